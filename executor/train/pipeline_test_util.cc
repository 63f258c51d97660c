#include "executor/train/pipeline_test_util.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "executor/train/test_programs.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"
#include "planner/pipeline/layers.h"

namespace hap::testing {
namespace {

using executor::TrainResult;

// The one activation produced before `begin` that ops [begin, end) read
// (want_input), or produced in [begin, end) and read at `end` or later.
absl::StatusOr<graph::TensorId> Crossing(const graph::Graph& m, int begin, int end,
                                         bool want_input) {
  std::set<graph::TensorId> found;
  for (int k = 0; k < static_cast<int>(m.ops().size()); ++k) {
    const bool reader = want_input ? (k >= begin && k < end) : k >= end;
    if (!reader) continue;
    for (graph::TensorId t : m.op(k).inputs) {
      const graph::Tensor& x = m.tensor(t);
      if (x.kind != graph::TensorKind::kActivation) continue;
      const bool from = want_input ? x.producer < begin : (x.producer >= begin && x.producer < end);
      if (from) found.insert(t);
    }
  }
  if (found.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("ops [", begin, ", ", end, ") have ", found.size(), " crossing tensors"));
  }
  return *found.begin();
}

// A stage's op range and the activations it receives and sends (-1: none,
// for the first stage's input and the last stage's output).
struct StageCut {
  int begin_op = 0, end_op = 0;
  graph::TensorId input = -1, output = -1;
};

// The stages of `c` on the microbatch graph `m`: at `c.cuts`, or at about
// equal numbers of planner/pipeline layers (their boundaries crossing).
absl::StatusOr<std::vector<StageCut>> CutStages(const graph::Graph& m, const PipelineCase& c) {
  const int S = static_cast<int>(c.group_sizes.size());
  std::vector<StageCut> stages(S);
  if (c.cuts.empty()) {
    pipeline::Layers layers = pipeline::FindLayers(m, 2 * S);
    if (layers.size() < S) {
      return absl::FailedPreconditionError(absl::StrCat("only ", layers.size(), " layers"));
    }
    for (int s = 0; s < S; ++s) {
      const int first_layer = s * layers.size() / S, end_layer = (s + 1) * layers.size() / S;
      stages[s].begin_op = layers.begin[first_layer];
      stages[s].end_op = layers.begin[end_layer];
      if (first_layer > 0) stages[s].input = layers.boundary[first_layer - 1];
      if (s + 1 < S) stages[s].output = layers.boundary[end_layer - 1];
    }
    return stages;
  }
  if (static_cast<int>(c.cuts.size()) != S + 1) {
    return absl::InvalidArgumentError("cuts must have one entry per stage and the end");
  }
  for (int s = 0; s < S; ++s) {
    stages[s].begin_op = c.cuts[s];
    stages[s].end_op = c.cuts[s + 1];
    if (s > 0) {
      auto in = Crossing(m, c.cuts[s], c.cuts[s + 1], true);
      if (!in.ok()) return in.status();
      stages[s].input = *in;
    }
    if (s + 1 < S) {
      auto out = Crossing(m, c.cuts[s], c.cuts[s + 1], false);
      if (!out.ok()) return out.status();
      stages[s].output = *out;
    }
  }
  return stages;
}

std::map<std::string, std::vector<TrainResult>>& References() {
  static auto* m = new std::map<std::string, std::vector<TrainResult>>();
  return *m;
}

}  // namespace

