// Tests of bf16 mixed precision in the CPU kernels (kernels.h attribute
// "bf16"): the rounding, and linear / matmul forward and backward against a
// float64 reference computed on bf16-rounded operands and rounded like
// PyTorch's bf16 autocast (the product rounded to bf16, then accumulated
// into float32 gradients).
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/status_matchers.h"
#include "executor/cpu/kernels.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/runtime/bf16.h"
#include "executor/runtime/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using cpu::RoundBf16;
using graph::Attrs;
using graph::DType;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

HostTensor Rand(Shape s, uint64_t seed, DType dt = DType::kFloat32) {
  HostTensor t(dt, std::move(s));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (dt == DType::kFloat32) {
      t.as<float>()[i] = static_cast<float>(u(gen));
    } else {
      t.as<double>()[i] = u(gen);
    }
  }
  return t;
}

HostTensor Copy(const HostTensor& x) {
  HostTensor t(x.dtype(), x.shape());
  std::memcpy(t.data(), x.data(), x.num_elements() * graph::DTypeBytes(x.dtype()));
  return t;
}

absl::Status RunK(const std::string& name, bool bf16, const std::vector<const HostTensor*>& in,
                 const std::vector<const HostTensor*>& out, int threads = 2,
                 Attrs attrs = {}) {
  KernelContext ctx;
  ctx.num_threads = threads;
  if (bf16) attrs.Set("bf16", true);
  std::vector<TensorView> iv, ov;
  for (const HostTensor* t : in) iv.push_back(t == nullptr ? TensorView{} : t->view());
  for (const HostTensor* t : out) ov.push_back(t == nullptr ? TensorView{} : t->view());
  return RunCpuKernel(name, ctx, attrs, iv, ov);
}

bool IsBf16(float x) { return RoundBf16(x) == x || std::isnan(x); }

// got equals want (a double reference on rounded operands, then rounded to
// bf16) exactly or, where float32 and float64 sums fall on two sides of a
// rounding boundary, one bf16 step away.
void ExpectBf16Near(float got, double want_unrounded, const std::string& where) {
  const float want = RoundBf16(static_cast<float>(want_unrounded));
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want_unrounded), 1e-30)) - 7);
  EXPECT_TRUE(IsBf16(got)) << where << ": " << got << " is not a bf16 value";
  EXPECT_LE(std::fabs(got - want), ulp * 1.01) << where << ": got " << got << " want " << want;
}

// got = prefill + a bf16 product (added in float32), the product as above.
void ExpectAccumulated(float got, float prefill, double want_unrounded, const std::string& where) {
  const float want = prefill + RoundBf16(static_cast<float>(want_unrounded));
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want_unrounded), 1e-30)) - 7);
  EXPECT_LE(std::fabs(got - want), ulp * 1.01 + 1e-6 * std::fabs(want))
      << where << ": got " << got << " want " << want;
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(RoundBf16(1.0f), 1.0f);
  EXPECT_EQ(RoundBf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);  // tie: to even (1.0)
  EXPECT_EQ(RoundBf16(1.0f + 3 * std::ldexp(1.0f, -8)),    // tie: to even (1 + 2^-6)
            1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(RoundBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            1.0f + std::ldexp(1.0f, -7));  // above the tie: up
  EXPECT_EQ(RoundBf16(-2.5f), -2.5f);
  EXPECT_TRUE(std::isnan(RoundBf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(RoundBf16(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(RoundBf16(std::numeric_limits<float>::max()), std::numeric_limits<float>::infinity());
}

// Device::Convert on host memory (bf16 on the wire): float32 -> bf16 bits as
// RoundBf16 rounds, back exactly; other pairs and sizes are refused.
TEST(Bf16Test, HostConvertRoundsAndWidens) {
  std::vector<float> x = {1.0f,
                          1.0f + std::ldexp(1.0f, -8),
                          1.0f + 3 * std::ldexp(1.0f, -8),
                          -2.5f,
                          3.14159f,
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::max(),
                          -1e-30f};
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint16_t> bits(x.size());
  std::vector<float> back(x.size());
  ASSERT_THAT(HostConvert(TensorView{DType::kFloat32, {n}, x.data()},
                          TensorView{DType::kBFloat16, {n}, bits.data()}),
              ::hap::testing::IsOk());
  ASSERT_THAT(HostConvert(TensorView{DType::kBFloat16, {n}, bits.data()},
                          TensorView{DType::kFloat32, {n}, back.data()}),
              ::hap::testing::IsOk());
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(back[i]));
      continue;
    }
    EXPECT_EQ(back[i], RoundBf16(x[i])) << i;
    EXPECT_EQ(bits[i], Bf16Bits(x[i])) << i;
  }
  std::vector<double> d(x.size());
  EXPECT_THAT(HostConvert(TensorView{DType::kFloat32, {n}, x.data()},
                          TensorView{DType::kFloat64, {n}, d.data()}),
              ::hap::testing::StatusIs(absl::StatusCode::kUnimplemented,
                                       ::testing::HasSubstr("only float32 <-> bfloat16")));
  EXPECT_THAT(HostConvert(TensorView{DType::kFloat32, {n}, x.data()},
                          TensorView{DType::kBFloat16, {n - 1}, bits.data()}),
              ::hap::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                       ::testing::HasSubstr("elements into")));
}

