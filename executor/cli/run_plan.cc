#include "executor/cli/run_plan.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli_args.h"
#include "common/status_macros.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/cli/netns_testbed.h"
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

// The default CFS period of --cpu-shares groups: 20 ms keeps throttling
// fine-grained against step times of tens of milliseconds (with the
// kernel's default 100 ms a short step runs at full speed or not at all).
// --cpu-period-us sets another (1000 to 1000000, the kernel's bounds).
constexpr int64_t kCpuPeriodUs = 20000;
constexpr int64_t kCpuWeight = 262144;

namespace v1 = ::hap::v1;

// The file in the rendezvous directory by which rank R says that its
// training failed because a peer's connection did: the peer failed first,
// and hap-launch names that one (the rank exits 1 all the same).
std::string LostPeerMarker(const std::string& rendezvous, int64_t rank) {
  return absl::StrCat(rendezvous, "/rank", rank, ".lost-peer");
}

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

constexpr char kLaunchUsage[] =
    R"(usage: hap-launch --plan PLAN.pb [--executor PATH] [--cpu-shares F,F,...]
                  [--cpu-period-us US] [--pin-cores] [--device cpu|cuda|cuda:N]
                  [--network SPEC] [--deadline SECONDS] [--grace-seconds S]
                  [hap-executor flags]

Starts one hap-executor per rank of the plan on this machine, with a fresh
rendezvous directory, waits for them and stops the rest when one fails.
hap-executor's flags are passed on, but --rank, --world and --rendezvous,
which hap-launch sets for each rank. The executor is --executor, else the
hap-executor next to hap-launch.
A rank that fails is named with its exit code or signal and the others are
stopped (SIGTERM, then SIGKILL after --grace-seconds: default 5,
0.1-3600): exit 1. A rank that failed because its connection to a peer did
is named as having lost it, and the rank that failed on its own is named
when it ends.
SIGINT, SIGTERM or SIGHUP to hap-launch stop the ranks the same way: exit
128 + the signal. A closed standard error (`hap-launch ... 2>&1 | head`)
does not kill hap-launch: it still stops the ranks and removes what it
made.
--deadline SECONDS bounds the whole run (0.001-1e9; default none): past it
the ranks are stopped the same way and hap-launch exits 124, as timeout(1)
does (hap-executor's --timeout bounds only each wait for a peer).
The ranks die with hap-launch even when it is killed outright (SIGKILL);
what such a run left (its /tmp/hap-rendezvous-PID-* directory, cgroups and
namespaces) is removed by name at the next start.
--cpu-shares gives rank i the fraction F_i of one core through a cgroup
(/sys/fs/cgroup/cpu/hap-launch-PID-rI, cpu.cfs_quota_us): a heterogeneous
cluster on one machine, each group's CFS period --cpu-period-us (default
20000; a shorter one spreads a rank's throttling more evenly, closer to a
uniformly slower device). --pin-cores pins rank i to the i-th core that
hap-launch may run on (mod their number; `taskset -c 2,3 hap-launch ...`
gives ranks 0 and 1 cores 2 and 3).
--device cuda runs rank i on GPU i (NCCL needs one GPU per rank).
The cgroups are removed when the ranks end (also on SIGINT/SIGTERM).
--network SPEC runs the ranks on the network testbed (root only; README
"The network testbed"): each node a network namespace, its ranks inside
talking over Gloo on the node's address, links shaped with tc. SPEC, e.g.
"between=1gbit inside=10gbit pair=0-2:300mbit": nodes= defaults to the
plan's nodes (those of its cluster holding the ranks' devices, numbered in
rank order), ranks=N,N,... places the ranks otherwise. Made before the ranks start and removed after
they end (also on SIGINT/SIGTERM); one left by a launcher killed outright is
removed at the next start.
)";

const std::set<std::string> kValueFlags = {"plan",
                                           "rank",
                                           "world",
                                           "device",
                                           "rendezvous",
                                           "steps",
                                           "data",
                                           "data-dir",
                                           "threads",
                                           "timeout",
                                           "log-every",
                                           "executor",
                                           "cpu-shares",
                                           "cpu-period-us",
                                           "profile",
                                           "checkpoint-dir",
                                           "checkpoint-every",
                                           "checkpoint-keep",
                                           "resume",
                                           "init-weights",
                                           "shuffle",
                                           "network",
                                           "gloo-host",
                                           "overlap",
                                           "deadline",
                                           "grace-seconds"};

absl::StatusOr<v1::Plan> ReadPlan(const std::string& path) {
  // Every rank reads the plan itself: a FIFO blocked the open for good, and
  // a pipe (--plan <(...)) was drained by hap-launch, leaving the ranks an
  // empty plan. A directory is named as such by ReadInputFile.
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st) &&
      !std::filesystem::is_directory(st)) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan '", path,
                     "' is not a regular file (a pipe or a device: every rank reads the plan "
                     "itself; save it to a file)"));
  }
  // An empty file parses as a plan of nothing (hap-launch ran no rank).
  HAP_ASSIGN_OR_RETURN(std::string bytes, tools::ReadInputFile(path, "plan "));
  v1::Plan plan;
  if (!plan.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan '", path, "' is not a hap.v1.Plan (corrupted or truncated?)"));
  }
  return plan;
}

