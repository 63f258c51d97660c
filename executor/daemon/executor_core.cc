#include "executor/daemon/executor_core.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "common/training_checks.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/data/batches.h"
#include "executor/data/user_data.h"
#include "executor/data/wikitext.h"
#include "executor/runtime/async_collectives.h"
#include "executor/runtime/program_runner.h"
#include "executor/runtime/timing_device.h"
#include "executor/train/backend.h"
#include "executor/train/pipeline.h"
#include "executor/train/trainer.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/plan_file.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

// The communicator a runner is validated and created with at LoadPlan, when
// the peers are not connected yet; the training thread attaches the real
// one (Gloo) for the duration of training. Calls without one are
// FailedPrecondition.
class DeferredCommunicator : public Communicator {
 public:
  DeferredCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  void Attach(Communicator* c) { target_ = c; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduce(TensorView buf) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->AllReduce(buf);
  }
  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod method) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->AllGather(in, out, counts, method);
  }
  absl::Status ReduceScatter(TensorView in, TensorView out,
                             absl::Span<const int64_t> counts, CommMethod method) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->ReduceScatter(in, out, counts, method);
  }
  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts, TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->AllToAll(in, send_counts, out, recv_counts);
  }
  absl::Status Broadcast(TensorView buf, int root) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->Broadcast(buf, root);
  }
  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->Reduce(in, out, root);
  }
  absl::Status Barrier() override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->Barrier();
  }

 private:
  absl::Status Check() const {
    if (target_ != nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError("the ranks are not connected (training not started)");
  }
  const int rank_;
  const int size_;
  Communicator* target_ = nullptr;
};

// The runner's asynchronous collectives (a plan lowered with overlap) for a
// plan loaded before the ranks connect: the communication thread, with the
// rank's second communicator, is attached when training connects and
// dropped when it ends.
class DeferredAsync : public AsyncCollectives {
 public:
  void Attach(std::unique_ptr<AsyncCollectives> a) { target_ = std::move(a); }
  absl::Status Start(int id, Work work) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->Start(id, std::move(work));
  }
  absl::Status Wait(int id) override {
    HAP_RETURN_IF_ERROR(Check());
    return target_->Wait(id);
  }
  absl::Status WaitAll() override { return target_ == nullptr ? absl::OkStatus() : target_->WaitAll(); }

 private:
  absl::Status Check() const {
    if (target_ != nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError("the ranks are not connected (no training running)");
  }
  std::unique_ptr<AsyncCollectives> target_;
};

// "dns:///h:p", "dns://resolver/h:p", "ipv4:h:p", "ipv6:[h]:p" and "h:p"
// name the same planner (gRPC's target schemes, which --planner accepts;
// the planner advertises a bare "h:p").
std::string NormalizeAddress(absl::string_view a) {
  if (absl::ConsumePrefix(&a, "dns:")) {
    // "dns://AUTHORITY/h:p" names the DNS server, not the planner.
    if (absl::ConsumePrefix(&a, "//")) {
      const size_t slash = a.find('/');
      a.remove_prefix(slash == absl::string_view::npos ? a.size() : slash + 1);
    }
  } else if (!absl::ConsumePrefix(&a, "ipv4:")) {
    absl::ConsumePrefix(&a, "ipv6:");
  }
  return std::string(a);
}

bool Ended(v1::ExecutorStatus::State s) {
  return s == v1::ExecutorStatus::FINISHED || s == v1::ExecutorStatus::FAILED;
}

absl::StatusOr<std::unique_ptr<data::BatchSource>> MakeBatches(const graph::Graph& g,
                                                               const v1::Plan& plan,
                                                               const v1::TrainingConfig& t,
                                                               const std::string& data_dir,
                                                               std::optional<uint64_t> data_seed) {
  if (!t.data_spec().empty()) {
    data::DataOptions o;
    if (t.shuffle()) o.shuffle_seed = t.shuffle_seed();
    return data::OpenUserData(t.data_spec(), g, o);
  }
  if (t.shuffle()) {
    return absl::InvalidArgumentError("shuffle applies to data_spec (npy:, tokens:) data only");
  }
  switch (t.data()) {
    case v1::TrainingConfig::DATA_SOURCE_UNSPECIFIED:
    case v1::TrainingConfig::SYNTHETIC:
      return data::NewSyntheticBatches(g, data_seed.value_or(plan.options().seed()));
    case v1::TrainingConfig::WIKITEXT2: {
      // data_path: the split's file (its directory holds the others), or a
      // WikiText-2 directory; empty: <data_dir>/wikitext-2.
      std::string dir = t.data_path().empty() ? data_dir + "/wikitext-2" : t.data_path();
      std::string corpus_file = dir + "/valid.txt";
      std::error_code ec;
      if (!t.data_path().empty() && std::filesystem::is_regular_file(t.data_path(), ec)) {
        corpus_file = t.data_path();
        dir = std::filesystem::path(t.data_path()).parent_path().string();
        if (dir.empty()) dir = ".";
      }
      HAP_ASSIGN_OR_RETURN(data::Vocabulary vocab,
                           data::Vocabulary::Build(data::WikiText2Files(dir)));
      HAP_ASSIGN_OR_RETURN(std::vector<int64_t> corpus, vocab.Encode(corpus_file));
      return data::NewLmBatches(g, std::move(corpus));
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown data source ", static_cast<int>(t.data())));
  }
}

// The rendezvous store of one training run, which ends its waits once the
// run is cancelled (StopTraining, SIGTERM): a rank whose peers never come
// would otherwise wait in the store for the whole communicator timeout, the
// Stop give up on it as a stuck step after stop_wait, and its thread stay
// behind. Long waits are polled in slices of kSlice for that; Sets and
// polls (a Get of no timeout) pass.
class CancellableStore : public RendezvousStore {
 public:
  static constexpr absl::Duration kSlice = absl::Milliseconds(200);
  CancellableStore(std::unique_ptr<RendezvousStore> store, std::function<bool()> cancelled)
      : store_(std::move(store)), cancelled_(std::move(cancelled)) {}

  // Not refused once cancelled: a rank that gives up sets the abort key,
  // which tells the peers still connecting to it to give up too (they
  // would wait in Gloo's connect for the communicator timeout).
  absl::Status Set(const std::string& key, const std::string& value) override {
    return store_->Set(key, value);
  }
  // Gloo's connect polls it while a pair waits for its peer's connection.
  bool Cancelled() override { return cancelled_(); }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    // A poll passes even once cancelled: Gloo's abort watcher polls for the
    // abort key a peer that gave up sets, and must still see it.
    if (timeout <= absl::ZeroDuration()) return store_->Get(key, timeout);
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      HAP_RETURN_IF_ERROR(Check(key));
      const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
      if (left <= kSlice) {
        absl::StatusOr<std::string> v = store_->Get(key, left);
        if (!absl::IsDeadlineExceeded(v.status()) || timeout <= kSlice) return v;
        return absl::DeadlineExceededError(absl::StrCat(v.status().message(), " (waited ",
                                                        absl::FormatDuration(timeout), " in all)"));
      }
      absl::StatusOr<std::string> v = store_->Get(key, kSlice);
      if (v.ok() || !absl::IsDeadlineExceeded(v.status())) return v;
    }
  }

 private:
  absl::Status Check(const std::string& key) const {
    if (!cancelled_()) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrCat("training was stopped while the ranks met (rendezvous key '", key, "')"));
  }
  const std::unique_ptr<RendezvousStore> store_;
  const std::function<bool()> cancelled_;
};

