// The file rendezvous store (NewFileStore).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "executor/comm/communicator.h"
#include "executor/comm/gloo_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using ::hap::testing::IsOk;

using gloo_test::FreshDir;

TEST(FileStoreTest, SetGetTimeoutAndBadDirectory) {
  std::string dir = FreshDir("store");
  auto store = NewFileStore(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Set("plan/7/rank 0", std::string("a\0b", 3)).ok());
  auto v = (*store)->Get("plan/7/rank 0", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("a\0b", 3));
  EXPECT_THAT((*store)->Get("plan/7/rank 1", absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'plan/7/rank 1'")));
  EXPECT_THAT(NewFileStore(dir + "/nope"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a writable directory")));
}

// Keys whose plain file names would be the directory itself or its parent
// ("", ".", "..") are keys like any other: absent until set (they used to
// read as present and empty at once, and could not be set).
TEST(FileStoreTest, KeysThatWouldNameADirectoryAreKeysLikeAnyOther) {
  auto store = NewFileStore(FreshDir("store_dots"));
  ASSERT_TRUE(store.ok());
  for (const std::string key : {"", ".", "..", "...", ".a"}) {
    EXPECT_THAT((*store)->Get(key, absl::ZeroDuration()),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'" + key + "'")))
        << "key '" << key << "'";
    ASSERT_THAT((*store)->Set(key, "value of '" + key + "'"), IsOk()) << "key '" << key << "'";
  }
  for (const std::string key : {"", ".", "..", "...", ".a"}) {
    auto v = (*store)->Get(key, absl::ZeroDuration());
    ASSERT_THAT(v, IsOk()) << "key '" << key << "'";
    EXPECT_EQ(*v, "value of '" + key + "'");
  }
}

// A key that cannot be read for another reason than its absence (here a
// name too long for the file system; a file of another user's alike) fails
// Get at once naming the reason, instead of waiting out the timeout and
// saying that the key did not appear.
TEST(FileStoreTest, AKeyThatCannotBeReadIsNotReportedAsAbsent) {
  auto store = NewFileStore(FreshDir("store_unreadable"));
  ASSERT_TRUE(store.ok());
  const std::string key(300, 'k');
  EXPECT_THAT((*store)->Get(key, absl::Seconds(60)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("cannot read key"), HasSubstr("File name too long"))));
}

// A key as long as a file name may be (here 250 bytes) can be set: the
// temporary file Set writes first used to carry the key in its name too,
// which made that name too long. Longer keys are refused by Set and Get
// alike, naming the reason.
TEST(FileStoreTest, AKeyAsLongAsAFileNameCanBeSet) {
  auto store = NewFileStore(FreshDir("store_long"));
  ASSERT_TRUE(store.ok());
  const std::string key(250, 'k');
  ASSERT_THAT((*store)->Set(key, "v"), IsOk());
  auto v = (*store)->Get(key, absl::ZeroDuration());
  ASSERT_THAT(v, IsOk());
  EXPECT_EQ(*v, "v");
  EXPECT_THAT((*store)->Set(std::string(300, 'k'), "v"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("File name too long")));
}

// A value the file system refuses part of (here a file size limit; a full
// disk alike) fails Set and is not published (with a buffered stream the
// write that failed was the one at close, after the stream's checks, and it
// published 16 bytes of 100).
TEST(FileStoreTest, AWriteThatFailsAtCloseFailsSetAndPublishesNothing) {
  auto store = NewFileStore(FreshDir("store_full"));
  ASSERT_TRUE(store.ok());
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit small = old;
  small.rlim_cur = 16;
  auto* previous = signal(SIGXFSZ, SIG_IGN);  // EFBIG rather than the signal
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status set = (*store)->Set("rank0", std::string(100, 'x'));
  setrlimit(RLIMIT_FSIZE, &old);  // before anything is printed
  signal(SIGXFSZ, previous);
  EXPECT_THAT(set, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot write")));
  EXPECT_THAT((*store)->Get("rank0", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'rank0'")));
}

}  // namespace
}  // namespace hap::executor
