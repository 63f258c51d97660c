#include "planner/lower/lower.h"

#include <map>
#include <set>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/op_registry.h"
#include "planner/graph/zoo.h"
#include "planner/lower/arena.h"
#include "planner/lower/op_lowering.h"
#include "planner/synth/planner.h"
#include "planner/synth/search.h"

namespace hap::lower {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

graph::Graph Gpt(int batch) {
  auto g = graph::BuildZooModel(
      "gpt", {{"layers", 2}, {"hidden", 16}, {"heads", 4}, {"ffn", 24}, {"seq", 6},
              {"vocab", 37}, {"batch", batch}});
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

cost::ClusterModel Cluster(int n) {
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < n; ++i) {
    d.push_back({"d" + std::to_string(i), "n0", "t", 1e7, int64_t{1} << 34, 0});
  }
  std::vector<std::vector<double>> bw(n, std::vector<double>(n, 1e12)),
      lat(n, std::vector<double>(n, 0));
  return *cost::ClusterModel::Create(d, bw, lat);
}

synth::Program Search(const graph::Graph& g, int n, std::vector<double> ratios,
                      std::optional<synth::ParamStorage> storage,
                      std::function<bool(const synth::ShardRule&)> filter) {
  synth::SearchOptions o;
  o.ratios = std::move(ratios);
  o.rule_filter = std::move(filter);
  o.force_storage = storage;
  o.allow_sfb = false;
  auto p = synth::Synthesize(g, Cluster(n), o);
  EXPECT_TRUE(p.ok()) << p.status();
  return *std::move(p);
}

const v1::Buffer* Find(const v1::RankProgram& p, const std::string& tensor,
                       v1::Buffer::Role role) {
  for (const auto& b : p.buffers()) {
    if (b.tensor() == tensor && b.role() == role) return &b;
  }
  return nullptr;
}

TEST(LowerTest, ShardsFollowTheDimensionClassAcrossReshapes) {
  graph::Graph g = Gpt(7);
  std::vector<double> ratios = {0.5, 0.3, 0.2};
  synth::Program p = Search(g, 3, ratios, synth::ParamStorage::kReplicated, synth::DataParallelRule);
  LowerOptions o;
  o.world_size = 3;
  o.ratios = ratios;
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  // 7 sequences split 4/2/1 (RoundShards of 7 by 0.5/0.3/0.2 gives 3/2/1
  // plus the remainder to the largest deficit); the labels, one per token
  // of 6, follow the same split scaled by 6.
  int64_t token_total = 0, label_total = 0;
  for (const auto& prog : *progs) {
    const v1::Buffer* tokens = Find(prog, "tokens", v1::Buffer::INPUT);
    const v1::Buffer* labels = Find(prog, "labels", v1::Buffer::INPUT);
    ASSERT_NE(tokens, nullptr);
    ASSERT_NE(labels, nullptr);
    EXPECT_EQ(labels->shape(0), tokens->shape(0) * 6);
    EXPECT_EQ(labels->offsets(0), tokens->offsets(0) * 6);
    EXPECT_EQ(tokens->offsets(0), token_total);
    EXPECT_GE(tokens->shape(0), 1);
    token_total += tokens->shape(0);
    label_total += labels->shape(0);
  }
  EXPECT_EQ(token_total, 7);
  EXPECT_EQ(label_total, 42);
  EXPECT_GT((*progs)[0].buffers(Find((*progs)[0], "tokens", v1::Buffer::INPUT)->id()).shape(0),
            (*progs)[2].buffers(Find((*progs)[2], "tokens", v1::Buffer::INPUT)->id()).shape(0));
}

// Every rank runs the same collectives in the same order with the same
// per-rank sizes: otherwise the ranks would deadlock.
void ExpectMatchingCollectives(const std::vector<v1::RankProgram>& progs) {
  auto sequence = [](const v1::RankProgram& p) {
    std::vector<std::string> out;
    for (const auto& s : p.steps()) {
      if (!s.has_collective()) continue;
      const auto& c = s.collective();
      std::string k = v1::Collective_Name(c.collective()) + ":" + c.tensor() + ":" +
                      std::to_string(c.dim());
      for (int64_t x : c.shard_sizes()) k += "," + std::to_string(x);
      out.push_back(k);
    }
    return out;
  };
  for (size_t r = 1; r < progs.size(); ++r) {
    EXPECT_EQ(sequence(progs[r]), sequence(progs[0])) << "rank " << r;
  }
}

TEST(LowerTest, DataParallelAllReducesEveryWeightGradient) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.5, 0.5}, synth::ParamStorage::kReplicated, synth::DataParallelRule);
  LowerOptions o;
  o.world_size = 2;
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  // Every weight gradient is all-reduced, all of them in one coalesced call
  // (a gradient bucket) after backward: one synchronisation, not one each.
  const v1::RankProgram& r0 = (*progs)[0];
  std::set<std::string> reduced;
  int calls = 0;
  int last_backward = -1, bucket_step = -1;
  for (int i = 0; i < r0.steps_size(); ++i) {
    const auto& s = r0.steps(i);
    if (s.phase() == v1::Step::BACKWARD) last_backward = i;
    if (s.phase() == v1::Step::GRADIENT_SYNC && s.has_collective() &&
        s.collective().collective() == v1::ALL_REDUCE) {
      ++calls;
      bucket_step = i;
      reduced.insert(r0.buffers(s.collective().input()).tensor());
      for (int id : s.collective().coalesced()) reduced.insert(r0.buffers(id).tensor());
    }
  }
  EXPECT_EQ(calls, 1);
  EXPECT_GT(bucket_step, last_backward);
  for (graph::TensorId t : g.Parameters()) {
    EXPECT_TRUE(reduced.count(g.tensor(t).name + "#grad")) << g.tensor(t).name;
  }
  // One optimizer update per parameter.
  int updates = 0;
  for (const auto& s : (*progs)[0].steps()) {
    updates += s.has_kernel() && s.kernel().kernel() == "sgd_update";
  }
  EXPECT_EQ(updates, static_cast<int>(g.Parameters().size()));
}

