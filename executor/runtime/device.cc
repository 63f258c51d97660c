#include "executor/runtime/device.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace hap::executor {

absl::Status HostCopyBox(TensorView src, absl::Span<const int64_t> src_start,
                         TensorView dst, absl::Span<const int64_t> dst_start,
                         absl::Span<const int64_t> extent) {
  const int rank = src.rank();
  if (dst.rank() != rank || static_cast<int>(src_start.size()) != rank ||
      static_cast<int>(dst_start.size()) != rank ||
      static_cast<int>(extent.size()) != rank || src.dtype != dst.dtype) {
    return absl::InvalidArgumentError("copy box: ranks or dtypes differ");
  }
  for (int d = 0; d < rank; ++d) {
    if (extent[d] < 0 || src_start[d] < 0 || dst_start[d] < 0 ||
        src_start[d] + extent[d] > src.shape[d] ||
        dst_start[d] + extent[d] > dst.shape[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("copy box: dimension ", d, " out of range"));
    }
    if (extent[d] == 0) return absl::OkStatus();
  }
  const int64_t esize = graph::DTypeBytes(src.dtype);
  // Merge the trailing dimensions copied whole into one contiguous run.
  int inner_from = rank;
  int64_t run = esize;
  while (inner_from > 0) {
    int d = inner_from - 1;
    run *= extent[d];
    --inner_from;
    if (extent[d] != src.shape[d] || extent[d] != dst.shape[d]) break;
  }
  if (rank == 0) {
    std::memcpy(dst.data, src.data, esize);
    return absl::OkStatus();
  }
  std::vector<int64_t> sstride(rank), dstride(rank);
  int64_t ss = esize, ds = esize;
  for (int d = rank - 1; d >= 0; --d) {
    sstride[d] = ss;
    dstride[d] = ds;
    ss *= src.shape[d];
    ds *= dst.shape[d];
  }
  // Iterate over the outer index space [0, inner_from) of the box.
  std::vector<int64_t> idx(inner_from, 0);
  const char* s = static_cast<const char*>(src.data);
  char* t = static_cast<char*>(dst.data);
  while (true) {
    int64_t so = 0, to = 0;
    for (int d = 0; d < rank; ++d) {
      int64_t i = d < inner_from ? idx[d] : 0;
      so += (src_start[d] + i) * sstride[d];
      to += (dst_start[d] + i) * dstride[d];
    }
    std::memcpy(t + to, s + so, run);
    int d = inner_from - 1;
    while (d >= 0 && ++idx[d] == extent[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  return absl::OkStatus();
}

}  // namespace hap::executor
