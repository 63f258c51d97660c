#include "planner/pipeline/pipeline.h"

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <numeric>
#include <set>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_file.h"
#include "planner/pipeline/layers.h"
#include "planner/pipeline/pipeline_plan.h"
#include "planner/pipeline/schedule.h"

namespace hap::pipeline {
namespace {

using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

StageTimes Times(double f, double b, double send = 0, double grad = 0, double sync = 0) {
  StageTimes t;
  t.forward = f;
  t.backward = b;
  t.send = send;
  t.gradient = grad;
  t.sync = sync;
  return t;
}

// Hand-computed 1F1B timelines (stage 0 runs F1 | F2 B1 | F3 B2 | B3 with
// one warm-up forward; stage 1 F1 B1 F2 B2 F3 B3):
//   s0 F1 0-1; s1 F1 1-2 B1 2-4; s0 F2 1-2 B1 4-6 F3 6-7;
//   s1 F2 4-5 B2 5-7; s0 B2 7-9; s1 F3 7-8 B3 8-10; s0 B3 10-12.
TEST(Schedule, TwoEqualStagesThreeMicrobatches) {
  auto r = Simulate1F1B({Times(1, 2), Times(1, 2)}, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->step, 12);   // (M + S - 1)(f + b)
  EXPECT_DOUBLE_EQ(r->bubble, 3);  // (S - 1)(f + b)
  EXPECT_DOUBLE_EQ(ClosedForm1F1B({Times(1, 2), Times(1, 2)}, 3), 12);
}

// With 0.5 s each way on the link, M = 2:
//   s0 F1 0-1, send 1-1.5; s1 F1 1.5-2.5 B1 2.5-4.5, gradient 4.5-5;
//   s0 F2 1-2, send 2-2.5; s0 B1 5-7; s1 F2 4.5-5.5 B2 5.5-7.5, gradient
//   7.5-8; s0 B2 8-10. Syncs of 1 s and 3 s end at 11 and 10.5.
TEST(Schedule, TransfersAndSync) {
  auto r = Simulate1F1B({Times(1, 2, 0.5, 0.5), Times(1, 2)}, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->step, 10);
  EXPECT_DOUBLE_EQ(ClosedForm1F1B({Times(1, 2, 0.5, 0.5), Times(1, 2)}, 2), 10);
  auto s = Simulate1F1B({Times(1, 2, 0.5, 0.5, 1), Times(1, 2, 0, 0, 3)}, 2);
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ(s->stage_finish[0], 11);
  EXPECT_DOUBLE_EQ(s->stage_finish[1], 10.5);
  EXPECT_DOUBLE_EQ(s->step, 11);
}

// A slow second stage: s0 F1 0-1; s1 F1 1-3 B1 3-7; s0 F2 1-2 B1 7-9;
// s1 F2 7-9 B2 9-13; s0 B2 13-15.
TEST(Schedule, UnequalStages) {
  auto r = Simulate1F1B({Times(1, 2), Times(2, 4)}, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->step, 15);
  EXPECT_DOUBLE_EQ(r->bubble, 3);  // 15 - 2 * 6
  // A link slower than the stages is the bottleneck: sends of 5 s
  // serialise (arrivals at 6 and 11), s1 F2 11-12 B2 12-14, s0 B2 14-16...
  auto slow = Simulate1F1B({Times(1, 1, 5, 0), Times(1, 1)}, 2);
  ASSERT_TRUE(slow.ok());
  // s0 F1 0-1 send 1-6; F2 1-2 send 6-11; s1 F1 6-7 B1 7-8; s0 B1 8-9;
  // s1 F2 11-12 B2 12-13; s0 B2 13-14.
  EXPECT_DOUBLE_EQ(slow->step, 14);
}

TEST(Schedule, Errors) {
  EXPECT_THAT(Simulate1F1B({}, 2).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least one stage")));
  EXPECT_THAT(Simulate1F1B({Times(1, 1)}, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("microbatch")));
  EXPECT_THAT(Simulate1F1B({Times(1, -1)}, 2).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stage 0")));
  EXPECT_EQ(InFlightMicrobatches(0, 4, 8), 4);
  EXPECT_EQ(InFlightMicrobatches(3, 4, 8), 1);
  EXPECT_EQ(InFlightMicrobatches(0, 4, 2), 2);
}

absl::StatusOr<graph::Graph> TinyGpt(int layers) {
  return graph::BuildZooModel("gpt", {{"layers", layers},
                                      {"hidden", 64},
                                      {"heads", 4},
                                      {"ffn", 128},
                                      {"seq", 8},
                                      {"vocab", 100},
                                      {"batch", 8}});
}

TEST(Layers, GptCutsAtTheResidualStream) {
  auto g = TinyGpt(3);
  ASSERT_TRUE(g.ok());
  Layers l = FindLayers(*g, 64);
  // Two residual adds per block, plus cuts around embedding and head.
  EXPECT_GE(l.size(), 7);
  ASSERT_EQ(l.boundary.size(), static_cast<size_t>(l.size() - 1));
  int residual = 0;
  for (graph::TensorId t : l.boundary) {
    if (g->tensor(t).type.shape == std::vector<int64_t>{8, 8, 64}) ++residual;
  }
  EXPECT_GE(residual, 6);
  EXPECT_EQ(l.begin.front(), 0);
  EXPECT_EQ(l.begin.back(), static_cast<int>(g->ops().size()));
  // At most max_layers, cut where one activation crosses.
  Layers few = FindLayers(*g, 3);
  EXPECT_EQ(few.size(), 3);
  std::vector<int> valid = ValidCuts(*g);
  for (size_t k = 1; k + 1 < few.begin.size(); ++k) {
    EXPECT_NE(std::find(valid.begin(), valid.end(), few.begin[k]), valid.end());
  }
}

// FindLayers(g, n) gives n layers wherever the graph has n - 1 valid cuts,
// also where the forward FLOPs are skewed: a chain of cheap layers, then
// two dear ones. Each cut was chosen nearest its equal-FLOP target without
// leaving cuts for the targets after it, so 4 layers came out as 3.
TEST(Layers, AsManyLayersAsAskedWhereTheCutsExist) {
  graph::GraphBuilder b("skewed");
  auto f32 = [](std::vector<int64_t> shape) {
    return graph::TensorType{graph::DType::kFloat32, std::move(shape)};
  };
  graph::TensorId x = b.Input("x", f32({8, 16}));
  graph::TensorId y =
      b.Input("labels", graph::TensorType{graph::DType::kInt64, {8}}, graph::InputRole::kLabels);
  const std::vector<int64_t> widths = {16, 16, 16, 16, 2048, 2048};
  int64_t in = 16;
  for (size_t i = 0; i < widths.size(); ++i) {
    const std::string n = "fc" + std::to_string(i);
    graph::TensorId w =
        b.Parameter(n + ".weight", f32({widths[i], in}), graph::Initializer::Ones());
    x = b.Add("relu", n + ".relu", {b.Add("linear", n, {x, w})});
    in = widths[i];
  }
  graph::TensorId head = b.Parameter("head.weight", f32({10, in}), graph::Initializer::Ones());
  b.SetLoss(b.Add("cross_entropy", "loss", {b.Add("linear", "head", {x, head}), y}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  const int cuts = static_cast<int>(ValidCuts(*g).size());
  ASSERT_GE(cuts, 8);
  for (int n = 1; n <= cuts + 1; ++n) {
    Layers l = FindLayers(*g, n);
    EXPECT_EQ(l.size(), n) << "max_layers " << n;
    for (int k = 0; k < l.size(); ++k) EXPECT_LT(l.begin[k], l.begin[k + 1]);
  }
}

TEST(Layers, Rebatch) {
  auto g = TinyGpt(2);
  ASSERT_TRUE(g.ok());
  auto m = Rebatch(*g, 2);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(GraphBatch(*m), 2);
  ASSERT_EQ(m->ops().size(), g->ops().size());
  EXPECT_NEAR(m->ForwardFlops() / g->ForwardFlops(), 0.25, 1e-9);
  EXPECT_THAT(Rebatch(*g, 3).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not divide")));
}

// A reshape of a parameter whose first entry happens to be a multiple of
// the batch (a [16, 8] weight seen as [8, 16] at a batch of 8) keeps its
// shape at a microbatch: only tensors computed from the inputs carry the
// batch. It was scaled to [4, 16] and the graph refused microbatches.
TEST(Layers, RebatchKeepsTheShapeOfAParametersReshape) {
  graph::GraphBuilder b("reshaped");
  auto f32 = [](std::vector<int64_t> shape) {
    return graph::TensorType{graph::DType::kFloat32, std::move(shape)};
  };
  graph::TensorId x = b.Input("x", f32({8, 16}));
  graph::TensorId y =
      b.Input("labels", graph::TensorType{graph::DType::kInt64, {8}}, graph::InputRole::kLabels);
  graph::TensorId w = b.Parameter("w", f32({16, 8}), graph::Initializer::Ones());
  graph::TensorId w2 =
      b.Add("reshape", "w_view", {w}, graph::Attrs{{"shape", std::vector<int64_t>{8, 16}}});
  x = b.Add("relu", "relu", {b.Add("linear", "fc", {x, w2})});
  graph::TensorId head = b.Parameter("head.weight", f32({10, 8}), graph::Initializer::Ones());
  b.SetLoss(b.Add("cross_entropy", "loss", {b.Add("linear", "head", {x, head}), y}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  auto m = Rebatch(*g, 4);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(GraphBatch(*m), 4);
  auto view = m->FindTensor("w_view");
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(m->tensor(*view).type.shape, (std::vector<int64_t>{8, 16}));

  // An expand of a parameter to the batch (ViT's class token) still scales.
  auto vit = graph::BuildZooModel("vit", {{"layers", 1}, {"batch", 8}});
  ASSERT_TRUE(vit.ok()) << vit.status();
  auto micro = Rebatch(*vit, 2);
  ASSERT_TRUE(micro.ok()) << micro.status();
  EXPECT_EQ(GraphBatch(*micro), 2);
}

// Grouped mixture-of-experts routing keeps its slots per group at a
// microbatch: the op's capacity (slots per group times groups) scales with
// the batch. It was kept, so each group had the whole batch's capacity.
// Routing all the batch's tokens as one group cannot be split.
TEST(Layers, RebatchScalesGroupedRoutingAndRefusesWholeBatchRouting) {
  std::map<std::string, double> p = {
      {"layers", 1}, {"hidden", 16}, {"heads", 4},   {"ffn", 24},      {"seq", 6},
      {"vocab", 37}, {"batch", 24},  {"experts", 4}, {"moe_every", 1}, {"moe_group_size", 6}};
  auto g = graph::BuildZooModel("moe", p);
  ASSERT_TRUE(g.ok()) << g.status();
  auto capacities = [](const graph::Graph& m) {
    std::vector<int64_t> c;
    for (const graph::Op& op : m.ops()) {
      if (op.attrs.Has("capacity")) c.push_back(*op.attrs.Int("capacity"));
    }
    return c;
  };
  const std::vector<int64_t> whole = capacities(*g);
  ASSERT_EQ(whole.size(), 2u);  // the route and the dispatch
  auto m = Rebatch(*g, 8);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int64_t> third;
  for (int64_t c : whole) third.push_back(c / 3);
  EXPECT_EQ(capacities(*m), third);

  p["moe_group_size"] = 0;
  auto one_group = graph::BuildZooModel("moe", p);
  ASSERT_TRUE(one_group.ok()) << one_group.status();
  EXPECT_THAT(Rebatch(*one_group, 8).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("routes all the batch's tokens as one group"),
                             HasSubstr("microbatches of 8"))));
  EXPECT_TRUE(Rebatch(*one_group, 24).ok());
}

// batch_norm's statistics are the whole batch's: a graph with one does not
// take microbatches (the executor's pipeline runner refuses such a stage
// too). The pipeline planner then keeps the SPMD plan with a note.
TEST(Layers, RebatchRefusesBatchNorm) {
  graph::GraphBuilder b("bn");
  auto f32 = [](std::vector<int64_t> shape) {
    return graph::TensorType{graph::DType::kFloat32, std::move(shape)};
  };
  graph::TensorId x = b.Input("x", f32({8, 4}));
  graph::TensorId y =
      b.Input("labels", graph::TensorType{graph::DType::kInt64, {8}}, graph::InputRole::kLabels);
  graph::TensorId w = b.Parameter("fc.weight", f32({4, 4}), graph::Initializer::Ones());
  graph::TensorId gamma = b.Parameter("bn.weight", f32({4}), graph::Initializer::Ones());
  graph::TensorId beta = b.Parameter("bn.bias", f32({4}), graph::Initializer::Zeros());
  x = b.Add("batch_norm", "bn", {b.Add("linear", "fc", {x, w}), gamma, beta});
  b.SetLoss(b.Add("cross_entropy", "loss", {x, y}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(Rebatch(*g, 4).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("op 'bn' (batch_norm) normalises with the statistics of the "
                                 "whole batch: microbatches of 4 would each take their own")));
  EXPECT_TRUE(Rebatch(*g, 8).ok());
}

cost::ClusterModel TwoNodes(double inter_bw) {
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 4; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / 2), "test",
                 i < 2 ? 3.86e12 : 2.15e12, 40 * kGiB, 1e-5});
  }
  return *cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, inter_bw, 5e-5);
}

absl::StatusOr<graph::Graph> SmallGpt() {
  return graph::BuildZooModel("gpt", {{"layers", 4},
                                      {"hidden", 256},
                                      {"heads", 4},
                                      {"ffn", 1024},
                                      {"seq", 64},
                                      {"vocab", 2000},
                                      {"batch", 32}});
}

// Two layers of hidden 64 at `batch` samples.
absl::StatusOr<graph::Graph> TwoLayerGpt(int batch) {
  return graph::BuildZooModel("gpt", {{"layers", 2},
                                      {"hidden", 64},
                                      {"heads", 4},
                                      {"ffn", 128},
                                      {"seq", 16},
                                      {"vocab", 200},
                                      {"batch", batch}});
}

PipelineOptions Fast(Mode mode, int stages = 0) {
  PipelineOptions o;
  o.mode = mode;
  o.stages = stages;
  o.max_microbatches = 8;
  o.max_layers = 8;
  o.threads = 2;
  o.stage_options.max_joint_iterations = 2;
  return o;
}

TEST(Subset, KeepsLinksAndOrder) {
  cost::ClusterModel c = TwoNodes(1e9);
  auto s = c.Subset({3, 1});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->device(0).id, "d3");
  EXPECT_DOUBLE_EQ(s->bandwidth(0, 1), 1e9);
  EXPECT_THAT(c.Subset({1, 1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeated")));
  auto one = c.Subset({2});  // a stage of one device
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->size(), 1);
  EXPECT_EQ(one->device(0).id, "d2");
  EXPECT_THAT(c.Subset({}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least one device")));
}

TEST(Planner, NoPipelineOverFastLinks) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  auto p = PlanPipeline(*g, TwoNodes(100e9), Fast(Mode::kAuto));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->pipelined());
  EXPECT_TRUE(p->has_spmd);
  EXPECT_DOUBLE_EQ(p->step_seconds, p->spmd.cost.total);
  EXPECT_GT(p->syntheses, 0);  // pipelines were priced and lost
  ASSERT_FALSE(p->notes.empty());
  EXPECT_THAT(p->notes.back(), HasSubstr("no pipeline is predicted faster than the SPMD plan"));
}

// The options' max_seconds bounds the whole search, not each synthesis:
// once it is spent no further stage is synthesized, and the answer is the
// SPMD plan with a note. Cancelled stops it.
TEST(Planner, TheTimeBudgetBoundsTheWholeSearch) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  PipelineOptions o = Fast(Mode::kAuto);
  o.stage_options.max_seconds = 1e-9;
  auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->pipelined());
  EXPECT_EQ(p->syntheses, 0);
  EXPECT_THAT(::testing::PrintToString(p->notes), HasSubstr("time budget"));

  o = Fast(Mode::kAuto);
  o.stage_options.cancelled = [] { return true; };
  EXPECT_THAT(PlanPipeline(*g, TwoNodes(1.25e9), o).status(),
              StatusIs(absl::StatusCode::kCancelled, ::testing::_));
}

// A budget of any finite size is a budget: 1e300 s converted to the
// clock's nanoseconds overflowed to a deadline in the past, and the search
// stopped at once with "the time budget ran out".
TEST(Planner, AHugeTimeBudgetIsNoBudgetNotOneSpent) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  PipelineOptions o = Fast(Mode::kAuto);
  o.stage_options.max_seconds = 1e300;
  auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->pipelined()) << ::testing::PrintToString(p->notes);
  EXPECT_GT(p->syntheses, 0);
  EXPECT_THAT(::testing::PrintToString(p->notes), ::testing::Not(HasSubstr("time budget")));
}

