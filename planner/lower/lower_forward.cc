// Forward: ops (with their families' hooks, op_lowering.h), the loss and a
// stage's output.
// Part of lower::internal::RankBuilder (rank_builder.h).

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/op_registry.h"
#include "planner/lower/op_lowering.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {

absl::Status RankBuilder::Forward(int k) {
  const synth::OpStep& s = p_.steps[k];
  const graph::Op& op = g_.op(s.op);
  const auto F = v1::Step::FORWARD;
  for (const synth::SourceLoad& l : s.loads) {
    const graph::Tensor& t = g_.tensor(l.tensor);
    if (!l.parameter) {
      fwd_[K(l.tensor, l.form)] = NewBuffer(l.tensor, l.form.raw(), v1::Buffer::INPUT);
      continue;
    }
    ParamSlot slot;
    slot.tensor = l.tensor;
    auto once = gather_once_.find(l.tensor);
    if (once != gather_once_.end()) {
      // Gathered before forward (GatherOnceParameters); the whole copy
      // stays for backward.
      slot.storage = {l.tensor, kZeroStorage};
      fwd_[slot.storage] = once->second.in;
      fwd_[K(l.tensor, Form::R())] = once->second.out;
    } else if (l.storage == synth::ParamStorage::kZero) {
      slot.storage = {l.tensor, kZeroStorage};
      auto pre = prefetched_.find(l.tensor);
      std::pair<int, int> gathered;
      if (pre == prefetched_.end()) {
        gathered = GatherZero3(l, /*async=*/false);
      } else {
        gathered = pre->second;
        prefetched_.erase(pre);
      }
      fwd_[slot.storage] = gathered.first;
      fwd_[K(l.tensor, Form::R())] = gathered.second;
      zero_gathered_[K(l.tensor, Form::R())] = {fwd_.at(slot.storage), l.method};
    } else {
      slot.storage = K(l.tensor, l.form);
      fwd_[slot.storage] = NewBuffer(l.tensor, l.form.raw(), v1::Buffer::PARAMETER);
    }
    slot.replicated = l.storage == synth::ParamStorage::kReplicated;
    if (!t.frozen) params_.push_back(slot);
  }
  if (IsZero3Step(k)) {
    // The next op's gathers queue behind this op's (waited for at their
    // first use below): one op ahead. (Steps, not op ids: a pipeline
    // stage's step k is op begin_op + k.)
    auto next = std::upper_bound(zero3_steps_.begin(), zero3_steps_.end(), k);
    if (next != zero3_steps_.end()) PrefetchGathers(*next);
  }
  if (st_ != nullptr) {
    // A model input whose load sits in another stage: loaded here.
    for (const synth::CommStep& c : s.comms) StageLoad(K(c.tensor, c.from));
    for (size_t j = 0; j < op.inputs.size(); ++j) StageLoad(K(op.inputs[j], s.rule.inputs[j]));
  }
  for (const synth::CommStep& c : s.comms) {
    HAP_ASSIGN_OR_RETURN(int in, Fwd(K(c.tensor, c.from), op));
    int out = NewBuffer(c.tensor, c.to.raw(), v1::Buffer::ACTIVATION);
    fwd_[K(c.tensor, c.to)] = out;
    EmitForwardComm(c, in, out);
  }
  std::vector<int> in, out;
  for (size_t j = 0; j < op.inputs.size(); ++j) {
    HAP_ASSIGN_OR_RETURN(int id, Fwd(K(op.inputs[j], s.rule.inputs[j]), op));
    in.push_back(AddedOnce(s.rule, static_cast<int>(j)) && r_ != 0 ? -1 : id);
  }
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    Key k = K(op.outputs[j], s.rule.outputs[j]);
    int id = NewBuffer(op.outputs[j], k.second, v1::Buffer::ACTIVATION);
    fwd_[k] = id;
    out.push_back(id);
  }
  const OpLowering* hooks = FindOpLowering(op.type);
  if (hooks != nullptr && hooks->lowers_apart != nullptr && hooks->lowers_apart(s)) {
    HAP_RETURN_IF_ERROR(hooks->forward(*this, s, op, in, out));
  } else {
    OpAttrs(s, op, Kernel(F, op.type, in, out, op.name));
  }
  if (hooks != nullptr && hooks->after_forward != nullptr) hooks->after_forward(*this, op, in);
  return absl::OkStatus();
}

