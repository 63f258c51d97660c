#include "planner/service/core/deployments.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

// `damaged`: the checkpoint it resumes from is to blame (ResumeDamaged).
void SetFailed(const DeploymentControl& control, const std::string& error,
               const std::vector<int>& failed_ranks, bool damaged) {
  control.update([&](v1::Deployment& x) {
    x.set_state(v1::Deployment::FAILED);
    x.set_error(error);
    x.clear_failed_ranks();
    for (int r : failed_ranks) x.add_failed_ranks(r);
    if (damaged) x.set_damaged_checkpoint(x.training().resume());
  });
}

// Appends the ranks that could not be stopped to the deployment's error.
void NoteUnstopped(const DeploymentControl& control, const absl::Status& stopped) {
  if (stopped.ok()) return;
  control.update([&](v1::Deployment& x) {
    x.set_error(absl::StrCat(x.error(), x.error().empty() ? "" : "; ", stopped.message()));
  });
}

// FAILED with `error`, then every rank stopped. The stops' answers are
// the ranks' last word: a rank whose damaged checkpoint failed it after
// the poll that found a peer failed (the peer's loss ended its collective
// first) says so there.
void FailAndStop(const v1::Deployment& d, const std::string& error,
                 const std::vector<int>& failed_ranks, bool damaged, DeploymentExecutors& executors,
                 const DeploymentWatchOptions& o, const DeploymentControl& control) {
  SetFailed(control, error, failed_ranks, damaged);
  bool damaged_later = false;
  NoteUnstopped(control, StopEveryRank(d, executors, o, control,
                                       [&](const absl::StatusOr<v1::ExecutorStatus>& a) {
                                         damaged_later |= a.ok() && ResumeDamaged(d, *a);
                                       }));
  if (damaged_later && !damaged) {
    control.update([&](v1::Deployment& x) { x.set_damaged_checkpoint(x.training().resume()); });
  }
}

// Every rank stopped, then STOPPED.
void StopAndMarkStopped(const v1::Deployment& d, DeploymentExecutors& executors,
                        const DeploymentWatchOptions& o, const DeploymentControl& control) {
  absl::Status stopped = StopEveryRank(d, executors, o, control);
  control.update([&](v1::Deployment& x) {
    x.set_state(v1::Deployment::STOPPED);
    if (!stopped.ok()) x.set_error(std::string(stopped.message()));
  });
}

std::string Unstopped(const v1::Deployment& d, int rank,
                      const absl::StatusOr<v1::ExecutorStatus>& answer) {
  if (!answer.ok()) {
    return absl::StrCat(DescribeRank(d, rank), ": ", answer.status().message());
  }
  return absl::StrCat(DescribeRank(d, rank), ": still ",
                      v1::ExecutorStatus::State_Name(answer->state()));
}

}  // namespace

absl::Status ValidateDeploymentWatchOptions(const DeploymentWatchOptions& o) {
  auto positive = [](absl::Duration x) { return x > absl::ZeroDuration(); };
  if (!positive(o.call_timeout) || !positive(o.status_interval) ||
      !positive(o.status_timeout) || !positive(o.stop_timeout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "deployment watch: call_timeout (", absl::FormatDuration(o.call_timeout),
        "), status_interval (", absl::FormatDuration(o.status_interval), "), status_timeout (",
        absl::FormatDuration(o.status_timeout), ") and stop_timeout (",
        absl::FormatDuration(o.stop_timeout), ") must be positive"));
  }
  if (o.missed_status_limit < 1 || o.stop_attempts < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "deployment watch: missed_status_limit (", o.missed_status_limit,
        ") and stop_attempts (", o.stop_attempts, ") must be at least 1"));
  }
  return absl::OkStatus();
}

bool ResumeDamaged(const v1::Deployment& d, const v1::ExecutorStatus& s) {
  return !d.training().resume().empty() && s.deployment() == d.name() &&
         s.generation() == d.generation() && s.state() == v1::ExecutorStatus::FAILED &&
         s.error_code() == static_cast<int>(absl::StatusCode::kDataLoss) &&
         s.steps_completed() == 0;
}

