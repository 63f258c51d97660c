// Convolution and pooling over NCHW images and NCDHW volumes: conv2d and
// conv3d as im2col (vol2col) + GEMM, one code path with conv2d a conv3d of
// depth 1 (a group of images per GEMM; a 1x1, stride-1, unpadded
// convolution needs no im2col),
// max_pool2d and max_pool3d (padding reads as -inf, the first maximum in
// scan order takes the gradient, as PyTorch), avg_pool2d, avg_pool3d and
// adaptive_avg_pool2d (PyTorch's windows; ceil_mode as PyTorch's,
// executor/cpu/pool_window.h; a 2-D window is a 3-D one of depth 1).
#include <cmath>
#include <limits>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/pool_window.h"

namespace hap::executor::cpu {
namespace {

// An attribute of 1 or 2 integers >= min_value, as a (height, width) pair.
absl::StatusOr<std::pair<int64_t, int64_t>> Pair(
    const KernelArgs& a, const std::string& name,
    const std::vector<int64_t>& def, int64_t min_value) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> v, def.empty()
                                                   ? AttrInts(a, name)
                                                   : AttrInts(a, name, def));
  if (v.size() == 1) v.push_back(v[0]);
  if (v.size() != 2 || v[0] < min_value || v[1] < min_value) {
    return Invalid(a, "attribute '", name, "' must be 1 or 2 integers >= ",
                   min_value);
  }
  return std::make_pair(v[0], v[1]);
}

// A window attribute of a convolution over `spatial` axes: 1 or `spatial`
// integers >= min_value, default `fill` on every axis.
absl::StatusOr<std::vector<int64_t>> Axes(const KernelArgs& a, const std::string& name, int spatial,
                                          int64_t fill, int64_t min_value) {
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> v,
                       AttrInts(a, name, std::vector<int64_t>(spatial, fill)));
  if (!pool::SpatialValues(&v, spatial, min_value)) {
    return Invalid(a, "attribute '", name, "' must be 1 or ", spatial, " integers >= ", min_value);
  }
  return v;
}

using Window = pool::Window;

// The layout an input of `spatial` axes must have.
const char* Layout(int spatial) { return spatial == 3 ? "NCDHW (rank 5)" : "NCHW (rank 4)"; }

absl::StatusOr<Window> MakeWindow(const KernelArgs& a, const TensorView& x, int spatial,
                                  const std::vector<int64_t>& k, const std::vector<int64_t>& s,
                                  const std::vector<int64_t>& p, bool ceil_mode = false,
                                  std::vector<int64_t> d = {}) {
  if (x.rank() != spatial + 2) {
    return Invalid(a, InLabel(a, 0), " must be ", Layout(spatial));
  }
  if (d.empty()) d.assign(spatial, 1);
  Window g;
  const std::string error =
      pool::FitWindow(x.shape, spatial, k, s, p, d, ceil_mode, InLabel(a, 0), &g);
  if (!error.empty()) return Invalid(a, error);
  return g;
}

// --- conv2d -----------------------------------------------------------------------

// The output columns ox of one kernel column j whose input column ix = ox *
// sw - pw + j * dw lies inside the image: [first, last).
std::pair<int64_t, int64_t> ValidColumns(const Window& g, int64_t j) {
  // ox * sw >= pw - j * dw  and  ox * sw <= w - 1 + pw - j * dw.
  const int64_t lo = g.pw - j * g.dw;
  const int64_t first = lo <= 0 ? 0 : (lo + g.sw - 1) / g.sw;
  const int64_t hi = g.w - 1 + g.pw - j * g.dw;
  const int64_t last = hi < 0 ? 0 : std::min(g.ow, hi / g.sw + 1);
  return {first, std::max(first, last)};
}

