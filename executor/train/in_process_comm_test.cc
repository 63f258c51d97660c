// The in-process group honours the communicator's contract on calls
// (communicator.h): calls that differ across ranks, or that a rank's own
// checks refuse, end InvalidArgument on every rank with the message Gloo's
// check_calls gives, and the group stays in step. Before, ranks read and
// wrote each other's buffers by their own sizes (out of bounds, or a
// silently wrong result) and a rank's bad call was not refused.
#include "executor/train/in_process_comm.h"

#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Runs fn(rank, comm) for each of `n` in-process ranks, one thread each.
void InGroup(int n, const std::function<void(int, Communicator&)>& fn) {
  auto comms = NewInProcessGroup(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { fn(r, *comms[r]); });
  for (auto& t : threads) t.join();
}

template <typename T>
TensorView Of(std::vector<T>& v) {
  DType dtype = DType::kFloat32;
  if (std::is_same<T, double>::value) dtype = DType::kFloat64;
  if (std::is_same<T, int64_t>::value) dtype = DType::kInt64;
  return TensorView{dtype, {static_cast<int64_t>(v.size())}, v.empty() ? nullptr : v.data()};
}

::testing::Matcher<absl::Status> Differ(const std::string& first, const std::string& other) {
  return StatusIs(absl::StatusCode::kInvalidArgument,
                  AllOf(HasSubstr("the ranks' calls differ"), HasSubstr(first), HasSubstr(other)));
}

// Every rank gives r + 1 to a sum over `n` ranks: the group is in step.
void ExpectSumsStill(int r, int n, Communicator& comm) {
  std::vector<double> x(3, r + 1.0);
  ASSERT_THAT(comm.AllReduce(Of(x)), IsOk());
  EXPECT_EQ(x[2], n * (n + 1) / 2.0);
}

TEST(InProcessCommTest, CollectivesOfOtherSizesAreInvalidArgumentOnEveryRank) {
  InGroup(3, [](int r, Communicator& comm) {
    std::vector<float> x(r == 2 ? 8 : 4, 1.0f);
    EXPECT_THAT(comm.AllReduce(Of(x)),
                AllOf(StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("all-reduce: ")),
                      Differ("rank 0 calls all-reduce of 4 f32 elements",
                             "rank 2 calls all-reduce of 8 f32 elements")));
    // A larger broadcast on a peer than on the root.
    std::vector<float> b(r == 1 ? 9 : 2, 1.0f);
    EXPECT_THAT(comm.Broadcast(Of(b), 0),
                Differ("rank 0 calls broadcast of 2 f32 elements from rank 0",
                       "rank 1 calls broadcast of 9 f32 elements from rank 0"));
    // All-gather chunks: each rank's own arguments agree, the ranks' not.
    std::vector<int64_t> counts =
        r == 0 ? std::vector<int64_t>{1, 1, 2} : std::vector<int64_t>{2, 1, 1};
    std::vector<float> part(counts[r]), whole(4);
    EXPECT_THAT(comm.AllGather(Of(part), Of(whole), counts, CommMethod::kGrouped),
                Differ("rank 0 calls all-gather (grouped) of f32 chunks [1,1,2]",
                       "rank 1 calls all-gather (grouped) of f32 chunks [2,1,1]"));
    ExpectSumsStill(r, 3, comm);
  });
}

TEST(InProcessCommTest, CollectivesOfOtherDTypesAreInvalidArgumentOnEveryRank) {
  InGroup(2, [](int r, Communicator& comm) {
    std::vector<float> f(5, 1.0f);
    std::vector<double> d(5, 1.0);
    EXPECT_THAT(comm.AllReduce(r == 1 ? Of(d) : Of(f)),
                Differ("rank 0 calls all-reduce of 5 f32 elements",
                       "rank 1 calls all-reduce of 5 f64 elements"));
    std::vector<float> fo(5);
    std::vector<double> dout(5);
    const std::vector<int64_t> counts = {2, 3};
    std::vector<float> fpart(counts[r]);
    std::vector<double> dpart(counts[r]);
    EXPECT_THAT(comm.ReduceScatter(r == 0 ? Of(d) : Of(f), r == 0 ? Of(dpart) : Of(fpart), counts,
                                   CommMethod::kPadded),
                Differ("rank 0 calls reduce-scatter (padded) of f64 chunks [2,3]",
                       "rank 1 calls reduce-scatter (padded) of f32 chunks [2,3]"));
    ExpectSumsStill(r, 2, comm);
  });
}

TEST(InProcessCommTest, CollectivesFromOtherRootsAreInvalidArgumentOnEveryRank) {
  InGroup(3, [](int r, Communicator& comm) {
    std::vector<float> b(4, static_cast<float>(r));
    EXPECT_THAT(comm.Broadcast(Of(b), r == 0 ? 0 : 1),
                Differ("rank 0 calls broadcast of 4 f32 elements from rank 0",
                       "rank 1 calls broadcast of 4 f32 elements from rank 1"));
    EXPECT_EQ(b[0], static_cast<float>(r));  // untouched
    std::vector<float> in(2, 1.0f), out(2, -1.0f);
    EXPECT_THAT(comm.Reduce(Of(in), Of(out), r == 2 ? 1 : 0),
                Differ("rank 0 calls reduce of 2 f32 elements to rank 0",
                       "rank 2 calls reduce of 2 f32 elements to rank 1"));
    EXPECT_EQ(out[0], -1.0f);  // untouched
    ExpectSumsStill(r, 3, comm);
  });
}

