// Tests of the CPU kernels: every backward kernel against central finite
// differences in float64 (with accumulation, absent output gradients and
// absent input gradients), the sharded-execution attributes, float32
// against float64, and argument errors. The MoE, LSTM and optimizer kernels
// have files of their own; the helpers are in kernel_test_util.h.
#include "executor/cpu/kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>

#include "common/status_matchers.h"
#include "executor/cpu/kernel_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/op_registry.h"

namespace hap::executor::kernel_test {
namespace {

using graph::Attrs;
using graph::DType;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// --- gradients, op by op ----------------------------------------------------------

TEST(KernelGradTest, Linear) {
  ExpectGradientsMatch({"linear", {}, {Rand({2, 3, 4}, 1), Rand({5, 4}, 2), Rand({5}, 3)}});
  ExpectGradientsMatch({"linear", {}, {Rand({3, 4}, 4), Rand({2, 4}, 5)}});
  // Bias slot present but absent: no bias.
  ExpectGradientsMatch({"linear", {}, {Rand({3, 4}, 4), Rand({2, 4}, 5), kAbsent},
                        {{3, 2}}});
}

TEST(KernelGradTest, Matmul) {
  ExpectGradientsMatch({"matmul", {}, {Rand({3, 4}, 1), Rand({4, 2}, 2)}});
  ExpectGradientsMatch({"matmul", {}, {Rand({2, 3, 4}, 3), Rand({4, 5}, 4)}});
  ExpectGradientsMatch({"matmul", {}, {Rand({2, 2, 3, 4}, 5), Rand({2, 2, 4, 3}, 6)}});
}

TEST(KernelGradTest, BinaryBroadcasting) {
  for (const char* op : {"add", "sub", "mul"}) {
    ExpectGradientsMatch({op, {}, {Rand({2, 3}, 1), Rand({2, 3}, 2)}});
    ExpectGradientsMatch({op, {}, {Rand({2, 3, 4}, 3), Rand({3, 1}, 4)}});
    ExpectGradientsMatch({op, {}, {Rand({1, 4}, 5), Rand({3, 1}, 6)}});
    ExpectGradientsMatch({op, {}, {Rand({4}, 7), Rand({2, 3, 4}, 8)}});
    ExpectGradientsMatch({op, {}, {Rand({2, 1, 4}, 9), Rand({}, 10)}});
  }
}

TEST(KernelGradTest, BinaryAbsentOperand) {
  for (const char* op : {"add", "sub", "mul"}) {
    ExpectGradientsMatch({op, {}, {kAbsent, Rand({2, 3}, 1)}, {{2, 3}}});
    ExpectGradientsMatch({op, {}, {Rand({2, 3}, 2), kAbsent}, {{2, 3}}});
    ExpectGradientsMatch({op, {}, {kAbsent, Rand({3}, 3)}, {{2, 3}}});
  }
  // Forward values: add -> the other operand, sub -> its negation first.
  HostTensor b = Rand({2, 3}, 4), out(DType::kFloat64, {2, 3});
  ASSERT_THAT(RunKernel("sub", {}, {kAbsent, b}, {out}), IsOk());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.as<double>()[i], -b.as<double>()[i]);
  ASSERT_THAT(RunKernel("add", {}, {b, kAbsent}, {out}), IsOk());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.as<double>()[i], b.as<double>()[i]);
}

TEST(KernelGradTest, Activations) {
  for (const char* op :
       {"relu", "gelu", "sigmoid", "tanh", "silu", "relu6", "hardsigmoid", "hardswish", "exp"}) {
    ExpectGradientsMatch({op, {}, {Rand({3, 5}, 1, 3.0)}});
  }
  // rsqrt and log on positive values, [0.5, 2.5].
  HostTensor positive = Rand({3, 5}, 5);
  for (int64_t i = 0; i < positive.num_elements(); ++i) positive.as<double>()[i] += 1.5;
  ExpectGradientsMatch({"rsqrt", {}, {positive}});
  ExpectGradientsMatch({"log", {}, {positive}});
  // relu6 on both sides of its clamp.
  ExpectGradientsMatch({"relu6", {}, {Rand({4, 6}, 3, 9.0)}});
  for (const char* op : {"hardsigmoid", "hardswish"}) {
    ExpectGradientsMatch({op, {}, {Rand({4, 6}, 4, 6.0)}});
  }
  ExpectGradientsMatch({"scale", {{"factor", 0.37}}, {Rand({2, 3}, 2)}});
}

TEST(KernelGradTest, Dropout) {
  ExpectGradientsMatch(
      {"dropout", {{"p", 0.3}, {"rng_key", int64_t{7}}}, {Rand({3, 5}, 1)}, {}, 2});
  ExpectGradientsMatch({"dropout", {{"p", 0.5}}, {Rand({4, 2, 3}, 2)}});
}

TEST(KernelGradTest, DropPath) {
  ExpectGradientsMatch(
      {"drop_path", {{"p", 0.4}, {"rng_key", int64_t{9}}}, {Rand({6, 2, 3}, 1)}, {}, 3});
  ExpectGradientsMatch({"drop_path", {{"p", 0.5}, {"mode", std::string("batch")}},
                        {Rand({4, 3}, 2)}, {}, 1});
}

