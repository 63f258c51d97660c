// How the planner drives and follows the executors of one deployment, with
// no gRPC: the executors come through `DeploymentExecutors` (gRPC in
// planner/service/grpc, fakes in tests), time and the deployment's record
// through `DeploymentControl`.
//
// A deployment as the planner sees it:
//
//   PENDING --LoadPlan, StartTraining on every rank--> RUNNING
//   RUNNING --every rank FINISHED--> SUCCEEDED
//   PENDING/RUNNING --a rank refuses a call, reports FAILED, no longer holds
//       the deployment (its executor restarted or took another plan), or
//       leaves `missed_status_limit` status polls in a row unanswered--> FAILED
//   PENDING/RUNNING --StopDeployment--> STOPPED
//
// Whenever a deployment fails or is stopped, every rank it started is told
// to stop (StopTraining names the deployment, so an executor that holds
// another one is left alone). A rank counts as stopped when it answers that
// it is not training the deployment; ranks that do not answer are asked
// again, `stop_attempts` times in all. A deployment is FAILED as soon as the
// failure is seen (the error says why); ranks that could not be stopped are
// added to the error afterwards. STOPPED is set once the ranks were asked.
//
// A planner that shuts down leaves RUNNING deployments running. A restarted
// planner re-attaches to them (WatchDeployment: the first poll finds out
// whether each rank still trains the deployment at its generation) and
// fails PENDING ones (FailUnfinishedDeployment), whose rendezvous keys are
// lost with the old process, and any other it cannot follow (a stored state
// that is neither RUNNING nor final).
#ifndef HAP_PLANNER_SERVICE_CORE_DEPLOYMENTS_H_
#define HAP_PLANNER_SERVICE_CORE_DEPLOYMENTS_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hap/v1/executor_service.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::service {

// The executors of one deployment: rank r is the deployment's ranks(r).
// Called from one thread at a time.
class DeploymentExecutors {
 public:
  // One answer per rank, in rank order.
  using Statuses = std::vector<absl::StatusOr<hap::v1::ExecutorStatus>>;

  virtual ~DeploymentExecutors() = default;
  virtual absl::Status LoadPlan(int rank, const hap::v1::LoadPlanRequest& request,
                                absl::Duration timeout) = 0;
  virtual absl::Status StartTraining(int rank, const std::string& deployment,
                                     absl::Duration timeout) = 0;
  // Every rank at once; each answer within `timeout` or an error
  // (DeadlineExceeded for a rank that does not answer in time).
  virtual Statuses GetStatus(absl::Duration timeout) = 0;
  // StopTraining(deployment) to every rank at once, as GetStatus.
  virtual Statuses StopTraining(const std::string& deployment, absl::Duration timeout) = 0;
};

struct DeploymentWatchOptions {
  // Deadline of each LoadPlan and StartTraining (a plan is tens of MiB).
  absl::Duration call_timeout = absl::Seconds(30);
  // A RUNNING deployment's ranks are asked their status this often, each
  // poll with a deadline of `status_timeout`.
  absl::Duration status_interval = absl::Seconds(1);
  absl::Duration status_timeout = absl::Seconds(1);
  // A rank that leaves this many polls in a row unanswered (dead, frozen,
  // or cut off) fails the deployment: about missed_status_limit *
  // status_interval after it went silent.
  int missed_status_limit = 3;
  // Deadline of each StopTraining; the executor waits for the step in
  // progress at most half of it. Ranks that do not confirm are asked again
  // after status_interval, stop_attempts times in all.
  absl::Duration stop_timeout = absl::Seconds(3);
  int stop_attempts = 3;
};

// InvalidArgument naming the first option out of range.
absl::Status ValidateDeploymentWatchOptions(const DeploymentWatchOptions& o);

// Why DeploymentControl::wait returned.
enum class Wake {
  kTimeout,   // the deadline passed
  kStop,      // StopDeployment asked for this deployment
  kShutdown,  // the planner is shutting down: leave the executors as they are
};

// What a supervisor needs from the deployment's owner.
struct DeploymentControl {
  std::function<absl::Time()> now;
  // Blocks until `deadline`, shutdown or (when `stop_wakes`) a stop
  // request for the deployment, whichever comes first; one already pending
  // returns at once, also for a deadline in the past. Shutdown wins over
  // stop.
  std::function<Wake(absl::Time deadline, bool stop_wakes)> wait;
  // Applies `edit` to the deployment's record (and saves it).
  std::function<void(const std::function<void(hap::v1::Deployment&)>&)> update;
  // Saves the record again where the store refused its last save (a full
  // disk): the store would otherwise hold the state before until the next
  // change. Nothing when the last save went through; may be unset.
  std::function<void()> save_again;
};

