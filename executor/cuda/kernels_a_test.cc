// Every kernel of the dense, elementwise, reduction, loss and runtime
// families on the GPU against the CPU backend (kernel_compare.h), in float32
// and float64, on shapes that are not multiples of the block sizes, with
// broadcasting, absent inputs/outputs and accumulation into random initial
// gradients. Skips without a GPU.
//
// Tolerances (|got - want| <= atol + rtol * max(|want|, output scale)):
//   element-wise, reductions, losses, optimizers: f32 rtol 1e-5, atol 1e-6
//     (the CPU's float exp/erf are fast approximations within a few ulp;
//     sums are double on both); f64 rtol 1e-12, atol 1e-13.
//   GEMM (linear, matmul): f32 rtol 1e-4, atol 1e-5 (summation order);
//     TF32 (allow_tf32) rtol 5e-3, atol 1e-4 (10-bit mantissa products);
//     f64 rtol 1e-11, atol 1e-12.
//   dropout: the element-wise tolerance; the masks (same counter RNG) must
//     agree, since one wrong element is off by |x| / (1 - p).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/cpu_device.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/kernel_compare.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::testing::HasSubstr;

constexpr DType kF32 = DType::kFloat32;
constexpr DType kF64 = DType::kFloat64;
constexpr DType kDtypes[] = {kF32, kF64};

struct Tol {
  double rtol, atol;
};
Tol ElementTol(DType t) { return t == kF32 ? Tol{1e-5, 1e-6} : Tol{1e-12, 1e-13}; }
Tol GemmTol(DType t) { return t == kF32 ? Tol{1e-4, 1e-5} : Tol{1e-11, 1e-12}; }
constexpr Tol kTf32Tol{5e-3, 1e-4};

// Numpy broadcasting of two shapes (the test's own, for output shapes).
Shape Broadcast(const Shape& a, const Shape& b) {
  const size_t r = std::max(a.size(), b.size());
  Shape s(r);
  for (size_t i = 0; i < r; ++i) {
    const int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    const int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    s[i] = da == 1 ? db : da;
  }
  return s;
}

// The shape sum/mean give for `axes` (all when empty).
Shape Reduced(const Shape& x, std::vector<int64_t> axes, bool keep) {
  std::vector<bool> red(x.size(), axes.empty());
  for (int64_t a : axes) red[a < 0 ? a + x.size() : a] = true;
  Shape s;
  for (size_t d = 0; d < x.size(); ++d) {
    if (!red[d]) {
      s.push_back(x[d]);
    } else if (keep) {
      s.push_back(1);
    }
  }
  return s;
}

class KernelsATest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = CudaAvailable();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.message();
    auto d = NewCudaDevice(0);
    ASSERT_THAT(d, IsOk());
    device_ = std::move(*d);
    CudaDeviceOptions o;
    o.allow_tf32 = true;
    auto t = NewCudaDevice(0, o);
    ASSERT_THAT(t, IsOk());
    tf32_ = std::move(*t);
  }

  HostTensor R(DType t, Shape s, double lo = -2, double hi = 2) {
    return RandomTensor(t, std::move(s), lo, hi, ++seed_);
  }

  // A case: inputs and initial outputs, presence flags (empty = all).
  KernelCase Case(const std::string& kernel, Tol tol,
                  std::vector<HostTensor> in, std::vector<HostTensor> out,
                  graph::Attrs attrs = {}, std::vector<bool> in_present = {},
                  std::vector<bool> out_present = {}) {
    KernelCase c;
    c.kernel = kernel;
    c.attrs = std::move(attrs);
    c.inputs = std::move(in);
    c.outputs = std::move(out);
    c.input_present = std::move(in_present);
    c.output_present = std::move(out_present);
    c.rtol = tol.rtol;
    c.atol = tol.atol;
    return c;
  }

  void Expect(const KernelCase& c, Device* device = nullptr) {
    EXPECT_THAT(CompareWithCpu(device != nullptr ? *device : *device_, c),
                IsOk())
        << c.kernel;
  }

  std::unique_ptr<Device> device_, tf32_;
  uint64_t seed_ = 1000;
};

// --- elementwise ------------------------------------------------------------

