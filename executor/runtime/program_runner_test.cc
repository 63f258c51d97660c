// The interpreter refuses rank programs that are wrong, naming the buffer
// or step, and reports failures inside a step with the step and op.
#include "executor/runtime/program_runner.h"

#include <atomic>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "executor/cpu/cpu_device.h"
#include "executor/data/batches.h"
#include "executor/train/in_process_comm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

class ProgramRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto g = graph::BuildZooModel(
        "mlp", {{"layers", 2}, {"hidden", 8}, {"input", 4}, {"classes", 3}, {"batch", 5}});
    ASSERT_TRUE(g.ok());
    g_ = std::make_unique<graph::Graph>(*std::move(g));
    lower::LowerOptions o;
    o.optimizer.set_learning_rate(0.1);
    auto progs = lower::Lower(*g_, lower::SingleDeviceProgram(*g_), o);
    ASSERT_TRUE(progs.ok()) << progs.status();
    program_ = (*progs)[0];
    comms_ = NewInProcessGroup(1);
    device_ = NewCpuDevice(1);
  }
  absl::StatusOr<std::unique_ptr<ProgramRunner>> Create(const v1::RankProgram& p) {
    return ProgramRunner::Create(p, *g_, device_.get(), comms_[0].get());
  }
  int FirstStep(const std::string& kernel) {
    for (int i = 0; i < program_.steps_size(); ++i) {
      if (program_.steps(i).has_kernel() && program_.steps(i).kernel().kernel() == kernel) return i;
    }
    return -1;
  }

  std::unique_ptr<graph::Graph> g_;
  v1::RankProgram program_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::unique_ptr<Device> device_;
};

TEST_F(ProgramRunnerTest, RunsTheValidProgram) {
  auto r = Create(program_);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)->InitializeParameters().ok());
  auto batches = data::NewSyntheticBatches(*g_, 1);
  auto loss = (*r)->RunStep(*batches->Get(0), 0);
  ASSERT_TRUE(loss.ok()) << loss.status();
  // Cross-entropy over 3 classes starts near ln 3.
  EXPECT_NEAR(*loss, std::log(3.0), 0.5);
}

// A frozen constant listed by value (a VALUES initializer: runs of
// values) starts as those values, and a piece of it (a sharded plan's) as
// the elements at its offsets in the whole tensor.
TEST(ProgramRunnerInitTest, ValuesInitializerFillsTheListedElements) {
  graph::GraphBuilder b("values");
  graph::TensorId x = b.Input("x", {graph::DType::kFloat32, {2, 3}});
  graph::TensorId c =
      b.Parameter("c", {graph::DType::kFloat32, {2, 3}},
                  graph::Initializer::Values({0.5, -100, 7}, {2, 3, 1}), /*frozen=*/true);
  graph::TensorId y = b.Add("add", "plus", {x, c});
  b.SetLoss(b.Add("sum", "all", {y}, {{"axes", std::vector<int64_t>{}}}));
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  auto progs = lower::Lower(*g, lower::SingleDeviceProgram(*g), lower::LowerOptions());
  ASSERT_TRUE(progs.ok()) << progs.status();
  auto comms = NewInProcessGroup(1);
  auto device = NewCpuDevice(1);
  auto values_of_c = [&](const v1::RankProgram& p) -> std::vector<float> {
    auto r = ProgramRunner::Create(p, *g, device.get(), comms[0].get());
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    EXPECT_TRUE((*r)->InitializeParameters().ok());
    auto params = (*r)->Parameters();
    EXPECT_TRUE(params.ok()) << params.status();
    for (const ParameterShard& s : *params) {
      if (s.name != "c") continue;
      const float* v = s.value.as<float>();
      return std::vector<float>(v, v + s.value.num_elements());
    }
    ADD_FAILURE() << "no parameter 'c'";
    return {};
  };
  EXPECT_EQ(values_of_c((*progs)[0]), (std::vector<float>{0.5, 0.5, -100, -100, -100, 7}));
  // The program's piece of c made its second row, [1, 3] at offsets [1, 0].
  v1::RankProgram piece = (*progs)[0];
  for (v1::Buffer& buf : *piece.mutable_buffers()) {
    if (buf.tensor() != "c") continue;
    buf.set_shape(0, 1);
    buf.set_offsets(0, 1);
  }
  EXPECT_EQ(values_of_c(piece), (std::vector<float>{-100, -100, 7}));
}

