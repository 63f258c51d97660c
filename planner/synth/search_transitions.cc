// The instruction set as the search's transitions (searcher.h): each op's
// rules, form changes, parameter loads and their costs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "planner/graph/op_registry.h"
#include "planner/synth/gradients.h"
#include "planner/synth/searcher.h"

namespace hap::synth::internal {

void Searcher::Prepare() {
  RuleContext ctx;
  ctx.num_devices = cluster_.size();
  ctx.min_shard_length = opt_.min_shard_length;
  const auto& tensors = g_.tensors();
  last_use_.assign(tensors.size(), -1);
  requires_grad_.assign(tensors.size(), false);
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].kind == TensorKind::kParameter && !tensors[t].frozen) {
      requires_grad_[t] = true;
    }
    for (OpId c : tensors[t].consumers) {
      last_use_[t] = std::max(last_use_[t], c);
    }
  }
  rules_.resize(n_);
  rule_index_.resize(n_);
  compute_.resize(n_);
  compute_eval_.resize(n_);
  internal_.resize(n_);
  h_.assign(n_ + 1, 0);
  const std::vector<OpWork> work = TrainingWork(g_);
  // Kernel launches cost what a device's queue does not hide
  // (cost::ExposedLaunchFraction) behind the step's kernels, taken at a
  // split proportional to FLOP/s: every device's share of the work over
  // the cluster's summed rate.
  std::vector<double> exposed(cluster_.size(), 1.0);
  {
    double summed_rate = 0;
    for (int d = 0; d < cluster_.size(); ++d) summed_rate += cluster_.device(d).flops;
    double launches = 0;
    for (const OpWork& w : work) launches += w.launches();
    for (int d = 0; d < cluster_.size(); ++d) {
      const auto& dev = cluster_.device(d);
      double kernels = 0;
      for (OpId i = 0; i < n_; ++i) {
        kernels += work[i].flops / summed_rate * dev.OpTimeScale(g_.op(i).type);
      }
      exposed[d] = cost::ExposedLaunchFraction(dev, launches, kernels);
    }
  }
  for (OpId i = 0; i < n_; ++i) {
    const graph::Op& op = g_.op(i);
    for (TensorId o : op.outputs) requires_grad_[o] = work[i].backward;
    const double flops = work[i].flops;
    std::vector<ShardRule> all = RulesFor(g_, i, ctx);
    for (size_t r = 0; r < all.size(); ++r) {
      if (opt_.rule_filter && !opt_.rule_filter(all[r])) continue;
      CostTerm t = coll_.Constant(0);
      for (int d = 0; d < cluster_.size(); ++d) {
        const auto& dev = cluster_.device(d);
        double secs = flops / dev.flops * dev.OpTimeScale(op.type);
        t.constant[d] = work[i].launches() * dev.launch_overhead_seconds * exposed[d];
        if (all[r].split) {
          t.coef[d] = secs;
        } else {
          t.constant[d] += secs;
        }
      }
      CostTerm internal;
      if (all[r].internal_gather_bytes > 0) {
        // Equal chunks from every device: the padded all-gather at even
        // ratios.
        const std::vector<double> even(cluster_.size(), 1.0 / cluster_.size());
        internal = coll_.Constant(cost::EvaluateTerm(
            coll_.AllGather(all[r].internal_gather_bytes, cost::Method::kPadded), even));
      }
      compute_eval_[i].push_back(Eval(t) + Eval(internal));  // an empty term is 0
      compute_[i].push_back(std::move(t));
      internal_[i].push_back(std::move(internal));
      rule_index_[i].push_back(static_cast<int>(r));
      rules_[i].push_back(std::move(all[r]));
    }
  }
  if (!opt_.zero_heuristic) {
    for (int i = n_ - 1; i >= 0; --i) {
      double best = 0;
      if (!compute_eval_[i].empty()) {
        best = *std::min_element(compute_eval_[i].begin(), compute_eval_[i].end());
      }
      h_[i] = h_[i + 1] + best;
    }
  }
}

// `t` less the per-call overhead the collective model adds (once per rank
// for the grouped form): a tensor's share of a coalesced call.
CostTerm Searcher::WithoutCallOverhead(CostTerm t, Method m) const {
  const double ov = cluster_.collective_overhead_seconds();
  const double calls = m == Method::kGrouped ? cluster_.size() : 1;
  for (double& c : t.constant) c = std::max(0.0, c - calls * ov);
  return t;
}

