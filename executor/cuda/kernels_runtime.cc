// The runtime's own kernels on the GPU (executor/cpu/kernels_runtime.cc):
// fill_zero, copy, accumulate, sq_norm (double, deterministic), sgd_update
// and adam_update (PyTorch SGD and AdamW with clip_grad_norm_'s factor,
// read from the device-resident global norm by the kernel itself).
#include <cmath>

#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_elementwise.h"
#include "executor/cuda/launch_runtime.h"

namespace hap::executor::cuda {
namespace {

absl::Status FillZero(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(cpu::CheckArity(CpuArgs(a), 0, 0, 1));
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  if (a.out[0].bytes() == 0) return absl::OkStatus();
  return KernelCudaStatus(a, cudaMemsetAsync(a.out[0].data, 0, a.out[0].bytes(), a.stream),
                          "cudaMemsetAsync");
}

// Input 0 and output 0 present, of one dtype and element count.
absl::Status CheckSameElements(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  if (!a.in[0].present()) return Invalid(a, "input 0 is absent");
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  if (a.in[0].dtype != a.out[0].dtype ||
      a.in[0].num_elements() != a.out[0].num_elements()) {
    return Invalid(a, cpu::InLabel(c, 0), " and ", cpu::OutLabel(c, 0),
                   " differ in dtype or element count");
  }
  return absl::OkStatus();
}

absl::Status Copy(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckSameElements(a));
  if (a.out[0].data == a.in[0].data || a.in[0].bytes() == 0) {
    return absl::OkStatus();
  }
  return KernelCudaStatus(a,
                          cudaMemcpyAsync(a.out[0].data, a.in[0].data, a.in[0].bytes(),
                                          cudaMemcpyDeviceToDevice, a.stream),
                          "cudaMemcpyAsync");
}

template <typename T>
absl::Status Accumulate(const KernelArgs& a) {
  HAP_RETURN_IF_ERROR(CheckSameElements(a));
  LaunchScale<T>(T(1), a.in[0].as<const T>(), a.out[0].as<T>(),
                 a.in[0].num_elements(), true, a.stream);
  return CheckLaunch(a);
}

// An f64 [1] tensor (the global squared norm).
absl::Status CheckNormTensor(const KernelArgs& a, const TensorView& v,
                             absl::string_view what) {
  if (v.dtype != DType::kFloat64 || v.num_elements() != 1) {
    return Invalid(a, what, " (", cpu::Describe(v), ") must be f64[1]");
  }
  return absl::OkStatus();
}

// acc[0] += the sum of squares of every present input: per input, a fixed
// number of block partials (a function of its size), then one block adds
// them all in order.
absl::Status SqNorm(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 0, -1, 1));
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  HAP_RETURN_IF_ERROR(CheckNormTensor(a, a.out[0], "output 0"));
  int64_t slots = 0;
  for (int i = 0; i < static_cast<int>(a.in.size()); ++i) {
    const TensorView& g = a.in[i];
    if (!g.present()) continue;
    if (g.dtype != DType::kFloat32 && g.dtype != DType::kFloat64) {
      return Invalid(a, cpu::InLabel(c, i), " must be f32 or f64");
    }
    slots += SquaresBlocks(g.num_elements());
  }
  if (slots == 0) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(void* scratch, a.scratch.Get(slots * sizeof(double)));
  double* partials = static_cast<double*>(scratch);
  int64_t at = 0;
  for (const TensorView& g : a.in) {
    if (!g.present()) continue;
    if (g.dtype == DType::kFloat32) {
      LaunchSquares<float>(g.as<const float>(), g.num_elements(), partials + at,
                           a.stream);
    } else {
      LaunchSquares<double>(g.as<const double>(), g.num_elements(),
                            partials + at, a.stream);
    }
    at += SquaresBlocks(g.num_elements());
  }
  LaunchSumInto(partials, slots, a.out[0].as<double>(), a.stream);
  return CheckLaunch(a);
}

