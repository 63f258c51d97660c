// Layout kernels on the GPU: transpose, reshape, flatten, concat, split,
// slice, expand and the embedding lookup, with the contracts and argument
// checks of executor/cpu/kernels_layout.cc. The forward kernels move integer
// tensors too. Launchers are in kernels_layout.cu.
//
// One difference from the CPU: an embedding id outside the vocabulary is
// found on the GPU, so it is reported through KernelArgs::fault (the device
// returns InvalidArgument at its next synchronization) instead of by this
// call; the id's row reads as zeros and gets no gradient meanwhile.
#include <limits>

#include "common/status_macros.h"
#include "executor/cuda/kernel_checks.h"
#include "executor/cuda/kernels_b_util.h"
#include "executor/cuda/launch_elementwise.h"
#include "executor/cuda/launch_layout.h"

namespace hap::executor::cuda {
namespace {

// The shape helpers and checks shared with the CPU (kernels_internal.h).
using cpu::AroundAxis;
using cpu::AxisView;
using cpu::Permuted;
using cpu::PermuteShape;
using cpu::SliceRange;

// --- transpose ---------------------------------------------------------------

// dst (+)= src over `shape`, each read through its strides.
template <typename T>
absl::Status StridedCopy(const KernelArgs& a, const Shape& shape, T* dst,
                         const std::vector<int64_t>& dst_strides, const T* src,
                         const std::vector<int64_t>& src_strides,
                         bool accumulate) {
  HAP_ASSIGN_OR_RETURN(StridedSpace space,
                       MakeSpace(a, shape, {dst_strides, src_strides}));
  LaunchStridedCopy<T>(space, src, dst, accumulate, a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status TransposeForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckUnary(c, t));
  HAP_ASSIGN_OR_RETURN(std::vector<int> perm, cpu::Perm(c, a.in[0].rank()));
  Permuted p = PermuteShape(a.in[0].shape, perm);
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, p.shape));
  return StridedCopy<T>(a, p.shape, a.out[0].as<T>(),
                        cpu::ContiguousStrides(p.shape), a.in[0].as<const T>(),
                        p.in_strides, false);
}

template <typename T>
absl::Status TransposeBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Unary(c, t));
  HAP_ASSIGN_OR_RETURN(std::vector<int> perm, cpu::Perm(c, g.x(0).rank()));
  Permuted p = PermuteShape(g.x(0).shape, perm);
  HAP_RETURN_IF_ERROR(g.Check(t, {p.shape}));
  if (!g.active()) return absl::OkStatus();
  // dx, read in dy's (the output's) order, += dy: a permutation, so every dy
  // element has its own dx element.
  return StridedCopy<T>(a, p.shape, g.dx(0).as<T>(), p.in_strides,
                        g.dy(0).as<const T>(), cpu::ContiguousStrides(p.shape),
                        true);
}

// --- reshape, flatten: the same elements in a new shape ----------------------

template <typename T>
absl::Status ReshapeForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckUnary(c, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, a.out[0].shape));
  if (a.out[0].num_elements() != a.in[0].num_elements()) {
    return Invalid(a, cpu::OutLabel(c, 0), " and ", cpu::InLabel(c, 0),
                   " differ in element count");
  }
  if (a.out[0].data != a.in[0].data && a.in[0].bytes() > 0) {
    const cudaError_t e =
        cudaMemcpyAsync(a.out[0].data, a.in[0].data, a.in[0].bytes(),
                        cudaMemcpyDeviceToDevice, a.stream);
    HAP_RETURN_IF_ERROR(KernelCudaStatus(a, e, "cudaMemcpyAsync"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ReshapeBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Unary(c, t));
  if (!g.active()) return absl::OkStatus();
  HAP_RETURN_IF_ERROR(g.Check(t, {g.dy(0).shape}));
  if (g.dy(0).num_elements() != g.x(0).num_elements()) {
    return Invalid(a, "the output gradient ", cpu::InLabel(c, 2), " and ",
                   cpu::InLabel(c, 0), " differ in element count");
  }
  LaunchAccumulate<T>(g.dy(0).as<const T>(), g.dx(0).as<T>(),
                      g.x(0).num_elements(), a.stream);
  return CheckLaunch(a);
}

// stop_gradient's backward: no gradient flows through it, so it adds nothing
// to the input's (gradients accumulate); its arguments are still checked.
template <typename T>
absl::Status StopGradientBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Unary(c, t));
  if (!g.active()) return absl::OkStatus();
  return g.Check(t, {g.dy(0).shape});
}

// --- concat, split, slice: blocks along one axis -----------------------------

