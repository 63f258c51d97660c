// Tests of the CPU kernels: every backward kernel against central finite
// differences in float64 (with accumulation, absent output gradients and
// absent input gradients), the sharded-execution attributes, the runtime
// and optimizer kernels against hand-computed values, and argument errors.
#include "executor/cpu/kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/op_registry.h"
#include "planner/util/status_matchers.h"

namespace hap::executor {
namespace {

using graph::Attrs;
using graph::DType;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The value every requested gradient starts at, to check accumulation.
constexpr double kPrefill = 0.25;

// --- tensors --------------------------------------------------------------------

HostTensor Rand(Shape s, uint64_t seed, double scale = 1.0) {
  HostTensor t(DType::kFloat64, std::move(s));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.as<double>()[i] = u(gen);
  return t;
}

HostTensor Full(Shape s, double v, DType dt = DType::kFloat64) {
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

HostTensor Vals(Shape s, const std::vector<double>& v) {
  HostTensor t(DType::kFloat64, std::move(s));
  EXPECT_EQ(static_cast<size_t>(t.num_elements()), v.size());
  std::copy(v.begin(), v.end(), t.as<double>());
  return t;
}

HostTensor Ints(Shape s, const std::vector<int64_t>& v) {
  HostTensor t(DType::kInt64, std::move(s));
  EXPECT_EQ(static_cast<size_t>(t.num_elements()), v.size());
  std::copy(v.begin(), v.end(), t.as<int64_t>());
  return t;
}

HostTensor ToF32(const HostTensor& x) {
  HostTensor t(DType::kFloat32, x.shape());
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    t.as<float>()[i] = static_cast<float>(x.as<double>()[i]);
  }
  return t;
}

const HostTensor kAbsent;

// A box [start, start + extent) of a row-major f64 tensor.
HostTensor Box(const HostTensor& x, const std::vector<int64_t>& start,
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

void ExpectAllNear(const HostTensor& got, const HostTensor& want, double tol,
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
void ExpectRelativelyNear(const HostTensor& got, const HostTensor& want,
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

std::vector<Arg> Args(const std::vector<HostTensor>& ts) {
  return std::vector<Arg>(ts.begin(), ts.end());
}

absl::Status RunKernel(const std::string& name, const Attrs& attrs,
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

const graph::OpDef& Def(const std::string& op) {
  const graph::OpDef* d = graph::OpRegistry::Global().Find(op);
  EXPECT_NE(d, nullptr) << op;
  return *d;
}

std::vector<Shape> OutShapes(const GradCase& c) {
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

std::vector<HostTensor> Forward(const GradCase& c,
                                const std::vector<HostTensor>& inputs,
                                const std::vector<Shape>& shapes) {
  std::vector<HostTensor> outs;
  for (const Shape& s : shapes) outs.emplace_back(DType::kFloat64, s);
  EXPECT_THAT(RunKernel(c.op, c.attrs, Args(inputs), Args(outs), c.step), IsOk()) << c.op;
  return outs;
}

double Dot(const HostTensor& a, const HostTensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    s += a.as<double>()[i] * b.as<double>()[i];
  }
  return s;
}

bool Differentiable(const GradCase& c, int i) {
  const auto& nd = Def(c.op).non_differentiable_inputs;
  const HostTensor& x = c.inputs[i];
  return x.data() != nullptr && x.dtype() == DType::kFloat64 &&
         std::find(nd.begin(), nd.end(), i) == nd.end();
}

// The backward kernel's gradients of L = sum_j <w_j, y_j> against central
// differences of L, every requested gradient prefilled with kPrefill; then
// each gradient requested alone, and every output gradient absent.
void ExpectGradientsMatch(const GradCase& c, double tol = 1e-6) {
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

// --- gradients, op by op ----------------------------------------------------------

TEST(KernelGradTest, Linear) {
  ExpectGradientsMatch({"linear", {}, {Rand({2, 3, 4}, 1), Rand({5, 4}, 2), Rand({5}, 3)}});
  ExpectGradientsMatch({"linear", {}, {Rand({3, 4}, 4), Rand({2, 4}, 5)}});
  // Bias slot present but absent: no bias.
  ExpectGradientsMatch({"linear", {}, {Rand({3, 4}, 4), Rand({2, 4}, 5), kAbsent},
                        {{3, 2}}});
}

TEST(KernelGradTest, Matmul) {
  ExpectGradientsMatch({"matmul", {}, {Rand({3, 4}, 1), Rand({4, 2}, 2)}});
  ExpectGradientsMatch({"matmul", {}, {Rand({2, 3, 4}, 3), Rand({4, 5}, 4)}});
  ExpectGradientsMatch({"matmul", {}, {Rand({2, 2, 3, 4}, 5), Rand({2, 2, 4, 3}, 6)}});
}

TEST(KernelGradTest, BinaryBroadcasting) {
  for (const char* op : {"add", "sub", "mul"}) {
    ExpectGradientsMatch({op, {}, {Rand({2, 3}, 1), Rand({2, 3}, 2)}});
    ExpectGradientsMatch({op, {}, {Rand({2, 3, 4}, 3), Rand({3, 1}, 4)}});
    ExpectGradientsMatch({op, {}, {Rand({1, 4}, 5), Rand({3, 1}, 6)}});
    ExpectGradientsMatch({op, {}, {Rand({4}, 7), Rand({2, 3, 4}, 8)}});
    ExpectGradientsMatch({op, {}, {Rand({2, 1, 4}, 9), Rand({}, 10)}});
  }
}

TEST(KernelGradTest, BinaryAbsentOperand) {
  for (const char* op : {"add", "sub", "mul"}) {
    ExpectGradientsMatch({op, {}, {kAbsent, Rand({2, 3}, 1)}, {{2, 3}}});
    ExpectGradientsMatch({op, {}, {Rand({2, 3}, 2), kAbsent}, {{2, 3}}});
    ExpectGradientsMatch({op, {}, {kAbsent, Rand({3}, 3)}, {{2, 3}}});
  }
  // Forward values: add -> the other operand, sub -> its negation first.
  HostTensor b = Rand({2, 3}, 4), out(DType::kFloat64, {2, 3});
  ASSERT_THAT(RunKernel("sub", {}, {kAbsent, b}, {out}), IsOk());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.as<double>()[i], -b.as<double>()[i]);
  ASSERT_THAT(RunKernel("add", {}, {b, kAbsent}, {out}), IsOk());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.as<double>()[i], b.as<double>()[i]);
}

TEST(KernelGradTest, Activations) {
  for (const char* op : {"relu", "gelu", "sigmoid", "tanh", "silu", "relu6",
                         "hardsigmoid", "hardswish"}) {
    ExpectGradientsMatch({op, {}, {Rand({3, 5}, 1, 3.0)}});
  }
  // relu6 on both sides of its clamp.
  ExpectGradientsMatch({"relu6", {}, {Rand({4, 6}, 3, 9.0)}});
  for (const char* op : {"hardsigmoid", "hardswish"}) {
    ExpectGradientsMatch({op, {}, {Rand({4, 6}, 4, 6.0)}});
  }
  ExpectGradientsMatch({"scale", {{"factor", 0.37}}, {Rand({2, 3}, 2)}});
}

TEST(KernelGradTest, Dropout) {
  ExpectGradientsMatch(
      {"dropout", {{"p", 0.3}, {"rng_key", int64_t{7}}}, {Rand({3, 5}, 1)}, {}, 2});
  ExpectGradientsMatch({"dropout", {{"p", 0.5}}, {Rand({4, 2, 3}, 2)}});
}

TEST(KernelGradTest, DropPath) {
  ExpectGradientsMatch(
      {"drop_path", {{"p", 0.4}, {"rng_key", int64_t{9}}}, {Rand({6, 2, 3}, 1)}, {}, 3});
  ExpectGradientsMatch({"drop_path", {{"p", 0.5}, {"mode", std::string("batch")}},
                        {Rand({4, 3}, 2)}, {}, 1});
}

// Row mode keeps or drops each sample whole (about 1 - p of them), scaled by
// 1 / (1 - p); a shard's mask is its slice of the whole batch's.
TEST(KernelShardTest, DropPathDropsWholeSamplesAndShardsAreSlices) {
  const Attrs attrs = {{"p", 0.3}, {"rng_key", int64_t{41}}};
  const HostTensor x = Full({200, 3, 2}, 1.0);
  HostTensor y(DType::kFloat64, x.shape());
  ASSERT_THAT(RunKernel("drop_path", attrs, {x}, {y}, 5), IsOk());
  int kept = 0;
  for (int64_t m = 0; m < 200; ++m) {
    const double v = y.as<double>()[m * 6];
    EXPECT_TRUE(v == 0.0 || std::abs(v - 1 / 0.7) < 1e-12) << v;
    for (int j = 1; j < 6; ++j) EXPECT_EQ(y.as<double>()[m * 6 + j], v) << m;
    kept += v != 0.0;
  }
  EXPECT_GT(kept, 110);
  EXPECT_LT(kept, 170);
  Attrs shard = attrs;
  shard.Set("global_shape", std::vector<int64_t>{200, 3, 2});
  shard.Set("offsets", std::vector<int64_t>{50, 1, 0});
  const HostTensor xs = Full({30, 2, 2}, 1.0);
  HostTensor ys(DType::kFloat64, xs.shape());
  ASSERT_THAT(RunKernel("drop_path", shard, {xs}, {ys}, 5), IsOk());
  ExpectAllNear(ys, Box(y, {50, 1, 0}, {30, 2, 2}), 0, "shard");
  // Batch mode: all or nothing; another step draws again.
  Attrs batch = attrs;
  batch.Set("mode", std::string("batch"));
  int all_kept = 0;
  for (int64_t step = 0; step < 40; ++step) {
    ASSERT_THAT(RunKernel("drop_path", batch, {x}, {y}, step), IsOk());
    const double v = y.as<double>()[0];
    for (int64_t i = 1; i < x.num_elements(); ++i) ASSERT_EQ(y.as<double>()[i], v);
    all_kept += v != 0.0;
  }
  EXPECT_GT(all_kept, 10);
  EXPECT_LT(all_kept, 40);
  batch.Set("mode", std::string("column"));
  EXPECT_THAT(RunKernel("drop_path", batch, {x}, {y}, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mode")));
}

TEST(KernelGradTest, LayerNorm) {
  ExpectGradientsMatch({"layer_norm", {{"eps", 1e-5}},
                        {Rand({2, 3, 5}, 1), Rand({5}, 2), Rand({5}, 3)}});
}

TEST(KernelGradTest, BatchNorm) {
  // NCHW with running statistics (not differentiated), [n, c] without.
  ExpectGradientsMatch({"batch_norm", {{"eps", 1e-5}, {"momentum", 0.2}},
                        {Rand({3, 4, 2, 3}, 1, 2.0), Rand({4}, 2), Rand({4}, 3),
                         Rand({4}, 4), Full({4}, 1.0)}});
  ExpectGradientsMatch({"batch_norm", {}, {Rand({5, 3}, 5, 2.0), Rand({3}, 6), Rand({3}, 7)}});
}

// The running statistics move towards the batch's mean and unbiased
// variance (PyTorch's rule); y is normalised with the biased variance.
TEST(KernelTest, BatchNormUpdatesRunningStatistics) {
  HostTensor x = Vals({4, 1}, {1, 2, 3, 6}), y(DType::kFloat64, {4, 1});
  HostTensor rm = Vals({1}, {1.0}), rv = Vals({1}, {2.0});
  ASSERT_THAT(RunKernel("batch_norm", {{"momentum", 0.25}, {"eps", 1e-9}},
                        {x, Full({1}, 1.0), Full({1}, 0.0), rm, rv}, {y}),
              IsOk());
  // mean 3, biased variance 3.5, unbiased 14/3.
  EXPECT_NEAR(rm.as<double>()[0], 0.75 * 1.0 + 0.25 * 3.0, 1e-12);
  EXPECT_NEAR(rv.as<double>()[0], 0.75 * 2.0 + 0.25 * 14.0 / 3.0, 1e-12);
  EXPECT_NEAR(y.as<double>()[3], 3.0 / std::sqrt(3.5), 1e-7);
}

// The pieces of a batch-sharded batch_norm (kernels_batch_norm.cc) on two
// uneven shards, their sums added as the all-reduce would, give the
// single-device kernels' y, dx, dgamma + dbeta (summed over shards) and
// running statistics.
TEST(KernelShardTest, BatchNormPiecesOnShardsMatchTheWholeBatch) {
  const int64_t c = 3;
  const HostTensor x = Rand({7, c, 2, 2}, 11, 2.0), dy = Rand({7, c, 2, 2}, 12);
  const HostTensor gamma = Rand({c}, 13), beta = Rand({c}, 14);
  const Attrs attrs = {{"eps", 1e-5}, {"momentum", 0.3}};
  HostTensor rm = Rand({c}, 15), rv = Full({c}, 1.5);
  HostTensor y(DType::kFloat64, x.shape());
  ASSERT_THAT(RunKernel("batch_norm", attrs, {x, gamma, beta, rm, rv}, {y}), IsOk());
  HostTensor dx = Full(x.shape(), 0.0), dg = Full({c}, 0.0), db = Full({c}, 0.0);
  ASSERT_THAT(RunKernel("batch_norm_grad", attrs,
                        {x, gamma, beta, kAbsent, kAbsent, y, dy},
                        {dx, dg, db, kAbsent, kAbsent}),
              IsOk());

  Attrs sharded = attrs;
  sharded.Set("global_count", int64_t{7 * 4});
  const int64_t starts[] = {0, 2}, lengths[] = {2, 5};
  std::vector<HostTensor> xs, dys;
  HostTensor sums = Full({2, c}, 0.0);
  for (int r = 0; r < 2; ++r) {
    xs.push_back(Box(x, {starts[r], 0, 0, 0}, {lengths[r], c, 2, 2}));
    dys.push_back(Box(dy, {starts[r], 0, 0, 0}, {lengths[r], c, 2, 2}));
    HostTensor local(DType::kFloat64, {2, c});
    ASSERT_THAT(RunKernel("batch_norm_stats", sharded, {xs[r]}, {local}), IsOk());
    for (int i = 0; i < 2 * c; ++i) sums.as<double>()[i] += local.as<double>()[i];
  }
  HostTensor gsums = Full({2, c}, 0.0);
  for (int r = 0; r < 2; ++r) {
    HostTensor local(DType::kFloat64, {2, c});
    ASSERT_THAT(RunKernel("batch_norm_grad_stats", sharded, {xs[r], sums, dys[r]}, {local}),
                IsOk());
    for (int i = 0; i < 2 * c; ++i) gsums.as<double>()[i] += local.as<double>()[i];
  }
  HostTensor dg_sum = Full({c}, 0.0), db_sum = Full({c}, 0.0);
  for (int r = 0; r < 2; ++r) {
    // Each rank updates its own (replicated) copy of the running statistics.
    HostTensor rm_r = Rand({c}, 15), rv_r = Full({c}, 1.5);
    HostTensor yr(DType::kFloat64, xs[r].shape());
    ASSERT_THAT(RunKernel("batch_norm_apply", sharded,
                          {xs[r], gamma, beta, rm_r, rv_r, sums}, {yr}),
                IsOk());
    ExpectAllNear(yr, Box(y, {starts[r], 0, 0, 0}, yr.shape()), 1e-12, "y");
    ExpectAllNear(rm_r, rm, 1e-12, "running_mean");
    ExpectAllNear(rv_r, rv, 1e-12, "running_var");
    HostTensor dxr = Full(xs[r].shape(), 0.0);
    ASSERT_THAT(RunKernel("batch_norm_grad_apply", sharded,
                          {xs[r], gamma, sums, gsums, dys[r]}, {dxr, dg_sum, db_sum}),
                IsOk());
    ExpectAllNear(dxr, Box(dx, {starts[r], 0, 0, 0}, dxr.shape()), 1e-12, "dx");
  }
  ExpectAllNear(dg_sum, dg, 1e-12, "dgamma");
  ExpectAllNear(db_sum, db, 1e-12, "dbeta");
  // A global count below the local batch is an error naming the attribute.
  HostTensor local(DType::kFloat64, {2, c});
  Attrs bad = attrs;
  bad.Set("global_count", int64_t{3});
  EXPECT_THAT(RunKernel("batch_norm_stats", bad, {xs[1]}, {local}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global_count")));
}

TEST(KernelGradTest, Softmax) {
  ExpectGradientsMatch({"softmax", {}, {Rand({3, 5}, 1, 2.0)}});
  ExpectGradientsMatch({"softmax", {{"causal", true}}, {Rand({2, 4, 4}, 2, 2.0)}});
  ExpectGradientsMatch({"softmax", {}, {Rand({2, 3, 4}, 3), Rand({1, 4}, 4)}});
  ExpectGradientsMatch({"softmax", {{"causal", true}, {"axis", int64_t{-1}}},
                        {Rand({2, 2, 3, 3}, 5), Rand({2, 1, 3, 1}, 6)}});
  ExpectGradientsMatch({"log_softmax", {}, {Rand({3, 6}, 7, 3.0)}});
}

TEST(KernelGradTest, Embedding) {
  ExpectGradientsMatch(
      {"embedding", {}, {Ints({2, 3}, {0, 4, 2, 4, 1, 0}), Rand({5, 3}, 1)}});
}

TEST(KernelGradTest, Layout) {
  ExpectGradientsMatch({"transpose", {{"perm", std::vector<int64_t>{0, 2, 3, 1}}},
                        {Rand({2, 3, 2, 4}, 1)}});
  ExpectGradientsMatch({"transpose", {{"perm", std::vector<int64_t>{1, 0}}},
                        {Rand({3, 4}, 2)}});
  ExpectGradientsMatch({"reshape", {{"shape", std::vector<int64_t>{4, -1}}},
                        {Rand({2, 3, 2}, 3)}});
  ExpectGradientsMatch({"flatten", {}, {Rand({2, 3, 2}, 4)}});
  ExpectGradientsMatch({"concat", {{"axis", int64_t{1}}},
                        {Rand({2, 1, 3}, 5), Rand({2, 3, 3}, 6), Rand({2, 2, 3}, 7)}});
  ExpectGradientsMatch({"split", {{"axis", int64_t{-1}},
                                  {"sizes", std::vector<int64_t>{1, 3, 2}}},
                        {Rand({2, 6}, 8)}});
  ExpectGradientsMatch({"slice", {{"axis", int64_t{1}}, {"start", int64_t{1}},
                                  {"end", int64_t{3}}},
                        {Rand({2, 4, 3}, 9)}});
  ExpectGradientsMatch({"expand", {{"shape", std::vector<int64_t>{2, 3, 4}}},
                        {Rand({3, 1}, 10)}});
}

TEST(KernelGradTest, SplitWithAbsentOutputGradient) {
  Attrs attrs = {{"axis", int64_t{0}}, {"sizes", std::vector<int64_t>{1, 2}}};
  HostTensor x = Rand({3, 2}, 1);
  HostTensor y0(DType::kFloat64, {1, 2}), y1(DType::kFloat64, {2, 2});
  ASSERT_THAT(RunKernel("split", attrs, {x}, {y0, y1}), IsOk());
  HostTensor dy1 = Rand({2, 2}, 2), dx = Full({3, 2}, kPrefill);
  // y0 and dy0 absent: the size of part 0 comes from the attribute.
  ASSERT_THAT(RunKernel("split_grad", attrs, {x, kAbsent, y1, kAbsent, dy1}, {dx}),
              IsOk());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(dx.as<double>()[i], kPrefill);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(dx.as<double>()[2 + i], kPrefill + dy1.as<double>()[i]);
  }
}

TEST(KernelGradTest, Reductions) {
  for (const char* op : {"sum", "mean"}) {
    ExpectGradientsMatch({op, {}, {Rand({2, 3, 4}, 1)}});
    ExpectGradientsMatch({op, {{"axes", std::vector<int64_t>{0, 2}}}, {Rand({2, 3, 4}, 2)}});
    ExpectGradientsMatch({op, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}},
                          {Rand({2, 3, 4}, 3)}});
  }
}

TEST(KernelGradTest, Losses) {
  HostTensor targets = Ints({4}, {2, 0, 4, 1});
  ExpectGradientsMatch({"nll_loss", {}, {Rand({4, 5}, 1), targets}});
  ExpectGradientsMatch({"cross_entropy", {}, {Rand({4, 5}, 2, 3.0), targets}});
  ExpectGradientsMatch({"cross_entropy", {{"global_rows", int64_t{10}}},
                        {Rand({4, 5}, 3), targets}});
}

// Vocabulary-parallel cross-entropy: shards' log-sum-exps gathered, each
// shard's partial loss and its classes' gradient, against the whole row.
TEST(KernelTest, CrossEntropyShardedByClassMatchesTheWholeRows) {
  const int64_t rows = 4, vocab = 11;
  const std::vector<int64_t> bounds = {0, 4, 7, 11};  // three ranks
  const int64_t ranks = 3;
  HostTensor x = Rand({rows, vocab}, 21, 4.0);
  HostTensor targets = Ints({rows}, {2, 10, 4, 7});
  const Attrs whole_attrs = {{"global_rows", int64_t{6}}};
  HostTensor loss(DType::kFloat64, {});
  ASSERT_THAT(RunKernel("cross_entropy", whole_attrs, {x, targets}, {loss}), IsOk());
  HostTensor dy = Vals({}, {1.7});
  HostTensor dx = Full({rows, vocab}, kPrefill);
  ASSERT_THAT(RunKernel("cross_entropy_grad", whole_attrs,
                      {x, targets, loss, dy}, {dx, kAbsent}), IsOk());
  std::vector<HostTensor> shard, lse;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t c = bounds[r + 1] - bounds[r];
    HostTensor xs(DType::kFloat64, {rows, c});
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        xs.as<double>()[i * c + j] = x.as<double>()[i * vocab + bounds[r] + j];
      }
    }
    HostTensor l(DType::kFloat64, {rows});
    ASSERT_THAT(RunKernel("cross_entropy_lse",
                        {{"vocab_offset", bounds[r]}, {"vocab_size", vocab}},
                        {xs}, {l}), IsOk());
    shard.push_back(std::move(xs));
    lse.push_back(std::move(l));
  }
  HostTensor gathered(DType::kFloat64, {ranks * rows});
  for (int64_t r = 0; r < ranks; ++r) {
    std::copy(lse[r].as<double>(), lse[r].as<double>() + rows,
              gathered.as<double>() + r * rows);
  }
  double total = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    const Attrs a = {{"vocab_offset", bounds[r]}, {"vocab_size", vocab},
                     {"rank", r}, {"ranks", ranks}, {"global_rows", int64_t{6}}};
    HostTensor part(DType::kFloat64, {});
    ASSERT_THAT(RunKernel("cross_entropy_sharded", a, {shard[r], targets, gathered},
                        {part}), IsOk());
    total += part.as<double>()[0];
    const int64_t c = bounds[r + 1] - bounds[r];
    HostTensor dxs = Full({rows, c}, kPrefill);
    ASSERT_THAT(RunKernel("cross_entropy_sharded_grad", a,
                        {shard[r], targets, gathered, dy}, {dxs}), IsOk());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        EXPECT_NEAR(dxs.as<double>()[i * c + j],
                    dx.as<double>()[i * vocab + bounds[r] + j], 1e-12)
            << "rank " << r << " row " << i << " class " << bounds[r] + j;
      }
    }
  }
  EXPECT_NEAR(total, loss.as<double>()[0], 1e-12);