// Walks the rows of the im2col (vol2col for 3-D) matrix of `images`
// consecutive images: col[((c * kd + t) * kh + i) * kw + j][m * out_plane +
// (oz * oh + oy) * ow + ox] = x_m[c][oz*sd - pd + t*dd][oy*sh - ph +
// i*dh][ox*sw - pw + j*dw], 0 in the padding; rows are images * out_plane
// long. For each output row segment (c, t, i, j, m, oz, oy), run(col_offset,
// x_offset, first, last) with the segment's columns [first, last) inside
// the image (x_offset of column `first`), or x_offset = -1 when the input
// row is padding. Parallel over channels: each c's rows and planes belong
// to one thread.
template <typename F>
void ForEachIm2ColRun(const KernelArgs& a, const Window& g, int64_t images,
                      F run) {
  const int64_t ld = images * g.out_plane();
  ParallelFor(a.ctx.num_threads, g.c, GrainFor(g.taps() * ld), [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      for (int64_t t = 0; t < g.kd; ++t) {
        for (int64_t i = 0; i < g.kh; ++i) {
          for (int64_t j = 0; j < g.kw; ++j) {
            const auto [first, last] = ValidColumns(g, j);
            const int64_t row = (((c * g.kd + t) * g.kh + i) * g.kw + j) * ld;
            for (int64_t m = 0; m < images; ++m) {
              for (int64_t oz = 0; oz < g.od; ++oz) {
                const int64_t iz = oz * g.sd - g.pd + t * g.dd;
                for (int64_t oy = 0; oy < g.oh; ++oy) {
                  const int64_t iy = oy * g.sh - g.ph + i * g.dh;
                  const int64_t col = row + m * g.out_plane() + (oz * g.oh + oy) * g.ow;
                  const bool inside = iz >= 0 && iz < g.d && iy >= 0 && iy < g.h;
                  run(col,
                      inside ? (((m * g.c + c) * g.d + iz) * g.h + iy) * g.w + first * g.sw - g.pw +
                                   j * g.dw
                             : -1,
                      first, last);
                }
              }
            }
          }
        }
      }
    }
  });
}

template <typename T>
void Im2Col(const KernelArgs& a, const Window& g, const T* x, int64_t images,
            T* col) {
  ForEachIm2ColRun(a, g, images, [&](int64_t co, int64_t xo, int64_t first,
                                     int64_t last) {
    T* d = col + co;
    if (xo < 0) {
      std::fill(d, d + g.ow, T(0));
      return;
    }
    std::fill(d, d + first, T(0));
    const T* src = x + xo;
    if (g.sw == 1) {
      std::copy(src, src + (last - first), d + first);
    } else {
      for (int64_t ox = first; ox < last; ++ox) d[ox] = src[(ox - first) * g.sw];
    }
    std::fill(d + last, d + g.ow, T(0));
  });
}

// The adjoint of Im2Col: dx += col scattered back.
template <typename T>
void Col2Im(const KernelArgs& a, const Window& g, const T* col, int64_t images,
            T* dx) {
  ForEachIm2ColRun(a, g, images, [&](int64_t co, int64_t xo, int64_t first,
                                     int64_t last) {
    if (xo < 0) return;
    const T* s = col + co;
    T* d = dx + xo;
    if (g.sw == 1) {
      AddTo(d, s + first, last - first);
    } else {
      for (int64_t ox = first; ox < last; ++ox) d[(ox - first) * g.sw] += s[ox];
    }
  });
}

struct Conv {
  Window g;
  int64_t o = 0, ckk = 0;
  // Input channels / the weight's: > 1 for a grouped (depthwise)
  // convolution, which runs the direct loops below. Derived from the
  // shapes, so a shard holding whole groups is a smaller grouped
  // convolution.
  int64_t groups = 1;
  bool direct = false;  // 1x1, stride 1, no padding: x is its own im2col
  int64_t group = 1;    // images per GEMM
  Shape y;

  // fn(first image, images, GEMM columns) for each group of images.
  template <typename F>
  void ForEachGroup(F fn) const {
    for (int64_t i0 = 0; i0 < g.n; i0 += group) {
      const int64_t m = std::min(group, g.n - i0);
      fn(i0, m, m * g.out_plane());
    }
  }
};

// GEMM columns wanted per call: small images are grouped up to this many.
constexpr int64_t kGemmColumns = 512;
// The most elements of an im2col buffer grouping may use.
constexpr int64_t kMaxColElements = int64_t{1} << 23;

