// Tests of the vectorized float loops (kernels_simd.h), for every Isa this
// CPU runs: against double-precision references, over lengths that exercise
// the vector bodies and the tails (not multiples of kLanes, a partial last
// block of kSumBlock), values across exp's range (-100 underflows to 0, -inf
// masks), nothing written past a row's end, and bit-identical results across
// Isas and against the scalar FastExp, the scalar optimizer arithmetic, the
// scalar dropout over CounterUniform and the scalar gelu expressions.
#include "executor/cpu/kernels_simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "executor/cpu/kernels_internal.h"
#include "executor/runtime/counter_random.h"
#include "gtest/gtest.h"

namespace hap::executor::cpu::simd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// Row lengths: shorter than a vector, one vector and around it, several
// blocks with a tail, the LM's vocabulary.
const int64_t kLengths[] = {1,  7,   8,   9,   15,   16,   17,
                            33, 255, 256, 257, 1000, 18328};
// Floats after a row that no function may touch.
constexpr int kGuard = 2 * kLanes;
constexpr float kSentinel = 12345.0f;

std::vector<float> Uniform(int64_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(gen);
  return v;
}

// A buffer of n floats set to `fill`, then kGuard sentinels.
std::vector<float> Guarded(int64_t n, float fill) {
  std::vector<float> v(n + kGuard, kSentinel);
  for (int64_t i = 0; i < n; ++i) v[i] = fill;
  return v;
}

void ExpectGuardIntact(const std::vector<float>& v, int64_t n,
                       const std::string& what) {
  for (int64_t i = n; i < n + kGuard; ++i) {
    ASSERT_EQ(v[i], kSentinel) << what << ": wrote past the end, index " << i;
  }
}

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

std::string Label(Isa isa, int64_t n) {
  return std::string(IsaName(isa)) + " n=" + std::to_string(n);
}

// |got - want| <= rel * |want| + abs, infinities equal.
void ExpectClose(double got, double want, double rel, double abs,
                 const std::string& what) {
  if (std::isinf(want)) {
    ASSERT_EQ(got, want) << what;
    return;
  }
  ASSERT_NEAR(got, want, rel * std::abs(want) + abs) << what;
}

// The double reference of softmax_row: the row's first `valid` values of
// x + mask (the float sum, as the kernel forms it), exp and sums in double.
std::vector<double> SoftmaxReference(const std::vector<float>& x,
                                     const float* mask, int64_t ms,
                                     int64_t valid, int64_t cols, bool log) {
  std::vector<double> z(valid), y(cols, 0.0);
  double mx = -kInf;
  for (int64_t j = 0; j < valid; ++j) {
    z[j] = mask ? static_cast<double>(x[j] + mask[j * ms]) : x[j];
    mx = std::max(mx, z[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < valid; ++j) sum += std::exp(z[j] - mx);
  for (int64_t j = 0; j < valid; ++j) {
    y[j] = log ? z[j] - mx - std::log(sum) : std::exp(z[j] - mx) / sum;
  }
  return y;
}

// Accuracy of the float rows. softmax: FastExp is within a few ulp, x - max
// rounds to float (below 4e-6 absolute where exp does not underflow, so
// relative in exp), sums are float within blocks of 256: relative 1e-5; the
// probabilities FastExp flushes to 0 (exp below -87.3) are below 1e-37.
// log_softmax: x - lse rounds to float (relative 1e-6 covers it), and lse's
// own error is absolute (1e-5).
constexpr double kSoftmaxRel = 1e-5, kSoftmaxAbs = 1e-37;
constexpr double kLogSoftmaxRel = 1e-6, kLogSoftmaxAbs = 1e-5;

TEST(SimdRowsTest, BaselineIsAlwaysAvailable) {
  const std::vector<Isa> isas = AvailableIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), Isa::kBaseline);
  EXPECT_EQ(Rows().isa, isas.back());
  for (Isa isa : isas) EXPECT_EQ(RowsFor(isa).isa, isa) << IsaName(isa);
}

