// The Gloo communicator's agreement on the call (gloo_communicator.cc;
// GlooOptions::check_calls in communicator.h).
//
// Every collective (and barrier) starts with an agreement on the call:
// each rank sends every peer a description of its call (CallKind, dtype,
// elements, root, counts) and waits for theirs, before any of the
// collective's own traffic. Gloo cannot survive calls that differ: a
// message longer than the receive posted for it fails a check on Gloo's
// event-loop thread, which ends the process (std::terminate); a shorter
// one is taken as complete and leaves the ranks out of step (wrong sums,
// then a hang until the timeout). With the descriptions every rank sees
// the same table and refuses a mismatch with the same message, naming
// the first rank that differs from rank 0 and both calls; as no rank
// sends any of the collective's data, the group stays in step and the
// communicator usable. The cost is one small message per peer, sent at
// once (each rank keeps a receive for the next description posted per
// peer), so the wait is one one-way hop, not a round trip.
//
// The pure half (EncodeCall, DescribeCall, CheckCallsMatch) needs no
// connection (the in-process test group, executor/train/in_process_comm.h,
// compares its ranks' calls with it too); CallAgreement does the exchange
// over a Gloo context. A call's own checks, before it is described, are in
// call_checks.h.
#ifndef HAP_EXECUTOR_COMM_CALL_AGREEMENT_H_
#define HAP_EXECUTOR_COMM_CALL_AGREEMENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "executor/runtime/tensor.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace hap::executor {

// What a rank calls. The values go over the wire: keep them.
enum class CallKind : int64_t {
  kAllReduce = 1,
  kAllGatherPadded,
  kAllGatherGrouped,
  kReduceScatterPadded,
  kReduceScatterGrouped,
  kAllToAll,
  kBroadcast,
  kReduce,
  kBarrier,
  // This rank's own checks refused its call (Refuse): nothing follows.
  kRefused,
};

// A call as its peers see it. counts: all-gather and reduce-scatter
// chunks, or all-to-all send counts (recv_counts: what it expects). The
// spans are borrowed: the call is encoded before they go.
struct Call {
  Call(CallKind kind, DType dtype, int64_t elements, int64_t root = -1,
       absl::Span<const int64_t> counts = {}, absl::Span<const int64_t> recv_counts = {})
      : kind(kind),
        dtype(dtype),
        elements(elements),
        root(root),
        counts(counts),
        recv_counts(recv_counts) {}
  CallKind kind;
  DType dtype;
  int64_t elements;
  int64_t root;
  absl::Span<const int64_t> counts;
  absl::Span<const int64_t> recv_counts;
};

// A call on the wire: kind, dtype, elements, root (kCallFields words), then
// one count per rank and one receive count per rank (zeros where a call has
// none): kCallFields + 2 * ranks words in all.
using EncodedCall = std::vector<int64_t>;
inline constexpr int kCallFields = 4;

// The words of `call` among `ranks` ranks. The communicator has checked
// that a call's counts hold one a rank; any past `ranks` are not encoded.
EncodedCall EncodeCall(const Call& call, int ranks);

// An encoded call in words, as the mismatch messages name it: "all-reduce
// of 4 f32 elements", "broadcast of 4 f32 elements from rank 1",
// "all-gather (padded) of f32 chunks [2,3]", "barrier". A kind or dtype
// this build does not know is named by its number ("collective #12",
// "dtype #42"). `call` holds kCallFields + 2 * ranks words.
std::string DescribeCall(const EncodedCall& call);

// Every rank's encoded call (calls[r] for rank r, the same table on every
// rank): OK when they match, else InvalidArgument prefixed with `what`
// naming the first difference (the same message on every rank): a rank
// that refused its own call, the first rank whose call differs from rank
// 0's, or, for an all-to-all (whose rows differ by rank: only the kind and
// dtype must be the same), the first pair of ranks whose counts do not pair
// up.
absl::Status CheckCallsMatch(const std::string& what, const std::vector<EncodedCall>& calls);

// The exchange of the calls over a Gloo context: one send to every peer
// and one receive kept posted per peer, under a slot of its own (clear of
// the collectives' and of point-to-point messages). Not thread-safe, as
// the communicator is not.
class CallAgreement {
 public:
  // `context` must be connected; each exchange waits up to `timeout`.
  CallAgreement(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout);
  ~CallAgreement();
  CallAgreement(const CallAgreement&) = delete;
  CallAgreement& operator=(const CallAgreement&) = delete;

  // Sends `mine` to every peer, and returns every rank's encoded call
  // (this rank's own at its index) once each peer's has come, within the
  // timeout. Throws as Gloo does (an IoException saying "agreement
  // aborted" when a peer's did not come in time): call it inside the
  // communicator's Guard.
  std::vector<EncodedCall> Exchange(const Call& mine);

 private:
  // The receive kept posted for a peer's next description.
  struct Inbox {
    std::vector<int64_t> buffer;
    std::unique_ptr<gloo::transport::UnboundBuffer> receive;
    bool posted = false;
  };

  size_t Words() const;

  std::shared_ptr<gloo::Context> context_;
  std::chrono::milliseconds timeout_;
  // This rank's last description and the buffer it is sent from (one for
  // every peer); the receives for the peers' next ones, by peer (filled at
  // the first exchange). After context_, so that they go first.
  std::vector<int64_t> out_;
  std::unique_ptr<gloo::transport::UnboundBuffer> send_;
  std::vector<Inbox> inboxes_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_CALL_AGREEMENT_H_