// conv2d (spatial = 2) and conv3d (spatial = 3): one code path, a 2-D
// convolution being a 3-D one of depth 1.
absl::StatusOr<Conv> CheckConv(const KernelArgs& a, DType t, bool has_bias_slot, int spatial) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  const TensorView& w = a.in[1];
  if (a.in[0].rank() != spatial + 2) {
    return Invalid(a, "image ", InLabel(a, 0), " must be ", Layout(spatial));
  }
  if (w.rank() != spatial + 2) {
    return Invalid(a, "weight ", InLabel(a, 1), " must have rank ", spatial + 2,
                   " ([out, in / groups, ", spatial == 3 ? "kt, " : "", "kh, kw])");
  }
  if (w.shape[1] < 1 || a.in[0].shape[1] < w.shape[1] || a.in[0].shape[1] % w.shape[1] != 0 ||
      w.shape[0] % (a.in[0].shape[1] / w.shape[1]) != 0) {
    return Invalid(a, "weight ", InLabel(a, 1), " does not fit image ",
                   InLabel(a, 0),
                   " (its channels must be a whole number of groups of the "
                   "weight's input channels, dividing its output channels)");
  }
  const std::vector<int64_t> kernel(w.shape.begin() + 2, w.shape.end());
  for (int64_t k : kernel) {
    if (k < 1) return Invalid(a, "weight ", InLabel(a, 1), " has an empty kernel");
  }
  HAP_ASSIGN_OR_RETURN(auto stride, Axes(a, "stride", spatial, 1, 1));
  HAP_ASSIGN_OR_RETURN(auto pad, Axes(a, "padding", spatial, 0, 0));
  HAP_ASSIGN_OR_RETURN(auto dil, Axes(a, "dilation", spatial, 1, 1));
  Conv c;
  HAP_ASSIGN_OR_RETURN(c.g, MakeWindow(a, a.in[0], spatial, kernel, stride, pad, false, dil));
  c.o = w.shape[0];
  c.groups = a.in[0].shape[1] / w.shape[1];
  c.ckk = w.shape[1] * c.g.taps();
  const Window& g = c.g;
  c.direct =
      g.taps() == 1 && g.sd == 1 && g.sh == 1 && g.sw == 1 && g.pd == 0 && g.ph == 0 && g.pw == 0;
  if (!c.direct) {
    const int64_t op = c.g.out_plane();
    c.group = std::min({c.g.n, std::max<int64_t>(1, kGemmColumns / op),
                        std::max<int64_t>(1, kMaxColElements / (c.ckk * op))});
  }
  c.y = spatial == 3 ? Shape{g.n, c.o, g.od, g.oh, g.ow} : Shape{g.n, c.o, g.oh, g.ow};
  HAP_RETURN_IF_ERROR(CheckBias(a, t, has_bias_slot, c.o));
  HAP_RETURN_IF_ERROR(CheckFitsBlas(a, {c.o, c.ckk, c.group * c.g.out_plane()}));
  return c;
}

// --- grouped convolution: direct loops ---------------------------------------------
// Output channel oc of group q = oc / og reads input channels
// [q * cg, (q + 1) * cg) (cg = the weight's input channels, og = o / groups):
//   y[m][oc][oz][oy][ox] = b[oc] + sum_{k, t, i, j} w[oc][k][t][i][j] *
//       x[m][q * cg + k][oz*sd - pd + t*dd][oy*sh - ph + i*dh][ox*sw - pw + j*dw]
// (2-D: depth 1). Sums in double, in the order k, t, i, j.

// fn(out, in, tap) over the taps (t, i, j) of the output positions, `out`
// and `in` indices in the output and input planes, tap = (t * kh + i) * kw +
// j; taps reading padding are skipped. Each output's taps come in order.
template <typename F>
void ForEachTap(const Window& g, F fn) {
  for (int64_t oz = 0; oz < g.od; ++oz) {
    for (int64_t t = 0; t < g.kd; ++t) {
      const int64_t iz = oz * g.sd - g.pd + t * g.dd;
      if (iz < 0 || iz >= g.d) continue;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t i = 0; i < g.kh; ++i) {
          const int64_t iy = oy * g.sh - g.ph + i * g.dh;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t ix = ox * g.sw - g.pw + j * g.dw;
              if (ix >= 0 && ix < g.w) {
                fn((oz * g.oh + oy) * g.ow + ox, (iz * g.h + iy) * g.w + ix,
                   (t * g.kh + i) * g.kw + j);
              }
            }
          }
        }
      }
    }
  }
}

