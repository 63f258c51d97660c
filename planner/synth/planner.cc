#include "planner/synth/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/deadline.h"
#include "common/status_macros.h"
#include "planner/cost/collectives.h"
#include "planner/synth/snap.h"

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
  if (n == "dp-prop" || n == "dp-proportional")
    return Baseline::kDpProportional;
  if (n == "megatron") return Baseline::kMegatron;
  if (n == "zero3" || n == "zero-3") return Baseline::kZero3;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown baseline '", n,
                   "' (known: hap, dp-even, dp-prop, megatron, zero3)"));
}

ratios::MemoryConstraint MemoryModel(const graph::Graph& g, const cost::ClusterModel& cluster,
                                     const Program& p, OptimizerKind opt, double extra_gradients) {
  int n = cluster.size();
  ratios::MemoryConstraint m;
  m.coef.assign(1, std::vector<double>(n, 0));
  m.constant.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    m.capacity.push_back(static_cast<double>(cluster.device(i).memory_bytes));
    m.device_names.push_back(cluster.device(i).id);
  }
  double state = 2.0 + OptimizerStateMultiple(opt) + extra_gradients;  // value, grad, state
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

int64_t ToBytes(double bytes) {
  // 2^63 is a double; every double below it converts.
  constexpr double kLimit = 9223372036854775808.0;
  return bytes >= kLimit ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
}

std::vector<int64_t> MemoryAt(const ratios::MemoryConstraint& m,
                              const std::vector<double>& r) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < m.constant.size(); ++i) {
    out.push_back(ToBytes(m.constant[i] + m.coef[0][i] * r[i]));
  }
  return out;
}