void RankBuilder::EmitForwardComm(const synth::CommStep& c, int in, int out) {
  const auto F = v1::Step::FORWARD;
  using C = synth::Collective;
  switch (c.forward) {
    case C::kAllGather:
      Sharded(F, v1::ALL_GATHER, c.method, in, out, c.tensor, c.from.dim());
      break;
    case C::kAllReduce:
      Coll(F, v1::ALL_REDUCE, in, out, c.tensor);
      break;
    case C::kReduceScatter:
      Sharded(F, v1::REDUCE_SCATTER, c.method, in, out, c.tensor, c.to.dim());
      break;
    case C::kAllToAll: {
      v1::CollectiveCall* call =
          Sharded(F, v1::ALL_TO_ALL, c.method, in, out, c.tensor, c.to.dim());
      call->set_from_dim(c.from.dim());
      for (int64_t l : dims_.Layout(c.tensor, c.from.dim()).lengths) {
        call->add_from_shard_sizes(l);
      }
      break;
    }
    case C::kSlice:
      SliceAttrs(Kernel(F, "slice", {in}, {out}), c.tensor, c.to.dim());
      break;
    case C::kZeroOut:
      if (r_ == 0) {
        Kernel(F, "copy", {in}, {out});
      } else {
        Fill(F, out, 0.0);
      }
      break;
  }
}

// Attributes for sharded execution (executor/cpu/kernels.h).
void RankBuilder::OpAttrs(const synth::OpStep& s, const graph::Op& op, v1::KernelCall* call) {
  auto& a = *call->mutable_attrs();
  for (const auto& [name, v] : op.attrs.values()) {
    if (name.rfind(graph::kAnnotationPrefix, 0) == 0) continue;
    graph::AttrToProto(v, &a[name]);
  }
  const OpLowering* hooks = FindOpLowering(op.type);
  if (hooks == nullptr) return;
  if (o_.bf16 && hooks->bf16_product != nullptr && hooks->bf16_product(op)) a["bf16"].set_b(true);
  if (hooks->attrs != nullptr) hooks->attrs(*this, s, op, a);
}

absl::Status RankBuilder::Loss() {
  TensorId l = g_.loss();
  Key k = K(l, Form::R());
  if (!fwd_.count(k)) k = K(l, Form::P());
  if (!fwd_.count(k)) {
    return absl::FailedPreconditionError("the program does not compute the loss in form R or P");
  }
  int loss = NewBuffer(l, Form::R().raw(), v1::Buffer::LOSS, "#value");
  prog_.set_loss_buffer(loss);
  if (Form::FromRaw(k.second).is_partial()) {
    // This rank's part now; summed with the gradient bucket after backward
    // (FlushGradientBuckets): nothing reads the value before the step
    // ends, and one synchronisation fewer per step.
    Kernel(v1::Step::FORWARD, "copy", {fwd_[k]}, {loss});
    partial_loss_ = loss;
  } else {
    Kernel(v1::Step::FORWARD, "copy", {fwd_[k]}, {loss});
  }
  // dL/dL = 1, whole on every rank (the gradient of a P or R loss is R);
  // a pipeline stage's microbatch counts 1 / microbatches of the step.
  int seed = Grad(k, v1::Step::BACKWARD);
  Fill(v1::Step::BACKWARD, seed, st_ != nullptr ? 1.0 / st_->microbatches : 1.0);
  return absl::OkStatus();
}

// A pipeline stage's end: the output for the next stage, and its
// gradient from there seeding backward. The LOSS buffer holds 0.
absl::Status RankBuilder::StageOutput() {
  Key k = K(st_->output, st_->output_form);
  auto it = fwd_.find(k);
  if (it == fwd_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("the stage never produces its output '",
                                                   g_.tensor(st_->output).name, "' as ",
                                                   st_->output_form.ToString()));
  }
  int out = NewBuffer(st_->output, k.second, v1::Buffer::STAGE_OUTPUT, "#stage_out");
  Kernel(v1::Step::FORWARD, "copy", {it->second}, {out});
  int loss = NewBuffer(g_.loss(), Form::R().raw(), v1::Buffer::LOSS, "#value");
  prog_.set_loss_buffer(loss);
  Fill(v1::Step::FORWARD, loss, 0.0);
  int in =
      NewBuffer(st_->output, GradForm(k), v1::Buffer::STAGE_OUTPUT_GRADIENT, "#stage_out_grad");
  Kernel(v1::Step::BACKWARD, "copy", {in}, {Grad(k, v1::Step::BACKWARD)});
  return absl::OkStatus();
}

// Stage mode: a model input read as `k` and loaded by no step of this
// stage gets an INPUT buffer of that form.
void RankBuilder::StageLoad(Key k) {
  if (g_.tensor(k.first).kind != graph::TensorKind::kInput || fwd_.count(k)) return;
  fwd_[k] = NewBuffer(k.first, k.second, v1::Buffer::INPUT);
}

}  // namespace hap::lower::internal
