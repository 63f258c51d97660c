// Series of the planner's /metrics whose label sets are not bounded by
// the cluster: per deployment, made from the
// deployments the planner holds at each scrape: a series exists while its
// deployment does (retention deletes finished ones) and the family's bound
// on label sets drops the oldest finished deployments, never a running
// one. (A family fed as metrics arrived kept every deployment ever seen
// and, once it held its 1,000 label sets, showed no new deployment's loss.)
#ifndef HAP_PLANNER_SERVICE_DEPLOYMENT_METRICS_H_
#define HAP_PLANNER_SERVICE_DEPLOYMENT_METRICS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/metrics/metrics.h"

namespace hap::service {

// hap_training_loss{deployment}: rank 0's latest loss of each deployment
// that has reported a step; unfinished deployments first (by name), then
// finished ones, the latest to end first; at most `max_rows`.
std::vector<metrics::LabeledValue> TrainingLossRows(std::vector<hap::v1::Deployment> deployments,
                                                    size_t max_rows);

// A gauge's latest value per key, for keys callers choose (hap_plan_
// predicted_step_seconds{model}): at most `max_keys`, the least recently
// set forgotten first, so a new key is always shown. (The family fed
// directly stopped taking new models at its 1,000th.) Thread-safe.
class LatestPerKey {
 public:
  explicit LatestPerKey(size_t max_keys) : max_keys_(max_keys) {}
  void Set(const std::string& key, double value);
  // The most recently set first.
  std::vector<metrics::LabeledValue> Rows() const;

 private:
  const size_t max_keys_;
  mutable absl::Mutex mu_;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::pair<uint64_t, double>> values_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> by_age_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_DEPLOYMENT_METRICS_H_