  // Bad input is named.
  HostTensor part(DType::kFloat64, {});
  EXPECT_THAT(RunKernel("cross_entropy_sharded",
                        {{"vocab_offset", int64_t{0}}, {"vocab_size", vocab},
                         {"rank", int64_t{3}}, {"ranks", ranks}},
                        {shard[0], targets, gathered}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside a world of 'ranks' 3")));
  EXPECT_THAT(RunKernel("cross_entropy_sharded",
                        {{"vocab_offset", int64_t{0}}, {"vocab_size", int64_t{9}},
                         {"rank", int64_t{0}}, {"ranks", ranks}},
                        {shard[0], targets, gathered}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("target 10 at row 1 is outside [0, 9)")));
  EXPECT_THAT(RunKernel("cross_entropy_sharded",
                        {{"vocab_offset", int64_t{0}}, {"vocab_size", vocab},
                         {"rank", int64_t{0}}, {"ranks", int64_t{1} << 62}},
                        {shard[0], targets, gathered}, {part}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'ranks'")));
  // A rank without classes contributes nothing: -inf.
  HostTensor none(DType::kFloat64, {rows, 0}), empty_lse(DType::kFloat64, {rows});
  ASSERT_THAT(RunKernel("cross_entropy_lse",
                        {{"vocab_offset", vocab}, {"vocab_size", vocab}}, {none},
                        {empty_lse}),
              IsOk());
  EXPECT_EQ(empty_lse.as<double>()[0], -std::numeric_limits<double>::infinity());
  EXPECT_THAT(RunKernel("cross_entropy_lse",
                        {{"vocab_offset", int64_t{9}}, {"vocab_size", vocab}},
                        {shard[0]}, {lse[0]}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("do not fit the vocabulary")));
}

// A class whose logit is -inf (masked out) leaves the shard's log-sum-exp
// that of the others, in float as in double.
TEST(KernelTest, CrossEntropyLseSkipsAMinusInfinityLogit) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::kFloat64, DType::kFloat32}) {
    HostTensor x(dt, {1, 3}), lse(dt, {1});
    const double v[] = {-inf, 1.0, 2.0};
    for (int j = 0; j < 3; ++j) {
      if (dt == DType::kFloat64) {
        x.as<double>()[j] = v[j];
      } else {
        x.as<float>()[j] = static_cast<float>(v[j]);
      }
    }
    ASSERT_THAT(RunKernel("cross_entropy_lse",
                          {{"vocab_offset", int64_t{0}}, {"vocab_size", int64_t{3}}},
                          {x}, {lse}),
                IsOk());
    const double got = dt == DType::kFloat64 ? lse.as<double>()[0] : lse.as<float>()[0];
    EXPECT_NEAR(got, std::log(std::exp(1.0) + std::exp(2.0)), 1e-6);
  }
}

TEST(KernelGradTest, Convolution) {
  ExpectGradientsMatch({"conv2d",
                        {{"stride", std::vector<int64_t>{2}},
                         {"padding", std::vector<int64_t>{1, 1}}},
                        {Rand({2, 3, 5, 5}, 1), Rand({4, 3, 3, 3}, 2), Rand({4}, 3)}});
  ExpectGradientsMatch({"conv2d", {{"stride", std::vector<int64_t>{1, 2}}},
                        {Rand({1, 2, 4, 5}, 4), Rand({3, 2, 2, 3}, 5)}});
  // Grouped (2 groups of 2 input and 3 output channels) and depthwise
  // (channel multiplier 2), the direct loops.
  ExpectGradientsMatch({"conv2d",
                        {{"stride", std::vector<int64_t>{2, 1}},
                         {"padding", std::vector<int64_t>{1}},
                         {"groups", int64_t{2}}},
                        {Rand({2, 4, 5, 4}, 20), Rand({6, 2, 3, 2}, 21), Rand({6}, 22)}});
  ExpectGradientsMatch({"conv2d",
                        {{"padding", std::vector<int64_t>{1}}, {"groups", int64_t{3}}},
                        {Rand({2, 3, 4, 4}, 23), Rand({6, 1, 3, 3}, 24)}});
  ExpectGradientsMatch({"conv2d", {},  // 1x1: no im2col
                        {Rand({2, 3, 3, 2}, 6), Rand({2, 3, 1, 1}, 7), Rand({2}, 8)}});
  ExpectGradientsMatch({"max_pool2d",
                        {{"kernel", std::vector<int64_t>{3}},
                         {"stride", std::vector<int64_t>{2}},
                         {"padding", std::vector<int64_t>{1}}},
                        {Rand({2, 2, 5, 5}, 9)}});
  ExpectGradientsMatch({"max_pool2d", {{"kernel", std::vector<int64_t>{2, 2}}},
                        {Rand({1, 3, 4, 6}, 10)}});
  // ceil_mode: a last, partial window on each axis.
  ExpectGradientsMatch({"max_pool2d",
                        {{"kernel", std::vector<int64_t>{3}},
                         {"stride", std::vector<int64_t>{2}},
                         {"ceil_mode", true}},
                        {Rand({1, 2, 6, 8}, 13)}});
  for (bool include_pad : {true, false}) {
    ExpectGradientsMatch({"avg_pool2d",
                          {{"kernel", std::vector<int64_t>{3}},
                           {"stride", std::vector<int64_t>{2}},
                           {"padding", std::vector<int64_t>{1}},
                           {"count_include_pad", include_pad}},
                          {Rand({2, 2, 5, 6}, 14)}});
    ExpectGradientsMatch({"avg_pool2d",
                          {{"kernel", std::vector<int64_t>{3, 2}},
                           {"stride", std::vector<int64_t>{2}},
                           {"padding", std::vector<int64_t>{1, 0}},
                           {"ceil_mode", true},
                           {"count_include_pad", include_pad}},
                          {Rand({1, 2, 6, 7}, 15)}});
  }
  ExpectGradientsMatch({"adaptive_avg_pool2d",
                        {{"output_size", std::vector<int64_t>{3, 4}}},
                        {Rand({2, 2, 5, 7}, 11)}});
  ExpectGradientsMatch({"adaptive_avg_pool2d",
                        {{"output_size", std::vector<int64_t>{1}}},
                        {Rand({1, 2, 3, 3}, 12)}});
}

// The combine weights of moe_gate on fixed logits.
HostTensor GateCombine(const HostTensor& logits, int64_t k, int64_t cap) {
  const Shape& s = logits.shape();
  HostTensor out(DType::kFloat64, {s[0], s[1], cap});
  EXPECT_THAT(RunKernel("moe_gate", {{"k", k}, {"capacity", cap}}, {logits}, {out}),
              IsOk());
  return out;
}

TEST(KernelGradTest, Moe) {
  // 6 tokens, 4 experts: with capacity 2 some assignments overflow.
  ExpectGradientsMatch({"moe_gate", {{"k", int64_t{2}}, {"capacity", int64_t{2}}},
                        {Rand({6, 4}, 1, 2.0)}});
  ExpectGradientsMatch({"moe_gate", {{"k", int64_t{1}}, {"capacity", int64_t{2}}},
                        {Rand({6, 4}, 2, 2.0)}});
  HostTensor combine = GateCombine(Rand({6, 4}, 3, 2.0), 2, 2);
  ExpectGradientsMatch({"moe_dispatch", {}, {Rand({6, 3}, 4), combine}});
  ExpectGradientsMatch({"moe_combine", {}, {Rand({4, 2, 3}, 5), combine}});
}

TEST(KernelGradTest, Lstm) {
  // x [2, 4, 3], hidden 2 (gates 8): with both biases, reversed, without
  // biases, and with the bias slots present but absent.
  auto ins = [](uint64_t seed, bool bias) {
    std::vector<HostTensor> v = {Rand({2, 4, 3}, seed, 1.5), Rand({8, 3}, seed + 1),
                                 Rand({8, 2}, seed + 2)};
    if (bias) {
      v.push_back(Rand({8}, seed + 3));
      v.push_back(Rand({8}, seed + 4));
    }
    return v;
  };
  ExpectGradientsMatch({"lstm", {}, ins(1, true)});
  ExpectGradientsMatch({"lstm", {{"reverse", true}}, ins(11, true)});
  ExpectGradientsMatch({"lstm", {}, ins(21, false)});
  std::vector<HostTensor> absent = ins(31, false);
  absent.push_back(kAbsent);
  absent.push_back(Rand({8}, 35));
  ExpectGradientsMatch({"lstm", {}, absent, {{2, 4, 2}}});
  // One step, one sample.
  ExpectGradientsMatch({"lstm", {}, {Rand({1, 1, 2}, 41), Rand({12, 2}, 42), Rand({12, 3}, 43),
                                     Rand({12}, 44), Rand({12}, 45)}});
}

// The cell written out from PyTorch's nn.LSTM equations, step by step in
// plain loops: i, f, g, o = sigma, sigma, tanh, sigma of x W_ih^T + b_ih +
// h W_hh^T + b_hh (rows in that order); c' = f c + i g; h' = o tanh(c').
std::vector<double> LstmReference(const HostTensor& x, const HostTensor& w_ih,
                                  const HostTensor& w_hh, const HostTensor& b_ih,
                                  const HostTensor& b_hh, bool reverse) {
  const int64_t nb = x.shape()[0], ns = x.shape()[1], ni = x.shape()[2];
  const int64_t nh = w_hh.shape()[1];
  std::vector<double> y(nb * ns * nh);
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  for (int64_t b = 0; b < nb; ++b) {
    std::vector<double> h(nh, 0.0), c(nh, 0.0);
    for (int64_t k = 0; k < ns; ++k) {
      const int64_t t = reverse ? ns - 1 - k : k;
      std::vector<double> pre(4 * nh);
      for (int64_t r = 0; r < 4 * nh; ++r) {
        double v = b_ih.as<double>()[r] + b_hh.as<double>()[r];
        for (int64_t q = 0; q < ni; ++q) {
          v += w_ih.as<double>()[r * ni + q] * x.as<double>()[(b * ns + t) * ni + q];
        }
        for (int64_t q = 0; q < nh; ++q) v += w_hh.as<double>()[r * nh + q] * h[q];
        pre[r] = v;
      }
      for (int64_t j = 0; j < nh; ++j) {
        const double i = sig(pre[j]), f = sig(pre[nh + j]);
        const double g = std::tanh(pre[2 * nh + j]), o = sig(pre[3 * nh + j]);
        c[j] = f * c[j] + i * g;
        h[j] = o * std::tanh(c[j]);
        y[(b * ns + t) * nh + j] = h[j];
      }
    }
  }
  return y;
}

TEST(KernelTest, LstmMatchesTheCellEquations) {
  const HostTensor x = Rand({3, 5, 4}, 1, 2.0), w_ih = Rand({12, 4}, 2), w_hh = Rand({12, 3}, 3),
                   b_ih = Rand({12}, 4), b_hh = Rand({12}, 5);
  for (bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    HostTensor y(DType::kFloat64, {3, 5, 3});
    ASSERT_THAT(RunKernel("lstm", {{"reverse", reverse}}, {x, w_ih, w_hh, b_ih, b_hh}, {y}, 0, 2),
                IsOk());
    const std::vector<double> want = LstmReference(x, w_ih, w_hh, b_ih, b_hh, reverse);
    ExpectAllNear(y, Vals({3, 5, 3}, want), 1e-12, "y");
  }
  // Without biases: the same as zero biases.
  HostTensor y(DType::kFloat64, {3, 5, 3});
  ASSERT_THAT(RunKernel("lstm", {}, {x, w_ih, w_hh}, {y}), IsOk());
  ExpectAllNear(y, Vals({3, 5, 3}, LstmReference(x, w_ih, w_hh, Full({12}, 0), Full({12}, 0), false)),
                1e-12, "y without biases");
}

// A batch shard's rows are the whole batch's rows (the data(0) rule): the
// samples never mix, forward and backward; the weight gradients of the two
// shards add up to the whole batch's.
TEST(KernelShardTest, LstmBatchShardsAreSlicesAndWeightGradientsAdd) {
  const HostTensor x = Rand({5, 3, 2}, 7), w_ih = Rand({8, 2}, 8), w_hh = Rand({8, 2}, 9),
                   b = Rand({8}, 10), dy = Rand({5, 3, 2}, 11);
  auto grads = [&](const HostTensor& xs, const HostTensor& dys, HostTensor& y,
                   std::vector<HostTensor>& d) {
    ASSERT_THAT(RunKernel("lstm", {}, {xs, w_ih, w_hh, b, b}, {y}), IsOk());
    d = {Full(xs.shape(), 0.0), Full({8, 2}, 0.0), Full({8, 2}, 0.0), Full({8}, 0.0),
         Full({8}, 0.0)};
    ASSERT_THAT(RunKernel("lstm_grad", {}, {xs, w_ih, w_hh, b, b, y, dys}, Args(d)), IsOk());
  };
  HostTensor y(DType::kFloat64, {5, 3, 2});
  std::vector<HostTensor> whole;
  grads(x, dy, y, whole);
  std::vector<HostTensor> sum = {HostTensor(), Full({8, 2}, 0.0), Full({8, 2}, 0.0),
                                 Full({8}, 0.0), Full({8}, 0.0)};
  for (auto [start, rows] : {std::pair<int64_t, int64_t>{0, 2}, {2, 3}}) {
    HostTensor ys(DType::kFloat64, {rows, 3, 2});
    std::vector<HostTensor> part;
    grads(Box(x, {start, 0, 0}, {rows, 3, 2}), Box(dy, {start, 0, 0}, {rows, 3, 2}), ys, part);
    ExpectAllNear(ys, Box(y, {start, 0, 0}, {rows, 3, 2}), 1e-14, "y shard");
    ExpectAllNear(part[0], Box(whole[0], {start, 0, 0}, {rows, 3, 2}), 1e-14, "dx shard");
    for (int i = 1; i < 5; ++i) {
      for (int64_t k = 0; k < sum[i].num_elements(); ++k) {
        sum[i].as<double>()[k] += part[i].as<double>()[k];
      }
    }
  }
  for (int i = 1; i < 5; ++i) ExpectAllNear(sum[i], whole[i], 1e-12, "weight gradient sum");
}

TEST(KernelTest, MoeGateRouting) {
  // Probabilities (softmax rows) order experts: token 0 -> 1, 0; token 1 ->
  // 1, 2; token 2 -> 1, 0 (expert 1 full at capacity 2: dropped there).
  HostTensor logits = Vals({3, 3}, {1.0, 2.0, 0.0,  //
                                    0.0, 3.0, 1.0,  //
                                    2.5, 3.0, 0.0});
  HostTensor c = GateCombine(logits, 2, 2);
  auto at = [&](int t, int e, int s) { return c.as<double>()[(t * 3 + e) * 2 + s]; };
  auto probs = [&](int t) {
    std::vector<double> p(3);
    double sum = 0;
    for (int e = 0; e < 3; ++e) sum += p[e] = std::exp(logits.as<double>()[t * 3 + e]);
    for (double& v : p) v /= sum;
    return p;
  };
  std::vector<double> p0 = probs(0), p1 = probs(1), p2 = probs(2);
  EXPECT_NEAR(at(0, 1, 0), p0[1] / (p0[1] + p0[0]), 1e-12);
  EXPECT_NEAR(at(0, 0, 0), p0[0] / (p0[1] + p0[0]), 1e-12);
  EXPECT_NEAR(at(1, 1, 1), p1[1] / (p1[1] + p1[2]), 1e-12);
  EXPECT_NEAR(at(1, 2, 0), p1[2] / (p1[1] + p1[2]), 1e-12);
  EXPECT_NEAR(at(2, 0, 1), p2[0] / (p2[1] + p2[0]), 1e-12);
  double total = 0;
  for (int64_t i = 0; i < c.num_elements(); ++i) total += c.as<double>()[i] != 0;
  EXPECT_EQ(total, 5);  // token 2's expert-1 entry was dropped
  // k = 1 (Switch): the unnormalised probability.
  HostTensor s = GateCombine(logits, 1, 1);
  EXPECT_NEAR(s.as<double>()[(0 * 3 + 1) * 1], p0[1], 1e-12);
  EXPECT_EQ(s.as<double>()[(1 * 3 + 1) * 1], 0.0);  // expert 1 full
}

// --- the compact MoE form against the dense one ------------------------------------

// moe_route's int64 slots of `logits`.
HostTensor RouteOf(const HostTensor& logits, int64_t k, int64_t cap) {
  HostTensor out(DType::kInt64, {logits.shape()[0], k});
  EXPECT_THAT(RunKernel("moe_route", {{"k", k}, {"capacity", cap}}, {logits}, {out}),
              IsOk());
  return out;
}

HostTensor WeightsOf(const HostTensor& logits, int64_t k) {
  HostTensor out(DType::kFloat64, {logits.shape()[0], k});
  EXPECT_THAT(RunKernel("moe_route_weights", {{"k", k}}, {logits}, {out}), IsOk());
  return out;
}

void ExpectSame(const HostTensor& got, const HostTensor& want) {
  ASSERT_EQ(got.shape(), want.shape());
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    ASSERT_EQ(got.as<double>()[i], want.as<double>()[i]) << "element " << i;
  }
}

