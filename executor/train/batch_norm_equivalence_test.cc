// batch_norm and depthwise convolution train on n ranks as on one device
// (issue 20): a small CNN (conv2d, batch_norm with running statistics, relu,
// a depthwise conv2d with channel multiplier 2, drop_path, avg_pool2d, linear,
// cross-entropy) planned data parallel (the batch sharded at uneven
// ratios: each rank's statistics cover its own samples, so the per-channel
// sums must be all-reduced), tensor parallel (channels sharded), the
// unrestricted search, and ZeRO (running statistics stored sharded and
// updated through their gathered copy). Ranks are threads over real Gloo on
// 127.0.0.1; the reference is the single-device program. Losses and every
// parameter after 4 steps — running_mean and running_var included — must
// match (tolerances of equivalence_test).
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/data/batches.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

using executor::TrainResult;

constexpr int kSteps = 4;
constexpr uint64_t kSeed = 77;

graph::Graph BatchNormCnn(int64_t batch) {
  auto g = hap::testing::BatchNormCnn(batch);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

absl::StatusOr<std::vector<TrainResult>> RunPlan(const graph::Graph& g, const synth::Program& p,
                                                 int n, const std::vector<double>& ratios,
                                                 const std::string& tag, bool overlap = false) {
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.optimizer = hap::testing::EquivalenceOptimizer(/*adam=*/false);
  lo.seed = kSeed;
  // With overlap: started collectives on a communication thread, buckets
  // of 256 bytes (several per step).
  lo.overlap = overlap;
  lo.gradient_bucket_bytes = overlap ? 256 : 0;
  return hap::testing::RunLoweredOverGloo(g, p, lo, kSteps, "bn_" + tag);
}

struct Case {
  int ranks;
  std::string kind;
  std::string bn_rule;  // the rule batch_norm must run ("" = any)
  std::string dw_rule;  // the rule the depthwise conv2d must run ("" = any)
  bool overlap = false;  // lowered with overlap (issue 16)
};

class BatchNormEquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(BatchNormEquivalenceTest, LossesParametersAndRunningStatisticsMatchSingleDevice) {
  const Case& c = GetParam();
  const graph::Graph g = BatchNormCnn(4 * c.ranks + 3);
  auto ref = RunPlan(g, lower::SingleDeviceProgram(g), 1, {1.0}, absl::StrCat("ref", c.ranks, c.kind));
  ASSERT_TRUE(ref.ok()) << ref.status();

  // Uneven: rank i gets a share growing with i.
  std::vector<double> ratios;
  double sum = 0;
  for (int i = 0; i < c.ranks; ++i) sum += ratios.emplace_back(1.0 + 0.7 * i);
  for (double& r : ratios) r /= sum;
  auto program = hap::testing::ProgramOfKind(g, c.ranks, c.kind, ratios);
  ASSERT_TRUE(program.ok()) << program.status();
  std::string rule, dw_rule;
  for (const synth::OpStep& s : program->steps) {
    if (g.op(s.op).type == "batch_norm") rule = s.rule.name;
    if (g.op(s.op).name == "dw") dw_rule = s.rule.name;
  }
  if (!c.bn_rule.empty()) {
    ASSERT_EQ(rule, c.bn_rule);
  }
  if (!c.dw_rule.empty()) {
    ASSERT_EQ(dw_rule, c.dw_rule);
  }
  auto runs = RunPlan(g, *program, c.ranks, ratios,
                      absl::StrCat(c.ranks, c.kind, c.overlap ? "_overlap" : ""), c.overlap);
  ASSERT_TRUE(runs.ok()) << runs.status();

  const TrainResult& want = (*ref)[0];
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ((*runs)[r].losses.size(), want.losses.size());
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR((*runs)[r].losses[s], want.losses[s], 2e-5 * std::abs(want.losses[s]) + 2e-6)
          << "rank " << r << " step " << s << " (batch_norm rule " << rule << ")";
    }
  }
  EXPECT_GT(std::abs(want.losses.front() - want.losses.back()), 1e-4);

  std::vector<std::vector<executor::ParameterShard>> pieces;
  for (const auto& run : *runs) pieces.push_back(run.parameters);
  auto got = executor::AssembleParameters(pieces);
  ASSERT_TRUE(got.ok()) << got.status();
  auto ref_params = executor::AssembleParameters({want.parameters});
  ASSERT_TRUE(ref_params.ok()) << ref_params.status();
  // The running statistics moved away from their initial 0 and 1.
  ASSERT_TRUE(ref_params->count("bn.running_mean"));
  const executor::HostTensor& rm = ref_params->at("bn.running_mean");
  const executor::HostTensor& rv = ref_params->at("bn.running_var");
  EXPECT_GT(std::abs(rm.as<float>()[0]), 1e-3);
  EXPECT_GT(std::abs(rv.as<float>()[0] - 1.0f), 1e-3);
  auto deviations = hap::testing::CompareParameters(*got, *ref_params);
  ASSERT_TRUE(deviations.ok()) << deviations.status();
  for (const auto& d : *deviations) {
    EXPECT_LE(d.worst, 1e-4 * d.scale)
        << "parameter " << d.name << " element " << d.at << ": " << d.got << " vs "
        << d.want << " (batch_norm rule " << rule << ")";
  }
}

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  return absl::StrCat(i.param.ranks, "ranks_", i.param.kind, i.param.overlap ? "_overlap" : "");
}

std::vector<Case> Cases() {
  std::vector<Case> out = {Case{2, "dp", "data(0)", "data(0)"},
                           Case{3, "dp", "data(0)", "data(0)"},
                           Case{2, "tp", "channels", "groups"},
                           Case{3, "tp", "", "groups"},
                           Case{3, "mix", "", ""},
                           Case{2, "zero", "data(0)", ""},
                           Case{3, "zero2", "data(0)", ""}};
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) {
    out.push_back(out[i]);
    out.back().overlap = true;
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Plans, BatchNormEquivalenceTest, ::testing::ValuesIn(Cases()), Name);

}  // namespace
}  // namespace hap
