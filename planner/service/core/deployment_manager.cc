#include "planner/service/core/deployment_manager.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/host_port.h"
#include "common/proto_time.h"
#include "common/stats.h"
#include "common/status_macros.h"
#include "common/training_checks.h"
#include "google/protobuf/util/time_util.h"
#include "planner/service/core/pagination.h"
#include "planner/service/core/rendezvous_store.h"
#include "planner/service/core/retention.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using google::protobuf::util::TimeUtil;

// The name of a stored state, or its number for a value this version does
// not know.
std::string StateName(v1::Deployment::State s) {
  const std::string& name = v1::Deployment::State_Name(s);
  return name.empty() ? absl::StrCat(static_cast<int>(s), " (unknown)") : name;
}

DeploymentWatchOptions Sanitized(DeploymentWatchOptions o) {
  const DeploymentWatchOptions defaults;
  auto positive = [](absl::Duration& x, absl::Duration def) {
    if (!(x > absl::ZeroDuration())) x = def;
  };
  positive(o.call_timeout, defaults.call_timeout);
  positive(o.status_interval, defaults.status_interval);
  positive(o.status_timeout, defaults.status_timeout);
  positive(o.stop_timeout, defaults.stop_timeout);
  if (o.missed_status_limit < 1) o.missed_status_limit = defaults.missed_status_limit;
  if (o.stop_attempts < 1) o.stop_attempts = defaults.stop_attempts;
  return o;
}

}  // namespace

absl::Status CheckDataSpecForm(const std::string& spec) {
  if (spec.empty()) return absl::OkStatus();
  constexpr absl::string_view kForms = "npy:DIR or tokens:FILE[:uint16|uint32]";
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.data_spec '", spec, "' ", why, " (", kForms, ")"));
  };
  if (absl::StartsWith(spec, "npy:")) {
    return spec.size() > 4 ? absl::OkStatus() : bad("names no directory");
  }
  if (absl::StartsWith(spec, "tokens:")) {
    absl::string_view path = absl::string_view(spec).substr(7);
    // As the executors read it: what follows the last ':' is the dtype.
    if (const size_t colon = path.rfind(':'); colon != absl::string_view::npos) {
      const absl::string_view dtype = path.substr(colon + 1);
      if (dtype != "uint16" && dtype != "uint32") {
        return bad(absl::StrCat("has token dtype '", dtype,
                                "', not uint16 or uint32 (a FILE containing ':' needs the dtype "
                                "spelled out)"));
      }
      path = path.substr(0, colon);
    }
    return path.empty() ? bad("names no file") : absl::OkStatus();
  }
  return bad("is not of a form the executors read");
}

bool FailedByPlannerRestartBeforeTraining(const v1::Deployment& d) {
  if (d.state() != v1::Deployment::FAILED) return false;
  if (d.failure_cause() != v1::Deployment::FAILURE_CAUSE_UNSPECIFIED) {
    return d.failure_cause() == v1::Deployment::PLANNER_RESTARTED_BEFORE_TRAINING;
  }
  // Saved by a planner older than failure_cause: only its error says so.
  return d.failed_ranks().empty() && absl::StartsWith(d.error(), kPlannerRestartedBeforeTraining);
}

namespace {

// The deployment's ranks: each of the plan's devices at its executor.
absl::StatusOr<v1::Deployment> AssignRanks(const v1::Plan& plan,
                                           const v1::DeployPlanRequest& request,
                                           const v1::Cluster& cluster) {
  // Each device's executor: from the request, else the node's label
  // "hap.executor/<device id>".
  std::map<std::string, std::string> labelled;
  for (const auto& n : cluster.nodes()) {
    for (const auto& [k, v] : n.labels()) {
      if (k.rfind("hap.executor/", 0) == 0) labelled[k.substr(13)] = v;
    }
  }
  v1::Deployment d;
  std::map<std::string, int> rank_at;  // executor address -> its rank
  for (int rank = 0; rank < plan.devices_size(); ++rank) {
    const std::string& dev = plan.devices(rank);
    auto it = request.executors().find(dev);
    std::string addr = it != request.executors().end() ? it->second
                       : labelled.count(dev)           ? labelled[dev]
                                                       : "";
    if (addr.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("no executor address for device '", dev,
                                                     "' (rank ", rank, "): pass executors[\"",
                                                     dev, "\"] = host:port"));
    }
    // Dialled as given, '127.0.0.1:99999' was port 34463 and a missing port
    // port 0: the rank's LoadPlan failed later, or reached another process.
    if (!service::IsHostPort(addr, 1, /*schemes=*/true)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the executor address '", addr, "' of device '", dev, "' (rank ", rank, ", ",
          it != request.executors().end() ? "from the request" : "from its node's label",
          ") must be HOST:PORT with a port from 1 to 65535"));
    }
    // An executor runs one rank: a second LoadPlan would replace the first.
    if (auto [at, added] = rank_at.emplace(addr, rank); !added) {
      return absl::InvalidArgumentError(
          absl::StrCat("devices '", plan.devices(at->second), "' (rank ", at->second, ") and '",
                       dev, "' (rank ", rank, ") have the same executor '", addr,
                       "'; an executor runs one rank: give each device its own"));
    }
    auto* a = d.add_ranks();
    a->set_rank(rank);
    a->set_device(dev);
    a->set_executor_address(addr);
  }
  for (const auto& [dev, addr] : request.executors()) {
    if (std::find(plan.devices().begin(), plan.devices().end(), dev) == plan.devices().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("executors names device '", dev, "', which the plan does not use"));
    }
  }
  return d;
}

}  // namespace

