// The executor core without gRPC: states and their transitions, LoadPlan's
// validation, Stop between steps, two ranks over an in-process communicator.
#include "executor/daemon/executor_core.h"

#include <netinet/in.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "executor/checkpoint/checkpoint_test_util.h"
#include "executor/cpu/cpu_device.h"
#include "executor/daemon/core_test_util.h"
#include "executor/daemon/test_plans.h"
#include "executor/data/npy_test_util.h"
#include "executor/runtime/timing_device.h"
#include "executor/train/in_process_comm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/lower/plan_file.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using testing::CachedMlpPlan;
using testing::InProcessGroup;
using testing::InProcessOptions;
using testing::MlpLoad;

// Plans need two ranks at least: `a` is rank 0, `b` rank 1.
TEST(ExecutorCoreTest, MovesThroughItsStates) {
  InProcessGroup group(2);
  ExecutorCore a(InProcessOptions(&group)), b(InProcessOptions(&group));
  EXPECT_EQ(a.Status().state(), v1::ExecutorStatus::IDLE);
  EXPECT_EQ(a.Status().device(), "node0/cpu0");
  EXPECT_THAT(a.Start(""), StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("call LoadPlan first")));

  auto hash = a.LoadPlan(MlpLoad(2, 0, 3));
  ASSERT_THAT(hash, IsOk());
  EXPECT_EQ(*hash, CachedMlpPlan(2).content_hash());
  ASSERT_THAT(b.LoadPlan(MlpLoad(2, 1, 3)), IsOk());
  EXPECT_EQ(a.Status().state(), v1::ExecutorStatus::LOADED);
  EXPECT_EQ(a.Status().deployment(), "deployments/d1");
  EXPECT_EQ(a.Status().generation(), 1);
  EXPECT_THAT(a.Start("deployments/other"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("deployments/d1")));

  ASSERT_THAT(a.Start("deployments/d1"), IsOk());
  ASSERT_THAT(b.Start(""), IsOk());
  auto again = a.Start("deployments/d1");  // a retried Start
  ASSERT_THAT(again, IsOk());
  for (ExecutorCore* c : {&a, &b}) {
    v1::ExecutorStatus done = c->WaitUntilDone(absl::InfiniteFuture());
    EXPECT_EQ(done.state(), v1::ExecutorStatus::FINISHED) << done.error();
    EXPECT_EQ(done.steps_completed(), 3);
    EXPECT_GT(done.last_loss(), 0);
  }

  bool finished = false;
  auto metrics = a.WaitMetrics("", 1, absl::InfiniteFuture(), &finished);
  ASSERT_THAT(metrics, IsOk());
  EXPECT_TRUE(finished);
  ASSERT_EQ(metrics->size(), 2u);
  EXPECT_EQ((*metrics)[0].step(), 1);
  EXPECT_EQ((*metrics)[0].deployment(), "deployments/d1");
  EXPECT_EQ((*metrics)[1].loss(), a.Status().last_loss());

  EXPECT_THAT(a.Start(""), StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("load the plan again")));
  ASSERT_THAT(a.LoadPlan(MlpLoad(2, 0, 3)), IsOk());
  EXPECT_EQ(a.Status().state(), v1::ExecutorStatus::LOADED);
  EXPECT_EQ(a.Status().steps_completed(), 0);
  auto stopped = a.Stop("");
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::ExecutorStatus::IDLE);
  EXPECT_THAT(a.Stop(""), IsOk());  // nothing loaded: a no-op
  EXPECT_THAT(a.WaitMetrics("", 0, absl::InfiniteFuture(), &finished),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no plan")));
}

