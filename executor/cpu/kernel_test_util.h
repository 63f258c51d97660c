// Helpers of the CPU kernel tests (kernels_test, moe_kernels_test,
// lstm_kernels_test, optimizer_kernels_test): tensors from values and seeds,
// running one kernel, comparisons, and the finite-difference harness that
// checks every backward kernel against central differences in float64.
#ifndef HAP_EXECUTOR_CPU_KERNEL_TEST_UTIL_H_
#define HAP_EXECUTOR_CPU_KERNEL_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/op_registry.h"

namespace hap::executor::kernel_test {

using graph::Attrs;
using graph::DType;
using ::hap::testing::IsOk;

// The value every requested gradient starts at, to check accumulation.
constexpr double kPrefill = 0.25;

// --- tensors --------------------------------------------------------------------

inline HostTensor Rand(Shape s, uint64_t seed, double scale = 1.0) {
  HostTensor t(DType::kFloat64, std::move(s));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.as<double>()[i] = u(gen);
  return t;
}

inline HostTensor Full(Shape s, double v, DType dt = DType::kFloat64) {
  HostTensor t(dt, std::move(s));
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (dt == DType::kFloat64) {
      t.as<double>()[i] = v;
    } else {
      t.as<float>()[i] = static_cast<float>(v);
    }
  }
  return t;
}

inline HostTensor Vals(Shape s, const std::vector<double>& v) {
  HostTensor t(DType::kFloat64, std::move(s));
  EXPECT_EQ(static_cast<size_t>(t.num_elements()), v.size());
  std::copy(v.begin(), v.end(), t.as<double>());
  return t;
}

inline HostTensor Ints(Shape s, const std::vector<int64_t>& v) {
  HostTensor t(DType::kInt64, std::move(s));
  EXPECT_EQ(static_cast<size_t>(t.num_elements()), v.size());
  std::copy(v.begin(), v.end(), t.as<int64_t>());
  return t;
}

inline HostTensor ToF32(const HostTensor& x) {
  HostTensor t(DType::kFloat32, x.shape());
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    t.as<float>()[i] = static_cast<float>(x.as<double>()[i]);
  }
  return t;
}

inline const HostTensor kAbsent;

// A box [start, start + extent) of a row-major f64 tensor.
inline HostTensor Box(const HostTensor& x, const std::vector<int64_t>& start,
               const Shape& extent) {
  HostTensor out(DType::kFloat64, extent);
  const Shape& s = x.shape();
  for (int64_t i = 0; i < out.num_elements(); ++i) {
    int64_t rem = i, src = 0, stride = 1;
    for (int d = static_cast<int>(s.size()) - 1; d >= 0; --d) {
      src += (rem % extent[d] + start[d]) * stride;
      rem /= extent[d];
      stride *= s[d];
    }
    out.as<double>()[i] = x.as<double>()[src];
  }
  return out;
}

inline void ExpectAllNear(const HostTensor& got, const HostTensor& want, double tol,
                   const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    const double g = got.dtype() == DType::kFloat32 ? got.as<float>()[i]
                                                   : got.as<double>()[i];
    const double w = want.as<double>()[i];
    ASSERT_NEAR(g, w, tol * std::max(1.0, std::abs(w)))
        << what << " element " << i;
  }
}

// |got - want| <= rel * |want| + abs element by element (infinities equal):
// relative where ExpectAllNear is absolute below 1 (probabilities).
inline void ExpectRelativelyNear(const HostTensor& got, const HostTensor& want,
                          double rel, double abs, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    const double g = got.dtype() == DType::kFloat32 ? got.as<float>()[i]
                                                    : got.as<double>()[i];
    const double w = want.as<double>()[i];
    if (std::isinf(w)) {
      ASSERT_EQ(g, w) << what << " element " << i;
    } else {
      ASSERT_NEAR(g, w, rel * std::abs(w) + abs) << what << " element " << i;
    }
  }
}

// A kernel argument: a view of a tensor the caller keeps (a temporary lives
// until the call returns).
struct Arg {
  Arg(const HostTensor& t) : view(t.view()) {}  // NOLINT: implicit by design
  TensorView view;
};

inline std::vector<Arg> Args(const std::vector<HostTensor>& ts) {
  return std::vector<Arg>(ts.begin(), ts.end());
}

inline absl::Status RunKernel(const std::string& name, const Attrs& attrs,
                       const std::vector<Arg>& in, const std::vector<Arg>& out,
                       int64_t step = 0, int threads = 1) {
  KernelContext ctx;
  ctx.step = step;
  ctx.num_threads = threads;
  std::vector<TensorView> iv, ov;
  for (const Arg& a : in) iv.push_back(a.view);
  for (const Arg& a : out) ov.push_back(a.view);
  return RunCpuKernel(name, ctx, attrs, iv, ov);
}

// --- the finite-difference harness ----------------------------------------------

struct GradCase {
  GradCase(std::string op, Attrs attrs, std::vector<HostTensor> inputs,
           std::vector<Shape> out_shapes = {}, int64_t step = 0)
      : op(std::move(op)),
        attrs(std::move(attrs)),
        inputs(std::move(inputs)),
        out_shapes(std::move(out_shapes)),
        step(step) {}

  std::string op;
  Attrs attrs;
  std::vector<HostTensor> inputs;  // kAbsent for an absent input
  std::vector<Shape> out_shapes;   // empty: the op registry's inference
  int64_t step = 0;
};

inline const graph::OpDef& Def(const std::string& op) {
  const graph::OpDef* d = graph::OpRegistry::Global().Find(op);
  EXPECT_NE(d, nullptr) << op;
  return *d;
}

