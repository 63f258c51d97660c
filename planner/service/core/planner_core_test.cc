// PlannerCore's plans: create, read, page, watch, cancel, restarts, writes
// the store refuses, and the options' checks (the cache, merging, retention
// and snapshot reads: planner_core_cache_test).
#include "planner/service/core/planner_core.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_file.h"
#include "planner/service/core/pagination.h"
#include "planner/service/core/planner_core_test_util.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using testing_internal::FakeClock;
using testing_internal::LongSearch;
using testing_internal::MakeNode;
using testing_internal::MlpRequest;
using testing_internal::PlannerCoreTest;
using testing_internal::RecordingSink;

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

TEST_F(PlannerCoreTest, APipelineIsPlannedWhereTheSpmdPlanDoesNotFit) {
  // Activations dominate: the whole batch at once needs ~4.7 MB a device,
  // 64 microbatches on 2-device stages far less.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 4e12, 1'000'000)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 4e12, 1'000'000)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 4;
  (*r.mutable_model()->mutable_zoo()->mutable_params())["batch"] = 4096;
  v1::CreatePlanRequest spmd = r;
  auto s = core_->CreatePlan(spmd, Deadline());
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->state(), v1::Plan::FAILED);
  EXPECT_EQ(s->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  r.mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
  r.mutable_options()->set_pipeline_stages(2);
  r.mutable_options()->set_pipeline_microbatches(64);
  auto p = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  ASSERT_EQ(p->pipeline().stages_size(), 2);
  for (const v1::PipelineStage& st : p->pipeline().stages()) {
    for (int64_t m : st.memory_bytes_per_device()) EXPECT_LE(m, 1'000'000);
  }
  EXPECT_THAT(p->notes(), ::testing::Contains(HasSubstr("the SPMD plan does not fit")));
}

TEST_F(PlannerCoreTest, BadRequestsGetSpecificStatuses) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  r.add_devices("a/cpu0");
  r.add_devices("z/gpu9");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'z/gpu9'")));
  // The request's device list, not the cluster, is wrong.
  v1::CreatePlanRequest twice = MlpRequest();
  for (const char* d : {"a/cpu0", "a/cpu1", "a/cpu0"}) twice.add_devices(d);
  EXPECT_THAT(core_->CreatePlan(twice, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("devices"), HasSubstr("'a/cpu0' twice"))));
  // One device is no plan (its program is the single-device one): the
  // request is wrong whatever the cluster holds.
  v1::CreatePlanRequest one = MlpRequest();
  one.add_devices("a/cpu0");
  EXPECT_THAT(core_->CreatePlan(one, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("devices"), HasSubstr("at least 2"), HasSubstr("lists 1"))));
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

TEST_F(PlannerCoreTest, AGlobalBatchForAGraphWhoseFirstInputIsAScalarIsInvalidArgument) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto g = graph::BuildZooModel("mlp", {{"layers", 1}, {"hidden", 8}, {"input", 4}, {"batch", 4}});
  ASSERT_TRUE(g.ok());
  const v1::Graph mlp = graph::ToProto(*g);
  v1::CreatePlanRequest r = MlpRequest();
  v1::Graph* graph = r.mutable_model()->mutable_graph();
  *graph = mlp;
  graph->clear_inputs();
  v1::Input* scalar = graph->add_inputs();  // first, with no batch dimension
  scalar->mutable_tensor()->set_name("temperature");
  scalar->mutable_tensor()->set_dtype(v1::FLOAT32);
  for (const v1::Input& in : mlp.inputs()) *graph->add_inputs() = in;
  r.set_global_batch(4);
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("global_batch 4"), HasSubstr("'temperature'"))));
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

