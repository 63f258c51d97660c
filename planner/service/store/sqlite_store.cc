// SQLite's C API stays in this file. Its result codes become statuses in
// SqliteStatus() alone; statements are prepared once per connection and
// reset after every use by ScopedStatement.
#include "planner/service/store/sqlite_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message.h"
#include "google/protobuf/wire_format_lite.h"
#include "planner/service/store/sqlite_store_internal.h"
#include "planner/service/store/store_internal.h"

namespace hap::service::store {
namespace internal {

const std::vector<SchemaMigration>& SqliteSchemaMigrations() {
  // Messages are serialized hap.v1 protobufs in `body`; the other columns
  // are copies of their fields for ordering and look-ups. Names compare
  // bytewise (BINARY collation), like std::string in the in-memory store.
  static const auto* const kMigrations = new std::vector<SchemaMigration>{
      {1, R"sql(
        CREATE TABLE nodes (
          name TEXT PRIMARY KEY NOT NULL,
          body BLOB NOT NULL
        ) WITHOUT ROWID;

        CREATE TABLE plans (
          name TEXT PRIMARY KEY NOT NULL,
          create_seconds INTEGER NOT NULL,
          create_nanos INTEGER NOT NULL,
          cache_key TEXT,  -- NULL: none
          body BLOB NOT NULL
        );
        CREATE INDEX plans_by_create_time ON plans (create_seconds, create_nanos, name);
        CREATE INDEX plans_by_cache_key ON plans (cache_key, create_seconds, create_nanos, name)
          WHERE cache_key IS NOT NULL;

        CREATE TABLE deployments (
          name TEXT PRIMARY KEY NOT NULL,
          create_seconds INTEGER NOT NULL,
          create_nanos INTEGER NOT NULL,
          body BLOB NOT NULL
        );
        CREATE INDEX deployments_by_create_time
          ON deployments (create_seconds, create_nanos, name);

        CREATE TABLE step_metrics (
          deployment TEXT NOT NULL,
          step INTEGER NOT NULL,
          rank INTEGER NOT NULL,
          body BLOB NOT NULL,
          PRIMARY KEY (deployment, step, rank)
        ) WITHOUT ROWID;
      )sql"},
      {2, R"sql(
        CREATE TABLE jobs (
          name TEXT PRIMARY KEY NOT NULL,
          create_seconds INTEGER NOT NULL,
          create_nanos INTEGER NOT NULL,
          body BLOB NOT NULL
        );
        CREATE INDEX jobs_by_create_time ON jobs (create_seconds, create_nanos, name);
      )sql"},
      // A plan's summary (PlanSummary: no graph, program or rank programs),
      // what a starting planner reads; NULL in rows written before it (they
      // are read whole and summarised then).
      {3, R"sql(
        ALTER TABLE plans ADD COLUMN summary BLOB;
      )sql"},
      // The highest deployment generation of each plan ever stored, kept
      // when its deployments are deleted (LastDeploymentGeneration).
      {4, R"sql(
        CREATE TABLE deployment_generations (
          plan TEXT PRIMARY KEY NOT NULL,
          generation INTEGER NOT NULL
        ) WITHOUT ROWID;
      )sql"},
  };
  return *kMigrations;
}

}  // namespace internal

namespace {

namespace v1 = ::hap::v1;

// A serialized plan's bytes without its rank programs, graph and program
// fields (PlanSummary's, without parsing or copying the big fields): the
// top-level fields are walked in the wire format and copied or skipped.
absl::StatusOr<std::string> PlanSummaryBytes(absl::string_view body) {
  using google::protobuf::internal::WireFormatLite;
  std::string out;
  out.reserve(std::min<size_t>(body.size(), 4096));
  {
    google::protobuf::io::StringOutputStream sink(&out);
    google::protobuf::io::CodedOutputStream output(&sink);
    google::protobuf::io::CodedInputStream input(reinterpret_cast<const uint8_t*>(body.data()),
                                                 static_cast<int>(body.size()));
    input.SetTotalBytesLimit(std::numeric_limits<int>::max());
    while (true) {
      const uint32_t tag = input.ReadTag();
      if (tag == 0) break;
      const int field = WireFormatLite::GetTagFieldNumber(tag);
      const bool big = field == v1::Plan::kRankProgramsFieldNumber ||
                       field == v1::Plan::kGraphFieldNumber ||
                       field == v1::Plan::kProgramFieldNumber;
      const bool ok = big ? WireFormatLite::SkipField(&input, tag)
                          : WireFormatLite::SkipField(&input, tag, &output);
      if (!ok) return absl::DataLossError("its bytes are not a valid plan");
    }
    if (!input.ConsumedEntireMessage()) {
      return absl::DataLossError("its bytes are not a valid plan (they end inside a field)");
    }
  }
  return out;
}
using internal::CheckName;
using internal::CursorOf;
using internal::ListCursor;
using internal::ListKind;
using internal::NotFoundError;
using internal::SchemaMigration;

// The one place where a SQLite result code becomes a status. `rc` is an
// extended code (enabled on our connections); `db` (may be null) holds the
// detailed message of the call that failed.
absl::Status SqliteStatus(int rc, sqlite3* db, absl::string_view path, absl::string_view doing) {
  if (rc == SQLITE_OK || rc == SQLITE_ROW || rc == SQLITE_DONE) return absl::OkStatus();
  const char* detail = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  std::string msg =
      absl::StrCat("sqlite store '", path, "': ", doing, ": ", detail, " (sqlite code ", rc, ")");
  switch (rc & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:  // garbage where the database file should be
      return absl::DataLossError(
          absl::StrCat(msg, "; the file is damaged or not a planner database"));
    case SQLITE_BUSY:    // another process held the lock past busy_timeout
    case SQLITE_LOCKED:  // a conflict inside this process (shared cache)
    case SQLITE_PROTOCOL:
    case SQLITE_IOERR:  // the disk failed this operation; a retry may succeed
      return absl::UnavailableError(msg);
    case SQLITE_FULL:
    case SQLITE_NOMEM:
    case SQLITE_TOOBIG:  // a message larger than SQLite's row limit
      return absl::ResourceExhaustedError(msg);
    case SQLITE_PERM:
    case SQLITE_READONLY:
    case SQLITE_AUTH:
      return absl::PermissionDeniedError(msg);
    case SQLITE_CANTOPEN:  // e.g. its directory does not exist
      return absl::FailedPreconditionError(msg);
    case SQLITE_INTERRUPT:
      return absl::CancelledError(msg);
    case SQLITE_ABORT:
    case SQLITE_SCHEMA:  // the schema changed under a statement; retry
      return absl::AbortedError(msg);
    default:  // SQLITE_ERROR, MISUSE, RANGE, CONSTRAINT, ...: a bug of ours
      return absl::InternalError(msg);
  }
}

// Binds parameters (1-based, as SQLite numbers them), steps, and resets the
// statement and its bindings when it goes out of scope, so the next user
// finds it clean. Binding errors are kept and returned by the next Step().
class ScopedStatement {
 public:
  ScopedStatement(sqlite3_stmt* stmt, sqlite3* db, absl::string_view path)
      : stmt_(stmt), db_(db), path_(path) {}
  ~ScopedStatement() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  ScopedStatement(const ScopedStatement&) = delete;
  ScopedStatement& operator=(const ScopedStatement&) = delete;

