// Communication overlapped with compute (Program::overlap): hand-built
// programs where a collective is hidden entirely, partly or not at all, ZeRO
// prefetching, the LP's critical path against the evaluator, and planning
// with overlap on real models.
#include <cmath>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/cost/cluster_model.h"
#include "planner/cost/collectives.h"
#include "planner/graph/zoo.h"
#include "planner/ratios/ratio_lp.h"
#include "planner/synth/checker.h"
#include "planner/synth/planner.h"
#include "planner/synth/program.h"
#include "planner/synth/search.h"

namespace hap::synth {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

CostTerm Const(double seconds, int n = 2) {
  CostTerm t;
  t.coef.assign(n, 0);
  t.constant.assign(n, seconds);
  return t;
}

// Compute of `seconds` at an even split on 2 devices: coef 2 s per unit ratio.
CostTerm Compute(double seconds) {
  CostTerm t;
  t.coef = {2 * seconds, 2 * seconds};
  t.constant = {0, 0};
  return t;
}

// Two ops: op 0 computes c0, op 1 computes c1 and holds a replicated
// parameter whose gradient bucket (`comm` seconds) is complete after op 1's
// backward; op 0's backward (2/3 c0) is left to hide it.
Program TwoOps(double c0, double c1, double comm) {
  Program p;
  p.steps.resize(2);
  p.steps[0].op = 0;
  p.steps[0].compute = Compute(c0);
  p.steps[1].op = 1;
  p.steps[1].compute = Compute(c1);
  SourceLoad l;
  l.tensor = 0;
  l.parameter = true;
  l.grad_allreduce = true;
  l.costs.push_back(Const(comm));  // per-tensor share; buckets replace it
  p.steps[1].loads.push_back(l);
  GradientBucket b;
  b.tensors = {0};
  b.bytes = 1 << 20;
  b.ready_step = 1;
  b.cost = Const(comm);
  p.buckets.push_back(b);
  return p;
}

const std::vector<double> kEven = {0.5, 0.5};

TEST(OverlapTest, CollectiveHiddenEntirelyPartlyOrNotAtAll) {
  const double c0 = 0.3, c1 = 0.6;  // op 0's backward: 0.2 s
  struct Case {
    double comm, interference, exposed;
  };
  for (const Case& k : {Case{0.15, 0, 0},          // all hidden
                        Case{0.25, 0, 0.05},       // part: 0.05 s sticks out
                        Case{0.15, 1, 0.15},       // efficiency 0: none hidden
                        Case{0.15, 0.5, 0.075}}) {  // half the slowdown
    SCOPED_TRACE(::testing::Message() << "comm " << k.comm << " interference "
                                      << k.interference);
    Program p = TwoOps(c0, c1, k.comm);
    const ProgramCost off = EvaluateProgram(p, kEven);
    EXPECT_NEAR(off.total, c0 + c1 + k.comm, 1e-12);
    EXPECT_NEAR(off.communication, k.comm, 1e-12);
    p.overlap = true;
    p.interference = {k.interference, k.interference};
    const ProgramCost on = EvaluateProgram(p, kEven);
    EXPECT_NEAR(on.total, c0 + c1 + k.exposed, 1e-12);
    EXPECT_NEAR(on.communication_busy, k.comm, 1e-12);
    EXPECT_NEAR(on.compute + on.communication, on.total, 1e-12);
    // The compute alone is the same step with no collective.
    EXPECT_NEAR(on.compute, c0 + c1, 1e-12);
  }
}

TEST(OverlapTest, FreeCollectivesDoNotSynchronise) {
  // Device 0 is slow in op 0, device 1 in op 1: each runs its kernels
  // without waiting between them, so the step is the larger per-device sum
  // (0.9 s each), not the sum of per-op maxima. Every op carries a zero-cost
  // internal gather and a free slice, as real programs do, and a zero-cost
  // launch before the bucket; none of them may synchronise the devices.
  Program p = TwoOps(0.3, 0.6, 0.1);
  p.steps[0].compute.coef = {2 * 0.6, 2 * 0.3};
  p.steps[1].compute.coef = {2 * 0.3, 2 * 0.6};
  for (OpStep& s : p.steps) {
    s.internal = Const(0);
    CommStep c;
    c.forward_cost = Const(0);
    c.backward_cost = Const(0);
    c.has_backward = true;
    s.comms.push_back(c);
  }
  GradientBucket empty = p.buckets[0];
  empty.cost = Const(0);
  p.buckets.insert(p.buckets.begin(), empty);
  const ProgramCost off = EvaluateProgram(p, kEven);
  EXPECT_NEAR(off.compute, 0.9, 1e-12);
  p.overlap = true;
  const ProgramCost on = EvaluateProgram(p, kEven);
  EXPECT_NEAR(on.compute, 0.9, 1e-12);
  // The bucket (0.1 s) is started after op 1's backward: device 0 has 0.4 s
  // of op 0's backward left, device 1 0.2 s, both hide it.
  EXPECT_NEAR(on.total, 0.9, 1e-12);
}

TEST(OverlapTest, TheLastBucketIsExposed) {
  // A bucket complete only at the end of backward (op 0's) hides nothing:
  // the optimizer waits for it.
  Program p = TwoOps(0.3, 0.6, 0.1);
  p.buckets[0].ready_step = 0;
  p.overlap = true;
  EXPECT_NEAR(EvaluateProgram(p, kEven).total, 0.9 + 0.1, 1e-12);
}

TEST(OverlapTest, BucketsRunOneAtATime) {
  // Two buckets started together after op 1's backward share the stream:
  // 0.15 + 0.15 s behind 0.2 s of compute leaves 0.1 s exposed.
  Program p = TwoOps(0.3, 0.6, 0.15);
  p.buckets.push_back(p.buckets[0]);
  p.overlap = true;
  EXPECT_NEAR(EvaluateProgram(p, kEven).total, 0.9 + 0.1, 1e-12);
}

TEST(OverlapTest, ZeroGathersArePrefetchedOneAhead) {
  // Op 0 and op 1 hold ZeRO-3 parameters; each gather (forward, then again
  // for backward) takes g seconds, each op's compute c (c/3 forward).
  const double c = 0.3, g = 0.05;
  Program p;
  p.steps.resize(2);
  for (int k = 0; k < 2; ++k) {
    p.steps[k].op = k;
    p.steps[k].compute = Compute(c);
    SourceLoad l;
    l.tensor = k;
    l.parameter = true;
    l.storage = ParamStorage::kZero;
    l.costs = {Const(g), Const(g)};
    p.steps[k].loads.push_back(l);
  }
  EXPECT_NEAR(EvaluateProgram(p, kEven).total, 2 * c + 4 * g, 1e-12);
  p.overlap = true;
  // Forward: op 0's gather waited for first (exposed), op 1's runs behind
  // op 0's forward (0.1 s > g). Backward: op 1's gather starts when forward
  // ends (exposed), op 0's behind op 1's backward.
  EXPECT_NEAR(EvaluateProgram(p, kEven).total, 2 * c + 2 * g, 1e-12);
  // A gather longer than the compute in front of it shows the difference.
  for (auto& s : p.steps) s.loads[0].costs = {Const(0.15), Const(0.15)};
  EXPECT_NEAR(EvaluateProgram(p, kEven).total, 2 * c + 0.15 + 0.05 + 0.15, 1e-12);
}

TEST(OverlapTest, RatioLpOptimisesTheCriticalPath) {
  // Device 0 computes twice as fast as device 1. The collective is hidden
  // behind op 0's backward at any split near the optimum, so the LP gives the
  // compute split (2/3, 1/3); its objective is the evaluator's.
  Program p = TwoOps(0.3, 0.6, 0.15);
  for (OpStep& s : p.steps) s.compute.coef[1] *= 2;
  p.overlap = true;
  ratios::RatioLpRequest req;
  req.num_devices = 2;
  AddProgramTerms(p, &req);
  ASSERT_TRUE(req.path.has_value());
  auto r = ratios::SolveRatioLp(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->ratios[0][0], 2.0 / 3, 1e-6);
  EXPECT_NEAR(r->objective, EvaluateProgram(p, r->ratios[0]).total, 1e-9);
  EXPECT_NEAR(r->objective, 2 * 0.9 * 2.0 / 3, 1e-9);
  // Without overlap the LP sums: the same split, the collective on top.
  p.overlap = false;
  ratios::RatioLpRequest sum;
  sum.num_devices = 2;
  AddProgramTerms(p, &sum);
  EXPECT_FALSE(sum.path.has_value());
  EXPECT_NEAR(ratios::SolveRatioLp(sum)->objective, 2 * 0.9 * 2.0 / 3 + 0.15, 1e-9);
}

cost::ClusterModel TwoNodes(double inter_bw, double efficiency = 1.0) {
  std::vector<cost::DeviceModel> d;
  const int n = 8;
  for (int i = 0; i < n; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / 4), "test",
                 i < 4 ? 3.86e12 : 2.15e12, 40 * kGiB, 1e-5});
    d.back().overlap_efficiency = efficiency;
  }
  return *cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, inter_bw, 5e-5);
}