TEST(KernelTest, MoeRouteIsTheGatesRouting) {
  // The fixed logits of MoeGateRouting: token 2's expert-1 choice dropped.
  HostTensor logits = Vals({3, 3}, {1.0, 2.0, 0.0,  //
                                    0.0, 3.0, 1.0,  //
                                    2.5, 3.0, 0.0});
  HostTensor r = RouteOf(logits, 2, 2);
  const std::vector<int64_t> want = {1 * 2 + 0, 0 * 2 + 0,  //
                                     1 * 2 + 1, 2 * 2 + 0,  //
                                     -1, 0 * 2 + 1};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(r.as<int64_t>()[i], want[i]) << i;
  HostTensor w = WeightsOf(logits, 2);
  HostTensor c = GateCombine(logits, 2, 2);
  EXPECT_EQ(w.as<double>()[0], c.as<double>()[(0 * 3 + 1) * 2 + 0]);
  EXPECT_EQ(w.as<double>()[3], c.as<double>()[(1 * 3 + 2) * 2 + 0]);
  EXPECT_EQ(w.as<double>()[5], c.as<double>()[(2 * 3 + 0) * 2 + 1]);
  EXPECT_GT(w.as<double>()[4], 0.0);  // dropped, but its weight is defined
}

TEST(KernelTest, MoeCompactFormMatchesDense) {
  const int64_t t = 11, e = 4, d = 5;
  for (int64_t k : {int64_t{1}, int64_t{2}}) {
    SCOPED_TRACE(k);
    const int64_t cap = 2;  // some choices overflow
    HostTensor logits = Rand({t, e}, 20 + k, 2.0);
    HostTensor combine = GateCombine(logits, k, cap);
    HostTensor route = RouteOf(logits, k, cap);
    HostTensor w = WeightsOf(logits, k);
    int64_t dropped = 0;
    for (int64_t i = 0; i < t * k; ++i) dropped += route.as<int64_t>()[i] < 0;
    EXPECT_GT(dropped, 0);
    const Attrs dattrs = {{"experts", e}, {"capacity", cap}};
    // Forward: bit for bit (same sums in the same order).
    HostTensor x = Rand({t, d}, 30 + k);
    HostTensor disp_dense(DType::kFloat64, {e, cap, d}), disp(DType::kFloat64, {e, cap, d});
    ASSERT_THAT(RunKernel("moe_dispatch", {}, {x, combine}, {disp_dense}), IsOk());
    ASSERT_THAT(RunKernel("moe_dispatch_idx", dattrs, {x, route}, {disp}), IsOk());
    ExpectSame(disp, disp_dense);
    HostTensor y = Rand({e, cap, d}, 40 + k);
    HostTensor out_dense(DType::kFloat64, {t, d}), out(DType::kFloat64, {t, d});
    ASSERT_THAT(RunKernel("moe_combine", {}, {y, combine}, {out_dense}), IsOk());
    ASSERT_THAT(RunKernel("moe_combine_idx", {}, {y, route, w}, {out}), IsOk());
    ExpectSame(out, out_dense);
    // Backward: dispatch's dx and combine's dy bit for bit; the logits'
    // gradient through combine and the gate, to rounding.
    HostTensor ddisp = Rand({e, cap, d}, 50 + k), dout = Rand({t, d}, 60 + k);
    HostTensor dx_dense = Full({t, d}, 0.0), dx = Full({t, d}, 0.0);
    ASSERT_THAT(RunKernel("moe_dispatch_grad", {}, {x, combine, disp_dense, ddisp},
                          {dx_dense, kAbsent}),
                IsOk());
    ASSERT_THAT(RunKernel("moe_dispatch_idx_grad", dattrs, {x, route, disp, ddisp},
                          {dx, kAbsent}),
                IsOk());
    ExpectSame(dx, dx_dense);
    HostTensor dy_dense = Full({e, cap, d}, 0.0), dy = Full({e, cap, d}, 0.0);
    HostTensor dcombine = Full({t, e, cap}, 0.0), dw = Full({t, k}, 0.0);
    ASSERT_THAT(RunKernel("moe_combine_grad", {}, {y, combine, out_dense, dout},
                          {dy_dense, dcombine}),
                IsOk());
    ASSERT_THAT(RunKernel("moe_combine_idx_grad", {}, {y, route, w, out, dout},
                          {dy, kAbsent, dw}),
                IsOk());
    ExpectSame(dy, dy_dense);
    HostTensor dl_dense = Full({t, e}, 0.0), dl = Full({t, e}, 0.0);
    ASSERT_THAT(RunKernel("moe_gate_grad", {{"k", k}, {"capacity", cap}},
                          {logits, combine, dcombine}, {dl_dense}),
                IsOk());
    ASSERT_THAT(RunKernel("moe_route_weights_grad", {{"k", k}}, {logits, w, dw}, {dl}),
                IsOk());
    ExpectAllNear(dl, dl_dense, 1e-12, "logits gradient");
    double norm = 0;
    for (int64_t i = 0; i < t * e; ++i) norm += std::abs(dl.as<double>()[i]);
    EXPECT_GT(norm, 1e-3);  // the comparison is not of zeros
  }
}

