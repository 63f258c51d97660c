#include "profiler_agent/devices.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

// HAP_WITH_CUDA comes with the :gpu_probe target, which the BUILD file links
// in only under --config=cuda.
#ifdef HAP_WITH_CUDA
#include "profiler_agent/gpu_probe.h"
#endif

namespace hap::agent {

absl::StatusOr<DeviceSelection> ParseDeviceSelection(absl::string_view text) {
  if (text == "auto") return DeviceSelection::kAuto;
  if (text == "cpu") return DeviceSelection::kCpu;
  if (text == "gpu") return DeviceSelection::kGpu;
  return absl::InvalidArgumentError(
      absl::StrCat("devices must be auto, cpu or gpu, got '", text, "'"));
}

const char* DeviceSelectionName(DeviceSelection selection) {
  switch (selection) {
    case DeviceSelection::kAuto:
      return "auto";
    case DeviceSelection::kCpu:
      return "cpu";
    case DeviceSelection::kGpu:
      return "gpu";
  }
  return "?";
}

bool BuiltWithCuda() {
#ifdef HAP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::vector<std::unique_ptr<DeviceProber>>> MakeDeviceProbers(
    DeviceSelection selection, std::string* why) {
  std::vector<std::unique_ptr<DeviceProber>> probers;
  std::string note;
  if (selection == DeviceSelection::kCpu) {
    note = "devices: the CPU (asked for)";
  } else {
#ifdef HAP_WITH_CUDA
    auto gpus = NewGpuProber();
    if (gpus.ok()) {
      probers.push_back(*std::move(gpus));
      note = absl::StrCat("devices: the GPUs (", VisibleGpus().value_or(0), " visible)");
    } else if (selection == DeviceSelection::kGpu) {
      return Annotate(gpus.status(), "--devices gpu");
    } else {
      note = absl::StrCat("devices: the CPU, as ", gpus.status().message());
    }
#else
    if (selection == DeviceSelection::kGpu) {
      return absl::FailedPreconditionError(
          "--devices gpu: this hap-agent was built without CUDA, so it cannot probe GPUs; "
          "build it with `bazel build --config=cuda //profiler_agent:hap-agent`, or use "
          "--devices auto|cpu");
    }
    note = "devices: the CPU (this hap-agent was built without CUDA)";
#endif
  }
  if (probers.empty()) probers.push_back(NewCpuProber());
  if (why != nullptr) *why = note;
  return probers;
}

}  // namespace hap::agent
