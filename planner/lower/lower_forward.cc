// Forward: ops, batch_norm's and vocabulary-parallel cross-entropy's collectives, the loss and a
// stage's output.
// Part of lower::internal::RankBuilder (rank_builder.h).

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/runtime/random.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/op_registry.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {

absl::Status RankBuilder::Forward(const synth::OpStep& s) {
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
  if (IsZero3Step(s.op)) {
    // The next op's gathers queue behind this op's (waited for at their
    // first use below): one op ahead.
    auto next = std::upper_bound(zero3_steps_.begin(), zero3_steps_.end(), s.op);
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
  if (IsVocabCrossEntropy(s, op)) return VocabCrossEntropy(s, op, in, out);
  if (IsShardedBatchNorm(s, op)) {
    ShardedBatchNorm(s, op, in, out);
  } else {
    v1::KernelCall* call = Kernel(F, op.type, in, out, op.name);
    OpAttrs(s, op, call);
  }
  if (op.type == "batch_norm") WriteBackRunningStats(op, in);
  return absl::OkStatus();
}

// batch_norm over a batch sharded along dimension 0 (its "data(0)" rule):
// the per-channel sums of x and x^2 are all-reduced between its pieces,
// so every rank normalises with the global batch's statistics
// (executor/cpu/kernels_batch_norm.cc); backward likewise with the sums of
// dy and dy * xhat.
bool RankBuilder::IsShardedBatchNorm(const synth::OpStep& s, const graph::Op& op) {
  return op.type == "batch_norm" && s.rule.inputs[0].is_sharded() && s.rule.inputs[0].dim() == 0;
}

// A replicated f64 [2, c] buffer of per-channel sums.
int RankBuilder::SumsBuffer(const std::string& name, int64_t c) {
  return AddBuffer(name, {2, c}, graph::DType::kFloat64, v1::Buffer::SCRATCH, Form::R().raw(),
                   {2, c}, {0, 0});
}

void RankBuilder::AllReduceSums(v1::Step::Phase phase, int in, int out, TensorId x,
                                const std::string& name) {
  Coll(phase, v1::ALL_REDUCE, in, out, x)->set_tensor(name);
}

void RankBuilder::ShardedBatchNorm(const synth::OpStep& s, const graph::Op& op, std::vector<int> in,
                                   const std::vector<int>& out) {
  const auto F = v1::Step::FORWARD;
  const int64_t c = g_.tensor(op.inputs[0]).type.shape[1];
  const int local = SumsBuffer(op.name + "#sums", c);
  const int global = SumsBuffer(op.name + "#sums_all", c);
  OpAttrs(s, op, Kernel(F, "batch_norm_stats", {in[0]}, {local}, op.name));
  AllReduceSums(F, local, global, op.inputs[0], op.name + "#sums");
  in.resize(5, -1);  // running statistics absent
  in.push_back(global);
  OpAttrs(s, op, Kernel(F, "batch_norm_apply", in, out, op.name));
  bn_sums_[s.op] = global;
}

// batch_norm updates its running statistics (frozen parameters) in place;
// one stored ZeRO-sharded was updated in its gathered whole copy, so the
// rank's shard takes its slice back.
void RankBuilder::WriteBackRunningStats(const graph::Op& op, const std::vector<int>& in) {
  for (size_t j = 3; j < op.inputs.size() && j < in.size(); ++j) {
    auto shard = fwd_.find({op.inputs[j], kZeroStorage});
    if (shard == fwd_.end() || in[j] < 0) continue;
    SliceAttrs(Kernel(v1::Step::FORWARD, "slice", {in[j]}, {shard->second}), op.inputs[j], 0);
  }
}

// Cross-entropy over logits sharded by class (the "vocab" rule): each
// rank's row log-sum-exps over its classes are all-gathered, then each
// rank computes its part of the loss (P) and, in backward, its classes'
// gradient (executor/cpu/kernels_loss.cc).
bool RankBuilder::IsVocabCrossEntropy(const synth::OpStep& s, const graph::Op& op) {
  return op.type == "cross_entropy" && s.rule.name == "vocab";
}

void RankBuilder::VocabAttrs(const synth::OpStep& s, const graph::Op& op, v1::KernelCall* k) {
  OpAttrs(s, op, k);
  auto& a = *k->mutable_attrs();
  a["vocab_offset"].set_i(dims_.Layout(op.inputs[0], 1).offsets[r_]);
  a["vocab_size"].set_i(g_.tensor(op.inputs[0]).type.shape[1]);
  a["rank"].set_i(r_);
  a["ranks"].set_i(o_.world_size);
}

absl::Status RankBuilder::VocabCrossEntropy(const synth::OpStep& s, const graph::Op& op,
                                            const std::vector<int>& in,
                                            const std::vector<int>& out) {
  const auto F = v1::Step::FORWARD;
  const int64_t rows = g_.tensor(op.inputs[0]).type.shape[0];
  const int n = o_.world_size;
  const int lse = RowBuffer(op.name + "#lse", rows, op.inputs[0]);
  const int all = RowBuffer(op.name + "#lse_all", rows * n, op.inputs[0]);
  VocabAttrs(s, op, Kernel(F, "cross_entropy_lse", {in[0]}, {lse}, op.name));
  v1::CollectiveCall* c = Coll(F, v1::ALL_GATHER, lse, all, op.inputs[0]);
  c->set_tensor(op.name + "#lse");
  c->set_method(MethodProto(synth::Method::kPadded));
  c->set_dim(0);
  for (int r = 0; r < n; ++r) c->add_shard_sizes(rows);
  VocabAttrs(s, op, Kernel(F, "cross_entropy_sharded", {in[0], in[1], all}, {out[0]}, op.name));
  vocab_lse_[s.op] = all;
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

// The ops whose products bf16 mixed precision rounds (LowerOptions::bf16);
// grouped convolutions have no bf16 kernels and stay float32.
bool RankBuilder::IsBf16Product(const graph::Op& op) {
  return op.type == "linear" || op.type == "matmul" ||
         (op.type == "conv2d" && op.attrs.Int("groups", 1).value_or(1) == 1);
}

// Attributes for sharded execution (executor/cpu/kernels.h).
void RankBuilder::OpAttrs(const synth::OpStep& s, const graph::Op& op, v1::KernelCall* call) {
  auto& a = *call->mutable_attrs();
  for (const auto& [name, v] : op.attrs.values()) {
    if (name.rfind(graph::kAnnotationPrefix, 0) == 0) continue;
    graph::AttrToProto(v, &a[name]);
  }
  if (o_.bf16 && IsBf16Product(op)) a["bf16"].set_b(true);
  const graph::Shape& in0 = g_.tensor(op.inputs[0]).type.shape;
  if (op.type == "dropout" || op.type == "drop_path") {
    // Counter-based masks keyed by global indices (drop_path: by sample).
    uint64_t key = executor::CounterKey(o_.seed, executor::HashName(op.name));
    a["rng_key"].set_i(static_cast<int64_t>(key));
    auto* gs = a["global_shape"].mutable_ints();
    for (int64_t d : in0) gs->add_values(d);
    auto* off = a["offsets"].mutable_ints();
    for (int64_t d : Offsets(op.inputs[0], s.rule.inputs[0].raw())) off->add_values(d);
  } else if (op.type == "nll_loss" || op.type == "cross_entropy") {
    a["global_rows"].set_i(in0[0]);
  } else if (op.type == "batch_norm") {
    // Elements per channel of the whole batch.
    a["global_count"].set_i(graph::NumElements(in0) / in0[1]);
  } else if (op.type == "mean") {
    std::vector<int64_t> axes = op.attrs.Ints("axes", {}).value_or(std::vector<int64_t>{});
    int64_t count = 1;
    int rank = static_cast<int>(in0.size());
    for (int d = 0; d < rank; ++d) {
      bool reduced = axes.empty();
      for (int64_t x : axes) reduced = reduced || (x < 0 ? x + rank : x) == d;
      if (reduced) count *= in0[d];
    }
    a["global_count"].set_i(count);
  } else if (op.type == "moe_dispatch_idx" || op.type == "moe_combine_idx") {
    // The compact route holds global slots; a rank holding experts
    // [offset, offset + local) keeps theirs (executor/cpu/kernels.h).
    const bool dispatch = op.type == "moe_dispatch_idx";
    const TensorId experts = dispatch ? op.outputs[0] : op.inputs[0];
    const Form f = dispatch ? s.rule.outputs[0] : s.rule.inputs[0];
    a["experts"].set_i(g_.tensor(experts).type.shape[0]);
    a["expert_offset"].set_i(f.is_sharded() && f.dim() == 0 ? dims_.Layout(experts, 0).offsets[r_]
                                                            : 0);
    // Grouped routing split by groups: this rank's run of every expert's
    // slots, of the whole capacity.
    a["capacity"].set_i(g_.tensor(experts).type.shape[1]);
    a["capacity_offset"].set_i(f.is_sharded() && f.dim() == 1 ? dims_.Layout(experts, 1).offsets[r_]
                                                              : 0);
  } else if (op.type == "moe_route") {
    // Grouped routing split by groups: this rank's tokens of the whole.
    a["global_tokens"].set_i(in0[0]);
    const Form f = s.rule.inputs[0];
    a["token_offset"].set_i(
        f.is_sharded() && f.dim() == 0 ? dims_.Layout(op.inputs[0], 0).offsets[r_] : 0);
  } else if (op.type == "embedding") {
    const graph::Shape& table = g_.tensor(op.inputs[1]).type.shape;
    a["vocab_size"].set_i(table[0]);
    Form tf = s.rule.inputs[1];
    a["vocab_offset"].set_i(
        tf.is_sharded() && tf.dim() == 0 ? dims_.Layout(op.inputs[1], 0).offsets[r_] : 0);
  }
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
