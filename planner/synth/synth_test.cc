#include <chrono>
#include <cmath>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/synth/checker.h"
#include "planner/synth/gradients.h"
#include "planner/synth/planner.h"
#include "planner/synth/search.h"
#include "planner/synth/snap.h"

namespace hap::synth {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

// `nodes` nodes of `per_node` devices; flops[i] per device.
cost::ClusterModel MakeCluster(const std::vector<double>& flops, int per_node,
                               double intra_bw = 1e11, double inter_bw = 1e10,
                               int64_t memory = 40 * kGiB) {
  std::vector<cost::DeviceModel> d;
  int n = static_cast<int>(flops.size());
  for (int i = 0; i < n; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / per_node),
                 "test", flops[i], memory, 0});
  }
  std::vector<std::vector<double>> bw(n, std::vector<double>(n, 0)),
      lat(n, std::vector<double>(n, 0));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      bool same = i / per_node == j / per_node;
      bw[i][j] = same ? intra_bw : inter_bw;
      lat[i][j] = same ? 5e-6 : 2e-5;
    }
  }
  return *cost::ClusterModel::Create(d, bw, lat);
}

graph::Graph Zoo(const std::string& name, std::map<std::string, double> p) {
  auto g = graph::BuildZooModel(name, p);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::map<std::string, double> Small(const std::string& name, int batch) {
  std::map<std::string, double> p = {{"batch", batch}};
  if (name == "vgg") {
    p["width"] = 8;
    p["hidden"] = 32;
    p["stages"] = 3;
    p["image"] = 16;
    return p;
  }
  p["hidden"] = 64;
  if (name == "mlp") {
    p["layers"] = 3;
    p["input"] = 32;
    return p;
  }
  p["layers"] = 2;
  p["heads"] = 4;
  p["ffn"] = 128;
  if (name == "vit") {
    p["image"] = 16;
    return p;
  }
  p["seq"] = 16;
  if (name == "gpt" || name == "moe" || name == "switch") p["vocab"] = 256;
  if (name == "moe" || name == "switch") p["experts"] = 8;
  return p;
}

struct Case {
  std::string name;
  cost::ClusterModel cluster;
};

std::vector<Case> Clusters() {
  std::vector<Case> c;
  c.push_back({"homogeneous-4", MakeCluster({1e13, 1e13, 1e13, 1e13}, 4)});
  c.push_back({"mixed-2x2", MakeCluster({2e13, 2e13, 1e13, 1e13}, 2)});
  c.push_back({"three-kinds-2x3",
               MakeCluster({3e13, 2e13, 1e13, 3e13, 2e13, 1e13}, 3)});
  return c;
}

// Every zoo model on homogeneous and heterogeneous clusters: the checker
// accepts the program, the cost is consistent, and no baseline is cheaper.
TEST(SynthTest, EveryZooModelChecksAndBeatsBaselines) {
  for (const Case& c : Clusters()) {
    for (const auto& info : graph::ZooModels()) {
      SCOPED_TRACE(info.name + " on " + c.name);
      graph::Graph g = Zoo(info.name, Small(info.name, 8 * c.cluster.size()));
      PlanOptions o;
      auto r = PlanModel(g, c.cluster, o);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(CheckProgram(g, r->program, c.cluster.size()).ok())
          << CheckProgram(g, r->program, c.cluster.size());
      EXPECT_NEAR(EvaluateProgram(r->program, r->ratios).total, r->cost.total,
                  1e-9 * r->cost.total);
      double sum = 0;
      for (double x : r->ratios) sum += x;
      EXPECT_NEAR(sum, 1.0, 1e-6);
      for (Baseline b : {Baseline::kDpEven, Baseline::kDpProportional,
                         Baseline::kZero3, Baseline::kMegatron}) {
        PlanOptions bo;
        bo.baseline = b;
        bo.ignore_memory = true;
        auto br = PlanModel(g, c.cluster, bo);
        if (b == Baseline::kDpEven || b == Baseline::kDpProportional) {
          ASSERT_TRUE(br.ok()) << BaselineName(b) << ": " << br.status();
        }
        if (!br.ok()) continue;  // e.g. no tensor-parallel program
        EXPECT_TRUE(CheckProgram(g, br->program, c.cluster.size()).ok())
            << BaselineName(b) << ": "
            << CheckProgram(g, br->program, c.cluster.size());
        EXPECT_LE(r->cost.total, br->cost.total * (1 + 1e-9))
            << "baseline " << BaselineName(b);
      }
    }
  }
}

TEST(SynthTest, ComputeBoundRatiosFollowFlops) {
  // A wide MLP with a large batch and fast links is compute bound.
  graph::Graph g = Zoo(
      "mlp", {{"layers", 2}, {"hidden", 64}, {"input", 64}, {"batch", 4096}});
  {
    auto c = MakeCluster({1e12, 1e12}, 2, 1e13, 1e13);
    auto r = PlanModel(g, c, PlanOptions());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->ratios[0], 0.5, 1e-3);
    EXPECT_NEAR(r->ratios[1], 0.5, 1e-3);
  }
  {
    auto c = MakeCluster({2e12, 1e12}, 2, 1e13, 1e13);
    auto r = PlanModel(g, c, PlanOptions());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->ratios[0] / r->ratios[1], 2.0, 0.01);
  }
}

