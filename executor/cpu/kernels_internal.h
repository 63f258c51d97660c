// Internal to executor/cpu: what the kernel family files (kernels_*.cc)
// share — the call arguments, the registry type, argument checks whose errors
// name the kernel, the backward-kernel argument layout, a simple parallel-for,
// strided loops for broadcasting / permuting / reducing, and GEMM.
#ifndef HAP_EXECUTOR_CPU_KERNELS_INTERNAL_H_
#define HAP_EXECUTOR_CPU_KERNELS_INTERNAL_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "executor/runtime/kernel_context.h"
#include "executor/runtime/tensor.h"
#include "planner/graph/types.h"

namespace hap::executor::cpu {

// Everything one kernel call sees (kernels.h RunCpuKernel's arguments).
struct KernelArgs {
  const std::string& name;
  const KernelContext& ctx;
  const graph::Attrs& attrs;
  absl::Span<const TensorView> in;
  absl::Span<const TensorView> out;
};

using KernelFn = std::function<absl::Status(const KernelArgs&)>;
using KernelTable = std::map<std::string, KernelFn>;

// The dtype dispatch of FloatKernel and AnyKernel below, for any call type
// `Args` with the fields name, in and out (the CUDA kernels' too), so both
// backends pick a dtype and reject one with the same messages.
template <typename Args>
std::function<absl::Status(const Args&)> FloatDispatch(
    absl::Status (*f32)(const Args&), absl::Status (*f64)(const Args&)) {
  return [f32, f64](const Args& a) -> absl::Status {
    const TensorView* v = nullptr;
    for (absl::Span<const TensorView> side : {a.in, a.out}) {
      for (const TensorView& t : side) {
        if (v == nullptr && t.present() && graph::IsFloating(t.dtype)) v = &t;
      }
    }
    if (v == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("kernel '", a.name,
                       "': no floating-point tensor among its arguments"));
    }
    switch (v->dtype) {
      case DType::kFloat32:
        return f32(a);
      case DType::kFloat64:
        return f64(a);
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "kernel '", a.name, "': dtype ", graph::DTypeName(v->dtype),
            " is not supported (f32 or f64)"));
    }
  };
}
template <typename Args>
std::function<absl::Status(const Args&)> AnyDispatch(
    absl::Status (*f32)(const Args&), absl::Status (*f64)(const Args&),
    absl::Status (*i32)(const Args&), absl::Status (*i64)(const Args&)) {
  return [f32, f64, i32, i64](const Args& a) -> absl::Status {
    const TensorView* v = nullptr;
    for (absl::Span<const TensorView> side : {a.in, a.out}) {
      for (const TensorView& t : side) {
        if (v == nullptr && t.present()) v = &t;
      }
    }
    if (v == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("kernel '", a.name, "': every argument is absent"));
    }
    switch (v->dtype) {
      case DType::kFloat32:
        return f32(a);
      case DType::kFloat64:
        return f64(a);
      case DType::kInt32:
        return i32(a);
      case DType::kInt64:
        return i64(a);
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "kernel '", a.name, "': dtype ", graph::DTypeName(v->dtype),
            " is not supported (f32, f64, i32 or i64)"));
    }
  };
}

// A floating kernel instantiated for float and double. The call's dtype is
// that of its first present floating input (its first present floating
// output when no input is floating); other dtypes are InvalidArgument.
using TypedKernel = absl::Status (*)(const KernelArgs&);
KernelFn FloatKernel(TypedKernel f32, TypedKernel f64);
#define HAP_FLOAT_KERNEL(fn) \
  ::hap::executor::cpu::FloatKernel(&fn<float>, &fn<double>)
// The same for a kernel template whose second parameter is an int (the
// spatial dims of a convolution or pooling): fn<float, n>, fn<double, n>.
#define HAP_FLOAT_KERNEL_N(fn, n) ::hap::executor::cpu::FloatKernel(&fn<float, n>, &fn<double, n>)
// A data-movement kernel, instantiated for every dtype with CPU kernels
// (f32, f64, i32, i64); the dtype is that of its first present input
// (output when it has none).
KernelFn AnyKernel(TypedKernel f32, TypedKernel f64, TypedKernel i32,
                   TypedKernel i64);
#define HAP_ANY_KERNEL(fn)                                                \
  ::hap::executor::cpu::AnyKernel(&fn<float>, &fn<double>, &fn<int32_t>, \
                                  &fn<int64_t>)

