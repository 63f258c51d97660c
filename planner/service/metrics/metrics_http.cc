// The server: one thread polls the listening socket and every connection
// (non-blocking reads of requests, writes of responses, deadlines), and a
// few threads compute responses. No client can hold a thread by being
// slow, and the memory of a connection is bounded (kMaxRequestBytes read,
// one response).
#include "planner/service/metrics/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace hap::metrics {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMetricsContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";
constexpr char kTextContentType[] = "text/plain; charset=utf-8";

// The request line and headers together.
constexpr size_t kMaxRequestBytes = 16 << 10;
// How long a closed response waits for the client to close, reading and
// dropping what it still sends (a request body), so that closing does not
// reset the connection before the client has read the response.
constexpr Clock::duration kDrainTime = std::chrono::seconds(1);
// Connections accepted per poll, so that a flood of connections does not
// starve the others.
constexpr int kAcceptsPerPoll = 64;

using TlsContext = std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)>;

// OpenSSL's oldest error on this thread, as text; the thread's error queue
// is left empty.
std::string TlsError() {
  const unsigned long e = ERR_get_error();
  char text[256] = "unknown error";
  if (e != 0) ERR_error_string_n(e, text, sizeof(text));
  ERR_clear_error();
  return text;
}

// The server context for `o`'s certificate and key (null without them).
absl::StatusOr<TlsContext> NewTlsContext(const MetricsHttpServerOptions& o) {
  TlsContext ctx(nullptr, &SSL_CTX_free);
  if (o.tls_cert_file.empty() && o.tls_key_file.empty()) return ctx;
  if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "metrics TLS needs both a certificate file and a key file, got one of them");
  }
  ctx.reset(SSL_CTX_new(TLS_server_method()));
  if (ctx == nullptr) {
    return absl::InternalError(absl::StrCat("cannot make a TLS context: ", TlsError()));
  }
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  // An encrypted key would make OpenSSL ask for its passphrase on the
  // terminal: no passphrase makes it fail instead.
  SSL_CTX_set_default_passwd_cb(ctx.get(), [](char*, int, int, void*) { return 0; });
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), o.tls_cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics TLS certificate '", o.tls_cert_file,
                                                   "' cannot be used: ", TlsError()));
  }
  // Read first, so that a key that is not one is told from another
  // certificate's (SSL_CTX_use_PrivateKey_file says "mismatch" for both).
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(BIO_new_file(o.tls_key_file.c_str(), "r"),
                                                    &BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      key_bio == nullptr
          ? nullptr
          : PEM_read_bio_PrivateKey(
                key_bio.get(), nullptr, [](char*, int, int, void*) { return 0; }, nullptr),
      &EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics TLS key '", o.tls_key_file,
                     "' cannot be used (not a PEM private key, or encrypted): ", TlsError()));
  }
  if (SSL_CTX_use_PrivateKey(ctx.get(), key.get()) != 1 ||
      SSL_CTX_check_private_key(ctx.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("metrics TLS key '", o.tls_key_file,
                                                   "' does not match the certificate '",
                                                   o.tls_cert_file, "'"));
  }
  // Responses are written as far as the socket takes them, and resumed
  // from where they stopped.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  return ctx;
}

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 414:
      return "URI Too Long";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Status";
  }
}

// A whole response that closes the connection.
std::string Response(int status, absl::string_view content_type, absl::string_view body,
                     bool send_body, const char* allow = nullptr,
                     const char* authenticate = nullptr) {
  std::string out = absl::StrCat(
      "HTTP/1.1 ", status, " ", Reason(status), "\r\nContent-Type: ", content_type,
      "\r\nContent-Length: ", body.size(), "\r\nCache-Control: no-store\r\nConnection: close\r\n");
  if (allow != nullptr) absl::StrAppend(&out, "Allow: ", allow, "\r\n");
  if (authenticate != nullptr) {
    absl::StrAppend(&out, "WWW-Authenticate: ", authenticate, "\r\n");
  }
  absl::StrAppend(&out, "\r\n");
  if (send_body) absl::StrAppend(&out, body);
  return out;
}

std::string Error(int status, absl::string_view why) {
  return Response(status, kTextContentType, absl::StrCat(why, "\n"), true);
}