// MoE split by experts: each rank's dispatch, combine and their backward
// kernels carry its experts' offset and the global expert count; the
// offsets are the cumulative shard sizes (8 experts at uneven ratios).
TEST(LowerTest, ExpertSplitMoeKernelsCarryTheRanksExpertOffset) {
  auto g = graph::BuildZooModel(
      "moe", {{"layers", 2}, {"hidden", 16}, {"heads", 4}, {"ffn", 24}, {"seq", 4},
              {"vocab", 29}, {"batch", 7}, {"experts", 8}, {"dropout", 0.0}});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<double> ratios = {0.5, 0.3, 0.2};
  synth::Program p = Search(*g, 3, ratios, std::nullopt, [](const synth::ShardRule& r) {
    return r.name != "tokens" && r.name != "features";
  });
  for (const synth::OpStep& s : p.steps) {
    const std::string& type = g->op(s.op).type;
    if (type == "moe_dispatch_idx" || type == "moe_combine_idx") {
      ASSERT_EQ(s.rule.name, "expert") << g->op(s.op).name;
    }
  }
  LowerOptions o;
  o.world_size = 3;
  o.ratios = ratios;
  auto progs = Lower(*g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  int64_t next = 0;
  for (int r = 0; r < 3; ++r) {
    int calls = 0;
    int64_t offset = -1;
    for (const auto& s : (*progs)[r].steps()) {
      if (!s.has_kernel() || s.kernel().kernel().rfind("moe_", 0) != 0 ||
          s.kernel().kernel().find("_idx") == std::string::npos) {
        continue;
      }
      ++calls;
      const auto& a = s.kernel().attrs();
      ASSERT_TRUE(a.count("expert_offset")) << s.kernel().kernel();
      EXPECT_EQ(a.at("experts").i(), 8);
      if (offset < 0) offset = a.at("expert_offset").i();
      EXPECT_EQ(a.at("expert_offset").i(), offset) << s.kernel().kernel();
    }
    EXPECT_EQ(calls, 4);  // dispatch, combine and their backward, 1 MoE layer
    EXPECT_EQ(offset, next) << "rank " << r;
    const v1::Buffer* w = Find((*progs)[r], "layer1/moe/experts/fc1/weight",
                               v1::Buffer::PARAMETER);
    ASSERT_NE(w, nullptr);
    next += w->shape(0);
  }
  EXPECT_EQ(next, 8);
}

// Grouped MoE routing split by groups: every rank's tokens are whole
// groups and its slots those groups' (token_offset and capacity_offset
// agree), even where the token dimension alone would round across a group
// (12 tokens in groups of 4 at equal ratios over 2 ranks: 6 + 6 without
// the groups' granularity).
TEST(LowerTest, GroupedMoeShardsAreWholeGroups) {
  graph::GraphBuilder b("grouped");
  const graph::TensorId x = b.Input("x", graph::TensorType{graph::DType::kFloat32, {12, 8}});
  const graph::TensorId w = b.Parameter(
      "gate", graph::TensorType{graph::DType::kFloat32, {8, 3}}, graph::Initializer::Zeros());
  const graph::TensorId logits = b.Add("matmul", "logits", {x, w});
  const graph::TensorId route =
      b.Add("moe_route", "route", {logits},
            {{"k", int64_t{1}}, {"capacity", int64_t{6}}, {"group_size", int64_t{4}}});
  const graph::TensorId disp = b.Add(
      "moe_dispatch_idx", "dispatch", {x, route},
      {{"experts", int64_t{3}}, {"capacity", int64_t{6}}, {"group_size", int64_t{4}}});
  b.SetLoss(b.Add("sum", "loss", {disp}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  synth::Program p = Search(*g, 2, {0.5, 0.5}, std::nullopt, [](const synth::ShardRule& r) {
    return r.name != "tokens" && r.name != "features" && r.name != "expert";
  });
  for (const synth::OpStep& s : p.steps) {
    const std::string& type = g->op(s.op).type;
    if (type == "moe_route" || type == "moe_dispatch_idx") {
      ASSERT_EQ(s.rule.name, "groups") << type;
    }
  }
  LowerOptions o;
  o.world_size = 2;
  o.ratios = {0.5, 0.5};
  auto progs = Lower(*g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  std::vector<int64_t> offsets;
  for (int r = 0; r < 2; ++r) {
    int64_t token_offset = -1, capacity_offset = -1;
    for (const auto& s : (*progs)[r].steps()) {
      if (!s.has_kernel()) continue;
      const auto& a = s.kernel().attrs();
      if (s.kernel().kernel() == "moe_route") token_offset = a.at("token_offset").i();
      if (s.kernel().kernel() == "moe_dispatch_idx") {
        capacity_offset = a.at("capacity_offset").i();
        EXPECT_EQ(a.at("capacity").i(), 6);
      }
    }
    EXPECT_EQ(token_offset % 4, 0) << "rank " << r << " starts at token " << token_offset;
    EXPECT_EQ(capacity_offset, token_offset / 4 * 2) << "rank " << r;
    offsets.push_back(token_offset);
  }
  EXPECT_EQ(offsets[0], 0);
  EXPECT_GT(offsets[1], 0);
  EXPECT_LT(offsets[1], 12);
}

TEST(LowerTest, ZeroKeepsParameterShardsAndReduceScattersGradients) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.5, 0.5}, synth::ParamStorage::kZero, synth::DataParallelRule);
  LowerOptions o;
  o.world_size = 2;
  o.optimizer.set_kind(v1::OptimizerConfig::ADAM);
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  const v1::Buffer* w = Find((*progs)[1], "layer0/mlp/fc1/weight", v1::Buffer::PARAMETER);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->global_shape(0), 24);
  EXPECT_EQ(w->shape(0), 12);
  EXPECT_EQ(w->offsets(0), 12);
  int scatters = 0, states = 0, regathers = 0;
  for (const auto& s : (*progs)[1].steps()) {
    scatters += s.phase() == v1::Step::GRADIENT_SYNC && s.has_collective() &&
                s.collective().collective() == v1::REDUCE_SCATTER;
    regathers += s.phase() == v1::Step::BACKWARD && s.has_collective() &&
                 s.collective().collective() == v1::ALL_GATHER &&
                 s.collective().tensor() == "layer0/mlp/fc1/weight";
  }
  // ZeRO-3: the whole weight is gathered again for backward, so the
  // forward copy dies when forward is done with it.
  EXPECT_EQ(regathers, 1);
  const v1::Buffer* fwd_copy = Find((*progs)[1], "layer0/mlp/fc1/weight#gathered",
                                    v1::Buffer::ACTIVATION);
  ASSERT_NE(fwd_copy, nullptr);
  int first_backward = 0;
  while ((*progs)[1].steps(first_backward).phase() == v1::Step::FORWARD) ++first_backward;
  EXPECT_LT(fwd_copy->last_use(), first_backward);
  for (const auto& b : (*progs)[1].buffers()) {
    if (b.role() == v1::Buffer::OPTIMIZER_STATE && b.tensor().rfind("layer0/mlp/fc1/weight#", 0) == 0) {
      ++states;
      EXPECT_EQ(b.shape(0), 12);  // Adam moments are sharded too
    }
  }
  EXPECT_GT(scatters, 0);
  EXPECT_EQ(states, 2);
}

