#include "planner/synth/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <queue>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_registry.h"
#include "planner/synth/gradients.h"
#include "planner/synth/searcher.h"

namespace hap::synth::internal {

bool Searcher::OutOfBudget() {
  if (cut_) return true;
  if (expanded_ >= opt_.max_states) cut_ = true;
  if ((expanded_ & 255) == 0) {
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
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

Program Searcher::Finish(Program p, bool optimal) {
  // Gradients that end partial through later ops (a split rule reading a
  // replicated activation, its partial gradient passed back through
  // replicated ops): the lowering all-reduces such a replicated parameter's
  // gradient in the bucket, so the program pays for it here.
  const GradientAnalysis grads = AnalyzeGradients(g_, p);
  for (OpStep& s : p.steps) {
    for (SourceLoad& l : s.loads) {
      if (!l.parameter || l.storage != ParamStorage::kReplicated || l.grad_allreduce || l.sfb ||
          !grads.partial_grad[l.tensor]) {
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
  p.search_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  return p;
}

absl::Status Searcher::EveryOpHasRules() const {
  for (int i = 0; i < n_; ++i) {
    if (rules_[i].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("no sharding rule of op '", g_.op(i).name, "' (", g_.op(i).type,
                       ") is allowed under the requested restrictions"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Program> Searcher::Run() {
  start_ = std::chrono::steady_clock::now();
  HAP_RETURN_IF_ERROR(EveryOpHasRules());
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
    for (int r = 0; r < static_cast<int>(rules_[states_[idx].step].size()); ++r) {
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
    return cut_
               ? absl::ResourceExhaustedError(
                     "search budget exhausted before any complete program; "
                     "raise the budget")
               : absl::FailedPreconditionError("no complete program exists under the restrictions");
  }
  Program p = Finish(Reconstruct(*goal), optimal);
  if (opt_.progress) opt_.progress(expanded_, p.cost);
  return p;
}

absl::StatusOr<Program> Searcher::RandomWalk(uint64_t seed) {
  start_ = std::chrono::steady_clock::now();
  HAP_RETURN_IF_ERROR(EveryOpHasRules());
  random_seed_ = seed;
  std::mt19937_64 rng(seed);
  // Depth-first: each state's applicable rules in a random order, the next
  // one taken when a later op has none left (a dead end).
  struct Frame {
    State state;
    std::vector<int> order;
    size_t next = 0;
  };
  auto frame = [&](State s) {
    Frame f{std::move(s), {}, 0};
    if (f.state.step == n_) return f;
    for (int r = 0; r < static_cast<int>(rules_[f.state.step].size()); ++r) {
      State ns;
      double c;
      if (Apply(f.state, r, &ns, &c, nullptr)) f.order.push_back(r);
    }
    for (size_t i = f.order.size(); i > 1; --i) std::swap(f.order[i - 1], f.order[rng() % i]);
    return f;
  };
  std::vector<Frame> stack;
  stack.push_back(frame(State{}));
  constexpr int64_t kNodeBudget = 1'000'000;
  int64_t nodes = 0;
  while (!stack.empty()) {
    if (stack.back().state.step == n_) {
      std::vector<int> rules;
      for (size_t i = 0; i + 1 < stack.size(); ++i) {
        rules.push_back(stack[i].order[stack[i].next - 1]);
      }
      Program p = Replay(rules);
      random_seed_.reset();
      return Finish(std::move(p), /*optimal=*/false);
    }
    if (stack.back().next == stack.back().order.size()) {
      stack.pop_back();
      continue;
    }
    if (++nodes > kNodeBudget) {
      random_seed_.reset();
      return absl::ResourceExhaustedError("random walk: no complete program within its budget");
    }
    const int r = stack.back().order[stack.back().next++];
    State ns;
    double c;
    Apply(stack.back().state, r, &ns, &c, nullptr);
    stack.push_back(frame(std::move(ns)));
  }
  random_seed_.reset();
  return absl::FailedPreconditionError("no complete program exists under the restrictions");
}

}  // namespace hap::synth::internal

namespace hap::synth {

namespace {

// The ratios the search runs at: options.ratios, or proportional to the
// devices' FLOP/s; InvalidArgument when they do not fit the cluster.
absl::StatusOr<std::vector<double>> SearchRatios(const cost::ClusterModel& cluster,
                                                 const SearchOptions& options) {
  std::vector<double> ratios =
      options.ratios.empty() ? cluster.ProportionalRatios() : options.ratios;
  if (static_cast<int>(ratios.size()) != cluster.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratios have ", ratios.size(), " entries for ", cluster.size(), " devices"));
  }
  double sum = 0;
  for (double r : ratios) {
    if (!(r >= 0) || !std::isfinite(r)) {
      return absl::InvalidArgumentError("ratios must be finite and >= 0");
    }
    sum += r;
  }
  if (std::abs(sum - 1) > 1e-6) {
    return absl::InvalidArgumentError(absl::StrCat("ratios must sum to 1, they sum to ", sum));
  }
  return ratios;
}

// InvalidArgument naming the first option that cannot be searched with.
absl::Status CheckOptions(const SearchOptions& o) {
  if (std::isnan(o.max_seconds)) {
    return absl::InvalidArgumentError(
        "max_seconds is NaN; expected seconds (0 or less: spent, infinity: no limit)");
  }
  if (!(std::isfinite(o.async_price) && o.async_price >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("async_price = ", o.async_price, "; expected a finite value >= 0"));
  }
  if (!(std::isfinite(o.gradient_wire_scale) && o.gradient_wire_scale > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("gradient_wire_scale = ", o.gradient_wire_scale,
                                                   "; expected a finite value > 0"));
  }
  if (o.progress_every < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress_every = ", o.progress_every, "; expected >= 1"));
  }
  return absl::OkStatus();
}

}  // namespace

using internal::Searcher;

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
      bool diff = std::find(nondiff.begin(), nondiff.end(), static_cast<int>(j)) == nondiff.end();
      if (diff && requires_grad[op.inputs[j]]) any_grad = true;
    }
    for (graph::TensorId o : op.outputs) requires_grad[o] = any_grad;
    out[i].backward = any_grad;
    out[i].flops = g.OpForwardFlops(i) * (1.0 + (any_grad ? def->backward_flops_multiple : 0.0));
  }
  return out;
}

absl::StatusOr<Program> Synthesize(const graph::Graph& g, const cost::ClusterModel& cluster,
                                   const SearchOptions& options) {
  HAP_RETURN_IF_ERROR(CheckOptions(options));
  HAP_ASSIGN_OR_RETURN(std::vector<double> ratios, SearchRatios(cluster, options));
  Searcher s(g, cluster, options, std::move(ratios));
  return s.Run();
}

absl::StatusOr<Program> RandomProgram(const graph::Graph& g, const cost::ClusterModel& cluster,
                                      const SearchOptions& options, uint64_t seed) {
  HAP_RETURN_IF_ERROR(CheckOptions(options));
  HAP_ASSIGN_OR_RETURN(std::vector<double> ratios, SearchRatios(cluster, options));
  Searcher s(g, cluster, options, std::move(ratios));
  return s.RandomWalk(seed);
}

}  // namespace hap::synth
