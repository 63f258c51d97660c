// Element-wise ops: unary activations and broadcasting binary arithmetic.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

void Unary(OpRegistry& r, const std::string& type, double flops_per_element,
           const std::string& summary) {
  OpDef d;
  d.type = type;
  d.summary = summary;
  d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
    HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
    return std::vector<TensorType>{c.in(0)};
  };
  d.flops = [flops_per_element](const OpCall& c) {
    return flops_per_element * static_cast<double>(c.in(0).num_elements());
  };
  d.backward_flops_multiple = 1.0;  // one pass over the elements
  r.Register(std::move(d));
}

void Binary(OpRegistry& r, const std::string& type,
            const std::string& summary) {
  OpDef d;
  d.type = type;
  d.summary = summary;
  d.min_inputs = d.max_inputs = 2;
  d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
    HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
    HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, 1));
    auto s = BroadcastShapes(c.shape(0), c.shape(1));
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          c.Describe(0), " and ", c.Describe(1), ": ", s.status().message()));
    }
    return std::vector<TensorType>{{c.in(0).dtype, *s}};
  };
  d.flops = [](const OpCall& c) {
    return static_cast<double>(c.outputs[0].num_elements());
  };
  d.backward_flops_multiple = 1.0;
  r.Register(std::move(d));
}

}  // namespace

void RegisterElementwiseOps(OpRegistry& r) {
  Unary(r, "relu", 1, "relu(x) -> max(x, 0)");
  Unary(r, "gelu", 8, "gelu(x) -> x * Phi(x) (exact, erf form)");
  Unary(r, "sigmoid", 4, "sigmoid(x) -> 1 / (1 + exp(-x))");
  Unary(r, "tanh", 4, "tanh(x)");
  Unary(r, "silu", 5, "silu(x) -> x * sigmoid(x) (swish)");
  Unary(r, "relu6", 2, "relu6(x) -> min(max(x, 0), 6)");
  Unary(r, "hardsigmoid", 3, "hardsigmoid(x) -> relu6(x + 3) / 6");
  Unary(r, "hardswish", 4, "hardswish(x) -> x * relu6(x + 3) / 6");
  Unary(r, "exp", 4, "exp(x) -> e^x");
  Unary(r, "rsqrt", 2, "rsqrt(x) -> 1 / sqrt(x)");
  Unary(r, "log", 4, "log(x) -> natural logarithm of x");
  {
    OpDef d;
    d.type = "dropout";
    d.attrs = {"p"};
    d.summary =
        "dropout(x; p=0.1) -> x * mask / (1-p); mask from a counter-based "
        "RNG keyed by the element's global index";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_ASSIGN_OR_RETURN(double p, c.attrs.Float("p", 0.1));
      if (!(p >= 0 && p < 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("attribute 'p' must be in [0, 1), got ", p));
      }
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return 2.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 0.5;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "drop_path";
    d.attrs = {"p", "mode"};
    d.summary =
        "drop_path(x[n, ...]; p=0.1, mode=\"row\") -> x * mask / (1-p), "
        "stochastic depth: mode row keeps or drops each sample whole (mask "
        "from a counter-based RNG keyed by the sample's global index), batch "
        "the whole batch";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 1));
      HAP_ASSIGN_OR_RETURN(double p, c.attrs.Float("p", 0.1));
      if (!(p >= 0 && p < 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("attribute 'p' must be in [0, 1), got ", p));
      }
      HAP_ASSIGN_OR_RETURN(std::string mode, c.attrs.String("mode", "row"));
      if (mode != "row" && mode != "batch") {
        return absl::InvalidArgumentError(absl::StrCat(
            "attribute 'mode' must be \"row\" or \"batch\", got \"", mode,
            "\""));
      }
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    // PyTorch's Tensor.detach(): the value, with no gradient flowing back
    // through it (a straight-through estimator's x + (q - x).detach(), a
    // target network's output).
    OpDef d;
    d.type = "stop_gradient";
    d.summary = "stop_gradient(x) -> x, through which no gradient flows (Tensor.detach())";
    d.non_differentiable_inputs = {0};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) { return static_cast<double>(c.in(0).num_elements()); };
    d.backward_flops_multiple = 0.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "scale";
    d.attrs = {"factor"};
    d.summary = "scale(x; factor) -> factor * x";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_ASSIGN_OR_RETURN(double f, c.attrs.Float("factor"));
      if (!std::isfinite(f)) {
        return absl::InvalidArgumentError("attribute 'factor' must be finite");
      }
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  Binary(r, "add", "add(a, b) -> a + b (numpy broadcasting)");
  Binary(r, "sub", "sub(a, b) -> a - b (numpy broadcasting)");
  Binary(r, "mul", "mul(a, b) -> a * b (numpy broadcasting)");
}

}  // namespace hap::graph::internal
