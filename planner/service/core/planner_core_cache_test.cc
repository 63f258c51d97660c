// PlannerCore's plan cache, the merging of identical requests in flight,
// plan retention (count, age, plans in use, deploy pins), and reads from
// snapshots (summaries, FULL reads, encoded reads).
#include "planner/service/core/planner_core.h"

#include <atomic>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "planner/service/core/planner_core_test_util.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using testing_internal::FakeClock;
using testing_internal::MakeNode;
using testing_internal::MlpRequest;
using testing_internal::PlannerCoreTest;
using testing_internal::RecordingSink;

using testing_internal::LongSearch;

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
  auto first = core_->CreatePlan(
      MlpRequest(), Deadline(), [] { return false; }, "jobs/j");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->state(), v1::Plan::SUCCEEDED) << first->error();
  EXPECT_EQ(first->job(), "jobs/j");  // kept through the search's result
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
  EXPECT_EQ(second->job(), "");  // a caller's copy is not the job's plan
  EXPECT_EQ(core_->GetPlan(second->name(), false)->job(), "");
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

// A CreatePlan that waits stops waiting when its caller goes away (a
// cancelled RPC), rather than holding a thread until the search ends; the
// plan goes on.
TEST_F(PlannerCoreTest, AWaitingCreatePlanEndsWhenItsCallerIsCancelled) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  BusyWorker busy(core_.get());  // the plan below waits in the queue
  int asked = 0;
  v1::CreatePlanRequest r = MlpRequest(/*wait=*/true);
  r.set_plan_id("waits");
  auto p = core_->CreatePlan(r, absl::InfiniteFuture(), [&] { return ++asked > 2; });
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::PENDING);
  EXPECT_EQ(asked, 3);
  busy.Release();
  EXPECT_EQ(WaitFinal(*core_, "plans/waits").state(), v1::Plan::SUCCEEDED);
}

// Plans not yet final are bounded (kMaxUnfinishedPlans): each holds its
// graph and cluster in memory and in the store until it is searched, and
// retention only trims finished plans, so a client creating plans faster
// than the workers search them grew the planner without end. One more is
// RESOURCE_EXHAUSTED, saved nowhere; a plan the cache answers is made.
TEST_F(PlannerCoreTest, PlansNotYetFinalAreBounded) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto cached = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(cached.ok()) << cached.status();
  BusyWorker busy(core_.get());  // one unfinished plan, the rest wait behind it
  v1::CreatePlanRequest other = MlpRequest(/*wait=*/false);
  (*other.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 64;  // not cached
  for (int i = 1; i < kMaxUnfinishedPlans; ++i) {
    other.set_plan_id(absl::StrCat("q", i));
    auto p = core_->CreatePlan(other, Deadline());
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
  }
  other.set_plan_id("over");
  EXPECT_THAT(
      core_->CreatePlan(other, Deadline()),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr(absl::StrCat(kMaxUnfinishedPlans)), HasSubstr("CancelPlan"))));
  EXPECT_THAT(core_->GetPlan("plans/over", false),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(sink_.Stored("plans/over"), v1::Plan::STATE_UNSPECIFIED);
  v1::CreatePlanRequest hit = MlpRequest(/*wait=*/false);
  hit.set_plan_id("hit");
  auto from_cache = core_->CreatePlan(hit, Deadline());
  ASSERT_TRUE(from_cache.ok()) << from_cache.status();
  EXPECT_EQ(from_cache->state(), v1::Plan::SUCCEEDED);
  busy.Release();
  EXPECT_EQ(WaitFinal(*core_, "plans/q1").state(), v1::Plan::SUCCEEDED);
  auto after = core_->CreatePlan(other, Deadline());
  ASSERT_TRUE(after.ok()) << after.status();
}