// Compares in a time that depends only on what the client sent (its
// length), so that timing tells it nothing of the token, its length
// included. `want` is not empty.
bool SameSecret(absl::string_view got, absl::string_view want) {
  if (want.empty()) return false;
  unsigned char diff = got.size() != want.size() ? 1 : 0;
  for (size_t i = 0; i < got.size(); ++i) diff |= got[i] ^ want[i % want.size()];
  return diff == 0;
}

// Whether an Authorization header carries `token`: "Bearer <token>", or
// HTTP Basic with the token as the password (any user name), which is what
// browsers send when the page asks for credentials.
bool Authorized(const std::optional<std::string>& header, const std::string& token) {
  if (!header.has_value()) return false;
  // "<scheme> <credentials>", the scheme in any case (RFC 9110 11.1).
  const absl::string_view h = absl::StripAsciiWhitespace(*header);
  const size_t space = h.find(' ');
  if (space == absl::string_view::npos) return false;
  const absl::string_view scheme = h.substr(0, space);
  const absl::string_view credentials = absl::StripLeadingAsciiWhitespace(h.substr(space));
  if (absl::EqualsIgnoreCase(scheme, "Bearer")) {
    return SameSecret(credentials, token);
  }
  if (absl::EqualsIgnoreCase(scheme, "Basic")) {
    std::string decoded;
    if (!absl::Base64Unescape(credentials, &decoded)) return false;
    const size_t colon = decoded.find(':');
    return colon != std::string::npos &&
           SameSecret(absl::string_view(decoded).substr(colon + 1), token);
  }
  return false;
}

// RFC 9110 token characters (methods, header names).
bool IsToken(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) &&
        !absl::StrContains("!#$%&'*+-.^_`|~", c)) {
      return false;
    }
  }
  return true;
}

// The value of a hex digit, or -1.
int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decodes `in`; false on a bad escape or a NUL.
bool PercentDecode(absl::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    if (i + 2 >= in.size()) return false;
    const int high = HexDigit(in[i + 1]);
    const int low = HexDigit(in[i + 2]);
    if (high < 0 || low < 0 || (high == 0 && low == 0)) return false;
    out->push_back(static_cast<char>(high * 16 + low));
    i += 2;
  }
  return true;
}

// `path` (starting with '/') with "." and ".." segments resolved (none
// above the root) and empty segments dropped; a trailing slash stays.
std::string CleanPath(absl::string_view path) {
  std::vector<absl::string_view> kept;
  for (absl::string_view segment : absl::StrSplit(path, '/')) {
    if (segment.empty() || segment == ".") continue;
    if (segment == "..") {
      if (!kept.empty()) kept.pop_back();
      continue;
    }
    kept.push_back(segment);
  }
  std::string out = absl::StrCat("/", absl::StrJoin(kept, "/"));
  const bool trailing =
      absl::EndsWith(path, "/") || absl::EndsWith(path, "/.") || absl::EndsWith(path, "/..");
  if (trailing && !kept.empty()) out.push_back('/');
  return out;
}

}  // namespace

// What the reading thread takes from a request for the answering threads.
struct internal::HttpRequest {
  // Nonzero: answer this error instead (`error_text` says why).
  int error = 0;
  std::string error_text;
  std::string method;
  std::string path;  // decoded and cleaned
  std::optional<std::string> authorization;
};

namespace {

using Request = internal::HttpRequest;

Request Malformed(int status, absl::string_view why) {
  Request r;
  r.error = status;
  r.error_text = std::string(why);
  return r;
}

// Parses a request's line and headers (`head`, up to and including the
// empty line).
Request Parse(absl::string_view head) {
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  // The last two are the empty line and what follows its '\n'.
  lines.resize(lines.size() >= 2 ? lines.size() - 2 : 0);
  for (absl::string_view& line : lines) absl::ConsumeSuffix(&line, "\r");
  if (lines.empty()) return Malformed(400, "no request line");

  const std::vector<absl::string_view> parts = absl::StrSplit(lines[0], ' ');
  if (parts.size() != 3 || !IsToken(parts[0])) {
    return Malformed(400, "the request line is not METHOD TARGET HTTP/1.x");
  }
  const absl::string_view version = parts[2];
  if (version.size() != 8 || !absl::StartsWith(version, "HTTP/") ||
      !absl::ascii_isdigit(version[5]) || version[6] != '.' || !absl::ascii_isdigit(version[7])) {
    return Malformed(400, "the request line is not METHOD TARGET HTTP/1.x");
  }
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    return Malformed(505, "only HTTP/1.0 and HTTP/1.1 are served");
  }
  const absl::string_view target = parts[1];
  if (target.empty() || target[0] != '/') {
    return Malformed(400, "the request target must be a path");
  }
  for (char c : target) {
    if (c <= ' ' || c >= 0x7f || c == '#') {
      return Malformed(400, "the request target has a character not allowed");
    }
  }
  Request request;
  request.method = std::string(parts[0]);
  std::string decoded;
  if (!PercentDecode(target.substr(0, target.find('?')), &decoded)) {
    return Malformed(400, "the path has a bad %-escape");
  }
  request.path = CleanPath(decoded);

