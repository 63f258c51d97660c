// The index math of the convolution, pooling and MoE gate kernels
// (kernels_b_index.h) on the host, against direct loops: im2col against a
// direct convolution and col2im as its exact adjoint, the pooling gathers
// against the CPU's scatters, the gate's top-k against a sort. Needs the
// CUDA headers, not a GPU.
#include "executor/cuda/kernels_b_index.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace hap::executor::cuda {
namespace {

Window MakeWindow(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t sh,
                  int64_t sw, int64_t ph, int64_t pw, int64_t dh = 1, int64_t dw = 1) {
  Window g;
  g.n = n;
  g.c = c;
  g.h = h;
  g.w = w;
  g.kh = kh;
  g.kw = kw;
  g.sh = sh;
  g.sw = sw;
  g.ph = ph;
  g.pw = pw;
  g.dh = dh;
  g.dw = dw;
  g.oh = (h + 2 * ph - (kh - 1) * dh - 1) / sh + 1;
  g.ow = (w + 2 * pw - (kw - 1) * dw - 1) / sw + 1;
  return g;
}

// A 3-D window (n, c, d, h, w; kernel, stride, padding, dilation per axis,
// depth first) as the kernels' argument checks make it (pool::FitWindow).
Window MakeWindow3(int64_t n, int64_t c, std::vector<int64_t> in, std::vector<int64_t> k,
                   std::vector<int64_t> s, std::vector<int64_t> p,
                   std::vector<int64_t> d = {1, 1, 1}) {
  Window g;
  const std::string error =
      pool::FitWindow({n, c, in[0], in[1], in[2]}, 3, k, s, p, d, false, "x", &g);
  EXPECT_EQ(error, "");
  return g;
}

std::vector<double> Random(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

// Geometries: strides, paddings, rectangular kernels, 1x1, dilations.
const Window kConvs[] = {
    MakeWindow(2, 3, 9, 11, 3, 3, 2, 2, 1, 1),
    MakeWindow(3, 5, 8, 8, 1, 1, 1, 1, 0, 0),
    MakeWindow(2, 3, 10, 9, 5, 4, 1, 2, 0, 1),
    MakeWindow(3, 2, 6, 6, 3, 3, 1, 1, 2, 2),
    MakeWindow(3, 2, 7, 5, 2, 3, 3, 1, 1, 0),
    MakeWindow(2, 3, 9, 11, 3, 3, 1, 1, 2, 2, 2, 2),
    MakeWindow(2, 2, 10, 9, 3, 2, 2, 1, 1, 3, 3, 4),
    // conv3d: strides, paddings and dilations per axis, (2+1)-D kernels, 1x1x1.
    MakeWindow3(2, 2, {5, 6, 7}, {3, 3, 2}, {2, 1, 2}, {1, 2, 0}, {1, 2, 1}),
    MakeWindow3(2, 3, {4, 5, 5}, {1, 3, 3}, {1, 2, 2}, {0, 1, 1}),
    MakeWindow3(1, 3, {6, 3, 4}, {3, 1, 1}, {2, 1, 1}, {1, 0, 0}),
    MakeWindow3(2, 4, {3, 4, 2}, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}),
    MakeWindow3(1, 2, {7, 5, 5}, {2, 2, 3}, {1, 2, 1}, {2, 1, 1}, {3, 1, 2}),
};

// The im2col of all images in one of the two layouts of LaunchIm2Col.
std::vector<double> Im2Col(const Window& g, const std::vector<double>& x,
                           bool image_major) {
  const int64_t ckk = g.c * g.taps(), op = g.out_plane();
  const int64_t rs = image_major ? op : g.n * op;
  const int64_t is = image_major ? ckk * op : op;
  std::vector<double> col(ckk * g.n * op, -7.0);
  for (int64_t k = 0; k < ckk * g.n * op; ++k) {
    int64_t at = -1;
    const int64_t src = Im2ColSource(g, k, g.n, rs, is, &at);
    EXPECT_GE(at, 0);
    EXPECT_LT(at, static_cast<int64_t>(col.size()));
    col[at] = src >= 0 ? x[src] : 0.0;
  }
  return col;
}

TEST(Im2ColTest, TimesTheWeightsIsTheConvolution) {
  std::mt19937_64 rng(1);
  for (const Window& g : kConvs) {
    const int64_t o = 4, ckk = g.c * g.taps(), op = g.out_plane();
    const std::vector<double> x = Random(g.n * g.c * g.plane(), rng);
    const std::vector<double> w = Random(o * ckk, rng);
    for (bool image_major : {true, false}) {
      const std::vector<double> col = Im2Col(g, x, image_major);
      for (double v : col) ASSERT_NE(v, -7.0);  // every entry written
      for (int64_t m = 0; m < g.n; ++m) {
        for (int64_t oc = 0; oc < o; ++oc) {
          for (int64_t p = 0; p < op; ++p) {
            const int64_t ox = p % g.ow, oy = (p / g.ow) % g.oh, oz = p / (g.ow * g.oh);
            double want = 0, got = 0;
            for (int64_t c = 0; c < g.c; ++c) {
              for (int64_t t = 0; t < g.kd; ++t) {
                for (int64_t i = 0; i < g.kh; ++i) {
                  for (int64_t j = 0; j < g.kw; ++j) {
                    const int64_t iz = oz * g.sd - g.pd + t * g.dd;
                    const int64_t iy = oy * g.sh - g.ph + i * g.dh;
                    const int64_t ix = ox * g.sw - g.pw + j * g.dw;
                    if (iz < 0 || iz >= g.d || iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) {
                      continue;
                    }
                    want += x[(((m * g.c + c) * g.d + iz) * g.h + iy) * g.w + ix] *
                            w[(((oc * g.c + c) * g.kd + t) * g.kh + i) * g.kw + j];
                  }
                }
              }
            }
            for (int64_t r = 0; r < ckk; ++r) {
              const int64_t at = image_major ? (m * ckk + r) * op + p : r * g.n * op + m * op + p;
              got += w[oc * ckk + r] * col[at];
            }
            EXPECT_NEAR(got, want, 1e-12);
          }
        }
      }
    }
  }
}

// <im2col(x), c> == <x, col2im(c)> for every x and c: col2im is im2col's
// adjoint (the backward of conv2d's input).
TEST(Col2ImTest, IsTheAdjointOfIm2Col) {
  std::mt19937_64 rng(2);
  for (const Window& g : kConvs) {
    const int64_t ckk = g.c * g.taps(), op = g.out_plane();
    for (bool image_major : {true, false}) {
      const int64_t rs = image_major ? op : g.n * op;
      const int64_t is = image_major ? ckk * op : op;
      const std::vector<double> x = Random(g.n * g.c * g.plane(), rng);
      const std::vector<double> c = Random(ckk * g.n * op, rng);
      const std::vector<double> col = Im2Col(g, x, image_major);
      double lhs = 0, rhs = 0;
      for (size_t i = 0; i < c.size(); ++i) lhs += col[i] * c[i];
      for (size_t k = 0; k < x.size(); ++k) {
        rhs +=
            x[k] * Col2ImSum(g, c.data(), g.n, rs, is, static_cast<int64_t>(k));
      }
      EXPECT_NEAR(lhs, rhs, 1e-9);
    }
  }
}

const Window kPools[] = {
    MakeWindow(1, 1, 9, 11, 3, 3, 2, 2, 1, 1),
    MakeWindow(1, 1, 8, 8, 2, 2, 2, 2, 0, 0),
    MakeWindow(1, 1, 7, 9, 3, 3, 1, 1, 1, 1),
    MakeWindow(1, 1, 9, 10, 3, 2, 2, 1, 1, 0),
    MakeWindow(1, 1, 30, 5, 5, 5, 3, 3, 2, 2),
    MakeWindow(1, 1, 6, 6, 4, 4, 1, 3, 2, 1),
};

TEST(MaxPoolTest, WindowMaxAndGatheredGradientMatchTheScatter) {
  std::mt19937_64 rng(3);
  for (const Window& g : kPools) {
    std::vector<double> x = Random(g.h * g.w, rng);
    x[g.w + 1] = x[g.w + 2];  // a tie: the first in scan order wins
    const std::vector<double> dy = Random(g.oh * g.ow, rng);
    std::vector<int64_t> argmax(g.oh * g.ow);
    std::vector<double> want(g.h * g.w, 0.0);
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        // The CPU's ForEachMax.
        int64_t best = -1;
        double mx = -INFINITY;
        for (int64_t iy = std::max<int64_t>(0, oy * g.sh - g.ph);
             iy < std::min(g.h, oy * g.sh - g.ph + g.kh); ++iy) {
          for (int64_t ix = std::max<int64_t>(0, ox * g.sw - g.pw);
               ix < std::min(g.w, ox * g.sw - g.pw + g.kw); ++ix) {
            if (x[iy * g.w + ix] > mx) {
              mx = x[iy * g.w + ix];
              best = iy * g.w + ix;
            }
          }
        }
        int64_t got_best = -1;
        double got_max = 0;
        WindowMax(g, x.data(), oy * g.ow + ox, &got_best, &got_max);
        EXPECT_EQ(got_best, best);
        EXPECT_EQ(got_max, mx);
        argmax[oy * g.ow + ox] = got_best;
        want[best] += dy[oy * g.ow + ox];
      }
    }
    for (int64_t e = 0; e < g.h * g.w; ++e) {
      double sum = 0;
      const bool any = MaxPoolGradSum(g, argmax.data(), dy.data(), e, &sum);
      EXPECT_NEAR(any ? sum : 0.0, want[e], 1e-12) << e;
    }
  }
}

