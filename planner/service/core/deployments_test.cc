// Deployment supervision against fake executors and a fake clock: every
// rank of a deployment that fails or is stopped is stopped; a silent rank
// fails it after missed_status_limit polls; re-attaching after a restart.
// Time only moves when the supervisor waits, so nothing here sleeps.
#include "planner/service/core/deployments.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

v1::Deployment ThreeRanks() {
  v1::Deployment d;
  d.set_name("deployments/p-g2");
  d.set_plan("plans/p");
  d.set_generation(2);
  d.set_state(v1::Deployment::PENDING);
  for (int r = 0; r < 3; ++r) {
    auto* a = d.add_ranks();
    a->set_rank(r);
    a->set_device(absl::StrCat("node", r, "/cpu0"));
    a->set_executor_address(absl::StrCat("127.0.0.1:500", r));
  }
  return d;
}

// Executors as state machines (executor_core.h in miniature), each of which
// can be made unreachable (dead or frozen: every call fails).
class FakeExecutors : public DeploymentExecutors {
 public:
  explicit FakeExecutors(int n) : ranks(n) {
    for (Rank& x : ranks) x.status.set_state(v1::ExecutorStatus::IDLE);
  }

  struct Rank {
    v1::ExecutorStatus status;  // state IDLE at first
    bool reachable = true;
    absl::Status load_error;
    int stops = 0;  // StopTraining calls that reached it
  };
  std::vector<Rank> ranks;
  int polls = 0;
  // Runs before each GetStatus answer: the test's events.
  std::function<void(int poll)> before_poll;
  // Runs before each StopTraining round is answered.
  std::function<void()> before_stop;

  absl::Status LoadPlan(int rank, const v1::LoadPlanRequest& request,
                        absl::Duration) override {
    Rank& x = ranks[rank];
    if (!x.reachable) return absl::UnavailableError("connection refused");
    if (!x.load_error.ok()) return x.load_error;
    x.status.set_state(v1::ExecutorStatus::LOADED);
    x.status.set_deployment(request.deployment());
    x.status.set_generation(request.generation());
    x.status.set_rank(rank);
    return absl::OkStatus();
  }
  absl::Status StartTraining(int rank, const std::string&, absl::Duration) override {
    Rank& x = ranks[rank];
    if (!x.reachable) return absl::UnavailableError("connection refused");
    x.status.set_state(v1::ExecutorStatus::TRAINING);
    return absl::OkStatus();
  }
  Statuses GetStatus(absl::Duration) override {
    if (before_poll) before_poll(polls);
    ++polls;
    Statuses out;
    for (const Rank& x : ranks) {
      if (x.reachable) {
        out.push_back(x.status);
      } else {
        out.push_back(absl::DeadlineExceededError("Deadline Exceeded"));
      }
    }
    return out;
  }
  Statuses StopTraining(const std::string& deployment, absl::Duration) override {
    if (before_stop) before_stop();
    Statuses out;
    for (Rank& x : ranks) {
      if (!x.reachable) {
        out.push_back(absl::UnavailableError("connection refused"));
        continue;
      }
      ++x.stops;
      if (!x.status.deployment().empty() && x.status.deployment() != deployment) {
        out.push_back(absl::NotFoundError("holds another deployment"));
        continue;
      }
      if (x.status.state() == v1::ExecutorStatus::TRAINING) {
        x.status.set_state(v1::ExecutorStatus::FAILED);
        x.status.set_error("stopped by StopTraining");
      } else if (x.status.state() == v1::ExecutorStatus::LOADED) {
        x.status = v1::ExecutorStatus();
        x.status.set_state(v1::ExecutorStatus::IDLE);
      }
      out.push_back(x.status);
    }
    return out;
  }
  bool Training(int rank) const {
    return ranks[rank].status.state() == v1::ExecutorStatus::TRAINING;
  }
};

