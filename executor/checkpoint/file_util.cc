#include "executor/checkpoint/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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

namespace {
constexpr size_t kAlign = 4096;
constexpr size_t kStagingBytes = 8 << 20;
}  // namespace

FileWriter::FileWriter(std::string path, int fd, bool direct)
    : path_(std::move(path)), fd_(fd), direct_(direct) {
  if (direct_) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, kStagingBytes) == 0) {
      staging_ = static_cast<char*>(p);
    } else {
      // Buffered writes, on a descriptor without O_DIRECT: left on, every
      // unaligned write failed EINVAL and the fallback (direct_ only) was
      // skipped.
      direct_ = false;
      const int fl = ::fcntl(fd_, F_GETFL);
      if (fl >= 0) (void)::fcntl(fd_, F_SETFL, fl & ~O_DIRECT);
    }
  }
}

absl::StatusOr<FileWriter> FileWriter::Create(const std::string& path, bool direct) {
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (fd >= 0) return FileWriter(path, fd, true);
    if (errno != EINVAL) return Errno("create", path, errno);
    // The file system refuses O_DIRECT: buffered writes.
  }
  int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) return Errno("create", path, errno);
  return FileWriter(path, fd, false);
}

FileWriter::FileWriter(FileWriter&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(o.fd_),
      direct_(o.direct_),
      buffered_fallback_(o.buffered_fallback_),
      staging_(o.staging_),
      staged_(o.staged_) {
  o.fd_ = -1;
  o.staging_ = nullptr;
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
  free(staging_);
}

absl::Status FileWriter::WriteAll(const char* p, size_t bytes) {
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EINVAL && direct_ && !buffered_fallback_) {
        // The file system accepted O_DIRECT at open but refuses the direct
        // write (alignment rules of its own): buffered writes from here on.
        const int fl = ::fcntl(fd_, F_GETFL);
        if (fl < 0 || ::fcntl(fd_, F_SETFL, fl & ~O_DIRECT) < 0) {
          return Errno("write (clearing O_DIRECT)", path_, errno);
        }
        buffered_fallback_ = true;
        continue;
      }
      return Errno("write", path_, err);
    }
    if (n == 0) {
      // No progress and no error: retrying could loop forever.
      return absl::InternalError(
          absl::StrCat("cannot write ", path_, ": the system wrote 0 of ", bytes, " bytes"));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FileWriter::FlushStaging(bool last) {
  const size_t aligned = staged_ / kAlign * kAlign;
  if (aligned > 0) HAP_RETURN_IF_ERROR(WriteAll(staging_, aligned));
  const size_t tail = staged_ - aligned;
  if (tail > 0) {
    if (!last) {
      std::memmove(staging_, staging_ + aligned, tail);
    } else {
      // The last partial block goes through the page cache.
      if (!buffered_fallback_) {
        const int fl = ::fcntl(fd_, F_GETFL);
        if (fl < 0 || ::fcntl(fd_, F_SETFL, fl & ~O_DIRECT) < 0) {
          return Errno("write (clearing O_DIRECT)", path_, errno);
        }
        buffered_fallback_ = true;
      }
      HAP_RETURN_IF_ERROR(WriteAll(staging_ + aligned, tail));
    }
  }
  staged_ = last ? 0 : tail;
  return absl::OkStatus();
}

absl::Status FileWriter::Write(const void* data, size_t bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  const char* p = static_cast<const char*>(data);
  if (!direct_) return WriteAll(p, bytes);
  while (bytes > 0) {
    const size_t n = std::min(bytes, kStagingBytes - staged_);
    std::memcpy(staging_ + staged_, p, n);
    staged_ += n;
    p += n;
    bytes -= n;
    if (staged_ == kStagingBytes) HAP_RETURN_IF_ERROR(FlushStaging(/*last=*/false));
  }
  return absl::OkStatus();
}

absl::Status FileWriter::SyncAndClose() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  absl::Status flushed = direct_ ? FlushStaging(/*last=*/true) : absl::OkStatus();
  int fd = fd_;
  fd_ = -1;
  if (!flushed.ok()) {
    ::close(fd);
    return flushed;
  }
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
  // O_NONBLOCK: opening a named pipe would wait for a writer; it is refused
  // below, as are devices (/dev/zero would be read until memory runs out).
  // No effect on regular files.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Errno("open", path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Errno("stat", path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    // A directory too: where a checkpoint file should be, it is damage
    // (DataLoss to the reader), not an I/O failure worth retrying.
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a regular file", S_ISDIR(st.st_mode) ? " (a directory)" : ""));
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      const int err = errno;  // before close() can change it
      if (err == EINTR) continue;
      ::close(fd);
      return Errno("read", path, err);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace hap::executor::checkpoint