struct DeploymentManager::State {
  mutable absl::Mutex mu;
  absl::CondVar changed;  // any record, key or stop request; shutdown
  bool shutdown = false;
  std::map<std::string, v1::Deployment> deployments;
  std::map<std::string, int64_t> generations;                  // plan -> last generation
  std::set<std::string> generations_read;  // plans whose stored last generation was read
  std::map<std::string, std::vector<v1::StepMetric>> metrics;  // per deployment
  // What each deployment's step statistics are computed from, kept as
  // metrics arrive (Add): rank 0's step times among the metrics kept, in
  // two halves for their upper median (median_step_seconds), and each
  // rank's last kRecentStepsPerRank step times, whatever the cap on metrics kept
  // (recent_step_seconds).
  struct StepStats {
    std::priority_queue<double> lower;  // the smaller half (max on top)
    std::priority_queue<double, std::vector<double>, std::greater<double>>
        upper;  // the larger half, one more when the count is odd (min on top)
    std::map<int, std::deque<double>> recent;  // rank -> its latest, oldest first

    // A metric kept with the deployment's (`kept`) or past the cap.
    void Add(const v1::StepMetric& m, bool kept) {
      std::deque<double>& r = recent[m.rank()];
      r.push_back(m.step_seconds());
      if (r.size() > static_cast<size_t>(kRecentStepsPerRank)) r.pop_front();
      if (!kept || m.rank() != 0) return;
      // upper.size() is lower.size() or one more; upper.top() is the value
      // at index size / 2 in order, what UpperMedian returns.
      if (!upper.empty() && m.step_seconds() < upper.top()) {
        lower.push(m.step_seconds());
      } else {
        upper.push(m.step_seconds());
      }
      if (lower.size() > upper.size()) {
        upper.push(lower.top());
        lower.pop();
      } else if (upper.size() > lower.size() + 1) {
        lower.push(upper.top());
        upper.pop();
      }
    }
    // The upper median of rank 0's step times kept; 0 for none.
    double Median() const { return upper.empty() ? 0 : upper.top(); }
    // The slowest rank's upper median over its latest steps; 0 for none.
    double Recent() const {
      double slowest = 0;
      for (const auto& [rank, r] : recent) {
        slowest = std::max(slowest, UpperMedian(std::vector<double>(r.begin(), r.end())));
      }
      return slowest;
    }
  };
  std::map<std::string, StepStats> step_stats;  // per deployment
  // Per deployment, what its saved metrics are pruned by: the step after
  // the last kept one's, whether any was not kept (past the cap), where
  // the sink is pruned up to, and each rank's latest step.
  struct SavedSteps {
    int64_t kept_end = 0;
    bool past_cap = false;
    int64_t pruned_to = 0;
    std::map<int32_t, int64_t> rank_last_end;  // each rank's step after its latest
  };
  std::map<std::string, SavedSteps> saved_steps;
  // Per deployment, the (rank, step) pairs reported so far, so that one
  // reported again (a client retrying a report that did arrive) replaces
  // the earlier metric, as the store does, rather than counting twice in
  // the statistics: each rank's steps as ranges [first, end), which stay
  // one or two ranges since ranks report in order; and where each kept
  // metric sits in `metrics`.
  struct Reported {
    std::map<int32_t, std::map<int64_t, int64_t>> ranges;  // rank -> first -> end
    std::map<std::pair<int32_t, int64_t>, size_t> kept_at;
    // Records (rank, step); false when it was reported before.
    bool Add(int32_t rank, int64_t step) {
      std::map<int64_t, int64_t>& r = ranges[rank];
      auto next = r.upper_bound(step);  // the first range starting after step
      if (next != r.begin()) {
        auto prev = std::prev(next);
        if (step < prev->second) return false;
        if (step == prev->second) {  // extends prev, perhaps up to next
          prev->second = step + 1;
          if (next != r.end() && next->first == prev->second) {
            prev->second = next->second;
            r.erase(next);
          }
          return true;
        }
      }
      if (next != r.end() && next->first == step + 1) {  // extends next down
        const int64_t end = next->second;
        r.erase(next);
        r.emplace(step, end);
        return true;
      }
      r.emplace(step, step + 1);
      return true;
    }
  };
  std::map<std::string, Reported> reported;
  std::set<std::string> stop_requested;
  std::set<std::string> supervised;  // deployments whose supervisor runs
  // Deployments whose record as served the sink refused to save (the store
  // still holds an earlier one), with the record's error before the note
  // saying so.
  std::map<std::string, std::string> unsaved;
  // Rendezvous keys belong to a deployment that exists, at its generation,
  // until it finishes.
  RendezvousStore rendezvous;
  // Supervisor threads by id; the ids of those that returned.
  std::map<int64_t, std::thread> supervisors;
  std::vector<int64_t> returned;
  int64_t next_supervisor = 0;

