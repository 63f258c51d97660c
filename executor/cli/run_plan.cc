#include "executor/cli/run_plan.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli_args.h"
#include "common/status_macros.h"
#include "common/std_streams.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/cli/run_flags.h"
#include "executor/cpu/cpu_device.h"
#include "executor/data/batches.h"
#include "executor/data/user_data.h"
#include "executor/data/wikitext.h"
#include "executor/runtime/timing_device.h"
#include "executor/train/backend.h"
#include "executor/train/pipeline.h"
#include "executor/train/trainer.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/plan_file.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

constexpr char kUsage[] =
    R"(usage: hap-executor --plan PLAN.pb --rank R --world N --rendezvous DIR
                    [--steps K] [--data synthetic|wikitext|npy:DIR|tokens:FILE]
                    [--shuffle SEED] [--data-dir DIR]
                    [--threads T] [--timeout SECONDS] [--log-every N]
                    [--device cpu|cuda[:N]]
                    [--profile PREFIX]
                    [--checkpoint-dir DIR [--checkpoint-every N]
                     [--checkpoint-keep K]] [--resume DIR|DIR/step-N]
                    [--init-weights FILE.safetensors] [--gloo-host HOST]
                    [--overlap on|off]

Runs rank R of a plan written by `hapctl plan --save-plan`. The ranks meet
through files in DIR (shared by all ranks; use a fresh one per run) and talk
over Gloo on 127.0.0.1 (--gloo-host, or $HAP_GLOO_HOST: the address Gloo
listens on, e.g. the node's in hap-launch --network). --data wikitext trains the GPT-style model on the
WikiText-2 valid split (word level) from --data-dir (default $HAP_DATA_DIR,
else ../shared/data); synthetic data is deterministic. Rank 0 prints each
step's loss and time, and at the end the perplexity (wikitext).
--device (or $HAP_DEVICE) picks the backend: cpu (Gloo between ranks) or
cuda[:N], GPU N (NCCL between ranks, one GPU each; builds made with
--config=cuda only). Default: the plan's device for this rank when the
plan's cluster says it is a GPU, else cpu.
--overlap (default on): a plan made with `hapctl plan --overlap on` starts
its gradient all-reduces and ZeRO-3 gathers early and runs them behind
compute, on a communication thread with a second Gloo context (a second
NCCL communicator on its own stream); off runs them in line.
--profile PREFIX times every kernel call after two warm-up steps and writes
PREFIX.rankR.json: median step seconds and seconds per step by op type
(optimizer kernels as (optimizer), fills and copies as (runtime); the rest
of a step is communication and waiting), the input of hapctl calibrate,
and PREFIX.rankR.kernels.md, the same timings per kernel name as a table.
--data npy:DIR reads one DIR/<input>.npy per graph input (first dimension:
samples); --data tokens:FILE[:uint16|uint32] a flat token stream for a
language model. Step k's global batch is samples k*B..k*B+B-1 (mod the
number of samples), or with --shuffle SEED a seeded permutation per epoch:
the same whatever the plan or world size.
--steps N trains until global step N (default 10): a resumed run does the
steps that remain. --timeout (0.001 to 1e7 seconds, default 60) bounds each
wait for a peer.
Standard output takes rank 0's losses and final line: closed, the run is
refused; a line that cannot be written stops the run at that step.
--checkpoint-dir DIR saves a checkpoint every --checkpoint-every steps (0,
the default: only at the end) and after the last step into
DIR/step-NNNNNNNN/, keeping the newest --checkpoint-keep (default 3). Every
rank writes its own slices; DIR must be visible to every rank. Its first
save renames the checkpoints in DIR past the step the run started from (a
run it replaces) to superseded-step-NNNNNNNN/.
--resume DIR starts from DIR's latest complete checkpoint (or the given
step-* directory), onto this plan whatever plan wrote it, if the graph is
the same. --init-weights FILE starts from the parameters of a safetensors
file of whole tensors (tools/export_fx.py --weights, hapctl checkpoint
export) instead of the initialisers.

