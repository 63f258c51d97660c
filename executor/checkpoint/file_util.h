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
class FileWriter {
 public:
  // Creates or truncates `path`.
  static absl::StatusOr<FileWriter> Create(const std::string& path);
  FileWriter(FileWriter&& o) noexcept;
  FileWriter& operator=(FileWriter&&) = delete;
  ~FileWriter();

  absl::Status Write(const void* data, size_t bytes);
  // Reserves `bytes` of disk for the file (fallocate) so that writing a
  // new file does not allocate block by block; best effort (a file system
  // without fallocate just writes).
  void Reserve(int64_t bytes);
  // fsync, then close; the first error of either.
  absl::Status SyncAndClose();

 private:
  FileWriter(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// Writes `contents` to `path` and fsyncs it.
absl::Status WriteFileSynced(const std::string& path, absl::string_view contents);
// fsync of a directory, so that the names created or renamed in it persist.
absl::Status SyncDirectory(const std::string& path);
// The whole file. NotFound for a missing one.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace hap::executor::checkpoint

#endif  // HAP_EXECUTOR_CHECKPOINT_FILE_UTIL_H_
