// The job controller: its resource API (create, get, list, watch, stop), a job
// planned, deployed and done, restarts, saves and the checkpoint scan.
#include "planner/service/core/jobs.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "planner/service/core/jobs_test_util.h"
#include "planner/service/core/pagination.h"
#include "planner/service/core/profile_checks.h"

namespace hap::service::jobs_testing {
namespace {

namespace fs = std::filesystem;

TEST_F(JobsTest, PlansOnEveryUsableDeviceDeploysAndSucceeds) {
  Make();
  v1::CreateJobRequest request = Request();
  (*request.mutable_spec()->mutable_executors())["d1"] = "127.0.0.1:7001";
  ASSERT_OK_AND_ASSIGN(v1::Job j, c_->Create(request));
  EXPECT_EQ(j.name(), "jobs/train");
  EXPECT_EQ(j.status().state(), v1::JobStatus::PENDING);
  EXPECT_EQ(sink_.jobs.at("jobs/train").status().state(), v1::JobStatus::PENDING);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].plan_id(), "train-p1");
  EXPECT_THAT(fake_.requests[0].devices(), ElementsAre("d0", "d1", "d2"));
  EXPECT_EQ(fake_.requests[0].global_batch(), 32);
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::PLANNING);
  EXPECT_EQ(j.status().plan(), "plans/train-p1");
  EXPECT_EQ(j.status().generation(), 1);
  const v1::Deployment& d = fake_.Only(j.status().deployment());
  EXPECT_EQ(fake_.deployed_executors.at("d1"), "127.0.0.1:7001");  // from the spec
  EXPECT_EQ(d.training().checkpoint_dir(), kDir);
  EXPECT_EQ(d.training().resume(), "");  // nothing to resume from yet
  EXPECT_EQ(d.training().steps(), 100);

  c_->Reconcile();  // still PENDING: no second deployment
  EXPECT_EQ(fake_.deployed.size(), 1u);
  fake_.SetState(d.name(), v1::Deployment::RUNNING);
  now_ += absl::Seconds(3);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  ASSERT_EQ(j.status().events_size(), 1);
  EXPECT_EQ(j.status().events(0).reason(), v1::JobEvent::STARTED);
  EXPECT_DOUBLE_EQ(j.status().events(0).downtime_seconds(), 3);
  EXPECT_DOUBLE_EQ(j.status().predicted_step_seconds(), 1.0 / 3);
  EXPECT_THAT(replans_, IsEmpty());  // a start is not a re-plan

  fake_.Only(d.name()).set_steps_completed(60);
  c_->Reconcile();
  EXPECT_EQ(Job().status().steps_done(), 60);
  // Deployment retention keeps a running job's deployment, and not a
  // finished job's.
  EXPECT_THAT(c_->UnfinishedJobsDeployments(), ElementsAre(d.name()));
  fake_.SetState(d.name(), v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  EXPECT_THAT(c_->UnfinishedJobsDeployments(), IsEmpty());
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::SUCCEEDED);
  EXPECT_EQ(j.status().steps_done(), 100);
  EXPECT_EQ(sink_.jobs.at("jobs/train").status().state(), v1::JobStatus::SUCCEEDED);
  c_->Reconcile();  // final: nothing more
  EXPECT_EQ(fake_.requests.size(), 1u);
}

