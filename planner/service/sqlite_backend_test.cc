// The daemon's SQLite backend: what a restart loads back.
#include <sqlite3.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/planner_server.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempDatabase(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
  std::filesystem::remove(path);
  return path;
}

v1::Deployment MakeDeployment(const std::string& id) {
  v1::Deployment d;
  d.set_name("deployments/" + id);
  d.set_plan("plans/p");
  d.set_generation(1);
  d.set_state(v1::Deployment::PENDING);
  d.mutable_create_time()->set_seconds(1700000000);
  return d;
}

// Runs `sql` on the file with plain SQLite, as an operator's tool (or a
// damaged disk) would change it.
void RawExec(const std::string& db, const std::string& sql) {
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open_v2(db.c_str(), &raw, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
  char* err = nullptr;
  EXPECT_EQ(sqlite3_exec(raw, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK)
      << sql << ": " << (err != nullptr ? err : "");
  sqlite3_free(err);
  sqlite3_close_v2(raw);
}

PlannerServerOptions ServerOn(const std::string& db) {
  PlannerServerOptions o;
  o.database = db;
  o.metrics_port = -1;
  o.drain = absl::ZeroDuration();
  return o;
}

v1::StepMetric Metric(const std::string& deployment, int rank, int64_t step) {
  v1::StepMetric m;
  m.set_deployment(deployment);
  m.set_rank(rank);
  m.set_step(step);
  m.set_loss(1.0 / (step + 1));
  m.set_step_seconds(0.1);
  return m;
}

// A deployment that never reported a step (deployed to an unreachable
// executor) used to crash Load() with back() of an empty vector.
TEST(SqliteBackendTest, LoadsADeploymentWithoutStepMetrics) {
  const std::string db = TempDatabase("no_metrics.db");
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveDeployment(MakeDeployment("quiet")).ok());
  }
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto loaded = (*backend)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->deployments.size(), 1u);
  EXPECT_EQ(loaded->deployments[0].name(), "deployments/quiet");
  EXPECT_TRUE(loaded->metrics.empty());
}

