// Mixture-of-experts kernels on the GPU (GShard formulation), with the
// contracts and argument checks of executor/cpu/kernels_moe.cc: the top-k
// gate producing combine weights [tokens, experts, capacity] (routing in
// token order, as the CPU: a per-token top-k, then one block per expert
// scanning the tokens for slots), and the dispatch and combine einsums over
// the nonzero entries of `combine` in order (kernels_moe.cu); combine's
// weight gradient is a cuBLAS GEMM. The compact form (moe_route,
// moe_route_weights, moe_dispatch_idx, moe_combine_idx) has the CPU's
// contracts too, except that its route entries are not checked here.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/kernels_b_util.h"
#include "executor/cuda/launch_moe.h"

namespace hap::executor::cuda {
namespace {

// --- moe_gate ----------------------------------------------------------------

absl::StatusOr<GateDims> CheckGate(const KernelArgs& a, DType t,
                                   bool capacity = true) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  if (a.in[0].rank() != 2) {
    return Invalid(a, cpu::InLabel(c, 0), " must be [tokens, experts]");
  }
  GateDims d;
  d.tokens = a.in[0].shape[0];
  d.experts = a.in[0].shape[1];
  HAP_ASSIGN_OR_RETURN(d.k, cpu::AttrInt(c, "k", 2));
  if (capacity) {
    HAP_ASSIGN_OR_RETURN(d.capacity, cpu::AttrInt(c, "capacity"));
  }
  if (d.k < 1 || d.k > d.experts) {
    return Invalid(a, "attribute 'k' = ", d.k,
                   " must be in [1, experts = ", d.experts, "]");
  }
  if (d.capacity < 1) return Invalid(a, "attribute 'capacity' must be >= 1");
  if (d.experts > INT32_MAX || d.capacity > INT32_MAX) {
    return Invalid(a, "the CUDA gate supports at most ", INT32_MAX,
                   " experts and capacity");
  }
  d.group = d.tokens;
  d.group_capacity = d.capacity;
  return d;
}

// The routing in scratch: expert and slot of each (token, choice).
struct Routing {
  int32_t* expert = nullptr;
  int32_t* slot = nullptr;
};

template <typename T>
absl::StatusOr<Routing> Route(const KernelArgs& a, const GateDims& d,
                              const T* logits) {
  Routing r;
  HAP_ASSIGN_OR_RETURN(r.expert, ScratchArray<int32_t>(a, d.tokens * d.k));
  HAP_ASSIGN_OR_RETURN(r.slot, ScratchArray<int32_t>(a, d.tokens * d.k));
  LaunchGateRoute<T>(d, logits, r.expert, r.slot, a.stream);
  HAP_RETURN_IF_ERROR(CheckLaunch(a));
  return r;
}

template <typename T>
absl::Status GateForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t));
  HAP_RETURN_IF_ERROR(
      cpu::CheckOutput(c, 0, t, {d.tokens, d.experts, d.capacity}));
  const T* logits = a.in[0].as<const T>();
  HAP_ASSIGN_OR_RETURN(Routing r, Route<T>(a, d, logits));
  LaunchGateCombine<T>(d, logits, r.expert, r.slot, a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status GateBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {{d.tokens, d.experts, d.capacity}}));
  if (!g.active()) return absl::OkStatus();
  const T* logits = g.x(0).as<const T>();
  HAP_ASSIGN_OR_RETURN(Routing r, Route<T>(a, d, logits));
  LaunchGateGrad<T>(d, logits, g.dy(0).as<const T>(), r.expert, r.slot,
                    g.dx(0).as<T>(), a.stream);
  return CheckLaunch(a);
}

// --- moe_route, moe_route_weights --------------------------------------------

template <typename T>
absl::Status RouteForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t));
  HAP_ASSIGN_OR_RETURN(cpu::MoeGroups g, cpu::CheckMoeGroups(c, d.tokens, d.capacity));
  d.group = g.group;
  d.group_capacity = g.group_capacity;
  d.first_group = g.first_group;
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, DType::kInt64, {d.tokens, d.k}));
  HAP_ASSIGN_OR_RETURN(Routing r, Route<T>(a, d, a.in[0].as<const T>()));
  LaunchRouteSlots(d, r.expert, r.slot, a.out[0].as<int64_t>(), a.stream);
  return CheckLaunch(a);
}

