#include "executor/data/user_data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "executor/runtime/counter_random.h"

// The .npy dtypes accepted ('<') and token streams are little-endian; the
// copies below are plain memcpy, so the host must be too.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "user_data reads little-endian files with plain loads");

namespace hap::data {
namespace {

using graph::DType;
using graph::Shape;

std::string ErrnoText(int e) { return std::strerror(e); }

// ---------------------------------------------------------------------------
// A data file held open for the lifetime of the object and read with
// pread(2). Not mapped: a file truncated under a mapping faulted the process
// (SIGBUS) at the next batch that read past its new end; a short read is an
// error naming the file. Thread-safe: pread keeps no shared offset.
class DataFile {
 public:
  // NotFound when `path` does not exist; InvalidArgument when it is not a
  // regular file or cannot be opened.
  static absl::StatusOr<std::unique_ptr<DataFile>> Open(const std::string& path) {
    // O_NONBLOCK: opening a named pipe would wait for a writer; it is
    // refused below as not a regular file. (No effect on regular files.)
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      int e = errno;
      if (e == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
      return absl::InvalidArgumentError(absl::StrCat("cannot open ", path, ": ", ErrnoText(e)));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int e = errno;
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("cannot stat ", path, ": ", ErrnoText(e)));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
    }
    return std::unique_ptr<DataFile>(new DataFile(path, fd, st));
  }

  ~DataFile() { ::close(fd_); }
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;

  const std::string& path() const { return path_; }
  // The size at Open.
  uint64_t size() const { return static_cast<uint64_t>(opened_.st_size); }

  // FailedPrecondition naming the file when its size or modification time
  // is no longer what it was at Open (rewritten or truncated while training
  // reads it: the checks at open no longer hold for what it holds).
  absl::Status CheckUnchanged() const {
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      int e = errno;
      return absl::FailedPreconditionError(absl::StrCat("cannot stat ", path_, ": ", ErrnoText(e)));
    }
    if (st.st_size != opened_.st_size) {
      return Changed(absl::StrCat("it held ", opened_.st_size, " bytes, now ", st.st_size));
    }
    if (st.st_mtim.tv_sec != opened_.st_mtim.tv_sec ||
        st.st_mtim.tv_nsec != opened_.st_mtim.tv_nsec) {
      return Changed("it was written to");
    }
    return absl::OkStatus();
  }

  // Reads n bytes at `offset` into `dst`: FailedPrecondition naming the file
  // when it ends before them (truncated since Open), InvalidArgument when
  // the read fails.
  absl::Status Read(uint64_t offset, size_t n, void* dst) const {
    auto* p = static_cast<unsigned char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        int e = errno;
        return absl::InvalidArgumentError(absl::StrCat("cannot read ", path_, ": ", ErrnoText(e)));
      }
      if (r == 0) {
        return Changed(absl::StrCat("it ends before byte ", offset + n, " of the ", size(),
                                    " it held (truncated)"));
      }
      p += r;
      offset += static_cast<uint64_t>(r);
      n -= static_cast<size_t>(r);
    }
    return absl::OkStatus();
  }

 private:
  DataFile(std::string path, int fd, const struct stat& st)
      : path_(std::move(path)), fd_(fd), opened_(st) {}

  absl::Status Changed(absl::string_view how) const {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, " changed since it was opened: ", how,
                     "; data files must stay as they are while training reads them"));
  }

  std::string path_;
  int fd_;
  struct stat opened_;
};

// Calls first_bad(chunk, n) over the `count` elements of `item_bytes` each
// at `offset` in `f`, a chunk at a time (first_bad returns the index in the
// chunk of an element it refuses, or -1); the index of the first refused
// element, or -1.
template <typename Fn>
absl::StatusOr<int64_t> ScanElements(const DataFile& f, uint64_t offset, int64_t count,
                                     int item_bytes, Fn first_bad) {
  const int64_t per_chunk = (int64_t{1} << 20) / item_bytes;
  std::vector<unsigned char> buf(static_cast<size_t>(std::min(count, per_chunk) * item_bytes));
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(per_chunk, count - done);
    HAP_RETURN_IF_ERROR(f.Read(offset + static_cast<uint64_t>(done * item_bytes),
                               static_cast<size_t>(n * item_bytes), buf.data()));
    const int64_t i = first_bad(buf.data(), n);
    if (i >= 0) return done + i;
    done += n;
  }
  return -1;
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (!dir.empty() && dir.back() == '/') return dir + name;
  return absl::StrCat(dir, "/", name);
}

