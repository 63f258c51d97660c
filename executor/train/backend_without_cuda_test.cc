// backend.cc as a build without --config=cuda compiles it
// (:backend_without_cuda), linked into every build: CI builds with
// --config=cuda, where backend_test can only skip the paths a CPU-only
// build takes (a plan's GPU rank run on the CPU with a note; cuda asked for
// explicitly refused, naming the flag).
#include <string>

#include "common/status_matchers.h"
#include "executor/train/backend.h"
#include "executor/train/gpu_and_cpu_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

TEST(BackendWithoutCudaTest, IsACpuOnlyBuild) { EXPECT_FALSE(CudaBuilt()); }

// A plan's GPU rank runs on the CPU, and the note says why; a plan mixing
// GPU and CPU ranks is no error here (every rank runs on the CPU, Gloo).
TEST(BackendWithoutCudaTest, APlansGpuRankRunsOnTheCpuWithANote) {
  const v1::Plan plan = GpuAndCpuPlan();
  EXPECT_EQ(PlannedDevice(plan, 0).ToString(), "cuda:1");
  std::string note;
  auto gpu_rank = ChooseDevice("", plan, 0, &note);
  ASSERT_TRUE(gpu_rank.ok()) << gpu_rank.status();
  EXPECT_EQ(gpu_rank->ToString(), "cpu");
  EXPECT_EQ(note,
            "the plan places rank 0 on a GPU (cuda:1) but this build has no CUDA support; "
            "running it on the CPU");
  note.clear();
  auto cpu_rank = ChooseDevice("", plan, 1, &note);
  ASSERT_TRUE(cpu_rank.ok()) << cpu_rank.status();
  EXPECT_EQ(cpu_rank->ToString(), "cpu");
  EXPECT_EQ(note, "");
  // Without a note to fill, the same choice.
  auto quiet = ChooseDevice("", plan, 0);
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  EXPECT_EQ(quiet->ToString(), "cpu");
  // --device wins, and an explicit cuda is taken as asked (MakeDevice
  // refuses it).
  auto asked = ChooseDevice("cuda:0", plan, 1, &note);
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_EQ(asked->ToString(), "cuda:0");
}

TEST(BackendWithoutCudaTest, CudaAskedForSaysHowToGetIt) {
  EXPECT_THAT(MakeDevice(DeviceSpec{DeviceSpec::Kind::kCuda, 0}, 1).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("device cuda:0: this build has no CUDA support; rebuild with "
                                 "--config=cuda")));
  EXPECT_TRUE(MakeDevice(DeviceSpec{}, 1).ok());
}

}  // namespace
}  // namespace hap::executor
