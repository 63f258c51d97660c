#include "planner/service/core/jobs.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/host_port.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/training_checks.h"
#include "executor/checkpoint/layout.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/protobuf/util/time_util.h"
#include "planner/service/core/job_reconcile.h"
#include "planner/service/core/node_calibration.h"
#include "planner/service/core/pagination.h"
#include "planner/service/core/profile_checks.h"
#include "planner/service/core/retention.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
namespace fs = std::filesystem;
namespace ckpt = ::hap::executor::checkpoint;
using job_internal::JoinStable;
using job_internal::ReadyDevices;

constexpr size_t kMaxJobId = 50;  // "{job}-p{n}" stays a valid plan id

std::string RandomJobId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (counter++ << 48);
  return absl::StrCat("j-", absl::Hex(x, absl::kZeroPad16));
}

absl::StatusOr<std::string> JobId(const std::string& name) {
  if (name.rfind("jobs/", 0) != 0 || !ValidId(name.substr(5))) {
    return absl::InvalidArgumentError(absl::StrCat("job name '", name, "' is not jobs/{id}"));
  }
  return name.substr(5);
}

// The daemon's backend over the planner core and the deployment manager.
class CoreJobBackend final : public JobBackend {
 public:
  CoreJobBackend(PlannerCore* core, DeploymentManager* deployments,
                 std::function<std::string()> rendezvous)
      : core_(core), deployments_(deployments), rendezvous_(std::move(rendezvous)) {}

  v1::Cluster Cluster() override { return core_->GetCluster(/*include_stale=*/true); }
  absl::StatusOr<v1::Plan> CreatePlan(const v1::CreatePlanRequest& r,
                                      const std::string& job) override {
    return core_->CreatePlan(
        r, absl::InfiniteFuture(), [] { return false; }, job);
  }
  absl::StatusOr<v1::Plan> GetPlan(const std::string& name) override {
    return core_->GetPlan(name, /*full=*/false);
  }
  absl::Status CancelPlan(const std::string& name) override {
    return core_->CancelPlan(name).status();
  }
  absl::StatusOr<v1::Deployment> Deploy(
      const std::string& plan, const v1::TrainingConfig& training,
      const std::map<std::string, std::string>& executors) override {
    // Pinned: retention cannot delete the plan under the new deployment.
    HAP_ASSIGN_OR_RETURN(v1::Plan p, core_->PinPlan(plan));
    v1::DeployPlanRequest r;
    r.set_plan(plan);
    *r.mutable_training() = training;
    for (const auto& d : p.devices()) {
      auto it = executors.find(d);
      if (it != executors.end()) (*r.mutable_executors())[d] = it->second;
    }
    absl::StatusOr<v1::Deployment> d =
        deployments_->Deploy(p, r, core_->GetCluster(true), rendezvous_());
    core_->UnpinPlan(plan);  // (a deployment made keeps its plan by itself)
    return d;
  }
  absl::StatusOr<v1::Deployment> GetDeployment(const std::string& name) override {
    return deployments_->Get(name);
  }
  std::vector<v1::Deployment> DeploymentsOf(const std::string& plan) override {
    return deployments_->OfPlan(plan);
  }
  std::map<std::string, std::vector<std::string>> ActiveDeploymentDevices() override {
    return deployments_->ActiveDevices();
  }
  absl::Status StopDeployment(const std::string& name) override {
    // A deadline already past: ask, do not wait.
    return deployments_->Stop(name, absl::InfinitePast(), [] { return true; }).status();
  }
  absl::StatusOr<int64_t> LatestCheckpoint(const std::string& dir) override {
    return LatestCommittedCheckpoint(dir);
  }
  absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& step_dir) override {
    return hap::service::SetAsideDamagedCheckpoint(step_dir);
  }
  absl::StatusOr<std::string> Calibrate(const v1::Deployment& d) override {
    return core_->CalibrateDevices(d.plan(), d.name(),
                                   {d.rank_profiles().begin(), d.rank_profiles().end()});
  }

 private:
  PlannerCore* core_;
  DeploymentManager* deployments_;
  std::function<std::string()> rendezvous_;
};

}  // namespace

