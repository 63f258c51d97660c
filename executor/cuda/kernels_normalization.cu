// Device code of the normalization kernels (launch_normalization.h).
#include <cmath>
#include <type_traits>

#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/launch_normalization.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::MaxOp;
using dev::SumOp;

// Threads (columns) of a parameter-gradient block, and the partial-sum
// chunks aimed at.
constexpr int kCols = 256;
constexpr int64_t kTargetBlocks = 1024;

unsigned RowBlocks(int64_t rows) { return BlocksFor(rows, 1); }

// Calls launch(std::integral_constant<int, B>()) with the row block size B
// for rows of `cols` elements: short rows leave fewer threads idle.
template <typename F>
void WithRowBlock(int64_t cols, F launch) {
  if (cols <= 64) {
    launch(std::integral_constant<int, 64>());
  } else if (cols <= 256) {
    launch(std::integral_constant<int, 128>());
  } else {
    launch(std::integral_constant<int, 256>());
  }
}

// --- layer_norm --------------------------------------------------------------

// Mean and 1 / sqrt(var + eps) of a row, on every thread of the block.
template <typename T, int kBlock, typename R>
__device__ void RowStats(const T* xr, int64_t d, double eps,
                         typename R::Storage& s, T* mean_out, T* rstd_out) {
  T sum = T(0);
  for (int64_t j = threadIdx.x; j < d; j += kBlock) sum += xr[j];
  const T mean = R::Run(sum, SumOp(), s) / static_cast<T>(d);
  T sq = T(0);
  for (int64_t j = threadIdx.x; j < d; j += kBlock) {
    const T c = xr[j] - mean;
    sq += c * c;
  }
  const T var = R::Run(sq, SumOp(), s) / static_cast<T>(d);
  *mean_out = mean;
  *rstd_out = T(1) / sqrt(var + static_cast<T>(eps));
}

template <typename T, int kBlock>
__global__ void LayerNormKernel(const T* x, const T* gamma, const T* beta,
                                int64_t rows, int64_t d, double eps, T* y) {
  using R = dev::BlockAll<T, kBlock>;
  __shared__ typename R::Storage s;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    T mean, rstd;
    RowStats<T, kBlock, R>(xr, d, eps, s, &mean, &rstd);
    for (int64_t j = threadIdx.x; j < d; j += kBlock) {
      yr[j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
    }
  }
}

// Per row: the statistics (for the parameter gradients, when `stats` is not
// null) and dx (when not null).
template <typename T, int kBlock>
__global__ void LayerNormGradRowKernel(const T* x, const T* gamma, const T* dy,
                                       int64_t rows, int64_t d, double eps,
                                       T* dx, T* stats) {
  using R = dev::BlockAll<T, kBlock>;
  __shared__ typename R::Storage s;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T mean, rstd;
    RowStats<T, kBlock, R>(xr, d, eps, s, &mean, &rstd);
    if (stats != nullptr && threadIdx.x == 0) {
      stats[2 * r] = mean;
      stats[2 * r + 1] = rstd;
    }
    if (dx == nullptr) continue;  // uniform over the block
    const T* dyr = dy + r * d;
    T sg = T(0), sgx = T(0);
    for (int64_t j = threadIdx.x; j < d; j += kBlock) {
      const T g = dyr[j] * gamma[j];
      sg += g;
      sgx += g * ((xr[j] - mean) * rstd);
    }
    const T mg = R::Run(sg, SumOp(), s) / static_cast<T>(d);
    const T mgx = R::Run(sgx, SumOp(), s) / static_cast<T>(d);
    T* dxr = dx + r * d;
    for (int64_t j = threadIdx.x; j < d; j += kBlock) {
      const T g = dyr[j] * gamma[j];
      const T xhat = (xr[j] - mean) * rstd;
      dxr[j] += rstd * (g - mg - xhat * mgx);
    }
  }
}

// partial[(c * 2 + 0) * d + j] = sum over chunk c's rows of dy * xhat,
// partial[(c * 2 + 1) * d + j] = sum of dy; block (column tile, chunk).
template <typename T>
__global__ void LayerNormParamPartialKernel(const T* x, const T* dy,
                                            const T* stats, int64_t rows,
                                            int64_t d, int64_t rows_per_chunk,
                                            T* partial) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  const int64_t c = blockIdx.y;
  if (j >= d) return;
  const int64_t r0 = c * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  T sg = T(0), sb = T(0);
  for (int64_t r = r0; r < r1; ++r) {
    const T g = dy[r * d + j];
    sg += g * ((x[r * d + j] - stats[2 * r]) * stats[2 * r + 1]);
    sb += g;
  }
  partial[(c * 2) * d + j] = sg;
  partial[(c * 2 + 1) * d + j] = sb;
}

