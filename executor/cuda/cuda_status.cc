#include "executor/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace hap::executor::cuda {

absl::Status CudaStatus(cudaError_t e, absl::string_view call, absl::string_view context) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(context, context.empty() ? "" : ": ", call, " failed: ",
                                          cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

}  // namespace hap::executor::cuda
