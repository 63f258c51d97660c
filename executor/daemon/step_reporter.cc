#include "executor/daemon/step_reporter.h"

#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hap::executor {

StepReporter::StepReporter(StepReporterOptions options) : o_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

StepReporter::~StepReporter() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool StepReporter::Push(hap::v1::StepMetric metric) {
  absl::MutexLock l(&mu_);
  if (queue_.size() >= o_.capacity) {
    ++counters_.dropped;
    return false;
  }
  queue_.push_back(std::move(metric));
  return true;
}

bool StepReporter::Flush(absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto drained = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return queue_.empty() && in_flight_ == 0;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&drained), deadline);
}

StepReporter::Counters StepReporter::counters() const {
  absl::MutexLock l(&mu_);
  return counters_;
}

void StepReporter::Loop() {
  while (true) {
    std::vector<hap::v1::StepMetric> batch;
    bool last = false;
    int64_t dropped_before = 0;  // counters_.dropped when the batch was taken
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, nothing left
      while (!queue_.empty() && batch.size() < o_.max_batch) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      in_flight_ = static_cast<int64_t>(batch.size());
      dropped_before = counters_.dropped;
      last = stop_;
    }
    absl::Status s = o_.send ? o_.send(batch) : absl::OkStatus();
    std::string message;
    {
      absl::MutexLock l(&mu_);
      in_flight_ = 0;
      if (s.ok()) {
        counters_.sent += static_cast<int64_t>(batch.size());
        if (failing_since_ >= 0) {
          // Sends that time out leave the queue full: most of an outage's
          // losses can be Push's drops, not the failed sends.
          const int64_t failed = counters_.failed - failing_since_;
          const int64_t dropped = counters_.dropped - dropped_since_;
          message = absl::StrCat(
              "hap-executor: the planner takes step metrics again; ", failed + dropped,
              " were dropped while it did not",
              dropped > 0 ? absl::StrCat(" (", dropped, " of them for a full queue)") : "");
          failing_since_ = -1;
        }
      } else {
        if (failing_since_ < 0) {
          failing_since_ = counters_.failed;
          dropped_since_ = dropped_before;  // the queue filled while it was sent
          message = absl::StrCat("hap-executor: dropped ", batch.size(),
                                 " step metrics the planner did not take: ", s.ToString(),
                                 " (further failures are counted, not logged, until it takes "
                                 "them again)");
        }
        counters_.failed += static_cast<int64_t>(batch.size());
      }
      if (!message.empty()) {  // before Flush can return
        if (o_.log) {
          o_.log(message);
        } else {
          std::cerr << message + "\n";
        }
      }
      if (last) {  // one last send on the way out; the rest is dropped
        counters_.dropped += static_cast<int64_t>(queue_.size());
        queue_.clear();
      }
    }
    if (last) return;
  }
}

}  // namespace hap::executor
