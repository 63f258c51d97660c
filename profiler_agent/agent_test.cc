// The agent daemon against a fake planner: registration with retries,
// heartbeats, re-registration after unknown_node, re-probes on request and on
// drift, peer link probes, tokens, shutdown.
#include "profiler_agent/agent.h"

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
#include "profiler_agent/agent_service.h"
#include "profiler_agent/fake_planner.h"

namespace hap::agent {
namespace {

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

double Flops(const v1::Device& d) { return d.flops(0).flops(); }

// An agent measuring `prober` alone.
absl::StatusOr<std::unique_ptr<Agent>> StartOn(AgentOptions o,
                                               std::unique_ptr<DeviceProber> prober) {
  std::vector<std::unique_ptr<DeviceProber>> probers;
  probers.push_back(std::move(prober));
  return Agent::Start(std::move(o), std::move(probers));
}

// An agent measuring one FakeProber over `state`.
absl::StatusOr<std::unique_ptr<Agent>> StartWithFakeProber(AgentOptions o,
                                                           FakeProber::State* state) {
  return StartOn(std::move(o), std::make_unique<FakeProber>(state));
}

// node-a's options against `planner`: no drift checks, links measured once
// an hour.
AgentOptions NodeAOf(const FakePlanner& planner) {
  AgentOptions o;
  o.planner = planner.address();
  o.name = "node-a";
  o.drift = 0;
  o.link_probe_interval = absl::Hours(1);
  return o;
}

// A client of `agent`'s Agent service (nullptr, failing the test, when
// there is no channel).
std::unique_ptr<v1::Agent::Stub> AgentStub(const Agent& agent) {
  auto channel = hap::service::MakeChannel(agent.listen_address(), {});
  EXPECT_THAT(channel, IsOk());
  return channel.ok() ? v1::Agent::NewStub(*channel) : nullptr;
}

// Agent.GetProfile through `stub`, with the token of `security`.
absl::StatusOr<v1::ProbeResponse> GetProfile(v1::Agent::Stub& stub,
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

  bool Registered(const std::string& name, int times = 1) {
    return planner_.WaitFor(
        [&](const Record& r) { return r.registrations >= times && r.nodes.count(name); });
  }

  FakePlanner planner_{absl::Milliseconds(20)};
  FakeProber::State state_;
};

TEST_F(AgentTest, RegistersThenHeartbeatsAtThePlannersInterval) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.heartbeats >= 5; }));
  Record r = planner_.Snapshot();
  EXPECT_EQ(r.registrations, 1);
  const v1::Node& n = r.nodes.at("node-a");
  EXPECT_EQ(n.address(), agent->address());
  EXPECT_EQ(agent->address(), agent->listen_address());
  ASSERT_EQ(n.devices_size(), 1);
  EXPECT_EQ(n.devices(0).id(), "node-a/cpu0");
  EXPECT_EQ(n.agent_version(), "hap-agent/1");
  // Nothing changed: heartbeats carry no devices.
  EXPECT_TRUE(r.heartbeats_with_devices.empty());
  EXPECT_EQ(state_.probes.load(), 1);
}

// A planner answering a heartbeat interval of 1 ns is heartbeated at most
// every 10 ms (hap-planner's own lower limit), not in a loop. The bound is
// on counts, not speed: in any wall time T the agent sends at most T/10 ms + 1
// heartbeats, however fast or loaded the machine.
TEST_F(AgentTest, APlannersTinyHeartbeatIntervalIsClamped) {
  FakePlanner tiny(absl::Nanoseconds(1));
  AgentOptions o = Options("node-a");
  o.planner = tiny.address();
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(tiny.WaitFor([](const Record& r) { return r.heartbeats >= 1; }));
  const int before = tiny.Snapshot().heartbeats;
  const absl::Time start = absl::Now();
  absl::SleepFor(absl::Milliseconds(500));
  const int sent = tiny.Snapshot().heartbeats - before;
  const double most = absl::ToDoubleMilliseconds(absl::Now() - start) / 10 + 2;
  EXPECT_LE(sent, most) << "heartbeats in " << (absl::Now() - start);
  EXPECT_GE(sent, 1);  // and it still heartbeats
}

// --executor: the node registers labelled with each executor daemon's
// address under the device it serves (what deployments and jobs use for a
// device given no executor).
TEST_F(AgentTest, LabelsTheNodeWithItsExecutorsAddresses) {
  FakeExecutor executor("node-a/cpu0", "127.0.0.1:0");
  std::unique_ptr<Agent> agent;
  const v1::Node n = RegisteredWithExecutors({executor.address()}, &agent);
  ASSERT_EQ(n.labels().count("hap.executor/node-a/cpu0"), 1u) << n.DebugString();
  EXPECT_EQ(n.labels().at("hap.executor/node-a/cpu0"), executor.address());
  EXPECT_EQ(n.labels().size(), 1u);
}

// Two --executor flags whose executors serve one device (one executor
// under two addresses, or a second one started on the device): the label
// silently went to the one listed last. The first keeps it, and the agent
// says which one it left out.
TEST_F(AgentTest, TwoExecutorsOfOneDeviceLabelTheFirstAndSaySo) {
  FakeExecutor first("node-a/cpu0", "127.0.0.1:0"), second("node-a/cpu0", "127.0.0.1:0");
  ::testing::internal::CaptureStderr();
  std::unique_ptr<Agent> agent;
  const v1::Node n = RegisteredWithExecutors({first.address(), second.address()}, &agent);
  agent.reset();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(n.labels().count("hap.executor/node-a/cpu0"), 1u) << n.DebugString();
  EXPECT_EQ(n.labels().at("hap.executor/node-a/cpu0"), first.address());
  EXPECT_THAT(log, HasSubstr("the executor at " + second.address() +
                             " (--executor) serves node-a/cpu0, as the one at " + first.address() +
                             " does: the node is labelled with " + first.address()));
}

// An executor that serves a device the node does not report (another
// node's, or node/cpu0 beside an agent that measures the GPUs): the planner
// refuses a registration with its label, so the node registers without it,
// labelled with the executors that serve its own devices.
TEST_F(AgentTest, AnExecutorOfADeviceTheNodeDoesNotReportIsNotLabelled) {
  FakeExecutor ours("node-a/cpu0", "127.0.0.1:0"), foreign("node-x/cpu0", "127.0.0.1:0");
  std::unique_ptr<Agent> agent;
  const v1::Node n = RegisteredWithExecutors({foreign.address(), ours.address()}, &agent);
  EXPECT_EQ(n.labels().size(), 1u) << n.DebugString();
  EXPECT_EQ(n.labels().count("hap.executor/node-a/cpu0"), 1u) << n.DebugString();
}

