// lstm and lstm_grad, gru and gru_grad: one LSTM or GRU layer, one
// direction (planner/graph ops_lstm.cc). The GRU follows the LSTM's scheme
// below with its own cell (lstm_cell.h GruCellForward). The input products of every step are one
// GEMM, the recurrent product one GEMM a step, the cell element-wise (lstm_cell.h). The backward
// recomputes the forward (gate activations and cell states are not kept between the passes), then
// runs backpropagation through time: per step the gate gradients and one GEMM for the recurrent
// gradient, then one GEMM each for dx, dw_ih and dw_hh.
#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/lstm_cell.h"

namespace hap::executor::cpu {

namespace {

// CheckLstm and CheckGru: `gates` stacked gates of h rows each.
absl::StatusOr<LstmDims> CheckRecurrent(const KernelArgs& a, DType t, int n, int64_t gates) {
  for (int i = 0; i < 3; ++i) HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
  const TensorView& x = a.in[0];
  if (x.rank() != 3) return Invalid(a, InLabel(a, 0), " must be [batch, seq, input]");
  LstmDims d;
  d.b = x.shape[0];
  d.s = x.shape[1];
  d.in = x.shape[2];
  const TensorView& w_hh = a.in[2];
  if (w_hh.rank() != 2 || w_hh.shape[1] < 1 || w_hh.shape[0] != gates * w_hh.shape[1]) {
    return Invalid(a, InLabel(a, 2), " must be [", gates, " * hidden, hidden]");
  }
  d.h = w_hh.shape[1];
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[1], "input 1", {gates * d.h, d.in}));
  for (int i = 3; i < 5; ++i) {
    if (i >= n || !a.in[i].present()) continue;
    HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
    HAP_RETURN_IF_ERROR(CheckShape(a, a.in[i], absl::StrCat("input ", i), {gates * d.h}));
  }
  HAP_ASSIGN_OR_RETURN(d.reverse, AttrBool(a, "reverse", false));
  HAP_RETURN_IF_ERROR(CheckFitsBlas(a, {d.b * d.s, gates * d.h, d.in, d.s * gates * d.h}));
  return d;
}

}  // namespace

absl::StatusOr<LstmDims> CheckLstm(const KernelArgs& a, DType t, int n) {
  return CheckRecurrent(a, t, n, 4);
}

absl::StatusOr<LstmDims> CheckGru(const KernelArgs& a, DType t, int n) {
  return CheckRecurrent(a, t, n, 3);
}

namespace {

// The bias inputs' sum (absent ones are zero), or empty when both are absent.
template <typename T>
std::vector<T> BiasSum(const KernelArgs& a, const LstmDims& d, int n) {
  std::vector<T> sum;
  for (int i = 3; i < n; ++i) {
    if (!a.in[i].present()) continue;
    sum.resize(4 * d.h, T(0));
    AddTo(sum.data(), a.in[i].as<const T>(), 4 * d.h);
  }
  return sum;
}

// h_prev[b, t] ([b, s, h]): the hidden state step t read, y at the step
// before it in reading order, zero at the first (the weight gradient of
// w_hh is one product over every (sample, step) row).
template <typename T>
std::vector<T> PreviousHidden(const LstmDims& d, const T* y) {
  std::vector<T> h_prev(d.b * d.s * d.h, T(0));
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t k = 1; k < d.s; ++k) {
      const int64_t t = d.reverse ? d.s - 1 - k : k;
      const int64_t tp = d.reverse ? t + 1 : t - 1;
      std::copy_n(y + (b * d.s + tp) * d.h, d.h, h_prev.data() + (b * d.s + t) * d.h);
    }
  }
  return h_prev;
}

// out[col] += the sum over rows of m[row, col] (m [rows, cols]), in double.
template <typename T>
void AddColumnSums(int64_t rows, int64_t cols, const T* m, T* out) {
  for (int64_t col = 0; col < cols; ++col) {
    out[col] += static_cast<T>(
        SumOver(rows, [&](int64_t r) { return static_cast<double>(m[r * cols + col]); }));
  }
}

// The gradients of the inputs once the steps have run backwards, added to
// those requested: dx, dw_ih and b_ih's from the input pre-activations'
// gradients d_in ([b*s, gates]), dw_hh and b_hh's from the hidden
// projection's d_hid (the same matrix for the LSTM); y the hidden states.
template <typename T>
void AddInputGradients(const GradArgs& g, const LstmDims& d, int64_t gates, const T* d_in,
                       const T* d_hid, const T* y) {
  const int64_t rows = d.b * d.s;
  if (g.dx(0).present()) {
    Gemm<T>(false, false, rows, d.in, gates, T(1), d_in, gates, g.x(1).as<const T>(), d.in, T(1),
            g.dx(0).as<T>(), d.in);
  }
  if (g.dx(1).present()) {
    Gemm<T>(true, false, gates, d.in, rows, T(1), d_in, gates, g.x(0).as<const T>(), d.in, T(1),
            g.dx(1).as<T>(), d.in);
  }
  if (g.dx(2).present()) {
    // Each step's gate gradients against the hidden state it read (zero at
    // the first step): one product over every (sample, step) row.
    const std::vector<T> h_prev = PreviousHidden<T>(d, y);
    Gemm<T>(true, false, gates, d.h, rows, T(1), d_hid, gates, h_prev.data(), d.h, T(1),
            g.dx(2).as<T>(), d.h);
  }
  if (g.n() > 3 && g.dx(3).present()) AddColumnSums<T>(rows, gates, d_in, g.dx(3).as<T>());
  if (g.n() > 4 && g.dx(4).present()) AddColumnSums<T>(rows, gates, d_hid, g.dx(4).as<T>());
}

