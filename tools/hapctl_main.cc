// hapctl: the command-line client of the HAP service.
#include <iostream>
#include <string>
#include <vector>

#include "tools/hapctl_checkpoint.h"
#include "tools/hapctl_client.h"
#include "tools/hapctl_graph.h"
#include "tools/hapctl_plan.h"

namespace {

constexpr char kUsage[] = R"(hapctl: plan and run SPMD training on heterogeneous clusters

Usage: hapctl COMMAND [ARGS]

Models:
  ops                       list the IR's ops and their signatures
  zoo [MODEL] [--layers N]  zoo models with parameter counts and FLOPs
                            (--export FILE.json writes the graph)
  validate FILE             load and validate a graph file (JSON/text/binary)

Planning (offline, no server):
  plan --cluster FILE [--model M | --graph FILE] [--baseline B] [-o table|json]
                            [--save-plan PLAN.pb]
  calibrate --cluster FILE --plan PLAN.pb --profile PREFIX --out FILE
                            cost model calibrated from measured runs

Checkpoints (hap-executor --checkpoint-dir):
  checkpoint inspect DIR    step, plan, files, tensors and their slices
  checkpoint export DIR -o FILE.safetensors
                            every parameter whole, by name (PyTorch, --init-weights)

Against a planner (--server HOST:PORT, else $HAPCTL_SERVER, else 127.0.0.1:7070):
  get nodes|plans|deployments|jobs   list (-o table|json|yaml)
  describe plan|deployment|job NAME  one resource in detail (a job: its timeline)
  create plan --model M [...]        synthesize on the live cluster (--wait)
  watch plan NAME                    stream progress until it ends
  cancel plan NAME / delete plan NAME / delete node NAME
  deploy plan NAME --executor DEV=HOST:PORT ... [--steps N]
  stop deployment NAME
  create job --id ID --model M [...] --checkpoint-dir DIR [--checkpoint-every N] [--steps N]
                                     an elastic job: re-planned as devices fail and join
  watch job NAME / stop job NAME

Run `hapctl COMMAND --help` for a command's flags.
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" ||
      std::string(argv[1]) == "help") {
    std::cout << kUsage;
    return argc < 2 ? 1 : 0;
  }
  std::string cmd = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
  if (cmd == "ops") return hap::tools::RunOps(rest);
  if (cmd == "zoo") return hap::tools::RunZoo(rest);
  if (cmd == "validate") return hap::tools::RunValidate(rest);
  if (cmd == "plan") return hap::tools::RunPlan(rest);
  if (cmd == "calibrate") return hap::tools::RunCalibrate(rest);
  if (cmd == "checkpoint") return hap::tools::RunCheckpoint(rest);
  for (const char* verb : {"get", "describe", "create", "watch", "cancel", "delete", "deploy",
                           "stop"}) {
    if (cmd == verb) return hap::tools::RunClient(cmd, rest);
  }
  std::cerr << "error: unknown command '" << cmd << "'\n\n" << kUsage;
  return 1;
}
