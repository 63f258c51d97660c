// The planner daemon's state backend: the SQLite StateStore
// (planner/service/store) behind the core's PlannerStateSink, plus loading
// everything back at start.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/service/planner_server.h"
#include "planner/service/store/sqlite_store.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

// A record the store cannot read (DataLoss, naming it) is not loaded: the
// planner starts with the rest, and the log says which and why. Each start
// says so again until the record is written anew or deleted.
void NotLoaded(const absl::Status& damaged) {
  std::cerr << "hap-planner: a stored record was not loaded: " << damaged.message() << "\n";
}

// Every readable item of a paged list.
template <typename T, typename Fn>
absl::StatusOr<std::vector<T>> All(Fn&& list) {
  std::vector<T> out;
  std::string token;
  do {
    HAP_ASSIGN_OR_RETURN(auto page, list(store::kMaxPageSize, token));
    for (auto& x : page.items) out.push_back(std::move(x));
    for (const absl::Status& damaged : page.damaged) NotLoaded(damaged);
    token = page.next_page_token;
  } while (!token.empty());
  return out;
}

// One planner a database: two would both drive its deployments and jobs and
// overwrite each other's records. The lock is flock(2) on the database file
// itself, held while the backend is open and dropped by the kernel when the
// process dies (also by SIGKILL). SQLite's own locks are fcntl(2) byte
// ranges, which flock does not touch; and since closing any descriptor of
// the file drops those, this one is closed only after the store (see
// StoreBackend's members).
class DatabaseLock {
 public:
  static absl::StatusOr<std::unique_ptr<DatabaseLock>> Acquire(const std::string& path) {
    int fd = open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("database '", path, "' cannot be opened: ", std::strerror(errno)));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      close(fd);
      if (err == EWOULDBLOCK) {
        return absl::FailedPreconditionError(absl::StrCat(
            "database '", path,
            "' is in use by another planner (a process holds its lock); two planners must not "
            "serve one database: stop the other or give this one another file"));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("database '", path, "' cannot be locked: ", std::strerror(err)));
    }
    return std::unique_ptr<DatabaseLock>(new DatabaseLock(fd));
  }
  ~DatabaseLock() { close(fd_); }  // drops the lock
  DatabaseLock(const DatabaseLock&) = delete;
  DatabaseLock& operator=(const DatabaseLock&) = delete;

 private:
  explicit DatabaseLock(int fd) : fd_(fd) {}
  const int fd_;
};

class StoreBackend : public StateBackend {
 public:
  StoreBackend(std::unique_ptr<DatabaseLock> lock, std::unique_ptr<store::StateStore> s)
      : lock_(std::move(lock)), s_(std::move(s)) {}

