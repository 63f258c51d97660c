#include "planner/service/metrics/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::metrics {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};

// Connects to 127.0.0.1:`port`; returns the socket or -errno.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -errno;
  // A stuck server fails the test instead of hanging it.
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int error = errno;
    close(fd);
    return -error;
  }
  return fd;
}

// Sends all of `bytes`; false on an error.
bool SendAll(int fd, absl::string_view bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += n;
  }
  return true;
}

absl::StatusOr<HttpResponse> ParseResponse(const std::string& raw);

// Sends `request` as it is on a new connection and parses the response,
// read to EOF.
absl::StatusOr<HttpResponse> FetchRaw(int port, absl::string_view request) {
  const int fd = Connect(port);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("connect to port ", port, ": ", strerror(-fd)));
  }
  if (!SendAll(fd, request)) {
    close(fd);
    return absl::InternalError(absl::StrCat("send: ", strerror(errno)));
  }
  std::string raw;
  char buffer[4096];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) break;
    if (n < 0) {
      close(fd);
      return absl::InternalError(absl::StrCat("recv: ", strerror(errno)));
    }
    raw.append(buffer, n);
  }
  close(fd);
  return ParseResponse(raw);
}

// A response as received, parsed.
absl::StatusOr<HttpResponse> ParseResponse(const std::string& raw) {
  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos) {
    return absl::InternalError(absl::StrCat("no header end in: ", raw));
  }
  HttpResponse response;
  response.body = raw.substr(header_end + 4);
  std::vector<std::string> lines =
      absl::StrSplit(raw.substr(0, header_end), "\r\n");
  // "HTTP/1.1 200 OK"
  std::vector<std::string> status_line = absl::StrSplit(lines[0], ' ');
  if (status_line.size() < 2 || !absl::StartsWith(status_line[0], "HTTP/") ||
      !absl::SimpleAtoi(status_line[1], &response.status)) {
    return absl::InternalError(absl::StrCat("bad status line: ", lines[0]));
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string::npos) continue;
    response.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
  }
  return response;
}

// A minimal HTTP/1.1 client: one request with "Connection: close".
absl::StatusOr<HttpResponse> Fetch(int port, const std::string& method, const std::string& path,
                                   const std::string& extra_headers = "") {
  return FetchRaw(port, absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1:", port,
                                     "\r\nConnection: close\r\n", extra_headers, "\r\n"));
}

class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    plans_ =
        registry_
            .AddCounterFamily("hap_plans_total", "Plans finished.", {"result"})
            .value();
    plans_->Get({"ok"}).value()->Increment(2);
    ASSERT_THAT(registry_.AddHistogram("hap_plan_duration_seconds",
                                       "Time to plan.", {1, 10}),
                IsOk());
  }

  // A started server with `options` and a page at "/" answering
  // "page <path>".
  std::unique_ptr<MetricsHttpServer> StartWithPage(const MetricsHttpServerOptions& options) {
    auto server = std::make_unique<MetricsHttpServer>(&registry_, options);
    EXPECT_THAT(server->AddHandler("/",
                                   [](absl::string_view path) {
                                     ::hap::metrics::HttpResponse r;
                                     r.body = absl::StrCat("page ", path);
                                     return r;
                                   }),
                IsOk());
    EXPECT_THAT(server->Start(), IsOk());
    return server;
  }

  MetricsRegistry registry_;
  Family<Counter>* plans_ = nullptr;
};

TEST_F(MetricsHttpServerTest, ServesMetricsOnAChosenPort) {
  MetricsHttpServer server(&registry_);
  EXPECT_EQ(server.port(), 0);
  ASSERT_THAT(server.Start(), IsOk());
  ASSERT_GT(server.port(), 0);

  absl::StatusOr<HttpResponse> response =
      Fetch(server.port(), "GET", "/metrics");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->headers["content-type"],
            "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(response->body, registry_.Serialize());
  EXPECT_EQ(response->headers["content-length"],
            absl::StrCat(response->body.size()));
  EXPECT_THAT(response->body, HasSubstr("hap_plans_total{result=\"ok\"} 2\n"));

  // Each scrape sees the current values.
  plans_->Get({"ok"}).value()->Increment();
  response = Fetch(server.port(), "GET", "/metrics");
  ASSERT_THAT(response, IsOk());
  EXPECT_THAT(response->body, HasSubstr("hap_plans_total{result=\"ok\"} 3\n"));
}

