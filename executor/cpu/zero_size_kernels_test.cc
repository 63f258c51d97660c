// Every CPU kernel, forward and backward, on arguments with a dimension of
// 0: a bad or degenerate input must never crash the executor. Each case is a
// valid argument set taken from the other kernel tests; the sweep shrinks
// each dimension of each input to 0 alone, and each dimension size to 0
// wherever it occurs (a batch, a feature, a contraction dimension the inputs
// share), takes the outputs' shapes from the op registry's InferOp (or the
// kernel's own rule) and runs the kernel, then its backward kernel on the
// forward's outputs. InferOp sees a dimension of 0 as a size of its own
// (OutTypes). A combination InferOp refuses (the planner never runs it)
// still runs once with the case's original outputs: the forward kernel must
// refuse it too. Every call must return: OK, or an error naming the kernel
// (SIGFPE, SIGSEGV or a hang fail the test and name the call, the sweep's
// counts are printed). Buffers are allocated to their exact size (no
// padding), so an AddressSanitizer build catches a read past an empty
// tensor. The last tests check what a few kernels write for empty
// inputs (a sum over nothing is 0, a product over nothing is the bias).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_matchers.h"
#include "executor/cpu/kernel_test_util.h"
#include "executor/cpu/kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/graph/op_registry.h"

// AddressSanitizer's hook (absent without -fsanitize=address).
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace hap::executor::kernel_test {
namespace {

using graph::TensorType;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;
using I = std::vector<int64_t>;

// --- what was running when the process died -------------------------------------------

char g_running[512] = "(no kernel call)";
struct sigaction g_old[32];

void PrintRunning() {
  const char head[] = "\nzero_size_kernels_test: died in ";
  ssize_t r = write(2, head, sizeof(head) - 1);
  r = write(2, g_running, std::strlen(g_running));
  r = write(2, "\n", 1);
  (void)r;
}

void OnFatalSignal(int sig) {
  PrintRunning();
  sigaction(sig, &g_old[sig], nullptr);
  // A fault (SIGFPE, SIGSEGV, SIGBUS, SIGILL) recurs on return and reaches the
  // previous handler (the sanitizer's report or the default); others raise.
  if (sig == SIGABRT || sig == SIGTERM) raise(sig);
}

void InstallCrashReport() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  for (int sig : {SIGFPE, SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGTERM}) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = OnFatalSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, &g_old[sig]);
  }
  if (__sanitizer_set_death_callback != nullptr) __sanitizer_set_death_callback(PrintRunning);
}

void SetRunning(const std::string& s) {
  const size_t n = std::min(s.size(), sizeof(g_running) - 1);
  std::memcpy(g_running, s.data(), n);
  g_running[n] = '\0';
}

// --- buffers of exactly their size --------------------------------------------------------

// A tensor whose allocation holds exactly its bytes (64-byte aligned, as the
// runtime's); an empty one still has a non-null pointer (a present tensor).
class Buf {
 public:
  Buf() = default;  // absent
  Buf(DType dt, Shape s) : dtype_(dt), shape_(std::move(s)) {
    const size_t bytes = static_cast<size_t>(graph::NumElements(shape_) * graph::DTypeBytes(dt));
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes) != 0 || p == nullptr) {
      p = nullptr;
      if (posix_memalign(&p, 64, 1) != 0) p = nullptr;
    }
    data_.reset(p);
  }
  static Buf Of(const HostTensor& t) {
    if (t.data() == nullptr) return Buf();
    Buf b(t.dtype(), t.shape());
    std::memcpy(b.data_.get(), t.data(), static_cast<size_t>(t.view().bytes()));
    return b;
  }
  void Fill(double v) {
    const int64_t n = graph::NumElements(shape_);
    for (int64_t i = 0; i < n; ++i) {
      switch (dtype_) {
        case DType::kFloat32:
          static_cast<float*>(data_.get())[i] = static_cast<float>(v);
          break;
        case DType::kFloat64:
          static_cast<double*>(data_.get())[i] = v;
          break;
        case DType::kInt64:
          static_cast<int64_t*>(data_.get())[i] = static_cast<int64_t>(v);
          break;
        case DType::kInt32:
          static_cast<int32_t*>(data_.get())[i] = static_cast<int32_t>(v);
          break;
        default:
          break;
      }
    }
  }
  HostTensor ToHost() const {
    if (data_ == nullptr) return HostTensor();
    HostTensor t(dtype_, shape_);
    std::memcpy(t.data(), data_.get(), static_cast<size_t>(t.view().bytes()));
    return t;
  }
  TensorView view() const { return TensorView{dtype_, shape_, data_.get()}; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::unique_ptr<void, Free> data_;
};

// --- the cases -----------------------------------------------------------------------------

using OutFn = std::function<std::vector<TensorType>(const std::vector<HostTensor>&)>;

struct Case {
  std::string kernel;  // the forward kernel: an IR op, or a kernel of its own
  Attrs attrs;
  std::vector<HostTensor> in;      // f64 or int64; HostTensor() is absent
  OutFn outs = nullptr;            // the outputs' types; null: InferOp's
  std::vector<int> keep_f64 = {};  // inputs that stay f64 in the f32 run
  int64_t step = 0;
  bool shrink = true;  // false: run as given (a hand-made zero-size case)
};

HostTensor Ids(Shape s, uint64_t seed, int64_t below) {
  HostTensor t(DType::kInt64, std::move(s));
  std::mt19937_64 gen(seed);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    t.as<int64_t>()[i] = static_cast<int64_t>(gen() % static_cast<uint64_t>(below));
  }
  return t;
}

// The output of a kernel run in place on the given inputs (moe_gate's combine
// weights, moe_route's slots).
HostTensor Output(const std::string& kernel, const Attrs& attrs, const HostTensor& in, DType dt,
                  Shape s) {
  HostTensor out(dt, std::move(s));
  EXPECT_THAT(RunKernel(kernel, attrs, {in}, {out}), IsOk()) << kernel;
  return out;
}

OutFn SameAs(int i) {
  return [i](const std::vector<HostTensor>& in) {
    return std::vector<TensorType>{{in[i].dtype(), in[i].shape()}};
  };
}

// Outputs of the given shapes, of input `like`'s dtype (int64 for kInt64).
OutFn Outs(std::vector<Shape> shapes, int like = 0) {
  return [shapes, like](const std::vector<HostTensor>& in) {
    std::vector<TensorType> t;
    for (const Shape& s : shapes) t.push_back({like < 0 ? DType::kInt64 : in[like].dtype(), s});
    return t;
  };
}

