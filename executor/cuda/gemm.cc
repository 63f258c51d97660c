// Row-major GEMMs through cuBLAS (gemm.h).
#include "executor/cuda/gemm.h"

#include <cublas_v2.h>

#include <algorithm>
#include <type_traits>

#include "common/status_macros.h"
#include "executor/cuda/launch_elementwise.h"
#include "executor/cuda/launch_runtime.h"

namespace hap::executor::cuda {
namespace {

// Sets the handle's math and pointer modes for one call and restores them
// (the handle is shared by the kernel families). The math mode matters with
// CUBLAS_COMPUTE_32F: a handle in CUBLAS_TF32_TENSOR_OP_MATH would run even
// an `exact` product on TF32 tensor cores.
class HandleModes {
 public:
  HandleModes(cublasHandle_t h, cublasMath_t math) : h_(h) {
    ok_ = cublasGetMathMode(h_, &math_) == CUBLAS_STATUS_SUCCESS &&
          cublasGetPointerMode(h_, &pointer_) == CUBLAS_STATUS_SUCCESS &&
          cublasSetMathMode(h_, math) == CUBLAS_STATUS_SUCCESS &&
          cublasSetPointerMode(h_, CUBLAS_POINTER_MODE_HOST) == CUBLAS_STATUS_SUCCESS;
  }
  ~HandleModes() {
    cublasSetMathMode(h_, math_);
    cublasSetPointerMode(h_, pointer_);
  }
  bool ok() const { return ok_; }

 private:
  cublasHandle_t h_;
  cublasMath_t math_ = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer_ = CUBLAS_POINTER_MODE_HOST;
  bool ok_ = false;
};

}  // namespace

// cuBLAS is column-major, where a row-major matrix reads as its transpose,
// so a row-major C = op(A) @ op(B) is the column-major C^T = op(B)^T @
// op(A)^T: the operands swap and m and n trade places.
template <typename T>
absl::Status Gemm(const KernelArgs& a, bool trans_a, bool trans_b, int64_t m,
                  int64_t n, int64_t k, T alpha, const T* pa, int64_t lda,
                  const T* pb, int64_t ldb, T beta, T* pc, int64_t ldc,
                  int64_t batch, int64_t sa, int64_t sb, int64_t sc, bool exact,
                  bool bf16) {
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  if (k == 0 && (beta == T(0) || beta == T(1))) {  // C = beta * C
    if (beta != T(0)) return absl::OkStatus();
    for (int64_t i = 0; i < batch; ++i) {
      cudaError_t e = cudaMemset2DAsync(pc + i * sc, ldc * sizeof(T), 0,
                                        n * sizeof(T), m, a.stream);
      HAP_RETURN_IF_ERROR(KernelCudaStatus(a, e, "cudaMemset2DAsync"));
    }
    return absl::OkStatus();
  }
  constexpr bool kFloat = std::is_same_v<T, float>;
  const cudaDataType_t type = kFloat ? CUDA_R_32F : CUDA_R_64F;
  const cublasComputeType_t compute =
      kFloat ? (bf16                      ? CUBLAS_COMPUTE_32F_FAST_16BF
                : a.allow_tf32 && !exact ? CUBLAS_COMPUTE_32F_FAST_TF32
                                         : CUBLAS_COMPUTE_32F)
             : CUBLAS_COMPUTE_64F;
  HandleModes modes(a.cublas, compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                      : CUBLAS_DEFAULT_MATH);
  if (!modes.ok()) {
    return absl::InternalError(
        absl::StrCat("CUDA kernel '", a.name, "': cannot set the cuBLAS modes"));
  }
  // ld >= 1 as cuBLAS asks even where a dimension is 0 (k == 0: C = beta * C).
  cublasStatus_t s = cublasGemmStridedBatchedEx(
      a.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
      trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, pb, type,
      static_cast<int>(std::max<int64_t>(ldb, 1)), sb, pa, type,
      static_cast<int>(std::max<int64_t>(lda, 1)), sa, &beta, pc, type,
      static_cast<int>(std::max<int64_t>(ldc, 1)), sc, static_cast<int>(batch),
      compute, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "CUDA kernel '", a.name, "': cublasGemmStridedBatchedEx (m=", m,
        ", n=", n, ", k=", k, ", batch=", batch,
        ") failed: ", cublasGetStatusString(s)));
  }
  return absl::OkStatus();
}

absl::Status ProductBf16(const KernelArgs& a, Bf16Mode mode, bool trans_a, bool trans_b,
                         int64_t m, int64_t n, int64_t k, const float* pa, int64_t lda,
                         const float* pb, int64_t ldb, float* pc, int64_t batch,
                         int64_t sa, int64_t sb, float* scratch) {
  const int64_t count = batch * m * n;
  if (count == 0) return absl::OkStatus();
  float* dst = pc;
  if (mode == Bf16Mode::kAccumulate) {
    if (scratch == nullptr) {
      HAP_ASSIGN_OR_RETURN(void* p, a.scratch.Get(count * sizeof(float)));
      scratch = static_cast<float*>(p);
    }
    dst = scratch;
  }
  HAP_RETURN_IF_ERROR(Gemm<float>(a, trans_a, trans_b, m, n, k, 1.0f, pa, lda, pb, ldb,
                                  mode == Bf16Mode::kFused ? 1.0f : 0.0f, dst, n, batch, sa,
                                  sb, m * n, /*exact=*/false, /*bf16=*/true));
  LaunchRoundBf16(dst, count, a.stream);
  if (mode == Bf16Mode::kAccumulate) {
    LaunchScale<float>(1.0f, dst, pc, count, /*accumulate=*/true, a.stream);
  }
  return CheckLaunch(a);
}

template <typename T>
absl::Status Product(const KernelArgs& a, bool bf16, bool trans_a, bool trans_b, int64_t m,
                     int64_t n, int64_t k, const T* pa, int64_t lda, const T* pb, int64_t ldb,
                     bool accumulate, T* pc, int64_t batch, int64_t sa,
                     int64_t sb) {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16) {
      return ProductBf16(a, accumulate ? Bf16Mode::kAccumulate : Bf16Mode::kOverwrite,
                         trans_a, trans_b, m, n, k, pa, lda, pb, ldb, pc, batch, sa, sb);
    }
  }
  return Gemm<T>(a, trans_a, trans_b, m, n, k, T(1), pa, lda, pb, ldb,
                 accumulate ? T(1) : T(0), pc, n, batch, sa, sb, m * n);
}


template absl::Status Gemm<float>(const KernelArgs&, bool, bool, int64_t, int64_t, int64_t,
                                  float, const float*, int64_t, const float*, int64_t, float,
                                  float*, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                                  bool);
template absl::Status Gemm<double>(const KernelArgs&, bool, bool, int64_t, int64_t, int64_t,
                                   double, const double*, int64_t, const double*, int64_t,
                                   double, double*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, bool, bool);
template absl::Status Product<float>(const KernelArgs&, bool, bool, bool, int64_t, int64_t,
                                     int64_t, const float*, int64_t, const float*, int64_t,
                                     bool, float*, int64_t, int64_t, int64_t);
template absl::Status Product<double>(const KernelArgs&, bool, bool, bool, int64_t, int64_t,
                                      int64_t, const double*, int64_t, const double*,
                                      int64_t, bool, double*, int64_t, int64_t, int64_t);

}  // namespace hap::executor::cuda
