// Device code of the convolution and pooling kernels
// (launch_convolution.h).
#include <cmath>

#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/kernels_b_index.h"
#include "executor/cuda/launch_convolution.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;

// --- im2col ------------------------------------------------------------------

template <typename T>
__global__ void Im2ColKernel(Window g, const T* x, int64_t images,
                             int64_t row_stride, int64_t image_stride, T* col) {
  const int64_t total = g.c * g.taps() * images * g.out_plane();
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    int64_t at;
    const int64_t src =
        Im2ColSource(g, k, images, row_stride, image_stride, &at);
    col[at] = src >= 0 ? x[src] : T(0);
  }
}

// One thread per input element (Col2ImSum).
template <typename T>
__global__ void Col2ImKernel(Window g, const T* col, int64_t images,
                             int64_t row_stride, int64_t image_stride, T* dx) {
  const int64_t total = images * g.c * g.plane();
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    dx[k] += Col2ImSum(g, col, images, row_stride, image_stride, k);
  }
}

template <typename T>
__global__ void AddBiasKernel(const T* bias, int64_t total, int64_t channels,
                              int64_t plane, T* y) {
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    y[k] += bias[(k / plane) % channels];
  }
}

template <typename T>
__global__ void ChannelsFirstKernel(const T* src, int64_t images,
                                    int64_t channels, int64_t plane, T* dst) {
  const int64_t total = images * channels * plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t p = k % plane;
    const int64_t t = k / plane;
    const int64_t m = t % images;
    const int64_t ch = t / images;
    dst[k] = src[(m * channels + ch) * plane + p];
  }
}

constexpr int kReduce = 256;

template <typename T>
__global__ void BiasGradKernel(const T* dy, int64_t images, int64_t channels,
                               int64_t plane, T* db) {
  using R = dev::BlockAll<double, kReduce>;  // in double, as the CPU sums
  __shared__ typename R::Storage s;
  const int64_t count = images * plane;
  for (int64_t ch = blockIdx.x; ch < channels; ch += gridDim.x) {
    double acc = 0;
    for (int64_t k = threadIdx.x; k < count; k += kReduce) {
      const int64_t m = k / plane;
      acc += static_cast<double>(dy[(m * channels + ch) * plane + (k - m * plane)]);
    }
    const double sum = R::Run(acc, dev::SumOp(), s);
    if (threadIdx.x == 0) db[ch] += static_cast<T>(sum);
  }
}

// --- grouped conv2d, conv3d --------------------------------------------------

template <typename T>
__global__ void GroupedConvKernel(Window g, int64_t groups, int64_t o,
                                  const T* x, const T* w, const T* bias, T* y) {
  const int64_t op = g.out_plane();
  const int64_t total = g.n * o * op;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t p = k % op, oc = (k / op) % o, m = k / (op * o);
    const double b = bias != nullptr ? static_cast<double>(bias[oc]) : 0.0;
    y[k] = static_cast<T>(b + GroupedConvValue(g, groups, o, x, w, m, oc, p));
  }
}

template <typename T>
__global__ void GroupedConvDxKernel(Window g, int64_t groups, int64_t o,
                                    const T* w, const T* dy, T* dx) {
  const int64_t plane = g.plane();
  const int64_t total = g.n * g.c * plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t p = k % plane, ic = (k / plane) % g.c, m = k / (plane * g.c);
    dx[k] += static_cast<T>(GroupedConvDx(g, groups, o, w, dy, m, ic, p));
  }
}

template <typename T>
__global__ void GroupedConvDwKernel(Window g, int64_t groups, int64_t o,
                                    const T* x, const T* dy, T* dw) {
  const int64_t cg = g.c / groups, taps = g.taps();
  const int64_t total = o * cg * taps;
  for (int64_t e = GridStart(); e < total; e += GridStep()) {
    const int64_t tap = e % taps, k = (e / taps) % cg, oc = e / (taps * cg);
    dw[e] += static_cast<T>(GroupedConvDw(g, groups, o, x, dy, oc, k, tap));
  }
}

// --- max_pool2d, max_pool3d --------------------------------------------------

template <typename T>
__global__ void MaxPoolKernel(Window g, const T* x, T* y, int64_t* argmax) {
  const int64_t out_plane = g.out_plane();
  const int64_t total = g.n * g.c * out_plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / out_plane;
    const int64_t o = k - pl * out_plane;
    int64_t best;
    T mx;
    WindowMax(g, x + pl * g.plane(), o, &best, &mx);
    if (y != nullptr) y[k] = mx;
    if (argmax != nullptr) argmax[k] = best;
  }
}

