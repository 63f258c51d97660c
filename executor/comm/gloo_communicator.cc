// The Gloo backend of the communicator (communicator.h). Gloo reports
// failures by throwing; every call into it (here and in call_agreement.cc)
// happens inside Guard(), which turns exceptions into statuses — nothing
// else in the project sees one.
#include <netdb.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "executor/comm/call_agreement.h"
#include "executor/comm/call_checks.h"
#include "executor/comm/communicator.h"
#include "executor/comm/dead_peer_watch.h"
#include "executor/comm/deadline.h"
#include "executor/runtime/bf16.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/math.h"
#include "gloo/reduce.h"
#include "gloo/transport/context.h"
#include "gloo/transport/tcp/address.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"

namespace hap::executor {
namespace {

// Thrown through Gloo by the store adapter (Gloo expects a store to throw),
// so that the store's own status, code included, reaches Guard intact.
struct StoreFailure : gloo::Exception {
  explicit StoreFailure(absl::Status s)
      : gloo::Exception(std::string(s.message())), status(std::move(s)) {}
  absl::Status status;
};

// Gloo's TCP transport reports every expiry as an IoException whose message
// says so ("Read timeout", "Timed out waiting ...", "Timeout waiting for
// memory region", "Application timeout caused pair closure"); any other
// IoException is a connection that broke.
bool IsTimeout(const std::string& message) {
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "timeout") ||
         absl::StrContains(lower, "timed out");
}

// Runs `fn`, mapping Gloo's exceptions to statuses named by `what`.
template <typename Fn>
absl::Status Guard(const std::string& what, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const StoreFailure& e) {
    return absl::Status(e.status.code(),
                        absl::StrCat(what, ": ", e.status.message()));
  } catch (const gloo::IoException& e) {
    std::string msg = e.what();
    if (IsTimeout(msg)) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": timed out waiting for a peer (", msg, ")"));
    }
    return LostPeerError(absl::StrCat(what, ": connection to a peer failed (", msg, ")"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": unknown failure in Gloo"));
  }
}