TEST(SimdRowsTest, ExpMatchesScalarFastExpBitForBit) {
  // log_softmax_grad with dy = (1, 0, 0, ...) and dx = 0 gives
  // dx[j] = -exp(y[j]) exactly for j >= 1 (s = sum(dy) = 1), but +0 where
  // exp gives 0 (0 + (0 - 0) is +0).
  std::vector<float> y = {0.0f,   -kInf,  -1000.0f, -100.0f, -87.4f, -87.3f,
                          -87.2f, -50.0f, -1e-30f,  0.0f,    1e-30f, 0.5f,
                          1.0f,   10.0f,  88.2f,    88.3f,   88.4f,  1000.0f};
  for (float v = -90.0f; v < 90.0f; v += 0.01171875f) y.push_back(v);
  const std::vector<float> more = Uniform(10001, -88.0f, 88.0f, 1);
  y.insert(y.end(), more.begin(), more.end());
  const int64_t n = static_cast<int64_t>(y.size());
  std::vector<float> dy(n, 0.0f);
  dy[0] = 1.0f;
  for (Isa isa : AvailableIsas()) {
    std::vector<float> dx = Guarded(n, 0.0f);
    RowsFor(isa).softmax_grad_row(y.data(), dy.data(), n, true, dx.data());
    for (int64_t j = 1; j < n; ++j) {
      const float got = dx[j] == 0.0f ? 0.0f : -dx[j];
      ASSERT_EQ(Bits(got), Bits(FastExp(y[j])))
          << IsaName(isa) << " exp(" << y[j] << ") = " << got << ", FastExp "
          << FastExp(y[j]);
    }
    ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(dx, n, IsaName(isa)));
  }
}

TEST(SimdRowsTest, SoftmaxRowsMatchDoubleReference) {
  for (Isa isa : AvailableIsas()) {
    const FloatRows& rows = RowsFor(isa);
    for (int64_t n : kLengths) {
      // Around 0, and far below it (the row's max must be subtracted).
      for (float shift : {0.0f, -180.0f}) {
        std::vector<float> x =
            Uniform(n, -30.0f + shift, 30.0f + shift, 10 + n);
        // Some values far below the maximum: exp underflows to 0.
        for (int64_t j = 3; j < n; j += 11) x[j] = -100.0f + shift;
        for (bool log : {false, true}) {
          const std::string what = Label(isa, n) + (log ? " log" : "") +
                                   " shift " + std::to_string(shift);
          std::vector<float> y = Guarded(n, std::nanf(""));
          rows.softmax_row(x.data(), nullptr, 0, n, n, log, y.data());
          const std::vector<double> want =
              SoftmaxReference(x, nullptr, 0, n, n, log);
          double total = 0;
          for (int64_t j = 0; j < n; ++j) {
            ASSERT_NO_FATAL_FAILURE(
                ExpectClose(y[j], want[j], log ? kLogSoftmaxRel : kSoftmaxRel,
                            log ? kLogSoftmaxAbs : kSoftmaxAbs,
                            what + " column " + std::to_string(j)));
            total += log ? std::exp(static_cast<double>(y[j])) : y[j];
          }
          EXPECT_NEAR(total, 1.0, 1e-5) << what;
          ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(y, n, what));
        }
      }
    }
  }
}