TEST(Planner, PipelineOverSlowLinks) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  cost::ClusterModel c = TwoNodes(1.25e9);
  auto p = PlanPipeline(*g, c, Fast(Mode::kAuto));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->pipelined()) << ::testing::PrintToString(p->notes);
  ASSERT_EQ(p->stages.size(), 2u);
  EXPECT_LT(p->step_seconds, p->spmd_step_seconds);
  // Stages cover the ops in order, on disjoint node groups.
  EXPECT_EQ(p->stages[0].begin_op, 0);
  EXPECT_EQ(p->stages[0].end_op, p->stages[1].begin_op);
  EXPECT_EQ(p->stages[1].end_op, static_cast<int>(g->ops().size()));
  std::set<int> devices;
  std::vector<StageTimes> times;
  for (const StagePlan& s : p->stages) {
    EXPECT_EQ(s.program.steps.size(), static_cast<size_t>(s.end_op - s.begin_op));
    EXPECT_NEAR(std::accumulate(s.ratios.begin(), s.ratios.end(), 0.0), 1, 1e-6);
    EXPECT_EQ(s.ratios.size(), s.devices.size());
    devices.insert(s.devices.begin(), s.devices.end());
    times.push_back(s.times);
  }
  EXPECT_EQ(devices.size(), 4u);
  EXPECT_EQ(p->stages[0].in_flight, 2);
  EXPECT_EQ(p->stages[1].in_flight, 1);
  EXPECT_GE(p->stages[0].output_tensor, 0);
  EXPECT_EQ(p->stages[0].output_tensor, p->stages[1].input_tensor);
  // The reported step is the schedule's at the stages' own times.
  auto sim = Simulate1F1B(times, p->microbatches);
  ASSERT_TRUE(sim.ok());
  EXPECT_DOUBLE_EQ(sim->step, p->step_seconds);
  EXPECT_EQ(p->microbatch_size * p->microbatches, 32);

  // As a plan: stages with their programs, and every device's stage
  // program for the executors.
  hap::v1::Cluster profile;
  hap::v1::PlanOptions po;
  po.set_pipeline(hap::v1::PlanOptions::PIPELINE_AUTO);
  auto plan = BuildPipelinePlan(*g, profile, c, *p, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->pipeline().stages_size(), 2);
  EXPECT_EQ(plan->pipeline().microbatches(), p->microbatches);
  EXPECT_EQ(plan->global_batch(), 32);
  ASSERT_EQ(plan->rank_programs_size(), c.size());
  const hap::v1::PipelineStage& s1 = plan->pipeline().stages(1);
  EXPECT_EQ(s1.devices_size(), static_cast<int>(p->stages[1].devices.size()));
  EXPECT_EQ(s1.input_tensor(), plan->pipeline().stages(0).output_tensor());
  EXPECT_FALSE(s1.input_tensor().empty());
  EXPECT_GE(s1.program().instructions_size(), s1.end_op() - s1.begin_op());
  EXPECT_DOUBLE_EQ(plan->prediction().step_seconds(), p->step_seconds);
  for (int r = 0; r < c.size(); ++r) {
    EXPECT_TRUE(lower::CheckPlanForRank(*plan, r, c.size()).ok())
        << lower::CheckPlanForRank(*plan, r, c.size());
  }
  // Stage 1's first device runs rank 0 of stage 1's group, which receives
  // the stage input.
  int first1 = -1;
  for (int r = 0; r < plan->devices_size(); ++r) {
    if (plan->devices(r) == s1.devices(0)) first1 = r;
  }
  ASSERT_GE(first1, 0);
  EXPECT_EQ(plan->rank_programs(first1).rank(), 0);
  EXPECT_EQ(plan->rank_programs(first1).world_size(), s1.devices_size());
  bool has_input = false;
  for (const auto& b : plan->rank_programs(first1).buffers()) {
    has_input = has_input || b.role() == hap::v1::Buffer::STAGE_INPUT;
  }
  EXPECT_TRUE(has_input);
  EXPECT_THAT(lower::CheckPlanForRank(*plan, 0, c.size() + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world of")));

  // The stage programs hold the microbatch split they were lowered for,
  // which the content hash does not cover: a count edited in the plan is
  // refused (it scaled every gradient), by the split of the batch and, in
  // the last stage, by the loss's seed.
  int last = -1;  // a rank of the last stage (it seeds the loss)
  for (int r = 0; r < plan->devices_size(); ++r) {
    if (plan->devices(r) == s1.devices(0)) last = r;
  }
  hap::v1::Plan edited = *plan;
  edited.mutable_pipeline()->set_microbatches(p->microbatches * 2);
  edited.mutable_pipeline()->set_microbatch_size(p->microbatch_size / 2);
  ASSERT_EQ(edited.pipeline().microbatch_size() * edited.pipeline().microbatches(), 32);
  EXPECT_THAT(lower::CheckPlanForRank(edited, last, c.size()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("lowered for ", p->microbatches, " microbatches"))));
  edited.mutable_pipeline()->set_microbatch_size(p->microbatch_size);
  EXPECT_THAT(
      lower::CheckPlanForRank(edited, 0, c.size()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("are not its global batch of 32")));
}

