// The interpreter and the plan collectives (shards along any dimension,
// uneven sizes) against the single-device run, with ranks as threads over
// an in-process communicator: a fast check of lowering + runtime that needs
// no sockets. equivalence_test.cc runs the same over real Gloo.
#include <iostream>
#include <thread>

#include "executor/cpu/cpu_device.h"
#include "executor/data/batches.h"
#include "executor/runtime/program_runner.h"
#include "executor/train/in_process_comm.h"
#include "executor/train/test_programs.h"
#include "gtest/gtest.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace hap {
namespace {

namespace v1 = ::hap::v1;

std::vector<std::vector<double>> RunRanks(const graph::Graph& g, const synth::Program& p,
                                          int n, std::vector<double> ratios, int steps,
                                          std::vector<executor::ParameterShard>* params) {
  lower::LowerOptions lo;
  lo.world_size = n;
  lo.ratios = ratios;
  lo.seed = 5;
  lo.optimizer.set_learning_rate(0.1);
  lo.optimizer.set_momentum(0.9);
  auto progs = lower::Lower(g, p, lo);
  EXPECT_TRUE(progs.ok()) << progs.status();
  auto comms = executor::NewInProcessGroup(n);
  std::vector<std::vector<double>> losses(n);
  std::vector<std::vector<executor::ParameterShard>> shards(n);
  std::vector<std::thread> th;
  for (int r = 0; r < n; ++r) {
    th.emplace_back([&, r] {
      auto dev = executor::NewCpuDevice(1);
      auto runner = executor::ProgramRunner::Create((*progs)[r], g, dev.get(), comms[r].get());
      ASSERT_TRUE(runner.ok()) << runner.status();
      ASSERT_TRUE((*runner)->InitializeParameters().ok());
      auto src = data::NewSyntheticBatches(g, 5);
      for (int s = 0; s < steps; ++s) {
        auto b = src->Get(s);
        auto loss = (*runner)->RunStep(*b, s);
        ASSERT_TRUE(loss.ok()) << "rank " << r << ": " << loss.status();
        losses[r].push_back(*loss);
      }
      shards[r] = *(*runner)->Parameters();
    });
  }
  for (auto& t : th) t.join();
  if (params) {
    for (auto& s : shards) params->insert(params->end(), s.begin(), s.end());
  }
  return losses;
}

class InProcessTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(InProcessTest, MatchesSingleDevice) {
  auto [model, kind] = GetParam();
  std::map<std::string, double> params;
  if (model == "mlp") params = {{"layers", 2}, {"hidden", 12}, {"input", 6}, {"classes", 4}, {"batch", 11}};
  if (model == "gpt") params = {{"layers", 1}, {"hidden", 8}, {"heads", 2}, {"ffn", 12}, {"seq", 4}, {"vocab", 13}, {"batch", 7}};
  if (model == "vit") params = {{"layers", 1}, {"hidden", 8}, {"heads", 2}, {"ffn", 12}, {"image", 8}, {"patch", 4}, {"classes", 3}, {"batch", 7}};
  if (model == "moe") params = {{"layers", 2}, {"hidden", 8}, {"heads", 2}, {"ffn", 12}, {"seq", 4}, {"vocab", 13}, {"batch", 7}, {"experts", 6}, {"dropout", 0.0}};
  auto g = graph::BuildZooModel(model, params);
  ASSERT_TRUE(g.ok());
  auto ref = RunRanks(*g, lower::SingleDeviceProgram(*g), 1, {1.0}, 3, nullptr);
  std::vector<double> ratios = {0.5, 0.3, 0.2};
  auto p = hap::testing::ProgramOfKind(*g, 3, kind, ratios);
  ASSERT_TRUE(p.ok()) << p.status();
  auto got = RunRanks(*g, *p, 3, ratios, 3, nullptr);
  // A real run: the loss moves, and the program splits work.
  EXPECT_GT(std::abs(ref[0][0] - ref[0][2]), 1e-4) << ref[0][0];
  int split = 0;
  for (const auto& s : p->steps) split += s.rule.split;
  EXPECT_GT(split, 0);
  std::cout << model << " " << kind << " losses " << ref[0][0] << " " << ref[0][2] << " split ops " << split << "\n";
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < 3; ++s) {
      EXPECT_NEAR(got[r][s], ref[0][s], 1e-5 * std::abs(ref[0][s]) + 1e-6) << "rank " << r << " step " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, InProcessTest,
                         ::testing::Combine(::testing::Values("mlp", "gpt", "vit", "moe"),
                                            ::testing::Values("dp", "tp", "mix", "zero", "zero2", "sfb")));

}  // namespace
}  // namespace hap