// The row's log-sum-exp: the reference's within log_softmax's tolerance, the
// very lse log_softmax subtracts (y = x - lse in float, bit for bit), and the
// same bits on every Isa.
TEST(SimdRowsTest, LogSumExpRowIsTheLseOfLogSoftmax) {
  for (int64_t n : kLengths) {
    for (float shift : {0.0f, -180.0f}) {
      std::vector<float> x = Uniform(n, -30.0f + shift, 30.0f + shift, 40 + n);
      for (int64_t j = 3; j < n; j += 11) x[j] = -100.0f + shift;
      double mx = -kInf, sum = 0;
      for (float v : x) mx = std::max(mx, static_cast<double>(v));
      for (float v : x) sum += std::exp(v - mx);
      const double want = mx + std::log(sum);
      std::vector<float> bits;
      for (Isa isa : AvailableIsas()) {
        const FloatRows& rows = RowsFor(isa);
        const std::string what = Label(isa, n) + " shift " + std::to_string(shift);
        const float lse = rows.log_sum_exp_row(x.data(), n);
        ASSERT_NO_FATAL_FAILURE(ExpectClose(lse, want, 0, kLogSoftmaxAbs, what));
        std::vector<float> y(n);
        rows.softmax_row(x.data(), nullptr, 0, n, n, true, y.data());
        for (int64_t j = 0; j < n; ++j) {
          ASSERT_EQ(Bits(y[j]), Bits(x[j] - lse)) << what << " column " << j;
        }
        bits.push_back(lse);
      }
      for (float b : bits) EXPECT_EQ(Bits(b), Bits(bits[0])) << "n=" << n;
    }
  }
  EXPECT_EQ(Rows().log_sum_exp_row(nullptr, 0), -std::numeric_limits<float>::infinity());
}

TEST(SimdRowsTest, MaskedAndCausalRows) {
  for (Isa isa : AvailableIsas()) {
    const FloatRows& rows = RowsFor(isa);
    for (int64_t cols : kLengths) {
      const std::vector<float> x = Uniform(cols, -5.0f, 5.0f, 20 + cols);
      // A column mask with -inf entries (stride 1), the same mask read with
      // stride 2 (the gather path), and one value for the row (stride 0).
      std::vector<float> mask = Uniform(2 * cols, -3.0f, 3.0f, 30 + cols);
      for (int64_t j = 1; j < 2 * cols; j += 3) mask[j] = -kInf;
      const float scalar_mask[] = {-2.5f};
      struct Case {
        const float* mask;
        int64_t stride;
      };
      for (Case c :
           {Case{mask.data(), 1}, Case{mask.data(), 2}, Case{scalar_mask, 0}}) {
        // Causal rows keep a prefix; the rest must be written as 0.
        for (int64_t valid : {cols, (cols + 1) / 2, int64_t{1}}) {
          for (bool log : {false, true}) {
            const std::string what =
                Label(isa, cols) + " stride " + std::to_string(c.stride) +
                " valid " + std::to_string(valid) + (log ? " log" : "");
            std::vector<float> y = Guarded(cols, std::nanf(""));
            rows.softmax_row(x.data(), c.mask, c.stride, valid, cols, log,
                             y.data());
            const std::vector<double> want =
                SoftmaxReference(x, c.mask, c.stride, valid, cols, log);
            for (int64_t j = 0; j < cols; ++j) {
              ASSERT_NO_FATAL_FAILURE(
                  ExpectClose(y[j], want[j], log ? kLogSoftmaxRel : kSoftmaxRel,
                              log ? kLogSoftmaxAbs : kSoftmaxAbs,
                              what + " column " + std::to_string(j)));
            }
            ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(y, cols, what));
          }
        }
      }
    }
  }
}

TEST(SimdRowsTest, FullyMaskedRowIsNaN) {
  // As PyTorch: softmax over nothing but -inf is NaN.
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{40}}) {
      const std::vector<float> x(n, 0.0f), mask(n, -kInf);
      for (bool log : {false, true}) {
        std::vector<float> y = Guarded(n, 0.0f);
        RowsFor(isa).softmax_row(x.data(), mask.data(), 1, n, n, log, y.data());
        for (int64_t j = 0; j < n; ++j) {
          EXPECT_TRUE(std::isnan(y[j])) << Label(isa, n) << " column " << j;
        }
      }
    }
  }
}

