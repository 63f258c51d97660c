#include "planner/service/core/planner_core.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_file.h"
#include "planner/util/status_matchers.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
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

// Records what the core persists; refuses writes on demand, as a store on
// a full disk does.
struct RecordingSink : PlannerStateSink {
  absl::Mutex mu;
  std::map<std::string, v1::Node> nodes;
  std::map<std::string, v1::Plan> plans;
  // Plans saved in these states are refused; so is every node write while
  // refuse_nodes is set.
  std::set<v1::Plan::State> refuse_plan_states;
  bool refuse_nodes = false;

  static absl::Status Full() {
    return absl::UnavailableError(
        "sqlite store '/var/lib/hap/planner.db': database or disk is full");
  }
  void RefusePlans(std::set<v1::Plan::State> states) {
    absl::MutexLock l(&mu);
    refuse_plan_states = std::move(states);
  }
  void RefuseNodes(bool refuse) {
    absl::MutexLock l(&mu);
    refuse_nodes = refuse;
  }
  absl::Status SaveNode(const v1::Node& n) override {
    absl::MutexLock l(&mu);
    if (refuse_nodes) return Full();
    nodes[n.name()] = n;
    return absl::OkStatus();
  }
  absl::Status DeleteNode(const std::string& name) override {
    absl::MutexLock l(&mu);
    if (refuse_nodes) return Full();
    nodes.erase(name);
    return absl::OkStatus();
  }
  // The next save of plan `name` signals `entered`, then waits for
  // `release` (a slow disk, to see what the core does meanwhile).
  void HoldSaveOf(const std::string& name, absl::Notification* entered,
                  absl::Notification* release) {
    absl::MutexLock l(&mu);
    hold_plan = name;
    hold_entered = entered;
    hold_release = release;
  }
  std::string hold_plan;
  absl::Notification* hold_entered = nullptr;
  absl::Notification* hold_release = nullptr;
  absl::Status SavePlan(const v1::Plan& p) override {
    absl::Notification* release = nullptr;
    {
      absl::MutexLock l(&mu);
      if (!hold_plan.empty() && p.name() == hold_plan) {
        hold_plan.clear();
        hold_entered->Notify();
        release = hold_release;
      }
    }
    if (release != nullptr) release->WaitForNotification();
    absl::MutexLock l(&mu);
    if (refuse_plan_states.count(p.state())) return Full();
    plans[p.name()] = p;
    saved_states[p.name()].push_back(p.state());
    return absl::OkStatus();
  }
  // Every state plan `name` was saved in, in order.
  std::vector<v1::Plan::State> History(const std::string& name) {
    absl::MutexLock l(&mu);
    return saved_states[name];
  }
  std::map<std::string, std::vector<v1::Plan::State>> saved_states;
  absl::Status DeletePlan(const std::string& name) override {
    absl::MutexLock l(&mu);
    if (!refuse_plan_states.empty()) return Full();
    plans.erase(name);
    return absl::OkStatus();
  }
  v1::Plan::State Stored(const std::string& plan) {
    absl::MutexLock l(&mu);
    auto it = plans.find(plan);
    return it == plans.end() ? v1::Plan::STATE_UNSPECIFIED : it->second.state();
  }
  std::vector<v1::Node> Nodes() {
    absl::MutexLock l(&mu);
    std::vector<v1::Node> out;
    for (const auto& [name, n] : nodes) out.push_back(n);
    return out;
  }
  std::vector<v1::Plan> Plans() {
    absl::MutexLock l(&mu);
    std::vector<v1::Plan> out;
    for (const auto& [name, p] : plans) out.push_back(p);
    return out;
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
    o.node_expiry = node_expiry_;
    o.sink = &sink_;
    o.workers = workers_;
    o.plan_retention_count = retention_count_;
    o.plan_retention_age = retention_age_;
    o.plans_in_use = plans_in_use_;
    o.load_plan = load_plan_;
    auto c = PlannerCore::Create(o, std::move(nodes), std::move(plans));
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = *std::move(c);
  }
  absl::Time Deadline() { return clock_.Now() + absl::Seconds(60); }

  FakeClock clock_;
  absl::Duration node_expiry_ = absl::InfiniteDuration();
  int workers_ = 1;
  int retention_count_ = 1000;
  absl::Duration retention_age_ = absl::Hours(24 * 7);
  std::function<absl::StatusOr<std::set<std::string>>()> plans_in_use_;
  std::function<absl::StatusOr<v1::Plan>(const std::string&)> load_plan_;
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

TEST_F(PlannerCoreTest, PlansPipelineStagesWhenAskedAndStoresThemLowered) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
  r.mutable_options()->set_pipeline_stages(2);
  r.mutable_options()->set_pipeline_microbatches(2);
  auto p = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  auto full = core_->GetPlan(p->name(), true);
  ASSERT_TRUE(full.ok());
  ASSERT_EQ(full->pipeline().stages_size(), 2);
  EXPECT_EQ(full->pipeline().microbatches(), 2);
  EXPECT_EQ(full->pipeline().stages(0).devices_size(), 2);  // one node each
  // Lowered: every device's stage program (executor/train/pipeline.h runs them).
  EXPECT_EQ(full->rank_programs_size(), 4);
  EXPECT_TRUE(lower::CheckPlanForRank(*full, 3, 4).ok()) << lower::CheckPlanForRank(*full, 3, 4);
  EXPECT_GT(full->prediction().step_seconds(), 0);
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

// A search that takes seconds (about 7 s on 2 cores): long enough to act
// on while it runs.
v1::CreatePlanRequest LongSearch(const std::string& id) {
  v1::CreatePlanRequest r;
  r.set_plan_id(id);
  r.mutable_model()->mutable_zoo()->set_name("gpt");
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 96;
  r.mutable_options()->mutable_budget()->set_max_seconds(120);
  r.mutable_options()->set_ignore_memory_limits(true);
  return r;
}

// --- Writes that fail (a full disk) ------------------------------------

TEST_F(PlannerCoreTest, AResultTheStoreRefusesIsNotReportedAsSucceeded) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  sink_.RefusePlans({v1::Plan::SUCCEEDED});
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("unsaved");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("plans/unsaved became SUCCEEDED but that could not be "
                                       "saved"),
                             HasSubstr("database or disk is full"))));
  // What the planner serves is what the store holds: FAILED, with the
  // store's code, and no result.
  auto p = core_->GetPlan("plans/unsaved", true);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::FAILED);
  EXPECT_EQ(p->error_code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_THAT(p->error(), HasSubstr("database or disk is full"));
  EXPECT_EQ(p->rank_programs_size(), 0);
  EXPECT_EQ(sink_.Stored("plans/unsaved"), v1::Plan::FAILED);
  // Nothing unsaved was cached: once the disk has room, the same request
  // is planned again and succeeds.
  sink_.RefusePlans({});
  auto again = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::Plan::SUCCEEDED) << again->error();
  EXPECT_EQ(sink_.Stored(again->name()), v1::Plan::SUCCEEDED);
}

