// The device interface (docs/design.md §10): memory, copies and kernels. The
// interpreter (program_runner.h) and the collectives run every tensor
// operation through it, so a backend (CPU + OpenBLAS now, CUDA + cuBLAS in
// executor/cuda) slots in without touching them.
#ifndef HAP_EXECUTOR_RUNTIME_DEVICE_H_
#define HAP_EXECUTOR_RUNTIME_DEVICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "executor/runtime/kernel_context.h"
#include "executor/runtime/tensor.h"
#include "planner/graph/types.h"

namespace hap::executor {

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda:0"

  // Device memory, 64-byte aligned. ResourceExhausted when it does not fit.
  virtual absl::StatusOr<void*> Allocate(int64_t bytes) = 0;
  virtual void Free(void* p) = 0;

  // Host <-> device copies of a whole view's bytes.
  virtual absl::Status CopyFromHost(const void* src, TensorView dst) = 0;
  virtual absl::Status CopyToHost(TensorView src, void* dst) = 0;
  // Sets every element to `value` (floating or integer dtypes).
  virtual absl::Status Fill(TensorView dst, double value) = 0;
  // Copies the box of `extent` starting at `src_start` in `src` to the box
  // starting at `dst_start` in `dst` (same dtype and rank; device memory).
  virtual absl::Status CopyBox(TensorView src, absl::Span<const int64_t> src_start,
                               TensorView dst, absl::Span<const int64_t> dst_start,
                               absl::Span<const int64_t> extent) = 0;

  virtual bool HasKernel(const std::string& name) const = 0;
  virtual absl::Status RunKernel(const std::string& name,
                                 const KernelContext& ctx,
                                 const graph::Attrs& attrs,
                                 absl::Span<const TensorView> inputs,
                                 absl::Span<const TensorView> outputs) = 0;
  // Waits for queued work (a no-op on the CPU).
  virtual absl::Status Synchronize() = 0;
  // Element-wise dtype conversion between two contiguous views of the same
  // element count in device memory: float32 -> bfloat16 rounds to nearest
  // even, bfloat16 -> float32 is exact (bf16 on the wire,
  // CollectiveCall.wire_dtype). Unimplemented for other pairs and, by
  // default, on devices without it.
  virtual absl::Status Convert(TensorView src, TensorView dst);
};

// Convert on host memory (shared by host backends).
absl::Status HostConvert(TensorView src, TensorView dst);
// InvalidArgument unless src and dst are a float32/bfloat16 pair of the
// same element count.
absl::Status CheckConvert(const std::string& device, TensorView src, TensorView dst);

// CopyBox on host memory (shared by host backends and staging).
absl::Status HostCopyBox(TensorView src, absl::Span<const int64_t> src_start,
                         TensorView dst, absl::Span<const int64_t> dst_start,
                         absl::Span<const int64_t> extent);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_DEVICE_H_