// The deployment's record and a clock that moves only when waited on.
class FakeOwner {
 public:
  explicit FakeOwner(v1::Deployment d) : record(std::move(d)) {}

  v1::Deployment record;
  absl::Time now = absl::FromUnixSeconds(1000);
  bool stop = false;
  bool shutdown = false;
  // (state, time) of every update, in order.
  std::vector<std::pair<v1::Deployment::State, absl::Time>> history;
  std::vector<absl::Time> waits;  // deadlines waited for

  DeploymentControl Control() {
    DeploymentControl c;
    c.now = [this] { return now; };
    c.wait = [this](absl::Time deadline, bool stop_wakes) {
      if (shutdown) return Wake::kShutdown;
      if (stop_wakes && stop) return Wake::kStop;
      waits.push_back(deadline);
      if (deadline > now) now = deadline;
      return Wake::kTimeout;
    };
    c.update = [this](const std::function<void(v1::Deployment&)>& edit) {
      edit(record);
      history.emplace_back(record.state(), now);
    };
    return c;
  }
  std::vector<v1::Deployment::State> states() const {
    std::vector<v1::Deployment::State> out;
    for (const auto& [s, t] : history) out.push_back(s);
    return out;
  }
};

DeploymentWatchOptions Options() {
  DeploymentWatchOptions o;
  o.status_interval = absl::Seconds(1);
  o.status_timeout = absl::Seconds(1);
  o.missed_status_limit = 3;
  o.stop_attempts = 3;
  return o;
}

TEST(RankWatchTest, CountsMissedPollsPerRankInARow) {
  v1::Deployment d = ThreeRanks();
  RankWatch watch(d, 3);
  v1::ExecutorStatus training;
  training.set_state(v1::ExecutorStatus::TRAINING);
  training.set_deployment(d.name());
  training.set_generation(2);
  const absl::Status silent = absl::DeadlineExceededError("Deadline Exceeded");
  DeploymentExecutors::Statuses one_silent = {training, silent, training};
  EXPECT_EQ(watch.Observe(one_silent), RankWatch::Verdict::kRunning);
  EXPECT_EQ(watch.Observe(one_silent), RankWatch::Verdict::kRunning);
  // An answer in between starts the count again.
  EXPECT_EQ(watch.Observe({training, training, training}), RankWatch::Verdict::kRunning);
  EXPECT_EQ(watch.Observe(one_silent), RankWatch::Verdict::kRunning);
  EXPECT_EQ(watch.Observe(one_silent), RankWatch::Verdict::kRunning);
  EXPECT_EQ(watch.Observe(one_silent), RankWatch::Verdict::kFailed);
  EXPECT_THAT(watch.error(),
              AllOf(HasSubstr("rank 1 (node1/cpu0 at 127.0.0.1:5001) did not answer 3 status "
                              "polls in a row"),
                    HasSubstr("Deadline Exceeded")));
  EXPECT_THAT(watch.failed_ranks(), ::testing::ElementsAre(1));
}

TEST(RankWatchTest, FailsOnAFailedRankAndNamesEveryProblem) {
  v1::Deployment d = ThreeRanks();
  RankWatch watch(d, 3);
  v1::ExecutorStatus training;
  training.set_state(v1::ExecutorStatus::TRAINING);
  training.set_deployment(d.name());
  training.set_generation(2);
  v1::ExecutorStatus failed = training;
  failed.set_state(v1::ExecutorStatus::FAILED);
  failed.set_error("connecting the ranks: connection closed by peer 2");
  EXPECT_EQ(watch.Observe({failed, training, absl::UnavailableError("connection refused")}),
            RankWatch::Verdict::kFailed);
  EXPECT_THAT(watch.error(),
              AllOf(HasSubstr("rank 0 (node0/cpu0 at 127.0.0.1:5000) failed: connecting the "
                              "ranks: connection closed by peer 2"),
                    HasSubstr("rank 2 (node2/cpu0 at 127.0.0.1:5002) did not answer 1 status "
                              "poll: connection refused")));
  // Rank 0 answers (alive); rank 2 is unreachable when it fails.
  EXPECT_THAT(watch.failed_ranks(), ::testing::ElementsAre(2));
}

