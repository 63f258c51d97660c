// DeploymentManager in process against a fleet of fake executors (no gRPC,
// supervisor threads for real, fast polls): deploy and validation, every
// rank stopped when one fails or on StopDeployment, idempotent stops of a
// FAILED deployment, re-attaching after a restart, step metrics and the
// rendezvous store. Waits are on conditions with deadlines, never sleeps.
#include "planner/service/core/deployment_manager.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/proto_time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/core/pagination.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Executors by address, as state machines; thread-safe. An unreachable one
// fails every call (a dead or frozen process).
class Fleet {
 public:
  struct Executor {
    v1::ExecutorStatus status;
    bool reachable = true;
    int stops = 0;
  };

  void Add(const std::string& address) {
    absl::MutexLock l(&mu_);
    executors_[address].status.set_state(v1::ExecutorStatus::IDLE);
  }
  void SetReachable(const std::string& address, bool reachable) {
    absl::MutexLock l(&mu_);
    executors_[address].reachable = reachable;
  }
  void Set(const std::string& address, v1::ExecutorStatus::State state,
           const std::string& error = "") {
    absl::MutexLock l(&mu_);
    executors_[address].status.set_state(state);
    executors_[address].status.set_error(error);
  }
  v1::ExecutorStatus status(const std::string& address) {
    absl::MutexLock l(&mu_);
    return executors_[address].status;
  }
  int stops(const std::string& address) {
    absl::MutexLock l(&mu_);
    return executors_[address].stops;
  }
  // While held, StopTraining calls wait in AwaitStopsReleased: a stop
  // still under way (executors slow to answer).
  void HoldStops(bool hold) {
    absl::MutexLock l(&mu_);
    hold_stops_ = hold;
  }
  void AwaitStopsReleased() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* hold) { return !*hold; }, &hold_stops_));
  }

  absl::StatusOr<v1::ExecutorStatus> Call(const std::string& address,
                                          const std::function<absl::Status(Executor&)>& fn) {
    absl::MutexLock l(&mu_);
    auto it = executors_.find(address);
    if (it == executors_.end() || !it->second.reachable) {
      return absl::UnavailableError(absl::StrCat(address, ": connection refused"));
    }
    absl::Status s = fn(it->second);
    if (!s.ok()) return s;
    return it->second.status;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, Executor> executors_ ABSL_GUARDED_BY(mu_);
  bool hold_stops_ ABSL_GUARDED_BY(mu_) = false;
};

class FleetExecutors : public DeploymentExecutors {
 public:
  FleetExecutors(Fleet* fleet, const v1::Deployment& d) : fleet_(fleet) {
    for (const auto& a : d.ranks()) addresses_.push_back(a.executor_address());
  }
  absl::Status LoadPlan(int rank, const v1::LoadPlanRequest& r, absl::Duration) override {
    return fleet_
        ->Call(addresses_[rank],
               [&](Fleet::Executor& x) {
                 if (x.status.state() == v1::ExecutorStatus::TRAINING) {
                   return absl::FailedPreconditionError(absl::StrCat(
                       "training ", x.status.deployment(), "; stop it before loading another"));
                 }
                 x.status.set_state(v1::ExecutorStatus::LOADED);
                 x.status.set_deployment(r.deployment());
                 x.status.set_generation(r.generation());
                 x.status.set_rank(r.rank());
                 x.status.clear_error();
                 return absl::OkStatus();
               })
        .status();
  }
  absl::Status StartTraining(int rank, const std::string&, absl::Duration) override {
    return fleet_
        ->Call(addresses_[rank],
               [](Fleet::Executor& x) {
                 x.status.set_state(v1::ExecutorStatus::TRAINING);
                 return absl::OkStatus();
               })
        .status();
  }
  Statuses GetStatus(absl::Duration) override {
    Statuses out;
    for (const auto& a : addresses_) {
      out.push_back(fleet_->Call(a, [](Fleet::Executor&) { return absl::OkStatus(); }));
    }
    return out;
  }
  Statuses StopTraining(const std::string& deployment, absl::Duration) override {
    fleet_->AwaitStopsReleased();
    Statuses out;
    for (const auto& a : addresses_) {
      out.push_back(fleet_->Call(a, [&](Fleet::Executor& x) {
        ++x.stops;
        if (!x.status.deployment().empty() && x.status.deployment() != deployment) {
          return absl::NotFoundError("holds another deployment");
        }
        if (x.status.state() == v1::ExecutorStatus::TRAINING) {
          x.status.set_state(v1::ExecutorStatus::FAILED);
          x.status.set_error("stopped by StopTraining");
        }
        return absl::OkStatus();
      }));
    }
    return out;
  }