TEST_F(MetricsHttpServerTest, HealthzNotFoundAndMethods) {
  MetricsHttpServer server(&registry_);
  ASSERT_THAT(server.Start(), IsOk());

  absl::StatusOr<HttpResponse> health = Fetch(server.port(), "GET", "/healthz");
  ASSERT_THAT(health, IsOk());
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok");

  for (const char* path : {"/", "/metricsx", "/metrics/extra", "/nope"}) {
    absl::StatusOr<HttpResponse> missing = Fetch(server.port(), "GET", path);
    ASSERT_THAT(missing, IsOk()) << path;
    EXPECT_EQ(missing->status, 404) << path;
  }

  absl::StatusOr<HttpResponse> post = Fetch(server.port(), "POST", "/metrics");
  ASSERT_THAT(post, IsOk());
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(post->headers["allow"], "GET, HEAD");

  absl::StatusOr<HttpResponse> head = Fetch(server.port(), "HEAD", "/metrics");
  ASSERT_THAT(head, IsOk());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->body, "");

  // A query string does not change the path.
  absl::StatusOr<HttpResponse> query =
      Fetch(server.port(), "GET", "/metrics?name[]=hap_plans_total");
  ASSERT_THAT(query, IsOk());
  EXPECT_EQ(query->status, 200);
}