// `s` with `message` for its own, its payloads (LostPeerError's mark)
// kept.
absl::Status WithMessage(const absl::Status& s, absl::string_view message) {
  absl::Status out(s.code(), message);
  s.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// The key under which a connect try under `prefix` keeps `k`.
std::string RendezvousKey(const std::string& prefix, const std::string& k) {
  return absl::StrCat(prefix, "/", k);
}

size_t ElementSize(const TensorView& v) {
  return static_cast<size_t>(graph::DTypeBytes(v.dtype));
}

class GlooCommunicator : public Communicator {
 public:
  // `idle_loop_tid`, `peer_sockets`: Gloo's event-loop thread when it runs
  // at SCHED_IDLE (else 0) and the connections' sockets (DeadPeerWatch).
  GlooCommunicator(std::shared_ptr<gloo::Context> ctx, std::chrono::milliseconds timeout,
                   bool check_calls, pid_t idle_loop_tid, std::vector<int> peer_sockets)
      : ctx_(std::move(ctx)),
        timeout_(timeout),
        check_calls_(check_calls),
        watch_(idle_loop_tid, std::move(peer_sockets)) {}

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }

  absl::Status AllReduce(TensorView buf) override {
    HAP_RETURN_IF_ERROR(Usable("all-reduce"));
    HAP_RETURN_IF_ERROR(CheckAndAgree("all-reduce", AllReduceCall(buf)));
    if (buf.num_elements() == 0) return absl::OkStatus();
    return Run("all-reduce",
               [&] { AllReduceRaw(buf.data, buf.num_elements(), buf.dtype); });
  }

  absl::Status AllGather(TensorView in, TensorView out,
                         absl::Span<const int64_t> counts,
                         CommMethod method) override {
    HAP_RETURN_IF_ERROR(Usable("all-gather"));
    HAP_RETURN_IF_ERROR(
        CheckAndAgree("all-gather", AllGatherCall(in, out, counts, method, rank(), size())));
    const size_t es = ElementSize(in);
    std::vector<int64_t> off = Offsets(counts);
    if (method == CommMethod::kGrouped) {
      return Run("all-gather (grouped)", [&] {
        char* o = static_cast<char*>(out.data);
        std::memcpy(o + off[rank()] * es, in.data, counts[rank()] * es);
        for (int r = 0; r < size(); ++r) {
          if (counts[r] == 0) continue;
          gloo::BroadcastOptions opts(ctx_);
          opts.setOutput(reinterpret_cast<uint8_t*>(o + off[r] * es),
                         counts[r] * es);
          opts.setRoot(r);
          opts.setTimeout(timeout_);
          gloo::broadcast(opts);
        }
      });
    }
    const int64_t m = *std::max_element(counts.begin(), counts.end());
    if (m == 0) return absl::OkStatus();
    return Run("all-gather (padded)", [&] {
      std::vector<char> send(m * es, 0), recv(m * es * size());
      std::memcpy(send.data(), in.data, counts[rank()] * es);
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(reinterpret_cast<uint8_t*>(send.data()), send.size());
      opts.setOutput(reinterpret_cast<uint8_t*>(recv.data()), recv.size());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      for (int r = 0; r < size(); ++r) {
        std::memcpy(static_cast<char*>(out.data) + off[r] * es,
                    recv.data() + r * m * es, counts[r] * es);
      }
    });
  }

  absl::Status ReduceScatter(TensorView in, TensorView out,
                             absl::Span<const int64_t> counts,
                             CommMethod method) override {
    HAP_RETURN_IF_ERROR(Usable("reduce-scatter"));
    HAP_RETURN_IF_ERROR(CheckAndAgree("reduce-scatter",
                                      ReduceScatterCall(in, out, counts, method, rank(), size())));
    const size_t es = ElementSize(in);
    std::vector<int64_t> off = Offsets(counts);
    if (method == CommMethod::kGrouped) {
      return Run("reduce-scatter (grouped)", [&] {
        const int64_t m = *std::max_element(counts.begin(), counts.end());
        std::vector<char> scratch(std::max<int64_t>(m, 1) * es);
        for (int r = 0; r < size(); ++r) {
          if (counts[r] == 0) continue;
          std::vector<char> chunk(counts[r] * es);
          std::memcpy(chunk.data(), static_cast<char*>(in.data) + off[r] * es,
                      chunk.size());
          void* dst = r == rank() ? out.data : scratch.data();
          ReduceRaw(chunk.data(), dst, counts[r], in.dtype, r);
        }
      });
    }
    const int64_t m = *std::max_element(counts.begin(), counts.end());
    if (m == 0) return absl::OkStatus();
    return Run("reduce-scatter (padded)", [&] {
      // Every chunk padded to the largest; one all-reduce; keep ours.
      std::vector<char> buf(m * es * size(), 0);
      for (int r = 0; r < size(); ++r) {
        std::memcpy(buf.data() + r * m * es,
                    static_cast<char*>(in.data) + off[r] * es, counts[r] * es);
      }
      AllReduceRaw(buf.data(), m * size(), in.dtype);
      std::memcpy(out.data, buf.data() + rank() * m * es, counts[rank()] * es);
    });
  }

  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts,
                        TensorView out,
                        absl::Span<const int64_t> recv_counts) override {
    HAP_RETURN_IF_ERROR(Usable("all-to-all"));
    HAP_RETURN_IF_ERROR(
        CheckAndAgree("all-to-all", AllToAllCall(in, send_counts, out, recv_counts, size())));
    const size_t es = ElementSize(in);
    return Run("all-to-all", [&] {
      // Gloo wants non-null buffers even when a side is empty.
      uint8_t dummy_in = 0, dummy_out = 0;
      gloo::AlltoallvOptions opts(ctx_);
      // In bytes: the typed setters are the public ones.
      std::vector<int64_t> s, r;
      for (int64_t c : send_counts) s.push_back(c * static_cast<int64_t>(es));
      for (int64_t c : recv_counts) r.push_back(c * static_cast<int64_t>(es));
      opts.setInput(static_cast<uint8_t*>(in.data ? in.data : &dummy_in), s);
      opts.setOutput(static_cast<uint8_t*>(out.data ? out.data : &dummy_out),
                     r);
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    });
  }

  absl::Status Broadcast(TensorView buf, int root) override {
    HAP_RETURN_IF_ERROR(Usable("broadcast"));
    HAP_RETURN_IF_ERROR(CheckAndAgree("broadcast", BroadcastCall(buf, root, size())));
    if (buf.bytes() == 0) return absl::OkStatus();
    return Run("broadcast", [&] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(buf.data), buf.bytes());
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    HAP_RETURN_IF_ERROR(Usable("reduce"));
    HAP_RETURN_IF_ERROR(CheckAndAgree("reduce", ReduceCall(in, out, root, rank(), size())));
    if (in.num_elements() == 0) return absl::OkStatus();
    return Run("reduce", [&] {
      std::vector<char> copy(in.bytes()), scratch(in.bytes());
      std::memcpy(copy.data(), in.data, in.bytes());
      ReduceRaw(copy.data(), rank() == root ? out.data : scratch.data(),
                in.num_elements(), in.dtype, root);
    });
  }

  // A message starts with a header (its tag and byte size) on a stream of
  // headers per pair (HeaderSlot), which carries the bytes too when there
  // are at most kInlineBytes; larger bytes follow under PayloadSlot(tag).
  // The receiver learns the size before it posts a buffer for the bytes, so
  // none overflows: Gloo's event loop would throw past its thread and abort
  // the process. Each receiver keeps a header receive posted per peer it
  // has received from (Inbox), so headers, and small messages whole, go out
  // at once rather than waiting for the receiver to ask.
  absl::Status Send(TensorView buf, int peer, int64_t tag) override {
    HAP_RETURN_IF_ERROR(Usable("send"));
    HAP_RETURN_IF_ERROR(CheckPeer("send", peer, tag));
    return Run(absl::StrCat("send to rank ", peer, " under tag ", tag), [&] {
      const uint64_t bytes = static_cast<uint64_t>(buf.bytes());
      const bool inline_bytes = bytes <= kInlineBytes;
      PendingSend p;
      p.peer = peer;
      p.tag = tag;
      p.header.resize(sizeof(Header) + (inline_bytes ? bytes : 0));
      const Header h{static_cast<uint64_t>(tag), bytes};
      std::memcpy(p.header.data(), &h, sizeof(h));
      if (inline_bytes && bytes > 0) {
        std::memcpy(p.header.data() + sizeof(h), buf.data, bytes);
      }
      p.header_send = ctx_->createUnboundBuffer(p.header.data(), p.header.size());
      p.header_send->send(peer, HeaderSlot());
      if (!inline_bytes) {
        p.payload_send = ctx_->createUnboundBuffer(buf.data, bytes);
        p.payload_send->send(peer, PayloadSlot(tag));
      }
      pending_sends_.push_back(std::move(p));
    });
  }

  // A message of another size than `buf` is taken (into scratch memory
  // when its bytes come apart, so the next message under the tag is read
  // in order) and refused.
  absl::Status Recv(TensorView buf, int peer, int64_t tag) override {
    HAP_RETURN_IF_ERROR(Usable("receive"));
    HAP_RETURN_IF_ERROR(CheckPeer("receive", peer, tag));
    const std::string what = absl::StrCat("receive from rank ", peer, " under tag ", tag);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    Arrived m;
    HAP_RETURN_IF_ERROR(Run(what, [&] { m = NextHeader(peer, tag, deadline); }));
    const bool fits = m.bytes == static_cast<uint64_t>(buf.bytes());
    if (m.bytes <= kInlineBytes) {
      if (fits && m.bytes > 0) std::memcpy(buf.data, m.inline_bytes.data(), m.bytes);
    } else {
      std::vector<char> scratch;
      HAP_RETURN_IF_ERROR(Run(what, [&] {
        if (!fits) scratch.resize(m.bytes);
        auto payload = ctx_->createUnboundBuffer(fits ? buf.data : scratch.data(), m.bytes);
        payload->recv(peer, PayloadSlot(tag));
        if (!payload->waitRecv(MillisecondsLeft(deadline))) {
          throw gloo::IoException("receive aborted");
        }
      }));
    }
    if (!fits) {
      return Invalid(absl::StrCat(what, ": the message holds ", m.bytes,
                                  " bytes, the receiving buffer ", buf.bytes()));
    }
    return absl::OkStatus();
  }

  absl::Status WaitSends() override {
    if (!failed_.ok()) {
      // Unusable: drop the handles, so the buffers are not read later.
      pending_sends_.clear();
      return Usable("send");
    }
    // Drop every handle, even when one fails: the buffers go away.
    auto sends = std::move(pending_sends_);
    pending_sends_.clear();
    for (auto& p : sends) {
      HAP_RETURN_IF_ERROR(
          Run(absl::StrCat("waiting for the send to rank ", p.peer, " under tag ", p.tag), [&] {
            for (auto* ub : {p.header_send.get(), p.payload_send.get()}) {
              if (ub != nullptr && !ub->waitSend(timeout_)) {
                throw gloo::IoException("send aborted");
              }
            }
          }));
    }
    return absl::OkStatus();
  }

  // The agreement on the call is a barrier itself: every rank has sent its
  // description once it returns.
  absl::Status Barrier() override {
    HAP_RETURN_IF_ERROR(Usable("barrier"));
    return AgreeOnCall("barrier", BarrierCall());
  }

 private:
  static absl::Status Invalid(const std::string& m) {
    return absl::InvalidArgumentError(m);
  }

  static std::vector<int64_t> Offsets(absl::Span<const int64_t> counts) {
    std::vector<int64_t> off(counts.size(), 0);
    for (size_t i = 1; i < counts.size(); ++i)
      off[i] = off[i - 1] + counts[i - 1];
    return off;
  }

  // Sums `n` elements of `t` (float32, float64 or bfloat16) over ranks in
  // place.
  void AllReduceRaw(void* data, int64_t n, DType t) {
    gloo::AllreduceOptions opts(ctx_);
    opts.setTimeout(timeout_);
    if (t == DType::kFloat64) {
      SetSum<double>(opts, nullptr, data, n);
    } else if (t == DType::kBFloat16) {
      SetSumBf16(opts, nullptr, data, n);
    } else {
      SetSum<float>(opts, nullptr, data, n);
    }
    gloo::allreduce(opts);
  }

  // Sums `n` elements of `t` from every rank's `in` into `out` on `root`.
  void ReduceRaw(void* in, void* out, int64_t n, DType t, int root) {
    gloo::ReduceOptions opts(ctx_);
    opts.setTimeout(timeout_);
    opts.setRoot(root);
    if (t == DType::kFloat64) {
      SetSum<double>(opts, in, out, n);
    } else if (t == DType::kBFloat16) {
      SetSumBf16(opts, in, out, n);
    } else {
      SetSum<float>(opts, in, out, n);
    }
    gloo::reduce(opts);
  }

  // Typed buffers (no input: in place) and the elementwise sum over T.
  template <typename T, typename Options>
  static void SetSum(Options& opts, void* in, void* out, int64_t n) {
    if (in != nullptr) opts.setInput(static_cast<T*>(in), n);
    opts.setOutput(static_cast<T*>(out), n);
    using ReduceFn = void (*)(void*, const void*, const void*, size_t);
    opts.setReduceFunction(static_cast<ReduceFn>(&gloo::sum<T>));
  }
  // bfloat16 buffers (bits in uint16_t): each partial sum is computed in
  // float32 and rounded to bf16 (as NCCL's bf16 sum), so the result depends
  // on the order Gloo's algorithm adds in, as a bf16 all-reduce does.
  template <typename Options>
  static void SetSumBf16(Options& opts, void* in, void* out, int64_t n) {
    if (in != nullptr) opts.setInput(static_cast<uint16_t*>(in), n);
    opts.setOutput(static_cast<uint16_t*>(out), n);
    using ReduceFn = void (*)(void*, const void*, const void*, size_t);
    opts.setReduceFunction(static_cast<ReduceFn>(&SumBf16));
  }
  static void SumBf16(void* c, const void* a, const void* b, size_t n) {
    auto* z = static_cast<uint16_t*>(c);
    const auto* x = static_cast<const uint16_t*>(a);
    const auto* y = static_cast<const uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) z[i] = Bf16Bits(Bf16ToFloat(x[i]) + Bf16ToFloat(y[i]));
  }

  // Every call starts here, even one with nothing to send: after a failure
  // the group is out of step, so the communicator refuses all work. Argument
  // errors (InvalidArgument) are found before any traffic and do not count.
  absl::Status Usable(const std::string& what) const {
    if (failed_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the communicator failed earlier: ", failed_.message()));
  }

  // Runs a collective; remembers a failure. A wait that ran out while the
  // connection to some rank had broken is that lost peer: the rank waited
  // for is most likely waiting for the dead one itself, and whoever reads
  // the error (hap-launch's lost-peer marker, the planner's recovery)
  // should hear of the death, not of a hang.
  template <typename Fn>
  absl::Status Run(const std::string& what, Fn&& fn) {
    watch_.Begin();
    absl::Status s = Guard(what, std::forward<Fn>(fn));
    watch_.End();
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      if (std::optional<std::string> broken = BrokenConnection()) {
        s = LostPeerError(absl::StrCat(what, ": ", *broken, " (while waiting: ", s.message(), ")"));
      }
    }
    if (!s.ok()) {
      failed_ = s;
      watch_.Failed();
    }
    return s;
  }

  // The first rank whose connection has failed other than by a timeout
  // ("the connection to rank R failed (Gloo's reason)"), or nothing. A
  // pair keeps the exception that closed it and rethrows it to any new
  // operation. On a pair still open (Gloo closes them all when one of its
  // own waits runs out, not when ours do) the probe posts an empty receive
  // under a slot nothing sends to, which tells the peer so and nothing
  // else; the communicator takes no more work after a failure.
  std::optional<std::string> BrokenConnection() {
    auto probe = ctx_->createUnboundBuffer(nullptr, 0);
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) continue;
      auto& pair = ctx_->getPair(p);
      if (pair == nullptr) continue;
      try {
        pair->recv(probe.get(), ProbeSlot(), 0, 0);
      } catch (const gloo::IoException& e) {
        if (!IsTimeout(e.what())) {
          return absl::StrCat("the connection to rank ", p, " failed (", e.what(), ")");
        }
      } catch (const std::exception&) {
        // Anything else says nothing about the peer.
      }
    }
    return std::nullopt;
  }

  absl::Status CheckPeer(const char* what, int peer, int64_t tag) const {
    if (peer < 0 || peer >= size() || peer == rank()) {
      return Invalid(absl::StrCat(what, ": peer ", peer, " is not another of ", size(),
                                  " ranks (this is rank ", rank(), ")"));
    }
    if (tag < 0 || tag > 0xffffffffLL) {
      return Invalid(absl::StrCat(what, ": tag ", tag, " is outside [0, 2^32)"));
    }
    return absl::OkStatus();
  }
  // Point-to-point messages live under slot prefixes of their own, clear of
  // the collectives' (gloo/types.h uses 0x01-0x08): one for the headers,
  // one per tag for the bytes that do not fit in them.
  static uint64_t PayloadSlot(int64_t tag) {
    return gloo::Slot::build(0x40, static_cast<uint32_t>(tag));
  }
  static uint64_t HeaderSlot() { return gloo::Slot::build(0x41, 0); }
  // Never sent to: BrokenConnection's probe.
  static uint64_t ProbeSlot() { return gloo::Slot::build(0x42, 0); }

  // The bytes a header carries itself (sent at once, with no second
  // message; copied on both sides).
  static constexpr uint64_t kInlineBytes = 16 << 10;
  struct Header {
    uint64_t tag;
    uint64_t bytes;
  };

  // A send started and not yet waited for: its header (with the bytes when
  // inline; kept until sent) and the messages' handles.
  struct PendingSend {
    int peer = 0;
    int64_t tag = 0;
    std::vector<char> header;
    std::unique_ptr<gloo::transport::UnboundBuffer> header_send, payload_send;
  };

  // A header received and not yet taken by a Recv of its tag.
  struct Arrived {
    int64_t tag = 0;
    uint64_t bytes = 0;
    std::string inline_bytes;  // the bytes, when at most kInlineBytes
  };
  // The headers from one peer: one receive kept posted (once this rank has
  // received from the peer), and those that came for other tags.
  struct Inbox {
    std::vector<char> buffer;
    std::unique_ptr<gloo::transport::UnboundBuffer> receive;
    bool posted = false;
    std::deque<Arrived> arrived;
  };

  // The first header from `peer` under `tag`, waiting for headers (and
  // keeping those of other tags) until `deadline`. Throws as Gloo does.
  Arrived NextHeader(int peer, int64_t tag, std::chrono::steady_clock::time_point deadline) {
    Inbox& in = inboxes_[peer];
    for (auto it = in.arrived.begin(); it != in.arrived.end(); ++it) {
      if (it->tag == tag) {
        Arrived m = std::move(*it);
        in.arrived.erase(it);
        return m;
      }
    }
    if (in.receive == nullptr) {
      in.buffer.resize(sizeof(Header) + kInlineBytes);
      in.receive = ctx_->createUnboundBuffer(in.buffer.data(), in.buffer.size());
    }
    while (true) {
      if (!in.posted) {
        in.receive->recv(peer, HeaderSlot());
        in.posted = true;
      }
      if (!in.receive->waitRecv(MillisecondsLeft(deadline))) {
        throw gloo::IoException("receive aborted");
      }
      in.posted = false;
      Header h;
      std::memcpy(&h, in.buffer.data(), sizeof(h));
      Arrived m{static_cast<int64_t>(h.tag), h.bytes, ""};
      if (h.bytes <= kInlineBytes) m.inline_bytes.assign(in.buffer.data() + sizeof(h), h.bytes);
      // Posted again at once, so the peer's next header goes out as sent. A
      // peer that has closed its end since (its last message sent) fails
      // the post, not this message: the next receive from it reports that.
      try {
        in.receive->recv(peer, HeaderSlot());
        in.posted = true;
      } catch (const std::exception&) {
      }
      if (m.tag == tag) return m;
      in.arrived.push_back(std::move(m));
    }
  }

  // The agreement on the call (call_agreement.h): exchanges `call` with
  // every peer and checks that the calls match (InvalidArgument naming the
  // first difference, the communicator still usable). A peer that does not
  // answer fails as a collective does.
  absl::Status AgreeOnCall(const std::string& what, const Call& call) {
    if (size() == 1) return absl::OkStatus();
    if (!check_calls_) {
      // The barrier is the exchange; other calls go to Gloo as they are.
      if (call.kind != CallKind::kBarrier) return absl::OkStatus();
      return Run(what, [&] {
        gloo::BarrierOptions opts(ctx_);
        opts.setTimeout(timeout_);
        gloo::barrier(opts);
      });
    }
    std::vector<EncodedCall> calls;
    HAP_RETURN_IF_ERROR(Run(what, [&] { calls = agreement_.Exchange(call); }));
    return CheckCallsMatch(what, calls);
  }

  // A collective's start: its own checks (call_checks.h), then the
  // agreement on the call they describe, or the refusal told to the peers.
  absl::Status CheckAndAgree(const std::string& what, const absl::StatusOr<Call>& call) {
    if (!call.ok()) return Refuse(what, call.status());
    return AgreeOnCall(what, *call);
  }

  // `own`, a refusal of this rank's call by its own checks, told to the
  // peers (as the call kRefused) so that they end InvalidArgument at once
  // rather than wait for the call until the timeout; the group stays in
  // step. Without check_calls the peers are not told.
  absl::Status Refuse(const std::string& what, absl::Status own) {
    if (!check_calls_ || size() == 1) return own;
    absl::Status told = Run(what, [&] { agreement_.Exchange(RefusedCall()); });
    if (!told.ok()) {
      return absl::Status(
          own.code(),
          absl::StrCat(own.message(), " (telling the other ranks failed: ", told.message(), ")"));
    }
    return own;
  }

  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  bool check_calls_ = true;  // GlooOptions::check_calls
  absl::Status failed_;
  // Sends started and not yet waited for (WaitSends).
  std::vector<PendingSend> pending_sends_;
  // By peer; after ctx_, so that they go first.
  std::vector<Inbox> inboxes_ = std::vector<Inbox>(ctx_->size);
  // The exchange of the calls (its buffers, filled at the first call).
  // After ctx_, so that they go first.
  CallAgreement agreement_{ctx_, timeout_};
  // After ctx_: stops watching before the loop thread can end.
  DeadPeerWatch watch_;
};

