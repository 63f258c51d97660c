// OpenBLAS, wrapped here only: its CBLAS entry points and its process-wide
// thread count. Debian's libopenblas-dev installs <cblas.h> (the openblas
// variant, via alternatives) on the default include path.
#include <cblas.h>

#include <atomic>
#include <climits>

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

bool FitsBlas(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (d > INT_MAX) return false;
  }
  return true;
}

template <>
void Gemm<float>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                 float alpha, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, Op(trans_a), Op(trans_b), static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
              static_cast<int>(ldc));
}

template <>
void Gemm<double>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  double alpha, const double* a, int64_t lda, const double* b,
                  int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, Op(trans_a), Op(trans_b), static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
              static_cast<int>(ldc));
}

}  // namespace cpu
}  // namespace hap::executor
