#include "planner/service/grpc/planner_service_impl.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/status_macros.h"
#include "common/training_checks.h"
#include "common/utf8.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "hap/v1/executor_service.grpc.pb.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

// A deployment's executors over gRPC, the token and TLS of `security`.
// GetStatus and StopTraining go to every rank at once (callback API), so
// one silent rank costs one deadline, not one per rank.
class GrpcExecutors final : public DeploymentExecutors {
 public:
  GrpcExecutors(const v1::Deployment& d, const Security& security) : security_(security) {
    for (const auto& a : d.ranks()) {
      auto channel = MakeChannel(a.executor_address(), security);
      if (channel.ok()) {
        stubs_.push_back(v1::Executor::NewStub(*channel));
        channel_errors_.push_back(absl::OkStatus());
      } else {
        stubs_.push_back(nullptr);
        channel_errors_.push_back(channel.status());
      }
    }
  }

  absl::Status LoadPlan(int rank, const v1::LoadPlanRequest& request,
                        absl::Duration timeout) override {
    if (stubs_[rank] == nullptr) return channel_errors_[rank];
    grpc::ClientContext ctx;
    PrepareClientContext(&ctx, security_, timeout);
    v1::LoadPlanResponse response;
    return FromGrpc(stubs_[rank]->LoadPlan(&ctx, request, &response));
  }

  absl::Status StartTraining(int rank, const std::string& deployment,
                             absl::Duration timeout) override {
    if (stubs_[rank] == nullptr) return channel_errors_[rank];
    grpc::ClientContext ctx;
    PrepareClientContext(&ctx, security_, timeout);
    v1::StartTrainingRequest request;
    request.set_deployment(deployment);
    v1::ExecutorStatus status;
    return FromGrpc(stubs_[rank]->StartTraining(&ctx, request, &status));
  }

  Statuses GetStatus(absl::Duration timeout) override {
    const v1::GetStatusRequest request;
    return EveryRank(timeout, [&](v1::Executor::Stub* stub, grpc::ClientContext* ctx,
                                  v1::ExecutorStatus* out, std::function<void(grpc::Status)> done) {
      stub->async()->GetStatus(ctx, &request, out, std::move(done));
    });
  }

  Statuses StopTraining(const std::string& deployment, absl::Duration timeout) override {
    v1::StopTrainingRequest request;
    request.set_deployment(deployment);
    return EveryRank(timeout, [&](v1::Executor::Stub* stub, grpc::ClientContext* ctx,
                                  v1::ExecutorStatus* out, std::function<void(grpc::Status)> done) {
      stub->async()->StopTraining(ctx, &request, out, std::move(done));
    });
  }

 private:
  // Starts `call` on every rank and waits for every answer (each bounded by
  // `timeout`).
  template <typename Call>
  Statuses EveryRank(absl::Duration timeout, const Call& call) {
    const int n = static_cast<int>(stubs_.size());
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts(n);
    std::vector<v1::ExecutorStatus> answers(n);
    std::vector<grpc::Status> results(n);
    absl::BlockingCounter pending(n);
    for (int r = 0; r < n; ++r) {
      if (stubs_[r] == nullptr) {
        pending.DecrementCount();
        continue;
      }
      contexts[r] = std::make_unique<grpc::ClientContext>();
      PrepareClientContext(contexts[r].get(), security_, timeout);
      call(stubs_[r].get(), contexts[r].get(), &answers[r],
           [&results, &pending, r](grpc::Status s) {
             results[r] = std::move(s);
             pending.DecrementCount();
           });
    }
    pending.Wait();
    Statuses out;
    out.reserve(n);
    for (int r = 0; r < n; ++r) {
      if (stubs_[r] == nullptr) {
        out.push_back(channel_errors_[r]);
      } else if (!results[r].ok()) {
        out.push_back(FromGrpc(results[r]));
      } else {
        out.push_back(std::move(answers[r]));
      }
    }
    return out;
  }

  const Security security_;
  std::vector<std::unique_ptr<v1::Executor::Stub>> stubs_;
  std::vector<absl::Status> channel_errors_;
};

