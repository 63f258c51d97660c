// The Gloo communicator's messages and collectives: point-to-point by tag,
// every collective against the single-process result, bf16 rounding, and
// the checks of a call (its own arguments, and the agreement across ranks).
// Connecting the ranks: gloo_connect_test; the file store: file_store_test.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "executor/comm/communicator.h"
#include "executor/comm/dead_peer_address.h"
#include "executor/comm/gloo_test_util.h"
#include "executor/runtime/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using ::hap::testing::IsOk;

using gloo_test::FreshDir;
using gloo_test::PeerFailure;
using gloo_test::Rank;
using gloo_test::Value;
using gloo_test::View;
using gloo_test::WithRanks;

// Point-to-point: every rank sends to every other two messages under two
// tags, the second before the first is received (sends do not wait for
// their receives), and receives them in the other order; then a bad peer.
TEST(GlooCommunicatorTest, SendAndReceiveByTag) {
  const int n = 3;
  WithRanks(n, [&](int r, Communicator& c) {
    std::vector<std::vector<float>> out;
    for (int p = 0; p < n; ++p) {
      for (int tag = 0; tag < 2; ++tag) {
        std::vector<float> v(5 + p);
        for (size_t i = 0; i < v.size(); ++i) v[i] = Value(r, i) + 100 * tag + 10 * p;
        out.push_back(std::move(v));
      }
    }
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      for (int tag = 0; tag < 2; ++tag) {
        ASSERT_THAT(c.Send(View(out[2 * p + tag]), p, tag), IsOk());
      }
    }
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      for (int tag = 1; tag >= 0; --tag) {
        std::vector<float> in(5 + r);
        ASSERT_THAT(c.Recv(View(in), p, tag), IsOk());
        for (size_t i = 0; i < in.size(); ++i) {
          EXPECT_EQ(in[i], static_cast<float>(Value(p, i) + 100 * tag + 10 * r))
              << "from " << p << " tag " << tag << " element " << i;
        }
      }
    }
    ASSERT_THAT(c.WaitSends(), IsOk());
    std::vector<float> x(2);
    EXPECT_THAT(c.Send(View(x), r, 0),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not another of")));
    EXPECT_THAT(c.Recv(View(x), n, 0),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peer")));
  });
}

// A receive whose buffer is not the size of the message sent is refused,
// naming both sizes: a larger message used to abort the receiving process
// (Gloo's event loop threw past its thread), a smaller or empty one to
// leave the buffer's tail stale or to wait out the timeout. The message is
// consumed, so the messages after it still arrive in order.
TEST(GlooCommunicatorTest, AReceiveOfTheWrongSizeIsInvalidArgumentNamingBoth) {
  WithRanks(2, [](int r, Communicator& c) {
    std::vector<float> eight(8, 1.0f), two(2, 2.0f), none, three = {3.0f, 4.0f, 5.0f};
    if (r == 0) {
      ASSERT_THAT(c.Send(View(eight), 1, 7), IsOk());
      ASSERT_THAT(c.Send(View(two), 1, 7), IsOk());
      ASSERT_THAT(c.Send(View(none), 1, 7), IsOk());
      ASSERT_THAT(c.Send(View(three), 1, 7), IsOk());
      ASSERT_THAT(c.WaitSends(), IsOk());
      return;
    }
    std::vector<float> four(4, 0.0f);
    EXPECT_THAT(c.Recv(View(four), 0, 7),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("receive from rank 0 under tag 7"), HasSubstr("32 bytes"),
                               HasSubstr("16"))));
    EXPECT_THAT(c.Recv(View(four), 0, 7), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   AllOf(HasSubstr("8 bytes"), HasSubstr("16"))));
    EXPECT_THAT(c.Recv(View(four), 0, 7), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   AllOf(HasSubstr("0 bytes"), HasSubstr("16"))));
    std::vector<float> got(3, 0.0f);
    ASSERT_THAT(c.Recv(View(got), 0, 7), IsOk());
    EXPECT_EQ(got, three);
  });
}

