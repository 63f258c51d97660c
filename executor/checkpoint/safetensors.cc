#include "executor/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json_struct.h"
#include "common/status_macros.h"
#include "executor/checkpoint/crc32c.h"
#include "executor/checkpoint/file_util.h"
#include "google/protobuf/struct.pb.h"

namespace hap::executor::checkpoint {
namespace {

namespace pb = ::google::protobuf;

// A JSON string literal (the header's names come from users).
std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// A non-negative integer held in a JSON number (exact below 2^53).
bool ToInt(const pb::Value& v, int64_t* out) {
  if (v.kind_case() != pb::Value::kNumberValue) return false;
  const double d = v.number_value();
  if (!(d >= 0) || d > 9007199254740992.0 || d != std::floor(d)) return false;
  *out = static_cast<int64_t>(d);
  return true;
}

}  // namespace

absl::string_view SafetensorsDType(DType t) {
  switch (t) {
    case DType::kFloat32: return "F32";
    case DType::kFloat64: return "F64";
    case DType::kFloat16: return "F16";
    case DType::kBFloat16: return "BF16";
    case DType::kInt32: return "I32";
    case DType::kInt64: return "I64";
  }
  return "?";
}

absl::StatusOr<DType> FromSafetensorsDType(absl::string_view s) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt32, DType::kInt64}) {
    if (SafetensorsDType(t) == s) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype '", s, "' is not one of F32, F64, F16, BF16, I32, I64"));
}

int SafetensorsDTypeWidth(absl::string_view s) {
  if (auto ours = FromSafetensorsDType(s); ours.ok()) return graph::DTypeBytes(*ours);
  static const auto* others = new std::map<std::string, int, std::less<>>{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2},  {"U16", 2}, {"U32", 4}, {"U64", 8}};
  auto it = others->find(s);
  return it == others->end() ? 0 : it->second;
}

