// hap-launch: one hap-executor per rank of a plan on this machine.
#include <string>
#include <vector>

#include "executor/cli/run_plan.h"

int main(int argc, char** argv) {
  return hap::executor::LaunchMain(argv[0],
                                   std::vector<std::string>(argv + 1, argv + argc));
}
