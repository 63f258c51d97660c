// Every kernel of the layout, normalization, convolution, MoE and recurrent
// (lstm, gru) families on the GPU against the CPU backend (kernel_compare.h),
// in float32 and float64 (and the integer dtypes the data-movement kernels take), on shapes
// that are not multiples of the block sizes, rows longer than a block,
// absent inputs/outputs and accumulation into random initial gradients; and
// the CPU's InvalidArgument for bad arguments. Skips without a GPU.
//
// Tolerances (|got - want| <= atol + rtol * max(|want|, output scale)):
//   layout, pooling: data movement is exact; sums (expand_grad,
//     embedding_grad, pooling backward) f32 rtol 1e-5, atol 1e-6; f64 rtol
//     1e-12, atol 1e-13.
//   normalization: f32 rtol 1e-4, atol 1e-5 (the GPU reduces rows in float,
//     the CPU in double); f64 rtol 1e-11, atol 1e-12.
//   conv2d (exact fp32 GEMM, no TF32), MoE (combine's weight gradient is a
//     GEMM), lstm and gru (GEMMs, their differences carried through the
//     steps): f32 rtol 1e-4, atol 1e-5; f64 rtol 1e-11, atol 1e-12.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/cpu_device.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/kernel_compare.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/op_registry.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::testing::HasSubstr;

constexpr DType kF32 = DType::kFloat32;
constexpr DType kF64 = DType::kFloat64;
constexpr DType kI32 = DType::kInt32;
constexpr DType kI64 = DType::kInt64;
constexpr DType kDtypes[] = {kF32, kF64};
constexpr DType kAllDtypes[] = {kF32, kF64, kI32, kI64};

struct Tol {
  double rtol, atol;
};
Tol ElementTol(DType t) {
  return t == kF32 ? Tol{1e-5, 1e-6} : Tol{1e-12, 1e-13};
}
Tol RowTol(DType t) { return t == kF32 ? Tol{1e-4, 1e-5} : Tol{1e-11, 1e-12}; }
Tol GemmTol(DType t) { return t == kF32 ? Tol{1e-4, 1e-5} : Tol{1e-11, 1e-12}; }
constexpr Tol kExact{0, 0};

using Ints = std::vector<int64_t>;

class KernelsBTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = CudaAvailable();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.message();
    auto d = NewCudaDevice(0);
    ASSERT_THAT(d, IsOk());
    device_ = std::move(*d);
  }

  // Uniform in [lo, hi) (integers for integer dtypes), a fresh seed a call.
  HostTensor R(DType t, Shape s, double lo = -2, double hi = 2) {
    return RandomTensor(t, std::move(s), lo, hi, ++seed_);
  }

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

  void Expect(const KernelCase& c) {
    EXPECT_THAT(CompareWithCpu(*device_, c), IsOk()) << c.kernel;
  }

  std::unique_ptr<Device> device_;
  uint64_t seed_ = 2000;
};

// --- layout ------------------------------------------------------------------

TEST_F(KernelsBTest, Transpose) {
  struct P {
    Shape x;
    Ints perm;
  };
  const P cases[] = {{{37, 300}, {1, 0}},          {{3, 33, 65}, {0, 2, 1}},
                     {{3, 33, 65}, {2, 0, 1}},     {{2, 3, 5, 7}, {3, 1, 0, 2}},
                     {{2, 3, 5, 7}, {0, 1, 2, 3}}, {{4, 1, 6}, {-1, 0, 1}}};
  for (const P& p : cases) {
    Shape y;
    for (int64_t d : p.perm) y.push_back(p.x[d < 0 ? d + p.x.size() : d]);
    const graph::Attrs attrs{{"perm", p.perm}};
    for (DType t : kAllDtypes) {
      Expect(Case("transpose", kExact, {R(t, p.x, -50, 50)}, {R(t, y, 0, 1)},
                  attrs));
    }
    for (DType t : kDtypes) {
      Expect(Case("transpose_grad", ElementTol(t),
                  {R(t, p.x), HostTensor(), R(t, y)}, {R(t, p.x)}, attrs,
                  {true, false, true}));
    }
  }
}

TEST_F(KernelsBTest, ReshapeAndFlatten) {
  for (DType t : kAllDtypes) {
    Expect(Case("reshape", kExact, {R(t, {4, 6}, -9, 9)}, {R(t, {3, 8}, 0, 1)},
                {{"shape", Ints{3, 8}}}));
    Expect(Case("flatten", kExact, {R(t, {2, 3, 45}, -9, 9)},
                {R(t, {2, 135}, 0, 1)}));
  }
  for (DType t : kDtypes) {
    for (const char* k : {"reshape_grad", "flatten_grad"}) {
      Expect(Case(k, ElementTol(t),
                  {R(t, {5, 301}), R(t, {1505}), R(t, {1505})},
                  {R(t, {5, 301})}));
      Expect(Case(k, ElementTol(t), {R(t, {5, 7}), HostTensor(), R(t, {35})},
                  {R(t, {5, 7})}, {}, {true, false, true}));
    }
  }
}

TEST_F(KernelsBTest, ConcatAndSplit) {
  for (DType t : kAllDtypes) {
    Expect(Case("concat", kExact,
                {R(t, {2, 3, 5}, -9, 9), R(t, {2, 4, 5}, -9, 9),
                 R(t, {2, 1, 5}, -9, 9)},
                {R(t, {2, 8, 5}, 0, 1)}, {{"axis", int64_t{1}}}));
    Expect(Case("concat", kExact, {R(t, {7, 300}, -9, 9), R(t, {7, 3}, -9, 9)},
                {R(t, {7, 303}, 0, 1)}, {{"axis", int64_t{-1}}}));
    Expect(Case("split", kExact, {R(t, {6, 10, 3}, -9, 9)},
                {R(t, {6, 3, 3}, 0, 1), R(t, {6, 7, 3}, 0, 1)},
                {{"axis", int64_t{1}}}));
    Expect(Case("split", kExact, {R(t, {9, 4}, -9, 9)},
                {R(t, {2, 4}, 0, 1), R(t, {7, 4}, 0, 1)},
                {{"axis", int64_t{0}}}));
  }
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    // concat_grad: (x0, x1, x2, y, dy) -> (dx0, dx1 absent, dx2).
    Expect(Case("concat_grad", tol,
                {R(t, {2, 3, 5}), R(t, {2, 4, 5}), R(t, {2, 1, 5}),
                 HostTensor(), R(t, {2, 8, 5})},
                {R(t, {2, 3, 5}), HostTensor(), R(t, {2, 1, 5})},
                {{"axis", int64_t{1}}}, {true, true, true, false, true},
                {true, false, true}));
    // split_grad: (x, y0, y1, dy0, dy1) -> dx; sizes from y1 / dy0.
    Expect(Case("split_grad", tol,
                {R(t, {6, 10, 3}), HostTensor(), R(t, {6, 7, 3}),
                 R(t, {6, 3, 3}), HostTensor()},
                {R(t, {6, 10, 3})}, {{"axis", int64_t{1}}},
                {true, false, true, true, false}));
    Expect(Case("split_grad", tol,
                {R(t, {9, 300}), HostTensor(), HostTensor(), R(t, {2, 300}),
                 R(t, {7, 300})},
                {R(t, {9, 300})}, {{"axis", int64_t{0}}},
                {true, false, false, true, true}));
  }
}

