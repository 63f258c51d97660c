// The jobs' reconciliation pass (JobController, jobs.h): one job observed
// against its deployment, the cluster and its checkpoints, and driven one
// step on (plan, deploy, follow, recover, re-plan, stop). Whether to switch
// to another plan (devices joining, a slowdown) is in job_switch.cc; the
// controller's resource API and the backend over the planner core are in
// jobs.cc.
#include "planner/service/core/job_reconcile.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "google/protobuf/util/message_differencer.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/deployments.h"
#include "planner/service/core/job_pass.h"
#include "planner/service/core/jobs.h"
#include "planner/service/core/node_calibration.h"
#include "planner/service/core/profile_checks.h"

namespace hap::service {

bool JobFinal(hap::v1::JobStatus::State s) {
  return s == hap::v1::JobStatus::SUCCEEDED || s == hap::v1::JobStatus::FAILED ||
         s == hap::v1::JobStatus::STOPPED;
}

}  // namespace hap::service

namespace hap::service::job_internal {

absl::Duration JoinStable(const v1::JobSpec& s) {
  const absl::Duration x = FromProto(s.replan().join_stable());
  return x > absl::ZeroDuration() ? x : kDefaultJoinStable;
}

// The devices of READY nodes, each with its node's agent address (a node
// registered again by a new agent comes back at another one).
std::map<std::string, std::string> ReadyDevices(const v1::Cluster& c) {
  std::map<std::string, std::string> out;
  for (const auto& n : c.nodes()) {
    if (n.state() == v1::Node::STALE) continue;
    for (const auto& d : n.devices()) out[d.id()] = n.address();
  }
  return out;
}

std::set<std::string> ClaimedDevices(const v1::Job& job, JobBackend& backend) {
  const v1::JobStatus& s = job.status();
  if (JobFinal(s.state())) return {};
  std::set<std::string> out(s.devices().begin(), s.devices().end());
  for (const std::string* plan : {&s.next_plan(), &s.candidate_plan()}) {
    if (plan->empty()) continue;
    absl::StatusOr<v1::Plan> p = backend.GetPlan(*plan);
    if (p.ok() && p->job() == job.name()) out.insert(p->devices().begin(), p->devices().end());
  }
  return out;
}

namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;
using Reason = v1::JobEvent::Reason;

// Checkpoints a job sets aside as damaged before a step is trained again;
// one more reported damaged FAILS it (JobStatus.damaged_in_a_row).
constexpr int kMaxDamagedInARow = 2;

// A recovery's detail (JobEvent.detail) says what started it and the
// latest failures while it recovers in at most this many bytes: one that
// kept failing appended every failure, and the job, saved whole on each
// change, grew without end.
constexpr size_t kMaxRecoveryDetail = 4096;
constexpr char kThenRecovering[] = "; then, while recovering: ";
constexpr char kLeftOut[] = " (failures since left out)";
// Ends the detail of a switch's event that a loss cut short.
constexpr char kCutShort[] = "; cut short by a loss before it trained (the next event)";

// A switch to another plan (devices joining, a slowdown), which the job
// chose, as against a re-plan a loss forced on it.
bool IsSwitch(Reason r) { return r == v1::JobEvent::NODE_JOINED || r == v1::JobEvent::SLOWDOWN; }

// `so_far`, a recovery's detail, with `latest` (a failure while it
// recovers) added, within kMaxRecoveryDetail.
std::string RecoveryDetail(const std::string& so_far, const std::string& latest) {
  std::string out = absl::StrCat(so_far, kThenRecovering, latest);
  if (out.size() <= kMaxRecoveryDetail) return out;
  std::string first = so_far.substr(0, so_far.find(kThenRecovering));
  if (!absl::EndsWith(first, kLeftOut)) {
    first = absl::StrCat(CutUtf8(first, kMaxRecoveryDetail / 4), kLeftOut);
  }
  return CutUtf8(absl::StrCat(first, kThenRecovering, latest), kMaxRecoveryDetail);
}

std::string ReasonLabel(Reason r) {
  std::string s = v1::JobEvent::Reason_Name(r);
  std::transform(s.begin(), s.end(), s.begin(), [](char c) {
    return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  });
  return s;
}

// No fewer than two: a plan of one device is not made (CreatePlan refuses
// it as INVALID_ARGUMENT, which would fail the job instead of waiting).
int MinDevices(const v1::JobSpec& s) { return std::max(2, s.devices().min_devices()); }

// A plan's failure that another plan of the same request may not meet:
// the store unavailable for its result, an aborted save.
bool PlannerSideFailure(int code) {
  return code == static_cast<int>(absl::StatusCode::kUnavailable) ||
         code == static_cast<int>(absl::StatusCode::kAborted);
}

}  // namespace

