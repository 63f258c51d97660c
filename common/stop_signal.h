// SIGTERM/SIGINT for the daemons, through a self-pipe: the handler only
// writes a byte, and a thread waits for it. Blocking the signals and
// sigwait()ing is not enough here: OpenBLAS starts its own threads with
// signals unblocked, and a signal delivered to one of them would kill the
// process.
#ifndef HAP_COMMON_STOP_SIGNAL_H_
#define HAP_COMMON_STOP_SIGNAL_H_

#include "absl/status/status.h"

namespace hap::tools {

// Installs the handler for SIGTERM and SIGINT. Call once, early in main.
absl::Status InstallStopSignalHandler();

// Blocks until SIGTERM or SIGINT arrives; returns the signal number.
int WaitForStopSignal();

// True once SIGTERM or SIGINT has arrived (WaitForStopSignal still returns
// it): for work a daemon does before it waits, such as the agent's first
// probe, to end early instead of delaying the shutdown by all of it.
bool StopSignalReceived();

}  // namespace hap::tools

#endif  // HAP_COMMON_STOP_SIGNAL_H_