// Registration, one function per family file.
void RegisterDenseKernels(KernelTable& t);          // linear, matmul
void RegisterConvolutionKernels(KernelTable& t);    // conv2d, conv3d, pooling
void RegisterElementwiseKernels(KernelTable& t);    // activations, binary
void RegisterNormalizationKernels(KernelTable& t);  // layer_norm, softmax
void RegisterBatchNormKernels(KernelTable& t);      // batch_norm and pieces
void RegisterLayoutKernels(KernelTable& t);         // shape ops, embedding
void RegisterReductionKernels(KernelTable& t);      // sum, mean
void RegisterLossKernels(KernelTable& t);           // nll_loss, cross_entropy
void RegisterMoeKernels(KernelTable& t);            // moe_*
void RegisterLstmKernels(KernelTable& t);           // lstm, gru
void RegisterRuntimeKernels(KernelTable& t);        // copies, optimizers

// --- errors and argument checks ---------------------------------------------

template <typename... P>
absl::Status Invalid(const KernelArgs& a, const P&... parts) {
  return absl::InvalidArgumentError(
      absl::StrCat("kernel '", a.name, "': ", parts...));
}

template <typename T>
constexpr DType DTypeOf() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
  if constexpr (std::is_same_v<T, int32_t>) return DType::kInt32;
  return DType::kInt64;
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
// One input, present and of dtype t, and one output: a one-input kernel.
absl::Status CheckUnary(const KernelArgs& a, DType t);
// CheckUnary, and the output has the input's shape (element-wise kernels).
absl::Status CheckElementwise(const KernelArgs& a, DType t);
// `v` (named `label`) has shape `want`.
absl::Status CheckShape(const KernelArgs& a, const TensorView& v,
                        absl::string_view label, const Shape& want);

// Attribute getters whose errors name the kernel.
absl::StatusOr<int64_t> AttrInt(const KernelArgs& a, const std::string& name,
                                int64_t def);
absl::StatusOr<int64_t> AttrInt(const KernelArgs& a, const std::string& name);
absl::StatusOr<double> AttrFloat(const KernelArgs& a, const std::string& name,
                                 double def);
absl::StatusOr<double> AttrFloat(const KernelArgs& a, const std::string& name);
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
// The value of an int-typed ids/targets tensor at flat index i.
inline int64_t IdAt(const TensorView& v, int64_t i) {
  return v.dtype == DType::kInt64 ? v.as<const int64_t>()[i]
                                  : v.as<const int32_t>()[i];
}

// --- the compact MoE ops (kernels_moe.cc; the CUDA kernels share these) --------

// A rank's view of moe_dispatch_idx / moe_combine_idx: the route int64
// [tokens, k]; it holds `experts` experts from `offset` on, of "experts"
// (the global count), and of each the `capacity` slots from
// `capacity_offset` on, of "capacity" (attributes, defaults the local
// count and capacity; "expert_offset" and "capacity_offset" default 0);
// rows d long. Route entries outside what it holds are skipped.
struct MoeIdxDims {
  int64_t tokens = 0, k = 0, experts = 0, capacity = 0, d = 0, offset = 0,
          global = 0, capacity_offset = 0, global_capacity = 0;
};
// moe_route's groups (its attribute "group_size", 0: all tokens one group)
// for a rank holding `tokens` tokens from "token_offset" on of
// "global_tokens" (the lowering's attributes; defaults 0 and `tokens`):
// tokens route in runs of `group`, run q (counted from `first_group`)
// filling slots [q * group_capacity, (q + 1) * group_capacity) of every
// expert. InvalidArgument when the groups do not divide the tokens or
// `capacity`, or the rank's tokens are not whole groups.
struct MoeGroups {
  int64_t group = 0, group_capacity = 0, first_group = 0;
};
absl::StatusOr<MoeGroups> CheckMoeGroups(const KernelArgs& a, int64_t tokens, int64_t capacity);
// moe_dispatch_idx: x[t, d], route, out[experts, capacity, d].
absl::StatusOr<MoeIdxDims> CheckMoeDispatchIdx(const KernelArgs& a, DType t,
                                               const TensorView& x,
                                               const TensorView& route,
                                               const TensorView& out);