TEST(AdaptivePoolTest, AverageAndGatheredGradientMatchTheScatter) {
  std::mt19937_64 rng(4);
  struct S {
    int64_t h, w, oh, ow;
  };
  for (const S& s : {S{9, 11, 4, 5}, S{7, 7, 1, 1}, S{5, 6, 13, 17},
                     S{32, 32, 7, 7}, S{3, 10, 7, 3}, S{1, 1, 5, 5}}) {
    Window g;
    g.n = g.c = 1;
    g.h = s.h;
    g.w = s.w;
    g.oh = s.oh;
    g.ow = s.ow;
    const std::vector<double> x = Random(g.h * g.w, rng);
    const std::vector<double> dy = Random(g.oh * g.ow, rng);
    std::vector<double> want(g.h * g.w, 0.0);
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      // PyTorch's windows.
      const int64_t y0 = oy * g.h / g.oh;
      const int64_t y1 = ((oy + 1) * g.h + g.oh - 1) / g.oh;
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        const int64_t x0 = ox * g.w / g.ow;
        const int64_t x1 = ((ox + 1) * g.w + g.ow - 1) / g.ow;
        double mean = 0;
        for (int64_t iy = y0; iy < y1; ++iy) {
          for (int64_t ix = x0; ix < x1; ++ix) mean += x[iy * g.w + ix];
        }
        const double n = static_cast<double>((y1 - y0) * (x1 - x0));
        EXPECT_NEAR(AdaptiveAvg(g, x.data(), oy, ox), mean / n, 1e-12);
        for (int64_t iy = y0; iy < y1; ++iy) {
          for (int64_t ix = x0; ix < x1; ++ix) {
            want[iy * g.w + ix] += dy[oy * g.ow + ox] / n;
          }
        }
      }
    }
    for (int64_t e = 0; e < g.h * g.w; ++e) {
      EXPECT_NEAR(AdaptiveGradSum(g, dy.data(), e), want[e], 1e-12) << e;
    }
  }
  // An empty plane's windows are empty: means of 0 (the CPU's), not 0 / 0.
  Window empty;
  empty.n = empty.c = 1;
  empty.h = 0;
  empty.w = 3;
  empty.oh = empty.ow = 2;
  const double none = 0;
  EXPECT_EQ(AdaptiveAvg(empty, &none, 1, 1), 0.0);
}

