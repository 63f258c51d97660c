// Element-wise kernels: activations, dropout, scale, and the broadcasting
// binary arithmetic (add, sub, mul).
#include <cmath>

#include "common/status_macros.h"
#include "executor/cpu/kernels_internal.h"
#include "executor/cpu/kernels_simd.h"
#include "executor/runtime/random.h"

namespace hap::executor::cpu {
namespace {

// --- activations ----------------------------------------------------------------
// Each has the value F(x) and the derivative D(x, y) given x and y = F(x).

struct Relu {
  template <typename T>
  static T F(T x) {
    return x < T(0) ? T(0) : x;  // NaN propagates, as in PyTorch
  }
  template <typename T>
  static T D(T x, T) {
    return x > T(0) ? T(1) : T(0);
  }
};

// Gelu's float loops run simd::FloatRows::gelu and gelu_grad
// (kernels_simd.h): these expressions, bit for bit.
struct Gelu {  // exact (erf) form: x * Phi(x)
  template <typename T>
  static T F(T x) {
    return T(0.5) * x * (T(1) + Erf<T>(x * T(M_SQRT1_2)));
  }
  template <typename T>
  static T D(T x, T) {
    const T cdf = T(0.5) * (T(1) + Erf<T>(x * T(M_SQRT1_2)));
    const T pdf = Exp<T>(T(-0.5) * x * x) * T(0.3989422804014327);
    return cdf + x * pdf;
  }
};

struct Sigmoid {
  template <typename T>
  static T F(T x) {
    return T(1) / (T(1) + Exp<T>(-x));
  }
  template <typename T>
  static T D(T, T y) {
    return y * (T(1) - y);
  }
};

struct Tanh {
  template <typename T>
  static T F(T x) {
    return std::tanh(x);
  }
  template <typename T>
  static T D(T, T y) {
    return T(1) - y * y;
  }
};

struct Silu {  // x * sigmoid(x)
  template <typename T>
  static T F(T x) {
    return x / (T(1) + Exp<T>(-x));
  }
  template <typename T>
  static T D(T x, T) {
    const T s = T(1) / (T(1) + Exp<T>(-x));
    return s * (T(1) + x * (T(1) - s));
  }
};

struct Relu6 {  // PyTorch's hardtanh(x, 0, 6): NaN propagates
  template <typename T>
  static T F(T x) {
    return x < T(0) ? T(0) : (x > T(6) ? T(6) : x);
  }
  template <typename T>
  static T D(T x, T) {
    return x > T(0) && x < T(6) ? T(1) : T(0);
  }
};

// PyTorch's hardsigmoid and hardswish (their backward's boundaries too).
struct Hardsigmoid {  // relu6(x + 3) / 6
  template <typename T>
  static T F(T x) {
    return Relu6::F<T>(x + T(3)) / T(6);
  }
  template <typename T>
  static T D(T x, T) {
    return x > T(-3) && x < T(3) ? T(1) / T(6) : T(0);
  }
};

struct Hardswish {  // x * relu6(x + 3) / 6
  template <typename T>
  static T F(T x) {
    return x * Relu6::F<T>(x + T(3)) / T(6);
  }
  template <typename T>
  static T D(T x, T) {
    return x < T(-3) ? T(0) : (x <= T(3) ? x / T(3) + T(0.5) : T(1));
  }
};

struct ExpOp {  // e^x, its own derivative
  template <typename T>
  static T F(T x) {
    return Exp<T>(x);
  }
  template <typename T>
  static T D(T, T y) {
    return y;
  }
};

struct Rsqrt {  // 1 / sqrt(x): d/dx = -y^3 / 2
  template <typename T>
  static T F(T x) {
    return T(1) / std::sqrt(x);
  }
  template <typename T>
  static T D(T, T y) {
    return T(-0.5) * y * y * y;
  }
};

struct Log {  // natural log: d/dx = 1 / x
  template <typename T>
  static T F(T x) {
    return std::log(x);
  }
  template <typename T>
  static T D(T x, T) {
    return T(1) / x;
  }
};

// The element loops take their pointers as parameters so that they
// vectorize (pointers captured by a lambda are reloaded every iteration).
template <typename Act, typename T>
void ActivationRange(const T* x, T* y, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) y[i] = Act::F(x[i]);
}

template <typename Act, typename T>
void ActivationGradRange(const T* x, const T* y, const T* dy, T* dx, int64_t b,
                         int64_t e) {
  if (y != nullptr) {
    for (int64_t i = b; i < e; ++i) dx[i] += dy[i] * Act::D(x[i], y[i]);
  } else {
    for (int64_t i = b; i < e; ++i) dx[i] += dy[i] * Act::D(x[i], Act::F(x[i]));
  }
}

template <typename Act, typename T>
absl::Status UnaryForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckElementwise(a, t));
  const T* x = a.in[0].as<const T>();
  T* y = a.out[0].as<T>();
  ParallelFor(a.ctx.num_threads, a.in[0].num_elements(), kParallelWork,
              [&](int64_t b, int64_t e) {
                if constexpr (std::is_same_v<Act, Gelu> &&
                              std::is_same_v<T, float>) {
                  simd::Rows().gelu(x + b, e - b, y + b);
                } else {
                  ActivationRange<Act>(x, y, b, e);
                }
              });
  return absl::OkStatus();
}

