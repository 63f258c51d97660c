// hap-planner's status page in a real browser: the planner as a process on
// 127.0.0.1, two fake nodes registered over gRPC, a plan created, then
// headless Chromium (Debian `chromium`, installed by scripts/setup.sh)
// renders /status and a plan's page; the test reads the rendered DOM and
// takes a screenshot.
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "tests/service_harness.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::Process;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "status-page-token";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The chromium binary, or "" when it is not installed.
std::string Chromium() {
  for (const char* p : {"/usr/bin/chromium", "/usr/lib/chromium/chromium"}) {
    struct stat st;
    if (stat(p, &st) == 0 && (st.st_mode & S_IXUSR)) return p;
  }
  return "";
}

// A node of `devices` CPU devices of `flops` float32 FLOP/s and 16 GiB each.
v1::RegisterNodeRequest Register(const std::string& name, int devices, double flops) {
  v1::RegisterNodeRequest r;
  v1::Node& node = *r.mutable_node();
  node.set_name(name);
  node.set_address("127.0.0.1:9");
  for (int i = 0; i < devices; ++i) {
    v1::Device& d = *node.add_devices();
    d.set_id(absl::StrCat(name, "/cpu", i));
    d.set_model("fake cpu");
    d.set_kind(v1::CPU);
    d.set_memory_bytes(int64_t{16} << 30);
    v1::DtypeThroughput& t = *d.add_flops();
    t.set_dtype(v1::FLOAT32);
    t.set_flops(flops);
  }
  return r;
}

// A call context carrying the token, 60 s to run.
std::unique_ptr<grpc::ClientContext> Authorized() {
  service::Security security;
  security.token = kToken;
  auto ctx = std::make_unique<grpc::ClientContext>();
  service::PrepareClientContext(ctx.get(), security, absl::Seconds(60));
  return ctx;
}

class StatusPageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    chromium_ = Chromium();
    ASSERT_FALSE(chromium_.empty())
        << "Debian's chromium is not installed; run scripts/setup.sh (it installs every "
           "package the tests need).";
    dir_ = hap::testing::TempDir("status-page");
    std::ofstream(dir_ + "/token") << kToken << "\n";
    ASSERT_TRUE(planner_
                    .Start({hap::testing::Runfile("planner/service/hap-planner"),
                            "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
                            "--token-file=" + dir_ + "/token"})
                    .ok());
    auto addr = planner_.WaitForLine("listening on 127.0.0.1:");
    ASSERT_TRUE(addr.ok()) << addr.status();
    ASSERT_TRUE(absl::SimpleAtoi(*addr, &port_));
    auto m = planner_.WaitForLine("metrics on http://127.0.0.1:");
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(absl::SimpleAtoi(m->substr(0, m->find('/')), &metrics_port_));
  }

  // Runs headless chromium with `args` then `url`; its stdout goes to
  // `out`. A fresh profile each run; nothing leaves 127.0.0.1.
  void RunChromium(const std::string& args, const std::string& url, const std::string& out) {
    static int run = 0;
    const std::string profile = absl::StrCat(dir_, "/profile-", run++);
    const std::string log = out + ".log";
    const std::string cmd = absl::StrCat(
        "timeout 120 ", chromium_,
        " --headless --no-sandbox --disable-gpu --no-first-run"
        " --disable-background-networking --disable-component-update --disable-sync"
        " --disable-dev-shm-usage --user-data-dir=",
        profile, " ", args, " '", url, "' >", out, " 2>", log);
    const int rc = std::system(cmd.c_str());
    ASSERT_EQ(rc, 0) << cmd << "\n" << ReadFile(log);
  }

  // The page needs the token (HTTP Basic, any user name, the token as the
  // password): a browser takes it from the URL.
  std::string StatusUrl(const std::string& path) const {
    return absl::StrCat("http://hap:", kToken, "@127.0.0.1:", metrics_port_, path);
  }

  std::string DumpDom(const std::string& path) {
    static int n = 0;
    const std::string out = absl::StrCat(dir_, "/dom-", n++, ".html");
    RunChromium("--dump-dom", StatusUrl(path), out);
    return ReadFile(out);
  }

  std::string chromium_;
  std::string dir_;
  Process planner_;
  int port_ = 0;
  int metrics_port_ = 0;
};

