#include "planner/graph/types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hap::graph {

int64_t DTypeBytes(DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
  }
  return 4;
}

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat64:
      return "f64";
    case DType::kInt32:
      return "i32";
    case DType::kInt64:
      return "i64";
  }
  return "?";
}

bool IsFloating(DType t) { return !IsInteger(t); }
bool IsInteger(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

std::string ShapeString(const Shape& s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

std::string TypeString(const TensorType& t) {
  return absl::StrCat(DTypeName(t.dtype), ShapeString(t.shape));
}

absl::StatusOr<int64_t> CheckedNumElements(const Shape& s) {
  if (s.size() > kMaxTensorDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shape has at most ", kMaxTensorDims, " dimensions, got ", s.size()));
  }
  int64_t n = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("dimension ", i, " of shape ", ShapeString(s),
                       " is ", s[i], "; dimensions must be positive"));
    }
    if (__builtin_mul_overflow(n, s[i], &n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", ShapeString(s), " has more elements than fit in 64 bits"));
    }
  }
  // Leave headroom for byte sizes (up to 8 bytes an element).
  if (n > (int64_t{1} << 59)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape ", ShapeString(s), " is too large (", n, " elements)"));
  }
  return n;
}

int64_t NumElements(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

namespace {

template <typename T>
absl::StatusOr<T> Get(const std::map<std::string, AttrValue>& m,
                      const std::string& name, const char* kind) {
  auto it = m.find(name);
  if (it == m.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("missing required attribute '", name, "'"));
  }
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  return absl::InvalidArgumentError(
      absl::StrCat("attribute '", name, "' must be ", kind));
}

}  // namespace

absl::StatusOr<int64_t> Attrs::Int(const std::string& name) const {
  return Get<int64_t>(values_, name, "an integer");
}
absl::StatusOr<int64_t> Attrs::Int(const std::string& name,
                                   int64_t def) const {
  if (!Has(name)) return def;
  return Int(name);
}
absl::StatusOr<double> Attrs::Float(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) {
    if (const int64_t* i = std::get_if<int64_t>(&it->second)) {
      return static_cast<double>(*i);
    }
  }
  return Get<double>(values_, name, "a number");
}
absl::StatusOr<double> Attrs::Float(const std::string& name,
                                    double def) const {
  if (!Has(name)) return def;
  return Float(name);
}
absl::StatusOr<bool> Attrs::Bool(const std::string& name, bool def) const {
  if (!Has(name)) return def;
  return Get<bool>(values_, name, "a boolean");
}
absl::StatusOr<std::string> Attrs::String(const std::string& name,
                                          const std::string& def) const {
  if (!Has(name)) return def;
  return Get<std::string>(values_, name, "a string");
}
absl::StatusOr<std::vector<int64_t>> Attrs::Ints(
    const std::string& name) const {
  return Get<std::vector<int64_t>>(values_, name, "a list of integers");
}
absl::StatusOr<std::vector<int64_t>> Attrs::Ints(
    const std::string& name, const std::vector<int64_t>& def) const {
  if (!Has(name)) return def;
  return Ints(name);
}

}  // namespace hap::graph
