// hapctl against hap-planner as a process on 127.0.0.1: listing every
// page, describing a deployment and a node, the planning flags of create plan, and
// one error for a TLS mismatch.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "tests/planner_process.h"
#include "tests/service_harness.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::Ctx;
using ::hap::testing::DeployAndWaitUntilFailed;
using ::hap::testing::MakeTestCertificate;
using ::hap::testing::Planner;
using ::hap::testing::Process;
using ::hap::testing::RegisterAndPlanDeployed;
using ::testing::HasSubstr;

// hapctl against a planner holding one node and the plan "deployed"
// (RegisterAndPlanDeployed).
class HapctlServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_.Start(hap::testing::TempDir("hapctl"));
    stub_ = p_.Stub();
    ASSERT_NO_FATAL_FAILURE(RegisterAndPlanDeployed(stub_.get(), &plan_request_, &deploy_));
  }
  // Runs hapctl with `args` against the planner; its output. Exits
  // `want_exit`, else the test fails.
  std::string Hapctl(std::vector<std::string> args, int want_exit = 0) {
    Process ctl;
    args.insert(args.begin(), hap::testing::Runfile("tools/hapctl"));
    args.push_back("--server=" + p_.Address());
    args.push_back("--token-file=" + p_.dir + "/token");
    EXPECT_TRUE(ctl.Start(args).ok());
    const int status = ctl.Stop(0, absl::Seconds(120));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == want_exit) << ctl.output();
    return ctl.output();
  }

  Planner p_;
  std::unique_ptr<v1::Planner::Stub> stub_;
  v1::CreatePlanRequest plan_request_;
  v1::DeployPlanRequest deploy_;
};

// `hapctl get deployments` printed the first page of ListDeployments only
// (50), so a planner holding more showed some of them, silently.
TEST_F(HapctlServiceTest, GetDeploymentsListsEveryPage) {
  std::set<std::string> made;
  for (int i = 0; i < 57; ++i) {  // more than one page of 50
    v1::Deployment d;
    grpc::Status s = stub_->DeployPlan(Ctx().get(), deploy_, &d);
    ASSERT_TRUE(s.ok()) << s.error_message();
    made.insert(d.name());
  }
  for (const std::string format : {"table", "json"}) {
    const std::string out = Hapctl({"get", "deployments", "-o", format});
    std::set<std::string> listed;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      for (const std::string& name : made) {
        if (absl::StrContains(line, "\"" + name + "\"") || absl::StartsWith(line, name + " ")) {
          listed.insert(name);
        }
      }
    }
    EXPECT_EQ(listed.size(), made.size()) << format << ":\n" << out;
  }
}

// `hapctl describe deployment` printed the record as JSON whatever -o said;
// plans and jobs had a description. Now: when, what it trains, its step
// time against the plan's prediction, why it failed, one line per rank;
// -o json still the record.
TEST_F(HapctlServiceTest, DescribeDeploymentSaysWhatItTrainsWhereAndWhyItFailed) {
  v1::DeployPlanRequest deploy = deploy_;
  deploy.mutable_training()->set_steps(300);
  deploy.mutable_training()->set_checkpoint_dir("/ckpt/run1");
  deploy.mutable_training()->set_checkpoint_every(50);
  v1::Deployment d;
  ASSERT_NO_FATAL_FAILURE(DeployAndWaitUntilFailed(stub_.get(), deploy, &d));
  v1::GetPlanRequest gp;
  gp.set_name("plans/deployed");
  v1::Plan plan;
  ASSERT_TRUE(stub_->GetPlan(Ctx().get(), gp, &plan).ok());
  const std::string text = Hapctl({"describe", "deployment", d.name()});
  EXPECT_THAT(text, HasSubstr(d.name() + " "));
  EXPECT_THAT(text, HasSubstr("FAILED"));
  EXPECT_THAT(text, HasSubstr("training: to step 300, data SYNTHETIC"));
  EXPECT_THAT(text, HasSubstr("checkpoints: every 50 steps and the last into /ckpt/run1, "
                              "keeping 3"));
  EXPECT_THAT(text, HasSubstr(absl::StrFormat("step time: predicted %.4g s",
                                              plan.prediction().step_seconds())));
  EXPECT_THAT(text, HasSubstr("error: " + d.error()));
  EXPECT_THAT(text, HasSubstr("RANK  DEVICE"));
  for (const auto& rank : d.ranks()) {
    EXPECT_THAT(text, HasSubstr(absl::StrFormat("%-5d %-24s %-24s %-8s", rank.rank(), rank.device(),
                                                rank.executor_address(),
                                                rank.backend().empty() ? "-" : rank.backend())));
  }
  EXPECT_THAT(text, ::testing::Not(HasSubstr("\"name\"")));
  EXPECT_THAT(Hapctl({"describe", "deployment", d.name(), "-o", "json"}),
              HasSubstr("\"name\": \"" + d.name() + "\""));
}

