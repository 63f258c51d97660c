// What every HAP gRPC server and client shares: status conversion, the
// bearer token on every call, TLS credentials, and call contexts with
// deadlines. One convention for the planner, the agent and the executor.
#ifndef HAP_PLANNER_SERVICE_GRPC_GRPC_UTIL_H_
#define HAP_PLANNER_SERVICE_GRPC_GRPC_UTIL_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace hap::service {

grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);

struct Security {
  // When set, every call must carry "authorization: Bearer <token>";
  // servers answer UNAUTHENTICATED otherwise.
  std::string token;
  // Server: certificate chain and key (PEM files); both or neither.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Client: CA bundle (PEM) to verify the server; empty = plaintext.
  std::string tls_ca_file;
};

// Reads a token from a file (trailing whitespace dropped); empty path = "".
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const Security& s);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const Security& s);

// OK, or UNAUTHENTICATED when `token` is set and the call lacks it (the
// comparison takes the same time whatever the mismatch).
grpc::Status CheckToken(const grpc::ServerContext* ctx, const std::string& token);

// A client context with the token and a deadline.
void PrepareClientContext(grpc::ClientContext* ctx, const Security& s,
                          absl::Duration timeout);

// A channel to `address` ("host:port") with the security settings and a
// message size limit matching the servers'.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const Security& s);

// Largest request/response a server accepts (plans with rank programs of
// large clusters are tens of MiB).
inline constexpr int kMaxMessageBytes = 256 << 20;

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_GRPC_GRPC_UTIL_H_