TEST_F(PlannerCoreTest, APlanWhoseEndNoWriteRecordsRunsAgainAfterARestart) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  sink_.RefusePlans({v1::Plan::SUCCEEDED, v1::Plan::FAILED, v1::Plan::CANCELLED});
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("cut");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("could not be saved")));
  auto p = core_->GetPlan("plans/cut", false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state(), v1::Plan::FAILED);  // never SUCCEEDED
  EXPECT_THAT(p->error(), HasSubstr("a restart runs it again"));
  ASSERT_EQ(sink_.Stored("plans/cut"), v1::Plan::RUNNING);
  sink_.RefusePlans({});
  Start(sink_.Nodes(), sink_.Plans());
  v1::Plan last;
  ASSERT_TRUE(core_->WatchPlan("plans/cut",
                               [&](const v1::Plan& u) {
                                 last = u;
                                 return true;
                               },
                               [] { return false; })
                  .ok());
  EXPECT_EQ(last.state(), v1::Plan::SUCCEEDED) << last.error();
  EXPECT_EQ(sink_.Stored("plans/cut"), v1::Plan::SUCCEEDED);
}

TEST_F(PlannerCoreTest, APlanTheStoreRefusesIsNotCreated) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  sink_.RefusePlans({v1::Plan::PENDING});
  v1::CreatePlanRequest r = MlpRequest(/*wait=*/false);
  r.set_plan_id("zombie");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("plans/zombie was not created"),
                             HasSubstr("database or disk is full"))));
  // No trace of it: not listed, cancel and get say NotFound, and the id is
  // free once the disk has room.
  EXPECT_THAT(core_->GetPlan("plans/zombie", false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/zombie")));
  EXPECT_THAT(core_->CancelPlan("plans/zombie"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/zombie")));
  EXPECT_EQ(core_->ListPlans(0, "")->plans_size(), 0);
  sink_.RefusePlans({});
  auto p = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name(), "plans/zombie");

  // A plan served from the cache is saved before it exists, too.
  ASSERT_TRUE(core_->CreatePlan(MlpRequest(), Deadline()).ok());
  sink_.RefusePlans({v1::Plan::SUCCEEDED});
  v1::CreatePlanRequest cached = MlpRequest();
  cached.set_plan_id("cached");
  EXPECT_THAT(core_->CreatePlan(cached, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("plans/cached was not created")));
  EXPECT_THAT(core_->GetPlan("plans/cached", false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/cached")));
  // And its id is free again once the disk has room.
  sink_.RefusePlans({});
  auto again = core_->CreatePlan(cached, Deadline());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::Plan::SUCCEEDED);
}

TEST_F(PlannerCoreTest, ACachedCopyIsWrittenOutsideTheLockAndHoldsItsName) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->CreatePlan(MlpRequest(), Deadline()).ok());
  absl::Notification entered, release;
  sink_.HoldSaveOf("plans/copy", &entered, &release);
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("copy");
  absl::StatusOr<v1::Plan> created;
  std::thread creator([&] { created = core_->CreatePlan(r, Deadline()); });
  entered.WaitForNotification();
  // While the copy is on its way to the disk, reads are answered (writes
  // of cached copies do not hold the core's lock, so concurrent ones can be
  // committed together) and its name is taken but not yet served.
  absl::Notification listed;
  std::thread reader([&] {
    (void)core_->ListPlans(0, "");
    listed.Notify();
  });
  const bool read_while_writing = listed.WaitForNotificationWithTimeout(absl::Seconds(60));
  EXPECT_TRUE(read_while_writing) << "a read waited for a cached copy's write";
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("plans/copy")));
  EXPECT_THAT(core_->GetPlan("plans/copy", false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/copy")));
  release.Notify();
  creator.join();
  reader.join();
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::Plan::SUCCEEDED);
  EXPECT_TRUE(core_->GetPlan("plans/copy", false).ok());
  EXPECT_EQ(sink_.Stored("plans/copy"), v1::Plan::SUCCEEDED);
}

TEST_F(PlannerCoreTest, ADeleteTheStoreRefusesKeepsThePlan) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("kept");
  ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  sink_.RefusePlans({v1::Plan::SUCCEEDED});
  EXPECT_THAT(core_->DeletePlan("plans/kept"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("plans/kept was not deleted")));
  EXPECT_TRUE(core_->GetPlan("plans/kept", false).ok());
  EXPECT_EQ(sink_.Stored("plans/kept"), v1::Plan::SUCCEEDED);
}

TEST_F(PlannerCoreTest, ANodeTheStoreRefusesIsNotRegisteredNorUpdated) {
  sink_.RefuseNodes(true);
  EXPECT_THAT(core_->RegisterNode(MakeNode("a", 2, 2e12)),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("node 'a' was not registered"),
                             HasSubstr("database or disk is full"))));
  EXPECT_EQ(core_->ListNodes(0, "")->nodes_size(), 0);
  sink_.RefuseNodes(false);
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  // A heartbeat with re-measured devices the store refuses changes nothing.
  sink_.RefuseNodes(true);
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  *hb.mutable_devices() = MakeNode("a", 3, 2e12).devices();
  EXPECT_THAT(core_->Heartbeat(hb),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("node 'a'")));
  EXPECT_EQ(core_->ListNodes(0, "")->nodes(0).devices_size(), 2);
}

TEST_F(PlannerCoreTest, CancellingARunningPlanIsSavedAndARestartDoesNotRunItAgain) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 4, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 4, 1e12)).ok());
  ASSERT_TRUE(core_->CreatePlan(LongSearch("long"), Deadline()).ok());
  absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (sink_.Stored("plans/long") != v1::Plan::RUNNING && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(sink_.Stored("plans/long"), v1::Plan::RUNNING);
  auto cancelled = core_->CancelPlan("plans/long");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::Plan::CANCELLED);
  EXPECT_EQ(sink_.Stored("plans/long"), v1::Plan::CANCELLED);

  // A restart (the old core stops its search first) finds it CANCELLED and
  // leaves it so.
  Start(sink_.Nodes(), sink_.Plans());
  auto p = core_->GetPlan("plans/long", false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state(), v1::Plan::CANCELLED);
  EXPECT_EQ(sink_.Stored("plans/long"), v1::Plan::CANCELLED);
  // Cancelling a final plan changes nothing.
  EXPECT_EQ(core_->CancelPlan("plans/long")->state(), v1::Plan::CANCELLED);
}

TEST_F(PlannerCoreTest, ACancelTheStoreRefusesFailsAndThePlanGoesOn) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  sink_.RefusePlans({v1::Plan::CANCELLED});
  ASSERT_TRUE(core_->CreatePlan(LongSearch("goes-on"), Deadline()).ok());
  EXPECT_THAT(core_->CancelPlan("plans/goes-on"),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("plans/goes-on was not cancelled")));
  auto p = core_->GetPlan("plans/goes-on", false);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(p->state(), v1::Plan::CANCELLED);
  EXPECT_NE(sink_.Stored("plans/goes-on"), v1::Plan::CANCELLED);
}

TEST_F(PlannerCoreTest, AShutdownLeavesRunningPlansToRunAgain) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 4, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 4, 1e12)).ok());
  ASSERT_TRUE(core_->CreatePlan(LongSearch("interrupted"), Deadline()).ok());
  absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (sink_.Stored("plans/interrupted") != v1::Plan::RUNNING && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(sink_.Stored("plans/interrupted"), v1::Plan::RUNNING);
  core_.reset();  // stops the search; the plan is not CANCELLED by that
  EXPECT_EQ(sink_.Stored("plans/interrupted"), v1::Plan::RUNNING);
}

