// Sliding-window geometry of the convolution and pooling kernels (PyTorch's
// rules), shared by the CPU kernels and the CUDA kernels (host and device
// code): plain C++, no Abseil, annotated for nvcc.
#ifndef HAP_EXECUTOR_CPU_POOL_WINDOW_H_
#define HAP_EXECUTOR_CPU_POOL_WINDOW_H_

#include <cstdint>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define HAP_POOL_HD __host__ __device__
#else
#define HAP_POOL_HD
#endif

namespace hap::executor::pool {

// The geometry of a sliding window over the spatial axes of an
// [n, c, (d,) h, w] tensor. 2-D ops (conv2d, the 2-D pools) have one depth
// slice: d = kd = od = 1, sd = dd = 1, pd = 0, so every depth loop runs once
// and a plane is h * w. Tap (t, i, j) of output (oz, oy, ox) reads input
// (oz*sd - pd + t*dd, oy*sh - ph + i*dh, ox*sw - pw + j*dw).
struct Window {
  int64_t n = 0, c = 0, d = 1, h = 0, w = 0;  // input
  int64_t kd = 1, kh = 1, kw = 1;             // kernel
  int64_t sd = 1, sh = 1, sw = 1;             // stride
  int64_t pd = 0, ph = 0, pw = 0;             // padding (both sides)
  int64_t dd = 1, dh = 1, dw = 1;             // a convolution's dilation
  int64_t od = 1, oh = 0, ow = 0;             // output
  int spatial = 2;                            // 2 or 3 spatial axes
  bool count_include_pad = true;              // avg_pool2d's divisor
  HAP_POOL_HD int64_t plane() const { return d * h * w; }
  HAP_POOL_HD int64_t out_plane() const { return od * oh * ow; }
  HAP_POOL_HD int64_t taps() const { return kd * kh * kw; }
};

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

// Host-only helpers of the kernels' argument checks.

// A window attribute as `spatial` per-axis values (depth first for 3-D): v
// as given, or its one value for every axis. False when v has another length
// or a value below min_value.
inline bool SpatialValues(std::vector<int64_t>* v, int spatial, int64_t min_value) {
  if (v->size() == 1) v->assign(spatial, (*v)[0]);
  if (static_cast<int>(v->size()) != spatial) return false;
  for (int64_t x : *v) {
    if (x < min_value) return false;
  }
  return true;
}

// "3x3", "3x1x1": per-axis values for messages.
inline std::string AxesString(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    s += (i ? "x" : "") + std::to_string(v[i]);
  }
  return s;
}

// Fills g from an input shape [n, c, (d,) h, w] of 2 + spatial axes and the
// per-axis kernel, stride, padding and dilation (spatial values each, as
// SpatialValues makes them; the caller checked the rank), and sets the
// output sizes (OutputSize of each axis). Returns "" or what is wrong: a
// (dilated) kernel larger than the padded input on some axis, as "kernel
// 3x3 (dilation 1x4) is larger than the padded " + input.
inline std::string FitWindow(const std::vector<int64_t>& shape, int spatial,
                             const std::vector<int64_t>& k, const std::vector<int64_t>& s,
                             const std::vector<int64_t>& p, const std::vector<int64_t>& dil,
                             bool ceil_mode, const std::string& input, Window* g) {
  *g = Window();
  g->spatial = spatial;
  g->n = shape[0];
  g->c = shape[1];
  const int o = spatial == 3 ? 0 : 1;  // index of depth in the 3-axis arrays
  int64_t* in[3] = {&g->d, &g->h, &g->w};
  int64_t* kk[3] = {&g->kd, &g->kh, &g->kw};
  int64_t* ss[3] = {&g->sd, &g->sh, &g->sw};
  int64_t* pp[3] = {&g->pd, &g->ph, &g->pw};
  int64_t* dd[3] = {&g->dd, &g->dh, &g->dw};
  int64_t* out[3] = {&g->od, &g->oh, &g->ow};
  bool fits = true;
  int64_t extent[3] = {1, 1, 1};
  for (int a = 0; a < spatial; ++a) {
    *in[a + o] = shape[2 + a];
    *kk[a + o] = k[a];
    *ss[a + o] = s[a];
    *pp[a + o] = p[a];
    *dd[a + o] = dil[a];
    // The dilated kernel's extent, (k - 1) * d + 1 (attributes are
    // unbounded).
    int64_t e;
    if (__builtin_mul_overflow(k[a] - 1, dil[a], &e) || ++e <= 0 || shape[2 + a] + 2 * p[a] < e) {
      fits = false;
    }
    extent[a + o] = e;
  }
  if (!fits) {
    bool dilated = false;
    for (int64_t x : dil) dilated = dilated || x != 1;
    return "kernel " + AxesString(k) + (dilated ? " (dilation " + AxesString(dil) + ")" : "") +
           " is larger than the padded " + input;
  }
  for (int a = o; a < 3; ++a) {
    *out[a] = OutputSize(*in[a], extent[a], *ss[a], *pp[a], ceil_mode);
  }
  return "";
}

}  // namespace hap::executor::pool

#endif  // HAP_EXECUTOR_CPU_POOL_WINDOW_H_
