// Elastic training jobs (jobs/{id}), with no gRPC: the planner keeps a job
// training on the devices that are there. A controller in the manner of a
// Kubernetes controller: each pass compares what it observes (the cluster's
// node states, the job's plans and deployment, the committed checkpoints)
// with what the job wants (training until spec.training.steps on its
// usable devices) and takes the next step towards it. Every step is
// idempotent and its intent saved before it is taken (plan ids are
// "{job}-p{n}"; a deployment of the job's plan is adopted, not made twice),
// so a planner restarted at any moment goes on from the saved job.
//
//   PENDING --enough usable devices--> PLANNING (plan, then deploy)
//   PLANNING/RECOVERING --deployment RUNNING (or seen only once it had
//       trained and ended)--> RUNNING, the (re)start's event complete
//   RUNNING --deployment FAILED (an executor lost or failed), a node of it
//       STALE, or it stopped outside the job--> RECOVERING: the survivors
//       are stopped, a plan is made on the usable devices and deployed,
//       resuming from the latest COMMITTED checkpoint. The devices of the
//       ranks that failed it (Deployment.failed_ranks) are held out for
//       join_stable even while their node stays READY (an executor can die
//       while its node's agent goes on); then they may join again.
//   RUNNING --a slowdown: the median of the deployment's last 20 steps
//       above the job's expectation of its plan (the median of its first 20
//       steps after warm-up, or of the last window judged) by more than
//       policy.slowdown_threshold (25%), or a device of it re-probed at that
//       much less FLOP/s--> once every rank's profile covers the slow steps:
//       the devices recalibrated, a plan on the same devices judged by the
//       calibrated model; when it gains min_gain, (at the next committed
//       checkpoint) RECOVERING onto it; otherwise the expectation becomes the
//       step measured now (no re-plan, and none again until 25% beyond it)
//   RUNNING --usable devices the job does not use, READY for
//       policy.join_stable, and a plan on all of them predicted at least
//       policy.min_gain faster--> (at the next committed checkpoint)
//       RECOVERING onto that plan
//   any --every step done--> SUCCEEDED
//   any --StopJob--> STOPPED once its deployment stopped (a plan in
//       flight is cancelled)
//   any --a plan that cannot be made, more than policy.max_replans
//       re-plans, or a spec that cannot run--> FAILED
//
// A spec whose global_batch is 0 (the model's own) stores the first
// plan's, so every later plan trains at it.
//
// Every deployment's devices are calibrated once from its ranks' profiles
// (JobBackend::Calibrate) as soon as each rank reported one, so the job's
// later plans (and every new plan on those devices) use the calibrated
// model.
//
// A failure while recovering (a device of the new plan lost before its
// deployment runs, the new deployment failing) starts the recovery again
// on what is left; its downtime counts from the first failure. A loss met
// while a switch (NODE_JOINED, SLOWDOWN) is under way, before the new
// plan's deployment trained, is an event of its own (EXECUTOR_LOST,
// NODE_STALE, ...) after the switch's, which ends there (its downtime up
// to the loss, no resume_time). A (re)start's deployment that a restarted
// planner failed before it ran (failure_cause
// PLANNER_RESTARTED_BEFORE_TRAINING) is no loss: its plan is deployed
// again, no re-plan counted. A node that flaps never stays READY for
// join_stable, so it causes no join re-plans.
//
// Thread-safe. Reconcile() makes one pass over every unfinished job; Start()
// runs passes on a thread every `interval` (and at once on a new job or a
// stop).
#ifndef HAP_PLANNER_SERVICE_CORE_JOBS_H_
#define HAP_PLANNER_SERVICE_CORE_JOBS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {

// SUCCEEDED, FAILED or STOPPED: the job is over.
bool JobFinal(hap::v1::JobStatus::State s);

