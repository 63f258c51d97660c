#include "profiler_agent/agent_service.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/proto_time.h"
#include "profiler_agent/link_probe.h"

namespace hap::agent {
namespace {

namespace v1 = hap::v1;

// How long a new connection may take to say what it is (a peer's handshake
// takes milliseconds).
constexpr absl::Duration kHandshakeTimeout = absl::Seconds(10);

std::string HostOf(const std::string& listen) {
  size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

}  // namespace

grpc::Status AgentServiceImpl::Probe(grpc::ServerContext* ctx, const v1::ProbeRequest* request,
                                     v1::ProbeResponse* response) {
  if (grpc::Status s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  const auto& d = request->max_duration();
  if (d.seconds() < 0 || d.nanos() < 0 || d.nanos() >= 1'000'000'000) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "max_duration must be a non-negative duration");
  }
  const absl::Duration max = service::FromProto(d);
  if (max > kMaxProbeDuration) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("max_duration must be at most ", absl::FormatDuration(kMaxProbeDuration),
                     ", got ", absl::FormatDuration(max)));
  }
  if (probe_calls_.fetch_add(1) >= kMaxProbeCalls) {
    probe_calls_.fetch_sub(1);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(kMaxProbeCalls,
                                     " probe calls are in progress on this agent (one probes, the "
                                     "others wait for it); ask again when they are done"));
  }
  // A caller that cancels (a client killed, a watch given up) was probed
  // for as one that waits: a whole probe, holding the probe lock.
  auto r = source_->ProbeNow(max, request->include_links(), hap::service::CallDeadline(ctx),
                             [ctx] { return ctx->IsCancelled(); });
  probe_calls_.fetch_sub(1);
  if (!r.ok()) return hap::service::ToGrpc(r.status());
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::GetProfile(grpc::ServerContext* ctx, const v1::GetProfileRequest*,
                                          v1::ProbeResponse* response) {
  if (grpc::Status s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  auto r = source_->LastProfile();
  if (!r.ok()) return hap::service::ToGrpc(r.status());
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::Echo(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::EchoChunk, v1::EchoChunk>* stream) {
  if (grpc::Status s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  {
    absl::MutexLock l(&echo_mu_);
    if (echo_running_ >= limits_.max_streams && echo_waiting_ >= limits_.max_waiting) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(echo_running_, " echo streams are running and ",
                                       echo_waiting_, " waiting, the most this agent takes"));
    }
    ++echo_waiting_;
    auto turn = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(echo_mu_) {
      return echo_running_ < limits_.max_streams;
    };
    // Until the turn, the call's deadline, max_stream_duration (at most a
    // day), or the peer giving up: a stream whose peer left waited on for
    // the whole time, and a burst of them kept every other peer refused.
    // Kept on the monotonic clock, and the peer looked at every 100 ms (a
    // synchronous handler is not told when its call is cancelled).
    const auto give_up =
        std::chrono::steady_clock::now() +
        absl::ToChronoNanoseconds(std::min({hap::service::CallDeadline(ctx) - absl::Now(),
                                            limits_.max_stream_duration, absl::Hours(24)}));
    bool got = turn();
    while (!got && !ctx->IsCancelled() && std::chrono::steady_clock::now() < give_up) {
      got = echo_mu_.AwaitWithTimeout(absl::Condition(&turn), absl::Milliseconds(100));
    }
    --echo_waiting_;
    if (!got && ctx->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the peer left while waiting for a turn");
    }
    if (!got) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("no turn among ", limits_.max_streams,
                                       " echo streams came before the deadline"));
    }
    ++echo_running_;
  }
  // A peer that stops reading (or writing) keeps its turn no longer.
  absl::Notification ended;
  std::thread watchdog([&] {
    if (!ended.WaitForNotificationWithTimeout(limits_.max_stream_duration)) ctx->TryCancel();
  });
  grpc::Status s = EchoChunks(stream);
  ended.Notify();
  watchdog.join();
  absl::MutexLock l(&echo_mu_);
  --echo_running_;
  return s;
}

grpc::Status AgentServiceImpl::EchoChunks(
    grpc::ServerReaderWriter<v1::EchoChunk, v1::EchoChunk>* stream) {
  v1::EchoChunk chunk;
  const v1::EchoChunk empty;
  int64_t total = 0;
  while (stream->Read(&chunk)) {
    const int64_t n = static_cast<int64_t>(chunk.payload().size());
    if (n > kMaxEchoChunkBytes) {
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("an echo chunk may carry at most ", kMaxEchoChunkBytes, " bytes, got ", n));
    }
    total += n;
    echo_bytes_ += n;
    if (total > kMaxEchoStreamBytes) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("an echo stream may carry at most ", kMaxEchoStreamBytes,
                                       " bytes; open a new stream"));
    }
    if (!stream->Write(chunk.reply_small() ? empty : chunk)) break;  // the peer left
  }
  return grpc::Status::OK;
}

int AgentServiceImpl::echo_streams_waiting() {
  absl::MutexLock l(&echo_mu_);
  return echo_waiting_;
}

absl::StatusOr<std::unique_ptr<AgentServer>> AgentServer::Start(
    const std::string& listen, const hap::service::Security& security, ProfileSource* source,
    EchoLimits limits) {
  auto creds = hap::service::MakeServerCredentials(security);
  if (!creds.ok()) return creds.status();
  std::unique_ptr<AgentServer> s(new AgentServer());
  s->service_ = std::make_unique<AgentServiceImpl>(source, security.token, limits);
  grpc::ServerBuilder b;
  b.AddListeningPort(listen, *creds, &s->port_);
  // gRPC binds with SO_REUSEPORT by default: a second agent (or any gRPC
  // server) given a port one serves on would bind it too, and the kernel
  // would split calls between them. A port in use fails the start instead.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // A connection that sends nothing (no HTTP/2 preface, no TLS hello) is
  // closed after this, not gRPC's 120 s: a few hundred such a minute held
  // enough file descriptors to leave none for the planner's calls.
  b.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                       static_cast<int>(absl::ToInt64Milliseconds(kHandshakeTimeout)));
  // Its requests are small but for Echo's chunks (their payload and a few
  // bytes of framing).
  b.SetMaxReceiveMessageSize(static_cast<int>(kMaxEchoChunkBytes) + 64);
  b.SetMaxSendMessageSize(hap::service::kMaxMessageBytes);
  b.RegisterService(s->service_.get());
  s->server_ = b.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", listen,
                     "' (want HOST:PORT with a port no other process uses, or port 0)"));
  }
  s->address_ = absl::StrCat(HostOf(listen), ":", s->port_);
  return s;
}

AgentServer::~AgentServer() { Shutdown(absl::ZeroDuration()); }

void AgentServer::Shutdown(absl::Duration deadline) {
  if (shut_down_.exchange(true) || !server_) return;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
  server_->Wait();
}

}  // namespace hap::agent
