// Matrix products through cuBLAS: linear (x @ w^T + b) and (batched) matmul,
// with the contracts of executor/cpu/kernels_dense.cc. Transposes are
// cuBLAS flags, never copies; float32 products use TF32 tensor cores only
// when the call allows it (KernelArgs::allow_tf32). With attribute "bf16"
// (bf16 mixed precision, executor/cpu/kernels.h) the products are gemm.h's
// ProductBf16: operands rounded to bf16, bf16 tensor cores with float32
// sums, results rounded to bf16.
#include <cublas_v2.h>

#include <algorithm>

#include "common/status_macros.h"
#include "executor/cuda/gemm.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_elementwise.h"
#include "executor/cuda/launch_runtime.h"

namespace hap::executor::cuda {
namespace {

// --- linear -----------------------------------------------------------------

struct LinearDims {
  int64_t rows = 0, in = 0, out = 0;
  Shape y;
};

// x[..., in], w[out, in], bias[out] (when present) of dtype t.
absl::StatusOr<LinearDims> CheckLinear(const KernelArgs& a, DType t,
                                       bool has_bias_slot) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  const TensorView& x = a.in[0];
  const TensorView& w = a.in[1];
  if (x.rank() < 1 || w.rank() != 2 || w.shape[1] != x.shape.back()) {
    return Invalid(a, cpu::InLabel(c, 0), " and weight ", cpu::InLabel(c, 1),
                   " do not fit x[..., in] @ w[out, in]^T");
  }
  LinearDims d;
  d.in = w.shape[1];
  d.out = w.shape[0];
  d.rows = d.in == 0 ? 0 : x.num_elements() / d.in;
  if (d.in == 0) {
    d.rows = 1;
    for (size_t i = 0; i + 1 < x.shape.size(); ++i) d.rows *= x.shape[i];
  }
  d.y = x.shape;
  d.y.back() = d.out;
  HAP_RETURN_IF_ERROR(cpu::CheckBias(c, t, has_bias_slot, d.out));
  HAP_RETURN_IF_ERROR(cpu::CheckFitsBlas(c, {d.rows, d.in, d.out}));
  return d;
}

template <typename T>
absl::Status LinearForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 3, 1));
  const bool has_bias = a.in.size() == 3 && a.in[2].present();
  HAP_ASSIGN_OR_RETURN(LinearDims d, CheckLinear(a, t, a.in.size() == 3));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, d.y));
  HAP_ASSIGN_OR_RETURN(bool bf16, cpu::Bf16Attr<T>(c));
  T* y = a.out[0].as<T>();
  if (has_bias) {  // y rows = bias, then y += x @ w^T
    HAP_ASSIGN_OR_RETURN(
        StridedSpace space,
        MakeSpace(a, {d.rows, d.out}, {{d.out, 1}, {0, 1}, {0, 0}}));
    LaunchBinary<T>(BinaryOp::kAdd, space, a.in[2].as<const T>(), nullptr, y,
                    a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
  }
  if constexpr (std::is_same_v<T, float>) {
    if (bf16) {  // y = bf16(x_b @ w_b^T + b_b)
      if (has_bias) LaunchRoundBf16(y, d.rows * d.out, a.stream);
      return ProductBf16(a, has_bias ? Bf16Mode::kFused : Bf16Mode::kOverwrite, false, true,
                         d.rows, d.out, d.in, a.in[0].as<const float>(), d.in,
                         a.in[1].as<const float>(), d.in, y);
    }
  }
  return Gemm<T>(a, false, true, d.rows, d.out, d.in, T(1),
                 a.in[0].as<const T>(), d.in, a.in[1].as<const T>(), d.in,
                 has_bias ? T(1) : T(0), y, d.out);
}

template <typename T>
absl::Status LinearBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(LinearDims d, CheckLinear(a, t, g.n() == 3));
  HAP_RETURN_IF_ERROR(g.Check(t, {d.y}));
  HAP_ASSIGN_OR_RETURN(bool bf16, cpu::Bf16Attr<T>(c));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* dy = g.dy(0).as<const T>();
  if (g.dx(0).present()) {  // dx += dy @ w
    HAP_RETURN_IF_ERROR(Product<T>(a, bf16, false, false, d.rows, d.in, d.out, dy, d.out,
                                   g.x(1).as<const T>(), d.in, true, g.dx(0).as<T>()));
  }
  if (g.dx(1).present()) {  // dw += dy^T @ x
    HAP_RETURN_IF_ERROR(Product<T>(a, bf16, true, false, d.out, d.in, d.rows, dy, d.out,
                                   g.x(0).as<const T>(), d.in, true, g.dx(1).as<T>()));
  }
  if constexpr (std::is_same_v<T, float>) {
    if (bf16 && g.n() == 3 && g.dx(2).present() && d.rows > 0) {
      // db += bf16(column sums of bf16(dy)): dy^T @ ones on the bf16 path.
      HAP_ASSIGN_OR_RETURN(void* p, a.scratch.Get(d.rows * sizeof(float)));
      float* ones = static_cast<float*>(p);
      LaunchFill<float>(1.0f, ones, d.rows, a.stream);
      HAP_RETURN_IF_ERROR(CheckLaunch(a));
      return ProductBf16(a, Bf16Mode::kAccumulate, true, false, d.out, 1, d.rows, dy, d.out, ones,
                         1, g.dx(2).as<float>());
    }
  }
  if (g.n() == 3 && g.dx(2).present() && d.rows > 0) {
    // db += column sums of dy = dy^T @ ones (a GEMV: cuBLAS reads dy once,
    // coalesced; deterministic), in plain float32 math.
    HAP_ASSIGN_OR_RETURN(void* p, a.scratch.Get(d.rows * sizeof(T)));
    T* ones = static_cast<T*>(p);
    LaunchFill<T>(T(1), ones, d.rows, a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
    HAP_RETURN_IF_ERROR(Gemm<T>(a, true, false, d.out, 1, d.rows, T(1), dy,
                                d.out, ones, 1, T(1), g.dx(2).as<T>(), 1,
                                /*batch=*/1, 0, 0, 0, /*exact=*/true));
  }
  return absl::OkStatus();
}

