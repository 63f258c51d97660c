#include "common/stats.h"

#include "gtest/gtest.h"

namespace hap {
namespace {

TEST(StatsTest, MedianAveragesTheMiddleTwoOfAnEvenCount) {
  EXPECT_EQ(Median({}), 0);
  EXPECT_EQ(Median({4}), 4);
  EXPECT_EQ(Median({9, 1, 5}), 5);
  EXPECT_EQ(Median({9, 1, 5, 2}), 3.5);
  EXPECT_EQ(Median({2, 2, 8, 8}), 5);
}

TEST(StatsTest, UpperMedianIsAMeasuredValue) {
  EXPECT_EQ(UpperMedian({}), 0);
  EXPECT_EQ(UpperMedian({9, 1, 5}), 5);
  EXPECT_EQ(UpperMedian({9, 1, 5, 2}), 5);
  EXPECT_EQ(UpperMedian({0.5, 0.5, 3, 3}), 3);
}

}  // namespace
}  // namespace hap
