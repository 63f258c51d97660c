// Normalisations: layer_norm, batch_norm, softmax (with causal or additive
// mask), log_softmax.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

// A floating-point input of rank >= 1 and an `axis` attribute naming its
// last axis (the only one the kernels support).
absl::Status ExpectLastAxis(const OpCall& c, absl::string_view op) {
  HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
  HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 1));
  HAP_ASSIGN_OR_RETURN(int64_t axis, c.attrs.Int("axis", -1));
  HAP_ASSIGN_OR_RETURN(int ax, NormalizeAxis(axis, c.in(0).rank(), "axis"));
  if (ax != c.in(0).rank() - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, " is supported over the last axis only"));
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterNormalizationOps(OpRegistry& r) {
  {
    OpDef d;
    d.type = "layer_norm";
    d.attrs = {"eps"};
    d.summary =
        "layer_norm(x[..., d], gamma[d], beta[d]; eps=1e-5) -> normalised "
        "over the last dimension";
    d.min_inputs = d.max_inputs = 3;
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 1));
      Shape want = {Dim(c, 0, -1)};
      for (int i : {1, 2}) {
        HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, i));
        if (c.shape(i) != want) {
          return absl::InvalidArgumentError(absl::StrCat(
              c.Describe(i), " must have shape ", ShapeString(want)));
        }
      }
      HAP_ASSIGN_OR_RETURN(double eps, c.attrs.Float("eps", 1e-5));
      if (!(eps > 0)) {
        return absl::InvalidArgumentError("attribute 'eps' must be positive");
      }
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return 8.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.5;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "batch_norm";
    d.attrs = {"eps", "momentum"};
    d.summary =
        "batch_norm(x[n, c, ...], gamma[c], beta[c], running_mean[c]?, "
        "running_var[c]?; eps=1e-5, momentum=0.1) -> normalised per channel "
        "with the statistics of the whole (global) batch, as in training; "
        "updates running_mean/running_var (frozen parameters) in place with "
        "the batch mean and unbiased variance";
    d.min_inputs = 3;
    d.max_inputs = 5;
    d.non_differentiable_inputs = {3, 4};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 2));
      Shape want = {c.shape(0)[1]};
      for (size_t i = 1; i < c.inputs.size(); ++i) {
        HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, static_cast<int>(i)));
        if (c.shape(static_cast<int>(i)) != want) {
          return absl::InvalidArgumentError(
              absl::StrCat(c.Describe(static_cast<int>(i)),
                           " must have shape ", ShapeString(want),
                           " (the channels, dimension 1 of x)"));
        }
      }
      if (c.in(0).num_elements() / c.shape(0)[1] < 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(0), " has one value per channel: batch statistics "
            "need at least two"));
      }
      HAP_ASSIGN_OR_RETURN(double eps, c.attrs.Float("eps", 1e-5));
      if (!(eps > 0)) {
        return absl::InvalidArgumentError("attribute 'eps' must be positive");
      }
      HAP_ASSIGN_OR_RETURN(double momentum, c.attrs.Float("momentum", 0.1));
      if (!(momentum >= 0 && momentum <= 1)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "attribute 'momentum' must be in [0, 1], got ", momentum));
      }
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return 7.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.5;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "softmax";
    d.attrs = {"axis", "causal"};
    d.summary =
        "softmax(x, mask?; axis=-1, causal=false) -> softmax over the last "
        "axis of x + mask; causal masks j > i over the last two dims";
    d.min_inputs = 1;
    d.max_inputs = 2;
    d.non_differentiable_inputs = {1};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectLastAxis(c, "softmax"));
      HAP_ASSIGN_OR_RETURN(bool causal, c.attrs.Bool("causal", false));
      if (causal) {
        HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 2));
        if (Dim(c, 0, -1) != Dim(c, 0, -2)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "causal softmax needs square last two dims, got ",
              c.Describe(0)));
        }
      }
      if (c.inputs.size() == 2) {
        HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, 1));
        auto b = BroadcastShapes(c.shape(0), c.shape(1));
        if (!b.ok() || *b != c.shape(0)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "mask ", c.Describe(1), " must broadcast to ", c.Describe(0)));
        }
      }
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return 5.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "log_softmax";
    d.attrs = {"axis"};
    d.summary = "log_softmax(x; axis=-1) -> x - logsumexp(x) over the axis";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectLastAxis(c, "log_softmax"));
      return std::vector<TensorType>{c.in(0)};
    };
    d.flops = [](const OpCall& c) {
      return 4.0 * static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
}

}  // namespace hap::graph::internal
