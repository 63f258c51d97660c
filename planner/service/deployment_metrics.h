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
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/metrics/metrics.h"

namespace hap::service {

// The rows of a per-deployment gauge: `value` of each deployment that has
// one (nullopt: no row); unfinished deployments first (by name), then
// finished ones, the latest to end first; at most `max_rows`.
std::vector<metrics::LabeledValue> DeploymentRows(
    std::vector<hap::v1::Deployment> deployments, size_t max_rows,
    const std::function<std::optional<double>(const hap::v1::Deployment&)>& value);

// hap_training_loss{deployment}: rank 0's latest loss of each deployment
// that has reported a step (DeploymentRows' order and bound).
std::vector<metrics::LabeledValue> TrainingLossRows(std::vector<hap::v1::Deployment> deployments,
                                                    size_t max_rows);

// hap_deployment_step_seconds{deployment}: the slowest rank's median step
// over its latest steps (Deployment.recent_step_seconds) of each
// unfinished deployment that has reported steps. Finished ones have no
// row: a step-time alert must not go on firing for a run that ended.
std::vector<metrics::LabeledValue> RecentStepRows(std::vector<hap::v1::Deployment> deployments,
                                                  size_t max_rows);

// hap_deployment_predicted_step_seconds{deployment}: the predicted step of
// each unfinished deployment's plan, `predicted(plan name)` (nullopt: a
// plan not held or not done: no row). With RecentStepRows, what the alert
// on steps slower than planned compares, deployment by deployment.
std::vector<metrics::LabeledValue> PredictedStepRows(
    std::vector<hap::v1::Deployment> deployments, size_t max_rows,
    const std::function<std::optional<double>(const std::string& plan)>& predicted);

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
