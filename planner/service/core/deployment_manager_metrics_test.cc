// Step metrics: the statistics kept as they arrive (rank 0's median over
// the metrics kept, the slowest rank's recent window), metrics loaded at a
// restart, repeats, refused reports and stores, paging; and the rendezvous
// store, which like the metrics belongs to a deployment.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/service/core/deployment_manager.h"
#include "planner/service/core/deployment_manager_test_util.h"
#include "planner/service/core/pagination.h"

namespace hap::service::deployment_manager_testing {
namespace {

// The slowest rank's median over its last 20 steps is what a job's
// slowdown is judged by, while rank 0's whole-run median moves slowly.
TEST_F(DeploymentManagerTest, TheRecentWindowIsRankZerosLastTwentySteps) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  std::vector<v1::StepMetric> batch;
  for (int step = 0; step < 60; ++step) {
    for (int rank : {0, 1}) {
      v1::StepMetric m;
      m.set_deployment(d->name());
      m.set_rank(rank);
      m.set_step(step);
      m.set_step_seconds(rank == 1 ? (step < 50 ? 0.5 : 3.0) : step < 35 ? 1.0 : 2.0);
      batch.push_back(m);
    }
  }
  ASSERT_THAT(manager_->ReportStepMetrics(batch), IsOk());
  const v1::Deployment now = *manager_->Get(d->name());
  EXPECT_DOUBLE_EQ(now.recent_step_seconds(), 3.0);  // rank 1: 10 of its last 20 at 3 s
  EXPECT_EQ(now.recent_steps_end(), 60);
  EXPECT_DOUBLE_EQ(now.median_step_seconds(), 1.0);
}

// median_step_seconds is rank 0's upper median over the metrics kept (the
// first max_metrics_per_deployment, metrics loaded at start included), as
// when it was recomputed over all of them for each metric; past the cap it
// stays, while the recent window follows the latest steps.
TEST(DeploymentManagerMetricsTest, TheMedianStepIsOverRankZerosMetricsKept) {
  v1::Deployment stored = StoredFinished(2);
  auto metric = [&](int rank, int64_t step, double seconds) {
    v1::StepMetric m;
    m.set_deployment(stored.name());
    m.set_rank(rank);
    m.set_step(step);
    m.set_step_seconds(seconds);
    return m;
  };
  auto upper_median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  // Step times with repeats, out of order, in batches of varying size.
  std::vector<double> kept;  // rank 0's, as kept
  std::vector<v1::StepMetric> loaded;
  int64_t step = 0;
  for (; step < 7; ++step) {
    loaded.push_back(metric(0, step, 1.0 + (step * 7 % 5) * 0.25));
    kept.push_back(loaded.back().step_seconds());
    loaded.push_back(metric(1, step, 0.5));
  }
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 200;
  DeploymentManager m(std::move(o), {stored}, loaded);
  size_t count = loaded.size();
  for (int batch = 1; step < 150; ++batch) {
    std::vector<v1::StepMetric> b;
    for (int i = 0; i < batch % 4 + 1 && step < 150; ++i, ++step) {
      const double seconds = 0.5 + ((step * 37) % 23) * 0.125;
      b.push_back(metric(0, step, seconds));
      b.push_back(metric(1, step, 0.25));
      for (int rank : {0, 1}) {
        if (count++ < 200 && rank == 0) kept.push_back(seconds);
      }
    }
    ASSERT_THAT(m.ReportStepMetrics(b), IsOk());
    const v1::Deployment d = *m.Get(stored.name());
    ASSERT_DOUBLE_EQ(d.median_step_seconds(), upper_median(kept)) << "at step " << step;
  }
  EXPECT_EQ(kept.size(), 100u);  // 200 metrics kept, half of them rank 0's
  EXPECT_EQ(m.StepMetrics(stored.name())->size(), 200u);
  std::vector<double> last;
  for (int64_t s = 130; s < 150; ++s) last.push_back(0.5 + ((s * 37) % 23) * 0.125);
  EXPECT_DOUBLE_EQ(m.Get(stored.name())->recent_step_seconds(), upper_median(last));
}

// Metrics loaded at start are kept up to the same cap as reported ones
// (all of a long run's were kept in memory after a restart), and the
// statistics follow all of them.
TEST(DeploymentManagerMetricsTest, MetricsLoadedAtStartAreKeptUpToTheCap) {
  v1::Deployment stored = StoredFinished(1);
  std::vector<v1::StepMetric> loaded;
  for (int64_t step = 0; step < 50; ++step) {
    v1::StepMetric m;
    m.set_deployment(stored.name());
    m.set_step(step);
    m.set_step_seconds(step < 10 ? 1.0 : 3.0);
    loaded.push_back(m);
  }
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 10;
  DeploymentManager m(std::move(o), {stored}, loaded);
  auto kept = m.StepMetrics(stored.name());
  ASSERT_THAT(kept, IsOk());
  ASSERT_EQ(kept->size(), 10u);
  EXPECT_EQ(kept->back().step(), 9);
  // One more step: the median is over the 10 kept, the recent window over
  // the latest 20 steps, loaded ones included.
  v1::StepMetric next = loaded.back();
  next.set_step(50);
  ASSERT_THAT(m.ReportStepMetrics({next}), IsOk());
  const v1::Deployment d = *m.Get(stored.name());
  EXPECT_DOUBLE_EQ(d.median_step_seconds(), 1.0);
  EXPECT_DOUBLE_EQ(d.recent_step_seconds(), 3.0);
  EXPECT_EQ(m.StepMetrics(stored.name())->size(), 10u);
}

// A metric reported again for the same (rank, step), e.g. by a client that
// retries a report that did arrive, replaces the earlier one, as the store
// replaces its row: served once, counted once in the median and the recent
// window, and the latest loss is the new one. Steps reported out of order
// and around a gap are told apart from repeats.
TEST(DeploymentManagerMetricsTest, AMetricReportedAgainReplacesTheEarlierOne) {
  v1::Deployment stored = StoredFinished(2);
  auto metric = [&](int rank, int64_t step, double seconds, double loss) {
    v1::StepMetric m;
    m.set_deployment(stored.name());
    m.set_rank(rank);
    m.set_step(step);
    m.set_step_seconds(seconds);
    m.set_loss(loss);
    return m;
  };
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 6;
  DeploymentManager m(std::move(o), {stored}, {metric(0, 0, 1.0, 5.0)});
  // Rank 0: steps 0 (loaded), 2, 1, 4 (a gap at 3), then 0 and 2 again;
  // rank 1: step 0 twice in one batch.
  ASSERT_THAT(
      m.ReportStepMetrics({metric(0, 2, 1.0, 4.0), metric(0, 1, 1.0, 4.5), metric(1, 0, 9.0, 0),
                           metric(1, 0, 9.0, 0), metric(0, 4, 1.0, 3.0)}),
      IsOk());
  ASSERT_THAT(
      m.ReportStepMetrics({metric(0, 0, 7.0, 6.0), metric(0, 2, 7.0, 6.0), metric(0, 4, 7.0, 2.5)}),
      IsOk());
  auto kept = m.StepMetrics(stored.name());
  ASSERT_THAT(kept, IsOk());
  std::vector<std::pair<int, int64_t>> keys;
  for (const v1::StepMetric& k : *kept) keys.emplace_back(k.rank(), k.step());
  EXPECT_THAT(keys,
              ::testing::ElementsAre(std::pair<int, int64_t>{0, 0}, std::pair<int, int64_t>{0, 2},
                                     std::pair<int, int64_t>{0, 1}, std::pair<int, int64_t>{1, 0},
                                     std::pair<int, int64_t>{0, 4}));
  EXPECT_DOUBLE_EQ((*kept)[0].step_seconds(), 7.0);  // replaced
  EXPECT_DOUBLE_EQ((*kept)[1].step_seconds(), 7.0);
  // Counted once: rank 0's median over its first reports (1, 1, 1, 1).
  v1::Deployment d = *m.Get(stored.name());
  EXPECT_DOUBLE_EQ(d.median_step_seconds(), 1.0);
  EXPECT_EQ(d.steps_completed(), 5);
  EXPECT_DOUBLE_EQ(d.last_loss(), 2.5);
  // Step 3 fills the gap: new, not a repeat.
  ASSERT_THAT(m.ReportStepMetrics({metric(0, 3, 1.0, 3.5)}), IsOk());
  EXPECT_EQ(m.StepMetrics(stored.name())->size(), 6u);
  d = *m.Get(stored.name());
  EXPECT_DOUBLE_EQ(d.last_loss(), 2.5);  // step 4's stays the latest
  // Rank 1's window holds one 9 s step, not two.
  ASSERT_THAT(m.ReportStepMetrics({metric(1, 1, 1.0, 0), metric(1, 2, 1.0, 0)}), IsOk());
  EXPECT_DOUBLE_EQ(m.Get(stored.name())->recent_step_seconds(), 1.0);
}

// A deployment's summary of its metrics (steps completed, last loss, the
// medians) is kept in memory as metrics arrive, not saved with every one:
// after a restart it is recomputed from the metrics loaded, also past the
// cap (before, a restarted planner showed the steps and loss of the
// deployment's last saved state change until its next metric).
TEST(DeploymentManagerMetricsTest, ARestartRecomputesStepsCompletedAndLastLossFromStoredMetrics) {
  v1::Deployment stored = StoredFinished(2);
  stored.set_steps_completed(0);  // as saved when it started
  std::vector<v1::StepMetric> loaded;
  for (int64_t step = 0; step < 50; ++step) {
    for (int rank : {1, 0}) {
      v1::StepMetric m;
      m.set_deployment(stored.name());
      m.set_rank(rank);
      m.set_step(step);
      m.set_loss(10.0 - step * 0.1 + rank);
      m.set_step_seconds(step < 10 ? 1.0 : 3.0);
      loaded.push_back(m);
    }
  }
  DeploymentManagerOptions o = NoExecutors();
  o.max_metrics_per_deployment = 10;  // steps 0-4 kept, the rest past the cap
  DeploymentManager m(std::move(o), {stored}, loaded);
  const v1::Deployment d = *m.Get(stored.name());
  EXPECT_EQ(d.steps_completed(), 50);
  EXPECT_DOUBLE_EQ(d.last_loss(), 10.0 - 49 * 0.1);  // rank 0's at step 49
  EXPECT_DOUBLE_EQ(d.median_step_seconds(), 1.0);    // over the kept
  EXPECT_DOUBLE_EQ(d.recent_step_seconds(), 3.0);    // the latest steps
  EXPECT_EQ(d.recent_steps_end(), 50);
}

// A misbehaving executor's metrics are refused whole, naming the field and
// value: a step past the deployment's last (INT64_MAX overflowed the steps
// completed), a NaN, infinite or negative time or a NaN loss (they poisoned
// the medians a job's slowdown is judged by).
TEST_F(DeploymentManagerTest, StepMetricsOutsideTheDeploymentOrNotFiniteAreRefused) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  auto metric = [&](int64_t step, double seconds) {
    v1::StepMetric m;
    m.set_deployment(d->name());
    m.set_step(step);
    m.set_loss(2.5);
    m.set_step_seconds(seconds);
    return m;
  };
  ASSERT_THAT(manager_->ReportStepMetrics({metric(0, 1.0), metric(999, 1.0)}), IsOk());
  for (int64_t step : {int64_t{1000}, std::numeric_limits<int64_t>::max()}) {
    EXPECT_THAT(manager_->ReportStepMetrics({metric(1, 1.0), metric(step, 1.0)}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("step ", step,
                                                " outside the deployment (ranks "
                                                "0 to 1, steps 0 to 999)"))));
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double seconds : {nan, inf, -1.0}) {
    EXPECT_THAT(manager_->ReportStepMetrics({metric(2, seconds)}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("rank 0 step 2: step_seconds is ", seconds,
                                                ", not a finite time of 0 or more"))));
  }
  v1::StepMetric bad = metric(2, 1.0);
  bad.set_loss(nan);
  EXPECT_THAT(manager_->ReportStepMetrics({bad}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss is nan, not finite")));
  bad = metric(2, 1.0);
  bad.set_communication_seconds(-inf);
  EXPECT_THAT(
      manager_->ReportStepMetrics({bad}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("communication_seconds is -inf")));
  // A batch past the bound per call (400,000 fit in a 16 MiB request, each
  // checked, saved and kept under the manager's lock) is refused whole.
  std::vector<v1::StepMetric> huge(DeploymentManager::kMaxStepMetricsPerReport + 1, metric(3, 1.0));
  EXPECT_THAT(manager_->ReportStepMetrics(huge),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("at most 4096 step metrics, got 4097")));
  // Nothing of the refused batches was taken.
  const v1::Deployment now = *manager_->Get(d->name());
  EXPECT_EQ(now.steps_completed(), 1000);
  EXPECT_DOUBLE_EQ(now.median_step_seconds(), 1.0);
  EXPECT_DOUBLE_EQ(now.recent_step_seconds(), 1.0);
  EXPECT_EQ(manager_->StepMetrics(d->name())->size(), 2u);
}

