// The local runner's logic: load a plan file, pick the rank's program,
// rendezvous through a directory, train K steps on synthetic data or
// WikiText-2 and print per-step loss and step time (hap-executor).
#ifndef HAP_EXECUTOR_CLI_RUN_PLAN_H_
#define HAP_EXECUTOR_CLI_RUN_PLAN_H_

#include <string>
#include <vector>

namespace hap::executor {

// argv without the program name. Returns the process exit code; errors go
// to stderr as "error: ..." (exit 1), usage errors exit 2.
int RunPlanMain(const std::vector<std::string>& argv);

// hap-launch: forks one hap-executor per rank of the plan on this machine
// (127.0.0.1), waits for all, and stops the others by pid when one fails.
int LaunchMain(const std::string& self, const std::vector<std::string>& argv);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CLI_RUN_PLAN_H_