// Row mode keeps or drops each sample whole (about 1 - p of them), scaled by
// 1 / (1 - p); a shard's mask is its slice of the whole batch's.
TEST(KernelShardTest, DropPathDropsWholeSamplesAndShardsAreSlices) {
  const Attrs attrs = {{"p", 0.3}, {"rng_key", int64_t{41}}};
  const HostTensor x = Full({200, 3, 2}, 1.0);
  HostTensor y(DType::kFloat64, x.shape());
  ASSERT_THAT(RunKernel("drop_path", attrs, {x}, {y}, 5), IsOk());
  int kept = 0;
  for (int64_t m = 0; m < 200; ++m) {
    const double v = y.as<double>()[m * 6];
    EXPECT_TRUE(v == 0.0 || std::abs(v - 1 / 0.7) < 1e-12) << v;
    for (int j = 1; j < 6; ++j) EXPECT_EQ(y.as<double>()[m * 6 + j], v) << m;
    kept += v != 0.0;
  }
  EXPECT_GT(kept, 110);
  EXPECT_LT(kept, 170);
  Attrs shard = attrs;
  shard.Set("global_shape", std::vector<int64_t>{200, 3, 2});
  shard.Set("offsets", std::vector<int64_t>{50, 1, 0});
  const HostTensor xs = Full({30, 2, 2}, 1.0);
  HostTensor ys(DType::kFloat64, xs.shape());
  ASSERT_THAT(RunKernel("drop_path", shard, {xs}, {ys}, 5), IsOk());
  ExpectAllNear(ys, Box(y, {50, 1, 0}, {30, 2, 2}), 0, "shard");
  // Batch mode: all or nothing; another step draws again.
  Attrs batch = attrs;
  batch.Set("mode", std::string("batch"));
  int all_kept = 0;
  for (int64_t step = 0; step < 40; ++step) {
    ASSERT_THAT(RunKernel("drop_path", batch, {x}, {y}, step), IsOk());
    const double v = y.as<double>()[0];
    for (int64_t i = 1; i < x.num_elements(); ++i) ASSERT_EQ(y.as<double>()[i], v);
    all_kept += v != 0.0;
  }
  EXPECT_GT(all_kept, 10);
  EXPECT_LT(all_kept, 40);
  batch.Set("mode", std::string("column"));
  EXPECT_THAT(RunKernel("drop_path", batch, {x}, {y}, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mode")));
}

TEST(KernelGradTest, LayerNorm) {
  ExpectGradientsMatch({"layer_norm", {{"eps", 1e-5}},
                        {Rand({2, 3, 5}, 1), Rand({5}, 2), Rand({5}, 3)}});
}

TEST(KernelGradTest, BatchNorm) {
  // NCHW with running statistics (not differentiated), [n, c] without.
  ExpectGradientsMatch({"batch_norm", {{"eps", 1e-5}, {"momentum", 0.2}},
                        {Rand({3, 4, 2, 3}, 1, 2.0), Rand({4}, 2), Rand({4}, 3),
                         Rand({4}, 4), Full({4}, 1.0)}});
  ExpectGradientsMatch({"batch_norm", {}, {Rand({5, 3}, 5, 2.0), Rand({3}, 6), Rand({3}, 7)}});
}

// The running statistics move towards the batch's mean and unbiased
// variance (PyTorch's rule); y is normalised with the biased variance.
TEST(KernelTest, BatchNormUpdatesRunningStatistics) {
  HostTensor x = Vals({4, 1}, {1, 2, 3, 6}), y(DType::kFloat64, {4, 1});
  HostTensor rm = Vals({1}, {1.0}), rv = Vals({1}, {2.0});
  ASSERT_THAT(RunKernel("batch_norm", {{"momentum", 0.25}, {"eps", 1e-9}},
                        {x, Full({1}, 1.0), Full({1}, 0.0), rm, rv}, {y}),
              IsOk());
  // mean 3, biased variance 3.5, unbiased 14/3.
  EXPECT_NEAR(rm.as<double>()[0], 0.75 * 1.0 + 0.25 * 3.0, 1e-12);
  EXPECT_NEAR(rv.as<double>()[0], 0.75 * 2.0 + 0.25 * 14.0 / 3.0, 1e-12);
  EXPECT_NEAR(y.as<double>()[3], 3.0 / std::sqrt(3.5), 1e-7);
}

// The pieces of a batch-sharded batch_norm (kernels_batch_norm.cc) on two
// uneven shards, their sums added as the all-reduce would, give the
// single-device kernels' y, dx, dgamma + dbeta (summed over shards) and
// running statistics.
TEST(KernelShardTest, BatchNormPiecesOnShardsMatchTheWholeBatch) {
  const int64_t c = 3;
  const HostTensor x = Rand({7, c, 2, 2}, 11, 2.0), dy = Rand({7, c, 2, 2}, 12);
  const HostTensor gamma = Rand({c}, 13), beta = Rand({c}, 14);
  const Attrs attrs = {{"eps", 1e-5}, {"momentum", 0.3}};
  HostTensor rm = Rand({c}, 15), rv = Full({c}, 1.5);
  HostTensor y(DType::kFloat64, x.shape());
  ASSERT_THAT(RunKernel("batch_norm", attrs, {x, gamma, beta, rm, rv}, {y}), IsOk());
  HostTensor dx = Full(x.shape(), 0.0), dg = Full({c}, 0.0), db = Full({c}, 0.0);
  ASSERT_THAT(RunKernel("batch_norm_grad", attrs,
                        {x, gamma, beta, kAbsent, kAbsent, y, dy},
                        {dx, dg, db, kAbsent, kAbsent}),
              IsOk());

  Attrs sharded = attrs;
  sharded.Set("global_count", int64_t{7 * 4});
  const int64_t starts[] = {0, 2}, lengths[] = {2, 5};
  std::vector<HostTensor> xs, dys;
  HostTensor sums = Full({2, c}, 0.0);
  for (int r = 0; r < 2; ++r) {
    xs.push_back(Box(x, {starts[r], 0, 0, 0}, {lengths[r], c, 2, 2}));
    dys.push_back(Box(dy, {starts[r], 0, 0, 0}, {lengths[r], c, 2, 2}));
    HostTensor local(DType::kFloat64, {2, c});
    ASSERT_THAT(RunKernel("batch_norm_stats", sharded, {xs[r]}, {local}), IsOk());
    for (int i = 0; i < 2 * c; ++i) sums.as<double>()[i] += local.as<double>()[i];
  }
  HostTensor gsums = Full({2, c}, 0.0);
  for (int r = 0; r < 2; ++r) {
    HostTensor local(DType::kFloat64, {2, c});
    ASSERT_THAT(RunKernel("batch_norm_grad_stats", sharded, {xs[r], sums, dys[r]}, {local}),
                IsOk());
    for (int i = 0; i < 2 * c; ++i) gsums.as<double>()[i] += local.as<double>()[i];
  }
  HostTensor dg_sum = Full({c}, 0.0), db_sum = Full({c}, 0.0);
  for (int r = 0; r < 2; ++r) {
    // Each rank updates its own (replicated) copy of the running statistics.
    HostTensor rm_r = Rand({c}, 15), rv_r = Full({c}, 1.5);
    HostTensor yr(DType::kFloat64, xs[r].shape());
    ASSERT_THAT(RunKernel("batch_norm_apply", sharded,
                          {xs[r], gamma, beta, rm_r, rv_r, sums}, {yr}),
                IsOk());
    ExpectAllNear(yr, Box(y, {starts[r], 0, 0, 0}, yr.shape()), 1e-12, "y");
    ExpectAllNear(rm_r, rm, 1e-12, "running_mean");
    ExpectAllNear(rv_r, rv, 1e-12, "running_var");
    HostTensor dxr = Full(xs[r].shape(), 0.0);
    ASSERT_THAT(RunKernel("batch_norm_grad_apply", sharded,
                          {xs[r], gamma, sums, gsums, dys[r]}, {dxr, dg_sum, db_sum}),
                IsOk());
    ExpectAllNear(dxr, Box(dx, {starts[r], 0, 0, 0}, dxr.shape()), 1e-12, "dx");
  }
  ExpectAllNear(dg_sum, dg, 1e-12, "dgamma");
  ExpectAllNear(db_sum, db, 1e-12, "dbeta");
  // A global count below the local batch is an error naming the attribute.
  HostTensor local(DType::kFloat64, {2, c});
  Attrs bad = attrs;
  bad.Set("global_count", int64_t{3});
  EXPECT_THAT(RunKernel("batch_norm_stats", bad, {xs[1]}, {local}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global_count")));
}

TEST(KernelGradTest, Softmax) {
  ExpectGradientsMatch({"softmax", {}, {Rand({3, 5}, 1, 2.0)}});
  ExpectGradientsMatch({"softmax", {{"causal", true}}, {Rand({2, 4, 4}, 2, 2.0)}});
  ExpectGradientsMatch({"softmax", {}, {Rand({2, 3, 4}, 3), Rand({1, 4}, 4)}});
  ExpectGradientsMatch({"softmax", {{"causal", true}, {"axis", int64_t{-1}}},
                        {Rand({2, 2, 3, 3}, 5), Rand({2, 1, 3, 1}, 6)}});
  ExpectGradientsMatch({"log_softmax", {}, {Rand({3, 6}, 7, 3.0)}});
}

TEST(KernelGradTest, Embedding) {
  ExpectGradientsMatch(
      {"embedding", {}, {Ints({2, 3}, {0, 4, 2, 4, 1, 0}), Rand({5, 3}, 1)}});
}

TEST(KernelGradTest, Layout) {
  ExpectGradientsMatch({"transpose", {{"perm", std::vector<int64_t>{0, 2, 3, 1}}},
                        {Rand({2, 3, 2, 4}, 1)}});
  ExpectGradientsMatch({"transpose", {{"perm", std::vector<int64_t>{1, 0}}},
                        {Rand({3, 4}, 2)}});
  ExpectGradientsMatch({"reshape", {{"shape", std::vector<int64_t>{4, -1}}},
                        {Rand({2, 3, 2}, 3)}});
  ExpectGradientsMatch({"flatten", {}, {Rand({2, 3, 2}, 4)}});
  ExpectGradientsMatch({"concat", {{"axis", int64_t{1}}},
                        {Rand({2, 1, 3}, 5), Rand({2, 3, 3}, 6), Rand({2, 2, 3}, 7)}});
  ExpectGradientsMatch({"split", {{"axis", int64_t{-1}},
                                  {"sizes", std::vector<int64_t>{1, 3, 2}}},
                        {Rand({2, 6}, 8)}});
  ExpectGradientsMatch({"slice", {{"axis", int64_t{1}}, {"start", int64_t{1}},
                                  {"end", int64_t{3}}},
                        {Rand({2, 4, 3}, 9)}});
  ExpectGradientsMatch({"expand", {{"shape", std::vector<int64_t>{2, 3, 4}}},
                        {Rand({3, 1}, 10)}});
}

TEST(KernelGradTest, SplitWithAbsentOutputGradient) {
  Attrs attrs = {{"axis", int64_t{0}}, {"sizes", std::vector<int64_t>{1, 2}}};
  HostTensor x = Rand({3, 2}, 1);
  HostTensor y0(DType::kFloat64, {1, 2}), y1(DType::kFloat64, {2, 2});
  ASSERT_THAT(RunKernel("split", attrs, {x}, {y0, y1}), IsOk());
  HostTensor dy1 = Rand({2, 2}, 2), dx = Full({3, 2}, kPrefill);
  // y0 and dy0 absent: the size of part 0 comes from the attribute.
  ASSERT_THAT(RunKernel("split_grad", attrs, {x, kAbsent, y1, kAbsent, dy1}, {dx}),
              IsOk());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(dx.as<double>()[i], kPrefill);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(dx.as<double>()[2 + i], kPrefill + dy1.as<double>()[i]);
  }
}

TEST(KernelGradTest, Reductions) {
  for (const char* op : {"sum", "mean"}) {
    ExpectGradientsMatch({op, {}, {Rand({2, 3, 4}, 1)}});
    ExpectGradientsMatch({op, {{"axes", std::vector<int64_t>{0, 2}}}, {Rand({2, 3, 4}, 2)}});
    ExpectGradientsMatch({op, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}},
                          {Rand({2, 3, 4}, 3)}});
  }
}

TEST(KernelGradTest, Losses) {
  HostTensor targets = Ints({4}, {2, 0, 4, 1});
  ExpectGradientsMatch({"nll_loss", {}, {Rand({4, 5}, 1), targets}});
  ExpectGradientsMatch({"cross_entropy", {}, {Rand({4, 5}, 2, 3.0), targets}});
  ExpectGradientsMatch({"cross_entropy", {{"global_rows", int64_t{10}}},
                        {Rand({4, 5}, 3), targets}});
}

// Vocabulary-parallel cross-entropy: shards' log-sum-exps gathered, each
// shard's partial loss and its classes' gradient, against the whole row.
TEST(KernelTest, CrossEntropyShardedByClassMatchesTheWholeRows) {
  const int64_t rows = 4, vocab = 11;
  const std::vector<int64_t> bounds = {0, 4, 7, 11};  // three ranks
  const int64_t ranks = 3;
  HostTensor x = Rand({rows, vocab}, 21, 4.0);
  HostTensor targets = Ints({rows}, {2, 10, 4, 7});
  const Attrs whole_attrs = {{"global_rows", int64_t{6}}};
  HostTensor loss(DType::kFloat64, {});
  ASSERT_THAT(RunKernel("cross_entropy", whole_attrs, {x, targets}, {loss}), IsOk());
  HostTensor dy = Vals({}, {1.7});
  HostTensor dx = Full({rows, vocab}, kPrefill);
  ASSERT_THAT(RunKernel("cross_entropy_grad", whole_attrs,
                      {x, targets, loss, dy}, {dx, kAbsent}), IsOk());
  std::vector<HostTensor> shard, lse;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t c = bounds[r + 1] - bounds[r];
    HostTensor xs(DType::kFloat64, {rows, c});
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        xs.as<double>()[i * c + j] = x.as<double>()[i * vocab + bounds[r] + j];
      }
    }
    HostTensor l(DType::kFloat64, {rows});
    ASSERT_THAT(RunKernel("cross_entropy_lse",
                        {{"vocab_offset", bounds[r]}, {"vocab_size", vocab}},
                        {xs}, {l}), IsOk());
    shard.push_back(std::move(xs));
    lse.push_back(std::move(l));
  }
  HostTensor gathered(DType::kFloat64, {ranks * rows});
  for (int64_t r = 0; r < ranks; ++r) {
    std::copy(lse[r].as<double>(), lse[r].as<double>() + rows,
              gathered.as<double>() + r * rows);
  }
  double total = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    const Attrs a = {{"vocab_offset", bounds[r]}, {"vocab_size", vocab},
                     {"rank", r}, {"ranks", ranks}, {"global_rows", int64_t{6}}};
    HostTensor part(DType::kFloat64, {});
    ASSERT_THAT(RunKernel("cross_entropy_sharded", a, {shard[r], targets, gathered},
                        {part}), IsOk());
    total += part.as<double>()[0];
    const int64_t c = bounds[r + 1] - bounds[r];
    HostTensor dxs = Full({rows, c}, kPrefill);
    ASSERT_THAT(RunKernel("cross_entropy_sharded_grad", a,
                        {shard[r], targets, gathered, dy}, {dxs}), IsOk());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        EXPECT_NEAR(dxs.as<double>()[i * c + j],
                    dx.as<double>()[i * vocab + bounds[r] + j], 1e-12)
            << "rank " << r << " row " << i << " class " << bounds[r] + j;
      }
    }
  }
  EXPECT_NEAR(total, loss.as<double>()[0], 1e-12);

  // Bad input is named.
  HostTensor part(DType::kFloat64, {});
  EXPECT_THAT(RunKernel("cross_entropy_sharded",
                        {{"vocab_offset", int64_t{0}}, {"vocab_size", vocab},
                         {"rank", int64_t{3}}, {"ranks", ranks}},
                        {shard[0], targets, gathered}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside a world of 'ranks' 3")));
  EXPECT_THAT(RunKernel("cross_entropy_sharded",
                        {{"vocab_offset", int64_t{0}}, {"vocab_size", int64_t{9}},
                         {"rank", int64_t{0}}, {"ranks", ranks}},
                        {shard[0], targets, gathered}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("target 10 at row 1 is outside [0, 9)")));
  EXPECT_THAT(RunKernel("cross_entropy_sharded",
                        {{"vocab_offset", int64_t{0}}, {"vocab_size", vocab},
                         {"rank", int64_t{0}}, {"ranks", int64_t{1} << 62}},
                        {shard[0], targets, gathered}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'ranks'")));
  // A rank without classes contributes nothing: -inf.
  HostTensor none(DType::kFloat64, {rows, 0}), empty_lse(DType::kFloat64, {rows});
  ASSERT_THAT(RunKernel("cross_entropy_lse",
                        {{"vocab_offset", vocab}, {"vocab_size", vocab}}, {none},
                        {empty_lse}),
              IsOk());
  EXPECT_EQ(empty_lse.as<double>()[0], -std::numeric_limits<double>::infinity());
  EXPECT_THAT(RunKernel("cross_entropy_lse",
                        {{"vocab_offset", int64_t{9}}, {"vocab_size", vocab}},
                        {shard[0]}, {lse[0]}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("do not fit the vocabulary")));
}

// A class whose logit is -inf (masked out) leaves the shard's log-sum-exp
// that of the others, in float as in double.
TEST(KernelTest, CrossEntropyLseSkipsAMinusInfinityLogit) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::kFloat64, DType::kFloat32}) {
    HostTensor x(dt, {1, 3}), lse(dt, {1});
    const double v[] = {-inf, 1.0, 2.0};
    for (int j = 0; j < 3; ++j) {
      if (dt == DType::kFloat64) {
        x.as<double>()[j] = v[j];
      } else {
        x.as<float>()[j] = static_cast<float>(v[j]);
      }
    }
    ASSERT_THAT(RunKernel("cross_entropy_lse",
                          {{"vocab_offset", int64_t{0}}, {"vocab_size", int64_t{3}}},
                          {x}, {lse}),
                IsOk());
    const double got = dt == DType::kFloat64 ? lse.as<double>()[0] : lse.as<float>()[0];
    EXPECT_NEAR(got, std::log(std::exp(1.0) + std::exp(2.0)), 1e-6);
  }
}

