// Tests of what a checkpoint directory keeps (retention.cc): the newest
// --checkpoint-keep checkpoints, retention that stops part way, killed
// saves' leftovers and other runs' temporary directories, and the later
// steps of a replaced run set aside.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/checkpoint/checkpoint_test_util.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::checkpoint {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;
using ::hap::testing::StatusIs;
using test_util::Entries;
using test_util::Fresh;
using test_util::Mlp;
using test_util::Programs;
using test_util::SaveOnEveryRank;
using test_util::StateOf;
using test_util::Train;
using test_util::TrainAndSave;
using test_util::TrainAndSaveFrom;
using ::testing::HasSubstr;

TEST(CheckpointTest, KeepsTheNewestCompleteCheckpointsOnly) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 2, "dp");
  const std::string dir = Fresh("keep");
  TrainAndSave(g, programs, dir, 5, 2);
  EXPECT_EQ(Entries(dir), (std::vector<std::string>{"step-00000004", "step-00000005"}));
  EXPECT_EQ(Entries(dir + "/step-00000005"),
            (std::vector<std::string>{"COMMITTED", "index.json", "rank-00000-of-00002.safetensors",
                                      "rank-00001-of-00002.safetensors", "trainer.json"}));
  auto found = FindCheckpoint(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, dir + "/step-00000005");
}

// Sets or clears a file's immutable attribute (FS_IMMUTABLE_FL, as
// chattr +i): false where the file system or the user cannot.
bool SetImmutable(const std::string& path, bool on) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  int flags = 0;
  bool ok = ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  flags = on ? (flags | FS_IMMUTABLE_FL) : (flags & ~FS_IMMUTABLE_FL);
  ok = ok && ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  close(fd);
  return ok;
}

// Retention that cannot remove an old checkpoint whole (a crash part way,
// a file it may not remove) leaves a step that does not count as complete:
// COMMITTED goes first. It was removed in directory order, so the step
// could keep COMMITTED with files gone and still count as complete.
TEST(CheckpointTest, ARetentionThatStopsPartWayLeavesNoStepThatCountsAsComplete) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 2, "dp");
  const std::string dir = Fresh("retain-part-way");
  TrainAndSave(g, programs, dir, 1, 1);
  const std::string old = dir + "/step-00000001";
  std::vector<std::string> held;
  for (const std::string& name : Entries(old)) {
    if (name == "COMMITTED") continue;
    if (!SetImmutable(old + "/" + name, true)) {
      for (const std::string& h : held) SetImmutable(h, false);
      GTEST_SKIP() << "cannot make " << old << "/" << name
                   << " immutable here (needs root and a file system with FS_IMMUTABLE_FL)";
    }
    held.push_back(old + "/" + name);
  }
  CheckpointPolicy policy;
  policy.dir = dir;
  policy.every = 1;
  policy.keep = 1;
  policy.last_step = 2;
  policy.resumed_from = 1;
  auto resumed = TrainAndSaveFrom(g, programs, policy, 1, 1, old);
  for (const std::string& h : held) SetImmutable(h, false);
  ASSERT_TRUE(resumed.ok()) << resumed.status();  // the failed removal is a warning
  auto found = FindCheckpoint(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, dir + "/step-00000002");
  const std::vector<std::string> left = Entries(old);
  EXPECT_EQ(std::count(left.begin(), left.end(), "COMMITTED"), 0)
      << "a step with files it could not remove still counts as complete";
}

TEST(CheckpointTest, AnIncompleteCheckpointDoesNotCountAndIsRemovedByTheNextSave) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 2, "dp");
  const std::string dir = Fresh("incomplete");
  TrainAndSave(g, programs, dir, 2, 3);
  // What a rank killed mid-write leaves: a temporary directory with one
  // file, and a renamed directory without COMMITTED.
  fs::create_directories(dir + "/.tmp-step-00000009");
  std::ofstream(dir + "/.tmp-step-00000009/rank-00000-of-00002.safetensors") << "partial";
  fs::copy(dir + "/step-00000002", dir + "/step-00000003", fs::copy_options::recursive);
  fs::remove(dir + "/step-00000003/COMMITTED");
  auto found = FindCheckpoint(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, dir + "/step-00000002");
  EXPECT_THAT(FindCheckpoint(dir + "/step-00000003").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("incomplete")));
  EXPECT_THAT(FindCheckpoint(Fresh("empty_dir_missing")).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("empty_dir_missing")));

  // Resume from step 2 and save steps 3 and 4: the leftovers go, the
  // committed step 3 replaces the incomplete one.
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  v1::TrainerState trainer = (*reader)->trainer();
  TrainOptions to;
  to.first_step = 2;
  to.steps = 2;
  to.initialize = ResumeHook(std::shared_ptr<CheckpointReader>(std::move(*reader)), &g);
  to.after_step = SaveHook({dir, 1, 3, 4}, &programs, trainer);
  auto r = Train(g, programs, to);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{"step-00000002", "step-00000003", "step-00000004"}));
  EXPECT_TRUE(fs::exists(dir + "/step-00000003/COMMITTED"));
}

