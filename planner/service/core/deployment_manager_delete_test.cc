// Deleting finished deployments: DeleteDeployment (refused for one not
// finished or a job's, waiting for a supervisor still stopping ranks only
// as long as the caller allows) and deployment retention by count and by
// age.
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/deployment_manager_test_util.h"

namespace hap::service::deployment_manager_testing {
namespace {

// DeleteDeployment: a finished deployment goes with its step metrics, from
// the store first; one not finished, or an unfinished job's, is refused.
TEST_F(DeploymentManagerTest, DeleteRemovesAFinishedDeploymentAndRefusesARunningOne) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  EXPECT_THAT(manager_->Delete(d->name(), {}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("'deployments/p-g1' is RUNNING"),
                             HasSubstr("hapctl stop deployment p-g1"))));
  EXPECT_THAT(manager_->Delete("deployments/nope", {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("deployments/nope")));
  ASSERT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }), IsOk());
  EXPECT_THAT(manager_->Delete(d->name(), {d->name()}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("an elastic job")));
  EXPECT_THAT(manager_->Delete(d->name(), {}), IsOk());
  EXPECT_THAT(manager_->Get(d->name()), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(manager_->StepMetrics(d->name()),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(sink_.deleted(), std::vector<std::string>{d->name()});
  // The plan's next deployment goes on from the deleted one's generation.
  auto next = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->name(), "deployments/p-g2");
}

// A delete waits for a finished deployment's supervisor, still telling
// its ranks to stop, only until the caller's deadline: then
// DeadlineExceeded naming the deployment and what it waited for, with
// nothing deleted (it waited 5 s whatever the deadline, and said
// Unavailable). A cancelled caller is answered Cancelled, also with
// nothing deleted; once the supervisor returns, the delete goes through.
TEST_F(DeploymentManagerTest, DeleteWaitsForTheSupervisorOnlyUntilTheCallersDeadline) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  WaitFor(d->name(), v1::Deployment::RUNNING);
  v1::StepMetric m;
  m.set_deployment(d->name());
  m.set_step_seconds(1.0);
  ASSERT_THAT(manager_->ReportStepMetrics({m}), IsOk());
  fleet_.HoldStops(true);
  fleet_.Set("a:1", v1::ExecutorStatus::FAILED, "loss is NaN");
  // FAILED, then its supervisor tells the ranks to stop, and is held there.
  WaitFor(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(
      manager_->Delete(d->name(), {}, absl::Now() + absl::Milliseconds(100), [] { return false; }),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               AllOf(HasSubstr("deployment 'deployments/p-g1' (FAILED) was not deleted"),
                     HasSubstr("the call's deadline passed while waiting for the "
                               "planner to finish telling its ranks to stop"))));
  EXPECT_THAT(manager_->Delete(d->name(), {}, absl::InfiniteFuture(), [] { return true; }),
              StatusIs(absl::StatusCode::kCancelled,
                       AllOf(HasSubstr("deployment 'deployments/p-g1' (FAILED) was not deleted"),
                             HasSubstr("the call was cancelled while waiting"))));
  // Nothing lost: the record and its metrics, in memory and stored.
  auto kept = manager_->Get(d->name());
  ASSERT_THAT(kept, IsOk());
  EXPECT_EQ(kept->state(), v1::Deployment::FAILED);
  auto metrics = manager_->StepMetrics(d->name());
  ASSERT_THAT(metrics, IsOk());
  EXPECT_EQ(metrics->size(), 1u);
  EXPECT_THAT(sink_.deleted(), IsEmpty());
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::FAILED);
  fleet_.HoldStops(false);
  EXPECT_THAT(manager_->Delete(d->name(), {}, absl::InfiniteFuture(), [] { return false; }),
              IsOk());
  EXPECT_EQ(sink_.deleted(), std::vector<std::string>{d->name()});
  EXPECT_THAT(manager_->Get(d->name()), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// Deployment retention: finished deployments past the count (or age) go,
// record and metrics, from the store and memory; the plan's generations go
// on; a job's stays.
TEST_F(DeploymentManagerTest, RetentionDeletesFinishedDeploymentsPastTheCount) {
  const absl::Time t = absl::FromUnixSeconds(1'800'000'000);
  Start({Finished("p", 1, v1::Deployment::SUCCEEDED, t + absl::Hours(1), t),
         Finished("p", 2, v1::Deployment::FAILED, t + absl::Hours(2), t),
         Finished("p", 3, v1::Deployment::SUCCEEDED, t + absl::Hours(3), t),
         Finished("b", 1, v1::Deployment::STOPPED, t, t),
         Finished("c", 1, v1::Deployment::STOPPED, std::nullopt, t + absl::Hours(4))});
  // Newest first: c-g1 (its create_time), p-g3 | p-g2, p-g1, b-g1.
  auto deleted = manager_->EnforceRetention(2, absl::InfinitePast(), {});
  ASSERT_THAT(deleted, IsOk());
  EXPECT_EQ(*deleted, 3);
  for (const char* gone : {"deployments/p-g1", "deployments/p-g2", "deployments/b-g1"}) {
    EXPECT_THAT(manager_->Get(gone), StatusIs(absl::StatusCode::kNotFound, HasSubstr(gone)));
  }
  EXPECT_THAT(sink_.deleted(), ::testing::UnorderedElementsAre(
                                   "deployments/p-g1", "deployments/p-g2", "deployments/b-g1"));
  EXPECT_THAT(manager_->Get("deployments/p-g3"), IsOk());
  EXPECT_THAT(manager_->Get("deployments/c-g1"), IsOk());
  // Nothing more to do at the same limits.
  auto again = manager_->EnforceRetention(2, absl::InfinitePast(), {});
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*again, 0);
  // The plan's generations go on from the deleted ones.
  ASSERT_THAT(manager_->EnforceRetention(1, absl::InfinitePast(), {}), IsOk());
  EXPECT_THAT(manager_->Get("deployments/p-g3"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("p-g3")));
  auto next = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->name(), "deployments/p-g4");
  EXPECT_EQ(next->generation(), 4);
}

TEST_F(DeploymentManagerTest, RetentionByAgeKeepsAJobsDeploymentAndNamesARefusal) {
  const absl::Time t = absl::FromUnixSeconds(1'800'000'000);
  Start({Finished("p", 1, v1::Deployment::SUCCEEDED, t, t),
         Finished("p", 2, v1::Deployment::SUCCEEDED, t + absl::Hours(20), t),
         Finished("c", 1, v1::Deployment::STOPPED, t, t)});
  auto deleted = manager_->EnforceRetention(0, t + absl::Hours(10), {"deployments/c-g1"});
  ASSERT_THAT(deleted, IsOk());
  EXPECT_EQ(*deleted, 1);
  EXPECT_THAT(sink_.deleted(), ::testing::ElementsAre("deployments/p-g1"));
  for (const char* kept : {"deployments/p-g2", "deployments/c-g1"}) {
    EXPECT_THAT(manager_->Get(kept), IsOk()) << kept;
  }
  // A store that refuses: an error naming the deployment, which stays.
  sink_.Refuse(true);
  EXPECT_THAT(
      manager_->EnforceRetention(0, t + absl::Hours(30), {}),
      StatusIs(absl::StatusCode::kUnavailable,
               AllOf(HasSubstr("deployment retention: deployments/"), HasSubstr("disk is full"))));
  EXPECT_EQ(manager_->All().size(), 2u);
}

}  // namespace
}  // namespace hap::service::deployment_manager_testing
