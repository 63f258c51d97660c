#include "planner/service/core/planner_core.h"

#include <atomic>
#include <cmath>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/util/time_util.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_builder.h"
#include "planner/synth/planner.h"
#include "planner/service/core/pagination.h"
#include "planner/util/status_macros.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using google::protobuf::util::TimeUtil;


google::protobuf::Timestamp ToProto(absl::Time t) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(t));
}
absl::Time FromProto(const google::protobuf::Timestamp& t) {
  return absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(t));
}

bool Final(v1::Plan::State s) {
  return s == v1::Plan::SUCCEEDED || s == v1::Plan::FAILED || s == v1::Plan::CANCELLED;
}

bool ValidId(const std::string& id) {
  if (id.empty() || id.size() > 63) return false;
  for (char c : id) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
      return false;
    }
  }
  return true;
}

bool ValidNodeName(const std::string& n) {
  if (n.empty() || n.size() > 253) return false;
  for (char c : n) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_')) {
      return false;
    }
  }
  return true;
}


std::string RandomId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (counter++ << 48);
  return absl::StrCat("p-", absl::Hex(x, absl::kZeroPad16));
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
  absl::Time deadline = absl::InfiniteFuture();
};

absl::Status ConvertOptions(const v1::PlanOptions& po, PlannerCore::Job* job,
                            const PlannerCoreOptions& o_) {
  if (po.budget().max_states() < 0 || po.budget().max_seconds() < 0 ||
      !std::isfinite(po.budget().max_seconds())) {
    return absl::InvalidArgumentError(
        "options.budget: max_states and max_seconds must not be negative");
  }
  if (po.segments() > 1) {
    return absl::InvalidArgumentError(
        "options.segments > 1 (per-layer-group ratios) is not supported yet");
  }
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

struct PlannerCore::State {
  absl::Mutex mu;
  absl::CondVar changed;
  int64_t version = 0;  // bumps on every plan change
  std::map<std::string, v1::Node> nodes;
  std::map<std::string, v1::Plan> plans;
  std::map<std::string, std::shared_ptr<Job>> jobs;  // not yet final
  std::deque<std::shared_ptr<Job>> queue;
  std::map<std::string, std::string> cache;  // key -> plan name
  std::map<std::pair<std::string, std::string>, v1::Link> links;  // (src, dst)
  bool stopping = false;
  std::vector<std::thread> workers;
};

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
  std::unique_ptr<PlannerCore> core(new PlannerCore(std::move(options)));
  std::vector<v1::Plan> resume;
  {
    absl::MutexLock l(&core->s_->mu);
    for (auto& n : nodes) core->s_->nodes[n.name()] = std::move(n);
    for (auto& p : plans) {
      if (!Final(p.state())) resume.push_back(p);
      core->s_->plans[p.name()] = std::move(p);
    }
  }
  // Plans cut off by a restart run again: the plan keeps what they need
  // (graph, cluster profile, devices, options).
  for (const v1::Plan& p : resume) {
    absl::Status st = core->Resume(p);
    if (!st.ok()) {
      absl::MutexLock l(&core->s_->mu);
      v1::Plan& failed = core->s_->plans[p.name()];
      failed.set_state(v1::Plan::FAILED);
      failed.set_error(absl::StrCat("could not resume after a restart: ", st.message()));
      failed.set_error_code(static_cast<int>(st.code()));
      if (core->o_.sink) (void)core->o_.sink->SavePlan(failed);
    }
  }
  for (int i = 0; i < core->o_.workers; ++i) {
    core->s_->workers.emplace_back([c = core.get()] { c->Worker(); });
  }
  return core;
}

// ---------------------------------------------------------------- nodes --

void PlannerCore::RefreshLiveness() {
  absl::MutexLock l(&s_->mu);
  RefreshLivenessLocked();
}

void PlannerCore::RefreshLivenessLocked() {
  absl::Time now = o_.now();
  absl::Duration limit = o_.heartbeat_interval * o_.missed_heartbeats;
  for (auto& [name, n] : s_->nodes) {
    bool stale = now - FromProto(n.last_heartbeat()) > limit;
    auto want = stale ? v1::Node::STALE : v1::Node::READY;
    if (n.state() != want) {
      n.set_state(want);
      if (o_.sink) (void)o_.sink->SaveNode(n);
    }
  }
}

