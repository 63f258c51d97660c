// Runs every IR op's forward and backward CPU kernel on fixed-seed float32
// inputs and writes inputs, outputs, output gradients and input gradients
// as JSON, for tests/kernels_torch_test.py to check against PyTorch.
//
// Usage: kernel_dump OUT.json [THREADS]
//
// Format: {"cases": [{"name", "op", "attrs": {name: value}, "step",
//   "inputs": [T or null], "outputs": [T], "dys": [T], "grads": [T or
//   null]}]}, T = {"dtype": "f32"|"i64", "shape": [...], "data": [...]};
// a null gradient is an input the op does not differentiate.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "executor/cpu/kernels.h"
#include "planner/graph/op_registry.h"

namespace hap::executor {
namespace {

using graph::Attrs;
using graph::DType;
using Ints = std::vector<int64_t>;

HostTensor Rand(Shape s, uint64_t seed, double scale = 1.0) {
  HostTensor t(DType::kFloat32, std::move(s));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    t.as<float>()[i] = static_cast<float>(u(gen));
  }
  return t;
}

// Values in [0.25, 4] (the domain of rsqrt and log).
HostTensor Positive(Shape s, uint64_t seed) {
  HostTensor t = Rand(std::move(s), seed);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    t.as<float>()[i] = 0.25f + 1.875f * (t.as<float>()[i] + 1.0f);
  }
  return t;
}

HostTensor Ids(Shape s, uint64_t seed, int64_t below) {
  HostTensor t(DType::kInt64, std::move(s));
  std::mt19937_64 gen(seed);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    t.as<int64_t>()[i] = static_cast<int64_t>(gen() % below);
  }
  return t;
}

struct Case {
  std::string name, op;
  Attrs attrs;
  std::vector<HostTensor> inputs;  // HostTensor() for an absent input
  std::vector<Shape> out_shapes = {};  // empty: the op registry's inference
  int64_t step = 0;
};

absl::StatusOr<std::vector<Shape>> OutShapes(const Case& c) {
  if (!c.out_shapes.empty()) return c.out_shapes;
  const graph::OpDef* def = graph::OpRegistry::Global().Find(c.op);
  Attrs ir;  // the lowering's sharding attributes are not IR attributes
  for (const auto& [name, v] : c.attrs.values()) {
    if (std::count(def->attrs.begin(), def->attrs.end(), name)) ir.Set(name, v);
  }
  std::vector<std::string> names;
  std::vector<graph::TensorType> types;
  for (const HostTensor& t : c.inputs) {
    names.push_back(absl::StrCat("in", names.size()));
    types.push_back({t.dtype(), t.shape()});
  }
  auto out = graph::InferOp(c.name, c.op, ir, names, types);
  if (!out.ok()) return out.status();
  std::vector<Shape> shapes;
  for (const auto& t : *out) shapes.push_back(t.shape);
  return shapes;
}

std::string Json(const HostTensor& t) {
  if (t.data() == nullptr) return "null";
  std::ostringstream s;
  s << "{\"dtype\": \"" << graph::DTypeName(t.dtype()) << "\", \"shape\": ["
    << absl::StrJoin(t.shape(), ", ") << "], \"data\": [";
  char buf[32];
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (i > 0) s << ",";
    if (t.dtype() == DType::kFloat32) {
      std::snprintf(buf, sizeof(buf), "%.9g", t.as<float>()[i]);
      s << buf;
    } else {
      s << t.as<int64_t>()[i];
    }
  }
  s << "]}";
  return s.str();
}

