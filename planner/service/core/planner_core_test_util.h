// What the planner core's tests share: a clock the test moves, a sink that
// records (and refuses on demand) what the core persists, nodes, a small
// MLP request, and the fixture that starts a core over them.
#ifndef HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_TEST_UTIL_H_
#define HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_TEST_UTIL_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {
namespace testing_internal {

namespace v1 = ::hap::v1;

// A clock the test moves.
struct FakeClock {
  absl::Mutex mu;
  absl::Time t = absl::FromUnixSeconds(1'800'000'000);
  absl::Time Now() {
    absl::MutexLock l(&mu);
    return t;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock l(&mu);
    t += d;
  }
};

// Records what the core persists; refuses writes on demand, as a store on
// a full disk does.
struct RecordingSink : PlannerStateSink {
  absl::Mutex mu;
  std::map<std::string, v1::Node> nodes;
  std::map<std::string, v1::Plan> plans;
  // Plans saved in these states are refused; so is every node write while
  // refuse_nodes is set, and every save of the nodes in refuse_node_names.
  std::set<v1::Plan::State> refuse_plan_states;
  bool refuse_nodes = false;
  std::set<std::string> refuse_node_names;

  static absl::Status Full() {
    return absl::UnavailableError(
        "sqlite store '/var/lib/hap/planner.db': database or disk is full");
  }
  void RefusePlans(std::set<v1::Plan::State> states) {
    absl::MutexLock l(&mu);
    refuse_plan_states = std::move(states);
  }
  void RefuseNodes(bool refuse) {
    absl::MutexLock l(&mu);
    refuse_nodes = refuse;
  }
  // Refuses saves of node `name` only (a disk that fills part way).
  void RefuseNode(const std::string& name) {
    absl::MutexLock l(&mu);
    refuse_node_names.insert(name);
  }
  absl::Status SaveNode(const v1::Node& n) override {
    absl::MutexLock l(&mu);
    if (refuse_nodes || refuse_node_names.count(n.name())) return Full();
    nodes[n.name()] = n;
    return absl::OkStatus();
  }
  absl::Status DeleteNode(const std::string& name) override {
    absl::MutexLock l(&mu);
    if (refuse_nodes) return Full();
    nodes.erase(name);
    return absl::OkStatus();
  }
  // The next save of plan `name` signals `entered`, then waits for
  // `release` (a slow disk, to see what the core does meanwhile).
  void HoldSaveOf(const std::string& name, absl::Notification* entered,
                  absl::Notification* release) {
    absl::MutexLock l(&mu);
    hold_plan = name;
    hold_entered = entered;
    hold_release = release;
  }
  std::string hold_plan;
  absl::Notification* hold_entered = nullptr;
  absl::Notification* hold_release = nullptr;
  absl::Status SavePlan(const v1::Plan& p) override {
    absl::Notification* release = nullptr;
    {
      absl::MutexLock l(&mu);
      if (!hold_plan.empty() && p.name() == hold_plan) {
        hold_plan.clear();
        hold_entered->Notify();
        release = hold_release;
      }
    }
    if (release != nullptr) release->WaitForNotification();
    absl::MutexLock l(&mu);
    if (refuse_plan_states.count(p.state())) return Full();
    plans[p.name()] = p;
    saved_states[p.name()].push_back(p.state());
    return absl::OkStatus();
  }
  // Every state plan `name` was saved in, in order.
  std::vector<v1::Plan::State> History(const std::string& name) {
    absl::MutexLock l(&mu);
    return saved_states[name];
  }
  std::map<std::string, std::vector<v1::Plan::State>> saved_states;
  absl::Status DeletePlan(const std::string& name) override {
    absl::MutexLock l(&mu);
    if (!refuse_plan_states.empty()) return Full();
    plans.erase(name);
    return absl::OkStatus();
  }
  v1::Plan::State Stored(const std::string& plan) {
    absl::MutexLock l(&mu);
    auto it = plans.find(plan);
    return it == plans.end() ? v1::Plan::STATE_UNSPECIFIED : it->second.state();
  }
  std::vector<v1::Node> Nodes() {
    absl::MutexLock l(&mu);
    std::vector<v1::Node> out;
    for (const auto& [name, n] : nodes) out.push_back(n);
    return out;
  }
  std::vector<v1::Plan> Plans() {
    absl::MutexLock l(&mu);
    std::vector<v1::Plan> out;
    for (const auto& [name, p] : plans) out.push_back(p);
    return out;
  }
};

inline v1::Node MakeNode(const std::string& name, int devices, double flops,
                  int64_t memory = int64_t{16} << 30) {
  v1::Node n;
  n.set_name(name);
  n.set_address("127.0.0.1:1");
  for (int i = 0; i < devices; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id(name + "/cpu" + std::to_string(i));
    d->set_kind(v1::CPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(flops);
    d->set_memory_bytes(memory);
  }
  return n;
}

inline v1::CreatePlanRequest MlpRequest(bool wait = true) {
  v1::CreatePlanRequest r;
  auto* zoo = r.mutable_model()->mutable_zoo();
  zoo->set_name("mlp");
  (*zoo->mutable_params())["layers"] = 2;
  (*zoo->mutable_params())["hidden"] = 32;
  (*zoo->mutable_params())["input"] = 16;
  (*zoo->mutable_params())["batch"] = 16;
  r.set_wait(wait);
  return r;
}

// A search that takes seconds (about 7 s on 2 cores): long enough to act
// on while it runs.
inline v1::CreatePlanRequest LongSearch(const std::string& id) {
  v1::CreatePlanRequest r;
  r.set_plan_id(id);
  r.mutable_model()->mutable_zoo()->set_name("gpt");
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 96;
  r.mutable_options()->mutable_budget()->set_max_seconds(120);
  r.mutable_options()->set_ignore_memory_limits(true);
  return r;
}

class PlannerCoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}, {}); }
  void Start(std::vector<v1::Node> nodes, std::vector<v1::Plan> plans) {
    core_.reset();
    PlannerCoreOptions o;
    o.now = [this] { return clock_.Now(); };
    o.heartbeat_interval = absl::Seconds(5);
    o.missed_heartbeats = 3;
    o.node_expiry = node_expiry_;
    o.sink = &sink_;
    o.workers = workers_;
    o.plan_retention_count = retention_count_;
    o.plan_retention_age = retention_age_;
    o.plans_in_use = plans_in_use_;
    o.load_plan = load_plan_;
    auto c = PlannerCore::Create(o, std::move(nodes), std::move(plans));
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = *std::move(c);
  }
  absl::Time Deadline() { return clock_.Now() + absl::Seconds(60); }

  FakeClock clock_;
  absl::Duration node_expiry_ = absl::InfiniteDuration();
  int workers_ = 1;
  int retention_count_ = 1000;
  absl::Duration retention_age_ = absl::Hours(24 * 7);
  std::function<absl::StatusOr<std::set<std::string>>()> plans_in_use_;
  std::function<absl::StatusOr<v1::Plan>(const std::string&)> load_plan_;
  RecordingSink sink_;
  std::unique_ptr<PlannerCore> core_;
};

}  // namespace testing_internal
}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_TEST_UTIL_H_