// Adam's betas as the config sets them, 0 included (PyTorch's betas=(0,
// b2)); unset, 0.9 and 0.999. A 0 read as unset, so no plan could run
// without a first moment.
TEST(LowerTest, AdamsBetasAreTheConfigsZeroIncluded) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.5, 0.5}, std::nullopt, synth::DataParallelRule);
  LowerOptions o;
  o.world_size = 2;
  o.optimizer.set_kind(v1::OptimizerConfig::ADAM);
  o.optimizer.set_beta1(0);
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  int updates = 0;
  for (const auto& s : (*progs)[0].steps()) {
    if (!s.has_kernel() || s.kernel().kernel() != "adam_update") continue;
    ++updates;
    EXPECT_EQ(s.kernel().attrs().at("beta1").f(), 0);
    EXPECT_EQ(s.kernel().attrs().at("beta2").f(), 0.999);
    EXPECT_EQ(s.kernel().attrs().at("epsilon").f(), 1e-8);
  }
  EXPECT_GT(updates, 0);
  o.optimizer.clear_beta1();
  o.optimizer.set_beta2(0.95);
  progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  for (const auto& s : (*progs)[0].steps()) {
    if (!s.has_kernel() || s.kernel().kernel() != "adam_update") continue;
    EXPECT_EQ(s.kernel().attrs().at("beta1").f(), 0.9);
    EXPECT_EQ(s.kernel().attrs().at("beta2").f(), 0.95);
  }
}

// The buffers a step reads or writes.
std::vector<int> Touched(const v1::Step& s) {
  std::vector<int> ids;
  if (s.has_kernel()) {
    ids.assign(s.kernel().inputs().begin(), s.kernel().inputs().end());
    ids.insert(ids.end(), s.kernel().outputs().begin(), s.kernel().outputs().end());
  } else if (s.has_collective()) {
    const v1::CollectiveCall& c = s.collective();
    ids = {c.input(), c.output()};
    ids.insert(ids.end(), c.coalesced().begin(), c.coalesced().end());
    ids.insert(ids.end(), c.coalesced_outputs().begin(), c.coalesced_outputs().end());
  }
  return ids;
}