// --- Node profiles -------------------------------------------------------

// The planner's own calibration (issue 19): fitted from a deployment's rank
// profiles, stored with the nodes, used by later plans unless asked not to,
// kept across a re-probe that measures about the same, dropped (and then
// borrowed from a device of the same kind) when it measures otherwise.
// Every rank of `plan` profiled 20 steps from step 2: median step `step`,
// kernels `kernels` s of which linear 0.02 s (+0.01 s per rank), optimizer
// 1 ms, runtime 2 ms.
std::vector<v1::StepProfile> Profiles(const v1::Plan& plan, double step, double kernels) {
  std::vector<v1::StepProfile> out;
  for (int r = 0; r < plan.devices_size(); ++r) {
    v1::StepProfile p;
    p.set_rank(r);
    p.set_device(plan.devices(r));
    p.set_plan_content_hash(plan.content_hash());
    p.set_first_step(2);
    p.set_steps(20);
    p.set_step_seconds_median(step);
    p.set_device_seconds(kernels);
    (*p.mutable_op_seconds())["linear"] = 0.02 + 0.01 * r;
    (*p.mutable_op_seconds())["(optimizer)"] = 0.001;
    (*p.mutable_op_seconds())["(runtime)"] = 0.002;
    out.push_back(p);
  }
  return out;
}

TEST_F(PlannerCoreTest, CalibratesDevicesFromProfilesAndLaterPlansUseIt) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->state(), v1::Plan::SUCCEEDED) << first->error();
  EXPECT_EQ(first->calibration(), "");  // nothing calibrated yet
  auto full = core_->GetPlan(first->name(), true);
  ASSERT_TRUE(full.ok());
  std::vector<v1::StepProfile> profiles = Profiles(*full, 0.05, 0.04);
  EXPECT_THAT(core_->CalibrateDevices(first->name(), "deployments/d1", {profiles[0]}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("profiles of 1 of the plan's 2 ranks")));
  EXPECT_THAT(core_->CalibrateDevices("plans/none", "deployments/d1", profiles),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/none")));
  auto line = core_->CalibrateDevices(first->name(), "deployments/d1", profiles);
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(*line, HasSubstr("from deployments/d1 (measured 0.0500 s)"));
  std::map<std::string, v1::Device> devices;
  const v1::Cluster cluster = core_->GetCluster(true);
  for (const auto& n : cluster.nodes()) devices[n.devices(0).id()] = n.devices(0);
  ASSERT_TRUE(devices.at("a/cpu0").has_calibration());
  const v1::DeviceCalibration& ca = devices.at("a/cpu0").calibration();
  EXPECT_EQ(ca.deployment(), "deployments/d1");
  EXPECT_EQ(ca.plan(), first->name());
  EXPECT_DOUBLE_EQ(ca.probed_flops(), 2e12);
  EXPECT_GT(ca.op_time_scale().at("linear"), 1);  // the model's 2 TFLOP/s is optimistic
  EXPECT_GT(ca.optimizer_seconds_per_element(), 0);
  EXPECT_DOUBLE_EQ(devices.at("b/cpu0").calibration().measured_step_seconds(), 0.05);
  {
    absl::MutexLock l(&sink_.mu);  // saved with the nodes
    EXPECT_TRUE(sink_.nodes.at("a").devices(0).has_calibration());
  }
  // A new plan uses it and says so; asked not to, the raw model as before.
  v1::CreatePlanRequest again = MlpRequest();
  again.set_plan_id("calibrated");
  auto calibrated = core_->CreatePlan(again, Deadline());
  ASSERT_TRUE(calibrated.ok()) << calibrated.status();
  ASSERT_EQ(calibrated->state(), v1::Plan::SUCCEEDED) << calibrated->error();
  EXPECT_THAT(calibrated->calibration(),
              AllOf(HasSubstr("a/cpu0: deployments/d1 (" + first->name() + ")"),
                    HasSubstr("b/cpu0: deployments/d1")));
  EXPECT_GT(calibrated->prediction().step_seconds(), 5 * first->prediction().step_seconds());
  v1::CreatePlanRequest raw = MlpRequest();
  raw.set_plan_id("raw");
  raw.mutable_options()->set_ignore_calibration(true);
  auto uncalibrated = core_->CreatePlan(raw, Deadline());
  ASSERT_TRUE(uncalibrated.ok()) << uncalibrated.status();
  EXPECT_EQ(uncalibrated->calibration(), "");
  EXPECT_DOUBLE_EQ(uncalibrated->prediction().step_seconds(), first->prediction().step_seconds());
  // Re-probed at about the same FLOP/s: kept; at 25% less: dropped, and a
  // plan borrows b's calibration for it.
  auto heartbeat = [&](double flops) {
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    *hb.mutable_devices() = MakeNode("a", 1, flops).devices();
    return core_->Heartbeat(hb);
  };
  ASSERT_TRUE(heartbeat(2.1e12).ok());
  EXPECT_TRUE(core_->GetCluster(true).nodes(0).devices(0).has_calibration());
  ASSERT_TRUE(heartbeat(1.5e12).ok());
  EXPECT_FALSE(core_->GetCluster(true).nodes(0).devices(0).has_calibration());
  EXPECT_TRUE(core_->GetCluster(true).nodes(1).devices(0).has_calibration());
  v1::CreatePlanRequest borrowed = MlpRequest();
  borrowed.set_plan_id("borrowed");
  auto b = core_->CreatePlan(borrowed, Deadline());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->calibration(), HasSubstr("a/cpu0: borrowed from b/cpu0"));
  // A re-registration keeps b's (same FLOP/s).
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  EXPECT_TRUE(core_->GetCluster(true).nodes(1).devices(0).has_calibration());
}

// A deployment of a pipeline plan (two stages of one device) whose steps
// take far longer than its kernels: its devices get the stall per transfer
// between stages that explains it, keep what the earlier SPMD run fitted of
// communication, and the next pipeline plan prices the stall.
TEST_F(PlannerCoreTest, APipelineRunCalibratesTheStallBetweenStagesAndKeepsTheRest) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto spmd = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(spmd.ok() && spmd->state() == v1::Plan::SUCCEEDED) << spmd.status();
  auto spmd_full = core_->GetPlan(spmd->name(), true);
  ASSERT_TRUE(spmd_full.ok());
  ASSERT_TRUE(core_->CalibrateDevices(spmd->name(), "deployments/d1",
                                      Profiles(*spmd_full, 0.08, 0.04)).ok());
  const v1::DeviceCalibration before = core_->GetCluster(true).nodes(0).devices(0).calibration();

  auto pipe_request = [](const std::string& id) {
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    r.mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
    r.mutable_options()->set_pipeline_stages(2);
    r.mutable_options()->set_pipeline_microbatches(2);
    return r;
  };
  auto pipe = core_->CreatePlan(pipe_request("pipe"), Deadline());
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_EQ(pipe->state(), v1::Plan::SUCCEEDED) << pipe->error();
  auto full = core_->GetPlan(pipe->name(), true);
  ASSERT_TRUE(full.ok());
  ASSERT_EQ(full->pipeline().stages_size(), 2);
  auto line = core_->CalibrateDevices(pipe->name(), "deployments/d2", Profiles(*full, 2.0, 0.04));
  ASSERT_TRUE(line.ok()) << line.status();
  const v1::DeviceCalibration after = core_->GetCluster(true).nodes(0).devices(0).calibration();
  EXPECT_EQ(after.plan(), pipe->name());
  // 2 s steps from 40 ms of kernels, two microbatches: the 1F1B schedule
  // needs well over 100 ms per transfer to take that long.
  EXPECT_GT(after.pipeline_transfer_overhead_seconds(), 0.1);
  EXPECT_LT(after.pipeline_transfer_overhead_seconds(), 2.0);
  EXPECT_DOUBLE_EQ(after.collective_overhead_seconds(), before.collective_overhead_seconds());
  EXPECT_DOUBLE_EQ(after.transfer_scale(), before.transfer_scale());
  EXPECT_DOUBLE_EQ(after.step_overhead_seconds(), before.step_overhead_seconds());
  auto again = core_->CreatePlan(pipe_request("pipe-again"), Deadline());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->state(), v1::Plan::SUCCEEDED) << again->error();
  EXPECT_GT(again->prediction().step_seconds(),
            pipe->prediction().step_seconds() + after.pipeline_transfer_overhead_seconds());
}