  // Opens or closes `d`'s rendezvous as its state says.
  void FollowRendezvous(const v1::Deployment& d) {
    if (!DeploymentFinal(d.state())) {
      rendezvous.Open(d.name(), d.generation());
      return;
    }
    rendezvous.Close(d.name(), d.generation(),
                     absl::StrCat("deployment '", d.name(), "' is ",
                                  v1::Deployment::State_Name(d.state()),
                                  ": its rendezvous is closed"));
  }

  // What ended a WaitChangedLocked, checked in this order.
  enum class WaitEnd { kDone, kShutdown, kCancelled, kDeadline };
  // Waits on `changed` until done(), shutdown, cancelled() (may be null) or
  // `deadline`; which of those ended the wait (mu held). The waits are
  // short, so that a cancelled caller, which nothing signals, is noticed
  // promptly.
  WaitEnd WaitChangedLocked(const std::function<bool()>& done, absl::Time deadline,
                            const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    constexpr absl::Duration kSlice = absl::Milliseconds(200);
    while (true) {
      if (done()) return WaitEnd::kDone;
      if (shutdown) return WaitEnd::kShutdown;
      if (cancelled != nullptr && cancelled()) return WaitEnd::kCancelled;
      if (absl::Now() >= deadline) return WaitEnd::kDeadline;
      changed.WaitWithDeadline(&mu, std::min(deadline, absl::Now() + kSlice));
    }
  }
};

DeploymentManager::DeploymentManager(DeploymentManagerOptions options,
                                     std::vector<v1::Deployment> deployments,
                                     std::vector<v1::StepMetric> metrics)
    : o_(std::move(options)), s_(std::make_unique<State>()) {
  o_.watch = Sanitized(o_.watch);
  absl::MutexLock l(&s_->mu);
  for (const auto& d : deployments) {
    s_->generations[d.plan()] = std::max(s_->generations[d.plan()], d.generation());
    s_->deployments[d.name()] = d;
    s_->FollowRendezvous(d);
  }
  // The first max_metrics_per_deployment are kept, as when reported, and
  // the record's summary of them (steps completed, last loss, medians),
  // which is not saved with every metric, is made again from them.
  // Metrics of a deployment not loaded are not served: dropped.
  std::map<std::string, std::vector<v1::StepMetric>> by_deployment;
  for (auto& m : metrics) {
    if (s_->deployments.count(m.deployment())) {
      by_deployment[m.deployment()].push_back(std::move(m));
    }
  }
  for (const auto& [name, list] : by_deployment) KeepStepMetricsLocked(name, list);
  for (const auto& entry : s_->deployments) {
    const v1::Deployment& d = entry.second;  // lambdas capture it by value
    if (d.state() == v1::Deployment::RUNNING) {
      // Re-attach: the first poll finds out whether each rank still trains it.
      Supervise(d, [this, d](DeploymentExecutors& ex, const DeploymentControl& c) {
        WatchDeployment(d, ex, o_.watch, c);
      });
    } else if (!DeploymentFinal(d.state())) {
      // PENDING: its push died with the previous planner, and the
      // rendezvous keys with it. Any other state that is not final
      // (STATE_UNSPECIFIED, a value of a later version) cannot be followed
      // either. Whatever ranks it loaded or started are stopped.
      const std::string reason =
          d.state() == v1::Deployment::PENDING
              ? std::string(kPlannerRestartedBeforeTraining)
              : absl::StrCat("the planner restarted and found this deployment stored in state ",
                             StateName(d.state()), ", which it cannot follow");
      Supervise(d, [this, d, reason](DeploymentExecutors& ex, const DeploymentControl& c) {
        if (d.state() != v1::Deployment::PENDING) {
          return FailUnfinishedDeployment(d, reason, ex, o_.watch, c);
        }
        // The cause goes with the edit that makes it FAILED (and its save):
        // a job reads the record as soon as it is FAILED.
        DeploymentControl failing = c;
        failing.update = [&c](const std::function<void(v1::Deployment&)>& edit) {
          c.update([&edit](v1::Deployment& x) {
            edit(x);
            if (x.state() == v1::Deployment::FAILED) {
              x.set_failure_cause(v1::Deployment::PLANNER_RESTARTED_BEFORE_TRAINING);
            }
          });
        };
        FailUnfinishedDeployment(d, reason, ex, o_.watch, failing);
      });
    }
  }
}

DeploymentManager::~DeploymentManager() {
  Shutdown();
  std::map<int64_t, std::thread> supervisors;
  {
    absl::MutexLock l(&s_->mu);
    supervisors.swap(s_->supervisors);
    s_->returned.clear();
  }
  for (auto& [id, t] : supervisors) t.join();
}

void DeploymentManager::Shutdown() {
  absl::MutexLock l(&s_->mu);
  s_->shutdown = true;
  s_->rendezvous.Shutdown();
  s_->changed.SignalAll();
}

bool DeploymentManager::shutting_down() const {
  absl::MutexLock l(&s_->mu);
  return s_->shutdown;
}

// ---------------------------------------------------------- supervisors --

void DeploymentManager::Supervise(
    const v1::Deployment& d,
    std::function<void(DeploymentExecutors&, const DeploymentControl&)> body) {
  const int64_t id = s_->next_supervisor++;
  s_->supervised.insert(d.name());
  s_->supervisors[id] = std::thread([this, d, body = std::move(body), id] {
    {
      std::unique_ptr<DeploymentExecutors> executors = o_.executors(d);
      body(*executors, Control(d.name()));
    }
    absl::MutexLock l(&s_->mu);
    s_->supervised.erase(d.name());
    s_->stop_requested.erase(d.name());
    s_->returned.push_back(id);
    s_->changed.SignalAll();
  });
}

