// hap-agent as a process: it prints its port, serves, registers with a
// (fake) planner, and exits 0 on SIGTERM; bad flags exit 2.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/agent_service.grpc.pb.h"
#include "profiler_agent/devices.h"
#include "profiler_agent/fake_planner.h"

extern char** environ;

namespace hap::agent {
namespace {

using ::hap::agent::testing::FakePlanner;
using ::hap::testing::IsOk;
namespace v1 = hap::v1;

// A file of this package in the test's runfiles.
std::string Runfile(const std::string& name) {
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  std::string rel = "profiler_agent/" + name;
  return src && ws ? absl::StrCat(src, "/", ws, "/", rel) : rel;
}

// The agent binary with stdout on a pipe (stderr passes through to the
// test log, or goes to `stderr_path` when given), in this process's
// environment plus `env` ("NAME=value"). Stopped by pid.
class AgentProcess {
 public:
  explicit AgentProcess(std::vector<std::string> args, const std::string& stderr_path = "",
                        std::vector<std::string> env = {}) {
    int p[2];
    if (pipe(p) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_addclose(&fa, p[0]);
    if (!stderr_path.empty()) {
      posix_spawn_file_actions_addopen(&fa, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                       0644);
    }
    args.insert(args.begin(), Runfile("hap-agent"));
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(p[1]);
    out_ = p[0];
  }
  ~AgentProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }

  // The first stdout line starting with `prefix`, without it; "" on EOF or
  // after `timeout`.
  std::string ReadLine(const std::string& prefix, absl::Duration timeout) {
    absl::Time deadline = absl::Now() + timeout;
    std::string line;
    while (absl::Now() < deadline) {
      pollfd pf{out_, POLLIN, 0};
      if (poll(&pf, 1, 100) <= 0) continue;
      char c;
      if (read(out_, &c, 1) != 1) return "";
      if (c != '\n') {
        line += c;
        continue;
      }
      if (absl::StartsWith(line, prefix)) return line.substr(prefix.size());
      line.clear();
    }
    return "";
  }

  // Sends `sig` and waits up to `timeout` for the exit; the wait status, or
  // -1 (after a SIGKILL) when it did not exit in time.
  int Stop(int sig, absl::Duration timeout) {
    kill(pid_, sig);
    absl::Time deadline = absl::Now() + timeout;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) return -1;  // the destructor kills it
      pollfd none{-1, 0, 0};
      poll(&none, 0, 20);
    }
    pid_ = -1;
    return status;
  }

