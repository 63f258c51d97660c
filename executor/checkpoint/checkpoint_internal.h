// What checkpoint.cc (saving, the sharded reader), retention.cc (what a
// checkpoint directory keeps) and state_dict.cc (the
// state_dict form: weights in, one safetensors file out) share. Internal
// to //executor/checkpoint.
#ifndef HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_INTERNAL_H_
#define HAP_EXECUTOR_CHECKPOINT_CHECKPOINT_INTERNAL_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "executor/checkpoint/checkpoint.h"

namespace hap::executor::checkpoint {

inline constexpr char kTrainerFile[] = "trainer.json";
// A save's temporary directory: kTmpPrefix, the step, RunSuffix.
inline constexpr char kTmpPrefix[] = ".tmp-step-";

// retention.cc: what a checkpoint directory keeps.
// What ends a run's temporary directories' names ("" or "-ID").
std::string RunSuffix(const std::string& run_id);
// remove_all, its error as a status.
absl::Status RemoveAll(const std::string& path);
// Sets aside the committed checkpoints in `dir` past `step` (a replaced
// run's): renamed superseded-step-N; failures are reported, not returned.
void SetAsideAfter(const std::string& dir, int64_t step);
// After the checkpoint of `step` committed in r.dir: SetAsideAfter, the
// newest r.keep kept, killed saves' leftovers swept (another run's
// temporary directory only once untouched for an hour). Failures are
// reported, not returned.
void Retain(const SaveRequest& r, int64_t step);

// A safetensors file's metadata "crc32c:NAME": the CRC-32C of tensor NAME's
// bytes, 8 hex digits (checkpoint shards and exports; files written before
// these, and PyTorch's, have none).
inline constexpr char kCrcPrefix[] = "crc32c:";

// Adds to `metadata` the kCrcPrefix entry of each of `entries`.
void AddChecksums(const std::vector<SafetensorsEntry>& entries,
                  std::map<std::string, std::string>* metadata);

// DataLoss naming the file and the tensor when the CRC-32C `f` records for
// tensor `name` is not that of its bytes; OK when it records none. Each
// (file, tensor) in `verified` is checked once.
absl::Status VerifyChecksum(const SafetensorsFile& f, const std::string& name,
                            std::set<std::pair<std::string, std::string>>* verified);

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
