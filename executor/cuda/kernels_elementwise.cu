// Element-wise, broadcasting and reduction kernels (launch_elementwise.h).
// Plain C++17 + CUDA. Loops are grid-stride over 64-bit indices; sums are
// double and run in a fixed order (no atomics), so results are reproducible.
#include <cstdint>

#include "executor/cuda/launch_elementwise.h"
#include "executor/cuda/grid.cuh"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
__device__ inline float Erf(float x) { return erff(x); }
__device__ inline double Erf(double x) { return erf(x); }
__device__ inline float Tanh(float x) { return tanhf(x); }
__device__ inline double Tanh(double x) { return tanh(x); }
__device__ inline float Rsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ inline double Rsqrt(double x) { return 1.0 / sqrt(x); }
__device__ inline float Log(float x) { return logf(x); }
__device__ inline double Log(double x) { return log(x); }

// F(x) and F'(x) given y = F(x), as executor/cpu/kernels_elementwise.cc.
template <Activation A, typename T>
__device__ inline T ActF(T x) {
  if constexpr (A == Activation::kRelu) {
    return x < T(0) ? T(0) : x;  // NaN propagates
  } else if constexpr (A == Activation::kGelu) {
    return T(0.5) * x * (T(1) + Erf(x * T(0.70710678118654752440)));
  } else if constexpr (A == Activation::kSigmoid) {
    return T(1) / (T(1) + Exp(-x));
  } else if constexpr (A == Activation::kSilu) {
    return x / (T(1) + Exp(-x));
  } else if constexpr (A == Activation::kRelu6) {
    return x < T(0) ? T(0) : (x > T(6) ? T(6) : x);  // NaN propagates
  } else if constexpr (A == Activation::kHardsigmoid) {
    return ActF<Activation::kRelu6>(x + T(3)) / T(6);
  } else if constexpr (A == Activation::kHardswish) {
    return x * ActF<Activation::kRelu6>(x + T(3)) / T(6);
  } else if constexpr (A == Activation::kExp) {
    return Exp(x);
  } else if constexpr (A == Activation::kRsqrt) {
    return Rsqrt(x);
  } else if constexpr (A == Activation::kLog) {
    return Log(x);
  } else {
    return Tanh(x);
  }
}

template <Activation A, typename T>
__device__ inline T ActD(T x, T y) {
  if constexpr (A == Activation::kRelu) {
    return x > T(0) ? T(1) : T(0);
  } else if constexpr (A == Activation::kGelu) {
    const T cdf = T(0.5) * (T(1) + Erf(x * T(0.70710678118654752440)));
    const T pdf = Exp(T(-0.5) * x * x) * T(0.3989422804014327);
    return cdf + x * pdf;
  } else if constexpr (A == Activation::kSigmoid) {
    return y * (T(1) - y);
  } else if constexpr (A == Activation::kSilu) {
    const T s = T(1) / (T(1) + Exp(-x));
    return s * (T(1) + x * (T(1) - s));
  } else if constexpr (A == Activation::kRelu6) {
    return x > T(0) && x < T(6) ? T(1) : T(0);
  } else if constexpr (A == Activation::kHardsigmoid) {
    return x > T(-3) && x < T(3) ? T(1) / T(6) : T(0);
  } else if constexpr (A == Activation::kHardswish) {
    return x < T(-3) ? T(0) : (x <= T(3) ? x / T(3) + T(0.5) : T(1));
  } else if constexpr (A == Activation::kExp) {
    return y;
  } else if constexpr (A == Activation::kRsqrt) {
    return T(-0.5) * y * y * y;
  } else if constexpr (A == Activation::kLog) {
    return T(1) / x;
  } else {
    return T(1) - y * y;
  }
}

template <Activation A, typename T>
__global__ void ActivationKernel(const T* x, T* y, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) y[i] = ActF<A>(x[i]);
}

template <Activation A, typename T>
__global__ void ActivationGradKernel(const T* x, const T* y, const T* dy,
                                     T* dx, int64_t n) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const T yi = y != nullptr ? y[i] : ActF<A>(x[i]);
    dx[i] += dy[i] * ActD<A>(x[i], yi);
  }
}