TEST_F(KernelsATest, Activations) {
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const char* name : {"relu", "gelu", "sigmoid", "tanh", "silu", "relu6", "hardsigmoid",
                             "hardswish", "exp", "rsqrt", "log"}) {
      // rsqrt and log on positive values (their domain).
      const bool positive = std::string(name) == "rsqrt" || std::string(name) == "log";
      for (Shape s : {Shape{1}, Shape{257}, Shape{3, 1031}}) {
        if (positive) {
          const std::string g = std::string(name) + "_grad";
          Expect(Case(name, tol, {R(t, s, 0.25, 4)}, {R(t, s)}));
          Expect(Case(g, tol, {R(t, s, 0.25, 4), R(t, s), R(t, s)}, {R(t, s)}));
          Expect(Case(g, tol, {R(t, s, 0.25, 4), HostTensor(), R(t, s)}, {R(t, s)}, {},
                      {true, false, true}));
          continue;
        }
        Expect(Case(name, tol, {R(t, s)}, {R(t, s)}));
        const std::string g = std::string(name) + "_grad";
        // y given, y absent; dx accumulates into random values.
        Expect(Case(g, tol, {R(t, s), R(t, s), R(t, s)}, {R(t, s)}));
        Expect(Case(g, tol, {R(t, s), HostTensor(), R(t, s)}, {R(t, s)}, {},
                    {true, false, true}));
        // dy absent, dx absent: nothing to do.
        Expect(Case(g, tol, {R(t, s), R(t, s), HostTensor()}, {R(t, s)}, {},
                    {true, true, false}));
        Expect(Case(g, tol, {R(t, s), R(t, s), R(t, s)}, {HostTensor()}, {},
                    {}, {false}));
      }
    }
  }
}

TEST_F(KernelsATest, Dropout) {
  for (DType t : kDtypes) {
    // A wrong mask element is off by |x| / (1 - p), far beyond the
    // element-wise tolerance (which only allows dropout_grad's accumulation
    // to round differently, e.g. through a fused multiply-add).
    const Tol exact = ElementTol(t);
    // A shard [2:6, 5:38] of an [8, 40] tensor, at step 3.
    graph::Attrs sharded{{"p", 0.3},
                         {"rng_key", int64_t{11}},
                         {"global_shape", std::vector<int64_t>{8, 40}},
                         {"offsets", std::vector<int64_t>{2, 5}}};
    KernelCase c = Case("dropout", exact, {R(t, {4, 33})}, {R(t, {4, 33})},
                        sharded);
    c.ctx.step = 3;
    Expect(c);
    KernelCase g = Case("dropout_grad", exact,
                        {R(t, {4, 33}), R(t, {4, 33}), R(t, {4, 33})},
                        {R(t, {4, 33})}, sharded);
    g.ctx.step = 3;
    Expect(g);
    // Defaults (p 0.1, key 0, unsharded) on odd shapes.
    for (Shape s : {Shape{}, Shape{1000}, Shape{2, 3, 257}}) {
      Expect(Case("dropout", exact, {R(t, s)}, {R(t, s)}));
      Expect(Case("dropout_grad", exact, {R(t, s), R(t, s), R(t, s)},
                  {R(t, s)}, {{"p", 0.5}}));
    }
  }
}

TEST_F(KernelsATest, Scale) {
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (Shape s : {Shape{}, Shape{513}, Shape{7, 9, 11}}) {
      Expect(Case("scale", tol, {R(t, s)}, {R(t, s)}, {{"factor", 2.5}}));
      Expect(Case("scale_grad", tol, {R(t, s), R(t, s), R(t, s)}, {R(t, s)},
                  {{"factor", -0.75}}));
    }
  }
}

