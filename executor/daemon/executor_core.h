// The executor daemon's core (docs/design.md §9): one rank of one deployment at a
// time, with no gRPC in it. The service (executor_service_impl.h) only
// translates protos and checks tokens; everything else happens here.
//
// States (hap.v1.ExecutorStatus.State):
//
//   IDLE --LoadPlan--> LOADED --Start--> TRAINING --> FINISHED
//    ^                 |   ^                 |    \-> FAILED (error, or Stop)
//    +------Stop-------+   +----LoadPlan-----+--------(from FINISHED/FAILED)
//
//   LoadPlan  validates the plan for (rank, world) (format, rank programs,
//             content hash), the model graph, the rank's program against a
//             device (ProgramRunner), the training config and its data; the
//             arena is allocated here. Allowed in every state but TRAINING
//             (FailedPrecondition, before anything is built), replacing
//             what was loaded. Of two
//             LoadPlans that race, the later to arrive wins: the earlier,
//             finishing after it was installed, is Aborted.
//   Start     LOADED -> TRAINING: a thread connects Gloo (NCCL on a GPU) through the
//             rendezvous store (key prefix "<deployment>/<generation>") and
//             runs TrainRank. Idempotent while TRAINING the same deployment.
//             From FINISHED/FAILED it is FailedPrecondition: the generation's
//             rendezvous keys are spent, so the planner loads the plan again
//             (a new generation) to train again.
//   Stop      TRAINING: cancels between steps, waits (bounded) for the step
//             in progress, -> FAILED "stopped ..." (error_code CANCELLED).
//             A rank still meeting its peers (waiting in the rendezvous
//             store) stops waiting at once. Peers still inside a
//             collective with this rank time out. A step that does not end
//             within the wait (typically a collective waiting for a peer
//             that is frozen or gone) is abandoned: the state is FAILED at
//             once, and the training thread, which can only leave the
//             collective at the communicator timeout, is retired: it keeps
//             its load's memory until then, reports nothing more and changes
//             no state, and LoadPlan does not wait for it. (Training that
//             had already ended, its thread still in on_end, shows how it
//             ended instead.) LOADED: unloads -> IDLE. Otherwise a no-op.
//
// Deployment names in Start/Stop/WaitMetrics must match the loaded one
// (NotFound naming both) unless empty.
//
// Thread-safe. The destructor stops training and joins its thread.
#ifndef HAP_EXECUTOR_DAEMON_EXECUTOR_CORE_H_
#define HAP_EXECUTOR_DAEMON_EXECUTOR_CORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/device.h"
#include "hap/v1/executor_service.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::executor {

// What LoadPlan carries, as plain data.
struct LoadOptions {
  hap::v1::Plan plan;  // with rank_programs
  std::string deployment;
  int64_t generation = 0;
  int rank = 0;
  int world_size = 0;
  std::string rendezvous_address;  // the planner serving the store
  hap::v1::TrainingConfig training;
};