// Finished jobs past --job-retention-count or that ended more than
// --job-retention-seconds ago are deleted, from the store first; an
// unfinished one never is (jobs were kept forever, in the database and in
// memory).
TEST_F(JobsTest, RetentionDeletesFinishedJobsPastTheCountOrAgeAndKeepsUnfinishedOnes) {
  Make();
  // One after another (each takes every device), running, then a and b end.
  auto run = [&](const std::string& id) {
    EXPECT_OK(c_->Create(Request(id)).status());
    c_->Reconcile();
    const std::string d = Job("jobs/" + id).status().deployment();
    fake_.SetState(d, v1::Deployment::RUNNING);
    now_ += absl::Seconds(2);
    c_->Reconcile();
    EXPECT_EQ(Job("jobs/" + id).status().state(), v1::JobStatus::RUNNING);
    return d;
  };
  for (const char* id : {"a", "b"}) {
    fake_.SetState(run(id), v1::Deployment::SUCCEEDED);
    c_->Reconcile();
    ASSERT_EQ(Job(absl::StrCat("jobs/", id)).status().state(), v1::JobStatus::SUCCEEDED);
    now_ += absl::Minutes(10);
  }
  run("c");
  // Nothing past the limits: nothing deleted.
  ASSERT_OK_AND_ASSIGN(int none, c_->EnforceRetention(2, absl::InfinitePast()));
  EXPECT_EQ(none, 0);
  // A store that refuses: an error naming the job, and the job kept.
  sink_.refuse = true;
  EXPECT_THAT(c_->EnforceRetention(1, absl::InfinitePast()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("jobs/a")));
  EXPECT_OK(c_->Get("jobs/a").status());
  sink_.refuse = false;
  // By count: the older finished one goes.
  ASSERT_OK_AND_ASSIGN(int by_count, c_->EnforceRetention(1, absl::InfinitePast()));
  EXPECT_EQ(by_count, 1);
  EXPECT_THAT(c_->Get("jobs/a"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(sink_.jobs.count("jobs/a"), 0u);
  EXPECT_OK(c_->Get("jobs/b").status());
  // By age: b ended 10 minutes ago; c runs and stays.
  ASSERT_OK_AND_ASSIGN(int by_age, c_->EnforceRetention(0, now_ - absl::Minutes(5)));
  EXPECT_EQ(by_age, 1);
  std::vector<std::string> left;
  for (const v1::Job& j : c_->All()) left.push_back(j.name());
  EXPECT_THAT(left, ElementsAre("jobs/c"));
  EXPECT_THAT(sink_.jobs, ::testing::SizeIs(1));
  // A name deleted is free again.
  fake_.SetState(Job("jobs/c").status().deployment(), v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  EXPECT_OK(c_->Create(Request("a")).status());
}

// DeleteJob: a finished job's record goes (from the store first); a job
// not finished is refused, naming its state and how to stop it.
TEST_F(JobsTest, DeleteRemovesAFinishedJobAndRefusesARunningOne) {
  Make();
  const std::string d = StartRunning();
  EXPECT_THAT(c_->Delete("jobs/train"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("'jobs/train' is RUNNING"),
                                        HasSubstr("hapctl stop job train"))));
  EXPECT_THAT(c_->Delete("jobs/none"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("jobs/none")));
  EXPECT_THAT(c_->Delete("train"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  fake_.SetState(d, v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  sink_.refuse = true;
  EXPECT_THAT(c_->Delete("jobs/train"), StatusIs(absl::StatusCode::kResourceExhausted,
                                                 HasSubstr("jobs/train was not deleted")));
  EXPECT_OK(c_->Get("jobs/train").status());
  sink_.refuse = false;
  EXPECT_OK(c_->Delete("jobs/train"));
  EXPECT_THAT(c_->Get("jobs/train"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(sink_.jobs.count("jobs/train"), 0u);
}

TEST_F(JobsTest, WaitsForEnoughDevicesAndHonoursTheSelector) {
  Make();
  fake_.cluster.mutable_nodes(1)->mutable_labels()->insert({"pool", "a"});
  fake_.cluster.mutable_nodes(2)->mutable_labels()->insert({"pool", "a"});
  fake_.SetNode(2, v1::Node::STALE);
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_devices()->set_min_devices(2);
  r.mutable_spec()->mutable_devices()->mutable_node_labels()->insert({"pool", "a"});
  ASSERT_OK(c_->Create(r).status());
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::PENDING);
  EXPECT_THAT(Job().status().message(), HasSubstr("waiting for devices: 1 usable"));
  EXPECT_THAT(fake_.requests, IsEmpty());
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_THAT(fake_.requests[0].devices(), ElementsAre("d1", "d2"));
}

// A plan needs two devices: a job (min_devices unset) with one usable
// device waits for a second one instead of asking for a plan of one.
TEST_F(JobsTest, AJobWithOneUsableDeviceWaitsForASecond) {
  Make();
  fake_.SetNode(1, v1::Node::STALE);
  fake_.SetNode(2, v1::Node::STALE);
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::PENDING);
  EXPECT_THAT(Job().status().message(),
              HasSubstr("waiting for devices: 1 usable, the job needs 2"));
  EXPECT_THAT(fake_.requests, IsEmpty());
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].devices_size(), 2);
}

// A job on a cluster larger than a plan takes (kMaxPlanDevices) plans on
// that many, as with max_devices; it FAILED at its first plan, refused for
// its size.
TEST_F(JobsTest, AJobOnAClusterLargerThanAPlanTakesPlansOnAsManyAsItTakes) {
  while (fake_.cluster.nodes_size() <= kMaxPlanDevices) fake_.AddNode();
  Make();
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].devices_size(), kMaxPlanDevices);
  EXPECT_EQ(fake_.requests[0].devices(0), "d0");
}

// Two jobs whose selectors overlap do not both deploy on one device: the
// first (by name) plans on the devices, the second plans on what is left
// or waits, saying why, and takes the devices once the first has ended.
TEST_F(JobsTest, JobsDoNotPlanOnDevicesAnotherJobHolds) {
  Make();
  v1::CreateJobRequest a = Request("a");
  a.mutable_spec()->mutable_devices()->set_max_devices(2);
  v1::CreateJobRequest b = Request("b");
  b.mutable_spec()->mutable_training()->set_checkpoint_dir("/shared/ckpt-b");
  b.mutable_spec()->mutable_devices()->set_min_devices(2);
  fake_.other_dirs.insert("/shared/ckpt-b");
  ASSERT_OK(c_->Create(a).status());
  ASSERT_OK(c_->Create(b).status());
  c_->Reconcile();
  // a plans on d0, d1 (its max); b needs 2 of what is left: d2 alone.
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_THAT(fake_.requests[0].devices(), ElementsAre("d0", "d1"));
  EXPECT_EQ(Job("jobs/b").status().state(), v1::JobStatus::PENDING);
  EXPECT_THAT(Job("jobs/b").status().message(),
              HasSubstr("waiting for devices: 1 usable, the job needs 2 (2 in use by other jobs)"));
  // a ends: b plans on every device.
  fake_.SetState(Job("jobs/a").status().deployment(), v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  EXPECT_EQ(Job("jobs/a").status().state(), v1::JobStatus::SUCCEEDED);
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1", "d2"));
}

// A deployment made directly (DeployPlan, not a job's) that has not finished
// keeps its devices from jobs too; once it has, they are usable.
TEST_F(JobsTest, JobsDoNotPlanOnDevicesADirectDeploymentTrainsOn) {
  Make();
  v1::Deployment direct;
  direct.set_name("deployments/by-hand");
  direct.set_state(v1::Deployment::RUNNING);
  direct.add_ranks()->set_device("d1");
  fake_.deployments[direct.name()] = direct;
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_THAT(fake_.requests[0].devices(), ElementsAre("d0", "d2"));
  // Stopped: a job made now may use d1 (with d3, of a node that joined).
  fake_.SetState(direct.name(), v1::Deployment::STOPPED);
  fake_.AddNode();
  v1::CreateJobRequest b = Request("b");
  b.mutable_spec()->mutable_training()->set_checkpoint_dir("/shared/ckpt-b");
  b.mutable_spec()->mutable_devices()->add_devices("d1");
  b.mutable_spec()->mutable_devices()->add_devices("d3");
  fake_.other_dirs.insert("/shared/ckpt-b");
  ASSERT_OK(c_->Create(b).status());
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d1", "d3"));
}

// A job that ends while its deployment still trains (FAILED past
// max_replans, its deployment asked to stop, which takes the ranks a while;
// a stored job the planner cannot drive) keeps that deployment's devices
// from other jobs until it has finished: they counted as free, and another
// job deployed onto executors still training.
TEST_F(JobsTest, AFinishedJobsDeploymentStillTrainingKeepsItsDevices) {
  Make();
  v1::CreateJobRequest a = Request();
  a.mutable_spec()->mutable_replan()->set_max_replans(1);
  const std::string first = StartRunning(a);
  fake_.SetState(first, v1::Deployment::FAILED);  // re-plan 1 of 1
  c_->Reconcile();
  const std::string second = Job().status().deployment();
  ASSERT_NE(second, first);
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  ASSERT_EQ(Job().status().state(), v1::JobStatus::RUNNING);
  fake_.stops_take_effect = false;
  fake_.SetNode(2, v1::Node::STALE);  // re-plan 2 of 1: FAILED, the stop asked
  c_->Reconcile();
  ASSERT_EQ(Job().status().state(), v1::JobStatus::FAILED);
  ASSERT_EQ(fake_.Only(second).state(), v1::Deployment::RUNNING);
  fake_.AddNode();
  fake_.AddNode();
  v1::CreateJobRequest b = Request("b");
  b.mutable_spec()->mutable_training()->set_checkpoint_dir("/shared/ckpt-b");
  fake_.other_dirs.insert("/shared/ckpt-b");
  ASSERT_OK(c_->Create(b).status());
  const size_t before = fake_.requests.size();
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), before + 1);
  EXPECT_THAT(fake_.requests.back().devices(), ElementsAre("d3", "d4"));
}

