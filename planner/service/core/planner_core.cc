#include "planner/service/core/planner_core.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/base/call_once.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "google/protobuf/util/time_util.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/plan_builder.h"
#include "planner/pipeline/pipeline_plan.h"
#include "planner/service/core/node_calibration.h"
#include "planner/service/core/planner_core_internal.h"
#include "planner/service/core/profile_checks.h"
#include "planner/service/core/retention.h"
#include "planner/synth/planner.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using google::protobuf::util::TimeUtil;

// The dtype a plan's matrix products are priced at (PlanOptions.precision).
v1::DType ComputeDType(const v1::PlanOptions& o) {
  return o.precision() == v1::PRECISION_BF16 ? v1::BFLOAT16 : v1::FLOAT32;
}

// A result made for another record of the plan (a cache hit's source, the
// plan a merged one waited for, the search's lowering) takes `own`'s
// identity: its name, uid, create time and the job it was made for.
void TakeIdentity(const v1::Plan& own, v1::Plan* result) {
  result->set_name(own.name());
  result->set_uid(own.uid());
  *result->mutable_create_time() = own.create_time();
  result->set_job(own.job());
}

std::string RandomId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (counter++ << 48);
  return absl::StrCat("p-", absl::Hex(x, absl::kZeroPad16));
}

// What the plan of a request depends on, hashed: the graph, the chosen
// devices in their order, their profiles, the node each is on, the links
// between them and the link defaults, and the options. Heartbeat times,
// node states, addresses, labels and devices not chosen are left out, so
// that agents heartbeating do not change the key.
std::string CacheKey(const v1::Graph& graph, const v1::Cluster& cluster,
                     const std::vector<std::string>& devices, const v1::PlanOptions& options,
                     std::string* graph_hash) {
  const std::set<std::string> chosen(devices.begin(), devices.end());
  v1::Cluster profile;
  *profile.mutable_defaults() = cluster.defaults();
  for (const v1::Node& n : cluster.nodes()) {
    v1::Node kept;
    kept.set_name(n.name());
    for (const v1::Device& d : n.devices()) {
      if (chosen.count(d.id())) *kept.add_devices() = d;
    }
    if (kept.devices_size() > 0) *profile.add_nodes() = std::move(kept);
  }
  for (const v1::Link& l : cluster.links()) {
    if (chosen.count(l.src()) && chosen.count(l.dst())) *profile.add_links() = l;
  }
  v1::Plan key_parts;
  key_parts.set_graph_hash(lower::Sha256Hex(graph));
  key_parts.set_cluster_hash(lower::Sha256Hex(profile));
  *key_parts.mutable_options() = options;
  for (const auto& d : devices) key_parts.add_devices(d);
  if (graph_hash) *graph_hash = key_parts.graph_hash();
  return lower::Sha256Hex(key_parts);
}

// Failures that come from the request itself: another search for the same
// request fails the same way, so merged plans take them over.
bool FailsForAnyone(int code) {
  switch (static_cast<absl::StatusCode>(code)) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kOutOfRange:
      return true;
    default:
      return false;
  }
}

}  // namespace

v1::LinkDefaults DefaultLinks() {
  v1::LinkDefaults d;
  d.set_intra_node_bandwidth_bytes_per_second(1e10);
  d.set_intra_node_latency_seconds(1e-5);
  d.set_inter_node_bandwidth_bytes_per_second(1.25e9);
  d.set_inter_node_latency_seconds(5e-5);
  return d;
}

absl::StatusOr<std::string> PlanId(const std::string& name) {
  if (name.rfind("plans/", 0) != 0 || !ValidId(name.substr(6))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan name '", name, "' must look like plans/{id} with an id of lowercase "
        "letters, digits and '-' (at most 63)"));
  }
  return name.substr(6);
}

struct PlannerCore::Job {
  std::string name;
  std::atomic<bool> cancel{false};
  graph::Graph graph;
  v1::Cluster cluster;  // the live cluster it plans for
  std::vector<std::string> devices;
  synth::PlanOptions options;
  v1::PlanOptions proto_options;
  std::string cache_key;
  std::string calibration;  // ApplyCalibration's note (Plan.calibration)
  absl::Time deadline = absl::InfiniteFuture();
  // Set (under the core's lock) when a state of the plan could not be saved
  // and it became FAILED instead; a CreatePlan that waits returns it.
  absl::Status save_error;
  // Merging (under the core's lock): the job whose search this one waits
  // for, or the jobs waiting for this one's.
  std::shared_ptr<Job> leader;
  std::vector<std::shared_ptr<Job>> followers;
};

