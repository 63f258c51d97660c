// The daemon's SQLite backend: what a restart loads back.
#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/planner_server.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

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
  PlannerServerOptions o;
  o.database = db;
  o.metrics_port = -1;
  o.drain = absl::ZeroDuration();
  auto server = PlannerServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  (*server)->Shutdown();
}

}  // namespace
}  // namespace hap::service
