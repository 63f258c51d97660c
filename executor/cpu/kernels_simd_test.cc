// Tests of the vectorized float loops (kernels_simd.h), for every Isa this
// CPU runs: against double-precision references, over lengths that exercise
// the vector bodies and the tails (not multiples of kLanes, a partial last
// block of kSumBlock), values across exp's range (-100 underflows to 0, -inf
// masks), nothing written past a row's end, and bit-identical results across
// Isas and against the scalar FastExp and the scalar optimizer arithmetic.
#include "executor/cpu/kernels_simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "executor/cpu/kernels_internal.h"
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

}  // namespace
}  // namespace hap::executor::cpu::simd
