// The central correctness test of the project (docs/design.md §7): a plan run on
// n ranks gives the losses and the updated parameters of the single-device
// program. Models: MLP, GPT-style LM, ViT, MoE and Switch (small
// configurations, the compact MoE form, plans split by experts too); the
// 1-rank run of the single-device program is the reference for 2, 3 and 4
// ranks; even and uneven ratios; plan kinds: data parallel, tensor parallel,
// the unrestricted search (a mix), ZeRO, SFB forced. Ranks are threads
// talking over real Gloo on 127.0.0.1.
//
// Tolerance (float32, 5 steps of SGD with momentum or AdamW with clipping):
// each loss within 2e-5 relative (plus 2e-6 absolute) of the reference, each
// parameter element within 1e-4 relative to its tensor's largest magnitude
// (with Adam, plus 1e-3 of the total step length lr * steps).
// The distributed runs sum in other orders (partial sums, collectives), so
// bitwise equality is not expected; a wrong shard, offset or gradient form
// gives errors of order 1e-2 or more.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "executor/data/batches.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using executor::TrainResult;

constexpr int kSteps = 5;
constexpr uint64_t kSeed = 1234;
constexpr double kAdamLr = hap::testing::kEquivalenceAdamLr;

graph::Graph Model(const std::string& name, int ranks) {
  auto g = hap::testing::EquivalenceModel(name, ranks);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::vector<double> Ratios(int n, bool uneven) {
  return hap::testing::EquivalenceRatios(n, uneven);
}

v1::OptimizerConfig Optimizer(bool adam) { return hap::testing::EquivalenceOptimizer(adam); }

// With overlap, gradient buckets this small: several per model, so
// buckets start at several points of backward.
constexpr int64_t kOverlapBucketBytes = 2048;

absl::StatusOr<std::vector<TrainResult>> RunPlan(const graph::Graph& g, const synth::Program& p,
                                                 int n, const std::vector<double>& ratios,
                                                 bool adam, const std::string& tag,
                                                 bool overlap = false,
                                                 const executor::RunnerOptions& runner = {}) {
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.optimizer = Optimizer(adam);
  lo.seed = kSeed;
  lo.overlap = overlap;
  lo.gradient_bucket_bytes = overlap ? kOverlapBucketBytes : 0;
  return hap::testing::RunLoweredOverGloo(g, p, lo, kSteps, tag, runner);
}

struct Case {
  std::string model;
  int ranks;
  std::string kind;
  bool uneven;
  bool adam;
  // Lowered with overlap: asynchronous collectives on a communication
  // thread with a second Gloo context.
  bool overlap = false;
};

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  const Case& c = i.param;
  return absl::StrCat(c.model, "_", c.ranks, "ranks_", c.kind, c.uneven ? "_uneven" : "_even",
                      c.adam ? "_adam" : "_sgd", c.overlap ? "_overlap" : "");
}

class EquivalenceTest : public ::testing::TestWithParam<Case> {};

// One reference per (model, ranks, optimizer): the single-device run.
std::map<std::string, std::vector<TrainResult>>& References() {
  static auto* m = new std::map<std::string, std::vector<TrainResult>>();
  return *m;
}

