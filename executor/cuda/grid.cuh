// Internal to executor/cuda: the launch sizes and grid-stride loop bounds
// every kernel family uses (.cu files only).
#ifndef HAP_EXECUTOR_CUDA_GRID_CUH_
#define HAP_EXECUTOR_CUDA_GRID_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace hap::executor::cuda::dev {

// Threads per block of the element-wise kernels.
inline constexpr int kThreads = 256;
// Blocks at most per launch of a grid-stride kernel.
inline constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// A grid-stride loop: for (i = GridStart(); i < n; i += GridStep()).
__device__ inline int64_t GridStart() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t GridStep() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Blocks for n items at `per_block` items a block (at least 1, at most
// kMaxBlocks: the kernels stride over the rest).
inline unsigned BlocksFor(int64_t n, int64_t per_block) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > kMaxBlocks) b = kMaxBlocks;
  return static_cast<unsigned>(b);
}

}  // namespace hap::executor::cuda::dev

#endif  // HAP_EXECUTOR_CUDA_GRID_CUH_
