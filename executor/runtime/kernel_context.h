// What every kernel call gets besides its tensors and attributes.
#ifndef HAP_EXECUTOR_RUNTIME_KERNEL_CONTEXT_H_
#define HAP_EXECUTOR_RUNTIME_KERNEL_CONTEXT_H_

#include <cstdint>

namespace hap::executor {

struct KernelContext {
  int num_threads = 1;
  int64_t step = 0;  // training step, 0-based (dropout masks, Adam)
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_KERNEL_CONTEXT_H_