// A long run's metrics: Load reads what the deployment manager keeps (the
// first ones, whole steps) and the latest steps, not every one stored.
// The latest steps are found in the metrics, not from the record's
// steps_completed: a RUNNING deployment's record is saved at its state
// changes, not with every metric, so after a restart it says 0 steps (the
// whole run's metrics were read then).
TEST(SqliteBackendTest, LoadReadsTheMetricsKeptAndTheLatestStepsOnly) {
  constexpr int64_t kSteps = 15'000;  // 30,000 metrics of 2 ranks
  for (const bool running : {false, true}) {
    SCOPED_TRACE(running ? "running, record saved at its start" : "succeeded");
    const std::string db = TempDatabase(running ? "long_run_running.db" : "long_run.db");
    {
      auto backend = OpenSqliteBackend(db);
      ASSERT_TRUE(backend.ok()) << backend.status();
      v1::Deployment d = MakeDeployment("long");
      d.set_state(running ? v1::Deployment::RUNNING : v1::Deployment::SUCCEEDED);
      d.set_steps_completed(running ? 0 : kSteps);
      ASSERT_TRUE((*backend)->SaveDeployment(d).ok());
      std::vector<v1::StepMetric> all;
      for (int64_t step = 0; step < kSteps; ++step) {
        for (int rank : {0, 1}) all.push_back(Metric(d.name(), rank, step));
      }
      ASSERT_TRUE((*backend)->AppendStepMetrics(all).ok());
    }
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto loaded = (*backend)->Load(/*max_metrics_per_deployment=*/100);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const std::vector<v1::StepMetric>& m = loaded->metrics;
    // One page (whole steps) from step 0, then the last 20 steps of both ranks.
    ASSERT_LT(m.size(), 12'000u);
    EXPECT_GE(m.size(), 100u + 40u);
    EXPECT_EQ(m.front().step(), 0);
    std::map<int64_t, int> ranks_of_step;
    for (const auto& x : m) ++ranks_of_step[x.step()];
    for (const auto& [step, ranks] : ranks_of_step) EXPECT_EQ(ranks, 2) << "step " << step;
    for (int64_t step = kSteps - kRecentStepsPerRank; step < kSteps; ++step) {
      EXPECT_EQ(ranks_of_step[step], 2) << "step " << step;
    }
    // (and up to kMaxRankLagSteps before them, for a rank behind the others)
    EXPECT_EQ(ranks_of_step.count(kSteps - kRecentStepsPerRank - kMaxRankLagSteps - 1), 0u);
    // The default reads them all here (fewer than 100,000).
    auto whole = (*backend)->Load();
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(whole->metrics.size(), 2u * kSteps);
  }
}

// A SUCCEEDED deployment of `ranks` ranks and `steps` steps (no supervisor:
// the tests report its metrics themselves).
v1::Deployment FinishedDeployment(const std::string& id, int ranks, int64_t steps) {
  v1::Deployment d = MakeDeployment(id);
  d.set_state(v1::Deployment::SUCCEEDED);
  d.mutable_training()->set_steps(steps);
  for (int r = 0; r < ranks; ++r) d.add_ranks()->set_rank(r);
  return d;
}

// A deployment manager saving to `sink`, keeping `kept` metrics in memory.
DeploymentManagerOptions ManagerOn(PlannerStateSink* sink, size_t kept) {
  DeploymentManagerOptions o;
  o.sink = sink;
  o.max_metrics_per_deployment = kept;
  o.executors = [](const v1::Deployment&) -> std::unique_ptr<DeploymentExecutors> {
    return nullptr;
  };
  return o;
}

// A long run's saved step metrics: the deployment manager leaves the sink
// with what a restart reads (the metrics it keeps, the latest steps) and
// prunes the steps between, which were saved and never read (a run of a
// million steps on 64 ranks stored 64 million rows). A restart from the
// pruned database serves the same metrics and summary.
TEST(SqliteBackendTest, SavedStepMetricsArePrunedToWhatARestartReads) {
  constexpr int64_t kSteps = 3'000;
  constexpr size_t kKept = 100;  // steps 0-49 of 2 ranks
  const std::string db = TempDatabase("pruned.db");
  const v1::Deployment d = FinishedDeployment("pruned", 2, kSteps);
  auto summary = [](const v1::Deployment& x) {
    return absl::StrCat(x.steps_completed(), " ", x.last_loss(), " ", x.median_step_seconds(), " ",
                        x.recent_step_seconds());
  };
  auto served = [](const std::vector<v1::StepMetric>& ms) {
    std::vector<std::string> out;
    for (const auto& m : ms) out.push_back(absl::StrCat(m.step(), "/", m.rank()));
    return out;
  };
  std::string summary_before;
  std::vector<std::string> served_before;
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveDeployment(d).ok());
    DeploymentManager m(ManagerOn(backend->get(), kKept), {d});
    for (int64_t step = 0; step < kSteps; ++step) {
      std::vector<v1::StepMetric> batch = {Metric(d.name(), 0, step), Metric(d.name(), 1, step)};
      batch[0].set_step_seconds(0.1 + 0.001 * (step % 7));  // a median and recent window to
      batch[1].set_step_seconds(0.2 + 0.001 * (step % 5));  // rebuild, rank 1 the slower
      ASSERT_TRUE(m.ReportStepMetrics(batch).ok());
    }
    auto now = m.Get(d.name());
    ASSERT_TRUE(now.ok());
    summary_before = summary(*now);
    served_before = served(*m.StepMetrics(d.name()));
    ASSERT_EQ(served_before.size(), kKept);
  }
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto everything = (*backend)->Load(/*max_metrics_per_deployment=*/1'000'000);
  ASSERT_TRUE(everything.ok()) << everything.status();
  std::set<int64_t> steps;
  for (const auto& m : everything->metrics) steps.insert(m.step());
  // Kept: steps 0-49; latest: at least 20, at most 20 + the prune batch.
  for (int64_t step = 0; step < 50; ++step) EXPECT_TRUE(steps.count(step)) << step;
  for (int64_t step = kSteps - kRecentStepsPerRank; step < kSteps; ++step) {
    EXPECT_TRUE(steps.count(step)) << step;
  }
  EXPECT_LE(steps.size(), 50u + kRecentStepsPerRank + kStepMetricsPruneSteps);
  EXPECT_FALSE(steps.count(50)) << "a step between the kept and the latest was saved still";
  EXPECT_FALSE(steps.count(kSteps / 2));

  auto loaded = (*backend)->Load(kKept);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  DeploymentManager again(ManagerOn(backend->get(), kKept), loaded->deployments, loaded->metrics);
  auto after = again.Get(d.name());
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(summary(*after), summary_before);
  EXPECT_EQ(served(*again.StepMetrics(d.name())), served_before);
}