  ScopedStatement& Text(int index, absl::string_view value) {
    return Bound(sqlite3_bind_text64(stmt_, index, value.data(), value.size(), SQLITE_TRANSIENT,
                                     SQLITE_UTF8));
  }
  // "" binds NULL.
  ScopedStatement& TextOrNull(int index, absl::string_view value) {
    return value.empty() ? Bound(sqlite3_bind_null(stmt_, index)) : Text(index, value);
  }
  ScopedStatement& Blob(int index, absl::string_view value) {
    return Bound(sqlite3_bind_blob64(stmt_, index, value.data(), value.size(), SQLITE_TRANSIENT));
  }
  ScopedStatement& Int(int index, int64_t value) {
    return Bound(sqlite3_bind_int64(stmt_, index, value));
  }

  // True when a row is ready, false when the statement is done.
  absl::StatusOr<bool> Step() {
    HAP_RETURN_IF_ERROR(bind_status_);
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqliteStatus(rc, db_, path_, sqlite3_sql(stmt_));
  }
  // Steps a statement that returns no rows.
  absl::Status Run() { return Step().status(); }

  absl::string_view ColumnBlob(int column) const {
    const void* data = sqlite3_column_blob(stmt_, column);
    int size = sqlite3_column_bytes(stmt_, column);
    return data == nullptr ? absl::string_view()
                           : absl::string_view(static_cast<const char*>(data), size);
  }
  int64_t ColumnInt(int column) const { return sqlite3_column_int64(stmt_, column); }

 private:
  ScopedStatement& Bound(int rc) {
    if (bind_status_.ok() && rc != SQLITE_OK) {
      bind_status_ = SqliteStatus(rc, db_, path_, absl::StrCat("binding ", sqlite3_sql(stmt_)));
    }
    return *this;
  }

  sqlite3_stmt* stmt_;
  sqlite3* db_;
  absl::string_view path_;
  absl::Status bind_status_;
};

class SqliteStore final : public StateStore {
 public:
  explicit SqliteStore(std::string path) : path_(std::move(path)) {}
  ~SqliteStore() override {
    for (sqlite3_stmt** stmt : AllStatements()) sqlite3_finalize(*stmt);
    // In WAL mode the last connection to close checkpoints the log into the
    // database file and removes it.
    if (db_ != nullptr) sqlite3_close_v2(db_);
  }

