// Device probes of the profiler agent (docs/design.md §8): what each local device
// can do, measured rather than read from a datasheet. No gRPC here: the
// agent's service and daemon call these and put the result on the wire.
//
// A DeviceProber measures every device of one backend on this node. The CPU
// prober is the first; gpu_probe.h has the GPU prober (CUDA builds only) and
// devices.h picks between them.
#ifndef HAP_PROFILER_AGENT_PROBES_H_
#define HAP_PROFILER_AGENT_PROBES_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "hap/v1/cluster.pb.h"

namespace hap::agent {

// The monotonic clock (steady_clock) as an absl::Time, only as a point to
// subtract from: schedules and durations that a step of the wall clock
// (NTP, `date -s`) must not stretch or cut.
inline absl::Time MonotonicNow() {
  return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

// What one probe may spend and use.
struct ProbeOptions {
  // Compute threads (BLAS threads on the CPU); 0 = the CPUs this process may
  // use (its cgroup CPU share rounded up, at most the hardware threads).
  int threads = 0;
  // Bound on one device's probe; a run that would not finish within it is
  // not started (the probe then reports what the runs so far measured).
  absl::Duration max_duration = absl::Seconds(2);
  // Square float32 matmul sizes, tried in increasing order; the largest one
  // that completes at least one timed run gives the FLOP/s.
  std::vector<int> matmul_sizes = {512, 768, 1024};
  // Timed runs per size; the median is reported.
  int repeats = 5;
  // The clock the CPU probes keep max_duration and time their runs with:
  // monotonic by default (an absl::Time only as a point to subtract from).
  // Tests inject a fake one that steps at every reading.
  std::function<absl::Time()> now = MonotonicNow;
  // True once the probe is to stop (the agent shuts down): a probe asks it
  // before each timed run (each GPU, each GPU pair) and, when it says so,
  // ends with Cancelled instead of finishing. Default: never.
  std::function<bool()> stop = [] { return false; };
};

// Cancelled, naming `what` was stopped, once options.stop() says so; OK
// otherwise.
absl::Status CheckNotStopped(const ProbeOptions& options, const std::string& what);

// The host files the CPU probe reads (/proc, /sys/fs/cgroup). Injected so
// tests can present any cgroup layout. Implementations are thread-safe.
class SystemFiles {
 public:
  virtual ~SystemFiles() = default;
  // The whole file, or NotFound.
  virtual absl::StatusOr<std::string> Read(const std::string& path) const = 0;
  // The real file system (a process-wide instance, never destroyed).
  static const SystemFiles& Real();
};

// Total memory this process may use: MemTotal of /proc/meminfo, capped by
// the memory limit of its cgroup (v1 memory.limit_in_bytes or v2 memory.max,
// the smallest along the path from its cgroup up to the root).
// Error when /proc/meminfo cannot be read or parsed.
absl::StatusOr<int64_t> ReadMemoryBytes(const SystemFiles& files);

// CPUs this process's cgroup allows (v1 cpu.cfs_quota_us / cpu.cfs_period_us
// or v2 cpu.max, the smallest along its path), e.g. 0.4; nullopt when there
// is no quota.
std::optional<double> ReadCpuQuota(const SystemFiles& files);

// Measures the devices of one backend. Implementations are not required to
// be thread-safe: the agent runs one probe at a time.
class DeviceProber {
 public:
  virtual ~DeviceProber() = default;
  // A full probe: every device of this backend on node `node`, with ids
  // "<node>/<kind><index>", FLOP/s per dtype, memory and launch overhead.
  virtual absl::StatusOr<std::vector<hap::v1::Device>> Probe(const std::string& node,
                                                             const ProbeOptions& options) = 0;
  // A quick float32 FLOP/s check of each device, in Probe's order, for drift
  // detection: cheaper than Probe (one size, a few runs). Ends at
  // options.stop as Probe does (before each timed run, each GPU).
  virtual absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions& options) = 0;
  // The links between this backend's devices on node `node` (GPU to GPU over
  // NVLink or PCIe), measured within options.max_duration in all. Default:
  // none (one device, or a backend without such links).
  virtual absl::StatusOr<std::vector<hap::v1::Link>> ProbeLinks(const std::string& node,
                                                                const ProbeOptions& options) {
    (void)node;
    (void)options;
    return std::vector<hap::v1::Link>{};
  }
};

// The CPU as one device "<node>/cpu0": OpenBLAS sgemm FLOP/s (which already
// reflect cgroup throttling) and the bf16 kernel's, each within half of
// options.max_duration, memory, the time of a 1x1 sgemm as launch
// overhead, and "cpu (N threads, share X)" as its model, X being the CPUs
// the cgroup allows (the machine's CPU count without a quota). `files` must
// outlive the prober.
std::unique_ptr<DeviceProber> NewCpuProber(const SystemFiles* files = &SystemFiles::Real());

// Float32 FLOP/s of square sgemm on `threads` threads: the median of timed
// runs of the largest size of `options.matmul_sizes` that fits in
// `options.max_duration`. The first (warm-up) run of the smallest size is
// always made and counts only when no timed run fits, so the probe overruns
// its bound by at most that one run. InvalidArgument for no sizes, a size
// outside 1..16384, or repeats < 1.
absl::StatusOr<double> MeasureMatmulFlops(int threads, const ProbeOptions& options);

// Seconds a minimal BLAS call takes (1x1x1 sgemm), the median of batches.
double MeasureLaunchOverhead(int threads);

// bf16 mixed precision's matmul FLOP/s (PlanOptions.precision BF16): the
// executor's own bf16 linear kernel (oneDNN, executor/cpu/kernels.h "bf16")
// on square operands, measured as MeasureMatmulFlops measures sgemm (sizes
// ascending, a warm-up, runs that would overrun options.max_duration not
// started, the largest size with a timed run), sizes cut to 1024.
// InvalidArgument for bad options as MeasureMatmulFlops, the kernel's error
// otherwise.
absl::StatusOr<double> MeasureBf16MatmulFlops(int threads, const ProbeOptions& options);

// The links every prober measures between its own devices (ProbeLinks), in
// prober order. The first error fails the whole probe, annotated with the
// prober's position.
absl::StatusOr<std::vector<hap::v1::Link>> ProbeNodeLinks(const std::string& name,
                                                          absl::Span<DeviceProber* const> probers,
                                                          const ProbeOptions& options);

// Runs every prober and assembles the node: name, agent address, devices
// (local_index kept as each prober numbered them). The first prober error
// fails the whole probe, annotated with the prober's position;
// FailedPrecondition when the probers found no device.
absl::StatusOr<hap::v1::Node> ProbeNode(const std::string& name, const std::string& address,
                                        absl::Span<DeviceProber* const> probers,
                                        const ProbeOptions& options);

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_PROBES_H_
