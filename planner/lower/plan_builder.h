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
#include "planner/lower/plan_file.h"  // CheckPlanForRank, hashes, format version
#include "planner/synth/planner.h"

namespace hap::lower {

// Lowers `result` for the cluster's devices (rank order = cluster order)
// and fills every field but name/uid/timestamps. `options` carries the
// optimizer and the seed. Errors: those of Lower.
// A form as plan.proto writes it.
hap::v1::TensorForm FormOf(synth::Form f);

// Appends `p`'s steps as instructions (sources, form changes, computes),
// each with its predicted seconds at `ratios`. BuildPlan uses it for the
// plan's program; planner/pipeline for each stage's.
void AddInstructions(const graph::Graph& g, const synth::Program& p,
                     const std::vector<double>& ratios, hap::v1::SynthesizedProgram* out);

absl::StatusOr<hap::v1::Plan> BuildPlan(const graph::Graph& g,
                                        const hap::v1::Cluster& cluster_profile,
                                        const cost::ClusterModel& cluster,
                                        const synth::PlanResult& result,
                                        const hap::v1::PlanOptions& options);

}  // namespace hap::lower

#endif  // HAP_PLANNER_LOWER_PLAN_BUILDER_H_