// Element i of a little-endian array of T at `base` (any alignment).
template <typename T>
T Load(const unsigned char* base, int64_t i) {
  T v;
  std::memcpy(&v, base + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

// ---------------------------------------------------------------------------
// The sample order (user_data.h, "Order").
class SampleOrder {
 public:
  SampleOrder(int64_t n, std::optional<uint64_t> seed) : n_(n), seed_(seed) {
    int bits = 1;
    while (bits < 63 && (int64_t{1} << bits) < n_) ++bits;
    half_bits_ = (bits + 1) / 2;
    half_mask_ = (uint64_t{1} << half_bits_) - 1;
  }

  // The samples of `step`'s global batch of `b`.
  absl::StatusOr<std::vector<int64_t>> Step(int64_t step, int64_t b) const {
    if (step < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
    }
    if (step > (std::numeric_limits<int64_t>::max() - b) / b) {
      return absl::OutOfRangeError(
          absl::StrCat("step ", step, " times the batch of ", b, " overflows 64 bits"));
    }
    std::vector<int64_t> samples(static_cast<size_t>(b));
    for (int64_t j = 0; j < b; ++j) samples[j] = At(step * b + j);
    return samples;
  }

  // The sample at global position `p` >= 0.
  int64_t At(int64_t p) const {
    int64_t pos = p % n_;
    if (!seed_ || n_ == 1) return pos;
    uint64_t epoch = static_cast<uint64_t>(p / n_);
    uint64_t key = executor::CounterKey(*seed_, kShuffleDomain, epoch);
    // Cycle walking: the Feistel network permutes [0, 2^(2h)) ⊇ [0, n), so
    // iterating it from a position in [0, n) returns to [0, n) (its cycle
    // holds the start), at most ~4 steps on average since 2^(2h) < 4n.
    uint64_t x = static_cast<uint64_t>(pos);
    do {
      x = Feistel(x, key);
    } while (x >= static_cast<uint64_t>(n_));
    return static_cast<int64_t>(x);
  }

 private:
  static constexpr uint64_t kShuffleDomain = 0x75736572'64617461ULL;  // "userdata"
  static constexpr int kRounds = 6;

  // A balanced Feistel network on 2 * half_bits_ bits: a bijection for any
  // round function; Mix64 of (key, round, half) makes it pseudo-random.
  uint64_t Feistel(uint64_t x, uint64_t key) const {
    uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (int r = 0; r < kRounds; ++r) {
      uint64_t f = executor::Mix64(key ^ executor::Mix64((uint64_t(r) << 56) | right));
      uint64_t next = left ^ (f & half_mask_);
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }

  int64_t n_;
  std::optional<uint64_t> seed_;
  int half_bits_ = 1;
  uint64_t half_mask_ = 1;
};

// ---------------------------------------------------------------------------
// NPY parsing (numpy.lib.format): magic "\x93NUMPY", major, minor, header
// length (uint16 in 1.0, uint32 in 2.0 / 3.0), an ASCII (3.0: UTF-8) Python
// dict literal {'descr': ..., 'fortran_order': ..., 'shape': (...)}, padded
// with spaces and '\n', then the data.

struct PyValue {
  enum class Kind { kString, kBool, kNone, kInt, kSequence };
  Kind kind = Kind::kNone;
  std::string str;
  bool boolean = false;
  int64_t integer = 0;
  std::vector<PyValue> items;
};

// Parses the Python literals a .npy header may hold: strings, True, False,
// None, integers (Python 2's "3L" too), tuples and lists.
class PyLiteralParser {
 public:
  explicit PyLiteralParser(absl::string_view s) : s_(s) {}

  absl::StatusOr<std::map<std::string, PyValue>> ParseDict() {
    std::map<std::string, PyValue> dict;
    SkipSpace();
    if (!Consume('{')) return Error("expected '{'");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      HAP_ASSIGN_OR_RETURN(PyValue key, ParseValue(0));
      if (key.kind != PyValue::Kind::kString) return Error("a key that is not a string");
      SkipSpace();
      if (!Consume(':')) return Error("expected ':'");
      HAP_ASSIGN_OR_RETURN(PyValue value, ParseValue(0));
      dict[key.str] = std::move(value);
      SkipSpace();
      if (Consume('}')) break;
      if (!Consume(',')) return Error("expected ',' or '}'");
    }
    SkipSpace();
    if (pos_ != s_.size()) return Error("text after the closing '}'");
    return dict;
  }

 private:
  static constexpr int kMaxDepth = 8;

  absl::StatusOr<PyValue> ParseValue(int depth) {
    if (depth > kMaxDepth) return Error("nesting too deep");
    SkipSpace();
    if (pos_ >= s_.size()) return Error("unexpected end");
    char c = s_[pos_];
    PyValue v;
    if (c == '\'' || c == '"') {
      ++pos_;
      v.kind = PyValue::Kind::kString;
      while (pos_ < s_.size() && s_[pos_] != c) {
        if (s_[pos_] == '\\' && pos_ + 1 < s_.size()) ++pos_;
        v.str += s_[pos_++];
      }
      if (!Consume(c)) return Error("unterminated string");
      return v;
    }
    if (c == '(' || c == '[') {
      char close = c == '(' ? ')' : ']';
      ++pos_;
      v.kind = PyValue::Kind::kSequence;
      while (true) {
        SkipSpace();
        if (Consume(close)) break;
        HAP_ASSIGN_OR_RETURN(PyValue item, ParseValue(depth + 1));
        v.items.push_back(std::move(item));
        SkipSpace();
        if (Consume(close)) break;
        if (!Consume(','))
          return Error(absl::StrCat("expected ',' or '", std::string(1, close), "'"));
      }
      return v;
    }
    if (c == '-' || absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      size_t start = pos_++;
      while (pos_ < s_.size() && absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
      v.kind = PyValue::Kind::kInt;
      if (pos_ == start + 1 && c == '-') return Error("'-' without digits");
      if (!absl::SimpleAtoi(s_.substr(start, pos_ - start), &v.integer)) {
        return Error("an integer out of range");
      }
      if (pos_ < s_.size() && (s_[pos_] == 'L' || s_[pos_] == 'l')) ++pos_;
      return v;
    }
    size_t start = pos_;
    while (pos_ < s_.size() && absl::ascii_isalpha(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    absl::string_view word = s_.substr(start, pos_ - start);
    if (word == "True" || word == "False") {
      v.kind = PyValue::Kind::kBool;
      v.boolean = word == "True";
      return v;
    }
    if (word == "None") return v;
    pos_ = start;
    return Error(absl::StrCat("unexpected '", std::string(1, c), "'"));
  }

  void SkipSpace() {
    while (pos_ < s_.size() && absl::ascii_isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Consume(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("malformed .npy header \"",
                                                   absl::StripAsciiWhitespace(s_.substr(0, 200)),
                                                   "\": ", what, " at offset ", pos_));
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

std::string PyShape(const Shape& s) {
  if (s.size() == 1) return absl::StrCat("(", s[0], ",)");
  return absl::StrCat("(", absl::StrJoin(s, ", "), ")");
}

// An array in a .npy file.
struct NpyArray {
  std::string descr;  // as written: "<f4"
  char kind = 'f';    // 'f', 'i', 'u' or 'b' (bool)
  int item_bytes = 4;
  Shape shape;
  uint64_t data_offset = 0;  // where the data begins in the file
};

constexpr absl::string_view kNpyMagic = "\x93NUMPY";
constexpr absl::string_view kNpyDtypes = "f2 f4 f8 i1 i2 i4 i8 u1 u2 u4 u8 b1";
// numpy.lib.format's default max_header_size: the header is parsed whole
// (a dimension per two bytes), and an error quotes the shape.
constexpr size_t kMaxNpyHeaderBytes = 10000;

absl::Status ParseDescr(const std::string& descr, NpyArray& a) {
  if (descr.size() < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported dtype '", descr, "' (supported: ", kNpyDtypes, ")"));
  }
  char order = descr[0];
  std::string code = descr.substr(1);
  const std::vector<absl::string_view> known = absl::StrSplit(kNpyDtypes, ' ');
  if (std::find(known.begin(), known.end(), code) == known.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported dtype '", descr, "' (supported: ", kNpyDtypes, ")"));
  }
  a.kind = code[0];
  a.item_bytes = code[1] - '0';
  if (order == '>' && a.item_bytes > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "big-endian dtype '", descr, "'; save it little-endian (a.astype('<", code, "'))"));
  }
  if (order != '<' && order != '=' && order != '|' && order != '>') {
    return absl::InvalidArgumentError(absl::StrCat("unknown byte order in dtype '", descr, "'"));
  }
  if (order == '|' && a.item_bytes > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype '", descr, "' has no byte order but more than one byte"));
  }
  return absl::OkStatus();
}

// Parses the whole .npy framing of `f`; messages do not name the file.
absl::StatusOr<NpyArray> ParseNpy(const DataFile& f) {
  const uint64_t size = f.size();
  if (size == 0) return absl::InvalidArgumentError("empty file, not a .npy file");
  // The preamble (at most 12 bytes) and a header of at most
  // kMaxNpyHeaderBytes: all that is parsed.
  std::string head(static_cast<size_t>(std::min<uint64_t>(size, 12 + kMaxNpyHeaderBytes)), '\0');
  HAP_RETURN_IF_ERROR(f.Read(0, head.size(), head.data()));
  const auto* p = reinterpret_cast<const unsigned char*>(head.data());
  if (size < kNpyMagic.size() ||
      absl::string_view(reinterpret_cast<const char*>(p), kNpyMagic.size()) != kNpyMagic) {
    return absl::InvalidArgumentError("not a .npy file (it does not start with \\x93NUMPY)");
  }
  if (size < 10) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncated: ", size, " bytes, shorter than the .npy preamble"));
  }
  int major = p[6], minor = p[7];
  uint64_t header_len, header_start;
  if (major == 1 && minor == 0) {
    header_len = Load<uint16_t>(p + 8, 0);
    header_start = 10;
  } else if ((major == 2 || major == 3) && minor == 0) {
    if (size < 12) {
      return absl::InvalidArgumentError(
          absl::StrCat("truncated: ", size, " bytes, shorter than the .npy preamble"));
    }
    header_len = Load<uint32_t>(p + 8, 0);
    header_start = 12;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unsupported .npy format version ", major, ".",
                                                   minor, " (1.0, 2.0 and 3.0 are read)"));
  }
  if (header_len > size - header_start) {
    return absl::InvalidArgumentError(absl::StrCat("truncated: the header needs ",
                                                   header_start + header_len,
                                                   " bytes, the file holds ", size));
  }
  if (header_len > kMaxNpyHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a .npy header of ", header_len, " bytes, more than the ", kMaxNpyHeaderBytes,
                     " numpy.load accepts by default (a plain array's is under 200)"));
  }
  absl::string_view header(reinterpret_cast<const char*>(p) + header_start, header_len);
  HAP_ASSIGN_OR_RETURN(auto dict, PyLiteralParser(header).ParseDict());

  NpyArray a;
  for (const char* key : {"descr", "fortran_order", "shape"}) {
    if (dict.count(key) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("the .npy header lacks '", key, "'"));
    }
  }
  const PyValue& descr = dict["descr"];
  if (descr.kind != PyValue::Kind::kString) {
    return absl::InvalidArgumentError(
        "a structured dtype (record array); save one plain array per input");
  }
  a.descr = descr.str;
  HAP_RETURN_IF_ERROR(ParseDescr(a.descr, a));
  const PyValue& fortran = dict["fortran_order"];
  if (fortran.kind != PyValue::Kind::kBool) {
    return absl::InvalidArgumentError("the .npy header's fortran_order is not True or False");
  }
  if (fortran.boolean) {
    return absl::InvalidArgumentError(
        "fortran_order is True (column-major); save a C-order array "
        "(np.ascontiguousarray(a))");
  }
  const PyValue& shape = dict["shape"];
  if (shape.kind != PyValue::Kind::kSequence) {
    return absl::InvalidArgumentError("the .npy header's shape is not a tuple");
  }
  for (const PyValue& d : shape.items) {
    if (d.kind != PyValue::Kind::kInt || d.integer < 0) {
      return absl::InvalidArgumentError("the .npy header's shape holds a non-integer or negative");
    }
    a.shape.push_back(d.integer);
  }
  if (a.shape.empty()) {
    return absl::InvalidArgumentError("a 0-d array; dimension 0 must count samples");
  }
  // Bytes of data, checked against overflow: at most the file size.
  const uint64_t data_start = header_start + header_len;
  const uint64_t available = size - data_start;
  uint64_t need = static_cast<uint64_t>(a.item_bytes);
  bool overflow = false;
  for (int64_t d : a.shape) {
    if (d != 0 && need > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) {
      overflow = true;
    }
    need *= static_cast<uint64_t>(d);
  }
  if (overflow || need > available) {
    return absl::InvalidArgumentError(absl::StrCat(
        "truncated: shape ", PyShape(a.shape), " of '", a.descr, "' needs ",
        overflow ? std::string("more than 2^64") : absl::StrCat(need), " bytes of data after the ",
        data_start, "-byte header, the file holds ", available));
  }
  a.data_offset = data_start;
  return a;
}

