#include "executor/data/batches.h"

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"

namespace hap::data {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

// A language model with inputs tokens[b, s] and labels[b*s] over 64 ids.
graph::Graph Lm(int64_t b, int64_t s) {
  graph::GraphBuilder g("lm");
  graph::TensorId t = g.Input("tokens", graph::I64({b, s}));
  graph::TensorId y = g.Input("labels", graph::I64({b * s}), graph::InputRole::kLabels);
  graph::TensorId table =
      g.Parameter("table", graph::F32({64, 64}), graph::Initializer::Normal(0, 1));
  graph::TensorId e = g.Add("embedding", "emb", {t, table});
  graph::TensorId logits =
      g.Add("reshape", "flat", {e}, {{"shape", std::vector<int64_t>{b * s, 64}}});
  g.SetLoss(g.Add("cross_entropy", "loss", {logits, y}));
  auto built = g.Build();
  EXPECT_TRUE(built.ok()) << built.status();
  return *std::move(built);
}

// How often each (token, label) pair of a corpus of ids 0..n-1 is read
// over `steps` steps.
std::map<std::pair<int64_t, int64_t>, int64_t> PairsRead(int64_t b, int64_t s, int64_t n,
                                                         int64_t steps) {
  std::vector<int64_t> corpus;
  for (int64_t i = 0; i < n; ++i) corpus.push_back(i);
  graph::Graph g = Lm(b, s);
  auto lm = NewLmBatches(g, corpus);
  EXPECT_THAT(lm.status(), IsOk());
  std::map<std::pair<int64_t, int64_t>, int64_t> pairs;
  if (!lm.ok()) return pairs;
  for (int64_t step = 0; step < steps; ++step) {
    auto batch = (*lm)->Get(step);
    EXPECT_THAT(batch.status(), IsOk());
    if (!batch.ok()) return pairs;
    const int64_t* t = batch->at("tokens").as<int64_t>();
    const int64_t* l = batch->at("labels").as<int64_t>();
    for (int64_t i = 0; i < b * s; ++i) ++pairs[{t[i], l[i]}];
  }
  return pairs;
}

// Every token of the corpus is predicted from the one before it, equally
// often over a whole number of cycles, whatever the corpus length, B and
// S. Windows started at (i * stride + step * S) mod (n - S - 1) and never
// reached the last token: with n = 14, S = 4 the pair 12 -> 13 was never
// read; with n = 13, S = 4, B = 2 the starts were 0 and 4 only (the step
// advance S shares a factor with n - S - 1 = 8), and tokens 9 to 12 were
// never labels. The corpus is now read as a loop (its last token is
// followed by its first: WikiText's ends in <eos>, as every line does).
TEST(LmBatchesTest, EveryTokenIsALabelEquallyOften) {
  struct Case {
    int64_t b, s, n;
  };
  for (const Case& c :
       {Case{1, 4, 14}, Case{2, 4, 13}, Case{2, 4, 16}, Case{3, 5, 17}, Case{4, 2, 9}}) {
    SCOPED_TRACE(::testing::Message() << "B " << c.b << ", S " << c.s << ", " << c.n << " tokens");
    // Over n steps, step * S mod n takes each multiple of g = gcd(S, n)
    // g times; windows of S from those starts cover each position S times
    // a row.
    const auto pairs = PairsRead(c.b, c.s, c.n, c.n);
    for (int64_t k = 0; k < c.n; ++k) {
      const std::pair<int64_t, int64_t> p = {k, (k + 1) % c.n};
      auto it = pairs.find(p);
      EXPECT_TRUE(it != pairs.end() && it->second == c.b * c.s)
          << "token " << p.first << " -> " << p.second << " read "
          << (it == pairs.end() ? 0 : it->second) << " times, not " << c.b * c.s;
    }
    EXPECT_EQ(pairs.size(), static_cast<size_t>(c.n)) << "distinct (token, label) pairs read";
  }
}

// The shortest corpus is a sequence and the token after it.
TEST(LmBatchesTest, TheShortestCorpusIsOneWindow) {
  graph::Graph g = Lm(2, 4);
  EXPECT_THAT(NewLmBatches(g, {0, 1, 2, 3}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the corpus has 4 tokens, fewer than a sequence of 4 and the "
                                 "token after it")));
  auto lm = NewLmBatches(g, {0, 1, 2, 3, 4});
  ASSERT_THAT(lm.status(), IsOk());
  auto batch = (*lm)->Get(0);
  ASSERT_THAT(batch.status(), IsOk());
  const int64_t* l = batch->at("labels").as<int64_t>();
  EXPECT_EQ(std::vector<int64_t>(l, l + 4), (std::vector<int64_t>{1, 2, 3, 4}));
}

}  // namespace
}  // namespace hap::data
