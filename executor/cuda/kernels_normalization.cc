// Normalizations over the last dimension on the GPU: layer_norm, softmax
// (additive mask, causal mask), log_softmax, with the contracts and argument
// checks of executor/cpu/kernels_normalization.cc. Launchers are in
// kernels_normalization.cu; rows reduce in float for float tensors (the CPU
// uses double), so float results agree to about 1e-5 relative.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/kernels_b_util.h"
#include "executor/cuda/launch_normalization.h"

namespace hap::executor::cuda {
namespace {

// --- layer_norm --------------------------------------------------------------

// x[..., d], gamma[d], beta[d] of dtype t; returns d.
absl::StatusOr<int64_t> CheckLayerNorm(const KernelArgs& a, DType t) {
  const cpu::KernelArgs c = CpuArgs(a);
  for (int i : {0, 1, 2}) HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
  if (a.in[0].rank() < 1) {
    return Invalid(a, cpu::InLabel(c, 0), " has rank 0");
  }
  const int64_t d = a.in[0].shape.back();
  HAP_RETURN_IF_ERROR(cpu::CheckShape(c, a.in[1], "gamma (input 1)", {d}));
  HAP_RETURN_IF_ERROR(cpu::CheckShape(c, a.in[2], "beta (input 2)", {d}));
  return d;
}

int64_t RowsOf(const TensorView& x, int64_t cols) {
  return cols == 0 ? 0 : x.num_elements() / cols;
}

template <typename T>
absl::Status LayerNormForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(int64_t d, CheckLayerNorm(a, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, a.in[0].shape));
  HAP_ASSIGN_OR_RETURN(double eps, cpu::AttrFloat(c, "eps", 1e-5));
  LaunchLayerNorm<T>(a.in[0].as<const T>(), a.in[1].as<const T>(),
                     a.in[2].as<const T>(), RowsOf(a.in[0], d), d, eps,
                     a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status LayerNormBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(int64_t d, CheckLayerNorm(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.x(0).shape}));
  HAP_ASSIGN_OR_RETURN(double eps, cpu::AttrFloat(c, "eps", 1e-5));
  if (!g.dy(0).present()) return absl::OkStatus();
  T* dx = g.dx(0).present() ? g.dx(0).as<T>() : nullptr;
  T* dgamma = g.dx(1).present() ? g.dx(1).as<T>() : nullptr;
  T* dbeta = g.dx(2).present() ? g.dx(2).as<T>() : nullptr;
  const int64_t rows = RowsOf(g.x(0), d);
  char* scratch = nullptr;
  if (dgamma != nullptr || dbeta != nullptr) {
    HAP_ASSIGN_OR_RETURN(
        scratch,
        ScratchArray<char>(
            a, static_cast<int64_t>(LayerNormGradScratchBytes<T>(rows, d))));
  }
  LaunchLayerNormGrad<T>(g.x(0).as<const T>(), g.x(1).as<const T>(),
                         g.dy(0).as<const T>(), rows, d, eps, dx, dgamma, dbeta,
                         scratch, a.stream);
  return CheckLaunch(a);
}

// --- softmax, log_softmax ----------------------------------------------------

// The last-axis check of both ops: attribute "axis" must name it.
absl::Status CheckLastAxis(const KernelArgs& a, const TensorView& x) {
  const cpu::KernelArgs c = CpuArgs(a);
  if (x.rank() < 1) return Invalid(a, "input 0 has rank 0");
  HAP_ASSIGN_OR_RETURN(int64_t axis, cpu::AttrInt(c, "axis", -1));
  HAP_ASSIGN_OR_RETURN(int ax, cpu::NormalizeAxis(c, axis, x.rank(), "axis"));
  if (ax != x.rank() - 1) {
    return Invalid(a, "is supported over the last axis only");
  }
  return absl::OkStatus();
}

// The mask of x (as the CPU's MakeMask): "causal", and an additive mask
// input broadcast to x.
template <typename T>
absl::StatusOr<SoftmaxMask> MakeMask(const KernelArgs& a, const Shape& x,
                                     const TensorView* mask) {
  const cpu::KernelArgs c = CpuArgs(a);
  SoftmaxMask m;
  HAP_ASSIGN_OR_RETURN(m.causal, cpu::AttrBool(c, "causal", false));
  if (m.causal) {
    if (x.size() < 2) return Invalid(a, "causal softmax needs rank >= 2");
    m.square = x[x.size() - 2];
  }
  if (mask != nullptr && mask->present()) {
    HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, cpu::DTypeOf<T>()));
    if (!cpu::BroadcastsTo(mask->shape, x)) {
      return Invalid(a, "mask ", cpu::InLabel(c, 1), " does not broadcast to ",
                     graph::ShapeString(x));
    }
    std::vector<int64_t> st = cpu::BroadcastStrides(mask->shape, x);
    m.mask = mask->data;
    m.col_stride = st.back();
    const Shape lead(x.begin(), x.end() - 1);
    HAP_ASSIGN_OR_RETURN(
        m.lead,
        MakeSpace(a, lead, {std::vector<int64_t>(st.begin(), st.end() - 1)}));
  }
  return m;
}