// The flags of a command line; a word that is not a flag or a flag's value
// is refused (`--pin-cores 7`, a word left over from an edit: both ran with
// the word ignored).
absl::StatusOr<tools::Args> ParseFlags(const std::vector<std::string>& argv,
                                       const std::set<std::string>& bool_flags) {
  HAP_ASSIGN_OR_RETURN(tools::Args a, tools::Args::Parse(argv, kValueFlags, bool_flags));
  if (!a.positional().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a.positional()[0],
                                                   "' (flags are --name VALUE or --name=VALUE)"));
  }
  return a;
}

// Writes `text` to `fd` in one write where the system allows: the ranks of
// hap-launch share one standard error, and a line written in pieces was
// interleaved with another rank's ("error: error: X is ...X is ...").
void WriteWhole(int fd, absl::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere left to report it
    text.remove_prefix(static_cast<size_t>(n));
  }
}

constexpr char kClosedStdout[] =
    "standard output is closed; the run writes its losses and final line there (redirect it, "
    "to /dev/null to drop them)";

// Standard input and error, when closed, are opened on /dev/null: with their
// numbers free, the first file or socket a run opened took one, and an
// error message went into it. Returns false when standard output is closed,
// which the caller refuses (the run trained to its end and then failed, its
// losses written into whatever had taken descriptor 1).
bool ReserveStandardStreams() {
  auto closed = [](int fd) { return fcntl(fd, F_GETFD) == -1 && errno == EBADF; };
  const bool stdout_open = !closed(1);
  for (int fd : {0, 2}) {
    if (!closed(fd)) continue;
    const int null = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (null >= 0 && null != fd) {
      dup2(null, fd);
      close(null);
    }
  }
  return stdout_open;
}

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

// OK when this process can make entries in the existing directory `dir`;
// otherwise InvalidArgument starting "FLAG VALUE: " and saying why.
absl::Status CheckCanMakeIn(const std::string& flag, const std::string& value,
                            const std::filesystem::path& dir) {
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", value, ": cannot write in '",
                                                   dir.string(), "': ", std::strerror(errno)));
  }
  // access() answers root from the permission bits: a file system that
  // refuses it all the same (proc, an NFS export that squashes root)
  // passed, and the first write failed. A directory made and removed again
  // is the answer.
  std::string probe = (dir / ".hap-write-check-XXXXXX").string();
  if (mkdtemp(probe.data()) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", value,
                                                   ": cannot make a directory in '", dir.string(),
                                                   "': ", std::strerror(errno)));
  }
  rmdir(probe.c_str());
  return absl::OkStatus();
}

// OK when files named PREFIX + `longest_suffix` (and shorter) can be made:
// PREFIX's directory (the working directory for a bare name) exists, this
// process may write in it and its file system takes a name that long.
// Otherwise InvalidArgument naming `flag` and what is wrong.
absl::Status CheckWritablePrefix(const std::string& flag, const std::string& prefix,
                                 const std::string& longest_suffix) {
  if (prefix.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a PREFIX"));
  const std::filesystem::path parent = std::filesystem::path(prefix).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", prefix, ": the directory '", dir, "' does not exist"));
  }
  HAP_RETURN_IF_ERROR(CheckCanMakeIn(flag, prefix, dir));
  // A name too long failed the write after the last step.
  const std::string longest = std::filesystem::path(prefix).filename().string() + longest_suffix;
  const long name_max = pathconf(dir.c_str(), _PC_NAME_MAX);
  if (longest.size() > static_cast<size_t>(name_max > 0 ? name_max : NAME_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", prefix, ": the file name '", longest, "' is ", longest.size(),
        " characters, longer than '", dir, "' takes (", name_max > 0 ? name_max : NAME_MAX, ")"));
  }
  return absl::OkStatus();
}

