// Lowering hooks of the mixture-of-experts family (planner/graph/ops_moe.cc):
// what a rank holding a piece of the experts, slots or tokens needs of the
// whole (executor/cpu/kernels.h).
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {
namespace {

// This rank's offset along `dim` of `t` when form `f` splits that dim.
int64_t OffsetIfSplit(const RankBuilder& b, TensorId t, Form f, int dim) {
  return f.is_sharded() && f.dim() == dim ? b.RankOffset(t, dim) : 0;
}

// The compact route holds global slots; a rank holding experts
// [offset, offset + local) keeps theirs. Grouped routing split by groups:
// this rank's run of every expert's slots, of the whole capacity.
void SlotAttrs(const RankBuilder& b, const synth::OpStep& s, const graph::Op& op, KernelAttrs& a) {
  const bool dispatch = op.type == "moe_dispatch_idx";
  const TensorId experts = dispatch ? op.outputs[0] : op.inputs[0];
  const Form f = dispatch ? s.rule.outputs[0] : s.rule.inputs[0];
  const graph::Shape& shape = b.graph().tensor(experts).type.shape;
  a["experts"].set_i(shape[0]);
  a["expert_offset"].set_i(OffsetIfSplit(b, experts, f, 0));
  a["capacity"].set_i(shape[1]);
  a["capacity_offset"].set_i(OffsetIfSplit(b, experts, f, 1));
}

// Grouped routing split by groups: this rank's tokens of the whole.
void RouteAttrs(const RankBuilder& b, const synth::OpStep& s, const graph::Op& op, KernelAttrs& a) {
  a["global_tokens"].set_i(b.graph().tensor(op.inputs[0]).type.shape[0]);
  a["token_offset"].set_i(OffsetIfSplit(b, op.inputs[0], s.rule.inputs[0], 0));
}

}  // namespace

const OpLowering* MoeLowering(absl::string_view type) {
  static const OpLowering kSlots = AttrsOnly(SlotAttrs);
  static const OpLowering kRoute = AttrsOnly(RouteAttrs);
  if (type == "moe_dispatch_idx" || type == "moe_combine_idx") return &kSlots;
  if (type == "moe_route") return &kRoute;
  return nullptr;
}

}  // namespace hap::lower::internal