TEST(RankWatchTest, ARankThatHoldsAnotherDeploymentOrNoneIsGone) {
  v1::Deployment d = ThreeRanks();
  v1::ExecutorStatus training;
  training.set_state(v1::ExecutorStatus::TRAINING);
  training.set_deployment(d.name());
  training.set_generation(2);
  v1::ExecutorStatus idle;  // a restarted executor
  idle.set_state(v1::ExecutorStatus::IDLE);
  v1::ExecutorStatus older = training;
  older.set_generation(1);
  RankWatch a(d, 3);
  EXPECT_EQ(a.Observe({training, idle, training}), RankWatch::Verdict::kFailed);
  EXPECT_THAT(a.error(), HasSubstr("rank 1 (node1/cpu0 at 127.0.0.1:5001) no longer holds this "
                                   "deployment: its executor holds none (IDLE)"));
  RankWatch b(d, 3);
  EXPECT_EQ(b.Observe({training, training, older}), RankWatch::Verdict::kFailed);
  EXPECT_THAT(b.error(), HasSubstr("holds 'deployments/p-g2' generation 1 (TRAINING)"));
  EXPECT_THAT(a.failed_ranks(), ::testing::ElementsAre(1));
  EXPECT_THAT(b.failed_ranks(), ::testing::ElementsAre(2));
}

TEST(RankWatchTest, SucceedsWhenEveryRankFinished) {
  v1::Deployment d = ThreeRanks();
  RankWatch watch(d, 3);
  v1::ExecutorStatus finished;
  finished.set_state(v1::ExecutorStatus::FINISHED);
  finished.set_deployment(d.name());
  finished.set_generation(2);
  v1::ExecutorStatus training = finished;
  training.set_state(v1::ExecutorStatus::TRAINING);
  EXPECT_EQ(watch.Observe({finished, training, finished}), RankWatch::Verdict::kRunning);
  EXPECT_EQ(watch.Observe({finished, finished, finished}), RankWatch::Verdict::kSucceeded);
}

// A rank goes silent (SIGSTOP, a dead host): the deployment fails after
// missed_status_limit polls, not after a 30 s call deadline, and the other
// ranks are stopped.
TEST(DeploymentsTest, ASilentRankFailsTheDeploymentAndTheOthersAreStopped) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  absl::Time silent_from;
  ex.before_poll = [&](int poll) {
    if (poll == 2) {
      ex.ranks[1].reachable = false;
      silent_from = owner.now;
    }
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  ASSERT_EQ(owner.record.state(), v1::Deployment::FAILED);
  EXPECT_THAT(owner.record.error(),
              AllOf(HasSubstr("rank 1 (node1/cpu0 at 127.0.0.1:5001) did not answer 3 status "
                              "polls in a row"),
                    HasSubstr("not confirmed stopped after 3 attempts: rank 1")));
  ASSERT_GE(owner.history.size(), 2u);
  EXPECT_EQ(owner.history[0].first, v1::Deployment::RUNNING);
  EXPECT_EQ(owner.history[1].first, v1::Deployment::FAILED);
  // Polls 2, 3 and 4 went unanswered: FAILED two intervals after the first.
  EXPECT_EQ(owner.history[1].second - silent_from, absl::Seconds(2));
  EXPECT_FALSE(ex.Training(0));
  EXPECT_FALSE(ex.Training(2));
  EXPECT_EQ(ex.ranks[0].status.state(), v1::ExecutorStatus::FAILED);
  // The silent rank was asked again, status_interval apart.
  EXPECT_EQ(owner.now - owner.history[1].second, absl::Seconds(2));
}