TEST_F(KernelsBTest, SliceAtOffsets) {
  struct S {
    Shape x;
    int64_t axis, start, end;
  };
  const S cases[] = {{{5, 40, 3}, 1, 7, 29},
                     {{5, 40, 3}, -1, 1, 2},
                     {{300, 2}, 0, 0, 299},
                     {{4, 1031}, 1, 500, 1031}};
  for (const S& s : cases) {
    Shape y = s.x;
    const int64_t ax = s.axis < 0 ? s.axis + s.x.size() : s.axis;
    y[ax] = s.end - s.start;
    const graph::Attrs attrs{
        {"axis", s.axis}, {"start", s.start}, {"end", s.end}};
    for (DType t : kAllDtypes) {
      Expect(Case("slice", kExact, {R(t, s.x, -9, 9)}, {R(t, y, 0, 1)}, attrs));
    }
    for (DType t : kDtypes) {
      Expect(Case("slice_grad", ElementTol(t),
                  {R(t, s.x), HostTensor(), R(t, y)}, {R(t, s.x)}, attrs,
                  {true, false, true}));
    }
  }
}

TEST_F(KernelsBTest, Expand) {
  struct E {
    Shape x, y;
  };
  const E cases[] = {{{1, 5, 1}, {4, 5, 6}},
                     {{7}, {3, 2, 7}},
                     {{3, 1}, {3, 1000}},
                     {{1}, {2, 3, 5, 7}},
                     {{2, 3}, {2, 3}}};
  for (const E& e : cases) {
    for (DType t : kAllDtypes) {
      Expect(Case("expand", kExact, {R(t, e.x, -9, 9)}, {R(t, e.y, 0, 1)}));
    }
    for (DType t : kDtypes) {
      Expect(Case("expand_grad", ElementTol(t),
                  {R(t, e.x), HostTensor(), R(t, e.y)}, {R(t, e.x)}, {},
                  {true, false, true}));
    }
  }
}

TEST_F(KernelsBTest, EmbeddingWithShardsAndOutOfShardIds) {
  struct Em {
    Shape ids;
    int64_t rows, d, offset, vocab;  // vocab 0: no attribute
  };
  const Em cases[] = {{{4, 33}, 50, 300, 0, 0},
                      {{4, 33}, 20, 7, 10, 50},  // ids outside the shard
                      {{257}, 20, 260, 30, 50},  // last shard
                      {{3, 5}, 1, 3, 0, 0},      // one row, every id 0
                      {{1000}, 13, 33, 0, 0}};   // hot rows
  for (const Em& e : cases) {
    graph::Attrs attrs;
    if (e.offset != 0) attrs.Set("vocab_offset", e.offset);
    if (e.vocab != 0) attrs.Set("vocab_size", e.vocab);
    const int64_t vocab = e.vocab != 0 ? e.vocab : e.rows;
    Shape y = e.ids;
    y.push_back(e.d);
    for (DType t : kDtypes) {
      for (DType it : {kI64, kI32}) {
        HostTensor ids = R(it, e.ids, 0, static_cast<double>(vocab));
        Expect(Case("embedding", kExact, {ids, R(t, {e.rows, e.d})}, {R(t, y)},
                    attrs));
        // (ids, table, y, dy) -> (dids absent, dtable).
        Expect(Case("embedding_grad", ElementTol(t),
                    {ids, R(t, {e.rows, e.d}), HostTensor(), R(t, y)},
                    {HostTensor(), R(t, {e.rows, e.d})}, attrs,
                    {true, true, false, true}, {false, true}));
      }
    }
  }
}

// --- normalization -----------------------------------------------------------

TEST_F(KernelsBTest, LayerNorm) {
  for (DType t : kDtypes) {
    const Tol tol = RowTol(t);
    for (Shape x : {Shape{37, 300}, Shape{5, 3, 1030}, Shape{9, 1},
                    Shape{2000, 64}, Shape{7}, Shape{33, 200}}) {
      const int64_t d = x.back();
      for (graph::Attrs attrs : {graph::Attrs{}, graph::Attrs{{"eps", 1e-3}}}) {
        Expect(Case("layer_norm", tol,
                    {R(t, x), R(t, {d}, 0.5, 1.5), R(t, {d})}, {R(t, x)},
                    attrs));
        // (x, gamma, beta, y, dy) -> (dx, dgamma, dbeta).
        Expect(Case(
            "layer_norm_grad", tol,
            {R(t, x), R(t, {d}, 0.5, 1.5), R(t, {d}), HostTensor(), R(t, x)},
            {R(t, x), R(t, {d}), R(t, {d})}, attrs,
            {true, true, true, false, true}));
      }
      Expect(
          Case("layer_norm_grad", tol,
               {R(t, x), R(t, {d}, 0.5, 1.5), R(t, {d}), HostTensor(), R(t, x)},
               {HostTensor(), R(t, {d}), HostTensor()}, {},
               {true, true, true, false, true}, {false, true, false}));
      Expect(
          Case("layer_norm_grad", tol,
               {R(t, x), R(t, {d}, 0.5, 1.5), R(t, {d}), HostTensor(), R(t, x)},
               {R(t, x), HostTensor(), HostTensor()}, {},
               {true, true, true, false, true}, {true, false, false}));
    }
  }
}