void DeploymentManager::ReapSupervisors() {
  std::vector<std::thread> done;
  {
    absl::MutexLock l(&s_->mu);
    for (int64_t id : s_->returned) {
      auto it = s_->supervisors.find(id);
      if (it == s_->supervisors.end()) continue;
      done.push_back(std::move(it->second));
      s_->supervisors.erase(it);
    }
    s_->returned.clear();
  }
  for (auto& t : done) t.join();  // each has returned or is returning
}

DeploymentControl DeploymentManager::Control(const std::string& deployment) {
  DeploymentControl c;
  c.now = [] { return absl::Now(); };
  c.wait = [this, deployment](absl::Time deadline, bool stop_wakes) {
    absl::MutexLock l(&s_->mu);
    while (true) {
      if (s_->shutdown) return Wake::kShutdown;
      if (stop_wakes && s_->stop_requested.count(deployment)) return Wake::kStop;
      if (absl::Now() >= deadline) return Wake::kTimeout;
      s_->changed.WaitWithDeadline(&s_->mu, deadline);
    }
  };
  c.update = [this, deployment](const std::function<void(v1::Deployment&)>& edit) {
    Update(deployment, edit);
  };
  c.save_again = [this, deployment] {
    absl::MutexLock l(&s_->mu);
    (void)SaveAgainLocked(deployment);  // still refused: tried at the next poll
  };
  return c;
}

void DeploymentManager::Update(const std::string& name,
                               const std::function<void(v1::Deployment&)>& edit) {
  absl::MutexLock l(&s_->mu);
  auto it = s_->deployments.find(name);
  if (it == s_->deployments.end()) return;
  v1::Deployment next = it->second;
  const bool was_final = DeploymentFinal(next.state());
  // A note that an earlier record was not saved goes with the save of this one.
  auto refused = s_->unsaved.find(name);
  if (refused != s_->unsaved.end()) next.set_error(refused->second);
  edit(next);
  if (!was_final && DeploymentFinal(next.state()))
    *next.mutable_end_time() = TimeUtil::GetCurrentTime();
  if (o_.sink != nullptr) {
    absl::Status saved = o_.sink->SaveDeployment(next);
    if (saved.ok()) {
      s_->unsaved.erase(name);
    } else {
      s_->unsaved[name] = next.error();
      // The executors did change state; say so, and that the store still
      // holds the state before (a restarted planner shows that one).
      next.set_error(absl::StrCat(next.error(), next.error().empty() ? "" : "; ",
                                  "the planner could not save this deployment as ",
                                  v1::Deployment::State_Name(next.state()), ": ",
                                  saved.message()));
    }
  }
  it->second = std::move(next);
  // No rank meets through a finished deployment again: its keys go.
  if (DeploymentFinal(it->second.state())) s_->FollowRendezvous(it->second);
  if (o_.on_change) o_.on_change(it->second);
  if (!was_final && DeploymentFinal(it->second.state()) && o_.on_finished)
    o_.on_finished(it->second);
  s_->changed.SignalAll();
}

absl::Status DeploymentManager::SaveAgainLocked(const std::string& name) {
  auto refused = s_->unsaved.find(name);
  if (refused == s_->unsaved.end() || o_.sink == nullptr) return absl::OkStatus();
  v1::Deployment d = s_->deployments[name];
  d.set_error(refused->second);  // without the note that it was not saved
  absl::Status saved = o_.sink->SaveDeployment(d);
  if (saved.ok()) {
    s_->unsaved.erase(refused);
    s_->deployments[name] = d;
    if (o_.on_change) o_.on_change(d);
    s_->changed.SignalAll();
    return absl::OkStatus();
  }
  return Annotate(saved, absl::StrCat(name, " is ", StateName(d.state()),
                                      " but the planner could not save it so (a restarted "
                                      "planner would find it as it was saved last)"));
}

// ---------------------------------------------------------- retention --

absl::StatusOr<int> DeploymentManager::EnforceRetention(int count, absl::Time oldest,
                                                        const std::set<std::string>& keep) {
  if (count <= 0 && oldest == absl::InfinitePast()) return 0;
  // Chosen under the lock, deleted one at a time (other calls get the lock
  // in between).
  std::vector<std::string> victims;
  {
    absl::MutexLock l(&s_->mu);
    std::vector<std::pair<absl::Time, std::string>> finished;
    for (const auto& [name, d] : s_->deployments) {
      if (!DeploymentFinal(d.state())) continue;
      // An older planner's record has no end_time: its create_time.
      finished.push_back({FromProto(d.has_end_time() ? d.end_time() : d.create_time()), name});
    }
    for (std::string& name : PastRetention(std::move(finished), count, oldest)) {
      if (!keep.count(name) && !s_->supervised.count(name)) victims.push_back(std::move(name));
    }
  }
  int deleted = 0;
  for (const std::string& name : victims) {
    absl::MutexLock l(&s_->mu);
    auto it = s_->deployments.find(name);
    if (it == s_->deployments.end() || !DeploymentFinal(it->second.state())) continue;
    if (absl::Status st = DeleteLocked(name); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("deployment retention: ", st.message(), " (",
                                                  deleted, " deleted before it)"));
    }
    ++deleted;
  }
  return deleted;
}