// avg_pool2d: PyTorch's windows (divisor with or without the padding, a
// ceil_mode window cut at the padded edge) written out here, against
// AvgPoolValue and the gathered gradient.
TEST(AvgPoolTest, AverageAndGatheredGradientMatchTheScatter) {
  std::mt19937_64 rng(6);
  struct S {
    int64_t h, w, kh, kw, sh, sw, ph, pw;
    bool ceil;
  };
  for (const S& s : {S{9, 11, 3, 3, 2, 2, 1, 1, false}, S{6, 7, 3, 2, 2, 2, 1, 0, true},
                     S{13, 10, 3, 3, 2, 2, 0, 0, true}, S{5, 5, 2, 2, 1, 1, 1, 1, false},
                     S{8, 8, 4, 4, 3, 3, 2, 1, true}}) {
    for (bool include_pad : {true, false}) {
      Window g;
      g.n = g.c = 1;
      g.h = s.h;
      g.w = s.w;
      g.kh = s.kh;
      g.kw = s.kw;
      g.sh = s.sh;
      g.sw = s.sw;
      g.ph = s.ph;
      g.pw = s.pw;
      g.count_include_pad = include_pad;
      auto out = [&](int64_t in, int64_t k, int64_t st, int64_t p) {
        int64_t o = (in + 2 * p - k + (s.ceil ? st - 1 : 0)) / st + 1;
        if (s.ceil && (o - 1) * st >= in + p) --o;
        return o;
      };
      g.oh = out(g.h, g.kh, g.sh, g.ph);
      g.ow = out(g.w, g.kw, g.sw, g.pw);
      const std::vector<double> x = Random(g.h * g.w, rng);
      const std::vector<double> dy = Random(g.oh * g.ow, rng);
      std::vector<double> want(g.h * g.w, 0.0);
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        int64_t y0 = oy * g.sh - g.ph, y1 = std::min(y0 + g.kh, g.h + g.ph);
        const int64_t pool_h = y1 - y0;
        y0 = std::max<int64_t>(y0, 0);
        y1 = std::min(y1, g.h);
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          int64_t x0 = ox * g.sw - g.pw, x1 = std::min(x0 + g.kw, g.w + g.pw);
          const int64_t pool_w = x1 - x0;
          x0 = std::max<int64_t>(x0, 0);
          x1 = std::min(x1, g.w);
          const double n = static_cast<double>(
              include_pad ? pool_h * pool_w : (y1 - y0) * (x1 - x0));
          double sum = 0;
          for (int64_t iy = y0; iy < y1; ++iy) {
            for (int64_t ix = x0; ix < x1; ++ix) {
              sum += x[iy * g.w + ix];
              want[iy * g.w + ix] += dy[oy * g.ow + ox] / n;
            }
          }
          EXPECT_NEAR(AvgPoolValue(g, x.data(), oy * g.ow + ox), sum / n, 1e-12);
        }
      }
      for (int64_t e = 0; e < g.h * g.w; ++e) {
        EXPECT_NEAR(AvgPoolGradSum(g, dy.data(), e), want[e], 1e-12) << e;
      }
    }
  }
}