std::vector<Case> Cases() {
  const HostTensor none;
  const HostTensor logits = Rand({7, 4}, 900, 2.0);
  const Attrs gate = {{"k", int64_t{2}}, {"capacity", int64_t{3}}};
  const HostTensor combine = Output("moe_gate", gate, logits, DType::kFloat64, {7, 4, 3});
  const HostTensor route = Output("moe_route", gate, logits, DType::kInt64, {7, 2});
  const HostTensor weights =
      Output("moe_route_weights", {{"k", int64_t{2}}}, logits, DType::kFloat64, {7, 2});
  const Attrs idx = {{"experts", int64_t{4}}, {"capacity", int64_t{3}}};
  const Attrs conv = {{"stride", I{2}}, {"padding", I{1, 1}}};
  const Attrs sharded_ce = {{"vocab_offset", int64_t{0}},
                            {"vocab_size", int64_t{6}},
                            {"rank", int64_t{0}},
                            {"ranks", int64_t{1}},
                            {"global_rows", int64_t{9}}};
  auto scalar = [](const std::vector<HostTensor>& in) {
    return std::vector<TensorType>{{in[0].dtype(), {}}};
  };
  auto bn_sums = [](const std::vector<HostTensor>& in) {
    return std::vector<TensorType>{{DType::kFloat64, {2, in[0].shape()[1]}}};
  };
  auto moments = [](const std::vector<HostTensor>& in) {
    const TensorType p{in[0].dtype(), in[0].shape()};
    return std::vector<TensorType>{p, p, p};
  };
  const Attrs sgd = {{"learning_rate", 0.1}, {"momentum", 0.9}, {"clip_global_norm", 1.0}};
  const Attrs adam = {{"learning_rate", 0.1}, {"weight_decay", 0.01}, {"clip_global_norm", 1.0}};
  std::vector<Case>
      cases =
          {
              // Dense products: batch, rows, the contraction and the output features.
              {"linear", {}, {Rand({2, 3, 5}, 1), Rand({4, 5}, 2), Rand({4}, 3)}},
              {"linear", {}, {Rand({3, 5}, 4), Rand({4, 5}, 5)}},
              {"linear", {{"bf16", true}}, {Rand({3, 5}, 6), Rand({4, 5}, 7), Rand({4}, 8)}},
              {"matmul", {}, {Rand({2, 3, 5}, 9), Rand({5, 4}, 10)}},
              {"matmul", {}, {Rand({2, 3, 4, 5}, 11), Rand({2, 3, 5, 6}, 12)}},
              {"matmul", {{"bf16", true}}, {Rand({3, 4, 5}, 13), Rand({3, 5, 6}, 14)}},
              // Element-wise, broadcasting and absent operands.
              {"add", {}, {Rand({3, 4}, 20), Rand({3, 4}, 21)}},
              {"add", {}, {Rand({2, 3, 4}, 22), Rand({3, 1}, 23)}},
              {"sub", {}, {Rand({1, 4}, 24), Rand({3, 1}, 25)}},
              {"mul", {}, {Rand({2, 3, 4}, 26), Rand({4}, 27)}},
              {"add", {}, {none, Rand({3, 4}, 28)}, SameAs(1)},
              {"sub", {}, {none, Rand({3, 4}, 29)}, SameAs(1)},
              {"relu", {}, {Rand({3, 4}, 30)}},
              {"gelu", {}, {Rand({3, 4}, 31)}},
              {"sigmoid", {}, {Rand({3, 4}, 32)}},
              {"tanh", {}, {Rand({3, 4}, 33)}},
              {"silu", {}, {Rand({3, 4}, 34)}},
              {"relu6", {}, {Rand({3, 4}, 35, 8.0)}},
              {"hardsigmoid", {}, {Rand({3, 4}, 36, 4.0)}},
              {"hardswish", {}, {Rand({3, 4}, 37, 4.0)}},
              {"exp", {}, {Rand({3, 4}, 87)}},
              {"rsqrt", {}, {Rand({3, 4}, 88, 0.5)}},
              {"log", {}, {Rand({3, 4}, 89, 0.5)}},
              {"dropout",
               {{"p", 0.2}, {"rng_key", int64_t{12345}}},
               {Rand({3, 4}, 38)},
               nullptr,
               {},
               7},
              {"dropout",
               {{"p", 0.3},
                {"rng_key", int64_t{-77}},
                {"global_shape", I{8, 33}},
                {"offsets", I{2, 5}}},
               {Rand({4, 10}, 39)},
               nullptr,
               {},
               3},
              {"drop_path",
               {{"p", 0.4},
                {"rng_key", int64_t{-91}},
                {"global_shape", I{12, 3, 4}},
                {"offsets", I{5, 0, 0}}},
               {Rand({6, 3, 4}, 40)},
               nullptr,
               {},
               4},
              {"drop_path",
               {{"p", 0.4}, {"rng_key", int64_t{5}}, {"mode", std::string("batch")}},
               {Rand({6, 3, 4}, 41)},
               nullptr,
               {},
               2},
              {"scale", {{"factor", 0.125}}, {Rand({3, 4}, 42)}},
              {"stop_gradient", {}, {Rand({3, 4}, 43)}},
              // Normalisation: rows, the row length, channels.
              {"layer_norm", {{"eps", 1e-5}}, {Rand({2, 3, 5}, 50), Rand({5}, 51), Rand({5}, 52)}},
              {"batch_norm",
               {{"eps", 1e-5}, {"momentum", 0.2}},
               {Rand({2, 3, 4, 5}, 53), Rand({3}, 54), Rand({3}, 55), Rand({3}, 56),
                Full({3}, 1.5)}},
              {"batch_norm", {}, {Rand({4, 3}, 57), Rand({3}, 58), Rand({3}, 59)}},
              {"softmax", {}, {Rand({3, 5}, 60)}},
              {"softmax", {{"causal", true}}, {Rand({2, 3, 4, 4}, 61)}},
              {"softmax", {}, {Rand({2, 4, 5}, 62), Rand({1, 1, 5}, 63)}},
              {"softmax", {{"causal", true}}, {Rand({2, 3, 4, 4}, 64), Rand({2, 1, 1, 4}, 65)}},
              {"log_softmax", {}, {Rand({3, 5}, 66)}},
              // Layout.
              {"embedding", {}, {Ids({2, 3}, 70, 5), Rand({5, 4}, 71)}},
              {"embedding",
               {{"vocab_offset", int64_t{5}}, {"vocab_size", int64_t{10}}},
               {Ids({2, 3}, 72, 10), Rand({5, 4}, 73)}},
              {"transpose", {{"perm", I{0, 2, 3, 1}}}, {Rand({2, 3, 4, 5}, 74)}},
              {"transpose", {{"perm", I{1, 0}}}, {Rand({3, 4}, 75)}},
              {"reshape", {{"shape", I{6, -1}}}, {Rand({2, 3, 4}, 76)}},
              {"reshape", {{"shape", I{4, 6}}}, {Rand({2, 3, 4}, 77)}},
              {"flatten",
               {{"start_dim", int64_t{1}}, {"end_dim", int64_t{2}}},
               {Rand({2, 3, 4, 5}, 78)}},
              {"flatten", {}, {Rand({2, 3, 4}, 79)}},
              {"concat",
               {{"axis", int64_t{1}}},
               {Rand({2, 3, 4}, 80), Rand({2, 1, 4}, 81), Rand({2, 5, 4}, 82)}},
              {"split", {{"axis", int64_t{-1}}, {"sizes", I{2, 3, 4}}}, {Rand({3, 9}, 83)}},
              {"slice",
               {{"axis", int64_t{1}}, {"start", int64_t{2}}, {"end", int64_t{5}}},
               {Rand({3, 7, 2}, 84)}},
              {"expand", {{"shape", I{2, 3, 4}}}, {Rand({3, 1}, 85)}},
              // Reductions and losses.
              {"sum", {{"axes", I{0, 2}}}, {Rand({3, 4, 5}, 90)}},
              {"sum", {}, {Rand({3, 4, 5}, 91)}},
              {"mean", {{"axes", I{-1}}, {"keepdims", true}}, {Rand({3, 4, 5}, 92)}},
              {"mean", {}, {Rand({4, 5}, 93)}},
              {"nll_loss", {}, {Rand({4, 5}, 94), Ids({4}, 95, 5)}},
              {"cross_entropy", {}, {Rand({4, 5}, 96), Ids({4}, 97, 5)}},
              {"cross_entropy",
               {{"global_rows", int64_t{10}}},
               {Rand({4, 5}, 98), Ids({4}, 99, 5)}},
              // Convolution and pooling: batch, channels, spatial, kernel.
              {"conv2d", conv, {Rand({2, 5, 7, 7}, 100), Rand({4, 5, 3, 3}, 101), Rand({4}, 102)}},
              {"conv2d", {{"stride", I{1, 2}}}, {Rand({1, 4, 6, 7}, 103), Rand({5, 4, 2, 3}, 104)}},
              {"conv2d",
               {{"stride", I{2}}, {"padding", I{1}}, {"groups", int64_t{2}}},
               {Rand({1, 4, 9, 8}, 105), Rand({6, 2, 3, 3}, 106), Rand({6}, 107)}},
              {"conv2d",
               {{"padding", I{1}}, {"groups", int64_t{5}}},
               {Rand({2, 5, 7, 6}, 108), Rand({10, 1, 3, 3}, 109)}},
              {"conv2d", {}, {Rand({2, 6, 4, 5}, 110), Rand({3, 6, 1, 1}, 111), Rand({3}, 112)}},
              {"conv2d",
               {{"padding", I{1}}, {"bf16", true}},
               {Rand({2, 5, 7, 6}, 113), Rand({4, 5, 3, 3}, 114), Rand({4}, 115)}},
              {"conv3d",
               {{"stride", I{1, 2, 2}}, {"padding", I{1}}},
               {Rand({2, 3, 4, 5, 5}, 116), Rand({4, 3, 3, 3, 3}, 117), Rand({4}, 118)}},
              {"conv3d",
               {{"groups", int64_t{2}}},
               {Rand({1, 4, 3, 4, 4}, 119), Rand({2, 2, 1, 3, 3}, 180)}},
              {"max_pool3d",
               {{"kernel", I{1, 3, 3}}, {"stride", I{1, 2, 2}}, {"padding", I{0, 1, 1}}},
               {Rand({2, 3, 3, 7, 6}, 183)}},
              {"avg_pool3d",
               {{"kernel", I{2}}, {"ceil_mode", true}, {"count_include_pad", false}},
               {Rand({2, 3, 3, 5, 4}, 184)}},
              {"max_pool2d",
               {{"kernel", I{3}}, {"stride", I{2}}, {"padding", I{1}}},
               {Rand({2, 3, 9, 8}, 120)}},
              {"max_pool2d",
               {{"kernel", I{3}}, {"stride", I{2}}, {"ceil_mode", true}},
               {Rand({2, 3, 13, 10}, 121)}},
              {"avg_pool2d",
               {{"kernel", I{3}}, {"stride", I{2}}, {"padding", I{1}}},
               {Rand({2, 3, 9, 8}, 122)}},
              {"avg_pool2d",
               {{"kernel", I{3, 2}},
                {"stride", I{2}},
                {"padding", I{1, 0}},
                {"ceil_mode", true},
                {"count_include_pad", false}},
               {Rand({2, 3, 10, 7}, 123)}},
              {"adaptive_avg_pool2d", {{"output_size", I{3, 2}}}, {Rand({2, 3, 7, 5}, 124)}},
              {"adaptive_avg_pool2d", {{"output_size", I{1}}}, {Rand({2, 3, 4, 5}, 125)}},
              // Mixture of experts: tokens, experts, capacity, k, features.
              {"moe_gate", gate, {logits}},
              {"moe_gate", {{"k", int64_t{1}}, {"capacity", int64_t{3}}}, {logits}},
              {"moe_dispatch", {}, {Rand({7, 5}, 130), combine}},
              {"moe_combine", {}, {Rand({4, 3, 5}, 131), combine}},
              {"moe_route", gate, {logits}},
              {"moe_route",
               {{"k", int64_t{1}}, {"capacity", int64_t{3}}, {"group_size", int64_t{7}}},
               {logits}},
              {"moe_route_weights", {{"k", int64_t{2}}}, {logits}},
              {"moe_dispatch_idx", idx, {Rand({7, 5}, 132), route}},
              {"moe_combine_idx", {}, {Rand({4, 3, 5}, 133), route, weights}},
              // LSTM, GRU: batch, sequence, input features, hidden.
              {"lstm",
               {},
               {Rand({3, 4, 5}, 140), Rand({8, 5}, 141), Rand({8, 2}, 142), Rand({8}, 143),
                Rand({8}, 144)}},
              {"lstm",
               {{"reverse", true}},
               {Rand({3, 4, 5}, 145), Rand({8, 5}, 146), Rand({8, 2}, 147)}},
              {"gru",
               {},
               {Rand({3, 4, 5}, 240), Rand({6, 5}, 241), Rand({6, 2}, 242), Rand({6}, 243),
                Rand({6}, 244)}},
              {"gru",
               {{"reverse", true}},
               {Rand({3, 4, 5}, 245), Rand({6, 5}, 246), Rand({6, 2}, 247)}},
              // The sharded pieces: vocabulary-parallel cross-entropy, batch_norm.
              {"cross_entropy_lse",
               {{"vocab_offset", int64_t{0}}, {"vocab_size", int64_t{6}}},
               {Rand({4, 6}, 150)},
               [](const std::vector<HostTensor>& in) {
                 return std::vector<TensorType>{{in[0].dtype(), {in[0].shape()[0]}}};
               }},
              {"cross_entropy_sharded",
               sharded_ce,
               {Rand({4, 6}, 151), Ids({4}, 152, 6), Rand({4}, 153)},
               scalar},
              {"cross_entropy_sharded_grad",
               sharded_ce,
               {Rand({4, 6}, 154), Ids({4}, 155, 6), Rand({4}, 156), Rand({}, 157)},
               SameAs(0)},
              {"batch_norm_stats", {}, {Rand({5, 3, 4, 6}, 160)}, bn_sums},
              {"batch_norm_grad_stats",
               {},
               {Rand({5, 3, 4, 6}, 161), Full({2, 3}, 1.0), Rand({5, 3, 4, 6}, 162)},
               bn_sums,
               {1}},
              {"batch_norm_apply",
               {{"momentum", 0.2}},
               {Rand({5, 3, 4, 6}, 163), Rand({3}, 164), Rand({3}, 165), Rand({3}, 166),
                Full({3}, 1.0), Full({2, 3}, 100.0)},
               SameAs(0),
               {5}},
              {"batch_norm_grad_apply",
               {},
               {Rand({5, 3, 4, 6}, 167), Rand({3}, 168), Full({2, 3}, 100.0), Rand({2, 3}, 169),
                Rand({5, 3, 4, 6}, 170)},
               [](const std::vector<HostTensor>& in) {
                 const DType t = in[0].dtype();
                 const int64_t c = in[0].shape()[1];
                 return std::vector<TensorType>{{t, in[0].shape()}, {t, {c}}, {t, {c}}};
               },
               {2, 3}},
              // The runtime's kernels.
              {"copy", {}, {Rand({3, 4}, 180)}, SameAs(0)},
              {"accumulate", {}, {Rand({3, 4}, 181)}, SameAs(0)},
              {"sq_norm",
               {},
               {Rand({3, 4}, 182), Rand({5}, 183)},
               [](const std::vector<HostTensor>&) {
                 return std::vector<TensorType>{{DType::kFloat64, {1}}};
               }},
              {"sgd_update",
               sgd,
               {Rand({3, 4}, 184), Rand({3, 4}, 185), Full({1}, 4.0)},
               [](const std::vector<HostTensor>& in) {
                 const TensorType p{in[0].dtype(), in[0].shape()};
                 return std::vector<TensorType>{p, p};
               },
               {2}},
              {"adam_update",
               adam,
               {Rand({3, 4}, 186), Rand({3, 4}, 187), Full({1}, 4.0)},
               moments,
               {2},
               3},
          };
  // Hand-made zero sizes the shrinking above cannot reach: dimensions an
  // attribute or two inputs must agree on.
  auto zero = [&](Case c) {
    c.shrink = false;
    cases.push_back(std::move(c));
  };
  zero({"lstm",
        {},
        {Rand({3, 4, 5}, 200), Rand({0, 5}, 201), Rand({0, 0}, 202), Rand({0}, 203)},
        Outs({{3, 4, 0}})});
  zero({"lstm", {}, {Rand({3, 0, 5}, 204), Rand({8, 5}, 205), Rand({8, 2}, 206)}});
  zero({"gru",
        {},
        {Rand({3, 4, 5}, 250), Rand({0, 5}, 251), Rand({0, 0}, 252), Rand({0}, 253)},
        Outs({{3, 4, 0}})});
  zero({"gru", {}, {Rand({3, 0, 5}, 254), Rand({6, 5}, 255), Rand({6, 2}, 256)}});
  zero({"split",
        {{"axis", int64_t{1}}, {"sizes", I{0, 3, 0, 4}}},
        {Rand({3, 7}, 207)},
        Outs({{3, 0}, {3, 3}, {3, 0}, {3, 4}})});
  zero({"split",
        {{"axis", int64_t{0}}, {"sizes", I{0, 0}}},
        {Rand({0, 7}, 208)},
        Outs({{0, 7}, {0, 7}})});
  zero({"slice",
        {{"axis", int64_t{1}}, {"start", int64_t{3}}, {"end", int64_t{3}}},
        {Rand({3, 7, 2}, 209)},
        Outs({{3, 0, 2}})});
  zero({"expand", {{"shape", I{0, 3, 4}}}, {Rand({3, 1}, 210)}, Outs({{0, 3, 4}})});
  zero({"expand", {{"shape", I{2, 3, 0}}}, {Rand({3, 1}, 211)}, Outs({{2, 3, 0}})});
  zero({"reshape", {{"shape", I{0, 5}}}, {Rand({2, 0, 4}, 212)}, Outs({{0, 5}})});
  zero({"concat", {{"axis", int64_t{0}}}, {Rand({0, 4}, 213), Rand({0, 4}, 214)}, Outs({{0, 4}})});
  zero({"sum", {{"axes", I{1}}}, {Rand({3, 0}, 215)}});
  zero({"mean", {{"axes", I{1}}}, {Rand({3, 0}, 216)}});
  zero({"mean", {{"axes", I{0}}, {"global_count", int64_t{4}}}, {Rand({0, 3}, 217)}});
  zero({"nll_loss", {{"global_rows", int64_t{4}}}, {Rand({0, 5}, 218), Ints({0}, {})}});
  zero({"cross_entropy", {{"global_rows", int64_t{4}}}, {Rand({0, 5}, 219), Ints({0}, {})}});
  zero({"moe_gate", {{"k", int64_t{2}}, {"capacity", int64_t{0}}}, {logits}, Outs({{7, 4, 0}})});
  zero({"moe_route", {{"k", int64_t{2}}, {"capacity", int64_t{0}}}, {logits}, Outs({{7, 2}}, -1)});
  zero({"moe_route",
        {{"k", int64_t{1}}, {"capacity", int64_t{3}}, {"group_size", int64_t{7}}},
        {Rand({0, 4}, 220)},
        Outs({{0, 1}}, -1)});
  zero({"moe_dispatch_idx",
        {{"experts", int64_t{4}}, {"capacity", int64_t{0}}},
        {Rand({7, 5}, 221), Ints({7, 1}, {-1, -1, -1, -1, -1, -1, -1})},
        Outs({{4, 0, 5}})});
  zero({"moe_dispatch_idx",
        {{"experts", int64_t{0}}, {"capacity", int64_t{3}}},
        {Rand({2, 5}, 222), Ints({2, 1}, {-1, -1})},
        Outs({{0, 3, 5}})});
  zero({"moe_combine_idx",
        {},
        {Rand({0, 3, 5}, 223), Ints({2, 1}, {-1, -1}), Rand({2, 1}, 224)},
        Outs({{2, 5}})});
  zero({"moe_combine_idx",
        {},
        {Rand({4, 0, 5}, 225), Ints({2, 1}, {-1, -1}), Rand({2, 1}, 226)},
        Outs({{2, 5}})});
  zero({"moe_dispatch", {}, {Rand({7, 5}, 227), Rand({7, 4, 0}, 228)}});
  zero({"moe_combine", {}, {Rand({0, 3, 5}, 229), Rand({7, 0, 3}, 230)}});
  zero({"embedding",
        {{"vocab_offset", int64_t{5}}, {"vocab_size", int64_t{5}}},
        {Ids({2, 3}, 231, 5), Rand({0, 4}, 232)}});
  zero({"adaptive_avg_pool2d",
        {{"output_size", I{0, 2}}},
        {Rand({2, 3, 7, 5}, 233)},
        Outs({{2, 3, 0, 2}})});
  zero({"adaptive_avg_pool2d", {{"output_size", I{3, 2}}}, {Rand({2, 3, 0, 5}, 234)}});
  zero({"max_pool2d",
        {{"kernel", I{3}}, {"stride", I{2}}},
        {Rand({2, 3, 2, 8}, 235)},
        Outs({{2, 3, 0, 3}})});
  zero({"avg_pool2d",
        {{"kernel", I{3}}, {"padding", I{1}}, {"count_include_pad", false}},
        {Rand({2, 3, 0, 0}, 236)},
        Outs({{2, 3, 0, 0}})});
  zero({"conv2d",
        {{"groups", int64_t{2}}},
        {Rand({1, 0, 5, 5}, 237), Rand({0, 0, 3, 3}, 238)},
        Outs({{1, 0, 3, 3}})});
  zero({"conv2d", {}, {Rand({1, 3, 2, 2}, 239), Rand({4, 3, 3, 3}, 240)}, Outs({{1, 4, 0, 0}})});
  zero({"conv3d",
        {},
        {Rand({1, 3, 2, 4, 4}, 181), Rand({4, 3, 3, 3, 3}, 182)},
        Outs({{1, 4, 0, 2, 2}})});
  zero({"cross_entropy_lse",
        {{"vocab_offset", int64_t{6}}, {"vocab_size", int64_t{6}}},
        {Rand({4, 0}, 241)},
        [](const std::vector<HostTensor>& in) {
          return std::vector<TensorType>{{in[0].dtype(), {in[0].shape()[0]}}};
        }});
  zero({"cross_entropy_sharded",
        {{"vocab_offset", int64_t{0}},
         {"vocab_size", int64_t{6}},
         {"rank", int64_t{0}},
         {"ranks", int64_t{0}}},
        {Rand({0, 6}, 242), Ints({0}, {}), Rand({0}, 243)},
        scalar});
  zero({"batch_norm_stats", {{"global_count", int64_t{8}}}, {Rand({0, 3, 4, 6}, 244)}, bn_sums});
  zero({"batch_norm_apply",
        {{"global_count", int64_t{8}}},
        {Rand({0, 3, 2}, 245), Rand({3}, 246), Rand({3}, 247), Rand({3}, 248), Full({3}, 1.0),
         Full({2, 3}, 10.0)},
        SameAs(0),
        {5}});
  zero({"fill_zero", {}, {}, [](const std::vector<HostTensor>&) {
          return std::vector<TensorType>{{DType::kFloat64, {0, 3}}};
        }});
  zero({"fill_zero", {}, {}, [](const std::vector<HostTensor>&) {
          return std::vector<TensorType>{
              {DType::kFloat32, {3, 0}},
          };
        }});
  zero({"copy", {}, {Rand({0, 3}, 249)}, Outs({{4, 0}})});
  zero({"sq_norm",
        {},
        {Rand({0}, 250), none, Rand({3, 0}, 251)},
        [](const std::vector<HostTensor>&) {
          return std::vector<TensorType>{{DType::kFloat64, {1}}};
        }});
  return cases;
}

