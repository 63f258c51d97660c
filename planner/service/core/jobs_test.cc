#include "planner/service/core/jobs.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/util/status_matchers.h"

#define HAP_JOBS_CONCAT_(a, b) a##b
#define HAP_JOBS_CONCAT(a, b) HAP_JOBS_CONCAT_(a, b)
#define ASSERT_OK(x) ASSERT_THAT((x), ::hap::testing::IsOk())
#define EXPECT_OK(x) EXPECT_THAT((x), ::hap::testing::IsOk())
#define ASSERT_OK_AND_ASSIGN_(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  ASSERT_TRUE(tmp.ok()) << tmp.status();      \
  lhs = std::move(*tmp)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_(HAP_JOBS_CONCAT(status_or_, __LINE__), lhs, expr)

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;
using ::hap::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kDir[] = "/shared/ckpt";

// The planner core and the deployment manager as the controller sees them:
// plans finish at once (or when the test says), deployments change state
// when the test says, stops take effect at once (or when the test says).
class FakeBackend : public JobBackend {
 public:
  explicit FakeBackend(int nodes) {
    for (int i = 0; i < nodes; ++i) {
      v1::Node* n = cluster.add_nodes();
      n->set_name(absl::StrCat("n", i));
      n->set_state(v1::Node::READY);
      n->add_devices()->set_id(absl::StrCat("d", i));
    }
  }

  void SetNode(int i, v1::Node::State s) { cluster.mutable_nodes(i)->set_state(s); }
  // Node i registered again by a new agent (at another address).
  void Reregister(int i) {
    v1::Node* n = cluster.mutable_nodes(i);
    n->set_address(absl::StrCat("127.0.0.1:", 1000 + ++registrations));
  }
  int registrations = 0;
  v1::Deployment& Only(const std::string& name) { return deployments.at(name); }
  void SetState(const std::string& deployment, v1::Deployment::State s) {
    deployments.at(deployment).set_state(s);
  }
  void FinishPlan(const std::string& name, v1::Plan::State s = v1::Plan::SUCCEEDED) {
    plans.at(name).set_state(s);
  }

