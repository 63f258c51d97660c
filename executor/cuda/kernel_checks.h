// Internal to executor/cuda: the CPU backend's argument checks applied to
// CUDA kernel calls (both backends accept and reject the same calls with the
// same messages: a CUDA family file builds a cpu::KernelArgs view of its call
// with CpuArgs and calls the cpu:: checks of executor/cpu/kernels_internal.h
// on it), the dtype dispatch of the CUDA kernels, and the index spaces their
// launchers take (launch_common.h). Host code only.
#ifndef HAP_EXECUTOR_CUDA_KERNEL_CHECKS_H_
#define HAP_EXECUTOR_CUDA_KERNEL_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cuda/kernels_internal.h"
#include "executor/cuda/launch_common.h"

namespace hap::executor::cuda {

// The CPU's view of a CUDA kernel call (same name, context, attributes and
// tensor views; the views' data are device pointers, which the checks never
// dereference). The result refers to `a`'s spans: keep `a` alive.
inline cpu::KernelArgs CpuArgs(const KernelArgs& a) {
  return cpu::KernelArgs{a.name, a.ctx, a.attrs, a.in, a.out};
}

// InvalidArgument naming the kernel, as the CPU's Invalid.
template <typename... P>
absl::Status Invalid(const KernelArgs& a, const P&... parts) {
  return absl::InvalidArgumentError(
      absl::StrCat("kernel '", a.name, "': ", parts...));
}

// A floating kernel instantiated for float and double. The call's dtype is
// that of its first present floating input (its first present floating
// output when no input is floating); other dtypes are InvalidArgument.
using TypedKernel = absl::Status (*)(const KernelArgs&);
KernelFn FloatKernel(TypedKernel f32, TypedKernel f64);
#define HAP_CUDA_FLOAT_KERNEL(fn) \
  ::hap::executor::cuda::FloatKernel(&fn<float>, &fn<double>)
// The same for a kernel template whose second parameter is an int (the
// spatial dims of a convolution or pooling): fn<float, n>, fn<double, n>.
#define HAP_CUDA_FLOAT_KERNEL_N(fn, n) \
  ::hap::executor::cuda::FloatKernel(&fn<float, n>, &fn<double, n>)

// A data-movement kernel instantiated for f32, f64, i32 and i64; the dtype
// is that of its first present input (output when it has none), as the
// CPU's AnyKernel.
inline KernelFn AnyKernel(TypedKernel f32, TypedKernel f64, TypedKernel i32,
                          TypedKernel i64) {
  return cpu::AnyDispatch<KernelArgs>(f32, f64, i32, i64);
}
#define HAP_CUDA_ANY_KERNEL(fn)                                            \
  ::hap::executor::cuda::AnyKernel(&fn<float>, &fn<double>, &fn<int32_t>, \
                                   &fn<int64_t>)

// The index space of `shape` with one stride vector per operand (at most
// kMaxOperands): size-1 dimensions dropped, neighbours merged where every
// operand allows. InvalidArgument naming the kernel when more than kMaxDims
// dimensions remain.
absl::StatusOr<StridedSpace> MakeSpace(
    const KernelArgs& a, const Shape& shape,
    const std::vector<std::vector<int64_t>>& strides);

// A reduction over `shape`: dimensions where `out_strides` is 0 (and the
// size is not 1) are summed, the others enumerate outputs. `a_strides` and
// `b_strides` (empty: operand b absent) are the inputs' strides over `shape`.
absl::StatusOr<ReduceSpace> MakeReduceSpace(
    const KernelArgs& a, const Shape& shape,
    const std::vector<int64_t>& out_strides,
    const std::vector<int64_t>& a_strides,
    const std::vector<int64_t>& b_strides = {});

// Scratch for LaunchReduce to split a long reduction of `space` across
// blocks (launch_elementwise.h), from the call's Scratch; nullptr when the
// reduction runs in one pass.
absl::StatusOr<double*> ReduceScratch(const KernelArgs& a,
                                      const ReduceSpace& space);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_KERNEL_CHECKS_H_
