// Tests of the pipeline-stage runner (executor/train/pipeline.cc):
// schedules the equivalence test does not cover (one microbatch on three
// stages, fewer microbatches than stages, odd microbatch counts, four
// stages), a stage without parameters, the profile of a pipeline rank, a
// peer that fails mid-step, the sends of a failed step, device memory
// across steps, and a resume from a pipeline checkpoint. The models, the
// cases' lowering and the single-device reference are those of
// pipeline_equivalence_test.cc (pipeline_test_util.h). Ranks are threads
// over real Gloo, as there; every rank here is built by this file's harness
// (RunRanks) so a test can wrap its device or communicator.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/comm/communicator.h"
#include "executor/comm/forwarding_communicator.h"
#include "executor/cpu/cpu_device.h"
#include "executor/data/batches.h"
#include "executor/runtime/timing_device.h"
#include "executor/train/backend.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/pipeline.h"
#include "executor/train/pipeline_test_util.h"
#include "executor/train/test_programs.h"
#include "executor/train/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;
using executor::Communicator;
using executor::Device;
using executor::ForwardingCommunicator;
using executor::PipelineRunner;
using executor::ProgramRunner;
using executor::TensorView;
using executor::TrainResult;
using hap::testing::BoundaryPieces;
using hap::testing::ExpectMatchesReference;
using hap::testing::kPipelineBatch;
using hap::testing::kPipelineSeed;
using hap::testing::PipelineCase;
using hap::testing::PipelineCaseName;
using hap::testing::PipelineTestDir;
using hap::testing::PipelineTestModel;
using hap::testing::SingleDeviceReference;
using hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Truly;
using Lowered = hap::testing::LoweredPipeline;

PipelineCase MakeSpec(const std::string& model, std::vector<int> group_sizes, int microbatches,
                      bool adam, const std::string& kind, bool overlap = false,
                      std::vector<int> cuts = {}) {
  PipelineCase c;
  c.model = model;
  c.group_sizes = std::move(group_sizes);
  c.microbatches = microbatches;
  c.adam = adam;
  c.kind = kind;
  c.overlap = overlap;
  c.cuts = std::move(cuts);
  return c;
}

// The layout carries the boundary pieces: RunRanks creates the
// PipelineRunners itself.
absl::StatusOr<Lowered> LowerPipeline(const graph::Graph& g, const PipelineCase& c) {
  return hap::testing::LowerPipeline(g, c, BoundaryPieces::kAdd);
}

// A device that forwards to another and counts the memory it holds.
class CountingDevice : public Device {
 public:
  explicit CountingDevice(Device* inner) : inner_(inner) {}
  std::string name() const override { return inner_->name(); }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    auto p = inner_->Allocate(bytes);
    if (p.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      live_ += 1;
    }
    return p;
  }
  void Free(void* p) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      live_ -= 1;
    }
    inner_->Free(p);
  }
  absl::Status CopyFromHost(const void* src, TensorView dst) override {
    return inner_->CopyFromHost(src, dst);
  }
  absl::Status CopyToHost(TensorView src, void* dst) override {
    return inner_->CopyToHost(src, dst);
  }
  absl::Status Fill(TensorView dst, double value) override { return inner_->Fill(dst, value); }
  absl::Status Convert(TensorView src, TensorView dst) override {
    return inner_->Convert(src, dst);
  }
  absl::Status CopyBox(TensorView src, absl::Span<const int64_t> src_start, TensorView dst,
                       absl::Span<const int64_t> dst_start,
                       absl::Span<const int64_t> extent) override {
    return inner_->CopyBox(src, src_start, dst, dst_start, extent);
  }
  bool HasKernel(const std::string& name) const override { return inner_->HasKernel(name); }
  absl::Status RunKernel(const std::string& name, const executor::KernelContext& ctx,
                         const graph::Attrs& attrs, absl::Span<const TensorView> inputs,
                         absl::Span<const TensorView> outputs) override {
    return inner_->RunKernel(name, ctx, attrs, inputs, outputs);
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  int64_t live() const {
    std::lock_guard<std::mutex> l(mu_);
    return live_;
  }

 private:
  Device* inner_;
  mutable std::mutex mu_;
  int64_t live_ = 0;
};

// A communicator that forwards to another; before its Recv number n
// (0-based) it calls before_recv(n), which may block, and fails the Recv
// with what it returns when that is not OK (the inner communicator is
// then not called: it stays healthy).
class HookedComm : public ForwardingCommunicator {
 public:
  HookedComm(std::unique_ptr<Communicator> inner, std::function<absl::Status(int)> before_recv)
      : ForwardingCommunicator(std::move(inner)), before_recv_(std::move(before_recv)) {}
  absl::Status Recv(TensorView buf, int peer, int64_t tag) override {
    absl::Status s = before_recv_(recvs_++);
    if (!s.ok()) return s;
    return ForwardingCommunicator::Recv(buf, peer, tag);
  }

 private:
  std::function<absl::Status(int)> before_recv_;
  int recvs_ = 0;
};

// Fails Recv number `n` and every later one ("injected").
std::function<absl::Status(int)> FailFrom(int n) {
  return [n](int k) {
    return k >= n ? absl::InternalError("injected receive failure") : absl::OkStatus();
  };
}

