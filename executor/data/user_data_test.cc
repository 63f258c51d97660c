#include "executor/data/user_data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "executor/data/batches.h"
#include "executor/data/npy_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"
#include "planner/graph/zoo.h"

namespace hap::data {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using npy_files::Npy;
using npy_files::Raw;
using npy_files::WriteFile;

// A fresh directory under $TEST_TMPDIR, one per test.
std::string TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string dir =
      std::string(std::getenv("TEST_TMPDIR")) + "/" + info->test_suite_name() + "." + info->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// --- Graphs ---------------------------------------------------------------

// x f32[4, 3], labels i64[4] (cross_entropy over 5 classes).
graph::Graph Mlp(int64_t batch = 4) {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 1}, {"hidden", 4}, {"input", 3}, {"classes", 5}, {"batch", batch}});
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

// tokens i64[2, 4], labels i64[8] (vocabulary 50).
graph::Graph Gpt() {
  auto g = graph::BuildZooModel("gpt", {{"layers", 1},
                                        {"hidden", 8},
                                        {"heads", 2},
                                        {"ffn", 16},
                                        {"seq", 4},
                                        {"vocab", 50},
                                        {"batch", 2}});
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

// "enc/x" f32[4, 5], "ids" i32[4] (embedding of 7 rows), labels i64[4]
// (5 classes); `clash` adds an input "enc__x" mapping to the same file.
graph::Graph Custom(bool clash = false) {
  graph::GraphBuilder b("custom");
  graph::TensorId x = b.Input("enc/x", graph::F32({4, 5}));
  graph::TensorId ids = b.Input("ids", {graph::DType::kInt32, {4}});
  graph::TensorId y = b.Input("labels", graph::I64({4}), graph::InputRole::kLabels);
  graph::TensorId table =
      b.Parameter("table", graph::F32({7, 5}), graph::Initializer::Normal(0, 1));
  graph::TensorId logits = b.Add("add", "sum", {x, b.Add("embedding", "emb", {ids, table})});
  if (clash) logits = b.Add("add", "sum2", {logits, b.Input("enc__x", graph::F32({4, 5}))});
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, y}));
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

// Sample i of an Mlp data set: x = (10 i, 10 i + 1, 10 i + 2), label i % 5.
void WriteMlpData(const std::string& dir, int64_t n, const std::string& label_descr = "<i8") {
  std::vector<float> x;
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 3; ++k) x.push_back(static_cast<float>(10 * i + k));
  }
  WriteFile(dir + "/x.npy", Npy("<f4", {n, 3}, Raw(x)));
  std::vector<int64_t> l64;
  std::vector<int32_t> l32;
  std::vector<uint8_t> l8;
  for (int64_t i = 0; i < n; ++i) {
    l64.push_back(i % 5);
    l32.push_back(static_cast<int32_t>(i % 5));
    l8.push_back(static_cast<uint8_t>(i % 5));
  }
  std::string data = label_descr == "<i8" ? Raw(l64) : label_descr == "<i4" ? Raw(l32) : Raw(l8);
  WriteFile(dir + "/labels.npy", Npy(label_descr, {n}, data));
}

// The samples a batch of the Mlp data holds, decoded from x.
std::vector<int64_t> MlpSamples(const GlobalBatch& b) {
  std::vector<int64_t> s;
  const HostTensor& x = b.at("x");
  const HostTensor& l = b.at("labels");
  for (int64_t j = 0; j < x.shape()[0]; ++j) {
    int64_t i = static_cast<int64_t>(x.as<float>()[j * 3]) / 10;
    EXPECT_EQ(x.as<float>()[j * 3 + 2], static_cast<float>(10 * i + 2));
    EXPECT_EQ(l.as<int64_t>()[j], i % 5);
    s.push_back(i);
  }
  return s;
}

std::unique_ptr<UserData> MustOpen(const std::string& spec, const graph::Graph& g,
                                   DataOptions o = {}) {
  auto d = OpenUserDataSet(spec, g, o);
  EXPECT_THAT(d, IsOk());
  return d.ok() ? *std::move(d) : nullptr;
}

std::vector<int64_t> StepSamples(UserData& d, int64_t step) {
  auto b = d.Get(step);
  EXPECT_THAT(b, IsOk());
  return b.ok() ? MlpSamples(*b) : std::vector<int64_t>{};
}

// --- npy: values and order --------------------------------------------------

TEST(NpyFileNameTest, SlashesBecomeDoubleUnderscores) {
  EXPECT_EQ(NpyFileName("x"), "x.npy");
  EXPECT_EQ(NpyFileName("enc/block0/x"), "enc__block0__x.npy");
}

