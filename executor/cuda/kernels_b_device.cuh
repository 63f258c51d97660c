// Internal to executor/cuda: device helpers shared by the layout,
// normalization, convolution and MoE kernels (.cu files only): grid-stride
// loops, launch sizes, block-wide reductions, the accumulation type.
#ifndef HAP_EXECUTOR_CUDA_KERNELS_B_DEVICE_CUH_
#define HAP_EXECUTOR_CUDA_KERNELS_B_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

namespace hap::executor::cuda::dev {

// Threads per block of the element-wise kernels.
inline constexpr int kThreads = 256;
// Blocks at most per launch of a grid-stride kernel.
inline constexpr int64_t kMaxBlocks = int64_t{1} << 20;

__device__ inline int64_t GridStart() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t GridStep() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Blocks for n items at `per_block` items a block (at least 1).
inline unsigned BlocksFor(int64_t n, int64_t per_block) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > kMaxBlocks) b = kMaxBlocks;
  return static_cast<unsigned>(b);
}

// Accumulation type: float sums in float, double in double.
template <typename T>
struct Acc {
  using type = T;
};

struct SumOp {
  template <typename A>
  __device__ A operator()(const A& x, const A& y) const {
    return x + y;
  }
};
// NaN-free maximum, as the CPU's MaxOf (a NaN is kept only if first).
struct MaxOp {
  template <typename A>
  __device__ A operator()(const A& x, const A& y) const {
    return y > x ? y : x;
  }
};

// A reduction over the block whose result every thread gets. Call it from
// every thread of a block of kBlock threads; it synchronizes the block
// (twice), so the storage may be reused by the next call.
template <typename A, int kBlock>
struct BlockAll {
  using Reduce = cub::BlockReduce<A, kBlock>;
  struct Storage {
    typename Reduce::TempStorage tmp;
    A result;
  };
  template <typename Op>
  __device__ static A Run(A v, Op op, Storage& s) {
    A r = Reduce(s.tmp).Reduce(v, op);
    if (threadIdx.x == 0) s.result = r;
    __syncthreads();
    r = s.result;
    __syncthreads();
    return r;
  }
};

}  // namespace hap::executor::cuda::dev

#endif  // HAP_EXECUTOR_CUDA_KERNELS_B_DEVICE_CUH_