// "; ranks 2, 3 never published their address": Gloo's full-mesh rendezvous
// keys each rank's address by its decimal rank, so after a timed-out connect
// the ranks whose key is still absent are the ones that did not show up.
// Empty when none is missing any more (a peer that came late).
std::string MissingRanks(RendezvousStore& store, const std::string& prefix,
                         const GlooOptions& o) {
  std::vector<int> missing;
  for (int r = 0; r < o.size; ++r) {
    if (r == o.rank) continue;
    if (!store.Get(RendezvousKey(prefix, std::to_string(r)), absl::ZeroDuration()).ok()) {
      missing.push_back(r);
    }
  }
  if (missing.empty()) return "";
  return absl::StrCat("; rank", missing.size() > 1 ? "s " : " ",
                      absl::StrJoin(missing, ", "), " never published ",
                      missing.size() > 1 ? "their" : "its", " address");
}

// Gloo's TCP device starts one event-loop thread. Its handler only
// try-locks a connection: while the rank's own thread holds that lock (in
// a send), the loop sees the socket still readable and spins on
// epoll_wait. With a rank pinned to one core, the spinning loop preempts
// the rank's thread and runs out its time slice: 3.5 ms per 4 KiB
// all-reduce between two pinned ranks, 0.4 ms unpinned (bench/comm_bench).
// At SCHED_IDLE the loop thread runs only when the rank's own threads
// wait, which is when collectives need it (our collectives are
// synchronous). It goes there once the mesh is up (ConnectOnce): while the
// ranks connect it accepts their connections, and made at SCHED_IDLE (as
// it was, from a SCHED_IDLE thread) two ranks took 45 to 72 s to connect,
// or timed out, with one pinned beside 32 busy threads (0.3 to 0.6 s at
// the normal policy). The device is made by a thread of a name of its
// own, which the loop thread inherits: so it is told from the threads
// others start meanwhile, and renamed "hap-gloo-loop".
struct TcpDevice {
  std::shared_ptr<gloo::transport::Device> device;
  // Its event-loop thread, to run at SCHED_IDLE once connected; 0 for
  // none (idle_loop false, or the thread was not found).
  pid_t idle_loop_tid = 0;
};

