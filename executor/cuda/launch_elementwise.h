// Internal to executor/cuda: launchers of the element-wise, broadcasting and
// reduction kernels (kernels_elementwise.cu). Every launcher enqueues on
// `stream` and returns; launch errors are read by CheckLaunch. T is float or
// double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_ELEMENTWISE_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_ELEMENTWISE_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/cuda/launch_common.h"
#include "executor/runtime/counter_random.h"

namespace hap::executor::cuda {

enum class Activation {
  kRelu,
  kGelu,
  kSigmoid,
  kTanh,
  kSilu,
  kRelu6,
  kHardsigmoid,
  kHardswish,
  kExp,
  kRsqrt,
  kLog
};

// y = F(x) over n elements.
template <typename T>
void LaunchActivation(Activation act, const T* x, T* y, int64_t n,
                      cudaStream_t stream);
// dx += dy * F'(x) (from y = F(x) when y is not null).
template <typename T>
void LaunchActivationGrad(Activation act, const T* x, const T* y, const T* dy,
                          T* dx, int64_t n, cudaStream_t stream);

// out (+)= factor * in over n elements.
template <typename T>
void LaunchScale(T factor, const T* in, T* out, int64_t n, bool accumulate,
                 cudaStream_t stream);

// Dropout's mask (executor/cpu/kernels.h): local element i, at local index
// idx (row-major over `local`), has global flat index
// g = sum_d (idx_d + offsets_d) * global_strides_d and is kept iff
// CounterUniform(key, g) >= p.
struct DropoutMask {
  double p = 0;
  uint64_t key = 0;
  int rank = 0;
  int64_t local[kMaxDims] = {};
  int64_t offsets[kMaxDims] = {};
  int64_t global_strides[kMaxDims] = {};
};
// Whether local element i (row-major over m.local) is kept.
HAP_CUDA_HD inline bool DropoutKeeps(const DropoutMask& m, int64_t i) {
  int64_t g = 0;
  for (int d = m.rank - 1; d >= 0; --d) {
    const int64_t idx = i % m.local[d];
    i /= m.local[d];
    g += (idx + m.offsets[d]) * m.global_strides[d];
  }
  return CounterUniform(m.key, static_cast<uint64_t>(g)) >= m.p;
}

// out (+)= keep ? in * scale : 0 over n elements.
template <typename T>
void LaunchDropout(const DropoutMask& mask, T scale, const T* in, T* out,
                   int64_t n, bool accumulate, cudaStream_t stream);

enum class BinaryOp { kAdd, kSub, kMul };
// out = p op q over `space` (operands: 0 out, 1 p, 2 q); a null p or q reads
// as 0.
template <typename T>
void LaunchBinary(BinaryOp op, const StridedSpace& space, const T* p,
                  const T* q, T* out, cudaStream_t stream);

// out[o] (+)= scale * sum a * b (ReduceSpace), summed in double in a fixed
// order (deterministic). b may be null (1). `scratch`, when not null, holds
// ReduceScratchDoubles(space) doubles (launch_common.h): a long reduction over few outputs is
// then split across blocks (SplitFor); null: always one pass.
template <typename T>
void LaunchReduce(const ReduceSpace& space, const T* a, const T* b,
                  double scale, T* out, bool accumulate, cudaStream_t stream,
                  double* scratch = nullptr);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_ELEMENTWISE_H_