// What the controller observes and acts through: the planner core and the
// deployment manager in the daemon (NewCoreJobBackend), fakes in tests.
// Every call returns without waiting for what it starts.
class JobBackend {
 public:
  virtual ~JobBackend() = default;
  // The cluster with its STALE nodes (their state says so).
  virtual hap::v1::Cluster Cluster() = 0;
  // Starts a plan for job `job` (PlannerCore::CreatePlan without `wait`;
  // Plan.job says whose it is).
  virtual absl::StatusOr<hap::v1::Plan> CreatePlan(const hap::v1::CreatePlanRequest& r,
                                                   const std::string& job) = 0;
  // The plan without its rank programs; NotFound when it does not exist.
  virtual absl::StatusOr<hap::v1::Plan> GetPlan(const std::string& name) = 0;
  virtual absl::Status CancelPlan(const std::string& name) = 0;
  // Deploys SUCCEEDED plan `plan`, each device at the executor `executors`
  // names for it (entries for devices the plan does not use are ignored),
  // else the one its node's label "hap.executor/<device>" names.
  virtual absl::StatusOr<hap::v1::Deployment> Deploy(
      const std::string& plan, const hap::v1::TrainingConfig& training,
      const std::map<std::string, std::string>& executors) = 0;
  virtual absl::StatusOr<hap::v1::Deployment> GetDeployment(const std::string& name) = 0;
  // Every deployment made of `plan`, in any state.
  virtual std::vector<hap::v1::Deployment> DeploymentsOf(const std::string& plan) = 0;
  // The devices of every deployment not finished, by name: the jobs' own
  // and those made directly (DeployPlan), which jobs leave alone.
  virtual std::map<std::string, std::vector<std::string>> ActiveDeploymentDevices() = 0;
  // Asks a deployment to stop (its supervisor stops every rank, then marks
  // it STOPPED); does not wait.
  virtual absl::Status StopDeployment(const std::string& name) = 0;
  // The step of the latest committed checkpoint in `dir`; NotFound when it
  // holds none (or does not exist).
  virtual absl::StatusOr<int64_t> LatestCheckpoint(const std::string& dir) = 0;
  // Sets aside the damaged checkpoint `step_dir` (DIR/step-N, a deployment's
  // Deployment.damaged_checkpoint) so that no resume finds it again
  // (SetAsideDamagedCheckpoint); its new path. NotFound when it is gone.
  virtual absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& step_dir) = 0;
  // Fits the calibration of `d`'s devices from its ranks' profiles
  // (Deployment.rank_profiles) and stores it with their nodes, for the
  // plans made from then on (PlannerCore::CalibrateDevices); a line for
  // people. Unimplemented where the backend cannot.
  virtual absl::StatusOr<std::string> Calibrate(const hap::v1::Deployment& /*d*/) {
    return absl::UnimplementedError("this planner does not calibrate from deployments");
  }
};

// The step of the newest "step-N" directory of `dir` that holds the file
// COMMITTED (executor/checkpoint/checkpoint.h: without it a checkpoint
// does not count). NotFound when there is none or `dir` does not exist;
// another error when `dir` cannot be read.
absl::StatusOr<int64_t> LatestCommittedCheckpoint(const std::string& dir);
// "DIR/step-00000012", the directory name the executors write.
std::string CheckpointStepDir(const std::string& dir, int64_t step);
// Renames the checkpoint directory `step_dir` (".../step-N") to
// ".../damaged-step-N" (then "-1", "-2", ... while taken) and makes the
// rename durable: kept for a person to look at, never resumed from
// (LatestCommittedCheckpoint and the executors' search read step-N names
// only). The new path; NotFound when `step_dir` does not exist,
// InvalidArgument when its name is not step-N, the error otherwise.
absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& step_dir);

// The backend of the daemon: plans in `core`, deployments in `deployments`
// (rendezvous at rendezvous_address()), checkpoints on this machine's view
// of the shared file system. Both must outlive it.
std::unique_ptr<JobBackend> NewCoreJobBackend(PlannerCore* core, DeploymentManager* deployments,
                                              std::function<std::string()> rendezvous_address);