// Moves every present part into (to_whole) or out of the whole along the
// axis; the parts are disjoint blocks of the whole, so accumulation is
// race-free.
template <typename T>
absl::Status Scatter(const KernelArgs& a, const TensorView& whole, int axis,
                     const std::vector<const TensorView*>& parts,
                     const std::vector<int64_t>& sizes, bool to_whole,
                     bool accumulate) {
  AxisView w = AroundAxis(whole.shape, axis);
  int64_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i]->present()) {
      T* wp = whole.as<T>();
      T* pp = parts[i]->as<T>();
      if (to_whole) {
        LaunchAxisCopy<T>(w.outer, w.inner, pp, sizes[i], 0, wp, w.len, at,
                          sizes[i], accumulate, a.stream);
      } else {
        LaunchAxisCopy<T>(w.outer, w.inner, wp, w.len, at, pp, sizes[i], 0,
                          sizes[i], accumulate, a.stream);
      }
      HAP_RETURN_IF_ERROR(CheckLaunch(a));
    }
    at += sizes[i];
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ConcatForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 1, -1, 1));
  std::vector<const TensorView*> parts;
  for (int i = 0; i < static_cast<int>(a.in.size()); ++i) {
    HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
    parts.push_back(&a.in[i]);
  }
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, a.out[0].shape));
  HAP_ASSIGN_OR_RETURN(int axis, cpu::AxisAttr(c, a.out[0]));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       cpu::PartSizes(c, a.out[0], axis, parts, "input", {}));
  return Scatter<T>(a, a.out[0], axis, parts, sizes, true, false);
}

template <typename T>
absl::Status ConcatBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 1, 1 << 20, 1));
  std::vector<const TensorView*> xs, dxs;
  for (int i = 0; i < g.n(); ++i) {
    HAP_RETURN_IF_ERROR(cpu::CheckInput(c, i, t));
    xs.push_back(&g.x(i));
    dxs.push_back(&g.dx(i));
  }
  if (!g.dy(0).present()) return absl::OkStatus();
  HAP_ASSIGN_OR_RETURN(int axis, cpu::AxisAttr(c, g.dy(0)));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       cpu::PartSizes(c, g.dy(0), axis, xs, "input", {}));
  HAP_RETURN_IF_ERROR(g.Check(t, {g.dy(0).shape}));
  return Scatter<T>(a, g.dy(0), axis, dxs, sizes, false, true);
}

template <typename T>
absl::Status SplitForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  if (a.in.size() != 1 || a.out.empty()) {
    return Invalid(a, "takes 1 input and at least 1 output, got ", a.in.size(),
                   " and ", a.out.size());
  }
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  std::vector<const TensorView*> parts;
  for (int j = 0; j < static_cast<int>(a.out.size()); ++j) {
    HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, j, t, a.out[j].shape));
    parts.push_back(&a.out[j]);
  }
  HAP_ASSIGN_OR_RETURN(int axis, cpu::AxisAttr(c, a.in[0]));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       cpu::PartSizes(c, a.in[0], axis, parts, "output", {}));
  return Scatter<T>(a, a.in[0], axis, parts, sizes, false, false);
}

template <typename T>
absl::Status SplitBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 1, 1, -1));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 0, t));
  HAP_ASSIGN_OR_RETURN(int axis, cpu::AxisAttr(c, g.x(0)));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> attr_sizes,
                       cpu::AttrInts(c, "sizes", {}));
  // A part's size: from its value, else its gradient, else the attribute.
  std::vector<const TensorView*> shapes, dys;
  std::vector<Shape> y_shapes;
  for (int j = 0; j < g.m(); ++j) {
    shapes.push_back(g.y(j).present() ? &g.y(j) : &g.dy(j));
    dys.push_back(&g.dy(j));
  }
  HAP_ASSIGN_OR_RETURN(
      std::vector<int64_t> sizes,
      cpu::PartSizes(c, g.x(0), axis, shapes, "output", attr_sizes));
  for (int j = 0; j < g.m(); ++j) {
    y_shapes.push_back(g.x(0).shape);
    y_shapes.back()[axis] = sizes[j];
  }
  HAP_RETURN_IF_ERROR(g.Check(t, y_shapes));
  if (!g.dx(0).present()) return absl::OkStatus();
  return Scatter<T>(a, g.dx(0), axis, dys, sizes, true, true);
}

