// Internal to executor/cuda: the per-element index math of the convolution,
// pooling and MoE kernels (kernels_convolution.cu, kernels_moe.cu),
// __host__ __device__ under nvcc so kernels_b_index_test checks it on the
// host against direct loops, without a GPU. Plain C++ (no Abseil).
#ifndef HAP_EXECUTOR_CUDA_KERNELS_B_INDEX_H_
#define HAP_EXECUTOR_CUDA_KERNELS_B_INDEX_H_

#include <cmath>
#include <cstdint>

#include "executor/cpu/pool_window.h"
#include "executor/cuda/launch_common.h"
#include "executor/cuda/launch_convolution.h"
#include "executor/cuda/launch_moe.h"

namespace hap::executor::cuda {

// --- im2col (vol2col) ---------------------------------------------------------
// A 2-D window has one depth slice (pool::Window): the depth loops run once.

// Element k of the im2col matrix of `images` images (k row-major over
// [c*taps rows, images, od, oh, ow]; layout as LaunchIm2Col): sets *col to
// its index in the matrix and returns the index of the input element it
// reads (images counted from the first), or -1 in the padding.
HAP_CUDA_HD inline int64_t Im2ColSource(const Window& g, int64_t k,
                                        int64_t images, int64_t row_stride,
                                        int64_t image_stride, int64_t* col) {
  int64_t r = k;
  const int64_t ox = r % g.ow;
  r /= g.ow;
  const int64_t oy = r % g.oh;
  r /= g.oh;
  const int64_t oz = r % g.od;
  r /= g.od;
  const int64_t m = r % images;
  const int64_t row = r / images;
  const int64_t j = row % g.kw;
  const int64_t i = (row / g.kw) % g.kh;
  const int64_t t = (row / (g.kw * g.kh)) % g.kd;
  const int64_t ch = row / (g.kw * g.kh * g.kd);
  const int64_t iz = oz * g.sd - g.pd + t * g.dd;
  const int64_t iy = oy * g.sh - g.ph + i * g.dh;
  const int64_t ix = ox * g.sw - g.pw + j * g.dw;
  *col = row * row_stride + m * image_stride + (oz * g.oh + oy) * g.ow + ox;
  const bool inside = iz >= 0 && iz < g.d && iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
  return inside ? (((m * g.c + ch) * g.d + iz) * g.h + iy) * g.w + ix : -1;
}

// The outputs o of one axis whose tap `tap` reads input index `in`: o * s =
// in + p - tap * dil. Returns o, or -1 when none (negative, off the stride
// or past `out`); *stop set when every larger tap has none either.
HAP_CUDA_HD inline int64_t TapOutput(int64_t in, int64_t p, int64_t tap, int64_t dil, int64_t s,
                                     int64_t out, bool* stop) {
  const int64_t t = in + p - tap * dil;
  *stop = t < 0;
  if (t < 0 || t % s != 0 || t / s >= out) return -1;
  return t / s;
}

// The adjoint for input element k (row-major over [images, c, d, h, w]):
// the sum of the im2col entries that read it, kernel taps in order.
template <typename T>
HAP_CUDA_HD inline T Col2ImSum(const Window& g, const T* col, int64_t images,
                               int64_t row_stride, int64_t image_stride,
                               int64_t k) {
  int64_t r = k;
  const int64_t ix = r % g.w;
  r /= g.w;
  const int64_t iy = r % g.h;
  r /= g.h;
  const int64_t iz = r % g.d;
  r /= g.d;
  const int64_t ch = r % g.c;
  const int64_t m = r / g.c;
  (void)images;
  T acc = T(0);
  bool stop = false;
  for (int64_t t = 0; t < g.kd; ++t) {
    const int64_t oz = TapOutput(iz, g.pd, t, g.dd, g.sd, g.od, &stop);
    if (stop) break;  // and for every larger t
    if (oz < 0) continue;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t oy = TapOutput(iy, g.ph, i, g.dh, g.sh, g.oh, &stop);
      if (stop) break;
      if (oy < 0) continue;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t ox = TapOutput(ix, g.pw, j, g.dw, g.sw, g.ow, &stop);
        if (stop) break;
        if (ox < 0) continue;
        const int64_t row = ((ch * g.kd + t) * g.kh + i) * g.kw + j;
        acc += col[row * row_stride + m * image_stride + (oz * g.oh + oy) * g.ow + ox];
      }
    }
  }
  return acc;
}