TEST_F(KernelsBTest, SoftmaxWithMasks) {
  for (DType t : kDtypes) {
    const Tol tol = RowTol(t);
    struct M {
      Shape x, mask;  // mask {}: none
      bool causal;
    };
    const M cases[] = {{{37, 300}, {}, false},
                       {{2, 3, 5, 1030}, {3, 1, 1030}, false},
                       {{4, 9, 33}, {33}, false},
                       {{2, 17, 17}, {}, true},
                       {{2, 3, 17, 17}, {3, 1, 17}, true},
                       {{6, 1}, {}, false}};
    for (const M& m : cases) {
      graph::Attrs attrs{{"causal", m.causal}};
      if (m.x.size() == 4) attrs.Set("axis", int64_t{3});
      const bool has_mask = !m.mask.empty();
      std::vector<HostTensor> fin = {R(t, m.x, -4, 4)};
      if (has_mask) fin.push_back(R(t, m.mask, -3, 0));
      Expect(Case("softmax", tol, fin, {R(t, m.x)}, attrs));
      // (x, mask?, y?, dy) -> (dx, dmask absent?): y given and recomputed.
      for (bool with_y : {true, false}) {
        std::vector<HostTensor> in = fin;
        std::vector<bool> present(in.size(), true);
        // y must be the forward's output: computed on the CPU.
        HostTensor y(t, m.x);
        if (with_y) {
          std::unique_ptr<Device> cpu = NewCpuDevice(1);
          std::vector<TensorView> iv, ov = {y.view()};
          for (const HostTensor& h : fin) iv.push_back(h.view());
          ASSERT_THAT(cpu->RunKernel("softmax", {}, attrs, iv, ov), IsOk());
        }
        in.push_back(with_y ? y : HostTensor());
        present.push_back(with_y);
        in.push_back(R(t, m.x));
        present.push_back(true);
        std::vector<HostTensor> out = {R(t, m.x)};
        std::vector<bool> out_present = {true};
        if (has_mask) {
          out.push_back(HostTensor());
          out_present.push_back(false);
        }
        Expect(Case("softmax_grad", tol, in, out, attrs, present, out_present));
      }
    }
    for (Shape x :
         {Shape{37, 300}, Shape{3, 2000}, Shape{5, 1}, Shape{70, 100}}) {
      Expect(Case("log_softmax", tol, {R(t, x, -4, 4)}, {R(t, x)}));
      Expect(Case("log_softmax_grad", tol,
                  {R(t, x, -4, 4), HostTensor(), R(t, x)}, {R(t, x)}, {},
                  {true, false, true}));
    }
  }
}

// --- convolution -------------------------------------------------------------

TEST_F(KernelsBTest, Conv2d) {
  struct C {
    Shape x, w;
    Ints stride, padding;
    bool bias;
    Ints dilation = {1};
  };
  const C cases[] = {{{2, 3, 9, 11}, {4, 3, 3, 3}, {2}, {1}, true},
                     {{3, 5, 8, 8}, {6, 5, 1, 1}, {1}, {0}, true},  // direct
                     {{3, 5, 8, 7}, {6, 5, 1, 1}, {1}, {0}, false},
                     {{2, 3, 10, 9}, {2, 3, 5, 4}, {1, 2}, {0, 1}, false},
                     {{1, 2, 33, 40}, {3, 2, 3, 3}, {1}, {1}, true},
                     {{4, 16, 6, 6}, {8, 16, 3, 3}, {1}, {2}, true},
                     // 72 x 512^2 im2col elements an image: one image per
                     // group under the 2^25-element scratch bound, 3 groups.
                     {{3, 8, 512, 512}, {4, 8, 3, 3}, {1}, {1}, true},
                     // Grouped (2 groups) and depthwise (multiplier 2):
                     // the direct kernels; groups from the shapes.
                     {{2, 4, 9, 8}, {6, 2, 3, 3}, {2}, {1}, true},
                     {{3, 5, 7, 7}, {10, 1, 3, 3}, {1}, {1}, false},
                     // Dilated: im2col, and the direct grouped kernels.
                     {{2, 3, 9, 11}, {4, 3, 3, 2}, {1, 2}, {2, 3}, true, {2, 3}},
                     {{2, 4, 8, 7}, {8, 1, 3, 3}, {1}, {2}, false, {2}}};
  for (DType t : kDtypes) {
    const Tol tol = GemmTol(t);
    for (const C& c : cases) {
      graph::Attrs attrs{{"stride", c.stride}, {"padding", c.padding}};
      if (c.w[1] != c.x[1]) attrs.Set("groups", c.x[1] / c.w[1]);
      attrs.Set("dilation", c.dilation);
      const int64_t sh = c.stride[0], sw = c.stride.back();
      const int64_t ph = c.padding[0], pw = c.padding.back();
      const int64_t dh = c.dilation[0], dw = c.dilation.back();
      const Shape y = {c.x[0], c.w[0], (c.x[2] + 2 * ph - (c.w[2] - 1) * dh - 1) / sh + 1,
                       (c.x[3] + 2 * pw - (c.w[3] - 1) * dw - 1) / sw + 1};
      std::vector<HostTensor> in = {R(t, c.x), R(t, c.w)};
      if (c.bias) in.push_back(R(t, {c.w[0]}));
      Expect(Case("conv2d", tol, in, {R(t, y)}, attrs));
      // (x, w, b?, y, dy) -> (dx, dw, db?), accumulating; some absent.
      std::vector<HostTensor> gin = in;
      gin.push_back(HostTensor());
      gin.push_back(R(t, y));
      std::vector<bool> gp(gin.size(), true);
      gp[gin.size() - 2] = false;
      std::vector<HostTensor> gout = {R(t, c.x), R(t, c.w)};
      if (c.bias) gout.push_back(R(t, {c.w[0]}));
      Expect(Case("conv2d_grad", tol, gin, gout, attrs, gp));
      std::vector<bool> only_dw(gout.size(), false);
      only_dw[1] = true;
      Expect(Case("conv2d_grad", tol, gin, gout, attrs, gp, only_dw));
      std::vector<bool> only_dx(gout.size(), false);
      only_dx[0] = true;
      Expect(Case("conv2d_grad", tol, gin, gout, attrs, gp, only_dx));
    }
  }
}

