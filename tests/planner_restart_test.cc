// Restart cycles: a planner SIGKILLed at random moments while a client
// creates, cancels and deletes plans and deploys them (to executors nobody
// runs, so each deployment fails), restarted on the same database, 25
// times. After every restart: every plan whose creation was acknowledged is
// there (unless its deletion was acknowledged), no acknowledged deletion is
// brought back, an acknowledged cancel stays CANCELLED (never runs again),
// no plan appears twice, every acknowledged deployment is there once, the
// node is there once; at the end the SQLite file
// passes PRAGMA integrity_check. Calls cut by the kill have no expectation.
#include <sqlite3.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "tests/service_harness.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::Process;

constexpr char kToken[] = "restart-token";

struct Planner {
  Process proc;
  int port = 0;
  void Start(const std::string& dir) {
    std::ofstream(dir + "/token") << kToken << "\n";
    ASSERT_TRUE(
        proc.Start({hap::testing::Runfile("planner/service/hap-planner"), "--listen=127.0.0.1:0",
                    "--metrics-listen=off", "--database=" + dir + "/planner.db",
                    "--token-file=" + dir + "/token", "--heartbeat-seconds=30",
                    // Every plan is kept: retention would rightly delete the
                    // oldest of the thousand-odd plans this test makes.
                    "--plan-retention-count=0", "--deployment-retention-count=0"})
            .ok());
    auto addr = proc.WaitForLine("listening on 127.0.0.1:");
    ASSERT_TRUE(addr.ok()) << addr.status();
    ASSERT_TRUE(absl::SimpleAtoi(*addr, &port));
  }
  std::unique_ptr<v1::Planner::Stub> Stub() const {
    return v1::Planner::NewStub(*service::MakeChannel(absl::StrCat("127.0.0.1:", port), {}));
  }
};

std::unique_ptr<grpc::ClientContext> Ctx(int seconds = 5) {
  auto c = std::make_unique<grpc::ClientContext>();
  service::Security s;
  s.token = kToken;
  service::PrepareClientContext(c.get(), s, absl::Seconds(seconds));
  return c;
}

