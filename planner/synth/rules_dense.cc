// Rules of the dense ops: linear, matmul, embedding, conv2d, conv3d, pooling.
#include <numeric>

#include "absl/strings/str_cat.h"
#include "planner/synth/rules.h"

namespace hap::synth::internal {
namespace {

void Linear(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& s = x.in(0);
  int rank = static_cast<int>(s.size());
  bool bias = x.num_inputs() == 3;
  auto with_bias = [&](std::vector<Form> f, Form b) {
    if (bias) f.push_back(b);
    return f;
  };
  // Data parallel over any leading dimension.
  for (int d = 0; d + 1 < rank; ++d) {
    if (!x.Shardable(s[d])) continue;
    r.push_back(MakeRule(absl::StrCat("data(", d, ")"), RuleKind::kData,
                         with_bias({Form::S(d), Form::R()}, Form::R()),
                         {Form::S(d)}, true));
  }
  int64_t out = x.in(1)[0], in = x.in(1)[1];
  // Column parallel: output features split.
  if (x.Shardable(out)) {
    r.push_back(MakeRule("column", RuleKind::kTensor,
                         with_bias({Form::R(), Form::S(0)}, Form::S(0)),
                         {Form::S(rank - 1)}, true));
  }
  // Row parallel: contracted features split, partial output; the bias is
  // added on one device, so its gradient stays replicated.
  if (x.Shardable(in)) {
    ShardRule row = MakeRule("row", RuleKind::kTensor,
                             with_bias({Form::S(rank - 1), Form::S(1)}, Form::R()),
                             {Form::P()}, true);
    if (bias) row.replicated_grad[2] = true;
    r.push_back(row);
  }
  // A partial input stays partial through the linear map.
  ShardRule p = MakeRule("partial", RuleKind::kPartial,
                         with_bias({Form::P(), Form::R()}, Form::R()),
                         {Form::P()}, false);
  if (bias) p.replicated_grad[2] = true;
  r.push_back(p);
}

void Matmul(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& a = x.in(0);
  const auto& b = x.in(1);
  int ra = static_cast<int>(a.size()), rb = static_cast<int>(b.size());
  bool batched_b = rb == ra;
  for (int d = 0; d + 2 < ra; ++d) {
    if (!x.Shardable(a[d])) continue;
    r.push_back(MakeRule(absl::StrCat("batch(", d, ")"),
                         d == 0 ? RuleKind::kData : RuleKind::kTensor,
                         {Form::S(d), batched_b ? Form::S(d) : Form::R()},
                         {Form::S(d)}, true));
  }
  if (x.Shardable(a[ra - 2])) {
    r.push_back(MakeRule("rows", ra == 2 ? RuleKind::kData : RuleKind::kTensor,
                         {Form::S(ra - 2), Form::R()}, {Form::S(ra - 2)}, true));
  }
  if (x.Shardable(b[rb - 1])) {
    r.push_back(MakeRule("columns", RuleKind::kTensor,
                         {Form::R(), Form::S(rb - 1)}, {Form::S(ra - 1)}, true));
  }
  if (x.Shardable(a[ra - 1])) {
    r.push_back(MakeRule("contraction", RuleKind::kTensor,
                         {Form::S(ra - 1), Form::S(rb - 2)}, {Form::P()}, true));
  }
  r.push_back(MakeRule("partial*replicated", RuleKind::kPartial,
                       {Form::P(), Form::R()}, {Form::P()}, false));
  r.push_back(MakeRule("replicated*partial", RuleKind::kPartial,
                       {Form::R(), Form::P()}, {Form::P()}, false));
}

void Embedding(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& ids = x.in(0);
  const auto& table = x.in(1);
  int rank = static_cast<int>(ids.size());
  for (int d = 0; d < rank; ++d) {
    if (!x.Shardable(ids[d])) continue;
    r.push_back(MakeRule(absl::StrCat("data(", d, ")"), RuleKind::kData,
                         {Form::S(d), Form::R()}, {Form::S(d)}, true));
  }
  if (x.Shardable(table[1])) {
    r.push_back(MakeRule("features", RuleKind::kTensor,
                         {Form::R(), Form::S(1)}, {Form::S(rank)}, true));
  }
  if (x.Shardable(table[0])) {
    // Vocabulary parallel: each device looks up its rows, zeros elsewhere.
    r.push_back(MakeRule("vocab", RuleKind::kTensor, {Form::R(), Form::S(0)},
                         {Form::P()}, true));
  }
}

void Conv(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& s = x.in(0);
  bool bias = x.num_inputs() == 3;
  auto with_bias = [&](std::vector<Form> f, Form b) {
    if (bias) f.push_back(b);
    return f;
  };
  if (x.Shardable(s[0])) {
    r.push_back(MakeRule("data(0)", RuleKind::kData,
                         with_bias({Form::S(0), Form::R()}, Form::R()),
                         {Form::S(0)}, true));
  }
  const int64_t groups = x.op.attrs.Int("groups", 1).value_or(1);
  if (groups > 1) {
    // Grouped (depthwise when groups = c): whole groups per device, their
    // input channels, weight rows and output channels. The three are cut
    // together in units of their gcd, a whole group only when the per-group
    // channel counts are coprime (depthwise: 1 input channel a group).
    const int64_t cg = s[1] / groups, og = x.in(1)[0] / groups;
    if (x.Shardable(groups) && std::gcd(cg, og) == 1) {
      r.push_back(MakeRule("groups", RuleKind::kTensor,
                           with_bias({Form::S(1), Form::S(0)}, Form::S(0)),
                           {Form::S(1)}, true));
    }
    return;
  }
  if (x.Shardable(x.in(1)[0])) {
    r.push_back(MakeRule("out-channels", RuleKind::kTensor,
                         with_bias({Form::R(), Form::S(0)}, Form::S(0)),
                         {Form::S(1)}, true));
  }
  if (x.Shardable(s[1])) {
    ShardRule in = MakeRule("in-channels", RuleKind::kTensor,
                            with_bias({Form::S(1), Form::S(1)}, Form::R()),
                            {Form::P()}, true);
    if (bias) in.replicated_grad[2] = true;
    r.push_back(in);
  }
}

void Pool(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& s = x.in(0);
  for (int d = 0; d < 2; ++d) {
    if (!x.Shardable(s[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"),
                         d == 0 ? RuleKind::kData : RuleKind::kTensor,
                         {Form::S(d)}, {Form::S(d)}, true));
  }
  if (x.op.type == "adaptive_avg_pool2d" || x.op.type == "avg_pool2d" ||
      x.op.type == "avg_pool3d") {
    // Averages are linear: partial sums stay partial.
    r.push_back(MakeRule("partial", RuleKind::kPartial, {Form::P()},
                         {Form::P()}, false));
  }
}

}  // namespace

RuleFn DenseRules(const std::string& t) {
  if (t == "linear") return Linear;
  if (t == "matmul") return Matmul;
  if (t == "embedding") return Embedding;
  if (t == "conv2d" || t == "conv3d") return Conv;
  if (t == "max_pool2d" || t == "avg_pool2d" || t == "adaptive_avg_pool2d" || t == "max_pool3d" ||
      t == "avg_pool3d") {
    return Pool;
  }
  return nullptr;
}

}  // namespace hap::synth::internal

namespace hap::synth {

// A linear's weight W [out, in]: dW = dy^T x over every row of x.
std::optional<SufficientFactors> SfbFactors(const graph::Graph& g, const graph::Op& op, int input) {
  if (op.type != "linear" || input != 1) return std::nullopt;
  const graph::Shape& w = g.tensor(op.inputs[1]).type.shape;
  const double rows = static_cast<double>(g.tensor(op.inputs[0]).type.num_elements() / w[1]);
  SufficientFactors f;
  f.flops = 2.0 * rows * static_cast<double>(w[0] * w[1]);
  return f;
}

}  // namespace hap::synth