TcpDevice CreateTcpDevice(const gloo::transport::tcp::attr& attr, bool idle_loop) {
  if (!idle_loop) return {gloo::transport::tcp::CreateDevice(attr), 0};
  constexpr char kCreator[] = "hap-gloo-device";  // at most 15 characters
  TcpDevice out;
  std::exception_ptr failure;
  std::thread creator([&] {
    // One device at a time: each creator has the same name.
    static absl::Mutex one_at_a_time(absl::kConstInit);
    absl::MutexLock l(&one_at_a_time);
    const bool named = pthread_setname_np(pthread_self(), kCreator) == 0;
    const std::set<pid_t> before = named ? ThreadIds() : std::set<pid_t>();
    try {
      out.device = gloo::transport::tcp::CreateDevice(attr);
    } catch (...) {
      failure = std::current_exception();
      return;
    }
    if (!named) return;
    std::vector<pid_t> added;
    for (pid_t id : ThreadIds()) {
      if (!before.count(id) && ThreadName(id) == kCreator) added.push_back(id);
    }
    if (added.size() != 1) return;
    out.idle_loop_tid = added[0];
    (void)SetThreadName(out.idle_loop_tid, "hap-gloo-loop");
  });
  creator.join();
  if (failure) std::rethrow_exception(failure);
  return out;
}

