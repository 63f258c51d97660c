// Types, attributes, shape helpers, the builder and the op registry.
#include "planner/graph/graph.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/op_registry.h"
#include "planner/graph/op_util.h"
#include "planner/graph/test_util.h"
#include "planner/graph/types.h"

namespace hap::graph {
namespace {

using ::hap::graph::testing::IsOk;
using ::hap::graph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

TEST(TypesTest, DTypes) {
  EXPECT_EQ(DTypeBytes(DType::kFloat32), 4);
  EXPECT_EQ(DTypeBytes(DType::kFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kFloat64), 8);
  EXPECT_EQ(DTypeBytes(DType::kInt32), 4);
  EXPECT_EQ(DTypeBytes(DType::kInt64), 8);
  EXPECT_TRUE(IsFloating(DType::kBFloat16));
  EXPECT_FALSE(IsFloating(DType::kInt32));
  EXPECT_TRUE(IsInteger(DType::kInt64));
  EXPECT_EQ(TypeString(F32({32, 768})), "f32[32,768]");
  EXPECT_EQ(TypeString(I64({})), "i64[]");
  EXPECT_EQ(TensorType({DType::kFloat16, {2, 3}}).bytes(), 12);
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                  DType::kFloat64, DType::kInt32, DType::kInt64}) {
    EXPECT_EQ(FromProtoDType(ToProtoDType(d)), d);
  }
}

TEST(TypesTest, CheckedNumElements) {
  EXPECT_THAT(CheckedNumElements({}), IsOk());
  EXPECT_EQ(*CheckedNumElements({}), 1);
  EXPECT_EQ(*CheckedNumElements({2, 3, 4}), 24);
  EXPECT_EQ(*CheckedNumElements({int64_t{1} << 59}), int64_t{1} << 59);
  EXPECT_THAT(CheckedNumElements({2, 0}),
              StatusIs(kInvalid, AllOf(HasSubstr("dimension 1"),
                                       HasSubstr("[2,0]"), HasSubstr("is 0"))));
  EXPECT_THAT(CheckedNumElements({-1}),
              StatusIs(kInvalid, HasSubstr("must be positive")));
  EXPECT_THAT(CheckedNumElements({std::numeric_limits<int64_t>::min()}),
              StatusIs(kInvalid, HasSubstr("must be positive")));
  EXPECT_THAT(
      CheckedNumElements({int64_t{1} << 32, int64_t{1} << 32}),
      StatusIs(kInvalid, HasSubstr("more elements than fit in 64 bits")));
  EXPECT_THAT(CheckedNumElements({std::numeric_limits<int64_t>::max(), 2}),
              StatusIs(kInvalid, HasSubstr("64 bits")));
  EXPECT_THAT(CheckedNumElements({int64_t{1} << 59, 2}),
              StatusIs(kInvalid, HasSubstr("too large")));
  // Dimensions past what a sharding form names (an imported graph's).
  EXPECT_THAT(CheckedNumElements(Shape(128, 1)), IsOk());
  EXPECT_THAT(CheckedNumElements(Shape(129, 1)),
              StatusIs(kInvalid, HasSubstr("at most 128 dimensions, got 129")));
  // Overflow of a prefix is caught even when a later dim is non-positive.
  EXPECT_THAT(CheckedNumElements({int64_t{1} << 40, int64_t{1} << 40, 0}),
              StatusIs(kInvalid, ::testing::Not(::testing::IsEmpty())));
  EXPECT_EQ(NumElements({5, 7}), 35);
}