google::protobuf::Timestamp ToTimestamp(absl::Time t) {
  const int64_t ns = absl::ToUnixNanos(t);
  google::protobuf::Timestamp ts;
  ts.set_seconds(ns / 1'000'000'000);
  ts.set_nanos(static_cast<int32_t>(ns % 1'000'000'000));
  return ts;
}

}  // namespace

struct ExecutorCore::Loaded {
  LoadOptions options;
  graph::Graph graph;
  std::unique_ptr<Device> device;
  std::string backend;  // device->name(), kept once the device is freed
  // Times every kernel call of `device` (the runner runs on it) when the
  // load is profiled; null otherwise.
  std::unique_ptr<TimingDevice> timing;
  std::unique_ptr<DeferredCommunicator> comm;
  std::unique_ptr<data::BatchSource> batches;
  // A pipeline plan (README "Pipeline plans"): the rank's stage, the model
  // at the microbatch size (the runner's graph), and the communicator of
  // every rank (the stages' point-to-point transfers, the checkpoint's
  // commit; null for SPMD plans); `comm` is the stage group's then.
  PipelineRank at;
  std::unique_ptr<DeferredCommunicator> world;
  bool pipelined() const { return world != nullptr; }
  // A plan lowered with overlap: its started collectives run on a
  // communication thread attached while training (null otherwise).
  std::unique_ptr<DeferredAsync> async;
  std::unique_ptr<ProgramRunner> runner;  // uses graph (or at.micro), device, comm, async
  std::deque<v1::StepMetric> metrics;     // guarded by the core's mu_
  v1::StepProfile profile;                // guarded by mu_; the latest window
  // The window being timed (the training thread's): its first step and
  // its steps' seconds.
  int64_t window_first = 0;
  std::vector<double> window;
  // Where training starts (a checkpoint or weights; empty: initialisers)
  // and the checkpoints it writes.
  int64_t first_step = 0;
  // The seed of the synthetic data: a resumed run's checkpoint's, so that it
  // reads the batches the run it continues would have read.
  std::optional<uint64_t> data_seed;
  // Where training starts, which the ranks compare once connected.
  TrainingStart start;
  std::function<absl::Status(ProgramRunner&)> initialize;
  std::vector<v1::RankProgram> programs;  // every rank's, for the checkpoint index
  std::function<absl::Status(ProgramRunner&, int64_t)> after_step;
  // Set by Stop; read by the training thread between steps.
  std::atomic<bool> cancelled{false};
  // The step whose checkpoint the training thread is saving, -1 when none:
  // an abandoned save is named as such, not blamed on a collective.
  std::atomic<int64_t> saving_after{-1};
  // When the first Stop of this load came (guarded by mu_): the step in
  // progress is abandoned stop_wait after it, whatever the callers' deadlines.
  absl::Time stop_asked = absl::InfiniteFuture();
  // Who cancelled (guarded by mu_), for the error: "stopped by <who>".
  std::string stopped_by = "StopTraining";
  // Set (under the core's mu_) when Stop gave up waiting for the step in
  // progress: the thread's later steps, metrics and end change nothing.
  std::atomic<bool> abandoned{false};
  std::atomic<bool> ended{false};  // the training thread is about to return
  // How training ended, set (under mu_) before on_end runs, so that a Stop
  // during on_end reports it rather than an abandoned step.
  bool trained = false;
  v1::ExecutorStatus::State final_state = v1::ExecutorStatus::FAILED;
  std::string final_error;
  absl::StatusCode final_code = absl::StatusCode::kOk;  // of final_error
  ~Loaded() { runner.reset(); }    // before what it points into
};

struct ExecutorCore::Retired {
  std::thread thread;
  std::shared_ptr<Loaded> loaded;
};

absl::Status ExecutorCore::SetUpDataAndCheckpoints(const LoadOptions& in, Loaded* loaded) {
  namespace ckpt = checkpoint;
  const v1::TrainingConfig& t = in.training;
  const graph::Graph* g = &loaded->graph;
  std::optional<v1::TrainerState> resumed;       // the checkpoint's
  std::shared_ptr<ckpt::WeightsReader> weights;  // training.init_weights
  loaded->start = InitializersStart(in.plan.options().seed());
  if (!t.resume().empty()) {
    auto reader = ckpt::CheckpointReader::Open(t.resume());
    if (!reader.ok()) return Annotate(reader.status(), "training.resume");
    HAP_RETURN_IF_ERROR(Annotate((*reader)->CheckGraph(*g), "training.resume"));
    v1::TrainerState run;  // the data settings, as below
    run.set_global_batch(in.plan.global_batch());
    run.set_data(t.data_spec().empty() ? v1::TrainingConfig::DataSource_Name(t.data())
                                       : t.data_spec());
    run.set_shuffle(t.shuffle());
    run.set_shuffle_seed(t.shuffle_seed());
    HAP_RETURN_IF_ERROR(
        Annotate(ckpt::CheckDataSettings((*reader)->trainer(), run), "training.resume"));
    resumed = (*reader)->trainer();
    loaded->first_step = (*reader)->trainer().step();
    loaded->data_seed = (*reader)->trainer().seed();
    loaded->start = CheckpointStart((*reader)->trainer(), (*reader)->step_dir());
    if (loaded->first_step >= t.steps()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "training.resume: the checkpoint ", (*reader)->step_dir(), " is at step ",
          loaded->first_step, ", not before training.steps ", t.steps(), ": nothing to train"));
    }
    // Its shards are read when training starts: a damaged one (a checksum
    // that does not match, DataLoss) fails the rank before its first step,
    // which the planner reads as the checkpoint's fault (error_code).
    loaded->initialize = [hook = ckpt::ResumeHook(*std::move(reader), g)](ProgramRunner& r) {
      return Annotate(hook(r), "training.resume");
    };
  } else if (!t.init_weights().empty()) {
    auto w = ckpt::WeightsReader::OpenFor(t.init_weights(), *g);
    if (!w.ok()) return Annotate(w.status(), "training.init_weights");
    weights = *std::move(w);
    absl::StatusOr<std::string> identity = ckpt::WeightsFileIdentity(t.init_weights());
    if (!identity.ok()) return Annotate(identity.status(), "training.init_weights");
    loaded->start = {*identity, absl::StrCat("training.init_weights ", t.init_weights())};
    loaded->initialize = ckpt::InitWeightsHook(weights, g);
  }
  // The training data, once its seed is known (a resumed run's is its
  // checkpoint's): its size is compared with the checkpoint's and recorded
  // in new ones.
  {
    auto b = MakeBatches(loaded->graph, in.plan, t, o_.data_dir, loaded->data_seed);
    if (!b.ok()) return Annotate(b.status(), "training data");
    loaded->batches = *std::move(b);
  }
  if (resumed) {
    v1::TrainerState run = *resumed;
    run.set_data_size(loaded->batches->data_size());
    HAP_RETURN_IF_ERROR(Annotate(ckpt::CheckDataSettings(*resumed, run), "training.resume"));
  }
  if (!t.checkpoint_dir().empty()) {
    // Made now: found at the first save, the run (with checkpoint_every 0,
    // all of it) would be lost.
    std::error_code ec;
    std::filesystem::create_directories(t.checkpoint_dir(), ec);
    if (!ec && access(t.checkpoint_dir().c_str(), W_OK | X_OK) != 0) {
      ec.assign(errno, std::generic_category());
    }
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("training.checkpoint_dir '", t.checkpoint_dir(),
                       "' cannot be made or written on ", o_.device_id, ": ", ec.message()));
    }
    loaded->programs.assign(in.plan.rank_programs().begin(), in.plan.rank_programs().end());
    v1::TrainerState trainer;
    // A resumed run continues its checkpoint's seed (data and dropout).
    trainer.set_seed(loaded->data_seed.value_or(in.plan.options().seed()));
    trainer.set_global_batch(in.plan.global_batch());
    trainer.set_data(t.data_spec().empty() ? v1::TrainingConfig::DataSource_Name(t.data())
                                           : t.data_spec());
    trainer.set_data_size(loaded->batches->data_size());
    trainer.set_shuffle(t.shuffle());
    trainer.set_shuffle_seed(t.shuffle_seed());
    *trainer.mutable_optimizer() = in.plan.options().optimizer();
    trainer.set_graph_name(g->name());
    trainer.set_graph_hash(in.plan.graph_hash());
    trainer.set_plan_name(in.plan.name());
    trainer.set_plan_hash(in.plan.content_hash());
    if (auto it = g->metadata().find(ckpt::kStateDictSlicesKey); it != g->metadata().end()) {
      trainer.set_state_dict_slices(it->second);
    }
    if (auto it = g->metadata().find(ckpt::kStateDictExtrasKey); it != g->metadata().end()) {
      trainer.set_state_dict_extras(it->second);
    }
    HAP_RETURN_IF_ERROR(
        Annotate(ckpt::SetStartCounters(resumed ? &*resumed : nullptr, weights.get(), &trainer),
                 "training.init_weights"));
    ckpt::CheckpointPolicy policy;
    policy.dir = t.checkpoint_dir();
    policy.every = t.checkpoint_every();
    policy.keep = t.checkpoint_keep() > 0 ? t.checkpoint_keep() : ckpt::kDefaultKeep;
    policy.last_step = t.steps();
    // Fresh (step 0) or resumed: the committed checkpoints past it are of a
    // run this one replaces.
    policy.resumed_from = loaded->first_step;
    // A thread of a run this one replaced, still saving, keeps to its own
    // temporary directory.
    policy.run_id = absl::StrCat(in.deployment, "-g", in.generation);
    loaded->after_step =
        ckpt::SaveHook(policy, &loaded->programs, trainer, nullptr, loaded->world.get());
  }
  return absl::OkStatus();
}

