// The lstm and gru ops' rules: replicated, and data parallel over the batch (x and
// y sharded on dimension 0, the weights replicated, the work split) where
// the batch can be cut; never over the sequence or the hidden units.
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "planner/graph/graph.h"
#include "planner/synth/rules.h"

namespace hap::synth {
namespace {

using graph::F32;

std::vector<ShardRule> LstmRules(int64_t batch, bool bias, int devices,
                                 const std::string& op = "lstm") {
  const int64_t gates = op == "gru" ? 12 : 16;
  graph::GraphBuilder b(op);
  graph::TensorId x = b.Input("x", F32({batch, 6, 3}));
  std::vector<graph::TensorId> ins = {
      x, b.Parameter("w_ih", F32({gates, 3}), graph::Initializer::Zeros()),
      b.Parameter("w_hh", F32({gates, 4}), graph::Initializer::Zeros())};
  if (bias) {
    ins.push_back(b.Parameter("b_ih", F32({gates}), graph::Initializer::Zeros()));
    ins.push_back(b.Parameter("b_hh", F32({gates}), graph::Initializer::Zeros()));
  }
  graph::TensorId y = b.Add(op, op, ins);
  b.SetLoss(b.Add("sum", "loss", {y}));
  absl::StatusOr<graph::Graph> g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  RuleContext ctx;
  ctx.num_devices = devices;
  return RulesFor(*g, 0, ctx);
}

TEST(LstmRulesTest, DataParallelOverTheBatch) {
  for (auto [op, bias] : {std::pair<std::string, bool>{"lstm", true},
                          {"lstm", false},
                          {"gru", true},
                          {"gru", false}}) {
    SCOPED_TRACE(op + (bias ? " bias" : " no bias"));
    std::vector<ShardRule> r = LstmRules(8, bias, 2, op);
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[0].name, "replicated");
    const ShardRule& d = r[1];
    EXPECT_EQ(d.name, "data(0)");
    EXPECT_EQ(d.kind, RuleKind::kData);
    EXPECT_TRUE(d.split);
    ASSERT_EQ(d.inputs.size(), bias ? 5u : 3u);
    EXPECT_EQ(d.inputs[0], Form::S(0));
    for (size_t i = 1; i < d.inputs.size(); ++i) EXPECT_EQ(d.inputs[i], Form::R()) << i;
    ASSERT_EQ(d.outputs.size(), 1u);
    EXPECT_EQ(d.outputs[0], Form::S(0));
    // Weight gradients come out partial (summed between the devices).
    for (bool rg : d.replicated_grad) EXPECT_FALSE(rg);
  }
}

TEST(LstmRulesTest, ABatchTooSmallToCutIsReplicatedOnly) {
  std::vector<ShardRule> r = LstmRules(3, true, 4);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].name, "replicated");
}

}  // namespace
}  // namespace hap::synth
