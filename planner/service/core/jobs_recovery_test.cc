// The job controller after a loss: a lost executor, a STALE node, a second
// failure, a stop during recovery, the re-plan limit.
#include "absl/strings/str_format.h"
#include "planner/service/core/jobs.h"
#include "planner/service/core/jobs_test_util.h"

namespace hap::service::jobs_testing {
namespace {

TEST_F(JobsTest, LostExecutorReplansOnTheSurvivorsFromTheLatestCommittedCheckpoint) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 40;
  fake_.Only(first).set_steps_completed(47);
  c_->Reconcile();
  // Rank 2's executor is killed: the deployment manager fails the
  // deployment (and stops the others); its node is STALE a little later.
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).set_error("rank 2 (d2) did not answer 3 status polls in a row");
  fake_.SetNode(2, v1::Node::STALE);
  const absl::Time failed = now_;
  c_->Reconcile();
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RECOVERING);
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::EXECUTOR_LOST));
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1"));
  EXPECT_EQ(fake_.requests[1].global_batch(), 32);  // the data order does not change
  const std::string second = j.status().deployment();
  ASSERT_NE(second, first);
  EXPECT_EQ(fake_.Only(second).training().resume(), "/shared/ckpt/step-00000040");
  EXPECT_EQ(j.status().generation(), 2);
  EXPECT_EQ(j.status().steps_done(), 40);

  now_ += absl::Seconds(4);
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  ASSERT_EQ(j.status().events_size(), 2);
  const v1::JobEvent& e = j.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_THAT(e.detail(), HasSubstr("did not answer"));
  EXPECT_DOUBLE_EQ(e.downtime_seconds(), absl::ToDoubleSeconds(now_ - failed));
  EXPECT_EQ(e.steps_done_before(), 47);
  EXPECT_EQ(e.resume_step(), 40);
  EXPECT_EQ(e.steps_lost(), 7);
  EXPECT_DOUBLE_EQ(e.predicted_step_before(), 1.0 / 3);
  EXPECT_DOUBLE_EQ(e.predicted_step_after(), 1.0 / 2);
  EXPECT_THAT(e.devices_before(), ElementsAre("d0", "d1", "d2"));
  EXPECT_THAT(e.devices_after(), ElementsAre("d0", "d1"));
  EXPECT_EQ(j.status().replans(), 1);
  ASSERT_EQ(resumed_.size(), 2u);
  EXPECT_EQ(resumed_[1].reason(), v1::JobEvent::EXECUTOR_LOST);
}

// A recovery whose checkpoint turns out damaged (the new deployment's
// executors found a shard whose checksum does not match): the checkpoint is
// set aside and the job resumes from the one before, instead of resuming
// from the damaged one on every re-plan until max_replans. No device is
// held out: the executors are fine.
TEST_F(JobsTest, ADamagedCheckpointIsSetAsideAndTheJobResumesFromTheOneBefore) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 40;
  fake_.checkpoint_before_damaged = 30;
  fake_.Only(first).set_steps_completed(47);
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(2);
  fake_.SetNode(2, v1::Node::STALE);
  c_->Reconcile();
  const std::string second = Deployment();
  EXPECT_EQ(fake_.Only(second).training().resume(), "/shared/ckpt/step-00000040");

  now_ += absl::Seconds(3);
  fake_.SetState(second, v1::Deployment::FAILED);
  fake_.Only(second).set_error(
      "rank 0 (d0) failed: training.resume: rank-00001.safetensors: tensor 'w1' does not match "
      "its checksum");
  fake_.Only(second).set_damaged_checkpoint("/shared/ckpt/step-00000040");
  c_->Reconcile();
  EXPECT_THAT(fake_.set_aside, ElementsAre("/shared/ckpt/step-00000040"));
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RECOVERING);
  const std::string third = j.status().deployment();
  ASSERT_NE(third, second);
  EXPECT_EQ(fake_.Only(third).training().resume(), "/shared/ckpt/step-00000030");
  EXPECT_EQ(j.status().checkpoint_step(), 30);
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::EXECUTOR_LOST, v1::JobEvent::CHECKPOINT_DAMAGED));
  EXPECT_EQ(j.status().held_size(), 1);  // d2's, from the first failure only
  ASSERT_EQ(j.status().damaged_checkpoints_size(), 1);
  EXPECT_THAT(j.status().damaged_checkpoints(0),
              AllOf(HasSubstr("/shared/ckpt/step-00000040 -> /shared/ckpt/damaged-step-00000040"),
                    HasSubstr("does not match its checksum")));

  fake_.SetState(third, v1::Deployment::RUNNING);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  ASSERT_EQ(j.status().events_size(), 2);
  const v1::JobEvent& e = j.status().events(1);  // one recovery, both causes said
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_THAT(e.detail(), AllOf(HasSubstr("then, while recovering"),
                                HasSubstr("damaged-step-00000040"), HasSubstr("from step 30")));
  EXPECT_EQ(e.resume_step(), 30);
  EXPECT_EQ(e.steps_lost(), 17);
  EXPECT_EQ(e.deployment(), third);
}