absl::Status DeploymentManager::Delete(const std::string& name, const std::set<std::string>& in_use,
                                       absl::Time deadline,
                                       const std::function<bool()>& cancelled) {
  absl::MutexLock l(&s_->mu);
  auto it = s_->deployments.find(name);
  if (it == s_->deployments.end()) {
    return absl::NotFoundError(absl::StrCat("deployment '", name, "' does not exist"));
  }
  if (!DeploymentFinal(it->second.state())) {
    const std::string short_name = name.substr(name.find('/') + 1);
    return absl::FailedPreconditionError(absl::StrCat(
        "deployment '", name, "' is ", StateName(it->second.state()),
        ": only a finished deployment is deleted; stop it first (hapctl stop deployment ",
        short_name, ")"));
  }
  // Finished, its supervisor may still be returning (it marks the state,
  // then goes): a delete right after a stop was refused as "STOPPED: ...
  // stop it first". Waited for until the caller's deadline, at most
  // kDeleteSupervisorWait; one still telling ranks to stop is named as
  // such, and nothing is deleted.
  const State::WaitEnd end = s_->WaitChangedLocked(
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu) { return !s_->supervised.count(name); },
      std::min(deadline, absl::Now() + kDeleteSupervisorWait), cancelled);
  it = s_->deployments.find(name);
  if (it == s_->deployments.end()) {
    return absl::NotFoundError(absl::StrCat("deployment '", name, "' does not exist"));
  }
  if (end != State::WaitEnd::kDone) {
    const std::string not_deleted = absl::StrCat(
        "deployment '", name, "' (", StateName(it->second.state()), ") was not deleted: ");
    const char* waited = "waiting for the planner to finish telling its ranks to stop";
    if (end == State::WaitEnd::kCancelled) {
      return absl::CancelledError(
          absl::StrCat(not_deleted, "the call was cancelled while ", waited));
    }
    // The caller's deadline, not kDeleteSupervisorWait, ended the wait.
    if (end == State::WaitEnd::kDeadline && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(not_deleted,
                                                      "the call's deadline passed while ", waited,
                                                      "; try again in a few seconds"));
    }
    return absl::UnavailableError(absl::StrCat(
        "deployment '", name, "' is ", StateName(it->second.state()),
        " and the planner is still telling its ranks to stop; try again in a few seconds"));
  }
  if (in_use.count(name)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "deployment '", name, "' is an elastic job's, which is not finished: stop the job first"));
  }
  return DeleteLocked(name);
}

absl::Status DeploymentManager::DeleteLocked(const std::string& name) {
  if (o_.sink != nullptr) {
    absl::Status st = o_.sink->DeleteDeployment(name);
    if (!st.ok() && !absl::IsNotFound(st)) {
      return Annotate(st, absl::StrCat(name, " was not deleted"));
    }
  }
  // Its generation stays in `generations` (and the store keeps the
  // highest): the plan's next deploy goes on from it.
  s_->deployments.erase(name);
  s_->metrics.erase(name);
  s_->step_stats.erase(name);
  s_->saved_steps.erase(name);
  s_->reported.erase(name);
  s_->unsaved.erase(name);
  s_->stop_requested.erase(name);
  s_->changed.SignalAll();
  return absl::OkStatus();
}

// ---------------------------------------------------------- deployments --

absl::StatusOr<v1::Deployment> DeploymentManager::Deploy(const v1::Plan& plan,
                                                         const v1::DeployPlanRequest& request,
                                                         const v1::Cluster& cluster,
                                                         const std::string& rendezvous_address) {
  if (plan.state() != v1::Plan::SUCCEEDED) {
    return absl::FailedPreconditionError(absl::StrCat(plan.name(), " is ",
                                                      v1::Plan::State_Name(plan.state()),
                                                      "; only a SUCCEEDED plan can be deployed"));
  }
  // What the executors would refuse at LoadPlan, refused before a
  // deployment is made.
  HAP_RETURN_IF_ERROR(CheckTrainingConfig(request.training()));
  HAP_ASSIGN_OR_RETURN(v1::Deployment d, AssignRanks(plan, request, cluster));
  HAP_ASSIGN_OR_RETURN(std::string id, PlanId(plan.name()));
  ReapSupervisors();
  absl::MutexLock l(&s_->mu);
  if (s_->shutdown) return absl::UnavailableError("the planner is shutting down");
  // A plan first deployed since the start: the deployments loaded need not
  // hold its highest generation (retention or a delete may have removed
  // the newest and left an older one, or all of them); the store
  // remembers it, so no name is used twice. (Read only for a plan with no
  // deployment loaded, a restart gave the newest deleted one's name again.)
  if (o_.sink != nullptr && !s_->generations_read.count(plan.name())) {
    absl::StatusOr<int64_t> last = o_.sink->LastDeploymentGeneration(plan.name());
    HAP_RETURN_IF_ERROR(Annotate(last.status(), absl::StrCat("deploying ", plan.name())));
    int64_t& known = s_->generations[plan.name()];
    known = std::max(known, *last);
    s_->generations_read.insert(plan.name());
  }
  const int64_t gen = s_->generations[plan.name()] + 1;
  d.set_name(absl::StrCat("deployments/", id, "-g", gen));
  d.set_plan(plan.name());
  d.set_generation(gen);
  d.set_state(v1::Deployment::PENDING);
  *d.mutable_training() = request.training();
  if (d.training().steps() == 0) d.mutable_training()->set_steps(100);
  *d.mutable_create_time() = TimeUtil::GetCurrentTime();
  // Saved before it exists here: a deployment the store refused is none.
  if (o_.sink != nullptr) {
    HAP_RETURN_IF_ERROR(
        Annotate(o_.sink->SaveDeployment(d), absl::StrCat(d.name(), " was not created")));
  }
  s_->generations[plan.name()] = gen;
  s_->deployments[d.name()] = d;
  s_->FollowRendezvous(d);
  if (o_.on_change) o_.on_change(d);
  Supervise(d, [this, d, plan, rendezvous_address](DeploymentExecutors& ex,
                                                   const DeploymentControl& c) {
    RunDeployment(d, plan, rendezvous_address, ex, o_.watch, c);
  });
  return d;
}