TEST_F(PlannerCoreTest, AHeartbeatIsCheckedLikeARegistration) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  auto heartbeat = [&](const v1::Node& measured) {
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    *hb.mutable_devices() = measured.devices();
    return core_->Heartbeat(hb);
  };
  v1::Node nan_flops = MakeNode("a", 2, std::nan(""));
  EXPECT_THAT(heartbeat(nan_flops),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'a/cpu0'"), HasSubstr("FLOAT32 FLOP/s"),
                             HasSubstr("got nan"))));
  v1::Node negative_memory = MakeNode("a", 2, 2e12, -5);
  EXPECT_THAT(heartbeat(negative_memory),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'a/cpu0'"), HasSubstr("memory_bytes"), HasSubstr("-5"))));
  v1::Node theft = MakeNode("a", 2, 2e12);
  theft.mutable_devices(1)->set_id("b/cpu0");
  EXPECT_THAT(heartbeat(theft),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("device 'b/cpu0' is already registered by node 'b'")));
  v1::Node twice = MakeNode("a", 2, 2e12);
  twice.mutable_devices(1)->set_id("a/cpu0");
  EXPECT_THAT(heartbeat(twice),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unique, got 'a/cpu0'")));
  // None of them got in: the cluster still plans, on its four devices.
  auto p = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  EXPECT_EQ(p->devices_size(), 4);
  // A valid re-measurement is taken.
  ASSERT_TRUE(heartbeat(MakeNode("a", 3, 3e12)).ok());
  EXPECT_EQ(core_->GetCluster(false).nodes(0).devices_size(), 3);
}

TEST_F(PlannerCoreTest, MeasurementsThatAreNotFiniteNumbersAreRefusedAtRegistration) {
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(v1::Device&)> edit;
    std::string field, value;
  };
  std::vector<Case> cases = {
      {[&](v1::Device& d) { d.set_launch_overhead_seconds(nan); }, "launch_overhead_seconds",
       "nan"},
      {[&](v1::Device& d) { d.set_step_overhead_seconds(-1); }, "step_overhead_seconds", "-1"},
      {[&](v1::Device& d) { d.set_optimizer_seconds_per_element(inf); },
       "optimizer_seconds_per_element", "inf"},
      {[&](v1::Device& d) { d.set_tf32_flops(nan); }, "tf32_flops", "nan"},
      {[&](v1::Device& d) {
         auto* f = d.add_flops();
         f->set_dtype(v1::FLOAT16);
         f->set_flops(inf);
       },
       "FLOAT16 FLOP/s", "inf"},
      {[&](v1::Device& d) { (*d.mutable_op_time_scale())["linear"] = nan; },
       "op_time_scale[\"linear\"]", "nan"},
      {[&](v1::Device& d) { (*d.mutable_op_time_scale())["linear"] = 0; },
       "op_time_scale[\"linear\"]", "got 0"},
  };
  for (const Case& c : cases) {
    v1::Node n = MakeNode("a", 2, 2e12);
    c.edit(*n.mutable_devices(1));
    EXPECT_THAT(core_->RegisterNode(n),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("'a/cpu1'"), HasSubstr(c.field), HasSubstr(c.value))))
        << c.field;
  }
  EXPECT_EQ(core_->ListNodes(0, "")->nodes_size(), 0);

  // Links: a latency that is NaN or infinite, a bandwidth that is NaN.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto link = [](double bandwidth, double latency) {
    v1::Link l;
    l.set_src("a/cpu0");
    l.set_dst("a/cpu1");
    l.set_bandwidth_bytes_per_second(bandwidth);
    l.set_latency_seconds(latency);
    return std::vector<v1::Link>{l};
  };
  EXPECT_THAT(core_->ReportLinks("nodes/a", link(1e9, nan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("a/cpu0 -> a/cpu1"), HasSubstr("latency_seconds"),
                             HasSubstr("got nan"))));
  EXPECT_THAT(core_->ReportLinks("nodes/a", link(1e9, inf)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("latency_seconds"), HasSubstr("got inf"))));
  EXPECT_THAT(core_->ReportLinks("nodes/a", link(nan, 1e-5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("bandwidth_bytes_per_second"), HasSubstr("got nan"))));
  EXPECT_EQ(core_->GetCluster(false).links_size(), 0);
  ASSERT_TRUE(core_->ReportLinks("nodes/a", link(1e9, 1e-5)).ok());
  EXPECT_EQ(core_->GetCluster(false).links_size(), 1);
}

// A database written before registrations were checked may hold nodes
// that no registration would let in now: they are not loaded (and said
// so), and the good ones plan as before.
TEST_F(PlannerCoreTest, StoredNodesThatFailTheChecksAreNotLoaded) {
  v1::Node good = MakeNode("a", 2, 1e12);
  v1::Node nan = MakeNode("b", 1, std::nan(""));
  v1::Node thief = MakeNode("c", 1, 1e12);
  thief.mutable_devices(0)->set_id("a/cpu0");  // a's device
  v1::Node negative = MakeNode("d", 1, 1e12, -5);
  Start({thief, nan, good, negative}, {});
  const v1::Cluster cluster = core_->GetCluster(true);
  ASSERT_EQ(cluster.nodes_size(), 1);
  EXPECT_EQ(cluster.nodes(0).name(), "a");
  const auto& notes = core_->StartNotes();
  ASSERT_EQ(notes.size(), 3u);
  EXPECT_THAT(notes[0], AllOf(HasSubstr("'b'"), HasSubstr("not loaded")));
  EXPECT_THAT(notes[1], AllOf(HasSubstr("'c'"), HasSubstr("a/cpu0")));
  EXPECT_THAT(notes[2], HasSubstr("'d'"));
  // Its agent back, a's devices plan alone (no "device id appears twice").
  ASSERT_TRUE(core_->RegisterNode(good).ok());
  auto plan = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->state(), v1::Plan::SUCCEEDED);
  // The node's agent registering again (with good measurements) is let in.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 2e12)).ok());
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
}