absl::Status ConvertOptions(const v1::PlanOptions& po, PlannerCore::Job* job,
                            const PlannerCoreOptions& o_) {
  // Everything the plan carries to the executors is checked here: a NaN
  // learning rate would otherwise reach every rank's optimizer.
  if (po.budget().max_states() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.budget.max_states must not be negative, got ", po.budget().max_states()));
  }
  HAP_RETURN_IF_ERROR(CheckRange("options.budget.max_seconds", po.budget().max_seconds(), 0,
                                 kInf, "a finite number >= 0 (0 = the default)"));
  if (po.segments() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.segments must not be negative, got ", po.segments()));
  }
  if (po.segments() > 1) {
    return absl::InvalidArgumentError(
        "options.segments > 1 (per-layer-group ratios) is not supported yet");
  }
  if (po.max_joint_iterations() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.max_joint_iterations must not be negative, got ", po.max_joint_iterations()));
  }
  // Pipeline mode, stages and microbatches (checked again where planned).
  HAP_RETURN_IF_ERROR(pipeline::FromProto(po).status());
  if (!v1::Precision_IsValid(po.precision())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.precision ", po.precision(), " is not a known precision (FP32 or BF16)"));
  }
  if (!v1::Precision_IsValid(po.gradient_precision())) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.gradient_precision ", po.gradient_precision(),
                     " is not a known precision (FP32 or BF16)"));
  }
  if (!v1::DType_IsValid(po.compute_dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.compute_dtype ", po.compute_dtype(), " is not a known dtype"));
  }
  const v1::OptimizerConfig& opt = po.optimizer();
  if (!v1::OptimizerConfig::Kind_IsValid(opt.kind())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.optimizer.kind ", opt.kind(), " is not a known optimizer (SGD or ADAM)"));
  }
  HAP_RETURN_IF_ERROR(CheckRange("options.optimizer.learning_rate", opt.learning_rate(), 0,
                                 kInf, "a finite number >= 0 (0 = the default)"));
  HAP_RETURN_IF_ERROR(
      CheckRange("options.optimizer.momentum", opt.momentum(), 0, 1, "in [0, 1)"));
  HAP_RETURN_IF_ERROR(
      CheckRange("options.optimizer.beta1", opt.beta1(), 0, 1, "in [0, 1) (unset = 0.9)"));
  HAP_RETURN_IF_ERROR(
      CheckRange("options.optimizer.beta2", opt.beta2(), 0, 1, "in [0, 1) (unset = 0.999)"));
  HAP_RETURN_IF_ERROR(CheckRange("options.optimizer.epsilon", opt.epsilon(), 0, kInf,
                                 "a finite number >= 0 (0 = the default)"));
  HAP_RETURN_IF_ERROR(CheckRange("options.optimizer.weight_decay", opt.weight_decay(), 0, kInf,
                                 "a finite number >= 0"));
  HAP_RETURN_IF_ERROR(CheckRange("options.optimizer.clip_global_norm", opt.clip_global_norm(),
                                 0, kInf, "a finite number >= 0 (0 = no clipping)"));
  synth::PlanOptions& so = job->options;
  switch (po.baseline()) {
    case v1::BASELINE_UNSPECIFIED:
      so.baseline = synth::Baseline::kNone;
      break;
    case v1::DP_EVEN:
      so.baseline = synth::Baseline::kDpEven;
      break;
    case v1::DP_PROPORTIONAL:
      so.baseline = synth::Baseline::kDpProportional;
      break;
    case v1::MEGATRON:
      so.baseline = synth::Baseline::kMegatron;
      break;
    case v1::ZERO3:
      so.baseline = synth::Baseline::kZero3;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("options.baseline ", po.baseline(), " is not a known baseline"));
  }
  so.allow_sfb = !po.disable_sfb();
  so.allow_zero = !po.disable_zero();
  so.allow_grouped = !po.disable_grouped_collectives();
  so.overlap_communication = po.overlap_communication();
  so.bf16_gradients = po.gradient_precision() == v1::PRECISION_BF16;
  so.ignore_memory = po.ignore_memory_limits();
  so.max_states = po.budget().max_states() > 0 ? po.budget().max_states()
                                               : o_.default_max_states;
  so.max_seconds = po.budget().max_seconds() > 0 ? po.budget().max_seconds()
                                                 : o_.default_max_seconds;
  if (po.max_joint_iterations() > 0) so.max_joint_iterations = po.max_joint_iterations();
  so.optimizer = po.optimizer().kind() == v1::OptimizerConfig::ADAM
                     ? synth::OptimizerKind::kAdam
                 : po.optimizer().momentum() > 0 ? synth::OptimizerKind::kSgdMomentum
                                                 : synth::OptimizerKind::kSgd;
  job->proto_options = po;
  if (job->proto_options.optimizer().learning_rate() == 0) {
    job->proto_options.mutable_optimizer()->set_learning_rate(
        po.optimizer().kind() == v1::OptimizerConfig::ADAM ? 1e-3 : 0.1);
  }
  return absl::OkStatus();
}

absl::Status PlannerCore::CheckPlanOptions(const v1::PlanOptions& options) {
  Job job;
  return ConvertOptions(options, &job, PlannerCoreOptions());
}

PlannerCore::PlannerCore(PlannerCoreOptions options)
    : s_(std::make_unique<State>()), o_(std::move(options)) {}

PlannerCore::~PlannerCore() {
  {
    absl::MutexLock l(&s_->mu);
    s_->stopping = true;
    for (auto& [name, job] : s_->jobs) job->cancel = true;
    s_->changed.SignalAll();
  }
  for (auto& t : s_->workers) t.join();
}

