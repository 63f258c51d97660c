// User data is untrusted input (executor/data): values out of range for the
// graph are refused however they reach an embedding or a loss, a file that
// is not a regular one is refused without blocking, and the LM batches
// match the graph's label dtype. Each case failed before its fix.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "executor/data/batches.h"
#include "executor/data/user_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph.h"
#include "planner/graph/zoo.h"

namespace hap::data {
namespace {

using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

template <typename T>
std::string Raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// A version 1.0 .npy file, written by hand.
std::string Npy(const std::string& descr, const std::vector<int64_t>& shape,
                const std::string& data) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
    if (i + 1 < shape.size()) dims += " ";
  }
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((unpadded + 63) / 64 * 64 - unpadded, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\0';
  out += static_cast<char>(dict.size() & 0xff);
  out += static_cast<char>((dict.size() >> 8) & 0xff);
  return out + dict + data;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string dir = ::testing::TempDir() + "/data_validation." + info->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// x f32[4, 3], labels i64[4] (cross_entropy over 5 classes).
graph::Graph Mlp() {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 1}, {"hidden", 4}, {"input", 3}, {"classes", 5}, {"batch", 4}});
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

// 1. A '|b1' file feeding a bounded integer input skips the range check:
// FirstOutside has no case for kind 'b', so a bool byte of 7 becomes label 7
// of a 5-class loss (or an id outside a 2-row padding-mask table).
TEST(DataValidationTest, BoolFileValuesAreRangeChecked) {
  std::string dir = TestDir();
  WriteFile(dir + "/x.npy", Npy("<f4", {4, 3}, Raw(std::vector<float>(12, 1.0f))));
  WriteFile(dir + "/labels.npy", Npy("|b1", {4}, Raw(std::vector<uint8_t>{1, 0, 7, 1})));
  graph::Graph g = Mlp();
  auto d = OpenUserDataSet("npy:" + dir, g, {});
  EXPECT_THAT(d.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                   AllOf(HasSubstr("labels.npy"), HasSubstr("row 2"))));
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
    for (int i = 0; i < 100 && fut.wait_for(std::chrono::milliseconds(50)) !=
                                   std::future_status::ready;
         ++i) {
      int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (w >= 0) ::close(w);
    }
  }
  EXPECT_THAT(fut.get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("is not a regular file")));
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
  EXPECT_THAT(OpenUserData("npy:" + dir, *g, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("labels.npy"), HasSubstr("99"),
                             HasSubstr("outside [0, 5)"))));
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
  graph::TensorId logits =
      b.Add("reshape", "flat", {e}, {{"shape", std::vector<int64_t>{8, 10}}});
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
    SUCCEED() << lm.status();  // refused up front: fine
    return;
  }
  auto batch = (*lm)->Get(0);
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(batch->at("labels").dtype(), graph::DType::kInt32)
      << "labels " << graph::DTypeName(batch->at("labels").dtype()) << " for an i32 input";
}

}  // namespace
}  // namespace hap::data