TEST(SimdRowsTest, SoftmaxGradRowsMatchDoubleReference) {
  for (Isa isa : AvailableIsas()) {
    const FloatRows& rows = RowsFor(isa);
    for (int64_t n : kLengths) {
      const std::vector<float> x = Uniform(n, -8.0f, 8.0f, 40 + n);
      const std::vector<float> dy = Uniform(n, -1.0f, 1.0f, 50 + n);
      for (bool log : {false, true}) {
        const std::string what = Label(isa, n) + (log ? " log" : "");
        std::vector<float> y(n);
        rows.softmax_row(x.data(), nullptr, 0, n, n, log, y.data());
        std::vector<float> dx = Guarded(n, 0.25f);  // gradients accumulate
        rows.softmax_grad_row(y.data(), dy.data(), n, log, dx.data());
        double s = 0;
        for (int64_t j = 0; j < n; ++j) s += log ? dy[j] : double(dy[j]) * y[j];
        for (int64_t j = 0; j < n; ++j) {
          const double want = 0.25 + (log ? dy[j] - std::exp(double(y[j])) * s
                                          : y[j] * (dy[j] - s));
          // |s| grows like sqrt(n) (log): its float rounding scales exp(y).
          ASSERT_NO_FATAL_FAILURE(
              ExpectClose(dx[j], want, 1e-5, 1e-6 * (1 + std::abs(s)),
                          what + " column " + std::to_string(j)));
        }
        ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(dx, n, what));
      }
    }
  }
}

TEST(SimdRowsTest, EveryIsaGivesTheSameBits) {
  const std::vector<Isa> isas = AvailableIsas();
  if (isas.size() == 1) GTEST_SKIP() << "this CPU runs the baseline only";
  for (int64_t n : kLengths) {
    const std::vector<float> x = Uniform(n, -40.0f, 40.0f, 60 + n);
    const std::vector<float> dy = Uniform(n, -1.0f, 1.0f, 70 + n);
    std::vector<std::vector<float>> outs;
    for (Isa isa : isas) {
      const FloatRows& rows = RowsFor(isa);
      std::vector<float> out;
      for (bool log : {false, true}) {
        std::vector<float> y(n), dx(n, 0.5f);
        rows.softmax_row(x.data(), nullptr, 0, n, n, log, y.data());
        rows.softmax_grad_row(y.data(), dy.data(), n, log, dx.data());
        out.insert(out.end(), y.begin(), y.end());
        out.insert(out.end(), dx.begin(), dx.end());
      }
      std::vector<float> p = x, m = dy, v(n, 0.01f);
      rows.adam({0.7f, 0.999f, 0.9f, 0.99f, 1e-3f, 0.3f, 1e-8f}, p.data(),
                dy.data(), m.data(), v.data(), p.data(), n);
      rows.sgd({0.7f, 0.1f, 0.01f, 0.9f}, p.data(), dy.data(), m.data(),
               p.data(), n);
      out.insert(out.end(), p.begin(), p.end());
      out.insert(out.end(), m.begin(), m.end());
      out.insert(out.end(), v.begin(), v.end());
      out.push_back(static_cast<float>(rows.sum_squares(x.data(), n)));
      outs.push_back(out);
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      for (size_t k = 0; k < outs[0].size(); ++k) {
        ASSERT_EQ(Bits(outs[i][k]), Bits(outs[0][k]))
            << IsaName(isas[i]) << " vs baseline, n=" << n << " value " << k;
      }
    }
  }
}

// The optimizers' lengths: tails of every size, and a long run.
const int64_t kUpdateLengths[] = {1, 2, 7, 15, 16, 17, 31, 33, 100, 1000, 4099};

