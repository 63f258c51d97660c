// Internal to executor/cuda: launchers of nll_loss and cross_entropy and
// their gradients (kernels_loss.cu). T is float or double, I (targets)
// int32_t or int64_t. A target outside [0, classes) sets *fault to
// fault_code (if 0; fault may be null) and its row is skipped.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_LOSS_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_LOSS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace hap::executor::cuda {

struct LossShape {
  int64_t rows = 0, classes = 0;
  double inv_rows = 1;  // 1 / global_rows
  int* fault = nullptr;
  int fault_code = 0;
};

// out[0] = inv_rows * sum over rows of (logits ? logsumexp(x_i) - x_i[t_i]
// : -x_i[t_i]), summed in double in a fixed order; `row_loss` is scratch
// for `rows` doubles.
template <typename T, typename I>
void LaunchLossForward(bool logits, const LossShape& s, const T* x,
                       const I* targets, double* row_loss, T* out,
                       cudaStream_t stream);

// With scale = dy[0] * inv_rows: logits: dx_i += scale * softmax(x_i);
// then dx_i[t_i] -= scale.
template <typename T, typename I>
void LaunchLossBackward(bool logits, const LossShape& s, const T* x,
                        const I* targets, const T* dy, T* dx,
                        cudaStream_t stream);

// Cross-entropy over logits sharded by class (executor/cpu/kernels_loss.cc
// "cross_entropy_lse", "cross_entropy_sharded" and its gradient): this
// rank holds classes [offset, offset + classes) of `vocab`; `lse` is every
// rank's row log-sum-exp, rank-major ([ranks * rows]). A target outside
// [0, vocab) is reported as above.
struct ShardedLossShape {
  LossShape base;  // rows, classes (this rank's), inv_rows, fault
  int64_t offset = 0, vocab = 0, rank = 0, ranks = 1;
};
template <typename T>
void LaunchShardedLse(const ShardedLossShape& s, const T* x, T* out,
                      cudaStream_t stream);
template <typename T, typename I>
void LaunchShardedLossForward(const ShardedLossShape& s, const T* x,
                              const I* targets, const T* lse, double* row_loss,
                              T* out, cudaStream_t stream);
template <typename T, typename I>
void LaunchShardedLossBackward(const ShardedLossShape& s, const T* x,
                               const I* targets, const T* lse, const T* dy,
                               T* dx, cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_LOSS_H_