TEST(ExecutorCoreTest, RejectsBadPlans) {
  ExecutorCore core(InProcessOptions(nullptr));
  LoadOptions o = MlpLoad(2, 0, 3);
  o.world_size = 3;
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("for a world of 2 ranks, not 3")));
  o = MlpLoad(2, 2, 3);
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("rank 2 is out of range")));
  o = MlpLoad(2, 0, 3);
  o.plan.mutable_rank_programs(1)->set_seed(o.plan.rank_programs(1).seed() + 1);
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("content hash does not match")));
  for (int64_t batch : {0, -8}) {
    o = MlpLoad(2, 0, 3);
    o.plan.set_global_batch(batch);
    o.plan.set_content_hash(lower::ContentHash(o.plan));  // a plan written so
    EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr(absl::StrCat("global_batch is ", batch))));
  }
  o = MlpLoad(2, 0, 3);
  o.plan.set_format_version(99);
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("format version 99")));
  o = MlpLoad(2, 0, 0);
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("training.steps must be positive")));
  for (int threads : {-1, 4097, std::numeric_limits<int32_t>::max()}) {
    o = MlpLoad(2, 0, 3);
    o.training.set_threads_per_rank(threads);
    EXPECT_THAT(core.LoadPlan(o),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("training.threads_per_rank must be 0 (the "
                                                "executor's --threads) to 4096, got ",
                                                threads))));
  }
  o = MlpLoad(2, 0, 3);
  o.deployment.clear();
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("deployment")));
  o = MlpLoad(2, 0, 3);
  o.training.set_data(v1::TrainingConfig::WIKITEXT2);
  o.training.set_data_path(::testing::TempDir() + "/no-such-dir");
  EXPECT_THAT(core.LoadPlan(o), StatusIs(absl::StatusCode::kNotFound,
                                         HasSubstr("training data")));
  o = MlpLoad(2, 0, 3);
  o.rendezvous_address = "10.0.0.9:7000";
  EXPECT_THAT(core.LoadPlan(o),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       ::testing::AllOf(HasSubstr("127.0.0.1:7000"),
                                        HasSubstr("10.0.0.9:7000"))));
  o.rendezvous_address = "dns:///127.0.0.1:7000";  // the same planner
  EXPECT_THAT(core.LoadPlan(o), IsOk());
  EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::LOADED);
}

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

using testing::HungPeerCommunicator;

