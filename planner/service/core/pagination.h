// AIP-158 pagination over a sorted map, shared by the planner's List RPCs:
// page_size 0 means 50, at most 1000, negative is InvalidArgument; the
// token is the list's name and the last key of the previous page, web-safe
// base64, so that garbage and a token of another list are recognised
// (InvalidArgument).
#ifndef HAP_PLANNER_SERVICE_CORE_PAGINATION_H_
#define HAP_PLANNER_SERVICE_CORE_PAGINATION_H_

#include <algorithm>
#include <iterator>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace hap::service {

inline constexpr int kDefaultPageSize = 50;
inline constexpr int kMaxPageSize = 1000;
// A page ends once it holds this many bytes, with at least one item
// (records carry what clients sent: a job's graph, a node's labels; a
// plan's FULL view is megabytes).
inline constexpr size_t kMaxPageBytes = size_t{32} << 20;

// The token of the page of list `list` after key `last`.
inline std::string PageTokenAfter(absl::string_view list, absl::string_view last) {
  return absl::WebSafeBase64Escape(absl::StrCat(list, " after:", last));
}

// The key after which the page of `token` starts, if `token` is one of
// list `list`'s (PageTokenAfter); otherwise InvalidArgument.
inline absl::StatusOr<std::string> PageTokenKey(absl::string_view list, const std::string& token) {
  const std::string marker = absl::StrCat(list, " after:");
  std::string raw;
  if (!absl::WebSafeBase64Unescape(token, &raw) || raw.rfind(marker, 0) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token is not a token this server returned for the list of ", list,
                     " (pass next_page_token of the same list as is)"));
  }
  return raw.substr(marker.size());
}

// Calls emit(value) for each item of the page of list `list` ("plans",
// "nodes", ...); emit returns the bytes the item added to the answer, and
// the page ends early once they reach kMaxPageBytes. Returns
// next_page_token ("" after the last page).
template <typename Map, typename Fn>
absl::StatusOr<std::string> Paginate(const Map& m, int page_size, const std::string& token,
                                     absl::string_view list, const Fn& emit) {
  if (page_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must not be negative, got ", page_size));
  }
  if (page_size == 0) page_size = kDefaultPageSize;
  page_size = std::min(page_size, kMaxPageSize);
  auto it = m.begin();
  if (!token.empty()) {
    absl::StatusOr<std::string> after = PageTokenKey(list, token);
    if (!after.ok()) return after.status();
    it = m.upper_bound(*after);
  }
  int n = 0;
  size_t bytes = 0;
  for (; it != m.end() && n < page_size && bytes < kMaxPageBytes; ++it, ++n) {
    bytes += emit(it->second);
  }
  if (it == m.end()) return std::string();
  auto last = std::prev(it);
  return PageTokenAfter(list, last->first);
}

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_PAGINATION_H_