TEST(KernelGradTest, MoeCompact) {
  HostTensor logits = Rand({7, 4}, 71, 2.0);
  for (int64_t k : {int64_t{1}, int64_t{2}}) {
    ExpectGradientsMatch({"moe_route_weights", {{"k", k}}, {Rand({6, 4}, 72 + k, 2.0)}});
    HostTensor route = RouteOf(logits, k, 2);
    ExpectGradientsMatch({"moe_dispatch_idx",
                          {{"experts", int64_t{4}}, {"capacity", int64_t{2}}},
                          {Rand({7, 3}, 74 + k), route}});
    ExpectGradientsMatch(
        {"moe_combine_idx", {}, {Rand({4, 2, 3}, 76 + k), route, WeightsOf(logits, k)}});
  }
}

// Experts split in two halves (attributes "expert_offset", "experts"): the
// halves' dispatch outputs are the whole one's, their combines sum to it.
TEST(KernelTest, MoeCompactExpertShards) {
  const int64_t t = 9, e = 4, cap = 3, d = 2, k = 2;
  HostTensor logits = Rand({t, e}, 81, 2.0);
  HostTensor route = RouteOf(logits, k, cap), w = WeightsOf(logits, k);
  HostTensor x = Rand({t, d}, 82), y = Rand({e, cap, d}, 83);
  HostTensor whole(DType::kFloat64, {e, cap, d}), out(DType::kFloat64, {t, d});
  ASSERT_THAT(RunKernel("moe_dispatch_idx", {{"experts", e}, {"capacity", cap}},
                        {x, route}, {whole}),
              IsOk());
  ASSERT_THAT(RunKernel("moe_combine_idx", {}, {y, route, w}, {out}), IsOk());
  HostTensor sum = Full({t, d}, 0.0), dw_sum = Full({t, k}, 0.0);
  HostTensor dout = Rand({t, d}, 84);
  HostTensor dw = Full({t, k}, 0.0);
  ASSERT_THAT(RunKernel("moe_combine_idx_grad", {}, {y, route, w, out, dout},
                        {kAbsent, kAbsent, dw}),
              IsOk());
  for (int64_t half = 0; half < 2; ++half) {
    const Attrs a = {{"experts", e}, {"capacity", cap}, {"expert_offset", 2 * half}};
    HostTensor part(DType::kFloat64, {2, cap, d});
    ASSERT_THAT(RunKernel("moe_dispatch_idx", a, {x, route}, {part}), IsOk());
    ExpectSame(part, Box(whole, {2 * half, 0, 0}, {2, cap, d}));
    HostTensor ys = Box(y, {2 * half, 0, 0}, {2, cap, d});
    HostTensor o(DType::kFloat64, {t, d});
    ASSERT_THAT(RunKernel("moe_combine_idx", a, {ys, route, w}, {o}), IsOk());
    ASSERT_THAT(RunKernel("moe_combine_idx_grad", a, {ys, route, w, o, dout},
                          {kAbsent, kAbsent, dw_sum}),
                IsOk());
    for (int64_t i = 0; i < t * d; ++i) sum.as<double>()[i] += o.as<double>()[i];
  }
  ExpectAllNear(sum, out, 1e-12, "combine");
  ExpectAllNear(dw_sum, dw, 1e-12, "weights gradient");
}