bool DeploymentFinal(v1::Deployment::State s) {
  return s == v1::Deployment::SUCCEEDED || s == v1::Deployment::FAILED ||
         s == v1::Deployment::STOPPED;
}

std::string DescribeRank(const v1::Deployment& d, int rank) {
  if (rank < 0 || rank >= d.ranks_size()) return absl::StrCat("rank ", rank);
  return absl::StrCat("rank ", rank, " (", d.ranks(rank).device(), " at ",
                      d.ranks(rank).executor_address(), ")");
}

RankWatch::RankWatch(const v1::Deployment& d, int missed_status_limit)
    : d_(d), limit_(missed_status_limit), missed_(d.ranks_size(), 0) {}

RankWatch::Verdict RankWatch::Observe(const DeploymentExecutors::Statuses& statuses) {
  std::vector<std::string> problems;
  failed_ranks_.clear();
  resume_damaged_ = false;
  bool failed = false;
  int finished = 0;
  for (int r = 0; r < d_.ranks_size(); ++r) {
    const absl::StatusOr<v1::ExecutorStatus> st =
        r < static_cast<int>(statuses.size())
            ? statuses[r]
            : absl::InternalError("the executors' client gave no answer for this rank");
    if (!st.ok()) {
      ++missed_[r];
      failed |= missed_[r] >= limit_;
      failed_ranks_.push_back(r);  // unreachable now: to blame if it fails
      problems.push_back(absl::StrCat(DescribeRank(d_, r), " did not answer ", missed_[r],
                                      missed_[r] == 1 ? " status poll" : " status polls in a row",
                                      ": ", st.status().message()));
      continue;
    }
    missed_[r] = 0;
    if (st->deployment() != d_.name() || st->generation() != d_.generation()) {
      failed = true;
      failed_ranks_.push_back(r);
      problems.push_back(absl::StrCat(
          DescribeRank(d_, r), " no longer holds this deployment: its executor holds ",
          st->deployment().empty()
              ? std::string("none")
              : absl::StrCat("'", st->deployment(), "' generation ", st->generation()),
          " (", v1::ExecutorStatus::State_Name(st->state()),
          "); it restarted or took another plan"));
      continue;
    }
    switch (st->state()) {
      case v1::ExecutorStatus::TRAINING:
        break;
      case v1::ExecutorStatus::FINISHED:
        ++finished;
        break;
      case v1::ExecutorStatus::FAILED:  // it answers: alive (a peer's loss fails it too)
        failed = true;
        resume_damaged_ |= ResumeDamaged(d_, *st);
        problems.push_back(absl::StrCat(DescribeRank(d_, r), " failed: ", st->error()));
        break;
      default:
        failed = true;
        failed_ranks_.push_back(r);
        problems.push_back(absl::StrCat(DescribeRank(d_, r), " is not training it (",
                                        v1::ExecutorStatus::State_Name(st->state()), ")"));
    }
  }
  if (failed) {
    error_ = absl::StrJoin(problems, "; ");
    return Verdict::kFailed;
  }
  error_.clear();
  return finished == d_.ranks_size() ? Verdict::kSucceeded : Verdict::kRunning;
}

bool RankStopped(const v1::Deployment& d, const absl::StatusOr<v1::ExecutorStatus>& answer) {
  if (!answer.ok()) return absl::IsNotFound(answer.status());  // holds another deployment
  return !(answer->deployment() == d.name() && answer->generation() == d.generation() &&
           answer->state() == v1::ExecutorStatus::TRAINING);
}

namespace {

// One round of StopTraining to the ranks in `pending`; leaves there those
// that did not confirm, with their answers in `why`.
void StopRound(
    const v1::Deployment& d, DeploymentExecutors& executors, const DeploymentWatchOptions& o,
    std::vector<int>* pending, std::vector<std::string>* why,
    const std::function<void(const absl::StatusOr<v1::ExecutorStatus>&)>& seen = nullptr) {
  DeploymentExecutors::Statuses answers = executors.StopTraining(d.name(), o.stop_timeout);
  if (seen) {
    for (const auto& a : answers) seen(a);
  }
  std::vector<int> left;
  why->clear();
  for (int r : *pending) {
    absl::StatusOr<v1::ExecutorStatus> answer =
        r < static_cast<int>(answers.size())
            ? answers[r]
            : absl::StatusOr<v1::ExecutorStatus>(absl::InternalError("no answer"));
    if (RankStopped(d, answer)) continue;
    left.push_back(r);
    why->push_back(Unstopped(d, r, answer));
  }
  pending->swap(left);
}

absl::Status NotStopped(const std::vector<std::string>& why, int attempts) {
  return absl::UnavailableError(absl::StrCat("not confirmed stopped after ", attempts,
                                             attempts == 1 ? " attempt: " : " attempts: ",
                                             absl::StrJoin(why, "; ")));
}

}  // namespace

