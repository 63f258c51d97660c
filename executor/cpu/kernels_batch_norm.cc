// batch_norm in training mode: each channel normalised with the mean and
// (biased) variance of the whole batch, x viewed as [n, c, s] (s = the
// spatial elements). Statistics are sums in double.
//
// Single-device kernels: batch_norm (also updates running_mean/running_var
// in place: (1 - momentum) * r + momentum * the batch's mean / unbiased
// variance) and batch_norm_grad.
//
// A batch sharded over ranks (planner/lower) runs the same arithmetic in
// pieces around two all-reduces, so every rank normalises with the global
// batch's statistics:
//   batch_norm_stats(x) -> s[2, c] f64: per channel sum x, sum x^2 (local)
//   all-reduce s
//   batch_norm_apply(x, gamma, beta, rm?, rv?, s) -> y (and running stats)
//   batch_norm_grad_stats(x, s, dy) -> g[2, c] f64: sum dy, sum dy * xhat
//   all-reduce g
//   batch_norm_grad_apply(x, gamma, s, g, dy) -> dx, dgamma, dbeta
// with attribute global_count = the global batch's elements per channel.
// dgamma and dbeta are this rank's partial sums (the gradient
// synchronisation adds them); dx needs the global sums:
//   dx = gamma * invstd * (dy - sum dy / N - xhat * sum(dy * xhat) / N).
#include <cmath>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"

namespace hap::executor::cpu {

absl::StatusOr<BatchNormDims> CheckBatchNorm(
    const KernelArgs& a, DType t, std::initializer_list<int> channel_inputs) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  const TensorView& x = a.in[0];
  if (x.rank() < 2) {
    return Invalid(a, InLabel(a, 0), " must be [n, c, ...] (rank >= 2)");
  }
  BatchNormDims d;
  d.n = x.shape[0];
  d.c = x.shape[1];
  d.s = d.c == 0 || d.n == 0 ? 0 : x.num_elements() / (d.n * d.c);
  for (int i : channel_inputs) {
    if (i >= static_cast<int>(a.in.size()) || !a.in[i].present()) continue;
    HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
    HAP_RETURN_IF_ERROR(
        CheckShape(a, a.in[i], absl::StrCat("input ", i), {d.c}));
  }
  HAP_ASSIGN_OR_RETURN(d.eps, AttrFloat(a, "eps", 1e-5));
  if (!(d.eps > 0)) return Invalid(a, "attribute 'eps' must be positive");
  HAP_ASSIGN_OR_RETURN(d.momentum, AttrFloat(a, "momentum", 0.1));
  if (!(d.momentum >= 0 && d.momentum <= 1)) {
    return Invalid(a, "attribute 'momentum' must be in [0, 1]");
  }
  HAP_ASSIGN_OR_RETURN(int64_t count, AttrInt(a, "global_count", d.n * d.s));
  if (count < d.n * d.s || count < 1) {
    return Invalid(a, "attribute 'global_count' ", count,
                   " is smaller than the local batch's ", d.n * d.s,
                   " elements per channel");
  }
  d.count = static_cast<double>(count);
  return d;
}

absl::Status CheckBatchNormSums(const KernelArgs& a, const TensorView& v,
                                absl::string_view label, int64_t c) {
  if (!v.present() || v.dtype != DType::kFloat64) {
    return Invalid(a, label, " must be a present f64 tensor, got ",
                   Describe(v));
  }
  return CheckShape(a, v, label, {2, c});
}

