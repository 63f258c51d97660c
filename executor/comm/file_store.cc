// A rendezvous store in a shared directory: one file a key, written under a
// temporary name and renamed into place, so a reader never sees half a
// value.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "executor/comm/communicator.h"

namespace hap::executor {
namespace {

// Keys become file names: anything but [A-Za-z0-9._-] is escaped as %XX,
// and so is a leading '.', so that no key names the directory ("." and
// ".."), a hidden file or a temporary file of Set (".tmp."). The empty key
// is "%", which no other key gives (every other '%' has two digits after).
std::string FileName(const std::string& key) {
  if (key.empty()) return "%";
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || (c == '.' && !out.empty()) || c == '_' || c == '-') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

class FileStore : public RendezvousStore {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    std::string final_path = absl::StrCat(dir_, "/", FileName(key));
    // The temporary name leaves the key out, so that any key whose own file
    // name fits can be set.
    std::string tmp = absl::StrCat(dir_, "/.tmp.", getpid(), ".", std::random_device{}());
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) return Failure("cannot write", key, tmp, errno);
    size_t written = 0;
    while (written < value.size()) {
      const ssize_t n = write(fd, value.data() + written, value.size() - written);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        close(fd);
        unlink(tmp.c_str());
        return Failure("cannot write", key, tmp, err);
      }
      written += static_cast<size_t>(n);
    }
    if (close(fd) != 0) {
      const int err = errno;
      unlink(tmp.c_str());
      return Failure("cannot write", key, tmp, err);
    }
    if (std::rename(tmp.c_str(), final_path.c_str()) != 0) {
      const int err = errno;
      unlink(tmp.c_str());
      return Failure("cannot publish", key, final_path, err);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override {
    std::string path = absl::StrCat(dir_, "/", FileName(key));
    const absl::Time deadline = absl::Now() + timeout;
    absl::Duration backoff = absl::Milliseconds(1);
    while (true) {
      const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) return ReadAll(fd, key, path);
      // Only an absent file is a key not set yet: any other failure (a
      // name too long, a file this user cannot read) would last the whole
      // timeout and be reported as a key that never came.
      const int err = errno;
      if (err != ENOENT && err != EINTR) return Failure("cannot read", key, path, err);
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("rendezvous store: key '", key, "' did not appear in ",
                         dir_, " within ", absl::FormatDuration(timeout)));
      }
      absl::SleepFor(std::min(backoff, deadline - absl::Now()));
      backoff = std::min(backoff * 2, absl::Milliseconds(50));
    }
  }

 private:
  // "<what> key '<key>' (<path>): <reason>": InvalidArgument for a key whose
  // file name is too long, Unavailable otherwise.
  static absl::Status Failure(const char* what, const std::string& key, const std::string& path,
                              int err) {
    return absl::Status(
        err == ENAMETOOLONG ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kUnavailable,
        absl::StrCat("rendezvous store: ", what, " key '", key, "' (", path,
                     "): ", std::strerror(err)));
  }

  // The whole file behind `fd`, which it closes.
  static absl::StatusOr<std::string> ReadAll(int fd, const std::string& key,
                                             const std::string& path) {
    std::string value;
    char chunk[4096];
    while (true) {
      const ssize_t n = read(fd, chunk, sizeof(chunk));
      if (n > 0) {
        value.append(chunk, static_cast<size_t>(n));
      } else if (n == 0) {
        break;
      } else if (errno != EINTR) {
        const int err = errno;
        close(fd);
        return Failure("cannot read", key, path, err);
      }
    }
    close(fd);
    return value;
  }

  std::string dir_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RendezvousStore>> NewFileStore(
    const std::string& dir) {
  struct stat st;
  if (dir.empty() || stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      access(dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rendezvous directory '", dir, "' is not a writable directory"));
  }
  return std::unique_ptr<RendezvousStore>(new FileStore(dir));
}

}  // namespace hap::executor