// --- running them ---------------------------------------------------------------------------

const graph::OpDef* IrOp(const std::string& kernel) {
  return graph::OpRegistry::Global().Find(kernel);
}

absl::StatusOr<std::vector<TensorType>> Infer(const Case& c, const graph::OpDef& def,
                                              const std::vector<HostTensor>& in, int64_t zero_as) {
  Attrs ir;  // the lowering's sharding attributes are not IR attributes
  for (const auto& [name, v] : c.attrs.values()) {
    if (std::count(def.attrs.begin(), def.attrs.end(), name)) ir.Set(name, v);
  }
  std::vector<std::string> names;
  std::vector<TensorType> types;
  std::vector<std::string> described;
  for (const HostTensor& t : in) {
    names.push_back(absl::StrCat("in", names.size()));
    Shape s = t.shape();
    std::replace(s.begin(), s.end(), int64_t{0}, zero_as);
    types.push_back({t.dtype(), s});
    described.push_back(graph::ShapeString(s));
  }
  SetRunning(absl::StrCat("InferOp ", c.kernel, " on ", absl::StrJoin(described, ", ")));
  auto out = graph::InferOp("op", c.kernel, ir, names, types);
  SetRunning("(no kernel call)");
  return out;
}

// The outputs' types: c.outs, or InferOp's. InferOp refuses every output
// with a dimension of 0 (the planner's single-device tensors have none; a
// rank's shard may), so a dimension of 0 is inferred as a size of its own
// (twice, as 101 and as 103: the output dimensions that follow it become
// 0); an output dimension derived from it otherwise (a window count) is
// refused as InferOp refuses. (InferOp itself on a 0 would also crash:
// batch_norm's divides by the channels.)
absl::StatusOr<std::vector<TensorType>> OutTypes(const Case& c, const std::vector<HostTensor>& in) {
  if (c.outs) return c.outs(in);
  const graph::OpDef* def = IrOp(c.kernel);
  if (def == nullptr) return absl::InternalError(absl::StrCat(c.kernel, ": no output rule"));
  absl::StatusOr<std::vector<TensorType>> a = Infer(c, *def, in, 101);
  if (!a.ok()) return a.status();
  absl::StatusOr<std::vector<TensorType>> b = Infer(c, *def, in, 103);
  if (!b.ok()) return b.status();
  for (size_t j = 0; j < a->size(); ++j) {
    Shape& s = (*a)[j].shape;
    const Shape& t = (*b)[j].shape;
    if (s.size() != t.size()) return absl::InvalidArgumentError("ranks differ");
    for (size_t d = 0; d < s.size(); ++d) {
      if (s[d] == t[d]) continue;
      if (s[d] != 101 || t[d] != 103) {
        return absl::InvalidArgumentError(
            absl::StrCat("output ", j, " dimension ", d, " is derived from an empty dimension"));
      }
      s[d] = 0;
    }
  }
  return a;
}

