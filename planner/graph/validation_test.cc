// Bad graphs are InvalidArgument errors naming the op or tensor and what is
// wrong with it.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/test_util.h"
#include "planner/graph/zoo.h"

namespace hap::graph {
namespace {

using ::hap::graph::testing::IsOk;
using ::hap::graph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// x[4, 8] -> linear(w[3, 8], b[3]) -> logits[4, 3] -> cross_entropy. Tests
// edit it by substring, so keep one line per tensor.
// clang-format off
constexpr char kTiny[] = R"pb(
  name: "tiny"
  inputs { tensor { name: "x" shape: [ 4, 8 ] dtype: FLOAT32 } role: FEATURES }
  inputs { tensor { name: "labels" shape: [ 4 ] dtype: INT64 } role: LABELS }
  parameters {
    tensor { name: "w" shape: [ 3, 8 ] dtype: FLOAT32 }
    init { kind: NORMAL stddev: 0.02 }
  }
  parameters { tensor { name: "b" shape: [ 3 ] dtype: FLOAT32 } }
  ops { name: "fc" type: "linear" inputs: [ "x", "w", "b" ] outputs: [ "logits" ] }
  ops { name: "loss" type: "cross_entropy" inputs: [ "logits", "labels" ] outputs: [ "loss" ] }
  loss: "loss"
)pb";
// clang-format on

hap::v1::Graph Tiny() {
  hap::v1::Graph p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kTiny, &p));
  return p;
}

// kTiny with one substring replaced (which must occur).
absl::StatusOr<Graph> TinyWith(const std::string& from, const std::string& to) {
  std::string text = kTiny;
  EXPECT_NE(text.find(from), std::string::npos) << from;
  text = absl::StrReplaceAll(text, {{from, to}});
  return ParseGraph(text, GraphFormat::kText);
}

TEST(ValidationTest, TinyGraphIsValid) {
  auto g = FromProto(Tiny());
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->ParameterCount(), 3 * 8 + 3);
  EXPECT_EQ(g->ForwardFlops(), 2.0 * 4 * 8 * 3 + 4 * 3 + 4.0 * 4 * 3 + 2 * 4);
}

TEST(ValidationTest, OpsMayComeInAnyOrder) {
  hap::v1::Graph p = Tiny();
  p.mutable_ops()->SwapElements(0, 1);
  auto g = FromProto(p);
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->op(0).name, "fc");
  EXPECT_EQ(g->op(1).name, "loss");
}

// Enum values this build does not know (a newer exporter's, a corrupt
// file) are refused naming the tensor: an unknown initializer kind was
// initialised as zeros, an unknown input role read as features.
TEST(ValidationTest, UnknownInitializerKindAndInputRole) {
  hap::v1::Graph p = Tiny();
  p.mutable_parameters(0)->mutable_init()->set_kind(static_cast<hap::v1::Initializer::Kind>(9));
  EXPECT_THAT(FromProto(p), StatusIs(kInvalid, HasSubstr("parameter 'w' has initializer kind 9")));
  p = Tiny();
  p.mutable_inputs(1)->set_role(static_cast<hap::v1::Input::Role>(7));
  EXPECT_THAT(FromProto(p), StatusIs(kInvalid, HasSubstr("input 'labels' has role 7")));
}

TEST(ValidationTest, DuplicateOpName) {
  hap::v1::Graph p = Tiny();
  p.mutable_ops(1)->set_name(p.ops(0).name());
  EXPECT_THAT(FromProto(p),
              StatusIs(kInvalid, HasSubstr("op name 'fc' is used by two ops")));
}

TEST(ValidationTest, UnknownAttribute) {
  hap::v1::Graph p = Tiny();
  (*p.mutable_ops(0)->mutable_attrs())["transpose_b"].set_b(true);
  EXPECT_THAT(FromProto(p),
              StatusIs(kInvalid, AllOf(HasSubstr("op 'fc' (linear)"),
                                       HasSubstr("unknown attribute "
                                                 "'transpose_b'"))));
}

