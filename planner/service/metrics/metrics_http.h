// An HTTP server (civetweb) exposing a MetricsRegistry to Prometheus:
//   GET /metrics  200, Content-Type "text/plain; version=0.0.4;
//                 charset=utf-8", the registry's Serialize() output
//   GET /healthz  200, "ok"
//   other paths   404; other methods on those two paths 405
// HEAD is answered like GET, without a body.
//
//   MetricsHttpServerOptions options;
//   options.port = flags.metrics_port;  // 0: any free port
//   MetricsHttpServer server(&registry, options);
//   HAP_RETURN_IF_ERROR(server.Start());
//   ... serving on 127.0.0.1:server.port() ...
//
// Thread safety: requests are served on civetweb's own threads, which only
// read the registry (itself thread-safe). Start, Stop and port may be
// called from any thread.
#ifndef HAP_PLANNER_SERVICE_METRICS_METRICS_HTTP_H_
#define HAP_PLANNER_SERVICE_METRICS_METRICS_HTTP_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "planner/service/metrics/metrics.h"

struct mg_context;

namespace hap::metrics {

struct MetricsHttpServerOptions {
  // An IPv4 address to bind; loopback unless Prometheus scrapes from
  // another host.
  std::string bind_address = "127.0.0.1";
  // 0 picks a free port at Start(); port() says which.
  int port = 0;
  // Threads serving requests (scrapes are rare and short).
  int num_threads = 2;
};

class MetricsHttpServer {
 public:
  // `registry` is not owned and must outlive the server.
  explicit MetricsHttpServer(const MetricsRegistry* registry,
                             MetricsHttpServerOptions options = {});
  ~MetricsHttpServer();  // Stop()s.
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Binds and starts serving. Unavailable when the address cannot be bound
  // (e.g. the port is taken), with civetweb's reason; InvalidArgument for a
  // bind address that is not IPv4, a port outside 0..65535 or fewer than
  // one thread; FailedPrecondition when already started. After an error the
  // server may be started again.
  absl::Status Start();

  // Stops serving and waits for in-flight requests; a no-op when not
  // running. The server may be started again afterwards.
  void Stop();

  // The bound port while running (the chosen one when options.port is 0);
  // 0 when not running.
  int port() const;

 private:
  const MetricsRegistry* const registry_;
  const MetricsHttpServerOptions options_;
  mutable absl::Mutex mu_;
  mg_context* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  int port_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace hap::metrics

#endif  // HAP_PLANNER_SERVICE_METRICS_METRICS_HTTP_H_
