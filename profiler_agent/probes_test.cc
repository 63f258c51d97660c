#include "profiler_agent/probes.h"

#include <algorithm>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::agent {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::DoubleNear;
using ::testing::HasSubstr;
using ::testing::Optional;

// A host whose /proc and /sys/fs/cgroup are whatever the test says.
class FakeFiles : public SystemFiles {
 public:
  std::map<std::string, std::string> files;
  absl::StatusOr<std::string> Read(const std::string& path) const override {
    auto it = files.find(path);
    if (it == files.end()) return absl::NotFoundError(absl::StrCat("no ", path));
    return it->second;
  }
};

constexpr char kMeminfo[] = "MemTotal:       16384000 kB\nMemFree:  100 kB\n";
constexpr int64_t kMemTotal = int64_t{16384000} * 1024;

void ExpectMemory(const SystemFiles& f, int64_t want) {
  auto got = ReadMemoryBytes(f);
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(*got, want);
}

ProbeOptions Quick() {
  ProbeOptions o;
  o.matmul_sizes = {128, 256};
  o.repeats = 3;
  o.max_duration = absl::Seconds(1);
  return o;
}

TEST(CpuProberTest, ReportsPositiveFlopsAndMemoryOnThisHost) {
  auto prober = NewCpuProber();
  auto devices = prober->Probe("host-a", Quick());
  ASSERT_THAT(devices, IsOk());
  ASSERT_EQ(devices->size(), 1u);
  const hap::v1::Device& d = (*devices)[0];
  EXPECT_EQ(d.id(), "host-a/cpu0");
  EXPECT_EQ(d.kind(), hap::v1::CPU);
  EXPECT_EQ(d.node(), "host-a");
  EXPECT_EQ(d.local_index(), 0);
  EXPECT_THAT(d.model(), HasSubstr("threads, share "));
  ASSERT_EQ(d.flops_size(), 2);
  EXPECT_EQ(d.flops(0).dtype(), hap::v1::FLOAT32);
  EXPECT_GT(d.flops(0).flops(), 1e6);
  EXPECT_EQ(d.flops(1).dtype(), hap::v1::BFLOAT16);  // the executor's bf16 GEMM
  EXPECT_GT(d.flops(1).flops(), 1e6);
  EXPECT_GT(d.memory_bytes(), int64_t{1} << 20);
  EXPECT_GT(d.launch_overhead_seconds(), 0);
  EXPECT_LT(d.launch_overhead_seconds(), 0.1);

  auto quick = prober->QuickFlops(Quick());
  ASSERT_THAT(quick, IsOk());
  ASSERT_EQ(quick->size(), 1u);
  EXPECT_GT((*quick)[0], 1e6);
}

// A probe told to stop (the agent shuts down) ends before its next timed
// run: with --probe-seconds 60 on a CPU throttled by its cgroup, SIGTERM
// waited for the whole probe.
TEST(MatmulTest, AStoppedProbeEndsBeforeItsNextRun) {
  ProbeOptions o;
  o.matmul_sizes = {64, 128};
  o.repeats = 1000;
  o.max_duration = absl::Hours(1);
  int asked = 0;
  o.stop = [&asked] { return ++asked > 3; };
  EXPECT_THAT(MeasureMatmulFlops(1, o),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("the probe was stopped")));
  EXPECT_EQ(asked, 4);
  EXPECT_THAT(MeasureBf16MatmulFlops(1, o),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("the probe was stopped")));
}

TEST(MatmulTest, WarmUpRunCountsWhenNothingElseFits) {
  ProbeOptions o;
  o.matmul_sizes = {256};
  o.max_duration = absl::Nanoseconds(1);
  auto flops = MeasureMatmulFlops(1, o);
  ASSERT_THAT(flops, IsOk());
  EXPECT_GT(*flops, 0);
}

