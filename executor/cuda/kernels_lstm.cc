// lstm and lstm_grad, gru and gru_grad on the GPU: the algorithm and
// contracts of executor/cpu/kernels_lstm.cc, with its argument checks
// (cpu::CheckLstm, cpu::CheckGru):
// the input products as one cuBLAS GEMM, one GEMM and one cell kernel per
// step (kernels_lstm.cu); the backward recomputes the forward into scratch,
// runs the steps backwards, then one GEMM each for dx, dw_ih and dw_hh.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/kernels_b_util.h"
#include "executor/cuda/launch_lstm.h"

namespace hap::executor::cuda {
namespace {

template <typename T>
const T* Optional(const KernelArgs& a, int i, int n) {
  return i < n && a.in[i].present() ? a.in[i].as<const T>() : nullptr;
}

// One row-major GEMM, C = op(A) @ op(B) + beta * C.
template <typename T>
absl::Status Gemm(const KernelArgs& a, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                  const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  return BatchedGemm<T>(a, ta, tb, m, n, k, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}

// The forward over the sequence (the op's first n inputs): gates ends
// holding the activations, c the cell states, y the hidden states.
template <typename T>
absl::Status Forward(const KernelArgs& a, const LstmShape& d, int64_t in, int n, T* gates, T* c,
                     T* y) {
  const int64_t g4 = 4 * d.h, rows = d.b * d.s;
  HAP_RETURN_IF_ERROR(Gemm<T>(a, false, true, rows, g4, in, a.in[0].as<const T>(), in,
                              a.in[1].as<const T>(), in, T(0), gates, g4));
  LaunchLstmBias<T>(rows, g4, Optional<T>(a, 3, n), Optional<T>(a, 4, n), gates, a.stream);
  const T* w_hh = a.in[2].as<const T>();
  for (int64_t k = 0; k < d.s; ++k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    if (k > 0) {
      HAP_RETURN_IF_ERROR(Gemm<T>(a, false, true, d.b, g4, d.h, y + tp * d.h, d.s * d.h, w_hh, d.h,
                                  T(1), gates + t * g4, d.s * g4));
    }
    LaunchLstmCellForward<T>(d, t, tp, k > 0, gates, c, y, a.stream);
  }
  return CheckLaunch(a);
}

LstmShape ShapeOf(const cpu::LstmDims& d) {
  LstmShape s;
  s.b = d.b;
  s.s = d.s;
  s.h = d.h;
  s.reverse = d.reverse;
  return s;
}

// The gradients of the inputs once the steps have run backwards, added to
// those requested: dx, dw_ih and b_ih's from the input pre-activations'
// gradients d_in ([b*s, gates]), dw_hh and b_hh's from the hidden
// projection's d_hid (the same matrix for the LSTM); ys the hidden states.
template <typename T>
absl::Status AddInputGradients(const KernelArgs& a, const cpu::GradArgs& g, const LstmShape& d,
                               int64_t in, int64_t gates, const T* d_in, const T* d_hid,
                               const T* ys) {
  const int64_t rows = d.b * d.s;
  if (g.dx(0).present()) {
    HAP_RETURN_IF_ERROR(Gemm<T>(a, false, false, rows, in, gates, d_in, gates, g.x(1).as<const T>(),
                                in, T(1), g.dx(0).as<T>(), in));
  }
  if (g.dx(1).present()) {
    HAP_RETURN_IF_ERROR(Gemm<T>(a, true, false, gates, in, rows, d_in, gates, g.x(0).as<const T>(),
                                in, T(1), g.dx(1).as<T>(), in));
  }
  if (g.dx(2).present()) {
    HAP_ASSIGN_OR_RETURN(T* h_prev, ScratchArray<T>(a, rows * d.h));
    LaunchLstmPreviousHidden<T>(d, ys, h_prev, a.stream);
    HAP_RETURN_IF_ERROR(Gemm<T>(a, true, false, gates, d.h, rows, d_hid, gates, h_prev, d.h, T(1),
                                g.dx(2).as<T>(), d.h));
  }
  if (g.n() > 3 && g.dx(3).present()) {
    LaunchColumnSums<T>(rows, gates, d_in, g.dx(3).as<T>(), a.stream);
  }
  if (g.n() > 4 && g.dx(4).present()) {
    LaunchColumnSums<T>(rows, gates, d_hid, g.dx(4).as<T>(), a.stream);
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status LstmForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 5, 1));
  const int n = static_cast<int>(a.in.size());
  HAP_ASSIGN_OR_RETURN(cpu::LstmDims dims, cpu::CheckLstm(c, t, n));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, {dims.b, dims.s, dims.h}));
  const LstmShape d = ShapeOf(dims);
  HAP_ASSIGN_OR_RETURN(T* gates, ScratchArray<T>(a, d.b * d.s * 4 * d.h));
  HAP_ASSIGN_OR_RETURN(T* cs, ScratchArray<T>(a, d.b * d.s * d.h));
  return Forward<T>(a, d, dims.in, n, gates, cs, a.out[0].as<T>());
}

