// hap.v1.Planner in process against fake executors over gRPC (each its own
// server on 127.0.0.1:0) that can be frozen (SIGSTOP) or shut down
// (SIGKILL): every rank of a deployment that fails or is stopped is
// stopped, also after a planner restart; heartbeats say whether a
// deployment runs on the node. An elastic job over those fake executors: an
// executor lost, the job re-planned on the rest, resumed from the committed
// checkpoint, and done; across a planner restart too.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_test_util.h"
#include "common/grpc_util.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/resource_quota.h"
#include "gtest/gtest.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/profile_checks.h"
#include "planner/service/grpc/planner_service_impl.h"
#include "planner/service/grpc/planner_service_impl_test_util.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using impl_testing::FakeExecutor;
using impl_testing::kToken;
using impl_testing::Mlp;
using impl_testing::PlannerServiceImplTest;
using impl_testing::TestNode;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST_F(PlannerServiceImplTest, AFrozenExecutorFailsItsDeploymentAndTheOtherRankIsStopped) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  executors_[1]->Freeze(true);
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(),
              AllOf(HasSubstr("rank 1 (n/cpu1 at " + executors_[1]->address() + ")"),
                    HasSubstr("did not answer 3 status polls in a row")));
  // Each poll was given the status timeout (100 ms, as gRPC carries a
  // deadline: rounded up), not the call timeout (5 s) or none: the deadline
  // the frozen executor saw, not how long the test took. (This was a
  // wall-clock limit: failed within 3 s of the freeze.)
  EXPECT_GE(executors_[1]->frozen_status_calls(), 1);
  EXPECT_LT(executors_[1]->longest_frozen_status_call(), absl::Seconds(1));
  ASSERT_TRUE(executors_[0]->WaitForStops(1));
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);
  EXPECT_EQ(executors_[0]->status().error(), "stopped by StopTraining");
  // Thawed, the frozen rank is stopped too when asked again.
  executors_[1]->Freeze(false);
  ASSERT_THAT(Stop(d->name()), IsOk());
  EXPECT_EQ(executors_[1]->status().state(), v1::ExecutorStatus::FAILED);
}

// SIGKILL: connections refused; the survivor is stopped, and a new
// deployment of the plan to it (and a replacement) works with no manual stop.
TEST_F(PlannerServiceImplTest, AKilledExecutorFailsItsDeploymentAndANewOneWorks) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  executors_[1]->Kill();
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 1 (n/cpu1 at " + executors_[1]->address()));
  ASSERT_TRUE(executors_[0]->WaitForStops(1));
  EXPECT_NE(executors_[0]->status().state(), v1::ExecutorStatus::TRAINING);

  executors_[1] = std::make_unique<FakeExecutor>();  // the replacement
  auto again = DeployToFakes("p");
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->name(), "deployments/p-g2");
  WaitForState(again->name(), v1::Deployment::RUNNING);
  EXPECT_EQ(executors_[0]->status().deployment(), "deployments/p-g2");
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::TRAINING);
}

// A rank that reports FAILED fails the deployment and the other is stopped;
// StopDeployment on the FAILED deployment tells every rank again
// (idempotent), stopping one still training it.
TEST_F(PlannerServiceImplTest, StopDeploymentOnAFailedDeploymentStopsRanksStillTraining) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  executors_[1]->Set(v1::ExecutorStatus::FAILED, "out of memory");
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 1 (n/cpu1 at " + executors_[1]->address() +
                                        ") failed: out of memory"));
  ASSERT_TRUE(executors_[0]->WaitForStops(1));
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);

  // Say rank 0 never got that stop and trains on.
  executors_[0]->Set(v1::ExecutorStatus::TRAINING);
  auto stopped = Stop(d->name());
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::FAILED);
  EXPECT_EQ(executors_[0]->stops(), 2);
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);
  // A rank that cannot be reached is named, and the call can be retried.
  executors_[0]->Set(v1::ExecutorStatus::TRAINING);
  executors_[1]->Kill();
  EXPECT_THAT(Stop(d->name()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr(d->name() + " is FAILED; its ranks were told to stop"),
                             HasSubstr("not confirmed stopped after 1 attempt: rank 1"))));
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);
}

TEST_F(PlannerServiceImplTest, StopDeploymentStopsEveryRankThenSaysStopped) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  auto stopped = Stop(d->name());
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  for (auto& e : executors_) {
    EXPECT_EQ(e->stops(), 1);
    EXPECT_EQ(e->status().state(), v1::ExecutorStatus::FAILED);
  }
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::STOPPED);
}

