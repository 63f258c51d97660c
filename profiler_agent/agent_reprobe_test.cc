// The agent against the real planner core (behind a thin gRPC
// service). A re-probe that takes longer than the planner's STALE limit
// (heartbeat_interval x missed_heartbeats) must not stop heartbeats: an
// 8-GPU node's full probe (~2 s per GPU, + links + quick checks) is longer
// than the default 15 s limit.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/planner_core.h"
#include "profiler_agent/agent.h"
#include "profiler_agent/fake_planner.h"

namespace hap::agent {
namespace {

namespace v1 = hap::v1;

// RegisterNode and Heartbeat served by a PlannerCore; records when each
// heartbeat came and whether the node was answered reprobe.
class CorePlanner final : public v1::Planner::Service {
 public:
  explicit CorePlanner(service::PlannerCore* core) : core_(core) {
    server_ = hap::agent::testing::ServeForTest(this, "127.0.0.1:0", &address_);
  }
  ~CorePlanner() override { server_->Shutdown(); }
  grpc::Status RegisterNode(grpc::ServerContext*, const v1::RegisterNodeRequest* r,
                            v1::RegisterNodeResponse* out) override {
    auto s = core_->RegisterNode(r->node());
    if (!s.ok()) return service::ToGrpc(s.status());
    *out = *s;
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* r,
                         v1::HeartbeatResponse* out) override {
    auto s = core_->Heartbeat(*r);
    if (!s.ok()) return service::ToGrpc(s.status());
    if (s->reprobe()) ++reprobes;
    *out = *s;
    return grpc::Status::OK;
  }
  grpc::Status GetProbeAssignments(grpc::ServerContext*, const v1::GetProbeAssignmentsRequest*,
                                   v1::GetProbeAssignmentsResponse*) override {
    return grpc::Status::OK;
  }
  const std::string& address() const { return address_; }
  std::atomic<int> reprobes{0};

 private:
  service::PlannerCore* core_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// One device; every probe after the first takes `slow` (a multi-GPU node);
// QuickFlops returns `quick` (the test moves it to trigger a drift probe).
class SlowProber : public DeviceProber {
 public:
  std::atomic<int> probes{0};
  std::atomic<double> quick{1e9};
  absl::Duration slow = absl::Milliseconds(700);
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions&) override {
    if (probes++ > 0) absl::SleepFor(slow);
    v1::Device d;
    d.set_id(node + "/gpu0");
    d.set_kind(v1::GPU);
    auto* f = d.add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(1e12);
    d.set_memory_bytes(int64_t{16} << 30);
    return std::vector<v1::Device>{d};
  }
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions&) override {
    return std::vector<double>{quick.load()};
  }
};

// An agent on one prober against `planner`, checking for drift every
// `drift_check_interval`.
absl::StatusOr<std::unique_ptr<Agent>> StartAgent(const std::string& planner,
                                                  const std::string& name,
                                                  absl::Duration drift_check_interval,
                                                  std::unique_ptr<DeviceProber> prober) {
  std::vector<std::unique_ptr<DeviceProber>> probers;
  probers.push_back(std::move(prober));
  AgentOptions o;
  o.planner = planner;
  o.name = name;
  o.probe.max_duration = absl::Milliseconds(100);
  o.drift = 0.2;
  o.drift_check_interval = drift_check_interval;
  o.link_probe_interval = absl::Hours(1);
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Milliseconds(40);
  o.rpc_timeout = absl::Seconds(5);
  return Agent::Start(o, std::move(probers));
}

TEST(AgentReprobeTest, OneSlowReprobeDoesNotMakeTheNodeStaleAndReprobeForever) {
  service::PlannerCoreOptions po;
  po.heartbeat_interval = absl::Milliseconds(100);
  po.missed_heartbeats = 3;  // STALE after 300 ms without a heartbeat
  auto core = service::PlannerCore::Create(po);
  ASSERT_TRUE(core.ok()) << core.status();
  CorePlanner planner(core->get());

  auto owned = std::make_unique<SlowProber>();
  SlowProber* prober = owned.get();
  auto agent = StartAgent(planner.address(), "node-a", absl::Milliseconds(50), std::move(owned));
  ASSERT_TRUE(agent.ok()) << agent.status();

  // Registered and heartbeating.
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until && (*core)->GetCluster(false).nodes_size() == 0) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ((*core)->GetCluster(false).nodes_size(), 1);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(prober->probes.load(), 1);

  // The device's speed changes once: one drift re-probe (700 ms).
  prober->quick = 0.5e9;
  absl::SleepFor(absl::Seconds(5));
  (*agent)->Shutdown(absl::ZeroDuration());
  // One re-probe is enough; the node stayed live, so the planner had no
  // reason to ask for more.
  EXPECT_LE(prober->probes.load(), 3)
      << "probes: " << prober->probes.load()
      << ", reprobes the planner asked for: " << planner.reprobes.load();
  EXPECT_EQ(planner.reprobes.load(), 0)
      << "the node went STALE while the agent probed (no heartbeats meanwhile)";
}

// QuickFlops gives 1e9, but 0.5e9 on its second call only (one check beside
// a burst of other work) and always once `changed` is set.
class OnceSlowQuickCheck : public SlowProber {
 public:
  std::atomic<int> checks{0};
  std::atomic<bool> changed{false};
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions&) override {
    const int n = checks++;
    return std::vector<double>{changed || n == 1 ? 0.5e9 : 1e9};
  }
};

// One quick check that disagrees with the baseline (another agent probing
// on the same host, a job starting) re-probed the node: on a shared host
// every minute. A drift is probed again when two checks in a row find it.
TEST(AgentReprobeTest, ADriftIsProbedAgainOnlyWhenTwoChecksInARowFindIt) {
  service::PlannerCoreOptions po;
  auto core = service::PlannerCore::Create(po);
  ASSERT_TRUE(core.ok()) << core.status();
  CorePlanner planner(core->get());
  auto owned = std::make_unique<OnceSlowQuickCheck>();
  OnceSlowQuickCheck* prober = owned.get();
  prober->slow = absl::ZeroDuration();
  auto agent = StartAgent(planner.address(), "node-b", absl::Milliseconds(20), std::move(owned));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto wait_for = [](const std::function<bool()>& done) {
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (absl::Now() < until && !done()) absl::SleepFor(absl::Milliseconds(5));
    return done();
  };
  // The baseline (check 0), the odd check (1), then checks that agree.
  ASSERT_TRUE(wait_for([&] { return prober->checks.load() >= 6; }));
  EXPECT_EQ(prober->probes.load(), 1) << "one check's drift probed the node again";
  // A lasting change: probed again, once.
  prober->changed = true;
  EXPECT_TRUE(wait_for([&] { return prober->probes.load() >= 2; }));
  const int checks = prober->checks.load();
  ASSERT_TRUE(wait_for([&] { return prober->checks.load() >= checks + 4; }));
  (*agent)->Shutdown(absl::ZeroDuration());
  EXPECT_EQ(prober->probes.load(), 2);
}

}  // namespace
}  // namespace hap::agent
