// The planner's deployments, with no gRPC: their records, the step metrics
// executors report, the rendezvous store their ranks meet through, and one
// supervisor thread per deployment that is not over (deployments.h: push,
// status polls, stops). The gRPC service (planner/service/grpc) translates
// requests into these calls and back.
//
// Records and step metrics are saved to the sink before they are served: a
// save the sink refuses fails the call with the sink's error and changes
// nothing. A state change a supervisor makes (the executors did change)
// is kept even when its save fails, and the failed save is noted in the
// deployment's error; the next change saves the whole record, and a Stop of
// a deployment that ended so fails with the sink's error (saving it again)
// until the sink takes it.
//
// Rendezvous keys (rendezvous_store.h) belong to a deployment that exists,
// at its generation, until it finishes (a store open to any name would grow
// without bound); counters do not wrap.
//
// Deployments given to the constructor that are RUNNING are re-attached to
// (WatchDeployment); any other that is not final (PENDING, or a state this
// version does not follow: STATE_UNSPECIFIED, a value of a later version)
// is failed, with an error naming the state stored, and its ranks stopped.
// Shutdown leaves RUNNING deployments running for a restarted planner.
//
// Thread-safe.
#ifndef HAP_PLANNER_SERVICE_CORE_DEPLOYMENT_MANAGER_H_
#define HAP_PLANNER_SERVICE_CORE_DEPLOYMENT_MANAGER_H_

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
#include "planner/service/core/deployments.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {

// Step metrics a deployment keeps in memory by default, and the latest
// steps of each rank that Deployment.recent_step_seconds is the median of
// (the slowest rank's).
inline constexpr size_t kDefaultMaxMetricsPerDeployment = 100'000;
// The sink's metrics between those kept and the latest steps are pruned
// once this many steps of them have gathered.
inline constexpr int64_t kStepMetricsPruneSteps = 256;
inline constexpr int64_t kRecentStepsPerRank = 20;
// How far behind the latest step a rank's latest steps are still kept
// saved for a restart (a rank behind the others, within reason: one
// further behind has stopped reporting, and its window would hold every
// step of the others back).
inline constexpr int64_t kMaxRankLagSteps = 256;

// The error a restarted manager fails a stored PENDING deployment with (its
// push died with the previous planner), setting its failure_cause to
// PLANNER_RESTARTED_BEFORE_TRAINING: the planner's doing, not its
// executors'; a job deploys the same plan again without counting a
// re-plan. For people: code reads the failure_cause.
inline constexpr char kPlannerRestartedBeforeTraining[] =
    "the planner restarted before every rank had started training";

// Whether `d` is FAILED by a restarted planner before it trained: its
// failure_cause says so, or, for a record saved by a planner older than
// that field (failure_cause unset), its error begins with
// kPlannerRestartedBeforeTraining and no rank is blamed.
bool FailedByPlannerRestartBeforeTraining(const hap::v1::Deployment& d);

// InvalidArgument naming training.data_spec unless it is empty or of a form
// the executors read ("npy:DIR", "tokens:FILE[:uint16|uint32]", as
// executor/data/user_data.h). Only the form: the files are on the executor
// hosts. A new DeployPlan's or job's config is checked with it, so that a
// misspelled spec is refused at once, not by every rank's LoadPlan (a job
// re-planned on it until it ran out of re-plans).
absl::Status CheckDataSpecForm(const std::string& spec);

struct DeploymentManagerOptions {
  // Call deadlines, status polls and stop retries; values out of range
  // (ValidateDeploymentWatchOptions) are replaced by their defaults.
  DeploymentWatchOptions watch;
  // The executors of a deployment. Required.
  std::function<std::unique_ptr<DeploymentExecutors>(const hap::v1::Deployment&)> executors;
  // Where records and step metrics are saved; may be null (memory only).
  PlannerStateSink* sink = nullptr;
  // Every change of a deployment's record, as served from then on. Called
  // with the manager's lock held: it must not call the manager.
  std::function<void(const hap::v1::Deployment&)> on_change;
  // Once per deployment, as it ends (SUCCEEDED, FAILED or STOPPED), after
  // on_change; the same lock held.
  std::function<void(const hap::v1::Deployment&)> on_finished;
  // Step metrics kept in memory per deployment, the first ones.
  // median_step_seconds is over rank 0's metrics kept; recent_step_seconds
  // follows the latest steps past it too. The sink is left with what a
  // restart reads back: the metrics kept and the latest steps; the steps
  // between are pruned from it (PruneStepMetrics) every
  // kStepMetricsPruneSteps steps. (It kept every metric: a run of 1,000,000
  // steps on 64 ranks stored 64 million rows, nearly all never read.)
  size_t max_metrics_per_deployment = kDefaultMaxMetricsPerDeployment;
};

