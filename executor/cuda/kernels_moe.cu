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

// One block per (group, expert): scans the group's tokens in order; the
// i-th token routed to the expert takes the group's slot i while
// i < group_capacity.
__global__ void GateSlotsKernel(GateDims d, const int32_t* expert,
                                int32_t* slot) {
  using Scan = cub::BlockScan<int, kScan>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t groups = d.tokens / d.group;
  for (int64_t b = blockIdx.x; b < d.experts * groups; b += gridDim.x) {
    const int64_t e = b % d.experts, q = b / d.experts;
    const int64_t first = q * d.group, end = first + d.group;
    const int64_t slot0 = (d.first_group + q) * d.group_capacity;
    int64_t filled = 0;
    for (int64_t base = first; base < end; base += kScan) {
      const int64_t t = base + threadIdx.x;
      int64_t choice = -1;
      if (t < end) {
        for (int64_t j = 0; j < d.k; ++j) {
          if (expert[t * d.k + j] == e) choice = j;
        }
      }
      int rank = 0, count = 0;
      Scan(tmp).ExclusiveSum(choice >= 0 ? 1 : 0, rank, count);
      if (choice >= 0) {
        const int64_t s = filled + rank;
        slot[t * d.k + choice] =
            s < d.group_capacity ? static_cast<int32_t>(slot0 + s) : int32_t{-1};
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

// One token's dl[e] += d loss / d logit e given gw(j) = d loss / d w_j:
// w_j = p_j / S (k > 1, S the top-k sum) or p_j; then the softmax:
// dlogit_e += p_e (dp_e - sum_e' dp_e' p_e').
template <typename T, typename GW>
__device__ void WeightsGrad(const GateDims& d, const TokenSoftmax<T>& s,
                            const int32_t* ex, GW gw, T* dl) {
  const double top = TopSum(d, s, ex);
  double gw_dot_p = 0;
  for (int64_t j = 0; j < d.k; ++j) gw_dot_p += gw(j) * s.Prob(ex[j]);
  auto dp = [&](int64_t j) -> double {
    return d.k > 1 ? gw(j) / top - gw_dot_p / (top * top) : gw(j);
  };
  double dot = 0;
  for (int64_t j = 0; j < d.k; ++j) dot += dp(j) * s.Prob(ex[j]);
  for (int64_t e = 0; e < d.experts; ++e) {
    double dpe = 0;
    for (int64_t j = 0; j < d.k; ++j) {
      if (ex[j] == e) dpe = dp(j);
    }
    dl[e] += static_cast<T>(s.Prob(e) * (dpe - dot));
  }
}

// Through the placed entries' weights (dropped ones get none).
template <typename T>
__global__ void GateGradKernel(GateDims d, const T* logits, const T* dcombine,
                               const int32_t* expert, const int32_t* slot,
                               T* dlogits) {
  for (int64_t t = GridStart(); t < d.tokens; t += GridStep()) {
    const TokenSoftmax<T> s(logits + t * d.experts, d.experts);
    const int32_t* ex = expert + t * d.k;
    const int32_t* sl = slot + t * d.k;
    auto gw = [&](int64_t j) -> double {
      return sl[j] >= 0
                 ? static_cast<double>(
                       dcombine[(t * d.experts + ex[j]) * d.capacity + sl[j]])
                 : 0.0;
    };
    WeightsGrad(d, s, ex, gw, dlogits + t * d.experts);
  }
}

// --- the compact form --------------------------------------------------------

__global__ void RouteSlotsKernel(GateDims d, const int32_t* expert,
                                 const int32_t* slot, int64_t* route) {
  for (int64_t i = GridStart(); i < d.tokens * d.k; i += GridStep()) {
    route[i] = slot[i] < 0 ? int64_t{-1}
                           : int64_t{expert[i]} * d.capacity + slot[i];
  }
}

template <typename T>
__global__ void RouteWeightsKernel(GateDims d, const T* logits,
                                   const int32_t* expert, T* w) {
  for (int64_t t = GridStart(); t < d.tokens; t += GridStep()) {
    const TokenSoftmax<T> s(logits + t * d.experts, d.experts);
    const int32_t* ex = expert + t * d.k;
    const double top = TopSum(d, s, ex);
    for (int64_t j = 0; j < d.k; ++j) {
      const double p = s.Prob(ex[j]);
      w[t * d.k + j] = static_cast<T>(d.k > 1 ? p / top : p);
    }
  }
}

template <typename T>
__global__ void RouteWeightsGradKernel(GateDims d, const T* logits,
                                       const T* dw, const int32_t* expert,
                                       T* dlogits) {
  for (int64_t t = GridStart(); t < d.tokens; t += GridStep()) {
    const TokenSoftmax<T> s(logits + t * d.experts, d.experts);
    auto gw = [&](int64_t j) -> double {
      return static_cast<double>(dw[t * d.k + j]);
    };
    WeightsGrad(d, s, expert + t * d.k, gw, dlogits + t * d.experts);
  }
}

__global__ void SlotEntriesKernel(IdxDims m, const int64_t* route,
                                  int64_t* slot_entry) {
  for (int64_t i = GridStart(); i < m.tokens * m.k; i += GridStep()) {
    if (route[i] < 0) continue;
    const int64_t s = LocalSlot(m, route, i);
    if (s >= 0) slot_entry[s] = i;
  }
}

// One thread per (slot, column): the slot's token row, or 0.
template <typename T>
__global__ void DispatchIdxKernel(IdxDims m, const int64_t* slot_entry,
                                  const T* x, T* out) {
  const int64_t n = m.experts * m.capacity * m.d;
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const int64_t e = slot_entry[i / m.d];
    out[i] = e < 0 ? T(0) : x[(e / m.k) * m.d + i % m.d];
  }
}

// One thread per (token, column): dx (+)= sum over the token's local slots
// of (weighted ? w : 1) * src[slot], the slots in ascending order as the CPU
// sums them; `weighted` for combine, not for dispatch's backward.
template <typename T, bool kWeighted, bool kAccumulate>
__global__ void TokenSumKernel(IdxDims m, const int64_t* route, const T* w,
                               const T* src, T* out) {
  const int64_t n = m.tokens * m.d;
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const int64_t t = i / m.d, c = i % m.d;
    T acc = kAccumulate ? out[i] : T(0);
    int64_t j = 0;
    for (int64_t s = NextTokenSlot(m, route, t, -1, &j); s >= 0;
         s = NextTokenSlot(m, route, t, s, &j)) {
      const T v = src[s * m.d + c];
      if constexpr (kWeighted) {
        acc += w[t * m.k + j] * v;
      } else {
        acc += v;
      }
    }
    out[i] = acc;
  }
}

// dy[s] += w * dout[t] for the token in slot s, one thread per (slot,
// column).
template <typename T>
__global__ void CombineIdxGradYKernel(IdxDims m, const int64_t* slot_entry,
                                      const T* w, const T* dout, T* dy) {
  const int64_t n = m.experts * m.capacity * m.d;
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const int64_t e = slot_entry[i / m.d];
    if (e >= 0) dy[i] += w[e] * dout[(e / m.k) * m.d + i % m.d];
  }
}

// dw[t, j] += dout[t] . y[s] for the entries placed here, one thread each.
template <typename T>
__global__ void CombineIdxGradWKernel(IdxDims m, const int64_t* route,
                                      const T* y, const T* dout, T* dw) {
  for (int64_t i = GridStart(); i < m.tokens * m.k; i += GridStep()) {
    if (route[i] < 0) continue;
    const int64_t s = LocalSlot(m, route, i);
    if (s < 0) continue;
    const T* go = dout + (i / m.k) * m.d;
    const T* ys = y + s * m.d;
    T dot = 0;
    for (int64_t c = 0; c < m.d; ++c) dot += go[c] * ys[c];
    dw[i] += dot;
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
  GateSlotsKernel<<<BlocksFor(d.experts * (d.tokens / d.group), 1), kScan, 0, stream>>>(
      d, expert, slot);
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

template <typename T>
void LaunchGateTopK(const GateDims& d, const T* logits, int32_t* expert,
                    cudaStream_t stream) {
  if (d.tokens == 0 || d.experts == 0) return;
  GateTopKKernel<T>
      <<<BlocksFor(d.tokens, kTokens), kTokens, 0, stream>>>(d, logits, expert);
}

void LaunchRouteSlots(const GateDims& d, const int32_t* expert,
                      const int32_t* slot, int64_t* route,
                      cudaStream_t stream) {
  if (d.tokens * d.k == 0) return;
  RouteSlotsKernel<<<BlocksFor(d.tokens * d.k, kTokens), kTokens, 0,
                     stream>>>(d, expert, slot, route);
}

template <typename T>
void LaunchRouteWeights(const GateDims& d, const T* logits,
                        const int32_t* expert, T* w, cudaStream_t stream) {
  if (d.tokens == 0) return;
  RouteWeightsKernel<T><<<BlocksFor(d.tokens, kTokens), kTokens, 0, stream>>>(
      d, logits, expert, w);
}

template <typename T>
void LaunchRouteWeightsGrad(const GateDims& d, const T* logits, const T* dw,
                            const int32_t* expert, T* dlogits,
                            cudaStream_t stream) {
  if (d.tokens == 0) return;
  RouteWeightsGradKernel<T><<<BlocksFor(d.tokens, kTokens), kTokens, 0,
                              stream>>>(d, logits, dw, expert, dlogits);
}

void LaunchSlotEntries(const IdxDims& m, const int64_t* route,
                       int64_t* slot_entry, cudaStream_t stream) {
  const int64_t slots = m.experts * m.capacity;
  if (slots == 0) return;
  cudaMemsetAsync(slot_entry, 0xff, slots * sizeof(int64_t), stream);  // -1
  if (m.tokens * m.k == 0) return;
  SlotEntriesKernel<<<BlocksFor(m.tokens * m.k, kTokens), kTokens, 0,
                      stream>>>(m, route, slot_entry);
}

template <typename T>
void LaunchDispatchIdx(const IdxDims& m, const int64_t* slot_entry,
                       const T* x, T* out, cudaStream_t stream) {
  const int64_t n = m.experts * m.capacity * m.d;
  if (n == 0) return;
  DispatchIdxKernel<T><<<BlocksFor(n, kScan), kScan, 0, stream>>>(
      m, slot_entry, x, out);
}

template <typename T>
void LaunchTokenSum(const IdxDims& m, const int64_t* route, const T* w,
                    const T* src, bool accumulate, T* out,
                    cudaStream_t stream) {
  const int64_t n = m.tokens * m.d;
  if (n == 0) return;
  const unsigned blocks = BlocksFor(n, kScan);
  if (w != nullptr) {
    TokenSumKernel<T, true, false>
        <<<blocks, kScan, 0, stream>>>(m, route, w, src, out);
  } else if (accumulate) {
    TokenSumKernel<T, false, true>
        <<<blocks, kScan, 0, stream>>>(m, route, w, src, out);
  } else {
    TokenSumKernel<T, false, false>
        <<<blocks, kScan, 0, stream>>>(m, route, w, src, out);
  }
}

template <typename T>
void LaunchCombineIdxGrad(const IdxDims& m, const int64_t* route,
                          const int64_t* slot_entry, const T* y, const T* w,
                          const T* dout, T* dy, T* dw, cudaStream_t stream) {
  const int64_t n = m.experts * m.capacity * m.d;
  if (dy != nullptr && n > 0) {
    CombineIdxGradYKernel<T><<<BlocksFor(n, kScan), kScan, 0, stream>>>(
        m, slot_entry, w, dout, dy);
  }
  if (dw != nullptr && m.tokens * m.k > 0) {
    CombineIdxGradWKernel<T><<<BlocksFor(m.tokens * m.k, kTokens), kTokens, 0,
                               stream>>>(m, route, y, dout, dw);
  }
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
                                   cudaStream_t);                              \
  template void LaunchGateTopK<T>(const GateDims&, const T*, int32_t*,         \
                                  cudaStream_t);                               \
  template void LaunchRouteWeights<T>(const GateDims&, const T*,               \
                                      const int32_t*, T*, cudaStream_t);       \
  template void LaunchRouteWeightsGrad<T>(const GateDims&, const T*, const T*, \
                                          const int32_t*, T*, cudaStream_t);   \
  template void LaunchDispatchIdx<T>(const IdxDims&, const int64_t*, const T*, \
                                     T*, cudaStream_t);                        \
  template void LaunchTokenSum<T>(const IdxDims&, const int64_t*, const T*,    \
                                  const T*, bool, T*, cudaStream_t);           \
  template void LaunchCombineIdxGrad<T>(const IdxDims&, const int64_t*,        \
                                        const int64_t*, const T*, const T*,    \
                                        const T*, T*, T*, cudaStream_t);
HAP_INSTANTIATE_MOE(float)
HAP_INSTANTIATE_MOE(double)

}  // namespace hap::executor::cuda
