// What a TrainingConfig must hold before anything runs it, checked alike
// by the planner (DeployPlan, before a deployment is made) and by each
// executor (LoadPlan): InvalidArgument naming the field and the value.
#ifndef HAP_COMMON_TRAINING_CHECKS_H_
#define HAP_COMMON_TRAINING_CHECKS_H_

#include "absl/status/status.h"
#include "hap/v1/planner_service.pb.h"

namespace hap {

// The most threads a rank may ask for (as the executors' --threads: a pool,
// and OpenBLAS's and OpenMP's, of that many is made).
inline constexpr int kMaxThreadsPerRank = 4096;

// steps >= 0 (0: the planner's default), threads_per_rank 0 (the
// executor's --threads) to kMaxThreadsPerRank, checkpoint_every and
// checkpoint_keep >= 0, log_every >= 0, a known data source, resume and init_weights not
// both, shuffle only with data_spec.
absl::Status CheckTrainingConfig(const hap::v1::TrainingConfig& t);

// CheckTrainingConfig, and no field given that nothing would read: a new
// request's (DeployPlan, CreateJob), not a stored job's, which was taken
// before. data_path only with data WIKITEXT2 and no data_spec (it was
// ignored: '--data npy:D --data-path X' trained on D); checkpoint_every and
// checkpoint_keep only with a checkpoint_dir (nothing is saved without one).
absl::Status CheckNewTrainingConfig(const hap::v1::TrainingConfig& t);

}  // namespace hap

#endif  // HAP_COMMON_TRAINING_CHECKS_H_
