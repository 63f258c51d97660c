// The planner daemon's state backend: the SQLite StateStore
// (planner/service/store) behind the core's PlannerStateSink, plus loading
// everything back at start.
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/service/planner_server.h"
#include "planner/service/store/sqlite_store.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

// Every item of a paged list.
template <typename T, typename Fn>
absl::StatusOr<std::vector<T>> All(Fn&& list) {
  std::vector<T> out;
  std::string token;
  do {
    HAP_ASSIGN_OR_RETURN(auto page, list(store::kMaxPageSize, token));
    for (auto& x : page.items) out.push_back(std::move(x));
    token = page.next_page_token;
  } while (!token.empty());
  return out;
}

class StoreBackend : public StateBackend {
 public:
  explicit StoreBackend(std::unique_ptr<store::StateStore> s) : s_(std::move(s)) {}

  absl::StatusOr<Loaded> Load() override {
    Loaded l;
    HAP_ASSIGN_OR_RETURN(l.nodes, All<v1::Node>([&](int n, const std::string& t) {
                           return s_->ListNodes(n, t);
                         }));
    HAP_ASSIGN_OR_RETURN(l.plans, All<v1::Plan>([&](int n, const std::string& t) {
                           return s_->ListPlanSummaries(n, t);
                         }));
    for (v1::Plan& p : l.plans) {  // plans to run again need everything
      if (p.state() == v1::Plan::PENDING || p.state() == v1::Plan::RUNNING) {
        HAP_ASSIGN_OR_RETURN(p, s_->GetPlan(p.name()));
      }
    }
    HAP_ASSIGN_OR_RETURN(l.deployments, All<v1::Deployment>([&](int n, const std::string& t) {
                           return s_->ListDeployments(n, t);
                         }));
    for (const auto& d : l.deployments) {
      HAP_RETURN_IF_ERROR(LoadStepMetrics(d.name(), &l.metrics));
    }
    HAP_ASSIGN_OR_RETURN(l.jobs, All<v1::Job>([&](int n, const std::string& t) {
                           return s_->ListJobs(n, t);
                         }));
    return l;
  }
  // Every step metric of deployment `name`, in step order. Reads in pages of
  // kMaxStepMetricsLimit; a full page may end inside a step, so the next page
  // starts at that step again. A deployment that never reported a step (one
  // deployed to an unreachable executor) has no metrics at all.
  absl::Status LoadStepMetrics(const std::string& name, std::vector<v1::StepMetric>* out) {
    int64_t from = 0;
    while (true) {
      HAP_ASSIGN_OR_RETURN(std::vector<v1::StepMetric> batch,
                           s_->ListStepMetrics(name, from, store::kMaxStepMetricsLimit));
      if (batch.empty()) return absl::OkStatus();
      const bool last = static_cast<int>(batch.size()) < store::kMaxStepMetricsLimit;
      int64_t cut = last ? batch.back().step() + 1 : batch.back().step();
      // A full page of one single step cannot be split: keep it whole.
      if (cut <= from) cut = batch.back().step() + 1;
      for (auto& m : batch) {
        if (m.step() < cut) out->push_back(std::move(m));
      }
      if (last) return absl::OkStatus();
      from = cut;
    }
  }

  absl::StatusOr<v1::Plan> LoadPlan(const std::string& name) override {
    return s_->GetPlan(name);
  }
  absl::Status SaveNode(const v1::Node& n) override { return s_->UpsertNode(n); }
  absl::Status DeleteNode(const std::string& name) override { return s_->DeleteNode(name); }
  absl::Status SavePlan(const v1::Plan& p) override { return s_->PutPlan(p, ""); }
  absl::Status DeletePlan(const std::string& name) override { return s_->DeletePlan(name); }
  absl::Status SaveDeployment(const v1::Deployment& d) override { return s_->PutDeployment(d); }
  absl::Status SaveJob(const v1::Job& j) override { return s_->PutJob(j); }
  absl::Status AppendStepMetrics(const std::vector<v1::StepMetric>& ms) override {
    std::map<std::string, std::vector<v1::StepMetric>> by;
    for (const auto& m : ms) by[m.deployment()].push_back(m);
    for (const auto& [d, list] : by) HAP_RETURN_IF_ERROR(s_->AppendStepMetrics(d, list));
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<store::StateStore> s_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateBackend>> OpenSqliteBackend(const std::string& path) {
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<store::StateStore> s, store::OpenSqliteStore(path));
  return std::unique_ptr<StateBackend>(new StoreBackend(std::move(s)));
}

}  // namespace hap::service