// A job that runs on fewer devices than it may does not grow onto devices a
// second job holds when it judges a join.
TEST_F(JobsTest, AJoinDoesNotTakeAnotherJobsDevices) {
  Make();
  v1::CreateJobRequest b = Request("b");
  b.mutable_spec()->mutable_training()->set_checkpoint_dir("/shared/ckpt-b");
  b.mutable_spec()->mutable_devices()->add_devices("d2");
  b.mutable_spec()->mutable_devices()->add_devices("d3");
  fake_.other_dirs.insert("/shared/ckpt-b");
  fake_.AddNode();
  fake_.SetNode(2, v1::Node::STALE);
  fake_.SetNode(3, v1::Node::STALE);
  const std::string first = StartRunning();  // jobs/train on d0, d1
  ASSERT_OK(c_->Create(b).status());
  fake_.SetNode(2, v1::Node::READY);  // d2 and d3 back: b plans on them
  fake_.SetNode(3, v1::Node::READY);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d2", "d3"));
  // Long after, jobs/train has measured its steps: d2 and d3 are stable but b's.
  Measured(first, 1.0);
  now_ += absl::Minutes(5);
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 2u);
  EXPECT_TRUE(Job().status().candidate_plan().empty()) << Job().status().message();
}

// Two live jobs never share a checkpoint directory (written alike or not);
// once the first has ended, its directory may be taken.
TEST_F(JobsTest, TwoLiveJobsCannotShareACheckpointDirectory) {
  Make();
  StartRunning();  // jobs/train in kDir
  for (const std::string& dir :
       {std::string(kDir), std::string(kDir) + "/", std::string("/shared//ckpt/."),
        std::string("/shared/x/../ckpt")}) {
    v1::CreateJobRequest b = Request("b");
    b.mutable_spec()->mutable_training()->set_checkpoint_dir(dir);
    EXPECT_THAT(c_->Create(b).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("is the checkpoint directory of jobs/train (RUNNING)")))
        << dir;
  }
  EXPECT_EQ(c_->List(0, "")->jobs_size(), 1);
  v1::CreateJobRequest other = Request("c");
  other.mutable_spec()->mutable_training()->set_checkpoint_dir("/shared/ckpt-c");
  fake_.other_dirs.insert("/shared/ckpt-c");
  EXPECT_OK(c_->Create(other).status());
  fake_.SetState(Deployment(), v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  ASSERT_EQ(State(), v1::JobStatus::SUCCEEDED);
  EXPECT_OK(c_->Create(Request("b")).status());
}

