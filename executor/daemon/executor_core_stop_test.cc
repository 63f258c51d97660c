// The executor core stopped and failing while it trains or while its ranks
// meet: Stop between steps, a step stuck in a collective or a checkpoint
// save abandoned after stop_wait, Stop and Shutdown during the rendezvous
// and Gloo's connect, and a connect that fails.
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "executor/comm/communicator.h"
#include "executor/comm/dead_peer_address.h"
#include "executor/cpu/cpu_device.h"
#include "executor/daemon/core_test_util.h"
#include "executor/daemon/executor_core.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

using testing::InProcessGroup;
using testing::InProcessOptions;
using testing::MlpLoad;

// Real Gloo over a file store: rank 0 is stopped between steps; rank 1,
// left inside a collective, fails.
TEST(ExecutorCoreTest, StopCancelsBetweenStepsAndThePeerTimesOut) {
  const std::string dir = ::testing::TempDir() + "/stop_test_store";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto options = [&](absl::Notification* first_step) {
    ExecutorCoreOptions o;
    o.planner_address = "127.0.0.1:7000";
    o.comm_timeout = absl::Seconds(3);
    o.make_store = [dir](const LoadOptions&) { return NewFileStore(dir); };
    if (first_step != nullptr) {
      o.on_step = [first_step](const v1::StepMetric& m) {
        if (m.step() == 1) first_step->Notify();
      };
    }
    return o;
  };
  absl::Notification first_step;
  ExecutorCore a(options(&first_step)), b(options(nullptr));
  ASSERT_THAT(a.LoadPlan(MlpLoad(2, 0, 1'000'000)), IsOk());
  ASSERT_THAT(b.LoadPlan(MlpLoad(2, 1, 1'000'000)), IsOk());
  ASSERT_THAT(a.Start(""), IsOk());
  ASSERT_THAT(b.Start(""), IsOk());
  first_step.WaitForNotification();
  EXPECT_THAT(a.LoadPlan(MlpLoad(2, 0, 3)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stop it")));
  auto stopped = a.Stop("deployments/d1");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(), HasSubstr("stopped by StopTraining after"));
  EXPECT_GE(stopped->steps_completed(), 2);
  EXPECT_LT(stopped->steps_completed(), 1'000'000);

  v1::ExecutorStatus peer = b.WaitUntilDone(absl::InfiniteFuture());
  EXPECT_EQ(peer.state(), v1::ExecutorStatus::FAILED);
  // The stopped rank closed its connections (or, had it hung, the peer's
  // collective would time out): either way the peer fails, naming it.
  EXPECT_THAT(peer.error(), HasSubstr("peer"));
}

using testing::GlooThroughStore;
using testing::HungPeerCommunicator;

// A rank whose peer froze sits in a collective that only the communicator
// timeout ends. Stop does not wait for that: the rank is FAILED at once,
// takes a new plan, and the old thread, when it finally returns, changes
// nothing.
TEST(ExecutorCoreTest, StopAbandonsAStepStuckInACollective) {
  absl::Notification entered, release;
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.stop_wait = absl::Milliseconds(200);
  options.connect = [&](const GlooOptions& go,
                        RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return std::make_unique<HungPeerCommunicator>(go.rank, &entered, &release);
  };
  absl::Mutex mu;
  int reported = 0;
  options.on_step = [&](const v1::StepMetric&) {
    absl::MutexLock l(&mu);
    ++reported;
  };
  ExecutorCore core(options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 1'000)), IsOk());
  ASSERT_THAT(core.Start("deployments/d1"), IsOk());
  entered.WaitForNotification();  // inside step 0's first collective

  // The collective returns only once `release` is notified, below: a Stop
  // that waited for the step would never return (the test times out).
  auto stopped = core.Stop("deployments/d1");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(), ::testing::AllOf(HasSubstr("stopped by StopTraining after 0"),
                                                 HasSubstr("abandoned")));
  EXPECT_EQ(core.RetiredThreads(), 1);
  EXPECT_THAT(core.Stop("deployments/d1"), IsOk());  // again: a no-op

  // A new plan is taken while the old thread is still stuck.
  LoadOptions next = MlpLoad(2, 0, 3);
  next.deployment = "deployments/d2";
  ASSERT_THAT(core.LoadPlan(next), IsOk());
  EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::LOADED);

  release.Notify();  // the collective times out at last
  core.Shutdown();   // joins the retired thread
  EXPECT_EQ(core.RetiredThreads(), 0);
  v1::ExecutorStatus after = core.Status();
  EXPECT_EQ(after.state(), v1::ExecutorStatus::LOADED);
  EXPECT_EQ(after.deployment(), "deployments/d2");
  EXPECT_EQ(after.steps_completed(), 0);
  EXPECT_TRUE(after.error().empty()) << after.error();
  absl::MutexLock l(&mu);
  EXPECT_EQ(reported, 0);
}

