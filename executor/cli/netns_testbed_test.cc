#include "executor/cli/netns_testbed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::netns {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/", name);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(NetworkSpecTest, ParsesEveryItem) {
  auto spec = ParseNetworkSpec(
      "nodes=3 between=1gbit;inside=10gbit:50us pair=2-0:300mbit:2ms "
      "ranks=0,0,1,2");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->nodes, 3);
  EXPECT_DOUBLE_EQ(spec->between.rate_bits_per_second, 1e9);
  EXPECT_DOUBLE_EQ(spec->between.delay_seconds, 0);
  EXPECT_DOUBLE_EQ(spec->inside.rate_bits_per_second, 1e10);
  EXPECT_DOUBLE_EQ(spec->inside.delay_seconds, 50e-6);
  // A pair applies both ways; the others get `between`.
  EXPECT_DOUBLE_EQ(spec->Link(0, 2).rate_bits_per_second, 3e8);
  EXPECT_DOUBLE_EQ(spec->Link(2, 0).rate_bits_per_second, 3e8);
  EXPECT_DOUBLE_EQ(spec->Link(2, 0).delay_seconds, 2e-3);
  EXPECT_DOUBLE_EQ(spec->Link(1, 2).rate_bits_per_second, 1e9);
  EXPECT_EQ(spec->rank_nodes, (std::vector<int>{0, 0, 1, 2}));
  auto again = ParseNetworkSpec(spec->ToString());
  ASSERT_TRUE(again.ok()) << again.status() << " for " << spec->ToString();
  EXPECT_EQ(again->ToString(), spec->ToString());
}

TEST(NetworkSpecTest, RatesAndDelays) {
  EXPECT_DOUBLE_EQ(*ParseRate("500kbit"), 5e5);
  EXPECT_DOUBLE_EQ(*ParseRate("2.5mbit"), 2.5e6);
  EXPECT_DOUBLE_EQ(*ParseRate("1tbit"), 1e12);
  EXPECT_DOUBLE_EQ(*ParseRate("800bit"), 800);
  EXPECT_DOUBLE_EQ(*ParseRate("unlimited"), 0);
  EXPECT_DOUBLE_EQ(*ParseDelay("250us"), 250e-6);
  EXPECT_DOUBLE_EQ(*ParseDelay("1.5ms"), 1.5e-3);
  EXPECT_DOUBLE_EQ(*ParseDelay("0s"), 0);
  for (const char* bad : {"1gbps", "1GB", "-1mbit", "0gbit", "gbit", "20tbit", ""}) {
    EXPECT_THAT(ParseRate(bad).status().message(), HasSubstr("must be a positive number")) << bad;
  }
  for (const char* bad : {"1", "-1ms", "20s", "ms"}) {
    EXPECT_THAT(ParseDelay(bad).status().message(), HasSubstr("us, ms or s")) << bad;
  }
}

TEST(NetworkSpecTest, BadSpecsNameWhatIsWrong) {
  struct Case {
    const char* spec;
    const char* error;
  };
  for (const Case& c : {
           Case{"", "the spec is empty"},
           Case{"nodes=0", "nodes must be 1 to 64, got '0'"},
           Case{"nodes=two", "nodes must be 1 to 64"},
           Case{"nodes=2 speed=1gbit", "unknown item 'speed=1gbit'"},
           Case{"nodes=2 between=1gbps", "between: rate '1gbps'"},
           Case{"nodes=2 inside=1gbit:3", "inside: delay '3'"},
           Case{"nodes=2 between=1gbit:1ms:2ms", "is not RATE[:DELAY]"},
           Case{"nodes=2 pair=0-2:1gbit", "pair=0-2 names node 2 of 2"},
           Case{"nodes=2 pair=1-1:1gbit", "two different node numbers"},
           Case{"nodes=2 pair=0-1", "I-J:RATE[:DELAY]"},
           Case{"nodes=2 pair=0-1:1gbit pair=1-0:2gbit", "pair 0-1 given twice"},
           Case{"nodes=2 ranks=0,x", "ranks must be node numbers"},
           Case{"nodes=2 ranks=0,1,2", "ranks= names node 2 of 2"},
           // 1 + the largest node overflowed an int.
           Case{"nodes=2 ranks=0,2147483647", "ranks must be node numbers from 0 to 63"},
           // Given twice: the last won (nodes, between, inside) or the
           // lists were joined (ranks=0,1 ranks=1,0 placed four ranks).
           Case{"nodes=2 nodes=3", "nodes given twice"},
           Case{"nodes=2 between=1gbit between=2gbit", "between given twice"},
           Case{"nodes=2 inside=1gbit inside=2gbit", "inside given twice"},
           Case{"nodes=2 ranks=0,1 ranks=1,0", "ranks given twice"},
           // No '=': a segmentation fault (no value to split).
           Case{"nodes=2 between", "'between' has no value (items are KEY=VALUE)"},
           Case{"inside", "'inside' has no value"},
           Case{"nodes=2 between=", "between: rate ''"},
       }) {
    auto s = ParseNetworkSpec(c.spec);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    EXPECT_THAT(s.status().message(), HasSubstr(c.error)) << c.spec;
  }
  // Without nodes= the spec is checked when a launcher fills them in.
  auto open = ParseNetworkSpec("between=1gbit pair=0-5:1mbit");
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_THAT(open->Validate().message(), HasSubstr("nodes must be 1 to 64, got 0"));
  open->nodes = 3;
  EXPECT_THAT(open->Validate().message(), HasSubstr("pair=0-5 names node 5 of 3"));
}