std::string Json(const std::vector<HostTensor>& ts) {
  std::vector<std::string> parts;
  for (const HostTensor& t : ts) parts.push_back(Json(t));
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

std::string Json(const graph::AttrValue& v) {
  struct Visitor {
    std::string operator()(int64_t i) const { return absl::StrCat(i); }
    std::string operator()(double d) const {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.17g", d);
      return buf;
    }
    std::string operator()(const std::string& s) const {
      return absl::StrCat("\"", s, "\"");
    }
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(const std::vector<int64_t>& v) const {
      return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
    }
    std::string operator()(const std::vector<double>& v) const {
      return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
    }
  };
  return std::visit(Visitor{}, v);
}

std::vector<TensorView> Views(const std::vector<HostTensor>& ts) {
  std::vector<TensorView> v;
  for (const HostTensor& t : ts) v.push_back(t.view());
  return v;
}

// Runs forward and backward of one case; returns its JSON object.
absl::StatusOr<std::string> RunCase(const Case& c, int threads,
                                    uint64_t seed) {
  KernelContext ctx;
  ctx.num_threads = threads;
  ctx.step = c.step;
  absl::StatusOr<std::vector<Shape>> shapes = OutShapes(c);
  if (!shapes.ok()) return shapes.status();
  std::vector<HostTensor> outs, dys, grads;
  for (const Shape& s : *shapes) {
    outs.emplace_back(DType::kFloat32, s);
    dys.push_back(Rand(s, seed++));
  }
  absl::Status st = RunCpuKernel(c.op, ctx, c.attrs, Views(c.inputs), Views(outs));
  if (!st.ok()) return st;
  const auto& nd = graph::OpRegistry::Global().Find(c.op)->non_differentiable_inputs;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const HostTensor& x = c.inputs[i];
    const bool diff = x.data() != nullptr && x.dtype() == DType::kFloat32 &&
                      std::count(nd.begin(), nd.end(), static_cast<int>(i)) == 0;
    grads.push_back(diff ? HostTensor(DType::kFloat32, x.shape()) : HostTensor());
    if (diff) std::fill_n(grads.back().as<float>(), x.num_elements(), 0.0f);
  }
  std::vector<HostTensor> gin = c.inputs;
  gin.insert(gin.end(), outs.begin(), outs.end());
  gin.insert(gin.end(), dys.begin(), dys.end());
  st = RunCpuKernel(c.op + "_grad", ctx, c.attrs, Views(gin), Views(grads));
  if (!st.ok()) return st;
  std::vector<std::string> attrs;
  for (const auto& [name, v] : c.attrs.values()) {
    attrs.push_back(absl::StrCat("\"", name, "\": ", Json(v)));
  }
  return absl::StrCat("{\"name\": \"", c.name, "\", \"op\": \"", c.op,
                      "\", \"attrs\": {", absl::StrJoin(attrs, ", "),
                      "}, \"step\": ", c.step, ", \"inputs\": ",
                      Json(c.inputs), ", \"outputs\": ", Json(outs),
                      ", \"dys\": ", Json(dys), ", \"grads\": ", Json(grads),
                      "}");
}

// The combine weights of moe_gate on `logits`.
HostTensor Combine(const HostTensor& logits, int64_t k, int64_t cap) {
  HostTensor out(DType::kFloat32, {logits.shape()[0], logits.shape()[1], cap});
  std::vector<TensorView> in = {logits.view()}, o = {out.view()};
  absl::Status st = RunCpuKernel("moe_gate", {}, {{"k", k}, {"capacity", cap}},
                                 in, o);
  if (!st.ok()) std::cerr << st << "\n";
  return out;
}

