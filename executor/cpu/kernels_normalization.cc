// Normalisations over the last dimension: layer_norm, softmax (additive mask,
// causal mask), log_softmax. Row statistics accumulate in double (float
// softmax rows: in float lanes within blocks of simd::kSumBlock columns, in
// double across them).
#include <cmath>
#include <limits>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/kernels_simd.h"

namespace hap::executor::cpu {
namespace {

// --- layer_norm -------------------------------------------------------------------

struct RowStats {
  double mean, rstd;
};

template <typename T>
RowStats Stats(const T* x, int64_t d, double eps) {
  const double mean =
      SumOver(d, [&](int64_t j) { return static_cast<double>(x[j]); }) /
      static_cast<double>(d);
  const double sq = SumOver(d, [&](int64_t j) {
    const double c = x[j] - mean;
    return c * c;
  });
  return {mean, 1.0 / std::sqrt(sq / static_cast<double>(d) + eps)};
}

// x[..., d], gamma[d], beta[d] of dtype t; returns d.
absl::StatusOr<int64_t> CheckLayerNorm(const KernelArgs& a, DType t) {
  for (int i : {0, 1, 2}) HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
  if (a.in[0].rank() < 1) return Invalid(a, InLabel(a, 0), " has rank 0");
  const int64_t d = a.in[0].shape.back();
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[1], "gamma (input 1)", {d}));
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[2], "beta (input 2)", {d}));
  return d;
}

template <typename T>
void LayerNormRow(const T* x, const T* gamma, const T* beta, double eps,
                  int64_t d, T* y) {
  const RowStats s = Stats(x, d, eps);
  const T mean = static_cast<T>(s.mean);
  const T rstd = static_cast<T>(s.rstd);
  for (int64_t j = 0; j < d; ++j) y[j] = (x[j] - mean) * rstd * gamma[j] + beta[j];
}

template <typename T>
absl::Status LayerNormForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(int64_t d, CheckLayerNorm(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, a.in[0].shape));
  HAP_ASSIGN_OR_RETURN(double eps, AttrFloat(a, "eps", 1e-5));
  const T* x = a.in[0].as<const T>();
  const T* gamma = a.in[1].as<const T>();
  const T* beta = a.in[2].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, d == 0 ? 0 : a.in[0].num_elements() / d, GrainFor(4 * d),
              [&](int64_t b, int64_t e) {
                for (int64_t r = b; r < e; ++r) {
                  LayerNormRow(x + r * d, gamma, beta, eps, d, y + r * d);
                }
              });
  return absl::OkStatus();
}