// A batch over two deployments whose store takes the first and refuses the
// second fails naming it, and each deployment's metrics are served as the
// store holds them (a restart neither brings back metrics the call did not
// take nor loses some it did).
TEST_F(DeploymentManagerTest, StepMetricsTheStoreRefusesPartWayAreServedAsStored) {
  std::vector<v1::Deployment> stored;
  for (const char* name : {"deployments/p-g1", "deployments/q-g1"}) {
    v1::Deployment d;
    d.set_name(name);
    d.set_plan("plans/p");
    d.set_state(v1::Deployment::SUCCEEDED);
    d.add_ranks()->set_device("a/cpu0");
    d.mutable_training()->set_steps(100);
    stored.push_back(d);
  }
  Start(stored);
  sink_.RefuseMetricsOf("deployments/q-g1");
  std::vector<v1::StepMetric> batch(2);
  batch[0].set_deployment("deployments/p-g1");
  batch[1].set_deployment("deployments/q-g1");
  EXPECT_THAT(manager_->ReportStepMetrics(batch),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("step metrics not saved (deployments/q-g1)"),
                             HasSubstr("disk is full"))));
  for (const char* name : {"deployments/p-g1", "deployments/q-g1"}) {
    EXPECT_EQ(manager_->StepMetrics(name)->size(), sink_.metrics(name)) << name;
    EXPECT_EQ(manager_->Get(name)->steps_completed(), sink_.metrics(name)) << name;
  }
}