  absl::Status Open(const SqliteStoreOptions& options,
                    const std::vector<SchemaMigration>& migrations) {
    absl::MutexLock lock(&mu_);
    // NOMUTEX: mu_ serializes every use of the connection.
    int rc = sqlite3_open_v2(
        path_.c_str(), &db_,
        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_EXRESCODE,
        nullptr);
    HAP_RETURN_IF_ERROR(Check(rc, "opening the database"));
    sqlite3_extended_result_codes(db_, 1);
    int64_t busy_ms = absl::ToInt64Milliseconds(options.busy_timeout);
    HAP_RETURN_IF_ERROR(Check(sqlite3_busy_timeout(db_, static_cast<int>(std::min<int64_t>(
                                                            std::max<int64_t>(busy_ms, 0),
                                                            std::numeric_limits<int>::max()))),
                              "setting the busy timeout"));

    // The first statements read the file's header: a file that is not a
    // database fails here, with SQLITE_NOTADB.
    std::string journal_mode;
    HAP_RETURN_IF_ERROR(QueryText("PRAGMA journal_mode=WAL", &journal_mode));
    if (journal_mode != "wal" && journal_mode != "memory") {
      return absl::FailedPreconditionError(
          absl::StrCat("sqlite store '", path_, "': cannot use a write-ahead log (journal mode '",
                       journal_mode, "'); is the file on a file system without shared memory?"));
    }
    HAP_RETURN_IF_ERROR(Exec(options.synchronous == SqliteStoreOptions::Synchronous::kFull
                                 ? "PRAGMA synchronous=FULL"
                                 : "PRAGMA synchronous=NORMAL",
                             "setting synchronous"));
    HAP_RETURN_IF_ERROR(Migrate(migrations));
    return PrepareStatements();
  }

  // --- Nodes ---------------------------------------------------------------
  absl::Status UpsertNode(const v1::Node& node) override {
    HAP_RETURN_IF_ERROR(CheckName("node", node.name()));
    HAP_ASSIGN_OR_RETURN(std::string body, Serialize(node, "node"));
    absl::MutexLock lock(&mu_);
    return Use(s_.upsert_node).Text(1, node.name()).Blob(2, body).Run();
  }
  absl::StatusOr<v1::Node> GetNode(const std::string& name) override {
    return Get<v1::Node>(&SqliteStore::Statements::get_node, "node", name);
  }
  absl::StatusOr<Page<v1::Node>> ListNodes(int page_size, const std::string& page_token) override {
    return List<v1::Node>(ListKind::kNodes, &SqliteStore::Statements::list_nodes, "node", page_size,
                          page_token);
  }
  absl::Status DeleteNode(const std::string& name) override {
    return Delete(&SqliteStore::Statements::delete_node, "node", name);
  }

  // --- Plans ---------------------------------------------------------------
  absl::Status PutPlan(const v1::Plan& plan, const std::string& cache_key) override {
    HAP_RETURN_IF_ERROR(CheckName("plan", plan.name()));
    HAP_ASSIGN_OR_RETURN(std::string body, Serialize(plan, "plan"));
    HAP_ASSIGN_OR_RETURN(std::string summary, PlanSummaryBytes(body));
    PlanWrite w{&plan.name(), CursorOf(plan), &cache_key, &body, &summary, absl::OkStatus(), false};
    // Group commit: writes that arrive while one is being committed queue
    // up, and the next writer commits them all in one transaction (one
    // fsync with synchronous=FULL instead of one each). Each caller
    // returns once its own write is durable or has failed.
    absl::MutexLock batch_lock(&batch_mu_);
    pending_plans_.push_back(&w);
    while (!w.done) {
      if (!writing_plans_) {
        writing_plans_ = true;
        std::vector<PlanWrite*> batch;
        batch.swap(pending_plans_);
        batch_mu_.Unlock();
        WritePlans(batch);
        batch_mu_.Lock();
        for (PlanWrite* p : batch) p->done = true;
        writing_plans_ = false;
      } else {
        auto ready = [&w, this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_) {
          return w.done || !writing_plans_;
        };
        batch_mu_.Await(absl::Condition(&ready));
      }
    }
    return w.status;
  }
  absl::StatusOr<Page<v1::Plan>> ListPlanSummaries(int page_size,
                                                   const std::string& page_token) override {
    // Rows from before the summary column give the whole plan, whose big
    // fields are skipped in its bytes before it is parsed.
    return List<v1::Plan>(ListKind::kPlans, &SqliteStore::Statements::list_summaries,
                          "plan summary", page_size, page_token, &PlanSummaryBytes);
  }
  absl::StatusOr<v1::Plan> GetPlan(const std::string& name) override {
    return Get<v1::Plan>(&SqliteStore::Statements::get_plan, "plan", name);
  }
  absl::StatusOr<Page<v1::Plan>> ListPlans(int page_size, const std::string& page_token) override {
    return List<v1::Plan>(ListKind::kPlans, &SqliteStore::Statements::list_plans, "plan", page_size,
                          page_token);
  }
  absl::Status DeletePlan(const std::string& name) override {
    return Delete(&SqliteStore::Statements::delete_plan, "plan", name);
  }
  absl::StatusOr<v1::Plan> FindPlanByCacheKey(const std::string& cache_key) override {
    HAP_RETURN_IF_ERROR(internal::CheckCacheKey(cache_key));
    absl::MutexLock lock(&mu_);
    ScopedStatement st = Use(s_.find_plan_by_cache_key);
    st.Text(1, cache_key);
    HAP_ASSIGN_OR_RETURN(bool found, st.Step());
    if (!found) return NotFoundError("plan with cache key", cache_key);
    return ParseKeyed<v1::Plan>(st.ColumnBlob(0), "plan", st.ColumnBlob(1));
  }

