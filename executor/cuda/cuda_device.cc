// CudaDevice: the Device of one GPU (cuda_device.h). CUDA and cuBLAS are
// called here and in the kernel family files only; every call is checked
// and its error names the call (and the kernel, for kernel work).
#include "executor/cuda/cuda_device.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/cuda/box_copy.h"
#include "executor/cuda/caching_allocator.h"
#include "executor/cuda/cuda_status.h"
#include "executor/cuda/kernels_internal.h"
#include "executor/cuda/launch_runtime.h"

namespace hap::executor {
namespace {

using cuda::CachingAllocator;
using cuda::KernelTable;

const KernelTable& Table() {
  static const KernelTable* table = [] {
    auto* t = new KernelTable;
    cuda::RegisterDenseKernels(*t);
    cuda::RegisterElementwiseKernels(*t);
    cuda::RegisterReductionKernels(*t);
    cuda::RegisterLossKernels(*t);
    cuda::RegisterRuntimeKernels(*t);
    cuda::RegisterLayoutKernels(*t);
    cuda::RegisterNormalizationKernels(*t);
    cuda::RegisterBatchNormKernels(*t);
    cuda::RegisterConvolutionKernels(*t);
    cuda::RegisterMoeKernels(*t);
    cuda::RegisterLstmKernels(*t);
    return t;
  }();
  return *table;
}

// Makes `ordinal` the calling thread's current device for a scope (CUDA's
// current device is per thread, and callers may be on any thread).
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != ordinal) {
      status_ =
          cuda::CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice", absl::StrCat("cuda:", ordinal));
    } else {
      previous_ = -1;  // nothing to restore
    }
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

#define HAP_DEVICE_SCOPE()             \
  DeviceScope device_scope_(ordinal_); \
  HAP_RETURN_IF_ERROR(device_scope_.status())

class CudaDevice final : public Device {
 public:
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Open(
      int ordinal, const CudaDeviceOptions& options);
  ~CudaDevice() override;

  std::string name() const override { return name_; }
  absl::StatusOr<void*> Allocate(int64_t bytes) override;
  void Free(void* p) override { allocator_->Free(p); }
  absl::Status CopyFromHost(const void* src, TensorView dst) override;
  absl::Status CopyToHost(TensorView src, void* dst) override;
  absl::Status Fill(TensorView dst, double value) override;
  absl::Status Convert(TensorView src, TensorView dst) override;
  absl::Status CopyBox(TensorView src, absl::Span<const int64_t> src_start,
                       TensorView dst, absl::Span<const int64_t> dst_start,
                       absl::Span<const int64_t> extent) override;
  bool HasKernel(const std::string& name) const override {
    return Table().count(name) > 0;
  }
  absl::Status RunKernel(const std::string& name, const KernelContext& ctx,
                         const graph::Attrs& attrs,
                         absl::Span<const TensorView> inputs,
                         absl::Span<const TensorView> outputs) override;
  absl::Status Synchronize() override;

  cudaStream_t stream() const { return stream_; }
  int ordinal() const { return ordinal_; }

 private:
  CudaDevice(int ordinal, const CudaDeviceOptions& options)
      : ordinal_(ordinal),
        options_(options),
        name_(absl::StrCat("cuda:", ordinal)) {}

  // Waits for the stream, then turns a fault a kernel reported since the
  // last call into InvalidArgument naming it (and clears it).
  absl::Status SyncAndCheckFault();

