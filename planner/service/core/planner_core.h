// The planner service's core (docs/design.md §9), with no gRPC: the cluster
// registry (nodes, their measured devices, liveness by heartbeat) and plans
// as long-running resources (create, get, list, cancel, delete, watch) run
// by a pool of worker threads over the planner core (synth::PlanModel,
// lower::BuildPlan). planner/service/grpc translates RPCs to these calls.
//
// Errors are the statuses the RPCs return: InvalidArgument for a malformed
// request (naming the field, op or tensor), NotFound for an unknown node,
// device or plan, FailedPrecondition when no live node has reported,
// ResourceExhausted when the model fits nowhere (on the plan, as its
// error_code), AlreadyExists for a duplicate plan id.
//
// Thread-safe.
#ifndef HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_H_
#define HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_H_

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"
#include "planner/graph/graph.h"

namespace hap::service {

// SUCCEEDED, FAILED or CANCELLED: the plan is over.
bool PlanFinal(hap::v1::Plan::State s);

// Plans not yet final (pending or running) at most: each holds its graph
// and cluster until searched; CreatePlan beyond is ResourceExhausted.
inline constexpr int kMaxUnfinishedPlans = 1000;

// What the core persists (planner/service/store implements it over SQLite).
// Calls happen under the core's lock, in order.
//
// The core writes before it changes its own state, so that what it serves
// is what a restart would find: a write that fails leaves the core as it
// was and the call that needed it fails with the sink's status (naming the
// store, with context added by the core). The one exception is a plan's
// final state (below, PlannerCore::CreatePlan).
class PlannerStateSink {
 public:
  virtual ~PlannerStateSink() = default;
  virtual absl::Status SaveNode(const hap::v1::Node& node) = 0;
  // Removes node `name` (its name, not "nodes/..."). NotFound is taken as
  // done. Sinks that cannot delete nodes answer Unimplemented, and
  // PlannerCore::DeleteNode fails with it.
  virtual absl::Status DeleteNode(const std::string& name) {
    return absl::UnimplementedError(
        absl::StrCat("this planner's state store cannot delete nodes (node '", name, "')"));
  }
  virtual absl::Status SavePlan(const hap::v1::Plan& plan) = 0;
  // NotFound is taken as done.
  virtual absl::Status DeletePlan(const std::string& name) = 0;
  virtual absl::Status SaveDeployment(const hap::v1::Deployment&) { return absl::OkStatus(); }
  // The deployment's record and step metrics (deployment retention).
  virtual absl::Status DeleteDeployment(const std::string&) { return absl::OkStatus(); }
  // The highest generation of `plan`'s deployments ever saved, deleted ones
  // included (0: none); a restarted planner's next deployment of the plan
  // goes on from it.
  virtual absl::StatusOr<int64_t> LastDeploymentGeneration(const std::string&) { return 0; }
  virtual absl::Status AppendStepMetrics(const std::vector<hap::v1::StepMetric>&) {
    return absl::OkStatus();
  }
  // Deletes the deployment's saved step metrics of steps in [from_step,
  // to_step): those the planner will never read again (past the metrics
  // it keeps, before the latest steps a restart reads).
  virtual absl::Status PruneStepMetrics(const std::string& /*deployment*/, int64_t /*from_step*/,
                                        int64_t /*to_step*/) {
    return absl::OkStatus();
  }
  virtual absl::Status SaveJob(const hap::v1::Job&) { return absl::OkStatus(); }
  // A finished job's record (job retention). NotFound is taken as done.
  virtual absl::Status DeleteJob(const std::string&) { return absl::OkStatus(); }
};

hap::v1::LinkDefaults DefaultLinks();

struct PlannerCoreOptions {
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Agents heartbeat this often; a node that misses `missed_heartbeats` in
  // a row goes STALE and is left out of new plans.
  absl::Duration heartbeat_interval = absl::Seconds(5);
  int missed_heartbeats = 3;
  // A node STALE for longer than this (no heartbeat for
  // heartbeat_interval * missed_heartbeats + node_expiry) is removed, as by
  // DeleteNode; its agent is told to register again if it comes back.
  // InfiniteDuration() (the default) keeps stale nodes until deleted.
  absl::Duration node_expiry = absl::InfiniteDuration();
  int workers = 1;  // plans synthesized at once
  // Search budget when a request sets none; always also bounded by the
  // request's deadline.
  double default_max_seconds = 60;
  int64_t default_max_states = 2'000'000;
  PlannerStateSink* sink = nullptr;  // optional
  // Link bandwidth and latency where no measured link is reported: inside
  // a node (shared memory / PCIe class) and between nodes (10 GbE class).
  hap::v1::LinkDefaults link_defaults = DefaultLinks();
  // Observers (metrics): a plan reached a final state. Called under the
  // core's lock: it must not call back into the core.
  std::function<void(const hap::v1::Plan&)> on_plan_done;