TEST(KernelTest, MoeCompactRejectsBadRoutes) {
  HostTensor x = Rand({2, 3}, 90);
  HostTensor out(DType::kFloat64, {2, 2, 3});
  const Attrs a = {{"experts", int64_t{2}}, {"capacity", int64_t{2}}};
  HostTensor outside = Ints({2, 1}, {0, 4});  // slots are 0..3
  EXPECT_THAT(RunKernel("moe_dispatch_idx", a, {x, outside}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("route entry [1, 0] = 4 is not a slot")));
  HostTensor twice = Ints({2, 1}, {3, 3});
  EXPECT_THAT(RunKernel("moe_dispatch_idx", a, {x, twice}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("both take slot 3")));
  HostTensor f32 = Full({2, 1}, 0.0);
  EXPECT_THAT(RunKernel("moe_dispatch_idx", a, {x, f32}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be int64")));
  const Attrs beyond = {{"experts", int64_t{3}}, {"expert_offset", int64_t{2}}};
  EXPECT_THAT(RunKernel("moe_dispatch_idx", beyond, {x, Ints({2, 1}, {0, 1})}, {out}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
}

// --- every IR op has both kernels -------------------------------------------------

TEST(KernelTest, EveryOpHasForwardAndBackwardKernels) {
  for (const graph::OpDef* d : graph::OpRegistry::Global().All()) {
    EXPECT_TRUE(HasCpuKernel(d->type)) << d->type;
    EXPECT_TRUE(HasCpuKernel(d->type + "_grad")) << d->type;
  }
  for (const char* k : {"fill_zero", "copy", "accumulate", "sq_norm",
                        "sgd_update", "adam_update"}) {
    EXPECT_TRUE(HasCpuKernel(k)) << k;
  }
  // The kernels of ops run sharded (vocabulary-parallel cross-entropy).
  for (const char* k : {"cross_entropy_lse", "cross_entropy_sharded",
                        "cross_entropy_sharded_grad"}) {
    EXPECT_TRUE(HasCpuKernel(k)) << k;
  }
  // ... and batch-sharded batch_norm.
  for (const char* k : {"batch_norm_stats", "batch_norm_apply",
                        "batch_norm_grad_stats", "batch_norm_grad_apply"}) {
    EXPECT_TRUE(HasCpuKernel(k)) << k;
  }
  std::vector<std::string> names = CpuKernelNames();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(names.size(), 2 * graph::OpRegistry::Global().All().size() + 6 + 3 + 4);
  EXPECT_FALSE(HasCpuKernel("no_such_kernel"));
}

// --- float32 matches float64 --------------------------------------------------------

TEST(KernelTest, Float32MatchesFloat64) {
  struct F {
    std::string op;
    Attrs attrs;
    std::vector<HostTensor> in;
    Shape out;
  };
  std::vector<F> cases = {
      {"linear", {}, {Rand({5, 8}, 1), Rand({3, 8}, 2), Rand({3}, 3)}, {5, 3}},
      {"matmul", {}, {Rand({2, 4, 8}, 4), Rand({2, 8, 3}, 5)}, {2, 4, 3}},
      {"softmax", {{"causal", true}}, {Rand({2, 4, 4}, 6)}, {2, 4, 4}},
      {"layer_norm", {}, {Rand({3, 8}, 7), Rand({8}, 8), Rand({8}, 9)}, {3, 8}},
      {"conv2d", {{"padding", std::vector<int64_t>{1}}},
       {Rand({1, 2, 4, 4}, 10), Rand({3, 2, 3, 3}, 11)}, {1, 3, 4, 4}},
      {"gelu", {}, {Rand({10}, 12, 3.0)}, {10}},
      {"lstm", {}, {Rand({2, 6, 5}, 13), Rand({16, 5}, 14), Rand({16, 4}, 15), Rand({16}, 16)},
       {2, 6, 4}},
  };
  for (const F& c : cases) {
    HostTensor want(DType::kFloat64, c.out), got(DType::kFloat32, c.out);
    std::vector<HostTensor> in32;
    for (const HostTensor& t : c.in) in32.push_back(ToF32(t));
    ASSERT_THAT(RunKernel(c.op, c.attrs, Args(c.in), {want}), IsOk()) << c.op;
    ASSERT_THAT(RunKernel(c.op, c.attrs, Args(in32), {got}), IsOk()) << c.op;
    ExpectAllNear(got, want, 1e-5, c.op);
  }
}

// The float softmax rows are vectorized (kernels_simd.h): rows whose length
// is not a multiple of the vector width, exp's whole range (-100 underflows,
// -inf mask entries) and the LM's 18,328-column rows, forward and backward,
// against the float64 kernels. Tolerances: softmax 1e-5 relative (FastExp's
// few ulp, x - max rounded to float, float sums within blocks of 256; exp
// below -87.3 flushes to 0), log_softmax 1e-6 relative and 1e-5 absolute
// (the log-sum-exp rounded to float); gradients 1e-5 relative and 1e-6
// absolute (from y rounded to float).
TEST(KernelTest, Float32SoftmaxRowsMatchFloat64) {
  for (int64_t cols : {1, 7, 8, 9, 33, 257, 1000, 18328}) {
    HostTensor x = Rand({3, cols}, 100 + cols, 20.0);
    for (int64_t j = 2; j < 3 * cols; j += 7) x.as<double>()[j] = -100.0;
    HostTensor dy = Rand({3, cols}, 200 + cols);
    for (const char* op : {"softmax", "log_softmax"}) {
      const std::string what = absl::StrCat(op, " cols ", cols);
      HostTensor y64(DType::kFloat64, x.shape()),
          y32(DType::kFloat32, x.shape());
      ASSERT_THAT(RunKernel(op, {}, {x}, {y64}), IsOk()) << what;
      ASSERT_THAT(RunKernel(op, {}, {ToF32(x)}, {y32}), IsOk()) << what;
      const bool log = std::string(op) == "log_softmax";
      ExpectRelativelyNear(y32, y64, log ? 1e-6 : 1e-5, log ? 1e-5 : 1e-37,
                           what);
      // The backward from the float64 y, so both see the same y; dx
      // accumulates onto kPrefill.
      HostTensor dx64 = Full(x.shape(), kPrefill);
      HostTensor dx32 = Full(x.shape(), kPrefill, DType::kFloat32);
      const std::string grad = absl::StrCat(op, "_grad");
      ASSERT_THAT(RunKernel(grad, {}, {x, y64, dy}, {dx64}), IsOk()) << what;
      ASSERT_THAT(
          RunKernel(grad, {}, {ToF32(x), ToF32(y64), ToF32(dy)}, {dx32}),
          IsOk())
          << what;
      ExpectRelativelyNear(dx32, dx64, 1e-5, 1e-6, what + " grad");
    }
  }
}

TEST(KernelTest, Float32MaskedCausalSoftmaxMatchesFloat64) {
  // Causal rows keep 1..9 columns of 9 (every tail length); the additive
  // mask has -inf entries (never a whole kept row).
  for (int64_t n : {9, 33}) {
    HostTensor x = Rand({2, n, n}, 300 + n, 10.0);
    HostTensor mask = Rand({n, n}, 400 + n, 2.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; j += 3) {
        mask.as<double>()[i * n + j] = -INFINITY;
      }
    }
    HostTensor dy = Rand({2, n, n}, 500 + n);
    const std::string what = absl::StrCat("causal masked softmax n ", n);
    const Attrs causal = {{"causal", true}};
    HostTensor y64(DType::kFloat64, x.shape()), y32(DType::kFloat32, x.shape());
    ASSERT_THAT(RunKernel("softmax", causal, {x, mask}, {y64}), IsOk());
    ASSERT_THAT(RunKernel("softmax", causal, {ToF32(x), ToF32(mask)}, {y32}),
                IsOk());
    ExpectRelativelyNear(y32, y64, 1e-5, 1e-37, what);
    for (int64_t i = 0; i < y32.num_elements(); ++i) {
      const int64_t row = (i / n) % n, col = i % n;
      if (col > row || std::isinf(mask.as<double>()[row * n + col])) {
        ASSERT_EQ(y32.as<float>()[i], 0.0f) << what << " element " << i;
      }
    }
    HostTensor dx64 = Full(x.shape(), kPrefill);
    HostTensor dx32 = Full(x.shape(), kPrefill, DType::kFloat32);
    ASSERT_THAT(
        RunKernel("softmax_grad", causal, {x, mask, y64, dy}, {dx64, kAbsent}),
        IsOk());
    ASSERT_THAT(RunKernel("softmax_grad", causal,
                          {ToF32(x), ToF32(mask), ToF32(y64), ToF32(dy)},
                          {dx32, kAbsent}),
                IsOk());
    ExpectRelativelyNear(dx32, dx64, 1e-5, 1e-6, what + " grad");
  }
}

// The float gelu runs vectorized loops (kernels_simd.h), the scalar float
// expressions bit for bit: lengths with tails, two threads, against the
// float64 kernels (FastErf's 1.5e-7 absolute error and float rounding).
TEST(KernelTest, Float32GeluMatchesFloat64) {
  for (int64_t n : {1, 7, 8, 9, 33, 257, 1000, 100003}) {
    const std::string what = absl::StrCat("n ", n);
    const HostTensor x = Rand({n}, 500 + n, 6.0), dy = Rand({n}, 510 + n);
    HostTensor y64(DType::kFloat64, {n}), y32(DType::kFloat32, {n});
    ASSERT_THAT(RunKernel("gelu", {}, {x}, {y64}, 0, 2), IsOk()) << what;
    ASSERT_THAT(RunKernel("gelu", {}, {ToF32(x)}, {y32}, 0, 2), IsOk()) << what;
    ExpectAllNear(y32, y64, 2e-6, "gelu " + what);
    HostTensor dx64 = Full({n}, kPrefill);
    HostTensor dx32 = Full({n}, kPrefill, DType::kFloat32);
    ASSERT_THAT(RunKernel("gelu_grad", {}, {x, y64, dy}, {dx64}, 0, 2), IsOk());
    ASSERT_THAT(RunKernel("gelu_grad", {}, {ToF32(x), y32, ToF32(dy)}, {dx32},
                          0, 2),
                IsOk());
    ExpectAllNear(dx32, dx64, 3e-6, "gelu_grad " + what);
  }
}

TEST(KernelTest, ThreadsGiveTheSameResults) {
  // Large enough for the parallel paths.
  HostTensor x = Rand({64, 1024}, 1), g = Rand({1024}, 2), b = Rand({1024}, 3);
  HostTensor dy = Rand({64, 1024}, 4);
  for (const char* op : {"layer_norm", "gelu", "softmax", "dropout"}) {
    std::vector<HostTensor> in = {x};
    if (std::string(op) == "layer_norm") in = {x, g, b};
    HostTensor y1(DType::kFloat64, x.shape()), y4(DType::kFloat64, x.shape());
    ASSERT_THAT(RunKernel(op, {}, Args(in), {y1}, 0, 1), IsOk());
    ASSERT_THAT(RunKernel(op, {}, Args(in), {y4}, 0, 4), IsOk());
    ExpectAllNear(y4, y1, 0, op);
    std::vector<HostTensor> dx1, dx4, gin = in;
    gin.push_back(y1);
    gin.push_back(dy);
    for (const HostTensor& t : in) {
      dx1.push_back(Full(t.shape(), 0.0));
      dx4.push_back(Full(t.shape(), 0.0));
    }
    ASSERT_THAT(RunKernel(std::string(op) + "_grad", {}, Args(gin), Args(dx1), 0, 1), IsOk());
    ASSERT_THAT(RunKernel(std::string(op) + "_grad", {}, Args(gin), Args(dx4), 0, 4), IsOk());
    for (size_t i = 0; i < dx1.size(); ++i) ExpectAllNear(dx4[i], dx1[i], 1e-12, op);
  }
}

// --- sharded-execution attributes ---------------------------------------------------

TEST(KernelShardTest, DropoutShardMaskIsTheSliceOfTheFullMask) {
  const Shape global = {4, 6};
  HostTensor x = Rand(global, 1);
  Attrs attrs = {{"p", 0.4}, {"rng_key", int64_t{123}}};
  HostTensor full(DType::kFloat64, global);
  ASSERT_THAT(RunKernel("dropout", attrs, {x}, {full}, 3), IsOk());
  for (auto [r0, c0, rows, cols] : std::vector<std::array<int64_t, 4>>{
           {2, 3, 2, 3}, {0, 0, 4, 2}, {1, 0, 1, 6}}) {
    Attrs sharded = attrs;
    sharded.Set("global_shape", std::vector<int64_t>(global));
    sharded.Set("offsets", std::vector<int64_t>{r0, c0});
    HostTensor part = Box(x, {r0, c0}, {rows, cols});
    HostTensor y(DType::kFloat64, {rows, cols});
    ASSERT_THAT(RunKernel("dropout", sharded, {part}, {y}, 3), IsOk());
    ExpectAllNear(y, Box(full, {r0, c0}, {rows, cols}), 0, "shard");
  }
  // A different step draws a different mask.
  HostTensor other(DType::kFloat64, global);
  ASSERT_THAT(RunKernel("dropout", attrs, {x}, {other}, 4), IsOk());
  int differ = 0;
  for (int i = 0; i < 24; ++i) differ += (full.as<double>()[i] == 0) != (other.as<double>()[i] == 0);
  EXPECT_GT(differ, 0);
}

TEST(KernelShardTest, DropoutKeepsAboutOneMinusPAndRescales) {
  HostTensor x = Full({100, 100}, 1.0), y(DType::kFloat64, {100, 100});
  ASSERT_THAT(RunKernel("dropout", {{"p", 0.25}}, {x}, {y}), IsOk());
  int kept = 0;
  for (int i = 0; i < 10000; ++i) {
    const double v = y.as<double>()[i];
    ASSERT_TRUE(v == 0 || std::abs(v - 1 / 0.75) < 1e-12) << v;
    kept += v != 0;
  }
  EXPECT_NEAR(kept / 10000.0, 0.75, 0.02);
}

// The float dropout runs vectorized loops (kernels_simd.h) that draw the
// mask in 64-bit lanes: the same mask as the float64 kernel (its scalar
// CounterUniform loop), whole or sharded, and the same float products bit
// for bit: y = x * float(1 / (1 - p)) where kept, 0 elsewhere; the gradient
// accumulates onto kPrefill.
TEST(KernelShardTest, Float32DropoutIsTheFloat64Mask) {
  const Attrs attrs = {{"p", 0.3}, {"rng_key", int64_t{99}}};
  const float scale = static_cast<float>(1.0 / 0.7);
  for (int64_t cols : {1, 7, 8, 9, 33, 257, 1000, 100003}) {
    const Shape global = {3, cols};
    const HostTensor x = Rand(global, 300 + cols);
    const HostTensor dy = Rand(global, 400 + cols);
    HostTensor mask(DType::kFloat64, global);
    ASSERT_THAT(RunKernel("dropout", attrs, {Full(global, 1.0)}, {mask}, 5, 2),
                IsOk());
    // The whole tensor, and a shard: rows [1, 3), columns from an odd offset.
    const int64_t c0 = cols > 2 ? (cols / 3) | 1 : 0;
    for (auto [r0, rows, c1, width] :
         std::vector<std::array<int64_t, 4>>{{0, 3, 0, cols},
                                             {1, 2, c0, cols - c0}}) {
      const std::string what = absl::StrCat("cols ", cols, " shard ", r0, ",",
                                            c1, " width ", width);
      Attrs a = attrs;
      if (r0 != 0 || c1 != 0) {
        a.Set("global_shape", std::vector<int64_t>(global));
        a.Set("offsets", std::vector<int64_t>{r0, c1});
      }
      const HostTensor xs = ToF32(Box(x, {r0, c1}, {rows, width}));
      const HostTensor dys = ToF32(Box(dy, {r0, c1}, {rows, width}));
      HostTensor y(DType::kFloat32, {rows, width});
      HostTensor dx = Full({rows, width}, kPrefill, DType::kFloat32);
      ASSERT_THAT(RunKernel("dropout", a, {xs}, {y}, 5, 2), IsOk()) << what;
      ASSERT_THAT(RunKernel("dropout_grad", a, {xs, y, dys}, {dx}, 5, 2),
                  IsOk())
          << what;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < width; ++c) {
          const int64_t i = r * width + c;
          const bool keep = mask.as<double>()[(r0 + r) * cols + c1 + c] != 0;
          const float want = keep ? xs.as<float>()[i] * scale : 0.0f;
          const float want_dx =
              static_cast<float>(kPrefill) +
              (keep ? dys.as<float>()[i] * scale : 0.0f);
          ASSERT_EQ(y.as<float>()[i], want) << what << " element " << i;
          ASSERT_EQ(dx.as<float>()[i], want_dx) << what << " grad " << i;
        }
      }
    }
  }
}

TEST(KernelShardTest, NllLossGlobalRows) {
  HostTensor logp = Rand({6, 4}, 1);
  HostTensor targets = Ints({6}, {0, 3, 1, 2, 2, 0});
  for (const char* op : {"nll_loss", "cross_entropy"}) {
    HostTensor full = Full({}, 0.0);
    ASSERT_THAT(RunKernel(op, {}, {logp, targets}, {full}), IsOk());
    HostTensor dfull = Full({6, 4}, 0.0);
    ASSERT_THAT(RunKernel(std::string(op) + "_grad", {}, {logp, targets, full, Full({}, 1.0)},
                    {dfull, kAbsent}),
                IsOk());
    double sum = 0;
    for (int64_t r0 : {0, 3}) {
      Attrs a = {{"global_rows", int64_t{6}}};
      HostTensor part = Box(logp, {r0, 0}, {3, 4});
      HostTensor t = Ints({3}, {targets.as<int64_t>()[r0], targets.as<int64_t>()[r0 + 1],
                                targets.as<int64_t>()[r0 + 2]});
      HostTensor loss = Full({}, 0.0), dpart = Full({3, 4}, 0.0);
      ASSERT_THAT(RunKernel(op, a, {part, t}, {loss}), IsOk());
      sum += loss.as<double>()[0];
      ASSERT_THAT(RunKernel(std::string(op) + "_grad", a, {part, t, loss, Full({}, 1.0)},
                      {dpart, kAbsent}),
                  IsOk());
      ExpectAllNear(dpart, Box(dfull, {r0, 0}, {3, 4}), 1e-12, op);
    }
    EXPECT_NEAR(sum, full.as<double>()[0], 1e-12) << op;
  }
}

TEST(KernelShardTest, MeanGlobalCount) {
  HostTensor x = Rand({4, 6}, 1);
  for (const std::vector<int64_t>& axes :
       {std::vector<int64_t>{1}, std::vector<int64_t>{}}) {
    Attrs a = {{"axes", axes}};
    Shape out = axes.empty() ? Shape{} : Shape{4};
    HostTensor full = Full(out, 0.0);
    ASSERT_THAT(RunKernel("mean", a, {x}, {full}), IsOk());
    a.Set("global_count", int64_t{axes.empty() ? 24 : 6});
    HostTensor sum = Full(out, 0.0);
    for (int64_t c0 : {0, 2}) {  // columns [0, 2) and [2, 6)
      HostTensor part = Box(x, {0, c0}, {4, c0 == 0 ? 2 : 4});
      HostTensor y = Full(out, 0.0);
      ASSERT_THAT(RunKernel("mean", a, {part}, {y}), IsOk());
      for (int64_t i = 0; i < y.num_elements(); ++i) sum.as<double>()[i] += y.as<double>()[i];
      HostTensor dx = Full(part.shape(), 0.0);
      ASSERT_THAT(RunKernel("mean_grad", a, {part, y, Full(out, 1.0)}, {dx}), IsOk());
      EXPECT_NEAR(dx.as<double>()[0], 1.0 / (axes.empty() ? 24 : 6), 1e-15);
    }
    ExpectAllNear(sum, full, 1e-12, "mean");
  }
}

TEST(KernelShardTest, EmbeddingVocabOffset) {
  HostTensor table = Rand({10, 3}, 1);
  HostTensor ids = Ints({2, 3}, {0, 9, 4, 5, 7, 4});
  HostTensor full(DType::kFloat64, {2, 3, 3});
  ASSERT_THAT(RunKernel("embedding", {}, {ids, table}, {full}), IsOk());
  HostTensor dy = Rand({2, 3, 3}, 2), dfull = Full({10, 3}, 0.0);
  ASSERT_THAT(RunKernel("embedding_grad", {}, {ids, table, full, dy}, {kAbsent, dfull}),
              IsOk());
  HostTensor sum = Full({2, 3, 3}, 0.0);
  for (int64_t off : {0, 5}) {
    Attrs a = {{"vocab_offset", off}, {"vocab_size", int64_t{10}}};
    HostTensor half = Box(table, {off, 0}, {5, 3});
    HostTensor y(DType::kFloat64, {2, 3, 3});
    ASSERT_THAT(RunKernel("embedding", a, {ids, half}, {y}), IsOk());
    for (int i = 0; i < 18; ++i) sum.as<double>()[i] += y.as<double>()[i];
    HostTensor dhalf = Full({5, 3}, 0.0);
    ASSERT_THAT(RunKernel("embedding_grad", a, {ids, half, y, dy}, {kAbsent, dhalf}), IsOk());
    ExpectAllNear(dhalf, Box(dfull, {off, 0}, {5, 3}), 1e-12, "dtable");
  }
  ExpectAllNear(sum, full, 0, "embedding");
  // Ids outside the vocabulary are errors, even those no shard holds.
  HostTensor bad = Ints({1}, {10});
  HostTensor y(DType::kFloat64, {1, 3});
  EXPECT_THAT(RunKernel("embedding", {{"vocab_offset", int64_t{5}}, {"vocab_size", int64_t{10}}},
                  {bad, Box(table, {5, 0}, {5, 3})}, {y}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("kernel 'embedding'"), HasSubstr("id 10"))));
}

