#include "tools/hapctl_optimizer.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace hap::tools {

absl::StatusOr<hap::v1::OptimizerConfig> OptimizerFromFlags(const Args& args) {
  const std::string opt = args.Get("optimizer", "momentum");
  if (opt != "sgd" && opt != "momentum" && opt != "adam") {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer must be sgd, momentum or adam, got '", opt, "'"));
  }
  // Adam keeps its own moments (beta1 0.9, beta2 0.999): a --momentum
  // beside it was written into the plan and never used.
  if (opt == "adam" && args.Has("momentum")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--momentum is SGD's (--optimizer sgd or momentum); --optimizer adam would "
                     "ignore it, got '",
                     args.Get("momentum"), "'"));
  }
  // Adam's own: beside SGD they were never read.
  for (const char* flag : {"beta1", "beta2", "epsilon"}) {
    if (opt != "adam" && args.Has(flag)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " is Adam's (--optimizer adam); --optimizer ", opt,
                       " would ignore it, got '", args.Get(flag), "'"));
    }
  }
  HAP_ASSIGN_OR_RETURN(double lr, args.Number("lr", opt == "adam" ? 1e-3 : 0.1));
  HAP_ASSIGN_OR_RETURN(double m, args.Number("momentum", opt == "momentum" ? 0.9 : 0));
  HAP_ASSIGN_OR_RETURN(double wd, args.Number("weight-decay", 0));
  HAP_ASSIGN_OR_RETURN(double clip, args.Number("clip-norm", 0));
  // Each named with its value. The momentum as the planner service takes
  // it: from 1 on, a step's update never decays and training diverges.
  if (!(lr > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lr must be positive, got '", args.Get("lr"), "'"));
  }
  if (!(m >= 0 && m < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--momentum must be from 0 to below 1, got '", args.Get("momentum"), "'"));
  }
  for (const auto& [flag, v] :
       {std::pair<const char*, double>{"weight-decay", wd}, {"clip-norm", clip}}) {
    if (v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must not be negative, got '", args.Get(flag), "'"));
    }
  }
  hap::v1::OptimizerConfig o;
  // Unset, the planner's 0.9 and 0.999 (PyTorch's); 0 is 0.
  for (const char* flag : {"beta1", "beta2"}) {
    if (!args.Has(flag)) continue;
    HAP_ASSIGN_OR_RETURN(double b, args.Number(flag, 0));
    if (!(b >= 0 && b < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be from 0 to below 1, got '", args.Get(flag), "'"));
    }
    std::string(flag) == "beta1" ? o.set_beta1(b) : o.set_beta2(b);
  }
  if (args.Has("epsilon")) {
    HAP_ASSIGN_OR_RETURN(double eps, args.Number("epsilon", 0));
    if (!(eps > 0)) {  // 0 would divide a moment by a zero second moment
      return absl::InvalidArgumentError(
          absl::StrCat("--epsilon must be positive, got '", args.Get("epsilon"), "'"));
    }
    o.set_epsilon(eps);
  }
  o.set_kind(opt == "adam" ? hap::v1::OptimizerConfig::ADAM : hap::v1::OptimizerConfig::SGD);
  o.set_learning_rate(lr);
  o.set_momentum(m);
  o.set_weight_decay(wd);
  o.set_clip_global_norm(clip);
  return o;
}

}  // namespace hap::tools
