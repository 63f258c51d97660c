// Matrix products through BLAS: linear (x @ w^T + b) and (batched) matmul.
// Transposes are BLAS flags, never copies. With attribute "bf16" (float32
// only) the products are bf16 products (kernels.h), the bias too.
#include <functional>
#include <mutex>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor::cpu {
namespace {

// --- linear ---------------------------------------------------------------------

struct LinearDims {
  int64_t rows = 0, in = 0, out = 0;
  Shape y;
};

// x[..., in], w[out, in], bias[out] (when present) of dtype t.
absl::StatusOr<LinearDims> CheckLinear(const KernelArgs& a, DType t,
                                       bool has_bias_slot) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  const TensorView& x = a.in[0];
  const TensorView& w = a.in[1];
  if (x.rank() < 1 || w.rank() != 2 || w.shape[1] != x.shape.back()) {
    return Invalid(a, InLabel(a, 0), " and weight ", InLabel(a, 1),
                   " do not fit x[..., in] @ w[out, in]^T");
  }
  LinearDims d;
  d.in = w.shape[1];
  d.out = w.shape[0];
  d.rows = 1;  // x's rows, also where in == 0
  for (size_t i = 0; i + 1 < x.shape.size(); ++i) d.rows *= x.shape[i];
  d.y = x.shape;
  d.y.back() = d.out;
  HAP_RETURN_IF_ERROR(CheckBias(a, t, has_bias_slot, d.out));
  HAP_RETURN_IF_ERROR(CheckFitsBlas(a, {d.rows, d.in, d.out}));
  return d;
}

template <typename T>
absl::Status LinearForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 3, 1));
  const bool has_bias = a.in.size() == 3 && a.in[2].present();
  HAP_ASSIGN_OR_RETURN(LinearDims d, CheckLinear(a, t, a.in.size() == 3));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, d.y));
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Attr<T>(a));
  T* y = a.out[0].as<T>();
  if (has_bias) {
    const T* b = a.in[2].as<const T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      std::copy(b, b + d.out, y + r * d.out);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (bf16) {  // y = bf16(x_bf16 @ w_bf16^T + b_bf16)
      if (has_bias) RoundBf16InPlace(y, d.rows * d.out);
      return GemmBf16(a.ctx.num_threads, false, true, d.rows, d.out, d.in,
                      a.in[0].as<const float>(), d.in, a.in[1].as<const float>(), d.in,
                      has_bias, y, d.out);
    }
  }
  Gemm<T>(false, true, d.rows, d.out, d.in, T(1), a.in[0].as<const T>(), d.in,
          a.in[1].as<const T>(), d.in, has_bias ? T(1) : T(0), y, d.out);
  return absl::OkStatus();
}

template <typename T>
absl::Status LinearBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(LinearDims d, CheckLinear(a, t, g.n() == 3));
  HAP_RETURN_IF_ERROR(g.Check(t, {d.y}));
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Attr<T>(a));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* dy = g.dy(0).as<const T>();
  if (g.dx(0).present()) {  // dx += dy @ w
    HAP_RETURN_IF_ERROR(Product<T>(a, bf16, false, false, d.rows, d.in, d.out, dy, d.out,
                                   g.x(1).as<const T>(), d.in, true, g.dx(0).as<T>(), d.in));
  }
  if (g.dx(1).present()) {  // dw += dy^T @ x
    HAP_RETURN_IF_ERROR(Product<T>(a, bf16, true, false, d.out, d.in, d.rows, dy, d.out,
                                   g.x(0).as<const T>(), d.in, true, g.dx(1).as<T>(), d.in));
  }
  if (g.n() == 3 && g.dx(2).present()) {  // db += column sums of dy
    T* db = g.dx(2).as<T>();
    if (!bf16) {
      for (int64_t r = 0; r < d.rows; ++r) AddTo(db, dy + r * d.out, d.out);
    } else {  // the bf16 bias's gradient: sums of bf16(dy), rounded
      std::vector<T> sums(d.out, T(0));
      for (int64_t r = 0; r < d.rows; ++r) {
        for (int64_t j = 0; j < d.out; ++j) sums[j] += RoundBf16(dy[r * d.out + j]);
      }
      for (int64_t j = 0; j < d.out; ++j) db[j] += RoundBf16(sums[j]);
    }
  }
  return absl::OkStatus();
}

// --- matmul ---------------------------------------------------------------------

struct MatmulDims {
  int64_t batch = 1, m = 0, k = 0, n = 0;
  bool shared_b = false;  // b is [k, n] for every batch entry
  Shape y;
};

