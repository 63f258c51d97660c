// hap-planner as a process on 127.0.0.1: health, bad requests and their
// codes, liveness of nodes, state that survives SIGKILL, and a real
// Prometheus server scraping /metrics.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/grpc_util.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "tests/planner_process.h"
#include "tests/service_harness.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::Ctx;
using ::hap::testing::DeployAndWaitUntilFailed;
using ::hap::testing::FakeNode;
using ::hap::testing::kToken;
using ::hap::testing::MakeTestCertificate;
using ::hap::testing::Mlp;
using ::hap::testing::Planner;
using ::hap::testing::Process;
using ::hap::testing::RegisterAndPlanDeployed;
using ::testing::HasSubstr;

grpc::health::v1::HealthCheckResponse::ServingStatus Health(int port,
                                                            const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      *service::MakeChannel(absl::StrCat("127.0.0.1:", port), {}));
  grpc::health::v1::HealthCheckRequest r;
  r.set_service(service);
  grpc::health::v1::HealthCheckResponse out;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (!stub->Check(&ctx, r, &out).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return out.status();
}

class PlannerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { planner_.Start(hap::testing::TempDir("planner")); }
  Planner planner_;
};

TEST_F(PlannerServiceTest, HealthIsServingWhileUpAndNotServingDuringShutdown) {
  using HS = grpc::health::v1::HealthCheckResponse;
  EXPECT_EQ(Health(planner_.port, "hap.v1.Planner"), HS::SERVING);
  EXPECT_EQ(Health(planner_.port, ""), HS::SERVING);
  kill(planner_.proc.pid(), SIGTERM);
  // During the drain the server still answers, with NOT_SERVING.
  bool seen = false;
  for (int i = 0; i < 50 && !seen; ++i) {
    seen = Health(planner_.port, "hap.v1.Planner") == HS::NOT_SERVING;
    if (!seen) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(seen);
  int status = planner_.proc.Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << planner_.proc.output();
}

TEST_F(PlannerServiceTest, BadRequestsGetSpecificCodesAndMessages) {
  auto stub = planner_.Stub();
  v1::Plan plan;
  // No token.
  grpc::Status s = stub->CreatePlan(Ctx(false).get(), Mlp(), &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("bearer token"));
  // No live node yet.
  s = stub->CreatePlan(Ctx().get(), Mlp(), &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("no live node"));
  v1::RegisterNodeRequest reg;
  *reg.mutable_node() = FakeNode("n1", 1e12);
  v1::RegisterNodeResponse rr;
  ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  // A malformed graph names the op.
  auto g = graph::BuildZooModel("mlp", {{"layers", 1}, {"hidden", 8}, {"input", 4}, {"batch", 4}});
  ASSERT_TRUE(g.ok());
  v1::CreatePlanRequest bad;
  *bad.mutable_model()->mutable_graph() = graph::ToProto(*g);
  bad.mutable_model()->mutable_graph()->mutable_ops(0)->set_type("no_such_op");
  s = stub->CreatePlan(Ctx().get(), bad, &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr(bad.model().graph().ops(0).name()));
  // An unknown device / node.
  v1::CreatePlanRequest unknown = Mlp();
  unknown.add_devices("ghost/gpu0");
  s = stub->CreatePlan(Ctx().get(), unknown, &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("ghost/gpu0"));
  v1::GetProbeAssignmentsRequest pa;
  pa.set_node("ghost");
  v1::GetProbeAssignmentsResponse par;
  s = stub->GetProbeAssignments(Ctx().get(), pa, &par);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  // A negative page size.
  v1::ListPlansRequest lp;
  lp.set_page_size(-1);
  v1::ListPlansResponse lr;
  s = stub->ListPlans(Ctx().get(), lp, &lr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("page_size"));
  // An oversized request (the planner was started with a 1 MiB limit).
  v1::CreatePlanRequest big = Mlp();
  big.set_plan_id(std::string(2 << 20, 'x'));
  s = stub->CreatePlan(Ctx().get(), big, &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // A plan that fits nowhere fails with RESOURCE_EXHAUSTED as its code.
  v1::CreatePlanRequest huge = Mlp();
  (*huge.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 65536;
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), huge, &plan).ok());
  EXPECT_EQ(plan.state(), v1::Plan::FAILED);
  EXPECT_EQ(plan.error_code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  // The planner is still serving.
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), Mlp(), &plan).ok());
  EXPECT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
}