  const int ordinal_;
  const CudaDeviceOptions options_;
  const std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::unique_ptr<CachingAllocator> allocator_;
  // Serializes RunKernel (one cuBLAS handle) and the fault bookkeeping
  // against synchronizations, so a code always indexes the list it was
  // given from.
  std::mutex mu_;
  // KernelArgs::fault: a device int (0 = no fault) and, per code - 1, the
  // kernel that got it since the last synchronization (at most
  // kMaxFaultNames; later kernels share code kMaxFaultNames + 1).
  static constexpr size_t kMaxFaultNames = 1 << 16;
  int* fault_word_ = nullptr;
  std::vector<const std::string*> fault_kernels_;
};

// Scratch memory of one kernel call: back to the cache when the call
// returns (its work is queued on the stream, so reuse stays ordered).
class CallScratch final : public cuda::Scratch {
 public:
  explicit CallScratch(Device& device) : device_(device) {}
  ~CallScratch() override {
    for (void* p : blocks_) device_.Free(p);
  }
  absl::StatusOr<void*> Get(int64_t bytes) override {
    HAP_ASSIGN_OR_RETURN(void* p, device_.Allocate(bytes));
    blocks_.push_back(p);
    return p;
  }

 private:
  Device& device_;
  std::vector<void*> blocks_;
};

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Open(
    int ordinal, const CudaDeviceOptions& options) {
  std::unique_ptr<CudaDevice> d(new CudaDevice(ordinal, options));
  const std::string& ctx = d->name_;
  DeviceScope scope(ordinal);
  if (!scope.status().ok()) {
    return absl::UnavailableError(std::string(scope.status().message()));
  }
  HAP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&d->stream_, cudaStreamNonBlocking), ctx);
  cublasStatus_t s = cublasCreate(&d->cublas_);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(d->cublas_, d->stream_);
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasSetMathMode(d->cublas_, options.allow_tf32
                                          ? CUBLAS_TF32_TENSOR_OP_MATH
                                          : CUBLAS_DEFAULT_MATH);
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::UnavailableError(absl::StrCat(
        ctx, ": cuBLAS setup failed: ", cublasGetStatusString(s)));
  }
  int64_t limit = options.memory_limit_bytes;
  if (limit <= 0) {
    size_t free_bytes = 0, total_bytes = 0;
    HAP_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes), ctx);
    limit = static_cast<int64_t>(total_bytes);
  }
  const int dev = ordinal;
  cudaStream_t stream = d->stream_;
  cuda::MemoryBackend backend;
  backend.allocate = [dev](int64_t bytes) -> void* {
    DeviceScope scope(dev);
    void* p = nullptr;
    if (!scope.status().ok() ||
        cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
      cudaGetLastError();  // an out-of-memory error is not sticky: clear it
      return nullptr;
    }
    return p;
  };
  backend.release = [dev](void* p) {
    DeviceScope scope(dev);
    cudaFree(p);
  };
  backend.synchronize = [dev, stream] {
    DeviceScope scope(dev);
    cudaStreamSynchronize(stream);
  };
  d->allocator_ =
      std::make_unique<CachingAllocator>(std::move(backend), limit, ctx);
  HAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&d->fault_word_, sizeof(int)), ctx);
  HAP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d->fault_word_, 0, sizeof(int), d->stream_), ctx);
  HAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(d->stream_), ctx);
  return d;
}

CudaDevice::~CudaDevice() {
  DeviceScope scope(ordinal_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  allocator_.reset();
  if (fault_word_ != nullptr) cudaFree(fault_word_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<void*> CudaDevice::Allocate(int64_t bytes) {
  return allocator_->Allocate(bytes);
}

absl::Status CudaDevice::CopyFromHost(const void* src, TensorView dst) {
  if (dst.bytes() == 0) return absl::OkStatus();
  HAP_DEVICE_SCOPE();
  const std::string ctx = absl::StrCat(name_, ": copy of ", dst.bytes(),
                                       " bytes from the host");
  HAP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst.data, src, dst.bytes(), cudaMemcpyHostToDevice, stream_), ctx);
  // From pageable memory the call returns once `src` is staged; from pinned
  // memory the copy is asynchronous, so wait: the caller may reuse `src`.
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, src) == cudaSuccess &&
      attr.type == cudaMemoryTypeHost) {
    HAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), ctx);
  }
  cudaGetLastError();  // cudaPointerGetAttributes may leave an error behind
  return absl::OkStatus();
}