// Ranks report on their own (each executor its stream): one 40 steps
// behind the other. Pruning went on from where it last ended, so the
// metrics of the rank behind that came after each prune, below where it
// ended, were saved for good (about 40 steps of every 256 of that rank).
TEST(SqliteBackendTest, PruningAlsoDeletesTheMetricsOfARankBehind) {
  constexpr int64_t kSteps = 3'000, kLag = 40;
  const std::string db = TempDatabase("pruned_lagging.db");
  const v1::Deployment d = FinishedDeployment("lagging", 2, kSteps);
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const DeploymentManagerOptions o = ManagerOn(backend->get(), 100);
  ASSERT_TRUE((*backend)->SaveDeployment(d).ok());
  {
    DeploymentManager m(o, {d});
    for (int64_t step = 0; step < kSteps + kLag; ++step) {
      if (step < kSteps) {
        ASSERT_TRUE(m.ReportStepMetrics({Metric(d.name(), 0, step)}).ok());
      }
      if (step >= kLag) {
        ASSERT_TRUE(m.ReportStepMetrics({Metric(d.name(), 1, step - kLag)}).ok());
      }
    }
  }
  auto everything = (*backend)->Load(/*max_metrics_per_deployment=*/1'000'000);
  ASSERT_TRUE(everything.ok()) << everything.status();
  std::vector<int64_t> between;  // rank 1's, past those kept, before the latest
  for (const auto& m : everything->metrics) {
    if (m.rank() == 1 && m.step() >= 100 &&
        m.step() < kSteps - kRecentStepsPerRank - kStepMetricsPruneSteps - kLag) {
      between.push_back(m.step());
    }
  }
  EXPECT_THAT(between, ::testing::IsEmpty());
}

// A restart in the middle of a run on 64 ranks where rank 63 is 40 steps
// behind the others and slower: its latest steps were pruned (the latest 20
// were counted from the others') and not read back, so the restarted
// planner's recent step time was the others', leaving out the very rank it
// is there to catch. (64 ranks: the latest steps are more than a page of
// the store, read apart from the first ones.)
TEST(SqliteBackendTest, ARestartKeepsTheRecentStepsOfARankBehind) {
  constexpr int64_t kSteps = 1'500, kLag = 40;
  constexpr int kRanks = 64;
  const std::string db = TempDatabase("restart_lagging.db");
  const v1::Deployment d = FinishedDeployment("behind", kRanks, kSteps + 1000);
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const DeploymentManagerOptions o = ManagerOn(backend->get(), 100);
  ASSERT_TRUE((*backend)->SaveDeployment(d).ok());
  double recent_before = 0;
  {
    DeploymentManager m(o, {d});
    for (int64_t step = 0; step < kSteps; ++step) {
      std::vector<v1::StepMetric> batch;
      for (int r = 0; r + 1 < kRanks; ++r) {
        batch.push_back(Metric(d.name(), r, step));
        batch.back().set_step_seconds(0.1);
      }
      if (step >= kLag) {  // 0.2 s a step, 0.3 s over its latest 20
        const int64_t behind = step - kLag;
        batch.push_back(Metric(d.name(), kRanks - 1, behind));
        batch.back().set_step_seconds(behind >= kSteps - kLag - kRecentStepsPerRank ? 0.3 : 0.2);
      }
      ASSERT_TRUE(m.ReportStepMetrics(batch).ok());
    }
    recent_before = m.Get(d.name())->recent_step_seconds();
    ASSERT_DOUBLE_EQ(recent_before, 0.3);  // rank 63's latest
  }
  auto everything = (*backend)->Load(/*max_metrics_per_deployment=*/1'000'000);
  ASSERT_TRUE(everything.ok()) << everything.status();
  int saved = 0;  // rank 63's latest 20 steps, still saved
  for (const auto& m : everything->metrics) {
    saved += m.rank() == kRanks - 1 && m.step() >= kSteps - kLag - kRecentStepsPerRank;
  }
  EXPECT_EQ(saved, kRecentStepsPerRank);
  auto loaded = (*backend)->Load(o.max_metrics_per_deployment);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  DeploymentManager again(o, loaded->deployments, loaded->metrics);
  EXPECT_DOUBLE_EQ(again.Get(d.name())->recent_step_seconds(), recent_before);
}