TEST_F(ProgramRunnerTest, RejectsAProgramForAnotherWorld) {
  program_.set_world_size(2);
  EXPECT_THAT(Create(program_), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("rank 0 of 2 but this executor is rank 0 of 1")));
}

TEST_F(ProgramRunnerTest, RejectsBuffersOutsideTheArena) {
  program_.mutable_buffers(3)->set_offset_bytes(program_.arena_bytes());
  EXPECT_THAT(Create(program_), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("buffer 3")));
  EXPECT_THAT(Create(program_), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("lies outside the arena")));
}

TEST_F(ProgramRunnerTest, RejectsUnknownKernelsAndMissingBuffers) {
  v1::RankProgram p = program_;
  int i = FirstStep("linear");
  ASSERT_GE(i, 0);
  p.mutable_steps(i)->mutable_kernel()->set_kernel("linear_v2");
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("kernel 'linear_v2'")));
  p = program_;
  p.mutable_steps(i)->mutable_kernel()->set_inputs(0, 9999);
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("buffer 9999 does not exist")));
}

// A fill's value that is not a number (the loss gradient's seed given as
// a string) filled 0: every gradient 0, a step that silently did nothing.
TEST_F(ProgramRunnerTest, RejectsAFillWhoseValueIsNotANumber) {
  v1::RankProgram p = program_;
  int seed = -1;
  for (int i = 0; i < p.steps_size(); ++i) {
    const v1::Step& s = p.steps(i);
    if (s.has_kernel() && s.kernel().kernel() == "fill" && s.kernel().attrs().count("value") &&
        s.kernel().attrs().at("value").f() == 1.0) {
      seed = i;
    }
  }
  ASSERT_GE(seed, 0);
  (*p.mutable_steps(seed)->mutable_kernel()->mutable_attrs())["value"].set_s("1.0");
  EXPECT_THAT(
      Create(p),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr(absl::StrCat("step ", seed, " (kernel 'fill'): attribute 'value'"))));
}

// Two buffers of one step laid over the same arena bytes: the kernel
// writes its output over the input it is still reading. Buffers used by
// one step are alive together, so a valid layout never overlaps them.
TEST_F(ProgramRunnerTest, RejectsAStepWhoseBuffersShareArenaBytes) {
  v1::RankProgram p = program_;
  const int i = FirstStep("linear");
  ASSERT_GE(i, 0);
  const int in = p.steps(i).kernel().inputs(0), out = p.steps(i).kernel().outputs(0);
  ASSERT_NE(in, out);
  p.set_arena_bytes(p.arena_bytes() + 4096);  // room for the moved buffer at any offset
  p.mutable_buffers(out)->set_offset_bytes(p.buffers(in).offset_bytes() + 4);
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr(absl::StrCat("step ", i, " (kernel 'linear'"))));
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr(absl::StrCat(" buffers ", std::min(in, out), " ('"))));
  EXPECT_THAT(Create(p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("which share arena bytes")));
}

TEST_F(ProgramRunnerTest, RejectsBuffersThatDoNotMatchTheModel) {
  v1::RankProgram p = program_;
  for (auto& b : *p.mutable_buffers()) {
    if (b.role() == v1::Buffer::PARAMETER) {
      b.set_tensor("no/such/weight");
      break;
    }
  }
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("names no parameter of model 'mlp'")));
  p = program_;
  p.mutable_buffers(0)->set_offsets(0, 1000);
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("is outside its tensor")));
}