struct ExecutorCoreOptions {
  std::string device_id;  // reported in the status, e.g. "node0/cpu0"
  // The backend (executor/train/backend.h): "cpu" (Gloo), "cuda" or
  // "cuda:N" (NCCL); empty = the plan's device for the loaded rank when the
  // plan's cluster says it is a GPU, else cpu. Used unless make_device is set.
  std::string device;
  // The only planner this executor takes plans from: LoadPlan naming another
  // rendezvous address is PermissionDenied. Empty = any (tests, local use).
  std::string planner_address;
  // WikiText-2 root when a plan's TrainingConfig has no data_path: the
  // corpus is <data_dir>/wikitext-2/valid.txt.
  std::string data_dir = "../shared/data";
  int threads = 1;  // per rank, unless TrainingConfig.threads_per_rank > 0
  absl::Duration comm_timeout = absl::Seconds(60);  // Gloo connect/collectives
  std::string gloo_hostname = "127.0.0.1";         // interface Gloo listens on
  // How long Stop waits for the step in progress.
  absl::Duration stop_wait = absl::Seconds(10);
  // The rendezvous store of a load (the planner's store). Required to train.
  std::function<absl::StatusOr<std::unique_ptr<RendezvousStore>>(const LoadOptions&)>
      make_store;
  // Connects the communicator; default ConnectBackend: NCCL on a CUDA
  // device, Gloo otherwise.
  std::function<absl::StatusOr<std::unique_ptr<Communicator>>(const GlooOptions&,
                                                              RendezvousStore&)>
      connect;
  // The device for `threads` threads; default the `device` option's.
  std::function<std::unique_ptr<Device>(int threads)> make_device;
  // Every step's metric, on the training thread; must not block.
  std::function<void(const hap::v1::StepMetric&)> on_step;
  // Called on the training thread once training has ended, before the state
  // leaves TRAINING (e.g. to flush metrics to the planner; keep it bounded).
  std::function<void()> on_end;
  // The daemon's log, a line per call without its newline (hap-executor
  // writes them to its standard error: `kubectl logs`): each plan loaded
  // (the device its rank runs on, and why when that is not the kind the
  // plan placed it on), each start and end of training, and every
  // training.log_every-th step (0 = 100) and the last. Called on the
  // caller's or the training thread, never under the lock of the status;
  // must not block for long. Null = no log.
  std::function<void(const std::string&)> log;
  std::function<absl::Time()> now = absl::Now;
  size_t max_kept_metrics = 100'000;  // for WaitMetrics; oldest dropped first
  // Per-op timing for the planner's calibration (ExecutorStatus.profile):
  // every kernel call of a CPU device is timed (two clock reads), and after
  // two warm-up steps each window of `profile_window` steps becomes the
  // status's profile. 0 = none. Devices that run asynchronously (CUDA) are
  // never profiled: their calls' wall times are launch times. Nor is a rank
  // the plan places on a GPU that runs on the CPU: its profile names the
  // plan's device, which the planner would calibrate with CPU times.
  int profile_window = 20;
};

class ExecutorCore {
 public:
  explicit ExecutorCore(ExecutorCoreOptions options);
  ~ExecutorCore();
  ExecutorCore(const ExecutorCore&) = delete;
  ExecutorCore& operator=(const ExecutorCore&) = delete;

  // Returns the plan's content hash. InvalidArgument naming what is wrong;
  // PermissionDenied for another planner; FailedPrecondition while training
  // or for a training.checkpoint_dir that cannot be made or written;
  // NotFound for missing data; ResourceExhausted when the arena does not fit.
  // `check_caller`, when set, is asked between the load's slow parts and
  // last just before the plan is installed: OK while the caller still waits
  // for the answer, an error (DeadlineExceeded, Cancelled) once it has gone.
  // Its error is returned, with where the load stopped, and nothing is
  // installed: the state, and any plan loaded before, stay as they were.
  absl::StatusOr<std::string> LoadPlan(LoadOptions options,
                                       const std::function<absl::Status()>& check_caller = nullptr);
  absl::StatusOr<hap::v1::ExecutorStatus> Start(const std::string& deployment);
  // Asks the run to stop at its next step boundary and waits for it until
  // `wait_until` or stop_wait after this load's first Stop, whichever is
  // sooner, then abandons a step still in progress (see the state diagram):
  // FAILED. Except for a `wait_until` already past when Stop is called (a
  // caller gone): then a step still in progress before stop_wait is
  // answered TRAINING (stopping), not given up on.
  absl::StatusOr<hap::v1::ExecutorStatus> Stop(const std::string& deployment,
                                               absl::Time wait_until = absl::InfiniteFuture());
  hap::v1::ExecutorStatus Status() const;

  // Blocks until training has left TRAINING or `deadline` passes; the status.
  hap::v1::ExecutorStatus WaitUntilDone(absl::Time deadline) const;

