#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/cost/cluster_model.h"
#include "planner/cost/collectives.h"

namespace hap::cost {
namespace {

using ::testing::HasSubstr;

// Two nodes of `per_node` devices; `flops[i]` per device.
hap::v1::Cluster MakeProto(const std::vector<double>& flops, int per_node) {
  hap::v1::Cluster c;
  for (size_t i = 0; i < flops.size(); ++i) {
    if (i % per_node == 0) {
      c.add_nodes()->set_name("n" + std::to_string(i / per_node));
    }
    auto* d = c.mutable_nodes(c.nodes_size() - 1)->add_devices();
    d->set_id("d" + std::to_string(i));
    auto* f = d->add_flops();
    f->set_dtype(hap::v1::FLOAT32);
    f->set_flops(flops[i]);
    d->set_memory_bytes(int64_t{16} << 30);
  }
  auto* def = c.mutable_defaults();
  def->set_intra_node_bandwidth_bytes_per_second(1e11);
  def->set_intra_node_latency_seconds(1e-6);
  def->set_inter_node_bandwidth_bytes_per_second(1e10);
  def->set_inter_node_latency_seconds(1e-5);
  return c;
}

void ExpectInvalid(const hap::v1::Cluster& c, const std::string& what,
                   const std::vector<std::string>& ids = {}) {
  auto m = ClusterModel::FromProto(c, ids);
  ASSERT_FALSE(m.ok()) << what;
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << what;
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(what));
}

TEST(ClusterModelTest, BuildsFromProtoWithNodeHierarchy) {
  auto m = ClusterModel::FromProto(MakeProto({2e12, 2e12, 1e12, 1e12}, 2));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->size(), 4);
  EXPECT_EQ(m->node_groups().size(), 2u);
  EXPECT_DOUBLE_EQ(m->bandwidth(0, 1), 1e11);
  EXPECT_DOUBLE_EQ(m->bandwidth(1, 2), 1e10);
  EXPECT_DOUBLE_EQ(m->RingBandwidth(m->all()), 1e10);  // crosses nodes
  EXPECT_DOUBLE_EQ(m->total_flops(), 6e12);
  auto r = m->ProportionalRatios();
  EXPECT_NEAR(r[0], 1.0 / 3, 1e-12);
  EXPECT_NEAR(r[3], 1.0 / 6, 1e-12);
}

TEST(ClusterModelTest, MeasuredLinksOverrideDefaults) {
  auto c = MakeProto({1e12, 1e12}, 2);
  auto* l = c.add_links();
  l->set_src("d0");
  l->set_dst("d1");
  l->set_bandwidth_bytes_per_second(5e9);
  l->set_latency_seconds(2e-6);
  auto m = ClusterModel::FromProto(c);
  ASSERT_TRUE(m.ok());
  EXPECT_DOUBLE_EQ(m->bandwidth(0, 1), 5e9);
  EXPECT_DOUBLE_EQ(m->bandwidth(1, 0), 5e9);  // one direction serves both
}

TEST(ClusterModelTest, DeviceSelectionAndOrder) {
  auto m = ClusterModel::FromProto(MakeProto({3e12, 2e12, 1e12}, 3),
                                   {"d2", "d0"});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->device(0).id, "d2");
  EXPECT_EQ(m->device(1).id, "d0");
}

TEST(ClusterModelTest, StaleNodesAreLeftOut) {
  auto c = MakeProto({1e12, 1e12, 1e12, 1e12}, 2);
  c.mutable_nodes(1)->set_state(hap::v1::Node::STALE);
  auto m = ClusterModel::FromProto(c);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->size(), 2);
}

// bf16 plans price each device at its bf16 rate where its profile has one,
// at its float32 rate where not; the ratios follow.
TEST(ClusterModelTest, Bf16PlansUseEachDevicesBf16Rate) {
  auto c = MakeProto({1e12, 1e12, 1e12}, 3);
  auto* f0 = c.mutable_nodes(0)->mutable_devices(0)->add_flops();
  f0->set_dtype(hap::v1::BFLOAT16);
  f0->set_flops(4e12);
  auto* f1 = c.mutable_nodes(0)->mutable_devices(1)->add_flops();
  f1->set_dtype(hap::v1::BFLOAT16);
  f1->set_flops(2e12);
  auto fp32 = ClusterModel::FromProto(c);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_DOUBLE_EQ(fp32->device(0).flops, 1e12);
  EXPECT_DOUBLE_EQ(fp32->device(1).flops, 1e12);
  auto bf16 = ClusterModel::FromProto(c, {}, hap::v1::BFLOAT16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_DOUBLE_EQ(bf16->device(0).flops, 4e12);
  EXPECT_DOUBLE_EQ(bf16->device(1).flops, 2e12);
  EXPECT_DOUBLE_EQ(bf16->device(2).flops, 1e12);  // no bf16 rate: float32's
  EXPECT_DOUBLE_EQ(bf16->total_flops(), 7e12);
  f1->set_flops(-1);
  auto bad = ClusterModel::FromProto(c, {}, hap::v1::BFLOAT16);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("device 'd1' has bf16 FLOPS -1"));
  auto f16 = ClusterModel::FromProto(c, {}, hap::v1::FLOAT16);
  EXPECT_THAT(std::string(f16.status().message()),
              HasSubstr("compute precision FLOAT16 is not priced"));
}

