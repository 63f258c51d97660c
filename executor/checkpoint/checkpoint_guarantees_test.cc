// Guarantees of checkpoints and resume: each test states a guarantee of
// checkpoint.h / safetensors.h / README "Checkpoints, data and weights" and
// fails while the guarantee is broken.
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/checkpoint/file_util.h"
#include "executor/checkpoint/safetensors.h"
#include "executor/data/batches.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap::executor::checkpoint {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

graph::Graph Mlp(int hidden = 24) {
  auto g = graph::BuildZooModel(
      "mlp", {{"layers", 2}, {"hidden", static_cast<double>(hidden)}, {"input", 12},
              {"classes", 5}, {"batch", 9}});
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::vector<v1::RankProgram> Programs(const graph::Graph& g, int n, const std::string& kind,
                                      bool momentum = true) {
  std::vector<double> ratios(n, 1.0 / n);
  synth::Program p = lower::SingleDeviceProgram(g);
  if (n > 1) {
    auto q = hap::testing::ProgramOfKind(g, n, kind, ratios);
    EXPECT_TRUE(q.ok()) << q.status();
    p = *q;
  }
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.optimizer.set_kind(v1::OptimizerConfig::SGD);
  lo.optimizer.set_learning_rate(0.1);
  lo.optimizer.set_momentum(momentum ? 0.9 : 0.0);
  lo.seed = 5;
  auto programs = lower::Lower(g, p, lo);
  EXPECT_TRUE(programs.ok()) << programs.status();
  return *programs;
}

std::string Fresh(const std::string& name) {
  std::string dir = absl::StrCat(::testing::TempDir(), "/review/", name);
  fs::remove_all(dir);
  fs::create_directories(fs::path(dir).parent_path());
  return dir;
}

absl::StatusOr<std::vector<TrainResult>> Train(const graph::Graph& g,
                                               const std::vector<v1::RankProgram>& programs,
                                               const TrainOptions& to) {
  LocalRanksOptions lro;
  auto comms = std::make_shared<std::vector<std::unique_ptr<Communicator>>>(
      NewInProcessGroup(static_cast<int>(programs.size())));
  lro.connect = [comms](int r) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return std::move((*comms)[r]);
  };
  return RunLocalRanks(
      programs, g, [&](int) { return data::NewSyntheticBatches(g, 3); }, to, lro);
}

// Trains `steps` steps (from `first_step`, resuming from `resume` when
// given), saving as `policy` says.
absl::Status TrainAndSave(const graph::Graph& g, const std::vector<v1::RankProgram>& programs,
                          CheckpointPolicy policy, int64_t first_step, int64_t steps,
                          const std::string& resume = "") {
  v1::TrainerState trainer;
  trainer.set_seed(5);
  trainer.set_global_batch(9);
  TrainOptions to;
  to.first_step = first_step;
  to.steps = steps;
  if (!resume.empty()) {
    auto reader = CheckpointReader::Open(resume);
    if (!reader.ok()) return reader.status();
    to.initialize = ResumeHook(std::shared_ptr<CheckpointReader>(std::move(*reader)), &g);
  }
  to.after_step = SaveHook(policy, &programs, trainer);
  return Train(g, programs, to).status();
}

// This rank's persistent state as SaveCheckpoint takes it (values: rank+1).
std::vector<ParameterShard> StateOf(const v1::RankProgram& p) {
  std::vector<ParameterShard> out;
  for (const v1::Buffer& b : p.buffers()) {
    if (b.role() != v1::Buffer::PARAMETER && b.role() != v1::Buffer::OPTIMIZER_STATE) continue;
    ParameterShard s;
    s.name = b.tensor();
    s.global_shape.assign(b.global_shape().begin(), b.global_shape().end());
    s.offsets.assign(b.offsets().begin(), b.offsets().end());
    s.value = HostTensor(graph::FromProtoDType(b.dtype()),
                         Shape(b.shape().begin(), b.shape().end()));
    s.optimizer_state = b.role() == v1::Buffer::OPTIMIZER_STATE;
    out.push_back(std::move(s));
  }
  return out;
}