std::vector<std::string> UsableDevices(const v1::Cluster& c, const v1::DeviceSelector& sel,
                                       const std::set<std::string>& held,
                                       const std::set<std::string>* only) {
  std::set<std::string> allowed(sel.devices().begin(), sel.devices().end());
  std::vector<std::string> out;
  for (const auto& n : c.nodes()) {
    if (n.state() == v1::Node::STALE) continue;
    bool labelled = true;
    for (const auto& [k, v] : sel.node_labels()) {
      auto it = n.labels().find(k);
      labelled &= it != n.labels().end() && it->second == v;
    }
    if (!labelled) continue;
    for (const auto& d : n.devices()) {
      if (!allowed.empty() && !allowed.count(d.id())) continue;
      if (only != nullptr && !only->count(d.id())) continue;
      if (held.count(d.id())) continue;
      out.push_back(d.id());
    }
  }
  // At most max_devices, and never more than a plan takes: a job with no
  // max_devices on a larger cluster FAILED at its first plan.
  const int most =
      sel.max_devices() > 0 ? std::min(sel.max_devices(), kMaxPlanDevices) : kMaxPlanDevices;
  if (static_cast<int>(out.size()) > most) out.resize(most);
  return out;
}

std::set<std::string> Pass::Held() const {
  std::set<std::string> out;
  for (const auto& h : j_.status().held()) out.insert(h.device());
  return out;
}

std::set<std::string> Pass::Unavailable() const {
  std::set<std::string> out = Held();
  out.insert(e_.taken.begin(), e_.taken.end());
  return out;
}

void Pass::PruneHolds() {
  auto* held = st().mutable_held();
  for (int i = held->size() - 1; i >= 0; --i) {
    if (FromProto(held->Get(i).until()) <= e_.now) held->DeleteSubrange(i, 1);
  }
}

void Pass::Hold(const v1::Deployment& d) {
  for (int r : d.failed_ranks()) {
    if (r < 0 || r >= d.ranks_size()) continue;
    v1::JobStatus::Hold* h = nullptr;
    for (auto& x : *st().mutable_held()) {
      if (x.device() == d.ranks(r).device()) h = &x;
    }
    if (h == nullptr) h = st().add_held();
    h->set_device(d.ranks(r).device());
    *h->mutable_until() = ToProto(e_.now + JoinStable(spec()));
  }
}

bool Pass::Commit() {
  if (!e_.commit(j_)) return false;
  for (Reason r : replanned_) {
    if (e_.on_replan) e_.on_replan(j_, r);
  }
  replanned_.clear();
  for (const v1::JobEvent& ev : ended_) {
    if (e_.on_resumed) e_.on_resumed(j_, ev);
  }
  ended_.clear();
  return true;
}

bool Pass::Finish(v1::JobStatus::State state, const std::string& message) {
  st().set_state(state);
  st().set_message(message);
  st().clear_pending();
  st().clear_next_plan();
  st().clear_candidate_plan();
  st().clear_switch_pending();
  return Commit();
}

void Pass::RefreshCheckpoint() {
  absl::StatusOr<int64_t> step = b_.LatestCheckpoint(spec().training().checkpoint_dir());
  if (step.ok()) {
    st().set_checkpoint_step(*step);
  } else if (absl::IsNotFound(step.status())) {
    st().set_checkpoint_step(-1);
  }  // unreadable: keep what was seen
}