template <typename T>
absl::Status SliceForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckUnary(c, t));
  HAP_ASSIGN_OR_RETURN(SliceRange r, cpu::CheckSlice(c, a.in[0]));
  Shape s = a.in[0].shape;
  s[r.axis] = r.end - r.start;
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, s));
  AxisView x = AroundAxis(a.in[0].shape, r.axis);
  LaunchAxisCopy<T>(x.outer, x.inner, a.in[0].as<const T>(), x.len, r.start,
                    a.out[0].as<T>(), s[r.axis], 0, s[r.axis], false, a.stream);
  return CheckLaunch(a);
}

template <typename T>
absl::Status SliceBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Unary(c, t));
  HAP_ASSIGN_OR_RETURN(SliceRange r, cpu::CheckSlice(c, g.x(0)));
  Shape s = g.x(0).shape;
  s[r.axis] = r.end - r.start;
  HAP_RETURN_IF_ERROR(g.Check(t, {s}));
  if (!g.active()) return absl::OkStatus();
  AxisView x = AroundAxis(g.x(0).shape, r.axis);
  LaunchAxisCopy<T>(x.outer, x.inner, g.dy(0).as<const T>(), s[r.axis], 0,
                    g.dx(0).as<T>(), x.len, r.start, s[r.axis], true, a.stream);
  return CheckLaunch(a);
}

// --- expand ------------------------------------------------------------------

template <typename T>
absl::Status ExpandForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckUnary(c, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, a.out[0].shape));
  const Shape& s = a.out[0].shape;
  if (!cpu::BroadcastsTo(a.in[0].shape, s)) {
    return Invalid(a, cpu::InLabel(c, 0), " does not broadcast to ",
                   cpu::OutLabel(c, 0));
  }
  return StridedCopy<T>(a, s, a.out[0].as<T>(), cpu::ContiguousStrides(s),
                        a.in[0].as<const T>(),
                        cpu::BroadcastStrides(a.in[0].shape, s), false);
}

// dx += dy summed over the broadcast dimensions: the deterministic strided
// reduction of the elementwise family (launch_elementwise.h).
template <typename T>
absl::Status ExpandBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Unary(c, t));
  if (!g.active()) return absl::OkStatus();
  const Shape& s = g.dy(0).shape;
  HAP_RETURN_IF_ERROR(g.Check(t, {s}));
  if (!cpu::BroadcastsTo(g.x(0).shape, s)) {
    return Invalid(a, cpu::InLabel(c, 0), " does not broadcast to ",
                   cpu::InLabel(c, 2));
  }
  HAP_ASSIGN_OR_RETURN(
      ReduceSpace space,
      MakeReduceSpace(a, s, cpu::BroadcastStrides(g.x(0).shape, s),
                      cpu::ContiguousStrides(s)));
  LaunchReduce<T>(space, g.dy(0).as<const T>(), nullptr, 1.0, g.dx(0).as<T>(),
                  true, a.stream);
  return CheckLaunch(a);
}

// --- embedding ---------------------------------------------------------------

// ids[...] int, table[rows, d]: the local table holds rows [offset, offset +
// rows) of the vocabulary (executor/cpu/kernels.h). The CPU's checks but
// the ids' range, which the GPU checks (FaultWord).
struct EmbeddingDims {
  int64_t n = 0, rows = 0, d = 0, offset = 0, vocab = 0;
  Shape y;
};

absl::StatusOr<EmbeddingDims> CheckEmbedding(const KernelArgs& a, DType t) {
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckIdsInput(c, 0));
  HAP_RETURN_IF_ERROR(cpu::CheckInput(c, 1, t));
  if (a.in[1].rank() != 2) {
    return Invalid(a, "table ", cpu::InLabel(c, 1), " must have rank 2");
  }
  EmbeddingDims e;
  e.n = a.in[0].num_elements();
  e.rows = a.in[1].shape[0];
  e.d = a.in[1].shape[1];
  e.y = a.in[0].shape;
  e.y.push_back(e.d);
  HAP_ASSIGN_OR_RETURN(e.offset, cpu::AttrInt(c, "vocab_offset", 0));
  // Without "vocab_size", a shard at a nonzero offset checks the lower bound
  // only (it cannot know the vocabulary).
  HAP_ASSIGN_OR_RETURN(
      e.vocab,
      cpu::AttrInt(
          c, "vocab_size",
          e.offset == 0 ? e.rows : std::numeric_limits<int64_t>::max()));
  if (e.offset < 0 || e.offset + e.rows > e.vocab) {
    return Invalid(a, "table rows [", e.offset, ", ", e.offset + e.rows,
                   ") do not fit in the vocabulary of ", e.vocab);
  }
  return e;
}

FaultWord Fault(const KernelArgs& a) {
  return FaultWord{a.fault.word, a.fault.code};
}

