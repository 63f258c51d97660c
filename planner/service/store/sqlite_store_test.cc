// The SQLite store on disk: what survives closing, reopening and SIGKILL;
// damaged files; the schema version and its migrations. The contract common
// to all stores is in state_store_test.cc.
#include "planner/service/store/sqlite_store.h"

#include <signal.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/store/sqlite_store_internal.h"
#include "planner/service/store/test_util.h"

namespace hap::service::store {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::_;
using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::EqualsProto;
using ::testing::HasSubstr;
using testing::TestDeployment;
using testing::TestMetric;
using testing::TestNode;
using testing::TestPlan;

// Plain SQLite on the same file, to inspect or damage what the store wrote.
class RawDb {
 public:
  explicit RawDb(const std::string& path, bool create = false) {
    EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db_,
                              SQLITE_OPEN_READWRITE | (create ? SQLITE_OPEN_CREATE : 0), nullptr),
              SQLITE_OK);
  }
  ~RawDb() { sqlite3_close_v2(db_); }
  void Exec(const std::string& sql) {
    char* err = nullptr;
    EXPECT_EQ(sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK)
        << sql << ": " << (err ? err : "");
    sqlite3_free(err);
  }
  // The first column of the first row, as text.
  std::string Query(const std::string& sql) {
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    std::string out;
    if (stmt != nullptr && sqlite3_step(stmt) == SQLITE_ROW) {
      const unsigned char* text = sqlite3_column_text(stmt, 0);
      if (text != nullptr) out = reinterpret_cast<const char*>(text);
    }
    sqlite3_finalize(stmt);
    return out;
  }

 private:
  sqlite3* db_ = nullptr;
};

class SqliteStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::NewTempDir();
    ASSERT_NE(dir_, "");
    path_ = dir_ + "/state.db";
  }
  std::unique_ptr<StateStore> Open(const SqliteStoreOptions& options = {}) {
    absl::StatusOr<std::unique_ptr<StateStore>> store = OpenSqliteStore(path_, options);
    EXPECT_THAT(store, IsOk());
    return store.ok() ? std::move(*store) : nullptr;
  }
  // A closed database of 50 plans (closing checkpoints the log into the
  // file); its size in bytes, 0 on failure.
  off_t FileOf50Plans() {
    {
      std::unique_ptr<StateStore> store = Open();
      if (store == nullptr) return 0;
      for (int i = 0; i < 50; ++i) {
        EXPECT_THAT(store->PutPlan(TestPlan(absl::StrCat("plans/p", i), i), ""), IsOk());
      }
    }
    struct stat st;
    return stat(path_.c_str(), &st) == 0 ? st.st_size : 0;
  }
  // The first error of opening the file and listing its plans.
  absl::Status OpenAndListPlans() {
    absl::StatusOr<std::unique_ptr<StateStore>> store = OpenSqliteStore(path_);
    if (!store.ok()) return store.status();
    return (*store)->ListPlans(kMaxPageSize, "").status();
  }

  std::string dir_;
  std::string path_;
};

TEST_F(SqliteStoreTest, EverythingIsThereAfterReopening) {
  const v1::Node node = TestNode("nodes/a");
  const v1::Plan plan = TestPlan("plans/p", 10);
  const v1::Deployment deployment = TestDeployment("deployments/d", 11);
  std::string token;
  {
    std::unique_ptr<StateStore> store = Open();
    ASSERT_NE(store, nullptr);
    ASSERT_THAT(store->UpsertNode(node), IsOk());
    ASSERT_THAT(store->UpsertNode(TestNode("nodes/b")), IsOk());
    ASSERT_THAT(store->UpsertNode(TestNode("nodes/c")), IsOk());
    ASSERT_THAT(store->PutPlan(plan, "cache-key"), IsOk());
    ASSERT_THAT(store->PutDeployment(deployment), IsOk());
    ASSERT_THAT(
        store->AppendStepMetrics(deployment.name(), {TestMetric(0, 0, 2.5), TestMetric(0, 1, 2.5)}),
        IsOk());
    absl::StatusOr<Page<v1::Node>> page = store->ListNodes(1, "");
    ASSERT_THAT(page, IsOk());
    token = page->next_page_token;
  }
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  absl::StatusOr<v1::Node> got_node = store->GetNode("nodes/a");
  ASSERT_THAT(got_node, IsOk());
  EXPECT_THAT(*got_node, EqualsProto(node));
  absl::StatusOr<v1::Plan> got_plan = store->GetPlan("plans/p");
  ASSERT_THAT(got_plan, IsOk());
  EXPECT_THAT(*got_plan, EqualsProto(plan));
  absl::StatusOr<v1::Plan> cached = store->FindPlanByCacheKey("cache-key");
  ASSERT_THAT(cached, IsOk());
  EXPECT_THAT(*cached, EqualsProto(plan));
  absl::StatusOr<v1::Deployment> got_deployment = store->GetDeployment("deployments/d");
  ASSERT_THAT(got_deployment, IsOk());
  EXPECT_THAT(*got_deployment, EqualsProto(deployment));
  absl::StatusOr<std::vector<v1::StepMetric>> metrics =
      store->ListStepMetrics("deployments/d", 0, 10);
  ASSERT_THAT(metrics, IsOk());
  EXPECT_EQ(metrics->size(), 2u);
  // A page token from before the restart goes on where it left off.
  absl::StatusOr<Page<v1::Node>> rest = store->ListNodes(10, token);
  ASSERT_THAT(rest, IsOk());
  ASSERT_EQ(rest->items.size(), 2u);
  EXPECT_EQ(rest->items[0].name(), "nodes/b");
}

