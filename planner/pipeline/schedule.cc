#include "planner/pipeline/schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace hap::pipeline {

int InFlightMicrobatches(int stage, int stages, int microbatches) {
  return std::max(1, std::min(stages - stage, microbatches));
}

absl::StatusOr<ScheduleResult> Simulate1F1B(const std::vector<StageTimes>& stages,
                                            int microbatches) {
  const int S = static_cast<int>(stages.size());
  const int M = microbatches;
  if (S < 1) return absl::InvalidArgumentError("a pipeline needs at least one stage");
  if (M < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a pipeline needs at least one microbatch, got ", M));
  }
  for (int s = 0; s < S; ++s) {
    const StageTimes& t = stages[s];
    for (double v : {t.forward, t.backward, t.send, t.gradient, t.sync}) {
      if (!std::isfinite(v) || v < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", s, " has a negative or non-finite time (", v, " s)"));
      }
    }
  }
  // Per stage its ops in 1F1B order: (is_backward, microbatch).
  std::vector<std::vector<std::pair<bool, int>>> order(S);
  for (int s = 0; s < S; ++s) {
    const int w = std::min(S - 1 - s, M);
    for (int m = 0; m < w; ++m) order[s].push_back({false, m});
    for (int m = w; m < M; ++m) {
      order[s].push_back({false, m});
      order[s].push_back({true, m - w});
    }
    for (int m = M - w; m < M; ++m) order[s].push_back({true, m});
  }
  const double kUnset = -1;
  // End times of compute, and of the arrivals at each stage.
  std::vector<std::vector<double>> fend(S, std::vector<double>(M, kUnset)),
      bend = fend, act_arrive = fend, grad_arrive = fend;
  std::vector<double> fwd_link_free(S, 0), bwd_link_free(S, 0), free_at(S, 0);
  std::vector<size_t> next(S, 0);
  size_t left = 0;
  for (const auto& o : order) left += o.size();
  while (left > 0) {
    bool progressed = false;
    for (int s = 0; s < S; ++s) {
      while (next[s] < order[s].size()) {
        auto [backward, m] = order[s][next[s]];
        double ready;
        if (!backward) {
          ready = s == 0 ? 0 : act_arrive[s][m];
        } else {
          ready = s == S - 1 ? fend[s][m] : grad_arrive[s][m];
        }
        if (ready == kUnset) break;
        const double start = std::max(free_at[s], ready);
        if (!backward) {
          fend[s][m] = start + stages[s].forward;
          free_at[s] = fend[s][m];
          if (s + 1 < S) {
            const double t0 = std::max(fend[s][m], fwd_link_free[s]);
            fwd_link_free[s] = t0 + stages[s].send;
            act_arrive[s + 1][m] = fwd_link_free[s];
          }
        } else {
          bend[s][m] = start + stages[s].backward;
          free_at[s] = bend[s][m];
          if (s > 0) {
            const double t0 = std::max(bend[s][m], bwd_link_free[s - 1]);
            bwd_link_free[s - 1] = t0 + stages[s - 1].gradient;
            grad_arrive[s - 1][m] = bwd_link_free[s - 1];
          }
        }
        ++next[s];
        --left;
        progressed = true;
      }
    }
    if (!progressed) return absl::InternalError("1F1B schedule deadlocked");
  }
  ScheduleResult r;
  double busiest = 0;
  for (int s = 0; s < S; ++s) {
    r.stage_finish.push_back(free_at[s] + stages[s].sync);
    r.step = std::max(r.step, r.stage_finish.back());
    busiest = std::max(busiest, M * (stages[s].forward + stages[s].backward) + stages[s].sync);
  }
  r.bubble = std::max(0.0, r.step - busiest);
  return r;
}

double ClosedForm1F1B(const std::vector<StageTimes>& stages, int microbatches) {
  double sum = 0, slowest = 0, sync = 0;
  for (const StageTimes& t : stages) {
    sum += t.forward + t.backward + t.send + t.gradient;
    slowest = std::max({slowest, t.forward + t.backward, t.send, t.gradient});
    sync = std::max(sync, t.sync);
  }
  return sum + (microbatches - 1) * slowest + sync;
}

}  // namespace hap::pipeline
