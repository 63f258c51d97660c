// Element-wise kernels on the GPU: activations, dropout, scale, and the
// broadcasting binary arithmetic (add, sub, mul), with the contracts and
// argument checks of executor/cpu/kernels_elementwise.cc. Launchers are in
// kernels_elementwise.cu.
#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/launch_elementwise.h"
#include "executor/runtime/random.h"

namespace hap::executor::cuda {
namespace {

// --- activations ------------------------------------------------------------

template <Activation act, typename T>
absl::Status UnaryForward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckElementwise(c, cpu::DTypeOf<T>()));
  LaunchActivation<T>(act, a.in[0].as<const T>(), a.out[0].as<T>(),
                      a.in[0].num_elements(), a.stream);
  return CheckLaunch(a);
}

template <Activation act, typename T>
absl::Status UnaryBackward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g,
                       cpu::GradArgs::Elementwise(c, cpu::DTypeOf<T>()));
  if (!g.active()) return absl::OkStatus();
  LaunchActivationGrad<T>(
      act, g.x(0).as<const T>(),
      g.y(0).present() ? g.y(0).as<const T>() : nullptr,
      g.dy(0).as<const T>(), g.dx(0).as<T>(), g.x(0).num_elements(), a.stream);
  return CheckLaunch(a);
}

template <Activation act>
void RegisterUnary(KernelTable& t, const std::string& name) {
  t[name] = FloatKernel(&UnaryForward<act, float>, &UnaryForward<act, double>);
  t[name + "_grad"] =
      FloatKernel(&UnaryBackward<act, float>, &UnaryBackward<act, double>);
}

// --- dropout ------------------------------------------------------------------

// The mask of a (possibly sharded) tensor, checked as the CPU's DropoutMask.
absl::StatusOr<DropoutMask> MakeMask(const KernelArgs& a, const Shape& local) {
  const cpu::KernelArgs c = CpuArgs(a);
  DropoutMask m;
  HAP_ASSIGN_OR_RETURN(m.p, cpu::AttrFloat(c, "p", 0.1));
  if (!(m.p >= 0 && m.p < 1)) {
    return Invalid(a, "attribute 'p' must be in [0, 1), got ", m.p);
  }
  HAP_ASSIGN_OR_RETURN(int64_t key, cpu::AttrInt(c, "rng_key", 0));
  HAP_ASSIGN_OR_RETURN(Shape global, cpu::AttrInts(c, "global_shape", local));
  HAP_ASSIGN_OR_RETURN(
      std::vector<int64_t> offsets,
      cpu::AttrInts(c, "offsets", std::vector<int64_t>(local.size())));
  if (global.size() != local.size() || offsets.size() != local.size()) {
    return Invalid(a, "attributes 'global_shape' and 'offsets' must have "
                      "one entry per dimension of ",
                   graph::ShapeString(local));
  }
  for (size_t d = 0; d < local.size(); ++d) {
    if (offsets[d] < 0 || offsets[d] + local[d] > global[d]) {
      return Invalid(a, "the local slice ", graph::ShapeString(local),
                     " at offsets ", graph::ShapeString(offsets),
                     " does not fit in global shape ",
                     graph::ShapeString(global));
    }
  }
  if (local.size() > static_cast<size_t>(kMaxDims)) {
    return Invalid(a, "the CUDA dropout supports rank <= ", kMaxDims, ", got ",
                   graph::ShapeString(local));
  }
  m.key = CounterKey(static_cast<uint64_t>(key),
                     static_cast<uint64_t>(a.ctx.step));
  m.rank = static_cast<int>(local.size());
  HAP_ASSIGN_OR_RETURN(const std::vector<int64_t> gs,
                       cpu::MaskCounterStrides(c, global));
  for (int d = 0; d < m.rank; ++d) {
    m.local[d] = local[d];
    m.offsets[d] = offsets[d];
    m.global_strides[d] = gs[d];
  }
  return m;
}

