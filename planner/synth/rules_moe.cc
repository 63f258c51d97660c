// Rules of the mixture-of-experts ops. Gating places tokens by a running
// count over all tokens, so it is computed replicated to keep the
// single-device semantics; dispatch and combine split by tokens or experts.
#include "planner/synth/rules.h"

namespace hap::synth::internal {
namespace {

void Gate(const RuleInput&, std::vector<ShardRule>&) {}

void Dispatch(const RuleInput& x, std::vector<ShardRule>& r) {
  // x[t, d], combine[t, e, c] -> [e, c, d].
  if (x.Shardable(x.in(1)[1])) {
    r.push_back(MakeRule("expert", RuleKind::kTensor, {Form::R(), Form::S(1)},
                         {Form::S(0)}, true));
  }
  if (x.Shardable(x.in(0)[0])) {
    r.push_back(MakeRule("tokens", RuleKind::kData, {Form::S(0), Form::S(0)},
                         {Form::P()}, true));
  }
  if (x.Shardable(x.in(0)[1])) {
    r.push_back(MakeRule("features", RuleKind::kTensor,
                         {Form::S(1), Form::R()}, {Form::S(2)}, true));
  }
}

void Combine(const RuleInput& x, std::vector<ShardRule>& r) {
  // y[e, c, d], combine[t, e, c] -> [t, d].
  if (x.Shardable(x.in(0)[0])) {
    r.push_back(MakeRule("expert", RuleKind::kTensor, {Form::S(0), Form::S(1)},
                         {Form::P()}, true));
  }
  if (x.Shardable(x.in(1)[0])) {
    r.push_back(MakeRule("tokens", RuleKind::kData, {Form::R(), Form::S(0)},
                         {Form::S(0)}, true));
  }
  if (x.Shardable(x.in(0)[2])) {
    r.push_back(MakeRule("features", RuleKind::kTensor,
                         {Form::S(2), Form::R()}, {Form::S(1)}, true));
  }
}

}  // namespace

RuleFn MoeRules(const std::string& t) {
  if (t == "moe_gate") return Gate;
  if (t == "moe_dispatch") return Dispatch;
  if (t == "moe_combine") return Combine;
  return nullptr;
}

}  // namespace hap::synth::internal