// A heartbeat tells the agent whether a deployment not finished runs on its
// node (HeartbeatResponse.training): it pauses drift checks and link
// re-probes meanwhile, which beside the job read its load as the device's.
TEST_F(PlannerServiceImplTest, HeartbeatsSayWhetherADeploymentRunsOnTheNode) {
  Register("n");
  auto beat = [&](const std::string& node) {
    v1::HeartbeatRequest r;
    r.set_name("nodes/" + node);
    v1::HeartbeatResponse out;
    EXPECT_THAT(FromGrpc(stub_->Heartbeat(Ctx().get(), r, &out)), IsOk());
    return out.training();
  };
  EXPECT_FALSE(beat("n"));
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  Register("other");  // after the plan: it is on n's devices only
  EXPECT_TRUE(beat("n"));
  EXPECT_FALSE(beat("other"));
  ASSERT_THAT(Stop(d->name()), IsOk());
  EXPECT_FALSE(beat("n"));
}

// The planner restarts (shut down, a new service from the saved state) while
// a deployment runs: its executors train on meanwhile; the new planner
// re-attaches, and StopDeployment stops them.
TEST_F(PlannerServiceImplTest, ARestartedPlannerReattachesAndStopDeploymentStopsTheRanks) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  StopService();
  for (auto& e : executors_) {
    EXPECT_EQ(e->stops(), 0);
    EXPECT_EQ(e->status().state(), v1::ExecutorStatus::TRAINING);
  }
  ASSERT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::RUNNING);
  StartService(sink_.deployments());
  auto stopped = Stop(d->name());
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  for (auto& e : executors_) {
    EXPECT_EQ(e->stops(), 1);
    EXPECT_EQ(e->status().state(), v1::ExecutorStatus::FAILED);
  }
}

// ... and one whose executor died while the planner was away is failed on
// re-attaching, the other rank stopped.
TEST_F(PlannerServiceImplTest, ARestartedPlannerFailsADeploymentWhoseRankIsGone) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  StopService();
  executors_[0]->Kill();
  StartService(sink_.deployments());
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 0 (n/cpu0 at " + executors_[0]->address()));
  ASSERT_TRUE(executors_[1]->WaitForStops(1));
  EXPECT_EQ(executors_[1]->status().state(), v1::ExecutorStatus::FAILED);
}

// --------------------------------------------------------------- jobs --

class JobTest : public PlannerServiceImplTest {
 protected:
  // Nodes "a" and "b", two devices each, at four fake executors (a's named
  // by its node's labels, b's by the job's spec); a checkpoint directory with
  // step 5 committed and step 10 cut short.
  void SetUp() override {
    PlannerServiceImplTest::SetUp();
    for (int i = 0; i < 4; ++i) executors_.push_back(std::make_unique<FakeExecutor>());
    for (int n = 0; n < 2; ++n) {
      v1::RegisterNodeRequest r;
      *r.mutable_node() = TestNode(n == 0 ? "a" : "b");
      for (int i = 0; n == 0 && i < 2; ++i) {  // node b's executors: in the job's spec
        (*r.mutable_node()
              ->mutable_labels())[absl::StrCat("hap.executor/", r.node().devices(i).id())] =
            executors_[i]->address();
      }
      v1::RegisterNodeResponse out;
      ASSERT_THAT(FromGrpc(stub_->RegisterNode(Ctx().get(), r, &out)), IsOk());
    }
    dir_ = std::filesystem::path(::testing::TempDir()) / "job-checkpoints";
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "step-00000005");
    std::ofstream(dir_ / "step-00000005" / "COMMITTED") << "";
    std::filesystem::create_directories(dir_ / "step-00000010");  // no COMMITTED
  }
  void TearDown() override {
    PlannerServiceImplTest::TearDown();
    std::filesystem::remove_all(dir_);
  }

  v1::CreateJobRequest JobRequest() {
    v1::CreateJobRequest r;
    r.set_job_id("train");
    *r.mutable_spec()->mutable_model() = Mlp("unused").model();
    r.mutable_spec()->mutable_training()->set_steps(50);
    r.mutable_spec()->mutable_training()->set_checkpoint_dir(dir_.string());
    r.mutable_spec()->mutable_training()->set_checkpoint_every(5);
    // The lost executor's device stays out for the whole test.
    r.mutable_spec()->mutable_replan()->mutable_join_stable()->set_seconds(600);
    (*r.mutable_spec()->mutable_executors())["b/cpu0"] = executors_[2]->address();
    (*r.mutable_spec()->mutable_executors())["b/cpu1"] = executors_[3]->address();
    return r;
  }

  // WatchJob of jobs/train, on `ctx` (given the token and a deadline).
  std::unique_ptr<grpc::ClientReader<v1::Job>> WatchJob(grpc::ClientContext* ctx) {
    Security s;
    s.token = kToken;
    PrepareClientContext(ctx, s, absl::Seconds(60));
    v1::WatchJobRequest r;
    r.set_name("jobs/train");
    return stub_->WatchJob(ctx, r);
  }

  // Follows WatchJob until `done` holds for the job; the job then.
  v1::Job WatchUntil(const std::function<bool(const v1::Job&)>& done) {
    grpc::ClientContext ctx;
    auto reader = WatchJob(&ctx);
    v1::Job j;
    while (reader->Read(&j)) {
      if (done(j)) {
        ctx.TryCancel();
        break;
      }
    }
    reader->Finish();
    EXPECT_TRUE(done(j)) << j.DebugString();
    return j;
  }

  std::filesystem::path dir_;
};

