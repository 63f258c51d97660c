// The arithmetic of one LSTM cell element (PyTorch's nn.LSTM, gates i, f, g,
// o) and one GRU cell element (nn.GRU, gates r, z, n), shared by the CPU kernels and the CUDA
// kernels' device code: plain C++, no Abseil, annotated for nvcc. T is float or double; exp and
// tanh are the standard ones (not the CPU's fast float exp) so both backends agree.
#ifndef HAP_EXECUTOR_CPU_LSTM_CELL_H_
#define HAP_EXECUTOR_CPU_LSTM_CELL_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define HAP_LSTM_HD __host__ __device__
#else
#define HAP_LSTM_HD
#endif

namespace hap::executor::lstm {

// exp and tanh in T: CUDA's overloads on the device, std's on the host.
template <typename T>
HAP_LSTM_HD inline T Exp(T x) {
#if defined(__CUDA_ARCH__)
  return exp(x);
#else
  return std::exp(x);
#endif
}
template <typename T>
HAP_LSTM_HD inline T Tanh(T x) {
#if defined(__CUDA_ARCH__)
  return tanh(x);
#else
  return std::tanh(x);
#endif
}
template <typename T>
HAP_LSTM_HD inline T Sigmoid(T x) {
  return T(1) / (T(1) + Exp(-x));
}

// Hidden unit j of one sample at one step. `gates` holds the sample's 4h
// pre-activations (x W_ih^T + h_prev W_hh^T + biases) and is overwritten
// with the activations (i, f, g, o), which the backward reads. c_prev is 0
// at the sequence's first step. Writes the cell state and the hidden state.
template <typename T>
HAP_LSTM_HD inline void CellForward(T* gates, int64_t h, int64_t j, T c_prev, T* c, T* y) {
  const T i = Sigmoid(gates[j]);
  const T f = Sigmoid(gates[h + j]);
  const T g = Tanh(gates[2 * h + j]);
  const T o = Sigmoid(gates[3 * h + j]);
  gates[j] = i;
  gates[h + j] = f;
  gates[2 * h + j] = g;
  gates[3 * h + j] = o;
  const T cn = f * c_prev + i * g;
  *c = cn;
  *y = o * Tanh(cn);
}

// The backward of CellForward for unit j: from the activations `act` (4h),
// the cell state c and c_prev, the gradient reaching the hidden state (dh:
// the output's gradient plus the next step's recurrent one) and the next
// step's cell-state gradient dc_next (0 at the last step), writes the
// pre-activation gradients of the four gates into `dgates` (4h) and returns
// the gradient of c_prev.
template <typename T>
HAP_LSTM_HD inline T CellBackward(const T* act, int64_t h, int64_t j, T c, T c_prev, T dh,
                                  T dc_next, T* dgates) {
  const T i = act[j], f = act[h + j], g = act[2 * h + j], o = act[3 * h + j];
  const T tc = Tanh(c);
  const T dc = dh * o * (T(1) - tc * tc) + dc_next;
  dgates[j] = dc * g * i * (T(1) - i);
  dgates[h + j] = dc * c_prev * f * (T(1) - f);
  dgates[2 * h + j] = dc * i * (T(1) - g * g);
  dgates[3 * h + j] = dh * tc * o * (T(1) - o);
  return dc * f;
}

// GRU hidden unit j of one sample at one step (PyTorch's nn.GRU):
//   r = sigmoid(xg_r + hg_r), z = sigmoid(xg_z + hg_z),
//   n = tanh(xg_n + r * hg_n), h' = (1 - z) * n + z * h_prev,
// xg the sample's 3h input pre-activations (x W_ih^T + b_ih), hg its hidden
// projection h_prev W_hh^T (null at the first step: zero) plus b_hh (null:
// zero). Overwrites xg with (r, z, n), which the backward reads, and writes
// hg_n (hn, which the backward needs too: r multiplies it) and h'.
template <typename T>
HAP_LSTM_HD inline void GruCellForward(T* xg, const T* hg, const T* b_hh, int64_t h, int64_t j,
                                       T h_prev, T* hn, T* y) {
  T hr = hg != nullptr ? hg[j] : T(0), hz = hg != nullptr ? hg[h + j] : T(0);
  T hnv = hg != nullptr ? hg[2 * h + j] : T(0);
  if (b_hh != nullptr) {
    hr += b_hh[j];
    hz += b_hh[h + j];
    hnv += b_hh[2 * h + j];
  }
  const T r = Sigmoid(xg[j] + hr);
  const T z = Sigmoid(xg[h + j] + hz);
  const T n = Tanh(xg[2 * h + j] + r * hnv);
  xg[j] = r;
  xg[h + j] = z;
  xg[2 * h + j] = n;
  *hn = hnv;
  *y = n + z * (h_prev - n);
}

// The backward of GruCellForward for unit j: from the activations `act`
// (3h: r, z, n), hn, h_prev (0 at the first step) and the gradient reaching
// h' (dh: the output's plus the next step's recurrent one), writes the
// gradients of the input pre-activations (dxg, 3h) and of the hidden
// projection (dhg, 3h: also b_hh's) and returns the part of h_prev's
// gradient that does not go through W_hh (dh * z).
template <typename T>
HAP_LSTM_HD inline T GruCellBackward(const T* act, int64_t h, int64_t j, T hn, T h_prev, T dh,
                                     T* dxg, T* dhg) {
  const T r = act[j], z = act[h + j], n = act[2 * h + j];
  const T dn = dh * (T(1) - z) * (T(1) - n * n);
  const T dr = dn * hn * r * (T(1) - r);
  const T dz = dh * (h_prev - n) * z * (T(1) - z);
  dxg[j] = dr;
  dxg[h + j] = dz;
  dxg[2 * h + j] = dn;
  dhg[j] = dr;
  dhg[h + j] = dz;
  dhg[2 * h + j] = dn * r;
  return dh * z;
}

}  // namespace hap::executor::lstm

#endif  // HAP_EXECUTOR_CPU_LSTM_CELL_H_