TEST(ValidationTest, UnknownOpType) {
  EXPECT_THAT(TinyWith("\"linear\"", "\"convolve\""),
              StatusIs(kInvalid, AllOf(HasSubstr("op 'fc'"),
                                       HasSubstr("unknown type 'convolve'"))));
}

TEST(ValidationTest, LinearWithWrongInFeatures) {
  EXPECT_THAT(
      TinyWith("name: \"w\" shape: [ 3, 8 ]", "name: \"w\" shape: [ 3, 9 ]"),
      StatusIs(kInvalid,
               AllOf(HasSubstr("op 'fc' (linear)"), HasSubstr("'x'"),
                     HasSubstr("has 8 features"), HasSubstr("expects 9"))));
}

TEST(ValidationTest, BiasWithWrongShape) {
  EXPECT_THAT(TinyWith("name: \"b\" shape: [ 3 ]", "name: \"b\" shape: [ 4 ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("op 'fc' (linear)"),
                                       HasSubstr("bias input 'b'"),
                                       HasSubstr("must have shape [3]"))));
}

TEST(ValidationTest, WrongNumberOfInputs) {
  EXPECT_THAT(
      TinyWith("inputs: [ \"x\", \"w\", \"b\" ]", "inputs: [ \"x\" ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("op 'fc' (linear)"),
                               HasSubstr("takes 2 to 3 inputs, got 1"))));
}

TEST(ValidationTest, WrongDtypeOfLabels) {
  EXPECT_THAT(
      TinyWith("shape: [ 4 ] dtype: INT64", "shape: [ 4 ] dtype: FLOAT32"),
      StatusIs(kInvalid, AllOf(HasSubstr("op 'loss' (cross_entropy)"),
                               HasSubstr("'labels'"),
                               HasSubstr("must be an integer tensor"))));
}

TEST(ValidationTest, DanglingTensor) {
  EXPECT_THAT(
      TinyWith("[ \"logits\", \"labels\" ]", "[ \"logitz\", \"labels\" ]"),
      StatusIs(kInvalid,
               AllOf(HasSubstr("op 'loss'"), HasSubstr("reads tensor 'logitz'"),
                     HasSubstr("not an input, a parameter"))));
}

TEST(ValidationTest, Cycle) {
  hap::v1::Graph p = Tiny();
  auto* a = p.add_ops();
  a->set_name("a");
  a->set_type("relu");
  a->add_inputs("b_out");
  a->add_outputs("a_out");
  auto* b = p.add_ops();
  b->set_name("b");
  b->set_type("relu");
  b->add_inputs("a_out");
  b->add_outputs("b_out");
  EXPECT_THAT(FromProto(p),
              StatusIs(kInvalid, AllOf(HasSubstr("cycle"), HasSubstr("'a'"),
                                       HasSubstr("'b'"))));
}

