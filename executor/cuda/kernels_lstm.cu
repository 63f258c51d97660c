// Device code of the LSTM and GRU kernels (launch_lstm.h); the cell arithmetic is
// executor/cpu/lstm_cell.h, the CPU's own.
#include "executor/cpu/lstm_cell.h"
#include "executor/cuda/kernels_b_device.cuh"
#include "executor/cuda/launch_lstm.h"

namespace hap::executor::cuda {
namespace {

using dev::BlocksFor;
using dev::GridStart;
using dev::GridStep;
using dev::kThreads;

template <typename T>
__global__ void BiasKernel(int64_t rows, int64_t g4, const T* b_ih, const T* b_hh, T* gates) {
  for (int64_t e = GridStart(); e < rows * g4; e += GridStep()) {
    const int64_t col = e % g4;
    T v = T(0);
    if (b_ih != nullptr) v += b_ih[col];
    if (b_hh != nullptr) v += b_hh[col];
    gates[e] += v;
  }
}

template <typename T>
__global__ void CellForwardKernel(LstmShape d, int64_t t, int64_t tp, bool has_prev, T* gates, T* c,
                                  T* y) {
  for (int64_t e = GridStart(); e < d.b * d.h; e += GridStep()) {
    const int64_t n = e / d.h, j = e - n * d.h;
    const int64_t r = n * d.s + t;
    const T c_prev = has_prev ? c[(n * d.s + tp) * d.h + j] : T(0);
    lstm::CellForward<T>(gates + r * 4 * d.h, d.h, j, c_prev, c + r * d.h + j, y + r * d.h + j);
  }
}

template <typename T>
__global__ void CellBackwardKernel(LstmShape d, int64_t t, int64_t tp, bool has_prev, bool has_next,
                                   const T* act, const T* c, const T* dy, const T* dh_next,
                                   T* dc_next, T* dgates) {
  for (int64_t e = GridStart(); e < d.b * d.h; e += GridStep()) {
    const int64_t n = e / d.h, j = e - n * d.h;
    const int64_t r = n * d.s + t;
    const T dh = dy[r * d.h + j] + (has_next ? dh_next[e] : T(0));
    const T dc = has_next ? dc_next[e] : T(0);
    const T c_prev = has_prev ? c[(n * d.s + tp) * d.h + j] : T(0);
    dc_next[e] = lstm::CellBackward<T>(act + r * 4 * d.h, d.h, j, c[r * d.h + j], c_prev, dh, dc,
                                       dgates + r * 4 * d.h);
  }
}

template <typename T>
__global__ void GruCellForwardKernel(LstmShape d, int64_t t, int64_t tp, bool has_prev, const T* hg,
                                     const T* b_hh, T* xg, T* hn, T* y) {
  for (int64_t e = GridStart(); e < d.b * d.h; e += GridStep()) {
    const int64_t n = e / d.h, j = e - n * d.h;
    const int64_t r = n * d.s + t;
    const T h_prev = has_prev ? y[(n * d.s + tp) * d.h + j] : T(0);
    lstm::GruCellForward<T>(xg + r * 3 * d.h, has_prev ? hg + n * 3 * d.h : nullptr, b_hh, d.h, j,
                            h_prev, hn + r * d.h + j, y + r * d.h + j);
  }
}

template <typename T>
__global__ void GruCellBackwardKernel(LstmShape d, int64_t t, int64_t tp, bool has_prev,
                                      bool has_next, const T* act, const T* hn, const T* y,
                                      const T* dy, T* dh_next, T* dxg, T* dhg) {
  for (int64_t e = GridStart(); e < d.b * d.h; e += GridStep()) {
    const int64_t n = e / d.h, j = e - n * d.h;
    const int64_t r = n * d.s + t;
    const T dh = dy[r * d.h + j] + (has_next ? dh_next[e] : T(0));
    const T h_prev = has_prev ? y[(n * d.s + tp) * d.h + j] : T(0);
    dh_next[e] = lstm::GruCellBackward<T>(act + r * 3 * d.h, d.h, j, hn[r * d.h + j], h_prev, dh,
                                          dxg + r * 3 * d.h, dhg + r * 3 * d.h);
  }
}

template <typename T>
__global__ void PreviousHiddenKernel(LstmShape d, const T* y, T* h_prev) {
  for (int64_t e = GridStart(); e < d.b * d.s * d.h; e += GridStep()) {
    const int64_t j = e % d.h, r = e / d.h;
    const int64_t n = r / d.s, t = r - n * d.s;
    const bool first = d.reverse ? t == d.s - 1 : t == 0;
    const int64_t tp = d.reverse ? t + 1 : t - 1;
    h_prev[e] = first ? T(0) : y[(n * d.s + tp) * d.h + j];
  }
}

template <typename T>
__global__ void ColumnSumsKernel(int64_t rows, int64_t cols, const T* m, T* out) {
  for (int64_t col = GridStart(); col < cols; col += GridStep()) {
    double acc = 0;
    for (int64_t r = 0; r < rows; ++r) acc += static_cast<double>(m[r * cols + col]);
    out[col] += static_cast<T>(acc);
  }
}

}  // namespace

template <typename T>
void LaunchLstmBias(int64_t rows, int64_t g4, const T* b_ih, const T* b_hh, T* gates,
                    cudaStream_t stream) {
  if (rows * g4 == 0 || (b_ih == nullptr && b_hh == nullptr)) return;
  BiasKernel<T>
      <<<BlocksFor(rows * g4, kThreads), kThreads, 0, stream>>>(rows, g4, b_ih, b_hh, gates);
}

template <typename T>
void LaunchLstmCellForward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, T* gates, T* c,
                           T* y, cudaStream_t stream) {
  if (d.b * d.h == 0) return;
  CellForwardKernel<T>
      <<<BlocksFor(d.b * d.h, kThreads), kThreads, 0, stream>>>(d, t, tp, has_prev, gates, c, y);
}