 private:
  Fleet* fleet_;
  std::vector<std::string> addresses_;
};

// Keeps what the manager saves; refuses deployments while told to, and the
// step metrics of the deployments named (a full disk).
class Sink : public PlannerStateSink {
 public:
  absl::Status SaveNode(const v1::Node&) override { return absl::OkStatus(); }
  absl::Status SavePlan(const v1::Plan&) override { return absl::OkStatus(); }
  absl::Status DeletePlan(const std::string&) override { return absl::OkStatus(); }
  absl::Status SaveDeployment(const v1::Deployment& d) override {
    absl::MutexLock l(&mu_);
    if (refuse_ || refuse_states_.count(d.state())) {
      return absl::UnavailableError("sqlite store 'planner.db': database or disk is full");
    }
    deployments_[d.name()] = d;
    int64_t& last = generations_[d.plan()];
    last = std::max(last, d.generation());
    return absl::OkStatus();
  }
  // As the store: the highest generation ever saved, deleted ones included.
  absl::StatusOr<int64_t> LastDeploymentGeneration(const std::string& plan) override {
    absl::MutexLock l(&mu_);
    auto it = generations_.find(plan);
    return it == generations_.end() ? 0 : it->second;
  }
  void Refuse(bool refuse) {
    absl::MutexLock l(&mu_);
    refuse_ = refuse;
  }
  absl::Status DeleteDeployment(const std::string& name) override {
    absl::MutexLock l(&mu_);
    if (refuse_) {
      return absl::UnavailableError("sqlite store 'planner.db': database or disk is full");
    }
    deployments_.erase(name);
    metrics_.erase(name);
    deleted_.push_back(name);
    return absl::OkStatus();
  }
  std::vector<std::string> deleted() {
    absl::MutexLock l(&mu_);
    return deleted_;
  }
  // Refuses saves of deployments in these states only.
  void RefuseStates(std::set<v1::Deployment::State> states) {
    absl::MutexLock l(&mu_);
    refuse_states_ = std::move(states);
  }
  // Waits (at most 30 s) until the stored `name` is in `state`.
  bool AwaitStored(const std::string& name, v1::Deployment::State state) {
    absl::MutexLock l(&mu_);
    auto stored = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      auto it = deployments_.find(name);
      return it != deployments_.end() && it->second.state() == state;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&stored), absl::Seconds(30));
  }
  // As the daemon's store does (sqlite_backend.cc): one deployment's
  // metrics at a time, all or none, stopping at the first refused.
  absl::Status AppendStepMetrics(const std::vector<v1::StepMetric>& batch) override {
    std::map<std::string, std::vector<v1::StepMetric>> by_deployment;
    for (const auto& m : batch) by_deployment[m.deployment()].push_back(m);
    absl::MutexLock l(&mu_);
    for (const auto& [name, metrics] : by_deployment) {
      if (refuse_metrics_of_.count(name)) {
        return absl::UnavailableError("sqlite store 'planner.db': database or disk is full");
      }
      for (const auto& m : metrics) metrics_[name].push_back(m);
    }
    return absl::OkStatus();
  }
  void RefuseMetricsOf(const std::string& deployment) {
    absl::MutexLock l(&mu_);
    refuse_metrics_of_.insert(deployment);
  }
  size_t metrics(const std::string& deployment) {
    absl::MutexLock l(&mu_);
    return metrics_[deployment].size();
  }
  v1::Deployment deployment(const std::string& name) {
    absl::MutexLock l(&mu_);
    return deployments_[name];
  }
  std::vector<v1::Deployment> deployments() {
    absl::MutexLock l(&mu_);
    std::vector<v1::Deployment> out;
    for (const auto& [name, d] : deployments_) out.push_back(d);
    return out;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, v1::Deployment> deployments_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> generations_ ABSL_GUARDED_BY(mu_);  // plan -> highest
  bool refuse_ ABSL_GUARDED_BY(mu_) = false;
  std::set<v1::Deployment::State> refuse_states_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> deleted_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<v1::StepMetric>> metrics_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> refuse_metrics_of_ ABSL_GUARDED_BY(mu_);
};