template <typename T>
__global__ void ScaleKernel(T factor, const T* in, T* out, int64_t n,
                            bool accumulate) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const T v = factor * in[i];
    out[i] = accumulate ? out[i] + v : v;
  }
}

template <typename T>
__global__ void DropoutKernel(DropoutMask m, T scale, const T* in, T* out,
                              int64_t n, bool accumulate) {
  for (int64_t i = GridStart(); i < n; i += GridStep()) {
    const T v = DropoutKeeps(m, i) ? in[i] * scale : T(0);
    out[i] = accumulate ? out[i] + v : v;
  }
}

template <BinaryOp op, typename T>
__global__ void BinaryKernel(StridedSpace s, const T* p, const T* q, T* out) {
  for (int64_t i = GridStart(); i < s.count; i += GridStep()) {
    int64_t off[3];
    SpaceOffsets<3>(s, i, off);
    const T a = p != nullptr ? p[off[1]] : T(0);
    const T b = q != nullptr ? q[off[2]] : T(0);
    T v;
    if constexpr (op == BinaryOp::kAdd) {
      v = a + b;
    } else if constexpr (op == BinaryOp::kSub) {
      v = a - b;
    } else {
      v = a * b;
    }
    out[off[0]] = v;
  }
}

// One thread per output (ReducedSum: the reduced space row by row, its
// innermost dimension without divisions).
template <typename T>
__global__ void ReduceThreadKernel(ReduceSpace s, const T* a, const T* b,
                                   double scale, T* out, bool accumulate) {
  for (int64_t o = GridStart(); o < s.kept.count; o += GridStep()) {
    int64_t base[3];
    SpaceOffsets<3>(s.kept, o, base);
    const double acc = ReducedSum(s, a, b, base);
    const T v = static_cast<T>(acc * scale);
    out[base[0]] = accumulate ? out[base[0]] + v : v;
  }
}

// One block per output: threads take reduced elements k = tid, tid + 256,
// ...; a fixed-shape tree combines them.
template <typename T>
__global__ void ReduceBlockKernel(ReduceSpace s, const T* a, const T* b,
                                  double scale, T* out, bool accumulate) {
  __shared__ double part[kThreads];
  for (int64_t o = blockIdx.x; o < s.kept.count; o += gridDim.x) {
    int64_t base[3];
    SpaceOffsets<3>(s.kept, o, base);
    double acc = 0;
    for (int64_t k = threadIdx.x; k < s.reduced.count; k += blockDim.x) {
      int64_t off[3];
      SpaceOffsets<3>(s.reduced, k, off);
      double v = static_cast<double>(a[base[1] + off[1]]);
      if (b != nullptr) v *= static_cast<double>(b[base[2] + off[2]]);
      acc += v;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      const T v = static_cast<T>(part[0] * scale);
      out[base[0]] = accumulate ? out[base[0]] + v : v;
    }
    __syncthreads();  // part[] is reused by the next output
  }
}

// Stage 1 of a split reduction: block (c, o) sums chunk c of output o.
template <typename T>
__global__ void ReducePartialKernel(ReduceSpace s, ReduceSplit split,
                                    const T* a, const T* b, double* partial) {
  __shared__ double part[kThreads];
  const int64_t o = blockIdx.y, c = blockIdx.x;
  int64_t base[3];
  SpaceOffsets<3>(s.kept, o, base);
  const int64_t k0 = c * split.chunk_len;
  const int64_t k1 = k0 + split.chunk_len < s.reduced.count
                         ? k0 + split.chunk_len
                         : s.reduced.count;
  double acc = 0;
  for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
    int64_t off[3];
    SpaceOffsets<3>(s.reduced, k, off);
    double v = static_cast<double>(a[base[1] + off[1]]);
    if (b != nullptr) v *= static_cast<double>(b[base[2] + off[2]]);
    acc += v;
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[o * split.chunks + c] = part[0];
}

