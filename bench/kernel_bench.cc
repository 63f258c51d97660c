// The vectorized float kernels (executor/cpu/kernels_simd.h) against the
// scalar loops they replaced, in the same process, interleaved round by round
// (the order alternates between rounds). Prints a Markdown table: ms per call
// (median over rounds) and the speed-up baseline / ours (median of the
// per-round ratios, min-max alongside).
//
//   bazel run -c opt //bench:kernel_bench -- [--quick]
//
// Cases, float32:
//   log_softmax fwd+bwd  [362, 18328]: "log_softmax" then "log_softmax_grad"
//                        (the GPT LM's decoder output: vocabulary 18,328)
//   adam_update          2.4 M parameters
//   sq_norm              2.4 M values
//   gelu fwd+bwd         [512, 1024]: "gelu" then "gelu_grad" (the GPT FFN's
//                        activation at hidden 256, 512 tokens)
//   cross-entropy fwd+bwd [512, 18328]: "cross_entropy" then
//                        "cross_entropy_grad" (the GPT LM's fused loss)
//                        against what the model ran before: "log_softmax",
//                        "nll_loss", zeroing the log-probabilities'
//                        gradient, "nll_loss_grad", "log_softmax_grad"
//   dropout fwd+bwd      [512, 1024] and [8192, 64]: "dropout" then
//                        "dropout_grad", p = 0.1 (rows of 1,024 and of 64,
//                        the attention probabilities' rows at seq 64)
// "kernel table" rows go through RunCpuKernel (the widest Isa this CPU
// runs); "Isa <name>" rows call that Isa's loops directly, on one thread.
// The baseline is the previous implementation, copied below verbatim and
// built with the flags the kernel library used for it (BUILD.bazel copts).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/stats.h"
#include "executor/cpu/kernels.h"
#include "executor/cpu/kernels_simd.h"
#include "executor/runtime/counter_random.h"
#include "executor/runtime/tensor.h"

namespace {

using ::hap::Median;

using hap::executor::HostTensor;
using hap::executor::KernelContext;
using hap::executor::TensorView;
using hap::graph::DType;
namespace simd = hap::executor::cpu::simd;

// --- the baseline: the scalar loops before kernels_simd ----------------------

namespace old {

inline float FastExp(float x) {
  constexpr float kHi = 88.3f, kLo = -87.3f, kRound = 12582912.0f;
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < kLo ? 0.0f : p * scale;
}

template <typename A, typename F, typename C>
A LaneFold(int64_t n, A init, F f, C combine) {
  A acc[8];
  for (A& v : acc) v = init;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] = combine(acc[k], f(i + k));
  }
  for (; i < n; ++i) acc[i % 8] = combine(acc[i % 8], f(i));
  for (int w = 4; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) acc[k] = combine(acc[k], acc[k + w]);
  }
  return acc[0];
}

template <typename F>
double SumOver(int64_t n, F f) {
  return LaneFold(n, 0.0, f, [](double s, double v) { return s + v; });
}

float MaxOf(const float* x, int64_t n) {
  return LaneFold(
      n, x[0], [x](int64_t j) { return x[j]; },
      [](float m, float v) { return v > m ? v : m; });
}

// The row functions are kept out of interprocedural optimization: in the
// kernel library the row length is not a constant (and with it constant,
// GCC warns about the lane loops' tails).
#define HAP_OLD_ROW __attribute__((noipa))

// SoftmaxRow<float, true> without a mask (valid == cols).
HAP_OLD_ROW void LogSoftmaxRow(const float* x, int64_t cols, float* y) {
  std::copy(x, x + cols, y);
  const float mx = MaxOf(y, cols);
  const double sum =
      SumOver(cols, [&](int64_t j) { return double(FastExp(y[j] - mx)); });
  const float lse = mx + static_cast<float>(std::log(sum));
  for (int64_t j = 0; j < cols; ++j) y[j] -= lse;
}

// SoftmaxBackward<float, true>'s row.
HAP_OLD_ROW void LogSoftmaxGradRow(const float* yr, const float* dyr,
                                   int64_t cols, float* dxr) {
  const float s = static_cast<float>(
      SumOver(cols, [&](int64_t j) { return double(dyr[j]); }));
  for (int64_t j = 0; j < cols; ++j) dxr[j] += dyr[j] - FastExp(yr[j]) * s;
}