absl::StatusOr<v1::RegisterNodeResponse> PlannerCore::RegisterNode(const v1::Node& in) {
  if (!ValidNodeName(in.name())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node name '", in.name(), "' must be 1-253 letters, digits, '-', '.' or '_'"));
  }
  if (in.devices().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("node '", in.name(), "' reports no devices"));
  }
  v1::Node node = in;
  std::set<std::string> ids;
  for (v1::Device& d : *node.mutable_devices()) {
    if (d.id().empty() || !ids.insert(d.id()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node '", in.name(), "': device ids must be non-empty and unique, got '", d.id(),
          "'"));
    }
    double f32 = 0;
    for (const auto& t : d.flops()) {
      if (t.dtype() == v1::FLOAT32) f32 = t.flops();
    }
    if (!(f32 > 0) || !std::isfinite(f32)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", d.id(), "' has no positive float32 FLOP/s measurement"));
    }
    if (d.memory_bytes() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device '", d.id(), "' reports no memory"));
    }
    d.set_node(node.name());
  }
  absl::MutexLock l(&s_->mu);
  for (const auto& [name, other] : s_->nodes) {
    if (name == node.name()) continue;
    for (const auto& d : other.devices()) {
      if (ids.count(d.id())) {
        return absl::AlreadyExistsError(absl::StrCat(
            "device '", d.id(), "' is already registered by node '", name, "'"));
      }
    }
  }
  *node.mutable_last_heartbeat() = ToProto(o_.now());
  node.set_state(v1::Node::READY);
  s_->nodes[node.name()] = node;
  if (o_.sink) HAP_RETURN_IF_ERROR(o_.sink->SaveNode(node));
  v1::RegisterNodeResponse r;
  *r.mutable_node() = node;
  r.mutable_heartbeat_interval()->set_seconds(
      absl::ToInt64Seconds(o_.heartbeat_interval));
  r.mutable_heartbeat_interval()->set_nanos(static_cast<int32_t>(
      absl::ToInt64Nanoseconds(o_.heartbeat_interval) % 1'000'000'000));
  return r;
}

absl::StatusOr<v1::HeartbeatResponse> PlannerCore::Heartbeat(const v1::HeartbeatRequest& r) {
  std::string name = r.name().rfind("nodes/", 0) == 0 ? r.name().substr(6) : r.name();
  v1::HeartbeatResponse out;
  absl::MutexLock l(&s_->mu);
  auto it = s_->nodes.find(name);
  if (it == s_->nodes.end()) {
    out.set_unknown_node(true);  // register again
    return out;
  }
  v1::Node& n = it->second;
  // A node back from STALE may have changed: ask it to measure again.
  RefreshLivenessLocked();
  out.set_reprobe(n.state() == v1::Node::STALE);
  if (!r.devices().empty()) {
    n.mutable_devices()->CopyFrom(r.devices());
    for (auto& d : *n.mutable_devices()) d.set_node(name);
  }
  *n.mutable_last_heartbeat() = ToProto(o_.now());
  n.set_state(v1::Node::READY);
  if (o_.sink) HAP_RETURN_IF_ERROR(o_.sink->SaveNode(n));
  return out;
}

v1::Cluster PlannerCore::ClusterLocked(bool include_stale) const {
  v1::Cluster c;
  *c.mutable_defaults() = o_.link_defaults;
  std::set<std::string> devices;
  for (const auto& [name, n] : s_->nodes) {
    if (!include_stale && n.state() == v1::Node::STALE) continue;
    *c.add_nodes() = n;
    for (const auto& d : n.devices()) devices.insert(d.id());
  }
  for (const auto& [pair, link] : s_->links) {
    if (devices.count(pair.first) && devices.count(pair.second)) *c.add_links() = link;
  }
  return c;
}

v1::Cluster PlannerCore::GetCluster(bool include_stale) {
  absl::MutexLock l(&s_->mu);
  RefreshLivenessLocked();
  return ClusterLocked(include_stale);
}

absl::StatusOr<v1::ListNodesResponse> PlannerCore::ListNodes(int page_size,
                                                             const std::string& token) {
  absl::MutexLock l(&s_->mu);
  RefreshLivenessLocked();
  v1::ListNodesResponse r;
  HAP_ASSIGN_OR_RETURN(std::string next,
                       Paginate(s_->nodes, page_size, token,
                                [&](const v1::Node& n) { *r.add_nodes() = n; }));
  r.set_next_page_token(next);
  return r;
}

absl::Status PlannerCore::ReportLinks(const std::string& node,
                                      const std::vector<v1::Link>& links) {
  std::string name = node.rfind("nodes/", 0) == 0 ? node.substr(6) : node;
  absl::MutexLock l(&s_->mu);
  auto it = s_->nodes.find(name);
  if (it == s_->nodes.end()) {
    return absl::NotFoundError(absl::StrCat("node '", name, "' is not registered"));
  }
  std::set<std::string> known;
  for (const auto& [n, node_msg] : s_->nodes) {
    for (const auto& d : node_msg.devices()) known.insert(d.id());
  }
  for (const v1::Link& l : links) {
    if (!known.count(l.src()) || !known.count(l.dst())) {
      return absl::NotFoundError(absl::StrCat("link ", l.src(), " -> ", l.dst(),
                                              " names a device no node has registered"));
    }
    if (!(l.bandwidth_bytes_per_second() > 0) || l.latency_seconds() < 0 ||
        !std::isfinite(l.bandwidth_bytes_per_second())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "link ", l.src(), " -> ", l.dst(), " needs a positive bandwidth and a "
          "non-negative latency"));
    }
  }
  for (const v1::Link& l : links) s_->links[{l.src(), l.dst()}] = l;
  return absl::OkStatus();
}