// A recovery whose deployments keep failing (a job given a large
// max_replans to never give up) appended each failure to its event's
// detail: the job record, saved whole on every change and copied into its
// events, grew without bound (about 100 bytes a failure here; a
// deployment's error names every rank). The detail keeps what started the
// recovery and the latest failures, within a bound.
TEST_F(JobsTest, ARecoveryThatKeepsFailingKeepsItsEventDetailBounded) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(100000);
  const std::string first = StartRunning(r);
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).set_error("the first failure");
  c_->Reconcile();
  for (int i = 0; i < 500; ++i) {
    const std::string d = Deployment();
    fake_.SetState(d, v1::Deployment::FAILED);
    fake_.Only(d).set_error(absl::StrCat("failure ", i, " while recovering"));
    c_->Reconcile();
  }
  const v1::Job j = Job();
  ASSERT_EQ(j.status().state(), v1::JobStatus::RECOVERING);
  EXPECT_EQ(j.status().replans(), 501);
  const std::string& detail = j.status().pending().detail();
  EXPECT_LE(detail.size(), 4096u);
  EXPECT_THAT(detail,
              AllOf(HasSubstr("the first failure"), HasSubstr("failure 499 while recovering")));
  EXPECT_LE(sink_.jobs.at("jobs/train").ByteSizeLong(), 16u << 10);
}

// A running job's own deployment fails on a damaged checkpoint it resumed
// from with none before it: it trains again from step 0.
TEST_F(JobsTest, ADamagedCheckpointWithNoneBeforeItResumesFromStepZero) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 10;
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).set_damaged_checkpoint("/shared/ckpt/step-00000010");
  fake_.Only(first).set_error("LoadPlan on rank 1: trainer.json is corrupted");
  c_->Reconcile();
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::CHECKPOINT_DAMAGED));
  EXPECT_EQ(fake_.Only(Deployment()).training().resume(), "");
  EXPECT_EQ(Job().status().checkpoint_step(), -1);
  EXPECT_THAT(Job().status().pending().detail(), HasSubstr("step 0 (no checkpoint before it)"));
  EXPECT_EQ(Job().status().held_size(), 0);
}

// A damaged checkpoint that cannot be renamed (the directory is not the
// planner's to change) fails the job, saying what to do; a transient error
// is tried again at the next pass.
TEST_F(JobsTest, ADamagedCheckpointThatCannotBeSetAsideFailsTheJobSayingWhatToDo) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 20;
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).set_damaged_checkpoint("/shared/ckpt/step-00000020");
  fake_.Only(first).set_error("rank 0 failed: training.resume: checksum");
  fake_.set_aside_error = absl::UnavailableError("cannot sync /shared/ckpt: EIO");
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
  EXPECT_THAT(Job().status().message(), HasSubstr("trying again"));
  EXPECT_EQ(fake_.deployed.size(), 1u);

  fake_.set_aside_error = absl::FailedPreconditionError("cannot rename: Permission denied");
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::FAILED);
  EXPECT_THAT(Job().status().message(),
              AllOf(HasSubstr("/shared/ckpt/step-00000020 is damaged"),
                    HasSubstr("Permission denied"), HasSubstr("move it out of /shared/ckpt")));
  EXPECT_EQ(fake_.deployed.size(), 1u);
}