// A runner that records the commands and fails the ones matching `fail`.
struct Recorder {
  std::vector<std::string> commands;
  std::string fail;
  CommandRunner runner() {
    return [this](const std::vector<std::string>& argv) -> absl::StatusOr<std::string> {
      std::string line = absl::StrJoin(argv, " ");
      commands.push_back(line);
      if (!fail.empty() && line.find(fail) != std::string::npos) {
        return absl::UnknownError("Error: Specified qdisc kind is unknown.");
      }
      return std::string();
    };
  }
};

TestbedOptions Recorded(Recorder* r, const std::string& name) {
  TestbedOptions o;
  o.owner = 4242;
  o.state_dir = TempDir(name + "-state");
  o.netns_dir = TempDir(name + "-netns");  // empty: nothing stale
  o.run = r->runner();
  o.check_environment = false;
  return o;
}

TEST(TestbedTest, CommandsShapeEveryLinkInItsNamespaces) {
  Recorder r;
  auto spec = ParseNetworkSpec("nodes=3 between=1gbit inside=10gbit pair=0-2:300mbit");
  ASSERT_TRUE(spec.ok());
  auto t = Testbed::Create(*spec, Recorded(&r, "shape"));
  ASSERT_TRUE(t.ok()) << t.status();
  const auto& c = r.commands;
  EXPECT_THAT(c, Contains("ip netns add hapnet-4242-sw"));
  EXPECT_THAT(c, Contains("ip -n hapnet-4242-sw link add hapnet-br0 type bridge"));
  EXPECT_THAT(c, Contains("ip -n hapnet-4242-sw addr add 10.213.0.254/24 dev hapnet-br0"));
  EXPECT_THAT(c, Contains("ip -n hapnet-4242-sw link add hapnet-s2 type veth peer name "
                          "hapnet-n2 netns hapnet-4242-n2"));
  EXPECT_THAT(c, Contains("ip -n hapnet-4242-n1 addr add 10.213.0.2/24 dev hapnet-n1"));
  // Node 0: 1 Gbit/s by default, 300 Mbit/s to node 2 (10.213.0.3).
  EXPECT_THAT(c, Contains("tc -n hapnet-4242-n0 qdisc add dev hapnet-n0 root handle 1: htb "
                          "default 10"));
  EXPECT_THAT(c, Contains("tc -n hapnet-4242-n0 class add dev hapnet-n0 parent 1: classid 1:10 "
                          "htb rate 1000000000bit ceil 1000000000bit burst 125000b cburst 125000b "
                          "quantum 200000"));
  EXPECT_THAT(c,
              Contains("tc -n hapnet-4242-n0 class add dev hapnet-n0 parent 1: classid "
                       "1:104 htb rate 300000000bit ceil 300000000bit burst 65536b cburst 65536b "
                       "quantum 200000"));
  EXPECT_THAT(c, Contains("tc -n hapnet-4242-n0 filter add dev hapnet-n0 parent 1: protocol ip "
                          "prio 1 u32 match ip dst 10.213.0.3/32 flowid 1:104"));
  // Node 2 the other way (to node 0, 10.213.0.1); node 1 has no pair.
  EXPECT_THAT(c, Contains("tc -n hapnet-4242-n2 filter add dev hapnet-n2 parent 1: protocol ip "
                          "prio 1 u32 match ip dst 10.213.0.1/32 flowid 1:100"));
  for (const std::string& line : c) {
    EXPECT_THAT(line, Not(HasSubstr("tc -n hapnet-4242-n1 filter"))) << line;
    EXPECT_THAT(line, Not(HasSubstr("netem"))) << line;  // no delay asked
    // Every command names one of our namespaces: nothing in the host's.
    if (line.rfind("ip netns", 0) != 0) {
      EXPECT_THAT(line, HasSubstr("-n hapnet-4242-")) << line;
    }
  }
  EXPECT_THAT(c, Contains("tc -n hapnet-4242-n1 qdisc add dev lo root handle 1: htb default 10"));
  EXPECT_EQ((*t)->NodeNamespace(1), "hapnet-4242-n1");
  EXPECT_EQ(Testbed::NodeAddress(2), "10.213.0.3");
  // Destroy deletes every namespace made.
  r.commands.clear();
  ASSERT_TRUE((*t)->Destroy().ok());
  EXPECT_THAT(r.commands, Contains("ip netns del hapnet-4242-sw"));
  EXPECT_THAT(r.commands, Contains("ip netns del hapnet-4242-n2"));
}

