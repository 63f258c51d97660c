#include "executor/comm/call_agreement.h"

#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::Eq;
using ::testing::HasSubstr;

// Kind, dtype, elements, root, then a count and a receive count per rank
// (zeros where the call has none).
TEST(CallAgreementTest, EncodeCallLaysOutTheFieldsThenCountsThenReceiveCounts) {
  const std::vector<int64_t> send{1, 2, 3}, recv{4, 5, 6};
  EXPECT_THAT(EncodeCall({CallKind::kAllToAll, DType::kFloat64, 6, -1, send, recv}, 3),
              ElementsAre(static_cast<int64_t>(CallKind::kAllToAll),
                          static_cast<int64_t>(DType::kFloat64), 6, -1, 1, 2, 3, 4, 5, 6));
  EXPECT_THAT(EncodeCall({CallKind::kBroadcast, DType::kFloat32, 4, 1}, 2),
              ElementsAre(static_cast<int64_t>(CallKind::kBroadcast),
                          static_cast<int64_t>(DType::kFloat32), 4, 1, 0, 0, 0, 0));
}

TEST(CallAgreementTest, DescribeCallNamesEachKindAsTheMismatchMessagesDo) {
  const std::vector<int64_t> chunks{2, 3};
  auto describe = [](const Call& c) { return DescribeCall(EncodeCall(c, 2)); };
  EXPECT_EQ(describe({CallKind::kAllReduce, DType::kFloat32, 4}), "all-reduce of 4 f32 elements");
  EXPECT_EQ(describe({CallKind::kBroadcast, DType::kFloat32, 4, 1}),
            "broadcast of 4 f32 elements from rank 1");
  EXPECT_EQ(describe({CallKind::kReduce, DType::kFloat64, 3, 0}),
            "reduce of 3 f64 elements to rank 0");
  EXPECT_EQ(describe({CallKind::kAllGatherPadded, DType::kFloat32, 5, -1, chunks}),
            "all-gather (padded) of f32 chunks [2,3]");
  EXPECT_EQ(describe({CallKind::kReduceScatterGrouped, DType::kBFloat16, 5, -1, chunks}),
            "reduce-scatter (grouped) of bf16 chunks [2,3]");
  EXPECT_EQ(describe({CallKind::kAllToAll, DType::kFloat32, 5, -1, chunks, chunks}),
            "all-to-all of f32");
  EXPECT_EQ(describe({CallKind::kBarrier, DType::kFloat32, 0}), "barrier");
  EXPECT_EQ(describe({CallKind::kRefused, DType::kFloat32, 0}), "a call it refused");
}

// A newer peer's kind or dtype is named by its number, not misread.
TEST(CallAgreementTest, DescribeCallNamesAnUnknownKindOrDTypeByItsNumber) {
  EXPECT_EQ(DescribeCall({99, 0, 4, -1, 0, 0, 0, 0}), "collective #99");
  EXPECT_EQ(DescribeCall({static_cast<int64_t>(CallKind::kAllReduce), 42, 4, -1, 0, 0, 0, 0}),
            "all-reduce of 4 dtype #42 elements");
}

TEST(CallAgreementTest, MatchingCallsAgree) {
  const EncodedCall call = EncodeCall({CallKind::kAllReduce, DType::kFloat32, 4}, 3);
  EXPECT_THAT(CheckCallsMatch("all-reduce", {call, call, call}), IsOk());
}

TEST(CallAgreementTest, CallsOfOtherCountsNameRankZerosCallAndTheFirstThatDiffers) {
  const EncodedCall four = EncodeCall({CallKind::kAllReduce, DType::kFloat32, 4}, 2);
  const EncodedCall eight = EncodeCall({CallKind::kAllReduce, DType::kFloat32, 8}, 2);
  EXPECT_THAT(CheckCallsMatch("all-reduce", {four, eight}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       Eq("all-reduce: the ranks' calls differ: rank 0 calls all-reduce of 4 f32 "
                          "elements, rank 1 calls all-reduce of 8 f32 elements")));
}

TEST(CallAgreementTest, CallsOfAnotherDTypeNameTheFirstRankThatDiffers) {
  const EncodedCall f32 = EncodeCall({CallKind::kAllReduce, DType::kFloat32, 5}, 3);
  const EncodedCall f64 = EncodeCall({CallKind::kAllReduce, DType::kFloat64, 5}, 3);
  EXPECT_THAT(CheckCallsMatch("all-reduce", {f32, f32, f64}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       Eq("all-reduce: the ranks' calls differ: rank 0 calls all-reduce of 5 f32 "
                          "elements, rank 2 calls all-reduce of 5 f64 elements")));
}

// A refusal is named before any other difference, wherever it stands.
TEST(CallAgreementTest, ARefusedCallNamesTheRankThatRefused) {
  const EncodedCall call = EncodeCall({CallKind::kAllReduce, DType::kFloat32, 4}, 3);
  const EncodedCall refused = EncodeCall({CallKind::kRefused, DType::kFloat32, 0}, 3);
  EXPECT_THAT(CheckCallsMatch("broadcast", {call, refused, refused}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       Eq("broadcast: rank 1 refused its own call before any traffic (its "
                          "arguments there are invalid; its error names them)")));
}

TEST(CallAgreementTest, DifferentCollectivesNameBoth) {
  const EncodedCall sum = EncodeCall({CallKind::kAllReduce, DType::kFloat32, 2}, 2);
  const EncodedCall barrier = EncodeCall({CallKind::kBarrier, DType::kFloat32, 0}, 2);
  EXPECT_THAT(CheckCallsMatch("barrier", {sum, barrier}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 0 calls all-reduce of 2 f32 elements, rank 1 calls "
                                 "barrier")));
}

// All-to-all rows differ by rank: they agree when every rank's sends are
// what their receivers expect, whatever each one's own element count.
TEST(CallAgreementTest, AllToAllCountsMustPairUp) {
  const std::vector<int64_t> send0{1, 2}, recv0{1, 2}, send1{2, 1}, recv1{2, 1};
  const EncodedCall rank0 =
      EncodeCall({CallKind::kAllToAll, DType::kFloat32, 3, -1, send0, recv0}, 2);
  const EncodedCall rank1 =
      EncodeCall({CallKind::kAllToAll, DType::kFloat32, 3, -1, send1, recv1}, 2);
  EXPECT_THAT(CheckCallsMatch("all-to-all", {rank0, rank1}), IsOk());

  // Rank 1 sends 3 elements to rank 0, which expects 2.
  const std::vector<int64_t> send3{3, 1};
  const EncodedCall more =
      EncodeCall({CallKind::kAllToAll, DType::kFloat32, 4, -1, send3, recv1}, 2);
  EXPECT_THAT(CheckCallsMatch("all-to-all", {rank0, more}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       Eq("all-to-all: the ranks' counts differ: rank 1 sends 3 f32 elements to "
                          "rank 0, which expects 2 from it")));

  // The dtype must still be the same.
  const EncodedCall f64 =
      EncodeCall({CallKind::kAllToAll, DType::kFloat64, 3, -1, send1, recv1}, 2);
  EXPECT_THAT(CheckCallsMatch("all-to-all", {rank0, f64}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 0 calls all-to-all of f32, rank 1 calls all-to-all of "
                                 "f64")));
}

}  // namespace
}  // namespace hap::executor
