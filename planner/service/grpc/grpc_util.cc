#include "planner/service/grpc/grpc_util.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace hap::service {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "'"));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  if (path.empty()) return std::string();
  auto t = ReadFile(path, "token file");
  if (!t.ok()) return t.status();
  std::string token(absl::StripTrailingAsciiWhitespace(*t));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  }
  return token;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const Security& s) {
  if (s.tls_cert_file.empty() != s.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key file");
  }
  if (s.tls_cert_file.empty()) return grpc::InsecureServerCredentials();
  auto cert = ReadFile(s.tls_cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(s.tls_key_file, "TLS key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions o;
  o.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const Security& s) {
  if (s.tls_ca_file.empty()) return grpc::InsecureChannelCredentials();
  auto ca = ReadFile(s.tls_ca_file, "TLS CA bundle");
  if (!ca.ok()) return ca.status();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = *ca;
  return grpc::SslCredentials(o);
}

grpc::Status CheckToken(const grpc::ServerContext* ctx, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const std::string want = "Bearer " + token;
  auto range = ctx->client_metadata().equal_range("authorization");
  for (auto it = range.first; it != range.second; ++it) {
    const grpc::string_ref& got = it->second;
    if (got.size() != want.size()) continue;
    unsigned char diff = 0;
    for (size_t i = 0; i < want.size(); ++i) diff |= got.data()[i] ^ want[i];
    if (diff == 0) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "this server requires a bearer token: pass --token-file (or "
                      "HAP_TOKEN_FILE) with the token it was started with");
}

void PrepareClientContext(grpc::ClientContext* ctx, const Security& s,
                          absl::Duration timeout) {
  if (!s.token.empty()) ctx->AddMetadata("authorization", "Bearer " + s.token);
  if (timeout != absl::InfiniteDuration()) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const Security& s) {
  auto creds = MakeChannelCredentials(s);
  if (!creds.ok()) return creds.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Daemons reconnect to a restarted peer within seconds, not gRPC's
  // default of up to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  return grpc::CreateCustomChannel(address, *creds, args);
}

}  // namespace hap::service