template <typename Act, typename T>
absl::Status UnaryBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Elementwise(a, t));
  if (!g.active()) return absl::OkStatus();
  const T* x = g.x(0).as<const T>();
  const T* y = g.y(0).present() ? g.y(0).as<const T>() : nullptr;
  const T* dy = g.dy(0).as<const T>();
  T* dx = g.dx(0).as<T>();
  ParallelFor(a.ctx.num_threads, g.x(0).num_elements(), kParallelWork,
              [&](int64_t b, int64_t e) {
                if constexpr (std::is_same_v<Act, Gelu> &&
                              std::is_same_v<T, float>) {
                  simd::Rows().gelu_grad(x + b, dy + b, e - b, dx + b);
                } else {
                  ActivationGradRange<Act>(x, y, dy, dx, b, e);
                }
              });
  return absl::OkStatus();
}

template <typename Act>
void RegisterUnary(KernelTable& t, const std::string& name) {
  t[name] = FloatKernel(&UnaryForward<Act, float>, &UnaryForward<Act, double>);
  t[name + "_grad"] =
      FloatKernel(&UnaryBackward<Act, float>, &UnaryBackward<Act, double>);
}

// --- dropout ----------------------------------------------------------------------

// Which elements of a (possibly sharded) tensor dropout keeps (kernels.h).
class DropoutMask {
 public:
  static absl::StatusOr<DropoutMask> Make(const KernelArgs& a,
                                          const Shape& local) {
    DropoutMask m;
    HAP_ASSIGN_OR_RETURN(m.p_, AttrFloat(a, "p", 0.1));
    if (!(m.p_ >= 0 && m.p_ < 1)) {
      return Invalid(a, "attribute 'p' must be in [0, 1), got ", m.p_);
    }
    HAP_ASSIGN_OR_RETURN(int64_t key, AttrInt(a, "rng_key", 0));
    HAP_ASSIGN_OR_RETURN(Shape global, AttrInts(a, "global_shape", local));
    HAP_ASSIGN_OR_RETURN(
        m.offsets_, AttrInts(a, "offsets", std::vector<int64_t>(local.size())));
    if (global.size() != local.size() || m.offsets_.size() != local.size()) {
      return Invalid(a, "attributes 'global_shape' and 'offsets' must have "
                        "one entry per dimension of ",
                     graph::ShapeString(local));
    }
    for (size_t d = 0; d < local.size(); ++d) {
      if (m.offsets_[d] < 0 || m.offsets_[d] + local[d] > global[d]) {
        return Invalid(a, "the local slice ", graph::ShapeString(local),
                       " at offsets ", graph::ShapeString(m.offsets_),
                       " does not fit in global shape ",
                       graph::ShapeString(global));
      }
    }
    m.key_ = CounterKey(static_cast<uint64_t>(key),
                        static_cast<uint64_t>(a.ctx.step));
    m.local_ = local;
    HAP_ASSIGN_OR_RETURN(m.global_strides_, MaskCounterStrides(a, global));
    m.row_ = local.empty() ? 1 : local.back();
    m.last_stride_ = local.empty() ? 1 : m.global_strides_.back();
    return m;
  }

  double scale() const { return 1.0 / (1.0 - p_); }
  int64_t row_length() const { return row_; }
  // A row's elements have consecutive counters (dropout, not drop_path).
  bool consecutive() const { return last_stride_ == 1; }
  // The float loops' constants (simd::FloatRows::dropout): the same mask.
  simd::DropoutConstants simd_constants() const {
    return {key_, simd::DropoutThreshold(p_), static_cast<float>(scale())};
  }

  // The global index of local row r's first element (rows of the last
  // dimension); the row's elements follow it.
  int64_t RowStart(int64_t r) const {
    int64_t g = local_.empty() ? 0 : offsets_.back() * last_stride_;
    for (int d = static_cast<int>(local_.size()) - 2; d >= 0; --d) {
      g += (r % local_[d] + offsets_[d]) * global_strides_[d];
      r /= local_[d];
    }
    return g;
  }