class DeploymentManager {
 public:
  // `deployments` and `metrics` are the persisted state to start from.
  DeploymentManager(DeploymentManagerOptions options,
                    std::vector<hap::v1::Deployment> deployments = {},
                    std::vector<hap::v1::StepMetric> metrics = {});
  // Shutdown(), then waits for the supervisors (each returns within one
  // call deadline to an executor).
  ~DeploymentManager();
  DeploymentManager(const DeploymentManager&) = delete;
  DeploymentManager& operator=(const DeploymentManager&) = delete;

  // Wakes every wait (rendezvous gets, stops) and the supervisors, which
  // return leaving their executors as they are. Later deploys are
  // Unavailable.
  void Shutdown();
  bool shutting_down() const;

  // A new deployment (PENDING, a new generation of the plan) of `plan`, a
  // SUCCEEDED plan with its rank programs; its supervisor pushes it to the
  // executors, which reach the rendezvous store at `rendezvous_address`.
  // Rank r runs on plan.devices(r), at the executor `request.executors`
  // names for it, else the one its node's label "hap.executor/<device>"
  // names. FailedPrecondition for a plan not SUCCEEDED; InvalidArgument for
  // a device without an executor, an executor for a device the plan does
  // not use, two devices at one executor (it runs one rank), or training
  // the executors would refuse (negative steps or checkpoint_every/keep,
  // threads_per_rank outside 0-4096, an unknown data source, both resume
  // and init_weights, shuffle without data_spec), naming the field and
  // value; Unavailable while shutting down;
  // the sink's error (nothing created, no generation used) when it refuses.
  absl::StatusOr<hap::v1::Deployment> Deploy(const hap::v1::Plan& plan,
                                             const hap::v1::DeployPlanRequest& request,
                                             const hap::v1::Cluster& cluster,
                                             const std::string& rendezvous_address);
  // NotFound for an unknown name.
  absl::StatusOr<hap::v1::Deployment> Get(const std::string& name) const;
  absl::StatusOr<hap::v1::ListDeploymentsResponse> List(int page_size,
                                                        const std::string& page_token) const;
  std::vector<hap::v1::Deployment> All() const;  // by name
  // Every deployment by name without its rank_profiles (each rank's per-op
  // profile, about 1 KB a rank: 64 MB for 1,000 deployments of 64 ranks),
  // which /metrics, the status page and the plans-in-use check do not read
  // and which All() copies under the manager's lock, holding back metric
  // reports while it does (bench/deployment_reads_bench).
  std::vector<hap::v1::Deployment> Summaries() const;
  // The deployments of one plan, by name, whole.
  std::vector<hap::v1::Deployment> OfPlan(const std::string& plan) const;
  // Deployment retention: deletes finished deployments (SUCCEEDED, FAILED,
  // STOPPED), record and step metrics, from the sink and from memory, that
  // are not among the `count` most recently finished (0 = no limit by
  // count) or finished before `oldest` (InfinitePast = no limit by age),
  // except those named in `keep` (an unfinished job's). The number deleted,
  // or the sink's error naming the deployment (those before it are
  // deleted). Their plans are then free for plan retention.
  absl::StatusOr<int> EnforceRetention(int count, absl::Time oldest,
                                       const std::set<std::string>& keep);
  // Deletes finished deployment `name` with its step metrics, from the
  // sink first. NotFound for no such deployment; FailedPrecondition for one
  // not finished (stop it first) or named in `in_use` (an unfinished
  // job's); the sink's error when it refuses (the deployment kept).
  // A deployment just finished may still have its supervisor telling its
  // ranks to stop: waited for until `deadline`, at most
  // kDeleteSupervisorWait, or `cancelled()` (may be null); then, with
  // nothing deleted, DeadlineExceeded (the deadline came first) or
  // Cancelled, naming the deployment and what was waited for, or
  // Unavailable (kDeleteSupervisorWait passed, or shutting down).
  static constexpr absl::Duration kDeleteSupervisorWait = absl::Seconds(5);
  absl::Status Delete(const std::string& name, const std::set<std::string>& in_use,
                      absl::Time deadline = absl::InfiniteFuture(),
                      const std::function<bool()>& cancelled = nullptr);
  // The devices of every deployment not finished (PENDING or RUNNING), by
  // deployment name.
  std::map<std::string, std::vector<std::string>> ActiveDevices() const;
  // Whether a deployment not finished has a rank on one of `devices`.
  bool AnyActiveOn(const std::set<std::string>& devices) const;
  // PENDING/RUNNING: its supervisor stops every rank, then marks it
  // STOPPED; waits for that until `deadline` or `cancelled()` and returns
  // the deployment as it is then. FAILED/STOPPED: every rank is told to stop
  // again (idempotent): Unavailable naming the ranks that did not confirm.
  // SUCCEEDED: nothing to do. NotFound for an unknown name; Unavailable
  // while shutting down. A final state the sink refused to save is saved
  // again first: the sink's error, naming the state, while it refuses (the
  // ranks are stopped, but the store still holds the state before).
  absl::StatusOr<hap::v1::Deployment> Stop(const std::string& name, absl::Time deadline,
                                           const std::function<bool()>& cancelled);

