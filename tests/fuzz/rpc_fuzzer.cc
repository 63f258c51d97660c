// libFuzzer target: the planner's request handling, below gRPC. Each input
// is a sequence of calls, each [method byte][2-byte length][request bytes]:
// the bytes are parsed as that RPC's request message (unparseable ones are
// skipped) and given to the core (nodes, plans) or the deployment manager
// (deployments, step metrics, the rendezvous store) as the gRPC service
// does, and job requests to a job controller's CreateJob and reads. One
// core and one manager live across inputs, so calls meet the state earlier
// inputs left (nodes, plans, deployments). Crashes, sanitizer reports and
// hangs (libFuzzer's -timeout) are the findings; every status
// is acceptable, since validation answering is the point.
//
// Executors are a fake that answers nothing (the real gRPC client is tested
// by the service tests); deployments therefore fail, which exercises the
// failure paths.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hap/v1/planner_service.pb.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/jobs.h"
#include "planner/service/core/planner_core.h"

namespace {

namespace v1 = ::hap::v1;
using hap::service::DeploymentExecutors;
using hap::service::DeploymentManager;
using hap::service::DeploymentManagerOptions;
using hap::service::PlannerCore;
using hap::service::PlannerCoreOptions;

// Executors nobody runs: every call fails at once.
class NoExecutors final : public DeploymentExecutors {
 public:
  explicit NoExecutors(int ranks) : ranks_(ranks) {}
  absl::Status LoadPlan(int, const v1::LoadPlanRequest&, absl::Duration) override {
    return absl::UnavailableError("no executor (fuzzing)");
  }
  absl::Status StartTraining(int, const std::string&, absl::Duration) override {
    return absl::UnavailableError("no executor (fuzzing)");
  }
  Statuses GetStatus(absl::Duration) override { return Fail(); }
  Statuses StopTraining(const std::string&, absl::Duration) override { return Fail(); }

 private:
  Statuses Fail() const {
    return Statuses(ranks_, absl::UnavailableError("no executor (fuzzing)"));
  }
  int ranks_;
};

struct Service {
  std::unique_ptr<PlannerCore> core;
  std::unique_ptr<DeploymentManager> deployments;
  std::unique_ptr<hap::service::JobBackend> job_backend;

