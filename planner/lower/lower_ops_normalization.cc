// Lowering hooks of the normalization family (planner/graph/ops_normalization.cc).
// batch_norm normalises with the whole batch's statistics: over a batch
// sharded along dimension 0 (its "data(0)" rule) the per-channel sums of x
// and x^2 are all-reduced between its pieces, so every rank normalises as
// the single device does (executor/cpu/kernels_batch_norm.cc); backward
// likewise with the sums of dy and dy * xhat.
#include "common/status_macros.h"
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {
namespace {

// Elements per channel of the whole batch.
void BatchNormAttrs(const RankBuilder& b, const synth::OpStep&, const graph::Op& op,
                    KernelAttrs& a) {
  const graph::Shape& in0 = b.graph().tensor(op.inputs[0]).type.shape;
  a["global_count"].set_i(graph::NumElements(in0) / in0[1]);
}

bool BatchSharded(const synth::OpStep& s) {
  return s.rule.inputs[0].is_sharded() && s.rule.inputs[0].dim() == 0;
}

// A replicated f64 [2, c] buffer of per-channel sums.
int SumsBuffer(RankBuilder& b, const std::string& name, int64_t c) {
  return b.AddBuffer(name, {2, c}, graph::DType::kFloat64, v1::Buffer::SCRATCH, Form::R().raw(),
                     {2, c}, {0, 0});
}

void AllReduceSums(RankBuilder& b, v1::Step::Phase phase, int in, int out, TensorId x,
                   const std::string& name) {
  b.Coll(phase, v1::ALL_REDUCE, in, out, x)->set_tensor(name);
}

int64_t Channels(const RankBuilder& b, const graph::Op& op) {
  return b.graph().tensor(op.inputs[0]).type.shape[1];
}

absl::Status ShardedForward(RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                            std::vector<int> in, const std::vector<int>& out) {
  const auto F = v1::Step::FORWARD;
  const int64_t c = Channels(b, op);
  const int local = SumsBuffer(b, op.name + "#sums", c);
  const int global = SumsBuffer(b, op.name + "#sums_all", c);
  b.OpAttrs(s, op, b.Kernel(F, "batch_norm_stats", {in[0]}, {local}, op.name));
  AllReduceSums(b, F, local, global, op.inputs[0], op.name + "#sums");
  in.resize(5, -1);  // running statistics absent
  in.push_back(global);
  b.OpAttrs(s, op, b.Kernel(F, "batch_norm_apply", in, out, op.name));
  b.SaveForBackward(s.op, global);
  return absl::OkStatus();
}

absl::Status ShardedBackward(RankBuilder& b, const synth::OpStep& s, const graph::Op& op,
                             const OpGradients& io) {
  const auto B = v1::Step::BACKWARD;
  HAP_ASSIGN_OR_RETURN(int sums, b.SavedForBackward(s.op, "all-reduced sums"));
  if (io.dys[0] < 0) return absl::OkStatus();
  const int64_t c = Channels(b, op);
  const int local = SumsBuffer(b, op.name + "#grad_sums", c);
  const int global = SumsBuffer(b, op.name + "#grad_sums_all", c);
  b.OpAttrs(s, op,
            b.Kernel(B, "batch_norm_grad_stats", {io.in[0], sums, io.dys[0]}, {local}, op.name));
  AllReduceSums(b, B, local, global, op.inputs[0], op.name + "#grad_sums");
  b.OpAttrs(s, op,
            b.Kernel(B, "batch_norm_grad_apply", {io.in[0], io.in[1], sums, global, io.dys[0]},
                     {io.dxs[0], io.dxs[1], io.dxs[2]}, op.name));
  return absl::OkStatus();
}

// batch_norm updates its running statistics (frozen parameters) in place;
// one stored ZeRO-sharded was updated in its gathered whole copy, so the
// rank's shard takes its slice back.
void WriteBackRunningStats(RankBuilder& b, const graph::Op& op, const std::vector<int>& in) {
  for (size_t j = 3; j < op.inputs.size() && j < in.size(); ++j) {
    const int shard = b.ZeroStorage(op.inputs[j]);
    if (shard < 0 || in[j] < 0) continue;
    b.SliceAttrs(b.Kernel(v1::Step::FORWARD, "slice", {in[j]}, {shard}), op.inputs[j], 0);
  }
}

}  // namespace

const OpLowering* NormalizationLowering(absl::string_view type) {
  static const OpLowering kBatchNorm = [] {
    OpLowering h;
    h.attrs = BatchNormAttrs;
    h.lowers_apart = BatchSharded;
    h.forward = ShardedForward;
    h.backward = ShardedBackward;
    h.after_forward = WriteBackRunningStats;
    return h;
  }();
  return type == "batch_norm" ? &kBatchNorm : nullptr;
}

}  // namespace hap::lower::internal