TEST_F(PlannerCoreTest, AModelBeyondInt64BytesFailsEvenWithMemoryLimitsIgnored) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  // Embedding and decoder of 5e17 floats each: with Adam's two states and
  // the gradients, 1.6e19 bytes on a device, more than an int64 counts.
  v1::CreatePlanRequest r;
  auto* zoo = r.mutable_model()->mutable_zoo();
  zoo->set_name("gpt");
  for (const auto& [k, v] : std::map<std::string, double>{{"layers", 1},
                                                          {"hidden", 512},
                                                          {"heads", 1},
                                                          {"ffn", 1},
                                                          {"seq", 1},
                                                          {"vocab", 1e15},
                                                          {"batch", 4}}) {
    (*zoo->mutable_params())[k] = v;
  }
  r.set_wait(true);
  r.mutable_options()->mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
  r.mutable_options()->set_ignore_memory_limits(true);
  auto p = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::FAILED);
  for (int64_t m : p->prediction().memory_bytes_per_device()) EXPECT_GE(m, 0);
  EXPECT_EQ(p->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(p->error(), HasSubstr("2^63 bytes"));
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

// A FULL page holds whole plans up to kMaxPageBytes (at least one),
// and its token goes on from the last: 1,000 plans of a GPT-48 on 8
// devices (megabytes each) were read whole, encoded and joined into one
// answer of gigabytes, past what gRPC sends, by one ListPlans.
TEST_F(PlannerCoreTest, AFullPageOfPlansIsBoundedInBytes) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 4, 2e12)).ok());
  v1::CreatePlanRequest r = MlpRequest();
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 32;
  r.set_plan_id("p0");
  auto first = core_->CreatePlan(r, Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  const size_t one = core_->GetPlan("plans/p0", true)->ByteSizeLong();
  const int plans = static_cast<int>(kMaxPageBytes / one) * 3 / 2;
  for (int i = 1; i < plans; ++i) {  // copies from the cache
    r.set_plan_id(absl::StrCat("p", i));
    ASSERT_TRUE(core_->CreatePlan(r, Deadline()).ok());
  }
  std::set<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    auto page = core_->ListPlans(kMaxPageSize, token, /*full=*/true);
    ASSERT_TRUE(page.ok()) << page.status();
    ASSERT_GT(page->plans_size(), 0);
    size_t bytes = 0;
    for (const v1::Plan& p : page->plans()) {
      EXPECT_GT(p.rank_programs_size(), 0);  // whole
      bytes += p.ByteSizeLong();
      EXPECT_TRUE(seen.insert(p.name()).second) << p.name() << " twice";
    }
    EXPECT_LE(bytes, kMaxPageBytes + one);
    token = page->next_page_token();
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(static_cast<int>(seen.size()), plans);
  EXPECT_GE(pages, 2);
  // BASIC pages are as long as asked.
  auto basic = core_->ListPlans(kMaxPageSize, "", /*full=*/false);
  ASSERT_TRUE(basic.ok());
  EXPECT_EQ(basic->plans_size(), std::min(plans, kMaxPageSize));
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
       "options.optimizer.beta2 must be in [0, 1) (unset = 0.999), got 1"},
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
      {[&](v1::PlanOptions& o) { o.set_gradient_precision(static_cast<v1::Precision>(9)); },
       "options.gradient_precision 9 is not a known precision (FP32 or BF16)"},
      {[&](v1::PlanOptions& o) { o.set_pipeline(static_cast<v1::PlanOptions::Pipeline>(9)); },
       "options.pipeline 9 is not a known pipeline mode (PIPELINE_OFF, PIPELINE_AUTO or "
       "PIPELINE_STAGES)"},
      {[&](v1::PlanOptions& o) {
         o.set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
         o.set_pipeline_stages(-1);
       },
       "options.pipeline_stages must be at least 1 with PIPELINE_STAGES, got -1"},
      {[&](v1::PlanOptions& o) {
         o.set_pipeline(v1::PlanOptions::PIPELINE_AUTO);
         o.set_pipeline_microbatches(-3);
       },
       "options.pipeline_microbatches must not be negative, got -3"},
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

}  // namespace
}  // namespace hap::service