// max_pool3d and avg_pool3d: the gathers (WindowMax, MaxPoolGradSum,
// AvgPoolValue, AvgPoolGradSum) against direct 3-D windows and scatters,
// with padding, strides, ceil_mode's cut windows and both divisors.
TEST(Pool3dTest, MaxAndAverageAndGatheredGradientsMatchTheScatter) {
  std::mt19937_64 rng(8);
  struct S {
    std::vector<int64_t> in, k, s, p;
    bool ceil;
  };
  for (const S& c : {S{{3, 7, 6}, {1, 3, 3}, {1, 2, 2}, {0, 1, 1}, false},
                     S{{5, 6, 7}, {3, 3, 3}, {2, 2, 2}, {1, 1, 1}, true},
                     S{{4, 5, 4}, {2, 2, 2}, {2, 2, 2}, {0, 0, 0}, true},
                     S{{6, 4, 5}, {3, 2, 3}, {1, 1, 2}, {1, 1, 0}, false}}) {
    for (bool include_pad : {true, false}) {
      Window g;
      ASSERT_EQ(pool::FitWindow({1, 1, c.in[0], c.in[1], c.in[2]}, 3, c.k, c.s, c.p, {1, 1, 1},
                                c.ceil, "x", &g),
                "");
      g.count_include_pad = include_pad;
      const std::vector<double> x = Random(g.plane(), rng);
      const std::vector<double> dy = Random(g.out_plane(), rng);
      std::vector<int64_t> argmax(g.out_plane());
      std::vector<double> want_max(g.plane(), 0.0), want_avg(g.plane(), 0.0);
      for (int64_t o = 0; o < g.out_plane(); ++o) {
        const int64_t o3[3] = {o / (g.ow * g.oh), (o / g.ow) % g.oh, o % g.ow};
        const int64_t in[3] = {g.d, g.h, g.w};
        int64_t lo[3], hi[3], padded = 1, inside = 1;
        for (int a = 0; a < 3; ++a) {  // PyTorch's windows, written out
          const int64_t start = o3[a] * c.s[a] - c.p[a];
          const int64_t end = std::min(start + c.k[a], in[a] + c.p[a]);
          padded *= end - start;
          lo[a] = std::max<int64_t>(start, 0);
          hi[a] = std::min(end, in[a]);
          inside *= hi[a] - lo[a];
        }
        const double n = static_cast<double>(include_pad ? padded : inside);
        int64_t best = -1;
        double mx = -INFINITY, sum = 0;
        for (int64_t iz = lo[0]; iz < hi[0]; ++iz) {
          for (int64_t iy = lo[1]; iy < hi[1]; ++iy) {
            for (int64_t ix = lo[2]; ix < hi[2]; ++ix) {
              const int64_t e = (iz * g.h + iy) * g.w + ix;
              if (x[e] > mx) {
                mx = x[e];
                best = e;
              }
              sum += x[e];
              want_avg[e] += dy[o] / n;
            }
          }
        }
        int64_t got_best = -1;
        double got_max = 0;
        WindowMax(g, x.data(), o, &got_best, &got_max);
        EXPECT_EQ(got_best, best);
        EXPECT_EQ(got_max, mx);
        argmax[o] = got_best;
        want_max[best] += dy[o];
        EXPECT_NEAR(AvgPoolValue(g, x.data(), o), sum / n, 1e-12);
      }
      for (int64_t e = 0; e < g.plane(); ++e) {
        double sum = 0;
        const bool any = MaxPoolGradSum(g, argmax.data(), dy.data(), e, &sum);
        EXPECT_NEAR(any ? sum : 0.0, want_max[e], 1e-12) << e;
        EXPECT_NEAR(AvgPoolGradSum(g, dy.data(), e), want_avg[e], 1e-12) << e;
      }
    }
  }
}

