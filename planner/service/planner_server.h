// The hap-planner daemon put together: durable state, the core, the gRPC
// service (with grpc.health.v1 and server reflection), and Prometheus
// metrics and the status page (status_page.h) over HTTP. main.cc is flags
// around this; tests start it in process on 127.0.0.1 with port 0.
#ifndef HAP_PLANNER_SERVICE_PLANNER_SERVER_H_
#define HAP_PLANNER_SERVICE_PLANNER_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/deployments.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {

// What a restart starts from, and where changes go.
class StateBackend : public PlannerStateSink {
 public:
  struct Loaded {
    std::vector<hap::v1::Node> nodes;
    std::vector<hap::v1::Plan> plans;
    std::vector<hap::v1::Deployment> deployments;
    std::vector<hap::v1::StepMetric> metrics;
    std::vector<hap::v1::Job> jobs;
  };
  // Plans come as summaries (store::PlanSummary: no rank programs, graph or
  // program), except those not finished (PENDING, RUNNING), which come whole:
  // the core reads a finished plan's body with LoadPlan when it is asked for.
  // Of each deployment's step metrics, the first `max_metrics_per_deployment`
  // (whole steps; what the deployment manager keeps) and those of its latest
  // kRecentStepsPerRank steps (its recent statistics), not every one stored.
  virtual absl::StatusOr<Loaded> Load(size_t max_metrics_per_deployment) = 0;
  absl::StatusOr<Loaded> Load() { return Load(kDefaultMaxMetricsPerDeployment); }
  virtual absl::StatusOr<hap::v1::Plan> LoadPlan(const std::string& name) = 0;
};

// The SQLite database at `path` (created when missing).
absl::StatusOr<std::unique_ptr<StateBackend>> OpenSqliteBackend(const std::string& path);

struct PlannerServerOptions {
  std::string listen = "127.0.0.1:0";  // gRPC; port 0 picks a free port
  // Address executors use to reach the planner (rendezvous); empty = the
  // bound listen address (ListenAddressToAdvertise).
  std::string advertise;
  std::string metrics_address = "127.0.0.1";
  int metrics_port = 0;         // /metrics over HTTP; -1 = off
  std::string database;         // SQLite file; empty = state in memory only
  Security security;            // token and TLS for every RPC
  // Largest request accepted (RESOURCE_EXHAUSTED beyond); see
  // kDefaultMaxRequestBytes.
  int max_message_bytes = kDefaultMaxRequestBytes;
  // Threads for the calls that block (CreatePlan, deploys, watches,
  // rendezvous waits); such a call beyond them gets RESOURCE_EXHAUSTED.
  // Reads are answered on gRPC's callback API and need none (at least 4).
  int max_threads = 256;
  // Calls one client connection may have open on the server at once
  // (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); more wait in the client, in
  // order, until one ends. 0 = gRPC's default (no limit). Bounding it keeps
  // the calls the server juggles few and served in order under load: with
  // 8 client connections, 10,000 reads in flight had a p99 of 0.5-1.1 s
  // unbounded and 0.34-0.37 s at 64 (bench/README.md, "The planner under
  // load"). A client that holds more long calls (watches, rendezvous
  // waits) than this on one connection must open more connections.
  int max_concurrent_streams = 64;
  // HTTP/2 keepalive: every client connection is pinged this often and
  // closed when a ping goes unanswered for as long (at most 20 s), which
  // cancels its calls. Without it a watch whose client vanished without
  // closing its connection (host down, network cut) held its thread (of
  // max_threads) until the plan or job ended, for days.
  absl::Duration keepalive = absl::Seconds(60);
  // How running deployments are watched (poll interval, missed polls,
  // deadlines); must pass ValidateDeploymentWatchOptions.
  DeploymentWatchOptions deployments;
  // While shutting down, health reports NOT_SERVING for this long before
  // the server stops taking calls (load balancers drain meanwhile).
  absl::Duration drain = absl::Seconds(1);
  // How often plan and deployment retention run (PlannerCore::
  // EnforceRetention; the limits are core.plan_retention_count and
  // core.plan_retention_age; DeploymentManager::EnforceRetention with the
  // two below). Plans deployments use are kept until their deployments go.
  // A pass runs at start too, deployments first.
  absl::Duration retention_interval = absl::Minutes(1);
  // Finished deployments (and their step metrics) kept: the most recently
  // finished `deployment_retention_count` (0 = no limit by count), finished
  // within `deployment_retention_age` (InfiniteDuration = no limit by age),
  // and an unfinished job's.
  int deployment_retention_count = 1000;
  absl::Duration deployment_retention_age = absl::Hours(24 * 7);
  // Finished elastic jobs kept, the same way (JobController::
  // EnforceRetention); unfinished ones always.
  int job_retention_count = 1000;
  absl::Duration job_retention_age = absl::Hours(24 * 7);
  PlannerCoreOptions core;
};

// The address executors are given to reach a planner listening on
// `listen` (HOST:PORT as --listen takes it) at the bound `port`: HOST:port,
// this machine's host name for a wildcard host (0.0.0.0, [::] or none),
// which executors on other machines could not dial (0.0.0.0 is their own).
std::string ListenAddressToAdvertise(const std::string& listen, int port);

class PlannerServer {
 public:
  static absl::StatusOr<std::unique_ptr<PlannerServer>> Start(PlannerServerOptions options);
  ~PlannerServer();  // Shutdown()

  int port() const;          // the gRPC port bound
  int metrics_port() const;  // the HTTP port bound, or -1
  std::string address() const;  // "127.0.0.1:port": to dial it from this machine
  // Where it listens: --listen's host with the port bound ("0.0.0.0:7070",
  // "[fd00::1]:7070"), as hap-planner prints it.
  const std::string& listen_address() const;
  // The address executors are given to reach the planner: --advertise (an
  // unbracketed IPv6 host bracketed), or ListenAddressToAdvertise.
  const std::string& advertised_address() const;

  // NOT_SERVING, drain, then stop accepting and finish calls in flight.
  void Shutdown();
  // Blocks until Shutdown() has finished (from another thread or signal).
  void Wait();

  PlannerCore& core();

 private:
  PlannerServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_PLANNER_SERVER_H_