struct RankCtx {
  int rank = 0;
  ProgramRunner* runner = nullptr;
  PipelineRunner* pipe = nullptr;
  // The pipeline runner's owner: a body may destroy it (before the
  // communicators, which outlive it as PipelineRunner::Create asks).
  std::unique_ptr<PipelineRunner>* pipe_owner = nullptr;
  Communicator* world = nullptr;
  executor::TimingDevice* timing = nullptr;  // HarnessOptions::timing
  CountingDevice* counting = nullptr;
};

struct HarnessOptions {
  absl::Duration timeout = absl::Seconds(60);
  bool timing = false;    // the runner's device is a TimingDevice
  bool counting = false;  // ... or a CountingDevice
  // Wraps rank r's world communicator (null: as it is).
  std::function<std::unique_ptr<Communicator>(int, std::unique_ptr<Communicator>)> wrap_world;
};

// Rank r of `L` on thread r: CPU device, Gloo world and stage group (and
// the overlap thread when its program has asynchronous collectives), its
// runner and pipeline runner; then `body`. Returns each rank's status.
std::vector<absl::Status> RunRanks(const Lowered& L, const std::string& tag,
                                   const HarnessOptions& o,
                                   const std::function<absl::Status(RankCtx&)>& body) {
  const int n = static_cast<int>(L.programs.size());
  const std::string dir = PipelineTestDir(tag);
  std::vector<absl::Status> results(n, absl::UnknownError("did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      results[r] = [&]() -> absl::Status {
        auto at = executor::StageOf(L.layout, r);
        if (!at.ok()) return at.status();
        std::unique_ptr<Device> cpu = executor::NewCpuDevice(1);
        std::unique_ptr<executor::TimingDevice> timing;
        std::unique_ptr<CountingDevice> counting;
        Device* device = cpu.get();
        if (o.timing) {
          timing = std::make_unique<executor::TimingDevice>(device);
          device = timing.get();
        } else if (o.counting) {
          counting = std::make_unique<CountingDevice>(device);
          device = counting.get();
        }
        auto store = executor::NewFileStore(dir);
        if (!store.ok()) return store.status();
        executor::GlooOptions go;
        go.rank = r;
        go.size = n;
        go.prefix = absl::StrCat(tag, "/world");
        go.timeout = o.timeout;
        auto world = executor::ConnectGloo(go, **store);
        if (!world.ok()) return world.status();
        std::unique_ptr<Communicator> w = *std::move(world);
        if (o.wrap_world) w = o.wrap_world(r, std::move(w));
        go.rank = at->second;
        go.size = static_cast<int>(L.layout.stage_ranks[at->first].size());
        go.prefix = absl::StrCat(tag, "/stage", at->first);
        auto group = executor::ConnectGloo(go, **store);
        if (!group.ok()) return group.status();
        executor::RunnerOptions ro;
        std::unique_ptr<executor::AsyncCollectives> async;
        if (executor::HasAsyncCollectives(L.programs[r])) {
          auto a = executor::ConnectOverlap(*device, go, **store);
          if (!a.ok()) return a.status();
          async = *std::move(a);
          ro.async = async.get();
        }
        auto runner = ProgramRunner::Create(L.programs[r], *L.micro, device, group->get(), ro);
        if (!runner.ok()) return runner.status();
        auto pipe = PipelineRunner::Create(runner->get(), w.get(), L.layout);
        if (!pipe.ok()) return pipe.status();
        RankCtx ctx;
        ctx.rank = r;
        ctx.runner = runner->get();
        ctx.pipe = pipe->get();
        ctx.pipe_owner = &*pipe;
        ctx.world = w.get();
        ctx.timing = timing.get();
        ctx.counting = counting.get();
        return body(ctx);
      }();
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Trains `steps` steps of the synthetic batches on every rank.
absl::StatusOr<std::vector<TrainResult>> Train(const graph::Graph& g, const Lowered& L,
                                               const std::string& tag, int steps) {
  std::vector<TrainResult> out(L.programs.size());
  auto st = RunRanks(L, tag, {}, [&](RankCtx& c) -> absl::Status {
    auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
    executor::TrainOptions to;
    to.steps = steps;
    auto r = executor::TrainRankWith(
        *c.runner, [&](const executor::Batch& b, int64_t step) { return c.pipe->RunStep(b, step); },
        *batches, to);
    if (!r.ok()) return r.status();
    out[c.rank] = *std::move(r);
    return absl::OkStatus();
  });
  for (size_t r = 0; r < st.size(); ++r) {
    if (!st[r].ok()) return Annotate(st[r], absl::StrCat("rank ", r));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Schedules the equivalence test does not cover.

class PipelineScheduleTest : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(PipelineScheduleTest, MatchesSingleDevice) {
  constexpr int kSteps = 3;
  const PipelineCase& c = GetParam();
  graph::Graph g = PipelineTestModel(c.model);
  const TrainResult& ref = SingleDeviceReference(g, c.model, c.adam, kSteps);
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  auto runs = Train(g, *lowered, PipelineCaseName(c), kSteps);
  ASSERT_TRUE(runs.ok()) << runs.status();
  ExpectMatchesReference(*runs, ref, c.adam, kSteps);
}

std::vector<PipelineCase> ScheduleCases() {
  return {
      // One microbatch through three stages (w = 1, 1, 0).
      MakeSpec("mlp", {1, 1, 1}, 1, false, "dp"),
      // Fewer microbatches than stages: stage 0 runs both forwards first.
      MakeSpec("mlp", {1, 1, 1, 1}, 2, true, "dp"),
      MakeSpec("gpt", {1, 2, 1}, 2, false, "tp"),
      // An odd microbatch count, not a multiple of the stages.
      MakeSpec("gpt", {1, 1, 1}, 3, true, "dp"),
      MakeSpec("mlp", {2, 1}, 3, false, "dp", true),
      // Many microbatches on a deep pipeline: stash slots reused.
      MakeSpec("mlp", {1, 1, 1, 1}, 6, false, "dp"),
      // Microbatches of 2 and 1 samples split over a group of 2.
      MakeSpec("mlp", {2, 2}, 12, false, "dp"),
      MakeSpec("mlp", {1, 2}, 24, true, "dp"),
      // ZeRO-3 and the unrestricted search with overlap at odd / single
      // microbatch counts.
      MakeSpec("gpt", {2, 1}, 3, true, "zero", true),
      MakeSpec("gpt", {1, 2, 2}, 1, true, "mix", true),
  };
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineScheduleTest, ::testing::ValuesIn(ScheduleCases()),
                         hap::testing::PipelineCaseTestName);

// A stage without parameters (a lone relu between two linear stages): no
// gradients to sum, no clipping norm of its own, still in the norm's sum
// over the stages.
TEST(PipelineRunnerTest, StageWithoutParametersMatchesSingleDevice) {
  constexpr int kSteps = 3;
  graph::Graph g = PipelineTestModel("mlp");
  int relu = -1;
  for (int k = 0; k < static_cast<int>(g.ops().size()); ++k) {
    if (g.op(k).type == "relu") {
      relu = k;
      break;
    }
  }
  ASSERT_GT(relu, 0);
  for (bool adam : {false, true}) {
    PipelineCase c = MakeSpec("mlp", {1, 1, 1}, 4, adam, "dp", false,
                              {0, relu, relu + 1, static_cast<int>(g.ops().size())});
    auto lowered = LowerPipeline(g, c);
    ASSERT_TRUE(lowered.ok()) << lowered.status();
    for (const v1::Buffer& b : lowered->programs[1].buffers()) {
      EXPECT_NE(b.role(), v1::Buffer::PARAMETER) << b.tensor();
    }
    auto runs = Train(g, *lowered, PipelineCaseName(c), kSteps);
    ASSERT_TRUE(runs.ok()) << runs.status();
    ExpectMatchesReference(*runs, SingleDeviceReference(g, "mlp", adam, kSteps), adam, kSteps);
  }
}

// batch_norm normalises with the statistics of the whole batch (its op's
// contract, which the SPMD lowering keeps by all-reducing the sums between
// a batch's pieces). A stage program is lowered at the microbatch size, so
// with M > 1 each microbatch was normalised with its own statistics and the
// running statistics moved M times a step: the pipeline trained another
// model than the single device, with no error (bn_cnn in 2 microbatches:
// loss 1.7114 vs 1.7111 at step 0). Rebatch now refuses such a graph, and
// the runner a stage program lowered so (a plan made before); with one
// microbatch it still matches.
TEST(PipelineRunnerTest, BatchNormStageWithSeveralMicrobatchesIsRefused) {
  constexpr int kSteps = 2;
  auto g = testing::BatchNormCnn(kPipelineBatch);
  ASSERT_TRUE(g.ok()) << g.status();
  int relu = -1;
  for (int k = 0; k < static_cast<int>(g->ops().size()); ++k) {
    if (g->op(k).type == "relu") relu = k;
  }
  ASSERT_GT(relu, 0);
  const std::vector<int> cuts = {0, relu + 1, static_cast<int>(g->ops().size())};
  PipelineCase c = MakeSpec("bn_cnn", {1, 1}, 1, false, "dp", false, cuts);
  auto lowered = LowerPipeline(*g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  auto runs = Train(*g, *lowered, PipelineCaseName(c), kSteps);
  ASSERT_TRUE(runs.ok()) << runs.status();
  ExpectMatchesReference(*runs, SingleDeviceReference(*g, "bn_cnn", false, kSteps), false, kSteps);

  EXPECT_THAT(LowerPipeline(*g, MakeSpec("bn_cnn", {1, 1}, 2, false, "dp", false, cuts)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("op 'bn' (batch_norm) normalises with the statistics of the "
                                 "whole batch")));
  // Lowered for one microbatch, run in two.
  lowered->layout.microbatches = 2;
  auto st =
      RunRanks(*lowered, "bn_two_microbatches", {}, [](RankCtx&) { return absl::OkStatus(); });
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kInvalidArgument,
                              AllOf(HasSubstr("the program of stage 0 normalises with batch_norm "
                                              "('bn')"),
                                    HasSubstr("run in 2 microbatches"))));
}

// Mixture-of-experts routing fills each expert's capacity with a group's
// tokens. Rebatch kept the op's capacity (the whole batch's) at the
// microbatch size, so every group had M times the slots and dropped fewer
// tokens than on the single device: a pipeline of the moe model with
// groups of one sample (6 tokens) and 2 microbatches had another loss
// (3.7647 vs 3.7856 at step 0), the same as without groups. The capacity
// now scales with the batch. Routing over the whole batch as one group
// cannot be split: Rebatch refuses it, and a stage program lowered with it
// (a plan made before) is refused by the runner.
TEST(PipelineRunnerTest, MixtureOfExpertsRoutesAsOnTheSingleDevice) {
  constexpr int kSteps = 2;
  std::map<std::string, double> p = {{"layers", 2},
                                     {"hidden", 16},
                                     {"heads", 4},
                                     {"ffn", 24},
                                     {"seq", 6},
                                     {"vocab", 37},
                                     {"batch", kPipelineBatch},
                                     {"dropout", 0},
                                     {"experts", 4},
                                     {"capacity_factor", 1.0},
                                     {"moe_every", 1},
                                     {"top_k", 2},
                                     {"moe_group_size", 6}};
  auto g = graph::BuildZooModel("moe", p);
  ASSERT_TRUE(g.ok()) << g.status();
  const TrainResult& ref = SingleDeviceReference(*g, "moe_grouped", false, kSteps);
  for (const std::vector<int>& groups : {std::vector<int>{1, 1}, std::vector<int>{2, 1}}) {
    PipelineCase c = MakeSpec("moe", groups, 2, false, "dp", false);
    SCOPED_TRACE(PipelineCaseName(c));
    auto lowered = LowerPipeline(*g, c);
    ASSERT_TRUE(lowered.ok()) << lowered.status();
    auto runs = Train(*g, *lowered, PipelineCaseName(c), kSteps);
    ASSERT_TRUE(runs.ok()) << runs.status();
    ExpectMatchesReference(*runs, ref, false, kSteps);
  }

  p["moe_group_size"] = 0;
  auto whole = graph::BuildZooModel("moe", p);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_THAT(LowerPipeline(*whole, MakeSpec("moe", {1, 1}, 2, false, "dp")).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("routes all the batch's tokens as one group")));
  // Lowered for one microbatch, run in two.
  PipelineCase c = MakeSpec("moe", {1, 1}, 1, false, "dp");
  auto lowered = LowerPipeline(*whole, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  lowered->layout.microbatches = 2;
  auto st =
      RunRanks(*lowered, "moe_whole_batch_routing", {}, [](RankCtx&) { return absl::OkStatus(); });
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kInvalidArgument,
                              HasSubstr("the program of stage 0 routes all the batch's tokens to "
                                        "its experts as one group")));
}

// ---------------------------------------------------------------------------
// The profile (hap-executor --profile, the daemon's windows) of a pipeline
// rank: TimingDevice::SecondsByOpType charges kernel "T" to IR op type T,
// and hapctl calibrate fits each op type's speed from it. The pipeline
// runner's own gradient sums over microbatches are runtime work; they must
// not be charged to a model op type. The MLP has no "add" op, so no "add"
// may appear.
TEST(PipelineRunnerTest, GradientSumsAreRuntimeWorkInTheProfile) {
  graph::Graph g = PipelineTestModel("mlp");
  PipelineCase c = MakeSpec("mlp", {1, 1}, 4, false, "dp");
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  std::set<std::string> op_types;
  for (const graph::Op& op : lowered->micro->ops()) op_types.insert(op.type);
  ASSERT_EQ(op_types.count("add"), 0u);
  for (const v1::RankProgram& p : lowered->programs) {
    for (const v1::Step& step : p.steps()) {
      ASSERT_FALSE(step.has_kernel() && step.kernel().kernel() == "add")
          << "the stage programs themselves run no add kernel";
    }
  }
  std::vector<std::map<std::string, double>> by_type(lowered->programs.size());
  HarnessOptions timed;
  timed.timing = true;
  auto st = RunRanks(*lowered, "profile", timed, [&](RankCtx& c) -> absl::Status {
    auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
    executor::TrainOptions to;
    to.steps = 1;
    auto r = executor::TrainRankWith(
        *c.runner, [&](const executor::Batch& b, int64_t step) { return c.pipe->RunStep(b, step); },
        *batches, to);
    if (!r.ok()) return r.status();
    by_type[c.rank] = c.timing->SecondsByOpType(1);
    return absl::OkStatus();
  });
  for (size_t r = 0; r < st.size(); ++r) {
    ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
    std::vector<std::string> foreign;
    for (const auto& [type, seconds] : by_type[r]) {
      if (type == "(runtime)" || type == "(optimizer)" || op_types.count(type)) continue;
      foreign.push_back(type);
    }
    EXPECT_TRUE(foreign.empty()) << "rank " << r << " profile charges op types the model lacks: "
                                 << absl::StrJoin(foreign, ", ");
  }
}

// ---------------------------------------------------------------------------
// Error paths.

// A stage whose step fails but whose process stays (a daemon rank, a rank
// whose communicators are still open): its peers fail their step with the
// communicator's deadline, they do not wait for ever.
TEST(PipelineRunnerTest, PeerFailingMidStepFailsTheStepWithinTheDeadline) {
  graph::Graph g = PipelineTestModel("mlp");
  PipelineCase c = MakeSpec("mlp", {1, 2}, 4, false, "dp");
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  HarnessOptions o;
  o.timeout = absl::Seconds(3);
  // Rank 1 (stage 1's rank 0) fails at its second receive (microbatch 1's
  // activation), after microbatch 0 went through.
  o.wrap_world = [](int r, std::unique_ptr<Communicator> w) -> std::unique_ptr<Communicator> {
    if (r != 1) return w;
    return std::make_unique<HookedComm>(std::move(w), FailFrom(1));
  };
  std::mutex mu;
  std::condition_variable cv;
  int others_done = 0;
  auto st = RunRanks(*lowered, "peer_fails", o, [&](RankCtx& c) -> absl::Status {
    absl::Status s = c.runner->InitializeParameters();
    if (!s.ok()) return s;
    auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
    auto b = batches->Get(0);
    if (!b.ok()) return b.status();
    auto loss = c.pipe->RunStep(*b, 0);
    std::unique_lock<std::mutex> l(mu);
    if (c.rank != 1) {
      ++others_done;
      cv.notify_all();
    } else {
      // Keep this rank's communicators open until the others are done (at
      // most 60 s): a peer still waiting then is failed by the connection
      // closing (Unavailable), not by its deadline, and the check below
      // says so.
      cv.wait_for(l, std::chrono::seconds(60), [&] { return others_done == 2; });
    }
    return loss.status();
  });
  ASSERT_EQ(st.size(), 3u);
  EXPECT_NE(st[1].message().find("injected"), std::string::npos) << st[1];
  for (int r : {0, 2}) {
    // Failed by the communicator's deadline (o.timeout, 3 s), waiting for
    // a receive that rank 1's failed step never matched. (This was a
    // wall-clock limit of 30 s on the failure.) The other of ranks 0 and 2
    // may have ended first, closing its connections: its deadline is then
    // reported as that lost peer (Unavailable), the wait still named.
    EXPECT_THAT(
        st[r],
        AnyOf(StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_),
              AllOf(StatusIs(absl::StatusCode::kUnavailable, HasSubstr("the connection to rank")),
                    Truly(executor::IsLostPeer))))
        << "rank " << r;
    EXPECT_THAT(st[r].message(),
                AllOf(HasSubstr("receive from rank"), HasSubstr("timed out waiting for a peer")))
        << "rank " << r;
  }
}