// ---------------------------------------------------------------------------
// Element conversion from a file dtype (kind, bytes) to a graph dtype.

bool SameRepresentation(char kind, int bytes, DType d) {
  switch (d) {
    case DType::kFloat16:
      return kind == 'f' && bytes == 2;
    case DType::kFloat32:
      return kind == 'f' && bytes == 4;
    case DType::kFloat64:
      return kind == 'f' && bytes == 8;
    case DType::kInt32:
      return kind == 'i' && bytes == 4;
    case DType::kInt64:
      return kind == 'i' && bytes == 8;
    case DType::kBFloat16:
      return false;
  }
  return false;
}

template <typename S, typename D>
void Cast(const unsigned char* src, D* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(Load<S>(src, i));
}

// Converts n elements; the pair was accepted by CheckDType.
template <typename D>
void CastTo(char kind, int bytes, const unsigned char* src, D* dst, int64_t n) {
  switch (kind * 16 + bytes) {
    case 'f' * 16 + 4:
      return Cast<float>(src, dst, n);
    case 'f' * 16 + 8:
      return Cast<double>(src, dst, n);
    case 'i' * 16 + 1:
      return Cast<int8_t>(src, dst, n);
    case 'i' * 16 + 2:
      return Cast<int16_t>(src, dst, n);
    case 'i' * 16 + 4:
      return Cast<int32_t>(src, dst, n);
    case 'i' * 16 + 8:
      return Cast<int64_t>(src, dst, n);
    case 'u' * 16 + 1:
    case 'b' * 16 + 1:  // NumPy's bool: one byte, 0 or 1
      return Cast<uint8_t>(src, dst, n);
    case 'u' * 16 + 2:
      return Cast<uint16_t>(src, dst, n);
    case 'u' * 16 + 4:
      return Cast<uint32_t>(src, dst, n);
    case 'u' * 16 + 8:
      return Cast<uint64_t>(src, dst, n);
    default:
      return;
  }
}