TEST(SqliteBackendTest, LoadsJobsAsLastSaved) {
  const std::string db = TempDatabase("jobs.db");
  v1::Job j;
  j.set_name("jobs/train");
  j.mutable_create_time()->set_seconds(1700000000);
  j.mutable_status()->set_state(v1::JobStatus::PLANNING);
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveJob(j).ok());
    j.mutable_status()->set_state(v1::JobStatus::RUNNING);
    j.mutable_status()->set_deployment("deployments/train-p1-g1");
    ASSERT_TRUE((*backend)->SaveJob(j).ok());
  }
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto loaded = (*backend)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(loaded->jobs[0].status().state(), v1::JobStatus::RUNNING);
  EXPECT_EQ(loaded->jobs[0].status().deployment(), "deployments/train-p1-g1");
}

// Job retention deletes from the database: a restart finds no such job.
TEST(SqliteBackendTest, ADeletedJobIsNotLoadedAgain) {
  const std::string db = TempDatabase("deleted_job.db");
  v1::Job j;
  j.set_name("jobs/old");
  j.mutable_status()->set_state(v1::JobStatus::SUCCEEDED);
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveJob(j).ok());
    ASSERT_TRUE((*backend)->DeleteJob(j.name()).ok());
    EXPECT_TRUE(absl::IsNotFound((*backend)->DeleteJob(j.name())));
  }
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto loaded = (*backend)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->jobs.empty());
}

TEST(SqliteBackendTest, LoadsEveryMetricOfEveryDeploymentInStepOrder) {
  const std::string db = TempDatabase("metrics.db");
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveDeployment(MakeDeployment("quiet")).ok());
    ASSERT_TRUE((*backend)->SaveDeployment(MakeDeployment("busy")).ok());
    std::vector<v1::StepMetric> ms;
    for (int64_t step = 0; step < 7; ++step) {
      for (int rank = 0; rank < 2; ++rank) ms.push_back(Metric("deployments/busy", rank, step));
    }
    ASSERT_TRUE((*backend)->AppendStepMetrics(ms).ok());
  }
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto loaded = (*backend)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->deployments.size(), 2u);
  ASSERT_EQ(loaded->metrics.size(), 14u);
  for (size_t i = 0; i < loaded->metrics.size(); ++i) {
    EXPECT_EQ(loaded->metrics[i].deployment(), "deployments/busy");
    EXPECT_EQ(loaded->metrics[i].step(), static_cast<int64_t>(i / 2));
  }
}

// DeleteNode reaches the database: a deleted node is not loaded again.
TEST(SqliteBackendTest, ADeletedNodeStaysDeleted) {
  const std::string db = TempDatabase("nodes.db");
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    for (const char* name : {"nodes/a", "nodes/b"}) {
      v1::Node n;
      n.set_name(name);
      ASSERT_TRUE((*backend)->SaveNode(n).ok());
    }
    ASSERT_TRUE((*backend)->DeleteNode("nodes/a").ok());
  }
  auto backend = OpenSqliteBackend(db);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto loaded = (*backend)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->nodes.size(), 1u);
  EXPECT_EQ(loaded->nodes[0].name(), "nodes/b");
}

// The whole daemon starts on such a database (it exited with SIGSEGV).
TEST(SqliteBackendTest, PlannerStartsWithADeploymentThatNeverReported) {
  const std::string db = TempDatabase("server.db");
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveDeployment(MakeDeployment("quiet")).ok());
  }
  auto server = PlannerServer::Start(ServerOn(db));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  (*server)->Shutdown();
}