// Communicator::Send: "`buf` must stay unchanged until WaitSends returns".
// The pipeline runner's sends read its host copies (pending_sends_); a
// step that fails after sending leaves them started, and the runner frees
// them when it is destroyed (or at the next RunStep) without a WaitSends
// that succeeded. Gloo sends an unbound buffer only once the receiver has
// posted its receive, so a slow peer that posts it afterwards is sent
// freed memory. Here stage 0 sends microbatches 0 and 1, then fails
// (its backward's receive, injected); its runner is destroyed before its
// communicators, as every driver does (RunLocalPipeline, hap-executor, the
// daemon); then stage 1 receives microbatch 0's activation. What arrives
// must be what stage 0 computed (the bytes a control run receives while
// stage 0's runner still exists), or nothing: a failed step's sends may be
// withdrawn (the receive then fails), never sent from freed memory.
TEST(PipelineRunnerTest, SendsOfAFailedStepDoNotReadFreedMemory) {
  graph::Graph g = PipelineTestModel("mlp");
  PipelineCase c = MakeSpec("mlp", {1, 1}, 2, false, "dp");
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  std::vector<int64_t> in_shape;
  for (const v1::Buffer& b : lowered->programs[1].buffers()) {
    if (b.role() == v1::Buffer::STAGE_INPUT) {
      in_shape.assign(b.global_shape().begin(), b.global_shape().end());
    }
  }
  ASSERT_FALSE(in_shape.empty());

  // Returns what stage 1 receives as microbatch 0's activation (empty when
  // its receive fails).
  auto run = [&](bool destroy_first, const std::string& tag) -> std::vector<float> {
    std::mutex mu;
    std::condition_variable cv;
    bool released = false, received = false;
    auto wait_for = [&](bool* flag) {
      std::unique_lock<std::mutex> l(mu);
      cv.wait_for(l, std::chrono::seconds(30), [&] { return *flag; });
    };
    auto set = [&](bool* flag) {
      std::lock_guard<std::mutex> l(mu);
      *flag = true;
      cv.notify_all();
    };
    std::vector<float> got;
    HarnessOptions o;
    o.timeout = absl::Seconds(2);
    o.wrap_world = [&](int r, std::unique_ptr<Communicator> w) -> std::unique_ptr<Communicator> {
      if (r == 0) return std::make_unique<HookedComm>(std::move(w), FailFrom(0));
      return w;
    };
    std::vector<std::vector<float>> filler;
    auto st = RunRanks(*lowered, tag, o, [&](RankCtx& ctx) -> absl::Status {
      if (ctx.rank == 1) {
        wait_for(&released);  // a slow peer: receives only now
        executor::HostTensor t(graph::DType::kFloat32, in_shape);
        absl::Status s = ctx.world->Recv(t.view(), 0, 0);
        if (s.ok()) got.assign(t.as<float>(), t.as<float>() + t.num_elements());
        set(&received);
        return s;
      }
      absl::Status s = ctx.runner->InitializeParameters();
      if (!s.ok()) return s;
      auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
      auto b = batches->Get(0);
      if (!b.ok()) return b.status();
      auto loss = ctx.pipe->RunStep(*b, 0);  // sends microbatches 0 and 1, then fails
      if (destroy_first) {
        ctx.pipe_owner->reset();
        // Memory handed out again, as any later work of the process does.
        for (int i = 0; i < 64; ++i) filler.emplace_back(in_shape[0] * in_shape[1] + 16, 7777.0f);
      }
      set(&released);
      wait_for(&received);
      return loss.status();
    });
    EXPECT_NE(st[0].message().find("injected"), std::string::npos) << st[0];
    if (!destroy_first) {
      EXPECT_TRUE(st[1].ok()) << st[1];
    }
    return got;
  };
  const std::vector<float> want = run(false, "freed_control");
  ASSERT_FALSE(want.empty());
  const std::vector<float> got = run(true, "freed_destroyed");
  if (got.empty()) return;  // withdrawn: fine
  ASSERT_EQ(got.size(), want.size());
  int differ = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      if (first < 0) first = static_cast<int>(i);
      ++differ;
    }
  }
  EXPECT_EQ(differ, 0) << differ << " of " << got.size()
                       << " received elements are not what stage 0 sent; first at " << first << ": "
                       << (first >= 0 ? got[first] : 0.0f) << " instead of "
                       << (first >= 0 ? want[first] : 0.0f);
}