TEST_F(PlannerServiceTest, AStaleNodeIsLeftOutOfTheNextPlan) {
  auto stub = planner_.Stub();
  for (const char* n : {"fast", "slow"}) {
    v1::RegisterNodeRequest reg;
    *reg.mutable_node() = FakeNode(n, std::string(n) == "fast" ? 2e12 : 1e12);
    v1::RegisterNodeResponse rr;
    ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  }
  v1::Plan both;
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), Mlp(), &both).ok());
  EXPECT_EQ(both.devices_size(), 4);
  // Only "fast" keeps heartbeating (every 100 ms, on a thread of its own,
  // until the plan is made: a loaded machine must not make it stale too);
  // "slow" misses two 0.5 s intervals.
  std::atomic<bool> beating{true};
  std::thread beat([&] {
    while (beating) {
      v1::HeartbeatRequest hb;
      hb.set_name("nodes/fast");
      v1::HeartbeatResponse hr;
      EXPECT_TRUE(stub->Heartbeat(Ctx().get(), hb, &hr).ok());
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  absl::SleepFor(absl::Seconds(2));
  v1::ListNodesRequest ln;
  v1::ListNodesResponse nodes;
  grpc::Status listed = stub->ListNodes(Ctx().get(), ln, &nodes);
  v1::CreatePlanRequest r = Mlp();
  r.set_plan_id("after-stale");
  v1::Plan one;
  grpc::Status created = stub->CreatePlan(Ctx().get(), r, &one);
  beating = false;
  beat.join();
  ASSERT_TRUE(listed.ok()) << listed.error_message();
  for (const auto& n : nodes.nodes()) {
    EXPECT_EQ(n.state(), n.name() == "slow" ? v1::Node::STALE : v1::Node::READY) << n.name();
  }
  ASSERT_TRUE(created.ok()) << created.error_message();
  EXPECT_EQ(one.state(), v1::Plan::SUCCEEDED) << one.error();
  ASSERT_EQ(one.devices_size(), 2);
  for (const auto& d : one.devices()) EXPECT_THAT(d, ::testing::StartsWith("fast/"));
}

TEST_F(PlannerServiceTest, StateSurvivesSigkillAndNodesReRegisterWithoutDuplicates) {
  auto stub = planner_.Stub();
  v1::RegisterNodeRequest reg;
  *reg.mutable_node() = FakeNode("n1", 1e12);
  v1::RegisterNodeResponse rr;
  ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  v1::CreatePlanRequest r = Mlp();
  r.set_plan_id("kept");
  v1::Plan plan;
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), r, &plan).ok());
  ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED);
  planner_.proc.Stop(SIGKILL);

  Planner again;
  again.Start(planner_.dir);
  auto s2 = again.Stub();
  v1::GetPlanRequest gp;
  gp.set_name("plans/kept");
  gp.set_view(v1::GetPlanRequest::FULL);
  v1::Plan back;
  ASSERT_TRUE(s2->GetPlan(Ctx().get(), gp, &back).ok());
  EXPECT_EQ(back.state(), v1::Plan::SUCCEEDED);
  EXPECT_EQ(back.content_hash(), plan.content_hash());
  EXPECT_EQ(back.rank_programs_size(), 2);
  // The node is remembered; its agent registering again adds nothing new.
  ASSERT_TRUE(s2->RegisterNode(Ctx().get(), reg, &rr).ok());
  v1::ListNodesRequest ln;
  v1::ListNodesResponse nodes;
  ASSERT_TRUE(s2->ListNodes(Ctx().get(), ln, &nodes).ok());
  ASSERT_EQ(nodes.nodes_size(), 1);
  EXPECT_EQ(nodes.nodes(0).devices_size(), 2);
  again.proc.Stop(SIGTERM);
}

TEST_F(PlannerServiceTest, HostileProfilesOptionsAndRendezvousCallsAreRefused) {
  auto stub = planner_.Stub();
  v1::RegisterNodeResponse rr;
  for (const char* n : {"n1", "n2"}) {
    v1::RegisterNodeRequest reg;
    *reg.mutable_node() = FakeNode(n, 1e12);
    ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  }
  // A heartbeat that claims n2's device, or reports NaN FLOP/s.
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/n1");
  *hb.mutable_devices() = FakeNode("n1", 1e12).devices();
  hb.mutable_devices(1)->set_id("n2/cpu0");
  v1::HeartbeatResponse hr;
  grpc::Status s = stub->Heartbeat(Ctx().get(), hb, &hr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(s.error_message(), HasSubstr("device 'n2/cpu0' is already registered by node 'n2'"));
  *hb.mutable_devices() = FakeNode("n1", std::nan("")).devices();
  s = stub->Heartbeat(Ctx().get(), hb, &hr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(
      s.error_message(),
      HasSubstr("FLOAT32 FLOP/s must be a finite number >= 1e+06 and at most 1e+18, got nan"));
  // Options out of range.
  v1::CreatePlanRequest nan_lr = Mlp();
  nan_lr.mutable_options()->mutable_optimizer()->set_learning_rate(std::nan(""));
  v1::Plan plan;
  s = stub->CreatePlan(Ctx().get(), nan_lr, &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("options.optimizer.learning_rate"));
  // Rendezvous keys of a deployment that does not exist.
  v1::StoreSetRequest set;
  set.set_deployment("deployments/ghost-g1");
  set.set_generation(1);
  set.set_key("k");
  v1::StoreSetResponse set_out;
  s = stub->StoreSet(Ctx().get(), set, &set_out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("deployments/ghost-g1"));
  // The cluster still plans on its four devices, also after a restart.
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), Mlp(), &plan).ok());
  EXPECT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  EXPECT_EQ(plan.devices_size(), 4);
  planner_.proc.Stop(SIGKILL);
  Planner again;
  again.Start(planner_.dir);
  v1::CreatePlanRequest r = Mlp();
  r.set_plan_id("after-restart");
  ASSERT_TRUE(again.Stub()->CreatePlan(Ctx().get(), r, &plan).ok());
  EXPECT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  EXPECT_EQ(plan.devices_size(), 4);
  again.proc.Stop(SIGTERM);
}