TEST(SimdRowsTest, AdamMatchesScalarReferences) {
  const AdamConstants c = {
      0.8f,          1.0f - 1e-3f * 0.1f,         0.9f, 0.999f,
      1e-3f / 0.19f, std::sqrt(1.0f - 0.998001f), 1e-8f};
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : kUpdateLengths) {
      const std::string what = Label(isa, n);
      const std::vector<float> param = Uniform(n, -1.0f, 1.0f, 80 + n);
      const std::vector<float> grad = Uniform(n, -2.0f, 2.0f, 90 + n);
      const std::vector<float> m0 = Uniform(n, -0.1f, 0.1f, 100 + n);
      const std::vector<float> v0 = Uniform(n, 0.0f, 0.01f, 110 + n);
      std::vector<float> out = Guarded(n, 0.0f), m = Guarded(n, 0.0f),
                         v = Guarded(n, 0.0f);
      std::copy(m0.begin(), m0.end(), m.begin());
      std::copy(v0.begin(), v0.end(), v.begin());
      RowsFor(isa).adam(c, param.data(), grad.data(), m.data(), v.data(),
                        out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        // The scalar float arithmetic of the f64 path, bit for bit.
        const float g = grad[i] * c.clip;
        const float mf = c.b1 * m0[i] + (1.0f - c.b1) * g;
        const float vf = c.b2 * v0[i] + (1.0f - c.b2) * g * g;
        const float of = param[i] * c.decay -
                         c.step * mf / (std::sqrt(vf) / c.sqrt_bc2 + c.eps);
        ASSERT_EQ(Bits(m[i]), Bits(mf)) << what << " m " << i;
        ASSERT_EQ(Bits(v[i]), Bits(vf)) << what << " v " << i;
        ASSERT_EQ(Bits(out[i]), Bits(of)) << what << " param " << i;
        // And double arithmetic, within float rounding.
        const double gd = double(grad[i]) * c.clip;
        const double md = double(c.b1) * m0[i] + (1.0 - c.b1) * gd;
        const double vd = double(c.b2) * v0[i] + (1.0 - c.b2) * gd * gd;
        const double od =
            double(param[i]) * c.decay -
            double(c.step) * md / (std::sqrt(vd) / c.sqrt_bc2 + c.eps);
        // Float rounding of terms near 0.1 and 1 (b1 m vs (1 - b1) g,
        // param vs the step) is absolute.
        ASSERT_NO_FATAL_FAILURE(
            ExpectClose(m[i], md, 1e-6, 3e-8, what + " m vs double"));
        ASSERT_NO_FATAL_FAILURE(
            ExpectClose(v[i], vd, 1e-6, 1e-12, what + " v vs double"));
        ASSERT_NO_FATAL_FAILURE(
            ExpectClose(out[i], od, 1e-6, 2e-7, what + " param vs double"));
      }
      ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(out, n, what + " param"));
      ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(m, n, what + " m"));
      ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(v, n, what + " v"));
    }
  }
}

TEST(SimdRowsTest, SgdMatchesScalarReferences) {
  const SgdConstants c = {0.5f, 0.1f, 0.01f, 0.9f};
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : kUpdateLengths) {
      for (bool momentum : {false, true}) {
        const std::string what = Label(isa, n) + (momentum ? " momentum" : "");
        const std::vector<float> param = Uniform(n, -1.0f, 1.0f, 120 + n);
        const std::vector<float> grad = Uniform(n, -2.0f, 2.0f, 130 + n);
        const std::vector<float> m0 = Uniform(n, -0.5f, 0.5f, 140 + n);
        std::vector<float> out = Guarded(n, 0.0f), m = Guarded(n, 0.0f);
        std::copy(m0.begin(), m0.end(), m.begin());
        RowsFor(isa).sgd(c, param.data(), grad.data(),
                         momentum ? m.data() : nullptr, out.data(), n);
        for (int64_t i = 0; i < n; ++i) {
          float g = grad[i] * c.clip + c.weight_decay * param[i];
          double gd =
              double(grad[i]) * c.clip + double(c.weight_decay) * param[i];
          if (momentum) {
            g = c.momentum * m0[i] + g;
            gd = double(c.momentum) * m0[i] + gd;
            ASSERT_EQ(Bits(m[i]), Bits(g)) << what << " m " << i;
          } else {
            ASSERT_EQ(m[i], m0[i]) << what << ": buffer untouched";
          }
          ASSERT_EQ(Bits(out[i]), Bits(param[i] - c.lr * g))
              << what << " param " << i;
          ASSERT_NO_FATAL_FAILURE(
              ExpectClose(out[i], double(param[i]) - double(c.lr) * gd, 1e-6,
                          2e-7, what + " param vs double"));
        }
        ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(out, n, what));
        ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(m, n, what + " m"));
      }
    }
  }
}