// AdamUpdate<float>'s loop.
HAP_OLD_ROW void Adam(const simd::AdamConstants& c, const float* param,
                      const float* grad, float* m, float* v, float* out,
                      int64_t b, int64_t e) {
  const float clip = c.clip, decay = c.decay, tb1 = c.b1, tb2 = c.b2,
              step = c.step, sqrt_bc2 = c.sqrt_bc2, teps = c.eps;
  for (int64_t i = b; i < e; ++i) {
    const float g = grad[i] * clip;
    m[i] = tb1 * m[i] + (1.0f - tb1) * g;
    v[i] = tb2 * v[i] + (1.0f - tb2) * g * g;
    const float denom = std::sqrt(v[i]) / sqrt_bc2 + teps;
    out[i] = param[i] * decay - step * m[i] / denom;
  }
}

HAP_OLD_ROW double SumSquares(const float* p, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

// FastErf and kernels_elementwise.cc's Gelu (float) and activation loops.
inline float FastErf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return std::copysign(1.0f - p * t * FastExp(-ax * ax), x);
}

struct Gelu {
  static float F(float x) {
    return 0.5f * x * (1.0f + FastErf(x * static_cast<float>(M_SQRT1_2)));
  }
  static float D(float x, float) {
    const float cdf =
        0.5f * (1.0f + FastErf(x * static_cast<float>(M_SQRT1_2)));
    const float pdf =
        FastExp(-0.5f * x * x) * static_cast<float>(0.3989422804014327);
    return cdf + x * pdf;
  }
};

HAP_OLD_ROW void GeluRange(const float* x, float* y, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) y[i] = Gelu::F(x[i]);
}

HAP_OLD_ROW void GeluGradRange(const float* x, const float* y, const float* dy,
                               float* dx, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) dx[i] += dy[i] * Gelu::D(x[i], y[i]);
}

// DropoutMask::Row (unsharded: row r starts at global index r * row) and
// MaskRow<float>.
HAP_OLD_ROW void DropoutMaskRow(uint64_t key, double p, int64_t g, int64_t row,
                                std::vector<char>& keep) {
  keep.resize(row);
  for (int64_t j = 0; j < row; ++j) {
    keep[j] =
        hap::executor::CounterUniform(key, static_cast<uint64_t>(g + j)) >= p;
  }
}

HAP_OLD_ROW void MaskRow(const char* keep, const float* in, float scale,
                         float* out, int64_t n, bool accumulate) {
  if (accumulate) {
    for (int64_t j = 0; j < n; ++j) out[j] += keep[j] ? in[j] * scale : 0.0f;
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = keep[j] ? in[j] * scale : 0.0f;
  }
}

}  // namespace old

// fn(begin, end) over [0, n) on `threads` threads (the calling one included),
// as the kernels' ParallelFor splits work.
void Split(int threads, int64_t n,
           const std::function<void(int64_t, int64_t)>& fn) {
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const int64_t b = std::min(n, t * per), e = std::min(n, b + per);
    pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(0, std::min(n, per));
  for (std::thread& t : pool) t.join();
}

// --- timing ------------------------------------------------------------------

HostTensor Random(std::vector<int64_t> shape, float lo, float hi,
                  std::mt19937& rng) {
  HostTensor t(DType::kFloat32, std::move(shape));
  std::uniform_real_distribution<float> d(lo, hi);
  float* p = t.as<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) p[i] = d(rng);
  return t;
}

double TimePerCall(const std::function<void()>& f, int iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
             .count() /
         iters;
}

struct Result {
  double ours_ms, base_ms, ratio, ratio_min, ratio_max;
};

// `ours` and `base` do the same work; both are timed in every round.
Result Compare(const std::function<void()>& ours,
               const std::function<void()>& base, int rounds) {
  ours();  // warm-up: page faults, threads
  base();
  const double once = TimePerCall(base, 1);
  const int iters = std::max(1, static_cast<int>(0.3 / std::max(once, 1e-6)));
  std::vector<double> a, b, r;
  for (int i = 0; i < rounds; ++i) {
    double ta, tb;
    if (i % 2 == 0) {
      ta = TimePerCall(ours, iters);
      tb = TimePerCall(base, iters);
    } else {
      tb = TimePerCall(base, iters);
      ta = TimePerCall(ours, iters);
    }
    a.push_back(ta * 1e3);
    b.push_back(tb * 1e3);
    r.push_back(tb / ta);  // speed-up: baseline time / ours
  }
  return {Median(a), Median(b), Median(r),
          *std::min_element(r.begin(), r.end()),
          *std::max_element(r.begin(), r.end())};
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "kernel_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// Exits unless |a - b| <= tol * max(1, |b|) everywhere: ours and the
// baseline compute the same values (up to summation order).
void ExpectSame(const HostTensor& a, const HostTensor& b, double tol,
                const char* what) {
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    const double x = a.as<float>()[i], y = b.as<float>()[i];
    if (!(std::abs(x - y) <= tol * std::max(1.0, std::abs(y)))) {
      std::fprintf(stderr, "kernel_bench: %s differs at %lld: %g vs %g\n", what,
                   static_cast<long long>(i), x, y);
      std::exit(1);
    }
  }
}

