// The MoE kernels on the CPU: the dense gate, dispatch and combine against
// finite differences and hand-computed routing, and the compact form
// (moe_route, moe_route_weights, index dispatch and combine) against the
// dense one, expert shards included.
#include <cmath>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/kernel_test_util.h"
#include "executor/cpu/kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::kernel_test {
namespace {

using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

// The combine weights of moe_gate on fixed logits.
HostTensor GateCombine(const HostTensor& logits, int64_t k, int64_t cap) {
  const Shape& s = logits.shape();
  HostTensor out(DType::kFloat64, {s[0], s[1], cap});
  EXPECT_THAT(RunKernel("moe_gate", {{"k", k}, {"capacity", cap}}, {logits}, {out}),
              IsOk());
  return out;
}

TEST(KernelGradTest, Moe) {
  // 6 tokens, 4 experts: with capacity 2 some assignments overflow.
  ExpectGradientsMatch({"moe_gate", {{"k", int64_t{2}}, {"capacity", int64_t{2}}},
                        {Rand({6, 4}, 1, 2.0)}});
  ExpectGradientsMatch({"moe_gate", {{"k", int64_t{1}}, {"capacity", int64_t{2}}},
                        {Rand({6, 4}, 2, 2.0)}});
  HostTensor combine = GateCombine(Rand({6, 4}, 3, 2.0), 2, 2);
  ExpectGradientsMatch({"moe_dispatch", {}, {Rand({6, 3}, 4), combine}});
  ExpectGradientsMatch({"moe_combine", {}, {Rand({4, 2, 3}, 5), combine}});
}


TEST(KernelTest, MoeGateRouting) {
  // Probabilities (softmax rows) order experts: token 0 -> 1, 0; token 1 ->
  // 1, 2; token 2 -> 1, 0 (expert 1 full at capacity 2: dropped there).
  HostTensor logits = Vals({3, 3}, {1.0, 2.0, 0.0,  //
                                    0.0, 3.0, 1.0,  //
                                    2.5, 3.0, 0.0});
  HostTensor c = GateCombine(logits, 2, 2);
  auto at = [&](int t, int e, int s) { return c.as<double>()[(t * 3 + e) * 2 + s]; };
  auto probs = [&](int t) {
    std::vector<double> p(3);
    double sum = 0;
    for (int e = 0; e < 3; ++e) sum += p[e] = std::exp(logits.as<double>()[t * 3 + e]);
    for (double& v : p) v /= sum;
    return p;
  };
  std::vector<double> p0 = probs(0), p1 = probs(1), p2 = probs(2);
  EXPECT_NEAR(at(0, 1, 0), p0[1] / (p0[1] + p0[0]), 1e-12);
  EXPECT_NEAR(at(0, 0, 0), p0[0] / (p0[1] + p0[0]), 1e-12);
  EXPECT_NEAR(at(1, 1, 1), p1[1] / (p1[1] + p1[2]), 1e-12);
  EXPECT_NEAR(at(1, 2, 0), p1[2] / (p1[1] + p1[2]), 1e-12);
  EXPECT_NEAR(at(2, 0, 1), p2[0] / (p2[1] + p2[0]), 1e-12);
  double total = 0;
  for (int64_t i = 0; i < c.num_elements(); ++i) total += c.as<double>()[i] != 0;
  EXPECT_EQ(total, 5);  // token 2's expert-1 entry was dropped
  // k = 1 (Switch): the unnormalised probability.
  HostTensor s = GateCombine(logits, 1, 1);
  EXPECT_NEAR(s.as<double>()[(0 * 3 + 1) * 1], p0[1], 1e-12);
  EXPECT_EQ(s.as<double>()[(1 * 3 + 1) * 1], 0.0);  // expert 1 full
}

// --- the compact MoE form against the dense one ------------------------------------

// moe_route's int64 slots of `logits`.
HostTensor RouteOf(const HostTensor& logits, int64_t k, int64_t cap) {
  HostTensor out(DType::kInt64, {logits.shape()[0], k});
  EXPECT_THAT(RunKernel("moe_route", {{"k", k}, {"capacity", cap}}, {logits}, {out}),
              IsOk());
  return out;
}

HostTensor WeightsOf(const HostTensor& logits, int64_t k) {
  HostTensor out(DType::kFloat64, {logits.shape()[0], k});
  EXPECT_THAT(RunKernel("moe_route_weights", {{"k", k}}, {logits}, {out}), IsOk());
  return out;
}

void ExpectSame(const HostTensor& got, const HostTensor& want) {
  ASSERT_EQ(got.shape(), want.shape());
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    ASSERT_EQ(got.as<double>()[i], want.as<double>()[i]) << "element " << i;
  }
}

