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
#include "executor/runtime/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

using ::hap::testing::IsOk;

std::string FreshDir(const std::string& name) {
  static int counter = 0;
  std::string dir = absl::StrCat(::testing::TempDir(), "/", name, "_", getpid(),
                                 "_", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

GlooOptions Rank(int rank, int size, absl::Duration timeout) {
  GlooOptions o;
  o.rank = rank;
  o.size = size;
  o.timeout = timeout;
  return o;
}

// Runs fn(rank, comm) on n threads, each with its own Gloo communicator.
void WithRanks(int n, const std::function<void(int, Communicator&)>& fn,
               absl::Duration timeout = absl::Seconds(20), bool check_calls = true) {
  std::string dir = FreshDir("ranks");
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto store = NewFileStore(dir);
      ASSERT_TRUE(store.ok()) << store.status();
      GlooOptions o = Rank(r, n, timeout);
      o.check_calls = check_calls;
      auto comm = ConnectGloo(o, **store);
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(r, **comm);
    });
  }
  for (auto& t : threads) t.join();
}

// Rank r's value at element i: distinct per rank and element.
double Value(int r, int64_t i) {
  return 1000.0 * (r + 1) + static_cast<double>(i) * 0.5;
}

template <typename T>
TensorView View(std::vector<T>& v) {
  return TensorView{
      std::is_same<T, double>::value ? DType::kFloat64 : DType::kFloat32,
      {static_cast<int64_t>(v.size())},
      v.empty() ? nullptr : v.data()};
}

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
    EXPECT_THAT(c.Send(View(x), r, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("is not another of")));
    EXPECT_THAT(c.Recv(View(x), n, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peer")));
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
  const int64_t total =
      std::accumulate(counts.begin(), counts.end(), int64_t{0});
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

class CollectivesTest
    : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

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
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Bool(),
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
                                     TensorView{DType::kBFloat16, {counts[r]}, out.data()},
                                     counts, CommMethod::kPadded),
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
    EXPECT_THAT(
        comm.AllGather(View(in), View(out), counts, CommMethod::kPadded),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sum to 6")));
    std::vector<int64_t> three = {1, 2, 2};
    EXPECT_THAT(
        comm.ReduceScatter(View(out), View(in), three, CommMethod::kGrouped),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("3 counts for 2 ranks")));
    std::vector<int64_t> ids(2);
    TensorView iv{DType::kInt64, {2}, ids.data()};
    EXPECT_THAT(comm.AllReduce(iv),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("only float32, float64 and bfloat16")));
    std::vector<double> wide(6);
    EXPECT_THAT(
        comm.AllGather(View(in), View(wide), counts, CommMethod::kGrouped),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("dtypes differ (f32 and f64)")));
    EXPECT_THAT(comm.Reduce(View(in), View(out), 5),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("root 5 is out of range")));
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

// A collective that a broken group must fail: Unavailable (the connection
// closed) or DeadlineExceeded (nothing arrived in time), naming itself.
::testing::Matcher<absl::Status> PeerFailure(const std::string& what) {
  return AnyOf(StatusIs(absl::StatusCode::kUnavailable, HasSubstr(what)),
               StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(what)));
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
                             AllOf(HasSubstr("failed earlier"),
                                   HasSubstr("timed out"))));
        EXPECT_THAT(comm.Broadcast(View(none), 0),
                    StatusIs(absl::StatusCode::kFailedPrecondition,
                             HasSubstr("broadcast")));
        EXPECT_TRUE((*sync)->Set("rank0-done", "1").ok());
      },
      absl::Seconds(1));
}

// Forks a rank as a real process; its exit code is its verdict.
pid_t ForkRank(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) _exit(body());
  return pid;
}