// The inputs (param, grad, norm_sq?) and the clipping, as the CPU checks.
template <typename T>
absl::StatusOr<Clip> CheckOptimizer(const KernelArgs& a, int min_out,
                                    int max_out) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  if (a.in.size() < 2 || a.in.size() > 3) {
    return Invalid(a, "takes 2 or 3 inputs (param, grad, norm_sq?), got ",
                   a.in.size());
  }
  if (static_cast<int>(a.out.size()) < min_out ||
      static_cast<int>(a.out.size()) > max_out) {
    return Invalid(a, "takes ", min_out, " to ", max_out, " outputs, got ",
                   a.out.size());
  }
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  const Shape& s = a.in[0].shape;
  HAP_RETURN_IF_ERROR(cpu::CheckShape(c, a.in[1], "grad (input 1)", s));
  for (int j = 0; j < static_cast<int>(a.out.size()); ++j) {
    if (j == 0 || a.out[j].present()) {
      HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, j, t, s));
    }
  }
  Clip clip;
  HAP_ASSIGN_OR_RETURN(double max_norm,
                       cpu::AttrFloat(c, "clip_global_norm", 0.0));
  if (max_norm > 0 && a.in.size() == 3 && a.in[2].present()) {
    HAP_RETURN_IF_ERROR(CheckNormTensor(a, a.in[2], "norm_sq (input 2)"));
    clip.norm_sq = a.in[2].as<const double>();
    clip.max_norm = max_norm;
  }
  return clip;
}

template <typename T>
absl::Status SgdUpdate(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(Clip clip, CheckOptimizer<T>(a, 1, 2));
  HAP_ASSIGN_OR_RETURN(double lr, cpu::AttrFloat(c, "learning_rate"));
  HAP_ASSIGN_OR_RETURN(double momentum, cpu::AttrFloat(c, "momentum", 0.0));
  HAP_ASSIGN_OR_RETURN(double wd, cpu::AttrFloat(c, "weight_decay", 0.0));
  T* mbuf =
      a.out.size() == 2 && a.out[1].present() ? a.out[1].as<T>() : nullptr;
  if (momentum != 0 && mbuf == nullptr) {
    return Invalid(a, "momentum ", momentum,
                   " needs a momentum buffer (output 1)");
  }
  LaunchSgd<T>(a.in[0].as<const T>(), a.in[1].as<const T>(), clip,
               static_cast<T>(lr), static_cast<T>(wd), static_cast<T>(momentum),
               momentum != 0 ? mbuf : nullptr, a.out[0].as<T>(),
               a.in[0].num_elements(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status AdamUpdate(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(Clip clip, CheckOptimizer<T>(a, 3, 3));
  if (!a.out[1].present() || !a.out[2].present()) {
    return Invalid(a, "needs its moment buffers (outputs 1 and 2)");
  }
  HAP_ASSIGN_OR_RETURN(double lr, cpu::AttrFloat(c, "learning_rate"));
  HAP_ASSIGN_OR_RETURN(double b1, cpu::AttrFloat(c, "beta1", 0.9));
  HAP_ASSIGN_OR_RETURN(double b2, cpu::AttrFloat(c, "beta2", 0.999));
  HAP_ASSIGN_OR_RETURN(double eps, cpu::AttrFloat(c, "epsilon", 1e-8));
  HAP_ASSIGN_OR_RETURN(double wd, cpu::AttrFloat(c, "weight_decay", 0.0));
  const double t = static_cast<double>(a.ctx.step + 1);
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  AdamParams p;
  p.decay = 1 - lr * wd;
  p.b1 = b1;
  p.b2 = b2;
  p.step = lr / bc1;
  p.sqrt_bc2 = std::sqrt(bc2);
  p.eps = eps;
  LaunchAdam<T>(a.in[0].as<const T>(), a.in[1].as<const T>(), clip, p,
                a.out[1].as<T>(), a.out[2].as<T>(), a.out[0].as<T>(),
                a.in[0].num_elements(), a.stream);
  return CheckLaunch(a);
}

}  // namespace

void RegisterRuntimeKernels(KernelTable& t) {
  t["fill_zero"] = FillZero;
  t["copy"] = Copy;
  t["accumulate"] = HAP_CUDA_FLOAT_KERNEL(Accumulate);
  t["sq_norm"] = SqNorm;
  t["sgd_update"] = HAP_CUDA_FLOAT_KERNEL(SgdUpdate);
  t["adam_update"] = HAP_CUDA_FLOAT_KERNEL(AdamUpdate);
}

}  // namespace hap::executor::cuda