// Kernel launches: a CPU pays each; a GPU's queue hides them behind its
// kernels but for what they take beyond the kernels.
TEST(LaunchTest, ExposedLaunchFraction) {
  cost::DeviceModel cpu{"c", "n", "cpu", 1e9, kGiB, 1e-5};
  cost::DeviceModel gpu = cpu;
  gpu.queued_launches = true;
  EXPECT_EQ(cost::ExposedLaunchFraction(cpu, 100, 10.0), 1.0);  // kernels never hide them
  EXPECT_EQ(cost::ExposedLaunchFraction(gpu, 100, 0.0), 1.0);   // nothing to hide behind
  EXPECT_NEAR(cost::ExposedLaunchFraction(gpu, 100, 0.5e-3), 0.5, 1e-12);
  EXPECT_EQ(cost::ExposedLaunchFraction(gpu, 100, 1e-3), 0.0);  // kernels as long: all hidden
  EXPECT_EQ(cost::ExposedLaunchFraction(gpu, 100, 1.0), 0.0);
  gpu.launch_overhead_seconds = 0;
  EXPECT_EQ(cost::ExposedLaunchFraction(gpu, 100, 1.0), 1.0);  // no overhead at all

  // From a profile: GPUs queue, CPUs do not.
  hap::v1::Cluster c;
  c.mutable_defaults()->set_intra_node_bandwidth_bytes_per_second(1e10);
  auto* node = c.add_nodes();
  node->set_name("n");
  for (auto kind : {hap::v1::GPU, hap::v1::CPU}) {
    auto* d = node->add_devices();
    d->set_id(kind == hap::v1::GPU ? "n/gpu0" : "n/cpu0");
    d->set_kind(kind);
    auto* f = d->add_flops();
    f->set_dtype(hap::v1::FLOAT32);
    f->set_flops(1e12);
    d->set_memory_bytes(kGiB);
  }
  auto m = cost::ClusterModel::FromProto(c);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->device(0).queued_launches);
  EXPECT_FALSE(m->device(1).queued_launches);
}