// With an identity weight, y = bf16(x) exactly: the operand conversion (the
// AVX512-BF16 one where the CPU has it) rounds as RoundBf16, ties included.
TEST(Bf16Test, OperandConversionRoundsToNearestEven) {
  const int64_t rows = 5, in = 40;
  HostTensor x = Rand({rows, in}, 30), w(DType::kFloat32, {in, in});
  float* xs = x.as<float>();
  xs[0] = 1.0f + std::ldexp(1.0f, -8);      // tie: down to 1
  xs[1] = 1.0f + 3 * std::ldexp(1.0f, -8);  // tie: up to 1 + 2^-6
  xs[17] = -(1.0f + std::ldexp(1.0f, -8));
  xs[18] = 3.0e38f;  // near bf16's largest finite value
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t j = 0; j < in; ++j) w.as<float>()[i * in + j] = i == j ? 1.0f : 0.0f;
  }
  HostTensor y(DType::kFloat32, {rows, in});
  ASSERT_THAT(RunK("linear", true, {&x, &w}, {&y}), IsOk());
  for (int64_t i = 0; i < rows * in; ++i) {
    EXPECT_EQ(y.as<float>()[i], RoundBf16(xs[i])) << "element " << i << " of x " << xs[i];
  }
}

TEST(Bf16Test, LinearForwardRoundsOperandsAndResult) {
  const int64_t rows = 37, in = 70, out = 19;
  HostTensor x = Rand({rows, in}, 1), w = Rand({out, in}, 2), b = Rand({out}, 3);
  HostTensor y(DType::kFloat32, {rows, out}), y32(DType::kFloat32, {rows, out});
  ASSERT_THAT(RunK("linear", true, {&x, &w, &b}, {&y}), IsOk());
  ASSERT_THAT(RunK("linear", false, {&x, &w, &b}, {&y32}), IsOk());
  int differs = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = RoundBf16(b.as<float>()[o]);
      for (int64_t i = 0; i < in; ++i) {
        s += double(RoundBf16(x.as<float>()[r * in + i])) * RoundBf16(w.as<float>()[o * in + i]);
      }
      ExpectBf16Near(y.as<float>()[r * out + o], s, "y");
      differs += y.as<float>()[r * out + o] != y32.as<float>()[r * out + o];
    }
  }
  EXPECT_GT(differs, rows * out / 2) << "the bf16 result should not be the fp32 one";
}

TEST(Bf16Test, LinearBackwardAccumulatesRoundedProducts) {
  const int64_t rows = 23, in = 40, out = 17;
  HostTensor x = Rand({rows, in}, 4), w = Rand({out, in}, 5), b = Rand({out}, 6);
  HostTensor y(DType::kFloat32, {rows, out}), dy = Rand({rows, out}, 7);
  HostTensor dx = Rand({rows, in}, 8), dw = Rand({out, in}, 9), db = Rand({out}, 10);
  HostTensor dx0 = Copy(dx), dw0 = Copy(dw), db0 = Copy(db);
  ASSERT_THAT(RunK("linear_grad", true, {&x, &w, &b, &y, &dy}, {&dx, &dw, &db}), IsOk());
  auto rx = [&](int64_t r, int64_t i) { return double(RoundBf16(x.as<float>()[r * in + i])); };
  auto rw = [&](int64_t o, int64_t i) { return double(RoundBf16(w.as<float>()[o * in + i])); };
  auto rdy = [&](int64_t r, int64_t o) { return double(RoundBf16(dy.as<float>()[r * out + o])); };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < in; ++i) {
      double s = 0;
      for (int64_t o = 0; o < out; ++o) s += rdy(r, o) * rw(o, i);
      ExpectAccumulated(dx.as<float>()[r * in + i], dx0.as<float>()[r * in + i], s, "dx");
    }
  }
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double s = 0;
      for (int64_t r = 0; r < rows; ++r) s += rdy(r, o) * rx(r, i);
      ExpectAccumulated(dw.as<float>()[o * in + i], dw0.as<float>()[o * in + i], s, "dw");
    }
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) s += rdy(r, o);
    ExpectAccumulated(db.as<float>()[o], db0.as<float>()[o], s, "db");
  }
}