TEST(AttrsTest, Getters) {
  Attrs a = {{"i", int64_t{3}},
             {"f", 0.5},
             {"s", std::string("hi")},
             {"b", true},
             {"is", std::vector<int64_t>{1, 2}},
             {"fs", std::vector<double>{1.5}}};
  EXPECT_TRUE(a.Has("i"));
  EXPECT_FALSE(a.Has("nope"));
  EXPECT_EQ(*a.Int("i"), 3);
  EXPECT_EQ(*a.Int("nope", 9), 9);
  EXPECT_EQ(*a.Int("i", 9), 3);
  EXPECT_EQ(*a.Float("f"), 0.5);
  EXPECT_EQ(*a.Float("i"), 3.0);  // integers are accepted as floats
  EXPECT_EQ(*a.Float("i", 1.0), 3.0);
  EXPECT_EQ(*a.Float("nope", 1.0), 1.0);
  EXPECT_EQ(*a.String("s", ""), "hi");
  EXPECT_EQ(*a.String("nope", "d"), "d");
  EXPECT_EQ(*a.Bool("b", false), true);
  EXPECT_EQ(*a.Bool("nope", false), false);
  EXPECT_EQ(*a.Ints("is"), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(*a.Ints("nope", {7}), (std::vector<int64_t>{7}));

  EXPECT_THAT(
      a.Int("nope"),
      StatusIs(kInvalid, HasSubstr("missing required attribute 'nope'")));
  EXPECT_THAT(
      a.Float("nope"),
      StatusIs(kInvalid, HasSubstr("missing required attribute 'nope'")));
  EXPECT_THAT(
      a.Ints("nope"),
      StatusIs(kInvalid, HasSubstr("missing required attribute 'nope'")));
  EXPECT_THAT(
      a.Int("f"),
      StatusIs(kInvalid, HasSubstr("attribute 'f' must be an integer")));
  EXPECT_THAT(
      a.Int("f", 1),
      StatusIs(kInvalid, HasSubstr("attribute 'f' must be an integer")));
  EXPECT_THAT(a.Float("s"),
              StatusIs(kInvalid, HasSubstr("attribute 's' must be a number")));
  EXPECT_THAT(a.Float("b", 1.0),
              StatusIs(kInvalid, HasSubstr("attribute 'b' must be a number")));
  EXPECT_THAT(a.Bool("i", false),
              StatusIs(kInvalid, HasSubstr("attribute 'i' must be a boolean")));
  EXPECT_THAT(a.String("is", ""),
              StatusIs(kInvalid, HasSubstr("attribute 'is' must be a string")));
  EXPECT_THAT(a.Ints("i"),
              StatusIs(kInvalid,
                       HasSubstr("attribute 'i' must be a list of integers")));
  EXPECT_THAT(a.Ints("fs", {}),
              StatusIs(kInvalid,
                       HasSubstr("attribute 'fs' must be a list of integers")));
  a.Set("i", std::string("x"));
  EXPECT_THAT(a.Int("i", 0), StatusIs(kInvalid, HasSubstr("'i'")));
}

TEST(ShapeHelpersTest, BroadcastShapes) {
  using internal::BroadcastShapes;
  EXPECT_EQ(*BroadcastShapes({2, 3}, {2, 3}), (Shape{2, 3}));
  EXPECT_EQ(*BroadcastShapes({2, 3}, {3}), (Shape{2, 3}));
  EXPECT_EQ(*BroadcastShapes({3}, {4, 1, 3}), (Shape{4, 1, 3}));
  EXPECT_EQ(*BroadcastShapes({4, 1, 3}, {5, 1}), (Shape{4, 5, 3}));
  EXPECT_EQ(*BroadcastShapes({}, {2, 2}), (Shape{2, 2}));
  EXPECT_EQ(*BroadcastShapes({}, {}), Shape{});
  EXPECT_THAT(BroadcastShapes({2, 3}, {4}),
              StatusIs(kInvalid, AllOf(HasSubstr("[2,3] and [4]"),
                                       HasSubstr("do not broadcast"),
                                       HasSubstr("3 vs 4"))));
  EXPECT_THAT(BroadcastShapes({2, 4, 3}, {5, 3}),
              StatusIs(kInvalid, HasSubstr("4 vs 5")));
}

TEST(ShapeHelpersTest, NormalizeAxis) {
  using internal::NormalizeAxis;
  EXPECT_EQ(*NormalizeAxis(-1, 3, "axis"), 2);
  EXPECT_EQ(*NormalizeAxis(-3, 3, "axis"), 0);
  EXPECT_EQ(*NormalizeAxis(2, 3, "axis"), 2);
  EXPECT_THAT(
      NormalizeAxis(3, 3, "axis"),
      StatusIs(kInvalid, HasSubstr("axis 3 is out of range for rank 3")));
  EXPECT_THAT(NormalizeAxis(-4, 3, "axis"),
              StatusIs(kInvalid, HasSubstr("-4")));
  EXPECT_THAT(NormalizeAxis(0, 0, "axis"),
              StatusIs(kInvalid, HasSubstr("rank 0")));
  EXPECT_THAT(NormalizeAxis(std::numeric_limits<int64_t>::min(), 2, "axis"),
              StatusIs(kInvalid, HasSubstr("out of range")));
  EXPECT_THAT(NormalizeAxis(std::numeric_limits<int64_t>::max(), 2, "axis"),
              StatusIs(kInvalid, HasSubstr("out of range")));
}

TEST(RegistryTest, EveryOpIsComplete) {
  const auto all = OpRegistry::Global().All();
  EXPECT_GE(all.size(), 30u);
  for (size_t i = 0; i < all.size(); ++i) {
    const OpDef* d = all[i];
    SCOPED_TRACE(d->type);
    EXPECT_FALSE(d->summary.empty());
    EXPECT_TRUE(d->infer != nullptr);
    EXPECT_TRUE(d->flops != nullptr);
    EXPECT_GE(d->min_inputs, 1);
    EXPECT_TRUE(d->max_inputs < 0 || d->max_inputs >= d->min_inputs);
    EXPECT_GE(d->backward_flops_multiple, 0);
    EXPECT_EQ(OpRegistry::Global().Find(d->type), d);
    if (i > 0) {
      EXPECT_LT(all[i - 1]->type, d->type);
    }
  }
  EXPECT_EQ(OpRegistry::Global().Find("nope"), nullptr);
  EXPECT_EQ(OpRegistry::Global().Find(""), nullptr);
}

TEST(RegistryTest, InferOpPrefixesErrors) {
  EXPECT_THAT(InferOp("r", "relu", {}, {"x"}, {I64({2})}),
              StatusIs(kInvalid, AllOf(HasSubstr("op 'r' (relu): "),
                                       HasSubstr("input 'x' (i64[2])"),
                                       HasSubstr("floating-point"))));
  EXPECT_THAT(InferOp("r", "relu", {}, {}, {}),
              StatusIs(kInvalid, HasSubstr("takes 1 inputs, got 0")));
  EXPECT_THAT(InferOp("c", "concat", {{"axis", int64_t{0}}}, {}, {}),
              StatusIs(kInvalid, HasSubstr("takes at least 1 inputs")));
  EXPECT_THAT(InferOp("q", "quux", {}, {}, {}),
              StatusIs(kInvalid, HasSubstr("op 'q' has unknown type 'quux'")));
}

// An input with a dimension of 0 is refused before the op's rule runs
// (batch_norm's divided by the channels: SIGFPE before).
TEST(RegistryTest, InferOpRefusesEmptyInputs) {
  EXPECT_THAT(
      InferOp("bn", "batch_norm", {}, {"x", "g", "b"}, {F32({4, 0, 3}), F32({0}), F32({0})}),
      StatusIs(kInvalid, AllOf(HasSubstr("op 'bn' (batch_norm): input 0"),
                               HasSubstr("dimensions must be positive"))));
  EXPECT_THAT(InferOp("c", "conv2d", {}, {"x", "w"}, {F32({1, 2, 5, 5}), F32({3, 2, 0, 3})}),
              StatusIs(kInvalid, HasSubstr("input 1")));
}

// Each op family on small shapes: inference results and rank-0 corner cases.
TEST(RegistryTest, ShapeRules) {
  auto infer = [](const std::string& type, Attrs attrs,
                  std::vector<TensorType> ins) {
    std::vector<std::string> names;
    for (size_t i = 0; i < ins.size(); ++i)
      names.push_back("in" + std::to_string(i));
    return InferOp("op", type, attrs, names, ins);
  };
  using V = std::vector<TensorType>;
  using I = std::vector<int64_t>;
  EXPECT_EQ(*infer("add", {}, {F32({2, 3}), F32({3})}), V{F32({2, 3})});
  EXPECT_EQ(*infer("matmul", {}, {F32({5, 2, 3}), F32({3, 4})}),
            V{F32({5, 2, 4})});
  EXPECT_EQ(*infer("linear", {}, {F32({3}), F32({4, 3})}), V{F32({4})});
  EXPECT_EQ(*infer("transpose", {{"perm", I{}}}, {F32({})}), V{F32({})});
  EXPECT_EQ(*infer("reshape", {{"shape", I{}}}, {F32({1, 1})}), V{F32({})});
  EXPECT_EQ(*infer("reshape", {{"shape", I{-1, 2}}}, {F32({3, 4})}),
            V{F32({6, 2})});
  EXPECT_EQ(*infer("sum", {}, {F32({3, 4})}), V{F32({})});
  EXPECT_EQ(
      *infer("mean", {{"axes", I{-1}}, {"keepdims", true}}, {F32({3, 4})}),
      V{F32({3, 1})});
  EXPECT_EQ(*infer("flatten", {}, {F32({2, 3, 4})}), V{F32({2, 12})});
  EXPECT_EQ(
      *infer("concat", {{"axis", int64_t{-1}}}, {F32({2, 3}), F32({2, 4})}),
      V{F32({2, 7})});
  EXPECT_EQ(*infer("split", {{"axis", int64_t{0}}, {"sizes", I{1, 3}}},
                   {F32({4, 2})}),
            (V{F32({1, 2}), F32({3, 2})}));
  EXPECT_EQ(
      *infer("slice",
             {{"axis", int64_t{1}}, {"start", int64_t{1}}, {"end", int64_t{3}}},
             {F32({2, 4})}),
      V{F32({2, 2})});
  EXPECT_EQ(*infer("expand", {{"shape", I{3, 2, 4}}}, {F32({1, 4})}),
            V{F32({3, 2, 4})});
  EXPECT_EQ(*infer("embedding", {}, {I64({2, 5}), F32({10, 8})}),
            V{F32({2, 5, 8})});
  EXPECT_EQ(*infer("conv2d", {{"stride", I{2}}, {"padding", I{1}}},
                   {F32({1, 3, 8, 8}), F32({6, 3, 3, 3}), F32({6})}),
            V{F32({1, 6, 4, 4})});
  // Dilation: a 3x3 kernel dilated by (2, 3) spans 5x7 (PyTorch: 8 -> 4, 2).
  EXPECT_EQ(*infer("conv2d", {{"dilation", I{2, 3}}}, {F32({1, 3, 8, 8}), F32({6, 3, 3, 3})}),
            V{F32({1, 6, 4, 2})});
  EXPECT_THAT(infer("conv2d", {{"dilation", I{0}}}, {F32({1, 3, 8, 8}), F32({6, 3, 3, 3})}),
              StatusIs(kInvalid, HasSubstr("'dilation'")));
  EXPECT_THAT(infer("conv2d", {{"dilation", I{4}}}, {F32({1, 3, 8, 8}), F32({6, 3, 3, 3})}),
              StatusIs(kInvalid, HasSubstr("kernel 9 is larger")));
  // conv3d: per-axis stride, padding and dilation (PyTorch: [2, 6, 8, 9,
  // 9] by [4, 6, 3, 3, 3], stride (1, 2, 2), padding 1, dilation (2, 1, 1)
  // gives [2, 4, 6, 5, 5]); a 4-D input or weight is refused naming it.
  EXPECT_EQ(*infer("conv3d", {{"stride", I{1, 2, 2}}, {"padding", I{1}}, {"dilation", I{2, 1, 1}}},
                   {F32({2, 6, 8, 9, 9}), F32({4, 6, 3, 3, 3}), F32({4})}),
            V{F32({2, 4, 6, 5, 5})});
  EXPECT_EQ(
      *infer("conv3d", {{"groups", int64_t{2}}}, {F32({1, 4, 3, 5, 5}), F32({6, 2, 1, 3, 3})}),
      V{F32({1, 6, 3, 3, 3})});
  EXPECT_THAT(infer("conv3d", {}, {F32({1, 3, 8, 8}), F32({6, 3, 3, 3, 3})}),
              StatusIs(kInvalid, HasSubstr("rank 5")));
  EXPECT_THAT(infer("conv3d", {}, {F32({1, 3, 4, 8, 8}), F32({6, 3, 3, 3})}),
              StatusIs(kInvalid, HasSubstr("rank 5")));
  EXPECT_THAT(infer("conv3d", {{"stride", I{1, 2}}}, {F32({1, 3, 4, 8, 8}), F32({6, 3, 3, 3, 3})}),
              StatusIs(kInvalid, HasSubstr("'stride' must be 1 or 3 integers")));
  EXPECT_THAT(infer("conv3d", {}, {F32({1, 3, 2, 8, 8}), F32({6, 3, 3, 3, 3})}),
              StatusIs(kInvalid, HasSubstr("kernel 3 is larger than the padded depth 2")));
  EXPECT_EQ(*infer("max_pool2d", {{"kernel", I{2}}}, {F32({1, 3, 8, 8})}),
            V{F32({1, 3, 4, 4})});
  // 3-D pools (PyTorch: s3d's (1, 3, 3) stride (1, 2, 2) padding (0, 1, 1)
  // over [2, 3, 8, 9, 9] gives [2, 3, 8, 5, 5]; 3x3x3 stride 2 ceil_mode
  // over 7x7x6 gives 3x3x3).
  EXPECT_EQ(*infer("max_pool3d",
                   {{"kernel", I{1, 3, 3}}, {"stride", I{1, 2, 2}}, {"padding", I{0, 1, 1}}},
                   {F32({2, 3, 8, 9, 9})}),
            V{F32({2, 3, 8, 5, 5})});
  EXPECT_EQ(*infer("avg_pool3d", {{"kernel", I{3}}, {"stride", I{2}}, {"ceil_mode", true}},
                   {F32({1, 2, 7, 7, 6})}),
            V{F32({1, 2, 3, 3, 3})});
  EXPECT_THAT(infer("max_pool3d", {{"kernel", I{2}}}, {F32({1, 3, 8, 8})}),
              StatusIs(kInvalid, HasSubstr("rank 5")));
  EXPECT_THAT(infer("avg_pool3d", {{"kernel", I{2, 2}}}, {F32({1, 3, 4, 8, 8})}),
              StatusIs(kInvalid, HasSubstr("'kernel' must be 1 or 3 integers")));
  EXPECT_THAT(
      infer("max_pool3d", {{"kernel", I{3}}, {"padding", I{2, 1, 1}}}, {F32({1, 3, 4, 8, 8})}),
      StatusIs(kInvalid, HasSubstr("padding must be at most half the kernel")));
  EXPECT_EQ(*infer("adaptive_avg_pool2d", {{"output_size", I{1}}},
                   {F32({1, 3, 8, 8})}),
            V{F32({1, 3, 1, 1})});
  EXPECT_EQ(*infer("moe_gate", {{"k", int64_t{2}}, {"capacity", int64_t{3}}},
                   {F32({6, 4})}),
            V{F32({6, 4, 3})});
  // The compact MoE form: int64 route, weights, index dispatch/combine.
  const Attrs route_attrs = {{"k", int64_t{2}}, {"capacity", int64_t{3}}};
  EXPECT_EQ(*infer("moe_route", route_attrs, {F32({6, 4})}), V{I64({6, 2})});
  EXPECT_EQ(*infer("moe_route_weights", {{"k", int64_t{2}}}, {F32({6, 4})}),
            V{F32({6, 2})});
  const Attrs disp = {{"experts", int64_t{4}}, {"capacity", int64_t{3}}};
  EXPECT_EQ(*infer("moe_dispatch_idx", disp, {F32({6, 5}), I64({6, 2})}),
            V{F32({4, 3, 5})});
  EXPECT_EQ(*infer("moe_combine_idx", {},
                   {F32({4, 3, 5}), I64({6, 2}), F32({6, 2})}),
            V{F32({6, 5})});
  EXPECT_THAT(infer("moe_dispatch_idx", disp, {F32({6, 5}), F32({6, 2})}),
              StatusIs(kInvalid, HasSubstr("must be an int64 route")));
  EXPECT_THAT(infer("moe_dispatch_idx", disp, {F32({6, 5}), I64({5, 2})}),
              StatusIs(kInvalid, HasSubstr("one row per token")));
  EXPECT_THAT(infer("moe_combine_idx", {},
                    {F32({4, 3, 5}), I64({6, 2}), F32({6, 1})}),
              StatusIs(kInvalid, HasSubstr("must match")));
  EXPECT_THAT(infer("moe_route", {{"k", int64_t{5}}, {"capacity", int64_t{3}}},
                    {F32({6, 4})}),
              StatusIs(kInvalid, HasSubstr("must be in [1, experts = 4]")));

  // Rank-0 inputs where a rank is required: errors, not out-of-range reads.
  for (const char* type :
       {"linear", "layer_norm", "softmax", "log_softmax", "matmul", "flatten",
        "concat", "split", "slice", "embedding", "conv2d", "conv3d", "max_pool2d",
        "adaptive_avg_pool2d", "moe_gate", "moe_dispatch", "moe_combine",
        "moe_route", "moe_route_weights", "moe_dispatch_idx",
        "moe_combine_idx", "nll_loss", "cross_entropy", "lstm", "gru"}) {
    SCOPED_TRACE(type);
    const OpDef* d = OpRegistry::Global().Find(type);
    ASSERT_NE(d, nullptr);
    V ins(d->min_inputs, F32({}));
    if (std::string(type) == "embedding") ins[0] = I64({});
    EXPECT_THAT(infer(type,
                      {{"axis", int64_t{0}},
                       {"sizes", I{1}},
                       {"start", int64_t{0}},
                       {"end", int64_t{1}},
                       {"kernel", I{1}},
                       {"output_size", I{1}},
                       {"capacity", int64_t{1}}},
                      ins),
                StatusIs(kInvalid, HasSubstr("op 'op'")));
  }
}

// lstm: y[b, s, h] from x[b, s, i] and PyTorch's gate-stacked weights;
// mismatched weights, biases and ranks are errors naming the input.
TEST(RegistryTest, LstmShapes) {
  auto infer = [](Attrs attrs, std::vector<TensorType> ins) {
    std::vector<std::string> names;
    for (size_t i = 0; i < ins.size(); ++i) names.push_back("in" + std::to_string(i));
    return InferOp("op", "lstm", attrs, names, ins);
  };
  using V = std::vector<TensorType>;
  EXPECT_EQ(*infer({}, {F32({2, 5, 3}), F32({16, 3}), F32({16, 4}), F32({16}), F32({16})}),
            V{F32({2, 5, 4})});
  EXPECT_EQ(*infer({{"reverse", true}}, {F32({2, 5, 3}), F32({16, 3}), F32({16, 4})}),
            V{F32({2, 5, 4})});
  const OpDef* d = OpRegistry::Global().Find("lstm");
  ASSERT_NE(d, nullptr);
  // Twice the forward's products and its recomputation.
  EXPECT_EQ(d->backward_flops_multiple, 3.0);
  Attrs none;
  OpCall call{"lstm", none, {"x", "w_ih", "w_hh"}, {F32({2, 5, 3}), F32({16, 3}), F32({16, 4})}, {}};
  EXPECT_EQ(d->flops(call), 10.0 * (2 * 16 * (3 + 4) + 12 * 4));
  EXPECT_THAT(infer({}, {F32({2, 5, 3}), F32({12, 3}), F32({16, 4})}),
              StatusIs(kInvalid, AllOf(HasSubstr("input 'in1' (f32[12,3])"),
                                       HasSubstr("must have shape [16,3]"))));
  EXPECT_THAT(infer({}, {F32({2, 5, 3}), F32({16, 3}), F32({15, 4})}),
              StatusIs(kInvalid, HasSubstr("input 'in2' (f32[15,4]) must be [4 * hidden")));
  EXPECT_THAT(infer({}, {F32({2, 5, 3}), F32({16, 3}), F32({16, 4}), F32({4})}),
              StatusIs(kInvalid, HasSubstr("input 'in3' (f32[4]) must have shape [16]")));
  EXPECT_THAT(infer({}, {F32({5, 3}), F32({16, 3}), F32({16, 4})}),
              StatusIs(kInvalid, HasSubstr("input 'in0'")));
  EXPECT_THAT(infer({}, {F32({2, 5, 3}), TensorType{DType::kFloat64, {16, 3}}, F32({16, 4})}),
              StatusIs(kInvalid, HasSubstr("in1")));
  EXPECT_THAT(infer({{"hidden", int64_t{4}}}, {F32({2, 5, 3}), F32({16, 3}), F32({16, 4})}),
              StatusIs(kInvalid, HasSubstr("hidden")));
}

// gru: lstm's shape rule with 3 gates (r, z, n) in place of 4.
TEST(RegistryTest, GruShapes) {
  auto infer = [](std::vector<TensorType> ins) {
    std::vector<std::string> names;
    for (size_t i = 0; i < ins.size(); ++i) names.push_back("in" + std::to_string(i));
    return InferOp("op", "gru", {{"reverse", true}}, names, ins);
  };
  using V = std::vector<TensorType>;
  EXPECT_EQ(*infer({F32({2, 5, 3}), F32({12, 3}), F32({12, 4}), F32({12}), F32({12})}),
            V{F32({2, 5, 4})});
  EXPECT_THAT(infer({F32({2, 5, 3}), F32({16, 3}), F32({16, 4})}),
              StatusIs(kInvalid, HasSubstr("must be [3 * hidden, hidden] (gates r, z, n)")));
  EXPECT_THAT(infer({F32({2, 5, 3}), F32({12, 3}), F32({12, 4}), F32({16})}),
              StatusIs(kInvalid, HasSubstr("input 'in3' (f32[16]) must have shape [12]")));
  const OpDef* d = OpRegistry::Global().Find("gru");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->backward_flops_multiple, 3.0);
  Attrs none;
  OpCall call{"gru", none, {"x", "w_ih", "w_hh"}, {F32({2, 5, 3}), F32({12, 3}), F32({12, 4})}, {}};
  EXPECT_EQ(d->flops(call), 10.0 * (2 * 12 * (3 + 4) + 10 * 4));
}

