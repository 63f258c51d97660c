// Reductions: sum and mean over a set of axes.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {
namespace {

void Reduction(OpRegistry& r, const std::string& type) {
  OpDef d;
  d.type = type;
  d.attrs = {"axes", "keepdims"};
  d.summary = type +
              "(x; axes=[] (all), keepdims=false) -> reduced over the axes";
  d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
    HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
    HAP_ASSIGN_OR_RETURN(std::vector<int64_t> axes, c.attrs.Ints("axes", {}));
    HAP_ASSIGN_OR_RETURN(bool keep, c.attrs.Bool("keepdims", false));
    int rank = c.in(0).rank();
    std::vector<bool> reduced(rank, axes.empty());
    for (int64_t a : axes) {
      HAP_ASSIGN_OR_RETURN(int ax, NormalizeAxis(a, rank, "axis"));
      if (reduced[ax]) {
        return absl::InvalidArgumentError(
            absl::StrCat("axis ", a, " is listed twice"));
      }
      reduced[ax] = true;
    }
    Shape s;
    for (int i = 0; i < rank; ++i) {
      if (!reduced[i]) {
        s.push_back(c.shape(0)[i]);
      } else if (keep) {
        s.push_back(1);
      }
    }
    return std::vector<TensorType>{{c.in(0).dtype, s}};
  };
  d.flops = [](const OpCall& c) {
    return static_cast<double>(c.in(0).num_elements());
  };
  d.backward_flops_multiple = 1.0;
  r.Register(std::move(d));
}

}  // namespace

void RegisterReductionOps(OpRegistry& r) {
  Reduction(r, "sum");
  Reduction(r, "mean");
}

}  // namespace hap::graph::internal
