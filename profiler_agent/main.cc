// hap-agent: the per-node profiler agent (docs/design.md §9). Flags in
// agent_flags.cc (--help); the daemon in agent.h. Prints "listening on
// HOST:PORT" once serving; SIGTERM or SIGINT shuts it down gracefully.
#include <signal.h>

#include <iostream>

#include "common/stop_signal.h"
#include "profiler_agent/agent.h"
#include "profiler_agent/agent_flags.h"

int main(int argc, char** argv) {
  if (absl::Status s = hap::tools::InstallStopSignalHandler(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  }
  // A stdout whose reader is gone (`| head -1`) must not kill the agent
  // (at its "shutting down" line, before the graceful shutdown).
  signal(SIGPIPE, SIG_IGN);

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
  // SIGTERM during the first probe (inside Start) ends the probe; the
  // shutdown below follows at once.
  options->stop_requested = hap::tools::StopSignalReceived;
  auto agent = hap::agent::Agent::Start(*std::move(options));
  if (!agent.ok()) {
    std::cerr << "error: " << agent.status().message() << "\n";
    return 1;
  }
  std::cout << "listening on " << (*agent)->listen_address() << "\n" << std::flush;
  int sig = hap::tools::WaitForStopSignal();
  std::cout << "shutting down (signal " << sig << ")\n" << std::flush;
  (*agent)->Shutdown(absl::Seconds(5));
  return 0;
}
