#include "planner/service/core/planner_core.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/util/status_matchers.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

// A clock the test moves.
struct FakeClock {
  absl::Mutex mu;
  absl::Time t = absl::FromUnixSeconds(1'800'000'000);
  absl::Time Now() {
    absl::MutexLock l(&mu);
    return t;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock l(&mu);
    t += d;
  }
};

// Records what the core persists.
struct RecordingSink : PlannerStateSink {
  absl::Mutex mu;
  std::map<std::string, v1::Node> nodes;
  std::map<std::string, v1::Plan> plans;
  absl::Status SaveNode(const v1::Node& n) override {
    absl::MutexLock l(&mu);
    nodes[n.name()] = n;
    return absl::OkStatus();
  }
  absl::Status SavePlan(const v1::Plan& p) override {
    absl::MutexLock l(&mu);
    plans[p.name()] = p;
    return absl::OkStatus();
  }
  absl::Status DeletePlan(const std::string& name) override {
    absl::MutexLock l(&mu);
    plans.erase(name);
    return absl::OkStatus();
  }
};

v1::Node MakeNode(const std::string& name, int devices, double flops,
                  int64_t memory = int64_t{16} << 30) {
  v1::Node n;
  n.set_name(name);
  n.set_address("127.0.0.1:1");
  for (int i = 0; i < devices; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id(name + "/cpu" + std::to_string(i));
    d->set_kind(v1::CPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(flops);
    d->set_memory_bytes(memory);
  }
  return n;
}

v1::CreatePlanRequest MlpRequest(bool wait = true) {
  v1::CreatePlanRequest r;
  auto* zoo = r.mutable_model()->mutable_zoo();
  zoo->set_name("mlp");
  (*zoo->mutable_params())["layers"] = 2;
  (*zoo->mutable_params())["hidden"] = 32;
  (*zoo->mutable_params())["input"] = 16;
  (*zoo->mutable_params())["batch"] = 16;
  r.set_wait(wait);
  return r;
}

class PlannerCoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}, {}); }
  void Start(std::vector<v1::Node> nodes, std::vector<v1::Plan> plans) {
    core_.reset();
    PlannerCoreOptions o;
    o.now = [this] { return clock_.Now(); };
    o.heartbeat_interval = absl::Seconds(5);
    o.missed_heartbeats = 3;
    o.sink = &sink_;
    auto c = PlannerCore::Create(o, std::move(nodes), std::move(plans));
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = *std::move(c);
  }
  absl::Time Deadline() { return clock_.Now() + absl::Seconds(60); }

  FakeClock clock_;
  RecordingSink sink_;
  std::unique_ptr<PlannerCore> core_;
};

TEST_F(PlannerCoreTest, NoLiveNodeIsFailedPrecondition) {
  EXPECT_THAT(core_->CreatePlan(MlpRequest(), Deadline()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no live node")));
}

TEST_F(PlannerCoreTest, PlansFromRegisteredNodesAndKeepsRankProgramsForFullView) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  auto p = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  EXPECT_EQ(p->devices_size(), 4);
  EXPECT_EQ(p->rank_programs_size(), 0);  // BASIC view
  auto full = core_->GetPlan(p->name(), true);
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->rank_programs_size(), 4);
  EXPECT_FALSE(full->content_hash().empty());
  // Faster devices get more of the work.
  EXPECT_GT(full->ratios(0).ratios(0), full->ratios(0).ratios(2));
  // Persisted.
  absl::MutexLock l(&sink_.mu);
  EXPECT_EQ(sink_.plans.at(p->name()).state(), v1::Plan::SUCCEEDED);
  EXPECT_EQ(sink_.nodes.size(), 2u);
}

TEST_F(PlannerCoreTest, ReRegistrationDoesNotDuplicateAndDevicesAreOwnedOnce) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 3, 2e12)).ok());
  auto nodes = core_->ListNodes(0, "");
  ASSERT_TRUE(nodes.ok());
  ASSERT_EQ(nodes->nodes_size(), 1);
  EXPECT_EQ(nodes->nodes(0).devices_size(), 3);
  v1::Node thief = MakeNode("b", 1, 1e12);
  thief.mutable_devices(0)->set_id("a/cpu0");
  EXPECT_THAT(core_->RegisterNode(thief),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("'a/cpu0'")));
  v1::Node bad = MakeNode("c", 1, 0);
  EXPECT_THAT(core_->RegisterNode(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("FLOP/s")));
}

TEST_F(PlannerCoreTest, ANodeThatStopsHeartbeatingGoesStaleAndIsLeftOut) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(5));
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    auto r = core_->Heartbeat(hb);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->unknown_node());
  }
  v1::Cluster live = core_->GetCluster(false);
  ASSERT_EQ(live.nodes_size(), 1);
  EXPECT_EQ(live.nodes(0).name(), "a");
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
  auto p = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->devices_size(), 2);
  for (const auto& d : p->devices()) EXPECT_EQ(d.rfind("a/", 0), 0u) << d;
  // Asking for a stale device by name says why.
  v1::CreatePlanRequest r = MlpRequest();
  r.add_devices("a/cpu0");
  r.add_devices("b/cpu0");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale")));
  // A heartbeat brings it back, with a request to measure again.
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/b");
  auto back = core_->Heartbeat(hb);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->reprobe());
  EXPECT_EQ(core_->GetCluster(false).nodes_size(), 2);
  hb.set_name("nodes/nobody");
  EXPECT_TRUE(core_->Heartbeat(hb)->unknown_node());
}

