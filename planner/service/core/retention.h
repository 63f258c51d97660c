// Retention's choice, shared by plans (PlannerCore::EnforceRetention) and
// deployments (DeploymentManager::EnforceRetention): of the finished
// records, which are past the limits.
#ifndef HAP_PLANNER_SERVICE_CORE_RETENTION_H_
#define HAP_PLANNER_SERVICE_CORE_RETENTION_H_

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace hap::service {

// The names among `finished` ((when it finished, name) pairs) that are not
// among the `count` most recently finished (count 0 = no limit by count;
// ties by name, the greater counting as the more recent) or that finished
// before `oldest` (InfinitePast = no limit by age), most recent first.
inline std::vector<std::string> PastRetention(
    std::vector<std::pair<absl::Time, std::string>> finished, int count, absl::Time oldest) {
  std::sort(finished.begin(), finished.end(),
            [](const auto& a, const auto& b) { return a > b; });
  std::vector<std::string> past;
  for (size_t i = 0; i < finished.size(); ++i) {
    if ((count > 0 && i >= static_cast<size_t>(count)) || finished[i].first < oldest) {
      past.push_back(std::move(finished[i].second));
    }
  }
  return past;
}

// The end of the time retention counts back from `now`: finished before
// it goes (InfiniteDuration = no limit by age: InfinitePast).
inline absl::Time OldestKept(absl::Time now, absl::Duration age) {
  return age == absl::InfiniteDuration() ? absl::InfinitePast() : now - age;
}

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_RETENTION_H_
