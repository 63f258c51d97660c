// Device code of the convolution and pooling kernels
// (launch_convolution.h).
#include <cmath>

#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/launch_convolution.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;

// --- im2col ---------------------------------------------------------------------

template <typename T>
__global__ void Im2ColKernel(Window g, const T* x, int64_t images,
                             int64_t row_stride, int64_t image_stride,
                             T* col) {
  const int64_t total = g.c * g.kh * g.kw * images * g.oh * g.ow;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    int64_t t = k;
    const int64_t ox = t % g.ow;
    t /= g.ow;
    const int64_t oy = t % g.oh;
    t /= g.oh;
    const int64_t m = t % images;
    const int64_t row = t / images;
    const int64_t j = row % g.kw;
    const int64_t i = (row / g.kw) % g.kh;
    const int64_t ch = row / (g.kw * g.kh);
    const int64_t iy = oy * g.sh - g.ph + i;
    const int64_t ix = ox * g.sw - g.pw + j;
    const bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
    col[row * row_stride + m * image_stride + oy * g.ow + ox] =
        inside ? x[((m * g.c + ch) * g.h + iy) * g.w + ix] : T(0);
  }
}

// One thread per input element: the sum over the (i, j) kernel taps whose
// output position (oy, ox) reads it.
template <typename T>
__global__ void Col2ImKernel(Window g, const T* col, int64_t images,
                             int64_t row_stride, int64_t image_stride,
                             T* dx) {
  const int64_t total = images * g.c * g.h * g.w;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    int64_t t = k;
    const int64_t ix = t % g.w;
    t /= g.w;
    const int64_t iy = t % g.h;
    t /= g.h;
    const int64_t ch = t % g.c;
    const int64_t m = t / g.c;
    T acc = T(0);
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t ty = iy + g.ph - i;  // = oy * sh
      if (ty < 0) break;                 // and for every larger i
      if (ty % g.sh != 0) continue;
      const int64_t oy = ty / g.sh;
      if (oy >= g.oh) continue;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t tx = ix + g.pw - j;
        if (tx < 0) break;
        if (tx % g.sw != 0) continue;
        const int64_t ox = tx / g.sw;
        if (ox >= g.ow) continue;
        const int64_t row = (ch * g.kh + i) * g.kw + j;
        acc += col[row * row_stride + m * image_stride + oy * g.ow + ox];
      }
    }
    dx[k] += acc;
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
  using R = dev::BlockAll<T, kReduce>;
  __shared__ typename R::Storage s;
  const int64_t count = images * plane;
  for (int64_t ch = blockIdx.x; ch < channels; ch += gridDim.x) {
    T acc = T(0);
    for (int64_t k = threadIdx.x; k < count; k += kReduce) {
      const int64_t m = k / plane;
      acc += dy[(m * channels + ch) * plane + (k - m * plane)];
    }
    const T sum = R::Run(acc, dev::SumOp(), s);
    if (threadIdx.x == 0) db[ch] += sum;
  }
}

// --- max_pool2d -------------------------------------------------------------------

// The first maximum of output (oy, ox)'s window over plane xp (as the CPU's
// ForEachMax): its index in the plane and value.
template <typename T>
__device__ void WindowMax(const Window& g, const T* xp, int64_t oy, int64_t ox,
                          int64_t* best_out, T* max_out) {
  const int64_t y0 = oy * g.sh - g.ph > 0 ? oy * g.sh - g.ph : 0;
  const int64_t y1 = oy * g.sh - g.ph + g.kh < g.h ? oy * g.sh - g.ph + g.kh
                                                    : g.h;
  const int64_t x0 = ox * g.sw - g.pw > 0 ? ox * g.sw - g.pw : 0;
  const int64_t x1 = ox * g.sw - g.pw + g.kw < g.w ? ox * g.sw - g.pw + g.kw
                                                    : g.w;
  int64_t best = y0 * g.w + x0;
  T mx = -static_cast<T>(INFINITY);
  for (int64_t iy = y0; iy < y1; ++iy) {
    for (int64_t ix = x0; ix < x1; ++ix) {
      const T v = xp[iy * g.w + ix];
      if (v > mx || isnan(v)) {
        mx = v;
        best = iy * g.w + ix;
      }
    }
  }
  *best_out = best;
  *max_out = mx;
}

