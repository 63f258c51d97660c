// Internal to executor/cuda: launchers of the batch_norm kernels
// (kernels_batch_norm.cu), the arithmetic of executor/cpu/kernels_batch_norm.cc:
// x viewed as [n, c, s], per-channel sums in double (one block a channel,
// a fixed reduction order: deterministic). Every launcher enqueues on
// `stream` and returns; launch errors are read by CheckLaunch. T is float or
// double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_BATCH_NORM_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_BATCH_NORM_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace hap::executor::cuda {

struct BatchNormShape {
  int64_t n = 0, c = 0, s = 0;
  double count = 1;  // elements per channel of the whole (global) batch
  double eps = 1e-5, momentum = 0.1;
};

// sums[ch] = sum x, sums[c + ch] = sum x^2 over channel ch.
template <typename T>
void LaunchBatchNormSums(const BatchNormShape& g, const T* x, double* sums,
                         cudaStream_t stream);
// y = (x - mean) * invstd * gamma + beta from the (global) sums; when not
// null, rm and rv move towards the batch mean and unbiased variance.
template <typename T>
void LaunchBatchNormApply(const BatchNormShape& g, const T* x, const T* gamma,
                          const T* beta, const double* sums, T* y, T* rm,
                          T* rv, cudaStream_t stream);
// gsums[ch] = sum dy, gsums[c + ch] = sum dy * xhat over channel ch.
template <typename T>
void LaunchBatchNormGradSums(const BatchNormShape& g, const T* x, const T* dy,
                             const double* sums, double* gsums,
                             cudaStream_t stream);
// dx += gamma * invstd * (dy - gsums[ch] / N - xhat * gsums[c + ch] / N)
// with the global gradient sums.
template <typename T>
void LaunchBatchNormDx(const BatchNormShape& g, const T* x, const T* gamma,
                       const T* dy, const double* sums, const double* gsums,
                       T* dx, cudaStream_t stream);
// dgamma += local_gsums[c + ch], dbeta += local_gsums[ch] (either may be
// null).
template <typename T>
void LaunchBatchNormAffineGrad(int64_t c, const double* local_gsums, T* dgamma,
                               T* dbeta, cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_BATCH_NORM_H_
