// Losses averaged over rows: nll_loss on log-probabilities, cross_entropy on
// logits. A shard divides its local sum by "global_rows" (kernels.h).
#include <cmath>

#include "executor/cpu/kernels_internal.h"
#include "planner/util/status_macros.h"

namespace hap::executor::cpu {
namespace {

struct LossDims {
  int64_t rows = 0, classes = 0;
  double inv_rows = 1;  // 1 / global_rows
};

// x[n, c] of dtype t, targets[n] int in [0, c).
absl::StatusOr<LossDims> CheckLoss(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckIdsInput(a, 1));
  const TensorView& x = a.in[0];
  const TensorView& target = a.in[1];
  if (x.rank() != 2) return Invalid(a, InLabel(a, 0), " must have rank 2");
  LossDims d;
  d.rows = x.shape[0];
  d.classes = x.shape[1];
  if (target.shape != Shape{d.rows}) {
    return Invalid(a, "targets ", InLabel(a, 1), " must have one entry per row of ",
                   InLabel(a, 0));
  }
  for (int64_t i = 0; i < d.rows; ++i) {
    const int64_t c = IdAt(target, i);
    if (c < 0 || c >= d.classes) {
      return Invalid(a, "target ", c, " at row ", i, " is outside [0, ",
                     d.classes, ")");
    }
  }
  HAP_ASSIGN_OR_RETURN(int64_t global, AttrInt(a, "global_rows", d.rows));
  if (global < 1) return Invalid(a, "attribute 'global_rows' must be >= 1");
  d.inv_rows = 1.0 / static_cast<double>(global);
  return d;
}

absl::Status CheckScalar(const KernelArgs& a, const TensorView& v,
                         absl::string_view what) {
  if (v.present() && v.num_elements() != 1) {
    return Invalid(a, what, " (", Describe(v), ") must be a scalar");
  }
  return absl::OkStatus();
}

// log-sum-exp of a row; the sum in double.
template <typename T>
double LogSumExp(const T* x, int64_t n) {
  const T mx = MaxOf(x, n);
  return mx + std::log(SumOver(n, [&](int64_t j) { return double(Exp<T>(x[j] - mx)); }));
}

template <typename T, bool kLogits>
absl::Status LossForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(LossDims d, CheckLoss(a, t));
  if (!a.out[0].present() || a.out[0].dtype != t) {
    return Invalid(a, OutLabel(a, 0), " must be a ", graph::DTypeName(t),
                   " scalar");
  }
  HAP_RETURN_IF_ERROR(CheckScalar(a, a.out[0], "output 0"));
  const T* x = a.in[0].as<const T>();
  double sum = 0;
  for (int64_t i = 0; i < d.rows; ++i) {
    const T* row = x + i * d.classes;
    const double picked = row[IdAt(a.in[1], i)];
    sum += kLogits ? LogSumExp(row, d.classes) - picked : -picked;
  }
  *a.out[0].as<T>() = static_cast<T>(sum * d.inv_rows);
  return absl::OkStatus();
}

// dx += scale * softmax(x) over a row.
template <typename T>
void SoftmaxGradRow(const T* x, int64_t n, double scale, T* dx) {
  const T lse = static_cast<T>(LogSumExp(x, n));
  const T s = static_cast<T>(scale);
  for (int64_t j = 0; j < n; ++j) dx[j] += s * Exp<T>(x[j] - lse);
}

// nll_loss: dx[i, t_i] -= g / rows; cross_entropy: dx[i] += g / rows *
// (softmax(x[i]) - onehot(t_i)).
template <typename T, bool kLogits>
absl::Status LossBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_ASSIGN_OR_RETURN(LossDims d, CheckLoss(a, t));
  for (int idx : {2, 3}) {
    if (a.in[idx].present() && a.in[idx].dtype != t) {
      return Invalid(a, InLabel(a, idx), " must be ", graph::DTypeName(t));
    }
    HAP_RETURN_IF_ERROR(CheckScalar(a, a.in[idx], absl::StrCat("input ", idx)));
  }
  HAP_RETURN_IF_ERROR(
      g.Check(t, {g.y(0).present() ? g.y(0).shape : g.dy(0).shape}));
  if (!g.active()) return absl::OkStatus();
  const double scale = *g.dy(0).as<const T>() * d.inv_rows;
  const T* x = g.x(0).as<const T>();
  T* dx = g.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, d.rows, GrainFor(4 * d.classes),
              [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) {
                  const int64_t c = IdAt(g.x(1), i);
                  T* dr = dx + i * d.classes;
                  if (kLogits) SoftmaxGradRow(x + i * d.classes, d.classes, scale, dr);
                  dr[c] -= static_cast<T>(scale);
                }
              });
  return absl::OkStatus();
}

}  // namespace

void RegisterLossKernels(KernelTable& t) {
  t["nll_loss"] =
      FloatKernel(&LossForward<float, false>, &LossForward<double, false>);
  t["nll_loss_grad"] =
      FloatKernel(&LossBackward<float, false>, &LossBackward<double, false>);
  t["cross_entropy"] =
      FloatKernel(&LossForward<float, true>, &LossForward<double, true>);
  t["cross_entropy_grad"] =
      FloatKernel(&LossBackward<float, true>, &LossBackward<double, true>);
}

}  // namespace hap::executor::cpu