// Unfinished jobs are bounded (kMaxUnfinishedJobs): each holds its spec
// (a graph of up to the request limit) and is driven by every pass, and
// retention only deletes finished jobs, so CreateJob called without end
// grew the planner without end. One more is RESOURCE_EXHAUSTED, saved
// nowhere.
TEST_F(JobsTest, UnfinishedJobsAreBounded) {
  Make();
  for (int i = 0; i < kMaxUnfinishedJobs; ++i) {
    v1::CreateJobRequest r = Request(absl::StrCat("j", i));
    r.mutable_spec()->mutable_training()->set_checkpoint_dir(absl::StrCat(kDir, "-", i));
    ASSERT_OK(c_->Create(r).status());
  }
  v1::CreateJobRequest over = Request("over");
  over.mutable_spec()->mutable_training()->set_checkpoint_dir(absl::StrCat(kDir, "-over"));
  EXPECT_THAT(c_->Create(over).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::AllOf(HasSubstr(absl::StrCat(kMaxUnfinishedJobs)),
                                        HasSubstr("StopJob"))));
  EXPECT_THAT(c_->Get("jobs/over").status(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(sink_.jobs.count("jobs/over"), 0u);
}

// A page of jobs ends once it holds kMaxPageBytes (at least one job), its
// token going on after the last: a spec may carry a graph of up to the
// request limit, and 1,000 of them were one answer of gigabytes.
TEST_F(JobsTest, APageOfJobsIsBoundedInBytes) {
  Make();
  const int jobs = static_cast<int>(kMaxPageBytes >> 20) * 3 / 2;
  for (int i = 0; i < jobs; ++i) {
    v1::CreateJobRequest r = Request(absl::StrCat("j", i));
    r.mutable_spec()->mutable_training()->set_checkpoint_dir(absl::StrCat(kDir, "-", i));
    r.mutable_spec()->mutable_training()->set_data(v1::TrainingConfig::WIKITEXT2);
    r.mutable_spec()->mutable_training()->set_data_path(
        std::string(1 << 20, 'd'));  // a spec of 1 MiB
    ASSERT_OK(c_->Create(r).status());
  }
  std::set<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<v1::ListJobsResponse> page = c_->List(kMaxPageSize, token);
    ASSERT_OK(page.status());
    ASSERT_GT(page->jobs_size(), 0);
    EXPECT_LE(page->ByteSizeLong(), kMaxPageBytes + (size_t{2} << 20));
    for (const v1::Job& j : page->jobs()) EXPECT_TRUE(seen.insert(j.name()).second) << j.name();
    token = page->next_page_token();
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(static_cast<int>(seen.size()), jobs);
  EXPECT_GE(pages, 2);
}

TEST_F(JobsTest, StopWhileRunningWaitsForTheDeploymentToStop) {
  Make();
  const std::string first = StartRunning();
  fake_.stops_take_effect = false;
  ASSERT_OK(c_->Stop("jobs/train").status());
  c_->Reconcile();
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
  EXPECT_THAT(Job().status().message(), HasSubstr("stopping"));
  fake_.SetState(first, v1::Deployment::STOPPED);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::STOPPED);
  EXPECT_THAT(replans_, IsEmpty());  // our own stop is no failure
}

TEST_F(JobsTest, AFailedPlanFailsTheJob) {
  Make();
  fake_.plans_finish_at_once = false;
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  fake_.plans.at("plans/train-p1").set_error("does not fit: 3 GiB needed, 1 GiB on d0");
  fake_.FinishPlan("plans/train-p1", v1::Plan::FAILED);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::FAILED);
  EXPECT_THAT(Job().status().message(), HasSubstr("does not fit"));
}

