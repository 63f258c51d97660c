// The interpreter of a rank's executable program (plan.proto RankProgram):
// validates it, lays its buffers out in one device arena, initialises the
// parameters from the plan's seed (shard-invariant: a shard holds exactly
// its slice of the single-device tensor), and runs training steps — every
// kernel through the Device, every collective through the Communicator.
// Asynchronous collectives (CollectiveCall.async, completed by a WaitCall
// step) run behind the kernels through RunnerOptions::async when given, in
// line at their start otherwise.
//
// Thread-compatible: one thread drives a runner.
#ifndef HAP_EXECUTOR_RUNTIME_PROGRAM_RUNNER_H_
#define HAP_EXECUTOR_RUNTIME_PROGRAM_RUNNER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/async_collectives.h"
#include "executor/runtime/collective_call.h"
#include "executor/runtime/device.h"
#include "executor/runtime/tensor.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"

namespace hap::executor {

// A parameter's piece held by this rank.
struct ParameterShard {
  std::string name;
  Shape global_shape;
  std::vector<int64_t> offsets;  // where the piece starts, per dimension
  HostTensor value;
  bool optimizer_state = false;  // "<parameter>#momentum", "#adam_m", "#adam_v"
};

// The global batch of one step: one tensor per graph input, by name, with
// the single-device shape. Each rank takes its own slice.
using Batch = std::map<std::string, HostTensor>;

struct RunnerOptions {
  // Runs the program's asynchronous collectives behind compute (a
  // communication thread, NewCommThread); not owned, must outlive the
  // runner. Null: each runs in line at its start step, and its wait does
  // nothing (the same results, no overlap).
  AsyncCollectives* async = nullptr;
  // Test only: every started collective is held back until its wait (or
  // the end of the step), and its outputs that are not also its inputs are
  // filled with NaN at the start, so a step that reads them before the
  // wait reads poison, and one that reads an in-place result (a gradient
  // bucket) reads the value before the collective.
  bool test_hold_until_wait = false;
  // Test only: wait steps do nothing; held collectives run at the end of
  // the step (with test_hold_until_wait: a program whose waits are gone).
  bool test_skip_waits = false;
};

// The buffers `step` uses: a kernel's inputs and outputs (not the absent
// ones, -1), a collective's input, output and coalesced ones; none for a
// wait. Sorted, each once.
std::vector<int> StepBuffers(const hap::v1::Step& step);

class ProgramRunner {
 public:
  // Validates `program` against `graph` (the plan's model), the device and
  // the communicator's rank and size. InvalidArgument naming the buffer or
  // step that is wrong; ResourceExhausted when the arena does not fit.
  // `device` and `comm` must outlive the runner.
  static absl::StatusOr<std::unique_ptr<ProgramRunner>> Create(const hap::v1::RankProgram& program,
                                                               const graph::Graph& graph,
                                                               Device* device, Communicator* comm,
                                                               const RunnerOptions& options = {});
  ~ProgramRunner();

  // Parameters from their initialisers and the program's seed; optimizer
  // state to zero.
  absl::Status InitializeParameters();

  // One training step (0-based `step`): forward, backward, gradient
  // synchronisation, optimizer update. Returns the loss of the step (the
  // single-device loss, before the update). InvalidArgument for a batch
  // that lacks an input or has the wrong shape or dtype.
  absl::StatusOr<double> RunStep(const Batch& batch, int64_t step);

  // This rank's parameter pieces (copied to the host).
  absl::StatusOr<std::vector<ParameterShard>> Parameters() const;
  // Parameters and optimizer state: every persistent buffer (a checkpoint).
  absl::StatusOr<std::vector<ParameterShard>> PersistentState() const;
  // Sets every persistent buffer (parameters and optimizer state) from
  // `fill`, which gets the buffer and a host tensor of its local shape and
  // dtype to fill (a restore; instead of InitializeParameters). The first
  // error of `fill` is returned, annotated with the buffer.
  // With `select`, only the buffers it accepts are set; the rest keep
  // their values.
  absl::Status SetPersistentState(
      const std::function<absl::Status(const hap::v1::Buffer&, HostTensor&)>& fill,
      const std::function<bool(const hap::v1::Buffer&)>& select = nullptr);
  // The seed of dropout keys (and initialisers) from now on: a resumed run
  // keeps the seed its checkpoint was trained with. Rewrites the dropout
  // kernels' rng_key attributes as the lowering derives them.
  void OverrideSeed(uint64_t seed);

  // Piecewise execution, for the pipeline runner (executor/train/pipeline.h),
  // which drives the phases of a stage's program per microbatch itself:
  // BeginSteps before a training step's first RunSteps (what a failed
  // step left running finishes first), LoadBatch fills the INPUT buffers
  // (as RunStep does), RunSteps runs steps [begin, end) for training step
  // `step` as RunStep does (asynchronous collectives started through
  // RunnerOptions::async, waited for at their wait steps), EndSteps after
  // the last completes every collective still running; buffer(id) is a
  // buffer's memory on the device.
  absl::Status BeginSteps(int64_t step);
  absl::Status LoadBatch(const Batch& batch) { return LoadInputs(batch); }
  absl::Status RunSteps(int begin, int end, int64_t step);
  absl::Status EndSteps(int64_t step);
  const TensorView& buffer(int id) const { return views_[id]; }
  Device& device() const { return *device_; }
  // Microbatch m of `microbatches` (equal parts of the batch along dimension
  // 0): dropout masks are keyed by the whole batch's element indices, so
  // each sample keeps the mask it has in the single-device program. The
  // dropout kernels' global_shape[0] is scaled by `microbatches` and their
  // offsets[0] moved to the microbatch's rows. (0, 1): as lowered.
  void SetMicrobatch(int m, int microbatches);

  const hap::v1::RankProgram& program() const { return program_; }
  Communicator& comm() const { return *comm_; }

 private:
  ProgramRunner(const hap::v1::RankProgram& program, const graph::Graph& graph, Device* device,
                Communicator* comm, const RunnerOptions& options);
  absl::Status Validate();
  // Runs collective step i with `comm` and `staging`.
  absl::Status RunCollectiveStep(int i, Communicator& comm, Staging& staging);
  absl::Status StartAsync(int i);
  absl::Status WaitAsync(int start);
  absl::Status FinishAsync();
  absl::Status LoadInputs(const Batch& batch);
  absl::Status RunKernelStep(int index, const hap::v1::KernelCall& k,
                             int64_t step);

  hap::v1::RankProgram program_;
  const graph::Graph& graph_;
  Device* device_;
  Communicator* comm_;
  Staging staging_;
  void* arena_ = nullptr;
  std::vector<TensorView> views_;          // per buffer
  std::vector<graph::Attrs> attrs_;        // per step (kernels)
  RunnerOptions options_;
  std::map<int, bool> held_;  // test_hold_until_wait: started, not yet run
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_PROGRAM_RUNNER_H_
