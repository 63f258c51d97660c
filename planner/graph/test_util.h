// Test helpers for planner/graph: a StatusIs matcher (our gmock predates
// Abseil's status matchers) and a structural comparison of two graphs.
#ifndef HAP_PLANNER_GRAPH_TEST_UTIL_H_
#define HAP_PLANNER_GRAPH_TEST_UTIL_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"

namespace hap::graph::testing {

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

// Adds a gtest failure for every difference between two graphs, matched by
// name (ids and order may differ: see Graph::tensors()): tensors (types,
// kinds, producers, consumers, initialisers), ops (types, inputs, outputs,
// attrs, scopes), loss, metadata, parameter counts and FLOPs.
void ExpectSameGraph(const Graph& a, const Graph& b);

}  // namespace hap::graph::testing

#endif  // HAP_PLANNER_GRAPH_TEST_UTIL_H_
