#include "absl/strings/str_cat.h"
#include "executor/cuda/kernels_internal.h"

namespace hap::executor::cuda {

absl::Status CheckLaunch(const KernelArgs& a) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA kernel '", a.name,
                                          "' failed to launch: ",
                                          cudaGetErrorString(e)));
}

}  // namespace hap::executor::cuda