TEST_F(SqliteStoreTest, FileUsesWriteAheadLog) {
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_THAT(store->UpsertNode(TestNode("nodes/a")), IsOk());
  struct stat st;
  EXPECT_EQ(stat((path_ + "-wal").c_str(), &st), 0) << "no " << path_ << "-wal";
  RawDb raw(path_);
  EXPECT_EQ(raw.Query("PRAGMA journal_mode"), "wal");
  EXPECT_EQ(raw.Query("SELECT version FROM schema_version"),
            absl::StrCat(internal::SqliteSchemaMigrations().size()));
}

// Two store objects (as two processes would) on one file see each other's
// commits.
TEST_F(SqliteStoreTest, TwoConnectionsShareTheFile) {
  std::unique_ptr<StateStore> a = Open();
  std::unique_ptr<StateStore> b = Open();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_THAT(a->PutPlan(TestPlan("plans/p", 1), "k"), IsOk());
  absl::StatusOr<v1::Plan> got = b->FindPlanByCacheKey("k");
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->name(), "plans/p");
  ASSERT_THAT(b->DeletePlan("plans/p"), IsOk());
  EXPECT_THAT(a->GetPlan("plans/p"), StatusIs(absl::StatusCode::kNotFound, _));
}

// Plan writes from many threads are committed in groups (one transaction
// for the writes that queued while the last one was committed). Each
// caller gets its own write's verdict: a write the database refuses (here a
// trigger refuses one name) fails alone, the others in its group are kept.
TEST_F(SqliteStoreTest, ConcurrentPlanWritesAreGroupCommittedAndEachGetsItsOwnVerdict) {
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  {
    RawDb raw(path_);
    raw.Exec("CREATE TRIGGER refuse_bad BEFORE INSERT ON plans WHEN NEW.name = 'plans/bad' "
             "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;");
  }
  constexpr int kThreads = 8;
  constexpr int kWrites = 40;
  std::vector<std::thread> threads;
  std::vector<int> refused(kThreads, 0), failed(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kWrites; ++i) {
        // Every fifth write of thread 0 is the refused name; every thread
        // also rewrites one plan of its own (the last write must win).
        if (t == 0 && i % 5 == 0) {
          if (!store->PutPlan(TestPlan("plans/bad", i), "").ok()) ++refused[t];
          continue;
        }
        if (!store->PutPlan(TestPlan(absl::StrCat("plans/t", t, "-", i), i),
                            absl::StrCat("k", t, "-", i))
                 .ok()) {
          ++failed[t];
        }
        if (!store->PutPlan(TestPlan(absl::StrCat("plans/t", t), i), "").ok()) ++failed[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(refused[0], kWrites / 5);
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failed[t], 0) << "thread " << t;
  store.reset();
  store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(store->GetPlan("plans/bad"), StatusIs(absl::StatusCode::kNotFound, _));
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kWrites; ++i) {
      if (t == 0 && i % 5 == 0) continue;
      absl::StatusOr<v1::Plan> p = store->GetPlan(absl::StrCat("plans/t", t, "-", i));
      ASSERT_THAT(p, IsOk());
      EXPECT_EQ(p->create_time().seconds(), i);
    }
    absl::StatusOr<v1::Plan> last = store->GetPlan(absl::StrCat("plans/t", t));
    ASSERT_THAT(last, IsOk());
    EXPECT_EQ(last->create_time().seconds(), kWrites - 1);
  }
}

