// The LSTM kernels on the CPU: backward against finite differences, the
// forward against the cell equations, and batch shards.
#include <cmath>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/kernel_test_util.h"
#include "executor/cpu/kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::kernel_test {
namespace {


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

}  // namespace
}  // namespace hap::executor::kernel_test
