// The agent daemon against a fake planner: registration with retries,
// heartbeats, executors' labels, re-registration after unknown_node,
// re-probes on request and on drift, Probe calls, tokens, shutdown (its link
// measurements: agent_links_test.cc).
#include "profiler_agent/agent_test_util.h"

namespace hap::agent::agent_test {
namespace {

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
  std::unique_ptr<Agent> first, second;
  ASSERT_TRUE(TwoAgentsOfNodeA(Options("node-a"), &first, &second));
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
  std::unique_ptr<Agent> first, second;
  ASSERT_TRUE(TwoAgentsOfNodeA(o, &first, &second));
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
  // Three re-probe ticks that asked the executor and found it training
  // (counted, not timed: under load 15 heartbeats held only 3 such ticks).
  const int asked = executor.asked();
  for (int i = 0; i < 6000 && executor.asked() < asked + 3; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(executor.asked(), asked + 3);
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

// node-a's agent, its probes after the first held while `hold_.hold` is
// set, registered, with a stub to it.
class HeldAgentTest : public AgentTest {
 protected:
  bool StartHeld() {
    auto agent = StartOn(Options("node-a"), std::make_unique<HeldProber>(&state_, &hold_));
    if (!agent.ok() || !Registered("node-a")) return false;
    agent_ = *std::move(agent);
    stub_ = AgentStub(*agent_);
    return stub_ != nullptr && state_.probes.load() == 1;
  }
  // Holds the probes from now, asks a re-probe and waits until it is held.
  bool HoldTheNextProbe() {
    hold_.hold = true;
    planner_.RequestReprobe("node-a");
    for (int i = 0; i < 3000 && hold_.waiting == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
    return hold_.waiting.load() == 1;
  }
  HeldProber::Hold hold_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<v1::Agent::Stub> stub_;
};

// Probe calls queued behind a running probe whose callers gave up (their
// deadline passed) probe nothing: a burst of them is not a burst of probes
// run after their callers left.
TEST_F(HeldAgentTest, AProbeCallWhoseDeadlinePassedWhileQueuedProbesNothing) {
  ASSERT_TRUE(StartHeld());
  auto probe = [&](absl::Duration timeout) {
    grpc::ClientContext ctx;
    hap::service::PrepareClientContext(&ctx, {}, timeout);
    v1::ProbeResponse r;
    return FromGrpc(stub_->Probe(&ctx, v1::ProbeRequest(), &r));
  };
  hold_.hold = true;
  std::thread running([&] { EXPECT_THAT(probe(absl::Seconds(30)), IsOk()); });
  for (int i = 0; i < 2000 && hold_.waiting == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(hold_.waiting.load(), 1);
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
  hold_.hold = false;
  running.join();
  agent_->Shutdown();  // the queued calls' handlers are done
  EXPECT_EQ(state_.probes.load(), 2);
}

// A second Shutdown while the first waited for the agent's threads (a
// signal handler's and the destructor's) returned at once, so its caller
// could destroy the agent under the first. It now returns when the agent
// is down, as the first does.
TEST_F(HeldAgentTest, ASecondShutdownReturnsOnlyOnceTheAgentIsDown) {
  ASSERT_TRUE(StartHeld());
  ASSERT_TRUE(HoldTheNextProbe());  // the probe thread is held: Shutdown waits for it
  std::atomic<bool> first_done{false}, second_done{false};
  std::thread first([&] {
    agent_->Shutdown();
    first_done = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  std::thread second([&] {
    agent_->Shutdown();
    second_done = true;
  });
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(first_done);
  EXPECT_FALSE(second_done);
  hold_.hold = false;
  first.join();
  second.join();
  EXPECT_EQ(hold_.waiting.load(), 0);
}

// A Probe call whose caller cancelled it (a killed client, a given-up
// watch) while it waited for another probe was probed for when its turn
// came, as one that waits: only its deadline was looked at.
TEST_F(HeldAgentTest, AProbeCallCancelledWhileQueuedProbesNothing) {
  ASSERT_TRUE(StartHeld());
  ASSERT_TRUE(HoldTheNextProbe());  // a re-probe runs, held
  grpc::ClientContext queued_ctx;   // no deadline
  std::thread queued([&] {
    v1::ProbeResponse r;
    EXPECT_EQ(stub_->Probe(&queued_ctx, v1::ProbeRequest(), &r).error_code(),
              grpc::StatusCode::CANCELLED);
  });
  absl::SleepFor(absl::Seconds(1));  // the call arrives and waits for the probe that runs
  queued_ctx.TryCancel();
  queued.join();
  absl::SleepFor(absl::Seconds(1));  // the cancellation reaches the server
  hold_.hold = false;
  for (int i = 0; i < 3000 && state_.probes < 2; ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(500));  // a queued probe would have run by now
  agent_->Shutdown();
  EXPECT_EQ(state_.probes.load(), 2);
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

// A FakeProber whose quick FLOP/s check number `long_check` (0 = the
// baseline after the probe inside Start) runs until told to stop (a drift
// check of many GPUs, half a second each); the others return at once.
class UntilStoppedQuickProber : public FakeProber {
 public:
  UntilStoppedQuickProber(State* s, UntilStoppedProber::Seen* seen, int long_check)
      : FakeProber(s), seen_(seen), long_check_(long_check) {}
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions& o) override {
    if (checks_++ != long_check_) return FakeProber::QuickFlops(o);
    seen_->probing = true;
    for (int i = 0; i < 3000 && !o.stop(); ++i) absl::SleepFor(absl::Milliseconds(10));
    seen_->stopped = o.stop();
    HAP_RETURN_IF_ERROR(CheckNotStopped(o, "the next run"));
    return FakeProber::QuickFlops(o);
  }

 private:
  UntilStoppedProber::Seen* seen_;
  const int long_check_;
  int checks_ = 0;
};

// Shutdown while a drift check's quick FLOP/s check runs ends it at its
// next run, as it ends a probe: the check was given the configured probe
// options, whose stop never says so, and the exit waited for all of it.
TEST_F(AgentTest, ShutdownStopsADriftCheckThatRuns) {
  UntilStoppedProber::Seen seen;
  AgentOptions o = Options("node-a");
  o.drift = 0.2;
  o.drift_check_interval = absl::Milliseconds(20);
  auto agent = StartOn(o, std::make_unique<UntilStoppedQuickProber>(&state_, &seen, 1));
  ASSERT_THAT(agent, IsOk());
  for (int i = 0; i < 3000 && !seen.probing; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(seen.probing);
  (*agent)->Shutdown();
  EXPECT_TRUE(seen.stopped);
}

// A Probe call cancelled while its probe runs (a long one: many GPUs, a
// large max_duration) ends the probe at its next run, as Shutdown does,
// and keeps the profile the agent serves. Before, the probe ran on for
// nobody, holding the probe lock.
TEST_F(AgentTest, AProbeCallCancelledWhileItProbesEndsTheProbeAndKeepsTheProfile) {
  UntilStoppedProber::Seen seen;
  auto agent = StartOn(Options("node-a"), std::make_unique<UntilStoppedProber>(&state_, &seen));
  ASSERT_THAT(agent, IsOk());
  ASSERT_TRUE(Registered("node-a"));
  auto stub = AgentStub(**agent);
  ASSERT_TRUE(stub);
  auto profile = [&]() -> absl::StatusOr<v1::ProbeResponse> {
    grpc::ClientContext ctx;
    v1::ProbeResponse r;
    HAP_RETURN_IF_ERROR(FromGrpc(stub->GetProfile(&ctx, v1::GetProfileRequest(), &r)));
    return r;
  };
  auto before = profile();
  ASSERT_THAT(before, IsOk());
  grpc::ClientContext ctx;  // no deadline
  std::thread caller([&] {
    v1::ProbeResponse r;
    EXPECT_EQ(stub->Probe(&ctx, v1::ProbeRequest(), &r).error_code(), grpc::StatusCode::CANCELLED);
  });
  for (int i = 0; i < 3000 && !seen.probing; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(seen.probing);
  ctx.TryCancel();
  caller.join();
  for (int i = 0; i < 3000 && !seen.stopped; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(seen.stopped);
  auto after = profile();
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->SerializeAsString(), before->SerializeAsString());
  (*agent)->Shutdown();
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
}  // namespace hap::agent::agent_test