// Stage 2: one thread per output adds its partials in chunk order.
template <typename T>
__global__ void ReduceCombineKernel(ReduceSpace s, ReduceSplit split,
                                    const double* partial, double scale, T* out,
                                    bool accumulate) {
  for (int64_t o = GridStart(); o < s.kept.count; o += GridStep()) {
    int64_t base[3];
    SpaceOffsets<3>(s.kept, o, base);
    double acc = 0;
    for (int64_t c = 0; c < split.chunks; ++c) acc += partial[o * split.chunks + c];
    const T v = static_cast<T>(acc * scale);
    out[base[0]] = accumulate ? out[base[0]] + v : v;
  }
}

template <typename T, Activation A>
void ActivationAs(const T* x, T* y, int64_t n, cudaStream_t stream) {
  ActivationKernel<A, T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(x, y, n);
}

template <typename T, Activation A>
void ActivationGradAs(const T* x, const T* y, const T* dy, T* dx, int64_t n,
                      cudaStream_t stream) {
  ActivationGradKernel<A, T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(x, y, dy, dx, n);
}

}  // namespace

template <typename T>
void LaunchActivation(Activation act, const T* x, T* y, int64_t n,
                      cudaStream_t stream) {
  if (n <= 0) return;
  switch (act) {
    case Activation::kRelu:
      return ActivationAs<T, Activation::kRelu>(x, y, n, stream);
    case Activation::kGelu:
      return ActivationAs<T, Activation::kGelu>(x, y, n, stream);
    case Activation::kSigmoid:
      return ActivationAs<T, Activation::kSigmoid>(x, y, n, stream);
    case Activation::kTanh:
      return ActivationAs<T, Activation::kTanh>(x, y, n, stream);
    case Activation::kSilu:
      return ActivationAs<T, Activation::kSilu>(x, y, n, stream);
    case Activation::kRelu6:
      return ActivationAs<T, Activation::kRelu6>(x, y, n, stream);
    case Activation::kHardsigmoid:
      return ActivationAs<T, Activation::kHardsigmoid>(x, y, n, stream);
    case Activation::kHardswish:
      return ActivationAs<T, Activation::kHardswish>(x, y, n, stream);
    case Activation::kExp:
      return ActivationAs<T, Activation::kExp>(x, y, n, stream);
    case Activation::kRsqrt:
      return ActivationAs<T, Activation::kRsqrt>(x, y, n, stream);
    case Activation::kLog:
      return ActivationAs<T, Activation::kLog>(x, y, n, stream);
  }
}

template <typename T>
void LaunchActivationGrad(Activation act, const T* x, const T* y, const T* dy,
                          T* dx, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  switch (act) {
    case Activation::kRelu:
      return ActivationGradAs<T, Activation::kRelu>(x, y, dy, dx, n, stream);
    case Activation::kGelu:
      return ActivationGradAs<T, Activation::kGelu>(x, y, dy, dx, n, stream);
    case Activation::kSigmoid:
      return ActivationGradAs<T, Activation::kSigmoid>(x, y, dy, dx, n, stream);
    case Activation::kTanh:
      return ActivationGradAs<T, Activation::kTanh>(x, y, dy, dx, n, stream);
    case Activation::kSilu:
      return ActivationGradAs<T, Activation::kSilu>(x, y, dy, dx, n, stream);
    case Activation::kRelu6:
      return ActivationGradAs<T, Activation::kRelu6>(x, y, dy, dx, n, stream);
    case Activation::kHardsigmoid:
      return ActivationGradAs<T, Activation::kHardsigmoid>(x, y, dy, dx, n,
                                                           stream);
    case Activation::kHardswish:
      return ActivationGradAs<T, Activation::kHardswish>(x, y, dy, dx, n,
                                                         stream);
    case Activation::kExp:
      return ActivationGradAs<T, Activation::kExp>(x, y, dy, dx, n, stream);
    case Activation::kRsqrt:
      return ActivationGradAs<T, Activation::kRsqrt>(x, y, dy, dx, n, stream);
    case Activation::kLog:
      return ActivationGradAs<T, Activation::kLog>(x, y, dy, dx, n, stream);
  }
}

