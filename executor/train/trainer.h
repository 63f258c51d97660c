// Training loops over rank programs: TrainRank drives one rank (the
// executor binary and daemon use it); RunLocalRanks runs every rank of a
// plan as threads of this process, each with its own CPU device and Gloo
// communicator over a file rendezvous on 127.0.0.1 (tests, benchmarks).
#ifndef HAP_EXECUTOR_TRAIN_TRAINER_H_
#define HAP_EXECUTOR_TRAIN_TRAINER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "executor/comm/communicator.h"
#include "executor/data/batches.h"
#include "executor/runtime/device.h"
#include "executor/runtime/program_runner.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"

namespace hap::executor {

struct TrainOptions {
  int64_t steps = 1;
  int64_t first_step = 0;
  // Called after every step on the calling thread.
  std::function<void(int64_t step, double loss, double seconds)> on_step;
  // Polled before every step; true stops training (Cancelled).
  std::function<bool()> cancelled;
  // Sets the parameters and optimizer state before the first step (a resume
  // from a checkpoint, or starting weights); empty: the graph's
  // initialisers (ProgramRunner::InitializeParameters).
  std::function<absl::Status(ProgramRunner&)> initialize;
  // Called after every step (after on_step) with the global number of steps
  // done; an error stops training (a checkpoint that did not save).
  std::function<absl::Status(ProgramRunner&, int64_t steps_done)> after_step;
  // Copies every parameter to the host into TrainResult::parameters after
  // the last step (tests compare them). False leaves them empty: a caller
  // that does not read them (the executor daemon) skips a device-to-host
  // copy of the whole model, whose failure would fail a run that had
  // finished every step and saved its checkpoint.
  bool return_parameters = true;
};

struct TrainResult {
  std::vector<double> losses;        // per step
  std::vector<double> step_seconds;  // per step, wall time
  std::vector<ParameterShard> parameters;  // after the last step (return_parameters)
};

// Initialises the parameters and trains. A loss that is not finite stops
// training with Aborted naming the step (the steps before it are in the
// error's context only; the parameters are left as they are).
absl::StatusOr<TrainResult> TrainRank(ProgramRunner& runner,
                                      data::BatchSource& batches,
                                      const TrainOptions& options);

// TrainRank with every step run by `run_step` (a pipeline's) instead of
// runner.RunStep; `runner` initialises and gives the parameters.
absl::StatusOr<TrainResult> TrainRankWith(
    ProgramRunner& runner,
    const std::function<absl::StatusOr<double>(const Batch&, int64_t)>& run_step,
    data::BatchSource& batches, const TrainOptions& options);

struct LocalRanksOptions {
  std::string rendezvous_dir;  // a fresh directory
  int threads_per_rank = 1;
  absl::Duration timeout = absl::Seconds(60);
  std::string prefix = "hap";
  // Makes rank r's communicator; empty: Gloo over a file store in
  // rendezvous_dir. Called on rank r's thread.
  std::function<absl::StatusOr<std::unique_ptr<Communicator>>(int rank)> connect;
  // The runners' options. With Gloo (no `connect`), a program with
  // asynchronous collectives gets a communication thread with a second
  // Gloo context (ConnectOverlap), unless `overlap` is false: they then
  // run in line.
  RunnerOptions runner;
  bool overlap = true;
  // RunLocalPipeline (pipeline.h): senders send only their pieces
  // (AddBoundaryPieces); false: contributions to the whole tensor.
  bool pipeline_pieces = true;
};

// Runs rank r's program on thread r. Each rank's batches come from
// `batches(r)`. Returns every rank's result, or the first rank's error.
absl::StatusOr<std::vector<TrainResult>> RunLocalRanks(
    const std::vector<hap::v1::RankProgram>& programs, const graph::Graph& g,
    const std::function<std::unique_ptr<data::BatchSource>(int rank)>& batches,
    const TrainOptions& train, const LocalRanksOptions& options);

// The single-device tensors of every parameter, assembled from the pieces
// of all ranks. InvalidArgument when pieces disagree in shape or leave
// elements uncovered; DataLoss when copies of an element (replicas) differ
// in any bit: the run's state diverged, not the pieces' layout.
absl::StatusOr<std::map<std::string, HostTensor>> AssembleParameters(
    const std::vector<std::vector<ParameterShard>>& per_rank);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_TRAIN_TRAINER_H_