absl::StatusOr<v1::GetProbeAssignmentsResponse> PlannerCore::GetProbeAssignments(
    const std::string& node, int64_t bytes) {
  std::string name = node.rfind("nodes/", 0) == 0 ? node.substr(6) : node;
  absl::MutexLock l(&s_->mu);
  RefreshLivenessLocked();
  if (!s_->nodes.count(name)) {
    return absl::NotFoundError(absl::StrCat("node '", name, "' is not registered"));
  }
  v1::GetProbeAssignmentsResponse r;
  for (const auto& [peer, n] : s_->nodes) {
    if (peer == name || n.state() != v1::Node::READY || n.address().empty()) continue;
    v1::ProbeAssignment* a = r.add_assignments();
    a->set_peer_node(peer);
    a->set_peer_address(n.address());
    a->set_bytes(bytes);
  }
  return r;
}

// ---------------------------------------------------------------- plans --

absl::StatusOr<v1::Plan> PlannerCore::CreatePlan(const v1::CreatePlanRequest& r,
                                                 absl::Time deadline) {
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
  if (job->devices.empty()) {
    for (const auto& n : job->cluster.nodes()) {
      for (const auto& d : n.devices()) job->devices.push_back(d.id());
    }
  }
  auto cluster_model = cost::ClusterModel::FromProto(job->cluster, job->devices);
  if (!cluster_model.ok()) {
    return absl::Status(cluster_model.status().code() == absl::StatusCode::kInvalidArgument
                            ? absl::StatusCode::kFailedPrecondition
                            : cluster_model.status().code(),
                        absl::StrCat("cluster: ", cluster_model.status().message()));
  }
  const int n = cluster_model->size();

  // The model.
  if (r.model().has_zoo()) {
    std::map<std::string, double> params(r.model().zoo().params().begin(),
                                         r.model().zoo().params().end());
    const std::string& zoo = r.model().zoo().name();
    if (r.global_batch() > 0) params["batch"] = static_cast<double>(r.global_batch());
    if (!params.count("batch")) params["batch"] = 32.0 * n;
    if ((zoo == "moe" || zoo == "switch") && !params.count("experts")) {
      params["experts"] = 2.0 * n;
    }
    auto g = graph::BuildZooModel(zoo, params);
    if (!g.ok()) return Annotate(g.status(), "model.zoo");
    job->graph = *std::move(g);
  } else if (r.model().has_graph()) {
    auto g = graph::FromProto(r.model().graph());
    if (!g.ok()) return Annotate(g.status(), "model.graph");
    job->graph = *std::move(g);
    if (r.global_batch() > 0 && !job->graph.Inputs().empty() &&
        job->graph.tensor(job->graph.Inputs().front()).type.shape[0] != r.global_batch()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "global_batch ", r.global_batch(), " differs from the graph's batch ",
          job->graph.tensor(job->graph.Inputs().front()).type.shape[0],
          " (graphs have concrete shapes; export the graph at that batch)"));
    }
  } else {
    return absl::InvalidArgumentError("model is required: a graph or a zoo model");
  }

  // The cache: same graph, same devices and profiles, same options.
  v1::Plan key_parts;
  key_parts.set_graph_hash(lower::Sha256Hex(graph::ToProto(job->graph)));
  key_parts.set_cluster_hash(lower::Sha256Hex(job->cluster));
  *key_parts.mutable_options() = job->proto_options;
  for (const auto& d : job->devices) key_parts.add_devices(d);
  job->cache_key = lower::Sha256Hex(key_parts);

  v1::Plan plan;
  plan.set_name(job->name);
  plan.set_uid(id);
  *plan.mutable_create_time() = ToProto(o_.now());
  *plan.mutable_update_time() = plan.create_time();
  plan.set_format_version(lower::kPlanFormatVersion);
  for (const auto& d : job->devices) plan.add_devices(d);
  *plan.mutable_options() = job->proto_options;
  plan.set_graph_hash(key_parts.graph_hash());
  {
    absl::MutexLock l(&s_->mu);
    if (s_->plans.count(job->name)) {
      return absl::AlreadyExistsError(absl::StrCat(job->name, " already exists"));
    }
    auto hit = s_->cache.find(job->cache_key);
    if (hit != s_->cache.end() && s_->plans.count(hit->second) &&
        s_->plans[hit->second].state() == v1::Plan::SUCCEEDED) {
      v1::Plan copy = s_->plans[hit->second];
      copy.set_name(plan.name());
      copy.set_uid(plan.uid());
      *copy.mutable_create_time() = plan.create_time();
      *copy.mutable_update_time() = plan.create_time();
      s_->plans[copy.name()] = copy;
      if (o_.sink) HAP_RETURN_IF_ERROR(o_.sink->SavePlan(copy));
      ++s_->version;
      if (o_.on_plan_done) o_.on_plan_done(copy);
      s_->changed.SignalAll();
      return copy;
    }
    plan.set_state(v1::Plan::PENDING);
    // Kept so that a restarted planner can run it again.
    *plan.mutable_graph() = graph::ToProto(job->graph);
    *plan.mutable_cluster() = job->cluster;
    s_->plans[plan.name()] = plan;
    if (o_.sink) HAP_RETURN_IF_ERROR(o_.sink->SavePlan(plan));
    s_->jobs[plan.name()] = job;
    s_->queue.push_back(job);
    ++s_->version;
    s_->changed.SignalAll();
  }
  if (!r.wait()) return plan;
  absl::MutexLock l(&s_->mu);
  while (!Final(s_->plans[job->name].state()) && !s_->stopping) {
    if (s_->changed.WaitWithDeadline(&s_->mu, deadline)) break;
  }
  v1::Plan out = s_->plans[job->name];
  out.clear_rank_programs();
  return out;
}