TEST(TestbedTest, DelaysGetNetemAndAMissingNetemIsNamed) {
  Recorder r;
  auto spec = ParseNetworkSpec("nodes=2 between=unlimited:2ms");
  ASSERT_TRUE(spec.ok());
  auto t = Testbed::Create(*spec, Recorded(&r, "delay"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(r.commands, Contains("tc -n hapnet-4242-n1 qdisc add dev hapnet-n1 parent 1:10 "
                                   "handle 11: netem delay 2000us limit 100000"));
  ASSERT_TRUE((*t)->Destroy().ok());

  // A kernel without netem: a clear error, and what was made is removed.
  Recorder no_netem;
  no_netem.fail = "netem";
  auto f = Testbed::Create(*spec, Recorded(&no_netem, "nonetem"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.status().message(), HasSubstr("no netem qdisc"));
  EXPECT_THAT(no_netem.commands, Contains("ip netns del hapnet-4242-sw"));
  EXPECT_THAT(no_netem.commands, Contains("ip netns del hapnet-4242-n0"));
}

TEST(TestbedTest, RefusedNamespacesAreAFailedPrecondition) {
  Recorder r;
  r.fail = "ip netns add";
  auto spec = ParseNetworkSpec("nodes=2 between=1gbit");
  auto t = Testbed::Create(*spec, Recorded(&r, "refused"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(t.status().message(), HasSubstr("cannot make network namespaces here"));
}

TEST(TestbedTest, AStateFileThatCannotBeWrittenFailsBeforeAnythingIsMade) {
  // The state file on a full device: the write fails when it is flushed,
  // which the check before close missed (Create went on without it).
  Recorder r;
  TestbedOptions o = Recorded(&r, "fullstate");
  o.owner = getpid();  // alive: its state file is not a stale one to remove
  const std::string state = absl::StrCat(o.state_dir, "/hapnet-", o.owner, ".state");
  std::filesystem::remove(state);
  std::filesystem::create_symlink("/dev/full", state);
  auto spec = ParseNetworkSpec("nodes=2 between=1gbit");
  auto t = Testbed::Create(*spec, o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(t.status().message(),
              HasSubstr("cannot write the testbed state file " + state + ": No space left"));
  EXPECT_THAT(r.commands, IsEmpty());
  std::filesystem::remove(state);
}

// A stale set whose namespace cannot be removed (here `ip netns del`
// fails and the namespace stays) made every later launch fail until it
// was removed by hand: now it is named, its state file kept for the next
// try, and the new set is made beside it.
TEST(TestbedTest, AStaleSetThatCannotBeRemovedIsNamedAndTheNewSetIsMadeBesideIt) {
  Recorder r;
  r.fail = "ip netns del hapnet-999999-n0";
  TestbedOptions o = Recorded(&r, "stuck");
  const pid_t gone = 999999;  // no process has it (checked)
  ASSERT_NE(kill(gone, 0), 0);
  const std::string stuck = o.netns_dir + "/hapnet-999999-n0";
  const std::string other = o.netns_dir + "/hapnet-999999-sw";
  const std::string state = o.state_dir + "/hapnet-999999.state";
  for (const std::string& f : {stuck, other, state}) std::ofstream(f) << "";
  // The recorder only records: the namespace that is deleted goes by hand.
  CommandRunner record = o.run;
  o.run = [&](const std::vector<std::string>& argv) -> absl::StatusOr<std::string> {
    auto out = record(argv);
    if (out.ok() && argv.size() == 4 && argv[1] == "netns" && argv[2] == "del") {
      std::filesystem::remove(o.netns_dir + "/" + argv[3]);
    }
    return out;
  };
  testing::internal::CaptureStderr();
  auto t = Testbed::Create(*ParseNetworkSpec("nodes=2 between=1gbit"), o);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(r.commands, Contains("ip netns add hapnet-4242-sw"));
  EXPECT_THAT(err, HasSubstr("network testbed: removed hapnet-999999-sw, left by a run that is "
                             "gone"));
  EXPECT_THAT(err, HasSubstr("network testbed: could not remove hapnet-999999-n0 (left by a run "
                             "that is gone): "));
  EXPECT_THAT(err, HasSubstr("remove it with `ip netns del hapnet-999999-n0`"));
  EXPECT_TRUE(std::filesystem::exists(stuck));
  EXPECT_TRUE(std::filesystem::exists(state)) << "the next try needs the owner's state file";
  EXPECT_FALSE(std::filesystem::exists(other));

  // Once it can be removed, it is, with its state file.
  r.fail.clear();
  const StaleRemoval again = RemoveStale(o);
  EXPECT_THAT(again.failed, IsEmpty());
  EXPECT_THAT(again.removed, ElementsAre("hapnet-999999-n0"));
  EXPECT_FALSE(std::filesystem::exists(state));
  ASSERT_TRUE((*t)->Destroy().ok());
}

// Only the testbed's own names (PREFIX-OWNER-sw, PREFIX-OWNER-n<i>) are
// its: a namespace that merely starts with the prefix and a gone owner's
// pid is someone else's. The next start (and hap-netns down) deleted it,
// killing every process inside.
TEST(TestbedTest, OnlyTheTestbedsOwnNamesAreListedAndRemoved) {
  Recorder r;
  TestbedOptions o = Recorded(&r, "foreign");
  const pid_t gone = 999999;  // no process has it (checked)
  ASSERT_NE(kill(gone, 0), 0);
  const std::vector<std::string> ours = {"hapnet-999999-n3", "hapnet-999999-sw"};
  const std::vector<std::string> theirs = {"hapnet-999999-mine", "hapnet-999999-n0x",
                                           "hapnet-999999-sw2",  "hapnet-999999-n-1",
                                           "hapnet-0999999-sw",  "hapnet-999999-n"};
  for (const auto& names : {ours, theirs}) {
    for (const std::string& ns : names) std::ofstream(o.netns_dir + "/" + ns) << "";
  }
  EXPECT_THAT(ListNamespaces(o), ElementsAre("hapnet-999999-n3", "hapnet-999999-sw"));

  const StaleRemoval stale = RemoveStale(o);
  EXPECT_THAT(stale.failed, IsEmpty());
  EXPECT_THAT(stale.removed, ElementsAre("hapnet-999999-n3", "hapnet-999999-sw"));
  o.owner = gone;
  ASSERT_TRUE(RemoveOwned(o).ok());
  for (const std::string& ns : theirs) {
    EXPECT_THAT(r.commands, Not(Contains("ip netns pids " + ns))) << ns;
    EXPECT_THAT(r.commands, Not(Contains("ip netns del " + ns))) << ns;
  }
  for (const std::string& ns : ours) EXPECT_THAT(r.commands, Contains("ip netns del " + ns));
}

// hap-netns's own argument errors (no root needed): a flag without its
// value was "unexpected argument '--network'", --network given to another
// command was ignored, and node 01 was looked up as namespace ...-n01.
TEST(HapNetnsTest, ArgumentErrorsNameWhatIsWrong) {
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  ASSERT_TRUE(src && ws);
  const std::string tool = absl::StrCat(src, "/", ws, "/executor/cli/hap-netns");
  auto error = [&](std::vector<std::string> args) {
    args.insert(args.begin(), tool);
    return std::string(RunCommand(args).status().message());
  };
  EXPECT_THAT(error({"up", "--network"}), HasSubstr("hap-netns: --network needs a value"));
  EXPECT_THAT(error({"down", "--owner"}), HasSubstr("hap-netns: --owner needs a value"));
  EXPECT_THAT(error({"down", "--owner", "999999", "--network", "nodes=2"}),
              HasSubstr("hap-netns: --network applies to up only"));
  EXPECT_THAT(error({"exec", "01", "--owner", "999999", "--", "true"}),
              HasSubstr("cannot open network namespace /var/run/netns/hapnet-999999-n1:"));
  // down with nothing to remove said nothing and exited 0.
  EXPECT_THAT(error({"down", "--owner", "999999"}),
              HasSubstr("hap-netns: no testbed of owner 999999 here"));
}

// --- With root: real namespaces. Skips where they cannot be made. ---------

// Makes a 2-node testbed or says why not.
absl::StatusOr<std::unique_ptr<Testbed>> RealTestbed(const std::string& text) {
  auto spec = ParseNetworkSpec(text);
  if (!spec.ok()) return spec.status();
  return Testbed::Create(*spec);
}

#define SKIP_UNLESS_MADE(t)                                                        \
  if (!(t).ok() && (t).status().code() == absl::StatusCode::kFailedPrecondition) { \
    GTEST_SKIP() << "no network testbed here: " << (t).status().message();         \
  }                                                                                \
  ASSERT_TRUE((t).ok()) << (t).status()

TEST(RealTestbedTest, NodesTalkAcrossTheBridgeAndAllIsRemoved) {
  auto t = RealTestbed("nodes=2 between=1gbit");
  SKIP_UNLESS_MADE(t);
  const std::string n0 = (*t)->NodeNamespace(0), n1 = (*t)->NodeNamespace(1);
  EXPECT_THAT(ListNamespaces({}), Contains(n0));
  // A server in node 1, a client in node 0, each on a thread that entered
  // its node's namespace.
  std::promise<int> port;
  std::thread server([&] {
    int fd = -1;
    if (EnterNamespace(n1).ok()) {
      fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      inet_pton(AF_INET, Testbed::NodeAddress(1).c_str(), &a.sin_addr);
      if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 1) != 0) {
        close(fd);
        fd = -1;
      }
    }
    if (fd < 0) {
      port.set_value(-1);
      return;
    }
    sockaddr_in bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    port.set_value(ntohs(bound.sin_port));
    // Bounded, so that a client that never connects fails the test below
    // instead of hanging it.
    pollfd pf{fd, POLLIN, 0};
    int c = poll(&pf, 1, 20000) == 1 ? accept(fd, nullptr, nullptr) : -1;
    char byte = 0;
    if (c >= 0 && read(c, &byte, 1) == 1 && byte == 'x') (void)!write(c, "y", 1);
    if (c >= 0) close(c);
    close(fd);
  });
  const int p = port.get_future().get();
  char reply = 0;
  std::thread client([&] {
    if (!EnterNamespace(n0).ok() || p < 0) return;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(p);
    inet_pton(AF_INET, Testbed::NodeAddress(1).c_str(), &a.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && write(fd, "x", 1) == 1) {
      (void)!read(fd, &reply, 1);
    }
    close(fd);
  });
  client.join();
  server.join();
  EXPECT_EQ(reply, 'y') << "node 0 did not reach node 1 at " << Testbed::NodeAddress(1);
  // The shaping is in place: node 0's veth has the HTB class.
  auto qdisc = RunCommand({"tc", "-n", n0, "class", "show", "dev", "hapnet-n0"});
  ASSERT_TRUE(qdisc.ok()) << qdisc.status();
  EXPECT_THAT(*qdisc, HasSubstr("rate 1Gbit"));
  ASSERT_TRUE((*t)->Destroy().ok());
  EXPECT_THAT(ListNamespaces({}), Not(Contains(n0)));
  EXPECT_THAT(ListNamespaces({}), Not(Contains((*t)->SwitchNamespace())));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat("/run/hapnet/hapnet-", getpid(), ".state")));
}

// A run SIGKILLed with its testbed up (and a process still inside): the
// next start finds the set by its prefix and removes it, process included.
TEST(RealTestbedTest, AKilledRunsSetIsRemovedAtTheNextStart) {
  if (geteuid() != 0) GTEST_SKIP() << "no network testbed here: not root";
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  ASSERT_TRUE(src && ws);
  const std::string tool = absl::StrCat(src, "/", ws, "/executor/cli/hap-netns");
  pid_t owner = fork();  // stands for a hap-launch that will be killed
  if (owner == 0) {
    pause();
    _exit(0);
  }
  auto up = RunCommand(
      {tool, "up", "--owner", std::to_string(owner), "--network", "nodes=2 between=500mbit"});
  if (!up.ok() &&
      up.status().message().find("cannot make network namespaces") != std::string::npos) {
    kill(owner, SIGKILL);
    waitpid(owner, nullptr, 0);
    GTEST_SKIP() << "no network testbed here: " << up.status().message();
  }
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_THAT(*up, HasSubstr(absl::StrCat("node 1 hapnet-", owner, "-n1 10.213.0.2")));
  const std::string n1 = absl::StrCat("hapnet-", owner, "-n1");
  // A rank left running inside node 1.
  pid_t rank = fork();
  if (rank == 0) {
    if (EnterNamespace(n1).ok()) pause();
    _exit(1);
  }
  // While the owner lives, its set is not stale.
  const StaleRemoval kept = RemoveStale({});
  EXPECT_THAT(kept.failed, IsEmpty());
  EXPECT_THAT(kept.removed, Not(Contains(n1)));
  EXPECT_THAT(ListNamespaces({}), Contains(n1));

  kill(owner, SIGKILL);
  waitpid(owner, nullptr, 0);
  // The next start (a testbed of this process) removes the stale set.
  auto t = RealTestbed("nodes=1");
  ASSERT_TRUE(t.ok()) << t.status();
  for (const std::string& ns : ListNamespaces({})) {
    EXPECT_NE(ns.rfind(absl::StrCat("hapnet-", owner, "-"), 0), 0u) << ns << " left";
  }
  int status = 0;
  ASSERT_EQ(waitpid(rank, &status, 0), rank);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "the process left inside the stale namespace was not killed";
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat("/run/hapnet/hapnet-", owner, ".state")));
  ASSERT_TRUE((*t)->Destroy().ok());
  EXPECT_THAT(ListNamespaces({}), Not(Contains((*t)->NodeNamespace(0))));
}