  std::optional<std::string> content_length;
  bool chunked = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const absl::string_view line = lines[i];
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || !IsToken(line.substr(0, colon))) {
      return Malformed(400, "a header line is not NAME: VALUE");
    }
    for (char c : line) {
      if ((static_cast<unsigned char>(c) < ' ' && c != '\t') || c == 0x7f) {
        return Malformed(400, "a header has a control character");
      }
    }
    const std::string name = absl::AsciiStrToLower(line.substr(0, colon));
    const std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    if (name == "authorization") {
      if (request.authorization.has_value()) {
        return Malformed(400, "more than one Authorization header");
      }
      request.authorization = value;
    } else if (name == "content-length") {
      uint64_t length;
      if (value.empty() || value.size() > 18 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return absl::ascii_isdigit(c); }) ||
          !absl::SimpleAtoi(value, &length) ||
          (content_length.has_value() && *content_length != value)) {
        return Malformed(400, "a bad Content-Length");
      }
      content_length = value;
    } else if (name == "transfer-encoding") {
      chunked = true;
    }
  }
  if (chunked && content_length.has_value()) {
    return Malformed(400, "both Content-Length and Transfer-Encoding");
  }
  return request;
}

// The end of the request's head in `in` (just past its empty line), or 0
// while it has not all arrived.
size_t HeadEnd(absl::string_view in) {
  for (size_t i = in.find('\n'); i != absl::string_view::npos; i = in.find('\n', i + 1)) {
    // A line that is empty, or only "\r": the previous one ended at i.
    if (i == 0) return 1;
    if (in[i - 1] == '\n') return i + 1;
    if (in[i - 1] == '\r' && (i == 1 || in[i - 2] == '\n')) return i + 1;
  }
  return 0;
}

}  // namespace