v1::Node Node() {
  v1::Node n;
  n.set_name("n1");
  n.set_address("127.0.0.1:1");
  for (int i = 0; i < 2; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id(absl::StrCat("n1/cpu", i));
    d->set_kind(v1::CPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(1e12);
    d->set_memory_bytes(int64_t{8} << 30);
  }
  return n;
}

// What the client was told, per plan id. Ids with a call cut by the kill
// are "unknown" and only checked for duplicates.
enum class Told { kCreated, kCancelled, kDeleted, kUnknown };

class Ledger {
 public:
  void Set(const std::string& id, Told t) {
    std::lock_guard<std::mutex> l(mu_);
    told_[id] = t;
  }
  std::map<std::string, Told> Snapshot() {
    std::lock_guard<std::mutex> l(mu_);
    return told_;
  }
  std::vector<std::string> Known(Told t) {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<std::string> out;
    for (const auto& [id, v] : told_) {
      if (v == t) out.push_back(id);
    }
    return out;
  }

 // Deployments whose creation was acknowledged.
  void Deployed(const std::string& name) {
    std::lock_guard<std::mutex> l(mu_);
    deployed_.insert(name);
  }
  std::set<std::string> Deployments() {
    std::lock_guard<std::mutex> l(mu_);
    return deployed_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, Told> told_;
  std::set<std::string> deployed_;
};

v1::CreatePlanRequest Mlp(const std::string& id) {
  v1::CreatePlanRequest r;
  r.set_plan_id(id);
  r.mutable_model()->mutable_zoo()->set_name("mlp");
  auto& p = *r.mutable_model()->mutable_zoo()->mutable_params();
  p["layers"] = 2;
  p["hidden"] = 256;
  p["input"] = 64;
  p["batch"] = 64;
  return r;
}

// Random operations until `stop`; every outcome acknowledged goes into
// the ledger, every call in flight is marked unknown first.
void Client(Planner* p, Ledger* ledger, std::atomic<bool>* stop, int cycle, uint64_t seed) {
  auto stub = p->Stub();
  std::mt19937_64 rng(seed);
  for (int k = 0; !stop->load(); ++k) {
    const int op = static_cast<int>(rng() % 5);
    if (op <= 1) {
      const std::string id = absl::StrCat("c", cycle, "-", k);
      ledger->Set(id, Told::kUnknown);
      v1::Plan plan;
      if (stub->CreatePlan(Ctx().get(), Mlp(id), &plan).ok()) ledger->Set(id, Told::kCreated);
    } else {
      std::vector<std::string> created = ledger->Known(Told::kCreated);
      if (created.empty()) continue;
      const std::string id = created[rng() % created.size()];
      ledger->Set(id, Told::kUnknown);
      if (op == 4) {  // deploy: the plan is not touched (unless it is not done yet)
        ledger->Set(id, Told::kCreated);
        v1::DeployPlanRequest r;
        r.set_plan("plans/" + id);
        for (int d = 0; d < 2; ++d) {
          (*r.mutable_executors())[absl::StrCat("n1/cpu", d)] = absl::StrCat("127.0.0.1:", d + 1);
        }
        v1::Deployment dep;
        if (stub->DeployPlan(Ctx().get(), r, &dep).ok()) ledger->Deployed(dep.name());
      } else if (op == 2) {
        v1::CancelPlanRequest r;
        r.set_name("plans/" + id);
        v1::Plan plan;
        grpc::Status s = stub->CancelPlan(Ctx().get(), r, &plan);
        if (s.ok()) {
          ledger->Set(id, plan.state() == v1::Plan::CANCELLED ? Told::kCancelled : Told::kCreated);
        } else if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
          ledger->Set(id, Told::kCreated);  // already final: unchanged
        }
      } else {
        v1::DeletePlanRequest r;
        r.set_name("plans/" + id);
        v1::DeletePlanResponse resp;
        if (stub->DeletePlan(Ctx().get(), r, &resp).ok()) ledger->Set(id, Told::kDeleted);
      }
    }
  }
}

void CheckAgainst(Planner& p, Ledger& ledger, int cycle) {
  SCOPED_TRACE(absl::StrCat("after restart ", cycle));
  auto stub = p.Stub();
  std::map<std::string, v1::Plan::State> plans;
  std::string token;
  do {
    v1::ListPlansRequest r;
    r.set_page_size(500);
    r.set_page_token(token);
    v1::ListPlansResponse resp;
    grpc::Status s = stub->ListPlans(Ctx(30).get(), r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (const auto& plan : resp.plans()) {
      const std::string id = plan.name().substr(plan.name().find('/') + 1);
      EXPECT_TRUE(plans.emplace(id, plan.state()).second) << "plan " << id << " listed twice";
    }
    token = resp.next_page_token();
  } while (!token.empty());
  for (const auto& [id, told] : ledger.Snapshot()) {
    switch (told) {
      case Told::kCreated:
        EXPECT_TRUE(plans.count(id)) << "acknowledged plan " << id << " lost";
        break;
      case Told::kCancelled:
        ASSERT_TRUE(plans.count(id)) << "cancelled plan " << id << " lost";
        EXPECT_EQ(plans[id], v1::Plan::CANCELLED) << "cancelled plan " << id << " came back";
        break;
      case Told::kDeleted:
        EXPECT_FALSE(plans.count(id)) << "deleted plan " << id << " came back";
        break;
      case Told::kUnknown:
        break;
    }
  }
  std::set<std::string> deployments;
  token.clear();
  do {
    v1::ListDeploymentsRequest r;
    r.set_page_size(500);
    r.set_page_token(token);
    v1::ListDeploymentsResponse resp;
    grpc::Status s = stub->ListDeployments(Ctx(30).get(), r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (const auto& d : resp.deployments()) {
      EXPECT_TRUE(deployments.insert(d.name()).second) << d.name() << " listed twice";
      EXPECT_NE(d.state(), v1::Deployment::RUNNING) << d.name() << " runs on no executor";
    }
    token = resp.next_page_token();
  } while (!token.empty());
  for (const std::string& name : ledger.Deployments()) {
    EXPECT_TRUE(deployments.count(name)) << "acknowledged deployment " << name << " lost";
  }
  v1::ListNodesRequest ln;
  v1::ListNodesResponse nodes;
  ASSERT_TRUE(stub->ListNodes(Ctx().get(), ln, &nodes).ok());
  ASSERT_EQ(nodes.nodes_size(), 1);
  EXPECT_EQ(nodes.nodes(0).devices_size(), 2);
}

TEST(PlannerRestartTest, SigkillAtRandomMomentsLosesDuplicatesAndRevivesNothing) {
  const std::string dir = hap::testing::TempDir("restart");
  Ledger ledger;
  {
    Planner p;
    p.Start(dir);
    v1::RegisterNodeRequest reg;
    *reg.mutable_node() = Node();
    v1::RegisterNodeResponse rr;
    ASSERT_TRUE(p.Stub()->RegisterNode(Ctx().get(), reg, &rr).ok());
    p.proc.Stop(SIGKILL);
  }
  std::mt19937_64 rng(20261204);
  // 25 in CI; HAP_RESTART_CYCLES sets another count for long runs
  // (bazel test --test_env=HAP_RESTART_CYCLES=100).
  int kCycles = 25;
  if (const char* n = std::getenv("HAP_RESTART_CYCLES")) {
    ASSERT_TRUE(absl::SimpleAtoi(n, &kCycles) && kCycles > 0)
        << "HAP_RESTART_CYCLES must be a positive count, got '" << n << "'";
  }
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    Planner p;
    p.Start(dir);
    CheckAgainst(p, ledger, cycle);
    if (::testing::Test::HasFatalFailure()) return;
    std::atomic<bool> stop{false};
    std::thread client(Client, &p, &ledger, &stop, cycle, rng());
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 400));
    p.proc.Stop(SIGKILL);  // at a random moment of the client's work
    stop = true;
    client.join();
  }
  Planner last;
  last.Start(dir);
  CheckAgainst(last, ledger, kCycles);
  int created = 0;
  for (const auto& [id, told] : ledger.Snapshot()) created += told != Told::kUnknown;
  EXPECT_GT(created, kCycles) << "the client got too few calls through to test anything";
  EXPECT_GE(ledger.Deployments().size(), 3u) << "too few deployments got through";
  std::cout << kCycles << " SIGKILL cycles: " << created << " plans acknowledged, "
            << ledger.Deployments().size() << " deployments, none lost, duplicated or revived\n";
  last.proc.Stop(SIGTERM);

  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2((dir + "/planner.db").c_str(), &db, SQLITE_OPEN_READONLY, nullptr),
            SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &st, nullptr), SQLITE_OK);
  ASSERT_EQ(sqlite3_step(st), SQLITE_ROW);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(sqlite3_column_text(st, 0))), "ok");
  sqlite3_finalize(st);
  sqlite3_close(db);
}

}  // namespace
}  // namespace hap