// OK when directory `dir` exists or can be made: its nearest existing
// ancestor is a directory this process may write in. Otherwise
// InvalidArgument naming `flag` and that path.
absl::Status CheckWritableDir(const std::string& flag, const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a DIR"));
  std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  std::error_code ec;
  while (!std::filesystem::exists(p, ec)) {
    // A lookup that failed (a name too long, a directory it may not search)
    // is not a directory still to be made: the first save failed on it.
    if (ec) return absl::InvalidArgumentError(absl::StrCat(flag, " ", dir, ": ", ec.message()));
    const std::filesystem::path parent = p.parent_path();
    if (parent == p) break;
    p = parent.empty() ? std::filesystem::path(".") : parent;  // a relative DIR
  }
  if (!std::filesystem::is_directory(p, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", dir, ": '", p.string(), "' is not a directory"));
  }
  return CheckCanMakeIn(flag, dir, p);
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

// The bounds of --timeout (a wait for a peer), in seconds.
constexpr double kMinTimeoutSeconds = 0.001;
constexpr double kMaxTimeoutSeconds = 1e7;
// Steps a --profile run leaves out (warm-up) before it times kernels.
constexpr int64_t kProfileWarmup = 2;
// The longest name a checkpoint save makes inside --checkpoint-dir, with
// room to spare ("/superseded-step-N-K/rank-R-of-W.safetensors.failed").
constexpr size_t kCheckpointNamesInside = 128;

// The run's flags that need neither the plan nor a peer, checked before
// anything connects: by hap-executor first, and by hap-launch once before
// it starts any rank (a bad one was reported by every rank, some only
// after every rank had connected). `last_rank`: the highest rank that
// runs with them (the --profile files carry it).
absl::Status CheckRunFlags(const tools::Args& a, int64_t last_rank) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
  HAP_RETURN_IF_ERROR(a.Integer("steps", 10, 1, kMaxInt64).status());
  HAP_RETURN_IF_ERROR(a.Integer("checkpoint-every", 0, 0, kMaxInt64).status());
  HAP_RETURN_IF_ERROR(a.Integer("checkpoint-keep", checkpoint::kDefaultKeep, 1, kMaxInt).status());
  if (a.Has("resume") && a.Has("init-weights")) {
    return absl::InvalidArgumentError("--resume and --init-weights exclude each other");
  }
  HAP_RETURN_IF_ERROR(a.Integer("threads", 1, 1, 4096).status());
  HAP_RETURN_IF_ERROR(a.Integer("log-every", 1, 1, kMaxInt64).status());
  // Gloo waits in whole milliseconds added to a nanosecond clock: 1e-9 s
  // was 0 ms, and 1e300 s 2^63 ms, which overflowed there (every wait
  // timed out at once).
  HAP_ASSIGN_OR_RETURN(double timeout, a.Number("timeout", 60));
  if (!(timeout >= kMinTimeoutSeconds && timeout <= kMaxTimeoutSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--timeout must be seconds from %.3f to %.0f, got '%s'", kMinTimeoutSeconds,
                        kMaxTimeoutSeconds, a.Get("timeout")));
  }
  const std::string source = a.Get("data", "synthetic");
  const bool user_data = absl::StartsWith(source, "npy:") || absl::StartsWith(source, "tokens:");
  if (source != "synthetic" && source != "wikitext" && !user_data) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data must be synthetic, wikitext, npy:DIR or tokens:FILE[:uint16|uint32], got '", source,
        "'"));
  }
  if (a.Has("shuffle")) {
    uint64_t seed;
    if (!absl::SimpleAtoi(a.Get("shuffle"), &seed)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shuffle takes a seed (a non-negative integer), got '", a.Get("shuffle"), "'"));
    }
    if (!user_data) {
      return absl::InvalidArgumentError("--shuffle applies to npy: and tokens: data only");
    }
  }
  const std::string overlap = a.Get("overlap", "on");
  if (overlap != "on" && overlap != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--overlap must be on or off, not '", overlap, "'"));
  }
  // Where --profile writes is checked now, not after the last step (a
  // missing directory failed the run once it had trained).
  if (a.Has("profile")) {
    HAP_ASSIGN_OR_RETURN(int64_t steps, a.Integer("steps", 10, 1, kMaxInt64));
    if (steps <= kProfileWarmup) {
      return absl::InvalidArgumentError(
          absl::StrCat("--profile needs more than ", kProfileWarmup, " --steps"));
    }
    HAP_RETURN_IF_ERROR(CheckWritablePrefix("--profile", a.Get("profile"),
                                            absl::StrCat(".rank", last_rank, ".kernels.md")));
  }
  // The same for checkpoints: an unusable directory failed the first save.
  if (a.Has("checkpoint-dir")) {
    const std::string dir = a.Get("checkpoint-dir");
    HAP_RETURN_IF_ERROR(CheckWritableDir("--checkpoint-dir", dir));
    std::error_code ec;
    const size_t length = std::filesystem::absolute(dir, ec).string().size();
    if (length + kCheckpointNamesInside > PATH_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--checkpoint-dir ", dir, ": the path is ", length,
          " characters long; the files of a checkpoint in it would pass the system's limit of ",
          PATH_MAX, " (PATH_MAX)"));
    }
  }
  return absl::OkStatus();
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
  if (a.Has("resume")) {
    HAP_ASSIGN_OR_RETURN(
        std::unique_ptr<checkpoint::CheckpointReader> reader,
        WithDamageHint(checkpoint::CheckpointReader::Open(a.Get("resume")), a.Get("resume")));
    HAP_RETURN_IF_ERROR(reader->CheckGraph(g));
    first_step = reader->trainer().step();
    resumed = reader->trainer();
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

  HAP_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> store,
                       NewFileStore(a.Get("rendezvous")));
  GlooOptions go;
  go.rank = static_cast<int>(rank);
  go.size = static_cast<int>(world);
  go.prefix = absl::StrCat("plan-", plan.content_hash().substr(0, 16));
  go.timeout = absl::Seconds(timeout);
  go.hostname = a.GetOrEnv("gloo-host", go.hostname);
  std::string note;
  HAP_ASSIGN_OR_RETURN(DeviceSpec spec, ChooseDevice(a.GetOrEnv("device"), plan,
                                                     static_cast<int>(rank), &note));
  if (!note.empty()) std::cerr << "hap-executor: " << note << "\n";
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
    // Unavailable in training: a collective whose connection to a peer
    // failed (devices, stores and checkpoints to resume from are opened
    // before the first step). Best effort: without it the rank is named.
    if (absl::IsUnavailable(trained.status())) {
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
  const bool stdout_open = ReserveStandardStreams();
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

// The network of --network for this plan: rank r's node in (*rank_node)[r],
// from ranks= or else from the plan's cluster (nodes numbered in order of
// first appearance among the ranks); nodes= from the spec or
// the number of nodes found.
absl::StatusOr<netns::NetworkSpec> NetworkForPlan(const std::string& text, const v1::Plan& plan,
                                                  std::vector<int>* rank_node) {
  HAP_ASSIGN_OR_RETURN(netns::NetworkSpec spec, netns::ParseNetworkSpec(text));
  const int world = plan.rank_programs_size();
  if (!spec.rank_nodes.empty()) {
    if (static_cast<int>(spec.rank_nodes.size()) != world) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks= places ", spec.rank_nodes.size(), " ranks, the plan has ", world));
    }
    *rank_node = spec.rank_nodes;
  } else {
    // The node of each device in the plan's cluster; a device the cluster
    // does not list is on the node its id names ("node1/cpu0").
    std::map<std::string, std::string> node_of;
    for (const auto& n : plan.cluster().nodes()) {
      for (const auto& d : n.devices()) node_of[d.id()] = n.name();
    }
    std::vector<std::string> names;
    for (const auto& p : plan.rank_programs()) {
      auto known = node_of.find(p.device());
      const std::string node =
          known != node_of.end() ? known->second : p.device().substr(0, p.device().find('/'));
      auto it = std::find(names.begin(), names.end(), node);
      rank_node->push_back(static_cast<int>(it - names.begin()));
      if (it == names.end()) names.push_back(node);
    }
  }
  const int used = 1 + *std::max_element(rank_node->begin(), rank_node->end());
  if (spec.nodes == 0) spec.nodes = used;
  if (spec.nodes < used) {
    return absl::InvalidArgumentError(
        absl::StrCat("nodes=", spec.nodes, " but the ranks are on ", used, " nodes"));
  }
  HAP_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

// How long a rank told to stop (SIGTERM) has before it is killed (SIGKILL),
// by default (--grace-seconds): a rank stopped, hung in a kernel or
// ignoring SIGTERM held the launcher (and its cgroups and namespaces)
// forever.
constexpr double kStopGraceSeconds = 5;
constexpr char kCgroupRoot[] = "/sys/fs/cgroup/cpu";
constexpr char kRendezvousDir[] = "/tmp";
constexpr char kRendezvousPrefix[] = "hap-rendezvous-";

bool ProcessAlive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

// The pid in NAME when NAME is exactly what a launcher of that pid makes,
// HEAD<pid>-<tail> with `is_tail(tail)`; else -1. A name that only starts
// the same way (/tmp/hap-rendezvous-5-keep, someone else's) is not a
// launcher's to remove.
pid_t OwnerPid(absl::string_view name, absl::string_view head, bool (*is_tail)(absl::string_view)) {
  if (!absl::ConsumePrefix(&name, head)) return -1;
  const size_t end = name.find('-');
  int pid;
  if (end == absl::string_view::npos || !absl::SimpleAtoi(name.substr(0, end), &pid) || pid <= 0 ||
      name.substr(0, end) != absl::StrCat(pid) || !is_tail(name.substr(end + 1))) {
    return -1;
  }
  return pid;
}

// mkdtemp's XXXXXX: six letters and digits.
bool IsMkdtempTail(absl::string_view tail) {
  return tail.size() == 6 && std::all_of(tail.begin(), tail.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c));
         });
}