TEST(GlooCommunicatorTest, APeerThatDiesFailsTheSurvivorsWithoutHanging) {
  const std::string dir = FreshDir("dies");
  const absl::Duration timeout = absl::Seconds(2);
  // Rank 2 connects, reports it, and waits to be SIGKILLed.
  pid_t victim = ForkRank([&] {
    auto store = NewFileStore(dir);
    if (!store.ok()) return 10;
    auto comm = ConnectGloo(Rank(2, 3, timeout), **store);
    if (!comm.ok()) {
      std::fprintf(stderr, "rank 2: %s\n", comm.status().ToString().c_str());
      return 10;
    }
    (void)(*store)->Set("test/rank2-connected", "1");
    (void)(*store)->Get("test/never", absl::Seconds(60));
    return 11;
  });
  ASSERT_GT(victim, 0);
  // Rank 1 survives: once rank 2 is dead its all-reduce must fail promptly.
  pid_t survivor = ForkRank([&] {
    auto store = NewFileStore(dir);
    if (!store.ok()) return 10;
    auto comm = ConnectGloo(Rank(1, 3, timeout), **store);
    if (!comm.ok()) {
      std::fprintf(stderr, "rank 1: %s\n", comm.status().ToString().c_str());
      return 10;
    }
    if (!(*store)->Get("test/rank2-dead", absl::Seconds(30)).ok()) return 11;
    std::vector<float> x(1 << 16, 1.0f);
    absl::Status s = (*comm)->AllReduce(View(x));
    if (!::testing::Matches(PeerFailure("all-reduce"))(s)) return 12;
    if ((*comm)->Barrier().code() != absl::StatusCode::kFailedPrecondition)
      return 14;
    return 0;
  });
  ASSERT_GT(survivor, 0);

  auto store = NewFileStore(dir);
  ASSERT_TRUE(store.ok());
  auto comm = ConnectGloo(Rank(0, 3, timeout), **store);
  ASSERT_TRUE(comm.ok()) << comm.status();
  ASSERT_TRUE((*store)->Get("test/rank2-connected", absl::Seconds(30)).ok());
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(victim, &status, 0), victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ASSERT_TRUE((*store)->Set("test/rank2-dead", "1").ok());

  // Failed (a hang fails the test by its timeout); that the group's
  // timeout is what a silent peer is waited for is
  // APeerThatSkipsACollectiveIsDeadlineExceeded's. (Both ranks had a
  // wall-clock limit here: the timeout and 4 s.)
  std::vector<float> x(1 << 16, 1.0f);
  EXPECT_THAT((*comm)->AllReduce(View(x)), PeerFailure("all-reduce"));
  // Unusable from now on, naming the first error.
  EXPECT_THAT((*comm)->Barrier(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("barrier"),
                             HasSubstr("failed earlier: all-reduce"))));
  ASSERT_EQ(waitpid(survivor, &status, 0), survivor);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the surviving rank 1 failed its checks";
}

TEST(GlooCommunicatorTest, ARankThatNeverShowsUpIsDeadlineExceeded) {
  auto store = NewFileStore(FreshDir("missing"));
  ASSERT_TRUE(store.ok());
  EXPECT_THAT(ConnectGloo(Rank(0, 2, absl::Seconds(1)), **store),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("did not appear"),
                             HasSubstr("rank 1 never published its address"))));
  EXPECT_THAT(
      ConnectGloo(Rank(2, 2, absl::Seconds(1)), **store),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
}

// A store that cannot be reached: every call is DeadlineExceeded, as the
// planner's store says when the planner does not answer.
class UnreachableStore : public RendezvousStore {
 public:
  absl::Status Set(const std::string& key, const std::string&) override {
    return absl::DeadlineExceededError(absl::StrCat("StoreSet '", key, "': no answer"));
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration) override {
    ++gets;
    return absl::DeadlineExceededError(absl::StrCat("StoreGet '", key, "': no answer"));
  }
  int gets = 0;
};

// A store that does not take this rank's address is the store's failure,
// not the peers': the error is the store's, and no peer is said to be
// missing (each such look-up took the store's whole timeout too).
TEST(GlooCommunicatorTest, AStoreThatCannotPublishIsNotBlamedOnThePeers) {
  UnreachableStore store;
  EXPECT_THAT(ConnectGloo(Rank(0, 3, absl::Seconds(1)), store),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("StoreSet 'hap/0': no answer"),
                             ::testing::Not(HasSubstr("never published")))));
  EXPECT_EQ(store.gets, 0);
}