bool HasZero(const Shape& s) { return std::count(s.begin(), s.end(), int64_t{0}) > 0; }

struct Tally {
  int calls = 0, refused = 0;
  int zero_ok = 0, zero_errors = 0;       // calls with a zero-size argument
  std::map<std::string, int> zero_calls;  // kernel -> calls with a zero-size argument
  std::vector<std::string> unnamed;       // errors that do not name their kernel
  std::vector<std::string> accepted;      // forward calls OK on what InferOp refuses
};

class Sweep {
 public:
  explicit Sweep(Tally& t) : tally_(t) {}

  // Runs `kernel` on exact-size copies of `in` and fresh outputs of `out`
  // (filled with `fill`); returns its status and the outputs.
  absl::Status Call(const std::string& label, const std::string& kernel, const Attrs& attrs,
                    const std::vector<HostTensor>& in, const std::vector<TensorType>& out,
                    const std::vector<bool>& out_present, double fill, int64_t step, int threads,
                    std::vector<HostTensor>* results) {
    std::vector<Buf> ib, ob;
    std::vector<TensorView> iv, ov;
    bool zero = false;
    for (const HostTensor& t : in) {
      ib.push_back(Buf::Of(t));
      iv.push_back(ib.back().view());
      zero = zero || (t.data() != nullptr && t.num_elements() == 0);
    }
    for (size_t j = 0; j < out.size(); ++j) {
      if (!out_present.empty() && !out_present[j]) {
        ob.emplace_back();
      } else {
        ob.emplace_back(out[j].dtype, out[j].shape);
        ob.back().Fill(fill);
        zero = zero || HasZero(out[j].shape);
      }
      ov.push_back(ob.back().view());
    }
    const std::string what = absl::StrCat(kernel, " [", label, "]");
    SetRunning(what);
    KernelContext ctx;
    ctx.step = step;
    ctx.num_threads = threads;
    const absl::Status s = RunCpuKernel(kernel, ctx, attrs, iv, ov);
    SetRunning("(no kernel call)");
    ++tally_.calls;
    if (zero) ++tally_.zero_calls[kernel];
    if (zero) ++(s.ok() ? tally_.zero_ok : tally_.zero_errors);
    if (!s.ok()) {
      if (!absl::StrContains(s.message(), absl::StrCat("'", kernel, "'"))) {
        tally_.unnamed.push_back(absl::StrCat(what, ": ", s.ToString()));
      }
    }
    if (results != nullptr) {
      results->clear();
      for (const Buf& b : ob) results->push_back(b.ToHost());
    }
    return s;
  }