TEST(ClusterModelTest, BadProfilesGiveClearErrors) {
  auto base = MakeProto({1e12, 1e12}, 2);
  ExpectInvalid(base, "unknown device 'gpu9'", {"d0", "gpu9"});
  ExpectInvalid(base, "listed twice", {"d0", "d0"});
  ExpectInvalid(base, "at least 2 devices", {"d0"});
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(1)->mutable_flops(0)->set_flops(0);
    ExpectInvalid(c, "device 'd1' has no valid float32 FLOPS");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->mutable_flops(0)->set_flops(NAN);
    ExpectInvalid(c, "device 'd0' has no valid float32 FLOPS");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->mutable_flops(0)->set_flops(-1e12);
    ExpectInvalid(c, "FLOPS must be positive");
  }
  {
    // A bad float32 rate is an error even when another dtype's rate comes
    // first (it was replaced by that one, here bf16's 1e14).
    auto c = base;
    auto* d = c.mutable_nodes(0)->mutable_devices(0);
    d->mutable_flops(0)->set_dtype(hap::v1::BFLOAT16);
    d->mutable_flops(0)->set_flops(1e14);
    auto* f = d->add_flops();
    f->set_dtype(hap::v1::FLOAT32);
    f->set_flops(-1e12);
    ExpectInvalid(c, "device 'd0' has no valid float32 FLOPS (got -1e+12)");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->clear_flops();
    ExpectInvalid(c, "device 'd0' has no valid float32 FLOPS (got none)");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->set_memory_bytes(-5);
    ExpectInvalid(c, "memory_bytes -5");
  }
  {
    auto c = base;
    c.mutable_defaults()->set_intra_node_bandwidth_bytes_per_second(0);
    ExpectInvalid(c, "no valid bandwidth between 'd0' and 'd1'");
  }
  {
    auto c = base;
    auto* l = c.add_links();
    l->set_src("d0");
    l->set_dst("d1");
    l->set_bandwidth_bytes_per_second(NAN);
    ExpectInvalid(c, "positive finite bandwidth");
  }
  {
    auto c = base;
    auto* l = c.add_links();
    l->set_src("d0");
    l->set_dst("ghost");
    l->set_bandwidth_bytes_per_second(1e9);
    ExpectInvalid(c, "unknown device");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->set_launch_overhead_seconds(-1);
    ExpectInvalid(c, "launch_overhead_seconds");
  }
  // Past the planner service's limits (service::CheckNodeProfile): a
  // cluster file (hapctl plan --cluster) with an op scale of 1e300 was
  // planned with costs near infinity.
  {
    auto c = base;
    (*c.mutable_nodes(0)->mutable_devices(0)->mutable_op_time_scale())["matmul"] = 1e300;
    ExpectInvalid(c,
                  "op_time_scale[matmul] = 1e+300; calibration scales must be positive, "
                  "finite and below 1e+06");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->set_launch_overhead_seconds(5);
    ExpectInvalid(c, "launch_overhead_seconds (5); it must be finite, >= 0 and at most 1");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->set_optimizer_seconds_per_element(2);
    ExpectInvalid(c, "optimizer_seconds_per_element 2; it must be finite, >= 0 and at most 1");
  }
  {
    auto c = base;
    c.mutable_nodes(0)->mutable_devices(0)->set_step_overhead_seconds(1e5);
    ExpectInvalid(c, "step_overhead_seconds 100000; it must be finite, >= 0 and at most 3600");
  }
  {
    hap::v1::Cluster empty;
    ExpectInvalid(empty, "at least 2 devices");
  }
}