TEST(BuilderTest, ErrorsAreRememberedAndNameTheOp) {
  GraphBuilder b("g");
  TensorId x = b.Input("x", F32({2, 3}));
  TensorId w = b.Parameter("w", F32({4, 5}), Initializer::Zeros());
  TensorId h = b.Add("linear", "fc", {x, w});
  EXPECT_EQ(h, -1);
  EXPECT_THAT(b.status(), StatusIs(kInvalid, HasSubstr("op 'fc' (linear)")));
  // Later calls are no-ops.
  EXPECT_EQ(b.Add("relu", "r", {x}), -1);
  EXPECT_EQ(b.Input("y", F32({1})), -1);
  EXPECT_THAT(b.Build(), StatusIs(kInvalid, HasSubstr("op 'fc' (linear)")));
}

TEST(BuilderTest, BadIdsAndNames) {
  {
    GraphBuilder b("g");
    b.Add("relu", "r", {7});
    EXPECT_THAT(b.Build(), StatusIs(kInvalid, AllOf(HasSubstr("op 'r'"),
                                                    HasSubstr("input id 7"))));
  }
  {
    GraphBuilder b("g");
    TensorId x = b.Input("x", F32({2}));
    b.Add("relu", "", {x});
    EXPECT_THAT(b.Build(), StatusIs(kInvalid, HasSubstr("empty name")));
  }
  {
    GraphBuilder b("g");
    b.Input("", F32({2}));
    EXPECT_THAT(b.Build(), StatusIs(kInvalid, HasSubstr("empty name")));
  }
  {
    GraphBuilder b("g");
    TensorId x = b.Input("x", F32({4, 2}));
    b.Add("split", "sp", {x},
          {{"axis", int64_t{0}}, {"sizes", std::vector<int64_t>{2, 2}}});
    EXPECT_THAT(b.Build(), StatusIs(kInvalid, AllOf(HasSubstr("op 'sp'"),
                                                    HasSubstr("use AddOp"))));
  }
  {
    GraphBuilder b("g");
    TensorId x = b.Input("x", F32({4, 2}));
    b.AddOp("split", "sp", {x},
            {{"axis", int64_t{0}}, {"sizes", std::vector<int64_t>{2, 2}}},
            {"a"});
    EXPECT_THAT(b.Build(),
                StatusIs(kInvalid, HasSubstr("produces 2 outputs but 1")));
  }
}

