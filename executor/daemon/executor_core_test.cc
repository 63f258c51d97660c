// The executor core without gRPC: states and their transitions, LoadPlan's
// validation, two ranks over an in-process communicator, profiles, metrics,
// checkpoints and pipeline plans (stops and failures: executor_core_stop_test).
#include "executor/daemon/executor_core.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
#include "executor/train/backend.h"
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

// --planner takes gRPC's target schemes (CheckPlannerAddress: dns:, ipv4:,
// ipv6:); the planner advertises a bare HOST:PORT. An executor started with
// --planner ipv6:[::1]:7000 refused every plan of the planner at [::1]:7000.
TEST(ExecutorCoreTest, GrpcTargetSchemesNameTheSamePlanner) {
  // A plan loaded by an executor of --planner `planner` from the planner
  // that advertises `rendezvous`.
  auto load = [](const std::string& planner, const std::string& rendezvous) {
    ExecutorCoreOptions o = InProcessOptions(nullptr);
    o.planner_address = planner;
    ExecutorCore core(o);
    LoadOptions l = MlpLoad(2, 0, 3);
    l.rendezvous_address = rendezvous;
    return core.LoadPlan(l).status();
  };
  const std::vector<std::pair<std::string, std::string>> same = {
      {"ipv6:[::1]:7000", "[::1]:7000"},
      {"[::1]:7000", "ipv6:[::1]:7000"},
      {"dns://10.0.0.53/127.0.0.1:7000", "127.0.0.1:7000"},
      {"dns:///127.0.0.1:7000", "ipv4:127.0.0.1:7000"}};
  for (const auto& [planner, rendezvous] : same) {
    EXPECT_THAT(load(planner, rendezvous), IsOk()) << planner << " and " << rendezvous;
  }
  const std::vector<std::pair<std::string, std::string>> other = {
      {"ipv6:[::1]:7000", "[::2]:7000"}, {"dns://127.0.0.1/10.0.0.9:7000", "127.0.0.1:7000"}};
  for (const auto& [planner, rendezvous] : other) {
    EXPECT_THAT(load(planner, rendezvous),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(rendezvous)))
        << planner << " and " << rendezvous;
  }
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

// A profile names the plan's device (StepProfile.device), whose
// calibration the planner fits to it. A rank the plan places on a GPU that
// runs on the CPU (--device cpu, as ChooseDevice advises for plans mixing
// GPUs and CPUs, or a build without CUDA) reported CPU times for the GPU,
// and the planner calibrated the GPU as if it were that CPU.
// CachedMlpPlan(2) with every device of its cluster a GPU, as planned.
v1::Plan GpuPlannedMlpPlan() {
  v1::Plan plan = CachedMlpPlan(2);
  for (v1::Node& n : *plan.mutable_cluster()->mutable_nodes()) {
    int index = 0;
    for (v1::Device& d : *n.mutable_devices()) {
      d.set_kind(v1::GPU);
      d.set_local_index(index++);
    }
  }
  plan.set_cluster_hash(lower::Sha256Hex(plan.cluster()));
  plan.set_content_hash(lower::ContentHash(plan));
  EXPECT_EQ(PlannedDevice(plan, 0).kind, DeviceSpec::Kind::kCuda);
  return plan;
}

TEST(ExecutorCoreTest, ARankPlannedOnAGpuThatRunsOnTheCpuReportsNoProfile) {
  const v1::Plan plan = GpuPlannedMlpPlan();
  InProcessGroup group(2);
  ExecutorCoreOptions o = InProcessOptions(&group);
  o.profile_window = 3;
  o.make_device = [](int threads) { return NewCpuDevice(threads); };  // on the CPU
  ExecutorCore a(o), b(o);
  LoadOptions la = MlpLoad(2, 0, 10), lb = MlpLoad(2, 1, 10);
  la.plan = lb.plan = plan;
  TrainToTheEnd({&a, &b}, {la, lb});
  EXPECT_EQ(a.Status().steps_completed(), 10);
  EXPECT_FALSE(a.Status().has_profile()) << a.Status().profile().DebugString();
  EXPECT_FALSE(b.Status().has_profile());
}