// Every asynchronous collective of `p` is waited for once, later; no step
// in between touches its buffers; and the wait sits just before the first
// step touching one of them (only other waits and starts in between), or in the
// waits at the program's end. Returns the wait step of each start.
std::map<int, int> CheckAsyncPlacement(const v1::RankProgram& p) {
  std::map<int, int> wait_of;
  for (int i = 0; i < p.steps_size(); ++i) {
    if (p.steps(i).has_wait()) {
      const int start = p.steps(i).wait().start_step();
      EXPECT_TRUE(p.steps(start).has_collective() && p.steps(start).collective().async())
          << "step " << i;
      EXPECT_FALSE(wait_of.count(start)) << "waited twice: " << start;
      EXPECT_LT(start, i);
      wait_of[start] = i;
    }
  }
  for (int i = 0; i < p.steps_size(); ++i) {
    if (!p.steps(i).has_collective() || !p.steps(i).collective().async()) continue;
    EXPECT_TRUE(wait_of.count(i)) << "never waited for: step " << i;
    if (!wait_of.count(i)) continue;
    const std::vector<int> mine = Touched(p.steps(i));
    auto touches = [&](int j) {
      for (int id : Touched(p.steps(j))) {
        if (std::find(mine.begin(), mine.end(), id) != mine.end()) return true;
      }
      return false;
    };
    const int w = wait_of[i];
    for (int j = i + 1; j < w; ++j) EXPECT_FALSE(touches(j)) << "step " << j << " inside " << i;
    int next = w + 1;
    // Other waits, and the next prefetch started right after this wait.
    while (next < p.steps_size() &&
           (p.steps(next).has_wait() ||
            (p.steps(next).has_collective() && p.steps(next).collective().async()))) {
      ++next;
    }
    if (next < p.steps_size()) {
      EXPECT_TRUE(touches(next)) << "the wait for step " << i << " at " << w
                                 << " is not just before a use";
    }
  }
  return wait_of;
}

int CountAsync(const v1::RankProgram& p) {
  int n = 0;
  for (const auto& s : p.steps())
    n += s.has_wait() + (s.has_collective() && s.collective().async());
  return n;
}

TEST(LowerTest, OverlapStartsEachGradientBucketOnceItsGradientsAreDone) {
  graph::Graph g = Gpt(8);
  synth::Program p =
      Search(g, 2, {0.6, 0.4}, synth::ParamStorage::kReplicated, synth::DataParallelRule);
  LowerOptions o;
  o.world_size = 2;
  o.ratios = {0.6, 0.4};
  auto inline_progs = Lower(g, p, o);
  ASSERT_TRUE(inline_progs.ok()) << inline_progs.status();
  EXPECT_EQ(CountAsync((*inline_progs)[0]), 0);  // without overlap: in line

  o.overlap = true;
  o.gradient_bucket_bytes = 4096;
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  // The planner's buckets for the same size: as many calls.
  synth::Program priced = p;
  synth::AssignGradientBuckets(
      g, 4096, [](double, const char**) { return ratios::CostTerm(); }, &priced);
  ASSERT_GT(priced.buckets.size(), 2u);
  for (const v1::RankProgram& r : *progs) {
    std::map<int, int> wait_of = CheckAsyncPlacement(r);
    std::map<int, int> last_write;  // buffer -> last step writing it
    int buckets = 0, first_optimizer = -1;
    std::set<std::string> reduced;
    for (int i = 0; i < r.steps_size(); ++i) {
      const v1::Step& s = r.steps(i);
      if (s.phase() == v1::Step::OPTIMIZER && first_optimizer < 0 && !s.has_wait()) {
        first_optimizer = i;
      }
      if (s.has_kernel()) {
        for (int id : s.kernel().outputs()) last_write[id] = i;
      }
      if (!s.has_collective() || s.collective().collective() != v1::ALL_REDUCE ||
          s.phase() != v1::Step::GRADIENT_SYNC) {
        continue;
      }
      ASSERT_TRUE(s.collective().async()) << "step " << i;
      ++buckets;
      std::vector<int> grads = {s.collective().input()};
      grads.insert(grads.end(), s.collective().coalesced().begin(),
                   s.collective().coalesced().end());
      // Started right after the backward kernel that completed its last
      // gradient: no backward kernel of another op in between.
      int done = -1;
      for (int id : grads) {
        done = std::max(done, last_write[id]);
        reduced.insert(r.buffers(id).tensor());
      }
      ASSERT_GE(done, 0);
      for (int j = done + 1; j < i; ++j) {
        const v1::Step& t = r.steps(j);
        EXPECT_FALSE(t.has_kernel() && t.phase() == v1::Step::BACKWARD &&
                     !t.kernel().op().empty() && t.kernel().op() != r.steps(done).kernel().op())
            << "bucket at " << i << " waits past step " << j;
      }
      // Started during backward, waited for in the optimizer.
      EXPECT_LT(i, first_optimizer < 0 ? r.steps_size() : first_optimizer);
      EXPECT_EQ(r.steps(wait_of[i]).phase(), v1::Step::OPTIMIZER);
    }
    EXPECT_EQ(buckets, static_cast<int>(priced.buckets.size()));
    for (graph::TensorId t : g.Parameters()) {
      EXPECT_TRUE(reduced.count(g.tensor(t).name + "#grad")) << g.tensor(t).name;
    }
    // The first bucket starts before backward ends: it overlaps backward.
    int last_backward = 0;
    for (int i = 0; i < r.steps_size(); ++i) {
      if (r.steps(i).phase() == v1::Step::BACKWARD && r.steps(i).has_kernel()) last_backward = i;
    }
    EXPECT_LT(wait_of.begin()->first, last_backward);
  }
}

