#include "common/grpc_util.h"

#include <sys/stat.h>

#include <algorithm>
#include <iostream>
#include <limits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/cli_args.h"
#include "common/proto_time.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "openssl/bio.h"
#include "openssl/err.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace hap::service {
namespace {

constexpr char kNeedToken[] =
    "this server requires a bearer token: pass --token-file (or HAP_TOKEN_FILE) with the "
    "token it was started with";

// Warns on stderr when users other than the owner and the owner's group
// may read or write the secret file `path` (ssh refuses such keys; we
// warn, as Kubernetes mounts secrets group-readable, 0440).
void WarnIfOthersCanAccess(const std::string& path, const char* what) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || (st.st_mode & (S_IROTH | S_IWOTH)) == 0) return;
  std::cerr << absl::StrFormat(
      "warning: %s '%s' can be %s by every user on this machine (mode %04o); chmod 600 (or "
      "440 for a group) it\n",
      what, path, (st.st_mode & S_IWOTH) != 0 ? "read and written" : "read", st.st_mode & 07777);
}

// Compares in a time that depends only on what the caller sent (its
// length), so that timing tells it nothing of the secret, its length
// included (as the metrics HTTP server's check). `want` is not empty.
bool SameSecret(absl::string_view got, absl::string_view want) {
  if (want.empty()) return false;
  unsigned char diff = got.size() != want.size() ? 1 : 0;
  for (size_t i = 0; i < got.size(); ++i) diff |= got[i] ^ want[i % want.size()];
  return diff == 0;
}

// InvalidArgument naming the files unless `cert_pem` holds a certificate
// (the first of the chain) and `key_pem` its private key: gRPC takes them
// unchecked, and a server started with a key of another certificate fails
// every TLS handshake with an error only the clients see.
absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem,
                                        const Security& s) {
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(
      BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr), &X509_free);
  // An encrypted key would make OpenSSL prompt for a passphrase on the
  // terminal: an empty one makes it fail instead.
  static char kNoPassphrase[] = "";
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(
      BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())), &BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, kNoPassphrase), &EVP_PKEY_free);
  const bool matches =
      cert != nullptr && key != nullptr && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();  // OpenSSL's error queue is per thread; leave it empty
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS certificate '", s.tls_cert_file,
                     "' holds no PEM certificate (\"-----BEGIN CERTIFICATE-----\")"));
  }
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS key '", s.tls_key_file,
        "' holds no PEM private key (or one encrypted with a passphrase, which is not supported)"));
  }
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat("TLS key '", s.tls_key_file,
                                                   "' does not match the certificate '",
                                                   s.tls_cert_file, "' (it is another's key)"));
  }
  return absl::OkStatus();
}

absl::string_view View(const grpc_slice& s) {
  return absl::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(s)),
                           GRPC_SLICE_LENGTH(s));
}

// The token check as gRPC core's server auth filter runs it: on a call's
// initial metadata, before the server asks for the request message, so a
// caller without the token is refused (UNAUTHENTICATED) having sent no
// more than the HTTP/2 flow-control window, which is discarded with the
// call. Methods in `open_paths` ("/package.Service/Method") pass without
// the token.
struct TokenCheck {
  std::string want;  // "Bearer <token>"
  std::vector<std::string> open_paths;
  std::function<void(absl::string_view)> on_refused;

