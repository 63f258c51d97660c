// Device code of the batch_norm kernels (launch_batch_norm.h).
#include <cmath>

#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/launch_batch_norm.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;

constexpr int kBlock = 256;  // threads of a channel's reduction

struct Stats {
  double mean, var, invstd;
};
__device__ inline Stats ChannelStats(const BatchNormShape& g, const double* sums,
                                     int64_t ch) {
  Stats s;
  s.mean = sums[ch] / g.count;
  const double v = sums[g.c + ch] / g.count - s.mean * s.mean;
  s.var = v > 0 ? v : 0;
  s.invstd = 1.0 / sqrt(s.var + g.eps);
  return s;
}

// Element k of channel ch (k < n * s) as an offset into x.
__device__ inline int64_t At(const BatchNormShape& g, int64_t ch, int64_t k) {
  const int64_t m = k / g.s;
  return (m * g.c + ch) * g.s + (k - m * g.s);
}

// One block per channel: the sums of f(x, dy) and h(x, dy) over it.
template <typename T, bool kGrad>
__global__ void SumsKernel(BatchNormShape g, const T* x, const T* dy,
                           const double* sums, double* out) {
  using Reduce = cub::BlockReduce<double, kBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t ch = blockIdx.x;
  const int64_t per_channel = g.n * g.s;
  Stats st = {0, 0, 0};
  if (kGrad) st = ChannelStats(g, sums, ch);
  double a = 0, b = 0;
  for (int64_t k = threadIdx.x; k < per_channel; k += kBlock) {
    const int64_t o = At(g, ch, k);
    const double v = static_cast<double>(x[o]);
    if (kGrad) {
      const double d = static_cast<double>(dy[o]);
      a += d;
      b += d * (v - st.mean) * st.invstd;
    } else {
      a += v;
      b += v * v;
    }
  }
  const double ra = Reduce(tmp).Sum(a);
  __syncthreads();
  const double rb = Reduce(tmp).Sum(b);
  if (threadIdx.x == 0) {
    out[ch] = ra;
    out[g.c + ch] = rb;
  }
}

template <typename T>
__global__ void ApplyKernel(BatchNormShape g, const T* x, const T* gamma,
                            const T* beta, const double* sums, T* y) {
  const int64_t total = g.n * g.c * g.s;
  for (int64_t i = GridStart(); i < total; i += GridStep()) {
    const int64_t ch = (i / g.s) % g.c;
    const Stats st = ChannelStats(g, sums, ch);
    const double scale = st.invstd * static_cast<double>(gamma[ch]);
    const double shift = static_cast<double>(beta[ch]) - st.mean * scale;
    y[i] = static_cast<T>(static_cast<double>(x[i]) * scale + shift);
  }
}

template <typename T>
__global__ void RunningKernel(BatchNormShape g, const double* sums, T* rm,
                              T* rv) {
  const double unbias = g.count > 1 ? g.count / (g.count - 1) : 1.0;
  for (int64_t ch = GridStart(); ch < g.c; ch += GridStep()) {
    const Stats st = ChannelStats(g, sums, ch);
    if (rm != nullptr) {
      rm[ch] = static_cast<T>((1 - g.momentum) * static_cast<double>(rm[ch]) +
                              g.momentum * st.mean);
    }
    if (rv != nullptr) {
      rv[ch] = static_cast<T>((1 - g.momentum) * static_cast<double>(rv[ch]) +
                              g.momentum * st.var * unbias);
    }
  }
}

template <typename T>
__global__ void DxKernel(BatchNormShape g, const T* x, const T* gamma,
                         const T* dy, const double* sums, const double* gsums,
                         T* dx) {
  const int64_t total = g.n * g.c * g.s;
  for (int64_t i = GridStart(); i < total; i += GridStep()) {
    const int64_t ch = (i / g.s) % g.c;
    const Stats st = ChannelStats(g, sums, ch);
    const double xhat = (static_cast<double>(x[i]) - st.mean) * st.invstd;
    const double k = st.invstd * static_cast<double>(gamma[ch]);
    dx[i] += static_cast<T>(k * (static_cast<double>(dy[i]) - gsums[ch] / g.count -
                                 xhat * gsums[g.c + ch] / g.count));
  }
}