TEST_F(JobTest, ALostExecutorIsReplannedAroundAndTheJobSucceeds) {
  v1::Job job;
  ASSERT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), JobRequest(), &job)), IsOk());
  EXPECT_EQ(job.name(), "jobs/train");
  EXPECT_EQ(job.status().state(), v1::JobStatus::PENDING);
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::RUNNING; });
  EXPECT_EQ(job.status().devices_size(), 4);
  EXPECT_EQ(job.status().generation(), 1);
  // Step 5 is the latest complete checkpoint (step 10 was cut short).
  EXPECT_EQ(executors_[0]->last_resume(), (dir_ / "step-00000005").string());

  executors_[3]->Kill();  // b/cpu1's executor dies; node b stays READY
  job = WatchUntil([](const v1::Job& j) {
    return j.status().state() == v1::JobStatus::RUNNING && j.status().generation() == 2;
  });
  EXPECT_THAT(job.status().devices(), ::testing::ElementsAre("a/cpu0", "a/cpu1", "b/cpu0"));
  ASSERT_EQ(job.status().events_size(), 2);
  const v1::JobEvent& e = job.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_THAT(e.detail(), HasSubstr("rank 3 (b/cpu1 at " + executors_[3]->address()));
  EXPECT_EQ(e.resume_step(), 5);
  EXPECT_GE(e.downtime_seconds(), 0);
  EXPECT_EQ(e.devices_before_size(), 4);
  EXPECT_EQ(job.status().replans(), 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(executors_[i]->status().deployment(), job.status().deployment());
    EXPECT_EQ(executors_[i]->status().state(), v1::ExecutorStatus::TRAINING);
  }

  for (int i = 0; i < 3; ++i) executors_[i]->Set(v1::ExecutorStatus::FINISHED);
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::SUCCEEDED; });
  EXPECT_EQ(job.status().steps_done(), 50);

  v1::ListJobsResponse list;
  ASSERT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list)), IsOk());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).status().state(), v1::JobStatus::SUCCEEDED);
  v1::StopJobRequest stop;
  stop.set_name("jobs/train");
  ASSERT_THAT(FromGrpc(stub_->StopJob(Ctx().get(), stop, &job)), IsOk());
  EXPECT_EQ(job.status().state(), v1::JobStatus::SUCCEEDED);  // final: as it is
}

// A watch that the planner's shutdown ends, the job still running, is
// UNAVAILABLE (watch again, at the restarted planner), not OK: hapctl watch
// read the OK as the job's end and exited 0 while the job trained on.
TEST_F(JobTest, AWatchEndedByShutdownIsUnavailableNotOk) {
  v1::Job job;
  ASSERT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), JobRequest(), &job)), IsOk());
  grpc::ClientContext ctx;
  auto reader = WatchJob(&ctx);
  ASSERT_TRUE(reader->Read(&job));
  service_->Shutdown();
  while (reader->Read(&job)) {
  }
  EXPECT_THAT(FromGrpc(reader->Finish()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("shutting down"), HasSubstr("jobs/train"))));
  EXPECT_NE(job.status().state(), v1::JobStatus::SUCCEEDED);
}

TEST_F(JobTest, ErrorsAreStatusesNamingWhatIsWrong) {
  v1::Job job;
  v1::GetJobRequest get;
  get.set_name("jobs/none");
  EXPECT_THAT(FromGrpc(stub_->GetJob(Ctx().get(), get, &job)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("jobs/none")));
  get.set_name("train");
  EXPECT_THAT(FromGrpc(stub_->GetJob(Ctx().get(), get, &job)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("jobs/{id}")));
  v1::CreateJobRequest r = JobRequest();
  r.mutable_spec()->mutable_training()->clear_checkpoint_dir();
  EXPECT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), r, &job)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("checkpoint_dir")));
  grpc::ClientContext no_token;
  EXPECT_THAT(FromGrpc(stub_->CreateJob(&no_token, JobRequest(), &job)),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  v1::ListJobsRequest bad;
  bad.set_page_token("garbage");
  v1::ListJobsResponse list;
  EXPECT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), bad, &list)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
}

