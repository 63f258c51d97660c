// Pipeline plans against the single-device program (issue 17 item 3): the
// model cut into 2 or 3 stages along planner/pipeline's layer cuts, each
// stage on a group of 1 or 2 ranks running its own synthesized program (a
// whole-model program for that group at the microbatch size, restricted to
// the stage's ops, as the pipeline planner makes them) at uneven ratios,
// 2 to 8 microbatches in 1F1B order, dropout on; ranks are threads over
// real Gloo. The losses and the parameters after 4 steps must be the
// single-device run's (tolerances as equivalence_test.cc). Also: the 1F1B
// order, microbatch slicing, and the stage programs' boundary buffers.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "executor/data/batches.h"
#include "executor/train/pipeline.h"
#include "executor/train/pipeline_test_util.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using executor::TrainResult;
using hap::testing::BoundaryPieces;
using hap::testing::kPipelineSeed;
using hap::testing::PipelineCase;
using hap::testing::PipelineCaseName;

constexpr int kSteps = 4;

// The stage programs without boundary pieces: RunLocalPipeline adds them
// itself unless the case sends whole tensors, and that is what runs here.
absl::StatusOr<hap::testing::LoweredPipeline> LowerPipeline(const graph::Graph& g,
                                                            const PipelineCase& c) {
  return hap::testing::LowerPipeline(g, c, BoundaryPieces::kLeaveToRunLocalPipeline);
}

// Trains `programs` (of `lowered`, possibly altered) for `steps` steps with
// executor::RunLocalPipeline over Gloo.
absl::StatusOr<std::vector<TrainResult>> RunLowered(const graph::Graph& g, const PipelineCase& c,
                                                    const hap::testing::LoweredPipeline& lowered,
                                                    const std::vector<v1::RankProgram>& programs,
                                                    int steps, const std::string& tag,
                                                    const executor::RunnerOptions& runner) {
  executor::TrainOptions to;
  to.steps = steps;
  executor::LocalRanksOptions lro;
  lro.rendezvous_dir = hap::testing::PipelineTestDir(tag);
  lro.prefix = tag;
  lro.pipeline_pieces = !c.whole;
  lro.runner = runner;
  return executor::RunLocalPipeline(
      programs, *lowered.micro, lowered.layout,
      [&](int) { return data::NewSyntheticBatches(g, kPipelineSeed); }, to, lro);
}

absl::StatusOr<std::vector<TrainResult>> RunPipeline(const graph::Graph& g, const PipelineCase& c,
                                                     const std::string& tag,
                                                     const executor::RunnerOptions& runner) {
  auto lowered = LowerPipeline(g, c);
  if (!lowered.ok()) return lowered.status();
  return RunLowered(g, c, *lowered, lowered->programs, kSteps, tag, runner);
}

class PipelineEquivalenceTest : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(PipelineEquivalenceTest, LossesAndParametersMatchSingleDevice) {
  const PipelineCase& c = GetParam();
  graph::Graph g = hap::testing::PipelineTestModel(c.model);
  const TrainResult& ref = hap::testing::SingleDeviceReference(g, c.model, c.adam, kSteps);
  ASSERT_FALSE(ref.losses.empty());
  if (c.overlap) {
    // The stages' gradient buckets start during backward (dp and mix
    // groups of 2 replicate some parameters).
    auto lowered = LowerPipeline(g, c);
    ASSERT_TRUE(lowered.ok()) << lowered.status();
    int started = 0;
    for (const v1::RankProgram& p : lowered->programs) {
      for (const v1::Step& st : p.steps()) {
        started += st.has_collective() && st.collective().async() &&
                   st.phase() == v1::Step::GRADIENT_SYNC;
      }
    }
    if (c.kind == "dp" || c.kind == "mix") {
      EXPECT_GT(started, 0);
    }
  }
  auto runs = RunPipeline(g, c, PipelineCaseName(c), {});
  ASSERT_TRUE(runs.ok()) << runs.status();
  hap::testing::ExpectMatchesReference(*runs, ref, c.adam, kSteps);
  EXPECT_GT(std::abs(ref.losses.front() - ref.losses.back()), 1e-4);
}