TEST(UserDataNpyTest, StepsReadSamplesInOrderAndWrapAround) {
  std::string dir = TestDir();
  WriteMlpData(dir, 10);
  graph::Graph g = Mlp();
  auto d = MustOpen("npy:" + dir, g);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->num_samples(), 10);
  EXPECT_EQ(d->batch_size(), 4);
  EXPECT_THAT(d->Describe(), HasSubstr("10 samples"));
  auto b0 = d->Get(0);
  ASSERT_THAT(b0, IsOk());
  ASSERT_EQ(b0->size(), 2u);
  const HostTensor& x = b0->at("x");
  EXPECT_EQ(x.dtype(), graph::DType::kFloat32);
  EXPECT_EQ(x.shape(), (graph::Shape{4, 3}));
  std::vector<float> want_x = {0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32};
  EXPECT_EQ(std::vector<float>(x.as<float>(), x.as<float>() + 12), want_x);
  EXPECT_EQ(b0->at("labels").dtype(), graph::DType::kInt64);
  EXPECT_EQ(MlpSamples(*b0), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(StepSamples(*d, 1), (std::vector<int64_t>{4, 5, 6, 7}));
  // Positions 8..11 and 20..23 of a 10-sample epoch.
  EXPECT_EQ(StepSamples(*d, 2), (std::vector<int64_t>{8, 9, 0, 1}));
  EXPECT_EQ(StepSamples(*d, 5), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(StepSamples(*d, 1000001), (std::vector<int64_t>{4, 5, 6, 7}));
}

TEST(UserDataNpyTest, ConvertsIntegerAndFloatFileDtypes) {
  for (const char* label_descr : {"<i4", "|u1"}) {
    std::string dir = TestDir();
    WriteMlpData(dir, 8, label_descr);
    // x as float64: rounded to the f32 input.
    std::vector<double> x;
    for (int i = 0; i < 24; ++i) x.push_back(i + 0.25);
    WriteFile(dir + "/x.npy", Npy("<f8", {8, 3}, Raw(x)));
    graph::Graph g = Mlp();
    auto d = MustOpen("npy:" + dir, g);
    ASSERT_NE(d, nullptr);
    auto b = d->Get(1);
    ASSERT_THAT(b, IsOk());
    EXPECT_EQ(b->at("x").as<float>()[0], 12.25f);
    EXPECT_EQ(b->at("x").as<float>()[11], 23.25f);
    const HostTensor& l = b->at("labels");
    EXPECT_EQ(std::vector<int64_t>(l.as<int64_t>(), l.as<int64_t>() + 4),
              (std::vector<int64_t>{4, 0, 1, 2}))
        << label_descr;
  }
}

TEST(UserDataNpyTest, BoolFilesFeedIntegerInputsAsZeroAndOne) {
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  std::vector<uint8_t> mask = {1, 0, 0, 1, 1, 1, 0, 0};
  WriteFile(dir + "/labels.npy", Npy("|b1", {8}, Raw(mask)));
  graph::Graph g = Mlp();
  auto d = MustOpen("npy:" + dir, g);
  ASSERT_NE(d, nullptr);
  auto b = d->Get(1);
  ASSERT_THAT(b, IsOk());
  const HostTensor& l = b->at("labels");
  EXPECT_EQ(std::vector<int64_t>(l.as<int64_t>(), l.as<int64_t>() + 4),
            (std::vector<int64_t>{1, 1, 0, 0}));
  // Not for float inputs.
  WriteFile(dir + "/x.npy", Npy("|b1", {8, 3}, std::string(24, '\1')));
  EXPECT_THAT(OpenUserDataSet("npy:" + dir, g, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x.npy")));
}

TEST(UserDataNpyTest, ReadsFormatVersions2And3) {
  for (int major : {2, 3}) {
    std::string dir = TestDir();
    WriteMlpData(dir, 4);
    std::vector<float> x(12, 1.5f);
    WriteFile(dir + "/x.npy", Npy("<f4", {4, 3}, Raw(x), major));
    graph::Graph g = Mlp();
    auto d = MustOpen("npy:" + dir, g);
    ASSERT_NE(d, nullptr);
    auto b = d->Get(0);
    ASSERT_THAT(b, IsOk());
    EXPECT_EQ(b->at("x").as<float>()[5], 1.5f);
  }
}

TEST(UserDataNpyTest, SlashedNamesAndInt32Inputs) {
  std::string dir = TestDir();
  std::vector<float> x(6 * 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  WriteFile(dir + "/enc__x.npy", Npy("<f4", {6, 5}, Raw(x)));
  WriteFile(dir + "/ids.npy", Npy("<i8", {6}, Raw(std::vector<int64_t>{6, 5, 4, 3, 2, 1})));
  WriteFile(dir + "/labels.npy", Npy("<i8", {6}, Raw(std::vector<int64_t>{0, 1, 2, 3, 4, 0})));
  graph::Graph g = Custom();
  auto d = MustOpen("npy:" + dir, g);
  ASSERT_NE(d, nullptr);
  auto b = d->Get(1);  // positions 4, 5, 0, 1
  ASSERT_THAT(b, IsOk());
  const HostTensor& ids = b->at("ids");
  EXPECT_EQ(ids.dtype(), graph::DType::kInt32);
  EXPECT_EQ(std::vector<int32_t>(ids.as<int32_t>(), ids.as<int32_t>() + 4),
            (std::vector<int32_t>{2, 1, 6, 5}));
  EXPECT_EQ(b->at("enc/x").as<float>()[0], 20.0f);
}

TEST(UserDataNpyTest, InputsWithSeveralRowsPerSample) {
  // gpt: tokens[2, 4] one row a sample, labels[8] four rows a sample.
  std::string dir = TestDir();
  std::vector<int32_t> tokens;
  std::vector<int64_t> labels;
  for (int i = 0; i < 3 * 4; ++i) {
    tokens.push_back(i);
    labels.push_back(i + 1);
  }
  WriteFile(dir + "/tokens.npy", Npy("<i4", {3, 4}, Raw(tokens)));
  WriteFile(dir + "/labels.npy", Npy("<i8", {3, 4}, Raw(labels)));
  graph::Graph g = Gpt();
  auto d = MustOpen("npy:" + dir, g);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->batch_size(), 2);
  auto b = d->Get(1);  // samples 2, 0
  ASSERT_THAT(b, IsOk());
  const HostTensor& l = b->at("labels");
  EXPECT_EQ(l.shape(), (graph::Shape{8}));
  EXPECT_EQ(std::vector<int64_t>(l.as<int64_t>(), l.as<int64_t>() + 8),
            (std::vector<int64_t>{9, 10, 11, 12, 1, 2, 3, 4}));
  EXPECT_EQ(b->at("tokens").as<int64_t>()[3], 11);

  // labels as (N * 4,) is refused: dim 0 counts samples.
  WriteFile(dir + "/labels.npy", Npy("<i8", {12}, Raw(labels)));
  EXPECT_THAT(OpenUserData("npy:" + dir, g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("shape (12,), expected (12, 4)"),
                             HasSubstr("4 rows of the input per sample"))));
}

// --- Shuffling ---------------------------------------------------------------

TEST(UserDataShuffleTest, EachEpochIsAPermutationAndEpochsDiffer) {
  std::string dir = TestDir();
  WriteMlpData(dir, 12);
  graph::Graph g = Mlp();
  auto d = MustOpen("npy:" + dir, g, DataOptions{7});
  ASSERT_NE(d, nullptr);
  std::vector<std::vector<int64_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    std::vector<int64_t> order;
    for (int s = 0; s < 3; ++s) {
      for (int64_t i : StepSamples(*d, 3 * e + s)) order.push_back(i);
    }
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(12);
    for (int i = 0; i < 12; ++i) all[i] = i;
    EXPECT_EQ(sorted, all) << "epoch " << e;
    EXPECT_NE(order, all) << "epoch " << e;
    epochs.push_back(order);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
}

TEST(UserDataShuffleTest, BatchesSpanningEpochsAreStillPermutations) {
  std::string dir = TestDir();
  WriteMlpData(dir, 10);
  graph::Graph g = Mlp();
  auto d = MustOpen("npy:" + dir, g, DataOptions{3});
  ASSERT_NE(d, nullptr);
  std::vector<int64_t> positions;  // 5 steps of 4 = 2 epochs of 10
  for (int s = 0; s < 5; ++s) {
    for (int64_t i : StepSamples(*d, s)) positions.push_back(i);
  }
  for (int e = 0; e < 2; ++e) {
    std::set<int64_t> seen(positions.begin() + 10 * e, positions.begin() + 10 * (e + 1));
    EXPECT_EQ(seen.size(), 10u) << "epoch " << e;
  }
}

TEST(UserDataShuffleTest, DependsOnlyOnSeedAndStep) {
  std::string dir = TestDir();
  WriteMlpData(dir, 12);
  graph::Graph g = Mlp();
  auto a = MustOpen("npy:" + dir, g, DataOptions{42});
  auto b = MustOpen("npy:" + dir, g, DataOptions{42});
  auto c = MustOpen("npy:" + dir, g, DataOptions{43});
  ASSERT_TRUE(a && b && c);
  // b is asked in another order (as a resumed run would): same batches.
  std::vector<std::vector<int64_t>> from_b(8);
  for (int s : {7, 3, 0, 5, 1, 6, 2, 4}) from_b[s] = StepSamples(*b, s);
  bool differs_from_c = false;
  for (int s = 0; s < 8; ++s) {
    std::vector<int64_t> sa = StepSamples(*a, s);
    EXPECT_EQ(sa, from_b[s]) << "step " << s;
    EXPECT_EQ(sa, StepSamples(*a, s)) << "step " << s;
    differs_from_c |= sa != StepSamples(*c, s);
  }
  EXPECT_TRUE(differs_from_c);
  // Pinned: a change to the permutation changes what a resumed run reads.
  std::vector<int64_t> epoch0;
  for (int st = 0; st < 3; ++st) {
    for (int64_t i : StepSamples(*a, st)) epoch0.push_back(i);
  }
  EXPECT_EQ(epoch0, (std::vector<int64_t>{2, 4, 11, 3, 8, 10, 7, 6, 9, 1, 0, 5}));
}

TEST(UserDataShuffleTest, FirstSampleOfAnEpochIsRoughlyUniform) {
  std::string dir = TestDir();
  WriteMlpData(dir, 10);
  graph::Graph g = Mlp(/*batch=*/2);
  auto d = MustOpen("npy:" + dir, g, DataOptions{11});
  ASSERT_NE(d, nullptr);
  std::map<int64_t, int> count;
  for (int e = 0; e < 2000; ++e) ++count[StepSamples(*d, 5 * e)[0]];
  ASSERT_EQ(count.size(), 10u);
  for (const auto& [sample, n] : count) {
    EXPECT_GT(n, 140) << sample;  // expectation 200, sd ~13
    EXPECT_LT(n, 260) << sample;
  }
}

TEST(UserDataShuffleTest, OneSampleAndHugeSteps) {
  std::string dir = TestDir();
  WriteMlpData(dir, 1);
  graph::Graph g = Mlp(/*batch=*/1);
  auto d = MustOpen("npy:" + dir, g, DataOptions{5});
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(StepSamples(*d, 123456789), (std::vector<int64_t>{0}));
  EXPECT_THAT(d->Get(-1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
  EXPECT_THAT(d->Get(std::numeric_limits<int64_t>::max()),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("overflows")));
}

// --- tokens: ------------------------------------------------------------------

TEST(UserDataTokensTest, NonOverlappingShiftedWindows) {
  for (const char* dtype : {"", ":uint16", ":uint32"}) {
    std::string dir = TestDir();
    std::string path = dir + "/train.bin";
    const int ntokens = 5 * 4 + 3;  // 5 windows of 4 + 1, 2 tokens left over
    if (std::string(dtype) == ":uint32") {
      std::vector<uint32_t> t;
      for (int i = 0; i < ntokens; ++i) t.push_back(static_cast<uint32_t>(i * 2));
      WriteFile(path, Raw(t));
    } else {
      std::vector<uint16_t> t;
      for (int i = 0; i < ntokens; ++i) t.push_back(static_cast<uint16_t>(i * 2));
      WriteFile(path, Raw(t));
    }
    graph::Graph g = Gpt();
    auto d = MustOpen("tokens:" + path + dtype, g);
    ASSERT_NE(d, nullptr);
    EXPECT_EQ(d->num_samples(), 5) << dtype;
    EXPECT_EQ(d->batch_size(), 2);
    auto b = d->Get(0);
    ASSERT_THAT(b, IsOk());
    const HostTensor& tokens = b->at("tokens");
    const HostTensor& labels = b->at("labels");
    EXPECT_EQ(tokens.shape(), (graph::Shape{2, 4}));
    EXPECT_EQ(labels.shape(), (graph::Shape{8}));
    EXPECT_EQ(std::vector<int64_t>(tokens.as<int64_t>(), tokens.as<int64_t>() + 8),
              (std::vector<int64_t>{0, 2, 4, 6, 8, 10, 12, 14}));
    EXPECT_EQ(std::vector<int64_t>(labels.as<int64_t>(), labels.as<int64_t>() + 8),
              (std::vector<int64_t>{2, 4, 6, 8, 10, 12, 14, 16}));
    auto b2 = d->Get(2);  // samples 4, then 0 (wrapped)
    ASSERT_THAT(b2, IsOk());
    EXPECT_EQ(
        std::vector<int64_t>(b2->at("tokens").as<int64_t>(), b2->at("tokens").as<int64_t>() + 8),
        (std::vector<int64_t>{32, 34, 36, 38, 0, 2, 4, 6}));
    EXPECT_EQ(b2->at("labels").as<int64_t>()[3], 40);
  }
}

TEST(UserDataTokensTest, ShuffledWindowsArePermutations) {
  std::string dir = TestDir();
  std::vector<uint16_t> t;
  for (int i = 0; i < 6 * 4 + 1; ++i) t.push_back(static_cast<uint16_t>(i));
  WriteFile(dir + "/t.bin", Raw(t));
  graph::Graph g = Gpt();
  auto d = MustOpen("tokens:" + dir + "/t.bin", g, DataOptions{9});
  ASSERT_NE(d, nullptr);
  std::set<int64_t> windows;
  for (int s = 0; s < 3; ++s) {
    auto b = d->Get(s);
    ASSERT_THAT(b, IsOk());
    for (int j = 0; j < 2; ++j) {
      const int64_t* row = b->at("tokens").as<int64_t>() + 4 * j;
      EXPECT_EQ(row[0] % 4, 0);
      EXPECT_EQ(b->at("labels").as<int64_t>()[4 * j + 3], row[3] + 1);
      windows.insert(row[0] / 4);
    }
  }
  EXPECT_EQ(windows, (std::set<int64_t>{0, 1, 2, 3, 4, 5}));
}

// --- Errors -------------------------------------------------------------------

absl::Status OpenNpyStatus(const std::string& dir, const graph::Graph& g) {
  return OpenUserData("npy:" + dir, g, {}).status();
}

TEST(UserDataErrorsTest, BadSpecs) {
  graph::Graph g = Mlp();
  for (const char* spec : {"", "csv:/tmp/x", "/tmp/x", "npy", "NPY:/tmp"}) {
    EXPECT_THAT(OpenUserData(spec, g, {}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("npy:DIR or tokens:FILE[:uint16|uint32]")))
        << spec;
  }
  EXPECT_THAT(OpenUserData("npy:", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names no directory")));
  EXPECT_THAT(OpenUserData("tokens:", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names no file")));
  EXPECT_THAT(OpenUserData("tokens:/tmp/x.bin:int32", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("token dtype 'int32' is not uint16 or uint32")));
}

TEST(UserDataErrorsTest, MissingDirectoryAndFiles) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  EXPECT_THAT(OpenNpyStatus(dir + "/nope", g),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("data directory " + dir + "/nope does not exist")));
  WriteFile(dir + "/plain", "x");
  EXPECT_THAT(OpenNpyStatus(dir + "/plain", g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not a directory")));
  WriteMlpData(dir, 8);
  std::filesystem::remove(dir + "/labels.npy");
  EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kNotFound,
                                              AllOf(HasSubstr("graph input 'labels'"),
                                                    HasSubstr("expected " + dir + "/labels.npy"))));
  // A slashed name says which file it wanted.
  EXPECT_THAT(OpenNpyStatus(dir, Custom()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir + "/enc__x.npy")));
  EXPECT_THAT(OpenNpyStatus(dir, Custom(/*clash=*/true)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'enc/x' and 'enc__x' both map to the file enc__x.npy")));
}

TEST(UserDataErrorsTest, WrongDtypes) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  WriteFile(dir + "/x.npy", Npy("|u1", {8, 3}, std::string(24, '\1')));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(dir + "/x.npy"), HasSubstr("integer dtype '|u1'"),
                             HasSubstr("float"))));
  WriteMlpData(dir, 8);
  WriteFile(dir + "/labels.npy", Npy("<f4", {8}, Raw(std::vector<float>(8, 1.0f))));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("labels.npy"), HasSubstr("dtype '<f4' for an integer"))));
  WriteFile(dir + "/labels.npy", Npy("<f2", {8}, std::string(16, '\0')));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'<f2'")));
  WriteMlpData(dir, 8);
  WriteFile(dir + "/x.npy", Npy("<f2", {8, 3}, std::string(48, '\0')));
  EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("save it as float32 or float64")));
  WriteFile(dir + "/x.npy", Npy("<c8", {8, 3}, std::string(192, '\0')));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unsupported dtype '<c8'")));
  WriteFile(dir + "/x.npy", Npy(">f4", {8, 3}, std::string(96, '\0')));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("big-endian dtype '>f4'")));
}

