// What every HAP gRPC server and client shares: status conversion, the
// bearer token on every call, TLS credentials, and call contexts with
// deadlines. One convention for the planner, the agent and the executor.
#ifndef HAP_COMMON_GRPC_UTIL_H_
#define HAP_COMMON_GRPC_UTIL_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/host_port.h"
#include "google/protobuf/duration.pb.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/grpcpp.h"

namespace hap::service {

grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);

// A server call's deadline (InfiniteFuture when the client set none), or
// `timeout` from now when one is given and sooner (a request's own wait
// bound, e.g. StoreGetRequest.timeout when set).
absl::Time CallDeadline(const grpc::ServerContextBase* ctx,
                        const google::protobuf::Duration* timeout = nullptr);

// grpc.health.v1.Health's methods, as paths.
inline std::vector<std::string> HealthMethods() {
  return {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"};
}

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

// Reads a token from a file (surrounding whitespace, the line end included,
// dropped); empty path = "". InvalidArgument for an empty token, a
// directory, or a token that is not one line of printable ASCII (it goes in
// a header); NotFound for a file it cannot read. Warns on stderr when every
// user may read the file (mode o+r or o+w), and one over
// kMaxTokenFileBytes.
inline constexpr int64_t kMaxTokenFileBytes = 64 << 10;
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Plaintext, or TLS with the certificate and key: InvalidArgument naming
// the files when one holds no PEM certificate / private key or the key is
// not the certificate's (checked here, at start, not at each handshake);
// a warning on stderr when every user may read the key. When `s.token` is set,
// every call without "authorization: Bearer <token>" is refused with
// UNAUTHENTICATED as its metadata arrives, before the server reads its
// request message (gRPC core's server auth filter), so that callers
// without the token cannot make the server buffer large requests. Methods
// in `open_methods` ("/package.Service/Method") are let through without
// it; by default the health checks, which load balancers call without
// credentials. Handlers still check the token (CheckToken) themselves.
// `on_refused`, when set, is called with the ":path" of each call refused
// there (gRPC core's thread; the path is the caller's, unchecked), which
// never reaches a handler: for the RPC metrics.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const Security& s, std::vector<std::string> open_methods = HealthMethods(),
    std::function<void(absl::string_view path)> on_refused = nullptr);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const Security& s);

// OK, or UNAUTHENTICATED when `token` is set and the call lacks it (the
// comparison takes the same time whatever the mismatch).
grpc::Status CheckToken(const grpc::ServerContextBase* ctx, const std::string& token);

// A client context with the token and a deadline.
void PrepareClientContext(grpc::ClientContext* ctx, const Security& s,
                          absl::Duration timeout);

// The channel arguments of keepalive pings every `every` (clamped to
// [`least`, a day]), as a client's channel and the planner's server both
// set them: each ping answered within min(every, 20 s), and pings go on
// while a call receives nothing (gRPC stops after 2 by default).
std::vector<std::pair<std::string, int>> KeepaliveArguments(absl::Duration every,
                                                            absl::Duration least);

// A channel to `address` ("host:port") with the security settings and a
// message size limit matching the servers'.
// `keepalive` > 0: while a call is open the client pings the server that
// often and fails the call (UNAVAILABLE) when a ping goes unanswered for as
// long, at most 20 s: a server whose host died or hung leaves no TCP reset,
// and a call without a deadline (hapctl watch) waited for ever. The server
// must take pings that often (the planner takes them down to once a second:
// kMinClientPingInterval).
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(
    const std::string& address, const Security& s, absl::Duration keepalive = absl::ZeroDuration());
inline constexpr absl::Duration kMinClientPingInterval = absl::Seconds(1);

// Largest message a client accepts and a server sends (plans with rank
// programs of large clusters are tens of MiB), and the executors' request
// limit (LoadPlan carries a plan).
inline constexpr int kMaxMessageBytes = 256 << 20;

// The planner's default request limit (hap-planner --max-request-bytes).
// Its largest requests are CreatePlans carrying a graph: a 48-layer GPT
// (GPT-2 XL's shape, 1.6 B parameters, 1303 ops) is 176 KB as a proto
// (480 KB as JSON; tests/planner_service_test.cc measures it), so 16 MiB
// admits graphs some 95 times that size while bounding what one
// authenticated call can make the planner buffer.
inline constexpr int kDefaultMaxRequestBytes = 16 << 20;

// Raw (ByteBuffer) handlers, which answer with bytes serialized once and
// shared rather than copying a message per call:
// The request parsed as `msg`; InvalidArgument naming its type when the
// bytes are not one.
absl::Status ParseRequest(const grpc::ByteBuffer& request, google::protobuf::MessageLite* msg);
// A response holding `bytes` without copying them: the buffer keeps them
// alive until gRPC has sent it.
grpc::ByteBuffer SharedBytes(std::shared_ptr<const std::string> bytes);

}  // namespace hap::service

#endif  // HAP_COMMON_GRPC_UTIL_H_