// moe_combine_idx: y[experts, capacity, d], route, weights (route's shape).
absl::StatusOr<MoeIdxDims> CheckMoeCombineIdx(const KernelArgs& a, DType t,
                                              const TensorView& y,
                                              const TensorView& route,
                                              const TensorView& w);

// --- backward kernels ---------------------------------------------------------

// The argument layout of a backward kernel "T_grad" (kernels.h): inputs
// [x_0..x_{n-1}, y_0..y_{m-1}, dy_0..dy_{m-1}], outputs [dx_0..dx_{n-1}].
class GradArgs {
 public:
  // n = the output count, in [min_n, max_n]; m = num_y, or when num_y < 0
  // whatever the input count implies (split).
  static absl::StatusOr<GradArgs> Make(const KernelArgs& a, int min_n,
                                       int max_n, int num_y);
  // The backward of a one-input, one-output op, input 0 of dtype t.
  static absl::StatusOr<GradArgs> Unary(const KernelArgs& a, DType t);
  // Unary, and y/dy/dx have x's shape (element-wise ops).
  static absl::StatusOr<GradArgs> Elementwise(const KernelArgs& a, DType t);

  int n() const { return n_; }
  int m() const { return m_; }
  const TensorView& x(int i) const { return a_->in[i]; }
  const TensorView& y(int j) const { return a_->in[n_ + j]; }
  const TensorView& dy(int j) const { return a_->in[n_ + m_ + j]; }
  const TensorView& dx(int i) const { return a_->out[i]; }
  bool any_dy() const;
  bool any_dx() const;
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

// --- parallel loops -----------------------------------------------------------

// Elements of work below which a loop stays on the calling thread.
inline constexpr int64_t kParallelWork = 1 << 15;

// Items per chunk so that a chunk holds at least kParallelWork elements of
// work when each item costs `per_item` of them.
inline int64_t GrainFor(int64_t per_item) {
  return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, per_item));
}
// How many chunks RunChunks will use: at most `threads`, each at least
// `grain` items.
int NumChunks(int threads, int64_t n, int64_t grain);
// fn(chunk, begin, end) over [0, n) in `chunks` contiguous chunks; chunk 0
// runs on the calling thread.
void RunChunks(int chunks, int64_t n,
               const std::function<void(int, int64_t, int64_t)>& fn);
void ParallelFor(int threads, int64_t n, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn);

// --- strided loops ------------------------------------------------------------

std::vector<int64_t> ContiguousStrides(const Shape& s);
// Numpy broadcasting.
bool BroadcastsTo(const Shape& small, const Shape& big);
absl::StatusOr<Shape> BroadcastShape(const Shape& a, const Shape& b);
// Element strides of `small` read as a tensor of shape `big` (BroadcastsTo):
// 0 along broadcast dimensions.
std::vector<int64_t> BroadcastStrides(const Shape& small, const Shape& big);

// A loop nest over `shape` carrying the offsets of up to kMax operands, each
// with its own element strides over `shape`. Dimensions are merged where
// every operand allows, so rows (the innermost dimension) are long.
class StridedLoop {
 public:
  static constexpr int kMax = 3;
  StridedLoop(const Shape& shape,
              const std::vector<std::vector<int64_t>>& strides);

  int64_t rows() const { return rows_; }
  int64_t inner() const { return inner_; }
  int64_t inner_stride(int k) const { return inner_stride_[k]; }

  // fn(off) for rows [begin, end), off[k] the offset of operand k at the
  // row's first element.
  template <typename F>
  void ForRows(int64_t begin, int64_t end, F fn) const {
    if (begin >= end) return;
    const int nd = static_cast<int>(outer_.size());
    std::vector<int64_t> idx(nd);
    int64_t off[kMax] = {0, 0, 0};
    int64_t r = begin;
    for (int d = nd - 1; d >= 0; --d) {
      idx[d] = r % outer_[d];
      r /= outer_[d];
      for (int k = 0; k < kMax; ++k) off[k] += idx[d] * outer_stride_[d][k];
    }
    for (int64_t row = begin; row < end; ++row) {
      fn(static_cast<const int64_t*>(off));
      for (int d = nd - 1; d >= 0; --d) {
        for (int k = 0; k < kMax; ++k) off[k] += outer_stride_[d][k];
        if (++idx[d] < outer_[d]) break;
        for (int k = 0; k < kMax; ++k) off[k] -= outer_[d] * outer_stride_[d][k];
        idx[d] = 0;
      }
    }
  }

