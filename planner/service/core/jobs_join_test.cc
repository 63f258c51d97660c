// The job controller when devices join or return: the switch at the next
// checkpoint when the calibrated gain clears the threshold, and when not.
#include "planner/service/core/jobs.h"
#include "planner/service/core/jobs_test_util.h"

namespace hap::service::jobs_testing {
// Running on d0 and d1, d2 returns and the plan on all three, predicted at
// *three s (0.95 s against 1.0 s), is judged not worth it.
void JobsTest::JudgeThreeNotWorthIt(const double* three,
                                    const std::function<void(const std::string&)>& running,
                                    const v1::CreateJobRequest& request) {
  Make();
  fake_.predict = [three](const std::vector<std::string>& d) {
    return d.size() == 3 ? *three : 1.0;
  };
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning(request);
  Measured(first, 1.0);  // as predicted: the predicted gain decides
  if (running) running(first);
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
}

std::string JobsTest::SwitchPending() {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  Measured(first, 0.5);
  fake_.checkpoint = 20;
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 2u);
  c_->Reconcile();  // the join pays: waits for a checkpoint
  EXPECT_TRUE(Job().status().switch_pending());
  return first;
}

namespace {

TEST_F(JobsTest, ReturningNodeSwitchesAtTheNextCheckpointWhenTheGainClearsTheThreshold) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  EXPECT_THAT(Job().status().devices(), ElementsAre("d0", "d1"));
  Measured(first, 0.5);  // as predicted
  fake_.checkpoint = 20;
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(29);
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 1u);  // not READY for 30 s yet
  now_ += absl::Seconds(2);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1", "d2"));
  c_->Reconcile();  // 0.5 s -> 0.333 s: 50% >= 10%; waits for a checkpoint
  v1::Job j = Job();
  EXPECT_TRUE(j.status().switch_pending());
  EXPECT_THAT(j.status().message(), HasSubstr("at the next checkpoint"));
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
  fake_.checkpoint = 30;
  fake_.Only(first).set_steps_completed(31);
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_JOINED));
  c_->Reconcile();
  const std::string second = Deployment();
  ASSERT_NE(second, first);
  EXPECT_EQ(Job().status().plan(), "plans/train-p2");  // the plan judged, not another
  EXPECT_EQ(fake_.requests.size(), 2u);
  EXPECT_EQ(fake_.Only(second).training().resume(), "/shared/ckpt/step-00000030");
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  const v1::JobEvent& e = j.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::NODE_JOINED);
  EXPECT_EQ(e.steps_lost(), 1);
  EXPECT_DOUBLE_EQ(e.predicted_step_before(), 0.5);
  EXPECT_DOUBLE_EQ(e.predicted_step_after(), 1.0 / 3);
}

// The switch is saved before the deployment is stopped: a pass that cannot
// save it stops nothing, and the next makes the switch it judged (not a
// recovery from a deployment "stopped outside the job", re-planned anew).
TEST_F(JobsTest, ASwitchTheSinkRefusesStopsNothing) {
  const std::string first = SwitchPending();
  fake_.checkpoint = 30;
  fake_.Only(first).set_steps_completed(31);
  sink_.refuse = true;
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(fake_.Only(first).state(), v1::Deployment::RUNNING);
  EXPECT_THAT(replans_, IsEmpty());
  sink_.refuse = false;
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_JOINED));
  c_->Reconcile();
  EXPECT_EQ(Job().status().plan(), "plans/train-p2");  // the plan judged
  EXPECT_EQ(fake_.requests.size(), 2u);
}