// SIGTERM or StopTraining while a checkpoint save is stuck (here a peer
// vanishes in the save's collective): the abandoned save is named, with
// what it means, instead of blaming a step's collective.
TEST(ExecutorCoreTest, AnAbandonedCheckpointSaveIsNamedAsSuch) {
  const std::string dir = ::testing::TempDir() + "/abandoned_save";
  std::filesystem::remove_all(dir);
  InProcessGroup group(2);
  std::atomic<bool> armed[2] = {false, false};
  absl::Notification entered[2], release;
  std::vector<std::unique_ptr<ExecutorCore>> cores;
  for (int r = 0; r < 2; ++r) {
    ExecutorCoreOptions o = InProcessOptions(&group);
    o.stop_wait = absl::Milliseconds(200);
    auto connect = o.connect;
    o.connect = [&, r, connect](
                    const GlooOptions& go,
                    RendezvousStore& store) -> absl::StatusOr<std::unique_ptr<Communicator>> {
      HAP_ASSIGN_OR_RETURN(auto inner, connect(go, store));
      return std::make_unique<HungPeerCommunicator>(std::move(inner), &armed[r], &entered[r],
                                                    &release);
    };
    // Step 1's metric comes just before the checkpoint of step 2 is saved.
    o.on_step = [&, r](const v1::StepMetric& m) {
      if (m.step() == 1) armed[r] = true;
    };
    cores.push_back(std::make_unique<ExecutorCore>(o));
    LoadOptions load = MlpLoad(2, r, 1'000);
    load.training.set_checkpoint_dir(dir);
    load.training.set_checkpoint_every(2);
    ASSERT_THAT(cores[r]->LoadPlan(load), IsOk());
  }
  for (auto& c : cores) ASSERT_THAT(c->Start("deployments/d1"), IsOk());
  entered[0].WaitForNotification();
  auto stopped = cores[0]->Stop("deployments/d1");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(),
              ::testing::AllOf(HasSubstr("saving the checkpoint of step 2 did not end"),
                               HasSubstr("abandoned (that checkpoint was not committed by then"),
                               ::testing::Not(HasSubstr("collective"))));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-00000002/COMMITTED"));
  ASSERT_THAT(cores[1]->Stop("deployments/d1"), IsOk());
  release.Notify();
  for (auto& c : cores) c->Shutdown();
}

