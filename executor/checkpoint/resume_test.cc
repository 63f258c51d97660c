// Resume equivalence (real Gloo between threads): train 6 steps on plan A,
// checkpoint, resume on plan B (another world size, other forms and
// ratios) to step 12; the losses and the final parameters equal 12
// uninterrupted single-device steps within the equivalence test's
// tolerances (executor/train/equivalence_test.cc).
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/data/batches.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
namespace ckpt = ::hap::executor::checkpoint;
using executor::TrainResult;

constexpr int kSteps = 12;
constexpr int kSplit = 6;
constexpr uint64_t kSeed = 99;
constexpr double kAdamLr = hap::testing::kEquivalenceAdamLr;

graph::Graph Model(const std::string& name) {
  std::map<std::string, double> p;
  if (name == "mlp") {
    p = {{"layers", 3}, {"hidden", 24}, {"input", 12}, {"classes", 5}, {"batch", 13}};
  } else {
    p = {{"layers", 2}, {"hidden", 16}, {"heads", 4}, {"ffn", 24}, {"seq", 6},
         {"vocab", 37}, {"batch", 13}, {"dropout", 0.1}};
  }
  auto g = graph::BuildZooModel(name, p);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

v1::OptimizerConfig Optimizer(bool adam) { return hap::testing::EquivalenceOptimizer(adam); }

struct PlanSpec {
  int ranks;
  std::string kind;  // test_programs.h; "single" = the single-device program
  std::vector<double> ratios;
};

absl::StatusOr<std::vector<v1::RankProgram>> Programs(const graph::Graph& g, const PlanSpec& s,
                                                      bool adam, uint64_t seed) {
  synth::Program p;
  if (s.kind == "single") {
    p = lower::SingleDeviceProgram(g);
  } else {
    auto q = hap::testing::ProgramOfKind(g, s.ranks, s.kind, s.ratios);
    if (!q.ok()) return q.status();
    p = *std::move(q);
  }
  lower::LowerOptions lo;
  lo.world_size = s.ranks;
  lo.ratios = s.ratios;
  lo.optimizer = Optimizer(adam);
  lo.seed = seed;
  return lower::Lower(g, p, lo);
}

absl::StatusOr<std::vector<TrainResult>> RunRanks(const graph::Graph& g,
                                             const std::vector<v1::RankProgram>& programs,
                                             executor::TrainOptions to, const std::string& tag) {
  std::string dir = absl::StrCat(::testing::TempDir(), "/rdv_", tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  executor::LocalRanksOptions lro;
  lro.rendezvous_dir = dir;
  lro.prefix = tag;
  return executor::RunLocalRanks(
      programs, g, [&](int) { return data::NewSyntheticBatches(g, kSeed); }, to, lro);
}

std::map<std::string, std::vector<TrainResult>>& References() {
  static auto* m = new std::map<std::string, std::vector<TrainResult>>();
  return *m;
}

struct Case {
  std::string model;
  bool adam;
  PlanSpec a, b;
};

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  const Case& c = i.param;
  return absl::StrCat(c.model, c.adam ? "_adam_" : "_sgd_", c.a.ranks, c.a.kind, "_to_",
                      c.b.ranks, c.b.kind);
}

class ResumeTest : public ::testing::TestWithParam<Case> {};

TEST_P(ResumeTest, ResumedRunEqualsUninterruptedSingleDevice) {
  const Case& c = GetParam();
  const std::string tag = Name({c, 0});
  graph::Graph g = Model(c.model);
  const std::string key = absl::StrCat(c.model, c.adam);
  if (!References().count(key)) {
    auto single = Programs(g, {1, "single", {1.0}}, c.adam, kSeed);
    ASSERT_TRUE(single.ok()) << single.status();
    executor::TrainOptions to;
    to.steps = kSteps;
    auto ref = RunRanks(g, *single, to, "ref_" + key);
    ASSERT_TRUE(ref.ok()) << ref.status();
    References()[key] = *std::move(ref);
  }
  const TrainResult& ref = References()[key][0];

  // Plan A: steps 0..5, a checkpoint after step 3 and after step 6.
  const std::string dir = absl::StrCat(::testing::TempDir(), "/ckpt_", tag);
  std::filesystem::remove_all(dir);
  auto programs_a = Programs(g, c.a, c.adam, kSeed);
  ASSERT_TRUE(programs_a.ok()) << programs_a.status();
  v1::TrainerState trainer;
  trainer.set_seed(kSeed);
  trainer.set_global_batch(13);
  trainer.set_graph_name(g.name());
  *trainer.mutable_optimizer() = Optimizer(c.adam);
  executor::TrainOptions ta;
  ta.steps = kSplit;
  ta.after_step = ckpt::SaveHook({dir, 3, 3, kSplit}, &*programs_a, trainer);
  auto runs_a = RunRanks(g, *programs_a, ta, tag + "_a");
  ASSERT_TRUE(runs_a.ok()) << runs_a.status();
  ASSERT_TRUE(std::filesystem::exists(dir + "/step-00000003/COMMITTED"));
  ASSERT_TRUE(std::filesystem::exists(dir + "/step-00000006/COMMITTED"));

  // Plan B, with another seed in its plan: the checkpoint's seed wins.
  auto programs_b = Programs(g, c.b, c.adam, kSeed + 1);
  ASSERT_TRUE(programs_b.ok()) << programs_b.status();
  auto reader = ckpt::CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->trainer().step(), kSplit);
  EXPECT_EQ((*reader)->trainer().samples_seen(), kSplit * 13);
  EXPECT_EQ((*reader)->trainer().world_size(), c.a.ranks);
  executor::TrainOptions tb;
  tb.first_step = (*reader)->trainer().step();
  tb.steps = kSteps - tb.first_step;
  tb.initialize = ckpt::ResumeHook(std::shared_ptr<ckpt::CheckpointReader>(std::move(*reader)), &g);
  auto runs_b = RunRanks(g, *programs_b, tb, tag + "_b");
  ASSERT_TRUE(runs_b.ok()) << runs_b.status();

  for (int r = 0; r < c.b.ranks; ++r) {
    ASSERT_EQ((*runs_b)[r].losses.size(), static_cast<size_t>(kSteps - kSplit));
    for (int s = 0; s < kSteps - kSplit; ++s) {
      const double want = ref.losses[kSplit + s], got = (*runs_b)[r].losses[s];
      EXPECT_NEAR(got, want, 2e-5 * std::abs(want) + 2e-6) << "rank " << r << " step " << kSplit + s;
    }
  }
  std::vector<std::vector<executor::ParameterShard>> pieces;
  for (const auto& run : *runs_b) pieces.push_back(run.parameters);
  auto got = executor::AssembleParameters(pieces);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = executor::AssembleParameters({ref.parameters});
  ASSERT_TRUE(want.ok()) << want.status();
  auto deviations = hap::testing::CompareParameters(*got, *want);
  ASSERT_TRUE(deviations.ok()) << deviations.status();
  for (const auto& d : *deviations) {
    const double tol = 1e-4 * d.scale + (c.adam ? 1e-3 * kAdamLr * kSteps : 0.0);
    EXPECT_LE(d.worst, tol) << "parameter " << d.name << " element " << d.at << ": " << d.got
                            << " vs " << d.want;
  }
}

std::vector<Case> Cases() {
  const std::vector<double> uneven2 = {0.35, 0.65}, uneven3 = {0.2, 0.3, 0.5};
  std::vector<Case> out;
  for (std::string model : {"mlp", "gpt"}) {
    for (bool adam : {false, true}) {
      out.push_back({model, adam, {2, "dp", uneven2}, {3, "tp", uneven3}});
      out.push_back({model, adam, {2, "dp", uneven2}, {3, "zero", uneven3}});
      out.push_back({model, adam, {3, "mix", uneven3}, {1, "single", {1.0}}});
    }
  }
  out.push_back({"gpt", true, {3, "zero2", uneven3}, {2, "tp", uneven2}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Plans, ResumeTest, ::testing::ValuesIn(Cases()), Name);

}  // namespace
}  // namespace hap