// A plan the planner's store could not record (the core fails it UNAVAILABLE
// "... could not be saved: database or disk is full") says nothing of the
// request: the job plans again rather than failing for good.
TEST_F(JobsTest, APlanFailedOnThePlannersSideIsMadeAgain) {
  Make();
  fake_.plans_finish_at_once = false;
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  v1::Plan& first = fake_.plans.at("plans/train-p1");
  first.set_error("plans/train-p1 became SUCCEEDED but that could not be saved: disk is full");
  first.set_error_code(static_cast<int>(absl::StatusCode::kUnavailable));
  fake_.FinishPlan("plans/train-p1", v1::Plan::FAILED);
  c_->Reconcile();
  EXPECT_NE(State(), v1::JobStatus::FAILED) << Job().status().message();
  EXPECT_THAT(Job().status().message(), HasSubstr("planning again"));
  c_->Reconcile();
  ASSERT_TRUE(fake_.plans.count("plans/train-p2"));
  fake_.FinishPlan("plans/train-p2");
  c_->Reconcile();
  EXPECT_FALSE(Deployment().empty()) << Job().status().message();
}

// A plan named as the job names its plans (plans/{id}-p{n}) that a caller
// made through CreatePlan, here before the job was created, is not the
// job's: the job plans under its next name, and neither deploys nor, when
// stopped, cancels the caller's plan. It adopted it before, as its own plan
// made before a restart.
TEST_F(JobsTest, APlanACallerNamedAsTheJobNamesItsPlansIsNotAdopted) {
  Make();
  fake_.plans_finish_at_once = false;
  v1::Plan theirs;
  theirs.set_name("plans/train-p1");
  theirs.set_state(v1::Plan::RUNNING);
  theirs.add_devices("d0");
  theirs.add_devices("d1");
  fake_.plans[theirs.name()] = theirs;
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  EXPECT_THAT(Job().status().message(),
              HasSubstr("plans/train-p1 exists and was not made by jobs/train (it was made "
                        "through CreatePlan); planning under another name"));
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].plan_id(), "train-p2");
  EXPECT_EQ(fake_.plans.at("plans/train-p2").job(), "jobs/train");
  fake_.FinishPlan("plans/train-p1");  // the caller's finishes first: not deployed
  c_->Reconcile();
  EXPECT_TRUE(fake_.deployed.empty());
  ASSERT_OK(c_->Stop("jobs/train").status());
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::STOPPED);
  EXPECT_EQ(fake_.plans.at("plans/train-p2").state(), v1::Plan::CANCELLED);
  EXPECT_EQ(fake_.plans.at("plans/train-p1").state(), v1::Plan::SUCCEEDED);
}

// A job deleted and its id used again: the earlier job's plans (kept by
// plan retention) carry the same Plan.job, and the new job adopted and
// deployed its plans/train-p1, made for the earlier job's model and options.
TEST_F(JobsTest, APlanOfAnEarlierJobOfTheSameNameIsNotAdopted) {
  Make();
  v1::Plan earlier;
  earlier.set_name("plans/train-p1");
  earlier.set_state(v1::Plan::SUCCEEDED);
  earlier.set_job("jobs/train");
  earlier.add_devices("d0");
  earlier.add_devices("d1");
  earlier.mutable_create_time()->set_seconds(absl::ToUnixSeconds(now_ - absl::Hours(1)));
  fake_.plans[earlier.name()] = earlier;
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();
  EXPECT_THAT(Job().status().message(),
              HasSubstr("plans/train-p1 exists and was not made by jobs/train but by an earlier "
                        "job of that name"));
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].plan_id(), "train-p2");
  ASSERT_EQ(fake_.deployed.size(), 1u);
  EXPECT_EQ(fake_.Only(fake_.deployed[0]).plan(), "plans/train-p2");
  EXPECT_EQ(Job().status().plan(), "plans/train-p2");
  ASSERT_OK(c_->Stop("jobs/train").status());
  c_->Reconcile();
  EXPECT_EQ(fake_.plans.at("plans/train-p1").state(), v1::Plan::SUCCEEDED);
}

TEST_F(JobsTest, ARestartedControllerGoesOnFromTheSavedJob) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 30;
  c_->Reconcile();
  c_.reset();  // the planner stops; the deployment keeps training
  Make(sink_.Saved());
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::RUNNING);
  EXPECT_EQ(Deployment(), first);
  EXPECT_EQ(fake_.requests.size(), 1u);
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();
  EXPECT_EQ(fake_.Only(Deployment()).training().resume(), "/shared/ckpt/step-00000030");
  EXPECT_EQ(Job().status().plan(), "plans/train-p2");
}

TEST_F(JobsTest, IntentsSavedBeforeACrashAreCarriedOutOnce) {
  Make();
  ASSERT_OK(c_->Create(Request()).status());
  // The planner saved "plan train-p1" and died before asking for it.
  v1::Job saved = sink_.jobs.at("jobs/train");
  saved.mutable_status()->set_state(v1::JobStatus::PLANNING);
  saved.mutable_status()->set_next_plan("plans/train-p1");
  saved.mutable_status()->set_plans_made(1);
  c_.reset();
  Make({saved});
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].plan_id(), "train-p1");
  EXPECT_EQ(fake_.deployed.size(), 1u);

  // It died after deploying, before saving the deployment: adopted.
  saved = sink_.jobs.at("jobs/train");
  saved.mutable_status()->set_next_plan("plans/train-p1");
  saved.mutable_status()->clear_deployment();
  c_.reset();
  Make({saved});
  c_->Reconcile();
  EXPECT_EQ(fake_.deployed.size(), 1u);
  EXPECT_EQ(Deployment(), fake_.deployed[0]);
}