template <typename T>
void GroupedForward(const KernelArgs& a, const Conv& c, const T* x, const T* w,
                    const T* bias, T* y) {
  const Window& g = c.g;
  const int64_t cg = g.c / c.groups, og = c.o / c.groups, kk = g.taps();
  ParallelFor(a.ctx.num_threads, g.n * c.o, GrainFor(g.out_plane() * cg * kk),
              [&](int64_t b, int64_t e) {
                std::vector<double> acc(g.out_plane());
                for (int64_t mo = b; mo < e; ++mo) {
                  const int64_t m = mo / c.o, oc = mo % c.o, q = oc / og;
                  std::fill(acc.begin(), acc.end(),
                            bias != nullptr ? double(bias[oc]) : 0.0);
                  for (int64_t k = 0; k < cg; ++k) {
                    const T* xp = x + (m * g.c + q * cg + k) * g.plane();
                    const T* wk = w + (oc * cg + k) * kk;
                    ForEachTap(g, [&](int64_t out, int64_t in, int64_t tap) {
                      acc[out] += double(wk[tap]) * double(xp[in]);
                    });
                  }
                  T* yp = y + mo * g.out_plane();
                  for (int64_t p = 0; p < g.out_plane(); ++p) yp[p] = T(acc[p]);
                }
              });
}

// dx (parallel over images and groups: disjoint channels), dw (parallel
// over output channels), db.
template <typename T>
void GroupedBackward(const KernelArgs& a, const Conv& c, const T* x, const T* w,
                     const T* dy, T* dx, T* dw, T* db) {
  const Window& g = c.g;
  const int64_t cg = g.c / c.groups, og = c.o / c.groups, kk = g.taps();
  const int64_t op = g.out_plane();
  if (dx != nullptr) {
    ParallelFor(a.ctx.num_threads, g.n * c.groups, GrainFor(og * op * cg * kk),
                [&](int64_t b, int64_t e) {
                  for (int64_t mq = b; mq < e; ++mq) {
                    const int64_t m = mq / c.groups, q = mq % c.groups;
                    for (int64_t oc = q * og; oc < (q + 1) * og; ++oc) {
                      const T* dyp = dy + (m * c.o + oc) * op;
                      for (int64_t k = 0; k < cg; ++k) {
                        T* dxp = dx + (m * g.c + q * cg + k) * g.plane();
                        const T* wk = w + (oc * cg + k) * kk;
                        ForEachTap(g, [&](int64_t out, int64_t in, int64_t tap) {
                          dxp[in] += wk[tap] * dyp[out];
                        });
                      }
                    }
                  }
                });
  }
  if (dw == nullptr && db == nullptr) return;
  ParallelFor(a.ctx.num_threads, c.o, GrainFor(g.n * op * cg * kk),
              [&](int64_t b, int64_t e) {
                std::vector<double> acc(cg * kk);
                for (int64_t oc = b; oc < e; ++oc) {
                  const int64_t q = oc / og;
                  std::fill(acc.begin(), acc.end(), 0.0);
                  double bsum = 0;
                  for (int64_t m = 0; m < g.n; ++m) {
                    const T* dyp = dy + (m * c.o + oc) * op;
                    for (int64_t p = 0; p < op; ++p) bsum += double(dyp[p]);
                    for (int64_t k = 0; dw != nullptr && k < cg; ++k) {
                      const T* xp = x + (m * g.c + q * cg + k) * g.plane();
                      ForEachTap(g, [&](int64_t out, int64_t in, int64_t tap) {
                        acc[k * kk + tap] += double(dyp[out]) * double(xp[in]);
                      });
                    }
                  }
                  if (dw != nullptr) {
                    for (int64_t r = 0; r < cg * kk; ++r) dw[oc * cg * kk + r] += T(acc[r]);
                  }
                  if (db != nullptr) db[oc] += T(bsum);
                }
              });
}