// The route is piecewise constant in the logits: nothing to add.
template <typename T>
absl::Status RouteBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 1, 1, 1));
  HAP_RETURN_IF_ERROR(CheckGate(a, t).status());
  if (g.dx(0).present() && g.dx(0).shape != g.x(0).shape) {
    return Invalid(a, "the logits' gradient ", cpu::Describe(g.dx(0)),
                   " must have the logits' shape");
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status RouteWeightsForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t, false));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, {d.tokens, d.k}));
  HAP_ASSIGN_OR_RETURN(int32_t* expert, ScratchArray<int32_t>(a, d.tokens * d.k));
  const T* logits = a.in[0].as<const T>();
  LaunchGateTopK<T>(d, logits, expert, a.stream);
  LaunchRouteWeights<T>(d, logits, expert, a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status RouteWeightsBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(GateDims d, CheckGate(a, t, false));
  HAP_RETURN_IF_ERROR(g.Check(t, {{d.tokens, d.k}}));
  if (!g.active()) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(int32_t* expert, ScratchArray<int32_t>(a, d.tokens * d.k));
  const T* logits = g.x(0).as<const T>();
  LaunchGateTopK<T>(d, logits, expert, a.stream);
  LaunchRouteWeightsGrad<T>(d, logits, g.dy(0).as<const T>(), expert,
                            g.dx(0).as<T>(), a.stream);
  return CheckLaunch(a);
}

// --- moe_dispatch_idx, moe_combine_idx ---------------------------------------

IdxDims ToIdx(const cpu::MoeIdxDims& c) {
  IdxDims m;
  m.tokens = c.tokens;
  m.k = c.k;
  m.experts = c.experts;
  m.capacity = c.capacity;
  m.d = c.d;
  m.offset = c.offset;
  m.capacity_offset = c.capacity_offset;
  m.global_capacity = c.global_capacity;
  return m;
}

absl::StatusOr<IdxDims> CheckDispatchIdx(const KernelArgs& a, DType t,
                                         const TensorView& x,
                                         const TensorView& route,
                                         const TensorView& out) {
  HAP_ASSIGN_OR_RETURN(cpu::MoeIdxDims m, cpu::CheckMoeDispatchIdx(
                                              CpuArgs(a), t, x, route, out));
  return ToIdx(m);
}

absl::StatusOr<IdxDims> CheckCombineIdx(const KernelArgs& a, DType t,
                                        const TensorView& y,
                                        const TensorView& route,
                                        const TensorView& w) {
  HAP_ASSIGN_OR_RETURN(cpu::MoeIdxDims m,
                       cpu::CheckMoeCombineIdx(CpuArgs(a), t, y, route, w));
  return ToIdx(m);
}

absl::StatusOr<int64_t*> SlotEntries(const KernelArgs& a, const IdxDims& m,
                                     const int64_t* route) {
  HAP_ASSIGN_OR_RETURN(int64_t* e,
                       ScratchArray<int64_t>(a, m.experts * m.capacity));
  LaunchSlotEntries(m, route, e, a.stream);
  return e;
}

template <typename T>
absl::Status DispatchIdxForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(IdxDims m,
                       CheckDispatchIdx(a, t, a.in[0], a.in[1], a.out[0]));
  const int64_t* route = a.in[1].as<const int64_t>();
  HAP_ASSIGN_OR_RETURN(int64_t* entries, SlotEntries(a, m, route));
  LaunchDispatchIdx<T>(m, entries, a.in[0].as<const T>(), a.out[0].as<T>(),
                       a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status DispatchIdxBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  if (!g.active()) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(IdxDims m,
                       CheckDispatchIdx(a, t, g.x(0), g.x(1), g.dy(0)));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.dy(0).shape}));
  LaunchTokenSum<T>(m, g.x(1).as<const int64_t>(), nullptr,
                    g.dy(0).as<const T>(), true, g.dx(0).as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status CombineIdxForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 3, 3, 1));
  HAP_ASSIGN_OR_RETURN(IdxDims m,
                       CheckCombineIdx(a, t, a.in[0], a.in[1], a.in[2]));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, {m.tokens, m.d}));
  LaunchTokenSum<T>(m, a.in[1].as<const int64_t>(), a.in[2].as<const T>(),
                    a.in[0].as<const T>(), false, a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status CombineIdxBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 3, 3, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_ASSIGN_OR_RETURN(IdxDims m,
                       CheckCombineIdx(a, t, g.x(0), g.x(1), g.x(2)));
  HAP_RETURN_IF_ERROR(g.Check(t, {{m.tokens, m.d}}));
  if (!g.dy(0).present()) return absl::OkStatus();
  const int64_t* route = g.x(1).as<const int64_t>();
  int64_t* entries = nullptr;
  if (g.dx(0).present()) {
    HAP_ASSIGN_OR_RETURN(entries, SlotEntries(a, m, route));
  }
  LaunchCombineIdxGrad<T>(
      m, route, entries, g.x(0).as<const T>(), g.x(2).as<const T>(),
      g.dy(0).as<const T>(), g.dx(0).present() ? g.dx(0).as<T>() : nullptr,
      g.dx(2).present() ? g.dx(2).as<T>() : nullptr, a.stream);
  return CheckLaunch(a);
}

// --- moe_dispatch, moe_combine -----------------------------------------------

struct MoeDims {
  int64_t tokens = 0, experts = 0, capacity = 0, d = 0;
  int64_t slots() const { return experts * capacity; }
};