// A child process writes plans (and rewrites one node) and reports each
// commit through a pipe; the parent SIGKILLs it mid-stream. Every commit it
// reported must be there when the file is opened again — with either
// synchronous setting, since a killed process loses nothing the kernel has.
void CheckCommittedWritesSurviveSigkill(const std::string& path,
                                        SqliteStoreOptions::Synchronous synchronous) {
  constexpr int kKillAfter = 60;
  SqliteStoreOptions options;
  options.synchronous = synchronous;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // child: no gtest here, only _exit
    close(fds[0]);
    absl::StatusOr<std::unique_ptr<StateStore>> store = OpenSqliteStore(path, options);
    if (!store.ok()) _exit(2);
    for (int32_t i = 0; i < 1'000'000; ++i) {
      if (!(*store)->UpsertNode(TestNode("nodes/n", absl::StrCat("10.0.0.1:", i))).ok()) _exit(3);
      v1::Plan plan = TestPlan(absl::StrCat("plans/p", i), i);
      for (int d = 0; d < 64; ++d) plan.add_devices(absl::StrCat("node", d, "/cpu0"));
      if (!(*store)->PutPlan(plan, absl::StrCat("key", i)).ok()) _exit(4);
      if (write(fds[1], &i, sizeof i) != sizeof i) _exit(5);
    }
    _exit(6);  // not killed: the parent failed to
  }
  close(fds[1]);
  std::vector<int32_t> reported;
  int32_t i = 0;
  bool killed = false;
  // A 4-byte write to a pipe is atomic; read until the child is gone.
  while (read(fds[0], &i, sizeof i) == sizeof i) {
    reported.push_back(i);
    if (!killed && reported.size() == kKillAfter) {
      ASSERT_EQ(kill(pid, SIGKILL), 0);
      killed = true;
    }
  }
  close(fds[0]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(wstatus)) << "child exited with " << WEXITSTATUS(wstatus);
  ASSERT_EQ(WTERMSIG(wstatus), SIGKILL);
  ASSERT_GE(reported.size(), static_cast<size_t>(kKillAfter));

  absl::StatusOr<std::unique_ptr<StateStore>> store = OpenSqliteStore(path);
  ASSERT_THAT(store, IsOk());
  for (int32_t r : reported) {
    absl::StatusOr<v1::Plan> plan = (*store)->GetPlan(absl::StrCat("plans/p", r));
    ASSERT_THAT(plan, IsOk());
    EXPECT_EQ(plan->create_time().seconds(), r);
    EXPECT_THAT((*store)->FindPlanByCacheKey(absl::StrCat("key", r)), IsOk());
  }
  absl::StatusOr<v1::Node> node = (*store)->GetNode("nodes/n");
  ASSERT_THAT(node, IsOk());
  int32_t last_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(node->address().substr(node->address().rfind(':') + 1), &last_port));
  EXPECT_GE(last_port, reported.back());
  // Nothing torn: every stored plan parses, one at most beyond the reports.
  absl::StatusOr<Page<v1::Plan>> all = (*store)->ListPlans(kMaxPageSize, "");
  ASSERT_THAT(all, IsOk());
  EXPECT_GE(all->items.size(), reported.size());
  EXPECT_LE(all->items.size(), reported.size() + 1);
}

TEST_F(SqliteStoreTest, CommittedWritesSurviveSigkill) {
  CheckCommittedWritesSurviveSigkill(path_, SqliteStoreOptions::Synchronous::kFull);
}

TEST_F(SqliteStoreTest, CommittedWritesSurviveSigkillWithSynchronousNormal) {
  CheckCommittedWritesSurviveSigkill(path_, SqliteStoreOptions::Synchronous::kNormal);
}

TEST_F(SqliteStoreTest, GarbageFileIsDataLoss) {
  {
    std::ofstream out(path_, std::ios::binary);
    for (int i = 0; i < 8192; ++i) out.put(static_cast<char>((i * 37 + 11) & 0xff));
  }
  EXPECT_THAT(
      OpenSqliteStore(path_),
      StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr(path_), HasSubstr("not a database"))));
}

