#include "executor/checkpoint/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "planner/util/status_macros.h"

namespace hap::executor::checkpoint {
namespace {

absl::Status Errno(absl::string_view what, const std::string& path, int err) {
  std::string msg = absl::StrCat("cannot ", what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == EACCES || err == EPERM || err == EROFS) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

}  // namespace

absl::StatusOr<FileWriter> FileWriter::Create(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create", path, errno);
  return FileWriter(path, fd);
}

FileWriter::FileWriter(FileWriter&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_) {
  o.fd_ = -1;
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status FileWriter::Write(const void* data, size_t bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", path_, errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

void FileWriter::Reserve(int64_t bytes) {
  if (fd_ >= 0 && bytes > 0) (void)::fallocate(fd_, 0, 0, bytes);  // an optimisation only
}

absl::Status FileWriter::SyncAndClose() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return Errno("sync", path_, err);
  }
  if (::close(fd) != 0) return Errno("close", path_, errno);
  return absl::OkStatus();
}

absl::Status WriteFileSynced(const std::string& path, absl::string_view contents) {
  HAP_ASSIGN_OR_RETURN(FileWriter w, FileWriter::Create(path));
  HAP_RETURN_IF_ERROR(w.Write(contents.data(), contents.size()));
  return w.SyncAndClose();
}

absl::Status SyncDirectory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open directory", path, errno);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return Errno("sync directory", path, err);
  }
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Errno("open", path, errno != 0 ? errno : ENOENT);
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return absl::InternalError(absl::StrCat("cannot read ", path));
  return ss.str();
}

}  // namespace hap::executor::checkpoint