// Every rank of `programs` calls SaveCheckpoint at `step` (threads over the
// in-process communicator); each rank's result.
std::vector<absl::StatusOr<std::string>> SaveOnEveryRank(
    const std::vector<v1::RankProgram>& programs, const std::string& dir, int64_t step) {
  const int n = static_cast<int>(programs.size());
  auto comms = NewInProcessGroup(n);
  std::vector<absl::StatusOr<std::string>> results(n, absl::UnknownError("did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      SaveRequest req;
      req.dir = dir;
      req.rank = r;
      req.programs = &programs;
      req.trainer.set_step(step);
      results[r] = SaveCheckpoint(req, StateOf(programs[r]), *comms[r]);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// 1. FindCheckpoint / --resume DIR: a checkpoint directory whose own name
// looks like a step directory ("step-7", e.g. an experiment named after a
// sweep step) is taken for a step directory and refused, although it holds
// a complete checkpoint.
TEST(CheckpointReviewTest, ResumeFromADirectoryNamedLikeAStep) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 1, "single");
  const std::string dir = Fresh("step-7");
  ASSERT_TRUE(TrainAndSave(g, programs, {dir, 1, 3, 2}, 0, 2).ok());
  ASSERT_TRUE(fs::exists(dir + "/step-00000002/COMMITTED"));
  auto found = FindCheckpoint(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, dir + "/step-00000002");
}

// 2. Retention: resuming from an older step of a directory that holds newer
// checkpoints (README: "--resume DIR/step-N") must not delete what it has
// just committed (and reported as saved).
TEST(CheckpointReviewTest, RetentionNeverDeletesTheCheckpointJustCommitted) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 1, "single");
  const std::string dir = Fresh("rollback");
  // First run: steps 2 and 4.
  ASSERT_TRUE(TrainAndSave(g, programs, {dir, 2, 3, 4}, 0, 4).ok());
  // Roll back to step 2 and train one step, keeping 1 checkpoint.
  const absl::Status resumed =
      TrainAndSave(g, programs, {dir, 1, 1, 3}, 2, 1, dir + "/step-00000002");
  EXPECT_TRUE(resumed.ok()) << resumed;
  EXPECT_TRUE(fs::exists(dir + "/step-00000003/COMMITTED"))
      << "the checkpoint of step 3 (committed, then removed by retention) is gone; left: "
      << [&] {
           std::string s;
           for (const auto& e : fs::directory_iterator(dir)) {
             s += e.path().filename().string() + " ";
           }
           return s;
         }();
}