// A file store whose Set of a try's abort key fails.
class NoAbortStore : public RendezvousStore {
 public:
  explicit NoAbortStore(std::unique_ptr<RendezvousStore> inner) : inner_(std::move(inner)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    if (absl::EndsWith(key, "/abort")) return absl::UnavailableError("the disk is full");
    return inner_->Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return inner_->Get(key, timeout);
  }

 private:
  std::unique_ptr<RendezvousStore> inner_;
};

// A try that breaks tells the other ranks through the store; when that
// fails too, the error says so (they will wait out their timeout), rather
// than dropping the store's error.
TEST(GlooCommunicatorTest, AnAbortTheStoreRefusesIsReported) {
  auto files = NewFileStore(FreshDir("no_abort"));
  ASSERT_TRUE(files.ok());
  RendezvousStore& shared = **files;
  // Rank 1 publishes no address at all: rank 0's try breaks (Internal).
  ASSERT_THAT(shared.Set(ConnectAttemptPrefix("hap", 0) + "/1", ""), IsOk());
  NoAbortStore store(std::move(*files));
  GlooOptions o = Rank(0, 2, absl::Seconds(5));
  o.connect_attempts = 1;
  EXPECT_THAT(ConnectGloo(o, store),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("rank 1 published 0 bytes of addresses"),
                             HasSubstr("the other ranks could not be told to give this try up"),
                             HasSubstr("the disk is full"))));
}

// A try that fails on a lost connection is still a lost connection when
// ConnectGloo gives up (the launcher tells a rank that lost a peer from
// one that failed by it): the mark used to be dropped with the message's
// " (after N attempts)". Rank 1's published address is a port of this
// machine that refuses connections, below rank 0's so that rank 0 dials.
// A socket bound to a loopback port whose raw (network order) value is
// below 256, so that a rank's pair (listening on an ephemeral port, above
// it) is the side that dials it; listening when `listening`, else
// connections to it are refused. -1 when no such port is free.
int BindLowPort(bool listening, uint16_t* raw_port) {
  for (int high = 4; high < 256; ++high) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(high << 8));
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        (!listening || listen(fd, 4) == 0)) {
      *raw_port = a.sin_port;
      return fd;
    }
    close(fd);
  }
  return -1;
}

// `blob` (a rank's published pair addresses) with its first address's
// port replaced by `raw_port` (network order).
std::string WithFirstPort(std::string blob, uint16_t raw_port) {
  sockaddr_in addr{};
  std::memcpy(&addr, blob.data(), sizeof(addr));
  addr.sin_port = raw_port;
  std::memcpy(blob.data(), &addr, sizeof(addr));
  return blob;
}

TEST(GlooCommunicatorTest, ALostConnectionIsMarkedAfterTheLastAttempt) {
  auto store = NewFileStore(FreshDir("refused"));
  ASSERT_TRUE(store.ok());
  uint16_t raw_port = 0;
  const int refusing = BindLowPort(/*listening=*/false, &raw_port);
  ASSERT_GE(refusing, 0) << "no free port";
  std::thread fake_rank1([&] {
    auto blob = (*store)->Get(ConnectAttemptPrefix("hap", 0) + "/0", absl::Seconds(20));
    ASSERT_TRUE(blob.ok()) << blob.status();
    sockaddr_in addr{};
    std::memcpy(&addr, blob->data(), sizeof(addr));
    ASSERT_LT(raw_port, addr.sin_port) << "rank 0 would not dial";
    ASSERT_THAT(
        (*store)->Set(ConnectAttemptPrefix("hap", 0) + "/1", WithFirstPort(*blob, raw_port)),
        IsOk());
  });
  GlooOptions o = Rank(0, 2, absl::Seconds(5));
  o.connect_attempts = 1;
  const absl::Status s = ConnectGloo(o, **store).status();
  fake_rank1.join();
  close(refusing);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("(after 1 attempts)")));
  EXPECT_TRUE(IsLostPeer(s)) << s;
}

