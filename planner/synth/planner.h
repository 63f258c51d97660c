// The planner core's entry point: the joint loop of docs/design.md §6 and the
// baselines, over one graph and one cluster, with no I/O.
//
//   ratios <- proportional to FLOPS
//   repeat: program <- Synthesize(ratios); ratios' <- LP(program)
//           until the LP cost stops improving
//
// The baselines are restricted searches in the same cost model:
//   dp-even          data-parallel rules only, replicated parameters, equal
//   split dp-proportional  the same, split proportional to FLOPS zero3
//   data-parallel rules, ZeRO-sharded parameters, equal split megatron
//   tensor-parallel rules (column/row/heads) over the plan's
//                    devices, equal split
// Because each baseline program is in the synthesizer's search space, the
// planner also re-optimises the data-parallel and ZeRO programs' ratios with
// the LP and keeps the cheapest candidate: the synthesized plan's predicted
// time is never above a baseline's.
#ifndef HAP_PLANNER_SYNTH_PLANNER_H_
#define HAP_PLANNER_SYNTH_PLANNER_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph.h"
#include "planner/ratios/ratio_lp.h"
#include "planner/synth/program.h"
#include "planner/synth/search.h"

namespace hap::synth {

enum class Baseline { kNone, kDpEven, kDpProportional, kMegatron, kZero3 };
const char* BaselineName(Baseline b);
absl::StatusOr<Baseline> ParseBaseline(const std::string& name);

// The rule filters of the baselines: data parallel (batch-like splits of
// dimension 0, replicated or partial rules) and tensor parallel (anything
// but data rules).
bool DataParallelRule(const ShardRule& r);
bool TensorParallelRule(const ShardRule& r);

enum class OptimizerKind { kSgd, kSgdMomentum, kAdam };

struct PlanOptions {
  Baseline baseline = Baseline::kNone;
  bool allow_sfb = true;
  bool allow_zero = true;
  bool allow_grouped = true;
  // Price collectives as overlapping compute (Program::overlap), as the
  // executors run a plan lowered with it. Off (the default) prices them in
  // line.
  bool overlap_communication = false;
  // Gradients synchronised in bf16 (hap.v1 PlanOptions.gradient_precision
  // BF16): priced at half the bytes (SearchOptions::gradient_wire_scale).
  bool bf16_gradients = false;
  bool zero_heuristic = false;
  // The search's weight on collectives that need not run once per
  // forward/backward (SearchOptions::async_price: replicated gradients'
  // all-reduce, ZeRO-3 gathers and reduce-scatters). A pipeline stage runs M
  // microbatches per gradient sync and searches at 1/M. The LP, the
  // candidates' comparison and the reported cost still price them in full.
  double search_async_price = 1.0;
  int max_joint_iterations = 4;
  // Budgets. Each search stops at max_states; max_seconds bounds the whole
  // planning (searches, LPs, the baselines and the snap to whole samples).
  // A budget that runs out returns the best plan found so far (a note in
  // PlanResult::notes says so), never an error, when one that fits is known.
  int64_t max_states = 2'000'000;
  double max_seconds = 60;
  bool ignore_memory = false;
  // Ratios snapped to whole samples of the batch (what the lowering runs),
  // the search's split moved by one sample where that is predicted faster.
  bool snap_ratios_to_batch = true;
  // A baseline's ratios instead of even (dp-even) or proportional to FLOP/s
  // (the others), one per device: e.g. data parallelism at the split a
  // synthesized plan chose, to tell the program's gain from the split's.
  // Ignored without a baseline.
  std::vector<double> baseline_ratios;
  OptimizerKind optimizer = OptimizerKind::kSgdMomentum;
  // Polled; once true, the planning ends with the best plan found (a note
  // says so; the baselines are then not compared), or Cancelled before any.
  std::function<bool()> cancelled;
  // states expanded (cumulative), best cost so far, joint iteration.
  std::function<void(int64_t, double, int)> progress;
};

// Where the planning time went (seconds).
struct PhaseSeconds {
  double search = 0;  // the joint loop's and the baselines' searches
  double lp = 0;      // ratio LPs
  double snap = 0;    // whole samples and one-sample moves
};

struct PlanResult {
  Program program;
  std::vector<double> ratios;         // per device (one segment)
  ProgramCost cost;                   // at `ratios`
  std::vector<int64_t> memory_bytes;  // per device, at `ratios`
  double synthesis_seconds = 0;
  int64_t states_expanded = 0;
  bool optimal = false;
  int joint_iterations = 0;
  std::string source;  // "search", or the baseline candidate that won
  PhaseSeconds phases;
  // What cut the planning short, for the user: a budget (states or seconds)
  // that ended a search, the LP, the loop, the baselines or the one-sample
  // moves; the plan is then the best found, not proven optimal.
  std::vector<std::string> notes;
};

// Errors: InvalidArgument for a NaN max_seconds or a search_async_price not
// finite and >= 0 (a max_seconds of 0 or less is a budget already spent:
// the best plan found, with a note); those of Synthesize and SolveRatioLp
// when no plan was found;
// ResourceExhausted "does not fit" naming the device and bytes when no
// candidate program has ratios that satisfy memory; DeadlineExceeded when the
// budget ran out before any plan that fits was found.
absl::StatusOr<PlanResult> PlanModel(const graph::Graph& g,
                                     const cost::ClusterModel& cluster,
                                     const PlanOptions& options);

// Memory per device as linear functions of the ratios: parameters, their
// gradients and optimizer state, and the activations kept for backward.
// `extra_gradients`: more copies of each trained parameter's gradient (a
// pipeline stage sums its microbatches' gradients in one more buffer).
ratios::MemoryConstraint MemoryModel(const graph::Graph& g, const cost::ClusterModel& cluster,
                                     const Program& p, OptimizerKind opt,
                                     double extra_gradients = 0);
// Bytes as an int64, saturating at INT64_MAX: the memory model's sums can
// pass 2^63 for graphs whose every tensor is addressable (a cast would be
// undefined).
int64_t ToBytes(double bytes);
std::vector<int64_t> MemoryAt(const ratios::MemoryConstraint& m,
                              const std::vector<double>& ratios);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_PLANNER_H_