// A Gloo context whose connections we make ourselves (ConnectOnce), so
// that a try can be abandoned while a pair still waits for its peer.
class MeshContext : public gloo::Context {
 public:
  MeshContext(int rank, int size) : gloo::Context(rank, size) {}
  void Adopt(std::shared_ptr<gloo::transport::Device> dev,
             std::shared_ptr<gloo::transport::Context> transport) {
    device_ = std::move(dev);
    transportContext_ = std::move(transport);
  }
};

// Watches the store for the abort key of a try while this rank is still
// connecting. A rank whose try broke publishes the key before it tries
// again; a rank here may be waiting, as the listening side of a pair, for
// a connection the broken rank will never make, and Gloo would let it wait
// out the whole timeout. On the key, the watcher closes the pair this
// rank's connect waits for (Connecting), which ends such a wait at once;
// the try then fails (Unavailable) and this rank follows the others to the
// next one. The watcher closes that pair at the try's deadline too
// (expired()): Gloo waits five times its timeout for a pair's connection,
// each pair in turn, so a rank that published its address and died would
// hold this rank far past its timeout. And once the store says its user
// gave up (RendezvousStore::Cancelled, a stopped training run:
// cancelled()), which the wait for a connection never asks. A try given up
// while no pair was connecting (between two) connects no more pairs:
// Connecting refuses, since the watcher, whose watch has ended, would
// close none.
//
// Only that pair: Pair::close() sets SO_LINGER 0, so the kernel resets a
// connection that is established, also one whose peer's Gloo has not
// accepted it yet. That Gloo's event loop then accepts a reset socket,
// fails getpeername (ENOTCONN) in a check that throws on the loop thread,
// and the peer's whole process ends (std::terminate: an executor daemon
// gone because another rank was stopped while the ranks met). The pairs
// already connected, and those not dialled yet, are closed with the
// context, plainly (FIN): a peer accepts a connection that has ended, and
// its read fails as a lost connection does.
class AbortWatcher {
 public:
  AbortWatcher(RendezvousStore& store, std::string key, gloo::transport::Context& transport,
               absl::Time deadline)
      : store_(store),
        key_(std::move(key)),
        transport_(transport),
        deadline_(deadline),
        thread_([this] { Run(); }) {}
  ~AbortWatcher() { Stop(); }