absl::StatusOr<std::unique_ptr<PlannerCore>> PlannerCore::Create(
    PlannerCoreOptions options, std::vector<v1::Node> nodes, std::vector<v1::Plan> plans) {
  if (options.workers < 1 || options.missed_heartbeats < 1 ||
      options.heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "workers, missed_heartbeats and heartbeat_interval must be positive");
  }
  if (options.plan_retention_count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan_retention_count must be >= 0 (0 = no limit), got ", options.plan_retention_count));
  }
  if (options.plan_retention_age <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan_retention_age must be positive (InfiniteDuration = no limit), got ",
                     absl::FormatDuration(options.plan_retention_age)));
  }
  std::unique_ptr<PlannerCore> core(new PlannerCore(std::move(options)));
  core->s_->started = core->o_.now();
  std::vector<v1::Plan> resume;
  {
    absl::MutexLock l(&core->s_->mu);
    // In name order, so that of two nodes claiming one device the first
    // by name keeps it, whatever order the store gave.
    std::sort(nodes.begin(), nodes.end(),
              [](const v1::Node& a, const v1::Node& b) { return a.name() < b.name(); });
    for (auto& n : nodes) {
      std::set<std::string> ids;
      absl::Status ok = ValidNodeName(n.name())
                            ? ValidateDevices(n.name(), n.devices(), &ids)
                            : absl::InvalidArgumentError("its name is not a valid node name");
      if (ok.ok()) ok = CheckOwners(core->s_->nodes, n.name(), ids);
      if (!ok.ok()) {
        core->start_notes_.push_back(absl::StrCat("stored node '", n.name(),
                                                  "' was not loaded: ", ok.message()));
        continue;
      }
      for (v1::Device& d : *n.mutable_devices()) {
        if (!d.has_calibration()) continue;
        if (absl::Status c = CheckCalibration(d.calibration()); !c.ok()) {
          d.clear_calibration();
          core->start_notes_.push_back(
              absl::StrCat("stored node '", n.name(), "': the calibration of device '", d.id(),
                           "' was dropped (its devices plan uncalibrated until the next "
                           "CalibrateDevices): ",
                           c.message()));
        }
      }
      core->s_->nodes[n.name()] = std::move(n);
    }
    for (auto& p : plans) {
      if (!PlanFinal(p.state())) resume.push_back(p);
      if (core->o_.load_plan && PlanFinal(p.state()) && p.rank_programs_size() == 0 &&
          !p.has_graph() && !p.has_program()) {
        // A summary: the rest is read when asked for (Whole).
        std::string name = p.name();
        core->s_->plans.insert_or_assign(std::move(name), PlanEntry::Summary(std::move(p)));
        continue;
      }
      core->s_->Put(std::move(p));
    }
  }
  // Plans cut off by a restart run again: the plan keeps what they need
  // (graph, cluster profile, devices, options).
  for (const v1::Plan& p : resume) {
    absl::Status st = core->Resume(p);
    if (!st.ok()) {
      absl::MutexLock l(&core->s_->mu);
      v1::Plan failed = *core->s_->plans.at(p.name());
      failed.set_state(v1::Plan::FAILED);
      failed.set_error(absl::StrCat("could not resume after a restart: ", st.message()));
      failed.set_error_code(static_cast<int>(st.code()));
      if (core->o_.sink) {
        // A planner that cannot write its store does not start.
        HAP_RETURN_IF_ERROR(Annotate(
            core->o_.sink->SavePlan(failed),
            absl::StrCat(p.name(), " could not resume (", st.message(),
                         ") and could not be saved as FAILED")));
      }
      core->s_->Put(std::move(failed));
    }
  }
  for (int i = 0; i < core->o_.workers; ++i) {
    core->s_->workers.emplace_back([c = core.get()] { c->Worker(); });
  }
  return core;
}

// ---------------------------------------------------------------- plans --

