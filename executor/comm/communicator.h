// The communicator: the collectives a rank's program calls (docs/design.md §10).
// Backends: Gloo over TCP (gloo_communicator.h) for CPU ranks; NCCL for GPUs
// (executor/cuda). Every collective works on contiguous buffers split by
// rank in rank order ("chunks"); the executor maps a shard along any
// dimension onto this flat layout itself.
//
// Uneven chunks (sharding ratios) come in two methods (plan.proto
// CollectiveMethod): PADDED pads every chunk to the largest and runs one
// collective; GROUPED runs one broadcast (all-gather) or one reduce
// (reduce-scatter) per rank, each of its own size.
//
// Errors: InvalidArgument for inconsistent sizes (naming them);
// DeadlineExceeded when a peer does not take part within the timeout (a
// peer that died); Unavailable for a broken connection (LostPeerError:
// IsLostPeer tells it from other Unavailable errors); Internal for any
// other backend failure. After an error the communicator is unusable: every
// later call returns FailedPrecondition naming the first error.
// InvalidArgument leaves the communicator usable. It comes in two kinds:
// - a call whose own arguments disagree (counts that do not sum to the
//   buffer, a root out of range, an unsummable dtype) is refused before
//   any of its traffic; with Gloo's check_calls the rank tells its peers,
//   whose call ends InvalidArgument naming it (without it, or on NCCL,
//   they time out).
// - calls that disagree across ranks (element counts, dtypes, chunks,
//   roots, methods, all-to-all counts that do not pair up, or another
//   collective): Gloo's collectives and barrier first exchange a small
//   description of the call with every peer, and every rank refuses the
//   mismatch with the same message naming the first rank that differs
//   from rank 0 and both calls (call_agreement.h).
//   NCCL's does not compare the ranks' calls (executor/cuda).
//
// Thread-safety: one thread at a time per communicator; collectives are
// matched by call order across ranks.
#ifndef HAP_EXECUTOR_COMM_COMMUNICATOR_H_
#define HAP_EXECUTOR_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "executor/runtime/tensor.h"