// --- grouped conv2d, conv3d (direct; executor/cpu/kernels_convolution.cc) ----
// Output channel oc of group q = oc / og (og = o / groups) reads input
// channels [q * cg, (q + 1) * cg), cg = c / groups; w is [o, cg, kd, kh,
// kw] (kd = 1 for conv2d). Positions are indices in a plane: out = (oz * oh
// + oy) * ow + ox, in = (iz * h + iy) * w + ix, tap = (t * kh + i) * kw + j.

// y[m][oc][out] without the bias: the taps in the CPU's order (k, t, i, j),
// summed in double.
template <typename T>
HAP_CUDA_HD inline double GroupedConvValue(const Window& g, int64_t groups, int64_t o, const T* x,
                                           const T* w, int64_t m, int64_t oc, int64_t out) {
  const int64_t cg = g.c / groups, og = o / groups, q = oc / og;
  const int64_t ox = out % g.ow, oy = (out / g.ow) % g.oh, oz = out / (g.ow * g.oh);
  double acc = 0;
  for (int64_t k = 0; k < cg; ++k) {
    const T* xp = x + (m * g.c + q * cg + k) * g.plane();
    const T* wk = w + (oc * cg + k) * g.taps();
    for (int64_t t = 0; t < g.kd; ++t) {
      const int64_t iz = oz * g.sd - g.pd + t * g.dd;
      if (iz < 0 || iz >= g.d) continue;
      for (int64_t i = 0; i < g.kh; ++i) {
        const int64_t iy = oy * g.sh - g.ph + i * g.dh;
        if (iy < 0 || iy >= g.h) continue;
        for (int64_t j = 0; j < g.kw; ++j) {
          const int64_t ix = ox * g.sw - g.pw + j * g.dw;
          if (ix < 0 || ix >= g.w) continue;
          acc += static_cast<double>(wk[(t * g.kh + i) * g.kw + j]) *
                 static_cast<double>(xp[(iz * g.h + iy) * g.w + ix]);
        }
      }
    }
  }
  return acc;
}

// dL/dx[m][ic][in]: w * dy over the outputs of ic's group and the taps that
// read it.
template <typename T>
HAP_CUDA_HD inline double GroupedConvDx(const Window& g, int64_t groups, int64_t o, const T* w,
                                        const T* dy, int64_t m, int64_t ic, int64_t in) {
  const int64_t cg = g.c / groups, og = o / groups, q = ic / cg, k = ic % cg;
  const int64_t ix = in % g.w, iy = (in / g.w) % g.h, iz = in / (g.w * g.h);
  double acc = 0;
  bool stop = false;
  for (int64_t oc = q * og; oc < (q + 1) * og; ++oc) {
    const T* dyp = dy + (m * o + oc) * g.out_plane();
    const T* wk = w + (oc * cg + k) * g.taps();
    for (int64_t t = 0; t < g.kd; ++t) {
      const int64_t oz = TapOutput(iz, g.pd, t, g.dd, g.sd, g.od, &stop);
      if (stop) break;
      if (oz < 0) continue;
      for (int64_t i = 0; i < g.kh; ++i) {
        const int64_t oy = TapOutput(iy, g.ph, i, g.dh, g.sh, g.oh, &stop);
        if (stop) break;
        if (oy < 0) continue;
        for (int64_t j = 0; j < g.kw; ++j) {
          const int64_t ox = TapOutput(ix, g.pw, j, g.dw, g.sw, g.ow, &stop);
          if (stop) break;
          if (ox < 0) continue;
          acc += static_cast<double>(wk[(t * g.kh + i) * g.kw + j]) *
                 static_cast<double>(dyp[(oz * g.oh + oy) * g.ow + ox]);
        }
      }
    }
  }
  return acc;
}

// dL/dw[oc][k][tap]: dy * x over the images and output positions.
template <typename T>
HAP_CUDA_HD inline double GroupedConvDw(const Window& g, int64_t groups, int64_t o, const T* x,
                                        const T* dy, int64_t oc, int64_t k, int64_t tap) {
  const int64_t cg = g.c / groups, og = o / groups, q = oc / og;
  const int64_t j = tap % g.kw, i = (tap / g.kw) % g.kh, t = tap / (g.kw * g.kh);
  double acc = 0;
  for (int64_t m = 0; m < g.n; ++m) {
    const T* xp = x + (m * g.c + q * cg + k) * g.plane();
    const T* dyp = dy + (m * o + oc) * g.out_plane();
    for (int64_t oz = 0; oz < g.od; ++oz) {
      const int64_t iz = oz * g.sd - g.pd + t * g.dd;
      if (iz < 0 || iz >= g.d) continue;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        const int64_t iy = oy * g.sh - g.ph + i * g.dh;
        if (iy < 0 || iy >= g.h) continue;
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const int64_t ix = ox * g.sw - g.pw + j * g.dw;
          if (ix < 0 || ix >= g.w) continue;
          acc += static_cast<double>(dyp[(oz * g.oh + oy) * g.ow + ox]) *
                 static_cast<double>(xp[(iz * g.h + iy) * g.w + ix]);
        }
      }
    }
  }
  return acc;
}

