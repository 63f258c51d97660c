// DeploymentManager in process against a fleet of fake executors (no gRPC,
// supervisor threads for real, fast polls): its life cycle. Deploy and
// validation, every rank stopped when one fails or on StopDeployment,
// idempotent stops of a FAILED deployment, records the store refuses, the
// reads of every deployment. Waits are on conditions with deadlines, never
// sleeps. Deletion, restarts and step metrics have files of their own
// (deployment_manager_*_test.cc); the fixture is deployment_manager_test_util.h.
#include "planner/service/core/deployment_manager.h"

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/proto_time.h"
#include "planner/service/core/deployment_manager_test_util.h"

namespace hap::service::deployment_manager_testing {
namespace {

TEST_F(DeploymentManagerTest, DeployChecksThePlanAndTheExecutors) {
  v1::Plan pending = TwoDevicePlan();
  pending.set_state(v1::Plan::RUNNING);
  EXPECT_THAT(manager_->Deploy(pending, Request(), v1::Cluster(), "planner:1"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("only a SUCCEEDED plan can be deployed")));
  v1::DeployPlanRequest missing = Request();
  missing.mutable_executors()->erase("b/cpu0");
  EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), missing, v1::Cluster(), "planner:1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no executor address for device 'b/cpu0' (rank 1)")));
  // ... unless the node's label names it.
  v1::Cluster labelled;
  auto* node = labelled.add_nodes();
  (*node->mutable_labels())["hap.executor/b/cpu0"] = "b:1";
  auto d = manager_->Deploy(TwoDevicePlan(), missing, labelled, "planner:1");
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(d->name(), "deployments/p-g1");
  EXPECT_EQ(d->ranks(1).executor_address(), "b:1");
  v1::DeployPlanRequest extra = Request();
  (*extra.mutable_executors())["c/cpu0"] = "c:1";
  EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), extra, v1::Cluster(), "planner:1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'c/cpu0', which the plan does not use")));
  // Two ranks on one executor: its second LoadPlan replaced the first, and
  // the deployment ran one rank twice until the ranks' connect timed out.
  v1::DeployPlanRequest shared = Request();
  (*shared.mutable_executors())["b/cpu0"] = "a:1";
  EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), shared, v1::Cluster(), "planner:1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("devices 'a/cpu0' (rank 0) and 'b/cpu0' (rank 1) have the same "
                                 "executor 'a:1'")));
  (*labelled.mutable_nodes(0)->mutable_labels())["hap.executor/b/cpu0"] = "a:1";
  EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), missing, labelled, "planner:1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("same executor 'a:1'")));
  // An address gRPC would dial as another ('b:99999' is port 34463, 'b'
  // port 0): refused, from the request or from a label.
  for (const std::string bad : {"b:99999", "b", "b:", "b:http"}) {
    v1::DeployPlanRequest r = Request();
    (*r.mutable_executors())["b/cpu0"] = bad;
    EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), r, v1::Cluster(), "planner:1"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the executor address '" + bad +
                                   "' of device 'b/cpu0' (rank 1, from the request) must be "
                                   "HOST:PORT")));
  }
  (*labelled.mutable_nodes(0)->mutable_labels())["hap.executor/b/cpu0"] = "b:0";
  EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), missing, labelled, "planner:1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'b:0' of device 'b/cpu0' (rank 1, from its node's label)")));
}

// Training the executors would refuse at LoadPlan is refused by DeployPlan,
// naming the field and value (it made a deployment that FAILED on its push,
// and threads_per_rank had no upper bound on either side).
TEST_F(DeploymentManagerTest, DeployChecksTheTrainingConfig) {
  auto refused = [&](const std::function<void(v1::TrainingConfig&)>& edit,
                     const std::string& error) {
    v1::DeployPlanRequest r = Request();
    edit(*r.mutable_training());
    EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), r, v1::Cluster(), "planner:1"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(error)))
        << r.training().DebugString();
  };
  refused([](auto& t) { t.set_steps(-5); }, "training.steps must be 0 (100 steps) or more, got -5");
  refused([](auto& t) { t.set_threads_per_rank(4097); },
          "training.threads_per_rank must be 0 (the executor's --threads) to 4096, got 4097");
  refused([](auto& t) { t.set_threads_per_rank(-1); }, "threads_per_rank must be 0");
  refused([](auto& t) { t.set_checkpoint_every(-1); },
          "training.checkpoint_every must be 0 or more, got -1");
  refused([](auto& t) { t.set_checkpoint_keep(-2); },
          "training.checkpoint_keep must be 0 or more, got -2");
  refused([](auto& t) { t.set_log_every(-5); },
          "training.log_every must be 0 (every 100th step) or more, got -5");
  refused([](auto& t) { t.set_data(static_cast<v1::TrainingConfig::DataSource>(7)); },
          "training.data must be SYNTHETIC or WIKITEXT2, got 7");
  refused(
      [](auto& t) {
        t.set_resume("/ckpt");
        t.set_init_weights("/w.safetensors");
      },
      "training.resume ('/ckpt') and init_weights ('/w.safetensors') exclude each other");
  refused([](auto& t) { t.set_shuffle(true); }, "training.shuffle applies to data_spec");
  EXPECT_TRUE(manager_->All().empty());  // none was made
  v1::DeployPlanRequest ok = Request();
  ok.mutable_training()->set_threads_per_rank(4096);
  ok.mutable_training()->set_checkpoint_every(std::numeric_limits<int64_t>::max());
  ok.mutable_training()->set_steps(int64_t{1} << 62);
  EXPECT_THAT(manager_->Deploy(TwoDevicePlan(), ok, v1::Cluster(), "planner:1"), IsOk());
}

