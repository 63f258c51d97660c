// The bandwidth probe between in-process Agent servers on loopback, and the
// Agent service's checks (token, arguments).
#include "profiler_agent/link_probe.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_test_util.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hap/v1/agent_service.grpc.pb.h"
#include "profiler_agent/agent_service.h"

namespace hap::agent {
namespace {

using ::hap::service::FromGrpc;
using ::hap::service::Security;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;
namespace v1 = hap::v1;

// A profile that is whatever the test sets.
class StaticSource : public ProfileSource {
 public:
  std::optional<v1::ProbeResponse> profile;
  absl::StatusOr<v1::ProbeResponse> ProbeNow(absl::Duration, bool, absl::Time,
                                             const std::function<bool()>&) override {
    return LastProfile();
  }
  absl::StatusOr<v1::ProbeResponse> LastProfile() override {
    if (!profile) return absl::FailedPreconditionError("no probe yet");
    return *profile;
  }
};

// A raw Echo stream to an agent, for the service's own checks.
struct RawEcho {
  explicit RawEcho(const AgentServer& server, absl::Duration timeout = absl::Seconds(30)) {
    auto channel = hap::service::MakeChannel(server.address(), Security());
    EXPECT_THAT(channel, IsOk());
    stub = v1::Agent::NewStub(*channel);
    hap::service::PrepareClientContext(&ctx, Security(), timeout);
    stream = stub->Echo(&ctx);
  }
  // Sends `bytes` of payload and reads the answer; false once the stream ended.
  bool RoundTrip(int64_t bytes = 0, bool reply_small = true) {
    v1::EchoChunk chunk, reply;
    chunk.mutable_payload()->assign(static_cast<size_t>(bytes), 'x');
    chunk.set_reply_small(reply_small);
    return stream->Write(chunk) && stream->Read(&reply);
  }
  absl::Status Finish() {
    stream->WritesDone();
    return FromGrpc(stream->Finish());
  }
  std::unique_ptr<v1::Agent::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::EchoChunk, v1::EchoChunk>> stream;
};

// True once `n` echo streams of `server` wait for a turn (within 30 s).
bool WaitingBecomes(AgentServer& server, int n) {
  for (int i = 0; i < 6000 && server.service().echo_streams_waiting() != n; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  return server.service().echo_streams_waiting() == n;
}

class LinkProbeTest : public ::testing::Test {
 protected:
  std::unique_ptr<AgentServer> Serve(const std::string& token = "", EchoLimits limits = {}) {
    Security s;
    s.token = token;
    auto server = AgentServer::Start("127.0.0.1:0", s, &source_, limits);
    EXPECT_THAT(server, IsOk());
    return server.ok() ? std::move(*server) : nullptr;
  }
  // Echoes one stream at a time, each for at most `max_stream_duration`.
  std::unique_ptr<AgentServer> ServeOneStreamAtATime(absl::Duration max_stream_duration) {
    EchoLimits limits;
    limits.max_streams = 1;
    limits.max_stream_duration = max_stream_duration;
    return Serve("", limits);
  }
  StaticSource source_;
};

TEST_F(LinkProbeTest, MeasuresPositiveBandwidthAndLatencyBetweenTwoAgents) {
  auto a = Serve(), b = Serve();
  ASSERT_TRUE(a && b);
  auto ab = MeasureLink(b->address(), 4 << 20, Security());
  ASSERT_THAT(ab, IsOk());
  EXPECT_EQ(ab->bytes, 4 << 20);
  EXPECT_GT(ab->bandwidth_bytes_per_second, 1e6);
  EXPECT_GT(ab->latency_seconds, 0);
  EXPECT_LT(ab->latency_seconds, 1);
  EXPECT_EQ(b->service().echo_bytes_received(), 4 << 20);
  auto ba = MeasureLink(a->address(), 1 << 20, Security());
  ASSERT_THAT(ba, IsOk());
  EXPECT_EQ(a->service().echo_bytes_received(), 1 << 20);

  v1::Link link = MakeLink("a/cpu0", "b/cpu0", *ab, LinkKindBetween(a->address(), b->address()));
  EXPECT_EQ(link.src(), "a/cpu0");
  EXPECT_EQ(link.dst(), "b/cpu0");
  EXPECT_EQ(link.kind(), v1::LOOPBACK);
  EXPECT_EQ(link.bandwidth_bytes_per_second(), ab->bandwidth_bytes_per_second);
}

TEST_F(LinkProbeTest, RespectsTheByteCap) {
  auto b = Serve();
  ASSERT_TRUE(b);
  LinkProbeOptions o;
  o.max_bytes = 1 << 20;
  o.chunk_bytes = 300 << 10;  // a short last chunk
  auto m = MeasureLink(b->address(), int64_t{1} << 40, Security(), o);
  ASSERT_THAT(m, IsOk());
  EXPECT_EQ(m->bytes, 1 << 20);
  EXPECT_EQ(b->service().echo_bytes_received(), 1 << 20);
}

// A planner or peer asking for 1 byte would have the round trip timed and
// reported as a bandwidth (about 1 byte per round trip): the transfer is
// raised to the minimum, 1 MiB.
TEST_F(LinkProbeTest, ATinyAskIsRaisedToTheMinimumTransfer) {
  auto b = Serve();
  ASSERT_TRUE(b);
  auto m = MeasureLink(b->address(), 1, Security());
  ASSERT_THAT(m, IsOk());
  EXPECT_EQ(m->bytes, 1 << 20);
  EXPECT_EQ(b->service().echo_bytes_received(), 1 << 20);
}

TEST_F(LinkProbeTest, RejectsAMinimumTransferAboveTheCap) {
  LinkProbeOptions o;
  o.min_bytes = o.max_bytes + 1;
  EXPECT_THAT(MeasureLink("127.0.0.1:1", 1, Security(), o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("min_bytes must be within 1..max_bytes")));
}

TEST_F(LinkProbeTest, RejectsNonPositiveBytes) {
  EXPECT_THAT(MeasureLink("127.0.0.1:1", 0, Security()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be positive")));
}

TEST_F(LinkProbeTest, AnUnreachablePeerIsUnavailableNamingIt) {
  auto b = Serve();
  ASSERT_TRUE(b);
  std::string address = b->address();
  b->Shutdown(absl::ZeroDuration());
  b.reset();
  EXPECT_THAT(MeasureLink(address, 1024, Security()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(address)));
}

TEST_F(LinkProbeTest, EchoRejectsCallsWithoutTheToken) {
  auto b = Serve("s3cret");
  ASSERT_TRUE(b);
  EXPECT_THAT(MeasureLink(b->address(), 1024, Security()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bearer token")));
  Security wrong;
  wrong.token = "guess";
  EXPECT_THAT(MeasureLink(b->address(), 1024, wrong),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bearer token")));
  EXPECT_EQ(b->service().echo_bytes_received(), 0);

  Security right;
  right.token = "s3cret";
  EXPECT_THAT(MeasureLink(b->address(), 1024, right), IsOk());

  // The raw stream, too: the first read ends with UNAUTHENTICATED.
  auto channel = hap::service::MakeChannel(b->address(), Security());
  ASSERT_THAT(channel, IsOk());
  auto stub = v1::Agent::NewStub(*channel);
  grpc::ClientContext ctx;
  auto stream = stub->Echo(&ctx);
  v1::EchoChunk chunk;
  stream->Write(chunk);
  EXPECT_FALSE(stream->Read(&chunk));
  EXPECT_THAT(FromGrpc(stream->Finish()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bearer token")));
}

// Every method of hap.v1.Agent (Probe, GetProfile and the Echo stream)
// refuses a caller without the token or with a wrong one: on the agent's
// server (gRPC's auth filter), and in the service's own handlers (on a
// server without the filter).
TEST_F(LinkProbeTest, EveryAgentMethodRefusesCallsWithoutTheToken) {
  const auto* service = v1::EchoChunk::descriptor()->file()->FindServiceByName("Agent");
  ASSERT_NE(service, nullptr);
  auto b = Serve("s3cret");
  ASSERT_TRUE(b);
  auto channel = hap::service::MakeChannel(b->address(), Security());
  ASSERT_THAT(channel, IsOk());
  EXPECT_THAT(hap::service::testing::CallsNotRefused(*channel, *service, "s3cret"),
              ::testing::IsEmpty());

  AgentServiceImpl handlers(&source_, "s3cret");
  EXPECT_THAT(hap::service::testing::HandlerCallsNotRefused(&handlers, *service, "s3cret"),
              ::testing::IsEmpty());
  EXPECT_EQ(handlers.echo_bytes_received(), 0);
}

TEST_F(LinkProbeTest, EchoEchoesPayloadsUnlessReplySmall) {
  auto b = Serve();
  ASSERT_TRUE(b);
  auto channel = hap::service::MakeChannel(b->address(), Security());
  ASSERT_THAT(channel, IsOk());
  auto stub = v1::Agent::NewStub(*channel);
  grpc::ClientContext ctx;
  auto stream = stub->Echo(&ctx);
  v1::EchoChunk chunk, reply;
  chunk.set_payload("hello");
  ASSERT_TRUE(stream->Write(chunk));
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_EQ(reply.payload(), "hello");
  chunk.set_reply_small(true);
  ASSERT_TRUE(stream->Write(chunk));
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_EQ(reply.payload(), "");
  stream->WritesDone();
  EXPECT_THAT(FromGrpc(stream->Finish()), IsOk());
}

// Peers probing one agent at once take turns: max_streams are echoed,
// max_waiting wait, and one more is refused at once, rather than each
// taking a thread and its chunks' memory.
TEST_F(LinkProbeTest, EchoStreamsBeyondTheLimitWaitTheirTurnOrAreRefused) {
  EchoLimits limits;
  limits.max_streams = 1;
  limits.max_waiting = 1;
  auto b = Serve("", limits);
  ASSERT_TRUE(b);
  RawEcho first(*b);
  ASSERT_TRUE(first.RoundTrip());
  RawEcho second(*b);
  ASSERT_TRUE(second.stream->Write(v1::EchoChunk()));  // answered in its turn
  ASSERT_TRUE(WaitingBecomes(*b, 1));
  RawEcho third(*b);
  EXPECT_FALSE(third.RoundTrip());
  EXPECT_THAT(third.Finish(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("echo streams")));
  EXPECT_THAT(first.Finish(), IsOk());
  v1::EchoChunk reply;
  EXPECT_TRUE(second.stream->Read(&reply));
  EXPECT_THAT(second.Finish(), IsOk());
  EXPECT_EQ(b->service().echo_streams_waiting(), 0);
}

// A peer that gives up while its stream waits for a turn (its measurement's
// deadline passed, or it was stopped) frees its place in the queue at once:
// before, the stream waited on for its whole max_stream_duration, and a burst
// of peers that had given up kept the agent refusing every other one.
TEST_F(LinkProbeTest, AStreamWhosePeerGaveUpWhileWaitingLeavesTheQueue) {
  auto b = ServeOneStreamAtATime(absl::Hours(1));
  ASSERT_TRUE(b);
  RawEcho first(*b, absl::Hours(1));
  ASSERT_TRUE(first.RoundTrip());
  RawEcho second(*b, absl::Hours(1));
  ASSERT_TRUE(second.stream->Write(v1::EchoChunk()));
  ASSERT_TRUE(WaitingBecomes(*b, 1));
  second.ctx.TryCancel();
  EXPECT_TRUE(WaitingBecomes(*b, 0));
  EXPECT_THAT(first.Finish(), IsOk());
}

// A peer that stops reading keeps its turn no longer than
// max_stream_duration: the stream is cancelled and the next peer is echoed.
TEST_F(LinkProbeTest, AStreamWhosePeerStopsReadingIsCancelledAndFreesItsTurn) {
  auto b = ServeOneStreamAtATime(absl::Milliseconds(300));
  ASSERT_TRUE(b);
  RawEcho stalled(*b, absl::Seconds(40));
  v1::EchoChunk chunk, reply;
  chunk.mutable_payload()->assign(1 << 20, 'x');  // echoed back, never read
  while (stalled.stream->Write(chunk)) {
  }
  while (stalled.stream->Read(&reply)) {
  }
  EXPECT_THAT(FromGrpc(stalled.stream->Finish()),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("")));
  EXPECT_THAT(MeasureLink(b->address(), 1 << 20, Security()), IsOk());
}

// A chunk may be at most kMaxEchoChunkBytes (the server would otherwise hold
// up to 256 MiB a message, and as much again echoing it); MeasureLink cuts
// its chunks to that size.
TEST_F(LinkProbeTest, AnEchoChunkOverTheLimitIsRefused) {
  auto b = Serve();
  ASSERT_TRUE(b);
  RawEcho big(*b);
  EXPECT_FALSE(big.RoundTrip(kMaxEchoChunkBytes + 1, false));
  EXPECT_THAT(big.Finish(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("echo chunk may carry")));
  RawEcho huge(*b);  // refused by gRPC before the handler sees it
  EXPECT_FALSE(huge.RoundTrip(2 * kMaxEchoChunkBytes, false));
  EXPECT_THAT(huge.Finish(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("larger than max")));
  RawEcho fits(*b);
  EXPECT_TRUE(fits.RoundTrip(kMaxEchoChunkBytes, false));
  EXPECT_THAT(fits.Finish(), IsOk());
  LinkProbeOptions o;
  o.chunk_bytes = 4 * kMaxEchoChunkBytes;
  auto m = MeasureLink(b->address(), 2 * o.chunk_bytes, Security(), o);
  ASSERT_THAT(m, IsOk());
  EXPECT_EQ(m->bytes, 2 * o.chunk_bytes);
}

TEST_F(LinkProbeTest, ProbeAndGetProfileTranslateTheSource) {
  auto b = Serve();
  ASSERT_TRUE(b);
  auto channel = hap::service::MakeChannel(b->address(), Security());
  ASSERT_THAT(channel, IsOk());
  auto stub = v1::Agent::NewStub(*channel);
  v1::ProbeResponse r;
  {
    grpc::ClientContext ctx;
    EXPECT_THAT(FromGrpc(stub->GetProfile(&ctx, v1::GetProfileRequest(), &r)),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no probe")));
  }
  source_.profile.emplace();
  source_.profile->mutable_node()->set_name("b");
  {
    grpc::ClientContext ctx;
    ASSERT_THAT(FromGrpc(stub->GetProfile(&ctx, v1::GetProfileRequest(), &r)), IsOk());
    EXPECT_EQ(r.node().name(), "b");
  }
  v1::ProbeRequest bad;
  bad.mutable_max_duration()->set_seconds(-1);
  {
    grpc::ClientContext ctx;
    EXPECT_THAT(FromGrpc(stub->Probe(&ctx, bad, &r)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-negative")));
  }
  bad.mutable_max_duration()->set_seconds(3600);
  {
    grpc::ClientContext ctx;
    EXPECT_THAT(FromGrpc(stub->Probe(&ctx, bad, &r)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most")));
  }
}

// A second agent given the port of one that serves (two agents started with
// the same --listen) must fail to start, not share the port: gRPC binds with
// SO_REUSEPORT by default, and the kernel then splits the peers' calls
// between the two.
TEST_F(LinkProbeTest, APortAnotherAgentServesOnIsRefusedNamingIt) {
  auto first = Serve();
  ASSERT_TRUE(first);
  auto second = AgentServer::Start(first->address(), Security(), &source_);
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kUnavailable,
                               HasSubstr(absl::StrCat("cannot listen on '", first->address()))));
}

// A TCP connection to 127.0.0.1:`port` that sends nothing; closed (its
// file descriptor too) when destroyed.
class SilentConnection {
 public:
  explicit SilentConnection(int port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~SilentConnection() {
    if (fd_ >= 0) close(fd_);
  }
  bool connected() const { return connected_; }
  // True once the server closed the connection, within `timeout` (what it
  // sends before, its HTTP/2 settings, is read and dropped).
  bool ClosedByThePeer(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    char b[4096];
    while (absl::Now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) > 0 && read(fd_, b, sizeof(b)) <= 0) return true;
    }
    return false;
  }

 private:
  int fd_;
  bool connected_ = false;
};

// Peers that connect and send nothing (a port scanner, a wedged client,
// many at once) neither stop the agent serving nor keep their connections:
// gRPC let each hold a file descriptor for its 120 s handshake timeout, so a
// few hundred a minute used up a descriptor limit of 1,024 and the agent
// could no longer reach its planner.
TEST_F(LinkProbeTest, ConnectionsThatSendNothingAreClosedAndServingGoesOn) {
  auto b = Serve();
  ASSERT_TRUE(b);
  std::vector<std::unique_ptr<SilentConnection>> silent;
  for (int i = 0; i < 100; ++i) {
    silent.push_back(std::make_unique<SilentConnection>(b->port()));
    ASSERT_TRUE(silent.back()->connected());
  }
  RawEcho echo(*b);
  EXPECT_TRUE(echo.RoundTrip());
  EXPECT_THAT(echo.Finish(), IsOk());
  EXPECT_TRUE(silent.front()->ClosedByThePeer(absl::Seconds(40)));
}

TEST(LinkKindTest, LoopbackOnTheSameHostNetworkOtherwise) {
  EXPECT_EQ(LinkKindBetween("127.0.0.1:1", "127.0.0.2:2"), v1::LOOPBACK);
  EXPECT_EQ(LinkKindBetween("localhost:1", "127.0.0.1:2"), v1::LOOPBACK);
  EXPECT_EQ(LinkKindBetween("[::1]:1", "127.0.0.1:2"), v1::LOOPBACK);
  EXPECT_EQ(LinkKindBetween("node-a:1", "node-a:2"), v1::LOOPBACK);
  EXPECT_EQ(LinkKindBetween("node-a:1", "node-b:1"), v1::NETWORK);
  EXPECT_EQ(LinkKindBetween("10.0.0.1:1", "10.0.0.2:1"), v1::NETWORK);
}

}  // namespace
}  // namespace hap::agent