// A try given up while a pair is connected that its peer has not accepted
// yet ends that connection plainly (FIN), not with a reset. Rank 0 of 3
// dials rank 1 (a listening socket here that accepts nothing until the
// end), then waits for rank 2, which never comes, until the try's abort
// key. Its pairs were closed with SO_LINGER 0: the kernel reset the
// connection, and a peer's Gloo that accepted it afterwards failed
// getpeername (ENOTCONN) on its event-loop thread, which ended the peer's
// process (seen once in executor_server_test: a stopped executor's peer
// aborted). Accepted now, the connection has a peer name and reads as
// closed (0), not reset.
TEST(GlooCommunicatorTest, AnAbandonedTryClosesItsConnectionsWithoutAReset) {
  auto store = NewFileStore(FreshDir("no_reset"));
  ASSERT_TRUE(store.ok());
  uint16_t raw_port = 0;
  const int rank1 = BindLowPort(/*listening=*/true, &raw_port);
  ASSERT_GE(rank1, 0) << "no free port";
  std::thread fake_rank1([&] {
    auto blob = (*store)->Get(ConnectAttemptPrefix("hap", 0) + "/0", absl::Seconds(20));
    ASSERT_TRUE(blob.ok()) << blob.status();
    // Rank 0's own two addresses, the first (for rank 0) at the socket here.
    ASSERT_THAT(
        (*store)->Set(ConnectAttemptPrefix("hap", 0) + "/1", WithFirstPort(*blob, raw_port)),
        IsOk());
    pollfd dialled{rank1, POLLIN, 0};
    ASSERT_EQ(poll(&dialled, 1, 20'000), 1) << "rank 0 never dialled";
    ASSERT_THAT((*store)->Set(ConnectAttemptPrefix("hap", 0) + "/abort", "rank 2 is gone"), IsOk());
  });
  GlooOptions o = Rank(0, 3, absl::Seconds(30));
  o.connect_attempts = 1;
  const absl::Status s = ConnectGloo(o, **store).status();
  fake_rank1.join();
  EXPECT_THAT(
      s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("another rank's connection broke")));
  const int accepted = accept(rank1, nullptr, nullptr);
  ASSERT_GE(accepted, 0) << std::strerror(errno);
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  EXPECT_EQ(getpeername(accepted, reinterpret_cast<sockaddr*>(&peer), &len), 0)
      << "the connection was reset: " << std::strerror(errno);
  char byte = 0;
  EXPECT_EQ(recv(accepted, &byte, 1, 0), 0) << std::strerror(errno);
  close(accepted);
  close(rank1);
}

TEST(GlooCommunicatorTest, TheMissingRanksAreNamed) {
  // Ranks 0 and 1 of 4 show up; 2 and 3 never do.
  auto store = NewFileStore(FreshDir("missing_two"));
  ASSERT_TRUE(store.ok());
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      results[r] = ConnectGloo(Rank(r, 4, absl::Seconds(1)), **store).status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) {
    EXPECT_THAT(
        s, StatusIs(absl::StatusCode::kDeadlineExceeded,
                    HasSubstr("ranks 2, 3 never published their address")));
  }
}

// Connects to rank 0's published listening address the way a stray
// client would (a probe, or a gRPC client retrying a port its server gave
// up: seen in CI) and hangs up, before rank 1 has shown up.
void StrayConnectToRankZero(RendezvousStore& store, const std::string& prefix) {
  auto blob = store.Get(ConnectAttemptPrefix(prefix, 0) + "/0", absl::Seconds(20));
  ASSERT_TRUE(blob.ok()) << blob.status();
  ASSERT_GE(blob->size(), sizeof(sockaddr_in));
  sockaddr_in addr{};
  std::memcpy(&addr, blob->data(), sizeof(addr));
  ASSERT_EQ(addr.sin_family, AF_INET);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  close(fd);
}