absl::Status PlannerCore::Resume(const v1::Plan& p) {
  auto job = std::make_shared<Job>();
  job->name = p.name();
  HAP_RETURN_IF_ERROR(ConvertOptions(p.options(), job.get(), o_));
  HAP_ASSIGN_OR_RETURN(job->graph, graph::FromProto(p.graph()));
  job->cluster = p.cluster();
  job->devices.assign(p.devices().begin(), p.devices().end());
  job->cache_key = "resumed:" + p.name();
  absl::MutexLock l(&s_->mu);
  s_->plans[p.name()].set_state(v1::Plan::PENDING);
  s_->jobs[p.name()] = job;
  s_->queue.push_back(job);
  return absl::OkStatus();
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
  }
}

void PlannerCore::UpdatePlan(const std::shared_ptr<Job>& job,
                             const std::function<void(v1::Plan&)>& edit) {
  {
    absl::MutexLock l(&s_->mu);
    auto it = s_->plans.find(job->name);
    if (it == s_->plans.end()) return;  // deleted
    edit(it->second);
    *it->second.mutable_update_time() = ToProto(o_.now());
    if (Final(it->second.state())) {
      s_->jobs.erase(job->name);
      if (it->second.state() == v1::Plan::SUCCEEDED) s_->cache[job->cache_key] = job->name;
      if (o_.sink) (void)o_.sink->SavePlan(it->second);
      // Before waiters wake: whoever sees the final state sees it counted.
      if (o_.on_plan_done) o_.on_plan_done(it->second);
    } else if (o_.sink && it->second.state() == v1::Plan::RUNNING &&
               !it->second.progress().states_expanded()) {
      (void)o_.sink->SavePlan(it->second);
    }
    ++s_->version;
    s_->changed.SignalAll();
  }
}

