// hap.v1.Planner over gRPC: a thin translator over PlannerCore (nodes,
// plans), DeploymentManager (deployments, step metrics from executors,
// the rendezvous store; planner/service/core/deployment_manager.h) and
// JobController (elastic jobs; planner/service/core/jobs.h), plus the
// executors' gRPC client the deployments are pushed and watched with.
//
// Every RPC checks the bearer token (when configured), maps absl statuses
// to gRPC codes one to one, and reports (method, code, seconds) to
// `on_rpc` for the go-grpc-prometheus style metrics.
#ifndef HAP_PLANNER_SERVICE_GRPC_PLANNER_SERVICE_IMPL_H_
#define HAP_PLANNER_SERVICE_GRPC_PLANNER_SERVICE_IMPL_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/grpc_util.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/deployments.h"
#include "planner/service/core/jobs.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {

struct PlannerServiceOptions {
  Security security;  // token required from callers; TLS for executors
  // The address executors reach this planner at (rendezvous, metrics).
  std::string advertise_address;
  // Deadlines of the calls to executors, status polls (how soon a dead or
  // frozen executor fails its deployment) and stop retries. Must pass
  // ValidateDeploymentWatchOptions; out-of-range values are replaced by
  // their defaults.
  DeploymentWatchOptions deployments;
  // The executors of a deployment; empty = over gRPC with `security`.
  std::function<std::unique_ptr<DeploymentExecutors>(const hap::v1::Deployment&)> executors;
  // Every change of a deployment's record, as served from then on. Called
  // with the service's lock held: it must not call the service.
  std::function<void(const hap::v1::Deployment&)> on_deployment;
  // Once per deployment, as it ends (DeploymentManagerOptions::on_finished).
  std::function<void(const hap::v1::Deployment&)> on_deployment_finished;
  int64_t probe_bytes = 8 << 20;  // bandwidth probe payload per peer
  // Metrics hooks (may be empty): a call started; a call ended.
  std::function<void(const std::string& method)> on_rpc_start;
  std::function<void(const std::string& method, grpc::StatusCode code, double seconds)>
      on_rpc;
  std::function<void(const hap::v1::StepMetric&)> on_step_metric;
  // Jobs: how often the controller reconciles, and its observers
  // (JobControllerOptions).
  absl::Duration job_interval = absl::Seconds(1);
  std::function<void(const hap::v1::Job&, hap::v1::JobEvent::Reason)> on_job_replan;
  std::function<void(const hap::v1::Job&, const hap::v1::JobEvent&)> on_job_resumed;
};

// Reads that only copy a snapshot (plans, nodes, deployments, step metrics)
// are served on gRPC's callback API, on the threads that poll the
// connections: thousands of them in flight take no thread each. GetPlan
// and ListPlans, the hottest and largest, answer in raw bytes: each plan
// snapshot's views are serialized once (PlannerCore::GetPlanEncoded) and
// every read shares them. The rest
// block (planning, deploying, waits) and run on the synchronous server's
// thread pool.
using PlannerServiceBase = hap::v1::Planner::WithCallbackMethod_GetCluster<
    hap::v1::Planner::WithCallbackMethod_ListNodes<
        hap::v1::Planner::WithRawCallbackMethod_GetPlan<
            hap::v1::Planner::WithRawCallbackMethod_ListPlans<
                hap::v1::Planner::WithCallbackMethod_GetDeployment<
                    hap::v1::Planner::WithCallbackMethod_ListDeployments<
                        hap::v1::Planner::WithCallbackMethod_ListStepMetrics<
                            hap::v1::Planner::Service>>>>>>>;

