// A pipeline plan as hap.v1.Plan (plan.proto Plan.pipeline): the model at
// the global batch, the cluster, the options, and per stage its op range,
// device group, program (instructions at the microbatch size), ratios,
// boundary tensors and forms, predicted times and memory; rank_programs
// holds each device's stage program (planner/lower LowerStage, at the
// microbatch size), which executor/train/pipeline.h runs. program and
// ratios stay empty.
#ifndef HAP_PLANNER_PIPELINE_PIPELINE_PLAN_H_
#define HAP_PLANNER_PIPELINE_PIPELINE_PLAN_H_

#include "absl/status/statusor.h"
#include "hap/v1/plan.pb.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph.h"
#include "planner/pipeline/pipeline.h"

namespace hap::pipeline {

// `g` is the graph planned (global batch); `p` must be pipelined
// (InvalidArgument otherwise).
absl::StatusOr<hap::v1::Plan> BuildPipelinePlan(const graph::Graph& g,
                                                const hap::v1::Cluster& cluster_profile,
                                                const cost::ClusterModel& cluster,
                                                const PipelinePlan& p,
                                                const hap::v1::PlanOptions& options);

// PlanOptions.pipeline* as PipelineOptions (mode, stages, microbatches);
// InvalidArgument for an unknown mode, PIPELINE_STAGES below 1 or negative
// microbatches.
absl::StatusOr<PipelineOptions> FromProto(const hap::v1::PlanOptions& options);

}  // namespace hap::pipeline

#endif  // HAP_PLANNER_PIPELINE_PIPELINE_PLAN_H_