inline std::vector<Shape> OutShapes(const GradCase& c) {
  if (!c.out_shapes.empty()) return c.out_shapes;
  const graph::OpDef& def = Def(c.op);
  Attrs ir;  // only the attributes the IR declares
  for (const auto& [name, v] : c.attrs.values()) {
    if (std::count(def.attrs.begin(), def.attrs.end(), name)) ir.Set(name, v);
  }
  std::vector<std::string> names;
  std::vector<graph::TensorType> types;
  for (const HostTensor& t : c.inputs) {
    names.push_back(absl::StrCat("in", names.size()));
    types.push_back({t.dtype(), t.shape()});
  }
  auto out = graph::InferOp("op", c.op, ir, names, types);
  EXPECT_THAT(out.status(), IsOk());
  std::vector<Shape> shapes;
  for (const auto& t : *out) shapes.push_back(t.shape);
  return shapes;
}

inline std::vector<HostTensor> Forward(const GradCase& c,
                                const std::vector<HostTensor>& inputs,
                                const std::vector<Shape>& shapes) {
  std::vector<HostTensor> outs;
  for (const Shape& s : shapes) outs.emplace_back(DType::kFloat64, s);
  EXPECT_THAT(RunKernel(c.op, c.attrs, Args(inputs), Args(outs), c.step), IsOk()) << c.op;
  return outs;
}

inline double Dot(const HostTensor& a, const HostTensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    s += a.as<double>()[i] * b.as<double>()[i];
  }
  return s;
}

inline bool Differentiable(const GradCase& c, int i) {
  const auto& nd = Def(c.op).non_differentiable_inputs;
  const HostTensor& x = c.inputs[i];
  return x.data() != nullptr && x.dtype() == DType::kFloat64 &&
         std::find(nd.begin(), nd.end(), i) == nd.end();
}

// The backward kernel's gradients of L = sum_j <w_j, y_j> against central
// differences of L, every requested gradient prefilled with kPrefill; then
// each gradient requested alone, and every output gradient absent.
inline void ExpectGradientsMatch(const GradCase& c, double tol = 1e-6) {
  SCOPED_TRACE(c.op);
  const int n = static_cast<int>(c.inputs.size());
  const std::vector<Shape> shapes = OutShapes(c);
  const std::vector<HostTensor> ys = Forward(c, c.inputs, shapes);
  std::vector<HostTensor> ws;
  for (size_t j = 0; j < shapes.size(); ++j) ws.push_back(Rand(shapes[j], 1000 + j));
  auto objective = [&](const std::vector<HostTensor>& in) {
    std::vector<HostTensor> y = Forward(c, in, shapes);
    double s = 0;
    for (size_t j = 0; j < y.size(); ++j) s += Dot(y[j], ws[j]);
    return s;
  };
  auto run_grad = [&](const std::vector<HostTensor>& dys,
                      const std::vector<HostTensor>& dxs) {
    std::vector<HostTensor> in = c.inputs;
    in.insert(in.end(), ys.begin(), ys.end());
    in.insert(in.end(), dys.begin(), dys.end());
    return RunKernel(c.op + "_grad", c.attrs, Args(in), Args(dxs), c.step);
  };
  std::vector<HostTensor> grads;
  int any = 0;
  for (int i = 0; i < n; ++i) {
    grads.push_back(Differentiable(c, i) ? Full(c.inputs[i].shape(), kPrefill)
                                         : HostTensor());
    any += Differentiable(c, i);
  }
  ASSERT_GT(any, 0);
  ASSERT_THAT(run_grad(ws, grads), IsOk());

  const double h = 1e-6;
  for (int i = 0; i < n; ++i) {
    if (!Differentiable(c, i)) continue;
    for (int64_t k = 0; k < c.inputs[i].num_elements(); ++k) {
      std::vector<HostTensor> in = c.inputs;
      double& v = in[i].as<double>()[k];
      const double v0 = v;
      v = v0 + h;
      const double up = objective(in);
      v = v0 - h;
      const double down = objective(in);
      const double fd = (up - down) / (2 * h);
      const double got = grads[i].as<double>()[k] - kPrefill;
      ASSERT_NEAR(got, fd, tol * std::max(1.0, std::abs(fd)))
          << "d/d input " << i << " element " << k;
    }
  }
  // Each gradient alone (the others absent) gives the same values.
  for (int i = 0; i < n; ++i) {
    if (!Differentiable(c, i)) continue;
    std::vector<HostTensor> one(n);
    one[i] = Full(c.inputs[i].shape(), 0.0);
    ASSERT_THAT(run_grad(ws, one), IsOk()) << "only gradient " << i;
    for (int64_t k = 0; k < one[i].num_elements(); ++k) {
      ASSERT_NEAR(one[i].as<double>()[k], grads[i].as<double>()[k] - kPrefill,
                  1e-12)
          << "only gradient " << i << " element " << k;
    }
  }
  // Absent output gradients are zero: nothing changes.
  std::vector<HostTensor> same;
  for (int i = 0; i < n; ++i) {
    same.push_back(Differentiable(c, i) ? Full(c.inputs[i].shape(), kPrefill)
                                        : HostTensor());
  }
  ASSERT_THAT(run_grad(std::vector<HostTensor>(ws.size()), same), IsOk());
  for (int i = 0; i < n; ++i) {
    for (int64_t k = 0; same[i].data() && k < same[i].num_elements(); ++k) {
      ASSERT_EQ(same[i].as<double>()[k], kPrefill);
    }
  }
}

}  // namespace hap::executor::kernel_test

#endif  // HAP_EXECUTOR_CPU_KERNEL_TEST_UTIL_H_