// A Stop whose caller's deadline has passed (or comes before the step in
// progress ends) does not give up on a healthy step: it was abandoned at
// once, the run FAILED "abandoned" and its thread retired while it went on
// computing, although it stopped cleanly at the next step boundary.
TEST(ExecutorCoreTest, AStopWithAPassedDeadlineDoesNotAbandonAHealthyStep) {
  const std::string dir = ::testing::TempDir() + "/passed_deadline_store";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ExecutorCoreOptions options;  // real Gloo over a file store, as above
  options.planner_address = "127.0.0.1:7000";
  options.comm_timeout = absl::Seconds(3);
  options.make_store = [dir](const LoadOptions&) { return NewFileStore(dir); };
  ExecutorCoreOptions peer_options = options;
  absl::Notification entered, release;
  options.stop_wait = absl::Seconds(600);
  options.on_step = [&](const v1::StepMetric&) {  // step 0 goes on until released
    if (!entered.HasBeenNotified()) entered.Notify();
    release.WaitForNotification();
  };
  ExecutorCore core(options), peer(peer_options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 1'000)), IsOk());
  ASSERT_THAT(peer.LoadPlan(MlpLoad(2, 1, 1'000)), IsOk());
  ASSERT_THAT(core.Start(""), IsOk());
  ASSERT_THAT(peer.Start(""), IsOk());
  entered.WaitForNotification();

  auto stopping = core.Stop("deployments/d1", absl::Now());
  ASSERT_THAT(stopping, IsOk());
  EXPECT_EQ(stopping->state(), v1::ExecutorStatus::TRAINING);
  EXPECT_EQ(core.RetiredThreads(), 0);

  release.Notify();
  auto stopped = core.Stop("deployments/d1");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(), HasSubstr("stopped by StopTraining after 1 of 1000 steps"));
  EXPECT_THAT(stopped->error(), ::testing::Not(HasSubstr("abandoned")));
  EXPECT_EQ(stopped->error_code(), static_cast<int>(absl::StatusCode::kCancelled));
  EXPECT_EQ(core.RetiredThreads(), 0);
  // The peer, left in its next collective, fails naming its lost peer.
  EXPECT_THAT(peer.WaitUntilDone(absl::InfiniteFuture()).error(), HasSubstr("peer"));
}

// A step stuck for good is still abandoned stop_wait after the first Stop,
// by a later Stop whose own wait is short.
TEST(ExecutorCoreTest, AStuckStepIsAbandonedStopWaitAfterTheFirstStop) {
  absl::Notification entered, release;
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  // Far more than the first Stop takes to answer, even on a loaded machine.
  options.stop_wait = absl::Seconds(2);
  options.connect = [&](const GlooOptions& go,
                        RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return std::make_unique<HungPeerCommunicator>(go.rank, &entered, &release);
  };
  ExecutorCore core(options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 1'000)), IsOk());
  ASSERT_THAT(core.Start("deployments/d1"), IsOk());
  entered.WaitForNotification();
  auto first = core.Stop("deployments/d1", absl::Now());
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->state(), v1::ExecutorStatus::TRAINING);
  absl::SleepFor(absl::Milliseconds(2100));
  auto later = core.Stop("deployments/d1", absl::Now());
  ASSERT_THAT(later, IsOk());
  EXPECT_EQ(later->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(later->error(), HasSubstr("abandoned"));
  EXPECT_EQ(core.RetiredThreads(), 1);
  release.Notify();
  core.Shutdown();
  EXPECT_EQ(core.RetiredThreads(), 0);
}

// A rendezvous store whose other ranks never come: Get waits for a key
// until its timeout; after `release` (the end of the test) every Get fails.
class NoPeersStore : public RendezvousStore {
 public:
  NoPeersStore(absl::Notification* asked, absl::Notification* release)
      : asked_(asked), release_(release) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    absl::MutexLock l(&mu_);
    keys_[key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    {
      absl::MutexLock l(&mu_);
      if (auto it = keys_.find(key); it != keys_.end()) return it->second;
    }
    if (!asked_->HasBeenNotified()) asked_->Notify();
    if (release_->WaitForNotificationWithTimeout(timeout)) {
      return absl::UnavailableError("the test is over");  // ends Gloo's wait too
    }
    return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set"));
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> keys_ ABSL_GUARDED_BY(mu_);
  absl::Notification* asked_;
  absl::Notification* release_;
};

// Stop (and SIGTERM's Shutdown) while the rank waits in the rendezvous for
// peers that never come: the wait ends at once, as a cancelled run, not
// after stop_wait as "a step in progress abandoned" with a thread left
// waiting for the whole communicator timeout.
TEST(ExecutorCoreTest, StopDuringTheRendezvousEndsTheWait) {
  for (const bool shutdown : {false, true}) {
    SCOPED_TRACE(shutdown ? "Shutdown" : "Stop");
    absl::Notification asked, release;
    ExecutorCore core(GlooThroughStore(
        absl::Seconds(600), absl::Seconds(2),
        [&](const LoadOptions&) -> absl::StatusOr<std::unique_ptr<RendezvousStore>> {
          return std::make_unique<NoPeersStore>(&asked, &release);
        }));
    ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 10)), IsOk());
    ASSERT_THAT(core.Start(""), IsOk());
    asked.WaitForNotification();  // waiting for rank 1's address
    v1::ExecutorStatus stopped;
    if (shutdown) {
      core.Shutdown(/*join=*/false);
      stopped = core.Status();
    } else {
      auto s = core.Stop("");
      ASSERT_THAT(s, IsOk());
      stopped = *s;
    }
    EXPECT_EQ(stopped.state(), v1::ExecutorStatus::FAILED);
    EXPECT_THAT(stopped.error(),
                HasSubstr(shutdown ? "stopped by the executor shutting down after 0 of 10"
                                   : "stopped by StopTraining after 0 of 10"));
    EXPECT_THAT(stopped.error(), ::testing::Not(HasSubstr("abandoned")));
    EXPECT_EQ(stopped.error_code(), static_cast<int>(absl::StatusCode::kCancelled));
    EXPECT_EQ(core.RetiredThreads(), 0);
    release.Notify();  // a thread left waiting (before the fix) ends
  }
}

// A rendezvous store in which rank 1 of two publishes an address that
// nobody listens at (rank 0's, port 65535) once rank 0 published its own,
// as a rank that died after publishing: rank 0 then waits in Gloo's
// connect for a connection that never comes. `peer_seen` is notified once
// rank 0 has read rank 1's address (it connects next).
class DeadPeerStore : public RendezvousStore {
 public:
  explicit DeadPeerStore(absl::Notification* peer_seen) : peer_seen_(peer_seen) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    absl::MutexLock l(&mu_);
    keys_[key] = value;
    if (absl::EndsWith(key, "/0")) {
      const std::string dead = AtAPortNobodyListensOn(value);
      if (!dead.empty()) keys_[key.substr(0, key.size() - 1) + "1"] = dead;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    absl::MutexLock l(&mu_);
    auto there = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return keys_.count(key) > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&there), std::max(timeout, absl::ZeroDuration()))) {
      return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set"));
    }
    if (absl::EndsWith(key, "/1") && !peer_seen_->HasBeenNotified()) peer_seen_->Notify();
    return keys_[key];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> keys_ ABSL_GUARDED_BY(mu_);
  absl::Notification* peer_seen_;
};