TEST(UserDataErrorsTest, WrongShapesAndCounts) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  WriteFile(dir + "/x.npy", Npy("<f4", {8, 4}, Raw(std::vector<float>(32))));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("x.npy"), HasSubstr("shape (8, 4), expected (8, 3)"))));
  WriteFile(dir + "/x.npy", Npy("<f4", {24}, Raw(std::vector<float>(24))));
  EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("shape (24,), expected (24, 3)")));
  WriteFile(dir + "/x.npy", Npy("<f4", {}, Raw(std::vector<float>(1))));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a 0-d array")));
  WriteFile(dir + "/x.npy", Npy("<f4", {9, 3}, Raw(std::vector<float>(27))));
  EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kInvalidArgument,
                                              AllOf(HasSubstr("disagree on the number of samples"),
                                                    HasSubstr("holds 9"), HasSubstr("holds 8"))));
  WriteMlpData(dir, 3);
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holds 3 samples, fewer than one global batch of 4")));
}

TEST(UserDataErrorsTest, LabelsAndIdsOutOfRange) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  std::vector<int64_t> labels = {0, 1, 2, 3, 4, 0, 1, 5};
  WriteFile(dir + "/labels.npy", Npy("<i8", {8}, Raw(labels)));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(dir + "/labels.npy"),
                             HasSubstr("row 7 holds 5, outside [0, 5), the 5 classes of "
                                       "cross_entropy 'loss'"))));
  labels[2] = -1;
  WriteFile(dir + "/labels.npy", Npy("<i8", {8}, Raw(labels)));
  EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("row 2 holds -1, outside [0, 5)")));
  std::vector<uint64_t> huge(8, 1);
  huge[4] = ~uint64_t{0};
  WriteFile(dir + "/labels.npy", Npy("<u8", {8}, Raw(huge)));
  EXPECT_THAT(OpenNpyStatus(dir, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("row 4 holds 18446744073709551615, outside [0, 5)")));
  // A row of several ids names the element too.
  std::vector<int64_t> tokens(3 * 4, 1), next(3 * 4, 1);
  tokens[6] = 50;
  WriteFile(dir + "/tokens.npy", Npy("<i8", {3, 4}, Raw(tokens)));
  WriteFile(dir + "/labels.npy", Npy("<i8", {3, 4}, Raw(next)));
  EXPECT_THAT(OpenNpyStatus(dir, Gpt()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tokens.npy"),
                             HasSubstr("row 1, element 2 holds 50, outside [0, 50), the "
                                       "vocabulary of 50 of embedding"))));
}

