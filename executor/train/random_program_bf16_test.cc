// bf16 mixed precision (LowerOptions::bf16) on random valid programs
// (random_programs.h, as random_program_equivalence_test draws them) against
// the single-device bf16 program, with tolerances measured against bf16's
// own noise floor rather than fixed.
//
// Why a noise floor: a distributed bf16 run cannot give the single-device
// bf16 run's numbers. Every bf16 product rounds its result (kernels.h), so
// a contraction split over ranks (row-parallel linear, in-channels conv,
// partial matmul) rounds each rank's partial sum instead of the total, and
// data-parallel gradients are sums of other rounded partials. Measured on
// 240 programs per optimizer (mlp, gpt, vit, moe, bn_cnn, lstm; seeds 0-39),
// per parameter, a = |distributed bf16 - single bf16|, b = |single bf16 -
// single fp32| (the noise floor), c = |distributed fp32 - single fp32|:
// - SGD, one step: a/b median 1.2, 90% under 1.9; c below 1e-7. The
//   outliers are rounding, isolated by turning bf16 off op by op: a conv
//   split by in-channels over 3 ranks rounds 3 partial sums that cancel,
//   then batch norm divides by the channel's small deviation (a/b 16 on
//   conv.weight, all of it from the conv's forward rounding); and an MoE
//   routing flip (moe seed 27: token 21's second expert 4 -> 3 from a
//   near-tie in the gate's logits, and through the capacity tokens 33 and
//   49 change places; a/b 39, the loss 18x the floor at step 0; fp32 is
//   exact).
// - AdamW normalises each element's gradient, so an element whose gradient
//   is nearly zero steps +-lr on its rounding's sign: the largest element
//   difference is 2 * lr in both a and b, on whichever elements flipped (a/b
//   of the largest element up to 950 at step 1). The root-mean-square
//   deviation over the tensor is the stable measure there.
// So, per parameter, with floor = max(b, 1e-3 * the tensor's scale):
//   SGD:   largest element |a| <= kSgdFactor * largest-element floor
//          (clean: at most 8.5 over 144 programs at 2 steps, 3.7 without
//          moe),
//   AdamW: rms |a| <= kAdamFactor * rms floor (clean: at most 18).
// Measured with these factors: 476 of 480 programs (seeds 0-79) pass; the 4
// that fail are MoE routing flips (seeds 27, 41, 49, 58; the routes printed
// from the kernel differ from the single-device bf16 run's at step 0 or 1).
// A gradient sum dropped for the bias parameters in bf16 lowering only (an
// injected bug) fails 29 of the default 60 programs (on the 2-step
// diagnostic runs: 76 of the 89 programs it changes with SGD, 66 of 89
// with AdamW; those it passes lose only a small rank's share of a bias'
// gradient). A bug below bf16's resolution (gradients synchronised in bf16,
// a missing or extra rounding) is beyond any test against the single-device
// bf16 run: it is noise-sized (bf16_test measures bf16 gradients against
// fp32).
// Losses: each step within kLossFactor * the largest single-device bf16 vs
// fp32 loss difference over the steps, plus 1e-4.
//
// MoE routing flips on a near-tie in about 1 program in 20 of a sweep: such
// a seed fails on an MoE model's parameters (and often its loss); the
// default seeds do not flip. fp32 (random_program_equivalence_test) has no
// flips.
//
// A failure names the model and the seed, prints every parameter's a and b
// and the program; the case reruns alone as
//   --gtest_filter='*/<model>_seed<seed>_*'
// Larger sweeps: HAP_RANDOM_PROGRAMS=<count per model> (kProgramsPerModel),
// HAP_RANDOM_PROGRAMS_FIRST=<first seed> (0),
// HAP_RANDOM_PROGRAMS_MODELS=<comma-separated EquivalenceModel names>
// (kModels); HAP_RANDOM_PROGRAMS_PRINT=1 prints every program and deviation.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "executor/train/random_programs.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

using executor::HostTensor;
using executor::TrainResult;

constexpr int kSteps = 2;
constexpr int kProgramsPerModel = 10;
constexpr const char* kModels = "mlp,gpt,vit,moe,bn_cnn,lstm";
constexpr double kSgdFactor = 20;
constexpr double kAdamFactor = 40;
constexpr double kLossFactor = 10;
// The floor's share of a tensor's scale: below it, b is a lucky sample.
constexpr double kRelativeFloor = 1e-3;

// What the seed decides, as random_program_equivalence_test's
// (random_programs.h): ranks, ratios, SGD or AdamW, overlap.
using Case = hap::testing::RandomCase;
int Ranks(uint64_t seed) { return hap::testing::RandomCaseRanks(seed); }
bool Adam(uint64_t seed) { return hap::testing::RandomCaseAdam(seed); }
bool Overlap(uint64_t seed) { return hap::testing::RandomCaseOverlap(seed); }
std::vector<double> Ratios(uint64_t seed) { return hap::testing::RandomCaseRatios(seed); }

std::string Name(const ::testing::TestParamInfo<Case>& i) {
  return hap::testing::RandomCaseName(i.param);
}

absl::StatusOr<std::vector<TrainResult>> RunPlan(const graph::Graph& g, const synth::Program& p,
                                                 int n, const std::vector<double>& ratios,
                                                 bool adam, bool overlap, bool bf16,
                                                 const std::string& tag) {
  return hap::testing::RunLoweredOverGloo(
      g, p, hap::testing::RandomCaseLowering(n, ratios, adam, overlap, bf16), kSteps, tag);
}

absl::StatusOr<std::map<std::string, HostTensor>> Assemble(const std::vector<TrainResult>& runs) {
  std::vector<std::vector<executor::ParameterShard>> pieces;
  for (const TrainResult& r : runs) pieces.push_back(r.parameters);
  return executor::AssembleParameters(pieces);
}

