// What agents report (registrations, heartbeats, link
// reports) as untrusted input. A report the planner accepts must never make
// later plans fail or come out non-finite.
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/core/planner_core.h"
#include "planner/service/core/planner_core_test_util.h"
#include "planner/service/core/profile_checks.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::testing::HasSubstr;
using testing_internal::MakeNode;
using testing_internal::MlpRequest;
using testing_internal::PlannerCoreTest;

// Every number a plan predicts is finite.
void ExpectFinitePlan(const v1::Plan& p) {
  EXPECT_TRUE(std::isfinite(p.prediction().step_seconds())) << p.prediction().DebugString();
  EXPECT_TRUE(std::isfinite(p.prediction().compute_seconds())) << p.prediction().DebugString();
  EXPECT_TRUE(std::isfinite(p.prediction().communication_seconds()))
      << p.prediction().DebugString();
  for (const auto& s : p.ratios()) {
    for (double r : s.ratios()) EXPECT_TRUE(std::isfinite(r)) << s.DebugString();
  }
}

// After a registration the planner accepted, a default plan (every live
// device) still succeeds with finite predictions.
void ExpectPlansStillWork(PlannerCore* core, absl::Time deadline, bool bf16 = false) {
  v1::CreatePlanRequest r = MlpRequest();
  if (bf16) r.mutable_options()->set_precision(v1::PRECISION_BF16);
  auto p = core->CreatePlan(r, deadline);
  ASSERT_TRUE(p.ok()) << "an accepted report poisons every plan: " << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  ExpectFinitePlan(*p);
}

TEST_F(PlannerCoreTest, OverlapEfficiencyOutsideZeroOneIsRefusedOrHarmless) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (double bad : {std::nan(""), 2.0, -1.0, std::numeric_limits<double>::infinity()}) {
    v1::Node b = MakeNode("b", 1, 1e12);
    b.mutable_devices(0)->set_overlap_efficiency(bad);
    absl::Status s = core_->RegisterNode(b).status();
    if (s.ok()) {
      ExpectPlansStillWork(core_.get(), Deadline());
      ASSERT_TRUE(core_->DeleteNode("b").ok());
    } else {
      EXPECT_THAT(s.message(), HasSubstr("overlap_efficiency")) << bad;
    }
  }
}

TEST_F(PlannerCoreTest, OverlapEfficiencyInAHeartbeatIsRefusedOrHarmless) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/b");
  *hb.mutable_devices() = MakeNode("b", 1, 1e12).devices();
  hb.mutable_devices(0)->set_overlap_efficiency(std::nan(""));
  if (core_->Heartbeat(hb).ok()) ExpectPlansStillWork(core_.get(), Deadline());
}

TEST_F(PlannerCoreTest, ZeroBf16FlopsIsRefusedOrHarmless) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ExpectPlansStillWork(core_.get(), Deadline(), /*bf16=*/true);
  v1::Node b = MakeNode("b", 1, 1e12);
  auto* f = b.mutable_devices(0)->add_flops();
  f->set_dtype(v1::BFLOAT16);
  f->set_flops(0);
  if (core_->RegisterNode(b).ok()) ExpectPlansStillWork(core_.get(), Deadline(), /*bf16=*/true);
}

// One FLOP/s a dtype: a second FLOAT32 entry would be validated on one and
// calibrated on the other.
TEST_F(PlannerCoreTest, AFlopsRateReportedTwiceIsRefused) {
  v1::Node b = MakeNode("b", 1, 1e12);
  auto* f = b.mutable_devices(0)->add_flops();
  f->set_dtype(v1::FLOAT32);
  f->set_flops(5e12);
  const absl::Status s = core_->RegisterNode(b).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("FLOAT32 FLOP/s is reported twice"), absl::string_view::npos) << s;
}

// Enum values this planner does not know are refused, naming them: a
// device of kind 99, and a rate for dtype 99 (DType_Name gave "", so the
// checks' messages named nothing), were registered and planned with.
TEST_F(PlannerCoreTest, UnknownDeviceKindsAndDtypesAreRefused) {
  v1::Node kind = MakeNode("b", 1, 1e12);
  kind.mutable_devices(0)->set_kind(static_cast<v1::DeviceKind>(99));
  EXPECT_THAT(core_->RegisterNode(kind).status(),
              hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("device 'b/cpu0': kind 99 is not a device kind")));
  v1::Node dtype = MakeNode("b", 1, 1e12);
  auto* f = dtype.mutable_devices(0)->add_flops();
  f->set_dtype(static_cast<v1::DType>(99));
  f->set_flops(5e12);
  EXPECT_THAT(
      core_->RegisterNode(dtype).status(),
      hap::testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("for dtype 99")));
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 0);
}