  // Ends the watch; true when the try was aborted (pairs closed).
  bool Stop() {
    {
      absl::MutexLock l(&mu_);
      stopped_ = true;
    }
    if (thread_.joinable()) thread_.join();
    absl::MutexLock l(&mu_);
    return aborted_;
  }
  bool aborted() {
    absl::MutexLock l(&mu_);
    return aborted_;
  }
  // True when the deadline came first (pairs closed).
  bool expired() {
    absl::MutexLock l(&mu_);
    return expired_;
  }
  // True when the store's user gave up first (pairs closed).
  bool cancelled() {
    absl::MutexLock l(&mu_);
    return cancelled_;
  }
  // Marks `peer`'s pair as the one this rank's connect is about to wait
  // for: the watcher closes it if the try is given up meanwhile. False
  // (nothing marked, nothing to connect) when the try was given up already.
  bool Connecting(int peer) {
    absl::MutexLock l(&mu_);
    if (aborted_ || expired_ || cancelled_) return false;
    connecting_ = peer;
    return true;
  }
  // The marked pair's connect returned; false when the try was given up
  // meanwhile (a pair the watcher closed returns as if connected).
  bool Connected() {
    absl::MutexLock l(&mu_);
    connecting_ = -1;
    return !(aborted_ || expired_ || cancelled_);
  }

 private:
  void Run() {
    while (true) {
      const bool found = store_.Get(key_, absl::ZeroDuration()).ok();
      const bool cancelled = !found && store_.Cancelled();
      absl::MutexLock l(&mu_);
      if (stopped_) return;
      if (found || cancelled || absl::Now() >= deadline_) {
        (found ? aborted_ : cancelled ? cancelled_ : expired_) = true;
        if (connecting_ >= 0) {
          try {
            transport_.getPair(connecting_)->close();
          } catch (...) {
            // A pair that cannot close is as good as closed for this try.
          }
        }
        return;
      }
      auto stopped = [this] { return stopped_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopped), absl::Milliseconds(20));
      if (stopped_) return;
    }
  }

  RendezvousStore& store_;
  const std::string key_;
  gloo::transport::Context& transport_;
  const absl::Time deadline_;
  absl::Mutex mu_;
  int connecting_ = -1;  // the peer whose pair is connecting; -1: none
  bool stopped_ = false;
  bool aborted_ = false;
  bool expired_ = false;
  bool cancelled_ = false;
  std::thread thread_;
};

// One try at the full mesh under `prefix`: every rank publishes the
// addresses of its pairs (under its decimal rank, like Gloo's own
// rendezvous) and connects each pair, then a barrier runs over the new
// connections. The barrier makes a broken mesh visible to every rank before
// anyone uses it: Gloo's TCP listener (this Gloo, 2022) accepts whichever
// connection reaches its port first, so a stray client (a probe, or a gRPC
// client retrying a port its server gave up) can take a peer's place. The
// ranks involved fail at once (the stray's close, a refused or reset
// connection), the others through the abort key or their closed pairs, so
// every rank fails this try (Unavailable) instead of one collective failing
// later.
// Rank `r`'s published pair addresses under `prefix`, polled until
// `deadline` so that an abort is seen while waiting: nullopt once the
// watcher saw one. Throws StoreFailure (DeadlineExceeded when the key never
// came).
std::optional<std::string> PeerAddresses(RendezvousStore& store, const std::string& prefix,
                                         int r, absl::Time deadline, absl::Duration timeout,
                                         AbortWatcher& watcher) {
  const std::string key = RendezvousKey(prefix, std::to_string(r));
  while (!watcher.aborted()) {
    const absl::Duration left = deadline - absl::Now();
    absl::StatusOr<std::string> theirs =
        store.Get(key, std::clamp(left, absl::ZeroDuration(), absl::Milliseconds(50)));
    if (theirs.ok()) return *std::move(theirs);
    if (theirs.status().code() != absl::StatusCode::kDeadlineExceeded) {
      throw StoreFailure(theirs.status());
    }
    if (left <= absl::ZeroDuration()) {
      throw StoreFailure(absl::DeadlineExceededError(absl::StrCat(
          "rendezvous store: key '", key, "' did not appear within ",
          absl::FormatDuration(timeout))));
    }
  }
  return std::nullopt;
}

