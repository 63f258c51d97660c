// Internal to executor/cuda: launchers of the runtime kernels and the
// device's own fills and box copies (kernels_runtime.cu). Every launcher
// enqueues on `stream` and returns; T is float or double unless noted.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_RUNTIME_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_RUNTIME_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/cuda/launch_common.h"

namespace hap::executor::cuda {

// out[0, n) = value. T: float, double, int32_t, int64_t.
template <typename T>
void LaunchFill(T value, T* out, int64_t n, cudaStream_t stream);

// x[0, n) rounded to bfloat16 (to nearest even; NaN stays NaN), in place:
// bf16 mixed precision's product results (executor/cpu/kernels.h "bf16").
void LaunchRoundBf16(float* x, int64_t n, cudaStream_t stream);
// float32 -> bfloat16 bits (round to nearest even) and back (Device::Convert).
void LaunchToBf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream);
void LaunchFromBf16(const uint16_t* x, float* y, int64_t n, cudaStream_t stream);

// A box copy in units of `unit` bytes (1, 2, 4, 8 or 16; the pointers and
// every stride are multiples of it): element idx of the box (row-major over
// `extent`) goes from src[sum idx_d src_stride_d] to dst[sum idx_d
// dst_stride_d]; `src`/`dst` point at the boxes' first elements.
struct BoxCopy {
  int rank = 0;
  int unit = 1;
  int64_t count = 1;
  int64_t extent[kMaxDims + 1] = {};
  int64_t src_stride[kMaxDims + 1] = {};
  int64_t dst_stride[kMaxDims + 1] = {};
};
void LaunchCopyBox(const BoxCopy& box, const void* src, void* dst,
                   cudaStream_t stream);
// The offsets (in units) of box element i in src and dst.
HAP_CUDA_HD inline void BoxOffsets(const BoxCopy& box, int64_t i,
                                   int64_t* src_off, int64_t* dst_off) {
  int64_t so = 0, to = 0;
  for (int d = box.rank - 1; d >= 0; --d) {
    const int64_t idx = i % box.extent[d];
    i /= box.extent[d];
    so += idx * box.src_stride[d];
    to += idx * box.dst_stride[d];
  }
  *src_off = so;
  *dst_off = to;
}

// Blocks (and so partial sums) LaunchSquares uses for n elements: a
// function of n alone, so the sum's order is fixed.
int SquaresBlocks(int64_t n);
// partials[b] = sum of x^2 over block b's elements (double), for
// b < SquaresBlocks(n).
template <typename T>
void LaunchSquares(const T* x, int64_t n, double* partials,
                   cudaStream_t stream);
// acc[0] += sum of partials[0, count), in a fixed order.
void LaunchSumInto(const double* partials, int64_t count, double* acc,
                   cudaStream_t stream);

// The gradient clipping factor of kernels.h: min(1, max_norm /
// (sqrt(*norm_sq) + 1e-6)) when norm_sq is not null, else 1.
struct Clip {
  const double* norm_sq = nullptr;
  double max_norm = 0;
};

// sgd_update (kernels.h): g = grad * clip + wd * param; with momentum,
// m = momentum * m + g and g = m; out = param - lr * g. `out` may alias
// `param`.
template <typename T>
void LaunchSgd(const T* param, const T* grad, Clip clip, T lr, T wd,
               T momentum, T* mbuf, T* out, int64_t n, cudaStream_t stream);

// adam_update (kernels.h): g = grad * clip; m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; out = param * decay - step * m / (sqrt(v) /
// sqrt_bc2 + eps).
struct AdamParams {
  double decay = 1, b1 = 0.9, b2 = 0.999, step = 0, sqrt_bc2 = 1, eps = 1e-8;
};
template <typename T>
void LaunchAdam(const T* param, const T* grad, Clip clip, AdamParams p, T* m,
                T* v, T* out, int64_t n, cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_RUNTIME_H_
