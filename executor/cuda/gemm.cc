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

// One strided-batched cuBLAS GEMM on operands of `ab_type` and C of
// `c_type`, alpha and beta pointing at values of the scale type (float for
// float32 and bf16 operands, double for float64). cuBLAS is column-major,
// where a row-major matrix reads as its transpose, so a row-major C = op(A)
// @ op(B) is the column-major C^T = op(B)^T @ op(A)^T: the operands swap and
// m and n trade places. ld >= 1 as cuBLAS asks even where a dimension is 0.
absl::Status GemmEx(const KernelArgs& a, bool trans_a, bool trans_b, int64_t m, int64_t n,
                    int64_t k, const void* alpha, const void* pa, int64_t lda, const void* pb,
                    int64_t ldb, cudaDataType_t ab_type, const void* beta, void* pc, int64_t ldc,
                    cudaDataType_t c_type, int64_t batch, int64_t sa, int64_t sb, int64_t sc,
                    cublasComputeType_t compute) {
  HandleModes modes(a.cublas, compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                      : CUBLAS_DEFAULT_MATH);
  if (!modes.ok()) {
    return absl::InternalError(
        absl::StrCat("CUDA kernel '", a.name, "': cannot set the cuBLAS modes"));
  }
  cublasStatus_t s = cublasGemmStridedBatchedEx(
      a.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), alpha, pb, ab_type,
      static_cast<int>(std::max<int64_t>(ldb, 1)), sb, pa, ab_type,
      static_cast<int>(std::max<int64_t>(lda, 1)), sa, beta, pc, c_type,
      static_cast<int>(std::max<int64_t>(ldc, 1)), sc, static_cast<int>(batch), compute,
      CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("CUDA kernel '", a.name, "': cublasGemmStridedBatchedEx (m=", m, ", n=", n,
                     ", k=", k, ", batch=", batch, ") failed: ", cublasGetStatusString(s)));
  }
  return absl::OkStatus();
}

// C = beta * C for k == 0 with beta 0 or 1 (true when done): an empty sum.
template <typename T>
absl::StatusOr<bool> EmptySum(const KernelArgs& a, int64_t m, int64_t n, int64_t k, T beta, T* pc,
                              int64_t ldc, int64_t batch, int64_t sc) {
  if (k != 0 || (beta != T(0) && beta != T(1))) return false;
  for (int64_t i = 0; beta == T(0) && i < batch; ++i) {
    cudaError_t e = cudaMemset2DAsync(pc + i * sc, ldc * sizeof(T), 0, n * sizeof(T), m, a.stream);
    HAP_RETURN_IF_ERROR(KernelCudaStatus(a, e, "cudaMemset2DAsync"));
  }
  return true;
}

// The elements a strided batch of row-major matrices spans: `rows` x `cols`
// each, `ld` apart by row and `stride` by matrix (0 when none).
int64_t Span(int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

// `*buf` with room for `count` elements, grown from the call's scratch.
template <typename T>
absl::Status Reserve(const KernelArgs& a, int64_t count, T** buf, int64_t* size) {
  if (*size >= count) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(*buf, ScratchArray<T>(a, count));
  *size = count;
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status Gemm(const KernelArgs& a, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  T alpha, const T* pa, int64_t lda, const T* pb, int64_t ldb, T beta, T* pc,
                  int64_t ldc, int64_t batch, int64_t sa, int64_t sb, int64_t sc, bool exact) {
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(bool done, EmptySum<T>(a, m, n, k, beta, pc, ldc, batch, sc));
  if (done) return absl::OkStatus();
  constexpr bool kFloat = std::is_same_v<T, float>;
  const cudaDataType_t type = kFloat ? CUDA_R_32F : CUDA_R_64F;
  const cublasComputeType_t compute = !kFloat                  ? CUBLAS_COMPUTE_64F
                                      : a.allow_tf32 && !exact ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                               : CUBLAS_COMPUTE_32F;
  return GemmEx(a, trans_a, trans_b, m, n, k, &alpha, pa, lda, pb, ldb, type, &beta, pc, ldc, type,
                batch, sa, sb, sc, compute);
}

absl::Status ProductBf16(const KernelArgs& a, Bf16Mode mode, bool trans_a, bool trans_b, int64_t m,
                         int64_t n, int64_t k, const float* pa, int64_t lda, const float* pb,
                         int64_t ldb, float* pc, int64_t batch, int64_t sa, int64_t sb,
                         Bf16Scratch* reuse) {
  const int64_t count = batch * m * n;
  if (count == 0) return absl::OkStatus();
  Bf16Scratch local;
  Bf16Scratch& s = reuse != nullptr ? *reuse : local;
  float* dst = pc;
  if (mode == Bf16Mode::kAccumulate) {
    HAP_RETURN_IF_ERROR(Reserve(a, count, &s.product, &s.product_size));
    dst = s.product;
  }
  const float beta = mode == Bf16Mode::kFused ? 1.0f : 0.0f;
  HAP_ASSIGN_OR_RETURN(bool done, EmptySum<float>(a, m, n, k, beta, dst, n, batch, m * n));
  if (!done) {
    // The operands rounded to bf16 by our kernel (to nearest, ties to even:
    // the CPU's rounding), in their own layout; then bf16 x bf16 products,
    // exact in float32, summed in float32 whatever kernel cuBLAS picks.
    const int64_t a_span = Span(trans_a ? k : m, trans_a ? m : k, lda, batch, sa);
    const int64_t b_span = Span(trans_b ? n : k, trans_b ? k : n, ldb, batch, sb);
    HAP_RETURN_IF_ERROR(Reserve(a, a_span, &s.a, &s.a_size));
    HAP_RETURN_IF_ERROR(Reserve(a, b_span, &s.b, &s.b_size));
    LaunchToBf16(pa, s.a, a_span, a.stream);
    LaunchToBf16(pb, s.b, b_span, a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
    const float one = 1.0f;
    HAP_RETURN_IF_ERROR(GemmEx(a, trans_a, trans_b, m, n, k, &one, s.a, lda, s.b, ldb, CUDA_R_16BF,
                               &beta, dst, n, CUDA_R_32F, batch, sa, sb, m * n,
                               CUBLAS_COMPUTE_32F));
  }
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

template absl::Status Gemm<float>(const KernelArgs&, bool, bool, int64_t, int64_t, int64_t, float,
                                  const float*, int64_t, const float*, int64_t, float, float*,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, bool);
template absl::Status Gemm<double>(const KernelArgs&, bool, bool, int64_t, int64_t, int64_t, double,
                                   const double*, int64_t, const double*, int64_t, double, double*,
                                   int64_t, int64_t, int64_t, int64_t, int64_t, bool);
template absl::Status Product<float>(const KernelArgs&, bool, bool, bool, int64_t, int64_t,
                                     int64_t, const float*, int64_t, const float*, int64_t,
                                     bool, float*, int64_t, int64_t, int64_t);
template absl::Status Product<double>(const KernelArgs&, bool, bool, bool, int64_t, int64_t,
                                      int64_t, const double*, int64_t, const double*,
                                      int64_t, bool, double*, int64_t, int64_t, int64_t);

}  // namespace hap::executor::cuda