TEST(KernelTest, MoeRouteIsTheGatesRouting) {
  // The fixed logits of MoeGateRouting: token 2's expert-1 choice dropped.
  HostTensor logits = Vals({3, 3}, {1.0, 2.0, 0.0,  //
                                    0.0, 3.0, 1.0,  //
                                    2.5, 3.0, 0.0});
  HostTensor r = RouteOf(logits, 2, 2);
  const std::vector<int64_t> want = {1 * 2 + 0, 0 * 2 + 0,  //
                                     1 * 2 + 1, 2 * 2 + 0,  //
                                     -1, 0 * 2 + 1};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(r.as<int64_t>()[i], want[i]) << i;
  HostTensor w = WeightsOf(logits, 2);
  HostTensor c = GateCombine(logits, 2, 2);
  EXPECT_EQ(w.as<double>()[0], c.as<double>()[(0 * 3 + 1) * 2 + 0]);
  EXPECT_EQ(w.as<double>()[3], c.as<double>()[(1 * 3 + 2) * 2 + 0]);
  EXPECT_EQ(w.as<double>()[5], c.as<double>()[(2 * 3 + 0) * 2 + 1]);
  EXPECT_GT(w.as<double>()[4], 0.0);  // dropped, but its weight is defined
}

TEST(KernelTest, MoeCompactFormMatchesDense) {
  const int64_t t = 11, e = 4, d = 5;
  for (int64_t k : {int64_t{1}, int64_t{2}}) {
    SCOPED_TRACE(k);
    const int64_t cap = 2;  // some choices overflow
    HostTensor logits = Rand({t, e}, 20 + k, 2.0);
    HostTensor combine = GateCombine(logits, k, cap);
    HostTensor route = RouteOf(logits, k, cap);
    HostTensor w = WeightsOf(logits, k);
    int64_t dropped = 0;
    for (int64_t i = 0; i < t * k; ++i) dropped += route.as<int64_t>()[i] < 0;
    EXPECT_GT(dropped, 0);
    const Attrs dattrs = {{"experts", e}, {"capacity", cap}};
    // Forward: bit for bit (same sums in the same order).
    HostTensor x = Rand({t, d}, 30 + k);
    HostTensor disp_dense(DType::kFloat64, {e, cap, d}), disp(DType::kFloat64, {e, cap, d});
    ASSERT_THAT(RunKernel("moe_dispatch", {}, {x, combine}, {disp_dense}), IsOk());
    ASSERT_THAT(RunKernel("moe_dispatch_idx", dattrs, {x, route}, {disp}), IsOk());
    ExpectSame(disp, disp_dense);
    HostTensor y = Rand({e, cap, d}, 40 + k);
    HostTensor out_dense(DType::kFloat64, {t, d}), out(DType::kFloat64, {t, d});
    ASSERT_THAT(RunKernel("moe_combine", {}, {y, combine}, {out_dense}), IsOk());
    ASSERT_THAT(RunKernel("moe_combine_idx", {}, {y, route, w}, {out}), IsOk());
    ExpectSame(out, out_dense);
    // Backward: dispatch's dx and combine's dy bit for bit; the logits'
    // gradient through combine and the gate, to rounding.
    HostTensor ddisp = Rand({e, cap, d}, 50 + k), dout = Rand({t, d}, 60 + k);
    HostTensor dx_dense = Full({t, d}, 0.0), dx = Full({t, d}, 0.0);
    ASSERT_THAT(RunKernel("moe_dispatch_grad", {}, {x, combine, disp_dense, ddisp},
                          {dx_dense, kAbsent}),
                IsOk());
    ASSERT_THAT(RunKernel("moe_dispatch_idx_grad", dattrs, {x, route, disp, ddisp},
                          {dx, kAbsent}),
                IsOk());
    ExpectSame(dx, dx_dense);
    HostTensor dy_dense = Full({e, cap, d}, 0.0), dy = Full({e, cap, d}, 0.0);
    HostTensor dcombine = Full({t, e, cap}, 0.0), dw = Full({t, k}, 0.0);
    ASSERT_THAT(RunKernel("moe_combine_grad", {}, {y, combine, out_dense, dout},
                          {dy_dense, dcombine}),
                IsOk());
    ASSERT_THAT(RunKernel("moe_combine_idx_grad", {}, {y, route, w, out, dout},
                          {dy, kAbsent, dw}),
                IsOk());
    ExpectSame(dy, dy_dense);
    HostTensor dl_dense = Full({t, e}, 0.0), dl = Full({t, e}, 0.0);
    ASSERT_THAT(RunKernel("moe_gate_grad", {{"k", k}, {"capacity", cap}},
                          {logits, combine, dcombine}, {dl_dense}),
                IsOk());
    ASSERT_THAT(RunKernel("moe_route_weights_grad", {{"k", k}}, {logits, w, dw}, {dl}),
                IsOk());
    ExpectAllNear(dl, dl_dense, 1e-12, "logits gradient");
    double norm = 0;
    for (int64_t i = 0; i < t * e; ++i) norm += std::abs(dl.as<double>()[i]);
    EXPECT_GT(norm, 1e-3);  // the comparison is not of zeros
  }
}

