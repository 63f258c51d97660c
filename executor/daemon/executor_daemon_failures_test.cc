// The executor daemon (`hap-executor --serve`) under failures: requests and
// start-up failures that must never crash or mislead a long-running service.
// Tests of crashes run in a death-test child, so a crash fails only that
// test.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "common/stop_signal.h"
#include "executor/daemon/core_test_util.h"
#include "executor/daemon/daemon_main.h"
#include "executor/daemon/executor_core.h"
#include "executor/daemon/executor_server.h"
#include "executor/daemon/test_plans.h"
#include "executor/train/in_process_comm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using testing::CachedMlpPlan;
using testing::InProcessGroup;
using testing::InProcessOptions;
using testing::MlpLoad;

// Loads `plan` on two in-process ranks and trains `steps`; the child of a
// death test exits 0 when LoadPlan refuses the plan, 2 when it trains to
// an end without crashing (the bug is then not reproduced, but the plan
// should have been refused), and crashes otherwise.
[[noreturn]] void LoadAndTrainInChild(const v1::Plan& plan, int64_t steps) {
  InProcessGroup group(2);
  ExecutorCore a(InProcessOptions(&group)), b(InProcessOptions(&group));
  for (int r = 0; r < 2; ++r) {
    LoadOptions o = MlpLoad(2, r, steps);
    o.plan = plan;
    auto h = (r == 0 ? a : b).LoadPlan(o);
    if (!h.ok()) {
      std::fprintf(stderr, "LoadPlan refused the plan: %s\n", h.status().ToString().c_str());
      std::_Exit(0);
    }
  }
  if (!a.Start("").ok() || !b.Start("").ok()) std::_Exit(3);
  a.WaitUntilDone(absl::Now() + absl::Seconds(10));
  b.WaitUntilDone(absl::Now() + absl::Seconds(10));
  std::fprintf(stderr, "trained without crashing: %s\n", a.Status().error().c_str());
  std::_Exit(2);
}

class ReviewDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

// 1. ExecutorServer::Start returning an error destroys the half-made
// server, whose destructor calls Shutdown() on a null grpc::Server: a
// bad --tls-ca-file or --listen crashes `hap-executor --serve` instead of
// printing the error.
TEST_F(ReviewDeathTest, ServerStartFailureReturnsAnError) {
  EXPECT_EXIT(
      {
        ExecutorServerOptions o;
        o.planner = "127.0.0.1:1";
        o.security.tls_ca_file = ::testing::TempDir() + "/no-such-ca.pem";
        auto s = ExecutorServer::Start(o);
        std::fprintf(stderr, "Start: %s\n", s.status().ToString().c_str());
        std::_Exit(s.ok() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "Start: NOT_FOUND|Start: INVALID|Start: FAILED");
}

TEST_F(ReviewDeathTest, ServerStartOnABusyPortIsUnavailable) {
  // A port held by another listener (a daemon still running).
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  EXPECT_EXIT(
      {
        ExecutorServerOptions o;
        o.planner = "127.0.0.1:1";
        o.listen = absl::StrCat("127.0.0.1:", port);
        auto s = ExecutorServer::Start(o);
        std::fprintf(stderr, "Start: %s\n", s.status().ToString().c_str());
        std::_Exit(absl::IsUnavailable(s.status()) ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "Start: UNAVAILABLE");
  close(fd);
}

// 2. ProgramRunner::Validate computes a buffer's bytes as n * dtype bytes
// without an overflow check: a buffer of 2^62 floats is "0 bytes", lies
// "inside" the arena, and training writes past the arena (crash).
TEST_F(ReviewDeathTest, HugeBufferIsRefusedAtLoad) {
  v1::Plan plan = CachedMlpPlan(2);
  plan.clear_content_hash();
  for (int r = 0; r < 2; ++r) {
    v1::RankProgram* p = plan.mutable_rank_programs(r);
    v1::Buffer* b = p->add_buffers();
    b->set_id(p->buffers_size() - 1);
    b->set_tensor("huge#state");
    b->set_dtype(v1::FLOAT32);
    b->set_role(v1::Buffer::OPTIMIZER_STATE);
    b->add_shape(int64_t{1} << 62);
    b->add_global_shape(int64_t{1} << 62);
    b->add_offsets(0);
    b->set_offset_bytes(0);
  }
  EXPECT_EXIT(LoadAndTrainInChild(plan, 2), ::testing::ExitedWithCode(0), "refused");
}

// 3. The loss buffer is only checked for its role: RunStep copies all of
// its bytes into one float on the stack. A LOSS buffer of 16M floats
// passes LoadPlan and smashes the training thread's stack.
TEST_F(ReviewDeathTest, NonScalarLossBufferIsRefusedAtLoad) {
  v1::Plan plan = CachedMlpPlan(2);
  plan.clear_content_hash();
  constexpr int64_t kElems = int64_t{1} << 24;
  for (int r = 0; r < 2; ++r) {
    v1::RankProgram* p = plan.mutable_rank_programs(r);
    const int64_t at = (p->arena_bytes() + 63) / 64 * 64;
    v1::Buffer* b = p->add_buffers();
    b->set_id(p->buffers_size() - 1);
    b->set_tensor("loss#big");
    b->set_dtype(v1::FLOAT32);
    b->set_role(v1::Buffer::LOSS);
    b->add_shape(kElems);
    b->add_global_shape(kElems);
    b->add_offsets(0);
    b->set_offset_bytes(at);
    p->set_arena_bytes(at + kElems * 4);
    p->set_loss_buffer(b->id());
  }
  EXPECT_EXIT(LoadAndTrainInChild(plan, 2), ::testing::ExitedWithCode(0), "refused");
}

using testing::HungPeerCommunicator;

// 4. A step that fails by itself while a Stop is pending is reported as
// "stopped by StopTraining": the real error (here a lost peer; equally a
// final checkpoint that did not save) is swallowed.
TEST(ExecutorDaemonFailuresTest, AFailedStepIsNotReportedAsAStop) {
  absl::Notification entered, release;
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.stop_wait = absl::Seconds(20);
  options.connect = [&](const GlooOptions& go,
                        RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return std::make_unique<HungPeerCommunicator>(go.rank, &entered, &release);
  };
  ExecutorCore core(options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 100)), IsOk());
  ASSERT_THAT(core.Start(""), IsOk());
  entered.WaitForNotification();  // inside step 0's first collective
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(500));  // Stop has asked by now
    release.Notify();                          // the collective fails
  });
  auto stopped = core.Stop("");
  releaser.join();
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(), HasSubstr("connection closed by peer 1"));
}

