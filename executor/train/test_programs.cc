#include "executor/train/test_programs.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/data/batches.h"
#include "planner/graph/zoo.h"
#include "planner/synth/checker.h"
#include "planner/synth/planner.h"
#include "planner/synth/search.h"

namespace hap::testing {

cost::ClusterModel SlowDevicesFastLinks(int n) {
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < n; ++i) {
    d.push_back({"cpu" + std::to_string(i), "node0", "test", 1e7 * (1 + i % 2),
                 int64_t{1} << 34, 0});
  }
  std::vector<std::vector<double>> bw(n, std::vector<double>(n, 1e12)),
      lat(n, std::vector<double>(n, 0));
  return *cost::ClusterModel::Create(d, bw, lat);
}

// batch_norm_equivalence_test's CNN: conv2d, batch_norm with running
// statistics, relu, a depthwise conv2d with channel multiplier 2,
// drop_path, avg_pool2d, linear, cross-entropy.
absl::StatusOr<graph::Graph> BatchNormCnn(int64_t batch) {
  using graph::F32;
  using graph::Initializer;
  graph::GraphBuilder b("bn_cnn");
  graph::TensorId x = b.Input("images", F32({batch, 3, 6, 6}));
  graph::TensorId labels = b.Input("labels", graph::I64({batch}), graph::InputRole::kLabels);
  graph::TensorId w =
      b.Parameter("conv.weight", F32({4, 3, 3, 3}), Initializer::Uniform(-0.3, 0.3));
  graph::TensorId gamma = b.Parameter("bn.weight", F32({4}), Initializer::Ones());
  graph::TensorId beta = b.Parameter("bn.bias", F32({4}), Initializer::Zeros());
  graph::TensorId rm = b.Parameter("bn.running_mean", F32({4}), Initializer::Zeros(),
                                   /*frozen=*/true);
  graph::TensorId rv = b.Parameter("bn.running_var", F32({4}), Initializer::Ones(),
                                   /*frozen=*/true);
  x = b.Add("conv2d", "conv", {x, w}, {{"padding", std::vector<int64_t>{1}}});
  x = b.Add("batch_norm", "bn", {x, gamma, beta, rm, rv}, {{"momentum", 0.3}});
  x = b.Add("relu", "relu", {x});
  graph::TensorId dw = b.Parameter("dw.weight", F32({8, 1, 3, 3}), Initializer::Uniform(-0.5, 0.5));
  graph::TensorId dwb = b.Parameter("dw.bias", F32({8}), Initializer::Uniform(-0.1, 0.1));
  x = b.Add("conv2d", "dw", {x, dw, dwb},
            {{"padding", std::vector<int64_t>{1}}, {"groups", int64_t{4}}});
  x = b.Add("drop_path", "drop_path", {x}, {{"p", 0.4}});
  x = b.Add("avg_pool2d", "pool", {x}, {{"kernel", std::vector<int64_t>{2}}});
  x = b.Add("flatten", "flatten", {x});
  graph::TensorId fw = b.Parameter("fc.weight", F32({5, 72}), Initializer::Uniform(-0.2, 0.2));
  graph::TensorId fb = b.Parameter("fc.bias", F32({5}), Initializer::Zeros());
  x = b.Add("linear", "fc", {x, fw, fb});
  b.SetLoss(b.Add("cross_entropy", "loss", {x, labels}));
  return b.Build();
}

