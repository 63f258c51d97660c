// One place per op, checked: every IR op type has a sharding rule that
// splits its work (an op without one is computed whole on every device,
// whatever the plan). Each registered type is met in a zoo model or in the
// graph of the remaining ops below, so a new op type fails here until it
// has both an instance and a rule.
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/graph/op_registry.h"
#include "planner/graph/zoo.h"
#include "planner/synth/rules.h"

namespace hap::synth {
namespace {

using graph::F32;
using graph::GraphBuilder;
using graph::I64;
using graph::Initializer;
using graph::TensorId;

// The ops no zoo model has, each once, on small shapes every dimension of
// which can be split two ways.
absl::StatusOr<graph::Graph> RemainingOps() {
  GraphBuilder b("remaining_ops");
  auto param = [&](const std::string& name, graph::Shape s) {
    return b.Parameter(name, F32(std::move(s)), Initializer::Normal(0, 0.02));
  };
  const TensorId img = b.Input("img", F32({4, 4, 8, 8}));
  const TensorId labels = b.Input("labels", I64({4}), graph::InputRole::kLabels);
  TensorId x = b.Add("batch_norm", "bn", {img, param("gamma", {4}), param("beta", {4})});
  x = b.Add("conv2d", "depthwise", {x, param("dw", {4, 1, 3, 3})},
            {{"padding", std::vector<int64_t>{1, 1}}, {"groups", int64_t{4}}});
  // The image as a 2-frame clip for conv3d, and back.
  x = b.Add("reshape", "as_clip", {x}, {{"shape", std::vector<int64_t>{4, 4, 2, 4, 8}}});
  x = b.Add("conv3d", "conv3d", {x, param("w3", {4, 4, 1, 3, 3}), param("b3", {4})},
            {{"padding", std::vector<int64_t>{0, 1, 1}}});
  x = b.Add("max_pool3d", "max_pool3d", {x},
            {{"kernel", std::vector<int64_t>{1, 3, 3}},
             {"stride", std::vector<int64_t>{1}},
             {"padding", std::vector<int64_t>{0, 1, 1}}});
  x = b.Add("avg_pool3d", "avg_pool3d", {x},
            {{"kernel", std::vector<int64_t>{1, 3, 3}},
             {"stride", std::vector<int64_t>{1}},
             {"padding", std::vector<int64_t>{0, 1, 1}}});
  x = b.Add("reshape", "as_image", {x}, {{"shape", std::vector<int64_t>{4, 4, 8, 8}}});
  for (const char* act :
       {"relu6", "silu", "hardswish", "hardsigmoid", "sigmoid", "tanh", "exp", "rsqrt", "log"}) {
    x = b.Add(act, act, {x});
  }
  x = b.Add("drop_path", "drop_path", {x});
  x = b.Add("avg_pool2d", "avg_pool", {x}, {{"kernel", std::vector<int64_t>{2, 2}}});
  x = b.Add("adaptive_avg_pool2d", "adaptive_pool", {x},
            {{"output_size", std::vector<int64_t>{2, 2}}});
  x = b.Add("flatten", "flat", {x});  // [4, 16]
  const std::vector<TensorId> halves = b.AddOp(
      "split", "halves", {x}, {{"axis", int64_t{1}}, {"sizes", std::vector<int64_t>{8, 8}}});
  TensorId h = halves.size() == 2 ? b.Add("sub", "diff", {halves[0], halves[1]}) : -1;
  h = b.Add("mul", "square", {h, h});
  h = b.Add("scale", "half", {h}, {{"factor", 0.5}});
  h = b.Add("add", "straight_through", {h, b.Add("stop_gradient", "detached", {h})});
  const TensorId row_sum =
      b.Add("sum", "row_sum", {h}, {{"axes", std::vector<int64_t>{1}}, {"keepdims", true}});
  h = b.Add("add", "plus_row_sum",
            {h, b.Add("expand", "spread", {row_sum}, {{"shape", std::vector<int64_t>{4, 8}}})});
  h = b.Add("concat", "both", {h, halves.size() == 2 ? halves[1] : -1}, {{"axis", int64_t{1}}});
  // An LSTM over the 16 features as 4 steps of 4, then a reversed GRU.
  TensorId seq = b.Add("reshape", "as_steps", {h}, {{"shape", std::vector<int64_t>{4, 4, 4}}});
  seq = b.Add("lstm", "lstm", {seq, param("w_ih", {16, 4}), param("w_hh", {16, 4})});
  seq = b.Add("gru", "gru", {seq, param("gru_w_ih", {12, 4}), param("gru_w_hh", {12, 4})},
              {{"reverse", true}});
  TensorId last = b.Add("slice", "last_step", {seq},
                        {{"axis", int64_t{1}}, {"start", int64_t{3}}, {"end", int64_t{4}}});
  last = b.Add("reshape", "last_flat", {last}, {{"shape", std::vector<int64_t>{4, 4}}});
  last = b.Add("mul", "by_mean",
               {last, b.Add("mean", "row_mean", {last},
                            {{"axes", std::vector<int64_t>{1}}, {"keepdims", true}})});
  TensorId logits = b.Add("linear", "head", {last, param("head_w", {4, 4})});
  logits = b.Add("log_softmax", "logp", {logits});
  b.SetLoss(b.Add("nll_loss", "loss", {logits, labels}));
  return b.Build();
}

TEST(RulesCoverageTest, EveryOpTypeHasARuleThatSplitsItsWork) {
  std::vector<graph::Graph> graphs;
  auto add = [&](absl::StatusOr<graph::Graph> g, const std::string& what) {
    ASSERT_TRUE(g.ok()) << what << ": " << g.status();
    graphs.push_back(*std::move(g));
  };
  for (const graph::ZooModelInfo& m : graph::ZooModels()) {
    std::map<std::string, double> params;
    if (m.defaults.count("layers")) params["layers"] = 2;
    add(graph::BuildZooModel(m.name, params), m.name);
  }
  // The MoE zoo model's other routings: dense dispatch tensors, and the
  // compact route in groups (GShard's), which splits by whole groups.
  add(graph::BuildZooModel("moe", {{"layers", 2}, {"dense_routing", 1}}), "moe dense");
  add(graph::BuildZooModel("moe", {{"layers", 2}, {"moe_group_size", 64}}), "moe grouped");
  add(RemainingOps(), "remaining ops");

  RuleContext ctx;
  ctx.num_devices = 2;
  std::map<std::string, bool> splits;  // op type met -> a rule splits it
  for (const graph::Graph& g : graphs) {
    for (graph::OpId id = 0; id < static_cast<graph::OpId>(g.ops().size()); ++id) {
      bool any = false;
      for (const ShardRule& r : RulesFor(g, id, ctx)) any = any || r.split;
      splits[g.op(id).type] = splits[g.op(id).type] || any;
    }
  }
  // Computed whole by design, and why.
  const std::map<std::string, std::string> kWhole = {
      {"moe_gate",
       "places each token by a running count over all tokens (rules_moe.cc); "
       "moe_route in groups is the form that splits"}};
  for (const graph::OpDef* d : graph::OpRegistry::Global().All()) {
    SCOPED_TRACE(d->type);
    auto it = splits.find(d->type);
    ASSERT_NE(it, splits.end()) << "no instance: add one to a zoo model or RemainingOps()";
    EXPECT_EQ(it->second, kWhole.count(d->type) == 0)
        << (it->second ? "splits, but is listed as whole by design"
                       : "every rule computes the op whole on every device");
  }
}

// S(d) holds d in an int8_t: dimensions up to 127 are sharded, and a graph
// has at most 128 dimensions a tensor (graph::kMaxTensorDims; RulesFor
// would give an op with a tensor of more only the replicated rule). Rank
// 256 was taken: the last dimension's rule read S(255), which is R, a split
// rule that moved no data.
TEST(RulesCoverageTest, DimensionsPastWhatAFormNamesAreNotSharded) {
  for (int rank : {128, 129, 256}) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    GraphBuilder b("high_rank");
    graph::Shape shape(rank, 1);
    shape.back() = 4;
    const TensorId x = b.Input("x", F32(shape));
    b.SetLoss(b.Add("sum", "loss", {b.Add("relu", "relu", {x})}));
    auto g = b.Build();
    if (rank > static_cast<int>(graph::kMaxTensorDims)) {
      EXPECT_FALSE(g.ok()) << "a graph of rank " << rank << " was built";
      continue;
    }
    ASSERT_TRUE(g.ok()) << g.status();
    RuleContext ctx;
    ctx.num_devices = 2;
    const std::vector<ShardRule> rules = RulesFor(*g, 0, ctx);
    ASSERT_EQ(rules.size(), 2u);
    EXPECT_EQ(rules[1].inputs[0], Form::S(rank - 1));
    EXPECT_EQ(rules[1].inputs[0].dim(), rank - 1);
  }
}

}  // namespace
}  // namespace hap::synth
