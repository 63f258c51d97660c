// A synthesized SPMD program (docs/design.md §4–§5): for every op of the graph,
// in topological order, the sharding rule it runs, the sources it loads (and
// how parameters are stored) and the communication fused in front of it.
// Costs are linear-in-ratio terms (ratios::CostTerm), forward and backward
// together, so the same program can be re-costed at other ratios and handed
// to the ratio LP.
#ifndef HAP_PLANNER_SYNTH_PROGRAM_H_
#define HAP_PLANNER_SYNTH_PROGRAM_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "planner/cost/collectives.h"
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

// Replicated parameters' partial gradients, all-reduced in buckets of about
// Program::bucket_bytes, filled in the order backward completes them.
struct GradientBucket {
  std::vector<graph::TensorId> tensors;
  int64_t bytes = 0;
  // Its last gradient is complete after the backward of steps[ready_step].
  int ready_step = 0;
  CostTerm cost;             // one all-reduce call: latency, bytes, overhead
  const char* algorithm = "";  // CollectiveModel::AllReduceAlgorithm
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

  // Communication overlapped with compute (ProgramCost is then the critical
  // path over a compute and a communication stream): gradient buckets start
  // during backward once their gradients are complete, ZeRO gathers are
  // prefetched one parameter ahead, waits sit just before first use (the
  // optimizer for gradients); other collectives synchronise. Off: every
  // collective in line, where the executors run it today.
  bool overlap = false;
  // Gradient buckets (AssignGradientBuckets); empty = each replicated
  // gradient's own SourceLoad::costs, summed after backward.
  int64_t bucket_bytes = 0;
  std::vector<GradientBucket> buckets;
  // Bytes on the wire per gradient byte in the buckets (0.5: bf16
  // gradients, SearchOptions::gradient_wire_scale); bucket sizes stay in
  // the buffers' bytes, as the lowering fills them.
  double gradient_wire_scale = 1.0;
  // Per device: 1 - overlap_efficiency, the share of an overlapped
  // collective that still slows its compute (empty = none).
  std::vector<double> interference;

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
// communication. Without overlap each is a sum of per-block maxima; with
// overlap `total` is the critical path, `compute` the same path with every
// collective taking no time, and `communication` the rest (exposed).
struct ProgramCost {
  double total = 0;
  double compute = 0;
  double communication = 0;        // exposed: total - compute
  double communication_busy = 0;   // every collective's time, hidden or not
};
ProgramCost EvaluateProgram(const Program& p, const std::vector<double>& ratios);

// The ratio LP's terms for `p` (added to req->terms): BlockTerms merged
// without overlap; with overlap the terms of the critical path and the path
// (req->path).
void AddProgramTerms(const Program& p, ratios::RatioLpRequest* req);

// The executors' gradient bucket (planner/lower kBucketBytes), and the
// sizes the planner chooses from when collectives overlap compute.
inline constexpr int64_t kLoweringBucketBytes = int64_t{64} << 20;
inline constexpr int64_t kBucketCandidates[] = {int64_t{1} << 20, int64_t{4} << 20,
                                                int64_t{25} << 20, int64_t{64} << 20,
                                                int64_t{100} << 20};

// Buckets of `bucket_bytes` (a gradient larger than that gets its own) for
// the replicated parameters whose gradient is all-reduced, priced with
// `bucket_cost(bytes)`; sets p->buckets and p->bucket_bytes.
void AssignGradientBuckets(const graph::Graph& g, int64_t bucket_bytes,
                           const std::function<CostTerm(double bytes, const char** algorithm)>&
                               bucket_cost,
                           Program* p);

// Sets p->overlap, the devices' interference and the gradient buckets: the
// lowering's size without overlap; with overlap the candidate whose step is
// shortest at `ratios`. Each bucket is one all-reduce call
// (CollectiveModel::AllReduce: ring or tree, latency and overhead once).
void ScheduleCommunication(const graph::Graph& g, const cost::CollectiveModel& coll,
                           const std::vector<double>& ratios, bool overlap, Program* p);

// Merges identical terms (same segment, coefficients, constants) into one
// with a weight: 12 identical layers give one term of weight 12.
std::vector<CostTerm> MergeTerms(const std::vector<CostTerm>& terms);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_PROGRAM_H_