namespace {

// An entry's element size and its bytes.
int64_t EntryWidth(const SafetensorsEntry& e) {
  return e.other_dtype.empty() ? graph::DTypeBytes(e.data.dtype)
                               : SafetensorsDTypeWidth(e.other_dtype);
}
int64_t EntryBytes(const SafetensorsEntry& e) { return e.data.num_elements() * EntryWidth(e); }

}  // namespace

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<const SafetensorsEntry*> order;
  std::set<std::string> names;
  for (const SafetensorsEntry& e : entries) {
    if (e.name.empty() || e.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat("a tensor of ", path, " has the reserved or empty name '", e.name, "'"));
    }
    if (!names.insert(e.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", e.name, "' appears twice in ", path));
    }
    if (EntryWidth(e) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", e.name, "' has the unknown dtype '", e.other_dtype, "'"));
    }
    order.push_back(&e);
  }
  std::sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    const int64_t sa = EntryWidth(*a), sb = EntryWidth(*b);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      absl::StrAppend(&header, first ? "" : ",", JsonString(k), ":", JsonString(v));
      first = false;
    }
    header += "}";
  }
  int64_t offset = 0;
  for (const SafetensorsEntry* e : order) {
    const int64_t bytes = EntryBytes(*e);
    absl::StrAppend(&header, header.size() > 1 ? "," : "", JsonString(e->name), ":{\"dtype\":\"",
                    e->other_dtype.empty() ? SafetensorsDType(e->data.dtype) : e->other_dtype,
                    "\",\"shape\":[");
    for (size_t i = 0; i < e->data.shape.size(); ++i) {
      absl::StrAppend(&header, i ? "," : "", e->data.shape[i]);
    }
    absl::StrAppend(&header, "],\"data_offsets\":[", offset, ",", offset + bytes, "]}");
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  unsigned char length[8];
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));

  HAP_ASSIGN_OR_RETURN(FileWriter out, FileWriter::Create(path, /*direct=*/offset >= (1 << 20)));
  HAP_RETURN_IF_ERROR(out.Write(length, 8));
  HAP_RETURN_IF_ERROR(out.Write(header.data(), header.size()));
  for (const SafetensorsEntry* e : order) {
    HAP_RETURN_IF_ERROR(out.Write(e->data.data, static_cast<size_t>(EntryBytes(*e))));
  }
  return out.SyncAndClose();
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a named pipe would wait for a writer; it is refused
  // below. (No effect on regular files.)
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no file ", path));
    return absl::InternalError(absl::StrCat("cannot open ", path, ": ", std::strerror(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, " is not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile);
  f->path_ = path;
  f->map_bytes_ = st.st_size;
  auto bad = [&](auto&&... what) {
    return absl::DataLossError(absl::StrCat(path, " is not a valid safetensors file: ", what...));
  };
  if (st.st_size < 8) {
    ::close(fd);
    return bad("it has ", st.st_size, " bytes, fewer than the 8 of the header length");
  }
  void* m = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  f->fd_ = fd;  // closed by the destructor
  if (m == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map ", path, ": ", std::strerror(map_err)));
  }
  f->map_ = m;
  const auto* bytes = static_cast<const unsigned char*>(m);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (n > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes)) {
    return bad("its header length ", n, " is over the 100 MB limit");
  }
  if (n > static_cast<uint64_t>(st.st_size - 8)) {
    return bad("its header length ", n, " runs past the end of the file (", st.st_size,
               " bytes; truncated?)");
  }
  const std::string header(reinterpret_cast<const char*>(bytes + 8), n);
  pb::Struct json;
  if (absl::Status st = JsonToStruct(header, &json); !st.ok()) {
    return bad("its header is not a JSON object: ", st.message());
  }
  f->data_ = reinterpret_cast<const char*>(bytes + 8 + n);
  f->data_offset_ = static_cast<int64_t>(8 + n);
  const int64_t data_bytes = st.st_size - 8 - static_cast<int64_t>(n);
  struct Span {
    int64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  std::map<std::string, std::pair<int64_t, int64_t>> other_spans;
  for (const auto& [name, value] : json.fields()) {
    if (name == "__metadata__") {
      if (value.kind_case() != pb::Value::kStructValue) return bad("__metadata__ is not an object");
      for (const auto& [k, v] : value.struct_value().fields()) {
        if (v.kind_case() != pb::Value::kStringValue) {
          return bad("__metadata__ value '", k, "' is not a string");
        }
        f->metadata_[k] = v.string_value();
      }
      continue;
    }
    if (value.kind_case() != pb::Value::kStructValue) return bad("tensor '", name, "' is not an object");
    const auto& fields = value.struct_value().fields();
    auto dt = fields.find("dtype");
    auto sh = fields.find("shape");
    auto off = fields.find("data_offsets");
    if (dt == fields.end() || sh == fields.end() || off == fields.end() ||
        dt->second.kind_case() != pb::Value::kStringValue ||
        sh->second.kind_case() != pb::Value::kListValue ||
        off->second.kind_case() != pb::Value::kListValue ||
        off->second.list_value().values_size() != 2) {
      return bad("tensor '", name, "' lacks a string dtype, a shape list or two data_offsets");
    }
    const std::string& dtype_name = dt->second.string_value();
    auto dtype = FromSafetensorsDType(dtype_name);
    const int width = SafetensorsDTypeWidth(dtype_name);
    if (width == 0) return bad("tensor '", name, "' has the unknown dtype '", dtype_name, "'");
    Tensor t;
    if (dtype.ok()) t.dtype = *dtype;
    int64_t elements = 1;
    for (const pb::Value& d : sh->second.list_value().values()) {
      int64_t dim;
      if (!ToInt(d, &dim)) return bad("tensor '", name, "' has a shape entry that is not a count");
      if (dim != 0 && elements > (int64_t{1} << 53) / dim) return bad("tensor '", name, "' is too large");
      elements *= dim;
      t.shape.push_back(dim);
    }
    if (!ToInt(off->second.list_value().values(0), &t.begin) ||
        !ToInt(off->second.list_value().values(1), &t.end) || t.end < t.begin) {
      return bad("tensor '", name, "' has malformed data_offsets");
    }
    if (t.end - t.begin != elements * width) {
      return bad("tensor '", name, "' has ", t.end - t.begin, " bytes for shape ",
                 graph::ShapeString(t.shape), " of ", dtype_name);
    }
    spans.push_back({t.begin, t.end, name});
    if (dtype.ok()) {
      f->tensors_.emplace(name, std::move(t));
    } else {  // a dtype we do not train with: bytes only (checked below)
      f->others_.emplace(name, Other{dtype_name, std::move(t.shape), {}});
      other_spans.emplace(name, std::make_pair(t.begin, t.end));
    }
  }
  // The entries tile the data buffer: sorted by (begin, end), each starts
  // where the one before ended, and the last ends with the file. A
  // zero-size tensor shares its offset with the next tensor and sorts first.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin
           : a.end != b.end   ? a.end < b.end
                              : a.name < b.name;
  });
  int64_t at = 0;
  for (const Span& span : spans) {
    if (span.begin != at) {
      return bad("tensor '", span.name, "' starts at byte ", span.begin, " of the data, expected ",
                 at, " (overlapping or non-contiguous offsets)");
    }
    at = span.end;
  }
  if (at != data_bytes) {
    return bad("the tensors cover ", at, " bytes of a ", data_bytes,
               "-byte data buffer (truncated or trailing bytes?)");
  }
  for (auto& [name, other] : f->others_) {
    const auto [begin, end] = other_spans.at(name);
    other.bytes = absl::string_view(f->data_ + begin, static_cast<size_t>(end - begin));
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, static_cast<size_t>(map_bytes_));
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SafetensorsFile::ReadBytes(const std::string& name, int64_t offset, int64_t bytes,
                                        void* dst) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("no tensor '", name, "' in ", path_));
  }
  const Tensor& t = it->second;
  if (offset < 0 || bytes < 0 || t.begin + offset + bytes > t.end) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset + bytes,
                                              ") lie outside tensor '", name, "' of ", path_));
  }
  char* out = static_cast<char*>(dst);
  int64_t at = data_offset_ + t.begin + offset;
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, out, static_cast<size_t>(bytes), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat("cannot read tensor '", name, "' of ", path_, ": ",
                                              n < 0 ? std::strerror(errno) : "end of file"));
    }
    out += n;
    at += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> SafetensorsFile::Crc32cOf(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("no tensor '", name, "' in ", path_));
  }
  constexpr int64_t kChunk = 4 << 20;
  const int64_t size = it->second.end - it->second.begin;
  std::vector<char> buffer(static_cast<size_t>(std::min(size, kChunk)));
  uint32_t crc = 0;
  for (int64_t at = 0; at < size; at += kChunk) {
    const int64_t n = std::min(kChunk, size - at);
    HAP_RETURN_IF_ERROR(ReadBytes(name, at, n, buffer.data()));
    crc = Crc32c(crc, buffer.data(), static_cast<size_t>(n));
  }
  return crc;
}

absl::StatusOr<TensorView> SafetensorsFile::View(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("no tensor '", name, "' in ", path_));
  }
  return TensorView{it->second.dtype, it->second.shape,
                    const_cast<char*>(data_ + it->second.begin)};
}

}  // namespace hap::executor::checkpoint