absl::StatusOr<v1::Plan> PlannerCore::CreatePlan(const v1::CreatePlanRequest& r,
                                                 absl::Time deadline,
                                                 const std::function<bool()>& cancelled,
                                                 const std::string& for_job) {
  auto job = std::make_shared<Job>();
  // The plan's id.
  std::string id = r.plan_id().empty() ? RandomId() : r.plan_id();
  if (!ValidId(id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan_id '", id, "' must be 1-63 lowercase letters, digits or '-'"));
  }
  job->name = "plans/" + id;
  HAP_RETURN_IF_ERROR(ConvertOptions(r.options(), job.get(), o_));
  if (r.global_batch() < 0) {
    return absl::InvalidArgumentError("global_batch must not be negative");
  }
  if (r.devices_size() > kMaxPlanDevices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "devices lists ", r.devices_size(), " device ids; a plan takes at most ", kMaxPlanDevices));
  }
  // A device listed twice, or one device listed (below), is the request's
  // fault (the cluster's, such as fewer than 2 devices in it, are
  // FAILED_PRECONDITION; an elastic job waits for a second device before it
  // asks).
  std::set<std::string> listed;
  for (const std::string& d : r.devices()) {
    if (!listed.insert(d).second) {
      return absl::InvalidArgumentError(absl::StrCat("devices lists '", d, "' twice"));
    }
  }
  synth::PlanOptions& so = job->options;
  if (r.wait() && deadline != absl::InfiniteFuture()) {
    // The search and the LP must finish inside the caller's deadline.
    double left = absl::ToDoubleSeconds(deadline - o_.now()) * 0.9;
    if (left <= 0) return absl::DeadlineExceededError("the deadline has already passed");
    so.max_seconds = std::min(so.max_seconds, left);
    job->deadline = deadline;
  }

  // The cluster: live nodes, the requested devices.
  {
    absl::MutexLock l(&s_->mu);
    if (s_->plans.count(job->name)) {
      return absl::AlreadyExistsError(absl::StrCat(job->name, " already exists"));
    }
    RefreshLivenessLocked();
    std::map<std::string, const v1::Node*> owner;
    bool any_live = false;
    for (const auto& [name, n] : s_->nodes) {
      any_live = any_live || n.state() == v1::Node::READY;
      for (const auto& d : n.devices()) owner[d.id()] = &n;
    }
    if (!any_live) {
      return absl::FailedPreconditionError(
          "no live node has reported to the planner: start hap-agent on the nodes "
          "(or check that their heartbeats reach it)");
    }
    for (const auto& d : r.devices()) {
      auto it = owner.find(d);
      if (it == owner.end()) {
        return absl::NotFoundError(absl::StrCat("device '", d, "' is not registered by any node"));
      }
      if (it->second->state() == v1::Node::STALE) {
        return absl::FailedPreconditionError(absl::StrCat(
            "device '", d, "' is on node '", it->second->name(),
            "', which is stale (no heartbeat since ",
            TimeUtil::ToString(it->second->last_heartbeat()), ")"));
      }
      job->devices.push_back(d);
    }
    job->cluster = ClusterLocked(false);
  }
  // Checked once the device is known (an unknown one is NOT_FOUND above).
  if (r.devices_size() == 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: a plan needs at least 2 devices, the request lists 1 ('",
                     r.devices(0), "'); a single device runs the single-device program as it is"));
  }
  if (job->devices.empty()) {
    for (const auto& n : job->cluster.nodes()) {
      for (const auto& d : n.devices()) job->devices.push_back(d.id());
    }
    if (job->devices.size() > static_cast<size_t>(kMaxPlanDevices)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the cluster has ", job->devices.size(), " live devices and a plan takes at most ",
          kMaxPlanDevices, ": list the devices to plan for in `devices`"));
    }
  }
  if (!r.options().ignore_calibration()) {
    job->calibration = ApplyCalibration(&job->cluster, job->devices);
  }
  auto cluster_model =
      cost::ClusterModel::FromProto(job->cluster, job->devices, ComputeDType(job->proto_options));
  if (!cluster_model.ok()) {
    return absl::Status(cluster_model.status().code() == absl::StatusCode::kInvalidArgument
                            ? absl::StatusCode::kFailedPrecondition
                            : cluster_model.status().code(),
                        absl::StrCat("cluster: ", cluster_model.status().message()));
  }
  const int n = cluster_model->size();

  // The model.
  HAP_ASSIGN_OR_RETURN(job->graph, BuildModel(r.model(), r.global_batch(), n));

  // The cache key: what the plan depends on (see CacheKey).
  v1::Graph graph_proto = graph::ToProto(job->graph);
  std::string graph_hash;
  job->cache_key =
      CacheKey(graph_proto, job->cluster, job->devices, job->proto_options, &graph_hash);

  v1::Plan plan;
  plan.set_name(job->name);
  plan.set_uid(id);
  *plan.mutable_create_time() = ToProto(o_.now());
  *plan.mutable_update_time() = plan.create_time();
  plan.set_format_version(lower::kPlanFormatVersion);
  for (const auto& d : job->devices) plan.add_devices(d);
  *plan.mutable_options() = job->proto_options;
  plan.set_graph_hash(graph_hash);
  plan.set_calibration(job->calibration);
  plan.set_job(for_job);
  bool over_count = false;
  // A cache hit: the plan to copy. The copy is made and written to the sink
  // outside the core's mutex, so that concurrent hits are written together
  // (the SQLite store commits them in one transaction) and reads are not
  // held up behind the write; the name stays taken meanwhile.
  std::shared_ptr<const v1::Plan> source;
  {
    absl::MutexLock l(&s_->mu);
    if (s_->plans.count(job->name) || s_->creating.count(job->name)) {
      return absl::AlreadyExistsError(absl::StrCat(job->name, " already exists"));
    }
    auto hit = s_->cache.find(job->cache_key);
    auto cached_plan = hit == s_->cache.end() ? s_->plans.end() : s_->plans.find(hit->second);
    if (cached_plan != s_->plans.end() && cached_plan->second->state() == v1::Plan::SUCCEEDED &&
        cached_plan->second.full) {
      source = cached_plan->second.full;
      s_->creating.insert(job->name);
    } else {
      if (s_->jobs.size() >= static_cast<size_t>(kMaxUnfinishedPlans)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            s_->jobs.size(), " plans are pending or running, the most the planner holds (",
            kMaxUnfinishedPlans, "): wait for some to finish or CancelPlan some"));
      }
      plan.set_state(v1::Plan::PENDING);
      // Kept so that a restarted planner can run it again.
      *plan.mutable_graph() = std::move(graph_proto);
      *plan.mutable_cluster() = job->cluster;
      // Saved before it exists here: a plan the store refused is no plan.
      if (o_.sink) {
        HAP_RETURN_IF_ERROR(
            Annotate(o_.sink->SavePlan(plan), absl::StrCat(plan.name(), " was not created")));
      }
      s_->Put(plan);
      s_->jobs[plan.name()] = job;
      EnqueueLocked(job);
      ++s_->version;
      s_->changed.SignalAll();
      over_count = OverCountLocked();
    }
  }
  std::optional<v1::Plan> cached;
  if (source != nullptr) {
    v1::Plan copy = *source;
    TakeIdentity(plan, &copy);
    *copy.mutable_update_time() = plan.create_time();
    const absl::Status saved = o_.sink ? o_.sink->SavePlan(copy) : absl::OkStatus();
    absl::MutexLock l(&s_->mu);
    s_->creating.erase(copy.name());
    HAP_RETURN_IF_ERROR(Annotate(saved, absl::StrCat(copy.name(), " was not created")));
    s_->Put(copy);
    // The newest copy answers the next hits: retention deletes the
    // oldest plans first.
    s_->Cache(copy.name(), job->cache_key);
    ++s_->version;
    if (o_.on_plan_done) o_.on_plan_done(copy);
    s_->changed.SignalAll();
    over_count = OverCountLocked();
    cached = std::move(copy);
  }
  // Each new plan may push an old one past the count. A pass that fails
  // leaves the plans for the next one (the daemon's periodic pass reports
  // the error); the new plan is made either way.
  if (over_count) EnforceRetention().IgnoreError();
  if (cached) return *std::move(cached);
  if (!r.wait()) return plan;
  std::optional<PlanEntry> done;
  {
    absl::MutexLock l(&s_->mu);
    auto it = s_->plans.find(job->name);
    // Short waits, so that a caller that went away (a cancelled RPC) is
    // noticed and does not hold its thread until the search ends.
    while (it != s_->plans.end() && !PlanFinal(it->second->state()) && !s_->stopping &&
           absl::Now() < deadline && !cancelled()) {
      s_->changed.WaitWithDeadline(&s_->mu,
                                   std::min(deadline, absl::Now() + absl::Milliseconds(200)));
      it = s_->plans.find(job->name);
    }
    if (!job->save_error.ok()) return job->save_error;
    if (it == s_->plans.end()) {
      return absl::NotFoundError(absl::StrCat(job->name, " was deleted while it was planned"));
    }
    done = it->second;
  }
  // Finished, it may push an old plan past the count: trimmed before the
  // caller hears, so what it lists next (or a restart finds) is trimmed.
  TrimPastRetentionCount();
  return BasicView(*done);
}

