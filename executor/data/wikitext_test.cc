#include "executor/data/wikitext.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "planner/graph/zoo.h"

namespace hap::data {
namespace {

// scripts/test.sh passes HAP_DATA_DIR=<checkout>/../shared/data.
std::string DataDir() {
  const char* d = std::getenv("HAP_DATA_DIR");
  return d ? std::string(d) + "/wikitext-2" : "";
}

TEST(WikiTextTest, VocabularyMatchesTheZooDefault) {
  std::string dir = DataDir();
  if (dir.empty() || !std::ifstream(dir + "/valid.txt")) {
    GTEST_SKIP() << "WikiText-2 not found (set HAP_DATA_DIR to ../shared/data)";
  }
  auto v = Vocabulary::Build(WikiText2Files(dir));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->size(), graph::kWikiText2Vocab);
  EXPECT_GE(v->Id("<eos>"), 0);
  EXPECT_GE(v->Id("<unk>"), 0);
  auto ids = v->Encode(dir + "/valid.txt");
  ASSERT_TRUE(ids.ok());
  // ~214k words plus one <eos> a line (3,760 lines).
  EXPECT_GT(ids->size(), 210000u);
  for (int64_t id : *ids) ASSERT_TRUE(id >= 0 && id < v->size());
}

TEST(WikiTextTest, SmallFileRoundTrip) {
  std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/t.txt";
  std::ofstream(path) << "a b a\n\nc <unk>\n";
  auto v = Vocabulary::Build({path});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->size(), 5);  // a b <eos> c <unk>
  EXPECT_EQ(v->Word(2), "<eos>");
  auto ids = v->Encode(path);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int64_t>{0, 1, 0, 2, 2, 3, 4, 2}));
  std::string other = std::string(std::getenv("TEST_TMPDIR")) + "/u.txt";
  std::ofstream(other) << "zzz a\n";
  auto enc = v->Encode(other);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ((*enc)[0], v->Id("<unk>"));
}

TEST(WikiTextTest, MissingFileIsNotFound) {
  auto v = Vocabulary::Build({"/nonexistent/valid.txt"});
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(v.status().message()).find("/nonexistent/valid.txt"),
            std::string::npos);
}

// std::ifstream opens a directory and then reads nothing: a directory
// given for valid.txt was an empty vocabulary (and an empty corpus, refused
// later as "the corpus has 0 tokens" without naming the file). A named pipe
// made the open wait for a writer forever.
TEST(WikiTextTest, ADirectoryOrAPipeIsAnErrorNamingIt) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/wikitext_dir";
  std::filesystem::create_directories(dir);
  auto v = Vocabulary::Build({dir});
  ASSERT_FALSE(v.ok()) << "a vocabulary of " << v->size() << " words from a directory";
  EXPECT_NE(std::string(v.status().message()).find(dir), std::string::npos) << v.status();
  const std::string fifo = std::string(std::getenv("TEST_TMPDIR")) + "/wikitext_fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  v = Vocabulary::Build({fifo});
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(v.status().message()).find(fifo + " is not a regular file"),
            std::string::npos)
      << v.status();
}

}  // namespace
}  // namespace hap::data
