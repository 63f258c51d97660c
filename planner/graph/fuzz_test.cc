// Random mutations of valid graphs (fixed seed): FromProto either accepts
// the result, and then the graph is internally consistent, or rejects it
// with an InvalidArgument error that says something. It never crashes.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/op_registry.h"
#include "planner/graph/test_util.h"
#include "planner/graph/zoo.h"

namespace hap::graph {
namespace {

using Rng = std::mt19937_64;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

// Small zoo models and hand-built graphs covering every op family.
std::vector<hap::v1::Graph> Seeds() {
  std::vector<hap::v1::Graph> out;
  const std::map<std::string, double> common = {
      {"layers", 2}, {"hidden", 16}, {"batch", 2}};
  const std::map<std::string, std::map<std::string, double>> extra = {
      {"mlp", {{"input", 8}, {"classes", 3}}},
      {"transformer", {{"heads", 2}, {"ffn", 32}, {"seq", 4}, {"classes", 3}}},
      {"gpt", {{"heads", 2}, {"ffn", 32}, {"seq", 4}, {"vocab", 11}}},
      {"vit",
       {{"heads", 2}, {"ffn", 32}, {"image", 8}, {"patch", 4}, {"classes", 3}}},
      {"moe",
       {{"heads", 2}, {"ffn", 32}, {"seq", 4}, {"vocab", 11}, {"experts", 4}}},
      {"switch",
       {{"heads", 2}, {"ffn", 32}, {"seq", 4}, {"vocab", 11}, {"experts", 4}}},
      {"vgg",
       {{"width", 4},
        {"stages", 2},
        {"convs_per_stage", 1},
        {"image", 8},
        {"classes", 3}}},
  };
  for (const auto& [name, params] : extra) {
    std::map<std::string, double> p = params;
    for (const auto& [k, v] : common) {
      if (name != "vgg" || k != "layers") p[k] = v;
    }
    auto g = BuildZooModel(name, p);
    EXPECT_TRUE(g.ok()) << name << ": " << g.status();
    if (g.ok()) out.push_back(ToProto(*g));
  }
  {
    // Layout ops, pooling, masks and reductions.
    using I = std::vector<int64_t>;
    GraphBuilder b("layout");
    TensorId img = b.Input("img", F32({2, 3, 6, 6}));
    TensorId y = b.Input("y", I64({2}), InputRole::kLabels);
    TensorId w = b.Parameter("w", F32({4, 3, 3, 3}), Initializer::Normal(0, 1));
    TensorId h = b.Add("conv2d", "conv", {img, w}, {{"padding", I{1}}});
    h = b.Add("max_pool2d", "pool", {h},
              {{"kernel", I{2}}, {"stride", I{2, 2}}, {"padding", I{1}}});
    h = b.Add("adaptive_avg_pool2d", "gap", {h}, {{"output_size", I{2, 2}}});
    h = b.Add("flatten", "flat", {h}, {{"start_dim", int64_t{1}}});
    auto parts = b.AddOp("split", "split", {h},
                         {{"axis", int64_t{-1}}, {"sizes", I{6, 10}}});
    TensorId a = parts.empty() ? -1 : parts[0];
    TensorId c = parts.empty() ? -1 : parts[1];
    a = b.Add(
        "slice", "slice", {a},
        {{"axis", int64_t{1}}, {"start", int64_t{1}}, {"end", int64_t{5}}});
    TensorId m = b.Parameter("mask", F32({1, 4}), Initializer::Zeros(), true);
    a = b.Add("softmax", "sm", {a, m});
    a = b.Add("sigmoid", "sig", {a});
    c = b.Add("tanh", "tanh", {c});
    c = b.Add("mean", "red", {c}, {{"axes", I{1}}, {"keepdims", true}});
    c = b.Add("expand", "exp", {c}, {{"shape", I{2, 4}}});
    TensorId j = b.Add("concat", "cat", {a, c, a}, {{"axis", int64_t{1}}});
    j = b.Add("transpose", "tr", {j}, {{"perm", I{1, 0}}});
    j = b.Add("reshape", "rs", {j}, {{"shape", I{2, -1}}});
    TensorId v = b.Parameter("v", F32({12, 3}), Initializer::Uniform(-1, 1));
    j = b.Add("matmul", "mm", {j, v});
    j = b.Add("sub", "sub", {j, b.Add("mul", "mul", {j, j})});
    j = b.Add("scale", "sc", {j}, {{"factor", 0.5}});
    b.SetLoss(b.Add("cross_entropy", "loss", {j, y}));
    auto g = b.Build();
    EXPECT_TRUE(g.ok()) << g.status();
    if (g.ok()) out.push_back(ToProto(*g));
  }
  return out;
}

template <typename T>
T Pick(Rng& rng, const std::vector<T>& v) {
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

int Index(Rng& rng, int n) {
  return std::uniform_int_distribution<int>(0, n - 1)(rng);
}

int64_t WildInt(Rng& rng) {
  return Pick<int64_t>(
      rng, {0, -1, 1, 2, 3, -2, 7, 64, int64_t{1} << 31, int64_t{1} << 40,
            int64_t{1} << 62, kMax, kMin, kMax - 1, kMin + 1});
}

std::vector<std::string> TensorNames(const hap::v1::Graph& p) {
  std::vector<std::string> names;
  for (const auto& in : p.inputs()) names.push_back(in.tensor().name());
  for (const auto& par : p.parameters()) names.push_back(par.tensor().name());
  for (const auto& op : p.ops()) {
    for (const auto& o : op.outputs()) names.push_back(o);
  }
  return names;
}

hap::v1::TensorSpec* AnySpec(Rng& rng, hap::v1::Graph& p) {
  int n = p.inputs_size() + p.parameters_size() + p.value_info_size();
  if (n == 0) return nullptr;
  int i = Index(rng, n);
  if (i < p.inputs_size()) return p.mutable_inputs(i)->mutable_tensor();
  i -= p.inputs_size();
  if (i < p.parameters_size()) return p.mutable_parameters(i)->mutable_tensor();
  return p.mutable_value_info(i - p.parameters_size());
}

void MutateAttr(Rng& rng, hap::v1::Op* op) {
  auto* attrs = op->mutable_attrs();
  std::vector<std::string> keys;
  for (const auto& [k, v] : *attrs) keys.push_back(k);
  if (keys.empty() || Index(rng, 4) == 0) {
    keys.push_back(Pick<std::string>(
        rng, {"axis",   "axes",    "perm",        "shape",     "sizes",
              "start",  "end",     "k",           "capacity",  "kernel",
              "stride", "padding", "output_size", "p",         "eps",
              "factor", "causal",  "keepdims",    "start_dim", "end_dim"}));
  }
  const std::string key = Pick(rng, keys);
  hap::v1::AttrValue& v = (*attrs)[key];
  switch (Index(rng, 9)) {
    case 0:
      attrs->erase(key);
      break;
    case 1:
      v.set_i(WildInt(rng));
      break;
    case 2:
      v.set_f(Pick<double>(
          rng, {0.0, -1.0, 0.5, 1.0, 1e300,
                std::numeric_limits<double>::infinity(), std::nan("")}));
      break;
    case 3:
      v.set_s("garbage");
      break;
    case 4:
      v.set_b(Index(rng, 2) == 0);
      break;
    case 5: {
      v.mutable_ints()->clear_values();
      int n = Index(rng, 5);
      for (int i = 0; i < n; ++i) v.mutable_ints()->add_values(WildInt(rng));
      break;
    }
    case 6:
      if (v.has_ints() && v.ints().values_size() > 0) {
        v.mutable_ints()->set_values(Index(rng, v.ints().values_size()),
                                     WildInt(rng));
      } else {
        v.set_i(Index(rng, 9) - 4);  // an in- or out-of-range axis
      }
      break;
    case 7:
      v.mutable_floats()->add_values(0.5);
      break;
    default:
      v.Clear();  // no value set
      break;
  }
}

// One random mutation of `p`.
void Mutate(Rng& rng, hap::v1::Graph& p,
            const std::vector<std::string>& op_types) {
  const std::vector<std::string> names = TensorNames(p);
  hap::v1::Op* op =
      p.ops_size() > 0 ? p.mutable_ops(Index(rng, p.ops_size())) : nullptr;
  switch (Index(rng, 20)) {
    case 0: {  // a dim to 0, -1, huge or small; or a dim added or removed
      hap::v1::TensorSpec* s = AnySpec(rng, p);
      if (s == nullptr) break;
      int r = Index(rng, 4);
      if (r == 0) {
        s->add_shape(WildInt(rng));
      } else if (r == 1 && s->shape_size() > 0) {
        s->mutable_shape()->RemoveLast();
      } else if (s->shape_size() > 0) {
        s->set_shape(Index(rng, s->shape_size()), WildInt(rng));
      }
      break;
    }
    case 1:  // swap two inputs of an op
      if (op && op->inputs_size() >= 2) {
        op->mutable_inputs()->SwapElements(Index(rng, op->inputs_size()),
                                           Index(rng, op->inputs_size()));
      }
      break;
    case 2:  // delete an input of an op
      if (op && op->inputs_size() > 0) {
        op->mutable_inputs()->DeleteSubrange(Index(rng, op->inputs_size()), 1);
      }
      break;
    case 3:  // add an input to an op
      if (op) op->add_inputs(Pick(rng, names));
      break;
    case 4:  // rename a tensor reference
      if (op && op->inputs_size() > 0) {
        op->set_inputs(Index(rng, op->inputs_size()), Index(rng, 3) == 0
                                                          ? "no_such_tensor"
                                                          : Pick(rng, names));
      }
      break;
    case 5:  // change an op's type
      if (op) {
        op->set_type(Index(rng, 8) == 0 ? "garbage" : Pick(rng, op_types));
      }
      break;
    case 6:  // delete an op
      if (p.ops_size() > 0) {
        p.mutable_ops()->DeleteSubrange(Index(rng, p.ops_size()), 1);
      }
      break;
    case 7:  // delete a parameter
      if (p.parameters_size() > 0) {
        p.mutable_parameters()->DeleteSubrange(Index(rng, p.parameters_size()),
                                               1);
      }
      break;
    case 8:  // delete an input
      if (p.inputs_size() > 0) {
        p.mutable_inputs()->DeleteSubrange(Index(rng, p.inputs_size()), 1);
      }
      break;
    case 9:
    case 10:  // change attributes
      if (op) MutateAttr(rng, op);
      break;
    case 11: {  // change a dtype
      hap::v1::TensorSpec* s = AnySpec(rng, p);
      if (s) s->set_dtype(static_cast<hap::v1::DType>(Index(rng, 9)));
      break;
    }
    case 12:  // change the loss name
      p.set_loss(Index(rng, 4) == 0 ? (Index(rng, 2) ? "" : "no_such_tensor")
                                    : Pick(rng, names));
      break;
    case 13:  // duplicate or add an output
      if (op) {
        op->add_outputs(Index(rng, 2) == 0 && op->outputs_size() > 0
                            ? op->outputs(0)
                            : Pick(rng, names));
      }
      break;
    case 14:  // rename an output (to an existing name, or to "")
      if (op && op->outputs_size() > 0) {
        op->set_outputs(Index(rng, op->outputs_size()),
                        Index(rng, 4) == 0 ? "" : Pick(rng, names));
      }
      break;
    case 15: {  // a value_info entry, right or wrong
      auto* vi = p.add_value_info();
      vi->set_name(Index(rng, 6) == 0 ? "no_such_tensor" : Pick(rng, names));
      vi->set_dtype(static_cast<hap::v1::DType>(Index(rng, 8)));
      int rank = Index(rng, 4);
      for (int i = 0; i < rank; ++i) vi->add_shape(Index(rng, 5));
      break;
    }
    case 16: {  // shuffle the ops (must not change the result)
      for (int i = p.ops_size() - 1; i > 0; --i) {
        p.mutable_ops()->SwapElements(i, Index(rng, i + 1));
      }
      break;
    }
    case 17:  // an op name to "" or a duplicate
      if (op) op->set_name(Index(rng, 2) == 0 ? "" : p.ops(0).name());
      break;
    case 18:  // an initializer
      if (p.parameters_size() > 0) {
        auto* init = p.mutable_parameters(Index(rng, p.parameters_size()))
                         ->mutable_init();
        init->set_kind(static_cast<hap::v1::Initializer::Kind>(Index(rng, 7)));
        double x = Pick<double>(rng, {-1.0, 0.0, 2.0, std::nan(""),
                                      std::numeric_limits<double>::infinity()});
        switch (Index(rng, 4)) {
          case 0:
            init->set_stddev(x);
            break;
          case 1:
            init->set_low(x);
            break;
          case 2:
            init->set_value(x);
            break;
          default:
            init->set_high(x);
        }
      }
      break;
    default:  // an op's scope
      if (op) op->set_scope(Index(rng, 2) == 0 ? "" : "a/b");
      break;
  }
}

// The checks on one candidate; returns whether it was accepted.
bool Check(const hap::v1::Graph& p, const std::string& what) {
  auto g = FromProto(p);
  if (!g.ok()) {
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument)
        << what << ": " << g.status();
    EXPECT_FALSE(g.status().message().empty()) << what;
    return false;
  }
  const int64_t params = g->ParameterCount();
  const double fwd = g->ForwardFlops();
  const double train = g->TrainingFlops();
  EXPECT_GE(params, 0) << what;
  EXPECT_GE(g->TrainableParameterCount(), 0) << what;
  EXPECT_LE(g->TrainableParameterCount(), params) << what;
  EXPECT_TRUE(std::isfinite(fwd) && fwd >= 0) << what << ": " << fwd;
  EXPECT_TRUE(std::isfinite(train) && train >= fwd) << what << ": " << train;
  for (size_t i = 0; i < g->tensors().size(); ++i) {
    const Tensor& t = g->tensor(static_cast<TensorId>(i));
    EXPECT_EQ(g->FindTensor(t.name), std::optional<TensorId>(i)) << what;
    EXPECT_TRUE(CheckedNumElements(t.type.shape).ok()) << what << " " << t.name;
    if (t.kind == TensorKind::kActivation) {
      EXPECT_LT(t.producer, static_cast<OpId>(g->ops().size())) << what;
    }
  }
  for (size_t i = 0; i < g->ops().size(); ++i) {
    for (TensorId in : g->op(static_cast<OpId>(i)).inputs) {
      const Tensor& t = g->tensor(in);
      // Topological: every input is defined before the op.
      EXPECT_TRUE(t.kind != TensorKind::kActivation ||
                  t.producer < static_cast<OpId>(i))
          << what;
    }
  }
  auto back = FromProto(ToProto(*g));
  EXPECT_TRUE(back.ok()) << what << ": " << back.status();
  if (back.ok()) {
    EXPECT_EQ(back->ParameterCount(), params) << what;
    EXPECT_EQ(back->ForwardFlops(), fwd) << what;
    EXPECT_EQ(back->tensors().size(), g->tensors().size()) << what;
  }
  return true;
}

TEST(FuzzTest, MutatedGraphsAreAcceptedConsistentlyOrRejected) {
  const std::vector<hap::v1::Graph> seeds = Seeds();
  ASSERT_EQ(seeds.size(), 8u);
  std::vector<std::string> op_types;
  for (const OpDef* d : OpRegistry::Global().All()) op_types.push_back(d->type);

  for (const auto& s : seeds) ASSERT_TRUE(Check(s, s.name())) << s.name();

  Rng rng(20240607);
  constexpr int kCases = 3000;
  int accepted = 0;
  for (int i = 0; i < kCases; ++i) {
    hap::v1::Graph p = seeds[i % seeds.size()];
    const int mutations = 1 + Index(rng, 3);
    for (int m = 0; m < mutations; ++m) Mutate(rng, p, op_types);
    if (Check(p, absl::StrCat("case ", i, " (", p.name(), ")"))) ++accepted;
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "first failing case " << i << ":\n" << p.DebugString();
      break;
    }
  }
  ::testing::Test::RecordProperty("accepted", accepted);
  // Both outcomes are exercised.
  EXPECT_GT(accepted, kCases / 20);
  EXPECT_LT(accepted, kCases - kCases / 20);
}

// Every integer attribute of one op of each type, in turn set to each
// extreme value (whole list, and one entry at a time): overflow-prone
// arithmetic on attributes (padding, kernel, sizes, capacity, ...) is
// rejected or sane, never undefined.
TEST(FuzzTest, ExtremeAttributeValues) {
  const std::vector<int64_t> values = {0,
                                       -1,
                                       1,
                                       -7,
                                       int64_t{1} << 31,
                                       int64_t{1} << 40,
                                       int64_t{1} << 62,
                                       kMax,
                                       kMin,
                                       kMax - 1,
                                       kMin + 1};
  int cases = 0;
  for (const auto& seed : Seeds()) {
    std::set<std::string> seen;
    for (int i = 0; i < seed.ops_size(); ++i) {
      if (!seen.insert(seed.ops(i).type()).second) continue;
      for (const auto& [key, attr] : seed.ops(i).attrs()) {
        for (int64_t v : values) {
          std::vector<hap::v1::Graph> variants;
          if (attr.has_i()) {
            variants.push_back(seed);
            (*variants.back().mutable_ops(i)->mutable_attrs())[key].set_i(v);
          } else if (attr.has_ints()) {
            const int n = attr.ints().values_size();
            for (int j = -1; j < n; ++j) {
              variants.push_back(seed);
              auto* ints =
                  (*variants.back().mutable_ops(i)->mutable_attrs())[key]
                      .mutable_ints();
              for (int e = 0; e < n; ++e) {
                if (j < 0 || e == j) ints->set_values(e, v);
              }
            }
          }
          for (const auto& p : variants) {
            ++cases;
            Check(p, absl::StrCat(seed.name(), " op ", seed.ops(i).name(), " ",
                                  key, " = ", v));
          }
        }
      }
    }
  }
  ::testing::Test::RecordProperty("cases", cases);
  EXPECT_GT(cases, 300);
}

// Shuffling the ops never changes the graph.
TEST(FuzzTest, OpOrderDoesNotMatter) {
  Rng rng(7);
  for (const auto& seed : Seeds()) {
    auto want = FromProto(seed);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int rep = 0; rep < 5; ++rep) {
      hap::v1::Graph p = seed;
      for (int i = p.ops_size() - 1; i > 0; --i) {
        p.mutable_ops()->SwapElements(i, Index(rng, i + 1));
      }
      auto g = FromProto(p);
      ASSERT_TRUE(g.ok()) << g.status();
      testing::ExpectSameGraph(*want, *g);
    }
  }
}