absl::StatusOr<int64_t> LatestCommittedCheckpoint(const std::string& dir) {
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint directory ", dir));
  }
  const std::map<int64_t, std::string> committed = ckpt::CommittedSteps(dir, &ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot read ", dir, ": ", ec.message()));
  if (committed.empty()) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", dir));
  }
  return committed.rbegin()->first;
}

std::string CheckpointStepDir(const std::string& dir, int64_t step) {
  return (fs::path(dir) / ckpt::StepDirName(step)).string();
}

absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& step_dir) {
  fs::path from(step_dir);
  if (!from.has_filename()) from = from.parent_path();  // "DIR/step-N/"
  const int64_t step = ckpt::StepOf(from.filename().string());
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", step_dir, "' is not a checkpoint step directory (step-N)"));
  }
  std::error_code ec;
  if (!fs::is_directory(from, ec)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint directory ", step_dir));
  }
  const fs::path parent = from.parent_path().empty() ? fs::path(".") : from.parent_path();
  const fs::path to = ckpt::SetAsidePath(parent.string(), ckpt::kDamagedPrefix, step);
  // rename(2) refuses to replace a directory that is not empty, so a name
  // taken between the check and here fails rather than losing anything.
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot rename ", from.string(), " to ",
                                                      to.string(), ": ", std::strerror(errno)));
  }
  const int fd = open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const bool synced = fd >= 0 && fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) close(fd);
  if (!synced) {
    // Renamed, not durable: a crash may bring the name back, and the job
    // then finds the damage again.
    return absl::UnavailableError(absl::StrCat("renamed ", from.string(), " to ", to.string(),
                                               " but cannot sync ", parent.string(), ": ",
                                               std::strerror(err)));
  }
  return to.string();
}

std::unique_ptr<JobBackend> NewCoreJobBackend(PlannerCore* core, DeploymentManager* deployments,
                                              std::function<std::string()> rendezvous_address) {
  return std::make_unique<CoreJobBackend>(core, deployments, std::move(rendezvous_address));
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  if (spec.model().model_case() == v1::ModelSpec::MODEL_NOT_SET) {
    return absl::InvalidArgumentError("spec.model: a zoo model or a graph is required");
  }
  const v1::TrainingConfig& t = spec.training();
  if (t.steps() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.training.steps must be positive, got ", t.steps()));
  }
  if (t.checkpoint_dir().empty()) {
    return absl::InvalidArgumentError(
        "spec.training.checkpoint_dir is required: a job resumes from it after a re-plan "
        "(a directory every executor and the planner see)");
  }
  if (t.checkpoint_every() < 0 || t.checkpoint_keep() < 0 || t.threads_per_rank() < 0) {
    return absl::InvalidArgumentError(
        "spec.training.checkpoint_every, checkpoint_keep and threads_per_rank must not be "
        "negative");
  }
  if (!t.resume().empty() || !t.init_weights().empty()) {
    return absl::InvalidArgumentError(
        "spec.training.resume and init_weights are set by the job (it resumes from "
        "checkpoint_dir); leave them empty");
  }
  if (spec.global_batch() < 0) {
    return absl::InvalidArgumentError("spec.global_batch must not be negative");
  }
  const v1::DeviceSelector& d = spec.devices();
  if (d.min_devices() < 0 || d.max_devices() < 0 ||
      (d.max_devices() > 0 && d.max_devices() < d.min_devices())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.devices: min_devices (", d.min_devices(), ") and max_devices (", d.max_devices(),
        ") must not be negative, and max_devices (when set) at least min_devices"));
  }
  const v1::ReplanPolicy& r = spec.replan();
  if (!(r.min_gain() >= 0 && r.min_gain() < 100)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.replan.min_gain must be a fraction in [0, 100), got ", r.min_gain()));
  }
  if (r.join_stable().seconds() < 0 || r.join_stable().nanos() < 0 || r.max_replans() < 0) {
    return absl::InvalidArgumentError(
        "spec.replan.join_stable and max_replans must not be negative");
  }
  return absl::OkStatus();
}