// A device's fixed per-step time (calibrated step_overhead_seconds) runs
// in the same block as its share of the batch when nothing synchronises in
// between, so the LP gives that device less; a per-instruction maximum would
// leave the split even.
TEST(SynthTest, FixedStepTimeOfADeviceLowersItsRatio) {
  graph::Graph g = Zoo(
      "mlp", {{"layers", 2}, {"hidden", 64}, {"input", 64}, {"batch", 4096}});
  // Slow links: data parallelism (one gradient all-reduce after backward)
  // is the program, forward and backward one block.
  auto even = MakeCluster({1e12, 1e12}, 2, 1e9, 1e9);
  auto base = PlanModel(g, even, PlanOptions());
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_NEAR(base->ratios[1], 0.5, 1e-3);
  std::vector<cost::DeviceModel> d = even.devices();
  // Device 1 spends a fifth of the even step's compute on fixed work.
  d[1].step_overhead_seconds = 0.2 * base->cost.compute;
  std::vector<std::vector<double>> bw = {{0, 1e9}, {1e9, 0}},
                                   lat = {{0, 5e-6}, {5e-6, 0}};
  auto c = *cost::ClusterModel::Create(d, bw, lat);
  auto r = PlanModel(g, c, PlanOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  // Balanced: 2 * r1 * C + 0.2 C = 2 * r0 * C -> r1 = 0.45.
  EXPECT_NEAR(r->ratios[1], 0.45, 0.01);
  EXPECT_LT(r->cost.total, base->cost.total * 1.2);
}

// Ratios come out as whole samples of the batch (what the lowering runs),
// predicted there; the search's split is the best of its one-sample
// neighbours, a baseline's is its ratios rounded.
TEST(SynthTest, RatiosAreWholeSamplesAndTheBestNeighbour) {
  graph::Graph g = Zoo("gpt", Small("gpt", 16));
  auto c = MakeCluster({2.5e12, 1e12}, 2, 1e10, 1e10);
  auto r = PlanModel(g, c, PlanOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  const double samples = r->ratios[0] * 16;
  EXPECT_NEAR(samples, std::round(samples), 1e-9);
  EXPECT_NEAR(r->ratios[0] + r->ratios[1], 1.0, 1e-12);
  EXPECT_NEAR(EvaluateProgram(r->program, r->ratios).total, r->cost.total,
              1e-12);
  for (int m : {-1, 1}) {
    const double k = std::round(samples) + m;
    if (k < 1 || k > 15) continue;
    EXPECT_LE(
        r->cost.total,
        EvaluateProgram(r->program, {k / 16, 1 - k / 16}).total * (1 + 1e-9))
        << k << " samples on device 0";
  }
  PlanOptions bo;
  bo.baseline = Baseline::kDpProportional;
  auto b = PlanModel(g, c, bo);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NEAR(b->ratios[0], 11.0 / 16, 1e-12);  // 2.5:1 = 11.43 -> 11 of 16
  PlanOptions raw;
  raw.baseline = Baseline::kDpProportional;
  raw.snap_ratios_to_batch = false;
  auto unsnapped = PlanModel(g, c, raw);
  ASSERT_TRUE(unsnapped.ok()) << unsnapped.status();
  EXPECT_NEAR(unsnapped->ratios[0], 2.5 / 3.5, 1e-9);
  // A baseline at a given split; bad splits named.
  PlanOptions at;
  at.baseline = Baseline::kDpProportional;
  at.baseline_ratios = {0.75, 0.25};
  auto fixed = PlanModel(g, c, at);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_NEAR(fixed->ratios[0], 0.75, 1e-12);
  for (std::vector<double> bad :
       std::vector<std::vector<double>>{{0.5}, {0.7, 0.7}, {1.0, 0.0}}) {
    at.baseline_ratios = bad;
    auto e = PlanModel(g, c, at);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(e.status().message()),
                HasSubstr("baseline ratios"));
  }
}

// BlockTerms: compute between synchronising collectives summed per block,
// in execution order, the last block joining the first.
// bf16 gradients (PlanOptions::bf16_gradients) price the gradients'
// synchronisation at half the bytes: data parallelism's communication on a
// slow link about halves, its compute does not change, and the synthesized
// plan is no slower than with fp32 gradients. With overlap too.
TEST(SynthTest, Bf16GradientsHalveTheGradientTransfer) {
  graph::Graph g = Zoo("gpt", Small("gpt", 16));
  // Slow devices, so that computing every layer replicated (no gradient to
  // synchronise) is no way out for the data-parallel baseline.
  cost::ClusterModel c = MakeCluster({2e11, 2e11, 1e11, 1e11}, 2, 1e10, 1e9);
  for (bool overlap : {false, true}) {
    PlanOptions dp;
    dp.baseline = Baseline::kDpProportional;
    dp.overlap_communication = overlap;
    auto fp32 = PlanModel(g, c, dp);
    dp.bf16_gradients = true;
    auto bf16 = PlanModel(g, c, dp);
    ASSERT_TRUE(fp32.ok() && bf16.ok());
    EXPECT_EQ(bf16->program.gradient_wire_scale, 0.5);
    EXPECT_EQ(fp32->program.gradient_wire_scale, 1.0);
    EXPECT_NEAR(bf16->cost.compute, fp32->cost.compute, 1e-12 + 1e-9 * fp32->cost.compute);
    if (!overlap) {
      const double ratio = bf16->cost.communication / fp32->cost.communication;
      EXPECT_GT(ratio, 0.45) << "latencies and call overheads do not halve";
      EXPECT_LT(ratio, 0.6) << bf16->cost.communication << " vs " << fp32->cost.communication;
    }
    EXPECT_LT(bf16->cost.total, fp32->cost.total);
    PlanOptions hap;
    hap.overlap_communication = overlap;
    auto h32 = PlanModel(g, c, hap);
    hap.bf16_gradients = true;
    auto h16 = PlanModel(g, c, hap);
    ASSERT_TRUE(h32.ok() && h16.ok());
    EXPECT_LE(h16->cost.total, h32->cost.total * (1 + 1e-9));
    EXPECT_LE(h16->cost.total, bf16->cost.total * (1 + 1e-9));
  }
}

TEST(SynthTest, BlockTermsSumComputeBetweenCollectives) {
  auto term = [](std::vector<double> coef, std::vector<double> constant) {
    CostTerm t;
    t.coef = std::move(coef);
    t.constant = std::move(constant);
    return t;
  };
  Program p;
  p.steps.resize(3);
  p.steps[0].compute = term({3, 6}, {0, 0});
  p.steps[1].compute = term({6, 3}, {0, 0});
  p.steps[2].compute = term({3, 3}, {0.3, 0});
  CommStep c;
  c.has_backward = true;
  c.forward_cost = term({0, 0}, {1, 1});
  c.backward_cost = term({0, 0}, {2, 2});
  p.steps[1].comms.push_back(c);
  CommStep local;  // a slice: no cost, no synchronisation
  local.forward_cost = term({0, 0}, {0, 0});
  p.steps[2].comms.push_back(local);
  p.overhead = term({0, 0}, {0.5, 0.25});
  std::vector<bool> is_compute;
  std::vector<CostTerm> t = p.BlockTerms(&is_compute);
  // [step 0 fwd + step 0 bwd + overhead] [fwd comm] [steps 1, 2 fwd+bwd]
  // [bwd comm].
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(is_compute, (std::vector<bool>{true, false, true, false}));
  EXPECT_NEAR(t[0].coef[0], 3, 1e-12);
  EXPECT_NEAR(t[0].coef[1], 6, 1e-12);
  EXPECT_NEAR(t[0].constant[0], 0.5, 1e-12);
  EXPECT_NEAR(t[0].constant[1], 0.25, 1e-12);
  EXPECT_NEAR(t[1].constant[0], 1, 1e-12);
  EXPECT_NEAR(t[2].coef[0], 9, 1e-12);
  EXPECT_NEAR(t[2].coef[1], 6, 1e-12);
  EXPECT_NEAR(t[2].constant[0], 0.3, 1e-12);
  EXPECT_NEAR(t[3].constant[0], 2, 1e-12);
  // At ratios (0.5, 0.5): blocks max(2, 3.25) + max(4.8, 3) = 8.05, against
  // 9.55 for the sum of per-instruction maxima.
  ProgramCost pc = EvaluateProgram(p, {0.5, 0.5});
  EXPECT_NEAR(pc.compute, 3.25 + 4.8, 1e-9);
  EXPECT_NEAR(pc.communication, 3, 1e-9);
  // Without any collective, one block.
  p.steps[1].comms.clear();
  EXPECT_EQ(p.BlockTerms().size(), 1u);
}

// RandomProgram (the randomized equivalence test's generator): complete
// programs the checker accepts, the same for the same seed, others for
// others, with storages the search would not pick here; its errors are
// Synthesize's.
TEST(SynthTest, RandomProgramsAreValidAndDeterministicPerSeed) {
  auto c = MakeCluster({1e12, 2e12, 1e12, 2e12}, 2);
  for (std::string name : {"mlp", "gpt", "vit", "moe"}) {
    graph::Graph g = Zoo(name, Small(name, 16));
    std::set<std::vector<int>> seen;
    int zero = 0;
    for (uint64_t seed = 0; seed < 6; ++seed) {
      auto p = RandomProgram(g, c, {}, seed);
      ASSERT_TRUE(p.ok()) << name << " seed " << seed << ": " << p.status();
      EXPECT_TRUE(CheckProgram(g, *p, c.size()).ok()) << CheckProgram(g, *p, c.size());
      EXPECT_FALSE(p->optimal);
      auto again = RandomProgram(g, c, {}, seed);
      ASSERT_TRUE(again.ok()) << again.status();
      std::vector<int> rules, rules_again;
      for (const OpStep& s : p->steps) {
        rules.push_back(s.rule_index);
        for (const SourceLoad& l : s.loads) zero += l.storage == ParamStorage::kZero;
      }
      for (const OpStep& s : again->steps) rules_again.push_back(s.rule_index);
      EXPECT_EQ(rules, rules_again) << name << " seed " << seed;
      seen.insert(rules);
    }
    EXPECT_GT(seen.size(), 1u) << name;
    EXPECT_GT(zero, 0) << name;
  }
  graph::Graph g = Zoo("mlp", Small("mlp", 16));
  SearchOptions none;
  none.rule_filter = [](const ShardRule&) { return false; };
  auto p = RandomProgram(g, c, none, 0);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("no sharding rule of op"));
  SearchOptions wrong;
  wrong.ratios = {0.5, 0.5};
  EXPECT_EQ(RandomProgram(g, c, wrong, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// SFB: all-gathering x and dy beats all-reducing dW when the batch is small
// next to the layer's width, and not when it is large.
TEST(SynthTest, SfbChosenForSmallBatchOnly) {
  // Slow devices, so that computing every layer replicated is no way out.
  auto c = MakeCluster({1e11, 1e11, 1e11, 1e11}, 4, 1e9, 1e9);
  auto uses_sfb = [&](int batch) {
    graph::Graph g = Zoo(
        "mlp",
        {{"layers", 2}, {"hidden", 2048}, {"input", 2048}, {"batch", batch}});
    SearchOptions so;
    so.allow_zero = false;
    so.rule_filter = [](const ShardRule& r) {
      return r.kind != RuleKind::kTensor;  // data parallel: dW needs sync
    };
    auto p = Synthesize(g, c, so);
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(CheckProgram(g, *p, c.size()).ok());
    int sfb = 0;
    for (const auto& s : p->steps) {
      for (const auto& l : s.loads) sfb += l.sfb;
    }
    return sfb;
  };
  EXPECT_GT(uses_sfb(8), 0);
  EXPECT_EQ(uses_sfb(8192), 0);
}

// A replicated parameter whose gradient ends partial only through later ops
// (a column-parallel decoder reading the replicated layers' output makes
// their gradients partial) is all-reduced by the lowering; the program must
// price that all-reduce like any other.
TEST(SynthTest, PartialGradientsThroughLaterOpsArePriced) {
  graph::Graph g = Zoo("gpt", {{"layers", 1},
                               {"hidden", 64},
                               {"heads", 4},
                               {"ffn", 128},
                               {"seq", 16},
                               {"vocab", 4096},
                               {"batch", 8}});
  // Slow links: the layers stay replicated, the large decoder is split.
  auto c = MakeCluster({1e10, 1e10}, 1, 1e8, 1e8);
  int propagated = 0;
  for (bool tensor_parallel : {false, true}) {
    SearchOptions so;
    so.allow_zero = false;
    if (tensor_parallel) so.rule_filter = TensorParallelRule;
    auto p = Synthesize(g, c, so);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(CheckProgram(g, *p, c.size()).ok());
    const GradientAnalysis grads = AnalyzeGradients(g, *p);
    for (const OpStep& s : p->steps) {
      for (const SourceLoad& l : s.loads) {
        if (!l.parameter || l.storage != ParamStorage::kReplicated || l.sfb)
          continue;
        const std::string& name = g.tensor(l.tensor).name;
        EXPECT_EQ(l.grad_allreduce, grads.partial_grad[l.tensor]) << name;
        if (l.grad_allreduce) {
          EXPECT_FALSE(l.costs.empty()) << name;
        }
        if (l.grad_allreduce && !s.rule.split) ++propagated;
      }
    }
  }
  // The case this is about happened at least once.
  EXPECT_GT(propagated, 0);
}

TEST(SynthTest, SmallMemoryDeviceGetsNoMoreThanFits) {
  graph::Graph g = Zoo("gpt", {{"layers", 2},
                               {"hidden", 256},
                               {"heads", 4},
                               {"ffn", 1024},
                               {"seq", 64},
                               {"vocab", 1024},
                               {"batch", 64}});
  // Find the unconstrained memory, then give device 1 a third of it.
  auto big = MakeCluster({1e13, 1e13}, 2, 1e11, 1e11, 64 * kGiB);
  auto free_run = PlanModel(g, big, PlanOptions());
  ASSERT_TRUE(free_run.ok()) << free_run.status();
  int64_t need = free_run->memory_bytes[1];
  std::vector<cost::DeviceModel> d = big.devices();
  d[1].memory_bytes = need * 2 / 3;
  std::vector<std::vector<double>> bw = {{0, 1e11}, {1e11, 0}},
                                   lat = {{0, 1e-6}, {1e-6, 0}};
  auto small = *cost::ClusterModel::Create(d, bw, lat);
  auto r = PlanModel(g, small, PlanOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(r->memory_bytes[1], d[1].memory_bytes);
  EXPECT_TRUE(CheckProgram(g, r->program, 2).ok());

  d[0].memory_bytes = d[1].memory_bytes = 1 << 20;  // 1 MiB: hopeless
  auto tiny = *cost::ClusterModel::Create(d, bw, lat);
  auto e = PlanModel(g, tiny, PlanOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("does not fit"));
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("d"));
}

// One more gradient copy (a pipeline stage's sums over microbatches) adds
// each trained parameter's bytes once more, in the parameter's own form.
TEST(SynthTest, ExtraGradientCopiesAddEachParametersBytes) {
  graph::Graph g =
      Zoo("mlp", {{"layers", 2}, {"hidden", 32}, {"input", 16}, {"classes", 4}, {"batch", 8}});
  auto c = MakeCluster({1e13, 1e13}, 2, 1e11, 1e11, 64 * kGiB);
  auto plan = PlanModel(g, c, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const ratios::MemoryConstraint base =
      MemoryModel(g, c, plan->program, OptimizerKind::kSgdMomentum);
  const ratios::MemoryConstraint more =
      MemoryModel(g, c, plan->program, OptimizerKind::kSgdMomentum, /*extra_gradients=*/1);
  double params = 0;
  for (const graph::Tensor& t : g.tensors()) {
    if (t.kind == graph::TensorKind::kParameter && !t.frozen) {
      params += static_cast<double>(t.type.bytes());
    }
  }
  ASSERT_GT(params, 0);
  for (int d = 0; d < 2; ++d) {
    // Replicated parameters in the constant, sharded ones in the ratio term.
    EXPECT_DOUBLE_EQ((more.constant[d] - base.constant[d]) + (more.coef[0][d] - base.coef[0][d]),
                     params)
        << d;
  }
}

TEST(SynthTest, MemoryBeyondInt64SaturatesInsteadOfWrapping) {
  ratios::MemoryConstraint m;
  m.constant = {1.6e19, 1e3};
  m.coef = {{0, 1e3}};
  m.capacity = {1e9, 1e9};
  EXPECT_EQ(MemoryAt(m, {0.5, 1}), (std::vector<int64_t>{INT64_MAX, 2000}));
  m.coef = {{1e19, 1e19}};
  EXPECT_EQ(MemoryAt(m, {1, 1}), (std::vector<int64_t>{INT64_MAX, INT64_MAX}));
}

TEST(SynthTest, HeuristicCutsStatesAndKeepsOptimum) {
  // The reference profile's GPU classes and link rates (docs/design.md §8).
  graph::Graph g = Zoo("gpt", {{"layers", 2},
                               {"hidden", 256},
                               {"heads", 4},
                               {"ffn", 1024},
                               {"seq", 64},
                               {"vocab", 1024},
                               {"batch", 64}});
  auto c = MakeCluster(
      {3.86e12, 3.86e12, 3.86e12, 3.86e12, 2.15e12, 2.15e12, 2.15e12, 2.15e12},
      4, 9.5e9, 3e9);
  SearchOptions a;
  a.block_search = false;  // plain A*
  SearchOptions z;
  z.zero_heuristic = true;
  auto pa = Synthesize(g, c, a);
  auto pz = Synthesize(g, c, z);
  ASSERT_TRUE(pa.ok() && pz.ok());
  EXPECT_TRUE(pa->optimal && pz->optimal);
  EXPECT_NEAR(pa->cost, pz->cost, 1e-9 * pz->cost);
  EXPECT_LT(pa->states_expanded, pz->states_expanded);
}

// Identical layers are solved once: the block search expands as many states
// for 8 layers as for 2, and finds the same optimum as A*.
TEST(SynthTest, RepeatedLayersDoNotMultiplySearchWork) {
  auto c = MakeCluster({3.86e12, 3.86e12, 2.15e12, 2.15e12}, 2, 9.5e9, 3e9);
  std::vector<int64_t> states;
  for (int layers : {2, 8}) {
    auto p = Small("gpt", 32);
    p["layers"] = layers;
    graph::Graph g = Zoo("gpt", p);
    SearchOptions blocked;
    SearchOptions astar;
    astar.block_search = false;
    auto pb = Synthesize(g, c, blocked);
    auto pa = Synthesize(g, c, astar);
    ASSERT_TRUE(pb.ok() && pa.ok());
    EXPECT_TRUE(pb->optimal);
    EXPECT_NEAR(pb->cost, pa->cost, 1e-9 * pa->cost);
    EXPECT_TRUE(CheckProgram(g, *pb, c.size()).ok());
    states.push_back(pb->states_expanded);
  }
  EXPECT_EQ(states[0], states[1]);
}

TEST(SynthTest, DeterministicOutput) {
  graph::Graph g = Zoo("vit", Small("vit", 16));
  auto c = MakeCluster({2e13, 1e13, 1e13, 1e13}, 2);
  auto a = PlanModel(g, c, PlanOptions());
  auto b = PlanModel(g, c, PlanOptions());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->program.steps.size(), b->program.steps.size());
  for (size_t i = 0; i < a->program.steps.size(); ++i) {
    const OpStep &x = a->program.steps[i], &y = b->program.steps[i];
    EXPECT_EQ(x.rule.name, y.rule.name);
    ASSERT_EQ(x.loads.size(), y.loads.size());
    for (size_t k = 0; k < x.loads.size(); ++k) {
      EXPECT_EQ(x.loads[k].tensor, y.loads[k].tensor);
      EXPECT_EQ(x.loads[k].storage, y.loads[k].storage);
      EXPECT_EQ(x.loads[k].sfb, y.loads[k].sfb);
    }
    ASSERT_EQ(x.comms.size(), y.comms.size());
    for (size_t k = 0; k < x.comms.size(); ++k) {
      EXPECT_EQ(x.comms[k].to, y.comms[k].to);
      EXPECT_EQ(x.comms[k].method, y.comms[k].method);
    }
  }
  EXPECT_EQ(a->ratios, b->ratios);
  EXPECT_EQ(a->cost.total, b->cost.total);
  EXPECT_EQ(a->source, b->source);
}

TEST(SynthTest, BudgetCutReturnsCompleteProgramNotProvenOptimal) {
  graph::Graph g = Zoo("gpt", Small("gpt", 32));
  auto c = MakeCluster({2e13, 2e13, 1e13, 1e13}, 2);
  SearchOptions so;
  so.max_states = 10;
  auto p = Synthesize(g, c, so);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->optimal);
  EXPECT_TRUE(CheckProgram(g, *p, c.size()).ok());
  int calls = 0;
  so.max_states = 1'000'000;
  so.cancelled = [&]() { return ++calls > 2; };
  auto q = Synthesize(g, c, so);
  ASSERT_TRUE(q.ok()) << q.status();  // the greedy incumbent survives
  EXPECT_GT(calls, 2);                // it was cancelled...
  EXPECT_FALSE(q->optimal);           // ...and says it was cut
  EXPECT_TRUE(CheckProgram(g, *q, c.size()).ok());
}

TEST(SynthTest, ProgressReportsStates) {
  graph::Graph g = Zoo("gpt", Small("gpt", 32));
  auto c = MakeCluster({2e13, 2e13, 1e13, 1e13}, 2);
  SearchOptions so;
  so.progress_every = 16;
  int64_t last = -1;
  int calls = 0;
  so.progress = [&](int64_t states, double best) {
    EXPECT_GE(states, last);
    EXPECT_GE(best, 0);
    last = states;
    ++calls;
  };
  ASSERT_TRUE(Synthesize(g, c, so).ok());
  EXPECT_GT(calls, 2);
}

// Memory that holds the LP's split (511.5 samples each) but no whole-sample
// one (512 and 511): the plan keeps the LP's fractional ratios, and says so
// (the executors run them rounded, a sample more than fits on a device).
TEST(SynthTest, NoWholeSampleSplitThatFitsIsNoted) {
  graph::Graph g = Zoo("mlp", {{"layers", 2}, {"hidden", 64}, {"input", 64}, {"batch", 1023}});
  auto big = MakeCluster({1e12, 1e12}, 2, 1e13, 1e13);
  auto free_run = PlanModel(g, big, PlanOptions());
  ASSERT_TRUE(free_run.ok()) << free_run.status();
  EXPECT_THAT(free_run->notes, ::testing::IsEmpty());
  const ratios::MemoryConstraint m =
      MemoryModel(g, big, free_run->program, OptimizerKind::kSgdMomentum);
  ASSERT_GT(m.coef[0][0], 0);  // sharded activations
  std::vector<cost::DeviceModel> d = big.devices();
  for (int i = 0; i < 2; ++i) {
    d[i].memory_bytes = static_cast<int64_t>(std::ceil(m.constant[i] + m.coef[0][i] / 2));
  }
  auto tight = *cost::ClusterModel::Create(d, {{0, 1e13}, {1e13, 0}}, {{0, 5e-6}, {5e-6, 0}});
  auto r = PlanModel(g, tight, PlanOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->ratios[0], 0.5, 1e-6);
  EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("no split of whole samples")));
}