// Checkpoints reported damaged one after another, none trained from: after
// two set aside the job FAILS rather than rename more (a node that does not
// see the storage as written would otherwise walk it back to step 0). A
// step trained in between starts the count again.
TEST_F(JobsTest, DamagedCheckpointsInARowStopAfterTwoUnlessAStepIsTrainedBetween) {
  Make();
  std::string d = StartRunning();
  auto damaged = [&](int64_t latest, int64_t before) {
    fake_.checkpoint = latest;
    fake_.checkpoint_before_damaged = before;
    fake_.SetState(d, v1::Deployment::FAILED);
    fake_.Only(d).set_error("rank 1 failed: training.resume: no file rank-00001-of-00003");
    fake_.Only(d).set_damaged_checkpoint(absl::StrFormat("/shared/ckpt/step-%08d", latest));
    c_->Reconcile();
    d = Deployment();
  };
  damaged(40, 30);
  // The deployment from step 30 trains a step: the count starts again.
  fake_.SetState(d, v1::Deployment::RUNNING);
  fake_.Only(d).set_steps_completed(31);
  c_->Reconcile();
  EXPECT_EQ(Job().status().damaged_in_a_row(), 0);
  damaged(30, 20);
  damaged(20, 10);
  EXPECT_EQ(Job().status().damaged_in_a_row(), 2);
  EXPECT_EQ(State(), v1::JobStatus::RECOVERING);
  damaged(10, -1);
  EXPECT_EQ(State(), v1::JobStatus::FAILED);
  EXPECT_THAT(Job().status().message(),
              AllOf(HasSubstr("step-00000010 is reported damaged too"),
                    HasSubstr("2 set aside in a row"), HasSubstr("do not see /shared/ckpt")));
  EXPECT_THAT(fake_.set_aside,
              ElementsAre("/shared/ckpt/step-00000040", "/shared/ckpt/step-00000030",
                          "/shared/ckpt/step-00000020"));
}

// A job asking for 3 pipeline stages that loses one of its 3 devices is
// re-planned with 2 stages (one per device left), not refused.
TEST_F(JobsTest, APipelineJobOnFewerDevicesThanStagesGetsOneStagePerDevice) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
  r.mutable_spec()->mutable_options()->set_pipeline_stages(3);
  const std::string first = StartRunning(r);
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].options().pipeline_stages(), 3);
  fake_.checkpoint = 10;
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).set_error("rank 2 (d2) did not answer 3 status polls in a row");
  fake_.SetNode(2, v1::Node::STALE);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1"));
  EXPECT_EQ(fake_.requests[1].options().pipeline(), v1::PlanOptions::PIPELINE_STAGES);
  EXPECT_EQ(fake_.requests[1].options().pipeline_stages(), 2);
  EXPECT_EQ(Job().status().state(), v1::JobStatus::RECOVERING);
}

// A spec that leaves the global batch to the model (0) keeps the one its
// first plan chose, saved with the job, across re-plans on fewer devices
// (and a restart).
TEST_F(JobsTest, TheFirstPlansGlobalBatchIsKeptWhenTheSpecLeavesItZero) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->set_global_batch(0);
  const std::string first = StartRunning(r);
  EXPECT_EQ(fake_.requests[0].global_batch(), 0);
  EXPECT_EQ(fake_.plans.at("plans/train-p1").global_batch(), 96);  // 3 devices
  EXPECT_EQ(Job().spec().global_batch(), 96);
  EXPECT_EQ(sink_.jobs.at("jobs/train").spec().global_batch(), 96);  // saved
  c_.reset();
  Make(sink_.Saved());
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(2);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1"));
  EXPECT_EQ(fake_.requests[1].global_batch(), 96);
}

