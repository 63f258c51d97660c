#include "planner/service/store/memory_store.h"

#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "planner/service/store/store_internal.h"

namespace hap::service::store {
namespace {

namespace v1 = ::hap::v1;
using internal::CheckName;
using internal::CursorOf;
using internal::ListCursor;
using internal::ListKind;
using internal::NotFoundError;

// Rows by name, plus their list order.
template <typename Row>
class Table {
 public:
  Table(ListKind kind, const char* what) : kind_(kind), what_(what) {}

  absl::Status Put(Row row) {
    HAP_RETURN_IF_ERROR(CheckName(what_, row.name()));
    auto it = rows_.find(row.name());
    if (it != rows_.end()) order_.erase(CursorOf(it->second));
    order_.insert(CursorOf(row));
    std::string name = row.name();
    rows_.insert_or_assign(std::move(name), std::move(row));
    return absl::OkStatus();
  }

  absl::StatusOr<const Row*> Get(const std::string& name) const {
    HAP_RETURN_IF_ERROR(CheckName(what_, name));
    auto it = rows_.find(name);
    if (it == rows_.end()) return NotFoundError(what_, name);
    return &it->second;
  }

  absl::Status Delete(const std::string& name) {
    HAP_ASSIGN_OR_RETURN(const Row* row, Get(name));
    order_.erase(CursorOf(*row));
    rows_.erase(name);
    return absl::OkStatus();
  }

  absl::StatusOr<Page<Row>> List(int page_size, const std::string& page_token) const {
    HAP_ASSIGN_OR_RETURN(internal::PageRequest request,
                         internal::ParsePageRequest(kind_, page_size, page_token));
    std::vector<Row> rows;
    for (auto it = order_.upper_bound(request.after);
         it != order_.end() && rows.size() <= static_cast<size_t>(request.page_size); ++it) {
      rows.push_back(rows_.at(it->name));
    }
    return internal::FinishPage(kind_, request, std::move(rows));
  }

  const std::map<std::string, Row>& rows() const { return rows_; }

 private:
  ListKind kind_;
  const char* what_;
  std::map<std::string, Row> rows_;
  std::set<ListCursor> order_;
};

class InMemoryStore final : public StateStore {
 public:
  absl::Status UpsertNode(const v1::Node& node) override {
    absl::MutexLock lock(&mu_);
    return nodes_.Put(node);
  }
  absl::StatusOr<v1::Node> GetNode(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    HAP_ASSIGN_OR_RETURN(const v1::Node* node, nodes_.Get(name));
    return *node;
  }
  absl::StatusOr<Page<v1::Node>> ListNodes(int page_size, const std::string& page_token) override {
    absl::MutexLock lock(&mu_);
    return nodes_.List(page_size, page_token);
  }
  absl::Status DeleteNode(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    return nodes_.Delete(name);
  }

  absl::Status PutPlan(const v1::Plan& plan, const std::string& cache_key) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(plans_.Put(plan));
    if (cache_key.empty()) {
      cache_keys_.erase(plan.name());
    } else {
      cache_keys_[plan.name()] = cache_key;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<v1::Plan> GetPlan(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    HAP_ASSIGN_OR_RETURN(const v1::Plan* plan, plans_.Get(name));
    return *plan;
  }
  absl::StatusOr<Page<v1::Plan>> ListPlans(int page_size, const std::string& page_token) override {
    absl::MutexLock lock(&mu_);
    return plans_.List(page_size, page_token);
  }
  absl::Status DeletePlan(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(plans_.Delete(name));
    cache_keys_.erase(name);
    return absl::OkStatus();
  }
  absl::StatusOr<v1::Plan> FindPlanByCacheKey(const std::string& cache_key) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(internal::CheckCacheKey(cache_key));
    // A scan: this store is for tests.
    const v1::Plan* latest = nullptr;
    for (const auto& [name, key] : cache_keys_) {
      if (key != cache_key) continue;
      const v1::Plan& plan = plans_.rows().at(name);
      if (latest == nullptr || CursorOf(*latest) < CursorOf(plan)) latest = &plan;
    }
    if (latest == nullptr) return NotFoundError("plan with cache key", cache_key);
    return *latest;
  }

