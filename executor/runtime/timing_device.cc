#include "executor/runtime/timing_device.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>
#include <vector>

#include "planner/graph/op_registry.h"

namespace hap::executor {

template <typename F>
absl::Status TimingDevice::Timed(const std::string& key, F&& f) {
  if (synchronize_) {
    absl::Status before = inner_->Synchronize();
    if (!before.ok()) return before;
  }
  auto t0 = std::chrono::steady_clock::now();
  absl::Status s = f();
  if (synchronize_ && s.ok()) s = inner_->Synchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(mu_);
  Total& t = totals_[key];
  t.calls += 1;
  t.seconds += seconds;
  return s;
}

absl::Status TimingDevice::CopyFromHost(const void* src,
                                        TensorView dst) {
  return Timed("(copy from host)",
               [&] { return inner_->CopyFromHost(src, dst); });
}

absl::Status TimingDevice::CopyToHost(TensorView src, void* dst) {
  return Timed("(copy to host)", [&] { return inner_->CopyToHost(src, dst); });
}

absl::Status TimingDevice::Fill(TensorView dst, double value) {
  return Timed("(fill)", [&] { return inner_->Fill(dst, value); });
}

absl::Status TimingDevice::Convert(TensorView src, TensorView dst) {
  return Timed("(convert)", [&] { return inner_->Convert(src, dst); });
}

absl::Status TimingDevice::CopyBox(TensorView src,
                                   absl::Span<const int64_t> src_start,
                                   TensorView dst,
                                   absl::Span<const int64_t> dst_start,
                                   absl::Span<const int64_t> extent) {
  return Timed("(copy box)", [&] {
    return inner_->CopyBox(src, src_start, dst, dst_start, extent);
  });
}

absl::Status TimingDevice::RunKernel(
    const std::string& name, const KernelContext& ctx,
    const graph::Attrs& attrs, absl::Span<const TensorView> inputs,
    absl::Span<const TensorView> outputs) {
  return Timed(name, [&] {
    return inner_->RunKernel(name, ctx, attrs, inputs, outputs);
  });
}

std::string TimingDevice::Table(int64_t steps) const {
  std::vector<std::pair<std::string, Total>> rows;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rows.assign(totals_.begin(), totals_.end());
  }
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.second.seconds > b.second.seconds;
  });
  double total = 0;
  for (const auto& [name, t] : rows) total += t.seconds;
  const double per = steps > 0 ? 1.0 / steps : 0.0;
  std::string out =
      "| kernel | calls/step | ms/step | share |\n|---|---|---|---|\n";
  char buf[256];
  for (const auto& [name, t] : rows) {
    std::snprintf(buf, sizeof buf, "| %s | %.0f | %.2f | %.1f%% |\n",
                  name.c_str(), t.calls * per, 1e3 * t.seconds * per,
                  total > 0 ? 100 * t.seconds / total : 0.0);
    out += buf;
  }
  std::snprintf(buf, sizeof buf, "| total (device calls) | | %.2f | 100%% |\n",
                1e3 * total * per);
  return out + buf;
}

namespace {

// The IR op type a kernel runs for: "T" and "T_grad" for op type T, and a
// kernel of an op run in parts ("cross_entropy_lse", "cross_entropy_sharded"
// for a cross_entropy sharded by class) the longest registered op type it
// starts with, followed by '_'. Other names stand for themselves.
std::string OpTypeOfKernel(const std::string& name) {
  const graph::OpRegistry& ops = graph::OpRegistry::Global();
  std::string base = name;
  if (base.size() > 5 && base.compare(base.size() - 5, 5, "_grad") == 0) {
    base.resize(base.size() - 5);
  }
  if (ops.Find(base) != nullptr) return base;
  for (size_t cut = base.rfind('_'); cut != std::string::npos && cut > 0;
       cut = base.rfind('_', cut - 1)) {
    if (ops.Find(absl::string_view(base).substr(0, cut)) != nullptr) {
      return base.substr(0, cut);
    }
  }
  return base;
}

}  // namespace

std::map<std::string, double> TimingDevice::SecondsByOpType(
    int64_t steps) const {
  static const char* const kOptimizer[] = {"sgd_update", "adam_update",
                                           "sq_norm"};
  static const char* const kRuntime[] = {"fill_zero", "copy", "accumulate"};
  std::map<std::string, double> out;
  const double per = steps > 0 ? 1.0 / steps : 0.0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, t] : totals_) {
    std::string type = name;
    if (name.empty() || name[0] == '(') {
      type = "(runtime)";
    } else if (std::find(std::begin(kOptimizer), std::end(kOptimizer), name) !=
               std::end(kOptimizer)) {
      type = "(optimizer)";
    } else if (std::find(std::begin(kRuntime), std::end(kRuntime), name) !=
               std::end(kRuntime)) {
      type = "(runtime)";
    } else {
      type = OpTypeOfKernel(name);
    }
    out[type] += t.seconds * per;
  }
  return out;
}

double TimingDevice::TotalSeconds(int64_t steps) const {
  double total = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, t] : totals_) total += t.seconds;
  return steps > 0 ? total / steps : 0.0;
}

}  // namespace hap::executor
