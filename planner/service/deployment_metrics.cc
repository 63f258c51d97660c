#include "planner/service/deployment_metrics.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "common/proto_time.h"
#include "planner/service/core/deployments.h"

namespace hap::service {

namespace v1 = ::hap::v1;

std::vector<metrics::LabeledValue> DeploymentRows(
    std::vector<v1::Deployment> deployments, size_t max_rows,
    const std::function<std::optional<double>(const v1::Deployment&)>& value) {
  auto finished = [](const v1::Deployment& d) { return DeploymentFinal(d.state()); };
  // Unfinished by name, then finished ones, the latest to end first (an
  // older planner's record has no end_time: its create_time).
  auto key = [&](const v1::Deployment& d) {
    const absl::Time end = FromProto(d.has_end_time() ? d.end_time() : d.create_time());
    return std::make_tuple(finished(d),
                           finished(d) ? absl::UnixEpoch() - end : absl::ZeroDuration(), d.name());
  };
  std::sort(deployments.begin(), deployments.end(),
            [&](const v1::Deployment& a, const v1::Deployment& b) { return key(a) < key(b); });
  std::vector<metrics::LabeledValue> rows;
  for (const v1::Deployment& d : deployments) {
    if (rows.size() >= max_rows) break;
    if (std::optional<double> v = value(d)) rows.push_back({{d.name()}, *v});
  }
  return rows;
}

std::vector<metrics::LabeledValue> TrainingLossRows(std::vector<v1::Deployment> deployments,
                                                    size_t max_rows) {
  return DeploymentRows(std::move(deployments), max_rows,
                        [](const v1::Deployment& d) -> std::optional<double> {
                          if (d.steps_completed() <= 0) return std::nullopt;
                          return d.last_loss();
                        });
}

std::vector<metrics::LabeledValue> RecentStepRows(std::vector<v1::Deployment> deployments,
                                                  size_t max_rows) {
  return DeploymentRows(std::move(deployments), max_rows,
                        [](const v1::Deployment& d) -> std::optional<double> {
                          if (DeploymentFinal(d.state()) || d.recent_step_seconds() <= 0) {
                            return std::nullopt;
                          }
                          return d.recent_step_seconds();
                        });
}

std::vector<metrics::LabeledValue> PredictedStepRows(
    std::vector<v1::Deployment> deployments, size_t max_rows,
    const std::function<std::optional<double>(const std::string& plan)>& predicted) {
  return DeploymentRows(std::move(deployments), max_rows,
                        [&](const v1::Deployment& d) -> std::optional<double> {
                          if (DeploymentFinal(d.state())) return std::nullopt;
                          return predicted(d.plan());
                        });
}

void LatestPerKey::Set(const std::string& key, double value) {
  absl::MutexLock l(&mu_);
  auto it = values_.find(key);
  if (it != values_.end()) by_age_.erase(it->second.first);
  values_[key] = {++clock_, value};
  by_age_[clock_] = key;
  while (values_.size() > max_keys_) {
    values_.erase(by_age_.begin()->second);
    by_age_.erase(by_age_.begin());
  }
}

std::vector<metrics::LabeledValue> LatestPerKey::Rows() const {
  absl::MutexLock l(&mu_);
  std::vector<metrics::LabeledValue> rows;
  for (auto it = by_age_.rbegin(); it != by_age_.rend(); ++it) {
    rows.push_back({{it->second}, values_.at(it->second).second});
  }
  return rows;
}

}  // namespace hap::service