// A cancellation once a plan is known (the service's also fires at its
// caller's deadline) returns that plan with a note, without searching the
// baselines (their searches and LPs took as long as an uncancelled plan's).
TEST(SynthTest, CancellationReturnsThePlanFoundWithoutTheBaselines) {
  graph::Graph g = Zoo("gpt", Small("gpt", 32));
  auto c = MakeCluster({2e13, 2e13, 1e13, 1e13}, 2);
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "in line");
    bool cancel = false;
    int calls_after_cancel = 0;
    PlanOptions o;
    o.overlap_communication = overlap;
    o.cancelled = [&]() { return cancel; };
    o.progress = [&](int64_t, double best, int) {
      // The first search's last report: a complete program.
      calls_after_cancel += cancel;
      if (best > 0) cancel = true;
    };
    auto r = PlanModel(g, c, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(cancel);
    EXPECT_EQ(calls_after_cancel, 0);  // no search after it
    EXPECT_EQ(r->source, "search");
    EXPECT_FALSE(r->optimal);
    EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("cancelled")));
    EXPECT_TRUE(CheckProgram(g, r->program, c.size()).ok());
  }
}

// The plan is never predicted slower than a baseline planned alone: every
// candidate (the search's, each baseline's program at its own split and at
// the LP's) is compared at whole samples, as the lowering runs it. They were
// compared at the LP's fractional ratios and only the winner snapped, so a
// program that tied data parallelism there (8 equal devices, a batch of 17:
// a split of 2.125 samples each) could lose 2.7% to it once rounded.
TEST(SynthTest, ThePlanIsNeverSlowerThanABaselineAtWholeSamples) {
  // GPUs as the example clusters have them (planner/examples: 10 us
  // launches, queued; 9.5e9 B/s inside a node, 3e9 B/s between).
  const auto gpus = [](const std::vector<double>& flops, int per_node) {
    std::vector<cost::DeviceModel> d;
    const int n = static_cast<int>(flops.size());
    for (int i = 0; i < n; ++i) {
      cost::DeviceModel m{"d" + std::to_string(i),
                          "n" + std::to_string(i / per_node),
                          "test",
                          flops[i],
                          32 * kGiB,
                          1e-5};
      m.queued_launches = true;
      d.push_back(m);
    }
    std::vector<std::vector<double>> bw(n, std::vector<double>(n, 0)),
        lat(n, std::vector<double>(n, 0));
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        if (i == j) continue;
        const bool same = i / per_node == j / per_node;
        bw[i][j] = same ? 9.5e9 : 3e9;
        lat[i][j] = same ? 1e-5 : 5e-5;
      }
    }
    return *cost::ClusterModel::Create(d, bw, lat);
  };
  struct Case {
    std::string model;
    std::vector<double> flops;
    int per_node;
  };
  const std::vector<Case> cases = {
      {"gpt", std::vector<double>(8, 5.97e12), 8},
      {"gpt", {3.86e12, 3.86e12, 3.86e12, 3.86e12, 2.15e12, 2.15e12, 2.15e12, 2.15e12}, 4},
      {"vit", {3.86e12, 3.86e12, 3.86e12, 3.86e12, 2.15e12, 2.15e12, 2.15e12, 2.15e12}, 4},
  };
  for (const Case& c : cases) {
    const auto cluster = gpus(c.flops, c.per_node);
    for (int batch : {9, 17, 20}) {
      SCOPED_TRACE(absl::StrCat(c.model, " on ", cluster.size(), " devices, batch ", batch));
      graph::Graph g = Zoo(c.model, {{"layers", 2}, {"batch", batch}});
      auto plan = PlanModel(g, cluster, PlanOptions());
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (Baseline b :
           {Baseline::kDpEven, Baseline::kDpProportional, Baseline::kMegatron, Baseline::kZero3}) {
        PlanOptions o;
        o.baseline = b;
        auto base = PlanModel(g, cluster, o);
        // Each baseline plans these models (a failing one was skipped, and
        // the comparison with it).
        ASSERT_TRUE(base.ok()) << BaselineName(b) << ": " << base.status();
        EXPECT_LE(plan->cost.total, base->cost.total * (1 + 1e-9))
            << BaselineName(b) << " (the plan's source: " << plan->source << ")";
      }
    }
  }
}