TEST(DeploymentsTest, ARankThatFailsStopsTheOthers) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll == 1) {
      ex.ranks[2].status.set_state(v1::ExecutorStatus::FAILED);
      ex.ranks[2].status.set_error("out of memory");
    }
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::RUNNING, v1::Deployment::FAILED));
  EXPECT_THAT(owner.record.error(), HasSubstr("rank 2 (node2/cpu0 at 127.0.0.1:5002) failed: "
                                              "out of memory"));
  EXPECT_THAT(owner.record.error(), Not(HasSubstr("not confirmed")));
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(ex.Training(r)) << r;
    EXPECT_EQ(ex.ranks[r].stops, 1) << r;
  }
}

TEST(DeploymentsTest, AFailedLoadUnloadsTheRanksLoadedBefore) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  ex.ranks[2].load_error = absl::ResourceExhaustedError("the arena does not fit");
  FakeOwner owner(d);
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::FAILED));
  EXPECT_THAT(owner.record.error(),
              HasSubstr("LoadPlan on rank 2 (node2/cpu0 at 127.0.0.1:5002): the arena"));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ex.ranks[r].status.state(), v1::ExecutorStatus::IDLE) << r;
  }
}

v1::Deployment Resuming() {
  v1::Deployment d = ThreeRanks();
  d.mutable_training()->set_resume("/ck/step-00000200");
  return d;
}

// A rank's status as an executor whose restore of a damaged checkpoint
// failed it: DATA_LOSS before its first step.
void FailWithDamage(v1::ExecutorStatus& s, int64_t steps_completed = 0) {
  s.set_state(v1::ExecutorStatus::FAILED);
  s.set_error_code(static_cast<int>(absl::StatusCode::kDataLoss));
  s.set_steps_completed(steps_completed);
  s.set_error(
      "training.resume: /ck/step-00000200/rank-00001.safetensors: tensor 'w1' does not match "
      "its checksum");
}

// LoadPlan's DataLoss on a resumed run: the checkpoint's records are
// damaged. The deployment names the checkpoint, and not the rank, whose
// executor is fine (a job would otherwise keep its device out).
TEST(DeploymentsTest, ADamagedCheckpointAtLoadIsTheCheckpointsFaultNotTheRanks) {
  v1::Deployment d = Resuming();
  FakeExecutors ex(3);
  ex.ranks[1].load_error = absl::DataLossError(
      "training.resume: the checkpoint file /ck/step-00000200/trainer.json is corrupted");
  FakeOwner owner(d);
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::FAILED));
  EXPECT_EQ(owner.record.damaged_checkpoint(), "/ck/step-00000200");
  EXPECT_THAT(owner.record.failed_ranks(), ::testing::IsEmpty());
  EXPECT_THAT(owner.record.error(), HasSubstr("trainer.json is corrupted"));

  // The same code from a run that resumes nothing (a damaged init_weights
  // file, for one) names no checkpoint; other codes neither.
  for (const v1::Deployment& other : {ThreeRanks(), Resuming()}) {
    FakeExecutors ex2(3);
    ex2.ranks[1].load_error = other.training().resume().empty()
                                  ? absl::DataLossError("w.safetensors is damaged")
                                  : absl::UnavailableError("connection refused");
    FakeOwner owner2(other);
    RunDeployment(other, v1::Plan(), "127.0.0.1:7000", ex2, Options(), owner2.Control());
    EXPECT_THAT(owner2.states(), ElementsAre(v1::Deployment::FAILED));
    EXPECT_EQ(owner2.record.damaged_checkpoint(), "");
    EXPECT_THAT(owner2.record.failed_ranks(), ElementsAre(1));
  }
}