// --- matmul -----------------------------------------------------------------

struct MatmulDims {
  int64_t batch = 1, m = 0, k = 0, n = 0;
  bool shared_b = false;  // b is [k, n] for every batch entry
  Shape y;
};

absl::StatusOr<MatmulDims> CheckMatmul(const KernelArgs& a, DType t) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  const Shape& as = a.in[0].shape;
  const Shape& bs = a.in[1].shape;
  const int r = static_cast<int>(as.size());
  bool ok = r >= 2 && (bs.size() == 2 || bs.size() == as.size()) &&
            as[r - 1] == bs[bs.size() - 2];
  for (int i = 0; ok && bs.size() == as.size() && i + 2 < r; ++i) {
    ok = as[i] == bs[i];
  }
  if (!ok) {
    return Invalid(a, cpu::InLabel(c, 0), " and ", cpu::InLabel(c, 1),
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
  HAP_RETURN_IF_ERROR(cpu::CheckFitsBlas(c, {d.batch * d.m, d.k, d.n}));
  return d;
}

template <typename T>
absl::Status MatmulForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MatmulDims d, CheckMatmul(a, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, d.y));
  HAP_ASSIGN_OR_RETURN(bool bf16, cpu::Bf16Attr<T>(c));
  const T* pa = a.in[0].as<const T>();
  const T* pb = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  if (d.shared_b) {
    return Product<T>(a, bf16, false, false, d.batch * d.m, d.n, d.k, pa, d.k, pb, d.n,
                      false, y);
  }
  return Product<T>(a, bf16, false, false, d.m, d.n, d.k, pa, d.k, pb, d.n, false, y,
                    d.batch, d.m * d.k, d.k * d.n);
}

template <typename T>
absl::Status MatmulBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MatmulDims d, CheckMatmul(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {d.y}));
  HAP_ASSIGN_OR_RETURN(bool bf16, cpu::Bf16Attr<T>(c));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* pa = g.x(0).as<const T>();
  const T* pb = g.x(1).as<const T>();
  const T* dy = g.dy(0).as<const T>();
  T* da = g.dx(0).present() ? g.dx(0).as<T>() : nullptr;
  T* db = g.dx(1).present() ? g.dx(1).as<T>() : nullptr;
  if (d.shared_b) {
    if (da != nullptr) {  // da += dy @ b^T
      HAP_RETURN_IF_ERROR(Product<T>(a, bf16, false, true, d.batch * d.m, d.k, d.n, dy, d.n,
                                     pb, d.n, true, da));
    }
    if (db != nullptr) {  // db += a^T @ dy, over every batch row at once
      HAP_RETURN_IF_ERROR(Product<T>(a, bf16, true, false, d.k, d.n, d.batch * d.m, pa, d.k,
                                     dy, d.n, true, db));
    }
    return absl::OkStatus();
  }
  const int64_t sa = d.m * d.k, sb = d.k * d.n, sy = d.m * d.n;
  if (da != nullptr) {  // da_i += dy_i @ b_i^T
    HAP_RETURN_IF_ERROR(Product<T>(a, bf16, false, true, d.m, d.k, d.n, dy, d.n, pb, d.n,
                                   true, da, d.batch, sy, sb));
  }
  if (db != nullptr) {  // db_i += a_i^T @ dy_i
    HAP_RETURN_IF_ERROR(Product<T>(a, bf16, true, false, d.k, d.n, d.m, pa, d.k, dy, d.n,
                                   true, db, d.batch, sa, sy));
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterDenseKernels(KernelTable& t) {
  t["linear"] = HAP_CUDA_FLOAT_KERNEL(LinearForward);
  t["linear_grad"] = HAP_CUDA_FLOAT_KERNEL(LinearBackward);
  t["matmul"] = HAP_CUDA_FLOAT_KERNEL(MatmulForward);
  t["matmul_grad"] = HAP_CUDA_FLOAT_KERNEL(MatmulBackward);
}

}  // namespace hap::executor::cuda
