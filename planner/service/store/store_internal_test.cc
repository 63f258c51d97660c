#include "planner/service/store/store_internal.h"

#include <limits>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::service::store::internal {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

TEST(PageTokenTest, RoundTripsAnyName) {
  const std::vector<std::string> names = {"nodes/a", "plans/with:colons:and#hash", "x",
                                          "ünïcode/名前", std::string("nul\0inside", 10)};
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    ListCursor cursor{-12345678901, 999999999, name};
    std::string token = EncodePageToken(ListKind::kPlans, cursor);
    absl::StatusOr<PageRequest> request = ParsePageRequest(ListKind::kPlans, 3, token);
    ASSERT_THAT(request, IsOk());
    EXPECT_EQ(request->page_size, 3);
    EXPECT_TRUE(request->after == cursor);
  }
}

TEST(PageTokenTest, RefusesATokenOfAnotherList) {
  std::string token = EncodePageToken(ListKind::kNodes, {0, 0, "nodes/a"});
  EXPECT_THAT(ParsePageRequest(ListKind::kNodes, 1, token), IsOk());
  EXPECT_THAT(ParsePageRequest(ListKind::kDeployments, 1, token),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listing deployments")));
}

TEST(PageTokenTest, RefusesMadeUpTokens) {
  const std::vector<std::string> tokens = {
      "a", "====", absl::WebSafeBase64Escape("hapstore1:nodes:0:0:x"),
      absl::WebSafeBase64Escape("#0123456789abcdef"),
      absl::WebSafeBase64Escape("hapstore1:nodes:0:0:#af63bd4c8601b7df")};
  for (const std::string& token : tokens) {
    SCOPED_TRACE(token);
    EXPECT_THAT(ParsePageRequest(ListKind::kNodes, 1, token),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("pass next_page_token back unchanged")));
  }
}

TEST(PageRequestTest, PageSizeDefaultsAndCaps) {
  absl::StatusOr<PageRequest> request = ParsePageRequest(ListKind::kNodes, 0, "");
  ASSERT_THAT(request, IsOk());
  EXPECT_EQ(request->page_size, kDefaultPageSize);
  EXPECT_TRUE(request->after == ListCursor::First());
  request = ParsePageRequest(ListKind::kNodes, 1'000'000, "");
  ASSERT_THAT(request, IsOk());
  EXPECT_EQ(request->page_size, kMaxPageSize);
  EXPECT_THAT(ParsePageRequest(ListKind::kNodes, -1, ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("page_size must not be negative, got -1")));
}

TEST(ListCursorTest, FirstIsBeforeEveryRow) {
  EXPECT_TRUE(ListCursor::First() < (ListCursor{0, 0, "a"}));
  EXPECT_TRUE(ListCursor::First() < (ListCursor{std::numeric_limits<int64_t>::min(),
                                                std::numeric_limits<int32_t>::min(), "a"}));
  EXPECT_TRUE((ListCursor{1, 0, "z"}) < (ListCursor{1, 1, "a"}));
  EXPECT_TRUE((ListCursor{1, 1, "a"}) < (ListCursor{1, 1, "b"}));
}

TEST(StepMetricsTest, LimitIsCapped) {
  absl::StatusOr<int> limit = StepMetricsLimit("deployments/d", 1'000'000);
  ASSERT_THAT(limit, IsOk());
  EXPECT_EQ(*limit, kMaxStepMetricsLimit);
}

}  // namespace
}  // namespace hap::service::store::internal