absl::StatusOr<v1::Deployment> DeploymentManager::Get(const std::string& name) const {
  absl::MutexLock l(&s_->mu);
  auto it = s_->deployments.find(name);
  if (it == s_->deployments.end()) {
    return absl::NotFoundError(absl::StrCat("deployment '", name, "' does not exist"));
  }
  return it->second;
}

absl::StatusOr<v1::ListDeploymentsResponse> DeploymentManager::List(
    int page_size, const std::string& page_token) const {
  v1::ListDeploymentsResponse out;
  absl::MutexLock l(&s_->mu);
  HAP_ASSIGN_OR_RETURN(std::string next, Paginate(s_->deployments, page_size, page_token,
                                                  "deployments", [&](const v1::Deployment& d) {
                                                    *out.add_deployments() = d;
                                                    return d.ByteSizeLong();
                                                  }));
  out.set_next_page_token(next);
  return out;
}

std::vector<v1::Deployment> DeploymentManager::All() const {
  absl::MutexLock l(&s_->mu);
  std::vector<v1::Deployment> out;
  out.reserve(s_->deployments.size());
  for (const auto& [name, d] : s_->deployments) out.push_back(d);
  return out;
}

std::vector<v1::Deployment> DeploymentManager::Summaries() const {
  absl::MutexLock l(&s_->mu);
  std::vector<v1::Deployment> out;
  out.reserve(s_->deployments.size());
  google::protobuf::RepeatedPtrField<v1::StepProfile> profiles;
  for (auto& [name, d] : s_->deployments) {
    // The profiles step aside while the record is copied (a swap of
    // pointers, under the lock): nothing else sees the record without them.
    profiles.Swap(d.mutable_rank_profiles());
    out.push_back(d);
    profiles.Swap(d.mutable_rank_profiles());
  }
  return out;
}

std::vector<v1::Deployment> DeploymentManager::OfPlan(const std::string& plan) const {
  absl::MutexLock l(&s_->mu);
  std::vector<v1::Deployment> out;
  for (const auto& [name, d] : s_->deployments) {
    if (d.plan() == plan) out.push_back(d);
  }
  return out;
}

std::map<std::string, std::vector<std::string>> DeploymentManager::ActiveDevices() const {
  absl::MutexLock l(&s_->mu);
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [name, d] : s_->deployments) {
    if (DeploymentFinal(d.state())) continue;
    std::vector<std::string>& devices = out[name];
    for (const auto& r : d.ranks()) devices.push_back(r.device());
  }
  return out;
}

bool DeploymentManager::AnyActiveOn(const std::set<std::string>& devices) const {
  if (devices.empty()) return false;
  absl::MutexLock l(&s_->mu);
  for (const auto& [name, d] : s_->deployments) {
    if (DeploymentFinal(d.state())) continue;
    for (const auto& r : d.ranks()) {
      if (devices.count(r.device())) return true;
    }
  }
  return false;
}

absl::StatusOr<v1::Deployment> DeploymentManager::Stop(const std::string& name,
                                                       absl::Time deadline,
                                                       const std::function<bool()>& cancelled) {
  v1::Deployment d;
  {
    absl::MutexLock l(&s_->mu);
    auto it = s_->deployments.find(name);
    if (it == s_->deployments.end()) {
      return absl::NotFoundError(absl::StrCat("deployment '", name, "' does not exist"));
    }
    if (!DeploymentFinal(it->second.state())) {
      if (s_->shutdown || !s_->supervised.count(name)) {
        return absl::UnavailableError(absl::StrCat(
            "the planner is shutting down; ", name,
            " keeps running and a restarted planner can stop it"));
      }
      // Its supervisor stops every rank, then marks it STOPPED.
      s_->stop_requested.insert(name);
      s_->changed.SignalAll();
      // Looked up again after each wait: once STOPPED it may be deleted
      // (DeletePlan, retention) before this wakes, and operator[] made an
      // empty record of it, never finished, that nothing could stop or
      // delete.
      auto stopping = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu) -> const v1::Deployment* {
        auto i = s_->deployments.find(name);
        return i == s_->deployments.end() ? nullptr : &i->second;
      };
      // Whatever ended the wait, the deployment is answered as it is now.
      s_->WaitChangedLocked(
          [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu) {
            return stopping() == nullptr || DeploymentFinal(stopping()->state());
          },
          deadline, cancelled);
      if (stopping() == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("deployment '", name, "' was deleted once it had stopped"));
      }
      if (DeploymentFinal(stopping()->state())) HAP_RETURN_IF_ERROR(SaveAgainLocked(name));
      return *stopping();
    }
    // Over, but not saved so: not reported as done until the store has it.
    HAP_RETURN_IF_ERROR(SaveAgainLocked(name));
    d = it->second;
  }
  if (d.state() == v1::Deployment::SUCCEEDED) return d;
  // FAILED or STOPPED: tell every rank again; those still training it (a
  // stop that did not reach them before) stop now.
  std::unique_ptr<DeploymentExecutors> executors = o_.executors(d);
  HAP_RETURN_IF_ERROR(Annotate(StopRanksOnce(d, *executors, o_.watch),
                               absl::StrCat(d.name(), " is ",
                                            v1::Deployment::State_Name(d.state()),
                                            "; its ranks were told to stop again")));
  return d;
}