// The snap before device groups (test-only reference): the rounded split and
// all N(N-1) one-sample moves built whole and each costed by EvaluateProgram;
// the first strictly better (relative 1e-9) valid split in that order wins.
std::vector<double> ExhaustiveSnap(const Program& p,
                                   const std::vector<double>& ratios,
                                   int64_t batch,
                                   const ratios::MemoryConstraint* mem) {
  const int n = static_cast<int>(ratios.size());
  const std::vector<int64_t> base = ratios::RoundShardsAtLeastOne(batch, ratios);
  std::vector<std::vector<int64_t>> splits = {base};
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j || base[i] <= 1) continue;
      std::vector<int64_t> m = base;
      --m[i];
      ++m[j];
      splits.push_back(std::move(m));
    }
  }
  double best_cost = INFINITY;
  std::vector<double> best;
  for (const std::vector<int64_t>& m : splits) {
    std::vector<double> r;
    bool ok = true;
    for (int d = 0; d < n; ++d) {
      ok = ok && m[d] >= 1;
      r.push_back(static_cast<double>(m[d]) / static_cast<double>(batch));
    }
    if (!ok) continue;
    if (mem != nullptr) {
      const std::vector<int64_t> bytes = MemoryAt(*mem, r);
      for (int d = 0; d < n && ok; ++d) {
        ok = bytes[d] <= static_cast<int64_t>(mem->capacity[d]);
      }
      if (!ok) continue;
    }
    const double cost = EvaluateProgram(p, r).total;
    if (cost < best_cost * (1 - 1e-9)) {
      best_cost = cost;
      best = std::move(r);
    }
  }
  return best;
}