void Print(const char* kernel, const char* size, const std::string& ours,
           int threads, double elements, const Result& r) {
  std::printf(
      "| %s | %s | %s | %d | %.2f | %.2f | %.2f | %.2f | %.2fx (%.2f-%.2f) "
      "|\n",
      kernel, size, ours.c_str(), threads, r.base_ms, r.ours_ms,
      r.base_ms * 1e6 / elements, r.ours_ms * 1e6 / elements, r.ratio,
      r.ratio_min, r.ratio_max);
  std::fflush(stdout);
}

// --- cases -------------------------------------------------------------------

void LogSoftmax(int threads, int rounds, std::mt19937& rng) {
  const int64_t rows = 362, cols = 18328;
  // Logits and their gradient at the scale of a trained LM's.
  HostTensor x = Random({rows, cols}, -12.0f, 12.0f, rng);
  HostTensor dy = Random({rows, cols}, -1e-4f, 1e-4f, rng);
  HostTensor y(DType::kFloat32, {rows, cols}),
      dx(DType::kFloat32, {rows, cols});
  HostTensor yb(DType::kFloat32, {rows, cols}),
      dxb(DType::kFloat32, {rows, cols});
  std::memset(dx.data(), 0, rows * cols * sizeof(float));
  std::memset(dxb.data(), 0, rows * cols * sizeof(float));
  KernelContext ctx;
  ctx.num_threads = threads;
  const hap::graph::Attrs none;
  const TensorView fin[] = {x.view()}, fout[] = {y.view()};
  const TensorView bin[] = {x.view(), y.view(), dy.view()},
                   bout[] = {dx.view()};
  auto baseline = [&] {
    Split(threads, rows, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        old::LogSoftmaxRow(x.as<float>() + r * cols, cols,
                           yb.as<float>() + r * cols);
      }
    });
    Split(threads, rows, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        old::LogSoftmaxGradRow(yb.as<float>() + r * cols,
                               dy.as<float>() + r * cols, cols,
                               dxb.as<float>() + r * cols);
      }
    });
  };
  auto ours = [&] {
    Check(hap::executor::RunCpuKernel("log_softmax", ctx, none, fin, fout));
    Check(
        hap::executor::RunCpuKernel("log_softmax_grad", ctx, none, bin, bout));
  };
  if (threads == 1) {  // one call each from dx = 0: the same values
    ours();
    baseline();
    ExpectSame(y, yb, 1e-5, "log_softmax");
    ExpectSame(dx, dxb, 1e-6, "log_softmax_grad");
  }
  const char* size = "[362, 18328]";
  const double elements = static_cast<double>(rows * cols);
  Print("log_softmax fwd+bwd", size, "kernel table", threads, elements,
        Compare(ours, baseline, rounds));
  if (threads != 1) return;
  for (simd::Isa isa : simd::AvailableIsas()) {
    const simd::FloatRows& v = simd::RowsFor(isa);
    Print("log_softmax fwd+bwd", size, "Isa " + std::string(simd::IsaName(isa)),
          threads, elements,
          Compare(
              [&] {
                for (int64_t r = 0; r < rows; ++r) {
                  v.softmax_row(x.as<float>() + r * cols, nullptr, 0, cols,
                                cols, true, y.as<float>() + r * cols);
                }
                for (int64_t r = 0; r < rows; ++r) {
                  v.softmax_grad_row(y.as<float>() + r * cols,
                                     dy.as<float>() + r * cols, cols, true,
                                     dx.as<float>() + r * cols);
                }
              },
              baseline, rounds));
  }
}

