// The agent daemon against a fake planner: registration with retries,
// heartbeats, re-registration after unknown_node, re-probes on request and on
// drift, peer link probes, tokens, shutdown.
#include "profiler_agent/agent.h"

#include <atomic>
#include <chrono>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/agent_service.grpc.pb.h"
#include "planner/util/status_matchers.h"
#include "profiler_agent/fake_planner.h"

namespace hap::agent {
namespace {

using ::hap::agent::testing::FakePlanner;
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
    std::vector<std::unique_ptr<DeviceProber>> probers;
    probers.push_back(std::make_unique<FakeProber>(state));
    auto agent = Agent::Start(std::move(o), std::move(probers));
    EXPECT_THAT(agent, IsOk());
    return agent.ok() ? std::move(*agent) : nullptr;
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

TEST_F(AgentTest, RetriesRegistrationWithBackoffWhileThePlannerRefuses) {
  planner_.RefuseRegistrations(3);
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  Record r = planner_.Snapshot();
  EXPECT_EQ(r.refused_registrations, 3);
  EXPECT_EQ(r.registrations, 1);
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
  auto channel = hap::service::MakeChannel(agent->listen_address(), {});
  ASSERT_THAT(channel, IsOk());
  auto stub = v1::Agent::NewStub(*channel);
  grpc::ClientContext ctx;
  v1::ProbeResponse profile;
  ASSERT_THAT(FromGrpc(stub->GetProfile(&ctx, v1::GetProfileRequest(), &profile)), IsOk());
  EXPECT_EQ(profile.node().name(), "node-a");
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
  EXPECT_EQ(r.registrations, 1);
}

TEST_F(AgentTest, ReprobesWhenTheQuickCheckDrifts) {
  AgentOptions o = Options("node-a");
  o.drift = 0.2;
  o.drift_check_interval = absl::Milliseconds(20);
  auto agent = StartAgent(o, &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
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

TEST_F(AgentTest, TheProbeRpcProbesAndTheNextHeartbeatCarriesTheDevices) {
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(Registered("node-a"));
  state_.flops = 7e9;
  auto channel = hap::service::MakeChannel(agent->listen_address(), {});
  ASSERT_THAT(channel, IsOk());
  auto stub = v1::Agent::NewStub(*channel);
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

TEST_F(AgentTest, MeasuresTheAssignedPeersAndReportsTheLinks) {
  FakeProber::State state_b;
  auto b = StartAgent(Options("node-b"), &state_b);
  ASSERT_TRUE(b);
  ASSERT_TRUE(Registered("node-b"));
  v1::ProbeAssignment a;
  a.set_peer_node("node-b");
  a.set_peer_address(b->address());
  a.set_bytes(1 << 20);
  planner_.AssignProbe("node-a", a);
  auto agent = StartAgent(Options("node-a"), &state_);
  ASSERT_TRUE(agent);
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return !r.links.empty(); }));
  v1::Link link = planner_.Snapshot().links[0];
  EXPECT_EQ(link.src(), "node-a/cpu0");
  EXPECT_EQ(link.dst(), "node-b/cpu0");
  EXPECT_GT(link.bandwidth_bytes_per_second(), 0);
  EXPECT_GT(link.latency_seconds(), 0);
  EXPECT_EQ(link.kind(), v1::LOOPBACK);
}

TEST(AgentTokenTest, SendsTheTokenToThePlannerAndRequiresItFromCallers) {
  FakePlanner planner(absl::Milliseconds(20), "tok");
  FakeProber::State state;
  AgentOptions o;
  o.planner = planner.address();
  o.name = "node-t";
  o.drift = 0;
  o.security.token = "tok";
  std::vector<std::unique_ptr<DeviceProber>> probers;
  probers.push_back(std::make_unique<FakeProber>(&state));
  auto agent = Agent::Start(o, std::move(probers));
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(planner.WaitFor([](const Record& r) { return r.heartbeats >= 2; }));

  auto channel = hap::service::MakeChannel((*agent)->listen_address(), {});
  ASSERT_THAT(channel, IsOk());
  auto stub = v1::Agent::NewStub(*channel);
  v1::ProbeResponse r;
  {
    grpc::ClientContext ctx;
    EXPECT_THAT(FromGrpc(stub->GetProfile(&ctx, v1::GetProfileRequest(), &r)),
                StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bearer token")));
  }
  {
    grpc::ClientContext ctx;
    hap::service::PrepareClientContext(&ctx, o.security, absl::Seconds(5));
    EXPECT_THAT(FromGrpc(stub->GetProfile(&ctx, v1::GetProfileRequest(), &r)), IsOk());
  }
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
  o.name = "n";
  o.drift = -1;
  EXPECT_THAT(Agent::Start(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("drift")));
}

TEST(AgentStartTest, ShutdownIsPromptWhileRetryingAnUnreachablePlanner) {
  FakeProber::State state;
  AgentOptions o;
  o.planner = "127.0.0.1:1";
  o.name = "lonely";
  o.max_backoff = absl::Seconds(30);
  std::vector<std::unique_ptr<DeviceProber>> probers;
  probers.push_back(std::make_unique<FakeProber>(&state));
  auto agent = Agent::Start(o, std::move(probers));
  ASSERT_THAT(agent, IsOk());
  auto t0 = std::chrono::steady_clock::now();
  (*agent)->Shutdown(absl::Seconds(1));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
}

}  // namespace
}  // namespace hap::agent
