// The jobs' reconciliation pass (JobController, jobs.h): one job observed
// against its deployment, the cluster and its checkpoints, and driven one
// step on (plan, deploy, follow, recover, re-plan, stop). The controller's
// resource API and the backend over the planner core are in jobs.cc.
#include "planner/service/core/job_reconcile.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "google/protobuf/util/message_differencer.h"
#include "planner/service/core/deployments.h"
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

constexpr double kDefaultMinGain = 0.10;
constexpr int kDefaultMaxReplans = 20;
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

double MinGain(const v1::JobSpec& s) {
  return s.replan().has_min_gain() ? s.replan().min_gain() : kDefaultMinGain;
}
int MaxReplans(const v1::JobSpec& s) {
  return s.replan().has_max_replans() ? s.replan().max_replans() : kDefaultMaxReplans;
}
// No fewer than two: a plan of one device is not made (CreatePlan refuses
// it as INVALID_ARGUMENT, which would fail the job instead of waiting).
int MinDevices(const v1::JobSpec& s) { return std::max(2, s.devices().min_devices()); }
double SlowdownThreshold(const v1::JobSpec& s) {
  return s.replan().slowdown_threshold() > 0 ? s.replan().slowdown_threshold()
                                             : kDefaultSlowdownThreshold;
}