  // keep[j] for the elements of local row r.
  void Row(int64_t r, std::vector<char>& keep) const {
    const int64_t g = RowStart(r);
    keep.resize(row_);
    for (int64_t j = 0; j < row_; ++j) {
      keep[j] = CounterUniform(key_, static_cast<uint64_t>(g + j * last_stride_)) >= p_;
    }
  }

 private:
  double p_ = 0;
  uint64_t key_ = 0;
  Shape local_;
  std::vector<int64_t> offsets_, global_strides_;
  int64_t row_ = 1, last_stride_ = 1;
};

// out[j] (+)= keep[j] ? in[j] * scale : 0 over a row.
template <typename T>
void MaskRow(const char* keep, const T* in, T scale, T* out, int64_t n,
             bool accumulate) {
  if (accumulate) {
    for (int64_t j = 0; j < n; ++j) out[j] += keep[j] ? in[j] * scale : T(0);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = keep[j] ? in[j] * scale : T(0);
  }
}

// out (+)= in * mask / (1 - p). Float rows run simd::FloatRows::dropout
// (kernels_simd.h): the same mask and products, bit for bit.
template <typename T>
void ApplyDropout(const KernelArgs& a, const DropoutMask& m, const T* in,
                  T* out, int64_t n, bool accumulate) {
  const int64_t row = m.row_length();
  const int64_t rows = row == 0 ? 0 : n / row;  // a last dimension of 0: none
  if constexpr (std::is_same_v<T, float>) {
    if (m.consecutive()) {
      const simd::DropoutConstants c = m.simd_constants();
      ParallelFor(a.ctx.num_threads, rows, GrainFor(8 * row), [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          simd::Rows().dropout(c, static_cast<uint64_t>(m.RowStart(r)), in + r * row, row,
                               accumulate, out + r * row);
        }
      });
      return;
    }
  }
  const T scale = static_cast<T>(m.scale());
  ParallelFor(a.ctx.num_threads, rows, GrainFor(8 * row), [&](int64_t b, int64_t e) {
    std::vector<char> keep;
    for (int64_t r = b; r < e; ++r) {
      m.Row(r, keep);
      MaskRow(keep.data(), in + r * row, scale, out + r * row, row, accumulate);
    }
  });
}

template <typename T>
absl::Status DropoutForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckElementwise(a, t));
  HAP_ASSIGN_OR_RETURN(DropoutMask m, DropoutMask::Make(a, a.in[0].shape));
  ApplyDropout<T>(a, m, a.in[0].as<const T>(), a.out[0].as<T>(),
                  a.in[0].num_elements(), false);
  return absl::OkStatus();
}

template <typename T>
absl::Status DropoutBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Elementwise(a, t));
  HAP_ASSIGN_OR_RETURN(DropoutMask m, DropoutMask::Make(a, g.x(0).shape));
  if (!g.active()) return absl::OkStatus();
  ApplyDropout<T>(a, m, g.dy(0).as<const T>(), g.dx(0).as<T>(),
                  g.x(0).num_elements(), true);
  return absl::OkStatus();
}

// --- scale ------------------------------------------------------------------------

template <typename T>
void ScaleRange(T factor, const T* in, T* out, int64_t b, int64_t e,
                bool accumulate) {
  if (accumulate) {
    for (int64_t i = b; i < e; ++i) out[i] += factor * in[i];
  } else {
    for (int64_t i = b; i < e; ++i) out[i] = factor * in[i];
  }
}

// out (+)= factor * in over n elements.
template <typename T>
void Scaled(const KernelArgs& a, T factor, const T* in, T* out, int64_t n,
            bool accumulate) {
  ParallelFor(a.ctx.num_threads, n, kParallelWork, [&](int64_t b, int64_t e) {
    ScaleRange(factor, in, out, b, e, accumulate);
  });
}

template <typename T>
absl::Status ScaleForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckElementwise(a, t));
  HAP_ASSIGN_OR_RETURN(double f, AttrFloat(a, "factor"));
  Scaled<T>(a, static_cast<T>(f), a.in[0].as<const T>(), a.out[0].as<T>(),
            a.in[0].num_elements(), false);
  return absl::OkStatus();
}

template <typename T>
absl::Status ScaleBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Elementwise(a, t));
  HAP_ASSIGN_OR_RETURN(double f, AttrFloat(a, "factor"));
  if (!g.active()) return absl::OkStatus();
  Scaled<T>(a, static_cast<T>(f), g.dy(0).as<const T>(), g.dx(0).as<T>(),
            g.x(0).num_elements(), true);
  return absl::OkStatus();
}