void Pass::CancelPlan(const std::string& name) {
  // A plan already gone or final is fine; one of this name that the job
  // did not make is left alone.
  if (!name.empty() && OwnPlan(name).ok()) (void)b_.CancelPlan(name);
}

absl::StatusOr<v1::Plan> Pass::OwnPlan(const std::string& name) {
  absl::StatusOr<v1::Plan> p = b_.GetPlan(name);
  if (p.ok() && p->job() != j_.name()) {
    return absl::AlreadyExistsError(absl::StrCat(name, " exists and was not made by ", j_.name(),
                                                 p->job().empty()
                                                     ? " (it was made through CreatePlan)"
                                                     : absl::StrCat(" but by ", p->job())));
  }
  if (p.ok() && p->has_create_time() && j_.has_create_time() &&
      FromProto(p->create_time()) < FromProto(j_.create_time())) {
    return absl::AlreadyExistsError(absl::StrCat(
        name, " exists and was not made by ", j_.name(), " but by an earlier job of that name (",
        absl::FormatTime(FromProto(p->create_time())), ", before this job was created)"));
  }
  return p;
}

void Pass::RunStop() {
  if (!st().next_plan().empty()) {
    absl::StatusOr<v1::Deployment> recorded = absl::NotFoundError("none recorded");
    if (!st().deployment().empty()) recorded = b_.GetDeployment(st().deployment());
    if ((!recorded.ok() || DeploymentFinal(recorded->state())) && OwnPlan(st().next_plan()).ok()) {
      for (const v1::Deployment& x : b_.DeploymentsOf(st().next_plan())) {
        if (!DeploymentFinal(x.state())) st().set_deployment(x.name());
      }
    }
  }
  CancelPlan(st().next_plan());
  CancelPlan(st().candidate_plan());
  st().clear_next_plan();
  st().clear_candidate_plan();
  if (!st().deployment().empty()) {
    absl::StatusOr<v1::Deployment> d = b_.GetDeployment(st().deployment());
    if (d.ok() && !DeploymentFinal(d->state())) {
      absl::Status s = b_.StopDeployment(d->name());
      st().set_message(s.ok() ? absl::StrCat("stopping ", d->name())
                              : absl::StrCat("stopping ", d->name(), ": ", s.message()));
      Commit();
      return;
    }
  }
  Finish(v1::JobStatus::STOPPED, "stopped on request");
}

void Pass::BeginReplan(Reason reason, const std::string& detail) {
  if (st().has_pending() && IsSwitch(st().pending().reason()) && !IsSwitch(reason)) {
    // A loss (or another forced re-plan) met while a switch is under way,
    // before its deployment trained: the switch's event ends here, cut
    // short, and the loss is an event of its own, as it would be had the
    // switch not been under way (`hapctl describe job` showed only the
    // switch, the node lost named deep in its detail). Its downtime is the
    // switch's up to the loss; the loss's counts from here, so the two add
    // up to the time without training.
    v1::JobEvent ev = st().pending();
    ev.set_detail(CutUtf8(absl::StrCat(ev.detail(), kCutShort), kMaxRecoveryDetail));
    ev.set_downtime_seconds(
        std::max(0.0, absl::ToDoubleSeconds(e_.now - FromProto(ev.detect_time()))));
    AddEvent(ev);
    ended_.push_back(std::move(ev));
    st().clear_pending();
  }
  if (st().has_pending()) {
    v1::JobEvent& p = *st().mutable_pending();
    p.set_detail(RecoveryDetail(p.detail(), detail));
    p.clear_plan();
    p.clear_deployment();
  } else {
    v1::JobEvent& p = *st().mutable_pending();
    p.Clear();
    p.set_reason(reason);
    p.set_detail(detail);
    *p.mutable_detect_time() = ToProto(e_.now);
    p.set_steps_done_before(st().steps_done());
    p.set_predicted_step_before(st().predicted_step_seconds());
    *p.mutable_devices_before() = st().devices();
  }
  st().set_replans(st().replans() + 1);
  st().set_state(v1::JobStatus::RECOVERING);
  st().set_message(absl::StrCat("re-planning (", ReasonLabel(reason), "): ", detail));
  if (reason != v1::JobEvent::NODE_JOINED && reason != v1::JobEvent::SLOWDOWN) {
    CancelPlan(st().next_plan());
  }
  st().clear_next_plan();
  CancelPlan(st().candidate_plan());
  st().clear_candidate_plan();
  st().clear_switch_pending();
  st().clear_judged_devices();
  st().clear_candidate_reason();
  st().clear_slowdown_step();
  st().clear_switched_from_step_seconds();
  st().clear_switched_from_plan();
  replanned_.push_back(reason);
}

