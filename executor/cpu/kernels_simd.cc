// The loops of kernels_simd.h. Each is written once, as always-inline
// templates over a native vector type V (4, 8 or 16 floats), and stamped out
// per Isa by HAP_SIMD_ROWS: the compiler inlines the body into a wrapper
// built for that Isa's target, so one source gives SSE2, AVX2 and AVX-512
// code.
//
// Why vector extensions rather than plain loops: GCC at -O2 vectorizes only
// loops with a known trip count, and the float selects of FastExp become
// branches, so a plain exp loop stays scalar even at -O3 -mavx2.
//
// Why native types and a Pack of them rather than one 16-float type: a
// vector type wider than the target's registers has no machine mode, so GCC
// keeps it in memory and every operation goes through the stack (slower
// than scalar code). Element-wise loops use V directly; sums and maxima use
// a Pack, kLanes floats as kLanes / width native vectors, so that every Isa
// folds the same elements into the same logical lane.
#include "executor/cpu/kernels_simd.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HAP_SIMD_X86_ISAS 1
#endif

// Helpers and the loop bodies (lambdas) are always inlined, so that they
// are built for the target of the wrapper that calls them.
#define HAP_SIMD_INLINE inline __attribute__((always_inline))
#define HAP_SIMD_INLINE_LAMBDA __attribute__((always_inline))

