#include "planner/service/deployment_metrics.h"

#include <map>
#include <optional>
#include <string>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::testing::ElementsAre;
using ::testing::Pair;

v1::Deployment Made(const std::string& name, v1::Deployment::State state, int64_t steps,
                    double loss, int64_t end_seconds = 0) {
  v1::Deployment d;
  d.set_name(name);
  d.set_state(state);
  d.set_steps_completed(steps);
  d.set_last_loss(loss);
  if (end_seconds > 0) d.mutable_end_time()->set_seconds(end_seconds);
  return d;
}

std::vector<std::pair<std::string, double>> Flat(const std::vector<metrics::LabeledValue>& rows) {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& r : rows) {
    EXPECT_EQ(r.label_values.size(), 1u);
    out.push_back({r.label_values.at(0), r.value});
  }
  return out;
}

TEST(TrainingLossRowsTest, RunningFirstThenTheLatestToEndAndOnlyThoseWithASteps) {
  std::vector<v1::Deployment> held = {
      Made("deployments/old", v1::Deployment::SUCCEEDED, 100, 1.5, 1000),
      Made("deployments/b-run", v1::Deployment::RUNNING, 7, 3.25),
      Made("deployments/new", v1::Deployment::FAILED, 10, 2.5, 2000),
      Made("deployments/a-run", v1::Deployment::RUNNING, 3, 4.0),
      Made("deployments/pending", v1::Deployment::PENDING, 0, 0),  // no step yet
  };
  EXPECT_THAT(Flat(TrainingLossRows(held, 100)),
              ElementsAre(Pair("deployments/a-run", 4.0), Pair("deployments/b-run", 3.25),
                          Pair("deployments/new", 2.5), Pair("deployments/old", 1.5)));
  // The bound drops the oldest finished first.
  EXPECT_THAT(Flat(TrainingLossRows(held, 3)),
              ElementsAre(Pair("deployments/a-run", 4.0), Pair("deployments/b-run", 3.25),
                          Pair("deployments/new", 2.5)));
  EXPECT_THAT(Flat(TrainingLossRows(held, 0)), ElementsAre());
}

// 1,500 deployments one after another, as a long-running planner sees
// them: the newest is always shown (the family fed as metrics arrived
// stopped at the 1,000th).
TEST(TrainingLossRowsTest, TheNewestDeploymentIsShownPastTheBound) {
  std::vector<v1::Deployment> held;
  for (int i = 0; i < 1500; ++i) {
    held.push_back(Made("deployments/d" + std::to_string(i), v1::Deployment::SUCCEEDED, 5,
                        static_cast<double>(i), 1000 + i));
  }
  held.push_back(Made("deployments/now", v1::Deployment::RUNNING, 1, 9.0));
  const auto rows = Flat(TrainingLossRows(held, 1000));
  ASSERT_EQ(rows.size(), 1000u);
  EXPECT_THAT(rows.front(), Pair("deployments/now", 9.0));
  EXPECT_THAT(rows[1], Pair("deployments/d1499", 1499.0));
  EXPECT_THAT(rows.back(), Pair("deployments/d501", 501.0));
}

// The step-time alert's two sides: running deployments only (a finished
// one's series goes, and its alert resolves), each with its own plan's
// prediction.
TEST(RecentStepRowsTest, RunningDeploymentsThatReportedStepsOnly) {
  std::vector<v1::Deployment> held = {
      Made("deployments/b-run", v1::Deployment::RUNNING, 40, 1.0),
      Made("deployments/done", v1::Deployment::SUCCEEDED, 100, 1.0, 1000),
      Made("deployments/a-run", v1::Deployment::RUNNING, 25, 1.0),
      Made("deployments/starting", v1::Deployment::RUNNING, 0, 0),
  };
  held[0].set_recent_step_seconds(0.5);
  held[1].set_recent_step_seconds(9.0);
  held[2].set_recent_step_seconds(2.0);
  EXPECT_THAT(Flat(RecentStepRows(held, 100)),
              ElementsAre(Pair("deployments/a-run", 2.0), Pair("deployments/b-run", 0.5)));
  EXPECT_THAT(Flat(RecentStepRows(held, 1)), ElementsAre(Pair("deployments/a-run", 2.0)));
}

TEST(PredictedStepRowsTest, EachUnfinishedDeploymentsOwnPlanAndNoneForAPlanNotHeld) {
  std::vector<v1::Deployment> held = {
      Made("deployments/gpt-g1", v1::Deployment::RUNNING, 40, 1.0),
      Made("deployments/vit-g3", v1::Deployment::PENDING, 0, 0),
      Made("deployments/gone-g1", v1::Deployment::RUNNING, 3, 1.0),
      Made("deployments/gpt-g0", v1::Deployment::FAILED, 10, 1.0, 1000),
  };
  held[0].set_plan("plans/gpt");
  held[1].set_plan("plans/vit");
  held[2].set_plan("plans/gone");
  held[3].set_plan("plans/gpt");
  const std::map<std::string, double> predicted = {{"plans/gpt", 0.25}, {"plans/vit", 1.5}};
  auto lookup = [&](const std::string& plan) -> std::optional<double> {
    auto it = predicted.find(plan);
    if (it == predicted.end()) return std::nullopt;
    return it->second;
  };
  EXPECT_THAT(Flat(PredictedStepRows(held, 100, lookup)),
              ElementsAre(Pair("deployments/gpt-g1", 0.25), Pair("deployments/vit-g3", 1.5)));
}

TEST(LatestPerKeyTest, KeepsTheLatestValuePerKeyAndForgetsTheLeastRecentlySet) {
  LatestPerKey latest(2);
  EXPECT_THAT(Flat(latest.Rows()), ElementsAre());
  latest.Set("gpt", 1.0);
  latest.Set("vit", 2.0);
  latest.Set("gpt", 1.5);  // gpt set again: vit is now the least recent
  EXPECT_THAT(Flat(latest.Rows()), ElementsAre(Pair("gpt", 1.5), Pair("vit", 2.0)));
  latest.Set("mlp", 3.0);  // a new key is always shown; vit goes
  EXPECT_THAT(Flat(latest.Rows()), ElementsAre(Pair("mlp", 3.0), Pair("gpt", 1.5)));
}

}  // namespace
}  // namespace hap::service