  v1::Cluster Cluster() override { return cluster; }
  absl::StatusOr<v1::Plan> CreatePlan(const v1::CreatePlanRequest& r) override {
    const std::string name = "plans/" + r.plan_id();
    if (plans.count(name)) return absl::AlreadyExistsError(name);
    if (r.devices().empty()) return absl::InvalidArgumentError("no devices");
    requests.push_back(r);
    v1::Plan p;
    p.set_name(name);
    *p.mutable_devices() = r.devices();
    p.set_state(plans_finish_at_once ? v1::Plan::SUCCEEDED : v1::Plan::PENDING);
    p.mutable_prediction()->set_step_seconds(
        predict(std::vector<std::string>(r.devices().begin(), r.devices().end())));
    p.set_calibration(calibration);
    plans[name] = p;
    return p;
  }
  absl::StatusOr<v1::Plan> GetPlan(const std::string& name) override {
    auto it = plans.find(name);
    if (it == plans.end()) return absl::NotFoundError(name);
    return it->second;
  }
  absl::Status CancelPlan(const std::string& name) override {
    auto it = plans.find(name);
    if (it == plans.end()) return absl::NotFoundError(name);
    if (it->second.state() == v1::Plan::PENDING || it->second.state() == v1::Plan::RUNNING) {
      it->second.set_state(v1::Plan::CANCELLED);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<v1::Deployment> Deploy(
      const std::string& plan, const v1::TrainingConfig& training,
      const std::map<std::string, std::string>& executors) override {
    if (!deploy_error.ok()) return deploy_error;
    deployed_executors = executors;
    const v1::Plan& p = plans.at(plan);
    EXPECT_EQ(p.state(), v1::Plan::SUCCEEDED);
    v1::Deployment d;
    d.set_name(absl::StrCat("deployments/", plan.substr(6), "-g", ++generation));
    d.set_plan(plan);
    d.set_state(v1::Deployment::PENDING);
    for (int r = 0; r < p.devices_size(); ++r) {
      auto* a = d.add_ranks();
      a->set_rank(r);
      a->set_device(p.devices(r));
    }
    *d.mutable_training() = training;
    deployments[d.name()] = d;
    deployed.push_back(d.name());
    return d;
  }
  absl::StatusOr<v1::Deployment> GetDeployment(const std::string& name) override {
    auto it = deployments.find(name);
    if (it == deployments.end()) return absl::NotFoundError(name);
    return it->second;
  }
  std::vector<v1::Deployment> DeploymentsOf(const std::string& plan) override {
    std::vector<v1::Deployment> out;
    for (const auto& [n, d] : deployments) {
      if (d.plan() == plan) out.push_back(d);
    }
    return out;
  }
  absl::Status StopDeployment(const std::string& name) override {
    stops.push_back(name);
    v1::Deployment& d = deployments.at(name);
    if (stops_take_effect &&
        (d.state() == v1::Deployment::PENDING || d.state() == v1::Deployment::RUNNING)) {
      d.set_state(v1::Deployment::STOPPED);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> LatestCheckpoint(const std::string& dir) override {
    EXPECT_EQ(dir, kDir);
    if (checkpoint < 0) return absl::NotFoundError("none");
    return checkpoint;
  }
  absl::StatusOr<std::string> Calibrate(const v1::Deployment& d) override {
    calibrated.push_back(d.name());
    for (const auto& p : d.rank_profiles()) EXPECT_GT(p.steps(), 0);
    return absl::StrCat("calibrated from ", d.name());
  }

  v1::Cluster cluster;
  std::map<std::string, v1::Plan> plans;
  std::map<std::string, v1::Deployment> deployments;
  std::vector<v1::CreatePlanRequest> requests;
  std::vector<std::string> deployed;  // in order
  std::vector<std::string> stops;
  bool plans_finish_at_once = true;
  bool stops_take_effect = true;
  absl::Status deploy_error;
  std::map<std::string, std::string> deployed_executors;
  int64_t checkpoint = -1;
  int generation = 0;
  std::vector<std::string> calibrated;  // Calibrate calls, in order
  std::string calibration;              // Plan.calibration of the plans made
  // Predicted step time of a device set: more devices, faster.
  std::function<double(const std::vector<std::string>&)> predict =
      [](const std::vector<std::string>& d) { return 1.0 / d.size(); };
};

// Saves into a map; refuses while `refuse` is set.
class MapSink : public PlannerStateSink {
 public:
  absl::Status SaveNode(const v1::Node&) override { return absl::OkStatus(); }
  absl::Status SavePlan(const v1::Plan&) override { return absl::OkStatus(); }
  absl::Status DeletePlan(const std::string&) override { return absl::OkStatus(); }
  absl::Status SaveJob(const v1::Job& j) override {
    if (refuse) return absl::ResourceExhaustedError("disk full");
    jobs[j.name()] = j;
    return absl::OkStatus();
  }
  std::vector<v1::Job> Saved() const {
    std::vector<v1::Job> out;
    for (const auto& [n, j] : jobs) out.push_back(j);
    return out;
  }
  std::map<std::string, v1::Job> jobs;
  bool refuse = false;
};

v1::CreateJobRequest Request(const std::string& id = "train") {
  v1::CreateJobRequest r;
  r.set_job_id(id);
  v1::JobSpec& s = *r.mutable_spec();
  s.mutable_model()->mutable_zoo()->set_name("gpt");
  s.set_global_batch(32);
  s.mutable_training()->set_steps(100);
  s.mutable_training()->set_checkpoint_dir(kDir);
  s.mutable_training()->set_checkpoint_every(10);
  return r;
}

class JobsTest : public ::testing::Test {
 protected:
  explicit JobsTest(int nodes = 3) : fake_(nodes) {}

  void Make(std::vector<v1::Job> jobs = {}) {
    JobControllerOptions o;
    o.backend = &fake_;
    o.now = [this] { return now_; };
    o.sink = &sink_;
    o.on_replan = [this](const v1::Job&, v1::JobEvent::Reason r) { replans_.push_back(r); };
    o.on_resumed = [this](const v1::Job&, const v1::JobEvent& e) { resumed_.push_back(e); };
    c_ = std::make_unique<JobController>(o, std::move(jobs));
  }

  v1::Job Job(const std::string& name = "jobs/train") {
    absl::StatusOr<v1::Job> j = c_->Get(name);
    EXPECT_TRUE(j.ok()) << j.status();
    return j.ok() ? *j : v1::Job();
  }
  v1::JobStatus::State State() { return Job().status().state(); }
  std::string Deployment() { return Job().status().deployment(); }

  // A job created, planned, deployed and RUNNING; returns its deployment.
  std::string StartRunning(v1::CreateJobRequest r = Request()) {
    EXPECT_OK(c_->Create(r).status());
    c_->Reconcile();
    const std::string d = Deployment();
    EXPECT_FALSE(d.empty());
    fake_.SetState(d, v1::Deployment::RUNNING);
    now_ += absl::Seconds(2);
    c_->Reconcile();
    EXPECT_EQ(State(), v1::JobStatus::RUNNING);
    return d;
  }

  void JudgeThreeNotWorthIt(const double* three);

  // A running job, calibrated, that expects 1.0 s steps, measured 1.3 s over
  // steps 23-42 and judged a plan on the same devices predicted at
  // `predicted` s; returns its deployment.
  std::string SlowdownJudged(double predicted) {
    Make();
    fake_.calibration = "calibrated";
    const std::string first = StartRunning();
    Profile(first, 2);
    Window(first, 1.0, 22);
    c_->Reconcile();
    fake_.predict = [predicted](const std::vector<std::string>&) { return predicted; };
    Window(first, 1.3, 42);
    Profile(first, 22);
    c_->Reconcile();
    return first;
  }

  // Every rank of `deployment` reported a profile of 20 steps from `first`.
  void Profile(const std::string& deployment, int64_t first) {
    v1::Deployment& d = fake_.Only(deployment);
    d.clear_rank_profiles();
    for (int r = 0; r < d.ranks_size(); ++r) {
      v1::StepProfile* p = d.add_rank_profiles();
      p->set_rank(r);
      p->set_first_step(first);
      p->set_steps(20);
    }
  }
  // Rank 0's last 20 steps ended at step `end` with median `seconds`.
  void Window(const std::string& deployment, double seconds, int64_t end) {
    v1::Deployment& d = fake_.Only(deployment);
    d.set_recent_step_seconds(seconds);
    d.set_recent_steps_end(end);
    d.set_steps_completed(end);
    d.set_median_step_seconds(seconds);
  }

  FakeBackend fake_;
  MapSink sink_;
  absl::Time now_ = absl::FromUnixSeconds(1'800'000'000);
  std::vector<v1::JobEvent::Reason> replans_;
  std::vector<v1::JobEvent> resumed_;
  std::unique_ptr<JobController> c_;
};

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
  fake_.SetState(d.name(), v1::Deployment::SUCCEEDED);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::SUCCEEDED);
  EXPECT_EQ(j.status().steps_done(), 100);
  EXPECT_EQ(sink_.jobs.at("jobs/train").status().state(), v1::JobStatus::SUCCEEDED);
  c_->Reconcile();  // final: nothing more
  EXPECT_EQ(fake_.requests.size(), 1u);
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

TEST_F(JobsTest, SecondFailureWhileRecoveringStartsTheRecoveryAgain) {
  Make();
  const std::string first = StartRunning();
  fake_.plans_finish_at_once = false;
  const absl::Time failed = now_;
  fake_.SetNode(2, v1::Node::STALE);
  c_->Reconcile();  // stops the survivors
  c_->Reconcile();  // sees them stopped; plans on d0, d1
  ASSERT_EQ(fake_.requests.size(), 2u);
  const std::string plan2 = "plans/train-p2";
  EXPECT_EQ(Job().status().next_plan(), plan2);
  // d1 goes too while that plan is made.
  fake_.SetNode(1, v1::Node::STALE);
  now_ += absl::Seconds(1);
  fake_.FinishPlan(plan2);
  c_->Reconcile();
  EXPECT_EQ(fake_.deployed.size(), 1u);  // plan2 is not deployed
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::NODE_STALE, v1::JobEvent::NODE_STALE));
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  EXPECT_THAT(fake_.requests[2].devices(), ElementsAre("d0"));
  fake_.FinishPlan("plans/train-p3");
  c_->Reconcile();
  const std::string third = Deployment();
  ASSERT_EQ(fake_.deployed.size(), 2u);
  // Its deployment fails before it runs: recovery again, on d0.
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
  EXPECT_THAT(e.devices_after(), ElementsAre("d0"));
  EXPECT_EQ(j.status().replans(), 3);
}

TEST_F(JobsTest, ReturningNodeSwitchesAtTheNextCheckpointWhenTheGainClearsTheThreshold) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  EXPECT_THAT(Job().status().devices(), ElementsAre("d0", "d1"));
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

// A switch waiting for the next checkpoint is not made when that
// checkpoint is the job's last step: nothing is left to run faster.
TEST_F(JobsTest, NoSwitchAtTheJobsFinalCheckpoint) {
  Make();
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  fake_.checkpoint = 20;
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
  c_->Reconcile();  // the join pays: waits for a checkpoint
  ASSERT_TRUE(Job().status().switch_pending());
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
  Make();
  fake_.predict = [](const std::vector<std::string>& d) { return d.size() == 3 ? 0.95 : 1.0; };
  fake_.SetNode(2, v1::Node::STALE);
  StartRunning();
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 2u);
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

// Running on d0 and d1, d2 returns and the plan on all three, predicted at
// *three s (0.95 s against 1.0 s), is judged not worth it.
void JobsTest::JudgeThreeNotWorthIt(const double* three) {
  Make();
  fake_.predict = [three](const std::vector<std::string>& d) {
    return d.size() == 3 ? *three : 1.0;
  };
  fake_.SetNode(2, v1::Node::STALE);
  StartRunning();
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
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
  Make();
  fake_.predict = [](const std::vector<std::string>& d) { return d.size() == 3 ? 0.95 : 1.0; };
  fake_.SetNode(2, v1::Node::STALE);
  const std::string first = StartRunning();
  fake_.Only(first).set_median_step_seconds(3.0);
  fake_.Only(first).set_steps_completed(25);
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 2u);
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
  StartRunning(r);
  fake_.SetNode(2, v1::Node::READY);
  c_->Reconcile();
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_THAT(Job().status().message(), HasSubstr("no periodic checkpoints"));
  EXPECT_THAT(fake_.stops, IsEmpty());
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

TEST_F(JobsTest, DeploymentStoppedOutsideTheJobIsRecovered) {
  Make();
  const std::string first = StartRunning();
  fake_.SetState(first, v1::Deployment::STOPPED);
  c_->Reconcile();
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::DEPLOYMENT_STOPPED));
  EXPECT_EQ(fake_.deployed.size(), 2u);
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

TEST_F(JobsTest, EveryStepCheckpointedBeforeTheFailureIsSuccess) {
  Make();
  const std::string first = StartRunning();
  fake_.checkpoint = 100;
  fake_.SetState(first, v1::Deployment::FAILED);
  c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::SUCCEEDED);
  EXPECT_EQ(fake_.deployed.size(), 1u);
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

TEST_F(JobsTest, ListPagesAndWatchSeesEveryChangeToTheEnd) {
  Make();
  ASSERT_OK(c_->Create(Request("a")).status());
  ASSERT_OK(c_->Create(Request("b")).status());
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

// ------------------------------------------------ calibration, slowdowns --

TEST_F(JobsTest, EveryDeploymentCalibratesOnceEveryRankReportedAProfile) {
  Make();
  const std::string first = StartRunning();
  v1::Deployment& d = fake_.Only(first);
  d.add_rank_profiles()->set_steps(20);  // one rank of three: not yet
  c_->Reconcile();
  EXPECT_THAT(fake_.calibrated, IsEmpty());
  Profile(first, 2);
  c_->Reconcile();
  c_->Reconcile();
  EXPECT_THAT(fake_.calibrated, ElementsAre(first));  // once
  EXPECT_EQ(Job().status().calibrated_deployment(), first);
  EXPECT_FALSE(Job().status().events(0).calibrated());
  // The next plan is made after it: calibrated (its prediction is the
  // calibrated model's), and a join is judged by that prediction as it is.
  fake_.calibration = "d0: deployments/x (plans/y)";
  fake_.SetState(first, v1::Deployment::FAILED);
  fake_.Only(first).add_failed_ranks(2);
  c_->Reconcile();
  const std::string second = Deployment();
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  EXPECT_TRUE(Job().status().events(1).calibrated());
  Profile(second, 2);
  c_->Reconcile();
  EXPECT_THAT(fake_.calibrated, ElementsAre(first, second));
  fake_.predict = [](const std::vector<std::string>& d) { return d.size() == 3 ? 0.6 : 1.0; };
  Window(second, 0.9, 40);
  now_ += absl::Seconds(31);
  c_->Reconcile();
  c_->Reconcile();
  const v1::Job j = Job();
  EXPECT_TRUE(j.status().switch_pending()) << j.DebugString();
  EXPECT_THAT(j.status().message(),
              HasSubstr("expected 50.0% faster (measured 0.9000 s now -> 0.6000 s predicted by "
                        "the calibrated model)"));
}

// The measured step above the expectation by more than 25% over a whole
// window after it: recalibrated once the profiles cover the slow steps, a
// plan on the same devices, a switch at the next checkpoint.
TEST_F(JobsTest, ASlowdownRecalibratesAndSwitchesToAPlanOnTheSameDevicesWhenItPays) {
  Make();
  fake_.calibration = "calibrated";
  const std::string first = StartRunning();
  Profile(first, 2);
  Window(first, 1.0, 15);  // not a whole window after warm-up: no expectation yet
  c_->Reconcile();
  EXPECT_EQ(Job().status().expected_step_seconds(), 0);
  Window(first, 1.0, 22);
  c_->Reconcile();
  EXPECT_DOUBLE_EQ(Job().status().expected_step_seconds(), 1.0);
  EXPECT_EQ(Job().status().expected_until_step(), 22);
  Window(first, 1.24, 42);  // 24%: not a slowdown
  c_->Reconcile();
  Window(first, 1.3, 30);  // 30%, but the window overlaps the expectation's
  c_->Reconcile();
  EXPECT_EQ(Job().status().slowdown_step(), 0);
  EXPECT_EQ(fake_.requests.size(), 1u);
  Window(first, 1.3, 42);
  c_->Reconcile();
  v1::Job j = Job();
  EXPECT_EQ(j.status().slowdown_step(), 22);
  EXPECT_THAT(j.status().slowdown_detail(),
              HasSubstr("the median of the last 20 steps is 1.3000 s, 30% above the 1.0000 s "
                        "expected of plans/train-p1"));
  EXPECT_EQ(fake_.requests.size(), 1u);  // the profiles predate the slow steps
  EXPECT_THAT(fake_.calibrated, ElementsAre(first));
  fake_.predict = [](const std::vector<std::string>&) { return 0.9; };
  Profile(first, 22);
  c_->Reconcile();
  EXPECT_THAT(fake_.calibrated, ElementsAre(first, first));  // recalibrated
  ASSERT_EQ(fake_.requests.size(), 2u);
  EXPECT_THAT(fake_.requests[1].devices(), ElementsAre("d0", "d1", "d2"));
  j = Job();
  EXPECT_TRUE(j.status().switch_pending()) << j.DebugString();
  EXPECT_THAT(j.status().message(), HasSubstr("expected 44.4% faster"));
  EXPECT_THAT(fake_.stops, IsEmpty());
  fake_.checkpoint = 40;
  c_->Reconcile();
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::SLOWDOWN));
  EXPECT_THAT(fake_.stops, ElementsAre(first));
  c_->Reconcile();
  const std::string second = Deployment();
  ASSERT_NE(second, first);
  EXPECT_EQ(fake_.Only(second).plan(), "plans/train-p2");
  EXPECT_EQ(fake_.Only(second).training().resume(), CheckpointStepDir(kDir, 40));
  fake_.SetState(second, v1::Deployment::RUNNING);
  c_->Reconcile();
  j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::RUNNING);
  EXPECT_EQ(j.status().replans(), 1);
  EXPECT_EQ(j.status().expected_step_seconds(), 0);  // the new deployment's, once measured
  ASSERT_EQ(j.status().events_size(), 2);
  EXPECT_EQ(j.status().events(1).reason(), v1::JobEvent::SLOWDOWN);
  EXPECT_THAT(j.status().events(1).detail(), HasSubstr("30% above"));
  EXPECT_THAT(j.status().events(1).detail(), HasSubstr("expected 44.4% faster"));
}

