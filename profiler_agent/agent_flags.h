// hap-agent's flags, each also read from the environment as HAP_<FLAG>
// (common/cli_args.h: the flag wins, then the variable, then the default).
#ifndef HAP_PROFILER_AGENT_AGENT_FLAGS_H_
#define HAP_PROFILER_AGENT_AGENT_FLAGS_H_

#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "common/cli_args.h"
#include "profiler_agent/agent.h"

namespace hap::agent {

// Flags that take a value, for Args::Parse.
const std::set<std::string>& AgentValueFlags();

// The usage text of --help.
extern const char kAgentUsage[];

// The options the flags (or their variables) ask for. InvalidArgument
// naming the flag for a missing --planner or a malformed number, or naming
// an argument that is no flag's value; the token file's error when it
// cannot be read.
absl::StatusOr<AgentOptions> AgentOptionsFromArgs(const hap::tools::Args& args);

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_AGENT_FLAGS_H_