TEST(KernelGradTest, Convolution) {
  ExpectGradientsMatch({"conv2d",
                        {{"stride", std::vector<int64_t>{2}},
                         {"padding", std::vector<int64_t>{1, 1}}},
                        {Rand({2, 3, 5, 5}, 1), Rand({4, 3, 3, 3}, 2), Rand({4}, 3)}});
  ExpectGradientsMatch({"conv2d", {{"stride", std::vector<int64_t>{1, 2}}},
                        {Rand({1, 2, 4, 5}, 4), Rand({3, 2, 2, 3}, 5)}});
  // Grouped (2 groups of 2 input and 3 output channels) and depthwise
  // (channel multiplier 2), the direct loops.
  ExpectGradientsMatch({"conv2d",
                        {{"stride", std::vector<int64_t>{2, 1}},
                         {"padding", std::vector<int64_t>{1}},
                         {"groups", int64_t{2}}},
                        {Rand({2, 4, 5, 4}, 20), Rand({6, 2, 3, 2}, 21), Rand({6}, 22)}});
  ExpectGradientsMatch({"conv2d",
                        {{"padding", std::vector<int64_t>{1}}, {"groups", int64_t{3}}},
                        {Rand({2, 3, 4, 4}, 23), Rand({6, 1, 3, 3}, 24)}});
  // Dilated: im2col (stride and padding on both axes) and the grouped loops.
  ExpectGradientsMatch({"conv2d",
                        {{"stride", std::vector<int64_t>{2, 1}},
                         {"padding", std::vector<int64_t>{2, 1}},
                         {"dilation", std::vector<int64_t>{2, 3}}},
                        {Rand({2, 3, 7, 8}, 25), Rand({4, 3, 3, 2}, 26), Rand({4}, 27)}});
  ExpectGradientsMatch({"conv2d",
                        {{"padding", std::vector<int64_t>{3}},
                         {"dilation", std::vector<int64_t>{3, 2}},
                         {"groups", int64_t{2}}},
                        {Rand({2, 4, 6, 5}, 28), Rand({4, 2, 3, 3}, 29)}});
  {  // A dilated kernel wider than the padded image fails naming the dilation.
    HostTensor y(DType::kFloat64, {1, 2, 1, 1});
    EXPECT_THAT(RunKernel("conv2d", {{"dilation", std::vector<int64_t>{1, 4}}},
                          {Rand({1, 2, 5, 5}, 30), Rand({2, 2, 3, 3}, 31)}, {y}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("kernel 3x3 (dilation 1x4) is larger than the padded")));
  }
  ExpectGradientsMatch({"conv2d", {},  // 1x1: no im2col
                        {Rand({2, 3, 3, 2}, 6), Rand({2, 3, 1, 1}, 7), Rand({2}, 8)}});
  // conv3d: vol2col with stride, padding and dilation on every axis; the
  // (2+1)-D factorisation's kernels; grouped (the direct loops); 1x1x1.
  ExpectGradientsMatch({"conv3d",
                        {{"stride", std::vector<int64_t>{2, 1, 2}},
                         {"padding", std::vector<int64_t>{1, 2, 1}},
                         {"dilation", std::vector<int64_t>{1, 2, 1}}},
                        {Rand({2, 2, 5, 6, 5}, 40), Rand({3, 2, 3, 3, 2}, 41), Rand({3}, 42)}});
  ExpectGradientsMatch({"conv3d",
                        {{"padding", std::vector<int64_t>{0, 1, 1}}},
                        {Rand({1, 3, 3, 4, 4}, 43), Rand({2, 3, 1, 3, 3}, 44)}});
  ExpectGradientsMatch(
      {"conv3d",
       {{"stride", std::vector<int64_t>{2, 1, 1}}, {"padding", std::vector<int64_t>{1, 0, 0}}},
       {Rand({2, 2, 5, 3, 3}, 45), Rand({3, 2, 3, 1, 1}, 46), Rand({3}, 47)}});
  ExpectGradientsMatch({"conv3d",
                        {{"padding", std::vector<int64_t>{1}},
                         {"dilation", std::vector<int64_t>{2, 1, 1}},
                         {"groups", int64_t{2}}},
                        {Rand({2, 4, 5, 4, 3}, 48), Rand({4, 2, 3, 2, 2}, 49), Rand({4}, 50)}});
  ExpectGradientsMatch(
      {"conv3d", {}, {Rand({2, 3, 2, 3, 2}, 51), Rand({2, 3, 1, 1, 1}, 52), Rand({2}, 53)}});
  {  // An NCHW image or a 2-D kernel given to conv3d fails naming which.
    HostTensor y(DType::kFloat64, {1, 2, 3, 3});
    EXPECT_THAT(RunKernel("conv3d", {}, {Rand({1, 2, 5, 5}, 54), Rand({2, 2, 3, 3, 3}, 55)}, {y}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be NCDHW (rank 5)")));
    HostTensor y3(DType::kFloat64, {1, 2, 3, 3, 3});
    EXPECT_THAT(RunKernel("conv3d", {}, {Rand({1, 2, 5, 5, 5}, 56), Rand({2, 2, 3, 3}, 57)}, {y3}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("must have rank 5 ([out, in / groups, kt, kh, kw])")));
    EXPECT_THAT(RunKernel("conv3d", {{"stride", std::vector<int64_t>{1, 2}}},
                          {Rand({1, 2, 5, 5, 5}, 58), Rand({2, 2, 3, 3, 3}, 59)}, {y3}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("attribute 'stride' must be 1 or 3 integers >= 1")));
    EXPECT_THAT(RunKernel("conv3d", {{"dilation", std::vector<int64_t>{3, 1, 1}}},
                          {Rand({1, 2, 5, 5, 5}, 60), Rand({2, 2, 3, 3, 3}, 61)}, {y3}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("kernel 3x3x3 (dilation 3x1x1) is larger than the padded")));
  }
  ExpectGradientsMatch({"max_pool2d",
                        {{"kernel", std::vector<int64_t>{3}},
                         {"stride", std::vector<int64_t>{2}},
                         {"padding", std::vector<int64_t>{1}}},
                        {Rand({2, 2, 5, 5}, 9)}});
  // 3-D pools: s3d's and mvit's windows ((1, 3, 3) stride (1, 2, 2) padded,
  // 3x3x3 stride 1 padded, 2x2x2), ceil_mode, count_include_pad.
  ExpectGradientsMatch({"max_pool3d",
                        {{"kernel", std::vector<int64_t>{1, 3, 3}},
                         {"stride", std::vector<int64_t>{1, 2, 2}},
                         {"padding", std::vector<int64_t>{0, 1, 1}}},
                        {Rand({2, 2, 3, 5, 5}, 62)}});
  ExpectGradientsMatch({"max_pool3d",
                        {{"kernel", std::vector<int64_t>{3}},
                         {"stride", std::vector<int64_t>{2}},
                         {"padding", std::vector<int64_t>{1}},
                         {"ceil_mode", true}},
                        {Rand({1, 2, 4, 6, 5}, 63)}});
  ExpectGradientsMatch({"avg_pool3d",
                        {{"kernel", std::vector<int64_t>{3, 3, 2}},
                         {"stride", std::vector<int64_t>{1, 2, 2}},
                         {"padding", std::vector<int64_t>{1, 1, 0}},
                         {"count_include_pad", false}},
                        {Rand({2, 2, 4, 5, 6}, 64)}});
  ExpectGradientsMatch({"avg_pool3d",
                        {{"kernel", std::vector<int64_t>{2}}, {"ceil_mode", true}},
                        {Rand({1, 3, 5, 4, 3}, 65)}});
  {  // A 4-D input or a 2-element kernel given to a 3-D pool fails naming it.
    HostTensor y(DType::kFloat64, {1, 2, 2, 2});
    EXPECT_THAT(RunKernel("max_pool3d", {{"kernel", std::vector<int64_t>{2}}},
                          {Rand({1, 2, 4, 4}, 66)}, {y}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be NCDHW (rank 5)")));
    HostTensor y3(DType::kFloat64, {1, 2, 2, 2, 2});
    EXPECT_THAT(RunKernel("avg_pool3d", {{"kernel", std::vector<int64_t>{2, 2}}},
                          {Rand({1, 2, 4, 4, 4}, 67)}, {y3}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("attribute 'kernel' must be 1 or 3 integers >= 1")));
  }
  ExpectGradientsMatch({"max_pool2d", {{"kernel", std::vector<int64_t>{2, 2}}},
                        {Rand({1, 3, 4, 6}, 10)}});
  // ceil_mode: a last, partial window on each axis.
  ExpectGradientsMatch({"max_pool2d",
                        {{"kernel", std::vector<int64_t>{3}},
                         {"stride", std::vector<int64_t>{2}},
                         {"ceil_mode", true}},
                        {Rand({1, 2, 6, 8}, 13)}});
  for (bool include_pad : {true, false}) {
    ExpectGradientsMatch({"avg_pool2d",
                          {{"kernel", std::vector<int64_t>{3}},
                           {"stride", std::vector<int64_t>{2}},
                           {"padding", std::vector<int64_t>{1}},
                           {"count_include_pad", include_pad}},
                          {Rand({2, 2, 5, 6}, 14)}});
    ExpectGradientsMatch({"avg_pool2d",
                          {{"kernel", std::vector<int64_t>{3, 2}},
                           {"stride", std::vector<int64_t>{2}},
                           {"padding", std::vector<int64_t>{1, 0}},
                           {"ceil_mode", true},
                           {"count_include_pad", include_pad}},
                          {Rand({1, 2, 6, 7}, 15)}});
  }
  ExpectGradientsMatch({"adaptive_avg_pool2d",
                        {{"output_size", std::vector<int64_t>{3, 4}}},
                        {Rand({2, 2, 5, 7}, 11)}});
  ExpectGradientsMatch({"adaptive_avg_pool2d",
                        {{"output_size", std::vector<int64_t>{1}}},
                        {Rand({1, 2, 3, 3}, 12)}});
}

// --- every IR op has both kernels -------------------------------------------------

TEST(KernelTest, EveryOpHasForwardAndBackwardKernels) {
  for (const graph::OpDef* d : graph::OpRegistry::Global().All()) {
    EXPECT_TRUE(HasCpuKernel(d->type)) << d->type;
    EXPECT_TRUE(HasCpuKernel(d->type + "_grad")) << d->type;
  }
  for (const char* k : {"fill_zero", "copy", "accumulate", "sq_norm",
                        "sgd_update", "adam_update"}) {
    EXPECT_TRUE(HasCpuKernel(k)) << k;
  }
  // The kernels of ops run sharded (vocabulary-parallel cross-entropy).
  for (const char* k : {"cross_entropy_lse", "cross_entropy_sharded",
                        "cross_entropy_sharded_grad"}) {
    EXPECT_TRUE(HasCpuKernel(k)) << k;
  }
  // ... and batch-sharded batch_norm.
  for (const char* k : {"batch_norm_stats", "batch_norm_apply",
                        "batch_norm_grad_stats", "batch_norm_grad_apply"}) {
    EXPECT_TRUE(HasCpuKernel(k)) << k;
  }
  std::vector<std::string> names = CpuKernelNames();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(names.size(), 2 * graph::OpRegistry::Global().All().size() + 6 + 3 + 4);
  EXPECT_FALSE(HasCpuKernel("no_such_kernel"));
}

// --- float32 matches float64 --------------------------------------------------------

TEST(KernelTest, Float32MatchesFloat64) {
  struct F {
    std::string op;
    Attrs attrs;
    std::vector<HostTensor> in;
    Shape out;
  };
  std::vector<F> cases = {
      {"linear", {}, {Rand({5, 8}, 1), Rand({3, 8}, 2), Rand({3}, 3)}, {5, 3}},
      {"matmul", {}, {Rand({2, 4, 8}, 4), Rand({2, 8, 3}, 5)}, {2, 4, 3}},
      {"softmax", {{"causal", true}}, {Rand({2, 4, 4}, 6)}, {2, 4, 4}},
      {"layer_norm", {}, {Rand({3, 8}, 7), Rand({8}, 8), Rand({8}, 9)}, {3, 8}},
      {"conv2d", {{"padding", std::vector<int64_t>{1}}},
       {Rand({1, 2, 4, 4}, 10), Rand({3, 2, 3, 3}, 11)}, {1, 3, 4, 4}},
      {"gelu", {}, {Rand({10}, 12, 3.0)}, {10}},
      {"lstm", {}, {Rand({2, 6, 5}, 13), Rand({16, 5}, 14), Rand({16, 4}, 15), Rand({16}, 16)},
       {2, 6, 4}},
      {"gru", {}, {Rand({2, 6, 5}, 17), Rand({12, 5}, 18), Rand({12, 4}, 19), Rand({12}, 20)},
       {2, 6, 4}},
  };
  for (const F& c : cases) {
    HostTensor want(DType::kFloat64, c.out), got(DType::kFloat32, c.out);
    std::vector<HostTensor> in32;
    for (const HostTensor& t : c.in) in32.push_back(ToF32(t));
    ASSERT_THAT(RunKernel(c.op, c.attrs, Args(c.in), {want}), IsOk()) << c.op;
    ASSERT_THAT(RunKernel(c.op, c.attrs, Args(in32), {got}), IsOk()) << c.op;
    ExpectAllNear(got, want, 1e-5, c.op);
  }
}

// Products over an input dimension of 0 (k == 0 in the GEMM, which BLAS
// refuses for its leading dimension of 0): linear gives the bias or zeros
// whatever the output held, and an LSTM over 0 input features equals one over
// an all-zero input feature.
TEST(KernelTest, ProductsOverZeroInputsAreTheBiasAlone) {
  const HostTensor b = Rand({4}, 3);
  HostTensor bias_rows(DType::kFloat64, {3, 4});
  for (int64_t i = 0; i < 12; ++i) bias_rows.as<double>()[i] = b.as<double>()[i % 4];
  const HostTensor w_hh = Rand({8, 2}, 5), b_ih = Rand({8}, 6);
  // The reference: float64, one input feature of 0.
  HostTensor lstm_want(DType::kFloat64, {2, 3, 2});
  ASSERT_THAT(
      RunKernel("lstm", {}, {Full({2, 3, 1}, 0.0), Rand({8, 1}, 12), w_hh, b_ih}, {lstm_want}),
      IsOk());
  for (DType t : {DType::kFloat64, DType::kFloat32}) {
    auto as = [&](const HostTensor& h) { return t == DType::kFloat32 ? ToF32(h) : h; };
    const double tol = t == DType::kFloat32 ? 1e-6 : 0.0;
    HostTensor x = as(Rand({3, 0}, 1)), w = as(Rand({4, 0}, 2));
    HostTensor y = Full({3, 4}, 7.0, t);  // whatever the output held
    ASSERT_THAT(RunKernel("linear", {}, {x, w}, {y}), IsOk());
    ExpectAllNear(y, Full({3, 4}, 0.0), tol, "linear without bias");
    ASSERT_THAT(RunKernel("linear", {}, {x, w, as(b)}, {y}), IsOk());
    ExpectAllNear(y, bias_rows, tol, "linear with bias");
    HostTensor lstm_y = Full({2, 3, 2}, 7.0, t);
    ASSERT_THAT(
        RunKernel("lstm", {}, {as(Rand({2, 3, 0}, 10)), as(Rand({8, 0}, 11)), as(w_hh), as(b_ih)},
                  {lstm_y}),
        IsOk());
    ExpectAllNear(lstm_y, lstm_want, t == DType::kFloat32 ? 1e-5 : 0.0, "lstm");
  }
}

// Rows of no elements (a last dimension of 0) are nothing to do, never a
// division by their length.
TEST(KernelTest, RowsOfNoElementsAreNothingToDo) {
  for (DType t : {DType::kFloat64, DType::kFloat32}) {
    const HostTensor x = Full({3, 0}, 0.0, t), none = Full({0}, 0.0, t);
    HostTensor y = Full({3, 0}, 0.0, t), dx = Full({3, 0}, 0.0, t);
    HostTensor dgamma = Full({0}, 0.0, t), dbeta = Full({0}, 0.0, t);
    EXPECT_THAT(RunKernel("softmax", {}, {x}, {y}), IsOk());
    EXPECT_THAT(RunKernel("softmax_grad", {}, {x, kAbsent, y, x}, {dx, kAbsent}), IsOk());
    EXPECT_THAT(RunKernel("log_softmax", {}, {x}, {y}), IsOk());
    EXPECT_THAT(RunKernel("log_softmax_grad", {}, {x, y, x}, {dx}), IsOk());
    EXPECT_THAT(RunKernel("layer_norm", {}, {x, none, none}, {y}), IsOk());
    EXPECT_THAT(RunKernel("layer_norm_grad", {}, {x, none, none, y, x}, {dx, dgamma, dbeta}),
                IsOk());
  }
}

// The float softmax rows are vectorized (kernels_simd.h): rows whose length
// is not a multiple of the vector width, exp's whole range (-100 underflows,
// -inf mask entries) and the LM's 18,328-column rows, forward and backward,
// against the float64 kernels. Tolerances: softmax 1e-5 relative (FastExp's
// few ulp, x - max rounded to float, float sums within blocks of 256; exp
// below -87.3 flushes to 0), log_softmax 1e-6 relative and 1e-5 absolute
// (the log-sum-exp rounded to float); gradients 1e-5 relative and 1e-6
// absolute (from y rounded to float).
TEST(KernelTest, Float32SoftmaxRowsMatchFloat64) {
  for (int64_t cols : {1, 7, 8, 9, 33, 257, 1000, 18328}) {
    HostTensor x = Rand({3, cols}, 100 + cols, 20.0);
    for (int64_t j = 2; j < 3 * cols; j += 7) x.as<double>()[j] = -100.0;
    HostTensor dy = Rand({3, cols}, 200 + cols);
    for (const char* op : {"softmax", "log_softmax"}) {
      const std::string what = absl::StrCat(op, " cols ", cols);
      HostTensor y64(DType::kFloat64, x.shape()),
          y32(DType::kFloat32, x.shape());
      ASSERT_THAT(RunKernel(op, {}, {x}, {y64}), IsOk()) << what;
      ASSERT_THAT(RunKernel(op, {}, {ToF32(x)}, {y32}), IsOk()) << what;
      const bool log = std::string(op) == "log_softmax";
      ExpectRelativelyNear(y32, y64, log ? 1e-6 : 1e-5, log ? 1e-5 : 1e-37,
                           what);
      // The backward from the float64 y, so both see the same y; dx
      // accumulates onto kPrefill.
      HostTensor dx64 = Full(x.shape(), kPrefill);
      HostTensor dx32 = Full(x.shape(), kPrefill, DType::kFloat32);
      const std::string grad = absl::StrCat(op, "_grad");
      ASSERT_THAT(RunKernel(grad, {}, {x, y64, dy}, {dx64}), IsOk()) << what;
      ASSERT_THAT(
          RunKernel(grad, {}, {ToF32(x), ToF32(y64), ToF32(dy)}, {dx32}),
          IsOk())
          << what;
      ExpectRelativelyNear(dx32, dx64, 1e-5, 1e-6, what + " grad");
    }
  }
}

TEST(KernelTest, Float32MaskedCausalSoftmaxMatchesFloat64) {
  // Causal rows keep 1..9 columns of 9 (every tail length); the additive
  // mask has -inf entries (never a whole kept row).
  for (int64_t n : {9, 33}) {
    HostTensor x = Rand({2, n, n}, 300 + n, 10.0);
    HostTensor mask = Rand({n, n}, 400 + n, 2.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; j += 3) {
        mask.as<double>()[i * n + j] = -INFINITY;
      }
    }
    HostTensor dy = Rand({2, n, n}, 500 + n);
    const std::string what = absl::StrCat("causal masked softmax n ", n);
    const Attrs causal = {{"causal", true}};
    HostTensor y64(DType::kFloat64, x.shape()), y32(DType::kFloat32, x.shape());
    ASSERT_THAT(RunKernel("softmax", causal, {x, mask}, {y64}), IsOk());
    ASSERT_THAT(RunKernel("softmax", causal, {ToF32(x), ToF32(mask)}, {y32}),
                IsOk());
    ExpectRelativelyNear(y32, y64, 1e-5, 1e-37, what);
    for (int64_t i = 0; i < y32.num_elements(); ++i) {
      const int64_t row = (i / n) % n, col = i % n;
      if (col > row || std::isinf(mask.as<double>()[row * n + col])) {
        ASSERT_EQ(y32.as<float>()[i], 0.0f) << what << " element " << i;
      }
    }
    HostTensor dx64 = Full(x.shape(), kPrefill);
    HostTensor dx32 = Full(x.shape(), kPrefill, DType::kFloat32);
    ASSERT_THAT(
        RunKernel("softmax_grad", causal, {x, mask, y64, dy}, {dx64, kAbsent}),
        IsOk());
    ASSERT_THAT(RunKernel("softmax_grad", causal,
                          {ToF32(x), ToF32(mask), ToF32(y64), ToF32(dy)},
                          {dx32, kAbsent}),
                IsOk());
    ExpectRelativelyNear(dx32, dx64, 1e-5, 1e-6, what + " grad");
  }
}

// The float gelu runs vectorized loops (kernels_simd.h), the scalar float
// expressions bit for bit: lengths with tails, two threads, against the
// float64 kernels (FastErf's 1.5e-7 absolute error and float rounding).
TEST(KernelTest, Float32GeluMatchesFloat64) {
  for (int64_t n : {1, 7, 8, 9, 33, 257, 1000, 100003}) {
    const std::string what = absl::StrCat("n ", n);
    const HostTensor x = Rand({n}, 500 + n, 6.0), dy = Rand({n}, 510 + n);
    HostTensor y64(DType::kFloat64, {n}), y32(DType::kFloat32, {n});
    ASSERT_THAT(RunKernel("gelu", {}, {x}, {y64}, 0, 2), IsOk()) << what;
    ASSERT_THAT(RunKernel("gelu", {}, {ToF32(x)}, {y32}, 0, 2), IsOk()) << what;
    ExpectAllNear(y32, y64, 2e-6, "gelu " + what);
    HostTensor dx64 = Full({n}, kPrefill);
    HostTensor dx32 = Full({n}, kPrefill, DType::kFloat32);
    ASSERT_THAT(RunKernel("gelu_grad", {}, {x, y64, dy}, {dx64}, 0, 2), IsOk());
    ASSERT_THAT(RunKernel("gelu_grad", {}, {ToF32(x), y32, ToF32(dy)}, {dx32},
                          0, 2),
                IsOk());
    ExpectAllNear(dx32, dx64, 3e-6, "gelu_grad " + what);
  }
}

TEST(KernelTest, ThreadsGiveTheSameResults) {
  // Large enough for the parallel paths.
  HostTensor x = Rand({64, 1024}, 1), g = Rand({1024}, 2), b = Rand({1024}, 3);
  HostTensor dy = Rand({64, 1024}, 4);
  for (const char* op : {"layer_norm", "gelu", "softmax", "dropout"}) {
    std::vector<HostTensor> in = {x};
    if (std::string(op) == "layer_norm") in = {x, g, b};
    HostTensor y1(DType::kFloat64, x.shape()), y4(DType::kFloat64, x.shape());
    ASSERT_THAT(RunKernel(op, {}, Args(in), {y1}, 0, 1), IsOk());
    ASSERT_THAT(RunKernel(op, {}, Args(in), {y4}, 0, 4), IsOk());
    ExpectAllNear(y4, y1, 0, op);
    std::vector<HostTensor> dx1, dx4, gin = in;
    gin.push_back(y1);
    gin.push_back(dy);
    for (const HostTensor& t : in) {
      dx1.push_back(Full(t.shape(), 0.0));
      dx4.push_back(Full(t.shape(), 0.0));
    }
    ASSERT_THAT(RunKernel(std::string(op) + "_grad", {}, Args(gin), Args(dx1), 0, 1), IsOk());
    ASSERT_THAT(RunKernel(std::string(op) + "_grad", {}, Args(gin), Args(dx4), 0, 4), IsOk());
    for (size_t i = 0; i < dx1.size(); ++i) ExpectAllNear(dx4[i], dx1[i], 1e-12, op);
  }
}

// --- sharded-execution attributes ---------------------------------------------------

TEST(KernelShardTest, DropoutShardMaskIsTheSliceOfTheFullMask) {
  const Shape global = {4, 6};
  HostTensor x = Rand(global, 1);
  Attrs attrs = {{"p", 0.4}, {"rng_key", int64_t{123}}};
  HostTensor full(DType::kFloat64, global);
  ASSERT_THAT(RunKernel("dropout", attrs, {x}, {full}, 3), IsOk());
  for (auto [r0, c0, rows, cols] : std::vector<std::array<int64_t, 4>>{
           {2, 3, 2, 3}, {0, 0, 4, 2}, {1, 0, 1, 6}}) {
    Attrs sharded = attrs;
    sharded.Set("global_shape", std::vector<int64_t>(global));
    sharded.Set("offsets", std::vector<int64_t>{r0, c0});
    HostTensor part = Box(x, {r0, c0}, {rows, cols});
    HostTensor y(DType::kFloat64, {rows, cols});
    ASSERT_THAT(RunKernel("dropout", sharded, {part}, {y}, 3), IsOk());
    ExpectAllNear(y, Box(full, {r0, c0}, {rows, cols}), 0, "shard");
  }
  // A different step draws a different mask.
  HostTensor other(DType::kFloat64, global);
  ASSERT_THAT(RunKernel("dropout", attrs, {x}, {other}, 4), IsOk());
  int differ = 0;
  for (int i = 0; i < 24; ++i) differ += (full.as<double>()[i] == 0) != (other.as<double>()[i] == 0);
  EXPECT_GT(differ, 0);
}

TEST(KernelShardTest, DropoutKeepsAboutOneMinusPAndRescales) {
  HostTensor x = Full({100, 100}, 1.0), y(DType::kFloat64, {100, 100});
  ASSERT_THAT(RunKernel("dropout", {{"p", 0.25}}, {x}, {y}), IsOk());
  int kept = 0;
  for (int i = 0; i < 10000; ++i) {
    const double v = y.as<double>()[i];
    ASSERT_TRUE(v == 0 || std::abs(v - 1 / 0.75) < 1e-12) << v;
    kept += v != 0;
  }
  EXPECT_NEAR(kept / 10000.0, 0.75, 0.02);
}

// The float dropout runs vectorized loops (kernels_simd.h) that draw the
// mask in 64-bit lanes: the same mask as the float64 kernel (its scalar
// CounterUniform loop), whole or sharded, and the same float products bit
// for bit: y = x * float(1 / (1 - p)) where kept, 0 elsewhere; the gradient
// accumulates onto kPrefill.
TEST(KernelShardTest, Float32DropoutIsTheFloat64Mask) {
  const Attrs attrs = {{"p", 0.3}, {"rng_key", int64_t{99}}};
  const float scale = static_cast<float>(1.0 / 0.7);
  for (int64_t cols : {1, 7, 8, 9, 33, 257, 1000, 100003}) {
    const Shape global = {3, cols};
    const HostTensor x = Rand(global, 300 + cols);
    const HostTensor dy = Rand(global, 400 + cols);
    HostTensor mask(DType::kFloat64, global);
    ASSERT_THAT(RunKernel("dropout", attrs, {Full(global, 1.0)}, {mask}, 5, 2),
                IsOk());
    // The whole tensor, and a shard: rows [1, 3), columns from an odd offset.
    const int64_t c0 = cols > 2 ? (cols / 3) | 1 : 0;
    for (auto [r0, rows, c1, width] :
         std::vector<std::array<int64_t, 4>>{{0, 3, 0, cols},
                                             {1, 2, c0, cols - c0}}) {
      const std::string what = absl::StrCat("cols ", cols, " shard ", r0, ",",
                                            c1, " width ", width);
      Attrs a = attrs;
      if (r0 != 0 || c1 != 0) {
        a.Set("global_shape", std::vector<int64_t>(global));
        a.Set("offsets", std::vector<int64_t>{r0, c1});
      }
      const HostTensor xs = ToF32(Box(x, {r0, c1}, {rows, width}));
      const HostTensor dys = ToF32(Box(dy, {r0, c1}, {rows, width}));
      HostTensor y(DType::kFloat32, {rows, width});
      HostTensor dx = Full({rows, width}, kPrefill, DType::kFloat32);
      ASSERT_THAT(RunKernel("dropout", a, {xs}, {y}, 5, 2), IsOk()) << what;
      ASSERT_THAT(RunKernel("dropout_grad", a, {xs, y, dys}, {dx}, 5, 2),
                  IsOk())
          << what;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < width; ++c) {
          const int64_t i = r * width + c;
          const bool keep = mask.as<double>()[(r0 + r) * cols + c1 + c] != 0;
          const float want = keep ? xs.as<float>()[i] * scale : 0.0f;
          const float want_dx =
              static_cast<float>(kPrefill) +
              (keep ? dys.as<float>()[i] * scale : 0.0f);
          ASSERT_EQ(y.as<float>()[i], want) << what << " element " << i;
          ASSERT_EQ(dx.as<float>()[i], want_dx) << what << " grad " << i;
        }
      }
    }
  }
}

TEST(KernelShardTest, NllLossGlobalRows) {
  HostTensor logp = Rand({6, 4}, 1);
  HostTensor targets = Ints({6}, {0, 3, 1, 2, 2, 0});
  for (const char* op : {"nll_loss", "cross_entropy"}) {
    HostTensor full = Full({}, 0.0);
    ASSERT_THAT(RunKernel(op, {}, {logp, targets}, {full}), IsOk());
    HostTensor dfull = Full({6, 4}, 0.0);
    ASSERT_THAT(RunKernel(std::string(op) + "_grad", {}, {logp, targets, full, Full({}, 1.0)},
                    {dfull, kAbsent}),
                IsOk());
    double sum = 0;
    for (int64_t r0 : {0, 3}) {
      Attrs a = {{"global_rows", int64_t{6}}};
      HostTensor part = Box(logp, {r0, 0}, {3, 4});
      HostTensor t = Ints({3}, {targets.as<int64_t>()[r0], targets.as<int64_t>()[r0 + 1],
                                targets.as<int64_t>()[r0 + 2]});
      HostTensor loss = Full({}, 0.0), dpart = Full({3, 4}, 0.0);
      ASSERT_THAT(RunKernel(op, a, {part, t}, {loss}), IsOk());
      sum += loss.as<double>()[0];
      ASSERT_THAT(RunKernel(std::string(op) + "_grad", a, {part, t, loss, Full({}, 1.0)},
                      {dpart, kAbsent}),
                  IsOk());
      ExpectAllNear(dpart, Box(dfull, {r0, 0}, {3, 4}), 1e-12, op);
    }
    EXPECT_NEAR(sum, full.as<double>()[0], 1e-12) << op;
  }
}

TEST(KernelShardTest, MeanGlobalCount) {
  HostTensor x = Rand({4, 6}, 1);
  for (const std::vector<int64_t>& axes :
       {std::vector<int64_t>{1}, std::vector<int64_t>{}}) {
    Attrs a = {{"axes", axes}};
    Shape out = axes.empty() ? Shape{} : Shape{4};
    HostTensor full = Full(out, 0.0);
    ASSERT_THAT(RunKernel("mean", a, {x}, {full}), IsOk());
    a.Set("global_count", int64_t{axes.empty() ? 24 : 6});
    HostTensor sum = Full(out, 0.0);
    for (int64_t c0 : {0, 2}) {  // columns [0, 2) and [2, 6)
      HostTensor part = Box(x, {0, c0}, {4, c0 == 0 ? 2 : 4});
      HostTensor y = Full(out, 0.0);
      ASSERT_THAT(RunKernel("mean", a, {part}, {y}), IsOk());
      for (int64_t i = 0; i < y.num_elements(); ++i) sum.as<double>()[i] += y.as<double>()[i];
      HostTensor dx = Full(part.shape(), 0.0);
      ASSERT_THAT(RunKernel("mean_grad", a, {part, y, Full(out, 1.0)}, {dx}), IsOk());
      EXPECT_NEAR(dx.as<double>()[0], 1.0 / (axes.empty() ? 24 : 6), 1e-15);
    }
    ExpectAllNear(sum, full, 1e-12, "mean");
  }
}

TEST(KernelShardTest, EmbeddingVocabOffset) {
  HostTensor table = Rand({10, 3}, 1);
  HostTensor ids = Ints({2, 3}, {0, 9, 4, 5, 7, 4});
  HostTensor full(DType::kFloat64, {2, 3, 3});
  ASSERT_THAT(RunKernel("embedding", {}, {ids, table}, {full}), IsOk());
  HostTensor dy = Rand({2, 3, 3}, 2), dfull = Full({10, 3}, 0.0);
  ASSERT_THAT(RunKernel("embedding_grad", {}, {ids, table, full, dy}, {kAbsent, dfull}),
              IsOk());
  HostTensor sum = Full({2, 3, 3}, 0.0);
  for (int64_t off : {0, 5}) {
    Attrs a = {{"vocab_offset", off}, {"vocab_size", int64_t{10}}};
    HostTensor half = Box(table, {off, 0}, {5, 3});
    HostTensor y(DType::kFloat64, {2, 3, 3});
    ASSERT_THAT(RunKernel("embedding", a, {ids, half}, {y}), IsOk());
    for (int i = 0; i < 18; ++i) sum.as<double>()[i] += y.as<double>()[i];
    HostTensor dhalf = Full({5, 3}, 0.0);
    ASSERT_THAT(RunKernel("embedding_grad", a, {ids, half, y, dy}, {kAbsent, dhalf}), IsOk());
    ExpectAllNear(dhalf, Box(dfull, {off, 0}, {5, 3}), 1e-12, "dtable");
  }
  ExpectAllNear(sum, full, 0, "embedding");
  // Ids outside the vocabulary are errors, even those no shard holds.
  HostTensor bad = Ints({1}, {10});
  HostTensor y(DType::kFloat64, {1, 3});
  EXPECT_THAT(RunKernel("embedding", {{"vocab_offset", int64_t{5}}, {"vocab_size", int64_t{10}}},
                  {bad, Box(table, {5, 0}, {5, 3})}, {y}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("kernel 'embedding'"), HasSubstr("id 10"))));
}