TEST_F(KernelsATest, BinaryOpsWithBroadcasting) {
  const std::vector<std::pair<Shape, Shape>> pairs = {
      {{5, 7}, {5, 7}},       {{4, 1, 6}, {3, 1}},     {{300}, {1}},
      {{2, 3, 4}, {}},        {{1, 5}, {6, 1}},        {{64, 512}, {512}},
      {{3000, 70}, {70}},     {{70, 3000}, {70, 1}},   {{2, 1, 3, 1, 5}, {4, 1, 1, 1}},
      {{70000}, {}},  // the scalar's gradient: a split reduction
  };
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const char* name : {"add", "sub", "mul"}) {
      const std::string g = std::string(name) + "_grad";
      for (const auto& [a, b] : pairs) {
        const Shape y = Broadcast(a, b);
        Expect(Case(name, tol, {R(t, a), R(t, b)}, {R(t, y)}));
        Expect(Case(name, tol, {R(t, b), R(t, a)}, {R(t, y)}));
        Expect(Case(g, tol, {R(t, a), R(t, b), R(t, y), R(t, y)},
                    {R(t, a), R(t, b)}));
        Expect(Case(g, tol, {R(t, a), R(t, b), R(t, y), R(t, y)},
                    {HostTensor(), R(t, b)}, {}, {}, {false, true}));
      }
      // An absent operand reads as zero; the output view gives the shape.
      Expect(Case(name, tol, {R(t, {5, 7}), HostTensor()}, {R(t, {5, 7})}, {},
                  {true, false}));
      Expect(Case(name, tol, {HostTensor(), R(t, {5, 7})}, {R(t, {5, 7})}, {},
                  {false, true}));
      Expect(Case(g, tol,
                  {HostTensor(), R(t, {5, 7}), R(t, {5, 7}), R(t, {5, 7})},
                  {HostTensor(), R(t, {5, 7})}, {}, {false, true, true, true},
                  {false, true}));
      // dy absent: a zero gradient.
      Expect(Case(g, tol,
                  {R(t, {5, 7}), R(t, {7}), R(t, {5, 7}), HostTensor()},
                  {R(t, {5, 7}), R(t, {7})}, {}, {true, true, true, false}));
    }
  }
}

// --- reduction --------------------------------------------------------------

TEST_F(KernelsATest, SumAndMean) {
  struct R_ {
    Shape x;
    std::vector<int64_t> axes;
    bool keep;
  };
  const std::vector<R_> cases = {
      {{6, 7, 8}, {}, false},      {{6, 7, 8}, {1}, false},
      {{6, 7, 8}, {0, 2}, true},   {{6, 7, 8}, {-1}, false},
      {{1000, 300}, {0}, false},   {{1000, 300}, {1}, true},
      {{300, 1000}, {1}, false},   {{5000}, {}, false},
      {{3, 1, 4, 5}, {1, 3}, false},
      // Long reductions over few outputs: split across blocks.
      {{3, 70000}, {1}, false},    {{100000}, {}, false},
      {{5, 40000, 2}, {1}, true},
  };
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const R_& c : cases) {
      const Shape y = Reduced(c.x, c.axes, c.keep);
      graph::Attrs attrs{{"keepdims", c.keep}};
      if (!c.axes.empty()) attrs.Set("axes", c.axes);
      graph::Attrs mean_attrs = attrs;
      mean_attrs.Set("global_count", int64_t{12345});
      for (const char* name : {"sum", "mean"}) {
        Expect(Case(name, tol, {R(t, c.x)}, {R(t, y)}, attrs));
        Expect(Case(std::string(name) + "_grad", tol,
                    {R(t, c.x), R(t, y), R(t, y)}, {R(t, c.x)}, attrs));
      }
      Expect(Case("mean", tol, {R(t, c.x)}, {R(t, y)}, mean_attrs));
      Expect(Case("mean_grad", tol, {R(t, c.x), R(t, y), R(t, y)},
                  {R(t, c.x)}, mean_attrs));
    }
  }
}

// --- loss -------------------------------------------------------------------

// The all-gathered row log-sum-exps "cross_entropy_sharded(_grad)" take
// ([ranks x rows], rank-major): `rank`'s slot the true log-sum-exp of x's
// rows over its classes (what cross_entropy_lse gives in a real step), the
// other ranks' random. Both backends may use either form of the local
// softmax only when the slot agrees with x.
HostTensor GatheredLse(HostTensor lse, const HostTensor& x, int64_t rank) {
  const int64_t rows = x.shape()[0], classes = x.shape()[1];
  auto fill = [&](auto* out, const auto* in) {
    for (int64_t i = 0; i < rows; ++i) {
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < classes; ++j) mx = std::max(mx, double(in[i * classes + j]));
      double sum = 0;
      for (int64_t j = 0; j < classes; ++j) sum += std::exp(double(in[i * classes + j]) - mx);
      out[rank * rows + i] = static_cast<std::remove_reference_t<decltype(*out)>>(mx + std::log(sum));
    }
  };
  if (x.dtype() == kF32) {
    fill(lse.as<float>(), x.as<float>());
  } else {
    fill(lse.as<double>(), x.as<double>());
  }
  return lse;
}