template <typename T>
__global__ void AffineGradKernel(int64_t c, const double* gsums, T* dgamma,
                                 T* dbeta) {
  for (int64_t ch = GridStart(); ch < c; ch += GridStep()) {
    if (dgamma != nullptr) dgamma[ch] += static_cast<T>(gsums[c + ch]);
    if (dbeta != nullptr) dbeta[ch] += static_cast<T>(gsums[ch]);
  }
}

}  // namespace

template <typename T>
void LaunchBatchNormSums(const BatchNormShape& g, const T* x, double* sums,
                         cudaStream_t stream) {
  if (g.c == 0) return;
  SumsKernel<T, false><<<static_cast<unsigned>(g.c), kBlock, 0, stream>>>(
      g, x, nullptr, nullptr, sums);
}

template <typename T>
void LaunchBatchNormApply(const BatchNormShape& g, const T* x, const T* gamma,
                          const T* beta, const double* sums, T* y, T* rm,
                          T* rv, cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.s;
  if (total > 0) {
    ApplyKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
        g, x, gamma, beta, sums, y);
  }
  if (g.c > 0 && (rm != nullptr || rv != nullptr)) {
    RunningKernel<T><<<BlocksFor(g.c, kThreads), kThreads, 0, stream>>>(
        g, sums, rm, rv);
  }
}

template <typename T>
void LaunchBatchNormGradSums(const BatchNormShape& g, const T* x, const T* dy,
                             const double* sums, double* gsums,
                             cudaStream_t stream) {
  if (g.c == 0) return;
  SumsKernel<T, true><<<static_cast<unsigned>(g.c), kBlock, 0, stream>>>(
      g, x, dy, sums, gsums);
}

template <typename T>
void LaunchBatchNormDx(const BatchNormShape& g, const T* x, const T* gamma,
                       const T* dy, const double* sums, const double* gsums,
                       T* dx, cudaStream_t stream) {
  const int64_t total = g.n * g.c * g.s;
  if (total == 0) return;
  DxKernel<T><<<BlocksFor(total, kThreads), kThreads, 0, stream>>>(
      g, x, gamma, dy, sums, gsums, dx);
}

template <typename T>
void LaunchBatchNormAffineGrad(int64_t c, const double* local_gsums, T* dgamma,
                               T* dbeta, cudaStream_t stream) {
  if (c == 0 || (dgamma == nullptr && dbeta == nullptr)) return;
  AffineGradKernel<T><<<BlocksFor(c, kThreads), kThreads, 0, stream>>>(
      c, local_gsums, dgamma, dbeta);
}

#define HAP_INSTANTIATE_BATCH_NORM(T)                                          \
  template void LaunchBatchNormSums<T>(const BatchNormShape&, const T*,        \
                                       double*, cudaStream_t);                 \
  template void LaunchBatchNormApply<T>(const BatchNormShape&, const T*,       \
                                        const T*, const T*, const double*, T*, \
                                        T*, T*, cudaStream_t);                 \
  template void LaunchBatchNormGradSums<T>(const BatchNormShape&, const T*,    \
                                           const T*, const double*, double*,   \
                                           cudaStream_t);                      \
  template void LaunchBatchNormDx<T>(const BatchNormShape&, const T*,          \
                                     const T*, const T*, const double*,        \
                                     const double*, T*, cudaStream_t);         \
  template void LaunchBatchNormAffineGrad<T>(int64_t, const double*, T*, T*,   \
                                             cudaStream_t);
HAP_INSTANTIATE_BATCH_NORM(float)
HAP_INSTANTIATE_BATCH_NORM(double)

}  // namespace hap::executor::cuda