TEST(DeploymentsTest, ARankThatADamagedCheckpointFailedNamesIt) {
  v1::Deployment d = Resuming();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll == 1) FailWithDamage(ex.ranks[0].status);
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::RUNNING, v1::Deployment::FAILED));
  EXPECT_EQ(owner.record.damaged_checkpoint(), "/ck/step-00000200");
  EXPECT_THAT(owner.record.failed_ranks(), ::testing::IsEmpty());
  EXPECT_THAT(owner.record.error(), HasSubstr("does not match its checksum"));
}

// The poll found a peer failed first (the damaged rank's end closed its
// connections before its own state said why); the stop's answers say it.
TEST(DeploymentsTest, ADamagedCheckpointSeenOnlyWhenTheRanksAreStoppedIsNamed) {
  v1::Deployment d = Resuming();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll != 1) return;
    ex.ranks[2].status.set_state(v1::ExecutorStatus::FAILED);
    ex.ranks[2].status.set_error_code(static_cast<int>(absl::StatusCode::kUnavailable));
    ex.ranks[2].status.set_error("connection closed by peer rank 0");
  };
  ex.before_stop = [&] {
    if (ex.Training(0)) FailWithDamage(ex.ranks[0].status);
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_EQ(owner.record.state(), v1::Deployment::FAILED);
  EXPECT_EQ(owner.record.damaged_checkpoint(), "/ck/step-00000200");
  EXPECT_THAT(owner.record.error(), HasSubstr("connection closed by peer"));
}

// DATA_LOSS after training steps is not the checkpoint it resumed from
// (the restore ended well before): nothing is named.
TEST(DeploymentsTest, DataLossAfterTrainingStepsIsNotTheResumedCheckpoint) {
  v1::Deployment d = Resuming();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll == 1) FailWithDamage(ex.ranks[0].status, /*steps_completed=*/205);
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_EQ(owner.record.state(), v1::Deployment::FAILED);
  EXPECT_EQ(owner.record.damaged_checkpoint(), "");
}

TEST(DeploymentsTest, AStopRequestStopsEveryRank) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll == 3) owner.stop = true;
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::RUNNING, v1::Deployment::STOPPED));
  EXPECT_EQ(owner.record.error(), "");
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ex.ranks[r].status.state(), v1::ExecutorStatus::FAILED) << r;
    EXPECT_EQ(ex.ranks[r].stops, 1) << r;
  }
}

// The ranks' per-op profiles go into the record when a poll brings a new
// window (not at every poll).
TEST(DeploymentsTest, KeepsEachRanksLatestProfile) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  int updates_at_poll_4 = 0;
  ex.before_poll = [&](int poll) {
    auto window = [&](int r, int64_t first) {
      v1::StepProfile* p = ex.ranks[r].status.mutable_profile();
      p->set_first_step(first);
      p->set_steps(20);
      p->set_step_seconds_median(0.1 * (r + 1));
    };
    if (poll == 2) {
      for (int r = 0; r < 3; ++r) window(r, 2);
    }
    if (poll == 4) {
      updates_at_poll_4 = static_cast<int>(owner.history.size());
      window(1, 22);
    }
    if (poll == 6) owner.stop = true;
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  ASSERT_EQ(owner.record.rank_profiles_size(), 3);
  EXPECT_EQ(owner.record.rank_profiles(0).first_step(), 2);
  EXPECT_EQ(owner.record.rank_profiles(1).first_step(), 22);
  EXPECT_EQ(owner.record.rank_profiles(1).rank(), 1);
  EXPECT_DOUBLE_EQ(owner.record.rank_profiles(2).step_seconds_median(), 0.3);
  // RUNNING, the first windows (poll 2), rank 1's next (poll 4): one update
  // each, none for the polls that brought nothing new.
  EXPECT_EQ(updates_at_poll_4, 2);
}

