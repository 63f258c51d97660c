// hap-agent: the per-node profiler agent (DESIGN.md §9). Flags in
// agent_flags.cc (--help); the daemon in agent.h. Prints "listening on
// HOST:PORT" once serving; SIGTERM or SIGINT shuts it down gracefully.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <iostream>

#include "profiler_agent/agent.h"
#include "profiler_agent/agent_flags.h"

namespace {

// The stop signals arrive on any thread (OpenBLAS starts its own before
// main), so the handler only writes the signal number to a pipe that main
// waits on.
int g_stop_pipe[2] = {-1, -1};

void OnStopSignal(int sig) {
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = write(g_stop_pipe[1], &b, 1);
  (void)ignored;
}

// Blocks until SIGTERM or SIGINT; returns the signal.
int WaitForStopSignal() {
  unsigned char b = 0;
  while (read(g_stop_pipe[0], &b, 1) < 0 && errno == EINTR) {
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (pipe(g_stop_pipe) != 0) {
    std::cerr << "error: cannot create the signal pipe\n";
    return 1;
  }
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  auto args = hap::tools::Args::Parse(std::vector<std::string>(argv + 1, argv + argc),
                                      hap::agent::AgentValueFlags(), {"help"});
  if (!args.ok()) {
    std::cerr << "error: " << args.status().message() << "\n" << hap::agent::kAgentUsage;
    return 2;
  }
  if (args->Bool("help")) {
    std::cout << hap::agent::kAgentUsage;
    return 0;
  }
  auto options = hap::agent::AgentOptionsFromArgs(*args);
  if (!options.ok()) {
    std::cerr << "error: " << options.status().message() << "\n";
    return 2;
  }
  auto agent = hap::agent::Agent::Start(*std::move(options));
  if (!agent.ok()) {
    std::cerr << "error: " << agent.status().message() << "\n";
    return 1;
  }
  std::cout << "listening on " << (*agent)->listen_address() << "\n" << std::flush;
  int sig = WaitForStopSignal();
  std::cout << "shutting down (signal " << sig << ")\n" << std::flush;
  (*agent)->Shutdown(absl::Seconds(5));
  return 0;
}