// `why` this rank gives up the try under `prefix`, after publishing it
// under the try's abort key: the ranks still connecting (the watcher polls
// the key) give it up too, instead of waiting out their timeout. A store
// that refuses the key is said in the returned status.
absl::Status TellOthersToGiveUp(RendezvousStore& store, const std::string& prefix,
                                const absl::Status& why) {
  const absl::Status told = store.Set(RendezvousKey(prefix, "abort"), std::string(why.message()));
  if (told.ok()) return why;
  return WithMessage(why, absl::StrCat(why.message(),
                                       "; the other ranks could not be told to give this try up "
                                       "(they wait out their timeout): ",
                                       told.message()));
}

// One try at the full mesh under `prefix`: every rank publishes the
// addresses of its pairs (under its decimal rank, like Gloo's own
// rendezvous) and connects each pair, then a barrier runs over the new
// connections. The barrier makes a broken mesh visible to every rank before
// anyone uses it: Gloo's TCP listener (this Gloo, 2022) accepts whichever
// connection reaches its port first, so a stray client (a probe, or a gRPC
// client retrying a port its server gave up) can take a peer's place. The
// ranks involved fail at once (the stray's close, a refused or reset
// connection), the others through the abort key or their closed pairs, so
// every rank fails this try (Unavailable) instead of one collective failing
// later.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectOnce(
    const GlooOptions& o, RendezvousStore& store, const std::string& prefix) {
  const std::chrono::milliseconds timeout(absl::ToInt64Milliseconds(o.timeout));
  const absl::Time deadline = absl::Now() + o.timeout;
  const std::string what =
      absl::StrCat("connecting rank ", o.rank, " of ", o.size);
  auto ctx = std::make_shared<MeshContext>(o.rank, o.size);
  ctx->setTimeout(timeout);
  std::shared_ptr<gloo::transport::Context> transport;
  std::unique_ptr<AbortWatcher> watcher;
  // The store refused or did not take this rank's address: its failure,
  // not the peers'.
  bool publish_failed = false;
  // The peer whose pair is connecting (-1: none).
  int connecting = -1;
  // The listening addresses: this rank's and those it connected to.
  sockaddr_storage listening{};
  std::vector<sockaddr_storage> peer_addresses;
  pid_t idle_loop_tid = 0;
  absl::Status s = Guard(what, [&] {
    gloo::transport::tcp::attr attr(o.hostname.c_str());
    TcpDevice tcp = CreateTcpDevice(attr, o.idle_progress_thread);
    idle_loop_tid = tcp.idle_loop_tid;
    auto dev = std::move(tcp.device);
    transport = dev->createContext(o.rank, o.size);
    transport->setTimeout(timeout);
    std::string mine;
    for (int r = 0; r < o.size; ++r) {
      if (r == o.rank) continue;
      const gloo::transport::Address& address = transport->createPair(r)->address();
      if (auto* tcp_address = dynamic_cast<const gloo::transport::tcp::Address*>(&address)) {
        listening = tcp_address->getSockaddr();
      }
      const std::vector<char> bytes = address.bytes();
      mine.append(bytes.begin(), bytes.end());
    }
    ctx->Adopt(dev, transport);
    if (o.size == 1) return;
    absl::Status published = store.Set(RendezvousKey(prefix, std::to_string(o.rank)), mine);
    if (!published.ok()) {
      publish_failed = true;
      throw StoreFailure(std::move(published));
    }
    watcher =
        std::make_unique<AbortWatcher>(store, RendezvousKey(prefix, "abort"), *transport, deadline);
    for (int r = 0; r < o.size; ++r) {
      if (r == o.rank) continue;
      std::optional<std::string> theirs =
          PeerAddresses(store, prefix, r, deadline, o.timeout, *watcher);
      if (!theirs.has_value()) return;  // aborted
      const size_t peers = static_cast<size_t>(o.size - 1);
      const size_t each = theirs->size() / peers;
      if (each == 0 || theirs->size() % peers != 0) {
        throw StoreFailure(absl::InternalError(
            absl::StrCat("rank ", r, " published ", theirs->size(),
                         " bytes of addresses for ", peers, " peers")));
      }
      const size_t index = static_cast<size_t>(o.rank > r ? o.rank - 1 : o.rank);
      const std::vector<char> address(theirs->begin() + index * each,
                                      theirs->begin() + (index + 1) * each);
      peer_addresses.push_back(gloo::transport::tcp::Address(address).getSockaddr());
      connecting = r;
      if (!watcher->Connecting(r)) return;  // given up before
      transport->getPair(r)->connect(address);
      if (!watcher->Connected()) return;  // given up meanwhile
      connecting = -1;
    }
    // Aborted, out of time, or given up.
    if (watcher->Stop() || watcher->expired() || watcher->cancelled()) return;
    gloo::BarrierOptions opts(ctx);
    opts.setTimeout(timeout);
    gloo::barrier(opts);
  });
  if (watcher != nullptr && watcher->Stop()) {
    return absl::UnavailableError(absl::StrCat(
        what, ": another rank's connection broke, so this try was abandoned"));
  }
  // Given up while a pair waited for its peer: the ranks still connecting
  // are told, as for a try that broke (a stopped deployment's other ranks
  // end too, not at their timeout).
  if (watcher != nullptr && watcher->cancelled()) {
    const absl::Status gave_up = absl::CancelledError(
        absl::StrCat(what, ": given up while ",
                     connecting >= 0 ? absl::StrCat("waiting for rank ", connecting, " to connect")
                                     : std::string("the connections formed")));
    return TellOthersToGiveUp(store, prefix, gave_up);
  }
  // The watcher closed the pairs at the deadline: while this rank waited
  // for a pair (the rank on its other side had published its address), or
  // after the last one formed. (A peer that never published is named below.)
  if (watcher != nullptr && watcher->expired() && (s.ok() || connecting >= 0)) {
    return absl::DeadlineExceededError(
        connecting >= 0 ? absl::StrCat(what, ": rank ", connecting,
                                       " published its address but did not connect within ",
                                       absl::FormatDuration(o.timeout))
                        : absl::StrCat(what, ": the connections did not form within ",
                                       absl::FormatDuration(o.timeout)));
  }
  if (!s.ok()) {
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      // Asking a store that did not answer which peers are missing would
      // wait for it once a rank, to blame peers it cannot see.
      if (publish_failed) return s;
      return absl::DeadlineExceededError(
          absl::StrCat(s.message(), MissingRanks(store, prefix, o)));
    }
    // Tell the ranks still connecting to give this try up too.
    return o.size > 1 ? TellOthersToGiveUp(store, prefix, s) : s;
  }
  // Connected: the loop thread goes to SCHED_IDLE (CreateTcpDevice says
  // why); where it cannot, it stays as it is, without a watch.
  if (idle_loop_tid > 0 && !SetThreadPolicy(idle_loop_tid, SCHED_IDLE)) idle_loop_tid = 0;
  return std::unique_ptr<Communicator>(new GlooCommunicator(
      ctx, timeout, o.check_calls, idle_loop_tid,
      idle_loop_tid > 0 ? PeerSockets(listening, peer_addresses) : std::vector<int>()));
}

