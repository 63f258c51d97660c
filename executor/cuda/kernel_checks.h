// Internal to executor/cuda: argument checks for the CUDA kernel families,
// with the same rules and messages as the CPU backend's
// (executor/cpu/kernels_internal.h), so a program rejected on one backend is
// rejected on the other; the dtype dispatch of floating and data-movement
// kernels; the backward-kernel argument layout; shape helpers; scratch and
// cuBLAS GEMM helpers. Host code only (compiled by the host compiler).
#ifndef HAP_EXECUTOR_CUDA_KERNEL_CHECKS_H_
#define HAP_EXECUTOR_CUDA_KERNEL_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "executor/cuda/kernels_internal.h"

namespace hap::executor::cuda {

// --- dtype dispatch -------------------------------------------------------------

// A floating kernel instantiated for float and double: the call's dtype is
// that of its first present floating input (else output); other dtypes are
// InvalidArgument. A data-movement kernel instantiated for f32, f64, i32,
// i64: the dtype of its first present input (else output).
using TypedKernel = absl::Status (*)(const KernelArgs&);
KernelFn FloatKernel(TypedKernel f32, TypedKernel f64);
KernelFn AnyKernel(TypedKernel f32, TypedKernel f64, TypedKernel i32,
                   TypedKernel i64);
#define HAP_CUDA_FLOAT_KERNEL(fn) \
  ::hap::executor::cuda::FloatKernel(&fn<float>, &fn<double>)
#define HAP_CUDA_ANY_KERNEL(fn)                                            \
  ::hap::executor::cuda::AnyKernel(&fn<float>, &fn<double>, &fn<int32_t>, \
                                   &fn<int64_t>)

template <typename T>
constexpr DType DTypeOf() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
  if constexpr (std::is_same_v<T, int32_t>) return DType::kInt32;
  return DType::kInt64;
}

// --- errors and argument checks -------------------------------------------------

template <typename... P>
absl::Status Invalid(const KernelArgs& a, const P&... parts) {
  return absl::InvalidArgumentError(
      absl::StrCat("kernel '", a.name, "': ", parts...));
}

std::string Describe(const TensorView& v);        // "f32[2,3]" or "absent"
std::string InLabel(const KernelArgs& a, int i);  // "input 1 (f32[2,3])"
std::string OutLabel(const KernelArgs& a, int i);

// Input count in [min_in, max_in] (max_in < 0: any), output count num_out.
absl::Status CheckArity(const KernelArgs& a, int min_in, int max_in,
                        int num_out);
// Input i is present and of dtype t.
absl::Status CheckInput(const KernelArgs& a, int i, DType t);
// Input i is present with an integer dtype (int32 or int64).
absl::Status CheckIdsInput(const KernelArgs& a, int i);
// Output i is present, of dtype t and shape `shape`.
absl::Status CheckOutput(const KernelArgs& a, int i, DType t,
                         const Shape& shape);
// One input, present and of dtype t, and one output.
absl::Status CheckUnary(const KernelArgs& a, DType t);
// `v` (named `label`) has shape `want`.
absl::Status CheckShape(const KernelArgs& a, const TensorView& v,
                        absl::string_view label, const Shape& want);
// Every one of `dims` fits cuBLAS's 32-bit int.
absl::Status CheckFitsBlas(const KernelArgs& a,
                           std::initializer_list<int64_t> dims);
// The optional bias input 2 (when `has_slot` and present): dtype t, [n].
absl::Status CheckBias(const KernelArgs& a, DType t, bool has_slot, int64_t n);

// Attribute getters whose errors name the kernel.
absl::StatusOr<int64_t> AttrInt(const KernelArgs& a, const std::string& name,
                                int64_t def);
absl::StatusOr<int64_t> AttrInt(const KernelArgs& a, const std::string& name);
absl::StatusOr<double> AttrFloat(const KernelArgs& a, const std::string& name,
                                 double def);
absl::StatusOr<bool> AttrBool(const KernelArgs& a, const std::string& name,
                              bool def);
absl::StatusOr<std::vector<int64_t>> AttrInts(const KernelArgs& a,
                                              const std::string& name);
