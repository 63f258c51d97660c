// The agent's link measurements against a fake planner: the peers it is
// assigned, the links between its own devices, what it reports and when it
// measures none, and Probe calls that ask for links.
#include "profiler_agent/agent_test_util.h"

namespace hap::agent::agent_test {
namespace {

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
  std::unique_ptr<Agent> first, second;
  ASSERT_TRUE(TwoAgentsOfNodeA(Options("node-a"), &first, &second));
  // The first agent's second refused heartbeat: it took the answer of the first.
  ASSERT_TRUE(planner_.WaitFor([](const Record& r) { return r.foreign_heartbeats >= 2; }));
  const int probes = state_.probes.load();
  EXPECT_THAT(ProbeForLinks(*first, absl::Seconds(30)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("the agent at " + second->address()),
                                        HasSubstr("nothing was probed"))));
  EXPECT_EQ(state_.probes.load(), probes);
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
  const int probes = state_.probes.load();
  EXPECT_THAT(ProbeForLinks(*agent, absl::Seconds(30)),
              StatusIs(absl::StatusCode::kUnavailable,
                       ::testing::AllOf(HasSubstr("probe assignments"), HasSubstr(address),
                                        HasSubstr("nothing was probed"))));
  EXPECT_EQ(state_.probes.load(), probes);
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
// links only; before, one report held every peer's and all were lost. A
// Probe call for links answers those the planner took: node-c's are left
// out, as a failed peer's (it answered them too, and its caller believed
// the planner held them).
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
  v1::ProbeResponse probed;
  ASSERT_THAT(ProbeForLinks(*agent, absl::Seconds(60), &probed), IsOk());
  std::vector<std::string> answered;
  for (const v1::Link& l : probed.links()) answered.push_back(l.dst());
  EXPECT_THAT(answered, ::testing::ElementsAre("node-b/cpu0"));
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
  EXPECT_THAT(ProbeForLinks(*agent, absl::Seconds(2)),
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
  EXPECT_THAT(ProbeForLinks(*agent, absl::Seconds(2)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("")));
  ASSERT_TRUE(planner_.WaitFor([](const Record& x) { return !x.held_reports_given.empty(); }));
  // The caller's 2 s as gRPC carries a deadline (rounded up), not the hour.
  EXPECT_LT(planner_.Snapshot().held_reports_given[0], absl::Minutes(1));
}

}  // namespace
}  // namespace hap::agent::agent_test
