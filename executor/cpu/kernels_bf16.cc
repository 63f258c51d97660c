// bfloat16 mixed precision on the CPU (kernels.h attribute "bf16"): rounding
// float32 to bfloat16 and the bf16 matrix product, through oneDNN's matmul
// primitive (Debian's libdnnl 2.6; it runs AVX512-BF16 where the CPU has
// it). oneDNN is wrapped here only: its C API (no exceptions), its engine,
// its per-shape primitives (made once, cached) and its OpenMP thread count.
#include <oneapi/dnnl/dnnl.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAP_BF16_AVX512 1
#endif

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/runtime/bf16.h"

extern "C" {
// libgomp, the OpenMP runtime Debian's oneDNN is built with.
int omp_get_max_threads(void);
void omp_set_num_threads(int n);
}

namespace hap::executor::cpu {
namespace {

absl::Status DnnlError(dnnl_status_t s, const char* what) {
  return absl::InternalError(
      absl::StrCat("oneDNN ", what, " failed with status ", static_cast<int>(s)));
}

#define HAP_DNNL(call, what)                                 \
  do {                                                       \
    dnnl_status_t hap_dnnl_s = (call);                       \
    if (hap_dnnl_s != dnnl_success) return DnnlError(hap_dnnl_s, what); \
  } while (0)

using ::hap::executor::Bf16Bits;  // executor/runtime/bf16.h

// x[0, n) to bf16 bits, 16 at a time with AVX512-BF16's vcvtneps2bf16
// where the CPU has it (round to nearest even like Bf16Bits; it flushes
// denormal inputs to zero, values below 1.2e-38 that no model here holds).
#ifdef HAP_BF16_AVX512
__attribute__((target("avx512f,avx512bf16"))) void RowToBf16Avx512(const float* x,
                                                                  int64_t n, uint16_t* y) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
    std::memcpy(y + j, &h, 32);
  }
  for (; j < n; ++j) y[j] = Bf16Bits(x[j]);
}
#endif

void RowToBf16(const float* x, int64_t n, uint16_t* y) {
#ifdef HAP_BF16_AVX512
  static const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  if (avx512_bf16) return RowToBf16Avx512(x, n, y);
#endif
  for (int64_t j = 0; j < n; ++j) y[j] = Bf16Bits(x[j]);
}

// op(X) (rows x cols after op; X row-major with leading dimension ld) into
// a contiguous row-major bf16 [rows, cols]: the transpose, when asked, is
// done here in tiles, so oneDNN always sees plain row-major operands (its
// matmul is much slower on transposed strides).
void ToBf16Plain(const float* x, bool trans, int64_t rows, int64_t cols, int64_t ld,
                 uint16_t* y) {
  if (!trans) {
    for (int64_t r = 0; r < rows; ++r) RowToBf16(x + r * ld, cols, y + r * cols);
    return;
  }
  constexpr int64_t kTile = 32;  // y[r][j] = x[j][r]
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), j1 = std::min(cols, j0 + kTile);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = j0; j < j1; ++j) y[r * cols + j] = Bf16Bits(x[j * ld + r]);
      }
    }
  }
}

// What a matmul primitive is made for; one primitive per distinct key.
using GemmKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t,
                           int64_t, bool>;

class Dnnl {
 public:
  // The process's oneDNN CPU engine, or the error of making it.
  static absl::StatusOr<Dnnl*> Get() {
    static Dnnl* d = new Dnnl;
    static absl::Status made = d->Init();
    if (!made.ok()) return made;
    return d;
  }

  dnnl_engine_t engine() const { return engine_; }

