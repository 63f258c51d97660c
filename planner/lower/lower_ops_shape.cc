// Lowering hooks of the shape family (planner/graph/ops_shape.cc): an
// embedding whose table is split by rows looks up only the ids in its rows.
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {
namespace {

void EmbeddingAttrs(const RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                    KernelAttrs& a) {
  const graph::Shape& table = b.graph().tensor(op.inputs[1]).type.shape;
  a["vocab_size"].set_i(table[0]);
  const Form tf = s.rule.inputs[1];
  a["vocab_offset"].set_i(tf.is_sharded() && tf.dim() == 0 ? b.RankOffset(op.inputs[1], 0) : 0);
}

}  // namespace

const OpLowering* ShapeLowering(absl::string_view type) {
  static const OpLowering kEmbedding = AttrsOnly(EmbeddingAttrs);
  return type == "embedding" ? &kEmbedding : nullptr;
}

}  // namespace hap::lower::internal
