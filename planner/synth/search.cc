#include "planner/synth/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "planner/graph/op_registry.h"
#include "planner/synth/gradients.h"

namespace hap::synth {
namespace {

using graph::OpId;
using graph::TensorId;
using graph::TensorKind;

// A live tensor: up to two forms (produced + one communicated).
struct Live {
  TensorId tensor;
  int8_t forms[2];
  int8_t nforms;
  bool communicated;

  bool Has(Form f) const {
    for (int i = 0; i < nforms; ++i) {
      if (forms[i] == f.raw()) return true;
    }
    return false;
  }
};

// The cost model's method for a program's (the dual keeps the method).
cost::Method CostMethod(Method m) {
  return m == Method::kGrouped ? cost::Method::kGrouped : cost::Method::kPadded;
}

// Appends a live tensor's forms (order-free) and communicated flag.
void AppendForms(const Live& l, std::string* k) {
  int8_t a = l.forms[0], b = l.nforms > 1 ? l.forms[1] : -100;
  if (l.nforms > 1 && b < a) std::swap(a, b);
  k->push_back(static_cast<char>(a));
  k->push_back(static_cast<char>(b));
  k->push_back(l.communicated ? 1 : 0);
}

struct State {
  int step = 0;
  std::vector<Live> live;  // sorted by tensor id
  double g = 0;
  int parent = -1;
  int rule = -1;  // rule applied at step-1 to reach this state
};

struct Candidate {
  double f;
  int64_t seq;
  int index;
  bool operator>(const Candidate& o) const {
    if (f != o.f) return f > o.f;
    return seq > o.seq;
  }
};

class Searcher {
 public:
  Searcher(const graph::Graph& g, const cost::ClusterModel& c,
           const SearchOptions& o, std::vector<double> ratios)
      : g_(g),
        cluster_(c),
        coll_(c),
        opt_(o),
        ratios_(std::move(ratios)),
        n_(static_cast<int>(g.ops().size())) {
    Prepare();
  }

  absl::StatusOr<Program> Run();
  // The repeated-block search (see RunBlocked); nullopt when the graph has
  // no repeated blocks or the budget ran out (then Run() takes over).
  std::optional<Program> RunBlocked();

 private:
  void Prepare();
  double Eval(const CostTerm& t) const { return cost::EvaluateTerm(t, ratios_); }
  // Runs rule `r` of the op at s.step. Returns false when it does not apply.
  bool Apply(const State& s, int r, State* out, double* cost,
             OpStep* detail) const;
  bool Convert(TensorId t, Form from, Form to, CommStep* out,
               double* cost) const;
  void AddUpdateCost(const graph::Tensor& p, bool sharded, SourceLoad* l) const;
  bool LoadParameter(TensorId t, Form need, const ShardRule& rule, int input,
                     OpId op, SourceLoad* out, double* cost) const;
  CostTerm Gather(double bytes, Method* m) const { return Uneven(bytes, true, m); }
  CostTerm Scatter(double bytes, Method* m) const {
    return Uneven(bytes, false, m);
  }
  CostTerm Uneven(double bytes, bool gather, Method* method) const;
  CostTerm WithoutCallOverhead(CostTerm t, Method m) const;
  std::string Key(const State& s) const;
  std::optional<int> Greedy(int from, int64_t node_budget);
  Program Reconstruct(int goal) const;
  // The program of `rules` applied from the empty state (costs unset).
  Program Replay(const std::vector<int>& rules) const;
  bool OutOfBudget();
  std::vector<int> Cuts() const;
  std::string Signature(int a, int b) const;
  std::string EntryKey(const State& s) const;
  Program Finish(Program p, bool optimal);

  const graph::Graph& g_;
  const cost::ClusterModel& cluster_;
  cost::CollectiveModel coll_;
  const SearchOptions& opt_;
  std::vector<double> ratios_;
  const int n_;

