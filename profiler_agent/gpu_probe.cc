// The GPU prober: turns the CUDA measurements of gpu_probe.cu (plain C++,
// errors as text) into Device and Link protos and absl::Status.
#include "profiler_agent/gpu_probe.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace hap::agent {
namespace {

namespace v1 = hap::v1;
using gpu::GemmKind;

// Copies faster than this cannot be PCIe: a Gen5 x16 link carries 64e9 B/s
// raw per direction, about 55e9 B/s in practice.
constexpr double kPcieCeilingBytesPerSecond = 64e9;

// An error text of gpu_probe.cu as a status: CUDA failures at run time
// (device lost, out of memory) are the GPU's state, not the caller's fault.
absl::Status Check(const std::string& error, absl::string_view context) {
  if (error.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(context, ": ", error));
}

v1::DType DtypeOf(GemmKind kind) {
  switch (kind) {
    case GemmKind::kFloat32:
    case GemmKind::kTf32:
      return v1::FLOAT32;
    case GemmKind::kBFloat16:
      return v1::BFLOAT16;
    case GemmKind::kFloat16:
      return v1::FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

std::string GpuId(const std::string& node, int ordinal) {
  return absl::StrCat(node, "/gpu", ordinal);
}

class GpuProber : public DeviceProber {
 public:
  GpuProber(int count, GpuProbeOptions options) : count_(count), options_(std::move(options)) {}

  absl::StatusOr<std::vector<v1::Device>> Probe(const std::string& node,
                                                const ProbeOptions& options) override {
    std::vector<v1::Device> devices;
    for (int ordinal = 0; ordinal < count_; ++ordinal) {
      HAP_RETURN_IF_ERROR(CheckNotStopped(options, absl::StrCat("GPU ", ordinal)));
      auto d = ProbeOne(node, ordinal, options);
      if (!d.ok()) return Annotate(d.status(), absl::StrCat("GPU ", ordinal));
      devices.push_back(*std::move(d));
    }
    return devices;
  }

  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions& options) override {
    gpu::GemmOptions quick;
    quick.sizes = {options_.quick_size};
    quick.repeats = 3;
    quick.budget_seconds =
        absl::ToDoubleSeconds(std::min(options.max_duration, absl::Milliseconds(500)));
    std::vector<double> flops;
    for (int ordinal = 0; ordinal < count_; ++ordinal) {
      HAP_RETURN_IF_ERROR(
          CheckNotStopped(options, absl::StrCat("the quick check of GPU ", ordinal)));
      std::vector<gpu::GemmRate> rates;
      HAP_RETURN_IF_ERROR(Check(gpu::MeasureGemmRates(ordinal, {GemmKind::kFloat32}, quick, &rates),
                                absl::StrCat("GPU ", ordinal, ": quick float32 GEMM check")));
      flops.push_back(rates.at(0).flops);
    }
    return flops;
  }

  absl::StatusOr<std::vector<v1::Link>> ProbeLinks(const std::string& node,
                                                   const ProbeOptions& options) override {
    std::vector<v1::Link> links;
    if (count_ < 2) return links;
    gpu::PeerOptions peer;
    peer.max_bytes = options_.peer_max_bytes;
    peer.repeats = std::max(1, std::min(options.repeats, 3));
    peer.budget_seconds = absl::ToDoubleSeconds(options.max_duration) / (count_ * (count_ - 1));
    for (int src = 0; src < count_; ++src) {
      for (int dst = 0; dst < count_; ++dst) {
        if (src == dst) continue;
        HAP_RETURN_IF_ERROR(
            CheckNotStopped(options, absl::StrCat("peer copy GPU ", src, " -> GPU ", dst)));
        gpu::PeerMeasurement m;
        HAP_RETURN_IF_ERROR(Check(gpu::MeasurePeer(src, dst, peer, &m),
                                  absl::StrCat("peer copy GPU ", src, " -> GPU ", dst)));
        v1::Link l;
        l.set_src(GpuId(node, src));
        l.set_dst(GpuId(node, dst));
        l.set_bandwidth_bytes_per_second(m.bandwidth_bytes_per_second);
        l.set_latency_seconds(m.latency_seconds);
        l.set_kind(GpuLinkKind(m));
        links.push_back(std::move(l));
      }
    }
    return links;
  }

 private:
  absl::StatusOr<v1::Device> ProbeOne(const std::string& node, int ordinal,
                                      const ProbeOptions& options) {
    gpu::GpuProperties props;
    HAP_RETURN_IF_ERROR(Check(gpu::GetGpuProperties(ordinal, &props), "reading its properties"));
    std::vector<GemmKind> kinds;
    for (GemmKind k :
         {GemmKind::kFloat32, GemmKind::kTf32, GemmKind::kBFloat16, GemmKind::kFloat16}) {
      if (gpu::GemmSupported(k, props.compute_major)) kinds.push_back(k);
    }
    gpu::GemmOptions gemm;
    gemm.sizes = options_.matmul_sizes;
    gemm.repeats = options.repeats;
    // The launch-overhead check takes a few milliseconds of the budget.
    gemm.budget_seconds = 0.95 * absl::ToDoubleSeconds(options.max_duration);
    std::vector<gpu::GemmRate> rates;
    HAP_RETURN_IF_ERROR(
        Check(gpu::MeasureGemmRates(ordinal, kinds, gemm, &rates), "measuring GEMM FLOP/s"));
    double launch = 0;
    HAP_RETURN_IF_ERROR(
        Check(gpu::MeasureLaunchOverhead(ordinal, &launch), "measuring the launch overhead"));

    v1::Device d;
    d.set_id(GpuId(node, ordinal));
    d.set_kind(v1::GPU);
    d.set_model(props.name);
    for (const gpu::GemmRate& r : rates) {
      if (r.kind == GemmKind::kTf32) {
        d.set_tf32_flops(r.flops);
        continue;
      }
      auto* f = d.add_flops();
      f->set_dtype(DtypeOf(r.kind));
      f->set_flops(r.flops);
    }
    d.set_memory_bytes(props.total_bytes);
    d.set_launch_overhead_seconds(launch);
    d.set_node(node);
    d.set_local_index(ordinal);
    return d;
  }

  const int count_;
  const GpuProbeOptions options_;
};

}  // namespace

absl::StatusOr<int> VisibleGpus() {
  std::string reason;
  int n = gpu::VisibleGpuCount(&reason);
  if (n <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no GPU is visible to this process (", reason, ")"));
  }
  return n;
}

absl::StatusOr<std::unique_ptr<DeviceProber>> NewGpuProber(GpuProbeOptions options) {
  HAP_ASSIGN_OR_RETURN(int count, VisibleGpus());
  return std::make_unique<GpuProber>(count, std::move(options));
}

v1::LinkKind GpuLinkKind(const gpu::PeerMeasurement& m) {
  if (m.attributes.native_atomics || m.bandwidth_bytes_per_second > kPcieCeilingBytesPerSecond) {
    return v1::NVLINK;
  }
  return v1::PCIE;
}

}  // namespace hap::agent
