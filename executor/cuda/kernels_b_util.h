// Internal to executor/cuda: a host helper of the layout, normalization,
// convolution and MoE kernel families — a row-major, batched cuBLAS GEMM
// (their scratch arrays: kernels_internal.h ScratchArray).
#ifndef HAP_EXECUTOR_CUDA_KERNELS_B_UTIL_H_
#define HAP_EXECUTOR_CUDA_KERNELS_B_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "executor/cuda/kernels_internal.h"

namespace hap::executor::cuda {

// One batch of row-major matrix products:
//   C[b] = op(A[b]) @ op(B[b]) + beta * C[b],  b in [0, batch),
// A[b] = A + b * stride_a (likewise B and C), op = transpose when asked,
// op(A) m x k, op(B) k x n, leading dimensions in elements. Float products
// use TF32 tensor cores only when the call allows it (KernelArgs::
// allow_tf32); the handle's math mode is restored afterwards. Every size must
// fit int (the CPU's CheckFitsBlas); Internal naming the kernel on a cuBLAS
// error. Nothing happens when m, n or batch is 0.
template <typename T>
absl::Status BatchedGemm(const KernelArgs& a, bool trans_a, bool trans_b,
                         int64_t m, int64_t n, int64_t k, const T* A,
                         int64_t lda, int64_t stride_a, const T* B, int64_t ldb,
                         int64_t stride_b, T beta, T* C, int64_t ldc,
                         int64_t stride_c, int64_t batch);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_KERNELS_B_UTIL_H_
