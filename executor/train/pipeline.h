// Pipeline execution (issue 17 item 3): every rank belongs to one stage's
// group and runs that stage's program (planner/lower LowerStage, on the
// model at the microbatch size) once per microbatch in 1F1B order, as
// planner/pipeline/schedule.h prices it: stage s of S runs
// w = min(S - 1 - s, M) warm-up forwards, then M - w (forward, backward)
// pairs, then w backwards.
//
// Per microbatch m (rows [m B/M, (m+1) B/M) of every input of the global
// batch B; dropout masks keyed by the whole batch's indices, so each sample
// sees its single-device mask):
//   forward   the stage input arrives from the previous stage; the
//             program's FORWARD steps; the output leaves for the next stage;
//             the buffers backward reads are set aside (host copies),
//   backward  they come back; the output's gradient arrives from the next
//             stage; the BACKWARD steps (the loss's gradient seeded with
//             1/M); the input's gradient leaves for the previous stage; the
//             buffers gradient synchronisation reads (parameter gradients,
//             this rank's loss part) are added to host accumulators.
// After the last backward: the sums go back, the program's GRADIENT_SYNC
// steps run once on its group (its own communicator), then OPTIMIZER. A
// program lowered with overlap starts its gradient buckets during backward
// (CollectiveCall.async, waited for before the optimizer): those starts are
// left out of every microbatch's backward but the last, where each runs as
// soon as the backward completed its gradients, after the sums over the
// earlier microbatches are added into them; so the stage's gradient
// synchronisation runs behind its last backward, on the communication
// thread (RunnerOptions::async) with the group's second communicator. A

// clipping norm is summed over the stages on the world communicator
// (counted on each group's rank 0). The loss (the mean over microbatches =
// the single-device loss) is broadcast from the last stage so every rank
// reports it.
//
// Transfers between stages go over the world communicator's point-to-point
// Send/Recv on host copies (Gloo; a CUDA group may use NCCL inside itself):
// every rank of the sending group sends every rank of the receiving group
// its piece (a slice, a partial sum, or from rank 0 alone a replicated
// tensor; PipelineLayout's pieces say which), the receiver assembles the
// whole tensor and takes the piece its own form holds. Without the pieces
// every sender sends its contribution to the whole tensor (its slice in
// place, zeros elsewhere), which the receiver sums. Sends are asynchronous
// (completed before the gradient synchronisation), receives blocking, so
// the 1F1B order cannot deadlock.
//
// Thread-compatible: one thread drives a PipelineRunner.
#ifndef HAP_EXECUTOR_TRAIN_PIPELINE_H_
#define HAP_EXECUTOR_TRAIN_PIPELINE_H_

#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/program_runner.h"
#include "executor/runtime/tensor.h"
#include "executor/train/trainer.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"

namespace hap::executor {

// Which world ranks form each stage's group, in group-rank order.
struct PipelineLayout {
  std::vector<std::vector<int>> stage_ranks;
  int microbatches = 1;
  // The step clips gradients by their global norm (the optimizer's
  // clip_global_norm > 0): the norm is then summed over the stages.
  bool clip = false;
  // What each rank of each stage holds of the tensors it sends: its output
  // (STAGE_OUTPUT) and its input's gradient (STAGE_INPUT_GRADIENT), per
  // stage and group rank (AddBoundaryPieces). With them a sender sends only
  // its piece (nothing off rank 0 of a replicated form) and the receiver
  // places it; without them (empty) every sender sends its contribution to
  // the whole tensor.
  struct Piece {
    int kind = 0;  // hap.v1.TensorForm.Kind
    std::vector<int64_t> offsets, shape;
  };
  std::vector<std::vector<Piece>> output_pieces, input_grad_pieces;
};

// Fills layout.output_pieces and input_grad_pieces from every rank's
// program (programs[r] = world rank r's). InvalidArgument when a program
// is missing or a stage's ranks disagree about having the buffer.
absl::Status AddBoundaryPieces(PipelineLayout& layout,
                               const std::vector<hap::v1::RankProgram>& programs);

// The layout of a pipeline plan (Plan.pipeline; world rank r = device
// Plan.devices(r)); InvalidArgument when a device is in no stage or two.
absl::StatusOr<PipelineLayout> PipelineLayoutOf(const hap::v1::Plan& plan);

// The (stage, rank in its group) of world rank `rank`; InvalidArgument when
// the layout does not hold it exactly once.
absl::StatusOr<std::pair<int, int>> StageOf(const PipelineLayout& layout, int rank);

// What a rank of a pipeline plan needs besides its program (hap-launch and
// the executor daemon alike): the layout with its boundary pieces, the model
// at the microbatch size (its stage program's graph), its stage, and its
// rank and size in the stage's group.
struct PipelineRank {
  PipelineLayout layout;
  graph::Graph micro;
  int stage = 0;
  int group_rank = 0;
  int group_size = 1;
};
// `g` is the plan's model at the global batch.
absl::StatusOr<PipelineRank> PipelineRankOf(const hap::v1::Plan& plan, const graph::Graph& g,
                                            int rank);
// Gloo options of the communicator of every rank (the stages' transfers, a
// checkpoint's commit) and of the rank's stage group, from the rank's own.
GlooOptions PipelineWorldOptions(const GlooOptions& rank_options);
GlooOptions PipelineGroupOptions(const GlooOptions& rank_options, const PipelineRank& at);

// The 1F1B order of stage `stage`: +m+1 is the forward of microbatch m,
// -(m+1) its backward.
std::vector<int> OneFOneBOrder(int stage, int stages, int microbatches);

// Microbatch m of `microbatches` of a global batch: every input's rows
// [m n / M, (m+1) n / M) along dimension 0. InvalidArgument when M does not
// divide an input's dimension 0.
absl::StatusOr<Batch> MicroBatch(const Batch& batch, int m, int microbatches);

class PipelineRunner {
 public:
  // `runner` runs this rank's stage program on its group's communicator;
  // `world` connects every rank of the layout (rank() = the world rank).
  // Both must outlive this. InvalidArgument when the program is not a
  // stage program the layout can drive (phases out of order, buffers that
  // cross from forward into the optimizer, boundary buffers missing or
  // present against the stage's position), and when the stage normalises
  // with batch_norm and the layout has more than one microbatch (its
  // statistics would be each microbatch's, not the batch's).
  static absl::StatusOr<std::unique_ptr<PipelineRunner>> Create(ProgramRunner* runner,
                                                                Communicator* world,
                                                                const PipelineLayout& layout);