absl::Status CudaDevice::CopyToHost(TensorView src, void* dst) {
  HAP_DEVICE_SCOPE();
  if (src.bytes() > 0) {
    HAP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_),
        absl::StrCat(name_, ": copy of ", src.bytes(), " bytes to the host"));
  }
  return SyncAndCheckFault();
}

absl::Status CudaDevice::Fill(TensorView dst, double value) {
  const int64_t n = dst.num_elements();
  if (n == 0) return absl::OkStatus();
  HAP_DEVICE_SCOPE();
  const std::string ctx = absl::StrCat(name_, ": fill");
  if (value == 0 && !std::signbit(value)) {  // every dtype's zero is all-zero bits
    HAP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst.data, 0, dst.bytes(), stream_), ctx);
    return absl::OkStatus();
  }
  switch (dst.dtype) {
    case DType::kFloat32:
      cuda::LaunchFill<float>(static_cast<float>(value), dst.as<float>(), n,
                              stream_);
      break;
    case DType::kFloat64:
      cuda::LaunchFill<double>(value, dst.as<double>(), n, stream_);
      break;
    case DType::kInt32:
      cuda::LaunchFill<int32_t>(static_cast<int32_t>(value), dst.as<int32_t>(),
                                n, stream_);
      break;
    case DType::kInt64:
      cuda::LaunchFill<int64_t>(static_cast<int64_t>(value), dst.as<int64_t>(),
                                n, stream_);
      break;
    default:
      return absl::UnimplementedError(absl::StrCat(
          "fill of ", graph::DTypeName(dst.dtype), " on ", name_));
  }
  HAP_CUDA_RETURN_IF_ERROR(cudaGetLastError(), ctx);
  return absl::OkStatus();
}

absl::Status CudaDevice::Convert(TensorView src, TensorView dst) {
  HAP_RETURN_IF_ERROR(CheckConvert(name_, src, dst));
  const int64_t n = src.num_elements();
  if (n == 0) return absl::OkStatus();
  HAP_DEVICE_SCOPE();
  if (src.dtype == DType::kFloat32) {
    cuda::LaunchToBf16(src.as<float>(), static_cast<uint16_t*>(dst.data), n, stream_);
  } else {
    cuda::LaunchFromBf16(static_cast<const uint16_t*>(src.data), dst.as<float>(), n, stream_);
  }
  HAP_CUDA_RETURN_IF_ERROR(cudaGetLastError(), absl::StrCat(name_, ": convert"));
  return absl::OkStatus();
}

absl::Status CudaDevice::CopyBox(TensorView src,
                                 absl::Span<const int64_t> src_start,
                                 TensorView dst,
                                 absl::Span<const int64_t> dst_start,
                                 absl::Span<const int64_t> extent) {
  HAP_ASSIGN_OR_RETURN(
      cuda::BoxCopyPlan plan,
      cuda::PlanBoxCopy(src, src_start, dst, dst_start, extent));
  if (plan.empty) return absl::OkStatus();
  HAP_DEVICE_SCOPE();
  cuda::LaunchCopyBox(plan.box,
                      static_cast<const char*>(src.data) + plan.src_offset,
                      static_cast<char*>(dst.data) + plan.dst_offset, stream_);
  HAP_CUDA_RETURN_IF_ERROR(cudaGetLastError(), absl::StrCat(name_, ": copy box"));
  return absl::OkStatus();
}

absl::Status CudaDevice::RunKernel(const std::string& name,
                                   const KernelContext& ctx,
                                   const graph::Attrs& attrs,
                                   absl::Span<const TensorView> inputs,
                                   absl::Span<const TensorView> outputs) {
  auto it = Table().find(name);
  if (it == Table().end()) {
    return absl::NotFoundError(absl::StrCat("no CUDA kernel '", name, "'"));
  }
  HAP_DEVICE_SCOPE();
  std::lock_guard<std::mutex> lock(mu_);
  cuda::DeviceFault fault{fault_word_, static_cast<int>(kMaxFaultNames + 1)};
  if (fault_kernels_.size() < kMaxFaultNames) {
    fault_kernels_.push_back(&it->first);
    fault.code = static_cast<int>(fault_kernels_.size());
  }
  CallScratch scratch(*this);
  cuda::KernelArgs args{it->first, ctx,      attrs,   inputs,
                        outputs,   stream_,  cublas_, options_.allow_tf32,
                        scratch,   fault};
  return it->second(args);
}

