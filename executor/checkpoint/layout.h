// How checkpoints are laid out in a checkpoint directory, for the code that
// writes and reads them (checkpoint.h) and for the planner, which finds a
// job's latest complete checkpoint and sets a damaged one aside without
// reading any: "step-N" directories, complete once they hold COMMITTED;
// set-aside ones renamed with a prefix ("superseded-step-N", "damaged-step-N",
// then "-1", "-2", ... while taken), which nothing resumes from.
#ifndef HAP_EXECUTOR_CHECKPOINT_LAYOUT_H_
#define HAP_EXECUTOR_CHECKPOINT_LAYOUT_H_

#include <cstdint>
#include <map>
#include <string>
#include <system_error>

namespace hap::executor::checkpoint {

inline constexpr char kCommittedFile[] = "COMMITTED";
inline constexpr char kStepPrefix[] = "step-";
// Committed checkpoints of a run that a resumed run replaced (steps past
// the one it resumed from): set aside under this prefix, never deleted.
inline constexpr char kSupersededPrefix[] = "superseded-";
// A checkpoint an elastic job found damaged while resuming from it.
inline constexpr char kDamagedPrefix[] = "damaged-";

// "step-00000012".
std::string StepDirName(int64_t step);
// The step of a "step-N" name (N decimal digits only), or -1.
int64_t StepOf(const std::string& name);
// The committed checkpoints in `dir` by step (path). `error`, when given,
// receives why `dir` could not be listed whole, else is cleared.
std::map<int64_t, std::string> CommittedSteps(const std::string& dir,
                                              std::error_code* error = nullptr);
// A free path in `dir` for the checkpoint of `step` set aside under
// `prefix`: DIR/PREFIXstep-N, else DIR/PREFIXstep-N-1, -2, ...
std::string SetAsidePath(const std::string& dir, const std::string& prefix, int64_t step);

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_LAYOUT_H_