TEST(KernelGradTest, MoeCompact) {
  HostTensor logits = Rand({7, 4}, 71, 2.0);
  for (int64_t k : {int64_t{1}, int64_t{2}}) {
    ExpectGradientsMatch({"moe_route_weights", {{"k", k}}, {Rand({6, 4}, 72 + k, 2.0)}});
    HostTensor route = RouteOf(logits, k, 2);
    ExpectGradientsMatch({"moe_dispatch_idx",
                          {{"experts", int64_t{4}}, {"capacity", int64_t{2}}},
                          {Rand({7, 3}, 74 + k), route}});
    ExpectGradientsMatch(
        {"moe_combine_idx", {}, {Rand({4, 2, 3}, 76 + k), route, WeightsOf(logits, k)}});
  }
}

// Experts split in two halves (attributes "expert_offset", "experts"): the
// halves' dispatch outputs are the whole one's, their combines sum to it.
TEST(KernelTest, MoeCompactExpertShards) {
  const int64_t t = 9, e = 4, cap = 3, d = 2, k = 2;
  HostTensor logits = Rand({t, e}, 81, 2.0);
  HostTensor route = RouteOf(logits, k, cap), w = WeightsOf(logits, k);
  HostTensor x = Rand({t, d}, 82), y = Rand({e, cap, d}, 83);
  HostTensor whole(DType::kFloat64, {e, cap, d}), out(DType::kFloat64, {t, d});
  ASSERT_THAT(RunKernel("moe_dispatch_idx", {{"experts", e}, {"capacity", cap}},
                        {x, route}, {whole}),
              IsOk());
  ASSERT_THAT(RunKernel("moe_combine_idx", {}, {y, route, w}, {out}), IsOk());
  HostTensor sum = Full({t, d}, 0.0), dw_sum = Full({t, k}, 0.0);
  HostTensor dout = Rand({t, d}, 84);
  HostTensor dw = Full({t, k}, 0.0);
  ASSERT_THAT(RunKernel("moe_combine_idx_grad", {}, {y, route, w, out, dout},
                        {kAbsent, kAbsent, dw}),
              IsOk());
  for (int64_t half = 0; half < 2; ++half) {
    const Attrs a = {{"experts", e}, {"capacity", cap}, {"expert_offset", 2 * half}};
    HostTensor part(DType::kFloat64, {2, cap, d});
    ASSERT_THAT(RunKernel("moe_dispatch_idx", a, {x, route}, {part}), IsOk());
    ExpectSame(part, Box(whole, {2 * half, 0, 0}, {2, cap, d}));
    HostTensor ys = Box(y, {2 * half, 0, 0}, {2, cap, d});
    HostTensor o(DType::kFloat64, {t, d});
    ASSERT_THAT(RunKernel("moe_combine_idx", a, {ys, route, w}, {o}), IsOk());
    ASSERT_THAT(RunKernel("moe_combine_idx_grad", a, {ys, route, w, o, dout},
                          {kAbsent, kAbsent, dw_sum}),
                IsOk());
    for (int64_t i = 0; i < t * d; ++i) sum.as<double>()[i] += o.as<double>()[i];
  }
  ExpectAllNear(sum, out, 1e-12, "combine");
  ExpectAllNear(dw_sum, dw, 1e-12, "weights gradient");
}