TEST(LowerTest, OverlapPrefetchesZero3GathersOneOpAheadAndStartsReduceScatters) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.5, 0.5}, synth::ParamStorage::kZero, synth::DataParallelRule);
  LowerOptions o;
  o.world_size = 2;
  o.overlap = true;
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  const v1::RankProgram& r = (*progs)[1];
  std::map<int, int> wait_of = CheckAsyncPlacement(r);
  int gathers = 0, prefetched = 0, regathers = 0, scatters = 0;
  for (int i = 0; i < r.steps_size(); ++i) {
    const v1::Step& s = r.steps(i);
    if (!s.has_collective()) continue;
    const v1::CollectiveCall& c = s.collective();
    if (c.collective() == v1::ALL_GATHER && s.phase() != v1::Step::GRADIENT_SYNC) {
      EXPECT_TRUE(c.async()) << "step " << i;
      (s.phase() == v1::Step::FORWARD ? gathers : regathers) += 1;
      // One ahead: the previous parameter-holding op's kernel runs behind it.
      for (int j = i + 1; j < wait_of[i]; ++j) {
        const v1::Step& t = r.steps(j);
        if (t.has_kernel() && !t.kernel().op().empty() && t.kernel().kernel() != "fill") {
          ++prefetched;
          break;
        }
      }
    }
    if (c.collective() == v1::REDUCE_SCATTER) {
      EXPECT_TRUE(c.async()) << "step " << i;
      EXPECT_EQ(r.steps(wait_of[i]).phase(), v1::Step::OPTIMIZER);
      ++scatters;
    }
  }
  EXPECT_GT(gathers, 4);
  EXPECT_GT(regathers, 4);
  EXPECT_GT(scatters, 4);
  // All but the first op's (forward and backward) run behind an op.
  EXPECT_GE(prefetched, gathers + regathers - 6);
}

TEST(LowerTest, ZeroGatheredOnceIsOneCoalescedGatherAndOneCoalescedReduceScatter) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.7, 0.3}, synth::ParamStorage::kZero, synth::DataParallelRule);
  int once = 0;
  for (synth::OpStep& s : p.steps) {
    for (synth::SourceLoad& l : s.loads) {
      if (l.parameter && l.storage == synth::ParamStorage::kZero) {
        l.gather_once = true;
        ++once;
      }
    }
  }
  ASSERT_GT(once, 2);
  LowerOptions o;
  o.world_size = 2;
  o.ratios = {0.7, 0.3};
  o.optimizer.set_kind(v1::OptimizerConfig::ADAM);
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  const v1::RankProgram& r1 = (*progs)[1];
  int gathers = 0, scatters = 0, backward_gathers = 0;
  for (const auto& s : r1.steps()) {
    if (!s.has_collective()) continue;
    const v1::CollectiveCall& c = s.collective();
    if (c.collective() == v1::ALL_GATHER) {
      if (s.phase() == v1::Step::BACKWARD) ++backward_gathers;
      if (s.phase() != v1::Step::FORWARD) continue;
      ++gathers;
      // Every ZeRO parameter in the one call, before any kernel.
      EXPECT_EQ(c.coalesced_size() + 1, once);
      EXPECT_EQ(c.coalesced_outputs_size(), c.coalesced_size());
      EXPECT_EQ(c.coalesced_shard_sizes_size(), 2 * c.coalesced_size());
      EXPECT_EQ(c.dim(), 0);
      EXPECT_EQ(&s, &r1.steps(0));
      for (int k = 0; k < c.coalesced_size(); ++k) {
        const v1::Buffer& shard = r1.buffers(c.coalesced(k));
        const v1::Buffer& whole = r1.buffers(c.coalesced_outputs(k));
        EXPECT_EQ(shard.role(), v1::Buffer::PARAMETER);
        EXPECT_EQ(whole.shape(0), whole.global_shape(0));
        EXPECT_EQ(c.coalesced_shard_sizes(2 * k) + c.coalesced_shard_sizes(2 * k + 1),
                  whole.shape(0));
        EXPECT_EQ(c.coalesced_shard_sizes(2 * k + 1), shard.shape(0));
      }
    }
    if (c.collective() == v1::REDUCE_SCATTER) {
      EXPECT_EQ(s.phase(), v1::Step::GRADIENT_SYNC);
      EXPECT_EQ(c.coalesced_size() + 1, once);
      ++scatters;
    }
  }
  EXPECT_EQ(gathers, 1);
  EXPECT_EQ(scatters, 1);
  EXPECT_EQ(backward_gathers, 0);
  // The gathered copy is kept for backward.
  const v1::Buffer* whole = Find(r1, "layer0/mlp/fc1/weight#gathered", v1::Buffer::ACTIVATION);
  ASSERT_NE(whole, nullptr);
  int first_backward = 0;
  while (r1.steps(first_backward).phase() == v1::Step::FORWARD) ++first_backward;
  EXPECT_GT(whole->last_use(), first_backward);
  // The optimizer runs on the shard: Adam moments of the shard's rows.
  const v1::Buffer* w = Find(r1, "layer0/mlp/fc1/weight", v1::Buffer::PARAMETER);
  ASSERT_NE(w, nullptr);
  for (const auto& b : r1.buffers()) {
    if (b.role() == v1::Buffer::OPTIMIZER_STATE &&
        b.tensor().rfind("layer0/mlp/fc1/weight#", 0) == 0) {
      EXPECT_EQ(b.shape(0), w->shape(0));
      EXPECT_LT(b.shape(0), b.global_shape(0));
    }
  }
}