TEST_F(PlannerServiceTest, PrometheusScrapesHapSeriesAndPromtoolAcceptsTheOutput) {
  auto stub = planner_.Stub();
  v1::RegisterNodeRequest reg;
  *reg.mutable_node() = FakeNode("n1", 1.5e12);
  v1::RegisterNodeResponse rr;
  ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  v1::Plan plan;
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), Mlp(), &plan).ok());
  ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED);

  auto text = hap::testing::HttpGet(planner_.metrics_port, "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("hap_plans_total{result=\"succeeded\"} 1"));
  // Every re-plan reason's series exists before any job re-planned.
  for (const char* reason :
       {"executor_lost", "node_stale", "node_joined", "deployment_stopped", "slowdown"}) {
    EXPECT_THAT(*text, HasSubstr(absl::StrCat("hap_job_replans_total{reason=\"", reason, "\"} 0")));
  }
  EXPECT_THAT(*text, HasSubstr("grpc_server_handled_total{grpc_type=\"unary\","
                               "grpc_service=\"hap.v1.Planner\",grpc_method=\"CreatePlan\","
                               "grpc_code=\"OK\"} 1"));
  std::string dir = hap::testing::TempDir("prom");
  std::ofstream(dir + "/metrics.txt") << *text;
  std::string check = absl::StrCat("promtool check metrics < ", dir, "/metrics.txt 2>&1");
  FILE* f = popen(check.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char buf[4096];
  std::string out;
  while (fgets(buf, sizeof(buf), f)) out += buf;
  EXPECT_EQ(pclose(f), 0) << out;

  // A real Prometheus on loopback scrapes the planner every 200 ms.
  int prom_port = hap::testing::FreePort();
  std::ofstream(dir + "/prometheus.yml")
      << "global:\n  scrape_interval: 200ms\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: hap-planner\n    static_configs:\n"
      << "      - targets: ['127.0.0.1:" << planner_.metrics_port << "']\n";
  Process prom;
  ASSERT_TRUE(prom.Start({"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml",
                          "--storage.tsdb.path=" + dir + "/data",
                          absl::StrCat("--web.listen-address=127.0.0.1:", prom_port),
                          "--log.level=warn"})
                  .ok());
  std::string got;
  for (int i = 0; i < 150; ++i) {
    auto r = hap::testing::HttpGet(prom_port,
                                   "/api/v1/query?query=hap_plans_total%7Bresult%3D%22succeeded%22%7D");
    if (r.ok() && r->find("\"value\"") != std::string::npos) {
      got = *r;
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_FALSE(got.empty()) << "Prometheus never returned the series; its log:\n"
                            << prom.output();
  EXPECT_THAT(got, HasSubstr("\"job\":\"hap-planner\""));
  EXPECT_THAT(got, HasSubstr("\"1\"]"));  // the value: one succeeded plan
  auto flops = hap::testing::HttpGet(prom_port, "/api/v1/query?query=hap_device_peak_flops");
  ASSERT_TRUE(flops.ok());
  EXPECT_THAT(*flops, HasSubstr("\"device\":\"n1/cpu0\""));
  EXPECT_THAT(*flops, HasSubstr("1500000000000"));
  prom.Stop(SIGTERM);
}

TEST(PlannerTlsTest, ServesTlsWithTheTokenAndRefusesPlaintext) {
  std::string dir = hap::testing::TempDir("tls");
  ASSERT_NO_FATAL_FAILURE(MakeTestCertificate(dir));
  Planner p;
  p.Start(dir, {"--tls-cert-file=" + dir + "/cert.pem", "--tls-key-file=" + dir + "/key.pem"});
  service::Security s;
  s.token = kToken;
  s.tls_ca_file = dir + "/cert.pem";
  auto stub = v1::Planner::NewStub(*service::MakeChannel(p.Address(), s));
  grpc::ClientContext ok_ctx;
  service::PrepareClientContext(&ok_ctx, s, absl::Seconds(10));
  v1::ListNodesRequest r;
  v1::ListNodesResponse out;
  grpc::Status st = stub->ListNodes(&ok_ctx, r, &out);
  EXPECT_TRUE(st.ok()) << st.error_message();
  // Over TLS but without the token.
  service::Security no_token = s;
  no_token.token.clear();
  grpc::ClientContext anon;
  service::PrepareClientContext(&anon, no_token, absl::Seconds(10));
  EXPECT_EQ(stub->ListNodes(&anon, r, &out).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // Plaintext to a TLS server does not get through.
  auto plain = v1::Planner::NewStub(*service::MakeChannel(p.Address(), {}));
  EXPECT_FALSE(plain->ListNodes(Ctx(true, 3).get(), r, &out).ok());
  // The status page and /metrics are HTTPS with the same certificate: the
  // token is not sent in clear (plain HTTP gets no answer).
  absl::StatusOr<std::string> plain_page =
      hap::testing::HttpGet(p.metrics_port, "/status", absl::Seconds(5), kToken);
  EXPECT_FALSE(plain_page.ok());
  EXPECT_THAT(plain_page.status().message(), HasSubstr("no HTTP response"));
  const std::string fetch = absl::StrCat(
      "printf 'GET /status HTTP/1.0\\r\\nAuthorization: Bearer ", kToken,
      "\\r\\n\\r\\n' | timeout 20 openssl s_client -quiet -verify_return_error -CAfile ", dir,
      "/cert.pem -verify_ip 127.0.0.1 -connect 127.0.0.1:", p.metrics_port, " 2>/dev/null > ", dir,
      "/status.out");
  EXPECT_EQ(std::system(fetch.c_str()), 0) << fetch;
  std::ifstream got(dir + "/status.out");
  const std::string page((std::istreambuf_iterator<char>(got)), std::istreambuf_iterator<char>());
  EXPECT_THAT(page, HasSubstr("HTTP/1.1 200 OK"));
  EXPECT_THAT(page, HasSubstr("<html"));
  p.proc.Stop(SIGTERM);
}

// An executor over TLS that takes every plan (with the token) and reports
// TRAINING: what the planner's push looks like from the executor's side.
class TlsFakeExecutor final : public v1::Executor::Service {
 public:
  grpc::Status LoadPlan(grpc::ServerContext* ctx, const v1::LoadPlanRequest* r,
                        v1::LoadPlanResponse*) override {
    if (grpc::Status s = service::CheckToken(ctx, kToken); !s.ok()) return s;
    loads_.fetch_add(1);
    deployment_ = r->deployment();
    return grpc::Status::OK;
  }
  grpc::Status StartTraining(grpc::ServerContext*, const v1::StartTrainingRequest*,
                             v1::ExecutorStatus* out) override {
    out->set_state(v1::ExecutorStatus::TRAINING);
    return grpc::Status::OK;
  }
  int loads() const { return loads_.load(); }

 private:
  std::atomic<int> loads_{0};
  std::string deployment_;
};

// hap-planner --tls-ca-file: plans go to executors that serve TLS (the
// planner dialled them in plaintext, so a TLS executor never got a plan),
// and a CA bundle that cannot be read stops the planner at start.
TEST(PlannerTlsTest, PlansGoToTlsExecutorsWithTheCaBundle) {
  std::string dir = hap::testing::TempDir("tls-executors");
  ASSERT_NO_FATAL_FAILURE(MakeTestCertificate(dir));
  service::Security tls;
  tls.token = kToken;
  tls.tls_cert_file = dir + "/cert.pem";
  tls.tls_key_file = dir + "/key.pem";
  auto creds = service::MakeServerCredentials(tls);
  ASSERT_TRUE(creds.ok()) << creds.status();
  TlsFakeExecutor executors[2];
  std::unique_ptr<grpc::Server> servers[2];
  int ports[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", *creds, &ports[i]);
    b.RegisterService(&executors[i]);
    servers[i] = b.BuildAndStart();
    ASSERT_TRUE(servers[i] != nullptr && ports[i] > 0);
  }
  Planner p;
  p.Start(dir, {"--tls-ca-file=" + dir + "/cert.pem"});
  auto stub = p.Stub();
  v1::RegisterNodeRequest reg;
  *reg.mutable_node() = FakeNode("n1", 1e12);
  v1::RegisterNodeResponse rr;
  ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  v1::CreatePlanRequest r = Mlp();
  r.set_plan_id("tls");
  v1::Plan plan;
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), r, &plan).ok());
  ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  v1::DeployPlanRequest deploy;
  deploy.set_plan("plans/tls");
  (*deploy.mutable_executors())["n1/cpu0"] = absl::StrCat("127.0.0.1:", ports[0]);
  (*deploy.mutable_executors())["n1/cpu1"] = absl::StrCat("127.0.0.1:", ports[1]);
  deploy.mutable_training()->set_steps(5);
  v1::Deployment d;
  grpc::Status s = stub->DeployPlan(Ctx().get(), deploy, &d);
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (int tries = 0; tries < 600 && executors[0].loads() + executors[1].loads() < 2; ++tries) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(executors[0].loads(), 1);
  EXPECT_EQ(executors[1].loads(), 1);
  p.proc.Stop(SIGTERM);
  for (auto& server : servers) server->Shutdown();

  Planner bad;
  ASSERT_TRUE(
      bad.proc
          .Start({hap::testing::Runfile("planner/service/hap-planner"), "--listen=127.0.0.1:0",
                  "--metrics-listen=off", "--database=", "--tls-ca-file=" + dir + "/missing.pem"})
          .ok());
  auto line = bad.proc.WaitForLine("error: ", absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status() << "\n" << bad.proc.output();
  EXPECT_THAT(*line, AllOf(HasSubstr("--tls-ca-file"), HasSubstr("missing.pem")));
  const int status = bad.proc.Stop(0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status;
}

// --- Authentication before the message is read (issue 15 item 5) ---------

// A field of /proc/PID/status in KiB ("VmHWM", "VmRSS"), or -1.
int64_t ProcKib(pid_t pid, const std::string& field) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    int64_t kib = -1;
    std::string number(absl::StripAsciiWhitespace(line.substr(field.size() + 1)));
    number = number.substr(0, number.find(' '));
    if (absl::SimpleAtoi(number, &kib)) return kib;
  }
  return -1;
}

