#include "executor/cpu/cpu_device.h"

#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "executor/cpu/kernels.h"

namespace hap::executor {
namespace {

template <typename T>
void FillAs(TensorView v, double value) {
  T* p = v.as<T>();
  const int64_t n = v.num_elements();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(value);
}

class CpuDevice : public Device {
 public:
  explicit CpuDevice(int threads) : threads_(threads < 1 ? 1 : threads) {}

  std::string name() const override { return "cpu"; }

  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes < 0 || bytes > std::numeric_limits<int64_t>::max() - 63) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
    }
    size_t size = static_cast<size_t>((bytes + 63) / 64 * 64);
    if (size == 0) size = 64;
    void* p = std::aligned_alloc(64, size);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
    }
    return p;
  }
  void Free(void* p) override { std::free(p); }

  absl::Status CopyFromHost(const void* src, TensorView dst) override {
    if (dst.bytes() > 0) std::memcpy(dst.data, src, dst.bytes());
    return absl::OkStatus();
  }
  absl::Status CopyToHost(TensorView src, void* dst) override {
    if (src.bytes() > 0) std::memcpy(dst, src.data, src.bytes());
    return absl::OkStatus();
  }
  absl::Status Fill(TensorView dst, double value) override {
    switch (dst.dtype) {
      case DType::kFloat32:
        FillAs<float>(dst, value);
        break;
      case DType::kFloat64:
        FillAs<double>(dst, value);
        break;
      case DType::kInt32:
        FillAs<int32_t>(dst, value);
        break;
      case DType::kInt64:
        FillAs<int64_t>(dst, value);
        break;
      default:
        if (value != 0) {
          return absl::UnimplementedError(absl::StrCat(
              "fill of ", graph::DTypeName(dst.dtype), " on the CPU"));
        }
        if (dst.bytes() > 0) std::memset(dst.data, 0, dst.bytes());
    }
    return absl::OkStatus();
  }
  absl::Status CopyBox(TensorView src, absl::Span<const int64_t> src_start,
                       TensorView dst, absl::Span<const int64_t> dst_start,
                       absl::Span<const int64_t> extent) override {
    return HostCopyBox(src, src_start, dst, dst_start, extent);
  }
  absl::Status Convert(TensorView src, TensorView dst) override {
    return HostConvert(src, dst);
  }
  bool HasKernel(const std::string& name) const override {
    return HasCpuKernel(name);
  }
  absl::Status RunKernel(const std::string& name, const KernelContext& ctx,
                         const graph::Attrs& attrs,
                         absl::Span<const TensorView> inputs,
                         absl::Span<const TensorView> outputs) override {
    KernelContext c = ctx;
    c.num_threads = threads_;
    return RunCpuKernel(name, c, attrs, inputs, outputs);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  int threads_;
};

}  // namespace

std::unique_ptr<Device> NewCpuDevice(int threads) {
  SetBlasThreads(threads < 1 ? 1 : threads);
  return std::make_unique<CpuDevice>(threads);
}

}  // namespace hap::executor
