// Test harness for the daemons: start a binary with its stdout on a pipe,
// wait for a line, stop it by pid; free loopback ports; plain HTTP GET.
// Everything stays on 127.0.0.1.
#ifndef HAP_TESTS_SERVICE_HARNESS_H_
#define HAP_TESTS_SERVICE_HARNESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hap::testing {

// A path to a binary built into the test's runfiles, e.g.
// "planner/service/hap-planner".
std::string Runfile(const std::string& path);

class Process {
 public:
  Process() = default;
  ~Process();  // SIGKILLs a process still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Starts argv[0] with its stdout (and stderr, into `log` only) captured.
  absl::Status Start(const std::vector<std::string>& argv,
                     const std::vector<std::string>& env = {});
  // Reads stdout lines until one starts with `prefix`; returns the rest of
  // that line. DeadlineExceeded (with what was read) after `timeout`.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix,
                                          absl::Duration timeout = absl::Seconds(60));
  // Sends `sig` and waits up to `timeout` for the exit; SIGKILL after.
  // Returns the exit status as waitpid gives it.
  int Stop(int sig, absl::Duration timeout = absl::Seconds(30));
  bool Running();
  pid_t pid() const { return pid_; }
  const std::string& output() const { return out_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string out_;     // everything read so far
  std::string buffer_;  // unconsumed part
};

// A loopback port free at the time of the call.
int FreePort();

// A TCP connection to 127.0.0.1:port whose reads time out after `timeout`;
// the socket, or -1 when it cannot connect. The caller closes it.
int ConnectLoopback(int port, absl::Duration timeout = absl::Seconds(10));

// GET http://127.0.0.1:port/path; returns the body of a 200 response.
// `bearer`: sent as "Authorization: Bearer ..." when not empty.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(10),
                                    const std::string& bearer = "");

std::string TempDir(const std::string& name);

}  // namespace hap::testing

#endif  // HAP_TESTS_SERVICE_HARNESS_H_
