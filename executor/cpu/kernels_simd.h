// Float32 loops of the hottest non-GEMM kernels — softmax and log_softmax
// rows and their gradients, the SGD and AdamW updates, the sum of squares,
// dropout (its counter-based mask included) and gelu with its gradient —
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

// Dropout's per-call constants (kernels_elementwise.cc DropoutMask): the
// element with global index i is kept iff CounterUniform(key, i) >= p
// (counter_random.h), that is iff the top 53 bits of Mix64(key ^ Mix64(i))
// are >= threshold = DropoutThreshold(p) (an integer comparison, exact).
struct DropoutConstants {
  uint64_t key;        // CounterKey(rng_key, step)
  uint64_t threshold;  // DropoutThreshold(p)
  float scale;         // float(1 / (1 - p))
};
// ceil(p * 2^53) for p in [0, 1): CounterUniform is k * 2^-53 with k the top
// 53 bits, and k * 2^-53 >= p iff k >= ceil(p * 2^53) (p * 2^53 is exact).
uint64_t DropoutThreshold(double p);

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
  // y[j] = keep(counter + j) ? x[j] * scale : 0 (or y[j] += that, when
  // `accumulate`) for j < n; keep as DropoutConstants says. The same bits as
  // that scalar loop over CounterUniform: the mask is drawn in 64-bit integer
  // lanes (Mix64 lane by lane), the product is one float multiply.
  void (*dropout)(const DropoutConstants& c, uint64_t counter, const float* x,
                  int64_t n, bool accumulate, float* y);
  // y[j] = 0.5 x (1 + erf(x / sqrt(2))), x = x[j], j < n; erf and exp are
  // FastErf's and FastExp's (kernels_internal.h), and the result is the
  // scalar float expression's (kernels_elementwise.cc Gelu::F) bit for bit.
  void (*gelu)(const float* x, int64_t n, float* y);
  // dx[j] += dy[j] * (Phi(x) + x phi(x)), x = x[j], j < n: Gelu::D's
  // float expression bit for bit.
  void (*gelu_grad)(const float* x, const float* dy, int64_t n, float* dx);
  // log sum_j exp(x[j]) over j < n (-inf for n = 0): the lse softmax_row
  // subtracts for log_softmax, the same float.
  float (*log_sum_exp_row)(const float* x, int64_t n);
};

// The widest of AvailableIsas().
const FloatRows& Rows();
// `isa` must be one of AvailableIsas() (the baseline otherwise).
const FloatRows& RowsFor(Isa isa);

}  // namespace hap::executor::cpu::simd

#endif  // HAP_EXECUTOR_CPU_KERNELS_SIMD_H_
