// hap-executor: runs one rank of a plan (see run_plan.h).
#include <string>
#include <vector>

#include "executor/cli/run_plan.h"

int main(int argc, char** argv) {
  return hap::executor::RunPlanMain(std::vector<std::string>(argv + 1, argv + argc));
}