// The step moves past the threshold again while a slowdown's switch waits
// for its checkpoint (a throttle after noise was judged): the candidate,
// calibrated from profiles that no longer hold, is dropped and the slowdown
// judged anew from profiles after the change; the switch goes to that plan.
TEST_F(JobsTest, AStepThatChangesAgainBeforeTheSwitchIsJudgedAnew) {
  const std::string first = SlowdownJudged(0.9);
  ASSERT_EQ(fake_.requests.size(), 2u);
  v1::Job j = Job();
  ASSERT_TRUE(j.status().switch_pending()) << j.DebugString();
  EXPECT_EQ(j.status().candidate_plan(), "plans/train-p2");
  Window(first, 1.55, 50);  // 19% above the 1.3 judged: the switch stands
  c_->Reconcile();
  EXPECT_TRUE(Job().status().switch_pending());
  Window(first, 2.6, 60);  // twice the 1.3 judged: p2 no longer holds
  c_->Reconcile();
  j = Job();
  EXPECT_FALSE(j.status().switch_pending()) << j.DebugString();
  EXPECT_TRUE(j.status().candidate_plan().empty());
  EXPECT_EQ(j.status().slowdown_step(), 43);
  EXPECT_THAT(j.status().slowdown_detail(),
              HasSubstr("the median of the last 20 steps is 2.6000 s, +100% from the 1.3000 s "
                        "plans/train-p2 was judged on"));
  fake_.checkpoint = 60;  // the checkpoint p2 waited for: no switch to it
  c_->Reconcile();
  EXPECT_THAT(replans_, IsEmpty());
  EXPECT_EQ(fake_.requests.size(), 2u);  // the profiles predate the change
  fake_.predict = [](const std::vector<std::string>&) { return 1.5; };
  Profile(first, 43);
  c_->Reconcile();
  ASSERT_EQ(fake_.requests.size(), 3u);
  j = Job();
  EXPECT_EQ(j.status().candidate_plan(), "plans/train-p3");
  EXPECT_TRUE(j.status().switch_pending()) << j.DebugString();
  EXPECT_THAT(j.status().message(), HasSubstr("plans/train-p3 is expected 73.3% faster"));
  fake_.checkpoint = 80;
  c_->Reconcile();
  EXPECT_THAT(replans_, ElementsAre(v1::JobEvent::SLOWDOWN));
  c_->Reconcile();
  EXPECT_EQ(fake_.Only(Deployment()).plan(), "plans/train-p3");
}

