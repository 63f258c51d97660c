#include "planner/graph/op_registry.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "planner/graph/op_util.h"

namespace hap::graph {

std::string OpCall::Describe(int i) const {
  return absl::StrCat("input '", input_names[i], "' (", TypeString(inputs[i]),
                      ")");
}

OpRegistry::OpRegistry() {
  internal::RegisterElementwiseOps(*this);
  internal::RegisterLinearOps(*this);
  internal::RegisterNormalizationOps(*this);
  internal::RegisterShapeOps(*this);
  internal::RegisterReductionOps(*this);
  internal::RegisterLossOps(*this);
  internal::RegisterConvolutionOps(*this);
  internal::RegisterMoeOps(*this);
  internal::RegisterLstmOps(*this);
  std::sort(defs_.begin(), defs_.end(),
            [](const OpDef& a, const OpDef& b) { return a.type < b.type; });
}

const OpRegistry& OpRegistry::Global() {
  static const OpRegistry* r = new OpRegistry();
  return *r;
}

void OpRegistry::Register(OpDef def) { defs_.push_back(std::move(def)); }

const OpDef* OpRegistry::Find(absl::string_view type) const {
  auto it = std::lower_bound(
      defs_.begin(), defs_.end(), type,
      [](const OpDef& d, absl::string_view t) { return d.type < t; });
  if (it == defs_.end() || it->type != type) return nullptr;
  return &*it;
}

std::vector<const OpDef*> OpRegistry::All() const {
  std::vector<const OpDef*> out;
  for (const OpDef& d : defs_) out.push_back(&d);
  return out;
}

absl::StatusOr<std::vector<TensorType>> InferOp(
    absl::string_view op_name, absl::string_view type, const Attrs& attrs,
    const std::vector<std::string>& input_names,
    const std::vector<TensorType>& inputs) {
  auto prefix = [&]() {
    return absl::StrCat("op '", op_name, "' (", type, "): ");
  };
  const OpDef* def = OpRegistry::Global().Find(type);
  if (def == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("op '", op_name, "' has unknown type '", type,
                     "' (see `hapctl ops` for the registered ops)"));
  }
  int n = static_cast<int>(inputs.size());
  if (n < def->min_inputs || (def->max_inputs >= 0 && n > def->max_inputs)) {
    std::string want =
        def->max_inputs < 0
            ? absl::StrCat("at least ", def->min_inputs)
            : (def->min_inputs == def->max_inputs
                   ? absl::StrCat(def->min_inputs)
                   : absl::StrCat(def->min_inputs, " to ", def->max_inputs));
    return absl::InvalidArgumentError(absl::StrCat(
        prefix(), "takes ", want, " inputs, got ", n, " (", def->summary,
        ")"));
  }
  for (const auto& [name, value] : attrs.values()) {
    if (absl::StartsWith(name, kAnnotationPrefix)) continue;
    if (std::find(def->attrs.begin(), def->attrs.end(), name) ==
        def->attrs.end()) {
      std::string known = def->attrs.empty() ? "none" : "";
      for (const auto& a : def->attrs) {
        absl::StrAppend(&known, known.empty() ? "" : ", ", a);
      }
      return absl::InvalidArgumentError(absl::StrCat(
          prefix(), "unknown attribute '", name, "' (it takes: ", known, ")"));
    }
  }
  // Tensors of a graph have positive dimensions (Graph checks each as it is
  // made); a caller passing others gets the same error, never an op's
  // division by a dimension of 0.
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto n_el = CheckedNumElements(inputs[i].shape);
    if (!n_el.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix(), "input ", i, ": ", n_el.status().message()));
    }
  }
  OpCall call{type, attrs, input_names, inputs, {}};
  auto out = def->infer(call);
  if (!out.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix(), out.status().message()));
  }
  for (size_t i = 0; i < out->size(); ++i) {
    auto n_el = CheckedNumElements((*out)[i].shape);
    if (!n_el.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix(), "output ", i, ": ", n_el.status().message()));
    }
  }
  return out;
}

namespace internal {

absl::StatusOr<int> NormalizeAxis(int64_t axis, int rank,
                                  absl::string_view what) {
  if (axis < -rank || axis >= rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", axis, " is out of range for rank ", rank));
  }
  return static_cast<int>(axis < 0 ? axis + rank : axis);
}

absl::StatusOr<Shape> BroadcastShapes(const Shape& a, const Shape& b) {
  size_t r = std::max(a.size(), b.size());
  Shape out(r);
  for (size_t i = 0; i < r; ++i) {
    int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    if (da != db && da != 1 && db != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("shapes ", ShapeString(a), " and ", ShapeString(b),
                       " do not broadcast (dimension ", i, ": ", da, " vs ",
                       db, ")"));
    }
    out[i] = std::max(da, db);
  }
  return out;
}

absl::Status ExpectRank(const OpCall& c, int i, int rank) {
  if (c.in(i).rank() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.Describe(i), " must have rank ", rank));
  }
  return absl::OkStatus();
}

absl::Status ExpectMinRank(const OpCall& c, int i, int rank) {
  if (c.in(i).rank() < rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.Describe(i), " must have rank at least ", rank));
  }
  return absl::OkStatus();
}

absl::Status ExpectFloating(const OpCall& c, int i) {
  if (!IsFloating(c.in(i).dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.Describe(i), " must be a floating-point tensor"));
  }
  return absl::OkStatus();
}

absl::Status ExpectInteger(const OpCall& c, int i) {
  if (!IsInteger(c.in(i).dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.Describe(i), " must be an integer tensor"));
  }
  return absl::OkStatus();
}

absl::Status ExpectSameDtype(const OpCall& c, int i, int j) {
  if (c.in(i).dtype != c.in(j).dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.Describe(i), " and ", c.Describe(j), " must have the same dtype"));
  }
  return absl::OkStatus();
}

int64_t Dim(const OpCall& c, int i, int dim) {
  const Shape& s = c.shape(i);
  return dim < 0 ? s[s.size() + dim] : s[dim];
}

}  // namespace internal
}  // namespace hap::graph