// One thread per input element (MaxPoolGradSum).
template <typename T>
__global__ void MaxPoolGradKernel(Window g, const int64_t* argmax, const T* dy,
                                  T* dx) {
  const int64_t plane = g.plane();
  const int64_t out_plane = g.out_plane();
  const int64_t total = g.n * g.c * plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / plane;
    T sum;
    if (MaxPoolGradSum(g, argmax + pl * out_plane, dy + pl * out_plane,
                       k - pl * plane, &sum)) {
      dx[k] += sum;
    }
  }
}

// --- avg_pool2d, avg_pool3d and adaptive_avg_pool2d ---------------------------

// One thread per output: AvgPoolValue (kAdaptive: AdaptiveAvg, 2-D).
template <typename T, bool kAdaptive>
__global__ void AvgPoolKernel(Window g, const T* x, T* y) {
  const int64_t out_plane = g.out_plane();
  const int64_t total = g.n * g.c * out_plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / out_plane;
    const int64_t o = k - pl * out_plane;
    const T* xp = x + pl * g.plane();
    if constexpr (kAdaptive) {
      y[k] = AdaptiveAvg(g, xp, o / g.ow, o % g.ow);
    } else {
      y[k] = AvgPoolValue(g, xp, o);
    }
  }
}

// One thread per input element: AvgPoolGradSum (kAdaptive:
// AdaptiveGradSum).
template <typename T, bool kAdaptive>
__global__ void AvgPoolGradKernel(Window g, const T* dy, T* dx) {
  const int64_t plane = g.plane();
  const int64_t out_plane = g.out_plane();
  const int64_t total = g.n * g.c * plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / plane;
    const T* dyp = dy + pl * out_plane;
    if constexpr (kAdaptive) {
      dx[k] += AdaptiveGradSum(g, dyp, k - pl * plane);
    } else {
      dx[k] += AvgPoolGradSum(g, dyp, k - pl * plane);
    }
  }
}

template <typename T, bool kAdaptive>
void LaunchAvg(const Window& g, const T* x, T* y, cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.out_plane();
  if (total == 0) return;
  AvgPoolKernel<T, kAdaptive>
      <<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(g, x, y);
}

template <typename T, bool kAdaptive>
void LaunchAvgGrad(const Window& g, const T* dy, T* dx, cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.plane();
  if (total == 0 || g.out_plane() == 0) return;
  AvgPoolGradKernel<T, kAdaptive>
      <<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(g, dy, dx);
}

}  // namespace

template <typename T>
void LaunchIm2Col(const Window& g, const T* x, int64_t images,
                  int64_t row_stride, int64_t image_stride, T* col,
                  cudaStream_t stream) {
  const int64_t total = g.c * g.taps() * images * g.out_plane();
  if (total == 0) return;
  Im2ColKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, x, images, row_stride, image_stride, col);
}

template <typename T>
void LaunchCol2Im(const Window& g, const T* col, int64_t images,
                  int64_t row_stride, int64_t image_stride, T* dx,
                  cudaStream_t stream) {
  const int64_t total = images * g.c * g.plane();
  if (total == 0) return;
  Col2ImKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, col, images, row_stride, image_stride, dx);
}

template <typename T>
void LaunchAddBias(const T* bias, int64_t images, int64_t channels,
                   int64_t plane, T* y, cudaStream_t stream) {
  const int64_t total = images * channels * plane;
  if (total == 0) return;
  AddBiasKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      bias, total, channels, plane, y);
}

template <typename T>
void LaunchChannelsFirst(const T* src, int64_t images, int64_t channels,
                         int64_t plane, T* dst, cudaStream_t stream) {
  const int64_t total = images * channels * plane;
  if (total == 0) return;
  ChannelsFirstKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      src, images, channels, plane, dst);
}

template <typename T>
void LaunchBiasGrad(const T* dy, int64_t images, int64_t channels,
                    int64_t plane, T* db, cudaStream_t stream) {
  if (channels == 0) return;
  BiasGradKernel<T><<<BlocksFor(channels, 1), kReduce, 0, stream>>>(
      dy, images, channels, plane, db);
}

template <typename T>
void LaunchGroupedConv(const Window& g, int64_t groups, int64_t o, const T* x,
                       const T* w, const T* bias, T* y, cudaStream_t stream) {
  const int64_t total = g.n * o * g.out_plane();
  if (total == 0) return;
  GroupedConvKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, groups, o, x, w, bias, y);
}