void ConvertElements(char kind, int bytes, const unsigned char* src, DType d, void* dst,
                     int64_t n) {
  if (SameRepresentation(kind, bytes, d)) {
    std::memcpy(dst, src, static_cast<size_t>(n * bytes));
    return;
  }
  switch (d) {
    case DType::kFloat32:
      return CastTo(kind, bytes, src, static_cast<float*>(dst), n);
    case DType::kFloat64:
      return CastTo(kind, bytes, src, static_cast<double*>(dst), n);
    case DType::kInt32:
      return CastTo(kind, bytes, src, static_cast<int32_t*>(dst), n);
    case DType::kInt64:
      return CastTo(kind, bytes, src, static_cast<int64_t*>(dst), n);
    default:
      return;
  }
}

// Whether a file of dtype `a` may feed a graph input of dtype `d`
// (user_data.h, "Dtypes").
absl::Status CheckDType(const NpyArray& a, DType d) {
  const std::string want(graph::DTypeName(d));
  switch (d) {
    case DType::kFloat32:
    case DType::kFloat64:
      if (a.kind == 'f' && a.item_bytes >= 4) return absl::OkStatus();
      break;
    case DType::kFloat16:
      if (a.kind == 'f' && a.item_bytes == 2) return absl::OkStatus();
      break;
    case DType::kInt32:
    case DType::kInt64:
      if (a.kind == 'i' || a.kind == 'u' || a.kind == 'b') return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat("dtype '", a.descr, "' for an integer (", want,
                       ") input; save integer ids or labels (a.astype('int64'))"));
    case DType::kBFloat16:
      return absl::UnimplementedError(
          "the input is bf16, which NumPy has no dtype for; npy data feeds f32, f64, f16, "
          "i32 and i64 inputs");
  }
  if (a.kind != 'f') {
    return absl::InvalidArgumentError(
        absl::StrCat(a.kind == 'b' ? "bool" : "integer", " dtype '", a.descr, "' for a float (", want,
                     ") input; convert (and scale) it in NumPy, e.g. (a / 255).astype('float32')"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype '", a.descr, "' for a ", want, " input; save it as ",
                   d == DType::kFloat16 ? "float16 ('<f2')" : "float32 or float64"));
}

// The values an integer input accepts: [lo, hi] inclusive, and why.
struct IntBounds {
  int64_t lo = 0, hi = 0;
  std::string why;
};