// Two agents with one node name (two containers with one hostname): the
// planner took both agents' heartbeats into one node. An agent whose node
// another agent registered since now sends its address, is told who holds
// the node, says so, and does not register again (the two would take the
// node in turns).
TEST_F(AgentTest, AnAgentWhoseNodeAnotherAgentRegisteredDoesNotTakeItBack) {
  ::testing::internal::CaptureStderr();
  auto first = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(first);
  ASSERT_TRUE(Registered("node-a"));
  auto second = StartAgent(Options("node-a"), &state_);  // another port
  ASSERT_TRUE(second);
  ASSERT_TRUE(Registered("node-a", 2));
  const bool refused = planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 10; });
  const Record r = planner_.Snapshot();
  const std::string first_address = first->address(), second_address = second->address();
  first.reset();
  second.reset();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(refused) << "the first agent's heartbeats were taken";
  EXPECT_EQ(r.registrations, 2);
  EXPECT_EQ(r.nodes.at("node-a").address(), second_address);
  EXPECT_THAT(log, HasSubstr("node 'node-a' is registered by the agent at " + second_address +
                             ", not this one (" + first_address + ")"));
}

// The agent whose node another agent holds went on measuring links and
// reporting them for the node: the planner took its measurements, made on
// another machine, as the holder's (a report names only the node). It now
// measures none while the planner says another agent holds the node.
TEST_F(AgentTest, AnAgentWhoseNodeAnotherAgentHoldsMeasuresNoLinks) {
  AgentOptions o = Options("node-a");
  o.link_probe_interval = absl::Milliseconds(20);
  auto first = StartAgent(o, &state_);
  ASSERT_TRUE(first);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.probe_assignment_requests >= 2; }));
  AgentOptions holder = Options("node-a");
  holder.link_probe_delay = absl::Hours(1);  // measures nothing itself
  auto second = StartAgent(holder, &state_);
  ASSERT_TRUE(second);
  // The first agent's second refused heartbeat: it took the answer of the
  // first (a link measurement already begun may still ask once).
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 2; }));
  const int asked = planner_.Snapshot().probe_assignment_requests;
  // Ten more heartbeats (20 ms each) and as many link intervals.
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 12; }));
  EXPECT_LE(planner_.Snapshot().probe_assignment_requests, asked + 1);
}

// The same for a Probe call with include_links: its reports too were taken
// as the holder's. It fails naming the holder, probing nothing.
TEST_F(AgentTest, AProbeCallForLinksOnANodeAnotherAgentHoldsFailsNamingIt) {
  auto first = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(first);
  ASSERT_TRUE(Registered("node-a"));
  auto second = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(second);
  ASSERT_TRUE(Registered("node-a", 2));
  // The first agent's second refused heartbeat: it took the answer of the first.
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 2; }));
  auto stub = AgentStub(*first);
  ASSERT_TRUE(stub);
  const int probes = state_.probes.load();
  grpc::ClientContext ctx;
  hap::service::PrepareClientContext(&ctx, {}, absl::Seconds(30));
  v1::ProbeRequest req;
  req.set_include_links(true);
  v1::ProbeResponse r;
  EXPECT_THAT(FromGrpc(stub->Probe(&ctx, req, &r)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("the agent at " + second->address()),
                                        HasSubstr("nothing was probed"))));
  EXPECT_EQ(state_.probes.load(), probes);
}

// An executor address where none answers yet: a port free a moment ago.
std::string NoExecutorYet() {
  FakeExecutor probe("x", "127.0.0.1:0");
  return probe.address();
}

// An executor that starts after the agent: the node registers without its
// label, then again with it once the executor answers.
TEST_F(AgentTest, AnExecutorStartedLaterIsLabelledOnceItAnswers) {
  const std::string address = NoExecutorYet();
  AgentOptions o = Options("node-a");
  o.executors = {address};
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  EXPECT_EQ(planner_.Snapshot().nodes.at("node-a").labels().size(), 0u);
  FakeExecutor executor("node-a/cpu0", address);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) {
    return r.nodes.count("node-a") && r.nodes.at("node-a").labels().count("hap.executor/node-a/cpu0");
  })) << planner_.Snapshot().nodes.at("node-a").DebugString();
  Record r = planner_.Snapshot();
  EXPECT_EQ(r.registrations, 2);
  EXPECT_EQ(r.nodes.at("node-a").labels().at("hap.executor/node-a/cpu0"), address);
}

// A hung --executor was asked for its device after every heartbeat with
// the whole rpc_timeout (10 s): heartbeats came every 10 s instead of 5, so
// two hung executors (or a planner's --heartbeat-seconds 1) made the node
// STALE over and over. The executors are now asked within half an interval.
TEST_F(AgentTest, AHungExecutorDoesNotHoldUpHeartbeats) {
  HungExecutor hung;
  AgentOptions o = Options("node-a");
  o.executors = {hung.address()};
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.heartbeats >= 3; }));
  agent->Shutdown();
  const std::vector<absl::Duration> given = hung.given();
  ASSERT_GE(given.size(), 2u);
  // After registering, at the planner's 20 ms interval: at most half (10
  // ms), not rpc_timeout (5 s). The server reads the deadline gRPC sends
  // rounded up (10.05 ms seen for 10 ms: failed 1 run in 3 at exactly 10).
  EXPECT_LE(given.back(), absl::Milliseconds(15));
}

// An executor that answers late is labelled by registering again, but not
// while another agent holds the node: the agent registered again for the
// label and took the node back from the agent that held it (the two would
// take it in turns).
TEST_F(AgentTest, AnExecutorStartedLaterDoesNotTakeBackANodeAnotherAgentHolds) {
  const std::string address = NoExecutorYet();
  AgentOptions o = Options("node-a");
  o.executors = {address};
  auto first = StartAgent(o, &state_);
  ASSERT_TRUE(first);
  ASSERT_TRUE(Registered("node-a"));
  auto second = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(second);
  ASSERT_TRUE(Registered("node-a", 2));
  // The first agent took the answer of its first refused heartbeat.
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 2; }));
  FakeExecutor executor("node-a/cpu0", address);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 12; }));
  const Record r = planner_.Snapshot();
  EXPECT_EQ(r.registrations, 2);
  EXPECT_EQ(r.nodes.at("node-a").address(), second->address());
}

// The lookups shared one budget one after another: a hung executor listed
// first spent it all, and the executors after it were given 1 ms each (a
// healthy one was never labelled while the hung one stayed). Each is asked
// within the whole budget, at once.
TEST_F(AgentTest, AHungExecutorDoesNotStarveTheExecutorsAfterIt) {
  HungExecutor hung;
  FakeExecutor executor("node-a/cpu0", "127.0.0.1:0");
  std::unique_ptr<Agent> agent;
  const v1::Node n = RegisteredWithExecutors({hung.address(), executor.address()}, &agent);
  ASSERT_TRUE(agent);
  EXPECT_EQ(n.labels().count("hap.executor/node-a/cpu0"), 1u) << n.DebugString();
  agent->Shutdown();
}

TEST_F(AgentTest, RetriesRegistrationWithBackoffWhileThePlannerRefuses) {
  planner_.RefuseRegistrations(3);
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  Record r = planner_.Snapshot();
  EXPECT_EQ(r.refused_registrations, 3);
  EXPECT_EQ(r.registrations, 1);
}