TEST(UserDataErrorsTest, MalformedAndTruncatedFiles) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  const std::string good = Npy("<f4", {8, 3}, Raw(std::vector<float>(24)));
  auto expect = [&](const std::string& bytes, const std::string& what) {
    WriteFile(dir + "/x.npy", bytes);
    EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kInvalidArgument,
                                                AllOf(HasSubstr(dir + "/x.npy"), HasSubstr(what))))
        << what;
  };
  expect(good.substr(0, good.size() - 1),
         "truncated: shape (8, 3) of '<f4' needs 96 bytes of data after the 128-byte header, "
         "the file holds 95");
  expect(good.substr(0, 40), "truncated: the header needs 128 bytes, the file holds 40");
  expect(good.substr(0, 9), "shorter than the .npy preamble");
  expect("", "empty file");
  expect("PK\3\4 a zip, say", "not a .npy file");
  std::string v4 = good;
  v4[6] = 4;
  expect(v4, "unsupported .npy format version 4.0");
  expect(Npy("<f4", {8, 3}, Raw(std::vector<float>(24)), 1, /*fortran=*/true),
         "fortran_order is True");
  std::string garbled = good;
  garbled.replace(garbled.find("(8, 3)"), 1, "{");
  expect(garbled, "malformed .npy header");
  std::string bare_minus = good;  // "(8, 3)" -> "(-, 3)"
  bare_minus.replace(bare_minus.find("(8, 3)") + 1, 1, "-");
  expect(bare_minus, "'-' without digits");
  std::string structured = Npy("[('a', '<f4')]", {8, 3}, Raw(std::vector<float>(24)));
  structured.replace(structured.find("'[('a', '<f4')]'"), 16, "[('a', '<f4')]  ");
  expect(structured, "a structured dtype");
}

