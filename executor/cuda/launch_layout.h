// Internal to executor/cuda: launchers of the layout kernels
// (kernels_layout.cu): strided and blocked copies, and the embedding lookup
// and its gradient. Every launcher enqueues on `stream` and returns; launch
// errors are read by CheckLaunch. Data movement takes T in {float, double,
// int32_t, int64_t}; accumulation and the embedding take float or double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_LAYOUT_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_LAYOUT_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "executor/cuda/launch_common.h"

namespace hap::executor::cuda {

// dst (+)= src element by element over `space` (operands: 0 dst, 1 src).
// Distinct elements of the space must be distinct elements of dst (no
// reduction: that is LaunchReduce).
template <typename T>
void LaunchStridedCopy(const StridedSpace& space, const T* src, T* dst,
                       bool accumulate, cudaStream_t stream);

// For each o < outer: dst[(o * dst_len + dst_at) * inner + i] (+)=
// src[(o * src_len + src_at) * inner + i] for i < n * inner (blocks along
// one axis: concat, split, slice).
template <typename T>
void LaunchAxisCopy(int64_t outer, int64_t inner, const T* src, int64_t src_len,
                    int64_t src_at, T* dst, int64_t dst_len, int64_t dst_at,
                    int64_t n, bool accumulate, cudaStream_t stream);

// dst[i] += src[i], i < n.
template <typename T>
void LaunchAccumulate(const T* src, T* dst, int64_t n, cudaStream_t stream);

// Where a kernel reports an id it cannot use (kernels_internal.h
// DeviceFault): *word = code if still 0; word may be null.
struct FaultWord {
  int* word = nullptr;
  int code = 0;
};

// The embedding lookup: y[i, :] = table[ids[i] - offset, :] for ids whose
// row is in [0, rows), else zeros; ids outside [0, vocab) also raise
// `fault`. I is int32_t or int64_t.
template <typename T, typename I>
void LaunchEmbedding(const I* ids, int64_t n, const T* table, int64_t rows,
                     int64_t d, int64_t offset, int64_t vocab, T* y,
                     FaultWord fault, cudaStream_t stream);

// Scratch bytes LaunchEmbeddingGrad needs for n ids over `rows` rows.
size_t EmbeddingGradScratchBytes(int64_t n, int64_t rows);

// dtable[r, :] += sum of dy[i, :] over the ids i of row r (offset as the
// lookup), deterministically: the ids are stably sorted by row (CUB radix
// sort in `scratch`) and each row's gradient rows are summed in position
// order. Returns the error of the sort, if any.
template <typename T, typename I>
cudaError_t LaunchEmbeddingGrad(const I* ids, int64_t n, const T* dy,
                                int64_t rows, int64_t d, int64_t offset,
                                int64_t vocab, T* dtable, void* scratch,
                                size_t scratch_bytes, FaultWord fault,
                                cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_LAYOUT_H_