// lstm_equivalence_test's language model: embedding, two lstm layers (the
// second reversed), linear, cross-entropy.
absl::StatusOr<graph::Graph> LstmLm(int64_t batch) {
  using graph::F32;
  using graph::Initializer;
  constexpr int64_t kSeq = 5, kVocab = 11, kEmbed = 6, kHidden = 7;
  graph::GraphBuilder b("lstm_lm");
  graph::TensorId tokens = b.Input("tokens", graph::I64({batch, kSeq}));
  graph::TensorId labels = b.Input("labels", graph::I64({batch * kSeq}), graph::InputRole::kLabels);
  const double w = 1.0 / std::sqrt(static_cast<double>(kHidden));
  auto param = [&](const std::string& name, graph::Shape s) {
    return b.Parameter(name, F32(std::move(s)), Initializer::Uniform(-w, w));
  };
  graph::TensorId x = b.Add(
      "embedding", "embed",
      {tokens, b.Parameter("embed.weight", F32({kVocab, kEmbed}), Initializer::Normal(0, 1))});
  x = b.Add("lstm", "lstm.l0",
            {x, param("lstm.weight_ih_l0", {4 * kHidden, kEmbed}),
             param("lstm.weight_hh_l0", {4 * kHidden, kHidden}),
             param("lstm.bias_ih_l0", {4 * kHidden}), param("lstm.bias_hh_l0", {4 * kHidden})});
  x = b.Add("lstm", "lstm.l1",
            {x, param("lstm.weight_ih_l1", {4 * kHidden, kHidden}),
             param("lstm.weight_hh_l1", {4 * kHidden, kHidden})},
            {{"reverse", true}});
  x = b.Add("linear", "head",
            {x, param("head.weight", {kVocab, kHidden}), param("head.bias", {kVocab})});
  x = b.Add("reshape", "flat", {x}, {{"shape", std::vector<int64_t>{batch * kSeq, kVocab}}});
  b.SetLoss(b.Add("cross_entropy", "loss", {x, labels}));
  return b.Build();
}

absl::StatusOr<graph::Graph> EquivalenceModel(const std::string& name, int ranks) {
  // Batches divisible by nothing in particular: uneven shards everywhere.
  std::map<std::string, double> p;
  int batch = 6 * ranks + 1;
  if (name == "bn_cnn") return BatchNormCnn(batch);
  if (name == "lstm") return LstmLm(batch);
  if (name == "mlp") {
    p = {{"layers", 3}, {"hidden", 24}, {"input", 12}, {"classes", 5}, {"batch", batch}};
  } else if (name == "gpt") {
    p = {{"layers", 2}, {"hidden", 16}, {"heads", 4},     {"ffn", 24},
         {"seq", 6},    {"vocab", 37},  {"batch", batch}, {"dropout", 0.1}};
  } else if (name == "vit") {
    p = {{"layers", 1}, {"hidden", 16},  {"heads", 4},   {"ffn", 24},      {"image", 8},
         {"patch", 4},  {"channels", 3}, {"classes", 5}, {"batch", batch}, {"dropout", 0.1}};
  } else if (name == "moe" || name == "switch" || name == "moe_grouped" ||
             name == "switch_grouped") {
    const bool top2 = name.rfind("moe", 0) == 0;
    p = {{"layers", 2},
         {"hidden", 16},
         {"heads", 4},
         {"ffn", 24},
         {"seq", 4},
         {"vocab", 29},
         {"batch", batch},
         {"dropout", 0.0},
         {"experts", 2 * ranks + 2},
         {"moe_every", 2},
         {"top_k", top2 ? 2 : 1}};
    // Grouped routing: every 2 tokens of a sample route together.
    if (name.find("grouped") != std::string::npos) p["moe_group_size"] = 2;
  } else if (name == "transformer") {
    p = {{"layers", 1}, {"hidden", 16}, {"heads", 4},     {"ffn", 24},
         {"seq", 5},    {"classes", 5}, {"batch", batch}, {"dropout", 0.1}};
  } else if (name == "vgg") {
    p = {{"width", 4},    {"stages", 2},  {"convs_per_stage", 1}, {"image", 8},
         {"channels", 3}, {"classes", 5}, {"hidden", 12},         {"batch", batch}};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("no equivalence model '", name, "'"));
  }
  return graph::BuildZooModel(name.substr(0, name.find('_')), p);
}

std::vector<double> EquivalenceRatios(int n, bool uneven) {
  std::vector<double> r(n, 1.0 / n);
  if (!uneven || n == 1) return r;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += r[i] = 1.0 + 0.6 * i;
  for (double& x : r) x /= sum;
  return r;
}