// The devices the job may use now, in cluster order: READY nodes' devices
// that pass the selector, and (when `only` is given) are in it; at most
// max_devices.
std::vector<std::string> UsableDevices(const v1::Cluster& c, const v1::DeviceSelector& sel,
                                       const std::set<std::string>& held,
                                       const std::set<std::string>* only = nullptr) {
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

template <typename C>
std::vector<std::string> Missing(const C& want, const std::set<std::string>& have) {
  std::vector<std::string> out;
  for (const auto& x : want) {
    if (!have.count(x)) out.push_back(x);
  }
  return out;
}

// One reconciliation pass over one job: observe, decide, act, save.
class Pass {
 public:
  using Env = PassEnv;

  Pass(v1::Job job, Env env) : j_(std::move(job)), e_(std::move(env)), b_(*e_.backend) {}

  void Run() {
    PruneHolds();
    if (st().stop_requested()) return RunStop();
    if (!st().deployment().empty() && !FollowDeployment()) return;
    if (JobFinal(st().state())) return;
    PlanAndDeploy();
  }

 private:
  v1::JobStatus& st() { return *j_.mutable_status(); }

  // Devices whose executor failed a deployment lately.
  std::set<std::string> Held() const {
    std::set<std::string> out;
    for (const auto& h : j_.status().held()) out.insert(h.device());
    return out;
  }
  // The devices the job may not plan on: held (above) and those other jobs
  // hold or are planning on (PassEnv::taken).
  std::set<std::string> Unavailable() const {
    std::set<std::string> out = Held();
    out.insert(e_.taken.begin(), e_.taken.end());
    return out;
  }
  void PruneHolds() {
    auto* held = st().mutable_held();
    for (int i = held->size() - 1; i >= 0; --i) {
      if (FromProto(held->Get(i).until()) <= e_.now) held->DeleteSubrange(i, 1);
    }
  }
  // Leaves the devices of the ranks that failed `d` out for join_stable.
  void Hold(const v1::Deployment& d) {
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
  const v1::JobSpec& spec() const { return j_.spec(); }
  // Saves the job; the observers hear of a re-plan or a resumption only
  // once it is saved (a pass that could not save repeats it).
  bool Commit() {
    if (!e_.commit(j_)) return false;
    for (Reason r : replanned_) {
      if (e_.on_replan) e_.on_replan(j_, r);
    }
    replanned_.clear();
    if (resumed_.has_value() && e_.on_resumed) e_.on_resumed(j_, *resumed_);
    resumed_.reset();
    return true;
  }

  // Whether it was saved.
  bool Finish(v1::JobStatus::State state, const std::string& message) {
    st().set_state(state);
    st().set_message(message);
    st().clear_pending();
    st().clear_next_plan();
    st().clear_candidate_plan();
    st().clear_switch_pending();
    return Commit();
  }

  void RefreshCheckpoint() {
    absl::StatusOr<int64_t> step = b_.LatestCheckpoint(spec().training().checkpoint_dir());
    if (step.ok()) {
      st().set_checkpoint_step(*step);
    } else if (absl::IsNotFound(step.status())) {
      st().set_checkpoint_step(-1);
    }  // unreadable: keep what was seen
  }

  void CancelPlan(const std::string& name) {
    // A plan already gone or final is fine; one of this name that the job
    // did not make is left alone.
    if (!name.empty() && OwnPlan(name).ok()) (void)b_.CancelPlan(name);
  }

  // The job's plan `name` (plans/{id}-p{n}); AlreadyExists when a plan of
  // that name exists that this job did not make: a caller's CreatePlan took
  // the name first, or an earlier job of this name (deleted, its id used
  // again) made it, for its own model and options; the job must not adopt,
  // deploy or cancel it.
  absl::StatusOr<v1::Plan> OwnPlan(const std::string& name) {
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

  // Stop asked: cancel plans in flight, stop the deployment, then STOPPED.
  // A deployment of next_plan the job has not recorded (its save failed, or
  // the planner died between the deploy and the save) is the job's too:
  // adopted, then stopped, as a pass would adopt it (Deploy). It is made
  // only once the one recorded before it has ended (a switch's or a
  // recovery's old deployment, still recorded when the save failed).
  void RunStop() {
    if (!st().next_plan().empty()) {
      absl::StatusOr<v1::Deployment> recorded = absl::NotFoundError("none recorded");
      if (!st().deployment().empty()) recorded = b_.GetDeployment(st().deployment());
      if ((!recorded.ok() || DeploymentFinal(recorded->state())) &&
          OwnPlan(st().next_plan()).ok()) {
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

  // A re-plan begins: from a loss (the deployment failed or has a STALE
  // node) or a switch to more devices. A failure while recovering starts
  // the recovery again; its downtime counts from the first failure.
  void BeginReplan(Reason reason, const std::string& detail) {
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

  // Past max_replans: the job FAILS. `deployment_live`: the job's
  // deployment is still PENDING or RUNNING and is asked to stop (a request
  // that returns at once) once FAILED is saved (a pass that cannot save it
  // stops nothing; the next decides again); a FAILED or STOPPED one was
  // stopped by its supervisor, and asking again would block this pass, and
  // every job's after it, on the ranks that are gone (up to the stop
  // timeout).
  bool OverReplanLimit(bool deployment_live = true) {
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

  // `d` FAILED because the checkpoint it resumed from is damaged: that
  // directory is set aside (damaged-step-N) and the job re-plans, to resume
  // from the committed checkpoint before it (or step 0 when there is none),
  // which it would otherwise never reach: every later deploy would resume
  // from the damaged one again, until max_replans. Returns false when the
  // pass ends here: the job FAILED (the directory cannot be renamed), or
  // waits for a pass that can (a transient error).
  bool SetAsideDamaged(const v1::Deployment& d) {
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

  // The job's deployment: training, done, failed or being stopped. Returns
  // true when the pass should go on to plan and deploy (no deployment now).
  bool FollowDeployment() {
    absl::StatusOr<v1::Deployment> d = b_.GetDeployment(st().deployment());
    if (!d.ok()) {
      if (!absl::IsNotFound(d.status())) {
        st().set_message(
            absl::StrCat("cannot read ", st().deployment(), ": ", d.status().message()));
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

  // The (re)start in progress reached RUNNING: its event is complete.
  void Resumed() {
    v1::JobEvent ev = st().pending();
    *ev.mutable_resume_time() = ToProto(e_.now);
    ev.set_downtime_seconds(
        std::max(0.0, absl::ToDoubleSeconds(e_.now - FromProto(ev.detect_time()))));
    *st().add_events() = ev;
    while (st().events_size() > static_cast<int>(e_.max_events)) {
      st().mutable_events()->DeleteSubrange(0, 1);
    }
    st().clear_pending();
    st().set_state(v1::JobStatus::RUNNING);
    st().set_message("");
    resumed_ = ev;
  }

  // More usable devices than the job has: a plan on all of them, judged
  // against the current one; a switch at the next checkpoint when it pays.
  void ConsiderJoin(const v1::Deployment& d) {
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
      st().set_message(absl::StrCat("judging a plan on ", want.size(), " devices (",
                                    st().candidate_plan(), ")"));
      if (!Commit()) return;
      absl::StatusOr<v1::Plan> p =
          b_.CreatePlan(PlanRequest(st().candidate_plan(), want), j_.name());
      if (!p.ok() && !absl::IsAlreadyExists(p.status())) {
        st().set_message(
            absl::StrCat("a plan on ", want.size(), " devices: ", p.status().message()));
        *st().mutable_judged_devices() = {want.begin(), want.end()};
        st().clear_candidate_plan();
      }
      return;
    }
  }

  // The candidate plan (more devices joining, or the same devices after a
  // slowdown) judged once made: a switch at the next checkpoint when it
  // gains min_gain.
  void JudgeCandidate(const v1::Deployment& d) {
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
      return stay(
          absl::StrFormat("staying: %s, below min_gain %.1f%%", what, 100 * MinGain(spec())));
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

  // The gain of switching to plan `p`, predicted and, where the job has
  // measured steps, calibrated: the current deployment's measured median
  // against the plan's prediction scaled by measured/predicted of the
  // latest deployment the job ran on the same devices, else of the current
  // one (the model's error on this cluster). The cost model alone can be
  // far off (CPU ranks, links measured under load); this is the job's own
  // calibration from what it ran.
  struct Judgement {
    double gain = 0;
    std::string what;
  };
  // Steps trained by the deployment of events(i): up to the next event's
  // detection, or up to now for the current one.
  int64_t StepsMeasured(int i) const {
    const v1::JobStatus& s = j_.status();
    if (i < 0 || i >= s.events_size()) return 0;
    const int64_t end =
        i + 1 < s.events_size() ? s.events(i + 1).steps_done_before() : s.steps_done();
    return end - s.events(i).resume_step();
  }
  Judgement Judge(const v1::Plan& p) const {
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

  // The gain of switching to `p`, a plan on the same devices made after a
  // slowdown: the latest window's median step against p's prediction, which
  // is the recalibrated model's (else, with no calibration, the model's
  // alone against the current plan's prediction).
  Judgement JudgeSlowdown(const v1::Plan& p, const v1::Deployment& d) const {
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

  // A switch judged after a slowdown, still waiting for its checkpoint,
  // whose step moved past the slowdown threshold since (the noise that was
  // judged passed, or another device slowed down): `candidate` was planned
  // from profiles that no longer hold, so it is dropped and the slowdown
  // judged anew once every rank has profiled steps after the change (the
  // CI once switched to a plan calibrated before a throttle that came
  // while the switch waited, and ran 25% slower).
  bool ChangedSinceJudged(const v1::Deployment& d, const std::string& candidate) {
    const double was = st().judged_step_seconds();
    const double now = d.recent_step_seconds();
    if (was <= 0 || now <= 0 || d.recent_steps_end() <= st().judged_until_step()) return false;
    const double threshold = SlowdownThreshold(spec());
    if (now <= (1 + threshold) * was && now * (1 + threshold) >= was) return false;
    st().set_slowdown_step(std::max(st().judged_until_step() + 1,
                                    d.recent_steps_end() - kSlowdownWindow));
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

  // The candidate plan dropped, with a switch waiting for it and the step
  // it was judged on (not cancelled: a finished plan, kept as others are).
  void DropCandidate() {
    st().clear_candidate_plan();
    st().clear_switch_pending();
    st().clear_judged_step_seconds();
    st().clear_judged_until_step();
  }

  // Whether every rank of `d` has reported a profile starting at `from` or
  // later.
  static bool Profiled(const v1::Deployment& d, int64_t from) {
    if (d.rank_profiles_size() != d.ranks_size() || d.ranks_size() == 0) return false;
    for (const auto& p : d.rank_profiles()) {
      if (p.steps() <= 0 || p.first_step() < from) return false;
    }
    return true;
  }

  // The deployment's devices calibrated once from its ranks' profiles.
  void CalibrateFrom(const v1::Deployment& d) {
    if (st().calibrated_deployment() == d.name() || !Profiled(d, 0)) return;
    st().set_calibrated_deployment(d.name());
    absl::StatusOr<std::string> c = b_.Calibrate(d);
    if (c.ok()) {
      st().set_message(*c);
    } else if (!absl::IsUnimplemented(c.status())) {
      st().set_message(absl::StrCat("no calibration from ", d.name(), ": ", c.status().message()));
    }
  }

  // What the job expects of its plan: the latest window's median step.
  void ExpectNow(const v1::Deployment& d) {
    st().set_expected_step_seconds(d.recent_step_seconds());
    st().set_expected_until_step(d.recent_steps_end());
    st().clear_candidate_reason();
  }

  // The first window of a deployment a switch made, more than `threshold`
  // slower than the step the switch was chosen to beat: the devices changed
  // after its plan was made (a throttle whose first steps came just before
  // the switch's checkpoint, too few to judge the switch anew), so it is a
  // slowdown, recalibrated from this deployment's profiles; expected as it
  // runs, the job would stay on a plan made for devices that are gone.
  void SlowerThanSwitchedFrom(const v1::Deployment& d, double threshold) {
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

  // A slowdown seen (measured, or a device re-probed slower): once every
  // rank's profile covers the slow steps, the devices are recalibrated and
  // a plan on the same devices is made to be judged (JudgeCandidate).
  void ConsiderSlowdown(const v1::Deployment& d) {
    if (spec().replan().disable_slowdown()) return;
    const double threshold = SlowdownThreshold(spec());
    const int64_t resumed = st().events_size() > 0 ? st().events(st().events_size() - 1).resume_step()
                                                   : 0;
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
    std::string unprofiled;
    if (!Profiled(d, st().slowdown_step())) {
      if (d.recent_steps_end() < st().slowdown_step() + kProfileWaitSteps) return;
      unprofiled = absl::StrCat("ranks without a profile of steps from ", st().slowdown_step(), " ",
                                kProfileWaitSteps,
                                " steps on (CUDA ranks are not profiled) are not recalibrated; ");
    }
    absl::StatusOr<std::string> c = b_.Calibrate(d);
    st().set_calibrated_deployment(d.name());
    const std::vector<std::string> devices(st().devices().begin(), st().devices().end());
    st().set_candidate_plan(NextPlanName());
    st().set_candidate_reason(v1::JobEvent::SLOWDOWN);
    st().clear_slowdown_step();
    st().set_message(
        absl::StrCat(st().slowdown_detail(), "; ", unprofiled,
                     c.ok() ? *c : absl::StrCat("not recalibrated (", c.status().message(), ")"),
                     "; judging ", st().candidate_plan(), " on the same devices"));
    if (!Commit()) return;
    absl::StatusOr<v1::Plan> p =
        b_.CreatePlan(PlanRequest(st().candidate_plan(), devices), j_.name());
    if (!p.ok() && !absl::IsAlreadyExists(p.status())) {
      st().set_message(absl::StrCat("after a slowdown, a plan on the same devices: ",
                                    p.status().message()));
      ExpectNow(d);
      st().clear_candidate_plan();
    }
  }

  // A plan's failure that another plan of the same request may not meet:
  // the store unavailable for its result, an aborted save.
  static bool PlannerSideFailure(int code) {
    return code == static_cast<int>(absl::StatusCode::kUnavailable) ||
           code == static_cast<int>(absl::StatusCode::kAborted);
  }

  std::string NextPlanName() {
    st().set_plans_made(st().plans_made() + 1);
    return absl::StrCat("plans/", absl::StripPrefix(j_.name(), "jobs/"), "-p", st().plans_made());
  }

  v1::CreatePlanRequest PlanRequest(const std::string& plan,
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

  void WaitForDevices(const std::vector<std::string>& usable) {
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

  // No deployment running: plan on the usable devices, then deploy.
  void PlanAndDeploy() {
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
      st().set_message(
          absl::StrCat(st().next_plan(), ": ", p.status().message(), "; trying again"));
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

  void Deploy(const v1::Plan& p) {
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

  v1::Job j_;
  Env e_;
  JobBackend& b_;
  std::vector<Reason> replanned_;        // re-plans begun, not yet saved
  std::optional<v1::JobEvent> resumed_;  // a resumption, not yet saved
};

}  // namespace

void RunPass(v1::Job job, PassEnv env) { Pass(std::move(job), std::move(env)).Run(); }

}  // namespace hap::service::job_internal