// Overlap (PlanOptions::overlap_communication): a stage's gradient sync
// runs behind its last microbatch's backward, so what it adds after that
// backward shrinks, never below nothing, and the step cannot grow (the same
// stages, programs and microbatches: two layers, one cut, data parallelism
// inside each node); the plan assumes overlap and its stage programs start
// their gradient buckets during backward.
TEST(Planner, OverlapHidesStageSyncBehindTheLastBackward) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  cost::ClusterModel c = TwoNodes(1.25e9);
  PipelineOptions o = Fast(Mode::kStages, 2);
  o.microbatches = 4;
  o.max_layers = 2;
  o.variant = Variant::kDataParallel;
  o.plan_spmd = false;
  auto off = PlanPipeline(*g, c, o);
  o.stage_options.overlap_communication = true;
  auto on = PlanPipeline(*g, c, o);
  ASSERT_TRUE(off.ok()) << off.status();
  ASSERT_TRUE(on.ok()) << on.status();
  ASSERT_EQ(off->stages.size(), 2u);
  ASSERT_EQ(on->stages.size(), 2u);
  EXPECT_FALSE(off->overlap);
  EXPECT_TRUE(on->overlap);
  double hidden = 0;
  for (int s = 0; s < 2; ++s) {
    ASSERT_EQ(on->stages[s].first_layer, off->stages[s].first_layer);
    EXPECT_GE(on->stages[s].times.sync, 0);
    EXPECT_LE(on->stages[s].times.sync, off->stages[s].times.sync + 1e-12) << "stage " << s;
    hidden += off->stages[s].times.sync - on->stages[s].times.sync;
  }
  EXPECT_GT(hidden, 0);
  EXPECT_LE(on->step_seconds, off->step_seconds);

  hap::v1::PlanOptions po;
  po.set_pipeline(hap::v1::PlanOptions::PIPELINE_STAGES);
  po.set_pipeline_stages(2);
  po.set_overlap_communication(true);
  auto plan = BuildPipelinePlan(*g, hap::v1::Cluster(), c, *on, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->prediction().overlap_assumed());
  int started = 0;
  for (const hap::v1::RankProgram& rp : plan->rank_programs()) {
    for (const hap::v1::Step& st : rp.steps()) {
      started += st.has_collective() && st.collective().async() &&
                 st.phase() == hap::v1::Step::GRADIENT_SYNC;
    }
  }
  EXPECT_GT(started, 0);
}

