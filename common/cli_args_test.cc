#include "common/cli_args.h"

#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::tools {
namespace {

using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

TEST(WriteOutputFileTest, WritesAndReplacesTheFile) {
  const std::string path = TempPath("out.txt");
  ASSERT_TRUE(WriteOutputFile(path, "a longer first version").ok());
  ASSERT_TRUE(WriteOutputFile(path, std::string("x\0y", 3)).ok());
  auto back = ReadInputFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, std::string("x\0y", 3));
}

// A full device: a few bytes fit the stream's buffer, so only the close can
// tell; the write must not be reported done.
TEST(WriteOutputFileTest, AFullDeviceIsAnErrorEvenForAFewBytes) {
  if (!std::ifstream("/dev/full")) GTEST_SKIP() << "no /dev/full";
  EXPECT_THAT(WriteOutputFile("/dev/full", "tiny", "plan file "),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("cannot write plan file '/dev/full': No space left on device")));
  EXPECT_THAT(WriteOutputFile("/dev/full", std::string(1 << 20, 'x')),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("No space left")));
}

// A write that fails part way (a full disk, a quota; here a file size
// limit) left the old file truncated to what was written: the plan or
// cluster it held was lost with the new one. The old file stays whole now,
// and no temporary file is left beside it. A replaced file keeps its mode.
TEST(WriteOutputFileTest, AFailedWriteLeavesTheOldFileWhole) {
  const std::string dir = TempPath("failed-write");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/plan.pb";
  ASSERT_TRUE(WriteOutputFile(path, "the old plan").ok());
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  struct rlimit before;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  struct rlimit limit = before;
  limit.rlim_cur = 4096;
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  const absl::Status s = WriteOutputFile(path, std::string(1 << 20, 'x'), "plan file ");
  setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal,
                          HasSubstr("cannot write plan file '" + path + "': File too large")));
  auto back = ReadInputFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, "the old plan");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);
  ASSERT_TRUE(WriteOutputFile(path, "the new plan").ok());
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640);
  // A new file gets 0666 less the umask, as any new file.
  const mode_t mask = umask(027);
  const std::string fresh = dir + "/fresh.pb";
  const absl::Status made = WriteOutputFile(fresh, "x");
  umask(mask);
  ASSERT_TRUE(made.ok()) << made;
  ASSERT_EQ(stat(fresh.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640);
}

// A name at the file system's limit (255 bytes) is written: the temporary
// file beside it has a short name of its own.
TEST(WriteOutputFileTest, ANameAtTheLengthLimitIsWritten) {
  const std::string path = TempPath(std::string(250, 'p') + ".json");
  ASSERT_TRUE(WriteOutputFile(path, "old").ok());
  ASSERT_TRUE(WriteOutputFile(path, "new").ok());
  auto back = ReadInputFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, "new");
}

// A symbolic link stays one: the file it points to gets the bytes.
TEST(WriteOutputFileTest, ALinkIsWrittenThrough) {
  const std::string target = TempPath("link-target.json"), link = TempPath("link.json");
  ASSERT_TRUE(WriteOutputFile(target, "old").ok());
  std::filesystem::remove(link);
  std::filesystem::create_symlink(target, link);
  ASSERT_TRUE(WriteOutputFile(link, "new").ok());
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  auto back = ReadInputFile(target);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, "new");
}

TEST(WriteOutputFileTest, AnUnopenableFileIsAnErrorNamingIt) {
  EXPECT_THAT(WriteOutputFile(TempPath("no/such/dir/out.txt"), "x", "--out "),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("cannot write --out '")));
}

// An input that cannot be opened says why (it said only "cannot open").
TEST(ReadInputFileTest, AnUnopenableFileSaysWhy) {
  EXPECT_THAT(
      ReadInputFile(TempPath("absent.pb"), "plan "),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot open plan '" + TempPath("absent.pb") +
                                                      "': No such file or directory")));
  EXPECT_THAT(ReadInputFile(TempPath(std::string(300, 'x')), "plan "),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("File name too long")));
}

// A source that does not end (/dev/zero given as --cluster or a token
// file) was read until memory ran out and the process aborted; it stops
// one byte past the bound, naming the file. A file of exactly the bound is
// read.
TEST(ReadInputFileTest, AnInputOverTheBoundIsAnErrorNotAnAbort) {
  EXPECT_THAT(ReadInputFile("/dev/zero", "cluster ", 3 << 20),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cluster '/dev/zero' is larger than 3145728 bytes")));
  const std::string path = TempPath("bound.json");
  ASSERT_TRUE(WriteOutputFile(path, std::string(100, 'x'), "").ok());
  auto exact = ReadInputFile(path, "", 100);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(exact->size(), 100u);
  EXPECT_THAT(ReadInputFile(path, "", 99),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("larger than 99 bytes")));
}

}  // namespace
}  // namespace hap::tools
