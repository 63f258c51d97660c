// The reconciliation pass over one job (job_reconcile.h's RunPass), shared
// by the two files that define it: job_reconcile.cc (observe, recover,
// plan, deploy, stop) and job_switch.cc (whether to switch to another plan:
// devices joining, a candidate plan judged, a slowdown). Internal to
// //planner/service/core:jobs.
#ifndef HAP_PLANNER_SERVICE_CORE_JOB_PASS_H_
#define HAP_PLANNER_SERVICE_CORE_JOB_PASS_H_

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/core/job_reconcile.h"
#include "planner/service/core/jobs.h"

namespace hap::service::job_internal {

inline constexpr int kDefaultMaxReplans = 20;

// The job's replan.max_replans, kDefaultMaxReplans when unset.
inline int MaxReplans(const v1::JobSpec& s) {
  return s.replan().has_max_replans() ? s.replan().max_replans() : kDefaultMaxReplans;
}

// The devices the job may use now, in cluster order: READY nodes' devices
// that pass the selector, and (when `only` is given) are in it; at most
// max_devices.
std::vector<std::string> UsableDevices(const v1::Cluster& c, const v1::DeviceSelector& sel,
                                       const std::set<std::string>& held,
                                       const std::set<std::string>* only = nullptr);

// The elements of `want` not in `have`, in want's order.
template <typename C>
std::vector<std::string> Missing(const C& want, const std::set<std::string>& have) {
  std::vector<std::string> out;
  for (const auto& x : want) {
    if (!have.count(x)) out.push_back(x);
  }
  return out;
}

// One reconciliation pass over one job: observe, decide, act, save.
// RunPass makes one for a pass and runs it once, on its caller's thread.
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
  const v1::JobSpec& spec() const { return j_.spec(); }

  // Observe, recover, plan, deploy, stop (job_reconcile.cc).

  // Devices whose executor failed a deployment lately.
  std::set<std::string> Held() const;

  // The devices the job may not plan on: held (above) and those other jobs
  // hold or are planning on (PassEnv::taken).
  std::set<std::string> Unavailable() const;

  void PruneHolds();

  // Leaves the devices of the ranks that failed `d` out for join_stable.
  void Hold(const v1::Deployment& d);

  // Saves the job; the observers hear of a re-plan or a resumption only
  // once it is saved (a pass that could not save repeats it).
  bool Commit();

  // Whether it was saved.
  bool Finish(v1::JobStatus::State state, const std::string& message);

  void RefreshCheckpoint();

  void CancelPlan(const std::string& name);

  // The job's plan `name` (plans/{id}-p{n}); AlreadyExists when a plan of
  // that name exists that this job did not make: a caller's CreatePlan took
  // the name first, or an earlier job of this name (deleted, its id used
  // again) made it, for its own model and options; the job must not adopt,
  // deploy or cancel it.
  absl::StatusOr<v1::Plan> OwnPlan(const std::string& name);

  // Stop asked: cancel plans in flight, stop the deployment, then STOPPED.
  // A deployment of next_plan the job has not recorded (its save failed, or
  // the planner died between the deploy and the save) is the job's too:
  // adopted, then stopped, as a pass would adopt it (Deploy). It is made
  // only once the one recorded before it has ended (a switch's or a
  // recovery's old deployment, still recorded when the save failed).
  void RunStop();

  // A re-plan begins: from a loss (the deployment failed or has a STALE
  // node) or a switch to more devices. A failure while recovering starts
  // the recovery again; its downtime counts from the first failure. A
  // loss met while a switch (NODE_JOINED, SLOWDOWN) is under way ends the
  // switch's event (its downtime up to the loss, no resume_time) and
  // begins its own.
  void BeginReplan(Reason reason, const std::string& detail);

  // Past max_replans: the job FAILS. `deployment_live`: the job's
  // deployment is still PENDING or RUNNING and is asked to stop (a request
  // that returns at once) once FAILED is saved (a pass that cannot save it
  // stops nothing; the next decides again); a FAILED or STOPPED one was
  // stopped by its supervisor, and asking again would block this pass, and
  // every job's after it, on the ranks that are gone (up to the stop
  // timeout).
  bool OverReplanLimit(bool deployment_live = true);

