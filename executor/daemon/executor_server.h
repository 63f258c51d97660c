// The hap-executor daemon put together: the core, the step reporter to the
// planner, the rendezvous store at the planner, and the gRPC server with
// grpc.health.v1. The binary's main is flags around this; tests start it in
// process on 127.0.0.1 port 0.
#ifndef HAP_EXECUTOR_DAEMON_EXECUTOR_SERVER_H_
#define HAP_EXECUTOR_DAEMON_EXECUTOR_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "executor/daemon/executor_core.h"
#include "executor/daemon/executor_service_impl.h"
#include "executor/daemon/step_reporter.h"

namespace hap::executor {

struct ExecutorServerOptions {
  std::string listen = "127.0.0.1:0";  // port 0 picks a free port
  // The planner ("host:port"): the only one plans are taken from, the
  // rendezvous store and where step metrics go. Required.
  std::string planner;
  // token: required on every call to this server and sent on every call to
  // the planner; tls_cert_file/tls_key_file: this server's TLS;
  // tls_ca_file: verifies the planner.
  service::Security security;
  // While shutting down, health reports NOT_SERVING for this long before
  // the server stops taking calls.
  absl::Duration drain = absl::Seconds(1);
  absl::Duration report_timeout = absl::Seconds(5);  // per ReportStepMetrics
  size_t report_queue = 1024;                        // metrics queued at most
  // StreamStepMetrics calls served at once; beyond, a stream is
  // RESOURCE_EXHAUSTED naming this limit. Each open stream holds a server
  // thread until training ends, so unbounded streams could take every
  // thread and leave LoadPlan and StopTraining unanswered. The server's
  // threads are bounded to this plus kControlThreads (grpc::ResourceQuota),
  // so control calls are still served while the streams are at their
  // limit. From 1 to ExecutorServer::kMaxStreamsLimit.
  int max_streams = kDefaultMaxStreams;
  // device_id, data_dir, threads, comm_timeout, ...; planner_address,
  // make_store, on_step and on_end are set by Start.
  ExecutorCoreOptions core;
};

// OK when `listen` is HOST:PORT with PORT a whole number from 0 (a free
// port) to 65535; InvalidArgument naming it otherwise (gRPC took a port
// above 65535 modulo 65536, and an empty one as 443).
absl::Status CheckListenAddress(const std::string& listen);
// OK when `planner` is [dns:///|ipv4:|ipv6:]HOST:PORT with PORT from 1 to
// 65535, or a unix: address; InvalidArgument naming it otherwise.
absl::Status CheckPlannerAddress(const std::string& planner);

class ExecutorServer {
 public:
  // Server threads beyond max_streams: for LoadPlan, StartTraining,
  // StopTraining, GetStatus, refused streams and gRPC's pollers. Calls that
  // find no thread are RESOURCE_EXHAUSTED.
  static constexpr int kControlThreads = 16;
  static constexpr int kMaxStreamsLimit = 65536;

  // InvalidArgument for bad options; Unavailable when the address cannot be
  // bound.
  static absl::StatusOr<std::unique_ptr<ExecutorServer>> Start(ExecutorServerOptions options);
  ~ExecutorServer();  // Shutdown()

  int port() const;
  std::string address() const;  // listen host and the bound port

  // NOT_SERVING, stop training (its final status: FAILED "stopped by the
  // executor shutting down ..."), drain (GetStatus answers that status),
  // then stop accepting and finish the calls in flight. Idempotent; safe
  // from any thread but a handler's.
  void Shutdown();
  // Blocks until Shutdown() has finished.
  void Wait();

  ExecutorCore& core();
  StepReporter::Counters reporter_counters() const;

 private:
  ExecutorServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_EXECUTOR_SERVER_H_