TEST_F(JobsTest, TheDeviceOfAFailedRankIsHeldOutWhileItsNodeStaysReady) {
  Make();
  const std::string first = StartRunning();
  // Rank 1's executor died; its node's agent still heartbeats.
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(1);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d2"));
  ASSERT_EQ(Job().status().held_size(), 1);
  EXPECT_EQ(Job().status().held(0).device(), "d1");
  fake_.SetState(Deployment(), v1::Deployment::RUNNING);
  Measured(Deployment(), 0.5);  // trained enough to judge a join against
  c_->Reconcile();
  now_ += absl::Seconds(29);
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 2u);  // still held
  now_ += absl::Seconds(2);
  c_->Reconcile();  // the hold ends: d1 may join again (judged like any join)
  ASSERT_EQ(fake_.requests.size(), 3u);
  EXPECT_THAT(fake_.requests[2].devices(), ElementsAre("d0", "d1", "d2"));
  EXPECT_EQ(Job().status().held_size(), 0);
}

// A job left with too few devices because the devices of the ranks that
// failed its deployment are held out says so, and until when: it said
// "waiting for devices: 1 usable, the job needs 2" of a cluster whose
// three nodes were all READY.
TEST_F(JobsTest, AJobWaitingOnDevicesItHoldsOutSaysSo) {
  Make();
  const std::string first = StartRunning();
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(1);
  fake_.Only(first).add_failed_ranks(2);
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(State(), v1::JobStatus::RECOVERING);
  EXPECT_THAT(Job().status().message(),
              AllOf(HasSubstr("waiting for devices: 1 usable, the job needs 2"),
                    HasSubstr("2 held out"), HasSubstr("d1"), HasSubstr("d2")));
  now_ += absl::Seconds(31);  // join_stable: the hold ends
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1", "d2"));
}

TEST_F(JobsTest, StaleNodeStopsTheSurvivorsBeforeReplanning) {
  Make();
  const std::string first = StartRunning();
  fake_.stops_take_effect = false;
  fake_.SetNode(1, v1::Node::STALE);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::RECOVERING);
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_STALE));
  // No plan while the old deployment still trains; asked again each pass.
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.stops.size(), 2u);
  // It stops (or fails while stopping): the same recovery, no second re-plan.
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_STALE));
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d2"));
  EXPECT_EQ(fake_.Only(Deployment()).training().resume(), "");  // no checkpoint yet
}

// The recovery is saved before the deployment is stopped: a pass that cannot
// save it stops nothing (the job, as stored, still trains on it), and the
// next pass recovers from the STALE node, not from a deployment "stopped
// outside the job" by the pass before.
TEST_F(JobsTest, ARecoveryTheSinkRefusesStopsNothing) {
  Make();
  const std::string first = StartRunning();
  fake_.SetNode(1, v1::Node::STALE);
  sink_.refuse = true;
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(fake_.Only(first).state(), v1::Deployment::RUNNING);
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
  EXPECT_THAT(Job().status().message(), HasSubstr("could not save this job: disk full"));
  EXPECT_THAT(replans_, IsEmpty());
  sink_.refuse = false;
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_STALE));
  EXPECT_EQ(sink_.jobs.at("jobs/train").status().pending().reason(), v1::JobEvent::NODE_STALE);
  EXPECT_EQ(sink_.jobs.at("jobs/train").status().replans(), 1);
}

