// The CUDA device (docs/design.md §10): device memory from a caching allocator,
// copies and kernels on one compute stream, cuBLAS for matrix products. It
// implements executor/runtime/device.h with the same kernel names and
// contracts as the CPU backend (executor/cpu/kernels.h), so the interpreter
// and the collectives run unchanged on it.
//
// Built only under `--config=cuda` (build_defs/hap.bzl); tests skip with a
// message naming the reason when no GPU is visible.
#ifndef HAP_EXECUTOR_CUDA_CUDA_DEVICE_H_
#define HAP_EXECUTOR_CUDA_CUDA_DEVICE_H_

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "executor/runtime/device.h"

namespace hap::executor {

struct CudaDeviceOptions {
  // Matrix products of float32 tensors may use TF32 tensor cores
  // (plan.proto compute_dtype asks for it); false = exact fp32 GEMM.
  bool allow_tf32 = false;
  // Upper bound on memory the caching allocator holds (0 = all the GPU has).
  int64_t memory_limit_bytes = 0;
};

// OK when at least one GPU and a working driver are visible; otherwise
// Unavailable naming the reason (no driver, driver too old, no device).
absl::Status CudaAvailable();

// The device for GPU `ordinal`. Unavailable when it cannot be opened,
// InvalidArgument for an ordinal out of range.
//
// Its memory comes from a caching allocator (freed blocks are reused in
// stream order; ResourceExhausted names the bytes requested, held and the
// limit). Kernels and copies are queued on one non-blocking stream and run
// in order; CopyToHost and Synchronize wait for it. An error a kernel can
// only find on the GPU (a target or id out of range) is InvalidArgument
// naming the kernel at the next CopyToHost or Synchronize. Thread-safety:
// every method may be called from any thread; RunKernel calls are
// serialized.
absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(
    int ordinal, const CudaDeviceOptions& options = {});

// The compute stream of a device made by NewCudaDevice (kernels and copies
// run on it, in order), or nullptr for any other device. The NCCL
// communicator orders its own stream after it with events.
cudaStream_t CudaComputeStream(Device& device);
// The GPU ordinal of a device made by NewCudaDevice, or -1.
int CudaOrdinal(const Device& device);

// The names of the CUDA device's kernels, sorted (no GPU needed): the same
// set as executor/cpu/kernels.h CpuKernelNames().
std::vector<std::string> CudaKernelNames();

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CUDA_CUDA_DEVICE_H_
