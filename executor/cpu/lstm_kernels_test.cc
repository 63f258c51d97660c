// The LSTM and GRU kernels on the CPU: backward against finite
// differences, the forward against the cell equations, and batch shards.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "executor/cpu/kernel_test_util.h"
#include "executor/cpu/kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::kernel_test {
namespace {

using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

// x [2, 4, 3], hidden 2, `gates` stacked gates of 2 rows: x, w_ih, w_hh
// and, with `bias`, b_ih and b_hh.
std::vector<HostTensor> RecurrentInputs(uint64_t seed, bool bias, int64_t gates) {
  std::vector<HostTensor> v = {Rand({2, 4, 3}, seed, 1.5), Rand({2 * gates, 3}, seed + 1),
                               Rand({2 * gates, 2}, seed + 2)};
  if (bias) {
    v.push_back(Rand({2 * gates}, seed + 3));
    v.push_back(Rand({2 * gates}, seed + 4));
  }
  return v;
}

TEST(KernelGradTest, Lstm) {
  // With both biases, reversed, without biases, and with the bias slots
  // present but absent.
  auto ins = [](uint64_t seed, bool bias) { return RecurrentInputs(seed, bias, 4); };
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

TEST(KernelGradTest, Gru) {
  // With both biases, reversed, without biases, with one bias slot absent
  // (either: they enter differently), and one step, one sample.
  auto ins = [](uint64_t seed, bool bias) { return RecurrentInputs(seed, bias, 3); };
  ExpectGradientsMatch({"gru", {}, ins(1, true)});
  ExpectGradientsMatch({"gru", {{"reverse", true}}, ins(11, true)});
  ExpectGradientsMatch({"gru", {}, ins(21, false)});
  for (int absent_slot : {3, 4}) {
    std::vector<HostTensor> v = ins(31, true);
    v[absent_slot] = kAbsent;
    ExpectGradientsMatch({"gru", {{"reverse", absent_slot == 4}}, v, {{2, 4, 2}}});
  }
  ExpectGradientsMatch(
      {"gru",
       {},
       {Rand({1, 1, 2}, 41), Rand({9, 2}, 42), Rand({9, 3}, 43), Rand({9}, 44), Rand({9}, 45)}});
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

// PyTorch's nn.GRU equations step by step in plain loops: r, z = sigma of
// x W_i*^T + b_i* + h W_h*^T + b_h*; n = tanh(x W_in^T + b_in + r * (h
// W_hn^T + b_hn)); h' = (1 - z) n + z h.
std::vector<double> GruReference(const HostTensor& x, const HostTensor& w_ih,
                                 const HostTensor& w_hh, const HostTensor& b_ih,
                                 const HostTensor& b_hh, bool reverse) {
  const int64_t nb = x.shape()[0], ns = x.shape()[1], ni = x.shape()[2];
  const int64_t nh = w_hh.shape()[1];
  std::vector<double> y(nb * ns * nh);
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  for (int64_t b = 0; b < nb; ++b) {
    std::vector<double> h(nh, 0.0);
    for (int64_t k = 0; k < ns; ++k) {
      const int64_t t = reverse ? ns - 1 - k : k;
      std::vector<double> xi(3 * nh), hi(3 * nh);
      for (int64_t r = 0; r < 3 * nh; ++r) {
        xi[r] = b_ih.as<double>()[r];
        for (int64_t q = 0; q < ni; ++q) {
          xi[r] += w_ih.as<double>()[r * ni + q] * x.as<double>()[(b * ns + t) * ni + q];
        }
        hi[r] = b_hh.as<double>()[r];
        for (int64_t q = 0; q < nh; ++q) hi[r] += w_hh.as<double>()[r * nh + q] * h[q];
      }
      for (int64_t j = 0; j < nh; ++j) {
        const double r = sig(xi[j] + hi[j]), z = sig(xi[nh + j] + hi[nh + j]);
        const double n = std::tanh(xi[2 * nh + j] + r * hi[2 * nh + j]);
        h[j] = (1 - z) * n + z * h[j];
        y[(b * ns + t) * nh + j] = h[j];
      }
    }
  }
  return y;
}

TEST(KernelTest, GruMatchesTheCellEquations) {
  const HostTensor x = Rand({3, 5, 4}, 1, 2.0), w_ih = Rand({9, 4}, 2), w_hh = Rand({9, 3}, 3),
                   b_ih = Rand({9}, 4), b_hh = Rand({9}, 5);
  for (bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    HostTensor y(DType::kFloat64, {3, 5, 3});
    ASSERT_THAT(RunKernel("gru", {{"reverse", reverse}}, {x, w_ih, w_hh, b_ih, b_hh}, {y}, 0, 2),
                IsOk());
    ExpectAllNear(y, Vals({3, 5, 3}, GruReference(x, w_ih, w_hh, b_ih, b_hh, reverse)), 1e-12, "y");
  }
  HostTensor y(DType::kFloat64, {3, 5, 3});
  ASSERT_THAT(RunKernel("gru", {}, {x, w_ih, w_hh}, {y}), IsOk());
  ExpectAllNear(y, Vals({3, 5, 3}, GruReference(x, w_ih, w_hh, Full({9}, 0), Full({9}, 0), false)),
                1e-12, "y without biases");
  // b_hh is not b_ih: inside r * (...) on the n gate, they differ.
  ASSERT_THAT(RunKernel("gru", {}, {x, w_ih, w_hh, kAbsent, b_hh}, {y}), IsOk());
  ExpectAllNear(y, Vals({3, 5, 3}, GruReference(x, w_ih, w_hh, Full({9}, 0), b_hh, false)), 1e-12,
                "y with b_hh only");
  EXPECT_THAT(
      RunKernel("gru", {}, {x, w_ih, Rand({12, 3}, 6)}, {y}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be [3 * hidden, hidden]")));
}

// A batch shard's rows are the whole batch's rows (the data(0) rule): the
// samples never mix, forward and backward; the weight gradients of the two
// shards add up to the whole batch's.
TEST(KernelShardTest, RecurrentBatchShardsAreSlicesAndWeightGradientsAdd) {
  for (auto [op, gates] : {std::pair<std::string, int64_t>{"lstm", 8}, {"gru", 6}}) {
    SCOPED_TRACE(op);
    const int64_t g = gates;
    const HostTensor x = Rand({5, 3, 2}, 7), w_ih = Rand({g, 2}, 8), w_hh = Rand({g, 2}, 9),
                     b_ih = Rand({g}, 10), b_hh = Rand({g}, 12), dy = Rand({5, 3, 2}, 11);
    auto grads = [&](const HostTensor& xs, const HostTensor& dys, HostTensor& y,
                     std::vector<HostTensor>& d) {
      ASSERT_THAT(RunKernel(op, {}, {xs, w_ih, w_hh, b_ih, b_hh}, {y}), IsOk());
      d = {Full(xs.shape(), 0.0), Full({g, 2}, 0.0), Full({g, 2}, 0.0), Full({g}, 0.0),
           Full({g}, 0.0)};
      ASSERT_THAT(RunKernel(op + "_grad", {}, {xs, w_ih, w_hh, b_ih, b_hh, y, dys}, Args(d)),
                  IsOk());
    };
    HostTensor y(DType::kFloat64, {5, 3, 2});
    std::vector<HostTensor> whole;
    grads(x, dy, y, whole);
    std::vector<HostTensor> sum = {HostTensor(), Full({g, 2}, 0.0), Full({g, 2}, 0.0),
                                   Full({g}, 0.0), Full({g}, 0.0)};
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
}

}  // namespace
}  // namespace hap::executor::kernel_test
