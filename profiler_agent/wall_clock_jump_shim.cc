// Test-only LD_PRELOAD library: makes the wall clock of the process it is
// loaded into jump. Each SIGUSR1 moves CLOCK_REALTIME (as clock_gettime
// reads it) forward by the seconds in HAP_TEST_CLOCK_JUMP_SECONDS (negative:
// back); other clocks are left alone. A process preloaded with it sees what
// an NTP step or an operator's `date -s` does to a daemon, without changing
// the machine's clock.
#include <dlfcn.h>
#include <signal.h>
#include <time.h>

#include <atomic>
#include <cstdlib>

namespace {

std::atomic<long> g_offset_seconds{0};
long g_jump_seconds = 0;

void OnJump(int) { g_offset_seconds += g_jump_seconds; }

__attribute__((constructor)) void InstallJumpHandler() {
  if (const char* s = std::getenv("HAP_TEST_CLOCK_JUMP_SECONDS")) g_jump_seconds = std::atol(s);
  struct sigaction sa = {};
  sa.sa_handler = OnJump;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, nullptr);
}

}  // namespace

extern "C" int clock_gettime(clockid_t clock, struct timespec* ts) {
  using ClockGettime = int (*)(clockid_t, struct timespec*);
  static const auto real = reinterpret_cast<ClockGettime>(dlsym(RTLD_NEXT, "clock_gettime"));
  const int r = real(clock, ts);
  if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
    ts->tv_sec += g_offset_seconds.load();
  }
  return r;
}
