// sum and mean over a set of axes (all when none are given), as
// executor/cpu/kernels_reduction.cc: sums in double, in a fixed order.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_elementwise.h"

namespace hap::executor::cuda {
namespace {

// The checks shared with the CPU (kernels_internal.h).
using cpu::Reduced;

absl::StatusOr<Reduced> CheckReduction(const KernelArgs& a,
                                       const TensorView& x) {
  return cpu::CheckReduction(CpuArgs(a), x);
}

template <bool kMean>
absl::StatusOr<double> Factor(const KernelArgs& a, const Reduced& r) {
  return cpu::Factor<kMean>(CpuArgs(a), r);
}

template <typename T, bool kMean>
absl::Status ReduceForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckUnary(c, t));
  HAP_ASSIGN_OR_RETURN(Reduced r, CheckReduction(a, a.in[0]));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, r.out));
  HAP_ASSIGN_OR_RETURN(double factor, Factor<kMean>(a, r));
  const Shape& s = a.in[0].shape;
  HAP_ASSIGN_OR_RETURN(
      ReduceSpace space,
      MakeReduceSpace(a, s, r.strides, cpu::ContiguousStrides(s), {}));
  HAP_ASSIGN_OR_RETURN(double* scratch, ReduceScratch(a, space));
  LaunchReduce<T>(space, a.in[0].as<const T>(), nullptr, factor,
                  a.out[0].as<T>(), false, a.stream, scratch);
  return CheckLaunch(a);
}

template <typename T, bool kMean>
absl::Status ReduceBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Unary(c, t));
  HAP_ASSIGN_OR_RETURN(Reduced r, CheckReduction(a, g.x(0)));
  HAP_RETURN_IF_ERROR(g.Check(t, {r.out}));
  HAP_ASSIGN_OR_RETURN(double factor, Factor<kMean>(a, r));
  if (!g.active()) return absl::OkStatus();
  // dx += factor * dy broadcast over the reduced axes: a "reduction" that
  // sums nothing (dx's strides are never 0).
  const Shape& s = g.x(0).shape;
  HAP_ASSIGN_OR_RETURN(
      ReduceSpace space,
      MakeReduceSpace(a, s, cpu::ContiguousStrides(s), r.strides, {}));
  LaunchReduce<T>(space, g.dy(0).as<const T>(), nullptr, factor,
                  g.dx(0).as<T>(), true, a.stream);
  return CheckLaunch(a);
}

}  // namespace

void RegisterReductionKernels(KernelTable& t) {
  t["sum"] = FloatKernel(&ReduceForward<float, false>,
                         &ReduceForward<double, false>);
  t["sum_grad"] = FloatKernel(&ReduceBackward<float, false>,
                              &ReduceBackward<double, false>);
  t["mean"] = FloatKernel(&ReduceForward<float, true>,
                          &ReduceForward<double, true>);
  t["mean_grad"] = FloatKernel(&ReduceBackward<float, true>,
                               &ReduceBackward<double, true>);
}

}  // namespace hap::executor::cuda