  std::vector<std::vector<ShardRule>> rules_;     // per op (filtered)
  std::vector<std::vector<int>> rule_index_;      // position in RulesFor
  std::vector<std::vector<CostTerm>> compute_;    // per op, per rule
  std::vector<std::vector<double>> compute_eval_;  // compute + internal
  std::vector<std::vector<CostTerm>> internal_;   // per op, per rule
  std::vector<int> last_use_;                     // per tensor
  std::vector<bool> requires_grad_;
  std::vector<double> h_;                         // per step

  std::vector<State> states_;
  int64_t expanded_ = 0;
  bool cut_ = false;
  std::chrono::steady_clock::time_point start_;
};

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
    for (const OpWork& w : work) launches += w.backward ? 3.0 : 1.0;
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
    const double launches = work[i].backward ? 3.0 : 1.0;
    std::vector<ShardRule> all = RulesFor(g_, i, ctx);
    for (size_t r = 0; r < all.size(); ++r) {
      if (opt_.rule_filter && !opt_.rule_filter(all[r])) continue;
      CostTerm t = coll_.Constant(0);
      for (int d = 0; d < cluster_.size(); ++d) {
        const auto& dev = cluster_.device(d);
        double secs = flops / dev.flops * dev.OpTimeScale(op.type);
        t.constant[d] = launches * dev.launch_overhead_seconds * exposed[d];
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
        best = *std::min_element(compute_eval_[i].begin(),
                                 compute_eval_[i].end());
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

bool Searcher::Convert(TensorId t, Form from, Form to, CommStep* out,
                       double* cost) const {
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
void Searcher::AddUpdateCost(const graph::Tensor& p, bool sharded,
                             SourceLoad* l) const {
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

bool Searcher::LoadParameter(TensorId t, Form need, const ShardRule& rule,
                             int input, OpId op, SourceLoad* out,
                             double* cost) const {
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
      a.costs.push_back(
          coll_.Constant(coll_.AllReduceTransfer(bytes * opt_.gradient_wire_scale)));
    }
    AddUpdateCost(p, /*sharded=*/false, &a);
    double c = 0;
    for (const auto& t2 : a.costs) c += opt_.async_price * Eval(t2);
    for (const auto& t2 : a.update_costs) c += Eval(t2);
    options.push_back({a, c});
    // Sufficient factor broadcasting for a data-parallel linear weight:
    // gather x and dy, every device computes the whole dW.
    const graph::Op& o = g_.op(op);
    if (opt_.allow_sfb && partial && o.type == "linear" && input == 1 &&
        rule.kind == RuleKind::kData) {
      SourceLoad s = l;
      s.storage = ParamStorage::kReplicated;
      s.storage_form = Form::R();
      s.sfb = true;
      double xb = static_cast<double>(g_.tensor(o.inputs[0]).type.bytes());
      double yb = static_cast<double>(g_.tensor(o.outputs[0]).type.bytes());
      s.costs.push_back(Gather(xb, &s.method));
      Method m2;
      s.costs.push_back(Gather(yb, &m2));
      const auto& w = p.type.shape;
      double rows = static_cast<double>(g_.tensor(o.inputs[0]).type.num_elements() /
                                        w[1]);
      double flops = 2.0 * rows * static_cast<double>(w[0] * w[1]);
      CostTerm extra = coll_.Constant(0);
      for (int d = 0; d < cluster_.size(); ++d) {
        extra.constant[d] =
            flops / cluster_.device(d).flops * cluster_.device(d).OpTimeScale("linear");
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
      (opt_.allow_zero || opt_.force_storage == ParamStorage::kZero) &&
      zero_possible) {
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
  if (allowed(ParamStorage::kZero) && opt_.allow_zero && !opt_.force_storage &&
      zero_possible) {
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
  auto best = std::min_element(
      options.begin(), options.end(),
      [](const Option& a, const Option& b) { return a.cost < b.cost; });
  *cost = best->cost;
  *out = std::move(best->load);
  return true;
}

bool Searcher::Apply(const State& s, int r, State* out, double* cost,
                     OpStep* detail) const {
  const OpId op_id = s.step;
  const graph::Op& op = g_.op(op_id);
  const ShardRule& rule = rules_[op_id][r];
  std::vector<Live> live = s.live;
  double c = compute_eval_[op_id][r];
  auto find = [&](TensorId t) -> Live* {
    auto it = std::lower_bound(
        live.begin(), live.end(), t,
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
        if (!LoadParameter(t, need, rule, static_cast<int>(j), op_id, &load,
                           &lc)) {
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
      auto it = std::lower_bound(
          live.begin(), live.end(), t,
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
    auto it = std::lower_bound(
        live.begin(), live.end(), t,
        [](const Live& a, TensorId x) { return a.tensor < x; });
    live.insert(it, nl);
  }
  live.erase(std::remove_if(live.begin(), live.end(),
                            [&](const Live& l) {
                              return last_use_[l.tensor] <= op_id;
                            }),
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

bool Searcher::OutOfBudget() {
  if (cut_) return true;
  if (expanded_ >= opt_.max_states) cut_ = true;
  if ((expanded_ & 255) == 0) {
    double secs = std::chrono::duration<double>(
                      std::chrono::steady_clock::now() - start_)
                      .count();
    if (secs > opt_.max_seconds) cut_ = true;
    if (opt_.cancelled && opt_.cancelled()) cut_ = true;
  }
  return cut_;
}

// Depth-first completion, cheapest rule first, with a node budget.
std::optional<int> Searcher::Greedy(int from, int64_t node_budget) {
  std::vector<std::pair<int, std::vector<std::pair<double, int>>>> stack;
  auto children = [&](int idx) {
    std::vector<std::pair<double, int>> kids;
    const State& s = states_[idx];
    for (int r = 0; r < static_cast<int>(rules_[s.step].size()); ++r) {
      State ns;
      double c;
      if (Apply(states_[idx], r, &ns, &c, nullptr)) kids.push_back({c, r});
    }
    std::sort(kids.begin(), kids.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    return kids;  // cheapest last (popped first)
  };
  if (states_[from].step == n_) return from;
  stack.push_back({from, children(from)});
  int64_t nodes = 0;
  while (!stack.empty() && nodes < node_budget) {
    auto& [idx, kids] = stack.back();
    if (kids.empty()) {
      stack.pop_back();
      continue;
    }
    int r = kids.back().second;
    kids.pop_back();
    State ns;
    double c;
    Apply(states_[idx], r, &ns, &c, nullptr);
    ns.parent = idx;
    ns.rule = r;
    states_.push_back(std::move(ns));
    ++nodes;
    int ni = static_cast<int>(states_.size()) - 1;
    if (states_[ni].step == n_) return ni;
    stack.push_back({ni, children(ni)});
  }
  return std::nullopt;
}

Program Searcher::Reconstruct(int goal) const {
  std::vector<int> rules;
  for (int i = goal; states_[i].parent >= 0; i = states_[i].parent) {
    rules.push_back(states_[i].rule);
  }
  std::reverse(rules.begin(), rules.end());
  return Replay(rules);
}

Program Searcher::Replay(const std::vector<int>& rules) const {
  Program p;
  State s;
  for (int r : rules) {
    OpStep step;
    State ns;
    double c;
    Apply(s, r, &ns, &c, &step);
    p.steps.push_back(std::move(step));
    s = std::move(ns);
  }
  return p;
}

// Steps where at most one tensor (of any kind) is live: the boundaries
// between blocks (a transformer layer's residual stream).
std::vector<int> Searcher::Cuts() const {
  const auto& tensors = g_.tensors();
  std::vector<int> delta(n_ + 2, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (last_use_[t] < 0) continue;
    int first = tensors[t].kind == TensorKind::kActivation
                    ? tensors[t].producer + 1
                    : tensors[t].consumers.front() + 1;
    if (first > last_use_[t]) continue;  // live at no step boundary
    delta[first] += 1;                   // live at steps first..last_use
    delta[last_use_[t] + 1] -= 1;
  }
  std::vector<int> cuts = {0};
  int live = 0;
  for (int s = 1; s < n_; ++s) {
    live += delta[s];
    if (live <= 1) cuts.push_back(s);
  }
  cuts.push_back(n_);
  return cuts;
}

// Everything that determines the transitions and costs of ops [a, b) from a
// given entry state: op types, attributes, shapes, how inputs refer to each
// other, sources, gradient requirements, and what stays live at b.
std::string Searcher::Signature(int a, int b) const {
  std::string sig;
  for (int k = a; k < b; ++k) {
    const graph::Op& op = g_.op(k);
    absl::StrAppend(&sig, op.type, "(");
    for (const auto& [name, v] : op.attrs.values()) {
      absl::StrAppend(&sig, name, "=", v.index(), ":");
      if (auto* i = std::get_if<int64_t>(&v)) absl::StrAppend(&sig, *i);
      if (auto* d = std::get_if<double>(&v)) absl::StrAppend(&sig, *d);
      if (auto* str = std::get_if<std::string>(&v)) absl::StrAppend(&sig, *str);
      if (auto* bo = std::get_if<bool>(&v)) absl::StrAppend(&sig, *bo);
      if (auto* is = std::get_if<std::vector<int64_t>>(&v)) {
        for (int64_t x : *is) absl::StrAppend(&sig, x, ",");
      }
      if (auto* fs = std::get_if<std::vector<double>>(&v)) {
        for (double x : *fs) absl::StrAppend(&sig, x, ",");
      }
      sig += ";";
    }
    sig += ")[";
    for (TensorId t : op.inputs) {
      const graph::Tensor& x = g_.tensor(t);
      if (x.kind == TensorKind::kActivation && x.producer >= a) {
        absl::StrAppend(&sig, "L", x.producer - a, ".", x.producer_output);
      } else if (x.kind == TensorKind::kActivation) {
        absl::StrAppend(&sig, "B", graph::TypeString(x.type));
      } else {
        absl::StrAppend(&sig, "S", static_cast<int>(x.kind), x.frozen,
                        graph::TypeString(x.type),
                        x.consumers.front() == k ? "new" : "old",
                        last_use_[t] >= b ? "live" : "");
      }
      absl::StrAppend(&sig, requires_grad_[t] ? "g" : "", ",");
    }
    sig += "]->";
    for (TensorId t : op.outputs) {
      absl::StrAppend(&sig, graph::TypeString(g_.tensor(t).type),
                      last_use_[t] >= b ? "X" : "", t == g_.loss() ? "loss" : "",
                      ",");
    }
    sig += "\n";
  }
  return sig;
}

std::string Searcher::EntryKey(const State& s) const {
  std::string k;
  for (const Live& l : s.live) AppendForms(l, &k);
  return k;
}

Program Searcher::Finish(Program p, bool optimal) {
  // Gradients that end partial through later ops (a split rule reading a
  // replicated activation, its partial gradient passed back through
  // replicated ops): the lowering all-reduces such a replicated parameter's
  // gradient in the bucket, so the program pays for it here.
  const GradientAnalysis grads = AnalyzeGradients(g_, p);
  for (OpStep& s : p.steps) {
    for (SourceLoad& l : s.loads) {
      if (!l.parameter || l.storage != ParamStorage::kReplicated || l.grad_allreduce ||
          l.sfb || !grads.partial_grad[l.tensor]) {
        continue;
      }
      l.grad_allreduce = true;
      l.costs.push_back(coll_.Constant(coll_.AllReduceTransfer(
          static_cast<double>(g_.tensor(l.tensor).type.bytes()) * opt_.gradient_wire_scale)));
    }
  }
  // Calls the lowering adds outside the searched steps, each paying the
  // per-call overhead: the gradient bucket's all-reduce (with a partial
  // loss in it), the gathered-once parameters' all-gather and reduce-scatter.
  int extra_calls = 0;
  bool bucket = false, partial_loss = false, gather = false, scatter = false;
  for (const OpStep& s : p.steps) {
    for (const SourceLoad& l : s.loads) {
      bucket = bucket || l.grad_allreduce;
      // The coalesced all-gather of the parameters gathered once and the
      // reduce-scatter of their gradients.
      if (l.gather_once) {
        gather = true;
        scatter = scatter || l.grad_reduce_scatter;
      }
    }
    const graph::Op& op = g_.op(s.op);
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      if (op.outputs[j] == g_.loss() && j < s.rule.outputs.size() &&
          s.rule.outputs[j].is_partial()) {
        partial_loss = true;
      }
    }
  }
  // A partial loss is summed in the gradient bucket's call when there is
  // one; the buckets (ScheduleCommunication) pay their own calls.
  // With bf16 gradients the loss (fp32) is summed in a call of its own.
  const bool loss_alone = partial_loss && (!bucket || opt_.gradient_wire_scale != 1.0);
  extra_calls = (loss_alone ? 1 : 0) + (gather ? 1 : 0) + (scatter ? 1 : 0);
  p.overhead = coll_.Constant(0);
  for (int d = 0; d < cluster_.size(); ++d) {
    p.overhead.constant[d] = cluster_.device(d).step_overhead_seconds +
                             extra_calls * cluster_.collective_overhead_seconds();
  }
  p.gradient_wire_scale = opt_.gradient_wire_scale;
  ScheduleCommunication(g_, coll_, ratios_, opt_.overlap, &p);
  ProgramCost pc = EvaluateProgram(p, ratios_);
  p.cost = pc.total;
  p.compute_seconds = pc.compute;
  p.communication_seconds = pc.communication;
  p.optimal = optimal;
  p.states_expanded = expanded_;
  p.states_generated = static_cast<int64_t>(states_.size());
  p.search_seconds = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - start_)
                         .count();
  return p;
}

// Repeated blocks: cut the op sequence where at most one tensor is live; a
// block's transitions from an entry state (the live tensor's forms) to every
// exit state are found once, exhaustively (Dijkstra inside the block), and
// reused for every block with the same signature. A DP over the cuts then
// combines blocks. Exact for the same state space as the A* search, and the
// work is per distinct block, not per layer.
std::optional<Program> Searcher::RunBlocked() {
  std::vector<int> cuts = Cuts();
  std::vector<std::string> sigs;
  absl::flat_hash_map<std::string, int> count;
  int longest = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    sigs.push_back(Signature(cuts[i], cuts[i + 1]));
    ++count[sigs.back()];
    longest = std::max(longest, cuts[i + 1] - cuts[i]);
  }
  bool repeated = false;
  for (const auto& [sig, c] : count) repeated = repeated || c > 1;
  if (!repeated || longest > 96) return std::nullopt;

  struct Exit {
    std::string key;
    double cost;
    std::vector<int> rules;
  };
  struct Front {
    double g;
    std::vector<int> rules;
    State state;
  };
  absl::flat_hash_map<std::string, std::vector<Exit>> tables;
  std::map<std::string, Front> front;
  front[""] = Front{0, {}, State{}};
  for (size_t seg = 0; seg + 1 < cuts.size(); ++seg) {
    int b = cuts[seg + 1];
    std::map<std::string, Front> next;
    for (const auto& [key, f] : front) {
      std::string tkey = absl::StrCat(sigs[seg], "|", key);
      auto it = tables.find(tkey);
      if (it == tables.end()) {
        // Dijkstra inside the block from this entry state.
        std::vector<State> local = {f.state};
        local[0].g = 0;
        local[0].parent = -1;
        absl::flat_hash_map<std::string, int> best;
        best[Key(local[0])] = 0;
        std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>>
            open;
        int64_t seq = 0;
        open.push({0, seq++, 0});
        std::vector<Exit> exits;
        while (!open.empty()) {
          Candidate top = open.top();
          open.pop();
          if (best[Key(local[top.index])] != top.index) continue;
          if (local[top.index].step == b) {
            Exit e;
            e.key = EntryKey(local[top.index]);
            e.cost = local[top.index].g;
            for (int i = top.index; local[i].parent >= 0; i = local[i].parent) {
              e.rules.push_back(local[i].rule);
            }
            std::reverse(e.rules.begin(), e.rules.end());
            exits.push_back(std::move(e));
            continue;
          }
          ++expanded_;
          if (OutOfBudget()) return std::nullopt;
          int idx = top.index;
          for (int r = 0; r < static_cast<int>(rules_[local[idx].step].size());
               ++r) {
            State ns;
            double c;
            if (!Apply(local[idx], r, &ns, &c, nullptr)) continue;
            std::string k = Key(ns);
            auto bi = best.find(k);
            if (bi != best.end() && local[bi->second].g <= ns.g) continue;
            ns.parent = idx;
            ns.rule = r;
            local.push_back(std::move(ns));
            int ni = static_cast<int>(local.size()) - 1;
            best[k] = ni;
            open.push({local[ni].g, seq++, ni});
          }
        }
        it = tables.emplace(tkey, std::move(exits)).first;
      }
      for (const Exit& e : it->second) {
        double g = f.g + e.cost;
        auto n = next.find(e.key);
        if (n != next.end() && n->second.g <= g) continue;
        // The concrete exit state of this block instance: replay the rules.
        State s = f.state;
        bool ok = true;
        for (int r : e.rules) {
          State ns;
          double c;
          ok = ok && Apply(s, r, &ns, &c, nullptr);
          if (!ok) break;
          s = std::move(ns);
        }
        if (!ok) return std::nullopt;  // signature collision: be safe
        Front nf{g, f.rules, std::move(s)};
        nf.rules.insert(nf.rules.end(), e.rules.begin(), e.rules.end());
        next[e.key] = std::move(nf);
      }
    }
    front = std::move(next);
    if (opt_.progress) opt_.progress(expanded_, 0);
    if (front.empty()) return std::nullopt;
  }
  auto done = front.find("");
  if (done == front.end()) return std::nullopt;
  return Finish(Replay(done->second.rules), true);
}

absl::StatusOr<Program> Searcher::Run() {
  start_ = std::chrono::steady_clock::now();
  for (int i = 0; i < n_; ++i) {
    if (rules_[i].empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no sharding rule of op '", g_.op(i).name, "' (", g_.op(i).type,
          ") is allowed under the requested restrictions"));
    }
  }
  if (opt_.block_search && !opt_.zero_heuristic) {
    if (std::optional<Program> p = RunBlocked()) {
      if (opt_.progress) opt_.progress(expanded_, p->cost);
      return *std::move(p);
    }
    cut_ = false;  // fall back to the A* search with the remaining budget
  }
  states_.push_back(State{});
  // An upper bound and a fallback: a greedy complete program.
  std::optional<int> incumbent = Greedy(0, 200000);
  double upper = incumbent ? states_[*incumbent].g : INFINITY;
  if (opt_.progress && incumbent) opt_.progress(0, upper);

  absl::flat_hash_map<std::string, int> best;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> open;
  int64_t seq = 0;
  best[Key(states_[0])] = 0;
  open.push({h_[0], seq++, 0});
  std::optional<int> goal;
  const double eps = 1e-12;
  while (!open.empty()) {
    Candidate top = open.top();
    open.pop();
    const State& s = states_[top.index];
    auto it = best.find(Key(s));
    if (it != best.end() && it->second != top.index) continue;  // stale
    if (s.step == n_) {
      goal = top.index;
      break;
    }
    ++expanded_;
    if (opt_.progress && expanded_ % opt_.progress_every == 0) {
      opt_.progress(expanded_, std::isfinite(upper) ? upper : 0);
    }
    if (OutOfBudget()) break;
    int idx = top.index;
    for (int r = 0; r < static_cast<int>(rules_[states_[idx].step].size());
         ++r) {
      State ns;
      double c;
      if (!Apply(states_[idx], r, &ns, &c, nullptr)) continue;
      double f = ns.g + h_[ns.step];
      if (f > upper * (1 + 1e-9) + eps) continue;  // cannot beat the incumbent
      std::string key = Key(ns);
      auto b = best.find(key);
      if (b != best.end() && states_[b->second].g <= ns.g + eps) continue;
      ns.parent = idx;
      ns.rule = r;
      states_.push_back(std::move(ns));
      int ni = static_cast<int>(states_.size()) - 1;
      best[key] = ni;
      open.push({f, seq++, ni});
    }
  }
  bool optimal = false;
  if (goal) {
    optimal = true;
  } else if (!cut_ && incumbent) {
    // Everything left was pruned by the bound: the incumbent is optimal.
    goal = incumbent;
    optimal = true;
  } else if (incumbent) {
    goal = incumbent;
  }
  if (!goal) {
    if (cut_ && opt_.cancelled && opt_.cancelled()) {
      return absl::CancelledError("synthesis cancelled before any program");
    }
    return cut_ ? absl::ResourceExhaustedError(
                      "search budget exhausted before any complete program; "
                      "raise the budget")
                : absl::FailedPreconditionError(
                      "no complete program exists under the restrictions");
  }
  Program p = Finish(Reconstruct(*goal), optimal);
  if (opt_.progress) opt_.progress(expanded_, p.cost);
  return p;
}

}  // namespace

std::vector<OpWork> TrainingWork(const graph::Graph& g) {
  std::vector<bool> requires_grad(g.tensors().size(), false);
  for (size_t t = 0; t < g.tensors().size(); ++t) {
    const graph::Tensor& x = g.tensors()[t];
    requires_grad[t] = x.kind == graph::TensorKind::kParameter && !x.frozen;
  }
  std::vector<OpWork> out(g.ops().size());
  for (graph::OpId i = 0; i < static_cast<graph::OpId>(g.ops().size()); ++i) {
    const graph::Op& op = g.op(i);
    const graph::OpDef* def = graph::OpRegistry::Global().Find(op.type);
    const std::vector<int>& nondiff = def->non_differentiable_inputs;
    bool any_grad = false;
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      bool diff = std::find(nondiff.begin(), nondiff.end(),
                            static_cast<int>(j)) == nondiff.end();
      if (diff && requires_grad[op.inputs[j]]) any_grad = true;
    }
    for (graph::TensorId o : op.outputs) requires_grad[o] = any_grad;
    out[i].backward = any_grad;
    out[i].flops = g.OpForwardFlops(i) *
                   (1.0 + (any_grad ? def->backward_flops_multiple : 0.0));
  }
  return out;
}


absl::StatusOr<Program> Synthesize(const graph::Graph& g,
                                   const cost::ClusterModel& cluster,
                                   const SearchOptions& options) {
  std::vector<double> ratios = options.ratios.empty()
                                   ? cluster.ProportionalRatios()
                                   : options.ratios;
  if (static_cast<int>(ratios.size()) != cluster.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratios have ", ratios.size(), " entries for ",
                     cluster.size(), " devices"));
  }
  double sum = 0;
  for (double r : ratios) {
    if (!(r >= 0) || !std::isfinite(r)) {
      return absl::InvalidArgumentError("ratios must be finite and >= 0");
    }
    sum += r;
  }
  if (std::abs(sum - 1) > 1e-6) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratios must sum to 1, they sum to ", sum));
  }
  Searcher s(g, cluster, options, std::move(ratios));
  return s.Run();
}

}  // namespace hap::synth