// `hapctl describe node` (there was none: `get nodes` showed a row, the
// rest only as JSON of the whole cluster): its devices with their rates and
// calibration, its links by peer and kind, and the deployments not finished
// with a rank on it (two real executor daemons train one here).
TEST_F(HapctlServiceTest, DescribeNodeShowsDevicesLinksAndTheDeploymentsOnIt) {
  // n1 heartbeats as its agent would (every 100 ms, on a thread of its
  // own): the planner here counts a node STALE after 1 s without one, which
  // starting two executors took on a loaded machine (CI once saw STALE).
  std::atomic<bool> beating{true};
  std::thread beat([&] {
    while (beating) {
      v1::HeartbeatRequest hb;
      hb.set_name("nodes/n1");
      v1::HeartbeatResponse hr;
      EXPECT_TRUE(stub_->Heartbeat(Ctx().get(), hb, &hr).ok());
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  struct Join {
    std::atomic<bool>& beating;
    std::thread& beat;
    ~Join() {
      beating = false;
      beat.join();
    }
  } join{beating, beat};
  v1::ReportLinksRequest links;
  links.set_node("n1");
  for (const auto& [src, dst] : {std::pair<std::string, std::string>{"n1/cpu0", "n1/cpu1"},
                                 std::pair<std::string, std::string>{"n1/cpu1", "n1/cpu0"}}) {
    v1::Link* l = links.add_links();
    l->set_src(src);
    l->set_dst(dst);
    l->set_bandwidth_bytes_per_second(src == "n1/cpu0" ? 2e10 : 1e10);
    l->set_latency_seconds(2e-6);
    l->set_kind(v1::SHARED_MEMORY);
  }
  v1::ReportLinksResponse lr;
  grpc::Status s = stub_->ReportLinks(Ctx().get(), links, &lr);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<std::unique_ptr<Process>> executors;
  v1::DeployPlanRequest deploy = deploy_;
  for (const std::string device : {"n1/cpu0", "n1/cpu1"}) {
    executors.push_back(std::make_unique<Process>());
    ASSERT_TRUE(
        executors.back()
            ->Start({hap::testing::Runfile("executor/cli/hap-executor"), "--serve",
                     "--planner=" + p_.Address(), "--listen=127.0.0.1:0",
                     "--token-file=" + p_.dir + "/token", "--device-id=" + device, "--threads=1"})
            .ok());
    auto address = executors.back()->WaitForLine("listening on ");
    ASSERT_TRUE(address.ok()) << address.status();
    (*deploy.mutable_executors())[device] = *address;
  }
  deploy.mutable_training()->set_steps(10'000'000);  // trains until stopped
  v1::Deployment d;
  s = stub_->DeployPlan(Ctx().get(), deploy, &d);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::string text = Hapctl({"describe", "node", "n1"});
  EXPECT_THAT(text, HasSubstr("name: n1\nstate: READY"));
  EXPECT_THAT(text, HasSubstr("address: 127.0.0.1:1"));
  EXPECT_THAT(text, HasSubstr("n1/cpu0                  CPU"));
  EXPECT_THAT(text, HasSubstr("8.00  float32 1 TFLOP/s"));
  EXPECT_THAT(text, HasSubstr("not calibrated"));
  EXPECT_THAT(text, ::testing::ContainsRegex(
                        "within n1 +SHARED_MEMORY +2 link\\(s\\)  10 GB/s - 20 GB/s, latency "
                        "2e-06 s"));
  EXPECT_THAT(text,
              ::testing::ContainsRegex(d.name() + " \\((PENDING|RUNNING)\\) rank 0 on n1/cpu0"));
  EXPECT_THAT(text,
              ::testing::ContainsRegex(d.name() + " \\((PENDING|RUNNING)\\) rank 1 on n1/cpu1"));
  // Where each rank runs (its executor's ExecutorStatus.backend) reaches
  // the deployment's record through the status polls, and its description.
  v1::GetDeploymentRequest gd;
  gd.set_name(d.name());
  v1::Deployment live;
  for (absl::Time until = absl::Now() + absl::Seconds(60); absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(100))) {
    ASSERT_TRUE(stub_->GetDeployment(Ctx().get(), gd, &live).ok());
    if (live.ranks_size() == 2 && !live.ranks(1).backend().empty()) break;
  }
  ASSERT_EQ(live.ranks_size(), 2);
  EXPECT_EQ(live.ranks(0).backend(), "cpu");
  EXPECT_EQ(live.ranks(1).backend(), "cpu");
  EXPECT_THAT(Hapctl({"describe", "deployment", d.name()}),
              ::testing::ContainsRegex("\n1 +n1/cpu1 +127\\.0\\.0\\.1:[0-9]+ +cpu +"));
  v1::StopDeploymentRequest stop;
  stop.set_name(d.name());
  ASSERT_TRUE(stub_->StopDeployment(Ctx().get(), stop, &d).ok());
  EXPECT_THAT(Hapctl({"describe", "node", "nodes/n1"}), HasSubstr("deployments on it: none"));
  EXPECT_THAT(Hapctl({"describe", "node", "n1", "-o", "json"}), HasSubstr("\"id\": \"n1/cpu1\""));
  EXPECT_THAT(
      Hapctl({"describe", "node", "n9"}, 1),
      HasSubstr("no node 'n9' is registered with the planner (hapctl get nodes lists them)"));
  for (auto& e : executors) e->Stop(SIGTERM);
}

// A watch whose client vanished without closing its connection (its host
// down, the network cut: here the client is SIGSTOPped, so the kernel keeps
// the connection but nothing answers) ends once a keepalive ping goes
// unanswered, freeing its thread; before, it held one of --max-threads
// until the job ended, for days.
TEST(PlannerKeepaliveTest, AWatchWhoseClientVanishedEnds) {
  Planner p;
  p.Start(hap::testing::TempDir("keepalive"), {"--keepalive-seconds=0.5"});
  const std::string ctl = hap::testing::Runfile("tools/hapctl");
  const std::vector<std::string> common = {"--server=" + p.Address(),
                                           "--token-file=" + p.dir + "/token"};
  {
    std::vector<std::string> args = {
        ctl,   "create",           "job",          "--id", "waits", "--model",
        "mlp", "--checkpoint-dir", p.dir + "/ckpt"};
    args.insert(args.end(), common.begin(), common.end());
    Process create;
    ASSERT_TRUE(create.Start(args).ok());
    const int status = create.Stop(0, absl::Seconds(60));
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << create.output();
  }
  std::vector<std::string> args = {ctl, "watch", "job", "waits"};
  args.insert(args.end(), common.begin(), common.end());
  Process watch;
  ASSERT_TRUE(watch.Start(args).ok());
  // The job's first state (it waits for devices: there are none).
  ASSERT_TRUE(watch.WaitForLine("20").ok()) << watch.output();
  ASSERT_EQ(kill(watch.pid(), SIGSTOP), 0);
  const std::string ended = "grpc_method=\"WatchJob\",grpc_code=\"";
  std::string metrics;
  for (int i = 0; i < 300 && !absl::StrContains(metrics, ended); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    auto text = hap::testing::HttpGet(p.metrics_port, "/metrics");
    if (text.ok()) metrics = *text;
  }
  kill(watch.pid(), SIGCONT);
  watch.Stop(SIGTERM);
  EXPECT_THAT(metrics, HasSubstr(ended)) << "the watch of a vanished client never ended";
}

// `hapctl create plan` had no --precision, --gradient-precision,
// --momentum, --ignore-memory or --max-states (hapctl plan has them): a
// bf16 plan could be asked of the service through its API only.
TEST_F(HapctlServiceTest, CreatePlanTakesPrecisionMomentumMemoryAndBudgetFlags) {
  const std::vector<std::string> model = {"create",   "plan", "--model", "mlp", "--layers", "2",
                                          "--hidden", "64",   "--batch", "32",  "--wait"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = model;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  Hapctl(with({"--id", "bf16", "--precision", "bf16", "--gradient-precision", "bf16", "--momentum",
               "0.5", "--ignore-memory", "--max-states", "5000"}),
         0);
  v1::GetPlanRequest g;
  g.set_name("plans/bf16");
  v1::Plan plan;
  ASSERT_TRUE(stub_->GetPlan(Ctx().get(), g, &plan).ok());
  EXPECT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  const v1::PlanOptions& o = plan.options();
  EXPECT_EQ(o.precision(), v1::PRECISION_BF16);
  EXPECT_EQ(o.gradient_precision(), v1::PRECISION_BF16);
  EXPECT_EQ(o.optimizer().momentum(), 0.5);
  EXPECT_TRUE(o.ignore_memory_limits());
  EXPECT_EQ(o.budget().max_states(), 5000);
  // The defaults as before: fp32, momentum 0.9, no budget of states.
  Hapctl(with({"--id", "fp32"}), 0);
  g.set_name("plans/fp32");
  ASSERT_TRUE(stub_->GetPlan(Ctx().get(), g, &plan).ok());
  EXPECT_NE(plan.options().precision(), v1::PRECISION_BF16);
  EXPECT_EQ(plan.options().optimizer().momentum(), 0.9);
  EXPECT_EQ(plan.options().budget().max_states(), 0);
  EXPECT_FALSE(plan.options().ignore_memory_limits());
  for (const auto& [flag, value, error] :
       {std::tuple<std::string, std::string, std::string>{
            "--precision", "fp16", "--precision must be fp32 or bf16, got 'fp16'"},
        {"--gradient-precision", "int8", "--gradient-precision must be fp32 or bf16"},
        {"--momentum", "-1", "--momentum must be from 0 to below 1, got '-1'"},
        {"--momentum", "1", "--momentum must be from 0 to below 1, got '1'"},
        {"--max-states", "0", "max-states"}}) {
    EXPECT_THAT(Hapctl(with({"--id", "bad", flag, value}), 1), HasSubstr(error)) << flag;
  }
}

// A TLS client against this plaintext planner: hapctl's error with its
// hint, without gRPC's own log line before it ("E1206 ... ssl_transport_
// security.cc ... Handshake failed ... WRONG_VERSION_NUMBER").
TEST_F(HapctlServiceTest, ATlsMismatchIsOneErrorWithItsHint) {
  const std::string dir = hap::testing::TempDir("hapctl-tls");
  ASSERT_NO_FATAL_FAILURE(MakeTestCertificate(dir));
  const std::string out =
      Hapctl({"get", "nodes", "--tls-ca-file=" + dir + "/cert.pem", "--timeout=5"}, 1);
  EXPECT_THAT(out, HasSubstr("does not serve TLS"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("Handshake failed")));
}

}  // namespace
}  // namespace hap
