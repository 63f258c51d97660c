#include "executor/daemon/test_plans.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_builder.h"
#include "planner/pipeline/pipeline.h"
#include "planner/pipeline/pipeline_plan.h"
#include "planner/synth/planner.h"

namespace hap::executor::testing {

namespace v1 = ::hap::v1;

absl::StatusOr<v1::Plan> MakeMlpPlan(int world, bool overlap) {
  std::map<std::string, double> p = {{"layers", 3},  {"hidden", 24},
                                     {"input", 12},  {"classes", 5},
                                     {"batch", 6.0 * world + 1}};
  HAP_ASSIGN_OR_RETURN(graph::Graph g, graph::BuildZooModel("mlp", p));
  v1::Cluster cluster;
  v1::Node* node = cluster.add_nodes();
  node->set_name("node0");
  node->set_state(v1::Node::READY);
  for (int i = 0; i < world; ++i) {
    v1::Device* d = node->add_devices();
    d->set_id(absl::StrCat("node0/cpu", i));
    d->set_kind(v1::CPU);
    d->set_node("node0");
    d->set_local_index(i);
    v1::DtypeThroughput* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(1e9 * (1 + i % 2));
    d->set_memory_bytes(int64_t{1} << 32);
  }
  cluster.mutable_defaults()->set_intra_node_bandwidth_bytes_per_second(1e10);
  cluster.mutable_defaults()->set_inter_node_bandwidth_bytes_per_second(1e9);
  HAP_ASSIGN_OR_RETURN(cost::ClusterModel model, cost::ClusterModel::FromProto(cluster));
  synth::PlanOptions po;
  po.max_seconds = 20;
  po.overlap_communication = overlap;
  HAP_ASSIGN_OR_RETURN(synth::PlanResult r, synth::PlanModel(g, model, po));
  v1::PlanOptions options;
  options.mutable_optimizer()->set_kind(v1::OptimizerConfig::SGD);
  options.mutable_optimizer()->set_learning_rate(0.1);
  options.mutable_optimizer()->set_momentum(0.9);
  options.set_seed(7);
  options.set_overlap_communication(overlap);
  return lower::BuildPlan(g, cluster, model, r, options);
}

absl::StatusOr<v1::Plan> MakeMlpTwoNodePlan(bool pipelined) {
  std::map<std::string, double> p = {
      {"layers", 4}, {"hidden", 24}, {"input", 12}, {"classes", 5}, {"batch", 16}};
  HAP_ASSIGN_OR_RETURN(graph::Graph g, graph::BuildZooModel("mlp", p));
  v1::Cluster cluster;
  for (int n = 0; n < 2; ++n) {
    v1::Node* node = cluster.add_nodes();
    node->set_name(absl::StrCat("node", n));
    node->set_state(v1::Node::READY);
    for (int i = 0; i < 2; ++i) {
      v1::Device* d = node->add_devices();
      d->set_id(absl::StrCat("node", n, "/cpu", i));
      d->set_kind(v1::CPU);
      d->set_node(node->name());
      d->set_local_index(i);
      v1::DtypeThroughput* f = d->add_flops();
      f->set_dtype(v1::FLOAT32);
      f->set_flops(1e9 * (1 + n));
      d->set_memory_bytes(int64_t{1} << 32);
    }
  }
  cluster.mutable_defaults()->set_intra_node_bandwidth_bytes_per_second(1e10);
  cluster.mutable_defaults()->set_inter_node_bandwidth_bytes_per_second(1e8);
  HAP_ASSIGN_OR_RETURN(cost::ClusterModel model, cost::ClusterModel::FromProto(cluster));
  v1::PlanOptions options;
  options.mutable_optimizer()->set_kind(v1::OptimizerConfig::SGD);
  options.mutable_optimizer()->set_learning_rate(0.1);
  options.mutable_optimizer()->set_momentum(0.9);
  options.set_seed(7);
  if (!pipelined) {
    synth::PlanOptions po;
    po.max_seconds = 20;
    HAP_ASSIGN_OR_RETURN(synth::PlanResult r, synth::PlanModel(g, model, po));
    return lower::BuildPlan(g, cluster, model, r, options);
  }
  pipeline::PipelineOptions o;
  o.mode = pipeline::Mode::kStages;
  o.stages = 2;
  o.microbatches = 4;
  o.threads = 1;
  o.plan_spmd = false;
  o.stage_options.max_seconds = 20;
  HAP_ASSIGN_OR_RETURN(pipeline::PipelinePlan planned, pipeline::PlanPipeline(g, model, o));
  options.set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
  options.set_pipeline_stages(2);
  options.set_pipeline_microbatches(4);
  return pipeline::BuildPipelinePlan(g, cluster, model, planned, options);
}

}  // namespace hap::executor::testing