// The forward over the whole sequence: gates (b*s*4h) ends holding the
// activations, c (b*s*h) the cell states, y (b*s*h) the hidden states.
template <typename T>
void Forward(const KernelArgs& a, const LstmDims& d, int n, T* gates, T* c, T* y) {
  const T* x = a.in[0].as<const T>();
  const T* w_ih = a.in[1].as<const T>();
  const T* w_hh = a.in[2].as<const T>();
  const int64_t g4 = 4 * d.h, rows = d.b * d.s;
  Gemm<T>(false, true, rows, g4, d.in, T(1), x, d.in, w_ih, d.in, T(0), gates, g4);
  const std::vector<T> bias = BiasSum<T>(a, d, n);
  if (!bias.empty()) {
    ParallelFor(a.ctx.num_threads, rows, GrainFor(g4), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) AddTo(gates + r * g4, bias.data(), g4);
    });
  }
  for (int64_t k = 0; k < d.s; ++k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    if (k > 0) {
      Gemm<T>(false, true, d.b, g4, d.h, T(1), y + tp * d.h, d.s * d.h, w_hh, d.h, T(1),
              gates + t * g4, d.s * g4);
    }
    ParallelFor(a.ctx.num_threads, d.b, GrainFor(8 * d.h), [&](int64_t n0, int64_t n1) {
      for (int64_t b = n0; b < n1; ++b) {
        T* gr = gates + (b * d.s + t) * g4;
        const int64_t o = (b * d.s + t) * d.h, op = (b * d.s + tp) * d.h;
        for (int64_t j = 0; j < d.h; ++j) {
          lstm::CellForward<T>(gr, d.h, j, k > 0 ? c[op + j] : T(0), c + o + j, y + o + j);
        }
      }
    });
  }
}

template <typename T>
absl::Status LstmForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(LstmDims d, CheckLstm(a, t, static_cast<int>(a.in.size())));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {d.b, d.s, d.h}));
  std::vector<T> gates(d.b * d.s * 4 * d.h), c(d.b * d.s * d.h);
  Forward<T>(a, d, static_cast<int>(a.in.size()), gates.data(), c.data(), a.out[0].as<T>());
  return absl::OkStatus();
}

template <typename T>
absl::Status LstmBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(LstmDims d, CheckLstm(a, t, g.n()));
  HAP_RETURN_IF_ERROR(g.Check(t, {{d.b, d.s, d.h}}));
  if (!g.dy(0).present() || !g.any_dx()) return absl::OkStatus();
  const int64_t g4 = 4 * d.h, rows = d.b * d.s, nh = rows * d.h;
  std::vector<T> act(rows * g4), c(nh), y(nh);
  Forward<T>(a, d, g.n(), act.data(), c.data(), y.data());

  const T* dy = g.dy(0).as<const T>();
  const T* w_hh = g.x(2).as<const T>();
  std::vector<T> dgates(rows * g4), dh_next(d.b * d.h, T(0)), dc_next(d.b * d.h, T(0));
  for (int64_t k = d.s - 1; k >= 0; --k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    ParallelFor(a.ctx.num_threads, d.b, GrainFor(12 * d.h), [&](int64_t n0, int64_t n1) {
      for (int64_t b = n0; b < n1; ++b) {
        const int64_t r = b * d.s + t, o = r * d.h, op = (b * d.s + tp) * d.h;
        for (int64_t j = 0; j < d.h; ++j) {
          T& dc = dc_next[b * d.h + j];  // the next step's, then this one's c_prev's
          dc =
              lstm::CellBackward<T>(act.data() + r * g4, d.h, j, c[o + j], k > 0 ? c[op + j] : T(0),
                                    dy[o + j] + dh_next[b * d.h + j], dc, dgates.data() + r * g4);
        }
      }
    });
    if (k > 0) {  // the previous step's hidden state feeds every gate of this one
      Gemm<T>(false, false, d.b, d.h, g4, T(1), dgates.data() + t * g4, d.s * g4, w_hh, d.h, T(0),
              dh_next.data(), d.h);
    }
  }
  AddInputGradients<T>(g, d, g4, dgates.data(), dgates.data(), y.data());
  return absl::OkStatus();
}

// --- gru ---------------------------------------------------------------------

