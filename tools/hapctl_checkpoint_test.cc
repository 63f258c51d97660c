// hapctl checkpoint on a checkpoint written by the trainer (two ranks in
// process, one step).
#include "tools/hapctl_checkpoint.h"

#include <sys/stat.h>

#include <string>
#include <vector>

#include "executor/checkpoint/checkpoint_test_util.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace hap::tools {
namespace {

namespace test_util = ::hap::executor::checkpoint::test_util;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// hapctl checkpoint ARGS...; the exit code, with what it printed.
int Hapctl(const std::vector<std::string>& args, std::string* out, std::string* err) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = RunCheckpoint(args);
  *out = ::testing::internal::GetCapturedStdout();
  *err = ::testing::internal::GetCapturedStderr();
  return rc;
}

// A checkpoint of one step of the test MLP on two ranks, in `name`.
std::string Checkpoint(const std::string& name) {
  const graph::Graph g = test_util::Mlp();
  const std::string dir = test_util::Fresh(name);
  test_util::TrainAndSave(g, test_util::Programs(g, 2, "dp"), dir, 1, 1);
  return dir;
}

// inspect -o json wrote the directory between quotes as it was: a quote or
// a backslash in its name made the output no JSON.
TEST(HapctlCheckpointTest, InspectAsJsonEscapesThePath) {
  const std::string dir = Checkpoint("a \"quoted\" \\ name");
  std::string out, err;
  ASSERT_EQ(Hapctl({"inspect", dir, "-o", "json"}, &out, &err), 0) << err;
  google::protobuf::Struct json;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(out, &json).ok()) << out;
  EXPECT_THAT(json.fields().at("path").string_value(), StartsWith(dir));
  EXPECT_TRUE(json.fields().at("trainer").has_struct_value()) << out;
  EXPECT_TRUE(json.fields().at("index").has_struct_value()) << out;
}

// Another -o is refused naming it, before the checkpoint is read (a
// missing one was reported instead).
TEST(HapctlCheckpointTest, InspectRefusesAnotherFormatNamingIt) {
  std::string out, err;
  EXPECT_EQ(Hapctl({"inspect", test_util::Fresh("none"), "-o", "yaml"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("-o must be table or json, got 'yaml'"));
  EXPECT_EQ(out, "");
}

// A flag another checkpoint command takes is refused, not dropped.
TEST(HapctlCheckpointTest, AnotherCommandsFlagIsRefused) {
  const std::string dir = test_util::Fresh("none");
  for (const auto& [args, error] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"verify", dir, "-o", "json"}, "checkpoint verify has no -o"},
           {{"inspect", dir, "--with-optimizer-state"}, "--with-optimizer-state is export's"},
           {{"verify", dir, "--with-optimizer-state"}, "--with-optimizer-state is export's"}}) {
    std::string out, err;
    EXPECT_EQ(Hapctl(args, &out, &err), 1) << args[0];
    EXPECT_THAT(err, HasSubstr(error)) << args[0];
  }
}

// export -o a path that is no regular file: the export was renamed over it
// (a named pipe, '/dev/stdout', as root '/dev/null' became a regular file)
// and 'wrote' said the export went there. Refused; the path is as it was.
TEST(HapctlCheckpointTest, ExportRefusesAnOutputThatIsNoRegularFile) {
  const std::string dir = Checkpoint("export-to-a-pipe");
  const std::string fifo = test_util::Fresh("pipe.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string out, err;
  EXPECT_EQ(Hapctl({"export", dir, "-o", fifo}, &out, &err), 1) << out;
  EXPECT_THAT(err, HasSubstr("-o " + fifo + " is not a regular file"));
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // A directory as well; a regular file is replaced, as before.
  const std::string a_dir = test_util::Fresh("a-dir");
  ASSERT_EQ(::mkdir(a_dir.c_str(), 0700), 0);
  EXPECT_EQ(Hapctl({"export", dir, "-o", a_dir}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("is a directory"));
  const std::string file = test_util::Fresh("out.safetensors");
  ASSERT_EQ(Hapctl({"export", dir, "-o", file}, &out, &err), 0) << err;
  ASSERT_EQ(Hapctl({"export", dir, "-o", file}, &out, &err), 0) << err;
  EXPECT_THAT(out, HasSubstr("wrote " + file));
}

}  // namespace
}  // namespace hap::tools
