// `hapctl plan`, offline mode: synthesize a plan on this machine from a
// model and a cluster profile file, with no planner service.
#ifndef HAP_TOOLS_HAPCTL_PLAN_H_
#define HAP_TOOLS_HAPCTL_PLAN_H_

#include <string>
#include <vector>

namespace hap::tools {

int RunPlan(const std::vector<std::string>& argv);
// hapctl calibrate: the cost model calibrated from --profile runs.
int RunCalibrate(const std::vector<std::string>& argv);

}  // namespace hap::tools

#endif  // HAP_TOOLS_HAPCTL_PLAN_H_