  // `d`, the (re)start in progress, FAILED by a restarted planner before it
  // ran (failure_cause PLANNER_RESTARTED_BEFORE_TRAINING, or an older
  // planner's record with that error: FailedByPlannerRestartBeforeTraining),
  // with no rank to blame.
  bool FailedByPlannerRestart(const v1::Deployment& d) const;

  // `d` FAILED because the checkpoint it resumed from is damaged: that
  // directory is set aside (damaged-step-N) and the job re-plans, to resume
  // from the committed checkpoint before it (or step 0 when there is none),
  // which it would otherwise never reach: every later deploy would resume
  // from the damaged one again, until max_replans. Returns false when the
  // pass ends here: the job FAILED (the directory cannot be renamed), or
  // waits for a pass that can (a transient error).
  bool SetAsideDamaged(const v1::Deployment& d);

  // The job's deployment: training, done, failed or being stopped. Returns
  // true when the pass should go on to plan and deploy (no deployment now).
  bool FollowDeployment();

  // The (re)start in progress reached RUNNING: its event is complete.
  void Resumed();

  // Appends `ev` to the job's events, the oldest dropped past max_events.
  void AddEvent(const v1::JobEvent& ev);

  std::string NextPlanName();

  v1::CreatePlanRequest PlanRequest(const std::string& plan,
                                    const std::vector<std::string>& devices) const;

  void WaitForDevices(const std::vector<std::string>& usable);

  // No deployment running: plan on the usable devices, then deploy.
  void PlanAndDeploy();

  void Deploy(const v1::Plan& p);

  // Whether to switch to another plan: devices joining, a candidate
  // plan judged, a slowdown (job_switch.cc).

  // More usable devices than the job has: a plan on all of them, judged
  // against the current one; a switch at the next checkpoint when it pays.
  void ConsiderJoin(const v1::Deployment& d);

  // The candidate plan (more devices joining, or the same devices after a
  // slowdown) judged once made: a switch at the next checkpoint when it
  // gains min_gain.
  void JudgeCandidate(const v1::Deployment& d);

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
  int64_t StepsMeasured(int i) const;

  Judgement Judge(const v1::Plan& p) const;

  // The gain of switching to `p`, a plan on the same devices made after a
  // slowdown: the latest window's median step against p's prediction, which
  // is the recalibrated model's (else, with no calibration, the model's
  // alone against the current plan's prediction).
  Judgement JudgeSlowdown(const v1::Plan& p, const v1::Deployment& d) const;

  // A switch judged after a slowdown, still waiting for its checkpoint,
  // whose step moved past the slowdown threshold since (the noise that was
  // judged passed, or another device slowed down): `candidate` was planned
  // from profiles that no longer hold, so it is dropped and the slowdown
  // judged anew once every rank has profiled steps after the change (the
  // CI once switched to a plan calibrated before a throttle that came
  // while the switch waited, and ran 25% slower).
  bool ChangedSinceJudged(const v1::Deployment& d, const std::string& candidate);

  // The candidate plan dropped, with a switch waiting for it and the step
  // it was judged on (not cancelled: a finished plan, kept as others are).
  void DropCandidate();

  // The deployment's devices calibrated once from its ranks' profiles.
  void CalibrateFrom(const v1::Deployment& d);

  // What the job expects of its plan: the latest window's median step.
  void ExpectNow(const v1::Deployment& d);

  // The first window of a deployment a switch made, more than `threshold`
  // slower than the step the switch was chosen to beat: the devices changed
  // after its plan was made (a throttle whose first steps came just before
  // the switch's checkpoint, too few to judge the switch anew), so it is a
  // slowdown, recalibrated from this deployment's profiles; expected as it
  // runs, the job would stay on a plan made for devices that are gone.
  void SlowerThanSwitchedFrom(const v1::Deployment& d, double threshold);

  // A slowdown seen (measured, or a device re-probed slower): once every
  // rank's profile covers the slow steps, the devices are recalibrated and
  // a plan on the same devices is made to be judged (JudgeCandidate).
  void ConsiderSlowdown(const v1::Deployment& d);

  v1::Job j_;
  Env e_;
  JobBackend& b_;
  std::vector<Reason> replanned_;        // re-plans begun, not yet saved
  // Events ended (training again, or a switch cut short by a loss), not
  // yet saved: the observers hear of them once they are.
  std::vector<v1::JobEvent> ended_;
};

}  // namespace hap::service::job_internal

#endif  // HAP_PLANNER_SERVICE_CORE_JOB_PASS_H_