  // Metrics one ReportStepMetrics call takes at most (executors send 256).
  static constexpr size_t kMaxStepMetricsPerReport = 4096;
  // A batch of step metrics from executors, checked all or none:
  // InvalidArgument past kMaxStepMetricsPerReport (a call is checked, saved
  // and kept under the manager's lock, which every read waits for); NotFound
  // for an unknown deployment, InvalidArgument for a rank or step outside it
  // (steps are 0 to training.steps - 1), a loss that is not finite or a
  // time that is not finite and non-negative. Then saved and taken one
  // deployment at a time, by name: the sink's error, naming the deployment,
  // when it refuses one (the deployments before it are taken, as saved). Rank
  // 0's metrics update the deployment's steps_completed, last_loss and
  // median_step_seconds (the upper median of rank 0's step times kept,
  // updated in O(log n) a metric), and every metric its recent_step_seconds
  // (the slowest rank's upper median over its last 20 steps, whatever
  // max_metrics_per_deployment).
  absl::Status ReportStepMetrics(const std::vector<hap::v1::StepMetric>& batch);
  // One deployment's metrics in arrival order (NotFound for an unknown
  // deployment); a page of them (page_size 0 = 500, at most 10,000).
  absl::StatusOr<std::vector<hap::v1::StepMetric>> StepMetrics(
      const std::string& deployment) const;
  absl::StatusOr<hap::v1::ListStepMetricsResponse> ListStepMetrics(
      const std::string& deployment, int page_size, const std::string& page_token) const;

  // The rendezvous store: keys of (deployment, generation). NotFound for a
  // deployment that does not exist, FailedPrecondition for another
  // generation of it, InvalidArgument without a deployment or key.
  absl::Status StoreSet(const std::string& deployment, int64_t generation,
                        const std::string& key, const std::string& value);
  // Waits until every key is set: DeadlineExceeded naming the missing keys
  // at `deadline`, Cancelled when `cancelled()`, Unavailable on shutdown.
  absl::StatusOr<std::vector<std::string>> StoreGet(const std::string& deployment,
                                                    int64_t generation,
                                                    const std::vector<std::string>& keys,
                                                    absl::Time deadline,
                                                    const std::function<bool()>& cancelled);
  // How many keys the store holds (every deployment's). A deployment's keys
  // are dropped when it finishes, and its rendezvous refuses calls from
  // then on (FailedPrecondition).
  int64_t rendezvous_keys() const;
  // Adds `delta` to the counter at `key` (absent = 0); the sum.
  // FailedPrecondition when the key holds no counter; OutOfRange when the
  // sum overflows (the counter is left).
  absl::StatusOr<int64_t> StoreAdd(const std::string& deployment, int64_t generation,
                                   const std::string& key, int64_t delta);

 private:
  struct State;
  // Starts a supervisor running `body` for `d` (mu held).
  void Supervise(const hap::v1::Deployment& d,
                 std::function<void(DeploymentExecutors&, const DeploymentControl&)> body);
  DeploymentControl Control(const std::string& deployment);
  void ReapSupervisors();
  void Update(const std::string& name, const std::function<void(hap::v1::Deployment&)>& edit);
  // Deletes finished deployment `name` from the sink, then from memory (mu
  // held; its generation stays in `generations`).
  absl::Status DeleteLocked(const std::string& name);
  // Serves `metrics` of deployment `name`, saved (mu held).
  void KeepStepMetricsLocked(const std::string& name,
                             const std::vector<hap::v1::StepMetric>& metrics);
  // Deletes from the sink `name`'s saved metrics that no one reads again
  // (past those kept, before the latest steps), once enough have gathered
  // (mu held). Best effort: a refusal is logged and tried again later.
  void PruneStepMetricsLocked(const std::string& name);
  // Saves `name`'s record again when the sink refused its last save
  // (Update); the sink's error, naming the state, while it still refuses
  // (mu held).
  absl::Status SaveAgainLocked(const std::string& name);

  DeploymentManagerOptions o_;
  std::unique_ptr<State> s_;
};

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_DEPLOYMENT_MANAGER_H_
