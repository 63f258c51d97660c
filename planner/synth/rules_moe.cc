// Rules of the mixture-of-experts ops. Gating places tokens by a running
// count over all tokens, so it is computed replicated to keep the
// single-device semantics (grouped routing counts within each group, so it
// splits by whole groups); dispatch and combine split by tokens or experts.
// The compact form (moe_route, moe_route_weights, moe_dispatch_idx,
// moe_combine_idx) splits the same ways: its route holds global slot
// indices, so a rank holding some experts is told their offset by the
// lowering ("expert_offset") and keeps the slots of its experts.
#include "planner/synth/rules.h"

namespace hap::synth::internal {
namespace {

void Gate(const RuleInput&, std::vector<ShardRule>&) {}

// Grouped routing (the ops' "group_size" g > 0, GShard's groups): tokens
// route in runs of g, each run into its own slots of every expert, so a
// split of the tokens in whole groups is a split of the capacity (the
// lowering keeps shards whole groups). True when there are enough groups
// to split (t tokens).
bool Grouped(const RuleInput& x, int64_t t) {
  const int64_t g = x.op.attrs.Int("group_size", 0).value_or(0);
  return g > 0 && t % g == 0 && x.Shardable(t / g);
}

// moe_route: by tokens when grouped (each rank routes its own groups).
void Route(const RuleInput& x, std::vector<ShardRule>& r) {
  if (Grouped(x, x.in(0)[0])) {
    r.push_back(MakeRule("groups", RuleKind::kData, {Form::S(0)}, {Form::S(0)}, true));
  }
}

// Dispatch by tokens (partial sums of the dispatched tensor) or features;
// the second input (combine weights or route) splits with x's tokens.
void DispatchByTokensOrFeatures(const RuleInput& x,
                                std::vector<ShardRule>& r) {
  if (x.Shardable(x.in(0)[0])) {
    r.push_back(MakeRule("tokens", RuleKind::kData, {Form::S(0), Form::S(0)},
                         {Form::P()}, true));
  }
  if (x.Shardable(x.in(0)[1])) {
    r.push_back(MakeRule("features", RuleKind::kTensor,
                         {Form::S(1), Form::R()}, {Form::S(2)}, true));
  }
}

void Dispatch(const RuleInput& x, std::vector<ShardRule>& r) {
  // x[t, d], combine[t, e, c] -> [e, c, d].
  if (x.Shardable(x.in(1)[1])) {
    r.push_back(MakeRule("expert", RuleKind::kTensor, {Form::R(), Form::S(1)},
                         {Form::S(0)}, true));
  }
  DispatchByTokensOrFeatures(x, r);
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

// The per-token top-k weights: by tokens.
void RouteWeights(const RuleInput& x, std::vector<ShardRule>& r) {
  if (x.Shardable(x.in(0)[0])) {
    r.push_back(MakeRule("tokens", RuleKind::kData, {Form::S(0)}, {Form::S(0)},
                         true));
  }
}

void DispatchIdx(const RuleInput& x, std::vector<ShardRule>& r) {
  // x[t, d], route[t, k] -> [e, c, d].
  if (x.Shardable(x.out(0)[0])) {
    r.push_back(MakeRule("expert", RuleKind::kTensor, {Form::R(), Form::R()},
                         {Form::S(0)}, true));
  }
  // Grouped: each rank's groups fill their own slots of every expert
  // (nothing to sum); an all-to-all then takes them to their experts.
  if (Grouped(x, x.in(0)[0])) {
    r.push_back(MakeRule("groups", RuleKind::kData, {Form::S(0), Form::S(0)},
                         {Form::S(1)}, true));
  }
  DispatchByTokensOrFeatures(x, r);
}

void CombineIdx(const RuleInput& x, std::vector<ShardRule>& r) {
  // y[e, c, d], route[t, k], weights[t, k] -> [t, d].
  if (x.Shardable(x.in(0)[0])) {
    r.push_back(MakeRule("expert", RuleKind::kTensor,
                         {Form::S(0), Form::R(), Form::R()}, {Form::P()},
                         true));
  }
  if (x.Shardable(x.in(1)[0])) {
    r.push_back(MakeRule("tokens", RuleKind::kData,
                         {Form::R(), Form::S(0), Form::S(0)}, {Form::S(0)},
                         true));
  }
  // Grouped: each rank's tokens read only their groups' slots.
  if (Grouped(x, x.in(1)[0])) {
    r.push_back(MakeRule("groups", RuleKind::kData,
                         {Form::S(1), Form::S(0), Form::S(0)}, {Form::S(0)}, true));
  }
  if (x.Shardable(x.in(0)[2])) {
    r.push_back(MakeRule("features", RuleKind::kTensor,
                         {Form::S(2), Form::R(), Form::R()}, {Form::S(1)},
                         true));
  }
}

}  // namespace

RuleFn MoeRules(const std::string& t) {
  if (t == "moe_gate") return Gate;
  if (t == "moe_dispatch") return Dispatch;
  if (t == "moe_combine") return Combine;
  if (t == "moe_route") return Route;
  if (t == "moe_route_weights") return RouteWeights;
  if (t == "moe_dispatch_idx") return DispatchIdx;
  if (t == "moe_combine_idx") return CombineIdx;
  return nullptr;
}

}  // namespace hap::synth::internal
