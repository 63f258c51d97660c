// Backward: ops' gradients (SFB included) and the transposes of forward collectives.
// Part of lower::internal::RankBuilder (rank_builder.h).

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {

absl::Status RankBuilder::Backward(int k) {
  const synth::OpStep& s = p_.steps[k];
  const graph::Op& op = g_.op(s.op);
  if (IsZero3Step(k)) {
    // This op's backward gathers (those not started yet), then the
    // previous op's, one ahead; each waited for at its first use.
    PrefetchRegathers(k);
    auto prev = std::lower_bound(zero3_steps_.begin(), zero3_steps_.end(), k);
    if (prev != zero3_steps_.begin()) PrefetchRegathers(*(prev - 1));
  }
  // The op's gradient kernel.
  bool any_dy = false;
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    any_dy = any_dy || HasGrad(K(op.outputs[j], s.rule.outputs[j]));
  }
  bool any_dx = false;
  for (size_t j = 0; j < op.inputs.size(); ++j) {
    any_dx =
        any_dx || (a_.requires_grad[op.inputs[j]] && Differentiable(g_, op, static_cast<int>(j)));
  }
  if (any_dy && any_dx) {
    HAP_RETURN_IF_ERROR(OpBackward(k, s, op));
  }
  // The duals of the communication in front of it, last first.
  for (auto c = s.comms.rbegin(); c != s.comms.rend(); ++c) {
    HAP_RETURN_IF_ERROR(CommBackward(*c));
  }
  // Gradient synchronisation of the parameters it loaded.
  for (const synth::SourceLoad& l : s.loads) {
    if (l.parameter && !g_.tensor(l.tensor).frozen) SyncParameter(l);
  }
  StartGradientBuckets(k);
  return absl::OkStatus();
}

absl::Status RankBuilder::OpBackward(int k, const synth::OpStep& s, const graph::Op& op) {
  const auto B = v1::Step::BACKWARD;
  std::vector<int> in, outs, dys, dxs;
  bool replicated_rule = !s.rule.split && s.rule.kind != synth::RuleKind::kPartial;
  bool any_partial_out = false;
  for (TensorId o : op.outputs) any_partial_out = any_partial_out || a_.partial_grad[o];
  for (size_t j = 0; j < op.inputs.size(); ++j) {
    Key key = K(op.inputs[j], s.rule.inputs[j]);
    HAP_RETURN_IF_ERROR(Fwd(key, op).status());
    in.push_back(BwdValue(key));
  }
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    Key key = K(op.outputs[j], s.rule.outputs[j]);
    outs.push_back(BwdValue(key));
    int dy = HasGrad(key) ? grad_.at(key) : -1;
    // A replicated op whose outputs' gradients are partly partial: the
    // whole ones count on rank 0 only, and every input gradient is partial.
    if (replicated_rule && any_partial_out && !a_.partial_grad[op.outputs[j]] && r_ != 0) {
      dy = -1;
    }
    dys.push_back(dy);
  }
  TensorId sfb = a_.sfb_param[k];
  for (size_t j = 0; j < op.inputs.size(); ++j) {
    TensorId t = op.inputs[j];
    if (!a_.requires_grad[t] || !Differentiable(g_, op, static_cast<int>(j)) ||
        (sfb == t && synth::SfbFactors(g_, op, static_cast<int>(j)))) {
      dxs.push_back(-1);
      continue;
    }
    Form f = s.rule.inputs[j];
    bool partial =
        f.is_replicated() && PartialContribution(s, op, static_cast<int>(j), a_.partial_grad);
    HAP_ASSIGN_OR_RETURN(int dx, GradTarget(K(t, f), partial, B, op.name));
    dxs.push_back(dx);
  }
  std::vector<int> inputs = in;
  inputs.insert(inputs.end(), outs.begin(), outs.end());
  inputs.insert(inputs.end(), dys.begin(), dys.end());
  bool any_out = std::any_of(dxs.begin(), dxs.end(), [](int x) { return x >= 0; });
  bool any_in = std::any_of(dys.begin(), dys.end(), [](int x) { return x >= 0; });
  if (any_out && any_in) {
    const OpLowering* hooks = FindOpLowering(op.type);
    if (hooks != nullptr && hooks->lowers_apart != nullptr && hooks->lowers_apart(s)) {
      HAP_RETURN_IF_ERROR(hooks->backward(*this, s, op, OpGradients{in, dys, dxs}));
    } else {
      OpAttrs(s, op, Kernel(B, op.type + "_grad", inputs, dxs, op.name));
    }
  }
  if (sfb >= 0) HAP_RETURN_IF_ERROR(SfbBackward(k, s, op, in));
  return absl::OkStatus();
}

