// Internal to executor/cuda: launchers of the mixture-of-experts kernels
// (kernels_moe.cu), GShard formulation as executor/cpu/kernels_moe.cc: the
// top-k gate producing combine weights [tokens, experts, capacity], and the
// dispatch/combine einsums walking the nonzero entries of `combine` in
// order. Every launcher enqueues on `stream` and returns; launch errors are
// read by CheckLaunch. T is float or double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_MOE_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_MOE_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace hap::executor::cuda {

struct GateDims {
  int64_t tokens = 0, experts = 0, k = 2, capacity = 1;
  // Grouped routing (moe_route's "group_size"; cpu::MoeGroups): runs of
  // `group` tokens, run q (from `first_group`) filling slots
  // [q * group_capacity, (q + 1) * group_capacity). One group by default.
  int64_t group = 0, group_capacity = 0, first_group = 0;
};

// The routing of every token (scratch arrays of tokens * k): its top-k
// experts by softmax probability (computed in double, ties to the lower
// index) in order, expert[t * k + j], and the slot each takes,
// slot[t * k + j]: its group's first slot plus the number of earlier
// tokens of its group routed to that expert, or -1 once the expert is at
// the group's capacity.
template <typename T>
void LaunchGateRoute(const GateDims& d, const T* logits, int32_t* expert,
                     int32_t* slot, cudaStream_t stream);

// combine = 0, then combine[t, e_j, slot_j] = w_j for each placed choice:
// w_j = p_j / (sum of the token's top-k p) when k > 1, else p_j.
template <typename T>
void LaunchGateCombine(const GateDims& d, const T* logits,
                       const int32_t* expert, const int32_t* slot, T* combine,
                       cudaStream_t stream);

// dlogits += the gradient through the placed entries' weights and the
// softmax (as the CPU's GateBackward).
template <typename T>
void LaunchGateGrad(const GateDims& d, const T* logits, const T* dcombine,
                    const int32_t* expert, const int32_t* slot, T* dlogits,
                    cudaStream_t stream);

// For each output row r < out_rows, over the input rows i < in_rows in
// order whose weight w = weights[r * w_row_stride + i * w_col_stride] is
// nonzero: out[r, :] (+)= (weighted ? w : 1) * src[i, :]; rows are d long.
// Without `accumulate` out rows start at 0.
template <typename T>
void LaunchMoeGather(const T* weights, int64_t out_rows, int64_t in_rows,
                     int64_t w_row_stride, int64_t w_col_stride, const T* src,
                     int64_t d, bool weighted, bool accumulate, T* out,
                     cudaStream_t stream);

// --- the compact form (moe_route, moe_route_weights, moe_dispatch_idx,
// moe_combine_idx) ---

// Only the top-k experts of every token (LaunchGateRoute's `expert`).
template <typename T>
void LaunchGateTopK(const GateDims& d, const T* logits, int32_t* expert,
                    cudaStream_t stream);

// route[t * k + j] = expert * capacity + slot, or -1 (slot -1).
void LaunchRouteSlots(const GateDims& d, const int32_t* expert,
                      const int32_t* slot, int64_t* route,
                      cudaStream_t stream);

// w[t * k + j]: the weight of choice j (as LaunchGateCombine's entries).
template <typename T>
void LaunchRouteWeights(const GateDims& d, const T* logits,
                        const int32_t* expert, T* w, cudaStream_t stream);

// dlogits += the gradient through the weights, given dw [tokens, k].
template <typename T>
void LaunchRouteWeightsGrad(const GateDims& d, const T* logits, const T* dw,
                            const int32_t* expert, T* dlogits,
                            cudaStream_t stream);

// A rank's view of the route [tokens, k]: it holds `experts` experts from
// `offset` on, rows `d` long. Route entries outside its slots are skipped
// (the CPU kernels check the entries; these do not).
struct IdxDims {
  int64_t tokens = 0, k = 0, experts = 0, capacity = 0, d = 0, offset = 0;
  // Of each expert, the `capacity` slots from capacity_offset on, of
  // global_capacity (cpu::MoeIdxDims).
  int64_t capacity_offset = 0, global_capacity = 0;
};

// slot_entry[s] = the route entry (token * k + choice) in local slot s, or
// -1 (scratch of experts * capacity).
void LaunchSlotEntries(const IdxDims& m, const int64_t* route,
                       int64_t* slot_entry, cudaStream_t stream);

// out[s] = x[token of slot s], or 0.
template <typename T>
void LaunchDispatchIdx(const IdxDims& m, const int64_t* slot_entry,
                       const T* x, T* out, cudaStream_t stream);

// out[t] = sum over t's local slots s of w[t, j] * src[s] (w non-null;
// combine) or out[t] (+)= sum of src[s] (w null; dispatch's backward).
template <typename T>
void LaunchTokenSum(const IdxDims& m, const int64_t* route, const T* w,
                    const T* src, bool accumulate, T* out,
                    cudaStream_t stream);

// Combine's backward: dy[s] += w * dout[t] (dy non-null), dw[t, j] +=
// dout[t] . y[s] (dw non-null) over the local slots.
template <typename T>
void LaunchCombineIdxGrad(const IdxDims& m, const int64_t* route,
                          const int64_t* slot_entry, const T* y, const T* w,
                          const T* dout, T* dy, T* dw, cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_MOE_H_