// --- add, sub, mul ----------------------------------------------------------------

enum class BinOp { kAdd, kSub, kMul };

template <BinOp op, typename T>
T Apply(T x, T y) {
  if constexpr (op == BinOp::kAdd) return x + y;
  if constexpr (op == BinOp::kSub) return x - y;
  return x * y;
}

// y[i * 1] = p[i * sp] op q[i * sq], with the common unit/zero strides as
// their own loops so that they vectorize.
template <BinOp op, typename T>
void BinaryRow(const T* p, int64_t sp, const T* q, int64_t sq, T* y,
               int64_t n) {
  if (sp == 1 && sq == 1) {
    for (int64_t i = 0; i < n; ++i) y[i] = Apply<op>(p[i], q[i]);
  } else if (sp == 1 && sq == 0) {
    const T v = *q;
    for (int64_t i = 0; i < n; ++i) y[i] = Apply<op>(p[i], v);
  } else if (sp == 0 && sq == 1) {
    const T v = *p;
    for (int64_t i = 0; i < n; ++i) y[i] = Apply<op>(v, q[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = Apply<op>(p[i * sp], q[i * sq]);
  }
}

// An operand of a broadcasting binary op: an absent one reads as a scalar 0.
template <typename T>
struct Operand {
  const T* data;
  std::vector<int64_t> strides;  // over the output shape
};

template <typename T>
Operand<T> OperandOf(const TensorView& v, const Shape& out) {
  static const T kZero = T(0);
  if (!v.present()) return {&kZero, std::vector<int64_t>(out.size(), 0)};
  return {v.as<const T>(), BroadcastStrides(v.shape, out)};
}

// The output shape of a binary op: the broadcast of its present operands,
// or `given` (the output view's) when one is absent; both operands must
// broadcast to it.
absl::StatusOr<Shape> BinaryShape(const KernelArgs& a, const TensorView& x,
                                  const TensorView& y, const Shape& given) {
  if (!x.present() && !y.present()) {
    return Invalid(a, "both operands are absent");
  }
  Shape s = given;
  if (x.present() && y.present()) {
    auto b = BroadcastShape(x.shape, y.shape);
    if (!b.ok()) {
      return Invalid(a, "operands ", InLabel(a, 0), " and ", InLabel(a, 1),
                     " do not broadcast");
    }
    s = *b;
  }
  for (int i : {0, 1}) {
    const TensorView& v = i == 0 ? x : y;
    if (v.present() && !BroadcastsTo(v.shape, s)) {
      return Invalid(a, InLabel(a, i), " does not broadcast to ",
                     graph::ShapeString(s));
    }
  }
  return s;
}

template <typename T, BinOp op>
absl::Status BinaryForward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_RETURN_IF_ERROR(CheckArity(a, 2, 2, 1));
  for (int i : {0, 1}) {
    if (a.in[i].present()) HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
  }
  if (!a.out[0].present()) return Invalid(a, "output 0 is absent");
  HAP_ASSIGN_OR_RETURN(Shape s,
                       BinaryShape(a, a.in[0], a.in[1], a.out[0].shape));
  HAP_RETURN_IF_ERROR(CheckOutput(a, 0, t, s));
  T* y = a.out[0].as<T>();
  const int64_t n = a.out[0].num_elements();
  if (a.in[0].present() && a.in[1].present() && a.in[0].shape == s &&
      a.in[1].shape == s) {
    const T* p = a.in[0].as<const T>();
    const T* q = a.in[1].as<const T>();
    ParallelFor(a.ctx.num_threads, n, kParallelWork, [&](int64_t b, int64_t e) {
      BinaryRow<op>(p + b, 1, q + b, 1, y + b, e - b);
    });
    return absl::OkStatus();
  }
  Operand<T> p = OperandOf<T>(a.in[0], s), q = OperandOf<T>(a.in[1], s);
  StridedLoop loop(s, {ContiguousStrides(s), p.strides, q.strides});
  const int64_t len = loop.inner(), sp = loop.inner_stride(1),
                sq = loop.inner_stride(2);
  ParallelFor(a.ctx.num_threads, loop.rows(), GrainFor(len),
              [&](int64_t b, int64_t e) {
                loop.ForRows(b, e, [&](const int64_t* off) {
                  BinaryRow<op>(p.data + off[1], sp, q.data + off[2], sq,
                                y + off[0], len);
                });
              });
  return absl::OkStatus();
}

// dst (+)= dy * other over `shape`; dst may broadcast (a reduction).
template <typename T>
void MulGrad(const KernelArgs& a, const Shape& s, T* dst,
             const std::vector<int64_t>& dst_strides, const T* dy,
             const Operand<T>& other) {
  StridedLoop loop(s, {dst_strides, ContiguousStrides(s), other.strides});
  const int64_t len = loop.inner(), sd = loop.inner_stride(0),
                so = loop.inner_stride(2);
  auto rows = [&](int64_t b, int64_t e) {
    loop.ForRows(b, e, [&](const int64_t* off) {
      T* d = dst + off[0];
      const T* g = dy + off[1];
      const T* o = other.data + off[2];
      if (sd == 0) {  // a row summed into one element: in double
        double acc = 0;
        for (int64_t i = 0; i < len; ++i) acc += double(g[i]) * double(o[i * so]);
        *d += static_cast<T>(acc);
        return;
      }
      for (int64_t i = 0; i < len; ++i) d[i * sd] += g[i] * o[i * so];
    });
  };
  bool reduction = false;
  for (size_t d = 0; d < s.size(); ++d) {
    reduction = reduction || (dst_strides[d] == 0 && s[d] > 1);
  }
  if (reduction) {
    rows(0, loop.rows());
  } else {
    ParallelFor(a.ctx.num_threads, loop.rows(), GrainFor(len), rows);
  }
}

template <typename T, BinOp op>
absl::Status BinaryBackward(const KernelArgs& a) {
  constexpr DType t = DTypeOf<T>();
  HAP_ASSIGN_OR_RETURN(GradArgs g, GradArgs::Make(a, 2, 2, 1));
  for (int i : {0, 1}) {
    if (g.x(i).present()) HAP_RETURN_IF_ERROR(CheckInput(a, i, t));
  }
  if (!g.dy(0).present()) return absl::OkStatus();  // a zero gradient
  HAP_ASSIGN_OR_RETURN(Shape s, BinaryShape(a, g.x(0), g.x(1), g.dy(0).shape));
  HAP_RETURN_IF_ERROR(g.Check(t, {s}));
  const T* dy = g.dy(0).as<const T>();
  for (int i : {0, 1}) {
    if (!g.dx(i).present()) continue;
    std::vector<int64_t> strides = BroadcastStrides(g.x(i).shape, s);
    T* dx = g.dx(i).as<T>();
    if constexpr (op == BinOp::kMul) {
      MulGrad<T>(a, s, dx, strides, dy, OperandOf<T>(g.x(1 - i), s));
    } else {
      const T sign = op == BinOp::kSub && i == 1 ? T(-1) : T(1);
      StridedCopy<T, T>(a.ctx.num_threads, s, dx, strides, dy,
                        ContiguousStrides(s), true, sign);
    }
  }
  return absl::OkStatus();
}

template <BinOp op>
void RegisterBinary(KernelTable& t, const std::string& name) {
  t[name] = FloatKernel(&BinaryForward<float, op>, &BinaryForward<double, op>);
  t[name + "_grad"] =
      FloatKernel(&BinaryBackward<float, op>, &BinaryBackward<double, op>);
}

}  // namespace