  // --- Deployments ---------------------------------------------------------
  absl::Status PutDeployment(const v1::Deployment& deployment) override {
    HAP_RETURN_IF_ERROR(CheckName("deployment", deployment.name()));
    HAP_ASSIGN_OR_RETURN(std::string body, Serialize(deployment, "deployment"));
    ListCursor at = CursorOf(deployment);
    absl::MutexLock lock(&mu_);
    Transaction txn(this);
    HAP_RETURN_IF_ERROR(txn.Begin());
    HAP_RETURN_IF_ERROR(Use(s_.put_deployment)
                            .Text(1, deployment.name())
                            .Int(2, at.seconds)
                            .Int(3, at.nanos)
                            .Blob(4, body)
                            .Run());
    HAP_RETURN_IF_ERROR(Use(s_.put_deployment_generation)
                            .Text(1, deployment.plan())
                            .Int(2, deployment.generation())
                            .Run());
    return txn.Commit();
  }
  absl::StatusOr<int64_t> LastDeploymentGeneration(const std::string& plan) override {
    HAP_RETURN_IF_ERROR(CheckName("plan", plan));
    absl::MutexLock lock(&mu_);
    ScopedStatement st = Use(s_.last_deployment_generation);
    st.Text(1, plan);
    HAP_ASSIGN_OR_RETURN(bool row, st.Step());
    return row ? st.ColumnInt(0) : int64_t{0};
  }
  absl::StatusOr<v1::Deployment> GetDeployment(const std::string& name) override {
    return Get<v1::Deployment>(&SqliteStore::Statements::get_deployment, "deployment", name);
  }
  absl::StatusOr<Page<v1::Deployment>> ListDeployments(int page_size,
                                                       const std::string& page_token) override {
    return List<v1::Deployment>(ListKind::kDeployments, &SqliteStore::Statements::list_deployments,
                                "deployment", page_size, page_token);
  }
  absl::Status DeleteDeployment(const std::string& name) override {
    HAP_RETURN_IF_ERROR(CheckName("deployment", name));
    absl::MutexLock lock(&mu_);
    Transaction txn(this);
    HAP_RETURN_IF_ERROR(txn.Begin());
    HAP_RETURN_IF_ERROR(Use(s_.delete_deployment).Text(1, name).Run());
    if (sqlite3_changes(db_) == 0) return NotFoundError("deployment", name);
    HAP_RETURN_IF_ERROR(Use(s_.delete_step_metrics).Text(1, name).Run());
    return txn.Commit();
  }

  // --- Step metrics --------------------------------------------------------
  absl::Status AppendStepMetrics(const std::string& deployment,
                                 const std::vector<v1::StepMetric>& metrics) override {
    HAP_ASSIGN_OR_RETURN(std::vector<v1::StepMetric> prepared,
                         internal::PrepareStepMetrics(deployment, metrics));
    std::vector<std::string> bodies;
    bodies.reserve(prepared.size());
    for (const v1::StepMetric& m : prepared) {
      HAP_ASSIGN_OR_RETURN(bodies.emplace_back(), Serialize(m, "step metric"));
    }
    absl::MutexLock lock(&mu_);
    Transaction txn(this);
    HAP_RETURN_IF_ERROR(txn.Begin());
    HAP_RETURN_IF_ERROR(RequireDeployment(deployment));
    for (size_t i = 0; i < prepared.size(); ++i) {
      HAP_RETURN_IF_ERROR(Use(s_.put_step_metric)
                              .Text(1, deployment)
                              .Int(2, prepared[i].step())
                              .Int(3, prepared[i].rank())
                              .Blob(4, bodies[i])
                              .Run());
    }
    return txn.Commit();
  }
  absl::StatusOr<std::vector<v1::StepMetric>> ListStepMetrics(const std::string& deployment,
                                                              int64_t from_step,
                                                              int limit) override {
    HAP_ASSIGN_OR_RETURN(limit, internal::StepMetricsLimit(deployment, limit));
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(RequireDeployment(deployment));
    ScopedStatement st = Use(s_.list_step_metrics);
    st.Text(1, deployment).Int(2, from_step).Int(3, limit);
    std::vector<v1::StepMetric> out;
    while (true) {
      HAP_ASSIGN_OR_RETURN(bool row, st.Step());
      if (!row) break;
      const std::string key =
          absl::StrCat(deployment, " step ", st.ColumnInt(1), " rank ", st.ColumnInt(2));
      HAP_ASSIGN_OR_RETURN(v1::StepMetric m,
                           Parse<v1::StepMetric>(st.ColumnBlob(0), "step metric", key));
      if (m.deployment() != deployment || m.step() != st.ColumnInt(1) ||
          m.rank() != st.ColumnInt(2)) {
        return Damaged(
            "step metric", key,
            absl::StrCat("holds ", m.deployment(), " step ", m.step(), " rank ", m.rank()));
      }
      out.push_back(std::move(m));
    }
    return out;
  }

  absl::StatusOr<int64_t> LastStepMetricStep(const std::string& deployment) override {
    HAP_RETURN_IF_ERROR(CheckName("deployment", deployment));
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(RequireDeployment(deployment));
    ScopedStatement st = Use(s_.last_step_metric_step);
    st.Text(1, deployment);
    HAP_ASSIGN_OR_RETURN(bool row, st.Step());
    return row ? st.ColumnInt(0) : int64_t{-1};
  }