TEST_F(StatusPageTest, ChromiumShowsNodesAndPlanAndTakesAScreenshot) {
  auto stub = v1::Planner::NewStub(*service::MakeChannel(absl::StrCat("127.0.0.1:", port_), {}));
  v1::RegisterNodeResponse registered;
  grpc::Status s = stub->RegisterNode(Authorized().get(), Register("status-fast", 2, 5e10),
                                      &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  s = stub->RegisterNode(Authorized().get(), Register("status-slow", 1, 2e10), &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::CreatePlanRequest req;
  req.mutable_model()->mutable_zoo()->set_name("mlp");
  auto& params = *req.mutable_model()->mutable_zoo()->mutable_params();
  params["layers"] = 2;
  params["hidden"] = 64;
  params["input"] = 32;
  params["batch"] = 32;
  req.set_wait(true);
  v1::Plan plan;
  s = stub->CreatePlan(Authorized().get(), req, &plan);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(plan.state(), v1::Plan::SUCCEEDED) << plan.error();
  const std::string id = plan.name().substr(plan.name().find('/') + 1);

  // (1) The index as the browser rendered it.
  const std::string dom = DumpDom("/status");
  EXPECT_THAT(dom, AllOf(HasSubstr("HAP planner status"), HasSubstr("status-fast"),
                         HasSubstr("status-slow"), HasSubstr("50.0 GFLOP/s"),
                         HasSubstr("20.0 GFLOP/s"), HasSubstr("16.00 GiB"), HasSubstr("READY"),
                         HasSubstr(plan.name()), HasSubstr("SUCCEEDED"),
                         HasSubstr(absl::StrCat("href=\"/status/plans/", id, "\""))))
      << dom;
  EXPECT_THAT(dom, Not(HasSubstr("<script")));

  // (2) A screenshot of it.
  const std::string png = dir_ + "/status.png";
  RunChromium(absl::StrCat("--window-size=1280,900 --screenshot=", png), StatusUrl("/status"),
              dir_ + "/shot.out");
  const std::string image = ReadFile(png);
  ASSERT_GT(image.size(), 10000u) << "screenshot " << png << " is missing or blank";
  EXPECT_EQ(image.substr(0, 8), "\x89PNG\r\n\x1a\n");
  if (const char* outputs = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR")) {
    std::ofstream(absl::StrCat(outputs, "/status.png"), std::ios::binary) << image;
  }

  // The plan's page: an op of its program, a ratio, the per-op table.
  std::string op;
  for (const auto& i : plan.program().instructions()) {
    if (i.kind() == v1::Instruction::COMPUTE) {
      op = i.op();
      break;
    }
  }
  ASSERT_FALSE(op.empty());
  ASSERT_GT(plan.ratios_size(), 0);
  ASSERT_GT(plan.ratios(0).ratios_size(), 0);
  const std::string plan_dom = DumpDom(absl::StrCat("/status/plans/", id));
  EXPECT_THAT(plan_dom, AllOf(HasSubstr(plan.name()), HasSubstr("id=\"ops\""), HasSubstr(op),
                              HasSubstr(absl::StrFormat("%.4f", plan.ratios(0).ratios(0))),
                              HasSubstr("status-fast/cpu0")))
      << plan_dom;

  // Bad and unknown ids are 404s with a reason, and the planner lives on.
  absl::StatusOr<std::string> missing = hap::testing::HttpGet(
      metrics_port_, "/status/plans/no-such-plan", absl::Seconds(10), kToken);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("404"));
  for (const char* bad : {"/status/plans/", "/status/plans/a/b", "/status/deployments/nope",
                          "/status/nothing-here"}) {
    absl::StatusOr<std::string> r =
        hap::testing::HttpGet(metrics_port_, bad, absl::Seconds(10), kToken);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("404")) << bad;
  }
  // Without the token the page is refused; health and metrics stay open.
  absl::StatusOr<std::string> anonymous = hap::testing::HttpGet(metrics_port_, "/status");
  ASSERT_FALSE(anonymous.ok());
  EXPECT_THAT(anonymous.status().message(), HasSubstr("401"));
  EXPECT_TRUE(hap::testing::HttpGet(metrics_port_, "/metrics").ok());
  const std::string not_found = DumpDom("/status/plans/no-such-plan");
  EXPECT_THAT(not_found, HasSubstr("There is no plan \"plans/no-such-plan\""));
  EXPECT_TRUE(hap::testing::HttpGet(metrics_port_, "/healthz").ok());
  EXPECT_TRUE(planner_.Running());
}

}  // namespace
}  // namespace hap