// Many callers creating one plan id at once, answered from the cache or
// searched: exactly one gets the plan, every other ALREADY_EXISTS, and one
// plan is stored.
TEST_F(PlannerCoreTest, ConcurrentCreatesOfOneIdMakeOnePlan) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->CreatePlan(MlpRequest(), Deadline()).ok());  // cached from now on
  for (bool cached : {true, false}) {
    const std::string id = cached ? "same-cached" : "same-searched";
    std::atomic<int> made{0}, exists{0};
    std::vector<std::thread> callers;
    for (int i = 0; i < 8; ++i) {
      callers.emplace_back([&, i] {
        v1::CreatePlanRequest r = MlpRequest(/*wait=*/false);
        r.set_plan_id(id);
        // The searched ones differ (no cache hit, no merge).
        if (!cached) (*r.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 40 + i;
        absl::StatusOr<v1::Plan> p = core_->CreatePlan(r, Deadline());
        if (p.ok()) ++made;
        if (absl::IsAlreadyExists(p.status())) ++exists;
      });
    }
    for (auto& t : callers) t.join();
    EXPECT_EQ(made.load(), 1) << id;
    EXPECT_EQ(exists.load(), 7) << id;
    EXPECT_NE(sink_.Stored("plans/" + id), v1::Plan::STATE_UNSPECIFIED);
  }
}