// A small message is complete once sent (WaitSends returns without its
// receiver), so its sender may close its end before the receiver asks for
// it; the receiver still gets it, and the next receive from the closed
// peer fails.
TEST(GlooCommunicatorTest, ASmallMessageOutlivesItsSendersEnd) {
  const std::string dir = FreshDir("outlives");
  auto sync = NewFileStore(FreshDir("outlives_sync"));
  ASSERT_TRUE(sync.ok());
  std::vector<float> first = {1.0f, 2.0f}, last = {3.0f, 4.0f, 5.0f};
  std::thread sender([&] {
    auto store = NewFileStore(dir);
    ASSERT_TRUE(store.ok());
    {
      auto comm = ConnectGloo(Rank(1, 2, absl::Seconds(5)), **store);
      ASSERT_THAT(comm, IsOk());
      EXPECT_THAT((*comm)->Send(View(first), 0, 0), IsOk());
      EXPECT_THAT((*comm)->Send(View(last), 0, 1), IsOk());
      EXPECT_THAT((*comm)->WaitSends(), IsOk());
    }  // closed
    EXPECT_THAT((*sync)->Set("rank1-closed", "1"), IsOk());
  });
  auto store = NewFileStore(dir);
  ASSERT_TRUE(store.ok());
  auto comm = ConnectGloo(Rank(0, 2, absl::Seconds(5)), **store);
  ASSERT_THAT(comm, IsOk());
  std::vector<float> got(2);
  EXPECT_THAT((*comm)->Recv(View(got), 1, 0), IsOk());
  EXPECT_EQ(got, first);
  EXPECT_THAT((*sync)->Get("rank1-closed", absl::Seconds(30)), IsOk());
  got.resize(3);
  EXPECT_THAT((*comm)->Recv(View(got), 1, 1), IsOk());
  EXPECT_EQ(got, last);
  EXPECT_THAT((*comm)->Recv(View(got), 1, 1),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("receive from rank 1")));
  sender.join();
}

// A send its receiver never takes fails WaitSends within the timeout,
// naming the receiver and the tag (it used to say only that it timed out
// waiting for a peer). Rank 1 stays connected without receiving until
// rank 0 has seen the timeout.
TEST(GlooCommunicatorTest, ASendNeverReceivedNamesItsPeerAndTag) {
  auto sync = NewFileStore(FreshDir("unreceived_sync"));
  ASSERT_TRUE(sync.ok());
  WithRanks(
      2,
      [&](int r, Communicator& c) {
        if (r == 1) {
          EXPECT_THAT((*sync)->Get("rank0-done", absl::Seconds(30)), IsOk());
          return;
        }
        std::vector<float> x(4, 1.0f);
        ASSERT_THAT(c.Send(View(x), 1, 4), IsOk());
        EXPECT_THAT(c.WaitSends(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                            HasSubstr("send to rank 1 under tag 4")));
        EXPECT_THAT((*sync)->Set("rank0-done", "1"), IsOk());
      },
      absl::Seconds(1));
}

std::vector<int64_t> Counts(int n) {
  // Uneven, with a zero where there are enough ranks.
  std::vector<int64_t> c;
  for (int r = 0; r < n; ++r) c.push_back(n >= 3 && r == 1 ? 0 : 2 * r + 3);
  return c;
}

