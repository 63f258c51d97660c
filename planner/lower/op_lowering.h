// Per-op lowering hooks (docs/design.md §7). Lowering emits one kernel call
// per op forward (`<type>`) and one per backward (`<type>_grad`), with the
// op's attributes; an op type that needs more says so here, in its family's
// file (lower_ops_*.cc, as planner/graph/ops_*.cc and the rule families of
// planner/synth do), so adding or changing an op touches one place rather
// than branches inside the generic passes. Internal to planner/lower.
#ifndef HAP_PLANNER_LOWER_OP_LOWERING_H_
#define HAP_PLANNER_LOWER_OP_LOWERING_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"
#include "planner/synth/program.h"

namespace hap::lower::internal {

class RankBuilder;

using KernelAttrs = google::protobuf::Map<std::string, v1::AttrValue>;

// One op's backward as the generic pass prepared it: the forward inputs as
// backward reads them, the outputs' gradients and the inputs' gradient
// targets (-1 where there is none), in the op's input and output order.
struct OpGradients {
  std::vector<int> in, dys, dxs;
};

// What one op type does beyond the generic lowering. Every hook is
// optional (null: the generic behaviour).
struct OpLowering {
  // Attributes a rank's kernels need of the whole beyond the op's own
  // (global counts, this rank's offsets, random keys), added to every
  // kernel call of the op, forward and backward.
  void (*attrs)(const RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                KernelAttrs& a) = nullptr;
  // Whether bf16 mixed precision (LowerOptions::bf16) rounds this op's
  // products.
  bool (*bf16_product)(const graph::Op& op) = nullptr;
  // Whether this step's rule lowers to more than one kernel call
  // (collectives between them); then `forward` and `backward` replace the
  // generic kernel calls. `forward` gets the input buffers (-1 for an
  // operand read on rank 0 only) and the output buffers.
  bool (*lowers_apart)(const synth::OpStep& s) = nullptr;
  absl::Status (*forward)(RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                          std::vector<int> in, const std::vector<int>& out) = nullptr;
  absl::Status (*backward)(RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                           const OpGradients& io) = nullptr;
  // After the op's forward, whichever way it lowered (e.g. batch_norm's
  // running statistics back into their ZeRO shard).
  void (*after_forward)(RankBuilder& b, const graph::Op& op, const std::vector<int>& in) = nullptr;
};

// Hooks that only add kernel attributes, or only mark bf16 products.
OpLowering AttrsOnly(decltype(OpLowering::attrs) attrs);
OpLowering Bf16ProductOnly(decltype(OpLowering::bf16_product) bf16_product);

// The hooks of `type`, or null when the generic lowering is all it needs.
const OpLowering* FindOpLowering(absl::string_view type);

// The families (lower_ops_*.cc): each returns the hooks of the types it
// owns, null for any other.
const OpLowering* ConvolutionLowering(absl::string_view type);
const OpLowering* ElementwiseLowering(absl::string_view type);
const OpLowering* LinearLowering(absl::string_view type);
const OpLowering* LossLowering(absl::string_view type);
const OpLowering* MoeLowering(absl::string_view type);
const OpLowering* NormalizationLowering(absl::string_view type);
const OpLowering* ReductionLowering(absl::string_view type);
const OpLowering* ShapeLowering(absl::string_view type);

}  // namespace hap::lower::internal

#endif  // HAP_PLANNER_LOWER_OP_LOWERING_H_