// Agents started together (a DaemonSet rolled out while the planner is
// down or overloaded) retried their registrations in step: at the same
// doubling backoffs from the same start, all at once each time. Each wait
// is now a random part of the backoff, from half to all of it.
TEST_F(AgentTest, RegistrationRetriesWaitARandomPartOfTheBackoff) {
  planner_.RefuseRegistrations(2);
  AgentOptions o = Options("node-a");
  o.initial_backoff = absl::Milliseconds(100);
  o.max_backoff = absl::Seconds(1);
  std::atomic<int> drawn{0};
  o.random = [&drawn] { return drawn++ == 0 ? 0.0 : 0.5; };
  ::testing::internal::CaptureStderr();
  auto agent = StartAgent(o, &state_);
  const bool registered = agent != nullptr && Registered("node-a");
  agent.reset();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(registered);
  EXPECT_EQ(drawn.load(), 2);
  EXPECT_THAT(log, HasSubstr("UNAVAILABLE: the fake planner is refusing; retrying in 50ms"));
  EXPECT_THAT(log, HasSubstr("UNAVAILABLE: the fake planner is refusing; retrying in 150ms"));
}

TEST_F(AgentTest, RegistersOnceThePlannerComesUp) {
  // Nothing listens at first: the address of a planner that is gone.
  std::string address;
  {
    FakePlanner gone(absl::Milliseconds(20));
    address = gone.address();
  }
  AgentOptions o = Options("node-a");
  o.planner = address;
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  // The agent keeps serving while it retries.
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  auto profile = GetProfile(*stub);
  ASSERT_THAT(profile, IsOk());
  EXPECT_EQ(profile->node().name(), "node-a");
  // The planner comes up at that address: the next retry registers.
  FakePlanner back(absl::Milliseconds(20), "", address);
  ASSERT_TRUE(back.WaitFor([](const Record& r) { return r.nodes.count("node-a") > 0; }));
  EXPECT_EQ(back.Snapshot().registrations, 1);
  agent->Shutdown();
}

TEST_F(AgentTest, ReRegistersUnderTheSameNameAfterUnknownNode) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  planner_.Forget("node-a");  // a planner restarted without its state
  ASSERT_TRUE(Registered("node-a", 2));
  Record r = planner_.Snapshot();
  EXPECT_EQ(r.registrations, 2);
  ASSERT_EQ(r.nodes.size(), 1u);
  EXPECT_EQ(r.nodes.begin()->first, "node-a");
  EXPECT_EQ(r.nodes.begin()->second.devices(0).id(), "node-a/cpu0");
  // Heartbeats go on after it.
  int before = r.heartbeats;
  EXPECT_TRUE(planner_.WaitFor([&](const Record& x) { return x.heartbeats >= before + 3; }));
}

// A planner restarted with a shorter --heartbeat-seconds, its database kept
// (the node stays known, so no unknown_node): the agent heartbeated at the
// interval of its registration, the node went STALE between heartbeats, and
// each heartbeat brought it back with a request to probe again (a full probe
// every interval, beside whatever trained). From a planner whose heartbeat
// answers carry no interval (older ones), a heartbeat answered reprobe also
// registers the node again, which takes the planner's interval.
TEST(AgentHeartbeatTest, ANodeAskedToProbeAgainTakesThePlannersCurrentInterval) {
  FakePlanner planner(absl::Seconds(2));
  planner.SetIntervalInHeartbeats(false);
  FakeProber::State state;
  auto agent = StartWithFakeProber(NodeAOf(planner), &state);
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(planner.WaitFor([](const Record& r) { return r.registrations >= 1; }));
  planner.SetHeartbeatInterval(absl::Milliseconds(20));
  planner.RequestReprobe("node-a");
  ASSERT_TRUE(planner.WaitFor([](const Record& r) { return r.registrations >= 2; }));
  const int before = planner.Snapshot().heartbeats;
  EXPECT_TRUE(planner.WaitFor([&](const Record& r) { return r.heartbeats >= before + 20; }));
}

// The same, without the STALE node in between: heartbeats carry the
// planner's interval, and the agent takes it at the first answer, without
// registering again or probing.
TEST(AgentHeartbeatTest, TakesTheIntervalAHeartbeatIsAnsweredWith) {
  FakePlanner planner(absl::Seconds(5));
  FakeProber::State state;
  auto agent = StartWithFakeProber(NodeAOf(planner), &state);
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(planner.WaitFor([](const Record& r) { return r.registrations >= 1; }));
  planner.SetHeartbeatInterval(absl::Milliseconds(20));
  // The first heartbeat, 5 s after the registration, is answered 20 ms; 20
  // more at 5 s would take 100 s.
  EXPECT_TRUE(planner.WaitFor([&](const Record& r) { return r.heartbeats >= 21; }));
  EXPECT_EQ(planner.Snapshot().registrations, 1);
  EXPECT_EQ(state.probes.load(), 1);
}

// An interval of its own (--heartbeat-seconds) longer than the planner's:
// the planner took the node for STALE between heartbeats and answered each
// one reprobe, a full probe at every heartbeat. The agent heartbeats at
// least as often as the planner expects; its own interval may be shorter.
TEST(AgentHeartbeatTest, AnOwnIntervalIsHeldToThePlannersAtMost) {
  {
    FakePlanner planner(absl::Milliseconds(20));
    FakeProber::State state;
    AgentOptions o = NodeAOf(planner);
    o.heartbeat_interval = absl::Hours(1);
    auto agent = StartWithFakeProber(o, &state);
    ASSERT_THAT(agent, IsOk());
    // At an hour each, 20 heartbeats would take 20 hours.
    EXPECT_TRUE(planner.WaitFor([](const Record& r) { return r.heartbeats >= 20; }));
    EXPECT_EQ(planner.Snapshot().registrations, 1);
  }
  FakePlanner planner(absl::Hours(1));
  FakeProber::State state;
  AgentOptions o = NodeAOf(planner);
  o.heartbeat_interval = absl::Milliseconds(20);
  auto agent = StartWithFakeProber(o, &state);
  ASSERT_THAT(agent, IsOk());
  EXPECT_TRUE(planner.WaitFor([](const Record& r) { return r.heartbeats >= 20; }));
}

TEST_F(AgentTest, ReprobesWhenAskedAndSendsTheDevicesWithTheNextHeartbeat) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  state_.flops = 3e9;
  planner_.RequestReprobe("node-a");
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.heartbeats_with_devices.empty(); }));
  Record r = planner_.Snapshot();
  ASSERT_EQ(r.heartbeats_with_devices.size(), 1u);
  const v1::HeartbeatRequest& hb = r.heartbeats_with_devices[0];
  EXPECT_EQ(hb.name(), "nodes/node-a");
  ASSERT_EQ(hb.devices_size(), 1);
  EXPECT_EQ(Flops(hb.devices(0)), 3e9);
  EXPECT_EQ(Flops(r.nodes.at("node-a").devices(0)), 3e9);
  EXPECT_EQ(state_.probes.load(), 2);
  // Not again: the heartbeat answer carries the planner's interval.
  EXPECT_EQ(r.registrations, 1);
}