template <typename T>
__global__ void MaxPoolKernel(Window g, const T* x, T* y, int64_t* argmax) {
  const int64_t out_plane = g.oh * g.ow;
  const int64_t total = g.n * g.c * out_plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / out_plane;
    const int64_t o = k - pl * out_plane;
    int64_t best;
    T mx;
    WindowMax(g, x + pl * g.h * g.w, o / g.ow, o % g.ow, &best, &mx);
    if (y != nullptr) y[k] = mx;
    if (argmax != nullptr) argmax[k] = best;
  }
}

// One thread per input element: the sum of dy over the windows whose first
// maximum it is, in output scan order.
template <typename T>
__global__ void MaxPoolGradKernel(Window g, const int64_t* argmax,
                                  const T* dy, T* dx) {
  const int64_t plane = g.h * g.w;
  const int64_t out_plane = g.oh * g.ow;
  const int64_t total = g.n * g.c * plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / plane;
    const int64_t e = k - pl * plane;
    const int64_t iy = e / g.w, ix = e % g.w;
    // Windows [oy * sh - ph, oy * sh - ph + kh) containing iy.
    const int64_t ay = iy + g.ph - g.kh;
    const int64_t oy0 = ay < 0 ? 0 : ay / g.sh + 1;
    const int64_t oy1 = (iy + g.ph) / g.sh < g.oh - 1 ? (iy + g.ph) / g.sh
                                                      : g.oh - 1;
    const int64_t ax = ix + g.pw - g.kw;
    const int64_t ox0 = ax < 0 ? 0 : ax / g.sw + 1;
    const int64_t ox1 = (ix + g.pw) / g.sw < g.ow - 1 ? (ix + g.pw) / g.sw
                                                      : g.ow - 1;
    const int64_t* am = argmax + pl * out_plane;
    const T* dyp = dy + pl * out_plane;
    T acc = T(0);
    bool any = false;
    for (int64_t oy = oy0; oy <= oy1; ++oy) {
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        if (am[oy * g.ow + ox] == e) {
          acc += dyp[oy * g.ow + ox];
          any = true;
        }
      }
    }
    if (any) dx[k] += acc;
  }
}

// --- adaptive_avg_pool2d ----------------------------------------------------------

__device__ inline int64_t RangeStart(int64_t i, int64_t in, int64_t out) {
  return i * in / out;
}
__device__ inline int64_t RangeEnd(int64_t i, int64_t in, int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

template <typename T>
__global__ void AdaptivePoolKernel(Window g, const T* x, T* y) {
  const int64_t out_plane = g.oh * g.ow;
  const int64_t total = g.n * g.c * out_plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / out_plane;
    const int64_t o = k - pl * out_plane;
    const int64_t oy = o / g.ow, ox = o % g.ow;
    const int64_t y0 = RangeStart(oy, g.h, g.oh), y1 = RangeEnd(oy, g.h, g.oh);
    const int64_t x0 = RangeStart(ox, g.w, g.ow), x1 = RangeEnd(ox, g.w, g.ow);
    const T* xp = x + pl * g.h * g.w;
    T acc = T(0);
    for (int64_t iy = y0; iy < y1; ++iy) {
      for (int64_t ix = x0; ix < x1; ++ix) acc += xp[iy * g.w + ix];
    }
    y[k] = static_cast<T>(
        static_cast<double>(acc) /
        static_cast<double>((y1 - y0) * (x1 - x0)));
  }
}

// One thread per input element: dy / window size summed over the windows
// containing it (a superset of candidate windows is tested exactly).
template <typename T>
__global__ void AdaptivePoolGradKernel(Window g, const T* dy, T* dx) {
  const int64_t plane = g.h * g.w;
  const int64_t out_plane = g.oh * g.ow;
  const int64_t total = g.n * g.c * plane;
  for (int64_t k = GridStart(); k < total; k += GridStep()) {
    const int64_t pl = k / plane;
    const int64_t e = k - pl * plane;
    const int64_t iy = e / g.w, ix = e % g.w;
    const int64_t oy_lo = iy * g.oh / g.h - 1 > 0 ? iy * g.oh / g.h - 1 : 0;
    const int64_t oy_hi_raw = ((iy + 1) * g.oh + g.h - 1) / g.h;
    const int64_t oy_hi = oy_hi_raw < g.oh - 1 ? oy_hi_raw : g.oh - 1;
    const int64_t ox_lo = ix * g.ow / g.w - 1 > 0 ? ix * g.ow / g.w - 1 : 0;
    const int64_t ox_hi_raw = ((ix + 1) * g.ow + g.w - 1) / g.w;
    const int64_t ox_hi = ox_hi_raw < g.ow - 1 ? ox_hi_raw : g.ow - 1;
    const T* dyp = dy + pl * out_plane;
    T acc = T(0);
    for (int64_t oy = oy_lo; oy <= oy_hi; ++oy) {
      const int64_t y0 = RangeStart(oy, g.h, g.oh), y1 = RangeEnd(oy, g.h, g.oh);
      if (iy < y0 || iy >= y1) continue;
      for (int64_t ox = ox_lo; ox <= ox_hi; ++ox) {
        const int64_t x0 = RangeStart(ox, g.w, g.ow);
        const int64_t x1 = RangeEnd(ox, g.w, g.ow);
        if (ix < x0 || ix >= x1) continue;
        const double inv = 1.0 / static_cast<double>((y1 - y0) * (x1 - x0));
        acc += static_cast<T>(dyp[oy * g.ow + ox] * inv);
      }
    }
    dx[k] += acc;
  }
}

}  // namespace