TEST(BuilderTest, LossChecks) {
  {
    GraphBuilder b("g");
    EXPECT_THAT(b.Build(), StatusIs(kInvalid, HasSubstr("'g' has no ops")));
  }
  {
    GraphBuilder b("g");
    TensorId x = b.Input("x", F32({2}));
    b.Add("relu", "r", {x});
    EXPECT_THAT(b.Build(), StatusIs(kInvalid, HasSubstr("'g' has no loss")));
  }
  {
    GraphBuilder b("g");
    TensorId x = b.Input("x", F32({2}));
    b.Add("relu", "r", {x});
    b.SetLoss(42);
    EXPECT_THAT(b.Build(),
                StatusIs(kInvalid, AllOf(HasSubstr("'g'"), HasSubstr("loss"))));
  }
  {
    GraphBuilder b("g");
    TensorId x = b.Input("x", F32({2}));
    b.SetLoss(b.Add("sum", "s", {b.Add("relu", "r", {x})}));
    auto g = b.Build();
    ASSERT_THAT(g, IsOk());
    EXPECT_EQ(g->tensor(g->loss()).name, "s");
    EXPECT_EQ(g->tensor(x).consumers, std::vector<OpId>{0});
    EXPECT_EQ(g->Inputs(), std::vector<TensorId>{x});
    EXPECT_TRUE(g->Parameters().empty());
  }
}