TEST(InProcessCommTest, CollectivesOfOtherKindsAreInvalidArgumentOnEveryRank) {
  InGroup(3, [](int r, Communicator& comm) {
    std::vector<float> x(2, 1.0f);
    absl::Status s;
    if (r == 0) s = comm.AllReduce(Of(x));
    if (r == 1) s = comm.Barrier();
    if (r == 2) s = comm.Broadcast(Of(x), 0);
    // The first rank that differs from rank 0 is named.
    EXPECT_THAT(s, Differ("rank 0 calls all-reduce of 2 f32 elements", "rank 1 calls barrier"));
    // Another method is another kind.
    const std::vector<int64_t> counts = {1, 1, 1};
    std::vector<float> whole(3), part(1);
    EXPECT_THAT(
        comm.ReduceScatter(Of(whole), Of(part), counts,
                           r == 2 ? CommMethod::kGrouped : CommMethod::kPadded),
        Differ("rank 0 calls reduce-scatter (padded)", "rank 2 calls reduce-scatter (grouped)"));
    // All-to-all counts that do not pair up: rank 1 sends 2 to rank 0,
    // which expects 1.
    std::vector<int64_t> send = {1, 1, 1}, recv = {1, 1, 1};
    if (r == 1) send = {2, 1, 1};
    std::vector<float> s_in(r == 1 ? 4 : 3), s_out(3);
    EXPECT_THAT(comm.AllToAll(Of(s_in), send, Of(s_out), recv),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("all-to-all: the ranks' counts differ: rank 1 sends 2 f32 "
                                   "elements to rank 0, which expects 1 from it")));
    ExpectSumsStill(r, 3, comm);
  });
}

// A call refused by its rank's own checks is refused there with what is
// wrong, and on its peers naming it; no rank waits for it.
TEST(InProcessCommTest, ACallRefusedByItsOwnRankIsInvalidArgumentOnEveryRank) {
  InGroup(3, [](int r, Communicator& comm) {
    std::vector<float> part(1), whole(r == 1 ? 4 : 3);
    const std::vector<int64_t> counts = {1, 1, 1};
    const absl::Status gather = comm.AllGather(Of(part), Of(whole), counts, CommMethod::kPadded);
    if (r == 1) {
      EXPECT_THAT(gather, StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("all-gather: counts [1,1,1] sum to 3 but the buffer "
                                             "holds 4 elements")));
    } else {
      EXPECT_THAT(gather, StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("all-gather: rank 1 refused its own call")));
    }
    std::vector<int64_t> ints(2);
    std::vector<float> floats(2);
    EXPECT_THAT(comm.AllReduce(r == 0 ? Of(ints) : Of(floats)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(r == 0 ? "only float32, float64 and bfloat16 are summed, got i64"
                                          : "all-reduce: rank 0 refused its own call")));
    std::vector<float> in(2), out(2);
    EXPECT_THAT(comm.Reduce(Of(in), Of(out), r == 0 ? 2 : 5),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(r == 0 ? "reduce: rank 1 refused its own call"
                                          : "reduce: root 5 is out of range for 3 ranks")));
    ExpectSumsStill(r, 3, comm);
  });
}

// What the checks let through still moves the right data.
TEST(InProcessCommTest, MatchedCallsMoveTheRightData) {
  InGroup(3, [](int r, Communicator& comm) {
    const std::vector<int64_t> counts = {1, 0, 2};
    std::vector<double> part(counts[r], 10.0 * r), whole(3);
    ASSERT_THAT(comm.AllGather(Of(part), Of(whole), counts, CommMethod::kPadded), IsOk());
    EXPECT_EQ(whole, (std::vector<double>{0, 20, 20}));
    std::vector<double> all = {1, 2, 3}, mine(counts[r]);
    ASSERT_THAT(comm.ReduceScatter(Of(all), Of(mine), counts, CommMethod::kGrouped), IsOk());
    if (r == 2) {
      EXPECT_EQ(mine, (std::vector<double>{6, 9}));
    }
    // Rank r sends r + 1 elements of value 10 r + j to rank j.
    std::vector<int64_t> send(3, r + 1), recv = {1, 2, 3};
    std::vector<float> out(6), in;
    for (int j = 0; j < 3; ++j) in.insert(in.end(), r + 1, 10.0f * r + j);
    ASSERT_THAT(comm.AllToAll(Of(in), send, Of(out), recv), IsOk());
    EXPECT_EQ(
        out, (std::vector<float>{0.0f + r, 10.0f + r, 10.0f + r, 20.0f + r, 20.0f + r, 20.0f + r}));
    std::vector<float> b(2, static_cast<float>(r));
    ASSERT_THAT(comm.Broadcast(Of(b), 1), IsOk());
    EXPECT_EQ(b[1], 1.0f);
    std::vector<float> in2(2, r + 1.0f), sum(r == 2 ? 2 : 0);
    ASSERT_THAT(comm.Reduce(Of(in2), Of(sum), 2), IsOk());
    if (r == 2) {
      EXPECT_EQ(sum[0], 6.0f);
    }
    ASSERT_THAT(comm.Barrier(), IsOk());
  });
}

}  // namespace
}  // namespace hap::executor
