// safetensors files, written and read as the format's specification says
// (huggingface/safetensors): an 8-byte little-endian header length N, N
// bytes of JSON header (an object: tensor name -> {"dtype", "shape",
// "data_offsets": [begin, end]} relative to the data buffer, plus an
// optional "__metadata__" object of strings), padded with spaces to a
// multiple of 8, then the data buffer: every tensor row-major, little-endian,
// back to back with no gaps or overlaps. Standard readers (PyTorch's, the
// Rust crate) open what WriteSafetensors writes; SafetensorsFile reads any
// conforming file, mapped read-only so that a reader touches only the bytes
// it copies.
#ifndef HAP_EXECUTOR_CHECKPOINT_SAFETENSORS_H_
#define HAP_EXECUTOR_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "executor/runtime/tensor.h"

namespace hap::executor::checkpoint {

// "F32", "F64", "F16", "BF16", "I32", "I64".
absl::string_view SafetensorsDType(DType t);
// InvalidArgument for a dtype we do not train with (U8, BOOL, F8_*, ...).
absl::StatusOr<DType> FromSafetensorsDType(absl::string_view s);
// The bytes of an element of any dtype of the specification (BOOL, U8, I8,
// I16, U16, U32, U64, F8_E4M3, F8_E5M2 besides ours); 0 for another name.
int SafetensorsDTypeWidth(absl::string_view s);

// Readers reject headers larger than this (the specification's limit).
inline constexpr int64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  SafetensorsEntry(std::string name, TensorView data, std::string other_dtype = "")
      : name(std::move(name)), data(std::move(data)), other_dtype(std::move(other_dtype)) {}
  std::string name;
  TensorView data;  // dtype, shape, and the bytes to write
  // Set: the entry is of this safetensors dtype instead of data.dtype's
  // (one we do not train with, such as a model's BOOL buffer): data.shape
  // elements of SafetensorsDTypeWidth(other_dtype) bytes from data.data.
  std::string other_dtype;
};

// Writes `entries` to `path` (created or truncated) and fsyncs it. Tensors
// are laid out largest element size first, then by name, so that every
// tensor starts aligned to its element size. InvalidArgument for an empty
// or repeated name; Internal naming the file and errno on a failed write.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata = {});

// A safetensors file mapped read-only. Thread-safe after Open.
class SafetensorsFile {
 public:
  struct Tensor {
    DType dtype;
    Shape shape;
    int64_t begin = 0;  // in the data buffer
    int64_t end = 0;
  };

  // Maps and validates `path`: the header length fits the file and the
  // 100 MB limit, the header is a JSON object of well-formed entries of a
  // dtype we support, each entry's byte count matches its shape, and the
  // entries tile the data buffer exactly (the specification's rule).
  // NotFound for a missing file; DataLoss, naming the file (and the tensor
  // where there is one), for anything malformed or truncated, and for a path
  // that is not a regular file (a named pipe is not waited on).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  // The entries of dtypes we do not train with (BOOL, U8, ...: a model's
  // buffers in a state_dict), by name: their dtype, shape and bytes (in the
  // mapping, read-only).
  struct Other {
    std::string dtype;
    Shape shape;
    absl::string_view bytes;
  };
  const std::map<std::string, Other>& others() const { return others_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's bytes in the mapping (read-only memory: never write
  // through the view). NotFound naming the tensor and the file.
  absl::StatusOr<TensorView> View(const std::string& name) const;
  // Copies `bytes` bytes from byte `offset` of tensor `name` into `dst`
  // with pread: a sequential read without page faults on the mapping, for
  // large contiguous pieces. OutOfRange past the tensor's end.
  absl::Status ReadBytes(const std::string& name, int64_t offset, int64_t bytes,
                         void* dst) const;
  // The CRC-32C (crc32c.h) of tensor `name`'s bytes, read with pread in
  // chunks. Errors as ReadBytes.
  absl::StatusOr<uint32_t> Crc32cOf(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  int64_t map_bytes_ = 0;
  const char* data_ = nullptr;  // the data buffer
  int fd_ = -1;                 // kept open for ReadBytes
  int64_t data_offset_ = 0;     // of the data buffer in the file
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, Other> others_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_SAFETENSORS_H_
