#include "executor/checkpoint/checkpoint_test_util.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "executor/checkpoint/file_util.h"
#include "executor/checkpoint/safetensors.h"
#include "executor/comm/forwarding_communicator.h"
#include "executor/data/batches.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/test_programs.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap::executor::checkpoint::test_util {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;

graph::Graph Mlp(int hidden) {
  auto g = graph::BuildZooModel("mlp", {{"layers", 2},
                                        {"hidden", static_cast<double>(hidden)},
                                        {"input", 12},
                                        {"classes", 5},
                                        {"batch", 9}});
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::vector<v1::RankProgram> Programs(const graph::Graph& g, int n, const std::string& kind,
                                      bool momentum, bool adam) {
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
  if (adam) lo.optimizer.set_kind(v1::OptimizerConfig::ADAM);
  lo.seed = 5;
  auto programs = lower::Lower(g, p, lo);
  EXPECT_TRUE(programs.ok()) << programs.status();
  return *programs;
}

std::string Fresh(const std::string& name) {
  std::string dir = absl::StrCat(::testing::TempDir(), "/", name);
  fs::remove_all(dir);
  return dir;
}

// Trains `steps` steps from `to.first_step` with the in-process communicator.
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
absl::StatusOr<std::vector<TrainResult>> TrainAndSaveFrom(
    const graph::Graph& g, const std::vector<v1::RankProgram>& programs, CheckpointPolicy policy,
    int64_t first_step, int64_t steps, const std::string& resume) {
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
  return Train(g, programs, to);
}

// Saves after every step of `steps` from step 0, keeping `keep`.
std::vector<TrainResult> TrainAndSave(const graph::Graph& g,
                                      const std::vector<v1::RankProgram>& programs,
                                      const std::string& dir, int steps, int keep) {
  auto r = TrainAndSaveFrom(g, programs, {dir, 1, keep, steps}, 0, steps);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<TrainResult>{};
}

std::string FlipTheLastByte(const std::string& path) {
  auto f = SafetensorsFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return "";
  std::string last;
  int64_t end = -1;
  for (const auto& [name, t] : (*f)->tensors()) {
    if (t.end > end) std::tie(last, end) = std::make_pair(name, t.end);
  }
  auto bytes = ReadFile(path);
  EXPECT_TRUE(bytes.ok() && !bytes->empty());
  if (!bytes.ok() || bytes->empty()) return "";
  bytes->back() ^= 0x10;
  EXPECT_TRUE(WriteFileSynced(path, *bytes).ok());
  return last;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// This rank's persistent state as SaveCheckpoint takes it (zeros).
std::vector<ParameterShard> StateOf(const v1::RankProgram& p) {
  std::vector<ParameterShard> out;
  for (const v1::Buffer& b : p.buffers()) {
    if (b.role() != v1::Buffer::PARAMETER && b.role() != v1::Buffer::OPTIMIZER_STATE) continue;
    ParameterShard s;
    s.name = b.tensor();
    s.global_shape.assign(b.global_shape().begin(), b.global_shape().end());
    s.offsets.assign(b.offsets().begin(), b.offsets().end());
    s.value =
        HostTensor(graph::FromProtoDType(b.dtype()), Shape(b.shape().begin(), b.shape().end()));
    s.optimizer_state = b.role() == v1::Buffer::OPTIMIZER_STATE;
    out.push_back(std::move(s));
  }
  return out;
}

// Every rank of `programs` saves `step` (threads over the in-process
// communicator), rank r with `states[r]` when given; each rank's result.
std::vector<absl::StatusOr<std::string>> SaveOnEveryRank(
    const std::vector<v1::RankProgram>& programs, const std::string& dir, int64_t step, int keep,
    std::vector<std::vector<ParameterShard>> states, int64_t replaces_after,
    std::function<void(int rank, int k)> after_barrier) {
  const int n = static_cast<int>(programs.size());
  if (states.empty()) {
    for (const auto& p : programs) states.push_back(StateOf(p));
  }
  // Barriers counted per rank, each followed by the hook.
  class Hooked : public ForwardingCommunicator {
   public:
    Hooked(std::unique_ptr<Communicator> inner, std::function<void(int, int)> hook)
        : ForwardingCommunicator(std::move(inner)), hook_(std::move(hook)) {}
    absl::Status Barrier() override {
      absl::Status s = ForwardingCommunicator::Barrier();
      if (hook_) hook_(rank(), ++barriers_);
      return s;
    }

   private:
    std::function<void(int, int)> hook_;
    int barriers_ = 0;
  };
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& c : NewInProcessGroup(n)) {
    comms.push_back(std::make_unique<Hooked>(std::move(c), after_barrier));
  }
  std::vector<absl::StatusOr<std::string>> results(n, absl::UnknownError("did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      SaveRequest req;
      req.dir = dir;
      req.keep = keep;
      req.rank = r;
      req.programs = &programs;
      req.trainer.set_step(step);
      req.replaces_after = replaces_after;
      results[r] = SaveCheckpoint(req, states[r], *comms[r]);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace hap::executor::checkpoint::test_util
