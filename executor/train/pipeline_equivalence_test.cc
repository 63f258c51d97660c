// Pipeline plans against the single-device program (issue 17 item 3): the
// model cut into 2 or 3 stages along planner/pipeline's layer cuts, each
// stage on a group of 1 or 2 ranks running its own synthesized program (a
// whole-model program for that group at the microbatch size, restricted to
// the stage's ops, as the pipeline planner makes them) at uneven ratios,
// 2 to 8 microbatches in 1F1B order, dropout on; ranks are threads over
// real Gloo. The losses and the parameters after 4 steps must be the
// single-device run's (tolerances as equivalence_test.cc). Also: the 1F1B
// order, microbatch slicing, and the stage programs' boundary buffers.
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/data/batches.h"
#include "executor/train/pipeline.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"
#include "planner/pipeline/layers.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using executor::TrainResult;

constexpr int kSteps = 4;
constexpr uint64_t kSeed = 4321;
constexpr int kBatch = 24;

graph::Graph Model(const std::string& name) {
  std::map<std::string, double> p;
  if (name == "mlp") {
    p = {{"layers", 4}, {"hidden", 24}, {"input", 12}, {"classes", 5}, {"batch", kBatch}};
  } else {
    p = {{"layers", 3}, {"hidden", 16}, {"heads", 4}, {"ffn", 24}, {"seq", 6},
         {"vocab", 37}, {"batch", kBatch}, {"dropout", 0.1}};
  }
  auto g = graph::BuildZooModel(name, p);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::string TempDir(const std::string& tag) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir =
      std::filesystem::path(tmp != nullptr ? tmp : std::filesystem::temp_directory_path()) /
      ("pipe_" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

struct Case {
  std::string model;
  std::vector<int> group_sizes;  // ranks per stage
  int microbatches;
  bool adam;
  std::string kind;  // the groups' programs (test_programs.h kinds)
  // Senders send contributions to the whole tensor instead of their pieces.
  bool whole = false;
  // Lowered with overlap: gradient buckets started in the last microbatch's
  // backward on a communication thread.
  bool overlap = false;
};

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  const Case& c = i.param;
  std::string groups;
  for (int n : c.group_sizes) groups += std::to_string(n);
  return absl::StrCat(c.model, "_", c.group_sizes.size(), "stages_", groups, "_mb",
                      c.microbatches, "_", c.kind, c.adam ? "_adam" : "_sgd",
                      c.whole ? "_whole" : "", c.overlap ? "_overlap" : "");
}

std::vector<double> Uneven(int n) {
  if (n == 1) return {1.0};
  std::vector<double> r;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += 1.0 + 0.7 * i;
  for (int i = 0; i < n; ++i) r.push_back((1.0 + 0.7 * i) / sum);
  return r;
}

struct Lowered {
  std::vector<v1::RankProgram> programs;  // per world rank
  executor::PipelineLayout layout;
  std::shared_ptr<graph::Graph> micro;
};

// Cuts the model into group_sizes.size() stages of about equal numbers of
// layers and lowers each stage for its group.
absl::StatusOr<Lowered> LowerPipeline(const graph::Graph& g, const Case& c) {
  Lowered out;
  const int S = static_cast<int>(c.group_sizes.size());
  auto micro = pipeline::Rebatch(g, kBatch / c.microbatches);
  if (!micro.ok()) return micro.status();
  out.micro = std::make_shared<graph::Graph>(*std::move(micro));
  const graph::Graph& m = *out.micro;
  pipeline::Layers layers = pipeline::FindLayers(m, 2 * S);
  if (layers.size() < S) {
    return absl::FailedPreconditionError(absl::StrCat("only ", layers.size(), " layers"));
  }
  out.layout.microbatches = c.microbatches;
  out.layout.clip = c.adam;  // the equivalence optimizers clip with Adam
  int rank = 0;
  for (int s = 0; s < S; ++s) {
    const int first_layer = s * layers.size() / S, end_layer = (s + 1) * layers.size() / S;
    lower::StageSpec spec;
    spec.begin_op = layers.begin[first_layer];
    spec.end_op = layers.begin[end_layer];
    spec.microbatches = c.microbatches;
    const int n = c.group_sizes[s];
    std::vector<double> ratios = Uneven(n);
    absl::StatusOr<synth::Program> whole = lower::SingleDeviceProgram(m);
    if (n > 1) whole = hap::testing::ProgramOfKind(m, n, c.kind, ratios);
    if (!whole.ok()) return whole.status();
    synth::Program sub;
    for (int k = spec.begin_op; k < spec.end_op; ++k) sub.steps.push_back(whole->steps[k]);
    auto form_of = [&](graph::TensorId t) {
      const graph::Tensor& x = m.tensor(t);
      return whole->steps[x.producer].rule.outputs[x.producer_output];
    };
    if (first_layer > 0) {
      spec.input = layers.boundary[first_layer - 1];
      spec.input_form = form_of(spec.input);
    }
    if (s + 1 < S) {
      spec.output = layers.boundary[end_layer - 1];
      spec.output_form = form_of(spec.output);
    }
    lower::LowerOptions lo;
    lo.world_size = n;
    lo.ratios = ratios;
    lo.optimizer = hap::testing::EquivalenceOptimizer(c.adam);
    lo.seed = kSeed;
    lo.overlap = c.overlap;
    lo.gradient_bucket_bytes = c.overlap ? 4096 : 0;  // several buckets per stage
    auto progs = lower::LowerStage(m, sub, spec, lo);
    if (!progs.ok()) return progs.status();
    std::vector<int> group;
    for (int r = 0; r < n; ++r) {
      group.push_back(rank++);
      out.programs.push_back((*progs)[r]);
    }
    out.layout.stage_ranks.push_back(group);
  }
  return out;
}

class PipelineEquivalenceTest : public ::testing::TestWithParam<Case> {};

std::map<std::string, std::vector<TrainResult>>& References() {
  static auto* m = new std::map<std::string, std::vector<TrainResult>>();
  return *m;
}

const TrainResult& Reference(const graph::Graph& g, const std::string& model, bool adam) {
  const std::string key = absl::StrCat(model, adam);
  if (!References().count(key)) {
    lower::LowerOptions lo;
    lo.optimizer = hap::testing::EquivalenceOptimizer(adam);
    lo.seed = kSeed;
    auto ref = hap::testing::RunLoweredOverGloo(g, lower::SingleDeviceProgram(g), lo, kSteps,
                                                "ref_" + key);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (!ref.ok()) return *new TrainResult();
    References()[key] = *std::move(ref);
  }
  return References()[key][0];
}

absl::StatusOr<std::vector<TrainResult>> RunPipeline(const graph::Graph& g, const Case& c,
                                                     const std::string& tag,
                                                     const executor::RunnerOptions& runner) {
  auto lowered = LowerPipeline(g, c);
  if (!lowered.ok()) return lowered.status();
  executor::TrainOptions to;
  to.steps = kSteps;
  executor::LocalRanksOptions lro;
  lro.rendezvous_dir = TempDir(tag);
  lro.prefix = tag;
  lro.pipeline_pieces = !c.whole;
  lro.runner = runner;
  return executor::RunLocalPipeline(lowered->programs, *lowered->micro, lowered->layout,
                                    [&](int) { return data::NewSyntheticBatches(g, kSeed); },
                                    to, lro);
}

TEST_P(PipelineEquivalenceTest, LossesAndParametersMatchSingleDevice) {
  const Case& c = GetParam();
  graph::Graph g = Model(c.model);
  const TrainResult& ref = Reference(g, c.model, c.adam);
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
  auto runs = RunPipeline(g, c, Name({c, 0}), {});
  ASSERT_TRUE(runs.ok()) << runs.status();

  for (size_t r = 0; r < runs->size(); ++r) {
    ASSERT_EQ((*runs)[r].losses.size(), ref.losses.size());
    for (int s = 0; s < kSteps; ++s) {
      const double want = ref.losses[s], got = (*runs)[r].losses[s];
      EXPECT_NEAR(got, want, 2e-5 * std::abs(want) + 2e-6) << "rank " << r << " step " << s;
    }
  }
  EXPECT_GT(std::abs(ref.losses.front() - ref.losses.back()), 1e-4);

  auto deviations = hap::testing::CompareRunsWithReference(*runs, ref);
  ASSERT_TRUE(deviations.ok()) << deviations.status();
  for (const auto& d : *deviations) {
    const double tol = 1e-4 * d.scale +
                       (c.adam ? 1e-3 * hap::testing::kEquivalenceAdamLr * kSteps : 0.0);
    EXPECT_LE(d.worst, tol) << "parameter " << d.name << " element " << d.at << ": " << d.got
                            << " vs " << d.want;
  }
}

std::vector<Case> Cases() {
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

INSTANTIATE_TEST_SUITE_P(Plans, PipelineEquivalenceTest, ::testing::ValuesIn(Cases()), Name);

// The overlapped stage's waits are where they must be: with every
// collective held until its wait step, the pipeline still equals the
// single device; with the waits gone (held collectives then run after the
// optimizer) the unsummed gradients move the parameters elsewhere.
TEST(PipelineEquivalenceTest, OverlapWaitsAreNeeded) {
  Case c{"gpt", {2, 2}, 4, false, "dp", false, true};
  graph::Graph g = Model(c.model);
  const TrainResult& ref = Reference(g, c.model, c.adam);
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
  ASSERT_TRUE(off.ok()) << off.status();
  double worst = 0;
  for (const auto& d : *off) worst = std::max(worst, d.worst / std::max(d.scale, 1e-12));
  EXPECT_GT(worst, 1e-2);
}

// A wrong gradient scaling is caught: the same pipeline lowered with the
// loss seed of one microbatch (gradients M times too large) moves the
// parameters elsewhere.
TEST(PipelineEquivalenceTest, WrongMicrobatchScalingIsCaught) {
  graph::Graph g = Model("mlp");
  Case c{"mlp", {1, 1}, 4, false, "dp"};
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  Case wrong = c;
  wrong.microbatches = 4;
  // Re-lower with microbatches = 1 in the stage specs only.
  auto bad_layout = lowered->layout;
  std::vector<v1::RankProgram> bad = lowered->programs;
  for (auto& p : bad) {
    for (auto& s : *p.mutable_steps()) {
      if (s.has_kernel() && s.kernel().kernel() == "fill") {
        auto& a = *s.mutable_kernel()->mutable_attrs();
        if (a.count("value") && std::abs(a["value"].f() - 0.25) < 1e-12) a["value"].set_f(1.0);
      }
    }
  }
  lower::LowerOptions lo;
  lo.optimizer = hap::testing::EquivalenceOptimizer(false);
  lo.seed = kSeed;
  auto ref = hap::testing::RunLoweredOverGloo(g, lower::SingleDeviceProgram(g), lo, 2, "ref_w");
  ASSERT_TRUE(ref.ok()) << ref.status();
  executor::TrainOptions to;
  to.steps = 2;
  executor::LocalRanksOptions lro;
  lro.rendezvous_dir = TempDir("wrong_scale");
  lro.prefix = "wrong_scale";
  auto runs = executor::RunLocalPipeline(
      bad, *lowered->micro, bad_layout, [&](int) { return data::NewSyntheticBatches(g, kSeed); },
      to, lro);
  ASSERT_TRUE(runs.ok()) << runs.status();
  // Step 0's loss is before any update: still right; step 1's is not.
  EXPECT_NEAR((*runs)[0].losses[0], (*ref)[0].losses[0], 1e-5 * std::abs((*ref)[0].losses[0]));
  EXPECT_GT(std::abs((*runs)[0].losses[1] - (*ref)[0].losses[1]),
            1e-3 * std::abs((*ref)[0].losses[1]));
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
  graph::Graph g = Model("gpt");
  Case c{"gpt", {2, 1, 2}, 4, false, "tp"};
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