// `hap-netns up` whose listing of the nodes cannot be written (stdout on a
// full device) exited 0 and left the set for a caller that could not know
// its names; now it fails and removes the set.
TEST(RealTestbedTest, UpWithAnUnwritableListingFailsAndRemovesTheSet) {
  if (geteuid() != 0) GTEST_SKIP() << "no network testbed here: not root";
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  ASSERT_TRUE(src && ws);
  const std::string tool = absl::StrCat(src, "/", ws, "/executor/cli/hap-netns");
  const std::string owner = std::to_string(getpid());
  pid_t pid = fork();
  if (pid == 0) {
    const int full = open("/dev/full", O_WRONLY);
    if (full < 0 || dup2(full, 1) < 0) _exit(100);
    execl(tool.c_str(), tool.c_str(), "up", "--owner", owner.c_str(), "--network", "nodes=1",
          static_cast<char*>(nullptr));
    _exit(101);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "no network testbed here (hap-netns exit 3)";
  EXPECT_EQ(WEXITSTATUS(status), 1);
  for (const std::string& ns : ListNamespaces({})) {
    EXPECT_NE(ns.rfind(absl::StrCat("hapnet-", owner, "-"), 0), 0u) << ns << " left";
  }
  ASSERT_TRUE(RemoveOwned([&] {
                TestbedOptions o;
                o.owner = getpid();
                return o;
              }())
                  .ok());
}

}  // namespace
}  // namespace hap::netns