// ---------------------------------------------------------------------------
// Resources across steps.

// Device memory the pipeline runner allocates (gradient sums, stash slots)
// is made by the first step and reused: later steps hold no more.
TEST(PipelineRunnerTest, DeviceMemoryDoesNotGrowAcrossSteps) {
  graph::Graph g = PipelineTestModel("gpt");
  PipelineCase c = MakeSpec("gpt", {1, 1, 1}, 4, true, "dp");
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  HarnessOptions o;
  o.counting = true;
  std::vector<std::vector<int64_t>> live(lowered->programs.size());
  auto st = RunRanks(*lowered, "memory", o, [&](RankCtx& c) -> absl::Status {
    absl::Status s = c.runner->InitializeParameters();
    if (!s.ok()) return s;
    auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
    for (int step = 0; step < 4; ++step) {
      auto b = batches->Get(step);
      if (!b.ok()) return b.status();
      auto loss = c.pipe->RunStep(*b, step);
      if (!loss.ok()) return loss.status();
      live[c.rank].push_back(c.counting->live());
    }
    return absl::OkStatus();
  });
  for (size_t r = 0; r < st.size(); ++r) {
    ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
    ASSERT_EQ(live[r].size(), 4u);
    EXPECT_EQ(live[r][3], live[r][0]) << "rank " << r;
  }
}