bool Pass::FailedByPlannerRestart(const v1::Deployment& d) const {
  return FailedByPlannerRestartBeforeTraining(d) && d.failed_ranks().empty() &&
         j_.status().has_pending() && j_.status().pending().deployment() == d.name();
}

bool Pass::OverReplanLimit(bool deployment_live) {
  if (st().replans() <= MaxReplans(spec())) return false;
  if (!Finish(v1::JobStatus::FAILED,
              absl::StrCat("gave up after ", st().replans() - 1, " re-plans (max_replans ",
                           MaxReplans(spec()), "); the last: ", st().pending().detail()))) {
    return true;
  }
  if (deployment_live && !st().deployment().empty()) {
    // The job ends here and no later pass asks again: a refused stop is
    // said in the job's status, for the operator to act on.
    absl::Status stopped = b_.StopDeployment(st().deployment());
    if (!stopped.ok()) {
      absl::StrAppend(st().mutable_message(), "; stopping ", st().deployment(),
                      " failed: ", stopped.message());
      Commit();
    }
  }
  return true;
}

bool Pass::SetAsideDamaged(const v1::Deployment& d) {
  const std::string& dir = d.damaged_checkpoint();
  if (st().damaged_in_a_row() >= kMaxDamagedInARow) {
    // Checkpoints that every earlier run resumed from are now all
    // unreadable: more likely a node that does not see the storage as
    // the others do. Nothing more is renamed; a person looks.
    Finish(v1::JobStatus::FAILED,
           absl::StrCat("the checkpoint ", dir, " is reported damaged too (", d.error(),
                        "), after ", st().damaged_in_a_row(),
                        " set aside in a row without a step trained in between; that many "
                        "damaged checkpoints more likely means the executors do not see ",
                        spec().training().checkpoint_dir(),
                        " as written (a mount, a cache): check it, rename the damaged-step-N "
                        "directories that `hapctl checkpoint verify` finds sound back to "
                        "step-N, and create the job again"));
    return false;
  }
  absl::StatusOr<std::string> moved = b_.SetAsideDamagedCheckpoint(dir);
  std::string line;
  if (moved.ok()) {
    line = absl::StrCat(dir, " -> ", *moved);
  } else if (absl::IsNotFound(moved.status())) {
    line = absl::StrCat(dir, " (already gone)");  // a pass before renamed it, then did not save
  } else if (absl::IsUnavailable(moved.status())) {
    st().set_message(absl::StrCat("the checkpoint ", dir, " is damaged; setting it aside: ",
                                  moved.status().message(), "; trying again"));
    Commit();
    return false;
  } else {
    Finish(v1::JobStatus::FAILED,
           absl::StrCat("the checkpoint ", dir, " is damaged (", d.error(),
                        ") and cannot be set aside: ", moved.status().message(),
                        "; move it out of ", spec().training().checkpoint_dir(),
                        " and create the job again (it resumes from the checkpoint before)"));
    return false;
  }
  *st().add_damaged_checkpoints() = absl::StrCat(line, ": ", d.error());
  st().set_damaged_in_a_row(st().damaged_in_a_row() + 1);
  while (st().damaged_checkpoints_size() > static_cast<int>(e_.max_events)) {
    st().mutable_damaged_checkpoints()->DeleteSubrange(0, 1);
  }
  RefreshCheckpoint();
  BeginReplan(
      v1::JobEvent::CHECKPOINT_DAMAGED,
      absl::StrCat(d.name(), " could not resume: the checkpoint ", line,
                   " is damaged; resuming from ",
                   st().checkpoint_step() >= 0 ? absl::StrCat("step ", st().checkpoint_step())
                                               : std::string("step 0 (no checkpoint before it)"),
                   " (", d.error(), ")"));
  return true;
}

