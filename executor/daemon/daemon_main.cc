#include "executor/daemon/daemon_main.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cli_args.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "common/stop_signal.h"
#include "executor/daemon/executor_server.h"
#include "executor/train/backend.h"

namespace hap::executor {
namespace {

constexpr char kUsage[] =
    R"(usage: hap-executor --serve --planner HOST:PORT [--listen HOST:PORT]
                    [--token-file F] [--tls-cert-file F --tls-key-file F]
                    [--tls-ca-file F] [--device-id ID] [--data-dir DIR]
                    [--threads T] [--timeout SECONDS] [--drain-seconds S]
                    [--device cpu|cuda[:N]] [--gloo-host HOST] [--max-streams N]

Serves hap.v1.Executor: one rank of a deployment pushed by the planner at
--planner, the only planner whose plans it accepts. Ranks meet through the
planner's rendezvous store and train over Gloo (NCCL on GPUs); each step's loss and time go
to the planner. Every flag may instead come from the environment as
HAP_<FLAG> (--planner: HAP_PLANNER, --token-file: HAP_TOKEN_FILE, ...).

  --listen        gRPC address (default 127.0.0.1:0, a free port); prints
                  "listening on HOST:PORT" once serving
  --token-file    bearer token required on every call, and sent to the planner
  --tls-cert-file/--tls-key-file  serve TLS; --tls-ca-file verifies the planner
  --device-id     the device of this node it serves (default node0/cpu0)
  --device        the backend: cpu (Gloo) or cuda[:N], GPU N (NCCL; builds
                  made with --config=cuda); default the plan's device for the
                  rank when the plan says it is a GPU, else cpu
  --data-dir      WikiText-2 root when a deployment names no data_path
                  (default ../shared/data)
  --threads       kernel threads per rank unless the deployment says (1;
                  1 to 4096)
  --timeout       connect and collective timeout in seconds (60; 0.001 to
                  86400)
  --drain-seconds on SIGTERM, training is cancelled, then NOT_SERVING this
                  long, GetStatus still answering how it ended, before the
                  server stops (1; 0 to 3600)
  --gloo-host     the address Gloo listens on and peers dial (127.0.0.1; a
                  node's address on the network testbed, hap-netns)
  --max-streams   StreamStepMetrics calls served at once (64; 1 to 65536);
                  more are refused RESOURCE_EXHAUSTED, control calls still
                  answer
)";

absl::StatusOr<ExecutorServerOptions> Options(const tools::Args& a) {
  ExecutorServerOptions o;
  o.planner = service::BracketIpv6Host(a.GetOrEnv("planner"));  // fd00::5:7070 as on IPv6 pods
  if (!o.planner.empty()) {
    if (absl::Status s = CheckPlannerAddress(o.planner); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--planner (HAP_PLANNER): ", s.message()));
    }
  }
  o.listen = a.GetOrEnv("listen", "127.0.0.1:0");
  if (absl::Status s = CheckListenAddress(o.listen); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--listen (HAP_LISTEN): ", s.message()));
  }
  HAP_ASSIGN_OR_RETURN(o.security.token, service::ReadTokenFile(a.GetOrEnv("token-file")));
  o.security.tls_cert_file = a.GetOrEnv("tls-cert-file");
  o.security.tls_key_file = a.GetOrEnv("tls-key-file");
  o.security.tls_ca_file = a.GetOrEnv("tls-ca-file");
  o.core.device_id = a.GetOrEnv("device-id", "node0/cpu0");
  o.core.device = a.GetOrEnv("device");
  if (!o.core.device.empty()) {
    HAP_ASSIGN_OR_RETURN(DeviceSpec spec, ParseDeviceSpec(o.core.device));
    if (spec.kind == DeviceSpec::Kind::kCuda && !CudaBuilt()) {
      return absl::FailedPreconditionError(
          "--device cuda: this build has no CUDA support; rebuild with --config=cuda");
    }
  }
  o.core.data_dir = a.GetOrEnv("data-dir", "../shared/data");
  o.core.gloo_hostname = a.GetOrEnv("gloo-host", o.core.gloo_hostname);
  // Seconds flags are bounded (Args::NumberOrEnv): --drain-seconds nan or
  // 1e300 was an infinite drain (SIGTERM never stopped the daemon), --timeout
  // inf an infinite Gloo timeout and one under a millisecond 0 ms.
  HAP_ASSIGN_OR_RETURN(double threads, a.NumberOrEnv("threads", 1, 1, 4096, /*whole=*/true));
  HAP_ASSIGN_OR_RETURN(double timeout, a.NumberOrEnv("timeout", 60, 0.001, 86400));
  HAP_ASSIGN_OR_RETURN(double drain, a.NumberOrEnv("drain-seconds", 1, 0, 3600));
  HAP_ASSIGN_OR_RETURN(double streams,
                       a.NumberOrEnv("max-streams", o.max_streams, 1,
                                     ExecutorServer::kMaxStreamsLimit, /*whole=*/true));
  o.max_streams = static_cast<int>(streams);
  o.core.threads = static_cast<int>(threads);
  o.core.comm_timeout = absl::Seconds(timeout);
  o.drain = absl::Seconds(drain);
  return o;
}

absl::StatusOr<tools::Args> ParseArgs(const std::vector<std::string>& argv) {
  return tools::Args::Parse(argv,
                            {"planner", "listen", "token-file", "tls-cert-file", "tls-key-file",
                             "tls-ca-file", "device-id", "device", "data-dir", "threads", "timeout",
                             "drain-seconds", "gloo-host", "max-streams"},
                            {"serve", "help"});
}

}  // namespace

absl::StatusOr<ExecutorServerOptions> ExecutorDaemonOptions(const std::vector<std::string>& argv) {
  HAP_ASSIGN_OR_RETURN(tools::Args a, ParseArgs(argv));
  return Options(a);
}

int ExecutorDaemonMain(const std::vector<std::string>& argv) {
  auto a = ParseArgs(argv);
  if (!a.ok() || a->Bool("help")) {
    if (!a.ok()) std::cerr << "error: " << a.status().message() << "\n";
    std::cerr << kUsage;
    return a.ok() ? 0 : 2;
  }
  auto options = Options(*a);
  if (!options.ok()) {
    std::cerr << "error: " << options.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = hap::tools::InstallStopSignalHandler(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  }
  // A stdout (or stderr) whose reader is gone (`| head -1`, a dead log
  // pipe) must not kill a daemon that is training: its writes fail instead.
  signal(SIGPIPE, SIG_IGN);

  // One line at a time (a single write), whichever thread logs.
  options->core.log = [](const std::string& line) {
    std::cerr << absl::StrCat("hap-executor: ", line, "\n") << std::flush;
  };
  auto server = ExecutorServer::Start(*std::move(options));
  if (!server.ok()) {
    std::cerr << "error: " << server.status().message() << "\n";
    return 1;
  }
  std::cout << "listening on " << (*server)->address() << std::endl;
  if (!std::cout) {
    std::cerr << "hap-executor: listening on " << (*server)->address()
              << " (the line could not be written to stdout)\n";
  }
  std::thread waiter([&] {
    int sig = hap::tools::WaitForStopSignal();
    std::cerr << "hap-executor: signal " << static_cast<int>(sig)
              << ", NOT_SERVING, stopping training, then shutting down\n";
    (*server)->Shutdown();
  });
  (*server)->Wait();
  waiter.join();
  if (const int stuck = (*server)->core().RetiredThreads(); stuck > 0) {
    // Abandoned in a collective (a peer gone), they would end only at the
    // communicator timeout; they save nothing and their status was served.
    std::cerr << "hap-executor: exiting without waiting for " << stuck
              << " training thread(s) stuck in a collective\n";
    std::cout.flush();
    std::_Exit(0);
  }
  return 0;
}

}  // namespace hap::executor
