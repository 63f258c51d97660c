// OpenBLAS, wrapped here only: its CBLAS entry points and its process-wide
// thread count. Debian's libopenblas-dev installs <cblas.h> (the openblas
// variant, via alternatives) on the default include path.
#include <cblas.h>

#include <atomic>
#include <climits>
#include <type_traits>

#include "executor/cpu/kernels.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor {
namespace {

// The thread count last handed to OpenBLAS (0: never set).
std::atomic<int> blas_threads{0};

}  // namespace

void SetBlasThreads(int n) {
  n = n < 1 ? 1 : n;
  if (blas_threads.exchange(n) != n) openblas_set_num_threads(n);
}

namespace cpu {
namespace {

CBLAS_TRANSPOSE Op(bool t) { return t ? CblasTrans : CblasNoTrans; }

}  // namespace

absl::Status CheckFitsBlas(const KernelArgs& a,
                           std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (d > INT_MAX) {
      return Invalid(a, "a matrix dimension of ", d, " is too large for BLAS");
    }
  }
  return absl::OkStatus();
}

template <typename T>
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
          const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C; BLAS would reject the leading dimension 0
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
    }
    return;
  }
  constexpr auto gemm = [] {
    if constexpr (std::is_same_v<T, float>) {
      return &cblas_sgemm;
    } else {
      return &cblas_dgemm;
    }
  }();
  gemm(CblasRowMajor, Op(trans_a), Op(trans_b), static_cast<int>(m),
       static_cast<int>(n), static_cast<int>(k), alpha, a,
       static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
       static_cast<int>(ldc));
}

template void Gemm<float>(bool, bool, int64_t, int64_t, int64_t, float,
                          const float*, int64_t, const float*, int64_t, float,
                          float*, int64_t);
template void Gemm<double>(bool, bool, int64_t, int64_t, int64_t, double,
                           const double*, int64_t, const double*, int64_t,
                           double, double*, int64_t);

}  // namespace cpu
}  // namespace hap::executor