TEST(ValidationTest, SelfLoop) {
  EXPECT_THAT(
      TinyWith("[ \"x\", \"w\", \"b\" ]", "[ \"logits\", \"w\", \"b\" ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("cycle"), HasSubstr("'fc'"))));
}

TEST(ValidationTest, MissingLoss) {
  EXPECT_THAT(
      TinyWith("loss: \"loss\"", ""),
      StatusIs(kInvalid, AllOf(HasSubstr("'tiny'"), HasSubstr("no loss"))));
  EXPECT_THAT(TinyWith("loss: \"loss\"", "loss: \"lost\""),
              StatusIs(kInvalid, AllOf(HasSubstr("loss 'lost'"),
                                       HasSubstr("not a tensor"))));
}

TEST(ValidationTest, NonScalarLoss) {
  EXPECT_THAT(TinyWith("loss: \"loss\"", "loss: \"logits\""),
              StatusIs(kInvalid, AllOf(HasSubstr("loss 'logits'"),
                                       HasSubstr("must be a float scalar"),
                                       HasSubstr("f32[4,3]"))));
}

TEST(ValidationTest, LossThatIsAParameterOrInput) {
  EXPECT_THAT(TinyWith("loss: \"loss\"", "loss: \"w\""),
              StatusIs(kInvalid, AllOf(HasSubstr("loss 'w'"),
                                       HasSubstr("produced by an op"),
                                       HasSubstr("not be a parameter"))));
  EXPECT_THAT(TinyWith("loss: \"loss\"", "loss: \"x\""),
              StatusIs(kInvalid, AllOf(HasSubstr("loss 'x'"),
                                       HasSubstr("not be an input"))));
}

TEST(ValidationTest, NonPositiveDimensions) {
  EXPECT_THAT(
      TinyWith("shape: [ 4, 8 ]", "shape: [ 4, 0 ]"),
      StatusIs(kInvalid,
               AllOf(HasSubstr("input 'x'"), HasSubstr("dimension 1"),
                     HasSubstr("[4,0]"), HasSubstr("must be positive"))));
  EXPECT_THAT(
      TinyWith("shape: [ 4, 8 ]", "shape: [ -4, 8 ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("input 'x'"), HasSubstr("dimension 0"),
                               HasSubstr("is -4"))));
  EXPECT_THAT(TinyWith("name: \"b\" shape: [ 3 ]", "name: \"b\" shape: [ 0 ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("parameter 'b'"),
                                       HasSubstr("must be positive"))));
}

TEST(ValidationTest, SizesOverflowing64Bits) {
  EXPECT_THAT(
      TinyWith("shape: [ 4, 8 ]", "shape: [ 4294967296, 4294967296 ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("input 'x'"), HasSubstr("64 bits"))));
  EXPECT_THAT(TinyWith("name: \"w\" shape: [ 3, 8 ]",
                       "name: \"w\" shape: [ 3, 9223372036854775807 ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("parameter 'w'"),
                                       HasSubstr("64 bits"))));
  // Fits in 64 bits but leaves no headroom for byte sizes.
  EXPECT_THAT(TinyWith("shape: [ 4, 8 ]", "shape: [ 1073741824, 1073741824 ]"),
              StatusIs(kInvalid,
                       AllOf(HasSubstr("input 'x'"), HasSubstr("too large"))));
}

TEST(ValidationTest, InferredOutputTooLarge) {
  // An expand whose output overflows, from valid inputs.
  hap::v1::Graph p = Tiny();
  auto* op = p.add_ops();
  op->set_name("big");
  op->set_type("expand");
  op->add_inputs("b");
  op->add_outputs("big");
  auto* shape = (*op->mutable_attrs())["shape"].mutable_ints();
  shape->add_values(int64_t{1} << 40);
  shape->add_values(int64_t{1} << 40);
  shape->add_values(3);
  EXPECT_THAT(FromProto(p), StatusIs(kInvalid, AllOf(HasSubstr("op 'big'"),
                                                     HasSubstr("64 bits"))));
}

TEST(ValidationTest, TensorDefinedTwice) {
  EXPECT_THAT(
      TinyWith("outputs: [ \"logits\" ]", "outputs: [ \"x\" ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("tensor 'x'"), HasSubstr("op 'fc'"),
                               HasSubstr("defined twice"))));
  EXPECT_THAT(TinyWith("outputs: [ \"loss\" ]", "outputs: [ \"logits\" ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'logits'"),
                                       HasSubstr("defined twice"))));
  EXPECT_THAT(TinyWith("name: \"b\" shape", "name: \"w\" shape"),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'w'"),
                                       HasSubstr("defined twice"))));
  EXPECT_THAT(TinyWith("outputs: [ \"logits\" ]",
                       "outputs: [ \"logits\", \"logits\" ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'logits'"),
                                       HasSubstr("defined twice"))));
}