absl::StatusOr<MatmulDims> CheckMatmul(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  const Shape& as = a.in[0].shape;
  const Shape& bs = a.in[1].shape;
  const int r = static_cast<int>(as.size());
  bool ok = r >= 2 && (bs.size() == 2 || bs.size() == as.size()) &&
            as[r - 1] == bs[bs.size() - 2];
  for (int i = 0; ok && bs.size() == as.size() && i + 2 < r; ++i) {
    ok = as[i] == bs[i];
  }
  if (!ok) {
    return Invalid(a, InLabel(a, 0), " and ", InLabel(a, 1),
                   " do not fit a[..., m, k] @ b[..., k, n] or b[k, n]");
  }
  MatmulDims d;
  d.m = as[r - 2];
  d.k = as[r - 1];
  d.n = bs.back();
  d.shared_b = bs.size() == 2;
  for (int i = 0; i + 2 < r; ++i) d.batch *= as[i];
  d.y = as;
  d.y.back() = d.n;
  HAP_RETURN_IF_ERROR(CheckFitsBlas(a, {d.batch * d.m, d.k, d.n}));
  return d;
}

// Runs fn(args, i) for every product i of a batch. In bf16 with several
// threads the products go to the threads whole, each run with one oneDNN
// thread: a small product's own OpenMP region costs more than it saves (an
// attention's [65 x 64] @ [64 x 65] per head: 4x slower at 2 threads than
// at 1). Otherwise in order, each product with every thread.
absl::Status ForEachProduct(const KernelArgs& a, bool bf16, int64_t batch,
                            const std::function<absl::Status(const KernelArgs&, int64_t)>& fn) {
  if (!bf16 || a.ctx.num_threads <= 1 || batch < 2) {
    for (int64_t i = 0; i < batch; ++i) HAP_RETURN_IF_ERROR(fn(a, i));
    return absl::OkStatus();
  }
  KernelContext one = a.ctx;
  one.num_threads = 1;
  const KernelArgs single{a.name, one, a.attrs, a.in, a.out};
  std::mutex mu;
  absl::Status status;
  ParallelFor(a.ctx.num_threads, batch, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      absl::Status s = fn(single, i);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        status.Update(s);
        return;
      }
    }
  });
  return status;
}

template <typename T>
absl::Status MatmulForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MatmulDims d, CheckMatmul(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, d.y));
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Attr<T>(a));
  const T* pa = a.in[0].as<const T>();
  const T* pb = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  if (d.shared_b) {
    return Product<T>(a, bf16, false, false, d.batch * d.m, d.n, d.k, pa, d.k, pb, d.n,
                      false, y, d.n);
  }
  return ForEachProduct(a, bf16, d.batch, [&](const KernelArgs& c, int64_t i) {
    return Product<T>(c, bf16, false, false, d.m, d.n, d.k, pa + i * d.m * d.k, d.k,
                      pb + i * d.k * d.n, d.n, false, y + i * d.m * d.n, d.n);
  });
}

template <typename T>
absl::Status MatmulBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MatmulDims d, CheckMatmul(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {d.y}));
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Attr<T>(a));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* pa = g.x(0).as<const T>();
  const T* pb = g.x(1).as<const T>();
  const T* dy = g.dy(0).as<const T>();
  T* da = g.dx(0).present() ? g.dx(0).as<T>() : nullptr;
  T* db = g.dx(1).present() ? g.dx(1).as<T>() : nullptr;
  if (d.shared_b) {
    if (da != nullptr) {  // da += dy @ b^T
      HAP_RETURN_IF_ERROR(Product<T>(a, bf16, false, true, d.batch * d.m, d.k, d.n, dy,
                                     d.n, pb, d.n, true, da, d.k));
    }
    if (db != nullptr) {  // db += a^T @ dy, over every batch row at once
      HAP_RETURN_IF_ERROR(Product<T>(a, bf16, true, false, d.k, d.n, d.batch * d.m, pa,
                                     d.k, dy, d.n, true, db, d.n));
    }
    return absl::OkStatus();
  }
  const int64_t sa = d.m * d.k, sb = d.k * d.n, sy = d.m * d.n;
  return ForEachProduct(a, bf16, d.batch, [&](const KernelArgs& c, int64_t i) {
    if (da != nullptr) {
      HAP_RETURN_IF_ERROR(Product<T>(c, bf16, false, true, d.m, d.k, d.n, dy + i * sy, d.n,
                                     pb + i * sb, d.n, true, da + i * sa, d.k));
    }
    if (db != nullptr) {
      HAP_RETURN_IF_ERROR(Product<T>(c, bf16, true, false, d.k, d.n, d.m, pa + i * sa, d.k,
                                     dy + i * sy, d.n, true, db + i * sb, d.n));
    }
    return absl::OkStatus();
  });
}

}  // namespace

void RegisterDenseKernels(KernelTable& t) {
  t["linear"] = HAP_FLOAT_KERNEL(LinearForward);
  t["linear_grad"] = HAP_FLOAT_KERNEL(LinearBackward);
  t["matmul"] = HAP_FLOAT_KERNEL(MatmulForward);
  t["matmul_grad"] = HAP_FLOAT_KERNEL(MatmulBackward);
}

}  // namespace hap::executor::cpu