IntBounds BoundsOf(const graph::Graph& g, graph::TensorId t) {
  IntBounds b;
  if (std::optional<IdLimit> l = IntegerInputLimit(g, t)) {
    b.lo = 0;
    b.hi = l->limit - 1;
    b.why = absl::StrCat("outside [0, ", l->limit, "), ", l->source);
  } else if (g.tensor(t).type.dtype == DType::kInt32) {
    b.lo = std::numeric_limits<int32_t>::min();
    b.hi = std::numeric_limits<int32_t>::max();
    b.why = "which does not fit the input's dtype i32";
  } else {
    b.lo = std::numeric_limits<int64_t>::min();
    b.hi = std::numeric_limits<int64_t>::max();
    b.why = "which does not fit the input's dtype i64";
  }
  return b;
}

// The index of the first of n elements of S outside `b`, or -1.
template <typename S>
int64_t FirstOutside(const unsigned char* src, int64_t n, const IntBounds& b) {
  for (int64_t i = 0; i < n; ++i) {
    S v = Load<S>(src, i);
    bool in;
    if constexpr (std::is_unsigned_v<S>) {
      in = static_cast<uint64_t>(v) <= static_cast<uint64_t>(b.hi) && b.lo <= 0;
    } else {
      in = static_cast<int64_t>(v) >= b.lo && static_cast<int64_t>(v) <= b.hi;
    }
    if (!in) return i;
  }
  return -1;
}

// FirstOutside for a runtime integer dtype; also returns the value as text.
int64_t FirstOutside(char kind, int bytes, const unsigned char* src, int64_t n, const IntBounds& b,
                     std::string& value) {
  int64_t i = -1;
  switch (kind * 16 + bytes) {
#define HAP_USER_DATA_SCAN(k, nb, T)                   \
  case k * 16 + nb:                                    \
    i = FirstOutside<T>(src, n, b);                    \
    if (i >= 0) value = absl::StrCat(Load<T>(src, i)); \
    break;
    HAP_USER_DATA_SCAN('i', 1, int8_t)
    HAP_USER_DATA_SCAN('i', 2, int16_t)
    HAP_USER_DATA_SCAN('i', 4, int32_t)
    HAP_USER_DATA_SCAN('i', 8, int64_t)
    HAP_USER_DATA_SCAN('u', 1, uint8_t)
    HAP_USER_DATA_SCAN('u', 2, uint16_t)
    HAP_USER_DATA_SCAN('u', 4, uint32_t)
    HAP_USER_DATA_SCAN('u', 8, uint64_t)
    HAP_USER_DATA_SCAN('b', 1, uint8_t)  // NumPy's bool: bytes read as 0, 1 or more
#undef HAP_USER_DATA_SCAN
    default:
      break;
  }
  return i;
}

// The index of the first of n float elements (kind 'f', `bytes` each) that
// is not finite, or that a graph input of dtype `d` cannot hold (a float64
// past float32's range becomes inf there), or -1; `value` says what it is.
int64_t FirstNotFinite(int bytes, const unsigned char* src, int64_t n, DType d,
                       std::string& value) {
  const double max = d == DType::kFloat64   ? std::numeric_limits<double>::max()
                     : d == DType::kFloat16 ? 65504.0
                                            : std::numeric_limits<float>::max();
  for (int64_t i = 0; i < n; ++i) {
    if (bytes == 2) {  // half: exponent bits all ones is inf (mantissa 0) or nan
      const uint16_t h = Load<uint16_t>(src, i);
      if ((h & 0x7C00) == 0x7C00) {
        value = (h & 0x03FF) != 0 ? "nan" : (h & 0x8000) != 0 ? "-inf" : "inf";
        return i;
      }
      continue;
    }
    const double v = bytes == 4 ? static_cast<double>(Load<float>(src, i)) : Load<double>(src, i);
    if (!std::isfinite(v)) {
      value = absl::StrCat(v);
      return i;
    }
    if (std::fabs(v) > max) {
      value = absl::StrCat(v, ", beyond ", graph::DTypeName(d), "'s range");
      return i;
    }
  }
  return -1;
}

// Stores integer v as element i of an integer tensor.
void StoreInt(HostTensor& h, int64_t i, int64_t v) {
  if (h.dtype() == DType::kInt32) {
    h.as<int32_t>()[i] = static_cast<int32_t>(v);
  } else {
    h.as<int64_t>()[i] = v;
  }
}

// ---------------------------------------------------------------------------
// npy:DIR

struct NpyInput {
  std::string name;
  std::string path;
  DType dtype;
  Shape shape;               // the graph's, [r * B, ...]
  int64_t sample_elems = 0;  // r * prod(shape[1:])
  NpyArray array;
  IntBounds bounds;  // an integer input's
  std::unique_ptr<DataFile> file;
};

// The index of the first of n elements of `in`'s file at `src` that the
// input does not take (user_data.h, "Checks": floats finite and within the
// input's range, integers within its bounds, bools 0 or 1), or -1; `value`
// says what it holds and `why` why it is refused.
int64_t FirstRefused(const NpyInput& in, const unsigned char* src, int64_t n, std::string& value,
                     std::string& why) {
  if (!graph::IsInteger(in.dtype)) {
    why = ": training data must be finite";
    return FirstNotFinite(in.array.item_bytes, src, n, in.dtype, value);
  }
  int64_t i = -1;
  const IntBounds* bounds = &in.bounds;
  // NumPy writes bools as bytes 0 and 1; another byte is a damaged file
  // (numpy would read it as True, we would feed its value on).
  static const IntBounds* const kBoolBytes =
      new IntBounds{0, 1, "which is not a bool's byte (0 or 1): a damaged file?"};
  if (in.array.kind == 'b') {
    i = FirstOutside(in.array.kind, in.array.item_bytes, src, n, *kBoolBytes, value);
    if (i >= 0) bounds = kBoolBytes;
  }
  if (i < 0) i = FirstOutside(in.array.kind, in.array.item_bytes, src, n, *bounds, value);
  why = absl::StrCat(", ", bounds->why);
  return i;
}