TEST_F(PlannerCoreTest, TinyPositiveFlopsIsRefusedOrHarmless) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::Node b = MakeNode("b", 1, std::numeric_limits<double>::denorm_min());
  if (core_->RegisterNode(b).ok()) ExpectPlansStillWork(core_.get(), Deadline());
}

// A FLOP/s rate or memory no device has (a broken agent's figure) made the
// device's compute free, or everything fit on it, in every plan.
TEST_F(PlannerCoreTest, FlopsOrMemoryNoDeviceHasIsRefusedNamingIt) {
  v1::Node b = MakeNode("b", 1, 1e19);
  EXPECT_THAT(core_->RegisterNode(b).status(),
              ::hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("device 'b/cpu0': FLOAT32 FLOP/s must be a finite "
                                                 "number >= 1e+06 and at most 1e+18, got 1e+19")));
  b = MakeNode("b", 1, 1e12);
  b.mutable_devices(0)->set_tf32_flops(1e30);
  EXPECT_THAT(core_->RegisterNode(b).status(),
              ::hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("tf32_flops must be a finite number >= 0 and at "
                                                 "most 1e+18, got 1e+30")));
  b = MakeNode("b", 1, 1e12);
  b.mutable_devices(0)->set_memory_bytes(int64_t{1} << 60);
  EXPECT_THAT(core_->RegisterNode(b).status(),
              ::hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("memory_bytes must be at most")));
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
}

// A link kind this planner does not know was stored and served in
// GetCluster and every plan's cluster as if known.
TEST_F(PlannerCoreTest, AnUnknownLinkKindIsRefusedNamingTheLink) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::Link l;
  l.set_src("a/cpu0");
  l.set_dst("a/cpu1");
  l.set_bandwidth_bytes_per_second(1e9);
  l.set_latency_seconds(1e-5);
  l.set_kind(static_cast<v1::LinkKind>(42));
  EXPECT_THAT(core_->ReportLinks("a", {l}),
              ::hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("link a/cpu0 -> a/cpu1: kind 42 is not a link "
                                                 "kind this planner knows")));
  EXPECT_EQ(core_->GetCluster(false).links_size(), 0);
  l.set_kind(v1::SHARED_MEMORY);
  ASSERT_TRUE(core_->ReportLinks("a", {l}).ok());
  EXPECT_EQ(core_->GetCluster(false).links_size(), 1);
}

TEST_F(PlannerCoreTest, TinyBandwidthOrHugeLatencyIsRefusedOrHarmless) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::Link l;
  l.set_src("a/cpu0");
  l.set_dst("a/cpu1");
  l.set_bandwidth_bytes_per_second(std::numeric_limits<double>::denorm_min());
  l.set_latency_seconds(1e-5);
  if (core_->ReportLinks("a", {l}).ok()) ExpectPlansStillWork(core_.get(), Deadline());
  l.set_bandwidth_bytes_per_second(1e9);
  l.set_latency_seconds(1e300);
  if (core_->ReportLinks("a", {l}).ok()) ExpectPlansStillWork(core_.get(), Deadline());
}

// Per-call, per-step and per-element seconds (or an op's time scale) of
// 1e300 or so summed over a step's kernels or parameters came out infinite
// (every later plan on the cluster FAILED: "terms[0].constant[2] = inf");
// they are refused, naming the field.
TEST_F(PlannerCoreTest, HugeOverheadsAreRefusedOrHarmless) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  const std::vector<std::pair<std::string, std::function<void(v1::Device*, double)>>> fields = {
      {"launch_overhead_seconds", &v1::Device::set_launch_overhead_seconds},
      {"step_overhead_seconds", &v1::Device::set_step_overhead_seconds},
      {"optimizer_seconds_per_element", &v1::Device::set_optimizer_seconds_per_element},
      {"op_time_scale",
       [](v1::Device* d, double v) { (*d->mutable_op_time_scale())["matmul"] = v; }},
  };
  for (const auto& [field, set] : fields) {
    for (double huge : {1e300, std::numeric_limits<double>::max()}) {
      v1::Node b = MakeNode("b", 1, 1e12);
      set(b.mutable_devices(0), huge);
      absl::Status s = core_->RegisterNode(b).status();
      if (s.ok()) {
        ExpectPlansStillWork(core_.get(), Deadline());
        ASSERT_TRUE(core_->DeleteNode("b").ok());
      } else {
        EXPECT_THAT(s.message(), HasSubstr(field)) << huge;
      }
    }
  }
}