template <typename T>
absl::Status EmbeddingForward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_RETURN_IF_ERROR(cpu::CheckArity(c, 2, 2, 1));
  HAP_ASSIGN_OR_RETURN(EmbeddingDims e, CheckEmbedding(a, t));
  HAP_RETURN_IF_ERROR(cpu::CheckOutput(c, 0, t, e.y));
  const T* table = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  if (a.in[0].dtype == DType::kInt64) {
    LaunchEmbedding<T, int64_t>(a.in[0].as<const int64_t>(), e.n, table, e.rows,
                                e.d, e.offset, e.vocab, y, Fault(a), a.stream);
  } else {
    LaunchEmbedding<T, int32_t>(a.in[0].as<const int32_t>(), e.n, table, e.rows,
                                e.d, e.offset, e.vocab, y, Fault(a), a.stream);
  }
  return CheckLaunch(a);
}

template <typename T>
absl::Status EmbeddingBackward(const KernelArgs& a) {
  constexpr DType t = cpu::DTypeOf<T>();
  const cpu::KernelArgs c = CpuArgs(a);
  HAP_ASSIGN_OR_RETURN(cpu::GradArgs g, cpu::GradArgs::Make(c, 2, 2, 1));
  HAP_RETURN_IF_ERROR(g.CheckNoGrad({0}));
  HAP_ASSIGN_OR_RETURN(EmbeddingDims e, CheckEmbedding(a, t));
  HAP_RETURN_IF_ERROR(g.Check(t, {e.y}));
  if (!g.dy(0).present() || !g.dx(1).present() || e.n == 0) {
    return absl::OkStatus();
  }
  const size_t bytes = EmbeddingGradScratchBytes(e.n, e.rows);
  HAP_ASSIGN_OR_RETURN(char* scratch,
                       ScratchArray<char>(a, static_cast<int64_t>(bytes)));
  const T* dy = g.dy(0).as<const T>();
  T* dtable = g.dx(1).as<T>();
  const cudaError_t err =
      g.x(0).dtype == DType::kInt64
          ? LaunchEmbeddingGrad<T, int64_t>(
                g.x(0).as<const int64_t>(), e.n, dy, e.rows, e.d, e.offset,
                e.vocab, dtable, scratch, bytes, Fault(a), a.stream)
          : LaunchEmbeddingGrad<T, int32_t>(
                g.x(0).as<const int32_t>(), e.n, dy, e.rows, e.d, e.offset,
                e.vocab, dtable, scratch, bytes, Fault(a), a.stream);
  HAP_RETURN_IF_ERROR(KernelCudaStatus(a, err, "LaunchEmbeddingGrad"));
  return CheckLaunch(a);
}

}  // namespace

void RegisterLayoutKernels(KernelTable& t) {
  t["transpose"] = HAP_CUDA_ANY_KERNEL(TransposeForward);
  t["transpose_grad"] = HAP_CUDA_FLOAT_KERNEL(TransposeBackward);
  t["reshape"] = HAP_CUDA_ANY_KERNEL(ReshapeForward);
  t["reshape_grad"] = HAP_CUDA_FLOAT_KERNEL(ReshapeBackward);
  t["flatten"] = HAP_CUDA_ANY_KERNEL(ReshapeForward);
  t["flatten_grad"] = HAP_CUDA_FLOAT_KERNEL(ReshapeBackward);
  t["stop_gradient"] = HAP_CUDA_ANY_KERNEL(ReshapeForward);  // a copy
  t["stop_gradient_grad"] = HAP_CUDA_FLOAT_KERNEL(StopGradientBackward);
  t["concat"] = HAP_CUDA_ANY_KERNEL(ConcatForward);
  t["concat_grad"] = HAP_CUDA_FLOAT_KERNEL(ConcatBackward);
  t["split"] = HAP_CUDA_ANY_KERNEL(SplitForward);
  t["split_grad"] = HAP_CUDA_FLOAT_KERNEL(SplitBackward);
  t["slice"] = HAP_CUDA_ANY_KERNEL(SliceForward);
  t["slice_grad"] = HAP_CUDA_FLOAT_KERNEL(SliceBackward);
  t["expand"] = HAP_CUDA_ANY_KERNEL(ExpandForward);
  t["expand_grad"] = HAP_CUDA_FLOAT_KERNEL(ExpandBackward);
  t["embedding"] = HAP_CUDA_FLOAT_KERNEL(EmbeddingForward);
  t["embedding_grad"] = HAP_CUDA_FLOAT_KERNEL(EmbeddingBackward);
}

}  // namespace hap::executor::cuda