void PlannerCore::TrimPastRetentionCount() {
  bool over;
  {
    absl::MutexLock l(&s_->mu);
    over = OverCountLocked();
  }
  // A pass that fails leaves the plans for the next one (the daemon's
  // periodic pass reports the error).
  if (over) EnforceRetention().IgnoreError();
}

absl::Status PlannerCore::Resume(const v1::Plan& p) {
  auto job = std::make_shared<Job>();
  job->name = p.name();
  HAP_RETURN_IF_ERROR(ConvertOptions(p.options(), job.get(), o_));
  HAP_ASSIGN_OR_RETURN(job->graph, graph::FromProto(p.graph()));
  job->cluster = p.cluster();
  job->devices.assign(p.devices().begin(), p.devices().end());
  // Identical plans cut off together merge again.
  job->cache_key =
      CacheKey(graph::ToProto(job->graph), job->cluster, job->devices, job->proto_options, nullptr);
  absl::MutexLock l(&s_->mu);
  v1::Plan pending = *s_->plans.at(p.name());
  pending.set_state(v1::Plan::PENDING);
  s_->Put(std::move(pending));
  s_->jobs[p.name()] = job;
  EnqueueLocked(job);
  return absl::OkStatus();
}

bool PlannerCore::OverCountLocked() const {
  return o_.plan_retention_count > 0 &&
         s_->plans.size() > s_->jobs.size() + static_cast<size_t>(o_.plan_retention_count);
}

void PlannerCore::EnqueueLocked(const std::shared_ptr<Job>& job) {
  auto it = s_->in_flight.find(job->cache_key);
  if (it != s_->in_flight.end() && it->second != job &&
      it->second->options.max_seconds >= job->options.max_seconds) {
    job->leader = it->second;
    it->second->followers.push_back(job);
    return;
  }
  // No search for it yet, or only one with a smaller budget (a caller
  // waiting with a short deadline): this one searches, and the next
  // identical requests follow it.
  s_->in_flight[job->cache_key] = job;
  s_->queue.push_back(job);
}

void PlannerCore::ReleaseFollowersLocked(const std::shared_ptr<Job>& job, const v1::Plan* result) {
  auto in = s_->in_flight.find(job->cache_key);
  if (in != s_->in_flight.end() && in->second == job) s_->in_flight.erase(in);
  std::vector<std::shared_ptr<Job>> followers;
  followers.swap(job->followers);
  std::vector<std::shared_ptr<Job>> waiting;  // still to be planned
  for (auto& f : followers) {
    f->leader = nullptr;
    auto p = s_->plans.find(f->name);
    if (f->cancel || p == s_->plans.end() || PlanFinal(p->second->state())) continue;
    waiting.push_back(f);
  }
  if (waiting.empty()) return;
  const bool shared =
      result != nullptr && job->save_error.ok() &&
      (result->state() == v1::Plan::SUCCEEDED ||
       (result->state() == v1::Plan::FAILED && FailsForAnyone(result->error_code())));
  if (shared) {
    for (auto& f : waiting) {
      UpdatePlanLocked(f, [&](v1::Plan& p) {
        if (result->state() == v1::Plan::SUCCEEDED) {
          v1::Plan copy = *result;
          TakeIdentity(p, &copy);
          p = std::move(copy);
        } else {
          p.set_state(v1::Plan::FAILED);
          p.set_error(result->error());
          p.set_error_code(result->error_code());
        }
      });
    }
    return;
  }
  // Cancelled, deleted, out of time or not saved: the first follower
  // searches itself and the others follow it.
  std::shared_ptr<Job> next = waiting.front();
  next->followers.assign(waiting.begin() + 1, waiting.end());
  for (auto& f : next->followers) f->leader = next;
  s_->in_flight[next->cache_key] = next;
  s_->queue.push_back(next);
}

