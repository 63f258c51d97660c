// The runtime's own kernels (kernels.h): fill_zero, copy, accumulate, and the
// optimizer pieces — sq_norm, sgd_update, adam_update (PyTorch's SGD and
// AdamW, with clip_grad_norm_'s clipping factor). Their float loops are
// simd::FloatRows' (kernels_simd.h); the double loops here are the same
// arithmetic.
#include <cmath>
#include <cstring>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/kernels_simd.h"

namespace hap::executor::cpu {
namespace {

absl::Status FillZero(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 0, 0, 1));
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  std::memset(a.out[0].data, 0, a.out[0].bytes());
  return absl::OkStatus();
}

// Input 0 and output 0 present, of one dtype and element count.
absl::Status CheckSameElements(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  if (!a.in[0].present()) return Invalid(a, "input 0 is absent");
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  if (a.in[0].dtype != a.out[0].dtype ||
      a.in[0].num_elements() != a.out[0].num_elements()) {
    return Invalid(a, InLabel(a, 0), " and ", OutLabel(a, 0),
                   " differ in dtype or element count");
  }
  return absl::OkStatus();
}

absl::Status Copy(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckSameElements(a));
  if (a.out[0].data != a.in[0].data) {
    std::memcpy(a.out[0].data, a.in[0].data, a.in[0].bytes());
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Accumulate(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckSameElements(a));
  const T* x = a.in[0].as<const T>();
  T* out = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, a.in[0].num_elements(), kParallelWork,
              [&](int64_t b, int64_t e) { AddTo(out + b, x + b, e - b); });
  return absl::OkStatus();
}

double SumSquares(const double* p, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += p[i] * p[i];
  return s;
}

// An f64 [1] tensor (the global squared norm).
absl::Status CheckNormTensor(const KernelArgs& a, const TensorView& v,
                             absl::string_view what) {
  if (v.dtype != DType::kFloat64 || v.num_elements() != 1) {
    return Invalid(a, what, " (", Describe(v), ") must be f64[1]");
  }
  return absl::OkStatus();
}

absl::Status SqNorm(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 0, -1, 1));
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  HAP_RETURN_IF_ERROR(CheckNormTensor(a, a.out[0], "output 0"));
  double s = 0;
  for (int i = 0; i < static_cast<int>(a.in.size()); ++i) {
    const TensorView& g = a.in[i];
    if (!g.present()) continue;
    if (g.dtype == DType::kFloat32) {
      s += simd::Rows().sum_squares(g.as<const float>(), g.num_elements());
    } else if (g.dtype == DType::kFloat64) {
      s += SumSquares(g.as<const double>(), g.num_elements());
    } else {
      return Invalid(a, InLabel(a, i), " must be f32 or f64");
    }
  }
  *a.out[0].as<double>() += s;
  return absl::OkStatus();
}

// The inputs (param, grad, norm_sq?) and the gradient's clipping factor.
struct OptimizerInputs {
  int64_t n = 0;
  double clip = 1;
};

template <typename T>
absl::StatusOr<OptimizerInputs> CheckOptimizer(const KernelArgs& a,
                                               int min_out, int max_out) {
  constexpr DType t = DTypeOf<T>();
  if (a.in.size() < 2 || a.in.size() > 3) {
    return Invalid(a, "takes 2 or 3 inputs (param, grad, norm_sq?), got ",
                   a.in.size());
  }
  if (static_cast<int>(a.out.size()) < min_out ||
      static_cast<int>(a.out.size()) > max_out) {
    return Invalid(a, "takes ", min_out, " to ", max_out, " outputs, got ",
                   a.out.size());
  }
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  const Shape& s = a.in[0].shape;
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[1], "grad (input 1)", s));
  for (int j = 0; j < static_cast<int>(a.out.size()); ++j) {
    if (j == 0 || a.out[j].present()) HAP_RETURN_IF_ERROR(CheckOutput(a, j, t, s));
  }
  OptimizerInputs o;
  o.n = a.in[0].num_elements();
  HAP_ASSIGN_OR_RETURN(double max_norm, AttrFloat(a, "clip_global_norm", 0.0));
  if (max_norm > 0 && a.in.size() == 3 && a.in[2].present()) {
    HAP_RETURN_IF_ERROR(CheckNormTensor(a, a.in[2], "norm_sq (input 2)"));
    const double norm = std::sqrt(*a.in[2].as<const double>());
    o.clip = std::min(1.0, max_norm / (norm + 1e-6));
  }
  return o;
}