// Stages of one device each: four stages on two 2-device nodes split the
// nodes down to single devices, and three 1-device nodes over a slow link
// pipeline in auto mode. A one-device stage runs its layers' single-device
// program (ratio 1) and its rank program has a world of one.
TEST(Planner, OneDeviceStages) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  cost::ClusterModel c = TwoNodes(1.25e9);
  auto p = PlanPipeline(*g, c, Fast(Mode::kStages, 4));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->stages.size(), 4u);
  std::set<int> devices;
  for (const StagePlan& s : p->stages) {
    ASSERT_EQ(s.devices.size(), 1u);
    devices.insert(s.devices[0]);
    EXPECT_EQ(s.ratios, std::vector<double>{1.0});
    EXPECT_EQ(s.program.steps.size(), static_cast<size_t>(s.end_op - s.begin_op));
  }
  EXPECT_EQ(devices.size(), 4u);
  hap::v1::PlanOptions po;
  po.set_pipeline(hap::v1::PlanOptions::PIPELINE_STAGES);
  po.set_pipeline_stages(4);
  auto plan = BuildPipelinePlan(*g, hap::v1::Cluster(), c, *p, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int r = 0; r < c.size(); ++r) {
    EXPECT_THAT(lower::CheckPlanForRank(*plan, r, c.size()), ::hap::testing::IsOk());
    EXPECT_EQ(plan->rank_programs(r).world_size(), 1);
    EXPECT_EQ(plan->rank_programs(r).rank(), 0);
  }

  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 3; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i), "test",
                 i == 0 ? 4e11 : 2e11, 40 * kGiB, 1e-5});
  }
  auto three = cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 0.3e9, 5e-5);
  ASSERT_TRUE(three.ok()) << three.status();
  auto a = PlanPipeline(*g, *three, Fast(Mode::kAuto));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(a->pipelined()) << ::testing::PrintToString(a->notes);
  EXPECT_LT(a->step_seconds, a->spmd_step_seconds);
  int single = 0;
  for (const StagePlan& s : a->stages) single += s.devices.size() == 1;
  EXPECT_GE(single, 1);
}