template <typename T>
void CheckAllCollectives(int n, CommMethod method, bool check_calls = true) {
  std::vector<int64_t> counts = Counts(n);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<int64_t> off(n, 0);
  for (int r = 1; r < n; ++r) off[r] = off[r - 1] + counts[r - 1];
  WithRanks(
      n,
      [&](int r, Communicator& comm) {
        EXPECT_EQ(comm.rank(), r);
        EXPECT_EQ(comm.size(), n);
        // All-reduce.
        std::vector<T> buf(7);
        for (int i = 0; i < 7; ++i) buf[i] = static_cast<T>(Value(r, i));
        ASSERT_TRUE(comm.AllReduce(View(buf)).ok());
        for (int i = 0; i < 7; ++i) {
          double want = 0;
          for (int q = 0; q < n; ++q) want += Value(q, i);
          EXPECT_DOUBLE_EQ(buf[i], static_cast<T>(want));
        }
        // All-gather: chunk q holds Value(q, .).
        std::vector<T> mine(counts[r]), all(total);
        for (int64_t i = 0; i < counts[r]; ++i) mine[i] = static_cast<T>(Value(r, i));
        ASSERT_TRUE(comm.AllGather(View(mine), View(all), counts, method).ok());
        for (int q = 0; q < n; ++q) {
          for (int64_t i = 0; i < counts[q]; ++i) {
            EXPECT_EQ(all[off[q] + i], static_cast<T>(Value(q, i))) << "chunk " << q;
          }
        }
        // Reduce-scatter: every rank contributes Value(rank, global index).
        std::vector<T> full(total), part(counts[r]);
        for (int64_t i = 0; i < total; ++i) full[i] = static_cast<T>(Value(r, i));
        ASSERT_TRUE(comm.ReduceScatter(View(full), View(part), counts, method).ok());
        for (int64_t i = 0; i < counts[r]; ++i) {
          double want = 0;
          for (int q = 0; q < n; ++q) want += static_cast<T>(Value(q, off[r] + i));
          EXPECT_DOUBLE_EQ(part[i], static_cast<T>(want));
        }
        // All-to-all: rank r sends (r + 1) * (j + 1) elements to rank j, valued
        // by sender and position.
        std::vector<int64_t> send(n), recv(n);
        for (int j = 0; j < n; ++j) {
          send[j] = (r + 1) * (j + 1) % 4;  // includes zeros
          recv[j] = (j + 1) * (r + 1) % 4;
        }
        std::vector<T> out_buf(std::accumulate(send.begin(), send.end(), int64_t{0}));
        std::vector<T> in_buf(std::accumulate(recv.begin(), recv.end(), int64_t{0}));
        int64_t at = 0;
        for (int j = 0; j < n; ++j) {
          for (int64_t i = 0; i < send[j]; ++i)
            out_buf[at++] = static_cast<T>(Value(r, 10 * j + i));
        }
        ASSERT_TRUE(comm.AllToAll(View(out_buf), send, View(in_buf), recv).ok());
        at = 0;
        for (int j = 0; j < n; ++j) {
          for (int64_t i = 0; i < recv[j]; ++i) {
            EXPECT_EQ(in_buf[at++], static_cast<T>(Value(j, 10 * r + i))) << "from " << j;
          }
        }
        // Broadcast and reduce to the last rank.
        std::vector<T> b(5, static_cast<T>(r == n - 1 ? 42 : -1));
        ASSERT_TRUE(comm.Broadcast(View(b), n - 1).ok());
        for (T x : b) EXPECT_EQ(x, static_cast<T>(42));
        std::vector<T> red_in(3, static_cast<T>(r + 1)), red_out(3, 0);
        ASSERT_TRUE(comm.Reduce(View(red_in), View(red_out), n - 1).ok());
        if (r == n - 1) {
          for (T x : red_out) EXPECT_EQ(x, static_cast<T>(n * (n + 1) / 2));
        }
        ASSERT_TRUE(comm.Barrier().ok());
      },
      absl::Seconds(20), check_calls);
}

class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(CollectivesTest, MatchTheSingleProcessResult) {
  auto [n, grouped, f64] = GetParam();
  CommMethod m = grouped ? CommMethod::kGrouped : CommMethod::kPadded;
  if (f64) {
    CheckAllCollectives<double>(n, m);
  } else {
    CheckAllCollectives<float>(n, m);
  }
}

// Without the agreement on the call (GlooOptions::check_calls false, as
// the executors run after comparing their programs), every collective and
// the barrier give the same results.
TEST(GlooCommunicatorTest, CollectivesMatchTheSingleProcessResultWithoutTheCallCheck) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(n);
    CheckAllCollectives<float>(n, CommMethod::kPadded, /*check_calls=*/false);
    CheckAllCollectives<double>(n, CommMethod::kGrouped, /*check_calls=*/false);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsMethodsTypes, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool(),
                                            ::testing::Bool()));