namespace hap::executor {

enum class CommMethod { kPadded, kGrouped };

// The payload that marks a collective's broken connection to a peer (the
// peer's process ended, its host went away), which Annotate keeps through
// the layers above: hap-launch tells a rank that lost a peer from the rank
// that failed by it, not by the status code, which other failures share.
inline constexpr char kLostPeerPayload[] = "type.hap.dev/hap.executor.LostPeer";

// Unavailable with `message`, marked as a lost peer.
inline absl::Status LostPeerError(absl::string_view message) {
  absl::Status s = absl::UnavailableError(message);
  s.SetPayload(kLostPeerPayload, absl::Cord("1"));
  return s;
}

// True for LostPeerError's statuses (annotated or not).
inline bool IsLostPeer(const absl::Status& s) { return s.GetPayload(kLostPeerPayload).has_value(); }

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Elementwise sum over ranks, in place. float32, float64, bfloat16 (each
  // partial sum rounded to bf16; CollectiveCall.wire_dtype).
  virtual absl::Status AllReduce(TensorView buf) = 0;
  // `in` is this rank's chunk (counts[rank()] elements); `out` receives every
  // chunk in rank order (sum of counts elements).
  virtual absl::Status AllGather(TensorView in, TensorView out,
                                 absl::Span<const int64_t> counts,
                                 CommMethod method) = 0;
  // `in` holds every rank's chunk in rank order (sum of counts elements);
  // `out` (counts[rank()] elements) receives the sum over ranks of this
  // rank's chunk.
  virtual absl::Status ReduceScatter(TensorView in, TensorView out,
                                     absl::Span<const int64_t> counts,
                                     CommMethod method) = 0;
  // `in` holds send_counts[j] elements for rank j in rank order; `out`
  // receives recv_counts[j] elements from rank j in rank order.
  virtual absl::Status AllToAll(TensorView in, absl::Span<const int64_t> send_counts,
                                TensorView out,
                                absl::Span<const int64_t> recv_counts) = 0;
  virtual absl::Status Broadcast(TensorView buf, int root) = 0;
  // Sum over ranks into `out` on `root` (out may be absent elsewhere).
  virtual absl::Status Reduce(TensorView in, TensorView out, int root) = 0;
  virtual absl::Status Barrier() = 0;

  // Point-to-point (pipeline stages, executor/train/pipeline.h). Send
  // starts sending `buf` to rank `peer` under `tag` (0 <= tag < 2^32) and
  // returns; `buf` must stay unchanged until WaitSends returns. Recv blocks
  // until the message from `peer` under `tag` has arrived in `buf`, which
  // must have the sender's byte size (an empty message is a message too).
  // Messages of one (sender, receiver, tag) arrive in send order.
  // InvalidArgument for a peer out of range or this rank itself; the errors
  // of collectives otherwise. Gloo's Recv also refuses a message of another
  // size than `buf` (InvalidArgument naming both; the message is consumed
  // and the communicator stays usable); NCCL's cannot tell. (Gloo copies a
  // message of up to 16 KiB, which is then complete once sent, its
  // receiver or not.) Backends without them say Unimplemented.
  virtual absl::Status Send(TensorView buf, int peer, int64_t tag) {
    (void)buf, (void)peer, (void)tag;
    return absl::UnimplementedError("this communicator has no point-to-point send");
  }
  virtual absl::Status Recv(TensorView buf, int peer, int64_t tag) {
    (void)buf, (void)peer, (void)tag;
    return absl::UnimplementedError("this communicator has no point-to-point receive");
  }
  // Waits until every send started has completed.
  virtual absl::Status WaitSends() { return absl::OkStatus(); }
};

// A key-value store for rendezvous: a file store now (file_store.h), a store
// served by the planner later. Keys are plain strings; values bytes.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until the key exists; DeadlineExceeded after `timeout` naming it.
  // A store that fails otherwise (it cannot be read or reached) says so with
  // its own error, at once where it can tell.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          absl::Duration timeout) = 0;
  // Whether the store's user gave up (its training run was stopped): a
  // connect waiting for a peer's connection, not in the store, polls it and
  // ends Cancelled. A store of its own never is.
  virtual bool Cancelled() { return false; }
};

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Every key this communicator writes is prefixed by it: a plan's name and
  // generation, so restarted or concurrent plans never mix.
  std::string prefix = "hap";
  // The address to listen on (a name or a number; empty: this machine's
  // name). ConnectGloo refuses one that does not resolve or is not this
  // machine's (InvalidArgument).
  std::string hostname = "127.0.0.1";
  // Per collective and connect; 1 ms to 3650 days (InvalidArgument
  // otherwise: Gloo waits whole milliseconds).
  absl::Duration timeout = absl::Seconds(60);
  // Run Gloo's event-loop thread at SCHED_IDLE (gloo_communicator.cc says
  // why); false keeps the default policy (bench/comm_bench compares both).
  // Our collectives are synchronous, so the loop runs while the rank's own
  // thread waits; a core oversubscribed by other normal-policy processes
  // would starve it (collectives then slow down, up to the timeout): turn
  // it off there. A peer's death is still noticed there: DeadPeerWatch
  // raises the thread once a connection hangs up during a wait.
  bool idle_progress_thread = true;
  // Tries at the full mesh when one breaks (a connection closed, reset or
  // refused while it forms); each try has the whole timeout. All ranks of
  // a world must use the same value.
  int connect_attempts = 3;
  // Every collective and the barrier first exchange a small description of
  // the call with every peer, so that calls that differ across ranks end
  // InvalidArgument on every rank (Gloo aborts the process on a message
  // longer than the receive posted for it). It costs one small message per
  // peer per collective (bench/comm_bench.sh --call-check measures it);
  // false skips it where the calls are known to match (the executors
  // compare a hash of every rank's collectives at connect). All ranks of a
  // world must use the same value.
  bool check_calls = true;
};

// Connects to every peer through `store` (full mesh over TCP) and checks
// the mesh with a barrier; a mesh that breaks while it forms is tried again
// (connect_attempts), under ConnectAttemptPrefix(prefix, attempt). The store
// must outlive the call only, and take calls from two threads at once (a
// second one polls it for a try's abort key while this one connects).
// Errors: DeadlineExceeded when a peer does not show up or connect within
// the timeout, naming the rank(s) where known; Unavailable when every try
// broke; InvalidArgument for bad options; the store's own errors.
// The first call sets SIGPIPE to ignored for the process, so that writing
// to a dead peer is an error (Unavailable) rather than the process's death.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(
    const GlooOptions& options, RendezvousStore& store);

// The key prefix of connect attempt `attempt` (0 = the first: `prefix`).
std::string ConnectAttemptPrefix(const std::string& prefix, int attempt);

// A store in a directory shared by the ranks (one file a key, written
// atomically by rename). InvalidArgument when `dir` is not a writable
// directory.
absl::StatusOr<std::unique_ptr<RendezvousStore>> NewFileStore(
    const std::string& dir);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_COMMUNICATOR_H_