TEST_F(MetricsHttpServerTest, AddedHandlersServeTheirPatterns) {
  MetricsHttpServer server(&registry_);
  auto answer = [](const std::string& who) {
    return [who](absl::string_view path) {
      ::hap::metrics::HttpResponse r;
      r.status = path == "/status/missing" ? 404 : 200;
      r.body = absl::StrCat(who, " ", path);
      return r;
    };
  };
  ASSERT_THAT(server.AddHandler("/", answer("root")), IsOk());
  ASSERT_THAT(server.AddHandler("/status/", answer("subtree")), IsOk());
  ASSERT_THAT(server.AddHandler("/status", answer("exact")), IsOk());
  EXPECT_THAT(server.AddHandler("/status", answer("again")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already")));
  EXPECT_THAT(server.AddHandler("/metrics", answer("x")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("registry")));
  EXPECT_THAT(server.AddHandler("status", answer("x")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'/'")));
  EXPECT_THAT(server.AddHandler("/x", nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  ASSERT_THAT(server.Start(), IsOk());
  EXPECT_THAT(server.AddHandler("/late", answer("late")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("while serving")));

  const std::map<std::string, std::string> expected = {
      {"/", "root /"},
      {"/other", "root /other"},
      {"/status", "exact /status"},
      {"/status/", "subtree /status/"},
      {"/status/plans/a%20b?x=1", "subtree /status/plans/a b"},
  };
  for (const auto& [path, body] : expected) {
    absl::StatusOr<HttpResponse> r = Fetch(server.port(), "GET", path);
    ASSERT_THAT(r, IsOk()) << path;
    EXPECT_EQ(r->status, 200) << path;
    EXPECT_EQ(r->headers["content-type"], "text/html; charset=utf-8");
    EXPECT_EQ(r->body, body) << path;
  }
  absl::StatusOr<HttpResponse> missing = Fetch(server.port(), "GET", "/status/missing");
  ASSERT_THAT(missing, IsOk());
  EXPECT_EQ(missing->status, 404);
  absl::StatusOr<HttpResponse> post = Fetch(server.port(), "POST", "/status");
  ASSERT_THAT(post, IsOk());
  EXPECT_EQ(post->status, 405);
  // The registry's paths are not shadowed by "/".
  absl::StatusOr<HttpResponse> health = Fetch(server.port(), "GET", "/healthz");
  ASSERT_THAT(health, IsOk());
  EXPECT_EQ(health->body, "ok");
}

TEST_F(MetricsHttpServerTest, WithATokenAddedPagesNeedItAndMetricsStayOpen) {
  MetricsHttpServerOptions options;
  options.token = "s3cret";
  std::unique_ptr<MetricsHttpServer> started = StartWithPage(options);
  MetricsHttpServer& server = *started;
  // No token, a wrong one, a malformed header: 401 with a Basic challenge
  // (a browser then asks for the credentials), and nothing of the page.
  for (const std::string& header :
       {std::string(), std::string("Authorization: Bearer wrong\r\n"),
        std::string("Authorization: Bearer s3cret-but-longer\r\n"),
        std::string("Authorization: Basic !!!\r\n"),
        // "user:wrong"
        std::string("Authorization: Basic dXNlcjp3cm9uZw==\r\n"),
        std::string("Authorization: s3cret\r\n")}) {
    absl::StatusOr<HttpResponse> r =
        Fetch(server.port(), "GET", "/status", header);
    ASSERT_THAT(r, IsOk()) << header;
    EXPECT_EQ(r->status, 401) << header;
    EXPECT_EQ(r->headers["www-authenticate"],
              "Basic realm=\"hap\", charset=\"UTF-8\"");
    EXPECT_THAT(r->body, ::testing::Not(HasSubstr("page /status")));
  }
  // The token as a bearer token, or as a Basic password ("hap:s3cret").
  for (const std::string& header :
       {std::string("Authorization: Bearer s3cret\r\n"),
        std::string("Authorization: Basic aGFwOnMzY3JldA==\r\n")}) {
    absl::StatusOr<HttpResponse> r =
        Fetch(server.port(), "GET", "/status", header);
    ASSERT_THAT(r, IsOk()) << header;
    EXPECT_EQ(r->status, 200) << header;
    EXPECT_EQ(r->body, "page /status");
  }
  // Prometheus and load balancers need no token.
  absl::StatusOr<HttpResponse> metrics =
      Fetch(server.port(), "GET", "/metrics");
  ASSERT_THAT(metrics, IsOk());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->body, HasSubstr("hap_plans_total"));
  absl::StatusOr<HttpResponse> health = Fetch(server.port(), "GET", "/healthz");
  ASSERT_THAT(health, IsOk());
  EXPECT_EQ(health->status, 200);
}

TEST_F(MetricsHttpServerTest, TheAuthSchemeIsCaseInsensitive) {
  MetricsHttpServerOptions options;
  options.token = "s3cret";
  std::unique_ptr<MetricsHttpServer> server = StartWithPage(options);
  // RFC 9110: the scheme is case-insensitive, and may be followed by more
  // than one space.
  const std::map<std::string, int> expected = {
      {"bearer s3cret", 200},
      {"BEARER s3cret", 200},
      {"Bearer   s3cret", 200},
      {"basic aGFwOnMzY3JldA==", 200},
      // ":s3cret": an empty user name.
      {"BASIC OnMzY3JldA==", 200},
      {"bearer s3cre", 401},
      {"bearers3cret", 401},
      {"Bearer", 401},
  };
  for (const auto& [credentials, status] : expected) {
    absl::StatusOr<HttpResponse> r = Fetch(server->port(), "GET", "/status",
                                           absl::StrCat("Authorization: ", credentials, "\r\n"));
    ASSERT_THAT(r, IsOk()) << credentials;
    EXPECT_EQ(r->status, status) << credentials;
  }
}

TEST_F(MetricsHttpServerTest, TakenPortIsUnavailable) {
  MetricsHttpServer first(&registry_);
  ASSERT_THAT(first.Start(), IsOk());
  MetricsHttpServerOptions options;
  options.port = first.port();
  MetricsHttpServer second(&registry_, options);
  const absl::Status status = second.Start();
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr(absl::StrCat("127.0.0.1:", first.port()))));
  EXPECT_THAT(status.message(), HasSubstr("in use"));
  EXPECT_EQ(second.port(), 0);
  second.Stop();  // stopping a server that never started is fine
}

TEST_F(MetricsHttpServerTest, BadOptionsAndDoubleStart) {
  MetricsHttpServerOptions options;
  options.port = 70000;
  EXPECT_THAT(MetricsHttpServer(&registry_, options).Start(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("70000")));
  options.port = 0;
  options.bind_address = "localhost";
  EXPECT_THAT(MetricsHttpServer(&registry_, options).Start(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not an IPv4 address")));
  options.bind_address = "127.0.0.1";
  options.num_threads = 0;
  EXPECT_THAT(
      MetricsHttpServer(&registry_, options).Start(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("thread")));

  MetricsHttpServer server(&registry_);
  ASSERT_THAT(server.Start(), IsOk());
  EXPECT_THAT(server.Start(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                       HasSubstr("already serving")));
}

TEST_F(MetricsHttpServerTest, StopIsIdempotentAndClosesThePort) {
  MetricsHttpServer server(&registry_);
  ASSERT_THAT(server.Start(), IsOk());
  const int port = server.port();
  server.Stop();
  EXPECT_EQ(server.port(), 0);
  server.Stop();
  const int fd = Connect(port);
  if (fd >= 0) close(fd);
  EXPECT_EQ(fd, -ECONNREFUSED);

  // It can start again.
  ASSERT_THAT(server.Start(), IsOk());
  absl::StatusOr<HttpResponse> response =
      Fetch(server.port(), "GET", "/healthz");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status, 200);
}

TEST_F(MetricsHttpServerTest, DestructorStops) {
  int port = 0;
  {
    MetricsHttpServer server(&registry_);
    ASSERT_THAT(server.Start(), IsOk());
    port = server.port();
    ASSERT_THAT(Fetch(port, "GET", "/healthz"), IsOk());
  }
  const int fd = Connect(port);
  if (fd >= 0) close(fd);
  EXPECT_EQ(fd, -ECONNREFUSED);
}

// Connects and sends `partial` (possibly nothing) of a request, then stalls.
int Stall(int port, absl::string_view partial) {
  const int fd = Connect(port);
  EXPECT_GE(fd, 0) << strerror(-fd);
  if (fd >= 0) {
    EXPECT_TRUE(SendAll(fd, partial));
  }
  return fd;
}

// Whether the server closed `fd` (waits for it, up to Connect's timeout).
bool ClosedByServer(int fd) {
  char c;
  const ssize_t n = recv(fd, &c, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

TEST_F(MetricsHttpServerTest, StalledClientsDelayNeitherScrapesNorStop) {
  MetricsHttpServerOptions options;
  // Far longer than Fetch waits: a server that serves the stalled clients
  // first fails the fetches.
  options.request_timeout = absl::Minutes(10);
  MetricsHttpServer server(&registry_, options);
  ASSERT_THAT(server.Start(), IsOk());
  std::vector<int> stalled;
  for (int i = 0; i < 8; ++i) stalled.push_back(Stall(server.port(), ""));
  for (int i = 0; i < 4; ++i) {
    stalled.push_back(Stall(server.port(), "GET /metrics HTTP/1.1\r\nHo"));
  }
  for (const char* path : {"/metrics", "/healthz", "/metrics"}) {
    absl::StatusOr<HttpResponse> r = Fetch(server.port(), "GET", path);
    ASSERT_THAT(r, IsOk()) << path;
    EXPECT_EQ(r->status, 200) << path;
  }
  // Stopping does not wait for them, and closes them.
  server.Stop();
  for (int fd : stalled) {
    EXPECT_TRUE(ClosedByServer(fd));
    close(fd);
  }
}

TEST_F(MetricsHttpServerTest, AConnectionBeyondTheLimitClosesTheOldestStalled) {
  MetricsHttpServerOptions options;
  options.request_timeout = absl::Minutes(10);
  options.max_connections = 4;
  MetricsHttpServer server(&registry_, options);
  ASSERT_THAT(server.Start(), IsOk());
  std::vector<int> stalled;
  for (int i = 0; i < 20; ++i) stalled.push_back(Stall(server.port(), "GET"));
  absl::StatusOr<HttpResponse> r = Fetch(server.port(), "GET", "/healthz");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 200);
  // At most 4 connections were open at once: the oldest stalled ones made
  // room for the newer ones.
  for (size_t i = 0; i < stalled.size(); ++i) {
    if (i < stalled.size() - options.max_connections) {
      EXPECT_TRUE(ClosedByServer(stalled[i])) << i;
    }
    close(stalled[i]);
  }
}

TEST_F(MetricsHttpServerTest, MalformedRequestsGetA4xx) {
  MetricsHttpServerOptions options;
  options.token = "s3cret";
  std::unique_ptr<MetricsHttpServer> server = StartWithPage(options);
  const std::string ok_line = "GET /healthz HTTP/1.1\r\n";
  const std::vector<std::string> requests = {
      "\r\n\r\n",
      std::string("\x01\x02 \xff junk\r\n\r\n"),
      "GET /healthz\r\n\r\n",
      "GET /st atus HTTP/1.1\r\n\r\n",
      "GET  /healthz HTTP/1.1\r\n\r\n",
      "OPTIONS * HTTP/1.1\r\n\r\n",
      "GET http://127.0.0.1/status HTTP/1.1\r\n\r\n",
      "GET healthz HTTP/1.1\r\n\r\n",
      "GET /%zz HTTP/1.1\r\n\r\n",
      "GET /healthz%00 HTTP/1.1\r\n\r\n",
      "GET /healthz HTTP/1.1 extra\r\n\r\n",
      ok_line + "no colon\r\n\r\n",
      ok_line + "Bad Name: x\r\n\r\n",
      ok_line + ": no name\r\n\r\n",
      ok_line + "X: a\r\n folded\r\n\r\n",
      ok_line + "Content-Length: x\r\n\r\n",
      ok_line + "Content-Length: 99999999999999999999999\r\n\r\n",
      ok_line + "Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
      ok_line + "Transfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n0",
      "GET /status HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n"
      "Authorization: Bearer other\r\n\r\n",
      absl::StrCat("GET /", std::string(64 << 10, 'a'), " HTTP/1.1\r\n\r\n"),
      absl::StrCat(ok_line, "X: ", std::string(1 << 20, 'a'), "\r\n\r\n"),
  };
  for (const std::string& request : requests) {
    const std::string shown = request.substr(0, 80);
    absl::StatusOr<HttpResponse> r = FetchRaw(server->port(), request);
    EXPECT_THAT(r, IsOk()) << shown;
    if (!r.ok()) continue;
    EXPECT_GE(r->status, 400) << shown;
    EXPECT_LT(r->status, 500) << shown;
  }
  absl::StatusOr<HttpResponse> version = FetchRaw(server->port(), "GET /healthz HTTP/2.0\r\n\r\n");
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(version->status, 505);
  // The server still answers.
  absl::StatusOr<HttpResponse> health = Fetch(server->port(), "GET", "/healthz");
  ASSERT_THAT(health, IsOk());
  EXPECT_EQ(health->body, "ok");
}

TEST_F(MetricsHttpServerTest, AWebSocketUpgradeIsAnsweredLikeAnyRequest) {
  MetricsHttpServerOptions options;
  options.token = "s3cret";
  std::unique_ptr<MetricsHttpServer> server = StartWithPage(options);
  // What a browser sends to open a WebSocket; no "Connection: close".
  const std::string upgrade = absl::StrCat(
      "GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
      "Sec-WebSocket-Version: 13\r\n");
  absl::StatusOr<HttpResponse> r = FetchRaw(server->port(), absl::StrCat(upgrade, "\r\n"));
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 401);
  r = FetchRaw(server->port(), absl::StrCat(upgrade, "Authorization: Bearer s3cret\r\n\r\n"));
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "page /status");
}

// `request` sent over TLS to 127.0.0.1:`port`, the server's certificate
// verified against `ca_file` for the address 127.0.0.1; the response read
// to the end.
absl::StatusOr<HttpResponse> FetchTls(int port, absl::string_view request,
                                      const std::string& ca_file) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        &SSL_CTX_free);
  if (ctx == nullptr || SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr) != 1) {
    return absl::InternalError("cannot make the client's TLS context");
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  const int fd = Connect(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connect: ", strerror(-fd)));
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), &SSL_free);
  SSL_set_fd(ssl.get(), fd);
  X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()), "127.0.0.1");
  std::string raw;
  absl::Status status = absl::OkStatus();
  if (SSL_connect(ssl.get()) != 1) {
    status = absl::UnavailableError(absl::StrCat(
        "TLS handshake failed: ", ERR_error_string(ERR_get_error(), nullptr),
        " (verify: ", X509_verify_cert_error_string(SSL_get_verify_result(ssl.get())), ")"));
  } else if (SSL_write(ssl.get(), request.data(), static_cast<int>(request.size())) !=
             static_cast<int>(request.size())) {
    status = absl::InternalError("TLS write failed");
  } else {
    char buffer[4096];
    int n;
    while ((n = SSL_read(ssl.get(), buffer, sizeof(buffer))) > 0) raw.append(buffer, n);
  }
  ERR_clear_error();
  ssl.reset();
  close(fd);
  if (!status.ok()) return status;
  return ParseResponse(raw);
}

