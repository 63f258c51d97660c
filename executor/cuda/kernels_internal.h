// Internal to executor/cuda: what the kernel family files share. Each family
// is a .cc file (compiled by the host compiler: argument checks with Abseil,
// registration) calling launchers in a .cu file (compiled by nvcc: plain
// C++17 + CUDA, no Abseil or protobuf) declared in a launch_*.h header.
//
// Contracts are those of executor/cpu/kernels.h, kernel for kernel; every
// kernel runs on `args.stream` and must not synchronize it.
#ifndef HAP_EXECUTOR_CUDA_KERNELS_INTERNAL_H_
#define HAP_EXECUTOR_CUDA_KERNELS_INTERNAL_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "executor/runtime/kernel_context.h"
#include "executor/runtime/tensor.h"
#include "planner/graph/types.h"

namespace hap::executor::cuda {

// Temporary device memory for one kernel call, stream-ordered: freed (back
// to the caching allocator) after the call's work on the stream.
class Scratch {
 public:
  virtual ~Scratch() = default;
  virtual absl::StatusOr<void*> Get(int64_t bytes) = 0;
};

// Where a kernel reports an error it can only find on the GPU (a target or
// id out of range): it sets `*word` to `code` if still 0 (atomicCAS) and
// carries on with the bad element skipped; the device turns a set word into
// InvalidArgument naming the kernel at its next Synchronize (or CopyToHost).
// `word == nullptr`: no reporting (the kernel only skips).
struct DeviceFault {
  int* word = nullptr;
  int code = 0;
};

struct KernelArgs {
  const std::string& name;
  const KernelContext& ctx;
  const graph::Attrs& attrs;
  absl::Span<const TensorView> in;
  absl::Span<const TensorView> out;
  cudaStream_t stream;
  cublasHandle_t cublas;  // bound to `stream`
  bool allow_tf32;
  Scratch& scratch;
  DeviceFault fault = {};
};

// `count` elements of T of the call's stream-ordered scratch memory
// (nullptr for count <= 0). Errors name the kernel.
template <typename T>
absl::StatusOr<T*> ScratchArray(const KernelArgs& a, int64_t count) {
  if (count <= 0) return static_cast<T*>(nullptr);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  absl::StatusOr<void*> p = a.scratch.Get(bytes);
  if (!p.ok()) {
    return absl::Status(p.status().code(), absl::StrCat("kernel '", a.name, "': scratch of ", bytes,
                                                        " bytes: ", p.status().message()));
  }
  return static_cast<T*>(*p);
}

using KernelFn = std::function<absl::Status(const KernelArgs&)>;
using KernelTable = std::map<std::string, KernelFn>;

// Registration, one function per family (the same families as executor/cpu).
void RegisterDenseKernels(KernelTable& t);          // linear, matmul
void RegisterElementwiseKernels(KernelTable& t);    // activations, binary, dropout, scale
void RegisterReductionKernels(KernelTable& t);      // sum, mean
void RegisterLossKernels(KernelTable& t);           // nll_loss, cross_entropy
void RegisterRuntimeKernels(KernelTable& t);        // copies, optimizers
void RegisterLayoutKernels(KernelTable& t);         // shape ops, embedding
void RegisterNormalizationKernels(KernelTable& t);  // layer_norm, softmax
void RegisterBatchNormKernels(KernelTable& t);      // batch_norm and pieces
void RegisterConvolutionKernels(KernelTable& t);    // conv2d, conv3d, pooling
void RegisterMoeKernels(KernelTable& t);            // moe_*
void RegisterLstmKernels(KernelTable& t);           // lstm, gru

// OK, or Internal naming the kernel and the CUDA error of the last launch.
absl::Status CheckLaunch(const KernelArgs& a);

// `call`'s result inside kernel `a` (cuda_status.h's CudaStatus, naming the
// kernel).
absl::Status KernelCudaStatus(const KernelArgs& a, cudaError_t e, absl::string_view call);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_KERNELS_INTERNAL_H_
