// Internal to executor/cuda: row-major matrix products through cuBLAS in a
// kernel call's precision — float32 (TF32 tensor cores when the call allows
// them), float64, or bf16 mixed precision (attribute "bf16",
// executor/cpu/kernels.h: float32 operands rounded to bf16, bf16 tensor
// cores with float32 sums, results rounded to bf16, as the CPU's oneDNN path
// computes them). Used by the dense (linear, matmul), convolution, LSTM and MoE
// kernels.
#ifndef HAP_EXECUTOR_CUDA_GEMM_H_
#define HAP_EXECUTOR_CUDA_GEMM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "executor/cuda/kernels_internal.h"

namespace hap::executor::cuda {

// Row-major C = alpha * op(A) @ op(B) + beta * C for `batch` matrices
// `sa`, `sb`, `sc` elements apart; A is m x k after op, B k x n after op.
// Float32 on TF32 tensor cores when the call allows them (KernelArgs::
// allow_tf32) unless `exact` (sums that are not matrix products of the
// model). k == 0 sets C to beta * C. The handle's math mode follows the
// call's precision and is restored afterwards. Internal naming the kernel on
// a cuBLAS error.
template <typename T>
absl::Status Gemm(const KernelArgs& a, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  T alpha, const T* pa, int64_t lda, const T* pb, int64_t ldb, T beta, T* pc,
                  int64_t ldc, int64_t batch = 1, int64_t sa = 0, int64_t sb = 0, int64_t sc = 0,
                  bool exact = false);

// Scratch that ProductBf16 calls of one kernel call share (grown from the
// call's scratch as needed): the operands in bf16, the unrounded products.
struct Bf16Scratch {
  uint16_t* a = nullptr;
  int64_t a_size = 0;
  uint16_t* b = nullptr;
  int64_t b_size = 0;
  float* product = nullptr;
  int64_t product_size = 0;
};

// bf16 products as the CPU computes them (executor/cpu/kernels_bf16.cc):
// P = op(bf16(A)) @ op(bf16(B)), the operands rounded to bf16 (to nearest,
// ties to even) by our kernel and multiplied on bf16 tensor cores with
// float32 sums, `batch` of them (A and B `sa`, `sb` apart). kOverwrite: C =
// bf16(P); kFused: C = bf16(P + C) (a forward's bias already in C);
// kAccumulate: C += bf16(P) in float32 (a gradient). C is contiguous: ldc =
// n and, batched, m * n apart. `reuse`: scratch kept across calls.
enum class Bf16Mode { kOverwrite, kFused, kAccumulate };
absl::Status ProductBf16(const KernelArgs& a, Bf16Mode mode, bool trans_a, bool trans_b, int64_t m,
                         int64_t n, int64_t k, const float* pa, int64_t lda, const float* pb,
                         int64_t ldb, float* pc, int64_t batch = 1, int64_t sa = 0, int64_t sb = 0,
                         Bf16Scratch* reuse = nullptr);

// C = op(A) @ op(B) (C += it when `accumulate`) in the call's precision
// (`bf16` applies to float only); C contiguous as for ProductBf16.
template <typename T>
absl::Status Product(const KernelArgs& a, bool bf16, bool trans_a, bool trans_b,
                     int64_t m, int64_t n, int64_t k, const T* pa, int64_t lda,
                     const T* pb, int64_t ldb, bool accumulate, T* pc,
                     int64_t batch = 1, int64_t sa = 0, int64_t sb = 0);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_GEMM_H_
