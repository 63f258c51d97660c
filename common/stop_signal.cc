#include "common/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace hap::tools {
namespace {

int g_pipe[2] = {-1, -1};
volatile sig_atomic_t g_received = 0;

void OnStopSignal(int sig) {
  g_received = 1;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = write(g_pipe[1], &b, 1);
  (void)ignored;
}

}  // namespace

absl::Status InstallStopSignalHandler() {
  if (g_pipe[0] < 0 && pipe(g_pipe) != 0) {
    return absl::InternalError("cannot create the signal pipe");
  }
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  return absl::OkStatus();
}

int WaitForStopSignal() {
  unsigned char b = 0;
  while (read(g_pipe[0], &b, 1) < 0 && errno == EINTR) {
  }
  return b;
}

bool StopSignalReceived() { return g_received != 0; }

}  // namespace hap::tools
