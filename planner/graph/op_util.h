// Helpers shared by the op family files (shape rules). Internal to
// planner/graph.
#ifndef HAP_PLANNER_GRAPH_OP_UTIL_H_
#define HAP_PLANNER_GRAPH_OP_UTIL_H_

#include "absl/status/statusor.h"
#include "planner/graph/op_registry.h"
#include "planner/graph/types.h"

namespace hap::graph::internal {

// Maps a possibly negative axis into [0, rank).
absl::StatusOr<int> NormalizeAxis(int64_t axis, int rank,
                                  absl::string_view what);
// Numpy-style broadcast of two shapes.
absl::StatusOr<Shape> BroadcastShapes(const Shape& a, const Shape& b);

absl::Status ExpectRank(const OpCall& c, int i, int rank);
absl::Status ExpectMinRank(const OpCall& c, int i, int rank);
absl::Status ExpectFloating(const OpCall& c, int i);
absl::Status ExpectInteger(const OpCall& c, int i);
absl::Status ExpectSameDtype(const OpCall& c, int i, int j);

// A dimension of input i; `dim` may be negative.
int64_t Dim(const OpCall& c, int i, int dim);

// Registration functions, one per op family file.
void RegisterElementwiseOps(OpRegistry& r);
void RegisterLinearOps(OpRegistry& r);
void RegisterNormalizationOps(OpRegistry& r);
void RegisterShapeOps(OpRegistry& r);
void RegisterReductionOps(OpRegistry& r);
void RegisterLossOps(OpRegistry& r);
void RegisterConvolutionOps(OpRegistry& r);
void RegisterMoeOps(OpRegistry& r);
void RegisterLstmOps(OpRegistry& r);

}  // namespace hap::graph::internal

#endif  // HAP_PLANNER_GRAPH_OP_UTIL_H_