void PlannerCore::RunJob(const std::shared_ptr<Job>& job) {
  if (job->cancel) {
    UpdatePlan(job, [](v1::Plan& p) { p.set_state(v1::Plan::CANCELLED); });
    return;
  }
  UpdatePlan(job, [](v1::Plan& p) { p.set_state(v1::Plan::RUNNING); });
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
    UpdatePlan(job, [&](v1::Plan& p) {
      bool cancelled = s.code() == absl::StatusCode::kCancelled && job->cancel;
      p.set_state(cancelled ? v1::Plan::CANCELLED : v1::Plan::FAILED);
      p.set_error(std::string(s.message()));
      p.set_error_code(static_cast<int>(s.code()));
    });
  };
  auto cluster = cost::ClusterModel::FromProto(job->cluster, job->devices);
  if (!cluster.ok()) return fail(cluster.status());
  auto result = synth::PlanModel(job->graph, *cluster, so);
  if (!result.ok()) return fail(result.status());
  if (job->cancel) return fail(absl::CancelledError("cancelled"));
  auto built = lower::BuildPlan(job->graph, job->cluster, *cluster, *result, job->proto_options);
  if (!built.ok()) return fail(built.status());
  UpdatePlan(job, [&](v1::Plan& p) {
    v1::Plan b = *std::move(built);
    b.set_name(p.name());
    b.set_uid(p.uid());
    *b.mutable_create_time() = p.create_time();
    *b.mutable_progress() = p.progress();
    b.mutable_progress()->set_states_expanded(result->states_expanded);
    b.mutable_progress()->set_best_cost_seconds(result->cost.total);
    b.mutable_progress()->set_joint_iteration(result->joint_iterations);
    b.set_state(v1::Plan::SUCCEEDED);
    p = std::move(b);
  });
}

absl::StatusOr<v1::Plan> PlannerCore::GetPlan(const std::string& name, bool full) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  absl::MutexLock l(&s_->mu);
  auto it = s_->plans.find(name);
  if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
  v1::Plan p = it->second;
  if (!full) p.clear_rank_programs();
  return p;
}

absl::StatusOr<v1::ListPlansResponse> PlannerCore::ListPlans(int page_size,
                                                             const std::string& token) {
  absl::MutexLock l(&s_->mu);
  v1::ListPlansResponse r;
  HAP_ASSIGN_OR_RETURN(std::string next,
                       Paginate(s_->plans, page_size, token, [&](const v1::Plan& p) {
                         v1::Plan* out = r.add_plans();
                         *out = p;
                         out->clear_rank_programs();
                         out->clear_graph();
                         out->clear_program();
                       }));
  r.set_next_page_token(next);
  return r;
}

absl::StatusOr<v1::Plan> PlannerCore::CancelPlan(const std::string& name) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  std::shared_ptr<Job> job;
  {
    absl::MutexLock l(&s_->mu);
    auto it = s_->plans.find(name);
    if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    auto j = s_->jobs.find(name);
    if (j == s_->jobs.end()) {  // already final: cancelling is a no-op
      v1::Plan p = it->second;
      p.clear_rank_programs();
      return p;
    }
    job = j->second;
    job->cancel = true;
    auto q = std::find(s_->queue.begin(), s_->queue.end(), job);
    if (q == s_->queue.end()) {  // running: the search stops at its next poll
      v1::Plan p = it->second;
      p.clear_rank_programs();
      return p;
    }
    s_->queue.erase(q);
  }
  UpdatePlan(job, [](v1::Plan& p) { p.set_state(v1::Plan::CANCELLED); });
  return GetPlan(name, false);
}

absl::Status PlannerCore::DeletePlan(const std::string& name) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  absl::MutexLock l(&s_->mu);
  auto it = s_->plans.find(name);
  if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
  auto j = s_->jobs.find(name);
  if (j != s_->jobs.end()) {
    j->second->cancel = true;
    auto q = std::find(s_->queue.begin(), s_->queue.end(), j->second);
    if (q != s_->queue.end()) s_->queue.erase(q);
    s_->jobs.erase(j);
  }
  for (auto c = s_->cache.begin(); c != s_->cache.end();) {
    c = c->second == name ? s_->cache.erase(c) : std::next(c);
  }
  s_->plans.erase(it);
  if (o_.sink) HAP_RETURN_IF_ERROR(o_.sink->DeletePlan(name));
  ++s_->version;
  s_->changed.SignalAll();
  return absl::OkStatus();
}

absl::Status PlannerCore::WatchPlan(const std::string& name,
                                    const std::function<bool(const v1::Plan&)>& on_update,
                                    const std::function<bool()>& stop) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  int64_t seen = -1;
  std::string last;
  while (true) {
    v1::Plan p;
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
      p = it->second;
    }
    p.clear_rank_programs();
    p.clear_graph();
    p.clear_program();
    std::string bytes = p.SerializeAsString();
    if (bytes == last) continue;  // another plan changed
    last = std::move(bytes);
    if (!on_update(p) || Final(p.state())) return absl::OkStatus();
  }
}

}  // namespace hap::service