namespace {

// What a new job's spec must hold besides ValidateJobSpec (which stored
// jobs are loaded by, and so stays as lenient as it was): plan options a
// plan takes, a training config an executor takes, a slowdown threshold
// and join_stable that mean what they say.
absl::Status CheckNewJobSpec(const v1::JobSpec& spec) {
  // The model as a plan on the fewest devices a plan takes (two) builds it.
  if (absl::Status m = PlannerCore::BuildModel(spec.model(), spec.global_batch(), 2).status();
      !m.ok()) {
    return absl::Status(m.code(), absl::StrCat("spec.", m.message()));
  }
  HAP_RETURN_IF_ERROR(Annotate(PlannerCore::CheckNewPlanOptions(spec.options()), "spec"));
  HAP_RETURN_IF_ERROR(
      Annotate(PlannerCore::CheckBatchGivenOnce(spec.model(), spec.global_batch()), "spec"));
  HAP_RETURN_IF_ERROR(Annotate(CheckNewTrainingConfig(spec.training()), "spec"));
  HAP_RETURN_IF_ERROR(Annotate(CheckDataSpecForm(spec.training().data_spec()), "spec"));
  if (const std::string& dir = spec.training().checkpoint_dir(); dir.front() != '/') {
    // The planner reads it (the latest committed step) and the executors
    // write it, each from its own working directory.
    return absl::InvalidArgumentError(
        absl::StrCat("spec.training.checkpoint_dir must be an absolute path (a directory every "
                     "executor and the planner see at that path), got '",
                     dir, "'"));
  }
  HAP_RETURN_IF_ERROR(CheckRange("spec.replan.slowdown_threshold",
                                 spec.replan().slowdown_threshold(), 0, kInf,
                                 "a finite number >= 0 (0 = 0.25)"));
  if (spec.replan().join_stable().nanos() > 999'999'999) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.replan.join_stable.nanos must be at most 999999999, got ",
                     spec.replan().join_stable().nanos()));
  }
  // A selector no plan can satisfy: the job would wait for devices for ever.
  const v1::DeviceSelector& d = spec.devices();
  if (d.max_devices() == 1) {
    return absl::InvalidArgumentError(
        "spec.devices.max_devices must be 0 (no limit) or at least 2 (a plan takes two devices "
        "or more), got 1");
  }
  if (d.min_devices() > kMaxPlanDevices) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.devices.min_devices must be at most ", kMaxPlanDevices,
                     " (the most a plan takes), got ", d.min_devices()));
  }
  if (d.devices_size() > 0) {
    const std::set<std::string> listed(d.devices().begin(), d.devices().end());
    if (listed.size() < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.devices.devices lists ", listed.size(),
          " distinct device; a plan takes two or more (leave it empty for any device)"));
    }
    if (static_cast<int>(listed.size()) < d.min_devices()) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.devices.min_devices is ", d.min_devices(),
                       " but spec.devices.devices lists ", listed.size(), " distinct devices"));
    }
  }
  // Every deploy dials these as given (DeploymentManager::Deploy refuses
  // what it would misread): refused there, the job tried again for ever.
  const std::map<std::string, std::string> executors(spec.executors().begin(),
                                                     spec.executors().end());
  std::map<std::string, std::string> device_at;  // address -> device
  for (const auto& [device, address] : executors) {
    if (!ValidDeviceId(device)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.executors: '", absl::CHexEscape(device), "' is not a device id"));
    }
    if (!IsHostPort(address, 1, /*schemes=*/true)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.executors[\"", device, "\"] '", absl::CHexEscape(address),
                       "' must be HOST:PORT with a port from 1 to 65535"));
    }
    if (auto [at, added] = device_at.emplace(address, device); !added) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.executors gives devices '", at->second, "' and '", device, "' the same executor '",
          address, "'; an executor runs one rank: give each its own"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct JobController::State {
  mutable absl::Mutex mu;
  absl::CondVar changed;  // a job changed; shutdown; a pass asked for
  bool shutdown = false;
  bool wake = false;
  std::map<std::string, v1::Job> jobs;
  // When each device was first seen on a READY node, in an unbroken run
  // with the same agent (address): a node registered again starts anew.
  struct Seen {
    absl::Time since;
    std::string address;
  };
  std::map<std::string, Seen> ready_since;
  absl::Mutex pass_mu;  // one pass at a time
  std::thread loop;
};