absl::StatusOr<synth::Program> ProgramOfKind(const graph::Graph& g, int n,
                                             const std::string& kind,
                                             const std::vector<double>& ratios) {
  synth::SearchOptions o;
  o.ratios = ratios;
  o.allow_sfb = kind == "mix";
  o.max_seconds = 20;
  const bool zero = kind == "zero" || kind == "zero2";
  if (kind == "dp" || kind == "sfb" || zero) {
    o.rule_filter = synth::DataParallelRule;
    o.force_storage = zero ? synth::ParamStorage::kZero : synth::ParamStorage::kReplicated;
  } else if (kind == "tp") {
    o.rule_filter = synth::TensorParallelRule;
  } else if (kind == "vocab") {
    // Anything but a loss over rows split by sample: the loss must shard
    // its logits by class (or stay whole, which the search finds slower).
    o.rule_filter = [](const synth::ShardRule& r) {
      return !(r.name == "data(0)" && r.inputs.size() == 2 && r.inputs[1].is_sharded() &&
               r.outputs.size() == 1 && r.outputs[0].is_partial());
    };
  } else if (kind == "expert") {
    // Mixture of experts split by experts: the MoE ops' other splits are
    // left out (checked below: every dispatch and combine takes "expert").
    o.rule_filter = [](const synth::ShardRule& r) {
      return r.name != "tokens" && r.name != "features";
    };
  } else if (kind == "groups") {
    // Grouped MoE routing split by whole groups of tokens: the MoE ops
    // take their "groups" rules (or stay whole) and the experts' FFN splits
    // by experts, so the dispatched tokens reach their experts by an
    // all-to-all (checked below).
    o.rule_filter = [](const synth::ShardRule& r) {
      return r.name != "tokens" && r.name != "features" && r.name != "expert" &&
             r.name.rfind("batch", 0) != 0;
    };
  } else if (kind != "mix") {
    return absl::InvalidArgumentError(absl::StrCat("unknown program kind '", kind, "'"));
  }
  auto p = synth::Synthesize(g, SlowDevicesFastLinks(n), o);
  if (!p.ok()) return p.status();
  if (kind == "zero2") {
    int once = 0;
    for (synth::OpStep& s : p->steps) {
      for (synth::SourceLoad& l : s.loads) {
        if (l.parameter && l.storage == synth::ParamStorage::kZero) {
          l.gather_once = true;
          ++once;
        }
      }
    }
    if (once == 0) return absl::FailedPreconditionError("no ZeRO parameter to gather once");
  }
  if (kind == "vocab") {
    bool vocab = false;
    for (const synth::OpStep& s : p->steps) vocab = vocab || s.rule.name == "vocab";
    if (!vocab) return absl::FailedPreconditionError("the loss does not shard by class");
  }
  if (kind == "expert") {
    int moe = 0;
    for (const synth::OpStep& s : p->steps) {
      const std::string& type = g.op(s.op).type;
      if (type != "moe_dispatch_idx" && type != "moe_combine_idx" &&
          type != "moe_dispatch" && type != "moe_combine") {
        continue;
      }
      ++moe;
      if (s.rule.name != "expert") {
        return absl::FailedPreconditionError(absl::StrCat(
            "op '", g.op(s.op).name, "' is not split by experts (rule '",
            s.rule.name, "')"));
      }
    }
    if (moe == 0) return absl::FailedPreconditionError("no MoE dispatch or combine");
  }
  if (kind == "groups") {
    int grouped = 0, all_to_all = 0;
    for (const synth::OpStep& s : p->steps) {
      const std::string& type = g.op(s.op).type;
      if (type == "moe_dispatch_idx" || type == "moe_combine_idx") {
        if (s.rule.name != "groups") {
          return absl::FailedPreconditionError(absl::StrCat(
              "op '", g.op(s.op).name, "' is not split by groups (rule '", s.rule.name, "')"));
        }
        ++grouped;
      }
      for (const synth::CommStep& c : s.comms) {
        all_to_all += c.forward == synth::Collective::kAllToAll;
      }
    }
    if (grouped == 0) return absl::FailedPreconditionError("no grouped MoE dispatch or combine");
    if (all_to_all == 0) {
      return absl::FailedPreconditionError("the dispatched tokens reach no expert by all-to-all");
    }
  }
  if (kind == "sfb") {
    int forced = 0;
    for (synth::OpStep& s : p->steps) {
      if (g.op(s.op).type != "linear" || s.rule.kind != synth::RuleKind::kData) continue;
      for (synth::SourceLoad& l : s.loads) {
        if (l.parameter && l.grad_allreduce && l.tensor == g.op(s.op).inputs[1]) {
          l.grad_allreduce = false;
          l.sfb = true;
          ++forced;
        }
      }
    }
    if (forced == 0) {
      return absl::FailedPreconditionError("no data-parallel linear weight to force SFB on");
    }
  }
  absl::Status check = synth::CheckProgram(g, *p, n);
  if (!check.ok()) return check;
  return p;
}

