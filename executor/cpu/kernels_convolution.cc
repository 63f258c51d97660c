// Convolution and pooling over NCHW images: conv2d as im2col + GEMM (one
// image at a time; a 1x1, stride-1, unpadded convolution needs no im2col),
// max_pool2d (padding reads as -inf, the first maximum in scan order takes
// the gradient, as PyTorch), adaptive_avg_pool2d (PyTorch's windows).
#include <cmath>
#include <limits>

#include "executor/cpu/kernels_internal.h"
#include "planner/util/status_macros.h"

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

// The geometry of a sliding window over one image plane.
struct Window {
  int64_t n = 0, c = 0, h = 0, w = 0;  // input
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;
  int64_t oh = 0, ow = 0;
  int64_t plane() const { return h * w; }
  int64_t out_plane() const { return oh * ow; }
};

absl::StatusOr<Window> MakeWindow(const KernelArgs& a, const TensorView& x,
                                  std::pair<int64_t, int64_t> k,
                                  std::pair<int64_t, int64_t> s,
                                  std::pair<int64_t, int64_t> p) {
  if (x.rank() != 4) return Invalid(a, InLabel(a, 0), " must be NCHW");
  Window g;
  g.n = x.shape[0];
  g.c = x.shape[1];
  g.h = x.shape[2];
  g.w = x.shape[3];
  std::tie(g.kh, g.kw) = k;
  std::tie(g.sh, g.sw) = s;
  std::tie(g.ph, g.pw) = p;
  if (g.h + 2 * g.ph < g.kh || g.w + 2 * g.pw < g.kw) {
    return Invalid(a, "kernel ", g.kh, "x", g.kw, " is larger than the padded ",
                   InLabel(a, 0));
  }
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

// --- conv2d -----------------------------------------------------------------------

// col[(c * kh + i) * kw + j][oy * ow + ox] = x[c][oy*sh - ph + i][ox*sw - pw
// + j], 0 in the padding.
template <typename T>
void Im2Col(const KernelArgs& a, const Window& g, const T* x, T* col) {
  ParallelFor(a.ctx.num_threads, g.c, GrainFor(g.kh * g.kw * g.out_plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t c = b; c < e; ++c) {
                  for (int64_t i = 0; i < g.kh; ++i) {
                    for (int64_t j = 0; j < g.kw; ++j) {
                      T* dst = col + ((c * g.kh + i) * g.kw + j) * g.out_plane();
                      for (int64_t oy = 0; oy < g.oh; ++oy) {
                        const int64_t iy = oy * g.sh - g.ph + i;
                        T* d = dst + oy * g.ow;
                        if (iy < 0 || iy >= g.h) {
                          std::fill(d, d + g.ow, T(0));
                          continue;
                        }
                        const T* src = x + (c * g.h + iy) * g.w;
                        for (int64_t ox = 0; ox < g.ow; ++ox) {
                          const int64_t ix = ox * g.sw - g.pw + j;
                          d[ox] = ix >= 0 && ix < g.w ? src[ix] : T(0);
                        }
                      }
                    }
                  }
                }
              });
}

// The adjoint of Im2Col: dx += col scattered back.
template <typename T>
void Col2Im(const KernelArgs& a, const Window& g, const T* col, T* dx) {
  ParallelFor(a.ctx.num_threads, g.c, GrainFor(g.kh * g.kw * g.out_plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t c = b; c < e; ++c) {
                  for (int64_t i = 0; i < g.kh; ++i) {
                    for (int64_t j = 0; j < g.kw; ++j) {
                      const T* src =
                          col + ((c * g.kh + i) * g.kw + j) * g.out_plane();
                      for (int64_t oy = 0; oy < g.oh; ++oy) {
                        const int64_t iy = oy * g.sh - g.ph + i;
                        if (iy < 0 || iy >= g.h) continue;
                        T* d = dx + (c * g.h + iy) * g.w;
                        const T* s = src + oy * g.ow;
                        for (int64_t ox = 0; ox < g.ow; ++ox) {
                          const int64_t ix = ox * g.sw - g.pw + j;
                          if (ix >= 0 && ix < g.w) d[ix] += s[ox];
                        }
                      }
                    }
                  }
                }
              });
}

struct Conv {
  Window g;
  int64_t o = 0, ckk = 0;
  bool direct = false;  // 1x1, stride 1, no padding: x is its own im2col
  Shape y;
};