// A rank whose peer froze sits in a collective that only the communicator
// timeout ends. Stop does not wait for that: the rank is FAILED at once,
// takes a new plan, and the old thread, when it finally returns, changes
// nothing.
TEST(ExecutorCoreTest, StopAbandonsAStepStuckInACollective) {
  absl::Notification entered, release;
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.stop_wait = absl::Milliseconds(200);
  options.connect = [&](const GlooOptions& go, RendezvousStore&)
      -> absl::StatusOr<std::unique_ptr<Communicator>> {
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

// Options whose ranks connect over Gloo through `make_store`'s store, on
// CPU devices.
ExecutorCoreOptions GlooThroughStore(absl::Duration comm_timeout, absl::Duration stop_wait,
                                     decltype(ExecutorCoreOptions::make_store) make_store) {
  ExecutorCoreOptions o = InProcessOptions(nullptr);
  o.connect = nullptr;  // Gloo, through the store
  o.make_device = [](int threads) { return NewCpuDevice(threads); };
  o.comm_timeout = comm_timeout;
  o.stop_wait = stop_wait;
  o.make_store = std::move(make_store);
  return o;
}

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
    if (absl::EndsWith(key, "/0") && value.size() >= sizeof(sockaddr_in)) {
      std::string dead = value;
      sockaddr_in addr{};
      std::memcpy(&addr, dead.data(), sizeof(addr));
      addr.sin_port = 0xffff;
      std::memcpy(dead.data(), &addr, sizeof(addr));
      keys_[key.substr(0, key.size() - 1) + "1"] = dead;
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
  options.connect = [&](const GlooOptions& go, RendezvousStore&)
      -> absl::StatusOr<std::unique_ptr<Communicator>> {
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
  options.connect = [](const GlooOptions&, RendezvousStore&)
      -> absl::StatusOr<std::unique_ptr<Communicator>> {
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

// Loads rank r's options on core r, starts every core, and expects each to
// finish its training.
void TrainToTheEnd(const std::vector<ExecutorCore*>& cores, const std::vector<LoadOptions>& loads) {
  for (size_t r = 0; r < cores.size(); ++r) ASSERT_THAT(cores[r]->LoadPlan(loads[r]), IsOk());
  for (ExecutorCore* c : cores) ASSERT_THAT(c->Start(""), IsOk());
  for (ExecutorCore* c : cores) {
    v1::ExecutorStatus s = c->WaitUntilDone(absl::InfiniteFuture());
    EXPECT_EQ(s.state(), v1::ExecutorStatus::FINISHED) << s.error();
  }
}

TEST(ExecutorCoreTest, TwoRanksReportTheSameLosses) {
  InProcessGroup group(2);
  ExecutorCore a(InProcessOptions(&group)), b(InProcessOptions(&group));
  TrainToTheEnd({&a, &b}, {MlpLoad(2, 0, 4), MlpLoad(2, 1, 4)});
  bool done = false;
  auto ma = a.WaitMetrics("", 0, absl::InfiniteFuture(), &done);
  auto mb = b.WaitMetrics("", 0, absl::InfiniteFuture(), &done);
  ASSERT_THAT(ma, IsOk());
  ASSERT_THAT(mb, IsOk());
  ASSERT_EQ(ma->size(), 4u);
  ASSERT_EQ(mb->size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ((*ma)[i].rank(), 0);
    EXPECT_EQ((*mb)[i].rank(), 1);
    EXPECT_EQ((*ma)[i].loss(), (*mb)[i].loss()) << "step " << i;
  }
}

// A plan lowered with overlap: its gradient buckets run on a communication
// thread with the rank's second communicator (prefix ".../overlap"),
// attached when training connects; both ranks report the losses of the
// same model's plan run in line.
TEST(ExecutorCoreTest, OverlappedPlansRunTheirStartedCollectivesBehindCompute) {
  auto overlapped = testing::MakeMlpPlan(2, /*overlap=*/true);
  ASSERT_THAT(overlapped, IsOk());
  int started = 0;
  for (const v1::Step& st : overlapped->rank_programs(0).steps()) {
    started += st.has_collective() && st.collective().async();
  }
  ASSERT_GT(started, 0) << "the plan starts no collective asynchronously";
  std::map<std::string, std::unique_ptr<InProcessGroup>> groups;
  groups["deployments/d1/1"] = std::make_unique<InProcessGroup>(2);
  groups["deployments/d1/1/overlap"] = std::make_unique<InProcessGroup>(2);
  ExecutorCoreOptions o = InProcessOptions(nullptr);
  absl::Mutex mu;
  std::set<std::string> asked;
  o.connect = [&](const GlooOptions& go,
                  RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    absl::MutexLock l(&mu);
    asked.insert(go.prefix);
    auto it = groups.find(go.prefix);
    if (it == groups.end()) return absl::InternalError("unexpected prefix " + go.prefix);
    if (it->second->comms[go.rank] == nullptr) {
      return absl::FailedPreconditionError("communicator already taken");
    }
    return std::move(it->second->comms[go.rank]);
  };
  ExecutorCore a(o), b(o);
  LoadOptions la = MlpLoad(2, 0, 4), lb = MlpLoad(2, 1, 4);
  la.plan = lb.plan = *overlapped;
  TrainToTheEnd({&a, &b}, {la, lb});
  EXPECT_EQ(asked.count("deployments/d1/1/overlap"), 1u);

  // The in-line plan of the same model and seed.
  InProcessGroup inline_group(2);
  ExecutorCore c(InProcessOptions(&inline_group)), d(InProcessOptions(&inline_group));
  TrainToTheEnd({&c, &d}, {MlpLoad(2, 0, 4), MlpLoad(2, 1, 4)});
  bool done = false;
  auto ma = a.WaitMetrics("", 0, absl::InfiniteFuture(), &done);
  auto mb = b.WaitMetrics("", 0, absl::InfiniteFuture(), &done);
  auto mc = c.WaitMetrics("", 0, absl::InfiniteFuture(), &done);
  ASSERT_THAT(ma, IsOk());
  ASSERT_THAT(mb, IsOk());
  ASSERT_THAT(mc, IsOk());
  ASSERT_EQ(ma->size(), 4u);
  ASSERT_EQ(mc->size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ((*ma)[i].loss(), (*mb)[i].loss()) << "step " << i;
    const double want = (*mc)[i].loss();
    EXPECT_NEAR((*ma)[i].loss(), want, 2e-5 * std::abs(want) + 2e-6) << "step " << i;
  }
}

// Every kernel call is timed: after two warm-up steps, each window of
// profile_window steps becomes the status's profile (what the planner
// calibrates from), the latest complete one.
TEST(ExecutorCoreTest, ReportsPerOpProfilesOfCompleteWindows) {
  InProcessGroup group(2);
  ExecutorCoreOptions o = InProcessOptions(&group);
  o.profile_window = 3;
  ExecutorCore a(o), b(o);
  ASSERT_THAT(a.LoadPlan(MlpLoad(2, 0, 10)), IsOk());  // 2 warm-up + 2 windows + 2
  ASSERT_THAT(b.LoadPlan(MlpLoad(2, 1, 10)), IsOk());
  EXPECT_FALSE(a.Status().has_profile());
  ASSERT_THAT(a.Start(""), IsOk());
  ASSERT_THAT(b.Start(""), IsOk());
  for (ExecutorCore* c : {&a, &b}) {
    v1::ExecutorStatus s = c->WaitUntilDone(absl::InfiniteFuture());
    EXPECT_EQ(s.state(), v1::ExecutorStatus::FINISHED) << s.error();
  }
  const v1::ExecutorStatus s = a.Status();
  ASSERT_TRUE(s.has_profile());
  const v1::StepProfile& p = s.profile();
  EXPECT_EQ(p.first_step(), 5);  // steps 2-4, then 5-7; 8-9 incomplete
  EXPECT_EQ(p.steps(), 3);
  EXPECT_EQ(p.rank(), 0);
  EXPECT_EQ(p.device(), CachedMlpPlan(2).devices(0));
  EXPECT_EQ(p.plan_content_hash(), CachedMlpPlan(2).content_hash());
  EXPECT_GT(p.step_seconds_median(), 0);
  EXPECT_GT(p.device_seconds(), 0);
  EXPECT_LE(p.device_seconds(), 3 * p.step_seconds_median());
  ASSERT_TRUE(p.op_seconds().count("linear")) << p.DebugString();
  EXPECT_GT(p.op_seconds().at("linear"), 0);
  EXPECT_TRUE(p.op_seconds().count("(optimizer)"));
  EXPECT_TRUE(b.Status().has_profile());
  // Off: no profile.
  InProcessGroup g2(2);
  ExecutorCoreOptions off = InProcessOptions(&g2);
  off.profile_window = 0;
  ExecutorCore c(off), d(InProcessOptions(&g2));
  ASSERT_THAT(c.LoadPlan(MlpLoad(2, 0, 6)), IsOk());
  ASSERT_THAT(d.LoadPlan(MlpLoad(2, 1, 6)), IsOk());
  ASSERT_THAT(c.Start(""), IsOk());
  ASSERT_THAT(d.Start(""), IsOk());
  EXPECT_EQ(c.WaitUntilDone(absl::InfiniteFuture()).state(), v1::ExecutorStatus::FINISHED);
  d.WaitUntilDone(absl::InfiniteFuture());
  EXPECT_FALSE(c.Status().has_profile());
}

TEST(ExecutorCoreTest, ShutdownRefusesLoads) {
  ExecutorCore core(InProcessOptions(nullptr));
  core.Shutdown();
  EXPECT_THAT(core.LoadPlan(MlpLoad(2, 0, 3)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
}

// LoadPlan asks `check_caller` whether its caller still waits, between
// its slow parts and before it installs the plan: a load whose caller gave
// up (the planner's deadline passed while a device was made, a checkpoint
// read) installs nothing, and the executor keeps the load it had.
TEST(ExecutorCoreTest, LoadPlanWhoseCallerHasGoneInstallsNothing) {
  bool slow = false;
  absl::Status caller;  // what check_caller answers
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.make_device = [&](int threads) {
    if (slow) caller = absl::DeadlineExceededError("the LoadPlan call's deadline passed");
    return NewCpuDevice(threads);
  };
  ExecutorCore core(options);
  auto check = [&] { return caller; };
  auto hash = core.LoadPlan(MlpLoad(2, 0, 3), check);
  ASSERT_THAT(hash, IsOk());

  slow = true;
  LoadOptions second = MlpLoad(2, 0, 3);
  second.generation = 2;
  EXPECT_THAT(core.LoadPlan(second, check),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("the plan was not installed"),
                             HasSubstr("the LoadPlan call's deadline passed"))));
  v1::ExecutorStatus st = core.Status();
  EXPECT_EQ(st.state(), v1::ExecutorStatus::LOADED);
  EXPECT_EQ(st.generation(), 1);

  // A caller that cancelled before the load began: nothing is done.
  slow = false;
  caller = absl::CancelledError("the caller cancelled LoadPlan");
  EXPECT_THAT(core.LoadPlan(second, check),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("the caller cancelled")));
  EXPECT_EQ(core.Status().generation(), 1);

  caller = absl::OkStatus();
  ASSERT_THAT(core.LoadPlan(second, check), IsOk());
  EXPECT_EQ(core.Status().generation(), 2);
}

// Two LoadPlans race (a re-plan pushed while the previous push is still
// loading): the one that arrived first but finishes last installed its
// plan over the newer one, and both callers were told OK, so the executor
// trained the older generation while the planner took the newer as loaded.
// The later arrival wins; the earlier, finding it installed, is Aborted and
// installs nothing.
TEST(ExecutorCoreTest, AnOlderLoadPlanFinishingLastDoesNotReplaceANewerOne) {
  ExecutorCore core(InProcessOptions(nullptr));
  absl::Notification first_began, second_done;
  std::atomic<int> first_checks{0};
  auto first_check = [&]() -> absl::Status {
    if (first_checks++ == 1) {  // after it began: the second comes and goes
      first_began.Notify();
      second_done.WaitForNotification();
    }
    return absl::OkStatus();
  };
  absl::StatusOr<std::string> first;
  std::thread loader([&] { first = core.LoadPlan(MlpLoad(2, 0, 3), first_check); });
  first_began.WaitForNotification();
  LoadOptions newer = MlpLoad(2, 0, 3);
  newer.generation = 2;
  ASSERT_THAT(core.LoadPlan(newer), IsOk());
  second_done.Notify();
  loader.join();
  EXPECT_THAT(first, StatusIs(absl::StatusCode::kAborted,
                              AllOf(HasSubstr("generation 2"), HasSubstr("not installed"))));
  const v1::ExecutorStatus st = core.Status();
  EXPECT_EQ(st.state(), v1::ExecutorStatus::LOADED);
  EXPECT_EQ(st.generation(), 2);
}

// LoadPlan while training is refused, but only after it had read the
// graph, opened the data, made a device and allocated the plan's arena: a
// second arena next to the one training (on a GPU, out of memory for the
// run in progress, which the refused load was not meant to touch). It is
// refused before anything is built.
TEST(ExecutorCoreTest, LoadPlanWhileTrainingIsRefusedBeforeBuildingAnything) {
  absl::Notification entered, release;
  std::atomic<int> devices{0};
  ExecutorCoreOptions options = InProcessOptions(nullptr);
  options.stop_wait = absl::Seconds(30);
  options.connect = [&](const GlooOptions& go,
                        RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return std::make_unique<testing::HungPeerCommunicator>(go.rank, &entered, &release);
  };
  options.make_device = [&](int threads) {
    ++devices;
    return NewCpuDevice(threads);
  };
  ExecutorCore core(options);
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 1'000)), IsOk());
  ASSERT_THAT(core.Start(""), IsOk());
  entered.WaitForNotification();  // training, inside step 0
  LoadOptions next = MlpLoad(2, 0, 3);
  next.generation = 2;
  EXPECT_THAT(core.LoadPlan(next), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            HasSubstr("stop it before loading another plan")));
  EXPECT_EQ(devices.load(), 1);  // the training load's only
  EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::TRAINING);
  release.Notify();  // the collective fails
  EXPECT_EQ(core.WaitUntilDone(absl::Now() + absl::Seconds(60)).state(),
            v1::ExecutorStatus::FAILED);
}

// A metrics stream stays with the load it began on: when that load is
// replaced by another of the same deployment (a new generation) or
// unloaded, the stream is done; it never goes on with the next load's
// metrics, nor fails because nothing is loaded any more.
TEST(ExecutorCoreTest, MetricsOfABoundLoadEndWithIt) {
  ExecutorCore core(InProcessOptions(nullptr));
  ASSERT_THAT(core.LoadPlan(MlpLoad(2, 0, 3)), IsOk());
  int64_t load = 0;
  bool done = true;
  auto first = core.WaitMetrics("deployments/d1", 0, absl::InfinitePast(), &done, &load);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->empty());
  EXPECT_FALSE(done);
  EXPECT_NE(load, 0);
  LoadOptions again = MlpLoad(2, 0, 3);
  again.generation = 2;
  ASSERT_THAT(core.LoadPlan(again), IsOk());
  auto after = core.WaitMetrics("deployments/d1", 0, absl::Now() + absl::Seconds(60), &done, &load);
  ASSERT_THAT(after, IsOk());
  EXPECT_TRUE(after->empty());
  EXPECT_TRUE(done);
  // Bound to the second load, which is then unloaded.
  load = 0;
  ASSERT_THAT(core.WaitMetrics("", 0, absl::InfinitePast(), &done, &load), IsOk());
  ASSERT_THAT(core.Stop(""), IsOk());
  EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::IDLE);
  auto unloaded = core.WaitMetrics("", 0, absl::Now() + absl::Seconds(60), &done, &load);
  ASSERT_THAT(unloaded, IsOk());
  EXPECT_TRUE(done);
  // Unbound, nothing loaded: FailedPrecondition as before.
  EXPECT_THAT(core.WaitMetrics("", 0, absl::InfinitePast(), &done),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no plan is loaded")));
}

// Trains two ranks of `MlpLoad(2, r, steps)` as changed by `edit`; returns
// rank 0's final status.
v1::ExecutorStatus TrainTwo(int64_t steps, const std::function<void(LoadOptions&)>& edit) {
  InProcessGroup group(2);
  ExecutorCore a(InProcessOptions(&group)), b(InProcessOptions(&group));
  for (int r = 0; r < 2; ++r) {
    LoadOptions o = MlpLoad(2, r, steps);
    edit(o);
    EXPECT_THAT((r == 0 ? a : b).LoadPlan(o), IsOk());
  }
  EXPECT_THAT(a.Start(""), IsOk());
  EXPECT_THAT(b.Start(""), IsOk());
  b.WaitUntilDone(absl::InfiniteFuture());
  return a.WaitUntilDone(absl::InfiniteFuture());
}

// A device whose instances are counted in `*live`; it runs on `inner`.
class CountedDevice : public TimingDevice {
 public:
  CountedDevice(std::unique_ptr<Device> inner, std::atomic<int>* live)
      : TimingDevice(inner.get()), inner_(std::move(inner)), live_(live) {
    ++*live_;
  }
  ~CountedDevice() override { --*live_; }

 private:
  std::unique_ptr<Device> inner_;
  std::atomic<int>* live_;
};

// An ended load cannot train again (Start refuses it) but stays installed
// for its status until the next LoadPlan, which builds its own arena before
// it replaces the old one: on a GPU that holds one copy of a large model,
// every reload (a new generation, an elastic job's next plan) ran out of
// memory. The training thread now frees the load's device, arena and data
// when training ends.
TEST(ExecutorCoreTest, AnEndedLoadKeepsNoDevice) {
  std::atomic<int> live{0};
  InProcessGroup group(2);
  ExecutorCoreOptions options = InProcessOptions(&group);
  options.make_device = [&](int threads) -> std::unique_ptr<Device> {
    return std::make_unique<CountedDevice>(NewCpuDevice(threads), &live);
  };
  ExecutorCore a(options), b(options);
  ASSERT_THAT(a.LoadPlan(MlpLoad(2, 0, 3)), IsOk());
  ASSERT_THAT(b.LoadPlan(MlpLoad(2, 1, 3)), IsOk());
  EXPECT_EQ(live.load(), 2);
  ASSERT_THAT(a.Start(""), IsOk());
  ASSERT_THAT(b.Start(""), IsOk());
  EXPECT_EQ(b.WaitUntilDone(absl::InfiniteFuture()).state(), v1::ExecutorStatus::FINISHED);
  v1::ExecutorStatus st = a.WaitUntilDone(absl::InfiniteFuture());
  EXPECT_EQ(st.state(), v1::ExecutorStatus::FINISHED);
  EXPECT_EQ(st.steps_completed(), 3);
  EXPECT_EQ(live.load(), 0);
}

TEST(ExecutorCoreTest, WritesCheckpointsAndResumesFromThem) {
  const std::string dir = ::testing::TempDir() + "/core_ckpt";
  std::filesystem::remove_all(dir);
  v1::ExecutorStatus first = TrainTwo(4, [&](LoadOptions& o) {
    o.training.set_checkpoint_dir(dir);
    o.training.set_checkpoint_every(2);
  });
  ASSERT_EQ(first.state(), v1::ExecutorStatus::FINISHED) << first.error();
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-00000002/COMMITTED"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-00000004/COMMITTED"));

  // Resume to step 6: two more steps, counted globally.
  v1::ExecutorStatus resumed = TrainTwo(6, [&](LoadOptions& o) {
    o.training.set_resume(dir);
    o.training.set_checkpoint_dir(dir);
  });
  ASSERT_EQ(resumed.state(), v1::ExecutorStatus::FINISHED) << resumed.error();
  EXPECT_EQ(resumed.steps_completed(), 6);
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-00000006/COMMITTED"));

  // Nothing left to train, and a missing checkpoint: LoadPlan says so.
  InProcessGroup group(2);
  ExecutorCore c(InProcessOptions(&group));
  LoadOptions done = MlpLoad(2, 0, 6);
  done.training.set_resume(dir);
  EXPECT_THAT(c.LoadPlan(done), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("is at step 6, not before training.steps 6")));
  LoadOptions missing = MlpLoad(2, 0, 6);
  missing.training.set_resume(dir + "/nope");
  EXPECT_THAT(c.LoadPlan(missing), StatusIs(absl::StatusCode::kNotFound,
                                            HasSubstr("training.resume")));
  LoadOptions both = MlpLoad(2, 0, 6);
  both.training.set_resume(dir);
  both.training.set_init_weights(dir + "/w.safetensors");
  EXPECT_THAT(c.LoadPlan(both), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("exclude each other")));
}