template <typename T>
absl::Status DropoutForward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckElementwise(c, cpu::DTypeOf<T>()));
  HAP_ASSIGN_OR_RETURN(DropoutMask m, MakeMask(a, a.in[0].shape));
  LaunchDropout<T>(m, static_cast<T>(1.0 / (1.0 - m.p)), a.in[0].as<const T>(),
                   a.out[0].as<T>(), a.in[0].num_elements(), false, a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status DropoutBackward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g,
                       cpu::GradArgs::Elementwise(c, cpu::DTypeOf<T>()));
  HAP_ASSIGN_OR_RETURN(DropoutMask m, MakeMask(a, g.x(0).shape));
  if (!g.active()) return absl::OkStatus();
  LaunchDropout<T>(m, static_cast<T>(1.0 / (1.0 - m.p)), g.dy(0).as<const T>(),
                   g.dx(0).as<T>(), g.x(0).num_elements(), true, a.stream);
  return CheckLaunch(a);
}

// --- scale --------------------------------------------------------------------

template <typename T>
absl::Status ScaleForward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckElementwise(c, cpu::DTypeOf<T>()));
  HAP_ASSIGN_OR_RETURN(double f, cpu::AttrFloat(c, "factor"));
  LaunchScale<T>(static_cast<T>(f), a.in[0].as<const T>(), a.out[0].as<T>(),
                 a.in[0].num_elements(), false, a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status ScaleBackward(const KernelArgs& a) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g,
                       cpu::GradArgs::Elementwise(c, cpu::DTypeOf<T>()));
  HAP_ASSIGN_OR_RETURN(double f, cpu::AttrFloat(c, "factor"));
  if (!g.active()) return absl::OkStatus();
  LaunchScale<T>(static_cast<T>(f), g.dy(0).as<const T>(), g.dx(0).as<T>(),
                 g.x(0).num_elements(), true, a.stream);
  return CheckLaunch(a);
}

// --- add, sub, mul ------------------------------------------------------------

// The output shape of a binary op (as the CPU's): the broadcast of its
// present operands, or `given` when one is absent.
absl::StatusOr<Shape> BinaryShape(const KernelArgs& a, const TensorView& x,
                                  const TensorView& y, const Shape& given) {
  const cpu::KernelArgs c = CpuArgs(a);
  if (!x.present() && !y.present()) {
    return Invalid(a, "both operands are absent");
  }
  Shape s = given;
  if (x.present() && y.present()) {
    auto b = cpu::BroadcastShape(x.shape, y.shape);
    if (!b.ok()) {
      return Invalid(a, "operands ", cpu::InLabel(c, 0), " and ",
                     cpu::InLabel(c, 1), " do not broadcast");
    }
    s = *b;
  }
  for (int i : {0, 1}) {
    const TensorView& v = i == 0 ? x : y;
    if (v.present() && !cpu::BroadcastsTo(v.shape, s)) {
      return Invalid(a, cpu::InLabel(c, i), " does not broadcast to ",
                     graph::ShapeString(s));
    }
  }
  return s;
}

// Strides of an operand read over `s` (zeros when absent: never read).
std::vector<int64_t> OperandStrides(const TensorView& v, const Shape& s) {
  if (!v.present()) return std::vector<int64_t>(s.size(), 0);
  return cpu::BroadcastStrides(v.shape, s);
}

template <typename T, BinaryOp op>
absl::Status BinaryForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  for (int i : {0, 1}) {
    if (a.in[i].present()) HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
  }
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  HAP_ASSIGN_OR_RETURN(Shape s,
                       BinaryShape(a, a.in[0], a.in[1], a.out[0].shape));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, s));
  HAP_ASSIGN_OR_RETURN(
      StridedSpace space,
      MakeSpace(a, s,
                {cpu::ContiguousStrides(s), OperandStrides(a.in[0], s),
                 OperandStrides(a.in[1], s)}));
  LaunchBinary<T>(op, space,
                  a.in[0].present() ? a.in[0].as<const T>() : nullptr,
                  a.in[1].present() ? a.in[1].as<const T>() : nullptr,
                  a.out[0].as<T>(), a.stream);
  return CheckLaunch(a);
}