// The cheaper of the padded and grouped forms of an uneven collective.
CostTerm Searcher::Uneven(double bytes, bool gather, Method* method) const {
  auto make = [&](cost::Method m) {
    return gather ? coll_.AllGather(bytes, m) : coll_.ReduceScatter(bytes, m);
  };
  CostTerm padded = make(cost::Method::kPadded);
  *method = Method::kPadded;
  if (!opt_.allow_grouped) return padded;
  CostTerm grouped = make(cost::Method::kGrouped);
  if (Eval(grouped) < Eval(padded)) {
    *method = Method::kGrouped;
    return grouped;
  }
  return padded;
}

bool Searcher::Convert(TensorId t, Form from, Form to, CommStep* out, double* cost) const {
  double bytes = static_cast<double>(g_.tensor(t).type.bytes());
  CommStep c;
  c.tensor = t;
  c.from = from;
  c.to = to;
  c.has_backward = requires_grad_[t];
  CostTerm none = coll_.Constant(0);
  if (from.is_sharded() && to.is_replicated()) {
    c.forward = Collective::kAllGather;
    c.backward = Collective::kReduceScatter;
    c.forward_cost = Gather(bytes, &c.method);
    c.backward_cost = coll_.ReduceScatter(bytes, CostMethod(c.method));
  } else if (from.is_partial() && to.is_replicated()) {
    c.forward = c.backward = Collective::kAllReduce;
    c.forward_cost = c.backward_cost = coll_.Constant(coll_.AllReduce(bytes));
  } else if (from.is_partial() && to.is_sharded()) {
    c.forward = Collective::kReduceScatter;
    c.backward = Collective::kAllGather;
    c.forward_cost = Scatter(bytes, &c.method);
    c.backward_cost = coll_.AllGather(bytes, CostMethod(c.method));
  } else if (from.is_sharded() && to.is_sharded()) {
    c.forward = c.backward = Collective::kAllToAll;
    c.forward_cost = c.backward_cost = coll_.AllToAll(bytes);
  } else if (from.is_replicated() && to.is_sharded()) {
    c.forward = Collective::kSlice;
    c.backward = Collective::kAllGather;
    c.forward_cost = none;
    c.backward_cost = Gather(bytes, &c.method);
  } else if (from.is_replicated() && to.is_partial()) {
    c.forward = c.backward = Collective::kZeroOut;
    c.forward_cost = c.backward_cost = none;
  } else {
    return false;  // S -> P and P -> P are not instructions
  }
  if (!c.has_backward) c.backward_cost = none;
  *cost = Eval(c.forward_cost) + Eval(c.backward_cost);
  *out = std::move(c);
  return true;
}

// The optimizer update of a parameter's stored elements (calibrated
// seconds per element; nothing for frozen parameters or an uncalibrated
// cluster): on every device for replicated storage, on each shard for
// sharded and ZeRO storage.
void Searcher::AddUpdateCost(const graph::Tensor& p, bool sharded, SourceLoad* l) const {
  if (p.frozen) return;
  const double elements = static_cast<double>(p.type.num_elements());
  CostTerm t = coll_.Constant(0);
  bool any = false;
  for (int d = 0; d < cluster_.size(); ++d) {
    const double secs = elements * cluster_.device(d).optimizer_seconds_per_element;
    any = any || secs > 0;
    (sharded ? t.coef[d] : t.constant[d]) = secs;
  }
  if (any) l->update_costs.push_back(std::move(t));
}

