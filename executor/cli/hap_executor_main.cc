#include <algorithm>
#include <string>
#include <vector>

#include "executor/cli/run_plan.h"
#include "executor/daemon/daemon_main.h"

// `hap-executor --serve ...` is the daemon (hap.v1.Executor); without
// --serve it runs one rank of a plan file and exits.
int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (std::find(args.begin(), args.end(), "--serve") != args.end()) {
    return hap::executor::ExecutorDaemonMain(args);
  }
  return hap::executor::RunPlanMain(args);
}
