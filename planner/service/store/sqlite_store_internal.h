// The SQLite store's schema migrations, exposed for its tests: they open a
// store with a further migration to check the hook that upgrades old files.
// Not for use outside planner/service/store.
#ifndef HAP_PLANNER_SERVICE_STORE_SQLITE_STORE_INTERNAL_H_
#define HAP_PLANNER_SERVICE_STORE_SQLITE_STORE_INTERNAL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/service/store/sqlite_store.h"
#include "planner/service/store/state_store.h"

namespace hap::service::store::internal {

// Brings a file's schema from version - 1 to `version`: SQL statements run
// in the same transaction that records the new version, so a migration
// happens entirely or not at all. To change the schema, append one; never
// edit one that has shipped.
struct SchemaMigration {
  int version;
  const char* sql;
};

// This build's migrations, versions 1, 2, ... in order.
const std::vector<SchemaMigration>& SqliteSchemaMigrations();

// OpenSqliteStore with `migrations` in place of SqliteSchemaMigrations().
absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStoreWithMigrations(
    const std::string& path, const SqliteStoreOptions& options,
    const std::vector<SchemaMigration>& migrations);

}  // namespace hap::service::store::internal

#endif  // HAP_PLANNER_SERVICE_STORE_SQLITE_STORE_INTERNAL_H_