TEST(Bf16Test, BatchedMatmulForwardAndBackward) {
  const int64_t batch = 3, m = 9, k = 33, n = 14;
  HostTensor a = Rand({batch, m, k}, 11), b = Rand({batch, k, n}, 12);
  HostTensor y(DType::kFloat32, {batch, m, n}), dy = Rand({batch, m, n}, 13);
  HostTensor da(DType::kFloat32, {batch, m, k}), db(DType::kFloat32, {batch, k, n});
  std::memset(da.data(), 0, batch * m * k * 4);
  std::memset(db.data(), 0, batch * k * n * 4);
  ASSERT_THAT(RunK("matmul", true, {&a, &b}, {&y}), IsOk());
  ASSERT_THAT(RunK("matmul_grad", true, {&a, &b, &y, &dy}, {&da, &db}), IsOk());
  auto ra = [&](int64_t i, int64_t r, int64_t c) {
    return double(RoundBf16(a.as<float>()[(i * m + r) * k + c]));
  };
  auto rb = [&](int64_t i, int64_t r, int64_t c) {
    return double(RoundBf16(b.as<float>()[(i * k + r) * n + c]));
  };
  auto rdy = [&](int64_t i, int64_t r, int64_t c) {
    return double(RoundBf16(dy.as<float>()[(i * m + r) * n + c]));
  };
  for (int64_t i = 0; i < batch; ++i) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        double s = 0;
        for (int64_t j = 0; j < k; ++j) s += ra(i, r, j) * rb(i, j, c);
        ExpectBf16Near(y.as<float>()[(i * m + r) * n + c], s, "y");
      }
      for (int64_t c = 0; c < k; ++c) {
        double s = 0;
        for (int64_t j = 0; j < n; ++j) s += rdy(i, r, j) * rb(i, c, j);
        ExpectBf16Near(da.as<float>()[(i * m + r) * k + c], s, "da");
      }
    }
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        double s = 0;
        for (int64_t j = 0; j < m; ++j) s += ra(i, j, r) * rdy(i, j, c);
        ExpectBf16Near(db.as<float>()[(i * k + r) * n + c], s, "db");
      }
    }
  }
}

// x rounded to bf16, in float64.
HostTensor RoundedF64(const HostTensor& x) {
  HostTensor t(DType::kFloat64, x.shape());
  for (int64_t i = 0; i < x.num_elements(); ++i) t.as<double>()[i] = RoundBf16(x.as<float>()[i]);
  return t;
}

