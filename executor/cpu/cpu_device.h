// The CPU device: host memory and the kernels of kernels.h.
#ifndef HAP_EXECUTOR_CPU_CPU_DEVICE_H_
#define HAP_EXECUTOR_CPU_CPU_DEVICE_H_

#include <memory>

#include "executor/runtime/device.h"

namespace hap::executor {

// `threads` bounds each kernel's threads (OpenBLAS included).
std::unique_ptr<Device> NewCpuDevice(int threads);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_CPU_CPU_DEVICE_H_
