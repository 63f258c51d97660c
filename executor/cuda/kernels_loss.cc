// nll_loss on log-probabilities and cross_entropy on logits, averaged over
// "global_rows" (executor/cpu/kernels_loss.cc). Targets live on the GPU:
// one outside [0, classes) is reported through KernelArgs::fault
// (InvalidArgument at the device's next Synchronize), not here.
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_loss.h"
#include "planner/util/status_macros.h"

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
  const T* x = a.in[0].as<const T>();
  if (a.in[1].dtype == DType::kInt64) {
    LaunchLossForward<T, int64_t>(kLogits, d, x, a.in[1].as<const int64_t>(),
                                  row_loss, a.out[0].as<T>(), a.stream);
  } else {
    LaunchLossForward<T, int32_t>(kLogits, d, x, a.in[1].as<const int32_t>(),
                                  row_loss, a.out[0].as<T>(), a.stream);
  }
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
  if (g.x(1).dtype == DType::kInt64) {
    LaunchLossBackward<T, int64_t>(kLogits, d, x, g.x(1).as<const int64_t>(),
                                   dy, dx, a.stream);
  } else {
    LaunchLossBackward<T, int32_t>(kLogits, d, x, g.x(1).as<const int32_t>(),
                                   dy, dx, a.stream);
  }
  return CheckLaunch(a);
}

// Cross-entropy over logits sharded by class (launch_loss.h).
template <typename T>
absl::StatusOr<ShardedLossShape> CheckSharded(const KernelArgs& a, bool with_lse) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, cpu::DTypeOf<T>()));
  const TensorView& x = a.in[0];
  if (x.rank() != 2) return Invalid(a, cpu::InLabel(c, 0), " must have rank 2");
  ShardedLossShape d;
  d.base.rows = x.shape[0];
  d.base.classes = x.shape[1];
  d.base.fault = a.fault.word;
  d.base.fault_code = a.fault.code;
  HAP_ASSIGN_OR_RETURN(d.offset, cpu::AttrInt(c, "vocab_offset"));
  HAP_ASSIGN_OR_RETURN(d.vocab, cpu::AttrInt(c, "vocab_size"));
  if (d.vocab < 1 || d.offset < 0 || d.offset > d.vocab - d.base.classes) {
    return Invalid(a, "attributes 'vocab_offset' ", d.offset, " and 'vocab_size' ", d.vocab,
                   ": this shard's ", d.base.classes, " classes do not fit the vocabulary");
  }
  if (!with_lse) return d;
  HAP_RETURN_IF_ERROR(cpu::CheckIdsInput(c, 1));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 2, cpu::DTypeOf<T>()));
  HAP_ASSIGN_OR_RETURN(d.rank, cpu::AttrInt(c, "rank"));
  HAP_ASSIGN_OR_RETURN(d.ranks, cpu::AttrInt(c, "ranks"));
  constexpr int64_t kMaxRanks = int64_t{1} << 20;  // ranks x rows cannot overflow
  if (d.ranks < 1 || d.ranks > kMaxRanks || d.rank < 0 || d.rank >= d.ranks) {
    return Invalid(a, "attribute 'rank' ", d.rank, " is outside a world of 'ranks' ",
                   d.ranks, " (at most ", kMaxRanks, ")");
  }
  if (a.in[1].shape != Shape{d.base.rows}) {
    return Invalid(a, "targets ", cpu::InLabel(c, 1),
                   " must have one entry per row of ", cpu::InLabel(c, 0));
  }
  HAP_RETURN_IF_ERROR(cpu::CheckShape(c, a.in[2], cpu::InLabel(c, 2),
                                      {d.ranks * d.base.rows}));
  HAP_ASSIGN_OR_RETURN(int64_t global, cpu::AttrInt(c, "global_rows", d.base.rows));
  if (global < 1) return Invalid(a, "attribute 'global_rows' must be >= 1");
  d.base.inv_rows = 1.0 / static_cast<double>(global);
  return d;
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
  const T* x = a.in[0].as<const T>();
  const T* lse = a.in[2].as<const T>();
  if (a.in[1].dtype == DType::kInt64) {
    LaunchShardedLossForward<T, int64_t>(d, x, a.in[1].as<const int64_t>(), lse,
                                         row_loss, a.out[0].as<T>(), a.stream);
  } else {
    LaunchShardedLossForward<T, int32_t>(d, x, a.in[1].as<const int32_t>(), lse,
                                         row_loss, a.out[0].as<T>(), a.stream);
  }
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
  const T* x = a.in[0].as<const T>();
  const T* lse = a.in[2].as<const T>();
  const T* dy = a.in[3].as<const T>();
  if (a.in[1].dtype == DType::kInt64) {
    LaunchShardedLossBackward<T, int64_t>(d, x, a.in[1].as<const int64_t>(), lse,
                                          dy, a.out[0].as<T>(), a.stream);
  } else {
    LaunchShardedLossBackward<T, int32_t>(d, x, a.in[1].as<const int32_t>(), lse,
                                          dy, a.out[0].as<T>(), a.stream);
  }
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
