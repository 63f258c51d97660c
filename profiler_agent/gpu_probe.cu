// The GPU probes' CUDA code (interface: gpu_probe_cuda.h). The CUDA runtime
// and cuBLAS are called here only; every call goes through a check that turns
// its error code into text with the call and file:line, and every resource is
// held by a guard so an early error return leaks nothing.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/stats.h"
#include "profiler_agent/gpu_probe_cuda.h"

namespace hap::agent::gpu {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// "cudaMalloc (gpu_probe.cu:42): cudaErrorMemoryAllocation: out of memory".
// `call` is the stringized expression; its function name is kept.
std::string Failure(const char* call, const char* file, int line, const std::string& what) {
  std::string fn(call);
  fn = fn.substr(0, fn.find('('));
  const char* base = std::strrchr(file, '/');
  return fn + " (" + (base ? base + 1 : file) + ":" + std::to_string(line) + "): " + what;
}

std::string CudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

std::string CublasText(cublasStatus_t s) {
  return std::string(cublasGetStatusName(s)) + ": " + cublasGetStatusString(s);
}

#define HAP_CUDA_TRY(call)                                                  \
  do {                                                                      \
    cudaError_t hap_cuda_error_ = (call);                                   \
    if (hap_cuda_error_ != cudaSuccess) {                                   \
      return Failure(#call, __FILE__, __LINE__, CudaText(hap_cuda_error_)); \
    }                                                                       \
  } while (0)

#define HAP_CUBLAS_TRY(call)                                                     \
  do {                                                                           \
    cublasStatus_t hap_cublas_status_ = (call);                                  \
    if (hap_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                           \
      return Failure(#call, __FILE__, __LINE__, CublasText(hap_cublas_status_)); \
    }                                                                            \
  } while (0)

// Makes a GPU current and restores the caller's current GPU on exit.
class DeviceScope {
 public:
  DeviceScope() { had_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceScope() {
    if (had_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool had_ = false;
};

// Device memory, freed on the device it came from.
class Buffer {
 public:
  Buffer() = default;
  ~Buffer() {
    if (p_ != nullptr) {
      int current = 0;
      cudaGetDevice(&current);
      cudaSetDevice(device_);
      cudaFree(p_);
      cudaSetDevice(current);
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Allocates on the current device.
  std::string Allocate(size_t bytes) {
    HAP_CUDA_TRY(cudaGetDevice(&device_));
    HAP_CUDA_TRY(cudaMalloc(&p_, bytes));
    return "";
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  int device_ = 0;
};

class Stream {
 public:
  ~Stream() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
  }
  std::string Create() {
    HAP_CUDA_TRY(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return "";
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// A start and a stop event; Seconds() waits for the stop.
class Timer {
 public:
  ~Timer() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }
  std::string Create() {
    HAP_CUDA_TRY(cudaEventCreate(&start_));
    HAP_CUDA_TRY(cudaEventCreate(&stop_));
    return "";
  }
  std::string Start(cudaStream_t s) {
    HAP_CUDA_TRY(cudaEventRecord(start_, s));
    return "";
  }
  std::string Stop(cudaStream_t s) {
    HAP_CUDA_TRY(cudaEventRecord(stop_, s));
    return "";
  }
  std::string Seconds(double* seconds) {
    HAP_CUDA_TRY(cudaEventSynchronize(stop_));
    float ms = 0;
    HAP_CUDA_TRY(cudaEventElapsedTime(&ms, start_, stop_));
    // Events resolve about half a microsecond; never report zero.
    *seconds = std::max(static_cast<double>(ms) * 1e-3, 1e-7);
    return "";
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

class CublasHandle {
 public:
  ~CublasHandle() {
    if (h_ != nullptr) cublasDestroy(h_);
  }
  std::string Create(cudaStream_t s) {
    HAP_CUBLAS_TRY(cublasCreate(&h_));
    HAP_CUBLAS_TRY(cublasSetStream(h_, s));
    return "";
  }
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

#define HAP_TRY(expr)                           \
  do {                                          \
    std::string hap_error_ = (expr);            \
    if (!hap_error_.empty()) return hap_error_; \
  } while (0)

// ---------------------------------------------------------------- GEMM --

template <typename T>
__device__ T FromFloat(float x);
template <>
__device__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __half FromFloat<__half>(float x) {
  return __float2half(x);
}
template <>
__device__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Pseudo-random values in [-0.5, 0.5]: zeros would let the GPU draw less
// power (and run faster) than real data does.
template <typename T>
__global__ void FillKernel(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    p[i] = FromFloat<T>(static_cast<float>(h & 0xffffu) / 65535.0f - 0.5f);
  }
}

template <typename T>
std::string Fill(void* p, int64_t n, uint32_t seed, cudaStream_t s) {
  FillKernel<T><<<1024, 256, 0, s>>>(static_cast<T*>(p), n, seed);
  HAP_CUDA_TRY(cudaGetLastError());
  return "";
}

struct GemmTypes {
  cudaDataType_t data;
  cublasComputeType_t compute;
};

GemmTypes TypesOf(GemmKind kind) {
  switch (kind) {
    case GemmKind::kFloat32:
      return {CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case GemmKind::kTf32:
      return {CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    case GemmKind::kBFloat16:
      return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case GemmKind::kFloat16:
      return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
  }
  return {CUDA_R_32F, CUBLAS_COMPUTE_32F};
}

std::string FillFor(GemmKind kind, void* p, int64_t n, uint32_t seed, cudaStream_t s) {
  switch (kind) {
    case GemmKind::kFloat32:
    case GemmKind::kTf32:
      return Fill<float>(p, n, seed, s);
    case GemmKind::kBFloat16:
      return Fill<__nv_bfloat16>(p, n, seed, s);
    case GemmKind::kFloat16:
      return Fill<__half>(p, n, seed, s);
  }
  return "unknown GEMM kind";
}

// The matrices and cuBLAS state of one measurement on one GPU.
struct GemmBench {
  Stream stream;
  Timer timer;
  CublasHandle handle;
  Buffer a, b, c;

  // `count` products of n x n matrices of `kind`, enqueued.
  std::string Enqueue(GemmKind kind, int n, int count) {
    const GemmTypes t = TypesOf(kind);
    const float alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < count; ++i) {
      HAP_CUBLAS_TRY(cublasGemmEx(handle.get(), CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(),
                                  t.data, n, b.get(), t.data, n, &beta, c.get(), t.data, n,
                                  t.compute, CUBLAS_GEMM_DEFAULT));
    }
    return "";
  }

  // Seconds of `count` back-to-back products, timed with events.
  std::string Time(GemmKind kind, int n, int count, double* seconds) {
    HAP_TRY(timer.Start(stream.get()));
    HAP_TRY(Enqueue(kind, n, count));
    HAP_TRY(timer.Stop(stream.get()));
    return timer.Seconds(seconds);
  }
};

// ----------------------------------------------------- launch overhead --

__global__ void EmptyKernel() {}

}  // namespace

int VisibleGpuCount(std::string* reason) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: later calls must not see it
    if (reason != nullptr) *reason = "cudaGetDeviceCount: " + CudaText(e);
    return 0;
  }
  if (n == 0 && reason != nullptr) *reason = "cudaGetDeviceCount reports no device";
  return n;
}

std::string GetGpuProperties(int ordinal, GpuProperties* out) {
  DeviceScope scope;
  cudaDeviceProp p;
  HAP_CUDA_TRY(cudaGetDeviceProperties(&p, ordinal));
  out->name = p.name;
  out->compute_major = p.major;
  out->compute_minor = p.minor;
  char bus[32] = {};
  HAP_CUDA_TRY(cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, ordinal));
  out->pci_bus_id = bus;
  HAP_CUDA_TRY(cudaSetDevice(ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  HAP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  out->free_bytes = static_cast<int64_t>(free_bytes);
  out->total_bytes = static_cast<int64_t>(total_bytes);
  return "";
}

const char* GemmKindName(GemmKind kind) {
  switch (kind) {
    case GemmKind::kFloat32:
      return "fp32";
    case GemmKind::kTf32:
      return "tf32";
    case GemmKind::kBFloat16:
      return "bf16";
    case GemmKind::kFloat16:
      return "fp16";
  }
  return "?";
}

bool GemmSupported(GemmKind kind, int compute_major) {
  switch (kind) {
    case GemmKind::kTf32:
    case GemmKind::kBFloat16:
      return compute_major >= 8;
    case GemmKind::kFloat32:
    case GemmKind::kFloat16:
      return compute_major >= 5;
  }
  return false;
}

std::string MeasureGemmRates(int ordinal, const std::vector<GemmKind>& kinds,
                             const GemmOptions& options, std::vector<GemmRate>* out) {
  out->clear();
  if (kinds.empty()) return "";
  if (options.repeats < 1) return "GEMM repeats must be at least 1";
  DeviceScope scope;
  HAP_CUDA_TRY(cudaSetDevice(ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  HAP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Sizes whose three float32 matrices fit in a quarter of the free memory:
  // the probe must not starve a job already running on the GPU.
  std::vector<int> sizes;
  for (int n : options.sizes) {
    if (n < 1 || n > 32768) return "GEMM sizes must be within 1..32768, got " + std::to_string(n);
    if (3.0 * n * n * sizeof(float) <= free_bytes / 4.0) sizes.push_back(n);
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  if (sizes.empty()) {
    return "not enough free GPU memory for the smallest GEMM size (" +
           std::to_string(free_bytes >> 20) + " MiB free)";
  }
  const int64_t elems = static_cast<int64_t>(sizes.back()) * sizes.back();

  GemmBench bench;
  HAP_TRY(bench.stream.Create());
  HAP_TRY(bench.timer.Create());
  HAP_TRY(bench.handle.Create(bench.stream.get()));
  // Float32 products must not quietly use TF32 tensor cores.
  HAP_CUBLAS_TRY(cublasSetMathMode(bench.handle.get(), CUBLAS_DEFAULT_MATH));
  HAP_TRY(bench.a.Allocate(elems * sizeof(float)));
  HAP_TRY(bench.b.Allocate(elems * sizeof(float)));
  HAP_TRY(bench.c.Allocate(elems * sizeof(float)));

  const double share = options.budget_seconds / kinds.size();
  for (GemmKind kind : kinds) {
    HAP_TRY(FillFor(kind, bench.a.get(), elems, 1, bench.stream.get()));
    HAP_TRY(FillFor(kind, bench.b.get(), elems, 2, bench.stream.get()));
    HAP_CUDA_TRY(cudaStreamSynchronize(bench.stream.get()));
    const Clock::time_point start = Clock::now();
    GemmRate result;
    result.kind = kind;
    double rate = 0;  // FLOP/s of the last timed batch: predicts the next one
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int n = sizes[i];
      const double flop = 2.0 * n * n * n;
      if (i == 0) {
        // Warm-up, always made: the first product loads cuBLAS's kernel and
        // picks its algorithm; the second is timed to predict the rest.
        HAP_TRY(bench.Enqueue(kind, n, 1));
        HAP_CUDA_TRY(cudaStreamSynchronize(bench.stream.get()));
        double t = 0;
        HAP_TRY(bench.Time(kind, n, 1, &t));
        rate = flop / t;
        result.flops = rate;
        result.size = n;
      }
      // Batches of products lasting about a millisecond: small products
      // alone are dominated by the launch.
      const int batch = static_cast<int>(std::clamp(std::ceil(1e-3 * rate / flop), 1.0, 64.0));
      std::vector<double> rates;
      for (int r = 0; r < options.repeats; ++r) {
        if (SecondsSince(start) + batch * flop / rate > share) break;
        double t = 0;
        HAP_TRY(bench.Time(kind, n, batch, &t));
        rate = batch * flop / t;
        rates.push_back(rate);
      }
      if (rates.empty()) break;
      result.flops = Median(rates);
      result.size = n;
    }
    out->push_back(result);
  }
  return "";
}

std::string MeasureLaunchOverhead(int ordinal, double* seconds) {
  DeviceScope scope;
  HAP_CUDA_TRY(cudaSetDevice(ordinal));
  Stream stream;
  HAP_TRY(stream.Create());
  EmptyKernel<<<1, 1, 0, stream.get()>>>();  // loads the module
  HAP_CUDA_TRY(cudaGetLastError());
  HAP_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  constexpr int kLaunches = 100;
  std::vector<double> per_launch;
  for (int b = 0; b < 5; ++b) {
    Clock::time_point t0 = Clock::now();
    for (int k = 0; k < kLaunches; ++k) EmptyKernel<<<1, 1, 0, stream.get()>>>();
    HAP_CUDA_TRY(cudaGetLastError());
    HAP_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    per_launch.push_back(SecondsSince(t0) / kLaunches);
  }
  *seconds = Median(per_launch);
  return "";
}

std::string MeasurePeer(int src, int dst, const PeerOptions& options, PeerMeasurement* out) {
  *out = PeerMeasurement();
  if (src == dst) return "a peer link needs two different GPUs";
  if (options.repeats < 1) return "peer copy repeats must be at least 1";
  DeviceScope scope;
  int value = 0;
  HAP_CUDA_TRY(cudaDeviceGetP2PAttribute(&value, cudaDevP2PAttrAccessSupported, src, dst));
  out->attributes.access_supported = value != 0;
  HAP_CUDA_TRY(cudaDeviceGetP2PAttribute(&value, cudaDevP2PAttrNativeAtomicSupported, src, dst));
  out->attributes.native_atomics = value != 0;
  HAP_CUDA_TRY(cudaDeviceGetP2PAttribute(&value, cudaDevP2PAttrPerformanceRank, src, dst));
  out->attributes.performance_rank = value;

  constexpr int64_t kMiB = int64_t{1} << 20;
  // Timed copies up to max_bytes, and at most an eighth of either GPU's
  // free memory.
  int64_t bytes = std::max(options.max_bytes, kMiB);
  for (int d : {src, dst}) {
    HAP_CUDA_TRY(cudaSetDevice(d));
    size_t free_bytes = 0, total_bytes = 0;
    HAP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
    bytes = std::min(bytes, static_cast<int64_t>(free_bytes / 8));
  }
  if (bytes < kMiB) return "not enough free GPU memory for a 1 MiB peer copy";

  Buffer to, from;
  HAP_CUDA_TRY(cudaSetDevice(dst));
  HAP_TRY(to.Allocate(bytes));
  HAP_CUDA_TRY(cudaSetDevice(src));
  HAP_TRY(from.Allocate(bytes));
  HAP_CUDA_TRY(cudaMemset(from.get(), 1, bytes));

  // Direct access from src to dst for the measurement, as NCCL would use it.
  struct PeerAccess {
    int src = -1, dst = -1;
    ~PeerAccess() {
      if (src < 0) return;
      int current = 0;
      cudaGetDevice(&current);
      cudaSetDevice(src);
      cudaDeviceDisablePeerAccess(dst);
      cudaSetDevice(current);
    }
  } enabled;
  if (out->attributes.access_supported) {
    cudaError_t e = cudaDeviceEnablePeerAccess(dst, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // on already: fine, and leave it on
    } else if (e != cudaSuccess) {
      return Failure("cudaDeviceEnablePeerAccess", __FILE__, __LINE__, CudaText(e));
    } else {
      enabled.src = src;
      enabled.dst = dst;
    }
  }

  Stream stream;
  HAP_TRY(stream.Create());
  Timer timer;
  HAP_TRY(timer.Create());
  auto copy = [&](int64_t n, double* seconds) -> std::string {
    HAP_TRY(timer.Start(stream.get()));
    HAP_CUDA_TRY(cudaMemcpyPeerAsync(to.get(), dst, from.get(), src, n, stream.get()));
    HAP_TRY(timer.Stop(stream.get()));
    return timer.Seconds(seconds);
  };

  const Clock::time_point start = Clock::now();
  double t = 0;
  HAP_TRY(copy(kMiB, &t));  // warm-up: the copy path set up
  HAP_TRY(copy(kMiB, &t));
  double rate = kMiB / t;
  std::vector<double> small;
  for (int i = 0; i < 5; ++i) {
    HAP_TRY(copy(4, &t));
    small.push_back(t);
  }
  out->latency_seconds = Median(small);
  // The bandwidth of a copy with its fixed cost taken out, when the copy is
  // long enough for that to be meaningful.
  auto bandwidth = [&](int64_t n, double seconds) {
    double moving = seconds - out->latency_seconds;
    return moving > 0.5 * seconds ? n / moving : n / seconds;
  };
  out->bandwidth_bytes_per_second = bandwidth(kMiB, kMiB / rate);
  out->bytes = kMiB;
  for (int64_t n = kMiB; n <= bytes; n *= 2) {
    std::vector<double> times;
    for (int r = 0; r < options.repeats; ++r) {
      if (SecondsSince(start) + n / rate + out->latency_seconds > options.budget_seconds) break;
      HAP_TRY(copy(n, &t));
      rate = n / t;
      times.push_back(t);
    }
    if (times.empty()) break;
    out->bandwidth_bytes_per_second = bandwidth(n, Median(times));
    out->bytes = n;
  }
  return "";
}

}  // namespace hap::agent::gpu