// ---------------------------------------------------------------------------
// Checkpoint and resume of a pipeline plan: 2 steps, a checkpoint over the
// world communicator, 2 more steps resumed from it equal 4 steps straight
// (dropout on, AdamW with clipping).
TEST(PipelineRunnerTest, ResumedPipelineContinuesTheSameRun) {
  graph::Graph g = PipelineTestModel("gpt");
  PipelineCase c = MakeSpec("gpt", {1, 2}, 4, true, "dp");
  auto lowered = LowerPipeline(g, c);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  auto straight = Train(g, *lowered, "resume_straight", 4);
  ASSERT_TRUE(straight.ok()) << straight.status();

  const std::string ckpt = PipelineTestDir("resume_ckpt");
  v1::TrainerState trainer;
  trainer.set_seed(kPipelineSeed);
  trainer.set_global_batch(kPipelineBatch);
  trainer.set_data("synthetic");
  *trainer.mutable_optimizer() = hap::testing::EquivalenceOptimizer(true);
  trainer.set_graph_name(g.name());
  auto first = RunRanks(*lowered, "resume_first", {}, [&](RankCtx& c) -> absl::Status {
    auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
    executor::TrainOptions to;
    to.steps = 2;
    to.after_step = executor::checkpoint::SaveHook({ckpt, 0, 3, 2}, &lowered->programs, trainer,
                                                   nullptr, c.world);
    return executor::TrainRankWith(
               *c.runner,
               [&](const executor::Batch& b, int64_t step) { return c.pipe->RunStep(b, step); },
               *batches, to)
        .status();
  });
  for (size_t r = 0; r < first.size(); ++r) ASSERT_TRUE(first[r].ok()) << first[r];

  std::vector<TrainResult> resumed(lowered->programs.size());
  auto second = RunRanks(*lowered, "resume_second", {}, [&](RankCtx& c) -> absl::Status {
    auto reader = executor::checkpoint::CheckpointReader::Open(ckpt);
    if (!reader.ok()) return reader.status();
    auto batches = data::NewSyntheticBatches(g, kPipelineSeed);
    executor::TrainOptions to;
    to.first_step = 2;
    to.steps = 2;
    to.initialize = executor::checkpoint::ResumeHook(std::move(*reader), &g);
    auto r = executor::TrainRankWith(
        *c.runner, [&](const executor::Batch& b, int64_t step) { return c.pipe->RunStep(b, step); },
        *batches, to);
    if (!r.ok()) return r.status();
    resumed[c.rank] = *std::move(r);
    return absl::OkStatus();
  });
  for (size_t r = 0; r < second.size(); ++r) ASSERT_TRUE(second[r].ok()) << second[r];
  for (size_t r = 0; r < resumed.size(); ++r) {
    ASSERT_EQ(resumed[r].losses.size(), 2u);
    for (int s = 0; s < 2; ++s) {
      EXPECT_NEAR(resumed[r].losses[s], (*straight)[r].losses[2 + s],
                  1e-6 * std::abs((*straight)[r].losses[2 + s]))
          << "rank " << r << " step " << 2 + s;
    }
  }
  for (size_t r = 0; r < resumed.size(); ++r) {
    ASSERT_EQ(resumed[r].parameters.size(), (*straight)[r].parameters.size());
    for (size_t i = 0; i < resumed[r].parameters.size(); ++i) {
      const auto& a = resumed[r].parameters[i].value;
      const auto& b = (*straight)[r].parameters[i].value;
      ASSERT_EQ(a.num_elements(), b.num_elements());
      double worst = 0;
      for (int64_t k = 0; k < a.num_elements(); ++k) {
        worst = std::max(worst, std::abs(static_cast<double>(a.as<float>()[k]) -
                                         static_cast<double>(b.as<float>()[k])));
      }
      EXPECT_LE(worst, 1e-6) << "rank " << r << " " << resumed[r].parameters[i].name;
    }
  }
}

