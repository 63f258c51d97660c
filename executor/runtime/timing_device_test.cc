#include "executor/runtime/timing_device.h"

#include <vector>

#include "executor/cpu/cpu_device.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

TensorView View(std::vector<double>& v, Shape s) {
  return TensorView{graph::DType::kFloat64, std::move(s), v.data()};
}

// Kernels are booked to the op type an IR op's calls go under: forward and
// _grad together, the sharded cross-entropy's kernels as cross_entropy,
// optimizer and runtime kernels apart.
TEST(TimingDeviceTest, KernelsCountForTheirOpType) {
  auto cpu = NewCpuDevice(1);
  TimingDevice d(cpu.get());
  std::vector<double> x = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}, lse(2), all(2), dx(6, 0),
                      loss(1), dy = {1.0};
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
  const auto by_type = d.SecondsByOpType(1);
  EXPECT_EQ(by_type.size(), 2u);
  EXPECT_TRUE(by_type.count("cross_entropy"));
  EXPECT_TRUE(by_type.count("(runtime)"));
  // log(e^.1 + e^.2 + e^.3) - 0.2 and the same for the second row, halved.
  EXPECT_GT(loss[0], 0.9);
  EXPECT_LT(loss[0], 1.2);
}

}  // namespace
}  // namespace hap::executor
