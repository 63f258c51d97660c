// Rules of layout ops: transpose, reshape, flatten, concat, split, slice,
// expand. Layout ops move no data between devices; they keep the sharded
// dimension where it goes.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "planner/synth/rules.h"

namespace hap::synth::internal {
namespace {

RuleKind KindOf(int dim) { return dim == 0 ? RuleKind::kData : RuleKind::kTensor; }

void Partial(std::vector<ShardRule>& r, int inputs, int outputs) {
  r.push_back(MakeRule("partial", RuleKind::kPartial,
                       std::vector<Form>(inputs, Form::P()),
                       std::vector<Form>(outputs, Form::P()), false));
}

void Transpose(const RuleInput& x, std::vector<ShardRule>& r) {
  auto perm = x.op.attrs.Ints("perm");
  if (!perm.ok()) return;
  int rank = static_cast<int>(perm->size());
  for (int o = 0; o < rank; ++o) {
    int64_t p = (*perm)[o];
    int d = static_cast<int>(p < 0 ? p + rank : p);
    if (!x.Shardable(x.in(0)[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                         {Form::S(d)}, {Form::S(o)}, true));
  }
  Partial(r, 1, 1);
}

// Reshape/flatten keep a sharded input dimension d when it is the major
// (leftmost) factor of an output dimension with the same product of the
// dimensions before it: [B,S,D] -> [B*S,D] keeps S(0); [B,S,H*dh] ->
// [B,S,H,dh] keeps S(2) as S(2). Shards then hold whole rows of the merged
// dimension.
void Reshape(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& in = x.in(0);
  const auto& out = x.out(0);
  int64_t before_in = 1;
  for (size_t d = 0; d < in.size(); before_in *= in[d], ++d) {
    // The output dimension o that starts where input dimension d starts.
    int64_t before_out = 1;
    size_t o = 0;
    while (o < out.size() && before_out < before_in) before_out *= out[o++];
    if (o == out.size() || before_out != before_in) continue;
    bool keeps = out[o] == in[d];
    bool merges = false;
    if (out[o] > in[d] && out[o] % in[d] == 0) {
      int64_t inner = 1;
      for (size_t k = d + 1; k < in.size() && inner < out[o] / in[d]; ++k) {
        inner *= in[k];
      }
      merges = inner == out[o] / in[d];
    }
    bool splits = out[o] < in[d] && in[d] % out[o] == 0;
    int64_t length = std::min(in[d], out[o]);
    if ((keeps || merges || splits) && x.Shardable(length)) {
      r.push_back(MakeRule(absl::StrCat("shard(", d, ")"),
                           KindOf(static_cast<int>(d)),
                           {Form::S(static_cast<int>(d))},
                           {Form::S(static_cast<int>(o))}, true));
    }
  }
  Partial(r, 1, 1);
}

void Concat(const RuleInput& x, std::vector<ShardRule>& r) {
  auto axis = x.op.attrs.Int("axis");
  if (!axis.ok()) return;
  const auto& out = x.out(0);
  int rank = static_cast<int>(out.size());
  int ax = static_cast<int>(*axis < 0 ? *axis + rank : *axis);
  for (int d = 0; d < rank; ++d) {
    if (d == ax || !x.Shardable(out[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                         std::vector<Form>(x.num_inputs(), Form::S(d)),
                         {Form::S(d)}, true));
  }
  Partial(r, x.num_inputs(), 1);
}

void Split(const RuleInput& x, std::vector<ShardRule>& r) {
  auto axis = x.op.attrs.Int("axis");
  if (!axis.ok()) return;
  const auto& in = x.in(0);
  int rank = static_cast<int>(in.size());
  int ax = static_cast<int>(*axis < 0 ? *axis + rank : *axis);
  int outs = static_cast<int>(x.op.outputs.size());
  for (int d = 0; d < rank; ++d) {
    if (d == ax || !x.Shardable(in[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                         {Form::S(d)}, std::vector<Form>(outs, Form::S(d)),
                         true));
  }
  Partial(r, 1, outs);
}

void Slice(const RuleInput& x, std::vector<ShardRule>& r) {
  auto axis = x.op.attrs.Int("axis");
  if (!axis.ok()) return;
  const auto& in = x.in(0);
  int rank = static_cast<int>(in.size());
  int ax = static_cast<int>(*axis < 0 ? *axis + rank : *axis);
  for (int d = 0; d < rank; ++d) {
    if (d == ax || !x.Shardable(in[d])) continue;
    r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                         {Form::S(d)}, {Form::S(d)}, true));
  }
  Partial(r, 1, 1);
}

void Expand(const RuleInput& x, std::vector<ShardRule>& r) {
  const auto& in = x.in(0);
  const auto& out = x.out(0);
  int shift = static_cast<int>(out.size() - in.size());
  for (int d = 0; d < static_cast<int>(out.size()); ++d) {
    if (!x.Shardable(out[d])) continue;
    int k = d - shift;
    if (k >= 0 && in[k] == out[d]) {
      r.push_back(MakeRule(absl::StrCat("shard(", d, ")"), KindOf(d),
                           {Form::S(k)}, {Form::S(d)}, true));
    } else {
      // A broadcast dimension: each device expands to its own shard.
      r.push_back(MakeRule(absl::StrCat("expand-shard(", d, ")"), KindOf(d),
                           {Form::R()}, {Form::S(d)}, true));
    }
  }
}

}  // namespace

RuleFn LayoutRules(const std::string& t) {
  if (t == "transpose") return Transpose;
  if (t == "reshape" || t == "flatten") return Reshape;
  if (t == "concat") return Concat;
  if (t == "split") return Split;
  if (t == "slice") return Slice;
  if (t == "expand") return Expand;
  return nullptr;
}

}  // namespace hap::synth::internal