// --- errors -----------------------------------------------------------------------------

TEST(KernelErrorTest, UnknownKernelIsNotFound) {
  EXPECT_THAT(RunKernel("frobnicate", {}, {}, {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("frobnicate")));
}

TEST(KernelErrorTest, BadArgumentsNameTheKernel) {
  auto invalid = [](const std::string& kernel, const std::string& detail) {
    return StatusIs(absl::StatusCode::kInvalidArgument,
                    AllOf(HasSubstr("kernel '" + kernel + "'"), HasSubstr(detail)));
  };
  HostTensor x = Rand({2, 3}, 1), y(DType::kFloat64, {2, 4});
  EXPECT_THAT(RunKernel("linear", {}, {x}, {y}), invalid("linear", "inputs"));
  EXPECT_THAT(RunKernel("linear", {}, {x, Rand({4, 2}, 2)}, {y}), invalid("linear", "input 0"));
  EXPECT_THAT(RunKernel("linear", {}, {x, Rand({4, 3}, 2)}, {HostTensor(DType::kFloat64, {2, 5})}),
              invalid("linear", "output 0"));
  EXPECT_THAT(RunKernel("linear", {}, {x, ToF32(Rand({4, 3}, 2))}, {y}),
              invalid("linear", "input 1"));
  EXPECT_THAT(RunKernel("relu", {}, {Ints({2}, {1, 2})}, {Ints({2}, {0, 0})}),
              invalid("relu", "no floating-point tensor"));
  EXPECT_THAT(RunKernel("matmul", {}, {x, Rand({2, 3}, 3)}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("matmul", "input 0"));
  EXPECT_THAT(RunKernel("add", {}, {x, Rand({4}, 3)}, {y}), invalid("add", "broadcast"));
  EXPECT_THAT(RunKernel("linear_grad", {}, {x, Rand({4, 3}, 2), y}, {kAbsent, kAbsent}),
              invalid("linear_grad", "inputs"));
  EXPECT_THAT(RunKernel("nll_loss", {}, {x, Ints({2}, {0, 3})}, {Full({}, 0.0)}),
              invalid("nll_loss", "target 3"));
  EXPECT_THAT(RunKernel("embedding", {}, {Ints({1}, {-1}), x}, {HostTensor(DType::kFloat64, {1, 3})}),
              invalid("embedding", "id -1"));
  EXPECT_THAT(RunKernel("scale", {}, {x}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("scale", "factor"));
  EXPECT_THAT(RunKernel("softmax", {{"axis", int64_t{0}}}, {x}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("softmax", "last axis"));
  EXPECT_THAT(RunKernel("dropout", {{"p", 0.5}, {"global_shape", std::vector<int64_t>{2, 2}}},
                  {x}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("dropout", "global shape"));
  EXPECT_THAT(RunKernel("softmax_grad", {}, {x, x, y, x}, {Full({2, 3}, 0.0), Full({2, 3}, 0.0)}),
              invalid("softmax_grad", "input 1 is not differentiable"));
  EXPECT_THAT(RunKernel("adam_update", {{"learning_rate", 0.1}}, {x, x, kAbsent}, {x}),
              invalid("adam_update", "outputs"));
  HostTensor seq = Rand({2, 3, 4}, 5), lstm_y(DType::kFloat64, {2, 3, 2});
  EXPECT_THAT(RunKernel("lstm", {}, {seq, Rand({8, 4}, 6), Rand({8, 3}, 7)}, {lstm_y}),
              invalid("lstm", "input 2 (f64[8,3]) must be [4 * hidden, hidden]"));
  EXPECT_THAT(RunKernel("lstm", {}, {seq, Rand({8, 3}, 6), Rand({8, 2}, 7)}, {lstm_y}),
              invalid("lstm", "input 1"));
  EXPECT_THAT(RunKernel("lstm", {}, {seq, Rand({8, 4}, 6), Rand({8, 2}, 7), Rand({4}, 8)}, {lstm_y}),
              invalid("lstm", "input 3"));
  EXPECT_THAT(RunKernel("lstm", {}, {x, Rand({8, 3}, 6), Rand({8, 2}, 7)}, {lstm_y}),
              invalid("lstm", "[batch, seq, input]"));
}

}  // namespace
}  // namespace hap::executor::kernel_test