v1::Plan TwoDevicePlan() {
  v1::Plan p;
  p.set_name("plans/p");
  p.set_state(v1::Plan::SUCCEEDED);
  p.add_devices("a/cpu0");
  p.add_devices("b/cpu0");
  return p;
}

class DeploymentManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fleet_.Add("a:1");
    fleet_.Add("b:1");
    Start({});
  }
  void TearDown() override {
    fleet_.HoldStops(false);  // a test that failed holding them
    manager_.reset();
  }

  void Start(std::vector<v1::Deployment> deployments) {
    manager_.reset();
    DeploymentManagerOptions o;
    o.watch.status_interval = absl::Milliseconds(20);
    o.watch.status_timeout = absl::Milliseconds(20);
    o.watch.missed_status_limit = 3;
    o.watch.stop_attempts = 2;
    o.sink = &sink_;
    o.executors = [this](const v1::Deployment& d) {
      return std::make_unique<FleetExecutors>(&fleet_, d);
    };
    o.on_change = [this](const v1::Deployment& d) {
      absl::MutexLock l(&mu_);
      seen_[d.name()] = d;
    };
    o.on_finished = [this](const v1::Deployment& d) {
      absl::MutexLock l(&mu_);
      finished_.push_back(d.name() + " " + v1::Deployment::State_Name(d.state()));
    };
    manager_ = std::make_unique<DeploymentManager>(std::move(o), std::move(deployments));
  }
  v1::DeployPlanRequest Request() {
    v1::DeployPlanRequest r;
    r.set_plan("plans/p");
    (*r.mutable_executors())["a/cpu0"] = "a:1";
    (*r.mutable_executors())["b/cpu0"] = "b:1";
    r.mutable_training()->set_steps(1000);
    return r;
  }
  v1::Deployment WaitFor(const std::string& name, v1::Deployment::State state) {
    absl::MutexLock l(&mu_);
    auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return seen_.count(name) && seen_[name].state() == state;
    };
    EXPECT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(30)))
        << name << " never " << v1::Deployment::State_Name(state) << ": "
        << seen_[name].DebugString();
    return seen_[name];
  }
  // A deployment run, then the manager restarted on its record stored in
  // `state`: the record once the restarted manager has failed it.
  v1::Deployment FailedOnRestartFrom(v1::Deployment::State state) {
    auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
    EXPECT_THAT(d, IsOk());
    if (!d.ok()) return v1::Deployment();
    WaitFor(d->name(), v1::Deployment::RUNNING);
    manager_->Shutdown();
    std::vector<v1::Deployment> stored = sink_.deployments();
    EXPECT_EQ(stored.size(), 1u);
    for (v1::Deployment& x : stored) x.set_state(state);
    Start(stored);
    return WaitFor(d->name(), v1::Deployment::FAILED);
  }

  Fleet fleet_;
  Sink sink_;
  absl::Mutex mu_;
  std::map<std::string, v1::Deployment> seen_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> finished_ ABSL_GUARDED_BY(mu_);  // on_finished calls
  std::unique_ptr<DeploymentManager> manager_;
};

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