template <typename T, bool kLog>
absl::Status SoftmaxForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, kLog ? 1 : 2, 1));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  const TensorView& x = a.in[0];
  HAP_RETURN_IF_ERROR(CheckLastAxis(a, x));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, x.shape));
  HAP_ASSIGN_OR_RETURN(
      SoftmaxMask m,
      MakeMask<T>(a, x.shape, a.in.size() > 1 ? &a.in[1] : nullptr));
  const int64_t cols = x.shape.back();
  LaunchSoftmax<T, kLog>(x.as<const T>(), m, RowsOf(x, cols), cols,
                         a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

// An absent y is recomputed into scratch.
template <typename T, bool kLog>
absl::Status SoftmaxBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g,
                       cpu::GradArgs::Make(c, 1, kLog ? 1 : 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  const TensorView& x = g.x(0);
  HAP_RETURN_IF_ERROR(CheckLastAxis(a, x));
  HAP_RETURN_IF_ERROR(g.Check(t, {x.shape}));
  HAP_ASSIGN_OR_RETURN(SoftmaxMask m,
                       MakeMask<T>(a, x.shape, g.n() > 1 ? &g.x(1) : nullptr));
  if (!g.active()) return absl::OkStatus();
  const int64_t cols = x.shape.back();
  const int64_t rows = RowsOf(x, cols);
  const T* y = g.y(0).present() ? g.y(0).as<const T>() : nullptr;
  if (y == nullptr) {
    HAP_ASSIGN_OR_RETURN(T * recomputed, ScratchArray<T>(a, x.num_elements()));
    LaunchSoftmax<T, kLog>(x.as<const T>(), m, rows, cols, recomputed,
                           a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
    y = recomputed;
  }
  LaunchSoftmaxGrad<T, kLog>(y, g.dy(0).as<const T>(), rows, cols,
                             g.dx(0).as<T>(), a.stream);
  return CheckLaunch(a);
}

}  // namespace

void RegisterNormalizationKernels(KernelTable& t) {
  t["layer_norm"] = HAP_CUDA_FLOAT_KERNEL(LayerNormForward);
  t["layer_norm_grad"] = HAP_CUDA_FLOAT_KERNEL(LayerNormBackward);
  t["softmax"] = FloatKernel(&SoftmaxForward<float, false>,
                             &SoftmaxForward<double, false>);
  t["softmax_grad"] = FloatKernel(&SoftmaxBackward<float, false>,
                                  &SoftmaxBackward<double, false>);
  t["log_softmax"] =
      FloatKernel(&SoftmaxForward<float, true>, &SoftmaxForward<double, true>);
  t["log_softmax_grad"] = FloatKernel(&SoftmaxBackward<float, true>,
                                      &SoftmaxBackward<double, true>);
}

}  // namespace hap::executor::cuda