// A run on npy: data resumed after the data was regenerated with another
// sample count: the same spec, so only the size tells; each step would
// have read other samples (some skipped, some twice), silently. The
// checkpoint records the size (trainer.json data_size), and LoadPlan
// refuses the resume naming both.
TEST(ExecutorCoreTest, AResumeOverDataOfAnotherSizeIsRefused) {
  const std::string data = ::testing::TempDir() + "/core_npy";
  const std::string dir = ::testing::TempDir() + "/core_npy_ckpt";
  std::filesystem::remove_all(data);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(data);
  auto write_data = [&](int64_t n) {
    std::vector<float> x(n * 12);
    std::vector<int64_t> labels(n);
    for (int64_t i = 0; i < n; ++i) {
      for (int k = 0; k < 12; ++k) x[i * 12 + k] = 0.01f * static_cast<float>(i + k);
      labels[i] = i % 5;
    }
    data::npy_files::WriteFile(data + "/x.npy",
                               data::npy_files::Npy("<f4", {n, 12}, data::npy_files::Raw(x)));
    data::npy_files::WriteFile(data + "/labels.npy",
                               data::npy_files::Npy("<i8", {n}, data::npy_files::Raw(labels)));
  };
  write_data(20);
  auto on_data = [&](LoadOptions& o) {
    o.training.set_data_spec("npy:" + data);
    o.training.set_checkpoint_dir(dir);
  };
  v1::ExecutorStatus first = TrainTwo(2, on_data);
  ASSERT_EQ(first.state(), v1::ExecutorStatus::FINISHED) << first.error();
  write_data(26);
  InProcessGroup group(2);
  ExecutorCore c(InProcessOptions(&group));
  LoadOptions resume = MlpLoad(2, 0, 4);
  on_data(resume);
  resume.training.set_resume(dir);
  EXPECT_THAT(c.LoadPlan(resume),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("training.resume"),
                             HasSubstr("holding 20, this run has 26 (the data changed since)"))));
  write_data(20);  // as it was: the resume is taken
  EXPECT_THAT(c.LoadPlan(resume), IsOk());
}