TEST_P(EquivalenceTest, LossesAndParametersMatchSingleDevice) {
  const Case& c = GetParam();
  graph::Graph g = Model(c.model, c.ranks);
  std::string ref_key = absl::StrCat(c.model, c.ranks, c.adam);
  if (!References().count(ref_key)) {
    auto ref = RunPlan(g, lower::SingleDeviceProgram(g), 1, {1.0}, c.adam,
                   absl::StrCat("ref_", ref_key));
    ASSERT_TRUE(ref.ok()) << ref.status();
    References()[ref_key] = *std::move(ref);
  }
  const TrainResult& ref = References()[ref_key][0];

  std::vector<double> ratios = Ratios(c.ranks, c.uneven);
  auto program = hap::testing::ProgramOfKind(g, c.ranks, c.kind, ratios);
  ASSERT_TRUE(program.ok()) << program.status();
  auto runs = RunPlan(g, *program, c.ranks, ratios, c.adam, Name({c, 0}), c.overlap);
  ASSERT_TRUE(runs.ok()) << runs.status();

  // Losses: every rank reports the single-device loss.
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ((*runs)[r].losses.size(), ref.losses.size());
    for (int s = 0; s < kSteps; ++s) {
      double want = ref.losses[s], got = (*runs)[r].losses[s];
      EXPECT_NEAR(got, want, 2e-5 * std::abs(want) + 2e-6)
          << "rank " << r << " step " << s;
    }
  }
  // The training must have moved: the first and last losses differ.
  EXPECT_GT(std::abs(ref.losses.front() - ref.losses.back()), 1e-4);

  // Parameters after the last update, assembled from every rank's pieces.
  auto deviations = hap::testing::CompareRunsWithReference(*runs, ref);
  ASSERT_TRUE(deviations.ok()) << deviations.status();
  for (const auto& d : *deviations) {
    // Adam normalises each step to about lr, so float noise on a tiny
    // gradient moves an element by up to a fraction of lr: allow 1e-3 of
    // the total step length lr * steps on top.
    double tol = 1e-4 * d.scale + (c.adam ? 1e-3 * kAdamLr * kSteps : 0.0);
    EXPECT_LE(d.worst, tol) << "parameter " << d.name << " element " << d.at << ": " << d.got
                            << " vs " << d.want;
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (std::string model : {"mlp", "gpt", "vit", "moe", "switch"}) {
    for (int n : {2, 3, 4}) {
      std::vector<std::string> kinds = {"dp", "tp", "mix", "zero", "zero2", "sfb"};
      // Experts split across ranks (the compact MoE form's expert offsets).
      if (model == "moe" || model == "switch") kinds.push_back("expert");
      // Switch (top-1) shares the MoE code: the plan kinds that differ.
      if (model == "switch") kinds = {"dp", "mix", "expert"};
      // Vocabulary-parallel cross-entropy (the classifier's and the LM's).
      if (model == "gpt" || model == "mlp") kinds.push_back("vocab");
      for (const std::string& kind : kinds) {
        for (bool uneven : {false, true}) {
          // Adam with clipping on half the cases, SGD with momentum on the rest.
          bool adam = (n + (kind == "tp") + uneven) % 2 == 0;
          for (bool overlap : {false, true}) out.push_back({model, n, kind, uneven, adam, overlap});
        }
      }
    }
  }
  // Grouped routing split by groups, the experts' FFN by experts: the
  // dispatched tokens travel by all-to-all.
  for (std::string model : {"moe_grouped", "switch_grouped"}) {
    for (int n : {2, 3, 4}) {
      for (bool uneven : {false, true}) {
        out.push_back({model, n, "groups", uneven, n % 2 == 0, uneven});
      }
    }
  }
  // Beyond 4 ranks: 8, at uneven ratios (18 experts over 8 ranks for the
  // MoE models).
  const std::pair<const char*, const char*> eight[] = {
      {"moe", "expert"}, {"moe", "mix"}, {"switch", "expert"}, {"gpt", "mix"}, {"mlp", "zero"}};
  for (const auto& [model, kind] : eight) {
    for (bool overlap : {false, true}) {
      out.push_back({model, 8, kind, true, std::string(kind) != "mix", overlap});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Plans, EquivalenceTest, ::testing::ValuesIn(Cases()), Name);

// The waits matter: every started collective held back until its wait
// (outputs poisoned with NaN at the start, in-place gradient buckets left
// unsummed) still gives the single-device run, and the same with the waits
// skipped does not. Data parallel (gradient buckets) and ZeRO-3 (prefetched
// gathers, reduce-scatters) on 3 ranks at uneven ratios.
class DroppedWaitTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DroppedWaitTest, HeldCollectivesMatchAndSkippedWaitsAreCaught) {
  const std::string kind = GetParam();
  const int n = 3;
  graph::Graph g = Model("mlp", n);
  auto ref = RunPlan(g, lower::SingleDeviceProgram(g), 1, {1.0}, false, "held_ref_" + kind);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto want = executor::AssembleParameters({(*ref)[0].parameters});
  ASSERT_TRUE(want.ok()) << want.status();
  std::vector<double> ratios = Ratios(n, true);
  auto program = hap::testing::ProgramOfKind(g, n, kind, ratios);
  ASSERT_TRUE(program.ok()) << program.status();

  // Replicas that diverged (AssembleParameters refuses them) are as far
  // off as a run can be.
  auto worst = [&](const std::vector<TrainResult>& runs) -> double {
    std::vector<std::vector<executor::ParameterShard>> pieces;
    for (const auto& run : runs) pieces.push_back(run.parameters);
    auto got = executor::AssembleParameters(pieces);
    if (absl::IsDataLoss(got.status())) {
      std::cout << got.status() << "\n";
      return std::numeric_limits<double>::infinity();
    }
    EXPECT_TRUE(got.ok()) << got.status();
    auto d = hap::testing::CompareParameters(*got, *want);
    EXPECT_TRUE(d.ok()) << d.status();
    double w = 0;
    for (const auto& x : *d) w = std::max(w, x.worst / x.scale);
    return w;
  };
  executor::RunnerOptions held;
  held.test_hold_until_wait = true;
  auto ok = RunPlan(g, *program, n, ratios, false, "held_" + kind, true, held);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_LE(worst(*ok), 1e-4);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR((*ok)[0].losses[s], (*ref)[0].losses[s], 2e-5 * std::abs((*ref)[0].losses[s]));
  }

  executor::RunnerOptions dropped = held;
  dropped.test_skip_waits = true;
  auto bad = RunPlan(g, *program, n, ratios, false, "dropped_" + kind, true, dropped);
  if (kind == "dp") {
    // Unsummed gradients reach the optimizer.
    ASSERT_TRUE(bad.ok()) << bad.status();
    EXPECT_GT(worst(*bad), 1e-2);
  } else {
    // Poisoned gathered parameters reach the forward: the loss is NaN.
    EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("the loss is nan"));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, DroppedWaitTest, ::testing::Values("dp", "zero"));

}  // namespace
}  // namespace hap