bool Pass::FollowDeployment() {
  absl::StatusOr<v1::Deployment> d = b_.GetDeployment(st().deployment());
  if (!d.ok()) {
    if (!absl::IsNotFound(d.status())) {
      st().set_message(absl::StrCat("cannot read ", st().deployment(), ": ", d.status().message()));
      Commit();
      return false;
    }
    if (!(st().has_pending() && st().pending().deployment().empty())) {
      BeginReplan(v1::JobEvent::EXECUTOR_LOST,
                  absl::StrCat(st().deployment(), " no longer exists"));
      if (OverReplanLimit(/*deployment_live=*/false)) return false;
    }
    st().clear_deployment();
    return true;
  }
  if (d->steps_completed() > st().steps_done()) {
    st().set_steps_done(d->steps_completed());
    st().clear_damaged_in_a_row();  // it restored a checkpoint and trained on
  }
  if (d->median_step_seconds() > 0) {
    st().set_measured_step_seconds(d->median_step_seconds());
    for (auto& ev : *st().mutable_events()) {
      if (ev.deployment() == d->name()) ev.set_measured_step_seconds(d->median_step_seconds());
    }
  }
  RefreshCheckpoint();
  // The (re)start in progress trained and ended between two passes, none
  // of which saw it RUNNING: it did resume, so its event is complete, its
  // downtime up to this pass. (A job that finished so dropped the event
  // with its pending one, and a loss after steps trained was taken for a
  // failure while recovering.)
  if (st().has_pending() && st().pending().deployment() == d->name() &&
      (d->state() == v1::Deployment::SUCCEEDED ||
       (DeploymentFinal(d->state()) && d->steps_completed() > st().pending().resume_step()))) {
    Resumed();
  }
  // Part of a recovery already under way: the old deployment being stopped.
  const bool old_of_recovery = st().has_pending() && st().pending().deployment().empty();
  switch (d->state()) {
    case v1::Deployment::SUCCEEDED:
      st().set_steps_done(std::max(st().steps_done(), spec().training().steps()));
      Finish(v1::JobStatus::SUCCEEDED, "every step done");
      return false;
    case v1::Deployment::FAILED:
      Hold(*d);
      if (!old_of_recovery) {
        if (!d->damaged_checkpoint().empty()) {
          if (!SetAsideDamaged(*d)) return false;
        } else if (FailedByPlannerRestart(*d)) {
          // Not a loss: the planner restarted while this (re)start was
          // pushed, and failed it. The same plan is deployed again, not
          // counted: it cost a re-plan, and one past max_replans failed
          // the job (with max_replans 0, at its first deployment) for an
          // operator's restart of the planner. A rank truly lost fails the
          // next deployment as a loss.
          st().set_next_plan(d->plan());
          st().mutable_pending()->clear_plan();
          st().mutable_pending()->clear_deployment();
          st().set_message(
              absl::StrCat(d->name(), ": ", d->error(), "; deploying ", d->plan(), " again"));
        } else {
          BeginReplan(v1::JobEvent::EXECUTOR_LOST, absl::StrCat(d->name(), ": ", d->error()));
        }
        if (OverReplanLimit(/*deployment_live=*/false)) return false;
      }
      st().clear_deployment();
      return true;
    case v1::Deployment::STOPPED:
      // Only the old deployment of a recovery is stopped by the job; any
      // other (the recovery's new one included) was stopped outside it
      // and its redeploy counts against max_replans, as a failure does.
      if (!old_of_recovery) {
        BeginReplan(v1::JobEvent::DEPLOYMENT_STOPPED,
                    absl::StrCat(d->name(), " was stopped outside the job"));
        if (OverReplanLimit(/*deployment_live=*/false)) return false;
      }
      st().clear_deployment();
      return true;
    default:
      break;
  }
  if (old_of_recovery) {  // asked to stop; ask again until it has
    (void)b_.StopDeployment(d->name());
    Commit();
    return false;
  }
  std::vector<std::string> devices;
  for (const auto& r : d->ranks()) devices.push_back(r.device());
  std::vector<std::string> lost = Missing(devices, e_.ready);
  if (!lost.empty()) {
    BeginReplan(v1::JobEvent::NODE_STALE,
                absl::StrCat("the node of ", absl::StrJoin(lost, ", "),
                             " missed its heartbeats (STALE); stopping ", d->name()));
    if (OverReplanLimit()) return false;
    // The recovery is saved before the deployment is stopped: a pass that
    // cannot save it stops nothing (the job as stored still trains on it).
    if (!Commit()) return false;
    absl::Status s = b_.StopDeployment(d->name());
    if (!s.ok()) {
      st().set_message(absl::StrCat(st().message(), "; stop: ", s.message()));
      Commit();
    }
    return false;
  }
  if (d->state() == v1::Deployment::RUNNING) {
    if (st().has_pending() && st().pending().deployment() == d->name()) {
      Resumed();
    } else if (st().state() != v1::JobStatus::RUNNING && !st().has_pending()) {
      st().set_state(v1::JobStatus::RUNNING);
    }
    if (st().state() == v1::JobStatus::RUNNING) {
      CalibrateFrom(*d);
      ConsiderSlowdown(*d);
      ConsiderJoin(*d);
    }
  }
  Commit();
  return false;
}