// Rank 1 of 2 that published its address and died: rank 0's addresses,
// once rank 0 published them, at a port above rank 0's where nobody
// listens, so that rank 0 is the side that waits, for a connection that
// never comes.
void PublishADeadRankOne(RendezvousStore& store) {
  auto blob = store.Get(ConnectAttemptPrefix("hap", 0) + "/0", absl::Seconds(20));
  ASSERT_TRUE(blob.ok()) << blob.status();
  const std::string dead = AtAPortNobodyListensOn(*blob);
  ASSERT_FALSE(dead.empty());
  ASSERT_THAT(store.Set(ConnectAttemptPrefix("hap", 0) + "/1", dead), IsOk());
}

// Rank 1 publishes an address (rank 0's own, on a port above it, so that
// rank 0 is the side that waits) and never connects, as a rank that died
// after publishing. Gloo waits five times the timeout for a connection;
// rank 0 gives up within its timeout, naming the rank it waited for (it
// used to say only that a peer timed out, naming none, since every rank
// had published).
TEST(GlooCommunicatorTest, ARankThatPublishesButNeverConnectsIsNamed) {
  auto store = NewFileStore(FreshDir("never_connects"));
  ASSERT_TRUE(store.ok());
  std::thread fake_rank1([&] { PublishADeadRankOne(**store); });
  EXPECT_THAT(ConnectGloo(Rank(0, 2, absl::Seconds(1)), **store),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("rank 1 published its address but did not connect within 1s")));
  fake_rank1.join();
}

// A store whose user gives up once `give_up` is notified; everything else
// is the file store's.
class GivingUpStore : public RendezvousStore {
 public:
  GivingUpStore(RendezvousStore& store, absl::Notification& give_up)
      : store_(store), give_up_(give_up) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return store_.Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return store_.Get(key, timeout);
  }
  bool Cancelled() override { return give_up_.HasBeenNotified(); }

 private:
  RendezvousStore& store_;
  absl::Notification& give_up_;
};

// As above, with a timeout of an hour: rank 0 waits in Gloo's connect for
// rank 1, which never comes, and its store's user gives up (a stopped
// training run). The connect ends Cancelled, naming the rank it waited
// for, and tells the others through the abort key. It waited out five
// times the timeout (the wait for a connection never asks the store).
TEST(GlooCommunicatorTest, AConnectWaitingForAPeerEndsWhenTheStoresUserGivesUp) {
  auto files = NewFileStore(FreshDir("gives_up"));
  ASSERT_TRUE(files.ok());
  absl::Notification give_up;
  GivingUpStore store(**files, give_up);
  std::thread fake_rank1([&] {
    PublishADeadRankOne(**files);
    give_up.Notify();
  });
  EXPECT_THAT(ConnectGloo(Rank(0, 2, absl::Hours(1)), store),
              StatusIs(absl::StatusCode::kCancelled,
                       HasSubstr("given up while waiting for rank 1 to connect")));
  fake_rank1.join();
  EXPECT_THAT((*files)->Get(ConnectAttemptPrefix("hap", 0) + "/abort", absl::ZeroDuration()),
              IsOk());
}

// A file store whose user gives up just as rank 1's address is read: the
// read returns it once the abort watcher has seen the store given up.
class GivesUpAsRankOnesAddressIsReadStore : public RendezvousStore {
 public:
  explicit GivesUpAsRankOnesAddressIsReadStore(RendezvousStore& store) : store_(store) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return store_.Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    absl::StatusOr<std::string> v = store_.Get(key, timeout);
    if (v.ok() && key == ConnectAttemptPrefix("hap", 0) + "/1" && !give_up_.HasBeenNotified()) {
      give_up_.Notify();
      EXPECT_TRUE(seen_.WaitForNotificationWithTimeout(absl::Seconds(20)));
    }
    return v;
  }
  bool Cancelled() override {
    if (!give_up_.HasBeenNotified()) return false;
    if (!seen_.HasBeenNotified()) seen_.Notify();
    return true;
  }

 private:
  RendezvousStore& store_;
  absl::Notification give_up_, seen_;
};

