// The CPU device probe: OpenBLAS is wrapped here only (its CBLAS entry
// point and its process-wide thread count).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/stats.h"
#include "common/status_macros.h"
#include "executor/cpu/kernels.h"
#include "profiler_agent/probes.h"

namespace hap::agent {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int HardwareThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void SetBlasThreads(int n) { openblas_set_num_threads(std::max(1, n)); }

// C = A * B for n x n row-major matrices.
void Sgemm(int n, const float* a, const float* b, float* c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
}

// The bf16 probe's largest size: a product of 1024 shows the kernel's rate;
// larger ones would only lengthen the probe.
constexpr int kMaxBf16Size = 1024;

// options.matmul_sizes ascending, or InvalidArgument for no sizes, a size
// outside 1..16384, or repeats < 1.
absl::StatusOr<std::vector<int>> SortedSizes(const ProbeOptions& options) {
  if (options.matmul_sizes.empty()) {
    return absl::InvalidArgumentError("no matmul sizes to probe");
  }
  if (options.repeats < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("repeats must be at least 1, got ", options.repeats));
  }
  std::vector<int> sizes = options.matmul_sizes;
  std::sort(sizes.begin(), sizes.end());
  if (sizes.front() < 1 || sizes.back() > 16384) {
    return absl::InvalidArgumentError(absl::StrCat("matmul sizes must be within 1..16384, got ",
                                                   sizes.front(), "..", sizes.back()));
  }
  return sizes;
}

// The FLOP/s of `product(n)`, an n x n x n matmul, over `sizes` (ascending)
// within options.max_duration, as both probes measure them (probes.h):
// a warm-up of the smallest size, always made (threads started, pages
// touched); then, per size, up to options.repeats timed runs, each started
// only when it is predicted (from the last run's rate) to end within the
// bound. The median of the largest size with a timed run, else the
// warm-up's rate. Times come from options.now.
absl::StatusOr<double> ClimbSizes(const ProbeOptions& options, const std::vector<int>& sizes,
                                  const std::function<absl::Status(int n)>& product) {
  auto seconds_since = [&](absl::Time t0) { return absl::ToDoubleSeconds(options.now() - t0); };
  auto flop_of = [](int n) { return 2.0 * n * n * n; };
  auto timed_rate = [&](int n) -> absl::StatusOr<double> {
    HAP_RETURN_IF_ERROR(CheckNotStopped(options, absl::StrCat("a ", n, "x", n, " product")));
    const absl::Time t0 = options.now();
    HAP_RETURN_IF_ERROR(product(n));
    return flop_of(n) / std::max(seconds_since(t0), 1e-9);
  };
  const absl::Time start = options.now();
  const double budget = absl::ToDoubleSeconds(options.max_duration);
  // FLOP/s of the last run: predicts the next one's time.
  HAP_ASSIGN_OR_RETURN(double rate, timed_rate(sizes.front()));
  double result = rate;
  for (int n : sizes) {
    std::vector<double> runs;
    while (static_cast<int>(runs.size()) < options.repeats &&
           seconds_since(start) + flop_of(n) / rate <= budget) {
      HAP_ASSIGN_OR_RETURN(rate, timed_rate(n));
      runs.push_back(rate);
    }
    if (runs.empty()) break;
    result = Median(runs);
  }
  return result;
}

class CpuProber : public DeviceProber {
 public:
  explicit CpuProber(const SystemFiles* files) : files_(files) {}

