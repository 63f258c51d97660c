// A Device that forwards every call to another and adds up the wall time of
// each kernel by name (and of fills and host copies), for the per-kernel
// breakdown of bench/step_worker.cc. On the CPU device kernels run
// synchronously, so a call's wall time is the kernel's time.
//
// Thread-compatible, like the device it wraps.
#ifndef HAP_BENCH_TIMING_DEVICE_H_
#define HAP_BENCH_TIMING_DEVICE_H_

#include <cstdint>
#include <map>
#include <string>

#include "executor/runtime/device.h"

namespace hap::bench {

class TimingDevice : public executor::Device {
 public:
  // `inner` must outlive this device.
  explicit TimingDevice(executor::Device* inner) : inner_(inner) {}

  // Forgets what was recorded (after warm-up).
  void Reset() { totals_.clear(); }
  // A Markdown table, slowest first: per kernel name, calls and
  // milliseconds per step over `steps` steps, and the share of the total.
  std::string Table(int64_t steps) const;

  std::string name() const override { return inner_->name(); }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    return inner_->Allocate(bytes);
  }
  void Free(void* p) override { inner_->Free(p); }
  absl::Status CopyFromHost(const void* src, executor::TensorView dst) override;
  absl::Status CopyToHost(executor::TensorView src, void* dst) override;
  absl::Status Fill(executor::TensorView dst, double value) override;
  absl::Status CopyBox(executor::TensorView src,
                       absl::Span<const int64_t> src_start,
                       executor::TensorView dst,
                       absl::Span<const int64_t> dst_start,
                       absl::Span<const int64_t> extent) override;
  bool HasKernel(const std::string& name) const override {
    return inner_->HasKernel(name);
  }
  absl::Status RunKernel(
      const std::string& name, const executor::KernelContext& ctx,
      const graph::Attrs& attrs, absl::Span<const executor::TensorView> inputs,
      absl::Span<const executor::TensorView> outputs) override;
  absl::Status Synchronize() override { return inner_->Synchronize(); }

 private:
  struct Total {
    int64_t calls = 0;
    double seconds = 0;
  };
  // Runs `f`, adding its wall time to `key`.
  template <typename F>
  absl::Status Timed(const std::string& key, F&& f);

  executor::Device* inner_;
  std::map<std::string, Total> totals_;
};

}  // namespace hap::bench

#endif  // HAP_BENCH_TIMING_DEVICE_H_