TEST(ValidationTest, WrongNumberOfOutputs) {
  EXPECT_THAT(
      TinyWith("outputs: [ \"logits\" ]", "outputs: [ \"logits\", \"extra\" ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("op 'fc' (linear)"),
                               HasSubstr("produces 1 outputs but 2"))));
  EXPECT_THAT(
      TinyWith("outputs: [ \"logits\" ]", ""),
      StatusIs(kInvalid, AllOf(HasSubstr("op 'fc'"), HasSubstr("no outputs"))));
}

TEST(ValidationTest, EmptyNames) {
  EXPECT_THAT(
      TinyWith("name: \"fc\"", ""),
      StatusIs(kInvalid, AllOf(HasSubstr("op #0"), HasSubstr("no name"))));
  EXPECT_THAT(
      TinyWith("name: \"x\"", "name: \"\""),
      StatusIs(kInvalid, AllOf(HasSubstr("input"), HasSubstr("empty name"))));
  EXPECT_THAT(
      TinyWith("outputs: [ \"logits\" ]", "outputs: [ \"\" ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("op 'fc'"), HasSubstr("empty name"))));
}

TEST(ValidationTest, BadDtypes) {
  EXPECT_THAT(TinyWith("shape: [ 4, 8 ] dtype: FLOAT32", "shape: [ 4, 8 ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("input 'x'"),
                                       HasSubstr("no valid dtype"))));
  EXPECT_THAT(
      TinyWith("shape: [ 4, 8 ] dtype: FLOAT32", "shape: [ 4, 8 ] dtype: 42"),
      StatusIs(kInvalid,
               AllOf(HasSubstr("input 'x'"), HasSubstr("no valid dtype"))));
  EXPECT_THAT(
      TinyWith("shape: [ 3 ] dtype: FLOAT32", "shape: [ 3 ] dtype: INT32"),
      StatusIs(kInvalid,
               AllOf(HasSubstr("parameter 'b'"), HasSubstr("floating point"))));
  EXPECT_THAT(TinyWith("name: \"b\" shape: [ 3 ] dtype: FLOAT32",
                       "name: \"b\" shape: [ 3 ] dtype: FLOAT16"),
              StatusIs(kInvalid, AllOf(HasSubstr("op 'fc' (linear)"),
                                       HasSubstr("same dtype"))));
}

TEST(ValidationTest, BadInitializer) {
  EXPECT_THAT(TinyWith("stddev: 0.02", "stddev: -1"),
              StatusIs(kInvalid, AllOf(HasSubstr("parameter 'w'"),
                                       HasSubstr("invalid initializer"))));
  EXPECT_THAT(TinyWith("stddev: 0.02", "stddev: nan"),
              StatusIs(kInvalid, AllOf(HasSubstr("parameter 'w'"),
                                       HasSubstr("invalid initializer"))));
}

// A VALUES initializer lists the elements as runs; one that does not
// describe the tensor is refused naming the parameter and what is wrong.
TEST(ValidationTest, ValuesInitializer) {
  const std::string kind = "kind: NORMAL stddev: 0.02";
  auto ok = TinyWith(kind, "kind: VALUES values: [ 1, -2.5, 0 ] counts: [ 10, 4, 10 ]");
  ASSERT_THAT(ok, IsOk());
  const Tensor& w = ok->tensor(*ok->FindTensor("w"));
  EXPECT_EQ(w.init.kind, Initializer::Kind::kValues);
  EXPECT_EQ(w.init.values, (std::vector<double>{1, -2.5, 0}));
  EXPECT_EQ(w.init.counts, (std::vector<int64_t>{10, 4, 10}));
  EXPECT_THAT(
      TinyWith(kind, "kind: VALUES values: [ 1, 2 ] counts: [ 24 ]"),
      StatusIs(kInvalid, AllOf(HasSubstr("parameter 'w'"), HasSubstr("2 values but 1 counts"))));
  EXPECT_THAT(TinyWith(kind, "kind: VALUES values: [ 1, 2 ] counts: [ 10, 10 ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("parameter 'w'"),
                                       HasSubstr("add up to 20 elements, not its 24"))));
  EXPECT_THAT(TinyWith(kind, "kind: VALUES values: [ 1, 2, 3 ] counts: [ 25, 0, -1 ]"),
              StatusIs(kInvalid, HasSubstr("count 1 is 0")));
  EXPECT_THAT(TinyWith(kind, "kind: VALUES values: [ 1, inf ] counts: [ 12, 12 ]"),
              StatusIs(kInvalid, HasSubstr("value 1 is not finite")));
  EXPECT_THAT(TinyWith(kind, "kind: VALUES"),
              StatusIs(kInvalid, HasSubstr("add up to 0 elements, not its 24")));
  // A finite double past FLOAT32's range started the parameter as inf.
  EXPECT_THAT(TinyWith(kind, "kind: VALUES values: [ 1, -1e39 ] counts: [ 12, 12 ]"),
              StatusIs(kInvalid, AllOf(HasSubstr("parameter 'w'"),
                                       HasSubstr("value 1 (-1e+39) does not fit its dtype f32"))));
  EXPECT_THAT(
      TinyWith(kind, "kind: VALUES values: [ 3.4028234663852886e38, -1 ] counts: [ 1, 23 ]"),
      IsOk());
}