template <typename T>
absl::Status LstmBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(cpu::LstmDims dims, cpu::CheckLstm(c, t, g.n()));
  HAP_RETURN_IF_ERROR(g.Check(t, {{dims.b, dims.s, dims.h}}));
  if (!g.dy(0).present() || !g.any_dx()) return absl::OkStatus();
  const LstmShape d = ShapeOf(dims);
  const int64_t g4 = 4 * d.h, rows = d.b * d.s, in = dims.in;
  HAP_ASSIGN_OR_RETURN(T* act, ScratchArray<T>(a, rows * g4));
  HAP_ASSIGN_OR_RETURN(T* cs, ScratchArray<T>(a, rows * d.h));
  HAP_ASSIGN_OR_RETURN(T* ys, ScratchArray<T>(a, rows * d.h));
  HAP_ASSIGN_OR_RETURN(T* dgates, ScratchArray<T>(a, rows * g4));
  HAP_ASSIGN_OR_RETURN(T* dh_next, ScratchArray<T>(a, d.b * d.h));
  HAP_ASSIGN_OR_RETURN(T* dc_next, ScratchArray<T>(a, d.b * d.h));
  HAP_RETURN_IF_ERROR(Forward<T>(a, d, in, g.n(), act, cs, ys));

  const T* dy = g.dy(0).as<const T>();
  const T* w_hh = g.x(2).as<const T>();
  for (int64_t k = d.s - 1; k >= 0; --k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    LaunchLstmCellBackward<T>(d, t, tp, k > 0, k < d.s - 1, act, cs, dy, dh_next, dc_next, dgates,
                              a.stream);
    if (k > 0) {
      HAP_RETURN_IF_ERROR(Gemm<T>(a, false, false, d.b, d.h, g4, dgates + t * g4, d.s * g4, w_hh,
                                  d.h, T(0), dh_next, d.h));
    }
  }
  HAP_RETURN_IF_ERROR(AddInputGradients<T>(a, g, d, in, g4, dgates, dgates, ys));
  return CheckLaunch(a);
}

// --- gru ---------------------------------------------------------------------

// The GRU forward over the sequence (the op's first n inputs): xg ends
// holding the activations (r, z, n), hn the hidden projections' n part, y
// the hidden states; hg [b, 3h] is scratch.
template <typename T>
absl::Status GruForward(const KernelArgs& a, const LstmShape& d, int64_t in, int n, T* xg, T* hn,
                        T* y, T* hg) {
  const int64_t g3 = 3 * d.h, rows = d.b * d.s;
  HAP_RETURN_IF_ERROR(Gemm<T>(a, false, true, rows, g3, in, a.in[0].as<const T>(), in,
                              a.in[1].as<const T>(), in, T(0), xg, g3));
  LaunchLstmBias<T>(rows, g3, Optional<T>(a, 3, n), nullptr, xg, a.stream);
  const T* w_hh = a.in[2].as<const T>();
  const T* b_hh = Optional<T>(a, 4, n);
  for (int64_t k = 0; k < d.s; ++k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    if (k > 0) {
      HAP_RETURN_IF_ERROR(
          Gemm<T>(a, false, true, d.b, g3, d.h, y + tp * d.h, d.s * d.h, w_hh, d.h, T(0), hg, g3));
    }
    LaunchGruCellForward<T>(d, t, tp, k > 0, hg, b_hh, xg, hn, y, a.stream);
  }
  return CheckLaunch(a);
}

