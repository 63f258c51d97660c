// Float32 loops of the hottest non-GEMM kernels — softmax and log_softmax
// rows and their gradients, the SGD and AdamW updates, the sum of squares —
// written with GCC/Clang vector extensions, so that they vectorize at the
// baseline x86-64 target and -O2. On x86-64 with GCC the same code is also
// built for AVX2 and for AVX-512, and Rows() picks the widest one this CPU
// runs.
//
// Results are bit-identical whichever Isa runs them, on every CPU (and
// compiler): element-wise arithmetic is the same IEEE operations in the same
// order (the library is built without FMA contraction), and sums fold each
// element into the same one of kLanes logical lanes whatever the register
// width, then fold the lanes in a fixed order. Ranks on different CPU
// generations thus keep replicated parameters identical after an optimizer
// step.
//
// Thread-safety: every function is reentrant; Rows() decides once.
#ifndef HAP_EXECUTOR_CPU_KERNELS_SIMD_H_
#define HAP_EXECUTOR_CPU_KERNELS_SIMD_H_

#include <cstdint>
#include <vector>

namespace hap::executor::cpu::simd {

// The logical vector width, in floats.
inline constexpr int kLanes = 16;
// Sums accumulate in float lanes over blocks of at most this many elements;
// the blocks' sums are added in double.
inline constexpr int kSumBlock = 256;

// The instruction sets the row functions are built for.
enum class Isa { kBaseline, kAvx2, kAvx512 };
const char* IsaName(Isa isa);  // "baseline", "avx2", "avx512"
// Those this build has and this CPU runs, baseline first.
std::vector<Isa> AvailableIsas();

// AdamW's per-call constants, in float (kernels_runtime.cc AdamUpdate).
struct AdamConstants {
  float clip;      // gradient clipping factor
  float decay;     // 1 - lr * weight_decay
  float b1, b2;    // the moments' betas
  float step;      // lr / (1 - b1^t)
  float sqrt_bc2;  // sqrt(1 - b2^t)
  float eps;
};

// SGD's per-call constants (kernels_runtime.cc SgdUpdate).
struct SgdConstants {
  float clip, lr, weight_decay, momentum;
};

// One Isa's build of every loop. Pointers are to n (or cols) floats, unaligned;
// an output may be the same buffer as an input of the same element index
// (the optimizers update in place), but not overlap it otherwise.
struct FloatRows {
  Isa isa;
  // y[0, valid) = softmax (or, when `log`, log_softmax) of x[j] +
  // mask[j * mask_stride] over j in [0, valid) (no mask: mask == nullptr);
  // y[valid, cols) = 0. Exp is FastExp's (kernels_internal.h): inputs below
  // -87.3, -inf included, give 0. A row whose values are all -inf gives NaN.
  void (*softmax_row)(const float* x, const float* mask, int64_t mask_stride,
                      int64_t valid, int64_t cols, bool log, float* y);
  // dx[j] += y[j] * (dy[j] - s), s = sum of dy * y (softmax), or
  // dx[j] += dy[j] - exp(y[j]) * s, s = sum of dy (log_softmax); j < cols.
  void (*softmax_grad_row)(const float* y, const float* dy, int64_t cols,
                           bool log, float* dx);
  // g = grad * clip; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  // out = param * decay - step * m / (sqrt(v) / sqrt_bc2 + eps).
  void (*adam)(const AdamConstants& c, const float* param, const float* grad,
               float* m, float* v, float* out, int64_t n);
  // g = grad * clip + weight_decay * param; with a momentum buffer (not
  // null) mbuf = momentum * mbuf + g, g = mbuf; out = param - lr * g.
  void (*sgd)(const SgdConstants& c, const float* param, const float* grad,
              float* mbuf, float* out, int64_t n);
  // The sum of p[i]^2, each square and the sum in double.
  double (*sum_squares)(const float* p, int64_t n);
};

// The widest of AvailableIsas().
const FloatRows& Rows();
// `isa` must be one of AvailableIsas() (the baseline otherwise).
const FloatRows& RowsFor(Isa isa);

}  // namespace hap::executor::cpu::simd

#endif  // HAP_EXECUTOR_CPU_KERNELS_SIMD_H_
