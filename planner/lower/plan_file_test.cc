#include "planner/lower/plan_file.h"

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"
#include "planner/synth/program.h"

namespace hap::lower {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int kBatch = 6;

// A plan as BuildPlan writes one (the single-device program lowered for
// `world` ranks): graph, its hash, devices, batch, rank programs, content
// hash (of format `version`).
v1::Plan MlpPlan(int world, int version = kPlanFormatVersion) {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 1}, {"hidden", 4}, {"input", 3}, {"classes", 2}, {"batch", kBatch}});
  EXPECT_THAT(g.status(), IsOk());
  v1::Plan plan;
  plan.set_format_version(version);
  *plan.mutable_graph() = graph::ToProto(*g);
  plan.set_graph_hash(Sha256Hex(plan.graph()));
  plan.set_global_batch(kBatch);
  LowerOptions lo;
  lo.world_size = world;
  v1::Node* node = plan.mutable_cluster()->add_nodes();
  node->set_name("n0");
  for (int r = 0; r < world; ++r) {
    lo.devices.push_back("n0/gpu" + std::to_string(r));
    plan.add_devices(lo.devices.back());
    v1::Device* d = node->add_devices();
    d->set_id(lo.devices.back());
    d->set_kind(v1::GPU);
    d->set_node("n0");
    d->set_local_index(r);
  }
  plan.set_cluster_hash(Sha256Hex(plan.cluster()));
  auto programs = Lower(*g, SingleDeviceProgram(*g), lo);
  EXPECT_THAT(programs.status(), IsOk());
  for (v1::RankProgram& p : *programs) *plan.add_rank_programs() = std::move(p);
  plan.set_content_hash(ContentHash(plan));
  return plan;
}

TEST(PlanFileTest, APlanAsWrittenFitsEveryRank) {
  const v1::Plan plan = MlpPlan(2);
  for (int r = 0; r < 2; ++r) EXPECT_THAT(CheckPlanForRank(plan, r, 2), IsOk()) << r;
}

