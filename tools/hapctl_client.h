// hapctl's commands against a running planner (kubectl conventions):
// get, describe, create, watch, cancel, delete, deploy, stop.
#ifndef HAP_TOOLS_HAPCTL_CLIENT_H_
#define HAP_TOOLS_HAPCTL_CLIENT_H_

#include <string>
#include <vector>

namespace hap::tools {

// `verb` is the command ("get", ...); argv its arguments. Exit code.
int RunClient(const std::string& verb, const std::vector<std::string>& argv);

}  // namespace hap::tools

#endif  // HAP_TOOLS_HAPCTL_CLIENT_H_
