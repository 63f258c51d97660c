// What the agent's tests share (agent_test.cc, agent_links_test.cc): a
// prober whose FLOP/s the test sets, fake executors, and a fixture with a
// fake planner that starts agents on it.
#ifndef HAP_PROFILER_AGENT_AGENT_TEST_UTIL_H_
#define HAP_PROFILER_AGENT_AGENT_TEST_UTIL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hap/v1/agent_service.grpc.pb.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "planner/service/core/profile_checks.h"
#include "profiler_agent/agent.h"
#include "profiler_agent/agent_service.h"
#include "profiler_agent/fake_planner.h"

namespace hap::agent::agent_test {

using ::hap::agent::testing::FakePlanner;
using ::hap::agent::testing::ServeForTest;
using ::hap::service::FromGrpc;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;
namespace v1 = hap::v1;
using Record = FakePlanner::Record;

// One CPU-like device whose FLOP/s the test sets; counts full probes.
class FakeProber : public DeviceProber {
 public:
  struct State {
    std::atomic<double> flops{1e9};
    std::atomic<int> probes{0};
  };
  explicit FakeProber(State* s) : s_(s) {}
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions&) override {
    ++s_->probes;
    v1::Device d;
    d.set_id(node + "/cpu0");
    d.set_kind(v1::CPU);
    d.set_node(node);
    auto* f = d.add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(s_->flops.load());
    d.set_memory_bytes(1 << 30);
    return std::vector<v1::Device>{d};
  }
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions&) override {
    return std::vector<double>{s_->flops.load()};
  }

 private:
  State* s_;
};

inline double Flops(const v1::Device& d) { return d.flops(0).flops(); }

// An agent measuring `prober` alone.
inline absl::StatusOr<std::unique_ptr<Agent>> StartOn(AgentOptions o,
                                                      std::unique_ptr<DeviceProber> prober) {
  std::vector<std::unique_ptr<DeviceProber>> probers;
  probers.push_back(std::move(prober));
  return Agent::Start(std::move(o), std::move(probers));
}

// An agent measuring one FakeProber over `state`.
inline absl::StatusOr<std::unique_ptr<Agent>> StartWithFakeProber(AgentOptions o,
                                                                  FakeProber::State* state) {
  return StartOn(std::move(o), std::make_unique<FakeProber>(state));
}

// node-a's options against `planner`: no drift checks, links measured once
// an hour.
inline AgentOptions NodeAOf(const FakePlanner& planner) {
  AgentOptions o;
  o.planner = planner.address();
  o.name = "node-a";
  o.drift = 0;
  o.link_probe_interval = absl::Hours(1);
  return o;
}

// A client of `agent`'s Agent service (nullptr, failing the test, when
// there is no channel).
inline std::unique_ptr<v1::Agent::Stub> AgentStub(const Agent& agent) {
  auto channel = hap::service::MakeChannel(agent.listen_address(), {});
  EXPECT_THAT(channel, IsOk());
  return channel.ok() ? v1::Agent::NewStub(*channel) : nullptr;
}

// Agent.Probe with include_links on `agent`, within `timeout`; its answer
// into `out` when given.
inline absl::Status ProbeForLinks(const Agent& agent, absl::Duration timeout,
                                  v1::ProbeResponse* out = nullptr) {
  auto stub = AgentStub(agent);
  if (stub == nullptr) return absl::InternalError("no channel to the agent");
  grpc::ClientContext ctx;
  hap::service::PrepareClientContext(&ctx, {}, timeout);
  v1::ProbeRequest req;
  req.set_include_links(true);
  v1::ProbeResponse r;
  return FromGrpc(stub->Probe(&ctx, req, out != nullptr ? out : &r));
}

// Agent.GetProfile through `stub`, with the token of `security`.
inline absl::StatusOr<v1::ProbeResponse> GetProfile(v1::Agent::Stub& stub,
                                                    const hap::service::Security& security = {}) {
  grpc::ClientContext ctx;
  hap::service::PrepareClientContext(&ctx, security, absl::Seconds(30));
  v1::ProbeResponse r;
  absl::Status s = FromGrpc(stub.GetProfile(&ctx, v1::GetProfileRequest(), &r));
  if (!s.ok()) return s;
  return r;
}

