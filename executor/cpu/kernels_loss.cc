// Losses averaged over rows: nll_loss on log-probabilities, cross_entropy on
// logits. A shard divides its local sum by "global_rows" (kernels.h).
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/kernels_simd.h"

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

// A row's log-sum-exp and softmax: float rows run the vectorized loops of
// simd::FloatRows, double rows the same in double.
template <typename T>
double RowLse(const T* x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return simd::Rows().log_sum_exp_row(x, n);
  } else {
    return LogSumExp(x, n);
  }
}
template <typename T>
void SoftmaxOfRow(const T* x, int64_t n, T* y) {
  if constexpr (std::is_same_v<T, float>) {
    simd::Rows().softmax_row(x, nullptr, 0, n, n, false, y);
  } else {
    const double lse = LogSumExp(x, n);
    for (int64_t j = 0; j < n; ++j) y[j] = std::exp(x[j] - lse);
  }
}

// Rows [b, e) in blocks, each thread with its own row of scratch; fn(i,
// scratch) per row.
template <typename T, typename Fn>
void RowsWithScratch(const KernelArgs& a, int64_t rows, int64_t cols, Fn&& fn) {
  ParallelFor(a.ctx.num_threads, rows, GrainFor(4 * cols),
              [&](int64_t b, int64_t e) {
                std::vector<T> scratch(static_cast<size_t>(cols));
                for (int64_t i = b; i < e; ++i) fn(i, scratch.data());
              });
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
  if constexpr (kLogits) {
    // Rows in parallel, summed in row order (the same for any thread count).
    std::vector<double> per_row(static_cast<size_t>(d.rows));
    ParallelFor(a.ctx.num_threads, d.rows, GrainFor(2 * d.classes),
                [&](int64_t b, int64_t e) {
                  for (int64_t i = b; i < e; ++i) {
                    const T* row = x + i * d.classes;
                    per_row[i] = RowLse(row, d.classes) - row[IdAt(a.in[1], i)];
                  }
                });
    sum = std::accumulate(per_row.begin(), per_row.end(), 0.0);
  } else {
    for (int64_t i = 0; i < d.rows; ++i) sum -= x[i * d.classes + IdAt(a.in[1], i)];
  }
  *a.out[0].as<T>() = static_cast<T>(sum * d.inv_rows);
  return absl::OkStatus();
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
  const T s = static_cast<T>(scale);
  if (!kLogits) {
    for (int64_t i = 0; i < d.rows; ++i) dx[i * d.classes + IdAt(g.x(1), i)] -= s;
    return absl::OkStatus();
  }
  RowsWithScratch<T>(a, d.rows, d.classes, [&](int64_t i, T* p) {
    T* dr = dx + i * d.classes;
    SoftmaxOfRow<T>(x + i * d.classes, d.classes, p);
    for (int64_t j = 0; j < d.classes; ++j) dr[j] += s * p[j];
    dr[IdAt(g.x(1), i)] -= s;
  });
  return absl::OkStatus();
}

// --- cross-entropy over logits sharded by class (vocabulary-parallel) ------
// A rank holds x[rows, classes_local], the classes [vocab_offset,
// vocab_offset + classes_local) of "vocab_size". "cross_entropy_lse" gives
// its rows' log-sum-exp over its classes; the ranks all-gather those
// ([ranks * rows], rank-major); then "cross_entropy_sharded" gives this
// rank's part of the mean loss (its targets' -x, and on rank 0 the rows'
// global log-sum-exp), and "cross_entropy_sharded_grad" its classes'
// gradient, dx += dy / global_rows * (softmax - onehot).

// CheckShardedLoss, and every target within the vocabulary.
template <typename T>
absl::StatusOr<ShardedLossDims> CheckShardedLossOnHost(const KernelArgs& a, bool with_lse) {
  HAP_ASSIGN_OR_RETURN(ShardedLossDims d, CheckShardedLoss(a, DTypeOf<T>(), with_lse));
  if (!with_lse) return d;
  for (int64_t i = 0; i < d.rows; ++i) {
    const int64_t c = IdAt(a.in[1], i);
    if (c < 0 || c >= d.vocab) {
      return Invalid(a, "target ", c, " at row ", i, " is outside [0, ", d.vocab, ")");
    }
  }
  return d;
}

// Row i's log-sum-exp over every rank's classes, from the gathered ones.
template <typename T>
double GlobalLse(const T* lse, const ShardedLossDims& d, int64_t i) {
  double mx = lse[i];
  for (int64_t r = 1; r < d.ranks; ++r) mx = std::max(mx, double(lse[r * d.rows + i]));
  double sum = 0;
  for (int64_t r = 0; r < d.ranks; ++r) sum += std::exp(double(lse[r * d.rows + i]) - mx);
  return mx + std::log(sum);
}

template <typename T>
absl::Status ShardedLse(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(ShardedLossDims d, CheckShardedLossOnHost<T>(a, false));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, DTypeOf<T>(), {d.rows}));
  const T* x = a.in[0].as<const T>();
  T* out = a.out[0].as<T>();
  if (d.classes == 0) {  // no classes here: contributes nothing to the sum
    for (int64_t i = 0; i < d.rows; ++i) out[i] = -std::numeric_limits<T>::infinity();
    return absl::OkStatus();
  }
  ParallelFor(a.ctx.num_threads, d.rows, GrainFor(2 * d.classes),
              [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) {
                  out[i] = static_cast<T>(RowLse(x + i * d.classes, d.classes));
                }
              });
  return absl::OkStatus();
}