// A finished deployment of `plan` (plans/ID), generation `gen`, that ended
// at `end` (none: an older planner's record, its create_time counts).
v1::Deployment Finished(const std::string& plan, int64_t gen, v1::Deployment::State state,
                        std::optional<absl::Time> end, absl::Time create) {
  v1::Deployment d;
  d.set_name(absl::StrCat("deployments/", plan, "-g", gen));
  d.set_plan("plans/" + plan);
  d.set_generation(gen);
  d.set_state(state);
  *d.mutable_create_time() = ToProto(create);
  if (end) *d.mutable_end_time() = ToProto(*end);
  return d;
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

// The slowest rank's median over its last 20 steps is what a job's
// slowdown is judged by, while rank 0's whole-run median moves slowly.
TEST_F(DeploymentManagerTest, TheRecentWindowIsRankZerosLastTwentySteps) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  std::vector<v1::StepMetric> batch;
  for (int step = 0; step < 60; ++step) {
    for (int rank : {0, 1}) {
      v1::StepMetric m;
      m.set_deployment(d->name());
      m.set_rank(rank);
      m.set_step(step);
      m.set_step_seconds(rank == 1 ? (step < 50 ? 0.5 : 3.0) : step < 35 ? 1.0 : 2.0);
      batch.push_back(m);
    }
  }
  ASSERT_THAT(manager_->ReportStepMetrics(batch), IsOk());
  const v1::Deployment now = *manager_->Get(d->name());
  EXPECT_DOUBLE_EQ(now.recent_step_seconds(), 3.0);  // rank 1: 10 of its last 20 at 3 s
  EXPECT_EQ(now.recent_steps_end(), 60);
  EXPECT_DOUBLE_EQ(now.median_step_seconds(), 1.0);
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
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while ((fleet_.stops("a:1") == 0 || fleet_.stops("b:1") == 0) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
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

// A finished deployment of `ranks` ranks as a planner stored it (final: no
// supervisor runs for it), and options whose deployments need no executors.
v1::Deployment StoredFinished(int ranks) {
  v1::Deployment stored;
  stored.set_name("deployments/p-g1");
  stored.set_plan("plans/p");
  stored.set_generation(1);
  stored.set_state(v1::Deployment::SUCCEEDED);
  for (int r = 0; r < ranks; ++r) stored.add_ranks()->set_rank(r);
  return stored;
}
DeploymentManagerOptions NoExecutors() {
  DeploymentManagerOptions o;
  o.executors = [](const v1::Deployment&) -> std::unique_ptr<DeploymentExecutors> {
    return nullptr;
  };
  return o;
}

// median_step_seconds is rank 0's upper median over the metrics kept (the
// first max_metrics_per_deployment, metrics loaded at start included), as
// when it was recomputed over all of them for each metric; past the cap it
// stays, while the recent window follows the latest steps.
TEST(DeploymentManagerMetricsTest, TheMedianStepIsOverRankZerosMetricsKept) {
  v1::Deployment stored = StoredFinished(2);
  auto metric = [&](int rank, int64_t step, double seconds) {
    v1::StepMetric m;
    m.set_deployment(stored.name());
    m.set_rank(rank);
    m.set_step(step);
    m.set_step_seconds(seconds);
    return m;
  };
  auto upper_median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  // Step times with repeats, out of order, in batches of varying size.
  std::vector<double> kept;  // rank 0's, as kept
  std::vector<v1::StepMetric> loaded;
  int64_t step = 0;
  for (; step < 7; ++step) {
    loaded.push_back(metric(0, step, 1.0 + (step * 7 % 5) * 0.25));
    kept.push_back(loaded.back().step_seconds());
    loaded.push_back(metric(1, step, 0.5));
  }
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 200;
  DeploymentManager m(std::move(o), {stored}, loaded);
  size_t count = loaded.size();
  for (int batch = 1; step < 150; ++batch) {
    std::vector<v1::StepMetric> b;
    for (int i = 0; i < batch % 4 + 1 && step < 150; ++i, ++step) {
      const double seconds = 0.5 + ((step * 37) % 23) * 0.125;
      b.push_back(metric(0, step, seconds));
      b.push_back(metric(1, step, 0.25));
      for (int rank : {0, 1}) {
        if (count++ < 200 && rank == 0) kept.push_back(seconds);
      }
    }
    ASSERT_THAT(m.ReportStepMetrics(b), IsOk());
    const v1::Deployment d = *m.Get(stored.name());
    ASSERT_DOUBLE_EQ(d.median_step_seconds(), upper_median(kept)) << "at step " << step;
  }
  EXPECT_EQ(kept.size(), 100u);  // 200 metrics kept, half of them rank 0's
  EXPECT_EQ(m.StepMetrics(stored.name())->size(), 200u);
  std::vector<double> last;
  for (int64_t s = 130; s < 150; ++s) last.push_back(0.5 + ((s * 37) % 23) * 0.125);
  EXPECT_DOUBLE_EQ(m.Get(stored.name())->recent_step_seconds(), upper_median(last));
}

// Metrics loaded at start are kept up to the same cap as reported ones
// (all of a long run's were kept in memory after a restart), and the
// statistics follow all of them.
TEST(DeploymentManagerMetricsTest, MetricsLoadedAtStartAreKeptUpToTheCap) {
  v1::Deployment stored = StoredFinished(1);
  std::vector<v1::StepMetric> loaded;
  for (int64_t step = 0; step < 50; ++step) {
    v1::StepMetric m;
    m.set_deployment(stored.name());
    m.set_step(step);
    m.set_step_seconds(step < 10 ? 1.0 : 3.0);
    loaded.push_back(m);
  }
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 10;
  DeploymentManager m(std::move(o), {stored}, loaded);
  auto kept = m.StepMetrics(stored.name());
  ASSERT_THAT(kept, IsOk());
  ASSERT_EQ(kept->size(), 10u);
  EXPECT_EQ(kept->back().step(), 9);
  // One more step: the median is over the 10 kept, the recent window over
  // the latest 20 steps, loaded ones included.
  v1::StepMetric next = loaded.back();
  next.set_step(50);
  ASSERT_THAT(m.ReportStepMetrics({next}), IsOk());
  const v1::Deployment d = *m.Get(stored.name());
  EXPECT_DOUBLE_EQ(d.median_step_seconds(), 1.0);
  EXPECT_DOUBLE_EQ(d.recent_step_seconds(), 3.0);
  EXPECT_EQ(m.StepMetrics(stored.name())->size(), 10u);
}

// A metric reported again for the same (rank, step), e.g. by a client that
// retries a report that did arrive, replaces the earlier one, as the store
// replaces its row: served once, counted once in the median and the recent
// window, and the latest loss is the new one. Steps reported out of order
// and around a gap are told apart from repeats.
TEST(DeploymentManagerMetricsTest, AMetricReportedAgainReplacesTheEarlierOne) {
  v1::Deployment stored = StoredFinished(2);
  auto metric = [&](int rank, int64_t step, double seconds, double loss) {
    v1::StepMetric m;
    m.set_deployment(stored.name());
    m.set_rank(rank);
    m.set_step(step);
    m.set_step_seconds(seconds);
    m.set_loss(loss);
    return m;
  };
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 6;
  DeploymentManager m(std::move(o), {stored}, {metric(0, 0, 1.0, 5.0)});
  // Rank 0: steps 0 (loaded), 2, 1, 4 (a gap at 3), then 0 and 2 again;
  // rank 1: step 0 twice in one batch.
  ASSERT_THAT(
      m.ReportStepMetrics({metric(0, 2, 1.0, 4.0), metric(0, 1, 1.0, 4.5), metric(1, 0, 9.0, 0),
                           metric(1, 0, 9.0, 0), metric(0, 4, 1.0, 3.0)}),
      IsOk());
  ASSERT_THAT(
      m.ReportStepMetrics({metric(0, 0, 7.0, 6.0), metric(0, 2, 7.0, 6.0), metric(0, 4, 7.0, 2.5)}),
      IsOk());
  auto kept = m.StepMetrics(stored.name());
  ASSERT_THAT(kept, IsOk());
  std::vector<std::pair<int, int64_t>> keys;
  for (const v1::StepMetric& k : *kept) keys.emplace_back(k.rank(), k.step());
  EXPECT_THAT(keys,
              ::testing::ElementsAre(std::pair<int, int64_t>{0, 0}, std::pair<int, int64_t>{0, 2},
                                     std::pair<int, int64_t>{0, 1}, std::pair<int, int64_t>{1, 0},
                                     std::pair<int, int64_t>{0, 4}));
  EXPECT_DOUBLE_EQ((*kept)[0].step_seconds(), 7.0);  // replaced
  EXPECT_DOUBLE_EQ((*kept)[1].step_seconds(), 7.0);
  // Counted once: rank 0's median over its first reports (1, 1, 1, 1).
  v1::Deployment d = *m.Get(stored.name());
  EXPECT_DOUBLE_EQ(d.median_step_seconds(), 1.0);
  EXPECT_EQ(d.steps_completed(), 5);
  EXPECT_DOUBLE_EQ(d.last_loss(), 2.5);
  // Step 3 fills the gap: new, not a repeat.
  ASSERT_THAT(m.ReportStepMetrics({metric(0, 3, 1.0, 3.5)}), IsOk());
  EXPECT_EQ(m.StepMetrics(stored.name())->size(), 6u);
  d = *m.Get(stored.name());
  EXPECT_DOUBLE_EQ(d.last_loss(), 2.5);  // step 4's stays the latest
  // Rank 1's window holds one 9 s step, not two.
  ASSERT_THAT(m.ReportStepMetrics({metric(1, 1, 1.0, 0), metric(1, 2, 1.0, 0)}), IsOk());
  EXPECT_DOUBLE_EQ(m.Get(stored.name())->recent_step_seconds(), 1.0);
}

// A deployment's summary of its metrics (steps completed, last loss, the
// medians) is kept in memory as metrics arrive, not saved with every one:
// after a restart it is recomputed from the metrics loaded, also past the
// cap (before, a restarted planner showed the steps and loss of the
// deployment's last saved state change until its next metric).
TEST(DeploymentManagerMetricsTest, ARestartRecomputesStepsCompletedAndLastLossFromStoredMetrics) {
  v1::Deployment stored = StoredFinished(2);
  stored.set_steps_completed(0);  // as saved when it started
  std::vector<v1::StepMetric> loaded;
  for (int64_t step = 0; step < 50; ++step) {
    for (int rank : {1, 0}) {
      v1::StepMetric m;
      m.set_deployment(stored.name());
      m.set_rank(rank);
      m.set_step(step);
      m.set_loss(10.0 - step * 0.1 + rank);
      m.set_step_seconds(step < 10 ? 1.0 : 3.0);
      loaded.push_back(m);
    }
  }
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 10;  // steps 0-4 kept, the rest past the cap
  DeploymentManager m(std::move(o), {stored}, loaded);
  const v1::Deployment d = *m.Get(stored.name());
  EXPECT_EQ(d.steps_completed(), 50);
  EXPECT_DOUBLE_EQ(d.last_loss(), 10.0 - 49 * 0.1);  // rank 0's at step 49
  EXPECT_DOUBLE_EQ(d.median_step_seconds(), 1.0);    // over the kept
  EXPECT_DOUBLE_EQ(d.recent_step_seconds(), 3.0);    // the latest steps
  EXPECT_EQ(d.recent_steps_end(), 50);
}

// A misbehaving executor's metrics are refused whole, naming the field and
// value: a step past the deployment's last (INT64_MAX overflowed the steps
// completed), a NaN, infinite or negative time or a NaN loss (they poisoned
// the medians a job's slowdown is judged by).
TEST_F(DeploymentManagerTest, StepMetricsOutsideTheDeploymentOrNotFiniteAreRefused) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  auto metric = [&](int64_t step, double seconds) {
    v1::StepMetric m;
    m.set_deployment(d->name());
    m.set_step(step);
    m.set_loss(2.5);
    m.set_step_seconds(seconds);
    return m;
  };
  ASSERT_THAT(manager_->ReportStepMetrics({metric(0, 1.0), metric(999, 1.0)}), IsOk());
  for (int64_t step : {int64_t{1000}, std::numeric_limits<int64_t>::max()}) {
    EXPECT_THAT(manager_->ReportStepMetrics({metric(1, 1.0), metric(step, 1.0)}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("step ", step,
                                                " outside the deployment (ranks "
                                                "0 to 1, steps 0 to 999)"))));
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double seconds : {nan, inf, -1.0}) {
    EXPECT_THAT(manager_->ReportStepMetrics({metric(2, seconds)}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("rank 0 step 2: step_seconds is ", seconds,
                                                ", not a finite time of 0 or more"))));
  }
  v1::StepMetric bad = metric(2, 1.0);
  bad.set_loss(nan);
  EXPECT_THAT(manager_->ReportStepMetrics({bad}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss is nan, not finite")));
  bad = metric(2, 1.0);
  bad.set_communication_seconds(-inf);
  EXPECT_THAT(
      manager_->ReportStepMetrics({bad}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("communication_seconds is -inf")));
  // A batch past the bound per call (400,000 fit in a 16 MiB request, each
  // checked, saved and kept under the manager's lock) is refused whole.
  std::vector<v1::StepMetric> huge(DeploymentManager::kMaxStepMetricsPerReport + 1, metric(3, 1.0));
  EXPECT_THAT(manager_->ReportStepMetrics(huge),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("at most 4096 step metrics, got 4097")));
  // Nothing of the refused batches was taken.
  const v1::Deployment now = *manager_->Get(d->name());
  EXPECT_EQ(now.steps_completed(), 1000);
  EXPECT_DOUBLE_EQ(now.median_step_seconds(), 1.0);
  EXPECT_DOUBLE_EQ(now.recent_step_seconds(), 1.0);
  EXPECT_EQ(manager_->StepMetrics(d->name())->size(), 2u);
}

