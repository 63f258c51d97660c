// A synthesized SPMD program (DESIGN.md §4–§5): for every op of the graph,
// in topological order, the sharding rule it runs, the sources it loads (and
// how parameters are stored) and the communication fused in front of it.
// Costs are linear-in-ratio terms (ratios::CostTerm), forward and backward
// together, so the same program can be re-costed at other ratios and handed
// to the ratio LP.
#ifndef HAP_PLANNER_SYNTH_PROGRAM_H_
#define HAP_PLANNER_SYNTH_PROGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "planner/graph/graph.h"
#include "planner/ratios/ratio_lp.h"
#include "planner/synth/form.h"
#include "planner/synth/rules.h"

namespace hap::synth {

using ratios::CostTerm;

enum class Collective {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kSlice,      // R -> S(d), local
  kZeroOut,    // R -> P, local: kept on device 0, zeros elsewhere
};
enum class Method { kNone, kPadded, kGrouped };

const char* CollectiveName(Collective c);
const char* MethodName(Method m);

// A form change of a tensor, fused in front of its consumer.
struct CommStep {
  graph::TensorId tensor = -1;
  Form from, to;
  Collective forward = Collective::kSlice;
  Collective backward = Collective::kSlice;  // its dual; kSlice = none
  bool has_backward = false;                  // the tensor needs a gradient
  Method method = Method::kNone;
  CostTerm forward_cost, backward_cost;
};

enum class ParamStorage { kReplicated, kSharded, kZero };
const char* StorageName(ParamStorage s);

// A source (input or parameter) loaded for its first consumer.
struct SourceLoad {
  graph::TensorId tensor = -1;
  Form form;                        // the form the consumer reads
  bool parameter = false;
  ParamStorage storage = ParamStorage::kReplicated;
  Form storage_form;                // R, S(d), or S(0) for ZeRO
  // Gradient synchronisation of a replicated parameter: all-reduce, or
  // sufficient factor broadcasting (all-gather x and dy, recompute dW).
  bool grad_allreduce = false;
  bool sfb = false;
  // ZeRO storage gathered once per step (ZeRO-2-like: the gathered copy is
  // kept for backward) instead of again for backward (ZeRO-3). The lowering
  // coalesces these parameters into one all-gather before forward and their
  // gradients into one reduce-scatter after backward.
  bool gather_once = false;
  bool grad_reduce_scatter = false;  // gather_once with a partial gradient
  Method method = Method::kNone;    // ZeRO gathers / SFB gathers
  std::vector<CostTerm> costs;
  // Compute: the optimizer update of the stored elements (calibrated).
  std::vector<CostTerm> update_costs;
};

struct OpStep {
  graph::OpId op = -1;
  int rule_index = 0;
  ShardRule rule;
  std::vector<SourceLoad> loads;
  std::vector<CommStep> comms;
  CostTerm compute;
  // The rule's all-gather inside the op (ShardRule::internal_gather_bytes):
  // a synchronising collective after the op's forward kernels start.
  CostTerm internal;
};

struct Program {
  std::vector<OpStep> steps;  // one per op, topological order
  // Cost at the ratios it was searched with.
  double cost = 0;
  double compute_seconds = 0;
  double communication_seconds = 0;
  bool optimal = false;  // proven optimal (false when a budget cut it)
  int64_t states_expanded = 0;
  int64_t states_generated = 0;
  double search_seconds = 0;

  // Per-step time outside ops and collectives on each device (calibrated
  // step_overhead_seconds; empty = none).
  CostTerm overhead;

  // The terms a step takes (compute terms flagged), for re-costing and the
  // LP: every collective's term, and the compute between two
  // synchronising collectives summed into one term per block. A device runs
  // its kernels between two collectives without waiting for the others, so
  // a block takes the slowest device's sum, not the sum of per-kernel
  // maxima; a device's fixed per-step time (step_overhead_seconds, the
  // optimizer over replicated parameters) thus weighs against its share of
  // the batch in the same block, and the LP gives it less. The step is taken
  // in execution order: gathers of parameters gathered once, forward (each
  // op's form changes, then a third of its compute), backward in reverse
  // (two thirds of the compute, then the gradients' form changes), the
  // gradient bucket and reduce-scatters, the optimizer and the per-step
  // overhead; the last block continues into the next step's first.
  std::vector<CostTerm> BlockTerms(std::vector<bool>* is_compute = nullptr) const;
};

// Step time of `p` at `ratios` (one segment), split in compute and
// communication (each a sum of per-instruction maxima).
struct ProgramCost {
  double total = 0;
  double compute = 0;
  double communication = 0;
};
ProgramCost EvaluateProgram(const Program& p, const std::vector<double>& ratios);

// Merges identical terms (same segment, coefficients, constants) into one
// with a weight: 12 identical layers give one term of weight 12.
std::vector<CostTerm> MergeTerms(const std::vector<CostTerm>& terms);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_PROGRAM_H_