// What a node reports besides numbers is shown (status page, GetCluster,
// hapctl), dialled (its address, hap.executor/<device> labels) and copied
// into every plan's cluster: 10 KB of it, a NUL or a line break, or
// thousands of labels are refused naming the field, and nothing is kept.
TEST_F(PlannerCoreTest, OverlongOrOddNodeStringsAreRefused) {
  const std::string huge(10 * 1024, 'x');
  const std::string nul("a\0b", 3);
  const std::vector<std::pair<std::string, std::function<void(v1::Node*)>>> bad = {
      {"address", [&](v1::Node* n) { n->set_address(huge); }},
      {"address", [&](v1::Node* n) { n->set_address(nul); }},
      {"agent_version", [&](v1::Node* n) { n->set_agent_version(huge); }},
      {"model", [&](v1::Node* n) { n->mutable_devices(0)->set_model(huge); }},
      {"model", [&](v1::Node* n) { n->mutable_devices(0)->set_model("a\nb"); }},
      {"label", [&](v1::Node* n) { (*n->mutable_labels())[huge] = "v"; }},
      {"label", [&](v1::Node* n) { (*n->mutable_labels())["k"] = huge; }},
      {"label", [&](v1::Node* n) { (*n->mutable_labels())[nul] = "v"; }},
      {"label", [&](v1::Node* n) { (*n->mutable_labels())["k"] = nul; }},
      {"labels",
       [&](v1::Node* n) {
         for (int i = 0; i < 10000; ++i) (*n->mutable_labels())[absl::StrCat("k", i)] = "v";
       }},
  };
  for (const auto& [field, edit] : bad) {
    v1::Node n = MakeNode("b", 1, 1e12);
    edit(&n);
    EXPECT_THAT(core_->RegisterNode(n).status(),
                hap::testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)))
        << field;
  }
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 0);
  v1::Node ok = MakeNode("b", 1, 1e12);
  ok.set_address("node-b.example:7070");
  ok.set_agent_version("hap-agent 1.2 (abc)");
  ok.mutable_devices(0)->set_model("NVIDIA A100-SXM4-40GB");
  (*ok.mutable_labels())["hap.executor/b/cpu0"] = "10.0.0.2:7101";
  (*ok.mutable_labels())["zone"] = "eu west 1";
  EXPECT_TRUE(core_->RegisterNode(ok).ok());
}

// The cluster is bounded (kMaxNodes nodes, kMaxClusterDevices devices):
// every plan copies it and GetCluster answers it whole, and agents
// registering under new names (a stale node stays until deleted) grew it
// without end. A node past either is RESOURCE_EXHAUSTED; one registered
// again, or a heartbeat with as many devices, is taken.
TEST_F(PlannerCoreTest, TheClusterIsBoundedInNodesAndDevices) {
  const int full_nodes = kMaxClusterDevices / kMaxDevicesPerNode;
  for (int i = 0; i < full_nodes; ++i) {
    ASSERT_TRUE(
        core_->RegisterNode(MakeNode(absl::StrCat("big", i), kMaxDevicesPerNode, 1e12)).ok())
        << i;
  }
  EXPECT_THAT(core_->RegisterNode(MakeNode("one-more", 1, 1e12)).status(),
              hap::testing::StatusIs(absl::StatusCode::kResourceExhausted,
                                     HasSubstr(absl::StrCat(kMaxClusterDevices))));
  EXPECT_TRUE(core_->RegisterNode(MakeNode("big0", kMaxDevicesPerNode, 2e12)).ok());
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/big1");
  *hb.mutable_devices() = MakeNode("big1", kMaxDevicesPerNode, 3e12).devices();
  EXPECT_TRUE(core_->Heartbeat(hb).ok());
  for (int i = 1; i < full_nodes; ++i) ASSERT_TRUE(core_->DeleteNode(absl::StrCat("big", i)).ok());
  for (int i = 0; i + 1 < kMaxNodes; ++i) {
    ASSERT_TRUE(core_->RegisterNode(MakeNode(absl::StrCat("small", i), 1, 1e12)).ok()) << i;
  }
  EXPECT_THAT(core_->RegisterNode(MakeNode("one-more", 1, 1e12)).status(),
              hap::testing::StatusIs(absl::StatusCode::kResourceExhausted,
                                     HasSubstr(absl::StrCat(kMaxNodes))));
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), kMaxNodes);
}