TEST_F(PlannerCoreTest, DeleteNodeRemovesTheNodeItsDevicesAndItsLinks) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  v1::Link l;
  l.set_src("a/cpu0");
  l.set_dst("b/cpu0");
  l.set_bandwidth_bytes_per_second(1e9);
  ASSERT_TRUE(core_->ReportLinks("nodes/a", {l}).ok());
  ASSERT_TRUE(core_->DeleteNode("nodes/b").ok());
  v1::Cluster c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 1);
  EXPECT_EQ(c.nodes(0).name(), "a");
  EXPECT_EQ(c.links_size(), 0);
  EXPECT_EQ(sink_.Nodes().size(), 1u);
  // Its agent is told to register again; its device ids are free.
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/b");
  EXPECT_TRUE(core_->Heartbeat(hb)->unknown_node());
  v1::Node heir = MakeNode("c", 1, 1e12);
  heir.mutable_devices(0)->set_id("b/cpu0");
  EXPECT_TRUE(core_->RegisterNode(heir).ok());
  EXPECT_THAT(core_->DeleteNode("nodes/b"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("node 'b' is not registered")));
  EXPECT_THAT(core_->DeleteNode("nodes/no such"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'nodes/no such'")));
  // A removal the store refuses leaves the node.
  sink_.RefuseNodes(true);
  EXPECT_THAT(core_->DeleteNode("c"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("node 'c' was not deleted")));
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
}

TEST_F(PlannerCoreTest, ANodeStaleLongerThanTheExpiryIsRemoved) {
  node_expiry_ = absl::Minutes(1);
  Start({}, {});
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  // b is stale after 15 s and expires 60 s later; a keeps heartbeating.
  for (int i = 0; i < 14; ++i) {
    clock_.Advance(absl::Seconds(5));
    ASSERT_TRUE(core_->Heartbeat(hb).ok());
  }
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);  // 70 s: stale, kept
  clock_.Advance(absl::Seconds(6));
  // While the store refuses the removal, the node stays, as stored.
  sink_.RefuseNodes(true);
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
  sink_.RefuseNodes(false);
  v1::Cluster c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 1);
  EXPECT_EQ(c.nodes(0).name(), "a");
  EXPECT_EQ(sink_.Nodes().size(), 1u);
  hb.set_name("nodes/b");
  EXPECT_TRUE(core_->Heartbeat(hb)->unknown_node());
}

// A restarted planner does not blame nodes for the heartbeats they sent
// while no planner ran: a stored node whose last heartbeat is long past is
// READY at start and goes STALE only after missing heartbeats against the
// new planner (a job's deployment survives a planner restart).
TEST_F(PlannerCoreTest, ARestartDoesNotMakeStoredNodesStale) {
  v1::Node a = MakeNode("a", 2, 2e12);
  v1::Node b = MakeNode("b", 2, 1e12);
  const absl::Time long_ago = clock_.Now() - absl::Minutes(10);
  for (v1::Node* n : {&a, &b}) {
    n->mutable_last_heartbeat()->set_seconds(absl::ToUnixSeconds(long_ago));
  }
  Start({a, b}, {});
  v1::Cluster c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 2);
  for (const auto& n : c.nodes()) {
    EXPECT_EQ(n.state(), v1::Node::READY) << n.name();
  }
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  // 16 s later (the limit is 3 x 5 s): a heartbeat, b did not.
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(4));
    ASSERT_TRUE(core_->Heartbeat(hb).ok());
  }
  c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 2);
  for (const auto& n : c.nodes()) {
    EXPECT_EQ(n.state(), n.name() == "b" ? v1::Node::STALE : v1::Node::READY) << n.name();
  }
}

// --- Options -------------------------------------------------------------

TEST_F(PlannerCoreTest, OptionsOutOfRangeAreInvalidArgumentNamingTheFieldAndValue) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(v1::PlanOptions&)> edit;
    std::string message;
  };
  std::vector<Case> cases = {
      {[&](v1::PlanOptions& o) { o.mutable_optimizer()->set_learning_rate(nan); },
       "options.optimizer.learning_rate must be a finite number >= 0 (0 = the default), got nan"},
      {[&](v1::PlanOptions& o) { o.mutable_optimizer()->set_clip_global_norm(-3); },
       "options.optimizer.clip_global_norm must be a finite number >= 0 (0 = no clipping), got "
       "-3"},
      {[&](v1::PlanOptions& o) { o.mutable_optimizer()->set_weight_decay(inf); },
       "options.optimizer.weight_decay must be a finite number >= 0, got inf"},
      {[&](v1::PlanOptions& o) {
         o.mutable_optimizer()->set_kind(static_cast<v1::OptimizerConfig::Kind>(77));
       },
       "options.optimizer.kind 77 is not a known optimizer"},
      {[&](v1::PlanOptions& o) { o.mutable_optimizer()->set_momentum(1.5); },
       "options.optimizer.momentum must be in [0, 1), got 1.5"},
      {[&](v1::PlanOptions& o) { o.mutable_optimizer()->set_beta2(1); },
       "options.optimizer.beta2 must be in [0, 1) (0 = the default), got 1"},
      {[&](v1::PlanOptions& o) { o.mutable_optimizer()->set_epsilon(-1e-8); },
       "options.optimizer.epsilon must be a finite number >= 0"},
      {[&](v1::PlanOptions& o) { o.mutable_budget()->set_max_seconds(nan); },
       "options.budget.max_seconds must be a finite number >= 0 (0 = the default), got nan"},
      {[&](v1::PlanOptions& o) { o.set_max_joint_iterations(-2); },
       "options.max_joint_iterations must not be negative, got -2"},
      {[&](v1::PlanOptions& o) { o.set_compute_dtype(static_cast<v1::DType>(99)); },
       "options.compute_dtype 99 is not a known dtype"},
      {[&](v1::PlanOptions& o) { o.set_precision(static_cast<v1::Precision>(7)); },
       "options.precision 7 is not a known precision (FP32 or BF16)"},
      {[&](v1::PlanOptions& o) {
         o.set_gradient_precision(static_cast<v1::Precision>(9));
       },
       "options.gradient_precision 9 is not a known precision (FP32 or BF16)"},
  };
  for (const Case& c : cases) {
    v1::CreatePlanRequest r = MlpRequest();
    c.edit(*r.mutable_options());
    EXPECT_THAT(core_->CreatePlan(r, Deadline()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
  EXPECT_EQ(core_->ListPlans(0, "")->plans_size(), 0);
  // In range: planned.
  v1::CreatePlanRequest ok = MlpRequest();
  ok.mutable_options()->mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
  ok.mutable_options()->mutable_optimizer()->set_learning_rate(3e-4);
  ok.mutable_options()->mutable_optimizer()->set_clip_global_norm(1);
  ok.mutable_options()->mutable_optimizer()->set_weight_decay(0.01);
  auto p = core_->CreatePlan(ok, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
}

// --- The cache, merging and retention (issue 15 item 7) -----------------

// Waits (real time, bounded) until plan `name` is final; returns it.
v1::Plan WaitFinal(PlannerCore& core, const std::string& name) {
  v1::Plan last;
  absl::Status s = core.WatchPlan(
      name,
      [&](const v1::Plan& p) {
        last = p;
        return true;
      },
      [] { return false; });
  EXPECT_TRUE(s.ok()) << s;
  return last;
}

std::vector<std::string> PlanNames(PlannerCore& core) {
  std::vector<std::string> names;
  auto page = core.ListPlans(1000, "");
  EXPECT_TRUE(page.ok()) << page.status();
  if (page.ok()) {
    for (const auto& p : page->plans()) names.push_back(p.name());
  }
  return names;
}

bool Ran(const std::vector<v1::Plan::State>& history) {
  return std::count(history.begin(), history.end(), v1::Plan::RUNNING) > 0;
}

TEST_F(PlannerCoreTest, HeartbeatsDoNotChangeTheCacheKeyButNewMeasurementsDo) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->state(), v1::Plan::SUCCEEDED) << first->error();
  // Agents heartbeat (new heartbeat times; b misses enough to go stale and
  // comes back): the same request is answered from the cache, at once.
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(5));
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    ASSERT_TRUE(core_->Heartbeat(hb).ok());
  }
  v1::HeartbeatRequest hb_b;
  hb_b.set_name("nodes/b");
  ASSERT_TRUE(core_->Heartbeat(hb_b).ok());
  auto second = core_->CreatePlan(MlpRequest(/*wait=*/false), Deadline());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->state(), v1::Plan::SUCCEEDED);
  EXPECT_EQ(second->content_hash(), first->content_hash());
  EXPECT_FALSE(Ran(sink_.History(second->name())));
  // A device measured again at another speed is another cluster.
  v1::HeartbeatRequest remeasured;
  remeasured.set_name("nodes/b");
  *remeasured.mutable_devices() = MakeNode("b", 2, 1.5e12).devices();
  ASSERT_TRUE(core_->Heartbeat(remeasured).ok());
  auto third = core_->CreatePlan(MlpRequest(/*wait=*/false), Deadline());
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->state(), v1::Plan::PENDING);
  EXPECT_EQ(WaitFinal(*core_, third->name()).state(), v1::Plan::SUCCEEDED);
  EXPECT_TRUE(Ran(sink_.History(third->name())));
}