// A NaN or inf in float data, or a float64 past float32's range for a
// float32 input (it became inf), is refused at open naming the file, row and
// element; before, it showed only as a NaN loss at some step.
TEST(UserDataErrorsTest, FloatDataThatIsNotFiniteIsRefusedNamingTheElement) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  auto expect = [&](const std::string& bytes, const std::string& what) {
    WriteFile(dir + "/x.npy", bytes);
    EXPECT_THAT(OpenNpyStatus(dir, g), StatusIs(absl::StatusCode::kInvalidArgument,
                                                AllOf(HasSubstr(dir + "/x.npy"), HasSubstr(what),
                                                      HasSubstr("training data must be finite"))))
        << what;
  };
  std::vector<float> f(24, 1.0f);
  f[7] = std::numeric_limits<float>::quiet_NaN();
  expect(Npy("<f4", {8, 3}, Raw(f)), "row 2, element 1 holds nan");
  f[7] = 1.0f;
  f[23] = -std::numeric_limits<float>::infinity();
  expect(Npy("<f4", {8, 3}, Raw(f)), "row 7, element 2 holds -inf");
  std::vector<double> d(24, 1.0);
  d[4] = 1e300;
  expect(Npy("<f8", {8, 3}, Raw(d)), "row 1, element 1 holds 1e+300, beyond f32's range");
  // Finite data of each width opens.
  d[4] = 1e30;
  WriteFile(dir + "/x.npy", Npy("<f8", {8, 3}, Raw(d)));
  EXPECT_THAT(OpenNpyStatus(dir, g), IsOk());
}

