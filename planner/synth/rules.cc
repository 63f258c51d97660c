#include "planner/synth/rules.h"

namespace hap::synth {
namespace internal {

ShardRule MakeRule(std::string name, RuleKind kind, std::vector<Form> in,
                   std::vector<Form> out, bool split) {
  ShardRule r;
  r.name = std::move(name);
  r.kind = kind;
  r.replicated_grad.assign(in.size(), false);
  r.inputs = std::move(in);
  r.outputs = std::move(out);
  r.split = split;
  return r;
}

}  // namespace internal

std::vector<ShardRule> RulesFor(const graph::Graph& g, graph::OpId id,
                                const RuleContext& ctx) {
  const graph::Op& op = g.op(id);
  std::vector<ShardRule> rules;
  rules.push_back(internal::MakeRule(
      "replicated", RuleKind::kReplicated,
      std::vector<Form>(op.inputs.size(), Form::R()),
      std::vector<Form>(op.outputs.size(), Form::R()), false));
  // Dimensions past Form::kMaxShardedDim have no S(d) (an int8_t: S(255) is
  // R, S(254) P): an op with a tensor of more dimensions is computed whole.
  for (const auto* tensors : {&op.inputs, &op.outputs}) {
    for (graph::TensorId t : *tensors) {
      if (g.tensor(t).type.rank() > Form::kMaxShardedDim + 1) return rules;
    }
  }
  internal::RuleInput in{g, op, ctx};
  for (auto family : {internal::ElementwiseRules, internal::DenseRules,
                      internal::LayoutRules, internal::MoeRules,
                      internal::RecurrentRules}) {
    if (internal::RuleFn fn = family(op.type)) {
      fn(in, rules);
      break;
    }
  }
  return rules;
}

}  // namespace hap::synth