// Gloo's TCP device resolves the host to listen on itself, but this Gloo
// takes any resolver error other than -1 for success (and then reads an
// unset address list), and reports an address it cannot bind as a failed
// check (Internal, which ConnectGloo would take for a broken mesh and try
// again). The same look-up here first tells both as a bad option. An empty
// host is this machine's name, as in Gloo.
absl::Status CheckHostToListenOn(const std::string& hostname) {
  std::string host = hostname;
  if (host.empty()) {
    char name[HOST_NAME_MAX + 1] = {};
    if (gethostname(name, sizeof(name) - 1) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("no host to listen on was given and this machine's name is unknown: ",
                       std::strerror(errno)));
    }
    host = name;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rv = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the host to listen on '", hostname,
                                                   "' does not resolve: ", gai_strerror(rv)));
  }
  std::string why = "it has no address";
  bool bound = false;
  for (const addrinfo* a = found; a != nullptr && !bound; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = absl::StrCat("socket: ", std::strerror(errno));
      continue;
    }
    bound = bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!bound) why = absl::StrCat("bind: ", std::strerror(errno));
    close(fd);
  }
  freeaddrinfo(found);
  if (!bound) {
    return absl::InvalidArgumentError(absl::StrCat("the host to listen on '", hostname,
                                                   "' is no address of this machine (", why, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string ConnectAttemptPrefix(const std::string& prefix, int attempt) {
  return attempt == 0 ? prefix : absl::StrCat(prefix, "/retry", attempt);
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(
    const GlooOptions& o, RendezvousStore& store) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", o.rank, " is out of range for a world of ", o.size));
  }
  // Gloo waits whole milliseconds on std::chrono clocks: under 1 ms is 0 ms
  // (every wait over at once); centuries overflow the clock's nanoseconds.
  const absl::Duration longest = absl::Hours(24 * 3650);
  if (!(o.timeout >= absl::Milliseconds(1) && o.timeout <= longest)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the communicator timeout must be between 1ms and ",
                     absl::FormatDuration(longest), ", not ", absl::FormatDuration(o.timeout)));
  }
  if (o.connect_attempts < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "connect_attempts must be at least 1, not ", o.connect_attempts));
  }
  HAP_RETURN_IF_ERROR(CheckHostToListenOn(o.hostname));
  // A peer that dies leaves sockets that raise SIGPIPE on the next write;
  // without this the whole process would be killed instead of getting an
  // error it can report.
  static const bool sigpipe_ignored = [] {
    std::signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)sigpipe_ignored;
  // A try that broke (a connection closed, reset or refused, or garbage on
  // it: Unavailable or Internal) is retried under a fresh key prefix, which
  // every rank reaches the same way: none passes a barrier that another
  // failed. A peer that never showed up (DeadlineExceeded) is not retried.
  absl::Status last;
  for (int attempt = 0; attempt < o.connect_attempts; ++attempt) {
    auto comm = ConnectOnce(o, store, ConnectAttemptPrefix(o.prefix, attempt));
    if (comm.ok()) return comm;
    last = comm.status();
    const bool broken = last.code() == absl::StatusCode::kUnavailable ||
                        last.code() == absl::StatusCode::kInternal;
    if (!broken) return last;
    if (attempt + 1 < o.connect_attempts) {
      std::fprintf(stderr, "hap: %s; retrying (attempt %d of %d)\n",
                   std::string(last.message()).c_str(), attempt + 2,
                   o.connect_attempts);
    }
  }
  return WithMessage(last,
                     absl::StrCat(last.message(), " (after ", o.connect_attempts, " attempts)"));
}

}  // namespace hap::executor
