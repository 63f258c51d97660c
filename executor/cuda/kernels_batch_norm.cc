// batch_norm on the GPU: the kernels and contracts of
// executor/cpu/kernels_batch_norm.cc (the single-device batch_norm and
// batch_norm_grad, and the pieces of a batch-sharded one), with the CPU's
// argument checks (cpu::CheckBatchNorm). Launchers in kernels_batch_norm.cu.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/kernels_b_util.h"
#include "executor/cuda/launch_batch_norm.h"

namespace hap::executor::cuda {
namespace {

absl::StatusOr<BatchNormShape> Check(const KernelArgs& a, DType t,
                                     std::initializer_list<int> channel_inputs) {
  HAP_ASSIGN_OR_RETURN(cpu::BatchNormDims d,
                       cpu::CheckBatchNorm(CpuArgs(a), t, channel_inputs));
  BatchNormShape g;
  g.n = d.n;
  g.c = d.c;
  g.s = d.s;
  g.count = d.count;
  g.eps = d.eps;
  g.momentum = d.momentum;
  return g;
}

absl::Status CheckSums(const KernelArgs& a, const TensorView& v,
                       const std::string& label, int64_t c) {
  return cpu::CheckBatchNormSums(CpuArgs(a), v, label, c);
}

template <typename T>
T* Mutable(const TensorView& v) {
  return v.present() ? v.as<T>() : nullptr;
}

template <typename T>
absl::Status BatchNormForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormShape g, Check(a, t, {1, 2, 3, 4}));
  for (int i : {1, 2}) HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, a.in[0].shape));
  HAP_ASSIGN_OR_RETURN(double* sums, ScratchArray<double>(a, 2 * g.c));
  const T* x = a.in[0].as<const T>();
  LaunchBatchNormSums<T>(g, x, sums, a.stream);
  LaunchBatchNormApply<T>(g, x, a.in[1].as<const T>(), a.in[2].as<const T>(), sums,
                          a.out[0].as<T>(), a.in.size() > 3 ? Mutable<T>(a.in[3]) : nullptr,
                          a.in.size() > 4 ? Mutable<T>(a.in[4]) : nullptr, a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status BatchNormBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs gr, cpu::GradArgs::Make(c, 3, 5, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormShape g, Check(a, t, {1, 2}));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  HAP_RETURN_IF_ERROR(gr.Check(t, {a.in[0].shape}));
  HAP_RETURN_IF_ERROR(gr.CheckNoGrad({3, 4}));
  if (!gr.dy(0).present() ||
      !(gr.dx(0).present() || gr.dx(1).present() || gr.dx(2).present())) {
    return absl::OkStatus();
  }
  HAP_ASSIGN_OR_RETURN(double* sums, ScratchArray<double>(a, 4 * g.c));
  double* gsums = sums + 2 * g.c;
  const T* x = a.in[0].as<const T>();
  const T* dy = gr.dy(0).as<const T>();
  LaunchBatchNormSums<T>(g, x, sums, a.stream);
  LaunchBatchNormGradSums<T>(g, x, dy, sums, gsums, a.stream);
  if (gr.dx(0).present()) {
    LaunchBatchNormDx<T>(g, x, a.in[1].as<const T>(), dy, sums, gsums,
                         gr.dx(0).as<T>(), a.stream);
  }
  LaunchBatchNormAffineGrad<T>(g.c, gsums, Mutable<T>(gr.dx(1)), Mutable<T>(gr.dx(2)),
                               a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status StatsKernel(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormShape g, Check(a, t, {}));
  HAP_RETURN_IF_ERROR(CheckSums(a, a.out[0], cpu::OutLabel(c, 0), g.c));
  LaunchBatchNormSums<T>(g, a.in[0].as<const T>(), a.out[0].as<double>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status ApplyKernel(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 6, 6, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormShape g, Check(a, t, {1, 2, 3, 4}));
  for (int i : {1, 2}) HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
  HAP_RETURN_IF_ERROR(CheckSums(a, a.in[5], cpu::InLabel(c, 5), g.c));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, a.in[0].shape));
  LaunchBatchNormApply<T>(g, a.in[0].as<const T>(), a.in[1].as<const T>(),
                          a.in[2].as<const T>(), a.in[5].as<const double>(),
                          a.out[0].as<T>(), Mutable<T>(a.in[3]), Mutable<T>(a.in[4]),
                          a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status GradStatsKernel(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(BatchNormShape g, Check(a, t, {}));
  HAP_RETURN_IF_ERROR(CheckSums(a, a.in[1], cpu::InLabel(c, 1), g.c));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 2, t));
  HAP_RETURN_IF_ERROR(cpu::CheckShape(c, a.in[2], cpu::InLabel(c, 2), a.in[0].shape));
  HAP_RETURN_IF_ERROR(CheckSums(a, a.out[0], cpu::OutLabel(c, 0), g.c));
  LaunchBatchNormGradSums<T>(g, a.in[0].as<const T>(), a.in[2].as<const T>(),
                             a.in[1].as<const double>(), a.out[0].as<double>(),
                             a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status GradApplyKernel(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 5, 5, 3));
  HAP_ASSIGN_OR_RETURN(BatchNormShape g, Check(a, t, {1}));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  HAP_RETURN_IF_ERROR(CheckSums(a, a.in[2], cpu::InLabel(c, 2), g.c));
  HAP_RETURN_IF_ERROR(CheckSums(a, a.in[3], cpu::InLabel(c, 3), g.c));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 4, t));
  HAP_RETURN_IF_ERROR(cpu::CheckShape(c, a.in[4], cpu::InLabel(c, 4), a.in[0].shape));
  const Shape shapes[] = {a.in[0].shape, {g.c}, {g.c}};
  for (int i = 0; i < 3; ++i) {
    if (a.out[i].present()) HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, i, t, shapes[i]));
  }
  const T* x = a.in[0].as<const T>();
  const T* dy = a.in[4].as<const T>();
  const double* sums = a.in[2].as<const double>();
  if (a.out[0].present()) {
    LaunchBatchNormDx<T>(g, x, a.in[1].as<const T>(), dy, sums,
                         a.in[3].as<const double>(), a.out[0].as<T>(), a.stream);
  }
  if (a.out[1].present() || a.out[2].present()) {
    // dgamma and dbeta are this rank's part: its own gradient sums.
    HAP_ASSIGN_OR_RETURN(double* local, ScratchArray<double>(a, 2 * g.c));
    LaunchBatchNormGradSums<T>(g, x, dy, sums, local, a.stream);
    LaunchBatchNormAffineGrad<T>(g.c, local, Mutable<T>(a.out[1]),
                                 Mutable<T>(a.out[2]), a.stream);
  }
  return CheckLaunch(a);
}

}  // namespace

void RegisterBatchNormKernels(KernelTable& t) {
  t["batch_norm"] = HAP_CUDA_FLOAT_KERNEL(BatchNormForward);
  t["batch_norm_grad"] = HAP_CUDA_FLOAT_KERNEL(BatchNormBackward);
  t["batch_norm_stats"] = HAP_CUDA_FLOAT_KERNEL(StatsKernel);
  t["batch_norm_apply"] = HAP_CUDA_FLOAT_KERNEL(ApplyKernel);
  t["batch_norm_grad_stats"] = HAP_CUDA_FLOAT_KERNEL(GradStatsKernel);
  t["batch_norm_grad_apply"] = HAP_CUDA_FLOAT_KERNEL(GradApplyKernel);
}

}  // namespace hap::executor::cuda