void PlannerCore::Worker() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock l(&s_->mu);
      while (s_->queue.empty() && !s_->stopping) s_->changed.Wait(&s_->mu);
      if (s_->stopping) return;
      job = s_->queue.front();
      s_->queue.pop_front();
    }
    RunJob(job);
    TrimPastRetentionCount();  // (a plan nobody waits for finished)
  }
}

// Applies `edit` to the job's plan, unless the plan is gone (deleted) or
// already final (cancelled). A change of state is saved before it is made;
// when the sink refuses it, the plan becomes FAILED instead (see CreatePlan
// in the header), the search is told to stop, and job->save_error keeps the
// sink's error for a CreatePlan that waits.
void PlannerCore::UpdatePlan(const std::shared_ptr<Job>& job,
                             const std::function<void(v1::Plan&)>& edit) {
  absl::MutexLock l(&s_->mu);
  UpdatePlanLocked(job, edit);
}

void PlannerCore::UpdatePlanLocked(const std::shared_ptr<Job>& job,
                                   const std::function<void(v1::Plan&)>& edit) {
  auto it = s_->plans.find(job->name);
  if (it == s_->plans.end() || PlanFinal(it->second->state())) return;
  v1::Plan next = *it->second;
  edit(next);
  *next.mutable_update_time() = ToProto(o_.now());
  if (o_.sink && next.state() != it->second->state()) {
    absl::Status saved = o_.sink->SavePlan(next);
    if (!saved.ok()) {
      job->cancel = true;
      job->save_error = absl::Status(
          saved.code(), absl::StrCat(job->name, " became ", v1::Plan::State_Name(next.state()),
                                     " but that could not be saved: ", saved.message()));
      next = *it->second;  // without the result that is not saved
      next.set_state(v1::Plan::FAILED);
      next.set_error(std::string(job->save_error.message()));
      next.set_error_code(static_cast<int>(saved.code()));
      *next.mutable_update_time() = ToProto(o_.now());
      absl::Status failed_saved = o_.sink->SavePlan(next);
      if (!failed_saved.ok()) {
        next.set_error(absl::StrCat(next.error(), "; nor could FAILED (the store keeps it "
                                    "unfinished and a restart runs it again): ",
                                    failed_saved.message()));
      }
    }
  }
  it->second = PlanEntry(std::move(next));
  // (Held here: finishing replaces other plans, never this one.)
  std::shared_ptr<const v1::Plan> now = it->second.full;
  if (PlanFinal(now->state())) FinishPlanLocked(job, *now);
  ++s_->version;
  s_->changed.SignalAll();
}

void PlannerCore::FinishPlanLocked(const std::shared_ptr<Job>& job, const v1::Plan& plan) {
  s_->jobs.erase(job->name);
  if (plan.state() == v1::Plan::SUCCEEDED) s_->Cache(job->name, job->cache_key);
  // Before waiters wake: whoever sees the final state sees it counted.
  if (o_.on_plan_done) o_.on_plan_done(plan);
  if (job->leader == nullptr) {
    ReleaseFollowersLocked(job, &plan);
  }
  // (A follower that ends on its own — cancelled — is skipped by its
  // leader when that one ends.)
}

void PlannerCore::RunJob(const std::shared_ptr<Job>& job) {
  // Cancelled (the plan is CANCELLED already), deleted, or the core is
  // stopping (the plan stays as it is stored, for the next start).
  if (job->cancel) return;
  UpdatePlan(job, [](v1::Plan& p) { p.set_state(v1::Plan::RUNNING); });
  if (job->cancel) return;  // RUNNING could not be saved: the plan FAILED
  synth::PlanOptions so = job->options;
  so.cancelled = [job, this] {
    return job->cancel.load() || o_.now() > job->deadline;
  };
  absl::Time last_progress = absl::InfinitePast();
  so.progress = [&](int64_t states, double best, int iteration) {
    absl::Time now = absl::Now();
    if (now - last_progress < absl::Milliseconds(100)) return;
    last_progress = now;
    UpdatePlan(job, [&](v1::Plan& p) {
      p.mutable_progress()->set_states_expanded(states);
      p.mutable_progress()->set_best_cost_seconds(std::isfinite(best) ? best : 0);
      p.mutable_progress()->set_joint_iteration(iteration);
    });
  };
  auto fail = [&](const absl::Status& s) {
    // Stopped by CancelPlan or DeletePlan (which recorded that), by a save
    // that failed (recorded too), or by the core stopping (the plan stays
    // RUNNING, as stored, and runs again at the next start).
    if (s.code() == absl::StatusCode::kCancelled && job->cancel) return;
    UpdatePlan(job, [&](v1::Plan& p) {
      p.set_state(v1::Plan::FAILED);
      p.set_error(std::string(s.message()));
      p.set_error_code(static_cast<int>(s.code()));
    });
  };
  auto cluster =
      cost::ClusterModel::FromProto(job->cluster, job->devices, ComputeDType(job->proto_options));
  if (!cluster.ok()) return fail(cluster.status());
  auto succeed = [&](v1::Plan b, const synth::PlanResult& r, double step) {
    UpdatePlan(job, [&](v1::Plan& p) {
      TakeIdentity(p, &b);
      b.set_calibration(p.calibration());
      *b.mutable_progress() = p.progress();
      b.mutable_progress()->set_states_expanded(r.states_expanded);
      b.mutable_progress()->set_best_cost_seconds(step);
      b.mutable_progress()->set_joint_iteration(r.joint_iterations);
      b.set_state(v1::Plan::SUCCEEDED);
      p = std::move(b);
    });
  };
  // PlanOptions.pipeline (off by default): stages planned by
  // planner/pipeline; a plan with stages carries every device's stage program.
  auto pipe = pipeline::FromProto(job->proto_options);
  if (!pipe.ok()) return fail(pipe.status());
  absl::StatusOr<synth::PlanResult> result;
  if (pipe->mode == pipeline::Mode::kOff) {
    result = synth::PlanModel(job->graph, *cluster, so);
  } else {
    pipe->stage_options = so;
    auto planned = pipeline::PlanPipeline(job->graph, *cluster, *pipe);
    if (!planned.ok()) return fail(planned.status());
    if (job->cancel) return;  // as in `fail`
    if (planned->pipelined()) {
      auto built = pipeline::BuildPipelinePlan(job->graph, job->cluster, *cluster, *planned,
                                               job->proto_options);
      if (!built.ok()) return fail(built.status());
      return succeed(*std::move(built), planned->spmd, planned->step_seconds);
    }
    result = std::move(planned->spmd);
    for (std::string& n : planned->notes) result->notes.push_back(std::move(n));
  }
  if (!result.ok()) return fail(result.status());
  if (job->cancel) return;  // as in `fail`
  auto built = lower::BuildPlan(job->graph, job->cluster, *cluster, *result, job->proto_options);
  if (!built.ok()) return fail(built.status());
  succeed(*std::move(built), *result, result->cost.total);
}