// Occupies the only worker with a long search until it is cancelled, so
// that the next requests wait in the queue.
class BusyWorker {
 public:
  explicit BusyWorker(PlannerCore* core) : core_(core) {
    auto p = core_->CreatePlan(LongSearch("blocker"), absl::InfiniteFuture());
    EXPECT_TRUE(p.ok()) << p.status();
  }
  ~BusyWorker() { Release(); }
  void Release() {
    if (released_) return;
    released_ = true;
    EXPECT_TRUE(core_->CancelPlan("plans/blocker").ok());
  }

 private:
  PlannerCore* core_;
  bool released_ = false;
};

TEST_F(PlannerCoreTest, IdenticalRequestsInFlightShareOneSearch) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  BusyWorker busy(core_.get());
  std::vector<std::string> names;
  for (const char* id : {"one", "two", "three"}) {
    v1::CreatePlanRequest r = MlpRequest(/*wait=*/false);
    r.set_plan_id(id);
    auto p = core_->CreatePlan(r, Deadline());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->state(), v1::Plan::PENDING);
    names.push_back(p->name());
  }
  busy.Release();
  std::vector<v1::Plan> done;
  for (const auto& n : names) done.push_back(WaitFinal(*core_, n));
  for (const auto& p : done) {
    EXPECT_EQ(p.state(), v1::Plan::SUCCEEDED) << p.name() << ": " << p.error();
    EXPECT_EQ(p.content_hash(), done[0].content_hash());
  }
  // One search: the first plan ran; the others never did, and were saved
  // PENDING then SUCCEEDED.
  EXPECT_TRUE(Ran(sink_.History("plans/one")));
  for (const char* n : {"plans/two", "plans/three"}) {
    EXPECT_EQ(sink_.History(n),
              (std::vector<v1::Plan::State>{v1::Plan::PENDING, v1::Plan::SUCCEEDED}))
        << n;
    auto full = core_->GetPlan(n, true);
    ASSERT_TRUE(full.ok());
    EXPECT_EQ(full->name(), n);
    EXPECT_EQ(full->rank_programs_size(), 2);
  }
}

TEST_F(PlannerCoreTest, WhenTheSharedSearchIsCancelledOrDeletedAFollowerSearches) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  BusyWorker busy(core_.get());
  for (const char* id : {"lead", "follow-1", "follow-2", "other-lead", "other-follow"}) {
    v1::CreatePlanRequest r = MlpRequest(/*wait=*/false);
    r.set_plan_id(id);
    if (absl::string_view(id).find("other") == 0) {
      (*r.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 48;
    }
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  ASSERT_EQ(core_->CancelPlan("plans/lead")->state(), v1::Plan::CANCELLED);
  ASSERT_TRUE(core_->DeletePlan("plans/other-lead").ok());
  busy.Release();
  for (const char* n : {"plans/follow-1", "plans/follow-2", "plans/other-follow"}) {
    v1::Plan p = WaitFinal(*core_, n);
    EXPECT_EQ(p.state(), v1::Plan::SUCCEEDED) << n << ": " << p.error();
  }
  // follow-1 took over the search; follow-2 followed it.
  EXPECT_TRUE(Ran(sink_.History("plans/follow-1")));
  EXPECT_FALSE(Ran(sink_.History("plans/follow-2")));
  EXPECT_TRUE(Ran(sink_.History("plans/other-follow")));
  EXPECT_FALSE(Ran(sink_.History("plans/lead")));
}

TEST_F(PlannerCoreTest, AMergedRequestSharesAFailureOfTheRequestItself) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12, int64_t{1} << 20)).ok());
  BusyWorker busy(core_.get());
  for (const char* id : {"big-1", "big-2"}) {
    v1::CreatePlanRequest r = MlpRequest(/*wait=*/false);
    r.set_plan_id(id);
    (*r.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 4096;
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  busy.Release();
  for (const char* n : {"plans/big-1", "plans/big-2"}) {
    v1::Plan p = WaitFinal(*core_, n);
    EXPECT_EQ(p.state(), v1::Plan::FAILED) << n;
    EXPECT_EQ(p.error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << n;
  }
  EXPECT_FALSE(Ran(sink_.History("plans/big-2")));
}

TEST_F(PlannerCoreTest, ARequestWithALargerBudgetIsNotMergedIntoASmallerOne) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  BusyWorker busy(core_.get());
  v1::CreatePlanRequest small = MlpRequest(/*wait=*/false);
  small.set_plan_id("small");
  small.mutable_options()->mutable_budget()->set_max_seconds(5);
  ASSERT_TRUE(core_->CreatePlan(small, Deadline()).ok());
  // Not identical to "small" (the budget is an option), and a deadline-
  // bounded budget below another identical request's is not merged either.
  v1::CreatePlanRequest waits = MlpRequest(/*wait=*/false);
  waits.set_plan_id("waits");
  ASSERT_TRUE(core_->CreatePlan(waits, Deadline()).ok());
  v1::CreatePlanRequest same = MlpRequest(/*wait=*/false);
  same.set_plan_id("same");
  ASSERT_TRUE(core_->CreatePlan(same, Deadline()).ok());
  busy.Release();
  for (const char* n : {"plans/small", "plans/waits", "plans/same"}) {
    EXPECT_EQ(WaitFinal(*core_, n).state(), v1::Plan::SUCCEEDED) << n;
  }
  EXPECT_TRUE(Ran(sink_.History("plans/small")));
  EXPECT_TRUE(Ran(sink_.History("plans/waits")));
  EXPECT_FALSE(Ran(sink_.History("plans/same")));
}

TEST_F(PlannerCoreTest, RetentionKeepsTheNewestFinishedPlansByCount) {
  retention_count_ = 3;
  Start({}, {});
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (int i = 0; i < 6; ++i) {
    clock_.Advance(absl::Seconds(1));
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id("p" + std::to_string(i));
    auto p = core_->CreatePlan(r, Deadline());
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->state(), v1::Plan::SUCCEEDED);
  }
  // Each new plan pushed the oldest out, from the store too; the cache
  // still answers (from the newest copy).
  std::vector<std::string> names = PlanNames(*core_);
  EXPECT_EQ(names, (std::vector<std::string>{"plans/p3", "plans/p4", "plans/p5"}));
  std::vector<std::string> stored;
  for (const auto& p : sink_.Plans()) stored.push_back(p.name());
  EXPECT_EQ(stored, names);
  EXPECT_EQ(core_->CreatePlan(MlpRequest(/*wait=*/false), Deadline())->state(),
            v1::Plan::SUCCEEDED);
  EXPECT_EQ(*core_->EnforceRetention(), 0);
  EXPECT_EQ(core_->ListPlans(0, "")->plans_size(), 3);
}