// A re-plan that does not pay: the job stays, and what it measures now is
// what it expects from then on, so the same slow level never re-plans again
// (no flapping); only 25% beyond it does.
TEST_F(JobsTest, ASlowdownThatDoesNotPayMovesTheExpectationAndDoesNotFlap) {
  const std::string first = SlowdownJudged(1.25);
  ASSERT_EQ(fake_.requests.size(), 2u);
  v1::Job j = Job();
  EXPECT_FALSE(j.status().switch_pending());
  EXPECT_TRUE(j.status().candidate_plan().empty());
  EXPECT_THAT(j.status().message(), HasSubstr("staying"));
  EXPECT_DOUBLE_EQ(j.status().expected_step_seconds(), 1.3);
  EXPECT_EQ(j.status().expected_until_step(), 42);
  for (int64_t end : {62, 82, 102}) {
    Window(first, end == 102 ? 1.6 : 1.3, end);  // 1.6: 23% above 1.3
    Profile(first, end - 20);
    c_->Reconcile();
  }
  EXPECT_EQ(fake_.requests.size(), 2u);
  EXPECT_EQ(Job().status().slowdown_step(), 0);
  Window(first, 1.7, 122);  // 31% above 1.3
  c_->Reconcile();
  EXPECT_EQ(Job().status().slowdown_step(), 102);
  Profile(first, 102);
  c_->Reconcile();
  EXPECT_EQ(fake_.requests.size(), 3u);
  EXPECT_THAT(replans_, IsEmpty());
  EXPECT_EQ(Deployment(), first);
}