// Rank r of a two-stage MLP pipeline (one rank per stage, SGD without
// clipping), its ProgramRunner made, for PipelineRunner::Create to refuse
// layouts that disagree with it. Nothing here communicates: in-process
// communicators stand in for the world and the stage groups.
class PipelineCreateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto lowered = LowerPipeline(g_, MakeSpec("mlp", {1, 1}, 2, false, "dp"));
    ASSERT_TRUE(lowered.ok()) << lowered.status();
    lowered_ = *std::move(lowered);
    for (int r = 0; r < 2; ++r) {
      groups_.push_back(executor::NewInProcessGroup(1));
      auto runner = ProgramRunner::Create(lowered_.programs[r], *lowered_.micro, device_.get(),
                                          groups_.back()[0].get());
      ASSERT_TRUE(runner.ok()) << runner.status();
      runners_.push_back(*std::move(runner));
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(PipelineRunner::Create(runners_[r].get(), world_[r].get(), lowered_.layout).ok());
    }
  }
  void ExpectRefused(int rank, const executor::PipelineLayout& layout, const std::string& what) {
    auto pipe = PipelineRunner::Create(runners_[rank].get(), world_[rank].get(), layout);
    ASSERT_FALSE(pipe.ok()) << "rank " << rank << ": " << what;
    EXPECT_EQ(pipe.status().code(), absl::StatusCode::kInvalidArgument) << pipe.status();
    EXPECT_NE(pipe.status().message().find(what), std::string::npos) << pipe.status();
  }

  const graph::Graph g_ = PipelineTestModel("mlp");
  Lowered lowered_;
  std::vector<std::unique_ptr<Communicator>> world_ = executor::NewInProcessGroup(2);
  std::unique_ptr<Device> device_ = executor::NewCpuDevice(1);
  std::vector<std::vector<std::unique_ptr<Communicator>>> groups_;
  std::vector<std::unique_ptr<ProgramRunner>> runners_;
};