// A ListStepMetrics token is good for the deployment that returned it:
// one of another deployment was taken as a position in this one's metrics
// and silently skipped them.
TEST_F(DeploymentManagerTest, AStepMetricsTokenOfAnotherDeploymentIsRefused) {
  std::vector<std::string> names;
  for (int i = 0; i < 2; ++i) {
    auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
    ASSERT_THAT(d, IsOk());
    names.push_back(d->name());
    std::vector<v1::StepMetric> metrics;
    for (int step = 0; step < 3; ++step) {
      v1::StepMetric m;
      m.set_deployment(d->name());
      m.set_step(step);
      metrics.push_back(m);
    }
    ASSERT_THAT(manager_->ReportStepMetrics(metrics), IsOk());
  }
  auto first = manager_->ListStepMetrics(names[0], 1, "");
  ASSERT_THAT(first, IsOk());
  ASSERT_FALSE(first->next_page_token().empty());
  EXPECT_THAT(manager_->ListStepMetrics(names[1], 1, first->next_page_token()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("page_token"), HasSubstr(names[1]))));
  std::vector<int64_t> steps;
  std::string token;
  do {
    auto page = manager_->ListStepMetrics(names[0], 1, token);
    ASSERT_THAT(page, IsOk());
    for (const auto& m : page->metrics()) steps.push_back(m.step());
    token = page->next_page_token();
  } while (!token.empty());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2}));
}