// A node of the plan a join switches to goes STALE before that plan is
// deployed: the job plans again without it, and the loss is an event of
// its own (NODE_STALE) after the join's, not a line in its detail.
TEST_F(JobsTest, ANodeLostBeforeAJoinsPlanIsDeployedIsAnEventOfItsOwn) {
  const std::string first = SwitchPending();
  fake_.checkpoint = 30;
  fake_.Only(first).set_steps_completed(31);
  c_->Reconcile();  // the switch saved, the first deployment stopped
  ASSERT_EQ(Job().status().next_plan(), "plans/train-p2");
  fake_.SetNode(2, v1::Node::STALE);
  now_ += absl::Seconds(2);
  c_->Reconcile();  // p2 is on d2: not deployed, planned again
  EXPECT_EQ(fake_.deployed.size(), 1u);
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_JOINED, v1::JobEvent::NODE_STALE));
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  EXPECT_THAT(fake_.requests[2].devices(), ElementsAre("d0", "d1"));
  const std::string second = Deployment();
  ASSERT_NE(second, first);
  now_ += absl::Seconds(1);
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  const v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  EXPECT_EQ(j.status().replans(), 2);
  ASSERT_EQ(j.status().events_size(), 3) << j.DebugString();
  const v1::JobEvent& join = j.status().events(1);
  EXPECT_EQ(join.reason(), v1::JobEvent::NODE_JOINED);
  EXPECT_FALSE(join.has_resume_time());
  EXPECT_DOUBLE_EQ(join.downtime_seconds(), 2);
  EXPECT_TRUE(join.deployment().empty());  // never deployed
  EXPECT_THAT(join.detail(), HasSubstr("cut short by a loss"));
  const v1::JobEvent& loss = j.status().events(2);
  EXPECT_EQ(loss.reason(), v1::JobEvent::NODE_STALE);
  EXPECT_THAT(loss.detail(), HasSubstr("the node of d2 went STALE before plans/train-p2"));
  EXPECT_DOUBLE_EQ(loss.downtime_seconds(), 1);
  EXPECT_THAT(loss.devices_after(), ElementsAre("d0", "d1"));
  EXPECT_EQ(loss.deployment(), second);
}

// A switch's deployment the job did not record (the save after the deploy
// refused, or the planner died before it) while the job still records the
// deployment it switched from, STOPPED: StopJob adopted an unrecorded
// deployment only when the job recorded none, so the job ended STOPPED with
// the new deployment still training.
TEST_F(JobsTest, StopAfterAnUnrecordedSwitchDeployStopsThatDeploymentToo) {
  const std::string first = SwitchPending();
  fake_.checkpoint = 30;
  fake_.Only(first).set_steps_completed(31);
  c_->Reconcile();  // the switch saved, the first deployment stopped
  ASSERT_EQ(fake_.Only(first).state(), v1::Deployment::STOPPED);
  ASSERT_EQ(Job().status().next_plan(), "plans/train-p2");
  sink_.refuse = true;  // the disk fills up just as the job deploys p2
  c_->Reconcile();
  ASSERT_EQ(fake_.deployed.size(), 2u);
  const std::string unrecorded = fake_.deployed[1];
  ASSERT_EQ(Deployment(), first);  // as saved
  fake_.SetState(unrecorded, v1::Deployment::RUNNING);
  sink_.refuse = false;
  ASSERT_OK(c_->Stop("jobs/train").status());
  for (int i = 0; i < 3 && State() != v1::JobStatus::STOPPED; ++i) c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::STOPPED);
  EXPECT_EQ(fake_.Only(unrecorded).state(), v1::Deployment::STOPPED)
      << "StopJob left " << unrecorded << " "
      << v1::Deployment::State_Name(fake_.Only(unrecorded).state());
}

// A switch waiting for the next checkpoint is not made when that
// checkpoint is the job's last step: nothing is left to run faster.
TEST_F(JobsTest, NoSwitchAtTheJobsFinalCheckpoint) {
  const std::string first = SwitchPending();
  fake_.checkpoint = 100;  // the job's steps
  fake_.Only(first).set_steps_completed(100);
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_THAT(replans_, IsEmpty());
  fake_.SetState(first, v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::SUCCEEDED);
  EXPECT_THAT(replans_, IsEmpty());
}

TEST_F(JobsTest, JoinBelowTheThresholdStaysAndIsNotJudgedAgain) {
  double three = 0.95;
  JudgeThreeNotWorthIt(&three);  // two plans made: the first and the one judged
  v1::Job j = Job();
  EXPECT_THAT(j.status().message(), HasSubstr("below min_gain 10.0%"));
  EXPECT_THAT(j.status().judged_devices(), ElementsAre("d0", "d1", "d2"));
  for (int i = 0; i < 5; ++i) {
    now_ += absl::Seconds(10);
    c_->Reconcile();
  }
  EXPECT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
}