// A checkpoint whose shards were damaged after they committed (a flipped
// bit: the checksums they record no longer match) loads (its records are
// intact) and fails each rank before its first step, with the code that
// tells the planner it is the checkpoint's fault (DATA_LOSS), not the
// executor's.
TEST(ExecutorCoreTest, ADamagedCheckpointFailsTheResumeWithDataLoss) {
  const std::string dir = ::testing::TempDir() + "/core_damaged_ckpt";
  std::filesystem::remove_all(dir);
  v1::ExecutorStatus first = TrainTwo(4, [&](LoadOptions& o) {
    o.training.set_checkpoint_dir(dir);
    o.training.set_checkpoint_every(2);
  });
  ASSERT_EQ(first.state(), v1::ExecutorStatus::FINISHED) << first.error();
  EXPECT_EQ(first.error_code(), 0);
  int damaged = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/step-00000004")) {
    if (e.path().extension() != ".safetensors") continue;
    EXPECT_FALSE(checkpoint::test_util::FlipTheLastByte(e.path().string()).empty()) << e.path();
    ++damaged;
  }
  ASSERT_GT(damaged, 0);

  InProcessGroup group(2);
  ExecutorCore a(InProcessOptions(&group)), b(InProcessOptions(&group));
  std::vector<ExecutorCore*> cores = {&a, &b};
  for (int r = 0; r < 2; ++r) {
    LoadOptions o = MlpLoad(2, r, 6);
    o.training.set_resume(dir + "/step-00000004");
    ASSERT_THAT(cores[r]->LoadPlan(o), IsOk());
  }
  for (ExecutorCore* c : cores) ASSERT_THAT(c->Start(""), IsOk());
  for (ExecutorCore* c : cores) {
    v1::ExecutorStatus s = c->WaitUntilDone(absl::InfiniteFuture());
    EXPECT_EQ(s.state(), v1::ExecutorStatus::FAILED);
    EXPECT_EQ(s.error_code(), static_cast<int>(absl::StatusCode::kDataLoss)) << s.error();
    EXPECT_EQ(s.steps_completed(), 0);
    EXPECT_THAT(s.error(), AllOf(HasSubstr("training.resume"), HasSubstr("step-00000004")));
  }
}