bool Searcher::LoadParameter(TensorId t, Form need, const ShardRule& rule, int input, OpId op,
                             SourceLoad* out, double* cost) const {
  const graph::Tensor& p = g_.tensor(t);
  double bytes = static_cast<double>(p.type.bytes());
  SourceLoad l;
  l.tensor = t;
  l.form = need;
  l.parameter = true;
  if (need.is_partial()) return false;
  if (need.is_sharded()) {
    if (opt_.force_storage && *opt_.force_storage != ParamStorage::kSharded) {
      return false;
    }
    l.storage = ParamStorage::kSharded;
    l.storage_form = need;
    AddUpdateCost(p, /*sharded=*/true, &l);
    *cost = 0;
    for (const auto& t2 : l.update_costs) *cost += Eval(t2);
    *out = std::move(l);
    return true;
  }
  bool partial = rule.split && !rule.replicated_grad[input] && !p.frozen;
  struct Option {
    SourceLoad load;
    double cost;
  };
  std::vector<Option> options;
  bool zero_possible = p.type.rank() >= 1 && p.type.shape[0] >= cluster_.size();
  // A forced ZeRO storage falls back to replicated where a parameter is too
  // small to shard.
  auto allowed = [&](ParamStorage s) {
    if (!opt_.force_storage) return true;
    if (*opt_.force_storage == ParamStorage::kZero && !zero_possible) {
      return s == ParamStorage::kReplicated;
    }
    return *opt_.force_storage == s;
  };
  if (allowed(ParamStorage::kReplicated)) {
    SourceLoad a = l;
    a.storage = ParamStorage::kReplicated;
    a.storage_form = Form::R();
    if (partial) {
      a.grad_allreduce = true;
      // Coalesced into the gradient bucket (planner/lower): the transfer
      // only, the bucket's one call overhead is not counted per tensor.
      a.costs.push_back(coll_.Constant(coll_.AllReduceTransfer(bytes * opt_.gradient_wire_scale)));
    }
    AddUpdateCost(p, /*sharded=*/false, &a);
    double c = 0;
    for (const auto& t2 : a.costs) c += opt_.async_price * Eval(t2);
    for (const auto& t2 : a.update_costs) c += Eval(t2);
    options.push_back({a, c});
    // Sufficient factor broadcasting for a data-parallel weight (rules.h):
    // gather x and dy, every device computes the whole dW.
    const graph::Op& o = g_.op(op);
    const std::optional<SufficientFactors> sfb =
        opt_.allow_sfb && partial && rule.kind == RuleKind::kData ? SfbFactors(g_, o, input)
                                                                  : std::nullopt;
    if (sfb) {
      SourceLoad s = l;
      s.storage = ParamStorage::kReplicated;
      s.storage_form = Form::R();
      s.sfb = true;
      double xb = static_cast<double>(g_.tensor(o.inputs[sfb->x_input]).type.bytes());
      double yb = static_cast<double>(g_.tensor(o.outputs[sfb->y_output]).type.bytes());
      s.costs.push_back(Gather(xb, &s.method));
      Method m2;
      s.costs.push_back(Gather(yb, &m2));
      CostTerm extra = coll_.Constant(0);
      for (int d = 0; d < cluster_.size(); ++d) {
        extra.constant[d] =
            sfb->flops / cluster_.device(d).flops * cluster_.device(d).OpTimeScale(o.type);
      }
      s.costs.push_back(extra);
      AddUpdateCost(p, /*sharded=*/false, &s);
      double c2 = 0;
      for (const auto& t2 : s.costs) c2 += Eval(t2);
      for (const auto& t2 : s.update_costs) c2 += Eval(t2);
      options.push_back({s, c2});
    }
  }
  if (allowed(ParamStorage::kZero) &&
      (opt_.allow_zero || opt_.force_storage == ParamStorage::kZero) && zero_possible) {
    SourceLoad z = l;
    z.storage = ParamStorage::kZero;
    z.storage_form = Form::S(0);
    // Gathered for forward and again for backward; gradient reduce-scattered.
    z.costs.push_back(Gather(bytes, &z.method));
    z.costs.push_back(z.costs.back());
    if (partial) {
      Method m;
      z.costs.push_back(Scatter(bytes * opt_.gradient_wire_scale, &m));
    }
    AddUpdateCost(p, /*sharded=*/true, &z);
    double c = 0;
    for (const auto& t2 : z.costs) c += opt_.async_price * Eval(t2);
    for (const auto& t2 : z.update_costs) c += Eval(t2);
    options.push_back({z, c});
  }
  if (allowed(ParamStorage::kZero) && opt_.allow_zero && !opt_.force_storage && zero_possible) {
    // ZeRO gathered once per step: one gather kept for backward, the
    // gradient reduce-scattered. Both are coalesced with the other such
    // parameters (planner/lower), so a tensor pays the transfer only; the
    // two calls' overhead is counted once per step (Finish).
    SourceLoad z = l;
    z.storage = ParamStorage::kZero;
    z.storage_form = Form::S(0);
    z.gather_once = true;
    z.costs.push_back(WithoutCallOverhead(Gather(bytes, &z.method), z.method));
    if (partial) {
      z.grad_reduce_scatter = true;
      Method m;
      CostTerm scatter = Scatter(bytes * opt_.gradient_wire_scale, &m);
      z.costs.push_back(WithoutCallOverhead(scatter, m));
    }
    AddUpdateCost(p, /*sharded=*/true, &z);
    double c = 0;
    for (const auto& t2 : z.costs) c += Eval(t2);
    for (const auto& t2 : z.update_costs) c += Eval(t2);
    options.push_back({z, c});
  }
  if (options.empty()) return false;
  if (random_seed_) {
    // RandomWalk: any option, drawn per parameter (the same draw each time
    // the walk loads it), so cheaper storage does not hide the others.
    uint64_t x = *random_seed_ ^ (0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(t) + 1));
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
    Option& pick = options[x % options.size()];
    *cost = pick.cost;
    *out = std::move(pick.load);
    return true;
  }
  auto best = std::min_element(options.begin(), options.end(),
                               [](const Option& a, const Option& b) { return a.cost < b.cost; });
  *cost = best->cost;
  *out = std::move(best->load);
  return true;
}