TEST(BuilderTest, ScopesPrefixNames) {
  GraphBuilder b("g");
  TensorId x = b.Input("x", F32({2}));
  b.PushScope("block0");
  b.PushScope("attn");
  EXPECT_EQ(b.Scoped("q"), "block0/attn/q");
  TensorId r = b.Add("relu", b.Scoped("r"), {x});
  b.PopScope();
  b.PopScope();
  b.PopScope();  // extra pops are harmless
  EXPECT_EQ(b.Scoped("q"), "q");
  b.SetLoss(b.Add("sum", "s", {r}));
  auto g = b.Build();
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->op(0).scope, "block0/attn");
  EXPECT_EQ(g->op(0).name, "block0/attn/r");
  EXPECT_EQ(g->op(1).scope, "");
}

// Attribute values of every kind, including empty lists, survive the proto.
TEST(ProtoTest, ValuesInitializerRoundTrips) {
  GraphBuilder b("g");
  TensorId x = b.Input("x", F32({2, 3}));
  TensorId c = b.Parameter("c", F32({2, 3}), Initializer::Values({0.5, -100, 7}, {2, 3, 1}),
                           /*frozen=*/true);
  TensorId y = b.Add("add", "plus", {x, c});
  b.SetLoss(b.Add("sum", "all", {y}, {{"axes", std::vector<int64_t>{}}}));
  auto g = b.Build();
  ASSERT_THAT(g, IsOk());
  auto back = FromProto(ToProto(*g));
  ASSERT_THAT(back, IsOk());
  testing::ExpectSameGraph(*g, *back);
  const Tensor& t = back->tensor(*back->FindTensor("c"));
  EXPECT_EQ(t.init.values, (std::vector<double>{0.5, -100, 7}));
  EXPECT_EQ(t.init.counts, (std::vector<int64_t>{2, 3, 1}));
  auto json = ParseGraph(GraphToJson(*g), GraphFormat::kAuto);
  ASSERT_THAT(json, IsOk());
  testing::ExpectSameGraph(*g, *json);
  // The builder checks the runs against the tensor too.
  GraphBuilder bad("g");
  bad.Parameter("c", F32({2, 3}), Initializer::Values({1}, {5}));
  EXPECT_THAT(bad.status(),
              StatusIs(kInvalid, HasSubstr("parameter 'c': its VALUES initializer's "
                                           "counts add up to 5 elements, not its 6")));
}