class MetricsHttpsTest : public MetricsHttpServerTest {
 protected:
  void SetUp() override {
    MetricsHttpServerTest::SetUp();
    dir_ = absl::StrCat(::testing::TempDir(), "/metrics_tls");
    ASSERT_EQ(std::system(absl::StrCat("rm -rf ", dir_, " && mkdir -p ", dir_).c_str()), 0);
    for (const char* name : {"a", "b"}) {
      ASSERT_EQ(std::system(absl::StrCat("openssl req -x509 -newkey rsa:2048 -nodes -keyout ", dir_,
                                         "/", name, ".key -out ", dir_, "/", name,
                                         ".pem -subj /CN=127.0.0.1 -addext "
                                         "subjectAltName=IP:127.0.0.1 -days 1 >/dev/null 2>&1")
                                .c_str()),
                0)
          << "openssl could not make a test certificate";
    }
  }
  std::string File(const std::string& name) const { return absl::StrCat(dir_, "/", name); }
  MetricsHttpServerOptions Tls() const {
    MetricsHttpServerOptions o;
    o.tls_cert_file = File("a.pem");
    o.tls_key_file = File("a.key");
    return o;
  }
  static std::string Get(int port, const std::string& path, const std::string& headers = "") {
    return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1:", port,
                        "\r\nConnection: close\r\n", headers, "\r\n");
  }

  std::string dir_;
};

