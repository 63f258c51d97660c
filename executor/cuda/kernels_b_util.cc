#include "executor/cuda/kernels_b_util.h"

#include "executor/cuda/gemm.h"

namespace hap::executor::cuda {

template <typename T>
absl::Status BatchedGemm(const KernelArgs& a, bool trans_a, bool trans_b,
                         int64_t m, int64_t n, int64_t k, const T* A,
                         int64_t lda, int64_t stride_a, const T* B, int64_t ldb,
                         int64_t stride_b, T beta, T* C, int64_t ldc,
                         int64_t stride_c, int64_t batch) {
  return Gemm<T>(a, trans_a, trans_b, m, n, k, T(1), A, lda, B, ldb, beta, C, ldc, batch, stride_a,
                 stride_b, stride_c);
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