TEST_F(PlannerCoreTest, IdenticalRequestsInFlightShareOneSearch) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  BusyWorker busy(core_.get());
  std::vector<std::string> names;
  for (const char* id : {"one", "two", "three"}) {
    v1::CreatePlanRequest r = MlpRequest(/*wait=*/false);
    r.set_plan_id(id);
    // "two" is made for an elastic job (Plan.job), the others for callers.
    auto p = core_->CreatePlan(
        r, Deadline(), [] { return false; }, r.plan_id() == "two" ? "jobs/j" : "");
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
  // Each keeps whose it is, also when it took another's result.
  EXPECT_EQ(done[0].job(), "");
  EXPECT_EQ(done[1].job(), "jobs/j");
  EXPECT_EQ(done[2].job(), "");
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

// Plans that are searched (not answered from the cache) push old ones past
// the count when they finish, not when they are created: a CreatePlan that
// waited returns with the count kept, in the store too, without waiting for
// the daemon's periodic pass (a planner killed right after kept one plan too
// many: PlannerRetentionTest saw 4 of 3 after a restart); one nobody waits
// for is trimmed by the worker that finished it.
TEST_F(PlannerCoreTest, RetentionKeepsTheCountWhenSearchedPlansFinish) {
  retention_count_ = 2;
  Start({}, {});
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto distinct = [](int i, bool wait) {
    v1::CreatePlanRequest r = MlpRequest(wait);
    r.set_plan_id("p" + std::to_string(i));
    (*r.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 32 + 8 * i;  // no cache hit
    return r;
  };
  for (int i = 0; i < 3; ++i) {
    clock_.Advance(absl::Seconds(1));
    auto p = core_->CreatePlan(distinct(i, /*wait=*/true), Deadline());
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->state(), v1::Plan::SUCCEEDED);
  }
  EXPECT_EQ(PlanNames(*core_), (std::vector<std::string>{"plans/p1", "plans/p2"}));
  EXPECT_EQ(sink_.Plans().size(), 2u);
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(core_->CreatePlan(distinct(3, /*wait=*/false), Deadline()).ok());
  EXPECT_EQ(WaitFinal(*core_, "plans/p3").state(), v1::Plan::SUCCEEDED);
  // The worker trims after it finished p3 (WaitFinal may wake first).
  for (int i = 0; i < 1000 && PlanNames(*core_).size() > 2; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(PlanNames(*core_), (std::vector<std::string>{"plans/p2", "plans/p3"}));
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
// Plans p1 then p2, a second apart; `*racing` is set before p2, whose
// retention pass (over a count of 1) races the deploy it stands for.
void CreateP1ThenP2(FakeClock& clock, PlannerCore& core, bool* racing) {
  for (const char* id : {"p1", "p2"}) {
    clock.Advance(absl::Seconds(1));
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    if (std::string(id) == "p2") *racing = true;
    ASSERT_TRUE(core.CreatePlan(r, clock.Now() + absl::Seconds(60)).ok());
  }
}

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
  CreateP1ThenP2(clock_, *core_, &deploy_races);
  deploy_races = false;
  EXPECT_TRUE(core_->GetPlan("plans/p1", false).ok()) << "a pinned plan was deleted";
  EXPECT_EQ(*core_->EnforceRetention(), 0);
  core_->UnpinPlan("plans/p1");
  EXPECT_EQ(*core_->EnforceRetention(), 1);
  EXPECT_THAT(core_->PinPlan("plans/p1"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("p1")));
}

// plans_in_use answering `*deployed`, with a whole deploy of `plan` (pinned,
// its deployment made, unpinned) during the read when `*races` (once).
std::function<absl::StatusOr<std::set<std::string>>()> DeployedWhileRead(
    PlannerCore** core, bool* races, std::set<std::string>* deployed, const std::string& plan) {
  return [=]() -> absl::StatusOr<std::set<std::string>> {
    const std::set<std::string> before = *deployed;
    if (*races) {
      *races = false;
      EXPECT_TRUE((*core)->PinPlan(plan).ok());
      deployed->insert(plan);  // the deployment is made
      (*core)->UnpinPlan(plan);
    }
    return before;
  };
}

// A deploy unpins its plan once its deployment exists (which then keeps
// the plan through plans_in_use): a whole deploy between the pass reading
// the plans in use and deleting is seen by the unpin, the plans in use are
// read again, and the plan stays.
TEST_F(PlannerCoreTest, RetentionKeepsAPlanDeployedWholeDuringThePass) {
  retention_count_ = 1;
  PlannerCore* core = nullptr;
  bool deploy_races = false;
  std::set<std::string> deployed;
  plans_in_use_ = DeployedWhileRead(&core, &deploy_races, &deployed, "plans/p1");
  Start({}, {});
  core = core_.get();
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  CreateP1ThenP2(clock_, *core_, &deploy_races);
  EXPECT_TRUE(core_->GetPlan("plans/p1", false).ok()) << "a deployed plan was deleted";
  EXPECT_EQ(*core_->EnforceRetention(), 0);
  deployed.clear();  // its deployment deleted
  EXPECT_EQ(*core_->EnforceRetention(), 1);
}

// DeletePlan keeps a plan a deployment names, as retention does: one being
// deployed (pinned), one a deployment uses, and one whose whole deploy ran
// between the read of the plans in use and the delete. The service's own
// check (a deployment of the plan?) came before a deploy that then made
// one, and the deployment named a plan that was gone (or, with the id used
// again, another plan).
TEST_F(PlannerCoreTest, DeletePlanKeepsAPlanADeployHoldsOrMadeMeanwhile) {
  PlannerCore* core = nullptr;
  bool deploy_races = false;
  std::set<std::string> deployed;
  plans_in_use_ = DeployedWhileRead(&core, &deploy_races, &deployed, "plans/p");
  Start({}, {});
  core = core_.get();
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.set_plan_id("p");
  ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  ASSERT_TRUE(core_->PinPlan("plans/p").ok());
  EXPECT_THAT(core_->DeletePlan("plans/p"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("plans/p"), HasSubstr("being deployed"))));
  core_->UnpinPlan("plans/p");
  deploy_races = true;
  EXPECT_THAT(core_->DeletePlan("plans/p"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("plans/p"), HasSubstr("deployment"))));
  EXPECT_TRUE(core_->GetPlan("plans/p", false).ok()) << "a deployed plan was deleted";
  {
    absl::MutexLock l(&sink_.mu);
    EXPECT_TRUE(sink_.plans.count("plans/p"));
  }
  deployed.clear();  // its deployment deleted
  EXPECT_TRUE(core_->DeletePlan("plans/p").ok());
  EXPECT_THAT(core_->GetPlan("plans/p", false),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
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