// One GET with `headers` ("Name: value\r\n" lines); returns the status code
// (0 when there is no answer) and the body.
std::pair<int, std::string> HttpGetWith(int port, const std::string& path,
                                        const std::string& headers) {
  const int s = testing::ConnectLoopback(port);
  if (s < 0) return {0, ""};
  std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n", headers, "\r\n");
  (void)!write(s, req.data(), req.size());
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(s, buf, sizeof(buf))) > 0) resp.append(buf, n);
  close(s);
  int code = 0;
  if (resp.size() > 12) (void)absl::SimpleAtoi(resp.substr(9, 3), &code);
  size_t body = resp.find("\r\n\r\n");
  return {code, body == std::string::npos ? "" : resp.substr(body + 4)};
}

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo with one
// list_services request, through the generic stub (no generated code):
// the call's status and the response's bytes.
std::pair<grpc::Status, std::string> ListServicesByReflection(int port, bool token) {
  auto channel = *service::MakeChannel(absl::StrCat("127.0.0.1:", port), {});
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  auto ctx = Ctx(token, 10);
  auto call = stub.PrepareCall(
      ctx.get(), "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  auto step = [&](intptr_t want) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), want);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  // ServerReflectionRequest{list_services: ""}: field 7, length 0.
  grpc::Slice request(std::string("\x3a\x00", 2));
  grpc::ByteBuffer out(&request, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  step(2);
  call->WritesDone(reinterpret_cast<void*>(3));
  step(3);
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(4));
  std::string response;
  if (step(4)) {
    std::vector<grpc::Slice> slices;
    if (in.Dump(&slices).ok()) {
      for (const auto& sl : slices)
        response.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return {status, response};
}

TEST(PlannerAuthTest, TokenlessCallsAreRefusedBeforeTheirMessagesAreRead) {
  Planner p;
  // A request limit far above the messages below: only the token check
  // can refuse them.
  p.Start(hap::testing::TempDir("auth"), {"--max-request-bytes=536870912"});
  auto stub = p.Stub();
  v1::ListNodesResponse nodes;
  ASSERT_TRUE(stub->ListNodes(Ctx().get(), {}, &nodes).ok());
  const int64_t peak_before = ProcKib(p.proc.pid(), "VmHWM");
  ASSERT_GT(peak_before, 0);

  // Four concurrent token-less 64 MiB requests (two StoreSets, two
  // CreatePlans): refused, UNAUTHENTICATED, and the planner's peak RSS does
  // not grow by their size (read first, they would add at least 256 MiB).
  constexpr int kMib = 1 << 20;
  v1::StoreSetRequest set;
  set.set_deployment("deployments/anything-g1");
  set.set_generation(1);
  set.set_key("k");
  set.set_value(std::string(64 * kMib, 'v'));
  v1::CreatePlanRequest create = Mlp();
  create.set_plan_id(std::string(64 * kMib, 'x'));
  std::vector<grpc::Status> results(4);
  std::vector<std::thread> callers;
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      auto ctx = Ctx(/*token=*/false, 60);
      if (i % 2 == 0) {
        v1::StoreSetResponse out;
        results[i] = stub->StoreSet(ctx.get(), set, &out);
      } else {
        v1::Plan out;
        results[i] = stub->CreatePlan(ctx.get(), create, &out);
      }
    });
  }
  for (auto& t : callers) t.join();
  for (const grpc::Status& s : results) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("bearer token"));
  }
  const int64_t peak_after = ProcKib(p.proc.pid(), "VmHWM");
  std::cout << "planner peak RSS " << peak_before << " KiB before, " << peak_after
            << " KiB after 4 x 64 MiB token-less requests\n";
  EXPECT_LT(peak_after - peak_before, 32 * 1024)
      << "peak RSS grew from " << peak_before << " KiB to " << peak_after << " KiB";
  // A wrong token is no token.
  service::Security wrong;
  wrong.token = "not-the-token";
  grpc::ClientContext wrong_ctx;
  service::PrepareClientContext(&wrong_ctx, wrong, absl::Seconds(10));
  EXPECT_EQ(stub->ListNodes(&wrong_ctx, {}, &nodes).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // The planner serves on, and health stays open without the token.
  EXPECT_TRUE(stub->ListNodes(Ctx().get(), {}, &nodes).ok());
  EXPECT_EQ(Health(p.port, "hap.v1.Planner"), grpc::health::v1::HealthCheckResponse::SERVING);
  p.proc.Stop(SIGTERM);
}