// 5. threads_per_rank has no upper bound: a huge value reaches the device
// (BLAS/OpenMP thread counts).
[[noreturn]] void TrainWithHugeThreadsInChild() {
  InProcessGroup group(2);
  ExecutorCore a(InProcessOptions(&group)), b(InProcessOptions(&group));
  for (int r = 0; r < 2; ++r) {
    LoadOptions o = MlpLoad(2, r, 2);
    o.training.set_threads_per_rank(2'000'000'000);
    auto h = (r == 0 ? a : b).LoadPlan(o);
    if (!h.ok()) {
      std::fprintf(stderr, "refused: %s\n", h.status().ToString().c_str());
      std::_Exit(0);
    }
  }
  if (!a.Start("").ok() || !b.Start("").ok()) std::_Exit(3);
  auto s = a.WaitUntilDone(absl::Now() + absl::Seconds(15));
  b.WaitUntilDone(absl::Now() + absl::Seconds(15));
  std::fprintf(stderr, "trained: %s %s\n", v1::ExecutorStatus::State_Name(s.state()).c_str(),
               s.error().c_str());
  std::_Exit(s.state() == v1::ExecutorStatus::FINISHED ? 0 : 4);
}

TEST_F(ReviewDeathTest, HugeThreadsPerRankIsRefusedOrHarmless) {
  EXPECT_EXIT(TrainWithHugeThreadsInChild(), ::testing::ExitedWithCode(0), "trained: FINISHED|refused");
}

// `hap-executor --serve --drain-seconds nan` (or inf, 1e300) passed the
// flag checks as an infinite drain: on SIGTERM the daemon slept forever
// before shutting down. --timeout inf was an infinite Gloo timeout and
// --timeout 0.0001 a 0 ms one. Each is refused naming the flag and value.
TEST(ExecutorDaemonFailuresTest, NonFiniteOrOutOfRangeSecondsFlagsAreRefused) {
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"drain-seconds", "nan"},
                                                        {"drain-seconds", "inf"},
                                                        {"drain-seconds", "1e300"},
                                                        {"drain-seconds", "-1"},
                                                        {"timeout", "inf"},
                                                        {"timeout", "1e300"},
                                                        {"timeout", "0.0001"},
                                                        {"timeout", "nan"},
                                                        {"threads", "nan"},
                                                        {"threads", "2.5"},
                                                        {"max-streams", "0"},
                                                        {"max-streams", "65537"},
                                                        {"max-streams", "1.5"}}) {
    SCOPED_TRACE(flag + "=" + value);
    auto o = ExecutorDaemonOptions({"--serve", "--planner", "127.0.0.1:1", "--" + flag, value});
    EXPECT_THAT(o.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     AllOf(HasSubstr("--" + flag), HasSubstr("'" + value + "'"))));
  }
  auto o = ExecutorDaemonOptions({"--serve", "--planner", "127.0.0.1:1", "--drain-seconds", "0.5",
                                  "--timeout", "30", "--threads", "2", "--max-streams", "8"});
  ASSERT_THAT(o.status(), IsOk());
  EXPECT_EQ(o->drain, absl::Milliseconds(500));
  EXPECT_EQ(o->core.comm_timeout, absl::Seconds(30));
  EXPECT_EQ(o->core.threads, 2);
  EXPECT_EQ(o->max_streams, 8);
  auto defaults = ExecutorDaemonOptions({"--serve", "--planner", "127.0.0.1:1"});
  ASSERT_THAT(defaults.status(), IsOk());
  EXPECT_EQ(defaults->max_streams, 64);
}

