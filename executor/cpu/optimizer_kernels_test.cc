// The runtime and optimizer kernels on the CPU (fills, copies, squared
// norms, SGD with momentum and weight decay, AdamW) against hand-computed
// values, and float32 against float64.
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

// --- runtime kernels ------------------------------------------------------------------

TEST(RuntimeKernelTest, FillCopyAccumulate) {
  HostTensor out = Full({2, 2}, 3.0);
  ASSERT_THAT(RunKernel("fill_zero", {}, {}, {out}), IsOk());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.as<double>()[i], 0.0);
  HostTensor x = Rand({4}, 1);
  ASSERT_THAT(RunKernel("copy", {}, {x}, {out}), IsOk());  // same element count
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.as<double>()[i], x.as<double>()[i]);
  ASSERT_THAT(RunKernel("accumulate", {}, {x}, {out}), IsOk());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.as<double>()[i], 2 * x.as<double>()[i]);
  HostTensor ids = Ints({3}, {1, 2, 3}), ids2 = Ints({3}, {0, 0, 0});
  ASSERT_THAT(RunKernel("copy", {}, {ids}, {ids2}), IsOk());
  EXPECT_EQ(ids2.as<int64_t>()[2], 3);
  EXPECT_THAT(RunKernel("copy", {}, {x}, {Full({5}, 0.0)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kernel 'copy'")));
}

TEST(RuntimeKernelTest, SqNormAccumulatesInDouble) {
  HostTensor acc = Full({1}, 1.0);
  HostTensor a = Vals({2}, {3.0, 4.0});
  HostTensor b = ToF32(Vals({1}, {0.5}));
  ASSERT_THAT(RunKernel("sq_norm", {}, {a, b, kAbsent}, {acc}), IsOk());
  EXPECT_DOUBLE_EQ(acc.as<double>()[0], 1.0 + 9 + 16 + 0.25);
  EXPECT_THAT(RunKernel("sq_norm", {}, {a}, {Full({1}, 0.0, DType::kFloat32)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("f64[1]")));
}

TEST(RuntimeKernelTest, SgdMomentumWeightDecay) {
  HostTensor p = Vals({2}, {1.0, -2.0}), m = Full({2}, 0.0);
  Attrs a = {{"learning_rate", 0.1}, {"momentum", 0.9}, {"weight_decay", 0.01}};
  ASSERT_THAT(RunKernel("sgd_update", a, {p, Vals({2}, {0.5, -1.0}), kAbsent}, {p, m}), IsOk());
  // g = grad + 0.01 p = (0.51, -1.02); m = g; p -= 0.1 g.
  EXPECT_DOUBLE_EQ(m.as<double>()[0], 0.51);
  EXPECT_DOUBLE_EQ(p.as<double>()[0], 1.0 - 0.051);
  EXPECT_DOUBLE_EQ(p.as<double>()[1], -2.0 + 0.102);
  ASSERT_THAT(RunKernel("sgd_update", a, {p, Vals({2}, {1.0, 0.0}), kAbsent}, {p, m}), IsOk());
  // g = (1 + 0.01 * 0.949, 0.01 * -1.898); m = 0.9 m + g.
  const double g0 = 1.0 + 0.01 * 0.949, m0 = 0.9 * 0.51 + g0;
  EXPECT_DOUBLE_EQ(m.as<double>()[0], m0);
  EXPECT_DOUBLE_EQ(p.as<double>()[0], 0.949 - 0.1 * m0);
  // Without momentum, clipped: norm 4 > 2 scales the gradient by 2 / 4.
  HostTensor q = Vals({1}, {1.0});
  ASSERT_THAT(RunKernel("sgd_update", {{"learning_rate", 1.0}, {"clip_global_norm", 2.0}},
                  {q, Vals({1}, {4.0}), Vals({1}, {16.0})}, {q}),
              IsOk());
  EXPECT_NEAR(q.as<double>()[0], 1.0 - 4.0 * 2.0 / (4.0 + 1e-6), 1e-15);
  // A norm below the threshold leaves the gradient alone.
  ASSERT_THAT(RunKernel("sgd_update", {{"learning_rate", 1.0}, {"clip_global_norm", 5.0}},
                  {q, Vals({1}, {4.0}), Vals({1}, {16.0})}, {q}),
              IsOk());
  EXPECT_NEAR(q.as<double>()[0], 1.0 - 2.0 / (1.0 + 0.25e-6) - 4.0, 1e-12);
}

TEST(RuntimeKernelTest, AdamWTwoSteps) {
  const double lr = 0.01, b1 = 0.8, b2 = 0.9, eps = 1e-8, wd = 0.1;
  Attrs a = {{"learning_rate", lr}, {"beta1", b1}, {"beta2", b2},
             {"epsilon", eps}, {"weight_decay", wd}};
  HostTensor p = Vals({2}, {1.0, -0.5}), m = Full({2}, 0.0), v = Full({2}, 0.0);
  const double g1[2] = {0.3, -2.0}, g2[2] = {-0.1, 1.0};
  ASSERT_THAT(RunKernel("adam_update", a, {p, Vals({2}, {g1[0], g1[1]}), kAbsent}, {p, m, v}, 0),
              IsOk());
  double want[2];
  for (int i = 0; i < 2; ++i) {
    // Step 1: mhat = g, vhat = g^2.
    const double p0 = i == 0 ? 1.0 : -0.5;
    want[i] = p0 * (1 - lr * wd) - lr * g1[i] / (std::abs(g1[i]) + eps);
    EXPECT_NEAR(p.as<double>()[i], want[i], 1e-15);
    EXPECT_NEAR(m.as<double>()[i], (1 - b1) * g1[i], 1e-15);
    EXPECT_NEAR(v.as<double>()[i], (1 - b2) * g1[i] * g1[i], 1e-15);
  }
  ASSERT_THAT(RunKernel("adam_update", a, {p, Vals({2}, {g2[0], g2[1]}), kAbsent}, {p, m, v}, 1),
              IsOk());
  for (int i = 0; i < 2; ++i) {
    const double mm = b1 * (1 - b1) * g1[i] + (1 - b1) * g2[i];
    const double vv = b2 * (1 - b2) * g1[i] * g1[i] + (1 - b2) * g2[i] * g2[i];
    const double mhat = mm / (1 - b1 * b1), vhat = vv / (1 - b2 * b2);
    const double w = want[i] * (1 - lr * wd) - lr * mhat / (std::sqrt(vhat) + eps);
    EXPECT_NEAR(p.as<double>()[i], w, 1e-12);
  }
}

// The float optimizer loops are vectorized (kernels_simd.h): lengths with
// tails, and one long enough for two threads' chunks, against the float64
// kernels element by element (1e-6: float rounding of values near 1).
TEST(RuntimeKernelTest, Float32OptimizersMatchFloat64) {
  for (int64_t n : {1, 7, 17, 1000, 100003}) {
    const std::string what = absl::StrCat("n ", n);
    const HostTensor param = Rand({n}, 600 + n), grad = Rand({n}, 700 + n, 3.0);
    const HostTensor norm = Vals({1}, {4.0 * n});  // clips by about 1/2
    // AdamW, two steps so the moments are non-zero going in.
    const Attrs adam = {{"learning_rate", 1e-2},
                        {"weight_decay", 0.1},
                        {"clip_global_norm", 1.0 * std::sqrt(n)}};
    HostTensor p64 = param, m64 = Full({n}, 0.0), v64 = Full({n}, 0.0);
    HostTensor p32 = ToF32(param), m32 = Full({n}, 0.0, DType::kFloat32),
               v32 = Full({n}, 0.0, DType::kFloat32);
    for (int64_t step : {0, 1}) {
      ASSERT_THAT(RunKernel("adam_update", adam, {p64, grad, norm},
                            {p64, m64, v64}, step, 2),
                  IsOk());
      ASSERT_THAT(RunKernel("adam_update", adam, {p32, ToF32(grad), norm},
                            {p32, m32, v32}, step, 2),
                  IsOk());
    }
    ExpectAllNear(p32, p64, 1e-6, "adam param " + what);
    ExpectAllNear(m32, m64, 1e-6, "adam m " + what);
    ExpectAllNear(v32, v64, 1e-6, "adam v " + what);
    // SGD with momentum and weight decay, and without momentum.
    for (double momentum : {0.9, 0.0}) {
      const Attrs sgd = {{"learning_rate", 0.1},
                         {"momentum", momentum},
                         {"weight_decay", 0.01},
                         {"clip_global_norm", 1.0 * std::sqrt(n)}};
      HostTensor q64 = param, b64 = Full({n}, 0.5);
      HostTensor q32 = ToF32(param), b32 = Full({n}, 0.5, DType::kFloat32);
      ASSERT_THAT(
          RunKernel("sgd_update", sgd, {q64, grad, norm}, {q64, b64}, 0, 2),
          IsOk());
      ASSERT_THAT(RunKernel("sgd_update", sgd, {q32, ToF32(grad), norm},
                            {q32, b32}, 0, 2),
                  IsOk());
      ExpectAllNear(q32, q64, 1e-6,
                    absl::StrCat("sgd momentum ", momentum, " ", what));
      ExpectAllNear(b32, b64, 1e-6,
                    absl::StrCat("sgd buffer ", momentum, " ", what));
    }
    // The squared norm: every float square is exact in double.
    HostTensor acc = Full({1}, 1.0);
    const HostTensor param32 = ToF32(param);
    ASSERT_THAT(RunKernel("sq_norm", {}, {param32}, {acc}), IsOk());
    double want = 1.0;
    for (int64_t i = 0; i < n; ++i) {
      want += double(param32.as<float>()[i]) * param32.as<float>()[i];
    }
    EXPECT_NEAR(acc.as<double>()[0], want, 1e-13 * want) << what;
  }
}

}  // namespace
}  // namespace hap::executor::kernel_test