hap::v1::OptimizerConfig EquivalenceOptimizer(bool adam) {
  hap::v1::OptimizerConfig o;
  if (adam) {
    o.set_kind(hap::v1::OptimizerConfig::ADAM);
    o.set_learning_rate(kEquivalenceAdamLr);
    o.set_weight_decay(0.01);
    o.set_clip_global_norm(0.5);
    // Adam divides by the gradient's magnitude, so a gradient that is zero
    // in exact arithmetic (the attention key bias) steps by +-lr on float
    // noise alone; a larger epsilon keeps such noise from being amplified.
    o.set_epsilon(1e-6);
  } else {
    o.set_kind(hap::v1::OptimizerConfig::SGD);
    o.set_learning_rate(0.1);
    o.set_momentum(0.9);
    o.set_weight_decay(1e-3);
  }
  return o;
}

absl::StatusOr<std::vector<ParameterDeviation>> CompareRunsWithReference(
    const std::vector<executor::TrainResult>& runs, const executor::TrainResult& ref) {
  std::vector<std::vector<executor::ParameterShard>> pieces;
  for (const auto& run : runs) pieces.push_back(run.parameters);
  HAP_ASSIGN_OR_RETURN(auto got, executor::AssembleParameters(pieces));
  HAP_ASSIGN_OR_RETURN(auto want, executor::AssembleParameters({ref.parameters}));
  return CompareParameters(got, want);
}

absl::StatusOr<std::vector<ParameterDeviation>> CompareParameters(
    const std::map<std::string, executor::HostTensor>& got,
    const std::map<std::string, executor::HostTensor>& want) {
  if (got.size() != want.size()) {
    return absl::InvalidArgumentError(absl::StrCat(got.size(), " parameters, expected ",
                                                   want.size()));
  }
  std::vector<ParameterDeviation> out;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) return absl::InvalidArgumentError(absl::StrCat("no parameter ", name));
    const executor::HostTensor& h = it->second;
    if (h.shape() != w.shape()) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", name, " has another shape"));
    }
    ParameterDeviation d;
    d.name = name;
    const float* a = h.as<float>();
    const float* b = w.as<float>();
    for (int64_t i = 0; i < w.num_elements(); ++i) {
      d.scale = std::max(d.scale, std::abs(double{b[i]}));
      double diff = std::abs(double{a[i]} - double{b[i]});
      // A NaN compares false: as far off as can be.
      if (std::isnan(diff)) diff = std::numeric_limits<double>::infinity();
      if (diff > d.worst) {
        d.worst = diff;
        d.at = i;
      }
    }
    if (w.num_elements() > 0) {
      d.got = a[d.at];
      d.want = b[d.at];
    }
    out.push_back(d);
  }
  return out;
}

absl::StatusOr<std::vector<executor::TrainResult>> RunLoweredOverGloo(
    const graph::Graph& g, const synth::Program& p, const lower::LowerOptions& lo, int steps,
    const std::string& tag, const executor::RunnerOptions& runner) {
  auto programs = lower::Lower(g, p, lo);
  if (!programs.ok()) return programs.status();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(tmp != nullptr ? tmp : std::filesystem::temp_directory_path()) /
      ("rdv_" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  executor::TrainOptions to;
  to.steps = steps;
  executor::LocalRanksOptions lro;
  lro.rendezvous_dir = dir.string();
  lro.prefix = tag;
  lro.timeout = absl::Seconds(60);
  lro.runner = runner;
  const uint64_t seed = lo.seed;
  return executor::RunLocalRanks(
      *programs, g, [&](int) { return data::NewSyntheticBatches(g, seed); }, to, lro);
}

}  // namespace hap::testing