  absl::StatusOr<std::vector<hap::v1::Device>> Probe(const std::string& node,
                                                     const ProbeOptions& options) override {
    std::optional<double> quota = ReadCpuQuota(*files_);
    int threads = Threads(options, quota);
    // The device's bound split evenly between the two dtypes, as the GPU
    // prober splits it.
    ProbeOptions per_dtype = options;
    per_dtype.max_duration = options.max_duration / 2;
    HAP_ASSIGN_OR_RETURN(double flops, MeasureMatmulFlops(threads, per_dtype));
    HAP_ASSIGN_OR_RETURN(double bf16_flops, MeasureBf16MatmulFlops(threads, per_dtype));
    HAP_ASSIGN_OR_RETURN(int64_t memory, ReadMemoryBytes(*files_));
    double share = quota ? std::min(*quota, static_cast<double>(HardwareThreads()))
                         : static_cast<double>(HardwareThreads());
    hap::v1::Device d;
    d.set_id(absl::StrCat(node, "/cpu0"));
    d.set_kind(hap::v1::CPU);
    d.set_model(absl::StrFormat("cpu (%d threads, share %.2f)", threads, share));
    auto* f = d.add_flops();
    f->set_dtype(hap::v1::FLOAT32);
    f->set_flops(flops);
    auto* f16 = d.add_flops();  // what bf16 plans are priced at
    f16->set_dtype(hap::v1::BFLOAT16);
    f16->set_flops(bf16_flops);
    d.set_memory_bytes(memory);
    d.set_launch_overhead_seconds(MeasureLaunchOverhead(threads));
    d.set_node(node);
    d.set_local_index(0);
    return std::vector<hap::v1::Device>{std::move(d)};
  }

  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions& options) override {
    ProbeOptions quick = options;
    // One mid-sized matrix, a few runs: enough to see a changed CPU share.
    quick.matmul_sizes = {options.matmul_sizes.empty() ? 512 : options.matmul_sizes.front()};
    quick.repeats = 3;
    quick.max_duration = std::min(options.max_duration, absl::Milliseconds(500));
    HAP_ASSIGN_OR_RETURN(double flops,
                         MeasureMatmulFlops(Threads(options, ReadCpuQuota(*files_)), quick));
    return std::vector<double>{flops};
  }

 private:
  static int Threads(const ProbeOptions& options, std::optional<double> quota) {
    if (options.threads > 0) return options.threads;
    int hw = HardwareThreads();
    if (!quota) return hw;
    // Clamped as a double: a quota may allow more CPUs than an int counts.
    return static_cast<int>(std::clamp(std::ceil(*quota), 1.0, static_cast<double>(hw)));
  }

  const SystemFiles* files_;
};

}  // namespace

absl::StatusOr<double> MeasureMatmulFlops(int threads, const ProbeOptions& options) {
  HAP_ASSIGN_OR_RETURN(std::vector<int> sizes, SortedSizes(options));
  SetBlasThreads(threads);
  const size_t max_elems = static_cast<size_t>(sizes.back()) * sizes.back();
  std::vector<float> a(max_elems, 0.5f), b(max_elems, 0.25f), c(max_elems, 0.0f);
  return ClimbSizes(options, sizes, [&](int n) {
    Sgemm(n, a.data(), b.data(), c.data());
    return absl::OkStatus();
  });
}

absl::StatusOr<double> MeasureBf16MatmulFlops(int threads, const ProbeOptions& options) {
  HAP_ASSIGN_OR_RETURN(std::vector<int> sizes, SortedSizes(options));
  for (int& n : sizes) n = std::min(n, kMaxBf16Size);
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  const int max_n = sizes.back();
  executor::HostTensor x(graph::DType::kFloat32, {max_n, max_n}),
      w(graph::DType::kFloat32, {max_n, max_n}), y(graph::DType::kFloat32, {max_n, max_n});
  for (int64_t i = 0; i < int64_t{max_n} * max_n; ++i) {
    x.as<float>()[i] = 0.5f;
    w.as<float>()[i] = 0.25f;
  }
  executor::KernelContext ctx;
  ctx.num_threads = std::max(1, threads);
  graph::Attrs attrs;
  attrs.Set("bf16", true);
  return ClimbSizes(options, sizes, [&](int n) {
    // n x n operands at the start of the largest size's buffers.
    executor::TensorView in[] = {x.view(), w.view()}, out[] = {y.view()};
    for (executor::TensorView* v : {&in[0], &in[1], &out[0]}) v->shape = {n, n};
    return executor::RunCpuKernel("linear", ctx, attrs, in, out);
  });
}

double MeasureLaunchOverhead(int threads) {
  SetBlasThreads(threads);
  float a = 1, b = 1, c = 0;
  constexpr int kCalls = 200;
  std::vector<double> batches;
  for (int i = 0; i < 5; ++i) {
    Clock::time_point t0 = Clock::now();
    for (int k = 0; k < kCalls; ++k) Sgemm(1, &a, &b, &c);
    batches.push_back(SecondsSince(t0) / kCalls);
  }
  return Median(batches);
}

std::unique_ptr<DeviceProber> NewCpuProber(const SystemFiles* files) {
  return std::make_unique<CpuProber>(files);
}

}  // namespace hap::agent