class NpyData : public UserData {
 public:
  NpyData(std::string spec, std::vector<NpyInput> inputs, int64_t n, int64_t b,
          std::optional<uint64_t> seed)
      : spec_(std::move(spec)),
        inputs_(std::move(inputs)),
        n_(n),
        b_(b),
        seed_(seed),
        order_(n, seed) {}

  int64_t num_samples() const override { return n_; }
  int64_t batch_size() const override { return b_; }
  std::string Describe() const override {
    std::vector<std::string> parts;
    for (const NpyInput& in : inputs_) {
      parts.push_back(absl::StrCat(in.name, " ", in.array.descr, " ", PyShape(in.array.shape),
                                   " -> ", graph::DTypeName(in.dtype),
                                   graph::ShapeString(in.shape)));
    }
    return absl::StrCat(spec_, ": ", n_, " samples, batch ", b_, ", ",
                        seed_ ? absl::StrCat("shuffled (seed ", *seed_, ")") : "in order", "; ",
                        absl::StrJoin(parts, ", "));
  }

  absl::StatusOr<GlobalBatch> Get(int64_t step) override {
    HAP_ASSIGN_OR_RETURN(std::vector<int64_t> samples, order_.Step(step, b_));
    for (const NpyInput& in : inputs_) HAP_RETURN_IF_ERROR(in.file->CheckUnchanged());
    GlobalBatch batch;
    std::vector<unsigned char> rows;
    for (const NpyInput& in : inputs_) {
      HostTensor h(in.dtype, in.shape);
      auto* dst = static_cast<unsigned char*>(h.data());
      const int64_t src_bytes = in.sample_elems * in.array.item_bytes;
      const int64_t dst_bytes = in.sample_elems * graph::DTypeBytes(in.dtype);
      // A run of consecutive samples (the whole batch, unshuffled, unless
      // it wraps) in one read.
      for (int64_t j = 0, run = 1; j < b_; j += run) {
        for (run = 1; j + run < b_ && samples[j + run] == samples[j] + run;) ++run;
        rows.resize(static_cast<size_t>(run * src_bytes));
        HAP_RETURN_IF_ERROR(
            in.file->Read(in.array.data_offset + static_cast<uint64_t>(samples[j] * src_bytes),
                          rows.size(), rows.data()));
        // Checked again as read: a file rewritten in place within its
        // modification time's granularity would feed values the checks at
        // open never saw (ids past a table) to the kernels.
        std::string value, why;
        if (int64_t i = FirstRefused(in, rows.data(), run * in.sample_elems, value, why); i >= 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              in.path, " (graph input '", in.name, "') changed since it was opened: row ",
              samples[j] + i / in.sample_elems,
              in.sample_elems > 1 ? absl::StrCat(", element ", i % in.sample_elems) : "",
              " now holds ", value, why));
        }
        ConvertElements(in.array.kind, in.array.item_bytes, rows.data(), in.dtype,
                        dst + j * dst_bytes, run * in.sample_elems);
      }
      batch.emplace(in.name, std::move(h));
    }
    return batch;
  }

 private:
  std::string spec_;
  std::vector<NpyInput> inputs_;
  int64_t n_, b_;
  std::optional<uint64_t> seed_;
  SampleOrder order_;
};