TEST(ProtoTest, AttributesRoundTrip) {
  GraphBuilder b("g");
  TensorId x = b.Input("x", F32({1, 1}));
  TensorId t =
      b.Add("transpose", "t", {x}, {{"perm", std::vector<int64_t>{1, 0}}});
  TensorId s =
      b.Add("reshape", "scalar", {t}, {{"shape", std::vector<int64_t>{}}});
  TensorId u =
      b.Add("transpose", "t0", {s}, {{"perm", std::vector<int64_t>{}}});
  TensorId v = b.Add("sum", "all", {u},
                     {{"axes", std::vector<int64_t>{}},
                      {"keepdims", false},
                      {"meta.note", std::string("kept")},
                      {"meta.weights", std::vector<double>{}},
                      {"meta.ratio", 0.25},
                      {"meta.floats", std::vector<double>{1.5, -2}}});
  b.SetLoss(v);
  b.SetMetadata("zoo.model", "none");
  auto g = b.Build();
  ASSERT_THAT(g, IsOk());
  auto back = FromProto(ToProto(*g));
  ASSERT_THAT(back, IsOk());
  testing::ExpectSameGraph(*g, *back);
  auto json = ParseGraph(GraphToJson(*g), GraphFormat::kAuto);
  ASSERT_THAT(json, IsOk());
  testing::ExpectSameGraph(*g, *json);
  auto text = ParseGraph(ToProto(*g).DebugString(), GraphFormat::kText);
  ASSERT_THAT(text, IsOk());
  testing::ExpectSameGraph(*g, *text);
}

}  // namespace
}  // namespace hap::graph
