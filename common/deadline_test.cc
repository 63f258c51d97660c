#include "common/deadline.h"

#include <limits>

#include "gtest/gtest.h"

namespace hap {
namespace {

using Clock = std::chrono::steady_clock;

TEST(DeadlineAfterTest, AnyBudgetIsADeadlineNotAnOverflow) {
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(DeadlineAfter(start, 2.5) - start, std::chrono::milliseconds(2500));
  EXPECT_EQ(DeadlineAfter(start, -3), start);
  EXPECT_EQ(DeadlineAfter(start, 0), start);
  // 1e300 s converted to nanoseconds overflowed to a time before `start`.
  for (double huge : {1e9, 1e12, 1e300, std::numeric_limits<double>::max(),
                      std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_EQ(DeadlineAfter(start, huge), Clock::time_point::max()) << huge;
  }
  EXPECT_GT(DeadlineAfter(start, 9e8), start + std::chrono::hours(24 * 365 * 28));
}

}  // namespace
}  // namespace hap