// Stop while the rank waits in Gloo's connect for a peer that published
// its address and never connects: the connect ends (its abort watcher asks
// the store whether the run was stopped), so the stop reports a cancelled
// run, not "a step in progress abandoned" after stop_wait with a thread
// left in the connect for five times the communicator timeout.
TEST(ExecutorCoreTest, StopWhileConnectingToADeadPeerEndsTheConnect) {
  absl::Notification peer_seen;
  ExecutorCore core(
      GlooThroughStore(absl::Seconds(600), absl::Seconds(3),
                       [&](const LoadOptions&) -> absl::StatusOr<std::unique_ptr<RendezvousStore>> {
                         return std::make_unique<DeadPeerStore>(&peer_seen);
                       }));
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 10)), IsOk());
  ASSERT_THAT(core.Start(""), IsOk());
  peer_seen.WaitForNotification();
  auto stopped = core.Stop("");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(), HasSubstr("stopped by StopTraining after 0 of 10"));
  EXPECT_THAT(stopped->error(), ::testing::Not(HasSubstr("abandoned")));
  EXPECT_EQ(stopped->error_code(), static_cast<int>(absl::StatusCode::kCancelled));
  EXPECT_EQ(core.RetiredThreads(), 0);
}

// The rendezvous store of two ranks in this process. Until `hide` is
// notified, rank 0 does not see rank 1's address (it waits in the
// rendezvous), while rank 1 sees rank 0's (it goes on connecting to it);
// `peer_seen` is notified once rank 1 has it.
struct TwoRankStore {
  absl::Mutex mu;
  std::map<std::string, std::string> keys ABSL_GUARDED_BY(mu);
  absl::Notification hide, peer_seen;

  class Rank : public RendezvousStore {
   public:
    Rank(TwoRankStore* s, int rank) : s_(s), rank_(rank) {}
    absl::Status Set(const std::string& key, const std::string& value) override {
      absl::MutexLock l(&s_->mu);
      s_->keys[key] = value;
      return absl::OkStatus();
    }
    absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
      const bool hidden = rank_ == 0 && key == "deployments/d1/1/1" && !s_->hide.HasBeenNotified();
      absl::MutexLock l(&s_->mu);
      auto there = [&]() ABSL_SHARED_LOCKS_REQUIRED(s_->mu) {
        return !hidden && s_->keys.count(key) > 0;
      };
      if (!s_->mu.AwaitWithTimeout(absl::Condition(&there),
                                   std::max(timeout, absl::ZeroDuration()))) {
        return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set"));
      }
      if (rank_ == 1 && key == "deployments/d1/1/0" && !s_->peer_seen.HasBeenNotified()) {
        s_->peer_seen.Notify();
      }
      return s_->keys[key];
    }