// Sufficient factor broadcasting: gather x and dy of a data-parallel
// linear, and every rank computes the whole weight gradient.
absl::Status RankBuilder::SfbBackward(int k, const synth::OpStep& s, const graph::Op& op,
                                      const std::vector<int>& in) {
  const auto B = v1::Step::GRADIENT_SYNC;
  const TensorId w = a_.sfb_param[k];
  const int wj =
      static_cast<int>(std::find(op.inputs.begin(), op.inputs.end(), w) - op.inputs.begin());
  const std::optional<synth::SufficientFactors> f = synth::SfbFactors(g_, op, wj);
  if (!f) {
    return absl::InternalError(absl::StrCat("op '", op.name,
                                            "': sufficient factor broadcasting of '",
                                            g_.tensor(w).name, "', which has no factors"));
  }
  const TensorId x = op.inputs[f->x_input], y = op.outputs[f->y_output];
  Form xf = s.rule.inputs[f->x_input];
  Key yk = K(y, s.rule.outputs[f->y_output]);
  if (!HasGrad(yk) || !xf.is_sharded()) return absl::OkStatus();
  synth::Method method = synth::Method::kPadded;
  for (const auto& l : p_.steps[k].loads) {
    if (l.tensor == w) method = l.method;
  }
  int xs = NewBuffer(x, Form::R().raw(), v1::Buffer::SCRATCH, "#sfb");
  int dys = NewBuffer(y, Form::R().raw(), v1::Buffer::SCRATCH, "#sfb_grad");
  Sharded(B, v1::ALL_GATHER, method, in[f->x_input], xs, x, xf.dim());
  Sharded(B, v1::ALL_GATHER, method, grad_.at(yk), dys, y, xf.dim());
  HAP_ASSIGN_OR_RETURN(int dw, GradTarget(K(w, Form::R()), false, B, op.name));
  // The op's gradient kernel on the gathered factors, only dW wanted: its
  // inputs (x gathered), its outputs (not read: dy in their place) and the
  // outputs' gradients.
  std::vector<int> inputs, dx;
  for (size_t j = 0; j < op.inputs.size(); ++j) {
    inputs.push_back(static_cast<int>(j) == f->x_input ? xs : in[j]);
    dx.push_back(static_cast<int>(j) == wj ? dw : -1);
  }
  for (size_t j = 0; j < 2 * op.outputs.size(); ++j) inputs.push_back(dys);
  if (dw >= 0) Kernel(B, op.type + "_grad", inputs, dx, op.name);
  return absl::OkStatus();
}

absl::Status RankBuilder::CommBackward(const synth::CommStep& c) {
  Key to = K(c.tensor, c.to), from = K(c.tensor, c.from);
  if (!a_.requires_grad[c.tensor] || !HasGrad(to)) return absl::OkStatus();
  const auto B = v1::Step::BACKWARD;
  using C = synth::Collective;
  int gt = grad_.at(to);
  bool gt_partial = GradForm(to) == Form::P().raw();
  std::string what = absl::StrCat("dual of ", synth::CollectiveName(c.forward), " of '",
                                  g_.tensor(c.tensor).name, "'");
  auto accumulate = [&](int src, bool partial) -> absl::Status {
    HAP_ASSIGN_OR_RETURN(int dst, GradTarget(from, partial, B, what));
    if (dst >= 0) Kernel(B, "accumulate", {src}, {dst});
    return absl::OkStatus();
  };
  switch (c.forward) {
    case C::kAllGather: {  // S(d) -> R; gradient back to S(d)
      int d = c.from.dim();
      int tmp = Scratch(c.tensor, c.from.raw());
      if (gt_partial) {
        Sharded(B, v1::REDUCE_SCATTER, c.method, gt, tmp, c.tensor, d);
      } else {
        SliceAttrs(Kernel(B, "slice", {gt}, {tmp}), c.tensor, d);
      }
      return accumulate(tmp, false);
    }
    case C::kAllReduce:  // P -> R; gradient of P is whole
      if (gt_partial) Coll(B, v1::ALL_REDUCE, gt, gt, c.tensor);
      return accumulate(gt, false);
    case C::kReduceScatter: {  // P -> S(d); gradient of P is whole
      int tmp = Scratch(c.tensor, Form::R().raw());
      Sharded(B, v1::ALL_GATHER, c.method, gt, tmp, c.tensor, c.to.dim());
      return accumulate(tmp, false);
    }
    case C::kAllToAll: {  // S(i) -> S(j); back S(j) -> S(i)
      int tmp = Scratch(c.tensor, c.from.raw());
      v1::CollectiveCall* call =
          Sharded(B, v1::ALL_TO_ALL, c.method, gt, tmp, c.tensor, c.from.dim());
      call->set_from_dim(c.to.dim());
      for (int64_t l : dims_.Layout(c.tensor, c.to.dim()).lengths) {
        call->add_from_shard_sizes(l);
      }
      return accumulate(tmp, false);
    }
    case C::kSlice: {  // R -> S(d); gradient back to R by all-gather
      // The S(d) gradients gathered make the R gradient whole: a small
      // activation gathered (e.g. the embedding's output) instead of the
      // parameters before it all-reducing partial gradients (the
      // embedding table), as the search prices it.
      int tmp = Scratch(c.tensor, c.from.raw());
      Sharded(B, v1::ALL_GATHER, c.method, gt, tmp, c.tensor, c.to.dim());
      return accumulate(tmp, false);
    }
    case C::kZeroOut: {  // R -> P: only rank 0's copy counted
      HAP_ASSIGN_OR_RETURN(int dst, GradTarget(from, true, B, what));
      if (r_ == 0) Kernel(B, "accumulate", {gt}, {dst});
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

}  // namespace hap::lower::internal