  // Plan retention (PlannerCore::EnforceRetention). Finished plans
  // (SUCCEEDED, FAILED, CANCELLED) are deleted, from the sink first, when
  // they are not among the `plan_retention_count` most recently finished
  // (0 = no limit by count) or finished longer than `plan_retention_age`
  // ago (InfiniteDuration() = no limit by age). Plans not yet final and the
  // plans `plans_in_use` names are never deleted (they still take places in
  // the count).
  int plan_retention_count = 1000;
  absl::Duration plan_retention_age = absl::Hours(24 * 7);
  // The plans that must be kept whatever their age: those deployments use.
  // Called without the core's lock (it may take other components' locks,
  // not the core's). An error skips that retention pass, deleting nothing;
  // unset = no plan is in use.
  std::function<absl::StatusOr<std::set<std::string>>()> plans_in_use;
  // Reads a stored plan whole. Create's finished plans may come as
  // summaries (no rank programs, graph or program: a planner with 10,000
  // plans starts without parsing them); the first read that needs the rest
  // loads it with this. Unset: every plan given to Create must be whole.
  std::function<absl::StatusOr<hap::v1::Plan>(const std::string& name)> load_plan;
};

struct PlanEntry;  // a plan as the core holds it (planner_core.cc)

class PlannerCore {
 public:
  // `nodes` and `plans` are the persisted state to start from (plans that
  // were PENDING or RUNNING when the planner stopped are run again, and must
  // be whole; one that cannot be is saved FAILED, and Create fails with the
  // sink's error when that save does). Finished plans may be summaries
  // (PlannerCoreOptions::load_plan).
  // Stored nodes are checked as RegisterNode checks them (a database
  // written by an older planner may hold a NaN FLOP/s or a device id
  // claimed by two nodes); one that fails is not loaded (its agent's next
  // registration replaces it) and StartNotes() says why.
  static absl::StatusOr<std::unique_ptr<PlannerCore>> Create(
      PlannerCoreOptions options, std::vector<hap::v1::Node> nodes = {},
      std::vector<hap::v1::Plan> plans = {});
  // What Create left out of the stored state, one line each (for the log).
  const std::vector<std::string>& StartNotes() const { return start_notes_; }
  // Stops running searches and joins the workers. Their plans stay as
  // stored (PENDING or RUNNING), to run again at the next start.
  ~PlannerCore();