// The group snap picks the split the exhaustive one picks: clusters with
// repeated and distinct devices, programs searched at several splits, the
// LP's, proportional and perturbed ratios, with memory free, tight on some
// devices (a sample more does not fit), and missing (a device at 0).
TEST(SynthTest, GroupSnapMatchesExhaustiveSnap) {
  struct SnapCase {
    std::string name;
    cost::ClusterModel cluster;
  };
  std::vector<SnapCase> cases;
  cases.push_back({"4 same", MakeCluster({1e13, 1e13, 1e13, 1e13}, 4)});
  cases.push_back(
      {"2 kinds x 3", MakeCluster({2e13, 2e13, 2e13, 1e13, 1e13, 1e13}, 3)});
  cases.push_back(
      {"3 kinds, 2 a node",
       MakeCluster({3e13, 2e13, 1e13, 3e13, 2e13, 1e13, 3e13, 1e13}, 2)});
  cases.push_back(
      {"all distinct", MakeCluster({1e13, 1.3e13, 1.7e13, 2.2e13, 2.9e13}, 5)});
  cases.push_back({"12 of 2 kinds, slow links",
                   MakeCluster({2.5e12, 2.5e12, 2.5e12, 1e12, 1e12, 1e12, 1e12,
                                1e12, 1e12, 2.5e12, 1e12, 1e12},
                               4, 1e10, 1e9)});
  std::mt19937 rng(7);
  int cases_run = 0, moved = 0, memory_bound = 0;
  for (const SnapCase& c : cases) {
    const int n = c.cluster.size();
    for (const char* model : {"gpt", "mlp"}) {
      for (int per_device : {3, 8}) {
        SCOPED_TRACE(
            absl::StrCat(c.name, ", ", model, ", batch ", per_device * n));
        graph::Graph g = Zoo(model, Small(model, per_device * n));
        const int64_t batch = per_device * n;
        PlanOptions po;
        po.snap_ratios_to_batch = false;
        auto plan = PlanModel(g, c.cluster, po);
        ASSERT_TRUE(plan.ok()) << plan.status();
        std::vector<std::vector<double>> splits = {
            plan->ratios, c.cluster.ProportionalRatios()};
        std::uniform_real_distribution<double> jitter(0.5, 1.5);
        for (int k = 0; k < 3; ++k) {
          std::vector<double> r = plan->ratios;
          double sum = 0;
          for (double& x : r) sum += (x *= jitter(rng));
          for (double& x : r) x /= sum;
          splits.push_back(r);
        }
        std::vector<double> starved = c.cluster.EvenRatios();  // a device at 0
        starved[0] += starved[n - 1];
        starved[n - 1] = 0;
        splits.push_back(starved);
        const ratios::MemoryConstraint free_mem = MemoryModel(
            g, c.cluster, plan->program, OptimizerKind::kSgdMomentum);
        for (const std::vector<double>& r : splits) {
          // Tight: every other device (every device) holds exactly its
          // rounded share.
          ratios::MemoryConstraint tight = free_mem, tightest = free_mem;
          const std::vector<int64_t> base = ratios::RoundShardsAtLeastOne(batch, r);
          for (int d = 0; d < n; ++d) {
            const double at = std::floor(free_mem.constant[d] +
                                         free_mem.coef[0][d] * base[d] /
                                             static_cast<double>(batch));
            tightest.capacity[d] = at;
            if (d % 2 == 0) tight.capacity[d] = at;
          }
          for (const ratios::MemoryConstraint* mem :
               std::vector<const ratios::MemoryConstraint*>{
                   nullptr, &free_mem, &tight, &tightest}) {
            SnapRequest q;
            q.program = &plan->program;
            q.ratios = r;
            q.batch = batch;
            q.memory = mem;
            const SnapResult got = SnapToSamples(q);
            const std::vector<double> want =
                ExhaustiveSnap(plan->program, r, batch, mem);
            ASSERT_EQ(got.ratios, want);
            EXPECT_TRUE(got.complete);
            EXPECT_LE(got.moves_evaluated,
                      static_cast<int64_t>(got.groups) * got.groups);
            if (!want.empty()) {
              EXPECT_NEAR(got.cost, EvaluateProgram(plan->program, want).total,
                          1e-9 * got.cost);
              std::vector<double> rounded;
              for (int64_t m : base)
                rounded.push_back(m / static_cast<double>(batch));
              moved += want != rounded;
              memory_bound +=
                  mem == &tightest &&
                  want != ExhaustiveSnap(plan->program, r, batch, nullptr);
            }
            ++cases_run;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases_run, 5 * 2 * 2 * 6 * 4);
  // The comparisons covered moves and memory that changed the answer.
  EXPECT_GT(moved, 10);
  EXPECT_GT(memory_bound, 0);
}

// Groups: 64 devices of 2 kinds snap with a handful of group moves, not
// 64 x 63; a deadline already passed leaves the rounded split.
TEST(SynthTest, SnapMovesBetweenGroupsAndStopsAtTheDeadline) {
  std::vector<double> flops;
  for (int i = 0; i < 64; ++i) flops.push_back(i % 4 == 0 ? 2.5e12 : 1e12);
  auto c = MakeCluster(flops, 8);
  graph::Graph g = Zoo("gpt", Small("gpt", 64 * 5));
  SearchOptions so;
  auto p = Synthesize(g, c, so);
  ASSERT_TRUE(p.ok()) << p.status();
  SnapRequest q;
  q.program = &*p;
  q.ratios = c.ProportionalRatios();
  q.batch = 64 * 5;
  const SnapResult s = SnapToSamples(q);
  EXPECT_TRUE(s.complete);
  EXPECT_LE(s.groups, 4);  // 2 kinds x (k, k + 1 samples)
  EXPECT_GE(s.groups, 2);
  EXPECT_LE(s.moves_evaluated, 16);
  EXPECT_EQ(s.ratios, ExhaustiveSnap(*p, q.ratios, q.batch, nullptr));

  // 64 distinct devices make 64 x 63 group moves; the deadline is looked at
  // every 256.
  q.deadline = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  std::vector<double> distinct;
  for (int i = 0; i < 64; ++i) distinct.push_back(1e12 * (1 + i / 64.0));
  auto dc = MakeCluster(distinct, 64, 1e11, 1e11);
  auto dp = Synthesize(g, dc, so);
  ASSERT_TRUE(dp.ok()) << dp.status();
  q.program = &*dp;
  q.ratios = dc.ProportionalRatios();
  const SnapResult cut = SnapToSamples(q);
  EXPECT_FALSE(cut.complete);
  EXPECT_EQ(cut.moves_evaluated, 255);  // then the deadline was looked at
  // The best of the rounded split and the moves tried.
  std::vector<double> rounded;
  for (int64_t m : ratios::RoundShardsAtLeastOne(q.batch, q.ratios)) {
    rounded.push_back(m / static_cast<double>(q.batch));
  }
  EXPECT_LE(EvaluateProgram(*dp, cut.ratios).total,
            EvaluateProgram(*dp, rounded).total);
  q.deadline.reset();
  const SnapResult whole = SnapToSamples(q);
  EXPECT_TRUE(whole.complete);
  EXPECT_GT(whole.moves_evaluated, 64 * 60);
  EXPECT_EQ(whole.ratios, ExhaustiveSnap(*dp, q.ratios, q.batch, nullptr));
}

// With overlap a plan is predicted at the critical path (EvaluateProgram):
// the snap prices its candidates so (it priced them with the collectives in
// line, and could pick a split slower than its neighbours).
TEST(SynthTest, OverlapSnapPricesTheCriticalPath) {
  graph::Graph g = Zoo("moe", {{"layers", 2},
                               {"hidden", 256},
                               {"heads", 4},
                               {"ffn", 512},
                               {"seq", 32},
                               {"vocab", 512},
                               {"experts", 8},
                               {"batch", 24}});
  for (double bw : {1e9, 1e10}) {
    SCOPED_TRACE(absl::StrCat("bandwidth ", bw));
    auto c = MakeCluster({2.5e12, 1e12, 1e12, 1.7e12}, 2, 3 * bw, bw);
    PlanOptions o;
    o.overlap_communication = true;
    auto r = PlanModel(g, c, o);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->program.overlap);
    for (const std::vector<double>& at : {c.ProportionalRatios(), r->ratios}) {
      SnapRequest q;
      q.program = &r->program;
      q.ratios = at;
      q.batch = 24;
      const SnapResult s = SnapToSamples(q);
      EXPECT_EQ(s.ratios, ExhaustiveSnap(r->program, at, 24, nullptr));
      EXPECT_NEAR(s.cost, EvaluateProgram(r->program, s.ratios).total, 1e-12);
    }
  }
}

// Every device holds at least one whole sample, as the lowering lays the
// batch out, and the plan is predicted there: where the LP gives two or
// more devices nothing (a program whose cost hardly depends on the split),
// the ratios were the LP's, fractional and 0, and no one-sample move could
// make them whole.
TEST(SynthTest, EveryDeviceHoldsAWholeSampleAsLowered) {
  graph::Graph g = Zoo("gpt", {{"layers", 2},
                               {"hidden", 256},
                               {"heads", 4},
                               {"ffn", 512},
                               {"seq", 32},
                               {"vocab", 512},
                               {"batch", 16}});
  auto c = MakeCluster({2.5e12, 1e12, 1e12}, 3, 1e9, 1e9);
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "in line");
    PlanOptions o;
    o.overlap_communication = overlap;
    auto r = PlanModel(g, c, o);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<int64_t> samples;
    for (double x : r->ratios) {
      EXPECT_NEAR(x * 16, std::round(x * 16), 1e-9);
      samples.push_back(std::llround(x * 16));
    }
    EXPECT_EQ(samples, ratios::RoundShardsAtLeastOne(16, r->ratios));
    EXPECT_THAT(samples, ::testing::Each(::testing::Ge(1)));
    EXPECT_NEAR(EvaluateProgram(r->program, r->ratios).total, r->cost.total, 1e-12);
  }
}

// Budgets return the best plan found, with a note, not an error: a state
// budget too small to finish any search, and a time budget spent before the
// LP, on a model that fits.
TEST(SynthTest, SpentBudgetsReturnTheBestPlanWithANote) {
  graph::Graph g = Zoo("gpt", {{"layers", 2},
                               {"hidden", 256},
                               {"heads", 4},
                               {"ffn", 1024},
                               {"seq", 64},
                               {"vocab", 1024},
                               {"batch", 64}});
  auto c = MakeCluster({2e13, 2e13, 1e13, 1e13}, 2);
  auto full = PlanModel(g, c, PlanOptions());
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_THAT(full->notes, ::testing::IsEmpty());
  for (int64_t states : {1, 10, 1000}) {
    SCOPED_TRACE(absl::StrCat(states, " states"));
    PlanOptions o;
    o.max_states = states;
    auto r = PlanModel(g, c, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->optimal);
    EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("state budget")));
    EXPECT_TRUE(CheckProgram(g, r->program, c.size()).ok());
    EXPECT_GE(r->cost.total, full->cost.total * (1 - 1e-9));
    for (int d = 0; d < c.size(); ++d) {
      EXPECT_LE(r->memory_bytes[d], c.device(d).memory_bytes);
    }
  }
  PlanOptions o;
  o.max_seconds = 1e-9;
  auto r = PlanModel(g, c, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("time budget")));
  EXPECT_TRUE(CheckProgram(g, r->program, c.size()).ok());
  double sum = 0;
  for (double x : r->ratios) sum += x;
  EXPECT_NEAR(sum, 1.0, 1e-12);
  EXPECT_NEAR(EvaluateProgram(r->program, r->ratios).total, r->cost.total,
              1e-12);
}