// The store's user gives up while no pair is connecting (rank 0 has just
// read rank 1's address, rank 1 never dials). The watcher then closed no
// pair and stopped watching, and rank 0 went on to wait in Gloo's connect
// for rank 1, as the listening side, for five times the timeout (so did a
// try whose deadline came between two pairs). It now connects no pair of
// a try given up.
TEST(GlooCommunicatorTest, ATryGivenUpBetweenTwoPairsConnectsNoMore) {
  auto files = NewFileStore(FreshDir("gives_up_between"));
  ASSERT_TRUE(files.ok());
  GivesUpAsRankOnesAddressIsReadStore store(**files);
  std::thread fake_rank1([&] { PublishADeadRankOne(**files); });
  const absl::Duration timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  EXPECT_THAT(ConnectGloo(Rank(0, 2, timeout), store),
              StatusIs(absl::StatusCode::kCancelled,
                       HasSubstr("given up while waiting for rank 1 to connect")));
  EXPECT_LT(absl::Now() - start, timeout);
  fake_rank1.join();
}

// Rank 0 publishes its address, a stray connection takes it, then rank 1
// shows up. Which side of the pair listens depends on the ports, so a
// stray breaks the first try in some rounds only; returns per round
// whether both ranks connected (and all-reduced correctly) and whether a
// second try was needed.
struct StrayRound {
  absl::Status rank0, rank1;
  bool retried = false;
};
StrayRound RunStrayRound(int attempts, absl::Duration timeout) {
  StrayRound round;
  const std::string dir = FreshDir("stray");
  auto store = NewFileStore(dir);
  if (!store.ok()) {
    round.rank0 = store.status();
    return round;
  }
  auto rank = [&](int r, absl::Status* result) {
    auto own = NewFileStore(dir);
    GlooOptions o = Rank(r, 2, timeout);
    o.connect_attempts = attempts;
    auto comm = ConnectGloo(o, **own);
    if (!comm.ok()) {
      *result = comm.status();
      return;
    }
    std::vector<float> v = {1.0f + r, 10.0f * (r + 1)};
    *result = (*comm)->AllReduce(View(v));
    if (result->ok() && v != std::vector<float>{3.0f, 30.0f}) {
      *result = absl::InternalError("wrong all-reduce result");
    }
  };
  std::thread r0(rank, 0, &round.rank0);
  StrayConnectToRankZero(**store, "hap");
  std::thread r1(rank, 1, &round.rank1);
  r0.join();
  r1.join();
  round.retried =
      (*store)->Get(ConnectAttemptPrefix("hap", 1) + "/0", absl::ZeroDuration()).ok();
  return round;
}

TEST(GlooCommunicatorTest, AStrayConnectionBreaksOneTryAndTheNextConnects) {
  // A timeout no round may wait out: a rank that did would hang the test,
  // which then fails by its own timeout. (This was 30 s, with a wall-clock
  // limit of 15 s on each round.)
  const absl::Duration timeout = absl::Hours(1);
  // One try only: the stray breaks it in some rounds, and both ranks say
  // so promptly (the waiting side is told through the abort key rather
  // than waiting out the timeout).
  int broken = 0;
  for (int i = 0; i < 20 && broken == 0; ++i) {
    StrayRound round = RunStrayRound(1, timeout);
    if (round.rank0.ok() && round.rank1.ok()) continue;
    ++broken;
    for (const absl::Status& s : {round.rank0, round.rank1}) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable,
                              HasSubstr("connecting rank")));
    }
  }
  EXPECT_EQ(broken, 1) << "a stray connection never broke a single try in 20 rounds";
  // Three tries (the default): every round connects and sums correctly,
  // and some needed the second try.
  int retried = 0;
  for (int i = 0; i < 20; ++i) {
    StrayRound round = RunStrayRound(3, timeout);
    ASSERT_THAT(round.rank0, IsOk()) << "round " << i;
    ASSERT_THAT(round.rank1, IsOk()) << "round " << i;
    if (round.retried) ++retried;
  }
  EXPECT_GE(retried, 1) << "no round needed a second try";
}