namespace {

// Per channel: mean, biased variance and 1 / sqrt(var + eps) from the sums.
struct ChannelStats {
  double mean = 0, var = 0, invstd = 0;
};
ChannelStats FromSums(const double* sums, int64_t c, int64_t ch,
                      const BatchNormDims& d) {
  ChannelStats s;
  s.mean = sums[ch] / d.count;
  s.var = std::max(0.0, sums[c + ch] / d.count - s.mean * s.mean);
  s.invstd = 1.0 / std::sqrt(s.var + d.eps);
  return s;
}

// fn(plane pointer offset) over the n planes of channel ch.
template <typename F>
void ForPlanes(const BatchNormDims& d, int64_t ch, F fn) {
  for (int64_t m = 0; m < d.n; ++m) fn((m * d.c + ch) * d.s);
}

// out[ch] = sum x, out[c + ch] = sum x^2 over channel ch.
template <typename T>
void Sums(const KernelArgs& a, const BatchNormDims& d, const T* x, double* out) {
  ParallelFor(a.ctx.num_threads, d.c, GrainFor(d.n * d.s), [&](int64_t b, int64_t e) {
    for (int64_t ch = b; ch < e; ++ch) {
      double s1 = 0, s2 = 0;
      ForPlanes(d, ch, [&](int64_t o) {
        for (int64_t j = 0; j < d.s; ++j) {
          const double v = x[o + j];
          s1 += v;
          s2 += v * v;
        }
      });
      out[ch] = s1;
      out[d.c + ch] = s2;
    }
  });
}

// y = (x - mean) * invstd * gamma + beta; the running statistics move
// towards the batch's (unbiased variance).
template <typename T>
absl::Status Apply(const KernelArgs& a, const BatchNormDims& d, const double* sums,
                   const TensorView& rm, const TensorView& rv) {
  const T* x = a.in[0].as<const T>();
  const T* gamma = a.in[1].as<const T>();
  const T* beta = a.in[2].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, d.c, GrainFor(d.n * d.s), [&](int64_t b, int64_t e) {
    for (int64_t ch = b; ch < e; ++ch) {
      const ChannelStats s = FromSums(sums, d.c, ch, d);
      const double scale = s.invstd * static_cast<double>(gamma[ch]);
      const double shift = static_cast<double>(beta[ch]) - s.mean * scale;
      ForPlanes(d, ch, [&](int64_t o) {
        for (int64_t j = 0; j < d.s; ++j) {
          y[o + j] = static_cast<T>(static_cast<double>(x[o + j]) * scale + shift);
        }
      });
    }
  });
  const double unbias = d.count > 1 ? d.count / (d.count - 1) : 1.0;
  for (int64_t ch = 0; ch < d.c; ++ch) {
    const ChannelStats s = FromSums(sums, d.c, ch, d);
    if (rm.present()) {
      T& r = rm.as<T>()[ch];
      r = static_cast<T>((1 - d.momentum) * r + d.momentum * s.mean);
    }
    if (rv.present()) {
      T& r = rv.as<T>()[ch];
      r = static_cast<T>((1 - d.momentum) * r + d.momentum * s.var * unbias);
    }
  }
  return absl::OkStatus();
}

// out[ch] = sum dy, out[c + ch] = sum dy * xhat over channel ch.
template <typename T>
void GradSums(const KernelArgs& a, const BatchNormDims& d, const T* x, const T* dy,
              const double* sums, double* out) {
  ParallelFor(a.ctx.num_threads, d.c, GrainFor(d.n * d.s), [&](int64_t b, int64_t e) {
    for (int64_t ch = b; ch < e; ++ch) {
      const ChannelStats s = FromSums(sums, d.c, ch, d);
      double g1 = 0, g2 = 0;
      ForPlanes(d, ch, [&](int64_t o) {
        for (int64_t j = 0; j < d.s; ++j) {
          const double g = dy[o + j];
          g1 += g;
          g2 += g * (static_cast<double>(x[o + j]) - s.mean) * s.invstd;
        }
      });
      out[ch] = g1;
      out[d.c + ch] = g2;
    }
  });
}

// dx += gamma * invstd * (dy - g1 / N - xhat * g2 / N) with the global
// gradient sums g; dgamma += local sum dy * xhat, dbeta += local sum dy.
template <typename T>
void GradApply(const KernelArgs& a, const BatchNormDims& d, const T* x, const T* gamma,
               const T* dy, const double* sums, const double* gsums, T* dx, T* dgamma,
               T* dbeta) {
  ParallelFor(a.ctx.num_threads, d.c, GrainFor(d.n * d.s), [&](int64_t b, int64_t e) {
    for (int64_t ch = b; ch < e; ++ch) {
      const ChannelStats s = FromSums(sums, d.c, ch, d);
      const double k = s.invstd * static_cast<double>(gamma[ch]);
      const double mean_dy = gsums[ch] / d.count;
      const double mean_dy_xhat = gsums[d.c + ch] / d.count;
      double g1 = 0, g2 = 0;
      ForPlanes(d, ch, [&](int64_t o) {
        for (int64_t j = 0; j < d.s; ++j) {
          const double g = dy[o + j];
          const double xhat = (static_cast<double>(x[o + j]) - s.mean) * s.invstd;
          g1 += g;
          g2 += g * xhat;
          if (dx != nullptr) {
            dx[o + j] += static_cast<T>(k * (g - mean_dy - xhat * mean_dy_xhat));
          }
        }
      });
      if (dgamma != nullptr) dgamma[ch] += static_cast<T>(g2);
      if (dbeta != nullptr) dbeta[ch] += static_cast<T>(g1);
    }
  });
}

template <typename T>
const T* Ptr(const TensorView& v) {
  return v.present() ? v.as<const T>() : nullptr;
}
template <typename T>
T* MutablePtr(const TensorView& v) {
  return v.present() ? v.as<T>() : nullptr;
}

// x, gamma, beta present (gamma and beta [c]).
absl::Status CheckAffine(const KernelArgs& a, DType t) {
  for (int i : {1, 2}) HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
  return absl::OkStatus();
}

template <typename T>
absl::Status BatchNormForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormDims d, CheckBatchNorm(a, t, {1, 2, 3, 4}));
  HAP_RETURN_IF_ERROR(CheckAffine(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, a.in[0].shape));
  std::vector<double> sums(2 * d.c);
  Sums<T>(a, d, a.in[0].as<const T>(), sums.data());
  const TensorView none;
  return Apply<T>(a, d, sums.data(), a.in.size() > 3 ? a.in[3] : none,
                  a.in.size() > 4 ? a.in[4] : none);
}