// The daemon's log (`kubectl logs`): a line per load naming the device the
// rank runs on, the start and the end of training, and every log_every-th
// step and the last. training.log_every was sent to every executor and
// read by none; the daemon logged nothing of a deployment.
TEST(ExecutorCoreTest, LogsLoadsTrainingAndEveryLogEveryStep) {
  InProcessGroup group(2);
  absl::Mutex mu;
  std::vector<std::string> lines;
  ExecutorCoreOptions o = InProcessOptions(&group);
  ExecutorCore b(o);
  o.log = [&](const std::string& line) {
    absl::MutexLock l(&mu);
    lines.push_back(line);
  };
  ExecutorCore a(o);
  LoadOptions la = MlpLoad(2, 0, 5), lb = MlpLoad(2, 1, 5);
  la.training.set_log_every(2);
  lb.training.set_log_every(2);
  TrainToTheEnd({&a, &b}, {la, lb});
  EXPECT_EQ(a.Status().backend(), "cpu");
  absl::MutexLock l(&mu);
  ASSERT_EQ(lines.size(), 6u) << absl::StrJoin(lines, "\n");
  EXPECT_THAT(lines[0], HasSubstr("loaded deployments/d1 generation 1: rank 0 of 2 on cpu, plan "));
  EXPECT_EQ(lines[1], "deployments/d1 generation 1 rank 0: training steps 0 to 4");
  EXPECT_THAT(lines[2], HasSubstr("deployments/d1 generation 1 rank 0: step 1 loss "));
  EXPECT_THAT(lines[3], HasSubstr("rank 0: step 3 loss "));
  EXPECT_THAT(lines[4], AllOf(HasSubstr("rank 0: step 4 loss "), HasSubstr(" ms")));
  EXPECT_EQ(lines[5], "deployments/d1 generation 1 rank 0: FINISHED, 5 of 5 steps done");

  LoadOptions bad = MlpLoad(2, 0, 5);
  bad.training.set_log_every(-1);
  EXPECT_THAT(
      a.LoadPlan(bad),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("training.log_every must be 0 (every 100th step) or more, got -1")));
}

// A rank the plan places on a GPU that its executor runs on the CPU
// (--device cpu, or a build without CUDA) trains several times slower than
// planned; the daemon said nothing of it.
TEST(ExecutorCoreTest, ARankPlannedOnAGpuRunOnTheCpuIsLoggedAndShown) {
  std::vector<std::string> lines;
  ExecutorCoreOptions o = InProcessOptions(nullptr);
  o.device = "cpu";
  o.log = [&lines](const std::string& line) { lines.push_back(line); };
  ExecutorCore core(o);
  LoadOptions lo = MlpLoad(2, 0, 3);
  lo.plan = GpuPlannedMlpPlan();
  ASSERT_THAT(core.LoadPlan(lo), IsOk());
  EXPECT_EQ(core.Status().backend(), "cpu");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("rank 0 of 2 on cpu, plan "));
  EXPECT_THAT(lines[0], HasSubstr("(the plan places rank 0 on cuda:0 but this executor was "
                                  "started with --device cpu)"));
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

// A device that refuses, and counts, copies to the host once `*armed`.
class ArmedCopyDevice : public TimingDevice {
 public:
  ArmedCopyDevice(std::unique_ptr<Device> inner, const std::atomic<bool>* armed,
                  std::atomic<int>* copies)
      : TimingDevice(inner.get()), inner_(std::move(inner)), armed_(armed), copies_(copies) {}
  absl::Status CopyToHost(TensorView src, void* dst) override {
    if (!armed_->load()) return TimingDevice::CopyToHost(src, dst);
    ++*copies_;
    return absl::DataLossError("a copy to the host after the last step");
  }

 private:
  std::unique_ptr<Device> inner_;
  const std::atomic<bool>* armed_;
  std::atomic<int>* copies_;
};