TEST(SimdRowsTest, SumSquaresMatchesDouble) {
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : kUpdateLengths) {
      const std::vector<float> p = Uniform(n, -3.0f, 3.0f, 150 + n);
      double want = 0;
      for (float x : p) want += double(x) * x;
      EXPECT_NEAR(RowsFor(isa).sum_squares(p.data(), n), want, 1e-13 * want)
          << Label(isa, n);
    }
    EXPECT_EQ(RowsFor(isa).sum_squares(nullptr, 0), 0.0);
  }
}

// --- dropout and gelu -------------------------------------------------------

// Element-wise lengths: below a vector, around 8 and 16, tails, a long run.
const int64_t kElementLengths[] = {1, 7, 8, 9, 33, 257, 1000, 100003};

// The scalar loop of kernels_elementwise.cc (DropoutMask::Row, MaskRow).
float DropoutReference(uint64_t key, double p, uint64_t counter, float x,
                       float y0, bool accumulate) {
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  const float v = CounterUniform(key, counter) >= p ? x * scale : 0.0f;
  return accumulate ? y0 + v : v;
}

TEST(SimdRowsTest, DropoutThresholdIsTheUniformsComparison) {
  // k * 2^-53 >= p iff k >= DropoutThreshold(p), at and around the
  // threshold, for p on and between the uniforms' grid.
  for (double p : {0.0, 0.1, 0.25, 0.5, 0.9, 1.0 - 0x1p-53, 0x1p-53, 3e-300,
                   0.3 + 0x1p-55}) {
    const uint64_t t = DropoutThreshold(p);
    for (uint64_t k : {t - 1, t, t + 1}) {
      if (k > t && t == 0) continue;
      if (k >= (uint64_t{1} << 53)) continue;
      const double u = static_cast<double>(k) * (1.0 / 9007199254740992.0);
      EXPECT_EQ(k >= t, u >= p) << "p " << p << " k " << k;
    }
  }
}

TEST(SimdRowsTest, DropoutMatchesScalarCounterUniformBitForBit) {
  const uint64_t key = CounterKey(7, 3);
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : kElementLengths) {
      const std::vector<float> x = Uniform(n, -4.0f, 4.0f, 200 + n);
      const std::vector<float> y0 = Uniform(n, -1.0f, 1.0f, 210 + n);
      // Counters near 0, past 2^32 (the high half of the 64-bit lanes) and
      // odd, as a shard's row starts are.
      for (uint64_t counter : {uint64_t{0}, (uint64_t{1} << 40) + 3}) {
        // p == 0 keeps everything; the last p is the uniform of element 5
        // (or 0), so that element lies exactly on the threshold (kept).
        for (double p : {0.0, 0.1, 0.5, 0.9,
                         CounterUniform(key, counter + (n > 5 ? 5 : 0))}) {
          const DropoutConstants c = {key, DropoutThreshold(p),
                                      static_cast<float>(1.0 / (1.0 - p))};
          for (bool accumulate : {false, true}) {
            const std::string what =
                Label(isa, n) + " counter " + std::to_string(counter) + " p " +
                std::to_string(p) + (accumulate ? " accumulate" : "");
            std::vector<float> y = Guarded(n, 0.0f);
            std::copy(y0.begin(), y0.end(), y.begin());
            RowsFor(isa).dropout(c, counter, x.data(), n, accumulate,
                                 y.data());
            int64_t kept = 0;
            for (int64_t j = 0; j < n; ++j) {
              const float want = DropoutReference(key, p, counter + j, x[j],
                                                  y0[j], accumulate);
              ASSERT_EQ(Bits(y[j]), Bits(want))
                  << what << " element " << j << ": " << y[j] << " vs " << want;
              kept += CounterUniform(key, counter + j) >= p;
            }
            if (n >= 1000) {  // and the mask keeps about 1 - p
              EXPECT_NEAR(kept / static_cast<double>(n), 1.0 - p, 0.05) << what;
            }
            ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(y, n, what));
          }
        }
      }
    }
  }
}