std::vector<Case> Cases() {
  const HostTensor none;
  HostTensor gate_logits = Rand({16, 4}, 900, 2.0);
  HostTensor combine = Combine(gate_logits, 2, 6);
  return {
      {"linear_bias", "linear", {}, {Rand({4, 7, 33}, 1), Rand({17, 33}, 2), Rand({17}, 3)}},
      {"linear_nobias", "linear", {}, {Rand({5, 16}, 4), Rand({8, 16}, 5)}},
      {"matmul_shared", "matmul", {}, {Rand({3, 10, 12}, 6), Rand({12, 7}, 7)}},
      {"matmul_batched", "matmul", {}, {Rand({2, 3, 17, 9}, 8), Rand({2, 3, 9, 5}, 9)}},
      {"add_same", "add", {}, {Rand({8, 33}, 10), Rand({8, 33}, 11)}},
      {"add_bcast", "add", {}, {Rand({4, 5, 6}, 12), Rand({5, 1}, 13)}},
      {"add_bcast_large", "add", {}, {Rand({64, 512}, 14), Rand({512}, 15)}},
      {"sub_bcast", "sub", {}, {Rand({1, 6}, 16), Rand({4, 1}, 17)}},
      {"mul_bcast", "mul", {}, {Rand({3, 4, 5}, 18), Rand({5}, 19)}},
      {"mul_same", "mul", {}, {Rand({7, 9}, 20), Rand({7, 9}, 21)}},
      {"add_absent", "add", {}, {none, Rand({3, 4}, 22)}, {{3, 4}}},
      {"sub_absent_first", "sub", {}, {none, Rand({3, 4}, 23)}, {{3, 4}}},
      {"relu", "relu", {}, {Rand({16, 65}, 24, 3.0)}},
      {"gelu", "gelu", {}, {Rand({16, 65}, 25, 3.0)}},
      {"sigmoid", "sigmoid", {}, {Rand({16, 65}, 26, 3.0)}},
      {"tanh", "tanh", {}, {Rand({16, 65}, 27, 3.0)}},
      {"silu", "silu", {}, {Rand({16, 65}, 82, 6.0)}},
      {"relu6", "relu6", {}, {Rand({16, 65}, 83, 9.0)}},
      {"hardsigmoid", "hardsigmoid", {}, {Rand({16, 65}, 99, 6.0)}},
      {"hardswish", "hardswish", {}, {Rand({16, 65}, 100, 6.0)}},
      {"exp", "exp", {}, {Rand({16, 65}, 101, 3.0)}},
      {"rsqrt", "rsqrt", {}, {Positive({16, 65}, 102)}},
      {"log", "log", {}, {Positive({16, 65}, 103)}},
      {"dropout", "dropout", {{"p", 0.2}, {"rng_key", int64_t{12345}}}, {Rand({8, 33}, 28)}, {}, 7},
      {"dropout_shard",
       "dropout",
       {{"p", 0.3},
        {"rng_key", int64_t{-77}},
        {"global_shape", Ints{8, 33}},
        {"offsets", Ints{2, 5}}},
       {Rand({4, 10}, 29)},
       {},
       3},
      {"drop_path_shard",
       "drop_path",
       {{"p", 0.4},
        {"rng_key", int64_t{-91}},
        {"global_shape", Ints{12, 3, 4}},
        {"offsets", Ints{5, 0, 0}}},
       {Rand({6, 3, 4}, 98)},
       {},
       4},
      {"scale", "scale", {{"factor", 0.125}}, {Rand({5, 6}, 30)}},
      {"layer_norm",
       "layer_norm",
       {{"eps", 1e-5}},
       {Rand({6, 5, 48}, 31, 2.0), Rand({48}, 32), Rand({48}, 33)}},
      {"layer_norm_large",
       "layer_norm",
       {},
       {Rand({64, 512}, 34, 2.0), Rand({512}, 35), Rand({512}, 36)}},
      {"batch_norm",
       "batch_norm",
       {{"eps", 1e-5}, {"momentum", 0.2}},
       {Rand({5, 4, 3, 3}, 87, 2.0), Rand({4}, 88), Rand({4}, 89)}},
      {"batch_norm_1d",
       "batch_norm",
       {{"eps", 1e-3}},
       {Rand({9, 6}, 90, 3.0), Rand({6}, 91), Rand({6}, 92)}},
      {"softmax", "softmax", {}, {Rand({6, 40}, 37, 3.0)}},
      {"softmax_causal", "softmax", {{"causal", true}}, {Rand({2, 3, 9, 9}, 38, 3.0)}},
      {"softmax_mask", "softmax", {}, {Rand({2, 4, 10}, 39, 3.0), Rand({1, 1, 10}, 40, 2.0)}},
      {"softmax_causal_mask",
       "softmax",
       {{"causal", true}},
       {Rand({2, 2, 6, 6}, 41), Rand({2, 1, 1, 6}, 42)}},
      {"softmax_causal_large", "softmax", {{"causal", true}}, {Rand({2, 4, 64, 64}, 43, 3.0)}},
      {"log_softmax", "log_softmax", {}, {Rand({7, 50}, 44, 3.0)}},
      {"embedding", "embedding", {}, {Ids({3, 5}, 45, 20), Rand({20, 8}, 46)}},
      {"transpose_0231", "transpose", {{"perm", Ints{0, 2, 3, 1}}}, {Rand({2, 3, 4, 5}, 47)}},
      {"transpose_0213", "transpose", {{"perm", Ints{0, 2, 1, 3}}}, {Rand({2, 3, 4, 5}, 48)}},
      {"reshape", "reshape", {{"shape", Ints{6, -1}}}, {Rand({2, 3, 4}, 49)}},
      {"flatten",
       "flatten",
       {{"start_dim", int64_t{1}}, {"end_dim", int64_t{2}}},
       {Rand({2, 3, 4, 5}, 50)}},
      {"concat",
       "concat",
       {{"axis", int64_t{1}}},
       {Rand({2, 3, 4}, 51), Rand({2, 1, 4}, 52), Rand({2, 5, 4}, 53)}},
      {"split", "split", {{"axis", int64_t{-1}}, {"sizes", Ints{2, 3, 4}}}, {Rand({3, 9}, 54)}},
      {"slice",
       "slice",
       {{"axis", int64_t{1}}, {"start", int64_t{2}}, {"end", int64_t{5}}},
       {Rand({3, 7, 2}, 55)}},
      {"expand", "expand", {{"shape", Ints{2, 3, 4}}}, {Rand({3, 1}, 56)}},
      {"sum_axes", "sum", {{"axes", Ints{0, 2}}}, {Rand({3, 4, 5}, 57)}},
      {"sum_all", "sum", {}, {Rand({3, 4, 5}, 58)}},
      {"mean_keepdims", "mean", {{"axes", Ints{-1}}, {"keepdims", true}}, {Rand({3, 4, 5}, 59)}},
      {"mean_all", "mean", {}, {Rand({6, 7}, 60)}},
      {"nll_loss", "nll_loss", {}, {Rand({9, 6}, 61, 3.0), Ids({9}, 62, 6)}},
      {"cross_entropy", "cross_entropy", {}, {Rand({9, 6}, 63, 3.0), Ids({9}, 64, 6)}},
      {"cross_entropy_global_rows",
       "cross_entropy",
       {{"global_rows", int64_t{20}}},
       {Rand({9, 6}, 65, 3.0), Ids({9}, 66, 6)}},
      {"conv2d_bias",
       "conv2d",
       {{"stride", Ints{2}}, {"padding", Ints{1, 1}}},
       {Rand({2, 3, 9, 9}, 67), Rand({5, 3, 3, 3}, 68), Rand({5}, 69)}},
      {"conv2d_nobias",
       "conv2d",
       {{"stride", Ints{1, 2}}},
       {Rand({1, 4, 6, 7}, 70), Rand({2, 4, 2, 3}, 71)}},
      {"conv2d_grouped",
       "conv2d",
       {{"stride", Ints{2}}, {"padding", Ints{1}}, {"groups", int64_t{2}}},
       {Rand({2, 4, 9, 8}, 93), Rand({6, 2, 3, 3}, 94), Rand({6}, 95)}},
      {"conv2d_depthwise",
       "conv2d",
       {{"padding", Ints{1}}, {"groups", int64_t{5}}},
       {Rand({2, 5, 7, 7}, 96), Rand({10, 1, 3, 3}, 97)}},
      {"conv2d_dilated",
       "conv2d",
       {{"stride", Ints{1, 2}}, {"padding", Ints{2, 3}}, {"dilation", Ints{2, 3}}},
       {Rand({2, 3, 9, 11}, 98), Rand({4, 3, 3, 3}, 99), Rand({4}, 100)}},
      {"conv2d_dilated_depthwise",
       "conv2d",
       {{"padding", Ints{2}}, {"dilation", Ints{2}}, {"groups", int64_t{4}}},
       {Rand({2, 4, 8, 7}, 101), Rand({8, 1, 3, 3}, 102)}},
      {"conv2d_1x1", "conv2d", {}, {Rand({2, 6, 4, 4}, 72), Rand({3, 6, 1, 1}, 73), Rand({3}, 74)}},
      {"conv3d_bias",
       "conv3d",
       {{"stride", Ints{1, 2, 2}}, {"padding", Ints{1}}},
       {Rand({2, 3, 5, 7, 6}, 301), Rand({4, 3, 3, 3, 3}, 302), Rand({4}, 303)}},
      {"conv3d_2plus1",  // r2plus1d's (1, 3, 3) then (3, 1, 1) kernels
       "conv3d",
       {{"stride", Ints{2, 1, 1}}, {"padding", Ints{1, 0, 0}}},
       {Rand({2, 4, 6, 5, 5}, 304), Rand({3, 4, 3, 1, 1}, 305)}},
      {"conv3d_dilated_grouped",
       "conv3d",
       {{"padding", Ints{2, 1, 1}}, {"dilation", Ints{2, 1, 2}}, {"groups", int64_t{2}}},
       {Rand({2, 4, 5, 6, 6}, 306), Rand({6, 2, 3, 2, 3}, 307), Rand({6}, 308)}},
      {"conv3d_1x1x1",
       "conv3d",
       {},
       {Rand({2, 6, 3, 4, 4}, 309), Rand({3, 6, 1, 1, 1}, 310), Rand({3}, 311)}},
      {"max_pool2d",
       "max_pool2d",
       {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"padding", Ints{1}}},
       {Rand({2, 3, 9, 9}, 75)}},
      {"max_pool2d_2x2", "max_pool2d", {{"kernel", Ints{2, 2}}}, {Rand({1, 2, 8, 6}, 76)}},
      {"max_pool2d_ceil",
       "max_pool2d",
       {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"ceil_mode", true}},
       {Rand({2, 3, 13, 10}, 84)}},
      {"max_pool3d",  // s3d's first pool
       "max_pool3d",
       {{"kernel", Ints{1, 3, 3}}, {"stride", Ints{1, 2, 2}}, {"padding", Ints{0, 1, 1}}},
       {Rand({2, 3, 4, 9, 8}, 312)}},
      {"max_pool3d_ceil",
       "max_pool3d",
       {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"padding", Ints{1}}, {"ceil_mode", true}},
       {Rand({2, 2, 6, 7, 8}, 313)}},
      {"avg_pool3d",  // s3d's last pool
       "avg_pool3d",
       {{"kernel", Ints{2, 3, 3}}, {"stride", Ints{1}}},
       {Rand({2, 3, 3, 5, 4}, 314)}},
      {"avg_pool3d_ceil_nopad",
       "avg_pool3d",
       {{"kernel", Ints{3, 3, 2}},
        {"stride", Ints{2}},
        {"padding", Ints{1, 1, 0}},
        {"ceil_mode", true},
        {"count_include_pad", false}},
       {Rand({2, 2, 6, 7, 5}, 315)}},
      {"avg_pool2d",
       "avg_pool2d",
       {{"kernel", Ints{3}}, {"stride", Ints{2}}, {"padding", Ints{1}}},
       {Rand({2, 3, 9, 8}, 85)}},
      {"avg_pool2d_ceil_nopad",
       "avg_pool2d",
       {{"kernel", Ints{3, 2}},
        {"stride", Ints{2}},
        {"padding", Ints{1, 0}},
        {"ceil_mode", true},
        {"count_include_pad", false}},
       {Rand({2, 3, 10, 7}, 86)}},
      {"adaptive_avg_pool2d",
       "adaptive_avg_pool2d",
       {{"output_size", Ints{3, 2}}},
       {Rand({2, 3, 7, 5}, 77)}},
      {"adaptive_avg_pool2d_1",
       "adaptive_avg_pool2d",
       {{"output_size", Ints{1}}},
       {Rand({2, 3, 4, 4}, 78)}},
      {"moe_gate_top2", "moe_gate", {{"k", int64_t{2}}, {"capacity", int64_t{6}}}, {gate_logits}},
      {"moe_gate_top1",
       "moe_gate",
       {{"k", int64_t{1}}, {"capacity", int64_t{5}}},
       {Rand({16, 4}, 79, 2.0)}},
      {"moe_dispatch", "moe_dispatch", {}, {Rand({16, 8}, 80), combine}},
      {"moe_combine", "moe_combine", {}, {Rand({4, 6, 8}, 81), combine}},
      {"lstm",
       "lstm",
       {},
       {Rand({3, 6, 5}, 101), Rand({32, 5}, 102), Rand({32, 8}, 103), Rand({32}, 104),
        Rand({32}, 105)}},
      {"lstm_reverse",
       "lstm",
       {{"reverse", true}},
       {Rand({2, 5, 4}, 106, 2.0), Rand({12, 4}, 107), Rand({12, 3}, 108), Rand({12}, 109),
        Rand({12}, 110)}},
      {"lstm_nobias", "lstm", {}, {Rand({2, 4, 3}, 111), Rand({16, 3}, 112), Rand({16, 4}, 113)}},
      {"lstm_large",
       "lstm",
       {},
       {Rand({4, 20, 32}, 114), Rand({256, 32}, 115, 0.2), Rand({256, 64}, 116, 0.2),
        Rand({256}, 117), Rand({256}, 118)}},
      {"gru",
       "gru",
       {},
       {Rand({3, 6, 5}, 121), Rand({24, 5}, 122), Rand({24, 8}, 123), Rand({24}, 124),
        Rand({24}, 125)}},
      {"gru_reverse",
       "gru",
       {{"reverse", true}},
       {Rand({2, 5, 4}, 126, 2.0), Rand({9, 4}, 127), Rand({9, 3}, 128), Rand({9}, 129),
        Rand({9}, 130)}},
      {"gru_nobias", "gru", {}, {Rand({2, 4, 3}, 131), Rand({12, 3}, 132), Rand({12, 4}, 133)}},
  };
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: kernel_dump OUT.json [THREADS]\n";
    return 2;
  }
  const int threads = argc > 2 ? std::atoi(argv[2]) : 1;
  SetBlasThreads(threads);
  std::vector<std::string> cases;
  uint64_t seed = 5000;
  for (const Case& c : Cases()) {
    absl::StatusOr<std::string> j = RunCase(c, threads, seed);
    seed += 10;
    if (!j.ok()) {
      std::cerr << "case " << c.name << ": " << j.status() << "\n";
      return 1;
    }
    cases.push_back(*j);
  }
  std::ofstream out(argv[1]);
  out << "{\"cases\": [\n" << absl::StrJoin(cases, ",\n") << "\n]}\n";
  return out.good() ? 0 : 1;
}

}  // namespace
}  // namespace hap::executor

int main(int argc, char** argv) { return hap::executor::Main(argc, argv); }