// A probe that measured what the planner refuses (a FLOP/s below its
// minimum or not a number, from a device that hangs or a broken timing):
// the heartbeats carried it, each one was refused, and the node went STALE
// for good. The agent now keeps its last profile, serves it, says why, and
// heartbeats on.
TEST_F(AgentTest, AProbeThePlannerWouldRefuseKeepsTheLastProfile) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  state_.flops = std::numeric_limits<double>::quiet_NaN();
  planner_.RequestReprobe("node-a");
  for (int i = 0; i < 6000 && state_.probes < 2; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(state_.probes.load(), 2);
  const int before = planner_.Snapshot().heartbeats;
  ASSERT_TRUE(planner_.WaitFor([&](const Record& r) { return r.heartbeats >= before + 5; }));
  EXPECT_EQ(planner_.Snapshot().refused_heartbeats, 0);
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  auto profile = GetProfile(*stub);
  ASSERT_THAT(profile, IsOk());
  EXPECT_EQ(Flops(profile->node().devices(0)), 1e9);
}

// The planner refuses the re-probed devices a heartbeat carries (the
// cluster would pass its device bound, the planner is overloaded, ...):
// every heartbeat carried them again, each was refused, and the node went
// STALE for good. After a refusal the next heartbeat goes without them (the
// planner keeps the devices it has), the one after offers them again, and
// once the planner takes them they are in.
TEST_F(AgentTest, HeartbeatsGoOnWhenThePlannerRefusesTheReprobedDevices) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  planner_.RefuseHeartbeatDevices(true);
  state_.flops = 2e9;
  planner_.RequestReprobe("node-a");
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.refused_heartbeats >= 1; }));
  const int before = planner_.Snapshot().heartbeats;
  ASSERT_TRUE(planner_.WaitFor([&](const Record& r) { return r.heartbeats >= before + 5; }));
  EXPECT_TRUE(planner_.Snapshot().heartbeats_with_devices.empty());
  planner_.RefuseHeartbeatDevices(false);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.heartbeats_with_devices.empty(); }));
  EXPECT_EQ(Flops(planner_.Snapshot().nodes.at("node-a").devices(0)), 2e9);
}

TEST_F(AgentTest, ReprobesWhenTheQuickCheckDrifts) {
  auto agent = DriftCheckingAgent();
  ASSERT_TRUE(agent);
  // Within the tolerance: several checks pass without a probe.
  state_.flops = 1.1e9;
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.heartbeats >= 10; }));
  EXPECT_EQ(state_.probes.load(), 1);
  EXPECT_TRUE(planner_.Snapshot().heartbeats_with_devices.empty());
  // The CPU share halved: re-probed and sent.
  state_.flops = 0.5e9;
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.heartbeats_with_devices.empty(); }));
  EXPECT_EQ(Flops(planner_.Snapshot().heartbeats_with_devices[0].devices(0)), 0.5e9);
}

// A device that trains is not checked for drift: beside the job's kernels
// the quick check read the contention as a drift, two checks in a row, and
// the full probe it started slowed the job and reported the shared device
// as the node's. Once the executor is idle again the drift is probed.
TEST_F(AgentTest, NoDriftCheckWhileAnExecutorOfTheNodeTrains) {
  FakeExecutor executor("node-a/cpu0", "127.0.0.1:0");
  executor.set_state(v1::ExecutorStatus::TRAINING);
  auto agent = DriftCheckingAgent({executor.address()});
  ASSERT_TRUE(agent);
  state_.flops = 0.5e9;  // what a quick check beside the job measures
  const int asked = executor.asked();
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.heartbeats >= 15; }));
  EXPECT_GE(executor.asked(), asked + 3);  // the drift checks asked it, and were paused
  EXPECT_EQ(state_.probes.load(), 1);
  EXPECT_TRUE(planner_.Snapshot().heartbeats_with_devices.empty());
  executor.set_state(v1::ExecutorStatus::FINISHED);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.heartbeats_with_devices.empty(); }));
  EXPECT_EQ(Flops(planner_.Snapshot().heartbeats_with_devices[0].devices(0)), 0.5e9);
  EXPECT_EQ(state_.probes.load(), 2);
}

// The same, told by the planner's heartbeats (an agent given no --executor,
// as in Kubernetes, where the executor is another pod): a deployment runs
// on the node.
TEST_F(AgentTest, NoDriftCheckWhileThePlannerSaysTheNodeTrains) {
  planner_.SetTraining("node-a", true);
  auto agent = DriftCheckingAgent();
  ASSERT_TRUE(agent);
  state_.flops = 0.5e9;
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.heartbeats >= 20; }));
  EXPECT_EQ(state_.probes.load(), 1);
  EXPECT_TRUE(planner_.Snapshot().heartbeats_with_devices.empty());
  planner_.SetTraining("node-a", false);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.heartbeats_with_devices.empty(); }));
  EXPECT_EQ(Flops(planner_.Snapshot().heartbeats_with_devices[0].devices(0)), 0.5e9);
}

// Links are measured once at start whatever trains (the planner needs
// them); the periodic re-probes wait while a job trains (their transfers
// would slow its collectives and measure the link it shares).
// Until the planner has answered a heartbeat the agent does not know
// whether a deployment runs on the node: drift checks wait for that answer
// (they drifted twice before the first heartbeat, and probed the node
// while it trained).
TEST(AgentTrainingTest, NoDriftCheckBeforeThePlannerSaidWhetherTheNodeTrains) {
  FakePlanner planner(absl::Milliseconds(300));
  planner.SetTraining("node-a", true);
  FakeProber::State state;
  AgentOptions o = NodeAOf(planner);
  o.drift = 0.2;
  o.drift_check_interval = absl::Milliseconds(10);
  auto agent = StartWithFakeProber(o, &state);
  ASSERT_THAT(agent, IsOk());
  state.flops = 0.5e9;  // every check drifts
  ASSERT_TRUE(planner.WaitFor([](const Record& r) { return r.heartbeats >= 3; }));
  EXPECT_EQ(state.probes.load(), 1);
}

TEST_F(AgentTest, NoLinkReprobeWhileAnExecutorOfTheNodeTrains) {
  FakeProber::State state_b;
  auto b = NodeBAssigned(&state_b, 1 << 16);
  ASSERT_TRUE(b);
  FakeExecutor executor("node-a/cpu0", "127.0.0.1:0");
  executor.set_state(v1::ExecutorStatus::TRAINING);
  AgentOptions o = Options("node-a");
  o.executors = {executor.address()};
  o.link_probe_interval = absl::Milliseconds(20);
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.links.empty(); }));
  const size_t first = planner_.Snapshot().links.size();
  const int asked = executor.asked();
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.heartbeats >= 15; }));
  EXPECT_GE(executor.asked(), asked + 3);
  EXPECT_EQ(planner_.Snapshot().links.size(), first);
  executor.set_state(v1::ExecutorStatus::IDLE);
  ASSERT_TRUE(planner_.WaitFor([&](const Record& r) { return r.links.size() > first; }));
}