// conv3d: the same code path with a depth axis (vol2col, the grouped direct
// kernels), against the CPU's.
TEST_F(KernelsBTest, Conv3d) {
  struct C {
    Shape x, w;
    Ints stride, padding;
    bool bias;
    Ints dilation = {1};
  };
  const C cases[] = {
      {{2, 3, 5, 9, 8}, {4, 3, 3, 3, 3}, {1, 2, 2}, {1}, true},
      {{2, 4, 6, 7, 7}, {5, 4, 1, 3, 3}, {1, 2, 1}, {0, 1, 1}, false},  // (2+1)-D: spatial
      {{2, 5, 7, 4, 4}, {3, 5, 3, 1, 1}, {2, 1, 1}, {1, 0, 0}, true},   // and temporal
      {{3, 6, 3, 5, 4}, {4, 6, 1, 1, 1}, {1}, {0}, true},               // direct
      {{1, 2, 6, 6, 7}, {3, 2, 2, 3, 2}, {1}, {2, 1, 1}, true, {2, 1, 3}},
      // 81 x 16 x 64^2 vol2col elements an image: 6 images a group.
      {{8, 3, 16, 64, 64}, {4, 3, 3, 3, 3}, {1}, {1}, true},
      // Grouped and depthwise: the direct kernels.
      {{2, 4, 5, 6, 6}, {6, 2, 3, 3, 3}, {2, 1, 1}, {1}, true},
      {{2, 3, 4, 5, 5}, {6, 1, 3, 3, 3}, {1}, {1}, false, {1, 2, 1}}};
  for (DType t : kDtypes) {
    const Tol tol = GemmTol(t);
    for (const C& c : cases) {
      graph::Attrs attrs{{"stride", c.stride}, {"padding", c.padding}};
      if (c.w[1] != c.x[1]) attrs.Set("groups", c.x[1] / c.w[1]);
      attrs.Set("dilation", c.dilation);
      Shape y = {c.x[0], c.w[0]};
      for (int a = 0; a < 3; ++a) {
        const auto at = [&](const Ints& v) { return v.size() == 1 ? v[0] : v[a]; };
        y.push_back((c.x[2 + a] + 2 * at(c.padding) - (c.w[2 + a] - 1) * at(c.dilation) - 1) /
                        at(c.stride) +
                    1);
      }
      std::vector<HostTensor> in = {R(t, c.x), R(t, c.w)};
      if (c.bias) in.push_back(R(t, {c.w[0]}));
      Expect(Case("conv3d", tol, in, {R(t, y)}, attrs));
      std::vector<HostTensor> gin = in;
      gin.push_back(HostTensor());
      gin.push_back(R(t, y));
      std::vector<bool> gp(gin.size(), true);
      gp[gin.size() - 2] = false;
      std::vector<HostTensor> gout = {R(t, c.x), R(t, c.w)};
      if (c.bias) gout.push_back(R(t, {c.w[0]}));
      Expect(Case("conv3d_grad", tol, gin, gout, attrs, gp));
      std::vector<bool> only_dx(gout.size(), false);
      only_dx[0] = true;
      Expect(Case("conv3d_grad", tol, gin, gout, attrs, gp, only_dx));
    }
  }
}

TEST_F(KernelsBTest, Pooling) {
  struct P {
    Shape x;
    Ints kernel, stride, padding;  // stride {}: the kernel's
  };
  const P max_cases[] = {{{2, 3, 9, 11}, {3}, {2}, {1}},
                         {{2, 3, 8, 8}, {2}, {}, {0}},
                         {{1, 2, 7, 9}, {3}, {1}, {1}},  // overlapping
                         {{2, 1, 9, 10}, {3, 2}, {2, 1}, {1, 0}},
                         {{1, 1, 300, 5}, {5}, {3}, {2}}};
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const P& p : max_cases) {
      graph::Attrs attrs{{"kernel", p.kernel}, {"padding", p.padding}};
      if (!p.stride.empty()) attrs.Set("stride", p.stride);
      const Ints& st = p.stride.empty() ? p.kernel : p.stride;
      const int64_t kh = p.kernel[0], kw = p.kernel.back();
      const int64_t sh = st[0], sw = st.back();
      const int64_t ph = p.padding[0], pw = p.padding.back();
      const Shape y = {p.x[0], p.x[1], (p.x[2] + 2 * ph - kh) / sh + 1,
                       (p.x[3] + 2 * pw - kw) / sw + 1};
      Expect(Case("max_pool2d", kExact, {R(t, p.x)}, {R(t, y)}, attrs));
      Expect(Case("max_pool2d_grad", tol, {R(t, p.x), HostTensor(), R(t, y)},
                  {R(t, p.x)}, attrs, {true, false, true}));
    }
    // ceil_mode and avg_pool2d: output shapes from the op registry.
    struct C {
      Shape x;
      graph::Attrs attrs;
    };
    const C ceil_cases[] = {
        {{2, 3, 13, 10}, {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"ceil_mode", true}}},
        {{1, 2, 9, 8}, {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"padding", Ints{1}}}},
        {{2, 2, 10, 7},
         {{"kernel", Ints{3, 2}}, {"stride", Ints{2}}, {"padding", Ints{1, 0}},
          {"ceil_mode", true}, {"count_include_pad", false}}}};
    for (const C& p : ceil_cases) {
      for (const char* op : {"max_pool2d", "avg_pool2d"}) {
        graph::Attrs attrs = p.attrs;
        if (std::string(op) == "max_pool2d") {
          graph::Attrs m;
          for (const auto& [k, v] : attrs.values()) {
            if (k != "count_include_pad") m.Set(k, v);
          }
          attrs = m;
        }
        auto inferred = graph::InferOp("pool", op, attrs, {"x"},
                                       {{t, p.x}});
        ASSERT_TRUE(inferred.ok()) << inferred.status();
        const Shape y = (*inferred)[0].shape;
        Expect(Case(op, std::string(op) == "max_pool2d" ? kExact : tol,
                    {R(t, p.x)}, {R(t, y)}, attrs));
        Expect(Case(std::string(op) + "_grad", tol,
                    {R(t, p.x), HostTensor(), R(t, y)}, {R(t, p.x)}, attrs,
                    {true, false, true}));
      }
    }
    struct A {
      Shape x;
      Ints out;
      Shape y;
    };
    const A avg_cases[] = {{{2, 3, 9, 11}, {4, 5}, {2, 3, 4, 5}},
                           {{2, 3, 7, 7}, {1}, {2, 3, 1, 1}},
                           {{1, 2, 5, 6}, {13, 17}, {1, 2, 13, 17}},
                           {{3, 2, 32, 32}, {7}, {3, 2, 7, 7}}};
    for (const A& p : avg_cases) {
      const graph::Attrs attrs{{"output_size", p.out}};
      Expect(Case("adaptive_avg_pool2d", tol, {R(t, p.x)}, {R(t, p.y)}, attrs));
      Expect(Case("adaptive_avg_pool2d_grad", tol,
                  {R(t, p.x), HostTensor(), R(t, p.y)}, {R(t, p.x)}, attrs,
                  {true, false, true}));
    }
  }
}

