#include "profiler_agent/link_probe.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "hap/v1/agent_service.grpc.pb.h"

namespace hap::agent {
namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = hap::v1;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string HostOf(const std::string& address) {
  if (absl::StartsWith(address, "[")) {
    size_t end = address.find(']');
    return end == std::string::npos ? address : address.substr(1, end - 1);
  }
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

bool IsLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

// The stream's final status, with the peer named.
absl::Status Finished(grpc::ClientReaderWriter<v1::EchoChunk, v1::EchoChunk>* stream,
                      const std::string& peer, const char* phase) {
  absl::Status s = hap::service::FromGrpc(stream->Finish());
  if (s.ok()) {
    s = absl::UnavailableError("the peer closed the echo stream early");
  }
  return Annotate(s, absl::StrCat("measuring the link to ", peer, " (", phase, ")"));
}

}  // namespace

absl::StatusOr<LinkMeasurement> MeasureLink(const std::string& peer_address, int64_t bytes,
                                            const hap::service::Security& security,
                                            const LinkProbeOptions& options,
                                            grpc::ClientContext* ctx) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe to ", peer_address, ": bytes must be positive, got ", bytes));
  }
  if (options.min_bytes < 1 || options.min_bytes > options.max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe to ", peer_address, ": min_bytes must be within 1..max_bytes (",
                     options.max_bytes, "), got ", options.min_bytes));
  }
  const int64_t total = std::clamp(bytes, options.min_bytes, options.max_bytes);
  const int64_t chunk =
      std::max<int64_t>(1, std::min({options.chunk_bytes, kMaxEchoChunkBytes, total}));
  HAP_ASSIGN_OR_RETURN(auto channel, hap::service::MakeChannel(peer_address, security));
  auto stub = v1::Agent::NewStub(channel);
  grpc::ClientContext own;
  if (ctx == nullptr) {
    ctx = &own;
    hap::service::PrepareClientContext(ctx, security, options.timeout);
  }
  auto stream = stub->Echo(ctx);

  // Latency: empty round trips, echoed back.
  std::vector<double> round_trips;
  v1::EchoChunk empty, reply;
  for (int i = 0; i < std::max(1, options.latency_round_trips); ++i) {
    Clock::time_point t0 = Clock::now();
    if (!stream->Write(empty) || !stream->Read(&reply)) {
      return Finished(stream.get(), peer_address, "latency");
    }
    round_trips.push_back(SecondsSince(t0));
  }
  std::sort(round_trips.begin(), round_trips.end());
  const double rtt = round_trips[round_trips.size() / 2];

  // Bandwidth: chunks answered with empty chunks. One thread reads the
  // answers while this one writes, so neither side's buffers fill up.
  const int64_t chunks = (total + chunk - 1) / chunk;
  v1::EchoChunk data;
  data.set_reply_small(true);
  int64_t answers = 0;
  Clock::time_point t0 = Clock::now();
  std::thread reader([&] {
    v1::EchoChunk r;
    while (answers < chunks && stream->Read(&r)) ++answers;
  });
  bool write_failed = false;
  for (int64_t i = 0, sent = 0; i < chunks; ++i) {
    int64_t n = std::min(chunk, total - sent);
    data.mutable_payload()->assign(static_cast<size_t>(n), 'h');
    if (!stream->Write(data)) {
      write_failed = true;
      ctx->TryCancel();  // unblocks the reader
      break;
    }
    sent += n;
  }
  reader.join();
  const double elapsed = SecondsSince(t0);
  if (write_failed || answers < chunks) {
    return Finished(stream.get(), peer_address, "bandwidth");
  }
  stream->WritesDone();
  absl::Status end = hap::service::FromGrpc(stream->Finish());
  if (!end.ok()) {
    return Annotate(end, absl::StrCat("measuring the link to ", peer_address));
  }
  // The last answer arrives one round trip after the first byte left, plus
  // the transfer itself; subtract the round trip unless noise makes it
  // dominate (tiny transfers).
  double transfer = elapsed - rtt > 0.5 * elapsed ? elapsed - rtt : elapsed;
  LinkMeasurement m;
  m.bytes = total;
  m.bandwidth_bytes_per_second = static_cast<double>(total) / std::max(transfer, 1e-9);
  m.latency_seconds = rtt / 2;  // one way
  return m;
}

v1::LinkKind LinkKindBetween(const std::string& local_address, const std::string& peer_address) {
  std::string a = HostOf(local_address), b = HostOf(peer_address);
  if (a == b || (IsLoopback(a) && IsLoopback(b))) return v1::LOOPBACK;
  return v1::NETWORK;
}

v1::Link MakeLink(const std::string& src_device, const std::string& dst_device,
                  const LinkMeasurement& m, v1::LinkKind kind) {
  v1::Link l;
  l.set_src(src_device);
  l.set_dst(dst_device);
  l.set_bandwidth_bytes_per_second(m.bandwidth_bytes_per_second);
  l.set_latency_seconds(m.latency_seconds);
  l.set_kind(kind);
  return l;
}

}  // namespace hap::agent
