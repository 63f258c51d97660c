// Rules of element-wise ops, normalisations, reductions and losses.
#include "absl/strings/str_cat.h"
#include "planner/synth/rules.h"

namespace hap::synth::internal {
namespace {

RuleKind KindOf(int dim) { return dim == 0 ? RuleKind::kData : RuleKind::kTensor; }

// Input forms for output form S(d) under numpy broadcasting: an input that
// lacks the dimension or broadcasts it (size 1) must be replicated.
Form Aligned(const graph::Shape& in, const graph::Shape& out, int d) {
  int k = d - static_cast<int>(out.size() - in.size());
  if (k < 0 || (in[k] == 1 && out[d] != 1)) return Form::R();
  return Form::S(k);
}

// Unary element-wise: S(d) -> S(d) for every shardable d; `linear` ops also
// P -> P.
void Unary(const RuleInput& x, std::vector<ShardRule>& r, bool linear) {
  const auto& s = x.in(0);
  for (int d = 0; d < static_cast<int>(s.size()); ++d) {
    if (!x.Shardable(s[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                         {Form::S(d)}, {Form::S(d)}, true));
  }
  if (linear) {
    r.push_back(MakeRule("partial", RuleKind::kPartial, {Form::P()},
                         {Form::P()}, false));
  }
}

void UnaryNonlinear(const RuleInput& x, std::vector<ShardRule>& r) {
  Unary(x, r, false);
}
void UnaryLinear(const RuleInput& x, std::vector<ShardRule>& r) {
  Unary(x, r, true);
}

void Binary(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& out = x.out(0);
  for (int d = 0; d < static_cast<int>(out.size()); ++d) {
    if (!x.Shardable(out[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                         {Aligned(x.in(0), out, d), Aligned(x.in(1), out, d)},
                         {Form::S(d)}, true));
  }
  if (x.op.type == "add" || x.op.type == "sub") {
    // Sums of partial sums; a replicated operand joins on one device.
    r.push_back(MakeRule("partial", RuleKind::kPartial, {Form::P(), Form::P()},
                         {Form::P()}, false));
    ShardRule a = MakeRule("partial+replicated", RuleKind::kPartial,
                           {Form::P(), Form::R()}, {Form::P()}, false);
    a.replicated_grad = {false, true};
    r.push_back(a);
    ShardRule b = MakeRule("replicated+partial", RuleKind::kPartial,
                           {Form::R(), Form::P()}, {Form::P()}, false);
    b.replicated_grad = {true, false};
    r.push_back(b);
  } else if (x.op.type == "mul") {
    r.push_back(MakeRule("partial*replicated", RuleKind::kPartial,
                         {Form::P(), Form::R()}, {Form::P()}, false));
    r.push_back(MakeRule("replicated*partial", RuleKind::kPartial,
                         {Form::R(), Form::P()}, {Form::P()}, false));
  }
}

// Ops normalising over the last axis: shard any other axis. Extra inputs
// (gamma/beta, the mask) follow by broadcasting.
void LastAxis(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& s = x.in(0);
  int rank = static_cast<int>(s.size());
  int limit = rank - 1;
  if (x.op.type == "softmax") {
    auto causal = x.op.attrs.Bool("causal", false);
    if (causal.ok() && *causal) limit = rank - 2;  // rows keep global offsets
  }
  for (int d = 0; d < limit; ++d) {
    if (!x.Shardable(s[d])) continue;
    std::vector<Form> in = {Form::S(d)};
    for (int j = 1; j < x.num_inputs(); ++j) in.push_back(Aligned(x.in(j), s, d));
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d), in,
                         {Form::S(d)}, true));
  }
}

// batch_norm: channels sharded need nothing (each channel's statistics are
// whole on one device); the batch sharded all-reduces the per-channel sums
// of x and x^2 in forward and of dy and dy * xhat in backward (planner/lower
// emits the pieces), so every device normalises with the global batch's
// statistics whatever its share. Those two small all-reduces (2 x c
// doubles each) are priced as internal gathers of twice their bytes (an
// all-reduce moves about twice what an all-gather of its result does).
void BatchNorm(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& s = x.in(0);
  const int extra = x.num_inputs() - 1;  // gamma, beta, running stats
  if (x.Shardable(s[0])) {
    std::vector<Form> in = {Form::S(0)};
    in.insert(in.end(), extra, Form::R());
    ShardRule d = MakeRule("data(0)", RuleKind::kData, in, {Form::S(0)}, true);
    d.internal_gather_bytes = 2.0 * 2.0 * (2.0 * static_cast<double>(s[1]) * 8.0);
    r.push_back(std::move(d));
  }
  if (x.Shardable(s[1])) {
    std::vector<Form> in = {Form::S(1)};
    in.insert(in.end(), extra, Form::S(0));
    r.push_back(MakeRule("channels", RuleKind::kTensor, in, {Form::S(1)}, true));
  }
}

void Reduction(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& s = x.in(0);
  int rank = static_cast<int>(s.size());
  auto axes = x.op.attrs.Ints("axes", {});
  auto keep = x.op.attrs.Bool("keepdims", false);
  if (!axes.ok() || !keep.ok()) return;
  std::vector<bool> reduced(rank, axes->empty());
  for (int64_t a : *axes) reduced[a < 0 ? a + rank : a] = true;
  int out_dim = 0;
  for (int d = 0; d < rank; ++d) {
    if (x.Shardable(s[d])) {
      if (reduced[d]) {
        r.push_back(MakeRule(absl::StrCat("reduce-shard(", d, ")"), KindOf(d),
                             {Form::S(d)}, {Form::P()}, true));
      } else {
        r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                             {Form::S(d)}, {Form::S(out_dim)}, true));
      }
    }
    if (!reduced[d] || *keep) ++out_dim;
  }
  r.push_back(
      MakeRule("partial", RuleKind::kPartial, {Form::P()}, {Form::P()}, false));
}

