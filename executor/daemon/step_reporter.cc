#include "executor/daemon/step_reporter.h"

#include <iostream>
#include <utility>

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
      last = stop_;
    }
    absl::Status s = o_.send ? o_.send(batch) : absl::OkStatus();
    absl::MutexLock l(&mu_);
    in_flight_ = 0;
    if (s.ok()) {
      counters_.sent += static_cast<int64_t>(batch.size());
    } else {
      counters_.failed += static_cast<int64_t>(batch.size());
      std::cerr << "hap-executor: dropped " << batch.size()
                << " step metrics the planner did not take: " << s << "\n";
    }
    if (last) {  // one last send on the way out; the rest is dropped
      counters_.dropped += static_cast<int64_t>(queue_.size());
      queue_.clear();
      return;
    }
  }
}

}  // namespace hap::executor