class PlannerServiceImpl final : public PlannerServiceBase {
 public:
  // `core` and `sink` (may be null) must outlive the service. `deployments`,
  // `metrics` and `jobs` are the persisted state to start from; RUNNING
  // deployments among them are re-attached to, PENDING ones failed and
  // their ranks stopped (DeploymentManager); unfinished jobs go on once
  // StartJobs() is called.
  PlannerServiceImpl(PlannerCore* core, PlannerStateSink* sink, PlannerServiceOptions o,
                     std::vector<hap::v1::Deployment> deployments = {},
                     std::vector<hap::v1::StepMetric> metrics = {},
                     std::vector<hap::v1::Job> jobs = {});
  // Shutdown(), then waits for the supervisors (each returns within a call
  // deadline to an executor).
  ~PlannerServiceImpl() override;

  // Stops waiting RPCs (watches, rendezvous gets, stops) so the server can
  // stop, and the deployments' supervisors: RUNNING deployments stay
  // RUNNING, their executors training, for a restarted planner.
  void Shutdown();
  // Set once the listening port is known, before serving.
  void set_advertise_address(const std::string& a) { o_.advertise_address = a; }
  // Starts the jobs' reconciliation loop (after set_advertise_address: the
  // jobs deploy with it).
  void StartJobs();

  // Read-only snapshots for the status page and /metrics (thread-safe):
  // every deployment, by name, without its rank_profiles; the step metrics
  // reported for one deployment, in arrival order (NotFound for an unknown
  // deployment).
  std::vector<hap::v1::Deployment> Deployments() const;
  absl::StatusOr<std::vector<hap::v1::StepMetric>> StepMetrics(
      const std::string& deployment) const;
  std::vector<hap::v1::Job> Jobs() const;  // every job, by name
  // Deployment retention (DeploymentManager::EnforceRetention), keeping
  // each unfinished job's deployment.
  absl::StatusOr<int> EnforceDeploymentRetention(int count, absl::Time oldest);
  // Job retention (JobController::EnforceRetention).
  absl::StatusOr<int> EnforceJobRetention(int count, absl::Time oldest);