template <typename T>
absl::Status ShardedLossForward(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(ShardedLossDims d, CheckShardedLossOnHost<T>(a, true));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, DTypeOf<T>(), {}));
  const T* x = a.in[0].as<const T>();
  const T* lse = a.in[2].as<const T>();
  double sum = 0;
  for (int64_t i = 0; i < d.rows; ++i) {
    const int64_t c = IdAt(a.in[1], i) - d.offset;
    if (c >= 0 && c < d.classes) sum -= x[i * d.classes + c];
    if (d.rank == 0) sum += GlobalLse(lse, d, i);
  }
  *a.out[0].as<T>() = static_cast<T>(sum * d.inv_rows);
  return absl::OkStatus();
}

template <typename T>
absl::Status ShardedLossBackward(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckArity(a, 4, 4, 1));
  HAP_ASSIGN_OR_RETURN(ShardedLossDims d, CheckShardedLossOnHost<T>(a, true));
  HAP_RETURN_IF_ERROR(CheckInput(a, 3, DTypeOf<T>()));
  HAP_RETURN_IF_ERROR(CheckScalar(a, a.in[3], "input 3 (the loss gradient)"));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, DTypeOf<T>(), a.in[0].shape));
  const T* x = a.in[0].as<const T>();
  const T* lse = a.in[2].as<const T>();
  const double scale = double(*a.in[3].as<const T>()) * d.inv_rows;
  T* dx = a.out[0].as<T>();
  if (d.classes == 0) return absl::OkStatus();
  RowsWithScratch<T>(a, d.rows, d.classes, [&](int64_t i, T* q) {
    // softmax over this rank's classes, rescaled to the whole row's.
    SoftmaxOfRow<T>(x + i * d.classes, d.classes, q);
    const T f = static_cast<T>(
        scale * std::exp(double(lse[d.rank * d.rows + i]) - GlobalLse(lse, d, i)));
    T* dr = dx + i * d.classes;
    for (int64_t j = 0; j < d.classes; ++j) dr[j] += f * q[j];
    const int64_t c = IdAt(a.in[1], i) - d.offset;
    if (c >= 0 && c < d.classes) dr[c] -= static_cast<T>(scale);
  });
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ShardedLossDims> CheckShardedLoss(const KernelArgs& a, DType t,
                                                 bool with_lse) {
  // Bounds 'ranks' (so ranks x rows cannot overflow).
  constexpr int64_t kMaxRanks = int64_t{1} << 20;
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  const TensorView& x = a.in[0];
  if (x.rank() != 2) return Invalid(a, InLabel(a, 0), " must have rank 2");
  ShardedLossDims d;
  d.rows = x.shape[0];
  d.classes = x.shape[1];
  HAP_ASSIGN_OR_RETURN(d.offset, AttrInt(a, "vocab_offset"));
  HAP_ASSIGN_OR_RETURN(d.vocab, AttrInt(a, "vocab_size"));
  if (d.vocab < 1 || d.offset < 0 || d.offset > d.vocab - d.classes) {
    return Invalid(a, "attributes 'vocab_offset' ", d.offset, " and 'vocab_size' ", d.vocab,
                   ": this shard's ", d.classes, " classes do not fit the vocabulary");
  }
  if (!with_lse) return d;
  HAP_RETURN_IF_ERROR(CheckIdsInput(a, 1));
  HAP_RETURN_IF_ERROR(CheckInput(a, 2, t));
  HAP_ASSIGN_OR_RETURN(d.rank, AttrInt(a, "rank"));
  HAP_ASSIGN_OR_RETURN(d.ranks, AttrInt(a, "ranks"));
  if (d.ranks < 1 || d.ranks > kMaxRanks || d.rank < 0 || d.rank >= d.ranks) {
    return Invalid(a, "attribute 'rank' ", d.rank, " is outside a world of 'ranks' ",
                   d.ranks, " (at most ", kMaxRanks, ")");
  }
  if (a.in[1].shape != Shape{d.rows}) {
    return Invalid(a, "targets ", InLabel(a, 1), " must have one entry per row of ",
                   InLabel(a, 0));
  }
  HAP_RETURN_IF_ERROR(CheckShape(
      a, a.in[2], absl::StrCat(InLabel(a, 2), " (every rank's row log-sum-exps, ranks x rows)"),
      {d.ranks * d.rows}));
  HAP_ASSIGN_OR_RETURN(int64_t global, AttrInt(a, "global_rows", d.rows));
  if (global < 1) return Invalid(a, "attribute 'global_rows' must be >= 1");
  d.inv_rows = 1.0 / static_cast<double>(global);
  return d;
}

void RegisterLossKernels(KernelTable& t) {
  t["nll_loss"] =
      FloatKernel(&LossForward<float, false>, &LossForward<double, false>);
  t["nll_loss_grad"] =
      FloatKernel(&LossBackward<float, false>, &LossBackward<double, false>);
  t["cross_entropy"] =
      FloatKernel(&LossForward<float, true>, &LossForward<double, true>);
  t["cross_entropy_grad"] =
      FloatKernel(&LossBackward<float, true>, &LossBackward<double, true>);
  t["cross_entropy_lse"] = FloatKernel(&ShardedLse<float>, &ShardedLse<double>);
  t["cross_entropy_sharded"] =
      FloatKernel(&ShardedLossForward<float>, &ShardedLossForward<double>);
  t["cross_entropy_sharded_grad"] =
      FloatKernel(&ShardedLossBackward<float>, &ShardedLossBackward<double>);
}

}  // namespace hap::executor::cpu