TEST(LowerTest, BuffersAliveTogetherNeverOverlapAndMemoryIsReused) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.6, 0.4}, std::nullopt,
                            synth::TensorParallelRule);
  LowerOptions o;
  o.world_size = 2;
  o.ratios = {0.6, 0.4};
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  for (const auto& prog : *progs) {
    int64_t sum = 0;
    std::vector<std::tuple<int, int, int64_t, int64_t>> live;
    for (const auto& b : prog.buffers()) {
      int64_t n = 4;
      for (int64_t d : b.shape()) n *= d;
      if (b.dtype() == v1::INT64 || b.dtype() == v1::FLOAT64) n *= 2;
      sum += n;
      EXPECT_LE(b.offset_bytes() + n, prog.arena_bytes());
      live.emplace_back(b.first_use(), b.last_use(), b.offset_bytes(), b.offset_bytes() + n);
    }
    for (size_t i = 0; i < live.size(); ++i) {
      for (size_t j = i + 1; j < live.size(); ++j) {
        auto [f1, l1, b1, e1] = live[i];
        auto [f2, l2, b2, e2] = live[j];
        bool time = f1 <= l2 && f2 <= l1;
        bool space = b1 < e2 && b2 < e1;
        EXPECT_FALSE(time && space) << prog.buffers(i).tensor() << " and "
                                    << prog.buffers(j).tensor();
      }
    }
    EXPECT_LT(prog.arena_bytes(), sum);
  }
}

TEST(LowerTest, AnOperandAddedOnceIntoAPartialSumIsReadOnRankZeroOnly) {
  graph::Graph g = Gpt(8);
  synth::Program p = Search(g, 2, {0.5, 0.5}, std::nullopt,
                            synth::TensorParallelRule);
  bool found = false;
  for (const auto& s : p.steps) {
    if (g.op(s.op).type == "linear" && s.rule.name == "row" && g.op(s.op).inputs.size() == 3) {
      found = true;
    }
  }
  ASSERT_TRUE(found) << "expected a row-parallel linear with a bias";
  LowerOptions o;
  o.world_size = 2;
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  int absent0 = 0, absent1 = 0;
  for (int r = 0; r < 2; ++r) {
    for (const auto& s : (*progs)[r].steps()) {
      if (s.phase() == v1::Step::FORWARD && s.has_kernel() && s.kernel().kernel() == "linear" &&
          s.kernel().inputs_size() == 3 && s.kernel().inputs(2) == -1) {
        (r == 0 ? absent0 : absent1)++;
      }
    }
  }
  EXPECT_EQ(absent0, 0);
  EXPECT_GT(absent1, 0);
}

