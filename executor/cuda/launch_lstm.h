// Internal to executor/cuda: launchers of the LSTM and GRU kernels
// (kernels_lstm.cu),
// the element-wise parts of executor/cpu/kernels_lstm.cc (its GEMMs run on
// cuBLAS from kernels_lstm.cc). Tensors are row-major: x [b, s, in], gates
// [b, s, 4h] (pre-activations, then activations), c and y [b, s, h]. Every
// launcher enqueues on `stream` and returns; launch errors are read by
// CheckLaunch. T is float or double.
#ifndef HAP_EXECUTOR_CUDA_LAUNCH_LSTM_H_
#define HAP_EXECUTOR_CUDA_LAUNCH_LSTM_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace hap::executor::cuda {

struct LstmShape {
  int64_t b = 0, s = 0, h = 0;
  bool reverse = false;
};

// gates[r, :] += b_ih + b_hh for every row r < rows (a null bias is zero).
template <typename T>
void LaunchLstmBias(int64_t rows, int64_t gates_per_row, const T* b_ih, const T* b_hh, T* gates,
                    cudaStream_t stream);

// Step t of every sample (lstm_cell.h CellForward): gates at t turn into
// activations, c and y at t are written; `tp` is the step read before it
// (its c), absent (c_prev = 0) when `has_prev` is false.
template <typename T>
void LaunchLstmCellForward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, T* gates, T* c,
                           T* y, cudaStream_t stream);

// Step t of every sample backwards (lstm_cell.h CellBackward): dh = dy at t
// + dh_next, dc_next in, the gate gradients at t out into dgates, and
// dc_next replaced by the gradient of c at tp. Without `has_next` (the last
// step read) dh_next and dc_next are taken as 0 (not read).
template <typename T>
void LaunchLstmCellBackward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, bool has_next,
                            const T* act, const T* c, const T* dy, const T* dh_next, T* dc_next,
                            T* dgates, cudaStream_t stream);

// h_prev[b, t] = the hidden state step t read: y at the step before it in
// reading order, 0 at the first.
template <typename T>
void LaunchLstmPreviousHidden(const LstmShape& d, const T* y, T* h_prev, cudaStream_t stream);

// GRU step t of every sample (lstm_cell.h GruCellForward): xg at t (3h:
// x W_ih^T + b_ih) turns into the activations, hn and y at t are written;
// hg [b, 3h] holds h_prev W_hh^T (read only with `has_prev`, y at tp the
// h_prev), b_hh may be null.
template <typename T>
void LaunchGruCellForward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, const T* hg,
                          const T* b_hh, T* xg, T* hn, T* y, cudaStream_t stream);

// GRU step t of every sample backwards (lstm_cell.h GruCellBackward): dh =
// dy at t + dh_next (taken as 0 without `has_next`); the gradients of the
// input pre-activations and of the hidden projection at t out into dxg and
// dhg, and dh_next replaced by dh * z (h_prev's gradient but the part
// through W_hh, which the caller adds).
template <typename T>
void LaunchGruCellBackward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, bool has_next,
                           const T* act, const T* hn, const T* y, const T* dy, T* dh_next, T* dxg,
                           T* dhg, cudaStream_t stream);

// out[col] += the sum over rows of m[row, col] (in double), m [rows, cols].
template <typename T>
void LaunchColumnSums(int64_t rows, int64_t cols, const T* m, T* out, cudaStream_t stream);

}  // namespace hap::executor::cuda

#endif  // HAP_EXECUTOR_CUDA_LAUNCH_LSTM_H_