template <typename T>
__global__ void LayerNormParamSumKernel(const T* partial, int64_t chunks,
                                        int64_t d, T* dgamma, T* dbeta) {
  for (int64_t j = dev::GridStart(); j < d; j += dev::GridStep()) {
    T sg = T(0), sb = T(0);
    for (int64_t c = 0; c < chunks; ++c) {
      sg += partial[(c * 2) * d + j];
      sb += partial[(c * 2 + 1) * d + j];
    }
    if (dgamma != nullptr) dgamma[j] += sg;
    if (dbeta != nullptr) dbeta[j] += sb;
  }
}

struct Chunking {
  int64_t chunks = 1, rows_per_chunk = 1;
};

Chunking ParamChunks(int64_t rows, int64_t d) {
  const int64_t tiles = (d + kCols - 1) / kCols;
  int64_t chunks = (kTargetBlocks + tiles - 1) / tiles;
  if (chunks > rows) chunks = rows;
  if (chunks > 65535) chunks = 65535;  // gridDim.y
  if (chunks < 1) chunks = 1;
  Chunking c;
  c.rows_per_chunk = (rows + chunks - 1) / chunks;
  if (c.rows_per_chunk < 1) c.rows_per_chunk = 1;
  c.chunks = (rows + c.rows_per_chunk - 1) / c.rows_per_chunk;
  if (c.chunks < 1) c.chunks = 1;
  return c;
}

// --- softmax -----------------------------------------------------------------

__device__ inline int64_t MaskRowOffset(const StridedSpace& lead, int64_t r) {
  int64_t off = 0;
  for (int d = lead.rank - 1; d >= 0; --d) {
    off += (r % lead.shape[d]) * lead.stride[0][d];
    r /= lead.shape[d];
  }
  return off;
}

template <typename T, bool kLog, int kBlock>
__global__ void SoftmaxKernel(const T* x, const T* mask, StridedSpace lead,
                              int64_t col_stride, bool causal, int64_t square,
                              int64_t rows, int64_t cols, T* y) {
  using R = dev::BlockAll<T, kBlock>;
  __shared__ typename R::Storage s;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    const T* mr = mask != nullptr ? mask + MaskRowOffset(lead, r) : nullptr;
    const int64_t valid =
        causal ? (r % square + 1 < cols ? r % square + 1 : cols) : cols;
    auto value = [&](int64_t j) {
      return mr != nullptr ? xr[j] + mr[j * col_stride] : xr[j];
    };
    T mx = -static_cast<T>(INFINITY);
    for (int64_t j = threadIdx.x; j < valid; j += kBlock) {
      const T v = value(j);
      mx = v > mx ? v : mx;
    }
    mx = R::Run(mx, MaxOp(), s);
    T sum = T(0);
    if constexpr (kLog) {
      for (int64_t j = threadIdx.x; j < valid; j += kBlock) {
        sum += exp(value(j) - mx);
      }
      const T lse = mx + log(R::Run(sum, SumOp(), s));
      for (int64_t j = threadIdx.x; j < valid; j += kBlock) {
        yr[j] = value(j) - lse;
      }
    } else {
      for (int64_t j = threadIdx.x; j < valid; j += kBlock) {
        const T e = exp(value(j) - mx);
        yr[j] = e;
        sum += e;
      }
      const T inv = T(1) / R::Run(sum, SumOp(), s);
      // Each thread rescales the columns it wrote.
      for (int64_t j = threadIdx.x; j < valid; j += kBlock) yr[j] *= inv;
    }
    for (int64_t j = valid + threadIdx.x; j < cols; j += kBlock) yr[j] = T(0);
  }
}

template <typename T, bool kLog, int kBlock>
__global__ void SoftmaxGradKernel(const T* y, const T* dy, int64_t rows,
                                  int64_t cols, T* dx) {
  using R = dev::BlockAll<T, kBlock>;
  __shared__ typename R::Storage s;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    T part = T(0);
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      part += kLog ? dyr[j] : dyr[j] * yr[j];
    }
    const T sum = R::Run(part, SumOp(), s);
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      if constexpr (kLog) {
        dxr[j] += dyr[j] - exp(yr[j]) * sum;
      } else {
        dxr[j] += yr[j] * (dyr[j] - sum);
      }
    }
  }
}

}  // namespace