template <typename T, BinaryOp op>
absl::Status BinaryBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  for (int i : {0, 1}) {
    if (g.x(i).present()) HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
  }
  if (!g.dy(0).present()) return absl::OkStatus();  // a zero gradient
  HAP_ASSIGN_OR_RETURN(Shape s, BinaryShape(a, g.x(0), g.x(1), g.dy(0).shape));
  HAP_RETURN_IF_ERROR(g.Check(t, {s}));
  const std::vector<int64_t> dy_strides = cpu::ContiguousStrides(s);
  for (int i : {0, 1}) {
    if (!g.dx(i).present()) continue;
    const std::vector<int64_t> dx_strides =
        cpu::BroadcastStrides(g.x(i).shape, s);
    const T* other = nullptr;
    std::vector<int64_t> other_strides;
    if constexpr (op == BinaryOp::kMul) {
      const TensorView& o = g.x(1 - i);
      if (!o.present()) continue;  // the other factor is 0: dx += 0
      other = o.as<const T>();
      other_strides = cpu::BroadcastStrides(o.shape, s);
    }
    HAP_ASSIGN_OR_RETURN(
        ReduceSpace space,
        MakeReduceSpace(a, s, dx_strides, dy_strides, other_strides));
    const double sign = op == BinaryOp::kSub && i == 1 ? -1.0 : 1.0;
    HAP_ASSIGN_OR_RETURN(double* scratch, ReduceScratch(a, space));
    LaunchReduce<T>(space, g.dy(0).as<const T>(), other, sign, g.dx(i).as<T>(),
                    true, a.stream, scratch);
    HAP_RETURN_IF_ERROR(CheckLaunch(a));
  }
  return absl::OkStatus();
}

template <BinaryOp op>
void RegisterBinary(KernelTable& t, const std::string& name) {
  t[name] = FloatKernel(&BinaryForward<float, op>, &BinaryForward<double, op>);
  t[name + "_grad"] =
      FloatKernel(&BinaryBackward<float, op>, &BinaryBackward<double, op>);
}

}  // namespace

void RegisterElementwiseKernels(KernelTable& t) {
  RegisterUnary<Activation::kRelu>(t, "relu");
  RegisterUnary<Activation::kGelu>(t, "gelu");
  RegisterUnary<Activation::kSigmoid>(t, "sigmoid");
  RegisterUnary<Activation::kTanh>(t, "tanh");
  RegisterUnary<Activation::kSilu>(t, "silu");
  RegisterUnary<Activation::kRelu6>(t, "relu6");
  RegisterUnary<Activation::kHardsigmoid>(t, "hardsigmoid");
  RegisterUnary<Activation::kHardswish>(t, "hardswish");
  RegisterUnary<Activation::kExp>(t, "exp");
  RegisterUnary<Activation::kRsqrt>(t, "rsqrt");
  RegisterUnary<Activation::kLog>(t, "log");
  t["dropout"] = HAP_CUDA_FLOAT_KERNEL(DropoutForward);
  t["dropout_grad"] = HAP_CUDA_FLOAT_KERNEL(DropoutBackward);
  t["drop_path"] = HAP_CUDA_FLOAT_KERNEL(DropoutForward);
  t["drop_path_grad"] = HAP_CUDA_FLOAT_KERNEL(DropoutBackward);
  t["scale"] = HAP_CUDA_FLOAT_KERNEL(ScaleForward);
  t["scale_grad"] = HAP_CUDA_FLOAT_KERNEL(ScaleBackward);
  RegisterBinary<BinaryOp::kAdd>(t, "add");
  RegisterBinary<BinaryOp::kSub>(t, "sub");
  RegisterBinary<BinaryOp::kMul>(t, "mul");
}

}  // namespace hap::executor::cuda