// A batch over two deployments whose store takes the first and refuses the
// second fails naming it, and each deployment's metrics are served as the
// store holds them (a restart neither brings back metrics the call did not
// take nor loses some it did).
TEST_F(DeploymentManagerTest, StepMetricsTheStoreRefusesPartWayAreServedAsStored) {
  std::vector<v1::Deployment> stored;
  for (const char* name : {"deployments/p-g1", "deployments/q-g1"}) {
    v1::Deployment d;
    d.set_name(name);
    d.set_plan("plans/p");
    d.set_state(v1::Deployment::SUCCEEDED);
    d.add_ranks()->set_device("a/cpu0");
    d.mutable_training()->set_steps(100);
    stored.push_back(d);
  }
  Start(stored);
  sink_.RefuseMetricsOf("deployments/q-g1");
  std::vector<v1::StepMetric> batch(2);
  batch[0].set_deployment("deployments/p-g1");
  batch[1].set_deployment("deployments/q-g1");
  EXPECT_THAT(manager_->ReportStepMetrics(batch),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("step metrics not saved (deployments/q-g1)"),
                             HasSubstr("disk is full"))));
  for (const char* name : {"deployments/p-g1", "deployments/q-g1"}) {
    EXPECT_EQ(manager_->StepMetrics(name)->size(), sink_.metrics(name)) << name;
    EXPECT_EQ(manager_->Get(name)->steps_completed(), sink_.metrics(name)) << name;
  }
}