// max_pool3d and avg_pool3d (s3d's and mvit's windows, ceil_mode, both
// divisors) against the CPU's; output shapes from the op registry.
TEST_F(KernelsBTest, Pooling3d) {
  struct C {
    Shape x;
    graph::Attrs attrs;
  };
  const C cases[] = {
      {{2, 3, 4, 9, 8},
       {{"kernel", Ints{1, 3, 3}}, {"stride", Ints{1, 2, 2}}, {"padding", Ints{0, 1, 1}}}},
      {{2, 2, 6, 7, 8},
       {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"padding", Ints{1}}, {"ceil_mode", true}}},
      {{1, 4, 8, 14, 14}, {{"kernel", Ints{2}}, {"stride", Ints{2}}}},
      {{2, 3, 5, 9, 9}, {{"kernel", Ints{3}}, {"stride", Ints{1}}, {"padding", Ints{1}}}},
      {{2, 2, 6, 7, 5},
       {{"kernel", Ints{3, 3, 2}},
        {"stride", Ints{2}},
        {"padding", Ints{1, 1, 0}},
        {"ceil_mode", true}}}};
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const C& p : cases) {
      for (const char* op : {"max_pool3d", "avg_pool3d"}) {
        for (bool include_pad : {true, false}) {
          graph::Attrs attrs = p.attrs;
          const bool max = std::string(op) == "max_pool3d";
          if (max && !include_pad) continue;
          if (!max) attrs.Set("count_include_pad", include_pad);
          auto inferred = graph::InferOp("pool", op, attrs, {"x"}, {{t, p.x}});
          ASSERT_TRUE(inferred.ok()) << inferred.status();
          const Shape y = (*inferred)[0].shape;
          Expect(Case(op, max ? kExact : tol, {R(t, p.x)}, {R(t, y)}, attrs));
          Expect(Case(std::string(op) + "_grad", tol, {R(t, p.x), HostTensor(), R(t, y)},
                      {R(t, p.x)}, attrs, {true, false, true}));
        }
      }
    }
  }
}

// --- batch_norm --------------------------------------------------------------

TEST_F(KernelsBTest, BatchNorm) {
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const Shape& x : {Shape{6, 3, 5, 4}, Shape{9, 7}, Shape{2, 300, 33}}) {
      const Shape ch = {x[1]};
      const graph::Attrs attrs{{"eps", 1e-5}, {"momentum", 0.2}};
      Expect(Case("batch_norm", tol,
                  {R(t, x), R(t, ch), R(t, ch), R(t, ch), R(t, ch, 0.5, 2)},
                  {R(t, x)}, attrs));
      Expect(Case("batch_norm_grad", tol,
                  {R(t, x), R(t, ch), R(t, ch), HostTensor(), HostTensor(),
                   HostTensor(), R(t, x)},
                  {R(t, x), R(t, ch), R(t, ch), HostTensor(), HostTensor()}, attrs,
                  {true, true, true, false, false, false, true},
                  {true, true, true, false, false}));
      // The pieces, on a shard whose statistics come from a larger batch.
      graph::Attrs sharded = attrs;
      sharded.Set("global_count", 2 * graph::NumElements(x) / x[1]);
      const HostTensor sums = R(DType::kFloat64, {2, x[1]}, 0.5, 3);
      Expect(Case("batch_norm_stats", tol, {R(t, x)}, {R(DType::kFloat64, {2, x[1]})},
                  sharded));
      Expect(Case("batch_norm_apply", tol,
                  {R(t, x), R(t, ch), R(t, ch), R(t, ch), R(t, ch, 0.5, 2), sums},
                  {R(t, x)}, sharded));
      Expect(Case("batch_norm_grad_stats", tol, {R(t, x), sums, R(t, x)},
                  {R(DType::kFloat64, {2, x[1]})}, sharded));
      Expect(Case("batch_norm_grad_apply", tol,
                  {R(t, x), R(t, ch), sums, R(DType::kFloat64, {2, x[1]}), R(t, x)},
                  {R(t, x), R(t, ch), R(t, ch)}, sharded));
    }
  }
}

// --- lstm, gru ---------------------------------------------------------------

// `op` (lstm or gru, `gates` stacked gates) on batch, sequence and hidden
// sizes that are not multiples of the block size, both directions, without
// biases and with one bias absent; every gradient together (accumulating
// into random initial values) and each alone. The recurrence carries the
// GEMMs' different summation orders through the steps: GemmTol.
class RecurrentKernelsTest : public KernelsBTest {
 protected:
  void ExpectRecurrent(const std::string& op, int64_t gates) {
    struct P {
      int64_t b, s, in, h;
      bool bias_ih, bias_hh;
    };
    const P cases[] = {{5, 9, 33, 70, true, true},
                       {1, 1, 3, 2, true, true},
                       {3, 12, 8, 300, false, false},
                       {2, 4, 5, 7, false, true},
                       {2, 4, 5, 7, true, false}};
    for (DType t : kDtypes) {
      const Tol tol = GemmTol(t);
      for (const P& p : cases) {
        for (bool reverse : {false, true}) {
          const graph::Attrs attrs{{"reverse", reverse}};
          const Shape x = {p.b, p.s, p.in}, wi = {gates * p.h, p.in}, wh = {gates * p.h, p.h};
          const Shape bias = {gates * p.h}, y = {p.b, p.s, p.h};
          const double w = 1.0 / std::sqrt(static_cast<double>(p.h));
          const std::vector<HostTensor> in = {R(t, x), R(t, wi, -w, w), R(t, wh, -w, w),
                                              p.bias_ih ? R(t, bias, -w, w) : HostTensor(),
                                              p.bias_hh ? R(t, bias, -w, w) : HostTensor()};
          const std::vector<bool> present = {true, true, true, p.bias_ih, p.bias_hh};
          Expect(Case(op, tol, in, {R(t, y)}, attrs, present));
          // (x, w_ih, w_hh, b_ih, b_hh, y absent, dy) -> the gradients.
          std::vector<HostTensor> gin = in;
          gin.push_back(HostTensor());
          gin.push_back(R(t, y));
          std::vector<bool> gp = present;
          gp.push_back(false);
          gp.push_back(true);
          auto grads = [&] {
            return std::vector<HostTensor>{R(t, x), R(t, wi), R(t, wh),
                                           p.bias_ih ? R(t, bias) : HostTensor(),
                                           p.bias_hh ? R(t, bias) : HostTensor()};
          };
          Expect(Case(op + "_grad", tol, gin, grads(), attrs, gp, present));
          for (int i = 0; i < 5; ++i) {
            if (!present[i]) continue;
            std::vector<bool> one(5, false);
            one[i] = true;
            Expect(Case(op + "_grad", tol, gin, grads(), attrs, gp, one));
          }
        }
      }
    }
  }
};

