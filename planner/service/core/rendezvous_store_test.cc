#include "planner/service/core/rendezvous_store.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::service {
namespace {

using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const auto kNever = [] { return false; };

TEST(RendezvousStoreTest, KeysBelongToAnOpenDeploymentAtItsGeneration) {
  RendezvousStore store;
  EXPECT_THAT(store.Set("d", 1, "k", "v"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'d' does not exist")));
  store.Open("d", 1);
  ASSERT_THAT(store.Set("d", 1, "k", "v"), IsOk());
  EXPECT_THAT(store.Set("d", 2, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is generation 1, not 2")));
  EXPECT_THAT(store.Get("d", 1, {"k"}, absl::InfiniteFuture(), kNever), IsOk());
  EXPECT_THAT(*store.Get("d", 1, {"k"}, absl::InfiniteFuture(), kNever), ElementsAre("v"));
  EXPECT_THAT(store.Set("", 1, "k", "v"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(store.Set("d", 1, "", "v"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(store.Get("d", 1, {}, absl::InfiniteFuture(), kNever),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_EQ(store.keys("d", 1), 1);

  // A new generation of the same deployment leaves the old one's keys behind.
  store.Open("d", 2);
  EXPECT_EQ(store.keys("d", 1), 0);
  EXPECT_EQ(store.size(), 0);
  EXPECT_THAT(store.Set("d", 1, "k", "v"), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  ASSERT_THAT(store.Set("d", 2, "k", "w"), IsOk());
  EXPECT_EQ(store.keys("d", 2), 1);
}

TEST(RendezvousStoreTest, GetWaitsForEveryKeyAndNamesTheMissingAtItsDeadline) {
  RendezvousStore store;
  store.Open("d", 1);
  ASSERT_THAT(store.Set("d", 1, "a", "1"), IsOk());
  EXPECT_THAT(store.Get("d", 1, {"a", "b", "c"}, absl::Now() + absl::Milliseconds(50), kNever),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("d generation 1: b, c")));

  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_THAT(store.Set("d", 1, "b", "2"), IsOk());
  });
  auto got = store.Get("d", 1, {"a", "b"}, absl::InfiniteFuture(), kNever);
  setter.join();
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(*got, ElementsAre("1", "2"));
}

// One deployment's rendezvous holds at most its limits of keys and bytes
// (a client knowing the name could grow the planner's memory without end);
// replacing a value counts its new size only, closing frees it all.
TEST(RendezvousStoreTest, ADeploymentsKeysAndBytesAreBounded) {
  RendezvousStore::Options o;
  o.max_keys_per_deployment = 3;
  o.max_bytes_per_deployment = 100;
  RendezvousStore store(o);
  store.Open("d", 1);
  store.Open("e", 1);
  ASSERT_THAT(store.Set("d", 1, "a", std::string(40, 'x')), IsOk());  // 41 bytes
  ASSERT_THAT(store.Set("d", 1, "a", std::string(60, 'x')), IsOk());  // 61, replaced
  EXPECT_THAT(store.Set("d", 1, "b", std::string(40, 'x')),           // 61 + 41
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("the rendezvous of d would hold 2 keys and 102 bytes; it may "
                                 "hold 3 keys and 100 bytes")));
  ASSERT_THAT(store.Set("d", 1, "b", std::string(38, 'x')), IsOk());  // 100
  EXPECT_THAT(store.Add("d", 1, "c", 1),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  ASSERT_THAT(store.Set("d", 1, "a", ""), IsOk());  // 1 + 39
  EXPECT_THAT(store.Add("d", 1, "c", 1), IsOk());   // 3 keys
  EXPECT_THAT(store.Set("d", 1, "e", ""),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("4 keys")));
  EXPECT_EQ(store.keys("d", 1), 3);
  ASSERT_THAT(store.Set("e", 1, "a", std::string(99, 'x')), IsOk());  // another deployment's own
  store.Close("d", 1, "done");
  store.Open("d", 2);
  EXPECT_THAT(store.Set("d", 2, "a", std::string(99, 'x')), IsOk());
}

// A deadline's message names the first missing keys, not every one a client
// asked for (megabytes of key names passed gRPC's trailer limit).
TEST(RendezvousStoreTest, ADeadlineNamesTheFirstMissingKeysOnly) {
  RendezvousStore store;
  store.Open("d", 1);
  std::vector<std::string> keys;
  for (int i = 0; i < 10000; ++i)
    keys.push_back("key-" + std::string(100, 'k') + std::to_string(i));
  absl::StatusOr<std::vector<std::string>> got =
      store.Get("d", 1, keys, absl::Now() + absl::Milliseconds(10), kNever);
  ASSERT_THAT(got, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("and 9984 more")));
  EXPECT_LT(got.status().message().size(), 2048u);
}

TEST(RendezvousStoreTest, ClosingEndsWaitsAndDropsTheKeys) {
  RendezvousStore store;
  store.Open("d", 3);
  store.Open("e", 1);
  ASSERT_THAT(store.Set("d", 3, "a", "1"), IsOk());
  ASSERT_THAT(store.Set("e", 1, "a", "1"), IsOk());
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(100));
    store.Close("d", 3, "deployment 'd' is STOPPED: its rendezvous is closed");
  });
  EXPECT_THAT(store.Get("d", 3, {"never"}, absl::InfiniteFuture(), kNever),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("'d' is STOPPED")));
  closer.join();
  EXPECT_EQ(store.keys("d", 3), 0);
  EXPECT_EQ(store.size(), 1);  // e's
  EXPECT_THAT(store.Set("d", 3, "a", "1"), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(store.Add("d", 3, "n", 1), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  // Closed at another generation: the generation is named first.
  EXPECT_THAT(store.Set("d", 4, "a", "1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("generation 3, not 4")));
  // A deployment known only as finished (a planner's reload) is closed too.
  store.Close("f", 1, "f is SUCCEEDED");
  EXPECT_THAT(store.Set("f", 1, "a", "1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("f is SUCCEEDED")));
}

// Closed rendezvous are remembered up to max_closed, the oldest forgotten
// first (a long-running planner closes one per deployment it ever made);
// one opened again since it closed is not forgotten by its old closing.
TEST(RendezvousStoreTest, OnlyTheLatestClosedRendezvousAreRemembered) {
  RendezvousStore::Options o;
  o.max_closed = 2;
  RendezvousStore store(o);
  store.Close("a", 1, "a is SUCCEEDED");
  store.Close("b", 1, "b is SUCCEEDED");
  store.Open("a", 2);                  // a's next generation
  store.Close("c", 1, "c is FAILED");  // a's first closing is forgotten: a stays open
  EXPECT_THAT(store.Set("a", 2, "k", "v"), IsOk());
  EXPECT_THAT(store.Set("b", 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("b is SUCCEEDED")));
  store.Close("d", 1, "d is STOPPED");  // b is forgotten
  EXPECT_THAT(store.Set("b", 1, "k", "v"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'b' does not exist")));
  EXPECT_THAT(store.Set("c", 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("c is FAILED")));
}

// The deployment manager closes a finished deployment's rendezvous again
// with each later change of its record (the ranks it could not stop, a
// damaged checkpoint found by the stop): each closing took a place of
// max_closed, so a planner remembered half as many deployments or fewer,
// and their ranks heard "does not exist ... forgotten after 10000 more
// have finished" of a deployment that had just failed.
TEST(RendezvousStoreTest, ARendezvousClosedAgainIsRememberedOnce) {
  RendezvousStore::Options o;
  o.max_closed = 2;
  RendezvousStore store(o);
  store.Open("a", 1);
  store.Close("a", 1, "a is FAILED");
  store.Close("a", 1, "a is FAILED");  // its record changed again
  store.Open("b", 1);
  store.Close("b", 1, "b is FAILED");
  EXPECT_THAT(store.Set("a", 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("a is FAILED")));
  store.Close("c", 1, "c is FAILED");  // a is the oldest of three: forgotten
  EXPECT_THAT(store.Set("a", 1, "k", "v"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'a' does not exist")));
  EXPECT_THAT(store.Set("b", 1, "k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("b is FAILED")));
}

TEST(RendezvousStoreTest, ShutdownAndCancellationEndWaits) {
  RendezvousStore store;
  store.Open("d", 1);
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(100));
    cancel = true;
  });
  EXPECT_THAT(store.Get("d", 1, {"k"}, absl::InfiniteFuture(), [&] { return cancel.load(); }),
              StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  canceller.join();

  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(100));
    store.Shutdown();
  });
  EXPECT_THAT(store.Get("d", 1, {"k"}, absl::InfiniteFuture(), kNever),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  stopper.join();
  // Keys already set are still read after shutdown; waits are not.
  ASSERT_THAT(store.Set("d", 1, "k", "v"), IsOk());
  EXPECT_THAT(store.Get("d", 1, {"k"}, absl::InfiniteFuture(), kNever), IsOk());
  EXPECT_THAT(store.Get("d", 1, {"other"}, absl::InfiniteFuture(), kNever),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

TEST(RendezvousStoreTest, CountersAddWithoutWrapping) {
  RendezvousStore store;
  store.Open("d", 1);
  EXPECT_THAT(store.Add("d", 1, "n", 2), IsOk());
  EXPECT_EQ(*store.Add("d", 1, "n", 5), 7);
  EXPECT_EQ(*store.Add("d", 1, "n", -10), -3);
  ASSERT_THAT(store.Set("d", 1, "s", "text"), IsOk());
  EXPECT_THAT(store.Add("d", 1, "s", 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a counter")));
  ASSERT_THAT(store.Set("d", 1, "max", std::to_string(std::numeric_limits<int64_t>::max())),
              IsOk());
  EXPECT_THAT(store.Add("d", 1, "max", 1),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("overflows")));
  EXPECT_EQ(*store.Get("d", 1, {"max"}, absl::InfiniteFuture(), kNever),
            std::vector<std::string>{std::to_string(std::numeric_limits<int64_t>::max())});
  // A counter is read as a key holding its decimal value.
  EXPECT_THAT(*store.Get("d", 1, {"n"}, absl::InfiniteFuture(), kNever), ElementsAre("-3"));
}

TEST(RendezvousStoreTest, OpenOnUseAdmitsAnyDeploymentAndGeneration) {
  RendezvousStore store(RendezvousStore::Options{/*open_on_use=*/true});
  ASSERT_THAT(store.Set("x", 7, "k", "1"), IsOk());
  ASSERT_THAT(store.Set("x", 8, "k", "2"), IsOk());
  EXPECT_THAT(*store.Get("x", 7, {"k"}, absl::InfiniteFuture(), kNever), ElementsAre("1"));
  EXPECT_THAT(*store.Get("x", 8, {"k"}, absl::InfiniteFuture(), kNever), ElementsAre("2"));
  EXPECT_EQ(*store.Add("y", 1, "n", 4), 4);
  EXPECT_EQ(store.keys("x", 7), 1);
  EXPECT_EQ(store.size(), 3);
}

}  // namespace
}  // namespace hap::service
