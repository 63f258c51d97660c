// Durable file writes for checkpoints: every error names the file and the
// system's reason, and nothing counts as written before fsync succeeded.
#ifndef HAP_EXECUTOR_CHECKPOINT_FILE_UTIL_H_
#define HAP_EXECUTOR_CHECKPOINT_FILE_UTIL_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hap::executor::checkpoint {

// A file being written. Closes (without syncing) on destruction.
//
// Direct mode (large files: checkpoint shards) writes through an aligned
// staging buffer with O_DIRECT, bypassing the page cache: a checkpoint is
// not read back soon, and on virtual disks this is up to twice as fast as
// filling the page cache and flushing it at fsync. The last partial block
// is written through the page cache. Where O_DIRECT is refused (tmpfs,
// some network file systems), at open or at the first write (EINVAL), the
// writer falls back to buffered writes. A write that makes no progress is
// an error.
class FileWriter {
 public:
  // Creates or truncates `path`.
  static absl::StatusOr<FileWriter> Create(const std::string& path, bool direct = false);
  FileWriter(FileWriter&& o) noexcept;
  FileWriter& operator=(FileWriter&&) = delete;
  ~FileWriter();

  absl::Status Write(const void* data, size_t bytes);
  // fsync, then close; the first error of either.
  absl::Status SyncAndClose();

 private:
  FileWriter(std::string path, int fd, bool direct);
  absl::Status WriteAll(const char* p, size_t bytes);
  absl::Status FlushStaging(bool last);
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  bool buffered_fallback_ = false;  // direct mode, O_DIRECT cleared on the fd
  char* staging_ = nullptr;  // direct mode: kStagingBytes, 4096-aligned
  size_t staged_ = 0;
};

// Writes `contents` to `path` and fsyncs it.
absl::Status WriteFileSynced(const std::string& path, absl::string_view contents);
// fsync of a directory, so that the names created or renamed in it persist.
absl::Status SyncDirectory(const std::string& path);
// The whole file. NotFound for a missing one; InvalidArgument for one that
// is not a regular file (a directory, a named pipe, a device), which it neither waits on
// nor reads; otherwise errors name the file and the system's reason for the
// call that failed.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_FILE_UTIL_H_