TEST_F(JobsTest, SecondFailureWhileRecoveringStartsTheRecoveryAgain) {
  Make();
  fake_.AddNode();  // d3: a plan needs 2 devices, 2 are left at the end
  const std::string first = StartRunning();
  fake_.plans_finish_at_once = false;
  const absl::Time failed = now_;
  fake_.SetNode(3, v1::Node::STALE);
  c_->Reconcile();  // stops the survivors
  c_->Reconcile();  // sees them stopped; plans on d0, d1, d2
  ASSERT_EQ(fake_.requests.size(), 2u);
  const std::string plan2 = "plans/train-p2";
  EXPECT_EQ(Job().status().next_plan(), plan2);
  // d2 goes too while that plan is made.
  fake_.SetNode(2, v1::Node::STALE);
  now_ += absl::Seconds(1);
  fake_.FinishPlan(plan2);
  c_->Reconcile();
  EXPECT_EQ(fake_.deployed.size(), 1u);  // plan2 is not deployed
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_STALE, v1::JobEvent::NODE_STALE));
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  EXPECT_THAT(fake_.requests[2].devices(), ElementsAre("d0", "d1"));
  fake_.FinishPlan("plans/train-p3");
  c_->Reconcile();
  const std::string third = Deployment();
  ASSERT_EQ(fake_.deployed.size(), 2u);
  // Its deployment fails before it runs: recovery again, on d0 and d1.
  fake_.SetState(third, v1::Deployment::FAILED);
  c_->Reconcile();
  EXPECT_EQ(replans_.size(), 3u);
  ASSERT_EQ(fake_.requests.size(), 4u);
  fake_.FinishPlan("plans/train-p4");
  c_->Reconcile();
  const std::string fourth = Deployment();
  ASSERT_NE(fourth, third);
  now_ += absl::Seconds(5);
  fake_.SetState(fourth, v1::Deployment::RUNNING);
  c_->Reconcile();
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  ASSERT_EQ(j.status().events_size(), 2);  // one recovery, however many tries
  const v1::JobEvent& e = j.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::NODE_STALE);
  EXPECT_THAT(e.detail(), HasSubstr("while recovering"));
  EXPECT_DOUBLE_EQ(e.downtime_seconds(), absl::ToDoubleSeconds(now_ - failed));
  EXPECT_THAT(e.devices_after(), ElementsAre("d0", "d1"));
  EXPECT_EQ(j.status().replans(), 3);
}

TEST_F(JobsTest, StopWhileRecoveringCancelsThePlanAndStops) {
  Make();
  const std::string first = StartRunning();
  fake_.plans_finish_at_once = false;
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::RECOVERING);
  ASSERT_OK_AND_ASSIGN(v1::Job j, c_->Stop("jobs/train"));
  EXPECT_TRUE(j.status().stop_requested());
  EXPECT_TRUE(sink_.jobs.at("jobs/train").status().stop_requested());
  c_->Reconcile();
  EXPECT_EQ(fake_.plans.at("plans/train-p2").state(), v1::Plan::CANCELLED);
  EXPECT_EQ(State(), v1::JobStatus::STOPPED);
  EXPECT_EQ(fake_.deployed.size(), 1u);
  ASSERT_OK_AND_ASSIGN(j, c_->Stop("jobs/train"));  // final: as it is
  EXPECT_EQ(j.status().state(), v1::JobStatus::STOPPED);
}

TEST_F(JobsTest, DeploymentStoppedOutsideTheJobIsRecovered) {
  Make();
  const std::string first = StartRunning();
  fake_.SetState(first, v1::Deployment::STOPPED);
  c_->Reconcile();
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::DEPLOYMENT_STOPPED));
  EXPECT_EQ(fake_.deployed.size(), 2u);
}