TEST(CollectivesTest, RingFormulasOnAHomogeneousRing) {
  auto m = *ClusterModel::FromProto(MakeProto({1e12, 1e12, 1e12, 1e12}, 4));
  CollectiveModel c(m);
  double bytes = 4e8, bw = 1e11, lat = 1e-6;
  EXPECT_NEAR(c.AllReduce(bytes), 2.0 * 3 / 4 * bytes / bw + 6 * lat, 1e-12);
  std::vector<double> even(4, 0.25);
  // Even shards: padded all-gather = (n-1)/n * bytes / bw + (n-1) lat.
  EXPECT_NEAR(EvaluateTerm(c.AllGather(bytes, Method::kPadded), even),
              3.0 / 4 * bytes / bw + 3 * lat, 1e-12);
  // Uneven shards: padding to the largest makes padded cost grow with it,
  // grouped does not depend on the split.
  std::vector<double> skew = {0.7, 0.1, 0.1, 0.1};
  double padded = EvaluateTerm(c.AllGather(bytes, Method::kPadded), skew);
  double grouped = EvaluateTerm(c.AllGather(bytes, Method::kGrouped), skew);
  EXPECT_NEAR(padded, 3 * 0.7 * bytes / bw + 3 * lat, 1e-12);
  EXPECT_LT(grouped, padded);
  EXPECT_GT(grouped, EvaluateTerm(c.AllGather(bytes, Method::kPadded), even));
  EXPECT_DOUBLE_EQ(EvaluateTerm(c.AllGather(bytes, Method::kGrouped), skew),
                   EvaluateTerm(c.AllGather(bytes, Method::kGrouped), even));
}