// One row of the backward: dx += (when dx is not null), and the partial
// sums pg[0, d) += dy * xhat, pg[d, 2d) += dy (when pg is not null); xhat
// is scratch of d.
template <typename T>
void LayerNormGradRow(const T* x, const T* gamma, const T* dy, double eps,
                      int64_t d, double* xhat, T* dx, double* pg) {
  const RowStats s = Stats(x, d, eps);
  for (int64_t j = 0; j < d; ++j) xhat[j] = (x[j] - s.mean) * s.rstd;
  const double mg =
      SumOver(d, [&](int64_t j) { return double(dy[j]) * gamma[j]; }) /
      static_cast<double>(d);
  const double mgx =
      SumOver(d, [&](int64_t j) { return double(dy[j]) * gamma[j] * xhat[j]; }) /
      static_cast<double>(d);
  if (dx != nullptr) {
    for (int64_t j = 0; j < d; ++j) {
      const double gj = double(dy[j]) * gamma[j];
      dx[j] += static_cast<T>(s.rstd * (gj - mg - xhat[j] * mgx));
    }
  }
  if (pg != nullptr) {
    for (int64_t j = 0; j < d; ++j) {
      pg[j] += dy[j] * xhat[j];
      pg[d + j] += dy[j];
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma;
// dgamma = sum over rows of dy * xhat; dbeta = sum over rows of dy.
template <typename T>
absl::Status LayerNormBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(int64_t d, CheckLayerNorm(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.x(0).shape}));
  HAP_ASSIGN_OR_RETURN(double eps, AttrFloat(a, "eps", 1e-5));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* x = g.x(0).as<const T>();
  const T* gamma = g.x(1).as<const T>();
  const T* dy = g.dy(0).as<const T>();
  T* dx = g.dx(0).present() ? g.dx(0).as<T>() : nullptr;
  const bool param_grads = g.dx(1).present() || g.dx(2).present();
  const int64_t rows = d == 0 ? 0 : g.x(0).num_elements() / d;
  const int chunks = NumChunks(a.ctx.num_threads, rows, GrainFor(6 * d));
  // Per chunk: dgamma then dbeta partial sums.
  std::vector<double> partial(param_grads ? 2 * d * chunks : 0, 0.0);
  RunChunks(chunks, rows, [&](int c, int64_t b, int64_t e) {
    std::vector<double> xhat(d);
    double* pg = param_grads ? partial.data() + 2 * d * c : nullptr;
    for (int64_t r = b; r < e; ++r) {
      LayerNormGradRow(x + r * d, gamma, dy + r * d, eps, d, xhat.data(),
                       dx != nullptr ? dx + r * d : nullptr, pg);
    }
  });
  for (int which : {1, 2}) {
    if (!g.dx(which).present()) continue;
    T* out = g.dx(which).as<T>();
    const int64_t base = which == 1 ? 0 : d;
    for (int64_t j = 0; j < d; ++j) {
      double v = 0;
      for (int c = 0; c < chunks; ++c) v += partial[2 * d * c + base + j];
      out[j] += static_cast<T>(v);
    }
  }
  return absl::OkStatus();
}

// --- softmax, log_softmax ---------------------------------------------------------

// The last-axis check of both ops: attribute "axis" must name it.
absl::Status CheckLastAxis(const KernelArgs& a, const TensorView& x) {
  if (x.rank() < 1) return Invalid(a, "input 0 has rank 0");
  HAP_ASSIGN_OR_RETURN(int64_t axis, AttrInt(a, "axis", -1));
  HAP_ASSIGN_OR_RETURN(int ax, NormalizeAxis(a, axis, x.rank(), "axis"));
  if (ax != x.rank() - 1) {
    return Invalid(a, "is supported over the last axis only");
  }
  return absl::OkStatus();
}

// How softmax masks a row: an additive mask broadcast to x, and the causal
// rule (row i of the last two dimensions keeps columns j <= i).
template <typename T>
struct SoftmaxMask {
  const T* mask = nullptr;
  std::vector<int64_t> row_strides;  // the mask's over x's leading dims
  int64_t col_stride = 0;
  bool causal = false;
  Shape lead;           // x's dims but the last
  int64_t square = 1;   // x's second-to-last dim (causal)

  int64_t MaskOffset(int64_t r) const {
    int64_t off = 0;
    for (int d = static_cast<int>(lead.size()) - 1; d >= 0; --d) {
      off += (r % lead[d]) * row_strides[d];
      r /= lead[d];
    }
    return off;
  }
  // Columns [0, Valid(r)) take part.
  int64_t Valid(int64_t r, int64_t cols) const {
    return causal ? std::min(cols, r % square + 1) : cols;
  }
};

template <typename T>
absl::StatusOr<SoftmaxMask<T>> MakeMask(const KernelArgs& a, const Shape& x,
                                        const TensorView* mask) {
  SoftmaxMask<T> m;
  HAP_ASSIGN_OR_RETURN(m.causal, AttrBool(a, "causal", false));
  m.lead.assign(x.begin(), x.end() - 1);
  if (m.causal) {
    if (x.size() < 2) return Invalid(a, "causal softmax needs rank >= 2");
    m.square = x[x.size() - 2];
  }
  if (mask != nullptr && mask->present()) {
    HAP_RETURN_IF_ERROR(CheckInput(a, 1, DTypeOf<T>()));
    if (!BroadcastsTo(mask->shape, x)) {
      return Invalid(a, "mask ", InLabel(a, 1), " does not broadcast to ",
                     graph::ShapeString(x));
    }
    std::vector<int64_t> st = BroadcastStrides(mask->shape, x);
    m.mask = mask->as<const T>();
    m.col_stride = st.back();
    m.row_strides.assign(st.begin(), st.end() - 1);
  }
  return m;
}

// y = softmax (or log_softmax) of row x (+ mask row) over its first `valid`
// columns; masked columns get 0 (softmax). The double path; float rows run
// simd::FloatRows::softmax_row (kernels_simd.h), the same computation.
template <bool kLog>
void SoftmaxRow(const double* x, const double* mask, int64_t ms, int64_t valid,
                int64_t cols, double* y) {
  if (mask != nullptr) {
    for (int64_t j = 0; j < valid; ++j) y[j] = x[j] + mask[j * ms];
  } else {
    std::copy(x, x + valid, y);
  }
  const double mx = MaxOf(y, valid);
  if constexpr (kLog) {
    const double sum =
        SumOver(valid, [&](int64_t j) { return std::exp(y[j] - mx); });
    const double lse = mx + std::log(sum);
    for (int64_t j = 0; j < valid; ++j) y[j] -= lse;
  } else {
    for (int64_t j = 0; j < valid; ++j) y[j] = std::exp(y[j] - mx);
    const double inv = 1.0 / SumOver(valid, [&](int64_t j) { return y[j]; });
    for (int64_t j = 0; j < valid; ++j) y[j] *= inv;
  }
  for (int64_t j = valid; j < cols; ++j) y[j] = 0;
}

// Forward of softmax (kLog false; inputs x, mask?) or log_softmax.
template <typename T, bool kLog>
void SoftmaxRows(const KernelArgs& a, const T* x, const SoftmaxMask<T>& m,
                 int64_t rows, int64_t cols, T* y) {
  ParallelFor(a.ctx.num_threads, rows, GrainFor(4 * cols),
              [&](int64_t b, int64_t e) {
                for (int64_t r = b; r < e; ++r) {
                  const T* mr = m.mask ? m.mask + m.MaskOffset(r) : nullptr;
                  const int64_t valid = m.Valid(r, cols);
                  if constexpr (std::is_same_v<T, float>) {
                    simd::Rows().softmax_row(x + r * cols, mr, m.col_stride,
                                             valid, cols, kLog, y + r * cols);
                  } else {
                    SoftmaxRow<kLog>(x + r * cols, mr, m.col_stride, valid,
                                     cols, y + r * cols);
                  }
                }
              });
}

template <typename T, bool kLog>
absl::Status SoftmaxForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, kLog ? 1 : 2, 1));
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  const TensorView& x = a.in[0];
  HAP_RETURN_IF_ERROR(CheckLastAxis(a, x));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, x.shape));
  HAP_ASSIGN_OR_RETURN(SoftmaxMask<T> m,
                       MakeMask<T>(a, x.shape,
                                   a.in.size() > 1 ? &a.in[1] : nullptr));
  const int64_t cols = x.shape.back();
  SoftmaxRows<T, kLog>(a, x.as<const T>(), m, cols == 0 ? 0 : x.num_elements() / cols, cols,
                       a.out[0].as<T>());
  return absl::OkStatus();
}