TEST_F(RecurrentKernelsTest, Lstm) { ExpectRecurrent("lstm", 4); }

// GRU: b_ih and b_hh enter differently (b_hn inside r * (...)), so each
// alone is a case of its own.
TEST_F(RecurrentKernelsTest, Gru) { ExpectRecurrent("gru", 3); }

// --- MoE ---------------------------------------------------------------------

// Sparse combine weights [tokens, experts, capacity]: each entry nonzero
// with probability about `density` (a fixed pattern), so slots hold zero,
// one or several tokens and tokens any number of slots.
HostTensor SparseCombine(DType t, int64_t tokens, int64_t experts,
                         int64_t capacity, double density, uint64_t seed) {
  HostTensor w = RandomTensor(t, {tokens, experts, capacity}, 0.1, 1, seed);
  HostTensor keep =
      RandomTensor(kF64, {tokens, experts, capacity}, 0, 1, seed + 1);
  for (int64_t i = 0; i < w.num_elements(); ++i) {
    if (keep.as<double>()[i] >= density) {
      if (t == kF32) {
        w.as<float>()[i] = 0;
      } else {
        w.as<double>()[i] = 0;
      }
    }
  }
  return w;
}

TEST_F(KernelsBTest, MoeGateWithUnevenLoads) {
  struct G {
    int64_t tokens, experts, k, capacity;
  };
  const G cases[] = {{50, 6, 2, 12},
                     {300, 8, 2, 40},
                     {33, 4, 1, 20},
                     {600, 16, 3, 100},
                     {10, 3, 3, 10}};
  for (DType t : kDtypes) {
    const Tol tol = ElementTol(t);
    for (const G& g : cases) {
      HostTensor logits = R(t, {g.tokens, g.experts});
      // Expert 0 is popular: it overflows its capacity.
      for (int64_t i = 0; i < g.tokens; ++i) {
        if (t == kF32) {
          logits.as<float>()[i * g.experts] += 1.5f;
        } else {
          logits.as<double>()[i * g.experts] += 1.5;
        }
      }
      const graph::Attrs attrs{{"k", g.k}, {"capacity", g.capacity}};
      const Shape c = {g.tokens, g.experts, g.capacity};
      Expect(Case("moe_gate", tol, {logits}, {R(t, c)}, attrs));
      Expect(Case("moe_gate_grad", tol, {logits, HostTensor(), R(t, c)},
                  {R(t, {g.tokens, g.experts})}, attrs, {true, false, true}));
    }
  }
}

TEST_F(KernelsBTest, MoeDispatchAndCombine) {
  struct M {
    int64_t tokens, experts, capacity, d;
    double density;
  };
  const M cases[] = {{300, 4, 70, 300, 0.01},
                     {50, 3, 20, 5, 0.05},
                     {7, 2, 3, 1030, 0.3},
                     {260, 2, 130, 16, 0.004}};
  for (DType t : kDtypes) {
    const Tol tol = GemmTol(t);
    for (const M& m : cases) {
      const HostTensor w =
          SparseCombine(t, m.tokens, m.experts, m.capacity, m.density, ++seed_);
      ++seed_;
      const Shape x = {m.tokens, m.d}, y = {m.experts, m.capacity, m.d};
      const Shape c = {m.tokens, m.experts, m.capacity};
      Expect(Case("moe_dispatch", tol, {R(t, x), w}, {R(t, y)}));
      // (x, combine, y, dy) -> (dx, dcombine absent).
      Expect(Case("moe_dispatch_grad", tol, {R(t, x), w, HostTensor(), R(t, y)},
                  {R(t, x), HostTensor()}, {}, {true, true, false, true},
                  {true, false}));
      Expect(Case("moe_combine", tol, {R(t, y), w}, {R(t, x)}));
      // (y, combine, out, dout) -> (dy, dcombine), each alone and together.
      const std::vector<HostTensor> gin = {R(t, y), w, HostTensor(), R(t, x)};
      const std::vector<bool> gp = {true, true, false, true};
      Expect(Case("moe_combine_grad", tol, gin, {R(t, y), R(t, c)}, {}, gp));
      Expect(Case("moe_combine_grad", tol, gin, {R(t, y), R(t, c)}, {}, gp,
                  {true, false}));
      Expect(Case("moe_combine_grad", tol, gin, {R(t, y), R(t, c)}, {}, gp,
                  {false, true}));
    }
  }
}

// The gate's routing feeds dispatch and combine as in a model.
TEST_F(KernelsBTest, MoeGateOutputDrivesDispatch) {
  for (DType t : kDtypes) {
    std::unique_ptr<Device> cpu = NewCpuDevice(1);
    HostTensor logits = R(t, {300, 8});
    HostTensor combine(t, {300, 8, 50});
    std::vector<TensorView> in = {logits.view()}, out = {combine.view()};
    ASSERT_THAT(
        cpu->RunKernel("moe_gate", {},
                       {{"k", int64_t{2}}, {"capacity", int64_t{50}}}, in, out),
        IsOk());
    Expect(Case("moe_dispatch", GemmTol(t), {R(t, {300, 260}), combine},
                {R(t, {8, 50, 260})}));
    Expect(Case("moe_combine", GemmTol(t), {R(t, {8, 50, 260}), combine},
                {R(t, {300, 260})}));
  }
}