namespace {

// What is wrong with a stored job this controller cannot drive (a name not
// jobs/{id}, a plan name not plans/{id}, a state this version does not
// know, a spec it cannot run); OK for one it can.
absl::Status ValidateStoredJob(const v1::Job& j) {
  absl::StatusOr<std::string> id = JobId(j.name());
  if (!id.ok()) return id.status();
  if (id->size() > kMaxJobId) {
    return absl::InvalidArgumentError(
        absl::StrCat("job id '", *id, "' is longer than ", kMaxJobId, " characters"));
  }
  const v1::JobStatus& st = j.status();
  if (st.state() == v1::JobStatus::STATE_UNSPECIFIED ||
      v1::JobStatus::State_Name(st.state()).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("status.state ", static_cast<int>(st.state()), " is not a job state"));
  }
  for (const auto& [field, plan] : {std::pair<const char*, const std::string*>{"plan", &st.plan()},
                                    {"next_plan", &st.next_plan()},
                                    {"candidate_plan", &st.candidate_plan()}}) {
    if (plan->empty()) continue;
    absl::Status ok = PlanId(*plan).status();
    if (!ok.ok()) return Annotate(ok, absl::StrCat("status.", field));
  }
  return Annotate(ValidateJobSpec(j.spec()), "spec");
}

}  // namespace

JobController::JobController(JobControllerOptions options, std::vector<v1::Job> jobs)
    : o_(std::move(options)), s_(std::make_unique<State>()) {
  absl::MutexLock l(&s_->mu);
  for (auto& j : jobs) {
    // A stored job that cannot be driven ends FAILED, saying why, rather
    // than the planner failing on start (or a pass on it).
    if (!JobFinal(j.status().state())) {
      absl::Status bad = ValidateStoredJob(j);
      if (!bad.ok()) {
        v1::JobStatus& st = *j.mutable_status();
        st.set_state(v1::JobStatus::FAILED);
        st.set_message(
            absl::StrCat("the planner cannot drive this job as stored: ", bad.message()));
        *st.mutable_update_time() = ToProto(o_.now());
        if (o_.sink != nullptr) {
          absl::Status saved = o_.sink->SaveJob(j);
          if (!saved.ok()) {
            absl::StrAppend(st.mutable_message(), " (not saved: ", saved.message(), ")");
          }
        }
      }
    }
    s_->jobs[j.name()] = std::move(j);
  }
}

JobController::~JobController() { Shutdown(); }

void JobController::Start() {
  absl::MutexLock l(&s_->mu);
  if (s_->loop.joinable() || s_->shutdown) return;
  s_->loop = std::thread([this] {
    while (true) {
      Reconcile();
      absl::MutexLock l(&s_->mu);
      const absl::Time until = absl::Now() + o_.interval;
      while (!s_->shutdown && !s_->wake && absl::Now() < until) {
        s_->changed.WaitWithDeadline(&s_->mu, until);
      }
      if (s_->shutdown) return;
      s_->wake = false;
    }
  });
}

void JobController::Shutdown() {
  std::thread loop;
  {
    absl::MutexLock l(&s_->mu);
    s_->shutdown = true;
    s_->changed.SignalAll();
    loop.swap(s_->loop);
  }
  if (loop.joinable()) loop.join();
}

namespace {

// A directory path as a comparison key: "/a/b/", "/a//b" and "/a/./b" are
// one directory (links are not resolved: the planner may not see the
// executors' file system).
std::string SameDirectoryKey(const std::string& dir) {
  std::string key = fs::path(dir).lexically_normal().string();
  while (key.size() > 1 && key.back() == '/') key.pop_back();
  return key;
}

}  // namespace