// y[m] = w @ im2col(x[m]) (+ bias), `group` images per GEMM: their columns
// side by side, [o, group * ohw], copied out image by image when group > 1.
template <typename T, int kSpatial>
absl::Status ConvForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(Conv c, CheckConv(a, t, a.in.size() == 3, kSpatial));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, c.y));
  const T* bias = a.in.size() == 3 && a.in[2].present() ? a.in[2].as<const T>()
                                                         : nullptr;
  const Window& g = c.g;
  const int64_t op = g.out_plane();
  const T* x = a.in[0].as<const T>();
  const T* w = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Attr<T>(a));
  if (c.groups > 1) {
    if (bf16) return absl::UnimplementedError(
          absl::StrCat("kernel '", a.name, "': bf16 (mixed precision) with groups > 1"));
    GroupedForward<T>(a, c, x, w, bias, y);
    return absl::OkStatus();
  }
  std::vector<T> col(c.direct ? 0 : c.ckk * c.group * op);
  std::vector<T> out(c.group > 1 ? c.o * c.group * op : 0);
  absl::Status status;
  c.ForEachGroup([&](int64_t i0, int64_t m, int64_t cols) {
    if (!status.ok()) return;
    const T* xi = x + i0 * g.c * g.plane();
    T* yi = y + i0 * c.o * op;
    T* dst = c.group > 1 ? out.data() : yi;
    if (!c.direct) Im2Col(a, g, xi, m, col.data());
    if constexpr (std::is_same_v<T, float>) {
      if (bf16) {  // y = bf16(w_b @ col_b + b_b): the bias goes in before rounding
        for (int64_t ch = 0; bias != nullptr && ch < c.o; ++ch) {
          std::fill(dst + ch * cols, dst + (ch + 1) * cols, RoundBf16(bias[ch]));
        }
        status = GemmBf16(a.ctx.num_threads, false, false, c.o, cols, c.ckk, w, c.ckk,
                          c.direct ? xi : col.data(), cols, bias != nullptr, dst, cols);
        for (int64_t k = 0; dst != yi && k < m; ++k) {
          for (int64_t ch = 0; ch < c.o; ++ch) {
            std::copy(dst + ch * cols + k * op, dst + ch * cols + (k + 1) * op,
                      yi + (k * c.o + ch) * op);
          }
        }
        return;
      }
    }
    Gemm<T>(false, false, c.o, cols, c.ckk, T(1), w, c.ckk,
            c.direct ? xi : col.data(), cols, T(0), dst, cols);
    for (int64_t k = 0; k < m; ++k) {
      for (int64_t ch = 0; ch < c.o; ++ch) {
        T* yr = yi + (k * c.o + ch) * op;
        const T b = bias != nullptr ? bias[ch] : T(0);
        if (dst != yi) {
          const T* s = dst + ch * cols + k * op;
          for (int64_t j = 0; j < op; ++j) yr[j] = s[j] + b;
        } else if (bias != nullptr) {
          for (int64_t j = 0; j < op; ++j) yr[j] += b;
        }
      }
    }
  });
  return status;
}

template <typename T, int kSpatial>
absl::Status ConvBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs gr, GradArgs::Make(a, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(Conv c, CheckConv(a, t, gr.n() == 3, kSpatial));
  HAP_RETURN_IF_ERROR(gr.Check(t, {c.y}));
  if (!gr.dy(0).present()) return absl::OkStatus();
  const Window& g = c.g;
  const int64_t op = g.out_plane();
  const T* x = gr.x(0).as<const T>();
  const T* w = gr.x(1).as<const T>();
  const T* dy = gr.dy(0).as<const T>();
  T* dx = gr.dx(0).present() ? gr.dx(0).as<T>() : nullptr;
  T* dw = gr.dx(1).present() ? gr.dx(1).as<T>() : nullptr;
  T* db = gr.n() == 3 && gr.dx(2).present() ? gr.dx(2).as<T>() : nullptr;
  HAP_ASSIGN_OR_RETURN(bool bf16, Bf16Attr<T>(a));
  if (c.groups > 1) {
    if (bf16) return absl::UnimplementedError(
          absl::StrCat("kernel '", a.name, "': bf16 (mixed precision) with groups > 1"));
    GroupedBackward<T>(a, c, x, w, dy, dx, dw, db);
    return absl::OkStatus();
  }
  std::vector<T> col(c.direct ? 0 : c.ckk * c.group * op);
  std::vector<T> dyg(c.group > 1 ? c.o * c.group * op : 0);
  absl::Status status;
  c.ForEachGroup([&](int64_t i0, int64_t m, int64_t cols) {
    if (!status.ok()) return;
    const T* xi = x + i0 * g.c * g.plane();
    const T* dyi = dy + i0 * c.o * op;
    if (c.group > 1) {  // dy of the group as [o, m * ohw]
      for (int64_t k = 0; k < m; ++k) {
        for (int64_t ch = 0; ch < c.o; ++ch) {
          std::copy(dyi + (k * c.o + ch) * op, dyi + (k * c.o + ch + 1) * op,
                    dyg.data() + ch * cols + k * op);
        }
      }
    }
    const T* d = c.group > 1 ? dyg.data() : dyi;
    if (dw != nullptr) {  // dw += dy @ col^T
      if (!c.direct) Im2Col(a, g, xi, m, col.data());
      status.Update(Product<T>(a, bf16, false, true, c.o, c.ckk, cols, d, cols,
                               c.direct ? xi : col.data(), cols, true, dw, c.ckk));
    }
    if (dx != nullptr) {  // dcol = w^T @ dy, scattered back into dx
      T* dxi = dx + i0 * g.c * g.plane();
      if (c.direct) {
        status.Update(Product<T>(a, bf16, true, false, c.ckk, cols, c.o, w, c.ckk, d, cols,
                                 true, dxi, cols));
      } else {
        // With bf16 the columns' gradients are bf16 products, summed over
        // overlapping windows in float32.
        status.Update(Product<T>(a, bf16, true, false, c.ckk, cols, c.o, w, c.ckk, d, cols,
                                 false, col.data(), cols));
        Col2Im(a, g, col.data(), m, dxi);
      }
    }
    if (db != nullptr && bf16) {  // bf16(sum of bf16(dy)) per channel and group
      for (int64_t ch = 0; ch < c.o; ++ch) {
        db[ch] += static_cast<T>(RoundBf16(static_cast<float>(SumOver(cols, [&](int64_t j) {
          return double(RoundBf16(static_cast<float>(d[ch * cols + j])));
        }))));
      }
    } else if (db != nullptr) {
      for (int64_t ch = 0; ch < c.o; ++ch) {
        db[ch] += static_cast<T>(SumOver(cols, [&](int64_t j) {
          return double(d[ch * cols + j]);
        }));
      }
    }
  });
  return status;
}