// Nodes of unequal sizes (3 devices and 1): four stages are four single
// devices. The nodes were split into ceil(4 / 2) = 2 parts each, three
// units in all, and the stages refused ("cannot make 4 stages") though
// the cluster has four devices.
TEST(Planner, MoreStagesThanNodesSplitUnequalNodesFurther) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 4; ++i) {
    d.push_back({"d" + std::to_string(i), i < 3 ? "n0" : "n1", "test", 3.86e12, 40 * kGiB, 1e-5});
  }
  auto c = cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1.25e9, 5e-5);
  ASSERT_TRUE(c.ok()) << c.status();
  PipelineOptions o = Fast(Mode::kStages, 4);
  o.plan_spmd = false;
  auto p = PlanPipeline(*g, *c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->stages.size(), 4u);
  std::set<int> devices;
  for (const StagePlan& s : p->stages) {
    ASSERT_EQ(s.devices.size(), 1u);
    devices.insert(s.devices[0]);
  }
  EXPECT_EQ(devices.size(), 4u);
  // Five stages on four devices are refused.
  o.stages = 5;
  EXPECT_THAT(PlanPipeline(*g, *c, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot make 5 stages")));
}

// One microbatch (--microbatches 1): the runner keeps no gradient sums
// (they exist only to add microbatches up), so a stage's memory is its
// parameters, gradients and optimizer state and two copies of its
// activations (the one it runs and the one in flight), without the extra
// gradient copy the search counted for every microbatch count.
TEST(Planner, OneMicrobatchHoldsNoGradientSums) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  cost::ClusterModel c = TwoNodes(1.25e9);
  PipelineOptions o = Fast(Mode::kStages, 2);
  o.microbatches = 1;
  o.variant = Variant::kEvenSplit;  // the stages' memory as the search priced it
  o.plan_spmd = false;
  auto p = PlanPipeline(*g, c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->pipelined());
  ASSERT_EQ(p->microbatches, 1);
  for (const StagePlan& s : p->stages) {
    auto group = c.Subset(s.devices);
    ASSERT_TRUE(group.ok()) << group.status();
    synth::Program outputs = s.program;
    for (synth::OpStep& st : outputs.steps) st.loads.clear();
    const std::vector<int64_t> held = synth::MemoryAt(
        synth::MemoryModel(*p->microbatch_graph, *group, s.program, o.stage_options.optimizer),
        s.ratios);
    const std::vector<int64_t> act = synth::MemoryAt(
        synth::MemoryModel(*p->microbatch_graph, *group, outputs, o.stage_options.optimizer),
        s.ratios);
    ASSERT_EQ(s.in_flight, 1);
    for (size_t d = 0; d < s.devices.size(); ++d) {
      EXPECT_NEAR(static_cast<double>(s.memory_bytes[d]), static_cast<double>(held[d] + act[d]),
                  16.0)
          << "stage of layers " << s.first_layer << "-" << s.end_layer << ", device " << d;
    }
  }
}

// A time budget spent before any stage was synthesized is not "no pipeline
// fits": the asked stage count answers DeadlineExceeded naming the budget.
TEST(Planner, ASpentBudgetIsNotAPipelineThatDoesNotFit) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  PipelineOptions o = Fast(Mode::kStages, 2);
  o.plan_spmd = false;
  o.stage_options.max_seconds = 1e-9;
  auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                   AllOf(HasSubstr("time budget"), HasSubstr("2-stage"),
                                         ::testing::Not(HasSubstr("fits")))));
}

