// What the checkpoint tests share: a small MLP, its rank programs, fresh
// directories, and training with checkpoints over the in-process
// communicator (ranks are threads).
#ifndef HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_TEST_UTIL_H_
#define HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/train/trainer.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"

namespace hap::executor::checkpoint::test_util {

// A 2-layer MLP (input 12, 5 classes, batch 9) of `hidden` units.
graph::Graph Mlp(int hidden = 24);

// `g` lowered for `n` ranks at even ratios as a program of `kind`
// (test_programs' kinds), SGD (with momentum) or Adam, seed 5.
std::vector<hap::v1::RankProgram> Programs(const graph::Graph& g, int n, const std::string& kind,
                                           bool momentum = true, bool adam = false);

// TEST_TMPDIR/name, removed first.
std::string Fresh(const std::string& name);

// Trains `to.steps` steps from `to.first_step` with the in-process communicator.
absl::StatusOr<std::vector<TrainResult>> Train(const graph::Graph& g,
                                               const std::vector<hap::v1::RankProgram>& programs,
                                               const TrainOptions& to);

// Trains `steps` steps (from `first_step`, resuming from `resume` when
// given), saving as `policy` says.
absl::StatusOr<std::vector<TrainResult>> TrainAndSaveFrom(
    const graph::Graph& g, const std::vector<hap::v1::RankProgram>& programs,
    CheckpointPolicy policy, int64_t first_step, int64_t steps, const std::string& resume = "");

// Saves after every step of `steps` from step 0, keeping `keep`.
std::vector<TrainResult> TrainAndSave(const graph::Graph& g,
                                      const std::vector<hap::v1::RankProgram>& programs,
                                      const std::string& dir, int steps, int keep);

// Flips a bit of the last byte of the safetensors file `path` (a shard, an
// export): the last tensor's data, size and header intact. Returns that
// tensor's name.
std::string FlipTheLastByte(const std::string& path);

// The names in `dir`, sorted.
std::vector<std::string> Entries(const std::string& dir);

// This rank's persistent state as SaveCheckpoint takes it (zeros).
std::vector<ParameterShard> StateOf(const hap::v1::RankProgram& p);

// Every rank of `programs` saves `step` (threads over the in-process
// communicator), rank r with `states[r]` when given; each rank's result.
// `after_barrier(rank, k)`, when given, runs on `rank` once its k-th
// barrier (1, 2, ...) returned.
std::vector<absl::StatusOr<std::string>> SaveOnEveryRank(
    const std::vector<hap::v1::RankProgram>& programs, const std::string& dir, int64_t step,
    int keep = kDefaultKeep, std::vector<std::vector<ParameterShard>> states = {},
    int64_t replaces_after = -1, std::function<void(int rank, int k)> after_barrier = nullptr);

}  // namespace hap::executor::checkpoint::test_util

#endif  // HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_TEST_UTIL_H_