// With a certificate and key the server speaks HTTPS: pages, the token
// check, /metrics and /healthz as over HTTP, and nothing to a client that
// does not speak TLS (which would have sent the token in clear).
TEST_F(MetricsHttpsTest, PagesAndMetricsAreServedOverTlsOnly) {
  MetricsHttpServerOptions options = Tls();
  options.token = "s3cret";
  std::unique_ptr<MetricsHttpServer> server = StartWithPage(options);
  const int port = server->port();
  absl::StatusOr<HttpResponse> page =
      FetchTls(port, Get(port, "/status", "Authorization: Bearer s3cret\r\n"), File("a.pem"));
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->body, "page /status");
  absl::StatusOr<HttpResponse> refused = FetchTls(port, Get(port, "/status"), File("a.pem"));
  ASSERT_THAT(refused, IsOk());
  EXPECT_EQ(refused->status, 401);
  absl::StatusOr<HttpResponse> metrics = FetchTls(port, Get(port, "/metrics"), File("a.pem"));
  ASSERT_THAT(metrics, IsOk());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->body, HasSubstr("hap_plans_total"));
  // Plain HTTP: closed unanswered.
  const int fd = Stall(port, Get(port, "/status", "Authorization: Bearer s3cret\r\n"));
  ASSERT_GE(fd, 0);
  std::string got;
  char buffer[512];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) got.append(buffer, n);
  close(fd);
  EXPECT_THAT(got, ::testing::Not(HasSubstr("HTTP/1.1")));
  EXPECT_THAT(got, ::testing::Not(HasSubstr("page")));
  // A client that does not trust the certificate (another's) fails its
  // handshake.
  EXPECT_THAT(FetchTls(port, Get(port, "/metrics"), File("b.pem")),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("TLS handshake failed")));
}