// Boundary pieces that do not describe what a rank receives are refused:
// a stage's pieces missing (the receive indexed an empty list), a list per
// stage short of a stage, or a PARTIAL piece smaller than the tensor
// (summed over the whole tensor's elements, it was read past its end).
TEST_F(PipelineCreateTest, BoundaryPiecesThatDoNotFitAreRefused) {
  executor::PipelineLayout layout = lowered_.layout;
  layout.output_pieces[0].clear();
  ExpectRefused(1, layout, "stage 0 gives 0 pieces of its output for its 1 ranks");
  layout = lowered_.layout;
  layout.input_grad_pieces.pop_back();
  ExpectRefused(0, layout, "pieces for 2 and 1 of its 2 stages");
  layout = lowered_.layout;
  executor::PipelineLayout::Piece& piece = layout.output_pieces[0][0];
  piece.kind = v1::TensorForm::PARTIAL;
  piece.shape[0] -= 1;
  ExpectRefused(1, layout, "rank 0's piece of stage 0's output (PARTIAL");
}

// A plan that clips by the global gradient norm whose stage programs were
// lowered without clipping: each stage's optimizer would update its
// parameters unclipped while the single-device step clips them all. (The
// other way round, a program that clips in a plan that does not, was
// refused already; a stage without parameters has no norm of its own.)
TEST_F(PipelineCreateTest, StagesThatDoNotClipInAPlanThatClipsAreRefused) {
  executor::PipelineLayout layout = lowered_.layout;
  layout.clip = true;
  for (int r = 0; r < 2; ++r) {
    ExpectRefused(r, layout, "the plan's optimizer clips by the global gradient norm");
  }
}