// A ListStepMetrics token is good for the deployment that returned it:
// one of another deployment was taken as a position in this one's metrics
// and silently skipped them.
TEST_F(DeploymentManagerTest, AStepMetricsTokenOfAnotherDeploymentIsRefused) {
  std::vector<std::string> names;
  for (int i = 0; i < 2; ++i) {
    auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
    ASSERT_THAT(d, IsOk());
    names.push_back(d->name());
    std::vector<v1::StepMetric> metrics;
    for (int step = 0; step < 3; ++step) {
      v1::StepMetric m;
      m.set_deployment(d->name());
      m.set_step(step);
      metrics.push_back(m);
    }
    ASSERT_THAT(manager_->ReportStepMetrics(metrics), IsOk());
  }
  auto first = manager_->ListStepMetrics(names[0], 1, "");
  ASSERT_THAT(first, IsOk());
  ASSERT_FALSE(first->next_page_token().empty());
  EXPECT_THAT(manager_->ListStepMetrics(names[1], 1, first->next_page_token()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("page_token"), HasSubstr(names[1]))));
  std::vector<int64_t> steps;
  std::string token;
  do {
    auto page = manager_->ListStepMetrics(names[0], 1, token);
    ASSERT_THAT(page, IsOk());
    for (const auto& m : page->metrics()) steps.push_back(m.step());
    token = page->next_page_token();
  } while (!token.empty());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2}));
}

