// Promises of elastic jobs (README "Elastic jobs") that a review found
// broken: each test states a behaviour the README or the headers promise. In process, no sockets:
// the job controller over the fake backend of jobs_test_util.h (or over a real PlannerCore / a real
// DeploymentManager where the bug is theirs).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/jobs.h"
#include "planner/service/core/jobs_test_util.h"
#include "planner/service/core/planner_core.h"

namespace hap::service::jobs_testing {
namespace {

// --------------------------------------------------------------------------
// 1. A job stopped while a deployment of its plan exists that the job did not
//    record (Deploy succeeded, then the save of the job failed, or the
//    planner died before that save) finishes STOPPED with that deployment
//    still training: the deployment is orphaned, its executors stay busy.
//    (Normal passes adopt such a deployment: Pass::Deploy; RunStop does not.)
TEST_F(JobsTest, StopAfterAnUnrecordedDeployStopsThatDeploymentToo) {
  Make();
  fake_.plans_finish_at_once = false;
  ASSERT_OK(c_->Create(Request()).status());
  c_->Reconcile();  // intent saved, plan train-p1 in flight
  ASSERT_EQ(Job().status().next_plan(), "plans/train-p1");
  fake_.FinishPlan("plans/train-p1");
  sink_.refuse = true;  // the disk fills up just as the job deploys
  c_->Reconcile();
  ASSERT_EQ(fake_.deployed.size(), 1u);
  const std::string orphan = fake_.deployed[0];
  EXPECT_EQ(Deployment(), "");  // not recorded: the save was refused
  fake_.SetState(orphan, v1::Deployment::RUNNING);
  sink_.refuse = false;
  ASSERT_OK(c_->Stop("jobs/train").status());
  for (int i = 0; i < 3 && State() != v1::JobStatus::STOPPED; ++i) c_->Reconcile();
  EXPECT_EQ(State(), v1::JobStatus::STOPPED);
  // The job says STOPPED: nothing of it may still train.
  EXPECT_EQ(fake_.Only(orphan).state(), v1::Deployment::STOPPED)
      << "StopJob left " << orphan << " " << v1::Deployment::State_Name(fake_.Only(orphan).state())
      << "; stops asked: " << fake_.stops.size();
}

// --------------------------------------------------------------------------
// 2. JobSpec.global_batch: "Kept across re-plans, so the data order does not
//    depend on the plan; 0 = the model's own batch". With 0 (hapctl's
//    default: the README's `hapctl create job` example passes no batch) the
//    job sends 0 with every plan and the core picks 32 x devices each time,
//    so the job trains at another global batch after every re-plan.

// The fake backend with its plans made by a real PlannerCore.
class CorePlansBackend : public FakeBackend {
 public:
  explicit CorePlansBackend(PlannerCore* core) : FakeBackend(0), core_(core) {}
  v1::Cluster Cluster() override { return core_->GetCluster(/*include_stale=*/true); }
  absl::StatusOr<v1::Plan> CreatePlan(const v1::CreatePlanRequest& r,
                                      const std::string& job) override {
    requests.push_back(r);
    return core_->CreatePlan(
        r, absl::InfiniteFuture(), [] { return false; }, job);
  }
  absl::StatusOr<v1::Plan> GetPlan(const std::string& name) override {
    return core_->GetPlan(name, /*full=*/false);
  }
  absl::Status CancelPlan(const std::string& name) override {
    return core_->CancelPlan(name).status();
  }
  absl::StatusOr<v1::Deployment> Deploy(
      const std::string& plan, const v1::TrainingConfig& training,
      const std::map<std::string, std::string>& executors) override {
    absl::StatusOr<v1::Plan> p = GetPlan(plan);
    if (!p.ok()) return p.status();
    plans[plan] = *p;
    return FakeBackend::Deploy(plan, training, executors);
  }