  // The backward kernel of IR op c.kernel on (x, y, dy) -> dx, every
  // differentiable input's gradient requested (prefilled).
  void Grad(const std::string& label, const Case& c, const std::vector<HostTensor>& x,
            const std::vector<HostTensor>& y, DType t, int threads) {
    const graph::OpDef* def = IrOp(c.kernel);
    if (def == nullptr) return;
    std::vector<HostTensor> in = x;
    in.insert(in.end(), y.begin(), y.end());
    for (size_t j = 0; j < y.size(); ++j) {
      in.push_back(graph::IsFloating(y[j].dtype())
                       ? (t == DType::kFloat32 ? ToF32(Rand(y[j].shape(), 500 + j))
                                               : Rand(y[j].shape(), 500 + j))
                       : HostTensor());
    }
    std::vector<TensorType> dx;
    std::vector<bool> present;
    const auto& nd = def->non_differentiable_inputs;
    for (size_t i = 0; i < x.size(); ++i) {
      const bool diff = x[i].data() != nullptr && graph::IsFloating(x[i].dtype()) &&
                        std::count(nd.begin(), nd.end(), static_cast<int>(i)) == 0;
      dx.push_back({x[i].dtype(), x[i].shape()});
      present.push_back(diff);
    }
    Call(label, c.kernel + "_grad", c.attrs, in, dx, present, kPrefill, c.step, threads, nullptr)
        .IgnoreError();  // tallied
  }