// --- pooling ----------------------------------------------------------------------

// Validates a pooling op's input and attributes; returns its window.
using PoolCheck = absl::StatusOr<Window> (*)(const KernelArgs&, DType);

// A pooling op's output shape: [n, c, (od,) oh, ow].
Shape PoolShape(const Window& g) {
  return g.spatial == 3 ? Shape{g.n, g.c, g.od, g.oh, g.ow} : Shape{g.n, g.c, g.oh, g.ow};
}

// Forward of a pooling op: plane(g, x_plane, y_plane) over every (n, c).
template <typename T, typename F>
absl::Status PoolForward(const KernelArgs& a, PoolCheck check, F plane) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, check(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, PoolShape(g)));
  const T* x = a.in[0].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, g.n * g.c, GrainFor(g.plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t pl = b; pl < e; ++pl) {
                  plane(g, x + pl * g.plane(), y + pl * g.out_plane());
                }
              });
  return absl::OkStatus();
}

// Backward: plane(g, x_plane, dy_plane, dx_plane) over every (n, c).
template <typename T, typename F>
absl::Status PoolBackward(const KernelArgs& a, PoolCheck check, F plane) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs gr, GradArgs::Make(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, check(a, t));
  HAP_RETURN_IF_ERROR(gr.Check(t, {PoolShape(g)}));
  if (!gr.active()) return absl::OkStatus();
  const T* x = gr.x(0).as<const T>();
  const T* dy = gr.dy(0).as<const T>();
  T* dx = gr.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, g.n * g.c, GrainFor(g.plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t pl = b; pl < e; ++pl) {
                  plane(g, x + pl * g.plane(), dy + pl * g.out_plane(),
                        dx + pl * g.plane());
                }
              });
  return absl::OkStatus();
}

// max_pool2d / max_pool3d (spatial 2 / 3): kernel, stride (default: the
// kernel) and padding (at most half the kernel) per axis, ceil_mode.
template <int kSpatial>
absl::StatusOr<Window> CheckMaxPool(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> k, AttrInts(a, "kernel"));
  if (!pool::SpatialValues(&k, kSpatial, 1)) {
    return Invalid(a, "attribute 'kernel' must be 1 or ", kSpatial, " integers >= 1");
  }
  HAP_ASSIGN_OR_RETURN(std::vector<int64_t> s, AttrInts(a, "stride", k));
  if (!pool::SpatialValues(&s, kSpatial, 1)) {
    return Invalid(a, "attribute 'stride' must be 1 or ", kSpatial, " integers >= 1");
  }
  HAP_ASSIGN_OR_RETURN(auto p, Axes(a, "padding", kSpatial, 0, 0));
  HAP_ASSIGN_OR_RETURN(bool ceil_mode, AttrBool(a, "ceil_mode", false));
  for (int i = 0; i < kSpatial; ++i) {
    if (p[i] > k[i] / 2) return Invalid(a, "padding must be at most half the kernel");
  }
  return MakeWindow(a, a.in[0], kSpatial, k, s, p, ceil_mode);
}