// A recovery's new deployment stopped from outside before it ran is a
// re-plan too: an operator (or a script) stopping it over and over ends the
// job at max_replans rather than redeploying it forever uncounted.
TEST_F(JobsTest, RecoveryDeploymentStoppedOutsideTheJobCountsAsAReplan) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(2);
  const std::string first = StartRunning(r);
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();  // recovering: a new deployment, PENDING
  ASSERT_EQ(fake_.deployed.size(), 2u);
  for (int i = 0; i < 3 && State() != v1::JobStatus::FAILED; ++i) {
    fake_.SetState(fake_.deployed.back(), v1::Deployment::STOPPED);
    c_->Reconcile();
  }
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::FAILED) << j.status().message();
  EXPECT_THAT(j.status().message(), HasSubstr("gave up after 2 re-plans"));
  EXPECT_THAT(j.status().message(), HasSubstr("was stopped outside the job"));
  EXPECT_EQ(fake_.deployed.size(), 3u);
}

TEST_F(JobsTest, GivesUpAfterMaxReplans) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(2);
  StartRunning(r);
  for (int i = 0; i < 3; ++i) {
    fake_.SetState(Deployment(), v1::Deployment::FAILED);
    fake_.Only(Deployment()).set_error("loss is NaN at step 3");
    c_->Reconcile();
  }
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::FAILED);
  EXPECT_THAT(j.status().message(), HasSubstr("gave up after 2 re-plans"));
  EXPECT_THAT(j.status().message(), HasSubstr("NaN"));
  EXPECT_EQ(fake_.deployed.size(), 3u);
  // The FAILED deployments were stopped by their supervisors: the pass that
  // gives up does not ask again (a stop of a FAILED deployment waits on its
  // ranks, lost ones up to the stop timeout, holding up every job's pass).
  EXPECT_THAT(fake_.stops, IsEmpty());
}

// A job that gives up on a deployment still training stops it once FAILED
// is saved: a pass that cannot save it stops nothing (the job as stored
// still trains on it), the next gives up and stops it.
TEST_F(JobsTest, GivingUpTheSinkRefusesStopsNothing) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(1);
  StartRunning(r);
  fake_.SetState(Deployment(), v1::Deployment::FAILED);
  c_->Reconcile();
  const std::string second = Deployment();
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  ASSERT_EQ(State(), v1::JobStatus::RUNNING);
  fake_.SetNode(1, v1::Node::STALE);
  sink_.refuse = true;
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
  sink_.refuse = false;
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::FAILED);
  EXPECT_EQ(sink_.jobs.at("jobs/train").status().state(), v1::JobStatus::FAILED);
  EXPECT_THAT(fake_.stops, ElementsAre(second));
}

// A deployment that disappeared (deleted from the planner's store) counts as
// lost; past max_replans the job fails saying so, without trying to stop it.
TEST_F(JobsTest, GivesUpWhenItsDeploymentNoLongerExists) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(1);
  StartRunning(r);
  for (int i = 0; i < 2; ++i) {
    fake_.deployments.erase(Deployment());
    c_->Reconcile();
  }
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::FAILED);
  EXPECT_THAT(j.status().message(), HasSubstr("gave up after 1 re-plans"));
  EXPECT_THAT(j.status().message(), HasSubstr("no longer exists"));
  EXPECT_THAT(j.status().message(), Not(HasSubstr("stopping")));
  EXPECT_THAT(fake_.stops, IsEmpty());
}

// max_replans 0 (set: the field is optional) is none at all: the first
// lost rank fails the job, its deployment stopped. Unset is the default, 20
// (a 0 used to mean that too, so no job could ask for none).
TEST_F(JobsTest, MaxReplansZeroFailsTheJobAtTheFirstLoss) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(0);
  const std::string first = StartRunning(r);
  fake_.SetNode(1, v1::Node::STALE);
  c_->Reconcile();
  const v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::FAILED) << j.DebugString();
  EXPECT_THAT(j.status().message(), HasSubstr("gave up after 0 re-plans (max_replans 0)"));
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  EXPECT_EQ(fake_.deployed.size(), 1u);
  EXPECT_FALSE(Request().spec().replan().has_max_replans());  // what the other tests re-plan on
}