// A spec the job could never run is refused by CreateJob, naming the
// field, and no job is kept: before, a NaN slowdown threshold was taken as
// the default, and a model, plan options, thread counts or a data source
// no plan or executor takes made a job that failed (or re-planned) later.
TEST_F(JobTest, CreateJobRefusesASpecNoPlanOrDeploymentTakes) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::pair<std::string, std::function<void(v1::JobSpec*)>>> bad = {
      {"spec.replan.slowdown_threshold",
       [&](v1::JobSpec* s) { s->mutable_replan()->set_slowdown_threshold(nan); }},
      {"spec.replan.slowdown_threshold",
       [&](v1::JobSpec* s) { s->mutable_replan()->set_slowdown_threshold(-1); }},
      {"spec.replan.slowdown_threshold",
       [&](v1::JobSpec* s) { s->mutable_replan()->set_slowdown_threshold(inf); }},
      {"spec.replan.join_stable",
       [](v1::JobSpec* s) { s->mutable_replan()->mutable_join_stable()->set_nanos(2000000000); }},
      {"spec: options.optimizer.learning_rate",
       [&](v1::JobSpec* s) { s->mutable_options()->mutable_optimizer()->set_learning_rate(nan); }},
      {"spec: options.budget.max_seconds",
       [](v1::JobSpec* s) { s->mutable_options()->mutable_budget()->set_max_seconds(-1); }},
      {"spec: training.threads_per_rank",
       [](v1::JobSpec* s) { s->mutable_training()->set_threads_per_rank(1 << 30); }},
      {"spec.model.zoo",
       [](v1::JobSpec* s) { s->mutable_model()->mutable_zoo()->set_name("nope"); }},
      {"spec.model.zoo",
       [](v1::JobSpec* s) { (*s->mutable_model()->mutable_zoo()->mutable_params())["zzz"] = 1; }},
      {"spec.model.zoo",
       [&](v1::JobSpec* s) {
         (*s->mutable_model()->mutable_zoo()->mutable_params())["layers"] = nan;
       }},
      {"spec.model.graph",
       [](v1::JobSpec* s) { s->mutable_model()->mutable_graph()->add_ops()->set_name("x"); }},
      {"spec: training.data",
       [](v1::JobSpec* s) {
         s->mutable_training()->set_data(static_cast<v1::TrainingConfig::DataSource>(99));
       }},
      // Fields nothing would read (PlannerServiceImplTest.FieldsNothingWouldReadAreRefused).
      {"spec: options.optimizer.momentum",
       [](v1::JobSpec* s) {
         s->mutable_options()->mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
         s->mutable_options()->mutable_optimizer()->set_momentum(0.9);
       }},
      {"spec: training.data_path",
       [](v1::JobSpec* s) { s->mutable_training()->set_data_path("/data/wiki.train.tokens"); }},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const auto& [field, edit] = bad[i];
    v1::CreateJobRequest r = JobRequest();
    r.set_job_id(absl::StrCat("bad-", i));
    r.mutable_spec()->mutable_training()->set_checkpoint_dir((dir_ / r.job_id()).string());
    edit(r.mutable_spec());
    v1::Job job;
    EXPECT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), r, &job)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)))
        << r.spec().DebugString();
  }
  v1::ListJobsResponse jobs;
  ASSERT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), v1::ListJobsRequest(), &jobs)), IsOk());
  EXPECT_EQ(jobs.jobs_size(), 0);
  EXPECT_TRUE(sink_.jobs().empty());
}

TEST_F(JobTest, ARestartedPlannerGoesOnWithTheJobAndStopJobStopsIt) {
  v1::Job job;
  ASSERT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), JobRequest(), &job)), IsOk());
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::RUNNING; });
  const std::string deployment = job.status().deployment();
  StopService();  // the executors go on training
  StartService(sink_.deployments(), 0, sink_.jobs());
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::RUNNING; });
  EXPECT_EQ(job.status().deployment(), deployment);  // re-attached, not redeployed
  EXPECT_EQ(job.status().generation(), 1);
  v1::StopJobRequest stop;
  stop.set_name("jobs/train");
  ASSERT_THAT(FromGrpc(stub_->StopJob(Ctx().get(), stop, &job)), IsOk());
  EXPECT_TRUE(job.status().stop_requested());
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::STOPPED; });
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(executors_[i]->status().state(), v1::ExecutorStatus::TRAINING) << i;
  }
}

}  // namespace
}  // namespace hap::service