// bf16 sums (CollectiveCall.wire_dtype): each partial sum is computed in
// float32 and rounded to bf16. With 2 ranks there is one addition, so the
// result is exactly bf16(a + b); with 3 each element is within two bf16
// roundings of the exact sum, and every rank gets the same bits.
TEST(GlooCommunicatorTest, Bf16AllReduceAndReduceScatterRoundEachSum) {
  for (int n : {2, 3}) {
    const int64_t len = 37;
    std::vector<std::vector<uint16_t>> results(n);
    std::vector<std::vector<uint16_t>> scattered(n);
    auto input = [](int r, int64_t i) {
      // Values whose sums need more than bf16's 8 significant bits.
      return Bf16Bits(static_cast<float>(1.0 + 0.0078125 * (i % 7) + 0.37 * r + 1e-3 * i));
    };
    const std::vector<int64_t> counts = Counts(n);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    WithRanks(n, [&](int r, Communicator& comm) {
      std::vector<uint16_t> buf(len);
      for (int64_t i = 0; i < len; ++i) buf[i] = input(r, i);
      ASSERT_THAT(comm.AllReduce(TensorView{DType::kBFloat16, {len}, buf.data()}), IsOk());
      results[r] = buf;
      std::vector<uint16_t> in(total), out(counts[r]);
      for (int64_t i = 0; i < total; ++i) in[i] = input(r, i);
      ASSERT_THAT(comm.ReduceScatter(TensorView{DType::kBFloat16, {total}, in.data()},
                                     TensorView{DType::kBFloat16, {counts[r]}, out.data()}, counts,
                                     CommMethod::kPadded),
                  IsOk());
      scattered[r] = out;
    });
    for (int64_t i = 0; i < len; ++i) {
      double exact = 0;
      for (int r = 0; r < n; ++r) exact += Bf16ToFloat(input(r, i));
      const float got = Bf16ToFloat(results[0][i]);
      for (int r = 1; r < n; ++r) EXPECT_EQ(results[r][i], results[0][i]) << "rank " << r;
      if (n == 2) {
        EXPECT_EQ(results[0][i], Bf16Bits(static_cast<float>(exact))) << "element " << i;
      } else {
        EXPECT_NEAR(got, exact, 2 * std::ldexp(std::abs(exact), -8)) << "element " << i;
      }
      // Not float32's sum: the result is a bf16 value (its low bits zero).
      EXPECT_EQ(Bf16Bits(got), results[0][i]);
    }
    int64_t at = 0;
    for (int r = 0; r < n; ++r) {
      for (int64_t j = 0; j < counts[r]; ++j) {
        double exact = 0;
        for (int q = 0; q < n; ++q) exact += Bf16ToFloat(input(q, at + j));
        EXPECT_NEAR(Bf16ToFloat(scattered[r][j]), exact, 2 * std::ldexp(std::abs(exact), -8))
            << "rank " << r << " element " << j;
      }
      at += counts[r];
    }
  }
}

