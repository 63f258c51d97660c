#include "executor/cuda/box_copy.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace hap::executor::cuda {

absl::StatusOr<BoxCopyPlan> PlanBoxCopy(const TensorView& src,
                                        absl::Span<const int64_t> src_start,
                                        const TensorView& dst,
                                        absl::Span<const int64_t> dst_start,
                                        absl::Span<const int64_t> extent) {
  // The checks of HostCopyBox (executor/runtime/device.cc).
  const int rank = src.rank();
  if (dst.rank() != rank || static_cast<int>(src_start.size()) != rank ||
      static_cast<int>(dst_start.size()) != rank ||
      static_cast<int>(extent.size()) != rank || src.dtype != dst.dtype) {
    return absl::InvalidArgumentError("copy box: ranks or dtypes differ");
  }
  BoxCopyPlan plan;
  for (int d = 0; d < rank; ++d) {
    if (extent[d] < 0 || src_start[d] < 0 || dst_start[d] < 0 ||
        src_start[d] + extent[d] > src.shape[d] ||
        dst_start[d] + extent[d] > dst.shape[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("copy box: dimension ", d, " out of range"));
    }
    if (extent[d] == 0) {
      plan.empty = true;
      return plan;
    }
  }
  // Byte strides of dimensions [0, rank) and the element's bytes as
  // dimension `rank` (stride 1, extent esize).
  const int64_t esize = graph::DTypeBytes(src.dtype);
  std::vector<int64_t> ext(extent.begin(), extent.end()), ss(rank + 1),
      ds(rank + 1);
  ext.push_back(esize);
  ss[rank] = ds[rank] = 1;
  for (int d = rank - 1; d >= 0; --d) {
    ss[d] = ss[d + 1] * (d + 1 < rank ? src.shape[d + 1] : esize);
    ds[d] = ds[d + 1] * (d + 1 < rank ? dst.shape[d + 1] : esize);
  }
  for (int d = 0; d < rank; ++d) {
    plan.src_offset += src_start[d] * ss[d];
    plan.dst_offset += dst_start[d] * ds[d];
  }
  // Merge a dimension into the outer one before it when stepping the outer
  // index equals stepping the inner one by its extent, in both tensors.
  BoxCopy& box = plan.box;
  int r = 0;
  for (int d = 0; d <= rank; ++d) {
    if (ext[d] == 1 && d < rank) continue;
    if (r > 0 && box.src_stride[r - 1] == ss[d] * ext[d] &&
        box.dst_stride[r - 1] == ds[d] * ext[d]) {
      box.extent[r - 1] *= ext[d];
      box.src_stride[r - 1] = ss[d];
      box.dst_stride[r - 1] = ds[d];
      continue;
    }
    if (r == kMaxDims + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("copy box: more than ", kMaxDims,
                       " dimensions remain after merging"));
    }
    box.extent[r] = ext[d];
    box.src_stride[r] = ss[d];
    box.dst_stride[r] = ds[d];
    ++r;
  }
  box.rank = r;
  // Dimension r - 1 is the contiguous run (stride 1 in both: the element's
  // bytes, possibly merged with whole rows).
  const auto src_addr = reinterpret_cast<uintptr_t>(src.data) + plan.src_offset;
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst.data) + plan.dst_offset;
  int unit = 16;
  for (; unit > 1; unit /= 2) {
    const auto u = static_cast<uint64_t>(unit);
    bool ok = box.extent[r - 1] % unit == 0 && src_addr % u == 0 &&
              dst_addr % u == 0;
    for (int d = 0; ok && d < r - 1; ++d) {
      ok = box.src_stride[d] % unit == 0 && box.dst_stride[d] % unit == 0;
    }
    if (ok) break;
  }
  box.unit = unit;
  box.extent[r - 1] /= unit;
  box.count = 1;
  for (int d = 0; d < r; ++d) {
    if (d < r - 1) {
      box.src_stride[d] /= unit;
      box.dst_stride[d] /= unit;
    }
    box.count *= box.extent[d];
  }
  return plan;
}

}  // namespace hap::executor::cuda