  // The case as given, then (c.shrink) every zero-size variant of it.
  void Run(const Case& c, DType t) {
    const int threads = t == DType::kFloat32 ? 2 : 1;
    std::vector<HostTensor> base;
    for (size_t i = 0; i < c.in.size(); ++i) {
      const bool keep = std::count(c.keep_f64.begin(), c.keep_f64.end(), static_cast<int>(i));
      base.push_back(t == DType::kFloat32 && c.in[i].dtype() == DType::kFloat64 && !keep
                         ? ToF32(c.in[i])
                         : c.in[i]);
    }
    const std::string name = absl::StrCat(graph::DTypeName(t), " case ", index_);
    absl::StatusOr<std::vector<TensorType>> types = OutTypes(c, base);
    ASSERT_TRUE(types.ok()) << c.kernel << " " << name << ": " << types.status();
    std::vector<HostTensor> y;
    const absl::Status s =
        Call(name, c.kernel, c.attrs, base, *types, {}, 7.0, c.step, threads, &y);
    if (c.shrink) {
      // A valid case: bf16 runs only in float32.
      const bool bf16 = c.attrs.Has("bf16") && t == DType::kFloat64;
      ASSERT_TRUE(s.ok() || bf16) << c.kernel << " " << name << ": " << s;
    }
    if (s.ok()) Grad(name, c, base, y, t, threads);
    if (!c.shrink || !s.ok()) return;

    for (const auto& [label, in] : Variants(base)) {
      const std::string what = absl::StrCat(name, ", ", label);
      absl::StatusOr<std::vector<TensorType>> vt = OutTypes(c, in);
      if (vt.ok()) {
        std::vector<HostTensor> vy;
        const absl::Status vs =
            Call(what, c.kernel, c.attrs, in, *vt, {}, 7.0, c.step, threads, &vy);
        if (vs.ok()) Grad(what, c, in, vy, t, threads);
      } else {
        // Refused by the planner: the forward kernel must refuse it too.
        ++tally_.refused;
        if (Call(what + ", refused by InferOp", c.kernel, c.attrs, in, *types, {}, 7.0, c.step,
                 threads, nullptr)
                .ok()) {
          tally_.accepted.push_back(absl::StrCat(c.kernel, " [", what, "]"));
        }
        // The backward kernel may find nothing to do with a misfit input
        // it does not read (batch_norm's running statistics): OK or an error.
        Grad(what + ", refused by InferOp", c, in, y, t, threads);
      }
    }
  }

