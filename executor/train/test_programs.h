// Test-only: synthesized programs of a chosen kind, for checking execution
// against the single-device run (equivalence_test, in_process_test).
//   dp    data-parallel rules, replicated parameters
//   tp    tensor-parallel rules
//   mix   the unrestricted search (SFB and ZeRO allowed)
//   zero  data-parallel rules, ZeRO-sharded parameters gathered again for
//         backward (ZeRO-3)
//   zero2 the same, every ZeRO parameter gathered once per step and kept for
//         backward, gathers and gradient reduce-scatters coalesced
//   sfb   dp with SFB forced on every data-parallel linear weight
//   expert the search with every MoE dispatch and combine split by experts
#ifndef HAP_EXECUTOR_TRAIN_TEST_PROGRAMS_H_
#define HAP_EXECUTOR_TRAIN_TEST_PROGRAMS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/runtime/tensor.h"
#include "executor/train/trainer.h"
#include "hap/v1/plan.pb.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph.h"
#include "planner/lower/lower.h"
#include "planner/synth/program.h"

namespace hap::testing {

// n devices of alternating 1e7 / 2e7 FLOP/s on 1e12 B/s links: compute is
// so dear that the search splits work wherever a rule lets it.
cost::ClusterModel SlowDevicesFastLinks(int n);

// The small models of the equivalence tests for `ranks` ranks: "mlp",
// "gpt", "vit", "moe", "switch", "moe_grouped", "switch_grouped",
// "transformer", "vgg", "bn_cnn" (batch_norm_equivalence_test's CNN), "lstm"
// (lstm_equivalence_test's LM); batch 6 * ranks + 1, so shards are uneven
// everywhere; dropout on in gpt, vit and transformer; 2 * ranks + 2 experts.
// InvalidArgument for another name.
absl::StatusOr<graph::Graph> EquivalenceModel(const std::string& name, int ranks);

// Even ratios for n devices, or uneven ones growing 1 : 1.6 : 2.2 : ...
std::vector<double> EquivalenceRatios(int n, bool uneven);

// batch_norm_equivalence_test's CNN (conv2d, batch_norm with running
// statistics, relu, a depthwise conv2d, drop_path, avg_pool2d, linear,
// cross-entropy) and lstm_equivalence_test's language model (embedding, two
// lstm layers, the second reversed, linear, cross-entropy), of `batch`
// samples; EquivalenceModel's "bn_cnn" and "lstm".
absl::StatusOr<graph::Graph> BatchNormCnn(int64_t batch);
absl::StatusOr<graph::Graph> LstmLm(int64_t batch);

// A program of `kind` for n devices at `ratios`, checked by
// synth::CheckProgram. FailedPrecondition when "sfb" finds no weight to
// force SFB on, "zero2" no ZeRO parameter, or "expert" an MoE op not split
// by experts.
absl::StatusOr<synth::Program> ProgramOfKind(const graph::Graph& g, int n, const std::string& kind,
                                             const std::vector<double>& ratios);

// The optimizers of the equivalence tests: AdamW (lr kEquivalenceAdamLr,
// weight decay 0.01, clipping at global norm 0.5, epsilon 1e-6) or SGD
// with momentum 0.9 (lr 0.1, weight decay 1e-3).
inline constexpr double kEquivalenceAdamLr = 0.01;
hap::v1::OptimizerConfig EquivalenceOptimizer(bool adam);

// How far parameters `got` are from `want` (float32), per parameter of
// `want`: the largest absolute element difference, at which element, the
// two values there, and the tensor's scale (its largest magnitude, at
// least 1e-3). InvalidArgument naming a parameter missing from `got` or of
// another shape, or when `got` holds other parameters.
struct ParameterDeviation {
  std::string name;
  double worst = 0;
  int64_t at = 0;
  double got = 0, want = 0;  // at `at`
  double scale = 1e-3;
};
absl::StatusOr<std::vector<ParameterDeviation>> CompareParameters(
    const std::map<std::string, executor::HostTensor>& got,
    const std::map<std::string, executor::HostTensor>& want);

// CompareParameters of the parameters assembled from every rank's pieces
// of `runs` against those of the single-device run `ref`.
absl::StatusOr<std::vector<ParameterDeviation>> CompareRunsWithReference(
    const std::vector<executor::TrainResult>& runs, const executor::TrainResult& ref);

// Lowers `p` with `lo` and trains `steps` steps on lo.world_size local
// ranks over Gloo (rendezvous in a fresh directory under the test's temp
// dir, named by `tag`), every rank reading the synthetic batches of
// lo.seed: the multi-rank run the equivalence tests compare. Programs with
// asynchronous collectives (lo.overlap) run them on a communication thread
// with a second Gloo context; `runner` carries the runners' test options.
absl::StatusOr<std::vector<executor::TrainResult>> RunLoweredOverGloo(
    const graph::Graph& g, const synth::Program& p, const lower::LowerOptions& lo, int steps,
    const std::string& tag, const executor::RunnerOptions& runner = {});

}  // namespace hap::testing

#endif  // HAP_EXECUTOR_TRAIN_TEST_PROGRAMS_H_
