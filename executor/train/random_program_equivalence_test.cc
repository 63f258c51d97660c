// Random valid programs (random_programs.h) on n ranks against the
// single-device program: the equivalence of equivalence_test for programs
// the search rarely picks — each op's rule drawn among those that apply,
// tensors re-sharded between ops that disagree, parameter storage drawn
// (replicated, SFB, ZeRO gathered twice or once), padded or grouped
// collectives drawn. Models mlp, gpt, vit, moe (equivalence_test's small
// configurations), bn_cnn and lstm (those of batch_norm_ and
// lstm_equivalence_test); everything else follows from the seed: 2 or 3
// ranks, even ratios or drawn ones (some ranks given almost nothing, so
// short dimensions get empty shards), SGD with momentum or AdamW with
// clipping, overlap (asynchronous collectives on a communication thread) on
// a third of them. Ranks are threads over real Gloo on 127.0.0.1.
// Tolerances as equivalence_test's.
//
// A failure names the model and the seed and prints the ratios and the
// program's rule per op; the case reruns alone as
//   --gtest_filter='*/<model>_seed<seed>_*'
// A larger sweep for manual runs: HAP_RANDOM_PROGRAMS=<count per model>
// (default kProgramsPerModel), from seed HAP_RANDOM_PROGRAMS_FIRST (0);
// HAP_RANDOM_PROGRAMS_MODELS=<comma-separated EquivalenceModel names>
// (kModels), HAP_RANDOM_PROGRAMS_RANKS=<comma-separated rank counts> (2,3);
// HAP_RANDOM_PROGRAMS_PRINT=1 prints every program.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/train/random_programs.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

using executor::TrainResult;

constexpr int kSteps = 5;
constexpr double kAdamLr = hap::testing::kEquivalenceAdamLr;
constexpr int kProgramsPerModel = 10;
constexpr const char* kModels = "mlp,gpt,vit,moe,bn_cnn,lstm";

using Case = hap::testing::RandomCase;
int Ranks(uint64_t seed) { return hap::testing::RandomCaseRanks(seed); }
bool Adam(uint64_t seed) { return hap::testing::RandomCaseAdam(seed); }
bool Overlap(uint64_t seed) { return hap::testing::RandomCaseOverlap(seed); }

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  return hap::testing::RandomCaseName(i.param);
}

absl::StatusOr<std::vector<TrainResult>> RunPlan(const graph::Graph& g, const synth::Program& p,
                                                 int n, const std::vector<double>& ratios,
                                                 bool adam, bool overlap, const std::string& tag) {
  return hap::testing::RunLoweredOverGloo(
      g, p, hap::testing::RandomCaseLowering(n, ratios, adam, overlap, /*bf16=*/false), kSteps,
      tag);
}

// One reference per (model, ranks, optimizer): the single-device run.
std::map<std::string, TrainResult>& References() {
  static auto* m = new std::map<std::string, TrainResult>();
  return *m;
}

class RandomProgramTest : public ::testing::TestWithParam<Case> {};

TEST_P(RandomProgramTest, LossesAndParametersMatchSingleDevice) {
  const Case& c = GetParam();
  const int n = Ranks(c.seed);
  const bool adam = Adam(c.seed);
  auto g = hap::testing::EquivalenceModel(c.model, n);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string ref_key = absl::StrCat(c.model, n, adam);
  if (!References().count(ref_key)) {
    auto ref = RunPlan(*g, lower::SingleDeviceProgram(*g), 1, {1.0}, adam, false,
                       absl::StrCat("ref_", ref_key));
    ASSERT_TRUE(ref.ok()) << ref.status();
    References()[ref_key] = (*ref)[0];
  }
  const TrainResult& ref = References()[ref_key];
  // The training must have moved: the first and last losses differ.
  ASSERT_GT(std::abs(ref.losses.front() - ref.losses.back()), 1e-4);

  const std::vector<double> ratios = hap::testing::RandomCaseRatios(c.seed);
  auto program = hap::testing::RandomTestProgram(*g, n, ratios, c.seed);
  ASSERT_TRUE(program.ok()) << "model " << c.model << " seed " << c.seed << ": "
                            << program.status();
  const std::string repro = hap::testing::RandomCaseRepro(*g, c, ratios, *program);
  if (std::getenv("HAP_RANDOM_PROGRAMS_PRINT") != nullptr) std::cout << repro;
  auto runs = RunPlan(*g, *program, n, ratios, adam, Overlap(c.seed), Name({c, 0}));
  ASSERT_TRUE(runs.ok()) << runs.status() << "\n" << repro;

  bool ok = true;
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ((*runs)[r].losses.size(), ref.losses.size()) << repro;
    for (int s = 0; s < kSteps; ++s) {
      const double want = ref.losses[s], got = (*runs)[r].losses[s];
      const bool near = std::abs(got - want) <= 2e-5 * std::abs(want) + 2e-6;
      EXPECT_TRUE(near) << "rank " << r << " step " << s << " loss " << got << " vs " << want;
      ok = ok && near;
    }
  }
  auto deviations = hap::testing::CompareRunsWithReference(*runs, ref);
  ASSERT_TRUE(deviations.ok()) << deviations.status() << "\n" << repro;
  for (const auto& d : *deviations) {
    const double tol = 1e-4 * d.scale + (adam ? 1e-3 * kAdamLr * kSteps : 0.0);
    EXPECT_LE(d.worst, tol) << "parameter " << d.name << " element " << d.at << ": " << d.got
                            << " vs " << d.want;
    ok = ok && d.worst <= tol;
  }
  if (!ok) ADD_FAILURE() << repro;
}

// The generator is deterministic per seed and, over a few seeds, reaches
// what the sweep is for: every storage, re-sharding by all-to-all, both
// methods of uneven collectives.
TEST(RandomTestProgramTest, DeterministicAndVaried) {
  auto g = hap::testing::EquivalenceModel("gpt", 3);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<double> ratios = hap::testing::EquivalenceRatios(3, true);
  std::map<std::string, int> seen;
  std::set<std::string> programs;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    auto p = hap::testing::RandomTestProgram(*g, 3, ratios, seed);
    ASSERT_TRUE(p.ok()) << "seed " << seed << ": " << p.status();
    auto again = hap::testing::RandomTestProgram(*g, 3, ratios, seed);
    ASSERT_TRUE(again.ok()) << again.status();
    const std::string text = hap::testing::DescribeProgram(*g, *p);
    EXPECT_EQ(text, hap::testing::DescribeProgram(*g, *again)) << "seed " << seed;
    programs.insert(text);
    for (const synth::OpStep& s : p->steps) {
      for (const synth::SourceLoad& l : s.loads) {
        if (!l.parameter) continue;
        ++seen[synth::StorageName(l.storage)];
        if (l.sfb) ++seen["sfb"];
        if (l.gather_once) ++seen["once"];
      }
      for (const synth::CommStep& c : s.comms) {
        ++seen[synth::CollectiveName(c.forward)];
        ++seen[synth::MethodName(c.method)];
      }
    }
  }
  EXPECT_EQ(programs.size(), 8u);
  for (const char* what : {"replicated", "sharded", "zero", "sfb", "once", "all-to-all",
                           "all-gather", "reduce-scatter", "padded", "grouped"}) {
    EXPECT_GT(seen[what], 0) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, RandomProgramTest,
                         ::testing::ValuesIn(hap::testing::RandomCaseSweep(kProgramsPerModel,
                                                                           kModels)),
                         Name);

}  // namespace
}  // namespace hap