  void Next() { ++index_; }

 private:
  // Each dimension of each present input set to 0 alone, then each size set
  // to 0 wherever it occurs (when it occurs more than once).
  static std::vector<std::pair<std::string, std::vector<HostTensor>>> Variants(
      const std::vector<HostTensor>& in) {
    std::vector<std::pair<std::string, std::vector<HostTensor>>> out;
    std::map<int64_t, int> occurrences;
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i].data() == nullptr) continue;
      for (size_t d = 0; d < in[i].shape().size(); ++d) {
        if (in[i].shape()[d] == 0) continue;
        ++occurrences[in[i].shape()[d]];
        std::vector<HostTensor> v = in;
        Shape s = in[i].shape();
        s[d] = 0;
        v[i] = HostTensor(in[i].dtype(), s);
        out.push_back({absl::StrCat("input ", i, " dim ", d, " = 0"), std::move(v)});
      }
    }
    for (const auto& [size, n] : occurrences) {
      if (n < 2) continue;
      std::vector<HostTensor> v = in;
      for (HostTensor& t : v) {
        if (t.data() == nullptr) continue;
        Shape s = t.shape();
        std::replace(s.begin(), s.end(), size, int64_t{0});
        if (s != t.shape()) t = HostTensor(t.dtype(), s);
      }
      out.push_back({absl::StrCat("every dimension of ", size, " = 0"), std::move(v)});
    }
    return out;
  }

  Tally& tally_;
  int index_ = 0;
};

TEST(ZeroSizeKernelTest, EveryKernelReturnsOnEmptyDimensions) {
  InstallCrashReport();
  Tally tally;
  Sweep sweep(tally);
  for (const Case& c : Cases()) {
    for (DType t : {DType::kFloat64, DType::kFloat32}) sweep.Run(c, t);
    sweep.Next();
  }
  std::cout << "zero-size sweep: " << tally.calls << " kernel calls, "
            << tally.zero_ok + tally.zero_errors << " with a zero-size argument (" << tally.zero_ok
            << " OK, " << tally.zero_errors << " errors) over " << tally.zero_calls.size()
            << " kernels; " << tally.refused << " variants refused by InferOp\n";
  EXPECT_THAT(tally.unnamed, ::testing::IsEmpty()) << "errors must name their kernel";
  EXPECT_THAT(tally.accepted, ::testing::IsEmpty())
      << "forward kernels must refuse the arguments InferOp refuses";
  // Every kernel was called with an empty argument.
  for (const std::string& k : CpuKernelNames()) {
    EXPECT_GT(tally.zero_calls[k], 0) << k << " has no zero-size case";
  }
}

// --- what kernels write for empty inputs ----------------------------------------------

constexpr DType kBoth[] = {DType::kFloat64, DType::kFloat32};

HostTensor As(DType t, const HostTensor& h) { return t == DType::kFloat32 ? ToF32(h) : h; }