absl::StatusOr<v1::Plan> PlannerCore::CancelPlan(const std::string& name) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  absl::ReleasableMutexLock l(&s_->mu);
  auto it = s_->plans.find(name);
  if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
  auto j = s_->jobs.find(name);
  if (j != s_->jobs.end()) {  // not final yet (final: cancelling is a no-op)
    // CANCELLED is saved first, so that a restart does not run the plan
    // again; a running search stops at its next poll and its result, if
    // any, is dropped (UpdatePlan leaves final plans alone).
    v1::Plan cancelled = *it->second;
    cancelled.set_state(v1::Plan::CANCELLED);
    *cancelled.mutable_update_time() = ToProto(o_.now());
    if (o_.sink) {
      HAP_RETURN_IF_ERROR(
          Annotate(o_.sink->SavePlan(cancelled), absl::StrCat(name, " was not cancelled")));
    }
    std::shared_ptr<Job> job = j->second;
    job->cancel = true;
    auto q = std::find(s_->queue.begin(), s_->queue.end(), job);
    if (q != s_->queue.end()) s_->queue.erase(q);
    it->second = PlanEntry(std::move(cancelled));
    std::shared_ptr<const v1::Plan> now = it->second.full;
    FinishPlanLocked(job, *now);
    ++s_->version;
    s_->changed.SignalAll();
  }
  if (it->second.full) return BasicView(it->second);
  // A final plan held as its summary: the rest is read without the lock.
  PlanEntry entry = it->second;
  l.Release();
  HAP_ASSIGN_OR_RETURN(std::shared_ptr<const v1::Plan> whole, Whole(name, entry));
  v1::Plan out;
  FillBasicView(*entry.summary, *whole, &out);
  return out;
}

absl::Status PlannerCore::DeletePlan(const std::string& name) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  while (true) {
    std::set<std::string> in_use;
    uint64_t unpins_seen = 0;
    HAP_RETURN_IF_ERROR(
        Annotate(PlansInUse(&in_use, &unpins_seen), absl::StrCat(name, " was not deleted")));
    absl::MutexLock l(&s_->mu);
    // A deploy that unpinned since made its deployment: read them again.
    if (s_->unpins != unpins_seen) continue;
    auto it = s_->plans.find(name);
    if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    // A deployment names its plan, as from retention: kept while a deploy
    // holds it or a deployment uses it.
    if (s_->pins.count(name)) {
      return absl::FailedPreconditionError(
          absl::StrCat(name,
                       " is being deployed (a deploy holds it): try again once the deploy "
                       "has ended, deleting the deployment first if it made one"));
    }
    if (in_use.count(name)) {
      return absl::FailedPreconditionError(absl::StrCat(
          name,
          " is the plan of a deployment: delete the deployment first (stop it if it is "
          "not finished)"));
    }
    // Removed from the store first: a plan the store keeps stays here too.
    if (o_.sink) {
      absl::Status st = o_.sink->DeletePlan(name);
      if (!st.ok() && !absl::IsNotFound(st)) {
        return Annotate(st, absl::StrCat(name, " was not deleted"));
      }
    }
    ErasePlanLocked(name);
    return absl::OkStatus();
  }
}

absl::Status PlannerCore::PlansInUse(std::set<std::string>* in_use, uint64_t* unpins_seen) {
  {
    absl::MutexLock l(&s_->mu);
    *unpins_seen = s_->unpins;
  }
  in_use->clear();
  if (!o_.plans_in_use) return absl::OkStatus();
  absl::StatusOr<std::set<std::string>> used = o_.plans_in_use();
  if (!used.ok()) {
    return Annotate(used.status(), "the plans in use by deployments are unknown");
  }
  *in_use = *std::move(used);
  return absl::OkStatus();
}