absl::StatusOr<v1::Job> JobController::Create(const v1::CreateJobRequest& r) {
  HAP_RETURN_IF_ERROR(ValidateJobSpec(r.spec()));
  HAP_RETURN_IF_ERROR(CheckNewJobSpec(r.spec()));
  const std::string id = r.job_id().empty() ? RandomJobId() : r.job_id();
  if (!ValidId(id) || id.size() > kMaxJobId) {
    return absl::InvalidArgumentError(absl::StrCat("job_id '", id, "' must be 1-", kMaxJobId,
                                                   " lowercase letters, digits or '-'"));
  }
  v1::Job j;
  j.set_name("jobs/" + id);
  *j.mutable_spec() = r.spec();
  *j.mutable_create_time() = ToProto(o_.now());
  v1::JobStatus& st = *j.mutable_status();
  st.set_state(v1::JobStatus::PENDING);
  st.set_checkpoint_step(-1);
  st.set_switch_after_step(-1);
  *st.mutable_update_time() = j.create_time();
  absl::MutexLock l(&s_->mu);
  if (s_->shutdown) return absl::UnavailableError("the planner is shutting down");
  if (s_->jobs.count(j.name())) {
    return absl::AlreadyExistsError(absl::StrCat(j.name(), " already exists"));
  }
  int unfinished = 0;
  for (const auto& [name, other] : s_->jobs) {
    unfinished += JobFinal(other.status().state()) ? 0 : 1;
  }
  if (unfinished >= kMaxUnfinishedJobs) {
    return absl::ResourceExhaustedError(
        absl::StrCat(unfinished, " jobs are not finished, the most the planner holds (",
                     kMaxUnfinishedJobs, "): wait for some to finish or StopJob some"));
  }
  // One writer a checkpoint directory: two jobs training into one would
  // resume from (and retire) each other's checkpoints. A finished job's
  // directory may be taken (a new job then resumes from its last step).
  const std::string dir = SameDirectoryKey(r.spec().training().checkpoint_dir());
  for (const auto& [name, other] : s_->jobs) {
    if (!JobFinal(other.status().state()) &&
        SameDirectoryKey(other.spec().training().checkpoint_dir()) == dir) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spec.training.checkpoint_dir '", r.spec().training().checkpoint_dir(),
          "' is the checkpoint directory of ", name, " (",
          v1::JobStatus::State_Name(other.status().state()),
          "): two jobs writing one directory would resume from each other's checkpoints; "
          "give this job its own, or stop ",
          name, " first"));
    }
  }
  if (o_.sink != nullptr) {
    HAP_RETURN_IF_ERROR(Annotate(o_.sink->SaveJob(j), absl::StrCat(j.name(), " was not created")));
  }
  s_->jobs[j.name()] = j;
  if (o_.on_change) o_.on_change(j);
  s_->wake = true;
  s_->changed.SignalAll();
  return j;
}

absl::StatusOr<v1::Job> JobController::Get(const std::string& name) const {
  HAP_RETURN_IF_ERROR(JobId(name).status());
  absl::MutexLock l(&s_->mu);
  auto it = s_->jobs.find(name);
  if (it == s_->jobs.end()) {
    return absl::NotFoundError(absl::StrCat("job '", name, "' does not exist"));
  }
  return it->second;
}

absl::StatusOr<v1::ListJobsResponse> JobController::List(int page_size,
                                                         const std::string& page_token) const {
  v1::ListJobsResponse out;
  absl::MutexLock l(&s_->mu);
  HAP_ASSIGN_OR_RETURN(std::string next,
                       Paginate(s_->jobs, page_size, page_token, "jobs", [&](const v1::Job& j) {
                         *out.add_jobs() = j;
                         return j.ByteSizeLong();
                       }));
  out.set_next_page_token(next);
  return out;
}

std::vector<v1::Job> JobController::All() const {
  absl::MutexLock l(&s_->mu);
  std::vector<v1::Job> out;
  for (const auto& [name, j] : s_->jobs) out.push_back(j);
  return out;
}

std::set<std::string> JobController::UnfinishedJobsDeployments() const {
  absl::MutexLock l(&s_->mu);
  std::set<std::string> out;
  for (const auto& [name, j] : s_->jobs) {
    if (!JobFinal(j.status().state()) && !j.status().deployment().empty()) {
      out.insert(j.status().deployment());
    }
  }
  return out;
}

absl::StatusOr<int> JobController::EnforceRetention(int count, absl::Time oldest) {
  if (count <= 0 && oldest == absl::InfinitePast()) return 0;
  std::vector<std::string> victims;
  {
    absl::MutexLock l(&s_->mu);
    std::vector<std::pair<absl::Time, std::string>> finished;
    for (const auto& [name, j] : s_->jobs) {
      // A finished job changes no more: its last update is when it ended.
      if (JobFinal(j.status().state()))
        finished.push_back({FromProto(j.status().update_time()), name});
    }
    victims = PastRetention(std::move(finished), count, oldest);
  }
  int deleted = 0;
  for (const std::string& name : victims) {
    absl::MutexLock l(&s_->mu);
    auto it = s_->jobs.find(name);
    if (it == s_->jobs.end() || !JobFinal(it->second.status().state())) continue;
    if (absl::Status st = DeleteLocked(it); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("job retention: ", st.message(), " (", deleted,
                                                  " deleted before it)"));
    }
    ++deleted;
  }
  return deleted;
}

