#include "absl/strings/str_cat.h"
#include "executor/cuda/cuda_status.h"
#include "executor/cuda/kernels_internal.h"

namespace hap::executor::cuda {

absl::Status KernelCudaStatus(const KernelArgs& a, cudaError_t e, absl::string_view call) {
  if (e == cudaSuccess) return absl::OkStatus();
  return CudaStatus(e, call, absl::StrCat("CUDA kernel '", a.name, "'"));
}

absl::Status CheckLaunch(const KernelArgs& a) {
  return KernelCudaStatus(a, cudaGetLastError(), "its launch");
}

}  // namespace hap::executor::cuda
