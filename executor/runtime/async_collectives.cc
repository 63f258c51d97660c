#include "executor/runtime/async_collectives.h"

#include <deque>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace hap::executor {
namespace {

class CommThread : public AsyncCollectives {
 public:
  CommThread(Device* device, std::unique_ptr<Communicator> comm)
      : comm_(std::move(comm)), staging_(device), thread_([this] { Loop(); }) {}

  ~CommThread() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  absl::Status Start(int id, Work work) override {
    absl::MutexLock l(&mu_);
    if (!failed_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the communication thread failed before: ", failed_.message()));
    }
    if (!done_.emplace(id, std::nullopt).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("asynchronous collective ", id, " is already running"));
    }
    queue_.emplace_back(id, std::move(work));
    return absl::OkStatus();
  }

  absl::Status Wait(int id) override {
    absl::MutexLock l(&mu_);
    auto it = done_.find(id);
    if (it == done_.end()) {
      return absl::NotFoundError(absl::StrCat("no asynchronous collective ", id, " is running"));
    }
    auto finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_.at(id).has_value(); };
    mu_.Await(absl::Condition(&finished));
    absl::Status s = *done_.at(id);
    done_.erase(id);
    return s;
  }

  absl::Status WaitAll() override {
    absl::Status first;
    std::vector<int> ids;
    {
      absl::MutexLock l(&mu_);
      for (const auto& [id, _] : done_) ids.push_back(id);
    }
    for (int id : ids) first.Update(Wait(id));
    return first;
  }

 private:
  void Loop() {
    while (true) {
      std::pair<int, Work> item;
      {
        absl::MutexLock l(&mu_);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        if (!failed_.ok()) {
          // The communicator is unusable: work queued after a failure fails
          // without traffic.
          done_[item.first] = absl::FailedPreconditionError(absl::StrCat(
              "not run: an earlier asynchronous collective failed: ", failed_.message()));
          continue;
        }
      }
      absl::Status s = item.second(*comm_, staging_);
      absl::MutexLock l(&mu_);
      if (!s.ok() && failed_.ok()) failed_ = s;
      done_[item.first] = std::move(s);
    }
  }

  std::unique_ptr<Communicator> comm_;
  Staging staging_;  // the communication thread's only
  absl::Mutex mu_;
  std::deque<std::pair<int, Work>> queue_ ABSL_GUARDED_BY(mu_);
  // Started and not waited for: the result once run.
  std::map<int, std::optional<absl::Status>> done_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace

std::unique_ptr<AsyncCollectives> NewCommThread(Device* device,
                                                std::unique_ptr<Communicator> comm) {
  return std::make_unique<CommThread>(device, std::move(comm));
}

}  // namespace hap::executor
