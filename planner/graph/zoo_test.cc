#include "planner/graph/zoo.h"

#include <cmath>
#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/test_util.h"

namespace hap::graph {
namespace {

using ::hap::graph::testing::ExpectSameGraph;
using ::hap::graph::testing::IsOk;
using ::hap::graph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using Params = std::map<std::string, double>;

// Small overrides: every one the model accepts, from a common pool.
Params SmallParams(const ZooModelInfo& info) {
  static const Params kPool = {
      {"layers", 2}, {"hidden", 64}, {"heads", 4},          {"ffn", 128},
      {"seq", 16},   {"batch", 8},   {"vocab", 100},        {"experts", 4},
      {"input", 32}, {"classes", 5}, {"width", 8},          {"stages", 2},
      {"image", 16}, {"patch", 4},   {"convs_per_stage", 1}};
  Params p;
  for (const auto& [k, v] : kPool) {
    if (info.defaults.count(k)) p[k] = v;
  }
  return p;
}

TEST(ZooTest, ListsTheModels) {
  std::vector<std::string> names;
  for (const auto& m : ZooModels()) {
    names.push_back(m.name);
    EXPECT_FALSE(m.description.empty()) << m.name;
    EXPECT_FALSE(m.defaults.empty()) << m.name;
  }
  EXPECT_THAT(
      names, ::testing::UnorderedElementsAre("mlp", "transformer", "gpt", "vit",
                                             "moe", "switch", "vgg"));
}

TEST(ZooTest, EveryModelBuildsWithDefaults) {
  for (const auto& m : ZooModels()) {
    SCOPED_TRACE(m.name);
    auto g = BuildZooModel(m.name);
    ASSERT_THAT(g, IsOk());
    EXPECT_EQ(g->name(), m.name);
    EXPECT_GT(g->ParameterCount(), 0);
    EXPECT_EQ(g->TrainableParameterCount(), g->ParameterCount());
    EXPECT_GT(g->ForwardFlops(), 0);
    EXPECT_GT(g->TrainingFlops(), g->ForwardFlops());
    EXPECT_TRUE(std::isfinite(g->TrainingFlops()));
    const Tensor& loss = g->tensor(g->loss());
    EXPECT_EQ(loss.type, F32({}));
    EXPECT_EQ(loss.kind, TensorKind::kActivation);
    EXPECT_FALSE(g->Inputs().empty());
  }
}

TEST(ZooTest, EveryModelBuildsWithSmallOverrides) {
  for (const auto& m : ZooModels()) {
    SCOPED_TRACE(m.name);
    auto small = BuildZooModel(m.name, SmallParams(m));
    ASSERT_THAT(small, IsOk());
    auto full = BuildZooModel(m.name);
    ASSERT_THAT(full, IsOk());
    EXPECT_LT(small->ParameterCount(), full->ParameterCount());
    EXPECT_LT(small->ForwardFlops(), full->ForwardFlops());
  }
}

TEST(ZooTest, DefaultsAreThePapersSettings) {
  auto gpt = BuildZooModel("gpt");
  ASSERT_THAT(gpt, IsOk());
  auto tokens = gpt->FindTensor("tokens");
  ASSERT_TRUE(tokens.has_value());
  EXPECT_EQ(gpt->tensor(*tokens).type, I64({256, 128}));
  auto wte = gpt->FindTensor("embed/tokens");
  ASSERT_TRUE(wte.has_value());
  EXPECT_EQ(gpt->tensor(*wte).type, F32({kWikiText2Vocab, 768}));
}

void ExpectProtoRoundTrip(const Graph& g) {
  std::string bytes;
  ASSERT_TRUE(ToProto(g).SerializeToString(&bytes));
  hap::v1::Graph parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  auto back = FromProto(parsed);
  ASSERT_THAT(back, IsOk());
  ExpectSameGraph(g, *back);

  auto binary = ParseGraph(bytes, GraphFormat::kBinary);
  ASSERT_THAT(binary, IsOk());
  ExpectSameGraph(g, *binary);
  auto detected = ParseGraph(bytes, GraphFormat::kAuto);
  ASSERT_THAT(detected, IsOk());
  ExpectSameGraph(g, *detected);
}

void ExpectJsonRoundTrip(const Graph& g) {
  std::string json = GraphToJson(g);
  ASSERT_FALSE(json.empty());
  for (GraphFormat f : {GraphFormat::kJson, GraphFormat::kAuto}) {
    auto back = ParseGraph(json, f);
    ASSERT_THAT(back, IsOk());
    ExpectSameGraph(g, *back);
  }
}

void ExpectTextRoundTrip(const Graph& g) {
  std::string text = ToProto(g).DebugString();
  for (GraphFormat f : {GraphFormat::kText, GraphFormat::kAuto}) {
    auto back = ParseGraph(text, f);
    ASSERT_THAT(back, IsOk());
    ExpectSameGraph(g, *back);
  }
}

TEST(ZooTest, RoundTripsThroughEveryFormat) {
  for (const auto& m : ZooModels()) {
    for (bool small : {true, false}) {
      SCOPED_TRACE(m.name + (small ? " (small)" : " (defaults)"));
      auto g = BuildZooModel(m.name, small ? SmallParams(m) : Params{});
      ASSERT_THAT(g, IsOk());
      ExpectProtoRoundTrip(*g);
      ExpectJsonRoundTrip(*g);
      ExpectTextRoundTrip(*g);
    }
  }
}

int64_t PreNormBlockParams(int64_t h, int64_t ffn) {
  return 2 * h +            // ln1
         4 * (h * h + h) +  // q, k, v, out
         2 * h +            // ln2
         (h * ffn + ffn) +  // fc1
         (ffn * h + h);     // fc2
}

TEST(ZooTest, MlpParameterCount) {
  const int64_t layers = 3, input = 20, hidden = 64, classes = 7, batch = 8;
  auto g = BuildZooModel("mlp", {{"layers", layers},
                                 {"input", input},
                                 {"hidden", hidden},
                                 {"classes", classes},
                                 {"batch", batch}});
  ASSERT_THAT(g, IsOk());
  int64_t want = (input * hidden + hidden) +
                 (layers - 1) * (hidden * hidden + hidden) +
                 (hidden * classes + classes);
  EXPECT_EQ(g->ParameterCount(), want);
  // Only linears carry FLOPs above the element-wise ones; check the total
  // exactly: linear 2*rows*in*out + rows*out, relu 1 an element,
  // cross-entropy 4 an element + 2 a row.
  double linear =
      2.0 * batch * input * hidden + batch * hidden +
      (layers - 1) * (2.0 * batch * hidden * hidden + batch * hidden) +
      2.0 * batch * hidden * classes + batch * classes;
  double relu = static_cast<double>(layers * batch * hidden);
  double loss = 4.0 * batch * classes + 2.0 * batch;
  EXPECT_DOUBLE_EQ(g->ForwardFlops(), linear + relu + loss);
}

TEST(ZooTest, GptParameterCount) {
  const int64_t layers = 2, h = 64, heads = 4, ffn = 128, seq = 16, vocab = 100,
                batch = 8;
  auto g = BuildZooModel("gpt", {{"layers", layers},
                                 {"hidden", h},
                                 {"heads", heads},
                                 {"ffn", ffn},
                                 {"seq", seq},
                                 {"vocab", vocab},
                                 {"batch", batch}});
  ASSERT_THAT(g, IsOk());
  int64_t want = vocab * h + seq * h + layers * PreNormBlockParams(h, ffn) +
                 2 * h + h * vocab;
  EXPECT_EQ(want,
            vocab * h + seq * h +
                layers * (4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h) +
                2 * h + h * vocab);
  EXPECT_EQ(g->ParameterCount(), want);
}

TEST(ZooTest, VitParameterCount) {
  const int64_t layers = 2, h = 64, heads = 4, ffn = 128, image = 16, patch = 4,
                channels = 3, classes = 10, batch = 8;
  auto g = BuildZooModel("vit", {{"layers", layers},
                                 {"hidden", h},
                                 {"heads", heads},
                                 {"ffn", ffn},
                                 {"image", image},
                                 {"patch", patch},
                                 {"channels", channels},
                                 {"classes", classes},
                                 {"batch", batch}});
  ASSERT_THAT(g, IsOk());
  int64_t grid = image / patch;
  int64_t want = (h * channels * patch * patch + h) +  // patch embedding
                 h +                                   // class token
                 (grid * grid + 1) * h +               // positions
                 layers * PreNormBlockParams(h, ffn) + 2 * h +
                 (h * classes + classes);
  EXPECT_EQ(g->ParameterCount(), want);
}

TEST(ZooTest, MoeParameterCountCountsEveryExpert) {
  const int64_t layers = 2, h = 64, ffn = 128, seq = 16, vocab = 100,
                experts = 4;
  auto g = BuildZooModel("moe", {{"layers", layers},
                                 {"hidden", h},
                                 {"heads", 4},
                                 {"ffn", ffn},
                                 {"seq", seq},
                                 {"vocab", vocab},
                                 {"batch", 8},
                                 {"experts", experts},
                                 {"moe_every", 2}});
  ASSERT_THAT(g, IsOk());
  int64_t attn_block = 2 * h + 4 * (h * h + h) + 2 * h;
  int64_t dense_mlp = h * ffn + ffn + ffn * h + h;
  int64_t moe_mlp = h * experts + 2 * experts * h * ffn;
  int64_t want = vocab * h + seq * h + 2 * attn_block + dense_mlp + moe_mlp +
                 2 * h + h * vocab;
  EXPECT_EQ(g->ParameterCount(), want);
}

// The compact routing (the default) and the dense one (dense_routing 1):
// same parameters and dispatched tensor; the route is [tokens, k] where the
// dense form has combine weights [tokens, experts, capacity].
TEST(ZooTest, MoeRoutingForms) {
  for (const char* model : {"moe", "switch"}) {
    SCOPED_TRACE(model);
    const std::map<std::string, double> p = {{"layers", 2}, {"batch", 8},
                                             {"experts", 4}};
    auto compact = BuildZooModel(model, p);
    std::map<std::string, double> dp = p;
    dp["dense_routing"] = 1;
    auto dense = BuildZooModel(model, dp);
    ASSERT_THAT(compact, IsOk());
    ASSERT_THAT(dense, IsOk());
    EXPECT_EQ(compact->ParameterCount(), dense->ParameterCount());
    std::map<std::string, int> types;
    for (const Op& op : compact->ops()) ++types[op.type];
    EXPECT_EQ(types["moe_route"], 1);
    EXPECT_EQ(types["moe_dispatch_idx"], 1);
    EXPECT_EQ(types["moe_combine_idx"], 1);
    EXPECT_EQ(types["moe_gate"], 0);
    // tokens 8 * 128; capacity 1.25 * tokens * k / 4.
    const int64_t tokens = 8 * 128, k = std::string(model) == "moe" ? 2 : 1;
    const int64_t cap = (tokens * k * 5 + 15) / 16;
    auto output_of = [](const Graph& g, const std::string& type) {
      for (const Op& op : g.ops()) {
        if (op.type == type) return g.tensor(op.outputs[0]).type;
      }
      return TensorType{};
    };
    EXPECT_EQ(output_of(*dense, "moe_gate").shape, (Shape{tokens, 4, cap}));
    EXPECT_EQ(output_of(*compact, "moe_route").shape, (Shape{tokens, k}));
    EXPECT_EQ(output_of(*compact, "moe_route").dtype, DType::kInt64);
    EXPECT_EQ(output_of(*compact, "moe_dispatch_idx").shape,
              output_of(*dense, "moe_dispatch").shape);
  }
  EXPECT_THAT(BuildZooModel("moe", {{"dense_routing", 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'dense_routing' must be 0 or 1")));
}

TEST(ZooTest, UnknownModelIsInvalidArgument) {
  EXPECT_THAT(BuildZooModel("resnet"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("unknown zoo model 'resnet'"),
                             HasSubstr("gpt"))));
}

TEST(ZooTest, UnknownParameterIsInvalidArgument) {
  EXPECT_THAT(
      BuildZooModel("mlp", {{"heads", 4}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("'mlp'"), HasSubstr("no parameter 'heads'"))));
}

TEST(ZooTest, NonIntegerParametersAreInvalidArgument) {
  for (double bad : {2.5, 0.0, -3.0, std::nan(""), 1e300}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(
        BuildZooModel("gpt", {{"layers", bad}}),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr("'layers'"), HasSubstr("positive integer"))));
  }
  EXPECT_THAT(
      BuildZooModel("gpt", {{"dropout", 1.0}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'dropout'")));
  EXPECT_THAT(BuildZooModel("moe", {{"capacity_factor", -1}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'capacity_factor'")));
  // The value as given, not in 6 digits (1e+11, 1.23457e+06).
  EXPECT_THAT(BuildZooModel("gpt", {{"layers", 99999999999}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 99999999999")));
  EXPECT_THAT(BuildZooModel("gpt", {{"hidden", 1234567.5}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 1234567.5")));
  EXPECT_THAT(BuildZooModel("gpt", {{"dropout", 1.1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 1.1")));
}

TEST(ZooTest, InconsistentParametersAreInvalidArgument) {
  EXPECT_THAT(BuildZooModel("gpt", {{"hidden", 64}, {"heads", 5}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("zoo model 'gpt'"),
                             HasSubstr("divisible by heads"))));
  EXPECT_THAT(BuildZooModel("vit", {{"image", 30}, {"patch", 4}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("divisible by patch")));
  EXPECT_THAT(
      BuildZooModel("vgg", {{"stages", 6}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^stages")));
  EXPECT_THAT(BuildZooModel("moe", {{"experts", 2}, {"top_k", 3}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
}

// Every integer parameter at the largest accepted value, alone: the model
// either builds or reports a too-large shape; nothing overflows.
TEST(ZooTest, HugeParametersAreErrorsNotOverflows) {
  for (const auto& m : ZooModels()) {
    for (const auto& [k, v] : m.defaults) {
      if (k == "layers" || k == "dropout" || k == "moe_every" ||
          k == "convs_per_stage") {
        continue;  // these only repeat (or drop) work
      }
      SCOPED_TRACE(m.name + " " + k);
      Params p = SmallParams(m);
      p[k] = 1e15;
      auto g = BuildZooModel(m.name, p);
      if (!g.ok()) {
        EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(g.status().message()),
                    HasSubstr(absl::StrCat("zoo model '", m.name, "'")));
      } else {
        EXPECT_TRUE(std::isfinite(g->ForwardFlops()));
      }
    }
    SCOPED_TRACE(m.name + " all huge");
    Params all;
    for (const auto& [k, v] : m.defaults) {
      if (k != "layers" && k != "dropout" && k != "moe_every" &&
          k != "convs_per_stage" && k != "capacity_factor") {
        all[k] = 1e15;
      }
    }
    EXPECT_THAT(BuildZooModel(m.name, all),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::Not(::testing::IsEmpty())));
  }
}

TEST(FlopsTest, LinearIsTwoRowsInOutPlusBias) {
  const int64_t rows_a = 3, rows_b = 5, in = 7, out = 11;
  GraphBuilder b("tiny");
  TensorId x = b.Input("x", F32({rows_a, rows_b, in}));
  TensorId y = b.Input("y", I64({rows_a * rows_b}), InputRole::kLabels);
  TensorId w = b.Parameter("w", F32({out, in}), Initializer::Zeros());
  TensorId bias = b.Parameter("b", F32({out}), Initializer::Zeros());
  TensorId w2 = b.Parameter("w2", F32({out, out}), Initializer::Zeros(),
                            /*frozen=*/true);
  TensorId h = b.Add("linear", "fc", {x, w, bias});
  TensorId h2 = b.Add("linear", "fc_nobias", {h, w2});
  TensorId flat =
      b.Add("reshape", "flat", {h2},
            {{"shape", std::vector<int64_t>{rows_a * rows_b, out}}});
  b.SetLoss(b.Add("cross_entropy", "loss", {flat, y}));
  auto g = b.Build();
  ASSERT_THAT(g, IsOk());
  const double rows = rows_a * rows_b;
  EXPECT_EQ(g->OpForwardFlops(0), 2 * rows * in * out + rows * out);
  EXPECT_EQ(g->OpForwardFlops(1), 2 * rows * out * out);
  EXPECT_EQ(g->OpForwardFlops(2), 0);  // reshape is free
  EXPECT_EQ(g->OpForwardFlops(3), 4 * rows * out + 2 * rows);
  EXPECT_EQ(g->ForwardFlops(), 2 * rows * in * out + rows * out +
                                   2 * rows * out * out + 4 * rows * out +
                                   2 * rows);
  // linear backward is 2x forward; reshape free; cross-entropy 1x.
  EXPECT_EQ(g->TrainingFlops(),
            3 * (2 * rows * in * out + rows * out + 2 * rows * out * out) +
                2 * (4 * rows * out + 2 * rows));
  EXPECT_EQ(g->ParameterCount(), out * in + out + out * out);
  EXPECT_EQ(g->TrainableParameterCount(), out * in + out);
}

}  // namespace
}  // namespace hap::graph

namespace hap::graph {
namespace {

TEST(ZooLimitsTest, RepeatCountsAreBounded) {
  auto g = BuildZooModel("gpt", {{"layers", 1e6}});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(g.status().message()).find("'layers'"),
            std::string::npos);
}

}  // namespace
}  // namespace hap::graph
