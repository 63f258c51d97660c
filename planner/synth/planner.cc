#include "planner/synth/planner.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/cost/collectives.h"
#include "planner/util/status_macros.h"

namespace hap::synth {
namespace {

using Clock = std::chrono::steady_clock;

double OptimizerStateMultiple(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kSgd:
      return 0;
    case OptimizerKind::kSgdMomentum:
      return 1;
    case OptimizerKind::kAdam:
      return 2;
  }
  return 1;
}

struct Candidate {
  Program program;
  std::vector<double> ratios;
  double cost = INFINITY;
  std::string source;
};

}  // namespace

bool DataParallelRule(const ShardRule& r) {
  if (r.kind == RuleKind::kTensor) return false;
  for (const auto* forms : {&r.inputs, &r.outputs}) {
    for (Form f : *forms) {
      if (f.is_sharded() && f.dim() != 0) return false;
    }
  }
  return true;
}

bool TensorParallelRule(const ShardRule& r) {
  return r.kind != RuleKind::kData;
}

const char* BaselineName(Baseline b) {
  switch (b) {
    case Baseline::kNone:
      return "hap";
    case Baseline::kDpEven:
      return "dp-even";
    case Baseline::kDpProportional:
      return "dp-prop";
    case Baseline::kMegatron:
      return "megatron";
    case Baseline::kZero3:
      return "zero3";
  }
  return "?";
}

absl::StatusOr<Baseline> ParseBaseline(const std::string& n) {
  if (n.empty() || n == "hap" || n == "none") return Baseline::kNone;
  if (n == "dp-even") return Baseline::kDpEven;
  if (n == "dp-prop" || n == "dp-proportional") return Baseline::kDpProportional;
  if (n == "megatron") return Baseline::kMegatron;
  if (n == "zero3" || n == "zero-3") return Baseline::kZero3;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown baseline '", n,
      "' (known: hap, dp-even, dp-prop, megatron, zero3)"));
}

ratios::MemoryConstraint MemoryModel(const graph::Graph& g,
                                     const cost::ClusterModel& cluster,
                                     const Program& p, OptimizerKind opt) {
  int n = cluster.size();
  ratios::MemoryConstraint m;
  m.coef.assign(1, std::vector<double>(n, 0));
  m.constant.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    m.capacity.push_back(static_cast<double>(cluster.device(i).memory_bytes));
    m.device_names.push_back(cluster.device(i).id);
  }
  double state = 2.0 + OptimizerStateMultiple(opt);  // value, grad, state
  auto add = [&](double bytes, Form f) {
    for (int i = 0; i < n; ++i) {
      if (f.is_sharded()) {
        m.coef[0][i] += bytes;
      } else {
        m.constant[i] += bytes;
      }
    }
  };
  for (const OpStep& s : p.steps) {
    for (const SourceLoad& l : s.loads) {
      const graph::Tensor& t = g.tensor(l.tensor);
      double bytes = static_cast<double>(t.type.bytes());
      if (l.parameter) {
        double mult = t.frozen ? 1.0 : state;
        add(bytes * mult, l.storage_form);
        // Gathered once: the whole value and its whole gradient live
        // through the step beside the shards.
        if (l.gather_once) add(bytes * (t.frozen ? 1.0 : 2.0), Form::R());
      } else {
        add(bytes, l.form);
      }
    }
    for (const CommStep& c : s.comms) {
      add(static_cast<double>(g.tensor(c.tensor).type.bytes()), c.to);
    }
    const graph::Op& op = g.op(s.op);
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      add(static_cast<double>(g.tensor(op.outputs[j]).type.bytes()),
          s.rule.outputs[j]);
    }
  }
  return m;
}

std::vector<int64_t> MemoryAt(const ratios::MemoryConstraint& m,
                              const std::vector<double>& r) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < m.constant.size(); ++i) {
    out.push_back(static_cast<int64_t>(m.constant[i] + m.coef[0][i] * r[i]));
  }
  return out;
}