// The largest and the root-mean-square element difference of x and y.
struct Deviation {
  double max = 0, rms = 0;
};
Deviation Deviate(const HostTensor& x, const HostTensor& y) {
  Deviation d;
  const float* a = x.as<float>();
  const float* b = y.as<float>();
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    const double e = std::abs(double{a[i]} - double{b[i]});
    d.max = std::max(d.max, e);
    d.rms += e * e;
  }
  if (x.num_elements() > 0) d.rms = std::sqrt(d.rms / x.num_elements());
  return d;
}

// The single-device bf16 and fp32 runs per (model, ranks, optimizer).
struct Reference {
  TrainResult bf16, fp32;
  std::map<std::string, HostTensor> bf16_params, fp32_params;
};
std::map<std::string, Reference>& References() {
  static auto* m = new std::map<std::string, Reference>();
  return *m;
}

class RandomProgramBf16Test : public ::testing::TestWithParam<Case> {};

TEST_P(RandomProgramBf16Test, WithinBf16NoiseOfSingleDevice) {
  const Case& c = GetParam();
  const int n = Ranks(c.seed);
  const bool adam = Adam(c.seed);
  auto g = hap::testing::EquivalenceModel(c.model, n);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string ref_key = absl::StrCat(c.model, n, adam);
  if (!References().count(ref_key)) {
    const synth::Program single = lower::SingleDeviceProgram(*g);
    Reference ref;
    for (bool bf16 : {true, false}) {
      auto run = RunPlan(*g, single, 1, {1.0}, adam, false, bf16,
                         absl::StrCat("ref", bf16 ? "16_" : "32_", ref_key));
      ASSERT_TRUE(run.ok()) << run.status();
      auto params = Assemble(*run);
      ASSERT_TRUE(params.ok()) << params.status();
      (bf16 ? ref.bf16 : ref.fp32) = (*run)[0];
      (bf16 ? ref.bf16_params : ref.fp32_params) = *std::move(params);
    }
    References()[ref_key] = std::move(ref);
  }
  const Reference& ref = References()[ref_key];

  const std::vector<double> ratios = Ratios(c.seed);
  auto program = hap::testing::RandomTestProgram(*g, n, ratios, c.seed);
  ASSERT_TRUE(program.ok()) << "model " << c.model << " seed " << c.seed << ": "
                            << program.status();
  const std::string repro = hap::testing::RandomCaseRepro(*g, c, ratios, *program);
  auto runs = RunPlan(*g, *program, n, ratios, adam, Overlap(c.seed), true, Name({c, 0}));
  ASSERT_TRUE(runs.ok()) << runs.status() << "\n" << repro;
  auto params = Assemble(*runs);
  ASSERT_TRUE(params.ok()) << params.status() << "\n" << repro;
  ASSERT_EQ(params->size(), ref.bf16_params.size()) << repro;

  std::string report;
  bool ok = true;
  double loss_floor = 0;
  for (int s = 0; s < kSteps; ++s) {
    loss_floor = std::max(loss_floor, std::abs(ref.bf16.losses[s] - ref.fp32.losses[s]));
  }
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ((*runs)[r].losses.size(), ref.bf16.losses.size()) << repro;
    for (int s = 0; s < kSteps; ++s) {
      const double a = std::abs((*runs)[r].losses[s] - ref.bf16.losses[s]);
      const bool near = a <= kLossFactor * loss_floor + 1e-4;
      EXPECT_TRUE(near) << "rank " << r << " step " << s << " loss " << (*runs)[r].losses[s]
                        << " vs " << ref.bf16.losses[s] << " (bf16 vs fp32 at most " << loss_floor
                        << ")";
      ok = ok && near;
    }
  }
  for (const auto& [name, want] : ref.bf16_params) {
    auto it = params->find(name);
    ASSERT_TRUE(it != params->end()) << "no parameter " << name << "\n" << repro;
    ASSERT_EQ(it->second.shape(), want.shape()) << name << "\n" << repro;
    double scale = 1e-3;
    for (int64_t i = 0; i < want.num_elements(); ++i) {
      scale = std::max(scale, std::abs(double{want.as<float>()[i]}));
    }
    const Deviation a = Deviate(it->second, want);
    const Deviation b = Deviate(want, ref.fp32_params.at(name));
    const double floor = kRelativeFloor * scale;
    const double got = adam ? a.rms : a.max;
    const double tol =
        adam ? kAdamFactor * std::max(b.rms, floor) : kSgdFactor * std::max(b.max, floor);
    absl::StrAppendFormat(&report, "  %s: a max %.3g rms %.3g, b max %.3g rms %.3g, scale %.3g\n",
                          name, a.max, a.rms, b.max, b.rms, scale);
    EXPECT_LE(got, tol) << "parameter " << name << ": " << (adam ? "rms" : "largest")
                        << " deviation from single-device bf16 " << got << ", bf16 vs fp32 "
                        << (adam ? b.rms : b.max) << " (scale " << scale << ")";
    ok = ok && got <= tol;
  }
  if (!ok)
    ADD_FAILURE() << "deviations (a: from single-device bf16, b: single-device bf16 "
                     "from fp32):\n"
                  << report << repro;
  if (std::getenv("HAP_RANDOM_PROGRAMS_PRINT") != nullptr) std::cout << report << repro;
}

INSTANTIATE_TEST_SUITE_P(Sweep, RandomProgramBf16Test,
                         ::testing::ValuesIn(hap::testing::RandomCaseSweep(kProgramsPerModel,
                                                                           kModels)),
                         Name);

}  // namespace
}  // namespace hap
