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
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli_args.h"
#include "common/status_macros.h"
#include "common/std_streams.h"
#include "executor/cli/netns_testbed.h"
#include "executor/cli/run_flags.h"
#include "executor/cli/run_plan.h"
#include "planner/lower/plan_file.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

// The default CFS period of --cpu-shares groups: 20 ms keeps throttling
// fine-grained against step times of tens of milliseconds (with the
// kernel's default 100 ms a short step runs at full speed or not at all).
// --cpu-period-us sets another (1000 to 1000000, the kernel's bounds).
constexpr int64_t kCpuPeriodUs = 20000;
constexpr int64_t kCpuWeight = 262144;

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
// rank still inside killed by pid) and, as root, its network namespaces,
// found by name and removed when their launcher is gone. Nothing else is
// touched.
void RemoveLeftovers(bool testbed_follows) {
  // A leftover's owner is gone, or is this launcher: its pid reused (a
  // container's entrypoint gets the same small pid each time), it has made
  // nothing yet. Taken for alive, such a group failed this run's mkdir.
  auto gone = [](pid_t owner) { return owner > 0 && (owner == getpid() || !ProcessAlive(owner)); };
  // Iterated with error codes: a read error part way (EIO on /tmp) threw
  // out of the range-for and aborted hap-launch.
  std::error_code ec;
  for (std::filesystem::directory_iterator it(kRendezvousDir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const pid_t owner = OwnerPid(name, kRendezvousPrefix, IsMkdtempTail);
    std::error_code type;
    if (!gone(owner) || !it->is_directory(type)) continue;
    std::error_code rm;
    std::filesystem::remove_all(it->path(), rm);
    if (!rm)
      std::cerr << "hap-launch: removed " << it->path().string()
                << ", left by a run that is gone\n";
  }
  ec.clear();
  for (std::filesystem::directory_iterator it(kCgroupRoot, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const pid_t owner = OwnerPid(name, "hap-launch-", IsRankTail);
    std::error_code type;
    if (!gone(owner) || !it->is_directory(type)) continue;
    const std::string dir = it->path().string();
    // A rank still inside (it outlived its launcher) is killed; the group
    // can be removed once the kernel has reaped it (EBUSY until then).
    // Other errors (EACCES: not root) end the attempts at once.
    bool removed = false;
    int err = 0;
    for (int attempt = 0; attempt < 50 && !removed; ++attempt) {
      std::ifstream procs(dir + "/cgroup.procs");
      for (pid_t pid; procs >> pid;) {
        if (pid > 0) kill(pid, SIGKILL);
      }
      removed = rmdir(dir.c_str()) == 0;
      err = errno;
      if (!removed && err != EBUSY) break;
      if (!removed) usleep(100000);
    }
    if (removed) {
      std::cerr << "hap-launch: removed " << dir << ", left by a run that is gone\n";
    } else {
      std::cerr << "hap-launch: could not remove " << dir
                << " (left by a run that is gone): " << std::strerror(err) << "\n";
    }
  }
  // And its network testbed's namespaces, also when this run makes none
  // (only a later --network run removed them); one that makes a testbed
  // removes them there.
  if (geteuid() == 0 && !testbed_follows) {
    netns::RemoveStaleAndSay(netns::TestbedOptions{}, "hap-launch");
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
    // SIGCHLD ignored by the parent (a supervisor's signal(SIGCHLD,
    // SIG_IGN), `trap '' CHLD`) survives exec, and the kernel then reaps
    // children itself: waitpid found no rank (hap-launch waited for ever)
    // and no exit status of ip or tc (a failed command counted as done).
    struct sigaction child = {};
    child.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &child, &old_child_);
  }
  ~LaunchSignals() {
    // A stop signal that came is taken: it must not end hap-launch now.
    while (Pending() != 0) {
    }
    sigprocmask(SIG_SETMASK, &old_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
    sigaction(SIGCHLD, &old_child_, nullptr);
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
    sigaction(SIGCHLD, &old_child_, nullptr);
  }

 private:
  sigset_t stop_, wake_, old_;
  struct sigaction old_pipe_ = {};
  struct sigaction old_child_ = {};
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
// a path and one is there, else next to /proc/self/exe (hap-launch found
// through PATH, or run through a symlink to it in another directory, as
// /usr/local/bin/hap-launch -> /opt/hap/bin/hap-launch); when neither has
// one, the first, which the error then names.
std::string DefaultExecutor(const std::string& self) {
  std::vector<std::filesystem::path> dirs;
  if (self.find('/') != std::string::npos)
    dirs.push_back(std::filesystem::path(self).parent_path());
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(exe.parent_path());
  if (dirs.empty()) dirs.push_back(".");
  for (const auto& dir : dirs) {
    if (std::filesystem::exists(dir / "hap-executor", ec)) return (dir / "hap-executor").string();
  }
  return (dirs.front() / "hap-executor").string();
}

}  // namespace

int LaunchMain(const std::string& self, const std::vector<std::string>& argv) {
  const bool stdout_open = tools::ReserveStandardStreams();
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
  RemoveLeftovers(/*testbed_follows=*/net.has_value());
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
    // hap-launch's own flags stay here, as its flag parser reads them
    // (-pin-cores too: it reached the ranks, which refused it); --device
    // is given per rank below.
    if (const std::optional<tools::FlagArg> f = tools::ParseFlagArg(argv[i])) {
      static const std::set<std::string> kOwnValueFlags = {
          "executor", "cpu-shares",    "cpu-period-us", "network",
          "deadline", "grace-seconds", "device"};
      if (f->name == "pin-cores") continue;
      if (kOwnValueFlags.count(f->name)) {
        if (!f->value) ++i;  // and its value
        continue;
      }
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
    std::vector<std::string> args = {
        executor,       "--rank", std::to_string(r), "--world", std::to_string(world),
        "--rendezvous", tmpl};
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
