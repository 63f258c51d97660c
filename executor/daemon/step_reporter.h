// Sends step metrics to the planner without ever blocking training: Push
// puts a metric in a bounded queue (dropping it, and counting the drop,
// when the queue is full because the planner is slow or away); one thread
// sends what is queued in batches.
//
// Thread-safe. The destructor stops the thread after one last send.
#ifndef HAP_EXECUTOR_DAEMON_STEP_REPORTER_H_
#define HAP_EXECUTOR_DAEMON_STEP_REPORTER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::executor {

struct StepReporterOptions {
  // Sends one batch (ReportStepMetrics); called on the reporter's thread
  // only. A failed batch is dropped and counted, not retried: metrics are
  // telemetry, and a retry would only make a slow planner slower.
  std::function<absl::Status(const std::vector<hap::v1::StepMetric>&)> send;
  size_t capacity = 1024;  // queued metrics at most
  size_t max_batch = 256;  // metrics per send at most
  // Where failures go (default stderr): the first failed send, then nothing
  // until a send succeeds again, which says how many were lost meanwhile,
  // in failed sends and dropped from the full queue (a planner away for an
  // hour is two lines, not one per step).
  std::function<void(const std::string&)> log;
};

class StepReporter {
 public:
  explicit StepReporter(StepReporterOptions options);
  ~StepReporter();
  StepReporter(const StepReporter&) = delete;
  StepReporter& operator=(const StepReporter&) = delete;

  // Never blocks. False when the metric was dropped (queue full).
  bool Push(hap::v1::StepMetric metric);

  // Waits until everything pushed so far has been sent (or has failed), or
  // `deadline` passes. True when the queue drained.
  bool Flush(absl::Time deadline);

  struct Counters {
    int64_t sent = 0;     // metrics the planner accepted
    int64_t dropped = 0;  // metrics dropped because the queue was full
    int64_t failed = 0;   // metrics in batches the planner refused or missed
  };
  Counters counters() const;

 private:
  void Loop();

  const StepReporterOptions o_;
  mutable absl::Mutex mu_;
  std::deque<hap::v1::StepMetric> queue_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Counters counters_ ABSL_GUARDED_BY(mu_);
  // counters_.failed and .dropped at the first failed send of an outage
  // (failing_since_ -1: none); guarded by mu_.
  int64_t failing_since_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t dropped_since_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_STEP_REPORTER_H_