// hap.v1.ListPlansResponse in wire form from its plans' wire forms: each
// `plans` (field 1) length-delimited, then `next_page_token` (field 2)
// unless empty, as the message would serialize.
std::shared_ptr<const std::string> EncodeListPlansResponse(
    const std::vector<std::shared_ptr<const std::string>>& plans, const std::string& next) {
  using google::protobuf::internal::WireFormatLite;
  auto bytes = std::make_shared<std::string>();
  size_t size = next.size() + 16;
  for (const auto& p : plans) size += p->size() + 8;
  bytes->reserve(size);
  {
    google::protobuf::io::StringOutputStream stream(bytes.get());
    google::protobuf::io::CodedOutputStream out(&stream);
    for (const auto& p : plans)
      WireFormatLite::WriteBytes(v1::ListPlansResponse::kPlansFieldNumber, *p, &out);
    if (!next.empty()) {
      WireFormatLite::WriteString(v1::ListPlansResponse::kNextPageTokenFieldNumber, next, &out);
    }
  }
  return bytes;
}

// A status message quotes what the request sent (a name, an id, a key): of
// one 10 KB long, the client got "received initial metadata size exceeds
// limit" (RESOURCE_EXHAUSTED) instead. Longer messages keep their start
// and end (the field, and what is wrong with it) around a note of the cut.
// The cuts fall between UTF-8 characters: one cut inside a character (a
// name of non-ASCII letters) made the message invalid UTF-8.
grpc::Status Bounded(grpc::Status s) {
  constexpr size_t kHead = 768, kTail = 256;
  const std::string& m = s.error_message();
  if (m.size() <= kHead + kTail) return s;
  size_t head = kHead, tail = m.size() - kTail;
  while (head > 0 && Utf8Continuation(m[head])) --head;
  while (tail < m.size() && Utf8Continuation(m[tail])) ++tail;
  return grpc::Status(s.error_code(),
                      absl::StrCat(m.substr(0, head), " [... ", tail - head,
                                   " bytes of the message cut ...] ", m.substr(tail)),
                      s.error_details());
}

// Whether a read's `view` asks for whole plans. A value this planner does
// not know (a newer client's view) is InvalidArgument: it was served as
// BASIC, without a word.
absl::StatusOr<bool> FullView(v1::GetPlanRequest::View view) {
  if (!v1::GetPlanRequest::View_IsValid(view)) {
    return absl::InvalidArgumentError(
        absl::StrCat("view ", static_cast<int>(view),
                     " is not one of VIEW_UNSPECIFIED (0), BASIC (1) or FULL (2)"));
  }
  return view == v1::GetPlanRequest::FULL;
}

}  // namespace

PlannerServiceImpl::PlannerServiceImpl(PlannerCore* core, PlannerStateSink* sink,
                                       PlannerServiceOptions o,
                                       std::vector<v1::Deployment> deployments,
                                       std::vector<v1::StepMetric> metrics,
                                       std::vector<v1::Job> jobs)
    : core_(core), o_(std::move(o)) {
  DeploymentManagerOptions mo;
  mo.watch = o_.deployments;
  mo.sink = sink;
  mo.on_change = o_.on_deployment;
  mo.on_finished = o_.on_deployment_finished;
  mo.executors = o_.executors ? o_.executors : [security = o_.security](const v1::Deployment& d) {
    return std::unique_ptr<DeploymentExecutors>(std::make_unique<GrpcExecutors>(d, security));
  };
  deployments_ = std::make_unique<DeploymentManager>(std::move(mo), std::move(deployments),
                                                     std::move(metrics));
  job_backend_ =
      NewCoreJobBackend(core_, deployments_.get(), [this] { return o_.advertise_address; });
  JobControllerOptions jo;
  jo.backend = job_backend_.get();
  jo.sink = sink;
  jo.interval = o_.job_interval;
  jo.on_replan = o_.on_job_replan;
  jo.on_resumed = o_.on_job_resumed;
  jobs_ = std::make_unique<JobController>(std::move(jo), std::move(jobs));
}

PlannerServiceImpl::~PlannerServiceImpl() {
  Shutdown();
  jobs_.reset();         // joins the reconciliation loop
  deployments_.reset();  // joins the supervisors
}

void PlannerServiceImpl::StartJobs() { jobs_->Start(); }

void PlannerServiceImpl::Shutdown() {
  shutting_down_ = true;  // first: the watches it ends read it
  jobs_->Shutdown();  // first: it acts through the deployments
  deployments_->Shutdown();
}

