// Internal to executor/cuda: launchers of the convolution and pooling
// kernels over NCHW images (kernels_convolution.cu). conv2d itself is im2col
// + cuBLAS (kernels_convolution.cc); these are its data movement, bias, and
// the pooling ops. Adjoint scatters are written as gathers (each output
// element sums its own contributions in a fixed order): no atomics,
// deterministic. Every launcher enqueues on `stream` and returns; launch
// errors are read by CheckLaunch. T is float or double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_CONVOLUTION_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_CONVOLUTION_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/cpu/pool_window.h"

namespace hap::executor::cuda {

// The geometry of a sliding window, the CPU's (executor/cpu/pool_window.h):
// a depth axis for conv3d, of size 1 for the 2-D ops.
using Window = pool::Window;

// The im2col (vol2col) matrix of `images` images starting at x:
//   col[row * row_stride + m * image_stride + (oz * oh + oy) * ow + ox] =
//     x_m[ch][oz*sd - pd + t*dd][oy*sh - ph + i*dh][ox*sw - pw + j*dw]
// (0 in the padding), row = ((ch * kd + t) * kh + i) * kw + j. With op =
// od*oh*ow, row_stride = images * op and image_stride = op give one
// [c*taps, images*op] matrix; row_stride = op and image_stride = c*taps*op
// one matrix an image.
template <typename T>
void LaunchIm2Col(const Window& g, const T* x, int64_t images,
                  int64_t row_stride, int64_t image_stride, T* col,
                  cudaStream_t stream);

// The adjoint of LaunchIm2Col: dx_m += the col entries that read each
// element (same layout arguments).
template <typename T>
void LaunchCol2Im(const Window& g, const T* col, int64_t images,
                  int64_t row_stride, int64_t image_stride, T* dx,
                  cudaStream_t stream);

// y[m][ch][p] += bias[ch] for m < images, p < plane.
template <typename T>
void LaunchAddBias(const T* bias, int64_t images, int64_t channels,
                   int64_t plane, T* y, cudaStream_t stream);

// dst[ch][m * plane + p] = src[m][ch][p]: images side by side per channel.
template <typename T>
void LaunchChannelsFirst(const T* src, int64_t images, int64_t channels,
                         int64_t plane, T* dst, cudaStream_t stream);

// db[ch] += sum over m < images, p < plane of dy[m][ch][p].
template <typename T>
void LaunchBiasGrad(const T* dy, int64_t images, int64_t channels,
                    int64_t plane, T* db, cudaStream_t stream);

// Grouped (depthwise) conv2d and conv3d, direct (kernels_b_index.h GroupedConv*):
// y = conv + bias (bias may be null); dx += and dw += (either may be null).
template <typename T>
void LaunchGroupedConv(const Window& g, int64_t groups, int64_t o, const T* x,
                       const T* w, const T* bias, T* y, cudaStream_t stream);
template <typename T>
void LaunchGroupedConvGrad(const Window& g, int64_t groups, int64_t o,
                           const T* x, const T* w, const T* dy, T* dx, T* dw,
                           cudaStream_t stream);

// max_pool2d / max_pool3d over every (n, c) plane: padding reads as -inf, the first
// maximum in scan order (a NaN wins) is the window's value.
template <typename T>
void LaunchMaxPool(const Window& g, const T* x, T* y, cudaStream_t stream);

// dx[first maximum of each window] += dy; `argmax` is scratch of
// n * c * od * oh * ow int64.
template <typename T>
void LaunchMaxPoolGrad(const Window& g, const T* x, const T* dy, T* dx,
                       int64_t* argmax, cudaStream_t stream);

// avg_pool2d / avg_pool3d (PyTorch's windows and divisors,
// executor/cpu/pool_window.h).
template <typename T>
void LaunchAvgPool(const Window& g, const T* x, T* y, cudaStream_t stream);
// dx += the adjoint of LaunchAvgPool applied to dy.
template <typename T>
void LaunchAvgPoolGrad(const Window& g, const T* dy, T* dx,
                       cudaStream_t stream);

// adaptive_avg_pool2d (PyTorch's windows: output i of `out` over `in`
// averages [floor(i * in / out), ceil((i + 1) * in / out))).
template <typename T>
void LaunchAdaptiveAvgPool(const Window& g, const T* x, T* y,
                           cudaStream_t stream);
template <typename T>
void LaunchAdaptiveAvgPoolGrad(const Window& g, const T* dy, T* dx,
                               cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_CONVOLUTION_H_
