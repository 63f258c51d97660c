// A manager restarted on the stored state: a RUNNING deployment re-attached
// to, a PENDING one or one in a state it cannot follow failed (and why),
// generations that go on past deleted ones.
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/deployment_manager_test_util.h"

namespace hap::service::deployment_manager_testing {
namespace {

// A restarted manager names a plan's next deployment past the highest
// generation the store ever held, not only past those it loaded: with the
// newest deleted (hapctl delete deployment, retention) and an older one
// kept, the next deploy took the deleted one's name again.
TEST_F(DeploymentManagerTest, ARestartedManagerGoesOnPastADeletedNewerGeneration) {
  const absl::Time t = absl::FromUnixSeconds(1'800'000'000);
  for (int64_t g : {1, 2, 3}) {
    ASSERT_THAT(sink_.SaveDeployment(Finished("p", g, v1::Deployment::FAILED, t, t)), IsOk());
  }
  ASSERT_THAT(sink_.DeleteDeployment("deployments/p-g3"), IsOk());
  Start(sink_.deployments());  // p-g1 and p-g2
  auto next = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->name(), "deployments/p-g4");
  EXPECT_EQ(next->generation(), 4);
}

TEST_F(DeploymentManagerTest, ARestartedManagerReattachesAndStops) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  manager_->Shutdown();
  EXPECT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
  Start(sink_.deployments());  // the old one is gone; its executors train on
  EXPECT_EQ(fleet_.status("a:1").state(), v1::ExecutorStatus::TRAINING);
  EXPECT_EQ(fleet_.stops("a:1"), 0);
  auto again = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->name(), "deployments/p-g2");  // generations go on from the saved ones
  // g2 is refused by the executors still training g1, and fails; g1 is
  // watched on and stopped on request.
  WaitFor("deployments/p-g2", v1::Deployment::FAILED);
  auto stopped = manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; });
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  EXPECT_EQ(fleet_.status("a:1").state(), v1::ExecutorStatus::FAILED);
  EXPECT_EQ(fleet_.status("b:1").state(), v1::ExecutorStatus::FAILED);
}

// A deployment stored in a state this version does not follow (neither
// RUNNING nor final: a value of a later version here) is failed on load,
// naming that state, and its ranks are stopped, as a PENDING one's are.
TEST_F(DeploymentManagerTest, ADeploymentStoredInAStateItCannotFollowIsFailedNamingIt) {
  const v1::Deployment failed = FailedOnRestartFrom(static_cast<v1::Deployment::State>(9));
  EXPECT_THAT(failed.error(), HasSubstr("stored in state 9 (unknown)"));
  EXPECT_EQ(failed.failure_cause(), v1::Deployment::FAILURE_CAUSE_UNSPECIFIED);
  EXPECT_FALSE(FailedByPlannerRestartBeforeTraining(failed));
  // Its ranks are stopped once it is FAILED.
  ASSERT_TRUE(fleet_.AwaitStopped({"a:1", "b:1"}));
  EXPECT_EQ(fleet_.status("a:1").state(), v1::ExecutorStatus::FAILED);
  EXPECT_EQ(fleet_.status("b:1").state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(manager_->StoreSet(failed.name(), 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("FAILED")));
}

// A deployment stored PENDING (its push died with the previous planner)
// is failed by the restarted manager with failure_cause
// PLANNER_RESTARTED_BEFORE_TRAINING, saved with the FAILED state, and the
// error for people.
TEST_F(DeploymentManagerTest, AStoredPendingDeploymentIsFailedWithThePlannerRestartCause) {
  const v1::Deployment failed = FailedOnRestartFrom(v1::Deployment::PENDING);
  EXPECT_EQ(failed.failure_cause(), v1::Deployment::PLANNER_RESTARTED_BEFORE_TRAINING);
  EXPECT_THAT(failed.error(), HasSubstr(kPlannerRestartedBeforeTraining));
  EXPECT_TRUE(FailedByPlannerRestartBeforeTraining(failed));
  ASSERT_TRUE(sink_.AwaitStored(failed.name(), v1::Deployment::FAILED));
  EXPECT_EQ(sink_.deployment(failed.name()).failure_cause(),
            v1::Deployment::PLANNER_RESTARTED_BEFORE_TRAINING);
}

// The failure_cause decides; a record saved by a planner older than it
// (no failure_cause) says a restart failed it only in its error, which is
// still read.
TEST(FailedByPlannerRestartTest, ReadsTheFailureCauseOrAnOlderPlannersError) {
  v1::Deployment d;
  d.set_state(v1::Deployment::FAILED);
  d.set_failure_cause(v1::Deployment::PLANNER_RESTARTED_BEFORE_TRAINING);
  EXPECT_TRUE(FailedByPlannerRestartBeforeTraining(d));
  d.set_state(v1::Deployment::RUNNING);
  EXPECT_FALSE(FailedByPlannerRestartBeforeTraining(d));

  v1::Deployment older;  // no failure_cause
  older.set_state(v1::Deployment::FAILED);
  older.set_error(absl::StrCat(kPlannerRestartedBeforeTraining,
                               "; not confirmed stopped after 2 attempts: rank 1"));
  EXPECT_TRUE(FailedByPlannerRestartBeforeTraining(older));
  older.add_failed_ranks(1);  // a rank to blame: not the planner's doing
  EXPECT_FALSE(FailedByPlannerRestartBeforeTraining(older));

  v1::Deployment by_ranks;
  by_ranks.set_state(v1::Deployment::FAILED);
  by_ranks.set_error("rank 0 (a/cpu0 at a:1) failed: loss is NaN");
  EXPECT_FALSE(FailedByPlannerRestartBeforeTraining(by_ranks));
}

}  // namespace
}  // namespace hap::service::deployment_manager_testing
