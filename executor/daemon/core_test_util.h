// Tests only: executor cores on in-process ranks — the test plans' loads and
// options whose communicators come from one in-process group, for tests of
// ExecutorCore without sockets.
#ifndef HAP_EXECUTOR_DAEMON_CORE_TEST_UTIL_H_
#define HAP_EXECUTOR_DAEMON_CORE_TEST_UTIL_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "executor/cpu/cpu_device.h"
#include "executor/daemon/executor_core.h"
#include "executor/daemon/test_plans.h"
#include "executor/train/in_process_comm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::testing {

// MakeMlpPlan(world), made once per world size.
inline const hap::v1::Plan& CachedMlpPlan(int world) {
  static auto* plans = new std::map<int, hap::v1::Plan>;
  static absl::Mutex mu;
  absl::MutexLock l(&mu);
  auto it = plans->find(world);
  if (it == plans->end()) {
    auto p = MakeMlpPlan(world);
    EXPECT_THAT(p, ::hap::testing::IsOk());
    it = plans->emplace(world, p.ok() ? *p : hap::v1::Plan()).first;
  }
  return it->second;
}

// Rank `rank` of CachedMlpPlan(world) as deployment "deployments/d1",
// generation 1, training `steps` steps.
inline LoadOptions MlpLoad(int world, int rank, int64_t steps) {
  LoadOptions o;
  o.plan = CachedMlpPlan(world);
  o.deployment = "deployments/d1";
  o.generation = 1;
  o.rank = rank;
  o.world_size = world;
  o.rendezvous_address = "127.0.0.1:7000";
  o.training.set_steps(steps);
  return o;
}

// Communicators of one in-process group, handed out by rank.
struct InProcessGroup {
  explicit InProcessGroup(int n) : comms(NewInProcessGroup(n)) {}
  std::vector<std::unique_ptr<Communicator>> comms;
  absl::Mutex mu;
};

// A core of device node0/cpu0 whose ranks connect through `group` (each rank
// once; only MlpLoad's deployment and generation).
inline ExecutorCoreOptions InProcessOptions(InProcessGroup* group) {
  ExecutorCoreOptions o;
  o.device_id = "node0/cpu0";
  o.planner_address = "127.0.0.1:7000";
  o.make_store = [](const LoadOptions&) {
    return NewFileStore(::testing::TempDir());  // unused by the in-process group
  };
  o.connect = [group](const GlooOptions& go,
                      RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    absl::MutexLock l(&group->mu);
    if (go.prefix != "deployments/d1/1") {
      return absl::InternalError("unexpected prefix " + go.prefix);
    }
    if (group->comms[go.rank] == nullptr) {
      return absl::FailedPreconditionError("communicator already taken");
    }
    return std::move(group->comms[go.rank]);
  };
  return o;
}

// A communicator whose peer never answers: every collective blocks until
// `release` is notified, then fails as a vanished peer does. With `inner`
// and `armed`, calls go to `inner` until `*armed` is set, and hang from then
// on (the peer vanishes mid-run).
class HungPeerCommunicator : public Communicator {
 public:
  HungPeerCommunicator(int rank, absl::Notification* entered, absl::Notification* release)
      : rank_(rank), entered_(entered), release_(release) {}
  HungPeerCommunicator(std::unique_ptr<Communicator> inner, const std::atomic<bool>* armed,
                       absl::Notification* entered, absl::Notification* release)
      : rank_(inner->rank()),
        entered_(entered),
        release_(release),
        inner_(std::move(inner)),
        armed_(armed) {}
  int rank() const override { return rank_; }
  int size() const override { return inner_ != nullptr ? inner_->size() : 2; }
  absl::Status AllReduce(TensorView b) override { return Hung() ? Hang() : inner_->AllReduce(b); }
  absl::Status AllGather(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                         CommMethod m) override {
    return Hung() ? Hang() : inner_->AllGather(in, out, counts, m);
  }
  absl::Status ReduceScatter(TensorView in, TensorView out, absl::Span<const int64_t> counts,
                             CommMethod m) override {
    return Hung() ? Hang() : inner_->ReduceScatter(in, out, counts, m);
  }
  absl::Status AllToAll(TensorView in, absl::Span<const int64_t> sc, TensorView out,
                        absl::Span<const int64_t> rc) override {
    return Hung() ? Hang() : inner_->AllToAll(in, sc, out, rc);
  }
  absl::Status Broadcast(TensorView b, int root) override {
    return Hung() ? Hang() : inner_->Broadcast(b, root);
  }
  absl::Status Reduce(TensorView in, TensorView out, int root) override {
    return Hung() ? Hang() : inner_->Reduce(in, out, root);
  }
  absl::Status Barrier() override { return Hung() ? Hang() : inner_->Barrier(); }

 private:
  bool Hung() const { return inner_ == nullptr || armed_->load(); }
  absl::Status Hang() {
    if (!entered_->HasBeenNotified()) entered_->Notify();
    release_->WaitForNotification();
    return absl::UnavailableError("connection closed by peer 1");
  }
  const int rank_;
  absl::Notification* entered_;
  absl::Notification* release_;
  std::unique_ptr<Communicator> inner_;
  const std::atomic<bool>* armed_ = nullptr;
};

// Options whose ranks connect over Gloo through `make_store`'s store, on
// CPU devices.
inline ExecutorCoreOptions GlooThroughStore(absl::Duration comm_timeout, absl::Duration stop_wait,
                                            decltype(ExecutorCoreOptions::make_store) make_store) {
  ExecutorCoreOptions o = InProcessOptions(nullptr);
  o.connect = nullptr;  // Gloo, through the store
  o.make_device = [](int threads) { return NewCpuDevice(threads); };
  o.comm_timeout = comm_timeout;
  o.stop_wait = stop_wait;
  o.make_store = std::move(make_store);
  return o;
}

}  // namespace hap::executor::testing

#endif  // HAP_EXECUTOR_DAEMON_CORE_TEST_UTIL_H_
