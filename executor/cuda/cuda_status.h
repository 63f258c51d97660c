// CUDA runtime results as absl::Status: the one conversion the CUDA device,
// its kernels, the NCCL communicator and the GPU benchmarks use.
#ifndef HAP_EXECUTOR_CUDA_CUDA_STATUS_H_
#define HAP_EXECUTOR_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace hap::executor::cuda {

// OK for cudaSuccess; otherwise Internal
// "<context>: <call> failed: <error name> (<description>)", without the
// "<context>: " when `context` is empty.
absl::Status CudaStatus(cudaError_t e, absl::string_view call, absl::string_view context = {});

}  // namespace hap::executor::cuda

// Returns the failure from the enclosing function (absl::Status or
// StatusOr) when `expr`, a CUDA runtime call, does not succeed; `context`
// says what was being done (e.g. "GPU 0", "CUDA kernel 'relu'").
#define HAP_CUDA_RETURN_IF_ERROR(expr, context) \
  HAP_RETURN_IF_ERROR(::hap::executor::cuda::CudaStatus((expr), #expr, (context)))

#endif  // HAP_EXECUTOR_CUDA_CUDA_STATUS_H_