// min_gain 0 (set: the field is optional) switches to any plan predicted
// faster, and stays on one no faster (a restart for nothing). Unset is the
// default, 10%; a 0 used to mean that too, so no job could ask for any gain.
TEST_F(JobsTest, MinGainZeroSwitchesToAnyPlanPredictedFaster) {
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_min_gain(0);
  double three = 0.95;  // 5% faster: below the default 10%
  JudgeThreeNotWorthIt(&three, {}, r);
  const v1::Job j = Job();
  EXPECT_TRUE(j.status().switch_pending()) << j.status().message();
  EXPECT_THAT(j.status().message(), Not(HasSubstr("staying")));
  EXPECT_FALSE(Request().spec().replan().has_min_gain());  // what the other tests judge by
}

TEST_F(JobsTest, MinGainZeroStaysOnAPlanNoFaster) {
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_min_gain(0);
  double three = 1.0;
  JudgeThreeNotWorthIt(&three, {}, r);
  const v1::Job j = Job();
  EXPECT_FALSE(j.status().switch_pending());
  EXPECT_THAT(j.status().message(), HasSubstr(", no faster"));
  EXPECT_THAT(j.status().judged_devices(), ElementsAre("d0", "d1", "d2"));
}

// A set judged not worth it whose device then leaves (STALE) and comes
// back is judged again: the node returning was measured anew.
TEST_F(JobsTest, ASetJudgedIsJudgedAgainOnceADeviceOfItLeftAndReturned) {
  double three = 0.95;
  JudgeThreeNotWorthIt(&three);
  EXPECT_THAT(Job().status().judged_devices(), ElementsAre("d0", "d1", "d2"));
  fake_.SetNode(2, v1::Node::STALE);  // gone ...
  c_->Reconcile();
  EXPECT_THAT(Job().status().judged_devices(), IsEmpty());
  three = 0.5;  // ... and back, measured faster
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  EXPECT_THAT(fake_.requests[2].devices(), ElementsAre("d0", "d1", "d2"));
  c_->Reconcile();
  EXPECT_TRUE(Job().status().switch_pending()) << Job().DebugString();
}

// A node whose agent restarts and registers again before it is ever seen
// STALE (another address) counts as new: READY for join_stable again, and
// a set judged with it judged anew.
TEST_F(JobsTest, ANodeRegisteredAgainIsStableOnlyAfterJoinStableAndJudgedAnew) {
  double three = 0.95;
  JudgeThreeNotWorthIt(&three);
  three = 0.5;
  fake_.Reregister(2);
  c_->Reconcile();
  EXPECT_THAT(Job().status().judged_devices(), IsEmpty());
  now_ += absl::Seconds(29);
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 2u);  // READY under its new agent for 29 s only
  now_ += absl::Seconds(2);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  c_->Reconcile();
  EXPECT_TRUE(Job().status().switch_pending()) << Job().DebugString();
}

// A switch pending on a plan whose joiner's node is registered again by a
// new agent is dropped: that plan was judged on the old one.
TEST_F(JobsTest, ASwitchPendingIsDroppedWhenAJoinerRegistersAgain) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  Measured(first, 0.5);
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  ASSERT_TRUE(Job().status().switch_pending());
  fake_.Reregister(2);
  fake_.checkpoint = 30;
  c_->Reconcile();
  EXPECT_FALSE(Job().status().switch_pending());
  EXPECT_TRUE(Job().status().candidate_plan().empty());
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(Deployment(), first);
}

