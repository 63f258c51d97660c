// Runtime kernels (launch_runtime.h): fills, box copies, sums of squares and
// the optimizer updates. Plain C++17 + CUDA.
#include <cstdint>

#include "executor/cuda/launch_runtime.h"
#include "executor/cuda/grid.cuh"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;
constexpr int kMaxSquaresBlocks = 1024;

// Sum of every thread's `v` in a block of kThreads, in a fixed order; the
// result is valid in thread 0.
__device__ inline double BlockSum(double v) {
  __shared__ double part[kThreads];
  part[threadIdx.x] = v;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  return part[0];
}

template <typename T>
__global__ void FillKernel(T value, T* out, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) out[i] = value;
}

template <typename U>
__global__ void CopyBoxKernel(BoxCopy box, const U* src, U* dst) {
  for (int64_t i = GridStart(); i < box.count; i += GridStep()) {
    int64_t so, to;
    BoxOffsets(box, i, &so, &to);
    dst[to] = src[so];
  }
}

template <typename T>
__global__ void SquaresKernel(const T* x, int64_t n, double* partials) {
  double acc = 0;
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const double v = static_cast<double>(x[i]);
    acc += v * v;
  }
  const double s = BlockSum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void SumIntoKernel(const double* partials, int64_t count,
                              double* acc) {
  double v = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) v += partials[i];
  const double s = BlockSum(v);
  if (threadIdx.x == 0) acc[0] += s;
}

__device__ inline double ClipFactor(const Clip& c) {
  if (c.norm_sq == nullptr) return 1.0;
  const double f = c.max_norm / (sqrt(*c.norm_sq) + 1e-6);
  return f < 1.0 ? f : 1.0;
}

template <typename T>
__global__ void SgdKernel(const T* param, const T* grad, Clip clip, T lr, T wd,
                          T momentum, T* mbuf, T* out, int64_t n) {
  const T c = static_cast<T>(ClipFactor(clip));
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const T p = param[i];
    T g = grad[i] * c + wd * p;
    if (mbuf != nullptr) {
      const T m = momentum * mbuf[i] + g;
      mbuf[i] = m;
      g = m;
    }
    out[i] = p - lr * g;
  }
}

__device__ inline float Sqrt(float x) { return sqrtf(x); }
__device__ inline double Sqrt(double x) { return sqrt(x); }

template <typename T>
__global__ void AdamKernel(const T* param, const T* grad, Clip clip,
                           AdamParams ap, T* m, T* v, T* out, int64_t n) {
  const T c = static_cast<T>(ClipFactor(clip));
  const T decay = static_cast<T>(ap.decay), b1 = static_cast<T>(ap.b1),
          b2 = static_cast<T>(ap.b2), step = static_cast<T>(ap.step),
          sqrt_bc2 = static_cast<T>(ap.sqrt_bc2), eps = static_cast<T>(ap.eps);
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const T g = grad[i] * c;
    const T mi = b1 * m[i] + (T(1) - b1) * g;
    const T vi = b2 * v[i] + (T(1) - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const T denom = Sqrt(vi) / sqrt_bc2 + eps;
    out[i] = param[i] * decay - step * mi / denom;
  }
}

__global__ void RoundBf16Kernel(float* x, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const uint32_t u = __float_as_uint(x[i]);
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u
                           ? (u | 0x00400000u) & 0xffff0000u
                           : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    x[i] = __uint_as_float(r);
  }
}

__global__ void ToBf16Kernel(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const uint32_t u = __float_as_uint(x[i]);
    y[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u
                                     ? (u >> 16) | 0x40u
                                     : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

__global__ void FromBf16Kernel(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    y[i] = __uint_as_float(static_cast<uint32_t>(x[i]) << 16);
  }
}

template <typename U>
void CopyBoxAs(const BoxCopy& box, const void* src, void* dst,
               cudaStream_t stream) {
  CopyBoxKernel<U><<<BlocksFor(box.count, kThreads), kThreads, 0, stream>>>(
      box, static_cast<const U*>(src), static_cast<U*>(dst));
}

}  // namespace

void LaunchToBf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  ToBf16Kernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(x, y, n);
}

void LaunchFromBf16(const uint16_t* x, float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  FromBf16Kernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(x, y, n);
}

void LaunchRoundBf16(float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  RoundBf16Kernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(x, n);
}

template <typename T>
void LaunchFill(T value, T* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  FillKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(value, out, n);
}

void LaunchCopyBox(const BoxCopy& box, const void* src, void* dst,
                   cudaStream_t stream) {
  if (box.count <= 0) return;
  switch (box.unit) {
    case 16:
      return CopyBoxAs<uint4>(box, src, dst, stream);
    case 8:
      return CopyBoxAs<uint64_t>(box, src, dst, stream);
    case 4:
      return CopyBoxAs<uint32_t>(box, src, dst, stream);
    case 2:
      return CopyBoxAs<uint16_t>(box, src, dst, stream);
    default:
      return CopyBoxAs<uint8_t>(box, src, dst, stream);
  }
}

int SquaresBlocks(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  return static_cast<int>(b < kMaxSquaresBlocks ? b : kMaxSquaresBlocks);
}

template <typename T>
void LaunchSquares(const T* x, int64_t n, double* partials,
                   cudaStream_t stream) {
  SquaresKernel<T><<<SquaresBlocks(n), kThreads, 0, stream>>>(x, n, partials);
}

void LaunchSumInto(const double* partials, int64_t count, double* acc,
                   cudaStream_t stream) {
  SumIntoKernel<<<1, kThreads, 0, stream>>>(partials, count, acc);
}

template <typename T>
void LaunchSgd(const T* param, const T* grad, Clip clip, T lr, T wd,
               T momentum, T* mbuf, T* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  SgdKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(param, grad, clip, lr, wd,
                                                   momentum, mbuf, out, n);
}

template <typename T>
void LaunchAdam(const T* param, const T* grad, Clip clip, AdamParams p, T* m,
                T* v, T* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  AdamKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(param, grad, clip, p, m, v,
                                                    out, n);
}

template void LaunchFill<float>(float, float*, int64_t, cudaStream_t);
template void LaunchFill<double>(double, double*, int64_t, cudaStream_t);
template void LaunchFill<int32_t>(int32_t, int32_t*, int64_t, cudaStream_t);
template void LaunchFill<int64_t>(int64_t, int64_t*, int64_t, cudaStream_t);
template void LaunchSquares<float>(const float*, int64_t, double*, cudaStream_t);
template void LaunchSquares<double>(const double*, int64_t, double*,
                                    cudaStream_t);
template void LaunchSgd<float>(const float*, const float*, Clip, float, float,
                               float, float*, float*, int64_t, cudaStream_t);
template void LaunchSgd<double>(const double*, const double*, Clip, double,
                                double, double, double*, double*, int64_t,
                                cudaStream_t);
template void LaunchAdam<float>(const float*, const float*, Clip, AdamParams,
                                float*, float*, float*, int64_t, cudaStream_t);
template void LaunchAdam<double>(const double*, const double*, Clip,
                                 AdamParams, double*, double*, double*, int64_t,
                                 cudaStream_t);

}  // namespace hap::executor::cuda