// A save's sweep of killed saves' temporary directories takes this run's at
// once and another run's only once nothing in it changed for an hour: a
// replaced run's rank still saving (a Stop gave up on it) removed the new
// run's save in progress, and the new run the old one's.
TEST(CheckpointTest, ASaveRemovesOnlyItsOwnRunsOrLongUntouchedTemporaryDirectories) {
  graph::Graph g = Mlp();
  auto single = Programs(g, 1, "single");
  const std::string dir = Fresh("tmp-sweep");
  auto make = [&](const std::string& name) {
    fs::create_directories(dir + "/" + name);
    std::ofstream(dir + "/" + name + "/rank-00000-of-00001.safetensors") << "partial";
  };
  make(".tmp-step-00000001-job-7-g2");  // this run's, killed
  make(".tmp-step-00000004-job-7-g3");  // another run's, saving now
  make(".tmp-step-00000001");           // an older build's, saving now
  make(".tmp-step-00000002-job-7-g1");  // another run's, untouched for 2 hours
  const auto old = fs::file_time_type::clock::now() - std::chrono::hours(2);
  fs::last_write_time(dir + "/.tmp-step-00000002-job-7-g1/rank-00000-of-00001.safetensors", old);
  fs::last_write_time(dir + "/.tmp-step-00000002-job-7-g1", old);
  SaveRequest req;
  req.dir = dir;
  req.programs = &single;
  req.trainer.set_step(3);
  req.run_id = "job-7-g2";
  auto one = NewInProcessGroup(1);
  auto saved = SaveCheckpoint(req, StateOf(single[0]), *one[0]);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{".tmp-step-00000001", ".tmp-step-00000004-job-7-g3",
                                      "step-00000003"}));
}

// Saving step N where committed steps past N exist (this run resumed from
// an earlier step): those are set aside under a free name, said on stderr,
// never resumed from, and retention counts only the steps up to N.
TEST(CheckpointTest, LaterStepsOfAReplacedRunAreSetAsideNotDeleted) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 1, "single");
  const std::string dir = Fresh("superseded");
  for (int64_t step : {1, 2, 5}) {
    for (const auto& r : SaveOnEveryRank(programs, dir, step)) ASSERT_TRUE(r.ok()) << r.status();
  }
  fs::create_directory(dir + "/superseded-step-00000005");  // the name is taken
  ::testing::internal::CaptureStderr();
  for (const auto& r : SaveOnEveryRank(programs, dir, 3, /*keep=*/2)) {
    ASSERT_TRUE(r.ok()) << r.status();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr(dir + "/step-00000005 -> superseded-step-00000005-1"));
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{"step-00000002", "step-00000003", "superseded-step-00000005",
                                      "superseded-step-00000005-1"}));
  EXPECT_TRUE(fs::exists(dir + "/superseded-step-00000005-1/COMMITTED"));
  auto found = FindCheckpoint(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, dir + "/step-00000003");
  // The next save counts steps only: superseded directories stay.
  for (const auto& r : SaveOnEveryRank(programs, dir, 4, /*keep=*/2)) {
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{"step-00000003", "step-00000004", "superseded-step-00000005",
                                      "superseded-step-00000005-1"}));
}

// A run resumed from step 2 of a run that saved every 2 steps up to 6: its
// first save, of step 4, sets the replaced run's steps 4 and 6 aside instead
// of failing with AlreadyExists, and its next save is an ordinary one.
TEST(CheckpointTest, ARunResumedFromAnEarlierStepSavesTheStepsItsPredecessorReached) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 2, "tp");
  const std::string dir = Fresh("rolled_back");
  for (int64_t step : {2, 4, 6}) {
    for (const auto& r : SaveOnEveryRank(programs, dir, step)) ASSERT_TRUE(r.ok()) << r.status();
  }
  // Without the resume's step the save is refused, as for any duplicate.
  for (const auto& r : SaveOnEveryRank(programs, dir, 4)) {
    EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("exists")));
  }
  ::testing::internal::CaptureStderr();
  for (const auto& r : SaveOnEveryRank(programs, dir, 4, kDefaultKeep, {}, /*replaces_after=*/2)) {
    ASSERT_TRUE(r.ok()) << r.status();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("the committed checkpoints after step 2 belong to a run"));
  for (const auto& r : SaveOnEveryRank(programs, dir, 6)) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{"step-00000002", "step-00000004", "step-00000006",
                                      "superseded-step-00000004", "superseded-step-00000006"}));
  auto found = FindCheckpoint(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, dir + "/step-00000006");
}

// 2. Retention: resuming from an older step of a directory that holds newer
// checkpoints (README: "--resume DIR/step-N") must not delete what it has
// just committed (and reported as saved).
TEST(CheckpointTest, RetentionNeverDeletesTheCheckpointJustCommitted) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 1, "single");
  const std::string dir = Fresh("rollback");
  // First run: steps 2 and 4.
  ASSERT_TRUE(TrainAndSaveFrom(g, programs, {dir, 2, 3, 4}, 0, 4).ok());
  // Roll back to step 2 and train one step, keeping 1 checkpoint.
  const absl::Status resumed =
      TrainAndSaveFrom(g, programs, {dir, 1, 1, 3}, 2, 1, dir + "/step-00000002").status();
  EXPECT_TRUE(resumed.ok()) << resumed;
  EXPECT_TRUE(fs::exists(dir + "/step-00000003/COMMITTED"))
      << "the checkpoint of step 3 (committed, then removed by retention) is gone; left: " << [&] {
           std::string s;
           for (const auto& e : fs::directory_iterator(dir)) {
             s += e.path().filename().string() + " ";
           }
           return s;
         }();
}

}  // namespace
}  // namespace hap::executor::checkpoint