 private:
  std::vector<int64_t> outer_;
  std::vector<std::array<int64_t, kMax>> outer_stride_;
  int64_t rows_ = 1, inner_ = 1;
  int64_t inner_stride_[kMax] = {0, 0, 0};
};

// dst (+)= scale * src elementwise over `shape`, both read through their
// strides. A dst with a 0 stride is a reduction: it always accumulates, and
// runs serially.
template <typename D, typename S>
void StridedCopy(int threads, const Shape& shape, D* dst,
                 const std::vector<int64_t>& dst_strides, const S* src,
                 const std::vector<int64_t>& src_strides, bool accumulate,
                 D scale = D(1)) {
  StridedLoop loop(shape, {dst_strides, src_strides});
  const int64_t n = loop.inner(), sd = loop.inner_stride(0),
                ss = loop.inner_stride(1);
  bool reduction = false;
  for (size_t d = 0; d < shape.size(); ++d) {
    reduction = reduction || (dst_strides[d] == 0 && shape[d] > 1);
  }
  accumulate = accumulate || reduction;
  auto rows = [&](int64_t b, int64_t e) {
    loop.ForRows(b, e, [&](const int64_t* off) {
      D* d = dst + off[0];
      const S* s = src + off[1];
      if (sd == 0) {  // a row summed into one element: in double for floats
        using Acc = std::conditional_t<std::is_floating_point_v<D>, double, D>;
        Acc acc = 0;
        for (int64_t i = 0; i < n; ++i) acc += static_cast<Acc>(static_cast<D>(s[i * ss]));
        *d += scale * static_cast<D>(acc);
      } else if (accumulate) {
        for (int64_t i = 0; i < n; ++i) d[i * sd] += scale * static_cast<D>(s[i * ss]);
      } else {
        for (int64_t i = 0; i < n; ++i) d[i * sd] = scale * static_cast<D>(s[i * ss]);
      }
    });
  };
  if (reduction) {
    rows(0, loop.rows());
  } else {
    ParallelFor(threads, loop.rows(), GrainFor(n), rows);
  }
}

// dst[i] += src[i] for n elements.
template <typename T>
void AddTo(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// --- math that vectorizes ------------------------------------------------------
// The library builds with -O3 -fno-trapping-math -fno-math-errno so that
// loops over these inline, branch-free functions vectorize. Float gets fast
// approximations within a few ulp; double (what the finite-difference tests
// use) gets libm.

// e^x for float: Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-7
// Taylor polynomial (truncation error < 1e-8 relative), 2^n from exponent
// bits. Inputs below -87.3 (e.g. -inf masks) give 0; above 88.3 saturate.
inline float FastExp(float x) {
  constexpr float kHi = 88.3f, kLo = -87.3f, kRound = 12582912.0f;  // 1.5 * 2^23
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;  // round(x / ln 2)
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;    // x - n ln 2
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < kLo ? 0.0f : p * scale;
}

// erf for float: Abramowitz and Stegun 7.1.26 (absolute error < 1.5e-7,
// below float resolution of erf's values near 1).
inline float FastErf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return std::copysign(1.0f - p * t * FastExp(-ax * ax), x);
}

template <typename T>
inline T Exp(T x) {
  if constexpr (std::is_same_v<T, float>) return FastExp(x);
  return std::exp(x);
}
template <typename T>
inline T Erf(T x) {
  if constexpr (std::is_same_v<T, float>) return FastErf(x);
  return std::erf(x);
}

// Folds f(0..n) with `combine` in 8 independent lanes from `init` (they
// pipeline and vectorize where one running fold cannot).
template <typename A, typename F, typename C>
A LaneFold(int64_t n, A init, F f, C combine) {
  A acc[8];
  for (A& v : acc) v = init;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] = combine(acc[k], f(i + k));
  }
  for (; i < n; ++i) acc[i % 8] = combine(acc[i % 8], f(i));
  for (int w = 4; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) acc[k] = combine(acc[k], acc[k + w]);
  }
  return acc[0];
}

// sum of f(i) over [0, n), in double.
template <typename F>
double SumOver(int64_t n, F f) {
  return LaneFold(n, 0.0, f, [](double s, double v) { return s + v; });
}