// Pages after the first overwritten: the header still says SQLite, the
// tables are garbage. Whichever call first reads them says DataLoss.
TEST_F(SqliteStoreTest, DamagedPagesAreDataLoss) {
  const off_t size = FileOf50Plans();
  ASSERT_GT(size, 4096 * 2);
  {
    std::fstream f(path_, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);
    for (off_t i = 4096; i < size; ++i) f.put(static_cast<char>(0xA5));
  }
  EXPECT_THAT(OpenAndListPlans(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path_)));
}

// A file cut short (a copy that did not finish, a disk that filled while
// it was copied): the pages past the end are gone. Whichever call first
// needs them says DataLoss naming the file; nothing reads as empty.
TEST_F(SqliteStoreTest, ATruncatedFileIsDataLoss) {
  const off_t size = FileOf50Plans();
  ASSERT_GT(size, 4096 * 4);
  ASSERT_EQ(truncate(path_.c_str(), size / 2), 0);
  EXPECT_THAT(OpenAndListPlans(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path_)));
}

TEST_F(SqliteStoreTest, RowThatDoesNotParseIsDataLoss) {
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_THAT(store->PutPlan(TestPlan("plans/p", 1), ""), IsOk());
  RawDb(path_).Exec("UPDATE plans SET body = X'FFFFFFFF' WHERE name = 'plans/p'");
  EXPECT_THAT(store->GetPlan("plans/p"),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("plan 'plans/p' does not parse"), HasSubstr(path_))));
  // A list leaves it out and names it, so that a starting planner loads
  // the rest.
  absl::StatusOr<Page<v1::Plan>> page = store->ListPlans(0, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_TRUE(page->items.empty());
  EXPECT_THAT(page->damaged, ElementsAre(StatusIs(absl::StatusCode::kDataLoss,
                                                  HasSubstr("plan 'plans/p' does not parse"))));
}

// A record a newer planner wrote, with a field this one does not know
// (field 999 = 1 appended to its bytes), reads and lists as it is, the
// field kept for when it is written back.
TEST_F(SqliteStoreTest, ARecordWithAFieldFromANewerPlannerReads) {
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_THAT(store->UpsertNode(TestNode("nodes/a")), IsOk());
  RawDb(path_).Exec("UPDATE nodes SET body = body || X'B83E01'");
  absl::StatusOr<v1::Node> node = store->GetNode("nodes/a");
  ASSERT_THAT(node, IsOk());
  EXPECT_EQ(node->GetReflection()->GetUnknownFields(*node).field_count(), 1);
  absl::StatusOr<Page<v1::Node>> page = store->ListNodes(0, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->items.size(), 1u);
  EXPECT_TRUE(page->damaged.empty());
  ASSERT_THAT(store->UpsertNode(*node), IsOk());
  node = store->GetNode("nodes/a");
  ASSERT_THAT(node, IsOk());
  EXPECT_EQ(node->GetReflection()->GetUnknownFields(*node).field_count(), 1);
}