hap::v1::Graph WithTranspose(const hap::v1::AttrValue& perm) {
  hap::v1::Graph p = Tiny();
  auto* op = p.add_ops();
  op->set_name("t");
  op->set_type("transpose");
  op->add_inputs("logits");
  op->add_outputs("logits_t");
  (*op->mutable_attrs())["perm"] = perm;
  return p;
}

TEST(ValidationTest, WrongAttributeType) {
  hap::v1::AttrValue perm;
  perm.set_s("1,0");
  EXPECT_THAT(FromProto(WithTranspose(perm)),
              StatusIs(kInvalid, AllOf(HasSubstr("op 't' (transpose)"),
                                       HasSubstr("attribute 'perm'"),
                                       HasSubstr("list of integers"))));
  perm.set_i(1);
  EXPECT_THAT(FromProto(WithTranspose(perm)),
              StatusIs(kInvalid, AllOf(HasSubstr("op 't' (transpose)"),
                                       HasSubstr("attribute 'perm'"))));
  perm.Clear();
  EXPECT_THAT(FromProto(WithTranspose(perm)),
              StatusIs(kInvalid, AllOf(HasSubstr("op 't' (transpose)"),
                                       HasSubstr("attribute 'perm'"),
                                       HasSubstr("no value"))));
  perm.mutable_ints()->add_values(1);
  perm.mutable_ints()->add_values(0);
  EXPECT_THAT(FromProto(WithTranspose(perm)), IsOk());
  perm.mutable_ints()->set_values(0, 2);
  EXPECT_THAT(
      FromProto(WithTranspose(perm)),
      StatusIs(kInvalid, AllOf(HasSubstr("op 't' (transpose)"),
                               HasSubstr("perm entry 2 is out of range"))));
  perm.mutable_ints()->set_values(0, 0);
  EXPECT_THAT(FromProto(WithTranspose(perm)),
              StatusIs(kInvalid, AllOf(HasSubstr("op 't' (transpose)"),
                                       HasSubstr("not a permutation"))));
}

TEST(ValidationTest, MissingRequiredAttribute) {
  hap::v1::AttrValue perm;
  hap::v1::Graph p = WithTranspose(perm);
  p.mutable_ops(2)->mutable_attrs()->clear();
  EXPECT_THAT(FromProto(p),
              StatusIs(kInvalid, AllOf(HasSubstr("op 't' (transpose)"),
                                       HasSubstr("missing required attribute "
                                                 "'perm'"))));
}

