// bf16 mixed precision (PlanOptions.precision BF16, README "Precision")
// through lowering and training on the CPU:
// - the lowering marks exactly the products (linear, matmul, conv2d and
//   their gradients) and keeps every buffer float32;
// - a plan on 2 and 3 ranks (data, tensor parallel, ZeRO; uneven ratios)
//   gives the losses and parameters of the single-device bf16 program,
//   within bf16's tolerance: distributed sums in other orders can land on
//   the other side of a bf16 rounding boundary, a relative step of 2^-8
//   (measured: losses within 5e-4 relative, parameters within 0.6% of
//   their tensor's scale);
// - the bf16 program is not the fp32 one, but close to it;
// - parameters are fp32 masters: updates far below bf16's resolution land;
// - gradients synchronised in bf16 (PlanOptions.gradient_precision BF16):
//   the lowering marks exactly the gradients' sums (the loss stays fp32),
//   and multi-rank plans still give the single-device program's losses and
//   parameters within bf16's tolerance, while differing from the same plan
//   with fp32 gradients (the bf16 wire is really used).
// PyTorch's autocast is the reference of tests/bf16_autocast_test.py.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using executor::TrainResult;

constexpr int kSteps = 5;
constexpr uint64_t kSeed = 99;

graph::Graph Model(const std::string& name, int ranks) {
  std::map<std::string, double> p;
  const int batch = 6 * ranks + 1;
  if (name == "mlp") {
    p = {{"layers", 3}, {"hidden", 32}, {"input", 16}, {"classes", 5}, {"batch", batch}};
  } else if (name == "gpt") {
    p = {{"layers", 2}, {"hidden", 32}, {"heads", 4}, {"ffn", 48}, {"seq", 6},
         {"vocab", 37}, {"batch", batch}, {"dropout", 0.1}};
  } else if (name == "vit") {
    p = {{"layers", 1}, {"hidden", 16}, {"heads", 4}, {"ffn", 24}, {"image", 8},
         {"patch", 4}, {"channels", 3}, {"classes", 5}, {"batch", batch}, {"dropout", 0.0}};
  } else if (name == "vgg") {
    p = {{"width", 4}, {"stages", 2}, {"convs_per_stage", 1}, {"image", 8}, {"channels", 3},
         {"classes", 5}, {"hidden", 16}, {"batch", batch}};
  }
  auto g = graph::BuildZooModel(name, p);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

lower::LowerOptions Options(int n, const std::vector<double>& ratios, bool bf16) {
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  // Plain SGD at a moderate rate: bf16's rounding noise (2^-9 relative per
  // product) is amplified by training less than with momentum 0.9, so the
  // tolerances below stay far below what a wrong shard or gradient gives.
  lo.optimizer.set_kind(v1::OptimizerConfig::SGD);
  lo.optimizer.set_learning_rate(0.05);
  lo.seed = kSeed;
  lo.bf16 = bf16;
  return lo;
}

// Ratios 1 : 1.6 : 2.2 ... normalised.
std::vector<double> Uneven(int n) {
  std::vector<double> ratios(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += ratios[i] = 1.0 + 0.6 * i;
  for (double& r : ratios) r /= sum;
  return ratios;
}

absl::StatusOr<std::vector<TrainResult>> Train(const graph::Graph& g, const synth::Program& p,
                                             const lower::LowerOptions& lo, int steps,
                                             const std::string& tag) {
  return hap::testing::RunLoweredOverGloo(g, p, lo, steps, tag);
}

TEST(Bf16LoweringTest, MarksTheProductsAndKeepsBuffersFloat32) {
  graph::Graph g = Model("gpt", 1);
  for (bool bf16 : {false, true}) {
    auto programs = lower::Lower(g, lower::SingleDeviceProgram(g), Options(1, {1.0}, bf16));
    ASSERT_TRUE(programs.ok()) << programs.status();
    std::map<std::string, int> marked, unmarked;
    for (const v1::Step& s : (*programs)[0].steps()) {
      if (!s.has_kernel()) continue;
      auto it = s.kernel().attrs().find("bf16");
      bool on = it != s.kernel().attrs().end() && it->second.b();
      (on ? marked : unmarked)[s.kernel().kernel()]++;
    }
    if (!bf16) {
      EXPECT_TRUE(marked.empty());
      continue;
    }
    for (const char* k : {"linear", "linear_grad", "matmul", "matmul_grad"}) {
      EXPECT_GT(marked[k], 0) << k;
      EXPECT_EQ(unmarked[k], 0) << k;
    }
    for (const auto& [k, n] : marked) {
      EXPECT_THAT(k, ::testing::AnyOf("linear", "linear_grad", "matmul", "matmul_grad"));
    }
    EXPECT_GT(unmarked["softmax"] + unmarked["layer_norm"] + unmarked["log_softmax"], 0);
    for (const v1::Buffer& b : (*programs)[0].buffers()) {
      if (b.role() == v1::Buffer::NORM) continue;
      EXPECT_TRUE(b.dtype() == v1::FLOAT32 || b.dtype() == v1::INT64 || b.dtype() == v1::INT32)
          << b.tensor() << " " << v1::DType_Name(b.dtype());
    }
  }
}

struct Case {
  std::string model;
  int ranks;
  std::string kind;
};

class Bf16EquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(Bf16EquivalenceTest, MultiRankMatchesSingleDeviceBf16) {
  const Case& c = GetParam();
  graph::Graph g = Model(c.model, c.ranks);
  const synth::Program single = lower::SingleDeviceProgram(g);
  const std::string tag = absl::StrCat(c.model, c.ranks, c.kind);
  auto ref = Train(g, single, Options(1, {1.0}, true), kSteps, "ref16_" + tag);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto ref32 = Train(g, single, Options(1, {1.0}, false), kSteps, "ref32_" + tag);
  ASSERT_TRUE(ref32.ok()) << ref32.status();
  const TrainResult& want = (*ref)[0];

  // bf16 is applied (the losses are not fp32's) and is close to fp32.
  double most = 0;
  for (int s = 0; s < kSteps; ++s) {
    double a = want.losses[s], b = (*ref32)[0].losses[s];
    most = std::max(most, std::abs(a - b));
    EXPECT_NEAR(a, b, 2e-2 * std::abs(b)) << "step " << s << ": bf16 vs fp32";
  }
  EXPECT_GT(most, 1e-6) << "the bf16 losses equal the fp32 ones";

  const std::vector<double> ratios = Uneven(c.ranks);
  auto program = hap::testing::ProgramOfKind(g, c.ranks, c.kind, ratios);
  ASSERT_TRUE(program.ok()) << program.status();
  auto runs = Train(g, *program, Options(c.ranks, ratios, true), kSteps, "run16_" + tag);
  ASSERT_TRUE(runs.ok()) << runs.status();
  for (int r = 0; r < c.ranks; ++r) {
    for (int s = 0; s < kSteps; ++s) {
      double w = want.losses[s], got = (*runs)[r].losses[s];
      EXPECT_NEAR(got, w, 2e-3 * std::abs(w) + 1e-4) << "rank " << r << " step " << s;
    }
  }
  auto dev = hap::testing::CompareRunsWithReference(*runs, want);
  ASSERT_TRUE(dev.ok()) << dev.status();
  for (const auto& d : *dev) {
    // Measured: at most 0.6% of the tensor's scale (gpt, tensor parallel);
    // a wrong shard or gradient form gives 10% or more.
    EXPECT_LE(d.worst, 1e-2 * d.scale) << d.name << " element " << d.at << ": " << d.got
                                       << " vs " << d.want;
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, Bf16EquivalenceTest,
                         ::testing::Values(Case{"mlp", 2, "dp"}, Case{"mlp", 3, "tp"},
                                           Case{"gpt", 2, "tp"}, Case{"gpt", 3, "zero"},
                                           Case{"vit", 2, "mix"}, Case{"vgg", 2, "dp"}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return absl::StrCat(i.param.model, "_", i.param.ranks, "ranks_",
                                               i.param.kind);
                         });

// Float32 masters: with a learning rate this small each SGD update is far
// below half a bf16 step of the parameter, so a bf16 master would keep the
// parameter as it was; the float32 master moves.
TEST(Bf16MasterWeightsTest, UpdatesBelowBf16ResolutionLand) {
  graph::Graph g = Model("mlp", 1);
  lower::LowerOptions lo = Options(1, {1.0}, true);
  lo.optimizer.set_learning_rate(1e-5);
  lo.optimizer.set_momentum(0);
  lo.optimizer.set_weight_decay(0);
  const synth::Program p = lower::SingleDeviceProgram(g);
  auto one = Train(g, p, lo, 1, "master1");
  auto two = Train(g, p, lo, 2, "master2");
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(two.ok()) << two.status();
  auto a = executor::AssembleParameters(std::vector<std::vector<executor::ParameterShard>>{(*one)[0].parameters});
  auto b = executor::AssembleParameters(std::vector<std::vector<executor::ParameterShard>>{(*two)[0].parameters});
  ASSERT_TRUE(a.ok() && b.ok());
  int64_t tiny_moves = 0, total = 0;
  for (const auto& [name, t] : *a) {
    const executor::HostTensor& u = b->at(name);
    ASSERT_EQ(t.dtype(), graph::DType::kFloat32) << name;
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      const float before = t.template as<float>()[i];
      const float after = u.as<float>()[i];
      // Half the bf16 spacing at `before` (8 significant bits).
      const double half_step = std::ldexp(1.0, std::ilogb(std::fabs(before)) - 8);
      tiny_moves += after != before && std::fabs(after - before) < half_step;
      ++total;
    }
  }
  EXPECT_GT(tiny_moves, total / 2) << tiny_moves << " of " << total
                                   << " elements moved by less than half a bf16 step";
}

// --- bf16 gradients (LowerOptions::bf16_gradients) ---------------------------

TEST(Bf16GradientsTest, LoweringMarksTheGradientSumsAndKeepsTheLossFp32) {
  graph::Graph g = Model("gpt", 3);
  std::vector<double> even(3, 1.0 / 3);
  for (const std::string kind : {"dp", "zero"}) {
    auto program = hap::testing::ProgramOfKind(g, 3, kind, even);
    ASSERT_TRUE(program.ok()) << program.status();
    for (bool bf16_gradients : {false, true}) {
      lower::LowerOptions lo = Options(3, even, false);
      lo.bf16_gradients = bf16_gradients;
      auto programs = lower::Lower(g, *program, lo);
      ASSERT_TRUE(programs.ok()) << programs.status();
      int wire_bf16 = 0, gradient_sums = 0, loss_sums_fp32 = 0;
      for (const v1::Step& s : (*programs)[0].steps()) {
        if (!s.has_collective()) continue;
        const v1::CollectiveCall& c = s.collective();
        const bool bf16 = c.wire_dtype() == v1::BFLOAT16;
        wire_bf16 += bf16;
        if (s.phase() == v1::Step::GRADIENT_SYNC &&
            (c.collective() == v1::ALL_REDUCE || c.collective() == v1::REDUCE_SCATTER)) {
          const bool loss_alone = c.coalesced_size() == 0 && c.collective() == v1::ALL_REDUCE &&
                                  (*programs)[0].buffers(c.input()).role() != v1::Buffer::GRADIENT;
          if (loss_alone) {
            loss_sums_fp32 += !bf16;
            EXPECT_FALSE(bf16) << "the loss is summed in bf16: " << c.tensor();
          } else {
            ++gradient_sums;
            EXPECT_EQ(bf16, bf16_gradients) << kind << ": " << c.tensor();
          }
        } else {
          EXPECT_FALSE(bf16) << kind << ": " << v1::Collective_Name(c.collective()) << " of "
                             << c.tensor() << " in phase " << v1::Step::Phase_Name(s.phase());
        }
      }
      EXPECT_GT(gradient_sums, 0) << kind;
      if (bf16_gradients) {
        EXPECT_GT(wire_bf16, 0) << kind;
        EXPECT_EQ(loss_sums_fp32, 1) << kind << ": the loss has a call of its own";
      } else {
        EXPECT_EQ(wire_bf16, 0) << kind;
      }
    }
  }
}

class Bf16GradientsEquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(Bf16GradientsEquivalenceTest, MatchesSingleDeviceAndDiffersFromFp32Gradients) {
  const Case& c = GetParam();
  graph::Graph g = Model(c.model, c.ranks);
  const std::string tag = absl::StrCat("g16_", c.model, c.ranks, c.kind);
  // fp32 compute: what differs from the single-device program is only the
  // gradients' bf16 synchronisation.
  auto ref = Train(g, lower::SingleDeviceProgram(g), Options(1, {1.0}, false), kSteps,
                   "ref_" + tag);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<double> ratios = Uneven(c.ranks);
  auto program = hap::testing::ProgramOfKind(g, c.ranks, c.kind, ratios);
  ASSERT_TRUE(program.ok()) << program.status();
  lower::LowerOptions lo = Options(c.ranks, ratios, false);
  lo.bf16_gradients = true;
  auto runs = Train(g, *program, lo, kSteps, "run_" + tag);
  ASSERT_TRUE(runs.ok()) << runs.status();
  auto fp32_runs = Train(g, *program, Options(c.ranks, ratios, false), kSteps, "fp32_" + tag);
  ASSERT_TRUE(fp32_runs.ok()) << fp32_runs.status();
  for (int r = 0; r < c.ranks; ++r) {
    for (int s = 0; s < kSteps; ++s) {
      const double w = (*ref)[0].losses[s], got = (*runs)[r].losses[s];
      EXPECT_NEAR(got, w, 2e-3 * std::abs(w) + 1e-4) << "rank " << r << " step " << s;
    }
  }
  auto dev = hap::testing::CompareRunsWithReference(*runs, (*ref)[0]);
  ASSERT_TRUE(dev.ok()) << dev.status();
  for (const auto& d : *dev) {
    EXPECT_LE(d.worst, 1e-2 * d.scale) << d.name << " element " << d.at << ": " << d.got
                                       << " vs " << d.want;
  }
  // The fp32-gradient run of the same plan agrees with the single device to
  // rounding; the bf16-gradient run is measurably further away.
  auto dev32 = hap::testing::CompareRunsWithReference(*fp32_runs, (*ref)[0]);
  ASSERT_TRUE(dev32.ok()) << dev32.status();
  double worst16 = 0, worst32 = 0;
  for (const auto& d : *dev) worst16 = std::max(worst16, d.worst / d.scale);
  for (const auto& d : *dev32) worst32 = std::max(worst32, d.worst / d.scale);
  EXPECT_GT(worst16, 10 * worst32 + 1e-7)
      << "bf16 gradients leave the parameters as fp32 gradients do (" << worst16 << " vs "
      << worst32 << ")";
}

INSTANTIATE_TEST_SUITE_P(Plans, Bf16GradientsEquivalenceTest,
                         ::testing::Values(Case{"mlp", 2, "dp"}, Case{"gpt", 3, "zero"},
                                           Case{"vit", 2, "mix"}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return absl::StrCat(i.param.model, "_", i.param.ranks, "ranks_",
                                               i.param.kind);
                         });

}  // namespace
}  // namespace hap
