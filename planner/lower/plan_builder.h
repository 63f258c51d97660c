// A whole plan (hap.v1.Plan, plan.proto): the model, the cluster profile,
// the synthesized program as instructions, its ratios, the per-rank
// programs and the prediction, versioned and hashed. This is the file
// `hapctl plan --save-plan` writes and an executor loads.
#ifndef HAP_PLANNER_LOWER_PLAN_BUILDER_H_
#define HAP_PLANNER_LOWER_PLAN_BUILDER_H_

#include <string>

#include "absl/status/statusor.h"
#include "hap/v1/plan.pb.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph.h"
#include "planner/synth/planner.h"

namespace hap::lower {

// The format_version this code writes and executors accept.
inline constexpr int kPlanFormatVersion = 1;

// Lowers `result` for the cluster's devices (rank order = cluster order)
// and fills every field but name/uid/timestamps. `options` carries the
// optimizer and the seed. Errors: those of Lower.
absl::StatusOr<hap::v1::Plan> BuildPlan(const graph::Graph& g,
                                        const hap::v1::Cluster& cluster_profile,
                                        const cost::ClusterModel& cluster,
                                        const synth::PlanResult& result,
                                        const hap::v1::PlanOptions& options);

// Checks a plan an executor is about to run as rank `rank` of `world`:
// format version, rank programs for that world, content hash.
// InvalidArgument naming what does not fit.
absl::Status CheckPlanForRank(const hap::v1::Plan& plan, int rank, int world);

// sha256 (hex) of the deterministic serialization of a message.
std::string Sha256Hex(const google::protobuf::Message& m);
// The hash over program, ratios and rank programs (Plan.content_hash).
std::string ContentHash(const hap::v1::Plan& plan);

}  // namespace hap::lower

#endif  // HAP_PLANNER_LOWER_PLAN_BUILDER_H_
