// lstm and lstm_grad: one LSTM layer, one direction (planner/graph
// ops_lstm.cc). The input products of every step are one GEMM, the
// recurrent product one GEMM a step, the cell element-wise (lstm_cell.h).
// The backward recomputes the forward (gate activations and cell states are
// not kept between the passes), then runs backpropagation through time: per
// step the gate gradients and one GEMM for the recurrent gradient, then one
// GEMM each for dx, dw_ih and dw_hh.
#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/lstm_cell.h"

namespace hap::executor::cpu {

absl::StatusOr<LstmDims> CheckLstm(const KernelArgs& a, DType t, int n) {
  for (int i = 0; i < 3; ++i) HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
  const TensorView& x = a.in[0];
  if (x.rank() != 3) return Invalid(a, InLabel(a, 0), " must be [batch, seq, input]");
  LstmDims d;
  d.b = x.shape[0];
  d.s = x.shape[1];
  d.in = x.shape[2];
  const TensorView& w_hh = a.in[2];
  if (w_hh.rank() != 2 || w_hh.shape[1] < 1 || w_hh.shape[0] != 4 * w_hh.shape[1]) {
    return Invalid(a, InLabel(a, 2), " must be [4 * hidden, hidden]");
  }
  d.h = w_hh.shape[1];
  HAP_RETURN_IF_ERROR(CheckShape(a, a.in[1], "input 1", {4 * d.h, d.in}));
  for (int i = 3; i < 5; ++i) {
    if (i >= n || !a.in[i].present()) continue;
    HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
    HAP_RETURN_IF_ERROR(CheckShape(a, a.in[i], absl::StrCat("input ", i), {4 * d.h}));
  }
  HAP_ASSIGN_OR_RETURN(d.reverse, AttrBool(a, "reverse", false));
  HAP_RETURN_IF_ERROR(CheckFitsBlas(a, {d.b * d.s, 4 * d.h, d.in, d.s * 4 * d.h}));
  return d;
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
  if (g.dx(0).present()) {
    Gemm<T>(false, false, rows, d.in, g4, T(1), dgates.data(), g4, g.x(1).as<const T>(), d.in, T(1),
            g.dx(0).as<T>(), d.in);
  }
  if (g.dx(1).present()) {
    Gemm<T>(true, false, g4, d.in, rows, T(1), dgates.data(), g4, g.x(0).as<const T>(), d.in, T(1),
            g.dx(1).as<T>(), d.in);
  }
  if (g.dx(2).present()) {
    // Each step's gate gradients against the hidden state it read (zero at
    // the first step): one product over every (sample, step) row.
    std::vector<T> h_prev(nh, T(0));
    for (int64_t b = 0; b < d.b; ++b) {
      for (int64_t k = 1; k < d.s; ++k) {
        const int64_t t = d.reverse ? d.s - 1 - k : k;
        const int64_t tp = d.reverse ? t + 1 : t - 1;
        std::copy_n(y.data() + (b * d.s + tp) * d.h, d.h, h_prev.data() + (b * d.s + t) * d.h);
      }
    }
    Gemm<T>(true, false, g4, d.h, rows, T(1), dgates.data(), g4, h_prev.data(), d.h, T(1),
            g.dx(2).as<T>(), d.h);
  }
  for (int i = 3; i < g.n(); ++i) {
    if (!g.dx(i).present()) continue;
    T* db = g.dx(i).as<T>();
    for (int64_t col = 0; col < g4; ++col) {
      db[col] += static_cast<T>(
          SumOver(rows, [&](int64_t r) { return static_cast<double>(dgates[r * g4 + col]); }));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterLstmKernels(KernelTable& t) {
  t["lstm"] = HAP_FLOAT_KERNEL(LstmForward);
  t["lstm_grad"] = HAP_FLOAT_KERNEL(LstmBackward);
}

}  // namespace hap::executor::cpu
