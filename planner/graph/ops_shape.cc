// Layout ops: transpose, reshape, flatten, concat, split, slice, expand, and
// the embedding lookup.
#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

double Free(const OpCall&) { return 0; }

double CopyOut(const OpCall& c) {
  return static_cast<double>(c.outputs[0].num_elements());
}

}  // namespace

void RegisterShapeOps(OpRegistry& r) {
  {
    OpDef d;
    d.type = "transpose";
    d.attrs = {"perm"};
    d.summary = "transpose(x; perm) -> x with dims permuted (out[i] = in[perm[i]])";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_ASSIGN_OR_RETURN(std::vector<int64_t> perm, c.attrs.Ints("perm"));
      int rank = c.in(0).rank();
      if (static_cast<int>(perm.size()) != rank) {
        return absl::InvalidArgumentError(absl::StrCat(
            "attribute 'perm' has ", perm.size(), " entries for ",
            c.Describe(0)));
      }
      std::vector<bool> seen(rank, false);
      Shape s(rank);
      for (int i = 0; i < rank; ++i) {
        HAP_ASSIGN_OR_RETURN(int p, NormalizeAxis(perm[i], rank, "perm entry"));
        if (seen[p]) {
          return absl::InvalidArgumentError(
              "attribute 'perm' is not a permutation");
        }
        seen[p] = true;
        s[i] = c.shape(0)[p];
      }
      return std::vector<TensorType>{{c.in(0).dtype, s}};
    };
    d.flops = CopyOut;
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "reshape";
    d.attrs = {"shape"};
    d.summary = "reshape(x; shape) -> same elements, new shape (one -1 allowed)";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_ASSIGN_OR_RETURN(std::vector<int64_t> shape, c.attrs.Ints("shape"));
      int64_t known = 1;
      int infer_at = -1;
      for (size_t i = 0; i < shape.size(); ++i) {
        if (shape[i] == -1) {
          if (infer_at >= 0) {
            return absl::InvalidArgumentError(
                "attribute 'shape' has more than one -1");
          }
          infer_at = static_cast<int>(i);
        } else if (shape[i] <= 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "attribute 'shape' ", ShapeString(shape),
              " has a non-positive dimension"));
        } else if (__builtin_mul_overflow(known, shape[i], &known)) {
          return absl::InvalidArgumentError(
              "attribute 'shape' overflows 64 bits");
        }
      }
      int64_t n = c.in(0).num_elements();
      if (infer_at >= 0) {
        if (n % known != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "cannot reshape ", c.Describe(0), " to ", ShapeString(shape)));
        }
        shape[infer_at] = n / known;
        known = n;
      }
      if (known != n) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot reshape ", c.Describe(0), " (", n, " elements) to ",
            ShapeString(shape), " (", known, " elements)"));
      }
      return std::vector<TensorType>{{c.in(0).dtype, shape}};
    };
    d.flops = Free;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "flatten";
    d.attrs = {"start_dim", "end_dim"};
    d.summary = "flatten(x; start_dim=1, end_dim=-1) -> dims start..end merged";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      int rank = c.in(0).rank();
      HAP_ASSIGN_OR_RETURN(int64_t s0, c.attrs.Int("start_dim", 1));
      HAP_ASSIGN_OR_RETURN(int64_t e0, c.attrs.Int("end_dim", -1));
      HAP_ASSIGN_OR_RETURN(int s, NormalizeAxis(s0, rank, "start_dim"));
      HAP_ASSIGN_OR_RETURN(int e, NormalizeAxis(e0, rank, "end_dim"));
      if (s > e) {
        return absl::InvalidArgumentError("start_dim must not exceed end_dim");
      }
      Shape out(c.shape(0).begin(), c.shape(0).begin() + s);
      int64_t m = 1;
      for (int i = s; i <= e; ++i) m *= c.shape(0)[i];
      out.push_back(m);
      out.insert(out.end(), c.shape(0).begin() + e + 1, c.shape(0).end());
      return std::vector<TensorType>{{c.in(0).dtype, out}};
    };
    d.flops = Free;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "concat";
    d.attrs = {"axis"};
    d.summary = "concat(x0, x1, ...; axis) -> joined along axis";
    d.max_inputs = -1;
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_ASSIGN_OR_RETURN(int64_t axis, c.attrs.Int("axis"));
      HAP_ASSIGN_OR_RETURN(int ax, NormalizeAxis(axis, c.in(0).rank(), "axis"));
      Shape s = c.shape(0);
      for (size_t i = 1; i < c.inputs.size(); ++i) {
        HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, static_cast<int>(i)));
        const Shape& t = c.shape(static_cast<int>(i));
        bool ok = t.size() == s.size();
        for (size_t j = 0; ok && j < s.size(); ++j) {
          if (static_cast<int>(j) != ax && t[j] != s[j]) ok = false;
        }
        if (!ok) {
          return absl::InvalidArgumentError(absl::StrCat(
              c.Describe(static_cast<int>(i)), " does not match ",
              c.Describe(0), " outside axis ", ax));
        }
        if (__builtin_add_overflow(s[ax], t[ax], &s[ax])) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the inputs' sizes along axis ", ax, " overflow 64 bits"));
        }
      }
      return std::vector<TensorType>{{c.in(0).dtype, s}};
    };
    d.flops = CopyOut;
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "split";
    d.attrs = {"axis", "sizes"};
    d.summary = "split(x; axis, sizes) -> one output per size along axis";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_ASSIGN_OR_RETURN(int64_t axis, c.attrs.Int("axis"));
      HAP_ASSIGN_OR_RETURN(int ax, NormalizeAxis(axis, c.in(0).rank(), "axis"));
      HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes, c.attrs.Ints("sizes"));
      if (sizes.empty()) {
        return absl::InvalidArgumentError("attribute 'sizes' is empty");
      }
      int64_t total = 0;
      std::vector<TensorType> out;
      for (int64_t n : sizes) {
        if (n <= 0) {
          return absl::InvalidArgumentError(
              "attribute 'sizes' has a non-positive entry");
        }
        if (__builtin_add_overflow(total, n, &total)) {
          return absl::InvalidArgumentError(
              "attribute 'sizes' overflows 64 bits");
        }
        TensorType t = c.in(0);
        t.shape[ax] = n;
        out.push_back(t);
      }
      if (total != c.shape(0)[ax]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "attribute 'sizes' sums to ", total, " but axis ", ax, " of ",
            c.Describe(0), " is ", c.shape(0)[ax]));
      }
      return out;
    };
    d.flops = [](const OpCall& c) {
      return static_cast<double>(c.in(0).num_elements());
    };
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "slice";
    d.attrs = {"axis", "start", "end"};
    d.summary = "slice(x; axis, start, end) -> x[..., start:end, ...]";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_ASSIGN_OR_RETURN(int64_t axis, c.attrs.Int("axis"));
      HAP_ASSIGN_OR_RETURN(int ax, NormalizeAxis(axis, c.in(0).rank(), "axis"));
      HAP_ASSIGN_OR_RETURN(int64_t start, c.attrs.Int("start"));
      HAP_ASSIGN_OR_RETURN(int64_t end, c.attrs.Int("end"));
      if (start < 0 || end <= start || end > c.shape(0)[ax]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "slice [", start, ", ", end, ") is empty or out of range for axis ",
            ax, " of ", c.Describe(0)));
      }
      TensorType t = c.in(0);
      t.shape[ax] = end - start;
      return std::vector<TensorType>{t};
    };
    d.flops = CopyOut;
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "expand";
    d.attrs = {"shape"};
    d.summary = "expand(x; shape) -> x broadcast to shape (numpy rules)";
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_ASSIGN_OR_RETURN(std::vector<int64_t> shape, c.attrs.Ints("shape"));
      HAP_RETURN_IF_ERROR(CheckedNumElements(shape).status());
      auto b = BroadcastShapes(c.shape(0), shape);
      if (!b.ok() || *b != shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            c.Describe(0), " does not broadcast to ", ShapeString(shape)));
      }
      return std::vector<TensorType>{{c.in(0).dtype, shape}};
    };
    d.flops = CopyOut;
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
  {
    OpDef d;
    d.type = "embedding";
    d.attrs = {};
    d.summary = "embedding(ids[...] int, table[v, d]) -> table[ids] : [..., d]";
    d.min_inputs = d.max_inputs = 2;
    d.non_differentiable_inputs = {0};
    d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
      HAP_RETURN_IF_ERROR(ExpectInteger(c, 0));
      HAP_RETURN_IF_ERROR(ExpectFloating(c, 1));
      HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 2));
      Shape s = c.shape(0);
      s.push_back(c.shape(1)[1]);
      return std::vector<TensorType>{{c.in(1).dtype, s}};
    };
    d.flops = CopyOut;
    d.backward_flops_multiple = 1.0;
    r.Register(std::move(d));
  }
}

}  // namespace hap::graph::internal
