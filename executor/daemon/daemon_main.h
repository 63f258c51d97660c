// `hap-executor --serve`: the executor daemon's flags around ExecutorServer.
#ifndef HAP_EXECUTOR_DAEMON_DAEMON_MAIN_H_
#define HAP_EXECUTOR_DAEMON_DAEMON_MAIN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/daemon/executor_server.h"

namespace hap::executor {

// The daemon's options from its flags (argv without the program name), else
// their HAP_* environment variables: InvalidArgument naming the flag and its
// value for a bad one.
absl::StatusOr<ExecutorServerOptions> ExecutorDaemonOptions(const std::vector<std::string>& argv);

// argv without the program name. Returns the exit status: 0 after a clean
// SIGTERM/SIGINT shutdown, 1 on a startup error, 2 on bad flags.
int ExecutorDaemonMain(const std::vector<std::string>& argv);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_DAEMON_MAIN_H_