template <typename T>
void LaunchScale(T factor, const T* in, T* out, int64_t n, bool accumulate,
                 cudaStream_t stream) {
  if (n <= 0) return;
  ScaleKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(factor, in, out, n, accumulate);
}

template <typename T>
void LaunchDropout(const DropoutMask& mask, T scale, const T* in, T* out,
                   int64_t n, bool accumulate, cudaStream_t stream) {
  if (n <= 0) return;
  DropoutKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(mask, scale, in, out, n,
                                                       accumulate);
}

template <typename T>
void LaunchBinary(BinaryOp op, const StridedSpace& space, const T* p,
                  const T* q, T* out, cudaStream_t stream) {
  if (space.count <= 0) return;
  const unsigned blocks = BlocksFor(space.count, kThreads);
  switch (op) {
    case BinaryOp::kAdd:
      BinaryKernel<BinaryOp::kAdd, T><<<blocks, kThreads, 0, stream>>>(space, p, q, out);
      break;
    case BinaryOp::kSub:
      BinaryKernel<BinaryOp::kSub, T><<<blocks, kThreads, 0, stream>>>(space, p, q, out);
      break;
    case BinaryOp::kMul:
      BinaryKernel<BinaryOp::kMul, T><<<blocks, kThreads, 0, stream>>>(space, p, q, out);
      break;
  }
}

template <typename T>
void LaunchReduce(const ReduceSpace& space, const T* a, const T* b,
                  double scale, T* out, bool accumulate, cudaStream_t stream,
                  double* scratch) {
  const int64_t outs = space.kept.count, k = space.reduced.count;
  if (outs <= 0) return;
  const ReduceSplit split = SplitFor(space);
  if (scratch != nullptr && split.chunks > 1) {
    const dim3 grid(static_cast<unsigned>(split.chunks),
                    static_cast<unsigned>(outs));
    ReducePartialKernel<T><<<grid, kThreads, 0, stream>>>(space, split, a, b,
                                                          scratch);
    ReduceCombineKernel<T><<<BlocksFor(outs, kThreads), kThreads, 0, stream>>>(
        space, split, scratch, scale, out, accumulate);
    return;
  }
  const StridedSpace& r = space.reduced;
  // A contiguous innermost reduced dimension is read coalesced by a block;
  // otherwise many outputs are read coalesced by neighbouring threads.
  const bool inner_contiguous = r.rank > 0 && r.stride[1][r.rank - 1] == 1;
  const bool per_block =
      k >= 64 && (inner_contiguous || outs < 2048);
  if (per_block) {
    const unsigned blocks =
        static_cast<unsigned>(outs < 65535LL * 16 ? outs : 65535LL * 16);
    ReduceBlockKernel<T><<<blocks, kThreads, 0, stream>>>(space, a, b, scale,
                                                          out, accumulate);
  } else {
    ReduceThreadKernel<T><<<BlocksFor(outs, kThreads), kThreads, 0, stream>>>(
        space, a, b, scale, out, accumulate);
  }
}

#define HAP_INSTANTIATE(T)                                                    \
  template void LaunchActivation<T>(Activation, const T*, T*, int64_t,        \
                                    cudaStream_t);                            \
  template void LaunchActivationGrad<T>(Activation, const T*, const T*,       \
                                        const T*, T*, int64_t, cudaStream_t); \
  template void LaunchScale<T>(T, const T*, T*, int64_t, bool, cudaStream_t); \
  template void LaunchDropout<T>(const DropoutMask&, T, const T*, T*,         \
                                 int64_t, bool, cudaStream_t);                \
  template void LaunchBinary<T>(BinaryOp, const StridedSpace&, const T*,      \
                                const T*, T*, cudaStream_t);                  \
  template void LaunchReduce<T>(const ReduceSpace&, const T*, const T*,       \
                                double, T*, bool, cudaStream_t, double*);
HAP_INSTANTIATE(float)
HAP_INSTANTIATE(double)
#undef HAP_INSTANTIATE

}  // namespace hap::executor::cuda
