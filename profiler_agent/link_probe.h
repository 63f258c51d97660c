// The bandwidth probe, client side: time bounded transfers to a peer agent
// over its Agent.Echo stream (docs/design.md §8: the measured link matrix).
#ifndef HAP_PROFILER_AGENT_LINK_PROBE_H_
#define HAP_PROFILER_AGENT_LINK_PROBE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "hap/v1/cluster.pb.h"

namespace hap::agent {

struct LinkProbeOptions {
  // Whatever a caller (or the planner's assignment) asks, no more than this
  // is sent; the peer refuses larger streams too (kMaxEchoStreamBytes).
  int64_t max_bytes = int64_t{64} << 20;
  // A smaller ask is raised to this (at most max_bytes). A transfer of a few
  // bytes times the round trip, not the link: 1 byte over a 100 us round
  // trip "measures" 10 kB/s. Raising it, rather than refusing, keeps a
  // measurement when the planner's probe size is set too small or a peer
  // asks for 1 byte, at the cost of 1 MiB per peer.
  int64_t min_bytes = int64_t{1} << 20;
  // Payload per message.
  int64_t chunk_bytes = int64_t{1} << 20;
  // Empty round trips timed for the latency (the median is reported).
  int latency_round_trips = 5;
  // Deadline of the whole measurement.
  absl::Duration timeout = absl::Seconds(30);
};

// What a peer stream may carry in all; more is RESOURCE_EXHAUSTED.
inline constexpr int64_t kMaxEchoStreamBytes = int64_t{256} << 20;
// The largest chunk a peer takes (chunk_bytes above is cut to it); a larger
// message is RESOURCE_EXHAUSTED.
inline constexpr int64_t kMaxEchoChunkBytes = int64_t{4} << 20;

struct LinkMeasurement {
  double bandwidth_bytes_per_second = 0;
  double latency_seconds = 0;
  int64_t bytes = 0;  // payload actually sent
};

// Sends `bytes` held to [min_bytes, max_bytes] (at least one chunk) to the
// agent at `peer_address` in chunks the peer answers with empty ones, and
// times a few empty round trips. bandwidth = bytes / (transfer time - one
// latency). InvalidArgument for bytes <= 0 or min_bytes outside
// 1..max_bytes; the peer's status (UNAVAILABLE,
// UNAUTHENTICATED, DEADLINE_EXCEEDED...) with the address otherwise.
// `ctx`, when given, is the stream's context, prepared by the caller (token,
// deadline) and cancellable by it; otherwise one with the token of
// `security` and options.timeout is made.
absl::StatusOr<LinkMeasurement> MeasureLink(const std::string& peer_address, int64_t bytes,
                                            const hap::service::Security& security,
                                            const LinkProbeOptions& options = {},
                                            grpc::ClientContext* ctx = nullptr);

// LOOPBACK when both addresses name this host (the same host, or both
// loopback), NETWORK otherwise. Addresses are "host:port" or "[v6]:port".
hap::v1::LinkKind LinkKindBetween(const std::string& local_address,
                                  const std::string& peer_address);

hap::v1::Link MakeLink(const std::string& src_device, const std::string& dst_device,
                       const LinkMeasurement& m, hap::v1::LinkKind kind);

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_LINK_PROBE_H_