// --- runtime kernels ------------------------------------------------------------------

TEST(RuntimeKernelTest, FillCopyAccumulate) {
  HostTensor out = Full({2, 2}, 3.0);
  ASSERT_THAT(RunKernel("fill_zero", {}, {}, {out}), IsOk());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.as<double>()[i], 0.0);
  HostTensor x = Rand({4}, 1);
  ASSERT_THAT(RunKernel("copy", {}, {x}, {out}), IsOk());  // same element count
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.as<double>()[i], x.as<double>()[i]);
  ASSERT_THAT(RunKernel("accumulate", {}, {x}, {out}), IsOk());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.as<double>()[i], 2 * x.as<double>()[i]);
  HostTensor ids = Ints({3}, {1, 2, 3}), ids2 = Ints({3}, {0, 0, 0});
  ASSERT_THAT(RunKernel("copy", {}, {ids}, {ids2}), IsOk());
  EXPECT_EQ(ids2.as<int64_t>()[2], 3);
  EXPECT_THAT(RunKernel("copy", {}, {x}, {Full({5}, 0.0)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kernel 'copy'")));
}

TEST(RuntimeKernelTest, SqNormAccumulatesInDouble) {
  HostTensor acc = Full({1}, 1.0);
  HostTensor a = Vals({2}, {3.0, 4.0});
  HostTensor b = ToF32(Vals({1}, {0.5}));
  ASSERT_THAT(RunKernel("sq_norm", {}, {a, b, kAbsent}, {acc}), IsOk());
  EXPECT_DOUBLE_EQ(acc.as<double>()[0], 1.0 + 9 + 16 + 0.25);
  EXPECT_THAT(RunKernel("sq_norm", {}, {a}, {Full({1}, 0.0, DType::kFloat32)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("f64[1]")));
}

TEST(RuntimeKernelTest, SgdMomentumWeightDecay) {
  HostTensor p = Vals({2}, {1.0, -2.0}), m = Full({2}, 0.0);
  Attrs a = {{"learning_rate", 0.1}, {"momentum", 0.9}, {"weight_decay", 0.01}};
  ASSERT_THAT(RunKernel("sgd_update", a, {p, Vals({2}, {0.5, -1.0}), kAbsent}, {p, m}), IsOk());
  // g = grad + 0.01 p = (0.51, -1.02); m = g; p -= 0.1 g.
  EXPECT_DOUBLE_EQ(m.as<double>()[0], 0.51);
  EXPECT_DOUBLE_EQ(p.as<double>()[0], 1.0 - 0.051);
  EXPECT_DOUBLE_EQ(p.as<double>()[1], -2.0 + 0.102);
  ASSERT_THAT(RunKernel("sgd_update", a, {p, Vals({2}, {1.0, 0.0}), kAbsent}, {p, m}), IsOk());
  // g = (1 + 0.01 * 0.949, 0.01 * -1.898); m = 0.9 m + g.
  const double g0 = 1.0 + 0.01 * 0.949, m0 = 0.9 * 0.51 + g0;
  EXPECT_DOUBLE_EQ(m.as<double>()[0], m0);
  EXPECT_DOUBLE_EQ(p.as<double>()[0], 0.949 - 0.1 * m0);
  // Without momentum, clipped: norm 4 > 2 scales the gradient by 2 / 4.
  HostTensor q = Vals({1}, {1.0});
  ASSERT_THAT(RunKernel("sgd_update", {{"learning_rate", 1.0}, {"clip_global_norm", 2.0}},
                  {q, Vals({1}, {4.0}), Vals({1}, {16.0})}, {q}),
              IsOk());
  EXPECT_NEAR(q.as<double>()[0], 1.0 - 4.0 * 2.0 / (4.0 + 1e-6), 1e-15);
  // A norm below the threshold leaves the gradient alone.
  ASSERT_THAT(RunKernel("sgd_update", {{"learning_rate", 1.0}, {"clip_global_norm", 5.0}},
                  {q, Vals({1}, {4.0}), Vals({1}, {16.0})}, {q}),
              IsOk());
  EXPECT_NEAR(q.as<double>()[0], 1.0 - 2.0 / (1.0 + 0.25e-6) - 4.0, 1e-12);
}

TEST(RuntimeKernelTest, AdamWTwoSteps) {
  const double lr = 0.01, b1 = 0.8, b2 = 0.9, eps = 1e-8, wd = 0.1;
  Attrs a = {{"learning_rate", lr}, {"beta1", b1}, {"beta2", b2},
             {"epsilon", eps}, {"weight_decay", wd}};
  HostTensor p = Vals({2}, {1.0, -0.5}), m = Full({2}, 0.0), v = Full({2}, 0.0);
  const double g1[2] = {0.3, -2.0}, g2[2] = {-0.1, 1.0};
  ASSERT_THAT(RunKernel("adam_update", a, {p, Vals({2}, {g1[0], g1[1]}), kAbsent}, {p, m, v}, 0),
              IsOk());
  double want[2];
  for (int i = 0; i < 2; ++i) {
    // Step 1: mhat = g, vhat = g^2.
    const double p0 = i == 0 ? 1.0 : -0.5;
    want[i] = p0 * (1 - lr * wd) - lr * g1[i] / (std::abs(g1[i]) + eps);
    EXPECT_NEAR(p.as<double>()[i], want[i], 1e-15);
    EXPECT_NEAR(m.as<double>()[i], (1 - b1) * g1[i], 1e-15);
    EXPECT_NEAR(v.as<double>()[i], (1 - b2) * g1[i] * g1[i], 1e-15);
  }
  ASSERT_THAT(RunKernel("adam_update", a, {p, Vals({2}, {g2[0], g2[1]}), kAbsent}, {p, m, v}, 1),
              IsOk());
  for (int i = 0; i < 2; ++i) {
    const double mm = b1 * (1 - b1) * g1[i] + (1 - b1) * g2[i];
    const double vv = b2 * (1 - b2) * g1[i] * g1[i] + (1 - b2) * g2[i] * g2[i];
    const double mhat = mm / (1 - b1 * b1), vhat = vv / (1 - b2 * b2);
    const double w = want[i] * (1 - lr * wd) - lr * mhat / (std::sqrt(vhat) + eps);
    EXPECT_NEAR(p.as<double>()[i], w, 1e-12);
  }
}

// The float optimizer loops are vectorized (kernels_simd.h): lengths with
// tails, and one long enough for two threads' chunks, against the float64
// kernels element by element (1e-6: float rounding of values near 1).
TEST(RuntimeKernelTest, Float32OptimizersMatchFloat64) {
  for (int64_t n : {1, 7, 17, 1000, 100003}) {
    const std::string what = absl::StrCat("n ", n);
    const HostTensor param = Rand({n}, 600 + n), grad = Rand({n}, 700 + n, 3.0);
    const HostTensor norm = Vals({1}, {4.0 * n});  // clips by about 1/2
    // AdamW, two steps so the moments are non-zero going in.
    const Attrs adam = {{"learning_rate", 1e-2},
                        {"weight_decay", 0.1},
                        {"clip_global_norm", 1.0 * std::sqrt(n)}};
    HostTensor p64 = param, m64 = Full({n}, 0.0), v64 = Full({n}, 0.0);
    HostTensor p32 = ToF32(param), m32 = Full({n}, 0.0, DType::kFloat32),
               v32 = Full({n}, 0.0, DType::kFloat32);
    for (int64_t step : {0, 1}) {
      ASSERT_THAT(RunKernel("adam_update", adam, {p64, grad, norm},
                            {p64, m64, v64}, step, 2),
                  IsOk());
      ASSERT_THAT(RunKernel("adam_update", adam, {p32, ToF32(grad), norm},
                            {p32, m32, v32}, step, 2),
                  IsOk());
    }
    ExpectAllNear(p32, p64, 1e-6, "adam param " + what);
    ExpectAllNear(m32, m64, 1e-6, "adam m " + what);
    ExpectAllNear(v32, v64, 1e-6, "adam v " + what);
    // SGD with momentum and weight decay, and without momentum.
    for (double momentum : {0.9, 0.0}) {
      const Attrs sgd = {{"learning_rate", 0.1},
                         {"momentum", momentum},
                         {"weight_decay", 0.01},
                         {"clip_global_norm", 1.0 * std::sqrt(n)}};
      HostTensor q64 = param, b64 = Full({n}, 0.5);
      HostTensor q32 = ToF32(param), b32 = Full({n}, 0.5, DType::kFloat32);
      ASSERT_THAT(
          RunKernel("sgd_update", sgd, {q64, grad, norm}, {q64, b64}, 0, 2),
          IsOk());
      ASSERT_THAT(RunKernel("sgd_update", sgd, {q32, ToF32(grad), norm},
                            {q32, b32}, 0, 2),
                  IsOk());
      ExpectAllNear(q32, q64, 1e-6,
                    absl::StrCat("sgd momentum ", momentum, " ", what));
      ExpectAllNear(b32, b64, 1e-6,
                    absl::StrCat("sgd buffer ", momentum, " ", what));
    }
    // The squared norm: every float square is exact in double.
    HostTensor acc = Full({1}, 1.0);
    const HostTensor param32 = ToF32(param);
    ASSERT_THAT(RunKernel("sq_norm", {}, {param32}, {acc}), IsOk());
    double want = 1.0;
    for (int64_t i = 0; i < n; ++i) {
      want += double(param32.as<float>()[i]) * param32.as<float>()[i];
    }
    EXPECT_NEAR(acc.as<double>()[0], want, 1e-13 * want) << what;
  }
}

// --- errors -----------------------------------------------------------------------------

TEST(KernelErrorTest, UnknownKernelIsNotFound) {
  EXPECT_THAT(RunKernel("frobnicate", {}, {}, {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("frobnicate")));
}

TEST(KernelErrorTest, BadArgumentsNameTheKernel) {
  auto invalid = [](const std::string& kernel, const std::string& detail) {
    return StatusIs(absl::StatusCode::kInvalidArgument,
                    AllOf(HasSubstr("kernel '" + kernel + "'"), HasSubstr(detail)));
  };
  HostTensor x = Rand({2, 3}, 1), y(DType::kFloat64, {2, 4});
  EXPECT_THAT(RunKernel("linear", {}, {x}, {y}), invalid("linear", "inputs"));
  EXPECT_THAT(RunKernel("linear", {}, {x, Rand({4, 2}, 2)}, {y}), invalid("linear", "input 0"));
  EXPECT_THAT(RunKernel("linear", {}, {x, Rand({4, 3}, 2)}, {HostTensor(DType::kFloat64, {2, 5})}),
              invalid("linear", "output 0"));
  EXPECT_THAT(RunKernel("linear", {}, {x, ToF32(Rand({4, 3}, 2))}, {y}),
              invalid("linear", "input 1"));
  EXPECT_THAT(RunKernel("relu", {}, {Ints({2}, {1, 2})}, {Ints({2}, {0, 0})}),
              invalid("relu", "no floating-point tensor"));
  EXPECT_THAT(RunKernel("matmul", {}, {x, Rand({2, 3}, 3)}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("matmul", "input 0"));
  EXPECT_THAT(RunKernel("add", {}, {x, Rand({4}, 3)}, {y}), invalid("add", "broadcast"));
  EXPECT_THAT(RunKernel("linear_grad", {}, {x, Rand({4, 3}, 2), y}, {kAbsent, kAbsent}),
              invalid("linear_grad", "inputs"));
  EXPECT_THAT(RunKernel("nll_loss", {}, {x, Ints({2}, {0, 3})}, {Full({}, 0.0)}),
              invalid("nll_loss", "target 3"));
  EXPECT_THAT(RunKernel("embedding", {}, {Ints({1}, {-1}), x}, {HostTensor(DType::kFloat64, {1, 3})}),
              invalid("embedding", "id -1"));
  EXPECT_THAT(RunKernel("scale", {}, {x}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("scale", "factor"));
  EXPECT_THAT(RunKernel("softmax", {{"axis", int64_t{0}}}, {x}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("softmax", "last axis"));
  EXPECT_THAT(RunKernel("dropout", {{"p", 0.5}, {"global_shape", std::vector<int64_t>{2, 2}}},
                  {x}, {HostTensor(DType::kFloat64, {2, 3})}),
              invalid("dropout", "global shape"));
  EXPECT_THAT(RunKernel("softmax_grad", {}, {x, x, y, x}, {Full({2, 3}, 0.0), Full({2, 3}, 0.0)}),
              invalid("softmax_grad", "input 1 is not differentiable"));
  EXPECT_THAT(RunKernel("adam_update", {{"learning_rate", 0.1}}, {x, x, kAbsent}, {x}),
              invalid("adam_update", "outputs"));
  HostTensor seq = Rand({2, 3, 4}, 5), lstm_y(DType::kFloat64, {2, 3, 2});
  EXPECT_THAT(RunKernel("lstm", {}, {seq, Rand({8, 4}, 6), Rand({8, 3}, 7)}, {lstm_y}),
              invalid("lstm", "input 2 (f64[8,3]) must be [4 * hidden, hidden]"));
  EXPECT_THAT(RunKernel("lstm", {}, {seq, Rand({8, 3}, 6), Rand({8, 2}, 7)}, {lstm_y}),
              invalid("lstm", "input 1"));
  EXPECT_THAT(RunKernel("lstm", {}, {seq, Rand({8, 4}, 6), Rand({8, 2}, 7), Rand({4}, 8)}, {lstm_y}),
              invalid("lstm", "input 3"));
  EXPECT_THAT(RunKernel("lstm", {}, {x, Rand({8, 3}, 6), Rand({8, 2}, 7)}, {lstm_y}),
              invalid("lstm", "[batch, seq, input]"));
}

}  // namespace
}  // namespace hap::executor