void Adam(int threads, int rounds, std::mt19937& rng) {
  const int64_t n = 2400000;
  HostTensor param = Random({n}, -0.1f, 0.1f, rng);
  HostTensor grad = Random({n}, -1e-3f, 1e-3f, rng);
  HostTensor m(DType::kFloat32, {n}), v(DType::kFloat32, {n});
  HostTensor pb = param, mb(DType::kFloat32, {n}), vb(DType::kFloat32, {n});
  for (HostTensor* t : {&m, &v, &mb, &vb}) {
    std::memset(t->data(), 0, n * sizeof(float));
  }
  KernelContext ctx;
  ctx.num_threads = threads;
  ctx.step = 10;
  const hap::graph::Attrs attrs = {{"learning_rate", 1e-4},
                                   {"weight_decay", 0.01}};
  // AdamUpdate's constants for these attributes and step.
  const double lr = 1e-4, b1 = 0.9, b2 = 0.999, t = 11;
  const simd::AdamConstants c = {
      1.0f,
      static_cast<float>(1 - lr * 0.01),
      static_cast<float>(b1),
      static_cast<float>(b2),
      static_cast<float>(lr / (1 - std::pow(b1, t))),
      static_cast<float>(std::sqrt(1 - std::pow(b2, t))),
      1e-8f};
  const TensorView in[] = {param.view(), grad.view()};
  const TensorView out[] = {param.view(), m.view(), v.view()};
  auto baseline = [&] {
    Split(threads, n, [&](int64_t b, int64_t e) {
      old::Adam(c, pb.as<float>(), grad.as<float>(), mb.as<float>(),
                vb.as<float>(), pb.as<float>(), b, e);
    });
  };
  auto ours = [&] {
    Check(hap::executor::RunCpuKernel("adam_update", ctx, attrs, in, out));
  };
  if (threads == 1) {  // one step each from the same state: the same bits
    ours();
    baseline();
    ExpectSame(param, pb, 0, "adam_update param");
    ExpectSame(v, vb, 0, "adam_update v");
  }
  Print("adam_update", "2.4 M", "kernel table", threads, n,
        Compare(ours, baseline, rounds));
  if (threads != 1) return;
  for (simd::Isa isa : simd::AvailableIsas()) {
    const simd::FloatRows& rows = simd::RowsFor(isa);
    Print("adam_update", "2.4 M", "Isa " + std::string(simd::IsaName(isa)),
          threads, n,
          Compare(
              [&] {
                rows.adam(c, param.as<float>(), grad.as<float>(), m.as<float>(),
                          v.as<float>(), param.as<float>(), n);
              },
              baseline, rounds));
  }
}

void SqNorm(int threads, int rounds, std::mt19937& rng) {
  const int64_t n = 2400000;
  HostTensor g = Random({n}, -1e-3f, 1e-3f, rng);
  HostTensor acc(DType::kFloat64, {1});
  KernelContext ctx;
  ctx.num_threads = threads;
  const TensorView in[] = {g.view()}, out[] = {acc.view()};
  volatile double sink = 0;
  Print("sq_norm", "2.4 M", "kernel table", threads, n,
        Compare(
            [&] {
              Check(hap::executor::RunCpuKernel("sq_norm", ctx, {}, in, out));
            },
            [&] { sink = sink + old::SumSquares(g.as<float>(), n); }, rounds));
}

