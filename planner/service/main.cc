// hap-planner: the planner daemon (docs/design.md §9); its flags are kUsage.
#include <cmath>
#include <csignal>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cli_args.h"
#include "common/host_port.h"
#include "planner/service/planner_server.h"

namespace {

constexpr char kUsage[] = R"(usage: hap-planner [--listen HOST:PORT] [--database FILE] [flags]

The planner daemon: synthesizes SPMD plans on request, stores plans, deployments
and jobs, and pushes plans to executor daemons. Each flag may instead come from
the environment as HAP_<FLAG> (--database: HAP_DATABASE, ...), the flag winning.

  --listen HOST:PORT        gRPC (default 127.0.0.1:7070; port 0 = any free)
  --advertise HOST:PORT     address executors reach the planner at
  --metrics-listen HOST:PORT  Prometheus /metrics and /status (default
                            127.0.0.1:9464; "off"); HTTPS with --tls-cert-file
  --database FILE           SQLite state (default hap-planner.db; "" = memory);
                            locked to this planner while it runs
  --token-file FILE         bearer token every call must carry
  --tls-cert-file FILE      serve TLS with this certificate ...
  --tls-key-file FILE       ... and this key
  --tls-ca-file FILE        CA bundle to verify the executors' TLS certificates:
                            plans go to executors over TLS (without it, in
                            plaintext)
  --heartbeat-seconds S     agents' heartbeat interval (5; 0.01 to 3600)
  --missed-heartbeats N     heartbeats missed in a row before a node is STALE
                            (3; 1 to 1000)
  --workers N               plans synthesized at once (1; 1 to 1024)
  --max-seconds S           a plan request's default time budget (60; 0.001 to
                            1e7)
  --max-request-bytes N     larger requests get RESOURCE_EXHAUSTED (16 MiB; 1
                            to 2^30; a 48-layer GPT graph is 176 KB)
  --max-threads N           threads for calls that block (planning, deploys,
                            watches, rendezvous waits; 256; 4 to 65536); beyond
                            them such calls get RESOURCE_EXHAUSTED. Reads
                            (Get/List) take no thread of their own.
  --max-concurrent-streams N  calls one client connection may have open at once
                            (64; 0 = no limit, up to 2^30); more wait in the
                            client, in order. Long waits count while they wait.
  --keepalive-seconds S     ping each client connection this often, and close it
                            when a ping goes unanswered for as long (at most
                            20 s): a watch whose client vanished (host down,
                            network cut) ends and frees its thread (60; 0.1 to
                            86400)
  --status-poll-seconds S   how often each rank of a running deployment is
                            polled, and each poll's deadline (1; 0.001 to 3600)
  --missed-status-polls N   polls a rank may leave unanswered in a row before
                            its deployment fails and the others are stopped
                            (3; 1 to 1000)
  --drain-seconds S         NOT_SERVING this long before stopping (1; 0 to 3600)
  --node-expiry-seconds S   remove nodes STALE for longer than S (0 = never)
  --plan-retention-count N  keep the N most recently finished plans (1000; 0 =
                            no limit by count)
  --plan-retention-seconds S  delete plans finished more than S ago (604800, 7
                            days; 0 = no limit by age). Plans that deployments
                            use are always kept.
  --deployment-retention-count N  keep the N most recently finished
                            deployments with their step metrics (1000; 0 = no
                            limit by count)
  --deployment-retention-seconds S  delete deployments finished more than S
                            ago, with their step metrics (604800, 7 days; 0 =
                            no limit by age). An unfinished job's deployment
                            is kept.
  --job-retention-count N   keep the N most recently finished elastic jobs
                            (1000; 0 = no limit by count)
  --job-retention-seconds S  delete jobs finished more than S ago (604800, 7
                            days; 0 = no limit by age). Unfinished jobs are
                            kept.
)";

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
    // A negative port is no port: -1 turned the metrics off without a word.
    const size_t colon = metrics.rfind(':');
    if (!hap::service::IsHostPort(metrics, 0) ||
        !absl::SimpleAtoi(metrics.substr(colon + 1), &o.metrics_port)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--metrics-listen must be HOST:PORT (PORT 0 to 65535) or off, got '", metrics, "'"));
    }
    o.metrics_address = metrics.substr(0, colon);
  }
  o.database = a.GetOrEnv("database", "hap-planner.db");
  auto token = hap::service::ReadTokenFile(a.GetOrEnv("token-file", ""));
  if (!token.ok()) return token.status();
  o.security.token = *token;
  o.security.tls_cert_file = a.GetOrEnv("tls-cert-file", "");
  o.security.tls_key_file = a.GetOrEnv("tls-key-file", "");
  o.security.tls_ca_file = a.GetOrEnv("tls-ca-file", "");
  if (!o.security.tls_ca_file.empty()) {
    // Read now: a bad bundle would otherwise show at the first deploy.
    auto ca = hap::service::MakeChannelCredentials(o.security);
    if (!ca.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls-ca-file: ", ca.status().message()));
    }
  }
  // Every number flag in its range (Args::NumberOrEnv; the error names the
  // flag, its variable, the range and the value): --heartbeat-seconds=inf
  // made every node's heartbeat limit infinite, 1e12 missed heartbeats was
  // cast to a negative int, and values past a limit were clamped silently.
  constexpr bool kWhole = true;
  auto hb = a.NumberOrEnv("heartbeat-seconds", 5, 0.01, 3600);
  auto missed = a.NumberOrEnv("missed-heartbeats", 3, 1, 1000, kWhole);
  auto workers = a.NumberOrEnv("workers", 1, 1, 1024, kWhole);
  auto max_seconds = a.NumberOrEnv("max-seconds", 60, 0.001, 1e7);
  auto max_request =
      a.NumberOrEnv("max-request-bytes", hap::service::kDefaultMaxRequestBytes, 1, 1 << 30, kWhole);
  auto drain = a.NumberOrEnv("drain-seconds", 1, 0, 3600);
  auto expiry = a.NumberOrEnv("node-expiry-seconds", 0, 0, 1e9);
  auto threads = a.NumberOrEnv("max-threads", o.max_threads, 4, 1 << 16, kWhole);
  auto poll = a.NumberOrEnv("status-poll-seconds",
                            absl::ToDoubleSeconds(o.deployments.status_interval), 0.001, 3600);
  auto polls =
      a.NumberOrEnv("missed-status-polls", o.deployments.missed_status_limit, 1, 1000, kWhole);
  auto streams =
      a.NumberOrEnv("max-concurrent-streams", o.max_concurrent_streams, 0, 1 << 30, kWhole);
  auto keepalive =
      a.NumberOrEnv("keepalive-seconds", absl::ToDoubleSeconds(o.keepalive), 0.1, 86400);
  auto keep_count =
      a.NumberOrEnv("plan-retention-count", o.core.plan_retention_count, 0, 1 << 30, kWhole);
  auto keep_seconds = a.NumberOrEnv("plan-retention-seconds",
                                    absl::ToDoubleSeconds(o.core.plan_retention_age), 0, 1e12);
  auto keep_deployments =
      a.NumberOrEnv("deployment-retention-count", o.deployment_retention_count, 0, 1 << 30, kWhole);
  auto keep_deployment_seconds = a.NumberOrEnv(
      "deployment-retention-seconds", absl::ToDoubleSeconds(o.deployment_retention_age), 0, 1e12);
  auto keep_jobs = a.NumberOrEnv("job-retention-count", o.job_retention_count, 0, 1 << 30, kWhole);
  auto keep_job_seconds =
      a.NumberOrEnv("job-retention-seconds", absl::ToDoubleSeconds(o.job_retention_age), 0, 1e12);
  for (auto* s : {&hb, &missed, &workers, &max_seconds, &max_request, &drain, &expiry, &threads,
                  &poll, &polls, &streams, &keepalive, &keep_count, &keep_seconds,
                  &keep_deployments, &keep_deployment_seconds, &keep_jobs, &keep_job_seconds}) {
    if (!s->ok()) return s->status();
  }
  o.core.heartbeat_interval = absl::Seconds(*hb);
  o.core.missed_heartbeats = static_cast<int>(*missed);
  o.core.workers = static_cast<int>(*workers);
  o.core.default_max_seconds = *max_seconds;
  o.max_message_bytes = static_cast<int>(*max_request);
  o.drain = absl::Seconds(*drain);
  o.max_threads = static_cast<int>(*threads);
  o.deployments.status_interval = absl::Seconds(*poll);
  o.deployments.status_timeout = o.deployments.status_interval;
  o.deployments.missed_status_limit = static_cast<int>(*polls);
  if (*expiry > 0) o.core.node_expiry = absl::Seconds(*expiry);
  o.max_concurrent_streams = static_cast<int>(*streams);
  o.keepalive = absl::Seconds(*keepalive);
  // Retention: 0 turns a limit off.
  o.core.plan_retention_count = static_cast<int>(*keep_count);
  o.core.plan_retention_age =
      *keep_seconds > 0 ? absl::Seconds(*keep_seconds) : absl::InfiniteDuration();
  o.deployment_retention_count = static_cast<int>(*keep_deployments);
  o.deployment_retention_age = *keep_deployment_seconds > 0
                                   ? absl::Seconds(*keep_deployment_seconds)
                                   : absl::InfiniteDuration();
  o.job_retention_count = static_cast<int>(*keep_jobs);
  o.job_retention_age =
      *keep_job_seconds > 0 ? absl::Seconds(*keep_job_seconds) : absl::InfiniteDuration();
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
                                    "tls-ca-file",
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
                                    "keepalive-seconds",
                                    "status-poll-seconds",
                                    "missed-status-polls",
                                    "deployment-retention-count",
                                    "deployment-retention-seconds",
                                    "job-retention-count",
                                    "job-retention-seconds"},
                                   {"help"});
  if (!a.ok()) {
    std::cerr << "error: " << a.status().message() << "\n" << kUsage;
    return 2;
  }
  if (a->Bool("help")) {
    std::cout << kUsage;
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
  std::cout << "listening on " << (*server)->listen_address() << "\n";
  std::cout << "executors are told to dial " << (*server)->advertised_address() << "\n";
  if ((*server)->metrics_port() >= 0) {
    std::cout << "metrics on " << (o->security.tls_cert_file.empty() ? "http" : "https") << "://"
              << o->metrics_address << ":" << (*server)->metrics_port() << "/metrics\n";
  }
  std::cout << std::flush;
  std::signal(SIGTERM, [](int s) { g_signal = s; });
  std::signal(SIGINT, [](int s) { g_signal = s; });
  while (!g_signal) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::cout << "shutting down\n" << std::flush;
  (*server)->Shutdown();
  return 0;
}
