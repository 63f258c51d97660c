#include "executor/cli/netns_testbed.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace hap::netns {
namespace {

constexpr int kMaxNodes = 64;
constexpr char kSubnet[] = "10.213.0.";
constexpr char kBridge[] = "hapnet-br0";
// HTB's rate for a class that only carries a delay: no cap in practice.
constexpr double kUnlimitedBits = 100e9;
// Sharing among HTB siblings is not used (each class is its own link);
// a fixed quantum keeps tc from warning about r2q at high rates.
constexpr char kQuantum[] = "200000";
constexpr double kBurstSeconds = 1e-3;
constexpr int kNetemLimit = 100000;  // packets queued in a delay line

std::string NodeLink(int i) { return absl::StrCat("hapnet-n", i); }
std::string SwitchPort(int i) { return absl::StrCat("hapnet-s", i); }

std::string RateArg(double bits) { return absl::StrFormat("%.0fbit", bits); }
std::string DelayArg(double seconds) { return absl::StrFormat("%.0fus", seconds * 1e6); }

absl::StatusOr<LinkShape> ParseShape(absl::string_view text) {
  // absl::StrSplit of an empty view made of no string gives no parts.
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  if (parts.empty()) parts.push_back("");
  if (parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not RATE[:DELAY]"));
  }
  LinkShape s;
  HAP_ASSIGN_OR_RETURN(s.rate_bits_per_second, ParseRate(parts[0]));
  if (parts.size() == 2) {
    HAP_ASSIGN_OR_RETURN(s.delay_seconds, ParseDelay(parts[1]));
  }
  return s;
}

std::string ShapeText(const LinkShape& s) {
  std::string out =
      s.rate_bits_per_second > 0 ? RateArg(s.rate_bits_per_second) : std::string("unlimited");
  if (s.delay_seconds > 0) absl::StrAppend(&out, ":", DelayArg(s.delay_seconds));
  return out;
}

// Where a program is, without relying on the caller's PATH (bazel's test
// PATH has no sbin).
std::string FindProgram(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    std::string p = absl::StrCat(dir, "/", name);
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

bool Alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

// Field 22 of /proc/PID/stat: the start time in clock ticks since boot;
// empty when the process is gone.
std::string StartTime(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(f, line)) return "";
  size_t close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return "";
  std::vector<std::string> fields = absl::StrSplit(line.substr(close + 2), ' ');
  return fields.size() > 19 ? fields[19] : "";  // fields[0] is field 3
}

std::string StatePath(const TestbedOptions& o, pid_t owner) {
  return absl::StrCat(o.state_dir, "/", o.prefix, "-", owner, ".state");
}

// The number in `text` when `text` is that number as StrCat writes it
// (no sign, no leading zeros), or -1.
int64_t Canonical(absl::string_view text) {
  int64_t n;
  return absl::SimpleAtoi(text, &n) && n >= 0 && text == absl::StrCat(n) ? n : -1;
}

// The owner pid of a namespace named as a testbed names its own,
// PREFIX-OWNER-sw or PREFIX-OWNER-n<i>; -1 for any other name. One that
// only starts the same way ("hapnet-123-mine") is someone else's: it was
// deleted, every process inside killed, once pid 123 was gone.
pid_t OwnerOf(const TestbedOptions& o, absl::string_view ns) {
  if (!absl::ConsumePrefix(&ns, o.prefix + "-")) return -1;
  std::pair<absl::string_view, absl::string_view> owner_role =
      absl::StrSplit(ns, absl::MaxSplits('-', 1));
  const int64_t pid = Canonical(owner_role.first);
  absl::string_view role = owner_role.second;
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return -1;
  if (role == "sw") return static_cast<pid_t>(pid);
  if (!absl::ConsumePrefix(&role, "n")) return -1;
  const int64_t node = Canonical(role);
  return node >= 0 && node < kMaxNodes ? static_cast<pid_t>(pid) : -1;
}

// The owner's set is stale when the owner is gone, or when the state file
// names another process that had the same pid.
bool OwnerGone(const TestbedOptions& o, pid_t owner) {
  if (!Alive(owner)) return true;
  // Only a regular file is read (a device such as /dev/full never ends).
  std::error_code ec;
  if (!std::filesystem::is_regular_file(StatePath(o, owner), ec)) return false;
  std::ifstream f(StatePath(o, owner));
  std::string key, start;
  while (f >> key) {
    if (key == "start" && f >> start) return start != StartTime(owner);
    f.ignore(1 << 20, '\n');
  }
  return false;  // no state file yet: a run being set up
}

// Kills the processes inside namespace `ns` (never this one) and deletes it.
absl::Status RemoveNamespace(const TestbedOptions& o, const std::string& ns) {
  auto pids = o.run({"ip", "netns", "pids", ns});
  if (pids.ok()) {
    for (absl::string_view p : absl::StrSplit(*pids, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
      int pid;
      if (absl::SimpleAtoi(p, &pid) && pid > 0 && pid != getpid()) kill(pid, SIGKILL);
    }
  }
  auto del = o.run({"ip", "netns", "del", ns});
  if (!del.ok() && std::filesystem::exists(o.netns_dir + "/" + ns)) return del.status();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<double> ParseRate(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (text == "unlimited") return 0.0;
  struct Unit {
    const char* suffix;
    double scale;
  };
  // Longest suffixes first: "bit" ends every one of them.
  for (const Unit& u : {Unit{"tbit", 1e12}, Unit{"gbit", 1e9}, Unit{"mbit", 1e6}, Unit{"kbit", 1e3},
                        Unit{"bit", 1}}) {
    absl::string_view number = text;
    if (!absl::ConsumeSuffix(&number, u.suffix)) continue;
    double v;
    if (!absl::SimpleAtod(number, &v) || !(v > 0) || v * u.scale > 1e13) break;
    return v * u.scale;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("rate '", text,
                   "' must be a positive number with bit, kbit, mbit, gbit or tbit "
                   "(at most 10tbit), or 'unlimited'"));
}

absl::StatusOr<double> ParseDelay(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  struct Unit {
    const char* suffix;
    double scale;
  };
  for (const Unit& u : {Unit{"us", 1e-6}, Unit{"ms", 1e-3}, Unit{"s", 1}}) {
    absl::string_view number = text;
    if (!absl::ConsumeSuffix(&number, u.suffix)) continue;
    double v;
    if (!absl::SimpleAtod(number, &v) || !(v >= 0) || v * u.scale > 10) break;
    return v * u.scale;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("delay '", text, "' must be a number from 0 to 10 s with us, ms or s"));
}

LinkShape NetworkSpec::Link(int i, int j) const {
  auto it = pairs.find({std::min(i, j), std::max(i, j)});
  return it != pairs.end() ? it->second : between;
}

absl::Status NetworkSpec::Validate() const {
  if (nodes < 1 || nodes > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("network: nodes must be 1 to ", kMaxNodes, ", got ", nodes));
  }
  for (const auto& [p, shape] : pairs) {
    if (p.second >= nodes) {
      return absl::InvalidArgumentError(absl::StrCat("network: pair=", p.first, "-", p.second,
                                                     " names node ", p.second, " of ", nodes,
                                                     " (nodes are 0-", nodes - 1, ")"));
    }
  }
  for (int n : rank_nodes) {
    if (n >= nodes) {
      return absl::InvalidArgumentError(absl::StrCat("network: ranks= names node ", n, " of ",
                                                     nodes, " (nodes are 0-", nodes - 1, ")"));
    }
  }
  return absl::OkStatus();
}

std::string NetworkSpec::ToString() const {
  std::vector<std::string> items;
  if (nodes > 0) items.push_back(absl::StrCat("nodes=", nodes));
  if (between.shaped()) items.push_back("between=" + ShapeText(between));
  if (inside.shaped()) items.push_back("inside=" + ShapeText(inside));
  for (const auto& [p, shape] : pairs) {
    items.push_back(absl::StrCat("pair=", p.first, "-", p.second, ":", ShapeText(shape)));
  }
  if (!rank_nodes.empty()) items.push_back("ranks=" + absl::StrJoin(rank_nodes, ","));
  return absl::StrJoin(items, " ");
}

absl::StatusOr<NetworkSpec> ParseNetworkSpec(absl::string_view text) {
  NetworkSpec spec;
  bool any = false;
  std::set<std::string> seen;
  for (absl::string_view item :
       absl::StrSplit(text, absl::ByAnyChar(" \t\n;"), absl::SkipEmpty())) {
    any = true;
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    const absl::string_view key = kv.first, value = kv.second;
    auto bad = [&](const absl::Status& s) {
      return absl::InvalidArgumentError(absl::StrCat("network: ", key, ": ", s.message()));
    };
    if (!absl::StrContains(item, '=')) {
      return absl::InvalidArgumentError(
          absl::StrCat("network: '", item, "' has no value (items are KEY=VALUE)"));
    }
    // One of each but pair: a second one silently replaced the first (or
    // for ranks= was appended to it).
    if (key != "pair" && !seen.insert(std::string(key)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("network: ", key, " given twice (second: '", item, "')"));
    }
    if (key == "nodes") {
      if (!absl::SimpleAtoi(value, &spec.nodes) || spec.nodes < 1 || spec.nodes > kMaxNodes) {
        return absl::InvalidArgumentError(
            absl::StrCat("network: nodes must be 1 to ", kMaxNodes, ", got '", value, "'"));
      }
    } else if (key == "between" || key == "inside") {
      auto shape = ParseShape(value);
      if (!shape.ok()) return bad(shape.status());
      (key == "between" ? spec.between : spec.inside) = *shape;
    } else if (key == "pair") {
      std::pair<absl::string_view, absl::string_view> ends_rest =
          absl::StrSplit(value, absl::MaxSplits(':', 1));
      std::pair<absl::string_view, absl::string_view> ends = absl::StrSplit(ends_rest.first, '-');
      int i, j;
      if (!absl::SimpleAtoi(ends.first, &i) || !absl::SimpleAtoi(ends.second, &j) || i < 0 ||
          j < 0 || i == j || ends_rest.second.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "network: pair must be I-J:RATE[:DELAY] with two different node numbers, got '", value,
            "'"));
      }
      auto shape = ParseShape(ends_rest.second);
      if (!shape.ok()) return bad(shape.status());
      if (!spec.pairs.emplace(std::make_pair(std::min(i, j), std::max(i, j)), *shape).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("network: pair ", std::min(i, j), "-", std::max(i, j), " given twice"));
      }
    } else if (key == "ranks") {
      for (absl::string_view n : absl::StrSplit(value, ',')) {
        int node;
        // Bounded here: 1 + the largest node overflowed for 2147483647.
        if (!absl::SimpleAtoi(n, &node) || node < 0 || node >= kMaxNodes) {
          return absl::InvalidArgumentError(
              absl::StrCat("network: ranks must be node numbers from 0 to ", kMaxNodes - 1,
                           " separated by commas, got '", value, "'"));
        }
        spec.rank_nodes.push_back(node);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "network: unknown item '", item,
          "' (items: nodes=N between=RATE[:DELAY] inside=RATE[:DELAY] pair=I-J:RATE[:DELAY] "
          "ranks=N,N,...)"));
    }
  }
  if (!any) return absl::InvalidArgumentError("network: the spec is empty");
  if (spec.nodes > 0) HAP_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError("RunCommand: no command");
  const std::string path = FindProgram(argv[0]);
  if (path.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", argv[0], "' not found in /usr/sbin, /sbin, /usr/bin or /bin"));
  }
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return absl::InternalError("pipe failed");
  }
  std::vector<std::string> args = argv;
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    dup2(err[1], 2);
    execv(path.c_str(), cargs.data());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  std::string text[2];
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open_fds = 2;
  while (open_fds > 0) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int k = 0; k < 2; ++k) {
      if (fds[k].fd < 0 || !(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      ssize_t n = read(fds[k].fd, buf, sizeof(buf));
      if (n > 0) {
        text[k].append(buf, n);
      } else if (n == 0 || errno != EINTR) {
        close(fds[k].fd);
        fds[k].fd = -1;
        --open_fds;
      }
    }
  }
  for (const pollfd& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  int status = 0;
  if (pid < 0) return absl::InternalError(absl::StrCat("cannot fork for ", argv[0]));
  pid_t waited;
  while ((waited = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  if (waited < 0) {
    // ECHILD: reaped by the kernel (SIGCHLD ignored), its status lost. A
    // failure not seen must not count as done.
    return absl::InternalError(absl::StrCat("cannot learn how '", absl::StrJoin(argv, " "),
                                            "' ended: ", std::strerror(errno),
                                            " (is SIGCHLD ignored?)"));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::UnknownError(absl::StrCat(
        "'", absl::StrJoin(argv, " "), "' failed (", WIFEXITED(status) ? "exit " : "signal ",
        WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
        "): ", absl::StripAsciiWhitespace(text[1])));
  }
  return text[0];
}

Testbed::Testbed(NetworkSpec spec, TestbedOptions options)
    : spec_(std::move(spec)), options_(std::move(options)) {}

Testbed::~Testbed() {
  absl::Status s = Destroy();
  if (!s.ok()) std::cerr << "network testbed: " << s.message() << "\n";
}

std::string Testbed::NodeNamespace(int node) const {
  return absl::StrCat(options_.prefix, "-", options_.owner, "-n", node);
}
std::string Testbed::SwitchNamespace() const {
  return absl::StrCat(options_.prefix, "-", options_.owner, "-sw");
}
std::string Testbed::NodeAddress(int node) { return absl::StrCat(kSubnet, node + 1); }
std::string Testbed::SwitchAddress() { return absl::StrCat(kSubnet, 254); }
std::vector<std::string> Testbed::ExecPrefix(int node) const {
  return {FindProgram("ip"), "netns", "exec", NodeNamespace(node)};
}

absl::StatusOr<std::unique_ptr<Testbed>> Testbed::Create(const NetworkSpec& spec,
                                                         TestbedOptions options) {
  HAP_RETURN_IF_ERROR(spec.Validate());
  if (options.owner <= 0) options.owner = getpid();
  if (options.check_environment) {
    if (geteuid() != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the network testbed needs root (network namespaces, veth pairs, tc); this process "
          "runs as uid ",
          geteuid()));
    }
    for (const char* p : {"ip", "tc"}) {
      if (FindProgram(p).empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("the network testbed needs '", p, "' (iproute2), not found"));
      }
    }
  }
  // A stale set that cannot be removed is named, not fatal: this one is
  // made in namespaces of its own beside it (every later launch failed
  // until someone removed it by hand).
  RemoveStaleAndSay(options, "network testbed");
  std::unique_ptr<Testbed> t(new Testbed(spec, std::move(options)));
  const std::string sw = t->SwitchNamespace();
  if (std::filesystem::exists(t->options_.netns_dir + "/" + sw)) {
    t->destroyed_ = true;  // not ours to remove
    return absl::AlreadyExistsError(
        absl::StrCat("network namespace ", sw, " exists: this process has a testbed already"));
  }
  absl::Status s = t->Build();
  if (!s.ok()) {
    absl::Status d = t->Destroy();
    if (!d.ok()) std::cerr << "network testbed: " << d.message() << "\n";
    return s;
  }
  return t;
}