// Calls refused by the token check never reach a handler; they are still
// counted in grpc_server_handled_total (Unauthenticated), under their
// method when it is the planner's and under "(other)" otherwise, so that
// an unknown path cannot add label values.
TEST_F(PlannerServiceTest, TokenlessCallsAreCountedAsUnauthenticated) {
  auto stub = planner_.Stub();
  v1::GetPlanRequest g;
  g.set_name("plans/nothing");
  v1::Plan plan;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(stub->GetPlan(Ctx(false).get(), g, &plan).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(ListServicesByReflection(planner_.port, /*token=*/false).first.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // With the token: NotFound, counted by the handler.
  EXPECT_EQ(stub->GetPlan(Ctx().get(), g, &plan).error_code(), grpc::StatusCode::NOT_FOUND);

  auto text = hap::testing::HttpGet(planner_.metrics_port, "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("grpc_server_handled_total{grpc_type=\"unary\","
                               "grpc_service=\"hap.v1.Planner\",grpc_method=\"GetPlan\","
                               "grpc_code=\"Unauthenticated\"} 3"));
  EXPECT_THAT(*text, HasSubstr("grpc_server_handled_total{grpc_type=\"unary\","
                               "grpc_service=\"hap.v1.Planner\",grpc_method=\"GetPlan\","
                               "grpc_code=\"NotFound\"} 1"));
  EXPECT_THAT(*text, HasSubstr("grpc_server_handled_total{grpc_type=\"unary\","
                               "grpc_service=\"(other)\",grpc_method=\"(other)\","
                               "grpc_code=\"Unauthenticated\"} 1"));
  EXPECT_THAT(*text, HasSubstr("grpc_server_started_total{grpc_type=\"unary\","
                               "grpc_service=\"hap.v1.Planner\",grpc_method=\"GetPlan\"} 4"));
}

TEST_F(PlannerServiceTest, ReflectionAndTheStatusPageNeedTheTokenHealthAndMetricsDoNot) {
  // Reflection: refused without the token, served with it.
  auto [anon, anon_bytes] = ListServicesByReflection(planner_.port, /*token=*/false);
  EXPECT_EQ(anon.error_code(), grpc::StatusCode::UNAUTHENTICATED) << anon.error_message();
  EXPECT_EQ(anon_bytes.find("hap.v1.Planner"), std::string::npos);
  auto [authed, authed_bytes] = ListServicesByReflection(planner_.port, /*token=*/true);
  EXPECT_TRUE(authed.ok()) << authed.error_message();
  EXPECT_THAT(authed_bytes, HasSubstr("hap.v1.Planner"));
  // The status page: 401 with a Basic challenge without the token; the
  // token as a bearer token or a Basic password opens it.
  auto [code, body] = HttpGetWith(planner_.metrics_port, "/status", "");
  EXPECT_EQ(code, 401) << body;
  EXPECT_EQ(body.find("HAP planner status"), std::string::npos);
  auto [wrong, wrong_body] =
      HttpGetWith(planner_.metrics_port, "/status", "Authorization: Bearer guess\r\n");
  EXPECT_EQ(wrong, 401);
  auto [bearer, page] = HttpGetWith(planner_.metrics_port, "/status",
                                    absl::StrCat("Authorization: Bearer ", kToken, "\r\n"));
  EXPECT_EQ(bearer, 200);
  EXPECT_THAT(page, HasSubstr("HAP planner status"));
  auto [basic, basic_page] =
      HttpGetWith(planner_.metrics_port, "/status/plans/none",
                  absl::StrCat("Authorization: Basic ",
                               absl::Base64Escape(absl::StrCat("me:", kToken)), "\r\n"));
  EXPECT_EQ(basic, 404) << basic_page;  // past the token: no such plan
  // Health (gRPC and HTTP) and /metrics stay open.
  EXPECT_EQ(Health(planner_.port, ""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(hap::testing::HttpGet(planner_.metrics_port, "/healthz").ok());
  auto metrics = hap::testing::HttpGet(planner_.metrics_port, "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("hap_nodes{state=\"ready\"}"));
}

// --- Retention and bounded labels (issue 15 item 7) -----------------------

TEST(PlannerRetentionTest, RetentionFlagsBoundPlansDeploymentsKeepTheirsAndLabelsStaySmall) {
  Planner p;
  p.Start(hap::testing::TempDir("retention"), {"--plan-retention-count=2"});
  auto stub = p.Stub();
  v1::CreatePlanRequest r;
  v1::DeployPlanRequest deploy;
  ASSERT_NO_FATAL_FAILURE(RegisterAndPlanDeployed(stub.get(), &r, &deploy));
  v1::Plan plan;
  // A deployment (to executors that are not there) keeps its plan.
  v1::Deployment d;
  grpc::Status s = stub->DeployPlan(Ctx().get(), deploy, &d);
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (int i = 1; i <= 4; ++i) {
    r.set_plan_id(absl::StrCat("p", i));
    ASSERT_TRUE(stub->CreatePlan(Ctx().get(), r, &plan).ok());
    ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED);
  }
  auto names = [](v1::Planner::Stub* st) {
    v1::ListPlansRequest lp;
    v1::ListPlansResponse out;
    EXPECT_TRUE(st->ListPlans(Ctx().get(), lp, &out).ok());
    std::vector<std::string> n;
    for (const auto& x : out.plans()) n.push_back(x.name());
    return n;
  };
  const std::vector<std::string> kept = {"plans/deployed", "plans/p3", "plans/p4"};
  EXPECT_EQ(names(stub.get()), kept);

  // A model name of 100,000 characters: the model label is 64 of them, so
  // /metrics stays small.
  auto g =
      graph::BuildZooModel("mlp", {{"layers", 2}, {"hidden", 64}, {"input", 32}, {"batch", 32}});
  ASSERT_TRUE(g.ok());
  v1::CreatePlanRequest named;
  *named.mutable_model()->mutable_graph() = graph::ToProto(*g);
  named.mutable_model()->mutable_graph()->set_name(std::string(100'000, 'm') + "\"{}\n");
  named.set_wait(true);
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), named, &plan).ok());
  ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  auto text = hap::testing::HttpGet(p.metrics_port, "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_LT(text->size(), 32u << 10);
  EXPECT_THAT(*text, HasSubstr(absl::StrCat("hap_plan_predicted_step_seconds{model=\"",
                                            std::string(64, 'm'), "\"}")));

  // Deleted from the database too: a restart finds the same plans.
  p.proc.Stop(SIGKILL);
  Planner again;
  again.Start(p.dir, {"--plan-retention-count=2"});
  auto again_stub = again.Stub();
  std::vector<std::string> after = names(again_stub.get());
  EXPECT_EQ(after.size(), 3u);
  EXPECT_EQ(after.front(), "plans/deployed");
  again.proc.Stop(SIGTERM);
}

// Finished deployments past --deployment-retention-count go with their step
// metrics, from the database too (deployments and their metrics were kept
// forever, and all loaded at every start); their plan is then free.
TEST(PlannerRetentionTest, FinishedDeploymentsPastTheCountAreDeletedWithTheirMetrics) {
  Planner p;
  p.Start(hap::testing::TempDir("deployment-retention"));
  auto stub = p.Stub();
  v1::CreatePlanRequest r;
  v1::DeployPlanRequest deploy;
  ASSERT_NO_FATAL_FAILURE(RegisterAndPlanDeployed(stub.get(), &r, &deploy));
  v1::Plan plan;
  // Two deployments to executors that are not there: both fail.
  std::vector<std::string> names;
  for (int i = 0; i < 2; ++i) {
    v1::Deployment d;
    ASSERT_NO_FATAL_FAILURE(DeployAndWaitUntilFailed(stub.get(), deploy, &d));
    names.push_back(d.name());
    EXPECT_TRUE(d.has_end_time()) << d.DebugString();
  }
  p.proc.Stop(SIGKILL);
  // Restarted with a count of 1: the start's pass deletes the older one.
  Planner again;
  again.Start(p.dir, {"--deployment-retention-count=1", "--plan-retention-count=1"});
  auto again_stub = again.Stub();
  v1::ListDeploymentsResponse listed;
  ASSERT_TRUE(again_stub->ListDeployments(Ctx().get(), {}, &listed).ok());
  ASSERT_EQ(listed.deployments_size(), 1);
  EXPECT_EQ(listed.deployments(0).name(), names[1]);
  v1::ListStepMetricsRequest lm;
  lm.set_deployment(names[0]);
  v1::ListStepMetricsResponse metrics;
  EXPECT_EQ(again_stub->ListStepMetrics(Ctx().get(), lm, &metrics).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // The newest deployment still holds its plan.
  v1::GetPlanRequest gp;
  gp.set_name("plans/deployed");
  EXPECT_TRUE(again_stub->GetPlan(Ctx().get(), gp, &plan).ok());
  again.proc.Stop(SIGTERM);
}

// Deployment names are never reused: with every deployment of a plan
// deleted by retention, a restarted planner went on at g1 again (the
// generation came from the deployments still stored), so "deployments/
// deployed-g1" named two different runs in logs, dashboards and alerts.
TEST(PlannerRetentionTest, GenerationsGoOnAfterEveryDeploymentOfThePlanIsDeleted) {
  Planner p;
  p.Start(hap::testing::TempDir("generations"));
  auto stub = p.Stub();
  v1::CreatePlanRequest r;
  v1::DeployPlanRequest deploy;
  ASSERT_NO_FATAL_FAILURE(RegisterAndPlanDeployed(stub.get(), &r, &deploy));
  for (int i = 0; i < 2; ++i) {
    v1::Deployment d;
    ASSERT_NO_FATAL_FAILURE(DeployAndWaitUntilFailed(stub.get(), deploy, &d));
  }
  p.proc.Stop(SIGKILL);
  // Restarted keeping no finished deployment: both go at the start.
  Planner again;
  again.Start(p.dir, {"--deployment-retention-seconds=0.001"});
  auto again_stub = again.Stub();
  v1::ListDeploymentsResponse listed;
  ASSERT_TRUE(again_stub->ListDeployments(Ctx().get(), {}, &listed).ok());
  ASSERT_EQ(listed.deployments_size(), 0);
  again.proc.Stop(SIGKILL);
  // A planner that starts with none of them stored.
  Planner third;
  third.Start(p.dir);
  v1::Deployment d;
  grpc::Status s = third.Stub()->DeployPlan(Ctx().get(), deploy, &d);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(d.name(), "deployments/deployed-g3");
  EXPECT_EQ(d.generation(), 3);
  third.proc.Stop(SIGTERM);
}

TEST(PlannerLimitsTest, TheDefaultRequestLimitAdmitsA48LayerGptManyTimesOver) {
  // GPT-2 XL's shape: 48 layers, hidden 1600, 25 heads, 1024 tokens, a
  // 50257-word vocabulary (1.6 B parameters, 1303 ops).
  auto g = graph::BuildZooModel("gpt", {{"layers", 48},
                                        {"hidden", 1600},
                                        {"heads", 25},
                                        {"ffn", 6400},
                                        {"seq", 1024},
                                        {"vocab", 50257},
                                        {"batch", 8}});
  ASSERT_TRUE(g.ok()) << g.status();
  v1::CreatePlanRequest r;
  *r.mutable_model()->mutable_graph() = graph::ToProto(*g);
  const size_t bytes = r.ByteSizeLong();
  std::cout << "CreatePlan of a 48-layer GPT: " << g->ops().size() << " ops, " << bytes
            << " bytes\n";
  EXPECT_LT(bytes * 16, static_cast<size_t>(service::kDefaultMaxRequestBytes));
}

// The HTTP/2 SETTINGS the planner sends a new plaintext connection
// (setting id -> value), read from the socket after the client preface.
std::map<int, uint32_t> ServerHttp2Settings(int port) {
  std::map<int, uint32_t> settings;
  const int fd = testing::ConnectLoopback(port);
  if (fd < 0) return settings;
  // The connection preface, then an empty SETTINGS frame (length 0, type 4).
  const std::string hello =
      std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string("\0\0\0\x04\0\0\0\0\0", 9);
  if (write(fd, hello.data(), hello.size()) != static_cast<ssize_t>(hello.size())) {
    close(fd);
    return settings;
  }
  auto read_exactly = [fd](size_t n) {
    std::string out(n, '\0');
    size_t got = 0;
    while (got < n) {
      const ssize_t r = read(fd, &out[got], n - got);
      if (r <= 0) return std::string();
      got += r;
    }
    return out;
  };
  // Frames until the server's own SETTINGS (type 4 without the ACK flag).
  for (int frames = 0; frames < 16; ++frames) {
    const std::string h = read_exactly(9);
    if (h.empty()) break;
    const auto* u = reinterpret_cast<const unsigned char*>(h.data());
    const size_t length = (u[0] << 16) | (u[1] << 8) | u[2];
    const std::string payload = length > 0 ? read_exactly(length) : std::string();
    if (length > 0 && payload.empty()) break;
    if (u[3] != 4 || (u[4] & 1) != 0) continue;
    const auto* p = reinterpret_cast<const unsigned char*>(payload.data());
    for (size_t i = 0; i + 6 <= length; i += 6) {
      settings[(p[i] << 8) | p[i + 1]] =
          (uint32_t{p[i + 2]} << 24) | (p[i + 3] << 16) | (p[i + 4] << 8) | p[i + 5];
    }
    break;
  }
  close(fd);
  return settings;
}

// --max-concurrent-streams bounds the calls one client connection has open
// on the planner (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, id 3): 64 by
// default, the flag's value when given.
TEST(PlannerLimitsTest, EachConnectionsOpenCallsAreBounded) {
  constexpr int kMaxConcurrentStreams = 3;
  for (const auto& [flag, expected] :
       std::vector<std::pair<std::string, uint32_t>>{{"", 64}, {"--max-concurrent-streams=7", 7}}) {
    Planner p;
    std::vector<std::string> extra;
    if (!flag.empty()) extra.push_back(flag);
    p.Start(testing::TempDir("streams"), extra);
    const std::map<int, uint32_t> settings = ServerHttp2Settings(p.port);
    ASSERT_EQ(settings.count(kMaxConcurrentStreams), 1u) << flag << ": no such setting";
    EXPECT_EQ(settings.at(kMaxConcurrentStreams), expected) << flag;
    // The planner still answers over gRPC.
    v1::ListNodesResponse nodes;
    EXPECT_TRUE(p.Stub()->ListNodes(Ctx().get(), {}, &nodes).ok()) << flag;
    p.proc.Stop(SIGTERM);
  }
}

// Out-of-range flag values stop the planner at start with the flag's name,
// rather than being replaced silently or cast past int's range.
TEST(PlannerFlagsTest, OutOfRangeFlagsAreRefusedAtStart) {
  const std::string dir = testing::TempDir("planner-flags");
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--missed-status-polls=0",
            "--missed-status-polls (or HAP_MISSED_STATUS_POLLS) must be a whole number from 1 to "
            "1000"},
           {"--missed-status-polls=2.5",
            "--missed-status-polls (or HAP_MISSED_STATUS_POLLS) must be a whole number"},
           {"--status-poll-seconds=-1",
            "--status-poll-seconds (or HAP_STATUS_POLL_SECONDS) must be a number from 0.001 to "
            "3600"},
           {"--max-threads=nan",
            "--max-threads (or HAP_MAX_THREADS) must be a whole number from 4 to 65536"},
           {"--max-threads=1e9",
            "--max-threads (or HAP_MAX_THREADS) must be a whole number from 4 to 65536"},
           {"--max-concurrent-streams=1.5",
            "--max-concurrent-streams (or HAP_MAX_CONCURRENT_STREAMS) must be a whole number"},
           {"--max-concurrent-streams=-1",
            "--max-concurrent-streams (or HAP_MAX_CONCURRENT_STREAMS) must be a whole number from "
            "0"},
           {"--heartbeat-seconds=inf",
            "--heartbeat-seconds (or HAP_HEARTBEAT_SECONDS) must be a number from 0.01 to 3600"},
           {"--heartbeat-seconds=0.001",
            "--heartbeat-seconds (or HAP_HEARTBEAT_SECONDS) must be a number from 0.01 to 3600"},
           {"--missed-heartbeats=1e12",
            "--missed-heartbeats (or HAP_MISSED_HEARTBEATS) must be a whole number from 1 to"},
           {"--workers=2.5", "--workers (or HAP_WORKERS) must be a whole number from 1 to 1024"},
           {"--max-request-bytes=1e18",
            "--max-request-bytes (or HAP_MAX_REQUEST_BYTES) must be a whole number from 1 to "
            "1073741824"},
           {"--plan-retention-count=-2",
            "--plan-retention-count (or HAP_PLAN_RETENTION_COUNT) must be a whole number from 0"},
           {"--drain-seconds=1e300",
            "--drain-seconds (or HAP_DRAIN_SECONDS) must be a number from 0 to 3600"}}) {
    Process p;
    ASSERT_TRUE(p.Start({testing::Runfile("planner/service/hap-planner"), "--listen=127.0.0.1:0",
                         "--metrics-listen=off", "--database=" + dir + "/planner.db", flag})
                    .ok());
    auto line = p.WaitForLine("error: ", absl::Seconds(30));
    ASSERT_TRUE(line.ok()) << flag << ": " << line.status() << "\n" << p.output();
    EXPECT_THAT(*line, HasSubstr(message)) << flag;
    const int status = p.Stop(0);  // no signal: waits for its exit
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << flag << ": " << status;
  }
  // In range, they are taken.
  Process p;
  ASSERT_TRUE(p.Start({testing::Runfile("planner/service/hap-planner"), "--listen=127.0.0.1:0",
                       "--metrics-listen=off", "--database=" + dir + "/planner.db",
                       "--status-poll-seconds=0.25", "--missed-status-polls=5", "--max-threads=16",
                       "--drain-seconds=0", "--node-expiry-seconds=0"})
                  .ok());
  EXPECT_TRUE(p.WaitForLine("listening on 127.0.0.1:").ok()) << p.output();
  p.Stop(SIGTERM);
}

// --help lists every flag the planner reads, with its default and range
// (it printed three of them and "... (see main.cc)").
TEST(PlannerFlagsTest, HelpListsEveryFlag) {
  Process p;
  ASSERT_TRUE(p.Start({testing::Runfile("planner/service/hap-planner"), "--help"}).ok());
  const int status = p.Stop(0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << p.output();
  for (const char* flag : {"--listen",
                           "--advertise",
                           "--metrics-listen",
                           "--database",
                           "--token-file",
                           "--tls-cert-file",
                           "--tls-key-file",
                           "--tls-ca-file",
                           "--heartbeat-seconds",
                           "--missed-heartbeats",
                           "--workers",
                           "--max-seconds",
                           "--max-request-bytes",
                           "--max-threads",
                           "--max-concurrent-streams",
                           "--status-poll-seconds",
                           "--missed-status-polls",
                           "--drain-seconds",
                           "--node-expiry-seconds",
                           "--plan-retention-count",
                           "--plan-retention-seconds",
                           "--deployment-retention-count",
                           "--deployment-retention-seconds"}) {
    EXPECT_THAT(p.output(), HasSubstr(std::string("  ") + flag + " ")) << flag;
  }
  EXPECT_THAT(p.output(), Not(HasSubstr("see main.cc")));
}

}  // namespace
}  // namespace hap
