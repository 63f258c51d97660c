#include "executor/train/backend.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "executor/train/gpu_and_cpu_plan.h"
#include "executor/train/test_programs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(BackendTest, ParsesDeviceSpecs) {
  auto cpu = ParseDeviceSpec("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->kind, DeviceSpec::Kind::kCpu);
  auto cuda = ParseDeviceSpec("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->ToString(), "cuda:0");
  auto three = ParseDeviceSpec("cuda:3");
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(three->ToString(), "cuda:3");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:x", "cudax", "", "CPU"}) {
    EXPECT_THAT(ParseDeviceSpec(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpu, cuda or cuda:N")))
        << bad;
  }
}

TEST(BackendTest, PlannedDeviceFollowsTheClusterProfile) {
  v1::Plan plan = GpuAndCpuPlan();
  EXPECT_EQ(PlannedDevice(plan, 0).ToString(), "cuda:1");
  EXPECT_EQ(PlannedDevice(plan, 1).ToString(), "cpu");
  EXPECT_EQ(PlannedDevice(plan, 7).ToString(), "cpu");  // no such rank
  EXPECT_EQ(PlannedDevice(v1::Plan(), 0).ToString(), "cpu");
}

TEST(BackendTest, ChooseDevice) {
  v1::Plan plan = GpuAndCpuPlan();
  std::string note;
  auto flag = ChooseDevice("cpu", plan, 0, &note);
  ASSERT_TRUE(flag.ok());
  EXPECT_EQ(flag->ToString(), "cpu");  // the flag wins
  EXPECT_EQ(note, "");
  auto planned = ChooseDevice("", plan, 0, &note);
  if (CudaBuilt()) {  // a GPU rank and a CPU rank cannot talk
    EXPECT_THAT(planned.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                           HasSubstr("plans mixing GPU and CPU ranks")));
    EXPECT_THAT(ChooseDevice("", plan, 1).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 0 on cuda:1")));
  } else {
    ASSERT_TRUE(planned.ok());
    EXPECT_EQ(planned->ToString(), "cpu");
    EXPECT_THAT(note, HasSubstr("no CUDA support; running it on the CPU"));
  }
  // All GPUs: each rank on its own.
  v1::Plan gpus = GpuAndCpuPlan();
  gpus.mutable_cluster()->mutable_nodes(0)->mutable_devices(1)->set_kind(v1::GPU);
  gpus.mutable_cluster()->mutable_nodes(0)->mutable_devices(1)->set_local_index(0);
  auto r1 = ChooseDevice("", gpus, 1);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->ToString(), CudaBuilt() ? "cuda:0" : "cpu");
  EXPECT_THAT(ChooseDevice("tpu", plan, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'tpu'")));
}

// A build without CUDA refusing cuda: backend_without_cuda_test, which
// compiles backend.cc so in every build (here it could only skip under
// --config=cuda, as CI builds).

TEST(BackendTest, CpuBackendIsGloo) {
  std::string dir = absl::StrCat(::testing::TempDir(), "/backend_cpu");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto store = NewFileStore(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  GlooOptions o;
  o.timeout = absl::Seconds(10);
  auto b = MakeBackend(DeviceSpec{}, 1, o, **store);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->device->name(), "cpu");
  EXPECT_EQ(b->comm->size(), 1);
  EXPECT_TRUE(b->comm->Barrier().ok());
}

// Runs check(r, world, store) for ranks 0..present-1 of `size`, each on a
// thread with its own file store in a fresh `dir`; their statuses (ranks
// not present: "did not run").
std::vector<absl::Status> OnRanks(
    int size, int present, const std::string& dir, absl::Duration timeout,
    const std::function<absl::Status(int, const GlooOptions&, RendezvousStore&)>& check) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<absl::Status> out(size, absl::UnknownError("did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < present; ++r) {
    threads.emplace_back([&, r] {
      auto store = NewFileStore(dir);
      if (!store.ok()) {
        out[r] = store.status();
        return;
      }
      GlooOptions go;
      go.rank = r;
      go.size = size;
      go.prefix = "p";
      go.timeout = timeout;
      out[r] = check(r, go, **store);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Ranks of one lowered plan agree, though their buffers differ (uneven
// shards); a rank whose program issues another collective sequence is
// refused on its side and on rank 0's, each naming the other (rank 1,
// which compares with rank 0 only, goes on); a rank that never publishes
// is the store's DeadlineExceeded.
TEST(CheckProgramsAgreeTest, RanksOfOnePlanAgreeAndADifferentProgramIsNamed) {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", 16}, {"input", 8}, {"classes", 4}, {"batch", 12}});
  ASSERT_THAT(g, IsOk());
  const std::vector<double> ratios = {0.5, 0.3, 0.2};
  auto program = hap::testing::ProgramOfKind(*g, 3, "tp", ratios);
  ASSERT_THAT(program, IsOk());
  lower::LowerOptions lo;
  lo.world_size = 3;
  lo.ratios = ratios;
  auto ranks = lower::Lower(*g, *program, lo);
  ASSERT_THAT(ranks, IsOk());
  bool differ = false;  // some buffer's shard differs between ranks 0 and 2
  for (int b = 0; b < (*ranks)[0].buffers_size() && b < (*ranks)[2].buffers_size(); ++b) {
    const auto& a = (*ranks)[0].buffers(b).shape();
    const auto& c = (*ranks)[2].buffers(b).shape();
    differ |= !std::equal(a.begin(), a.end(), c.begin(), c.end());
  }
  ASSERT_TRUE(differ) << "the ranks' shards should differ";
  auto run = [&](const std::vector<v1::RankProgram>& programs, const std::string& dir,
                 absl::Duration timeout, int present) {
    return OnRanks(static_cast<int>(programs.size()), present, dir, timeout,
                   [&](int r, const GlooOptions& go, RendezvousStore& store) {
                     return CheckProgramsAgree(programs[r], go, store);
                   });
  };
  const std::string dir = absl::StrCat(::testing::TempDir(), "/agree");
  for (const absl::Status& s : run(*ranks, dir, absl::Seconds(30), 3)) EXPECT_THAT(s, IsOk());

  std::vector<v1::RankProgram> other = *ranks;
  int last = other[2].steps_size() - 1;
  while (!other[2].steps(last).has_collective()) --last;
  other[2].mutable_steps(last)->mutable_collective()->set_root(1);  // another call
  std::vector<absl::Status> refused = run(other, dir, absl::Seconds(30), 3);
  EXPECT_THAT(refused[0], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("rank 0's program issues other collectives than "
                                             "rank 2 (collective signature")));
  EXPECT_THAT(refused[1], IsOk());
  EXPECT_THAT(refused[2], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("rank 2's program issues other collectives than "
                                             "rank 0")));

  std::vector<absl::Status> alone = run(*ranks, dir, absl::Milliseconds(300), 1);
  EXPECT_THAT(alone[0], StatusIs(absl::StatusCode::kDeadlineExceeded,
                                 HasSubstr("comparing the ranks' programs")));
}

// Ranks that start from one checkpoint agree, at whatever path each found
// it; a rank that starts from another is refused on its side and on rank
// 0's, each naming the other's start (rank 1 compares with rank 0 only and
// goes on), before any step could train the ranks from different states.
TEST(CheckStartsAgreeTest, OneCheckpointAtTwoPathsAgreesAndAnotherStepIsNamed) {
  auto run = [](const std::vector<TrainingStart>& starts) {
    const int n = static_cast<int>(starts.size());
    return OnRanks(n, n, absl::StrCat(::testing::TempDir(), "/starts"), absl::Seconds(30),
                   [&](int r, const GlooOptions& go, RendezvousStore& store) {
                     return CheckStartsAgree(starts[r], go, store);
                   });
  };
  const TrainingStart at4{"checkpoint step 4 of plan abc", "checkpoint /a/step-00000004 (step 4)"};
  const TrainingStart at4_elsewhere{"checkpoint step 4 of plan abc",
                                    "checkpoint /b/step-00000004 (step 4)"};
  const TrainingStart at2{"checkpoint step 2 of plan abc", "checkpoint /b/step-00000002 (step 2)"};
  for (const absl::Status& s : run({at4, at4_elsewhere, at4})) EXPECT_THAT(s, IsOk());

  std::vector<absl::Status> refused = run({at4, at4_elsewhere, at2});
  EXPECT_THAT(refused[0],
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank 0 starts from checkpoint /a/step-00000004 (step 4) "
                                       "but rank 2 from checkpoint /b/step-00000002 (step 2)"),
                             HasSubstr("give every rank the same checkpoint"))));
  EXPECT_THAT(refused[1], IsOk());
  EXPECT_THAT(refused[2], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("rank 2 starts from checkpoint /b/step-00000002 "
                                             "(step 2) but rank 0 from checkpoint "
                                             "/a/step-00000004 (step 4)")));

  // A key with a newline is compared whole, not cut at it.
  const TrainingStart two_lines{"checkpoint step 4\nof plan abc", "x"};
  const TrainingStart two_lines_other{"checkpoint step 4\nof plan xyz", "y"};
  std::vector<absl::Status> cut = run({two_lines, two_lines_other});
  EXPECT_THAT(cut[0],
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("but rank 1 from y")));
}

}  // namespace
}  // namespace hap::executor