template <typename T>
absl::Status GruForwardKernel(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 5, 1));
  const int n = static_cast<int>(a.in.size());
  HAP_ASSIGN_OR_RETURN(cpu::LstmDims dims, cpu::CheckGru(c, t, n));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, {dims.b, dims.s, dims.h}));
  const LstmShape d = ShapeOf(dims);
  HAP_ASSIGN_OR_RETURN(T* xg, ScratchArray<T>(a, d.b * d.s * 3 * d.h));
  HAP_ASSIGN_OR_RETURN(T* hn, ScratchArray<T>(a, d.b * d.s * d.h));
  HAP_ASSIGN_OR_RETURN(T* hg, ScratchArray<T>(a, d.b * 3 * d.h));
  return GruForward<T>(a, d, dims.in, n, xg, hn, a.out[0].as<T>(), hg);
}

template <typename T>
absl::Status GruBackwardKernel(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(cpu::LstmDims dims, cpu::CheckGru(c, t, g.n()));
  HAP_RETURN_IF_ERROR(g.Check(t, {{dims.b, dims.s, dims.h}}));
  if (!g.dy(0).present() || !g.any_dx()) return absl::OkStatus();
  const LstmShape d = ShapeOf(dims);
  const int64_t g3 = 3 * d.h, rows = d.b * d.s, in = dims.in;
  HAP_ASSIGN_OR_RETURN(T* act, ScratchArray<T>(a, rows * g3));
  HAP_ASSIGN_OR_RETURN(T* hn, ScratchArray<T>(a, rows * d.h));
  HAP_ASSIGN_OR_RETURN(T* ys, ScratchArray<T>(a, rows * d.h));
  HAP_ASSIGN_OR_RETURN(T* hg, ScratchArray<T>(a, d.b * g3));
  HAP_ASSIGN_OR_RETURN(T* dxg, ScratchArray<T>(a, rows * g3));
  HAP_ASSIGN_OR_RETURN(T* dhg, ScratchArray<T>(a, rows * g3));
  HAP_ASSIGN_OR_RETURN(T* dh_next, ScratchArray<T>(a, d.b * d.h));
  HAP_RETURN_IF_ERROR(GruForward<T>(a, d, in, g.n(), act, hn, ys, hg));

  const T* dy = g.dy(0).as<const T>();
  const T* w_hh = g.x(2).as<const T>();
  for (int64_t k = d.s - 1; k >= 0; --k) {
    const int64_t t = d.reverse ? d.s - 1 - k : k;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    LaunchGruCellBackward<T>(d, t, tp, k > 0, k < d.s - 1, act, hn, ys, dy, dh_next, dxg, dhg,
                             a.stream);
    if (k > 0) {
      HAP_RETURN_IF_ERROR(Gemm<T>(a, false, false, d.b, d.h, g3, dhg + t * g3, d.s * g3, w_hh, d.h,
                                  T(1), dh_next, d.h));
    }
  }
  HAP_RETURN_IF_ERROR(AddInputGradients<T>(a, g, d, in, g3, dxg, dhg, ys));
  return CheckLaunch(a);
}

}  // namespace

void RegisterLstmKernels(KernelTable& t) {
  t["lstm"] = HAP_CUDA_FLOAT_KERNEL(LstmForward);
  t["lstm_grad"] = HAP_CUDA_FLOAT_KERNEL(LstmBackward);
  t["gru"] = HAP_CUDA_FLOAT_KERNEL(GruForwardKernel);
  t["gru_grad"] = HAP_CUDA_FLOAT_KERNEL(GruBackwardKernel);
}

}  // namespace hap::executor::cuda