// A rank's cgroup: r<rank>.
bool IsRankTail(absl::string_view tail) {
  int rank;
  return absl::ConsumePrefix(&tail, "r") && absl::SimpleAtoi(tail, &rank) && rank >= 0 &&
         tail == absl::StrCat(rank);
}

// What a launcher killed outright (SIGKILL) left: its rendezvous directory
// (/tmp/hap-rendezvous-PID-XXXXXX) and its cgroups (hap-launch-PID-rI, a
// rank still inside killed by pid), found by name and removed when their
// launcher is gone. Nothing else is touched.
void RemoveLeftovers() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(kRendezvousDir, ec)) {
    const std::string name = e.path().filename().string();
    const pid_t owner = OwnerPid(name, kRendezvousPrefix, IsMkdtempTail);
    if (owner <= 0 || ProcessAlive(owner) || !e.is_directory(ec)) continue;
    std::error_code rm;
    std::filesystem::remove_all(e.path(), rm);
    if (!rm)
      std::cerr << "hap-launch: removed " << e.path().string() << ", left by a run that is gone\n";
  }
  for (const auto& e : std::filesystem::directory_iterator(kCgroupRoot, ec)) {
    const std::string name = e.path().filename().string();
    const pid_t owner = OwnerPid(name, "hap-launch-", IsRankTail);
    if (owner <= 0 || ProcessAlive(owner) || !e.is_directory(ec)) continue;
    const std::string dir = e.path().string();
    // A rank still inside (it outlived its launcher) is killed; the group
    // can be removed once the kernel has reaped it.
    bool removed = false;
    for (int attempt = 0; attempt < 50 && !removed; ++attempt) {
      std::ifstream procs(dir + "/cgroup.procs");
      for (pid_t pid; procs >> pid;) kill(pid, SIGKILL);
      removed = rmdir(dir.c_str()) == 0;
      if (!removed) usleep(100000);
    }
    if (removed) {
      std::cerr << "hap-launch: removed " << dir << ", left by a run that is gone\n";
    } else {
      std::cerr << "hap-launch: could not remove " << dir
                << " (left by a run that is gone): " << std::strerror(errno) << "\n";
    }
  }
}