absl::StatusOr<std::unique_ptr<UserData>> OpenNpy(const std::string& spec, const std::string& dir,
                                                  const graph::Graph& g, const DataOptions& o) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    int e = errno;
    if (e == ENOENT) {
      return absl::NotFoundError(absl::StrCat("data directory ", dir, " does not exist"));
    }
    return absl::InvalidArgumentError(absl::StrCat("data directory ", dir, ": ", ErrnoText(e)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, " is not a directory (npy:DIR wants one .npy file per graph input)"));
  }
  std::vector<graph::TensorId> ids = g.Inputs();
  if (ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model '", g.name(), "' has no inputs"));
  }
  // The batch: the smallest first dimension; every input a multiple of it.
  int64_t b = std::numeric_limits<int64_t>::max();
  for (graph::TensorId t : ids) {
    const graph::Tensor& x = g.tensor(t);
    if (x.type.rank() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "graph input '", x.name, "' is a scalar; npy data batches every input along dim 0"));
    }
    b = std::min(b, x.type.shape[0]);
  }
  std::map<std::string, std::string> file_owner;  // file name -> input
  for (graph::TensorId t : ids) {
    const std::string& name = g.tensor(t).name;
    auto [it, fresh] = file_owner.emplace(NpyFileName(name), name);
    if (!fresh) {
      return absl::InvalidArgumentError(absl::StrCat("graph inputs '", it->second, "' and '", name,
                                                     "' both map to the file ", it->first));
    }
  }
  std::vector<NpyInput> inputs;
  for (graph::TensorId t : ids) {
    const graph::Tensor& x = g.tensor(t);
    const std::string where =
        absl::StrCat("graph input '", x.name, "' ", graph::TypeString(x.type));
    if (x.type.shape[0] % b != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": dim 0 is not a multiple of the batch ", b,
          " (the smallest dim 0 of the inputs), so its rows cannot be split into samples"));
    }
    NpyInput in;
    in.name = x.name;
    in.dtype = x.type.dtype;
    in.shape = x.type.shape;
    if (graph::IsInteger(in.dtype)) in.bounds = BoundsOf(g, t);
    in.path = JoinPath(dir, NpyFileName(x.name));
    auto f = DataFile::Open(in.path);
    if (absl::IsNotFound(f.status())) {
      return absl::NotFoundError(absl::StrCat(where, " has no data file: expected ", in.path));
    }
    HAP_RETURN_IF_ERROR(Annotate(f.status(), where));
    in.file = std::move(*f);
    const std::string ctx = absl::StrCat(in.path, " (", where, ")");
    auto a = ParseNpy(*in.file);
    HAP_RETURN_IF_ERROR(Annotate(a.status(), ctx));
    in.array = std::move(*a);
    HAP_RETURN_IF_ERROR(Annotate(CheckDType(in.array, in.dtype), ctx));
    // Expected file shape: (N, [r,] *shape[1:]).
    const int64_t r = x.type.shape[0] / b;
    Shape per_sample;
    if (r > 1) per_sample.push_back(r);
    per_sample.insert(per_sample.end(), x.type.shape.begin() + 1, x.type.shape.end());
    const Shape file_rest(in.array.shape.begin() + 1, in.array.shape.end());
    if (file_rest != per_sample) {
      Shape want = {in.array.shape[0]};
      want.insert(want.end(), per_sample.begin(), per_sample.end());
      return absl::InvalidArgumentError(absl::StrCat(
          ctx, ": shape ", PyShape(in.array.shape), ", expected ", PyShape(want),
          ": dim 0 counts samples, the rest is one sample",
          r > 1 ? absl::StrCat(" (", r, " rows of the input per sample, batch ", b, ")") : ""));
    }
    in.sample_elems = graph::NumElements(per_sample);
    inputs.push_back(std::move(in));
  }
  const int64_t n = inputs[0].array.shape[0];
  for (const NpyInput& in : inputs) {
    if (in.array.shape[0] != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("the data files disagree on the number of samples: ", inputs[0].path,
                       " holds ", n, ", ", in.path, " holds ", in.array.shape[0]));
    }
  }
  if (n < b) {
    return absl::InvalidArgumentError(absl::StrCat(spec, " holds ", n,
                                                   " samples, fewer than one global batch of ", b,
                                                   " (", inputs[0].path, ")"));
  }
  // Every value of every file, read through once: floats finite and
  // within the input's range (a NaN or inf would show only as a NaN loss,
  // at some step, naming no file), integers within the input's bounds.
  for (const NpyInput& in : inputs) {
    std::string value, why;
    HAP_ASSIGN_OR_RETURN(
        const int64_t i,
        ScanElements(*in.file, in.array.data_offset, n * in.sample_elems, in.array.item_bytes,
                     [&](const unsigned char* src, int64_t count) {
                       return FirstRefused(in, src, count, value, why);
                     }));
    if (i >= 0) {
      const int64_t row = i / in.sample_elems, elem = i % in.sample_elems;
      return absl::InvalidArgumentError(absl::StrCat(
          in.path, " (graph input '", in.name, "'): row ", row,
          in.sample_elems > 1 ? absl::StrCat(", element ", elem) : "", " holds ", value, why));
    }
  }
  return std::unique_ptr<UserData>(
      std::make_unique<NpyData>(spec, std::move(inputs), n, b, o.shuffle_seed));
}

// ---------------------------------------------------------------------------
// tokens:FILE[:uint16|uint32]

class TokenData : public UserData {
 public:
  TokenData(std::string spec, std::unique_ptr<DataFile> file, int token_bytes, int64_t b, int64_t s,
            const graph::TensorType& tokens, const graph::TensorType& labels, IntBounds bounds,
            std::optional<uint64_t> seed)
      : spec_(std::move(spec)),
        file_(std::move(file)),
        token_bytes_(token_bytes),
        b_(b),
        s_(s),
        n_((static_cast<int64_t>(file_->size()) / token_bytes - 1) / s),
        tokens_(tokens),
        labels_(labels),
        bounds_(std::move(bounds)),
        seed_(seed),
        order_(n_, seed) {}

  int64_t num_samples() const override { return n_; }
  int64_t batch_size() const override { return b_; }
  std::string Describe() const override {
    return absl::StrCat(spec_, ": ", static_cast<int64_t>(file_->size()) / token_bytes_,
                        " tokens, ", n_, " windows of ", s_, " + 1, batch ", b_, ", ",
                        seed_ ? absl::StrCat("shuffled (seed ", *seed_, ")") : "in order");
  }

  absl::StatusOr<GlobalBatch> Get(int64_t step) override {
    HAP_ASSIGN_OR_RETURN(std::vector<int64_t> samples, order_.Step(step, b_));
    HAP_RETURN_IF_ERROR(file_->CheckUnchanged());
    HostTensor tokens(tokens_.dtype, tokens_.shape);
    HostTensor labels(labels_.dtype, labels_.shape);
    std::vector<unsigned char> window(static_cast<size_t>((s_ + 1) * token_bytes_));
    for (int64_t j = 0; j < b_; ++j) {
      const int64_t start = samples[j] * s_;
      HAP_RETURN_IF_ERROR(
          file_->Read(static_cast<uint64_t>(start * token_bytes_), window.size(), window.data()));
      // Checked again as read (see NpyData::Get).
      std::string value;
      if (int64_t i = FirstOutside('u', token_bytes_, window.data(), s_ + 1, bounds_, value);
          i >= 0) {
        return absl::FailedPreconditionError(
            absl::StrCat(file_->path(), " changed since it was opened: token ", start + i,
                         " (window ", samples[j], ") is now ", value, ", ", bounds_.why));
      }
      for (int64_t t = 0; t < s_; ++t) {
        StoreInt(tokens, j * s_ + t, Token(window.data(), t));
        StoreInt(labels, j * s_ + t, Token(window.data(), t + 1));
      }
    }
    GlobalBatch batch;
    batch.emplace("tokens", std::move(tokens));
    batch.emplace("labels", std::move(labels));
    return batch;
  }

