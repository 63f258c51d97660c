// StateStore: the planner service's durable state — nodes, plans (with the
// plan-cache key stored beside each), deployments and their step metrics,
// elastic jobs —
// so that a planner restarted (even after SIGKILL) finds them again.
// Rendezvous keys are ephemeral and are not stored here.
//
// Two implementations: OpenSqliteStore() (sqlite_store.h), the one the
// daemon uses, and NewInMemoryStore() (memory_store.h), a fake for service
// tests. Both pass the same contract test (state_store_test.cc).
//
// Contract, common to every method:
//   - InvalidArgument for an empty name (or key), a negative page size or
//     limit, or a page token this store did not hand out for that list.
//   - NotFound, naming the resource ("plan 'plans/x' not found"), for a
//     missing one.
//   - Other codes come from the backend (e.g. DataLoss for a corrupt
//     database file, Unavailable for a locked one); the message says which
//     store and what it was doing.
//   - Put/Upsert replace the whole stored message (the last write wins).
//   - Writes are atomic: after an error nothing of that call is stored.
//   - A stored record that cannot be read (its bytes do not parse, or its
//     message names another record than the one it is stored as) is
//     DataLoss, naming it, for Get; lists leave it out and return that
//     status in the page's `damaged`, so that the rest can still be read.
//
// Lists are pages in a stable order (nodes by name; plans, deployments and
// jobs by create_time, then name). page_size 0 means kDefaultPageSize; larger sizes
// are capped at kMaxPageSize. A page token is opaque: pass next_page_token
// back unchanged; it stays valid across writes and restarts (it records
// where the last page ended, not an offset), and an empty one means the
// list ended.
//
// Thread-safety: every implementation is safe to call from many threads.
#ifndef HAP_PLANNER_SERVICE_STORE_STATE_STORE_H_
#define HAP_PLANNER_SERVICE_STORE_STATE_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::service::store {

inline constexpr int kDefaultPageSize = 50;
inline constexpr int kMaxPageSize = 1000;
// ListStepMetrics returns at most this many metrics per call.
inline constexpr int kMaxStepMetricsLimit = 10000;

// One page of a list.
template <typename T>
struct Page {
  std::vector<T> items;
  std::string next_page_token;  // empty: this was the last page
  // DataLoss, naming the record and why, for each record of this page's
  // span that could not be read and is not in `items`.
  std::vector<absl::Status> damaged;
};

// A plan without its rank programs, graph and program: what lists and a
// starting planner need.
inline hap::v1::Plan PlanSummary(const hap::v1::Plan& plan) {
  hap::v1::Plan s = plan;
  s.clear_rank_programs();
  s.clear_graph();
  s.clear_program();
  return s;
}

class StateStore {
 public:
  virtual ~StateStore() = default;

  // --- Nodes, keyed by node.name(). -----------------------------------
  // Inserts the node or replaces the one of the same name (an agent that
  // registers again is not a second node).
  virtual absl::Status UpsertNode(const hap::v1::Node& node) = 0;
  virtual absl::StatusOr<hap::v1::Node> GetNode(const std::string& name) = 0;
  // In name order (bytewise).
  virtual absl::StatusOr<Page<hap::v1::Node>> ListNodes(int page_size,
                                                        const std::string& page_token) = 0;
  virtual absl::Status DeleteNode(const std::string& name) = 0;

