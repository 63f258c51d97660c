#include "executor/runtime/timing_device.h"

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "executor/cpu/cpu_device.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

TensorView View(std::vector<double>& v, Shape s) {
  return TensorView{graph::DType::kFloat64, std::move(s), v.data()};
}

// Kernels are booked to the op type an IR op's calls go under: forward and
// _grad together, the sharded cross-entropy's
// kernels as cross_entropy, optimizer and runtime kernels apart.
TEST(TimingDeviceTest, KernelsCountForTheirOpType) {
  auto cpu = NewCpuDevice(1);
  TimingDevice d(cpu.get());
  std::vector<double> x = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}, lse(2), dx(6, 0), loss(1),
      dy = {1.0};
  std::vector<int64_t> ids = {1, 2};
  TensorView t{graph::DType::kInt64, {2}, ids.data()};
  graph::Attrs a;
  a.Set("vocab_offset", int64_t{0});
  a.Set("vocab_size", int64_t{3});
  a.Set("rank", int64_t{0});
  a.Set("ranks", int64_t{1});
  KernelContext ctx;
  ASSERT_TRUE(d.RunKernel("cross_entropy_lse", ctx, a, {View(x, {2, 3})},
                          {View(lse, {2})}).ok());
  ASSERT_TRUE(d.RunKernel("cross_entropy_sharded", ctx, a,
                          {View(x, {2, 3}), t, View(lse, {2})}, {View(loss, {})}).ok());
  ASSERT_TRUE(d.RunKernel("cross_entropy_sharded_grad", ctx, a,
                          {View(x, {2, 3}), t, View(lse, {2}), View(dy, {})},
                          {View(dx, {2, 3})}).ok());
  ASSERT_TRUE(d.Fill(View(dx, {2, 3}), 0).ok());
  graph::Attrs half;
  half.Set("factor", 0.5);
  std::vector<double> y(6), g(6, 1.0), gx(6, 0.0);
  ASSERT_TRUE(d.RunKernel("scale_grad", ctx, half, {View(x, {6}), View(y, {6}), View(g, {6})},
                          {View(gx, {6})}).ok());
  const auto by_type = d.SecondsByOpType(1);
  std::vector<std::string> types;
  for (const auto& [type, seconds] : by_type) types.push_back(type);
  EXPECT_EQ(types, (std::vector<std::string>{"(runtime)", "cross_entropy", "scale"}));
  // Row 0 (target 1): lse(.1, .2, .3) - .2; row 1 (target 2): lse(.4, .5, .6)
  // - .6; the mean over the two rows.
  auto lse3 = [](double a, double b, double c) {
    return std::log(std::exp(a) + std::exp(b) + std::exp(c));
  };
  EXPECT_NEAR(loss[0], (lse3(0.1, 0.2, 0.3) - 0.2 + lse3(0.4, 0.5, 0.6) - 0.6) / 2, 1e-12);
}

// With overlap the runner's communication thread converts and copies
// through the device while the main thread runs kernels: every call of both
// threads is counted.
TEST(TimingDeviceTest, CallsFromTwoThreadsAreAllCounted) {
  auto cpu = NewCpuDevice(1);
  TimingDevice d(cpu.get());
  constexpr int kCalls = 200000;
  std::atomic<int> ready{0};
  auto fill = [&] {
    std::vector<double> v(4);
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }
    for (int i = 0; i < kCalls; ++i) ASSERT_TRUE(d.Fill(View(v, {4}), i).ok());
  };
  std::thread other(fill);
  fill();
  other.join();
  EXPECT_NE(d.Table(1).find("| (fill) | 400000 |"), std::string::npos) << d.Table(1);
}

}  // namespace
}  // namespace hap::executor
