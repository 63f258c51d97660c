#include "executor/comm/dead_peer_watch.h"

#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>

#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace hap::executor {
namespace {

bool SameAddress(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr)) == 0;
  }
  return false;
}

// The numbers listed in a /proc directory (threads, descriptors).
std::vector<int> Numbers(const char* dir) {
  std::vector<int> out;
  DIR* d = opendir(dir);
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    int n = 0;
    if (absl::SimpleAtoi(e->d_name, &n)) out.push_back(n);
  }
  closedir(d);
  return out;
}

}  // namespace

std::set<pid_t> ThreadIds() {
  std::vector<int> ids = Numbers("/proc/self/task");
  return std::set<pid_t>(ids.begin(), ids.end());
}

std::string ThreadName(pid_t tid) {
  std::ifstream in(absl::StrCat("/proc/self/task/", tid, "/comm"));
  std::string name;
  std::getline(in, name);
  return in ? name : "";
}

bool SetThreadName(pid_t tid, const std::string& name) {
  std::ofstream out(absl::StrCat("/proc/self/task/", tid, "/comm"));
  out << name;
  out.flush();
  return static_cast<bool>(out);
}

std::vector<int> PeerSockets(const sockaddr_storage& listening,
                             const std::vector<sockaddr_storage>& peers) {
  std::vector<int> out;
  // (The directory's own descriptor is listed too; it is no socket.)
  for (int fd : Numbers("/proc/self/fd")) {
    sockaddr_storage local{}, remote{};
    socklen_t local_len = sizeof(local), remote_len = sizeof(remote);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0) continue;
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) continue;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_len) != 0) continue;
    bool ours = SameAddress(local, listening);
    for (const sockaddr_storage& p : peers) ours = ours || SameAddress(remote, p);
    if (ours) out.push_back(fd);
  }
  return out;
}

int HungUpSocket(const std::vector<int>& fds) {
  std::vector<pollfd> p(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) p[i] = pollfd{fds[i], POLLRDHUP, 0};
  if (poll(p.data(), p.size(), 0) <= 0) return -1;
  for (const pollfd& q : p) {
    if (q.revents & (POLLRDHUP | POLLHUP | POLLERR)) return q.fd;
  }
  return -1;
}

DeadPeerWatch::DeadPeerWatch(pid_t loop_tid, std::vector<int> fds)
    : tid_(loop_tid), fds_(std::move(fds)) {
  if (tid_ > 0 && !fds_.empty()) watcher_ = std::thread([this] { Watch(); });
}

DeadPeerWatch::~DeadPeerWatch() {
  if (watcher_.joinable()) {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    watcher_.join();
  }
  // The communicator is going, and its device with the loop thread, which
  // the device's destructor joins: at SCHED_IDLE on a busy core that takes
  // seconds.
  if (tid_ > 0) (void)SetPolicy(SCHED_OTHER);
}

void DeadPeerWatch::Failed() {
  if (tid_ <= 0) return;
  absl::MutexLock l(&mu_);
  if (failed_) return;
  failed_ = true;
  (void)SetPolicy(SCHED_OTHER);
}

void DeadPeerWatch::Begin() {
  if (!watcher_.joinable()) return;
  absl::MutexLock l(&mu_);
  if (depth_++ == 0) ++wait_;
}

void DeadPeerWatch::End() {
  if (!watcher_.joinable()) return;
  absl::MutexLock l(&mu_);
  --depth_;
}

int DeadPeerWatch::raised() const {
  absl::MutexLock l(&mu_);
  return raised_;
}

void DeadPeerWatch::Watch() {
  absl::MutexLock l(&mu_);
  bool allowed = true;
  while (true) {
    auto started = [this] { return stop_ || depth_ > 0; };
    mu_.Await(absl::Condition(&started));
    if (stop_) return;
    const uint64_t wait = wait_;
    auto over = [this, wait] { return stop_ || depth_ == 0 || wait_ != wait; };
    // Every kGrace of the wait, until a hang-up raises the thread; then
    // (or where the thread cannot be raised) only the wait's end.
    bool raised = false;
    bool ended = false;
    while (allowed && !raised &&
           !(ended = mu_.AwaitWithDeadline(absl::Condition(&over), absl::Now() + kGrace))) {
      if (HungUpSocket(fds_) < 0) continue;
      if (SetPolicy(SCHED_OTHER)) {
        raised = true;
        ++raised_;
      } else {
        allowed = false;  // EPERM: not this process's to change
      }
    }
    if (!ended) mu_.Await(absl::Condition(&over));
    if (raised && !failed_) (void)SetPolicy(SCHED_IDLE);
  }
}

bool DeadPeerWatch::SetPolicy(int policy) { return SetThreadPolicy(tid_, policy); }

bool SetThreadPolicy(pid_t tid, int policy) {
  sched_param param{};
  return sched_setscheduler(tid, policy, &param) == 0;
}

}  // namespace hap::executor