namespace hap::executor::cpu::simd {
namespace {

typedef float F4 __attribute__((vector_size(16)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F16 __attribute__((vector_size(64)));

template <typename V>
struct Native {
  static constexpr int kWidth = sizeof(V) / sizeof(float);
  // Native vectors per logical vector of kLanes.
  static constexpr int kParts = kLanes / kWidth;
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  typedef uint32_t U __attribute__((vector_size(sizeof(V))));
  // kWidth / 2 64-bit lanes (dropout's counters).
  typedef uint64_t Q __attribute__((vector_size(sizeof(V))));
  static_assert(kLanes % kWidth == 0, "a logical vector holds whole parts");
};

static_assert(kSumBlock % kLanes == 0, "blocks hold whole logical vectors");

// f(std::integral_constant<int, i>) for i in [0, kCount): constant indices,
// so that arrays of vectors indexed by i stay in registers.
template <typename F, int... kI>
HAP_SIMD_INLINE void UnrollSeq(F& f, std::integer_sequence<int, kI...>) {
  (f(std::integral_constant<int, kI>{}), ...);
}
template <int kCount, typename F>
HAP_SIMD_INLINE void Unroll(F&& f) {
  UnrollSeq(f, std::make_integer_sequence<int, kCount>{});
}

template <typename V>
HAP_SIMD_INLINE V Splat(float x) {
  V v;
  for (int k = 0; k < Native<V>::kWidth; ++k) v[k] = x;
  return v;
}

template <typename V>
HAP_SIMD_INLINE V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
HAP_SIMD_INLINE void Store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// base[at, at + n) for n <= kWidth (none when n <= 0); the other lanes 0.
template <typename V>
HAP_SIMD_INLINE V LoadFirst(const float* base, int64_t at, int64_t n) {
  if (n >= Native<V>::kWidth) return Load<V>(base + at);
  V v = Splat<V>(0.0f);
  if (n > 0) std::memcpy(&v, base + at, static_cast<size_t>(n) * sizeof(float));
  return v;
}

// The first n lanes of v to base[at, at + n).
template <typename V>
HAP_SIMD_INLINE void StoreFirst(float* base, int64_t at, int64_t n, V v) {
  if (n >= Native<V>::kWidth) {
    Store(base + at, v);
  } else if (n > 0) {
    std::memcpy(base + at, &v, static_cast<size_t>(n) * sizeof(float));
  }
}

// v in lanes [0, n), `fill` in the others.
template <typename V>
HAP_SIMD_INLINE V KeepFirst(V v, int64_t n, float fill) {
  if (n >= Native<V>::kWidth) return v;
  typename Native<V>::I lane;
  for (int k = 0; k < Native<V>::kWidth; ++k) lane[k] = k;
  return lane < static_cast<int32_t>(n) ? v : Splat<V>(fill);
}

template <typename V>
HAP_SIMD_INLINE V Max(V a, V b) {
  return b > a ? b : a;
}

template <typename V>
HAP_SIMD_INLINE V Sqrt(V v) {
  V r;
  for (int k = 0; k < Native<V>::kWidth; ++k) r[k] = __builtin_sqrtf(v[k]);
  return r;
}

// FastExp (kernels_internal.h) lane by lane, bit for bit: the same clamp at
// 88.3, Cody-Waite reduction and polynomial. 2^n comes from t's bits
// instead of a float-to-int conversion: t = x log2(e) + 1.5 2^23 holds n in
// its low mantissa bits, so (bits(t) + 127) << 23 is 2^n's exponent field
// (the bits above wrap out of the shift). FastExp's clamp at -87.3 is left
// out: lanes below it compute garbage (no traps) that the last select
// replaces with 0, as FastExp returns.
template <typename V>
HAP_SIMD_INLINE V Exp(V x) {
  typedef typename Native<V>::U U;
  const V hi = Splat<V>(88.3f), lo = Splat<V>(-87.3f),
          round = Splat<V>(12582912.0f);
  const V xc = x > hi ? hi : x;
  const V t = xc * 1.44269504088896341f + round;
  const V n = t - round;
  const V r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = Splat<V>(1.0f / 5040);
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const U bits = (__builtin_bit_cast(U, t) + 127u) << 23;
  const V e = p * __builtin_bit_cast(V, bits);
  return x < lo ? Splat<V>(0.0f) : e;
}

// fn(at, n) over [0, len) in native vectors (n == kWidth), then one tail
// (0 < n < kWidth). For element-wise loops.
template <typename V, typename F>
HAP_SIMD_INLINE void ForVectors(int64_t len, F&& fn) {
  constexpr int kWidth = Native<V>::kWidth;
  int64_t at = 0;
  for (; at + kWidth <= len; at += kWidth) fn(at, int64_t{kWidth});
  if (at < len) fn(at, len - at);
}

// A logical vector of kLanes floats: logical lane p * kWidth + k is lane k
// of part p.
template <typename V>
struct Pack {
  V part[Native<V>::kParts];
};

template <typename V>
HAP_SIMD_INLINE Pack<V> SplatPack(float x) {
  Pack<V> r;
  Unroll<Native<V>::kParts>(
      [&](auto p) HAP_SIMD_INLINE_LAMBDA { r.part[p] = Splat<V>(x); });
  return r;
}

// fn(at, n, p) over [0, len) in logical vectors: part p covers [at, at + n),
// n == kWidth, then the parts of one partial logical vector (0 <= n <=
// kWidth; n == 0 past len). For sums and maxima into a Pack.
template <typename V, typename F>
HAP_SIMD_INLINE void ForLogical(int64_t len, F&& fn) {
  constexpr int kWidth = Native<V>::kWidth, kParts = Native<V>::kParts;
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    Unroll<kParts>([&](auto p) HAP_SIMD_INLINE_LAMBDA {
      fn(j + p * kWidth, int64_t{kWidth}, p);
    });
  }
  if (j < len) {
    Unroll<kParts>([&](auto p) HAP_SIMD_INLINE_LAMBDA {
      const int64_t n = len - j - p * kWidth;
      fn(j + p * kWidth, n < 0 ? 0 : n > kWidth ? kWidth : n, p);
    });
  }
}

// A Pack's logical lanes in order: their max, and their sum in double.
template <typename V>
HAP_SIMD_INLINE float MaxLanes(const Pack<V>& a) {
  float lanes[kLanes];
  std::memcpy(lanes, &a, sizeof(lanes));
  float m = lanes[0];
  for (int k = 1; k < kLanes; ++k) m = lanes[k] > m ? lanes[k] : m;
  return m;
}
template <typename V>
HAP_SIMD_INLINE double SumLanes(const Pack<V>& a) {
  float lanes[kLanes];
  std::memcpy(lanes, &a, sizeof(lanes));
  double s = 0;
  for (int k = 0; k < kLanes; ++k) s += static_cast<double>(lanes[k]);
  return s;
}

// --- softmax, log_softmax ---------------------------------------------------

// How a row's mask is read: none, one value per column, one for the row.
enum class MaskKind { kNone, kColumns, kScalar };

// x + mask at columns [at, at + n) (the other lanes unspecified).
template <typename V, MaskKind kKind>
HAP_SIMD_INLINE V Masked(const float* x, const float* mask, int64_t at,
                         int64_t n) {
  V v = LoadFirst<V>(x, at, n);
  if constexpr (kKind == MaskKind::kColumns) {
    v += LoadFirst<V>(mask, at, n);
  } else if constexpr (kKind == MaskKind::kScalar) {
    v += mask[0];
  }
  return v;
}

// The row of softmax_row with `valid` >= 1. The passes reread x (and the
// mask) rather than storing x + mask: one store pass less.
// The row's max and the sum of exp(x + mask - max) over its first `valid`
// (>= 1) columns: in float over blocks, in double across them. With
// kStore, y receives the exponentials.
template <typename V, MaskKind kKind, bool kStore>
HAP_SIMD_INLINE std::pair<float, double> RowMaxAndSum(const float* x,
                                                      const float* mask,
                                                      int64_t valid, float* y) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  Pack<V> vmax = SplatPack<V>(-kInf);
  ForLogical<V>(valid, [&](int64_t at, int64_t n,
                           auto p) HAP_SIMD_INLINE_LAMBDA {
    vmax.part[p] = Max(vmax.part[p],
                       KeepFirst(Masked<V, kKind>(x, mask, at, n), n, -kInf));
  });
  const float row_max = MaxLanes(vmax);
  const V mx = Splat<V>(row_max);
  double sum = 0;
  for (int64_t b = 0; b < valid; b += kSumBlock) {
    const int64_t len = valid - b < kSumBlock ? valid - b : kSumBlock;
    Pack<V> acc = SplatPack<V>(0.0f);
    ForLogical<V>(
        len, [&](int64_t at, int64_t n, auto p) HAP_SIMD_INLINE_LAMBDA {
          const V e = KeepFirst(Exp(Masked<V, kKind>(x, mask, b + at, n) - mx),
                                n, 0.0f);
          acc.part[p] += e;
          if constexpr (kStore) StoreFirst(y, b + at, n, e);
        });
    sum += SumLanes(acc);
  }
  return {row_max, sum};
}

template <typename V, MaskKind kKind, bool kLog>
HAP_SIMD_INLINE void SoftmaxRowOf(const float* x, const float* mask,
                                  int64_t valid, float* y) {
  const auto [row_max, sum] = RowMaxAndSum<V, kKind, !kLog>(x, mask, valid, y);
  if constexpr (kLog) {
    const V lse = Splat<V>(row_max + static_cast<float>(std::log(sum)));
    ForVectors<V>(valid, [&](int64_t at, int64_t n) HAP_SIMD_INLINE_LAMBDA {
      StoreFirst(y, at, n, Masked<V, kKind>(x, mask, at, n) - lse);
    });
  } else {
    const V inv = Splat<V>(static_cast<float>(1.0 / sum));
    ForVectors<V>(valid, [&](int64_t at, int64_t n) HAP_SIMD_INLINE_LAMBDA {
      StoreFirst(y, at, n, LoadFirst<V>(y, at, n) * inv);
    });
  }
}

// log_softmax's lse: the max plus the log of the sum, in float.
template <typename V>
HAP_SIMD_INLINE float LogSumExpRow(const float* x, int64_t n) {
  if (n <= 0) return -std::numeric_limits<float>::infinity();
  const auto [row_max, sum] = RowMaxAndSum<V, MaskKind::kNone, false>(x, nullptr, n, nullptr);
  return row_max + static_cast<float>(std::log(sum));
}

template <typename V, bool kLog>
HAP_SIMD_INLINE void SoftmaxRowLog(const float* x, const float* mask,
                                   int64_t ms, int64_t valid, float* y) {
  if (mask == nullptr) {
    SoftmaxRowOf<V, MaskKind::kNone, kLog>(x, nullptr, valid, y);
  } else if (ms == 1) {
    SoftmaxRowOf<V, MaskKind::kColumns, kLog>(x, mask, valid, y);
  } else if (ms == 0) {
    SoftmaxRowOf<V, MaskKind::kScalar, kLog>(x, mask, valid, y);
  } else {
    // Any other stride (not made by kernels_normalization.cc): gather x +
    // mask into y first, then the unmasked row in place.
    for (int64_t j = 0; j < valid; ++j) y[j] = x[j] + mask[j * ms];
    SoftmaxRowOf<V, MaskKind::kNone, kLog>(y, nullptr, valid, y);
  }
}

template <typename V>
HAP_SIMD_INLINE void SoftmaxRow(const float* x, const float* mask, int64_t ms,
                                int64_t valid, int64_t cols, bool log,
                                float* y) {
  if (valid > 0) {
    if (log) {
      SoftmaxRowLog<V, true>(x, mask, ms, valid, y);
    } else {
      SoftmaxRowLog<V, false>(x, mask, ms, valid, y);
    }
  }
  for (int64_t j = valid < 0 ? 0 : valid; j < cols; ++j) y[j] = 0.0f;
}

// The sum of a[j] (or a[j] * b[j]) over [0, n), in float lanes within
// blocks and in double across them.
template <typename V, bool kProduct>
HAP_SIMD_INLINE double BlockSum(const float* a, const float* b, int64_t n) {
  double sum = 0;
  for (int64_t s = 0; s < n; s += kSumBlock) {
    const int64_t len = n - s < kSumBlock ? n - s : kSumBlock;
    Pack<V> acc = SplatPack<V>(0.0f);
    ForLogical<V>(len,
                  [&](int64_t at, int64_t k, auto p) HAP_SIMD_INLINE_LAMBDA {
                    V v = LoadFirst<V>(a, s + at, k);
                    if constexpr (kProduct) {
                      v *= LoadFirst<V>(b, s + at, k);
                    }
                    acc.part[p] += v;
                  });
    sum += SumLanes(acc);
  }
  return sum;
}

template <typename V, bool kLog>
HAP_SIMD_INLINE void SoftmaxGradRowLog(const float* y, const float* dy,
                                       int64_t cols, float* dx) {
  const V s =
      Splat<V>(static_cast<float>(kLog ? BlockSum<V, false>(dy, nullptr, cols)
                                       : BlockSum<V, true>(dy, y, cols)));
  ForVectors<V>(cols, [&](int64_t at, int64_t n) HAP_SIMD_INLINE_LAMBDA {
    const V yv = LoadFirst<V>(y, at, n);
    const V dyv = LoadFirst<V>(dy, at, n);
    V dxv = LoadFirst<V>(dx, at, n);
    if constexpr (kLog) {
      dxv += dyv - Exp(yv) * s;
    } else {
      dxv += yv * (dyv - s);
    }
    StoreFirst(dx, at, n, dxv);
  });
}

template <typename V>
HAP_SIMD_INLINE void SoftmaxGradRow(const float* y, const float* dy,
                                    int64_t cols, bool log, float* dx) {
  if (log) {
    SoftmaxGradRowLog<V, true>(y, dy, cols, dx);
  } else {
    SoftmaxGradRowLog<V, false>(y, dy, cols, dx);
  }
}

// --- optimizers and the squared norm
// ------------------------------------------

template <typename V>
HAP_SIMD_INLINE void Adam(const AdamConstants& c, const float* param,
                          const float* grad, float* m, float* v, float* out,
                          int64_t n) {
  // Copies: the stores below could alias `c` as far as the compiler knows.
  const V clip = Splat<V>(c.clip), decay = Splat<V>(c.decay),
          b1 = Splat<V>(c.b1), b2 = Splat<V>(c.b2),
          one_b1 = Splat<V>(1.0f - c.b1), one_b2 = Splat<V>(1.0f - c.b2),
          step = Splat<V>(c.step), sqrt_bc2 = Splat<V>(c.sqrt_bc2),
          eps = Splat<V>(c.eps);
  ForVectors<V>(n, [&](int64_t i, int64_t k) HAP_SIMD_INLINE_LAMBDA {
    const V g = LoadFirst<V>(grad, i, k) * clip;
    const V mv = b1 * LoadFirst<V>(m, i, k) + one_b1 * g;
    const V vv = b2 * LoadFirst<V>(v, i, k) + one_b2 * g * g;
    const V denom = Sqrt(vv) / sqrt_bc2 + eps;
    const V o = LoadFirst<V>(param, i, k) * decay - step * mv / denom;
    StoreFirst(m, i, k, mv);
    StoreFirst(v, i, k, vv);
    StoreFirst(out, i, k, o);
  });
}

template <typename V>
HAP_SIMD_INLINE void Sgd(const SgdConstants& c, const float* param,
                         const float* grad, float* mbuf, float* out,
                         int64_t n) {
  const V clip = Splat<V>(c.clip), lr = Splat<V>(c.lr),
          weight_decay = Splat<V>(c.weight_decay),
          momentum = Splat<V>(c.momentum);
  ForVectors<V>(n, [&](int64_t i, int64_t k) HAP_SIMD_INLINE_LAMBDA {
    const V p = LoadFirst<V>(param, i, k);
    V g = LoadFirst<V>(grad, i, k) * clip + weight_decay * p;
    if (mbuf != nullptr) {
      g = momentum * LoadFirst<V>(mbuf, i, k) + g;
      StoreFirst(mbuf, i, k, g);
    }
    StoreFirst(out, i, k, p - lr * g);
  });
}

// kLanes double accumulators, element i into lane i % kLanes, folded in
// order: the same sum on every Isa (the compiler vectorizes the lanes).
HAP_SIMD_INLINE double SumSquares(const float* p, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      acc[k] += static_cast<double>(p[i + k]) * p[i + k];
    }
  }
  for (int k = 0; i + k < n; ++k) {
    acc[k] += static_cast<double>(p[i + k]) * p[i + k];
  }
  double s = 0;
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  return s;
}