absl::StatusOr<PlanResult> PlanModel(const graph::Graph& g,
                                     const cost::ClusterModel& cluster,
                                     const PlanOptions& o) {
  if (std::isnan(o.max_seconds)) {
    return absl::InvalidArgumentError(
        "max_seconds is NaN; expected seconds (0 or less: spent, infinity: no limit)");
  }
  if (!(std::isfinite(o.search_async_price) && o.search_async_price >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("search_async_price = ", o.search_async_price,
                                                   "; expected a finite value >= 0"));
  }
  for (graph::TensorId t : g.Inputs()) {
    const graph::Tensor& in = g.tensor(t);
    if (in.type.rank() >= 1 && in.type.shape[0] < cluster.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", in.name, "' has batch ", in.type.shape[0],
          ", smaller than the ", cluster.size(),
          " devices of the plan; give each device at least one sample"));
    }
  }
  const auto start = Clock::now();
  auto elapsed = [&]() {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  // Every phase (search, LP, snap, baselines) runs against one deadline.
  std::optional<Clock::time_point> deadline;
  if (o.max_seconds < kNoDeadlineSeconds) deadline = DeadlineAfter<Clock>(start, o.max_seconds);
  auto left = [&]() { return o.max_seconds - elapsed(); };
  PhaseSeconds phases;
  auto timed = [](double* into, auto f) {
    const auto t0 = Clock::now();
    auto r = f();
    *into += std::chrono::duration<double>(Clock::now() - t0).count();
    return r;
  };
  std::vector<std::string> notes;
  auto note = [&](std::string n) {
    if (std::find(notes.begin(), notes.end(), n) == notes.end()) {
      notes.push_back(std::move(n));
    }
  };
  auto cancelled = [&]() { return o.cancelled && o.cancelled(); };
  // A cancellation (PlanOptions::cancelled; the service's also fires at its
  // caller's deadline) ends the planning with the best plan found.
  auto note_cancelled = [&]() {
    note(
        "the planning was cancelled (or its caller's deadline passed): the plan is the best "
        "found, not proven optimal");
  };
  int64_t states = 0;
  SearchOptions so;
  so.allow_sfb = o.allow_sfb;
  so.allow_zero = o.allow_zero;
  so.allow_grouped = o.allow_grouped;
  so.overlap = o.overlap_communication;
  so.gradient_wire_scale = o.bf16_gradients ? 0.5 : 1.0;
  so.zero_heuristic = o.zero_heuristic;
  so.async_price = o.search_async_price;
  so.max_states = o.max_states;
  so.cancelled = o.cancelled;
  int iteration = 0;
  so.progress = [&](int64_t expanded, double best) {
    if (o.progress) o.progress(states + expanded, best, iteration);
  };
  auto search = [&](const SearchOptions& opts) {
    auto p =
        timed(&phases.search, [&]() { return Synthesize(g, cluster, opts); });
    if (p.ok()) {
      states += p->states_expanded;
      if (!p->optimal && cancelled()) {
        note_cancelled();
      } else if (!p->optimal) {
        note(p->states_expanded >= opts.max_states
                 ? absl::StrCat("the state budget (", opts.max_states,
                                " states) cut a search: the plan is the best "
                                "found, not proven optimal")
                 : absl::StrCat("the time budget (", o.max_seconds,
                                " s) cut a search: the plan is the best found, "
                                "not proven optimal"));
      }
    }
    return p;
  };
  // Set when memory was only checked at fixed ratios because the budget left
  // no time for the LP: a misfit there proves nothing.
  bool unproven_misfit = false;

  // The LP's ratios for `p`; `fixed` (a baseline's own split) is only
  // checked. When the budget ends before or inside the LP, the ratios `p` was
  // searched at stand in for the LP's, if they fit.
  auto memory_lp = [&](const Program& p, const std::vector<double>& at,
                       bool fixed)
      -> absl::StatusOr<std::pair<std::vector<double>, double>> {
    ratios::RatioLpRequest req;
    req.num_devices = cluster.size();
    AddProgramTerms(p, &req);
    if (!o.ignore_memory) req.memory = MemoryModel(g, cluster, p, o.optimizer);
    if (!fixed && left() > 0) {
      req.time_limit_seconds = left();
      auto r = timed(&phases.lp, [&]() { return ratios::SolveRatioLp(req); });
      if (r.ok()) return std::make_pair(r->ratios[0], r->objective);
      if (r.status().code() != absl::StatusCode::kDeadlineExceeded) {
        return r.status();
      }
    }
    if (!fixed) {
      note(absl::StrCat("the time budget (", o.max_seconds,
                        " s) ran out before a ratio LP finished: a program "
                        "kept the split it was searched at"));
    }
    absl::Status fits = ratios::CheckRatios(req, {at});
    if (!fixed && !fits.ok()) unproven_misfit = true;
    HAP_RETURN_IF_ERROR(fits);
    return std::make_pair(at, ratios::EvaluateObjective(req, {at}));
  };

  // Whole samples (snap.h); a candidate of the joint search also tries the
  // one-sample moves, within the budget. `c`'s ratios become the snapped
  // ones (where there is a batch to split) and its cost the program's at
  // them; `fits` false when no split of whole samples tried fits (`c` keeps
  // its fractional ratios and cost). Notes are the caller's (snap_notes),
  // for the candidate that becomes the plan.
  struct Snapped {
    bool fits = true;
    bool complete = true;
    int64_t moves = 0;
  };
  auto snap = [&](Candidate* c, bool neighbours) -> Snapped {
    Snapped out;
    const auto unsnapped = [&] {
      c->cost = EvaluateProgram(c->program, c->ratios).total;
      return out;
    };
    if (!o.snap_ratios_to_batch || g.Inputs().empty()) return unsnapped();
    const graph::Tensor& in = g.tensor(g.Inputs().front());
    const int n = cluster.size();
    if (in.type.rank() < 1 || in.type.shape[0] < n ||
        c->ratios.size() != static_cast<size_t>(n)) {
      return unsnapped();
    }
    std::optional<ratios::MemoryConstraint> mem;
    if (!o.ignore_memory)
      mem = MemoryModel(g, cluster, c->program, o.optimizer);
    SnapRequest q;
    q.program = &c->program;
    q.ratios = c->ratios;
    q.batch = in.type.shape[0];
    q.memory = mem ? &*mem : nullptr;
    q.neighbours = neighbours;
    q.deadline = deadline;
    SnapResult s = timed(&phases.snap, [&]() { return SnapToSamples(q); });
    out.complete = s.complete;
    out.moves = s.moves_evaluated;
    out.fits = !s.ratios.empty();
    if (out.fits) {
      c->ratios = std::move(s.ratios);
      c->cost = s.cost;  // EvaluateProgram's at them (synth_test checks)
    }
    return out;
  };
  auto snap_notes = [&](const Snapped& s) {
    if (!s.complete) {
      note(absl::StrCat("the time budget (", o.max_seconds,
                        " s) ran out while moving single samples between "
                        "devices: ",
                        s.moves, " moves of device groups tried"));
    }
    if (!s.fits) {
      note(
          "no split of whole samples tried (the ratios rounded, one sample moved) fits every "
          "device's memory: the plan keeps fractional ratios, and as the executors run them "
          "(rounded) a device may hold a sample more than fits");
    }
  };

  // `snapped`: c was snapped already (choose).
  auto finish = [&](Candidate c, bool optimal,
                    std::optional<Snapped> snapped = std::nullopt) -> PlanResult {
    if (!snapped) snapped = snap(&c, o.baseline == Baseline::kNone);
    snap_notes(*snapped);
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
    r.phases = phases;
    r.notes = std::move(notes);
    r.synthesis_seconds = elapsed();
    return r;
  };

  // Baselines: a restricted search at fixed ratios. As candidates beside the
  // search (not asked for by o.baseline) they are also the fallback when the
  // search's state budget left no program that fits, so they search with at
  // least the default state budget (their spaces are small; the time budget
  // still holds).
  auto baseline = [&](Baseline b) -> absl::StatusOr<Candidate> {
    SearchOptions bo = so;
    if (b != o.baseline) {
      bo.max_states = std::max(so.max_states, SearchOptions().max_states);
    }
    bo.allow_sfb = false;
    bo.allow_zero = b == Baseline::kZero3;
    bo.max_seconds = std::max(0.1, left());
    bool even = b != Baseline::kDpProportional;
    bo.ratios = even ? cluster.EvenRatios() : cluster.ProportionalRatios();
    if (b == o.baseline && !o.baseline_ratios.empty())
      bo.ratios = o.baseline_ratios;
    if (b == Baseline::kMegatron) {
      bo.rule_filter = TensorParallelRule;
      bo.force_storage = std::nullopt;
    } else {
      bo.rule_filter = DataParallelRule;
      bo.force_storage = b == Baseline::kZero3 ? ParamStorage::kZero
                                               : ParamStorage::kReplicated;
    }
    HAP_ASSIGN_OR_RETURN(Program p, search(bo));
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
      auto fit = memory_lp(c.program, c.ratios, /*fixed=*/true);
      if (!fit.ok()) {
        return absl::ResourceExhaustedError(
            absl::StrCat("baseline ", BaselineName(o.baseline),
                         " does not fit: ", fit.status().message()));
      }
    }
    bool opt = c.program.optimal;
    return finish(std::move(c), opt);
  }

  // The joint loop.
  Candidate best;
  // Every other program found (a former best, the overlap search's, each
  // baseline's at the LP's ratios and at its own) is snapped to whole
  // samples as it comes, and the fastest there is kept: as the lowering
  // runs them, it may beat `best`, whose ratios are the least LP cost but
  // fractional (choose). Only the fastest is held, not every candidate (at
  // 2,048 devices each holds tens of MiB of per-device costs).
  Candidate whole;
  Snapped whole_snap;
  auto consider = [&](Candidate c) {
    if (!o.snap_ratios_to_batch || (left() <= 0 && !whole.program.steps.empty())) return;
    const Snapped s = snap(&c, true);
    if (!s.fits) return;
    if (whole.program.steps.empty() || c.cost < whole.cost * (1 - 1e-9)) {
      whole = std::move(c);
      whole_snap = s;
    }
  };
  // `c` becomes `best` when its LP cost is lower (the former best
  // considered at whole samples), else it is considered. Whether it became
  // best.
  auto offer = [&](Candidate c) {
    if (c.cost < best.cost * (1 - 1e-9)) {
      if (!best.program.steps.empty()) consider(std::move(best));
      best = std::move(c);
      return true;
    }
    consider(std::move(c));
    return false;
  };
  // `best` at whole samples, or the fastest other there when it is faster
  // (ties go to `best`, so the LP's choice stands wherever rounding does not
  // reorder them) or `best` has no split of whole samples that fits.
  auto choose = [&](bool optimal) -> PlanResult {
    if (!o.snap_ratios_to_batch) return finish(std::move(best), optimal);
    const Snapped s = snap(&best, true);
    if (!whole.program.steps.empty() && (!s.fits || whole.cost < best.cost * (1 - 1e-9))) {
      return finish(std::move(whole), optimal, whole_snap);
    }
    return finish(std::move(best), optimal, s);
  };
  bool all_optimal = true;
  std::vector<double> r = cluster.ProportionalRatios();
  int max_iter = std::max(1, o.max_joint_iterations);
  // The errors that leave no plan: memory (a proven misfit), the search's
  // budget with no complete program, anything else.
  absl::Status memory_error, other_error;
  bool budget_error = false;
  auto keep_error = [&](const absl::Status& s) {
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      memory_error = s;
    } else if (other_error.ok()) {
      other_error = s;
    }
  };
  for (iteration = 1; iteration <= max_iter; ++iteration) {
    if (iteration > 1 && left() <= 0) {
      note(absl::StrCat("the time budget (", o.max_seconds,
                        " s) ended the search-LP loop after ", iteration - 1,
                        " iterations"));
      break;
    }
    so.ratios = r;
    so.max_seconds = std::max(0.1, left());
    auto p = search(so);
    if (!p.ok()) {
      if (p.status().code() == absl::StatusCode::kCancelled &&
          best.program.steps.empty()) {
        return p.status();
      }
      if (p.status().code() == absl::StatusCode::kResourceExhausted) {
        budget_error = true;
      } else if (other_error.ok()) {
        other_error = p.status();
      }
      break;  // keep the best so far (budget or cancellation)
    }
    all_optimal = all_optimal && p->optimal;
    auto lp = memory_lp(*p, r, /*fixed=*/false);
    if (!lp.ok() &&
        lp.status().code() == absl::StatusCode::kResourceExhausted &&
        so.allow_zero && !so.force_storage) {
      // Memory-bound: prefer sharded parameter storage and try again.
      memory_error = lp.status();
      so.force_storage = ParamStorage::kZero;
      --iteration;
      continue;
    }
    if (!lp.ok()) {
      keep_error(lp.status());
      break;  // the baselines below may still fit
    }
    if (!offer({*std::move(p), lp->first, lp->second, "search"})) break;
    r = best.ratios;
    if (cancelled()) break;
  }
  if (!best.program.steps.empty() && cancelled()) {
    // The comparisons below are left out: the caller no longer waits.
    note_cancelled();
    iteration = std::min(iteration, max_iter);
    return finish(std::move(best), false);
  }
  // With overlap, the search once more at the best split, pricing the
  // collectives that can run behind compute at what they slow it (1 - the
  // lowest overlap efficiency): programs that lean on them get considered;
  // the LP's critical path decides.
  if (o.overlap_communication && !best.program.steps.empty() && left() > 0) {
    SearchOptions ho = so;
    ho.ratios = best.ratios;
    ho.max_seconds = std::max(0.1, left());
    ho.async_price = 0;
    for (const cost::DeviceModel& d : cluster.devices()) {
      ho.async_price = std::max(ho.async_price, 1 - d.overlap_efficiency);
    }
    auto p = ho.async_price < 1 ? search(ho) : absl::StatusOr<Program>(absl::CancelledError());
    if (p.ok()) {
      auto lp = memory_lp(*p, best.ratios, /*fixed=*/false);
      if (lp.ok()) {
        offer({*std::move(p), lp->first, lp->second,
               "search (overlapped collectives priced as hidden)"});
      }
    }
  }
  // Baseline programs, ratios re-optimised: candidates in the same space,
  // and the plan when the search's programs do not fit. Once the budget is
  // spent they are skipped, unless nothing was found yet.
  for (Baseline b : {Baseline::kDpEven, Baseline::kDpProportional,
                     Baseline::kZero3, Baseline::kMegatron}) {
    if (!best.program.steps.empty() && left() <= 0) {
      note(absl::StrCat("the time budget (", o.max_seconds,
                        " s) ran out before the baseline programs from ",
                        BaselineName(b), " on were compared"));
      break;
    }
    auto c = baseline(b);
    if (!c.ok()) {
      if (c.status().code() == absl::StatusCode::kCancelled) break;
      budget_error = budget_error ||
                     c.status().code() == absl::StatusCode::kResourceExhausted;
      continue;
    }
    auto lp = memory_lp(c->program, c->ratios, /*fixed=*/false);
    if (!lp.ok()) {
      if (best.program.steps.empty() && memory_error.ok()) {
        keep_error(lp.status());
      }
      continue;
    }
    if (lp->second < best.cost * (1 - 1e-9)) {
      if (best.program.steps.empty()) {
        note(absl::StrCat(
            "no searched program fit or was found (",
            (memory_error.ok() ? other_error : memory_error).message(),
            "); the plan is the best baseline program"));
        all_optimal = false;
      }
    }
    // The baseline's own split too (a baseline planned alone runs it): at
    // whole samples it can beat the LP's. Memory is the snap's to check.
    consider({c->program, c->ratios, 0, absl::StrCat(BaselineName(b), " program, its own ratios")});
    offer({std::move(c->program), lp->first, lp->second,
           absl::StrCat(BaselineName(b), " program, LP ratios")});
  }
  if (best.program.steps.empty()) {
    if (unproven_misfit || budget_error) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the planning budget (", o.max_seconds, " s, ", o.max_states,
          " states) ran out before any plan that fits was found; raise it",
          memory_error.ok() ? "" : " (at the split searched: ",
          memory_error.message(), memory_error.ok() ? "" : ")"));
    }
    if (!memory_error.ok()) return memory_error;
    if (!other_error.ok()) return other_error;
    return absl::FailedPreconditionError("no program found");
  }
  iteration = std::min(iteration, max_iter);
  return choose(all_optimal);
}

}  // namespace hap::synth