// An executor daemon serving `device`: GetStatus only, on `address`
// ("127.0.0.1:0" picks a free port).
class FakeExecutor final : public v1::Executor::Service {
 public:
  FakeExecutor(std::string device, const std::string& address) : device_(std::move(device)) {
    server_ = ServeForTest(this, address, &address_);
  }
  ~FakeExecutor() override { server_->Shutdown(); }
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::ExecutorStatus* out) override {
    out->set_state(state_.load());
    if (state_.load() == v1::ExecutorStatus::TRAINING) out->set_deployment("deployments/d-g1");
    out->set_device(device_);
    ++asked_;
    return grpc::Status::OK;
  }
  const std::string& address() const { return address_; }
  void set_state(v1::ExecutorStatus::State s) { state_ = s; }
  int asked() const { return asked_.load(); }

 private:
  std::atomic<v1::ExecutorStatus::State> state_{v1::ExecutorStatus::IDLE};
  std::atomic<int> asked_{0};
  std::string device_, address_;
  std::unique_ptr<grpc::Server> server_;
};

// An executor daemon that never answers GetStatus (frozen, or its host
// overloaded): each call waits until the caller gives up. Records the time
// each caller gave it.
class HungExecutor final : public v1::Executor::Service {
 public:
  HungExecutor() { server_ = ServeForTest(this, "127.0.0.1:0", &address_); }
  ~HungExecutor() override {
    released_.Notify();
    server_->Shutdown();
  }
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*,
                         v1::ExecutorStatus*) override {
    {
      absl::MutexLock l(&mu_);
      given_.push_back(absl::FromChrono(ctx->deadline()) - absl::Now());
    }
    while (!ctx->IsCancelled() &&
           !released_.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
    }
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "hung");
  }
  const std::string& address() const { return address_; }
  std::vector<absl::Duration> given() {
    absl::MutexLock l(&mu_);
    return given_;
  }

 private:
  std::string address_;
  std::unique_ptr<grpc::Server> server_;
  absl::Notification released_;
  absl::Mutex mu_;
  std::vector<absl::Duration> given_;
};

// A peer agent whose Echo never answers: it waits until the caller cancels
// the stream (or 20 s pass) and records which came first.
class StuckPeer final : public v1::Agent::Service {
 public:
  StuckPeer() { server_ = ServeForTest(this, "127.0.0.1:0", &address_); }
  ~StuckPeer() override { server_->Shutdown(); }
  grpc::Status GetProfile(grpc::ServerContext*, const v1::GetProfileRequest*,
                          v1::ProbeResponse* out) override {
    out->mutable_node()->add_devices()->set_id("stuck/cpu0");
    return grpc::Status::OK;
  }
  grpc::Status Echo(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::EchoChunk, v1::EchoChunk>*) override {
    echo_given = absl::FromChrono(ctx->deadline()) - absl::Now();
    echo_started = true;
    for (int i = 0; i < 2000 && !ctx->IsCancelled(); ++i) absl::SleepFor(absl::Milliseconds(10));
    echo_cancelled = ctx->IsCancelled();
    echo_ended = true;
    return grpc::Status::OK;
  }
  const std::string& address() const { return address_; }
  std::atomic<bool> echo_started{false}, echo_cancelled{false}, echo_ended{false};
  absl::Duration echo_given;  // the time the caller gave Echo (set before echo_started)

 private:
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// `peer` assigned to node-a on `planner`, and `o` (node-a's) giving a link
// measurement an hour.
inline void AssignStuckPeer(const StuckPeer& peer, FakePlanner* planner, AgentOptions* o) {
  v1::ProbeAssignment a;
  a.set_peer_node("stuck");
  a.set_peer_address(peer.address());
  planner->AssignProbe("node-a", a);
  o->link.timeout = absl::Hours(1);
}

// `agent` once its link thread measures `peer` (which never answers: the
// measurement holds the probe lock until Shutdown); nullptr, failing the
// test, when it does not start.
inline std::unique_ptr<Agent> WhileMeasuring(StuckPeer& peer, std::unique_ptr<Agent> agent) {
  for (int i = 0; agent && i < 2000 && !peer.echo_started; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!peer.echo_started) {
    ADD_FAILURE() << "the agent did not start measuring the stuck peer";
    return nullptr;
  }
  return agent;
}

class AgentTest : public ::testing::Test {
 protected:
  AgentOptions Options(const std::string& name) {
    AgentOptions o;
    o.planner = planner_.address();
    o.name = name;
    o.probe.max_duration = absl::Milliseconds(100);
    o.drift = 0;
    o.link_probe_interval = absl::Hours(1);
    o.initial_backoff = absl::Milliseconds(10);
    o.max_backoff = absl::Milliseconds(40);
    o.rpc_timeout = absl::Seconds(5);
    return o;
  }

