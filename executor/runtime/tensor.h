// Tensors of the executor runtime: a non-owning view (what kernels and
// collectives see) and an owning host tensor (tests, data loading, results).
// Layout is dense and row-major; shapes are the rank-local shapes the plan
// gives each buffer.
#ifndef HAP_EXECUTOR_RUNTIME_TENSOR_H_
#define HAP_EXECUTOR_RUNTIME_TENSOR_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "planner/graph/types.h"

namespace hap::executor {

using graph::DType;
using graph::Shape;

// A view of `data` as a tensor of `dtype` and `shape`. `data == nullptr`
// marks an absent tensor (an optional input or an output not wanted); see
// kernels.h for what each kernel does with one.
struct TensorView {
  DType dtype = DType::kFloat32;
  Shape shape;
  void* data = nullptr;

  bool present() const { return data != nullptr; }
  int rank() const { return static_cast<int>(shape.size()); }
  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t bytes() const { return num_elements() * graph::DTypeBytes(dtype); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// An owning, 64-byte aligned host tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    storage_.assign(static_cast<size_t>((n * graph::DTypeBytes(dtype_) + 63) / 64 + 1), Block{});
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const { return view().num_elements(); }
  void* data() { return storage_.empty() ? nullptr : storage_.data(); }
  const void* data() const { return storage_.empty() ? nullptr : storage_.data(); }
  template <typename T>
  T* as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data());
  }
  TensorView view() const {
    return TensorView{dtype_, shape_, const_cast<void*>(data())};
  }

 private:
  struct alignas(64) Block {
    unsigned char b[64];
  };
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::vector<Block> storage_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_RUNTIME_TENSOR_H_
