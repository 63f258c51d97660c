// Test support: runs one kernel on a device under test and on the CPU
// backend with the same inputs (and the same initial outputs, for
// accumulating backward kernels), and compares every output element, and
// every input after the call (batch norm changes its running statistics in
// place).
#ifndef HAP_EXECUTOR_CUDA_KERNEL_COMPARE_H_
#define HAP_EXECUTOR_CUDA_KERNEL_COMPARE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "executor/runtime/device.h"
#include "executor/runtime/tensor.h"
#include "planner/graph/types.h"

namespace hap::executor {

struct KernelCase {
  std::string kernel;
  graph::Attrs attrs;
  KernelContext ctx;
  // Absent inputs/outputs: a HostTensor with an empty shape and
  // `present = false` in the matching flag vector.
  std::vector<HostTensor> inputs;
  std::vector<bool> input_present;   // empty = all present
  std::vector<HostTensor> outputs;   // initial values (accumulation)
  std::vector<bool> output_present;  // empty = all present
  // |got - want| <= atol + rtol * max(|want|, scale), scale = the largest
  // |want| of that output (so near-zero elements of a big tensor are judged
  // against the tensor's magnitude).
  double rtol = 1e-5;
  double atol = 1e-6;
};

// OK when every output agrees; otherwise an error naming the kernel, the
// output, the first worst element (index, got, want) and the max error.
absl::Status CompareWithCpu(Device& device, const KernelCase& c);

// Uniform random values in [lo, hi) (floating) or integers in [lo, hi).
HostTensor RandomTensor(DType dtype, Shape shape, double lo, double hi,
                        uint64_t seed);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CUDA_KERNEL_COMPARE_H_