void PlannerCore::ErasePlanLocked(const std::string& name) {
  auto j = s_->jobs.find(name);
  if (j != s_->jobs.end()) {
    std::shared_ptr<Job> job = j->second;
    job->cancel = true;
    auto q = std::find(s_->queue.begin(), s_->queue.end(), job);
    if (q != s_->queue.end()) s_->queue.erase(q);
    s_->jobs.erase(j);
    // A leader's followers search themselves (a follower is skipped by its
    // leader, being cancelled).
    if (job->leader == nullptr) ReleaseFollowersLocked(job, nullptr);
  }
  s_->Uncache(name);
  s_->plans.erase(name);
  ++s_->version;
  s_->changed.SignalAll();
}

absl::StatusOr<int> PlannerCore::EnforceRetention() {
  const bool by_count = o_.plan_retention_count > 0;
  const bool by_age = o_.plan_retention_age != absl::InfiniteDuration();
  if (!by_count && !by_age) return 0;
  // The plans deployments use, read with the count of unpins up to then:
  // a deploy unpins its plan once its deployment exists, so after an unpin
  // the set is read again (a deployment made since holds its plan).
  std::set<std::string> in_use;
  uint64_t unpins_seen = 0;
  auto read_in_use = [&]() -> absl::Status {
    return Annotate(PlansInUse(&in_use, &unpins_seen), "plan retention skipped");
  };
  HAP_RETURN_IF_ERROR(read_in_use());
  // The victims, chosen under the lock; deleted one at a time so that
  // other calls get the lock in between.
  std::vector<std::string> victims;
  {
    absl::MutexLock l(&s_->mu);
    std::vector<std::pair<absl::Time, std::string>> finished;
    for (const auto& [name, p] : s_->plans) {
      if (PlanFinal(p->state())) finished.push_back({FromProto(p->update_time()), name});
    }
    const absl::Time oldest = OldestKept(o_.now(), o_.plan_retention_age);
    for (std::string& name : PastRetention(std::move(finished), o_.plan_retention_count, oldest)) {
      if (!in_use.count(name) && !s_->pins.count(name)) victims.push_back(std::move(name));
    }
  }
  int deleted = 0;
  for (const std::string& name : victims) {
    bool unpinned;
    {
      absl::MutexLock l(&s_->mu);
      unpinned = s_->unpins != unpins_seen;
    }
    if (unpinned) HAP_RETURN_IF_ERROR(read_in_use());
    absl::MutexLock l(&s_->mu);
    auto it = s_->plans.find(name);
    if (it == s_->plans.end() || !PlanFinal(it->second->state())) continue;  // gone meanwhile
    if (s_->pins.count(name)) continue;  // a deploy took it meanwhile
    // A deploy that took it and made its deployment since in_use was read.
    if (s_->unpins != unpins_seen || in_use.count(name)) continue;
    if (o_.sink) {
      absl::Status st = o_.sink->DeletePlan(name);
      if (!st.ok() && !absl::IsNotFound(st)) {
        return Annotate(st, absl::StrCat("plan retention: ", name, " was not deleted (", deleted,
                                         " deleted before it)"));
      }
    }
    ErasePlanLocked(name);
    ++deleted;
  }
  return deleted;
}

absl::StatusOr<v1::Plan> PlannerCore::PinPlan(const std::string& name) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  std::optional<PlanEntry> entry;
  {
    absl::MutexLock l(&s_->mu);
    auto it = s_->plans.find(name);
    if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    s_->pins[name] += 1;
    entry = it->second;
  }
  absl::StatusOr<std::shared_ptr<const v1::Plan>> whole = Whole(name, *entry);
  if (!whole.ok()) {
    UnpinPlan(name);
    return whole.status();
  }
  return **whole;
}

void PlannerCore::UnpinPlan(const std::string& name) {
  absl::MutexLock l(&s_->mu);
  auto it = s_->pins.find(name);
  if (it != s_->pins.end() && --it->second <= 0) s_->pins.erase(it);
  ++s_->unpins;
}

absl::Status PlannerCore::WatchPlan(const std::string& name,
                                    const std::function<bool(const v1::Plan&)>& on_update,
                                    const std::function<bool()>& stop) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  int64_t seen = -1;
  std::shared_ptr<const v1::Plan> last;  // held: a new snapshot is a change
  while (true) {
    std::shared_ptr<const v1::Plan> p;
    {
      absl::MutexLock l(&s_->mu);
      while (s_->version == seen && !s_->stopping && !stop()) {
        s_->changed.WaitWithTimeout(&s_->mu, absl::Milliseconds(100));
      }
      if (s_->stopping || stop()) return absl::OkStatus();
      seen = s_->version;
      auto it = s_->plans.find(name);
      if (it == s_->plans.end()) {
        return absl::NotFoundError(absl::StrCat(name, " does not exist"));
      }
      p = it->second.summary;
    }
    if (p == last) continue;  // another plan changed
    last = p;
    if (!on_update(*p) || PlanFinal(p->state())) return absl::OkStatus();
  }
}

bool PlanFinal(v1::Plan::State s) {
  return s == v1::Plan::SUCCEEDED || s == v1::Plan::FAILED || s == v1::Plan::CANCELLED;
}

}  // namespace hap::service