// f2 files feed only f16 inputs (CheckDType), so the half branch of the
// finite check is reached through a graph with an f16 input: inf, -inf and
// nan (any mantissa) are refused naming the element; 65504, f16's largest
// finite value, and subnormals open.
TEST(UserDataErrorsTest, HalfDataThatIsNotFiniteIsRefusedNamingTheElement) {
  graph::GraphBuilder b("half");
  graph::TensorId x = b.Input("x", {graph::DType::kFloat16, {4, 5}});
  graph::TensorId y = b.Input("labels", graph::I64({4}), graph::InputRole::kLabels);
  graph::TensorId bias =
      b.Parameter("bias", {graph::DType::kFloat16, {4, 5}}, graph::Initializer::Normal(0, 1));
  b.SetLoss(b.Add("cross_entropy", "loss", {b.Add("add", "sum", {x, bias}), y}));
  auto g = b.Build();
  ASSERT_THAT(g, IsOk());
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  auto open_with = [&](const std::vector<uint16_t>& halves) {
    WriteFile(dir + "/x.npy", Npy("<f2", {8, 5}, Raw(halves)));
    return OpenNpyStatus(dir, *g);
  };
  std::vector<uint16_t> h(40, 0x3C00);  // 1.0
  h[0] = 0x7BFF;                        // 65504
  h[1] = 0x0001;                        // the smallest subnormal
  h[2] = 0xFBFF;                        // -65504
  EXPECT_THAT(open_with(h), IsOk());
  for (const auto& [bits, what] :
       std::vector<std::pair<uint16_t, std::string>>{{0x7C00, "holds inf"},
                                                     {0xFC00, "holds -inf"},
                                                     {0x7E00, "holds nan"},
                                                     {0xFC01, "holds nan"}}) {
    std::vector<uint16_t> bad = h;
    bad[21] = bits;
    EXPECT_THAT(open_with(bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(dir + "/x.npy"), HasSubstr("row 4, element 1 " + what),
                               HasSubstr("training data must be finite"))))
        << what;
  }
}