// TrainRank copied every parameter to the host after the last step, for a
// TrainResult the daemon discards: on a GPU a host copy of the whole model
// at the end of every run, and a copy that failed turned a run that had
// finished every step into FAILED. The daemon asks for no parameters now.
TEST(ExecutorCoreTest, AFinishedRunCopiesNoParametersToTheHost) {
  InProcessGroup group(2);
  std::atomic<bool> armed[2] = {false, false};
  std::atomic<int> copies{0};
  std::vector<std::unique_ptr<ExecutorCore>> cores;
  for (int r = 0; r < 2; ++r) {
    ExecutorCoreOptions o = InProcessOptions(&group);
    o.profile_window = 0;
    o.make_device = [&, r](int threads) -> std::unique_ptr<Device> {
      return std::make_unique<ArmedCopyDevice>(NewCpuDevice(threads), &armed[r], &copies);
    };
    // On the rank's training thread, after its last step's work.
    o.on_step = [&, r](const v1::StepMetric& m) {
      if (m.step() == 2) armed[r] = true;
    };
    cores.push_back(std::make_unique<ExecutorCore>(o));
  }
  TrainToTheEnd({cores[0].get(), cores[1].get()}, {MlpLoad(2, 0, 3), MlpLoad(2, 1, 3)});
  EXPECT_EQ(copies.load(), 0);
  EXPECT_EQ(cores[0]->Status().steps_completed(), 3);
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

// Each executor opens training.resume itself and takes the newest complete
// checkpoint it sees. Directories that differ between nodes (a save that
// reached one node only) gave ranks different steps, and they trained on
// from different states. Over Gloo the ranks compare where they start
// before step 1: both fail, each naming the other's checkpoint.
TEST(ExecutorCoreTest, RanksThatFindDifferentCheckpointsFailBeforeTraining) {
  const std::string dir = ::testing::TempDir() + "/core_ckpt_differ";
  const std::string older = dir + "-older";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(older);
  v1::ExecutorStatus first = TrainTwo(4, [&](LoadOptions& o) {
    o.training.set_checkpoint_dir(dir);
    o.training.set_checkpoint_every(2);
  });
  ASSERT_EQ(first.state(), v1::ExecutorStatus::FINISHED) << first.error();
  std::filesystem::copy(dir, older, std::filesystem::copy_options::recursive);
  std::filesystem::remove_all(older + "/step-00000004");

  const std::string store_dir = ::testing::TempDir() + "/core_ckpt_differ_store";
  std::filesystem::remove_all(store_dir);
  std::filesystem::create_directories(store_dir);
  auto options = testing::GlooThroughStore(
      absl::Seconds(30), absl::Seconds(3),
      [store_dir](const LoadOptions&) { return NewFileStore(store_dir); });
  ExecutorCore a(options), b(options);
  LoadOptions la = MlpLoad(2, 0, 6), lb = MlpLoad(2, 1, 6);
  la.training.set_resume(dir);
  lb.training.set_resume(older);
  ASSERT_THAT(a.LoadPlan(la), IsOk());
  ASSERT_THAT(b.LoadPlan(lb), IsOk());
  ASSERT_THAT(a.Start(""), IsOk());
  ASSERT_THAT(b.Start(""), IsOk());
  v1::ExecutorStatus sa = a.WaitUntilDone(absl::InfiniteFuture());
  v1::ExecutorStatus sb = b.WaitUntilDone(absl::InfiniteFuture());
  EXPECT_EQ(sa.state(), v1::ExecutorStatus::FAILED);
  EXPECT_EQ(sb.state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(sa.error(), HasSubstr(absl::StrCat("rank 0 starts from checkpoint ", dir,
                                                 "/step-00000004 (step 4) but rank 1 from "
                                                 "checkpoint ",
                                                 older, "/step-00000002 (step 2)")));
  EXPECT_THAT(sb.error(), HasSubstr("rank 1 starts from checkpoint"));
  EXPECT_EQ(sa.steps_completed(), 0);  // no step trained
  EXPECT_EQ(sb.steps_completed(), 0);
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