// A state budget too small for any search (GPT-12 on 64 devices): the
// greedy complete programs the cut searches return, data-parallel ones too,
// keep whole activations on every device (234 GiB) and do not fit, where
// data parallelism does; the planner falls back to the baseline programs
// searched with their own state budget and returns a plan that fits, never
// a false "does not fit".
TEST(SynthTest, StateBudgetOnATightClusterStillFits) {
  graph::Graph g = Zoo("gpt", {{"layers", 12}, {"batch", 32 * 64}});
  std::vector<double> flops;
  for (int i = 0; i < 64; ++i) flops.push_back(i < 16 ? 3.86e12 : 2.15e12);
  auto c = MakeCluster(flops, 8, 9.5e9, 3e9, 40 * kGiB);
  auto unlimited = PlanModel(g, c, PlanOptions());
  ASSERT_TRUE(unlimited.ok()) << unlimited.status();
  for (int64_t states : {1, 1000}) {
    SCOPED_TRACE(absl::StrCat(states, " states"));
    PlanOptions o;
    o.max_states = states;
    auto r = PlanModel(g, c, o);
    ASSERT_TRUE(r.ok()) << r.status();
    for (int i = 0; i < c.size(); ++i) {
      EXPECT_LE(r->memory_bytes[i], c.device(i).memory_bytes);
    }
    EXPECT_TRUE(CheckProgram(g, r->program, c.size()).ok());
    EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("state budget")));
  }
}