// Follows one deployment's ranks, poll after poll: counts unanswered polls
// per rank and decides. Plain data; not thread-safe.
class RankWatch {
 public:
  enum class Verdict { kRunning, kSucceeded, kFailed };

  RankWatch(const hap::v1::Deployment& d, int missed_status_limit);

  // One poll's answers (one per rank). kFailed when a rank reported FAILED,
  // holds another deployment or generation (or none), is not training (it
  // was never started, or was stopped), or has now missed the limit;
  // `error()` then names every rank with a problem. kSucceeded when every
  // rank FINISHED.
  Verdict Observe(const DeploymentExecutors::Statuses& statuses);
  const std::string& error() const { return error_; }
  // After kFailed: the ranks whose executor is to blame, in rank order:
  // those that did not answer this poll, hold another deployment (or none),
  // or are not training it. A rank that answers FAILED is alive (a peer's
  // loss fails every rank) and is not among them.
  const std::vector<int>& failed_ranks() const { return failed_ranks_; }
  // After kFailed: a rank failed because the checkpoint `d` resumes from
  // is damaged (ResumeDamaged).
  bool resume_damaged() const { return resume_damaged_; }

 private:
  hap::v1::Deployment d_;
  int limit_;
  std::vector<int> missed_;
  std::string error_;
  std::vector<int> failed_ranks_;
  bool resume_damaged_ = false;
};

// Whether `s`, a rank's status, says it failed because the checkpoint `d`
// resumes from (training.resume) is damaged: FAILED with DATA_LOSS before
// training a step (the executor found a shard whose checksum does not match,
// or a truncated or malformed file, while restoring it).
bool ResumeDamaged(const hap::v1::Deployment& d, const hap::v1::ExecutorStatus& s);

// "rank 2 (node2/cpu0 at 127.0.0.1:5000)".
// Whether a deployment in state `s` has ended (SUCCEEDED, FAILED, STOPPED).
bool DeploymentFinal(hap::v1::Deployment::State s);

std::string DescribeRank(const hap::v1::Deployment& d, int rank);

// Whether a StopTraining answer says the rank is not training `d` (stopped,
// ended, unloaded, or holding another deployment: NotFound).
bool RankStopped(const hap::v1::Deployment& d,
                 const absl::StatusOr<hap::v1::ExecutorStatus>& answer);

// Sends StopTraining to every rank once; OK when every rank confirmed,
// otherwise Unavailable naming the ranks that did not, and why.
absl::Status StopRanksOnce(const hap::v1::Deployment& d, DeploymentExecutors& executors,
                           const DeploymentWatchOptions& o);

// Stops every rank, asking the ones that do not confirm again after
// status_interval, stop_attempts times in all (less on shutdown). As
// StopRanksOnce. `answers`, when given, receives every answer of every
// round.
absl::Status StopEveryRank(
    const hap::v1::Deployment& d, DeploymentExecutors& executors, const DeploymentWatchOptions& o,
    const DeploymentControl& control,
    const std::function<void(const absl::StatusOr<hap::v1::ExecutorStatus>&)>& answers = nullptr);

// A PENDING deployment from its start: LoadPlan (with `plan` and the
// rendezvous store at `rendezvous_address`) and StartTraining on every
// rank, RUNNING, then WatchDeployment. Returns when the deployment ends or
// the planner shuts down.
void RunDeployment(const hap::v1::Deployment& d, const hap::v1::Plan& plan,
                   const std::string& rendezvous_address, DeploymentExecutors& executors,
                   const DeploymentWatchOptions& o, const DeploymentControl& control);

// A RUNNING deployment (just started, or found in the database by a
// restarted planner): polls its ranks until they all finish (SUCCEEDED),
// one fails (FAILED, the others stopped), a stop is requested (every rank
// stopped, STOPPED) or the planner shuts down (no change). The first poll
// is at once.
void WatchDeployment(const hap::v1::Deployment& d, DeploymentExecutors& executors,
                     const DeploymentWatchOptions& o, const DeploymentControl& control);

// A PENDING (or otherwise unfinished, not RUNNING) deployment a restarted
// planner cannot finish: every rank is stopped and the deployment FAILED
// with `reason`.
void FailUnfinishedDeployment(const hap::v1::Deployment& d, const std::string& reason,
                              DeploymentExecutors& executors, const DeploymentWatchOptions& o,
                              const DeploymentControl& control);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_DEPLOYMENTS_H_