// The stage search (its DPs over stages, layers and groups, which grow as
// L^2 U^2 per bottleneck candidate) polls the time budget too: a clock
// that passes the deadline once every stage is synthesized stops it, and
// no pipeline priced by then is no pipeline that does not fit; so does a
// cancellation. The clock moves 100 s a reading: the start, one per
// synthesis, then the search's.
TEST(Planner, TheStageSearchStopsAtTheDeadline) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  for (Mode mode : {Mode::kStages, Mode::kAuto}) {
    PipelineOptions o = Fast(mode, mode == Mode::kStages ? 2 : 0);
    o.threads = 1;
    auto full = PlanPipeline(*g, TwoNodes(1.25e9), o);
    ASSERT_TRUE(full.ok()) << full.status();
    ASSERT_TRUE(full->pipelined());
    const int syntheses = full->syntheses;
    ASSERT_GT(syntheses, 0);
    auto readings = std::make_shared<std::atomic<int>>(0);
    const auto t0 = std::chrono::steady_clock::now();
    o.now = [readings, t0] { return t0 + std::chrono::seconds(100) * (*readings)++; };
    o.stage_options.max_seconds = 100.0 * syntheses + 50;
    auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
    if (mode == Mode::kStages) {
      EXPECT_THAT(p.status(),
                  StatusIs(absl::StatusCode::kDeadlineExceeded,
                           HasSubstr("ran out before any 2-stage pipeline was priced")));
    } else {
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_FALSE(p->pipelined());
      EXPECT_EQ(p->syntheses, syntheses);
      EXPECT_THAT(::testing::PrintToString(p->notes),
                  HasSubstr("ran out before a pipeline was priced; the plan is the SPMD plan"));
    }
    // A cancellation that comes once the stages are synthesized (the clock
    // read past them) is honoured as well.
    readings->store(0);
    o.stage_options.max_seconds = 1e300;
    o.stage_options.cancelled = [readings, syntheses] { return *readings > syntheses + 1; };
    EXPECT_THAT(PlanPipeline(*g, TwoNodes(1.25e9), o).status(),
                StatusIs(absl::StatusCode::kCancelled, HasSubstr("pipeline search was cancelled")));
  }
}

// A graph with an input that fixes the batch (a frozen projection fed as
// an input, 48 x 64 at a batch of 32) does not take microbatches: auto
// keeps the SPMD plan with a note (the Rebatch error failed the whole
// planning, the SPMD plan included), and STAGES N answers why.
TEST(Planner, AGraphWithoutMicrobatchesKeepsTheSpmdPlan) {
  graph::GraphBuilder b("fixed");
  auto f32 = [](std::vector<int64_t> shape) {
    return graph::TensorType{graph::DType::kFloat32, std::move(shape)};
  };
  graph::TensorId x = b.Input("x", f32({32, 64}));
  graph::TensorId y =
      b.Input("labels", graph::TensorType{graph::DType::kInt64, {32}}, graph::InputRole::kLabels);
  graph::TensorId proj = b.Input("proj", f32({48, 64}));
  x = b.Add("linear", "project", {x, proj});
  int64_t width = 48;
  for (int i = 0; i < 3; ++i) {
    const std::string n = "fc" + std::to_string(i);
    graph::TensorId w = b.Parameter(n + ".weight", f32({256, width}), graph::Initializer::Ones());
    x = b.Add("relu", n + ".relu", {b.Add("linear", n, {x, w})});
    width = 256;
  }
  graph::TensorId head = b.Parameter("head.weight", f32({10, width}), graph::Initializer::Ones());
  b.SetLoss(b.Add("cross_entropy", "loss", {b.Add("linear", "head", {x, head}), y}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  auto p = PlanPipeline(*g, TwoNodes(1.25e9), Fast(Mode::kAuto));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->pipelined());
  EXPECT_TRUE(p->has_spmd);
  EXPECT_THAT(::testing::PrintToString(p->notes),
              AllOf(HasSubstr("no pipeline: "), HasSubstr("'proj'")));
  EXPECT_THAT(PlanPipeline(*g, TwoNodes(1.25e9), Fast(Mode::kStages, 2)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'proj'"), HasSubstr("not a multiple of the batch"))));
}

// STAGES N above max_layers (8 here) cuts the model into N layers where it
// has the cuts: 9 stages of the 4-block GPT on 10 devices. The layers were
// capped at max_layers and the stages refused ("the model has 8 layers").
TEST(Planner, MoreStagesThanMaxLayersCutMoreLayers) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  ASSERT_GE(ValidCuts(*g).size(), 8u);
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 10; ++i) {
    d.push_back(
        {"d" + std::to_string(i), "n" + std::to_string(i / 2), "test", 3.86e12, 40 * kGiB, 1e-5});
  }
  auto c = cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1.25e9, 5e-5);
  ASSERT_TRUE(c.ok()) << c.status();
  PipelineOptions o = Fast(Mode::kStages, 9);
  o.variant = Variant::kEvenSplit;
  o.microbatches = 16;
  o.plan_spmd = false;
  auto p = PlanPipeline(*g, *c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stages.size(), 9u);
  EXPECT_EQ(p->layers, 9);
}

// STAGES N on an odd batch (9 samples) pipelines it in 3 microbatches of
// 3 samples (9 of 1 are smaller than the 2-device groups): when counts
// were powers of two it found none and answered no pipeline at all, OK and
// silent (the SPMD plan, or nothing without it).
TEST(Planner, AnOddBatchIsPipelinedInItsDivisors) {
  auto g = TwoLayerGpt(9);
  ASSERT_TRUE(g.ok()) << g.status();
  PipelineOptions o = Fast(Mode::kStages, 2);
  o.plan_spmd = false;
  auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->pipelined()) << ::testing::PrintToString(p->notes);
  EXPECT_EQ(p->microbatches, 3);
  EXPECT_EQ(p->microbatch_size, 3);
  // Both divisors were priced: 3 (taken) and 9 (microbatches of one sample,
  // too small for the 2-device groups, so no synthesis ran for them), and
  // on one-device stages 9 microbatches are priced too.
  o = Fast(Mode::kStages, 4);
  o.plan_spmd = false;
  o.max_microbatches = 16;
  auto four = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(four.ok()) << four.status();
  ASSERT_TRUE(four->pipelined());
  o.microbatches = 3;
  auto three = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_GT(four->syntheses, three->syntheses);
  EXPECT_LE(four->step_seconds, three->step_seconds);
}