TEST(SynthTest, BadInput) {
  graph::Graph g = Zoo("mlp", Small("mlp", 2));
  auto c = MakeCluster({1e13, 1e13, 1e13, 1e13}, 4);
  auto r = PlanModel(g, c, PlanOptions());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("batch 2"));

  graph::Graph g8 = Zoo("mlp", Small("mlp", 8));
  SearchOptions so;
  so.ratios = {0.5, 0.5};
  EXPECT_EQ(Synthesize(g8, c, so).status().code(),
            absl::StatusCode::kInvalidArgument);
  so.ratios = {0.5, 0.5, 0.5, NAN};
  EXPECT_EQ(Synthesize(g8, c, so).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseBaseline("fsdp").ok());

  // Options no search can run with: a clear error (progress_every 0 divides
  // by zero in the A* search; a NaN price or budget searched with NaN costs
  // or no time limit).
  auto expect_invalid = [&](const SearchOptions& o, const std::string& what) {
    auto p = Synthesize(g8, c, o);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(what));
    EXPECT_EQ(RandomProgram(g8, c, o, 1).status().code(), absl::StatusCode::kInvalidArgument)
        << what;
  };
  SearchOptions bad;
  bad.progress_every = 0;
  bad.progress = [](int64_t, double) {};
  expect_invalid(bad, "progress_every = 0");
  bad = SearchOptions();
  bad.async_price = NAN;
  expect_invalid(bad, "async_price = nan");
  bad.async_price = -1;
  expect_invalid(bad, "async_price = -1");
  bad = SearchOptions();
  bad.gradient_wire_scale = 0;
  expect_invalid(bad, "gradient_wire_scale = 0");
  bad = SearchOptions();
  bad.max_seconds = NAN;
  expect_invalid(bad, "max_seconds is NaN");
  PlanOptions po;
  po.max_seconds = NAN;
  auto r8 = PlanModel(g8, c, po);
  EXPECT_EQ(r8.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r8.status().message()), HasSubstr("max_seconds is NaN"));
  po = PlanOptions();
  po.search_async_price = -0.5;
  r8 = PlanModel(g8, c, po);
  EXPECT_EQ(r8.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r8.status().message()), HasSubstr("search_async_price = -0.5"));
}

}  // namespace
}  // namespace hap::synth