  grpc::Status RegisterNode(grpc::ServerContext*, const hap::v1::RegisterNodeRequest*,
                            hap::v1::RegisterNodeResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const hap::v1::HeartbeatRequest*,
                         hap::v1::HeartbeatResponse*) override;
  grpc::ServerUnaryReactor* GetCluster(grpc::CallbackServerContext*, const hap::v1::GetClusterRequest*,
                                       hap::v1::Cluster*) override;
  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext*, const hap::v1::ListNodesRequest*,
                                      hap::v1::ListNodesResponse*) override;
  grpc::Status DeleteNode(grpc::ServerContext*, const hap::v1::DeleteNodeRequest*,
                          hap::v1::DeleteNodeResponse*) override;
  grpc::Status GetProbeAssignments(grpc::ServerContext*,
                                   const hap::v1::GetProbeAssignmentsRequest*,
                                   hap::v1::GetProbeAssignmentsResponse*) override;
  grpc::Status ReportLinks(grpc::ServerContext*, const hap::v1::ReportLinksRequest*,
                           hap::v1::ReportLinksResponse*) override;

  grpc::Status CreatePlan(grpc::ServerContext*, const hap::v1::CreatePlanRequest*,
                          hap::v1::Plan*) override;
  // hap.v1.GetPlanRequest -> hap.v1.Plan, as bytes.
  grpc::ServerUnaryReactor* GetPlan(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                    grpc::ByteBuffer*) override;
  // hap.v1.ListPlansRequest -> hap.v1.ListPlansResponse, as bytes.
  grpc::ServerUnaryReactor* ListPlans(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                      grpc::ByteBuffer*) override;
  grpc::Status CancelPlan(grpc::ServerContext*, const hap::v1::CancelPlanRequest*,
                          hap::v1::Plan*) override;
  grpc::Status DeletePlan(grpc::ServerContext*, const hap::v1::DeletePlanRequest*,
                          hap::v1::DeletePlanResponse*) override;
  grpc::Status WatchPlan(grpc::ServerContext*, const hap::v1::WatchPlanRequest*,
                         grpc::ServerWriter<hap::v1::Plan>*) override;

  grpc::Status DeployPlan(grpc::ServerContext*, const hap::v1::DeployPlanRequest*,
                          hap::v1::Deployment*) override;
  grpc::ServerUnaryReactor* GetDeployment(grpc::CallbackServerContext*, const hap::v1::GetDeploymentRequest*,
                                          hap::v1::Deployment*) override;
  grpc::ServerUnaryReactor* ListDeployments(grpc::CallbackServerContext*, const hap::v1::ListDeploymentsRequest*,
                                            hap::v1::ListDeploymentsResponse*) override;
  // DeploymentManager::Stop within the call's deadline.
  grpc::Status StopDeployment(grpc::ServerContext*, const hap::v1::StopDeploymentRequest*,
                              hap::v1::Deployment*) override;

  grpc::Status ReportStepMetrics(grpc::ServerContext*,
                                 const hap::v1::ReportStepMetricsRequest*,
                                 hap::v1::ReportStepMetricsResponse*) override;
  grpc::ServerUnaryReactor* ListStepMetrics(grpc::CallbackServerContext*, const hap::v1::ListStepMetricsRequest*,
                                            hap::v1::ListStepMetricsResponse*) override;

  grpc::Status StoreSet(grpc::ServerContext*, const hap::v1::StoreSetRequest*,
                        hap::v1::StoreSetResponse*) override;
  grpc::Status StoreGet(grpc::ServerContext*, const hap::v1::StoreGetRequest*,
                        hap::v1::StoreGetResponse*) override;
  grpc::Status StoreAdd(grpc::ServerContext*, const hap::v1::StoreAddRequest*,
                        hap::v1::StoreAddResponse*) override;

  grpc::Status CreateJob(grpc::ServerContext*, const hap::v1::CreateJobRequest*,
                         hap::v1::Job*) override;
  grpc::Status GetJob(grpc::ServerContext*, const hap::v1::GetJobRequest*,
                      hap::v1::Job*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const hap::v1::ListJobsRequest*,
                        hap::v1::ListJobsResponse*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const hap::v1::WatchJobRequest*,
                        grpc::ServerWriter<hap::v1::Job>*) override;
  grpc::Status StopJob(grpc::ServerContext*, const hap::v1::StopJobRequest*,
                       hap::v1::Job*) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const hap::v1::DeleteJobRequest*,
                         hap::v1::DeleteJobResponse*) override;
  grpc::Status DeleteDeployment(grpc::ServerContext*, const hap::v1::DeleteDeploymentRequest*,
                                hap::v1::DeleteDeploymentResponse*) override;

 private:
  // Checks the token, runs `fn` (an error message over 1 KiB is cut in its
  // middle: it may quote a long name), reports the call.
  grpc::Status Handle(const char* method, grpc::ServerContextBase* ctx,
                      const std::function<absl::Status()>& fn);
  // Handle, answered on the callback API.
  grpc::ServerUnaryReactor* HandleNow(const char* method, grpc::CallbackServerContext* ctx,
                                      const std::function<absl::Status()>& fn);

  // How a watch whose stream the core ended (without an error) ends: OK
  // once the resource's final state was sent; Cancelled when the client
  // cancelled; Unavailable when the planner's shutdown ended it (an OK then
  // read as "the plan or job is done" while it went on).
  absl::Status WatchEnd(grpc::ServerContextBase* ctx, const std::string& name,
                        bool final_sent) const;

  PlannerCore* core_;
  PlannerServiceOptions o_;
  // Shutdown() was called: the watches end, UNAVAILABLE unless they sent
  // the final state.
  std::atomic<bool> shutting_down_{false};
  std::unique_ptr<DeploymentManager> deployments_;
  std::unique_ptr<JobBackend> job_backend_;
  std::unique_ptr<JobController> jobs_;
};

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_GRPC_PLANNER_SERVICE_IMPL_H_