// Grouped conv2d and conv3d: the gathered dx and dw of GroupedConvDx /
// GroupedConvDw against the scatter of the forward's taps (GroupedConvValue
// checked against the same loops).
TEST(GroupedConvTest, ValueAndGatheredGradientsMatchTheScatter) {
  std::mt19937_64 rng(7);
  struct S {
    int64_t o, groups;
    Window g;
  };
  for (const S& s :
       {S{6, 2, MakeWindow(2, 4, 5, 6, 3, 3, 2, 1, 1, 1)},
        S{6, 3, MakeWindow(1, 3, 4, 4, 3, 2, 1, 2, 1, 0)},
        S{6, 6, MakeWindow(2, 6, 7, 5, 3, 3, 2, 2, 1, 1)},
        S{6, 6, MakeWindow(2, 6, 9, 8, 3, 3, 1, 2, 2, 3, 2, 3)},
        S{4, 2, MakeWindow(1, 4, 8, 9, 2, 3, 2, 1, 0, 2, 3, 2)},
        S{6, 2, MakeWindow3(2, 4, {5, 4, 5}, {3, 2, 3}, {2, 1, 2}, {1, 1, 1})},
        S{4, 4, MakeWindow3(1, 4, {6, 5, 4}, {3, 3, 1}, {1, 2, 1}, {2, 1, 0}, {2, 1, 1})}}) {
    const Window& g = s.g;
    const int64_t cg = g.c / s.groups, og = s.o / s.groups, op = g.out_plane();
    const std::vector<double> x = Random(g.n * g.c * g.plane(), rng);
    const std::vector<double> w = Random(s.o * cg * g.taps(), rng);
    const std::vector<double> dy = Random(g.n * s.o * op, rng);
    std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0);
    for (int64_t m = 0; m < g.n; ++m) {
      for (int64_t oc = 0; oc < s.o; ++oc) {
        for (int64_t p = 0; p < op; ++p) {
          const int64_t ox = p % g.ow, oy = (p / g.ow) % g.oh, oz = p / (g.ow * g.oh);
          const double d = dy[(m * s.o + oc) * op + p];
          double y = 0;
          for (int64_t k = 0; k < cg; ++k) {
            const int64_t ic = (oc / og) * cg + k;
            for (int64_t t = 0; t < g.kd; ++t) {
              for (int64_t i = 0; i < g.kh; ++i) {
                for (int64_t j = 0; j < g.kw; ++j) {
                  const int64_t iz = oz * g.sd - g.pd + t * g.dd;
                  const int64_t iy = oy * g.sh - g.ph + i * g.dh, ix = ox * g.sw - g.pw + j * g.dw;
                  if (iz < 0 || iz >= g.d || iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                  const int64_t xi = (((m * g.c + ic) * g.d + iz) * g.h + iy) * g.w + ix;
                  const int64_t wi = (((oc * cg + k) * g.kd + t) * g.kh + i) * g.kw + j;
                  y += w[wi] * x[xi];
                  dx[xi] += w[wi] * d;
                  dw[wi] += x[xi] * d;
                }
              }
            }
          }
          EXPECT_NEAR(GroupedConvValue(g, s.groups, s.o, x.data(), w.data(), m, oc, p), y, 1e-12);
        }
      }
    }
    for (int64_t e = 0; e < static_cast<int64_t>(x.size()); ++e) {
      const int64_t in = e % g.plane(), ic = (e / g.plane()) % g.c, m = e / (g.plane() * g.c);
      EXPECT_NEAR(GroupedConvDx(g, s.groups, s.o, w.data(), dy.data(), m, ic, in), dx[e], 1e-12)
          << e;
    }
    for (int64_t e = 0; e < static_cast<int64_t>(w.size()); ++e) {
      const int64_t tap = e % g.taps(), k = (e / g.taps()) % cg, oc = e / (g.taps() * cg);
      EXPECT_NEAR(GroupedConvDw(g, s.groups, s.o, x.data(), dy.data(), oc, k, tap), dw[e], 1e-12)
          << e;
    }
  }
}

