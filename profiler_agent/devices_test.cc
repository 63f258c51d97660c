// --devices in both builds: without CUDA there is no GPU code and gpu is
// refused naming why; with CUDA but no GPU the same with CUDA's reason.
#include "profiler_agent/devices.h"

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::agent {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DevicesTest, ParsesTheThreeChoices) {
  EXPECT_THAT(ParseDeviceSelection("auto"), IsOk());
  EXPECT_EQ(*ParseDeviceSelection("auto"), DeviceSelection::kAuto);
  EXPECT_EQ(*ParseDeviceSelection("cpu"), DeviceSelection::kCpu);
  EXPECT_EQ(*ParseDeviceSelection("gpu"), DeviceSelection::kGpu);
  EXPECT_THAT(ParseDeviceSelection("tpu"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("auto, cpu or gpu")));
  EXPECT_STREQ(DeviceSelectionName(DeviceSelection::kGpu), "gpu");
}

TEST(DevicesTest, CpuAlwaysGivesTheCpuProber) {
  std::string why;
  auto probers = MakeDeviceProbers(DeviceSelection::kCpu, &why);
  ASSERT_THAT(probers, IsOk());
  EXPECT_EQ(probers->size(), 1u);
  EXPECT_THAT(why, HasSubstr("CPU"));
}

TEST(DevicesTest, AutoAlwaysGivesAProber) {
  std::string why;
  auto probers = MakeDeviceProbers(DeviceSelection::kAuto, &why);
  ASSERT_THAT(probers, IsOk());
  EXPECT_EQ(probers->size(), 1u);
  if (!BuiltWithCuda()) {
    EXPECT_THAT(why, HasSubstr("built without CUDA"));
  }
}

TEST(DevicesTest, GpuFailsNamingWhyWhereThereIsNone) {
  auto probers = MakeDeviceProbers(DeviceSelection::kGpu);
  if (!BuiltWithCuda()) {
    EXPECT_THAT(probers, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("--devices gpu: this hap-agent was built without "
                                            "CUDA")));
    EXPECT_THAT(probers,
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--config=cuda")));
    return;
  }
  if (probers.ok()) GTEST_SKIP() << "built with CUDA and a GPU is visible: gpu works here";
  EXPECT_THAT(probers, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("--devices gpu: no GPU is visible")));
}

}  // namespace
}  // namespace hap::agent
