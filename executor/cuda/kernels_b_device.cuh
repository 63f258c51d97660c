// Internal to executor/cuda: device helpers shared by the layout,
// normalization, convolution and MoE kernels (.cu files only): block-wide
// reductions, the accumulation type, and (grid.cuh) launch sizes.
#ifndef HAP_EXECUTOR_CUDA_KERNELS_B_DEVICE_CUH_
#define HAP_EXECUTOR_CUDA_KERNELS_B_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "executor/cuda/grid.cuh"

namespace hap::executor::cuda::dev {

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