void Pass::Resumed() {
  v1::JobEvent ev = st().pending();
  *ev.mutable_resume_time() = ToProto(e_.now);
  ev.set_downtime_seconds(
      std::max(0.0, absl::ToDoubleSeconds(e_.now - FromProto(ev.detect_time()))));
  AddEvent(ev);
  st().clear_pending();
  st().set_state(v1::JobStatus::RUNNING);
  st().set_message("");
  ended_.push_back(std::move(ev));
}

void Pass::AddEvent(const v1::JobEvent& ev) {
  *st().add_events() = ev;
  while (st().events_size() > static_cast<int>(e_.max_events)) {
    st().mutable_events()->DeleteSubrange(0, 1);
  }
}

std::string Pass::NextPlanName() {
  st().set_plans_made(st().plans_made() + 1);
  return absl::StrCat("plans/", absl::StripPrefix(j_.name(), "jobs/"), "-p", st().plans_made());
}

v1::CreatePlanRequest Pass::PlanRequest(const std::string& plan,
                                        const std::vector<std::string>& devices) const {
  v1::CreatePlanRequest r;
  *r.mutable_model() = spec().model();
  for (const auto& d : devices) r.add_devices(d);
  r.set_global_batch(spec().global_batch());
  *r.mutable_options() = spec().options();
  // A job that asks for N pipeline stages goes on when fewer than N
  // devices are left: one stage per device (no plan has more stages than
  // devices), the count asked for again once enough are back.
  v1::PlanOptions& o = *r.mutable_options();
  if (o.pipeline() == v1::PlanOptions::PIPELINE_STAGES &&
      o.pipeline_stages() > static_cast<int>(devices.size())) {
    o.set_pipeline_stages(static_cast<int>(devices.size()));
  }
  r.set_plan_id(std::string(absl::StripPrefix(plan, "plans/")));
  return r;
}

