// Test-only: the harness the pipeline tests share (pipeline_equivalence_test,
// pipeline_runner_test), so that both cut, lower and check pipelines the same
// way: the zoo models they cut, a pipeline case lowered into stage programs
// as the pipeline planner makes them (each stage's group runs a whole-model
// program of its kind at the microbatch size, restricted to the stage's ops,
// at uneven ratios), the single-device reference run and the comparison with
// it (tolerances as equivalence_test.cc).
#ifndef HAP_EXECUTOR_TRAIN_PIPELINE_TEST_UTIL_H_
#define HAP_EXECUTOR_TRAIN_PIPELINE_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/train/pipeline.h"
#include "executor/train/trainer.h"
#include "gtest/gtest.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"

namespace hap::testing {

// The global batch and the seed (parameters, dropout, synthetic batches) of
// every pipeline test; the references are run with the same ones.
inline constexpr int kPipelineBatch = 24;
inline constexpr uint64_t kPipelineSeed = 4321;

// The zoo model "mlp" (4 layers) or, for any other name, "gpt" (3 layers,
// dropout 0.1) at kPipelineBatch: small enough for many ranks as threads,
// with enough layers for 4 stages.
graph::Graph PipelineTestModel(const std::string& name);

// A fresh, empty directory pipe_<tag> under the test's temp dir
// (TEST_TMPDIR), for one run's Gloo rendezvous or a checkpoint.
std::string PipelineTestDir(const std::string& tag);

// Shares 1 : 1.7 : 2.4 : ... of n ranks, summing to 1 ({1} for one rank):
// uneven, so that a piece placed at the wrong offset shows.
std::vector<double> UnevenRatios(int n);

// One pipeline: the model cut into group_sizes.size() stages, stage s on
// group_sizes[s] ranks.
struct PipelineCase {
  std::string model;             // PipelineTestModel's name
  std::vector<int> group_sizes;  // ranks per stage
  int microbatches = 1;
  bool adam = false;        // EquivalenceOptimizer(adam); the layout clips with Adam
  std::string kind = "dp";  // the groups' programs (test_programs.h kinds)
  // Senders send contributions to the whole tensor instead of their pieces
  // (LocalRanksOptions::pipeline_pieces = false); read by the runs, not by
  // LowerPipeline.
  bool whole = false;
  // Lowered with overlap: gradient buckets started in the last microbatch's
  // backward on a communication thread (several buckets per stage).
  bool overlap = false;
  // Stage s is ops [cuts[s], cuts[s + 1]) of the model; empty: about equal
  // numbers of planner/pipeline layers per stage, cut where FindLayers does.
  std::vector<int> cuts = {};
};

// The case as a test name (and a run's tag), e.g.
// gpt_3stages_121_mb6_mix_adam[_whole][_overlap][_cuts].
std::string PipelineCaseName(const PipelineCase& c);
// PipelineCaseName for INSTANTIATE_TEST_SUITE_P.
std::string PipelineCaseTestName(const ::testing::TestParamInfo<PipelineCase>& info);

struct LoweredPipeline {
  std::vector<hap::v1::RankProgram> programs;  // per world rank
  executor::PipelineLayout layout;
  std::shared_ptr<graph::Graph> micro;  // the model at the microbatch size
};

// Whether LowerPipeline fills the layout's boundary pieces.
enum class BoundaryPieces {
  // AddBoundaryPieces on the stage programs: for harnesses that create the
  // PipelineRunners themselves.
  kAdd,
  // Left empty, so that executor::RunLocalPipeline adds them itself (or,
  // with PipelineCase::whole, runs without them) as the equivalence test
  // checks.
  kLeaveToRunLocalPipeline,
};

// Cuts `g` (at kPipelineBatch) as `c` says and lowers each stage for its
// group with lower::LowerStage (EquivalenceOptimizer, kPipelineSeed): world
// ranks are numbered stage by stage. With layer cuts each stage's input and
// output are the layers' boundary activations; with explicit cuts the one
// activation crossing into and out of the stage (FailedPrecondition when
// there is not exactly one).
absl::StatusOr<LoweredPipeline> LowerPipeline(const graph::Graph& g, const PipelineCase& c,
                                              BoundaryPieces pieces);

// The single-device run of `g` (the zoo model `model`) for `steps` steps
// with EquivalenceOptimizer(adam) over Gloo, run once per process and kept;
// an empty result (and a test failure) when it fails.
const executor::TrainResult& SingleDeviceReference(const graph::Graph& g, const std::string& model,
                                                   bool adam, int steps);

// Every rank of `runs` has the reference's losses for `steps` steps (within
// 2e-5 relative + 2e-6) and, assembled from all ranks, its parameters
// (within 1e-4 of each tensor's scale, plus 1e-3 * lr per step with Adam,
// whose normalised updates amplify rounding).
void ExpectMatchesReference(const std::vector<executor::TrainResult>& runs,
                            const executor::TrainResult& ref, bool adam, int steps);

}  // namespace hap::testing

#endif  // HAP_EXECUTOR_TRAIN_PIPELINE_TEST_UTIL_H_
