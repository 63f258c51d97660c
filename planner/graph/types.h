// Element types, shapes and op attributes of the model IR.
#ifndef HAP_PLANNER_GRAPH_TYPES_H_
#define HAP_PLANNER_GRAPH_TYPES_H_

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hap::graph {

enum class DType { kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64 };

int64_t DTypeBytes(DType t);
absl::string_view DTypeName(DType t);
bool IsFloating(DType t);
bool IsInteger(DType t);

using Shape = std::vector<int64_t>;

// "[32,128,768]".
std::string ShapeString(const Shape& s);
// The most dimensions a tensor has: the planner's forms name a sharded
// dimension in a signed byte (S(0) to S(127), synth::Form::kMaxShardedDim).
inline constexpr size_t kMaxTensorDims = 128;
// Product of dims; InvalidArgument on a non-positive dim, 64-bit overflow,
// or more than kMaxTensorDims dimensions.
absl::StatusOr<int64_t> CheckedNumElements(const Shape& s);
// Product of dims for shapes already validated (no checks).
int64_t NumElements(const Shape& s);

struct TensorType {
  DType dtype = DType::kFloat32;
  Shape shape;

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t num_elements() const { return NumElements(shape); }
  int64_t bytes() const { return num_elements() * DTypeBytes(dtype); }
  bool operator==(const TensorType& o) const {
    return dtype == o.dtype && shape == o.shape;
  }
  bool operator!=(const TensorType& o) const { return !(*this == o); }
};

std::string TypeString(const TensorType& t);  // "f32[32,768]"

inline TensorType F32(Shape s) { return {DType::kFloat32, std::move(s)}; }
inline TensorType I64(Shape s) { return {DType::kInt64, std::move(s)}; }

using AttrValue = std::variant<int64_t, double, std::string, bool,
                               std::vector<int64_t>, std::vector<double>>;

// Typed op attributes. Getters return InvalidArgument naming the attribute
// when it is missing (without a default) or of the wrong type. Integers are
// accepted where a float is asked for.
class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<const std::string, AttrValue>> init)
      : values_(init) {}

  Attrs& Set(const std::string& name, AttrValue v) {
    values_[name] = std::move(v);
    return *this;
  }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  const std::map<std::string, AttrValue>& values() const { return values_; }

  absl::StatusOr<int64_t> Int(const std::string& name) const;
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t def) const;
  absl::StatusOr<double> Float(const std::string& name) const;
  absl::StatusOr<double> Float(const std::string& name, double def) const;
  absl::StatusOr<bool> Bool(const std::string& name, bool def) const;
  absl::StatusOr<std::string> String(const std::string& name,
                                     const std::string& def) const;
  absl::StatusOr<std::vector<int64_t>> Ints(const std::string& name) const;
  absl::StatusOr<std::vector<int64_t>> Ints(
      const std::string& name, const std::vector<int64_t>& def) const;

 private:
  std::map<std::string, AttrValue> values_;
};

}  // namespace hap::graph

#endif  // HAP_PLANNER_GRAPH_TYPES_H_