TEST_F(KernelsATest, Losses) {
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (DType ids : {DType::kInt64, DType::kInt32}) {
      for (Shape x : {Shape{37, 11}, Shape{5, 3}, Shape{9, 1030}, Shape{1, 1}}) {
        const int64_t rows = x[0], classes = x[1];
        for (const char* name : {"nll_loss", "cross_entropy"}) {
          for (graph::Attrs attrs :
               {graph::Attrs{}, graph::Attrs{{"global_rows", int64_t{100}}}}) {
            HostTensor target = R(ids, {rows}, 0, static_cast<double>(classes));
            Expect(Case(name, tol, {R(t, x), target}, {R(t, {})}, attrs));
            Expect(Case(std::string(name) + "_grad", tol,
                        {R(t, x), target, R(t, {}), R(t, {})},
                        {R(t, x), HostTensor()}, attrs, {},
                        {true, false}));
          }
        }
        // Logits sharded by class: this rank (1 of 2) holds classes
        // [2, 2 + classes) of classes + 5.
        const int64_t vocab = classes + 5;
        const graph::Attrs sharded = {{"vocab_offset", int64_t{2}}, {"vocab_size", vocab},
                                      {"rank", int64_t{1}}, {"ranks", int64_t{2}},
                                      {"global_rows", int64_t{50}}};
        HostTensor target = R(ids, {rows}, 0, static_cast<double>(vocab));
        Expect(Case("cross_entropy_lse", tol, {R(t, x)}, {R(t, {rows})}, sharded));
        HostTensor logits = R(t, x);
        HostTensor lse = GatheredLse(R(t, {2 * rows}), logits, 1);
        Expect(Case("cross_entropy_sharded", tol, {logits, target, lse}, {R(t, {})}, sharded));
        Expect(Case("cross_entropy_sharded_grad", tol, {logits, target, lse, R(t, {})},
                    {R(t, x)}, sharded));
      }
    }
  }
}

// --- runtime ----------------------------------------------------------------

TEST_F(KernelsATest, CopiesAndAccumulate) {
  const Tol exact{0, 0};
  Expect(Case("fill_zero", exact, {}, {R(kF32, {100})}));
  Expect(Case("fill_zero", exact, {}, {R(DType::kInt64, {3, 5}, 0, 9)}));
  Expect(Case("copy", exact, {R(kF64, {3, 4})}, {R(kF64, {12})}));
  Expect(Case("copy", exact, {R(DType::kInt32, {7}, -9, 9)},
              {R(DType::kInt32, {7}, 0, 1)}));
  for (DType t : kDtypes) {
    Expect(Case("accumulate", ElementTol(t), {R(t, {1031})}, {R(t, {1031})}));
  }
}

TEST_F(KernelsATest, SqNorm) {
  const Tol tol{1e-12, 1e-12};
  Expect(Case("sq_norm", tol,
              {R(kF32, {1000}), R(kF64, {77}), HostTensor(), R(kF32, {70000})},
              {R(kF64, {1})}, {}, {true, true, false, true}));
  Expect(Case("sq_norm", tol, {}, {R(kF64, {1})}));
  Expect(Case("sq_norm", tol, {R(kF64, {1})}, {R(kF64, {1})}));
}