  // Nodes. RegisterNode and a Heartbeat that reports devices run the same
  // checks: InvalidArgument (naming the device and field) for a missing or
  // duplicate device id or a measurement that is not a finite number in
  // range (FLOP/s, memory, overheads); AlreadyExists (naming the device and
  // its owner) for a device id another node registered.
  absl::StatusOr<hap::v1::RegisterNodeResponse> RegisterNode(const hap::v1::Node& node);
  // An unknown (or expired) node gets unknown_node: register again.
  absl::StatusOr<hap::v1::HeartbeatResponse> Heartbeat(const hap::v1::HeartbeatRequest& r);
  // The device ids of node `name` ("nodes/{node}" or "{node}"); none for an
  // unknown node.
  std::set<std::string> NodeDeviceIds(const std::string& name);
  // Removes node `name` ("nodes/{node}" or "{node}") and the links of its
  // devices; plans made for it keep their copy of the cluster. NotFound for
  // an unknown node; the sink's error when the removal cannot be saved (the
  // node then stays).
  absl::Status DeleteNode(const std::string& name);
  hap::v1::Cluster GetCluster(bool include_stale);
  absl::StatusOr<hap::v1::ListNodesResponse> ListNodes(int page_size,
                                                       const std::string& page_token);
  // The devices' own calibration (Device.calibration, README "Elastic
  // jobs"): fitted from deployment `deployment`'s rank profiles of SUCCEEDED
  // plan `plan` (planner/calibrate against the devices as measured) and
  // stored with their nodes (saved first), replacing earlier ones. New plans
  // apply it (PlanOptions.ignore_calibration: not); a re-registration or a
  // re-probe whose FLOP/s differs by more than 10% drops it. Returns a line
  // for people. NotFound for an unknown plan or a device no longer
  // registered; InvalidArgument for profiles that do not fit the plan; the
  // sink's error when it refuses a node's save (that node and those after
  // it keep their calibration; those saved before it have the new one, here
  // as in the store).
  absl::StatusOr<std::string> CalibrateDevices(const std::string& plan,
                                               const std::string& deployment,
                                               const std::vector<hap::v1::StepProfile>& profiles);
  // Links measured by agents (replacing earlier measurements of the same
  // pair); used by the next plans. NotFound for an unknown node or device;
  // FailedPrecondition when `address` (the reporting agent's; empty: not
  // said) is not the node's: another agent holds the node, and these were
  // measured on another machine.
  absl::Status ReportLinks(const std::string& node, const std::vector<hap::v1::Link>& links,
                           const std::string& address = "");
  // The peers a node's agent should measure: every other live node.
  absl::StatusOr<hap::v1::GetProbeAssignmentsResponse> GetProbeAssignments(
      const std::string& node, int64_t bytes);

  // Plans. CreatePlan validates synchronously (InvalidArgument naming the
  // option and its value for options out of range: a learning rate that is
  // NaN, a negative clip norm, an unknown optimizer) and returns the PENDING
  // plan (or the finished one with `wait`, bounded by `deadline`). The
  // PENDING plan is saved before it is accepted: when the sink refuses it,
  // CreatePlan fails with the sink's error and there is no such plan.
  //
  // A plan whose state cannot be saved when it starts running or ends
  // becomes FAILED with the sink's code and an error saying it was not
  // saved (and never SUCCEEDED); its FAILED state is saved if the sink takes
  // it, or else the store still holds it unfinished and a restart runs it
  // again. CreatePlan with `wait` then fails with the sink's error.
  //
  // Identical requests share one search. Identical means the same graph,
  // the same devices in the same order with the same profiles (measurements,
  // node, links between them, link defaults) and the same options;
  // heartbeat times, node states, addresses and devices not chosen do not
  // count. A request identical to a plan that SUCCEEDED is answered at once
  // with a copy of it under the new name (saved SUCCEEDED). A request
  // identical to a plan still PENDING or RUNNING whose search budget is no
  // smaller is merged into it: its plan is saved PENDING but starts no
  // search, and ends with the other's result (a copy when it succeeds; the
  // same error when it fails for a reason of the request itself —
  // ResourceExhausted, InvalidArgument, FailedPrecondition, Unimplemented,
  // OutOfRange). When the other plan is cancelled or deleted, or fails for
  // any other reason, the first merged plan runs its own search and the
  // rest follow that one.
  // With `wait`, the wait ends at `deadline` or once `cancelled()` (checked
  // at least every 200 ms) with the plan as it is then (the plan itself
  // goes on; CancelPlan stops it).
  // `job` names the elastic job it is made for (Plan.job); empty for a
  // caller's request.
  absl::StatusOr<hap::v1::Plan> CreatePlan(
      const hap::v1::CreatePlanRequest& r, absl::Time deadline,
      const std::function<bool()>& cancelled = [] { return false; }, const std::string& job = "");
  // Reads serve immutable snapshots: the core's lock is held only to find
  // them, and the copying into the result happens after it. GetPlan's BASIC
  // view (full = false) leaves out the rank programs.
  absl::StatusOr<hap::v1::Plan> GetPlan(const std::string& name, bool full);
  // The same, copied straight into `out` (e.g. a response on an arena: one
  // copy of the snapshot, no intermediate message).
  absl::Status GetPlan(const std::string& name, bool full, hap::v1::Plan* out);
  // GetPlan's answer in protobuf's wire form (a serialized hap.v1.Plan),
  // for a server that sends bytes: the BASIC view is serialized once per
  // snapshot and shared by every read of it (nothing is copied per call);
  // FULL is serialized per call. ResourceExhausted for a plan over
  // protobuf's 2 GiB message limit.
  absl::StatusOr<std::shared_ptr<const std::string>> GetPlanEncoded(const std::string& name,
                                                                    bool full);
  // The plan as it is now, shared and never changed (the core replaces a
  // snapshot when the plan changes): for callers that only read a plan and
  // need not copy it. NotFound / InvalidArgument as GetPlan.
  absl::StatusOr<std::shared_ptr<const hap::v1::Plan>> GetPlanSnapshot(const std::string& name);
  // A page of plans, by name. The BASIC view (full = false, ListPlans'
  // default) leaves out the rank programs, the graph and the program, which
  // are most of a plan's size; FULL has everything.
  absl::StatusOr<hap::v1::ListPlansResponse> ListPlans(int page_size, const std::string& page_token,
                                                       bool full = false);
  // The same, into `out` (left as it was on an error).
  absl::Status ListPlans(int page_size, const std::string& page_token, bool full,
                         hap::v1::ListPlansResponse* out);
  // ListPlans' page in wire form: each plan serialized (the BASIC view's
  // summaries once per snapshot, as GetPlanEncoded), in order, and the
  // next page token.
  absl::Status ListPlansEncoded(int page_size, const std::string& page_token, bool full,
                                std::vector<std::shared_ptr<const std::string>>* plans,
                                std::string* next_page_token);
  // A plan not yet final becomes CANCELLED at once, saved as such (a
  // restart does not run it again), and its search stops at its next poll;
  // a final plan is returned as it is. When the CANCELLED state cannot be
  // saved, CancelPlan fails with the sink's error and the plan goes on.
  absl::StatusOr<hap::v1::Plan> CancelPlan(const std::string& name);
  // Removed from the sink first; when that fails the plan stays.
  // FailedPrecondition for a plan a deployment names, being made (pinned:
  // PinPlan) or made (plans_in_use), which keeps it as from retention; the
  // error of plans_in_use when it fails.
  absl::Status DeletePlan(const std::string& name);
  // Calls `on_update` with the plan now and on every change (progress,
  // state) until it is final, `on_update` returns false, or `stop()` turns
  // true (polled at least every 100 ms) — then returns OK; NotFound for an
  // unknown plan.
  absl::Status WatchPlan(const std::string& name,
                         const std::function<bool(const hap::v1::Plan&)>& on_update,
                         const std::function<bool()>& stop);

