// The GPU prober (docs/design.md §8): every CUDA GPU this process sees, measured
// rather than read from a datasheet. Built only under --config=cuda
// (target :gpu_probe, which defines HAP_WITH_CUDA for its dependents);
// devices.h picks it or the CPU prober.
//
// Per GPU, within ProbeOptions::max_duration: cuBLAS GEMM FLOP/s
// (cublasGemmEx timed with CUDA events after a warm-up) for float32, float16
// and, on Ampere and newer, bfloat16 and float32-on-TF32 (Device.tf32_flops);
// memory (cudaMemGetInfo total); the empty-kernel launch time; the model name
// and the CUDA ordinal (local_index). Between the GPUs of the node, within
// max_duration in all: cudaMemcpyPeerAsync bandwidth and latency per ordered
// pair, NVLINK or PCIE by cudaDeviceGetP2PAttribute and the rate.
#ifndef HAP_PROFILER_AGENT_GPU_PROBE_H_
#define HAP_PROFILER_AGENT_GPU_PROBE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "hap/v1/cluster.pb.h"
#include "profiler_agent/gpu_probe_cuda.h"
#include "profiler_agent/probes.h"

namespace hap::agent {

struct GpuProbeOptions {
  // Square GEMM sizes, tried in increasing order while the budget lasts
  // (those that do not fit in a quarter of the free memory are skipped).
  std::vector<int> matmul_sizes = {1024, 2048, 4096, 8192};
  // The size of the quick drift check (float32 only, three batches).
  int quick_size = 2048;
  // Largest timed peer copy.
  int64_t peer_max_bytes = int64_t{256} << 20;
};

// The GPUs this process sees (after CUDA_VISIBLE_DEVICES). FailedPrecondition
// naming the reason when there is none (no driver, driver too old, no
// device).
absl::StatusOr<int> VisibleGpus();

// A prober of every visible GPU: devices "<node>/gpu<ordinal>" of kind GPU,
// and links between each ordered pair of them (ProbeLinks; none with one
// GPU). FailedPrecondition as VisibleGpus when there is no GPU.
absl::StatusOr<std::unique_ptr<DeviceProber>> NewGpuProber(GpuProbeOptions options = {});

// The link kind of a GPU pair: NVLINK when the pair has native peer atomics
// (NVLink has them, PCIe peer access does not) or copies faster than any
// PCIe x16 link carries (64e9 B/s), PCIE otherwise (also when copies go
// through the host). A heuristic: NVML would say for sure, but the agent
// does not link it.
hap::v1::LinkKind GpuLinkKind(const gpu::PeerMeasurement& m);

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_GPU_PROBE_H_