// A stored job the controller cannot drive (a name not jobs/{id}, a plan
// name not plans/{id}, a state it does not know, a spec it cannot run)
// is loaded FAILED, saying what is wrong, and saved so; the others go on.
TEST_F(JobsTest, AMalformedStoredJobIsLoadedFailedNamingWhatIsWrong) {
  auto stored = [](const std::string& name) {
    v1::Job j;
    j.set_name(name);
    *j.mutable_spec() = Request().spec();
    j.mutable_status()->set_state(v1::JobStatus::PLANNING);
    j.mutable_status()->set_checkpoint_step(-1);
    j.mutable_status()->set_switch_after_step(-1);
    return j;
  };
  v1::Job bad_plan = stored("jobs/a");
  bad_plan.mutable_status()->set_next_plan("p1");
  v1::Job bad_name = stored("train");
  v1::Job bad_state = stored("jobs/b");
  bad_state.mutable_status()->set_state(static_cast<v1::JobStatus::State>(42));
  v1::Job bad_spec = stored("jobs/c");
  bad_spec.mutable_spec()->mutable_training()->clear_checkpoint_dir();
  v1::Job done = stored("jobs/d");  // final: left as it is
  done.mutable_status()->set_state(v1::JobStatus::SUCCEEDED);
  done.mutable_status()->set_next_plan("p1");
  Make({bad_plan, bad_name, bad_state, bad_spec, done, stored("jobs/train")});
  EXPECT_NO_THROW(c_->Reconcile());
  auto failed_with = [&](const std::string& name, const std::string& what) {
    v1::Job j;
    for (const v1::Job& x : c_->All()) {
      if (x.name() == name) j = x;
    }
    EXPECT_EQ(j.status().state(), v1::JobStatus::FAILED) << name;
    EXPECT_THAT(j.status().message(), HasSubstr("cannot drive this job as stored")) << name;
    EXPECT_THAT(j.status().message(), HasSubstr(what)) << name;
    ASSERT_TRUE(sink_.jobs.count(name)) << name << " not saved";
    EXPECT_EQ(sink_.jobs.at(name).status().state(), v1::JobStatus::FAILED) << name;
  };
  failed_with("jobs/a", "status.next_plan: plan name 'p1'");
  failed_with("train", "job name 'train' is not jobs/{id}");
  failed_with("jobs/b", "status.state 42");
  failed_with("jobs/c", "spec: spec.training.checkpoint_dir is required");
  EXPECT_EQ(Job("jobs/d").status().state(), v1::JobStatus::SUCCEEDED);
  EXPECT_EQ(State(), v1::JobStatus::PLANNING);  // the well-formed one is planned
  ASSERT_EQ(fake_.requests.size(), 1u);
  EXPECT_EQ(fake_.requests[0].plan_id(), "train-p1");
}

