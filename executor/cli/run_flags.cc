#include "executor/cli/run_flags.h"

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

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/cli_args.h"
#include "common/status_macros.h"
#include "executor/checkpoint/checkpoint.h"
#include "executor/cli/netns_testbed.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

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

// The bounds of --timeout (a wait for a peer), in seconds.
constexpr double kMinTimeoutSeconds = 0.001;
constexpr double kMaxTimeoutSeconds = 1e7;
// The longest name a checkpoint save makes inside --checkpoint-dir, with
// room to spare ("/superseded-step-N-K/rank-R-of-W.safetensors.failed").
constexpr size_t kCheckpointNamesInside = 128;

}  // namespace

// The file in the rendezvous directory by which rank R says that its
// training failed because a peer's connection did: the peer failed first,
// and hap-launch names that one (the rank exits 1 all the same).
std::string LostPeerMarker(const std::string& rendezvous, int64_t rank) {
  return absl::StrCat(rendezvous, "/rank", rank, ".lost-peer");
}

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
    return absl::InvalidArgumentError(
        absl::StrCat("plan '", path, "' is not a hap.v1.Plan (corrupted or truncated?)"));
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

}  // namespace hap::executor
