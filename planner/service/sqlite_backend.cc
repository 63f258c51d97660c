// The planner's state in SQLite: one table per resource kind, each row the
// serialized protobuf under its name. WAL journal with synchronous=FULL:
// a write acknowledged before a SIGKILL (or power loss) is there after a
// restart. SQLite's C API stays in this file; its codes become statuses in
// Check().
#include <sqlite3.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "planner/service/planner_server.h"
#include "planner/util/status_macros.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

constexpr int kSchemaVersion = 1;

class SqliteBackend : public StateBackend {
 public:
  ~SqliteBackend() override {
    if (db_) sqlite3_close(db_);
  }

  absl::Status Open(const std::string& path) {
    path_ = path;
    int rc = sqlite3_open_v2(path.c_str(), &db_,
                             SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                             nullptr);
    HAP_RETURN_IF_ERROR(Check(rc, "open"));
    sqlite3_busy_timeout(db_, 5000);
    HAP_RETURN_IF_ERROR(Exec("PRAGMA journal_mode=WAL"));
    HAP_RETURN_IF_ERROR(Exec("PRAGMA synchronous=FULL"));
    HAP_RETURN_IF_ERROR(Exec(
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER);"
        "CREATE TABLE IF NOT EXISTS nodes (name TEXT PRIMARY KEY, body BLOB NOT NULL);"
        "CREATE TABLE IF NOT EXISTS plans (name TEXT PRIMARY KEY, body BLOB NOT NULL);"
        "CREATE TABLE IF NOT EXISTS deployments (name TEXT PRIMARY KEY, body BLOB NOT NULL);"
        "CREATE TABLE IF NOT EXISTS step_metrics (id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " deployment TEXT NOT NULL, body BLOB NOT NULL);"
        "INSERT OR IGNORE INTO meta VALUES ('schema_version', 1);"));
    int64_t version = 0;
    HAP_RETURN_IF_ERROR(Query("SELECT value FROM meta WHERE key = 'schema_version'",
                              [&](sqlite3_stmt* st) {
                                version = sqlite3_column_int64(st, 0);
                                return absl::OkStatus();
                              }));
    if (version != kSchemaVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "database '", path, "' has schema version ", version, "; this planner reads ",
          kSchemaVersion));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Loaded> Load() override {
    Loaded l;
    HAP_RETURN_IF_ERROR(LoadTable("nodes", &l.nodes));
    HAP_RETURN_IF_ERROR(LoadTable("plans", &l.plans));
    HAP_RETURN_IF_ERROR(LoadTable("deployments", &l.deployments));
    HAP_RETURN_IF_ERROR(LoadTable("step_metrics ORDER BY id", &l.metrics));
    return l;
  }

  absl::Status SaveNode(const v1::Node& n) override { return Put("nodes", n.name(), n); }
  absl::Status SavePlan(const v1::Plan& p) override { return Put("plans", p.name(), p); }
  absl::Status SaveDeployment(const v1::Deployment& d) override {
    return Put("deployments", d.name(), d);
  }
  absl::Status DeletePlan(const std::string& name) override {
    absl::MutexLock l(&mu_);
    sqlite3_stmt* st = nullptr;
    HAP_RETURN_IF_ERROR(Check(
        sqlite3_prepare_v2(db_, "DELETE FROM plans WHERE name = ?", -1, &st, nullptr),
        "prepare delete"));
    sqlite3_bind_text(st, 1, name.data(), static_cast<int>(name.size()), SQLITE_TRANSIENT);
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    return Check(rc == SQLITE_DONE ? SQLITE_OK : rc, "delete plan");
  }
  absl::Status AppendStepMetrics(const std::vector<v1::StepMetric>& ms) override {
    absl::MutexLock l(&mu_);
    HAP_RETURN_IF_ERROR(ExecLocked("BEGIN"));
    for (const auto& m : ms) {
      absl::Status s = InsertLocked(
          "INSERT INTO step_metrics (deployment, body) VALUES (?, ?)", m.deployment(), m);
      if (!s.ok()) {
        (void)ExecLocked("ROLLBACK");
        return s;
      }
    }
    return ExecLocked("COMMIT");
  }

 private:
  absl::Status Check(int rc, const char* what) const {
    if (rc == SQLITE_OK || rc == SQLITE_ROW || rc == SQLITE_DONE) return absl::OkStatus();
    std::string msg = absl::StrCat("planner database '", path_, "': ", what, ": ",
                                   db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc));
    switch (rc & 0xff) {
      case SQLITE_BUSY:
      case SQLITE_LOCKED:
        return absl::UnavailableError(msg);
      case SQLITE_FULL:
        return absl::ResourceExhaustedError(msg);
      case SQLITE_CORRUPT:
      case SQLITE_NOTADB:
        return absl::DataLossError(msg);
      case SQLITE_CANTOPEN:
      case SQLITE_PERM:
      case SQLITE_READONLY:
        return absl::PermissionDeniedError(msg);
      default:
        return absl::InternalError(msg);
    }
  }
  absl::Status Exec(const char* sql) {
    absl::MutexLock l(&mu_);
    return ExecLocked(sql);
  }
  absl::Status ExecLocked(const char* sql) {
    char* err = nullptr;
    int rc = sqlite3_exec(db_, sql, nullptr, nullptr, &err);
    sqlite3_free(err);
    return Check(rc, sql);
  }
  absl::Status InsertLocked(const char* sql, const std::string& key,
                            const google::protobuf::Message& m) {
    std::string body = m.SerializeAsString();
    sqlite3_stmt* st = nullptr;
    HAP_RETURN_IF_ERROR(Check(sqlite3_prepare_v2(db_, sql, -1, &st, nullptr), "prepare"));
    sqlite3_bind_text(st, 1, key.data(), static_cast<int>(key.size()), SQLITE_TRANSIENT);
    sqlite3_bind_blob(st, 2, body.data(), static_cast<int>(body.size()), SQLITE_TRANSIENT);
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    return Check(rc == SQLITE_DONE ? SQLITE_OK : rc, "write");
  }
  absl::Status Put(const char* table, const std::string& name,
                   const google::protobuf::Message& m) {
    absl::MutexLock l(&mu_);
    return InsertLocked(
        absl::StrCat("INSERT OR REPLACE INTO ", table, " (name, body) VALUES (?, ?)").c_str(),
        name, m);
  }
  absl::Status Query(const std::string& sql,
                     const std::function<absl::Status(sqlite3_stmt*)>& row) {
    absl::MutexLock l(&mu_);
    sqlite3_stmt* st = nullptr;
    HAP_RETURN_IF_ERROR(Check(sqlite3_prepare_v2(db_, sql.c_str(), -1, &st, nullptr), "query"));
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
      absl::Status s = row(st);
      if (!s.ok()) {
        sqlite3_finalize(st);
        return s;
      }
    }
    sqlite3_finalize(st);
    return Check(rc, "read");
  }
  template <typename M>
  absl::Status LoadTable(const std::string& table, std::vector<M>* out) {
    return Query(absl::StrCat("SELECT body FROM ", table), [&](sqlite3_stmt* st) {
      M m;
      const void* b = sqlite3_column_blob(st, 0);
      int n = sqlite3_column_bytes(st, 0);
      if (!m.ParseFromArray(b, n)) {
        return absl::DataLossError(absl::StrCat("planner database '", path_, "': a row of ",
                                                table, " does not parse"));
      }
      out->push_back(std::move(m));
      return absl::OkStatus();
    });
  }

  absl::Mutex mu_;
  sqlite3* db_ = nullptr;
  std::string path_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateBackend>> OpenSqliteBackend(const std::string& path) {
  auto b = std::make_unique<SqliteBackend>();
  HAP_RETURN_IF_ERROR(b->Open(path));
  return std::unique_ptr<StateBackend>(std::move(b));
}

}  // namespace hap::service