void Pass::WaitForDevices(const std::vector<std::string>& usable) {
  st().set_message(absl::StrCat("waiting for devices: ", usable.size(), " usable, the job needs ",
                                MinDevices(spec())));
  const size_t busy = UsableDevices(e_.cluster, spec().devices(), Held()).size() - usable.size();
  if (busy > 0) absl::StrAppend(st().mutable_message(), " (", busy, " in use by other jobs)");
  // Devices the job holds out itself (their executors failed it) would
  // otherwise read as missing from a cluster whose nodes are all READY.
  const std::vector<std::string> selectable = UsableDevices(e_.cluster, spec().devices(), {});
  std::vector<std::string> held;
  absl::Time until = absl::InfinitePast();
  for (const auto& h : st().held()) {
    if (std::find(selectable.begin(), selectable.end(), h.device()) == selectable.end()) continue;
    held.push_back(h.device());
    until = std::max(until, FromProto(h.until()));
  }
  if (!held.empty()) {
    absl::StrAppend(
        st().mutable_message(), " (", held.size(),
        " held out after their executors failed a deployment, until ",
        absl::FormatTime(absl::RFC3339_sec, until, absl::UTCTimeZone()), ": ",
        absl::StrJoin(held.begin(), held.begin() + std::min<size_t>(held.size(), 8), ", "),
        held.size() > 8 ? absl::StrCat(" and ", held.size() - 8, " more") : "", ")");
  }
  Commit();
}

void Pass::PlanAndDeploy() {
  RefreshCheckpoint();
  if (st().checkpoint_step() >= spec().training().steps()) {
    st().set_steps_done(spec().training().steps());
    Finish(v1::JobStatus::SUCCEEDED, absl::StrCat("every step done (checkpoint at step ",
                                                  st().checkpoint_step(), " committed)"));
    return;
  }
  std::vector<std::string> usable = UsableDevices(e_.cluster, spec().devices(), Unavailable());
  if (st().next_plan().empty()) {
    if (static_cast<int>(usable.size()) < MinDevices(spec())) return WaitForDevices(usable);
    st().set_next_plan(NextPlanName());
    if (st().state() == v1::JobStatus::PENDING) st().set_state(v1::JobStatus::PLANNING);
    st().set_message(
        absl::StrCat("planning on ", usable.size(), " devices (", st().next_plan(), ")"));
    if (!Commit()) return;  // the intent first: a restart finds the plan by name
  }
  absl::StatusOr<v1::Plan> p = OwnPlan(st().next_plan());
  if (absl::IsNotFound(p.status())) {
    // Not made yet (the planner restarted between the intent and the
    // call) or deleted: made now, under the name saved.
    if (static_cast<int>(usable.size()) < MinDevices(spec())) {
      st().clear_next_plan();
      return WaitForDevices(usable);
    }
    p = b_.CreatePlan(PlanRequest(st().next_plan(), usable), j_.name());
    if (absl::IsAlreadyExists(p.status())) p = OwnPlan(st().next_plan());
    if (absl::IsInvalidArgument(p.status())) {
      Finish(v1::JobStatus::FAILED, absl::StrCat("cannot plan: ", p.status().message()));
      return;
    }
  }
  if (absl::IsAlreadyExists(p.status())) {  // not the job's: planned under the next name
    st().set_message(absl::StrCat(p.status().message(), "; planning under another name"));
    st().clear_next_plan();
    Commit();
    return;
  }
  if (!p.ok()) {
    st().set_message(absl::StrCat(st().next_plan(), ": ", p.status().message(), "; trying again"));
    Commit();
    return;
  }
  switch (p->state()) {
    case v1::Plan::SUCCEEDED:
      break;
    case v1::Plan::FAILED:
      if (PlannerSideFailure(p->error_code())) {
        // Not the request's failure but the planner's (its store refused
        // the plan's result: a full disk): it failed the job for good
        // while the job's own saves were tried again. Planned again,
        // under a new name.
        st().set_message(absl::StrCat(p->name(), " failed on the planner's side (", p->error(),
                                      "); planning again"));
        st().clear_next_plan();
        Commit();
        return;
      }
      [[fallthrough]];
    case v1::Plan::CANCELLED:
      Finish(
          v1::JobStatus::FAILED,
          absl::StrCat(p->name(), " ended ", v1::Plan::State_Name(p->state()), ": ", p->error()));
      return;
    default:
      st().set_message(
          absl::StrCat("planning: ", p->name(), " is ", v1::Plan::State_Name(p->state())));
      Commit();
      return;
  }
  std::vector<std::string> lost = Missing(p->devices(), e_.ready);
  if (!lost.empty()) {
    const std::string why = absl::StrCat("the node of ", absl::StrJoin(lost, ", "),
                                         " went STALE before ", p->name(), " was deployed");
    if (st().has_pending()) {
      BeginReplan(v1::JobEvent::NODE_STALE, why);
      if (OverReplanLimit()) return;
    } else {
      st().set_message(absl::StrCat(why, "; planning again"));
      st().clear_next_plan();
    }
    Commit();
    return;
  }
  Deploy(*p);
}