// Two identical devices running data parallelism at an even split, every
// op split: each device's kernels are half the model's, as the search
// estimates them. A step priced with queued launches pays max(launches,
// kernels) where a CPU pays their sum.
TEST(LaunchTest, QueuedLaunchesCostWhatTheyTakeBeyondTheKernels) {
  auto g = graph::BuildZooModel("mlp", {{"batch", 8}});
  ASSERT_TRUE(g.ok()) << g.status();
  double flops = 0, launches = 0;
  for (const OpWork& w : TrainingWork(*g)) {
    launches += w.backward ? 3 : 1;
    flops += w.flops;
  }
  auto step = [&](double rate, double launch, bool queued) {
    std::vector<cost::DeviceModel> d;
    for (int i = 0; i < 2; ++i) {
      d.push_back({"n/d" + std::to_string(i), "n", "test", rate, 40 * kGiB, launch});
      d.back().queued_launches = queued;
    }
    auto c = cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1e9, 5e-5);
    EXPECT_TRUE(c.ok()) << c.status();
    PlanOptions o;
    o.baseline = Baseline::kDpEven;
    auto p = PlanModel(*g, *c, o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->cost.compute : NAN;
  };
  // Kernels far longer than the launches: a GPU hides every launch.
  const double slow = 1e9, small = 1e-7;
  ASSERT_GT(flops / 2 / slow, 10 * launches * small);
  EXPECT_NEAR(step(slow, small, false) - step(slow, small, true), launches * small, 1e-12);
  // Launch-bound (tiny kernels, slow launches): a GPU pays the launches,
  // and its kernels run behind them.
  const double fast = 1e15, big = 1e-3;
  ASSERT_LT(flops / 2 / fast, 0.1 * launches * big);
  EXPECT_NEAR(step(fast, big, false) - step(fast, big, true), flops / 2 / fast, 1e-12);
}