// A batch of 20 is priced at 2, 4, 5 and 10 microbatches (one divisor per
// octave up to 16): powers of two alone priced only 2 and 4. Auto's answer
// is at least as fast as each count forced, and ran each one's syntheses.
TEST(Planner, AnEvenBatchIsPricedAtOneDivisorPerOctave) {
  auto g = TwoLayerGpt(20);
  ASSERT_TRUE(g.ok()) << g.status();
  PipelineOptions o = Fast(Mode::kStages, 4);
  o.plan_spmd = false;
  o.max_microbatches = 16;
  auto chosen = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  ASSERT_TRUE(chosen->pipelined()) << ::testing::PrintToString(chosen->notes);
  int syntheses = 0;
  for (int m : {2, 4, 5, 10}) {
    o.microbatches = m;
    auto forced = PlanPipeline(*g, TwoNodes(1.25e9), o);
    ASSERT_TRUE(forced.ok()) << m << ": " << forced.status();
    ASSERT_TRUE(forced->pipelined()) << m;
    EXPECT_EQ(forced->microbatches, m);
    EXPECT_LE(chosen->step_seconds, forced->step_seconds) << m;
    syntheses += forced->syntheses;
  }
  EXPECT_EQ(chosen->syntheses, syntheses);
}

// The even-split baseline in auto mode on fewer layers (2) than nodes (3)
// runs one layer a stage over equal runs of the nodes: it wanted one stage
// per node, found none, and noted "no pipeline fits".
TEST(Planner, EvenSplitOnFewerLayersThanNodes) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 3; ++i) {
    d.push_back(
        {"d" + std::to_string(i), "n" + std::to_string(i), "test", 3.86e12, 40 * kGiB, 1e-5});
  }
  auto c = cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1.25e9, 5e-5);
  ASSERT_TRUE(c.ok()) << c.status();
  PipelineOptions o = Fast(Mode::kAuto);
  o.variant = Variant::kEvenSplit;
  o.max_layers = 2;
  o.plan_spmd = false;
  auto p = PlanPipeline(*g, *c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->pipelined()) << ::testing::PrintToString(p->notes);
  ASSERT_EQ(p->stages.size(), 2u);
  EXPECT_EQ(p->stages[0].end_layer, 1);
  EXPECT_EQ(p->stages[0].devices.size() + p->stages[1].devices.size(), 3u);
}

// Microbatches asked for a one-stage plan (STAGES 1, or no pipeline) are
// not used, and a note says so rather than dropping them silently.
TEST(Planner, MicrobatchesOfAOneStagePlanAreNotedUnused) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  for (Mode mode : {Mode::kStages, Mode::kOff}) {
    PipelineOptions o = Fast(mode, 1);
    o.microbatches = 4;
    auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_FALSE(p->pipelined());
    EXPECT_EQ(p->microbatch_size, 32);
    EXPECT_THAT(::testing::PrintToString(p->notes), HasSubstr("microbatches 4 are not used"));
  }
}

// A budget that cuts the stages' syntheses short (here the state budget)
// leaves them the best programs found, and the plan says so as the SPMD
// plan does: the syntheses' notes were dropped.
TEST(Planner, StageSynthesesCutShortAreNoted) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  PipelineOptions o = Fast(Mode::kStages, 2);
  o.plan_spmd = false;
  o.stage_options.max_states = 20;
  auto p = PlanPipeline(*g, TwoNodes(1.25e9), o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->pipelined());
  EXPECT_THAT(::testing::PrintToString(p->notes),
              AllOf(HasSubstr("(synthesis): the state budget (20 states) cut a search"),
                    HasSubstr("stage")));
}

// Microbatches smaller than every group (8 samples in 8 microbatches of
// one, on nodes of two devices) are named as the reason no pipeline fits,
// not "memory or microbatches smaller than groups".
TEST(Planner, MicrobatchesSmallerThanEveryGroupAreNamed) {
  auto g = TinyGpt(2);
  ASSERT_TRUE(g.ok());
  PipelineOptions o = Fast(Mode::kStages, 2);
  o.microbatches = 8;
  o.plan_spmd = false;
  EXPECT_THAT(
      PlanPipeline(*g, TwoNodes(1.25e9), o).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("no 2-stage pipeline fits: microbatches of 1 sample are smaller "
                               "than every group of devices (the smallest has 2 devices"),
                     ::testing::Not(HasSubstr("memory")))));
}

TEST(PipelinePlan, OptionsFromProto) {
  hap::v1::PlanOptions po;
  EXPECT_EQ(FromProto(po)->mode, Mode::kOff);  // the default
  po.set_pipeline(hap::v1::PlanOptions::PIPELINE_STAGES);
  EXPECT_THAT(FromProto(po).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pipeline_stages")));
  po.set_pipeline_stages(3);
  po.set_pipeline_microbatches(8);
  auto o = FromProto(po);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->mode, Mode::kStages);
  EXPECT_EQ(o->stages, 3);
  EXPECT_EQ(o->microbatches, 8);
}

TEST(Planner, Baselines) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  cost::ClusterModel c = TwoNodes(1.25e9);
  PipelineOptions o = Fast(Mode::kStages, 2);
  auto hap = PlanPipeline(*g, c, o);
  o.variant = Variant::kDataParallel;
  auto metis = PlanPipeline(*g, c, o);
  o.variant = Variant::kEvenSplit;
  auto even = PlanPipeline(*g, c, o);
  ASSERT_TRUE(hap.ok()) << hap.status();
  ASSERT_TRUE(metis.ok()) << metis.status();
  ASSERT_TRUE(even.ok()) << even.status();
  ASSERT_EQ(even->stages.size(), 2u);
  EXPECT_EQ(even->stages[0].end_layer, even->layers / 2);
  EXPECT_NEAR(even->stages[0].ratios[0], 0.5,
              1e-12);  // data parallelism, equal split
  // The synthesized stages search a space holding the others' programs.
  EXPECT_LE(hap->step_seconds, metis->step_seconds * (1 + 1e-9));
  EXPECT_LE(metis->step_seconds, even->step_seconds * (1 + 1e-9));
}