// The pipeline half of a load: the rank's stage and the model at the
// microbatch size, and the world communicator (connected when training
// starts).
absl::Status ExecutorCore::SetUpPipeline(const LoadOptions& in, Loaded* loaded) {
  HAP_ASSIGN_OR_RETURN(loaded->at, PipelineRankOf(in.plan, loaded->graph, in.rank));
  loaded->world = std::make_unique<DeferredCommunicator>(in.rank, in.world_size);
  return absl::OkStatus();
}

ExecutorCore::ExecutorCore(ExecutorCoreOptions options) : o_(std::move(options)) {}

ExecutorCore::~ExecutorCore() { Shutdown(); }

absl::StatusOr<std::string> ExecutorCore::LoadPlan(
    LoadOptions in, const std::function<absl::Status()>& check_caller) {
  // The caller may give up while the load takes time (a large graph, a
  // checkpoint, the corpus, the arena): then nothing is installed.
  auto caller_waits = [&check_caller](absl::string_view done) {
    if (!check_caller) return absl::OkStatus();
    return Annotate(check_caller(), absl::StrCat("LoadPlan abandoned ", done,
                                                 " (the plan was not installed; the executor "
                                                 "keeps its previous state)"));
  };
  int64_t ticket;  // the order this LoadPlan arrived in
  {
    absl::MutexLock l(&mu_);
    if (shutdown_) return absl::UnavailableError("the executor is shutting down");
    // Before anything is built: a second arena next to the one training
    // (on a GPU, out of memory for the run in progress).
    HAP_RETURN_IF_ERROR(RefuseWhileTraining());
    ticket = ++load_tickets_;
  }
  HAP_RETURN_IF_ERROR(caller_waits("before it began"));
  if (in.deployment.empty()) {
    return absl::InvalidArgumentError("LoadPlan needs a deployment name");
  }
  if (!o_.planner_address.empty() &&
      NormalizeAddress(in.rendezvous_address) != NormalizeAddress(o_.planner_address)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "this executor takes plans only from its planner at '", o_.planner_address,
        "', but this LoadPlan names rendezvous address '", in.rendezvous_address, "'"));
  }
  if (in.generation < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation must not be negative, got ", in.generation));
  }
  HAP_RETURN_IF_ERROR(
      Annotate(lower::CheckPlanForRank(in.plan, in.rank, in.world_size), "plan"));
  const v1::TrainingConfig& t = in.training;
  if (t.steps() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.steps must be positive, got ", t.steps()));
  }
  HAP_RETURN_IF_ERROR(CheckTrainingConfig(t));

  auto loaded = std::make_shared<Loaded>();
  HAP_ASSIGN_OR_RETURN(loaded->graph,
                       [&]() -> absl::StatusOr<graph::Graph> {
                         auto g = graph::FromProto(in.plan.graph());
                         if (!g.ok()) return Annotate(g.status(), "plan.graph");
                         return g;
                       }());
  HAP_RETURN_IF_ERROR(caller_waits("after reading the model graph"));
  if (lower::IsPipelinePlan(in.plan)) {
    HAP_RETURN_IF_ERROR(Annotate(SetUpPipeline(in, loaded.get()), "plan.pipeline"));
  }
  HAP_RETURN_IF_ERROR(SetUpDataAndCheckpoints(in, loaded.get()));
  HAP_RETURN_IF_ERROR(caller_waits("after opening the checkpoint or weights and the data"));
  const int threads = t.threads_per_rank() > 0 ? t.threads_per_rank() : std::max(1, o_.threads);
  std::string device_note;  // why the rank runs on another kind of device than planned
  if (o_.make_device) {
    loaded->device = o_.make_device(threads);
  } else {
    auto spec = ChooseDevice(o_.device, in.plan, in.rank, &device_note);
    if (!spec.ok()) return Annotate(spec.status(), "device");
    const DeviceSpec planned = PlannedDevice(in.plan, in.rank);
    if (device_note.empty() && planned.kind != spec->kind) {
      device_note = absl::StrCat("the plan places rank ", in.rank, " on ", planned.ToString(),
                                 " but this executor was started with --device ", o_.device);
    }
    auto device = MakeDevice(*spec, threads);
    if (!device.ok()) return Annotate(device.status(), "device");
    loaded->device = *std::move(device);
  }
  loaded->backend = loaded->device->name();
  loaded->comm = loaded->pipelined() ? std::make_unique<DeferredCommunicator>(
                                         loaded->at.group_rank, loaded->at.group_size)
                                   : std::make_unique<DeferredCommunicator>(in.rank, in.world_size);
  {
    Device* run_on = loaded->device.get();
    // (Pipeline plans too: their kernels run on the microbatch model's
    // stage programs, which calibration maps.) The profile names the plan's
    // device, whose calibration the planner fits to it: a rank the plan
    // puts on a GPU that runs on the CPU (--device cpu, a build without
    // CUDA) is not profiled, or the GPU would be calibrated with CPU times.
    if (o_.profile_window > 0 && !absl::StartsWith(run_on->name(), "cuda") &&
        PlannedDevice(in.plan, in.rank).kind == DeviceSpec::Kind::kCpu) {
      loaded->timing = std::make_unique<TimingDevice>(run_on);
      run_on = loaded->timing.get();
    }
    // Executors overlap what the plan was lowered to overlap.
    RunnerOptions ro;
    if (HasAsyncCollectives(in.plan.rank_programs(in.rank))) {
      loaded->async = std::make_unique<DeferredAsync>();
      ro.async = loaded->async.get();
    }
    auto r = ProgramRunner::Create(in.plan.rank_programs(in.rank),
                                   loaded->pipelined() ? loaded->at.micro : loaded->graph, run_on,
                                   loaded->comm.get(), ro);
    if (!r.ok()) return Annotate(r.status(), absl::StrCat("rank ", in.rank, "'s program"));
    loaded->runner = *std::move(r);
  }
  HAP_RETURN_IF_ERROR(caller_waits("after preparing the rank's program"));
  std::string hash = in.plan.content_hash();
  const std::string loaded_line =
      absl::StrCat("loaded ", in.deployment, " generation ", in.generation, ": rank ", in.rank,
                   " of ", in.world_size, " on ", loaded->backend, ", plan ", in.plan.name(),
                   device_note.empty() ? "" : absl::StrCat(" (", device_note, ")"));
  loaded->options = std::move(in);

  absl::MutexLock ops(&ops_mu_);
  {
    absl::MutexLock l(&mu_);
    if (shutdown_) return absl::UnavailableError("the executor is shutting down");
    HAP_RETURN_IF_ERROR(RefuseWhileTraining());  // started while this one loaded
    if (installed_ticket_ > ticket) {
      // Two LoadPlans raced and the later one was installed first: this
      // older plan must not replace it.
      return absl::AbortedError(
          absl::StrCat("a LoadPlan that came after this one was installed while this one loaded (",
                       installed_.deployment, " generation ", installed_.generation,
                       "); this plan was not installed"));
    }
  }
  JoinTrainingThread();  // a thread that ended may still be returning
  ReapRetired(/*all=*/false);
  // Last chance: after this the plan is installed.
  HAP_RETURN_IF_ERROR(caller_waits("before installing the plan"));
  std::shared_ptr<Loaded> old;
  {
    absl::MutexLock l(&mu_);
    old = std::move(loaded_);
    installed_ticket_ = ticket;
    installed_.deployment = loaded->options.deployment;
    installed_.generation = loaded->options.generation;
    loaded_ = std::move(loaded);
    ++load_id_;
    state_ = v1::ExecutorStatus::LOADED;
    steps_completed_ = 0;
    last_loss_ = 0;
    error_.clear();
    error_code_ = absl::StatusCode::kOk;
  }
  Log(loaded_line);
  return hash;  // `old` is freed here (unless a retired thread holds it)
}