// max of x[0, n) (n >= 1); NaN-free inputs.
template <typename T>
T MaxOf(const T* x, int64_t n) {
  return LaneFold(n, x[0], [x](int64_t j) { return x[j]; },
                  [](T m, T v) { return v > m ? v : m; });
}

// --- BLAS ---------------------------------------------------------------------

// Row-major C = alpha * op(A) @ op(B) + beta * C, op = transpose when asked;
// A is m x k after op, B k x n after op. (kernels_blas.cc wraps OpenBLAS.)
template <typename T>
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
          const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
          int64_t ldc);

// --- bfloat16 (kernels_bf16.cc; attribute "bf16" of kernels.h) ---------------

// x rounded to the nearest bfloat16 (ties to even), as a float; NaN stays NaN,
// infinities stay, values beyond bf16's largest finite round to infinity.
inline float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : r;
  float y;
  std::memcpy(&y, &r, 4);
  return y;
}
void RoundBf16InPlace(float* x, int64_t n);
// Row-major C = bf16(op(A)) @ bf16(op(B)) (+ C when `accumulate`), summed
// in float32 (oneDNN's bf16 matmul), then every element of C rounded to
// bfloat16: PyTorch autocast's bf16 matmul with a bf16 result. `threads`
// bounds oneDNN's OpenMP threads. Internal for an error of oneDNN.
absl::Status GemmBf16(int threads, bool trans_a, bool trans_b, int64_t m, int64_t n,
                      int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                      bool accumulate, float* c, int64_t ldc);
// GemmBf16's arithmetic through OpenBLAS on bf16-rounded float32 copies of
// the operands: GemmBf16's fallback where oneDNN has no bf16 matmul for the
// CPU, and its reference in tests.
void GemmBf16Blas(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                  int64_t lda, const float* b, int64_t ldb, bool accumulate, float* c,
                  int64_t ldc);
// The call's attribute "bf16" (default false); InvalidArgument when it is
// set on a call whose floating dtype T is not float32.
template <typename T>
absl::StatusOr<bool> Bf16Attr(const KernelArgs& a);
// C = op(A) @ op(B), or C += it when `accumulate`, in the call's precision:
// BLAS in T, or with `bf16` GemmBf16's rounded product added to C in
// float32 (how autocast adds a bf16 gradient into a float32 one).
template <typename T>
absl::Status Product(const KernelArgs& a, bool bf16, bool trans_a, bool trans_b,
                     int64_t m, int64_t n, int64_t k, const T* pa, int64_t lda,
                     const T* pb, int64_t ldb, bool accumulate, T* c, int64_t ldc);

// Every one of `dims` fits BLAS's 32-bit int; InvalidArgument otherwise.
// --- vocabulary-parallel cross-entropy (kernels_loss.cc; CUDA uses it too) -
// Input 0 holds classes [offset, offset + classes) of `vocab`; with
// `with_lse`, input 1 the targets (ids, one per row), input 2 every rank's
// row log-sum-exps ([ranks * rows], dtype t), attributes rank/ranks and
// global_rows. Target values are not read (CUDA's live on the device).
struct ShardedLossDims {
  int64_t rows = 0, classes = 0, offset = 0, vocab = 0, rank = 0, ranks = 1;
  double inv_rows = 1;  // 1 / global_rows
};
absl::StatusOr<ShardedLossDims> CheckShardedLoss(const KernelArgs& a, DType t,
                                                 bool with_lse);

// --- counter-based masks (dropout, drop_path; the CUDA kernels use it) --------

// The counter of a mask element is sum_d global_index_d * stride_d with
// these strides over `global` (the unsharded shape): dropout's are the
// contiguous strides (one draw per element); drop_path's (kernels named
// "drop_path*") mode "row" [1, 0, ...] (one draw per sample), mode "batch"
// all 0 (one draw). InvalidArgument for another mode.
absl::StatusOr<std::vector<int64_t>> MaskCounterStrides(const KernelArgs& a,
                                                        const Shape& global);

// --- batch_norm checks (kernels_batch_norm.cc; the CUDA kernels use them) ----

// x (input 0) viewed as [n, c, s]; count = attribute global_count (default
// n * s: the batch is all here).
struct BatchNormDims {
  int64_t n = 0, c = 0, s = 0;
  double count = 0, eps = 1e-5, momentum = 0.1;
};
// Input 0 of dtype t and rank >= 2; the present inputs among
// `channel_inputs` of dtype t and shape [c]; attributes eps, momentum,
// global_count.
absl::StatusOr<BatchNormDims> CheckBatchNorm(
    const KernelArgs& a, DType t, std::initializer_list<int> channel_inputs);