TEST(SimdRowsTest, DropoutZeroesNonFiniteDroppedValues) {
  // The scalar loop selects 0 for a dropped element, whatever its value.
  const uint64_t key = CounterKey(1, 2);
  const int64_t n = 64;
  std::vector<float> x(n, std::nanf(""));
  for (int64_t j = 0; j < n; j += 2) x[j] = kInf;
  for (Isa isa : AvailableIsas()) {
    std::vector<float> y(n, -0.0f);
    RowsFor(isa).dropout({key, DropoutThreshold(0.5), 2.0f}, 11, x.data(), n,
                         false, y.data());
    for (int64_t j = 0; j < n; ++j) {
      const float want = DropoutReference(key, 0.5, 11 + j, x[j], 0, false);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(y[j])) << Label(isa, n) << " element " << j;
      } else {
        EXPECT_EQ(Bits(y[j]), Bits(want)) << Label(isa, n) << " element " << j;
      }
    }
  }
}

// kernels_elementwise.cc Gelu::F and Gelu::D in float, as the scalar
// kernels computed them.
float GeluScalar(float x) {
  return 0.5f * x * (1.0f + FastErf(x * static_cast<float>(M_SQRT1_2)));
}
float GeluGradScalar(float x) {
  const float cdf = 0.5f * (1.0f + FastErf(x * static_cast<float>(M_SQRT1_2)));
  const float pdf =
      FastExp(-0.5f * x * x) * static_cast<float>(0.3989422804014327);
  return cdf + x * pdf;
}

// Inputs: uniform over [-10, 10] (both tails of erf), and special values
// at the front: signed zeros, tiny and huge values, infinities.
std::vector<float> GeluInputs(int64_t n, uint64_t seed) {
  std::vector<float> x = Uniform(n, -10.0f, 10.0f, seed);
  const float special[] = {0.0f,    -0.0f,  1e-30f, -1e-30f, 0.5f,
                           -0.5f,   3.0f,   -3.0f,  13.2f,   -13.2f,
                           14.0f,   -14.0f, 1e30f,  -1e30f,  kInf,
                           -kInf,   2.5e-3f, -6.0f, 6.0f,    1.0f};
  for (int64_t j = 0; j < n && j < 20; ++j) x[j] = special[j];
  return x;
}

// Accuracy against double arithmetic with std::erf: FastErf is within
// 1.5e-7 absolute (A&S 7.1.26) and float rounding adds a few ulp, so
// gelu(x) is within 2e-7 |x| + 1e-6 |gelu(x)|, and gelu'(x) within
// 3e-7 (1 + |x|) (the cdf's absolute error plus x phi(x)'s relative one).
double GeluDouble(double x) { return 0.5 * x * (1 + std::erf(x * M_SQRT1_2)); }
double GeluGradDouble(double x) {
  return 0.5 * (1 + std::erf(x * M_SQRT1_2)) +
         x * std::exp(-0.5 * x * x) * 0.3989422804014327;
}