// Grouped routing ("group_size"): each group of tokens routes as if alone,
// into its own run of every expert's slots: group q's route is the
// ungrouped route of its tokens at the group's capacity, shifted by
// q * group capacity. Two groups of 5 tokens, 3 experts, 2 slots per group.
TEST(KernelTest, MoeGroupedRouting) {
  const int64_t t = 10, e = 3, k = 2, g = 5, cap = 4;  // 2 groups x 2 slots
  HostTensor logits = Rand({t, e}, 91, 2.0);
  HostTensor route(DType::kInt64, {t, k});
  ASSERT_THAT(RunKernel("moe_route", {{"k", k}, {"capacity", cap}, {"group_size", g}},
                        {logits}, {route}),
              IsOk());
  int dropped = 0;
  for (int64_t q = 0; q < 2; ++q) {
    HostTensor alone = RouteOf(Box(logits, {q * g, 0}, {g, e}), k, cap / 2);
    for (int64_t i = 0; i < g * k; ++i) {
      const int64_t want = alone.as<int64_t>()[i];
      const int64_t got = route.as<int64_t>()[q * g * k + i];
      if (want < 0) {
        EXPECT_EQ(got, -1) << "group " << q << " entry " << i;
        ++dropped;
        continue;
      }
      // expert * 2 + slot in the group -> expert * 4 + q * 2 + slot.
      EXPECT_EQ(got, want / 2 * cap + q * 2 + want % 2) << "group " << q << " entry " << i;
    }
  }
  EXPECT_GT(dropped, 0);  // the groups' capacity binds
  // A rank holding group 1 only ("token_offset", "global_tokens") routes it
  // as the whole does.
  HostTensor part(DType::kInt64, {g, k});
  ASSERT_THAT(RunKernel("moe_route",
                        {{"k", k}, {"capacity", cap}, {"group_size", g},
                         {"token_offset", g}, {"global_tokens", t}},
                        {Box(logits, {g, 0}, {g, e})}, {part}),
              IsOk());
  for (int64_t i = 0; i < g * k; ++i) {
    EXPECT_EQ(part.as<int64_t>()[i], route.as<int64_t>()[g * k + i]) << i;
  }
  // Tokens that are not whole groups, groups that do not share the
  // capacity, or a part of one group are refused.
  HostTensor half(DType::kInt64, {3, k});
  EXPECT_THAT(RunKernel("moe_route",
                        {{"k", k}, {"capacity", cap}, {"group_size", g},
                         {"token_offset", int64_t{2}}, {"global_tokens", t}},
                        {Box(logits, {2, 0}, {3, e})}, {half}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not whole groups")));
  EXPECT_THAT(RunKernel("moe_route", {{"k", k}, {"capacity", int64_t{5}}, {"group_size", g}},
                        {logits}, {route}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("evenly")));
  EXPECT_THAT(RunKernel("moe_route",
                        {{"k", k}, {"capacity", cap}, {"token_offset", g}, {"global_tokens", t}},
                        {Box(logits, {g, 0}, {g, e})}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("as one group")));
}

// A grouped route split with the tokens: a rank holding groups [q0, q1)
// dispatches its tokens into slots [q0, q1) x group capacity of every
// expert ("capacity_offset"), which are the whole dispatch's; its combine
// (and backward) from those slots alone gives its tokens' rows of the
// whole combine. What the all-to-all of dispatched tokens relies on.
TEST(KernelTest, MoeGroupedCapacityShards) {
  const int64_t t = 12, e = 3, k = 2, g = 4, cap = 6, d = 2;  // 3 groups x 2 slots
  HostTensor logits = Rand({t, e}, 93, 2.0);
  HostTensor route(DType::kInt64, {t, k});
  ASSERT_THAT(RunKernel("moe_route", {{"k", k}, {"capacity", cap}, {"group_size", g}},
                        {logits}, {route}),
              IsOk());
  HostTensor w = WeightsOf(logits, k), x = Rand({t, d}, 94), y = Rand({e, cap, d}, 95);
  HostTensor dout = Rand({t, d}, 96);
  HostTensor whole(DType::kFloat64, {e, cap, d}), out(DType::kFloat64, {t, d});
  const Attrs all = {{"experts", e}, {"capacity", cap}, {"group_size", g}};
  ASSERT_THAT(RunKernel("moe_dispatch_idx", all, {x, route}, {whole}), IsOk());
  ASSERT_THAT(RunKernel("moe_combine_idx", all, {y, route, w}, {out}), IsOk());
  HostTensor dy = Full({e, cap, d}, 0.0), dw = Full({t, k}, 0.0), dx = Full({t, d}, 0.0);
  ASSERT_THAT(RunKernel("moe_combine_idx_grad", all, {y, route, w, out, dout},
                        {dy, kAbsent, dw}),
              IsOk());
  ASSERT_THAT(RunKernel("moe_dispatch_idx_grad", all, {x, route, whole, dy}, {dx, kAbsent}),
              IsOk());
  // Rank 0: group 0 (tokens 0-3, slots 0-1); rank 1: groups 1-2.
  const int64_t first[] = {0, 1}, groups[] = {1, 2};
  for (int r = 0; r < 2; ++r) {
    const int64_t t0 = first[r] * g, tn = groups[r] * g;
    const int64_t c0 = first[r] * 2, cn = groups[r] * 2;
    Attrs a = all;
    a.Set("capacity_offset", c0);
    HostTensor rt(DType::kInt64, {tn, k}), wt = Box(w, {t0, 0}, {tn, k});
    for (int64_t i = 0; i < tn * k; ++i) rt.as<int64_t>()[i] = route.as<int64_t>()[t0 * k + i];
    HostTensor part(DType::kFloat64, {e, cn, d});
    ASSERT_THAT(RunKernel("moe_dispatch_idx", a, {Box(x, {t0, 0}, {tn, d}), rt}, {part}),
                IsOk());
    ExpectSame(part, Box(whole, {0, c0, 0}, {e, cn, d}));
    HostTensor ys = Box(y, {0, c0, 0}, {e, cn, d});
    HostTensor o(DType::kFloat64, {tn, d});
    ASSERT_THAT(RunKernel("moe_combine_idx", a, {ys, rt, wt}, {o}), IsOk());
    ExpectAllNear(o, Box(out, {t0, 0}, {tn, d}), 1e-12, "combine");
    HostTensor pdy = Full({e, cn, d}, 0.0), pdw = Full({tn, k}, 0.0);
    ASSERT_THAT(RunKernel("moe_combine_idx_grad", a,
                          {ys, rt, wt, o, Box(dout, {t0, 0}, {tn, d})}, {pdy, kAbsent, pdw}),
                IsOk());
    ExpectAllNear(pdy, Box(dy, {0, c0, 0}, {e, cn, d}), 1e-12, "combine's y gradient");
    ExpectAllNear(pdw, Box(dw, {t0, 0}, {tn, k}), 1e-12, "combine's weights gradient");
    HostTensor pdx = Full({tn, d}, 0.0);
    ASSERT_THAT(RunKernel("moe_dispatch_idx_grad", a, {Box(x, {t0, 0}, {tn, d}), rt, part, pdy},
                          {pdx, kAbsent}),
                IsOk());
    ExpectAllNear(pdx, Box(dx, {t0, 0}, {tn, d}), 1e-12, "dispatch's x gradient");
  }
  Attrs beyond = all;
  beyond.Set("capacity_offset", int64_t{5});
  HostTensor two(DType::kFloat64, {e, 2, d});
  EXPECT_THAT(RunKernel("moe_dispatch_idx", beyond, {x, route}, {two}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
}

TEST(KernelTest, MoeCompactRejectsBadRoutes) {
  HostTensor x = Rand({2, 3}, 90);
  HostTensor out(DType::kFloat64, {2, 2, 3});
  const Attrs a = {{"experts", int64_t{2}}, {"capacity", int64_t{2}}};
  HostTensor outside = Ints({2, 1}, {0, 4});  // slots are 0..3
  EXPECT_THAT(RunKernel("moe_dispatch_idx", a, {x, outside}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("route entry [1, 0] = 4 is not a slot")));
  HostTensor twice = Ints({2, 1}, {3, 3});
  EXPECT_THAT(RunKernel("moe_dispatch_idx", a, {x, twice}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("both take slot 3")));
  HostTensor f32 = Full({2, 1}, 0.0);
  EXPECT_THAT(RunKernel("moe_dispatch_idx", a, {x, f32}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be int64")));
  const Attrs beyond = {{"experts", int64_t{3}}, {"expert_offset", int64_t{2}}};
  EXPECT_THAT(RunKernel("moe_dispatch_idx", beyond, {x, Ints({2, 1}, {0, 1})}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
}

}  // namespace
}  // namespace hap::executor::kernel_test