TEST_F(ProgramRunnerTest, RejectsCollectivesWhoseShardsDoNotAddUp) {
  v1::RankProgram p = program_;
  v1::Step* s = p.add_steps();
  v1::CollectiveCall* c = s->mutable_collective();
  c->set_collective(v1::ALL_GATHER);
  c->set_input(0);
  c->set_output(0);
  c->set_dim(0);
  c->add_shard_sizes(1);
  c->set_tensor("x");
  EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("shard sizes do not add up")));
}

// A float32 SCRATCH buffer of `shape` appended to `p`, in arena bytes of
// its own (the arena grows); its id.
int AddScratch(v1::RankProgram& p, const std::vector<int64_t>& shape) {
  v1::Buffer* b = p.add_buffers();
  b->set_id(p.buffers_size() - 1);
  b->set_tensor(absl::StrCat("scratch", b->id()));
  b->set_dtype(v1::FLOAT32);
  b->set_role(v1::Buffer::SCRATCH);
  int64_t bytes = 4;
  for (int64_t d : shape) {
    b->add_shape(d);
    b->add_global_shape(d);
    b->add_offsets(0);
    bytes *= d;
  }
  b->set_offset_bytes(p.arena_bytes());
  p.set_arena_bytes(p.arena_bytes() + bytes);
  return b->id();
}