template <typename T>
void LaunchLstmCellBackward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, bool has_next,
                            const T* act, const T* c, const T* dy, const T* dh_next, T* dc_next,
                            T* dgates, cudaStream_t stream) {
  if (d.b * d.h == 0) return;
  CellBackwardKernel<T><<<BlocksFor(d.b * d.h, kThreads), kThreads, 0, stream>>>(
      d, t, tp, has_prev, has_next, act, c, dy, dh_next, dc_next, dgates);
}

template <typename T>
void LaunchGruCellForward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, const T* hg,
                          const T* b_hh, T* xg, T* hn, T* y, cudaStream_t stream) {
  if (d.b * d.h == 0) return;
  GruCellForwardKernel<T><<<BlocksFor(d.b * d.h, kThreads), kThreads, 0, stream>>>(
      d, t, tp, has_prev, hg, b_hh, xg, hn, y);
}

template <typename T>
void LaunchGruCellBackward(const LstmShape& d, int64_t t, int64_t tp, bool has_prev, bool has_next,
                           const T* act, const T* hn, const T* y, const T* dy, T* dh_next, T* dxg,
                           T* dhg, cudaStream_t stream) {
  if (d.b * d.h == 0) return;
  GruCellBackwardKernel<T><<<BlocksFor(d.b * d.h, kThreads), kThreads, 0, stream>>>(
      d, t, tp, has_prev, has_next, act, hn, y, dy, dh_next, dxg, dhg);
}

template <typename T>
void LaunchLstmPreviousHidden(const LstmShape& d, const T* y, T* h_prev, cudaStream_t stream) {
  const int64_t n = d.b * d.s * d.h;
  if (n == 0) return;
  PreviousHiddenKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(d, y, h_prev);
}

template <typename T>
void LaunchColumnSums(int64_t rows, int64_t cols, const T* m, T* out, cudaStream_t stream) {
  if (cols == 0) return;
  ColumnSumsKernel<T><<<BlocksFor(cols, kThreads), kThreads, 0, stream>>>(rows, cols, m, out);
}

#define HAP_INSTANTIATE(T)                                                                     \
  template void LaunchLstmBias<T>(int64_t, int64_t, const T*, const T*, T*, cudaStream_t);     \
  template void LaunchLstmCellForward<T>(const LstmShape&, int64_t, int64_t, bool, T*, T*, T*, \
                                         cudaStream_t);                                        \
  template void LaunchLstmCellBackward<T>(const LstmShape&, int64_t, int64_t, bool, bool,      \
                                          const T*, const T*, const T*, const T*, T*, T*,      \
                                          cudaStream_t);                                       \
  template void LaunchGruCellForward<T>(const LstmShape&, int64_t, int64_t, bool, const T*,   \
                                        const T*, T*, T*, T*, cudaStream_t);                   \
  template void LaunchGruCellBackward<T>(const LstmShape&, int64_t, int64_t, bool, bool,       \
                                         const T*, const T*, const T*, const T*, T*, T*, T*,   \
                                         cudaStream_t);                                        \
  template void LaunchLstmPreviousHidden<T>(const LstmShape&, const T*, T*, cudaStream_t);     \
  template void LaunchColumnSums<T>(int64_t, int64_t, const T*, T*, cudaStream_t);
HAP_INSTANTIATE(float)
HAP_INSTANTIATE(double)
#undef HAP_INSTANTIATE

}  // namespace hap::executor::cuda