TEST_F(DeploymentManagerTest, AFailedRankFailsTheDeploymentAndTheOtherIsStopped) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  fleet_.Set("b:1", v1::ExecutorStatus::FAILED, "out of memory");
  v1::Deployment failed = WaitFor(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 1 (b/cpu0 at b:1) failed: out of memory"));
  // The supervisor stops the ranks after saying FAILED; a StopDeployment
  // now tells them again and is OK once each confirms.
  auto stopped = manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; });
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::FAILED);
  EXPECT_EQ(fleet_.status("a:1").state(), v1::ExecutorStatus::FAILED);
  EXPECT_GE(fleet_.stops("a:1"), 1);

  // A new deployment of the plan is taken by the same executors.
  auto next = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->name(), "deployments/p-g2");
  WaitFor(next->name(), v1::Deployment::RUNNING);
  EXPECT_EQ(fleet_.status("a:1").deployment(), "deployments/p-g2");
}

// on_finished (hap_deployments_finished_total) is told once per deployment,
// when it ends, not at the changes of its record that follow (the ranks a
// failed deployment could not stop, noted in its error after FAILED).
TEST_F(DeploymentManagerTest, OnFinishedIsToldOncePerDeploymentAsItEnds) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  {
    absl::MutexLock l(&mu_);
    EXPECT_THAT(finished_, ::testing::IsEmpty());
  }
  fleet_.SetReachable("a:1", false);
  WaitFor(d->name(), v1::Deployment::FAILED);
  {
    absl::MutexLock l(&mu_);
    auto noted = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return absl::StrContains(seen_[d->name()].error(), "not confirmed stopped");
    };
    ASSERT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&noted), absl::Seconds(30)))
        << seen_[d->name()].DebugString();
  }
  // Reachable again, its rank told to stop, the executors take a new one.
  fleet_.SetReachable("a:1", true);
  ASSERT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }), IsOk());
  auto next = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(next, IsOk());
  WaitFor(next->name(), v1::Deployment::RUNNING);
  ASSERT_THAT(manager_->Stop(next->name(), absl::InfiniteFuture(), [] { return false; }), IsOk());
  absl::MutexLock l(&mu_);
  EXPECT_THAT(finished_, ElementsAre("deployments/p-g1 FAILED", "deployments/p-g2 STOPPED"));
}

TEST_F(DeploymentManagerTest, AnUnreachableRankFailsTheDeploymentAndIsNamedByStop) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  fleet_.SetReachable("a:1", false);
  v1::Deployment failed = WaitFor(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(),
              HasSubstr("rank 0 (a/cpu0 at a:1) did not answer 3 status polls in a row"));
  EXPECT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("deployments/p-g1 is FAILED; its ranks were told to "
                                       "stop again"),
                             HasSubstr("rank 0 (a/cpu0 at a:1): a:1: connection refused"))));
  EXPECT_EQ(fleet_.status("b:1").state(), v1::ExecutorStatus::FAILED);
}

TEST_F(DeploymentManagerTest, StopStopsEveryRankThenSaysStopped) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  auto stopped = manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; });
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  for (const char* a : {"a:1", "b:1"}) {
    EXPECT_EQ(fleet_.stops(a), 1) << a;
    EXPECT_EQ(fleet_.status(a).state(), v1::ExecutorStatus::FAILED) << a;
  }
  EXPECT_THAT(manager_->Stop("deployments/nope", absl::InfiniteFuture(), [] { return false; }),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'deployments/nope'")));
}