template <typename T>
void LaunchLayerNorm(const T* x, const T* gamma, const T* beta, int64_t rows,
                     int64_t d, double eps, T* y, cudaStream_t stream) {
  if (rows == 0 || d == 0) return;
  WithRowBlock(d, [&](auto block) {
    constexpr int kBlock = decltype(block)::value;
    LayerNormKernel<T, kBlock><<<RowBlocks(rows), kBlock, 0, stream>>>(
        x, gamma, beta, rows, d, eps, y);
  });
}

template <typename T>
size_t LayerNormGradScratchBytes(int64_t rows, int64_t d) {
  const Chunking c = ParamChunks(rows, d);
  return sizeof(T) * static_cast<size_t>(2 * rows + 2 * c.chunks * d);
}

template <typename T>
void LaunchLayerNormGrad(const T* x, const T* gamma, const T* dy, int64_t rows,
                         int64_t d, double eps, T* dx, T* dgamma, T* dbeta,
                         void* scratch, cudaStream_t stream) {
  if (rows == 0 || d == 0) return;
  const bool params = dgamma != nullptr || dbeta != nullptr;
  if (dx == nullptr && !params) return;
  T* stats = params ? static_cast<T*>(scratch) : nullptr;
  WithRowBlock(d, [&](auto block) {
    constexpr int kBlock = decltype(block)::value;
    LayerNormGradRowKernel<T, kBlock><<<RowBlocks(rows), kBlock, 0, stream>>>(
        x, gamma, dy, rows, d, eps, dx, stats);
  });
  if (!params) return;
  const Chunking c = ParamChunks(rows, d);
  T* partial = stats + 2 * rows;
  const dim3 grid(static_cast<unsigned>((d + kCols - 1) / kCols),
                  static_cast<unsigned>(c.chunks));
  LayerNormParamPartialKernel<T><<<grid, kCols, 0, stream>>>(
      x, dy, stats, rows, d, c.rows_per_chunk, partial);
  LayerNormParamSumKernel<T><<<BlocksFor(d, kCols), kCols, 0, stream>>>(
      partial, c.chunks, d, dgamma, dbeta);
}

template <typename T, bool kLog>
void LaunchSoftmax(const T* x, const SoftmaxMask& mask, int64_t rows,
                   int64_t cols, T* y, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  WithRowBlock(cols, [&](auto block) {
    constexpr int kBlock = decltype(block)::value;
    SoftmaxKernel<T, kLog, kBlock><<<RowBlocks(rows), kBlock, 0, stream>>>(
        x, static_cast<const T*>(mask.mask), mask.lead, mask.col_stride,
        mask.causal, mask.square, rows, cols, y);
  });
}

template <typename T, bool kLog>
void LaunchSoftmaxGrad(const T* y, const T* dy, int64_t rows, int64_t cols,
                       T* dx, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  WithRowBlock(cols, [&](auto block) {
    constexpr int kBlock = decltype(block)::value;
    SoftmaxGradKernel<T, kLog, kBlock>
        <<<RowBlocks(rows), kBlock, 0, stream>>>(y, dy, rows, cols, dx);
  });
}

#define HAP_INSTANTIATE_NORMALIZATION(T)                                       \
  template void LaunchLayerNorm<T>(const T*, const T*, const T*, int64_t,      \
                                   int64_t, double, T*, cudaStream_t);         \
  template size_t LayerNormGradScratchBytes<T>(int64_t, int64_t);              \
  template void LaunchLayerNormGrad<T>(const T*, const T*, const T*, int64_t,  \
                                       int64_t, double, T*, T*, T*, void*,     \
                                       cudaStream_t);                          \
  template void LaunchSoftmax<T, false>(const T*, const SoftmaxMask&, int64_t, \
                                        int64_t, T*, cudaStream_t);            \
  template void LaunchSoftmax<T, true>(const T*, const SoftmaxMask&, int64_t,  \
                                       int64_t, T*, cudaStream_t);             \
  template void LaunchSoftmaxGrad<T, false>(const T*, const T*, int64_t,       \
                                            int64_t, T*, cudaStream_t);        \
  template void LaunchSoftmaxGrad<T, true>(const T*, const T*, int64_t,        \
                                           int64_t, T*, cudaStream_t);
HAP_INSTANTIATE_NORMALIZATION(float)
HAP_INSTANTIATE_NORMALIZATION(double)

}  // namespace hap::executor::cuda