// The signals that stop a launch (Ctrl-C, SIGTERM, a closed terminal; each
// unless it was ignored when hap-launch started) are blocked from the start
// and taken with sigtimedwait, so one that comes while the testbed, the
// cgroups or the ranks are being made still has them removed. SIGCHLD too:
// a rank that ends wakes the wait.
class LaunchSignals {
 public:
  LaunchSignals() {
    sigemptyset(&stop_);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction now;
      if (sigaction(sig, nullptr, &now) == 0 && now.sa_handler != SIG_IGN) sigaddset(&stop_, sig);
    }
    wake_ = stop_;
    sigaddset(&wake_, SIGCHLD);
    sigprocmask(SIG_BLOCK, &wake_, &old_);
    // A write to a closed pipe (standard error read by `head`, a log
    // shipper gone) killed hap-launch before it had stopped its ranks and
    // removed what it made; now that write fails and the launch goes on.
    struct sigaction ignore = {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &old_pipe_);
  }
  ~LaunchSignals() {
    // A stop signal that came is taken: it must not end hap-launch now.
    while (Pending() != 0) {
    }
    sigprocmask(SIG_SETMASK, &old_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
  }
  LaunchSignals(const LaunchSignals&) = delete;
  LaunchSignals& operator=(const LaunchSignals&) = delete;

  // A stop signal that has come (taking it), or 0.
  int Pending() {
    timespec zero = {0, 0};
    const int sig = sigtimedwait(&stop_, nullptr, &zero);
    return sig > 0 ? sig : 0;
  }
  // Waits up to `seconds` for a stop signal or a child's end: the stop
  // signal, or 0.
  int Wait(double seconds) {
    timespec t;
    t.tv_sec = static_cast<time_t>(seconds);
    t.tv_nsec = static_cast<long>((seconds - static_cast<double>(t.tv_sec)) * 1e9);
    const int sig = sigtimedwait(&wake_, nullptr, &t);
    return sig > 0 && sigismember(&stop_, sig) ? sig : 0;
  }
  // In a forked rank, before exec: the signal mask and SIGPIPE's action
  // hap-launch started with.
  void RestoreInChild() const {
    sigprocmask(SIG_SETMASK, &old_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
  }

 private:
  sigset_t stop_, wake_, old_;
  struct sigaction old_pipe_ = {};
};

// Signal names for messages: "SIGSEGV (Segmentation fault)".
std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return absl::StrCat(
      abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig), " (",
      strsignal(sig), ")");
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("was killed by ", SignalName(WTERMSIG(status)));
  return absl::StrCat("ended with status ", status);
}

// What a launch has made, removed in reverse order when it goes out of
// scope (after the ranks are reaped): on every way out of LaunchMain.
struct LaunchResources {
  std::unique_ptr<netns::Testbed> testbed;
  std::string rendezvous;
  std::vector<std::string> groups;

  ~LaunchResources() {
    for (const auto& g : groups) {
      if (rmdir(g.c_str()) != 0) {
        std::cerr << "hap-launch: could not remove " << g << ": " << std::strerror(errno) << "\n";
      }
    }
    if (!rendezvous.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(rendezvous, ec);
    }
    if (testbed) {
      absl::Status s = testbed->Destroy();
      if (!s.ok()) std::cerr << "hap-launch: " << s.message() << "\n";
    }
  }
};

