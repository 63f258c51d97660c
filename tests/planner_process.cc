#include "tests/planner_process.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_util.h"
#include "gtest/gtest.h"

namespace hap::testing {

namespace v1 = ::hap::v1;

void Planner::Start(const std::string& state_dir, std::vector<std::string> extra) {
  dir = state_dir;
  std::ofstream(dir + "/token") << kToken << "\n";
  std::vector<std::string> argv = {Runfile("planner/service/hap-planner"),
                                   "--listen=127.0.0.1:0",
                                   "--metrics-listen=127.0.0.1:0",
                                   "--database=" + dir + "/planner.db",
                                   "--token-file=" + dir + "/token",
                                   "--heartbeat-seconds=0.5",
                                   "--missed-heartbeats=2",
                                   "--drain-seconds=1.5",
                                   "--max-request-bytes=1048576"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  ASSERT_TRUE(proc.Start(argv).ok());
  auto addr = proc.WaitForLine("listening on 127.0.0.1:");
  ASSERT_TRUE(addr.ok()) << addr.status();
  ASSERT_TRUE(absl::SimpleAtoi(*addr, &port));
  auto m = proc.WaitForLine("metrics on ");  // http:// or, with TLS, https://
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string at = "://127.0.0.1:";
  ASSERT_NE(m->find(at), std::string::npos) << *m;
  const std::string port_on = m->substr(m->find(at) + at.size());
  ASSERT_TRUE(absl::SimpleAtoi(port_on.substr(0, port_on.find('/')), &metrics_port)) << *m;
}

std::string Planner::Address() const { return absl::StrCat("127.0.0.1:", port); }

std::unique_ptr<v1::Planner::Stub> Planner::Stub() const {
  return v1::Planner::NewStub(*service::MakeChannel(Address(), {}));
}

std::unique_ptr<grpc::ClientContext> Ctx(bool token, int seconds) {
  auto c = std::make_unique<grpc::ClientContext>();
  service::Security s;
  if (token) s.token = kToken;
  service::PrepareClientContext(c.get(), s, absl::Seconds(seconds));
  return c;
}

v1::Node FakeNode(const std::string& name, double flops) {
  v1::Node n;
  n.set_name(name);
  n.set_address("127.0.0.1:1");
  for (int i = 0; i < 2; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id(absl::StrCat(name, "/cpu", i));
    d->set_kind(v1::CPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(flops);
    d->set_memory_bytes(int64_t{8} << 30);
  }
  return n;
}

v1::CreatePlanRequest Mlp(bool wait) {
  v1::CreatePlanRequest r;
  r.mutable_model()->mutable_zoo()->set_name("mlp");
  auto& p = *r.mutable_model()->mutable_zoo()->mutable_params();
  p["layers"] = 2;
  p["hidden"] = 64;
  p["input"] = 32;
  p["batch"] = 32;
  r.set_wait(wait);
  return r;
}

void MakeTestCertificate(const std::string& dir) {
  std::string cmd =
      absl::StrCat("openssl req -x509 -newkey rsa:2048 -nodes -keyout ", dir, "/key.pem -out ", dir,
                   "/cert.pem -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 -days 1 "
                   ">/dev/null 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make a test certificate";
}

void RegisterAndPlanDeployed(v1::Planner::Stub* stub, v1::CreatePlanRequest* r,
                             v1::DeployPlanRequest* deploy) {
  v1::RegisterNodeRequest reg;
  *reg.mutable_node() = FakeNode("n1", 1e12);
  v1::RegisterNodeResponse rr;
  ASSERT_TRUE(stub->RegisterNode(Ctx().get(), reg, &rr).ok());
  *r = Mlp();
  r->set_plan_id("deployed");
  v1::Plan plan;
  ASSERT_TRUE(stub->CreatePlan(Ctx().get(), *r, &plan).ok());
  ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  deploy->set_plan("plans/deployed");
  (*deploy->mutable_executors())["n1/cpu0"] = "127.0.0.1:1";
  (*deploy->mutable_executors())["n1/cpu1"] = "127.0.0.1:2";
}

void DeployAndWaitUntilFailed(v1::Planner::Stub* stub, const v1::DeployPlanRequest& deploy,
                              v1::Deployment* d) {
  grpc::Status s = stub->DeployPlan(Ctx().get(), deploy, d);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::GetDeploymentRequest g;
  g.set_name(d->name());
  for (int tries = 0; tries < 600 && d->state() != v1::Deployment::FAILED; ++tries) {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(stub->GetDeployment(Ctx().get(), g, d).ok());
  }
  ASSERT_EQ(d->state(), v1::Deployment::FAILED) << d->DebugString();
}

}  // namespace hap::testing