TEST(GlooCommunicatorTest, InconsistentSizesAreInvalidArgument) {
  WithRanks(2, [](int r, Communicator& comm) {
    std::vector<float> in(3), out(5);
    std::vector<int64_t> counts = {3, 3};  // sums to 6, not 5
    EXPECT_THAT(comm.AllGather(View(in), View(out), counts, CommMethod::kPadded),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sum to 6")));
    std::vector<int64_t> three = {1, 2, 2};
    EXPECT_THAT(comm.ReduceScatter(View(out), View(in), three, CommMethod::kGrouped),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 counts for 2 ranks")));
    std::vector<int64_t> ids(2);
    TensorView iv{DType::kInt64, {2}, ids.data()};
    EXPECT_THAT(comm.AllReduce(iv), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("only float32, float64 and bfloat16")));
    std::vector<double> wide(6);
    EXPECT_THAT(
        comm.AllGather(View(in), View(wide), counts, CommMethod::kGrouped),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtypes differ (f32 and f64)")));
    EXPECT_THAT(comm.Reduce(View(in), View(out), 5),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("root 5 is out of range")));
    // Bad arguments are caught before any traffic: the group still works.
    std::vector<float> x(2, static_cast<float>(r));
    EXPECT_TRUE(comm.AllReduce(View(x)).ok());
    EXPECT_EQ(x[0], 1.0f);
  });
}

// Calls that differ across ranks are refused by every rank before any of
// the collective's traffic, with the same message naming both calls, and
// the group goes on. (Gloo itself ends the process when a message is
// longer than the receive posted for it: the first all-reduce here did.)
TEST(GlooCommunicatorTest, AnAllReduceOfOtherSizesIsInvalidArgumentOnBothRanks) {
  WithRanks(2, [](int r, Communicator& comm) {
    std::vector<float> x(r == 0 ? 4 : 8, 1.0f);
    EXPECT_THAT(comm.AllReduce(View(x)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("all-reduce: the ranks' calls differ"),
                               HasSubstr("rank 0 calls all-reduce of 4 f32 elements"),
                               HasSubstr("rank 1 calls all-reduce of 8 f32 elements"))));
    // Nothing empty is skipped: no elements against some is refused too.
    std::vector<float> some(r == 0 ? 0 : 3, 1.0f);
    EXPECT_THAT(comm.AllReduce(View(some)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls all-reduce of 0 f32 elements"),
                               HasSubstr("rank 1 calls all-reduce of 3 f32 elements"))));
    // Still in step and usable.
    std::vector<float> y(3, static_cast<float>(r + 1));
    ASSERT_THAT(comm.AllReduce(View(y)), IsOk());
    EXPECT_EQ(y[0], 3.0f);
  });
}

// Three ranks, the last of another dtype: all three refuse it, naming it.
TEST(GlooCommunicatorTest, AnAllReduceOfAnotherDTypeIsInvalidArgumentOnEveryRank) {
  WithRanks(3, [](int r, Communicator& comm) {
    std::vector<float> f(5, 1.0f);
    std::vector<double> d(5, 1.0);
    EXPECT_THAT(comm.AllReduce(r == 2 ? View(d) : View(f)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls all-reduce of 5 f32 elements"),
                               HasSubstr("rank 2 calls all-reduce of 5 f64 elements"))));
    ASSERT_THAT(comm.Barrier(), IsOk());
  });
}

// A call refused by its own rank's checks (an all-reduce of int64, an
// all-gather whose chunks do not sum to its output, a root out of range)
// ends the peers' call InvalidArgument naming that rank: they waited for
// it until the timeout (DeadlineExceeded, the group unusable after). The
// group stays in step and usable.
TEST(GlooCommunicatorTest, ACallRefusedByItsOwnRankIsInvalidArgumentOnThePeers) {
  WithRanks(
      2,
      [](int r, Communicator& comm) {
        std::vector<float> f(4, 1.0f);
        std::vector<int64_t> i(4, 1);
        const TensorView ints{DType::kInt64, {4}, i.data()};
        const absl::Status sum = comm.AllReduce(r == 1 ? ints : View(f));
        if (r == 1) {
          EXPECT_THAT(sum, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("all-reduce")));
        } else {
          EXPECT_THAT(sum, StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("all-reduce: rank 1 refused its own call")));
        }
        std::vector<float> part(2), whole(r == 0 ? 5 : 4);
        const std::vector<int64_t> counts{2, 3};
        EXPECT_THAT(comm.AllGather(View(part), View(whole), counts, CommMethod::kPadded),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr(r == 0 ? "rank 1 refused its own call" : "all-gather")));
        std::vector<float> b(3, 1.0f);
        EXPECT_THAT(comm.Broadcast(View(b), r == 0 ? 7 : 0),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr(r == 1 ? "rank 0 refused its own call" : "broadcast")));
        std::vector<float> y(3, static_cast<float>(r + 1));
        ASSERT_THAT(comm.AllReduce(View(y)), IsOk());
        EXPECT_EQ(y[0], 3.0f);
      },
      absl::Seconds(20));
}