absl::Status Testbed::Build() {
  const TestbedOptions& o = options_;
  // The state file first: a run killed while building leaves it for the
  // next one to find.
  std::error_code ec;
  std::filesystem::create_directories(o.state_dir, ec);
  {
    std::ofstream f(StatePath(o, o.owner));
    f << "owner " << o.owner << "\nstart " << StartTime(o.owner) << "\nspec " << spec_.ToString()
      << "\nnamespaces " << SwitchNamespace();
    for (int i = 0; i < spec_.nodes; ++i) f << " " << NodeNamespace(i);
    f << "\n";
    // Closed before the check: a full disk fails the flush, not the <<.
    errno = 0;
    f.close();
    if (!f) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot write the testbed state file ", StatePath(o, o.owner), ": ",
                       errno != 0 ? std::strerror(errno) : "write failed"));
    }
  }
  auto run = [&](std::vector<std::string> argv) -> absl::Status {
    commands_.push_back(argv);
    return o.run(argv).status();
  };
  auto add_namespace = [&](const std::string& ns) -> absl::Status {
    absl::Status s = run({"ip", "netns", "add", ns});
    if (!s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot make network namespaces here: ", s.message()));
    }
    namespaces_.push_back(ns);
    return run({"ip", "-n", ns, "link", "set", "lo", "up"});
  };
  const std::string sw = SwitchNamespace();
  HAP_RETURN_IF_ERROR(add_namespace(sw));
  HAP_RETURN_IF_ERROR(run({"ip", "-n", sw, "link", "add", kBridge, "type", "bridge"}));
  HAP_RETURN_IF_ERROR(
      run({"ip", "-n", sw, "addr", "add", SwitchAddress() + "/24", "dev", kBridge}));
  HAP_RETURN_IF_ERROR(run({"ip", "-n", sw, "link", "set", kBridge, "up"}));
  for (int i = 0; i < spec_.nodes; ++i) {
    const std::string ns = NodeNamespace(i);
    HAP_RETURN_IF_ERROR(add_namespace(ns));
    // Made in the switch namespace with its peer straight in the node's:
    // never in the machine's own namespace.
    HAP_RETURN_IF_ERROR(run({"ip", "-n", sw, "link", "add", SwitchPort(i), "type", "veth", "peer",
                             "name", NodeLink(i), "netns", ns}));
    HAP_RETURN_IF_ERROR(run({"ip", "-n", sw, "link", "set", SwitchPort(i), "master", kBridge}));
    HAP_RETURN_IF_ERROR(run({"ip", "-n", sw, "link", "set", SwitchPort(i), "up"}));
    HAP_RETURN_IF_ERROR(
        run({"ip", "-n", ns, "addr", "add", NodeAddress(i) + "/24", "dev", NodeLink(i)}));
    HAP_RETURN_IF_ERROR(run({"ip", "-n", ns, "link", "set", NodeLink(i), "up"}));
  }
  // Shaping: an HTB class per rate a node sends at, a netem leaf under it
  // for a delay. Class and handle numbers are hex to tc.
  auto add_class = [&](const std::string& ns, const std::string& dev, int minor,
                       const LinkShape& shape) -> absl::Status {
    const double rate =
        shape.rate_bits_per_second > 0 ? shape.rate_bits_per_second : kUnlimitedBits;
    // tc's default burst (rate / HZ, 1375 bytes at 1 Gbit/s here) starves
    // the link between timer ticks: TCP got 89% of the rate. A millisecond's
    // worth (at least 64 KiB) gives the 95% that TCP/IP headers leave.
    const std::string burst = absl::StrFormat("%.0fb", std::max(rate / 8 * kBurstSeconds, 65536.0));
    HAP_RETURN_IF_ERROR(run({"tc",
                             "-n",
                             ns,
                             "class",
                             "add",
                             "dev",
                             dev,
                             "parent",
                             "1:",
                             "classid",
                             absl::StrFormat("1:%x", minor),
                             "htb",
                             "rate",
                             RateArg(rate),
                             "ceil",
                             RateArg(rate),
                             "burst",
                             burst,
                             "cburst",
                             burst,
                             "quantum",
                             kQuantum}));
    if (shape.delay_seconds > 0) {
      absl::Status s =
          run({"tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", absl::StrFormat("1:%x", minor),
               "handle", absl::StrFormat("%x:", minor + 1), "netem", "delay",
               DelayArg(shape.delay_seconds), "limit", absl::StrCat(kNetemLimit)});
      if (!s.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot add a delay: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)? ",
            s.message(), "; leave the delays out of the network spec"));
      }
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < spec_.nodes; ++i) {
    const std::string ns = NodeNamespace(i), dev = NodeLink(i);
    bool shaped = spec_.between.shaped();
    for (int j = 0; j < spec_.nodes; ++j) {
      if (j != i) shaped = shaped || spec_.Link(i, j).shaped();
    }
    if (shaped) {
      HAP_RETURN_IF_ERROR(run({"tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle",
                               "1:", "htb", "default", "10"}));
      HAP_RETURN_IF_ERROR(add_class(ns, dev, 0x10, spec_.between));
      for (int j = 0; j < spec_.nodes; ++j) {
        const auto it = spec_.pairs.find({std::min(i, j), std::max(i, j)});
        if (j == i || it == spec_.pairs.end()) continue;
        const int minor = 0x100 + 2 * j;  // its netem leaf takes minor + 1
        HAP_RETURN_IF_ERROR(add_class(ns, dev, minor, it->second));
        HAP_RETURN_IF_ERROR(run({"tc",     "-n",
                                 ns,       "filter",
                                 "add",    "dev",
                                 dev,      "parent",
                                 "1:",     "protocol",
                                 "ip",     "prio",
                                 "1",      "u32",
                                 "match",  "ip",
                                 "dst",    NodeAddress(j) + "/32",
                                 "flowid", absl::StrFormat("1:%x", minor)}));
      }
    }
    if (spec_.inside.shaped()) {
      HAP_RETURN_IF_ERROR(run({"tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "handle",
                               "1:", "htb", "default", "10"}));
      HAP_RETURN_IF_ERROR(add_class(ns, "lo", 0x10, spec_.inside));
    }
  }
  return absl::OkStatus();
}