hap-executor --serve --planner HOST:PORT [...] instead runs the executor
daemon: one rank of the deployments the planner pushes (flags:
hap-executor --serve --help).
)";

// A rank's error on standard error: "error: MESSAGE (rank R)", one line in
// one write (hap-launch's ranks share it), the rank named when known.
void ReportError(const absl::Status& s, const tools::Args& a) {
  auto rank = a.Integer("rank", 0, 0, std::numeric_limits<int>::max());
  WriteWhole(
      2, absl::StrCat("error: ", s.message(),
                      a.Has("rank") && rank.ok() ? absl::StrCat(" (rank ", *rank, ")") : "", "\n"));
}

// A damaged checkpoint to resume from (DataLoss: a checksum that does not
// match, a truncated or malformed file) says what to do about it.
absl::Status WithDamageHint(const absl::Status& s, const std::string& dir) {
  if (!absl::IsDataLoss(s)) return s;
  return absl::DataLossError(absl::StrCat(
      s.message(), " (the checkpoint is damaged: `hapctl checkpoint verify ", dir,
      "` lists what; --resume DIR/step-N resumes from an earlier checkpoint of its directory)"));
}
template <typename T>
absl::StatusOr<T> WithDamageHint(absl::StatusOr<T> r, const std::string& dir) {
  if (r.ok()) return r;
  return WithDamageHint(r.status(), dir);
}

std::string DataDir(const tools::Args& a) {
  if (a.Has("data-dir")) return a.Get("data-dir");
  if (const char* e = std::getenv("HAP_DATA_DIR")) return e;
  return "../shared/data";
}

// The --profile file (hapctl calibrate reads it; planner/calibrate).
absl::Status WriteProfile(const std::string& path, const v1::Plan& plan, int rank,
                          std::vector<double> step_seconds, const TimingDevice& timing) {
  std::sort(step_seconds.begin(), step_seconds.end());
  const int64_t n = static_cast<int64_t>(step_seconds.size());
  const double median = n % 2 ? step_seconds[n / 2]
                              : 0.5 * (step_seconds[n / 2 - 1] + step_seconds[n / 2]);
  std::string ops;
  for (const auto& [type, seconds] : timing.SecondsByOpType(n)) {
    absl::StrAppend(&ops, ops.empty() ? "" : ",\n", absl::StrFormat("    \"%s\": %.9g", type, seconds));
  }
  return tools::WriteOutputFile(
      path,
      absl::StrFormat(
          "{\n  \"plan_content_hash\": \"%s\",\n  \"rank\": %d,\n  \"device\": \"%s\",\n"
          "  \"steps\": %d,\n  \"step_seconds_median\": %.9g,\n  \"device_seconds\": %.9g,\n"
          "  \"op_seconds\": {\n%s\n  }\n}\n",
          plan.content_hash(), rank, rank < plan.devices_size() ? plan.devices(rank) : "", n,
          median, timing.TotalSeconds(n), ops),
      "profile ");
}