void RegisterElementwiseKernels(KernelTable& t) {
  RegisterUnary<Relu>(t, "relu");
  RegisterUnary<Gelu>(t, "gelu");
  RegisterUnary<Sigmoid>(t, "sigmoid");
  RegisterUnary<Tanh>(t, "tanh");
  RegisterUnary<Silu>(t, "silu");
  RegisterUnary<Relu6>(t, "relu6");
  RegisterUnary<Hardsigmoid>(t, "hardsigmoid");
  RegisterUnary<Hardswish>(t, "hardswish");
  RegisterUnary<ExpOp>(t, "exp");
  RegisterUnary<Rsqrt>(t, "rsqrt");
  RegisterUnary<Log>(t, "log");
  t["dropout"] = HAP_FLOAT_KERNEL(DropoutForward);
  t["dropout_grad"] = HAP_FLOAT_KERNEL(DropoutBackward);
  // Stochastic depth: dropout's kernels with a mask keyed by sample
  // (MaskCounterStrides).
  t["drop_path"] = HAP_FLOAT_KERNEL(DropoutForward);
  t["drop_path_grad"] = HAP_FLOAT_KERNEL(DropoutBackward);
  t["scale"] = HAP_FLOAT_KERNEL(ScaleForward);
  t["scale_grad"] = HAP_FLOAT_KERNEL(ScaleBackward);
  RegisterBinary<BinOp::kAdd>(t, "add");
  RegisterBinary<BinOp::kSub>(t, "sub");
  RegisterBinary<BinOp::kMul>(t, "mul");
}

}  // namespace hap::executor::cpu
