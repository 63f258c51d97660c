#include "executor/runtime/device.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "executor/runtime/bf16.h"

namespace hap::executor {

absl::Status Device::Convert(TensorView src, TensorView dst) {
  return absl::UnimplementedError(
      absl::StrCat(name(), " cannot convert ", graph::DTypeName(src.dtype), " to ",
                   graph::DTypeName(dst.dtype)));
}

absl::Status CheckConvert(const std::string& device, TensorView src, TensorView dst) {
  const bool pair = (src.dtype == DType::kFloat32 && dst.dtype == DType::kBFloat16) ||
                    (src.dtype == DType::kBFloat16 && dst.dtype == DType::kFloat32);
  if (!pair) {
    return absl::UnimplementedError(absl::StrCat(
        device, ": convert ", graph::DTypeName(src.dtype), " to ", graph::DTypeName(dst.dtype),
        ": only float32 <-> bfloat16"));
  }
  if (src.num_elements() != dst.num_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat(device, ": convert ", src.num_elements(), " elements into ",
                     dst.num_elements()));
  }
  return absl::OkStatus();
}

absl::Status HostConvert(TensorView src, TensorView dst) {
  if (absl::Status s = CheckConvert("host", src, dst); !s.ok()) return s;
  const int64_t n = src.num_elements();
  if (src.dtype == DType::kFloat32) {
    const float* x = src.as<float>();
    auto* y = static_cast<uint16_t*>(dst.data);
    for (int64_t i = 0; i < n; ++i) y[i] = Bf16Bits(x[i]);
  } else {
    const auto* x = static_cast<const uint16_t*>(src.data);
    float* y = dst.as<float>();
    for (int64_t i = 0; i < n; ++i) y[i] = Bf16ToFloat(x[i]);
  }
  return absl::OkStatus();
}

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
