#include "executor/cuda/kernel_checks.h"

#include "common/status_macros.h"

namespace hap::executor::cuda {

KernelFn FloatKernel(TypedKernel f32, TypedKernel f64) {
  return cpu::FloatDispatch<KernelArgs>(f32, f64);
}

}  // namespace hap::executor::cuda

namespace hap::executor::cuda {
namespace {

// MakeSpace over the dimensions `dims` of `shape` only.
absl::StatusOr<StridedSpace> SpaceOver(
    const KernelArgs& a, const Shape& shape, const std::vector<int>& dims,
    const std::vector<std::vector<int64_t>>& strides) {
  const int ops = static_cast<int>(strides.size());
  if (ops > kMaxOperands) {
    return absl::InternalError(
        absl::StrCat("kernel '", a.name, "': ", ops, " operands in a space"));
  }
  StridedSpace s;
  for (int d : dims) s.count *= shape[d];
  if (s.count == 0) return s;  // nothing to index
  int rank = 0;
  for (int d : dims) {
    if (shape[d] == 1) continue;
    bool merge = rank > 0;
    for (int k = 0; merge && k < ops; ++k) {
      merge = s.stride[k][rank - 1] == strides[k][d] * shape[d];
    }
    if (merge) {
      s.shape[rank - 1] *= shape[d];
      for (int k = 0; k < ops; ++k) s.stride[k][rank - 1] = strides[k][d];
      continue;
    }
    if (rank == kMaxDims) {
      return Invalid(a, "the CUDA kernels index at most ", kMaxDims,
                     " non-mergeable dimensions; ", graph::ShapeString(shape),
                     " needs more");
    }
    s.shape[rank] = shape[d];
    for (int k = 0; k < ops; ++k) s.stride[k][rank] = strides[k][d];
    ++rank;
  }
  s.rank = rank;
  return s;
}

}  // namespace

absl::StatusOr<StridedSpace> MakeSpace(
    const KernelArgs& a, const Shape& shape,
    const std::vector<std::vector<int64_t>>& strides) {
  std::vector<int> dims(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) dims[d] = static_cast<int>(d);
  return SpaceOver(a, shape, dims, strides);
}

absl::StatusOr<ReduceSpace> MakeReduceSpace(
    const KernelArgs& a, const Shape& shape,
    const std::vector<int64_t>& out_strides,
    const std::vector<int64_t>& a_strides,
    const std::vector<int64_t>& b_strides) {
  const std::vector<int64_t> zero(shape.size(), 0);
  const std::vector<int64_t>& bs = b_strides.empty() ? zero : b_strides;
  std::vector<int> kept, reduced;
  for (size_t d = 0; d < shape.size(); ++d) {
    (out_strides[d] == 0 && shape[d] != 1 ? reduced : kept)
        .push_back(static_cast<int>(d));
  }
  ReduceSpace r;
  HAP_ASSIGN_OR_RETURN(r.kept,
                       SpaceOver(a, shape, kept, {out_strides, a_strides, bs}));
  HAP_ASSIGN_OR_RETURN(r.reduced,
                       SpaceOver(a, shape, reduced, {zero, a_strides, bs}));
  return r;
}

absl::StatusOr<double*> ReduceScratch(const KernelArgs& a,
                                      const ReduceSpace& space) {
  const int64_t doubles = ReduceScratchDoubles(space);
  if (doubles == 0) return nullptr;
  HAP_ASSIGN_OR_RETURN(void* p, a.scratch.Get(doubles * sizeof(double)));
  return static_cast<double*>(p);
}

}  // namespace hap::executor::cuda
