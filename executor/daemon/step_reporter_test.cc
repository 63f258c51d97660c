#include "executor/daemon/step_reporter.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
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

}  // namespace
}  // namespace hap::executor
