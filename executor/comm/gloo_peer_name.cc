// Keeps a reset connection from ending the process inside Gloo.
//
// Gloo's TCP transport (Debian's 2022-05 snapshot, libgloo0) asks for a new
// connection's peer address on its event-loop thread, once a listening
// pair accepted it or a connecting pair saw it complete
// (Pair::handleConnected -> Address::fromPeerName), and checks that
// getpeername succeeded. A connection the other end reset in between (a
// stray client that hung up with a reset, a rank stopped or killed while
// the ranks met) has no peer any more: getpeername fails with ENOTCONN, the
// check throws on the loop thread, nothing catches it there, and
// std::terminate ends the whole process: a training rank, or the executor
// daemon that hosts ranks. Gloo itself later added a peer-name lookup that
// tolerates this (Socket::safePeerName, after the snapshot we build with).
//
// We define getpeername in our binaries, which the dynamic linker then
// binds Gloo's call to. It calls the C library's, and only where that
// failed with ENOTCONN and the caller is Gloo's Address::fromPeerName does
// it answer with an empty address (AF_UNSPEC; Gloo prints it "[none]")
// instead. The pair then counts as connected, its first read finds the
// reset, and Gloo reports that as an I/O error on the pair, the way every
// other lost connection is reported: the connect try fails, or the next
// one succeeds. Every other caller, and every other outcome, gets exactly
// what the C library says. gloo_connect_test
// AStrayConnectionResetBeforeItIsAcceptedEndsNoProcess resets a
// connection before Gloo accepts it, every time.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "executor/comm/gloo_peer_name.h"

#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>

namespace hap::executor {
namespace {

using GetPeerNameFn = int (*)(int, sockaddr*, socklen_t*);

GetPeerNameFn LibcGetPeerName() {
  static const GetPeerNameFn fn = reinterpret_cast<GetPeerNameFn>(dlsym(RTLD_NEXT, "getpeername"));
  return fn;
}

// The mangled name of gloo::transport::tcp::Address::fromPeerName(int).
constexpr char kGlooFromPeerName[] = "_ZN4gloo9transport3tcp7Address12fromPeerNameEi";

std::atomic<int64_t> reset_peer_lookups{0};

void CountGlooResetPeerLookup() { reset_peer_lookups.fetch_add(1); }

}  // namespace

int64_t GlooResetPeerLookups() { return reset_peer_lookups.load(); }

bool IsGlooPeerNameLookup(const void* return_address) {
  Dl_info info{};
  if (return_address == nullptr || dladdr(return_address, &info) == 0) return false;
  return info.dli_sname != nullptr && std::strcmp(info.dli_sname, kGlooFromPeerName) == 0;
}

}  // namespace hap::executor

extern "C" int getpeername(int fd, sockaddr* addr, socklen_t* len) {
  const hap::executor::GetPeerNameFn libc = hap::executor::LibcGetPeerName();
  if (libc == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const int rv = libc(fd, addr, len);
  if (rv == 0 || errno != ENOTCONN || addr == nullptr || len == nullptr) return rv;
  const int saved = errno;
  if (!hap::executor::IsGlooPeerNameLookup(__builtin_return_address(0))) {
    errno = saved;
    return rv;
  }
  hap::executor::CountGlooResetPeerLookup();
  std::memset(addr, 0, *len);
  if (*len >= sizeof(sa_family_t)) addr->sa_family = AF_UNSPEC;
  return 0;
}