  absl::Status PutDeployment(const v1::Deployment& deployment) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(deployments_.Put(deployment));
    int64_t& last = generations_[deployment.plan()];
    last = std::max(last, deployment.generation());
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> LastDeploymentGeneration(const std::string& plan) override {
    HAP_RETURN_IF_ERROR(CheckName("plan", plan));
    absl::MutexLock lock(&mu_);
    auto it = generations_.find(plan);
    return it == generations_.end() ? 0 : it->second;
  }
  absl::StatusOr<v1::Deployment> GetDeployment(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    HAP_ASSIGN_OR_RETURN(const v1::Deployment* deployment, deployments_.Get(name));
    return *deployment;
  }
  absl::StatusOr<Page<v1::Deployment>> ListDeployments(int page_size,
                                                       const std::string& page_token) override {
    absl::MutexLock lock(&mu_);
    return deployments_.List(page_size, page_token);
  }
  absl::Status DeleteDeployment(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(deployments_.Delete(name));
    metrics_.erase(name);
    return absl::OkStatus();
  }

  absl::Status AppendStepMetrics(const std::string& deployment,
                                 const std::vector<v1::StepMetric>& metrics) override {
    HAP_ASSIGN_OR_RETURN(std::vector<v1::StepMetric> prepared,
                         internal::PrepareStepMetrics(deployment, metrics));
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(deployments_.Get(deployment).status());
    auto& rows = metrics_[deployment];
    for (v1::StepMetric& m : prepared) {
      rows.insert_or_assign(std::make_pair(m.step(), m.rank()), std::move(m));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<v1::StepMetric>> ListStepMetrics(const std::string& deployment,
                                                              int64_t from_step,
                                                              int limit) override {
    HAP_ASSIGN_OR_RETURN(limit, internal::StepMetricsLimit(deployment, limit));
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(deployments_.Get(deployment).status());
    std::vector<v1::StepMetric> out;
    auto rows = metrics_.find(deployment);
    if (rows == metrics_.end()) return out;
    for (auto it = rows->second.lower_bound({from_step, std::numeric_limits<int32_t>::min()});
         it != rows->second.end() && out.size() < static_cast<size_t>(limit); ++it) {
      out.push_back(it->second);
    }
    return out;
  }

  absl::StatusOr<int64_t> LastStepMetricStep(const std::string& deployment) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(deployments_.Get(deployment).status());
    auto rows = metrics_.find(deployment);
    if (rows == metrics_.end() || rows->second.empty()) return -1;
    return rows->second.rbegin()->first.first;
  }

  absl::Status DeleteStepMetrics(const std::string& deployment, int64_t from_step,
                                 int64_t to_step) override {
    absl::MutexLock lock(&mu_);
    HAP_RETURN_IF_ERROR(deployments_.Get(deployment).status());
    auto rows = metrics_.find(deployment);
    if (rows == metrics_.end() || from_step >= to_step) return absl::OkStatus();
    rows->second.erase(rows->second.lower_bound({from_step, std::numeric_limits<int32_t>::min()}),
                       rows->second.lower_bound({to_step, std::numeric_limits<int32_t>::min()}));
    return absl::OkStatus();
  }

  absl::Status PutJob(const v1::Job& job) override {
    absl::MutexLock lock(&mu_);
    return jobs_.Put(job);
  }
  absl::StatusOr<v1::Job> GetJob(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    HAP_ASSIGN_OR_RETURN(const v1::Job* job, jobs_.Get(name));
    return *job;
  }
  absl::StatusOr<Page<v1::Job>> ListJobs(int page_size, const std::string& page_token) override {
    absl::MutexLock lock(&mu_);
    return jobs_.List(page_size, page_token);
  }
  absl::Status DeleteJob(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    return jobs_.Delete(name);
  }

 private:
  absl::Mutex mu_;
  Table<v1::Node> nodes_ ABSL_GUARDED_BY(mu_){ListKind::kNodes, "node"};
  Table<v1::Plan> plans_ ABSL_GUARDED_BY(mu_){ListKind::kPlans, "plan"};
  std::map<std::string, std::string> cache_keys_ ABSL_GUARDED_BY(mu_);  // plan name -> key
  Table<v1::Deployment> deployments_ ABSL_GUARDED_BY(mu_){ListKind::kDeployments, "deployment"};
  Table<v1::Job> jobs_ ABSL_GUARDED_BY(mu_){ListKind::kJobs, "job"};
  // deployment name -> (step, rank) -> metric
  std::map<std::string, std::map<std::pair<int64_t, int32_t>, v1::StepMetric>> metrics_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> generations_ ABSL_GUARDED_BY(mu_);  // plan -> highest
};

}  // namespace

std::unique_ptr<StateStore> NewInMemoryStore() { return std::make_unique<InMemoryStore>(); }

}  // namespace hap::service::store