absl::Status Testbed::Destroy() {
  if (destroyed_) return absl::OkStatus();
  absl::Status first;
  for (auto it = namespaces_.rbegin(); it != namespaces_.rend(); ++it) {
    absl::Status s = RemoveNamespace(options_, *it);
    if (!s.ok() && first.ok()) first = s;
  }
  namespaces_.clear();
  std::error_code ec;
  std::filesystem::remove(StatePath(options_, options_.owner), ec);
  destroyed_ = first.ok();
  return first;
}

absl::Status EnterNamespace(const std::string& name, const std::string& netns_dir) {
  const std::string path = netns_dir + "/" + name;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot open network namespace ", path, ": ", strerror(errno)));
  }
  int rc = setns(fd, CLONE_NEWNET);
  int err = errno;
  close(fd);
  if (rc != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot enter network namespace ", name, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

std::vector<std::string> ListNamespaces(const TestbedOptions& options) {
  std::vector<std::string> out;
  std::error_code ec;  // a read error part way ends the listing (the range-for threw)
  for (std::filesystem::directory_iterator it(options.netns_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (OwnerOf(options, name) > 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

StaleRemoval RemoveStale(const TestbedOptions& options) {
  StaleRemoval out;
  std::set<pid_t> kept;  // owners with a namespace that could not be removed
  for (const std::string& ns : ListNamespaces(options)) {
    const pid_t owner = OwnerOf(options, ns);
    if (owner <= 0 || !OwnerGone(options, owner)) continue;
    if (absl::Status s = RemoveNamespace(options, ns); !s.ok()) {
      out.failed.push_back(absl::StrCat("could not remove ", ns, " (left by a run that is gone): ",
                                        s.message(), "; remove it with `ip netns del ", ns, "`"));
      kept.insert(owner);
      continue;
    }
    out.removed.push_back(ns);
  }
  // State files whose owner is gone (namespaces removed above or never made).
  std::error_code ec;
  for (std::filesystem::directory_iterator it(options.state_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::filesystem::directory_entry& e = *it;
    const std::string name = e.path().filename().string();
    absl::string_view rest = name;
    if (!absl::ConsumePrefix(&rest, options.prefix + "-") ||
        !absl::ConsumeSuffix(&rest, ".state")) {
      continue;
    }
    const int64_t pid = Canonical(rest);
    if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) continue;
    std::error_code rm;  // one that cannot be removed does not end the loop
    if (!kept.count(pid) && OwnerGone(options, pid)) std::filesystem::remove(e.path(), rm);
  }
  return out;
}

void RemoveStaleAndSay(const TestbedOptions& options, absl::string_view who) {
  const StaleRemoval stale = RemoveStale(options);
  for (const std::string& ns : stale.removed) {
    std::cerr << who << ": removed " << ns << ", left by a run that is gone\n";
  }
  for (const std::string& why : stale.failed) std::cerr << who << ": " << why << "\n";
}

absl::StatusOr<int> RemoveOwned(const TestbedOptions& options) {
  const std::string head = absl::StrCat(options.prefix, "-", options.owner, "-");
  int removed = 0;
  for (const std::string& ns : ListNamespaces(options)) {
    if (!absl::StartsWith(ns, head)) continue;
    HAP_RETURN_IF_ERROR(RemoveNamespace(options, ns));
    ++removed;
  }
  std::error_code ec;
  std::filesystem::remove(StatePath(options, options.owner), ec);
  return removed;
}

}  // namespace hap::netns
