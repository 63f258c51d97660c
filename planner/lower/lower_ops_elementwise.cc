// Lowering hooks of the element-wise family (planner/graph/ops_elementwise.cc):
// dropout and drop_path draw counter-based masks keyed by global indices
// (drop_path: by sample), so every sharding draws the single device's mask.
#include "executor/runtime/random.h"
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {
namespace {

void RandomMaskAttrs(const RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                     KernelAttrs& a) {
  const uint64_t key = executor::CounterKey(b.options().seed, executor::HashName(op.name));
  a["rng_key"].set_i(static_cast<int64_t>(key));
  auto* gs = a["global_shape"].mutable_ints();
  for (int64_t d : b.graph().tensor(op.inputs[0]).type.shape) gs->add_values(d);
  auto* off = a["offsets"].mutable_ints();
  for (int64_t d : b.Offsets(op.inputs[0], s.rule.inputs[0].raw())) off->add_values(d);
}

}  // namespace

const OpLowering* ElementwiseLowering(absl::string_view type) {
  static const OpLowering kRandomMask = AttrsOnly(RandomMaskAttrs);
  return type == "dropout" || type == "drop_path" ? &kRandomMask : nullptr;
}

}  // namespace hap::lower::internal