// The GRU forward over the whole sequence: xg (b*s*3h) ends holding the
// activations (r, z, n), hn (b*s*h) the hidden projections' n part
// (h_prev W_hn^T + b_hn), y (b*s*h) the hidden states; hg (b*3h) is scratch.
template <typename T>
void GruForward(const KernelArgs& a, const LstmDims& d, int n, T* xg, T* hn, T* y, T* hg) {
  const T* w_hh = a.in[2].as<const T>();
  const T* b_ih = n > 3 && a.in[3].present() ? a.in[3].as<const T>() : nullptr;
  const T* b_hh = n > 4 && a.in[4].present() ? a.in[4].as<const T>() : nullptr;
  const int64_t g3 = 3 * d.h, rows = d.b * d.s;
  Gemm<T>(false, true, rows, g3, d.in, T(1), a.in[0].as<const T>(), d.in, a.in[1].as<const T>(),
          d.in, T(0), xg, g3);
  if (b_ih != nullptr) {
    ParallelFor(a.ctx.num_threads, rows, GrainFor(g3), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) AddTo(xg + r * g3, b_ih, g3);
    });
  }
  for (int64_t k = 0; k < d.s; ++k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    if (k > 0) {
      Gemm<T>(false, true, d.b, g3, d.h, T(1), y + tp * d.h, d.s * d.h, w_hh, d.h, T(0), hg, g3);
    }
    ParallelFor(a.ctx.num_threads, d.b, GrainFor(8 * d.h), [&](int64_t n0, int64_t n1) {
      for (int64_t b = n0; b < n1; ++b) {
        const int64_t r = b * d.s + t, o = r * d.h, op = (b * d.s + tp) * d.h;
        for (int64_t j = 0; j < d.h; ++j) {
          lstm::GruCellForward<T>(xg + r * g3, k > 0 ? hg + b * g3 : nullptr, b_hh, d.h, j,
                                  k > 0 ? y[op + j] : T(0), hn + o + j, y + o + j);
        }
      }
    });
  }
}

template <typename T>
absl::Status GruForwardKernel(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(LstmDims d, CheckGru(a, t, static_cast<int>(a.in.size())));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {d.b, d.s, d.h}));
  std::vector<T> xg(d.b * d.s * 3 * d.h), hn(d.b * d.s * d.h), hg(d.b * 3 * d.h);
  GruForward<T>(a, d, static_cast<int>(a.in.size()), xg.data(), hn.data(), a.out[0].as<T>(),
                hg.data());
  return absl::OkStatus();
}

// Recomputes the forward, then per step backwards: the cell's gradients
// (dxg for the input side, dhg for the hidden projection, which r scales on
// the n gate) and h_prev's, dh * z plus dhg W_hh; then one GEMM each for dx,
// dw_ih (from dxg) and dw_hh (from dhg), the biases' column sums.
template <typename T>
absl::Status GruBackwardKernel(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(LstmDims d, CheckGru(a, t, g.n()));
  HAP_RETURN_IF_ERROR(g.Check(t, {{d.b, d.s, d.h}}));
  if (!g.dy(0).present() || !g.any_dx()) return absl::OkStatus();
  const int64_t g3 = 3 * d.h, rows = d.b * d.s, nh = rows * d.h;
  std::vector<T> act(rows * g3), hn(nh), y(nh), hg(d.b * g3);
  GruForward<T>(a, d, g.n(), act.data(), hn.data(), y.data(), hg.data());

  const T* dy = g.dy(0).as<const T>();
  const T* w_hh = g.x(2).as<const T>();
  std::vector<T> dxg(rows * g3), dhg(rows * g3), dh_next(d.b * d.h, T(0));
  for (int64_t k = d.s - 1; k >= 0; --k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    ParallelFor(a.ctx.num_threads, d.b, GrainFor(12 * d.h), [&](int64_t n0, int64_t n1) {
      for (int64_t b = n0; b < n1; ++b) {
        const int64_t r = b * d.s + t, o = r * d.h, op = (b * d.s + tp) * d.h;
        for (int64_t j = 0; j < d.h; ++j) {
          T& dh = dh_next[b * d.h + j];  // the next step's, then this one's h_prev's
          dh = lstm::GruCellBackward<T>(act.data() + r * g3, d.h, j, hn[o + j],
                                        k > 0 ? y[op + j] : T(0), dy[o + j] + dh,
                                        dxg.data() + r * g3, dhg.data() + r * g3);
        }
      }
    });
    if (k > 0) {
      Gemm<T>(false, false, d.b, d.h, g3, T(1), dhg.data() + t * g3, d.s * g3, w_hh, d.h, T(1),
              dh_next.data(), d.h);
    }
  }
  AddInputGradients<T>(g, d, g3, dxg.data(), dhg.data(), y.data());
  return absl::OkStatus();
}

}  // namespace

void RegisterLstmKernels(KernelTable& t) {
  t["lstm"] = HAP_FLOAT_KERNEL(LstmForward);
  t["lstm_grad"] = HAP_FLOAT_KERNEL(LstmBackward);
  t["gru"] = HAP_FLOAT_KERNEL(GruForwardKernel);
  t["gru_grad"] = HAP_FLOAT_KERNEL(GruBackwardKernel);
}

}  // namespace hap::executor::cpu