// Gradients of the largest tensors the IR allows (2^59 float64 elements,
// 2^62 bytes) each fill their own bucket: two of them summed past
// INT64_MAX, wrapped negative and were put in one bucket priced at 0.
TEST(OverlapTest, BucketsOfTheLargestGradientsDoNotOverflow) {
  graph::GraphBuilder b("huge");
  const graph::TensorType huge{graph::DType::kFloat64, {int64_t{1} << 59}};
  const graph::TensorId w1 = b.Parameter("w1", huge, graph::Initializer::Zeros());
  const graph::TensorId w2 = b.Parameter("w2", huge, graph::Initializer::Zeros());
  b.SetLoss(b.Add("sum", "loss", {b.Add("add", "both", {w1, w2})}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  Program p;
  p.steps.resize(1);
  for (graph::TensorId w : {w1, w2}) {
    SourceLoad l;
    l.tensor = w;
    l.parameter = true;
    l.grad_allreduce = true;
    p.steps[0].loads.push_back(l);
  }
  std::vector<double> priced;
  AssignGradientBuckets(
      *g, kLoweringBucketBytes,
      [&](double bytes, const char** algorithm) {
        priced.push_back(bytes);
        *algorithm = "ring";
        return Const(bytes * 1e-9);
      },
      &p);
  ASSERT_EQ(p.buckets.size(), 2u);
  for (const GradientBucket& bucket : p.buckets) {
    EXPECT_EQ(bucket.tensors.size(), 1u);
    EXPECT_EQ(bucket.bytes, int64_t{1} << 62);
  }
  EXPECT_THAT(priced, ::testing::Each(std::ldexp(1.0, 62)));
}

TEST(OverlapTest, BucketsCoverEveryAllReducedGradientOnce) {
  auto g = graph::BuildZooModel("gpt", {{"layers", 2}, {"batch", 16}});
  ASSERT_TRUE(g.ok()) << g.status();
  cost::ClusterModel c = TwoNodes(3e9);
  SearchOptions so;
  so.overlap = true;
  auto p = Synthesize(*g, c, so);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->overlap);
  std::set<graph::TensorId> reduced;
  for (const OpStep& s : p->steps) {
    for (const SourceLoad& l : s.loads) {
      if (l.grad_allreduce) reduced.insert(l.tensor);
    }
  }
  ASSERT_FALSE(reduced.empty());
  std::set<graph::TensorId> bucketed;
  int prev_ready = static_cast<int>(p->steps.size());
  for (const GradientBucket& b : p->buckets) {
    int64_t bytes = 0;
    for (graph::TensorId t : b.tensors) {
      EXPECT_TRUE(bucketed.insert(t).second) << "tensor " << t << " twice";
      bytes += g->tensor(t).type.bytes();
    }
    EXPECT_EQ(bytes, b.bytes);
    EXPECT_TRUE(b.tensors.size() == 1 || b.bytes <= p->bucket_bytes);
    EXPECT_LE(b.ready_step, prev_ready);  // filled in backward order
    prev_ready = b.ready_step;
  }
  EXPECT_EQ(bucketed, reduced);
  EXPECT_THAT(std::vector<int64_t>(std::begin(kBucketCandidates), std::end(kBucketCandidates)),
              ::testing::Contains(p->bucket_bytes));
  // The chosen size is the best of the candidates at the search's ratios.
  Program q = *p;
  const double chosen = EvaluateProgram(*p, c.ProportionalRatios()).total;
  cost::CollectiveModel coll(c);
  for (int64_t bytes : kBucketCandidates) {
    AssignGradientBuckets(*g, bytes,
                          [&](double b, const char** a) {
                            *a = coll.AllReduceAlgorithm(b).algorithm;
                            return coll.Constant(coll.AllReduce(b));
                          },
                          &q);
    EXPECT_GE(EvaluateProgram(q, c.ProportionalRatios()).total, chosen * (1 - 1e-12));
  }
  // Without overlap the executors' bucket size is used.
  so.overlap = false;
  auto off = Synthesize(*g, c, so);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->bucket_bytes, kLoweringBucketBytes);
}

