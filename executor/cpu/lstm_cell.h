// The arithmetic of one LSTM cell element (PyTorch's nn.LSTM, gates i, f, g,
// o), shared by the CPU kernels and the CUDA kernels' device code: plain
// C++, no Abseil, annotated for nvcc. T is float or double; exp and tanh are
// the standard ones (not the CPU's fast float exp) so both backends agree.
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

}  // namespace hap::executor::lstm

#endif  // HAP_EXECUTOR_CPU_LSTM_CELL_H_
