// Noticing a dead peer while Gloo's event-loop thread starves.
//
// We run Gloo's loop thread at SCHED_IDLE (gloo_communicator.cc,
// CreateTcpDevice, says why). On a core that other work keeps busy it
// barely runs, and it is the only thread that reads the connections: a
// peer's death then went unnoticed for seconds (2 to 30 s with six busy
// loops on two cores; once, in CI, past a 60 s timeout, so the rank said
// "timed out" and not "lost peer"). Raising the thread for every long wait
// fixed that but gave back the spin SCHED_IDLE tames, so DeadPeerWatch
// raises it only once a connection has hung up: during a wait that lasts
// over kGrace it looks at the connections' sockets (poll, which reads
// nothing) every kGrace, and on a hang-up or error lifts the loop thread to
// the normal policy until the wait ends, so Gloo reads the failure and
// wakes the rank. A collective that crawls because its loop thread starves
// is not helped (communicator.h, idle_progress_thread).
#ifndef HAP_EXECUTOR_COMM_DEAD_PEER_WATCH_H_
#define HAP_EXECUTOR_COMM_DEAD_PEER_WATCH_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hap::executor {

// The ids of this process's threads (/proc/self/task).
std::set<pid_t> ThreadIds();

// A thread of this process's name (/proc/self/task/TID/comm), or "" where
// it cannot be read; and its renaming (at most 15 characters).
std::string ThreadName(pid_t tid);
bool SetThreadName(pid_t tid, const std::string& name);

// The descriptors of this process's connected TCP sockets that are one
// end of a connection to a peer: those accepted on `listening` (this
// rank's listening address) and those connected to one of `peers` (the
// peers' listening addresses). Addresses compare by family, address and
// port.
std::vector<int> PeerSockets(const sockaddr_storage& listening,
                             const std::vector<sockaddr_storage>& peers);

// Sets thread `tid`'s scheduling policy (priority 0); false where not
// allowed (leaving SCHED_IDLE needs RLIMIT_NICE or CAP_SYS_NICE).
bool SetThreadPolicy(pid_t tid, int policy);

// The first of `fds` the other end hung up or that has an error pending,
// or -1.
int HungUpSocket(const std::vector<int>& fds);

class DeadPeerWatch {
 public:
  static constexpr absl::Duration kGrace = absl::Milliseconds(50);

  // `loop_tid`: Gloo's loop thread, at SCHED_IDLE; `fds`: its connections'
  // sockets (PeerSockets). With no thread or no socket it does nothing.
  DeadPeerWatch(pid_t loop_tid, std::vector<int> fds);
  ~DeadPeerWatch();
  DeadPeerWatch(const DeadPeerWatch&) = delete;
  DeadPeerWatch& operator=(const DeadPeerWatch&) = delete;

  // Around each wait for the peers (one at a time).
  void Begin();
  void End();

  // The communicator failed and takes no more work: the loop thread is
  // raised for good. A process ends only once each of its threads has run,
  // and one whose peer died ended seconds late while its loop thread
  // starved (six busy loops on two cores: 5 to 16 s).
  void Failed();

  // Times the loop thread was raised for a hang-up (tests).
  int raised() const;

 private:
  void Watch();
  bool SetPolicy(int policy);

  const pid_t tid_;
  const std::vector<int> fds_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Begin()s not yet ended (a wait may run inside another's).
  int depth_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t wait_ ABSL_GUARDED_BY(mu_) = 0;
  int raised_ ABSL_GUARDED_BY(mu_) = 0;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watcher_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_DEAD_PEER_WATCH_H_
