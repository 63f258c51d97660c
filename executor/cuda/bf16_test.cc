// bf16 mixed precision on the GPU (attribute "bf16", executor/cpu/kernels.h):
// linear, matmul and (ungrouped) conv2d, forward and backward, on bf16
// tensor cores
// (CUBLAS_COMPUTE_32F_FAST_16BF, results rounded to bf16) against the CPU
// bf16 kernels (oneDNN) on the same inputs. The two sum in other orders, so
// a result may round to the neighbouring bf16 value: tolerance one bf16
// step (2^-8 relative) of the output's scale. Skips without a GPU.
#include <random>

#include "common/status_matchers.h"
#include "executor/cpu/cpu_device.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/kernel_compare.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using graph::DType;
using ::hap::testing::IsOk;

class CudaBf16Test : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = CudaAvailable();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.message();
    auto d = NewCudaDevice(0);
    ASSERT_THAT(d, IsOk());
    device_ = std::move(*d);
  }

  KernelCase Case(const std::string& kernel, std::vector<HostTensor> in,
                  std::vector<HostTensor> out) {
    KernelCase c;
    c.kernel = kernel;
    c.attrs.Set("bf16", true);
    c.inputs = std::move(in);
    c.outputs = std::move(out);
    c.rtol = 8e-3;  // a bf16 step of the output's scale, and a little more
    c.atol = 1e-6;
    return c;
  }
  HostTensor R(Shape s, uint64_t seed) { return RandomTensor(DType::kFloat32, s, -1, 1, seed); }

  std::unique_ptr<Device> device_;
};

TEST_F(CudaBf16Test, LinearForwardAndBackward) {
  const int64_t rows = 67, in = 96, out = 45;
  HostTensor x = R({rows, in}, 1), w = R({out, in}, 2), b = R({out}, 3);
  EXPECT_THAT(CompareWithCpu(*device_, Case("linear", {x, w, b}, {R({rows, out}, 4)})), IsOk());
  EXPECT_THAT(CompareWithCpu(*device_, Case("linear", {x, w}, {R({rows, out}, 4)})), IsOk());
  // Gradients accumulate into non-zero starting values.
  EXPECT_THAT(CompareWithCpu(*device_,
                             Case("linear_grad", {x, w, b, R({rows, out}, 5), R({rows, out}, 6)},
                                  {R({rows, in}, 7), R({out, in}, 8), R({out}, 9)})),
              IsOk());
}

TEST_F(CudaBf16Test, BatchedMatmulForwardAndBackward) {
  HostTensor a = R({3, 17, 40}, 10), b = R({3, 40, 23}, 11), y = R({3, 17, 23}, 12);
  EXPECT_THAT(CompareWithCpu(*device_, Case("matmul", {a, b}, {y})), IsOk());
  EXPECT_THAT(CompareWithCpu(*device_, Case("matmul_grad", {a, b, y, R({3, 17, 23}, 13)},
                                            {R({3, 17, 40}, 14), R({3, 40, 23}, 15)})),
              IsOk());
  HostTensor shared = R({40, 23}, 16);  // b shared by every batch entry
  EXPECT_THAT(CompareWithCpu(*device_, Case("matmul_grad", {a, shared, y, R({3, 17, 23}, 17)},
                                            {R({3, 17, 40}, 18), R({40, 23}, 19)})),
              IsOk());
}

// conv2d: im2col and direct (1x1) forms, with and without bias; the
// gradients' partial sums are rounded per group of images as the CPU groups
// them (up to 512 GEMM columns): 40 images of 4x4 outputs are two groups
// (32 and 8), a 33x40 image one group each, a direct convolution one image
// a group.
TEST_F(CudaBf16Test, Conv2dForwardAndBackward) {
  struct C {
    Shape x, w;
    int64_t stride, padding;
    bool bias;
  };
  const C cases[] = {{{2, 3, 9, 11}, {4, 3, 3, 3}, 2, 1, true},
                     {{3, 5, 8, 8}, {6, 5, 1, 1}, 1, 0, true},  // direct
                     {{3, 5, 8, 7}, {6, 5, 1, 1}, 1, 0, false},
                     {{40, 4, 4, 4}, {5, 4, 3, 3}, 1, 1, true},
                     {{2, 3, 33, 40}, {3, 3, 3, 3}, 1, 1, false}};
  uint64_t seed = 20;
  for (const C& c : cases) {
    const Shape y = {c.x[0], c.w[0], (c.x[2] + 2 * c.padding - c.w[2]) / c.stride + 1,
                     (c.x[3] + 2 * c.padding - c.w[3]) / c.stride + 1};
    std::vector<HostTensor> in = {R(c.x, ++seed), R(c.w, ++seed)};
    if (c.bias) in.push_back(R({c.w[0]}, ++seed));
    auto with_window = [&](KernelCase k) {
      k.attrs.Set("stride", std::vector<int64_t>{c.stride});
      k.attrs.Set("padding", std::vector<int64_t>{c.padding});
      return k;
    };
    EXPECT_THAT(CompareWithCpu(*device_, with_window(Case("conv2d", in, {R(y, ++seed)}))), IsOk())
        << "x " << c.x[0] << "x" << c.x[1] << "x" << c.x[2] << "x" << c.x[3];
    // (x, w, b?, y, dy) -> (dx, dw, db?), accumulating into non-zero values.
    std::vector<HostTensor> gin = in;
    gin.push_back(R(y, ++seed));
    gin.push_back(R(y, ++seed));
    std::vector<HostTensor> gout = {R(c.x, ++seed), R(c.w, ++seed)};
    if (c.bias) gout.push_back(R({c.w[0]}, ++seed));
    EXPECT_THAT(CompareWithCpu(*device_, with_window(Case("conv2d_grad", gin, gout))), IsOk())
        << "x " << c.x[0] << "x" << c.x[1] << "x" << c.x[2] << "x" << c.x[3];
  }
}

