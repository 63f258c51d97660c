// nll_loss and cross_entropy (launch_loss.h). One block per row for the
// log-sum-exp (max in T, the sum of exponentials in double, as the CPU);
// the row losses are then summed by one block in a fixed order.
#include <cstdint>

#include "executor/cuda/launch_loss.h"
#include "executor/cuda/grid.cuh"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::kThreads;

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }

// Block-wide combine of every thread's `v` (fixed order); every thread gets
// the result. `part` holds kThreads values.
template <typename V, typename C>
__device__ inline V BlockCombine(V v, V* part, C combine) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) {
      part[threadIdx.x] = combine(part[threadIdx.x], part[threadIdx.x + w]);
    }
    __syncthreads();
  }
  const V r = part[0];
  __syncthreads();  // part[] may be reused right after
  return r;
}

// log-sum-exp of row x[0, n) (n >= 1): max in T, sum in double.
template <typename T>
__device__ double RowLogSumExp(const T* x, int64_t n) {
  __shared__ T tpart[kThreads];
  __shared__ double dpart[kThreads];
  T mx = x[0];
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = x[j] > mx ? x[j] : mx;
  mx = BlockCombine<T>(mx, tpart, [](T a, T b) { return b > a ? b : a; });
  double s = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    s += static_cast<double>(Exp(static_cast<T>(x[j] - mx)));
  }
  s = BlockCombine<double>(s, dpart, [](double a, double b) { return a + b; });
  return static_cast<double>(mx) + log(s);
}

__device__ inline void Report(int* fault, int code) {
  if (fault != nullptr) atomicCAS(fault, 0, code);
}

// Row losses, one block per row (blockIdx.x strides over rows).
template <typename T, typename I>
__global__ void RowLossKernel(bool logits, LossShape s, const T* x,
                              const I* targets, double* row_loss) {
  for (int64_t i = blockIdx.x; i < s.rows; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    const bool valid = t >= 0 && t < s.classes;
    const T* row = x + i * s.classes;
    // Every thread of the block takes part in the log-sum-exp (it syncs).
    const double lse = logits && valid ? RowLogSumExp(row, s.classes) : 0.0;
    if (threadIdx.x == 0) {
      if (!valid) {
        Report(s.fault, s.fault_code);
        row_loss[i] = 0;
      } else {
        const double picked = static_cast<double>(row[t]);
        row_loss[i] = logits ? lse - picked : -picked;
      }
    }
  }
}

template <typename T>
__global__ void SumRowsKernel(const double* row_loss, int64_t rows,
                              double inv_rows, T* out) {
  __shared__ double part[kThreads];
  double v = 0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) v += row_loss[i];
  v = BlockCombine<double>(v, part, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) out[0] = static_cast<T>(v * inv_rows);
}

template <typename T, typename I>
__global__ void NllGradKernel(LossShape s, const I* targets, const T* dy,
                              T* dx) {
  const T scale = static_cast<T>(static_cast<double>(dy[0]) * s.inv_rows);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < s.rows; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t < 0 || t >= s.classes) {
      Report(s.fault, s.fault_code);
      continue;
    }
    dx[i * s.classes + t] -= scale;
  }
}

template <typename T, typename I>
__global__ void CrossEntropyGradKernel(LossShape s, const T* x,
                                       const I* targets, const T* dy, T* dx) {
  const double scale = static_cast<double>(dy[0]) * s.inv_rows;
  const T ts = static_cast<T>(scale);
  for (int64_t i = blockIdx.x; i < s.rows; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t < 0 || t >= s.classes) {  // uniform over the block
      if (threadIdx.x == 0) Report(s.fault, s.fault_code);
      continue;
    }
    const T* row = x + i * s.classes;
    T* drow = dx + i * s.classes;
    const T lse = static_cast<T>(RowLogSumExp(row, s.classes));
    for (int64_t j = threadIdx.x; j < s.classes; j += blockDim.x) {
      T v = drow[j] + ts * Exp(static_cast<T>(row[j] - lse));
      if (j == t) v -= ts;
      drow[j] = v;
    }
  }
}

// Row i's log-sum-exp over every rank's classes.
template <typename T>
__device__ double GlobalLse(const ShardedLossShape& s, const T* lse, int64_t i) {
  const int64_t rows = s.base.rows;
  double mx = static_cast<double>(lse[i]);
  for (int64_t r = 1; r < s.ranks; ++r) {
    const double v = static_cast<double>(lse[r * rows + i]);
    mx = v > mx ? v : mx;
  }
  double sum = 0;
  for (int64_t r = 0; r < s.ranks; ++r) {
    sum += exp(static_cast<double>(lse[r * rows + i]) - mx);
  }
  return mx + log(sum);
}

template <typename T>
__global__ void ShardedLseKernel(ShardedLossShape s, const T* x, T* out) {
  for (int64_t i = blockIdx.x; i < s.base.rows; i += gridDim.x) {
    // No classes here: contributes nothing to the row's sum.
    const double lse = s.base.classes > 0
                           ? RowLogSumExp(x + i * s.base.classes, s.base.classes)
                           : -INFINITY;
    if (threadIdx.x == 0) out[i] = static_cast<T>(lse);
  }
}

