// Internal to executor/cuda: how CudaDevice::CopyBox copies a box (host
// planning only, so it is tested without a GPU).
#ifndef HAP_EXECUTOR_CUDA_BOX_COPY_H_
#define HAP_EXECUTOR_CUDA_BOX_COPY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "executor/cuda/launch_runtime.h"
#include "executor/runtime/tensor.h"

namespace hap::executor::cuda {

struct BoxCopyPlan {
  bool empty = false;      // nothing to copy (an extent is 0)
  int64_t src_offset = 0;  // bytes from src.data to the box's first element
  int64_t dst_offset = 0;
  BoxCopy box;  // strides in units of box.unit bytes
};

// The checks of HostCopyBox (same errors), then the copy as a BoxCopy:
// byte strides with the element's bytes as an innermost dimension,
// dimensions contiguous in both tensors merged, extent-1 ones dropped, and
// the widest unit (16, 8, 4, 2, 1 bytes) dividing the contiguous run, every
// stride and both start addresses. InvalidArgument when more than
// kMaxDims + 1 dimensions remain.
absl::StatusOr<BoxCopyPlan> PlanBoxCopy(const TensorView& src,
                                        absl::Span<const int64_t> src_start,
                                        const TensorView& dst,
                                        absl::Span<const int64_t> dst_start,
                                        absl::Span<const int64_t> extent);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_BOX_COPY_H_
