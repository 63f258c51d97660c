#include "planner/service/grpc/planner_service_impl.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
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
                                  v1::ExecutorStatus* out,
                                  std::function<void(grpc::Status)> done) {
      stub->async()->GetStatus(ctx, &request, out, std::move(done));
    });
  }

  Statuses StopTraining(const std::string& deployment, absl::Duration timeout) override {
    v1::StopTrainingRequest request;
    request.set_deployment(deployment);
    return EveryRank(timeout, [&](v1::Executor::Stub* stub, grpc::ClientContext* ctx,
                                  v1::ExecutorStatus* out,
                                  std::function<void(grpc::Status)> done) {
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

DeploymentWatchOptions Sanitized(DeploymentWatchOptions o) {
  const DeploymentWatchOptions defaults;
  auto positive = [](absl::Duration& x, absl::Duration def) {
    if (!(x > absl::ZeroDuration())) x = def;
  };
  positive(o.call_timeout, defaults.call_timeout);
  positive(o.status_interval, defaults.status_interval);
  positive(o.status_timeout, defaults.status_timeout);
  positive(o.stop_timeout, defaults.stop_timeout);
  if (o.missed_status_limit < 1) o.missed_status_limit = defaults.missed_status_limit;
  if (o.stop_attempts < 1) o.stop_attempts = defaults.stop_attempts;
  return o;
}

}  // namespace

struct PlannerServiceImpl::State {
  absl::Mutex mu;
  absl::CondVar changed;
  bool shutdown = false;
  std::map<std::string, v1::Deployment> deployments;
  std::map<std::string, int64_t> generations;  // plan -> last generation
  std::map<std::string, std::vector<v1::StepMetric>> metrics;  // per deployment
  std::set<std::string> stop_requested;
  std::set<std::string> supervised;  // deployments whose supervisor runs
  // Rendezvous: (deployment, generation, key) -> value.
  std::map<std::tuple<std::string, int64_t, std::string>, std::string> kv;
  // Supervisor threads by id; the ids of those that returned.
  std::map<int64_t, std::thread> supervisors;
  std::vector<int64_t> returned;
  int64_t next_supervisor = 0;
};

PlannerServiceImpl::PlannerServiceImpl(PlannerCore* core, PlannerStateSink* sink,
                                       PlannerServiceOptions o,
                                       std::vector<v1::Deployment> deployments,
                                       std::vector<v1::StepMetric> metrics)
    : core_(core), sink_(sink), o_(std::move(o)), s_(std::make_unique<State>()) {
  o_.deployments = Sanitized(o_.deployments);
  for (auto& m : metrics) s_->metrics[m.deployment()].push_back(std::move(m));
  absl::MutexLock l(&s_->mu);
  for (auto& d : deployments) {
    s_->generations[d.plan()] = std::max(s_->generations[d.plan()], d.generation());
    s_->deployments[d.name()] = d;
    if (d.state() == v1::Deployment::RUNNING) {
      // Re-attach: the first poll finds out whether each rank still trains it.
      Supervise(d, [this, d](DeploymentExecutors& ex, const DeploymentControl& c) {
        WatchDeployment(d, ex, o_.deployments, c);
      });
    } else if (d.state() == v1::Deployment::PENDING) {
      // Its push died with the previous planner, and the rendezvous keys
      // with it: whatever ranks it loaded or started are stopped.
      Supervise(d, [this, d](DeploymentExecutors& ex, const DeploymentControl& c) {
        FailUnfinishedDeployment(
            d, "the planner restarted before every rank had started training", ex,
            o_.deployments, c);
      });
    }
  }
}

PlannerServiceImpl::~PlannerServiceImpl() {
  Shutdown();
  std::map<int64_t, std::thread> supervisors;
  {
    absl::MutexLock l(&s_->mu);
    supervisors.swap(s_->supervisors);
    s_->returned.clear();
  }
  for (auto& [id, t] : supervisors) t.join();
}

void PlannerServiceImpl::Shutdown() {
  absl::MutexLock l(&s_->mu);
  s_->shutdown = true;
  s_->changed.SignalAll();
}

void PlannerServiceImpl::Supervise(
    const v1::Deployment& d,
    std::function<void(DeploymentExecutors&, const DeploymentControl&)> body) {
  const int64_t id = s_->next_supervisor++;
  s_->supervised.insert(d.name());
  s_->supervisors[id] = std::thread([this, d, body = std::move(body), id] {
    {
      std::unique_ptr<DeploymentExecutors> executors = MakeExecutors(d);
      body(*executors, Control(d.name()));
    }
    absl::MutexLock l(&s_->mu);
    s_->supervised.erase(d.name());
    s_->stop_requested.erase(d.name());
    s_->returned.push_back(id);
    s_->changed.SignalAll();
  });
}

void PlannerServiceImpl::ReapSupervisors() {
  std::vector<std::thread> done;
  {
    absl::MutexLock l(&s_->mu);
    for (int64_t id : s_->returned) {
      auto it = s_->supervisors.find(id);
      if (it == s_->supervisors.end()) continue;
      done.push_back(std::move(it->second));
      s_->supervisors.erase(it);
    }
    s_->returned.clear();
  }
  for (auto& t : done) t.join();  // each has returned or is returning
}

std::unique_ptr<DeploymentExecutors> PlannerServiceImpl::MakeExecutors(
    const v1::Deployment& d) const {
  if (o_.executors) return o_.executors(d);
  return std::make_unique<GrpcExecutors>(d, o_.security);
}

DeploymentControl PlannerServiceImpl::Control(const std::string& deployment) {
  DeploymentControl c;
  c.now = [] { return absl::Now(); };
  c.wait = [this, deployment](absl::Time deadline, bool stop_wakes) {
    absl::MutexLock l(&s_->mu);
    while (true) {
      if (s_->shutdown) return Wake::kShutdown;
      if (stop_wakes && s_->stop_requested.count(deployment)) return Wake::kStop;
      if (absl::Now() >= deadline) return Wake::kTimeout;
      s_->changed.WaitWithDeadline(&s_->mu, deadline);
    }
  };
  c.update = [this, deployment](const std::function<void(v1::Deployment&)>& edit) {
    UpdateDeployment(deployment, edit);
  };
  return c;
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
  if (o_.on_deployment) o_.on_deployment(it->second);
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
    ReapSupervisors();
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
      if (o_.on_deployment) o_.on_deployment(d);
      Supervise(d, [this, d, plan, rendezvous = o_.advertise_address](
                       DeploymentExecutors& ex, const DeploymentControl& c) {
        RunDeployment(d, plan, rendezvous, ex, o_.deployments, c);
      });
    }
    *out = d;
    return absl::OkStatus();
  });
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
    v1::Deployment d;
    {
      absl::MutexLock l(&s_->mu);
      auto it = s_->deployments.find(r->name());
      if (it == s_->deployments.end()) {
        return absl::NotFoundError(absl::StrCat("deployment '", r->name(), "' does not exist"));
      }
      if (!FinalDeployment(it->second.state())) {
        if (s_->shutdown || !s_->supervised.count(r->name())) {
          return absl::UnavailableError(absl::StrCat(
              "the planner is shutting down; ", r->name(),
              " keeps running and a restarted planner can stop it"));
        }
        // Its supervisor stops every rank, then marks it STOPPED.
        s_->stop_requested.insert(r->name());
        s_->changed.SignalAll();
        const absl::Time deadline = Deadline(ctx);
        while (!FinalDeployment(s_->deployments[r->name()].state()) && !s_->shutdown &&
               !ctx->IsCancelled() && absl::Now() < deadline) {
          s_->changed.WaitWithDeadline(&s_->mu,
                                       std::min(deadline, absl::Now() + absl::Milliseconds(200)));
        }
        *out = s_->deployments[r->name()];
        return absl::OkStatus();
      }
      d = it->second;
    }
    *out = d;
    if (d.state() == v1::Deployment::SUCCEEDED) return absl::OkStatus();
    // FAILED or STOPPED: tell every rank again; those still training it (a
    // stop that did not reach them before) stop now.
    std::unique_ptr<DeploymentExecutors> executors = MakeExecutors(d);
    return Annotate(StopRanksOnce(d, *executors, o_.deployments),
                    absl::StrCat(d.name(), " is ", v1::Deployment::State_Name(d.state()),
                                 "; its ranks were told to stop again"));
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