template <typename T>
void LaunchIm2Col(const Window& g, const T* x, int64_t images,
                  int64_t row_stride, int64_t image_stride, T* col,
                  cudaStream_t stream) {
  const int64_t total = g.c * g.kh * g.kw * images * g.oh * g.ow;
  if (total == 0) return;
  Im2ColKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, x, images, row_stride, image_stride, col);
}

template <typename T>
void LaunchCol2Im(const Window& g, const T* col, int64_t images,
                  int64_t row_stride, int64_t image_stride, T* dx,
                  cudaStream_t stream) {
  const int64_t total = images * g.c * g.h * g.w;
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
void LaunchMaxPool(const Window& g, const T* x, T* y, cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.oh * g.ow;
  if (total == 0) return;
  MaxPoolKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, x, y, nullptr);
}

template <typename T>
void LaunchMaxPoolGrad(const Window& g, const T* x, const T* dy, T* dx,
                       int64_t* argmax, cudaStream_t stream) {
  const int64_t outs = g.n * g.c * g.oh * g.ow;
  const int64_t ins = g.n * g.c * g.h * g.w;
  if (outs == 0 || ins == 0) return;
  MaxPoolKernel<T><<<BlocksFor(outs, kThreads), kThreads, 0, stream>>>(
      g, x, nullptr, argmax);
  MaxPoolGradKernel<T><<<BlocksFor(ins, kThreads), kThreads, 0, stream>>>(
      g, argmax, dy, dx);
}

template <typename T>
void LaunchAdaptiveAvgPool(const Window& g, const T* x, T* y,
                           cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.oh * g.ow;
  if (total == 0) return;
  AdaptivePoolKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, x, y);
}

template <typename T>
void LaunchAdaptiveAvgPoolGrad(const Window& g, const T* dy, T* dx,
                               cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.h * g.w;
  if (total == 0 || g.oh * g.ow == 0) return;
  AdaptivePoolGradKernel<T>
      <<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(g, dy, dx);
}

#define HAP_INSTANTIATE_CONVOLUTION(T)                                       \
  template void LaunchIm2Col<T>(const Window&, const T*, int64_t, int64_t,  \
                                int64_t, T*, cudaStream_t);                  \
  template void LaunchCol2Im<T>(const Window&, const T*, int64_t, int64_t,  \
                                int64_t, T*, cudaStream_t);                  \
  template void LaunchAddBias<T>(const T*, int64_t, int64_t, int64_t, T*,    \
                                 cudaStream_t);                              \
  template void LaunchChannelsFirst<T>(const T*, int64_t, int64_t, int64_t,  \
                                       T*, cudaStream_t);                    \
  template void LaunchBiasGrad<T>(const T*, int64_t, int64_t, int64_t, T*,   \
                                  cudaStream_t);                             \
  template void LaunchMaxPool<T>(const Window&, const T*, T*, cudaStream_t); \
  template void LaunchMaxPoolGrad<T>(const Window&, const T*, const T*, T*,  \
                                     int64_t*, cudaStream_t);                \
  template void LaunchAdaptiveAvgPool<T>(const Window&, const T*, T*,       \
                                         cudaStream_t);                      \
  template void LaunchAdaptiveAvgPoolGrad<T>(const Window&, const T*, T*,   \
                                             cudaStream_t);
HAP_INSTANTIATE_CONVOLUTION(float)
HAP_INSTANTIATE_CONVOLUTION(double)

}  // namespace hap::executor::cuda
