// Internal to executor/cuda: plain data the kernel families hand their
// launchers (launch_*.h, implemented in .cu files compiled by nvcc, so no
// Abseil here): index spaces with per-operand strides, at most kMaxDims
// dimensions after merging (MakeSpace).
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_COMMON_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_COMMON_H_

#include <cstdint>

namespace hap::executor::cuda {

inline constexpr int kMaxDims = 8;
inline constexpr int kMaxOperands = 3;

// A row-major index space and the element strides of up to kMaxOperands
// operands over it: element i (flat, row-major) of the space is element
// sum_d idx_d * stride[k][d] of operand k.
struct StridedSpace {
  int rank = 0;
  int64_t count = 1;  // product of shape
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxOperands][kMaxDims] = {};
};

// out[o] (+)= scale * sum over the reduced space of a * b (b absent: 1).
// `kept` enumerates outputs (operands: 0 out, 1 a, 2 b); `reduced` the
// elements summed into each (operands: 0 unused, 1 a, 2 b).
struct ReduceSpace {
  StridedSpace kept;
  StridedSpace reduced;
};

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_COMMON_H_