TEST_F(PlannerCoreTest, ANodeWithThousandsOfDevicesIsRefused) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::Node many = MakeNode("b", 20000, 1e12);
  EXPECT_THAT(core_->RegisterNode(many).status(),
              hap::testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("devices")));
}

// Device ids become label keys, metric labels and job selectors: ids with
// spaces, quotes, control characters or unbounded length are refused by
// name, at registration and in a heartbeat; ordinary ids are taken.
TEST_F(PlannerCoreTest, DeviceIdsWithOddCharactersOrLengthAreRefused) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  for (const std::string& bad :
       {std::string("b/gpu 0"), std::string("b/\"gpu0\""), std::string("b/gpu0\n"),
        std::string("b/gpu\0", 6), std::string(600, 'x')}) {
    v1::Node b = MakeNode("b", 1, 1e12);
    b.mutable_devices(0)->set_id(bad);
    EXPECT_THAT(core_->RegisterNode(b).status(),
                hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("a device id must be 1-512")))
        << absl::CHexEscape(bad);
  }
  v1::Node b = MakeNode("b", 1, 1e12);
  b.mutable_devices(0)->set_id("b.example.com/gpu:0_x-1");
  ASSERT_TRUE(core_->RegisterNode(b).ok());
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/b");
  *hb.mutable_devices() = b.devices();
  hb.mutable_devices(0)->set_id("b/gpu\t0");
  EXPECT_THAT(
      core_->Heartbeat(hb).status(),
      hap::testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a device id must be")));
  ExpectPlansStillWork(core_.get(), Deadline());
}

// Executors are found by the label "hap.executor/<device id>" of any node
// (deployment_manager.cc AssignRanks merges every node's labels, the last
// node by name winning): a node must not label another node's device.
TEST_F(PlannerCoreTest, ANodeCannotLabelTheExecutorOfAnotherNodesDevice) {
  v1::Node a = MakeNode("a", 1, 2e12);
  (*a.mutable_labels())["hap.executor/a/cpu0"] = "10.0.0.1:7000";
  ASSERT_TRUE(core_->RegisterNode(a).ok());
  v1::Node z = MakeNode("z", 1, 1e12);
  (*z.mutable_labels())["hap.executor/a/cpu0"] = "10.0.0.26:7000";
  absl::Status s = core_->RegisterNode(z).status();
  EXPECT_FALSE(s.ok()) << "z now routes a/cpu0's rank to its own address";
  if (s.ok()) {
    std::map<std::string, std::string> labelled;  // as AssignRanks builds it
    const v1::Cluster cluster = core_->GetCluster(false);
    for (const auto& n : cluster.nodes()) {
      for (const auto& [k, v] : n.labels()) labelled[k] = v;
    }
    EXPECT_EQ(labelled["hap.executor/a/cpu0"], "10.0.0.1:7000");
  }
}

// The planner's wall clock stepping back (NTP step, a restart on a host
// whose clock is behind) must not keep a silent node READY until the
// clock catches up with its last heartbeat.
TEST_F(PlannerCoreTest, ANodeGoesStaleAfterThePlannersClockStepsBack) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  clock_.Advance(absl::Hours(-1));
  EXPECT_EQ(core_->GetCluster(false).nodes_size(), 2);
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  for (int i = 0; i < 6; ++i) {  // 30 s: a heartbeats, b is silent (limit 15 s)
    clock_.Advance(absl::Seconds(5));
    ASSERT_TRUE(core_->Heartbeat(hb).ok());
  }
  v1::Cluster live = core_->GetCluster(false);
  ASSERT_EQ(live.nodes_size(), 1) << "b has been silent for 30 s and is still READY";
  EXPECT_EQ(live.nodes(0).name(), "a");
}

}  // namespace
}  // namespace hap::service
