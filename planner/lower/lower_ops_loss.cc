// Lowering hooks of the loss family (planner/graph/ops_loss.cc). A loss over
// rows split between ranks divides by the whole batch's rows. Cross-entropy
// over logits sharded by class (the "vocab" rule): each rank's row
// log-sum-exps are all-gathered, then each rank computes its part of the
// loss (P) and, in backward, its classes' gradient
// (executor/cpu/kernels_loss.cc).
#include "common/status_macros.h"
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {
namespace {

void LossAttrs(const RankBuilder& b, const synth::OpStep&, const graph::Op& op, KernelAttrs& a) {
  a["global_rows"].set_i(b.graph().tensor(op.inputs[0]).type.shape[0]);
}

bool ByVocabulary(const synth::OpStep& s) { return s.rule.name == "vocab"; }

void VocabAttrs(RankBuilder& b, const synth::OpStep& s, const graph::Op& op, v1::KernelCall* k) {
  b.OpAttrs(s, op, k);
  auto& a = *k->mutable_attrs();
  a["vocab_offset"].set_i(b.RankOffset(op.inputs[0], 1));
  a["vocab_size"].set_i(b.graph().tensor(op.inputs[0]).type.shape[1]);
  a["rank"].set_i(b.rank());
  a["ranks"].set_i(b.options().world_size);
}

absl::Status VocabForward(RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                          std::vector<int> in, const std::vector<int>& out) {
  const auto F = v1::Step::FORWARD;
  const int64_t rows = b.graph().tensor(op.inputs[0]).type.shape[0];
  const int n = b.options().world_size;
  const int lse = b.RowBuffer(op.name + "#lse", rows, op.inputs[0]);
  const int all = b.RowBuffer(op.name + "#lse_all", rows * n, op.inputs[0]);
  VocabAttrs(b, s, op, b.Kernel(F, "cross_entropy_lse", {in[0]}, {lse}, op.name));
  v1::CollectiveCall* c = b.Coll(F, v1::ALL_GATHER, lse, all, op.inputs[0]);
  c->set_tensor(op.name + "#lse");
  c->set_method(MethodProto(synth::Method::kPadded));
  c->set_dim(0);
  for (int r = 0; r < n; ++r) c->add_shard_sizes(rows);
  VocabAttrs(b, s, op,
             b.Kernel(F, "cross_entropy_sharded", {in[0], in[1], all}, {out[0]}, op.name));
  b.SaveForBackward(s.op, all);
  return absl::OkStatus();
}

// softmax - onehot over this rank's classes, from the gathered
// log-sum-exps; the targets get no gradient.
absl::Status VocabBackward(RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                           const OpGradients& io) {
  HAP_ASSIGN_OR_RETURN(int lse, b.SavedForBackward(s.op, "gathered log-sum-exps"));
  if (io.dxs[0] >= 0 && io.dys[0] >= 0) {
    VocabAttrs(b, s, op,
               b.Kernel(v1::Step::BACKWARD, "cross_entropy_sharded_grad",
                        {io.in[0], io.in[1], lse, io.dys[0]}, {io.dxs[0]}, op.name));
  }
  return absl::OkStatus();
}

}  // namespace

const OpLowering* LossLowering(absl::string_view type) {
  static const OpLowering kNllLoss = AttrsOnly(LossAttrs);
  static const OpLowering kCrossEntropy = [] {
    OpLowering h;
    h.attrs = LossAttrs;
    h.lowers_apart = ByVocabulary;
    h.forward = VocabForward;
    h.backward = VocabBackward;
    return h;
  }();
  if (type == "nll_loss") return &kNllLoss;
  if (type == "cross_entropy") return &kCrossEntropy;
  return nullptr;
}

}  // namespace hap::lower::internal