// A host to listen on that does not resolve, or that is no address of this
// machine, is a bad option named as such, found before any connection is
// tried: the name that did not resolve used to reach Gloo, which took any
// resolver error but -1 for success and read an unset address list, and
// the foreign address was a broken connection (Internal), tried three times.
TEST(GlooCommunicatorTest, AHostToListenOnThatIsNotHereIsInvalidArgument) {
  auto store = NewFileStore(FreshDir("bad_host"));
  ASSERT_TRUE(store.ok());
  for (const std::string host : {"no-such-host.invalid", "192.0.2.1"}) {
    GlooOptions o = Rank(0, 2, absl::Seconds(5));
    o.hostname = host;
    EXPECT_THAT(ConnectGloo(o, **store),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("host to listen on '" + host + "'"),
                               ::testing::Not(HasSubstr("attempts")))));
  }
  // Nothing was published for the peers to connect to.
  EXPECT_THAT((*store)->Get(ConnectAttemptPrefix("hap", 0) + "/0", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("did not appear")));
}

// Gloo waits in whole milliseconds on std::chrono clocks: a timeout under
// a millisecond used to become 0 ms (every wait over at once) and an
// infinite one overflowed the clock. Both are refused, naming the bounds.
TEST(GlooCommunicatorTest, ATimeoutGlooCannotWaitIsInvalidArgument) {
  auto store = NewFileStore(FreshDir("bad_timeout"));
  ASSERT_TRUE(store.ok());
  for (absl::Duration t : {absl::Microseconds(500), absl::InfiniteDuration(),
                           absl::Hours(24 * 365 * 100), absl::ZeroDuration()}) {
    EXPECT_THAT(ConnectGloo(Rank(0, 1, t), **store),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("timeout"), HasSubstr("between 1ms and"),
                               HasSubstr(absl::FormatDuration(t)))));
  }
  EXPECT_THAT(ConnectGloo(Rank(0, 1, absl::Milliseconds(1)), **store), IsOk());
}

TEST(GlooCommunicatorTest, ConnectAttemptsMustBePositive) {
  auto store = NewFileStore(FreshDir("attempts"));
  ASSERT_TRUE(store.ok());
  GlooOptions o = Rank(0, 1, absl::Seconds(1));
  o.connect_attempts = 0;
  EXPECT_THAT(ConnectGloo(o, **store),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("connect_attempts")));
}

// Threads of this process per scheduling policy.
int ThreadsWithPolicy(int policy) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const pid_t tid = std::stoi(e.path().filename().string());
    if (sched_getscheduler(tid) == policy) ++n;
  }
  return n;
}

TEST(GlooCommunicatorTest, TheEventLoopThreadRunsAtIdlePriority) {
  // One communicator adds Gloo's loop thread at SCHED_IDLE and leaves the
  // caller's policy alone; with the option off the loop thread is ordinary.
  const int caller_policy = sched_getscheduler(0);
  const int idle_before = ThreadsWithPolicy(SCHED_IDLE);
  for (bool idle : {true, false}) {
    auto store = NewFileStore(FreshDir(idle ? "idle_loop" : "default_loop"));
    ASSERT_TRUE(store.ok());
    GlooOptions o = Rank(0, 1, absl::Seconds(5));
    o.idle_progress_thread = idle;
    auto comm = ConnectGloo(o, **store);
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ(ThreadsWithPolicy(SCHED_IDLE), idle_before + (idle ? 1 : 0))
        << (idle ? "idle" : "default") << " loop thread";
    EXPECT_EQ(sched_getscheduler(0), caller_policy);
    std::vector<float> v = {1.5f, 2.5f};
    ASSERT_THAT((*comm)->AllReduce(View(v)), IsOk());
    EXPECT_EQ(v, (std::vector<float>{1.5f, 2.5f}));
  }
}