// 3. checkpoint.h: "Every rank returns an error when the checkpoint did not
// commit". Saving a step that is committed already fails on rank 0
// (AlreadyExists) but rank 1 reports success.
TEST(CheckpointReviewTest, EveryRankFailsWhenTheCheckpointDidNotCommit) {
  graph::Graph g = Mlp();
  auto programs = Programs(g, 2, "tp");
  const std::string dir = Fresh("all_ranks_fail");
  for (const auto& r : SaveOnEveryRank(programs, dir, 1)) ASSERT_TRUE(r.ok()) << r.status();
  auto again = SaveOnEveryRank(programs, dir, 1);
  EXPECT_THAT(again[0].status(), StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
  EXPECT_FALSE(again[1].ok()) << "rank 1 says the checkpoint " << *again[1]
                              << " was saved, rank 0 says: " << again[0].status();
}

// 4. safetensors.h: "SafetensorsFile reads any conforming file" and
// "Standard readers open what WriteSafetensors writes". Zero-element
// tensors share their offset with the next tensor; the reader orders
// entries of equal begin by the address of their name, not by their end,
// and refuses the file that our own writer wrote.
TEST(CheckpointReviewTest, ZeroSizeTensorsRoundTrip) {
  HostTensor a(DType::kFloat32, {2});
  HostTensor z(DType::kFloat32, {2});
  std::vector<HostTensor> empties;
  for (int i = 0; i < 20; ++i) empties.emplace_back(DType::kFloat32, Shape{0, 3});
  std::vector<SafetensorsEntry> entries = {{"a", a.view()}, {"z", z.view()}};
  for (int i = 0; i < 20; ++i) {
    entries.push_back({absl::StrCat("m", i / 10, i % 10), empties[i].view()});
  }
  const std::string path = Fresh("zero_size.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, entries).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 22u);
}

// 5. README: a corrupted index is refused. An index whose slices of a
// tensor overlap (and so leave part of it uncovered) is accepted, and the
// read "succeeds" leaving the uncovered elements as they were: the
// coverage check counts copied elements, twice where slices overlap.
TEST(CheckpointReviewTest, AnIndexWithOverlappingSlicesIsRefused) {
  graph::Graph g = Mlp();
  const std::string dir = Fresh("overlap");
  ASSERT_TRUE(TrainAndSave(g, Programs(g, 2, "tp"), {dir, 1, 3, 1}, 0, 1).ok());
  const std::string index_path = dir + "/step-00000001/index.json";
  auto text = ReadFile(index_path);
  ASSERT_TRUE(text.ok());
  v1::CheckpointIndex index;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(*text, &index).ok());
  std::string damaged;
  Shape shape;
  for (auto& t : *index.mutable_tensors()) {
    if (t.slices_size() != 2 || t.optimizer_state()) continue;
    // The second slice claims the first slice's place.
    *t.mutable_slices(1)->mutable_offsets() = t.slices(0).offsets();
    damaged = t.name();
    shape.assign(t.shape().begin(), t.shape().end());
    break;
  }
  ASSERT_FALSE(damaged.empty()) << "no tensor with two slices";
  std::string json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(index, &json).ok());
  ASSERT_TRUE(WriteFileSynced(index_path, json).ok());

  int64_t untouched = 0;
  const absl::Status status = [&]() -> absl::Status {
    auto reader = CheckpointReader::Open(dir);
    if (!reader.ok()) return reader.status();
    HostTensor whole(DType::kFloat32, shape);
    for (int64_t i = 0; i < whole.num_elements(); ++i) whole.as<float>()[i] = -12345.0f;
    const std::vector<int64_t> zero(shape.size(), 0);
    HAP_RETURN_IF_ERROR((*reader)->Read(damaged, shape, zero, whole.view()));
    for (int64_t i = 0; i < whole.num_elements(); ++i) untouched += whole.as<float>()[i] == -12345.0f;
    return absl::OkStatus();
  }();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDataLoss, ::testing::_))
      << "tensor " << damaged << ": the read left " << untouched << " elements unwritten";
}

// 6. README: resume is "refused before step 1 ... optimizer state of
// another optimizer". A checkpoint with SGD momentum resumed by a plan
// without momentum silently drops the momentum.
TEST(CheckpointReviewTest, OptimizerStateOfAnotherOptimizerIsRefusedBothWays) {
  graph::Graph g = Mlp();
  const std::string dir = Fresh("momentum_dropped");
  ASSERT_TRUE(
      TrainAndSave(g, Programs(g, 1, "single", /*momentum=*/true), {dir, 1, 3, 1}, 0, 1).ok());
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  TrainOptions to;
  to.first_step = 1;
  to.steps = 1;
  to.initialize = ResumeHook(std::shared_ptr<CheckpointReader>(std::move(*reader)), &g);
  EXPECT_THAT(Train(g, Programs(g, 1, "single", /*momentum=*/false), to).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("#momentum")));
}

}  // namespace
}  // namespace hap::executor::checkpoint