// TLS clients that stall in their handshake (connected, nothing sent, or
// half a request) hold no thread either.
TEST_F(MetricsHttpsTest, StalledTlsClientsDelayNoScrape) {
  MetricsHttpServerOptions options = Tls();
  options.request_timeout = absl::Minutes(10);
  MetricsHttpServer server(&registry_, options);
  ASSERT_THAT(server.Start(), IsOk());
  std::vector<int> stalled;
  for (int i = 0; i < 4; ++i) stalled.push_back(Stall(server.port(), ""));
  stalled.push_back(Stall(server.port(), std::string("\x16\x03\x01\x02\x00", 5)));
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<HttpResponse> r =
        FetchTls(server.port(), Get(server.port(), "/metrics"), File("a.pem"));
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(r->status, 200);
  }
  server.Stop();
  for (int fd : stalled) {
    EXPECT_TRUE(ClosedByServer(fd));
    close(fd);
  }
}

TEST_F(MetricsHttpsTest, ACertificateAndKeyThatCannotServeAreRefusedNamingThem) {
  MetricsHttpServerOptions options = Tls();
  options.tls_key_file.clear();
  EXPECT_THAT(MetricsHttpServer(&registry_, options).Start(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("both a certificate")));
  options = Tls();
  options.tls_cert_file = File("missing.pem");
  EXPECT_THAT(MetricsHttpServer(&registry_, options).Start(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("certificate '" + File("missing.pem") + "' cannot be used")));
  options = Tls();
  options.tls_key_file = File("a.pem");  // a certificate, not a key
  EXPECT_THAT(MetricsHttpServer(&registry_, options).Start(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("key '" + File("a.pem") + "' cannot be used")));
  options = Tls();
  options.tls_key_file = File("b.key");
  EXPECT_THAT(MetricsHttpServer(&registry_, options).Start(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("key '" + File("b.key") + "' does not match the certificate '" +
                                 File("a.pem") + "'")));
}

}  // namespace
}  // namespace hap::metrics