TEST_F(PlannerCoreTest, BadRequestsGetSpecificStatuses) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.add_devices("z/gpu9");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'z/gpu9'")));
  // A malformed graph: the message names the op.
  auto g = graph::BuildZooModel("mlp", {{"layers", 1}, {"hidden", 8}, {"input", 4}, {"batch", 4}});
  ASSERT_TRUE(g.ok());
  v1::CreatePlanRequest bad;
  *bad.mutable_model()->mutable_graph() = graph::ToProto(*g);
  bad.mutable_model()->mutable_graph()->mutable_ops(0)->set_type("linear_v9");
  std::string op = bad.model().graph().ops(0).name();
  EXPECT_THAT(core_->CreatePlan(bad, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(op)));
  v1::CreatePlanRequest none;
  EXPECT_THAT(core_->CreatePlan(none, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model is required")));
  v1::CreatePlanRequest zoo = MlpRequest();
  zoo.mutable_model()->mutable_zoo()->set_name("resnet");
  EXPECT_THAT(core_->CreatePlan(zoo, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resnet")));
  v1::CreatePlanRequest id = MlpRequest();
  id.set_plan_id("Bad_Id");
  EXPECT_THAT(core_->CreatePlan(id, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan_id")));
  EXPECT_THAT(core_->ListPlans(-1, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_size")));
  EXPECT_THAT(core_->ListPlans(10, "garbage!"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  EXPECT_THAT(core_->GetPlan("plans/nope", false), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(core_->GetPlan("nope", false), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST_F(PlannerCoreTest, AModelThatFitsNowhereFailsWithResourceExhausted) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("tiny", 2, 1e12, 1 << 20)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  (*r.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 2048;
  auto p = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::FAILED);
  EXPECT_EQ(p->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(p->error(), HasSubstr("does not fit"));
}

TEST_F(PlannerCoreTest, TheSameRequestIsServedFromTheCache) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok());
  auto second = core_->CreatePlan(MlpRequest(/*wait=*/false), Deadline());
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->name(), first->name());
  EXPECT_EQ(second->state(), v1::Plan::SUCCEEDED);  // without waiting
  EXPECT_EQ(second->content_hash(), first->content_hash());
}

TEST_F(PlannerCoreTest, PagesThroughPlansAndDeletes) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (int i = 0; i < 5; ++i) {
    v1::CreatePlanRequest r = MlpRequest(false);
    r.set_plan_id("p" + std::to_string(i));
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  std::vector<std::string> names;
  std::string token;
  do {
    auto page = core_->ListPlans(2, token);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_LE(page->plans_size(), 2);
    for (const auto& p : page->plans()) names.push_back(p.name());
    token = page->next_page_token();
  } while (!token.empty());
  EXPECT_EQ(names, (std::vector<std::string>{"plans/p0", "plans/p1", "plans/p2", "plans/p3",
                                             "plans/p4"}));
  v1::CreatePlanRequest dup = MlpRequest(false);
  dup.set_plan_id("p0");
  EXPECT_THAT(core_->CreatePlan(dup, Deadline()), StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
  ASSERT_TRUE(core_->DeletePlan("plans/p3").ok());
  EXPECT_THAT(core_->GetPlan("plans/p3", false), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(core_->DeletePlan("plans/p3"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(PlannerCoreTest, WatchSeesTheFinalStateAndCancelStopsASearch) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 4, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 4, 1e12)).ok());
  // A search long enough to cancel: a 48-layer GPT with block search off is
  // not available through the API, so use a big budget on a large model.
  v1::CreatePlanRequest r;
  r.mutable_model()->mutable_zoo()->set_name("gpt");
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 96;
  r.mutable_options()->mutable_budget()->set_max_seconds(120);
  r.mutable_options()->set_ignore_memory_limits(true);
  auto p = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<v1::Plan::State> states;
  v1::Plan last;
  std::atomic<bool> cancelled{false};
  std::thread canceller([&] {
    while (!cancelled) {
      auto now = core_->GetPlan(p->name(), false);
      if (now.ok() && now->state() == v1::Plan::RUNNING) {
        cancelled = core_->CancelPlan(p->name()).ok();
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  absl::Status w = core_->WatchPlan(
      p->name(),
      [&](const v1::Plan& u) {
        states.push_back(u.state());
        last = u;
        return true;
      },
      [] { return false; });
  cancelled = true;
  canceller.join();
  ASSERT_TRUE(w.ok()) << w;
  ASSERT_FALSE(states.empty());
  // It either finished before the cancel landed or was cancelled.
  EXPECT_TRUE(states.back() == v1::Plan::CANCELLED || states.back() == v1::Plan::SUCCEEDED)
      << v1::Plan::State_Name(states.back()) << ": " << last.error();
  EXPECT_THAT(core_->WatchPlan("plans/none", [](const v1::Plan&) { return true; },
                               [] { return false; }),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(PlannerCoreTest, APlanCutOffByARestartRunsAgain) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto done = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(done.ok());
  v1::Plan interrupted;
  {
    absl::MutexLock l(&sink_.mu);
    interrupted = sink_.plans.at(done->name());
  }
  interrupted.set_name("plans/interrupted");
  interrupted.set_state(v1::Plan::RUNNING);
  interrupted.clear_rank_programs();
  std::vector<v1::Node> nodes;
  {
    absl::MutexLock l(&sink_.mu);
    for (auto& [n, node] : sink_.nodes) nodes.push_back(node);
  }
  Start(nodes, {interrupted});
  v1::Plan last;
  ASSERT_TRUE(core_->WatchPlan("plans/interrupted",
                               [&](const v1::Plan& u) {
                                 last = u;
                                 return true;
                               },
                               [] { return false; })
                  .ok());
  EXPECT_EQ(last.state(), v1::Plan::SUCCEEDED) << last.error();
  EXPECT_EQ(core_->GetPlan("plans/interrupted", true)->rank_programs_size(), 2);
}

}  // namespace
}  // namespace hap::service
