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
};

// The routing of every token (scratch arrays of tokens * k): its top-k
// experts by softmax probability (computed in double, ties to the lower
// index) in order, expert[t * k + j], and the slot each takes,
// slot[t * k + j]: the number of earlier tokens routed to that expert, or
// -1 once the expert is at capacity.
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

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_MOE_H_
