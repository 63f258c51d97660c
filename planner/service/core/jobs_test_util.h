// What the job controller's tests share (jobs_test.cc, jobs_recovery_test.cc,
// jobs_join_test.cc, jobs_slowdown_test.cc): a fake backend (the planner core
// and the deployment manager as the controller sees them), a sink into a map,
// a request, and the fixture with an injected clock. Tests only.
#ifndef HAP_PLANNER_SERVICE_CORE_JOBS_TEST_UTIL_H_
#define HAP_PLANNER_SERVICE_CORE_JOBS_TEST_UTIL_H_

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/core/jobs.h"

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

namespace hap::service::jobs_testing {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr char kDir[] = "/shared/ckpt";

// The planner core and the deployment manager as the controller sees them:
// plans finish at once (or when the test says), deployments change state
// when the test says, stops take effect at once (or when the test says).
class FakeBackend : public JobBackend {
 public:
  explicit FakeBackend(int nodes) {
    for (int i = 0; i < nodes; ++i) AddNode();
  }

  // Node n<i> with device d<i>, READY (i: the next index).
  void AddNode() {
    const int i = cluster.nodes_size();
    v1::Node* n = cluster.add_nodes();
    n->set_name(absl::StrCat("n", i));
    n->set_state(v1::Node::READY);
    n->add_devices()->set_id(absl::StrCat("d", i));
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
  absl::StatusOr<v1::Plan> CreatePlan(const v1::CreatePlanRequest& r,
                                      const std::string& job) override {
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
    p.set_job(job);
    // 0 = the model's own batch: 32 a device here, as the core's zoo does.
    p.set_global_batch(r.global_batch() > 0 ? r.global_batch() : 32 * r.devices_size());
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
  std::map<std::string, std::vector<std::string>> ActiveDeploymentDevices() override {
    std::map<std::string, std::vector<std::string>> out;
    for (const auto& [name, d] : deployments) {
      if (d.state() != v1::Deployment::PENDING && d.state() != v1::Deployment::RUNNING) continue;
      for (const auto& r : d.ranks()) out[name].push_back(r.device());
    }
    return out;
  }
  absl::Status StopDeployment(const std::string& name) override {
    stops.push_back(name);
    if (!stop_error.ok()) return stop_error;
    auto it = deployments.find(name);
    if (it == deployments.end()) return absl::NotFoundError(name);  // as the manager
    v1::Deployment& d = it->second;
    if (stops_take_effect &&
        (d.state() == v1::Deployment::PENDING || d.state() == v1::Deployment::RUNNING)) {
      d.set_state(v1::Deployment::STOPPED);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> LatestCheckpoint(const std::string& dir) override {
    if (dir != kDir) {  // another job's, without checkpoints
      EXPECT_EQ(other_dirs.count(dir), 1u) << dir;
      return absl::NotFoundError("none");
    }
    if (checkpoint < 0) return absl::NotFoundError("none");
    return checkpoint;
  }
  // The checkpoint set aside becomes `checkpoint_before_damaged` the latest.
  absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& step_dir) override {
    set_aside.push_back(step_dir);
    if (!set_aside_error.ok()) return set_aside_error;
    checkpoint = checkpoint_before_damaged;
    return absl::StrCat(kDir, "/damaged-", step_dir.substr(step_dir.rfind('/') + 1));
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
  absl::Status stop_error;  // what StopDeployment answers when not OK
  absl::Status deploy_error;
  std::map<std::string, std::string> deployed_executors;
  int64_t checkpoint = -1;           // the latest in kDir
  int64_t checkpoint_before_damaged = -1;
  std::vector<std::string> set_aside;  // SetAsideDamagedCheckpoint calls
  absl::Status set_aside_error;
  std::set<std::string> other_dirs;  // other jobs' checkpoint dirs
  int generation = 0;
  std::vector<std::string> calibrated;  // Calibrate calls, in order
  std::string calibration;              // Plan.calibration of the plans made
  // Predicted step time of a device set: more devices, faster.
  std::function<double(const std::vector<std::string>&)> predict =
      [](const std::vector<std::string>& d) { return 1.0 / d.size(); };
};

// Saves into a map, and every saved status message in order; refuses while
// `refuse` is set.
class MapSink : public PlannerStateSink {
 public:
  absl::Status SaveNode(const v1::Node&) override { return absl::OkStatus(); }
  absl::Status SavePlan(const v1::Plan&) override { return absl::OkStatus(); }
  absl::Status DeletePlan(const std::string&) override { return absl::OkStatus(); }
  absl::Status SaveJob(const v1::Job& j) override {
    if (refuse) return absl::ResourceExhaustedError("disk full");
    jobs[j.name()] = j;
    messages.push_back(j.status().message());
    return absl::OkStatus();
  }
  absl::Status DeleteJob(const std::string& name) override {
    if (refuse) return absl::ResourceExhaustedError("disk full");
    jobs.erase(name);
    return absl::OkStatus();
  }
  std::vector<v1::Job> Saved() const {
    std::vector<v1::Job> out;
    for (const auto& [n, j] : jobs) out.push_back(j);
    return out;
  }
  std::map<std::string, v1::Job> jobs;
  std::vector<std::string> messages;
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

  // `running`, when given, sees the first deployment before d2 returns.
  void JudgeThreeNotWorthIt(const double* three,
                            const std::function<void(const std::string& first)>& running = {},
                            const v1::CreateJobRequest& request = Request());
  // Running on d0 and d1 (at 0.5 s, as predicted), d2 returns: the plan on
  // all three is judged worth it and the switch waits for a checkpoint past
  // step 20 (jobs_join_test.cc). Returns the deployment.
  std::string SwitchPending();

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

  // `deployment` trained `steps` steps at a median step of `seconds`: the
  // job measured it (no join is judged before it has, README "Join").
  void Measured(const std::string& deployment, double seconds, int64_t steps = 20) {
    v1::Deployment& d = fake_.Only(deployment);
    d.set_median_step_seconds(seconds);
    d.set_steps_completed(steps);
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

}  // namespace hap::service::jobs_testing

#endif  // HAP_PLANNER_SERVICE_CORE_JOBS_TEST_UTIL_H_