// Inputs (x, gamma, beta, [rm, rv,] y, dy); outputs (dx, dgamma, dbeta[,
// drm, drv]): the running statistics get no gradient.
template <typename T>
absl::Status BatchNormBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormDims d, CheckBatchNorm(a, t, {1, 2}));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {a.in[0].shape}));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({3, 4}));
  if (!g.dy(0).present() || !(g.dx(0).present() || g.dx(1).present() ||
                              g.dx(2).present())) {
    return absl::OkStatus();
  }
  const T* x = a.in[0].as<const T>();
  const T* dy = g.dy(0).as<const T>();
  std::vector<double> sums(2 * d.c), gsums(2 * d.c);
  Sums<T>(a, d, x, sums.data());
  GradSums<T>(a, d, x, dy, sums.data(), gsums.data());
  GradApply<T>(a, d, x, a.in[1].as<const T>(), dy, sums.data(), gsums.data(),
               MutablePtr<T>(g.dx(0)), MutablePtr<T>(g.dx(1)), MutablePtr<T>(g.dx(2)));
  return absl::OkStatus();
}

// --- the pieces of a batch-sharded batch_norm ---------------------------------------

template <typename T>
absl::Status StatsKernel(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormDims d, CheckBatchNorm(a, t, {}));
  HAP_RETURN_IF_ERROR(CheckBatchNormSums(a, a.out[0], OutLabel(a, 0), d.c));
  Sums<T>(a, d, a.in[0].as<const T>(), a.out[0].as<double>());
  return absl::OkStatus();
}

template <typename T>
absl::Status ApplyKernel(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 6, 6, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormDims d, CheckBatchNorm(a, t, {1, 2, 3, 4}));
  HAP_RETURN_IF_ERROR(CheckAffine(a, t));
  HAP_RETURN_IF_ERROR(CheckBatchNormSums(a, a.in[5], InLabel(a, 5), d.c));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, a.in[0].shape));
  return Apply<T>(a, d, a.in[5].as<const double>(), a.in[3], a.in[4]);
}

// Inputs (x, sums, dy); output the gradient sums.
template <typename T>
absl::Status GradStatsKernel(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormDims d, CheckBatchNorm(a, t, {}));
  HAP_RETURN_IF_ERROR(CheckBatchNormSums(a, a.in[1], InLabel(a, 1), d.c));
  HAP_RETURN_IF_ERROR(CheckInput(a, 2, t));
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[2], InLabel(a, 2), a.in[0].shape));
  HAP_RETURN_IF_ERROR(CheckBatchNormSums(a, a.out[0], OutLabel(a, 0), d.c));
  GradSums<T>(a, d, a.in[0].as<const T>(), a.in[2].as<const T>(),
              a.in[1].as<const double>(), a.out[0].as<double>());
  return absl::OkStatus();
}

// Inputs (x, gamma, sums, gradient sums, dy); outputs (dx, dgamma, dbeta),
// each may be absent.
template <typename T>
absl::Status GradApplyKernel(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 5, 5, 3));
  HAP_ASSIGN_OR_RETURN(BatchNormDims d, CheckBatchNorm(a, t, {1}));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  HAP_RETURN_IF_ERROR(CheckBatchNormSums(a, a.in[2], InLabel(a, 2), d.c));
  HAP_RETURN_IF_ERROR(CheckBatchNormSums(a, a.in[3], InLabel(a, 3), d.c));
  HAP_RETURN_IF_ERROR(CheckInput(a, 4, t));
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[4], InLabel(a, 4), a.in[0].shape));
  const Shape shapes[] = {a.in[0].shape, {d.c}, {d.c}};
  for (int i = 0; i < 3; ++i) {
    if (!a.out[i].present()) continue;
    HAP_RETURN_IF_ERROR(CheckOutput(a, i, t, shapes[i]));
  }
  GradApply<T>(a, d, a.in[0].as<const T>(), a.in[1].as<const T>(),
               a.in[4].as<const T>(), a.in[2].as<const double>(),
               a.in[3].as<const double>(), MutablePtr<T>(a.out[0]),
               MutablePtr<T>(a.out[1]), MutablePtr<T>(a.out[2]));
  return absl::OkStatus();
}

}  // namespace

void RegisterBatchNormKernels(KernelTable& t) {
  t["batch_norm"] = HAP_FLOAT_KERNEL(BatchNormForward);
  t["batch_norm_grad"] = HAP_FLOAT_KERNEL(BatchNormBackward);
  t["batch_norm_stats"] = HAP_FLOAT_KERNEL(StatsKernel);
  t["batch_norm_apply"] = HAP_FLOAT_KERNEL(ApplyKernel);
  t["batch_norm_grad_stats"] = HAP_FLOAT_KERNEL(GradStatsKernel);
  t["batch_norm_grad_apply"] = HAP_FLOAT_KERNEL(GradApplyKernel);
}

}  // namespace hap::executor::cpu