absl::Status CudaDevice::Synchronize() {
  HAP_DEVICE_SCOPE();
  return SyncAndCheckFault();
}

absl::Status CudaDevice::SyncAndCheckFault() {
  std::lock_guard<std::mutex> lock(mu_);
  // The fault word, read behind every queued kernel; an asynchronous error
  // of one of them surfaces here too.
  int code = 0;
  HAP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&code, fault_word_, sizeof(int), cudaMemcpyDeviceToHost, stream_),
      absl::StrCat(name_, ": synchronize"));
  HAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), absl::StrCat(name_, ": synchronize"));
  std::vector<const std::string*> kernels = std::move(fault_kernels_);
  fault_kernels_.clear();
  if (code == 0) return absl::OkStatus();
  HAP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fault_word_, 0, sizeof(int), stream_),
                           absl::StrCat(name_, ": clearing the fault word"));
  const std::string kernel =
      code >= 1 && code <= static_cast<int>(kernels.size())
          ? absl::StrCat("'", *kernels[code - 1], "'")
          : absl::StrCat("(one of more than ", kMaxFaultNames,
                         " run since the last synchronize)");
  return absl::InvalidArgumentError(absl::StrCat(
      "kernel ", kernel, " on ", name_,
      ": a target or id is out of range (found on the GPU; the element was "
      "skipped)"));
}

}  // namespace

absl::Status CudaAvailable() {
  int driver = 0, runtime = 0;
  cudaError_t e = cudaDriverGetVersion(&driver);
  if (e != cudaSuccess || driver == 0) {
    return absl::UnavailableError(
        "no CUDA driver: libcuda is not installed or not loadable");
  }
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess && driver < runtime) {
    return absl::UnavailableError(absl::StrCat(
        "the CUDA driver is too old: it supports CUDA ", driver / 1000, ".",
        (driver % 1000) / 10, ", the runtime needs ", runtime / 1000, ".",
        (runtime % 1000) / 10));
  }
  int count = 0;
  e = cudaGetDeviceCount(&count);
  if (e == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return absl::UnavailableError(
        "the CUDA driver is too old for this runtime");
  }
  if (e == cudaErrorNoDevice || (e == cudaSuccess && count == 0)) {
    cudaGetLastError();
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device is visible", visible != nullptr
                                         ? absl::StrCat(" (CUDA_VISIBLE_DEVICES=",
                                                        visible, ")")
                                         : std::string()));
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "cudaGetDeviceCount failed: ", cudaGetErrorName(e), " (",
        cudaGetErrorString(e), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(
    int ordinal, const CudaDeviceOptions& options) {
  HAP_RETURN_IF_ERROR(CudaAvailable());
  int count = 0;
  HAP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "NewCudaDevice");
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ordinal ", ordinal, " is out of range: ", count,
        " device(s) visible"));
  }
  if (options.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_limit_bytes must be >= 0, got ", options.memory_limit_bytes));
  }
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<CudaDevice> d,
                       CudaDevice::Open(ordinal, options));
  return std::unique_ptr<Device>(std::move(d));
}

cudaStream_t CudaComputeStream(Device& device) {
  auto* d = dynamic_cast<CudaDevice*>(&device);
  return d != nullptr ? d->stream() : nullptr;
}

int CudaOrdinal(const Device& device) {
  auto* d = dynamic_cast<const CudaDevice*>(&device);
  return d != nullptr ? d->ordinal() : -1;
}

std::vector<std::string> CudaKernelNames() {
  std::vector<std::string> names;
  for (const auto& [name, fn] : Table()) names.push_back(name);
  return names;  // std::map: sorted
}

}  // namespace hap::executor