TEST_F(JobsTest, ASaveTheSinkRefusesChangesNothing) {
  Make();
  sink_.refuse = true;
  EXPECT_THAT(c_->Create(Request()), StatusIs(absl::StatusCode::kResourceExhausted,
                                              HasSubstr("jobs/train was not created")));
  EXPECT_THAT(c_->Get("jobs/train"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  sink_.refuse = false;
  ASSERT_OK(c_->Create(Request()).status());
  sink_.refuse = true;
  c_->Reconcile();
  EXPECT_THAT(fake_.requests, IsEmpty());  // the intent was not saved: no plan
  v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::PENDING);
  EXPECT_THAT(j.status().message(), HasSubstr("could not save this job: disk full"));
  EXPECT_THAT(c_->Stop("jobs/train"), StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_FALSE(Job().status().stop_requested());
  sink_.refuse = false;
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 1u);
}

TEST_F(JobsTest, BadRequestsAreRefusedNamingTheField) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_training()->clear_checkpoint_dir();
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("checkpoint_dir is required")));
  // Relative: to the planner's working directory and each executor's.
  r.mutable_spec()->mutable_training()->set_checkpoint_dir("ckpt/run");
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("checkpoint_dir must be an absolute path (a "
                                                "directory every executor and the planner see "
                                                "at that path), got 'ckpt/run'")));
  r = Request();
  r.mutable_spec()->clear_model();
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.model")));
  r = Request();
  r.mutable_spec()->mutable_training()->set_steps(0);
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("steps must be positive")));
  r = Request();
  r.mutable_spec()->mutable_training()->set_resume("/x");
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("set by the job")));
  r = Request();  // global_batch 32
  (*r.mutable_spec()->mutable_model()->mutable_zoo()->mutable_params())["batch"] = 64;
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("spec: global_batch 32 differs from "
                                                "model.zoo.params[\"batch\"] 64")));
  // A data_spec of no form the executors read: every rank's LoadPlan
  // refused it, and the job re-planned on it until its re-plans ran out.
  r = Request();
  r.mutable_spec()->mutable_training()->set_data_spec("tokens/data.bin");
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("spec: training.data_spec 'tokens/data.bin' is "
                                                "not of a form the executors read")));
  r.mutable_spec()->mutable_training()->set_data_spec("tokens:/data/a:b.bin:uint32");
  EXPECT_OK(c_->Create(r).status());  // a ':' in the file, the dtype spelled out
  ASSERT_OK(c_->Stop("jobs/train").status());
  c_->Reconcile();
  ASSERT_OK(c_->Delete("jobs/train"));
  r = Request();
  r.mutable_spec()->mutable_replan()->set_min_gain(std::nan(""));
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min_gain")));
  r = Request();
  r.mutable_spec()->mutable_devices()->set_min_devices(3);
  r.mutable_spec()->mutable_devices()->set_max_devices(2);
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_devices")));
  EXPECT_THAT(c_->Create(Request("Bad_Id")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id 'Bad_Id'")));
  EXPECT_THAT(c_->Create(Request(std::string(51, 'a'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1-50")));
  ASSERT_OK(c_->Create(Request()).status());
  EXPECT_THAT(c_->Create(Request()), StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
  EXPECT_THAT(c_->Get("train"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not jobs/{id}")));
  EXPECT_THAT(c_->Get("jobs/nope"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(c_->Stop("jobs/nope"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(c_->List(-1, ""), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(c_->List(0, "garbage"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

// The executors a spec names are dialled at every deploy: one gRPC would
// read as another address ('127.0.0.1:99999' is port 34463), or one given
// to two devices (an executor runs one rank), was taken at CreateJob and
// refused by every deploy after it, the job "trying again" forever on
// devices no other job could have.
TEST_F(JobsTest, ExecutorsTheSpecNamesAreCheckedAtCreate) {
  Make();
  v1::CreateJobRequest r = Request();
  (*r.mutable_spec()->mutable_executors())["d0"] = "127.0.0.1:99999";
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("spec.executors[\"d0\"]"), HasSubstr("127.0.0.1:99999"))));
  r = Request();
  (*r.mutable_spec()->mutable_executors())["d0"] = "127.0.0.1";
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.executors[\"d0\"]")));
  r = Request();
  (*r.mutable_spec()->mutable_executors())["d0"] = "127.0.0.1:7000";
  (*r.mutable_spec()->mutable_executors())["d1"] = "127.0.0.1:7000";
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'d0'"), HasSubstr("'d1'"), HasSubstr("127.0.0.1:7000"))));
  r = Request();
  (*r.mutable_spec()->mutable_executors())["no such id"] = "127.0.0.1:7000";
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.executors")));
  EXPECT_THAT(c_->List(0, "")->jobs(), IsEmpty());
  r = Request();
  (*r.mutable_spec()->mutable_executors())["d0"] = "127.0.0.1:7000";
  (*r.mutable_spec()->mutable_executors())["d1"] = "127.0.0.1:7001";
  EXPECT_OK(c_->Create(r).status());
}

// A selector no plan can ever satisfy (max_devices 1, when a plan takes two;
// more than a plan takes; a device list shorter than the job needs) was
// taken, and the job waited for devices for ever, saying "1 usable, the job
// needs 2" of a cluster with many.
TEST_F(JobsTest, ASelectorNoPlanCanSatisfyIsRefusedAtCreate) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_devices()->set_max_devices(1);
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.devices.max_devices")));
  r = Request();
  r.mutable_spec()->mutable_devices()->set_min_devices(kMaxPlanDevices + 1);
  EXPECT_THAT(c_->Create(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                      AllOf(HasSubstr("spec.devices.min_devices"),
                                            HasSubstr(absl::StrCat(kMaxPlanDevices)))));
  r = Request();
  r.mutable_spec()->mutable_devices()->add_devices("d0");
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.devices.devices")));
  r = Request();
  r.mutable_spec()->mutable_devices()->add_devices("d0");
  r.mutable_spec()->mutable_devices()->add_devices("d0");
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.devices.devices")));
  r = Request();
  r.mutable_spec()->mutable_devices()->add_devices("d0");
  r.mutable_spec()->mutable_devices()->add_devices("d1");
  r.mutable_spec()->mutable_devices()->set_min_devices(3);
  EXPECT_THAT(c_->Create(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.devices.min_devices")));
  EXPECT_THAT(c_->List(0, "")->jobs(), IsEmpty());
  r = Request();
  r.mutable_spec()->mutable_devices()->add_devices("d0");
  r.mutable_spec()->mutable_devices()->add_devices("d1");
  r.mutable_spec()->mutable_devices()->set_max_devices(2);
  EXPECT_OK(c_->Create(r).status());
}

TEST_F(JobsTest, ListPagesAndWatchSeesEveryChangeToTheEnd) {
  Make();
  ASSERT_OK(c_->Create(Request("a")).status());
  v1::CreateJobRequest b = Request("b");
  b.mutable_spec()->mutable_training()->set_checkpoint_dir("/shared/ckpt-b");
  fake_.other_dirs.insert("/shared/ckpt-b");
  ASSERT_OK(c_->Create(b).status());
  ASSERT_OK_AND_ASSIGN(v1::ListJobsResponse page, c_->List(1, ""));
  ASSERT_EQ(page.jobs_size(), 1);
  EXPECT_EQ(page.jobs(0).name(), "jobs/a");
  ASSERT_OK_AND_ASSIGN(page, c_->List(1, page.next_page_token()));
  EXPECT_EQ(page.jobs(0).name(), "jobs/b");
  EXPECT_EQ(page.next_page_token(), "");

  std::vector<v1::JobStatus::State> seen;
  absl::Notification watching;
  std::thread watcher([&] {
    EXPECT_OK(c_->Watch(
        "jobs/a",
        [&](const v1::Job& j) {
          if (seen.empty() || seen.back() != j.status().state()) {
            seen.push_back(j.status().state());
          }
          if (!watching.HasBeenNotified()) watching.Notify();
          return true;
        },
        [] { return false; }));
  });
  watching.WaitForNotification();
  c_->Reconcile();
  ASSERT_OK(c_->Stop("jobs/a").status());
  c_->Reconcile();  // stops the deployment (at once in the fake) ...
  c_->Reconcile();  // ... and sees it stopped
  watcher.join();   // returns because the job is final
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front(), v1::JobStatus::PENDING);
  EXPECT_EQ(seen.back(), v1::JobStatus::STOPPED);
  EXPECT_THAT(c_->Watch(
                  "jobs/x", [](const v1::Job&) { return true; }, [] { return false; }),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(JobsTest, TheLoopThreadReconcilesUntilShutdown) {
  JobControllerOptions o;
  o.backend = &fake_;
  o.interval = absl::Milliseconds(10);
  JobController c(o);
  c.Start();
  ASSERT_OK(c.Create(Request()).status());
  // Woken by the create: the job is planned without a Reconcile() here.
  ASSERT_OK(c.Watch(
      "jobs/train", [](const v1::Job& j) { return j.status().deployment().empty(); },
      [] { return false; }));
  c.Shutdown();
  EXPECT_THAT(c.Create(Request("later")), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

class CheckpointScanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / absl::StrCat("ckpt-", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void Step(const std::string& name, bool committed) {
    fs::create_directories(dir_ / name);
    if (committed) std::ofstream(dir_ / name / "COMMITTED") << "ok";
  }
  fs::path dir_;
};

TEST_F(CheckpointScanTest, OnlyCommittedStepDirectoriesCount) {
  EXPECT_THAT(LatestCommittedCheckpoint(dir_.string()),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(LatestCommittedCheckpoint((dir_ / "absent").string()),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  Step("step-00000010", true);
  Step("step-00000020", true);
  Step("step-00000030", false);      // a save cut short
  Step(".tmp-step-00000040", true);  // being written
  Step("step-x", true);
  Step("step-", true);
  absl::StatusOr<int64_t> latest = LatestCommittedCheckpoint(dir_.string());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 20);
  EXPECT_EQ(CheckpointStepDir("/c", 20), "/c/step-00000020");
  EXPECT_EQ(CheckpointStepDir("/c", 123456789), "/c/step-123456789");
}

TEST_F(CheckpointScanTest, ADamagedCheckpointIsRenamedOutOfTheScansReach) {
  Step("step-00000010", true);
  Step("step-00000020", true);
  Step("damaged-step-00000020", true);  // an earlier run's, set aside before
  std::ofstream(dir_ / "step-00000020" / "rank-00000.safetensors") << "damaged";
  absl::StatusOr<std::string> moved = SetAsideDamagedCheckpoint((dir_ / "step-00000020").string());
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, (dir_ / "damaged-step-00000020-1").string());  // nothing replaced
  EXPECT_TRUE(fs::exists(dir_ / "damaged-step-00000020-1" / "rank-00000.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "damaged-step-00000020" / "COMMITTED"));
  EXPECT_FALSE(fs::exists(dir_ / "step-00000020"));
  absl::StatusOr<int64_t> latest = LatestCommittedCheckpoint(dir_.string());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 10);

  // Gone already (a pass renamed it and could not save), and not a step.
  EXPECT_THAT(SetAsideDamagedCheckpoint((dir_ / "step-00000020").string()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("step-00000020")));
  EXPECT_THAT(SetAsideDamagedCheckpoint(dir_.string()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a checkpoint step")));
  EXPECT_TRUE(SetAsideDamagedCheckpoint((dir_ / "step-00000010/").string()).ok());
  EXPECT_TRUE(fs::exists(dir_ / "damaged-step-00000010"));
}

}  // namespace
}  // namespace hap::service::jobs_testing