TEST_F(JobsTest, ADeviceReprobedSlowerIsASlowdown) {
  Make();
  for (int i = 0; i < 3; ++i) {
    auto* f = fake_.cluster.mutable_nodes(i)->mutable_devices(0)->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(100e9);
  }
  fake_.calibration = "calibrated";
  const std::string first = StartRunning();
  EXPECT_DOUBLE_EQ(Job().status().device_flops().at("d1"), 100e9);
  Window(first, 1.0, 30);
  fake_.cluster.mutable_nodes(1)->mutable_devices(0)->mutable_flops(0)->set_flops(85e9);
  c_->Reconcile();  // 15% less: not a slowdown
  EXPECT_EQ(Job().status().slowdown_step(), 0);
  fake_.cluster.mutable_nodes(1)->mutable_devices(0)->mutable_flops(0)->set_flops(30e9);
  c_->Reconcile();
  const v1::Job j = Job();
  EXPECT_EQ(j.status().slowdown_step(), 30);
  EXPECT_THAT(j.status().slowdown_detail(), HasSubstr("d1 re-probed at 30.0 GFLOP/s, was 100.0"));
  Profile(first, 30);
  fake_.predict = [](const std::vector<std::string>&) { return 0.5; };
  c_->Reconcile();
  EXPECT_TRUE(Job().status().switch_pending());
}