  // The matmul primitive for `key` (made on first use).
  absl::StatusOr<dnnl_primitive_t> Matmul(const GemmKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    auto [m, n, k, ta, tb, lda, ldb, ldc, acc] = key;
    dnnl_dims_t a_dims = {m, k}, b_dims = {k, n}, c_dims = {m, n};
    dnnl_dims_t a_strides = {ta ? 1 : lda, ta ? lda : 1};
    dnnl_dims_t b_strides = {tb ? 1 : ldb, tb ? ldb : 1};
    dnnl_dims_t c_strides = {ldc, 1};
    dnnl_memory_desc_t a_md, b_md, c_md;
    HAP_DNNL(dnnl_memory_desc_init_by_strides(&a_md, 2, a_dims, dnnl_bf16, a_strides),
             "memory_desc_init (A)");
    HAP_DNNL(dnnl_memory_desc_init_by_strides(&b_md, 2, b_dims, dnnl_bf16, b_strides),
             "memory_desc_init (B)");
    HAP_DNNL(dnnl_memory_desc_init_by_strides(&c_md, 2, c_dims, dnnl_f32, c_strides),
             "memory_desc_init (C)");
    dnnl_matmul_desc_t desc;
    HAP_DNNL(dnnl_matmul_desc_init(&desc, &a_md, &b_md, nullptr, &c_md), "matmul_desc_init");
    dnnl_primitive_attr_t attr = nullptr;
    HAP_DNNL(dnnl_primitive_attr_create(&attr), "primitive_attr_create");
    // Our scratchpad, per call: the library's is shared between threads,
    // and ranks run as threads executing the same primitives at once.
    HAP_DNNL(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user),
             "set_scratchpad_mode");
    dnnl_post_ops_t ops = nullptr;
    if (acc) {
      HAP_DNNL(dnnl_post_ops_create(&ops), "post_ops_create");
      HAP_DNNL(dnnl_post_ops_append_sum(ops, 1.0f), "post_ops_append_sum");
      HAP_DNNL(dnnl_primitive_attr_set_post_ops(attr, ops), "set_post_ops");
    }
    dnnl_primitive_desc_t pd = nullptr;
    dnnl_status_t s = dnnl_primitive_desc_create(&pd, &desc, attr, engine_, nullptr);
    dnnl_primitive_attr_destroy(attr);
    if (ops != nullptr) dnnl_post_ops_destroy(ops);
    if (s != dnnl_success) return DnnlError(s, "primitive_desc_create (bf16 matmul)");
    dnnl_primitive_t p = nullptr;
    s = dnnl_primitive_create(&p, pd);
    dnnl_primitive_desc_destroy(pd);
    if (s != dnnl_success) return DnnlError(s, "primitive_create (bf16 matmul)");
    cache_.emplace(key, p);
    return p;
  }

 private:
  absl::Status Init() {
    HAP_DNNL(dnnl_engine_create(&engine_, dnnl_cpu, 0), "engine_create");
    return absl::OkStatus();
  }

  dnnl_engine_t engine_ = nullptr;
  std::mutex mu_;
  std::map<GemmKey, dnnl_primitive_t> cache_;
};

}  // namespace

void RoundBf16InPlace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = RoundBf16(x[i]);
}

void GemmBf16Blas(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                  int64_t lda, const float* b, int64_t ldb, bool accumulate, float* c,
                  int64_t ldc) {
  if (m == 0 || n == 0) return;
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  std::vector<float> ar(a_rows * a_cols), br(b_rows * b_cols);
  for (int64_t r = 0; r < a_rows; ++r) {
    for (int64_t j = 0; j < a_cols; ++j) ar[r * a_cols + j] = RoundBf16(a[r * lda + j]);
  }
  for (int64_t r = 0; r < b_rows; ++r) {
    for (int64_t j = 0; j < b_cols; ++j) br[r * b_cols + j] = RoundBf16(b[r * ldb + j]);
  }
  Gemm<float>(trans_a, trans_b, m, n, k, 1.0f, ar.data(), a_cols, br.data(), b_cols,
              accumulate ? 1.0f : 0.0f, c, ldc);
  for (int64_t r = 0; r < m; ++r) RoundBf16InPlace(c + r * ldc, n);
}

