// Test-only: random valid programs for checking the lowering and the
// executors against the single-device run (random_program_equivalence_test).
// Programs the search rarely picks: each op's sharding rule drawn among those
// that apply (so tensors change forms between ops wherever the rules
// disagree), each parameter's storage drawn among replicated, SFB and ZeRO
// (gathered twice or once), each uneven collective padded or grouped.
#ifndef HAP_EXECUTOR_TRAIN_RANDOM_PROGRAMS_H_
#define HAP_EXECUTOR_TRAIN_RANDOM_PROGRAMS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/graph/graph.h"
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

}  // namespace hap::testing

#endif  // HAP_EXECUTOR_TRAIN_RANDOM_PROGRAMS_H_
