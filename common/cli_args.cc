#include "common/cli_args.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace hap::tools {

std::optional<FlagArg> ParseFlagArg(const std::string& s) {
  if (s.size() <= 1 || s[0] != '-') return std::nullopt;
  FlagArg f;
  f.name = s.substr(s[1] == '-' ? 2 : 1);
  if (auto eq = f.name.find('='); eq != std::string::npos) {
    f.value = f.name.substr(eq + 1);
    f.name = f.name.substr(0, eq);
  }
  return f;
}

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::set<std::string>& value_flags,
                                 const std::set<std::string>& bool_flags) {
  Args a;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (std::optional<FlagArg> flag = ParseFlagArg(s)) {
      const std::string& name = flag->name;
      std::string value = flag->value.value_or("");
      const bool has_value = flag->value.has_value();
      if (bool_flags.count(name)) {
        if (has_value) {
          return absl::InvalidArgumentError(
              absl::StrCat("flag --", name, " takes no value"));
        }
        a.values_.emplace(name, "true");
      } else if (value_flags.count(name)) {
        if (!has_value) {
          if (i + 1 >= argv.size()) {
            return absl::InvalidArgumentError(
                absl::StrCat("flag --", name, " needs a value"));
          }
          value = argv[++i];
        }
        a.values_.emplace(name, value);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown flag --", name, " (see --help)"));
      }
    } else {
      a.positional_.push_back(s);
    }
  }
  return a;
}

std::string Args::Get(const std::string& flag, const std::string& def) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return def;
  std::string v = it->second;
  for (auto r = values_.equal_range(flag); r.first != r.second; ++r.first) {
    v = r.first->second;  // the last occurrence wins
  }
  return v;
}

std::string Args::EnvName(const std::string& flag) {
  std::string env = "HAP_";
  for (char c : flag) {
    env += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return env;
}

std::string Args::GetOrEnv(const std::string& flag, const std::string& def) const {
  if (Has(flag)) return Get(flag);
  if (const char* v = std::getenv(EnvName(flag).c_str())) return v;
  return def;
}

std::vector<std::string> Args::GetAll(const std::string& flag) const {
  std::vector<std::string> out;
  for (auto r = values_.equal_range(flag); r.first != r.second; ++r.first) {
    out.push_back(r.first->second);
  }
  return out;
}

absl::StatusOr<double> Args::Number(const std::string& flag, double def) const {
  if (!Has(flag)) return def;
  double v;
  std::string s = Get(flag);
  if (!absl::SimpleAtod(s, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", flag, " must be a number, got '", s, "'"));
  }
  return v;
}

namespace {

// A range bound as a reader writes it: whole numbers in full (1073741824,
// not 1.07374e+09), others as StrCat prints them.
std::string Bound(double x) {
  if (x == std::floor(x) && std::fabs(x) < 0x1p53) return absl::StrCat(static_cast<int64_t>(x));
  return absl::StrCat(x);
}

}  // namespace

absl::StatusOr<double> Args::NumberOrEnv(const std::string& flag, double def, double lo, double hi,
                                         bool whole) const {
  const std::string v = GetOrEnv(flag, "");
  if (v.empty()) return def;
  double x;
  if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x < lo || x > hi ||
      (whole && x != std::floor(x))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, " (or ", EnvName(flag), ") must be a ", whole ? "whole number" : "number",
        std::isfinite(hi) ? absl::StrCat(" from ", Bound(lo), " to ", Bound(hi))
                          : absl::StrCat(" >= ", Bound(lo)),
        ", got '", v, "'"));
  }
  return x;
}