  // --- Plans, keyed by plan.name() ("plans/{id}"). ----------------------
  // Inserts or replaces the plan and sets its cache key (a string the
  // service computes from graph hash, cluster hash and options) to
  // `cache_key`; "" stores none. Pass the key again with every update of
  // the plan: the key is replaced along with the plan.
  virtual absl::Status PutPlan(const hap::v1::Plan& plan, const std::string& cache_key) = 0;
  virtual absl::StatusOr<hap::v1::Plan> GetPlan(const std::string& name) = 0;
  // By create_time, then name.
  virtual absl::StatusOr<Page<hap::v1::Plan>> ListPlans(int page_size,
                                                        const std::string& page_token) = 0;
  virtual absl::Status DeletePlan(const std::string& name) = 0;
  // ListPlans' pages of PlanSummary(plan): what a starting planner reads
  // (a plan's rank programs, graph and program are most of its size; they
  // are read by GetPlan when asked for). This default summarises ListPlans.
  virtual absl::StatusOr<Page<hap::v1::Plan>> ListPlanSummaries(int page_size,
                                                                const std::string& page_token) {
    absl::StatusOr<Page<hap::v1::Plan>> page = ListPlans(page_size, page_token);
    if (page.ok()) {
      for (hap::v1::Plan& p : page->items) p = PlanSummary(p);
    }
    return page;
  }
  // The plan stored with `cache_key`; where several are, the latest by
  // (create_time, name). NotFound when none is.
  virtual absl::StatusOr<hap::v1::Plan> FindPlanByCacheKey(const std::string& cache_key) = 0;

  // --- Deployments, keyed by deployment.name() ("deployments/{id}"). ----
  virtual absl::Status PutDeployment(const hap::v1::Deployment& deployment) = 0;
  virtual absl::StatusOr<hap::v1::Deployment> GetDeployment(const std::string& name) = 0;
  // By create_time, then name.
  virtual absl::StatusOr<Page<hap::v1::Deployment>> ListDeployments(
      int page_size, const std::string& page_token) = 0;
  // Deletes the deployment and its step metrics.
  virtual absl::Status DeleteDeployment(const std::string& name) = 0;
  // The highest generation of a deployment of `plan` ever put, deleted
  // ones included; 0 when none was. A restarted planner goes on from it, so
  // no deployment name is used twice.
  virtual absl::StatusOr<int64_t> LastDeploymentGeneration(const std::string& plan) = 0;

  // --- Step metrics of a stored deployment, keyed by (step, rank). -------
  // Stores `metrics` (all or none). A metric's `deployment` must be empty
  // (it is filled in) or equal `deployment`; a metric reported again for
  // the same (step, rank) replaces the earlier one. NotFound for an
  // unknown deployment.
  virtual absl::Status AppendStepMetrics(const std::string& deployment,
                                         const std::vector<hap::v1::StepMetric>& metrics) = 0;
  // The deployment's metrics with step >= from_step, ordered by (step,
  // rank), at most `limit` (1..kMaxStepMetricsLimit; larger is capped).
  // To read on, call again from the last step returned and skip the
  // (step, rank) pairs already seen. NotFound for an unknown deployment.
  virtual absl::StatusOr<std::vector<hap::v1::StepMetric>> ListStepMetrics(
      const std::string& deployment, int64_t from_step, int limit) = 0;
  // The highest step of the deployment's metrics, -1 when it has none
  // (an index seek: what a restart reads the latest steps from, since the
  // deployment's record is not saved with every metric). NotFound for an
  // unknown deployment.
  virtual absl::StatusOr<int64_t> LastStepMetricStep(const std::string& deployment) = 0;
  // Deletes the deployment's metrics with from_step <= step < to_step (an
  // index range). NotFound for an unknown deployment.
  virtual absl::Status DeleteStepMetrics(const std::string& deployment, int64_t from_step,
                                         int64_t to_step) = 0;

  // --- Jobs, keyed by job.name() ("jobs/{id}"). ---------------------------
  virtual absl::Status PutJob(const hap::v1::Job& job) = 0;
  virtual absl::StatusOr<hap::v1::Job> GetJob(const std::string& name) = 0;
  // By create_time, then name.
  virtual absl::StatusOr<Page<hap::v1::Job>> ListJobs(int page_size,
                                                      const std::string& page_token) = 0;
  virtual absl::Status DeleteJob(const std::string& name) = 0;
};

}  // namespace hap::service::store

#endif  // HAP_PLANNER_SERVICE_STORE_STATE_STORE_H_