// -------------------------------------------------------------- metrics --

absl::Status DeploymentManager::ReportStepMetrics(const std::vector<v1::StepMetric>& batch) {
  if (batch.size() > kMaxStepMetricsPerReport) {
    return absl::InvalidArgumentError(absl::StrCat("a report carries at most ",
                                                   kMaxStepMetricsPerReport, " step metrics, got ",
                                                   batch.size(), ": send them in batches"));
  }
  absl::MutexLock l(&s_->mu);
  for (const auto& m : batch) {
    auto it = s_->deployments.find(m.deployment());
    if (it == s_->deployments.end()) {
      return absl::NotFoundError(
          absl::StrCat("step metric for unknown deployment '", m.deployment(), "'"));
    }
    // Its steps are 0 .. training.steps - 1 (global steps: a resumed run
    // starts past 0); the step after the last must be an int64 too.
    const int64_t end = it->second.training().steps() > 0 ? it->second.training().steps()
                                                          : std::numeric_limits<int64_t>::max();
    if (m.rank() < 0 || m.rank() >= it->second.ranks_size() || m.step() < 0 || m.step() >= end) {
      return absl::InvalidArgumentError(
          absl::StrCat("step metric of ", m.deployment(), " has rank ", m.rank(), " and step ",
                       m.step(), " outside the deployment (ranks 0 to ",
                       it->second.ranks_size() - 1, ", steps 0 to ", end - 1, ")"));
    }
    // Executors report finite losses (a NaN or infinite one fails training)
    // and measured times; anything else would poison the medians.
    for (const auto& [field, value, time] :
         {std::tuple<const char*, double, bool>{"loss", m.loss(), false},
          {"step_seconds", m.step_seconds(), true},
          {"compute_seconds", m.compute_seconds(), true},
          {"communication_seconds", m.communication_seconds(), true}}) {
      if (!std::isfinite(value) || (time && value < 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step metric of ", m.deployment(), " rank ", m.rank(), " step ", m.step(), ": ", field,
            " is ", value, time ? ", not a finite time of 0 or more" : ", not finite"));
      }
    }
  }
  // Saved first, one deployment at a time (the store writes each one's all
  // or none): what is served is what a restart finds, also when the store
  // takes one deployment's metrics and refuses the next's.
  std::map<std::string, std::vector<v1::StepMetric>> by_deployment;
  for (const auto& m : batch) by_deployment[m.deployment()].push_back(m);
  for (const auto& [name, metrics] : by_deployment) {
    if (o_.sink != nullptr) {
      HAP_RETURN_IF_ERROR(Annotate(o_.sink->AppendStepMetrics(metrics),
                                   absl::StrCat("step metrics not saved (", name, ")")));
    }
    KeepStepMetricsLocked(name, metrics);
    PruneStepMetricsLocked(name);
  }
  return absl::OkStatus();
}

void DeploymentManager::PruneStepMetricsLocked(const std::string& name) {
  if (o_.sink == nullptr) return;
  State::SavedSteps& saved = s_->saved_steps[name];
  if (!saved.past_cap) return;
  // What a restart reads: whole steps from 0 until the cap (every step
  // before kept_end) and the latest kRecentStepsPerRank steps of every rank
  // (of the slowest, up to kMaxRankLagSteps behind the latest). Once enough
  // steps gathered since the last prune, everything between goes, from
  // kept_end again: a rank behind the others reports steps below where the
  // last prune ended after it (an index range: the steps pruned before cost
  // nothing).
  const int64_t from = saved.kept_end;
  int64_t slowest = std::numeric_limits<int64_t>::max(), last_end = 0;
  for (const auto& [rank, end] : saved.rank_last_end) {
    slowest = std::min(slowest, end);
    last_end = std::max(last_end, end);
  }
  const int64_t to = std::max(slowest, last_end - kMaxRankLagSteps) - kRecentStepsPerRank;
  if (to - std::max(from, saved.pruned_to) < kStepMetricsPruneSteps) return;
  if (absl::Status s = o_.sink->PruneStepMetrics(name, from, to); !s.ok()) {
    std::cerr << "hap-planner: could not prune the saved step metrics of " << name << " (steps "
              << from << " to " << to << "; tried again later): " << s << std::endl;
    return;
  }
  saved.pruned_to = to;
}