// --- dropout -----------------------------------------------------------------

// counter_random.h's Mix64 (SplitMix64's finaliser) in 64-bit lanes. Each
// u64 multiply is exact whatever instructions the target lowers it to.
template <typename Q>
HAP_SIMD_INLINE Q Mix64(Q z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Dropout over native vectors of kWidth floats. The mask of a vector comes
// from two vectors Q of kWidth / 2 64-bit lanes: `odd` draws the elements
// at + 1, at + 3, ..., `even` those at + 0, at + 2, .... d = (top 53 bits)
// - threshold is negative (as int64; both are below 2^53) exactly where an
// element is dropped, so the high 32-bit half of d carries the decision in
// its sign. Odd elements' high halves already sit in float lanes 2k + 1;
// even elements' move down to lanes 2k. An arithmetic shift by 31 of those
// 32-bit lanes gives all ones where dropped, which clears the product to
// +0.0f (the scalar loop's 0).
template <typename V>
HAP_SIMD_INLINE void Dropout(const DropoutConstants& c, uint64_t counter,
                             const float* x, int64_t n, bool accumulate,
                             float* y) {
  typedef typename Native<V>::I I;
  typedef typename Native<V>::Q Q;
  constexpr int kHalf = Native<V>::kWidth / 2;
  Q odd_at, even_at;
  for (int k = 0; k < kHalf; ++k) {
    odd_at[k] = 2 * k + 1;
    even_at[k] = 2 * k;
  }
  const uint64_t key = c.key, threshold = c.threshold;
  const V scale = Splat<V>(c.scale);
  const Q high = Q{} + 0xffffffff00000000ULL;
  auto drop_mask = [&](int64_t at) HAP_SIMD_INLINE_LAMBDA {
    const Q base = Q{} + (counter + static_cast<uint64_t>(at));
    const Q d_odd = (Mix64(key ^ Mix64(base + odd_at)) >> 11) - threshold;
    const Q d_even = (Mix64(key ^ Mix64(base + even_at)) >> 11) - threshold;
    return __builtin_bit_cast(I, (d_odd & high) | (d_even >> 32)) >> 31;
  };
  if (accumulate) {
    ForVectors<V>(n, [&](int64_t at, int64_t k) HAP_SIMD_INLINE_LAMBDA {
      const I drop = drop_mask(at);
      const V kept = __builtin_bit_cast(
          V, __builtin_bit_cast(I, LoadFirst<V>(x, at, k) * scale) & ~drop);
      StoreFirst(y, at, k, LoadFirst<V>(y, at, k) + kept);
    });
  } else {
    ForVectors<V>(n, [&](int64_t at, int64_t k) HAP_SIMD_INLINE_LAMBDA {
      const I drop = drop_mask(at);
      StoreFirst(y, at, k,
                 __builtin_bit_cast(
                     V, __builtin_bit_cast(I, LoadFirst<V>(x, at, k) * scale) &
                            ~drop));
    });
  }
}

// --- gelu ------------------------------------------------------------------

// FastErf (kernels_internal.h) lane by lane, bit for bit: fabs and copysign
// as sign-bit masks, then the same float operations in the same order.
template <typename V>
HAP_SIMD_INLINE V Erf(V x) {
  typedef typename Native<V>::U U;
  const U bits = __builtin_bit_cast(U, x);
  const U sign = bits & 0x80000000u;
  const V ax = __builtin_bit_cast(V, bits & 0x7fffffffu);
  const V t = 1.0f / (1.0f + 0.3275911f * ax);
  V p = Splat<V>(1.061405429f);
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const V r = 1.0f - p * t * Exp(-ax * ax);
  return __builtin_bit_cast(V, (__builtin_bit_cast(U, r) & 0x7fffffffu) | sign);
}

// kernels_elementwise.cc Gelu's float constants.
constexpr float kSqrtHalf = static_cast<float>(M_SQRT1_2);
constexpr float kInvSqrt2Pi = static_cast<float>(0.3989422804014327);

template <typename V>
HAP_SIMD_INLINE void Gelu(const float* x, int64_t n, float* y) {
  ForVectors<V>(n, [&](int64_t at, int64_t k) HAP_SIMD_INLINE_LAMBDA {
    const V v = LoadFirst<V>(x, at, k);
    StoreFirst(y, at, k, 0.5f * v * (1.0f + Erf(v * kSqrtHalf)));
  });
}

template <typename V>
HAP_SIMD_INLINE void GeluGrad(const float* x, const float* dy, int64_t n,
                              float* dx) {
  ForVectors<V>(n, [&](int64_t at, int64_t k) HAP_SIMD_INLINE_LAMBDA {
    const V v = LoadFirst<V>(x, at, k);
    const V cdf = 0.5f * (1.0f + Erf(v * kSqrtHalf));
    const V pdf = Exp(-0.5f * v * v) * kInvSqrt2Pi;
    StoreFirst(dx, at, k,
               LoadFirst<V>(dx, at, k) + LoadFirst<V>(dy, at, k) *
                                             (cdf + v * pdf));
  });
}

// One Isa's wrappers (plain functions built for TARGET on native vectors V,
// the body inlined) and their table.
#define HAP_SIMD_ROWS(NAME, ISA, V, TARGET)                                   \
  TARGET void SoftmaxRow##NAME(const float* x, const float* mask, int64_t ms, \
                               int64_t valid, int64_t cols, bool log,         \
                               float* y) {                                    \
    SoftmaxRow<V>(x, mask, ms, valid, cols, log, y);                          \
  }                                                                           \
  TARGET void SoftmaxGradRow##NAME(const float* y, const float* dy,           \
                                   int64_t cols, bool log, float* dx) {       \
    SoftmaxGradRow<V>(y, dy, cols, log, dx);                                  \
  }                                                                           \
  TARGET void Adam##NAME(const AdamConstants& c, const float* param,          \
                         const float* grad, float* m, float* v, float* out,   \
                         int64_t n) {                                         \
    Adam<V>(c, param, grad, m, v, out, n);                                    \
  }                                                                           \
  TARGET void Sgd##NAME(const SgdConstants& c, const float* param,            \
                        const float* grad, float* mbuf, float* out,           \
                        int64_t n) {                                          \
    Sgd<V>(c, param, grad, mbuf, out, n);                                     \
  }                                                                           \
  TARGET double SumSquares##NAME(const float* p, int64_t n) {                 \
    return SumSquares(p, n);                                                  \
  }                                                                           \
  TARGET void Dropout##NAME(const DropoutConstants& c, uint64_t counter,      \
                            const float* x, int64_t n, bool accumulate,       \
                            float* y) {                                       \
    Dropout<V>(c, counter, x, n, accumulate, y);                              \
  }                                                                           \
  TARGET void Gelu##NAME(const float* x, int64_t n, float* y) {               \
    Gelu<V>(x, n, y);                                                         \
  }                                                                           \
  TARGET void GeluGrad##NAME(const float* x, const float* dy, int64_t n,      \
                             float* dx) {                                     \
    GeluGrad<V>(x, dy, n, dx);                                                \
  }                                                                           \
  TARGET float LogSumExpRow##NAME(const float* x, int64_t n) {                \
    return LogSumExpRow<V>(x, n);                                             \
  }                                                                           \
  const FloatRows k##NAME##Rows = {                                           \
      ISA,         &SoftmaxRow##NAME, &SoftmaxGradRow##NAME,                  \
      &Adam##NAME, &Sgd##NAME,        &SumSquares##NAME,                      \
      &Dropout##NAME, &Gelu##NAME,    &GeluGrad##NAME,                        \
      &LogSumExpRow##NAME};