// The backend each rank runs on (ExecutorStatus.backend) goes into the
// record's ranks once a poll reports it, so that `hapctl describe
// deployment` shows a GPU rank that runs on the CPU; a poll that brings
// nothing new saves nothing.
TEST(DeploymentsTest, KeepsTheBackendEachRankRunsOn) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  size_t updates_at_poll_4 = 0, updates_at_poll_5 = 0;
  ex.before_poll = [&](int poll) {
    if (poll == 2) {
      for (int r = 0; r < 3; ++r) ex.ranks[r].status.set_backend(r == 1 ? "cpu" : "cuda:0");
    }
    if (poll == 4) updates_at_poll_4 = owner.history.size();
    if (poll == 5) updates_at_poll_5 = owner.history.size();
    if (poll == 6) owner.stop = true;
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  ASSERT_EQ(owner.record.ranks_size(), 3);
  EXPECT_EQ(owner.record.ranks(0).backend(), "cuda:0");
  EXPECT_EQ(owner.record.ranks(1).backend(), "cpu");
  EXPECT_EQ(owner.record.ranks(2).backend(), "cuda:0");
  EXPECT_EQ(owner.record.ranks(1).device(), d.ranks(1).device());
  EXPECT_EQ(updates_at_poll_4, 2u);  // RUNNING, then the backends (poll 2)
  EXPECT_EQ(updates_at_poll_5, updates_at_poll_4);
}

// A run that ends before any poll of it while RUNNING still records its
// ranks' backends.
TEST(DeploymentsTest, ARunThatEndsAtItsFirstPollRecordsItsBackends) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll != 1) return;
    for (int r = 0; r < 3; ++r) {
      ex.ranks[r].status.set_backend("cpu");
      ex.ranks[r].status.set_state(v1::ExecutorStatus::FINISHED);
    }
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_EQ(owner.record.state(), v1::Deployment::SUCCEEDED);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(owner.record.ranks(r).backend(), "cpu") << r;
}

// So does one that fails at its first poll: where its ranks ran is what
// one asks of a failed run (a GPU rank that ran on the CPU).
TEST(DeploymentsTest, ARunThatFailsAtItsFirstPollRecordsItsBackends) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll != 1) return;
    for (int r = 0; r < 3; ++r) ex.ranks[r].status.set_backend("cpu");
    ex.ranks[2].status.set_state(v1::ExecutorStatus::FAILED);
    ex.ranks[2].status.set_error("out of memory");
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_EQ(owner.record.state(), v1::Deployment::FAILED);
  EXPECT_THAT(owner.record.error(), HasSubstr("out of memory"));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(owner.record.ranks(r).backend(), "cpu") << r;
}

TEST(DeploymentsTest, ShutdownLeavesTheExecutorsTraining) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  FakeOwner owner(d);
  ex.before_poll = [&](int poll) {
    if (poll == 2) owner.shutdown = true;
  };
  RunDeployment(d, v1::Plan(), "127.0.0.1:7000", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::RUNNING));
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(ex.Training(r)) << r;
    EXPECT_EQ(ex.ranks[r].stops, 0) << r;
  }
}

// A restarted planner re-attaches to a RUNNING deployment: ranks still
// training it are watched on; once it finishes it is SUCCEEDED.
TEST(DeploymentsTest, ReattachesToRanksStillTraining) {
  v1::Deployment d = ThreeRanks();
  d.set_state(v1::Deployment::RUNNING);
  FakeExecutors ex(3);
  for (int r = 0; r < 3; ++r) {
    ex.ranks[r].status.set_state(v1::ExecutorStatus::TRAINING);
    ex.ranks[r].status.set_deployment(d.name());
    ex.ranks[r].status.set_generation(2);
  }
  ex.before_poll = [&](int poll) {
    if (poll == 4) {
      for (auto& x : ex.ranks) x.status.set_state(v1::ExecutorStatus::FINISHED);
    }
  };
  FakeOwner owner(d);
  WatchDeployment(d, ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::SUCCEEDED));
  EXPECT_EQ(ex.polls, 5);
}

