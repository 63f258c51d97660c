// HAP_RETURN_IF_ERROR / HAP_ASSIGN_OR_RETURN: the semantics of Abseil's newer
// macros, which our Debian Abseil (20220623) predates.
#ifndef HAP_COMMON_STATUS_MACROS_H_
#define HAP_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define HAP_STATUS_CONCAT_INNER_(a, b) a##b
#define HAP_STATUS_CONCAT_(a, b) HAP_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// when it is not OK.
#define HAP_RETURN_IF_ERROR(expr)                        \
  do {                                                   \
    ::absl::Status hap_status_ = (expr);                 \
    if (!hap_status_.ok()) return hap_status_;           \
  } while (0)

// `HAP_ASSIGN_OR_RETURN(auto x, F());` evaluates F() (an absl::StatusOr<T>);
// on error returns its status, otherwise moves the value into `x`.
#define HAP_ASSIGN_OR_RETURN(lhs, expr) \
  HAP_ASSIGN_OR_RETURN_IMPL_(HAP_STATUS_CONCAT_(hap_statusor_, __LINE__), lhs, expr)

#define HAP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

// Prefixes a non-OK status's message with context, keeping its code and
// payloads.
namespace hap {
inline absl::Status Annotate(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(context, ": ", s.message()));
  // Payloads say what a code cannot (executor/comm's lost peer): kept.
  s.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}
}  // namespace hap

#endif  // HAP_COMMON_STATUS_MACROS_H_
