// A Device that forwards every call to another and adds up the wall time of
// each kernel by name (and of fills and host copies): the per-kernel
// breakdown of bench/step_worker.cc and the per-op-type profile that
// `hap-executor --profile` writes for cost-model calibration. On the CPU
// device kernels run synchronously, so a call's wall time is the kernel's
// time; a CUDA device is timed with `synchronize` (Synchronize around each
// call).
//
// Thread-safe: with overlap the runner's communication thread converts and
// copies through it while the main thread runs kernels (the wrapped device
// must allow that, as the CPU and CUDA devices do); each call's wall time
// counts in full, so calls that overlap are both counted.
#ifndef HAP_EXECUTOR_RUNTIME_TIMING_DEVICE_H_
#define HAP_EXECUTOR_RUNTIME_TIMING_DEVICE_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "executor/runtime/device.h"

namespace hap::executor {

class TimingDevice : public Device {
 public:
  // `inner` must outlive this device. With `synchronize`, every call waits
  // for the device's queued work before it starts and after it returns, so
  // an asynchronous device (CUDA) is timed per kernel too (at the cost of
  // the overlap between launches).
  explicit TimingDevice(Device* inner, bool synchronize = false)
      : inner_(inner), synchronize_(synchronize) {}

  // Forgets what was recorded (after warm-up).
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    totals_.clear();
  }
  // A Markdown table, slowest first: per kernel name, calls and
  // milliseconds per step over `steps` steps, and the share of the total.
  std::string Table(int64_t steps) const;
  // Seconds per step by IR op type over `steps` steps: a kernel "T" and its
  // backward "T_grad" count for op type T; optimizer kernels (sgd_update,
  // adam_update, sq_norm) for "(optimizer)"; runtime kernels, fills and
  // copies for "(runtime)".
  std::map<std::string, double> SecondsByOpType(int64_t steps) const;
  // Seconds per step of every call together.
  double TotalSeconds(int64_t steps) const;

  std::string name() const override { return inner_->name(); }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    return inner_->Allocate(bytes);
  }
  void Free(void* p) override { inner_->Free(p); }
  absl::Status CopyFromHost(const void* src, TensorView dst) override;
  absl::Status CopyToHost(TensorView src, void* dst) override;
  absl::Status Fill(TensorView dst, double value) override;
  absl::Status Convert(TensorView src, TensorView dst) override;
  absl::Status CopyBox(TensorView src,
                       absl::Span<const int64_t> src_start,
                       TensorView dst,
                       absl::Span<const int64_t> dst_start,
                       absl::Span<const int64_t> extent) override;
  bool HasKernel(const std::string& name) const override {
    return inner_->HasKernel(name);
  }
  absl::Status RunKernel(
      const std::string& name, const KernelContext& ctx,
      const graph::Attrs& attrs, absl::Span<const TensorView> inputs,
      absl::Span<const TensorView> outputs) override;
  absl::Status Synchronize() override { return inner_->Synchronize(); }

 private:
  struct Total {
    int64_t calls = 0;
    double seconds = 0;
  };
  // Runs `f`, adding its wall time to `key`.
  template <typename F>
  absl::Status Timed(const std::string& key, F&& f);

  Device* inner_;
  bool synchronize_;
  mutable std::mutex mu_;
  std::map<std::string, Total> totals_;  // guarded by mu_
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_TIMING_DEVICE_H_
