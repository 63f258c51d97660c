// Test helpers for planner/graph: the status matchers (planner/util) and a
// structural comparison of two graphs.
#ifndef HAP_PLANNER_GRAPH_TEST_UTIL_H_
#define HAP_PLANNER_GRAPH_TEST_UTIL_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"

namespace hap::graph::testing {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;

// Adds a gtest failure for every difference between two graphs, matched by
// name (ids and order may differ: see Graph::tensors()): tensors (types,
// kinds, producers, consumers, initialisers), ops (types, inputs, outputs,
// attrs, scopes), loss, metadata, parameter counts and FLOPs.
void ExpectSameGraph(const Graph& a, const Graph& b);

}  // namespace hap::graph::testing

#endif  // HAP_PLANNER_GRAPH_TEST_UTIL_H_