TEST(FileStoreTest, SetGetTimeoutAndBadDirectory) {
  std::string dir = FreshDir("store");
  auto store = NewFileStore(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Set("plan/7/rank 0", std::string("a\0b", 3)).ok());
  auto v = (*store)->Get("plan/7/rank 0", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("a\0b", 3));
  EXPECT_THAT((*store)->Get("plan/7/rank 1", absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("'plan/7/rank 1'")));
  EXPECT_THAT(NewFileStore(dir + "/nope"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a writable directory")));
}

// Keys whose plain file names would be the directory itself or its parent
// ("", ".", "..") are keys like any other: absent until set (they used to
// read as present and empty at once, and could not be set).
TEST(FileStoreTest, KeysThatWouldNameADirectoryAreKeysLikeAnyOther) {
  auto store = NewFileStore(FreshDir("store_dots"));
  ASSERT_TRUE(store.ok());
  for (const std::string key : {"", ".", "..", "...", ".a"}) {
    EXPECT_THAT((*store)->Get(key, absl::ZeroDuration()),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'" + key + "'")))
        << "key '" << key << "'";
    ASSERT_THAT((*store)->Set(key, "value of '" + key + "'"), IsOk()) << "key '" << key << "'";
  }
  for (const std::string key : {"", ".", "..", "...", ".a"}) {
    auto v = (*store)->Get(key, absl::ZeroDuration());
    ASSERT_THAT(v, IsOk()) << "key '" << key << "'";
    EXPECT_EQ(*v, "value of '" + key + "'");
  }
}

// A key that cannot be read for another reason than its absence (here a
// name too long for the file system; a file of another user's alike) fails
// Get at once naming the reason, instead of waiting out the timeout and
// saying that the key did not appear.
TEST(FileStoreTest, AKeyThatCannotBeReadIsNotReportedAsAbsent) {
  auto store = NewFileStore(FreshDir("store_unreadable"));
  ASSERT_TRUE(store.ok());
  const std::string key(300, 'k');
  EXPECT_THAT((*store)->Get(key, absl::Seconds(60)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("cannot read key"), HasSubstr("File name too long"))));
}

// A key as long as a file name may be (here 250 bytes) can be set: the
// temporary file Set writes first used to carry the key in its name too,
// which made that name too long. Longer keys are refused by Set and Get
// alike, naming the reason.
TEST(FileStoreTest, AKeyAsLongAsAFileNameCanBeSet) {
  auto store = NewFileStore(FreshDir("store_long"));
  ASSERT_TRUE(store.ok());
  const std::string key(250, 'k');
  ASSERT_THAT((*store)->Set(key, "v"), IsOk());
  auto v = (*store)->Get(key, absl::ZeroDuration());
  ASSERT_THAT(v, IsOk());
  EXPECT_EQ(*v, "v");
  EXPECT_THAT((*store)->Set(std::string(300, 'k'), "v"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("File name too long")));
}

// A value the file system refuses part of (here a file size limit; a full
// disk alike) fails Set and is not published (with a buffered stream the
// write that failed was the one at close, after the stream's checks, and it
// published 16 bytes of 100).
TEST(FileStoreTest, AWriteThatFailsAtCloseFailsSetAndPublishesNothing) {
  auto store = NewFileStore(FreshDir("store_full"));
  ASSERT_TRUE(store.ok());
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit small = old;
  small.rlim_cur = 16;
  auto* previous = signal(SIGXFSZ, SIG_IGN);  // EFBIG rather than the signal
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status set = (*store)->Set("rank0", std::string(100, 'x'));
  setrlimit(RLIMIT_FSIZE, &old);  // before anything is printed
  signal(SIGXFSZ, previous);
  EXPECT_THAT(set, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot write")));
  EXPECT_THAT((*store)->Get("rank0", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'rank0'")));
}

}  // namespace
}  // namespace hap::executor
