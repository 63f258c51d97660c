// What the StateStore implementations share, so that they keep one
// contract: name checks, NotFound messages, list order and page tokens.
// Internal to planner/service/store.
#ifndef HAP_PLANNER_SERVICE_STORE_STORE_INTERNAL_H_
#define HAP_PLANNER_SERVICE_STORE_STORE_INTERNAL_H_

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/timestamp.pb.h"
#include "planner/service/store/state_store.h"

namespace hap::service::store::internal {

// Which list a page token belongs to; a token of one list is refused by
// another.
enum class ListKind { kNodes, kPlans, kDeployments, kJobs };
absl::string_view ListKindName(ListKind kind);  // "nodes", "plans", ...

// A position in a list: rows are ordered by (seconds, nanos, name) —
// create_time for plans and deployments, zero for nodes (so name order).
struct ListCursor {
  int64_t seconds = 0;
  int32_t nanos = 0;
  std::string name;

  // Before every row: names are never empty.
  static ListCursor First() {
    return {std::numeric_limits<int64_t>::min(), std::numeric_limits<int32_t>::min(), ""};
  }
  friend bool operator<(const ListCursor& a, const ListCursor& b) {
    return std::tie(a.seconds, a.nanos, a.name) < std::tie(b.seconds, b.nanos, b.name);
  }
  friend bool operator==(const ListCursor& a, const ListCursor& b) {
    return std::tie(a.seconds, a.nanos, a.name) == std::tie(b.seconds, b.nanos, b.name);
  }
};

ListCursor CursorOf(const hap::v1::Node& node);
ListCursor CursorOf(const hap::v1::Plan& plan);
ListCursor CursorOf(const hap::v1::Deployment& deployment);
ListCursor CursorOf(const hap::v1::Job& job);

// A validated list request: return up to `page_size` rows after `after`.
struct PageRequest {
  int page_size = kDefaultPageSize;
  ListCursor after = ListCursor::First();
};

// InvalidArgument for a negative page size or a token that is not one
// EncodePageToken made for `kind`.
absl::StatusOr<PageRequest> ParsePageRequest(ListKind kind, int page_size,
                                             const std::string& page_token);
std::string EncodePageToken(ListKind kind, const ListCursor& last);

// Turns the rows read for `request` — in list order, at most
// page_size + 1 of them, the extra one telling that more follow — into a
// page.
template <typename T>
Page<T> FinishPage(ListKind kind, const PageRequest& request, std::vector<T> rows) {
  Page<T> page;
  if (rows.size() > static_cast<size_t>(request.page_size)) {
    rows.resize(request.page_size);
    page.next_page_token = EncodePageToken(kind, CursorOf(rows.back()));
  }
  page.items = std::move(rows);
  return page;
}

// InvalidArgument "<what> name is empty".
absl::Status CheckName(absl::string_view what, const std::string& name);
// InvalidArgument "plan cache key is empty".
absl::Status CheckCacheKey(const std::string& cache_key);
// NotFound "<what> '<name>' not found".
absl::Status NotFoundError(absl::string_view what, const std::string& name);

// Checks the arguments of AppendStepMetrics and returns the metrics with
// their deployment filled in.
absl::StatusOr<std::vector<hap::v1::StepMetric>> PrepareStepMetrics(
    const std::string& deployment, const std::vector<hap::v1::StepMetric>& metrics);
// Checks the arguments of ListStepMetrics and returns the limit to use.
absl::StatusOr<int> StepMetricsLimit(const std::string& deployment, int limit);

}  // namespace hap::service::store::internal

#endif  // HAP_PLANNER_SERVICE_STORE_STORE_INTERNAL_H_