TEST(UserDataErrorsTest, TokenFiles) {
  graph::Graph g = Gpt();
  std::string dir = TestDir();
  EXPECT_THAT(OpenUserData("tokens:" + dir + "/none.bin", g, {}),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("token file " + dir + "/none.bin does not exist")));
  std::vector<uint16_t> t(2 * 4 + 1, 3);
  WriteFile(dir + "/t.bin", Raw(t).substr(0, 17));
  EXPECT_THAT(OpenUserData("tokens:" + dir + "/t.bin", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("17 bytes is not a whole number of uint16 tokens")));
  WriteFile(dir + "/t.bin", Raw(std::vector<uint16_t>(8, 3)));
  EXPECT_THAT(OpenUserData("tokens:" + dir + "/t.bin", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holds 8 uint16 tokens, 1 windows of 4 + 1, fewer than one "
                                 "global batch of 2")));
  t[5] = 50;
  WriteFile(dir + "/t.bin", Raw(t));
  EXPECT_THAT(OpenUserData("tokens:" + dir + "/t.bin", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(dir + "/t.bin: token 5 (window 1) is 50"),
                             HasSubstr("outside [0, 50)"))));
  // uint32 reading of the same file: 4 tokens, too few.
  EXPECT_THAT(OpenUserData("tokens:" + dir + "/t.bin:uint32", g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bytes is not a whole number of uint32 tokens")));
  EXPECT_THAT(OpenUserData("tokens:" + dir + "/t.bin", Mlp(), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not a language model with integer inputs tokens[B, S]")));
}

// --- what a review found unchecked (each failed before its fix) ---------------

// 1. A '|b1' file feeding a bounded integer input skips the range check:
// FirstOutside has no case for kind 'b', so a bool byte of 7 becomes label 7
// of a 5-class loss (or an id outside a 2-row padding-mask table).
TEST(DataValidationTest, BoolFileValuesAreRangeChecked) {
  std::string dir = TestDir();
  WriteFile(dir + "/x.npy", Npy("<f4", {4, 3}, Raw(std::vector<float>(12, 1.0f))));
  WriteFile(dir + "/labels.npy", Npy("|b1", {4}, Raw(std::vector<uint8_t>{1, 0, 7, 1})));
  graph::Graph g = Mlp();
  auto d = OpenUserDataSet("npy:" + dir, g, {});
  // Named as what it is: not a bool (an input of any range gets the same).
  EXPECT_THAT(d.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                   AllOf(HasSubstr("labels.npy"), HasSubstr("row 2 holds 7"),
                                         HasSubstr("not a bool's byte (0 or 1)"))));
  if (d.ok()) {
    auto b = (*d)->Get(0);
    ASSERT_TRUE(b.ok());
    ADD_FAILURE() << "opened; step 0's label 2 is " << b->at("labels").as<int64_t>()[2]
                  << ", outside the 5 classes";
  }
}

// 2. A named pipe where a data file should be: MappedFile::Open calls
// open(O_RDONLY) before checking S_ISREG, which blocks until a writer comes.
TEST(DataValidationTest, FifoIsRefusedWithoutHanging) {
  std::string dir = TestDir();
  std::string fifo = dir + "/t.bin";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  graph::Graph g = Gpt();
  auto fut = std::async(std::launch::async,
                        [&] { return OpenUserData("tokens:" + fifo, g, {}).status(); });
  if (fut.wait_for(std::chrono::seconds(3)) != std::future_status::ready) {
    ADD_FAILURE() << "OpenUserData(tokens:FIFO) hangs in open()";
    // Release it: a writer end lets the blocked open return.
    for (int i = 0;
         i < 100 && fut.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready; ++i) {
      int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (w >= 0) ::close(w);
    }
  }
  EXPECT_THAT(fut.get(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not a regular file")));
}

// 3. Labels reach the loss through a reshape (labels.view(-1), as the FX
// exporter writes it, and the tokens: form labels[B, S]): IntegerInputLimit
// looks only at direct consumers, so the range of the loss's classes is not
// checked at all (README: "label range checked against the graph").
TEST(DataValidationTest, LabelsReshapedIntoTheLossAreRangeChecked) {
  graph::GraphBuilder b("reshaped_labels");
  graph::TensorId x = b.Input("x", graph::F32({8, 5}));
  graph::TensorId y = b.Input("labels", graph::I64({4, 2}), graph::InputRole::kLabels);
  graph::TensorId w = b.Parameter("w", graph::F32({8, 5}), graph::Initializer::Normal(0, 1));
  graph::TensorId logits = b.Add("add", "logits", {x, w});
  graph::TensorId flat = b.Add("reshape", "labels/flat", {y}, {{"shape", std::vector<int64_t>{8}}});
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, flat}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();

  std::string dir = TestDir();
  WriteFile(dir + "/x.npy", Npy("<f4", {4, 2, 5}, Raw(std::vector<float>(40, 0.5f))));
  WriteFile(dir + "/labels.npy",
            Npy("<i8", {4, 2}, Raw(std::vector<int64_t>{0, 1, 2, 3, 4, 99, 0, 1})));
  EXPECT_THAT(
      OpenUserData("npy:" + dir, *g, {}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("labels.npy"), HasSubstr("99"), HasSubstr("outside [0, 5)"))));
}

// tokens i64[2, 4] -> embedding of 50 rows of 10 -> [8, 10] logits:
// cross_entropy over 10 classes with labels `labels_dtype`[8].
graph::Graph LmWithFewerClasses(graph::DType labels_dtype = graph::DType::kInt64) {
  graph::GraphBuilder b("lm10");
  graph::TensorId t = b.Input("tokens", graph::I64({2, 4}));
  graph::TensorId y = b.Input("labels", {labels_dtype, {8}}, graph::InputRole::kLabels);
  graph::TensorId table =
      b.Parameter("table", graph::F32({50, 10}), graph::Initializer::Normal(0, 1));
  graph::TensorId e = b.Add("embedding", "emb", {t, table});
  graph::TensorId logits = b.Add("reshape", "flat", {e}, {{"shape", std::vector<int64_t>{8, 10}}});
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, y}));
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

// 4. NewLmBatches checks the corpus against the tokens' vocabulary only;
// every corpus token is also a label, and the loss has 10 classes. (The
// tokens: reader takes the tighter of both bounds.)
TEST(DataValidationTest, LmCorpusIsCheckedAgainstTheLossClassesToo) {
  graph::Graph g = LmWithFewerClasses();
  std::vector<int64_t> corpus;
  for (int i = 0; i < 40; ++i) corpus.push_back(i);  // ids 10..39 are no class
  auto lm = NewLmBatches(g, corpus);
  EXPECT_THAT(lm.status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("10")));
  if (lm.ok()) {
    auto batch = (*lm)->Get(0);
    ASSERT_TRUE(batch.ok());
    int64_t worst = 0;
    const HostTensor& l = batch->at("labels");
    for (int64_t i = 0; i < l.num_elements(); ++i) worst = std::max(worst, l.as<int64_t>()[i]);
    ADD_FAILURE() << "accepted; step 0 has label " << worst << " for a loss of 10 classes";
  }
}

// 5. NewLmBatches accepts int32 labels (it checks the tokens' dtype only)
// but always produces int64 labels: every step is then refused by the runner
// ("input 'labels' is i64[8] but the model expects i32[8]"), not at open.
TEST(DataValidationTest, LmBatchesMatchTheGraphsLabelDtype) {
  graph::Graph g = LmWithFewerClasses(graph::DType::kInt32);
  std::vector<int64_t> corpus(40, 3);
  auto lm = NewLmBatches(g, corpus);
  if (!lm.ok()) {
    // Refused up front, as a model whose labels are not int64 (any other
    // error would hide what this case is about).
    EXPECT_THAT(lm.status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("is not a language model with int64 inputs tokens[B, S] and "
                                   "labels[B*S]")));
    return;
  }
  auto batch = (*lm)->Get(0);
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(batch->at("labels").dtype(), graph::DType::kInt32)
      << "labels " << graph::DTypeName(batch->at("labels").dtype()) << " for an i32 input";
}

