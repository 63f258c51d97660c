// User data sets for training: each step's global batch read from files the
// user prepared, as a BatchSource (batches.h): per graph input, the whole
// single-device tensor of the step (each rank slices its own part later).
//
// Specs (OpenUserData):
//
//   npy:DIR   One NumPy .npy file per graph input, DIR/<input name>.npy,
//             with every '/' of the name written as "__" (input "enc/x" is
//             DIR/enc__x.npy; two inputs mapping to one file name is an
//             error). Other files in DIR are ignored. Dimension 0 of every
//             file counts samples, and every file has the same number N.
//             The batch size B is the smallest first dimension among the
//             graph's inputs; an input whose first dimension is r * B holds
//             r rows per sample, so its file's shape is
//               (N, *shape[1:])       when r == 1 (x[B, 784] -> (N, 784)),
//               (N, r, *shape[1:])    when r > 1  (labels[B*S] -> (N, S)),
//             and a step's tensor is its B samples' rows in batch order.
//             Format: NPY versions 1.0, 2.0 and 3.0, C order, little-endian
//             (or '|' one-byte) dtypes f2 f4 f8 i1 i2 i4 i8 u1 u2 u4 u8 b1,
//             headers of at most 10000 bytes (numpy.load's default).
//             Files are parsed here from the NPY specification.
//   tokens:FILE[:uint16|uint32]
//             A flat little-endian token stream (default uint16) for a
//             language model whose only inputs are integer tokens[B, S] and
//             labels[B*S] (or [B, S]), as NewLmBatches. Sample i is the
//             window of S + 1 tokens from token i * S (non-overlapping):
//             tokens = its first S, labels = its last S (shifted by one).
//             N = (ntokens - 1) / S. A FILE containing ':' needs the dtype
//             suffix spelled out ("tokens:a:b.bin:uint16").
//
// Dtypes (npy). Float inputs: f32 and f64 inputs take f4 or f8 files (f8 ->
// f32 rounds to nearest, since NumPy's default float64 is the common case);
// f16 inputs take f2 files; bf16 inputs are Unimplemented (NumPy has no
// bfloat16). Integer inputs (i32, i64) take any integer file dtype, every
// value checked to fit, and bool files (b1: 0/1, e.g. a padding mask, which
// tools/export_fx.py makes an integer input). Integer files for float inputs (e.g. uint8 images)
// and float files for integer inputs are refused: scale or cast in NumPy.
//
// Order. Step k's global batch holds the samples at global positions
// k * B + j, j in [0, B), epoch e = position / N. Without a shuffle seed,
// position p is sample p mod N. With one, sample pi_e(p mod N), where pi_e
// is a pseudo-random permutation of [0, N) keyed by (seed, e): a 6-round
// Feistel network over the next even power of two >= N with cycle walking
// (counter-based, as tf.random.experimental.index_shuffle; O(1) memory and
// random access). A batch therefore depends only on (data, seed, k, B), not
// on the plan or world size: a resumed run continues the same sequence.
//
// Checks. Everything is checked in OpenUserData, before step 1: the spec,
// each file's presence (NotFound naming the path and the input), format,
// dtype, shape, size (truncated files), the sample counts (equal, at least
// one global batch), and every value of the whole file (read through
// once): floats finite, integers within [0, limit) where a consumer bounds
// them (an embedding's vocabulary, a loss's classes: IntegerInputLimit in
// batches.h), else within the input's dtype. Errors name the file, the row
// (sample) and the value. Other failures are InvalidArgument; nothing
// aborts.
//
// Files stay open for the source's lifetime and are read (pread) only as
// batches need them; they must not be modified or truncated meanwhile. Get
// says so, FailedPrecondition naming the file, when one was: its size or
// modification time differs from when it was opened, it ends before a
// sample, or a value read fails the checks above (a file replaced by a
// rename is not seen: the source reads the one it opened).
//
// Thread-safety: a source is immutable once opened; Get may be called from
// several threads at once. It keeps no reference to the graph.
#ifndef HAP_EXECUTOR_DATA_USER_DATA_H_
#define HAP_EXECUTOR_DATA_USER_DATA_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "executor/data/batches.h"
#include "planner/graph/graph.h"

namespace hap::data {

struct DataOptions {
  // Shuffle the samples of every epoch with a permutation keyed by this
  // seed and the epoch; unset (the default): files' order, epoch after epoch.
  std::optional<uint64_t> shuffle_seed;
};

// A BatchSource over a user data set that also says how big it is.
class UserData : public BatchSource {
 public:
  // N, the samples of one epoch.
  virtual int64_t num_samples() const = 0;
  int64_t data_size() const override { return num_samples(); }
  // B, the samples of one step (from the graph).
  virtual int64_t batch_size() const = 0;
  // One line for logs: spec, samples, inputs and file dtypes.
  virtual std::string Describe() const = 0;
  // The global batch of `step` (>= 0); InvalidArgument for a negative
  // step, OutOfRange when step * B overflows, FailedPrecondition when a
  // data file changed since it was opened.
  absl::StatusOr<GlobalBatch> Get(int64_t step) override = 0;
};

// Opens `spec` ("npy:DIR" or "tokens:FILE[:uint16|uint32]") for graph `g`
// and checks all of it (see above). InvalidArgument for a malformed spec,
// NotFound for a missing directory or file.
absl::StatusOr<std::unique_ptr<UserData>> OpenUserDataSet(const std::string& spec,
                                                          const graph::Graph& g,
                                                          const DataOptions& o);

// OpenUserDataSet as a plain BatchSource.
absl::StatusOr<std::unique_ptr<BatchSource>> OpenUserData(const std::string& spec,
                                                          const graph::Graph& g,
                                                          const DataOptions& o);

// The file name of graph input `input_name` in an npy:DIR data set:
// "enc/x" -> "enc__x.npy".
std::string NpyFileName(const std::string& input_name);

}  // namespace hap::data

#endif  // HAP_EXECUTOR_DATA_USER_DATA_H_