void ExecutorCore::Log(const std::string& line) const {
  if (o_.log) o_.log(line);
}

absl::Status ExecutorCore::RefuseWhileTraining() const {
  if (state_ != v1::ExecutorStatus::TRAINING) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("training ", loaded_->options.deployment,
                                                    " generation ", loaded_->options.generation,
                                                    "; stop it before loading another plan"));
}

absl::Status ExecutorCore::CheckDeployment(const std::string& deployment) const {
  if (loaded_ == nullptr) {
    return absl::FailedPreconditionError("no plan is loaded; call LoadPlan first");
  }
  if (!deployment.empty() && deployment != loaded_->options.deployment) {
    return absl::NotFoundError(absl::StrCat("this executor holds deployment '",
                                            loaded_->options.deployment, "', not '",
                                            deployment, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ExecutorStatus> ExecutorCore::Start(const std::string& deployment) {
  absl::MutexLock ops(&ops_mu_);
  absl::MutexLock l(&mu_);
  if (shutdown_) return absl::UnavailableError("the executor is shutting down");
  HAP_RETURN_IF_ERROR(CheckDeployment(deployment));
  switch (state_) {
    case v1::ExecutorStatus::LOADED:
      break;
    case v1::ExecutorStatus::TRAINING:
      return StatusLocked();  // a retried Start
    default:
      return absl::FailedPreconditionError(absl::StrCat(
          "training of ", loaded_->options.deployment, " generation ",
          loaded_->options.generation, " has already ended (",
          v1::ExecutorStatus::State_Name(state_),
          "); load the plan again, as a new generation, to train again"));
  }
  if (!o_.make_store) {
    return absl::FailedPreconditionError(
        "this executor has no rendezvous store configured (no planner)");
  }
  state_ = v1::ExecutorStatus::TRAINING;
  std::shared_ptr<Loaded> loaded = loaded_;
  const int64_t id = load_id_;
  thread_ = std::thread([this, loaded, id] { Train(loaded, id); });
  return StatusLocked();
}

namespace {

// Every log_every-th step of the run (counted from its first), and its last.
bool LogStep(const v1::TrainingConfig& t, int64_t first_step, int64_t step) {
  constexpr int64_t kDefaultLogEvery = 100;
  const int64_t every = t.log_every() > 0 ? t.log_every() : kDefaultLogEvery;
  return (step + 1 - first_step) % every == 0 || step + 1 == t.steps();
}

}  // namespace

void ExecutorCore::Train(std::shared_ptr<Loaded> loaded, int64_t load_id) {
  const LoadOptions& lo = loaded->options;
  const int64_t steps = lo.training.steps();
  const std::string run =
      absl::StrCat(lo.deployment, " generation ", lo.generation, " rank ", lo.rank);
  Log(absl::StrCat(run, ": training steps ", loaded->first_step, " to ", steps - 1,
                   loaded->first_step > 0 ? " (resumed)" : ""));
  absl::Status s = [&]() -> absl::Status {
    HAP_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> made, o_.make_store(lo));
    auto store = std::make_unique<CancellableStore>(std::move(made),
                                                    [&loaded] { return loaded->cancelled.load(); });
    GlooOptions go;
    go.rank = lo.rank;
    go.size = lo.world_size;
    go.prefix = absl::StrCat(lo.deployment, "/", lo.generation);
    go.hostname = o_.gloo_hostname;
    go.timeout = o_.comm_timeout;
    // The ranks compare their programs' collectives (CheckProgramsAgree,
    // below) before any runs, so each collective's own agreement on the
    // call is skipped (bench/comm_bench.sh --call-check: up to 1.3x a
    // small collective).
    go.check_calls = false;
    absl::StatusOr<std::unique_ptr<Communicator>> world;
    const GlooOptions all_ranks = go;
    if (loaded->pipelined()) {
      // Every rank over Gloo for the stages' transfers, then the stage's
      // group on the backend (as hap-launch does).
      const GlooOptions wo = PipelineWorldOptions(go);
      world = o_.connect ? o_.connect(wo, *store) : ConnectGloo(wo, *store);
      if (!world.ok()) return Annotate(world.status(), "connecting the ranks (world)");
      loaded->world->Attach(world->get());
      go = PipelineGroupOptions(go, loaded->at);
    }
    auto comm = o_.connect ? o_.connect(go, *store) : ConnectBackend(*loaded->device, go, *store);
    if (!comm.ok()) return Annotate(comm.status(), "connecting the ranks");
    loaded->comm->Attach(comm->get());
    // The ranks compare their programs through the store their
    // communicators met in (an injected connect's, a test's in-process
    // group, meets in none).
    if (!o_.connect) {
      HAP_RETURN_IF_ERROR(CheckProgramsAgree(lo.plan.rank_programs(lo.rank), go, *store));
      HAP_RETURN_IF_ERROR(CheckStartsAgree(loaded->start, all_ranks, *store));
    }
    if (loaded->async != nullptr) {
      // The second communicator of the overlapped collectives (as
      // hap-launch's ConnectOverlap; through o_.connect when given).
      std::unique_ptr<AsyncCollectives> thread;
      if (o_.connect) {
        GlooOptions ov = go;
        ov.prefix = absl::StrCat(go.prefix, "/overlap");
        auto c = o_.connect(ov, *store);
        if (!c.ok()) return Annotate(c.status(), "connecting the ranks (overlap)");
        thread = NewCommThread(loaded->device.get(), *std::move(c));
      } else {
        auto t = ConnectOverlap(*loaded->device, go, *store);
        if (!t.ok()) return Annotate(t.status(), "connecting the ranks (overlap)");
        thread = *std::move(t);
      }
      loaded->async->Attach(std::move(thread));
    }
    std::unique_ptr<PipelineRunner> pipe;
    if (loaded->pipelined()) {
      HAP_ASSIGN_OR_RETURN(pipe, PipelineRunner::Create(loaded->runner.get(), world->get(),
                                                        loaded->at.layout));
    }
    TrainOptions to;
    to.first_step = loaded->first_step;
    to.steps = steps - loaded->first_step;
    to.initialize = loaded->initialize;
    to.return_parameters = false;  // nothing here reads them (checkpoints save their own)
    if (loaded->after_step) {
      // No checkpoint from a retired thread: a new load may own the directory.
      to.after_step = [&loaded](ProgramRunner& runner, int64_t steps_done) {
        if (loaded->abandoned) return absl::OkStatus();
        loaded->saving_after = steps_done;
        absl::Status saved = loaded->after_step(runner, steps_done);
        loaded->saving_after = -1;
        return saved;
      };
    }
    to.cancelled = [&loaded] { return loaded->cancelled.load(); };
    to.on_step = [&](int64_t step, double loss, double seconds) {
      std::optional<v1::StepProfile> profile = NextProfile(*loaded, step, seconds);
      v1::StepMetric m;
      m.set_deployment(lo.deployment);
      m.set_rank(lo.rank);
      m.set_step(step);
      m.set_loss(loss);
      m.set_step_seconds(seconds);
      *m.mutable_time() = ToTimestamp(o_.now());
      {
        absl::MutexLock l(&mu_);
        if (load_id_ != load_id || loaded->abandoned) return;  // retired: report nothing
        steps_completed_ = step + 1;
        last_loss_ = loss;
        loaded->metrics.push_back(m);
        if (profile.has_value()) loaded->profile = *std::move(profile);
        while (loaded->metrics.size() > o_.max_kept_metrics) loaded->metrics.pop_front();
      }
      if (LogStep(lo.training, loaded->first_step, step)) {
        Log(absl::StrCat(run, ": step ", step, " loss ", absl::StrFormat("%.6g", loss), ", ",
                         absl::StrFormat("%.1f", seconds * 1e3), " ms"));
      }
      if (o_.on_step) o_.on_step(m);
    };
    auto r = pipe != nullptr
                 ? TrainRankWith(
                       *loaded->runner,
                       [&](const Batch& b, int64_t step) { return pipe->RunStep(b, step); },
                       *loaded->batches, to)
                 : TrainRank(*loaded->runner, *loaded->batches, to);
    if (loaded->async != nullptr) loaded->async->Attach(nullptr);  // joins its thread
    loaded->comm->Attach(nullptr);
    if (loaded->world != nullptr) loaded->world->Attach(nullptr);
    return r.status();
  }();
  // An ended load never trains again (Start refuses it): its arena and
  // device (on a GPU most of its memory) go now, not when the next LoadPlan,
  // which builds its own first, replaces it. Only this thread uses them.
  loaded->runner.reset();
  loaded->async.reset();
  loaded->timing.reset();
  loaded->batches.reset();
  loaded->device.reset();
  // The log's line of the end, unless the load was retired: taken with the
  // final state, as a Stop that retires this thread after it (only on_end
  // left) logs nothing.
  std::string ended;
  {
    absl::MutexLock l(&mu_);
    if (load_id_ == load_id && !loaded->abandoned) {
      loaded->trained = true;
      loaded->final_state = s.ok() ? v1::ExecutorStatus::FINISHED : v1::ExecutorStatus::FAILED;
      if (!s.ok()) {
        loaded->final_code =
            loaded->cancelled && absl::IsCancelled(s) ? absl::StatusCode::kCancelled : s.code();
        // A step that failed on its own while a Stop waited keeps its error.
        const std::string stopped = absl::StrCat("stopped by ", loaded->stopped_by, " after ",
                                                 steps_completed_, " of ", steps, " steps");
        loaded->final_error =
            !loaded->cancelled ? s.ToString()
            : absl::IsCancelled(s)
                ? stopped
                : absl::StrCat(stopped, "; the step in progress failed: ", s.ToString());
      }
      ended =
          absl::StrCat(run, ": ", v1::ExecutorStatus::State_Name(loaded->final_state), ", ",
                       std::max(steps_completed_, loaded->first_step), " of ", steps, " steps done",
                       loaded->final_error.empty() ? "" : ": ", loaded->final_error);
    }
  }
  if (!ended.empty()) Log(ended);
  if (o_.on_end) o_.on_end();
  absl::MutexLock l(&mu_);
  loaded->ended = true;
  // Another load only replaces this one once Stop retired this thread.
  if (load_id_ != load_id || loaded->abandoned) return;
  state_ = loaded->final_state;
  error_ = loaded->final_error;
  error_code_ = loaded->final_code;
}

std::optional<v1::StepProfile> ExecutorCore::NextProfile(Loaded& loaded, int64_t step,
                                                         double seconds) const {
  // Two warm-up steps (first touches of buffers, the communicator's
  // connections) are left out, as `hap-executor --profile` does.
  constexpr int64_t kWarmup = 2;
  if (loaded.timing == nullptr) return std::nullopt;
  const int64_t done = step - loaded.first_step + 1;
  if (done <= kWarmup) {
    if (done == kWarmup) {
      loaded.timing->Reset();
      loaded.window.clear();
      loaded.window_first = step + 1;
    }
    return std::nullopt;
  }
  loaded.window.push_back(seconds);
  const auto n = static_cast<int64_t>(loaded.window.size());
  if (n < o_.profile_window) return std::nullopt;
  const LoadOptions& lo = loaded.options;
  v1::StepProfile p;
  p.set_rank(lo.rank);
  p.set_device(lo.rank < lo.plan.devices_size() ? lo.plan.devices(lo.rank) : o_.device_id);
  p.set_plan_content_hash(lo.plan.content_hash());
  p.set_first_step(loaded.window_first);
  p.set_steps(n);
  std::vector<double> sorted = loaded.window;
  std::sort(sorted.begin(), sorted.end());
  p.set_step_seconds_median(n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]));
  p.set_device_seconds(loaded.timing->TotalSeconds(n));
  for (const auto& [type, secs] : loaded.timing->SecondsByOpType(n)) {
    (*p.mutable_op_seconds())[type] = secs;
  }
  loaded.timing->Reset();
  loaded.window.clear();
  loaded.window_first = step + 1;
  return p;
}

void ExecutorCore::ReapRetired(bool all) {
  std::vector<Retired> keep;
  for (Retired& r : retired_) {
    if (all || r.loaded->ended) {
      r.thread.join();
    } else {
      keep.push_back(std::move(r));
    }
  }
  retired_.swap(keep);
  retired_count_ = static_cast<int>(retired_.size());
}

int ExecutorCore::RetiredThreads() const { return retired_count_.load(); }

void ExecutorCore::JoinTrainingThread() {
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<v1::ExecutorStatus> ExecutorCore::Stop(const std::string& deployment,
                                                      absl::Time wait_until) {
  const absl::Time called = absl::Now();
  absl::MutexLock ops(&ops_mu_);
  absl::Time asked;
  {
    absl::MutexLock l(&mu_);
    if (loaded_ == nullptr) return StatusLocked();  // nothing to stop
    HAP_RETURN_IF_ERROR(CheckDeployment(deployment));
    if (state_ == v1::ExecutorStatus::LOADED) {  // unload
      loaded_.reset();
      ++load_id_;
      state_ = v1::ExecutorStatus::IDLE;
      return StatusLocked();
    }
    if (state_ != v1::ExecutorStatus::TRAINING) return StatusLocked();
    loaded_->cancelled = true;
    if (loaded_->stop_asked == absl::InfiniteFuture()) loaded_->stop_asked = absl::Now();
    asked = loaded_->stop_asked;
  }
  WaitUntilDone(std::min(wait_until, asked + o_.stop_wait));
  ReapRetired(/*all=*/false);
  absl::ReleasableMutexLock l(&mu_);
  if (state_ == v1::ExecutorStatus::TRAINING && wait_until <= called &&
      absl::Now() < asked + o_.stop_wait) {
    // A caller whose deadline had passed before it was served waited for
    // nothing, and its answer reaches no one: the step in progress, most
    // likely healthy, is not given up on for it. The answer is TRAINING,
    // the run stopping at its next step boundary; a later Stop waits again
    // (and one stop_wait after the first Stop abandons a step still stuck).
    return StatusLocked();
  }
  if (state_ == v1::ExecutorStatus::TRAINING) {
    // The step in progress did not end: most likely a collective waiting for
    // a peer that is frozen or gone, which only the communicator timeout
    // ends. Nothing more comes from this load; its thread is retired.
    loaded_->abandoned = true;
    retired_.push_back(Retired{std::move(thread_), loaded_});
    retired_count_ = static_cast<int>(retired_.size());
    if (loaded_->trained) {  // only on_end (flushing metrics) was left
      state_ = loaded_->final_state;
      error_ = loaded_->final_error;
      error_code_ = loaded_->final_code;
      return StatusLocked();
    }
    state_ = v1::ExecutorStatus::FAILED;
    error_code_ = absl::StatusCode::kCancelled;
    const int64_t saving = loaded_->saving_after;
    error_ = absl::StrCat(
        "stopped by ", loaded_->stopped_by, " after ", steps_completed_, " of ",
        loaded_->options.training.steps(), " steps; ",
        saving >= 0 ? absl::StrCat("saving the checkpoint of step ", saving)
                    : std::string("the step in progress"),
        " did not end within ",
        absl::FormatDuration(absl::Trunc(absl::Now() - asked, absl::Milliseconds(1))),
        " and was abandoned ",
        saving >= 0 ? std::string("(that checkpoint was not committed by then: a resume takes the "
                                  "latest committed one)")
                    : absl::StrCat("(a collective waiting for a peer that is gone ends at the "
                                   "communicator timeout, ",
                                   absl::FormatDuration(o_.comm_timeout), ")"));
    const std::string line =
        absl::StrCat(loaded_->options.deployment, " generation ", loaded_->options.generation,
                     " rank ", loaded_->options.rank, ": FAILED, ", error_);
    v1::ExecutorStatus answer = StatusLocked();
    l.Release();  // the log is written without it
    Log(line);
    return answer;
  }
  return StatusLocked();
}

v1::ExecutorStatus ExecutorCore::WaitUntilDone(absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return state_ != v1::ExecutorStatus::TRAINING;
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  return StatusLocked();
}

v1::ExecutorStatus ExecutorCore::Status() const {
  absl::MutexLock l(&mu_);
  return StatusLocked();
}

v1::ExecutorStatus ExecutorCore::StatusLocked() const {
  v1::ExecutorStatus s;
  s.set_state(state_);
  s.set_device(o_.device_id);
  if (loaded_ != nullptr) {
    s.set_deployment(loaded_->options.deployment);
    s.set_generation(loaded_->options.generation);
    s.set_rank(loaded_->options.rank);
    s.set_backend(loaded_->backend);
  }
  s.set_steps_completed(steps_completed_);
  s.set_last_loss(last_loss_);
  s.set_error(error_);
  if (state_ == v1::ExecutorStatus::FAILED) s.set_error_code(static_cast<int32_t>(error_code_));
  if (loaded_ != nullptr && loaded_->profile.steps() > 0) *s.mutable_profile() = loaded_->profile;
  return s;
}

absl::StatusOr<std::vector<v1::StepMetric>> ExecutorCore::WaitMetrics(const std::string& deployment,
                                                                      int64_t from_step,
                                                                      absl::Time deadline,
                                                                      bool* done,
                                                                      int64_t* load) const {
  *done = false;
  absl::MutexLock l(&mu_);
  if (load != nullptr && *load != 0 && *load != load_id_) {
    *done = true;  // the stream's load was replaced or unloaded
    return std::vector<v1::StepMetric>();
  }
  HAP_RETURN_IF_ERROR(CheckDeployment(deployment));
  const int64_t id = load_id_;
  if (load != nullptr) *load = id;
  const Loaded* loaded = loaded_.get();
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return load_id_ != id || Ended(state_) ||
           (!loaded->metrics.empty() && loaded->metrics.back().step() >= from_step);
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  std::vector<v1::StepMetric> out;
  if (load_id_ != id) {
    *done = true;  // replaced or unloaded: `loaded` may be gone
    return out;
  }
  for (const auto& m : loaded->metrics) {
    if (m.step() >= from_step) out.push_back(m);
  }
  *done = Ended(state_);
  return out;
}

void ExecutorCore::Shutdown(bool join) {
  bool training;
  {
    absl::MutexLock l(&mu_);
    shutdown_ = true;  // no Start or LoadPlan from here on
    training = state_ == v1::ExecutorStatus::TRAINING;
    if (training) loaded_->stopped_by = "the executor shutting down";
  }
  // As StopTraining: a step stuck in a collective is abandoned after
  // stop_wait, not waited for until the communicator timeout.
  if (training) (void)Stop("");
  if (!join) return;
  absl::MutexLock ops(&ops_mu_);
  JoinTrainingThread();
  ReapRetired(/*all=*/true);
}

}  // namespace hap::executor