TEST(OverlapTest, PlanningWithOverlapHidesTheGradientAllReduce) {
  // GPT at batch 64 on two nodes joined by 10 GbE: in line the gradient
  // all-reduce is a large part of the step; overlapped behind backward much
  // of it is hidden, and the plan is never predicted slower.
  auto g = graph::BuildZooModel("gpt", {{"layers", 4}, {"batch", 64}});
  ASSERT_TRUE(g.ok()) << g.status();
  for (double eff : {1.0, 0.5}) {
    SCOPED_TRACE(::testing::Message() << "efficiency " << eff);
    cost::ClusterModel c = TwoNodes(1.25e9, eff);
    PlanOptions o;
    auto off = PlanModel(*g, c, o);
    ASSERT_TRUE(off.ok()) << off.status();
    o.overlap_communication = true;
    auto on = PlanModel(*g, c, o);
    ASSERT_TRUE(on.ok()) << on.status();
    EXPECT_TRUE(on->program.overlap);
    EXPECT_FALSE(off->program.overlap);
    EXPECT_TRUE(CheckProgram(*g, on->program, c.size()).ok());
    EXPECT_LT(on->cost.total, off->cost.total);
    EXPECT_LT(on->cost.communication, off->cost.communication);
    EXPECT_NEAR(on->cost.total, EvaluateProgram(on->program, on->ratios).total, 1e-12);
    EXPECT_GE(on->cost.total, on->cost.compute);
    if (eff == 1.0) {
      EXPECT_LT(on->cost.total, 0.8 * off->cost.total)
          << "on " << on->cost.total << " off " << off->cost.total;
    }
  }
}

TEST(OverlapTest, HiddenPricingLetsTheSearchPreferOverlappableCollectives) {
  // A wide MLP at a small batch over a slow link (1e8 B/s between nodes).
  // The program's own cost stays the critical path either way; the planner
  // compares both by it.
  auto g = graph::BuildZooModel("mlp", {{"batch", 8}, {"hidden", 2048}, {"layers", 4}});
  ASSERT_TRUE(g.ok()) << g.status();
  cost::ClusterModel c = TwoNodes(1e8);
  SearchOptions so;
  so.overlap = true;
  auto priced = Synthesize(*g, c, so);
  so.async_price = 0;
  auto hidden = Synthesize(*g, c, so);
  ASSERT_TRUE(priced.ok() && hidden.ok());
  auto count = [](const Program& p, bool sfb) {
    int n = 0;
    for (const OpStep& s : p.steps) {
      for (const SourceLoad& l : s.loads) n += sfb ? l.sfb : l.grad_allreduce;
    }
    return n;
  };
  // In line, the slow link makes every op replicated (each device computes
  // the whole batch, no collective at all); priced as hidden, the gradient
  // all-reduce of data parallelism is free to the search.
  EXPECT_EQ(count(*priced, false), 0);
  EXPECT_EQ(count(*hidden, true), 0);
  EXPECT_GT(count(*hidden, false), 0);
  EXPECT_TRUE(CheckProgram(*g, *hidden, c.size()).ok());
  EXPECT_NEAR(hidden->cost, EvaluateProgram(*hidden, c.ProportionalRatios()).total, 1e-12);
}

}  // namespace
}  // namespace hap::synth