TEST_F(JobsTest, SlowdownsCountAgainstTheReplanLimit) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_max_replans(1);
  // Longer than the checkpoints below (no switch at a job's last step).
  r.mutable_spec()->mutable_training()->set_steps(1000);
  fake_.calibration = "calibrated";
  fake_.predict = [](const std::vector<std::string>&) { return 0.5; };
  std::string d = StartRunning(r);
  for (int k = 0; k < 2; ++k) {
    const int64_t base = k * 50;  // the step the deployment resumed from
    Profile(d, base + 2);
    Window(d, 1.0, base + 22);
    c_->Reconcile();
    Window(d, 2.0, base + 42);
    Profile(d, base + 22);
    c_->Reconcile();
    ASSERT_TRUE(Job().status().switch_pending()) << k;
    fake_.checkpoint = base + 50;
    c_->Reconcile();
    if (k == 1) break;
    c_->Reconcile();
    d = Deployment();
    fake_.SetState(d, v1::Deployment::RUNNING);
    c_->Reconcile();
    ASSERT_EQ(State(), v1::JobStatus::RUNNING);
  }
  const v1::Job j = Job();
  EXPECT_EQ(j.status().state(), v1::JobStatus::FAILED);
  EXPECT_THAT(j.status().message(), HasSubstr("gave up after 1 re-plans"));
  EXPECT_THAT(j.status().message(), HasSubstr("slowdown"));
}

TEST_F(JobsTest, NoSlowdownWhenDisabled) {
  Make();
  v1::CreateJobRequest r = Request();
  r.mutable_spec()->mutable_replan()->set_disable_slowdown(true);
  const std::string first = StartRunning(r);
  Profile(first, 2);
  Window(first, 1.0, 22);
  c_->Reconcile();
  Window(first, 3.0, 42);
  c_->Reconcile();
  EXPECT_EQ(Job().status().slowdown_step(), 0);
  EXPECT_EQ(fake_.requests.size(), 1u);
}

}  // namespace
}  // namespace hap::service