TEST_F(AgentTest, TheProbeRpcProbesAndTheNextHeartbeatCarriesTheDevices) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  state_.flops = 7e9;
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  grpc::ClientContext ctx;
  v1::ProbeRequest req;
  req.mutable_max_duration()->set_seconds(1);
  v1::ProbeResponse r;
  ASSERT_THAT(FromGrpc(stub->Probe(&ctx, req, &r)), IsOk());
  EXPECT_EQ(Flops(r.node().devices(0)), 7e9);
  EXPECT_TRUE(r.has_probe_duration());
  ASSERT_TRUE(planner_.WaitFor([](const Record& x) { return !x.heartbeats_with_devices.empty(); }));
  EXPECT_EQ(Flops(planner_.Snapshot().heartbeats_with_devices[0].devices(0)), 7e9);
}

// A Probe call with include_links while the planner does not answer (down,
// restarting) probed the devices, measured no peer, and answered OK: the
// caller could not tell it from a cluster without peers, and believed the
// planner held its links. It now fails naming the planner, probing nothing.
TEST_F(AgentTest, AProbeCallForLinksThePlannerCannotAssignFailsNamingIt) {
  auto planner = std::make_unique<FakePlanner>(absl::Milliseconds(20));
  const std::string address = planner->address();
  AgentOptions o = Options("node-a");
  o.planner = address;
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(planner->WaitFor([](const Record& r) { return r.registrations >= 1; }));
  planner.reset();  // the planner is gone
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  const int probes = state_.probes.load();
  grpc::ClientContext ctx;
  hap::service::PrepareClientContext(&ctx, {}, absl::Seconds(30));
  v1::ProbeRequest req;
  req.set_include_links(true);
  v1::ProbeResponse r;
  EXPECT_THAT(FromGrpc(stub->Probe(&ctx, req, &r)),
              StatusIs(absl::StatusCode::kUnavailable,
                       ::testing::AllOf(HasSubstr("probe assignments"), HasSubstr(address),
                                        HasSubstr("nothing was probed"))));
  EXPECT_EQ(state_.probes.load(), probes);
}

// A FakeProber whose probes wait while `hold` is set.
class HeldProber : public FakeProber {
 public:
  struct Hold {
    std::atomic<bool> hold{false};
    std::atomic<int> waiting{0};
  };
  HeldProber(State* s, Hold* h) : FakeProber(s), h_(h) {}
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions& o) override {
    ++h_->waiting;
    while (h_->hold) absl::SleepFor(absl::Milliseconds(5));
    --h_->waiting;
    return FakeProber::Probe(node, o);
  }

 private:
  Hold* h_;
};

// Probe calls queued behind a running probe whose callers gave up (their
// deadline passed) probe nothing: a burst of them is not a burst of probes
// run after their callers left.
// An agent at a loopback address (the default --listen 127.0.0.1:0)
// registering with a planner on another host is unreachable from there and
// from peers, and says so at start; all on one machine it is fine.
TEST(LocalOnlyAddressWarningTest, ALoopbackAgentOfARemotePlannerIsWarnedAbout) {
  EXPECT_THAT(LocalOnlyAddressWarning("127.0.0.1:41000", "planner.example:7070"),
              HasSubstr("this node registers 127.0.0.1:41000, which only this machine reaches, "
                        "with the planner at planner.example:7070"));
  EXPECT_THAT(LocalOnlyAddressWarning("localhost:41000", "10.1.2.3:7070"),
              HasSubstr("--advertise HOST:PORT"));
  EXPECT_EQ(LocalOnlyAddressWarning("127.0.0.1:41000", "127.0.0.1:7070"), "");
  EXPECT_EQ(LocalOnlyAddressWarning("10.1.2.4:41000", "10.1.2.3:7070"), "");
  EXPECT_EQ(LocalOnlyAddressWarning("[::1]:41000", "unix:/run/hap-planner.sock"), "");
}

TEST_F(AgentTest, AProbeCallWhoseDeadlinePassedWhileQueuedProbesNothing) {
  HeldProber::Hold hold;
  auto agent = StartOn(Options("node-a"), std::make_unique<HeldProber>(&state_, &hold));
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(Registered("node-a"));
  ASSERT_EQ(state_.probes.load(), 1);
  auto stub = AgentStub(**agent);
  ASSERT_TRUE(stub);
  auto probe = [&](absl::Duration timeout) {
    grpc::ClientContext ctx;
    hap::service::PrepareClientContext(&ctx, {}, timeout);
    v1::ProbeResponse r;
    return FromGrpc(stub->Probe(&ctx, v1::ProbeRequest(), &r));
  };
  hold.hold = true;
  std::thread running([&] { EXPECT_THAT(probe(absl::Seconds(30)), IsOk()); });
  for (int i = 0; i < 2000 && hold.waiting == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(hold.waiting.load(), 1);
  std::vector<std::thread> queued;
  for (int i = 0; i < 3; ++i) {
    queued.emplace_back([&] {
      EXPECT_THAT(probe(absl::Milliseconds(200)),
                  StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("")));
    });
  }
  for (auto& t : queued) t.join();
  // The handlers' deadlines are the server's: the time left when a call
  // arrived, counted from its arrival, which on a loaded machine can be
  // later than the client's (a third probe ran in CI). Released once every
  // one of them has passed too, whenever the calls arrived.
  absl::SleepFor(absl::Seconds(1));
  hold.hold = false;
  running.join();
  (*agent)->Shutdown();  // the queued calls' handlers are done
  EXPECT_EQ(state_.probes.load(), 2);
}

TEST_F(AgentTest, MeasuresTheAssignedPeersAndReportsTheLinks) {
  FakeProber::State state_b;
  std::unique_ptr<Agent> b;
  auto agent = NodeAWithPeerB(&state_b, &b);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.links.empty(); }));
  v1::Link link = planner_.Snapshot().links[0];
  EXPECT_EQ(link.src(), "node-a/cpu0");
  EXPECT_EQ(link.dst(), "node-b/cpu0");
  EXPECT_GT(link.bandwidth_bytes_per_second(), 0);
  EXPECT_GT(link.latency_seconds(), 0);
  EXPECT_EQ(link.kind(), v1::LOOPBACK);
  // Said by whom, so that the planner takes reports of the node's agent only.
  EXPECT_EQ(planner_.Snapshot().report_addresses[0], agent->address());
}

// A planner that lost the node (restarted without its database, or expired
// it) lost its links too: registered again, the agent measures and reports
// them at once, not a --link-probe-seconds (here an hour) later.
TEST_F(AgentTest, LinksAreMeasuredAgainWhenThePlannerForgotTheNode) {
  FakeProber::State state_b;
  std::unique_ptr<Agent> b;
  auto agent = NodeAWithPeerB(&state_b, &b);
  ASSERT_TRUE(agent);
  auto from_a = [](const Record& r) {
    return std::count_if(r.links.begin(), r.links.end(),
                         [](const v1::Link& l) { return l.src() == "node-a/cpu0"; });
  };
  ASSERT_TRUE(planner_.WaitFor([&](const Record& r) { return from_a(r) >= 1; }));
  const auto reported = from_a(planner_.Snapshot());
  planner_.Forget("node-a");
  ASSERT_TRUE(Registered("node-a", 2));
  EXPECT_TRUE(planner_.WaitFor([&](const Record& r) { return from_a(r) >= 2 * reported; }));
}