// A clock that steps `step` at every reading and counts the readings: each
// probe run seems to take a step, whatever the CPU does, and the readings
// count the runs (each is timed with two, and its bound checked with one).
struct SteppingClock {
  explicit SteppingClock(absl::Duration step) : step(step) {}
  std::function<absl::Time()> Now() {
    return [this] { return absl::UnixEpoch() + step * ++readings; };
  }
  absl::Duration step;
  int readings = 0;
};

// Both probes keep --probe-seconds alike: with runs that seem to take 10 ms
// and a 100 ms bound, a few runs of the 1,000 asked are made (the bf16 one
// made all 1,000 of each size; a throttled CPU took minutes), and the rate
// is still measured.
TEST(MatmulTest, BothProbesStopRepeatingOnceTheBoundIsSpent) {
  for (auto probe : {&MeasureMatmulFlops, &MeasureBf16MatmulFlops}) {
    SteppingClock clock(absl::Milliseconds(10));
    ProbeOptions o;
    o.matmul_sizes = {32, 64};
    o.repeats = 1000;
    o.max_duration = absl::Milliseconds(100);
    o.now = clock.Now();
    auto flops = probe(1, o);
    ASSERT_THAT(flops, IsOk());
    EXPECT_GT(*flops, 0);
    // A timed run takes three readings (30 ms), so 100 ms holds three or
    // four and the warm-up; not honouring the bound takes 2,000 and more.
    EXPECT_LE(clock.readings, 20) << (probe == &MeasureMatmulFlops ? "fp32" : "bf16");
  }
}

// A size whose first run is predicted (from the last run's rate) to end
// past the bound is not started, while the bound still has room: with runs
// that seem to take 10 ms and a 100 ms bound, 32^3 products are measured
// twice and the 1024^3 one (32,768 times the work: 328 s at that rate) is
// skipped. The rate shows which size was timed last: each timed run reads
// the clock twice, one step apart, so it is exactly 2 n^3 FLOP per 10 ms.
// (This was a wall-clock limit of 5 s on sizes up to 4,096.)
TEST(MatmulTest, ASizePredictedToOverrunTheBoundIsNotStarted) {
  for (auto probe : {&MeasureMatmulFlops, &MeasureBf16MatmulFlops}) {
    const std::string which = probe == &MeasureMatmulFlops ? "fp32" : "bf16";
    SteppingClock clock(absl::Milliseconds(10));
    ProbeOptions o;
    o.matmul_sizes = {32, 1024};
    o.repeats = 2;
    o.max_duration = absl::Milliseconds(100);
    o.now = clock.Now();
    auto flops = probe(1, o);
    ASSERT_THAT(flops, IsOk()) << which;
    // (A timed 1024^3 run would make it 2.1e11.)
    EXPECT_THAT(*flops, DoubleNear(2.0 * 32 * 32 * 32 / 0.01, 1)) << which;
    // The start, the warm-up (2), per timed run of 32 a bound check and two
    // readings (6), and the check that refused 1024: 10 readings, 90 ms.
    EXPECT_EQ(clock.readings, 10) << which;
  }
}

TEST(MatmulTest, Bf16WarmUpRunCountsWhenNothingElseFits) {
  ProbeOptions o;
  o.matmul_sizes = {64};
  o.max_duration = absl::Nanoseconds(1);
  auto flops = MeasureBf16MatmulFlops(1, o);
  ASSERT_THAT(flops, IsOk());
  EXPECT_GT(*flops, 0);
}

