// hap-planner: the planner daemon (docs/design.md §9). Flags (each also read
// from HAP_<FLAG> in the environment, the flag winning):
//   --listen HOST:PORT        gRPC (default 127.0.0.1:7070; port 0 = any free)
//   --advertise HOST:PORT     address executors reach the planner at
//   --metrics-listen HOST:PORT  Prometheus /metrics (default 127.0.0.1:9464; "off")
//   --database FILE           SQLite state (default hap-planner.db; "" = memory)
//   --token-file FILE         bearer token every call must carry
//   --tls-cert-file FILE --tls-key-file FILE
//   --heartbeat-seconds S     agents' heartbeat interval (default 5; 0.01 to 3600)
//   --missed-heartbeats N     heartbeats missed in a row before a node is STALE
//                             (default 3; 1 to 1000)
//   --workers N               plans synthesized at once (default 1; 1 to 1024)
//   --max-seconds S           a plan request's default time budget (default 60)
//   --max-request-bytes N     larger requests get RESOURCE_EXHAUSTED (default
//                             16 MiB; a 48-layer GPT graph is 176 KB)
//   --max-threads N           threads for calls that block (planning, deploys,
//                             watches, rendezvous waits; default 256); beyond
//                             them such calls get RESOURCE_EXHAUSTED. Reads
//                             (Get/List) take no thread of their own.
//   --max-concurrent-streams N  calls one client connection may have open at
//                             once (default 64; 0 = no limit); more wait in
//                             the client, in order. Long waits (rendezvous,
//                             watches) count while they wait.
//   --status-poll-seconds S   how often each rank of a running deployment is
//                             polled, and each poll's deadline (default 1)
//   --missed-status-polls N   polls a rank may leave unanswered in a row before
//                             its deployment fails and the others are stopped
//                             (default 3)
//   --drain-seconds S         NOT_SERVING this long before stopping
//   --node-expiry-seconds S   remove nodes STALE for longer than S (default: never)
//   --plan-retention-count N  keep the N most recently finished plans (default
//                             1000; 0 = no limit by count)
//   --plan-retention-seconds S  delete plans finished more than S ago (default
//                             604800, 7 days; 0 = no limit by age). Plans that
//                             deployments use are always kept.
#include <cmath>
#include <csignal>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cli_args.h"
#include "planner/service/planner_server.h"