absl::StatusOr<std::string> ReadInputFile(const std::string& path, const std::string& what,
                                          int64_t max_bytes) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(what, "'", path, "' is a directory"));
  }
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    // The system's reason: a missing file, a name too long, no permission.
    const int err = errno;
    const std::string why = absl::StrCat("cannot open ", what, "'", path,
                                         "': ", err != 0 ? std::strerror(err) : "unknown error");
    if (err == ENOENT) return absl::NotFoundError(why);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  std::string bytes;
  std::vector<char> chunk(1 << 20);
  while (f) {
    const int64_t room = max_bytes + 1 - static_cast<int64_t>(bytes.size());
    f.read(chunk.data(), static_cast<std::streamsize>(
                             std::min<int64_t>(room, static_cast<int64_t>(chunk.size()))));
    bytes.append(chunk.data(), static_cast<size_t>(f.gcount()));
    if (static_cast<int64_t>(bytes.size()) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, "'", path, "' is larger than ",
                                                     max_bytes, " bytes (is it the file meant?)"));
    }
  }
  if (f.bad()) return absl::DataLossError(absl::StrCat("cannot read ", what, "'", path, "'"));
  if (bytes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, "'", path, "' is empty"));
  }
  return bytes;
}

namespace {

// Writes `bytes` to the open `f` and closes it; the error names `what` and
// `path` with the system's reason.
absl::Status WriteAndClose(std::FILE* f, std::string_view bytes, const std::string& path,
                           const std::string& what) {
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const int write_errno = errno;
  const bool flushed = written && std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  const int flush_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!written || !flushed || !closed) {
    return absl::InternalError(absl::StrCat("cannot write ", what, "'", path, "': ",
                                            std::strerror(!written   ? write_errno
                                                          : !flushed ? flush_errno
                                                                     : errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteOutputFile(const std::string& path, std::string_view bytes,
                             const std::string& what) {
  struct stat st;
  const bool exists = lstat(path.c_str(), &st) == 0;
  auto in_place = [&]() {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot write ", what, "'", path, "': ", std::strerror(errno)));
    }
    return WriteAndClose(f, bytes, path, what);
  };
  // A device, a pipe (/dev/stdout) or a link: written in place, as the
  // user named it (a rename would replace it with a regular file).
  if (exists && !S_ISREG(st.st_mode)) return in_place();
  // A regular file is replaced whole: written beside it and renamed over
  // it. Written in place, a failed write (a full disk, a quota) left the
  // old file truncated, the old plan or cluster lost with the new one.
  // A short name beside it: the path's own name plus a suffix could pass
  // the file system's name limit where the path itself does not.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
  // Made 0666 less the umask as any new file (the kernel applies it:
  // reading it with umask() would change it for the process's other
  // threads meanwhile), then given the old file's mode.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    tmp = absl::StrCat(dir, ".hap-out-", getpid(), "-", attempt);
    fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    // A writable file in a directory we may not add to: in place, as before.
    if (exists && (errno == EACCES || errno == EPERM || errno == EROFS)) return in_place();
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", what, "'", path, "': ", std::strerror(errno)));
  }
  std::FILE* f = !exists || fchmod(fd, st.st_mode & 07777) == 0 ? fdopen(fd, "wb") : nullptr;
  if (f == nullptr) {
    const int e = errno;
    close(fd);
    unlink(tmp.c_str());
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", what, "'", path, "': ", std::strerror(e)));
  }
  absl::Status s = WriteAndClose(f, bytes, path, what);
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    s = absl::InternalError(
        absl::StrCat("cannot write ", what, "'", path, "': ", std::strerror(errno)));
  }
  if (!s.ok()) unlink(tmp.c_str());
  return s;
}

absl::StatusOr<int64_t> Args::Integer(const std::string& flag, int64_t def, int64_t min,
                                      int64_t max) const {
  if (!Has(flag)) return def;
  const std::string s = Get(flag);
  int64_t v;
  double d;
  // 2^63 is the first double past int64_t; casting a double from there on is UB.
  bool ok = absl::SimpleAtoi(s, &v);
  if (!ok && absl::SimpleAtod(s, &d) && d == std::floor(d) && d >= -0x1p63 && d < 0x1p63) {
    v = static_cast<int64_t>(d);
    ok = true;
  }
  if (!ok || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat("flag --", flag, " must be an integer from ",
                                                   min, " to ", max, ", got '", s, "'"));
  }
  return v;
}

}  // namespace hap::tools