// One Start() .. Stop(): the listening socket, the connections and the
// threads.
class MetricsHttpServer::Serving {
 public:
  // Takes `listen_fd` (bound, listening, non-blocking) and `tls` (null:
  // plain HTTP).
  Serving(const MetricsHttpServer* server, int listen_fd, int wake_fd, TlsContext tls)
      : server_(server),
        listen_fd_(listen_fd),
        wake_fd_(wake_fd),
        tls_(std::move(tls)),
        // Clamped so that deadlines do not overflow.
        timeout_(std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(
            std::min(server->options_.request_timeout, absl::Hours(24))))) {
    loop_ = std::thread([this] { Loop(); });
    for (int i = 0; i < server_->options_.num_threads; ++i) {
      workers_.emplace_back([this] { Work(); });
    }
  }

  // Closes every connection and waits for running handlers.
  ~Serving() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      work_.SignalAll();
    }
    Wake();
    loop_.join();
    for (std::thread& t : workers_) t.join();
    close(wake_fd_);
    close(listen_fd_);
  }

 private:
  enum class State { kReading, kAnswering, kWriting, kDraining };
  struct Connection {
    int fd = -1;
    SSL* ssl = nullptr;  // with TLS
    // TLS must read (or write) before the call that wanted the other
    // direction can go on (the handshake, a renegotiation).
    bool tls_wants_read = false;
    bool tls_wants_write = false;
    State state = State::kReading;
    Clock::time_point deadline;
    std::string in;   // the request so far (kReading)
    std::string out;  // the response (kWriting)
    size_t written = 0;
  };
  struct Job {
    uint64_t id;
    Request request;
  };

  void Wake() {
    const uint64_t one = 1;
    // Fails only when the counter is full, which wakes the loop anyway.
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  bool Stopping() {
    absl::MutexLock lock(&mu_);
    return stopping_;
  }

  // Answering threads: take a request, compute its response, hand it back.
  void Work() {
    while (true) {
      Job job;
      {
        absl::MutexLock lock(&mu_);
        while (!stopping_ && jobs_.empty()) work_.Wait(&mu_);
        if (stopping_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::string response = server_->Answer(job.request);
      {
        absl::MutexLock lock(&mu_);
        answers_.emplace_back(job.id, std::move(response));
      }
      Wake();
    }
  }

  void Close(std::map<uint64_t, Connection>::iterator it) {
    SSL_free(it->second.ssl);
    close(it->second.fd);
    connections_.erase(it);
  }

  // After an SSL call on `c` returned `result` (<= 0): true when it waits
  // for the socket (which way: c.tls_wants_*), false when the connection
  // is over (the client closed, or a TLS error such as a client that does
  // not speak TLS).
  bool TlsWaits(Connection& c, int result) {
    const int e = SSL_get_error(c.ssl, result);
    ERR_clear_error();
    c.tls_wants_read = e == SSL_ERROR_WANT_READ;
    c.tls_wants_write = e == SSL_ERROR_WANT_WRITE;
    return c.tls_wants_read || c.tls_wants_write;
  }

  // Reads into `buffer`: the count (> 0); 0 when the client closed or the
  // connection failed; -1 when nothing can be read now.
  ssize_t Receive(Connection& c, char* buffer, size_t size) {
    if (c.ssl == nullptr) {
      const ssize_t n = recv(c.fd, buffer, size, 0);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? -1 : 0;
      return n;
    }
    const int n = SSL_read(c.ssl, buffer, static_cast<int>(size));
    if (n > 0) return n;
    return TlsWaits(c, n) ? -1 : 0;
  }

  // Writes from `data`: the count (> 0); 0 when the connection failed; -1
  // when nothing can be written now.
  ssize_t Send(Connection& c, const char* data, size_t size) {
    if (c.ssl == nullptr) {
      const ssize_t n = send(c.fd, data, size, MSG_NOSIGNAL);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? -1 : 0;
      return n;
    }
    const int n = SSL_write(c.ssl, data, static_cast<int>(std::min<size_t>(size, 1 << 20)));
    if (n > 0) return n;
    return TlsWaits(c, n) ? -1 : 0;
  }

  // Starts writing `response` to `c`.
  void Reply(Connection& c, std::string response) {
    c.state = State::kWriting;
    c.out = std::move(response);
    c.written = 0;
    c.in.clear();
    c.in.shrink_to_fit();
    c.deadline = Clock::now() + timeout_;
  }

  // The connection to close for a new one when all slots are taken: the
  // oldest that is sending its request or done, else the oldest being
  // written to; none while every one is being answered.
  std::map<uint64_t, Connection>::iterator Evictable() {
    auto writing = connections_.end();
    for (auto it = connections_.begin(); it != connections_.end(); ++it) {
      const State s = it->second.state;
      if (s == State::kReading || s == State::kDraining) return it;
      if (s == State::kWriting && writing == connections_.end()) writing = it;
    }
    return writing;
  }

  bool CanAdmit() {
    return static_cast<int>(connections_.size()) < server_->options_.max_connections ||
           Evictable() != connections_.end();
  }

  void Accept() {
    for (int i = 0; i < kAcceptsPerPoll && CanAdmit(); ++i) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: retry after a pause rather than spin.
          accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
        }
        return;
      }
      if (static_cast<int>(connections_.size()) >= server_->options_.max_connections) {
        Close(Evictable());
      }
      SSL* ssl = nullptr;
      if (tls_ != nullptr) {
        ssl = SSL_new(tls_.get());
        if (ssl == nullptr || SSL_set_fd(ssl, fd) != 1) {
          ERR_clear_error();
          SSL_free(ssl);
          close(fd);
          continue;
        }
        SSL_set_accept_state(ssl);  // the handshake runs in the first reads
      }
      Connection& c = connections_[next_id_++];
      c.fd = fd;
      c.ssl = ssl;
      c.deadline = Clock::now() + timeout_;
    }
  }

  // Reads what `c` sent; false when it is to be closed.
  bool Read(uint64_t id, Connection& c) {
    char buffer[4096];
    // At most 64 KiB a turn, so that one client cannot keep the loop.
    for (int turn = 0; turn < 16; ++turn) {
      const ssize_t n = Receive(c, buffer, sizeof(buffer));
      if (n == 0) return false;  // the client is gone (or done, draining)
      if (n < 0) return true;
      if (c.state == State::kDraining) continue;
      c.in.append(buffer, n);
      const size_t end = HeadEnd(c.in);
      if (end > kMaxRequestBytes || (end == 0 && c.in.size() > kMaxRequestBytes)) {
        const bool line_too_long = c.in.find('\n') > kMaxRequestBytes;
        Reply(c, line_too_long ? Error(414, "the request line is longer than 16 KiB")
                               : Error(431, "the request's headers take more than 16 KiB"));
        return Write(c);
      }
      if (end == 0) continue;
      Request request = Parse(absl::string_view(c.in).substr(0, end));
      if (request.error != 0) {
        Reply(c, Error(request.error, request.error_text));
        return Write(c);
      }
      c.state = State::kAnswering;
      {
        absl::MutexLock lock(&mu_);
        jobs_.push_back(Job{id, std::move(request)});
        work_.Signal();
      }
      return true;
    }
    return true;
  }

  // Writes what it can of `c`'s response; false when it is to be closed.
  bool Write(Connection& c) {
    while (c.written < c.out.size()) {
      const ssize_t n = Send(c, c.out.data() + c.written, c.out.size() - c.written);
      if (n == 0) return false;
      if (n < 0) return true;
      c.written += n;
    }
    // All sent: wait a little for the client to close first (with TLS,
    // having said so: close_notify, sent once, its answer not awaited).
    if (c.ssl != nullptr) {
      (void)SSL_shutdown(c.ssl);
      ERR_clear_error();
    }
    shutdown(c.fd, SHUT_WR);
    c.out.clear();
    c.out.shrink_to_fit();
    c.state = State::kDraining;
    c.deadline = Clock::now() + std::min(kDrainTime, timeout_);
    return true;
  }

  void TakeAnswers() {
    std::vector<std::pair<uint64_t, std::string>> answers;
    {
      absl::MutexLock lock(&mu_);
      answers.swap(answers_);
    }
    for (auto& [id, response] : answers) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      Reply(it->second, std::move(response));
      if (!Write(it->second)) Close(it);
    }
  }

  void Loop() {
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;  // of fds[2..]
    while (!Stopping()) {
      const Clock::time_point now = Clock::now();
      fds.clear();
      ids.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      const bool accepting = now >= accept_paused_until_ && CanAdmit();
      fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
      Clock::time_point next = now + std::chrono::seconds(1);
      if (!accepting && now < accept_paused_until_) {
        next = std::min(next, accept_paused_until_);
      }
      for (auto& [id, c] : connections_) {
        if (c.state == State::kAnswering) continue;
        short events = c.state == State::kWriting ? POLLOUT : POLLIN;
        if (c.tls_wants_read) events = POLLIN;
        if (c.tls_wants_write) events = POLLOUT;
        fds.push_back({c.fd, events, 0});
        ids.push_back(id);
        next = std::min(next, c.deadline);
      }
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now);
      const int ready = poll(fds.data(), fds.size(), std::max<int>(0, wait.count() + 1));
      if (ready < 0 && errno != EINTR) break;
      if (fds[0].revents != 0) {
        uint64_t count;
        (void)!read(wake_fd_, &count, sizeof(count));
        TakeAnswers();
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        if (fds[i + 2].revents == 0) continue;
        auto it = connections_.find(ids[i]);
        if (it == connections_.end()) continue;
        Connection& c = it->second;
        const bool keep = c.state == State::kWriting ? Write(c) : Read(it->first, c);
        if (!keep) Close(it);
      }
      const Clock::time_point after = Clock::now();
      for (auto it = connections_.begin(); it != connections_.end();) {
        auto current = it++;
        if (current->second.state != State::kAnswering && after >= current->second.deadline) {
          Close(current);
        }
      }
      if (fds[1].revents != 0) Accept();
    }
    for (auto& [id, c] : connections_) {
      SSL_free(c.ssl);
      close(c.fd);
    }
    connections_.clear();
  }

  const MetricsHttpServer* const server_;
  const int listen_fd_;
  const int wake_fd_;
  const TlsContext tls_;
  const Clock::duration timeout_;
  std::thread loop_;
  std::vector<std::thread> workers_;

  // The loop thread's own.
  std::map<uint64_t, Connection> connections_;  // by id: oldest first
  uint64_t next_id_ = 0;
  Clock::time_point accept_paused_until_;

  absl::Mutex mu_;
  absl::CondVar work_;  // a job or stopping_
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, std::string>> answers_ ABSL_GUARDED_BY(mu_);
};