// A recovery's deployment that trained to the end between two passes (a
// pass saw it PENDING, the next SUCCEEDED): the recovery is still an event,
// with its downtime up to that pass. The job finished with the recovery
// pending, which Finish dropped: no event, nothing to on_resumed, replans 1.
TEST_F(JobsTest, ARecoveryWhoseDeploymentFinishedBetweenPassesIsStillAnEvent) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 90;
  fake_.Only(first).set_steps_completed(95);
  fake_.SetState(first, v1::Deployment::FAILED);
  const absl::Time failed = now_;
  c_->Reconcile();
  const std::string second = Deployment();
  ASSERT_NE(second, first);
  now_ += absl::Seconds(1);
  fake_.Only(second).set_steps_completed(100);
  fake_.SetState(second, v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  const v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::SUCCEEDED);
  EXPECT_EQ(j.status().replans(), 1);
  ASSERT_EQ(j.status().events_size(), 2) << j.DebugString();
  const v1::JobEvent& e = j.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_EQ(e.deployment(), second);
  EXPECT_EQ(e.resume_step(), 90);
  EXPECT_EQ(e.steps_lost(), 5);
  EXPECT_DOUBLE_EQ(e.downtime_seconds(), absl::ToDoubleSeconds(now_ - failed));
  ASSERT_EQ(resumed_.size(), 2u);
  EXPECT_EQ(resumed_[1].reason(), v1::JobEvent::EXECUTOR_LOST);
}

// A recovery's deployment that trained, then failed, between two passes:
// the recovery ended (it trained) and the failure is a loss of its own,
// not a failure "while recovering" of the first.
TEST_F(JobsTest, ARecoveryWhoseDeploymentTrainedThenFailedBetweenPassesIsTwoEvents) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 40;
  fake_.Only(first).set_steps_completed(45);
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();
  const std::string second = Deployment();
  ASSERT_NE(second, first);
  now_ += absl::Seconds(1);
  fake_.checkpoint = 60;
  v1::Deployment& d = fake_.Only(second);
  d.set_steps_completed(67);
  d.set_state(v1::Deployment::FAILED);
  d.set_error("rank 1 (d1) did not answer 3 status polls in a row");
  c_->Reconcile();
  const std::string third = Deployment();
  ASSERT_NE(third, second);
  fake_.SetState(third, v1::Deployment::RUNNING);
  c_->Reconcile();
  const v1::Job j = Job();
  EXPECT_EQ(j.status().replans(), 2);
  ASSERT_EQ(j.status().events_size(), 3) << j.DebugString();
  EXPECT_EQ(j.status().events(1).deployment(), second);
  EXPECT_THAT(j.status().events(1).detail(), Not(HasSubstr("while recovering")));
  const v1::JobEvent& e = j.status().events(2);
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_THAT(e.detail(), HasSubstr("rank 1 (d1) did not answer"));
  EXPECT_EQ(e.steps_done_before(), 67);
  EXPECT_EQ(e.resume_step(), 60);
  EXPECT_EQ(e.steps_lost(), 7);
}

