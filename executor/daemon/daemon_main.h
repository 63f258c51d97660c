// `hap-executor --serve`: the executor daemon's flags around ExecutorServer.
#ifndef HAP_EXECUTOR_DAEMON_DAEMON_MAIN_H_
#define HAP_EXECUTOR_DAEMON_DAEMON_MAIN_H_

#include <string>
#include <vector>

namespace hap::executor {

// argv without the program name. Returns the exit status: 0 after a clean
// SIGTERM/SIGINT shutdown, 1 on a startup error, 2 on bad flags.
int ExecutorDaemonMain(const std::vector<std::string>& argv);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_DAEMON_MAIN_H_
