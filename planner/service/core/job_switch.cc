// Whether a job switches to another plan (JobController, jobs.h): more
// devices joining, or a slowdown of the ones it runs on, judged against
// the plan it runs (predicted, then calibrated from what it measured); a
// switch at the next checkpoint when it gains min_gain. The rest of the
// reconciliation pass is in job_reconcile.cc.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/core/job_pass.h"
#include "planner/service/core/node_calibration.h"

namespace hap::service::job_internal {
namespace {

constexpr double kDefaultMinGain = 0.10;
// A deployment's median step counts as measured once it trained this many
// steps (fewer: start-up dominates).
constexpr int64_t kMinMeasuredSteps = 20;
// A slowdown is judged over this many steps (Deployment.recent_step_seconds
// is the median of rank 0's last 20), after this many warm-up steps of a
// deployment, against the default threshold.
constexpr int64_t kSlowdownWindow = 20;
constexpr int64_t kWarmupSteps = 2;
// A slowdown waits for every rank's profile of the slow steps at most this
// many steps: ranks that never profile (CUDA ranks, whose kernels' wall
// times are launch times; a rank planned on a GPU that runs on the CPU)
// held it for ever. The executors report a profile each 20 steps after 2
// warm-up steps, so a rank that profiles has by then.
constexpr int64_t kProfileWaitSteps = 3 * kSlowdownWindow;
constexpr double kDefaultSlowdownThreshold = 0.25;

double MinGain(const v1::JobSpec& s) {
  return s.replan().has_min_gain() ? s.replan().min_gain() : kDefaultMinGain;
}
double SlowdownThreshold(const v1::JobSpec& s) {
  return s.replan().slowdown_threshold() > 0 ? s.replan().slowdown_threshold()
                                             : kDefaultSlowdownThreshold;
}

// Whether every rank of `d` has reported a profile starting at `from` or
// later.
bool Profiled(const v1::Deployment& d, int64_t from) {
  if (d.rank_profiles_size() != d.ranks_size() || d.ranks_size() == 0) return false;
  for (const auto& p : d.rank_profiles()) {
    if (p.steps() <= 0 || p.first_step() < from) return false;
  }
  return true;
}

}  // namespace

void Pass::ConsiderJoin(const v1::Deployment& d) {
  if (!st().candidate_plan().empty()) return JudgeCandidate(d);
  if (spec().replan().disable_join() || st().slowdown_step() > 0) return;
  // Judged against the current deployment as measured: not before it has
  // reported its median step and trained enough steps for it to count.
  if (st().measured_step_seconds() <= 0 ||
      StepsMeasured(st().events_size() - 1) < kMinMeasuredSteps) {
    return;
  }
  // A set judged not worth it is judged again once a joiner of it has
  // left or come back (its node measured anew: the plan may differ).
  {
    const std::set<std::string> used(st().devices().begin(), st().devices().end());
    for (const auto& d : st().judged_devices()) {
      if (!used.count(d) && !e_.stable.count(d)) {
        st().clear_judged_devices();
        break;
      }
    }
  }
  {
    std::set<std::string> pool(st().devices().begin(), st().devices().end());
    const size_t had = pool.size();
    const std::set<std::string> held = Unavailable();
    for (const auto& x : e_.stable) {
      if (!held.count(x)) pool.insert(x);
    }
    if (pool.size() == had) return;
    std::vector<std::string> want = UsableDevices(e_.cluster, spec().devices(), held, &pool);
    if (want.size() <= static_cast<size_t>(st().devices_size())) return;
    if (std::equal(want.begin(), want.end(), st().judged_devices().begin(),
                   st().judged_devices().end())) {
      return;  // judged already: not worth it
    }
    st().set_candidate_plan(NextPlanName());
    st().set_candidate_reason(v1::JobEvent::NODE_JOINED);
    st().set_message(
        absl::StrCat("judging a plan on ", want.size(), " devices (", st().candidate_plan(), ")"));
    if (!Commit()) return;
    absl::StatusOr<v1::Plan> p = b_.CreatePlan(PlanRequest(st().candidate_plan(), want), j_.name());
    if (!p.ok() && !absl::IsAlreadyExists(p.status())) {
      st().set_message(absl::StrCat("a plan on ", want.size(), " devices: ", p.status().message()));
      *st().mutable_judged_devices() = {want.begin(), want.end()};
      st().clear_candidate_plan();
    }
    return;
  }
}

void Pass::JudgeCandidate(const v1::Deployment& d) {
  const bool slowdown = st().candidate_reason() == v1::JobEvent::SLOWDOWN;
  // Gone, or another's of its name (judged again later, under a new name).
  absl::StatusOr<v1::Plan> p = OwnPlan(st().candidate_plan());
  if (!p.ok()) {
    st().clear_candidate_plan();
    return;
  }
  switch (p->state()) {
    case v1::Plan::SUCCEEDED:
      break;
    case v1::Plan::FAILED:
    case v1::Plan::CANCELLED:
      if (slowdown) {
        ExpectNow(d);
      } else {
        *st().mutable_judged_devices() = p->devices();
      }
      st().set_message(absl::StrCat("staying: ", p->name(), " on ", p->devices_size(),
                                    " devices ended ", v1::Plan::State_Name(p->state()), ": ",
                                    p->error()));
      st().clear_candidate_plan();
      return;
    default:
      return;  // still planning
  }
  {  // a joiner left again, or its node was registered anew since
    std::set<std::string> have(st().devices().begin(), st().devices().end());
    have.insert(e_.stable.begin(), e_.stable.end());
    if (!Missing(p->devices(), e_.ready).empty() || !Missing(p->devices(), have).empty()) {
      st().clear_candidate_plan();
      st().clear_switch_pending();
      return;
    }
  }
  const Judgement g = slowdown ? JudgeSlowdown(*p, d) : Judge(*p);
  const double gain = g.gain;
  const std::string what = g.what;
  // Not worth it: a joining set is not judged again (until a joiner of
  // it changes); after a slowdown, the step measured now becomes what the
  // job expects of its plan. A switch that waited for its checkpoint is
  // dropped with the candidate (the noise it was judged on passed): left
  // pending, it kept every later slowdown from being seen (the CI's
  // throttled demo once ran 180 steps 50% slow without a re-plan).
  auto stay = [&](const std::string& message) {
    if (slowdown) {
      ExpectNow(d);
    } else {
      *st().mutable_judged_devices() = p->devices();
    }
    st().set_message(message);
    DropCandidate();
  };
  if (gain < MinGain(spec())) {
    return stay(absl::StrFormat("staying: %s, below min_gain %.1f%%", what, 100 * MinGain(spec())));
  }
  if (gain <= 0) {  // min_gain 0: a plan no faster is not worth a restart
    return stay(absl::StrCat("staying: ", what, ", no faster"));
  }
  if (spec().training().checkpoint_every() <= 0) {
    return stay(absl::StrCat("staying: ", what,
                             ", but the job has no periodic checkpoints (a switch would lose "
                             "every step)"));
  }
  if (!st().switch_pending() && st().replans() >= MaxReplans(spec())) {
    // An optional switch never fails a job that trains: past the budget
    // the job stays on its plan (re-plans forced by a loss still count).
    return stay(absl::StrCat("staying: ", what, ", but the job has made its max_replans ",
                             MaxReplans(spec()), " re-plans"));
  }
  if (!st().switch_pending()) {
    st().set_switch_pending(true);
    st().set_switch_after_step(st().checkpoint_step());
    st().set_judged_step_seconds(slowdown ? d.recent_step_seconds() : 0);
    st().set_judged_until_step(slowdown ? d.recent_steps_end() : 0);
    st().set_message(absl::StrCat("switching at the next checkpoint: ", what));
    return;
  }
  if (slowdown && ChangedSinceJudged(d, p->name())) return;
  if (st().checkpoint_step() <= st().switch_after_step()) return;
  // A checkpoint at the job's last step ends it: nothing is left to run
  // faster, so no switch (the demo once re-planned at step 600 of 600).
  if (st().checkpoint_step() >= spec().training().steps()) return;
  const std::string candidate = st().candidate_plan();
  st().clear_candidate_plan();  // becomes next_plan, not cancelled
  BeginReplan(slowdown ? v1::JobEvent::SLOWDOWN : v1::JobEvent::NODE_JOINED,
              slowdown ? absl::StrCat(st().slowdown_detail(), "; ", what) : what);
  if (OverReplanLimit()) return;
  st().set_next_plan(candidate);
  st().set_switched_from_step_seconds(d.recent_step_seconds());
  st().set_switched_from_plan(st().plan());
  // Saved before the deployment is stopped (a pass that cannot save the
  // switch stops nothing; the next judges it again). A refused stop is
  // asked again by the passes that follow, until the deployment is final
  // (RECOVERING's old deployment, above).
  if (!Commit()) return;
  (void)b_.StopDeployment(st().deployment());
}

int64_t Pass::StepsMeasured(int i) const {
  const v1::JobStatus& s = j_.status();
  if (i < 0 || i >= s.events_size()) return 0;
  const int64_t end =
      i + 1 < s.events_size() ? s.events(i + 1).steps_done_before() : s.steps_done();
  return end - s.events(i).resume_step();
}

Pass::Judgement Pass::Judge(const v1::Plan& p) const {
  const v1::JobStatus& s = j_.status();
  const double now_pred = s.predicted_step_seconds();
  const double then_pred = p.prediction().step_seconds();
  Judgement g;
  g.gain = then_pred > 0 ? now_pred / then_pred - 1 : 0;
  g.what = absl::StrFormat("%s on %d devices is predicted %.1f%% faster (%.4f s -> %.4f s)",
                           p.name(), p.devices_size(), 100 * g.gain, now_pred, then_pred);
  const double now_meas = s.measured_step_seconds();
  if (now_meas <= 0 || now_pred <= 0 || then_pred <= 0) return g;
  if (!p.calibration().empty()) {
    // Planned with the devices' calibration: its prediction is the
    // calibrated model's already.
    g.gain = now_meas / then_pred - 1;
    g.what = absl::StrFormat(
        "%s on %d devices is expected %.1f%% faster (measured %.4f s now -> %.4f s predicted "
        "by the calibrated model)",
        p.name(), p.devices_size(), 100 * g.gain, now_meas, then_pred);
    return g;
  }
  const std::set<std::string> want(p.devices().begin(), p.devices().end());
  double factor = now_meas / now_pred;
  std::string basis = "the current deployment's";
  for (int i = s.events_size() - 1; i >= 0; --i) {
    const v1::JobEvent& e = s.events(i);
    if (e.measured_step_seconds() <= 0 || e.predicted_step_after() <= 0 || e.calibrated() ||
        StepsMeasured(i) < kMinMeasuredSteps) {
      continue;
    }
    if (std::set<std::string>(e.devices_after().begin(), e.devices_after().end()) != want) {
      continue;
    }
    factor = e.measured_step_seconds() / e.predicted_step_after();
    basis = absl::StrCat(e.deployment(), "'s on the same devices");
    break;
  }
  const double then_cal = then_pred * factor;
  g.gain = now_meas / then_cal - 1;
  g.what = absl::StrFormat(
      "%s on %d devices is expected %.1f%% faster (measured %.4f s now -> %.4f s: predicted "
      "%.4f s x %.2f, %s measured/predicted)",
      p.name(), p.devices_size(), 100 * g.gain, now_meas, then_cal, then_pred, factor, basis);
  return g;
}

Pass::Judgement Pass::JudgeSlowdown(const v1::Plan& p, const v1::Deployment& d) const {
  Judgement g;
  const double then = p.prediction().step_seconds();
  const double now = d.recent_step_seconds();
  if (then <= 0) {
    g.what = absl::StrCat(p.name(), " has no prediction");
    return g;
  }
  if (p.calibration().empty() || now <= 0) {
    const double was = j_.status().predicted_step_seconds();
    g.gain = was / then - 1;
    g.what = absl::StrFormat("%s is predicted %.1f%% faster (%.4f s -> %.4f s, uncalibrated)",
                             p.name(), 100 * g.gain, was, then);
    return g;
  }
  g.gain = now / then - 1;
  g.what = absl::StrFormat(
      "%s is expected %.1f%% faster (measured %.4f s over the last %d steps -> %.4f s "
      "predicted by the recalibrated model)",
      p.name(), 100 * g.gain, now, kSlowdownWindow, then);
  return g;
}

bool Pass::ChangedSinceJudged(const v1::Deployment& d, const std::string& candidate) {
  const double was = st().judged_step_seconds();
  const double now = d.recent_step_seconds();
  if (was <= 0 || now <= 0 || d.recent_steps_end() <= st().judged_until_step()) return false;
  const double threshold = SlowdownThreshold(spec());
  if (now <= (1 + threshold) * was && now * (1 + threshold) >= was) return false;
  st().set_slowdown_step(
      std::max(st().judged_until_step() + 1, d.recent_steps_end() - kSlowdownWindow));
  st().set_slowdown_detail(absl::StrFormat(
      "slowdown: the median of the last %d steps is %.4f s, %+.0f%% from the %.4f s %s was "
      "judged on before its switch",
      kSlowdownWindow, now, 100 * (now / was - 1), was, candidate));
  st().set_message(absl::StrCat(st().slowdown_detail(),
                                "; recalibrating once every rank profiled steps from ",
                                st().slowdown_step()));
  DropCandidate();
  return true;
}

void Pass::DropCandidate() {
  st().clear_candidate_plan();
  st().clear_switch_pending();
  st().clear_judged_step_seconds();
  st().clear_judged_until_step();
}

void Pass::CalibrateFrom(const v1::Deployment& d) {
  if (st().calibrated_deployment() == d.name() || !Profiled(d, 0)) return;
  st().set_calibrated_deployment(d.name());
  absl::StatusOr<std::string> c = b_.Calibrate(d);
  if (c.ok()) {
    st().set_message(*c);
  } else if (!absl::IsUnimplemented(c.status())) {
    st().set_message(absl::StrCat("no calibration from ", d.name(), ": ", c.status().message()));
  }
}

void Pass::ExpectNow(const v1::Deployment& d) {
  st().set_expected_step_seconds(d.recent_step_seconds());
  st().set_expected_until_step(d.recent_steps_end());
  st().clear_candidate_reason();
}

void Pass::SlowerThanSwitchedFrom(const v1::Deployment& d, double threshold) {
  const double beat = st().switched_from_step_seconds();
  const std::string from_plan = st().switched_from_plan();
  st().clear_switched_from_step_seconds();
  st().clear_switched_from_plan();
  const double now = d.recent_step_seconds();
  if (beat <= 0 || now <= (1 + threshold) * beat || st().slowdown_step() > 0) return;
  st().set_slowdown_step(std::max<int64_t>(1, d.recent_steps_end() - kSlowdownWindow));
  st().set_slowdown_detail(absl::StrFormat(
      "slowdown: the first %d steps of %s measure %.4f s, %.0f%% above the %.4f s of %s it "
      "was chosen to beat",
      kSlowdownWindow, st().plan(), now, 100 * (now / beat - 1), beat, from_plan));
  st().set_message(absl::StrCat(st().slowdown_detail(),
                                "; recalibrating once every rank profiled steps from ",
                                st().slowdown_step()));
}

void Pass::ConsiderSlowdown(const v1::Deployment& d) {
  if (spec().replan().disable_slowdown()) return;
  const double threshold = SlowdownThreshold(spec());
  const int64_t resumed =
      st().events_size() > 0 ? st().events(st().events_size() - 1).resume_step() : 0;
  if (st().expected_step_seconds() <= 0 && d.recent_step_seconds() > 0 &&
      d.recent_steps_end() - resumed >= kSlowdownWindow + kWarmupSteps) {
    ExpectNow(d);  // the first window after warm-up: what the plan runs at
    SlowerThanSwitchedFrom(d, threshold);
    return;
  }
  if (!st().candidate_plan().empty() || st().switch_pending()) return;
  if (st().slowdown_step() == 0) {
    std::string seen;
    int64_t from = 0;
    if (st().expected_step_seconds() > 0 &&
        d.recent_steps_end() - kSlowdownWindow >= st().expected_until_step() &&
        d.recent_step_seconds() > (1 + threshold) * st().expected_step_seconds()) {
      seen = absl::StrFormat(
          "slowdown: the median of the last %d steps is %.4f s, %.0f%% above the %.4f s "
          "expected of %s",
          kSlowdownWindow, d.recent_step_seconds(),
          100 * (d.recent_step_seconds() / st().expected_step_seconds() - 1),
          st().expected_step_seconds(), st().plan());
      from = d.recent_steps_end() - kSlowdownWindow;
    }
    for (const auto& n : e_.cluster.nodes()) {
      for (const auto& dev : n.devices()) {
        auto it = st().device_flops().find(dev.id());
        if (!seen.empty() || it == st().device_flops().end()) continue;
        const double now = Fp32Flops(dev);
        if (now > 0 && now * (1 + threshold) < it->second) {
          seen = absl::StrFormat("slowdown: %s re-probed at %.1f GFLOP/s, was %.1f", dev.id(),
                                 now / 1e9, it->second / 1e9);
          from = std::max<int64_t>(1, st().steps_done());
        }
      }
    }
    if (seen.empty()) return;
    st().set_slowdown_step(std::max<int64_t>(1, from));
    st().set_slowdown_detail(seen);
    st().set_message(absl::StrCat(seen, "; recalibrating once every rank profiled steps from ",
                                  st().slowdown_step()));
  }
  // Calibration fits every rank's profile (one of a rank that has none of
  // the slow steps would be its profile from before them): without all of
  // them the candidate is judged by the model as it stands.
  absl::StatusOr<std::string> c;
  if (Profiled(d, st().slowdown_step())) {
    c = b_.Calibrate(d);
  } else {
    if (d.recent_steps_end() < st().slowdown_step() + kProfileWaitSteps) return;
    c = absl::FailedPreconditionError(
        absl::StrCat("not every rank has a profile of the steps from ", st().slowdown_step(),
                     " after ", kProfileWaitSteps, " steps; CUDA ranks are never profiled"));
  }
  st().set_calibrated_deployment(d.name());
  const std::vector<std::string> devices(st().devices().begin(), st().devices().end());
  st().set_candidate_plan(NextPlanName());
  st().set_candidate_reason(v1::JobEvent::SLOWDOWN);
  st().clear_slowdown_step();
  st().set_message(
      absl::StrCat(st().slowdown_detail(), "; ",
                   c.ok() ? *c : absl::StrCat("not recalibrated (", c.status().message(), ")"),
                   "; judging ", st().candidate_plan(), " on the same devices"));
  if (!Commit()) return;
  absl::StatusOr<v1::Plan> p =
      b_.CreatePlan(PlanRequest(st().candidate_plan(), devices), j_.name());
  if (!p.ok() && !absl::IsAlreadyExists(p.status())) {
    st().set_message(
        absl::StrCat("after a slowdown, a plan on the same devices: ", p.status().message()));
    ExpectNow(d);
    st().clear_candidate_plan();
  }
}

}  // namespace hap::service::job_internal
