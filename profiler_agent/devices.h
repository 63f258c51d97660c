// Which devices the agent measures (--devices auto|cpu|gpu): the GPUs when
// this build has CUDA and a GPU is visible, the CPU otherwise. A build
// without CUDA (no --config=cuda) has no GPU code at all and measures the CPU.
#ifndef HAP_PROFILER_AGENT_DEVICES_H_
#define HAP_PROFILER_AGENT_DEVICES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "profiler_agent/probes.h"

namespace hap::agent {

enum class DeviceSelection {
  kAuto,  // the GPUs when built with CUDA and one is visible, else the CPU
  kCpu,   // the CPU only
  kGpu,   // the GPUs only; an error when there are none
};

// "auto", "cpu" or "gpu"; InvalidArgument naming the choices otherwise.
absl::StatusOr<DeviceSelection> ParseDeviceSelection(absl::string_view text);
const char* DeviceSelectionName(DeviceSelection selection);

// Whether this binary was built with the GPU probes (bazel --config=cuda).
bool BuiltWithCuda();

// The probers for `selection`; `why` (optional) gets one line saying what was
// chosen and, for auto falling back to the CPU, the reason. For kGpu:
// FailedPrecondition saying that this build has no CUDA, or that no GPU is
// visible and why (cudaGetDeviceCount's message).
absl::StatusOr<std::vector<std::unique_ptr<DeviceProber>>> MakeDeviceProbers(
    DeviceSelection selection, std::string* why = nullptr);

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_DEVICES_H_