struct JobControllerOptions {
  JobBackend* backend = nullptr;  // required; outlives the controller
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Jobs are saved here before a change is served (may be null).
  PlannerStateSink* sink = nullptr;
  absl::Duration interval = absl::Seconds(1);  // between passes (Start)
  // Observers (metrics): any change of a job, called with the controller's
  // lock held (it must not call the controller); a re-plan begun (a device
  // lost, a switch to more devices) and an event ended (training again, or
  // a switch cut short by a loss: its downtime up to the loss), each once
  // it is saved, from the pass's thread.
  std::function<void(const hap::v1::Job&)> on_change;
  std::function<void(const hap::v1::Job&, hap::v1::JobEvent::Reason)> on_replan;
  std::function<void(const hap::v1::Job&, const hap::v1::JobEvent&)> on_resumed;
  size_t max_events = 100;  // per job, oldest dropped
};

// Jobs not yet finished at most: CreateJob beyond is ResourceExhausted.
inline constexpr int kMaxUnfinishedJobs = 1000;

// InvalidArgument naming the field for a spec a job cannot run with.
absl::Status ValidateJobSpec(const hap::v1::JobSpec& spec);

class JobController {
 public:
  // `jobs` is the persisted state to start from; unfinished ones go on,
  // except one it cannot drive (a name not jobs/{id} of at most 50
  // characters, a plan name not plans/{id}, an unknown state, a spec
  // ValidateJobSpec refuses): that one is FAILED, its message naming what
  // is wrong, and saved so (best effort).
  JobController(JobControllerOptions options, std::vector<hap::v1::Job> jobs = {});
  ~JobController();  // Shutdown()
  JobController(const JobController&) = delete;
  JobController& operator=(const JobController&) = delete;

  // Runs Reconcile() on a thread every `interval` until Shutdown().
  void Start();
  // Stops the thread and wakes watches; jobs, their plans and deployments
  // stay as they are for a restarted planner. Later creates are Unavailable.
  void Shutdown();

  // A PENDING job. InvalidArgument for a bad spec or id (1-50 lower-case
  // letters, digits, '-'); AlreadyExists for a taken id; the sink's error
  // (no job) when it refuses; Unavailable while shutting down.
  absl::StatusOr<hap::v1::Job> Create(const hap::v1::CreateJobRequest& r);
  // NotFound for an unknown job; InvalidArgument for a name not "jobs/{id}".
  absl::StatusOr<hap::v1::Job> Get(const std::string& name) const;
  absl::StatusOr<hap::v1::ListJobsResponse> List(int page_size,
                                                 const std::string& page_token) const;
  std::vector<hap::v1::Job> All() const;  // by name
  // The deployment of each job not finished (deployment retention keeps
  // them).
  std::set<std::string> UnfinishedJobsDeployments() const;
  // Deletes finished jobs (SUCCEEDED, FAILED, STOPPED) beyond the `count`
  // most recently finished (0: no limit by count) or that finished before
  // `oldest` (InfinitePast: no limit by age), from the sink first; never an
  // unfinished one. The number deleted; the sink's error naming the job it
  // refused (those deleted before it stay deleted).
  absl::StatusOr<int> EnforceRetention(int count, absl::Time oldest);
  // Deletes finished job `name`, from the sink first. NotFound for no such
  // job, FailedPrecondition for one not finished (stop it first), the
  // sink's error when it refuses (the job kept).
  absl::Status Delete(const std::string& name);
  // Marks the job to stop (saved first: the sink's error when it refuses)
  // and returns it; the next pass cancels its plan and stops its
  // deployment, then STOPPED. A final job is returned as it is.
  absl::StatusOr<hap::v1::Job> Stop(const std::string& name);
  // Calls `on_update` with the job now and on every change until it is
  // final, `on_update` returns false, `stop()` turns true (polled every
  // 100 ms) or shutdown; NotFound for an unknown job.
  absl::Status Watch(const std::string& name,
                     const std::function<bool(const hap::v1::Job&)>& on_update,
                     const std::function<bool()>& stop);

  // One pass over every unfinished job.
  void Reconcile();

 private:
  struct State;
  void ReconcileJob(const std::string& name);
  // Saves `next` and serves it; false (the job left as it was, the error
  // noted in its message) when the sink refuses.
  bool Commit(const hap::v1::Job& next);
  // Deletes finished job `it` from the sink, then from memory (mu held).
  absl::Status DeleteLocked(std::map<std::string, hap::v1::Job>::iterator it);

  JobControllerOptions o_;
  std::unique_ptr<State> s_;
};

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_JOBS_H_