// --- max_pool2d, max_pool3d ----------------------------------------------------
// Plane positions as in the convolutions: out = (oz * oh + oy) * ow + ox,
// in = (iz * h + iy) * w + ix; a 2-D window has one depth slice.

// The first maximum of output `out`'s window over plane xp (as the CPU's
// ForEachMax: padding never wins, a NaN does): its index in the plane and
// value.
template <typename T>
HAP_CUDA_HD inline void WindowMax(const Window& g, const T* xp, int64_t out, int64_t* best_out,
                                  T* max_out) {
  const int64_t ox = out % g.ow, oy = (out / g.ow) % g.oh, oz = out / (g.ow * g.oh);
  const int64_t tz = oz * g.sd - g.pd, ty = oy * g.sh - g.ph, tx = ox * g.sw - g.pw;
  const int64_t z0 = tz > 0 ? tz : 0;
  const int64_t z1 = tz + g.kd < g.d ? tz + g.kd : g.d;
  const int64_t y0 = ty > 0 ? ty : 0;
  const int64_t y1 = ty + g.kh < g.h ? ty + g.kh : g.h;
  const int64_t x0 = tx > 0 ? tx : 0;
  const int64_t x1 = tx + g.kw < g.w ? tx + g.kw : g.w;
  int64_t best = (z0 * g.h + y0) * g.w + x0;
  T mx = -static_cast<T>(INFINITY);
  for (int64_t iz = z0; iz < z1; ++iz) {
    for (int64_t iy = y0; iy < y1; ++iy) {
      for (int64_t ix = x0; ix < x1; ++ix) {
        const T v = xp[(iz * g.h + iy) * g.w + ix];
        if (v > mx || v != v) {
          mx = v;
          best = (iz * g.h + iy) * g.w + ix;
        }
      }
    }
  }
  *best_out = best;
  *max_out = mx;
}

// For plane element e: *sum = dy summed over the windows whose first
// maximum (argmax, per output of the plane) it is, in output order; false
// when there is none.
template <typename T>
HAP_CUDA_HD inline bool MaxPoolGradSum(const Window& g, const int64_t* argmax,
                                       const T* dyp, int64_t e, T* sum) {
  const int64_t ix = e % g.w, iy = (e / g.w) % g.h, iz = e / (g.w * g.h);
  int64_t oz0, oz1, oy0, oy1, ox0, ox1;
  pool::CoveringOutputs(iz, g.kd, g.sd, g.pd, g.od, &oz0, &oz1);
  pool::CoveringOutputs(iy, g.kh, g.sh, g.ph, g.oh, &oy0, &oy1);
  pool::CoveringOutputs(ix, g.kw, g.sw, g.pw, g.ow, &ox0, &ox1);
  T acc = T(0);
  bool any = false;
  for (int64_t oz = oz0; oz <= oz1; ++oz) {
    for (int64_t oy = oy0; oy <= oy1; ++oy) {
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        const int64_t o = (oz * g.oh + oy) * g.ow + ox;
        if (argmax[o] == e) {
          acc += dyp[o];
          any = true;
        }
      }
    }
  }
  *sum = acc;
  return any;
}

// --- avg_pool2d, avg_pool3d ----------------------------------------------------

// 1 / the divisor of output `out`'s window (PyTorch's), and its input
// ranges per axis.
HAP_CUDA_HD inline double AvgWindowInverse(const Window& g, int64_t out, pool::AvgSpan* wz,
                                           pool::AvgSpan* wy, pool::AvgSpan* wx) {
  const int64_t ox = out % g.ow, oy = (out / g.ow) % g.oh, oz = out / (g.ow * g.oh);
  *wz = pool::AvgWindow(oz, g.d, g.kd, g.sd, g.pd);
  *wy = pool::AvgWindow(oy, g.h, g.kh, g.sh, g.ph);
  *wx = pool::AvgWindow(ox, g.w, g.kw, g.sw, g.pw);
  const int64_t divisor = g.count_include_pad
                              ? wz->padded * wy->padded * wx->padded
                              : (wz->hi - wz->lo) * (wy->hi - wy->lo) * (wx->hi - wx->lo);
  return 1.0 / static_cast<double>(divisor);
}

