// What the deployment manager's tests share (deployment_manager_test.cc,
// deployment_manager_delete_test.cc, deployment_manager_restart_test.cc,
// deployment_manager_metrics_test.cc): a fleet of fake executors, a sink
// into a map, a two-device plan, the fixture that runs a manager over them
// (supervisor threads for real, fast polls), and stored records to start
// a manager from. Tests only.
#ifndef HAP_PLANNER_SERVICE_CORE_DEPLOYMENT_MANAGER_TEST_UTIL_H_
#define HAP_PLANNER_SERVICE_CORE_DEPLOYMENT_MANAGER_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/proto_time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/core/deployment_manager.h"

namespace hap::service::deployment_manager_testing {

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
  // Waits (up to 30 s) until every one of `addresses` was told to stop;
  // whether they were.
  bool AwaitStopped(const std::vector<std::string>& addresses) {
    absl::MutexLock l(&mu_);
    auto stopped = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const std::string& a : addresses) {
        auto it = executors_.find(a);
        if (it == executors_.end() || it->second.stops == 0) return false;
      }
      return true;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&stopped), absl::Seconds(30));
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

inline v1::Plan TwoDevicePlan() {
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

// A finished deployment of `plan` (plans/ID), generation `gen`, that ended
// at `end` (none: an older planner's record, its create_time counts).
inline v1::Deployment Finished(const std::string& plan, int64_t gen, v1::Deployment::State state,
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

// A finished deployment of `ranks` ranks as a planner stored it (final: no
// supervisor runs for it), and options whose deployments need no executors.
inline v1::Deployment StoredFinished(int ranks) {
  v1::Deployment stored;
  stored.set_name("deployments/p-g1");
  stored.set_plan("plans/p");
  stored.set_generation(1);
  stored.set_state(v1::Deployment::SUCCEEDED);
  for (int r = 0; r < ranks; ++r) stored.add_ranks()->set_rank(r);
  return stored;
}
inline DeploymentManagerOptions NoExecutors() {
  DeploymentManagerOptions o;
  o.executors = [](const v1::Deployment&) -> std::unique_ptr<DeploymentExecutors> {
    return nullptr;
  };
  return o;
}

}  // namespace hap::service::deployment_manager_testing

#endif  // HAP_PLANNER_SERVICE_CORE_DEPLOYMENT_MANAGER_TEST_UTIL_H_
