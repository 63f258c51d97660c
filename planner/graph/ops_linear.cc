// Matrix products: linear (PyTorch layout) and (batched) matmul.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {

void RegisterLinearOps(OpRegistry& r) {
  {
    OpDef d;
    d.type = "linear";
    d.attrs = {};
    d.summary =
        "linear(x[..., in], w[out, in], b[out]?) -> x @ w^T + b : [..., out]";
    d.min_inputs = 2;
    d.max_inputs = 3;
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 1));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 2));
      HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, 1));
      int64_t in = Dim(c, 0, -1);
      if (c.shape(1)[1] != in) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(0), " has ", in, " features but weight ",
            c.Describe(1), " expects ", c.shape(1)[1]));
      }
      int64_t out = c.shape(1)[0];
      if (c.inputs.size() == 3) {
        HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, 2));
        if (c.shape(2) != Shape{out}) {
          return absl::InvalidArgumentError(
              absl::StrCat("bias ", c.Describe(2), " must have shape [", out,
                           "]"));
        }
      }
      Shape s = c.shape(0);
      s.back() = out;
      return std::vector<TensorType>{{c.in(0).dtype, s}};
    };
    d.flops = [](const OpCall& c) {
      double rows = static_cast<double>(c.in(0).num_elements() / Dim(c, 0, -1));
      double in = static_cast<double>(Dim(c, 0, -1));
      double out = static_cast<double>(c.shape(1)[0]);
      return 2.0 * rows * in * out + (c.inputs.size() == 3 ? rows * out : 0);
    };
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "matmul";
    d.attrs = {};
    d.summary =
        "matmul(a[..., m, k], b[..., k, n]) -> [..., m, n]; b may be rank 2 "
        "(shared across the batch dims of a)";
    d.min_inputs = d.max_inputs = 2;
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
      HAP_RETURN_IF_ERROR(ExpectMinRank(c, 0, 2));
      HAP_RETURN_IF_ERROR(ExpectMinRank(c, 1, 2));
      HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, 1));
      const Shape& a = c.shape(0);
      const Shape& b = c.shape(1);
      if (b.size() != 2 && b.size() != a.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(1), " must have rank 2 or the rank of ",
            c.Describe(0)));
      }
      if (b.size() == a.size()) {
        for (size_t i = 0; i + 2 < a.size(); ++i) {
          if (a[i] != b[i]) {
            return absl::InvalidArgumentError(absl::StrCat(
                "batch dimension ", i, " differs: ", c.Describe(0), " vs ",
                c.Describe(1)));
          }
        }
      }
      if (a[a.size() - 1] != b[b.size() - 2]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "inner dimensions differ: ", c.Describe(0), " vs ",
            c.Describe(1)));
      }
      Shape s = a;
      s.back() = b.back();
      return std::vector<TensorType>{{c.in(0).dtype, s}};
    };
    d.flops = [](const OpCall& c) {
      return 2.0 * static_cast<double>(c.outputs[0].num_elements()) *
             static_cast<double>(Dim(c, 0, -1));
    };
    r.Register(std::move(d));
  }
}

}  // namespace hap::graph::internal
