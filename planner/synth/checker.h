// An independent checker of synthesized programs: replays a program over the
// fact set and verifies every instruction's preconditions, the unique
// computation / communication rules, that the loss is reached in a valid
// form, and that every trainable parameter's gradient is produced and
// synchronised as its storage requires. Used by tests on every zoo model and
// by the planner service before it stores a plan.
#ifndef HAP_PLANNER_SYNTH_CHECKER_H_
#define HAP_PLANNER_SYNTH_CHECKER_H_

#include "absl/status/status.h"
#include "planner/graph/graph.h"
#include "planner/synth/program.h"

namespace hap::synth {

// Internal error naming the op and the violated condition, or OK.
absl::Status CheckProgram(const graph::Graph& g, const Program& p,
                          int num_devices);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_CHECKER_H_