TEST(GlooCommunicatorTest, CollectivesWhoseCallsDifferAreInvalidArgumentOnBothRanks) {
  WithRanks(2, [](int r, Communicator& comm) {
    // All-gather chunks (each rank's own arguments consistent).
    const std::vector<int64_t> counts =
        r == 0 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{3, 2};
    std::vector<float> part(2), whole(5);
    EXPECT_THAT(comm.AllGather(View(part), View(whole), counts, CommMethod::kPadded),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls all-gather (padded) of f32 chunks [2,3]"),
                               HasSubstr("rank 1 calls all-gather (padded) of f32 chunks [3,2]"))));
    // The same chunks by another method.
    const std::vector<int64_t> even = {2, 2};
    std::vector<float> four(4);
    EXPECT_THAT(comm.ReduceScatter(View(four), View(part), even,
                                   r == 0 ? CommMethod::kPadded : CommMethod::kGrouped),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls reduce-scatter (padded)"),
                               HasSubstr("rank 1 calls reduce-scatter (grouped)"))));
    // Broadcast and reduce: sizes and roots.
    std::vector<float> b(r == 0 ? 6 : 7);
    EXPECT_THAT(comm.Broadcast(View(b), 0),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls broadcast of 6 f32 elements from rank 0"),
                               HasSubstr("rank 1 calls broadcast of 7 f32 elements from rank 0"))));
    std::vector<float> in(3), out(3);
    EXPECT_THAT(comm.Reduce(View(in), View(out), r),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls reduce of 3 f32 elements to rank 0"),
                               HasSubstr("rank 1 calls reduce of 3 f32 elements to rank 1"))));
    // All-to-all: rank 1 sends 3 elements to rank 0, which expects 2.
    const std::vector<int64_t> send =
        r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 1};
    const std::vector<int64_t> recv =
        r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
    std::vector<float> s(r == 0 ? 3 : 4), t(3);
    EXPECT_THAT(comm.AllToAll(View(s), send, View(t), recv),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("rank 1 sends 3 f32 elements to rank 0, which expects 2 "
                                   "from it")));
    // Different collectives.
    std::vector<float> x(2);
    EXPECT_THAT(r == 0 ? comm.AllReduce(View(x)) : comm.Barrier(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("rank 0 calls all-reduce of 2 f32 elements"),
                               HasSubstr("rank 1 calls barrier"))));
    // Still in step: a matched call of each works.
    std::vector<float> y(2, static_cast<float>(r + 1));
    ASSERT_THAT(comm.AllReduce(View(y)), IsOk());
    EXPECT_EQ(y[1], 3.0f);
    ASSERT_THAT(comm.AllGather(View(part), View(four), even, CommMethod::kPadded), IsOk());
  });
}

TEST(GlooCommunicatorTest, APeerThatSkipsACollectiveIsDeadlineExceeded) {
  // Rank 1 stays connected (its sockets open) without joining the
  // all-reduce, until rank 0 has seen the timeout.
  auto sync = NewFileStore(FreshDir("skips_sync"));
  ASSERT_TRUE(sync.ok());
  WithRanks(
      2,
      [&](int r, Communicator& comm) {
        if (r == 1) {
          EXPECT_TRUE((*sync)->Get("rank0-done", absl::Seconds(30)).ok());
          return;
        }
        std::vector<double> x(4, 1.0);
        // After the group's 1 s, as Gloo says it waited (this was a
        // wall-clock limit: failed within 6 s).
        EXPECT_THAT(comm.AllReduce(View(x)),
                    StatusIs(absl::StatusCode::kDeadlineExceeded,
                             AllOf(HasSubstr("all-reduce: timed out waiting for a peer"),
                                   HasSubstr("Timed out waiting 1000ms"))));
        // Unusable from now on, even for a call with nothing to send.
        std::vector<double> none;
        EXPECT_THAT(comm.AllReduce(View(none)),
                    StatusIs(absl::StatusCode::kFailedPrecondition,
                             AllOf(HasSubstr("failed earlier"), HasSubstr("timed out"))));
        EXPECT_THAT(comm.Broadcast(View(none), 0),
                    StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("broadcast")));
        EXPECT_TRUE((*sync)->Set("rank0-done", "1").ok());
      },
      absl::Seconds(1));
}

}  // namespace
}  // namespace hap::executor