  absl::Status DeleteStepMetrics(const std::string& deployment, int64_t from_step,
                                 int64_t to_step) override {
    HAP_RETURN_IF_ERROR(CheckName("deployment", deployment));
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(RequireDeployment(deployment));
    if (from_step >= to_step) return absl::OkStatus();
    return Use(s_.delete_step_metrics_range)
        .Text(1, deployment)
        .Int(2, from_step)
        .Int(3, to_step)
        .Run();
  }

  // --- Jobs ----------------------------------------------------------------
  absl::Status PutJob(const v1::Job& job) override {
    HAP_RETURN_IF_ERROR(CheckName("job", job.name()));
    HAP_ASSIGN_OR_RETURN(std::string body, Serialize(job, "job"));
    ListCursor at = CursorOf(job);
    absl::MutexLock lock(&mu_);
    return Use(s_.put_job).Text(1, job.name()).Int(2, at.seconds).Int(3, at.nanos).Blob(4, body).Run();
  }
  absl::StatusOr<v1::Job> GetJob(const std::string& name) override {
    return Get<v1::Job>(&SqliteStore::Statements::get_job, "job", name);
  }
  absl::StatusOr<Page<v1::Job>> ListJobs(int page_size, const std::string& page_token) override {
    return List<v1::Job>(ListKind::kJobs, &SqliteStore::Statements::list_jobs, "job", page_size,
                         page_token);
  }
  absl::Status DeleteJob(const std::string& name) override {
    return Delete(&SqliteStore::Statements::delete_job, "job", name);
  }

 private:
  // Prepared once, used under mu_.
  struct Statements {
    sqlite3_stmt* begin = nullptr;
    sqlite3_stmt* commit = nullptr;
    sqlite3_stmt* rollback = nullptr;
    sqlite3_stmt* upsert_node = nullptr;
    sqlite3_stmt* get_node = nullptr;
    sqlite3_stmt* list_nodes = nullptr;
    sqlite3_stmt* delete_node = nullptr;
    sqlite3_stmt* put_plan = nullptr;
    sqlite3_stmt* get_plan = nullptr;
    sqlite3_stmt* list_plans = nullptr;
    sqlite3_stmt* list_summaries = nullptr;
    sqlite3_stmt* delete_plan = nullptr;
    sqlite3_stmt* find_plan_by_cache_key = nullptr;
    sqlite3_stmt* put_deployment = nullptr;
    sqlite3_stmt* put_deployment_generation = nullptr;
    sqlite3_stmt* last_deployment_generation = nullptr;
    sqlite3_stmt* get_deployment = nullptr;
    sqlite3_stmt* list_deployments = nullptr;
    sqlite3_stmt* delete_deployment = nullptr;
    sqlite3_stmt* put_step_metric = nullptr;
    sqlite3_stmt* list_step_metrics = nullptr;
    sqlite3_stmt* last_step_metric_step = nullptr;
    sqlite3_stmt* delete_step_metrics = nullptr;
    sqlite3_stmt* delete_step_metrics_range = nullptr;
    sqlite3_stmt* put_job = nullptr;
    sqlite3_stmt* get_job = nullptr;
    sqlite3_stmt* list_jobs = nullptr;
    sqlite3_stmt* delete_job = nullptr;
  };
  using StatementField = sqlite3_stmt* Statements::*;