  absl::StatusOr<Loaded> Load(size_t max_metrics_per_deployment) override {
    Loaded l;
    HAP_ASSIGN_OR_RETURN(l.nodes, All<v1::Node>([&](int n, const std::string& t) {
                           return s_->ListNodes(n, t);
                         }));
    HAP_ASSIGN_OR_RETURN(
        std::vector<v1::Plan> plans,
        All<v1::Plan>([&](int n, const std::string& t) { return s_->ListPlanSummaries(n, t); }));
    for (v1::Plan& p : plans) {  // plans to run again need everything
      if (p.state() == v1::Plan::PENDING || p.state() == v1::Plan::RUNNING) {
        absl::StatusOr<v1::Plan> whole = s_->GetPlan(p.name());
        if (absl::IsDataLoss(whole.status())) {
          NotLoaded(whole.status());
          continue;
        }
        HAP_ASSIGN_OR_RETURN(p, std::move(whole));
      }
      l.plans.push_back(std::move(p));
    }
    HAP_ASSIGN_OR_RETURN(l.deployments, All<v1::Deployment>([&](int n, const std::string& t) {
                           return s_->ListDeployments(n, t);
                         }));
    for (const auto& d : l.deployments) {
      // A deployment whose metrics cannot all be read loads without them.
      std::vector<v1::StepMetric> metrics;
      absl::Status st = LoadStepMetrics(d.name(), 0, max_metrics_per_deployment, &metrics);
      // Past what is kept, only the latest steps (the recent statistics).
      const int64_t read_to = metrics.empty() ? 0 : metrics.back().step() + 1;
      // The record's steps_completed is as of its last state change (a
      // RUNNING one's says 0): the last step is read from the metrics.
      if (st.ok() && metrics.size() >= max_metrics_per_deployment) {
        absl::StatusOr<int64_t> last = s_->LastStepMetricStep(d.name());
        st = last.status();
        if (st.ok()) {
          // Every rank's latest steps, a rank behind the others too (as
          // the deployment manager keeps them saved).
          st = LoadStepMetrics(
              d.name(), std::max(read_to, *last + 1 - kRecentStepsPerRank - kMaxRankLagSteps),
              std::numeric_limits<size_t>::max(), &metrics);
        }
      }
      if (absl::IsDataLoss(st)) {
        NotLoaded(absl::DataLossError(absl::StrCat("the step metrics of '", d.name(),
                                                   "' (none of them is loaded): ", st.message())));
        continue;
      }
      HAP_RETURN_IF_ERROR(st);
      for (auto& m : metrics) l.metrics.push_back(std::move(m));
    }
    HAP_ASSIGN_OR_RETURN(l.jobs, All<v1::Job>([&](int n, const std::string& t) {
                           return s_->ListJobs(n, t);
                         }));
    return l;
  }
  // The step metrics of deployment `name` from step `from`, in step order,
  // whole steps until at least `at_least` are read (or all are). Reads in
  // pages of kMaxStepMetricsLimit; a full page may end inside a step, so the
  // next page starts at that step again. A deployment that never reported a
  // step (one deployed to an unreachable executor) has no metrics at all.
  absl::Status LoadStepMetrics(const std::string& name, int64_t from, size_t at_least,
                               std::vector<v1::StepMetric>* out) {
    const size_t start = out->size();
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
      if (last || out->size() - start >= at_least) return absl::OkStatus();
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
  absl::Status DeleteDeployment(const std::string& name) override {
    return s_->DeleteDeployment(name);
  }
  absl::StatusOr<int64_t> LastDeploymentGeneration(const std::string& plan) override {
    return s_->LastDeploymentGeneration(plan);
  }
  absl::Status SaveJob(const v1::Job& j) override { return s_->PutJob(j); }
  absl::Status DeleteJob(const std::string& name) override { return s_->DeleteJob(name); }
  absl::Status AppendStepMetrics(const std::vector<v1::StepMetric>& ms) override {
    std::map<std::string, std::vector<v1::StepMetric>> by;
    for (const auto& m : ms) by[m.deployment()].push_back(m);
    for (const auto& [d, list] : by) HAP_RETURN_IF_ERROR(s_->AppendStepMetrics(d, list));
    return absl::OkStatus();
  }
  absl::Status PruneStepMetrics(const std::string& deployment, int64_t from_step,
                                int64_t to_step) override {
    return s_->DeleteStepMetrics(deployment, from_step, to_step);
  }

 private:
  std::unique_ptr<DatabaseLock> lock_;    // released after s_ is closed
  std::unique_ptr<store::StateStore> s_;  // (members are destroyed in reverse)
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateBackend>> OpenSqliteBackend(const std::string& path) {
  std::unique_ptr<DatabaseLock> lock;
  if (path != ":memory:") {
    HAP_ASSIGN_OR_RETURN(lock, DatabaseLock::Acquire(path));
  }
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<store::StateStore> s, store::OpenSqliteStore(path));
  return std::unique_ptr<StateBackend>(new StoreBackend(std::move(lock), std::move(s)));
}

}  // namespace hap::service
