// The GPU prober on this machine's GPUs; every test that needs one skips,
// naming the reason, where none is visible. No test times the probes: a
// budget is checked by what it lets them measure.
#include "profiler_agent/gpu_probe.h"

#include <cuda_runtime.h>

#include <map>

#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::agent {
namespace {

namespace v1 = hap::v1;
using ::hap::testing::IsOk;

std::map<v1::DType, double> FlopsByDtype(const v1::Device& d) {
  std::map<v1::DType, double> m;
  for (const auto& f : d.flops()) m[f.dtype()] = f.flops();
  return m;
}

class GpuProbeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto n = VisibleGpus();
    if (!n.ok()) GTEST_SKIP() << "no GPU to test on: " << n.status().message();
    count_ = *n;
    auto prober = NewGpuProber();
    ASSERT_THAT(prober, IsOk());
    prober_ = std::move(*prober);
  }

  static ProbeOptions Budget(absl::Duration d) {
    ProbeOptions o;
    o.max_duration = d;
    return o;
  }

  int count_ = 0;
  std::unique_ptr<DeviceProber> prober_;
};

TEST_F(GpuProbeTest, ReportsEveryGpuWithItsFlopsMemoryAndOrdinal) {
  auto devices = prober_->Probe("n", Budget(absl::Seconds(2)));
  ASSERT_THAT(devices, IsOk());
  ASSERT_EQ(static_cast<int>(devices->size()), count_);
  for (int i = 0; i < count_; ++i) {
    const v1::Device& d = (*devices)[i];
    SCOPED_TRACE(d.id());
    EXPECT_EQ(d.id(), "n/gpu" + std::to_string(i));
    EXPECT_EQ(d.kind(), v1::GPU);
    EXPECT_EQ(d.node(), "n");
    EXPECT_EQ(d.local_index(), i);

    cudaDeviceProp props;
    ASSERT_EQ(cudaGetDeviceProperties(&props, i), cudaSuccess);
    EXPECT_EQ(d.model(), props.name);
    ASSERT_EQ(cudaSetDevice(i), cudaSuccess);
    size_t free_bytes = 0, total_bytes = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    EXPECT_EQ(d.memory_bytes(), static_cast<int64_t>(total_bytes));

    auto flops = FlopsByDtype(d);
    EXPECT_GT(flops[v1::FLOAT32], 0);
    EXPECT_GT(flops[v1::FLOAT16], 0);
    if (props.major >= 8) {
      // Tensor cores: well above exact float32 on any Ampere or newer GPU;
      // asserted loosely, the probe's sizes are small at a 2 s budget.
      EXPECT_GT(flops[v1::BFLOAT16], 0.8 * flops[v1::FLOAT32]);
      EXPECT_GT(d.tf32_flops(), 0.8 * flops[v1::FLOAT32]);
    } else {
      EXPECT_EQ(flops.count(v1::BFLOAT16), 0u);
      EXPECT_EQ(d.tf32_flops(), 0);
    }
    EXPECT_GT(d.launch_overhead_seconds(), 0);
    EXPECT_LT(d.launch_overhead_seconds(), 1e-3);
  }
}

// The budgets are checked by what they let the probes measure, not by the
// time they took: a run predicted to overrun is not started, so a zero
// budget leaves only the warm-up (the smallest GEMM size, the 1 MiB copy)
// and an ample one reaches the largest size asked.
TEST_F(GpuProbeTest, AZeroBudgetMeasuresOnlyTheSmallestGemmAndStillGivesARate) {
  gpu::GemmOptions o;
  o.sizes = {256, 512};
  o.repeats = 2;
  o.budget_seconds = 0;
  std::vector<gpu::GemmRate> rates;
  ASSERT_EQ(gpu::MeasureGemmRates(0, {gpu::GemmKind::kFloat32}, o, &rates), "");
  ASSERT_EQ(rates.size(), 1u);
  EXPECT_EQ(rates[0].size, 256);
  EXPECT_GT(rates[0].flops, 0);

  o.budget_seconds = 30;  // some milliseconds of work on any GPU
  rates.clear();
  ASSERT_EQ(gpu::MeasureGemmRates(0, {gpu::GemmKind::kFloat32}, o, &rates), "");
  ASSERT_EQ(rates.size(), 1u);
  EXPECT_EQ(rates[0].size, 512);
  EXPECT_GT(rates[0].flops, 0);

  // Through the prober: a zero budget still gives every GPU a rate.
  auto devices = prober_->Probe("n", Budget(absl::ZeroDuration()));
  ASSERT_THAT(devices, IsOk());
  ASSERT_EQ(static_cast<int>(devices->size()), count_);
  for (const auto& d : *devices) EXPECT_GT(FlopsByDtype(d)[v1::FLOAT32], 0) << d.id();
}