// A sum over nothing is 0, whatever the output held; an empty gradient adds
// nothing to the squared norm.
TEST(ZeroSizeKernelTest, SumsOverNothingAreZero) {
  for (DType t : kBoth) {
    HostTensor rows = Full({3}, 7.0, t), all = Full({}, 7.0, t);
    ASSERT_THAT(RunKernel("sum", {{"axes", I{1}}}, {Full({3, 0}, 0.0, t)}, {rows}), IsOk());
    ExpectAllNear(rows, Full({3}, 0.0), 0.0, "sum over an empty axis");
    ASSERT_THAT(RunKernel("sum", {}, {Full({0, 4}, 0.0, t)}, {all}), IsOk());
    ExpectAllNear(all, Full({}, 0.0), 0.0, "sum of no elements");
    // mean over a rank's empty shard of a batch of 4: 0 / 4.
    HostTensor mean = Full({3}, 7.0, t);
    ASSERT_THAT(RunKernel("mean", {{"axes", I{0}}, {"global_count", int64_t{4}}},
                          {Full({0, 3}, 0.0, t)}, {mean}),
                IsOk());
    ExpectAllNear(mean, Full({3}, 0.0), 0.0, "mean of an empty shard");
    // Over nothing at all a mean has no count: an error, not 0 / 0.
    EXPECT_THAT(RunKernel("mean", {{"axes", I{1}}}, {Full({3, 0}, 0.0, t)}, {mean}),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kernel 'mean'")));
  }
  HostTensor acc = Full({1}, 1.5);
  ASSERT_THAT(RunKernel("sq_norm", {}, {Full({0}, 0.0), ToF32(Full({3, 0}, 0.0))}, {acc}), IsOk());
  EXPECT_EQ(acc.as<double>()[0], 1.5);
}

// A product over an empty contraction is zero (matmul, bf16 included) or the
// bias (conv2d has no such case: its channels are whole groups); products
// over an empty batch leave the parameter gradients as they were, and an
// empty contraction's bias gradient is still the column sums of dy.
TEST(ZeroSizeKernelTest, ProductsOverNothingAreZeroOrTheBias) {
  for (DType t : kBoth) {
    for (bool bf16 : {false, true}) {
      if (bf16 && t == DType::kFloat64) continue;
      const Attrs attrs = bf16 ? Attrs{{"bf16", true}} : Attrs{};
      HostTensor y = Full({2, 3, 4}, 7.0, t);
      ASSERT_THAT(
          RunKernel("matmul", attrs, {Full({2, 3, 0}, 0.0, t), Full({2, 0, 4}, 0.0, t)}, {y}),
          IsOk());
      ExpectAllNear(y, Full({2, 3, 4}, 0.0), 0.0, "matmul with k = 0");
      const HostTensor b = As(t, Rand({4}, 1));
      HostTensor ly = Full({3, 4}, 7.0, t);
      ASSERT_THAT(RunKernel("linear", attrs, {Full({3, 0}, 0.0, t), Full({4, 0}, 0.0, t), b}, {ly}),
                  IsOk());
      for (int64_t i = 0; i < 12; ++i) {
        const double got = t == DType::kFloat32 ? ly.as<float>()[i] : ly.as<double>()[i];
        const double want = t == DType::kFloat32 ? b.as<float>()[i % 4] : b.as<double>()[i % 4];
        // bf16 rounds the bias (kernels.h: y = bf16(x_b @ w_b^T + b_b)).
        ASSERT_NEAR(got, want, bf16 ? 1e-2 : 0.0) << "linear with in = 0, element " << i;
      }
    }
    // linear_grad over no rows: dw and db as they were; dx has no elements.
    const HostTensor x = Full({0, 5}, 0.0, t), w = As(t, Rand({4, 5}, 2)), b = As(t, Rand({4}, 3));
    HostTensor dx = Full({0, 5}, 0.0, t), dw = Full({4, 5}, kPrefill, t),
               db = Full({4}, kPrefill, t);
    ASSERT_THAT(RunKernel("linear_grad", {}, {x, w, b, Full({0, 4}, 0.0, t), Full({0, 4}, 0.0, t)},
                          {dx, dw, db}),
                IsOk());
    ExpectAllNear(dw, Full({4, 5}, kPrefill), 0.0, "linear_grad dw over no rows");
    ExpectAllNear(db, Full({4}, kPrefill), 0.0, "linear_grad db over no rows");
    // ... and over no input features: db += the column sums of dy.
    const HostTensor dy = Rand({3, 4}, 4);
    HostTensor db_want = Full({4}, kPrefill);
    for (int64_t i = 0; i < 12; ++i) db_want.as<double>()[i % 4] += dy.as<double>()[i];
    HostTensor dx0 = Full({3, 0}, 0.0, t), dw0 = Full({4, 0}, 0.0, t), db0 = Full({4}, kPrefill, t);
    ASSERT_THAT(
        RunKernel("linear_grad", {},
                  {Full({3, 0}, 0.0, t), Full({4, 0}, 0.0, t), b, Full({3, 4}, 0.0, t), As(t, dy)},
                  {dx0, dw0, db0}),
        IsOk());
    ExpectAllNear(db0, db_want, t == DType::kFloat32 ? 1e-6 : 1e-15, "linear_grad db with in = 0");
    // conv2d_grad over no images: dw and db as they were.
    HostTensor cdx = Full({0, 2, 5, 5}, 0.0, t), cdw = Full({3, 2, 3, 3}, kPrefill, t),
               cdb = Full({3}, kPrefill, t);
    ASSERT_THAT(
        RunKernel("conv2d_grad", {{"padding", I{1}}},
                  {Full({0, 2, 5, 5}, 0.0, t), As(t, Rand({3, 2, 3, 3}, 5)), As(t, Rand({3}, 6)),
                   Full({0, 3, 5, 5}, 0.0, t), Full({0, 3, 5, 5}, 0.0, t)},
                  {cdx, cdw, cdb}),
        IsOk());
    ExpectAllNear(cdw, Full({3, 2, 3, 3}, kPrefill), 0.0, "conv2d_grad dw over no images");
    ExpectAllNear(cdb, Full({3}, kPrefill), 0.0, "conv2d_grad db over no images");
  }
}

// Empty batches and sequences leave the parameters' gradients alone; a
// rank's empty shard of the rows contributes 0 to a loss; an empty part of
// a concat is nothing; no experts combine to zero rows.
TEST(ZeroSizeKernelTest, EmptyPartsContributeNothing) {
  for (DType t : kBoth) {
    // embedding_grad of no ids.
    HostTensor dtable = Full({5, 4}, kPrefill, t);
    ASSERT_THAT(RunKernel("embedding_grad", {},
                          {Ints({2, 0}, {}), As(t, Rand({5, 4}, 1)), Full({2, 0, 4}, 0.0, t),
                           Full({2, 0, 4}, 0.0, t)},
                          {kAbsent, dtable}),
                IsOk());
    ExpectAllNear(dtable, Full({5, 4}, kPrefill), 0.0, "embedding_grad of no ids");
    // layer_norm_grad of no rows.
    HostTensor dgamma = Full({5}, kPrefill, t), dbeta = Full({5}, kPrefill, t);
    HostTensor lx = Full({0, 5}, 0.0, t), ldx = Full({0, 5}, 0.0, t);
    ASSERT_THAT(
        RunKernel("layer_norm_grad", {}, {lx, As(t, Rand({5}, 2)), As(t, Rand({5}, 3)), lx, lx},
                  {ldx, dgamma, dbeta}),
        IsOk());
    ExpectAllNear(dgamma, Full({5}, kPrefill), 0.0, "layer_norm_grad dgamma of no rows");
    ExpectAllNear(dbeta, Full({5}, kPrefill), 0.0, "layer_norm_grad dbeta of no rows");
    // lstm_grad over a sequence of 0 steps.
    HostTensor dih = Full({8, 5}, kPrefill, t), dhh = Full({8, 2}, kPrefill, t),
               db = Full({8}, kPrefill, t), sx = Full({3, 0, 5}, 0.0, t);
    ASSERT_THAT(RunKernel("lstm_grad", {},
                          {sx, As(t, Rand({8, 5}, 4)), As(t, Rand({8, 2}, 5)), As(t, Rand({8}, 6)),
                           Full({3, 0, 2}, 0.0, t), Full({3, 0, 2}, 0.0, t)},
                          {sx, dih, dhh, db}),
                IsOk());
    ExpectAllNear(dih, Full({8, 5}, kPrefill), 0.0, "lstm_grad dw_ih over no steps");
    ExpectAllNear(dhh, Full({8, 2}, kPrefill), 0.0, "lstm_grad dw_hh over no steps");
    ExpectAllNear(db, Full({8}, kPrefill), 0.0, "lstm_grad db over no steps");
    // Losses over a rank's empty shard of 4 rows.
    for (const char* loss : {"nll_loss", "cross_entropy"}) {
      HostTensor l = Full({}, 7.0, t);
      ASSERT_THAT(RunKernel(loss, {{"global_rows", int64_t{4}}},
                            {Full({0, 5}, 0.0, t), Ints({0}, {})}, {l}),
                  IsOk())
          << loss;
      ExpectAllNear(l, Full({}, 0.0), 0.0, loss);
    }
    // concat with an empty part is the other parts.
    const HostTensor a = As(t, Rand({2, 3, 4}, 7));
    HostTensor cat = Full({2, 3, 4}, 7.0, t);
    ASSERT_THAT(RunKernel("concat", {{"axis", int64_t{1}}}, {Full({2, 0, 4}, 0.0, t), a}, {cat}),
                IsOk());
    ExpectAllNear(cat, t == DType::kFloat32 ? Rand({2, 3, 4}, 7) : a,
                  t == DType::kFloat32 ? 1e-7 : 0.0, "concat with an empty part");
    // moe_combine over 0 experts: every token's row is 0.
    HostTensor out = Full({7, 5}, 7.0, t);
    ASSERT_THAT(
        RunKernel("moe_combine", {}, {Full({0, 3, 5}, 0.0, t), Full({7, 0, 3}, 0.0, t)}, {out}),
        IsOk());
    ExpectAllNear(out, Full({7, 5}, 0.0), 0.0, "moe_combine over no experts");
  }
}

}  // namespace
}  // namespace hap::executor::kernel_test