  // Lists bind ?1 seconds, ?2 nanos, ?3 name of the cursor to start after
  // and ?4 how many rows to read (nodes use only the name); they select
  // body, name, create seconds, create nanos (0, 0 for nodes).
  struct StatementSql {
    StatementField field;
    const char* sql;
  };
  static constexpr StatementSql kStatementSql[] = {
      // IMMEDIATE: take the write lock now, so that a transaction never
      // fails half-way because another process started writing.
      {&Statements::begin, "BEGIN IMMEDIATE"},
      {&Statements::commit, "COMMIT"},
      {&Statements::rollback, "ROLLBACK"},
      {&Statements::upsert_node, "INSERT OR REPLACE INTO nodes (name, body) VALUES (?1, ?2)"},
      {&Statements::get_node, "SELECT body FROM nodes WHERE name = ?1"},
      {&Statements::list_nodes,
       "SELECT body, name, 0, 0 FROM nodes WHERE name > ?3 ORDER BY name LIMIT ?4"},
      {&Statements::delete_node, "DELETE FROM nodes WHERE name = ?1"},
      {&Statements::put_plan,
       "INSERT OR REPLACE INTO plans (name, create_seconds, create_nanos, cache_key, body,"
       " summary) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"},
      {&Statements::list_summaries,
       "SELECT COALESCE(summary, body), name, create_seconds, create_nanos FROM plans"
       " WHERE (create_seconds, create_nanos, name) > (?1, ?2, ?3)"
       " ORDER BY create_seconds, create_nanos, name LIMIT ?4"},
      {&Statements::get_plan, "SELECT body FROM plans WHERE name = ?1"},
      {&Statements::list_plans,
       "SELECT body, name, create_seconds, create_nanos FROM plans WHERE (create_seconds, "
       "create_nanos, name) > (?1, ?2, ?3)"
       " ORDER BY create_seconds, create_nanos, name LIMIT ?4"},
      {&Statements::delete_plan, "DELETE FROM plans WHERE name = ?1"},
      {&Statements::find_plan_by_cache_key,
       "SELECT body, name FROM plans WHERE cache_key = ?1"
       " ORDER BY create_seconds DESC, create_nanos DESC, name DESC LIMIT 1"},
      {&Statements::put_deployment,
       "INSERT OR REPLACE INTO deployments (name, create_seconds, create_nanos, body)"
       " VALUES (?1, ?2, ?3, ?4)"},
      {&Statements::get_deployment, "SELECT body FROM deployments WHERE name = ?1"},
      {&Statements::list_deployments,
       "SELECT body, name, create_seconds, create_nanos FROM deployments WHERE (create_seconds, "
       "create_nanos, name) > (?1, ?2, "
       "?3)"
       " ORDER BY create_seconds, create_nanos, name LIMIT ?4"},
      {&Statements::delete_deployment, "DELETE FROM deployments WHERE name = ?1"},
      {&Statements::put_deployment_generation,
       "INSERT INTO deployment_generations (plan, generation) VALUES (?1, ?2)"
       " ON CONFLICT (plan) DO UPDATE SET generation = max(generation, excluded.generation)"},
      {&Statements::last_deployment_generation,
       "SELECT generation FROM deployment_generations WHERE plan = ?1"},
      {&Statements::put_step_metric,
       "INSERT OR REPLACE INTO step_metrics (deployment, step, rank, body)"
       " VALUES (?1, ?2, ?3, ?4)"},
      {&Statements::list_step_metrics,
       "SELECT body, step, rank FROM step_metrics WHERE deployment = ?1 AND step >= ?2"
       " ORDER BY step, rank LIMIT ?3"},
      {&Statements::last_step_metric_step,
       "SELECT step FROM step_metrics WHERE deployment = ?1 ORDER BY step DESC LIMIT 1"},
      {&Statements::delete_step_metrics, "DELETE FROM step_metrics WHERE deployment = ?1"},
      {&Statements::delete_step_metrics_range,
       "DELETE FROM step_metrics WHERE deployment = ?1 AND step >= ?2 AND step < ?3"},
      {&Statements::put_job,
       "INSERT OR REPLACE INTO jobs (name, create_seconds, create_nanos, body)"
       " VALUES (?1, ?2, ?3, ?4)"},
      {&Statements::get_job, "SELECT body FROM jobs WHERE name = ?1"},
      {&Statements::list_jobs,
       "SELECT body, name, create_seconds, create_nanos FROM jobs WHERE (create_seconds, "
       "create_nanos, name) > (?1, ?2, ?3)"
       " ORDER BY create_seconds, create_nanos, name LIMIT ?4"},
      {&Statements::delete_job, "DELETE FROM jobs WHERE name = ?1"},
  };

  std::vector<sqlite3_stmt**> AllStatements() {
    std::vector<sqlite3_stmt**> all;
    for (const StatementSql& s : kStatementSql) all.push_back(&(s_.*(s.field)));
    return all;
  }

  // Rolls back unless committed.
  class Transaction {
   public:
    explicit Transaction(SqliteStore* store) : store_(store) {}
    ~Transaction() {
      if (open_) (void)store_->Use(store_->s_.rollback).Run();
    }
    absl::Status Begin() {
      HAP_RETURN_IF_ERROR(store_->Use(store_->s_.begin).Run());
      open_ = true;
      return absl::OkStatus();
    }
    absl::Status Commit() {
      HAP_RETURN_IF_ERROR(store_->Use(store_->s_.commit).Run());
      open_ = false;
      return absl::OkStatus();
    }

   private:
    SqliteStore* store_;
    bool open_ = false;
  };

  absl::Status Check(int rc, absl::string_view doing) const {
    return SqliteStatus(rc, db_, path_, doing);
  }

  ScopedStatement Use(sqlite3_stmt* stmt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ScopedStatement(stmt, db_, path_);
  }

  // Runs SQL (several statements allowed) that returns no rows we need.
  absl::Status Exec(const char* sql, absl::string_view doing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Check(sqlite3_exec(db_, sql, nullptr, nullptr, nullptr), doing);
  }

  // Runs a one-statement query and returns the first column of its first
  // row as text ("" when no row).
  absl::Status QueryText(const char* sql, std::string* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sqlite3_stmt* stmt = nullptr;
    HAP_RETURN_IF_ERROR(Check(sqlite3_prepare_v2(db_, sql, -1, &stmt, nullptr), sql));
    absl::Status status;
    {
      ScopedStatement st(stmt, db_, path_);
      absl::StatusOr<bool> row = st.Step();
      if (!row.ok()) {
        status = row.status();
      } else if (*row) {
        const unsigned char* text = sqlite3_column_text(stmt, 0);
        *out = text == nullptr ? "" : reinterpret_cast<const char*>(text);
      } else {
        out->clear();
      }
    }
    sqlite3_finalize(stmt);
    return status;
  }

