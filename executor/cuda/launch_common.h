// Internal to executor/cuda: plain data the kernel families hand their
// launchers (launch_*.h, implemented in .cu files compiled by nvcc, so no
// Abseil here): index spaces with per-operand strides, at most kMaxDims
// dimensions after merging (MakeSpace).
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_COMMON_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_COMMON_H_

#include <cstdint>

// Index math shared by device code and host tests (so it is checked
// without a GPU): __host__ __device__ under nvcc.
#if defined(__CUDACC__)
#define HAP_CUDA_HD __host__ __device__
#else
#define HAP_CUDA_HD
#endif

namespace hap::executor::cuda {

inline constexpr int kMaxDims = 8;
inline constexpr int kMaxOperands = 3;

// A row-major index space and the element strides of up to kMaxOperands
// operands over it: element i (flat, row-major) of the space is element
// sum_d idx_d * stride[k][d] of operand k.
struct StridedSpace {
  int rank = 0;
  int64_t count = 1;  // product of shape
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxOperands][kMaxDims] = {};
};

// out[o] (+)= scale * sum over the reduced space of a * b (b absent: 1).
// `kept` enumerates outputs (operands: 0 out, 1 a, 2 b); `reduced` the
// elements summed into each (operands: 0 unused, 1 a, 2 b).
struct ReduceSpace {
  StridedSpace kept;
  StridedSpace reduced;
};

// off[k] = the offset in operand k (k < K) of element i of `s`.
template <int K>
HAP_CUDA_HD inline void SpaceOffsets(const StridedSpace& s, int64_t i,
                                     int64_t* off) {
  for (int k = 0; k < K; ++k) off[k] = 0;
  for (int d = s.rank - 1; d >= 0; --d) {
    const int64_t idx = i % s.shape[d];
    i /= s.shape[d];
    for (int k = 0; k < K; ++k) off[k] += idx * s.stride[k][d];
  }
}

// The sum over `s.reduced` of a * b (b null: 1) for the output whose kept
// offsets are base[0..2], in double, in row-major order of the reduced
// space: rows (every dimension but the innermost) found by division, the
// innermost dimension walked by its strides.
template <typename T>
HAP_CUDA_HD inline double ReducedSum(const ReduceSpace& s, const T* a,
                                     const T* b, const int64_t* base) {
  const StridedSpace& r = s.reduced;
  const int inner_d = r.rank - 1;
  const int64_t inner = r.rank > 0 ? r.shape[inner_d] : 1;
  const int64_t sa = r.rank > 0 ? r.stride[1][inner_d] : 0;
  const int64_t sb = r.rank > 0 ? r.stride[2][inner_d] : 0;
  const int64_t rows = inner > 0 ? r.count / inner : 0;
  double acc = 0;
  for (int64_t row = 0; row < rows; ++row) {
    int64_t rr = row, oa = base[1], ob = base[2];
    for (int d = inner_d - 1; d >= 0; --d) {
      const int64_t idx = rr % r.shape[d];
      rr /= r.shape[d];
      oa += idx * r.stride[1][d];
      ob += idx * r.stride[2][d];
    }
    if (b != nullptr) {
      for (int64_t j = 0; j < inner; ++j) {
        acc += static_cast<double>(a[oa + j * sa]) *
               static_cast<double>(b[ob + j * sb]);
      }
    } else {
      for (int64_t j = 0; j < inner; ++j) {
        acc += static_cast<double>(a[oa + j * sa]);
      }
    }
  }
  return acc;
}

// How a long reduction over few outputs is split across blocks: chunk c of
// output o sums reduced elements [c * chunk_len, (c + 1) * chunk_len) into
// a partial, and the partials of o are then added in chunk order (a fixed
// order: deterministic). chunks == 1: no split (one pass). A function of the
// space alone.
struct ReduceSplit {
  int64_t chunks = 1;
  int64_t chunk_len = 0;
};
inline constexpr int64_t kSplitMinReduced = 1 << 16;  // shorter: one pass
inline constexpr int64_t kSplitMaxOutputs = 1024;     // more: one pass
inline constexpr int64_t kSplitChunk = 1 << 14;       // elements per chunk
inline constexpr int64_t kSplitMaxPartials = 1 << 16;

HAP_CUDA_HD inline ReduceSplit SplitFor(const ReduceSpace& s) {
  ReduceSplit r;
  const int64_t outs = s.kept.count, k = s.reduced.count;
  if (outs <= 0 || outs > kSplitMaxOutputs || k < kSplitMinReduced) return r;
  int64_t chunks = (k + kSplitChunk - 1) / kSplitChunk;
  const int64_t cap = kSplitMaxPartials / outs;
  if (chunks > cap) chunks = cap;
  r.chunk_len = (k + chunks - 1) / chunks;
  r.chunks = (k + r.chunk_len - 1) / r.chunk_len;  // no empty chunk
  return r;
}

// The scratch a split reduction of `space` needs, in doubles (0: none).
inline int64_t ReduceScratchDoubles(const ReduceSpace& space) {
  const ReduceSplit split = SplitFor(space);
  return split.chunks > 1 ? split.chunks * space.kept.count : 0;
}

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_COMMON_H_
