// The compact MoE ops' "groups" rules: offered only with grouped routing
// (group_size > 0) and enough groups for the devices; the route splits by
// tokens, dispatch maps the tokens' split to the capacity's, combine back.
#include <string>

#include "gtest/gtest.h"
#include "planner/graph/graph.h"
#include "planner/synth/rules.h"

namespace hap::synth {
namespace {

using graph::F32;

// x[16, 8] -> logits[16, 3] -> route -> dispatch -> combine, 4 tokens a
// group (0: one group of all), capacity 8.
graph::Graph Moe(int64_t group) {
  graph::GraphBuilder b("moe");
  const graph::TensorId x = b.Input("x", F32({16, 8}));
  const graph::TensorId w = b.Parameter("gate", F32({8, 3}), graph::Initializer::Zeros());
  const graph::TensorId logits = b.Add("matmul", "logits", {x, w});
  const graph::TensorId route =
      b.Add("moe_route", "route", {logits},
            {{"k", int64_t{1}}, {"capacity", int64_t{8}}, {"group_size", group}});
  const graph::TensorId weights =
      b.Add("moe_route_weights", "weights", {logits}, {{"k", int64_t{1}}});
  const graph::TensorId disp = b.Add(
      "moe_dispatch_idx", "dispatch", {x, route},
      {{"experts", int64_t{3}}, {"capacity", int64_t{8}}, {"group_size", group}});
  const graph::TensorId y =
      b.Add("moe_combine_idx", "combine", {disp, route, weights}, {{"group_size", group}});
  b.SetLoss(b.Add("sum", "loss", {y}));
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

const ShardRule* Named(const std::vector<ShardRule>& rules, const std::string& name) {
  for (const ShardRule& r : rules) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

std::vector<ShardRule> RulesOf(const graph::Graph& g, const std::string& type, int devices) {
  RuleContext ctx;
  ctx.num_devices = devices;
  for (size_t k = 0; k < g.ops().size(); ++k) {
    if (g.op(static_cast<int>(k)).type == type) return RulesFor(g, static_cast<int>(k), ctx);
  }
  ADD_FAILURE() << "no " << type;
  return {};
}

TEST(MoeRulesTest, GroupsRulesWithGroupedRouting) {
  graph::Graph g = Moe(4);  // 4 groups
  const std::vector<ShardRule> route_rules = RulesOf(g, "moe_route", 2);
  const std::vector<ShardRule> dispatch_rules = RulesOf(g, "moe_dispatch_idx", 2);
  const std::vector<ShardRule> combine_rules = RulesOf(g, "moe_combine_idx", 2);
  const ShardRule* route = Named(route_rules, "groups");
  ASSERT_NE(route, nullptr);
  EXPECT_EQ(route->inputs[0], Form::S(0));
  EXPECT_EQ(route->outputs[0], Form::S(0));
  const ShardRule* dispatch = Named(dispatch_rules, "groups");
  ASSERT_NE(dispatch, nullptr);
  EXPECT_EQ(dispatch->inputs[0], Form::S(0));  // tokens
  EXPECT_EQ(dispatch->inputs[1], Form::S(0));  // their route
  EXPECT_EQ(dispatch->outputs[0], Form::S(1));  // their groups' slots of every expert
  EXPECT_TRUE(dispatch->split);
  const ShardRule* combine = Named(combine_rules, "groups");
  ASSERT_NE(combine, nullptr);
  EXPECT_EQ(combine->inputs[0], Form::S(1));
  EXPECT_EQ(combine->inputs[1], Form::S(0));
  EXPECT_EQ(combine->inputs[2], Form::S(0));
  EXPECT_EQ(combine->outputs[0], Form::S(0));
  // More devices than groups: no split by groups.
  EXPECT_EQ(Named(RulesOf(g, "moe_route", 5), "groups"), nullptr);
  EXPECT_EQ(Named(RulesOf(g, "moe_dispatch_idx", 5), "groups"), nullptr);
}

TEST(MoeRulesTest, NoGroupsRulesWhenAllTokensRouteTogether) {
  graph::Graph g = Moe(0);
  for (const char* type : {"moe_route", "moe_dispatch_idx", "moe_combine_idx"}) {
    EXPECT_EQ(Named(RulesOf(g, type, 2), "groups"), nullptr) << type;
  }
  // The route is computed whole: its running count spans all tokens.
  EXPECT_EQ(RulesOf(g, "moe_route", 2).size(), 1u);
}

}  // namespace
}  // namespace hap::synth