   private:
    TwoRankStore* s_;
    const int rank_;
  };
};

// Both ranks stopped while they meet: rank 0 still waits for rank 1's
// address, rank 1 has rank 0's and waits for it in Gloo's connect (as the
// listening side of their pair). Rank 0, stopped, gives the try up and sets
// the abort key; rank 1, stopped first, must still see that key (its abort
// watcher polls the store) and end, not wait in the connect until the stop
// gives up on it.
TEST(ExecutorCoreTest, RanksStoppedWhileTheyMeetAllEnd) {
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    TwoRankStore store;
    auto options = [&](int rank) {
      return GlooThroughStore(
          absl::Seconds(8), absl::Seconds(4),
          [&store, rank](const LoadOptions&) -> absl::StatusOr<std::unique_ptr<RendezvousStore>> {
            return std::make_unique<TwoRankStore::Rank>(&store, rank);
          });
    };
    ExecutorCore a(options(0)), b(options(1));
    ASSERT_THAT(a.LoadPlan(MlpLoad(2, 0, 10)), IsOk());
    ASSERT_THAT(b.LoadPlan(MlpLoad(2, 1, 10)), IsOk());
    ASSERT_THAT(a.Start(""), IsOk());
    ASSERT_THAT(b.Start(""), IsOk());
    store.peer_seen.WaitForNotification();
    absl::StatusOr<v1::ExecutorStatus> stopped_b;
    std::thread stop_b([&] { stopped_b = b.Stop(""); });
    auto stopped_a = a.Stop("");
    stop_b.join();
    store.hide.Notify();
    for (const auto* s : {&stopped_a, &stopped_b}) {
      ASSERT_THAT(*s, IsOk());
      EXPECT_EQ((*s)->state(), v1::ExecutorStatus::FAILED);
      EXPECT_THAT((*s)->error(), HasSubstr("stopped by StopTraining after 0 of 10"));
      EXPECT_THAT((*s)->error(), ::testing::Not(HasSubstr("did not end")));
    }
    EXPECT_EQ(a.RetiredThreads(), 0);
    EXPECT_EQ(b.RetiredThreads(), 0);
  }
}

// Training failed by itself (a peer died) and the thread is still flushing
// metrics (on_end) when Stop comes: Stop does not wait for the flush, and
// reports the real error, not an abandoned step.
TEST(ExecutorCoreTest, StopDuringTheEndOfTrainingReportsHowItEnded) {
  absl::Notification entered, release, in_on_end, flushed;
  release.Notify();  // every collective fails at once
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.stop_wait = absl::Milliseconds(200);
  options.connect = [&](const GlooOptions& go,
                        RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return std::make_unique<HungPeerCommunicator>(go.rank, &entered, &release);
  };
  options.on_end = [&] {
    in_on_end.Notify();
    flushed.WaitForNotification();
  };
  ExecutorCore core(options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 1'000)), IsOk());
  ASSERT_THAT(core.Start(""), IsOk());
  in_on_end.WaitForNotification();
  EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::TRAINING);
  auto stopped = core.Stop("");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(stopped->error(), HasSubstr("connection closed by peer 1"));
  EXPECT_THAT(stopped->error(), ::testing::Not(HasSubstr("abandoned")));
  flushed.Notify();
  core.Shutdown();
  EXPECT_THAT(core.Status().error(), HasSubstr("connection closed by peer 1"));
}

TEST(ExecutorCoreTest, ConnectFailureIsFailedWithTheReason) {
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.connect = [](const GlooOptions&,
                       RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return absl::DeadlineExceededError("rank 1 never published its address");
  };
  bool ended = false;
  options.on_end = [&] { ended = true; };
  ExecutorCore core(options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 3)), IsOk());
  ASSERT_THAT(core.Start(""), IsOk());
  v1::ExecutorStatus s = core.WaitUntilDone(absl::InfiniteFuture());
  EXPECT_EQ(s.state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(s.error(), HasSubstr("connecting the ranks"));
  EXPECT_THAT(s.error(), HasSubstr("never published"));
  EXPECT_TRUE(ended);
}

}  // namespace
}  // namespace hap::executor