// 6. The step a run starts from comes from a checkpoint's trainer.json.
// NewLmBatches' Get(-1) read the corpus before its first element (the
// window start (i * stride + step * S) mod usable is negative), and a step
// whose step * S overflows read wherever the wrapped product pointed. Both
// are now refused, as the user data sets refuse them.
TEST(DataValidationTest, LmBatchesRefuseNegativeAndOverflowingSteps) {
  graph::Graph g = LmWithFewerClasses();
  std::vector<int64_t> corpus(40, 3);
  auto lm = NewLmBatches(g, corpus);
  ASSERT_THAT(lm.status(), IsOk());
  EXPECT_THAT((*lm)->Get(-1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step -1 is negative")));
  EXPECT_THAT((*lm)->Get(std::numeric_limits<int64_t>::max()).status(),
              StatusIs(absl::StatusCode::kOutOfRange,
                       HasSubstr("step 9223372036854775807 times the sequence length 4 "
                                 "overflows 64 bits")));
  // The last step that does not overflow still reads a window.
  auto last = (*lm)->Get(std::numeric_limits<int64_t>::max() / 4);
  ASSERT_THAT(last.status(), IsOk());
  EXPECT_EQ(last->at("tokens").as<int64_t>()[0], 3);
}

// 7. The .npy header's length is the file's to say (up to 4 GiB in format
// 2.0): a header of half a million dimensions was parsed whole (~100 bytes
// of memory per header byte) and refused with a shape message as long as
// the header. numpy.load refuses headers over 10000 bytes by default; a
// plain array's is under 200.
TEST(DataValidationTest, AnOversizedNpyHeaderIsRefusedBeforeParsing) {
  graph::Graph g = Mlp();
  std::string dir = TestDir();
  WriteMlpData(dir, 8);
  std::vector<int64_t> shape(500000, 0);
  shape[0] = 8;
  WriteFile(dir + "/x.npy", Npy("<f4", shape, "", /*major=*/2));
  const absl::Status s = OpenNpyStatus(dir, g);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr(dir + "/x.npy"),
                                HasSubstr("a .npy header of 1500084 bytes, more than the 10000"))));
  EXPECT_LT(s.message().size(), 1000u);
}

// A data file changed while a source reads it (a user regenerating the data
// set mid-run): the files were mapped, and one truncated faulted the whole
// process (SIGBUS) at the next batch; one rewritten in place fed what it
// now held, out-of-range labels too, to the kernels. Now Get is an error
// naming the file.
TEST(DataValidationTest, FilesChangedAfterOpeningAreErrorsNamingThem) {
  graph::Graph g = Mlp();
  const auto changed = [](const std::string& path) {
    return StatusIs(absl::StatusCode::kFailedPrecondition,
                    AllOf(HasSubstr(path), HasSubstr("changed since it was opened")));
  };
  {  // Truncated.
    std::string dir = TestDir();
    WriteMlpData(dir, 10);
    auto d = MustOpen("npy:" + dir, g);
    ASSERT_NE(d, nullptr);
    ASSERT_THAT(d->Get(0), IsOk());
    ASSERT_EQ(::truncate((dir + "/x.npy").c_str(), 0), 0);
    EXPECT_THAT(d->Get(1), changed(dir + "/x.npy"));
  }
  {  // A label rewritten in place, out of the loss's 5 classes, and its
     // modification time put back: the values are checked as read.
    std::string dir = TestDir();
    WriteMlpData(dir, 10);
    auto d = MustOpen("npy:" + dir, g);
    ASSERT_NE(d, nullptr);
    const std::string labels = dir + "/labels.npy";
    struct stat st;
    ASSERT_EQ(::stat(labels.c_str(), &st), 0);
    const int64_t seven = 7;
    int fd = ::open(labels.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    // Row 5 of ten int64 labels at the end of the file.
    ASSERT_EQ(::pwrite(fd, &seven, sizeof(seven), st.st_size - 5 * sizeof(seven)),
              static_cast<ssize_t>(sizeof(seven)));
    const struct timespec times[2] = {{0, UTIME_OMIT}, st.st_mtim};
    ASSERT_EQ(::futimens(fd, times), 0);
    ::close(fd);
    EXPECT_THAT(d->Get(1),  // samples 4..7
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr(labels + " (graph input 'labels') changed since it was "
                                                  "opened: row 5 now holds 7, outside [0, 5)"))));
    EXPECT_THAT(d->Get(0), IsOk());  // samples 0..3, as they were
  }
  {  // Rewritten in place with values in range: seen by its modification time.
    std::string dir = TestDir();
    WriteMlpData(dir, 10);
    auto d = MustOpen("npy:" + dir, g);
    ASSERT_NE(d, nullptr);
    const std::string x = dir + "/x.npy";
    const float v = 1.0f;
    int fd = ::open(x.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, &v, sizeof(v), 200), static_cast<ssize_t>(sizeof(v)));
    const struct timespec times[2] = {{0, UTIME_OMIT}, {12345, 678}};
    ASSERT_EQ(::futimens(fd, times), 0);
    ::close(fd);
    EXPECT_THAT(d->Get(0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                    AllOf(HasSubstr(x), HasSubstr("it was written to"))));
  }
  {  // A token stream truncated.
    std::string dir = TestDir();
    const std::string path = dir + "/train.bin";
    std::vector<uint16_t> t(41);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint16_t>(i);
    WriteFile(path, Raw(t));
    graph::Graph lm = Gpt();
    auto d = MustOpen("tokens:" + path, lm);
    ASSERT_NE(d, nullptr);
    ASSERT_THAT(d->Get(0), IsOk());
    ASSERT_EQ(::truncate(path.c_str(), 0), 0);
    EXPECT_THAT(d->Get(1), changed(path));
  }
}

}  // namespace
}  // namespace hap::data