// `v` (named `label`) is a present f64 [2, c] tensor of per-channel sums.
absl::Status CheckBatchNormSums(const KernelArgs& a, const TensorView& v,
                                absl::string_view label, int64_t c);

absl::Status CheckFitsBlas(const KernelArgs& a,
                           std::initializer_list<int64_t> dims);
// The optional bias input 2 (when `has_slot` and present): dtype t, [n].
absl::Status CheckBias(const KernelArgs& a, DType t, bool has_slot, int64_t n);

// --- lstm and gru checks (kernels_lstm.cc; the CUDA kernels use them) -------

// x (input 0) [b, s, in], w_ih (input 1) [4h, in], w_hh (input 2) [4h, h] of
// dtype t; inputs 3 and 4 (b_ih, b_hh), when among the op's `n` inputs and
// present, [4h] of dtype t; attribute reverse. The caller checks the arity.
struct LstmDims {
  int64_t b = 0, s = 0, in = 0, h = 0;
  bool reverse = false;
};
absl::StatusOr<LstmDims> CheckLstm(const KernelArgs& a, DType t, int n);
// The same for gru: 3h (gates r, z, n) in place of 4h.
absl::StatusOr<LstmDims> CheckGru(const KernelArgs& a, DType t, int n);

// --- layout checks (kernels_layout.cc; the CUDA layout kernels use them too) -

// Attribute 'perm' checked as a permutation of [0, rank).
absl::StatusOr<std::vector<int>> Perm(const KernelArgs& a, int rank);

// out[i] = in[perm[i]]: the output's shape, and the input's strides read in
// output order.
struct Permuted {
  Shape shape;
  std::vector<int64_t> in_strides;
};
Permuted PermuteShape(const Shape& in, const std::vector<int>& perm);

// A tensor seen as [outer, len, inner] around axis `axis`.
struct AxisView {
  int64_t outer = 1, len = 1, inner = 1;
};
AxisView AroundAxis(const Shape& s, int axis);

// Shapes equal except along `axis`.
bool SameOffAxis(const Shape& x, const Shape& y, int axis);

// The parts of a concat (its inputs) or split (its outputs): each part's
// size along the whole's axis. `parts[i]` may be absent when
// `fallback_sizes` gives its size. `what` names a part in errors.
absl::StatusOr<std::vector<int64_t>> PartSizes(
    const KernelArgs& a, const TensorView& whole, int axis,
    const std::vector<const TensorView*>& parts, absl::string_view what,
    const std::vector<int64_t>& fallback_sizes);

// Attribute 'axis' mapped into [0, x's rank).
absl::StatusOr<int> AxisAttr(const KernelArgs& a, const TensorView& x);

// slice: attributes axis, start, end; the output's size along the axis is
// end - start.
struct SliceRange {
  int axis = 0;
  int64_t start = 0, end = 0;
};
absl::StatusOr<SliceRange> CheckSlice(const KernelArgs& a,
                                      const TensorView& x);

// --- reduction checks (kernels_reduction.cc; the CUDA sum/mean use them) ----

// sum/mean over attribute 'axes' (all when empty), 'keepdims' kept or not.
struct Reduced {
  Shape out;
  // The output's strides read over x's shape: 0 along reduced dimensions.
  std::vector<int64_t> strides;
  int64_t count = 1;  // local elements per output element
};
absl::StatusOr<Reduced> CheckReduction(const KernelArgs& a,
                                       const TensorView& x);

// The factor applied to sums: 1 (sum) or 1 / elements averaged (mean).
template <bool kMean>
absl::StatusOr<double> Factor(const KernelArgs& a, const Reduced& r) {
  if (!kMean) return 1.0;
  absl::StatusOr<int64_t> count = AttrInt(a, "global_count", r.count);
  if (!count.ok()) return count.status();
  if (*count < 1) return Invalid(a, "attribute 'global_count' must be >= 1");
  return 1.0 / static_cast<double>(*count);
}

}  // namespace hap::executor::cpu

#endif  // HAP_EXECUTOR_CPU_KERNELS_INTERNAL_H_
