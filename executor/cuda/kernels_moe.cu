// Device code of the mixture-of-experts kernels (launch_moe.h).
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/kernels_b_index.h"
#include "executor/cuda/launch_moe.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;

constexpr int kTokens = 128;  // threads of the per-token kernels
constexpr int kScan = 256;    // threads of the scanning kernels

// --- moe_gate ----------------------------------------------------------------

// One thread per token (TopK).
template <typename T>
__global__ void GateTopKKernel(GateDims d, const T* logits, int32_t* expert) {
  for (int64_t t = GridStart(); t < d.tokens; t += GridStep()) {
    const TokenSoftmax<T> s(logits + t * d.experts, d.experts);
    TopK(s, d.experts, d.k, expert + t * d.k);
  }
}

// One block per expert: scans the tokens in order; the i-th token routed to
// the expert takes slot i while i < capacity.
__global__ void GateSlotsKernel(GateDims d, const int32_t* expert,
                                int32_t* slot) {
  using Scan = cub::BlockScan<int, kScan>;
  __shared__ typename Scan::TempStorage tmp;
  for (int64_t e = blockIdx.x; e < d.experts; e += gridDim.x) {
    int64_t filled = 0;
    for (int64_t base = 0; base < d.tokens; base += kScan) {
      const int64_t t = base + threadIdx.x;
      int64_t choice = -1;
      if (t < d.tokens) {
        for (int64_t j = 0; j < d.k; ++j) {
          if (expert[t * d.k + j] == e) choice = j;
        }
      }
      int rank = 0, count = 0;
      Scan(tmp).ExclusiveSum(choice >= 0 ? 1 : 0, rank, count);
      if (choice >= 0) {
        const int64_t s = filled + rank;
        slot[t * d.k + choice] =
            s < d.capacity ? static_cast<int32_t>(s) : int32_t{-1};
      }
      filled += count;
      __syncthreads();  // tmp is reused
    }
  }
}

// The sum of a token's top-k probabilities, in pick order.
template <typename T>
__device__ double TopSum(const GateDims& d, const TokenSoftmax<T>& s,
                         const int32_t* ex) {
  double top = 0;
  for (int64_t j = 0; j < d.k; ++j) top += s.Prob(ex[j]);
  return top;
}

template <typename T>
__global__ void GateCombineKernel(GateDims d, const T* logits,
                                  const int32_t* expert, const int32_t* slot,
                                  T* combine) {
  for (int64_t t = GridStart(); t < d.tokens; t += GridStep()) {
    const TokenSoftmax<T> s(logits + t * d.experts, d.experts);
    const int32_t* ex = expert + t * d.k;
    const int32_t* sl = slot + t * d.k;
    const double top = TopSum(d, s, ex);
    for (int64_t j = 0; j < d.k; ++j) {
      if (sl[j] < 0) continue;
      const double p = s.Prob(ex[j]);
      combine[(t * d.experts + ex[j]) * d.capacity + sl[j]] =
          static_cast<T>(d.k > 1 ? p / top : p);
    }
  }
}

// w_j = p_j / S (k > 1, S the top-k sum) or p_j; then the softmax:
// dlogit_e += p_e (dp_e - sum_e' dp_e' p_e').
template <typename T>
__global__ void GateGradKernel(GateDims d, const T* logits, const T* dcombine,
                               const int32_t* expert, const int32_t* slot,
                               T* dlogits) {
  for (int64_t t = GridStart(); t < d.tokens; t += GridStep()) {
    const TokenSoftmax<T> s(logits + t * d.experts, d.experts);
    const int32_t* ex = expert + t * d.k;
    const int32_t* sl = slot + t * d.k;
    const double top = TopSum(d, s, ex);
    auto gw = [&](int64_t j) -> double {
      return sl[j] >= 0
                 ? static_cast<double>(
                       dcombine[(t * d.experts + ex[j]) * d.capacity + sl[j]])
                 : 0.0;
    };
    double gw_dot_p = 0;
    for (int64_t j = 0; j < d.k; ++j) gw_dot_p += gw(j) * s.Prob(ex[j]);
    auto dp = [&](int64_t j) -> double {
      return d.k > 1 ? gw(j) / top - gw_dot_p / (top * top) : gw(j);
    };
    double dot = 0;
    for (int64_t j = 0; j < d.k; ++j) dot += dp(j) * s.Prob(ex[j]);
    T* dl = dlogits + t * d.experts;
    for (int64_t e = 0; e < d.experts; ++e) {
      double dpe = 0;
      for (int64_t j = 0; j < d.k; ++j) {
        if (ex[j] == e) dpe = dp(j);
      }
      dl[e] += static_cast<T>(s.Prob(e) * (dpe - dot));
    }
  }
}

// --- dispatch, combine -------------------------------------------------------

