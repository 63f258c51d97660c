// hap.v1.Agent over gRPC: a thin translator. Probe and GetProfile delegate
// to a ProfileSource (the daemon); Echo is the peer side of the bandwidth
// probe (link_probe.h). Every call is checked against the bearer token when
// one is set.
#ifndef HAP_PROFILER_AGENT_AGENT_SERVICE_H_
#define HAP_PROFILER_AGENT_AGENT_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "hap/v1/agent_service.grpc.pb.h"

namespace hap::agent {

// What the service reports. Implementations are thread-safe: calls arrive
// on gRPC's threads.
class ProfileSource {
 public:
  virtual ~ProfileSource() = default;
  // Probes now, within `max_duration` per device (zero = the configured
  // bound), and with peer links when `include_links`. DeadlineExceeded,
  // probing nothing, when `deadline` (the caller's) has passed by the time
  // the probes before it are done; with `include_links`, the planner's
  // error, probing nothing, when it cannot be asked whom to measure.
  // Cancelled once `cancelled()` says the caller has gone: probing nothing
  // when it went while queued, ending a probe that runs at its next run
  // (the last profile is kept), measuring no further peer.
  virtual absl::StatusOr<hap::v1::ProbeResponse> ProbeNow(
      absl::Duration max_duration, bool include_links, absl::Time deadline,
      const std::function<bool()>& cancelled) = 0;
  // The last profile; FailedPrecondition while there is none (before the
  // first probe finished, or naming the error of a probe that failed).
  virtual absl::StatusOr<hap::v1::ProbeResponse> LastProfile() = 0;
};

// Bounds on the Echo streams peers open (link_probe.h): peers probing this
// agent at once, or one that stops reading or writing, take a bounded number
// of threads, bytes and seconds.
struct EchoLimits {
  // Streams echoed at once; the others wait for a turn (measurements made
  // together would disturb each other).
  int max_streams = 4;
  // Streams waiting for a turn; one more is RESOURCE_EXHAUSTED at once.
  int max_waiting = 64;
  // A stream waits at most this long for its turn (RESOURCE_EXHAUSTED then)
  // and is cancelled this long after its turn began (MeasureLink's own
  // deadline is 30 s).
  absl::Duration max_stream_duration = absl::Seconds(60);
};

// Longest probe a caller may ask for.
inline constexpr absl::Duration kMaxProbeDuration = absl::Seconds(120);

// Probe calls in progress at once (one probes, the others wait for it); one
// more is RESOURCE_EXHAUSTED at once. Calls without a deadline queued
// without a bound before, each holding a server thread for a whole probe.
inline constexpr int kMaxProbeCalls = 4;

class AgentServiceImpl final : public hap::v1::Agent::Service {
 public:
  // `source` must outlive the service; `token` empty = no token required.
  AgentServiceImpl(ProfileSource* source, std::string token, EchoLimits limits = {})
      : source_(source), token_(std::move(token)), limits_(limits) {}

  grpc::Status Probe(grpc::ServerContext* ctx, const hap::v1::ProbeRequest* request,
                     hap::v1::ProbeResponse* response) override;
  grpc::Status GetProfile(grpc::ServerContext* ctx, const hap::v1::GetProfileRequest* request,
                          hap::v1::ProbeResponse* response) override;
  // Echoes each chunk, or answers it with an empty one when reply_small.
  // A stream that carries more than kMaxEchoStreamBytes in all, or a chunk
  // over kMaxEchoChunkBytes, is ended with RESOURCE_EXHAUSTED; EchoLimits
  // bound the streams at once and their time.
  grpc::Status Echo(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<hap::v1::EchoChunk, hap::v1::EchoChunk>* stream) override;

  // Payload bytes received by Echo since the start (all streams).
  int64_t echo_bytes_received() const { return echo_bytes_.load(); }
  // Echo streams waiting for a turn now.
  int echo_streams_waiting();

 private:
  // Echo's loop, in a stream's turn.
  grpc::Status EchoChunks(grpc::ServerReaderWriter<hap::v1::EchoChunk, hap::v1::EchoChunk>* stream);

  ProfileSource* source_;
  const std::string token_;
  const EchoLimits limits_;
  std::atomic<int64_t> echo_bytes_{0};
  std::atomic<int> probe_calls_{0};
  absl::Mutex echo_mu_;
  int echo_running_ ABSL_GUARDED_BY(echo_mu_) = 0;
  int echo_waiting_ ABSL_GUARDED_BY(echo_mu_) = 0;
};

// The service on a gRPC server of its own, for the daemon and tests.
class AgentServer {
 public:
  // Binds `listen` ("host:port", port 0 = any free one) with the server
  // credentials of `security` and starts serving. InvalidArgument/Unavailable
  // naming the address when it cannot bind.
  static absl::StatusOr<std::unique_ptr<AgentServer>> Start(const std::string& listen,
                                                            const hap::service::Security& security,
                                                            ProfileSource* source,
                                                            EchoLimits limits = {});
  ~AgentServer();  // Shutdown(zero)

  int port() const { return port_; }
  // The listen host with the bound port, e.g. "127.0.0.1:41235".
  const std::string& address() const { return address_; }
  AgentServiceImpl& service() { return *service_; }

  // Stops taking calls; calls in flight get until `deadline` from now, then
  // are cancelled. Idempotent.
  void Shutdown(absl::Duration deadline);

 private:
  AgentServer() = default;
  std::unique_ptr<AgentServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_AGENT_SERVICE_H_