absl::Status StopRanksOnce(const v1::Deployment& d, DeploymentExecutors& executors,
                           const DeploymentWatchOptions& o) {
  std::vector<int> pending;
  for (int r = 0; r < d.ranks_size(); ++r) pending.push_back(r);
  std::vector<std::string> why;
  StopRound(d, executors, o, &pending, &why);
  return pending.empty() ? absl::OkStatus() : NotStopped(why, 1);
}

absl::Status StopEveryRank(
    const v1::Deployment& d, DeploymentExecutors& executors, const DeploymentWatchOptions& o,
    const DeploymentControl& control,
    const std::function<void(const absl::StatusOr<v1::ExecutorStatus>&)>& answers) {
  std::vector<int> pending;
  for (int r = 0; r < d.ranks_size(); ++r) pending.push_back(r);
  std::vector<std::string> why;
  int attempts = 0;
  while (!pending.empty() && attempts < o.stop_attempts) {
    if (attempts > 0 && control.wait(control.now() + o.status_interval,
                                     /*stop_wakes=*/false) == Wake::kShutdown) {
      break;
    }
    // Every rank is asked again, not only the pending ones: the executors'
    // client sends to all at once, and a repeated stop is a no-op.
    StopRound(d, executors, o, &pending, &why, answers);
    ++attempts;
  }
  return pending.empty() ? absl::OkStatus() : NotStopped(why, attempts);
}

void RunDeployment(const v1::Deployment& d, const v1::Plan& plan,
                   const std::string& rendezvous_address, DeploymentExecutors& executors,
                   const DeploymentWatchOptions& o, const DeploymentControl& control) {
  const int world = d.ranks_size();
  // Between calls: a stop request ends the push, a shutdown leaves it.
  auto interrupted = [&]() -> bool {
    switch (control.wait(absl::InfinitePast(), /*stop_wakes=*/true)) {
      case Wake::kTimeout:
        return false;
      case Wake::kStop:
        StopAndMarkStopped(d, executors, o, control);
        return true;
      case Wake::kShutdown:
        return true;  // PENDING: a restarted planner fails it and stops its ranks
    }
    return true;
  };
  for (int r = 0; r < world; ++r) {
    if (interrupted()) return;
    v1::LoadPlanRequest req;
    *req.mutable_plan() = plan;
    req.set_deployment(d.name());
    req.set_generation(d.generation());
    req.set_rank(r);
    req.set_world_size(world);
    req.set_rendezvous_address(rendezvous_address);
    *req.mutable_training() = d.training();
    absl::Status s = executors.LoadPlan(r, req, o.call_timeout);
    if (!s.ok()) {
      // DataLoss from the load of a resumed run: the checkpoint's records
      // (trainer.json, index.json, COMMITTED) are damaged, which is not the
      // executor's fault.
      const bool damaged = absl::IsDataLoss(s) && !d.training().resume().empty();
      return FailAndStop(d, absl::StrCat("LoadPlan on ", DescribeRank(d, r), ": ", s.message()),
                         damaged ? std::vector<int>{} : std::vector<int>{r}, damaged, executors, o,
                         control);
    }
  }
  for (int r = 0; r < world; ++r) {
    if (interrupted()) return;
    absl::Status s = executors.StartTraining(r, d.name(), o.call_timeout);
    if (!s.ok()) {
      return FailAndStop(d,
                         absl::StrCat("StartTraining on ", DescribeRank(d, r), ": ", s.message()),
                         {r}, /*damaged=*/false, executors, o, control);
    }
  }
  control.update([](v1::Deployment& x) { x.set_state(v1::Deployment::RUNNING); });
  WatchDeployment(d, executors, o, control);
}