// A stop whose STOPPED the store refuses is not reported as done: the ranks
// are stopped (that cannot be undone), but the call fails with the store's
// error, as a restarted planner would find the deployment RUNNING. Asked
// again, the record is saved again, and the call succeeds once it is.
TEST_F(DeploymentManagerTest, AStopTheStoreRefusesToRecordFailsUntilItIsSaved) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  sink_.Refuse(true);
  EXPECT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("deployments/p-g1 is STOPPED but the planner could not "
                                       "save it so"),
                             HasSubstr("disk is full"))));
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::RUNNING);
  EXPECT_EQ(fleet_.status("a:1").state(), v1::ExecutorStatus::FAILED);
  // Still full: asked again, it still fails.
  EXPECT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("disk is full")));
  sink_.Refuse(false);
  auto stopped = manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; });
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::STOPPED);
}

// A RUNNING the store refused is saved again at a later poll, without the
// note that it was not saved (before, the store held PENDING until the
// next change, and a restarted planner failed a deployment that ran).
TEST_F(DeploymentManagerTest, ARunningTheStoreRefusedIsSavedAtALaterPoll) {
  sink_.RefuseStates({v1::Deployment::RUNNING});
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  const v1::Deployment served = WaitFor(d->name(), v1::Deployment::RUNNING);
  EXPECT_THAT(served.error(), HasSubstr("could not save this deployment as RUNNING"));
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::PENDING);
  sink_.RefuseStates({});  // space again
  ASSERT_TRUE(sink_.AwaitStored(d->name(), v1::Deployment::RUNNING));
  EXPECT_EQ(sink_.deployment(d->name()).error(), "");
  auto now = manager_->Get(d->name());
  ASSERT_THAT(now, IsOk());
  EXPECT_EQ(now->state(), v1::Deployment::RUNNING);
  EXPECT_EQ(now->error(), "");
}

// A deployment that ends gets its end_time, which retention counts from.
TEST_F(DeploymentManagerTest, AFinishedDeploymentRecordsWhenItEnded) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  EXPECT_FALSE(d->has_end_time());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  const absl::Time before = absl::Now();
  auto stopped = manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; });
  ASSERT_THAT(stopped, IsOk());
  ASSERT_TRUE(stopped->has_end_time());
  EXPECT_GE(FromProto(stopped->end_time()), before - absl::Seconds(1));
  EXPECT_TRUE(sink_.deployment(d->name()).has_end_time());
}

// Summaries: every record without its rank profiles (what /metrics and the
// status page read, copied under the lock), the profiles still there for
// All(); OfPlan: one plan's deployments, whole.
TEST(DeploymentManagerReadsTest, SummariesLeaveOutProfilesAndOfPlanFiltersByPlan) {
  std::vector<v1::Deployment> stored;
  for (const char* name : {"deployments/a-g1", "deployments/b-g1", "deployments/a-g2"}) {
    v1::Deployment d;
    d.set_name(name);
    d.set_plan(absl::StrCat("plans/", std::string(name).substr(12, 1)));
    d.set_state(v1::Deployment::SUCCEEDED);
    d.set_steps_completed(5);
    for (int r = 0; r < 2; ++r) {
      d.add_ranks()->set_rank(r);
      v1::StepProfile* p = d.add_rank_profiles();
      p->set_rank(r);
      p->set_steps(5);
      (*p->mutable_op_seconds())["matmul"] = 0.5 + r;
    }
    stored.push_back(d);
  }
  DeploymentManagerOptions o = NoExecutors();
  DeploymentManager m(std::move(o), stored);
  for (int pass = 0; pass < 2; ++pass) {  // the profiles come back after each
    const std::vector<v1::Deployment> summaries = m.Summaries();
    ASSERT_EQ(summaries.size(), 3u);
    for (const v1::Deployment& d : summaries) {
      EXPECT_EQ(d.rank_profiles_size(), 0) << d.name();
      EXPECT_EQ(d.ranks_size(), 2) << d.name();
      EXPECT_EQ(d.steps_completed(), 5) << d.name();
    }
    const std::vector<v1::Deployment> all = m.All();
    ASSERT_EQ(all.size(), 3u);
    for (const v1::Deployment& d : all) {
      ASSERT_EQ(d.rank_profiles_size(), 2) << d.name();
      EXPECT_EQ(d.rank_profiles(1).op_seconds().at("matmul"), 1.5) << d.name();
    }
  }
  std::vector<std::string> of_a;
  for (const v1::Deployment& d : m.OfPlan("plans/a")) {
    EXPECT_EQ(d.rank_profiles_size(), 2);
    of_a.push_back(d.name());
  }
  EXPECT_THAT(of_a, ElementsAre("deployments/a-g1", "deployments/a-g2"));
  EXPECT_THAT(m.OfPlan("plans/none"), IsEmpty());
}

}  // namespace
}  // namespace hap::service::deployment_manager_testing
