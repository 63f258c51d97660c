// civetweb lives in this file only: its C callbacks, option strings and
// error buffers do not leak past MetricsHttpServer.
#include "planner/service/metrics/metrics_http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace hap::metrics {
namespace {

constexpr char kMetricsContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";
constexpr char kTextContentType[] = "text/plain; charset=utf-8";

// Writes a whole response; returns `status` (what civetweb logs).
int Respond(mg_connection* conn, int status, const char* content_type,
            absl::string_view body, bool send_body, const char* allow = nullptr,
            const char* authenticate = nullptr) {
  const std::string length = absl::StrCat(body.size());
  mg_response_header_start(conn, status);
  mg_response_header_add(conn, "Content-Type", content_type, -1);
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  mg_response_header_add(conn, "Cache-Control", "no-store", -1);
  if (allow != nullptr) mg_response_header_add(conn, "Allow", allow, -1);
  if (authenticate != nullptr) {
    mg_response_header_add(conn, "WWW-Authenticate", authenticate, -1);
  }
  mg_response_header_send(conn);
  if (send_body && !body.empty()) mg_write(conn, body.data(), body.size());
  return status;
}

// civetweb would log to stderr. Bad requests are the client's business;
// why a start failed (e.g. "cannot bind to 127.0.0.1:9090: 98 (Address
// already in use)") it says only here, on the thread running mg_start2, so
// Start() collects those messages for its status.
thread_local std::string* start_log = nullptr;

int QuietLog(const mg_connection*, const char* message) {
  if (start_log != nullptr && message != nullptr) {
    if (!start_log->empty()) start_log->append("; ");
    start_log->append(message);
  }
  return 1;
}

// Opens and closes a TCP connection to `address`:`port` (best effort).
void Poke(const std::string& address, int port) {
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  // Start() checked that `address` is IPv4.
  const std::string target = address == "0.0.0.0" ? "127.0.0.1" : address;
  if (inet_pton(AF_INET, target.c_str(), &addr.sin_addr) != 1) return;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return;
  connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  close(fd);
}

// mg_stop() returns once civetweb's listening thread sees the stop flag,
// which it checks only between polls of the listening socket, and those
// time out every 2 s. A connection ends the poll early, so stop on a helper
// thread and poke the port until mg_stop() has returned.
void StopContext(mg_context* context, const std::string& address, int port) {
  absl::Notification stopped;
  std::thread stopper([context, &stopped] {
    mg_stop(context);
    stopped.Notify();
  });
  while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
    Poke(address, port);
  }
  stopper.join();
}

// Compares in a time that depends only on the lengths.
bool SameSecret(absl::string_view got, absl::string_view want) {
  if (got.size() != want.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff |= got[i] ^ want[i];
  return diff == 0;
}

// Whether an Authorization header carries `token`: "Bearer <token>", or
// HTTP Basic with the token as the password (any user name), which is what
// browsers send when the page asks for credentials.
bool Authorized(const char* header, const std::string& token) {
  if (header == nullptr) return false;
  absl::string_view h = absl::StripAsciiWhitespace(header);
  if (absl::ConsumePrefix(&h, "Bearer ")) return SameSecret(h, token);
  if (absl::ConsumePrefix(&h, "Basic ")) {
    std::string decoded;
    if (!absl::Base64Unescape(h, &decoded)) return false;
    const size_t colon = decoded.find(':');
    return colon != std::string::npos &&
           SameSecret(absl::string_view(decoded).substr(colon + 1), token);
  }
  return false;
}

}  // namespace

// Serves every path (registered at "/", which civetweb treats as a prefix
// of all URIs).
int MetricsHttpServer::OnRequest(mg_connection* conn, void* cbdata) {
  const auto* server = static_cast<const MetricsHttpServer*>(cbdata);
  const mg_request_info* request = mg_get_request_info(conn);
  const absl::string_view path =
      request->local_uri != nullptr ? request->local_uri : "";
  const absl::string_view method =
      request->request_method != nullptr ? request->request_method : "";
  const bool is_metrics = path == "/metrics";
  const bool is_health = path == "/healthz";
  const HttpHandler* handler =
      is_metrics || is_health ? nullptr : server->FindHandler(path);
  if (!is_metrics && !is_health && handler == nullptr) {
    return Respond(conn, 404, kTextContentType, "not found\n",
                   method != "HEAD");
  }
  if (method != "GET" && method != "HEAD") {
    return Respond(conn, 405, kTextContentType, "method not allowed\n", true,
                   "GET, HEAD");
  }
  const bool send_body = method == "GET";
  if (is_health) return Respond(conn, 200, kTextContentType, "ok", send_body);
  if (is_metrics) {
    return Respond(conn, 200, kMetricsContentType,
                   server->registry_->Serialize(), send_body);
  }
  if (!server->options_.token.empty() &&
      !Authorized(mg_get_header(conn, "Authorization"),
                  server->options_.token)) {
    return Respond(
        conn, 401, kTextContentType,
        "this page needs the planner's token: send \"Authorization: Bearer "
        "<token>\", or give the token as the password when the browser asks\n",
        send_body, nullptr, "Basic realm=\"hap\", charset=\"UTF-8\"");
  }
  const HttpResponse response = (*handler)(path);
  return Respond(conn, response.status, response.content_type.c_str(),
                 response.body, send_body);
}