namespace {

// What the status polls bring into the deployment's record, by rank.
struct RankReports {
  explicit RankReports(const v1::Deployment& d)
      : profiles(d.rank_profiles().begin(), d.rank_profiles().end()) {
    for (const auto& r : d.ranks()) backends.push_back(r.backend());
  }
  std::vector<v1::StepProfile> profiles;
  std::vector<std::string> backends;
};

// The ranks' newest per-op profiles into the deployment's record, when a
// poll brought a new window (every profile_window steps, not every poll),
// and the backend each rank runs on, once known or when it changed.
void KeepRankReports(const v1::Deployment& d, const DeploymentExecutors::Statuses& statuses,
                     RankReports* kept, const DeploymentControl& control) {
  bool profiles_changed = false, backends_changed = false;
  if (kept->profiles.size() != static_cast<size_t>(d.ranks_size())) {
    kept->profiles.assign(d.ranks_size(), v1::StepProfile());
  }
  kept->backends.resize(d.ranks_size());
  for (size_t r = 0; r < statuses.size() && r < kept->profiles.size(); ++r) {
    const auto& s = statuses[r];
    if (!s.ok() || s->deployment() != d.name() || s->generation() != d.generation()) continue;
    if (!s->backend().empty() && s->backend() != kept->backends[r]) {
      kept->backends[r] = s->backend();
      backends_changed = true;
    }
    if (!s->has_profile() || s->profile().steps() <= 0) continue;
    v1::StepProfile& k = kept->profiles[r];
    if (k.steps() > 0 && k.first_step() == s->profile().first_step()) continue;
    k = s->profile();
    k.set_rank(static_cast<int32_t>(r));
    profiles_changed = true;
  }
  if (!profiles_changed && !backends_changed) return;
  control.update([&](v1::Deployment& x) {
    if (profiles_changed) {
      x.clear_rank_profiles();
      for (const auto& p : kept->profiles) *x.add_rank_profiles() = p;
    }
    for (int r = 0; backends_changed && r < x.ranks_size(); ++r) {
      x.mutable_ranks(r)->set_backend(kept->backends[r]);
    }
  });
}

}  // namespace

void WatchDeployment(const v1::Deployment& d, DeploymentExecutors& executors,
                     const DeploymentWatchOptions& o, const DeploymentControl& control) {
  RankWatch watch(d, o.missed_status_limit);
  RankReports reports(d);
  absl::Time next = control.now();
  while (true) {
    switch (control.wait(next, /*stop_wakes=*/true)) {
      case Wake::kShutdown:
        return;  // the executors keep training; a restarted planner re-attaches
      case Wake::kStop:
        return StopAndMarkStopped(d, executors, o, control);
      case Wake::kTimeout:
        break;
    }
    // Polls start status_interval apart, however long one takes (at most
    // status_timeout), so a silent rank is found after about
    // missed_status_limit intervals.
    const absl::Time started = control.now();
    const DeploymentExecutors::Statuses statuses = executors.GetStatus(o.status_timeout);
    switch (watch.Observe(statuses)) {
      case RankWatch::Verdict::kRunning:
        KeepRankReports(d, statuses, &reports, control);
        if (control.save_again) control.save_again();
        break;
      case RankWatch::Verdict::kSucceeded:
        KeepRankReports(d, statuses, &reports, control);  // a run ended before a poll saw it
        control.update([](v1::Deployment& x) { x.set_state(v1::Deployment::SUCCEEDED); });
        return;
      case RankWatch::Verdict::kFailed:
        KeepRankReports(d, statuses, &reports, control);  // also of a run failed at its first poll
        return FailAndStop(d, watch.error(), watch.failed_ranks(), watch.resume_damaged(),
                           executors, o, control);
    }
    next = started + o.status_interval;
  }
}

void FailUnfinishedDeployment(const v1::Deployment& d, const std::string& reason,
                              DeploymentExecutors& executors, const DeploymentWatchOptions& o,
                              const DeploymentControl& control) {
  FailAndStop(d, reason, {}, /*damaged=*/false, executors, o, control);
}

}  // namespace hap::service