// Each peer's links are reported on their own: a peer whose device the
// planner refuses (node-c's here, as an unregistered one) loses its own
// links only; before, one report held every peer's and all were lost.
TEST_F(AgentTest, APeerWhoseLinksThePlannerRefusesLosesOnlyItsOwn) {
  FakeProber::State state_b, state_c;
  auto c = StartAgent(Options("node-c"), &state_c);
  auto b = StartAgent(Options("node-b"), &state_b);
  ASSERT_TRUE(b && c);
  ASSERT_TRUE(Registered("node-b") && Registered("node-c"));
  planner_.RefuseLinksNaming("node-c/cpu0");
  for (const auto& [node, peer] : {std::pair<std::string, Agent*>{"node-c", c.get()},
                                   std::pair<std::string, Agent*>{"node-b", b.get()}}) {
    AssignPeer(node, peer->address(), 1 << 16);
  }
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.links.empty(); }));
  const Record r = planner_.Snapshot();
  ASSERT_EQ(r.links.size(), 1u);
  EXPECT_EQ(r.links[0].dst(), "node-b/cpu0");
}

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
void AssignStuckPeer(const StuckPeer& peer, FakePlanner* planner, AgentOptions* o) {
  v1::ProbeAssignment a;
  a.set_peer_node("stuck");
  a.set_peer_address(peer.address());
  planner->AssignProbe("node-a", a);
  o->link.timeout = absl::Hours(1);
}

// `agent` once its link thread measures `peer` (which never answers: the
// measurement holds the probe lock until Shutdown); nullptr, failing the
// test, when it does not start.
std::unique_ptr<Agent> WhileMeasuring(StuckPeer& peer, std::unique_ptr<Agent> agent) {
  for (int i = 0; agent && i < 2000 && !peer.echo_started; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!peer.echo_started) {
    ADD_FAILURE() << "the agent did not start measuring the stuck peer";
    return nullptr;
  }
  return agent;
}

// Shutdown cancels a link measurement in flight, as it does the agent's
// other calls, rather than waiting out its deadline (an hour here).
TEST_F(AgentTest, ShutdownCancelsALinkProbeToAPeerThatDoesNotAnswer) {
  StuckPeer peer;
  AgentOptions o = Options("node-a");
  AssignStuckPeer(peer, &planner_, &o);
  auto agent = WhileMeasuring(peer, StartAgent(o, &state_));
  ASSERT_TRUE(agent);
  agent->Shutdown();
  for (int i = 0; i < 3000 && !peer.echo_ended; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(peer.echo_cancelled);
}

// Two GPU-like devices and the links between them, as the GPU prober
// reports them; or a link probe that fails.
class FakeGpuPairProber : public DeviceProber {
 public:
  // `gpu1_to_gpu0` is the bandwidth measured from gpu1 to gpu0 (gpu0 to
  // gpu1 measures 200e9 B/s).
  explicit FakeGpuPairProber(bool links_fail, double gpu1_to_gpu0 = 200e9)
      : links_fail_(links_fail), gpu1_to_gpu0_(gpu1_to_gpu0) {}
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions&) override {
    std::vector<v1::Device> devices;
    for (int i = 0; i < 2; ++i) {
      v1::Device d;
      d.set_id(absl::StrCat(node, "/gpu", i));
      d.set_kind(v1::GPU);
      d.set_node(node);
      d.set_local_index(i);
      auto* f = d.add_flops();
      f->set_dtype(v1::FLOAT32);
      f->set_flops(5e12);
      d.set_memory_bytes(int64_t{80} << 30);
      devices.push_back(d);
    }
    return devices;
  }
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions&) override {
    return std::vector<double>{5e12, 5e12};
  }
  absl::StatusOr<std::vector<v1::Link>> ProbeLinks(const std::string& node,
                                                   const ProbeOptions&) override {
    if (links_fail_) return absl::UnavailableError("peer copy failed");
    std::vector<v1::Link> links;
    for (auto [src, dst] : {std::pair{0, 1}, std::pair{1, 0}}) {
      v1::Link l;
      l.set_src(absl::StrCat(node, "/gpu", src));
      l.set_dst(absl::StrCat(node, "/gpu", dst));
      l.set_bandwidth_bytes_per_second(src == 0 ? 200e9 : gpu1_to_gpu0_);
      l.set_latency_seconds(5e-6);
      l.set_kind(v1::NVLINK);
      links.push_back(l);
    }
    return links;
  }

 private:
  bool links_fail_;
  double gpu1_to_gpu0_;
};

TEST_F(AgentTest, LinksBetweenItsOwnDevicesAreInTheProfileAndReported) {
  auto agent = StartOn(Options("node-g"), std::make_unique<FakeGpuPairProber>(false));
  ASSERT_THAT(agent, IsOk());
  // Reported right after registering, with no peer assigned.
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.links.size() >= 2; }));
  Record r = planner_.Snapshot();
  EXPECT_EQ(r.links[0].src(), "node-g/gpu0");
  EXPECT_EQ(r.links[0].dst(), "node-g/gpu1");
  EXPECT_EQ(r.links[0].kind(), v1::NVLINK);
  EXPECT_EQ(r.nodes.at("node-g").devices_size(), 2);

  auto stub = AgentStub(**agent);
  ASSERT_TRUE(stub);
  auto profile = GetProfile(*stub);
  ASSERT_THAT(profile, IsOk());
  ASSERT_EQ(profile->links_size(), 2);
  EXPECT_EQ(profile->links(1).src(), "node-g/gpu1");
  EXPECT_EQ(profile->links(1).dst(), "node-g/gpu0");
}

// A link between its own devices measured as what the planner refuses (a
// bandwidth that is not a number, zero, or past kMaxLinkBandwidth, from a
// broken timing) went into the profile and into the report of the node's
// own links, which the planner refuses whole: every one of them was lost,
// at every link measurement. Such a link is left out; the others are
// reported.
TEST_F(AgentTest, AnOwnLinkThePlannerWouldRefuseIsLeftOutAndTheOthersReported) {
  const double bad[] = {std::numeric_limits<double>::quiet_NaN(), 0, -1e9,
                        2 * service::kMaxLinkBandwidth};
  for (size_t i = 0; i < std::size(bad); ++i) {
    const std::string node = absl::StrCat("node-g", i);
    SCOPED_TRACE(absl::StrCat(node, ": gpu1 -> gpu0 measured ", bad[i], " B/s"));
    auto agent = StartOn(Options(node), std::make_unique<FakeGpuPairProber>(false, bad[i]));
    ASSERT_THAT(agent, IsOk());
    // Both links go in one report: once gpu0 -> gpu1 is in, so is any other.
    ASSERT_TRUE(planner_.WaitFor([&](const Record& r) {
      return std::any_of(r.links.begin(), r.links.end(),
                         [&](const v1::Link& l) { return l.src() == node + "/gpu0"; });
    }));
    for (const v1::Link& l : planner_.Snapshot().links) {
      EXPECT_NE(l.src(), node + "/gpu1") << "reported: " << l.ShortDebugString();
    }
    auto stub = AgentStub(**agent);
    ASSERT_TRUE(stub);
    auto profile = GetProfile(*stub);
    ASSERT_THAT(profile, IsOk());
    ASSERT_EQ(profile->links_size(), 1);
    EXPECT_EQ(profile->links(0).src(), node + "/gpu0");
    EXPECT_EQ(profile->node().devices_size(), 2);  // the devices are kept
  }
}