absl::Status Run(const tools::Args& a) {
  for (const char* f : {"plan", "rank", "world", "rendezvous"}) {
    if (!a.Has(f)) return absl::InvalidArgumentError(absl::StrCat("--", f, " is required"));
  }
  // Ranks and sizes are ints further on: a larger --rank ran as another rank.
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
  HAP_ASSIGN_OR_RETURN(int64_t rank, a.Integer("rank", 0, 0, kMaxInt));
  HAP_ASSIGN_OR_RETURN(int64_t world, a.Integer("world", 1, 1, kMaxInt));
  HAP_RETURN_IF_ERROR(CheckRunFlags(a, rank));
  HAP_ASSIGN_OR_RETURN(int64_t steps, a.Integer("steps", 10, 1, kMaxInt64));
  HAP_ASSIGN_OR_RETURN(int64_t checkpoint_every, a.Integer("checkpoint-every", 0, 0, kMaxInt64));
  HAP_ASSIGN_OR_RETURN(int64_t checkpoint_keep,
                       a.Integer("checkpoint-keep", checkpoint::kDefaultKeep, 1, kMaxInt));
  HAP_ASSIGN_OR_RETURN(int64_t threads, a.Integer("threads", 1, 1, 4096));
  HAP_ASSIGN_OR_RETURN(int64_t log_every, a.Integer("log-every", 1, 1, kMaxInt64));
  HAP_ASSIGN_OR_RETURN(double timeout, a.Number("timeout", 60));
  HAP_ASSIGN_OR_RETURN(v1::Plan plan, ReadPlan(a.Get("plan")));
  HAP_RETURN_IF_ERROR(lower::CheckPlanForRank(plan, static_cast<int>(rank),
                                              static_cast<int>(world)));
  HAP_ASSIGN_OR_RETURN(graph::Graph g, graph::FromProto(plan.graph()));

  // Where training starts: a checkpoint (its step), weights, or the
  // initialisers. Checked before anything connects.
  int64_t first_step = 0;
  std::function<absl::Status(ProgramRunner&)> initialize;
  v1::TrainerState resumed;  // the checkpoint's, for its data settings
  std::shared_ptr<checkpoint::WeightsReader> weights;  // --init-weights
  // Where this rank starts, which the ranks compare once connected.
  TrainingStart start = InitializersStart(plan.options().seed());
  if (a.Has("resume")) {
    HAP_ASSIGN_OR_RETURN(
        std::unique_ptr<checkpoint::CheckpointReader> reader,
        WithDamageHint(checkpoint::CheckpointReader::Open(a.Get("resume")), a.Get("resume")));
    HAP_RETURN_IF_ERROR(reader->CheckGraph(g));
    first_step = reader->trainer().step();
    resumed = reader->trainer();
    start = CheckpointStart(resumed, reader->step_dir());
    if (rank == 0) {
      std::cout << absl::StrFormat("resuming from %s (step %d, written by plan %s on %d ranks)\n",
                                   reader->step_dir(), first_step,
                                   reader->trainer().plan_hash().substr(0, 12),
                                   reader->trainer().world_size());
    }
    initialize = [hook = checkpoint::ResumeHook(std::move(reader), &g), dir = a.Get("resume")](
                     ProgramRunner& runner) { return WithDamageHint(hook(runner), dir); };
  } else if (a.Has("init-weights")) {
    HAP_ASSIGN_OR_RETURN(weights, checkpoint::WeightsReader::OpenFor(a.Get("init-weights"), g));
    HAP_ASSIGN_OR_RETURN(start.key, checkpoint::WeightsFileIdentity(a.Get("init-weights")));
    start.description = absl::StrCat("--init-weights ", a.Get("init-weights"));
    initialize = checkpoint::InitWeightsHook(weights, &g);
  }
  if (first_step >= steps) {
    if (rank == 0) {
      std::cout << absl::StrFormat("nothing to do: the checkpoint is at step %d, --steps is %d\n",
                                   first_step, steps);
    }
    return absl::OkStatus();
  }
  // Before anything connects (it was said by every rank once all had).
  const std::string profile = a.Get("profile");
  if (!profile.empty() && steps - first_step <= kProfileWarmup) {
    return absl::InvalidArgumentError(absl::StrCat("--profile needs more than ", kProfileWarmup,
                                                   " --steps after the checkpoint's step ",
                                                   first_step));
  }

  std::unique_ptr<data::BatchSource> batches;
  std::string source = a.Get("data", "synthetic");
  data::DataOptions data_options;
  if (a.Has("shuffle")) {
    uint64_t seed = 0;
    absl::SimpleAtoi(a.Get("shuffle"), &seed);  // checked by CheckRunFlags
    data_options.shuffle_seed = seed;
  }
  if (a.Has("resume")) {  // before any data is read
    v1::TrainerState run;
    run.set_global_batch(plan.global_batch());
    run.set_data(source);
    run.set_shuffle(data_options.shuffle_seed.has_value());
    run.set_shuffle_seed(data_options.shuffle_seed.value_or(0));
    HAP_RETURN_IF_ERROR(checkpoint::CheckDataSettings(resumed, run));
  }
  if (source == "wikitext") {
    std::string dir = DataDir(a) + "/wikitext-2";
    HAP_ASSIGN_OR_RETURN(data::Vocabulary vocab,
                         data::Vocabulary::Build(data::WikiText2Files(dir)));
    HAP_ASSIGN_OR_RETURN(std::vector<int64_t> corpus,
                         vocab.Encode(dir + "/valid.txt"));
    HAP_ASSIGN_OR_RETURN(batches, data::NewLmBatches(g, std::move(corpus)));
  } else if (source == "synthetic") {
    // A resumed run reads the batches the run it continues would have
    // read: the checkpoint's seed, not the plan's.
    batches =
        data::NewSyntheticBatches(g, a.Has("resume") ? resumed.seed() : plan.options().seed());
  } else if (absl::StartsWith(source, "npy:") || absl::StartsWith(source, "tokens:")) {
    HAP_ASSIGN_OR_RETURN(batches, data::OpenUserData(source, g, data_options));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data must be synthetic, wikitext, npy:DIR or tokens:FILE[:uint16|uint32], got '",
        source, "'"));
  }
  if (a.Has("resume")) {  // the data's size, known once it is open
    v1::TrainerState run = resumed;
    run.set_data_size(batches->data_size());
    HAP_RETURN_IF_ERROR(checkpoint::CheckDataSettings(resumed, run));
  }

  HAP_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> store,
                       NewFileStore(a.Get("rendezvous")));
  GlooOptions go;
  go.rank = static_cast<int>(rank);
  go.size = static_cast<int>(world);
  go.prefix = absl::StrCat("plan-", plan.content_hash().substr(0, 16));
  go.timeout = absl::Seconds(timeout);
  go.hostname = a.GetOrEnv("gloo-host", go.hostname);
  // The ranks compare their programs' collectives (CheckProgramsAgree,
  // below) before any runs, so each collective's own agreement on the call
  // is skipped (bench/comm_bench.sh --call-check: up to 1.3x a small
  // collective).
  go.check_calls = false;
  std::string note;
  HAP_ASSIGN_OR_RETURN(DeviceSpec spec, ChooseDevice(a.GetOrEnv("device"), plan,
                                                     static_cast<int>(rank), &note));
  if (!note.empty()) std::cerr << "hap-executor: " << note << "\n";
  // The profile names the plan's device, whose calibration hapctl
  // calibrate fits to it: a GPU's fitted with CPU times would price it as
  // a CPU in every later plan.
  if (!profile.empty() && spec.kind == DeviceSpec::Kind::kCpu &&
      PlannedDevice(plan, static_cast<int>(rank)).kind != DeviceSpec::Kind::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--profile: rank ", rank, "'s plan device ",
        rank < plan.devices_size() ? plan.devices(rank) : "?",
        " is a GPU, but the rank runs on the CPU (--device cpu, or a build without CUDA): its "
        "profile would calibrate that GPU with CPU times; profile on the GPU, or plan for CPUs"));
  }
  // A pipeline plan (README "Pipeline plans"): the rank's stage program runs
  // on the model at the microbatch size with its group's communicator (the
  // backend's: Gloo, or NCCL on GPUs); the stages talk over a Gloo world.
  const bool pipelined = lower::IsPipelinePlan(plan);
  std::unique_ptr<Communicator> world_comm;
  std::optional<PipelineRank> at;
  GlooOptions group = go;
  if (pipelined) {
    HAP_ASSIGN_OR_RETURN(at, PipelineRankOf(plan, g, static_cast<int>(rank)));
    HAP_ASSIGN_OR_RETURN(world_comm, ConnectGloo(PipelineWorldOptions(go), *store));
    group = PipelineGroupOptions(go, *at);
  }
  HAP_ASSIGN_OR_RETURN(Backend backend,
                       MakeBackend(spec, static_cast<int>(threads), group, *store));
  HAP_RETURN_IF_ERROR(CheckProgramsAgree(plan.rank_programs(rank), group, *store));
  HAP_RETURN_IF_ERROR(CheckStartsAgree(start, go, *store));
  std::unique_ptr<Device>& device = backend.device;
  std::unique_ptr<Communicator>& comm = backend.comm;
  TimingDevice timing(device.get());
  Device* run_on = profile.empty() ? device.get() : &timing;
  // A plan lowered with overlap starts collectives that run behind compute
  // on a communication thread with a communicator of its own; --overlap off
  // runs them in line (the same plan without overlap, for comparison).
  const std::string overlap = a.Get("overlap", "on");  // checked by CheckRunFlags
  RunnerOptions ro;
  if (overlap == "on" && HasAsyncCollectives(plan.rank_programs(rank))) {
    HAP_ASSIGN_OR_RETURN(backend.async, ConnectOverlap(*device, group, *store));
    ro.async = backend.async.get();
  }
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<ProgramRunner> runner,
                       ProgramRunner::Create(plan.rank_programs(rank), pipelined ? at->micro : g,
                                             run_on, comm.get(), ro));
  std::unique_ptr<PipelineRunner> pipe;
  if (pipelined) {
    HAP_ASSIGN_OR_RETURN(pipe, PipelineRunner::Create(runner.get(), world_comm.get(), at->layout));
  }
  if (rank == 0) {
    std::cout << absl::StrFormat(
        "training %s on %d ranks (plan %s, predicted step %.4f s), steps %d to %d, rank 0 on %s\n",
        g.name(), world, plan.content_hash().substr(0, 12),
        plan.prediction().step_seconds(), first_step, steps, device->name());
    if (pipelined) {
      std::cout << absl::StrFormat("pipeline: %d stages, %d microbatches of %d samples (1F1B)\n",
                                   at->layout.stage_ranks.size(), at->layout.microbatches,
                                   plan.pipeline().microbatch_size());
    }
  }
  TrainOptions to;
  to.return_parameters = false;  // nothing reads them; saved by checkpoints
  to.first_step = first_step;
  to.steps = steps - first_step;
  to.initialize = initialize;
  to.on_step = [&](int64_t step, double loss, double seconds) {
    if (step - first_step + 1 == kProfileWarmup) timing.Reset();
    if (rank == 0 && (step % log_every == 0 || step + 1 == steps)) {
      std::cout << absl::StrFormat("step %d loss %.6f time %.4f s\n", step, loss, seconds)
                << std::flush;
    }
  };
  std::vector<v1::RankProgram> programs(plan.rank_programs().begin(),
                                        plan.rank_programs().end());
  if (a.Has("checkpoint-dir")) {
    v1::TrainerState trainer;
    // A resumed run continues its checkpoint's seed (data and dropout).
    trainer.set_seed(a.Has("resume") ? resumed.seed() : plan.options().seed());
    trainer.set_global_batch(plan.global_batch());
    trainer.set_data(source);
    trainer.set_data_size(batches->data_size());
    trainer.set_shuffle(data_options.shuffle_seed.has_value());
    trainer.set_shuffle_seed(data_options.shuffle_seed.value_or(0));
    *trainer.mutable_optimizer() = plan.options().optimizer();
    trainer.set_graph_name(g.name());
    trainer.set_graph_hash(plan.graph_hash());
    trainer.set_plan_name(plan.name());
    trainer.set_plan_hash(plan.content_hash());
    if (auto it = g.metadata().find(checkpoint::kStateDictSlicesKey); it != g.metadata().end()) {
      trainer.set_state_dict_slices(it->second);
    }
    if (auto it = g.metadata().find(checkpoint::kStateDictExtrasKey); it != g.metadata().end()) {
      trainer.set_state_dict_extras(it->second);
    }
    HAP_RETURN_IF_ERROR(checkpoint::SetStartCounters(a.Has("resume") ? &resumed : nullptr,
                                                     weights.get(), &trainer));
    to.after_step = checkpoint::SaveHook(
        // A fresh run (step 0) replaces a run whose checkpoints are in the
        // directory as a resumed one does: its first save sets them aside.
        {a.Get("checkpoint-dir"), checkpoint_every, static_cast<int>(checkpoint_keep), steps,
         first_step},
        &programs, trainer,
        [&](const std::string& dir, int64_t step) {
          if (rank == 0) {
            std::cout << absl::StrFormat("checkpoint: %d steps done -> %s\n", step, dir)
                      << std::flush;
          }
        },
        // A pipeline rank's runner talks to its stage's group; the
        // checkpoint is every stage's, committed over the world.
        pipelined ? world_comm.get() : nullptr);
  }
  // A line of losses that did not go out (a full disk, a closed pipe) stops
  // the run there: it trained on to its last step and failed only then.
  to.after_step = [&rank, save = std::move(to.after_step)](ProgramRunner& runner,
                                                           int64_t steps_done) -> absl::Status {
    if (save) HAP_RETURN_IF_ERROR(save(runner, steps_done));
    if (rank == 0 && !std::cout) {
      return absl::DataLossError(absl::StrCat(
          "cannot write to standard output (the losses and the final line); stopped after step ",
          steps_done - 1));
    }
    return absl::OkStatus();
  };
  absl::StatusOr<TrainResult> trained =
      pipelined ? TrainRankWith(
                      *runner, [&](const Batch& b, int64_t step) { return pipe->RunStep(b, step); },
                      *batches, to)
                : TrainRank(*runner, *batches, to);
  if (!trained.ok()) {
    // The rank ends here, its connections still open: its peers fail on
    // the lost connection only once it has ended, and hap-launch names it.
    // Returning closed them first, and the peers often ended before this
    // rank had torn down (Gloo's threads joined): hap-launch named a peer.
    std::cout.flush();
    ReportError(trained.status(), a);
    // A collective whose connection to a peer failed (the communicator
    // marks it; other Unavailable errors are this rank's own). Best
    // effort: without the marker the rank is named.
    if (IsLostPeer(trained.status())) {
      std::ofstream(LostPeerMarker(a.Get("rendezvous"), rank)) << trained.status().message();
    }
    _exit(1);
  }
  TrainResult& r = *trained;
  if (!profile.empty()) {
    std::vector<double> timed(r.step_seconds.begin() + kProfileWarmup, r.step_seconds.end());
    HAP_RETURN_IF_ERROR(WriteProfile(absl::StrCat(profile, ".rank", rank, ".json"), plan,
                                     static_cast<int>(rank), timed, timing));
    // The same timings per kernel name, for people: PREFIX.rankR.kernels.md.
    const std::string table_path = absl::StrCat(profile, ".rank", rank, ".kernels.md");
    HAP_RETURN_IF_ERROR(tools::WriteOutputFile(
        table_path, timing.Table(static_cast<int64_t>(timed.size())), "profile "));
  }
  if (rank == 0) {
    double mean_time = 0;
    for (double s : r.step_seconds) mean_time += s;
    mean_time /= r.step_seconds.size();
    std::cout << absl::StrFormat("final loss %.6f, mean step time %.4f s",
                                 r.losses.back(), mean_time);
    if (source == "wikitext") {
      std::cout << absl::StrFormat(", perplexity %.2f (initial %.2f)",
                                   std::exp(r.losses.back()), std::exp(r.losses.front()));
    }
    std::cout << "\n";
  }
  return absl::OkStatus();
}

}  // namespace

int RunPlanMain(const std::vector<std::string>& argv) {
  const bool stdout_open = tools::ReserveStandardStreams();
  auto a = ParseFlags(argv, {"help"});
  if (!a.ok() || a->Bool("help")) {
    if (!a.ok()) std::cerr << "error: " << a.status().message() << "\n";
    std::cerr << kUsage;
    return a.ok() ? 0 : 2;
  }
  if (!stdout_open) {
    std::cerr << "error: " << kClosedStdout << "\n";
    return 2;
  }
  absl::Status s = Run(*a);
  // The losses and the final line are the run's result: not written (a
  // full disk, a closed pipe), the run failed.
  std::cout.flush();
  if (s.ok() && !std::cout) {
    s = absl::DataLossError("cannot write to standard output (the losses and the final line)");
  }
  if (!s.ok()) {
    ReportError(s, *a);
    return 1;
  }
  return 0;
}

}  // namespace hap::executor