// One row of the backward, the double path (float rows run
// simd::FloatRows::softmax_grad_row).
template <bool kLog>
void SoftmaxGradRow(const double* y, const double* dy, int64_t cols,
                    double* dx) {
  const double s =
      SumOver(cols, [&](int64_t j) { return kLog ? dy[j] : dy[j] * y[j]; });
  for (int64_t j = 0; j < cols; ++j) {
    if constexpr (kLog) {
      dx[j] += dy[j] - std::exp(y[j]) * s;
    } else {
      dx[j] += y[j] * (dy[j] - s);
    }
  }
}

// softmax: dx += y * (dy - sum(dy * y)); log_softmax: dx += dy - exp(y) *
// sum(dy). An absent y is recomputed.
template <typename T, bool kLog>
absl::Status SoftmaxBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 1, kLog ? 1 : 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  const TensorView& x = g.x(0);
  HAP_RETURN_IF_ERROR(CheckLastAxis(a, x));
  HAP_RETURN_IF_ERROR(g.Check(t, {x.shape}));
  HAP_ASSIGN_OR_RETURN(SoftmaxMask<T> m,
                       MakeMask<T>(a, x.shape, g.n() > 1 ? &g.x(1) : nullptr));
  if (!g.active()) return absl::OkStatus();
  const int64_t cols = x.shape.back();
  const int64_t rows = cols == 0 ? 0 : x.num_elements() / cols;
  HostTensor recomputed;
  const T* y = g.y(0).present() ? g.y(0).as<const T>() : nullptr;
  if (y == nullptr) {
    recomputed = HostTensor(t, x.shape);
    SoftmaxRows<T, kLog>(a, x.as<const T>(), m, rows, cols,
                         recomputed.as<T>());
    y = recomputed.as<const T>();
  }
  const T* dy = g.dy(0).as<const T>();
  T* dx = g.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, rows, GrainFor(4 * cols),
              [&](int64_t b, int64_t e) {
                for (int64_t r = b; r < e; ++r) {
                  if constexpr (std::is_same_v<T, float>) {
                    simd::Rows().softmax_grad_row(y + r * cols, dy + r * cols,
                                                  cols, kLog, dx + r * cols);
                  } else {
                    SoftmaxGradRow<kLog>(y + r * cols, dy + r * cols, cols,
                                         dx + r * cols);
                  }
                }
              });
  return absl::OkStatus();
}

}  // namespace

void RegisterNormalizationKernels(KernelTable& t) {
  t["layer_norm"] = HAP_FLOAT_KERNEL(LayerNormForward);
  t["layer_norm_grad"] = HAP_FLOAT_KERNEL(LayerNormBackward);
  t["softmax"] = FloatKernel(&SoftmaxForward<float, false>,
                             &SoftmaxForward<double, false>);
  t["softmax_grad"] = FloatKernel(&SoftmaxBackward<float, false>,
                                  &SoftmaxBackward<double, false>);
  t["log_softmax"] = FloatKernel(&SoftmaxForward<float, true>,
                                 &SoftmaxForward<double, true>);
  t["log_softmax_grad"] = FloatKernel(&SoftmaxBackward<float, true>,
                                      &SoftmaxBackward<double, true>);
}

}  // namespace hap::executor::cpu