TEST_F(AgentTest, AFailingLocalLinkProbeLeavesTheDevicesRegistered) {
  auto agent = StartOn(Options("node-g"), std::make_unique<FakeGpuPairProber>(true));
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(Registered("node-g"));
  EXPECT_EQ(planner_.Snapshot().nodes.at("node-g").devices_size(), 2);
  EXPECT_TRUE(planner_.Snapshot().links.empty());
}

// A prober whose every probe fails as a GPU's does when the device is gone
// or broken; counts its attempts.
class FailingProber : public DeviceProber {
 public:
  explicit FailingProber(std::atomic<int>* attempts) : attempts_(attempts) {}
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string&, const ProbeOptions&) override {
    ++*attempts_;
    return absl::InternalError("cudaGetDeviceCount: no CUDA-capable device is detected");
  }
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions&) override {
    return absl::InternalError("cudaGetDeviceCount: no CUDA-capable device is detected");
  }

 private:
  std::atomic<int>* attempts_;
};

// A device probe that fails keeps the agent up and probing again, and
// whoever asks it for its profile (a peer measuring the link, hapctl) is
// told why there is none, not that its first probe has not finished.
TEST_F(AgentTest, AFailingDeviceProbeIsRetriedAndItsErrorServed) {
  std::atomic<int> attempts{0};
  auto agent = StartOn(Options("node-f"), std::make_unique<FailingProber>(&attempts));
  ASSERT_THAT(agent, IsOk());
  for (int i = 0; i < 6000 && attempts < 3; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_GE(attempts.load(), 3);
  auto stub = AgentStub(**agent);
  ASSERT_TRUE(stub);
  EXPECT_THAT(GetProfile(*stub),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("its last probe failed"),
                                        HasSubstr("no CUDA-capable device is detected"))));
  grpc::ClientContext ctx;
  v1::ProbeResponse r;
  EXPECT_THAT(FromGrpc(stub->Probe(&ctx, v1::ProbeRequest(), &r)),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("no CUDA-capable device")));
  EXPECT_EQ(planner_.Snapshot().registrations, 0);
}

// A FakeProber whose first `failures` probes fail (a GPU not back yet).
class FailingFirstProber : public FakeProber {
 public:
  FailingFirstProber(State* s, int failures) : FakeProber(s), failures_(failures) {}
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions& o) override {
    if (failures_-- > 0) return absl::UnavailableError("the GPU is not back yet");
    return FakeProber::Probe(node, o);
  }

 private:
  int failures_;
};

// Retries of a failing first probe doubled the backoff, and the
// registration's retries started from there (up to max_backoff, 10 s by
// default, for its first retry). A probe that succeeds starts them afresh.
TEST_F(AgentTest, RegistrationRetriesStartAfreshAfterProbeRetries) {
  planner_.RefuseRegistrations(1);
  AgentOptions o = Options("node-a");
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Seconds(10);
  o.random = [] { return 0.0; };  // each wait half the backoff
  ::testing::internal::CaptureStderr();
  auto agent = StartOn(o, std::make_unique<FailingFirstProber>(&state_, 4));
  const bool registered = agent.ok() && Registered("node-a");
  if (agent.ok()) agent->reset();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(registered);
  // Probes waited 10, 20 and 40 ms (the one inside Start is not retried).
  EXPECT_THAT(log, HasSubstr("the GPU is not back yet; retrying in 40ms"));
  EXPECT_THAT(log, HasSubstr("the fake planner is refusing; retrying in 10ms"));
}

// Probes that waited for the probe lock when SIGTERM came (a planner's
// re-probe, a Probe call) probe nothing: each ran a full probe after the
// other, delaying the exit by their sum. Here a link measurement to a peer
// that never answers holds the lock until Shutdown cancels it.
TEST_F(AgentTest, ProbesWaitingWhenShutdownComesProbeNothing) {
  StuckPeer peer;
  AgentOptions o = Options("node-a");
  AssignStuckPeer(peer, &planner_, &o);
  auto agent = WhileMeasuring(peer, StartAgent(o, &state_));
  ASSERT_TRUE(agent);  // its link thread holds the probe lock
  planner_.RequestReprobe("node-a");
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  std::thread caller([&] {
    grpc::ClientContext ctx;
    v1::ProbeResponse r;
    EXPECT_FALSE(stub->Probe(&ctx, v1::ProbeRequest(), &r).ok());
  });
  const int before = planner_.Snapshot().heartbeats;  // the re-probe is asked for and queued
  ASSERT_TRUE(planner_.WaitFor([&](const Record& r) { return r.heartbeats >= before + 5; }));
  agent->Shutdown();
  caller.join();
  EXPECT_EQ(state_.probes.load(), 1);  // the one at start
}

// A FakeProber whose probe number `long_probe` (0 = the first, inside
// Start) runs until told to stop (a long probe: many GPUs, a large
// --probe-seconds, a throttled CPU); the others return at once.
class UntilStoppedProber : public FakeProber {
 public:
  struct Seen {
    std::atomic<bool> probing{false}, stopped{false};
  };
  UntilStoppedProber(State* s, Seen* seen, int long_probe = 1)
      : FakeProber(s), seen_(seen), long_probe_(long_probe) {}
  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions& o) override {
    if (probes_++ != long_probe_) return FakeProber::Probe(node, o);
    seen_->probing = true;
    for (int i = 0; i < 3000 && !o.stop(); ++i) absl::SleepFor(absl::Milliseconds(10));
    seen_->stopped = o.stop();
    HAP_RETURN_IF_ERROR(CheckNotStopped(o, "the next run"));
    return FakeProber::Probe(node, o);
  }

 private:
  Seen* seen_;
  const int long_probe_;
  int probes_ = 0;
};