absl::StatusOr<std::vector<int64_t>> AttrInts(
    const KernelArgs& a, const std::string& name,
    const std::vector<int64_t>& def);
// An axis attribute value mapped into [0, rank).
absl::StatusOr<int> NormalizeAxis(const KernelArgs& a, int64_t axis, int rank,
                                  absl::string_view what);

// --- backward kernels -------------------------------------------------------------

// The argument layout of a backward kernel "T_grad" (executor/cpu/kernels.h):
// inputs [x_0..x_{n-1}, y_0..y_{m-1}, dy_0..dy_{m-1}], outputs
// [dx_0..dx_{n-1}].
class GradArgs {
 public:
  // n = the output count, in [min_n, max_n]; m = num_y, or when num_y < 0
  // whatever the input count implies (split).
  static absl::StatusOr<GradArgs> Make(const KernelArgs& a, int min_n,
                                       int max_n, int num_y);
  // The backward of a one-input, one-output op, input 0 of dtype t.
  static absl::StatusOr<GradArgs> Unary(const KernelArgs& a, DType t);

  int n() const { return n_; }
  int m() const { return m_; }
  const TensorView& x(int i) const { return a_->in[i]; }
  const TensorView& y(int j) const { return a_->in[n_ + j]; }
  const TensorView& dy(int j) const { return a_->in[n_ + m_ + j]; }
  const TensorView& dx(int i) const { return a_->out[i]; }
  // A one-output op's gradient kernel has work: dy(0) and dx(0) present.
  bool active() const { return dy(0).present() && dx(0).present(); }

  // Present dy(j) (and y(j)) have dtype t and shape y_shapes[j]; present
  // dx(i) have dtype t, and x(i) is present with dx(i)'s shape.
  absl::Status Check(DType t, const std::vector<Shape>& y_shapes) const;
  // Present dx(i) for i in `no_grad` are an error (ids, targets).
  absl::Status CheckNoGrad(std::initializer_list<int> no_grad) const;

 private:
  const KernelArgs* a_ = nullptr;
  int n_ = 0, m_ = 0;
};

// --- shapes -------------------------------------------------------------------------

std::vector<int64_t> ContiguousStrides(const Shape& s);
// Numpy broadcasting: `small` reads as a tensor of shape `big`.
bool BroadcastsTo(const Shape& small, const Shape& big);
// Element strides of `small` read as `big` (0 along broadcast dimensions).
std::vector<int64_t> BroadcastStrides(const Shape& small, const Shape& big);

// --- scratch and GEMM -----------------------------------------------------------------

// `count` elements of T of the call's scratch memory (nullptr for 0).
template <typename T>
absl::StatusOr<T*> ScratchArray(const KernelArgs& a, int64_t count) {
  if (count <= 0) return static_cast<T*>(nullptr);
  absl::StatusOr<void*> p =
      a.scratch.Get(count * static_cast<int64_t>(sizeof(T)));
  if (!p.ok()) {
    return absl::Status(p.status().code(),
                        absl::StrCat("kernel '", a.name, "': scratch of ",
                                     count * sizeof(T),
                                     " bytes: ", p.status().message()));
  }
  return static_cast<T*>(*p);
}

// Row-major, batched: C[b] = op(A[b]) @ op(B[b]) + beta * C[b] for b <
// batch, A[b] = A + b * stride_a (likewise B, C); op = transpose when asked;
// op(A) is m x k, op(B) k x n. Float GEMMs use TF32 tensor cores only when
// the call allows it (KernelArgs::allow_tf32). Dimensions must fit int
// (CheckFitsBlas). Internal naming the kernel on a cuBLAS error.
template <typename T>
absl::Status Gemm(const KernelArgs& a, bool trans_a, bool trans_b, int64_t m,
                  int64_t n, int64_t k, const T* A, int64_t lda,
                  int64_t stride_a, const T* B, int64_t ldb, int64_t stride_b,
                  T beta, T* C, int64_t ldc, int64_t stride_c, int64_t batch);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_KERNEL_CHECKS_H_