  // Marks nodes whose heartbeats stopped STALE (also done on every call
  // that reads the cluster).
  void RefreshLiveness();

  // Deletes the finished plans beyond the retention limits (see
  // PlannerCoreOptions::plan_retention_count and plan_retention_age) and
  // returns how many it deleted. CreatePlan runs it whenever the count is
  // exceeded; the daemon also runs it periodically (for the age). A plan
  // the sink refuses to delete stays, and the pass stops there with the
  // sink's error; an error from plans_in_use deletes nothing.
  absl::StatusOr<int> EnforceRetention();
  // A plan about to be deployed, held against retention from now on: a
  // deploy that raced a retention pass either holds the plan before the
  // pass deletes it or gets NotFound, never a deployment whose plan was
  // deleted under it (plans_in_use only sees deployments that exist).
  // The plan is kept while pinned; UnpinPlan once the deploy ended (a
  // deployment that exists keeps its plan through plans_in_use; a pin kept
  // after it kept the plan from retention for as long as the core ran).
  absl::StatusOr<hap::v1::Plan> PinPlan(const std::string& name);
  void UnpinPlan(const std::string& name);

  // What CreatePlan checks of `options` (InvalidArgument naming the field
  // and value): for specs that plan later (an elastic job's).
  static absl::Status CheckPlanOptions(const hap::v1::PlanOptions& options);
  // CheckPlanOptions, and no optimizer field given that the optimizer does
  // not read: a new request's (CreatePlan, CreateJob), not a stored job's.
  // momentum is SGD's (Adam keeps its own moments: ADAM with momentum 0.5
  // ran plain Adam); beta1, beta2 and epsilon are Adam's; pipeline_stages
  // is PIPELINE_STAGES', pipeline_microbatches a pipeline's (PIPELINE_OFF
  // dropped both).
  static absl::Status CheckNewPlanOptions(const hap::v1::PlanOptions& options);
  // InvalidArgument when a new request (CreatePlan, CreateJob) gives a zoo
  // model a `batch` param and a different global_batch: BuildModel plans at
  // global_batch, which overrode the param without a word. (Not checked
  // where BuildModel plans a stored job's spec, which may hold both.)
  static absl::Status CheckBatchGivenOnce(const hap::v1::ModelSpec& model, int64_t global_batch);
  // The graph a plan on `devices` devices trains: a zoo model (its batch
  // `global_batch`, else 32 a device; MoE's experts 2 a device, unless
  // given) or a graph (whose first input's dimension 0 must be
  // `global_batch` when that is given). InvalidArgument naming model.zoo or
  // model.graph and what is wrong.
  static absl::StatusOr<graph::Graph> BuildModel(const hap::v1::ModelSpec& model,
                                                 int64_t global_batch, int devices);