  Service() {
    PlannerCoreOptions o;
    o.workers = 1;
    o.default_max_seconds = 0.2;  // fuzzed graphs must not plan for long
    o.plan_retention_count = 64;  // bounded across millions of inputs
    core = std::move(PlannerCore::Create(o)).value();
    DeploymentManagerOptions d;
    d.watch.call_timeout = absl::Milliseconds(5);
    d.watch.status_interval = absl::Milliseconds(5);
    d.watch.status_timeout = absl::Milliseconds(5);
    d.watch.stop_timeout = absl::Milliseconds(5);
    d.watch.stop_attempts = 1;
    d.executors = [](const v1::Deployment& dep) {
      return std::make_unique<NoExecutors>(dep.ranks_size());
    };
    deployments = std::make_unique<DeploymentManager>(std::move(d));
    job_backend = hap::service::NewCoreJobBackend(core.get(), deployments.get(),
                                                  [] { return std::string("127.0.0.1:1"); });
  }
};

template <typename M>
bool Parse(const uint8_t* data, size_t size, M* m) {
  return m->ParseFromArray(data, static_cast<int>(size));
}

// Budgets a request may set are cut to what a fuzzer can wait for.
void Bound(v1::PlanOptions* o) {
  auto* b = o->mutable_budget();
  if (!(b->max_seconds() >= 0 && b->max_seconds() <= 0.2)) b->set_max_seconds(0.2);
  if (b->max_states() < 0 || b->max_states() > 2000) b->set_max_states(2000);
}

void Call(Service& s, uint8_t method, const uint8_t* data, size_t size) {
  const absl::Time soon = absl::Now() + absl::Milliseconds(20);
  const auto never = [] { return false; };
  switch (method % 23) {
    case 0: {
      v1::RegisterNodeRequest r;
      if (Parse(data, size, &r)) (void)s.core->RegisterNode(r.node());
      break;
    }
    case 1: {
      v1::HeartbeatRequest r;
      if (Parse(data, size, &r)) (void)s.core->Heartbeat(r);
      break;
    }
    case 2: {
      v1::ListNodesRequest r;
      if (Parse(data, size, &r)) (void)s.core->ListNodes(r.page_size(), r.page_token());
      (void)s.core->GetCluster(size % 2 == 0);
      break;
    }
    case 3: {
      v1::DeleteNodeRequest r;
      if (Parse(data, size, &r)) (void)s.core->DeleteNode(r.name());
      break;
    }
    case 4: {
      v1::GetProbeAssignmentsRequest r;
      if (Parse(data, size, &r)) (void)s.core->GetProbeAssignments(r.node(), 1 << 20);
      break;
    }
    case 5: {
      v1::ReportLinksRequest r;
      if (Parse(data, size, &r)) {
        (void)s.core->ReportLinks(r.node(),
                                  std::vector<v1::Link>(r.links().begin(), r.links().end()));
      }
      break;
    }
    case 6: {
      v1::CreatePlanRequest r;
      if (!Parse(data, size, &r)) break;
      Bound(r.mutable_options());
      (void)s.core->CreatePlan(r, absl::Now() + absl::Milliseconds(500));
      break;
    }
    case 7: {  // as the server answers it (bytes), checked against the message
      v1::GetPlanRequest r;
      if (!Parse(data, size, &r)) break;
      const bool full = r.view() == v1::GetPlanRequest::FULL;
      auto bytes = s.core->GetPlanEncoded(r.name(), full);
      auto plan = s.core->GetPlan(r.name(), full);
      if (bytes.ok() != plan.ok()) __builtin_trap();
      v1::Plan parsed;
      if (bytes.ok() && (!parsed.ParseFromString(**bytes) || parsed.name() != plan->name())) {
        __builtin_trap();
      }
      break;
    }
    case 8: {
      v1::ListPlansRequest r;
      if (!Parse(data, size, &r)) break;
      std::vector<std::shared_ptr<const std::string>> plans;
      std::string next;
      auto listed = s.core->ListPlansEncoded(r.page_size(), r.page_token(),
                                             r.view() == v1::GetPlanRequest::FULL, &plans, &next);
      auto page = s.core->ListPlans(r.page_size(), r.page_token(),
                                    r.view() == v1::GetPlanRequest::FULL);
      if (listed.ok() != page.ok()) __builtin_trap();
      break;
    }
    case 9: {
      v1::CancelPlanRequest r;
      if (Parse(data, size, &r)) (void)s.core->CancelPlan(r.name());
      break;
    }
    case 10: {
      v1::DeletePlanRequest r;
      if (Parse(data, size, &r)) (void)s.core->DeletePlan(r.name());
      break;
    }
    case 11: {  // DeployPlan, as the service does it
      v1::DeployPlanRequest r;
      if (!Parse(data, size, &r)) break;
      auto plan = s.core->GetPlanSnapshot(r.plan());
      if (!plan.ok()) break;
      (void)s.deployments->Deploy(**plan, r, s.core->GetCluster(false), "127.0.0.1:1");
      break;
    }
    case 12: {
      v1::GetDeploymentRequest r;
      if (Parse(data, size, &r)) (void)s.deployments->Get(r.name());
      break;
    }
    case 13: {
      v1::ListDeploymentsRequest r;
      if (Parse(data, size, &r)) (void)s.deployments->List(r.page_size(), r.page_token());
      break;
    }
    case 14: {
      v1::StopDeploymentRequest r;
      if (Parse(data, size, &r)) (void)s.deployments->Stop(r.name(), soon, never);
      break;
    }
    case 15: {
      v1::ReportStepMetricsRequest r;
      if (Parse(data, size, &r)) {
        (void)s.deployments->ReportStepMetrics(
            std::vector<v1::StepMetric>(r.metrics().begin(), r.metrics().end()));
      }
      break;
    }
    case 16: {
      v1::ListStepMetricsRequest r;
      if (Parse(data, size, &r)) {
        (void)s.deployments->ListStepMetrics(r.deployment(), r.page_size(), r.page_token());
      }
      break;
    }
    case 17: {
      v1::StoreSetRequest r;
      if (Parse(data, size, &r)) {
        (void)s.deployments->StoreSet(r.deployment(), r.generation(), r.key(), r.value());
      }
      break;
    }
    case 18: {
      v1::StoreGetRequest r;
      if (Parse(data, size, &r)) {
        (void)s.deployments->StoreGet(r.deployment(), r.generation(),
                                      std::vector<std::string>(r.keys().begin(), r.keys().end()),
                                      soon, never);
      }
      break;
    }
    case 19: {
      v1::StoreAddRequest r;
      if (Parse(data, size, &r)) {
        (void)s.deployments->StoreAdd(r.deployment(), r.generation(), r.key(), r.delta());
      }
      break;
    }
    case 20: {  // CreateJob (every check of the spec), then the job's reads
      v1::CreateJobRequest r;
      if (!Parse(data, size, &r)) break;
      // A controller of its own (no reconciliation loop): jobs that never
      // finish do not pile up across inputs.
      hap::service::JobControllerOptions o;
      o.backend = s.job_backend.get();
      hap::service::JobController jobs(std::move(o));
      absl::StatusOr<v1::Job> job = jobs.Create(r);
      if (!job.ok()) break;
      if (!jobs.Get(job->name()).ok()) __builtin_trap();  // created, so there
      (void)jobs.List(static_cast<int>(size % 3), r.job_id());
      (void)jobs.Stop(job->name());
      (void)jobs.Delete(job->name());
      break;
    }
    case 21: {
      v1::DeleteDeploymentRequest r;
      if (Parse(data, size, &r)) (void)s.deployments->Delete(r.name(), {});
      break;
    }
    case 22: {  // the retention pass, with a count taken from the request
      v1::ListDeploymentsRequest r;
      if (Parse(data, size, &r)) {
        (void)s.deployments->EnforceRetention(r.page_size() % 8, absl::InfinitePast(), {});
      }
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Service* service = new Service();  // lives across inputs, never freed
  size_t at = 0;
  for (int calls = 0; at + 3 <= size && calls < 16; ++calls) {
    const uint8_t method = data[at];
    size_t n = static_cast<size_t>(data[at + 1]) | static_cast<size_t>(data[at + 2]) << 8;
    at += 3;
    n = std::min(n, size - at);
    Call(*service, method, data + at, n);
    at += n;
  }
  return 0;
}
