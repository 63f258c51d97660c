// Pooling window geometry (PyTorch's rules), shared by the CPU kernels and
// the CUDA kernels' device code: plain C++, no Abseil, annotated for nvcc.
#ifndef HAP_EXECUTOR_CPU_POOL_WINDOW_H_
#define HAP_EXECUTOR_CPU_POOL_WINDOW_H_

#include <cstdint>

#if defined(__CUDACC__)
#define HAP_POOL_HD __host__ __device__
#else
#define HAP_POOL_HD
#endif

namespace hap::executor::pool {

// Output length of a window of k, stride s over `in` padded by p on both
// sides (PyTorch's pooling_output_shape): with ceil_mode a last, partial
// window is kept when it starts inside the input or its left padding.
// Callers have checked in + 2p >= k, k >= 1, s >= 1.
HAP_POOL_HD inline int64_t OutputSize(int64_t in, int64_t k, int64_t s,
                                      int64_t p, bool ceil_mode) {
  const int64_t span = in + 2 * p - k;
  int64_t out = span / s + 1;
  if (ceil_mode && span % s != 0) {
    ++out;
    if ((out - 1) * s >= in + p) --out;
  }
  return out;
}

// One axis of avg_pool2d's window o: the input range [lo, hi) it averages
// and its length counting the padding (`padded`; a window hanging past the
// padded input in ceil_mode is cut there, as PyTorch's divisor is).
struct AvgSpan {
  int64_t lo = 0, hi = 0, padded = 0;
};
HAP_POOL_HD inline AvgSpan AvgWindow(int64_t o, int64_t in, int64_t k,
                                     int64_t s, int64_t p) {
  const int64_t start = o * s - p;
  const int64_t end = start + k < in + p ? start + k : in + p;
  AvgSpan w;
  w.padded = end - start;
  w.lo = start > 0 ? start : 0;
  w.hi = end < in ? end : in;
  return w;
}

// The outputs [*first, *last] (inclusive; empty when first > last) of `out`
// whose window [o * s - p, o * s - p + k) contains input index i.
HAP_POOL_HD inline void CoveringOutputs(int64_t i, int64_t k, int64_t s,
                                        int64_t p, int64_t out,
                                        int64_t* first, int64_t* last) {
  const int64_t a = i + p - k;  // o * s > a
  *first = a < 0 ? 0 : a / s + 1;
  const int64_t b = (i + p) / s;  // o * s <= i + p
  *last = b < out - 1 ? b : out - 1;
}

}  // namespace hap::executor::pool

#endif  // HAP_EXECUTOR_CPU_POOL_WINDOW_H_
