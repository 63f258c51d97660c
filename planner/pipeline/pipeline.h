// Pipeline x SPMD planning (issue 17 item 2): the layer sequence (layers.h)
// cut into stages, each stage on a group of devices running its own
// synthesized SPMD program with LP ratios, microbatches in a 1F1B schedule
// (schedule.h).
//
// Groups are contiguous runs of units in the cluster's node order; a unit is
// a node, or a part of one (down to a single device) when more stages are
// asked for than there are nodes. A stage may be one device: its program is
// then the single-device program of its layers. For every distinct group (same devices and links up
// to naming) and microbatch count M, the planner synthesizes the whole model at the microbatch size
// on the group (synth::PlanModel: the block search and the ratio LP) and prices each layer from
// that program's steps:
//   micro(l)  the layer's forward and backward per microbatch (activation
//             collectives, ZeRO-3 gathers, SFB included), EvaluateProgram of
//             the layer's steps without gradient sync, updates and overhead;
//   sync(l)   its gradient all-reduces (64 MiB buckets), ZeRO-2 gathers and
//             reduce-scatters and optimizer updates, once per step (with
//             overlap a stage's sync is priced whole instead: what of it
//             outlasts its last microbatch's backward, the buckets started
//             as that backward completes their gradients);
//   memory    parameters, gradients and optimizer state, one more copy of
//             the gradients (their sums over microbatches, when M > 1), and
//             activations: the microbatch being run plus one stashed copy
//             for every in-flight microbatch (1F1B: min(S - s, M) at stage
//             s), as executor/train/pipeline.h holds them.
// Transfers between stages: the boundary activation's bytes over the
// slowest link between the two groups (plus the cluster's calibrated
// pipeline_transfer_overhead_seconds per transfer), plus re-sharding inside
// a group (the sender reduces a partial form; a receiver holding it
// replicated broadcasts it inside its group; the gradient dually).
//
// The search is a DP over (layers, units, stages) per candidate bottleneck
// t_max, as Alpa's stage DP: minimise the sum over stages of f + b +
// transfers (+ mean sync) subject to every stage's f + b and transfers
// <= t_max and memory fitting; the objective adds (M - 1) t_max. Every
// (M, S, t_max) solution is re-priced with the exact schedule
// (Simulate1F1B) and the best kept; the chosen stages then get their own
// ratio LP (M microbatches + sync) and keep it when faster.
//
// Variants in the same cost model (the baselines of issue 17 item 4):
//   kSynthesized     the above (pipeline x SPMD)
//   kDataParallel    data parallelism inside stages at proportional ratios,
//                    uneven layer split by the same DP (Metis-style DP x PP)
//   kEvenSplit       one stage per unit, equal numbers of layers, data
//                    parallelism at equal ratios (GPipe / 1F1B as usual)
// and the best SPMD plan (one stage, today's search) for comparison.
//
// Thread-safety: PlanPipeline is thread-safe; it runs the per-group
// syntheses on up to `threads` threads.
#ifndef HAP_PLANNER_PIPELINE_PIPELINE_H_
#define HAP_PLANNER_PIPELINE_PIPELINE_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph.h"
#include "planner/pipeline/schedule.h"
#include "planner/synth/planner.h"

namespace hap::pipeline {

enum class Mode { kOff, kAuto, kStages };
enum class Variant { kSynthesized, kDataParallel, kEvenSplit };
const char* VariantName(Variant v);

struct PipelineOptions {
  Mode mode = Mode::kAuto;
  int stages = 0;        // kStages: exactly this many (>= 1)
  // 0: chosen among one divisor of the batch per octave from 2 to
  // max_microbatches, the largest in each of 2, 3-4, 5-8, 9-16, ... (a
  // power of two where it divides; 20 samples: 2, 4, 5, 10, 20 at most
  // 32); kStages with none: 1.
  int microbatches = 0;
  int max_microbatches = 64;
  int max_layers = 32;  // layers the DP cuts between (layers.h); kStages: >= stages
  Variant variant = Variant::kSynthesized;
  // The per-group syntheses (budgets apply to each); the SPMD comparison
  // uses it as given.
  synth::PlanOptions stage_options;
  int threads = 0;  // 0: the hardware's
  // The clock stage_options.max_seconds is measured on (steady_clock::now
  // when empty); tests inject one. Called from the planning's threads.
  std::function<std::chrono::steady_clock::time_point()> now;
  // Skip the one-stage SPMD plan (kStages with stages > 1 only needs it for
  // the comparison figure; benchmarks plan it once themselves).
  bool plan_spmd = true;
};

struct StagePlan {
  int first_layer = 0, end_layer = 0;  // layers [first, end)
  int begin_op = 0, end_op = 0;        // ops [begin, end)
  std::vector<int> devices;            // indices into the cluster
  synth::Program program;              // the stage's steps only
  std::vector<double> ratios;          // per device of the group
  graph::TensorId input_tensor = -1;   // in `microbatch_graph`; -1 at the ends
  graph::TensorId output_tensor = -1;
  synth::Form input_form, output_form;
  StageTimes times;
  int in_flight = 1;
  std::vector<int64_t> memory_bytes;  // per device of the group
};

struct PipelinePlan {
  Variant variant = Variant::kSynthesized;
  std::vector<StagePlan> stages;  // empty: the SPMD plan is the plan
  int microbatches = 1;
  int64_t microbatch_size = 0;
  std::shared_ptr<const graph::Graph> microbatch_graph;
  double step_seconds = 0;  // Simulate1F1B
  double bubble_seconds = 0;
  // The best one-stage SPMD plan (PlanModel on the whole cluster).
  bool has_spmd = false;
  synth::PlanResult spmd;
  double spmd_step_seconds = 0;
  // Stage gradient synchronisation overlapped with the last microbatch's
  // backward (stage_options.overlap_communication): StageTimes::sync is
  // then only what outlasts that backward, and the stages' rank programs
  // start their gradient buckets during it.
  bool overlap = false;
  int layers = 0;     // the DP's layer count
  int syntheses = 0;  // PlanModel runs (groups x microbatch counts)
  double planning_seconds = 0;
  std::vector<std::string> notes;
  bool pipelined() const { return stages.size() > 1; }
};

// Errors: InvalidArgument for bad options (kStages with stages < 1, more
// stages than layers, microbatches that do not divide the batch) and those
// of PlanModel for the SPMD plan (its ResourceExhausted only when no
// pipeline is found either: a pipeline that fits is planned without it);
// FailedPrecondition when no pipeline of the asked stage count fits (naming
// why); DeadlineExceeded when stage_options.max_seconds ran out before one
// was priced (auto: the SPMD plan with a note, when there is one);
// Cancelled once stage_options.cancelled is true. The budget and the
// cancellation are polled by the syntheses, between the stage search's DPs
// and before each chosen stage's ratio LP; a budget that runs out during
// the search leaves the best pipeline priced by then, with a note.
absl::StatusOr<PipelinePlan> PlanPipeline(const graph::Graph& g, const cost::ClusterModel& cluster,
                                          const PipelineOptions& options);

}  // namespace hap::pipeline

#endif  // HAP_PLANNER_PIPELINE_PIPELINE_H_