// ... and one whose rank restarted meanwhile fails at the first poll, the
// others stopped.
TEST(DeploymentsTest, ReattachingFindsARankGoneAndStopsTheRest) {
  v1::Deployment d = ThreeRanks();
  d.set_state(v1::Deployment::RUNNING);
  FakeExecutors ex(3);
  for (int r = 0; r < 3; ++r) {
    ex.ranks[r].status.set_state(v1::ExecutorStatus::TRAINING);
    ex.ranks[r].status.set_deployment(d.name());
    ex.ranks[r].status.set_generation(2);
  }
  ex.ranks[0].status = v1::ExecutorStatus();  // restarted: IDLE, holds nothing
  ex.ranks[0].status.set_state(v1::ExecutorStatus::IDLE);
  FakeOwner owner(d);
  const absl::Time start = owner.now;
  WatchDeployment(d, ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::FAILED));
  EXPECT_EQ(owner.history[0].second, start);  // the first poll is at once
  EXPECT_THAT(owner.record.error(), HasSubstr("rank 0 (node0/cpu0 at 127.0.0.1:5000) no longer "
                                              "holds this deployment"));
  EXPECT_FALSE(ex.Training(1));
  EXPECT_FALSE(ex.Training(2));
}

TEST(DeploymentsTest, AnUnfinishedPushIsFailedAndItsRanksStopped) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  ex.ranks[0].status.set_state(v1::ExecutorStatus::LOADED);
  ex.ranks[0].status.set_deployment(d.name());
  ex.ranks[0].status.set_generation(2);
  ex.ranks[1].status = ex.ranks[0].status;
  ex.ranks[1].status.set_state(v1::ExecutorStatus::TRAINING);
  FakeOwner owner(d);
  FailUnfinishedDeployment(d, "the planner restarted", ex, Options(), owner.Control());
  EXPECT_THAT(owner.states(), ElementsAre(v1::Deployment::FAILED));
  EXPECT_EQ(owner.record.error(), "the planner restarted");
  EXPECT_EQ(ex.ranks[0].status.state(), v1::ExecutorStatus::IDLE);
  EXPECT_EQ(ex.ranks[1].status.state(), v1::ExecutorStatus::FAILED);
}

TEST(DeploymentsTest, StopRanksOnceNamesTheRanksNotConfirmed) {
  v1::Deployment d = ThreeRanks();
  FakeExecutors ex(3);
  for (int r = 0; r < 3; ++r) {
    ex.ranks[r].status.set_state(v1::ExecutorStatus::TRAINING);
    ex.ranks[r].status.set_deployment(r == 1 ? "deployments/other-g1" : d.name());
    ex.ranks[r].status.set_generation(2);
  }
  ex.ranks[2].reachable = false;
  EXPECT_THAT(StopRanksOnce(d, ex, Options()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("not confirmed stopped after 1 attempt: rank 2 "
                                       "(node2/cpu0 at 127.0.0.1:5002): connection refused"),
                             Not(HasSubstr("rank 1")))));
  EXPECT_EQ(ex.ranks[0].status.state(), v1::ExecutorStatus::FAILED);
  EXPECT_TRUE(ex.Training(1));  // another deployment's: left alone
  ex.ranks[2].reachable = true;
  EXPECT_THAT(StopRanksOnce(d, ex, Options()), IsOk());
  EXPECT_FALSE(ex.Training(2));
}

TEST(DeploymentsTest, OptionsOutOfRangeAreNamed) {
  DeploymentWatchOptions o;
  EXPECT_THAT(ValidateDeploymentWatchOptions(o), IsOk());
  o.status_timeout = absl::ZeroDuration();
  EXPECT_THAT(ValidateDeploymentWatchOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("status_timeout (0)")));
  o = DeploymentWatchOptions();
  o.missed_status_limit = 0;
  EXPECT_THAT(ValidateDeploymentWatchOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missed_status_limit (0)")));
}

}  // namespace
}  // namespace hap::service
