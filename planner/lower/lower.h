// Lowering (docs/design.md §7): a synthesized forward program and its sharding
// ratios become one executable program per rank (hap.v1.RankProgram): a
// flat list of kernel and collective calls over buffers with concrete local
// shapes, in four phases — forward; backward in reverse order (each op's
// gradient kernel, the dual of every collective); gradient synchronisation
// as the program's parameter storage dictates (all-reduce of a partial
// gradient, SFB recomputation, reduce-scatter for ZeRO); and the optimizer
// update on the local shards, with clipping by the global norm across ranks.
//
// Semantics: running the n rank programs gives the loss and the updated
// parameters of the single-device program (SingleDeviceProgram on one rank)
// up to float rounding. How:
// - Shard lengths. Every sharded (tensor, dimension) belongs to the
//   dimension class of the rule applications that link it (a rule splits one
//   logical dimension: its S(d) inputs and outputs are the same split,
//   scaled by reshapes). A class with lengths L_k is cut in G = gcd(L_k)
//   units by RoundShardsAtLeastOne(G, ratios) = m; rank r holds L_k / G * m_r entries
//   of each member, contiguous, in rank order.
// - Gradient forms. The gradient of an S(d) buffer is S(d); of a P buffer,
//   R. The gradient of an R buffer is R when every contribution is whole on
//   every rank, else P; an R contribution into a P gradient is then added on
//   rank 0 only. A rule that adds an R operand once into a P result (the
//   bias of a row-parallel linear) reads it on rank 0 only (absent, i.e.
//   zero, elsewhere).
// - Randomness is keyed by global positions: dropout masks by
//   (seed, op name, step, global element index); initialisation by the
//   executor from (seed, parameter name, global index), using each buffer's
//   global shape and offsets.
// - A replicated parameter whose gradient ends partial is all-reduced even
//   where the program does not say so (the search's partial-gradient rule is
//   conservative only for split rules), so execution is always correct.
//
// Buffers reuse memory: each gets an offset in the rank's arena by lifetime
// (first and last step using it); parameters, optimizer state, inputs and
// the loss live throughout.
//
// No I/O; thread-compatible.
#ifndef HAP_PLANNER_LOWER_LOWER_H_
#define HAP_PLANNER_LOWER_LOWER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"
#include "planner/synth/program.h"

namespace hap::lower {

struct LowerOptions {
  // Per rank, summing to 1 (one segment). Empty: even.
  std::vector<double> ratios;
  int world_size = 1;
  std::vector<std::string> devices;  // optional, one per rank
  hap::v1::OptimizerConfig optimizer;  // learning_rate 0 is accepted
  // bf16 mixed precision (PlanOptions.precision BF16): the kernel calls of
  // linear, matmul, conv2d and conv3d (grouped ones excepted), forward and backward,
  // get attribute "bf16" (executor/cpu/kernels.h); buffers, parameters and
  // optimizer state stay float32.
  bool bf16 = false;
  // Gradients synchronised in bf16 (PlanOptions.gradient_precision BF16):
  // the gradient buckets' ALL_REDUCEs and ZeRO's gradient REDUCE_SCATTERs
  // get CollectiveCall.wire_dtype BFLOAT16; the loss is summed in fp32 in a
  // call of its own.
  bool bf16_gradients = false;
  uint64_t seed = 0;
  // Collectives behind compute (the plan's PlanOptions.overlap_communication,
  // priced by the planner's Program::overlap): the replicated gradients'
  // all-reduces go in buckets of `gradient_bucket_bytes`, filled in the
  // order backward completes them, each started (CollectiveCall.async) right
  // after backward completes its last gradient; ZeRO-3 parameters are
  // gathered one parameter-holding op ahead (forward and backward) and their
  // gradients' reduce-scatters started once complete. Every such collective
  // is waited for (a WaitCall step) just before the first step that touches
  // one of its buffers (the optimizer, for gradients), or at the end.
  // False: every collective in line, as before.
  bool overlap = false;
  // The buckets' size with `overlap` (Plan.gradient_bucket_bytes); 0 = the
  // in-line buckets' 64 MiB; negative is an error. A larger gradient gets a
  // bucket of its own.
  int64_t gradient_bucket_bytes = 0;
};

// The shard lengths of a tensor's sharded dimension on every rank (from
// the dimension classes); exposed for tests and the data loader.
struct ShardLayout {
  std::vector<int64_t> lengths;  // per rank
  std::vector<int64_t> offsets;  // per rank
};

// Errors: InvalidArgument for a program that does not belong to `g` (wrong
// number of steps, ops out of order, tensors not its own, a split along a
// dimension a tensor lacks), a world size below 1, ratios of the
// wrong size, negative or not summing to 1, devices neither none nor one per
// rank, a negative gradient bucket size; FailedPrecondition when a program's
// forms cannot be executed (a precondition that does not hold — run
// synth::CheckProgram first for a full diagnosis).
absl::StatusOr<std::vector<hap::v1::RankProgram>> Lower(
    const graph::Graph& g, const synth::Program& program,
    const LowerOptions& options);

// One pipeline stage (plan.proto PipelineStage): ops [begin_op, end_op)
// of `g` (the model at the microbatch size), the activation it receives
// (input, -1 for the first stage) and the one it sends (output, -1 for the
// stage holding the loss), in the forms the stage's program holds them.
struct StageSpec {
  int begin_op = 0, end_op = 0;
  graph::TensorId input = -1;
  synth::Form input_form = synth::Form::R();
  graph::TensorId output = -1;
  synth::Form output_form = synth::Form::R();
  // The loss gradient's seed is 1 / microbatches, so that the gradients
  // summed over the microbatches are the mean loss's.
  int microbatches = 1;
};

// Lowers a stage's program (its steps only: steps[k].op == begin_op + k)
// for the stage's group (options.world_size ranks, options.ratios) as Lower
// does, with these differences: the input is a STAGE_INPUT buffer (no
// load) whose gradient the end of backward copies to STAGE_INPUT_GRADIENT;
// the output is copied to STAGE_OUTPUT at the end of forward and its
// gradient's seed copied from STAGE_OUTPUT_GRADIENT at the start of
// backward (instead of the loss's); a stage without the loss has a LOSS
// buffer of 0; model inputs the stage reads but whose loads sit in other
// stages are loaded where first read; the clipping norm is all-reduced in
// the group even when every gradient is replicated (replicated ones counted
// on rank 0), so the pipeline runner can sum it over stages; with
// options.overlap the gradient buckets start during backward as Lower's do
// (the pipeline runner starts them in the last microbatch's backward), the
// loss stays out of them (summed in line after the last microbatch); SFB
// weights get their partial gradients all-reduced instead (SFB's
// gradients come from a whole step's gathered factors).
// Errors: those of Lower; InvalidArgument for a range or steps that do not
// match, an input or output produced on the wrong side of the cut, an input
// that no step reads in input_form, or a stage without output that does not
// compute the loss.
absl::StatusOr<std::vector<hap::v1::RankProgram>> LowerStage(
    const graph::Graph& g, const synth::Program& program, const StageSpec& stage,
    const LowerOptions& options);

// The single-device program: every op replicated, every parameter stored
// replicated; lowered with world_size 1 it is the reference run.
synth::Program SingleDeviceProgram(const graph::Graph& g);

}  // namespace hap::lower

#endif  // HAP_PLANNER_LOWER_LOWER_H_