  pid_t pid() const { return pid_; }
  // Closes our end of its stdout: the reader is gone (`| head -1`).
  void CloseStdout() {
    close(out_);
    out_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
};

TEST(HapAgentBinaryTest, PrintsItsPortRegistersAndExitsCleanlyOnSigterm) {
  FakePlanner planner(absl::Milliseconds(50));
  AgentProcess agent({"--planner", planner.address(), "--name", "bin-node", "--probe-seconds",
                      "0.2", "--drift", "0", "--devices", "cpu"});
  ASSERT_GT(agent.pid(), 0);
  std::string address = agent.ReadLine("listening on ", absl::Seconds(60));
  ASSERT_TRUE(absl::StartsWith(address, "127.0.0.1:")) << "got '" << address << "'";
  EXPECT_NE(address, "127.0.0.1:0");

  ASSERT_TRUE(planner.WaitFor(
      [](const FakePlanner::Record& r) { return r.heartbeats >= 2 && r.nodes.count("bin-node"); }));
  const v1::Node node = planner.Snapshot().nodes.at("bin-node");
  EXPECT_EQ(node.address(), address);
  ASSERT_EQ(node.devices_size(), 1);
  EXPECT_EQ(node.devices(0).id(), "bin-node/cpu0");
  EXPECT_GT(node.devices(0).flops(0).flops(), 0);
  EXPECT_GT(node.devices(0).memory_bytes(), 0);

  // It serves its profile at the printed port.
  auto channel = hap::service::MakeChannel(address, {});
  ASSERT_THAT(channel, IsOk());
  grpc::ClientContext ctx;
  v1::ProbeResponse profile;
  ASSERT_TRUE(
      v1::Agent::NewStub(*channel)->GetProfile(&ctx, v1::GetProfileRequest(), &profile).ok());
  EXPECT_EQ(profile.node().name(), "bin-node");

  int status = agent.Stop(SIGTERM, absl::Seconds(10));
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// `hap-agent ... | head -1` (a script reading the port): the "shutting
// down" line on SIGTERM raised SIGPIPE and killed the agent (signal 13)
// before its graceful shutdown.
TEST(HapAgentBinaryTest, AStdoutWhoseReaderIsGoneDoesNotKillIt) {
  FakePlanner planner(absl::Milliseconds(50));
  AgentProcess agent({"--planner", planner.address(), "--name", "pipe-node", "--probe-seconds",
                      "0.2", "--drift", "0", "--devices", "cpu"});
  ASSERT_GT(agent.pid(), 0);
  ASSERT_FALSE(agent.ReadLine("listening on ", absl::Seconds(60)).empty());
  agent.CloseStdout();
  int status = agent.Stop(SIGTERM, absl::Seconds(10));
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(HapAgentBinaryTest, FlagsComeFromTheEnvironmentToo) {
  FakePlanner planner(absl::Milliseconds(50));
  setenv("HAP_PLANNER", planner.address().c_str(), 1);
  setenv("HAP_NAME", "env-node", 1);
  AgentProcess agent({"--probe-seconds", "0.2"});
  unsetenv("HAP_PLANNER");
  unsetenv("HAP_NAME");
  ASSERT_FALSE(agent.ReadLine("listening on ", absl::Seconds(60)).empty());
  ASSERT_TRUE(
      planner.WaitFor([](const FakePlanner::Record& r) { return r.nodes.count("env-node") > 0; }));
  int status = agent.Stop(SIGINT, absl::Seconds(10));
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// The wall clock stepped back (NTP, `date -s`) while the agent waits for
// its next heartbeat: a schedule kept in wall-clock time waits the step on
// top (an hour back: an hour without heartbeats, the node STALE and its
// jobs re-planned). The preloaded shim steps the agent's CLOCK_REALTIME an
// hour back at SIGUSR1.
TEST(HapAgentBinaryTest, HeartbeatsGoOnWhenTheWallClockSteps) {
  FakePlanner planner(absl::Milliseconds(50));
  AgentProcess agent({"--planner", planner.address(), "--name", "clock-node", "--probe-seconds",
                      "0.2", "--drift", "0", "--devices", "cpu"},
                     "",
                     {absl::StrCat("LD_PRELOAD=", Runfile("wall_clock_jump_shim.so")),
                      "HAP_TEST_CLOCK_JUMP_SECONDS=-3600"});
  ASSERT_GT(agent.pid(), 0);
  ASSERT_FALSE(agent.ReadLine("listening on ", absl::Seconds(60)).empty());
  ASSERT_TRUE(planner.WaitFor([](const FakePlanner::Record& r) {
    return r.heartbeats >= 2 && r.nodes.count("clock-node");
  }));
  // Which of the agent's clock readings first sees a step depends on when
  // absl::Now() reads the kernel's clock again (about every 2 s; it
  // interpolates in between): step it back five times, each time waiting
  // for 60 heartbeats (3 s at 50 ms).
  for (int step = 1; step <= 5; ++step) {
    ASSERT_EQ(kill(agent.pid(), SIGUSR1), 0);
    const int before = planner.Snapshot().heartbeats;
    ASSERT_TRUE(planner.WaitFor([before](const FakePlanner::Record& r) {
      return r.heartbeats >= before + 60;
    })) << "the heartbeats stopped when the wall clock stepped back (step "
        << step << ")";
  }
  int status = agent.Stop(SIGTERM, absl::Seconds(10));
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(HapAgentBinaryTest, MissingPlannerOrBadFlagsExitTwo) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"--name", "x"},
        std::vector<std::string>{"--planner", "127.0.0.1:1", "--bogus"},
        std::vector<std::string>{"--planner", "127.0.0.1:1", "--drift", "lots"},
        std::vector<std::string>{"--planner", "127.0.0.1:1", "--devices", "tpu"},
        std::vector<std::string>{"--planner", "127.0.0.1:1", "stray"}}) {
    AgentProcess agent(args);
    ASSERT_GT(agent.pid(), 0);
    int status = agent.Stop(0, absl::Seconds(10));  // signal 0: just wait
    ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 2) << args.back();
  }
}

TEST(HapAgentBinaryTest, DevicesGpuWithoutAGpuExitsOneNamingWhy) {
  if (BuiltWithCuda() && MakeDeviceProbers(DeviceSelection::kGpu).ok()) {
    GTEST_SKIP() << "built with CUDA and a GPU is visible: --devices gpu works here";
  }
  std::string err = absl::StrCat(std::getenv("TEST_TMPDIR"), "/devices_gpu.stderr");
  AgentProcess agent({"--planner", "127.0.0.1:1", "--name", "x", "--devices", "gpu"}, err);
  ASSERT_GT(agent.pid(), 0);
  int status = agent.Stop(0, absl::Seconds(30));
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 1);
  std::ifstream f(err);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, ::testing::HasSubstr(BuiltWithCuda()
                                             ? "--devices gpu: no GPU is visible"
                                             : "--devices gpu: this hap-agent was built without "
                                               "CUDA"));
}

}  // namespace
}  // namespace hap::agent