 private:
  struct Job;
  friend absl::Status ConvertOptions(const hap::v1::PlanOptions&, Job*,
                                     const PlannerCoreOptions&);
  explicit PlannerCore(PlannerCoreOptions options);
  absl::Status Resume(const hap::v1::Plan& plan);
  void Worker();
  void RunJob(const std::shared_ptr<Job>& job);
  void UpdatePlan(const std::shared_ptr<Job>& job,
                  const std::function<void(hap::v1::Plan&)>& edit);
  void UpdatePlanLocked(const std::shared_ptr<Job>& job,
                        const std::function<void(hap::v1::Plan&)>& edit);
  void FinishPlanLocked(const std::shared_ptr<Job>& job, const hap::v1::Plan& plan);
  // Queues `job`, or merges it into an identical job in flight.
  void EnqueueLocked(const std::shared_ptr<Job>& job);
  // `job` will not search (any more): its followers end with `result`
  // (when it SUCCEEDED or failed for a reason of the request) or the first
  // of them takes over the search. `result` null: deleted.
  void ReleaseFollowersLocked(const std::shared_ptr<Job>& job, const hap::v1::Plan* result);
  // Forgets plan `name` (already removed from the sink).
  void ErasePlanLocked(const std::string& name);
  // The plans deployments use (PlannerCoreOptions::plans_in_use; none when
  // unset) into `in_use`, and the count of unpins before they were read
  // into `unpins_seen` (an unpin since: a deployment made, read again).
  absl::Status PlansInUse(std::set<std::string>* in_use, uint64_t* unpins_seen);
  // More finished plans than the retention count.
  bool OverCountLocked() const;
  // EnforceRetention when OverCountLocked (after a plan finished).
  void TrimPastRetentionCount();
  void RefreshLivenessLocked();
  absl::Status RemoveNodeLocked(const std::string& name);
  // A node now reporting `now` instead of `before`: the measured links of
  // the devices it no longer has are dropped (a device that comes back is
  // measured again, and ids that come and go do not pile up links).
  void DropLinksOfGoneDevicesLocked(const hap::v1::Node& before, const hap::v1::Node& now);
  hap::v1::Cluster ClusterLocked(bool include_stale) const;

  struct State;
  std::unique_ptr<State> s_;
  PlannerCoreOptions o_;
  std::vector<std::string> start_notes_;
  // Plan `name`'s entry: InvalidArgument for a malformed name, NotFound.
  absl::StatusOr<PlanEntry> Entry(const std::string& name);
  struct PagedPlan;
  absl::Status PlansPage(int page_size, const std::string& token, bool full,
                         std::vector<PagedPlan>* page, std::string* next);
  // The whole plan of an entry (loaded with o_.load_plan when the entry
  // holds only its summary, and kept in the entry). Called without the lock.
  absl::StatusOr<std::shared_ptr<const hap::v1::Plan>> Whole(const std::string& name,
                                                             const PlanEntry& entry);
};

// "plans/abc" -> "abc"; InvalidArgument naming the expected pattern.
absl::StatusOr<std::string> PlanId(const std::string& name);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_PLANNER_CORE_H_
