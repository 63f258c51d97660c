#include "planner/service/grpc/planner_service_impl.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/util/time_util.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "planner/service/core/pagination.h"
#include "planner/util/status_macros.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using google::protobuf::util::TimeUtil;

constexpr size_t kMaxMetricsPerDeployment = 100'000;

bool FinalDeployment(v1::Deployment::State s) {
  return s == v1::Deployment::SUCCEEDED || s == v1::Deployment::FAILED ||
         s == v1::Deployment::STOPPED;
}

absl::Time Deadline(const grpc::ServerContext* ctx) {
  auto d = ctx->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

// Rendezvous keys belong to a deployment that exists, at its generation: a
// store open to any name would grow without bound.
absl::Status CheckRendezvous(const std::map<std::string, v1::Deployment>& deployments,
                             const std::string& deployment, int64_t generation) {
  auto it = deployments.find(deployment);
  if (it == deployments.end()) {
    return absl::NotFoundError(absl::StrCat(
        "deployment '", deployment,
        "' does not exist (rendezvous keys belong to a deployment the planner made)"));
  }
  if (it->second.generation() != generation) {
    return absl::FailedPreconditionError(
        absl::StrCat("deployment '", deployment, "' is generation ", it->second.generation(),
                     ", not ", generation));
  }
  return absl::OkStatus();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

struct PlannerServiceImpl::State {
  absl::Mutex mu;
  absl::CondVar changed;
  bool shutdown = false;
  std::map<std::string, v1::Deployment> deployments;
  std::map<std::string, int64_t> generations;  // plan -> last generation
  std::map<std::string, std::vector<v1::StepMetric>> metrics;  // per deployment
  std::map<std::string, bool> stop_requested;
  // Rendezvous: (deployment, generation, key) -> value.
  std::map<std::tuple<std::string, int64_t, std::string>, std::string> kv;
  std::vector<std::thread> pushes;
};

PlannerServiceImpl::PlannerServiceImpl(PlannerCore* core, PlannerStateSink* sink,
                                       PlannerServiceOptions o,
                                       std::vector<v1::Deployment> deployments,
                                       std::vector<v1::StepMetric> metrics)
    : core_(core), sink_(sink), o_(std::move(o)), s_(std::make_unique<State>()) {
  for (auto& d : deployments) {
    s_->generations[d.plan()] = std::max(s_->generations[d.plan()], d.generation());
    // Pushes in flight when the planner stopped are not resumed: the
    // executors keep training on their own; their status shows through
    // metrics, so keep the state as it was.
    s_->deployments[d.name()] = std::move(d);
  }
  for (auto& m : metrics) s_->metrics[m.deployment()].push_back(std::move(m));
}

PlannerServiceImpl::~PlannerServiceImpl() {
  Shutdown();
  std::vector<std::thread> pushes;
  {
    absl::MutexLock l(&s_->mu);
    pushes.swap(s_->pushes);
  }
  for (auto& t : pushes) t.join();
}

void PlannerServiceImpl::Shutdown() {
  absl::MutexLock l(&s_->mu);
  s_->shutdown = true;
  for (auto& [name, stop] : s_->stop_requested) stop = true;
  s_->changed.SignalAll();
}

grpc::Status PlannerServiceImpl::Handle(const char* method, grpc::ServerContext* ctx,
                                        const std::function<absl::Status()>& fn) {
  auto start = std::chrono::steady_clock::now();
  if (o_.on_rpc_start) o_.on_rpc_start(method);
  grpc::Status s = CheckToken(ctx, o_.security.token);
  if (s.ok()) s = ToGrpc(fn());
  if (o_.on_rpc) {
    o_.on_rpc(method, s.error_code(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return s;
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

grpc::Status PlannerServiceImpl::Heartbeat(grpc::ServerContext* ctx,
                                           const v1::HeartbeatRequest* r,
                                           v1::HeartbeatResponse* out) {
  return Handle("Heartbeat", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->Heartbeat(*r));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::GetCluster(grpc::ServerContext* ctx,
                                            const v1::GetClusterRequest* r, v1::Cluster* out) {
  return Handle("GetCluster", ctx, [&]() -> absl::Status {
    *out = core_->GetCluster(r->include_stale());
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::ListNodes(grpc::ServerContext* ctx,
                                           const v1::ListNodesRequest* r,
                                           v1::ListNodesResponse* out) {
  return Handle("ListNodes", ctx, [&]() -> absl::Status {
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
    return core_->ReportLinks(r->node(),
                              std::vector<v1::Link>(r->links().begin(), r->links().end()));
  });
}

// ---------------------------------------------------------------- plans --

grpc::Status PlannerServiceImpl::CreatePlan(grpc::ServerContext* ctx,
                                            const v1::CreatePlanRequest* r, v1::Plan* out) {
  return Handle("CreatePlan", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->CreatePlan(*r, Deadline(ctx)));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::GetPlan(grpc::ServerContext* ctx, const v1::GetPlanRequest* r,
                                         v1::Plan* out) {
  return Handle("GetPlan", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->GetPlan(r->name(), r->view() == v1::GetPlanRequest::FULL));
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::ListPlans(grpc::ServerContext* ctx,
                                           const v1::ListPlansRequest* r,
                                           v1::ListPlansResponse* out) {
  return Handle("ListPlans", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(*out, core_->ListPlans(r->page_size(), r->page_token()));
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
  return Handle("DeletePlan", ctx, [&]() { return core_->DeletePlan(r->name()); });
}

grpc::Status PlannerServiceImpl::WatchPlan(grpc::ServerContext* ctx,
                                           const v1::WatchPlanRequest* r,
                                           grpc::ServerWriter<v1::Plan>* w) {
  return Handle("WatchPlan", ctx, [&]() -> absl::Status {
    bool write_failed = false;
    HAP_RETURN_IF_ERROR(core_->WatchPlan(
        r->name(),
        [&](const v1::Plan& p) {
          write_failed = !w->Write(p);
          return !write_failed;
        },
        [&] {
          absl::MutexLock l(&s_->mu);
          return ctx->IsCancelled() || s_->shutdown;
        }));
    if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled the watch");
    return absl::OkStatus();
  });
}

// ---------------------------------------------------------- deployments --

void PlannerServiceImpl::UpdateDeployment(const std::string& name,
                                          const std::function<void(v1::Deployment&)>& edit) {
  absl::MutexLock l(&s_->mu);
  auto it = s_->deployments.find(name);
  if (it == s_->deployments.end()) return;
  v1::Deployment next = it->second;
  edit(next);
  if (sink_) {
    absl::Status saved = sink_->SaveDeployment(next);
    if (!saved.ok()) {
      // The executors did change state; say so, and that the store still
      // holds the state before (a restarted planner shows that one).
      next.set_error(absl::StrCat(next.error(), next.error().empty() ? "" : "; ",
                                  "the planner could not save this deployment as ",
                                  v1::Deployment::State_Name(next.state()), ": ",
                                  saved.message()));
    }
  }
  it->second = std::move(next);
  s_->changed.SignalAll();
}

grpc::Status PlannerServiceImpl::DeployPlan(grpc::ServerContext* ctx,
                                            const v1::DeployPlanRequest* r,
                                            v1::Deployment* out) {
  return Handle("DeployPlan", ctx, [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(v1::Plan plan, core_->GetPlan(r->plan(), /*full=*/true));
    if (plan.state() != v1::Plan::SUCCEEDED) {
      return absl::FailedPreconditionError(absl::StrCat(
          r->plan(), " is ", v1::Plan::State_Name(plan.state()),
          "; only a SUCCEEDED plan can be deployed"));
    }
    if (r->training().steps() < 0 || r->training().threads_per_rank() < 0) {
      return absl::InvalidArgumentError("training.steps and threads_per_rank must not be negative");
    }
    // Each device's executor: from the request, else the node's label
    // "hap.executor/<device id>".
    v1::Cluster cluster = core_->GetCluster(true);
    std::map<std::string, std::string> labelled;
    for (const auto& n : cluster.nodes()) {
      for (const auto& [k, v] : n.labels()) {
        if (k.rfind("hap.executor/", 0) == 0) labelled[k.substr(13)] = v;
      }
    }
    v1::Deployment d;
    for (int rank = 0; rank < plan.devices_size(); ++rank) {
      const std::string& dev = plan.devices(rank);
      auto it = r->executors().find(dev);
      std::string addr = it != r->executors().end() ? it->second
                         : labelled.count(dev)     ? labelled[dev]
                                                   : "";
      if (addr.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "no executor address for device '", dev, "' (rank ", rank,
            "): pass executors[\"", dev, "\"] = host:port"));
      }
      auto* a = d.add_ranks();
      a->set_rank(rank);
      a->set_device(dev);
      a->set_executor_address(addr);
    }
    for (const auto& [dev, addr] : r->executors()) {
      if (std::find(plan.devices().begin(), plan.devices().end(), dev) == plan.devices().end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("executors names device '", dev, "', which the plan does not use"));
      }
    }
    HAP_ASSIGN_OR_RETURN(std::string id, PlanId(plan.name()));
    {
      absl::MutexLock l(&s_->mu);
      if (s_->shutdown) return absl::UnavailableError("the planner is shutting down");
      int64_t gen = s_->generations[plan.name()] + 1;
      d.set_name(absl::StrCat("deployments/", id, "-g", gen));
      d.set_plan(plan.name());
      d.set_generation(gen);
      d.set_state(v1::Deployment::PENDING);
      *d.mutable_training() = r->training();
      if (d.training().steps() == 0) d.mutable_training()->set_steps(100);
      *d.mutable_create_time() = TimeUtil::GetCurrentTime();
      // Saved before it exists here: a deployment the store refused is none.
      if (sink_) {
        HAP_RETURN_IF_ERROR(Annotate(sink_->SaveDeployment(d),
                                     absl::StrCat(d.name(), " was not created")));
      }
      s_->generations[plan.name()] = gen;
      s_->deployments[d.name()] = d;
      s_->stop_requested[d.name()] = false;
      s_->pushes.emplace_back([this, d, plan] { Push(d, plan); });
    }
    *out = d;
    return absl::OkStatus();
  });
}

// Loads the plan on every executor, starts training, and follows it until
// it ends (executor statuses), is stopped, or the planner shuts down.
void PlannerServiceImpl::Push(v1::Deployment d, v1::Plan plan) {
  const int world = d.ranks_size();
  std::vector<std::unique_ptr<v1::Executor::Stub>> stubs;
  auto fail = [&](const std::string& what) {
    UpdateDeployment(d.name(), [&](v1::Deployment& x) {
      x.set_state(v1::Deployment::FAILED);
      x.set_error(what);
    });
  };
  for (const auto& a : d.ranks()) {
    auto ch = MakeChannel(a.executor_address(), o_.security);
    if (!ch.ok()) return fail(std::string(ch.status().message()));
    stubs.push_back(v1::Executor::NewStub(*ch));
  }
  auto call = [&](int rank, const char* what, auto&& rpc) -> bool {
    grpc::ClientContext ctx;
    PrepareClientContext(&ctx, o_.security, o_.executor_timeout);
    grpc::Status s = rpc(ctx);
    if (!s.ok()) {
      fail(absl::StrCat(what, " on rank ", rank, " (", d.ranks(rank).device(), " at ",
                        d.ranks(rank).executor_address(), "): ", s.error_message()));
    }
    return s.ok();
  };
  for (int r = 0; r < world; ++r) {
    v1::LoadPlanRequest req;
    *req.mutable_plan() = plan;
    req.set_deployment(d.name());
    req.set_generation(d.generation());
    req.set_rank(r);
    req.set_world_size(world);
    req.set_rendezvous_address(o_.advertise_address);
    *req.mutable_training() = d.training();
    v1::LoadPlanResponse resp;
    if (!call(r, "LoadPlan", [&](grpc::ClientContext& c) {
          return stubs[r]->LoadPlan(&c, req, &resp);
        })) {
      return;
    }
  }
  for (int r = 0; r < world; ++r) {
    v1::StartTrainingRequest req;
    req.set_deployment(d.name());
    v1::ExecutorStatus st;
    if (!call(r, "StartTraining", [&](grpc::ClientContext& c) {
          return stubs[r]->StartTraining(&c, req, &st);
        })) {
      return;
    }
  }
  UpdateDeployment(d.name(), [](v1::Deployment& x) { x.set_state(v1::Deployment::RUNNING); });
  while (true) {
    {
      absl::MutexLock l(&s_->mu);
      s_->changed.WaitWithTimeout(&s_->mu, absl::Seconds(1));
      if (s_->stop_requested[d.name()] || s_->shutdown) break;
    }
    int finished = 0;
    for (int r = 0; r < world; ++r) {
      v1::GetStatusRequest req;
      v1::ExecutorStatus st;
      if (!call(r, "GetStatus", [&](grpc::ClientContext& c) {
            return stubs[r]->GetStatus(&c, req, &st);
          })) {
        return;
      }
      if (st.state() == v1::ExecutorStatus::FAILED) {
        return fail(absl::StrCat("rank ", r, " failed: ", st.error()));
      }
      finished += st.state() == v1::ExecutorStatus::FINISHED;
    }
    if (finished == world) {
      UpdateDeployment(d.name(),
                       [](v1::Deployment& x) { x.set_state(v1::Deployment::SUCCEEDED); });
      return;
    }
  }
  bool shutting_down;
  {
    absl::MutexLock l(&s_->mu);
    shutting_down = s_->shutdown && !s_->stop_requested[d.name()];
  }
  if (shutting_down) return;  // executors keep training; state stays RUNNING
  for (int r = 0; r < world; ++r) {
    v1::StopTrainingRequest req;
    req.set_deployment(d.name());
    v1::ExecutorStatus st;
    grpc::ClientContext c;
    PrepareClientContext(&c, o_.security, o_.executor_timeout);
    (void)stubs[r]->StopTraining(&c, req, &st);
  }
  UpdateDeployment(d.name(), [](v1::Deployment& x) { x.set_state(v1::Deployment::STOPPED); });
}

grpc::Status PlannerServiceImpl::GetDeployment(grpc::ServerContext* ctx,
                                               const v1::GetDeploymentRequest* r,
                                               v1::Deployment* out) {
  return Handle("GetDeployment", ctx, [&]() -> absl::Status {
    absl::MutexLock l(&s_->mu);
    auto it = s_->deployments.find(r->name());
    if (it == s_->deployments.end()) {
      return absl::NotFoundError(absl::StrCat("deployment '", r->name(), "' does not exist"));
    }
    *out = it->second;
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::ListDeployments(grpc::ServerContext* ctx,
                                                 const v1::ListDeploymentsRequest* r,
                                                 v1::ListDeploymentsResponse* out) {
  return Handle("ListDeployments", ctx, [&]() -> absl::Status {
    absl::MutexLock l(&s_->mu);
    HAP_ASSIGN_OR_RETURN(std::string next,
                         Paginate(s_->deployments, r->page_size(), r->page_token(),
                                  [&](const v1::Deployment& d) { *out->add_deployments() = d; }));
    out->set_next_page_token(next);
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::StopDeployment(grpc::ServerContext* ctx,
                                                const v1::StopDeploymentRequest* r,
                                                v1::Deployment* out) {
  return Handle("StopDeployment", ctx, [&]() -> absl::Status {
    absl::MutexLock l(&s_->mu);
    auto it = s_->deployments.find(r->name());
    if (it == s_->deployments.end()) {
      return absl::NotFoundError(absl::StrCat("deployment '", r->name(), "' does not exist"));
    }
    if (!FinalDeployment(it->second.state())) {
      s_->stop_requested[r->name()] = true;  // the push thread stops the executors
      s_->changed.SignalAll();
    }
    *out = it->second;
    return absl::OkStatus();
  });
}

// -------------------------------------------------------------- metrics --

grpc::Status PlannerServiceImpl::ReportStepMetrics(grpc::ServerContext* ctx,
                                                   const v1::ReportStepMetricsRequest* r,
                                                   v1::ReportStepMetricsResponse*) {
  return Handle("ReportStepMetrics", ctx, [&]() -> absl::Status {
    std::vector<v1::StepMetric> batch(r->metrics().begin(), r->metrics().end());
    {
      absl::MutexLock l(&s_->mu);
      for (const auto& m : batch) {
        auto it = s_->deployments.find(m.deployment());
        if (it == s_->deployments.end()) {
          return absl::NotFoundError(
              absl::StrCat("step metric for unknown deployment '", m.deployment(), "'"));
        }
        if (m.rank() < 0 || m.rank() >= it->second.ranks_size() || m.step() < 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "step metric of ", m.deployment(), " has rank ", m.rank(), " and step ",
              m.step(), " outside the deployment"));
        }
      }
      // Saved first: what is served is what a restart finds.
      if (sink_) {
        HAP_RETURN_IF_ERROR(Annotate(sink_->AppendStepMetrics(batch), "step metrics not saved"));
      }
      for (const auto& m : batch) {
        auto& list = s_->metrics[m.deployment()];
        if (list.size() < kMaxMetricsPerDeployment) list.push_back(m);
        v1::Deployment& d = s_->deployments[m.deployment()];
        if (m.rank() == 0) {
          d.set_steps_completed(std::max(d.steps_completed(), m.step() + 1));
          d.set_last_loss(m.loss());
          std::vector<double> times;
          for (const auto& x : list) {
            if (x.rank() == 0) times.push_back(x.step_seconds());
          }
          d.set_median_step_seconds(Median(times));
        }
      }
    }
    if (o_.on_step_metric) {
      for (const auto& m : batch) o_.on_step_metric(m);
    }
    return absl::OkStatus();
  });
}

std::vector<v1::Deployment> PlannerServiceImpl::Deployments() const {
  absl::MutexLock l(&s_->mu);
  std::vector<v1::Deployment> out;
  out.reserve(s_->deployments.size());
  for (const auto& [name, d] : s_->deployments) out.push_back(d);
  return out;
}

absl::StatusOr<std::vector<v1::StepMetric>> PlannerServiceImpl::StepMetrics(
    const std::string& deployment) const {
  absl::MutexLock l(&s_->mu);
  if (!s_->deployments.count(deployment)) {
    return absl::NotFoundError(absl::StrCat("deployment '", deployment, "' does not exist"));
  }
  auto it = s_->metrics.find(deployment);
  if (it == s_->metrics.end()) return std::vector<v1::StepMetric>{};
  return it->second;
}

grpc::Status PlannerServiceImpl::ListStepMetrics(grpc::ServerContext* ctx,
                                                 const v1::ListStepMetricsRequest* r,
                                                 v1::ListStepMetricsResponse* out) {
  return Handle("ListStepMetrics", ctx, [&]() -> absl::Status {
    if (r->page_size() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_size must not be negative, got ", r->page_size()));
    }
    int64_t from = 0;
    if (!r->page_token().empty() && !absl::SimpleAtoi(r->page_token(), &from)) {
      return absl::InvalidArgumentError("page_token is not a token this server returned");
    }
    int size = r->page_size() == 0 ? 500 : std::min(r->page_size(), 10000);
    absl::MutexLock l(&s_->mu);
    if (!s_->deployments.count(r->deployment())) {
      return absl::NotFoundError(
          absl::StrCat("deployment '", r->deployment(), "' does not exist"));
    }
    const auto& list = s_->metrics[r->deployment()];
    int64_t i = from;
    for (; i < static_cast<int64_t>(list.size()) && i < from + size; ++i) {
      *out->add_metrics() = list[i];
    }
    if (i < static_cast<int64_t>(list.size())) out->set_next_page_token(absl::StrCat(i));
    return absl::OkStatus();
  });
}

// ----------------------------------------------------------- rendezvous --

grpc::Status PlannerServiceImpl::StoreSet(grpc::ServerContext* ctx,
                                          const v1::StoreSetRequest* r, v1::StoreSetResponse*) {
  return Handle("StoreSet", ctx, [&]() -> absl::Status {
    if (r->deployment().empty() || r->key().empty()) {
      return absl::InvalidArgumentError("StoreSet needs a deployment and a key");
    }
    absl::MutexLock l(&s_->mu);
    HAP_RETURN_IF_ERROR(CheckRendezvous(s_->deployments, r->deployment(), r->generation()));
    s_->kv[{r->deployment(), r->generation(), r->key()}] = r->value();
    s_->changed.SignalAll();
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::StoreGet(grpc::ServerContext* ctx,
                                          const v1::StoreGetRequest* r,
                                          v1::StoreGetResponse* out) {
  return Handle("StoreGet", ctx, [&]() -> absl::Status {
    if (r->deployment().empty() || r->keys().empty()) {
      return absl::InvalidArgumentError("StoreGet needs a deployment and at least one key");
    }
    absl::Time deadline = Deadline(ctx);
    if (r->has_timeout()) {
      deadline = std::min(deadline, absl::Now() + absl::Seconds(r->timeout().seconds()) +
                                        absl::Nanoseconds(r->timeout().nanos()));
    }
    absl::MutexLock l(&s_->mu);
    HAP_RETURN_IF_ERROR(CheckRendezvous(s_->deployments, r->deployment(), r->generation()));
    while (true) {
      std::vector<std::string> missing;
      for (const auto& k : r->keys()) {
        if (!s_->kv.count({r->deployment(), r->generation(), k})) missing.push_back(k);
      }
      if (missing.empty()) break;
      if (s_->shutdown) return absl::UnavailableError("the planner is shutting down");
      if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled");
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "rendezvous keys not set in time for ", r->deployment(), " generation ",
            r->generation(), ": ", absl::StrJoin(missing, ", ")));
      }
      s_->changed.WaitWithDeadline(&s_->mu, std::min(deadline, absl::Now() + absl::Milliseconds(200)));
    }
    for (const auto& k : r->keys()) {
      out->add_values(s_->kv[{r->deployment(), r->generation(), k}]);
    }
    return absl::OkStatus();
  });
}

grpc::Status PlannerServiceImpl::StoreAdd(grpc::ServerContext* ctx,
                                          const v1::StoreAddRequest* r, v1::StoreAddResponse* out) {
  return Handle("StoreAdd", ctx, [&]() -> absl::Status {
    if (r->deployment().empty() || r->key().empty()) {
      return absl::InvalidArgumentError("StoreAdd needs a deployment and a key");
    }
    absl::MutexLock l(&s_->mu);
    HAP_RETURN_IF_ERROR(CheckRendezvous(s_->deployments, r->deployment(), r->generation()));
    std::tuple<std::string, int64_t, std::string> key{r->deployment(), r->generation(),
                                                      r->key()};
    auto it = s_->kv.find(key);
    int64_t n = 0;
    if (it != s_->kv.end() && !it->second.empty() && !absl::SimpleAtoi(it->second, &n)) {
      return absl::FailedPreconditionError(
          absl::StrCat("key '", r->key(), "' holds a value that is not a counter"));
    }
    int64_t sum = 0;
    if (__builtin_add_overflow(n, r->delta(), &sum)) {
      return absl::OutOfRangeError(absl::StrCat("key '", r->key(), "' holds ", n, ": adding ",
                                                r->delta(), " overflows a 64-bit counter"));
    }
    s_->kv[key] = absl::StrCat(sum);
    out->set_value(sum);
    s_->changed.SignalAll();
    return absl::OkStatus();
  });
}

}  // namespace hap::service