  static void Process(void* state, grpc_auth_context*, const grpc_metadata* md, size_t n,
                      grpc_process_auth_metadata_done_cb done, void* user_data) {
    const auto* check = static_cast<const TokenCheck*>(state);
    bool pass = false;
    absl::string_view path;
    for (size_t i = 0; i < n && !pass; ++i) {
      const absl::string_view key = View(md[i].key);
      if (key == "authorization") {
        pass = SameSecret(View(md[i].value), check->want);
      } else if (key == ":path") {
        path = View(md[i].value);
        for (const std::string& open : check->open_paths) pass = pass || path == open;
      }
    }
    if (!pass && check->on_refused) {
      for (size_t i = 0; i < n && path.empty(); ++i) {
        if (View(md[i].key) == ":path") path = View(md[i].value);
      }
      check->on_refused(path);
    }
    // Nothing is consumed: the handlers' own CheckToken sees the token too.
    done(user_data, nullptr, 0, nullptr, 0, pass ? GRPC_STATUS_OK : GRPC_STATUS_UNAUTHENTICATED,
         pass ? nullptr : kNeedToken);
  }
  static void Destroy(void* state) { delete static_cast<TokenCheck*>(state); }
};

// Server credentials made with gRPC core's C API, which (unlike
// grpc::InsecureServerCredentials in gRPC 1.51) take an auth metadata
// processor on plaintext ports too.
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  explicit CoreServerCredentials(grpc_server_credentials* creds) : creds_(creds) {}
  ~CoreServerCredentials() override { grpc_server_credentials_release(creds_); }
  // The processor is set at creation (MakeServerCredentials); a C++ one is
  // not supported here.
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), creds_);
  }

  grpc_server_credentials* const creds_;
};

}  // namespace

absl::Status ParseRequest(const grpc::ByteBuffer& request, google::protobuf::MessageLite* msg) {
  std::vector<grpc::Slice> slices;
  if (grpc::Status s = request.Dump(&slices); !s.ok()) return FromGrpc(s);
  std::string joined;  // only when the request came in pieces
  absl::string_view bytes;
  if (slices.size() == 1) {
    bytes = absl::string_view(reinterpret_cast<const char*>(slices[0].begin()), slices[0].size());
  } else {
    for (const grpc::Slice& slice : slices) {
      joined.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    bytes = joined;
  }
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !msg->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a valid ", msg->GetTypeName()));
  }
  return absl::OkStatus();
}

grpc::ByteBuffer SharedBytes(std::shared_ptr<const std::string> bytes) {
  auto* holder = new std::shared_ptr<const std::string>(std::move(bytes));
  grpc::Slice slice(
      const_cast<char*>((*holder)->data()), (*holder)->size(),
      [](void* p) { delete static_cast<std::shared_ptr<const std::string>*>(p); }, holder);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  std::string message = s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // gRPC's transport messages say what broke, not what to change. The
    // client cannot tell a server that closed the connection at its
    // plaintext hello from one that went away, so that hint is an "if".
    if (absl::StrContains(message, "Socket closed")) {
      absl::StrAppend(&message,
                      " (if the server serves TLS, it closes plaintext connections like this: "
                      "give the client its CA bundle with --tls-ca-file)");
    } else if (absl::StrContains(message, "wrong version number")) {
      absl::StrAppend(&message,
                      " (the server does not serve TLS: connect without --tls-ca-file, or start "
                      "it with --tls-cert-file and --tls-key-file)");
    } else if (absl::StrContains(message, "http1.x server")) {
      absl::StrAppend(&message,
                      " (that address serves HTTP, not gRPC: a --metrics-listen port? the gRPC "
                      "one is --listen)");
    }
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), message);
}