TEST(PlanFileTest, AGraphEditedAfterLoweringIsRefused) {
  // The content hash covers the graph's hash, not the graph: a parameter
  // frozen by hand would still be updated by the rank programs.
  v1::Plan plan = MlpPlan(2);
  plan.mutable_graph()->mutable_parameters(0)->set_frozen(true);
  EXPECT_THAT(CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's graph does not match its graph_hash")));
}

TEST(PlanFileTest, AGlobalBatchOtherThanTheGraphsIsRefused) {
  // Not covered by version 1's content hash; checkpoints count samples by
  // it. (Version 2's hash covers it: AVersion2Plan... below.)
  v1::Plan plan = MlpPlan(2, 1);
  plan.set_global_batch(2 * kBatch);
  EXPECT_THAT(CheckPlanForRank(plan, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("global_batch is 12, but its graph's batch (the first dimension "
                                 "of its first input, 'x') is 6")));
}

TEST(PlanFileTest, DevicesThatDisagreeWithTheRankProgramsAreRefused) {
  v1::Plan swapped = MlpPlan(2);
  swapped.mutable_devices()->SwapElements(0, 1);
  EXPECT_THAT(CheckPlanForRank(swapped, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan places rank 0 on device 'n0/gpu1', but its program "
                                 "was lowered for 'n0/gpu0'")));
  // Executors on a plan without devices run on the CPU.
  v1::Plan none = MlpPlan(2);
  none.clear_devices();
  EXPECT_THAT(CheckPlanForRank(none, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan lists 0 devices for its 2 rank programs")));
  v1::Plan more = MlpPlan(2);
  more.add_devices("n0/gpu2");
  EXPECT_THAT(CheckPlanForRank(more, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan lists 3 devices for its 2 rank programs")));
}

TEST(PlanFileTest, APipelinePlanWithADeviceListOfAnotherLengthSaysSo) {
  v1::Plan plan;
  plan.set_format_version(kPlanFormatVersion);
  plan.set_global_batch(1);
  for (const char* d : {"a", "b"}) {
    v1::PipelineStage* st = plan.mutable_pipeline()->add_stages();
    st->add_devices(d);
    v1::RankProgram* p = plan.add_rank_programs();
    p->set_world_size(1);
    p->set_device(d);
    plan.add_devices(d);
  }
  plan.add_devices("c");
  // Was "the plan is for a world of 2 ranks, not 2".
  EXPECT_THAT(CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan lists 3 devices for its 2 rank programs")));
}

// A two-stage pipeline plan of the MLP (one microbatch), as
// BuildPipelinePlan writes one: stage 0 (device "a") runs ops [0, cut) and
// sends the activation op cut - 1 makes, stage 1 (device "b") the rest.
v1::Plan PipelinePlan(int version = kPlanFormatVersion) {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 1}, {"hidden", 4}, {"input", 3}, {"classes", 2}, {"batch", kBatch}});
  EXPECT_THAT(g.status(), IsOk());
  const synth::Program whole = SingleDeviceProgram(*g);
  const int ops = static_cast<int>(g->ops().size());
  const int cut = ops / 2;
  const graph::TensorId sent = g->op(cut - 1).outputs[0];
  v1::Plan plan;
  plan.set_format_version(version);
  *plan.mutable_graph() = graph::ToProto(*g);
  plan.set_graph_hash(Sha256Hex(plan.graph()));
  plan.set_global_batch(kBatch);
  plan.mutable_pipeline()->set_microbatches(1);
  plan.mutable_pipeline()->set_microbatch_size(kBatch);
  for (int s = 0; s < 2; ++s) {
    StageSpec spec;
    spec.begin_op = s == 0 ? 0 : cut;
    spec.end_op = s == 0 ? cut : ops;
    (s == 0 ? spec.output : spec.input) = sent;
    synth::Program program;
    program.steps.assign(whole.steps.begin() + spec.begin_op, whole.steps.begin() + spec.end_op);
    LowerOptions lo;
    lo.devices = {s == 0 ? "a" : "b"};
    auto programs = LowerStage(*g, program, spec, lo);
    EXPECT_THAT(programs.status(), IsOk());
    v1::PipelineStage* st = plan.mutable_pipeline()->add_stages();
    st->set_index(s);
    st->set_begin_op(spec.begin_op);
    st->set_end_op(spec.end_op);
    st->add_devices(lo.devices[0]);
    (s == 0 ? *st->mutable_output_tensor() : *st->mutable_input_tensor()) = g->tensor(sent).name;
    plan.add_devices(lo.devices[0]);
    *plan.add_rank_programs() = (*programs)[0];
  }
  plan.set_content_hash(ContentHash(plan));
  return plan;
}

TEST(PlanFileTest, APipelinePlanAsWrittenFitsEveryRank) {
  const v1::Plan plan = PipelinePlan();
  for (int r = 0; r < 2; ++r) EXPECT_THAT(CheckPlanForRank(plan, r, 2), IsOk()) << r;
}

TEST(PlanFileTest, ARankProgramInAnotherPipelineStageThanItWasLoweredForIsRefused) {
  // The stages' devices swapped (version 1's content hash does not cover
  // the pipeline): each rank would run its program as the other stage's,
  // the first stage waiting for an activation nobody sends.
  v1::Plan plan = PipelinePlan(1);
  auto* stages = plan.mutable_pipeline()->mutable_stages();
  std::swap(*stages->Mutable(0)->mutable_devices(0), *stages->Mutable(1)->mutable_devices(0));
  const std::string sent = plan.pipeline().stages(0).output_tensor();
  EXPECT_THAT(CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("the plan's program 0 receives nothing and sends '",
                                              sent, "', but pipeline stage 1 receives '", sent,
                                              "' and sends nothing"))));
}

TEST(PlanFileTest, PipelineStagesOutOfOrderAreRefused) {
  // Each stage keeps its devices and programs, but the list (the order the
  // runner passes activations in) starts with the stage that receives one.
  v1::Plan plan = PipelinePlan();
  plan.mutable_pipeline()->mutable_stages()->SwapElements(0, 1);
  const std::string sent = plan.pipeline().stages(1).output_tensor();
  EXPECT_THAT(CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("the pipeline's stage 0 (index 1) receives '", sent,
                                              "', which no stage before it sends"))));
}

TEST(PlanFileTest, ALossSeedOfNoMicrobatchCountSaysSo) {
  // A seed whose inverse is no int64 was reported as lowered for
  // "-9223372036854775808 microbatches".
  for (const double seed : {1e-30, -0.5, 3.0}) {
    v1::Plan plan = PipelinePlan();
    int seeded = 0;
    for (v1::Step& step : *plan.mutable_rank_programs(1)->mutable_steps()) {
      if (step.phase() != v1::Step::BACKWARD || step.kernel().kernel() != "fill") continue;
      auto& value = (*step.mutable_kernel()->mutable_attrs())["value"];
      if (value.f() == 0) continue;
      value.set_f(seed);
      ++seeded;
    }
    ASSERT_EQ(seeded, 1);
    plan.set_content_hash(ContentHash(plan));
    EXPECT_THAT(CheckPlanForRank(plan, 1, 2),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("was lowered for another number of microbatches "
                                                "(its loss is seeded with ",
                                                seed, "), the pipeline says 1"))));
  }
}