  absl::Status Migrate(const std::vector<SchemaMigration>& migrations)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = 0; i < migrations.size(); ++i) {
      if (migrations[i].version != static_cast<int>(i) + 1) {
        return absl::InternalError(absl::StrCat("schema migration ", i, " has version ",
                                                migrations[i].version, ", want ", i + 1));
      }
    }
    const int latest = static_cast<int>(migrations.size());
    HAP_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "starting the schema migration"));
    absl::Status status = MigrateInTransaction(migrations, latest);
    if (!status.ok()) {
      (void)Exec("ROLLBACK", "rolling back the schema migration");
      return status;
    }
    return Exec("COMMIT", "committing the schema migration");
  }

  absl::Status MigrateInTransaction(const std::vector<SchemaMigration>& migrations, int latest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A database without our version table is new to the planner: one
    // that holds tables already is another program's, not to be written
    // into (nor its tables of our names taken for ours).
    std::string ours, theirs;
    HAP_RETURN_IF_ERROR(QueryText(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'", &ours));
    if (ours.empty()) {
      HAP_RETURN_IF_ERROR(
          QueryText("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE "
                    "'sqlite\\_%' ESCAPE '\\' ORDER BY name LIMIT 1",
                    &theirs));
    }
    if (!theirs.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sqlite store '", path_, "' holds tables of another program (such as '", theirs,
          "') and no planner schema: give the planner a database file of its own"));
    }
    HAP_RETURN_IF_ERROR(Exec("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
                             "creating the schema_version table"));
    std::string text;
    HAP_RETURN_IF_ERROR(QueryText("SELECT version FROM schema_version", &text));
    int version = 0;
    if (!text.empty() && !absl::SimpleAtoi(text, &version)) {
      return absl::DataLossError(absl::StrCat("sqlite store '", path_, "': schema_version holds '",
                                              text, "', not a number"));
    }
    if (version > latest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sqlite store '", path_, "': the database has schema version ", version,
          ", newer than this planner's ", latest, "; run a newer planner or another file"));
    }
    if (version == latest) return absl::OkStatus();
    for (const SchemaMigration& m : migrations) {
      if (m.version <= version) continue;
      HAP_RETURN_IF_ERROR(Exec(m.sql, absl::StrCat("migrating the schema to version ", m.version)));
    }
    HAP_RETURN_IF_ERROR(Exec("DELETE FROM schema_version", "recording the schema version"));
    return Exec(absl::StrCat("INSERT INTO schema_version (version) VALUES (", latest, ")").c_str(),
                "recording the schema version");
  }

  absl::Status PrepareStatements() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const StatementSql& s : kStatementSql) {
      HAP_RETURN_IF_ERROR(Check(
          sqlite3_prepare_v3(db_, s.sql, -1, SQLITE_PREPARE_PERSISTENT, &(s_.*(s.field)), nullptr),
          absl::StrCat("preparing ", s.sql)));
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<std::string> Serialize(const google::protobuf::Message& m,
                                               absl::string_view what) {
    std::string body;
    if (!m.SerializeToString(&body)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " cannot be serialized (", m.ByteSizeLong(), " bytes)"));
    }
    return body;
  }

  template <typename M>
  absl::StatusOr<M> Parse(absl::string_view body, absl::string_view what,
                          absl::string_view name) const {
    M m;
    if (!m.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
      return Damaged(what, name, absl::StrCat("does not parse as ", m.GetTypeName()));
    }
    return m;
  }
  // Parse, for a message stored under its name `key`: one whose name is
  // another (a row copied under a second key, or an empty body) would be a
  // second record of that name, or one with none.
  template <typename M>
  absl::StatusOr<M> ParseKeyed(absl::string_view body, absl::string_view what,
                               absl::string_view key) const {
    HAP_ASSIGN_OR_RETURN(M m, Parse<M>(body, what, key));
    if (m.name() != key) return Damaged(what, key, absl::StrCat("holds '", m.name(), "'"));
    return m;
  }
  absl::Status Damaged(absl::string_view what, absl::string_view name,
                       absl::string_view why) const {
    return absl::DataLossError(absl::StrCat("sqlite store '", path_, "': the stored ", what, " '",
                                            name, "' ", why, "; the database is damaged"));
  }

  absl::Status RequireDeployment(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ScopedStatement st = Use(s_.get_deployment);
    st.Text(1, name);
    HAP_ASSIGN_OR_RETURN(bool found, st.Step());
    return found ? absl::OkStatus() : NotFoundError("deployment", name);
  }

  template <typename M>
  absl::StatusOr<M> Get(StatementField stmt, absl::string_view what, const std::string& name) {
    HAP_RETURN_IF_ERROR(CheckName(what, name));
    absl::MutexLock lock(&mu_);
    ScopedStatement st = Use(s_.*stmt);
    st.Text(1, name);
    HAP_ASSIGN_OR_RETURN(bool found, st.Step());
    if (!found) return NotFoundError(what, name);
    return ParseKeyed<M>(st.ColumnBlob(0), what, name);
  }

  absl::Status Delete(StatementField stmt, absl::string_view what, const std::string& name) {
    HAP_RETURN_IF_ERROR(CheckName(what, name));
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(Use(s_.*stmt).Text(1, name).Run());
    if (sqlite3_changes(db_) == 0) return NotFoundError(what, name);
    return absl::OkStatus();
  }

  template <typename M>
  absl::StatusOr<Page<M>> List(
      ListKind kind, StatementField stmt, absl::string_view what, int page_size,
      const std::string& page_token,
      absl::StatusOr<std::string> (*filter)(absl::string_view body) = nullptr) {
    HAP_ASSIGN_OR_RETURN(internal::PageRequest request,
                         internal::ParsePageRequest(kind, page_size, page_token));
    absl::MutexLock lock(&mu_);
    ScopedStatement st = Use(s_.*stmt);
    st.Int(1, request.after.seconds)
        .Int(2, request.after.nanos)
        .Text(3, request.after.name)
        .Int(4, int64_t{request.page_size} + 1);  // one more: is there a next page?
    // A damaged row stays in `rows` as a message holding only its place in
    // the list, so that the page (and its token) goes on past it.
    std::vector<M> rows;
    std::vector<std::pair<size_t, absl::Status>> damaged;
    while (true) {
      HAP_ASSIGN_OR_RETURN(bool row, st.Step());
      if (!row) break;
      const absl::string_view key = st.ColumnBlob(1);
      absl::StatusOr<M> m = ListedRow<M>(st.ColumnBlob(0), what, key, filter);
      if (m.ok()) {
        rows.push_back(*std::move(m));
        continue;
      }
      damaged.emplace_back(rows.size(), m.status());
      M& place = rows.emplace_back();
      place.set_name(std::string(key));
      if constexpr (!std::is_same_v<M, v1::Node>) {  // nodes are listed by name alone
        place.mutable_create_time()->set_seconds(st.ColumnInt(2));
        place.mutable_create_time()->set_nanos(static_cast<int32_t>(st.ColumnInt(3)));
      }
    }
    Page<M> page = internal::FinishPage(kind, request, std::move(rows));
    for (auto it = damaged.rbegin(); it != damaged.rend(); ++it) {
      if (it->first >= page.items.size()) continue;  // the look-ahead row
      page.items.erase(page.items.begin() + it->first);
      page.damaged.insert(page.damaged.begin(), std::move(it->second));
    }
    return page;
  }
  // One row of a list: its body, through `filter` when there is one.
  template <typename M>
  absl::StatusOr<M> ListedRow(absl::string_view body, absl::string_view what, absl::string_view key,
                              absl::StatusOr<std::string> (*filter)(absl::string_view body)) const {
    if (filter == nullptr) return ParseKeyed<M>(body, what, key);
    absl::StatusOr<std::string> kept = filter(body);
    if (!kept.ok())
      return Damaged(what, key, absl::StrCat("is unreadable: ", kept.status().message()));
    return ParseKeyed<M>(*kept, what, key);
  }

  // A PutPlan waiting for its group commit (the pointers are the caller's).
  struct PlanWrite {
    const std::string* name;
    ListCursor at;
    const std::string* cache_key;
    const std::string* body;
    const std::string* summary;
    absl::Status status;
    bool done = false;
  };

  absl::Status InsertPlan(const PlanWrite& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Use(s_.put_plan)
        .Text(1, *w.name)
        .Int(2, w.at.seconds)
        .Int(3, w.at.nanos)
        .TextOrNull(4, *w.cache_key)
        .Blob(5, *w.body)
        .Blob(6, *w.summary)
        .Run();
  }

  // Writes `batch`, setting each write's status: one transaction for all;
  // where any part of it fails, nothing of it stays and each write is made
  // again on its own, so that every status is that write's own.
  void WritePlans(const std::vector<PlanWrite*>& batch) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (batch.size() > 1) {
      Transaction txn(this);
      absl::Status s = txn.Begin();
      for (size_t i = 0; s.ok() && i < batch.size(); ++i) s = InsertPlan(*batch[i]);
      if (s.ok()) s = txn.Commit();
      if (s.ok()) {
        for (PlanWrite* w : batch) w->status = absl::OkStatus();
        return;
      }
    }  // (rolled back unless committed)
    for (PlanWrite* w : batch) w->status = InsertPlan(*w);
  }

  const std::string path_;
  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_) = nullptr;
  Statements s_ ABSL_GUARDED_BY(mu_);
  // Group commit of PutPlan (see there).
  absl::Mutex batch_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<PlanWrite*> pending_plans_ ABSL_GUARDED_BY(batch_mu_);
  bool writing_plans_ ABSL_GUARDED_BY(batch_mu_) = false;
};

}  // namespace

namespace internal {

absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStoreWithMigrations(
    const std::string& path, const SqliteStoreOptions& options,
    const std::vector<SchemaMigration>& migrations) {
  auto store = std::make_unique<SqliteStore>(path);
  HAP_RETURN_IF_ERROR(store->Open(options, migrations));
  return std::unique_ptr<StateStore>(std::move(store));
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStore(const std::string& path,
                                                            const SqliteStoreOptions& options) {
  return internal::OpenSqliteStoreWithMigrations(path, options, internal::SqliteSchemaMigrations());
}

}  // namespace hap::service::store