void GeluCase(int threads, int rounds, std::mt19937& rng) {
  const int64_t rows = 512, cols = 1024, n = rows * cols;
  // Pre-activations of a trained FFN's scale: both of erf's tails.
  HostTensor x = Random({rows, cols}, -6.0f, 6.0f, rng);
  HostTensor dy = Random({rows, cols}, -1e-3f, 1e-3f, rng);
  HostTensor y(DType::kFloat32, {rows, cols}),
      dx(DType::kFloat32, {rows, cols});
  HostTensor yb(DType::kFloat32, {rows, cols}),
      dxb(DType::kFloat32, {rows, cols});
  std::memset(dx.data(), 0, n * sizeof(float));
  std::memset(dxb.data(), 0, n * sizeof(float));
  KernelContext ctx;
  ctx.num_threads = threads;
  const hap::graph::Attrs none;
  const TensorView fin[] = {x.view()}, fout[] = {y.view()};
  const TensorView bin[] = {x.view(), y.view(), dy.view()},
                   bout[] = {dx.view()};
  auto baseline = [&] {
    Split(threads, n, [&](int64_t b, int64_t e) {
      old::GeluRange(x.as<float>(), yb.as<float>(), b, e);
    });
    Split(threads, n, [&](int64_t b, int64_t e) {
      old::GeluGradRange(x.as<float>(), yb.as<float>(), dy.as<float>(),
                         dxb.as<float>(), b, e);
    });
  };
  auto ours = [&] {
    Check(hap::executor::RunCpuKernel("gelu", ctx, none, fin, fout));
    Check(hap::executor::RunCpuKernel("gelu_grad", ctx, none, bin, bout));
  };
  if (threads == 1) {  // one call each from dx = 0: the same bits
    ours();
    baseline();
    ExpectSame(y, yb, 0, "gelu");
    ExpectSame(dx, dxb, 0, "gelu_grad");
  }
  const char* size = "[512, 1024]";
  Print("gelu fwd+bwd", size, "kernel table", threads, n,
        Compare(ours, baseline, rounds));
  if (threads != 1) return;
  for (simd::Isa isa : simd::AvailableIsas()) {
    const simd::FloatRows& v = simd::RowsFor(isa);
    Print("gelu fwd+bwd", size, "Isa " + std::string(simd::IsaName(isa)),
          threads, n,
          Compare(
              [&] {
                v.gelu(x.as<float>(), n, y.as<float>());
                v.gelu_grad(x.as<float>(), dy.as<float>(), n, dx.as<float>());
              },
              baseline, rounds));
  }
}

void DropoutCase(int threads, int rounds, int64_t rows, int64_t cols,
                 std::mt19937& rng) {
  const int64_t n = rows * cols;
  const double p = 0.1;
  const int64_t rng_key = 17, step = 3;
  HostTensor x = Random({rows, cols}, -1.0f, 1.0f, rng);
  HostTensor dy = Random({rows, cols}, -1e-3f, 1e-3f, rng);
  HostTensor y(DType::kFloat32, {rows, cols}),
      dx(DType::kFloat32, {rows, cols});
  HostTensor yb(DType::kFloat32, {rows, cols}),
      dxb(DType::kFloat32, {rows, cols});
  std::memset(dx.data(), 0, n * sizeof(float));
  std::memset(dxb.data(), 0, n * sizeof(float));
  KernelContext ctx;
  ctx.num_threads = threads;
  ctx.step = step;
  const hap::graph::Attrs attrs = {{"p", p}, {"rng_key", rng_key}};
  // DropoutMask's key and scale for these attributes.
  const uint64_t key = hap::executor::CounterKey(
      static_cast<uint64_t>(rng_key), static_cast<uint64_t>(step));
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  const TensorView fin[] = {x.view()}, fout[] = {y.view()};
  const TensorView bin[] = {x.view(), y.view(), dy.view()},
                   bout[] = {dx.view()};
  auto baseline = [&] {
    for (bool accumulate : {false, true}) {
      const float* in = accumulate ? dy.as<float>() : x.as<float>();
      float* out = accumulate ? dxb.as<float>() : yb.as<float>();
      Split(threads, rows, [&](int64_t b, int64_t e) {
        std::vector<char> keep;
        for (int64_t r = b; r < e; ++r) {
          old::DropoutMaskRow(key, p, r * cols, cols, keep);
          old::MaskRow(keep.data(), in + r * cols, scale, out + r * cols, cols,
                       accumulate);
        }
      });
    }
  };
  auto ours = [&] {
    Check(hap::executor::RunCpuKernel("dropout", ctx, attrs, fin, fout));
    Check(hap::executor::RunCpuKernel("dropout_grad", ctx, attrs, bin, bout));
  };
  if (threads == 1) {  // one call each from dx = 0: the same bits
    ours();
    baseline();
    ExpectSame(y, yb, 0, "dropout");
    ExpectSame(dx, dxb, 0, "dropout_grad");
  }
  const std::string size =
      "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
  Print("dropout fwd+bwd", size.c_str(), "kernel table", threads, n,
        Compare(ours, baseline, rounds));
  if (threads != 1) return;
  const simd::DropoutConstants c = {key, simd::DropoutThreshold(p), scale};
  for (simd::Isa isa : simd::AvailableIsas()) {
    const simd::FloatRows& v = simd::RowsFor(isa);
    Print("dropout fwd+bwd", size.c_str(),
          "Isa " + std::string(simd::IsaName(isa)), threads, n,
          Compare(
              [&] {
                for (int64_t r = 0; r < rows; ++r) {
                  v.dropout(c, r * cols, x.as<float>() + r * cols, cols, false,
                            y.as<float>() + r * cols);
                }
                for (int64_t r = 0; r < rows; ++r) {
                  v.dropout(c, r * cols, dy.as<float>() + r * cols, cols, true,
                            dx.as<float>() + r * cols);
                }
              },
              baseline, rounds));
  }
}

}  // namespace