absl::StatusOr<Conv> CheckConv(const KernelArgs& a, DType t,
                               bool has_bias_slot) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_RETURN_IF_ERROR(CheckInput(a, 1, t));
  const TensorView& w = a.in[1];
  if (w.rank() != 4 || a.in[0].rank() != 4 || w.shape[1] != a.in[0].shape[1]) {
    return Invalid(a, "weight ", InLabel(a, 1), " does not fit image ",
                   InLabel(a, 0));
  }
  HAP_ASSIGN_OR_RETURN(auto stride, Pair(a, "stride", {1, 1}, 1));
  HAP_ASSIGN_OR_RETURN(auto pad, Pair(a, "padding", {0, 0}, 0));
  Conv c;
  HAP_ASSIGN_OR_RETURN(c.g, MakeWindow(a, a.in[0], {w.shape[2], w.shape[3]},
                                       stride, pad));
  c.o = w.shape[0];
  c.ckk = w.shape[1] * w.shape[2] * w.shape[3];
  c.direct = c.g.kh == 1 && c.g.kw == 1 && c.g.sh == 1 && c.g.sw == 1 &&
             c.g.ph == 0 && c.g.pw == 0;
  c.y = {c.g.n, c.o, c.g.oh, c.g.ow};
  if (has_bias_slot && a.in[2].present()) {
    HAP_RETURN_IF_ERROR(CheckInput(a, 2, t));
    HAP_RETURN_IF_ERROR(CheckShape(a, a.in[2], "bias", {c.o}));
  }
  if (!FitsBlas({c.o, c.ckk, c.g.out_plane()})) {
    return Invalid(a, InLabel(a, 0), " is too large for BLAS");
  }
  return c;
}

template <typename T>
absl::Status Conv2dForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(Conv c, CheckConv(a, t, a.in.size() == 3));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, c.y));
  const bool has_bias = a.in.size() == 3 && a.in[2].present();
  const Window& g = c.g;
  const T* x = a.in[0].as<const T>();
  const T* w = a.in[1].as<const T>();
  T* y = a.out[0].as<T>();
  std::vector<T> col(c.direct ? 0 : c.ckk * g.out_plane());
  for (int64_t i = 0; i < g.n; ++i) {
    const T* xi = x + i * g.c * g.plane();
    T* yi = y + i * c.o * g.out_plane();
    if (has_bias) {
      const T* b = a.in[2].as<const T>();
      for (int64_t o = 0; o < c.o; ++o) {
        std::fill(yi + o * g.out_plane(), yi + (o + 1) * g.out_plane(), b[o]);
      }
    }
    if (!c.direct) Im2Col(a, g, xi, col.data());
    Gemm<T>(false, false, c.o, g.out_plane(), c.ckk, T(1), w, c.ckk,
            c.direct ? xi : col.data(), g.out_plane(), has_bias ? T(1) : T(0),
            yi, g.out_plane());
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Conv2dBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs gr, GradArgs::Make(a, 2, 3, 1));
  HAP_ASSIGN_OR_RETURN(Conv c, CheckConv(a, t, gr.n() == 3));
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
  std::vector<T> col(c.direct || dw == nullptr ? 0 : c.ckk * op);
  std::vector<T> dcol(c.direct || dx == nullptr ? 0 : c.ckk * op);
  for (int64_t i = 0; i < g.n; ++i) {
    const T* xi = x + i * g.c * g.plane();
    const T* dyi = dy + i * c.o * op;
    if (dw != nullptr) {  // dw += dy_i @ col_i^T
      if (!c.direct) Im2Col(a, g, xi, col.data());
      Gemm<T>(false, true, c.o, c.ckk, op, T(1), dyi, op,
              c.direct ? xi : col.data(), op, T(1), dw, c.ckk);
    }
    if (dx != nullptr) {  // dcol = w^T @ dy_i, scattered back into dx_i
      T* dxi = dx + i * g.c * g.plane();
      if (c.direct) {
        Gemm<T>(true, false, c.ckk, op, c.o, T(1), w, c.ckk, dyi, op, T(1),
                dxi, op);
      } else {
        Gemm<T>(true, false, c.ckk, op, c.o, T(1), w, c.ckk, dyi, op, T(0),
                dcol.data(), op);
        Col2Im(a, g, dcol.data(), dxi);
      }
    }
    if (db != nullptr) {
      for (int64_t o = 0; o < c.o; ++o) {
        const T* r = dyi + o * op;
        T s = 0;
        for (int64_t j = 0; j < op; ++j) s += r[j];
        db[o] += s;
      }
    }
  }
  return absl::OkStatus();
}

// --- max_pool2d -------------------------------------------------------------------

absl::StatusOr<Window> CheckMaxPool(const KernelArgs& a, DType t) {
  HAP_RETURN_IF_ERROR(CheckInput(a, 0, t));
  HAP_ASSIGN_OR_RETURN(auto k, Pair(a, "kernel", {}, 1));
  HAP_ASSIGN_OR_RETURN(auto s, Pair(a, "stride", {k.first, k.second}, 1));
  HAP_ASSIGN_OR_RETURN(auto p, Pair(a, "padding", {0, 0}, 0));
  if (p.first > k.first / 2 || p.second > k.second / 2) {
    return Invalid(a, "padding must be at most half the kernel");
  }
  return MakeWindow(a, a.in[0], k, s, p);
}

