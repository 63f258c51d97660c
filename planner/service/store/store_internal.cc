#include "planner/service/store/store_internal.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hap::service::store::internal {
namespace {

// A page token is web-safe base64 of
//   "hapstore1:<kind>:<seconds>:<nanos>:<name>#<16 hex digits>"
// where the hex digits are a FNV-1a hash of everything before '#'. The hash
// is no secret: it only makes a mangled or made-up token fail loudly
// instead of silently listing from some other place.
constexpr absl::string_view kTokenMagic = "hapstore1";

uint64_t Fnv1a64(absl::string_view s) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

ListCursor CursorOf(const google::protobuf::Timestamp& t, const std::string& name) {
  return {t.seconds(), t.nanos(), name};
}

absl::Status BadToken(ListKind kind) {
  return absl::InvalidArgumentError(
      absl::StrCat("page_token is not one this store returned for listing ", ListKindName(kind),
                   " (pass next_page_token back unchanged, or \"\" for the first page)"));
}

}  // namespace

absl::string_view ListKindName(ListKind kind) {
  switch (kind) {
    case ListKind::kNodes:
      return "nodes";
    case ListKind::kPlans:
      return "plans";
    case ListKind::kDeployments:
      return "deployments";
    case ListKind::kJobs:
      return "jobs";
  }
  return "unknown";
}

ListCursor CursorOf(const hap::v1::Node& node) { return {0, 0, node.name()}; }
ListCursor CursorOf(const hap::v1::Plan& plan) { return CursorOf(plan.create_time(), plan.name()); }
ListCursor CursorOf(const hap::v1::Job& job) { return CursorOf(job.create_time(), job.name()); }
ListCursor CursorOf(const hap::v1::Deployment& deployment) {
  return CursorOf(deployment.create_time(), deployment.name());
}

std::string EncodePageToken(ListKind kind, const ListCursor& last) {
  std::string payload = absl::StrCat(kTokenMagic, ":", ListKindName(kind), ":", last.seconds, ":",
                                     last.nanos, ":", last.name);
  absl::StrAppend(&payload, "#", absl::Hex(Fnv1a64(payload), absl::kZeroPad16));
  return absl::WebSafeBase64Escape(payload);
}

absl::StatusOr<PageRequest> ParsePageRequest(ListKind kind, int page_size,
                                             const std::string& page_token) {
  if (page_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must not be negative, got ", page_size));
  }
  PageRequest request;
  request.page_size = page_size == 0 ? kDefaultPageSize : std::min(page_size, kMaxPageSize);
  if (page_token.empty()) return request;

  std::string raw;
  constexpr size_t kHashChars = 1 + 16;  // "#" and 16 hex digits
  if (!absl::WebSafeBase64Unescape(page_token, &raw) || raw.size() < kHashChars ||
      raw[raw.size() - kHashChars] != '#') {
    return BadToken(kind);
  }
  absl::string_view payload(raw.data(), raw.size() - kHashChars);
  uint64_t hash = 0;
  if (!absl::SimpleHexAtoi(absl::string_view(raw).substr(raw.size() - 16), &hash) ||
      hash != Fnv1a64(payload)) {
    return BadToken(kind);
  }
  // The name is last, so ':' inside it stays part of it.
  std::vector<absl::string_view> parts = absl::StrSplit(payload, absl::MaxSplits(':', 4));
  if (parts.size() != 5 || parts[0] != kTokenMagic || parts[1] != ListKindName(kind) ||
      !absl::SimpleAtoi(parts[2], &request.after.seconds) ||
      !absl::SimpleAtoi(parts[3], &request.after.nanos) || parts[4].empty()) {
    return BadToken(kind);
  }
  request.after.name = std::string(parts[4]);
  return request;
}

absl::Status CheckName(absl::string_view what, const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " name is empty"));
  return absl::OkStatus();
}

absl::Status CheckCacheKey(const std::string& cache_key) {
  if (cache_key.empty()) return absl::InvalidArgumentError("plan cache key is empty");
  return absl::OkStatus();
}

absl::Status NotFoundError(absl::string_view what, const std::string& name) {
  return absl::NotFoundError(absl::StrCat(what, " '", name, "' not found"));
}

absl::StatusOr<std::vector<hap::v1::StepMetric>> PrepareStepMetrics(
    const std::string& deployment, const std::vector<hap::v1::StepMetric>& metrics) {
  if (absl::Status s = CheckName("deployment", deployment); !s.ok()) return s;
  std::vector<hap::v1::StepMetric> prepared = metrics;
  for (size_t i = 0; i < prepared.size(); ++i) {
    hap::v1::StepMetric& m = prepared[i];
    if (m.deployment().empty()) {
      m.set_deployment(deployment);
    } else if (m.deployment() != deployment) {
      return absl::InvalidArgumentError(absl::StrCat("step metric ", i, " (step ", m.step(),
                                                     ", rank ", m.rank(), ") is for deployment '",
                                                     m.deployment(), "', not '", deployment, "'"));
    }
  }
  return prepared;
}

absl::StatusOr<int> StepMetricsLimit(const std::string& deployment, int limit) {
  if (absl::Status s = CheckName("deployment", deployment); !s.ok()) return s;
  if (limit <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step metrics limit must be positive, got ", limit));
  }
  return std::min(limit, kMaxStepMetricsLimit);
}

}  // namespace hap::service::store::internal