grpc::Status PlannerServiceImpl::Handle(const char* method, grpc::ServerContextBase* ctx,
                                        const std::function<absl::Status()>& fn) {
  auto start = std::chrono::steady_clock::now();
  if (o_.on_rpc_start) o_.on_rpc_start(method);
  grpc::Status s = CheckToken(ctx, o_.security.token);
  if (s.ok()) s = Bounded(ToGrpc(fn()));
  if (o_.on_rpc) {
    o_.on_rpc(method, s.error_code(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return s;
}

absl::Status PlannerServiceImpl::WatchEnd(grpc::ServerContextBase* ctx, const std::string& name,
                                          bool final_sent) const {
  if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled the watch");
  if (!final_sent && shutting_down_) {
    return absl::UnavailableError(absl::StrCat("the planner is shutting down; the watch of ", name,
                                               " ended before it did: watch it again"));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* PlannerServiceImpl::HandleNow(const char* method,
                                                        grpc::CallbackServerContext* ctx,
                                                        const std::function<absl::Status()>& fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Handle(method, ctx, fn));
  return reactor;
}

// ---------------------------------------------------------------- nodes --

grpc::Status PlannerServiceImpl::RegisterNode(grpc::ServerContext* ctx,
                                              const v1::RegisterNodeRequest* r,
                                              v1::RegisterNodeResponse* out) {
  return Handle("RegisterNode", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->RegisterNode(r->node()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* r,
                                           v1::HeartbeatResponse* out) {
  return Handle("Heartbeat", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->Heartbeat(*r));
    // The agent pauses its drift checks and link re-probes while a
    // deployment runs on the node (measured beside it they read its load).
    if (!out->unknown_node()) {
      out->set_training(deployments_->AnyActiveOn(core_->NodeDeviceIds(r->name())));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerServiceImpl::GetCluster(grpc::CallbackServerContext* ctx,
                                                         const v1::GetClusterRequest* r,
                                                         v1::Cluster* out) {
  return HandleNow("GetCluster", ctx, [&]() -> absl::Status {
    *out = core_->GetCluster(r->include_stale());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerServiceImpl::ListNodes(grpc::CallbackServerContext* ctx,
                                                        const v1::ListNodesRequest* r,
                                                        v1::ListNodesResponse* out) {
  return HandleNow("ListNodes", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->ListNodes(r->page_size(), r->page_token()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::DeleteNode(grpc::ServerContext* ctx,
                                            const v1::DeleteNodeRequest* r,
                                            v1::DeleteNodeResponse*) {
  return Handle("DeleteNode", ctx, [&]() { return core_->DeleteNode(r->name()); });
}

grpc::Status PlannerServiceImpl::GetProbeAssignments(grpc::ServerContext* ctx,
                                                     const v1::GetProbeAssignmentsRequest* r,
                                                     v1::GetProbeAssignmentsResponse* out) {
  return Handle("GetProbeAssignments", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->GetProbeAssignments(r->node(), o_.probe_bytes));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::ReportLinks(grpc::ServerContext* ctx,
                                             const v1::ReportLinksRequest* r,
                                             v1::ReportLinksResponse*) {
  return Handle("ReportLinks", ctx, [&]() -> absl::Status {
    return core_->ReportLinks(
        r->node(), std::vector<v1::Link>(r->links().begin(), r->links().end()), r->address());
  });
}

// ---------------------------------------------------------------- plans --

grpc::Status PlannerServiceImpl::CreatePlan(grpc::ServerContext* ctx,
                                            const v1::CreatePlanRequest* r, v1::Plan* out) {
  return Handle("CreatePlan", ctx, [&]() -> absl::Status {
    HAP_RETURN_IF_ERROR(PlannerCore::CheckNewPlanOptions(r->options()));
    HAP_RETURN_IF_ERROR(PlannerCore::CheckBatchGivenOnce(r->model(), r->global_batch()));
    HAP_ASSIGN_OR_RETURN(
        *out, core_->CreatePlan(*r, CallDeadline(ctx), [ctx] { return ctx->IsCancelled(); }));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerServiceImpl::GetPlan(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* out) {
  return HandleNow("GetPlan", ctx, [&]() -> absl::Status {
    v1::GetPlanRequest r;
    HAP_RETURN_IF_ERROR(ParseRequest(*request, &r));
    HAP_ASSIGN_OR_RETURN(const bool full, FullView(r.view()));
    HAP_ASSIGN_OR_RETURN(std::shared_ptr<const std::string> plan,
                         core_->GetPlanEncoded(r.name(), full));
    *out = SharedBytes(std::move(plan));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerServiceImpl::ListPlans(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* out) {
  return HandleNow("ListPlans", ctx, [&]() -> absl::Status {
    v1::ListPlansRequest r;
    HAP_RETURN_IF_ERROR(ParseRequest(*request, &r));
    HAP_ASSIGN_OR_RETURN(const bool full, FullView(r.view()));
    std::vector<std::shared_ptr<const std::string>> plans;
    std::string next;
    HAP_RETURN_IF_ERROR(
        core_->ListPlansEncoded(r.page_size(), r.page_token(), full, &plans, &next));
    *out = SharedBytes(EncodeListPlansResponse(plans, next));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::CancelPlan(grpc::ServerContext* ctx,
                                            const v1::CancelPlanRequest* r, v1::Plan* out) {
  return Handle("CancelPlan", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->CancelPlan(r->name()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::DeletePlan(grpc::ServerContext* ctx,
                                            const v1::DeletePlanRequest* r,
                                            v1::DeletePlanResponse*) {
  return Handle("DeletePlan", ctx, [&]() -> absl::Status {
    // A deployment names its plan: deleting the plan would leave it naming
    // one that is gone (or, with the id used again, another plan).
    for (const v1::Deployment& d : deployments_->Summaries()) {
      if (d.plan() == r->name()) {
        return absl::FailedPreconditionError(absl::StrCat(
            r->name(), " is the plan of ", d.name(), " (", v1::Deployment::State_Name(d.state()),
            "): delete the deployment first (stop it if it is not finished)"));
      }
    }
    return core_->DeletePlan(r->name());
  });
}

grpc::Status PlannerServiceImpl::WatchPlan(grpc::ServerContext* ctx, const v1::WatchPlanRequest* r,
                                           grpc::ServerWriter<v1::Plan>* w) {
  return Handle("WatchPlan", ctx, [&]() -> absl::Status {
    bool final_sent = false;
    HAP_RETURN_IF_ERROR(core_->WatchPlan(
        r->name(),
        [&](const v1::Plan& p) {
          final_sent = PlanFinal(p.state());
          return w->Write(p);
        },
        [&] { return ctx->IsCancelled() || shutting_down_.load(); }));
    return WatchEnd(ctx, r->name(), final_sent);
  });
}

// ---------------------------------------------------------- deployments --

grpc::Status PlannerServiceImpl::DeployPlan(grpc::ServerContext* ctx,
                                            const v1::DeployPlanRequest* r, v1::Deployment* out) {
  return Handle("DeployPlan", ctx, [&]() -> absl::Status {
    HAP_RETURN_IF_ERROR(CheckNewTrainingConfig(r->training()));
    HAP_RETURN_IF_ERROR(CheckDataSpecForm(r->training().data_spec()));
    // Pinned while deployed: retention cannot delete the plan under the new
    // deployment (which, once it exists, keeps its plan by itself).
    HAP_ASSIGN_OR_RETURN(v1::Plan plan, core_->PinPlan(r->plan()));
    absl::StatusOr<v1::Deployment> d =
        deployments_->Deploy(plan, *r, core_->GetCluster(true), o_.advertise_address);
    core_->UnpinPlan(plan.name());
    if (!d.ok()) return d.status();
    *out = *std::move(d);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerServiceImpl::GetDeployment(grpc::CallbackServerContext* ctx,
                                                            const v1::GetDeploymentRequest* r,
                                                            v1::Deployment* out) {
  return HandleNow("GetDeployment", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, deployments_->Get(r->name()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerServiceImpl::ListDeployments(grpc::CallbackServerContext* ctx,
                                                              const v1::ListDeploymentsRequest* r,
                                                              v1::ListDeploymentsResponse* out) {
  return HandleNow("ListDeployments", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, deployments_->List(r->page_size(), r->page_token()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::StopDeployment(grpc::ServerContext* ctx,
                                                const v1::StopDeploymentRequest* r,
                                                v1::Deployment* out) {
  return Handle("StopDeployment", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, deployments_->Stop(r->name(), CallDeadline(ctx),
                                                  [ctx] { return ctx->IsCancelled(); }));
    return absl::OkStatus();
  });
}

// -------------------------------------------------------------- metrics --

grpc::Status PlannerServiceImpl::ReportStepMetrics(grpc::ServerContext* ctx,
                                                   const v1::ReportStepMetricsRequest* r,
                                                   v1::ReportStepMetricsResponse*) {
  return Handle("ReportStepMetrics", ctx, [&]() -> absl::Status {
    std::vector<v1::StepMetric> batch(r->metrics().begin(), r->metrics().end());
    HAP_RETURN_IF_ERROR(deployments_->ReportStepMetrics(batch));
    if (o_.on_step_metric) {
      for (const auto& m : batch) o_.on_step_metric(m);
    }
    return absl::OkStatus();
  });
}

std::vector<v1::Deployment> PlannerServiceImpl::Deployments() const {
  return deployments_->Summaries();
}

absl::StatusOr<std::vector<v1::StepMetric>> PlannerServiceImpl::StepMetrics(
    const std::string& deployment) const {
  return deployments_->StepMetrics(deployment);
}

grpc::ServerUnaryReactor* PlannerServiceImpl::ListStepMetrics(grpc::CallbackServerContext* ctx,
                                                              const v1::ListStepMetricsRequest* r,
                                                              v1::ListStepMetricsResponse* out) {
  return HandleNow("ListStepMetrics", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(
        *out, deployments_->ListStepMetrics(r->deployment(), r->page_size(), r->page_token()));
    return absl::OkStatus();
  });
}

// ----------------------------------------------------------- rendezvous --

grpc::Status PlannerServiceImpl::StoreSet(grpc::ServerContext* ctx, const v1::StoreSetRequest* r,
                                          v1::StoreSetResponse*) {
  return Handle("StoreSet", ctx, [&]() {
    return deployments_->StoreSet(r->deployment(), r->generation(), r->key(), r->value());
  });
}

grpc::Status PlannerServiceImpl::StoreGet(grpc::ServerContext* ctx, const v1::StoreGetRequest* r,
                                          v1::StoreGetResponse* out) {
  return Handle("StoreGet", ctx, [&]() -> absl::Status {
    const absl::Time deadline = CallDeadline(ctx, r->has_timeout() ? &r->timeout() : nullptr);
    HAP_ASSIGN_OR_RETURN(
        std::vector<std::string> values,
        deployments_->StoreGet(r->deployment(), r->generation(),
                               std::vector<std::string>(r->keys().begin(), r->keys().end()),
                               deadline, [ctx] { return ctx->IsCancelled(); }));
    for (auto& v : values) out->add_values(std::move(v));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::StoreAdd(grpc::ServerContext* ctx, const v1::StoreAddRequest* r,
                                          v1::StoreAddResponse* out) {
  return Handle("StoreAdd", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(int64_t sum, deployments_->StoreAdd(r->deployment(), r->generation(),
                                                             r->key(), r->delta()));
    out->set_value(sum);
    return absl::OkStatus();
  });
}

// ----------------------------------------------------------------- jobs --

std::vector<v1::Job> PlannerServiceImpl::Jobs() const { return jobs_->All(); }

absl::StatusOr<int> PlannerServiceImpl::EnforceDeploymentRetention(int count, absl::Time oldest) {
  return deployments_->EnforceRetention(count, oldest, jobs_->UnfinishedJobsDeployments());
}

absl::StatusOr<int> PlannerServiceImpl::EnforceJobRetention(int count, absl::Time oldest) {
  return jobs_->EnforceRetention(count, oldest);
}

grpc::Status PlannerServiceImpl::CreateJob(grpc::ServerContext* ctx, const v1::CreateJobRequest* r,
                                           v1::Job* out) {
  return Handle("CreateJob", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, jobs_->Create(*r));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* r,
                                        v1::Job* out) {
  return Handle("GetJob", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, jobs_->Get(r->name()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* r,
                                          v1::ListJobsResponse* out) {
  return Handle("ListJobs", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, jobs_->List(r->page_size(), r->page_token()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* r,
                                          grpc::ServerWriter<v1::Job>* w) {
  return Handle("WatchJob", ctx, [&]() -> absl::Status {
    bool final_sent = false;
    HAP_RETURN_IF_ERROR(jobs_->Watch(
        r->name(),
        [&](const v1::Job& j) {
          final_sent = JobFinal(j.status().state());
          return w->Write(j);
        },
        [&] { return ctx->IsCancelled() || shutting_down_.load(); }));
    return WatchEnd(ctx, r->name(), final_sent);
  });
}

grpc::Status PlannerServiceImpl::StopJob(grpc::ServerContext* ctx, const v1::StopJobRequest* r,
                                         v1::Job* out) {
  return Handle("StopJob", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, jobs_->Stop(r->name()));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::DeleteDeployment(grpc::ServerContext* ctx,
                                                  const v1::DeleteDeploymentRequest* r,
                                                  v1::DeleteDeploymentResponse*) {
  return Handle("DeleteDeployment", ctx, [&]() {
    return deployments_->Delete(r->name(), jobs_->UnfinishedJobsDeployments(), CallDeadline(ctx),
                                [ctx] { return ctx->IsCancelled(); });
  });
}

grpc::Status PlannerServiceImpl::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* r,
                                           v1::DeleteJobResponse*) {
  return Handle("DeleteJob", ctx, [&]() { return jobs_->Delete(r->name()); });
}

}  // namespace hap::service