// Exactly the CPU's arithmetic: operands q/8 + 2^-12 (q a non-zero integer
// in [-16, 16]) round to q/8 in bf16 (the 2^-12 is below half a bf16 step)
// but not in TF32 or float32, and products of q/8 values summed over these
// sizes are exact in float32 in any order. So the GPU equals the CPU to the
// bit only if it rounds the operands to bf16 as the CPU does, rounds each
// result (and each group of images' partial weight and bias gradients, whose
// exact sums need more than bf16's 8 bits) where the CPU does, and nowhere
// else. Outputs start at q/8 values, exact in any float32 sum with these.
class CudaBf16ExactTest : public CudaBf16Test {
 protected:
  HostTensor Grid(Shape s, uint64_t seed, bool tiny = true) {
    HostTensor t(DType::kFloat32, std::move(s));
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> q(1, 16);
    std::bernoulli_distribution negative(0.5);
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      const float v = static_cast<float>(q(rng)) / 8.0f + (tiny ? 0x1p-12f : 0.0f);
      t.as<float>()[i] = negative(rng) ? -v : v;
    }
    return t;
  }
  KernelCase Exact(KernelCase c) {
    c.rtol = 0;
    c.atol = 0;
    return c;
  }
};

TEST_F(CudaBf16ExactTest, LinearAndConv2dRoundWhereTheCpuRounds) {
  HostTensor x = Grid({37, 24}, 1), w = Grid({11, 24}, 2), b = Grid({11}, 3);
  EXPECT_THAT(CompareWithCpu(*device_, Exact(Case("linear", {x, w, b}, {Grid({37, 11}, 4)}))),
              IsOk());
  EXPECT_THAT(
      CompareWithCpu(
          *device_,
          Exact(Case("linear_grad", {x, w, b, Grid({37, 11}, 5), Grid({37, 11}, 6)},
                     {Grid({37, 24}, 7, false), Grid({11, 24}, 8, false), Grid({11}, 9, false)}))),
      IsOk());
  // 40 images of 4x4 outputs: two groups of images (32 and 8) for the
  // gradients' partial sums; then a direct convolution, one image a group.
  struct C {
    Shape x, w;
    int64_t padding;
  };
  for (const C& c : {C{{40, 3, 4, 4}, {5, 3, 3, 3}, 1}, C{{3, 6, 5, 5}, {4, 6, 1, 1}, 0}}) {
    const Shape y = {c.x[0], c.w[0], c.x[2] + 2 * c.padding - c.w[2] + 1,
                     c.x[3] + 2 * c.padding - c.w[3] + 1};
    auto padded = [&](KernelCase k) {
      k.attrs.Set("padding", std::vector<int64_t>{c.padding});
      return Exact(k);
    };
    HostTensor cx = Grid(c.x, 10), cw = Grid(c.w, 11), cb = Grid({c.w[0]}, 12);
    EXPECT_THAT(CompareWithCpu(*device_, padded(Case("conv2d", {cx, cw, cb}, {Grid(y, 13)}))),
                IsOk());
    EXPECT_THAT(
        CompareWithCpu(*device_, padded(Case("conv2d_grad", {cx, cw, cb, Grid(y, 14), Grid(y, 15)},
                                             {Grid(c.x, 16, false), Grid(c.w, 17, false),
                                              Grid({c.w[0]}, 18, false)}))),
        IsOk());
  }
}

// Each gradient of the bf16 convolution alone (its scratch sized for it),
// and no dy at all.
TEST_F(CudaBf16Test, Conv2dGradientsOneAtATime) {
  for (bool direct : {false, true}) {
    const Shape xs = {5, 4, 6, 6}, ws = {3, 4, direct ? 1 : 3, direct ? 1 : 3};
    const Shape y = {5, 3, direct ? 6 : 4, direct ? 6 : 4};
    std::vector<HostTensor> in = {R(xs, 30), R(ws, 31), R({3}, 32), R(y, 33), R(y, 34)};
    std::vector<HostTensor> out = {R(xs, 35), R(ws, 36), R({3}, 37)};
    for (int only = 0; only < 3; ++only) {
      KernelCase k = Case("conv2d_grad", in, out);
      k.output_present = {only == 0, only == 1, only == 2};
      EXPECT_THAT(CompareWithCpu(*device_, k), IsOk()) << "direct " << direct << " output " << only;
    }
    KernelCase no_dy = Case("conv2d_grad", in, out);
    no_dy.input_present = {true, true, true, true, false};
    EXPECT_THAT(CompareWithCpu(*device_, no_dy), IsOk()) << "direct " << direct << " without dy";
  }
}

}  // namespace
}  // namespace hap::executor