  std::unique_ptr<Agent> StartAgent(AgentOptions o, FakeProber::State* state) {
    auto agent = StartWithFakeProber(std::move(o), state);
    EXPECT_THAT(agent, IsOk());
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  // The peer agent `peer` (at `peer_address`) assigned to node-a to measure.
  void AssignPeer(const std::string& peer, const std::string& peer_address, int64_t bytes) {
    v1::ProbeAssignment a;
    a.set_peer_node(peer);
    a.set_peer_address(peer_address);
    a.set_bytes(bytes);
    planner_.AssignProbe("node-a", a);
  }
  // node-b started, registered and assigned to node-a.
  std::unique_ptr<Agent> NodeBAssigned(FakeProber::State* state_b, int64_t bytes) {
    auto b = StartAgent(Options("node-b"), state_b);
    if (b == nullptr || !Registered("node-b")) return nullptr;
    AssignPeer("node-b", b->address(), bytes);
    return b;
  }

  // node-b started, registered and assigned to node-a (into *b), then node-a
  // started (nullptr, failing the test, where either is not).
  std::unique_ptr<Agent> NodeAWithPeerB(FakeProber::State* state_b, std::unique_ptr<Agent>* b) {
    *b = NodeBAssigned(state_b, 1 << 20);
    if (*b == nullptr) {
      ADD_FAILURE() << "node-b did not start and register";
      return nullptr;
    }
    return StartAgent(Options("node-a"), &state_);
  }

  // node-a, checking for drift every 20 ms at 20%, with `executors`,
  // started and registered (nullptr, failing the test, where it is not).
  std::unique_ptr<Agent> DriftCheckingAgent(std::vector<std::string> executors = {}) {
    AgentOptions o = Options("node-a");
    o.executors = std::move(executors);
    o.drift = 0.2;
    o.drift_check_interval = absl::Milliseconds(20);
    auto agent = StartAgent(o, &state_);
    if (agent == nullptr || !Registered("node-a")) {
      ADD_FAILURE() << "node-a did not start and register";
      return nullptr;
    }
    return agent;
  }

  // node-a started with `executors` and registered (into *agent): the node
  // as the planner has it, or an empty one, failing the test.
  v1::Node RegisteredWithExecutors(std::vector<std::string> executors,
                                   std::unique_ptr<Agent>* agent) {
    AgentOptions o = Options("node-a");
    o.executors = std::move(executors);
    *agent = StartAgent(o, &state_);
    if (*agent == nullptr || !Registered("node-a")) {
      ADD_FAILURE() << "node-a did not start and register";
      return v1::Node();
    }
    return planner_.Snapshot().nodes.at("node-a");
  }

  // Two agents of node-a: *first (of options `o`) registered it, then
  // *second (another port) did, which the planner now takes as the node's.
  // False where either did not start and register.
  bool TwoAgentsOfNodeA(AgentOptions o, std::unique_ptr<Agent>* first,
                        std::unique_ptr<Agent>* second) {
    *first = StartAgent(std::move(o), &state_);
    if (*first == nullptr || !Registered("node-a")) return false;
    *second = StartAgent(Options("node-a"), &state_);
    return *second != nullptr && Registered("node-a", 2);
  }

  bool Registered(const std::string& name, int times = 1) {
    return planner_.WaitFor(
        [&](const Record& r) { return r.registrations >= times && r.nodes.count(name); });
  }

  FakePlanner planner_{absl::Milliseconds(20)};
  FakeProber::State state_;
};

}  // namespace hap::agent::agent_test

#endif  // HAP_PROFILER_AGENT_AGENT_TEST_UTIL_H_
