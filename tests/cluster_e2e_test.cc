// The whole system on one machine, as processes on 127.0.0.1: a planner,
// three profiler agents and three executor daemons. A plan is created over
// gRPC from the agents' measured profiles, watched to completion, deployed
// and trained 20 steps; the losses reach the planner. Then the planner is
// SIGKILLed and restarted on the same database and port: nodes, plans and
// deployments are there and the agents re-register without duplicates.
// Finally an agent that stops heartbeating (SIGSTOP) goes stale and is left
// out of the next plan.
#include <signal.h>

#include <fstream>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/grpc/grpc_util.h"
#include "tests/service_harness.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::Process;
using ::hap::testing::Runfile;

constexpr char kToken[] = "e2e-token";
constexpr int kNodes = 3;
constexpr int kSteps = 20;

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = hap::testing::TempDir("cluster");
    std::ofstream(dir_ + "/token") << kToken << "\n";
    planner_port_ = hap::testing::FreePort();
    StartPlanner();
    for (int i = 0; i < kNodes; ++i) {
      std::string name = absl::StrCat("node", i);
      agents_.push_back(std::make_unique<Process>());
      ASSERT_TRUE(agents_.back()
                      ->Start({Runfile("profiler_agent/hap-agent"), "--planner=" + Planner(),
                               "--name=" + name, "--listen=127.0.0.1:0",
                               "--token-file=" + dir_ + "/token", "--threads=1",
                               "--probe-seconds=0.3", "--link-probe-seconds=3600",
                               "--devices=cpu"})
                      .ok());
      ASSERT_TRUE(agents_.back()->WaitForLine("listening on ").ok()) << agents_.back()->output();
      executors_.push_back(std::make_unique<Process>());
      ASSERT_TRUE(executors_.back()
                      ->Start({Runfile("executor/cli/hap-executor"), "--serve",
                               "--planner=" + Planner(), "--listen=127.0.0.1:0",
                               "--token-file=" + dir_ + "/token",
                               "--device-id=" + name + "/cpu0", "--threads=1",
                               "--timeout=30"})
                      .ok());
      auto addr = executors_.back()->WaitForLine("listening on ");
      ASSERT_TRUE(addr.ok()) << addr.status();
      executor_address_[name + "/cpu0"] = *addr;
    }
  }
  void TearDown() override {
    for (auto& e : executors_) e->Stop(SIGTERM);
    for (auto& a : agents_) {
      kill(a->pid(), SIGCONT);
      a->Stop(SIGTERM);
    }
    planner_.Stop(SIGTERM);
  }

  void StartPlanner() {
    ASSERT_TRUE(planner_
                    .Start({Runfile("planner/service/hap-planner"), "--listen=" + Planner(),
                            "--metrics-listen=off", "--database=" + dir_ + "/planner.db",
                            "--token-file=" + dir_ + "/token", "--heartbeat-seconds=0.5",
                            "--missed-heartbeats=3", "--drain-seconds=0.2"})
                    .ok());
    auto line = planner_.WaitForLine("listening on ");
    ASSERT_TRUE(line.ok()) << line.status();
    stub_ = v1::Planner::NewStub(*service::MakeChannel(Planner(), {}));
    // The first call on a channel to a restarted server may see the old
    // connection close; wait until calls go through.
    for (int i = 0; i < 100; ++i) {
      v1::ListNodesRequest r;
      v1::ListNodesResponse out;
      if (stub_->ListNodes(Ctx().get(), r, &out).ok()) return;
      absl::SleepFor(absl::Milliseconds(100));
    }
    FAIL() << "the planner does not answer: " << planner_.output();
  }
  std::string Planner() const { return absl::StrCat("127.0.0.1:", planner_port_); }
  std::unique_ptr<grpc::ClientContext> Ctx(int seconds = 30) {
    auto c = std::make_unique<grpc::ClientContext>();
    service::Security s;
    s.token = kToken;
    service::PrepareClientContext(c.get(), s, absl::Seconds(seconds));
    return c;
  }
  // Waits until `n` nodes are READY; returns the node list.
  v1::ListNodesResponse WaitForReadyNodes(int n, absl::Duration timeout = absl::Seconds(60)) {
    absl::Time deadline = absl::Now() + timeout;
    v1::ListNodesResponse nodes;
    while (absl::Now() < deadline) {
      nodes.Clear();
      v1::ListNodesRequest r;
      if (stub_->ListNodes(Ctx().get(), r, &nodes).ok()) {
        int ready = 0;
        for (const auto& x : nodes.nodes()) ready += x.state() == v1::Node::READY;
        if (ready == n) return nodes;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    ADD_FAILURE() << "never saw " << n << " ready nodes; last: " << nodes.DebugString();
    return nodes;
  }
  v1::CreatePlanRequest Request(const std::string& id) {
    v1::CreatePlanRequest r;
    r.set_plan_id(id);
    auto* zoo = r.mutable_model()->mutable_zoo();
    zoo->set_name("gpt");
    auto& p = *zoo->mutable_params();
    p["layers"] = 2;
    p["hidden"] = 32;
    p["heads"] = 4;
    p["ffn"] = 64;
    p["seq"] = 16;
    p["vocab"] = 97;
    p["batch"] = 12;
    r.mutable_options()->mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
    r.mutable_options()->mutable_optimizer()->set_learning_rate(3e-3);
    return r;
  }

  std::string dir_;
  int planner_port_ = 0;
  Process planner_;
  std::unique_ptr<v1::Planner::Stub> stub_;
  std::vector<std::unique_ptr<Process>> agents_, executors_;
  std::map<std::string, std::string> executor_address_;
};

TEST_F(ClusterTest, PlansFromMeasuredProfilesTrainsAndSurvivesAPlannerKill) {
  v1::ListNodesResponse nodes = WaitForReadyNodes(kNodes);
  ASSERT_EQ(nodes.nodes_size(), kNodes);
  for (const auto& n : nodes.nodes()) {
    ASSERT_EQ(n.devices_size(), 1) << n.DebugString();
    EXPECT_GT(n.devices(0).flops(0).flops(), 1e8) << "measured, not made up";
    EXPECT_GT(n.devices(0).memory_bytes(), 0);
  }

  // Create (asynchronously) and watch to completion.
  v1::Plan plan;
  ASSERT_TRUE(stub_->CreatePlan(Ctx().get(), Request("gpt-e2e"), &plan).ok());
  v1::WatchPlanRequest w;
  w.set_name("plans/gpt-e2e");
  auto watch_ctx = Ctx(120);
  auto reader = stub_->WatchPlan(watch_ctx.get(), w);
  v1::Plan update;
  int updates = 0;
  while (reader->Read(&update)) ++updates;
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_GE(updates, 1);
  ASSERT_EQ(update.state(), v1::Plan::SUCCEEDED) << update.error();
  ASSERT_EQ(update.devices_size(), kNodes);

  // Deploy to the three executors and train 20 steps.
  v1::DeployPlanRequest d;
  d.set_plan("plans/gpt-e2e");
  for (const auto& [dev, addr] : executor_address_) (*d.mutable_executors())[dev] = addr;
  d.mutable_training()->set_steps(kSteps);
  d.mutable_training()->set_data(v1::TrainingConfig::SYNTHETIC);
  v1::Deployment dep;
  grpc::Status s = stub_->DeployPlan(Ctx().get(), d, &dep);
  ASSERT_TRUE(s.ok()) << s.error_message();
  absl::Time deadline = absl::Now() + absl::Seconds(240);
  while (absl::Now() < deadline) {
    v1::GetDeploymentRequest g;
    g.set_name(dep.name());
    ASSERT_TRUE(stub_->GetDeployment(Ctx().get(), g, &dep).ok());
    if (dep.state() == v1::Deployment::SUCCEEDED || dep.state() == v1::Deployment::FAILED) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(dep.state(), v1::Deployment::SUCCEEDED) << dep.error();
  EXPECT_EQ(dep.steps_completed(), kSteps);

  // Every rank's loss of every step reached the planner; ranks agree.
  v1::ListStepMetricsRequest lm;
  lm.set_deployment(dep.name());
  lm.set_page_size(1000);
  v1::ListStepMetricsResponse metrics;
  ASSERT_TRUE(stub_->ListStepMetrics(Ctx().get(), lm, &metrics).ok());
  std::map<int64_t, std::vector<double>> by_step;
  for (const auto& m : metrics.metrics()) by_step[m.step()].push_back(m.loss());
  ASSERT_EQ(by_step.size(), static_cast<size_t>(kSteps));
  for (const auto& [step, losses] : by_step) {
    ASSERT_EQ(losses.size(), static_cast<size_t>(kNodes)) << "step " << step;
    for (double l : losses) EXPECT_EQ(l, losses[0]) << "step " << step;
  }
  EXPECT_LT(by_step[kSteps - 1][0], by_step[0][0]);

  // hapctl (kubectl conventions) reads the same state.
  {
    Process ctl;
    ASSERT_TRUE(ctl.Start({Runfile("tools/hapctl"), "get", "nodes", "-o", "json",
                           "--token-file=" + dir_ + "/token"},
                          {"HAPCTL_SERVER=" + Planner()})
                    .ok());
    int st = ctl.Stop(0, absl::Seconds(30));
    (void)st;
    EXPECT_THAT(ctl.output(), ::testing::HasSubstr("\"node1\""));
    Process describe;
    ASSERT_TRUE(describe.Start({Runfile("tools/hapctl"), "describe", "plan", "gpt-e2e",
                                "--server=" + Planner(), "--token-file=" + dir_ + "/token"})
                    .ok());
    describe.Stop(0, absl::Seconds(30));
    EXPECT_THAT(describe.output(), ::testing::HasSubstr("SUCCEEDED"));
    Process denied;
    ASSERT_TRUE(denied.Start({Runfile("tools/hapctl"), "get", "plans", "--server=" + Planner()})
                    .ok());
    int code = denied.Stop(0, absl::Seconds(30));
    EXPECT_TRUE(WIFEXITED(code) && WEXITSTATUS(code) == 1);
    EXPECT_THAT(denied.output(), ::testing::HasSubstr("UNAUTHENTICATED"));
  }

  // The planner dies hard and comes back on the same database and port.
  planner_.Stop(SIGKILL);
  StartPlanner();
  v1::GetPlanRequest gp;
  gp.set_name("plans/gpt-e2e");
  v1::Plan back;
  grpc::Status got = stub_->GetPlan(Ctx().get(), gp, &back);
  ASSERT_TRUE(got.ok()) << got.error_message() << "\n" << planner_.output();
  EXPECT_EQ(back.state(), v1::Plan::SUCCEEDED);
  EXPECT_EQ(back.content_hash(), update.content_hash());
  v1::GetDeploymentRequest gd;
  gd.set_name(dep.name());
  v1::Deployment dep_back;
  ASSERT_TRUE(stub_->GetDeployment(Ctx().get(), gd, &dep_back).ok());
  EXPECT_EQ(dep_back.state(), v1::Deployment::SUCCEEDED);
  // Agents keep heartbeating (or re-register): still exactly three nodes.
  absl::SleepFor(absl::Seconds(2));
  nodes = WaitForReadyNodes(kNodes);
  EXPECT_EQ(nodes.nodes_size(), kNodes);

  // An agent that stops heartbeating goes stale and is left out.
  kill(agents_[2]->pid(), SIGSTOP);
  nodes = WaitForReadyNodes(kNodes - 1, absl::Seconds(30));
  v1::Plan two;
  v1::CreatePlanRequest r = Request("after-stale");
  r.set_wait(true);
  ASSERT_TRUE(stub_->CreatePlan(Ctx(120).get(), r, &two).ok());
  ASSERT_EQ(two.state(), v1::Plan::SUCCEEDED) << two.error();
  EXPECT_EQ(two.devices_size(), kNodes - 1);
  for (const auto& dev : two.devices()) EXPECT_NE(dev, "node2/cpu0");
  kill(agents_[2]->pid(), SIGCONT);
}

}  // namespace
}  // namespace hap