// Waits for the ranks (pids[r] is rank r; 0 for one never started). The
// first that fails is named with its exit code or signal and the others are
// told to stop (SIGTERM); a stop signal to hap-launch does the same. When
// the first failures are ranks that lost their connection to a peer (exit
// 1 with a LostPeerMarker in `rendezvous`), the rank that failed on its
// own, ending after them, is named too. Ranks still there `grace_seconds`
// later are killed. Returns hap-launch's exit code: 128 + the signal when
// stopped by one, 124 when `deadline` passed first, 1 when a rank failed,
// else 0.
int WaitForRanks(const std::vector<pid_t>& pids, const std::string& rendezvous,
                 LaunchSignals& signals, int stop_signal, double grace_seconds,
                 absl::Time deadline = absl::InfiniteFuture(), double deadline_seconds = 0) {
  std::vector<bool> running(pids.size());
  size_t left = 0;
  for (size_t r = 0; r < pids.size(); ++r) {
    running[r] = pids[r] > 0;
    left += running[r];
  }
  int failed = 0;
  bool only_lost_peers = false;  // every failure so far lost its connection
  bool late = false;
  std::optional<absl::Time> kill_at;
  auto stop_all = [&]() {
    if (kill_at) return;
    for (size_t r = 0; r < pids.size(); ++r) {
      if (running[r]) kill(pids[r], SIGTERM);
    }
    kill_at = absl::Now() + absl::Seconds(grace_seconds);
  };
  if (stop_signal != 0) stop_all();
  auto stop_by = [&](int sig) {
    if (sig == 0 || stop_signal != 0) return;
    stop_signal = sig;
    WriteWhole(2, absl::StrCat("hap-launch: ", SignalName(sig), ": stopping the ranks\n"));
    stop_all();
  };
  while (left > 0) {
    // First: Ctrl-C reaches the ranks too (the terminal's process group);
    // one that died of it is not a failed rank.
    stop_by(signals.Pending());
    // Every rank that has ended, then the failures among them: ranks that
    // ended before hap-launch looked (a crash and a peer failing on the
    // lost connection) are reaped in fork order, which named the peer.
    // All are named, those killed by a signal first (a peer's failure is
    // an exit code).
    std::vector<std::pair<size_t, int>> failures;  // rank, wait status
    int status = 0;
    pid_t pid;
    while (left > 0 && (pid = waitpid(-1, &status, WNOHANG)) > 0) {
      auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      const size_t r = static_cast<size_t>(it - pids.begin());
      running[r] = false;
      --left;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failures.emplace_back(r, status);
    }
    if (!failures.empty() && (!failed || only_lost_peers) && stop_signal == 0 && !late) {
      auto lost_peer = [&](size_t r, int st) {
        std::error_code ec;
        return WIFEXITED(st) && WEXITSTATUS(st) == 1 &&
               std::filesystem::exists(LostPeerMarker(rendezvous, static_cast<int64_t>(r)), ec);
      };
      // The likely cause first: a signal, then an exit code of its own.
      std::stable_sort(failures.begin(), failures.end(), [&](const auto& x, const auto& y) {
        auto order = [&](const auto& f) {
          return WIFSIGNALED(f.second) ? 0 : lost_peer(f.first, f.second) ? 2 : 1;
        };
        return order(x) < order(y);
      });
      // What hap-launch's own SIGTERM, or its SIGKILL after the grace
      // period (kill_at is then infinite), did. A SIGKILL before that is
      // not its doing (the kernel's OOM killer, a user).
      auto stopped = [&](int st) {
        return kill_at && WIFSIGNALED(st) &&
               (WTERMSIG(st) == SIGTERM ||
                (WTERMSIG(st) == SIGKILL && *kill_at == absl::InfiniteFuture()));
      };
      std::string why;
      bool own_failure = false;
      for (const auto& [r, st] : failures) {
        const bool lost = lost_peer(r, st);
        if (failed && (lost || stopped(st))) continue;
        own_failure = own_failure || !lost;
        absl::StrAppend(&why, why.empty() ? "" : "; ", "rank ", r, " ",
                        lost ? "lost its connection to a peer" : DescribeExit(st));
      }
      if (!why.empty()) {
        WriteWhole(2,
                   absl::StrCat("hap-launch: ", why, failed ? "" : "; stopping the others", "\n"));
      }
      only_lost_peers = (!failed || only_lost_peers) && !own_failure;
      failed = 1;
      stop_all();
    }
    if (left == 0) break;
    if (!kill_at && absl::Now() >= deadline) {
      late = true;
      WriteWhole(2, absl::StrCat("hap-launch: the --deadline of ", deadline_seconds,
                                 " s passed; stopping the ranks\n"));
      stop_all();
    }
    if (kill_at && absl::Now() >= *kill_at) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!running[r]) continue;
        WriteWhole(2, absl::StrCat("hap-launch: rank ", r, " did not stop within ", grace_seconds,
                                   " s of SIGTERM; killing it\n"));
        kill(pids[r], SIGKILL);
      }
      kill_at = absl::InfiniteFuture();
    }
    const absl::Time next = kill_at ? *kill_at : deadline;
    double wait_seconds = 1;
    if (next != absl::InfiniteFuture()) {
      wait_seconds = std::clamp(absl::ToDoubleSeconds(next - absl::Now()), 0.001, 1.0);
    }
    stop_by(signals.Wait(wait_seconds));
  }
  return stop_signal != 0 ? 128 + stop_signal : late ? 124 : failed;
}

// The hap-executor next to this hap-launch: next to argv[0] when it names
// a path, else (found through PATH) next to /proc/self/exe.
std::string DefaultExecutor(const std::string& self) {
  std::filesystem::path dir = std::filesystem::path(self).parent_path();
  if (self.find('/') == std::string::npos) {
    std::error_code ec;
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) dir = exe.parent_path();
  }
  return (dir / "hap-executor").string();
}

