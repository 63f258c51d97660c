#include "executor/comm/call_checks.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace hap::executor {
namespace {

absl::Status Invalid(const std::string& m) { return absl::InvalidArgumentError(m); }

}  // namespace

absl::Status CheckFloat(const char* what, const TensorView& v) {
  if (v.dtype != DType::kFloat32 && v.dtype != DType::kFloat64 && v.dtype != DType::kBFloat16) {
    return Invalid(absl::StrCat(what, ": only float32, float64 and bfloat16 are summed, got ",
                                graph::DTypeName(v.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckRoot(const char* what, int root, int size) {
  if (root < 0 || root >= size) {
    return Invalid(absl::StrCat(what, ": root ", root, " is out of range for ", size, " ranks"));
  }
  return absl::OkStatus();
}

absl::Status SameDType(const char* what, const TensorView& a, const TensorView& b) {
  if (a.dtype != b.dtype) {
    return Invalid(absl::StrCat(what, ": the buffers' dtypes differ (", graph::DTypeName(a.dtype),
                                " and ", graph::DTypeName(b.dtype), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckCounts(const char* what, absl::Span<const int64_t> counts, const TensorView& part,
                         const TensorView& whole, bool check_part, int rank, int size) {
  if (check_part) HAP_RETURN_IF_ERROR(SameDType(what, part, whole));
  if (static_cast<int>(counts.size()) != size) {
    return Invalid(absl::StrCat(what, ": ", counts.size(), " counts for ", size, " ranks"));
  }
  int64_t sum = 0;
  for (int64_t c : counts) {
    if (c < 0) return Invalid(absl::StrCat(what, ": negative count ", c));
    sum += c;
  }
  if (sum != whole.num_elements()) {
    return Invalid(absl::StrCat(what, ": counts [", absl::StrJoin(counts, ","), "] sum to ", sum,
                                " but the buffer holds ", whole.num_elements(), " elements"));
  }
  if (check_part && counts[rank] != part.num_elements()) {
    return Invalid(absl::StrCat(what, ": rank ", rank, " holds ", part.num_elements(),
                                " elements, its count is ", counts[rank]));
  }
  return absl::OkStatus();
}

absl::StatusOr<Call> AllReduceCall(const TensorView& buf) {
  HAP_RETURN_IF_ERROR(CheckFloat("all-reduce", buf));
  return Call(CallKind::kAllReduce, buf.dtype, buf.num_elements());
}

absl::StatusOr<Call> AllGatherCall(const TensorView& in, const TensorView& out,
                                   absl::Span<const int64_t> counts, CommMethod method, int rank,
                                   int size) {
  HAP_RETURN_IF_ERROR(CheckCounts("all-gather", counts, in, out, /*check_part=*/true, rank, size));
  return Call(
      method == CommMethod::kGrouped ? CallKind::kAllGatherGrouped : CallKind::kAllGatherPadded,
      in.dtype, out.num_elements(), -1, counts);
}

absl::StatusOr<Call> ReduceScatterCall(const TensorView& in, const TensorView& out,
                                       absl::Span<const int64_t> counts, CommMethod method,
                                       int rank, int size) {
  HAP_RETURN_IF_ERROR(CheckFloat("reduce-scatter", in));
  HAP_RETURN_IF_ERROR(
      CheckCounts("reduce-scatter", counts, out, in, /*check_part=*/true, rank, size));
  return Call(method == CommMethod::kGrouped ? CallKind::kReduceScatterGrouped
                                             : CallKind::kReduceScatterPadded,
              in.dtype, in.num_elements(), -1, counts);
}

absl::StatusOr<Call> AllToAllCall(const TensorView& in, absl::Span<const int64_t> send_counts,
                                  const TensorView& out, absl::Span<const int64_t> recv_counts,
                                  int size) {
  // Neither side is this rank's part of the other: the rank is not read.
  HAP_RETURN_IF_ERROR(CheckCounts("all-to-all", send_counts, TensorView{}, in,
                                  /*check_part=*/false, /*rank=*/0, size));
  HAP_RETURN_IF_ERROR(CheckCounts("all-to-all", recv_counts, TensorView{}, out,
                                  /*check_part=*/false, /*rank=*/0, size));
  HAP_RETURN_IF_ERROR(SameDType("all-to-all", in, out));
  return Call(CallKind::kAllToAll, in.dtype, in.num_elements(), -1, send_counts, recv_counts);
}

absl::StatusOr<Call> BroadcastCall(const TensorView& buf, int root, int size) {
  HAP_RETURN_IF_ERROR(CheckRoot("broadcast", root, size));
  return Call(CallKind::kBroadcast, buf.dtype, buf.num_elements(), root);
}

absl::StatusOr<Call> ReduceCall(const TensorView& in, const TensorView& out, int root, int rank,
                                int size) {
  HAP_RETURN_IF_ERROR(CheckFloat("reduce", in));
  HAP_RETURN_IF_ERROR(CheckRoot("reduce", root, size));
  if (rank == root) {
    HAP_RETURN_IF_ERROR(SameDType("reduce", in, out));
    if (out.num_elements() != in.num_elements()) {
      return Invalid(absl::StrCat("reduce: the output holds ", out.num_elements(),
                                  " elements, the input ", in.num_elements()));
    }
  }
  return Call(CallKind::kReduce, in.dtype, in.num_elements(), root);
}

Call BarrierCall() { return Call(CallKind::kBarrier, DType::kFloat32, 0); }

Call RefusedCall() { return Call(CallKind::kRefused, DType::kFloat32, 0); }

}  // namespace hap::executor
