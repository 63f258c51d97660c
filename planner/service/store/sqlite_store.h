// OpenSqliteStore: the StateStore the planner daemon uses, in an embedded
// SQLite database file (Debian's libsqlite3), so that nodes, plans,
// deployments and step metrics survive a restart of the planner, also one
// by SIGKILL.
//
// Each message is stored as its serialized protobuf bytes, next to the
// columns that lists and look-ups are indexed by (name, create time, plan
// cache key, step and rank). A schema_version table records which of the
// store's schema migrations the file has had; opening a file runs the ones
// it lacks, in one transaction, and refuses a file from a newer planner.
//
// Durability: the journal is a write-ahead log (WAL), so readers do not
// block the writer and a commit is a single append. Every write call is one
// transaction; when it returns OK its data has been written into the WAL
// file with write(2), i.e. it is in the kernel's page cache, and survives
// the death of the process (SIGKILL, abort) with either `synchronous`
// setting. What the setting changes is a crash of the whole machine: with
// kNormal SQLite fsyncs only at checkpoints, so a power cut may lose the
// last commits (never corrupt the file); with kFull (the default) it also
// fsyncs the WAL at every commit. A planner writes little (registrations
// and heartbeats every few seconds a node, plan state changes, batches of
// step metrics), so one fsync per commit is cheap, and a deployment the
// planner acknowledged to a scheduler should not vanish with a reboot.
//
// Thread-safe: one connection, serialized by a mutex. Several processes
// may open the same file (SQLite's locks); a writer waits for another up to
// `busy_timeout`, then the call fails with Unavailable.
//
// Errors: every SQLite result code becomes a status in one place
// (sqlite_store.cc, SqliteStatus), with the file's path and what the store
// was doing: DataLoss for a corrupt file or one that is not a database,
// Unavailable for a busy database or a failing disk, ResourceExhausted for
// a full disk, PermissionDenied for a read-only one, FailedPrecondition for
// a path that cannot be opened or a schema from a newer planner.
#ifndef HAP_PLANNER_SERVICE_STORE_SQLITE_STORE_H_
#define HAP_PLANNER_SERVICE_STORE_SQLITE_STORE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "planner/service/store/state_store.h"

namespace hap::service::store {

struct SqliteStoreOptions {
  enum class Synchronous {
    kNormal,  // fsync at checkpoints: survives SIGKILL, may lose the last
              // commits on power loss
    kFull,    // fsync at every commit: survives power loss too
  };
  Synchronous synchronous = Synchronous::kFull;
  // How long a write waits for another process holding the database.
  absl::Duration busy_timeout = absl::Seconds(5);
};

// Opens (creating it if absent) the database at `path` and brings its
// schema up to date. ":memory:" is a private, non-durable database (tests).
absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStore(const std::string& path,
                                                            const SqliteStoreOptions& options = {});

}  // namespace hap::service::store

#endif  // HAP_PLANNER_SERVICE_STORE_SQLITE_STORE_H_