// A join is judged by measured steps where the job has them: the model
// predicts three devices only 5% faster than two (below min_gain), but the
// job measured its three-device deployment at 0.5 s (predicted 0.95 s) and
// measures 1.2 s on two (predicted 1.0 s): calibrated, three are 140%
// faster, and the job switches back.
TEST_F(JobsTest, AReturnIsJudgedByTheStepsMeasuredOnThoseDevices) {
  Make();
  fake_.predict = [](const std::vector<std::string>& d) { return d.size() == 3 ? 0.95 : 1.0; };
  const std::string first = StartRunning();
  fake_.Only(first).set_median_step_seconds(0.5);
  fake_.Only(first).set_steps_completed(30);
  c_->Reconcile();
  EXPECT_DOUBLE_EQ(Job().status().events(0).measured_step_seconds(), 0.5);
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(2);
  c_->Reconcile();
  const std::string second = Deployment();
  fake_.SetState(second, v1::Deployment::RUNNING);
  fake_.Only(second).set_median_step_seconds(1.2);
  fake_.Only(second).set_steps_completed(10);  // too few to judge by
  c_->Reconcile();
  EXPECT_THAT(Job().status().devices(), ElementsAre("d0", "d1"));
  now_ += absl::Seconds(31);  // the hold on d2 ends; d2 is stable
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 2u);  // not judged on 10 steps
  fake_.Only(second).set_steps_completed(40);
  c_->Reconcile();
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  const v1::Job j = Job();
  EXPECT_TRUE(j.status().switch_pending()) << j.DebugString();
  EXPECT_THAT(j.status().message(), HasSubstr("expected 140.0% faster"));
  EXPECT_THAT(j.status().message(), HasSubstr("on the same devices"));
  EXPECT_DOUBLE_EQ(j.status().events(1).measured_step_seconds(), 1.2);
  EXPECT_DOUBLE_EQ(j.status().events(0).measured_step_seconds(), 0.5);  // kept
}

// Without measurements of the set judged, the current deployment's error
// scales both sides alike: the predicted gain decides.
TEST_F(JobsTest, ANewSetIsJudgedByThePredictionScaledByTheCurrentError) {
  const double three = 0.95;
  JudgeThreeNotWorthIt(&three, [this](const std::string& first) {
    fake_.Only(first).set_median_step_seconds(3.0);
    fake_.Only(first).set_steps_completed(25);
  });
  const v1::Job j = Job();
  EXPECT_FALSE(j.status().switch_pending());
  EXPECT_THAT(j.status().message(), HasSubstr("expected 5.3% faster"));
  EXPECT_THAT(j.status().message(), HasSubstr("below min_gain"));
}

TEST_F(JobsTest, AJoinNeedsPeriodicCheckpoints) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_training()->set_checkpoint_every(0);
  Measured(StartRunning(r), 0.5);
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_THAT(Job().status().message(), HasSubstr("no periodic checkpoints"));
  EXPECT_THAT(fake_.stops, IsEmpty());
}

// README "Join": no join is judged before the current deployment has
// trained 20 steps as measured; one that has reported no median step yet is
// not judged on the prediction alone (too few steps:
// AReturnIsJudgedByTheStepsMeasuredOnThoseDevices).
TEST_F(JobsTest, AJoinWaitsForTheCurrentDeploymentsMeasuredSteps) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);  // d2 stable: a join could be judged
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 1u);       // nothing measured yet
  fake_.Only(first).set_steps_completed(25);  // steps, but no median reported
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 1u);
  EXPECT_FALSE(Job().status().switch_pending());
  Measured(first, 0.5, 25);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1", "d2"));
  c_->Reconcile();
  EXPECT_TRUE(Job().status().switch_pending()) << Job().DebugString();
  EXPECT_THAT(Job().status().message(), HasSubstr("measured 0.5000 s now"));
}

TEST_F(JobsTest, FlappingNodeNeverCausesAJoin) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  for (int i = 0; i < 24; ++i) {  // two minutes, READY 20 s then STALE 10 s
    fake_.SetNode(2, i % 3 == 2 ? v1::Node::STALE : v1::Node::READY);
    now_ += absl::Seconds(10);
    c_->Reconcile();
  }
  EXPECT_EQ(fake_.requests.size(), 1u);
  EXPECT_THAT(fake_.stops, IsEmpty());
  EXPECT_EQ(Deployment(), first);
  EXPECT_THAT(replans_, IsEmpty());
}

}  // namespace
}  // namespace hap::service::jobs_testing