TEST(Bf16Test, Conv2dAgainstFloat64OnRoundedOperands) {
  // Padding 1, stride 2: im2col, several images grouped into one product.
  const Attrs attrs{{"padding", std::vector<int64_t>{1}}, {"stride", std::vector<int64_t>{2}}};
  HostTensor x = Rand({3, 4, 7, 7}, 18), w = Rand({5, 4, 3, 3}, 19), b = Rand({5}, 20);
  HostTensor y(DType::kFloat32, {3, 5, 4, 4}), dy = Rand({3, 5, 4, 4}, 21);
  HostTensor dx(DType::kFloat32, x.shape()), dw(DType::kFloat32, w.shape()),
      db(DType::kFloat32, {5});
  for (HostTensor* t : {&dx, &dw, &db}) std::memset(t->data(), 0, t->num_elements() * 4);
  ASSERT_THAT(RunK("conv2d", true, {&x, &w, &b}, {&y}, 2, attrs), IsOk());
  ASSERT_THAT(RunK("conv2d_grad", true, {&x, &w, &b, &y, &dy}, {&dx, &dw, &db}, 2, attrs),
              IsOk());
  HostTensor x64 = RoundedF64(x), w64 = RoundedF64(w), b64 = RoundedF64(b),
             dy64 = RoundedF64(dy);
  HostTensor y64(DType::kFloat64, y.shape()), dx64(DType::kFloat64, x.shape()),
      dw64(DType::kFloat64, w.shape()), db64(DType::kFloat64, {5});
  for (HostTensor* t : {&dx64, &dw64, &db64}) std::memset(t->data(), 0, t->num_elements() * 8);
  ASSERT_THAT(RunK("conv2d", false, {&x64, &w64, &b64}, {&y64}, 2, attrs), IsOk());
  ASSERT_THAT(RunK("conv2d_grad", false, {&x64, &w64, &b64, &y64, &dy64}, {&dx64, &dw64, &db64},
                   2, attrs),
              IsOk());
  for (int64_t i = 0; i < y.num_elements(); ++i) {
    ExpectBf16Near(y.as<float>()[i], y64.as<double>()[i], "y");
  }
  for (int64_t i = 0; i < dw.num_elements(); ++i) {
    ExpectBf16Near(dw.as<float>()[i], dw64.as<double>()[i], "dw");
  }
  for (int64_t i = 0; i < db.num_elements(); ++i) {
    ExpectBf16Near(db.as<float>()[i], db64.as<double>()[i], "db");
  }
  // dx: bf16 column products (each rounded, of magnitude up to ~1) summed
  // over overlapping windows in float32.
  for (int64_t i = 0; i < dx.num_elements(); ++i) {
    const double want = dx64.as<double>()[i];
    EXPECT_NEAR(dx.as<float>()[i], want, std::ldexp(std::fabs(want) + 0.5, -6)) << "dx " << i;
  }
}

// oneDNN's bf16 matmul and the OpenBLAS fallback on rounded operands give
// the same products up to one bf16 step (their sums run in other orders),
// for every transpose combination and with accumulation.
TEST(Bf16Test, OneDnnAndBlasFallbackAgree) {
  const int64_t m = 21, n = 34, k = 45;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (bool acc : {false, true}) {
        HostTensor a = Rand({ta ? k : m, ta ? m : k}, 40), b = Rand({tb ? n : k, tb ? k : n}, 41);
        HostTensor c1 = Rand({m, n}, 42), c2 = Copy(c1);
        cpu::RoundBf16InPlace(c1.as<float>(), m * n);  // a bf16 bias, as linear's
        cpu::RoundBf16InPlace(c2.as<float>(), m * n);
        ASSERT_THAT(cpu::GemmBf16(2, ta, tb, m, n, k, a.as<float>(), ta ? m : k, b.as<float>(),
                                  tb ? k : n, acc, c1.as<float>(), n),
                    IsOk());
        cpu::GemmBf16Blas(ta, tb, m, n, k, a.as<float>(), ta ? m : k, b.as<float>(), tb ? k : n,
                          acc, c2.as<float>(), n);
        for (int64_t i = 0; i < m * n; ++i) {
          const float x = c1.as<float>()[i], y = c2.as<float>()[i];
          EXPECT_TRUE(IsBf16(x) && IsBf16(y));
          EXPECT_LE(std::fabs(x - y), std::ldexp(std::fabs(y), -7) + 1e-6)
              << "ta " << ta << " tb " << tb << " acc " << acc << " element " << i;
        }
      }
    }
  }
}

TEST(Bf16Test, ThreadCountsGiveTheSameBits) {
  HostTensor x = Rand({64, 96}, 14), w = Rand({48, 96}, 15);
  HostTensor y1(DType::kFloat32, {64, 48}), y2(DType::kFloat32, {64, 48});
  ASSERT_THAT(RunK("linear", true, {&x, &w}, {&y1}, 1), IsOk());
  ASSERT_THAT(RunK("linear", true, {&x, &w}, {&y2}, 2), IsOk());
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), 64 * 48 * 4), 0);
}

TEST(Bf16Test, Float64CallsRejectTheAttribute) {
  HostTensor x = Rand({2, 3}, 16, DType::kFloat64), w = Rand({4, 3}, 17, DType::kFloat64);
  HostTensor y(DType::kFloat64, {2, 4});
  EXPECT_THAT(RunK("linear", true, {&x, &w}, {&y}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("kernel 'linear': attribute bf16 (mixed precision) needs "
                                 "float32 tensors, not f64")));
}

}  // namespace
}  // namespace hap::executor
