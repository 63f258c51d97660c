// A collective's own checks (communicator.h: "a call whose own arguments
// disagree") and its description as its peers see it (call_agreement.h's
// Call), shared by the communicators that honour the contract on calls:
// Gloo's (gloo_communicator.cc) and the in-process test group
// (executor/train/in_process_comm.h), so that both refuse the same calls
// with the same messages; NCCL's (executor/cuda/nccl_communicator.cc) runs
// the same own checks (it compares no calls across ranks).
//
// Each <Collective>Call function checks one rank's arguments, `rank` of
// `size` ranks, against each other: on success it returns the Call to agree
// on (its counts borrowed from the arguments), else InvalidArgument
// prefixed with the collective's name ("all-gather: counts [2,3] sum to 5
// but the buffer holds 4 elements"). Pure functions: no traffic.
#ifndef HAP_EXECUTOR_COMM_CALL_CHECKS_H_
#define HAP_EXECUTOR_COMM_CALL_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "executor/comm/call_agreement.h"
#include "executor/comm/communicator.h"
#include "executor/runtime/tensor.h"

namespace hap::executor {

// The building blocks; `what` prefixes the message.
// `v` is of a dtype that is summed: float32, float64 or bfloat16.
absl::Status CheckFloat(const char* what, const TensorView& v);
// `root` is one of `size` ranks.
absl::Status CheckRoot(const char* what, int root, int size);
// `a` and `b` are of the same dtype.
absl::Status SameDType(const char* what, const TensorView& a, const TensorView& b);
// counts: one per rank, non-negative; `whole` holds their sum and, when
// `check_part`, `part` (of the same dtype) holds counts[rank].
absl::Status CheckCounts(const char* what, absl::Span<const int64_t> counts, const TensorView& part,
                         const TensorView& whole, bool check_part, int rank, int size);

// The collectives (communicator.h's arguments).
absl::StatusOr<Call> AllReduceCall(const TensorView& buf);
absl::StatusOr<Call> AllGatherCall(const TensorView& in, const TensorView& out,
                                   absl::Span<const int64_t> counts, CommMethod method, int rank,
                                   int size);
absl::StatusOr<Call> ReduceScatterCall(const TensorView& in, const TensorView& out,
                                       absl::Span<const int64_t> counts, CommMethod method,
                                       int rank, int size);
absl::StatusOr<Call> AllToAllCall(const TensorView& in, absl::Span<const int64_t> send_counts,
                                  const TensorView& out, absl::Span<const int64_t> recv_counts,
                                  int size);
absl::StatusOr<Call> BroadcastCall(const TensorView& buf, int root, int size);
// The output is checked on the root only (absent elsewhere).
absl::StatusOr<Call> ReduceCall(const TensorView& in, const TensorView& out, int root, int rank,
                                int size);
// Nothing to check.
Call BarrierCall();
// What a rank whose own checks refused its call tells its peers.
Call RefusedCall();

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_CALL_CHECKS_H_