TEST_F(PlannerCoreTest, RetentionDeletesPlansFinishedLongerAgoThanTheAge) {
  retention_count_ = 0;
  retention_age_ = absl::Hours(1);
  Start({}, {});
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (const char* id : {"old-1", "old-2"}) {
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  clock_.Advance(absl::Minutes(61));
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  ASSERT_TRUE(core_->Heartbeat(hb).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("new");
  ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  EXPECT_EQ(*core_->EnforceRetention(), 2);
  EXPECT_EQ(sink_.Plans().size(), 1u);
  EXPECT_EQ(core_->CreatePlan(MlpRequest(/*wait=*/false), Deadline())->state(),
            v1::Plan::SUCCEEDED);  // the cache still answers, from "new"
  ASSERT_TRUE(core_->DeletePlan(sink_.Plans().back().name()).ok());
  // A plan not yet final is never deleted, however old.
  {
    BusyWorker busy(core_.get());
    clock_.Advance(absl::Minutes(61));
    EXPECT_EQ(*core_->EnforceRetention(), 1);  // "new"; the blocker runs on
    EXPECT_TRUE(core_->GetPlan("plans/blocker", false).ok());
  }
  EXPECT_EQ(sink_.Plans().size(), 1u);  // the cancelled blocker
  EXPECT_THAT(core_->GetPlan("plans/old-1", false),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(PlannerCoreTest, RetentionKeepsPlansInUseAndSkipsAPassWhenTheyAreUnknown) {
  retention_count_ = 1;
  absl::Mutex mu;
  absl::StatusOr<std::set<std::string>> in_use = std::set<std::string>{"plans/deployed"};
  plans_in_use_ = [&]() -> absl::StatusOr<std::set<std::string>> {
    absl::MutexLock l(&mu);
    return in_use;
  };
  Start({}, {});
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (const char* id : {"deployed", "p1", "p2"}) {
    clock_.Advance(absl::Seconds(1));
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  std::vector<std::string> names = PlanNames(*core_);
  EXPECT_EQ(names, (std::vector<std::string>{"plans/deployed", "plans/p2"}));
  // Which plans are deployed is unknown: nothing is deleted.
  {
    absl::MutexLock l(&mu);
    in_use = absl::UnavailableError("the service is shutting down");
  }
  EXPECT_THAT(core_->EnforceRetention(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("plan retention skipped")));
  EXPECT_EQ(core_->ListPlans(0, "")->plans_size(), 2);
  // A delete the store refuses keeps the plan.
  {
    absl::MutexLock l(&mu);
    in_use = std::set<std::string>{};
  }
  sink_.RefusePlans({v1::Plan::FAILED});
  EXPECT_THAT(core_->EnforceRetention(), StatusIs(absl::StatusCode::kUnavailable,
                                                  HasSubstr("plans/deployed was not deleted")));
  EXPECT_TRUE(core_->GetPlan("plans/deployed", false).ok());
  sink_.RefusePlans({});
  EXPECT_EQ(*core_->EnforceRetention(), 1);
  EXPECT_THAT(core_->GetPlan("plans/deployed", false),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// A deploy that starts while a retention pass runs (after the pass asked
// which plans deployments use, before it deletes) pins its plan: the plan
// stays until the deploy unpins it (it failed) and is deleted after.
TEST_F(PlannerCoreTest, RetentionKeepsAPlanADeployPinnedDuringThePass) {
  retention_count_ = 1;
  PlannerCore* core = nullptr;
  bool deploy_races = false;
  plans_in_use_ = [&]() -> absl::StatusOr<std::set<std::string>> {
    if (deploy_races) {
      EXPECT_TRUE(core->PinPlan("plans/p1").ok());
    }
    return std::set<std::string>{};  // no deployment exists yet
  };
  Start({}, {});
  core = core_.get();
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (const char* id : {"p1", "p2"}) {
    clock_.Advance(absl::Seconds(1));
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    if (std::string(id) == "p2") deploy_races = true;
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  deploy_races = false;
  EXPECT_TRUE(core_->GetPlan("plans/p1", false).ok()) << "a pinned plan was deleted";
  EXPECT_EQ(*core_->EnforceRetention(), 0);
  core_->UnpinPlan("plans/p1");
  EXPECT_EQ(*core_->EnforceRetention(), 1);
  EXPECT_THAT(core_->PinPlan("plans/p1"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("p1")));
}

// A restarted planner holds finished plans as summaries (a database of
// 10,000 plans is not parsed whole at start) and reads the rest of one
// when a call needs it, once.
TEST_F(PlannerCoreTest, FinishedPlansStartAsSummariesAndAreReadWholeWhenAsked) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("p");
  ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  absl::StatusOr<v1::Plan> whole = core_->GetPlan("plans/p", true);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_GT(whole->rank_programs_size(), 0);
  ASSERT_TRUE(whole->has_graph());
  int loads = 0;
  load_plan_ = [&](const std::string& name) -> absl::StatusOr<v1::Plan> {
    ++loads;
    if (name == "plans/p") return *whole;
    return absl::NotFoundError(absl::StrCat(name, " is not in the store"));
  };
  v1::Plan summary = *whole;
  summary.clear_rank_programs();
  summary.clear_graph();
  summary.clear_program();
  v1::Plan gone = summary;
  gone.set_name("plans/gone");  // deleted from the store behind the planner
  Start({}, {summary, gone});
  EXPECT_EQ(loads, 0) << "plans were read whole at start";

  auto list = core_->ListPlans(0, "");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->plans_size(), 2);
  EXPECT_EQ(list->plans(1).rank_programs_size(), 0);
  EXPECT_EQ(loads, 0);

  auto full = core_->GetPlan("plans/p", true);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*full, *whole))
      << "the plan read whole differs from the stored one";
  auto basic = core_->GetPlan("plans/p", false);
  ASSERT_TRUE(basic.ok());
  EXPECT_TRUE(basic->has_graph());
  EXPECT_EQ(basic->rank_programs_size(), 0);
  auto pinned = core_->PinPlan("plans/p");
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pinned->rank_programs_size(), whole->rank_programs_size());
  core_->UnpinPlan("plans/p");
  EXPECT_EQ(loads, 1) << "the whole plan was not kept after it was read";

  EXPECT_THAT(core_->GetPlan("plans/gone", true),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/gone does not exist")));
  EXPECT_THAT(core_->PinPlan("plans/gone"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  auto cancelled = core_->CancelPlan("plans/p");  // final: returned as it is
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::Plan::SUCCEEDED);
  EXPECT_TRUE(cancelled->has_graph());
  auto full_list = core_->ListPlans(0, "", /*full=*/true);
  ASSERT_TRUE(full_list.ok()) << full_list.status();
  ASSERT_EQ(full_list->plans_size(), 1);  // the one the store lost is left out
  EXPECT_EQ(full_list->plans(0).rank_programs_size(), whole->rank_programs_size());
}

// --- Reads from snapshots (issue 15 item 6) -------------------------------

TEST_F(PlannerCoreTest, ListsLeaveOutProgramsUnlessFullAndSnapshotsNeverChange) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto done = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(done.ok()) << done.status();
  auto basic = core_->ListPlans(0, "");
  ASSERT_TRUE(basic.ok());
  ASSERT_EQ(basic->plans_size(), 1);
  EXPECT_EQ(basic->plans(0).rank_programs_size(), 0);
  EXPECT_FALSE(basic->plans(0).has_graph());
  EXPECT_FALSE(basic->plans(0).has_program());
  EXPECT_EQ(basic->plans(0).content_hash(), done->content_hash());
  auto full = core_->ListPlans(0, "", /*full=*/true);
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->plans(0).rank_programs_size(), 2);
  EXPECT_TRUE(full->plans(0).has_program());
  // GetPlan's BASIC view keeps the program, not the rank programs.
  auto one = core_->GetPlan(done->name(), false);
  ASSERT_TRUE(one.ok());
  EXPECT_TRUE(one->has_program());
  EXPECT_EQ(one->rank_programs_size(), 0);
  EXPECT_EQ(one->SerializeAsString(), done->SerializeAsString());

  // A snapshot taken before a change keeps what it showed.
  BusyWorker busy(core_.get());
  auto before = core_->GetPlanSnapshot("plans/blocker");
  ASSERT_TRUE(before.ok());
  const v1::Plan::State was = (*before)->state();
  ASSERT_NE(was, v1::Plan::CANCELLED);
  busy.Release();
  EXPECT_EQ((*before)->state(), was);
  EXPECT_EQ((*core_->GetPlanSnapshot("plans/blocker"))->state(), v1::Plan::CANCELLED);
  EXPECT_THAT(core_->GetPlanSnapshot("plans/none"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/none")));
}

// The wire forms the gRPC server sends (GetPlanEncoded, ListPlansEncoded)
// parse to exactly the messages GetPlan and ListPlans return, page by
// page, and a plan that changes is served as it is now, not as it was
// when first serialized.
TEST_F(PlannerCoreTest, EncodedReadsAreTheMessagesAndFollowChanges) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (const char* id : {"p0", "p1", "p2"}) {
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  using google::protobuf::util::MessageDifferencer;
  for (const char* name : {"plans/p0", "plans/p1", "plans/p2"}) {
    for (bool full : {false, true}) {
      for (int twice = 0; twice < 2; ++twice) {  // the second read: the shared bytes
        auto bytes = core_->GetPlanEncoded(name, full);
        ASSERT_TRUE(bytes.ok()) << bytes.status();
        v1::Plan got;
        ASSERT_TRUE(got.ParseFromString(**bytes)) << name;
        auto want = core_->GetPlan(name, full);
        ASSERT_TRUE(want.ok());
        EXPECT_TRUE(MessageDifferencer::Equals(got, *want)) << name << " full=" << full;
        EXPECT_EQ(got.rank_programs_size() > 0, full) << name;
      }
    }
  }
  for (bool full : {false, true}) {
    std::string token;
    int pages = 0;
    do {
      std::vector<std::shared_ptr<const std::string>> plans;
      std::string next;
      ASSERT_TRUE(core_->ListPlansEncoded(2, token, full, &plans, &next).ok());
      auto want = core_->ListPlans(2, token, full);
      ASSERT_TRUE(want.ok());
      ASSERT_EQ(static_cast<int>(plans.size()), want->plans_size());
      for (size_t i = 0; i < plans.size(); ++i) {
        v1::Plan got;
        ASSERT_TRUE(got.ParseFromString(*plans[i]));
        EXPECT_TRUE(MessageDifferencer::Equals(got, want->plans(static_cast<int>(i))))
            << "page " << pages << " plan " << i << " full=" << full;
      }
      EXPECT_EQ(next, want->next_page_token());
      token = next;
      ++pages;
    } while (!token.empty() && pages < 10);
    EXPECT_EQ(pages, 2);
  }

  // Read while running, then cancelled: both views show CANCELLED.
  BusyWorker busy(core_.get());
  auto running = core_->GetPlanEncoded("plans/blocker", false);
  ASSERT_TRUE(running.ok());
  std::vector<std::shared_ptr<const std::string>> listed;
  std::string next;
  ASSERT_TRUE(core_->ListPlansEncoded(0, "", false, &listed, &next).ok());
  busy.Release();
  v1::Plan now;
  ASSERT_TRUE(now.ParseFromString(**core_->GetPlanEncoded("plans/blocker", false)));
  EXPECT_EQ(now.state(), v1::Plan::CANCELLED);
  v1::Plan before;
  ASSERT_TRUE(before.ParseFromString(**running));
  EXPECT_NE(before.state(), v1::Plan::CANCELLED) << "the bytes read before changed";
  ASSERT_TRUE(core_->ListPlansEncoded(0, "", false, &listed, &next).ok());
  ASSERT_EQ(listed.size(), 4u);
  v1::Plan in_list;
  ASSERT_TRUE(in_list.ParseFromString(*listed[0]));  // "plans/blocker" sorts first
  EXPECT_EQ(in_list.name(), "plans/blocker");
  EXPECT_EQ(in_list.state(), v1::Plan::CANCELLED);

  ASSERT_TRUE(core_->DeletePlan("plans/p1").ok());
  EXPECT_THAT(core_->GetPlanEncoded("plans/p1", false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/p1 does not exist")));
  EXPECT_THAT(core_->GetPlanEncoded("p1", false),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST_F(PlannerCoreTest, RetentionOptionsAreChecked) {
  PlannerCoreOptions o;
  o.plan_retention_count = -1;
  EXPECT_THAT(PlannerCore::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan_retention_count")));
  o.plan_retention_count = 1;
  o.plan_retention_age = absl::ZeroDuration();
  EXPECT_THAT(PlannerCore::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan_retention_age")));
}

}  // namespace
}  // namespace hap::service