absl::StatusOr<PlanResult> PlanModel(const graph::Graph& g,
                                     const cost::ClusterModel& cluster,
                                     const PlanOptions& o) {
  for (graph::TensorId t : g.Inputs()) {
    const graph::Tensor& in = g.tensor(t);
    if (in.type.rank() >= 1 && in.type.shape[0] < cluster.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", in.name, "' has batch ", in.type.shape[0],
          ", smaller than the ", cluster.size(),
          " devices of the plan; give each device at least one sample"));
    }
  }
  auto start = Clock::now();
  auto elapsed = [&]() {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  int64_t states = 0;
  SearchOptions so;
  so.allow_sfb = o.allow_sfb;
  so.allow_zero = o.allow_zero;
  so.allow_grouped = o.allow_grouped;
  so.zero_heuristic = o.zero_heuristic;
  so.max_states = o.max_states;
  so.cancelled = o.cancelled;
  int iteration = 0;
  so.progress = [&](int64_t expanded, double best) {
    if (o.progress) o.progress(states + expanded, best, iteration);
  };

  auto memory_lp = [&](const Program& p, const std::vector<double>* fixed)
      -> absl::StatusOr<std::pair<std::vector<double>, double>> {
    ratios::RatioLpRequest req;
    req.num_devices = cluster.size();
    req.terms = MergeTerms(p.BlockTerms());
    if (!o.ignore_memory) req.memory = MemoryModel(g, cluster, p, o.optimizer);
    req.time_limit_seconds = std::max(1.0, o.max_seconds - elapsed());
    if (fixed != nullptr) {
      // Baselines keep their ratios; check they fit.
      HAP_RETURN_IF_ERROR(ratios::CheckRatios(req, {*fixed}));
      return std::make_pair(*fixed, ratios::EvaluateObjective(req, {*fixed}));
    }
    HAP_ASSIGN_OR_RETURN(ratios::RatioLpResult r, ratios::SolveRatioLp(req));
    return std::make_pair(r.ratios[0], r.objective);
  };

  // Whole samples: the lowering runs RoundShards(batch, ratios) samples per
  // device, so the plan is predicted (and reported) at those. For the
  // search's own result the split is also moved by one sample between any
  // two devices where the model says that is faster.
  auto snap = [&](Candidate* c, bool neighbours) {
    if (!o.snap_ratios_to_batch || g.Inputs().empty()) return;
    const graph::Tensor& in = g.tensor(g.Inputs().front());
    const int n = cluster.size();
    if (in.type.rank() < 1 || in.type.shape[0] < n || c->ratios.size() != static_cast<size_t>(n)) {
      return;
    }
    const int64_t batch = in.type.shape[0];
    std::vector<int64_t> base = ratios::RoundShards(batch, c->ratios);
    std::vector<std::vector<int64_t>> splits = {base};
    if (neighbours) {
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          if (i == j || base[i] <= 1) continue;
          std::vector<int64_t> m = base;
          --m[i];
          ++m[j];
          splits.push_back(std::move(m));
        }
      }
    }
    const ratios::MemoryConstraint mem = MemoryModel(g, cluster, c->program, o.optimizer);
    double best_cost = INFINITY;
    std::vector<double> best;
    for (const std::vector<int64_t>& m : splits) {
      std::vector<double> r;
      bool ok = true;
      for (int d = 0; d < n; ++d) {
        ok = ok && m[d] >= 1;
        r.push_back(static_cast<double>(m[d]) / static_cast<double>(batch));
      }
      if (!ok) continue;
      if (!o.ignore_memory) {
        const std::vector<int64_t> bytes = MemoryAt(mem, r);
        for (int d = 0; d < n && ok; ++d) ok = bytes[d] <= cluster.device(d).memory_bytes;
        if (!ok) continue;
      }
      const double cost = EvaluateProgram(c->program, r).total;
      if (cost < best_cost * (1 - 1e-9)) {
        best_cost = cost;
        best = std::move(r);
      }
    }
    if (!best.empty()) c->ratios = std::move(best);
  };

  auto finish = [&](Candidate c, bool optimal) -> PlanResult {
    snap(&c, o.baseline == Baseline::kNone);
    PlanResult r;
    r.cost = EvaluateProgram(c.program, c.ratios);
    r.memory_bytes =
        MemoryAt(MemoryModel(g, cluster, c.program, o.optimizer), c.ratios);
    r.program = std::move(c.program);
    r.ratios = std::move(c.ratios);
    r.states_expanded = states;
    r.optimal = optimal;
    r.joint_iterations = iteration;
    r.source = c.source;
    r.synthesis_seconds = elapsed();
    return r;
  };

  // Baselines: a restricted search at fixed ratios.
  auto baseline = [&](Baseline b) -> absl::StatusOr<Candidate> {
    SearchOptions bo = so;
    bo.allow_sfb = false;
    bo.allow_zero = b == Baseline::kZero3;
    bo.max_seconds = std::max(0.1, o.max_seconds - elapsed());
    bool even = b != Baseline::kDpProportional;
    bo.ratios = even ? cluster.EvenRatios() : cluster.ProportionalRatios();
    if (b == o.baseline && !o.baseline_ratios.empty()) bo.ratios = o.baseline_ratios;
    if (b == Baseline::kMegatron) {
      bo.rule_filter = TensorParallelRule;
      bo.force_storage = std::nullopt;
    } else {
      bo.rule_filter = DataParallelRule;
      bo.force_storage = b == Baseline::kZero3 ? ParamStorage::kZero
                                               : ParamStorage::kReplicated;
    }
    HAP_ASSIGN_OR_RETURN(Program p, Synthesize(g, cluster, bo));
    states += p.states_expanded;
    Candidate c;
    c.ratios = bo.ratios;
    c.cost = EvaluateProgram(p, c.ratios).total;
    c.program = std::move(p);
    c.source = BaselineName(b);
    return c;
  };

  if (o.baseline != Baseline::kNone) {
    if (!o.baseline_ratios.empty()) {
      double sum = 0;
      bool ok = static_cast<int>(o.baseline_ratios.size()) == cluster.size();
      for (double x : o.baseline_ratios) {
        ok = ok && std::isfinite(x) && x > 0;
        sum += x;
      }
      if (!ok || std::abs(sum - 1) > 1e-6) {
        return absl::InvalidArgumentError(absl::StrCat(
            "baseline ratios must be ", cluster.size(),
            " positive numbers (one per device) summing to 1, got ",
            absl::StrJoin(o.baseline_ratios, ",")));
      }
    }
    HAP_ASSIGN_OR_RETURN(Candidate c, baseline(o.baseline));
    if (!o.ignore_memory) {
      auto fit = memory_lp(c.program, &c.ratios);
      if (!fit.ok()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "baseline ", BaselineName(o.baseline),
            " does not fit: ", fit.status().message()));
      }
    }
    bool opt = c.program.optimal;
    return finish(std::move(c), opt);
  }

  // The joint loop.
  Candidate best;
  bool all_optimal = true;
  std::vector<double> r = cluster.ProportionalRatios();
  int max_iter = std::max(1, o.max_joint_iterations);
  absl::Status memory_error;
  for (iteration = 1; iteration <= max_iter; ++iteration) {
    so.ratios = r;
    so.max_seconds = std::max(0.1, o.max_seconds - elapsed());
    auto p = Synthesize(g, cluster, so);
    if (!p.ok()) {
      if (best.program.steps.empty()) return p.status();
      break;  // keep the best so far (budget or cancellation)
    }
    states += p->states_expanded;
    all_optimal = all_optimal && p->optimal;
    auto lp = memory_lp(*p, nullptr);
    if (!lp.ok() && lp.status().code() == absl::StatusCode::kResourceExhausted &&
        so.allow_zero && !so.force_storage) {
      // Memory-bound: prefer sharded parameter storage and try again.
      memory_error = lp.status();
      so.force_storage = ParamStorage::kZero;
      --iteration;
      continue;
    }
    if (!lp.ok()) return lp.status();
    if (lp->second < best.cost * (1 - 1e-9)) {
      best.cost = lp->second;
      best.ratios = lp->first;
      best.program = *std::move(p);
      best.source = "search";
      r = best.ratios;
    } else {
      break;
    }
    if (o.cancelled && o.cancelled()) break;
  }
  if (best.program.steps.empty()) {
    return memory_error.ok()
               ? absl::FailedPreconditionError("no program found")
               : memory_error;
  }
  // Baseline programs, ratios re-optimised: candidates in the same space.
  for (Baseline b : {Baseline::kDpEven, Baseline::kDpProportional,
                     Baseline::kZero3, Baseline::kMegatron}) {
    auto c = baseline(b);
    if (!c.ok()) continue;
    auto lp = memory_lp(c->program, nullptr);
    if (!lp.ok()) continue;
    if (lp->second < best.cost * (1 - 1e-9)) {
      best.cost = lp->second;
      best.ratios = lp->first;
      best.program = std::move(c->program);
      best.source = absl::StrCat(BaselineName(b), " program, LP ratios");
    }
  }
  iteration = std::min(iteration, max_iter);
  return finish(std::move(best), all_optimal);
}

}  // namespace hap::synth