// Corrupted bytes in every format: parse errors or graph errors, never a
// crash.
TEST(FuzzTest, CorruptedFilesAreRejectedOrValid) {
  Rng rng(99);
  int cases = 0;
  for (const auto& seed : Seeds()) {
    std::string binary;
    ASSERT_TRUE(seed.SerializeToString(&binary));
    auto g = FromProto(seed);
    ASSERT_TRUE(g.ok());
    const std::string json = GraphToJson(*g);
    const std::string text = seed.DebugString();
    for (int rep = 0; rep < 40; ++rep) {
      for (const std::string* src :
           std::vector<const std::string*>{&binary, &json, &text}) {
        std::string bytes = *src;
        int flips = 1 + Index(rng, 4);
        for (int f = 0; f < flips; ++f) {
          size_t at = Index(rng, static_cast<int>(bytes.size()));
          bytes[at] = static_cast<char>(Index(rng, 256));
        }
        if (Index(rng, 3) == 0) bytes.resize(Index(rng, bytes.size()));
        auto r = ParseGraph(bytes, GraphFormat::kAuto);
        ++cases;
        if (!r.ok()) {
          EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
          EXPECT_FALSE(r.status().message().empty());
        } else {
          EXPECT_TRUE(std::isfinite(r->ForwardFlops()));
          EXPECT_TRUE(FromProto(ToProto(*r)).ok());
        }
      }
    }
  }
  EXPECT_EQ(cases, 8 * 40 * 3);
}

}  // namespace
}  // namespace hap::graph