// The planner restarted while a recovery's deployment was pushed: the
// restarted deployment manager fails it (kPlannerRestartedBeforeTraining,
// no rank to blame). That is no loss: the same plan is deployed again,
// uncounted. It was counted as a re-plan, so a restart of the planner
// failed a job at its max_replans.
TEST_F(JobsTest, APlannerRestartDuringARecoveryIsNotAReplan) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(1);
  const std::string first = StartRunning(r);
  fake_.checkpoint = 40;
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(2);
  c_->Reconcile();
  const std::string second = Deployment();
  ASSERT_NE(second, first);
  ASSERT_EQ(Job().status().replans(), 1);
  // The planner restarts: the job as saved, its deployment failed by the
  // new deployment manager.
  c_.reset();
  Make(sink_.Saved());
  v1::Deployment& d = fake_.Only(second);
  d.set_state(v1::Deployment::FAILED);
  d.set_error(kPlannerRestartedBeforeTraining);
  now_ += absl::Seconds(3);
  c_->Reconcile();
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RECOVERING) << j.status().message();
  EXPECT_EQ(j.status().replans(), 1);
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::EXECUTOR_LOST));
  EXPECT_EQ(fake_.requests.size(), 2u);  // no new plan
  const std::string third = Deployment();
  ASSERT_NE(third, second);
  EXPECT_EQ(fake_.Only(third).plan(), fake_.Only(second).plan());
  EXPECT_EQ(fake_.Only(third).training().resume(), CheckpointStepDir(kDir, 40));
  fake_.SetState(third, v1::Deployment::RUNNING);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  ASSERT_EQ(j.status().events_size(), 2);
  const v1::JobEvent& e = j.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_EQ(e.deployment(), third);
  EXPECT_THAT(e.detail(), Not(HasSubstr("while recovering")));
  // A rank truly lost on the redeploy is a loss as before.
  fake_.SetState(third, v1::Deployment::FAILED);
  fake_.Only(third).set_error(kPlannerRestartedBeforeTraining);
  fake_.Only(third).add_failed_ranks(1);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::FAILED);
  EXPECT_THAT(Job().status().message(), HasSubstr("gave up after 1 re-plans"));
}

// With max_replans 0 a planner restarted during the first deploy failed
// the job; it deploys its first plan again.
class JobsPlannerRestartTest : public JobsTest {
 protected:
  // A job with max_replans 0 whose first deployment `fail` makes FAILED
  // as a restarted planner did: its first plan is deployed again, and runs,
  // with no re-plan counted.
  void ExpectTheFirstPlanDeployedAgain(const std::function<void(v1::Deployment&)>& fail) {
    Make();
    v1::CreateJobRequest r = Request();
    r.mutable_spec()->mutable_replan()->set_max_replans(0);
    ASSERT_OK(c_->Create(r).status());
    c_->Reconcile();
    const std::string first = Deployment();
    ASSERT_FALSE(first.empty());
    fake_.SetState(first, v1::Deployment::FAILED);
    fail(fake_.Only(first));
    c_->Reconcile();
    const std::string again = Deployment();
    ASSERT_NE(again, first);
    EXPECT_EQ(fake_.Only(again).plan(), "plans/train-p1");
    fake_.SetState(again, v1::Deployment::RUNNING);
    c_->Reconcile();
    const v1::Job j = Job();
    EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING) << j.status().message();
    EXPECT_EQ(j.status().replans(), 0);
    ASSERT_EQ(j.status().events_size(), 1);
    EXPECT_EQ(j.status().events(0).reason(), v1::JobEvent::STARTED);
    EXPECT_EQ(j.status().events(0).deployment(), again);
    EXPECT_THAT(replans_, IsEmpty());
  }
};

TEST_F(JobsPlannerRestartTest, APlannerRestartDuringTheFirstDeployDoesNotFailAJobWithNoReplans) {
  // The failure_cause decides, whatever the error says.
  ExpectTheFirstPlanDeployedAgain([](v1::Deployment& d) {
    d.set_failure_cause(v1::Deployment::PLANNER_RESTARTED_BEFORE_TRAINING);
    d.set_error("the planner restarted");
  });
}

// A deployment a planner older than Deployment.failure_cause failed on its
// restart, as that planner stored it: only its error says so; still no
// loss.
TEST_F(JobsPlannerRestartTest, AnOlderPlannersRestartFailureIsRecognisedByItsError) {
  ExpectTheFirstPlanDeployedAgain(
      [](v1::Deployment& d) { d.set_error(kPlannerRestartedBeforeTraining); });
}

TEST_F(JobsTest, EveryStepCheckpointedBeforeTheFailureIsSuccess) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 100;
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::SUCCEEDED);
  EXPECT_EQ(fake_.deployed.size(), 1u);
}

}  // namespace
}  // namespace hap::service::jobs_testing