TEST_F(KernelsATest, Optimizers) {
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    const Shape s = {33, 17};
    const graph::Attrs sgd{{"learning_rate", 0.1},
                           {"momentum", 0.9},
                           {"weight_decay", 0.01},
                           {"clip_global_norm", 1.0}};
    // Clipping active (norm 5 > 1) and inactive (no norm input).
    Expect(Case("sgd_update", tol,
                {R(t, s), R(t, s), R(kF64, {1}, 25, 26)}, {R(t, s), R(t, s)},
                sgd));
    Expect(Case("sgd_update", tol, {R(t, s), R(t, s)}, {R(t, s), R(t, s)},
                sgd));
    Expect(Case("sgd_update", tol, {R(t, s), R(t, s)}, {R(t, s)},
                {{"learning_rate", 0.05}}));
    const graph::Attrs adam{{"learning_rate", 1e-3}, {"beta1", 0.9},
                            {"beta2", 0.999},        {"epsilon", 1e-8},
                            {"weight_decay", 0.01},  {"clip_global_norm", 1.0}};
    KernelCase c = Case("adam_update", tol,
                        {R(t, s), R(t, s), R(kF64, {1}, 25, 26)},
                        {R(t, s), R(t, s), R(t, s, 0, 1)}, adam);
    c.ctx.step = 4;
    Expect(c);
    Expect(Case("adam_update", tol, {R(t, s), R(t, s)},
                {R(t, s), R(t, s), R(t, s, 0, 1)}, {{"learning_rate", 1e-2}}));
  }
}

// --- dense ------------------------------------------------------------------

TEST_F(KernelsATest, Linear) {
  struct L {
    Shape x;
    int64_t out;
    bool bias;
  };
  const std::vector<L> cases = {{{5, 7}, 3, true},
                                {{2, 3, 33}, 65, false},
                                {{128, 256}, 192, true},
                                {{1, 1}, 1, true}};
  for (DType t : kDtypes) {
    const Tol tol = GemmTol(t);
    for (const L& c : cases) {
      const int64_t in = c.x.back();
      Shape y = c.x;
      y.back() = c.out;
      const Shape w = {c.out, in};
      if (c.bias) {
        Expect(Case("linear", tol, {R(t, c.x), R(t, w), R(t, {c.out})},
                    {R(t, y)}));
        Expect(Case("linear_grad", tol,
                    {R(t, c.x), R(t, w), R(t, {c.out}), R(t, y), R(t, y)},
                    {R(t, c.x), R(t, w), R(t, {c.out})}));
        // Only the weight's and the bias's gradients.
        Expect(Case("linear_grad", tol,
                    {R(t, c.x), R(t, w), R(t, {c.out}), R(t, y), R(t, y)},
                    {HostTensor(), R(t, w), R(t, {c.out})}, {}, {},
                    {false, true, true}));
      } else {
        Expect(Case("linear", tol, {R(t, c.x), R(t, w)}, {R(t, y)}));
        // The bias slot present but absent.
        Expect(Case("linear", tol, {R(t, c.x), R(t, w), HostTensor()},
                    {R(t, y)}, {}, {true, true, false}));
        Expect(Case("linear_grad", tol,
                    {R(t, c.x), R(t, w), R(t, y), R(t, y)},
                    {R(t, c.x), R(t, w)}));
      }
    }
  }
}

TEST_F(KernelsATest, Matmul) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{4, 5}, {5, 6}},
      {{3, 7, 9}, {9, 4}},               // b shared by the batch
      {{2, 3, 7, 9}, {2, 3, 9, 4}},      // batched
      {{8, 64, 96}, {8, 96, 80}},
      {{1, 1}, {1, 1}},
  };
  for (DType t : kDtypes) {
    const Tol tol = GemmTol(t);
    for (const auto& [a, b] : cases) {
      Shape y = a;
      y.back() = b.back();
      Expect(Case("matmul", tol, {R(t, a), R(t, b)}, {R(t, y)}));
      Expect(Case("matmul_grad", tol, {R(t, a), R(t, b), R(t, y), R(t, y)},
                  {R(t, a), R(t, b)}));
      Expect(Case("matmul_grad", tol, {R(t, a), R(t, b), R(t, y), R(t, y)},
                  {R(t, a), HostTensor()}, {}, {}, {true, false}));
    }
  }
}

TEST_F(KernelsATest, Tf32GemmWithinTf32Tolerance) {
  // float32 on the TF32 device: tensor-core precision; float64 unaffected.
  Expect(Case("matmul", kTf32Tol, {R(kF32, {8, 64, 96}), R(kF32, {8, 96, 80})},
              {R(kF32, {8, 64, 80})}),
         tf32_.get());
  Expect(Case("linear_grad", kTf32Tol,
              {R(kF32, {128, 256}), R(kF32, {192, 256}), R(kF32, {192}),
               R(kF32, {128, 192}), R(kF32, {128, 192})},
              {R(kF32, {128, 256}), R(kF32, {192, 256}), R(kF32, {192})}),
         tf32_.get());
  Expect(Case("matmul", GemmTol(kF64),
              {R(kF64, {8, 64, 96}), R(kF64, {8, 96, 80})},
              {R(kF64, {8, 64, 80})}),
         tf32_.get());
}