template <typename T>
void LaunchGroupedConvGrad(const Window& g, int64_t groups, int64_t o,
                           const T* x, const T* w, const T* dy, T* dx, T* dw,
                           cudaStream_t stream) {
  const int64_t ins = g.n * g.c * g.plane();
  const int64_t weights = o * (g.c / groups) * g.taps();
  if (dx != nullptr && ins > 0) {
    GroupedConvDxKernel<T><<<BlocksFor(ins, kThreads), kThreads, 0, stream>>>(
        g, groups, o, w, dy, dx);
  }
  if (dw != nullptr && weights > 0) {
    GroupedConvDwKernel<T>
        <<<BlocksFor(weights, kThreads), kThreads, 0, stream>>>(g, groups, o, x,
                                                                dy, dw);
  }
}

template <typename T>
void LaunchMaxPool(const Window& g, const T* x, T* y, cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.out_plane();
  if (total == 0) return;
  MaxPoolKernel<T>
      <<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(g, x, y, nullptr);
}

template <typename T>
void LaunchMaxPoolGrad(const Window& g, const T* x, const T* dy, T* dx,
                       int64_t* argmax, cudaStream_t stream) {
  const int64_t outs = g.n * g.c * g.out_plane();
  const int64_t ins = g.n * g.c * g.plane();
  if (outs == 0 || ins == 0) return;
  MaxPoolKernel<T><<<BlocksFor(outs, kThreads), kThreads, 0, stream>>>(
      g, x, nullptr, argmax);
  MaxPoolGradKernel<T>
      <<<BlocksFor(ins, kThreads), kThreads, 0, stream>>>(g, argmax, dy, dx);
}

template <typename T>
void LaunchAvgPool(const Window& g, const T* x, T* y, cudaStream_t stream) {
  LaunchAvg<T, false>(g, x, y, stream);
}

template <typename T>
void LaunchAvgPoolGrad(const Window& g, const T* dy, T* dx,
                       cudaStream_t stream) {
  LaunchAvgGrad<T, false>(g, dy, dx, stream);
}

template <typename T>
void LaunchAdaptiveAvgPool(const Window& g, const T* x, T* y,
                           cudaStream_t stream) {
  LaunchAvg<T, true>(g, x, y, stream);
}

template <typename T>
void LaunchAdaptiveAvgPoolGrad(const Window& g, const T* dy, T* dx,
                               cudaStream_t stream) {
  LaunchAvgGrad<T, true>(g, dy, dx, stream);
}

#define HAP_INSTANTIATE_CONVOLUTION(T)                                       \
  template void LaunchIm2Col<T>(const Window&, const T*, int64_t, int64_t,   \
                                int64_t, T*, cudaStream_t);                  \
  template void LaunchCol2Im<T>(const Window&, const T*, int64_t, int64_t,   \
                                int64_t, T*, cudaStream_t);                  \
  template void LaunchAddBias<T>(const T*, int64_t, int64_t, int64_t, T*,    \
                                 cudaStream_t);                              \
  template void LaunchChannelsFirst<T>(const T*, int64_t, int64_t, int64_t,  \
                                       T*, cudaStream_t);                    \
  template void LaunchBiasGrad<T>(const T*, int64_t, int64_t, int64_t, T*,   \
                                  cudaStream_t);                             \
  template void LaunchGroupedConv<T>(const Window&, int64_t, int64_t,        \
                                     const T*, const T*, const T*, T*,       \
                                     cudaStream_t);                          \
  template void LaunchGroupedConvGrad<T>(const Window&, int64_t, int64_t,    \
                                         const T*, const T*, const T*, T*,   \
                                         T*, cudaStream_t);                  \
  template void LaunchMaxPool<T>(const Window&, const T*, T*, cudaStream_t); \
  template void LaunchMaxPoolGrad<T>(const Window&, const T*, const T*, T*,  \
                                     int64_t*, cudaStream_t);                \
  template void LaunchAvgPool<T>(const Window&, const T*, T*, cudaStream_t); \
  template void LaunchAvgPoolGrad<T>(const Window&, const T*, T*,            \
                                     cudaStream_t);                          \
  template void LaunchAdaptiveAvgPool<T>(const Window&, const T*, T*,        \
                                         cudaStream_t);                      \
  template void LaunchAdaptiveAvgPoolGrad<T>(const Window&, const T*, T*,    \
                                             cudaStream_t);
HAP_INSTANTIATE_CONVOLUTION(float)
HAP_INSTANTIATE_CONVOLUTION(double)

}  // namespace hap::executor::cuda