bool Searcher::Apply(const State& s, int r, State* out, double* cost, OpStep* detail) const {
  const OpId op_id = s.step;
  const graph::Op& op = g_.op(op_id);
  const ShardRule& rule = rules_[op_id][r];
  std::vector<Live> live = s.live;
  double c = compute_eval_[op_id][r];
  auto find = [&](TensorId t) -> Live* {
    auto it = std::lower_bound(live.begin(), live.end(), t,
                               [](const Live& l, TensorId x) { return l.tensor < x; });
    return (it != live.end() && it->tensor == t) ? &*it : nullptr;
  };
  if (detail) {
    detail->op = op_id;
    detail->rule_index = rule_index_[op_id][r];
    detail->rule = rule;
    detail->compute = compute_[op_id][r];
    detail->internal = internal_[op_id][r];
  }
  for (size_t j = 0; j < op.inputs.size(); ++j) {
    TensorId t = op.inputs[j];
    Form need = rule.inputs[j];
    Live* l = find(t);
    if (l == nullptr) {
      const graph::Tensor& tensor = g_.tensor(t);
      if (tensor.kind == TensorKind::kActivation) return false;  // dropped
      double lc = 0;
      SourceLoad load;
      if (tensor.kind == TensorKind::kParameter) {
        if (!LoadParameter(t, need, rule, static_cast<int>(j), op_id, &load, &lc)) {
          return false;
        }
      } else {
        if (need.is_partial()) return false;
        load.tensor = t;
        load.form = need;
        load.storage_form = need;
      }
      c += lc;
      if (detail) detail->loads.push_back(std::move(load));
      Live nl{t, {need.raw(), 0}, 1, false};
      auto it = std::lower_bound(live.begin(), live.end(), t,
                                 [](const Live& a, TensorId x) { return a.tensor < x; });
      live.insert(it, nl);
      continue;
    }
    if (l->Has(need)) continue;
    if (l->communicated || l->nforms == 2) return false;
    CommStep best;
    double best_cost = 0;
    bool found = false;
    for (int k = 0; k < l->nforms; ++k) {
      CommStep cs;
      double cc;
      Form from = Form::FromRaw(l->forms[k]);
      if (Convert(t, from, need, &cs, &cc) && (!found || cc < best_cost)) {
        best = std::move(cs);
        best_cost = cc;
        found = true;
      }
    }
    if (!found) return false;
    c += best_cost;
    l->forms[l->nforms++] = need.raw();
    l->communicated = true;
    if (detail) detail->comms.push_back(std::move(best));
  }
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    TensorId t = op.outputs[j];
    Form f = rule.outputs[j];
    if (t == g_.loss() && f.is_sharded()) return false;
    if (last_use_[t] <= op_id) continue;  // nobody reads it
    Live nl{t, {f.raw(), 0}, 1, false};
    auto it = std::lower_bound(live.begin(), live.end(), t,
                               [](const Live& a, TensorId x) { return a.tensor < x; });
    live.insert(it, nl);
  }
  live.erase(std::remove_if(live.begin(), live.end(),
                            [&](const Live& l) { return last_use_[l.tensor] <= op_id; }),
             live.end());
  out->step = s.step + 1;
  out->live = std::move(live);
  out->g = s.g + c;
  *cost = c;
  return true;
}

std::string Searcher::Key(const State& s) const {
  std::string k;
  k.reserve(4 + s.live.size() * 8);
  k.append(reinterpret_cast<const char*>(&s.step), sizeof(s.step));
  for (const Live& l : s.live) {
    k.append(reinterpret_cast<const char*>(&l.tensor), sizeof(l.tensor));
    AppendForms(l, &k);
  }
  return k;
}

}  // namespace hap::synth::internal