// fn(out_index, in_index of the window's first maximum, maximum) over a
// plane (2-D: one depth slice); padding never wins (it reads as -inf).
template <typename T, typename F>
void ForEachMax(const Window& g, const T* xp, F fn) {
  for (int64_t oz = 0; oz < g.od; ++oz) {
    const int64_t z0 = std::max<int64_t>(0, oz * g.sd - g.pd);
    const int64_t z1 = std::min(g.d, oz * g.sd - g.pd + g.kd);
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      const int64_t y0 = std::max<int64_t>(0, oy * g.sh - g.ph);
      const int64_t y1 = std::min(g.h, oy * g.sh - g.ph + g.kh);
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        const int64_t x0 = std::max<int64_t>(0, ox * g.sw - g.pw);
        const int64_t x1 = std::min(g.w, ox * g.sw - g.pw + g.kw);
        int64_t best = (z0 * g.h + y0) * g.w + x0;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t iz = z0; iz < z1; ++iz) {
          for (int64_t iy = y0; iy < y1; ++iy) {
            for (int64_t ix = x0; ix < x1; ++ix) {
              const T v = xp[(iz * g.h + iy) * g.w + ix];
              if (v > mx || std::isnan(v)) {
                mx = v;
                best = (iz * g.h + iy) * g.w + ix;
              }
            }
          }
        }
        fn((oz * g.oh + oy) * g.ow + ox, best, mx);
      }
    }
  }
}

template <typename T, int kSpatial>
absl::Status MaxPoolForward(const KernelArgs& a) {
  return PoolForward<T>(a, CheckMaxPool<kSpatial>, [](const Window& g, const T* xp, T* yp) {
    ForEachMax(g, xp, [&](int64_t o, int64_t, T v) { yp[o] = v; });
  });
}

template <typename T, int kSpatial>
absl::Status MaxPoolBackward(const KernelArgs& a) {
  return PoolBackward<T>(
      a, CheckMaxPool<kSpatial>, [](const Window& g, const T* xp, const T* dyp, T* dxp) {
        ForEachMax(g, xp, [&](int64_t o, int64_t best, T) { dxp[best] += dyp[o]; });
      });
}

// --- avg_pool2d -------------------------------------------------------------------

template <int kSpatial>
absl::StatusOr<Window> CheckAvgPool(const KernelArgs& a, DType t) {
  HAP_ASSIGN_OR_RETURN(Window g, CheckMaxPool<kSpatial>(a, t));
  HAP_ASSIGN_OR_RETURN(g.count_include_pad,
                       AttrBool(a, "count_include_pad", true));
  return g;
}

// fn(out_index, in_index, 1 / divisor) over every window element of a plane
// (pool::AvgWindow per axis: PyTorch's windows and divisors), outputs in
// order.
template <typename F>
void ForEachAvg(const Window& g, F fn) {
  for (int64_t oz = 0; oz < g.od; ++oz) {
    const pool::AvgSpan wz = pool::AvgWindow(oz, g.d, g.kd, g.sd, g.pd);
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      const pool::AvgSpan wy = pool::AvgWindow(oy, g.h, g.kh, g.sh, g.ph);
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        const pool::AvgSpan wx = pool::AvgWindow(ox, g.w, g.kw, g.sw, g.pw);
        const int64_t divisor = g.count_include_pad
                                    ? wz.padded * wy.padded * wx.padded
                                    : (wz.hi - wz.lo) * (wy.hi - wy.lo) * (wx.hi - wx.lo);
        const double inv = 1.0 / static_cast<double>(divisor);
        const int64_t o = (oz * g.oh + oy) * g.ow + ox;
        for (int64_t iz = wz.lo; iz < wz.hi; ++iz) {
          for (int64_t iy = wy.lo; iy < wy.hi; ++iy) {
            for (int64_t ix = wx.lo; ix < wx.hi; ++ix) {
              fn(o, (iz * g.h + iy) * g.w + ix, inv);
            }
          }
        }
      }
    }
  }
}

template <typename T, int kSpatial>
absl::Status AvgPoolForward(const KernelArgs& a) {
  return PoolForward<T>(a, CheckAvgPool<kSpatial>, [](const Window& g, const T* xp, T* yp) {
    std::vector<double> acc(g.out_plane(), 0.0);
    ForEachAvg(g, [&](int64_t o, int64_t i, double inv) { acc[o] += xp[i] * inv; });
    for (int64_t o = 0; o < g.out_plane(); ++o) yp[o] = static_cast<T>(acc[o]);
  });
}