void Pass::Deploy(const v1::Plan& p) {
  const int64_t resume = std::max<int64_t>(0, st().checkpoint_step());
  absl::StatusOr<v1::Deployment> d = absl::NotFoundError("none");
  // A deployment of this plan not over (made before a restart) is the
  // job's: adopt it rather than make another.
  for (const v1::Deployment& x : b_.DeploymentsOf(p.name())) {
    if (!DeploymentFinal(x.state())) d = x;
  }
  if (!d.ok()) {
    v1::TrainingConfig t = spec().training();
    t.set_resume(st().checkpoint_step() >= 0
                     ? CheckpointStepDir(t.checkpoint_dir(), st().checkpoint_step())
                     : "");
    d = b_.Deploy(
        p.name(), t,
        std::map<std::string, std::string>(spec().executors().begin(), spec().executors().end()));
    if (!d.ok()) {
      st().set_message(
          absl::StrCat("cannot deploy ", p.name(), ": ", d.status().message(), "; trying again"));
      Commit();
      return;
    }
  }
  if (!st().has_pending()) {  // the first deployment
    v1::JobEvent& ev = *st().mutable_pending();
    ev.Clear();
    ev.set_reason(v1::JobEvent::STARTED);
    ev.set_detail(absl::StrCat("started on ", p.devices_size(), " devices"));
    *ev.mutable_detect_time() = j_.create_time();
  }
  // A spec that leaves the global batch to the model (0) keeps the one
  // its first plan chose, saved with the job: every later plan trains at
  // it, so the data order does not depend on the plan.
  if (spec().global_batch() == 0 && p.global_batch() > 0) {
    j_.mutable_spec()->set_global_batch(p.global_batch());
  }
  v1::JobEvent& ev = *st().mutable_pending();
  ev.set_plan(p.name());
  ev.set_deployment(d->name());
  ev.set_predicted_step_after(p.prediction().step_seconds());
  ev.set_calibrated(!p.calibration().empty());
  *ev.mutable_devices_after() = p.devices();
  ev.set_resume_step(resume);
  ev.set_steps_lost(std::max<int64_t>(0, ev.steps_done_before() - resume));
  st().set_plan(p.name());
  st().clear_next_plan();
  st().set_deployment(d->name());
  st().set_generation(st().generation() + 1);
  *st().mutable_devices() = p.devices();
  st().set_predicted_step_seconds(p.prediction().step_seconds());
  st().clear_measured_step_seconds();  // the new deployment's, once it has trained
  st().clear_expected_step_seconds();
  st().clear_expected_until_step();
  st().clear_slowdown_step();
  st().clear_slowdown_detail();
  st().clear_candidate_reason();
  st().clear_device_flops();
  const std::set<std::string> used(p.devices().begin(), p.devices().end());
  for (const auto& n : e_.cluster.nodes()) {
    for (const auto& dev : n.devices()) {
      if (used.count(dev.id()) && Fp32Flops(dev) > 0) {
        (*st().mutable_device_flops())[dev.id()] = Fp32Flops(dev);
      }
    }
  }
  st().set_steps_done(resume);
  st().set_message(absl::StrCat("deployed ", d->name(), " on ", p.devices_size(),
                                " devices, from step ", resume));
  Commit();
}

void RunPass(v1::Job job, PassEnv env) { Pass(std::move(job), std::move(env)).Run(); }

}  // namespace hap::service::job_internal
