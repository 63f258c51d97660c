// The 1F1B pipeline schedule as the cost model prices it (issue 17 item 2).
//
// S stages, M microbatches. Stage s runs, per microbatch, a forward of
// forward[s] seconds and a backward of backward[s]; between stage s and s+1
// the activation travels forward (send[s] seconds on the link s -> s+1) and
// its gradient back (gradient[s] on the link s+1 -> s). Each link direction
// carries one transfer at a time, in microbatch order, beside the compute
// (sends are asynchronous). Stage s runs in 1F1B order: w = min(S-1-s, M)
// forwards (warm-up), then M-w pairs (forward, backward), then w backwards.
//   F(s,m) starts when stage s is free and the activation of microbatch m
//          arrived (s > 0);
//   B(s,m) starts when stage s is free and the gradient of m arrived from
//          stage s+1 (s < S-1; the last stage's follows its own forward).
// After its last backward a stage synchronises its gradients and updates
// (sync[s]); the step ends when every stage has. Simulate1F1B computes
// these times exactly.
//
// The closed form the stage search uses (exact for equal stages without
// transfers or sync, where it is (M + S - 1)(f + b)):
//   T = sum_s (f_s + b_s) + sum_s (send_s + gradient_s)
//       + (M - 1) max_s max(f_s + b_s, send_s, gradient_s) + max_s sync_s
//
// Thread-safety: pure functions.
#ifndef HAP_PLANNER_PIPELINE_SCHEDULE_H_
#define HAP_PLANNER_PIPELINE_SCHEDULE_H_

#include <vector>

#include "absl/status/statusor.h"

namespace hap::pipeline {

struct StageTimes {
  double forward = 0;  // seconds per microbatch
  double backward = 0;
  double send = 0;      // activation to the next stage (0 for the last)
  double gradient = 0;  // its gradient back from the next stage
  double sync = 0;      // once per step, after the last backward
};

struct ScheduleResult {
  double step = 0;
  // step - the busiest stage's own work, M (f + b) + sync: time some stage
  // idles for a dependency.
  double bubble = 0;
  std::vector<double> stage_finish;  // per stage, sync included
};

// InvalidArgument for no stage, M < 1, or a negative or non-finite time.
absl::StatusOr<ScheduleResult> Simulate1F1B(const std::vector<StageTimes>& stages,
                                            int microbatches);
double ClosedForm1F1B(const std::vector<StageTimes>& stages, int microbatches);

// Microbatches of activations stage `stage` of `stages` holds at most under
// 1F1B: min(stages - stage, microbatches).
int InFlightMicrobatches(int stage, int stages, int microbatches);

}  // namespace hap::pipeline

#endif  // HAP_PLANNER_PIPELINE_SCHEDULE_H_
