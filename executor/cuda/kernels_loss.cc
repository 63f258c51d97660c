// nll_loss on log-probabilities and cross_entropy on logits, averaged over
// "global_rows" (executor/cpu/kernels_loss.cc). Targets live on the GPU:
// one outside [0, classes) is reported through KernelArgs::fault
// (InvalidArgument at the device's next Synchronize), not here.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_loss.h"

namespace hap::executor::cuda {
namespace {

// x[n, c] of dtype t, targets[n] int32 or int64.
absl::StatusOr<LossShape> CheckLoss(const KernelArgs& a, DType t) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_RETURN_IF_ERROR(cpu::CheckIdsInput(c, 1));
  const TensorView& x = a.in[0];
  const TensorView& target = a.in[1];
  if (x.rank() != 2) return Invalid(a, cpu::InLabel(c, 0), " must have rank 2");
  LossShape d;
  d.rows = x.shape[0];
  d.classes = x.shape[1];
  if (target.shape != Shape{d.rows}) {
    return Invalid(a, "targets ", cpu::InLabel(c, 1),
                   " must have one entry per row of ", cpu::InLabel(c, 0));
  }
  HAP_ASSIGN_OR_RETURN(int64_t global, cpu::AttrInt(c, "global_rows", d.rows));
  if (global < 1) return Invalid(a, "attribute 'global_rows' must be >= 1");
  d.inv_rows = 1.0 / static_cast<double>(global);
  d.fault = a.fault.word;
  d.fault_code = a.fault.code;
  return d;
}

absl::Status CheckScalar(const KernelArgs& a, const TensorView& v,
                         absl::string_view what) {
  if (v.present() && v.num_elements() != 1) {
    return Invalid(a, what, " (", cpu::Describe(v), ") must be a scalar");
  }
  return absl::OkStatus();
}

// Calls f with the targets as int64_t or int32_t (CheckIdsInput admits
// those two).
template <typename F>
void WithIds(const TensorView& ids, F&& f) {
  if (ids.dtype == DType::kInt64) {
    f(ids.as<const int64_t>());
  } else {
    f(ids.as<const int32_t>());
  }
}

template <typename T, bool kLogits>
absl::Status LossForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(LossShape d, CheckLoss(a, t));
  if (!a.out[0].present() || a.out[0].dtype != t) {
    return Invalid(a, cpu::OutLabel(c, 0), " must be a ", graph::DTypeName(t),
                   " scalar");
  }
  HAP_RETURN_IF_ERROR(CheckScalar(a, a.out[0], "output 0"));
  double* row_loss = nullptr;
  if (d.rows > 0) {
    HAP_ASSIGN_OR_RETURN(void* p, a.scratch.Get(d.rows * sizeof(double)));
    row_loss = static_cast<double*>(p);
  }
  WithIds(a.in[1], [&](const auto* ids) {
    LaunchLossForward<T>(kLogits, d, a.in[0].as<const T>(), ids, row_loss,
                         a.out[0].as<T>(), a.stream);
  });
  return CheckLaunch(a);
}

template <typename T, bool kLogits>
absl::Status LossBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_ASSIGN_OR_RETURN(LossShape d, CheckLoss(a, t));
  for (int idx : {2, 3}) {
    if (a.in[idx].present() && a.in[idx].dtype != t) {
      return Invalid(a, cpu::InLabel(c, idx), " must be ", graph::DTypeName(t));
    }
    HAP_RETURN_IF_ERROR(CheckScalar(a, a.in[idx], absl::StrCat("input ", idx)));
  }
  HAP_RETURN_IF_ERROR(
      g.Check(t, {g.y(0).present() ? g.y(0).shape : g.dy(0).shape}));
  if (!g.active()) return absl::OkStatus();
  const T* x = g.x(0).as<const T>();
  const T* dy = g.dy(0).as<const T>();
  T* dx = g.dx(0).as<T>();
  WithIds(g.x(1), [&](const auto* ids) {
    LaunchLossBackward<T>(kLogits, d, x, ids, dy, dx, a.stream);
  });
  return CheckLaunch(a);
}

// Cross-entropy over logits sharded by class (launch_loss.h), checked as
// the CPU checks it.
template <typename T>
absl::StatusOr<ShardedLossShape> CheckSharded(const KernelArgs& a, bool with_lse) {
  HAP_ASSIGN_OR_RETURN(cpu::ShardedLossDims d,
                       cpu::CheckShardedLoss(CpuArgs(a), cpu::DTypeOf<T>(), with_lse));
  ShardedLossShape s;
  s.base.rows = d.rows;
  s.base.classes = d.classes;
  s.base.inv_rows = d.inv_rows;
  s.base.fault = a.fault.word;
  s.base.fault_code = a.fault.code;
  s.offset = d.offset;
  s.vocab = d.vocab;
  s.rank = d.rank;
  s.ranks = d.ranks;
  return s;
}

template <typename T>
absl::Status ShardedLse(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(ShardedLossShape d, CheckSharded<T>(a, false));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, cpu::DTypeOf<T>(), {d.base.rows}));
  LaunchShardedLse<T>(d, a.in[0].as<const T>(), a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status ShardedForward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(ShardedLossShape d, CheckSharded<T>(a, true));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, cpu::DTypeOf<T>(), {}));
  double* row_loss = nullptr;
  if (d.base.rows > 0) {
    HAP_ASSIGN_OR_RETURN(void* p, a.scratch.Get(d.base.rows * sizeof(double)));
    row_loss = static_cast<double*>(p);
  }
  WithIds(a.in[1], [&](const auto* ids) {
    LaunchShardedLossForward<T>(d, a.in[0].as<const T>(), ids, a.in[2].as<const T>(),
                                row_loss, a.out[0].as<T>(), a.stream);
  });
  return CheckLaunch(a);
}

template <typename T>
absl::Status ShardedBackward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 4, 4, 1));
  HAP_ASSIGN_OR_RETURN(ShardedLossShape d, CheckSharded<T>(a, true));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 3, cpu::DTypeOf<T>()));
  HAP_RETURN_IF_ERROR(CheckScalar(a, a.in[3], "input 3 (the loss gradient)"));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, cpu::DTypeOf<T>(), a.in[0].shape));
  WithIds(a.in[1], [&](const auto* ids) {
    LaunchShardedLossBackward<T>(d, a.in[0].as<const T>(), ids, a.in[2].as<const T>(),
                                 a.in[3].as<const T>(), a.out[0].as<T>(), a.stream);
  });
  return CheckLaunch(a);
}

}  // namespace

void RegisterLossKernels(KernelTable& t) {
  t["cross_entropy_lse"] = FloatKernel(&ShardedLse<float>, &ShardedLse<double>);
  t["cross_entropy_sharded"] =
      FloatKernel(&ShardedForward<float>, &ShardedForward<double>);
  t["cross_entropy_sharded_grad"] =
      FloatKernel(&ShardedBackward<float>, &ShardedBackward<double>);
  t["nll_loss"] =
      FloatKernel(&LossForward<float, false>, &LossForward<double, false>);
  t["nll_loss_grad"] =
      FloatKernel(&LossBackward<float, false>, &LossBackward<double, false>);
  t["cross_entropy"] =
      FloatKernel(&LossForward<float, true>, &LossForward<double, true>);
  t["cross_entropy_grad"] =
      FloatKernel(&LossBackward<float, true>, &LossBackward<double, true>);
}

}  // namespace hap::executor::cuda