TEST(LowerTest, BadInputIsAnErrorNamingIt) {
  graph::Graph g = Gpt(8);
  synth::Program p = SingleDeviceProgram(g);
  LowerOptions o;
  o.world_size = 0;
  EXPECT_THAT(Lower(g, p, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("world size must be at least 1")));
  o.world_size = 2;
  o.ratios = {1.0};
  EXPECT_THAT(Lower(g, p, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("1 sharding ratios for a world of 2")));
  o.ratios = {0.7, 0.7};
  EXPECT_THAT(Lower(g, p, o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sum to 1.4")));
  o.ratios = {-0.5, 1.5};
  EXPECT_THAT(Lower(g, p, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("not a finite non-negative")));
  o.ratios = {};
  graph::Graph other = Gpt(4);
  auto mlp = graph::BuildZooModel("mlp", {{"layers", 1}, {"hidden", 8}, {"input", 4}, {"batch", 4}});
  ASSERT_TRUE(mlp.ok());
  EXPECT_THAT(Lower(*mlp, p, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("steps for a graph of")));
}

TEST(LowerTest, AFormOrTensorAStepCannotHaveIsAnErrorNamingIt) {
  // A split along a dimension the tensor lacks was read past its shape
  // (undefined behaviour) when the program was laid out.
  graph::Graph g = Gpt(8);
  LowerOptions o;
  o.world_size = 2;
  synth::Program p = SingleDeviceProgram(g);
  const graph::Op& op0 = g.op(0);
  const std::string x = g.tensor(op0.inputs[0]).name;
  const size_t rank = g.tensor(op0.inputs[0]).type.shape.size();
  p.steps[0].rule.inputs[0] = synth::Form::S(7);
  EXPECT_THAT(Lower(g, p, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("program step 0 (op '", op0.name, "') holds '", x,
                                              "' (", rank, " dimensions) as S(7)"))));
  p = SingleDeviceProgram(g);
  ASSERT_FALSE(p.steps[0].loads.empty());
  p.steps[0].loads[0].form = synth::Form::S(7);
  EXPECT_THAT(Lower(g, p, o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dimensions) as S(7)")));
  p = SingleDeviceProgram(g);
  p.steps[0].loads[0].tensor = static_cast<graph::TensorId>(g.tensors().size());
  EXPECT_THAT(Lower(g, p, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("program step 0 (op '" + op0.name + "') loads tensor " +
                                 std::to_string(g.tensors().size()) + ", not one of the graph's")));
  p = SingleDeviceProgram(g);
  p.steps[0].comms.push_back({});
  p.steps[0].comms.back().tensor = -1;
  EXPECT_THAT(Lower(g, p, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("communicates tensor -1, not one of the graph's")));
}

TEST(LowerTest, DevicesOfAnotherCountThanTheRanksAreAnError) {
  // Rank programs name their device (plan files check it against
  // Plan.devices); a list of another length left ranks without one.
  graph::Graph g = Gpt(8);
  const synth::Program p = SingleDeviceProgram(g);
  LowerOptions o;
  o.world_size = 2;
  for (const std::vector<std::string>& devices :
       {std::vector<std::string>{"d0"}, std::vector<std::string>{"d0", "d1", "d2"}}) {
    o.devices = devices;
    EXPECT_THAT(
        Lower(g, p, o),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr(absl::StrCat("got ", devices.size(), " devices for a world of 2"))));
  }
  o.devices = {"d0", "d1"};
  auto progs = Lower(g, p, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  EXPECT_EQ((*progs)[1].device(), "d1");
}

TEST(LowerTest, ANegativeGradientBucketSizeIsAnError) {
  // It was taken as the default 64 MiB (what 0 means).
  graph::Graph g = Gpt(8);
  LowerOptions o;
  o.world_size = 2;
  o.overlap = true;
  o.gradient_bucket_bytes = -4096;
  EXPECT_THAT(Lower(g, SingleDeviceProgram(g), o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gradient bucket size must not be negative, got -4096")));
}

TEST(ArenaTest, PlacesDisjointLifetimesTogetherAndOverlappingApart) {
  ArenaLayout l = PlanArena({{100, 0, 1}, {100, 2, 3}, {50, 1, 2}});
  // 0 and 1 never live together: they share an offset; 2 overlaps both.
  EXPECT_EQ(l.offsets[0], l.offsets[1]);
  EXPECT_TRUE(l.offsets[2] >= 128 || l.offsets[2] + 50 <= l.offsets[0]);
  EXPECT_EQ(l.total_bytes, 128 + 64);
  EXPECT_EQ(l.offsets[2] % kArenaAlignment, 0);
}

TEST(ArenaTest, BuffersAliveTogetherBeyondInt64AreAnOverflowNotWrappedOffsets) {
  const int64_t big = int64_t{1} << 61;  // a 2^59-element float64 tensor
  ArenaLayout l = PlanArena({{big, 0, 1}, {big, 0, 1}, {big, 0, 1}, {big, 0, 1}, {big, 0, 1}});
  EXPECT_TRUE(l.overflow);
  // Apart in time, they fit.
  ArenaLayout apart = PlanArena({{big, 0, 0}, {big, 1, 1}, {big, 2, 2}, {big, 3, 3}});
  EXPECT_FALSE(apart.overflow);
  EXPECT_EQ(apart.total_bytes, big);
}

// A pipeline stage's programs: the single-device program's steps of the
// ops after a cut, with the activation crossing it as the stage input.
TEST(LowerStageTest, BoundaryBuffersAndSeed) {
  graph::Graph g = Gpt(4);
  synth::Program whole = SingleDeviceProgram(g);
  // The embedding's output crosses the cut after op 0 (the first valid cut
  // is not assumed: the op whose output op 1 reads).
  const graph::Op& second = g.op(1);
  StageSpec last;
  last.begin_op = 1;
  last.end_op = static_cast<int>(g.ops().size());
  last.input = second.inputs[0];
  last.microbatches = 4;
  synth::Program tail;
  for (int k = last.begin_op; k < last.end_op; ++k) tail.steps.push_back(whole.steps[k]);
  LowerOptions o;
  auto progs = LowerStage(g, tail, last, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  std::map<v1::Buffer::Role, int> roles;
  for (const v1::Buffer& b : (*progs)[0].buffers()) roles[b.role()] += 1;
  EXPECT_EQ(roles[v1::Buffer::STAGE_INPUT], 1);
  EXPECT_EQ(roles[v1::Buffer::STAGE_INPUT_GRADIENT], 1);
  EXPECT_EQ(roles[v1::Buffer::STAGE_OUTPUT], 0);
  // The loss gradient's seed is 1/M.
  bool quarter = false;
  for (const v1::Step& st : (*progs)[0].steps()) {
    if (st.has_kernel() && st.kernel().kernel() == "fill" && st.phase() == v1::Step::BACKWARD &&
        st.kernel().attrs().count("value") && st.kernel().attrs().at("value").f() == 0.25) {
      quarter = true;
    }
  }
  EXPECT_TRUE(quarter);

  // The first op alone: its output goes on, no loss.
  StageSpec first;
  first.begin_op = 0;
  first.end_op = 1;
  first.output = second.inputs[0];
  synth::Program head;
  head.steps.push_back(whole.steps[0]);
  progs = LowerStage(g, head, first, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  roles.clear();
  for (const v1::Buffer& b : (*progs)[0].buffers()) roles[b.role()] += 1;
  EXPECT_EQ(roles[v1::Buffer::STAGE_OUTPUT], 1);
  EXPECT_EQ(roles[v1::Buffer::STAGE_OUTPUT_GRADIENT], 1);
  EXPECT_EQ(roles[v1::Buffer::STAGE_INPUT], 0);

  // Bad stages are named.
  StageSpec no_loss = first;
  no_loss.output = -1;
  EXPECT_THAT(LowerStage(g, head, no_loss, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must compute the loss")));
  StageSpec wrong_out = first;
  wrong_out.output = g.loss();
  EXPECT_THAT(LowerStage(g, head, wrong_out, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not produced by ops")));
  EXPECT_THAT(LowerStage(g, tail, first, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("steps for ops [0, 1)")));
  // An input form the stage never reads the input in (its dimension is in
  // no class of the stage's program) is named, not a crash.
  StageSpec sharded_in = last;
  sharded_in.input_form = synth::Form::S(0);
  LowerOptions two;
  two.world_size = 2;
  EXPECT_THAT(
      LowerStage(g, tail, sharded_in, two).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the stage reads its input (tensor")));
  StageSpec range = last;
  range.end_op += 1;
  EXPECT_THAT(LowerStage(g, tail, range, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("are not a range")));
}

// A stage after the first prefetches its ZeRO-3 parameters' gathers one op
// ahead as Lower does: the prefetch was keyed by op id, not by the stage's
// step, so such a stage gathered every parameter in line.
TEST(LowerStageTest, OverlapPrefetchesZero3GathersInEveryStage) {
  graph::Graph g = Gpt(8);
  synth::Program whole =
      Search(g, 2, {0.5, 0.5}, synth::ParamStorage::kZero, synth::DataParallelRule);
  StageSpec last;
  last.begin_op = 1;
  last.end_op = static_cast<int>(g.ops().size());
  last.input = g.op(1).inputs[0];
  last.input_form = whole.steps[1].rule.inputs[0];
  synth::Program tail;
  for (int k = last.begin_op; k < last.end_op; ++k) tail.steps.push_back(whole.steps[k]);
  // Loaded where the stage first reads it (its load sat in op 0's step).
  for (synth::SourceLoad& l : whole.steps[0].loads) {
    if (!l.parameter) continue;
    for (synth::OpStep& step : tail.steps) {
      const auto& in = g.op(step.op).inputs;
      if (std::find(in.begin(), in.end(), l.tensor) != in.end()) {
        step.loads.push_back(l);
        break;
      }
    }
  }
  LowerOptions o;
  o.world_size = 2;
  o.overlap = true;
  auto progs = LowerStage(g, tail, last, o);
  ASSERT_TRUE(progs.ok()) << progs.status();
  ExpectMatchingCollectives(*progs);
  const v1::RankProgram& r = (*progs)[1];
  CheckAsyncPlacement(r);
  int gathers = 0, in_line = 0;
  for (int i = 0; i < r.steps_size(); ++i) {
    const v1::Step& s = r.steps(i);
    if (s.phase() != v1::Step::FORWARD || !s.has_collective() ||
        s.collective().collective() != v1::ALL_GATHER ||
        r.buffers(s.collective().output()).tensor().find("#gathered") == std::string::npos) {
      continue;
    }
    ++gathers;
    if (!s.collective().async()) ++in_line;
  }
  EXPECT_GT(gathers, 4);
  EXPECT_EQ(in_line, 0);
}

// The per-op hooks (op_lowering.h): each belongs to a registered op type (a
// family that misspells a type would own none: the count drops), and a rule
// that lowers apart has both its forward and its backward.
TEST(OpLoweringTest, HooksBelongToRegisteredOpsAndAreComplete) {
  std::set<std::string> hooked;
  for (const graph::OpDef* d : graph::OpRegistry::Global().All()) {
    const internal::OpLowering* h = internal::FindOpLowering(d->type);
    if (h == nullptr) continue;
    SCOPED_TRACE(d->type);
    hooked.insert(d->type);
    EXPECT_TRUE(h->attrs != nullptr || h->bf16_product != nullptr || h->lowers_apart != nullptr ||
                h->after_forward != nullptr);
    EXPECT_EQ(h->lowers_apart != nullptr, h->forward != nullptr);
    EXPECT_EQ(h->lowers_apart != nullptr, h->backward != nullptr);
  }
  EXPECT_EQ(hooked, (std::set<std::string>{"batch_norm", "conv2d", "conv3d", "cross_entropy",
                                           "drop_path", "dropout", "embedding", "linear", "matmul",
                                           "mean", "moe_combine_idx", "moe_dispatch_idx",
                                           "moe_route", "nll_loss"}));
  EXPECT_EQ(internal::FindOpLowering("relu"), nullptr);
  EXPECT_EQ(internal::FindOpLowering("no_such_op"), nullptr);
}

}  // namespace
}  // namespace hap::lower
