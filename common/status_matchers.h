// gmock matchers for absl::Status / absl::StatusOr<T> (our gmock predates
// Abseil's): StatusIs(code, message_matcher) and IsOk(). Tests only.
#ifndef HAP_COMMON_STATUS_MATCHERS_H_
#define HAP_COMMON_STATUS_MATCHERS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace hap::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

// Matches an absl::Status or absl::StatusOr<T> whose code is `code` and
// whose message matches `message_matcher`.
MATCHER_P2(StatusIs, code, message_matcher,
           std::string(negation ? "isn't" : "is") + " a status with code " +
               absl::StatusCodeToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "whose status is " << s;
  return s.code() == code &&
         ::testing::ExplainMatchResult(
             message_matcher, std::string(s.message()), result_listener);
}

// Matches an OK absl::Status or absl::StatusOr<T>.
MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "whose status is " << s;
  return s.ok();
}

}  // namespace hap::testing

#endif  // HAP_COMMON_STATUS_MATCHERS_H_