TEST(GateTest, TopKIsTheCpusPartialSortOrder) {
  std::mt19937_64 rng(5);
  for (int64_t experts : {1, 3, 8, 33}) {
    for (int64_t k = 1; k <= std::min<int64_t>(experts, 4); ++k) {
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<float> row(experts);
        std::uniform_int_distribution<int> q(-4, 4);  // ties are common
        for (float& v : row) v = 0.5f * static_cast<float>(q(rng));
        const TokenSoftmax<float> s(row.data(), experts);
        std::vector<int64_t> order(experts);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
          return s.Prob(a) > s.Prob(b);
        });
        std::vector<int32_t> got(k);
        TopK(s, experts, k, got.data());
        for (int64_t j = 0; j < k; ++j) EXPECT_EQ(got[j], order[j]) << j;
        double total = 0;
        for (int64_t e = 0; e < experts; ++e) total += s.Prob(e);
        EXPECT_NEAR(total, 1.0, 1e-12);
      }
    }
  }
}

// A NaN or infinite logit makes the token's probabilities NaN; the experts
// picked stay distinct and in range (the lowest indices, NaN ordering below
// every number), never -1 or a repeat that the gate kernels would write
// through.
TEST(GateTest, TopKOfNanProbabilitiesIsDistinctExperts) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {
      {0, nan, 1, 2}, {inf, 0, 1, 2}, {-inf, -inf, -inf, -inf}, {1, 2, nan, 3}};
  for (const std::vector<float>& row : rows) {
    const TokenSoftmax<float> s(row.data(), 4);
    std::vector<int32_t> got(3);
    TopK(s, 4, 3, got.data());
    EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  }
  // Finite probabilities come before NaN ones.
  std::vector<double> probs = {nan, 0.25, nan, 0.75};
  std::vector<int64_t> order = {0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return TopKKey(probs[a]) > TopKKey(probs[b]); });
  EXPECT_EQ(order, (std::vector<int64_t>{3, 1, 0, 2}));
}

// A token's local slots come in ascending order (the CPU's summation
// order), each once, skipping dropped entries (-1) and other ranks' experts
// and capacity rows.
TEST(MoeIdxTest, TokenSlotsComeInAscendingOrder) {
  std::mt19937_64 rng(9);
  IdxDims m;
  m.tokens = 50;
  m.k = 3;
  m.experts = 4;  // this rank's: experts 2..5 of 8
  m.offset = 2;
  m.global_capacity = 6;
  m.capacity = 3;  // rows 1..3 of 6
  m.capacity_offset = 1;
  std::vector<int64_t> route(m.tokens * m.k);
  std::uniform_int_distribution<int64_t> entry(-1, 8 * m.global_capacity - 1);
  for (int64_t& r : route) r = entry(rng);
  for (int64_t t = 0; t < m.tokens; ++t) {
    std::vector<std::pair<int64_t, int64_t>> want;  // (slot, choice)
    for (int64_t j = 0; j < m.k; ++j) {
      const int64_t r = route[t * m.k + j];
      if (r < 0) continue;
      const int64_t e = r / m.global_capacity - m.offset, row = r % m.global_capacity - 1;
      if (e < 0 || e >= m.experts || row < 0 || row >= m.capacity) continue;
      want.emplace_back(e * m.capacity + row, j);
    }
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end(),
                           [](const auto& a, const auto& b) { return a.first == b.first; }),
               want.end());
    std::vector<std::pair<int64_t, int64_t>> got;
    int64_t j = -1;
    for (int64_t s = NextTokenSlot(m, route.data(), t, -1, &j); s >= 0;
         s = NextTokenSlot(m, route.data(), t, s, &j)) {
      got.emplace_back(s, j);
    }
    EXPECT_EQ(got, want) << "token " << t;
  }
}