TEST(ValidationTest, ValueInfoThatDisagreesWithInference) {
  hap::v1::Graph p = Tiny();
  auto* vi = p.add_value_info();
  vi->set_name("logits");
  vi->add_shape(4);
  vi->add_shape(3);
  vi->set_dtype(hap::v1::FLOAT32);
  EXPECT_THAT(FromProto(p), IsOk());
  vi->set_shape(1, 4);
  EXPECT_THAT(FromProto(p),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'logits'"),
                                       HasSubstr("declared f32[4,4]"),
                                       HasSubstr("inference gives f32[4,3]"))));
  vi->set_shape(1, 3);
  vi->set_dtype(hap::v1::FLOAT16);
  EXPECT_THAT(FromProto(p),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'logits'"),
                                       HasSubstr("declared f16[4,3]"))));
  vi->set_name("nothing");
  EXPECT_THAT(FromProto(p), StatusIs(kInvalid, HasSubstr("'nothing'")));
  vi->set_name("logits");
  vi->set_shape(1, 0);
  EXPECT_THAT(FromProto(p), StatusIs(kInvalid, AllOf(HasSubstr("'logits'"),
                                                     HasSubstr("positive"))));
}

TEST(ValidationTest, NoOps) {
  hap::v1::Graph p = Tiny();
  p.clear_ops();
  p.set_loss("x");
  EXPECT_THAT(FromProto(p), StatusIs(kInvalid, AllOf(HasSubstr("'tiny'"),
                                                     HasSubstr("no ops"))));
}

TEST(ValidationTest, TruncatedFiles) {
  auto g = BuildZooModel("gpt", {{"layers", 2},
                                 {"hidden", 64},
                                 {"heads", 4},
                                 {"ffn", 128},
                                 {"seq", 16},
                                 {"vocab", 100},
                                 {"batch", 8}});
  ASSERT_THAT(g, IsOk());
  std::string json = GraphToJson(*g);
  for (GraphFormat f : {GraphFormat::kJson, GraphFormat::kAuto}) {
    EXPECT_THAT(ParseGraph(json.substr(0, json.size() / 2), f),
                StatusIs(kInvalid, AllOf(HasSubstr("JSON does not parse"),
                                         HasSubstr("truncated"))));
  }
  std::string text = ToProto(*g).DebugString();
  EXPECT_THAT(ParseGraph(text.substr(0, text.size() / 2), GraphFormat::kText),
              StatusIs(kInvalid, AllOf(HasSubstr("text format does not parse"),
                                       HasSubstr("line "))));
  std::string bytes;
  ASSERT_TRUE(ToProto(*g).SerializeToString(&bytes));
  for (GraphFormat f : {GraphFormat::kBinary, GraphFormat::kAuto}) {
    EXPECT_THAT(ParseGraph(bytes.substr(0, bytes.size() / 2), f),
                StatusIs(kInvalid, HasSubstr("protobuf does not parse")));
  }
  // Cut at every length: never OK, always a message.
  for (size_t n = 0; n < bytes.size(); n += 7) {
    auto r = ParseGraph(bytes.substr(0, n), GraphFormat::kBinary);
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), kInvalid);
    EXPECT_FALSE(r.status().message().empty());
  }
}

TEST(ValidationTest, GarbageFiles) {
  EXPECT_THAT(ParseGraph("{\"name\": 3", GraphFormat::kAuto),
              StatusIs(kInvalid, HasSubstr("JSON")));
  EXPECT_THAT(ParseGraph("{\"nmae\": \"x\"}", GraphFormat::kJson),
              StatusIs(kInvalid, HasSubstr("nmae")));
  EXPECT_THAT(ParseGraph("name: \"x\" bogus: 1", GraphFormat::kText),
              StatusIs(kInvalid, HasSubstr("bogus")));
  EXPECT_THAT(ParseGraph("", GraphFormat::kAuto),
              StatusIs(kInvalid, HasSubstr("no loss")));
  EXPECT_THAT(
      ParseGraph(std::string("\xff\xff\xff\x01", 4), GraphFormat::kAuto),
      StatusIs(kInvalid, HasSubstr("protobuf does not parse")));
}

