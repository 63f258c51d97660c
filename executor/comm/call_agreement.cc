#include "executor/comm/call_agreement.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "executor/comm/deadline.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"

namespace hap::executor {
namespace {

// The number of ranks an encoded call is for.
int Ranks(const EncodedCall& call) { return static_cast<int>((call.size() - kCallFields) / 2); }

std::string KindName(int64_t kind) {
  switch (static_cast<CallKind>(kind)) {
    case CallKind::kAllReduce:
      return "all-reduce";
    case CallKind::kAllGatherPadded:
      return "all-gather (padded)";
    case CallKind::kAllGatherGrouped:
      return "all-gather (grouped)";
    case CallKind::kReduceScatterPadded:
      return "reduce-scatter (padded)";
    case CallKind::kReduceScatterGrouped:
      return "reduce-scatter (grouped)";
    case CallKind::kAllToAll:
      return "all-to-all";
    case CallKind::kBroadcast:
      return "broadcast";
    case CallKind::kReduce:
      return "reduce";
    case CallKind::kBarrier:
      return "barrier";
    case CallKind::kRefused:
      return "a call it refused";
  }
  return absl::StrCat("collective #", kind);
}

std::string DTypeOf(int64_t dtype) {
  if (dtype < 0 || dtype > static_cast<int64_t>(DType::kInt64)) {
    return absl::StrCat("dtype #", dtype);
  }
  return std::string(graph::DTypeName(static_cast<DType>(dtype)));
}

// The descriptions' own slot, clear of the collectives' (gloo/types.h uses
// 0x01-0x08) and of point-to-point messages (0x40, 0x41).
uint64_t CallSlot() { return gloo::Slot::build(0x42, 0); }

}  // namespace

EncodedCall EncodeCall(const Call& call, int ranks) {
  EncodedCall w(kCallFields + 2 * static_cast<size_t>(ranks), 0);
  w[0] = static_cast<int64_t>(call.kind);
  w[1] = static_cast<int64_t>(call.dtype);
  w[2] = call.elements;
  w[3] = call.root;
  const size_t n = static_cast<size_t>(ranks);
  std::copy_n(call.counts.begin(), std::min(call.counts.size(), n), w.begin() + kCallFields);
  std::copy_n(call.recv_counts.begin(), std::min(call.recv_counts.size(), n),
              w.begin() + kCallFields + ranks);
  return w;
}

std::string DescribeCall(const EncodedCall& w) {
  const std::string kind = KindName(w[0]);
  const std::string elements = absl::StrCat(w[2], " ", DTypeOf(w[1]), " elements");
  switch (static_cast<CallKind>(w[0])) {
    case CallKind::kAllReduce:
      return absl::StrCat(kind, " of ", elements);
    case CallKind::kBroadcast:
      return absl::StrCat(kind, " of ", elements, " from rank ", w[3]);
    case CallKind::kReduce:
      return absl::StrCat(kind, " of ", elements, " to rank ", w[3]);
    case CallKind::kAllGatherPadded:
    case CallKind::kAllGatherGrouped:
    case CallKind::kReduceScatterPadded:
    case CallKind::kReduceScatterGrouped:
      return absl::StrCat(
          kind, " of ", DTypeOf(w[1]), " chunks [",
          absl::StrJoin(w.begin() + kCallFields, w.begin() + kCallFields + Ranks(w), ","), "]");
    case CallKind::kAllToAll:
      return absl::StrCat(kind, " of ", DTypeOf(w[1]));
    case CallKind::kBarrier:
    case CallKind::kRefused:
      return kind;
  }
  return kind;
}

absl::Status CheckCallsMatch(const std::string& what, const std::vector<EncodedCall>& calls) {
  const int size = static_cast<int>(calls.size());
  for (int r = 0; r < size; ++r) {
    if (calls[r][0] == static_cast<int64_t>(CallKind::kRefused)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": rank ", r,
                       " refused its own call before any traffic (its arguments "
                       "there are invalid; its error names them)"));
    }
  }
  // An all-to-all's rows differ by rank: only the kind and dtype must be
  // the same; the counts must pair up (below).
  auto same = [&](const EncodedCall& a, const EncodedCall& b) {
    if (a[0] == static_cast<int64_t>(CallKind::kAllToAll) && a[0] == b[0]) return a[1] == b[1];
    return a == b;
  };
  for (int r = 1; r < size; ++r) {
    if (!same(calls[0], calls[r])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the ranks' calls differ: rank 0 calls ", DescribeCall(calls[0]),
                       ", rank ", r, " calls ", DescribeCall(calls[r])));
    }
  }
  if (calls[0][0] != static_cast<int64_t>(CallKind::kAllToAll)) return absl::OkStatus();
  for (int from = 0; from < size; ++from) {
    for (int to = 0; to < size; ++to) {
      const int64_t sends = calls[from][kCallFields + to];
      const int64_t expects = calls[to][kCallFields + size + from];
      if (sends != expects) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": the ranks' counts differ: rank ", from, " sends ", sends, " ",
                         DTypeOf(calls[from][1]), " elements to rank ", to, ", which expects ",
                         expects, " from it"));
      }
    }
  }
  return absl::OkStatus();
}

CallAgreement::CallAgreement(std::shared_ptr<gloo::Context> context,
                             std::chrono::milliseconds timeout)
    : context_(std::move(context)), timeout_(timeout) {}

CallAgreement::~CallAgreement() = default;

size_t CallAgreement::Words() const {
  return kCallFields + 2 * static_cast<size_t>(context_->size);
}

std::vector<EncodedCall> CallAgreement::Exchange(const Call& mine) {
  const int rank = context_->rank;
  const int size = context_->size;
  const EncodedCall encoded = EncodeCall(mine, size);
  const size_t bytes = Words() * sizeof(int64_t);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  if (inboxes_.empty()) inboxes_.resize(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    Inbox& in = inboxes_[p];
    if (in.receive == nullptr) {
      in.buffer.resize(Words());
      in.receive = context_->createUnboundBuffer(in.buffer.data(), bytes);
    }
    if (!in.posted) {
      in.receive->recv(p, CallSlot());
      in.posted = true;
    }
  }
  // Kept until every send has completed (below); the next call reuses it.
  if (send_ == nullptr) {
    out_.resize(Words());
    send_ = context_->createUnboundBuffer(out_.data(), bytes);
  }
  std::copy(encoded.begin(), encoded.end(), out_.begin());
  for (int p = 0; p < size; ++p) {
    if (p != rank) send_->send(p, CallSlot());
  }
  std::vector<EncodedCall> calls(size);
  calls[rank] = out_;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    Inbox& in = inboxes_[p];
    if (!in.receive->waitRecv(MillisecondsLeft(deadline))) {
      throw gloo::IoException("agreement aborted");
    }
    in.posted = false;
    calls[p] = in.buffer;
    // Posted again at once, so that the peer's next description goes out
    // as sent. A peer that has closed its end since (its last call made)
    // fails the post, not this call: the next call reports it.
    try {
      in.receive->recv(p, CallSlot());
      in.posted = true;
    } catch (const std::exception&) {
    }
  }
  for (int p = 0; p < size; ++p) {
    if (p != rank && !send_->waitSend(MillisecondsLeft(deadline))) {
      throw gloo::IoException("agreement aborted");
    }
  }
  return calls;
}

}  // namespace hap::executor