TEST_F(GpuProbeTest, AZeroBudgetCopiesOnlyTheWarmUpMebibyteBetweenPeers) {
  if (count_ < 2) GTEST_SKIP() << "one GPU: no peer links to measure";
  gpu::PeerOptions o;
  o.max_bytes = int64_t{4} << 20;
  o.repeats = 2;
  o.budget_seconds = 0;
  gpu::PeerMeasurement m;
  ASSERT_EQ(gpu::MeasurePeer(0, 1, o, &m), "");
  EXPECT_EQ(m.bytes, int64_t{1} << 20);
  EXPECT_GT(m.bandwidth_bytes_per_second, 0);

  o.budget_seconds = 30;
  ASSERT_EQ(gpu::MeasurePeer(0, 1, o, &m), "");
  EXPECT_EQ(m.bytes, int64_t{4} << 20);
  EXPECT_GT(m.bandwidth_bytes_per_second, 0);
}

TEST_F(GpuProbeTest, QuickFlopsGivesOneFloat32RatePerGpu) {
  auto quick = prober_->QuickFlops(Budget(absl::Seconds(1)));
  ASSERT_THAT(quick, IsOk());
  ASSERT_EQ(static_cast<int>(quick->size()), count_);
  for (double f : *quick) EXPECT_GT(f, 0);
}

TEST_F(GpuProbeTest, PeerLinksBetweenEveryOrderedPairOnlyWithTwoGpus) {
  auto links = prober_->ProbeLinks("n", Budget(absl::Seconds(1)));
  ASSERT_THAT(links, IsOk());
  if (count_ < 2) {
    EXPECT_TRUE(links->empty());
    GTEST_SKIP() << "one GPU: no peer links to measure";
  }
  EXPECT_EQ(static_cast<int>(links->size()), count_ * (count_ - 1));
  for (const v1::Link& l : *links) {
    SCOPED_TRACE(l.src() + " -> " + l.dst());
    EXPECT_NE(l.src(), l.dst());
    EXPECT_THAT(l.src(), ::testing::StartsWith("n/gpu"));
    EXPECT_THAT(l.dst(), ::testing::StartsWith("n/gpu"));
    EXPECT_GT(l.bandwidth_bytes_per_second(), 0);
    EXPECT_GE(l.latency_seconds(), 0);
    EXPECT_LT(l.latency_seconds(), 0.01);
    EXPECT_TRUE(l.kind() == v1::NVLINK || l.kind() == v1::PCIE) << l.kind();
  }
}

// What follows needs no GPU.

TEST(GpuLinkKindTest, NvlinkByAtomicsOrByARateNoPcieReaches) {
  gpu::PeerMeasurement m;
  m.bandwidth_bytes_per_second = 20e9;
  EXPECT_EQ(GpuLinkKind(m), v1::PCIE);
  m.attributes.access_supported = true;
  EXPECT_EQ(GpuLinkKind(m), v1::PCIE);
  m.attributes.native_atomics = true;
  EXPECT_EQ(GpuLinkKind(m), v1::NVLINK);
  m.attributes.native_atomics = false;
  m.bandwidth_bytes_per_second = 150e9;
  EXPECT_EQ(GpuLinkKind(m), v1::NVLINK);
}

TEST(GpuProbeCudaTest, RejectsBadArgumentsBeforeTouchingAGpu) {
  gpu::PeerMeasurement m;
  EXPECT_THAT(gpu::MeasurePeer(0, 0, {}, &m), ::testing::HasSubstr("two different GPUs"));
  std::vector<gpu::GemmRate> rates;
  gpu::GemmOptions o;
  o.repeats = 0;
  EXPECT_THAT(gpu::MeasureGemmRates(0, {gpu::GemmKind::kFloat32}, o, &rates),
              ::testing::HasSubstr("repeats"));
  EXPECT_FALSE(gpu::GemmSupported(gpu::GemmKind::kBFloat16, 7));
  EXPECT_TRUE(gpu::GemmSupported(gpu::GemmKind::kBFloat16, 8));
  EXPECT_TRUE(gpu::GemmSupported(gpu::GemmKind::kFloat16, 7));
}

TEST(GpuProbeCudaTest, WithoutAGpuTheCountIsZeroWithAReason) {
  std::string reason;
  int n = gpu::VisibleGpuCount(&reason);
  if (n > 0) GTEST_SKIP() << n << " GPU(s) visible: nothing to check without one";
  EXPECT_FALSE(reason.empty());
  EXPECT_THAT(VisibleGpus(), ::hap::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                                      ::testing::HasSubstr("no GPU is visible")));
  EXPECT_THAT(NewGpuProber(), ::hap::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                                       ::testing::HasSubstr(reason)));
}

}  // namespace
}  // namespace hap::agent