TEST(PlanFileTest, ARankProgramOfAnotherRankSaysWhichRankItIsFor) {
  // Was "the plan's program 0 is not rank 0's".
  v1::Plan swapped = MlpPlan(2);
  swapped.mutable_rank_programs()->SwapElements(0, 1);
  EXPECT_THAT(CheckPlanForRank(swapped, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's program 0 was lowered for rank 1 of 2, not rank 0 "
                                 "of 2")));
  v1::Plan resized = MlpPlan(2);
  resized.mutable_rank_programs(1)->set_world_size(3);
  EXPECT_THAT(CheckPlanForRank(resized, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's program 1 was lowered for rank 1 of 3, not rank 1 "
                                 "of 2")));
}

TEST(PlanFileTest, AClusterEditedAfterPlanningIsRefused) {
  // Executors take their device's kind and GPU ordinal from the plan's
  // cluster, which the content hash does not cover.
  v1::Plan plan = MlpPlan(2);
  plan.mutable_cluster()->mutable_nodes(0)->mutable_devices(1)->set_local_index(0);
  EXPECT_THAT(CheckPlanForRank(plan, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's cluster does not match its cluster_hash")));
}

TEST(PlanFileTest, AStageProgramLoweredForOtherMicrobatchesIsRefused) {
  // The count and size edited together (6 x 1 -> 3 x 2): the last stage's
  // loss seed says so; the first stage's inputs were lowered for 6 rows.
  // Version 1, whose content hash does not cover the pipeline fields.
  v1::Plan plan = PipelinePlan(1);
  plan.mutable_pipeline()->set_microbatches(2);
  plan.mutable_pipeline()->set_microbatch_size(kBatch / 2);
  EXPECT_THAT(CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's program 0 reads input 'x' with 6 rows, as "
                                 "microbatches of 6 samples have it, not 3")));
  // A graph input of no rows is the graph hash's to refuse, not a division
  // by zero here.
  plan.mutable_graph()->mutable_inputs(0)->mutable_tensor()->set_shape(0, 0);
  EXPECT_THAT(CheckPlanForRank(plan, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("graph_hash")));
}

// Version 2's content hash covers what version 1's left to the
// cross-checks: a cluster edited together with its cluster_hash (a GPU
// ordinal moved, which no other check sees) ran a version 1 plan on other
// devices than planned; so did stage fields edited consistently.
TEST(PlanFileTest, AVersion2PlanEditedWhereOnlyTheContentHashSeesItIsRefused) {
  const auto move_ordinal = [](v1::Plan& plan) {
    plan.mutable_cluster()->mutable_nodes(0)->mutable_devices(1)->set_local_index(5);
    plan.set_cluster_hash(Sha256Hex(plan.cluster()));
  };
  v1::Plan old = MlpPlan(2, 1);
  move_ordinal(old);
  EXPECT_THAT(CheckPlanForRank(old, 1, 2), IsOk());  // what version 1 could not see
  v1::Plan plan = MlpPlan(2);
  ASSERT_EQ(plan.format_version(), 2);
  move_ordinal(plan);
  EXPECT_THAT(CheckPlanForRank(plan, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's content hash does not match its content")));
  plan = MlpPlan(2);
  plan.set_global_batch(2 * kBatch);
  EXPECT_THAT(CheckPlanForRank(plan, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the plan's content hash does not match its content")));
  v1::Plan renamed = PipelinePlan();
  renamed.mutable_pipeline()->mutable_stages(1)->set_first_op("edited");
  renamed.mutable_pipeline()->set_schedule("gpipe");
  EXPECT_THAT(CheckPlanForRank(renamed, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("content hash")));
  v1::Plan old_renamed = PipelinePlan(1);
  old_renamed.mutable_pipeline()->mutable_stages(1)->set_first_op("edited");
  EXPECT_THAT(CheckPlanForRank(old_renamed, 1, 2), IsOk());
}

TEST(PlanFileTest, VersionsOneAndTwoAreReadAndOthersRefused) {
  for (int version : {1, 2}) {
    EXPECT_THAT(CheckPlanForRank(MlpPlan(2, version), 0, 2), IsOk()) << version;
    EXPECT_THAT(CheckPlanForRank(PipelinePlan(version), 1, 2), IsOk()) << version;
  }
  for (int version : {0, 3, -1}) {
    EXPECT_THAT(CheckPlanForRank(MlpPlan(2, version), 0, 2),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("plan format version ", version,
                                                " is not supported (this executor reads "
                                                "versions 1 to 2)"))))
        << version;
  }
  // The version is hashed too: a version 2 plan relabelled 1 (to skip the
  // wider hash) no longer matches.
  v1::Plan relabelled = MlpPlan(2);
  relabelled.set_format_version(1);
  EXPECT_THAT(CheckPlanForRank(relabelled, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("content hash")));
}

}  // namespace
}  // namespace hap::lower