std::vector<PipelineCase> Cases() {
  return {
      {"mlp", {1, 1}, 2, false, "dp"},
      {"mlp", {2, 1}, 4, true, "tp"},
      {"mlp", {1, 2, 2}, 8, false, "mix"},
      {"gpt", {1, 1}, 4, true, "dp"},
      {"gpt", {2, 2}, 2, false, "tp"},
      {"gpt", {1, 2, 1}, 6, true, "mix"},
      {"gpt", {2, 1, 2}, 8, false, "dp"},
      // ZeRO-3 and ZeRO-2 groups: gathered parameters, reduce-scattered
      // gradients summed over microbatches.
      {"gpt", {2, 2}, 4, true, "zero"},
      {"mlp", {1, 2}, 2, false, "zero2"},
      {"mlp", {2, 2, 1}, 4, true, "sfb"},
      {"gpt", {2, 2}, 2, false, "tp", true},
      {"mlp", {1, 2, 2}, 4, true, "mix", true},
      // Overlap: gradient buckets of the last microbatch's backward run
      // behind it on the communication thread.
      {"mlp", {2, 2}, 4, false, "dp", false, true},
      {"gpt", {2, 2}, 4, true, "dp", false, true},
      {"gpt", {1, 2, 2}, 6, true, "mix", false, true},
      {"gpt", {2, 2}, 4, true, "zero", false, true},
      {"mlp", {1, 2}, 2, false, "zero2", false, true},
      {"mlp", {2, 2, 1}, 4, true, "sfb", false, true},
      {"gpt", {2, 1}, 1, false, "tp", false, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Plans, PipelineEquivalenceTest, ::testing::ValuesIn(Cases()),
                         hap::testing::PipelineCaseTestName);

// The overlapped stage's waits are where they must be: with every
// collective held until its wait step, the pipeline still equals the
// single device; with the waits gone (held collectives then run after the
// optimizer) the unsummed gradients move the parameters elsewhere.
TEST(PipelineEquivalenceTest, OverlapWaitsAreNeeded) {
  PipelineCase c{"gpt", {2, 2}, 4, false, "dp", false, true};
  graph::Graph g = hap::testing::PipelineTestModel(c.model);
  const TrainResult& ref = hap::testing::SingleDeviceReference(g, c.model, c.adam, kSteps);
  ASSERT_FALSE(ref.losses.empty());
  executor::RunnerOptions held;
  held.test_hold_until_wait = true;
  auto ok = RunPipeline(g, c, "held_waits", held);
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto good = hap::testing::CompareRunsWithReference(*ok, ref);
  ASSERT_TRUE(good.ok()) << good.status();
  for (const auto& d : *good) EXPECT_LE(d.worst, 1e-4 * d.scale) << d.name;
  executor::RunnerOptions dropped = held;
  dropped.test_skip_waits = true;
  auto bad = RunPipeline(g, c, "dropped_waits", dropped);
  ASSERT_TRUE(bad.ok()) << bad.status();
  auto off = hap::testing::CompareRunsWithReference(*bad, ref);
  if (!off.ok()) {
    // Caught as replicas of a parameter that diverged.
    EXPECT_TRUE(absl::IsDataLoss(off.status())) << off.status();
    return;
  }
  double worst = 0;
  for (const auto& d : *off) worst = std::max(worst, d.worst / std::max(d.scale, 1e-12));
  EXPECT_GT(worst, 1e-2);
}

// A wrong gradient scaling is caught: the same pipeline lowered with the
// loss seed of one microbatch (gradients M times too large) moves the
// parameters elsewhere.
TEST(PipelineEquivalenceTest, WrongMicrobatchScalingIsCaught) {
  graph::Graph g = hap::testing::PipelineTestModel("mlp");
  PipelineCase c{"mlp", {1, 1}, 4, false, "dp"};
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  PipelineCase wrong = c;
  wrong.microbatches = 4;
  // Re-lower with microbatches = 1 in the stage specs only.
  std::vector<v1::RankProgram> bad = lowered->programs;
  for (auto& p : bad) {
    for (auto& s : *p.mutable_steps()) {
      if (s.has_kernel() && s.kernel().kernel() == "fill") {
        auto& a = *s.mutable_kernel()->mutable_attrs();
        if (a.count("value") && std::abs(a["value"].f() - 0.25) < 1e-12) a["value"].set_f(1.0);
      }
    }
  }
  const TrainResult& ref = hap::testing::SingleDeviceReference(g, "mlp", false, 2);
  ASSERT_EQ(ref.losses.size(), 2u);
  auto runs = RunLowered(g, c, *lowered, bad, 2, "wrong_scale", {});
  ASSERT_TRUE(runs.ok()) << runs.status();
  // Step 0's loss is before any update: still right; step 1's is not.
  EXPECT_NEAR((*runs)[0].losses[0], ref.losses[0], 1e-5 * std::abs(ref.losses[0]));
  EXPECT_GT(std::abs((*runs)[0].losses[1] - ref.losses[1]), 1e-3 * std::abs(ref.losses[1]));
}

TEST(PipelineScheduleTest, OneFOneBOrder) {
  // 3 stages, 4 microbatches: stage 0 warms up with 2 forwards.
  EXPECT_EQ(executor::OneFOneBOrder(0, 3, 4), (std::vector<int>{1, 2, 3, -1, 4, -2, -3, -4}));
  EXPECT_EQ(executor::OneFOneBOrder(1, 3, 4), (std::vector<int>{1, 2, -1, 3, -2, 4, -3, -4}));
  EXPECT_EQ(executor::OneFOneBOrder(2, 3, 4), (std::vector<int>{1, -1, 2, -2, 3, -3, 4, -4}));
  // Fewer microbatches than the warm-up: all forwards, then all backwards.
  EXPECT_EQ(executor::OneFOneBOrder(0, 4, 2), (std::vector<int>{1, 2, -1, -2}));
  // Every stage runs each microbatch's forward once, before its backward.
  for (int s = 0; s < 3; ++s) {
    std::vector<int> seen(9, 0);
    for (int op : executor::OneFOneBOrder(s, 3, 8)) {
      const int m = std::abs(op);
      if (op < 0) {
        EXPECT_EQ(seen[m], 1) << "stage " << s << " microbatch " << m;
      }
      seen[m] += 1;
    }
    for (int m = 1; m <= 8; ++m) EXPECT_EQ(seen[m], 2);
  }
}

TEST(PipelineScheduleTest, MicroBatchSlicesRows) {
  executor::Batch b;
  executor::HostTensor x(graph::DType::kFloat32, {6, 2});
  for (int i = 0; i < 12; ++i) x.as<float>()[i] = static_cast<float>(i);
  b.emplace("x", x);
  auto m1 = executor::MicroBatch(b, 1, 3);
  ASSERT_TRUE(m1.ok()) << m1.status();
  const executor::HostTensor& p = m1->at("x");
  ASSERT_EQ(p.shape(), (graph::Shape{2, 2}));
  EXPECT_EQ(p.as<float>()[0], 4.0f);
  EXPECT_EQ(p.as<float>()[3], 7.0f);
  EXPECT_FALSE(executor::MicroBatch(b, 0, 4).ok());
}

// Each stage's programs carry the boundary buffers its position needs, in
// matching shapes: what one stage sends is what the next receives.
TEST(PipelineLoweringTest, BoundaryBuffersMatch) {
  graph::Graph g = hap::testing::PipelineTestModel("gpt");
  PipelineCase c{"gpt", {2, 1, 2}, 4, false, "tp"};
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  const auto& L = *lowered;
  auto find = [](const v1::RankProgram& p, v1::Buffer::Role role) -> const v1::Buffer* {
    for (const v1::Buffer& b : p.buffers()) {
      if (b.role() == role) return &b;
    }
    return nullptr;
  };
  for (size_t s = 0; s < L.layout.stage_ranks.size(); ++s) {
    const bool first = s == 0, last = s + 1 == L.layout.stage_ranks.size();
    for (int r : L.layout.stage_ranks[s]) {
      const v1::RankProgram& p = L.programs[r];
      EXPECT_EQ(find(p, v1::Buffer::STAGE_INPUT) != nullptr, !first) << "rank " << r;
      EXPECT_EQ(find(p, v1::Buffer::STAGE_INPUT_GRADIENT) != nullptr, !first) << "rank " << r;
      EXPECT_EQ(find(p, v1::Buffer::STAGE_OUTPUT) != nullptr, !last) << "rank " << r;
      EXPECT_EQ(find(p, v1::Buffer::STAGE_OUTPUT_GRADIENT) != nullptr, !last) << "rank " << r;
      if (last) continue;
      const v1::Buffer* out = find(p, v1::Buffer::STAGE_OUTPUT);
      for (int q : L.layout.stage_ranks[s + 1]) {
        const v1::Buffer* in = find(L.programs[q], v1::Buffer::STAGE_INPUT);
        ASSERT_NE(in, nullptr);
        EXPECT_EQ(std::vector<int64_t>(out->global_shape().begin(), out->global_shape().end()),
                  std::vector<int64_t>(in->global_shape().begin(), in->global_shape().end()));
        EXPECT_EQ(out->dtype(), in->dtype());
      }
    }
  }
}

}  // namespace
}  // namespace hap
