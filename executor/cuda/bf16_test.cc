// bf16 mixed precision on the GPU (attribute "bf16", executor/cpu/kernels.h):
// linear, matmul and (ungrouped) conv2d, forward and backward, on bf16
// tensor cores
// (CUBLAS_COMPUTE_32F_FAST_16BF, results rounded to bf16) against the CPU
// bf16 kernels (oneDNN) on the same inputs. The two sum in other orders, so
// a result may round to the neighbouring bf16 value: tolerance one bf16
// step (2^-8 relative) of the output's scale. Skips without a GPU.
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

}  // namespace
}  // namespace hap::executor