// Output `out` of the average pool over plane xp: sum of x / divisor in
// double, in the CPU's order.
template <typename T>
HAP_CUDA_HD inline T AvgPoolValue(const Window& g, const T* xp, int64_t out) {
  pool::AvgSpan wz, wy, wx;
  const double inv = AvgWindowInverse(g, out, &wz, &wy, &wx);
  double acc = 0;
  for (int64_t iz = wz.lo; iz < wz.hi; ++iz) {
    for (int64_t iy = wy.lo; iy < wy.hi; ++iy) {
      for (int64_t ix = wx.lo; ix < wx.hi; ++ix) {
        acc += static_cast<double>(xp[(iz * g.h + iy) * g.w + ix]) * inv;
      }
    }
  }
  return static_cast<T>(acc);
}

// For plane element e: dy / divisor summed over the windows containing it,
// in output order.
template <typename T>
HAP_CUDA_HD inline T AvgPoolGradSum(const Window& g, const T* dyp, int64_t e) {
  const int64_t ix = e % g.w, iy = (e / g.w) % g.h, iz = e / (g.w * g.h);
  int64_t oz0, oz1, oy0, oy1, ox0, ox1;
  pool::CoveringOutputs(iz, g.kd, g.sd, g.pd, g.od, &oz0, &oz1);
  pool::CoveringOutputs(iy, g.kh, g.sh, g.ph, g.oh, &oy0, &oy1);
  pool::CoveringOutputs(ix, g.kw, g.sw, g.pw, g.ow, &ox0, &ox1);
  T acc = T(0);
  for (int64_t oz = oz0; oz <= oz1; ++oz) {
    for (int64_t oy = oy0; oy <= oy1; ++oy) {
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        const int64_t o = (oz * g.oh + oy) * g.ow + ox;
        pool::AvgSpan wz, wy, wx;
        const double inv = AvgWindowInverse(g, o, &wz, &wy, &wx);
        acc += static_cast<T>(dyp[o] * inv);
      }
    }
  }
  return acc;
}

// --- adaptive_avg_pool2d -----------------------------------------------------