namespace {

hap::service::PlannerServer* g_server = nullptr;
volatile std::sig_atomic_t g_signal = 0;

absl::StatusOr<hap::service::PlannerServerOptions> Options(const hap::tools::Args& a) {
  hap::service::PlannerServerOptions o;
  o.listen = a.GetOrEnv("listen", "127.0.0.1:7070");
  o.advertise = a.GetOrEnv("advertise", "");
  std::string metrics = a.GetOrEnv("metrics-listen", "127.0.0.1:9464");
  if (metrics == "off") {
    o.metrics_port = -1;
  } else {
    size_t colon = metrics.rfind(':');
    if (colon == std::string::npos || !absl::SimpleAtoi(metrics.substr(colon + 1), &o.metrics_port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-listen must be HOST:PORT or off, got '", metrics, "'"));
    }
    o.metrics_address = metrics.substr(0, colon);
  }
  o.database = a.GetOrEnv("database", "hap-planner.db");
  auto token = hap::service::ReadTokenFile(a.GetOrEnv("token-file", ""));
  if (!token.ok()) return token.status();
  o.security.token = *token;
  o.security.tls_cert_file = a.GetOrEnv("tls-cert-file", "");
  o.security.tls_key_file = a.GetOrEnv("tls-key-file", "");
  // A positive finite number from `lo` to `hi` (a whole one where `whole`):
  // a value out of range stops the planner with the flag's name, rather than
  // an infinity or a cast past int's range reaching the core (--heartbeat-
  // seconds=inf made every node's heartbeat limit infinite; 1e12 missed
  // heartbeats was cast to a negative int).
  auto number = [&](const char* flag, double def, double lo, double hi,
                    bool whole = false) -> absl::StatusOr<double> {
    std::string v = a.GetOrEnv(flag, "");
    if (v.empty()) return def;
    double x;
    if (!absl::SimpleAtod(v, &x) || !(x > 0) || !std::isfinite(x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be a positive number, got '", v, "'"));
    }
    if (x < lo || x > hi || (whole && x != std::floor(x))) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be a ",
                                                     whole ? "whole " : "", "number from ", lo,
                                                     " to ", hi, ", got ", v));
    }
    return x;
  };
  constexpr bool kWhole = true;
  auto hb = number("heartbeat-seconds", 5, 0.01, 3600);
  auto missed = number("missed-heartbeats", 3, 1, 1000, kWhole);
  auto workers = number("workers", 1, 1, 1024, kWhole);
  auto max_seconds = number("max-seconds", 60, 0, 1e7);
  auto max_request = number("max-request-bytes", hap::service::kDefaultMaxRequestBytes, 0, 1e18);
  auto drain = number("drain-seconds", 1, 0, 3600);
  auto expiry = number("node-expiry-seconds", 0, 0, 1e9);
  auto threads = number("max-threads", o.max_threads, 0, 1e9);
  auto poll =
      number("status-poll-seconds", absl::ToDoubleSeconds(o.deployments.status_interval), 0, 1e9);
  auto polls = number("missed-status-polls", o.deployments.missed_status_limit, 1, 1000, kWhole);
  for (auto* s : {&hb, &missed, &workers, &max_seconds, &max_request, &drain, &expiry, &threads,
                  &poll, &polls}) {
    if (!s->ok()) return s->status();
  }
  o.core.heartbeat_interval = absl::Seconds(*hb);
  o.core.missed_heartbeats = static_cast<int>(*missed);
  o.core.workers = static_cast<int>(*workers);
  o.core.default_max_seconds = *max_seconds;
  o.max_message_bytes = static_cast<int>(std::min<double>(*max_request, 1 << 30));
  o.drain = absl::Seconds(*drain);
  o.max_threads = static_cast<int>(std::min<double>(std::max(*threads, 4.0), 1 << 16));
  o.deployments.status_interval = absl::Seconds(std::min(*poll, 3600.0));
  o.deployments.status_timeout = o.deployments.status_interval;
  o.deployments.missed_status_limit = static_cast<int>(*polls);
  if (*expiry > 0) o.core.node_expiry = absl::Seconds(*expiry);
  // Retention: 0 turns a limit off.
  auto non_negative = [&](const char* flag, double def) -> absl::StatusOr<double> {
    std::string v = a.GetOrEnv(flag, "");
    if (v.empty()) return def;
    double x;
    if (!absl::SimpleAtod(v, &x) || !(x >= 0) || !std::isfinite(x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be a number >= 0 (0 = no limit), got '", v, "'"));
    }
    return x;
  };
  auto streams = non_negative("max-concurrent-streams", o.max_concurrent_streams);
  if (!streams.ok()) return streams.status();
  if (*streams != std::floor(*streams) || *streams > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-concurrent-streams must be a whole number from 0 to 2^30, got ", *streams));
  }
  o.max_concurrent_streams = static_cast<int>(*streams);
  auto keep_count = non_negative("plan-retention-count", o.core.plan_retention_count);
  auto keep_seconds =
      non_negative("plan-retention-seconds", absl::ToDoubleSeconds(o.core.plan_retention_age));
  for (auto* s : {&keep_count, &keep_seconds}) {
    if (!s->ok()) return s->status();
  }
  o.core.plan_retention_count = static_cast<int>(std::min<double>(*keep_count, 1 << 30));
  o.core.plan_retention_age =
      *keep_seconds > 0 ? absl::Seconds(*keep_seconds) : absl::InfiniteDuration();
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  // Abseil's lock-order (deadlock) detection is a debugging aid: it cost 4%
  // of the planner's CPU under read load. Tests of the core keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::vector<std::string> args(argv + 1, argv + argc);
  auto a = hap::tools::Args::Parse(args,
                                   {"listen",
                                    "advertise",
                                    "metrics-listen",
                                    "database",
                                    "token-file",
                                    "tls-cert-file",
                                    "tls-key-file",
                                    "heartbeat-seconds",
                                    "missed-heartbeats",
                                    "workers",
                                    "max-seconds",
                                    "node-expiry-seconds",
                                    "plan-retention-count",
                                    "plan-retention-seconds",
                                    "max-request-bytes",
                                    "drain-seconds",
                                    "max-threads",
                                    "max-concurrent-streams",
                                    "status-poll-seconds",
                                    "missed-status-polls"},
                                   {"help"});
  if (!a.ok()) {
    std::cerr << "error: " << a.status().message() << "\n";
    return 2;
  }
  if (a->Bool("help")) {
    std::cout << "usage: hap-planner [--listen HOST:PORT] [--database FILE] "
                 "[--metrics-listen HOST:PORT|off] [--token-file FILE] ... (see main.cc)\n";
    return 0;
  }
  auto o = Options(*a);
  if (!o.ok()) {
    std::cerr << "error: " << o.status().message() << "\n";
    return 2;
  }
  auto server = hap::service::PlannerServer::Start(*o);
  if (!server.ok()) {
    std::cerr << "error: " << server.status().message() << "\n";
    return 1;
  }
  g_server = server->get();
  std::cout << "listening on " << (*server)->address() << "\n";
  if ((*server)->metrics_port() >= 0) {
    std::cout << "metrics on http://" << o->metrics_address << ":" << (*server)->metrics_port()
              << "/metrics\n";
  }
  std::cout << std::flush;
  std::signal(SIGTERM, [](int s) { g_signal = s; });
  std::signal(SIGINT, [](int s) { g_signal = s; });
  while (!g_signal) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::cout << "shutting down\n" << std::flush;
  (*server)->Shutdown();
  return 0;
}
