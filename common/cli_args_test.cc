#include "common/cli_args.h"

#include <cstdlib>
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
