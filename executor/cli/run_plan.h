// The local runner's logic: load a plan file, pick the rank's program,
// rendezvous through a directory, train K steps on synthetic data or
// WikiText-2 and print per-step loss and step time (hap-executor).
#ifndef HAP_EXECUTOR_CLI_RUN_PLAN_H_
#define HAP_EXECUTOR_CLI_RUN_PLAN_H_

#include <string>
#include <vector>

namespace hap::executor {

// argv without the program name. Returns the process exit code; errors go
// to stderr as "error: ... (rank R)" in one write (exit 1), usage errors
// and a closed standard output exit 2. A failure in training ends the
// process there (_exit(1), after the error line), its connections still
// open until the exit closes them: its peers then fail after it has ended.
// Such a peer, whose collective lost its connection, also leaves
// RENDEZVOUS/rankR.lost-peer for hap-launch.
int RunPlanMain(const std::vector<std::string>& argv);

// hap-launch: forks one hap-executor per rank of the plan on this machine
// (127.0.0.1), waits for all, and stops the others by pid when one fails,
// naming it (and, when the first to end only lost their peer, the rank
// that failed on its own).
int LaunchMain(const std::string& self, const std::vector<std::string>& argv);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CLI_RUN_PLAN_H_
