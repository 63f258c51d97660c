// What checkpoint.cc (saving, the sharded reader) and state_dict.cc (the
// state_dict form: weights in, one safetensors file out) share. Internal
// to //executor/checkpoint.
#ifndef HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_INTERNAL_H_
#define HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "executor/checkpoint/checkpoint.h"

namespace hap::executor::checkpoint {

inline constexpr char kTrainerFile[] = "trainer.json";

// Why the slices of `t` do not cover it exactly once, or "" when they do:
// every slice lies within [0, shape), no two overlap, and their volumes sum
// to the tensor's element count.
std::string TilingError(const hap::v1::CheckpointIndex::Tensor& t);

// Copies into dst (the box [dst_offsets, +dst.shape) of a global tensor)
// the part of `src` (the box [src_offsets, +src.shape)) that overlaps it.
// Returns the number of elements copied.
absl::StatusOr<int64_t> CopyOverlap(TensorView src, absl::Span<const int64_t> src_offsets,
                                    TensorView dst, absl::Span<const int64_t> dst_offsets);

// InvalidArgument unless a piece `dst` at `offsets` of a tensor `global`
// the plan holds can be read from `name` saved as `saved_dtype`,
// `saved_shape` in `where`.
absl::Status CheckRequest(const std::string& name, DType saved_dtype, const Shape& saved_shape,
                          const Shape& global, absl::Span<const int64_t> offsets,
                          const TensorView& dst, const std::string& where);

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_INTERNAL_H_
