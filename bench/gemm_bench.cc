// GEMM throughput: our matrix-product kernels (executor/cpu, through
// RunCpuKernel) against raw OpenBLAS cblas_sgemm on the same float32
// operands, in the same process, interleaved round by round (the order
// alternates between rounds). Prints a Markdown table of GFLOP/s (median
// over rounds) and the ratio ours / cblas_sgemm (median of the per-round
// ratios; 1.0 means no overhead over the library).
//
//   bazel run -c opt //bench:gemm_bench -- [--quick]
//
// Kernels, for sizes M x K x N (M rows of K inputs, N outputs):
//   linear       y[M,N] = x[M,K] @ w[N,K]^T   vs one sgemm (NoTrans, Trans)
//   linear+bias  the same plus a bias[N]      vs the same sgemm, no bias
//   linear_grad  dx += dy @ w, dw += dy^T @ x vs those two sgemm calls
//   matmul       y[M,N] = a[M,K] @ b[K,N]     vs one sgemm (NoTrans, NoTrans)
// Thread counts 1 and 2: both sides get the same OpenBLAS thread count.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/stats.h"
#include "executor/cpu/kernels.h"
#include "executor/runtime/tensor.h"

namespace {

using ::hap::Median;

using hap::executor::HostTensor;
using hap::executor::KernelContext;
using hap::executor::TensorView;
using hap::graph::DType;

HostTensor Random(std::vector<int64_t> shape, std::mt19937& rng) {
  HostTensor t(DType::kFloat32, std::move(shape));
  std::normal_distribution<float> d(0.0f, 1.0f);
  float* p = t.as<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) p[i] = d(rng);
  return t;
}

// Seconds per call of `f`, over `iters` calls.
double TimePerCall(const std::function<void()>& f, int iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
             .count() /
         iters;
}

struct Case {
  std::string kernel;
  int64_t m, k, n;
};

struct Result {
  double ours_gflops, blas_gflops, ratio, ratio_min, ratio_max;
};

// `ours` and `blas` do the same FLOPs; both are timed in every round.
Result Compare(const std::function<void()>& ours,
               const std::function<void()>& blas, double flops, int rounds) {
  ours();  // warm-up: page faults, OpenBLAS buffers and threads
  blas();
  // Calls per timing: about 0.2 s of work each.
  const double once = TimePerCall(blas, 1);
  const int iters = std::max(1, static_cast<int>(0.2 / std::max(once, 1e-6)));
  std::vector<double> a, b, r;
  for (int i = 0; i < rounds; ++i) {
    double ta, tb;
    if (i % 2 == 0) {
      ta = TimePerCall(ours, iters);
      tb = TimePerCall(blas, iters);
    } else {
      tb = TimePerCall(blas, iters);
      ta = TimePerCall(ours, iters);
    }
    a.push_back(flops / ta * 1e-9);
    b.push_back(flops / tb * 1e-9);
    r.push_back(tb / ta);  // throughput ratio ours / blas
  }
  return {Median(a), Median(b), Median(r),
          *std::min_element(r.begin(), r.end()),
          *std::max_element(r.begin(), r.end())};
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "gemm_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

Result Run(const Case& c, int threads, int rounds, std::mt19937& rng) {
  const int m = static_cast<int>(c.m), k = static_cast<int>(c.k),
            n = static_cast<int>(c.n);
  KernelContext ctx;
  ctx.num_threads = threads;
  const hap::graph::Attrs none;
  const double flops = 2.0 * c.m * c.k * c.n;
  if (c.kernel == "matmul") {
    HostTensor a = Random({c.m, c.k}, rng), b = Random({c.k, c.n}, rng);
    HostTensor y(DType::kFloat32, {c.m, c.n});
    TensorView in[] = {a.view(), b.view()};
    TensorView out[] = {y.view()};
    return Compare(
        [&] {
          Check(hap::executor::RunCpuKernel("matmul", ctx, none, in, out));
        },
        [&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f,
                      a.as<float>(), k, b.as<float>(), n, 0.0f, y.as<float>(),
                      n);
        },
        flops, rounds);
  }
  HostTensor x = Random({c.m, c.k}, rng), w = Random({c.n, c.k}, rng);
  HostTensor bias = Random({c.n}, rng);
  HostTensor y(DType::kFloat32, {c.m, c.n});
  if (c.kernel == "linear_grad") {
    // Small dy keeps the accumulated gradients finite over many calls.
    HostTensor dy = Random({c.m, c.n}, rng);
    for (int64_t i = 0; i < dy.num_elements(); ++i) dy.as<float>()[i] *= 1e-6f;
    HostTensor dx(DType::kFloat32, {c.m, c.k}), dw(DType::kFloat32, {c.n, c.k});
    TensorView in[] = {x.view(), w.view(), y.view(), dy.view()};
    TensorView out[] = {dx.view(), dw.view()};
    return Compare(
        [&] {
          Check(hap::executor::RunCpuKernel("linear_grad", ctx, none, in, out));
        },
        [&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1.0f,
                      dy.as<float>(), n, w.as<float>(), k, 1.0f, dx.as<float>(),
                      k);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, m, 1.0f,
                      dy.as<float>(), n, x.as<float>(), k, 1.0f, dw.as<float>(),
                      k);
        },
        2 * flops, rounds);
  }
  const bool with_bias = c.kernel == "linear+bias";
  std::vector<TensorView> in = {x.view(), w.view()};
  if (with_bias) in.push_back(bias.view());
  TensorView out[] = {y.view()};
  return Compare(
      [&] { Check(hap::executor::RunCpuKernel("linear", ctx, none, in, out)); },
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f,
                    x.as<float>(), k, w.as<float>(), k, 0.0f, y.as<float>(), n);
      },
      flops, rounds);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int rounds = quick ? 3 : 7;
  // 512x1024x1024: a square-ish layer; 2048x768x3072: the zoo default's FFN
  // (16 sequences of 128); 512x256x{1024,18328}: the FFN and the decoder of
  // the small GPT of bench/step_bench.py (8 sequences of 64).
  std::vector<Case> cases;
  for (const char* kernel :
       {"linear", "linear+bias", "linear_grad", "matmul"}) {
    cases.push_back({kernel, 512, 1024, 1024});
    cases.push_back({kernel, 2048, 768, 3072});
    if (quick) continue;
    cases.push_back({kernel, 512, 256, 1024});
    cases.push_back({kernel, 512, 256, 18328});
  }
  std::printf(
      "| kernel | M | K | N | threads | ours GFLOP/s | cblas_sgemm GFLOP/s | "
      "ratio ours / sgemm (min-max) |\n|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(1);
  for (int threads : {1, 2}) {
    hap::executor::SetBlasThreads(threads);
    for (const Case& c : cases) {
      Result r = Run(c, threads, rounds, rng);
      std::printf(
          "| %s | %lld | %lld | %lld | %d | %.1f | %.1f | %.3f (%.3f-%.3f) |\n",
          c.kernel.c_str(), static_cast<long long>(c.m),
          static_cast<long long>(c.k), static_cast<long long>(c.n), threads,
          r.ours_gflops, r.blas_gflops, r.ratio, r.ratio_min, r.ratio_max);
      std::fflush(stdout);
    }
  }
  return 0;
}