// Random 2-D and 3-D geometries (as the argument checks make them:
// pool::FitWindow; strides, paddings and dilations up to 3 or 4, ceil_mode,
// both avg divisors, a NaN in some max pools) against loops written as the
// CPU's (executor/cpu/kernels_convolution.cc ForEachMax, ForEachAvg, the
// grouped taps): a review of conv3d and the 3-D pools beyond the fixed
// cases above.
TEST(RandomGeometryTest, GathersMatchTheCpusLoops) {
  std::mt19937_64 rng(11);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  // A random window; false when the kernel does not fit (the checks refuse it).
  auto window = [&](int spatial, bool is_pool, bool ceil, Window* g) {
    std::vector<int64_t> shape = {pick(1, 2), pick(1, 3)}, k, s, p, d;
    for (int a = 0; a < spatial; ++a) {
      shape.push_back(pick(1, 7));
      k.push_back(pick(1, 4));
      s.push_back(pick(1, 4));
      d.push_back(is_pool ? 1 : pick(1, 3));
      p.push_back(is_pool ? pick(0, k.back() / 2) : pick(0, 3));
    }
    return pool::FitWindow(shape, spatial, k, s, p, d, ceil, "x", g).empty();
  };
  int convs = 0, pools = 0;
  for (int it = 0; it < 300; ++it) {
    for (int spatial : {2, 3}) {
      Window g;
      if (!window(spatial, false, false, &g)) continue;
      ++convs;
      // col2im is the scatter of im2col, in both layouts.
      const int64_t ckk = g.c * g.taps(), op = g.out_plane();
      for (bool image_major : {true, false}) {
        const int64_t rs = image_major ? op : g.n * op, is = image_major ? ckk * op : op;
        const std::vector<double> c = Random(ckk * g.n * op, rng);
        std::vector<double> want(g.n * g.c * g.plane(), 0.0);
        for (int64_t k = 0; k < static_cast<int64_t>(c.size()); ++k) {
          int64_t at = -1;
          const int64_t src = Im2ColSource(g, k, g.n, rs, is, &at);
          ASSERT_GE(at, 0);
          if (src >= 0) want[src] += c[at];
        }
        for (int64_t k = 0; k < static_cast<int64_t>(want.size()); ++k) {
          ASSERT_NEAR(Col2ImSum(g, c.data(), g.n, rs, is, k), want[k], 1e-9) << it << " " << k;
        }
      }
      // Depthwise (groups = channels) with 1 or 2 outputs a group.
      const int64_t groups = g.c, o = groups * pick(1, 2), og = o / groups;
      const std::vector<double> x = Random(g.n * g.c * g.plane(), rng);
      const std::vector<double> w = Random(o * g.taps(), rng);
      const std::vector<double> dy = Random(g.n * o * op, rng);
      std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0);
      for (int64_t m = 0; m < g.n; ++m) {
        for (int64_t oc = 0; oc < o; ++oc) {
          for (int64_t p = 0; p < op; ++p) {
            const int64_t ox = p % g.ow, oy = (p / g.ow) % g.oh, oz = p / (g.ow * g.oh);
            const double d = dy[(m * o + oc) * op + p];
            double y = 0;
            for (int64_t tap = 0; tap < g.taps(); ++tap) {
              const int64_t j = tap % g.kw, i = (tap / g.kw) % g.kh, t = tap / (g.kw * g.kh);
              const int64_t iz = oz * g.sd - g.pd + t * g.dd;
              const int64_t iy = oy * g.sh - g.ph + i * g.dh, ix = ox * g.sw - g.pw + j * g.dw;
              if (iz < 0 || iz >= g.d || iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
              const int64_t xi = (((m * g.c + oc / og) * g.d + iz) * g.h + iy) * g.w + ix;
              y += w[oc * g.taps() + tap] * x[xi];
              dx[xi] += w[oc * g.taps() + tap] * d;
              dw[oc * g.taps() + tap] += x[xi] * d;
            }
            ASSERT_NEAR(GroupedConvValue(g, groups, o, x.data(), w.data(), m, oc, p), y, 1e-9);
          }
        }
      }
      for (int64_t e = 0; e < static_cast<int64_t>(x.size()); ++e) {
        const int64_t in = e % g.plane(), ic = (e / g.plane()) % g.c, m = e / (g.plane() * g.c);
        ASSERT_NEAR(GroupedConvDx(g, groups, o, w.data(), dy.data(), m, ic, in), dx[e], 1e-9);
      }
      for (int64_t e = 0; e < static_cast<int64_t>(w.size()); ++e) {
        ASSERT_NEAR(GroupedConvDw(g, groups, o, x.data(), dy.data(), e / g.taps(), 0, e % g.taps()),
                    dw[e], 1e-9);
      }
    }
    for (int spatial : {2, 3}) {
      for (bool ceil : {false, true}) {
        for (bool include_pad : {false, true}) {
          Window g;
          if (!window(spatial, true, ceil, &g)) continue;
          ++pools;
          g.count_include_pad = include_pad;
          std::vector<double> x = Random(g.plane(), rng);
          if (pick(0, 3) == 0) x[pick(0, g.plane() - 1)] = std::nan("");
          const std::vector<double> dy = Random(g.out_plane(), rng);
          std::vector<double> want_max(g.plane(), 0.0), want_avg(g.plane(), 0.0);
          std::vector<int64_t> argmax(g.out_plane());
          for (int64_t o = 0; o < g.out_plane(); ++o) {
            const int64_t ox = o % g.ow, oy = (o / g.ow) % g.oh, oz = o / (g.ow * g.oh);
            const int64_t z0 = std::max<int64_t>(0, oz * g.sd - g.pd);
            const int64_t z1 = std::min(g.d, oz * g.sd - g.pd + g.kd);
            const int64_t y0 = std::max<int64_t>(0, oy * g.sh - g.ph);
            const int64_t y1 = std::min(g.h, oy * g.sh - g.ph + g.kh);
            const int64_t x0 = std::max<int64_t>(0, ox * g.sw - g.pw);
            const int64_t x1 = std::min(g.w, ox * g.sw - g.pw + g.kw);
            int64_t best = (z0 * g.h + y0) * g.w + x0;
            double mx = -std::numeric_limits<double>::infinity();
            for (int64_t iz = z0; iz < z1; ++iz) {
              for (int64_t iy = y0; iy < y1; ++iy) {
                for (int64_t ix = x0; ix < x1; ++ix) {
                  const double v = x[(iz * g.h + iy) * g.w + ix];
                  if (v > mx || std::isnan(v)) {
                    mx = v;
                    best = (iz * g.h + iy) * g.w + ix;
                  }
                }
              }
            }
            int64_t got_best = -1;
            double got_max = 0;
            WindowMax(g, x.data(), o, &got_best, &got_max);
            ASSERT_EQ(got_best, best);
            ASSERT_TRUE(got_max == mx || (std::isnan(got_max) && std::isnan(mx)));
            argmax[o] = got_best;
            want_max[best] += dy[o];
            const pool::AvgSpan wz = pool::AvgWindow(oz, g.d, g.kd, g.sd, g.pd);
            const pool::AvgSpan wy = pool::AvgWindow(oy, g.h, g.kh, g.sh, g.ph);
            const pool::AvgSpan wx = pool::AvgWindow(ox, g.w, g.kw, g.sw, g.pw);
            const double inv =
                1.0 / static_cast<double>(include_pad ? wz.padded * wy.padded * wx.padded
                                                      : (wz.hi - wz.lo) * (wy.hi - wy.lo) *
                                                            (wx.hi - wx.lo));
            double sum = 0;
            for (int64_t iz = wz.lo; iz < wz.hi; ++iz) {
              for (int64_t iy = wy.lo; iy < wy.hi; ++iy) {
                for (int64_t ix = wx.lo; ix < wx.hi; ++ix) {
                  sum += x[(iz * g.h + iy) * g.w + ix] * inv;
                  want_avg[(iz * g.h + iy) * g.w + ix] += dy[o] * inv;
                }
              }
            }
            const double got = AvgPoolValue(g, x.data(), o);
            ASSERT_TRUE(std::isnan(sum) ? std::isnan(got) : std::fabs(got - sum) < 1e-12);
          }
          for (int64_t e = 0; e < g.plane(); ++e) {
            double sum = 0;
            const bool any = MaxPoolGradSum(g, argmax.data(), dy.data(), e, &sum);
            ASSERT_NEAR(any ? sum : 0.0, want_max[e], 1e-12) << e;
            ASSERT_NEAR(AvgPoolGradSum(g, dy.data(), e), want_avg[e], 1e-12) << e;
          }
        }
      }
    }
  }
  // Most random windows fit: the loops above did run.
  EXPECT_GT(convs, 300);
  EXPECT_GT(pools, 600);
}

}  // namespace
}  // namespace hap::executor::cuda
