#include "planner/synth/gradients.h"

#include "planner/graph/op_registry.h"
#include "planner/synth/rules.h"

namespace hap::synth {

bool Differentiable(const graph::Graph& g, const graph::Op& op, int j) {
  const graph::OpDef* def = graph::OpRegistry::Global().Find(op.type);
  if (def) {
    for (int k : def->non_differentiable_inputs) {
      if (k == j) return false;
    }
  }
  return graph::IsFloating(g.tensor(op.inputs[j]).type.dtype);
}

bool PartialContribution(const OpStep& s, const graph::Op& op, int j,
                         const std::vector<bool>& partial_grad) {
  const ShardRule& r = s.rule;
  if (r.split || r.kind == RuleKind::kPartial) return !r.replicated_grad[j];
  for (graph::TensorId o : op.outputs) {
    if (partial_grad[o]) return true;
  }
  return false;
}

GradientAnalysis AnalyzeGradients(const graph::Graph& g, const Program& p) {
  GradientAnalysis a;
  const int nt = static_cast<int>(g.tensors().size());
  a.requires_grad.assign(nt, false);
  a.partial_grad.assign(nt, false);
  a.sfb_param.assign(p.steps.size(), -1);
  for (graph::TensorId t : g.Parameters()) a.requires_grad[t] = !g.tensor(t).frozen;
  for (const graph::Op& op : g.ops()) {
    bool any = false;
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      any = any || (a.requires_grad[op.inputs[j]] &&
                    Differentiable(g, op, static_cast<int>(j)));
    }
    for (graph::TensorId o : op.outputs) a.requires_grad[o] = any;
  }
  for (size_t k = 0; k < p.steps.size(); ++k) {
    for (const SourceLoad& l : p.steps[k].loads) {
      if (l.sfb) a.sfb_param[k] = l.tensor;
    }
  }
  for (int k = static_cast<int>(p.steps.size()) - 1; k >= 0; --k) {
    const OpStep& s = p.steps[k];
    const graph::Op& op = g.op(s.op);
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      graph::TensorId t = op.inputs[j];
      if (!a.requires_grad[t] || !Differentiable(g, op, static_cast<int>(j))) continue;
      if (!s.rule.inputs[j].is_replicated()) continue;
      // SFB: the weight's whole gradient is recomputed (rules.h).
      if (a.sfb_param[k] == t && SfbFactors(g, op, static_cast<int>(j))) continue;
      if (PartialContribution(s, op, static_cast<int>(j), a.partial_grad)) {
        a.partial_grad[t] = true;
      }
    }
    for (const CommStep& c : s.comms) {
      // Zero-out R -> P: each device's part of the gradient. (A slice
      // R -> S(d) gets its gradient back whole, by all-gather.)
      if (c.forward == Collective::kZeroOut && a.requires_grad[c.tensor]) {
        a.partial_grad[c.tensor] = true;
      }
    }
  }
  return a;
}

}  // namespace hap::synth
