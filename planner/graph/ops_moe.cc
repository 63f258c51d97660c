// Mixture-of-experts pieces in the GShard formulation: a top-k gate that
// produces combine weights [tokens, experts, capacity], and the dispatch and
// combine einsums around the experts' batched FFN.
#include "absl/strings/str_cat.h"
#include "planner/graph/op_util.h"
#include "planner/util/status_macros.h"

namespace hap::graph::internal {

void RegisterMoeOps(OpRegistry& r) {
  {
    OpDef d;
    d.type = "moe_gate";
    d.attrs = {"k", "capacity"};
    d.summary =
        "moe_gate(logits[t, e]; k=2, capacity) -> combine[t, e, capacity]: "
        "softmax over experts, top-k, renormalised (k>1), each token placed "
        "at the next free slot of its experts; overflow tokens dropped";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 2));
      HAP_ASSIGN_OR_RETURN(int64_t k, c.attrs.Int("k", 2));
      HAP_ASSIGN_OR_RETURN(int64_t cap, c.attrs.Int("capacity"));
      int64_t e = c.shape(0)[1];
      if (k < 1 || k > e) {
        return absl::InvalidArgumentError(absl::StrCat(
            "attribute 'k' = ", k, " must be in [1, experts = ", e, "]"));
      }
      if (cap < 1) {
        return absl::InvalidArgumentError("attribute 'capacity' must be >= 1");
      }
      return std::vector<TensorType>{
          {c.in(0).dtype, {c.shape(0)[0], e, cap}}};
    };
    d.flops = [](const OpCall& c) {
      return 8.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "moe_dispatch";
    d.attrs = {};
    d.summary =
        "moe_dispatch(x[t, d], combine[t, e, c]) -> [e, c, d]: token rows "
        "routed to expert slots where combine != 0";
    d.min_inputs = d.max_inputs = 2;
    d.non_differentiable_inputs = {1};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 2));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 3));
      if (c.shape(1)[0] != c.shape(0)[0]) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(1), " and ", c.Describe(0), " differ in tokens"));
      }
      return std::vector<TensorType>{
          {c.in(0).dtype, {c.shape(1)[1], c.shape(1)[2], c.shape(0)[1]}}};
    };
    d.flops = [](const OpCall& c) {
      return 2.0 * static_cast<double>(c.outputs[0].num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "moe_combine";
    d.attrs = {};
    d.summary =
        "moe_combine(y[e, c, d], combine[t, e, c]) -> [t, d]: "
        "sum over slots of combine[t, e, c] * y[e, c]";
    d.min_inputs = d.max_inputs = 2;
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 3));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 3));
      if (c.shape(1)[1] != c.shape(0)[0] || c.shape(1)[2] != c.shape(0)[1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(1), " does not match experts/capacity of ",
            c.Describe(0)));
      }
      return std::vector<TensorType>{
          {c.in(0).dtype, {c.shape(1)[0], c.shape(0)[2]}}};
    };
    d.flops = [](const OpCall& c) {
      return 2.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 2.0;
    r.Register(std::move(d));
  }
}

}  // namespace hap::graph::internal
