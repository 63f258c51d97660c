// Test-only: random valid programs for checking the lowering and the
// executors against the single-device run (random_program_equivalence_test,
// random_program_bf16_test), and what each test case's seed decides.
// Programs the search rarely picks: each op's sharding rule drawn among those
// that apply (so tensors change forms between ops wherever the rules
// disagree), each parameter's storage drawn among replicated, SFB and ZeRO
// (gathered twice or once), each uneven collective padded or grouped.
#ifndef HAP_EXECUTOR_TRAIN_RANDOM_PROGRAMS_H_
#define HAP_EXECUTOR_TRAIN_RANDOM_PROGRAMS_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/graph/graph.h"
#include "planner/lower/lower.h"
#include "planner/synth/program.h"

namespace hap::testing {

// A random program for n devices at `ratios` (synth::RandomProgram on
// SlowDevicesFastLinks(n), every rule and storage allowed, then the methods
// of its uneven collectives drawn), checked by synth::CheckProgram. The
// same program for the same arguments. Errors: RandomProgram's, or the
// checker's Internal error (a program the transitions allow that the
// checker refuses).
absl::StatusOr<synth::Program> RandomTestProgram(const graph::Graph& g, int n,
                                                 const std::vector<double>& ratios, uint64_t seed);

// One line per op: its name and type, the rule (name, input and output
// forms), the sources it loads (storage, SFB, ZeRO gathered once, method)
// and the form changes in front of it (tensor, forms, collective, method).
std::string DescribeProgram(const graph::Graph& g, const synth::Program& p);

// A case of the random-program tests: a model (an EquivalenceModel name)
// and a seed, which decides everything else: the rank count (2 and 3 in
// turn, or HAP_RANDOM_PROGRAMS_RANKS, a comma-separated list), even ratios
// or drawn ones (every rank's weight in [0.05, 1), one in four 0.01: a slow
// device the ratio LP gives almost nothing, so short dimensions get empty
// shards), SGD with momentum or AdamW, overlap on a third of them.
struct RandomCase {
  std::string model;
  uint64_t seed = 0;
};
int RandomCaseRanks(uint64_t seed);
bool RandomCaseUneven(uint64_t seed);
std::vector<double> RandomCaseRatios(uint64_t seed);
bool RandomCaseAdam(uint64_t seed);
bool RandomCaseOverlap(uint64_t seed);
// "gpt seed 3" (gtest prints a case so).
void PrintTo(const RandomCase& c, std::ostream* os);
// "gpt_seed3_3ranks_uneven_adam_overlap": a gtest parameter name.
std::string RandomCaseName(const RandomCase& c);
// The lowering of a random case's run: n ranks at `ratios`, the
// equivalence tests' optimizer (AdamW or SGD with momentum), data seed 1234,
// with overlap gradient buckets of 2 KiB (several per model, so buckets
// start at several points of backward), bf16 or fp32.
lower::LowerOptions RandomCaseLowering(int n, const std::vector<double>& ratios, bool adam,
                                       bool overlap, bool bf16);
// What a failure prints to rerun a case: model, seed, the case's name, the
// ratios and the program's rule per op (DescribeProgram).
std::string RandomCaseRepro(const graph::Graph& g, const RandomCase& c,
                            const std::vector<double>& ratios, const synth::Program& p);
// `per_model` seeds of each of `models` (comma-separated), from seed 0;
// HAP_RANDOM_PROGRAMS (count per model), HAP_RANDOM_PROGRAMS_FIRST (first
// seed) and HAP_RANDOM_PROGRAMS_MODELS override them for manual sweeps.
std::vector<RandomCase> RandomCaseSweep(int64_t per_model, const std::string& models);

}  // namespace hap::testing

#endif  // HAP_EXECUTOR_TRAIN_RANDOM_PROGRAMS_H_