// A checkpoint directory that cannot be made was found at the first save:
// with checkpoint_every 0 (only the last step), after the whole run.
TEST(ExecutorCoreTest, ACheckpointDirThatCannotBeMadeIsRefusedAtLoad) {
  const std::string file = ::testing::TempDir() + "/core_ckpt_is_a_file";
  std::ofstream(file) << "not a directory";
  ExecutorCore core(InProcessOptions(nullptr));
  for (const std::string& dir : {file, file + "/ckpt"}) {
    LoadOptions o = MlpLoad(2, 0, 3);
    o.training.set_checkpoint_dir(dir);
    EXPECT_THAT(core.LoadPlan(o),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         ::testing::AllOf(HasSubstr("training.checkpoint_dir"), HasSubstr(dir))));
    EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::IDLE);
  }
  std::filesystem::remove(file);
}

// Four executor cores train `plan` over real Gloo (a file rendezvous store
// in `dir`) to global step `steps`; `edit` adjusts each load. Rank 0's
// losses by step, or the first rank's error. With `profiles`, every rank
// profiles windows of 2 steps and its last one is returned there.
absl::StatusOr<std::map<int64_t, double>> TrainFour(
    const v1::Plan& plan, const std::string& dir, int64_t steps,
    const std::function<void(LoadOptions&)>& edit,
    std::vector<v1::StepProfile>* profiles = nullptr) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<ExecutorCore>> cores;
  for (int r = 0; r < 4; ++r) {
    ExecutorCoreOptions o;
    o.device_id = absl::StrCat("node", r / 2, "/cpu", r % 2);
    o.planner_address = "127.0.0.1:7000";
    o.threads = 1;
    o.comm_timeout = absl::Seconds(60);
    o.make_store = [dir](const LoadOptions&) { return NewFileStore(dir); };
    if (profiles != nullptr) o.profile_window = 2;
    cores.push_back(std::make_unique<ExecutorCore>(o));
    LoadOptions l;
    l.plan = plan;
    l.deployment = "deployments/pipe";
    l.generation = 1;
    l.rank = r;
    l.world_size = 4;
    l.rendezvous_address = "127.0.0.1:7000";
    l.training.set_steps(steps);
    edit(l);
    HAP_RETURN_IF_ERROR(Annotate(cores.back()->LoadPlan(l).status(), absl::StrCat("rank ", r)));
  }
  for (auto& c : cores) HAP_RETURN_IF_ERROR(c->Start("").status());
  for (int r = 0; r < 4; ++r) {
    v1::ExecutorStatus s = cores[r]->WaitUntilDone(absl::InfiniteFuture());
    if (s.state() != v1::ExecutorStatus::FINISHED) {
      return absl::InternalError(absl::StrCat("rank ", r, ": ", s.error()));
    }
    if (profiles != nullptr) profiles->push_back(cores[r]->Status().profile());
  }
  bool done = false;
  HAP_ASSIGN_OR_RETURN(auto metrics, cores[0]->WaitMetrics("", 0, absl::InfiniteFuture(), &done));
  std::map<int64_t, double> losses;
  for (const v1::StepMetric& m : metrics) losses[m.step()] = m.loss();
  return losses;
}

