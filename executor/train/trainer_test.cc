// The oracle of every equivalence test: AssembleParameters puts the pieces
// of all ranks together into the single-device tensors, refusing pieces
// that leave elements uncovered or replicas that disagree, and
// CompareParameters measures them against the single-device run.
#include "executor/train/trainer.h"

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "common/status_matchers.h"
#include "executor/train/test_programs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

// Rows [offset, offset + values.size()) of f32[4] parameter "w".
ParameterShard Rows(int64_t offset, const std::vector<float>& values) {
  ParameterShard s;
  s.name = "w";
  s.global_shape = {4};
  s.offsets = {offset};
  s.value = HostTensor(DType::kFloat32, {static_cast<int64_t>(values.size())});
  for (size_t i = 0; i < values.size(); ++i) s.value.as<float>()[i] = values[i];
  return s;
}

TEST(AssembleParametersTest, PutsShardsAndReplicasTogether) {
  auto w = AssembleParameters({{Rows(0, {1, 2})}, {Rows(2, {3, 4})}, {Rows(0, {1, 2, 3, 4})}});
  ASSERT_TRUE(w.ok()) << w.status();
  const float* v = w->at("w").as<float>();
  EXPECT_EQ(std::vector<float>(v, v + 4), (std::vector<float>{1, 2, 3, 4}));
}

// Two ranks holding the same half: 4 elements of pieces, rows 2 and 3 set
// by none (they read 0).
TEST(AssembleParametersTest, TwoCopiesOfOneHalfLeaveTheOtherUncovered) {
  EXPECT_THAT(AssembleParameters({{Rows(0, {1, 2})}, {Rows(0, {1, 2})}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the pieces of parameter 'w' leave elements uncovered")));
}

// Replicas that diverged (a rank whose update went wrong): the last rank's
// copy stood for all of them, so rank 0's went unchecked.
TEST(AssembleParametersTest, ReplicasThatDisagreeAreAnError) {
  EXPECT_THAT(AssembleParameters({{Rows(0, {1, 2, 3, 9})}, {Rows(0, {1, 2, 3, 4})}}),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("the pieces of parameter 'w' disagree: element 3 of the piece "
                                 "at [0]")));
  EXPECT_THAT(
      AssembleParameters({{Rows(0, {1, 2, 3, 4})}, {Rows(2, {3, 5})}}),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("element 1 of the piece at [2]")));
}

// The comparison with the single-device parameters: a NaN (a poisoned
// gradient reaching the last update, after the last loss was read) is no
// deviation by `diff > worst`, so a run whose parameters went NaN
// "matched".
TEST(CompareParametersTest, NonFiniteElementsAreTheWorstDeviation) {
  std::map<std::string, HostTensor> want, got;
  want.emplace("w", Rows(0, {1, 2, 3, 4}).value);
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    got.clear();
    got.emplace("w", Rows(0, {1, bad, 3.5, 4}).value);
    auto d = hap::testing::CompareParameters(got, want);
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_EQ(d->size(), 1u);
    EXPECT_EQ((*d)[0].worst, std::numeric_limits<double>::infinity()) << bad;
    EXPECT_EQ((*d)[0].at, 1) << bad;
  }
}

}  // namespace
}  // namespace hap::executor
