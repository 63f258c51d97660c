// lstm trains on n ranks as on one device (issue 20 item 1, nn.LSTM): a
// small LSTM language model (embedding, an lstm layer, a reversed lstm layer
// on its output, a linear head over every step, cross-entropy) planned data
// parallel at uneven ratios (each rank runs its samples' whole sequences;
// the weights' gradients are summed between ranks), with ZeRO-3, and by the
// unrestricted search. Ranks are threads over real Gloo on 127.0.0.1; the
// reference is the single-device program. Losses and every parameter after
// 4 steps must match (tolerances of batch_norm_equivalence_test).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

using executor::TrainResult;

constexpr int kSteps = 4;
constexpr uint64_t kSeed = 91;

graph::Graph LstmLm(int64_t batch) {
  auto g = hap::testing::LstmLm(batch);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

absl::StatusOr<std::vector<TrainResult>> RunPlan(const graph::Graph& g, const synth::Program& p,
                                                 int n, const std::vector<double>& ratios,
                                                 const std::string& tag) {
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.optimizer = hap::testing::EquivalenceOptimizer(/*adam=*/true);
  lo.seed = kSeed;
  return hap::testing::RunLoweredOverGloo(g, p, lo, kSteps, "lstm_" + tag);
}

struct Case {
  int ranks;
  std::string kind;
  std::string lstm_rule;  // the rule both lstm ops must run ("" = any)
};

class LstmEquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(LstmEquivalenceTest, LossesAndParametersMatchSingleDevice) {
  const Case& c = GetParam();
  const graph::Graph g = LstmLm(3 * c.ranks + 2);
  auto ref =
      RunPlan(g, lower::SingleDeviceProgram(g), 1, {1.0}, absl::StrCat("ref", c.ranks, c.kind));
  ASSERT_TRUE(ref.ok()) << ref.status();

  // Uneven: rank i gets a share growing with i.
  std::vector<double> ratios;
  double sum = 0;
  for (int i = 0; i < c.ranks; ++i) sum += ratios.emplace_back(1.0 + 0.7 * i);
  for (double& r : ratios) r /= sum;
  auto program = hap::testing::ProgramOfKind(g, c.ranks, c.kind, ratios);
  ASSERT_TRUE(program.ok()) << program.status();
  std::vector<std::string> rules;
  for (const synth::OpStep& s : program->steps) {
    if (g.op(s.op).type == "lstm") rules.push_back(s.rule.name);
  }
  ASSERT_EQ(rules.size(), 2u);
  if (!c.lstm_rule.empty()) {
    for (const std::string& r : rules) ASSERT_EQ(r, c.lstm_rule);
  }
  auto runs = RunPlan(g, *program, c.ranks, ratios, absl::StrCat(c.ranks, c.kind));
  ASSERT_TRUE(runs.ok()) << runs.status();

  const TrainResult& want = (*ref)[0];
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ((*runs)[r].losses.size(), want.losses.size());
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR((*runs)[r].losses[s], want.losses[s], 2e-5 * std::abs(want.losses[s]) + 2e-6)
          << "rank " << r << " step " << s << " (lstm rules " << rules[0] << ", " << rules[1]
          << ")";
    }
  }
  EXPECT_GT(std::abs(want.losses.front() - want.losses.back()), 1e-4);

  auto deviations = hap::testing::CompareRunsWithReference(*runs, want);
  ASSERT_TRUE(deviations.ok()) << deviations.status();
  ASSERT_TRUE(std::any_of(deviations->begin(), deviations->end(),
                          [](const auto& d) { return d.name == "lstm.weight_hh_l1"; }));
  for (const auto& d : *deviations) {
    EXPECT_LE(d.worst, 1e-4 * d.scale)
        << "parameter " << d.name << " element " << d.at << ": " << d.got << " vs " << d.want;
  }
}

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  return absl::StrCat(i.param.ranks, "ranks_", i.param.kind);
}

INSTANTIATE_TEST_SUITE_P(Plans, LstmEquivalenceTest,
                         ::testing::Values(Case{2, "dp", "data(0)"}, Case{3, "dp", "data(0)"},
                                           Case{2, "zero", "data(0)"}, Case{3, "mix", ""}),
                         Name);

}  // namespace
}  // namespace hap