TEST_F(DeploymentManagerTest, StepMetricsAndTheRendezvousStoreBelongToADeployment) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  v1::StepMetric m;
  m.set_deployment(d->name());
  m.set_rank(0);
  m.set_step(4);
  m.set_loss(2.5);
  ASSERT_THAT(manager_->ReportStepMetrics({m}), IsOk());
  EXPECT_EQ(manager_->Get(d->name())->steps_completed(), 5);
  m.set_rank(2);
  EXPECT_THAT(manager_->ReportStepMetrics({m}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 and step 4")));
  const std::string list = absl::StrCat("step metrics of ", d->name());
  for (const char* token : {"-3", "1"}) {  // not a token of the list
    EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, token),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  }
  EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, PageTokenAfter(list, "-3")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  // A position past the metrics was not returned (INT64_MAX + page_size
  // overflowed).
  for (const char* position : {"2", "9223372036854775807"}) {
    EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, PageTokenAfter(list, position)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("page_token (position ", position,
                                                ") is not a token this server returned (",
                                                d->name(), " has 1 step metrics)"))));
  }
  EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, PageTokenAfter(list, "1")), IsOk());
  auto page = manager_->ListStepMetrics(d->name(), 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->metrics_size(), 1);

  ASSERT_THAT(manager_->StoreSet(d->name(), 1, "k", "v"), IsOk());
  EXPECT_THAT(manager_->StoreSet("deployments/ghost-g1", 1, "k", "v"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("ghost")));
  EXPECT_THAT(manager_->StoreGet(d->name(), 1, {"k"}, absl::InfiniteFuture(),
                                 [] { return false; }),
              IsOk());
  EXPECT_THAT(manager_->StoreGet(d->name(), 1, {"k", "missing"}, absl::InfinitePast(),
                                 [] { return false; }),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing")));
  EXPECT_THAT(manager_->StoreAdd(d->name(), 1, "n", 2), IsOk());
  EXPECT_THAT(manager_->StoreAdd(d->name(), 1, "k", 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a counter")));
  EXPECT_EQ(manager_->rendezvous_keys(), 2);

  // A finished deployment's keys are dropped and its rendezvous closed.
  WaitFor(d->name(), v1::Deployment::RUNNING);
  ASSERT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }), IsOk());
  EXPECT_EQ(manager_->rendezvous_keys(), 0);
  EXPECT_THAT(manager_->StoreSet(d->name(), 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("STOPPED")));
  EXPECT_THAT(manager_->StoreGet(d->name(), 1, {"k"}, absl::InfiniteFuture(),
                                 [] { return false; }),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rendezvous is closed")));
  EXPECT_EQ(manager_->rendezvous_keys(), 0);
}

}  // namespace
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

}  // namespace hap::service