// A binary graph whose name is 123 bytes long starts "\n{": auto-detection
// must not take it for JSON.
TEST(ValidationTest, AutoDetectsBinaryThatLooksLikeJson) {
  hap::v1::Graph p = Tiny();
  p.set_name(std::string(123, 'n'));
  std::string bytes;
  ASSERT_TRUE(p.SerializeToString(&bytes));
  ASSERT_EQ(bytes.substr(0, 2), "\n{");
  auto g = ParseGraph(bytes, GraphFormat::kAuto);
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->name(), p.name());
}

// Pooling and convolution with extreme attributes: errors (or sane graphs),
// never signed overflow.
TEST(ValidationTest, ExtremePoolingAttributes) {
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  struct Case {
    std::string type;
    std::string attr;
    std::vector<int64_t> value;
  };
  for (const Case& c : std::vector<Case>{{"max_pool2d", "kernel", {kMax}},
                                         {"max_pool2d", "kernel", {int64_t{1} << 62}},
                                         {"max_pool2d", "padding", {kMax}},
                                         {"max_pool2d", "stride", {kMax}},
                                         {"conv2d", "padding", {kMax}},
                                         {"conv2d", "padding", {int64_t{1} << 62}},
                                         {"conv2d", "stride", {kMax}},
                                         {"conv2d", "dilation", {kMax}},
                                         {"conv2d", "dilation", {int64_t{1} << 62}},
                                         {"adaptive_avg_pool2d", "output_size", {kMax}}}) {
    SCOPED_TRACE(c.type + " " + c.attr);
    GraphBuilder b("pool");
    TensorId x = b.Input("x", F32({2, 3, 8, 8}));
    TensorId y = b.Input("y", I64({2}), InputRole::kLabels);
    TensorId w = b.Parameter("w", F32({4, 3, 3, 3}), Initializer::Zeros());
    Attrs attrs;
    if (c.type == "max_pool2d") {
      attrs.Set("kernel", std::vector<int64_t>{2});
      if (c.attr == "padding") attrs.Set("kernel", c.value);
    }
    if (c.type == "adaptive_avg_pool2d") {
      attrs.Set("output_size", std::vector<int64_t>{1});
    }
    attrs.Set(c.attr, c.value);
    std::vector<TensorId> ins = {x};
    if (c.type == "conv2d") ins.push_back(w);
    TensorId h = b.Add(c.type, "op", ins, attrs);
    h = b.Add("flatten", "flat", {h});
    h = b.Add("sum", "s", {h},
              {{"axes", std::vector<int64_t>{1}}, {"keepdims", true}});
    h = b.Add("expand", "e", {h}, {{"shape", std::vector<int64_t>{2, 5}}});
    b.SetLoss(b.Add("cross_entropy", "loss", {h, y}));
    auto g = b.Build();
    if (g.ok()) {
      EXPECT_TRUE(std::isfinite(g->ForwardFlops()));
      EXPECT_GE(g->ForwardFlops(), 0);
      EXPECT_THAT(FromProto(ToProto(*g)), IsOk());
    } else {
      EXPECT_THAT(g, StatusIs(kInvalid,
                              AllOf(HasSubstr("op 'op'"), HasSubstr(c.type))));
    }
  }
}

TEST(ValidationTest, ExtremeSplitSizes) {
  GraphBuilder b("split");
  TensorId x = b.Input("x", F32({4, 6}));
  b.AddOp("split", "sp", {x},
          {{"axis", int64_t{1}},
           {"sizes", std::vector<int64_t>{int64_t{1} << 62, int64_t{1} << 62,
                                          int64_t{1} << 62, 6}}});
  EXPECT_THAT(b.Build(), StatusIs(kInvalid, AllOf(HasSubstr("op 'sp' (split)"),
                                                  HasSubstr("'sizes'"))));
}

}  // namespace
}  // namespace hap::graph