  ~PipelineRunner();
  PipelineRunner(const PipelineRunner&) = delete;
  PipelineRunner& operator=(const PipelineRunner&) = delete;

  // One training step on the global batch; returns the single-device loss.
  absl::StatusOr<double> RunStep(const Batch& batch, int64_t step);

  int stage() const { return stage_; }

 private:
  PipelineRunner(ProgramRunner* runner, Communicator* world, const PipelineLayout& layout)
      : runner_(runner), world_(world), layout_(layout) {}
  absl::Status Analyze();
  // The layout's boundary pieces (when it has them) describe what this rank
  // receives: every rank of the sending stage, each piece inside the tensor,
  // the whole of it for a replicated or partial form.
  absl::Status CheckPieces() const;
  absl::Status Forward(const Batch& batch, int m, int64_t step);
  absl::Status Backward(int m, int64_t step);
  // Steps [forward_end_, backward_end_): the deferred starts left out, or
  // on the last microbatch started after the sums are folded in.
  absl::Status RunBackwardSteps(bool last_microbatch, int64_t step);
  absl::Status Finish(int64_t step, double* loss);
  // Sends buffer `id` (this stage's form) to every rank of stage `to`.
  absl::Status SendWhole(int id, int to, int64_t tag);
  // Receives the whole tensor from every rank of stage `from` into buffer
  // `id`'s piece.
  absl::Status ReceiveInto(int id, int from, int64_t tag);
  absl::StatusOr<HostTensor> Read(int id);
  absl::Status Write(int id, const HostTensor& t);
  // Gradient accumulation on the device: after a microbatch that is not
  // the last, its gradients into sums_ (copied by the first, added after);
  // SumInto(k) adds sums_[k] into accumulate_ids_[k]'s buffer (the last
  // microbatch's gradient), which then holds the step's sum.
  absl::Status AccumulateMicrobatch();
  absl::Status SumInto(size_t k);
  // A device buffer shaped as `like`, freed with the runner.
  absl::StatusOr<TensorView> AllocateLike(const TensorView& like);
  ProgramRunner* runner_;
  Communicator* world_;
  PipelineLayout layout_;
  int stage_ = 0, group_rank_ = 0;
  int forward_end_ = 0, backward_end_ = 0, norm_step_ = -1;
  int stage_in_ = -1, stage_out_ = -1, out_grad_ = -1, in_grad_ = -1, norm_ = -1;
  std::vector<int> stash_ids_, accumulate_ids_;
  // Gradient synchronisations a program lowered with overlap starts during
  // backward and waits for after it (LowerOptions::overlap): step index ->
  // the indices into accumulate_ids_ of the buffers it reads. They run once
  // per step, started in the last microbatch's backward once the sums over
  // the earlier microbatches are added in.
  std::map<int, std::vector<size_t>> deferred_;
  // Per accumulate_ids_: device buffers of its shape, allocated by the
  // first step that needs them and kept (a microbatch's forward may reuse
  // a gradient buffer's memory, so the sums cannot stay in place).
  std::vector<TensorView> sums_;
  bool summed_ = false;      // this step's sums_ hold the earlier microbatches
  std::vector<void*> owned_;  // device memory of sums_ and stash_slots_
  std::vector<bool> folded_;  // per accumulate_ids_: sum in place
  // The forward buffers a microbatch's backward needs, kept on the device
  // while it is in flight: microbatch -> its slot in stash_slots_ (one
  // device buffer per stash_ids_); slots are reused, by later microbatches
  // and steps, and freed with the runner.
  std::map<int, size_t> stash_;
  std::vector<std::vector<TensorView>> stash_slots_;
  std::vector<size_t> free_stash_slots_;
  std::vector<HostTensor> pending_sends_;         // until WaitSends
  double loss_sum_ = 0;
};

// Runs every rank of a pipeline as threads of this process (tests,
// benchmarks): rank r runs programs[r] (its stage's program for its rank in
// the group) on a CPU device, with a Gloo world communicator and one for
// its stage's group, over a file rendezvous in options.rendezvous_dir.
// `microbatch_graph` is the model at the microbatch size; batches(r) gives
// rank r the global batches. Returns every rank's result (the losses are
// the pipeline's, every rank the same), or the first rank's error.
absl::StatusOr<std::vector<TrainResult>> RunLocalPipeline(
    const std::vector<hap::v1::RankProgram>& programs, const graph::Graph& microbatch_graph,
    const PipelineLayout& layout,
    const std::function<std::unique_ptr<data::BatchSource>(int rank)>& batches,
    const TrainOptions& train, const LocalRanksOptions& options);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_TRAIN_PIPELINE_H_
