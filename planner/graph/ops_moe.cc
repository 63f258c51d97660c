// Mixture-of-experts pieces in the GShard formulation, in two forms with the
// same routing: the dense one (a top-k gate that produces combine weights
// [tokens, experts, capacity], and the dispatch and combine einsums around
// the experts' batched FFN) and the compact one the zoo uses (the route as
// one int64 slot index per token and choice, the top-k weights per token,
// and the dispatch/combine as index gathers and scatters): its tensors grow
// with tokens, the dense combine tensor with tokens squared.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

// The gate's top-k attribute, checked against the experts of logits[t, e].
absl::StatusOr<int64_t> TopK(const OpCall& c) {
  HAP_ASSIGN_OR_RETURN(int64_t k, c.attrs.Int("k", 2));
  const int64_t e = c.shape(0)[1];
  if (k < 1 || k > e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attribute 'k' = ", k, " must be in [1, experts = ", e, "]"));
  }
  return k;
}

// route[t, k]: int64, the input's first dimension is tokens.
absl::Status ExpectRoute(const OpCall& c, int i, int64_t tokens) {
  if (c.in(i).dtype != DType::kInt64) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.Describe(i), " must be an int64 route"));
  }
  HAP_RETURN_IF_ERROR(ExpectRank(c, i, 2));
  if (c.shape(i)[0] != tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.Describe(i), " must have one row per token (", tokens, ")"));
  }
  return absl::OkStatus();
}

// Grouped routing (GShard's groups): attribute "group_size" g > 0 routes
// each run of g tokens on its own, with capacity / (tokens / g) slots per
// expert; 0 (the default) routes all tokens as one group. Checked against
// the op's tokens and capacity.
absl::Status CheckGroups(const OpCall& c, int64_t tokens, int64_t capacity) {
  HAP_ASSIGN_OR_RETURN(int64_t g, c.attrs.Int("group_size", 0));
  if (g == 0) return absl::OkStatus();
  if (g < 0 || tokens % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attribute 'group_size' = ", g, " must be 0 or divide the tokens (", tokens, ")"));
  }
  if (capacity % (tokens / g) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attribute 'capacity' = ", capacity, " must be a multiple of the ", tokens / g,
        " groups of 'group_size' = ", g, " tokens"));
  }
  return absl::OkStatus();
}

void RegisterCompactMoeOps(OpRegistry& r) {
  {
    OpDef d;
    d.type = "moe_route";
    d.attrs = {"k", "capacity", "group_size"};
    d.summary =
        "moe_route(logits[t, e]; k=2, capacity, group_size=0) -> i64[t, k]: "
        "moe_gate's routing as slot indices expert * capacity + slot of each "
        "token's top-k experts in order, -1 where the expert was full "
        "(dropped); with group_size g each run of g tokens fills its own "
        "capacity / (t / g) slots of every expert (slots of group q from "
        "q * capacity / (t / g) on)";
    d.non_differentiable_inputs = {0};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 2));
      HAP_ASSIGN_OR_RETURN(int64_t k, TopK(c));
      HAP_ASSIGN_OR_RETURN(int64_t cap, c.attrs.Int("capacity"));
      if (cap < 1) {
        return absl::InvalidArgumentError("attribute 'capacity' must be >= 1");
      }
      HAP_RETURN_IF_ERROR(CheckGroups(c, c.shape(0)[0], cap));
      return std::vector<TensorType>{{DType::kInt64, {c.shape(0)[0], k}}};
    };
    d.flops = [](const OpCall& c) {
      return 8.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 0.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "moe_route_weights";
    d.attrs = {"k"};
    d.summary =
        "moe_route_weights(logits[t, e]; k=2) -> [t, k]: the softmax "
        "probabilities of each token's top-k experts (moe_route's order), "
        "renormalised over the k when k > 1";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 2));
      HAP_ASSIGN_OR_RETURN(int64_t k, TopK(c));
      return std::vector<TensorType>{{c.in(0).dtype, {c.shape(0)[0], k}}};
    };
    d.flops = [](const OpCall& c) {
      return 8.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "moe_dispatch_idx";
    d.attrs = {"experts", "capacity", "group_size"};
    d.summary =
        "moe_dispatch_idx(x[t, d], route[t, k]; experts, capacity, "
        "group_size=0) -> [experts, capacity, d]: token rows gathered into "
        "their route slots (moe_dispatch with the compact route), empty "
        "slots zero; group_size: the route's (a grouped route lets plans "
        "split the capacity with the tokens)";
    d.min_inputs = d.max_inputs = 2;
    d.non_differentiable_inputs = {1};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 2));
      HAP_RETURN_IF_ERROR(ExpectRoute(c, 1, c.shape(0)[0]));
      HAP_ASSIGN_OR_RETURN(int64_t e, c.attrs.Int("experts"));
      HAP_ASSIGN_OR_RETURN(int64_t cap, c.attrs.Int("capacity"));
      if (e < 1 || cap < 1) {
        return absl::InvalidArgumentError(
            "attributes 'experts' and 'capacity' must be >= 1");
      }
      HAP_RETURN_IF_ERROR(CheckGroups(c, c.shape(0)[0], cap));
      return std::vector<TensorType>{{c.in(0).dtype, {e, cap, c.shape(0)[1]}}};
    };
    d.flops = [](const OpCall& c) {  // one row copy per routed token
      return static_cast<double>(c.in(1).num_elements()) *
             static_cast<double>(c.shape(0)[1]);
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "moe_combine_idx";
    d.attrs = {"group_size"};
    d.summary =
        "moe_combine_idx(y[e, c, d], route[t, k], weights[t, k]; "
        "group_size=0) -> [t, d]: each token's sum of weights[t, j] * "
        "y[route[t, j]] over its placed choices (moe_combine with the compact "
        "route); group_size: the route's";
    d.min_inputs = d.max_inputs = 3;
    d.non_differentiable_inputs = {1};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 3));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 2));
      const int64_t tokens = c.shape(1)[0];  // rank checked
      HAP_RETURN_IF_ERROR(ExpectRoute(c, 1, tokens));
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 2));
      if (c.shape(2) != c.shape(1) || c.in(2).dtype != c.in(0).dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(2), " must match ", c.Describe(1), "'s shape and ",
            c.Describe(0), "'s dtype"));
      }
      HAP_RETURN_IF_ERROR(CheckGroups(c, tokens, c.shape(0)[1]));
      return std::vector<TensorType>{{c.in(0).dtype, {tokens, c.shape(0)[2]}}};
    };
    d.flops = [](const OpCall& c) {
      return 2.0 * static_cast<double>(c.in(1).num_elements()) *
             static_cast<double>(c.shape(0)[2]);
    };
    d.backward_flops_multiple = 2.0;
    r.Register(std::move(d));
  }
}

}  // namespace

void RegisterMoeOps(OpRegistry& r) {
  RegisterCompactMoeOps(r);
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