graph::Graph PipelineTestModel(const std::string& name) {
  std::map<std::string, double> p;
  if (name == "mlp") {
    p = {{"layers", 4}, {"hidden", 24}, {"input", 12}, {"classes", 5}, {"batch", kPipelineBatch}};
  } else {
    p = {{"layers", 3},
         {"hidden", 16},
         {"heads", 4},
         {"ffn", 24},
         {"seq", 6},
         {"vocab", 37},
         {"batch", kPipelineBatch},
         {"dropout", 0.1}};
  }
  auto g = graph::BuildZooModel(name, p);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::string PipelineTestDir(const std::string& tag) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir =
      std::filesystem::path(tmp != nullptr ? tmp : std::filesystem::temp_directory_path()) /
      ("pipe_" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::vector<double> UnevenRatios(int n) {
  if (n == 1) return {1.0};
  std::vector<double> r;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += 1.0 + 0.7 * i;
  for (int i = 0; i < n; ++i) r.push_back((1.0 + 0.7 * i) / sum);
  return r;
}

std::string PipelineCaseName(const PipelineCase& c) {
  std::string groups;
  for (int n : c.group_sizes) groups += std::to_string(n);
  return absl::StrCat(c.model, "_", c.group_sizes.size(), "stages_", groups, "_mb", c.microbatches,
                      "_", c.kind, c.adam ? "_adam" : "_sgd", c.whole ? "_whole" : "",
                      c.overlap ? "_overlap" : "", c.cuts.empty() ? "" : "_cuts");
}

std::string PipelineCaseTestName(const ::testing::TestParamInfo<PipelineCase>& info) {
  return PipelineCaseName(info.param);
}

absl::StatusOr<LoweredPipeline> LowerPipeline(const graph::Graph& g, const PipelineCase& c,
                                              BoundaryPieces pieces) {
  LoweredPipeline out;
  auto micro = pipeline::Rebatch(g, kPipelineBatch / c.microbatches);
  if (!micro.ok()) return micro.status();
  out.micro = std::make_shared<graph::Graph>(*std::move(micro));
  const graph::Graph& m = *out.micro;
  auto stages = CutStages(m, c);
  if (!stages.ok()) return stages.status();
  out.layout.microbatches = c.microbatches;
  out.layout.clip = c.adam;  // the equivalence optimizers clip with Adam
  int rank = 0;
  for (size_t s = 0; s < stages->size(); ++s) {
    const StageCut& cut = (*stages)[s];
    lower::StageSpec spec;
    spec.begin_op = cut.begin_op;
    spec.end_op = cut.end_op;
    spec.microbatches = c.microbatches;
    const int n = c.group_sizes[s];
    std::vector<double> ratios = UnevenRatios(n);
    absl::StatusOr<synth::Program> whole = lower::SingleDeviceProgram(m);
    if (n > 1) whole = ProgramOfKind(m, n, c.kind, ratios);
    if (!whole.ok()) return whole.status();
    synth::Program sub;
    for (int k = spec.begin_op; k < spec.end_op; ++k) sub.steps.push_back(whole->steps[k]);
    auto form_of = [&](graph::TensorId t) {
      const graph::Tensor& x = m.tensor(t);
      return whole->steps[x.producer].rule.outputs[x.producer_output];
    };
    if (cut.input >= 0) {
      spec.input = cut.input;
      spec.input_form = form_of(spec.input);
    }
    if (cut.output >= 0) {
      spec.output = cut.output;
      spec.output_form = form_of(spec.output);
    }
    lower::LowerOptions lo;
    lo.world_size = n;
    lo.ratios = ratios;
    lo.optimizer = EquivalenceOptimizer(c.adam);
    lo.seed = kPipelineSeed;
    lo.overlap = c.overlap;
    lo.gradient_bucket_bytes = c.overlap ? 4096 : 0;  // several buckets per stage
    auto progs = lower::LowerStage(m, sub, spec, lo);
    if (!progs.ok()) return progs.status();
    std::vector<int> group;
    for (int r = 0; r < n; ++r) {
      group.push_back(rank++);
      out.programs.push_back((*progs)[r]);
    }
    out.layout.stage_ranks.push_back(group);
  }
  if (pieces == BoundaryPieces::kAdd) {
    absl::Status added = executor::AddBoundaryPieces(out.layout, out.programs);
    if (!added.ok()) return added;
  }
  return out;
}

const TrainResult& SingleDeviceReference(const graph::Graph& g, const std::string& model, bool adam,
                                         int steps) {
  const std::string key = absl::StrCat(model, adam, "_", steps);
  if (!References().count(key)) {
    lower::LowerOptions lo;
    lo.optimizer = EquivalenceOptimizer(adam);
    lo.seed = kPipelineSeed;
    auto ref = RunLoweredOverGloo(g, lower::SingleDeviceProgram(g), lo, steps, "ref_" + key);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (!ref.ok()) return *new TrainResult();
    References()[key] = *std::move(ref);
  }
  return References()[key][0];
}

void ExpectMatchesReference(const std::vector<TrainResult>& runs, const TrainResult& ref, bool adam,
                            int steps) {
  ASSERT_FALSE(ref.losses.empty());
  for (size_t r = 0; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].losses.size(), ref.losses.size());
    for (int s = 0; s < steps; ++s) {
      const double want = ref.losses[s], got = runs[r].losses[s];
      EXPECT_NEAR(got, want, 2e-5 * std::abs(want) + 2e-6) << "rank " << r << " step " << s;
    }
  }
  auto deviations = CompareRunsWithReference(runs, ref);
  ASSERT_TRUE(deviations.ok()) << deviations.status();
  for (const auto& d : *deviations) {
    // Adam normalises each step to about lr, so float noise on a tiny
    // gradient moves an element by up to a fraction of lr: allow 1e-3 of
    // the total step length lr * steps on top.
    const double tol = 1e-4 * d.scale + (adam ? 1e-3 * kEquivalenceAdamLr * steps : 0.0);
    EXPECT_LE(d.worst, tol) << "parameter " << d.name << " element " << d.at << ": " << d.got
                            << " vs " << d.want;
  }
}

}  // namespace hap::testing