 private:
  PlannerCore* core_;
};

v1::Node OneCpuNode(const std::string& name) {
  v1::Node n;
  n.set_name(name);
  n.set_address("127.0.0.1:1");
  v1::Device* d = n.add_devices();
  d->set_id(name + "/cpu0");
  d->set_kind(v1::CPU);
  auto* f = d->add_flops();
  f->set_dtype(v1::FLOAT32);
  f->set_flops(1e11);
  d->set_memory_bytes(int64_t{16} << 30);
  return n;
}

v1::Plan WaitForPlan(PlannerCore& core, const std::string& name) {
  const absl::Time until = absl::Now() + absl::Seconds(120);
  while (absl::Now() < until) {
    absl::StatusOr<v1::Plan> p = core.GetPlan(name, /*full=*/false);
    if (p.ok() && (p->state() == v1::Plan::SUCCEEDED || p->state() == v1::Plan::FAILED ||
                   p->state() == v1::Plan::CANCELLED)) {
      return *p;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  ADD_FAILURE() << name << " did not finish";
  return v1::Plan();
}

TEST(ElasticJobsTest, TheGlobalBatchIsKeptAcrossReplansWhenTheSpecLeavesItZero) {
  PlannerCoreOptions co;
  co.workers = 1;
  absl::StatusOr<std::unique_ptr<PlannerCore>> made = PlannerCore::Create(co, {}, {});
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<PlannerCore> core = *std::move(made);
  for (const char* n : {"a", "b", "c"}) ASSERT_OK(core->RegisterNode(OneCpuNode(n)).status());
  CorePlansBackend backend(core.get());
  MapSink sink;
  absl::Time now = absl::Now();
  JobControllerOptions o;
  o.backend = &backend;
  o.sink = &sink;
  o.now = [&now] { return now; };
  JobController c(o);

  v1::CreateJobRequest r = Request();
  r.mutable_spec()->set_global_batch(0);  // hapctl create job without --global-batch
  v1::ZooModel& zoo = *r.mutable_spec()->mutable_model()->mutable_zoo();
  zoo.set_name("mlp");
  (*zoo.mutable_params())["layers"] = 2;
  (*zoo.mutable_params())["hidden"] = 32;
  (*zoo.mutable_params())["input"] = 16;
  ASSERT_OK(c.Create(r).status());
  c.Reconcile();
  const v1::Plan p1 = WaitForPlan(*core, "plans/train-p1");
  ASSERT_EQ(p1.state(), v1::Plan::SUCCEEDED) << p1.error();
  c.Reconcile();
  ASSERT_OK_AND_ASSIGN(v1::Job j, c.Get("jobs/train"));
  const std::string first = j.status().deployment();
  ASSERT_FALSE(first.empty()) << j.status().message();
  backend.SetState(first, v1::Deployment::RUNNING);
  now += absl::Seconds(2);
  c.Reconcile();

  // c's executor dies (its agent lives on): re-planned onto a and b.
  backend.checkpoint = 10;
  backend.SetState(first, v1::Deployment::FAILED);
  backend.Only(first).add_failed_ranks(2);
  c.Reconcile();
  const v1::Plan p2 = WaitForPlan(*core, "plans/train-p2");
  ASSERT_EQ(p2.state(), v1::Plan::SUCCEEDED) << p2.error();
  ASSERT_EQ(p2.devices_size(), 2);
  EXPECT_EQ(p2.global_batch(), p1.global_batch())
      << "the job trained at global batch " << p1.global_batch() << " on " << p1.devices_size()
      << " devices and resumes at " << p2.global_batch() << " on " << p2.devices_size()
      << " (requests' global_batch: " << backend.requests[0].global_batch() << ", "
      << backend.requests[1].global_batch() << ")";
  c.Shutdown();
  core.reset();
}

// --------------------------------------------------------------------------
// 3. A deployment the planner's database holds in a state other than
//    PENDING/RUNNING/SUCCEEDED/FAILED/STOPPED (STATE_UNSPECIFIED, or a value
//    of a later version) is loaded unvalidated: no supervisor, its
//    rendezvous open, and StopDeployment answers "the planner is shutting
//    down" for ever. A job on it can never be stopped.

// Every executor answers that it trains the deployment asked about.
class AnsweringExecutors : public DeploymentExecutors {
 public:
  explicit AnsweringExecutors(const v1::Deployment& d) : d_(d) {}
  absl::Status LoadPlan(int, const v1::LoadPlanRequest&, absl::Duration) override {
    return absl::OkStatus();
  }
  absl::Status StartTraining(int, const std::string&, absl::Duration) override {
    return absl::OkStatus();
  }
  Statuses GetStatus(absl::Duration) override { return Answer(v1::ExecutorStatus::TRAINING); }
  Statuses StopTraining(const std::string&, absl::Duration) override {
    return Answer(v1::ExecutorStatus::FAILED);
  }

 private:
  Statuses Answer(v1::ExecutorStatus::State state) {
    Statuses out;
    for (int r = 0; r < d_.ranks_size(); ++r) {
      v1::ExecutorStatus s;
      s.set_state(state);
      s.set_deployment(d_.name());
      s.set_generation(d_.generation());
      s.set_rank(r);
      out.push_back(s);
    }
    return out;
  }
  v1::Deployment d_;
};

DeploymentManagerOptions FastManager() {
  DeploymentManagerOptions o;
  o.watch.status_interval = absl::Milliseconds(20);
  o.watch.status_timeout = absl::Milliseconds(20);
  o.watch.stop_timeout = absl::Milliseconds(100);
  o.watch.stop_attempts = 1;
  o.executors = [](const v1::Deployment& d) {
    return std::unique_ptr<DeploymentExecutors>(std::make_unique<AnsweringExecutors>(d));
  };
  return o;
}

v1::Deployment StoredDeployment(const std::string& name, v1::Deployment::State state) {
  v1::Deployment d;
  d.set_name(name);
  d.set_plan("plans/train-p1");
  d.set_generation(1);
  d.set_state(state);
  for (int r = 0; r < 2; ++r) {
    auto* a = d.add_ranks();
    a->set_rank(r);
    a->set_device(absl::StrCat("d", r));
    a->set_executor_address(absl::StrCat("127.0.0.1:", 7100 + r));
  }
  return d;
}

TEST(ElasticJobsTest, ADeploymentStoredInAnUnknownStateCanBeStopped) {
  const std::string name = "deployments/train-p1-g1";
  DeploymentManager m(FastManager(), {StoredDeployment(name, v1::Deployment::STATE_UNSPECIFIED)});
  ASSERT_FALSE(m.shutting_down());
  absl::StatusOr<v1::Deployment> d =
      m.Stop(name, absl::Now() + absl::Seconds(10), [] { return false; });
  EXPECT_TRUE(d.ok()) << "a planner that is not shutting down answered: " << d.status();
  absl::StatusOr<v1::Deployment> now = m.Get(name);
  ASSERT_TRUE(now.ok());
  EXPECT_TRUE(now->state() == v1::Deployment::STOPPED || now->state() == v1::Deployment::FAILED)
      << v1::Deployment::State_Name(now->state());
  // Its rendezvous should not take keys for a deployment nobody supervises.
  EXPECT_FALSE(m.StoreSet(name, 1, "rank0", "127.0.0.1:1").ok());
}

// The job controller's view of the same: deployments from a real manager.
class ManagerBackend : public FakeBackend {
 public:
  explicit ManagerBackend(DeploymentManager* m) : FakeBackend(2), m_(m) {}
  absl::StatusOr<v1::Deployment> GetDeployment(const std::string& name) override {
    return m_->Get(name);
  }
  absl::Status StopDeployment(const std::string& name) override {
    stops.push_back(name);
    return m_->Stop(name, absl::InfinitePast(), [] { return true; }).status();
  }

 private:
  DeploymentManager* m_;
};

TEST(ElasticJobsTest, AJobOnADeploymentStoredInAnUnknownStateStops) {
  const std::string name = "deployments/train-p1-g1";
  DeploymentManager m(FastManager(),
                      {StoredDeployment(name, static_cast<v1::Deployment::State>(9))});
  ManagerBackend backend(&m);
  MapSink sink;
  v1::Job stored;
  stored.set_name("jobs/train");
  *stored.mutable_spec() = Request().spec();
  v1::JobStatus& st = *stored.mutable_status();
  st.set_state(v1::JobStatus::RUNNING);
  st.set_plan("plans/train-p1");
  st.set_deployment(name);
  st.set_generation(1);
  st.set_checkpoint_step(-1);
  st.set_switch_after_step(-1);
  st.add_devices("d0");
  st.add_devices("d1");
  JobControllerOptions o;
  o.backend = &backend;
  o.sink = &sink;
  JobController c(o, {stored});
  ASSERT_OK(c.Stop("jobs/train").status());
  const absl::Time until = absl::Now() + absl::Seconds(5);
  v1::Job j;
  do {
    c.Reconcile();
    ASSERT_OK_AND_ASSIGN(j, c.Get("jobs/train"));
    if (j.status().state() == v1::JobStatus::STOPPED) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < until);
  EXPECT_EQ(j.status().state(), v1::JobStatus::STOPPED)
      << "after " << backend.stops.size() << " stops: " << j.status().message();
  c.Shutdown();
}

// --------------------------------------------------------------------------
// 4. Deployment.recent_step_seconds, what a job's slowdown is judged by, is
//    "the slowest rank's median over its last steps". The manager keeps at
//    most max_metrics_per_deployment metrics (100,000: 25,000 steps of 4
//    ranks) and computes the window from what it kept, so past the cap the
//    window freezes on old steps: a slowdown after that is never seen.
TEST(ElasticJobsTest, TheRecentWindowFollowsTheLatestStepsPastTheMetricCap) {
  DeploymentManagerOptions o = FastManager();
  o.max_metrics_per_deployment = 50;  // 100,000 in the daemon; smaller here
  const std::string name = "deployments/train-p1-g1";
  v1::Deployment stored = StoredDeployment(name, v1::Deployment::RUNNING);
  stored.mutable_ranks()->RemoveLast();  // one rank
  DeploymentManager m(std::move(o), {stored});
  auto report = [&](int64_t from, int64_t to, double seconds) {
    std::vector<v1::StepMetric> batch;
    for (int64_t s = from; s < to; ++s) {
      v1::StepMetric x;
      x.set_deployment(name);
      x.set_rank(0);
      x.set_step(s);
      x.set_loss(1.0);
      x.set_step_seconds(seconds);
      batch.push_back(x);
    }
    ASSERT_OK(m.ReportStepMetrics(batch));
  };
  report(0, 60, 1.0);   // steady at 1 s a step, past the cap
  report(60, 80, 3.0);  // then 3x slower for 20 steps
  ASSERT_OK_AND_ASSIGN(v1::Deployment d, m.Get(name));
  EXPECT_EQ(d.recent_steps_end(), 80);
  EXPECT_DOUBLE_EQ(d.recent_step_seconds(), 3.0)
      << "the last 20 steps took 3 s each; the window says " << d.recent_step_seconds();
}

// --------------------------------------------------------------------------
// 5. A malformed job row (a name that is not jobs/{id}, or a next_plan that
//    is not plans/...) throws std::out_of_range from the reconcile pass
//    (substr(5) / substr(6)): uncaught on the controller's thread, that is
//    std::terminate, the planner dies on start. Loaded jobs are not checked.
TEST(ElasticJobsTest, AMalformedStoredJobDoesNotThrowFromTheReconcilePass) {
  FakeBackend backend(2);
  MapSink sink;
  v1::Job odd;
  odd.set_name("jobs/train");
  *odd.mutable_spec() = Request().spec();
  odd.mutable_status()->set_state(v1::JobStatus::PLANNING);
  odd.mutable_status()->set_next_plan("p1");  // not plans/{id}
  odd.mutable_status()->set_checkpoint_step(-1);
  JobControllerOptions o;
  o.backend = &backend;
  o.sink = &sink;
  JobController c(o, {odd});
  EXPECT_NO_THROW(c.Reconcile());
}

}  // namespace
}  // namespace hap::service::jobs_testing