void DeploymentManager::KeepStepMetricsLocked(const std::string& name,
                                              const std::vector<v1::StepMetric>& metrics) {
  auto& list = s_->metrics[name];
  State::StepStats& stats = s_->step_stats[name];
  State::SavedSteps& saved = s_->saved_steps[name];
  State::Reported& reported = s_->reported[name];
  v1::Deployment& d = s_->deployments[name];
  for (const auto& m : metrics) {
    if (!reported.Add(m.rank(), m.step())) {
      // Reported again: replaces the metric served (and the latest loss)
      // as it replaces the saved one; the statistics counted it once.
      auto at = reported.kept_at.find({m.rank(), m.step()});
      if (at != reported.kept_at.end()) list[at->second] = m;
      if (m.rank() == 0 && m.step() + 1 == d.steps_completed()) d.set_last_loss(m.loss());
      continue;
    }
    // The first max_metrics_per_deployment are kept (served by StepMetrics);
    // the statistics follow every metric.
    const bool kept = list.size() < o_.max_metrics_per_deployment;
    if (kept) {
      reported.kept_at[{m.rank(), m.step()}] = list.size();
      list.push_back(m);
    }
    stats.Add(m, kept);
    if (kept) saved.kept_end = std::max(saved.kept_end, m.step() + 1);
    saved.past_cap |= !kept;
    int64_t& rank_end = saved.rank_last_end[m.rank()];
    rank_end = std::max(rank_end, m.step() + 1);
    if (m.rank() == 0) {
      // The latest step's loss, whatever order the metrics come in.
      if (m.step() + 1 >= d.steps_completed()) d.set_last_loss(m.loss());
      d.set_steps_completed(std::max(d.steps_completed(), m.step() + 1));
      // Rank 0's median step over the metrics kept (up to the cap), kept
      // up to date as they arrive rather than recomputed over all of them.
      d.set_median_step_seconds(stats.Median());
      d.set_recent_steps_end(std::max(d.recent_steps_end(), m.step() + 1));
    }
  }
  // The latest window, what a job's slowdown is judged by: the slowest
  // rank's median over its last steps (ranks that share no collective run
  // at their own pace, and the deployment ends with the slowest), past the
  // cap on metrics kept too.
  d.set_recent_step_seconds(stats.Recent());
}

absl::StatusOr<std::vector<v1::StepMetric>> DeploymentManager::StepMetrics(
    const std::string& deployment) const {
  absl::MutexLock l(&s_->mu);
  if (!s_->deployments.count(deployment)) {
    return absl::NotFoundError(absl::StrCat("deployment '", deployment, "' does not exist"));
  }
  auto it = s_->metrics.find(deployment);
  if (it == s_->metrics.end()) return std::vector<v1::StepMetric>{};
  return it->second;
}

absl::StatusOr<v1::ListStepMetricsResponse> DeploymentManager::ListStepMetrics(
    const std::string& deployment, int page_size, const std::string& page_token) const {
  if (page_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must not be negative, got ", page_size));
  }
  // Tokens are positions in the deployment's metrics, in a token of its
  // own (a token of another deployment's is refused, not a position here).
  const std::string list = absl::StrCat("step metrics of ", deployment);
  int64_t from = 0;
  if (!page_token.empty()) {
    HAP_ASSIGN_OR_RETURN(std::string position, PageTokenKey(list, page_token));
    if (!absl::SimpleAtoi(position, &from) || from < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_token is not a token this server returned for the list of ", list));
    }
  }
  const int size = page_size == 0 ? 500 : std::min(page_size, 10000);
  v1::ListStepMetricsResponse out;
  absl::MutexLock l(&s_->mu);
  if (!s_->deployments.count(deployment)) {
    return absl::NotFoundError(absl::StrCat("deployment '", deployment, "' does not exist"));
  }
  auto it = s_->metrics.find(deployment);
  const int64_t count = it == s_->metrics.end() ? 0 : static_cast<int64_t>(it->second.size());
  // Tokens are positions up to the count (metrics kept only grow): one past
  // it was not returned here (and from + size would overflow for some).
  if (from > count) {
    return absl::InvalidArgumentError(absl::StrCat("page_token (position ", from,
                                                   ") is not a token this server returned (",
                                                   deployment, " has ", count, " step metrics)"));
  }
  const int64_t end = std::min(count, from + size);
  for (int64_t i = from; i < end; ++i) *out.add_metrics() = it->second[i];
  if (end < count) out.set_next_page_token(PageTokenAfter(list, absl::StrCat(end)));
  return out;
}

// ----------------------------------------------------------- rendezvous --

int64_t DeploymentManager::rendezvous_keys() const { return s_->rendezvous.size(); }

absl::Status DeploymentManager::StoreSet(const std::string& deployment, int64_t generation,
                                         const std::string& key, const std::string& value) {
  return s_->rendezvous.Set(deployment, generation, key, value);
}

absl::StatusOr<std::vector<std::string>> DeploymentManager::StoreGet(
    const std::string& deployment, int64_t generation, const std::vector<std::string>& keys,
    absl::Time deadline, const std::function<bool()>& cancelled) {
  return s_->rendezvous.Get(deployment, generation, keys, deadline, cancelled);
}

absl::StatusOr<int64_t> DeploymentManager::StoreAdd(const std::string& deployment,
                                                    int64_t generation, const std::string& key,
                                                    int64_t delta) {
  return s_->rendezvous.Add(deployment, generation, key, delta);
}

}  // namespace hap::service