// A pipeline plan (2 stages of 2 ranks, 4 microbatches) runs on executor
// daemons as hap-launch runs it: the same losses as the SPMD plan of the
// same model (both equal the single-device run); it checkpoints over all
// four ranks, and a run resumed from its checkpoint goes on exactly as the
// uninterrupted one.
TEST(ExecutorCoreTest, RunsPipelinePlansAndTheirCheckpoints) {
  auto pipe = testing::MakeMlpTwoNodePlan(true);
  ASSERT_THAT(pipe, IsOk());
  ASSERT_EQ(pipe->pipeline().stages_size(), 2);
  auto spmd = testing::MakeMlpTwoNodePlan(false);
  ASSERT_THAT(spmd, IsOk());
  const std::string base = ::testing::TempDir() + "/core_pipe";
  auto none = [](LoadOptions&) {};
  std::vector<v1::StepProfile> profiles;
  auto p = TrainFour(*pipe, base + "/rv1", 6, none, &profiles);
  ASSERT_THAT(p, IsOk());
  // Every rank profiles its stage's kernels (what the planner calibrates
  // from): the loss op is the last stage's alone.
  ASSERT_EQ(profiles.size(), 4u);
  const std::string loss = pipe->graph().ops(pipe->graph().ops_size() - 1).type();
  const auto& last = pipe->pipeline().stages(1).devices();
  for (int r = 0; r < 4; ++r) {
    const v1::StepProfile& prof = profiles[r];
    EXPECT_EQ(prof.rank(), r);
    EXPECT_EQ(prof.plan_content_hash(), pipe->content_hash());
    EXPECT_EQ(prof.steps(), 2);
    EXPECT_GT(prof.device_seconds(), 0);
    const bool in_last = std::count(last.begin(), last.end(), pipe->devices(r)) > 0;
    EXPECT_EQ(prof.op_seconds().count(loss), in_last ? 1u : 0u) << "rank " << r << " " << loss;
  }
  auto s = TrainFour(*spmd, base + "/rv2", 6, none);
  ASSERT_THAT(s, IsOk());
  ASSERT_EQ(p->size(), 6u);
  ASSERT_EQ(s->size(), 6u);
  for (const auto& [step, loss] : *s) {
    EXPECT_NEAR(p->at(step), loss, 2e-5 * std::abs(loss) + 2e-6) << "step " << step;
  }
  EXPECT_GT(std::abs(p->at(0) - p->at(5)), 1e-4) << "the model did not train";

  const std::string ck = base + "/ck";
  std::filesystem::remove_all(ck);
  auto first = TrainFour(*pipe, base + "/rv3", 3, [&](LoadOptions& o) {
    o.training.set_checkpoint_dir(ck);
  });
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(std::filesystem::exists(ck + "/step-00000003/COMMITTED"));
  auto resumed = TrainFour(*pipe, base + "/rv4", 6, [&](LoadOptions& o) {
    o.training.set_resume(ck);
  });
  ASSERT_THAT(resumed, IsOk());
  ASSERT_EQ(resumed->size(), 3u);
  for (const auto& [step, loss] : *resumed) {
    EXPECT_EQ(loss, p->at(step)) << "step " << step << " resumed";
  }
}

}  // namespace
}  // namespace hap::executor