  // The metrics of the current load with step >= `from_step`, waiting until
  // there is at least one, the load's training has ended (`*done`), the load
  // is replaced (`*done`), or `deadline` passes (empty, not done).
  // NotFound for another deployment; FailedPrecondition when nothing is
  // loaded. With `load`, a stream's calls stay with one load: 0 binds it to
  // the current load (its id is stored); another id reads that load only,
  // and once it is replaced or unloaded the answer is empty and done, never
  // the next load's metrics (a plan of the same deployment loaded again).
  absl::StatusOr<std::vector<hap::v1::StepMetric>> WaitMetrics(const std::string& deployment,
                                                               int64_t from_step,
                                                               absl::Time deadline, bool* done,
                                                               int64_t* load = nullptr) const;

  // Refuses further loads and starts (Unavailable) and stops training as
  // Stop does: a step that does not end within stop_wait is abandoned, the
  // status FAILED "stopped by the executor shutting down ...". Then, when
  // `join`, waits for every training thread, retired ones included (an
  // abandoned one ends at the communicator timeout); the destructor does.
  void Shutdown(bool join = true);

  // Training threads abandoned by Stop that have not ended yet.
  int RetiredThreads() const;

 private:
  struct Loaded;
  struct Retired;
  void Train(std::shared_ptr<Loaded> loaded, int64_t load_id);
  // On the training thread after each step: the window's profile when
  // `step` completed one (see ExecutorCoreOptions::profile_window).
  std::optional<hap::v1::StepProfile> NextProfile(Loaded& loaded, int64_t step,
                                                  double seconds) const;
  // Joins the retired threads that have ended (all of them when `all`).
  void ReapRetired(bool all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens training.resume / init_weights, then the training data (at the
  // checkpoint's seed; its size checked against the checkpoint's), and sets
  // up training.checkpoint_dir.
  absl::Status SetUpDataAndCheckpoints(const LoadOptions& in, Loaded* loaded);
  // The pipeline half of a load (a plan with stages).
  static absl::Status SetUpPipeline(const LoadOptions& in, Loaded* loaded);
  absl::Status CheckDeployment(const std::string& deployment) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // FailedPrecondition naming the run while TRAINING (LoadPlan's refusal).
  absl::Status RefuseWhileTraining() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  hap::v1::ExecutorStatus StatusLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void JoinTrainingThread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  void Log(const std::string& line) const ABSL_LOCKS_EXCLUDED(mu_);  // to options.log

  const ExecutorCoreOptions o_;
  mutable absl::Mutex mu_;
  hap::v1::ExecutorStatus::State state_ ABSL_GUARDED_BY(mu_) = hap::v1::ExecutorStatus::IDLE;
  // Shared with the training thread, which may outlive the load (retired).
  std::shared_ptr<Loaded> loaded_ ABSL_GUARDED_BY(mu_);
  int64_t load_id_ ABSL_GUARDED_BY(mu_) = 0;  // bumps on every load and unload
  int64_t steps_completed_ ABSL_GUARDED_BY(mu_) = 0;
  double last_loss_ ABSL_GUARDED_BY(mu_) = 0;
  std::string error_ ABSL_GUARDED_BY(mu_);
  absl::StatusCode error_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;  // of error_
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // LoadPlans in the order they arrived, and the latest installed (its
  // ticket and plan): an earlier one finishing later is Aborted.
  int64_t load_tickets_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t installed_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  struct {
    std::string deployment;
    int64_t generation = 0;
  } installed_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // the training thread; started and joined under ops_mu_
  std::vector<Retired> retired_ ABSL_GUARDED_BY(ops_mu_);
  std::atomic<int> retired_count_{0};
  // Serialises the operations that change state (LoadPlan's install, Start,
  // Stop, Shutdown), so joining the training thread never races a start.
  // Taken before mu_.
  absl::Mutex ops_mu_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_EXECUTOR_CORE_H_