// The compact form: the route (int64 slots), the weights, the index
// dispatch and combine, whole and for shards of it: the upper half of the
// experts, a middle range, and a range of every expert's capacity rows.
// dispatch_idx's backward only adds, in the CPU's order: exact.
TEST_F(KernelsBTest, MoeCompactForm) {
  struct M {
    int64_t tokens, experts, k, capacity, d;
  };
  const M cases[] = {{300, 8, 2, 40, 260}, {33, 4, 1, 20, 5}, {600, 16, 3, 100, 16}};
  for (DType t : kDtypes) {
    std::unique_ptr<Device> cpu = NewCpuDevice(1);
    for (const M& m : cases) {
      HostTensor logits = R(t, {m.tokens, m.experts});
      for (int64_t i = 0; i < m.tokens; ++i) {  // expert 0 overflows
        if (t == kF32) {
          logits.as<float>()[i * m.experts] += 1.5f;
        } else {
          logits.as<double>()[i * m.experts] += 1.5;
        }
      }
      const graph::Attrs gate{{"k", m.k}, {"capacity", m.capacity}};
      const Shape tk = {m.tokens, m.k};
      HostTensor route(kI64, tk);
      std::vector<TensorView> in = {logits.view()}, out = {route.view()};
      ASSERT_THAT(cpu->RunKernel("moe_route", {}, gate, in, out), IsOk());
      Expect(Case("moe_route", kExact, {logits}, {HostTensor(kI64, tk)}, gate));
      const graph::Attrs top{{"k", m.k}};
      Expect(Case("moe_route_weights", ElementTol(t), {logits}, {R(t, tk)}, top));
      Expect(Case("moe_route_weights_grad", ElementTol(t),
                  {logits, HostTensor(), R(t, tk)}, {R(t, {m.tokens, m.experts})},
                  top, {true, false, true}));
      HostTensor w = R(t, tk);
      const Shape x = {m.tokens, m.d};
      struct Shard {
        int64_t offset, experts, capacity_offset, capacity;
      };
      for (const Shard& sh : {Shard{0, m.experts, 0, m.capacity},
                              Shard{m.experts / 2, m.experts - m.experts / 2, 0, m.capacity},
                              Shard{1, m.experts / 2, 0, m.capacity},
                              Shard{0, m.experts, m.capacity / 4, m.capacity / 2}}) {
        const graph::Attrs a{{"experts", m.experts},
                             {"capacity", m.capacity},
                             {"expert_offset", sh.offset},
                             {"capacity_offset", sh.capacity_offset}};
        const Shape y = {sh.experts, sh.capacity, m.d};
        Expect(Case("moe_dispatch_idx", kExact, {R(t, x), route}, {R(t, y)}, a));
        // (x, route, y, dy) -> (dx, droute absent).
        Expect(Case("moe_dispatch_idx_grad", kExact, {R(t, x), route, HostTensor(), R(t, y)},
                    {R(t, x), HostTensor()}, a, {true, true, false, true}, {true, false}));
        Expect(Case("moe_combine_idx", RowTol(t), {R(t, y), route, w}, {R(t, x)}, a));
        // (y, route, w, out, dout) -> (dy, droute absent, dw): each alone
        // and together.
        const std::vector<HostTensor> gin = {R(t, y), route, w, HostTensor(), R(t, x)};
        const std::vector<bool> gp = {true, true, true, false, true};
        for (const std::vector<bool>& op :
             {std::vector<bool>{true, false, true}, {true, false, false},
              {false, false, true}}) {
          Expect(Case("moe_combine_idx_grad", RowTol(t), gin,
                      {R(t, y), HostTensor(), R(t, tk)}, a, gp, op));
        }
      }
    }
  }
}

// Grouped routing (the form the planner splits by tokens): this rank's 300
// of 600 tokens from token 300 on, in groups of 100, each group filling its
// own 10 of every expert's 60 slots; expert 0 overflows in every group.
TEST_F(KernelsBTest, MoeGroupedRoute) {
  for (DType t : kDtypes) {
    HostTensor logits = R(t, {300, 8});
    for (int64_t i = 0; i < 300; ++i) {
      if (t == kF32) {
        logits.as<float>()[i * 8] += 1.5f;
      } else {
        logits.as<double>()[i * 8] += 1.5;
      }
    }
    const graph::Attrs a{{"k", int64_t{2}},
                         {"capacity", int64_t{60}},
                         {"group_size", int64_t{100}},
                         {"global_tokens", int64_t{600}},
                         {"token_offset", int64_t{300}}};
    Expect(Case("moe_route", kExact, {logits}, {HostTensor(kI64, {300, 2})}, a));
  }
}

// --- errors ------------------------------------------------------------------