// Mean-reduced losses over rows: rows sharded give a partial loss.
// cross_entropy may also shard its logits by class (vocabulary-parallel, as
// Megatron-LM's): every device reads every row's target, computes the rows'
// log-sum-exp over its classes, all-gathers those, and contributes its
// targets' logits (and, on one device, the log-sum-exps) to a partial loss.
void Loss(const RuleInput& x, std::vector<ShardRule>& r) {
  if (x.Shardable(x.in(0)[0])) {
    r.push_back(MakeRule("data(0)", RuleKind::kData, {Form::S(0), Form::S(0)},
                         {Form::P()}, true));
  }
  if (x.op.type == "cross_entropy" && x.in(0).size() == 2 &&
      x.Shardable(x.in(0)[1])) {
    ShardRule v = MakeRule("vocab", RuleKind::kTensor, {Form::S(1), Form::R()},
                           {Form::P()}, true);
    const graph::TensorType& t = x.g.tensor(x.op.inputs[0]).type;
    v.internal_gather_bytes = static_cast<double>(x.in(0)[0]) * x.ctx.num_devices *
                              graph::DTypeBytes(t.dtype);
    r.push_back(std::move(v));
  }
}

}  // namespace

RuleFn ElementwiseRules(const std::string& t) {
  if (t == "relu" || t == "gelu" || t == "sigmoid" || t == "tanh" || t == "silu" || t == "relu6" ||
      t == "hardsigmoid" || t == "hardswish" || t == "exp" || t == "rsqrt" || t == "log") {
    return UnaryNonlinear;
  }
  if (t == "dropout" || t == "drop_path" || t == "scale" || t == "stop_gradient") {
    return UnaryLinear;
  }
  if (t == "add" || t == "sub" || t == "mul") return Binary;
  if (t == "layer_norm" || t == "softmax" || t == "log_softmax") return LastAxis;
  if (t == "batch_norm") return BatchNorm;
  if (t == "sum" || t == "mean") return Reduction;
  if (t == "nll_loss" || t == "cross_entropy") return Loss;
  return nullptr;
}

}  // namespace hap::synth::internal