int LaunchMain(const std::string& self, const std::vector<std::string>& argv) {
  const bool stdout_open = ReserveStandardStreams();
  auto a = ParseFlags(argv, {"help", "pin-cores"});
  if (!a.ok() || a->Bool("help") || !a->Has("plan")) {
    if (!a.ok()) std::cerr << "error: " << a.status().message() << "\n";
    if (a.ok() && !a->Bool("help")) std::cerr << "error: --plan is required\n";
    std::cerr << kLaunchUsage;
    return a.ok() && a->Bool("help") ? 0 : 2;
  }
  // Refused before anything starts: the ranks inherit it.
  if (!stdout_open) {
    std::cerr << "error: " << kClosedStdout << "\n";
    return 2;
  }
  // Passed on, the last of each wins: every rank would be the same rank.
  for (const std::string f : {"rank", "world", "rendezvous"}) {
    if (a->Has(f)) {
      std::cerr << "error: hap-launch sets --" << f << " for each rank itself, got --" << f << " '"
                << a->Get(f) << "'\n";
      return 2;
    }
  }
  auto plan = ReadPlan(a->Get("plan"));
  if (!plan.ok()) {
    std::cerr << "error: " << plan.status().message() << "\n";
    return 1;
  }
  const int world = plan->rank_programs_size();
  // Checked as each rank will (format version, lowered, content hash):
  // a plan without rank programs would launch nothing and succeed.
  if (absl::Status s = lower::CheckPlanForRank(*plan, 0, world); !s.ok()) {
    std::cerr << "error: plan '" << a->Get("plan") << "': " << s.message() << "\n";
    return 1;
  }
  const std::string executor = a->Get("executor", DefaultExecutor(self));
  // Before anything is made: every rank would fail to start it.
  std::string cannot_run;
  if (access(executor.c_str(), X_OK) != 0) {
    cannot_run = std::strerror(errno);
  } else if (std::filesystem::is_directory(executor)) {
    cannot_run = "it is a directory";
  }
  if (!cannot_run.empty()) {
    std::cerr << "error: cannot run the executor '" << executor << "': " << cannot_run
              << (a->Has("executor") ? "" : " (give its path with --executor)") << "\n";
    return 1;
  }
  // Checked before anything is made: the CFS period and one share per rank,
  // each quota at least the kernel's minimum of 1 ms.
  auto period_us = a->Integer("cpu-period-us", kCpuPeriodUs, 1000, 1000000);
  if (!period_us.ok()) {
    std::cerr << "error: " << period_us.status().message() << "\n";
    return 2;
  }
  double deadline_seconds = 0;
  if (a->Has("deadline")) {
    auto d = a->Number("deadline", 0);
    if (!d.ok() || !(*d >= 0.001 && *d <= 1e9)) {
      std::cerr << "error: --deadline must be seconds in [0.001, 1e9], got '" << a->Get("deadline")
                << "'\n";
      return 2;
    }
    deadline_seconds = *d;
  }
  double grace_seconds = kStopGraceSeconds;
  if (a->Has("grace-seconds")) {
    auto g = a->Number("grace-seconds", 0);
    if (!g.ok() || !(*g >= 0.1 && *g <= 3600)) {
      std::cerr << "error: --grace-seconds must be seconds in [0.1, 3600], got '"
                << a->Get("grace-seconds") << "'\n";
      return 2;
    }
    grace_seconds = *g;
  }
  // hap-executor's flags, once, before any rank starts.
  if (absl::Status s = CheckRunFlags(*a, world - 1); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  // From the start: making the testbed and cgroups counts too.
  const absl::Time deadline =
      deadline_seconds > 0 ? absl::Now() + absl::Seconds(deadline_seconds) : absl::InfiniteFuture();
  std::vector<double> shares;
  if (a->Has("cpu-shares")) {
    std::vector<std::string> parts = absl::StrSplit(a->Get("cpu-shares"), ',');
    if (static_cast<int>(parts.size()) != world) {
      std::cerr << "error: --cpu-shares has " << parts.size() << " values for " << world
                << " ranks\n";
      return 2;
    }
    for (const std::string& part : parts) {
      double share;
      if (!absl::SimpleAtod(part, &share) || !(share > 0) || share > 1) {
        std::cerr << "error: --cpu-shares values must be in (0, 1], got '" << part << "'\n";
        return 2;
      }
      if (share * static_cast<double>(*period_us) < 1000) {
        std::cerr << "error: --cpu-shares " << part << " of a " << *period_us
                  << " us period is a quota under the kernel's minimum of 1000 us; "
                     "use a longer --cpu-period-us\n";
        return 2;
      }
      shares.push_back(share);
    }
  }
  std::vector<int> rank_node;
  std::optional<netns::NetworkSpec> net;
  if (a->Has("network")) {
    auto n = NetworkForPlan(a->Get("network"), *plan, &rank_node);
    if (!n.ok()) {
      std::cerr << "error: --network: " << n.status().message() << "\n";
      return 2;
    }
    net = *std::move(n);
  }

  // From here on things are made: a stop signal is taken, not fatal, and
  // `made` removes them on every way out.
  LaunchSignals signals;
  LaunchResources made;
  RemoveLeftovers();
  // The network testbed: the node of each rank, then the namespaces.
  if (net) {
    auto t = netns::Testbed::Create(*net);
    if (!t.ok()) {
      std::cerr << "error: --network: " << t.status().message() << "\n";
      return 1;
    }
    made.testbed = std::move(*t);
    for (int n = 0; n < made.testbed->nodes(); ++n) {
      std::cerr << "hap-launch: node " << n << " = namespace " << made.testbed->NodeNamespace(n)
                << " at " << netns::Testbed::NodeAddress(n) << ", ranks";
      for (int r = 0; r < world; ++r) {
        if (rank_node[r] == n) std::cerr << " " << r;
      }
      std::cerr << "\n";
    }
    std::cerr << "hap-launch: network " << net->ToString() << "\n";
  }
  // Named after this launcher, so that the next one removes it if this one
  // is killed outright.
  std::string tmpl = absl::StrCat(kRendezvousDir, "/", kRendezvousPrefix, getpid(), "-XXXXXX");
  if (!mkdtemp(tmpl.data())) {
    std::cerr << "error: cannot create a rendezvous directory " << tmpl << ": "
              << std::strerror(errno) << "\n";
    return 1;
  }
  made.rendezvous = tmpl;
  std::vector<std::string> pass;
  for (size_t i = 0; i < argv.size(); ++i) {
    // hap-launch's own flags, --flag VALUE or --flag=VALUE, stay here.
    bool own = false;
    for (const std::string f : {"--executor", "--cpu-shares", "--cpu-period-us", "--network",
                                "--deadline", "--grace-seconds"}) {
      if (argv[i] == f) {
        ++i;  // and its value
        own = true;
        break;
      }
      if (argv[i].rfind(f + "=", 0) == 0) {
        own = true;
        break;
      }
    }
    if (own) continue;
    if (argv[i] == "--pin-cores") continue;
    if (argv[i] == "--device" || argv[i].rfind("--device=", 0) == 0) {  // given per rank below
      if (argv[i] == "--device") ++i;
      continue;
    }
    pass.push_back(argv[i]);
  }
  // CPU shares through cgroup v1: one group per rank.
  if (!shares.empty()) {
    for (int r = 0; r < world; ++r) {
      const double share = shares[r];
      std::string dir = absl::StrCat(kCgroupRoot, "/hap-launch-", getpid(), "-r", r);
      if (mkdir(dir.c_str(), 0755) != 0) {
        std::cerr << "error: cgroups unavailable (cannot make " << dir << ": "
                  << std::strerror(errno) << "; needs cgroup v1 cpu mounted and root)\n";
        return 1;
      }
      made.groups.push_back(dir);
      std::ofstream period(dir + "/cpu.cfs_period_us");
      period << *period_us;
      period.close();
      std::ofstream quota(dir + "/cpu.cfs_quota_us");
      quota << static_cast<int64_t>(share * static_cast<double>(*period_us));
      quota.close();
      // The largest weight, so that other work on the machine (weight 1024
      // in the root group) takes little of what the quota grants: the rank
      // gets its share, no more (the quota) and hardly less. Best effort.
      std::ofstream(dir + "/cpu.shares") << kCpuWeight;
      if (!period || !quota) {
        std::cerr << "error: cgroups unavailable (cannot write " << dir
                  << "; needs cgroup v1 cpu mounted and root)\n";
        return 1;
      }
    }
  }
  if (const int sig = signals.Pending(); sig != 0) {
    std::cerr << "hap-launch: " << SignalName(sig) << " before the ranks started\n";
    return 128 + sig;
  }
  // NCCL needs a GPU per rank: plain "cuda" means GPU r for rank r.
  const std::string device = a->GetOrEnv("device");
  const bool pin = a->Bool("pin-cores");
  // Rank i on the i-th core hap-launch may run on (mod their number): core
  // i of the machine ignored `taskset -c 2,3 hap-launch`, so two launchers
  // given their own cores both pinned to cores 0 and 1.
  std::vector<int> cores;
  if (pin) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &allowed)) cores.push_back(c);
      }
    }
    if (cores.empty()) {
      std::cerr << "error: --pin-cores: cannot read the cores hap-launch may run on: "
                << std::strerror(errno) << "\n";
      return 1;
    }
  }
  const pid_t launcher = getpid();
  std::vector<pid_t> pids(world, 0);
  int stop_signal = 0;
  for (int r = 0; r < world && stop_signal == 0; ++r) {
    std::vector<std::string> args = {executor, "--rank", std::to_string(r), "--world",
                                     std::to_string(world), "--rendezvous", tmpl};
    args.insert(args.end(), pass.begin(), pass.end());
    if (!device.empty()) {
      args.push_back("--device");
      args.push_back(device == "cuda" ? absl::StrCat("cuda:", r) : device);
    }
    std::string node_namespace;
    if (made.testbed) {
      node_namespace = made.testbed->NodeNamespace(rank_node[r]);
      args.push_back("--gloo-host");
      args.push_back(netns::Testbed::NodeAddress(rank_node[r]));
    }
    pid_t pid = fork();
    if (pid == 0) {
      // A rank dies with its launcher, also one killed outright (SIGKILL):
      // it ran on, with its cgroup and namespace, until its peers timed out
      // (a one-rank plan to its last step).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(127);
      signals.RestoreInChild();
      if (!node_namespace.empty()) {
        absl::Status s = netns::EnterNamespace(node_namespace);
        if (!s.ok()) {
          WriteWhole(2, absl::StrCat("error: rank ", r, ": ", s.message(), "\n"));
          _exit(127);
        }
      }
      if (!made.groups.empty()) {
        std::ofstream procs(made.groups[r] + "/cgroup.procs");
        procs << 0;  // this process
        procs.close();
        if (!procs) {
          WriteWhole(2, absl::StrCat("error: rank ", r, ": cannot join the cgroup ", made.groups[r],
                                     "\n"));
          _exit(127);
        }
      }
      if (pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        const int core = cores[r % cores.size()];
        CPU_SET(core, &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) {
          WriteWhole(2, absl::StrCat("error: rank ", r, ": --pin-cores: cannot pin to core ", core,
                                     ": ", std::strerror(errno), "\n"));
          _exit(127);
        }
      }
      std::vector<char*> cargs;
      for (auto& s : args) cargs.push_back(s.data());
      cargs.push_back(nullptr);
      execv(executor.c_str(), cargs.data());
      WriteWhole(2, absl::StrCat("error: rank ", r, ": cannot run ", executor, ": ",
                                 std::strerror(errno), "\n"));
      _exit(127);
    }
    if (pid < 0) {
      std::cerr << "error: cannot start rank " << r << ": " << std::strerror(errno) << "\n";
      stop_signal = -1;
      break;
    }
    pids[r] = pid;
    stop_signal = signals.Pending();
  }
  if (stop_signal == -1) {  // fork failed: the started ranks are stopped
    WaitForRanks(pids, made.rendezvous, signals, SIGTERM, grace_seconds);
    return 1;
  }
  if (stop_signal != 0) {
    std::cerr << "hap-launch: " << SignalName(stop_signal) << ": stopping the ranks\n";
  }
  return WaitForRanks(pids, made.rendezvous, signals, stop_signal, grace_seconds, deadline,
                      deadline_seconds);
}

}  // namespace hap::executor