// A row whose message names another record than its key (copied by hand,
// or an empty body, which parses as a message without a name) is damaged:
// loaded, it would be a second record of that name or one without any.
// Get says DataLoss naming both; lists leave it out, name it, and page on
// past it.
TEST_F(SqliteStoreTest, ARowWhoseMessageNamesAnotherRecordIsDataLossAndListsSkipIt) {
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_THAT(store->PutPlan(TestPlan("plans/a", 1), ""), IsOk());
  ASSERT_THAT(store->PutPlan(TestPlan("plans/c", 3), ""), IsOk());
  ASSERT_THAT(store->PutDeployment(TestDeployment("deployments/d", 1)), IsOk());
  ASSERT_THAT(store->UpsertNode(TestNode("nodes/n")), IsOk());
  {
    RawDb raw(path_);
    raw.Exec(
        "INSERT INTO plans SELECT 'plans/b', 2, 0, NULL, body, summary FROM plans"
        " WHERE name = 'plans/a'");
    raw.Exec("INSERT INTO deployments VALUES ('deployments/e', 2, 0, X'')");
    raw.Exec("INSERT INTO nodes SELECT 'nodes/m', body FROM nodes");
  }
  EXPECT_THAT(store->GetPlan("plans/b"),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path_), HasSubstr("plan 'plans/b' holds 'plans/a'"))));
  EXPECT_THAT(
      store->GetDeployment("deployments/e"),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("deployment 'deployments/e' holds ''")));
  EXPECT_THAT(store->GetNode("nodes/m"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("node 'nodes/m' holds 'nodes/n'")));

  // One row a page: the damaged one is a page of its own, and the next
  // token goes on past it.
  std::vector<std::string> names;
  std::vector<absl::Status> damaged;
  std::string token;
  do {
    absl::StatusOr<Page<v1::Plan>> page = store->ListPlanSummaries(1, token);
    ASSERT_THAT(page, IsOk());
    for (const v1::Plan& p : page->items) names.push_back(p.name());
    damaged.insert(damaged.end(), page->damaged.begin(), page->damaged.end());
    token = page->next_page_token;
  } while (!token.empty());
  EXPECT_THAT(names, ElementsAre("plans/a", "plans/c"));
  EXPECT_THAT(damaged, ElementsAre(StatusIs(absl::StatusCode::kDataLoss,
                                            HasSubstr("plan summary 'plans/b' holds 'plans/a'"))));
  absl::StatusOr<Page<v1::Deployment>> deployments = store->ListDeployments(0, "");
  ASSERT_THAT(deployments, IsOk());
  ASSERT_EQ(deployments->items.size(), 1u);
  EXPECT_EQ(deployments->items[0].name(), "deployments/d");
  EXPECT_THAT(deployments->damaged,
              ElementsAre(StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'deployments/e'"))));
  absl::StatusOr<Page<v1::Node>> nodes = store->ListNodes(0, "");
  ASSERT_THAT(nodes, IsOk());
  ASSERT_EQ(nodes->items.size(), 1u);
  EXPECT_EQ(nodes->items[0].name(), "nodes/n");
  EXPECT_THAT(nodes->damaged, ElementsAre(StatusIs(absl::StatusCode::kDataLoss,
                                                   HasSubstr("node 'nodes/m' holds 'nodes/n'"))));
}

// Rows written before the summary column (schema 3) have none: their
// summaries come from the whole plan's bytes, its big fields skipped.
TEST_F(SqliteStoreTest, PlansWithoutAStoredSummaryAreSummarisedWhenListed) {
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  v1::Plan plan = TestPlan("plans/p", 1);
  plan.set_state(v1::Plan::FAILED);
  plan.set_error("no fit");
  plan.add_rank_programs()->set_rank(0);
  plan.mutable_graph()->set_name("g");
  ASSERT_THAT(store->PutPlan(plan, ""), IsOk());
  RawDb(path_).Exec("UPDATE plans SET summary = NULL");
  absl::StatusOr<Page<v1::Plan>> page = store->ListPlanSummaries(0, "");
  ASSERT_THAT(page, IsOk());
  ASSERT_EQ(page->items.size(), 1u);
  EXPECT_THAT(page->items[0], EqualsProto(PlanSummary(plan)));
  EXPECT_EQ(page->items[0].error(), "no fit");
  // Bytes that are not a plan are DataLoss, naming the plan.
  RawDb(path_).Exec("UPDATE plans SET body = X'FFFFFFFF'");
  page = store->ListPlanSummaries(0, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_TRUE(page->items.empty());
  EXPECT_THAT(page->damaged,
              ElementsAre(StatusIs(absl::StatusCode::kDataLoss,
                                   AllOf(HasSubstr("'plans/p'"), HasSubstr("not a valid plan")))));
}

TEST_F(SqliteStoreTest, UnopenablePathIsFailedPrecondition) {
  const std::string path = dir_ + "/no/such/dir/state.db";
  EXPECT_THAT(OpenSqliteStore(path),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(path)));
}

TEST_F(SqliteStoreTest, SchemaFromANewerPlannerIsRefused) {
  ASSERT_NE(Open(), nullptr);
  RawDb(path_).Exec("UPDATE schema_version SET version = 99");
  EXPECT_THAT(OpenSqliteStore(path_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("schema version 99"), HasSubstr("newer"))));
}