TEST(CollectivesTest, CalibratedCallOverheadIsPaidPerCall) {
  hap::v1::Cluster proto = MakeProto({1e12, 1e12, 1e12, 1e12}, 4);
  auto plain = *ClusterModel::FromProto(proto);
  proto.mutable_defaults()->set_collective_overhead_seconds(0.003);
  auto slow = *ClusterModel::FromProto(proto);
  CollectiveModel a(plain), b(slow);
  const double bytes = 4e8;
  std::vector<double> even(4, 0.25);
  EXPECT_NEAR(b.AllReduce(bytes), a.AllReduce(bytes) + 0.003, 1e-12);
  // A tensor's share of a gradient bucket carries no per-call overhead and
  // no latency (the bucket pays both once): the ring's bandwidth term.
  EXPECT_NEAR(b.AllReduceTransfer(bytes), 2.0 * 3 / 4 * bytes / 1e11, 1e-12);
  EXPECT_NEAR(EvaluateTerm(b.AllGather(bytes, Method::kPadded), even),
              EvaluateTerm(a.AllGather(bytes, Method::kPadded), even) + 0.003, 1e-12);
  // Grouped: one broadcast per rank, so four calls.
  EXPECT_NEAR(EvaluateTerm(b.ReduceScatter(bytes, Method::kGrouped), even),
              EvaluateTerm(a.ReduceScatter(bytes, Method::kGrouped), even) + 4 * 0.003, 1e-12);
  EXPECT_NEAR(EvaluateTerm(b.AllToAll(bytes), even), EvaluateTerm(a.AllToAll(bytes), even) + 0.003,
              1e-12);
  proto.mutable_defaults()->set_collective_overhead_seconds(-1);
  EXPECT_EQ(ClusterModel::FromProto(proto).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CollectivesTest, SlowestLinkBottlenecksAndHierarchyHelps) {
  // Two nodes of 4: fast inside, slow between.
  auto m = *ClusterModel::FromProto(
      MakeProto({1e12, 1e12, 1e12, 1e12, 1e12, 1e12, 1e12, 1e12}, 4));
  CollectiveModel c(m);
  double bytes = 8e8;
  double flat = c.RingAllReduce(bytes, m.all());
  EXPECT_NEAR(flat, 2.0 * 7 / 8 * bytes / 1e10 + 14 * 1e-5, 1e-9);
  // Hierarchical: intra-node all-reduce on the fast links, then the 1/4
  // slices across nodes.
  double hier = c.RingAllReduce(bytes, m.node_groups()[0]) +
                c.RingAllReduce(bytes / 4, {0, 4});
  EXPECT_NEAR(c.AllReduce(bytes), std::min(flat, hier), 1e-12);
  EXPECT_LT(c.AllReduce(bytes), flat);
  EXPECT_DOUBLE_EQ(c.AllReduce(0), 0);
  // All-gather: flat ring (n-1) shards over the slow link against k-1 shards
  // inside the node plus n-k across: the hierarchical form wins here.
  std::vector<double> even(8, 0.125);
  double ag = EvaluateTerm(c.AllGather(bytes, Method::kPadded), even);
  double flat_ag = 7 * 0.125 * bytes / 1e10 + 7 * 1e-5;
  double hier_ag = (3 * bytes / 1e11 + 4 * bytes / 1e10) * 0.125 + 3 * 1e-6 + 1e-5;
  EXPECT_NEAR(ag, hier_ag, 1e-12);
  EXPECT_LT(ag, flat_ag);
  EXPECT_LE(EvaluateTerm(c.ReduceScatter(bytes, Method::kGrouped), even),
            bytes / (kGroupedEfficiency * 1e10) + 8 * 1e-5);
}

TEST(CollectivesTest, TreeForSmallMessagesRingForLargeOnes) {
  // 64 devices on one node (1e10 B/s, 1e-5 s): a ring pays 2 (n-1) latencies,
  // a tree 2 log2 n, at about the same bandwidth.
  std::vector<double> flops(64, 1e12);
  hap::v1::Cluster proto = MakeProto(flops, 64);
  proto.mutable_defaults()->set_intra_node_bandwidth_bytes_per_second(1e10);
  proto.mutable_defaults()->set_intra_node_latency_seconds(1e-5);
  auto m = *ClusterModel::FromProto(proto);
  CollectiveModel c(m);
  const double small = 1e3, large = 1e9;
  EXPECT_NEAR(c.TreeAllReduce(small, m.all()), 2 * small / 1e10 + 2 * 6 * 1e-5, 1e-15);
  EXPECT_NEAR(c.RingAllReduce(small, m.all()), 2.0 * 63 / 64 * small / 1e10 + 126 * 1e-5,
              1e-15);
  EXPECT_STREQ(c.AllReduceAlgorithm(small).algorithm, "tree");
  EXPECT_DOUBLE_EQ(c.AllReduce(small), c.TreeAllReduce(small, m.all()));
  EXPECT_STREQ(c.AllReduceAlgorithm(large).algorithm, "ring");
  EXPECT_DOUBLE_EQ(c.AllReduce(large), c.RingAllReduce(large, m.all()));
  // Two devices: a ring moves half the bytes a tree does.
  auto two = *ClusterModel::FromProto(MakeProto({1e12, 1e12}, 2));
  EXPECT_STREQ(CollectiveModel(two).AllReduceAlgorithm(small).algorithm, "ring");
}

// nccl-tests report an all-reduce's bus bandwidth, busbw = S / t * 2 (n-1)/n
// (doc/PERFORMANCE.md in NVIDIA/nccl-tests), defined so that it does not
// depend on the number of ranks and compares with the links' speed: for
// large messages it stays flat as a job grows. Nodes of 8 devices at 9.5e9
// B/s inside and 3e9 B/s between (the hetero-64gpu profile's links), 450 MB
// (a 12-layer GPT's fp32 gradients), 16 to 2,048 devices: the model's busbw
// must stay within 15% of its 16-device value, and above the inter-node
// link's bandwidth (each local rank's slice crosses its own link). Small
// messages' time grows with log2 of the node count (trees), not with n.
TEST(CollectivesTest, AllReduceBusBandwidthHoldsFrom16To2048Devices) {
  const double bytes = 4.5e8, tiny = 8;
  double busbw16 = 0, tiny16 = 0;
  for (int n : {16, 64, 256, 1024, 2048}) {
    SCOPED_TRACE(n);
    std::vector<DeviceModel> d;
    for (int i = 0; i < n; ++i) {
      d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / 8), "gpu", 2.15e12,
                   int64_t{40} << 30, 1e-5});
    }
    auto m = ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 3e9, 5e-5);
    ASSERT_TRUE(m.ok()) << m.status();
    CollectiveModel c(*m);
    const double t = c.AllReduce(bytes);
    const double busbw = bytes / t * 2.0 * (n - 1) / n;
    if (n == 16) {
      busbw16 = busbw;
      tiny16 = c.AllReduce(tiny);
    }
    EXPECT_GE(busbw, 0.85 * busbw16) << "t " << t;
    EXPECT_GT(busbw, 3e9);
    EXPECT_LE(c.AllReduce(tiny), tiny16 * (1 + std::log2(n / 16.0)))
        << c.AllReduceAlgorithm(tiny).algorithm;
    // A flat ring's latency alone would be 2 (n-1) x 5e-5 s.
    if (n >= 256) {
      EXPECT_LT(c.AllReduce(tiny), 2.0 * (n - 1) * 5e-5 / 10);
    }
  }
}

}  // namespace
}  // namespace hap::cost