const HttpHandler* MetricsHttpServer::FindHandler(absl::string_view path) const {
  const HttpHandler* best = nullptr;
  size_t best_length = 0;
  for (const auto& [pattern, handler] : handlers_) {
    const bool subtree = pattern.back() == '/';
    const bool match = subtree ? absl::StartsWith(path, pattern) : path == pattern;
    if (match && pattern.size() >= best_length) {
      best = &handler;
      best_length = pattern.size();
    }
  }
  return best;
}

absl::Status MetricsHttpServer::AddHandler(const std::string& pattern,
                                           HttpHandler handler) {
  if (pattern.empty() || pattern[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "handler pattern \"", pattern, "\" does not start with '/'"));
  }
  if (pattern == "/metrics" || pattern == "/healthz") {
    return absl::InvalidArgumentError(
        absl::StrCat("handler pattern ", pattern, " is served by the registry"));
  }
  if (!handler) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty handler for ", pattern));
  }
  absl::MutexLock lock(&mu_);
  if (context_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot add handler ", pattern, " while serving on port ", port_));
  }
  if (!handlers_.emplace(pattern, std::move(handler)).second) {
    return absl::InvalidArgumentError(
        absl::StrCat("a handler for ", pattern, " was already added"));
  }
  return absl::OkStatus();
}

MetricsHttpServer::MetricsHttpServer(const MetricsRegistry* registry,
                                     MetricsHttpServerOptions options)
    : registry_(registry), options_(std::move(options)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::Status MetricsHttpServer::Start() {
  if (options_.port < 0 || options_.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port ", options_.port, " is not in 0..65535"));
  }
  in_addr parsed;
  if (inet_pton(AF_INET, options_.bind_address.c_str(), &parsed) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics bind address \"", options_.bind_address,
                     "\" is not an IPv4 address"));
  }
  if (options_.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics server needs at least one thread, got ",
                     options_.num_threads));
  }
  absl::MutexLock lock(&mu_);
  if (context_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("metrics server already serving on port ", port_));
  }
  // civetweb wants one library-wide initialization, not thread-safe itself.
  static std::once_flag init_once;
  std::call_once(init_once, [] { mg_init_library(0); });

  const std::string listening =
      absl::StrCat(options_.bind_address, ":", options_.port);
  const std::string threads = absl::StrCat(options_.num_threads);
  const char* config[] = {
      "listening_ports",    listening.c_str(), "num_threads", threads.c_str(),
      "request_timeout_ms", "10000",           nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.log_message = &QuietLog;
  mg_init_data init;
  init.callbacks = &callbacks;
  init.user_data = nullptr;
  init.configuration_options = config;
  unsigned error_code = 0;
  char error_text[256] = {0};
  mg_error_data error;
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);

  std::string log;
  start_log = &log;
  mg_context* context = mg_start2(&init, &error);
  start_log = nullptr;
  if (context == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listening, ": ",
        error_text[0] != '\0' ? error_text : "civetweb failed to start",
        log.empty() ? "" : " (", log, log.empty() ? "" : ")"));
  }
  mg_server_port ports[4];
  const int count = mg_get_server_ports(context, 4, ports);
  int bound = 0;
  for (int i = 0; i < count; ++i) {
    if (ports[i].port > 0) {
      bound = ports[i].port;
      break;
    }
  }
  if (bound == 0) {
    mg_stop(context);
    return absl::InternalError(absl::StrCat(
        "metrics server on ", listening, " started but reports no bound port"));
  }
  mg_set_request_handler(context, "/", &MetricsHttpServer::OnRequest, this);
  context_ = context;
  port_ = bound;
  return absl::OkStatus();
}

void MetricsHttpServer::Stop() {
  mg_context* context;
  int port;
  {
    absl::MutexLock lock(&mu_);
    context = context_;
    port = port_;
    context_ = nullptr;
    port_ = 0;
  }
  // Outside the lock: stopping waits for request threads.
  if (context != nullptr) StopContext(context, options_.bind_address, port);
}

int MetricsHttpServer::port() const {
  absl::MutexLock lock(&mu_);
  return port_;
}

}  // namespace hap::metrics