template <typename T, typename I>
__global__ void ShardedRowLossKernel(ShardedLossShape s, const T* x,
                                     const I* targets, const T* lse,
                                     double* row_loss) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < s.base.rows; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t < 0 || t >= s.vocab) {
      Report(s.base.fault, s.base.fault_code);
      row_loss[i] = 0;
      continue;
    }
    double v = s.rank == 0 ? GlobalLse(s, lse, i) : 0.0;
    const int64_t c = t - s.offset;
    if (c >= 0 && c < s.base.classes) v -= static_cast<double>(x[i * s.base.classes + c]);
    row_loss[i] = v;
  }
}

template <typename T, typename I>
__global__ void ShardedGradKernel(ShardedLossShape s, const T* x,
                                  const I* targets, const T* lse, const T* dy,
                                  T* dx) {
  const double scale = static_cast<double>(dy[0]) * s.base.inv_rows;
  const T ts = static_cast<T>(scale);
  for (int64_t i = blockIdx.x; i < s.base.rows; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t < 0 || t >= s.vocab) {  // uniform over the block
      if (threadIdx.x == 0) Report(s.base.fault, s.base.fault_code);
      continue;
    }
    const T whole = static_cast<T>(GlobalLse(s, lse, i));
    const T* row = x + i * s.base.classes;
    T* drow = dx + i * s.base.classes;
    const int64_t c = t - s.offset;
    for (int64_t j = threadIdx.x; j < s.base.classes; j += blockDim.x) {
      T v = drow[j] + ts * Exp(static_cast<T>(row[j] - whole));
      if (j == c) v -= ts;
      drow[j] = v;
    }
  }
}

}  // namespace

template <typename T, typename I>
void LaunchLossForward(bool logits, const LossShape& s, const T* x,
                       const I* targets, double* row_loss, T* out,
                       cudaStream_t stream) {
  if (s.rows > 0) {
    RowLossKernel<T, I><<<BlocksFor(s.rows, 1), kThreads, 0, stream>>>(
        logits, s, x, targets, row_loss);
  }
  SumRowsKernel<T><<<1, kThreads, 0, stream>>>(row_loss, s.rows, s.inv_rows,
                                               out);
}

template <typename T, typename I>
void LaunchLossBackward(bool logits, const LossShape& s, const T* x,
                        const I* targets, const T* dy, T* dx,
                        cudaStream_t stream) {
  if (s.rows <= 0) return;
  if (logits) {
    CrossEntropyGradKernel<T, I><<<BlocksFor(s.rows, 1), kThreads, 0, stream>>>(
        s, x, targets, dy, dx);
  } else {
    int64_t blocks = (s.rows + kThreads - 1) / kThreads;
    if (blocks > 65535LL * 16) blocks = 65535LL * 16;
    NllGradKernel<T, I><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        s, targets, dy, dx);
  }
}

template <typename T>
void LaunchShardedLse(const ShardedLossShape& s, const T* x, T* out,
                      cudaStream_t stream) {
  if (s.base.rows <= 0) return;
  ShardedLseKernel<T><<<BlocksFor(s.base.rows, 1), kThreads, 0, stream>>>(s, x, out);
}

template <typename T, typename I>
void LaunchShardedLossForward(const ShardedLossShape& s, const T* x,
                              const I* targets, const T* lse, double* row_loss,
                              T* out, cudaStream_t stream) {
  if (s.base.rows > 0) {
    int64_t blocks = (s.base.rows + kThreads - 1) / kThreads;
    if (blocks > 65535LL * 16) blocks = 65535LL * 16;
    ShardedRowLossKernel<T, I><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        s, x, targets, lse, row_loss);
  }
  SumRowsKernel<T><<<1, kThreads, 0, stream>>>(row_loss, s.base.rows,
                                               s.base.inv_rows, out);
}

template <typename T, typename I>
void LaunchShardedLossBackward(const ShardedLossShape& s, const T* x,
                               const I* targets, const T* lse, const T* dy,
                               T* dx, cudaStream_t stream) {
  if (s.base.rows <= 0 || s.base.classes <= 0) return;
  ShardedGradKernel<T, I><<<BlocksFor(s.base.rows, 1), kThreads, 0, stream>>>(
      s, x, targets, lse, dy, dx);
}

template void LaunchShardedLse<float>(const ShardedLossShape&, const float*, float*,
                                      cudaStream_t);
template void LaunchShardedLse<double>(const ShardedLossShape&, const double*,
                                       double*, cudaStream_t);

#define HAP_INSTANTIATE(T, I)                                                 \
  template void LaunchLossForward<T, I>(bool, const LossShape&, const T*,     \
                                        const I*, double*, T*, cudaStream_t); \
  template void LaunchLossBackward<T, I>(bool, const LossShape&, const T*,    \
                                         const I*, const T*, T*, cudaStream_t); \
  template void LaunchShardedLossForward<T, I>(                               \
      const ShardedLossShape&, const T*, const I*, const T*, double*, T*,     \
      cudaStream_t);                                                          \
  template void LaunchShardedLossBackward<T, I>(                              \
      const ShardedLossShape&, const T*, const I*, const T*, const T*, T*,    \
      cudaStream_t);
HAP_INSTANTIATE(float, int32_t)
HAP_INSTANTIATE(float, int64_t)
HAP_INSTANTIATE(double, int32_t)
HAP_INSTANTIATE(double, int64_t)
#undef HAP_INSTANTIATE

}  // namespace hap::executor::cuda