// SSE2 on x86-64 (NEON on AArch64): 4 floats.
HAP_SIMD_ROWS(Baseline, Isa::kBaseline, F4, )
#ifdef HAP_SIMD_X86_ISAS
// No FMA: the build contracts none (BUILD.bazel), for the same bits.
HAP_SIMD_ROWS(Avx2, Isa::kAvx2, F8, __attribute__((target("avx2"))))
HAP_SIMD_ROWS(Avx512, Isa::kAvx512, F16, __attribute__((target("avx512f"))))
#endif

}  // namespace

uint64_t DropoutThreshold(double p) {
  return static_cast<uint64_t>(std::ceil(p * 9007199254740992.0));  // 2^53
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    default:
      return "baseline";
  }
}

std::vector<Isa> AvailableIsas() {
  std::vector<Isa> isas = {Isa::kBaseline};
#ifdef HAP_SIMD_X86_ISAS
  __builtin_cpu_init();
  // Also checks that the OS saves the wider registers.
  if (__builtin_cpu_supports("avx2")) {
    isas.push_back(Isa::kAvx2);
    if (__builtin_cpu_supports("avx512f")) isas.push_back(Isa::kAvx512);
  }
#endif
  return isas;
}

const FloatRows& RowsFor(Isa isa) {
#ifdef HAP_SIMD_X86_ISAS
  for (Isa a : AvailableIsas()) {
    if (a != isa) continue;
    if (isa == Isa::kAvx2) return kAvx2Rows;
    if (isa == Isa::kAvx512) return kAvx512Rows;
  }
#endif
  (void)isa;
  return kBaselineRows;
}

const FloatRows& Rows() {
  static const FloatRows& best = RowsFor(AvailableIsas().back());
  return best;
}

}  // namespace hap::executor::cpu::simd