// `--listen 127.0.0.1:70000` served on port 4464 (the port taken modulo
// 65536) and `--listen 127.0.0.1:` on 443 (gRPC's default), each printing
// "listening on" the port it took: the planner, told the port asked for,
// could not reach the executor, or reached another service. A port that is
// not a whole number from 0 to 65535 is refused naming it, before anything
// is bound.
TEST(ExecutorDaemonFailuresTest, ListenPortsOutOfRangeAreRefused) {
  for (const std::string listen : {"127.0.0.1:70000", "127.0.0.1:", "127.0.0.1:-5", "127.0.0.1:abc",
                                   "127.0.0.1:80x", "127.0.0.1:99999999999999999999"}) {
    SCOPED_TRACE(listen);
    auto o = ExecutorDaemonOptions({"--serve", "--planner", "127.0.0.1:1", "--listen", listen});
    ASSERT_THAT(o.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     AllOf(HasSubstr("--listen"), HasSubstr("'" + listen + "'"),
                                           HasSubstr("0 to 65535"))));
    ExecutorServerOptions so;
    so.planner = "127.0.0.1:1";
    so.listen = listen;
    EXPECT_THAT(ExecutorServer::Start(so).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 to 65535")));
  }
  for (const std::string listen : {"127.0.0.1:0", "[::1]:0", "localhost:65535"}) {
    SCOPED_TRACE(listen);
    auto o = ExecutorDaemonOptions({"--serve", "--planner", "127.0.0.1:1", "--listen", listen});
    ASSERT_THAT(o.status(), IsOk());
    EXPECT_EQ(o->listen, listen);
  }
}

// `--planner 127.0.0.1:70000`, `--planner 127.0.0.1:0` or `--planner host`
// (no port) started a daemon that could never reach its planner (the
// rendezvous and the step metrics went to whatever port gRPC made of it),
// found only when a deployment failed at its rendezvous, far from the
// cause. A planner address whose port is not a whole number from 1 to
// 65535 is refused at start, naming it (unix: addresses have no port).
TEST(ExecutorDaemonFailuresTest, PlannerPortsOutOfRangeAreRefused) {
  for (const std::string planner : {"127.0.0.1:70000", "127.0.0.1:", "127.0.0.1:0", "hap-planner",
                                    "dns:///hap-planner", "127.0.0.1:-1", "ipv4:127.0.0.1:7x"}) {
    SCOPED_TRACE(planner);
    auto o = ExecutorDaemonOptions({"--serve", "--planner", planner});
    ASSERT_THAT(o.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     AllOf(HasSubstr("--planner"), HasSubstr("'" + planner + "'"),
                                           HasSubstr("1 to 65535"))));
    ExecutorServerOptions so;
    so.planner = planner;
    EXPECT_THAT(ExecutorServer::Start(so).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 to 65535")));
  }
  for (const std::string planner :
       {"127.0.0.1:7070", "hap-planner:7070", "dns:///hap-planner:7070", "ipv4:127.0.0.1:1",
        "[::1]:65535", "unix:/run/hap/planner.sock"}) {
    SCOPED_TRACE(planner);
    auto o = ExecutorDaemonOptions({"--serve", "--planner", planner});
    ASSERT_THAT(o.status(), IsOk());
    EXPECT_EQ(o->planner, planner);
  }
  // An IPv6 pod's $(POD_IP):7070, unbracketed, is the bracketed address the
  // planner advertises (it was refused as no HOST:PORT).
  auto o = ExecutorDaemonOptions({"--serve", "--planner", "fd00::5:7070"});
  ASSERT_THAT(o.status(), IsOk());
  EXPECT_EQ(o->planner, "[fd00::5]:7070");
}

// `hap-executor --serve | head -1` (a script reading the port) or a log
// pipe whose reader died: the "listening on" line (or any later write to
// stdout) raised SIGPIPE and killed the daemon without a word. It is
// ignored now: the daemon serves, and SIGTERM still ends it with 0. (The
// SIGTERM is queued before the daemon starts, so it shuts down once up.)
TEST_F(ReviewDeathTest, AStdoutWhoseReaderIsGoneDoesNotKillTheDaemon) {
  EXPECT_EXIT(
      {
        int p[2];
        if (pipe(p) != 0) std::_Exit(3);
        close(p[0]);
        dup2(p[1], STDOUT_FILENO);
        if (!hap::tools::InstallStopSignalHandler().ok()) std::_Exit(4);
        raise(SIGTERM);
        std::_Exit(ExecutorDaemonMain({"--serve", "--planner", "127.0.0.1:1", "--listen",
                                       "127.0.0.1:0", "--drain-seconds", "0"}));
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace hap::executor