// --- errors -----------------------------------------------------------------

// Runs `kernel` on the CPU and the GPU with the given tensors (uploaded to
// each) and expects the same InvalidArgument naming the kernel.
class KernelsAErrorTest : public KernelsATest {
 protected:
  absl::Status RunOn(Device& d, const std::string& kernel,
                     const std::vector<HostTensor>& in,
                     const std::vector<HostTensor>& out,
                     const graph::Attrs& attrs) {
    std::vector<void*> owned;
    auto up = [&](const HostTensor& h) {
      TensorView v{h.dtype(), h.shape(), nullptr};
      auto p = d.Allocate(std::max<int64_t>(v.bytes(), 1));
      if (!p.ok()) return v;
      owned.push_back(*p);
      v.data = *p;
      (void)d.CopyFromHost(h.data(), v);
      return v;
    };
    std::vector<TensorView> iv, ov;
    for (const HostTensor& h : in) iv.push_back(up(h));
    for (const HostTensor& h : out) ov.push_back(up(h));
    absl::Status s = d.RunKernel(kernel, {}, attrs, iv, ov);
    (void)d.Synchronize();
    for (void* p : owned) d.Free(p);
    return s;
  }

  void ExpectSameError(const std::string& kernel,
                       const std::vector<HostTensor>& in,
                       const std::vector<HostTensor>& out,
                       const graph::Attrs& attrs = {}) {
    std::unique_ptr<Device> cpu = NewCpuDevice(1);
    absl::Status want = RunOn(*cpu, kernel, in, out, attrs);
    absl::Status got = RunOn(*device_, kernel, in, out, attrs);
    EXPECT_EQ(want.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_EQ(got, want) << kernel;
    EXPECT_THAT(std::string(got.message()),
                HasSubstr("kernel '" + kernel + "'"));
  }
};

TEST_F(KernelsAErrorTest, BadArgumentsAreTheCpusInvalidArgument) {
  ExpectSameError("relu", {R(kF32, {4})}, {R(kF64, {4})});         // dtype
  ExpectSameError("relu", {R(DType::kInt32, {4}, 0, 3)},
                  {R(DType::kInt32, {4}, 0, 3)});                  // no float
  ExpectSameError("add", {R(kF32, {4}), R(kF32, {4}), R(kF32, {4})},
                  {R(kF32, {4})});                                 // arity
  ExpectSameError("add", {R(kF32, {4}), R(kF32, {3})}, {R(kF32, {4})});
  ExpectSameError("matmul", {R(kF32, {4, 5}), R(kF32, {4, 5})},
                  {R(kF32, {4, 5})});                              // shapes
  ExpectSameError("matmul", {R(kF32, {4, 5}), R(kF64, {5, 2})},
                  {R(kF32, {4, 2})});                              // mixed
  ExpectSameError("linear", {R(kF64, {2, 3}), R(kF64, {4, 3})},
                  {R(kF64, {2, 5})});                              // output
  ExpectSameError("sum", {R(kF32, {2, 3})}, {R(kF32, {})},
                  {{"axes", std::vector<int64_t>{2}}});            // axis
  ExpectSameError("nll_loss", {R(kF32, {3, 4}), R(kF32, {3})},
                  {R(kF32, {})});                                  // targets
  ExpectSameError("dropout", {R(kF32, {4})}, {R(kF32, {4})},
                  {{"p", 1.5}});                                   // p
  ExpectSameError("sgd_update", {R(kF32, {4}), R(kF32, {4})}, {R(kF32, {4})},
                  {{"learning_rate", 0.1}, {"momentum", 0.9}});   // no buffer
  ExpectSameError("sq_norm", {R(kF32, {4})}, {R(kF32, {1})});      // not f64
  ExpectSameError("copy", {R(kF32, {4})}, {R(kF32, {5})});         // count
}

}  // namespace
}  // namespace hap::executor
