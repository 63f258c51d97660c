// Program synthesis (docs/design.md §5): best-first search over the forward
// program. A state is the step (ops are taken in the graph's topological
// order) and the forms of the live tensors — those produced and still read
// by a later op; facts that can enable nothing more are dropped, so equal
// states merge (memo on the fact set). A step runs one sharding rule of the
// op; sources (inputs, parameters) and communication are fused into their
// consumer. Each tensor is computed once and communicated at most once.
//
//   cost(program) = sum over instructions of max over devices (compute,
//                   forward + backward) + max over devices (communication)
//
// at fixed ratios. The heuristic — the remaining ops' cheapest compute —
// never overestimates, so the first complete program popped is optimal.
// A budget (states, seconds) or cancellation cuts the search; the best
// complete program reachable greedily from the frontier is returned with
// optimal = false.
//
// Thread-safety: Synthesize is reentrant; the callbacks run on its thread.
#ifndef HAP_PLANNER_SYNTH_SEARCH_H_
#define HAP_PLANNER_SYNTH_SEARCH_H_

#include <functional>
#include <optional>

#include "absl/status/statusor.h"
#include "planner/cost/cluster_model.h"
#include "planner/cost/collectives.h"
#include "planner/graph/graph.h"
#include "planner/synth/program.h"

namespace hap::synth {

struct SearchOptions {
  std::vector<double> ratios;  // per device; empty = proportional to FLOPS
  bool allow_sfb = true;
  bool allow_zero = true;
  bool allow_grouped = true;
  bool zero_heuristic = false;  // uniform-cost search (the reference)
  // Solve repeated blocks (identical layers) once and combine them by DP
  // over the block boundaries; falls back to A* when there are none.
  bool block_search = true;
  // Baselines restrict the rules and the parameter storage.
  std::function<bool(const ShardRule&)> rule_filter;
  std::optional<ParamStorage> force_storage;
  int64_t max_states = 2'000'000;
  double max_seconds = 60;
  std::function<bool()> cancelled;  // polled; true stops the search
  // Called every `progress_every` expanded states (and at the end).
  std::function<void(int64_t states_expanded, double best_cost)> progress;
  int64_t progress_every = 4096;
  int64_t min_shard_length = 2;
  // Price the program with communication overlapping compute
  // (Program::overlap; ScheduleCommunication chooses the bucket size).
  bool overlap = false;
  // Bytes on the wire per byte of a parameter's gradient in its
  // synchronisation (the gradient buckets' all-reduce, ZeRO's gradient
  // reduce-scatter): 0.5 for bf16 gradients (PlanOptions.gradient_precision),
  // 1 for fp32.
  double gradient_wire_scale = 1.0;
  // The search's own price of the collectives that can run behind compute
  // (replicated gradients' all-reduce shares, ZeRO-3 gathers and gradient
  // reduce-scatters), as a fraction of their time. The program keeps their
  // true costs, so its cost (the critical path with overlap) is exact.
  double async_price = 1.0;
};

// Errors: InvalidArgument for ratios of the wrong size or not summing to 1,
// a NaN max_seconds, an async_price not finite and >= 0, a
// gradient_wire_scale not finite and > 0, a progress_every below 1;
// Cancelled when `cancelled` fired before any complete program was found;
// ResourceExhausted when the budget ran out with no complete program;
// FailedPrecondition when no program exists under the restrictions.
absl::StatusOr<Program> Synthesize(const graph::Graph& g,
                                   const cost::ClusterModel& cluster,
                                   const SearchOptions& options);

// For randomized tests of the lowering and the executors: a complete
// program drawn at random from the search's own transitions, the same for
// the same seed. At each op one of the rules that apply to the state so far
// (under options' restrictions), uniformly; a dead end (a later op with no
// rule left) backtracks. Each parameter takes one of the storages the
// search weighs for it (replicated, SFB, ZeRO gathered twice or once),
// uniformly, instead of the cheapest. Costs are those of the search at the
// ratios; optimal is false. Errors as Synthesize's (ResourceExhausted when
// backtracking runs past its budget).
absl::StatusOr<Program> RandomProgram(const graph::Graph& g, const cost::ClusterModel& cluster,
                                      const SearchOptions& options, uint64_t seed);

// The work of each op of a training step as the search costs it: forward
// FLOPs, plus backward FLOPs where a gradient flows through the op.
struct OpWork {
  double flops = 0;
  bool backward = false;
  // Kernel calls a step makes for the op: its forward, and with a backward
  // two more (input and parameter gradients), each paying a launch.
  double launches() const { return backward ? 3.0 : 1.0; }
};
std::vector<OpWork> TrainingWork(const graph::Graph& g);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_SEARCH_H_
