// Losses: nll_loss on log-probabilities and cross_entropy on logits, both
// averaged over the batch (PyTorch's reduction='mean').
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

// `flops_per_element` counts over the [n, c] input; `flops_per_row` over n.
void Loss(OpRegistry& r, const std::string& type, const std::string& summary,
          double flops_per_element, double flops_per_row) {
  OpDef d;
  d.type = type;
  d.summary = summary;
  d.min_inputs = d.max_inputs = 2;
  d.non_differentiable_inputs = {1};
  d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
    HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
    HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 2));
    HAP_RETURN_IF_ERROR(ExpectInteger(c, 1));
    HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 1));
    if (c.shape(1)[0] != c.shape(0)[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets ", c.Describe(1), " must have one entry per row of ",
          c.Describe(0)));
    }
    return std::vector<TensorType>{{c.in(0).dtype, {}}};
  };
  d.flops = [flops_per_element, flops_per_row](const OpCall& c) {
    return flops_per_element * static_cast<double>(c.in(0).num_elements()) +
           flops_per_row * static_cast<double>(c.shape(0)[0]);
  };
  d.backward_flops_multiple = 1.0;
  r.Register(std::move(d));
}

}  // namespace

void RegisterLossOps(OpRegistry& r) {
  Loss(r, "nll_loss",
       "nll_loss(logp[n, c], target[n] int) -> mean_i(-logp[i, target[i]]) "
       ": scalar",
       0, 2);  // a gather and a mean
  Loss(r, "cross_entropy",
       "cross_entropy(logits[n, c], target[n] int) -> "
       "nll_loss(log_softmax(logits), target) : scalar",
       4.0, 2);
}

}  // namespace hap::graph::internal