// Visits each output position of plane `pl` with the flat input index of
// its window's first maximum.
template <typename T, typename F>
void ForEachMax(const Window& g, const T* x, int64_t pl, F fn) {
  const T* xp = x + pl * g.plane();
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    const int64_t y0 = std::max<int64_t>(0, oy * g.sh - g.ph);
    const int64_t y1 = std::min(g.h, oy * g.sh - g.ph + g.kh);
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      const int64_t x0 = std::max<int64_t>(0, ox * g.sw - g.pw);
      const int64_t x1 = std::min(g.w, ox * g.sw - g.pw + g.kw);
      int64_t best = y0 * g.w + x0;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t iy = y0; iy < y1; ++iy) {
        for (int64_t ix = x0; ix < x1; ++ix) {
          const T v = xp[iy * g.w + ix];
          if (v > mx || std::isnan(v)) {
            mx = v;
            best = iy * g.w + ix;
          }
        }
      }
      fn(oy * g.ow + ox, best, mx);
    }
  }
}

template <typename T>
absl::Status MaxPoolForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, CheckMaxPool(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {g.n, g.c, g.oh, g.ow}));
  const T* x = a.in[0].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, g.n * g.c, GrainFor(g.plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t pl = b; pl < e; ++pl) {
                  T* yp = y + pl * g.out_plane();
                  ForEachMax(g, x, pl, [&](int64_t o, int64_t, T v) { yp[o] = v; });
                }
              });
  return absl::OkStatus();
}

template <typename T>
absl::Status MaxPoolBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs gr, GradArgs::Make(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, CheckMaxPool(a, t));
  HAP_RETURN_IF_ERROR(gr.Check(t, {{g.n, g.c, g.oh, g.ow}}));
  if (!gr.dy(0).present() || !gr.dx(0).present()) return absl::OkStatus();
  const T* x = gr.x(0).as<const T>();
  const T* dy = gr.dy(0).as<const T>();
  T* dx = gr.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, g.n * g.c, GrainFor(g.plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t pl = b; pl < e; ++pl) {
                  T* dxp = dx + pl * g.plane();
                  const T* dyp = dy + pl * g.out_plane();
                  ForEachMax(g, x, pl, [&](int64_t o, int64_t best, T) {
                    dxp[best] += dyp[o];
                  });
                }
              });
  return absl::OkStatus();
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
  if (a.in[0].rank() != 4) return Invalid(a, InLabel(a, 0), " must be NCHW");
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
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, CheckAdaptive(a, t));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, {g.n, g.c, g.oh, g.ow}));
  const T* x = a.in[0].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, g.n * g.c, GrainFor(g.plane()),
              [&](int64_t b, int64_t e) {
                std::vector<double> acc(g.out_plane());
                for (int64_t pl = b; pl < e; ++pl) {
                  std::fill(acc.begin(), acc.end(), 0.0);
                  const T* xp = x + pl * g.plane();
                  ForEachAdaptive(g, [&](int64_t o, int64_t i, double inv) {
                    acc[o] += xp[i] * inv;
                  });
                  T* yp = y + pl * g.out_plane();
                  for (int64_t o = 0; o < g.out_plane(); ++o) {
                    yp[o] = static_cast<T>(acc[o]);
                  }
                }
              });
  return absl::OkStatus();
}

template <typename T>
absl::Status AdaptivePoolBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs gr, GradArgs::Make(a, 1, 1, 1));
  HAP_ASSIGN_OR_RETURN(Window g, CheckAdaptive(a, t));
  HAP_RETURN_IF_ERROR(gr.Check(t, {{g.n, g.c, g.oh, g.ow}}));
  if (!gr.dy(0).present() || !gr.dx(0).present()) return absl::OkStatus();
  const T* dy = gr.dy(0).as<const T>();
  T* dx = gr.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, g.n * g.c, GrainFor(g.plane()),
              [&](int64_t b, int64_t e) {
                for (int64_t pl = b; pl < e; ++pl) {
                  T* dxp = dx + pl * g.plane();
                  const T* dyp = dy + pl * g.out_plane();
                  ForEachAdaptive(g, [&](int64_t o, int64_t i, double inv) {
                    dxp[i] += static_cast<T>(dyp[o] * inv);
                  });
                }
              });
  return absl::OkStatus();
}

}  // namespace

void RegisterConvolutionKernels(KernelTable& t) {
  t["conv2d"] = HAP_FLOAT_KERNEL(Conv2dForward);
  t["conv2d_grad"] = HAP_FLOAT_KERNEL(Conv2dBackward);
  t["max_pool2d"] = HAP_FLOAT_KERNEL(MaxPoolForward);
  t["max_pool2d_grad"] = HAP_FLOAT_KERNEL(MaxPoolBackward);
  t["adaptive_avg_pool2d"] = HAP_FLOAT_KERNEL(AdaptivePoolForward);
  t["adaptive_avg_pool2d_grad"] = HAP_FLOAT_KERNEL(AdaptivePoolBackward);
}

}  // namespace hap::executor::cpu