// PyTorch SGD (dampening 0, not Nesterov): g = grad * clip + wd * param;
// m = momentum * m + g; param -= lr * m (lr * g without momentum).
template <typename T>
absl::Status SgdUpdate(const KernelArgs& a) {
  HAP_ASSIGN_OR_RETURN(OptimizerInputs o, CheckOptimizer<T>(a, 1, 2));
  HAP_ASSIGN_OR_RETURN(double lr, AttrFloat(a, "learning_rate"));
  HAP_ASSIGN_OR_RETURN(double momentum, AttrFloat(a, "momentum", 0.0));
  HAP_ASSIGN_OR_RETURN(double wd, AttrFloat(a, "weight_decay", 0.0));
  T* mbuf = a.out.size() == 2 && a.out[1].present() ? a.out[1].as<T>() : nullptr;
  if (momentum != 0 && mbuf == nullptr) {
    return Invalid(a, "momentum ", momentum, " needs a momentum buffer (output 1)");
  }
  if (momentum == 0) mbuf = nullptr;
  const T* param = a.in[0].as<const T>();
  const T* grad = a.in[1].as<const T>();
  T* out = a.out[0].as<T>();
  const T clip = static_cast<T>(o.clip), tlr = static_cast<T>(lr),
          twd = static_cast<T>(wd), tm = static_cast<T>(momentum);
  ParallelFor(a.ctx.num_threads, o.n, kParallelWork, [&](int64_t b, int64_t e) {
    if constexpr (std::is_same_v<T, float>) {
      simd::Rows().sgd({clip, tlr, twd, tm}, param + b, grad + b,
                       mbuf != nullptr ? mbuf + b : nullptr, out + b, e - b);
    } else {
      for (int64_t i = b; i < e; ++i) {
        T g = grad[i] * clip + twd * param[i];
        if (mbuf != nullptr) {
          mbuf[i] = tm * mbuf[i] + g;
          g = mbuf[i];
        }
        out[i] = param[i] - tlr * g;
      }
    }
  });
  return absl::OkStatus();
}

// PyTorch AdamW: param *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v +
// (1 - b2) g^2; param -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), with
// bc_i = 1 - b_i^t, t = step + 1.
template <typename T>
absl::Status AdamUpdate(const KernelArgs& a) {
  HAP_ASSIGN_OR_RETURN(OptimizerInputs o, CheckOptimizer<T>(a, 3, 3));
  if (!a.out[1].present() || !a.out[2].present()) {
    return Invalid(a, "needs its moment buffers (outputs 1 and 2)");
  }
  HAP_ASSIGN_OR_RETURN(double lr, AttrFloat(a, "learning_rate"));
  HAP_ASSIGN_OR_RETURN(double b1, AttrFloat(a, "beta1", 0.9));
  HAP_ASSIGN_OR_RETURN(double b2, AttrFloat(a, "beta2", 0.999));
  HAP_ASSIGN_OR_RETURN(double eps, AttrFloat(a, "epsilon", 1e-8));
  HAP_ASSIGN_OR_RETURN(double wd, AttrFloat(a, "weight_decay", 0.0));
  const double t = static_cast<double>(a.ctx.step + 1);
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  const T* param = a.in[0].as<const T>();
  const T* grad = a.in[1].as<const T>();
  T* out = a.out[0].as<T>();
  T* m = a.out[1].as<T>();
  T* v = a.out[2].as<T>();
  const T clip = static_cast<T>(o.clip), decay = static_cast<T>(1 - lr * wd),
          tb1 = static_cast<T>(b1), tb2 = static_cast<T>(b2),
          step = static_cast<T>(lr / bc1),
          sqrt_bc2 = static_cast<T>(std::sqrt(bc2)), teps = static_cast<T>(eps);
  ParallelFor(a.ctx.num_threads, o.n, kParallelWork, [&](int64_t b, int64_t e) {
    if constexpr (std::is_same_v<T, float>) {
      simd::Rows().adam({clip, decay, tb1, tb2, step, sqrt_bc2, teps},
                        param + b, grad + b, m + b, v + b, out + b, e - b);
    } else {
      for (int64_t i = b; i < e; ++i) {
        const T g = grad[i] * clip;
        m[i] = tb1 * m[i] + (T(1) - tb1) * g;
        v[i] = tb2 * v[i] + (T(1) - tb2) * g * g;
        const T denom = std::sqrt(v[i]) / sqrt_bc2 + teps;
        out[i] = param[i] * decay - step * m[i] / denom;
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace

void RegisterRuntimeKernels(KernelTable& t) {
  t["fill_zero"] = FillZero;
  t["copy"] = Copy;
  t["accumulate"] = HAP_FLOAT_KERNEL(Accumulate);
  t["sq_norm"] = SqNorm;
  t["sgd_update"] = HAP_FLOAT_KERNEL(SgdUpdate);
  t["adam_update"] = HAP_FLOAT_KERNEL(AdamUpdate);
}

}  // namespace hap::executor::cpu