// A buffer's whole tensor is materialised on the host (a pipeline stage
// receives the whole activation, then takes its piece): its element count
// and bytes must fit int64 as the piece's do. f32[2^62] "holds" 2^64 bytes,
// which wrapped to an empty host tensor that the transfers indexed as
// f32[2^62].
TEST_F(ProgramRunnerTest, RejectsBuffersWhoseWholeTensorOverflows) {
  for (std::vector<int64_t> global : std::vector<std::vector<int64_t>>{
           {int64_t{1} << 62}, {int64_t{1} << 40, int64_t{1} << 40}}) {
    v1::RankProgram p = program_;
    const int id = AddScratch(p, std::vector<int64_t>(global.size(), 1));
    for (size_t d = 0; d < global.size(); ++d)
      p.mutable_buffers(id)->set_global_shape(d, global[d]);
    EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr(absl::StrCat("buffer ", id, " ('scratch", id,
                                                           "'): its whole tensor overflows"))))
        << graph::ShapeString(global);
  }
  // A negative whole dimension (which wrapped the bound check).
  v1::RankProgram p = program_;
  const int id = AddScratch(p, {1});
  p.mutable_buffers(id)->set_global_shape(0, std::numeric_limits<int64_t>::min());
  p.mutable_buffers(id)->set_offsets(0, 1);
  EXPECT_THAT(Create(p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is outside its tensor")));
}

// A collective's pieces share every dimension but those it splits or
// joins: a gather of f32[5,3] pieces into f32[5,8] would read 40 elements
// out of a 15-element buffer.
TEST_F(ProgramRunnerTest, RejectsCollectivesWhoseShapesDifferBeyondTheirDimensions) {
  auto with = [&](v1::Collective kind, std::vector<int64_t> in_shape,
                  std::vector<int64_t> out_shape) {
    v1::RankProgram p = program_;
    const int in = AddScratch(p, in_shape), out = AddScratch(p, out_shape);
    v1::CollectiveCall* c = p.add_steps()->mutable_collective();
    c->set_collective(kind);
    c->set_input(in);
    c->set_output(out);
    c->set_tensor("t");
    c->set_dim(0);
    c->add_shard_sizes(kind == v1::ALL_GATHER ? out_shape[0] : in_shape[0]);
    if (kind == v1::ALL_TO_ALL) {
      c->set_from_dim(1);
      c->add_from_shard_sizes(out_shape[1]);
    }
    return p;
  };
  EXPECT_THAT(Create(with(v1::ALL_GATHER, {5, 3}, {5, 8})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("f32[5,3] and f32[5,8] differ beyond dimension 0")));
  EXPECT_THAT(Create(with(v1::REDUCE_SCATTER, {5, 8}, {5, 3})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("f32[5,8] and f32[5,3] differ beyond dimension 0")));
  EXPECT_THAT(Create(with(v1::ALL_TO_ALL, {2, 2, 3}, {2, 2, 5})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("f32[2,2,3] and f32[2,2,5] differ beyond dimensions 0 and 1")));
  // The same calls with matching shapes are accepted.
  EXPECT_TRUE(Create(with(v1::ALL_GATHER, {5, 8}, {5, 8})).ok());
  EXPECT_TRUE(Create(with(v1::ALL_TO_ALL, {2, 2, 5}, {2, 2, 5})).ok());
}

// Shard sizes are lengths: none negative (another rank's surplus must not
// make up for it) and their sum not wrapping around int64 (INT64_MAX twice
// and 2 "added up" to an empty dimension, then the gather wrote past it).
TEST_F(ProgramRunnerTest, RejectsNegativeOrOverflowingShardSizes) {
  auto group = NewInProcessGroup(3);
  auto with = [&](std::vector<int64_t> in_shape, std::vector<int64_t> out_shape,
                  std::vector<int64_t> sizes) {
    v1::RankProgram p = program_;
    p.set_world_size(3);
    const int in = AddScratch(p, in_shape), out = AddScratch(p, out_shape);
    v1::CollectiveCall* c = p.add_steps()->mutable_collective();
    c->set_collective(v1::ALL_GATHER);
    c->set_input(in);
    c->set_output(out);
    c->set_tensor("t");
    for (int64_t x : sizes) c->add_shard_sizes(x);
    return ProgramRunner::Create(p, *g_, device_.get(), group[0].get());
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_THAT(with({2, 4}, {6, 4}, {2, -1, 1'000'000'000'004}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard size -1 of rank 1 is negative")));
  EXPECT_THAT(
      with({2, 4}, {0, 4}, {2, kMax, kMax}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard sizes overflow at rank 1")));
  EXPECT_TRUE(with({2, 4}, {6, 4}, {2, 1, 3}).ok());
}

// The clipping norm (plan.proto: f64[1]) is written back by the pipeline
// runner as one float64 after its sum over the stages: in an f32[1]
// buffer that wrote half of the double's bytes, a meaningless norm.
TEST_F(ProgramRunnerTest, RejectsANormBufferThatIsNotOneFloat64) {
  for (std::vector<int64_t> shape : std::vector<std::vector<int64_t>>{{1}, {2}}) {
    v1::RankProgram p = program_;
    const int id = AddScratch(p, shape);
    p.mutable_buffers(id)->set_role(v1::Buffer::NORM);
    if (shape[0] == 2) {
      p.mutable_buffers(id)->set_dtype(v1::FLOAT64);
      p.set_arena_bytes(p.arena_bytes() + 8);  // its second half
    }
    EXPECT_THAT(Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr(absl::StrCat("buffer ", id, " ('scratch", id,
                                                           "'): a clipping norm must be f64[1]"))));
  }
}

TEST_F(ProgramRunnerTest, RejectsBadCoalescedBuffers) {
  int f32 = -1, f32b = -1, integer = -1;
  for (const auto& b : program_.buffers()) {
    if (b.dtype() == v1::FLOAT32 && f32 >= 0 && f32b < 0) f32b = b.id();
    if (b.dtype() == v1::FLOAT32 && f32 < 0) f32 = b.id();
    if ((b.dtype() == v1::INT64 || b.dtype() == v1::INT32) && integer < 0) integer = b.id();
  }
  ASSERT_GE(f32b, 0);
  ASSERT_GE(integer, 0);
  auto with = [&](v1::Collective kind, int in, int out, int extra) {
    v1::RankProgram p = program_;
    v1::CollectiveCall* c = p.add_steps()->mutable_collective();
    c->set_collective(kind);
    c->set_input(in);
    c->set_output(out);
    c->set_tensor("bucket");
    c->add_coalesced(extra);
    return p;
  };
  EXPECT_THAT(Create(with(v1::ALL_REDUCE, f32, f32, 9999)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("coalesced buffer 9999 does not exist")));
  EXPECT_THAT(Create(with(v1::ALL_REDUCE, f32, f32, integer)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has another dtype")));
  EXPECT_THAT(Create(with(v1::BROADCAST, f32, f32, f32)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("for in-place ALL_REDUCE, ALL_GATHER and REDUCE_SCATTER only")));
  // Coalesced dim-0 gathers: every extra input needs an output and its
  // per-rank lengths, along dim 0, adding up.
  const v1::Buffer& fb = program_.buffers(f32b);
  auto gather = [&](int extra_out, std::vector<int64_t> extra_sizes, int dim) {
    v1::RankProgram p = with(v1::ALL_GATHER, f32, f32, f32b);
    v1::CollectiveCall* c = p.mutable_steps(p.steps_size() - 1)->mutable_collective();
    c->set_dim(dim);
    c->add_shard_sizes(program_.buffers(f32).shape(0));
    if (extra_out >= 0) c->add_coalesced_outputs(extra_out);
    for (int64_t x : extra_sizes) c->add_coalesced_shard_sizes(x);
    return p;
  };
  EXPECT_THAT(Create(gather(-1, {fb.shape(0)}, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("1 coalesced buffers, 0 coalesced outputs and 1 coalesced shard "
                                 "sizes do not match")));
  EXPECT_THAT(Create(gather(f32b, {}, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not match (world 1)")));
  EXPECT_THAT(Create(gather(f32b, {fb.shape(0) + 1}, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard sizes do not add up to dimension 0")));
  EXPECT_THAT(Create(gather(integer, {fb.shape(0)}, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has another dtype")));
  if (program_.buffers(f32).shape_size() > 1) {
    EXPECT_THAT(Create(gather(f32b, {fb.shape(0)}, 1)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be along dim 0")));
  }
  // A well-formed coalesced gather of one rank copies each shard into place.
  {
    auto r = Create(gather(f32b, {fb.shape(0)}, 0));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE((*r)->InitializeParameters().ok());
    auto batches = data::NewSyntheticBatches(*g_, 1);
    EXPECT_TRUE((*r)->RunStep(*batches->Get(0), 0).ok());
  }
  // A well-formed bucket of one world rank runs (the sum over one rank is
  // the buffer itself).
  auto r = Create(with(v1::ALL_REDUCE, f32, f32, f32b));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)->InitializeParameters().ok());
  auto batches = data::NewSyntheticBatches(*g_, 1);
  EXPECT_TRUE((*r)->RunStep(*batches->Get(0), 0).ok());
}

TEST_F(ProgramRunnerTest, BadBatchesAndKernelFailuresNameTheProblem) {
  auto r = Create(program_);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)->InitializeParameters().ok());
  data::GlobalBatch empty;
  EXPECT_THAT((*r)->RunStep(empty, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the batch has no input")));
  auto batch = *data::NewSyntheticBatches(*g_, 1)->Get(0);
  batch.at("x") = HostTensor(DType::kFloat32, {5, 5});
  EXPECT_THAT((*r)->RunStep(batch, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input 'x' is f32[5,5]")));
  batch = *data::NewSyntheticBatches(*g_, 1)->Get(0);
  batch.at("labels").as<int64_t>()[2] = 7;  // 3 classes
  auto loss = (*r)->RunStep(batch, 0);
  EXPECT_THAT(loss, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("training step 0")));
  EXPECT_THAT(loss, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cross_entropy")));
}

// A communicator of one rank that counts all-reduces, or fails them.
class OneRankComm : public Communicator {
 public:
  explicit OneRankComm(bool fail) : fail_(fail) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllReduce(TensorView) override {
    ++all_reduces;
    return fail_ ? absl::UnavailableError("peer 1 is gone") : absl::OkStatus();
  }
  absl::Status AllGather(TensorView, TensorView, absl::Span<const int64_t>, CommMethod) override {
    return absl::UnimplementedError("");
  }
  absl::Status ReduceScatter(TensorView, TensorView, absl::Span<const int64_t>,
                             CommMethod) override {
    return absl::UnimplementedError("");
  }
  absl::Status AllToAll(TensorView, absl::Span<const int64_t>, TensorView,
                        absl::Span<const int64_t>) override {
    return absl::UnimplementedError("");
  }
  absl::Status Broadcast(TensorView, int) override { return absl::UnimplementedError(""); }
  absl::Status Reduce(TensorView, TensorView, int) override { return absl::UnimplementedError(""); }
  absl::Status Barrier() override { return absl::OkStatus(); }
  std::atomic<int> all_reduces{0};

 private:
  const bool fail_;
};

// program_ with an asynchronous in-place all-reduce of the first weight
// gradient started after its last backward write, and its wait (or none)
// before the optimizer reads it.
class AsyncProgramTest : public ProgramRunnerTest {
 protected:
  void SetUp() override {
    ProgramRunnerTest::SetUp();
    for (const auto& b : program_.buffers()) {
      if (b.role() == v1::Buffer::GRADIENT && b.tensor() == "layer0/fc/weight#grad") grad_ = b.id();
    }
    ASSERT_GE(grad_, 0);
    int first_update = -1;
    for (int i = 0; i < program_.steps_size(); ++i) {
      if (program_.steps(i).phase() == v1::Step::OPTIMIZER && first_update < 0) first_update = i;
    }
    ASSERT_GT(first_update, 0);
    // Steps [0, first_update), start, wait, the optimizer.
    v1::RankProgram p = program_;
    p.clear_steps();
    for (int i = 0; i < first_update; ++i) *p.add_steps() = program_.steps(i);
    start_ = p.steps_size();
    v1::Step* s = p.add_steps();
    s->set_phase(v1::Step::GRADIENT_SYNC);
    s->mutable_collective()->set_collective(v1::ALL_REDUCE);
    s->mutable_collective()->set_input(grad_);
    s->mutable_collective()->set_output(grad_);
    s->mutable_collective()->set_tensor("layer0/fc/weight#grad");
    s->mutable_collective()->set_async(true);
    wait_ = p.steps_size();
    p.add_steps()->mutable_wait()->set_start_step(start_);
    for (int i = first_update; i < program_.steps_size(); ++i) *p.add_steps() = program_.steps(i);
    async_program_ = p;
  }
  // A runner of async_program_ whose communication thread talks through
  // `comm`, initialised.
  absl::StatusOr<std::unique_ptr<ProgramRunner>> CreateAsync(std::unique_ptr<Communicator> comm) {
    async_ = NewCommThread(device_.get(), std::move(comm));
    RunnerOptions ro;
    ro.async = async_.get();
    HAP_ASSIGN_OR_RETURN(
        auto r, ProgramRunner::Create(async_program_, *g_, device_.get(), comms_[0].get(), ro));
    HAP_RETURN_IF_ERROR(r->InitializeParameters());
    return r;
  }
  int grad_ = -1, start_ = -1, wait_ = -1;
  std::unique_ptr<AsyncCollectives> async_;
  v1::RankProgram async_program_;
};

TEST_F(AsyncProgramTest, RunsStartedCollectivesOnTheCommunicationThread) {
  auto own = std::make_unique<OneRankComm>(false);
  OneRankComm* counted = own.get();
  auto r = CreateAsync(std::move(own));
  ASSERT_TRUE(r.ok()) << r.status();
  auto batches = data::NewSyntheticBatches(*g_, 1);
  for (int step = 0; step < 2; ++step) {
    auto loss = (*r)->RunStep(*batches->Get(step), step);
    ASSERT_TRUE(loss.ok()) << loss.status();
  }
  EXPECT_EQ(counted->all_reduces.load(), 2);
  // Without a communication thread the same program runs it in line.
  auto inline_runner = Create(async_program_);
  ASSERT_TRUE(inline_runner.ok()) << inline_runner.status();
  ASSERT_TRUE((*inline_runner)->InitializeParameters().ok());
  EXPECT_TRUE((*inline_runner)->RunStep(*batches->Get(0), 0).ok());
}

TEST_F(AsyncProgramTest, AFailedCollectiveFailsTheStepAtItsWaitAndEveryLaterOne) {
  auto r = CreateAsync(std::make_unique<OneRankComm>(true));
  ASSERT_TRUE(r.ok()) << r.status();
  auto batches = data::NewSyntheticBatches(*g_, 1);
  auto first = (*r)->RunStep(*batches->Get(0), 0);
  EXPECT_THAT(first, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 1 is gone")));
  EXPECT_THAT(first,
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr(absl::StrCat("step ", wait_, " (wait for step ", start_, ")"))));
  EXPECT_THAT((*r)->RunStep(*batches->Get(1), 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("failed before")));
}

TEST_F(AsyncProgramTest, RejectsMissingWaitsAndStepsTouchingBuffersInFlight) {
  // The program cut after the start.
  v1::RankProgram no_wait = async_program_;
  no_wait.mutable_steps()->DeleteSubrange(wait_, no_wait.steps_size() - wait_);
  EXPECT_THAT(Create(no_wait),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is never waited for")));
  // The wait moved past the optimizer's first read of the gradient.
  v1::RankProgram late = async_program_;
  late.mutable_steps()->DeleteSubrange(wait_, 1);
  *late.add_steps() = async_program_.steps(wait_);
  EXPECT_THAT(Create(late),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat(
                           "touches buffer ", grad_,
                           " ('layer0/fc/weight#grad') of the asynchronous step ", start_))));
  v1::RankProgram stray = async_program_;
  stray.mutable_steps(wait_)->mutable_wait()->set_start_step(0);
  EXPECT_THAT(Create(stray), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("no asynchronous collective started at step 0")));
}

// Buffers share the arena; one whose bytes overlap a buffer of a
// collective in flight is as much the communication thread's as that
// buffer itself: a step between the start and its wait that writes it
// races with the collective.
TEST_F(AsyncProgramTest, RejectsStepsTouchingTheArenaBytesOfBuffersInFlight) {
  const v1::Buffer& grad = async_program_.buffers(grad_);
  auto with_fill_at = [&](int64_t offset_bytes) {
    v1::RankProgram p = async_program_;
    const int alias = AddScratch(p, {1});
    p.mutable_buffers(alias)->set_offset_bytes(offset_bytes);
    v1::Step fill;
    fill.set_phase(v1::Step::GRADIENT_SYNC);
    fill.mutable_kernel()->set_kernel("fill");
    fill.mutable_kernel()->add_outputs(alias);
    // Between the start and its wait.
    p.mutable_steps()->Add(std::move(fill));
    for (int i = p.steps_size() - 1; i > wait_; --i) p.mutable_steps()->SwapElements(i, i - 1);
    return p;
  };
  int64_t elements = 1;
  for (int64_t d : grad.shape()) elements *= d;
  const int64_t last_float = grad.offset_bytes() + 4 * (elements - 1);
  for (int64_t at : {grad.offset_bytes(), last_float}) {
    EXPECT_THAT(Create(with_fill_at(at)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("shares arena bytes with buffer ", grad_,
                                                " ('layer0/fc/weight#grad') of the asynchronous "
                                                "step ",
                                                start_))))
        << "at byte " << at;
  }
  // Just past the gradient's bytes: no overlap.
  auto past = Create(with_fill_at(last_float + 4));
  EXPECT_TRUE(past.ok()) << past.status();
}

}  // namespace
}  // namespace hap::executor