// Runs `kernel` on a device with the given tensors (uploaded) and returns
// the status of the call and of the synchronization after it.
absl::Status RunOn(Device& d, const std::string& kernel,
                   const std::vector<HostTensor>& in,
                   const std::vector<HostTensor>& out,
                   const graph::Attrs& attrs) {
  std::vector<void*> owned;
  auto up = [&](const HostTensor& h) {
    TensorView v{h.dtype(), h.shape(), nullptr};
    if (h.data() == nullptr) return v;  // HostTensor(): absent
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
  absl::Status sync = d.Synchronize();
  for (void* p : owned) d.Free(p);
  return s.ok() ? sync : s;
}

class KernelsBErrorTest : public KernelsBTest {
 protected:
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

TEST_F(KernelsBErrorTest, BadArgumentsAreTheCpusInvalidArgument) {
  ExpectSameError("transpose", {R(kF32, {2, 3})}, {R(kF32, {3, 2})},
                  {{"perm", Ints{0, 0}}});  // not a perm
  ExpectSameError("transpose", {R(kF32, {2, 3})}, {R(kF32, {2, 3})},
                  {{"perm", Ints{1, 0}}});  // out shape
  ExpectSameError("transpose_grad",
                  {R(kF32, {2, 3}), R(kF64, {3, 2}), R(kF64, {3, 2})},
                  {R(kF32, {2, 3})}, {{"perm", Ints{1, 0}}});  // dtype
  ExpectSameError("reshape", {R(kF32, {2, 3})}, {R(kF32, {7})});
  ExpectSameError("concat", {R(kF32, {2, 3}), R(kF32, {3, 3})},
                  {R(kF32, {5, 3})}, {{"axis", int64_t{1}}});  // off axis
  ExpectSameError("split", {R(kF64, {4, 3})},
                  {R(kF64, {1, 3}), R(kF64, {2, 3})},
                  {{"axis", int64_t{0}}});  // sizes
  ExpectSameError("slice", {R(kF32, {4, 3})}, {R(kF32, {2, 3})},
                  {{"axis", int64_t{0}},
                   {"start", int64_t{3}},
                   {"end", int64_t{5}}});  // range
  ExpectSameError("expand", {R(kF32, {2, 3})}, {R(kF32, {4, 3})});
  ExpectSameError("embedding", {R(kF32, {4}), R(kF32, {5, 3})},
                  {R(kF32, {4, 3})});  // float ids
  ExpectSameError(
      "embedding", {R(kI64, {4}, 0, 5), R(kF32, {5, 3})}, {R(kF32, {4, 3})},
      {{"vocab_offset", int64_t{4}}, {"vocab_size", int64_t{8}}});  // shard
  ExpectSameError("layer_norm", {R(kF32, {4, 3}), R(kF32, {4}), R(kF32, {3})},
                  {R(kF32, {4, 3})});  // gamma
  ExpectSameError("layer_norm",
                  {R(kI32, {4, 3}, 0, 3), R(kF32, {3}), R(kF32, {3})},
                  {R(kF32, {4, 3})});  // dtype
  ExpectSameError("softmax", {R(kF32, {4, 3})}, {R(kF32, {4, 3})},
                  {{"axis", int64_t{0}}});  // axis
  ExpectSameError("softmax", {R(kF32, {4, 3}), R(kF32, {2, 3})},
                  {R(kF32, {4, 3})});  // mask
  ExpectSameError("log_softmax", {R(kF32, {4, 3}), R(kF32, {4, 3})},
                  {R(kF32, {4, 3})});  // arity
  ExpectSameError("conv2d", {R(kF32, {1, 3, 5, 5}), R(kF32, {2, 4, 3, 3})},
                  {R(kF32, {1, 2, 3, 3})});  // channels
  ExpectSameError("conv2d", {R(kF32, {2, 0, 7, 7}), R(kF32, {4, 5, 3, 3})},
                  {R(kF32, {2, 4, 5, 5})});  // no image channels (divided by before)
  ExpectSameError("conv2d", {R(kF32, {1, 2, 5, 5}), R(kF32, {3, 2, 0, 3})},
                  {R(kF32, {1, 3, 6, 3})});  // an empty kernel
  ExpectSameError("conv2d",
                  {R(kF32, {1, 3, 5, 5}), R(kF32, {2, 3, 3, 3}), R(kF32, {3})},
                  {R(kF32, {1, 2, 3, 3})});  // bias
  ExpectSameError("conv3d", {R(kF32, {1, 2, 5, 5}), R(kF32, {2, 2, 3, 3, 3})},
                  {R(kF32, {1, 2, 3, 3})});  // a 4-D image
  ExpectSameError("conv3d", {R(kF32, {1, 2, 5, 5, 5}), R(kF32, {2, 2, 3, 3})},
                  {R(kF32, {1, 2, 3, 3, 3})});  // a 4-D weight
  ExpectSameError("conv3d", {R(kF32, {1, 2, 2, 5, 5}), R(kF32, {2, 2, 3, 3, 3})},
                  {R(kF32, {1, 2, 1, 3, 3})});  // a kernel deeper than the clip
  ExpectSameError("max_pool3d", {R(kF32, {1, 1, 5, 5})}, {R(kF32, {1, 1, 2, 2})},
                  {{"kernel", Ints{2}}});  // a 4-D input
  ExpectSameError("avg_pool3d", {R(kF32, {1, 1, 4, 5, 5})}, {R(kF32, {1, 1, 2, 2, 2})},
                  {{"kernel", Ints{2, 2}}});  // a 2-element kernel
  ExpectSameError("max_pool2d", {R(kF32, {1, 1, 5, 5})},
                  {R(kF32, {1, 1, 3, 3})},
                  {{"kernel", Ints{2}}, {"padding", Ints{2}}});  // padding
  ExpectSameError("adaptive_avg_pool2d", {R(kF32, {1, 5, 5})},
                  {R(kF32, {1, 1, 1})}, {{"output_size", Ints{1}}});
  ExpectSameError("moe_gate", {R(kF32, {5, 3})}, {R(kF32, {5, 3, 2})},
                  {{"k", int64_t{4}}, {"capacity", int64_t{2}}});  // k
  ExpectSameError("moe_dispatch", {R(kF32, {5, 4}), R(kF32, {6, 3, 2})},
                  {R(kF32, {3, 2, 4})});  // tokens
  ExpectSameError("moe_combine_grad",
                  {R(kF32, {3, 2, 4}), R(kF32, {5, 3, 2}), R(kF32, {5, 4}),
                   R(kF32, {5, 5})},
                  {R(kF32, {3, 2, 4}), R(kF32, {5, 3, 2})});  // dout
}

// An id outside the vocabulary is found on the GPU: the device reports the
// kernel's InvalidArgument at the next synchronization.
TEST_F(KernelsBErrorTest, EmbeddingIdOutsideTheVocabulary) {
  HostTensor ids(kI64, {3});
  ids.as<int64_t>()[0] = 1;
  ids.as<int64_t>()[1] = 9;  // vocabulary [0, 5)
  ids.as<int64_t>()[2] = 0;
  for (const char* k : {"embedding", "embedding_grad"}) {
    const bool grad = std::string(k) == "embedding_grad";
    std::vector<HostTensor> in = {ids, R(kF32, {5, 3})};
    std::vector<HostTensor> out = {R(kF32, {3, 3})};
    if (grad) {
      in.push_back(R(kF32, {3, 3}));
      in.push_back(R(kF32, {3, 3}));
      out = {HostTensor(), R(kF32, {5, 3})};
    }
    absl::Status s = RunOn(*device_, k, in, out, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(k));
  }
}

}  // namespace
}  // namespace hap::executor