// The GPT LM's loss fused (cross_entropy) against the two ops it replaced,
// both through the kernel table.
void CrossEntropyCase(int threads, int rounds, std::mt19937& rng) {
  const int64_t rows = 512, cols = 18328;
  HostTensor x = Random({rows, cols}, -12.0f, 12.0f, rng);
  HostTensor targets(DType::kInt64, {rows});
  std::uniform_int_distribution<int64_t> pick(0, cols - 1);
  for (int64_t i = 0; i < rows; ++i) targets.as<int64_t>()[i] = pick(rng);
  HostTensor loss(DType::kFloat32, {}), lossb(DType::kFloat32, {});
  HostTensor dl(DType::kFloat32, {});
  dl.as<float>()[0] = 1.0f;
  HostTensor dx(DType::kFloat32, {rows, cols}), dxb(DType::kFloat32, {rows, cols});
  HostTensor logp(DType::kFloat32, {rows, cols}), dlogp(DType::kFloat32, {rows, cols});
  KernelContext ctx;
  ctx.num_threads = threads;
  const hap::graph::Attrs none;
  using hap::executor::RunCpuKernel;
  auto ours = [&] {
    const TensorView in[] = {x.view(), targets.view()}, out[] = {loss.view()};
    Check(RunCpuKernel("cross_entropy", ctx, none, in, out));
    const TensorView bin[] = {x.view(), targets.view(), loss.view(), dl.view()};
    const TensorView bout[] = {dx.view(), TensorView{}};
    Check(RunCpuKernel("cross_entropy_grad", ctx, none, bin, bout));
  };
  auto baseline = [&] {
    const TensorView lin[] = {x.view()}, lout[] = {logp.view()};
    Check(RunCpuKernel("log_softmax", ctx, none, lin, lout));
    const TensorView nin[] = {logp.view(), targets.view()}, nout[] = {lossb.view()};
    Check(RunCpuKernel("nll_loss", ctx, none, nin, nout));
    std::memset(dlogp.data(), 0, rows * cols * sizeof(float));
    const TensorView gin[] = {logp.view(), targets.view(), lossb.view(), dl.view()};
    const TensorView gout[] = {dlogp.view(), TensorView{}};
    Check(RunCpuKernel("nll_loss_grad", ctx, none, gin, gout));
    const TensorView sin[] = {x.view(), logp.view(), dlogp.view()}, sout[] = {dxb.view()};
    Check(RunCpuKernel("log_softmax_grad", ctx, none, sin, sout));
  };
  if (threads == 1) {  // one call each from dx = 0: the same values
    std::memset(dx.data(), 0, rows * cols * sizeof(float));
    std::memset(dxb.data(), 0, rows * cols * sizeof(float));
    ours();
    baseline();
    ExpectSame(loss, lossb, 1e-5, "cross_entropy");
    ExpectSame(dx, dxb, 1e-6, "cross_entropy_grad");
  }
  Print("cross-entropy fwd+bwd", "[512, 18328]", "fused", threads,
        static_cast<double>(rows * cols), Compare(ours, baseline, rounds));
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int rounds = quick ? 3 : 7;
  std::printf("widest Isa: %s\n\n", simd::IsaName(simd::Rows().isa));
  std::printf(
      "| kernel | size | ours | threads | baseline ms | ours ms | baseline "
      "ns/element | ours ns/element | speed-up (min-max) |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(1);
  for (int threads : {1, 2}) {
    LogSoftmax(threads, rounds, rng);
    CrossEntropyCase(threads, rounds, rng);
    Adam(threads, rounds, rng);
    // sq_norm runs on one thread (it is one serial sum).
    if (threads == 1) SqNorm(threads, rounds, rng);
    GeluCase(threads, rounds, rng);
    DropoutCase(threads, rounds, 512, 1024, rng);
    DropoutCase(threads, rounds, 8192, 64, rng);
  }
  return 0;
}
