// Internal to executor/cuda: host helpers of the layout, normalization,
// convolution and MoE kernel families — their scratch arrays and a
// row-major, batched cuBLAS GEMM.
#ifndef HAP_EXECUTOR_CUDA_KERNELS_B_UTIL_H_
#define HAP_EXECUTOR_CUDA_KERNELS_B_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "executor/cuda/kernels_internal.h"

namespace hap::executor::cuda {

// `count` elements of T of the call's stream-ordered scratch memory
// (nullptr for count <= 0). Errors name the kernel.
template <typename T>
absl::StatusOr<T*> ScratchArray(const KernelArgs& a, int64_t count) {
  if (count <= 0) return static_cast<T*>(nullptr);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  absl::StatusOr<void*> p = a.scratch.Get(bytes);
  if (!p.ok()) {
    return absl::Status(p.status().code(),
                        absl::StrCat("kernel '", a.name, "': scratch of ",
                                     bytes, " bytes: ", p.status().message()));
  }
  return static_cast<T*>(*p);
}

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
