#include "planner/lower/plan_builder.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/cost/collectives.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/lower.h"

namespace hap::lower {

namespace v1 = ::hap::v1;

v1::TensorForm FormOf(synth::Form f) {
  v1::TensorForm p;
  if (f.is_replicated()) {
    p.set_kind(v1::TensorForm::REPLICATED);
  } else if (f.is_partial()) {
    p.set_kind(v1::TensorForm::PARTIAL);
  } else {
    p.set_kind(v1::TensorForm::SHARDED);
    p.set_dim(f.dim());
  }
  return p;
}

namespace {

v1::Collective CollectiveOf(synth::Collective c) {
  switch (c) {
    case synth::Collective::kAllGather:
      return v1::ALL_GATHER;
    case synth::Collective::kReduceScatter:
      return v1::REDUCE_SCATTER;
    case synth::Collective::kAllReduce:
      return v1::ALL_REDUCE;
    case synth::Collective::kAllToAll:
      return v1::ALL_TO_ALL;
    case synth::Collective::kSlice:
    case synth::Collective::kZeroOut:
      return v1::SLICE;
  }
  return v1::COLLECTIVE_UNSPECIFIED;
}

v1::Instruction::Storage StorageOf(synth::ParamStorage s) {
  switch (s) {
    case synth::ParamStorage::kReplicated:
      return v1::Instruction::STORAGE_REPLICATED;
    case synth::ParamStorage::kSharded:
      return v1::Instruction::STORAGE_SHARDED;
    case synth::ParamStorage::kZero:
      return v1::Instruction::STORAGE_ZERO;
  }
  return v1::Instruction::STORAGE_UNSPECIFIED;
}

}  // namespace

void AddInstructions(const graph::Graph& g, const synth::Program& p,
                     const std::vector<double>& ratios, v1::SynthesizedProgram* out) {
  auto eval = [&](const ratios::CostTerm& t) { return cost::EvaluateTerm(t, ratios); };
  for (const synth::OpStep& s : p.steps) {
    const graph::Op& op = g.op(s.op);
    for (const synth::SourceLoad& l : s.loads) {
      v1::Instruction* i = out->add_instructions();
      i->set_kind(v1::Instruction::SOURCE);
      i->set_op(g.tensor(l.tensor).name);
      *i->add_output_forms() = FormOf(l.form);
      if (l.parameter) {
        i->set_storage(StorageOf(l.storage));
        i->set_sfb(l.sfb);
        i->set_zero_gather_once(l.gather_once);
      }
      double comm = 0;
      for (const auto& c : l.costs) comm += eval(c);
      i->set_predicted_comm_seconds(comm);
    }
    for (const synth::CommStep& c : s.comms) {
      v1::Instruction* i = out->add_instructions();
      i->set_kind(v1::Instruction::COMMUNICATE);
      i->set_op(g.tensor(c.tensor).name);
      *i->add_input_forms() = FormOf(c.from);
      *i->add_output_forms() = FormOf(c.to);
      i->set_collective(CollectiveOf(c.forward));
      i->set_method(c.method == synth::Method::kGrouped ? v1::GROUPED
                    : c.method == synth::Method::kPadded ? v1::PADDED
                                                         : v1::COLLECTIVE_METHOD_UNSPECIFIED);
      i->set_predicted_comm_seconds(eval(c.forward_cost) + eval(c.backward_cost));
    }
    v1::Instruction* i = out->add_instructions();
    i->set_kind(v1::Instruction::COMPUTE);
    i->set_op(op.name);
    i->set_rule(s.rule.name);
    for (graph::TensorId t : op.inputs) i->add_tensors(g.tensor(t).name);
    for (graph::TensorId t : op.outputs) i->add_tensors(g.tensor(t).name);
    for (synth::Form f : s.rule.inputs) *i->add_input_forms() = FormOf(f);
    for (synth::Form f : s.rule.outputs) *i->add_output_forms() = FormOf(f);
    i->set_predicted_compute_seconds(eval(s.compute));
  }
}

absl::StatusOr<v1::Plan> BuildPlan(const graph::Graph& g,
                                   const v1::Cluster& cluster_profile,
                                   const cost::ClusterModel& cluster,
                                   const synth::PlanResult& result,
                                   const v1::PlanOptions& options) {
  v1::Plan plan;
  plan.set_format_version(kPlanFormatVersion);
  *plan.mutable_graph() = graph::ToProto(g);
  *plan.mutable_cluster() = cluster_profile;
  *plan.mutable_options() = options;
  plan.set_graph_hash(Sha256Hex(plan.graph()));
  plan.set_cluster_hash(Sha256Hex(plan.cluster()));
  std::vector<std::string> devices;
  for (int i = 0; i < cluster.size(); ++i) {
    devices.push_back(cluster.device(i).id);
    plan.add_devices(cluster.device(i).id);
  }
  // The batch of the first input's first dimension; 1 for a graph with no
  // batched input (executors refuse a plan without one: checkpoints count
  // samples by it).
  plan.set_global_batch(g.Inputs().empty() || g.tensor(g.Inputs().front()).type.shape.empty()
                            ? 1
                            : g.tensor(g.Inputs().front()).type.shape[0]);
  AddInstructions(g, result.program, result.ratios, plan.mutable_program());
  v1::SegmentRatios* r = plan.add_ratios();
  for (double x : result.ratios) r->add_ratios(x);
  LowerOptions lo;
  lo.world_size = cluster.size();
  lo.ratios = result.ratios;
  lo.devices = devices;
  lo.optimizer = options.optimizer();
  lo.seed = options.seed();
  lo.bf16 = options.precision() == v1::PRECISION_BF16;
  // Gradients synchronised in the precision they were priced at.
  lo.bf16_gradients = result.program.gradient_wire_scale < 1;
  // Executors overlap what the prediction assumed overlapped.
  lo.overlap = result.program.overlap;
  lo.gradient_bucket_bytes = result.program.bucket_bytes;
  HAP_ASSIGN_OR_RETURN(std::vector<v1::RankProgram> programs,
                       Lower(g, result.program, lo));
  for (auto& p : programs) *plan.add_rank_programs() = std::move(p);
  v1::PlanPrediction* pred = plan.mutable_prediction();
  pred->set_step_seconds(result.cost.total);
  pred->set_compute_seconds(result.cost.compute);
  pred->set_communication_seconds(result.cost.communication);
  for (int64_t m : result.memory_bytes) pred->add_memory_bytes_per_device(m);
  pred->set_overlap_assumed(result.program.overlap);
  pred->set_communication_busy_seconds(result.cost.communication_busy);
  plan.set_gradient_bucket_bytes(result.program.bucket_bytes);
  plan.set_gradient_buckets(static_cast<int>(result.program.buckets.size()));
  plan.set_synthesis_seconds(result.synthesis_seconds);
  plan.set_states_expanded(result.states_expanded);
  for (const std::string& note : result.notes) plan.add_notes(note);
  plan.set_optimal(result.optimal);
  plan.set_joint_iterations(result.joint_iterations);
  plan.set_state(v1::Plan::SUCCEEDED);
  plan.set_content_hash(ContentHash(plan));
  return plan;
}

}  // namespace hap::lower
