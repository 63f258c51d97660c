#include "executor/cuda/kernels_b_util.h"

#include <type_traits>

namespace hap::executor::cuda {
namespace {

// Sets the handle's math and pointer modes for one call and restores them
// (the handle is shared with the other kernel families).
class HandleModes {
 public:
  HandleModes(cublasHandle_t h, cublasMath_t math) : h_(h) {
    ok_ = cublasGetMathMode(h_, &math_) == CUBLAS_STATUS_SUCCESS &&
          cublasGetPointerMode(h_, &pointer_) == CUBLAS_STATUS_SUCCESS &&
          cublasSetMathMode(h_, math) == CUBLAS_STATUS_SUCCESS &&
          cublasSetPointerMode(h_, CUBLAS_POINTER_MODE_HOST) ==
              CUBLAS_STATUS_SUCCESS;
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

template <typename T>
absl::Status BatchedGemm(const KernelArgs& a, bool trans_a, bool trans_b,
                         int64_t m, int64_t n, int64_t k, const T* A,
                         int64_t lda, int64_t stride_a, const T* B, int64_t ldb,
                         int64_t stride_b, T beta, T* C, int64_t ldc,
                         int64_t stride_c, int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  constexpr bool kFloat = std::is_same_v<T, float>;
  const cudaDataType type = kFloat ? CUDA_R_32F : CUDA_R_64F;
  const cublasComputeType_t compute = !kFloat ? CUBLAS_COMPUTE_64F
                                      : a.allow_tf32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  HandleModes modes(a.cublas, kFloat && a.allow_tf32
                                  ? CUBLAS_TF32_TENSOR_OP_MATH
                                  : CUBLAS_DEFAULT_MATH);
  if (!modes.ok()) {
    return absl::InternalError(
        absl::StrCat("kernel '", a.name, "': cannot set the cuBLAS modes"));
  }
  const T alpha = T(1);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
  // row-major matrix is its column-major transpose with the same leading
  // dimension: so B comes first, with the row-major transposes as given.
  const cublasStatus_t s = cublasGemmStridedBatchedEx(
      a.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
      trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, B, type,
      static_cast<int>(ldb), stride_b, A, type, static_cast<int>(lda), stride_a,
      &beta, C, type, static_cast<int>(ldc), stride_c, static_cast<int>(batch),
      compute, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("kernel '", a.name,
                     "': cuBLAS GEMM failed: ", cublasGetStatusString(s)));
  }
  return absl::OkStatus();
}

template absl::Status BatchedGemm<float>(const KernelArgs&, bool, bool, int64_t,
                                         int64_t, int64_t, const float*,
                                         int64_t, int64_t, const float*,
                                         int64_t, int64_t, float, float*,
                                         int64_t, int64_t, int64_t);
template absl::Status BatchedGemm<double>(const KernelArgs&, bool, bool,
                                          int64_t, int64_t, int64_t,
                                          const double*, int64_t, int64_t,
                                          const double*, int64_t, int64_t,
                                          double, double*, int64_t, int64_t,
                                          int64_t);

}  // namespace hap::executor::cuda