TEST_F(DeploymentManagerTest, StepMetricsAndTheRendezvousStoreBelongToADeployment) {
  auto d = manager_->Deploy(TwoDevicePlan(), Request(), v1::Cluster(), "planner:1");
  ASSERT_THAT(d, IsOk());
  v1::StepMetric m;
  m.set_deployment(d->name());
  m.set_rank(0);
  m.set_step(4);
  m.set_loss(2.5);
  ASSERT_THAT(manager_->ReportStepMetrics({m}), IsOk());
  EXPECT_EQ(manager_->Get(d->name())->steps_completed(), 5);
  m.set_rank(2);
  EXPECT_THAT(manager_->ReportStepMetrics({m}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 and step 4")));
  const std::string list = absl::StrCat("step metrics of ", d->name());
  for (const char* token : {"-3", "1"}) {  // not a token of the list
    EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, token),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  }
  EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, PageTokenAfter(list, "-3")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  // A position past the metrics was not returned (INT64_MAX + page_size
  // overflowed).
  for (const char* position : {"2", "9223372036854775807"}) {
    EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, PageTokenAfter(list, position)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("page_token (position ", position,
                                                ") is not a token this server returned (",
                                                d->name(), " has 1 step metrics)"))));
  }
  EXPECT_THAT(manager_->ListStepMetrics(d->name(), 10, PageTokenAfter(list, "1")), IsOk());
  auto page = manager_->ListStepMetrics(d->name(), 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->metrics_size(), 1);

  ASSERT_THAT(manager_->StoreSet(d->name(), 1, "k", "v"), IsOk());
  EXPECT_THAT(manager_->StoreSet("deployments/ghost-g1", 1, "k", "v"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("ghost")));
  EXPECT_THAT(manager_->StoreGet(d->name(), 1, {"k"}, absl::InfiniteFuture(),
                                 [] { return false; }),
              IsOk());
  EXPECT_THAT(manager_->StoreGet(d->name(), 1, {"k", "missing"}, absl::InfinitePast(),
                                 [] { return false; }),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing")));
  EXPECT_THAT(manager_->StoreAdd(d->name(), 1, "n", 2), IsOk());
  EXPECT_THAT(manager_->StoreAdd(d->name(), 1, "k", 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a counter")));
  EXPECT_EQ(manager_->rendezvous_keys(), 2);

  // A finished deployment's keys are dropped and its rendezvous closed.
  WaitFor(d->name(), v1::Deployment::RUNNING);
  ASSERT_THAT(manager_->Stop(d->name(), absl::InfiniteFuture(), [] { return false; }), IsOk());
  EXPECT_EQ(manager_->rendezvous_keys(), 0);
  EXPECT_THAT(manager_->StoreSet(d->name(), 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("STOPPED")));
  EXPECT_THAT(manager_->StoreGet(d->name(), 1, {"k"}, absl::InfiniteFuture(),
                                 [] { return false; }),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rendezvous is closed")));
  EXPECT_EQ(manager_->rendezvous_keys(), 0);
}

}  // namespace
}  // namespace hap::service::deployment_manager_testing