TEST(MatmulTest, RejectsBadSizes) {
  ProbeOptions o;
  o.matmul_sizes = {};
  EXPECT_THAT(MeasureMatmulFlops(1, o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no matmul sizes")));
  o.matmul_sizes = {0, 64};
  EXPECT_THAT(MeasureMatmulFlops(1, o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1..16384")));
  o.matmul_sizes = {64};
  o.repeats = 0;
  EXPECT_THAT(MeasureMatmulFlops(1, o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeats")));
}

TEST(MemoryTest, MemTotalWithoutACgroupLimit) {
  FakeFiles f;
  f.files["/proc/meminfo"] = kMeminfo;
  f.files["/proc/self/cgroup"] = "4:memory:/\n1:cpu,cpuacct:/\n";
  f.files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "9223372036854771712\n";
  ExpectMemory(f, kMemTotal);
}

TEST(MemoryTest, CappedByTheCgroupV1LimitOfTheProcessOrAParent) {
  FakeFiles f;
  f.files["/proc/meminfo"] = kMeminfo;
  f.files["/proc/self/cgroup"] = "4:memory:/jobs/agent\n";
  f.files["/sys/fs/cgroup/memory/jobs/agent/memory.limit_in_bytes"] = "9223372036854771712\n";
  f.files["/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes"] = "1073741824\n";
  ExpectMemory(f, int64_t{1} << 30);
}

TEST(MemoryTest, ContainerWhoseCgroupPathIsTheHostsReadsTheMountRoot) {
  FakeFiles f;
  f.files["/proc/meminfo"] = kMeminfo;
  f.files["/proc/self/cgroup"] = "4:memory:/process_api/abc\n";
  f.files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "2147483648";
  ExpectMemory(f, int64_t{2} << 30);
}

TEST(MemoryTest, CappedByCgroupV2MemoryMax) {
  FakeFiles f;
  f.files["/proc/meminfo"] = kMeminfo;
  f.files["/proc/self/cgroup"] = "0::/user.slice/agent.service\n";
  f.files["/sys/fs/cgroup/user.slice/agent.service/memory.max"] = "536870912\n";
  f.files["/sys/fs/cgroup/user.slice/memory.max"] = "max\n";
  ExpectMemory(f, int64_t{512} << 20);
}

TEST(MemoryTest, UnreadableMeminfoIsAnError) {
  FakeFiles f;
  EXPECT_THAT(ReadMemoryBytes(f), StatusIs(absl::StatusCode::kNotFound, HasSubstr("meminfo")));
  f.files["/proc/meminfo"] = "MemFree: 12 kB\n";
  EXPECT_THAT(ReadMemoryBytes(f), StatusIs(absl::StatusCode::kInternal, HasSubstr("MemTotal")));
}

// A MemTotal whose bytes do not fit in 64 bits (a corrupt or faked
// /proc/meminfo) is an error naming it: kB x 1024 overflowed, and
// 18014398509481985 kB came out as 1 KiB, reported as the node's memory.
TEST(MemoryTest, AMemTotalPast64BitsOfBytesIsAnErrorNamingIt) {
  FakeFiles f;
  f.files["/proc/meminfo"] = "MemTotal:       18014398509481985 kB\n";
  EXPECT_THAT(ReadMemoryBytes(f),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("MemTotal 18014398509481985 kB")));
  f.files["/proc/meminfo"] = "MemTotal:       9007199254740991 kB\n";  // the most that fits
  ExpectMemory(f, int64_t{9007199254740991} * 1024);
}

TEST(CpuQuotaTest, CgroupV1QuotaOverPeriod) {
  FakeFiles f;
  f.files["/proc/self/cgroup"] = "2:cpu,cpuacct:/slow\n";
  f.files["/sys/fs/cgroup/cpu/slow/cpu.cfs_quota_us"] = "40000\n";
  f.files["/sys/fs/cgroup/cpu/slow/cpu.cfs_period_us"] = "100000\n";
  f.files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "-1\n";
  f.files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = "100000\n";
  EXPECT_THAT(ReadCpuQuota(f), Optional(DoubleNear(0.4, 1e-9)));
}

TEST(CpuQuotaTest, CgroupV2CpuMax) {
  FakeFiles f;
  f.files["/proc/self/cgroup"] = "0::/a\n";
  f.files["/sys/fs/cgroup/a/cpu.max"] = "150000 100000\n";
  EXPECT_THAT(ReadCpuQuota(f), Optional(DoubleNear(1.5, 1e-9)));
  f.files["/sys/fs/cgroup/a/cpu.max"] = "max 100000\n";
  EXPECT_EQ(ReadCpuQuota(f), std::nullopt);
}

TEST(CpuQuotaTest, NoQuotaAnywhere) {
  FakeFiles f;
  f.files["/proc/self/cgroup"] = "1:cpu:/\n";
  f.files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "-1\n";
  f.files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = "100000\n";
  EXPECT_EQ(ReadCpuQuota(f), std::nullopt);
}

TEST(CpuProberTest, ModelNamesTheCgroupShareAndThreads) {
  FakeFiles f;
  f.files["/proc/meminfo"] = kMeminfo;
  f.files["/proc/self/cgroup"] = "1:cpu:/slow\n4:memory:/slow\n";
  f.files["/sys/fs/cgroup/cpu/slow/cpu.cfs_quota_us"] = "40000";
  f.files["/sys/fs/cgroup/cpu/slow/cpu.cfs_period_us"] = "100000";
  f.files["/sys/fs/cgroup/memory/slow/memory.limit_in_bytes"] = "1048576000";
  auto devices = NewCpuProber(&f)->Probe("n", Quick());
  ASSERT_THAT(devices, IsOk());
  EXPECT_EQ((*devices)[0].model(), "cpu (1 threads, share 0.40)");
  EXPECT_EQ((*devices)[0].memory_bytes(), 1048576000);
}

// A quota of more CPUs than an int counts (cgroup v2 allows up to 2^44-1 us
// a 1 ms period: 1.8e10 CPUs) means all of this machine's threads, not the
// INT_MIN of an out-of-range cast clamped to one thread.
TEST(CpuProberTest, AQuotaBeyondAnIntOfCpusUsesEveryHardwareThread) {
  FakeFiles f;
  f.files["/proc/meminfo"] = kMeminfo;
  f.files["/proc/self/cgroup"] = "0::/big\n";
  f.files["/sys/fs/cgroup/big/cpu.max"] = "17592186044415 1000\n";
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  auto devices = NewCpuProber(&f)->Probe("n", Quick());
  ASSERT_THAT(devices, IsOk());
  EXPECT_EQ((*devices)[0].model(), absl::StrFormat("cpu (%d threads, share %.2f)", hw, hw * 1.0));
}

// A prober that reports what it is told.
class ScriptedProber : public DeviceProber {
 public:
  absl::Status error;
  bool no_devices = false;
  absl::StatusOr<std::vector<hap::v1::Device>> Probe(const std::string& node,
                                                     const ProbeOptions&) override {
    if (!error.ok()) return error;
    if (no_devices) return std::vector<hap::v1::Device>{};
    hap::v1::Device d;
    d.set_id(node + "/gpu0");
    return std::vector<hap::v1::Device>{d};
  }
  absl::StatusOr<std::vector<double>> QuickFlops(const ProbeOptions&) override {
    return std::vector<double>{1};
  }
};

TEST(ProbeNodeTest, AssemblesTheNodeFromEveryProber) {
  ScriptedProber a, b;
  std::vector<DeviceProber*> probers = {&a, &b};
  auto node = ProbeNode("n1", "127.0.0.1:5", probers, Quick());
  ASSERT_THAT(node, IsOk());
  EXPECT_EQ(node->name(), "n1");
  EXPECT_EQ(node->address(), "127.0.0.1:5");
  EXPECT_EQ(node->devices_size(), 2);
}

TEST(ProbeNodeTest, AProberErrorFailsTheProbeWithContext) {
  ScriptedProber a, b;
  b.error = absl::UnavailableError("driver gone");
  std::vector<DeviceProber*> probers = {&a, &b};
  EXPECT_THAT(ProbeNode("n1", "x:1", probers, Quick()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("prober 1): driver gone")));
  b.error = absl::OkStatus();
  a.no_devices = b.no_devices = true;
  EXPECT_THAT(ProbeNode("n1", "x:1", probers, Quick()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no device")));
}

}  // namespace
}  // namespace hap::agent