template <typename T, int kSpatial>
absl::Status AvgPoolBackward(const KernelArgs& a) {
  return PoolBackward<T>(
      a, CheckAvgPool<kSpatial>, [](const Window& g, const T*, const T* dyp, T* dxp) {
        ForEachAvg(g, [&](int64_t o, int64_t i, double inv) {
          dxp[i] += static_cast<T>(dyp[o] * inv);
        });
      });
}

// --- adaptive_avg_pool2d ----------------------------------------------------------

// PyTorch's window of output i of `out` over an input of `in`:
// [floor(i * in / out), ceil((i + 1) * in / out)).
std::pair<int64_t, int64_t> AdaptiveRange(int64_t i, int64_t in, int64_t out) {
  return {i * in / out, ((i + 1) * in + out - 1) / out};
}

absl::StatusOr<Window> CheckAdaptive(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_ASSIGN_OR_RETURN(auto o, Pair(a, "output_size", {}, 1));
  if (a.in[0].rank() != 4) return Invalid(a, InLabel(a, 0), " must be ", Layout(2));
  Window g;
  g.n = a.in[0].shape[0];
  g.c = a.in[0].shape[1];
  g.h = a.in[0].shape[2];
  g.w = a.in[0].shape[3];
  std::tie(g.oh, g.ow) = o;
  return g;
}

// fn(out_index, in_index, 1 / window size) over every window element of a
// plane.
template <typename F>
void ForEachAdaptive(const Window& g, F fn) {
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    auto [y0, y1] = AdaptiveRange(oy, g.h, g.oh);
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      auto [x0, x1] = AdaptiveRange(ox, g.w, g.ow);
      const double inv = 1.0 / static_cast<double>((y1 - y0) * (x1 - x0));
      for (int64_t iy = y0; iy < y1; ++iy) {
        for (int64_t ix = x0; ix < x1; ++ix) fn(oy * g.ow + ox, iy * g.w + ix, inv);
      }
    }
  }
}

template <typename T>
absl::Status AdaptivePoolForward(const KernelArgs& a) {
  return PoolForward<T>(a, CheckAdaptive, [](const Window& g, const T* xp, T* yp) {
    std::vector<double> acc(g.out_plane(), 0.0);
    ForEachAdaptive(g, [&](int64_t o, int64_t i, double inv) { acc[o] += xp[i] * inv; });
    for (int64_t o = 0; o < g.out_plane(); ++o) yp[o] = static_cast<T>(acc[o]);
  });
}

template <typename T>
absl::Status AdaptivePoolBackward(const KernelArgs& a) {
  return PoolBackward<T>(
      a, CheckAdaptive, [](const Window& g, const T*, const T* dyp, T* dxp) {
        ForEachAdaptive(g, [&](int64_t o, int64_t i, double inv) {
          dxp[i] += static_cast<T>(dyp[o] * inv);
        });
      });
}

}  // namespace

void RegisterConvolutionKernels(KernelTable& t) {
  t["conv2d"] = HAP_FLOAT_KERNEL_N(ConvForward, 2);
  t["conv2d_grad"] = HAP_FLOAT_KERNEL_N(ConvBackward, 2);
  t["conv3d"] = HAP_FLOAT_KERNEL_N(ConvForward, 3);
  t["conv3d_grad"] = HAP_FLOAT_KERNEL_N(ConvBackward, 3);
  t["max_pool2d"] = HAP_FLOAT_KERNEL_N(MaxPoolForward, 2);
  t["max_pool2d_grad"] = HAP_FLOAT_KERNEL_N(MaxPoolBackward, 2);
  t["avg_pool2d"] = HAP_FLOAT_KERNEL_N(AvgPoolForward, 2);
  t["avg_pool2d_grad"] = HAP_FLOAT_KERNEL_N(AvgPoolBackward, 2);
  t["max_pool3d"] = HAP_FLOAT_KERNEL_N(MaxPoolForward, 3);
  t["max_pool3d_grad"] = HAP_FLOAT_KERNEL_N(MaxPoolBackward, 3);
  t["avg_pool3d"] = HAP_FLOAT_KERNEL_N(AvgPoolForward, 3);
  t["avg_pool3d_grad"] = HAP_FLOAT_KERNEL_N(AvgPoolBackward, 3);
  t["adaptive_avg_pool2d"] = HAP_FLOAT_KERNEL(AdaptivePoolForward);
  t["adaptive_avg_pool2d_grad"] = HAP_FLOAT_KERNEL(AdaptivePoolBackward);
}

}  // namespace hap::executor::cpu