absl::Time CallDeadline(const grpc::ServerContextBase* ctx,
                        const google::protobuf::Duration* timeout) {
  const auto d = ctx->deadline();
  const absl::Time call = d == std::chrono::system_clock::time_point::max() ? absl::InfiniteFuture()
                                                                            : absl::FromChrono(d);
  return timeout == nullptr ? call : std::min(call, absl::Now() + FromProto(*timeout));
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  if (path.empty()) return std::string();
  auto t = tools::ReadInputFile(path, "token file ", kMaxTokenFileBytes);
  if (!t.ok()) return t.status();
  std::string token(absl::StripAsciiWhitespace(*t));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  }
  // The token goes in a header value: a gRPC client given one with a line
  // break or a control byte aborts the process at its first call
  // ("validate_metadata: Illegal header value", then an assertion).
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token file '%s' must hold one line of printable ASCII, but byte %d of the token is "
          "0x%02x%s",
          path, i, c, c == '\n' ? " (a second line)" : ""));
    }
  }
  WarnIfOthersCanAccess(path, "token file");
  return token;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const Security& s, std::vector<std::string> open_methods,
    std::function<void(absl::string_view)> on_refused) {
  if (s.tls_cert_file.empty() != s.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key file");
  }
  grpc_server_credentials* creds = nullptr;
  if (s.tls_cert_file.empty()) {
    creds = grpc_insecure_server_credentials_create();
  } else {
    auto cert = tools::ReadInputFile(s.tls_cert_file, "TLS certificate ");
    if (!cert.ok()) return cert.status();
    auto key = tools::ReadInputFile(s.tls_key_file, "TLS key ");
    if (!key.ok()) return key.status();
    if (absl::Status match = CheckKeyMatchesCertificate(*cert, *key, s); !match.ok()) return match;
    WarnIfOthersCanAccess(s.tls_key_file, "TLS key");
    grpc_ssl_pem_key_cert_pair pair = {key->c_str(), cert->c_str()};
    creds = grpc_ssl_server_credentials_create_ex(
        nullptr, &pair, 1, GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE, nullptr);
  }
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("gRPC refused the server credentials (TLS certificate '", s.tls_cert_file,
                     "', key '", s.tls_key_file, "')"));
  }
  if (!s.token.empty()) {
    grpc_auth_metadata_processor processor;
    processor.process = &TokenCheck::Process;
    processor.destroy = &TokenCheck::Destroy;
    processor.state =
        new TokenCheck{"Bearer " + s.token, std::move(open_methods), std::move(on_refused)};
    grpc_server_credentials_set_auth_metadata_processor(creds, processor);
  }
  return std::shared_ptr<grpc::ServerCredentials>(new CoreServerCredentials(creds));
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const Security& s) {
  if (s.tls_ca_file.empty()) return grpc::InsecureChannelCredentials();
  auto ca = tools::ReadInputFile(s.tls_ca_file, "TLS CA bundle ");
  if (!ca.ok()) return ca.status();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = *ca;
  return grpc::SslCredentials(o);
}

grpc::Status CheckToken(const grpc::ServerContextBase* ctx, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const std::string want = "Bearer " + token;
  auto range = ctx->client_metadata().equal_range("authorization");
  for (auto it = range.first; it != range.second; ++it) {
    if (SameSecret(absl::string_view(it->second.data(), it->second.size()), want)) {
      return grpc::Status::OK;
    }
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kNeedToken);
}

void PrepareClientContext(grpc::ClientContext* ctx, const Security& s, absl::Duration timeout) {
  if (!s.token.empty()) ctx->AddMetadata("authorization", "Bearer " + s.token);
  if (timeout != absl::InfiniteDuration()) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
}

std::vector<std::pair<std::string, int>> KeepaliveArguments(absl::Duration every,
                                                            absl::Duration least) {
  const int every_ms = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(every), absl::ToInt64Milliseconds(least), int64_t{86400} * 1000));
  return {{GRPC_ARG_KEEPALIVE_TIME_MS, every_ms},
          {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, std::min(every_ms, 20'000)},
          {GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0}};
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const Security& s,
                                                           absl::Duration keepalive) {
  auto creds = MakeChannelCredentials(s);
  if (!creds.ok()) return creds.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Daemons reconnect to a restarted peer within seconds, not gRPC's
  // default of up to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  if (keepalive > absl::ZeroDuration()) {
    for (const auto& [name, value] : KeepaliveArguments(keepalive, kMinClientPingInterval)) {
      args.SetInt(name, value);
    }
  }
  return grpc::CreateCustomChannel(address, *creds, args);
}

}  // namespace hap::service
