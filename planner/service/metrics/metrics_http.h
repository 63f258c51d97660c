// An HTTP/1.1 server exposing a MetricsRegistry to Prometheus:
//   GET /metrics  200, Content-Type "text/plain; version=0.0.4;
//                 charset=utf-8", the registry's Serialize() output
//   GET /healthz  200, "ok"
//   paths added with AddHandler: what the handler returns; with a token
//                 set (MetricsHttpServerOptions::token), 401 unless the
//                 request carries it
//   other paths   404; methods other than GET and HEAD 405
// HEAD is answered like GET, without a body. With a certificate and key
// (MetricsHttpServerOptions::tls_cert_file) it is HTTPS instead. A malformed request gets a
// 4xx (505 for an HTTP version other than 1.0 and 1.1); the request line
// and headers may take 16 KiB (414 or 431 beyond). Every response closes the
// connection ("Connection: close"); request bodies are not read.
//
// Hostile clients: one thread reads requests and writes responses for
// every connection without blocking, so clients that connect and send
// nothing, send a byte at a time or do not read their response hold no
// thread and delay no one else; each is closed after
// MetricsHttpServerOptions::request_timeout, or sooner when
// max_connections are open and a new client connects. Stop() does not
// wait for them.
//
// Extra pages (e.g. a status page) are plain functions from a path to a
// response, so this library knows nothing of what they show.
//
//   MetricsHttpServerOptions options;
//   options.port = flags.metrics_port;  // 0: any free port
//   MetricsHttpServer server(&registry, options);
//   HAP_RETURN_IF_ERROR(server.Start());
//   ... serving on 127.0.0.1:server.port() ...
//
// Thread safety: responses are computed on the server's own threads, which
// only read the registry (itself thread-safe) and call the added handlers
// (which must be thread-safe). Start, Stop and port may be called from any
// thread; AddHandler only before Start.
#ifndef HAP_PLANNER_SERVICE_METRICS_METRICS_HTTP_H_
#define HAP_PLANNER_SERVICE_METRICS_METRICS_HTTP_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "planner/service/metrics/metrics.h"

namespace hap::metrics {
namespace internal {
struct HttpRequest;  // a parsed request (metrics_http.cc)
}  // namespace internal

struct MetricsHttpServerOptions {
  // An IPv4 address to bind; loopback unless Prometheus scrapes from
  // another host.
  std::string bind_address = "127.0.0.1";
  // 0 picks a free port at Start(); port() says which.
  int port = 0;
  // Threads computing responses (scrapes are rare and short): how many
  // handlers run at once. Reading and writing is on one more thread.
  int num_threads = 2;
  // When set, pages added with AddHandler (e.g. the status page) answer
  // 401, with a "WWW-Authenticate: Basic" challenge, unless the request
  // carries "Authorization: Bearer <token>" or HTTP Basic credentials whose
  // password is the token (any user name: what a browser sends once asked).
  // /metrics and /healthz stay open, for Prometheus and load balancers.
  std::string token;
  // How long a client has to send its request's line and headers, counted
  // from its connection, and then to read the response; it is closed after.
  absl::Duration request_timeout = absl::Seconds(10);
  // Connections open at once. A new one beyond it closes the oldest
  // connection that has not sent its whole request (or not read its whole
  // response), so stalled clients cannot keep scrapes out.
  int max_connections = 128;
  // Both set: HTTPS only (TLS 1.2 or later), with this PEM certificate
  // chain (the server's certificate first) and its PEM private key, not
  // encrypted; a client that does not speak TLS is closed unanswered. The
  // token then never crosses the network in clear. Serving TLS ignores
  // SIGPIPE in the process (as gRPC does): a client gone mid-write is an
  // error of that connection, not the process's end.
  std::string tls_cert_file;
  std::string tls_key_file;
};

// What an added handler answers.
struct HttpResponse {
  int status = 200;
  std::string content_type = "text/html; charset=utf-8";
  std::string body;
};

// Answers a GET (or HEAD) for `path`: the request's path, percent-decoded,
// without the query string, with "." and ".." segments resolved and
// repeated slashes merged. Called on the server's threads, concurrently.
using HttpHandler = std::function<HttpResponse(absl::string_view path)>;

class MetricsHttpServer {
 public:
  // `registry` is not owned and must outlive the server.
  explicit MetricsHttpServer(const MetricsRegistry* registry,
                             MetricsHttpServerOptions options = {});
  ~MetricsHttpServer();  // Stop()s.
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Serves GET and HEAD for `pattern` with `handler`. As in Go's ServeMux,
  // a pattern ending in '/' matches that subtree ("/status/" matches
  // "/status/plans/x"; "/" matches every path) and any other pattern
  // matches only itself; the longest matching pattern wins, and /metrics
  // and /healthz always go to the registry. InvalidArgument for a pattern
  // not starting with '/', one already added, /metrics or /healthz, or an
  // empty handler; FailedPrecondition while serving.
  absl::Status AddHandler(const std::string& pattern, HttpHandler handler);

  // Binds and starts serving. Unavailable when the address cannot be bound
  // (e.g. the port is taken), with the reason; InvalidArgument for a bind
  // address that is not IPv4, a port outside 0..65535, fewer than one
  // thread or connection, a request timeout that is not positive, or a TLS
  // certificate or key that is missing, unreadable or not each other's;
  // FailedPrecondition when already started. After an error the
  // server may be started again.
  absl::Status Start();

  // Stops serving: closes every connection (without waiting for clients)
  // and waits for handlers that are running; a no-op when not running. The server may be started
  // again afterwards.
  void Stop();

  // The bound port while running (the chosen one when options.port is 0);
  // 0 when not running.
  int port() const;

 private:
  // The sockets and threads of one Start() .. Stop().
  class Serving;

  // The whole response (status line, headers, body) to a parsed request.
  std::string Answer(const internal::HttpRequest& request) const;
  // The handler for `path`, or null.
  const HttpHandler* FindHandler(absl::string_view path) const;

  const MetricsRegistry* const registry_;
  const MetricsHttpServerOptions options_;
  mutable absl::Mutex mu_;
  std::unique_ptr<Serving> serving_ ABSL_GUARDED_BY(mu_);
  int port_ ABSL_GUARDED_BY(mu_) = 0;
  // Pattern -> handler. Written only while stopped; read by requests,
  // which only run while started, so they read it without the lock.
  std::map<std::string, HttpHandler> handlers_;
};

}  // namespace hap::metrics

#endif  // HAP_PLANNER_SERVICE_METRICS_METRICS_HTTP_H_
