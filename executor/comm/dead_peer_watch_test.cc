#include "executor/comm/dead_peer_watch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::testing::Contains;
using ::testing::Not;

// A listening socket on 127.0.0.1, a client connected to it and the
// accepted end.
struct Connection {
  int listener = -1, client = -1, accepted = -1;
  sockaddr_storage address{};
  ~Connection() {
    for (int fd : {listener, client, accepted}) {
      if (fd >= 0) close(fd);
    }
  }
};

void Connect(Connection& c) {
  c.listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(c.listener, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(c.listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(c.listener, 1), 0);
  socklen_t len = sizeof(c.address);
  ASSERT_EQ(getsockname(c.listener, reinterpret_cast<sockaddr*>(&c.address), &len), 0);
  c.client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(c.client, 0);
  ASSERT_EQ(connect(c.client, reinterpret_cast<sockaddr*>(&c.address), len), 0);
  c.accepted = accept(c.listener, nullptr, nullptr);
  ASSERT_GE(c.accepted, 0);
}

TEST(PeerSocketsTest, FindsBothEndsOfAConnectionByTheListeningAddress) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(c));
  sockaddr_storage elsewhere = c.address;
  reinterpret_cast<sockaddr_in&>(elsewhere).sin_port = 0;
  // Accepted on "our" listening address: the accepted end.
  std::vector<int> mine = PeerSockets(c.address, {});
  EXPECT_THAT(mine, Contains(c.accepted));
  EXPECT_THAT(mine, Not(Contains(c.client)));
  EXPECT_THAT(mine, Not(Contains(c.listener)));
  // Connected to a peer's listening address: the client end.
  std::vector<int> theirs = PeerSockets(elsewhere, {c.address});
  EXPECT_THAT(theirs, Contains(c.client));
  EXPECT_THAT(theirs, Not(Contains(c.accepted)));
  EXPECT_THAT(theirs, Not(Contains(c.listener)));
}

TEST(HungUpSocketTest, IsTheSocketWhosePeerClosed) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(c));
  EXPECT_EQ(HungUpSocket({c.client, c.accepted}), -1);
  // Unread bytes do not count.
  ASSERT_EQ(write(c.client, "x", 1), 1);
  EXPECT_EQ(HungUpSocket({c.client, c.accepted}), -1);
  close(c.client);
  c.client = -1;
  EXPECT_EQ(HungUpSocket({c.accepted}), c.accepted);
}

// Stands in for Gloo's loop thread (gloo_connect_test has the real one): a
// thread at SCHED_IDLE that sleeps until told to end.
class IdleThread {
 public:
  IdleThread() {
    thread_ = std::thread([this] {
      sched_param param{};
      idle_ = pthread_setschedparam(pthread_self(), SCHED_IDLE, &param) == 0;
      tid_ = static_cast<pid_t>(syscall(SYS_gettid));
      started_.Notify();
      done_.WaitForNotification();
    });
    started_.WaitForNotification();
  }
  ~IdleThread() {
    done_.Notify();
    thread_.join();
  }
  pid_t tid() const { return tid_; }
  bool idle() const { return idle_; }

 private:
  absl::Notification started_, done_;
  pid_t tid_ = 0;
  bool idle_ = false;
  std::thread thread_;
};

// Why `t` cannot be moved between SCHED_IDLE and the normal policy here,
// or null.
const char* CannotRaise(const IdleThread& t) {
  if (!t.idle()) return "SCHED_IDLE cannot be set here";
  sched_param param{};
  if (sched_setscheduler(t.tid(), SCHED_OTHER, &param) != 0 ||
      sched_setscheduler(t.tid(), SCHED_IDLE, &param) != 0) {
    return "leaving SCHED_IDLE is not allowed here (RLIMIT_NICE, CAP_SYS_NICE)";
  }
  return nullptr;
}

// Waits (up to a minute) for `policy`; the policy it has at the end.
int AwaitPolicy(pid_t tid, int policy) {
  const absl::Time end = absl::Now() + absl::Minutes(1);
  while (sched_getscheduler(tid) != policy && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  return sched_getscheduler(tid);
}

TEST(ThreadNameTest, ReadsAndRenamesAThread) {
  IdleThread t;
  EXPECT_TRUE(SetThreadName(t.tid(), "hap-test-name"));
  EXPECT_EQ(ThreadName(t.tid()), "hap-test-name");
  EXPECT_EQ(ThreadName(-1), "");
}

TEST(DeadPeerWatchTest, RaisesTheLoopThreadWhileAWaitOutlastsAHangUp) {
  IdleThread loop;
  if (const char* why = CannotRaise(loop)) GTEST_SKIP() << why;
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(c));
  DeadPeerWatch watch(loop.tid(), {c.accepted});

  // A long wait over healthy connections leaves the thread alone.
  watch.Begin();
  absl::SleepFor(DeadPeerWatch::kGrace * 4);
  EXPECT_EQ(watch.raised(), 0);
  EXPECT_EQ(sched_getscheduler(loop.tid()), SCHED_IDLE);
  watch.End();

  // The peer hangs up during a wait: raised, and lowered at the wait's end.
  watch.Begin();
  close(c.client);
  c.client = -1;
  EXPECT_EQ(AwaitPolicy(loop.tid(), SCHED_OTHER), SCHED_OTHER);
  EXPECT_EQ(watch.raised(), 1);
  watch.End();
  EXPECT_EQ(AwaitPolicy(loop.tid(), SCHED_IDLE), SCHED_IDLE);
}

// A failed communicator takes no more work; its loop thread stays raised,
// so that the process (or the device's destructor) need not wait for it
// to get a turn on a busy core.
TEST(DeadPeerWatchTest, AFailureRaisesTheLoopThreadForGood) {
  IdleThread loop;
  if (const char* why = CannotRaise(loop)) GTEST_SKIP() << why;
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(c));
  DeadPeerWatch watch(loop.tid(), {c.accepted});
  watch.Failed();
  EXPECT_EQ(sched_getscheduler(loop.tid()), SCHED_OTHER);
  // A hang-up seen during a later wait does not lower it at the wait's end.
  watch.Begin();
  close(c.client);
  c.client = -1;
  const absl::Time end = absl::Now() + absl::Minutes(1);
  while (watch.raised() == 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(watch.raised(), 1);
  watch.End();
  absl::SleepFor(DeadPeerWatch::kGrace * 2);
  EXPECT_EQ(sched_getscheduler(loop.tid()), SCHED_OTHER);
}

TEST(DeadPeerWatchTest, WithoutALoopThreadOrSocketsItDoesNothing) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(c));
  close(c.client);
  c.client = -1;
  DeadPeerWatch none(0, {c.accepted});
  none.Begin();
  absl::SleepFor(DeadPeerWatch::kGrace * 3);
  none.End();
  EXPECT_EQ(none.raised(), 0);
}

}  // namespace
}  // namespace hap::executor