absl::Status GemmBf16(int threads, bool trans_a, bool trans_b, int64_t m, int64_t n,
                      int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                      bool accumulate, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return absl::OkStatus();
  if (k == 0) {  // an empty sum: C = round(beta * C)
    for (int64_t r = 0; r < m; ++r) {
      if (accumulate) {
        RoundBf16InPlace(c + r * ldc, n);
      } else {
        std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
      }
    }
    return absl::OkStatus();
  }
  HAP_ASSIGN_OR_RETURN(Dnnl * d, Dnnl::Get());
  absl::StatusOr<dnnl_primitive_t> made =
      d->Matmul(GemmKey{m, n, k, false, false, k, n, ldc, accumulate});
  if (!made.ok()) {
    // oneDNN has no bf16 matmul for this CPU (one without AVX-512): the
    // same arithmetic through OpenBLAS on rounded operands.
    GemmBf16Blas(trans_a, trans_b, m, n, k, a, lda, b, ldb, accumulate, c, ldc);
    return absl::OkStatus();
  }
  dnnl_primitive_t p = *made;
  // The operands in bf16, row-major and contiguous: op(A) [m, k], op(B) [k, n].
  thread_local std::vector<uint16_t> a16, b16;
  a16.resize(m * k);
  b16.resize(k * n);
  threads = threads < 1 ? 1 : threads;
  // The roundings in row blocks over the threads (each block's rows of
  // op(X) are whole tiles of ToBf16Plain's transpose).
  auto convert = [threads](const float* x, bool trans, int64_t rows, int64_t cols, int64_t ld,
                           uint16_t* y) {
    constexpr int64_t kRows = 32;
    ParallelFor(threads, (rows + kRows - 1) / kRows, GrainFor(kRows * cols),
                [&](int64_t b, int64_t e) {
                  const int64_t r0 = b * kRows, r1 = std::min(rows, e * kRows);
                  ToBf16Plain(trans ? x + r0 : x + r0 * ld, trans, r1 - r0, cols, ld,
                              y + r0 * cols);
                });
  };
  convert(a, trans_a, m, k, lda, a16.data());
  convert(b, trans_b, k, n, ldb, b16.data());

  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
  const_dnnl_primitive_desc_t pd = nullptr;
  HAP_DNNL(dnnl_primitive_get_primitive_desc(p, &pd), "primitive_get_primitive_desc");
  const dnnl_memory_desc_t* scratch_md =
      dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  thread_local std::vector<unsigned char> scratch;
  scratch.resize(scratch_md == nullptr ? 0 : dnnl_memory_desc_get_size(scratch_md) + 64);
  dnnl_memory_t ma = nullptr, mb = nullptr, mc = nullptr, ms = nullptr;
  HAP_DNNL(dnnl_memory_create(&ma, dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                              d->engine(), a16.data()),
           "memory_create (A)");
  HAP_DNNL(dnnl_memory_create(&mb, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0),
                              d->engine(), b16.data()),
           "memory_create (B)");
  HAP_DNNL(dnnl_memory_create(&mc, dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0),
                              d->engine(), c),
           "memory_create (C)");
  if (scratch_md != nullptr) {
    HAP_DNNL(dnnl_memory_create(&ms, scratch_md, d->engine(), scratch.data()),
             "memory_create (scratchpad)");
  }
  thread_local dnnl_stream_t stream = nullptr;
  dnnl_status_t s = dnnl_success;
  if (stream == nullptr) s = dnnl_stream_create(&stream, d->engine(), dnnl_stream_default_flags);
  if (s == dnnl_success) {
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma},
                               {DNNL_ARG_WEIGHTS, mb},
                               {DNNL_ARG_DST, mc},
                               {DNNL_ARG_SCRATCHPAD, ms}};
    s = dnnl_primitive_execute(p, stream, ms != nullptr ? 4 : 3, args);
    if (s == dnnl_success) s = dnnl_stream_wait(stream);
  }
  dnnl_memory_destroy(ma);
  dnnl_memory_destroy(mb);
  dnnl_memory_destroy(mc);
  if (ms != nullptr) dnnl_memory_destroy(ms);
  if (s != dnnl_success) return DnnlError(s, "bf16 matmul");
  for (int64_t r = 0; r < m; ++r) RoundBf16InPlace(c + r * ldc, n);
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<bool> Bf16Attr(const KernelArgs& a) {
  HAP_ASSIGN_OR_RETURN(bool bf16, AttrBool(a, "bf16", false));
  if (bf16 && !std::is_same_v<T, float>) {
    return Invalid(a, "attribute bf16 (mixed precision) needs float32 tensors, not ",
                   graph::DTypeName(DTypeOf<T>()));
  }
  return bf16;
}
template absl::StatusOr<bool> Bf16Attr<float>(const KernelArgs&);
template absl::StatusOr<bool> Bf16Attr<double>(const KernelArgs&);

template <typename T>
absl::Status Product(const KernelArgs& a, bool bf16, bool trans_a, bool trans_b,
                     int64_t m, int64_t n, int64_t k, const T* pa, int64_t lda,
                     const T* pb, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16) {
      if (!accumulate) {
        return GemmBf16(a.ctx.num_threads, trans_a, trans_b, m, n, k, pa, lda, pb, ldb,
                        false, c, ldc);
      }
      thread_local std::vector<float> product;
      product.resize(m * n);
      HAP_RETURN_IF_ERROR(GemmBf16(a.ctx.num_threads, trans_a, trans_b, m, n, k, pa, lda,
                                   pb, ldb, false, product.data(), n));
      for (int64_t r = 0; r < m; ++r) AddTo(c + r * ldc, product.data() + r * n, n);
      return absl::OkStatus();
    }
  }
  Gemm<T>(trans_a, trans_b, m, n, k, T(1), pa, lda, pb, ldb, accumulate ? T(1) : T(0), c,
          ldc);
  return absl::OkStatus();
}
template absl::Status Product<float>(const KernelArgs&, bool, bool, bool, int64_t, int64_t,
                                     int64_t, const float*, int64_t, const float*, int64_t,
                                     bool, float*, int64_t);
template absl::Status Product<double>(const KernelArgs&, bool, bool, bool, int64_t, int64_t,
                                      int64_t, const double*, int64_t, const double*,
                                      int64_t, bool, double*, int64_t);

}  // namespace hap::executor::cpu