// PyTorch's window of output i of `out` over an input of `in`:
// [floor(i * in / out), ceil((i + 1) * in / out)).
HAP_CUDA_HD inline int64_t AdaptiveStart(int64_t i, int64_t in, int64_t out) {
  return i * in / out;
}
HAP_CUDA_HD inline int64_t AdaptiveEnd(int64_t i, int64_t in, int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

// The mean of output (oy, ox)'s window over plane xp, as the CPU computes
// it: x * (1 / window size) summed in double (an empty window, of an empty
// plane, gives 0).
template <typename T>
HAP_CUDA_HD inline T AdaptiveAvg(const Window& g, const T* xp, int64_t oy,
                                 int64_t ox) {
  const int64_t y0 = AdaptiveStart(oy, g.h, g.oh);
  const int64_t y1 = AdaptiveEnd(oy, g.h, g.oh);
  const int64_t x0 = AdaptiveStart(ox, g.w, g.ow);
  const int64_t x1 = AdaptiveEnd(ox, g.w, g.ow);
  const double inv = 1.0 / static_cast<double>((y1 - y0) * (x1 - x0));
  double acc = 0;
  for (int64_t iy = y0; iy < y1; ++iy) {
    for (int64_t ix = x0; ix < x1; ++ix) {
      acc += static_cast<double>(xp[iy * g.w + ix]) * inv;
    }
  }
  return static_cast<T>(acc);
}

// For plane element e: dy / window size summed over the windows containing
// it. The candidates are a superset of those windows (they start at
// floor(iy * oh / h) and end by ceil((iy + 1) * oh / h) - 1), each tested.
template <typename T>
HAP_CUDA_HD inline T AdaptiveGradSum(const Window& g, const T* dyp, int64_t e) {
  const int64_t iy = e / g.w, ix = e % g.w;
  const int64_t oy_lo = iy * g.oh / g.h - 1 > 0 ? iy * g.oh / g.h - 1 : 0;
  const int64_t oy_top = ((iy + 1) * g.oh + g.h - 1) / g.h;
  const int64_t oy_hi = oy_top < g.oh - 1 ? oy_top : g.oh - 1;
  const int64_t ox_lo = ix * g.ow / g.w - 1 > 0 ? ix * g.ow / g.w - 1 : 0;
  const int64_t ox_top = ((ix + 1) * g.ow + g.w - 1) / g.w;
  const int64_t ox_hi = ox_top < g.ow - 1 ? ox_top : g.ow - 1;
  T acc = T(0);
  for (int64_t oy = oy_lo; oy <= oy_hi; ++oy) {
    const int64_t y0 = AdaptiveStart(oy, g.h, g.oh);
    const int64_t y1 = AdaptiveEnd(oy, g.h, g.oh);
    if (iy < y0 || iy >= y1) continue;
    for (int64_t ox = ox_lo; ox <= ox_hi; ++ox) {
      const int64_t x0 = AdaptiveStart(ox, g.w, g.ow);
      const int64_t x1 = AdaptiveEnd(ox, g.w, g.ow);
      if (ix < x0 || ix >= x1) continue;
      const double inv = 1.0 / static_cast<double>((y1 - y0) * (x1 - x0));
      acc += static_cast<T>(dyp[oy * g.ow + ox] * inv);
    }
  }
  return acc;
}

// --- moe_gate ----------------------------------------------------------------

// A token's softmax over experts in double, as the CPU's Route: the row
// maximum (in T) and the sum of exp(logit - max).
template <typename T>
struct TokenSoftmax {
  const T* row;
  double mx = 0, sum = 0;

  HAP_CUDA_HD TokenSoftmax(const T* r, int64_t experts) : row(r) {
    T m = r[0];
    for (int64_t e = 1; e < experts; ++e) m = r[e] > m ? r[e] : m;
    mx = static_cast<double>(m);
    for (int64_t e = 0; e < experts; ++e) {
      sum += exp(static_cast<double>(r[e]) - mx);
    }
  }
  HAP_CUDA_HD double Prob(int64_t e) const {
    return exp(static_cast<double>(row[e]) - mx) / sum;
  }
};

// What top-k orders experts by: the probability, a NaN (a token whose
// logits hold a NaN or an infinity) below every number, as the CPU's
// (executor/cpu/kernels_moe.cc), so the order is total.
HAP_CUDA_HD inline double TopKKey(double p) { return p != p ? -1.0 : p; }

// A token's top-k experts in order (TopKKey descending, ties to the lower
// index, as the CPU's partial_sort): the j-th pick is the best expert
// strictly after the (j-1)-th in that order, so the k experts are distinct.
template <typename T>
HAP_CUDA_HD inline void TopK(const TokenSoftmax<T>& s, int64_t experts,
                             int64_t k, int32_t* expert) {
  int64_t prev = -1;
  double prev_p = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    double bp = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const double p = TopKKey(s.Prob(e));
      const bool after = j == 0 || p < prev_p || (p == prev_p && e > prev);
      if (after && (best < 0 || p > bp)) {
        best = e;
        bp = p;
      }
    }
    expert[j] = static_cast<int32_t>(best);
    prev = best;
    prev_p = bp;
  }
}

// --- index-based dispatch and combine (moe_*_idx) --------------------------------

// The local slot of route entry i (IdxDims), -1 when dropped, another
// rank's or not a slot.
HAP_CUDA_HD inline int64_t LocalSlot(const IdxDims& m, const int64_t* route, int64_t i) {
  if (route[i] < 0) return -1;
  const int64_t e = route[i] / m.global_capacity - m.offset;
  const int64_t row = route[i] % m.global_capacity - m.capacity_offset;
  return e >= 0 && e < m.experts && row >= 0 && row < m.capacity ? e * m.capacity + row
                                                                 : int64_t{-1};
}

// Token t's next local slot after `prev` (-1: its first) in ascending slot
// order, the order the CPU sums a token's slots in (executor/cpu/
// kernels_moe.cc, as the dense form does); -1 when none is left. *choice is
// the slot's route entry's choice j.
HAP_CUDA_HD inline int64_t NextTokenSlot(const IdxDims& m, const int64_t* route, int64_t t,
                                         int64_t prev, int64_t* choice) {
  int64_t best = -1;
  for (int64_t j = 0; j < m.k; ++j) {
    const int64_t s = LocalSlot(m, route, t * m.k + j);
    if (s > prev && (best < 0 || s < best)) {
      best = s;
      *choice = j;
    }
  }
  return best;
}

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_KERNELS_B_INDEX_H_