std::string MetricsHttpServer::Answer(const Request& request) const {
  const absl::string_view path = request.path;
  const absl::string_view method = request.method;
  const bool is_metrics = path == "/metrics";
  const bool is_health = path == "/healthz";
  const HttpHandler* handler = is_metrics || is_health ? nullptr : FindHandler(path);
  if (!is_metrics && !is_health && handler == nullptr) {
    return Response(404, kTextContentType, "not found\n", method != "HEAD");
  }
  if (method != "GET" && method != "HEAD") {
    return Response(405, kTextContentType, "method not allowed\n", true, "GET, HEAD");
  }
  const bool send_body = method == "GET";
  if (is_health) return Response(200, kTextContentType, "ok", send_body);
  if (is_metrics) {
    return Response(200, kMetricsContentType, registry_->Serialize(), send_body);
  }
  if (!options_.token.empty() && !Authorized(request.authorization, options_.token)) {
    return Response(401, kTextContentType,
                    "this page needs the planner's token: send \"Authorization: Bearer "
                    "<token>\", or give the token as the password when the browser asks\n",
                    send_body, nullptr, "Basic realm=\"hap\", charset=\"UTF-8\"");
  }
  const HttpResponse response = (*handler)(path);
  if (response.status < 200 || response.status > 599 ||
      absl::StrContains(response.content_type, '\r') ||
      absl::StrContains(response.content_type, '\n')) {
    return Error(500, "the page's handler gave a bad status or content type");
  }
  return Response(response.status, response.content_type, response.body, send_body);
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
  if (serving_ != nullptr) {
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
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(options_.port));
  if (inet_pton(AF_INET, options_.bind_address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics bind address \"", options_.bind_address,
                     "\" is not an IPv4 address"));
  }
  if (options_.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics server needs at least one thread, got ",
                     options_.num_threads));
  }
  if (options_.max_connections < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics server needs at least one connection, got ", options_.max_connections));
  }
  if (options_.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics request timeout must be positive, got ",
                                                   absl::FormatDuration(options_.request_timeout)));
  }
  absl::StatusOr<TlsContext> tls = NewTlsContext(options_);
  if (!tls.ok()) return tls.status();
  if (*tls != nullptr) {
    static const bool sigpipe_ignored = [] {
      std::signal(SIGPIPE, SIG_IGN);
      return true;
    }();
    (void)sigpipe_ignored;
  }
  absl::MutexLock lock(&mu_);
  if (serving_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("metrics server already serving on port ", port_));
  }
  const std::string listening =
      absl::StrCat(options_.bind_address, ":", options_.port);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listening, ": socket: ", strerror(errno)));
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t length = sizeof(addr);
  const char* step = nullptr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    step = "bind";
  } else if (listen(fd, SOMAXCONN) != 0) {
    step = "listen";
  } else if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    step = "getsockname";
  }
  if (step != nullptr) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listening, ": ", step, ": ", strerror(error)));
  }
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listening, ": eventfd: ", strerror(error)));
  }
  serving_ = std::make_unique<Serving>(this, fd, wake, *std::move(tls));
  port_ = ntohs(addr.sin_port);
  return absl::OkStatus();
}

void MetricsHttpServer::Stop() {
  std::unique_ptr<Serving> serving;
  {
    absl::MutexLock lock(&mu_);
    serving = std::move(serving_);
    port_ = 0;
  }
  // Outside the lock: stopping waits for running handlers.
  serving.reset();
}

int MetricsHttpServer::port() const {
  absl::MutexLock lock(&mu_);
  return port_;
}

}  // namespace hap::metrics