// A stage whose parameters are all frozen (a fine-tune's first layers) has
// PARAMETER buffers, no update and no norm: nothing of it to clip, and it
// is taken (it was refused as "computes no norm" once clipping was checked).
TEST_F(PipelineCreateTest, AStageThatUpdatesNoParameterNeedsNoNorm) {
  executor::PipelineLayout layout = lowered_.layout;
  layout.clip = true;
  v1::RankProgram frozen = lowered_.programs[0];
  auto* steps = frozen.mutable_steps();
  const int before = steps->size();
  steps->erase(std::remove_if(steps->begin(), steps->end(),
                              [](const v1::Step& st) {
                                return st.has_kernel() && (st.kernel().kernel() == "sgd_update" ||
                                                           st.kernel().kernel() == "adam_update");
                              }),
               steps->end());
  ASSERT_LT(steps->size(), before);
  bool has_parameters = false;
  for (const v1::Buffer& b : frozen.buffers()) has_parameters |= b.role() == v1::Buffer::PARAMETER;
  ASSERT_TRUE(has_parameters);
  auto runner = ProgramRunner::Create(frozen, *lowered_.micro, device_.get(), groups_[0][0].get());
  ASSERT_TRUE(runner.ok()) << runner.status();
  auto pipe = PipelineRunner::Create(runner->get(), world_[0].get(), layout);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
}

// A stage program that never writes what it sends (its copy into the
// boundary buffer retargeted) sent whatever the arena held there,
// uninitialised memory, as its output (stage 0) or its input's gradient
// (stage 1).
TEST_F(PipelineCreateTest, AStageThatNeverWritesWhatItSendsIsRefused) {
  for (int r = 0; r < 2; ++r) {
    v1::RankProgram p = lowered_.programs[r];
    const auto role = r == 0 ? v1::Buffer::STAGE_OUTPUT : v1::Buffer::STAGE_INPUT_GRADIENT;
    int sent = -1, writes = 0;
    for (const v1::Buffer& b : p.buffers()) {
      if (b.role() == role) sent = b.id();
    }
    ASSERT_GE(sent, 0);
    for (v1::Step& s : *p.mutable_steps()) {
      if (!s.has_kernel()) continue;
      v1::KernelCall& k = *s.mutable_kernel();
      for (int o = 0; o < k.outputs_size(); ++o) {
        if (k.outputs(o) != sent) continue;
        ASSERT_EQ(k.kernel(), "copy");
        k.set_outputs(o, k.inputs(0));  // a copy onto itself
        ++writes;
      }
    }
    ASSERT_EQ(writes, 1);
    auto runner = ProgramRunner::Create(p, *lowered_.micro, device_.get(), groups_[r][0].get());
    ASSERT_TRUE(runner.ok()) << runner.status();
    auto pipe = PipelineRunner::Create(runner->get(), world_[r].get(), lowered_.layout);
    ASSERT_FALSE(pipe.ok()) << "stage " << r;
    EXPECT_EQ(pipe.status().code(), absl::StatusCode::kInvalidArgument) << pipe.status();
    EXPECT_NE(pipe.status().message().find(
                  absl::StrCat("the program of stage ", r, " never writes its ")),
              std::string::npos)
        << pipe.status();
  }
}

// The buffers' lifetimes in the plan decide what the runner keeps across
// microbatches: a weight gradient whose declared last use ended inside
// backward (while the optimizer still reads it) was not summed over the
// microbatches, and the update used the last microbatch's gradient alone.
TEST_F(PipelineCreateTest, LifetimesThatDoNotHoldEveryUseAreRefused) {
  v1::RankProgram p = lowered_.programs[0];
  int grad = -1;
  for (const v1::Buffer& b : p.buffers()) {
    if (b.role() == v1::Buffer::GRADIENT && !b.persistent() && grad < 0) grad = b.id();
  }
  ASSERT_GE(grad, 0);
  v1::Buffer& b = *p.mutable_buffers(grad);
  b.set_last_use(b.first_use());
  auto runner = ProgramRunner::Create(p, *lowered_.micro, device_.get(), groups_[0][0].get());
  ASSERT_TRUE(runner.ok()) << runner.status();
  auto pipe = PipelineRunner::Create(runner->get(), world_[0].get(), lowered_.layout);
  ASSERT_FALSE(pipe.ok());
  EXPECT_EQ(pipe.status().code(), absl::StatusCode::kInvalidArgument) << pipe.status();
  EXPECT_NE(
      pipe.status().message().find(absl::StrCat("buffer '", b.tensor(), "' is used at step ")),
      std::string::npos)
      << pipe.status();
  EXPECT_NE(pipe.status().message().find(
                absl::StrCat(", outside its lifetime [", b.first_use(), ", ", b.first_use(), "]")),
            std::string::npos)
      << pipe.status();
}

// A plan whose pipeline has a stage without devices is refused by name
// (its receives would read nothing, and the last stage's first rank would
// not exist).
TEST(PipelineRunnerTest, AStageWithoutDevicesIsRefused) {
  v1::Plan plan;
  plan.add_devices("cpu:0");
  plan.mutable_pipeline()->set_microbatches(2);
  v1::PipelineStage* s0 = plan.mutable_pipeline()->add_stages();
  s0->set_index(0);
  s0->add_devices("cpu:0");
  plan.mutable_pipeline()->add_stages()->set_index(1);
  auto layout = executor::PipelineLayoutOf(plan);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find("pipeline stage 1 has no devices"), std::string::npos)
      << layout.status();
}

}  // namespace
}  // namespace hap
