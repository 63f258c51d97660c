// The optimizer flags `hapctl plan`, `hapctl create plan` and `hapctl create
// job` share, read into the plan's OptimizerConfig with one set of rules.
#ifndef HAP_TOOLS_HAPCTL_OPTIMIZER_H_
#define HAP_TOOLS_HAPCTL_OPTIMIZER_H_

#include "absl/status/statusor.h"
#include "common/cli_args.h"
#include "proto/hap/v1/plan.pb.h"

namespace hap::tools {

// --optimizer sgd|momentum|adam (default momentum), --lr (default 0.1, Adam
// 1e-3: the planner service's defaults), --momentum (0.9 for momentum, else
// 0), --weight-decay and --clip-norm (default 0), Adam's --beta1 (0.9),
// --beta2 (0.999) and --epsilon (1e-8). Each is refused naming its value
// where the planner would refuse it: lr <= 0, momentum or a beta outside
// [0, 1), epsilon <= 0, negative weight decay or clip norm, an Adam flag
// beside SGD.
absl::StatusOr<hap::v1::OptimizerConfig> OptimizerFromFlags(const Args& args);

}  // namespace hap::tools

#endif  // HAP_TOOLS_HAPCTL_OPTIMIZER_H_