 private:
  int64_t Token(const unsigned char* window, int64_t i) const {
    return token_bytes_ == 2 ? Load<uint16_t>(window, i) : Load<uint32_t>(window, i);
  }

  std::string spec_;
  std::unique_ptr<DataFile> file_;
  int token_bytes_;
  int64_t b_, s_, n_;
  graph::TensorType tokens_, labels_;
  IntBounds bounds_;
  std::optional<uint64_t> seed_;
  SampleOrder order_;
};

absl::StatusOr<std::unique_ptr<UserData>> OpenTokens(const std::string& spec,
                                                     const std::string& path, int token_bytes,
                                                     const graph::Graph& g, const DataOptions& o) {
  auto tokens = g.FindTensor("tokens");
  auto labels = g.FindTensor("labels");
  auto is_int_input = [&](std::optional<graph::TensorId> t) {
    return t && g.tensor(*t).kind == graph::TensorKind::kInput &&
           graph::IsInteger(g.tensor(*t).type.dtype);
  };
  if (!is_int_input(tokens) || !is_int_input(labels) || g.tensor(*tokens).type.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", g.name(),
                     "' is not a language model with integer inputs tokens[B, S] and labels[B*S], "
                     "which tokens: data feeds"));
  }
  const graph::TensorType& tt = g.tensor(*tokens).type;
  const graph::TensorType& lt = g.tensor(*labels).type;
  const int64_t b = tt.shape[0], s = tt.shape[1];
  if (lt.shape != Shape{b * s} && lt.shape != tt.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", g.name(), "': labels ", graph::TypeString(lt),
                     " is neither [B*S] nor [B, S] for tokens ", graph::TypeString(tt)));
  }
  for (graph::TensorId t : g.Inputs()) {
    if (t != *tokens && t != *labels) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", g.name(), "' has input '", g.tensor(t).name,
          "' besides tokens and labels, which a token stream cannot feed (use npy:DIR)"));
    }
  }
  auto f = DataFile::Open(path);
  if (absl::IsNotFound(f.status())) {
    return absl::NotFoundError(absl::StrCat("token file ", path, " does not exist"));
  }
  HAP_RETURN_IF_ERROR(f.status());
  std::unique_ptr<DataFile> file = std::move(*f);
  const char* dtype_name = token_bytes == 2 ? "uint16" : "uint32";
  if (file->size() % static_cast<size_t>(token_bytes) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", file->size(),
                                                   " bytes is not a whole number of ", dtype_name,
                                                   " tokens (truncated, or another dtype?)"));
  }
  const int64_t ntokens = static_cast<int64_t>(file->size()) / token_bytes;
  const int64_t n = ntokens > 0 ? (ntokens - 1) / s : 0;
  if (n < b) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds ", ntokens, " ", dtype_name,
                                                   " tokens, ", n, " windows of ", s,
                                                   " + 1, fewer than one global batch of ", b));
  }
  // Every token is read both as an input and as a label: the tighter bound.
  IntBounds bt = BoundsOf(g, *tokens), bl = BoundsOf(g, *labels);
  const IntBounds& bounds = bl.hi < bt.hi ? bl : bt;
  std::string value;
  HAP_ASSIGN_OR_RETURN(
      const int64_t i,
      ScanElements(*file, 0, ntokens, token_bytes, [&](const unsigned char* src, int64_t count) {
        return FirstOutside('u', token_bytes, src, count, bounds, value);
      }));
  if (i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": token ", i, " (window ", i / s, ") is ", value, ", ", bounds.why));
  }
  return std::unique_ptr<UserData>(std::make_unique<TokenData>(
      spec, std::move(file), token_bytes, b, s, tt, lt, bounds, o.shuffle_seed));
}

constexpr absl::string_view kSpecForms = "npy:DIR or tokens:FILE[:uint16|uint32]";

}  // namespace

std::string NpyFileName(const std::string& input_name) {
  return absl::StrCat(absl::StrReplaceAll(input_name, {{"/", "__"}}), ".npy");
}

absl::StatusOr<std::unique_ptr<UserData>> OpenUserDataSet(const std::string& spec,
                                                          const graph::Graph& g,
                                                          const DataOptions& o) {
  if (absl::StartsWith(spec, "npy:")) {
    std::string dir = spec.substr(4);
    if (dir.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data spec '", spec, "' names no directory (", kSpecForms, ")"));
    }
    return OpenNpy(spec, dir, g, o);
  }
  if (absl::StartsWith(spec, "tokens:")) {
    std::string path = spec.substr(7);
    int token_bytes = 2;
    size_t colon = path.rfind(':');
    if (colon != std::string::npos) {
      std::string dtype = path.substr(colon + 1);
      if (dtype == "uint16") {
        token_bytes = 2;
      } else if (dtype == "uint32") {
        token_bytes = 4;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "data spec '", spec, "': token dtype '", dtype,
            "' is not uint16 or uint32 (a FILE containing ':' needs the dtype spelled out)"));
      }
      path.resize(colon);
    }
    if (path.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data spec '", spec, "' names no file (", kSpecForms, ")"));
    }
    return OpenTokens(spec, path, token_bytes, g, o);
  }
  return absl::InvalidArgumentError(absl::StrCat("data spec '", spec, "' is not ", kSpecForms));
}

absl::StatusOr<std::unique_ptr<BatchSource>> OpenUserData(const std::string& spec,
                                                          const graph::Graph& g,
                                                          const DataOptions& o) {
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<UserData> d, OpenUserDataSet(spec, g, o));
  return std::unique_ptr<BatchSource>(std::move(d));
}

}  // namespace hap::data