// Shutdown (SIGTERM) while a probe runs ends the probe at its next run
// rather than waiting for all of it.
TEST_F(AgentTest, ShutdownStopsAProbeThatRuns) {
  UntilStoppedProber::Seen seen;
  auto agent = StartOn(Options("node-a"), std::make_unique<UntilStoppedProber>(&state_, &seen));
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(Registered("node-a"));
  planner_.RequestReprobe("node-a");
  for (int i = 0; i < 3000 && !seen.probing; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(seen.probing);
  (*agent)->Shutdown();
  EXPECT_TRUE(seen.stopped);
}

// Probe calls without a deadline while a probe runs queued without a
// bound, each holding a server thread for a whole probe. One over
// kMaxProbeCalls is refused at once; the others wait for the probe.
TEST_F(AgentTest, ProbeCallsOverTheBoundAreRefusedAtOnce) {
  UntilStoppedProber::Seen seen;
  auto agent = StartOn(Options("node-a"), std::make_unique<UntilStoppedProber>(&state_, &seen));
  ASSERT_THAT(agent, IsOk());
  auto stub = AgentStub(**agent);
  ASSERT_TRUE(stub);
  std::atomic<int> answered{0}, refused{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < kMaxProbeCalls + 1; ++i) {
    callers.emplace_back([&] {
      grpc::ClientContext ctx;  // no deadline
      v1::ProbeResponse r;
      const grpc::Status s = stub->Probe(&ctx, v1::ProbeRequest(), &r);
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
          absl::StrContains(s.error_message(), "probe calls are in progress")) {
        ++refused;
      }
      ++answered;
    });
  }
  for (int i = 0; i < 3000 && answered == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(refused.load(), 1);
  EXPECT_EQ(answered.load(), 1);  // the others wait for the probe that runs
  EXPECT_TRUE(seen.probing);
  (*agent)->Shutdown();
  for (auto& t : callers) t.join();
  EXPECT_EQ(refused.load(), 1);
}

// SIGTERM during the first probe, which Start runs before the daemon can
// wait for the signal: the probe ends at its next run (the daemon's
// stop_requested says so) and Start returns, instead of the exit waiting
// for all of the probe.
TEST_F(AgentTest, AStopAskedForDuringTheFirstProbeEndsIt) {
  UntilStoppedProber::Seen seen;
  std::atomic<bool> sigterm{false};
  AgentOptions o = Options("node-a");
  o.stop_requested = [&sigterm] { return sigterm.load(); };
  absl::StatusOr<std::unique_ptr<Agent>> agent;
  std::thread starter(
      [&] { agent = StartOn(o, std::make_unique<UntilStoppedProber>(&state_, &seen, 0)); });
  for (int i = 0; i < 3000 && !seen.probing; ++i) absl::SleepFor(absl::Milliseconds(10));
  sigterm = true;
  starter.join();
  ASSERT_TRUE(seen.probing);
  EXPECT_TRUE(seen.stopped);
  ASSERT_THAT(agent, IsOk());  // a failed first probe is logged, not fatal
  (*agent)->Shutdown();
  EXPECT_EQ(state_.probes.load(), 0);  // the stopped probe measured nothing
}

// A Probe call with include_links measures the peers within the caller's
// deadline: before, it gave each peer the link timeout (an hour here), its
// handler went on long after the caller left, and held the probe lock (the
// planner's re-probes waited) until the peer answered.
TEST_F(AgentTest, AProbeCallMeasuresThePeersWithinItsDeadline) {
  StuckPeer peer;
  AgentOptions o = Options("node-a");
  AssignStuckPeer(peer, &planner_, &o);
  o.link_probe_delay = absl::Hours(1);  // only the Probe call measures
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  grpc::ClientContext ctx;
  hap::service::PrepareClientContext(&ctx, {}, absl::Seconds(2));
  v1::ProbeRequest req;
  req.set_include_links(true);
  v1::ProbeResponse r;
  EXPECT_THAT(FromGrpc(stub->Probe(&ctx, req, &r)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("")));
  ASSERT_TRUE(peer.echo_started);
  // The caller's 2 s as gRPC carries a deadline (rounded up), not the hour.
  EXPECT_LT(peer.echo_given, absl::Minutes(1));
}

// The same for its link reports to the planner: each was given the whole
// rpc_timeout (an hour here) whatever the caller's deadline, so with a
// planner that does not answer the handler ran on long after the caller
// left.
TEST_F(AgentTest, AProbeCallsLinkReportsEndByItsDeadline) {
  FakeProber::State state_b;
  auto b = NodeBAssigned(&state_b, 1 << 20);
  ASSERT_TRUE(b);
  AgentOptions o = Options("node-a");
  o.rpc_timeout = absl::Hours(1);
  o.link_probe_delay = absl::Hours(1);  // only the Probe call measures
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  planner_.HoldReportLinks(true);
  auto stub = AgentStub(*agent);
  ASSERT_TRUE(stub);
  grpc::ClientContext ctx;
  hap::service::PrepareClientContext(&ctx, {}, absl::Seconds(2));
  v1::ProbeRequest req;
  req.set_include_links(true);
  v1::ProbeResponse r;
  EXPECT_THAT(FromGrpc(stub->Probe(&ctx, req, &r)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("")));
  ASSERT_TRUE(planner_.WaitFor([](const Record& x) { return !x.held_reports_given.empty(); }));
  // The caller's 2 s as gRPC carries a deadline (rounded up), not the hour.
  EXPECT_LT(planner_.Snapshot().held_reports_given[0], absl::Minutes(1));
}

TEST(AgentTokenTest, SendsTheTokenToThePlannerAndRequiresItFromCallers) {
  FakePlanner planner(absl::Milliseconds(20), "tok");
  FakeProber::State state;
  AgentOptions o;
  o.planner = planner.address();
  o.name = "node-t";
  o.drift = 0;
  o.security.token = "tok";
  auto agent = StartOn(o, std::make_unique<FakeProber>(&state));
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(planner.WaitFor([](const Record& r) { return r.heartbeats >= 2; }));

  auto stub = AgentStub(**agent);
  ASSERT_TRUE(stub);
  EXPECT_THAT(GetProfile(*stub),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bearer token")));
  EXPECT_THAT(GetProfile(*stub, o.security), IsOk());
}

TEST(AgentStartTest, RejectsMissingPlannerOrName) {
  AgentOptions o;
  o.name = "n";
  EXPECT_THAT(Agent::Start(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("planner address is required")));
  o.planner = "127.0.0.1:1";
  o.name = "";
  EXPECT_THAT(Agent::Start(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node name")));
  for (const std::string& bad : {std::string("bad name/x"), std::string(254, 'a')}) {
    o.name = bad;  // refused by the planner at every registration
    EXPECT_THAT(Agent::Start(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("must be 1-253 letters, digits")));
  }
  o.name = "n";
  o.drift = -1;
  EXPECT_THAT(Agent::Start(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("drift")));
}

TEST(AgentStartTest, DevicesGpuWithoutCudaOrAGpuFailsToStartNamingWhy) {
  if (BuiltWithCuda() && MakeDeviceProbers(DeviceSelection::kGpu).ok()) {
    GTEST_SKIP() << "built with CUDA and a GPU is visible: --devices gpu works here";
  }
  AgentOptions o;
  o.planner = "127.0.0.1:1";
  o.name = "n";
  o.devices = DeviceSelection::kGpu;
  EXPECT_THAT(Agent::Start(o),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr(BuiltWithCuda() ? "no GPU is visible" : "built without CUDA")));
}

// Shutdown ends the wait between registration retries (half an hour at
// least here) at once: a hang is the test's timeout, not a timed assertion.
TEST_F(AgentTest, ShutdownIsPromptWhileRetryingTheRegistration) {
  planner_.RefuseRegistrations(1000);
  AgentOptions o = Options("node-a");
  o.initial_backoff = o.max_backoff = absl::Hours(1);
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.refused_registrations >= 1; }));
  agent->Shutdown(absl::Seconds(1));
  EXPECT_EQ(planner_.Snapshot().refused_registrations, 1);
}

}  // namespace
}  // namespace hap::agent
