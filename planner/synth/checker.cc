#include "planner/synth/checker.h"

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "planner/synth/gradients.h"
#include "planner/synth/rules.h"

namespace hap::synth {
namespace {

bool ValidConversion(const CommStep& c) {
  Form f = c.from, t = c.to;
  Collective k = c.forward;
  if (f.is_sharded() && t.is_replicated()) return k == Collective::kAllGather;
  if (f.is_partial() && t.is_replicated()) return k == Collective::kAllReduce;
  if (f.is_partial() && t.is_sharded()) return k == Collective::kReduceScatter;
  if (f.is_sharded() && t.is_sharded()) {
    return f != t && k == Collective::kAllToAll;
  }
  if (f.is_replicated() && t.is_sharded()) return k == Collective::kSlice;
  if (f.is_replicated() && t.is_partial()) return k == Collective::kZeroOut;
  return false;
}

bool SameRule(const ShardRule& a, const ShardRule& b) {
  return a.name == b.name && a.inputs == b.inputs && a.outputs == b.outputs &&
         a.split == b.split && a.replicated_grad == b.replicated_grad;
}

}  // namespace

absl::Status CheckProgram(const graph::Graph& g, const Program& p,
                          int num_devices) {
  auto fail = [&](const graph::Op* op, const std::string& what) {
    return absl::InternalError(
        op ? absl::StrCat("op '", op->name, "' (", op->type, "): ", what)
           : what);
  };
  if (p.steps.size() != g.ops().size()) {
    return fail(nullptr, absl::StrCat("program has ", p.steps.size(),
                                      " steps for ", g.ops().size(), " ops"));
  }
  RuleContext ctx;
  ctx.num_devices = num_devices;
  std::map<graph::TensorId, std::set<int8_t>> facts;
  std::set<graph::TensorId> communicated;
  std::map<graph::TensorId, const SourceLoad*> loads;
  // Per parameter: whether any use leaves a partial gradient.
  std::map<graph::TensorId, bool> partial_grad;
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const OpStep& s = p.steps[k];
    if (s.op != static_cast<graph::OpId>(k)) {
      return fail(nullptr, absl::StrCat("step ", k, " runs op ", s.op,
                                        " out of topological order"));
    }
    const graph::Op& op = g.op(s.op);
    std::vector<ShardRule> rules = RulesFor(g, s.op, ctx);
    bool known = false;
    for (const auto& r : rules) known = known || SameRule(r, s.rule);
    if (!known) {
      return fail(&op, absl::StrCat("rule '", s.rule.name,
                                    "' is not an instruction of this op"));
    }
    if (s.rule.inputs.size() != op.inputs.size() ||
        s.rule.outputs.size() != op.outputs.size()) {
      return fail(&op, "rule arity differs from the op");
    }
    for (const SourceLoad& l : s.loads) {
      const graph::Tensor& t = g.tensor(l.tensor);
      if (t.kind == graph::TensorKind::kActivation) {
        return fail(&op, absl::StrCat("loads '", t.name,
                                      "', which is not a source"));
      }
      if (loads.count(l.tensor)) {
        return fail(&op, absl::StrCat("source '", t.name, "' loaded twice"));
      }
      if (l.form.is_partial()) {
        return fail(&op, absl::StrCat("source '", t.name, "' loaded as P"));
      }
      if (l.parameter) {
        bool ok = (l.storage == ParamStorage::kSharded &&
                   l.storage_form == l.form && l.form.is_sharded()) ||
                  (l.storage == ParamStorage::kReplicated &&
                   l.form.is_replicated()) ||
                  (l.storage == ParamStorage::kZero && l.form.is_replicated() &&
                   l.storage_form == Form::S(0));
        if (!ok) {
          return fail(&op, absl::StrCat("parameter '", t.name,
                                        "' has an inconsistent storage"));
        }
      }
      loads[l.tensor] = &l;
      facts[l.tensor].insert(l.form.raw());
    }
    for (const CommStep& c : s.comms) {
      const std::string& name = g.tensor(c.tensor).name;
      if (!facts.count(c.tensor) || !facts[c.tensor].count(c.from.raw())) {
        return fail(&op, absl::StrCat("communicates '", name, "' from ",
                                      c.from.ToString(),
                                      ", which does not hold"));
      }
      if (!ValidConversion(c)) {
        return fail(&op, absl::StrCat("'", name, "' ", c.from.ToString(),
                                      " -> ", c.to.ToString(), " by ",
                                      CollectiveName(c.forward),
                                      " is not a communication instruction"));
      }
      if (!communicated.insert(c.tensor).second) {
        return fail(&op, absl::StrCat("'", name, "' communicated twice"));
      }
      facts[c.tensor].insert(c.to.raw());
    }
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      graph::TensorId t = op.inputs[j];
      Form need = s.rule.inputs[j];
      if (!facts.count(t) || !facts[t].count(need.raw())) {
        return fail(&op, absl::StrCat("precondition ", g.tensor(t).name, ":",
                                      need.ToString(), " does not hold"));
      }
      if (need.is_sharded() &&
          need.dim() >= g.tensor(t).type.rank()) {
        return fail(&op, "shards a dimension the tensor does not have");
      }
      if (g.tensor(t).kind == graph::TensorKind::kParameter &&
          need.is_replicated()) {
        bool partial = s.rule.split && !s.rule.replicated_grad[j];
        partial_grad[t] = partial_grad[t] || partial;
      }
    }
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      graph::TensorId t = op.outputs[j];
      if (facts.count(t)) {
        return fail(&op, absl::StrCat("'", g.tensor(t).name,
                                      "' computed twice"));
      }
      facts[t].insert(s.rule.outputs[j].raw());
    }
  }
  const auto& loss = facts[g.loss()];
  if (!loss.count(Form::R().raw()) && !loss.count(Form::P().raw())) {
    return fail(nullptr, "the loss is not reached in form R or P");
  }
  const GradientAnalysis grads = AnalyzeGradients(g, p);
  for (graph::TensorId t : g.Parameters()) {
    const graph::Tensor& par = g.tensor(t);
    if (par.consumers.empty()) continue;
    auto it = loads.find(t);
    if (it == loads.end()) {
      return fail(nullptr, absl::StrCat("parameter '", par.name,
                                        "' is never loaded"));
    }
    if (par.frozen) continue;
    const SourceLoad& l = *it->second;
    // Direct (a split rule reads it) or through later ops.
    bool partial = partial_grad[t] || grads.partial_grad[t];
    bool synced = l.grad_allreduce || l.sfb || l.storage != ParamStorage::kReplicated;
    if (partial && !synced) {
      return fail(nullptr, absl::StrCat("parameter '", par.name,
                                        "' gets a partial gradient that is "
                                        "never synchronised"));
    }
    if (!partial && (l.grad_allreduce || l.sfb)) {
      return fail(nullptr, absl::StrCat("parameter '", par.name,
                                        "' synchronises a gradient that is "
                                        "already replicated"));
    }
  }
  return absl::OkStatus();
}

}  // namespace hap::synth