// One block per output row: the row's weights are scanned kScan at a time,
// the nonzero ones compacted in order into shared memory, and each thread
// adds their source rows into its own columns of the output row (so the
// order of the additions is the CPU's, and no two threads share an
// element).
template <typename T, bool kWeighted, bool kAccumulate>
__global__ void MoeGatherKernel(const T* weights, int64_t out_rows,
                                int64_t in_rows, int64_t w_row_stride,
                                int64_t w_col_stride, const T* src, int64_t d,
                                T* out) {
  using Scan = cub::BlockScan<int, kScan>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t rows[kScan];
  __shared__ T ws[kScan];
  for (int64_t r = blockIdx.x; r < out_rows; r += gridDim.x) {
    T* o = out + r * d;
    if constexpr (!kAccumulate) {
      for (int64_t j = threadIdx.x; j < d; j += kScan) o[j] = T(0);
    }
    for (int64_t base = 0; base < in_rows; base += kScan) {
      const int64_t i = base + threadIdx.x;
      T w = T(0);
      if (i < in_rows) w = weights[r * w_row_stride + i * w_col_stride];
      const int nonzero = w != T(0) ? 1 : 0;
      int pos = 0, count = 0;
      Scan(tmp).ExclusiveSum(nonzero, pos, count);
      if (nonzero) {
        rows[pos] = i;
        ws[pos] = w;
      }
      __syncthreads();
      for (int e = 0; e < count; ++e) {
        const T* s = src + rows[e] * d;
        const T we = ws[e];
        for (int64_t j = threadIdx.x; j < d; j += kScan) {
          if constexpr (kWeighted) {
            o[j] += we * s[j];
          } else {
            o[j] += s[j];
          }
        }
      }
      __syncthreads();  // rows, ws and tmp are reused
    }
  }
}

}  // namespace

template <typename T>
void LaunchGateRoute(const GateDims& d, const T* logits, int32_t* expert,
                     int32_t* slot, cudaStream_t stream) {
  if (d.tokens == 0 || d.experts == 0) return;
  GateTopKKernel<T>
      <<<BlocksFor(d.tokens, kTokens), kTokens, 0, stream>>>(d, logits, expert);
  GateSlotsKernel<<<BlocksFor(d.experts, 1), kScan, 0, stream>>>(d, expert,
                                                                 slot);
}

template <typename T>
void LaunchGateCombine(const GateDims& d, const T* logits,
                       const int32_t* expert, const int32_t* slot, T* combine,
                       cudaStream_t stream) {
  const int64_t n = d.tokens * d.experts * d.capacity;
  if (n == 0) return;
  cudaMemsetAsync(combine, 0, n * sizeof(T), stream);
  GateCombineKernel<T><<<BlocksFor(d.tokens, kTokens), kTokens, 0, stream>>>(
      d, logits, expert, slot, combine);
}

template <typename T>
void LaunchGateGrad(const GateDims& d, const T* logits, const T* dcombine,
                    const int32_t* expert, const int32_t* slot, T* dlogits,
                    cudaStream_t stream) {
  if (d.tokens == 0 || d.experts == 0) return;
  GateGradKernel<T><<<BlocksFor(d.tokens, kTokens), kTokens, 0, stream>>>(
      d, logits, dcombine, expert, slot, dlogits);
}

template <typename T>
void LaunchMoeGather(const T* weights, int64_t out_rows, int64_t in_rows,
                     int64_t w_row_stride, int64_t w_col_stride, const T* src,
                     int64_t d, bool weighted, bool accumulate, T* out,
                     cudaStream_t stream) {
  if (out_rows == 0 || d == 0) return;
  const unsigned blocks = BlocksFor(out_rows, 1);
#define HAP_GATHER(W, A)                                  \
  MoeGatherKernel<T, W, A><<<blocks, kScan, 0, stream>>>( \
      weights, out_rows, in_rows, w_row_stride, w_col_stride, src, d, out)
  if (weighted) {
    if (accumulate) {
      HAP_GATHER(true, true);
    } else {
      HAP_GATHER(true, false);
    }
  } else {
    if (accumulate) {
      HAP_GATHER(false, true);
    } else {
      HAP_GATHER(false, false);
    }
  }
#undef HAP_GATHER
}

#define HAP_INSTANTIATE_MOE(T)                                                 \
  template void LaunchGateRoute<T>(const GateDims&, const T*, int32_t*,        \
                                   int32_t*, cudaStream_t);                    \
  template void LaunchGateCombine<T>(const GateDims&, const T*,                \
                                     const int32_t*, const int32_t*, T*,       \
                                     cudaStream_t);                            \
  template void LaunchGateGrad<T>(const GateDims&, const T*, const T*,         \
                                  const int32_t*, const int32_t*, T*,          \
                                  cudaStream_t);                               \
  template void LaunchMoeGather<T>(const T*, int64_t, int64_t, int64_t,        \
                                   int64_t, const T*, int64_t, bool, bool, T*, \
                                   cudaStream_t);
HAP_INSTANTIATE_MOE(float)
HAP_INSTANTIATE_MOE(double)

}  // namespace hap::executor::cuda