TEST(SimdRowsTest, GeluMatchesScalarBitForBitAndDouble) {
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : kElementLengths) {
      const std::string what = Label(isa, n);
      const std::vector<float> x = GeluInputs(n, 220 + n);
      std::vector<float> y = Guarded(n, std::nanf(""));
      RowsFor(isa).gelu(x.data(), n, y.data());
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(Bits(y[j]), Bits(GeluScalar(x[j])))
            << what << " gelu(" << x[j] << ") = " << y[j] << ", scalar "
            << GeluScalar(x[j]);
        if (std::isinf(x[j])) continue;  // -inf * 0 is NaN in both
        const double want = GeluDouble(x[j]);
        ASSERT_NEAR(y[j], want, 2e-7 * std::abs(x[j]) + 1e-6 * std::abs(want))
            << what << " gelu(" << x[j] << ") vs double";
      }
      ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(y, n, what));
    }
  }
}

TEST(SimdRowsTest, GeluGradMatchesScalarBitForBitAndDouble) {
  for (Isa isa : AvailableIsas()) {
    for (int64_t n : kElementLengths) {
      const std::string what = Label(isa, n);
      const std::vector<float> x = GeluInputs(n, 230 + n);
      const std::vector<float> dy = Uniform(n, -1.0f, 1.0f, 240 + n);
      std::vector<float> dx = Guarded(n, 0.25f);  // gradients accumulate
      RowsFor(isa).gelu_grad(x.data(), dy.data(), n, dx.data());
      for (int64_t j = 0; j < n; ++j) {
        const float scalar = 0.25f + dy[j] * GeluGradScalar(x[j]);
        ASSERT_EQ(Bits(dx[j]), Bits(scalar))
            << what << " gelu'(" << x[j] << "): " << dx[j] << ", scalar "
            << scalar;
        if (std::isinf(x[j]) || std::abs(x[j]) > 1e20f) continue;
        const double want = 0.25 + dy[j] * GeluGradDouble(x[j]);
        ASSERT_NEAR(dx[j], want, 3e-7 * (1 + std::abs(x[j])) + 1e-7)
            << what << " gelu'(" << x[j] << ") vs double";
      }
      ASSERT_NO_FATAL_FAILURE(ExpectGuardIntact(dx, n, what));
    }
  }
}

TEST(SimdRowsTest, DropoutAndGeluGiveTheSameBitsOnEveryIsa) {
  const std::vector<Isa> isas = AvailableIsas();
  if (isas.size() == 1) GTEST_SKIP() << "this CPU runs the baseline only";
  const uint64_t key = CounterKey(5, 9);
  for (int64_t n : kElementLengths) {
    const std::vector<float> x = GeluInputs(n, 250 + n);
    const std::vector<float> dy = Uniform(n, -1.0f, 1.0f, 260 + n);
    std::vector<std::vector<float>> outs;
    for (Isa isa : isas) {
      const FloatRows& rows = RowsFor(isa);
      std::vector<float> y(n), dx(n, 0.5f), d(n), da(n, 0.125f);
      rows.gelu(x.data(), n, y.data());
      rows.gelu_grad(x.data(), dy.data(), n, dx.data());
      const DropoutConstants c = {key, DropoutThreshold(0.3),
                                  static_cast<float>(1.0 / 0.7)};
      rows.dropout(c, 12345, dy.data(), n, false, d.data());
      rows.dropout(c, 12345, dy.data(), n, true, da.data());
      std::vector<float> out = y;
      for (const std::vector<float>* v : {&dx, &d, &da}) {
        out.insert(out.end(), v->begin(), v->end());
      }
      outs.push_back(out);
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      for (size_t k = 0; k < outs[0].size(); ++k) {
        ASSERT_EQ(Bits(outs[i][k]), Bits(outs[0][k]))
            << IsaName(isas[i]) << " vs baseline, n=" << n << " value " << k;
      }
    }
  }
}

}  // namespace
}  // namespace hap::executor::cpu::simd
