// The CUDA side of the GPU probes (gpu_probe.cu): plain C++17 with no
// Abseil, protobuf or CUDA types, so that nvcc compiles the implementation
// and gpu_probe.cc (Abseil, protos) calls it. The CUDA runtime and cuBLAS
// are used in gpu_probe.cu only; their error codes come back as text that
// names the call, its file:line and the library's own message.
//
// Every function takes a GPU ordinal (as CUDA numbers them in this process,
// after CUDA_VISIBLE_DEVICES), makes it current for the call and restores the
// caller's current device before returning. They hold nothing between calls
// except the CUDA primary context of each GPU touched (the runtime keeps it
// for the life of the process). Not thread-safe: one call at a time.
//
// Errors: each function returns "" on success and otherwise a message for a
// person ("cublasGemmEx (gpu_probe.cu:123): CUBLAS_STATUS_NOT_SUPPORTED").
#ifndef HAP_PROFILER_AGENT_GPU_PROBE_CUDA_H_
#define HAP_PROFILER_AGENT_GPU_PROBE_CUDA_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hap::agent::gpu {

// How many GPUs this process sees. With no GPU or no usable driver the count
// is 0 and `reason` says why (cudaGetDeviceCount's message); never fails.
int VisibleGpuCount(std::string* reason);

struct GpuProperties {
  std::string name;       // "NVIDIA H100 80GB HBM3"
  int compute_major = 0;  // compute capability, 8.0 = A100
  int compute_minor = 0;
  int64_t total_bytes = 0;  // cudaMemGetInfo total
  int64_t free_bytes = 0;   // cudaMemGetInfo free, at the time of the call
  std::string pci_bus_id;   // "0000:3B:00.0"
};

std::string GetGpuProperties(int ordinal, GpuProperties* out);

// The matrix-product kinds measured with cublasGemmEx. All accumulate in
// float32 (CUBLAS_COMPUTE_32F), as training does.
enum class GemmKind {
  kFloat32,   // float in and out, exact fp32 math (no TF32)
  kTf32,      // float in and out, CUBLAS_COMPUTE_32F_FAST_TF32 (Ampere+)
  kBFloat16,  // bf16 in and out (Ampere+)
  kFloat16,   // fp16 in and out
};
const char* GemmKindName(GemmKind kind);  // "fp32", "tf32", "bf16", "fp16"

// Whether a GPU of this compute capability runs `kind` (bf16 and tf32 need
// 8.0+; the others any GPU this build supports).
bool GemmSupported(GemmKind kind, int compute_major);

struct GemmOptions {
  // Square sizes n (n x n times n x n), tried in increasing order; the
  // largest one with at least one timed batch gives the rate. Sizes whose
  // three float32 matrices would not fit in a quarter of the free memory
  // are left out.
  std::vector<int> sizes = {1024, 2048, 4096, 8192};
  // Timed batches per size; the median batch rate is reported.
  int repeats = 5;
  // Bound on the whole measurement of all `kinds`, shared evenly between
  // them. A batch whose predicted time (from the last rate) would overrun
  // its kind's share is not started; the one warm-up product of the
  // smallest size per kind is always made, so the bound is overrun by at
  // most those (plus allocating and filling the matrices).
  double budget_seconds = 2.0;
};

struct GemmRate {
  GemmKind kind = GemmKind::kFloat32;
  double flops = 0;  // FLOP/s (2 n^3 per product), measured with CUDA events
  int size = 0;      // the n that gave it
};

// Measures each of `kinds` (all must be supported: see GemmSupported) on
// GPU `ordinal`, in the given order; `out` gets one rate per kind.
std::string MeasureGemmRates(int ordinal, const std::vector<GemmKind>& kinds,
                             const GemmOptions& options, std::vector<GemmRate>* out);

// Seconds one launch of an empty kernel costs: the median over a few
// batches of back-to-back launches of (host time to launch the batch and
// synchronize) / batch size. Takes a few milliseconds.
std::string MeasureLaunchOverhead(int ordinal, double* seconds);

// How GPU `src` reaches GPU `dst`, from cudaDeviceGetP2PAttribute.
struct PeerAttributes {
  bool access_supported = false;  // direct peer access (else copies stage through the host)
  bool native_atomics = false;    // atomics over the link: NVLink, not PCIe
  int performance_rank = 0;       // the driver's relative rank (lower is better)
};

struct PeerMeasurement {
  PeerAttributes attributes;
  double bandwidth_bytes_per_second = 0;  // copy rate, latency taken out
  double latency_seconds = 0;             // median time of a 4-byte copy
  int64_t bytes = 0;                      // size of the timed copies
};

struct PeerOptions {
  int64_t max_bytes = int64_t{256} << 20;  // largest timed copy
  int repeats = 3;                         // timed copies; the median counts
  // Bound on this one pair. Copy sizes double from 1 MiB while the
  // predicted time fits; a 1 MiB warm-up copy and the latency copies are
  // always made.
  double budget_seconds = 0.5;
};

// Times cudaMemcpyPeerAsync from GPU `src` to GPU `dst` with CUDA events on a
// stream of `src`, with peer access enabled for the measurement when the
// pair supports it (and disabled again after, if it was off).
std::string MeasurePeer(int src, int dst, const PeerOptions& options, PeerMeasurement* out);

}  // namespace hap::agent::gpu

#endif  // HAP_PROFILER_AGENT_GPU_PROBE_CUDA_H_
