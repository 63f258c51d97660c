#include "planner/pipeline/pipeline_plan.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/lower.h"
#include "planner/lower/plan_builder.h"
#include "planner/pipeline/layers.h"

namespace hap::pipeline {
namespace v1 = ::hap::v1;


absl::StatusOr<v1::Plan> BuildPipelinePlan(const graph::Graph& g,
                                           const v1::Cluster& cluster_profile,
                                           const cost::ClusterModel& cluster, const PipelinePlan& p,
                                           const v1::PlanOptions& options) {
  if (!p.pipelined() || p.microbatch_graph == nullptr) {
    return absl::InvalidArgumentError("the plan has no pipeline stages");
  }
  const graph::Graph& gm = *p.microbatch_graph;
  v1::Plan plan;
  plan.set_format_version(lower::kPlanFormatVersion);
  *plan.mutable_graph() = graph::ToProto(g);
  *plan.mutable_cluster() = cluster_profile;
  *plan.mutable_options() = options;
  plan.set_graph_hash(lower::Sha256Hex(plan.graph()));
  plan.set_cluster_hash(lower::Sha256Hex(plan.cluster()));
  for (int i = 0; i < cluster.size(); ++i) plan.add_devices(cluster.device(i).id);
  plan.set_global_batch(GraphBatch(g));
  v1::PlanPrediction* pred = plan.mutable_prediction();
  pred->set_step_seconds(p.step_seconds);
  pred->set_overlap_assumed(p.overlap);
  for (const std::string& n : p.notes) plan.add_notes(n);
  v1::PipelinePlan* out = plan.mutable_pipeline();
  out->set_microbatches(p.microbatches);
  out->set_microbatch_size(p.microbatch_size);
  out->set_schedule("1f1b");
  out->set_step_seconds(p.step_seconds);
  out->set_bubble_seconds(p.bubble_seconds);
  out->set_spmd_step_seconds(p.spmd_step_seconds);
  out->set_variant(VariantName(p.variant));
  double compute = 0;
  std::vector<v1::RankProgram> rank_programs(cluster.size());
  std::vector<int> placed(cluster.size(), 0);
  for (const StagePlan& s : p.stages) {
    for (int d : s.devices) placed[d] += 1;
  }
  for (int d = 0; d < cluster.size(); ++d) {
    if (placed[d] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device ", cluster.device(d).id, " is in ", placed[d],
          " pipeline stages; an executable pipeline plan places every device in one"));
    }
  }
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const StagePlan& s = p.stages[i];
    v1::PipelineStage* st = out->add_stages();
    st->set_index(static_cast<int>(i));
    st->set_begin_op(s.begin_op);
    st->set_end_op(s.end_op);
    st->set_first_op(gm.op(s.begin_op).name);
    st->set_last_op(gm.op(s.end_op - 1).name);
    for (int d : s.devices) st->add_devices(cluster.device(d).id);
    lower::AddInstructions(gm, s.program, s.ratios, st->mutable_program());
    for (double r : s.ratios) st->add_ratios(r);
    if (s.input_tensor >= 0) {
      st->set_input_tensor(gm.tensor(s.input_tensor).name);
      *st->mutable_input_form() = lower::FormOf(s.input_form);
    }
    if (s.output_tensor >= 0) {
      st->set_output_tensor(gm.tensor(s.output_tensor).name);
      *st->mutable_output_form() = lower::FormOf(s.output_form);
    }
    st->set_forward_seconds(s.times.forward);
    st->set_backward_seconds(s.times.backward);
    st->set_send_seconds(s.times.send);
    st->set_gradient_receive_seconds(s.times.gradient);
    st->set_sync_seconds(s.times.sync);
    st->set_in_flight_microbatches(s.in_flight);
    for (int64_t m : s.memory_bytes) st->add_memory_bytes_per_device(m);
    // The stage's rank programs (LowerStage), in Plan.rank_programs at the
    // world ranks of its devices (Plan.devices order).
    lower::StageSpec spec;
    spec.begin_op = s.begin_op;
    spec.end_op = s.end_op;
    spec.input = s.input_tensor;
    spec.input_form = s.input_form;
    spec.output = s.output_tensor;
    spec.output_form = s.output_form;
    spec.microbatches = p.microbatches;
    lower::LowerOptions lo;
    lo.world_size = static_cast<int>(s.devices.size());
    lo.ratios = s.ratios;
    for (int d : s.devices) lo.devices.push_back(cluster.device(d).id);
    lo.optimizer = options.optimizer();
    lo.seed = options.seed();
    lo.bf16 = options.precision() == v1::PRECISION_BF16;
    // The executors overlap what the prediction assumed overlapped.
    lo.overlap = p.overlap;
    auto programs = lower::LowerStage(gm, s.program, spec, lo);
    if (!programs.ok()) {
      return Annotate(programs.status(), absl::StrCat("lowering pipeline stage ", i));
    }
    for (size_t k = 0; k < s.devices.size(); ++k) rank_programs[s.devices[k]] = (*programs)[k];
    compute = std::max(compute, p.microbatches * (s.times.forward + s.times.backward));
  }
  for (v1::RankProgram& rp : rank_programs) *plan.add_rank_programs() = std::move(rp);
  pred->set_compute_seconds(compute);
  pred->set_communication_seconds(std::max(0.0, p.step_seconds - compute));
  plan.set_content_hash(lower::ContentHash(plan));
  return plan;
}

absl::StatusOr<PipelineOptions> FromProto(const v1::PlanOptions& o) {
  PipelineOptions p;
  switch (o.pipeline()) {
    case v1::PlanOptions::PIPELINE_AUTO:
      p.mode = Mode::kAuto;
      break;
    case v1::PlanOptions::PIPELINE_STAGES:
      if (o.pipeline_stages() < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("options.pipeline_stages must be at least 1 with PIPELINE_STAGES, got ",
                         o.pipeline_stages()));
      }
      p.mode = Mode::kStages;
      p.stages = o.pipeline_stages();
      break;
    case v1::PlanOptions::PIPELINE_OFF:
      p.mode = Mode::kOff;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("options.pipeline ", o.pipeline(),
                       " is not a known pipeline mode (PIPELINE_OFF, PIPELINE_AUTO or "
                       "PIPELINE_STAGES)"));
  }
  if (o.pipeline_microbatches() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.pipeline_microbatches must not be negative, got ", o.pipeline_microbatches()));
  }
  p.microbatches = o.pipeline_microbatches();
  return p;
}

}  // namespace hap::pipeline
