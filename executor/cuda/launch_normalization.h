// Internal to executor/cuda: launchers of the normalization kernels
// (kernels_normalization.cu): layer_norm, softmax and log_softmax over the
// last dimension, and their gradients. One block reduces one row, in float
// for float tensors and double for double ones, in a fixed order
// (deterministic). Every launcher enqueues on `stream` and returns; launch
// errors are read by CheckLaunch. T is float or double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_NORMALIZATION_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_NORMALIZATION_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "executor/cuda/launch_common.h"

namespace hap::executor::cuda {

// y = (x - mean) * rstd * gamma + beta per row of d, rstd = 1 / sqrt(var +
// eps) (biased variance).
template <typename T>
void LaunchLayerNorm(const T* x, const T* gamma, const T* beta, int64_t rows,
                     int64_t d, double eps, T* y, cudaStream_t stream);

// Scratch bytes of LaunchLayerNormGrad (row statistics and per-chunk
// partial sums of the parameter gradients).
template <typename T>
size_t LayerNormGradScratchBytes(int64_t rows, int64_t d);

// dx += rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma;
// dgamma += sum over rows of dy * xhat; dbeta += sum over rows of dy. Null
// outputs are skipped. The parameter sums are two-stage (fixed row chunks,
// then the chunks in order), so they are deterministic.
template <typename T>
void LaunchLayerNormGrad(const T* x, const T* gamma, const T* dy, int64_t rows,
                         int64_t d, double eps, T* dx, T* dgamma, T* dbeta,
                         void* scratch, cudaStream_t stream);

// How softmax masks a row (executor/cpu/kernels_normalization.cc): an
// additive mask broadcast to x, and the causal rule (row i of the last two
// dimensions keeps columns j <= i).
struct SoftmaxMask {
  const void* mask = nullptr;  // T*, or null
  // Row r of x (over x's leading dims) reads mask row sum_d idx_d *
  // lead.stride[0][d] (idx: r decomposed over lead.shape).
  StridedSpace lead;
  int64_t col_stride = 0;
  bool causal = false;
  int64_t square = 1;  // x's second-to-last dim (causal)
};

// y = softmax (kLog false) or log_softmax of each row (+ mask row) over its
// valid columns; the other columns get 0.
template <typename T, bool kLog>
void LaunchSoftmax(const T* x, const SoftmaxMask& mask, int64_t rows,
                   int64_t cols, T* y, cudaStream_t stream);

// softmax: dx += y * (dy - sum(dy * y)); log_softmax: dx += dy - exp(y) *
// sum(dy), per row.
template <typename T, bool kLog>
void LaunchSoftmaxGrad(const T* y, const T* dy, int64_t rows, int64_t cols,
                       T* dx, cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_NORMALIZATION_H_