// moe_dispatch: x[t, d], combine[t, e, c]; moe_combine: y[e, c, d],
// combine[t, e, c].
absl::StatusOr<MoeDims> CheckMoe(const KernelArgs& a, DType t, bool combine) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  const Shape& x = a.in[0].shape;
  const Shape& w = a.in[1].shape;
  MoeDims m;
  bool ok = w.size() == 3;
  if (ok) {
    m.tokens = w[0];
    m.experts = w[1];
    m.capacity = w[2];
  }
  if (combine) {
    ok = ok && x.size() == 3 && x[0] == m.experts && x[1] == m.capacity;
  } else {
    ok = ok && x.size() == 2 && x[0] == m.tokens;
  }
  if (!ok) {
    return Invalid(a, cpu::InLabel(c, 0), " does not fit combine weights ",
                   cpu::InLabel(c, 1));
  }
  m.d = x.back();
  return m;
}

// y[s] = sum of x[t] over the tokens t with combine[t, s] != 0.
template <typename T>
absl::Status DispatchForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, false));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, {m.experts, m.capacity, m.d}));
  LaunchMoeGather<T>(a.in[1].as<const T>(), m.slots(), m.tokens, 1, m.slots(),
                     a.in[0].as<const T>(), m.d, false, false, a.out[0].as<T>(),
                     a.stream);
  return CheckLaunch(a);
}

// dx[t] += sum of dy[s] over the slots s with combine[t, s] != 0.
template <typename T>
absl::Status DispatchBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({1}));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, false));
  HAP_RETURN_IF_ERROR(g.Check(t, {{m.experts, m.capacity, m.d}}));
  if (!g.active()) return absl::OkStatus();
  LaunchMoeGather<T>(g.x(1).as<const T>(), m.tokens, m.slots(), m.slots(), 1,
                     g.dy(0).as<const T>(), m.d, false, true, g.dx(0).as<T>(),
                     a.stream);
  return CheckLaunch(a);
}

// out[t] = sum of combine[t, s] * y[s] over the nonzero entries.
template <typename T>
absl::Status CombineForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, true));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, {m.tokens, m.d}));
  LaunchMoeGather<T>(a.in[1].as<const T>(), m.tokens, m.slots(), m.slots(), 1,
                     a.in[0].as<const T>(), m.d, true, false, a.out[0].as<T>(),
                     a.stream);
  return CheckLaunch(a);
}

// dy[s] += sum_t combine[t, s] * dout[t] (nonzeros only);
// dcombine[t, s] += dout[t] . y[s] for every entry (a GEMM).
template <typename T>
absl::Status CombineBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(MoeDims m, CheckMoe(a, t, true));
  HAP_RETURN_IF_ERROR(g.Check(t, {{m.tokens, m.d}}));
  if (!g.dy(0).present()) return absl::OkStatus();
  const T* y = g.x(0).as<const T>();
  const T* combine = g.x(1).as<const T>();
  const T* dout = g.dy(0).as<const T>();
  if (g.dx(0).present()) {
    LaunchMoeGather<T>(combine, m.slots(), m.tokens, 1, m.slots(), dout, m.d,
                       true, true, g.dx(0).as<T>(), a.stream);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
  }
  if (g.dx(1).present()) {
    HAP_RETURN_IF_ERROR(cpu::CheckFitsBlas(c, {m.tokens, m.slots(), m.d}));
    HAP_RETURN_IF_ERROR(BatchedGemm<T>(a, false, true, m.tokens, m.slots(), m.d,
                                       dout, m.d, 0, y, m.d, 0, T(1),
                                       g.dx(1).as<T>(), m.slots(), 0, 1));
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterMoeKernels(KernelTable& t) {
  t["moe_gate"] = HAP_CUDA_FLOAT_KERNEL(GateForward);
  t["moe_gate_grad"] = HAP_CUDA_FLOAT_KERNEL(GateBackward);
  t["moe_dispatch"] = HAP_CUDA_FLOAT_KERNEL(DispatchForward);
  t["moe_dispatch_grad"] = HAP_CUDA_FLOAT_KERNEL(DispatchBackward);
  t["moe_combine"] = HAP_CUDA_FLOAT_KERNEL(CombineForward);
  t["moe_combine_grad"] = HAP_CUDA_FLOAT_KERNEL(CombineBackward);
  t["moe_route"] = HAP_CUDA_FLOAT_KERNEL(RouteForward);
  t["moe_route_grad"] = HAP_CUDA_FLOAT_KERNEL(RouteBackward);
  t["moe_route_weights"] = HAP_CUDA_FLOAT_KERNEL(RouteWeightsForward);
  t["moe_route_weights_grad"] = HAP_CUDA_FLOAT_KERNEL(RouteWeightsBackward);
  t["moe_dispatch_idx"] = HAP_CUDA_FLOAT_KERNEL(DispatchIdxForward);
  t["moe_dispatch_idx_grad"] = HAP_CUDA_FLOAT_KERNEL(DispatchIdxBackward);
  t["moe_combine_idx"] = HAP_CUDA_FLOAT_KERNEL(CombineIdxForward);
  t["moe_combine_idx_grad"] = HAP_CUDA_FLOAT_KERNEL(CombineIdxBackward);
}

}  // namespace hap::executor::cuda