// Records that cannot be read — bytes that do not parse, a row whose
// message names another record (copied under a second key: two jobs of one
// name would both be driven) or none (an empty body; the planner refused to
// start, "deployment name is empty", naming no record) — are left out with
// a line naming each and why; the rest loads and the planner serves.
TEST(SqliteBackendTest, PlannerStartsWithoutTheRecordsItCannotReadAndNamesThem) {
  const std::string db = TempDatabase("damaged.db");
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SaveDeployment(MakeDeployment("good")).ok());
    ASSERT_TRUE((*backend)->AppendStepMetrics({Metric("deployments/good", 0, 0)}).ok());
    ASSERT_TRUE((*backend)->SaveDeployment(MakeDeployment("bad-metrics")).ok());
    ASSERT_TRUE((*backend)->AppendStepMetrics({Metric("deployments/bad-metrics", 0, 0)}).ok());
    v1::Job j;
    j.set_name("jobs/train");
    j.mutable_create_time()->set_seconds(1700000000);
    j.mutable_status()->set_state(v1::JobStatus::FAILED);
    ASSERT_TRUE((*backend)->SaveJob(j).ok());
    v1::Plan p;
    p.set_name("plans/good");
    p.set_state(v1::Plan::FAILED);
    ASSERT_TRUE((*backend)->SavePlan(p).ok());
    p.set_name("plans/running");
    p.set_state(v1::Plan::RUNNING);
    ASSERT_TRUE((*backend)->SavePlan(p).ok());
  }
  RawExec(db, "INSERT INTO plans VALUES ('plans/empty', 1, 0, NULL, X'', X'')");
  RawExec(db, "UPDATE plans SET body = X'FFFF' WHERE name = 'plans/running'");
  RawExec(db, "INSERT INTO deployments VALUES ('deployments/empty', 1, 0, X'')");
  RawExec(db, "INSERT INTO jobs SELECT 'jobs/copy', create_seconds, create_nanos, body FROM jobs");
  RawExec(db,
          "UPDATE step_metrics SET body = X'FFFF' WHERE deployment = 'deployments/bad-metrics'");

  ::testing::internal::CaptureStderr();
  {
    auto backend = OpenSqliteBackend(db);
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto loaded = (*backend)->Load();
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_EQ(loaded->plans.size(), 1u);
    EXPECT_EQ(loaded->plans[0].name(), "plans/good");
    ASSERT_EQ(loaded->deployments.size(), 2u);
    ASSERT_EQ(loaded->metrics.size(), 1u);
    EXPECT_EQ(loaded->metrics[0].deployment(), "deployments/good");
    ASSERT_EQ(loaded->jobs.size(), 1u);
    EXPECT_EQ(loaded->jobs[0].name(), "jobs/train");
  }
  auto server = PlannerServer::Start(ServerOn(db));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->Shutdown();
  EXPECT_THAT(log, AllOf(HasSubstr("plan summary 'plans/empty' holds ''"),
                         HasSubstr("plan 'plans/running' does not parse"),
                         HasSubstr("deployment 'deployments/empty' holds ''"),
                         HasSubstr("job 'jobs/copy' holds 'jobs/train'"),
                         HasSubstr("step metric 'deployments/bad-metrics step 0 rank 0'")));
}

// A second planner on the port one serves on (its own database) was started
// too (gRPC's default SO_REUSEPORT), and the kernel split the clients
// between the two: it is refused, naming the address.
TEST(SqliteBackendTest, ASecondPlannerOnTheSamePortIsRefused) {
  auto first = PlannerServer::Start(ServerOn(TempDatabase("port-a.db")));
  ASSERT_TRUE(first.ok()) << first.status();
  PlannerServerOptions o = ServerOn(TempDatabase("port-b.db"));
  o.listen = absl::StrCat("127.0.0.1:", (*first)->port());
  auto second = PlannerServer::Start(o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("cannot listen on " + o.listen));
  if (second.ok()) (*second)->Shutdown();
  (*first)->Shutdown();
}

// Two planners on one database would both drive its deployments and jobs
// and overwrite each other's records: the second is refused, naming the
// file, for as long as the first has it open.
TEST(SqliteBackendTest, ASecondPlannerOnTheSameDatabaseIsRefused) {
  const std::string db = TempDatabase("shared.db");
  auto first = PlannerServer::Start(ServerOn(db));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = PlannerServer::Start(ServerOn(db));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(std::string(second.status().message()),
              AllOf(HasSubstr(db), HasSubstr("another planner")));
  auto backend = OpenSqliteBackend(db);
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition) << backend.status();
  (*first)->Shutdown();
  first->reset();
  auto again = PlannerServer::Start(ServerOn(db));
  ASSERT_TRUE(again.ok()) << again.status();
  (*again)->Shutdown();
}