absl::Status JobController::Delete(const std::string& name) {
  HAP_ASSIGN_OR_RETURN(const std::string id, JobId(name));
  absl::MutexLock l(&s_->mu);
  auto it = s_->jobs.find(name);
  if (it == s_->jobs.end()) {
    return absl::NotFoundError(absl::StrCat("job '", name, "' does not exist"));
  }
  if (!JobFinal(it->second.status().state())) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", name, "' is ", v1::JobStatus::State_Name(it->second.status().state()),
                     ": only a finished job is deleted; stop it first (hapctl stop job ", id, ")"));
  }
  return DeleteLocked(it);
}

absl::Status JobController::DeleteLocked(std::map<std::string, v1::Job>::iterator it) {
  if (o_.sink != nullptr) {
    absl::Status st = o_.sink->DeleteJob(it->first);
    if (!st.ok() && !absl::IsNotFound(st)) {
      return Annotate(st, absl::StrCat(it->first, " was not deleted"));
    }
  }
  s_->jobs.erase(it);
  s_->changed.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> JobController::Stop(const std::string& name) {
  HAP_RETURN_IF_ERROR(JobId(name).status());
  absl::MutexLock l(&s_->mu);
  auto it = s_->jobs.find(name);
  if (it == s_->jobs.end()) {
    return absl::NotFoundError(absl::StrCat("job '", name, "' does not exist"));
  }
  if (JobFinal(it->second.status().state()) || it->second.status().stop_requested()) {
    return it->second;
  }
  v1::Job next = it->second;
  next.mutable_status()->set_stop_requested(true);
  next.mutable_status()->set_message("stop requested");
  *next.mutable_status()->mutable_update_time() = ToProto(o_.now());
  if (o_.sink != nullptr) {
    HAP_RETURN_IF_ERROR(
        Annotate(o_.sink->SaveJob(next), absl::StrCat(name, ": the stop was not saved")));
  }
  it->second = next;
  if (o_.on_change) o_.on_change(next);
  s_->wake = true;
  s_->changed.SignalAll();
  return next;
}

absl::Status JobController::Watch(const std::string& name,
                                  const std::function<bool(const v1::Job&)>& on_update,
                                  const std::function<bool()>& stop) {
  HAP_ASSIGN_OR_RETURN(v1::Job last, Get(name));
  if (!on_update(last)) return absl::OkStatus();
  while (!JobFinal(last.status().state()) && !stop()) {
    v1::Job now;
    {
      absl::MutexLock l(&s_->mu);
      if (s_->shutdown) return absl::OkStatus();
      auto changed = [&]() ABSL_SHARED_LOCKS_REQUIRED(s_->mu) {
        auto it = s_->jobs.find(name);
        return it == s_->jobs.end() || s_->shutdown ||
               !google::protobuf::util::MessageDifferencer::Equals(it->second, last);
      };
      const absl::Time until = absl::Now() + absl::Milliseconds(100);
      while (!changed() && absl::Now() < until) s_->changed.WaitWithDeadline(&s_->mu, until);
      auto it = s_->jobs.find(name);
      if (it == s_->jobs.end()) return absl::OkStatus();
      now = it->second;
    }
    if (google::protobuf::util::MessageDifferencer::Equals(now, last)) continue;
    last = now;
    if (!on_update(last)) return absl::OkStatus();
  }
  return absl::OkStatus();
}

bool JobController::Commit(const v1::Job& in) {
  v1::Job next = in;
  absl::MutexLock l(&s_->mu);
  auto it = s_->jobs.find(next.name());
  if (it == s_->jobs.end()) return false;
  // A stop asked while the pass ran is kept (the next pass acts on it).
  if (it->second.status().stop_requested()) next.mutable_status()->set_stop_requested(true);
  next.mutable_status()->clear_update_time();
  v1::Job cur = it->second;
  cur.mutable_status()->clear_update_time();
  if (google::protobuf::util::MessageDifferencer::Equals(cur, next)) return true;
  *next.mutable_status()->mutable_update_time() = ToProto(o_.now());
  if (o_.sink != nullptr) {
    absl::Status saved = o_.sink->SaveJob(next);
    if (!saved.ok()) {
      // Left as stored (what a restart would find); the next pass tries again.
      it->second.mutable_status()->set_message(
          absl::StrCat("the planner could not save this job: ", saved.message()));
      s_->changed.SignalAll();
      return false;
    }
  }
  it->second = std::move(next);
  if (o_.on_change) o_.on_change(it->second);
  s_->changed.SignalAll();
  return true;
}

void JobController::Reconcile() {
  absl::MutexLock pass(&s_->pass_mu);
  {
    absl::MutexLock l(&s_->mu);
    const bool any = std::any_of(s_->jobs.begin(), s_->jobs.end(), [](const auto& kv) {
      return !JobFinal(kv.second.status().state());
    });
    if (!any) {  // nothing to drive: no need to read the cluster every second
      s_->ready_since.clear();
      return;
    }
  }
  const absl::Time now = o_.now();
  const v1::Cluster cluster = o_.backend->Cluster();
  const std::map<std::string, std::string> ready_at = ReadyDevices(cluster);
  std::set<std::string> ready;
  for (const auto& [d, address] : ready_at) ready.insert(d);
  std::vector<std::string> names;
  {
    absl::MutexLock l(&s_->mu);
    for (auto it = s_->ready_since.begin(); it != s_->ready_since.end();) {
      auto r = ready_at.find(it->first);
      const bool same = r != ready_at.end() && r->second == it->second.address;
      it = same ? std::next(it) : s_->ready_since.erase(it);
    }
    for (const auto& [d, address] : ready_at) s_->ready_since.emplace(d, State::Seen{now, address});
    for (const auto& [name, j] : s_->jobs) {
      if (!JobFinal(j.status().state())) names.push_back(name);
    }
  }
  // What each job holds or is planning on, updated after its pass: a job
  // does not plan on another's devices, nor on those of a deployment made
  // directly (DeployPlan) that has not finished.
  std::map<std::string, std::set<std::string>> claimed;
  std::set<std::string> deployed_directly;
  {
    std::vector<v1::Job> jobs;
    {
      absl::MutexLock l(&s_->mu);
      for (const auto& [name, j] : s_->jobs) jobs.push_back(j);
    }
    std::set<std::string> of_jobs;
    for (const v1::Job& j : jobs) {
      claimed[j.name()] = job_internal::ClaimedDevices(j, *o_.backend);
      // A finished job's deployment that has not finished (asked to stop
      // as the job FAILED, or a stored job it cannot drive) still trains:
      // its devices are held as a direct deployment's are.
      if (!JobFinal(j.status().state()) && !j.status().deployment().empty()) {
        of_jobs.insert(j.status().deployment());
      }
    }
    for (const auto& [name, devices] : o_.backend->ActiveDeploymentDevices()) {
      if (!of_jobs.count(name)) deployed_directly.insert(devices.begin(), devices.end());
    }
  }
  for (const std::string& name : names) {
    v1::Job job;
    std::set<std::string> stable, taken;
    {
      absl::MutexLock l(&s_->mu);
      if (s_->shutdown) return;
      job = s_->jobs[name];
      const absl::Duration window = JoinStable(job.spec());
      for (const auto& [d, seen] : s_->ready_since) {
        if (now - seen.since >= window) stable.insert(d);
      }
    }
    taken = deployed_directly;
    for (const auto& [other, devices] : claimed) {
      if (other != name) taken.insert(devices.begin(), devices.end());
    }
    job_internal::PassEnv env{o_.backend,
                              now,
                              cluster,
                              ready,
                              std::move(stable),
                              std::move(taken),
                              [this](const v1::Job& j) { return Commit(j); },
                              o_.on_replan,
                              o_.on_resumed,
                              o_.max_events};
    job_internal::RunPass(std::move(job), std::move(env));
    v1::Job after;
    {
      absl::MutexLock l(&s_->mu);
      if (auto it = s_->jobs.find(name); it != s_->jobs.end()) after = it->second;
    }
    claimed[name] = job_internal::ClaimedDevices(after, *o_.backend);
  }
}

}  // namespace hap::service
