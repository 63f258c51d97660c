// Lowering hooks of the reduction family (planner/graph/ops_reduction.cc):
// a mean over a sharded axis divides by the whole count.
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {
namespace {

void MeanAttrs(const RankBuilder& b, const synth::OpStep&, const graph::Op& op, KernelAttrs& a) {
  const graph::Shape& in0 = b.graph().tensor(op.inputs[0]).type.shape;
  std::vector<int64_t> axes = op.attrs.Ints("axes", {}).value_or(std::vector<int64_t>{});
  int64_t count = 1;
  int rank = static_cast<int>(in0.size());
  for (int d = 0; d < rank; ++d) {
    bool reduced = axes.empty();
    for (int64_t x : axes) reduced = reduced || (x < 0 ? x + rank : x) == d;
    if (reduced) count *= in0[d];
  }
  a["global_count"].set_i(count);
}

}  // namespace

const OpLowering* ReductionLowering(absl::string_view type) {
  static const OpLowering kMean = AttrsOnly(MeanAttrs);
  return type == "mean" ? &kMean : nullptr;
}

}  // namespace hap::lower::internal