// Where a data-parallel stage does not fit (each device holds its layers'
// parameters, gradients and optimizer state whole: about 131 MiB here, on
// 64 MiB devices), the synthesized stages shard them and the pipeline is
// planned; Metis-style DP x PP has none (bench/README: GPT-12 and ViT at
// hidden 4096 on 16 GiB devices).
TEST(Planner, StagesTooLargeForDataParallelismAreSharded) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 4; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / 2), "test",
                 i < 2 ? 3.86e12 : 2.15e12, int64_t{64} << 20, 1e-5});
  }
  const cost::ClusterModel c =
      *cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1.25e9, 5e-5);
  PipelineOptions o = Fast(Mode::kStages, 2);
  auto hap = PlanPipeline(*g, c, o);
  ASSERT_TRUE(hap.ok()) << hap.status();
  ASSERT_TRUE(hap->pipelined());
  for (const StagePlan& s : hap->stages) {
    for (size_t k = 0; k < s.devices.size(); ++k) {
      EXPECT_LE(s.memory_bytes[k], c.device(s.devices[k]).memory_bytes);
    }
  }
  o.variant = Variant::kDataParallel;
  EXPECT_THAT(PlanPipeline(*g, c, o).status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                        AllOf(HasSubstr("no 2-stage pipeline fits"),
                                                              HasSubstr("dp-prop does not fit"))));
}

// Stages on groups of unequal size, where a microbatch is smaller than the
// larger groups (8 samples, M = 4: 2 a microbatch, groups of 2 and of 4
// devices): the microbatch counts a group cannot take are left out for
// that group, in every variant (the even split priced the transfer into
// such a group and crashed).
TEST(Planner, MicrobatchesSmallerThanSomeGroups) {
  auto g = graph::BuildZooModel("gpt", {{"layers", 4},
                                        {"hidden", 128},
                                        {"heads", 4},
                                        {"ffn", 512},
                                        {"seq", 32},
                                        {"vocab", 1000},
                                        {"batch", 8}});
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < 8; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / 4), "test",
                 i < 4 ? 3.86e12 : 2.15e12, 40 * kGiB, 1e-5});
  }
  auto c = cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1.25e9, 5e-5);
  ASSERT_TRUE(c.ok()) << c.status();
  for (Variant v : {Variant::kSynthesized, Variant::kDataParallel, Variant::kEvenSplit}) {
    PipelineOptions o = Fast(Mode::kStages, 3);
    o.variant = v;
    auto p = PlanPipeline(*g, *c, o);
    ASSERT_TRUE(p.ok()) << VariantName(v) << ": " << p.status();
    ASSERT_EQ(p->stages.size(), 3u) << VariantName(v);
    EXPECT_TRUE(std::isfinite(p->step_seconds)) << VariantName(v);
    for (const StagePlan& s : p->stages) {
      EXPECT_GE(p->microbatch_size, static_cast<int64_t>(s.devices.size())) << VariantName(v);
    }
  }
}

TEST(Planner, BadOptions) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  EXPECT_THAT(PlanPipeline(*g, TwoNodes(1e9), Fast(Mode::kStages, 0)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 1 stage")));
  EXPECT_THAT(PlanPipeline(*g, TwoNodes(1e9), Fast(Mode::kStages, 40)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot make 40 stages")));
  PipelineOptions o = Fast(Mode::kAuto);
  o.microbatches = 5;
  EXPECT_THAT(PlanPipeline(*g, TwoNodes(1e9), o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must divide the batch")));
}

TEST(Executor, RefusesPipelinePlansWithoutPrograms) {
  hap::v1::Plan plan;
  plan.set_format_version(lower::kPlanFormatVersion);
  plan.mutable_pipeline()->add_stages();
  plan.mutable_pipeline()->add_stages();
  plan.mutable_pipeline()->set_microbatches(4);
  EXPECT_THAT(lower::CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the pipeline plan (2 stages) has no rank programs")));
}

// A stage's memory is what the pipeline runner holds (executor/train/
// pipeline.h): its parameters, gradients and optimizer state, the gradient
// sums over microbatches (M > 1), and the activations of the microbatch it
// runs plus a stashed copy for each microbatch in flight.
TEST(Planner, StageMemoryIsWhatThePipelineRunnerHolds) {
  auto g = SmallGpt();
  ASSERT_TRUE(g.ok());
  cost::ClusterModel c = TwoNodes(1.25e9);
  const PipelineOptions o = Fast(Mode::kAuto);
  auto p = PlanPipeline(*g, c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->pipelined());
  ASSERT_GT(p->microbatches, 1);
  for (const StagePlan& s : p->stages) {
    auto group = c.Subset(s.devices);
    ASSERT_TRUE(group.ok()) << group.status();
    synth::Program outputs = s.program;
    for (synth::OpStep& st : outputs.steps) st.loads.clear();
    const std::vector<int64_t> held = synth::MemoryAt(
        synth::MemoryModel(*p->microbatch_graph, *group, s.program, o.stage_options.optimizer,
                           /*extra_gradients=*/1),
        s.ratios);
    const std::vector<int64_t> act = synth::MemoryAt(
        synth::MemoryModel(*p->microbatch_graph, *group, outputs, o.stage_options.optimizer),
        s.ratios);
    ASSERT_EQ(s.memory_bytes.size(), s.devices.size());
    for (size_t d = 0; d < s.devices.size(); ++d) {
      ASSERT_GT(act[d], 0);
      EXPECT_NEAR(static_cast<double>(s.memory_bytes[d]),
                  static_cast<double>(held[d] + s.in_flight * act[d]), 16.0)
          << "stage of layers " << s.first_layer << "-" << s.end_layer << ", device " << d
          << ", in flight " << s.in_flight << ", activations " << act[d];
    }
  }
}

}  // namespace
}  // namespace hap::pipeline
