#include "executor/daemon/step_reporter.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

hap::v1::StepMetric Metric(int64_t step) {
  hap::v1::StepMetric m;
  m.set_step(step);
  return m;
}

// A planner away while training goes on: every step's send failed and was
// logged, one stderr line per step (about 65,000 an hour at 20 steps/s).
// The outage is one line, and its end another, with the count.
TEST(StepReporterTest, AnOutageIsLoggedOnceAndItsEndOnce) {
  absl::Mutex mu;
  bool up = false;
  std::vector<std::string> lines;
  StepReporterOptions o;
  o.send = [&](const std::vector<hap::v1::StepMetric>&) {
    absl::MutexLock l(&mu);
    return up ? absl::OkStatus() : absl::UnavailableError("the planner is away");
  };
  o.log = [&](const std::string& line) {
    absl::MutexLock l(&mu);
    lines.push_back(line);
  };
  StepReporter reporter(o);
  for (int64_t step = 0; step < 5; ++step) {  // one send each
    ASSERT_TRUE(reporter.Push(Metric(step)));
    ASSERT_TRUE(reporter.Flush(absl::InfiniteFuture()));
  }
  {
    absl::MutexLock l(&mu);
    up = true;
  }
  for (int64_t step = 5; step < 7; ++step) {
    ASSERT_TRUE(reporter.Push(Metric(step)));
    ASSERT_TRUE(reporter.Flush(absl::InfiniteFuture()));
  }
  StepReporter::Counters c = reporter.counters();
  EXPECT_EQ(c.failed, 5);
  EXPECT_EQ(c.sent, 2);
  absl::MutexLock l(&mu);
  ASSERT_EQ(lines.size(), 2u) << ::testing::PrintToString(lines);
  EXPECT_THAT(lines[0], AllOf(HasSubstr("dropped 1 step metrics the planner did not take"),
                              HasSubstr("the planner is away")));
  EXPECT_THAT(lines[1], HasSubstr("the planner takes step metrics again; 5 were dropped"));
}

// A planner that does not answer: each send waits for its timeout, the
// queue fills meanwhile, and Push drops what does not fit. The outage's
// end said only how many the failed sends lost ("3 were dropped"), not the
// metrics dropped from the full queue: here 1 of 4.
TEST(StepReporterTest, AnOutagesEndCountsTheMetricsTheFullQueueDropped) {
  absl::Mutex mu;
  bool up = false;
  absl::Notification entered, release;
  std::vector<std::string> lines;
  StepReporterOptions o;
  o.capacity = 2;
  o.max_batch = 1;
  o.send = [&](const std::vector<hap::v1::StepMetric>&) {
    if (!entered.HasBeenNotified()) entered.Notify();
    release.WaitForNotification();  // the first send's timeout
    absl::MutexLock l(&mu);
    return up ? absl::OkStatus() : absl::DeadlineExceededError("the planner did not answer");
  };
  o.log = [&](const std::string& line) {
    absl::MutexLock l(&mu);
    lines.push_back(line);
  };
  StepReporter reporter(o);
  ASSERT_TRUE(reporter.Push(Metric(0)));
  entered.WaitForNotification();  // metric 0 in flight
  ASSERT_TRUE(reporter.Push(Metric(1)));
  ASSERT_TRUE(reporter.Push(Metric(2)));
  EXPECT_FALSE(reporter.Push(Metric(3)));  // the queue is full
  release.Notify();
  ASSERT_TRUE(reporter.Flush(absl::InfiniteFuture()));
  {
    absl::MutexLock l(&mu);
    up = true;
  }
  ASSERT_TRUE(reporter.Push(Metric(4)));
  ASSERT_TRUE(reporter.Flush(absl::InfiniteFuture()));
  StepReporter::Counters c = reporter.counters();
  EXPECT_EQ(c.failed, 3);
  EXPECT_EQ(c.dropped, 1);
  EXPECT_EQ(c.sent, 1);
  absl::MutexLock l(&mu);
  ASSERT_EQ(lines.size(), 2u) << ::testing::PrintToString(lines);
  EXPECT_THAT(lines[1], HasSubstr("the planner takes step metrics again; 4 were dropped while it "
                                  "did not (1 of them for a full queue)"));
}

}  // namespace
}  // namespace hap::executor