// Expects PlannerServer::Start(o) to be INVALID_ARGUMENT saying `message`
// (and stops a server that started).
void ExpectRefused(const PlannerServerOptions& o, const std::string& message) {
  auto server = PlannerServer::Start(o);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << message;
  EXPECT_THAT(std::string(server.status().message()), HasSubstr(message));
  if (server.ok()) (*server)->Shutdown();
}

// Only -1 turns the metrics off: another negative port started the
// planner without them and without a word; one past 65535 failed only
// once the gRPC server served. Both are refused before anything starts.
TEST(SqliteBackendTest, AMetricsPortOutOfRangeIsRefused) {
  for (int port : {-2, -5, 65536}) {
    PlannerServerOptions o = ServerOn("");
    o.metrics_port = port;
    ExpectRefused(o, absl::StrCat("metrics port ", port, " is not -1"));
  }
}

// gRPC takes a port past 65535 modulo 65536: a planner told to listen on
// 127.0.0.1:99999 served on 34463 (and on 65536, a free port), without a
// word, where no agent or executor looked for it. Such an address, and an
// advertised one executors would dial the same way, are refused.
TEST(SqliteBackendTest, AListenOrAdvertiseAddressPastPort65535IsRefused) {
  for (const char* listen : {"127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:x"}) {
    PlannerServerOptions o = ServerOn("");
    o.listen = listen;
    ExpectRefused(o, absl::StrCat("listen address '", listen, "'"));
  }
  PlannerServerOptions o = ServerOn("");
  o.advertise = "planner.example:70700";
  ExpectRefused(o, "advertise address 'planner.example:70700'");
}

// `--advertise fd00::5:7070` (an IPv6 pod's $(POD_IP):7070, as the agents
// take it) was refused as no HOST:PORT; it is advertised bracketed, as
// executors dial it. Without --advertise, the bound listen address.
TEST(SqliteBackendTest, AnUnbracketedIpv6AdvertiseAddressIsAdvertisedBracketed) {
  PlannerServerOptions o = ServerOn("");
  o.advertise = "fd00::5:7070";
  auto server = PlannerServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->advertised_address(), "[fd00::5]:7070");
  auto plain = PlannerServer::Start(ServerOn(""));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->advertised_address(), absl::StrCat("127.0.0.1:", (*plain)->port()));
}

// Executors are given the planner's listen address to reach it at: a
// wildcard host (--listen 0.0.0.0:7070 without --advertise) was given as
// is, and executors on other machines dialled their own (0.0.0.0
// is the local host there), so their rendezvous and step reports failed. It
// is the planner's host name now (common/host_port's AdvertisedAddress,
// tested there), with the port bound.
TEST(SqliteBackendTest, AWildcardListenAddressIsAdvertisedAsTheHostName) {
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  EXPECT_EQ(ListenAddressToAdvertise("0.0.0.0:0", 41000), absl::StrCat(name, ":41000"));
  EXPECT_EQ(ListenAddressToAdvertise("[::1]:0", 41000), "[::1]:41000");
}

// hap-planner prints where it listens: --listen's host with the port bound.
// It printed 127.0.0.1 whatever the host (a planner bound to every address,
// or to a testbed node's, said 127.0.0.1).
TEST(SqliteBackendTest, TheListenAddressIsTheListenFlagsHostWithThePortBound) {
  for (const std::string host : {"0.0.0.0", "127.0.0.1", "[::1]"}) {
    PlannerServerOptions o = ServerOn("");
    o.listen = host + ":0";
    auto server = PlannerServer::Start(o);
    if (host == "[::1]" && !server.ok()) continue;  // no IPv6 loopback here
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ((*server)->listen_address(), absl::StrCat(host, ":", (*server)->port()));
    EXPECT_EQ((*server)->address(), absl::StrCat("127.0.0.1:", (*server)->port()));
  }
}

// A directory where the database should be names the path.
TEST(SqliteBackendTest, ADirectoryForTheDatabaseIsRefusedNamingIt) {
  const std::string db = TempDatabase("dir.db");
  ASSERT_TRUE(std::filesystem::create_directory(db));
  auto server = PlannerServer::Start(ServerOn(db));
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition) << server.status();
  EXPECT_THAT(std::string(server.status().message()), HasSubstr(db));
}

}  // namespace
}  // namespace hap::service