// Another program's database (tables, none of the planner's) is refused,
// untouched: the planner added its tables beside the others', and a table
// of one of our names was taken for ours.
TEST_F(SqliteStoreTest, AnotherProgramsDatabaseIsRefusedUntouched) {
  RawDb(path_, /*create=*/true).Exec("CREATE TABLE plans (x INTEGER)");
  EXPECT_THAT(OpenSqliteStore(path_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path_), HasSubstr("tables of another program (such as "
                                                         "'plans') and no planner schema"))));
  EXPECT_EQ(RawDb(path_).Query("SELECT group_concat(name) FROM sqlite_master WHERE type = 'table'"),
            "plans");
  // An empty database file (sqlite3 made it, no tables) is the planner's.
  const std::string empty = dir_ + "/empty.db";
  RawDb(empty, /*create=*/true).Exec("PRAGMA user_version = 0");
  EXPECT_NE(OpenSqliteStore(empty).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SqliteStoreTest, MigrationsRunOnceEachAndAllOrNothing) {
  std::vector<internal::SchemaMigration> migrations = internal::SqliteSchemaMigrations();
  const int base = static_cast<int>(migrations.size());
  {
    std::unique_ptr<StateStore> store = Open();
    ASSERT_NE(store, nullptr);
    ASSERT_THAT(store->UpsertNode(TestNode("nodes/a")), IsOk());
  }
  // One more migration: it runs once (a second run would fail: the table
  // exists), and the data stays.
  migrations.push_back({base + 1, "CREATE TABLE extra (x INTEGER);"});
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<std::unique_ptr<StateStore>> store =
        internal::OpenSqliteStoreWithMigrations(path_, {}, migrations);
    ASSERT_THAT(store, IsOk());
    EXPECT_THAT((*store)->GetNode("nodes/a"), IsOk());
  }
  EXPECT_EQ(RawDb(path_).Query("SELECT version FROM schema_version"), absl::StrCat(base + 1));

  // A failing migration leaves the file as it was.
  migrations.push_back({base + 2, "CREATE TABLE extra2 (y INTEGER); CREATE TABLE extra (x);"});
  EXPECT_THAT(internal::OpenSqliteStoreWithMigrations(path_, {}, migrations),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr(absl::StrCat("migrating the schema to version ", base + 2))));
  {
    RawDb raw(path_);
    EXPECT_EQ(raw.Query("SELECT version FROM schema_version"), absl::StrCat(base + 1));
    EXPECT_EQ(raw.Query("SELECT count(*) FROM sqlite_master WHERE name = 'extra2'"), "0");
  }

  // Versions must count up from 1.
  std::vector<internal::SchemaMigration> gap = {{1, "SELECT 1;"}, {3, "SELECT 1;"}};
  EXPECT_THAT(internal::OpenSqliteStoreWithMigrations(dir_ + "/other.db", {}, gap),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("has version 3")));
}

// A database of schema version 3 (before deployment generations were kept)
// opens, gains the table, and keeps its deployments.
TEST_F(SqliteStoreTest, AVersion3DatabaseGainsDeploymentGenerations) {
  {
    std::unique_ptr<StateStore> store = Open();
    ASSERT_NE(store, nullptr);
  }
  // As a planner of schema version 3 left it.
  RawDb(path_).Exec("DROP TABLE deployment_generations; UPDATE schema_version SET version = 3");
  {
    RawDb raw(path_);
    EXPECT_EQ(raw.Query("SELECT version FROM schema_version"), "3");
    EXPECT_EQ(raw.Query("SELECT count(*) FROM sqlite_master WHERE name = "
                        "'deployment_generations'"),
              "0");
  }
  std::unique_ptr<StateStore> store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->LastDeploymentGeneration("plans/p").value_or(-1), 0);
  v1::Deployment d = TestDeployment("deployments/p-g4", 1);
  d.set_generation(4);
  ASSERT_THAT(store->PutDeployment(d), IsOk());
  EXPECT_EQ(store->LastDeploymentGeneration("plans/p").value_or(-1), 4);
  EXPECT_EQ(RawDb(path_).Query("SELECT version FROM schema_version"),
            absl::StrCat(internal::SqliteSchemaMigrations().size()));
}

TEST_F(SqliteStoreTest, InMemoryDatabasesArePrivate) {
  absl::StatusOr<std::unique_ptr<StateStore>> a = OpenSqliteStore(":memory:");
  absl::StatusOr<std::unique_ptr<StateStore>> b = OpenSqliteStore(":memory:");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT((*a)->UpsertNode(TestNode("nodes/a")), IsOk());
  EXPECT_THAT((*b)->GetNode("nodes/a"), StatusIs(absl::StatusCode::kNotFound, _));
}

}  // namespace
}  // namespace hap::service::store
