// The planner core's node registry (PlannerCore, planner_core.h): nodes
// registered and heartbeating, their liveness, measured links, probe
// assignments and per-device calibration. Plans are in planner_core.cc.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "planner/service/core/node_calibration.h"
#include "planner/service/core/pagination.h"
#include "planner/service/core/planner_core.h"
#include "planner/service/core/planner_core_internal.h"
#include "planner/service/core/profile_checks.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

}  // namespace

// ---------------------------------------------------------------- nodes --

void PlannerCore::RefreshLiveness() {
  absl::MutexLock l(&s_->mu);
  RefreshLivenessLocked();
}

void PlannerCore::RefreshLivenessLocked() {
  absl::Time now = o_.now();
  // The clock stepped back: what lies in the future counts from now.
  if (s_->started > now) s_->started = now;
  absl::Duration limit = o_.heartbeat_interval * o_.missed_heartbeats;
  std::vector<std::string> expired;
  for (auto& [name, n] : s_->nodes) {
    if (FromProto(n.last_heartbeat()) > now) *n.mutable_last_heartbeat() = ToProto(now);
    absl::Duration silent = now - std::max(FromProto(n.last_heartbeat()), s_->started);
    // Derived from last_heartbeat, which every heartbeat saves; a restart
    // derives it again, so reads do not write it. Time the planner was
    // down does not count: a node whose heartbeats went nowhere while it
    // restarted is READY until it misses them against this planner.
    n.set_state(silent > limit ? v1::Node::STALE : v1::Node::READY);
    if (silent > limit + o_.node_expiry) expired.push_back(name);
  }
  for (const std::string& name : expired) {
    // A removal the store refuses leaves the node (STALE), as the store
    // still holds it; the next refresh tries again.
    RemoveNodeLocked(name).IgnoreError();
  }
}

absl::Status PlannerCore::RemoveNodeLocked(const std::string& name) {
  if (o_.sink) {
    absl::Status st = o_.sink->DeleteNode(name);
    if (!st.ok() && !absl::IsNotFound(st)) {
      return Annotate(st, absl::StrCat("node '", name, "' was not deleted"));
    }
  }
  auto it = s_->nodes.find(name);
  if (it == s_->nodes.end()) return absl::OkStatus();
  std::set<std::string> devices;
  for (const auto& d : it->second.devices()) devices.insert(d.id());
  for (auto l = s_->links.begin(); l != s_->links.end();) {
    bool gone = devices.count(l->first.first) || devices.count(l->first.second);
    l = gone ? s_->links.erase(l) : std::next(l);
  }
  s_->nodes.erase(it);
  return absl::OkStatus();
}

void PlannerCore::DropLinksOfGoneDevicesLocked(const v1::Node& before, const v1::Node& now) {
  std::set<std::string> gone;
  for (const auto& d : before.devices()) gone.insert(d.id());
  for (const auto& d : now.devices()) gone.erase(d.id());
  if (gone.empty()) return;
  for (auto l = s_->links.begin(); l != s_->links.end();) {
    const bool drop = gone.count(l->first.first) || gone.count(l->first.second);
    l = drop ? s_->links.erase(l) : std::next(l);
  }
}

absl::Status PlannerCore::DeleteNode(const std::string& name) {
  std::string id = NodeId(name);
  if (!ValidNodeName(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("node name '", name,
                     "' must look like nodes/{node} or {node}, with 1-253 letters, "
                     "digits, '-', '.' or '_'"));
  }
  absl::MutexLock l(&s_->mu);
  if (!s_->nodes.count(id)) {
    return absl::NotFoundError(absl::StrCat("node '", id, "' is not registered"));
  }
  return RemoveNodeLocked(id);
}

namespace {

// A node measured anew (re-registered, re-probed): its devices keep the
// calibration the planner fitted where their FLOP/s is about the same
// (agents never send one; one they send is dropped).
void KeepCalibration(const v1::Node& before, v1::Node* now) {
  std::map<std::string, const v1::Device*> old;
  for (const auto& d : before.devices()) old[d.id()] = &d;
  for (auto& d : *now->mutable_devices()) {
    d.clear_calibration();
    auto it = old.find(d.id());
    if (it != old.end() && CalibrationHolds(*it->second, d)) {
      *d.mutable_calibration() = it->second->calibration();
    }
  }
}

}  // namespace

absl::StatusOr<std::string> PlannerCore::CalibrateDevices(
    const std::string& plan, const std::string& deployment,
    const std::vector<v1::StepProfile>& profiles) {
  HAP_ASSIGN_OR_RETURN(std::shared_ptr<const v1::Plan> p, GetPlanSnapshot(plan));
  if (p->state() != v1::Plan::SUCCEEDED) {
    return absl::FailedPreconditionError(
        absl::StrCat(plan, " is ", v1::Plan::State_Name(p->state()), ", not SUCCEEDED"));
  }
  absl::MutexLock l(&s_->mu);
  const v1::Cluster raw = ClusterLocked(/*include_stale=*/true);
  HAP_ASSIGN_OR_RETURN(auto fitted, FitDeviceCalibration(raw, *p, profiles, deployment, o_.now()));
  // Checked as a restart checks the stored ones: a fit past the bounds
  // would plan until the next start and then be dropped.
  for (const auto& [id, c] : fitted) {
    HAP_RETURN_IF_ERROR(
        Annotate(CheckCalibration(c), absl::StrCat("the calibration fitted for device '", id,
                                                   "' is out of range (not applied)")));
  }
  std::map<std::string, v1::Node> changed;
  for (const auto& [name, n] : s_->nodes) {
    for (int i = 0; i < n.devices_size(); ++i) {
      auto it = fitted.find(n.devices(i).id());
      if (it == fitted.end()) continue;
      if (!changed.count(name)) changed[name] = n;
      *changed[name].mutable_devices(i)->mutable_calibration() = it->second;
    }
  }
  // Each node is served as saved: a save the store refuses part way fails
  // the call, and the nodes saved before it keep their calibration here as
  // they do in the store (a restart neither adds nor loses one).
  for (auto& [name, n] : changed) {
    if (o_.sink) {
      HAP_RETURN_IF_ERROR(Annotate(o_.sink->SaveNode(n), absl::StrCat("the calibration of node '",
                                                                      name, "' was not saved")));
    }
    s_->nodes[name] = std::move(n);
  }
  std::vector<std::string> parts;
  for (const auto& [id, c] : fitted) {
    double scaled = 0;
    for (const auto& [type, x] : c.op_time_scale()) scaled = std::max(scaled, x);
    parts.push_back(absl::StrFormat("%s (op scales up to %.2f, %.2f ms per step overhead)", id,
                                    scaled, 1e3 * c.step_overhead_seconds()));
  }
  const v1::DeviceCalibration& any = fitted.begin()->second;
  return absl::StrFormat(
      "calibrated %s from %s (measured %.4f s): %s; collective overhead %.3f ms per call",
      absl::StrJoin(p->devices(), ", "), deployment, any.measured_step_seconds(),
      absl::StrJoin(parts, "; "), 1e3 * any.collective_overhead_seconds());
}

absl::StatusOr<v1::RegisterNodeResponse> PlannerCore::RegisterNode(const v1::Node& in) {
  if (!ValidNodeName(in.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat("node name '", in.name(), "' must be 1-253 letters, digits, '-', '.' or '_'"));
  }
  std::set<std::string> ids;
  HAP_RETURN_IF_ERROR(ValidateDevices(in.name(), in.devices(), &ids));
  HAP_RETURN_IF_ERROR(CheckNodeText(in));
  for (const auto& [key, value] : in.labels()) {
    if (key.rfind("hap.executor/", 0) == 0 && !ids.count(key.substr(13))) {
      return absl::InvalidArgumentError(absl::StrCat("node '", in.name(), "': label '", key,
                                                     "' names a device the node does not report"));
    }
  }
  v1::Node node = in;
  for (v1::Device& d : *node.mutable_devices()) d.set_node(node.name());
  absl::MutexLock l(&s_->mu);
  HAP_RETURN_IF_ERROR(CheckOwners(s_->nodes, node.name(), ids));
  HAP_RETURN_IF_ERROR(CheckClusterSize(s_->nodes, node.name(), node.devices_size()));
  // A new node's devices keep none: a calibration is the planner's own.
  const auto old = s_->nodes.find(node.name());
  KeepCalibration(old != s_->nodes.end() ? old->second : v1::Node(), &node);
  *node.mutable_last_heartbeat() = ToProto(o_.now());
  node.set_state(v1::Node::READY);
  if (o_.sink) {
    HAP_RETURN_IF_ERROR(Annotate(o_.sink->SaveNode(node),
                                 absl::StrCat("node '", node.name(), "' was not registered")));
  }
  if (auto old = s_->nodes.find(node.name()); old != s_->nodes.end()) {
    DropLinksOfGoneDevicesLocked(old->second, node);
  }
  s_->nodes[node.name()] = node;
  v1::RegisterNodeResponse r;
  *r.mutable_node() = node;
  *r.mutable_heartbeat_interval() = ToProto(o_.heartbeat_interval);
  return r;
}

absl::StatusOr<v1::HeartbeatResponse> PlannerCore::Heartbeat(const v1::HeartbeatRequest& r) {
  std::string name = NodeId(r.name());
  std::set<std::string> ids;
  if (!r.devices().empty()) HAP_RETURN_IF_ERROR(ValidateDevices(name, r.devices(), &ids));
  v1::HeartbeatResponse out;
  *out.mutable_heartbeat_interval() = ToProto(o_.heartbeat_interval);
  absl::MutexLock l(&s_->mu);
  RefreshLivenessLocked();  // (may expire the node)
  auto it = s_->nodes.find(name);
  if (it == s_->nodes.end()) {
    out.set_unknown_node(true);  // register again
    return out;
  }
  v1::Node n = it->second;
  if (!r.address().empty() && !n.address().empty() && r.address() != n.address()) {
    // Another agent registered the node since: two agents share its name
    // (or this one was replaced). Taken, their heartbeats and devices would
    // interleave; told to register again, they would take the node in
    // turns. Once the registered one goes silent, this one takes over.
    if (n.state() == v1::Node::STALE) {
      out.set_unknown_node(true);
    } else {
      out.set_registered_by(n.address());
    }
    return out;
  }
  // A node back from STALE may have changed: ask it to measure again.
  out.set_reprobe(n.state() == v1::Node::STALE);
  if (!r.devices().empty()) {
    HAP_RETURN_IF_ERROR(CheckOwners(s_->nodes, name, ids));
    HAP_RETURN_IF_ERROR(CheckClusterSize(s_->nodes, name, r.devices_size()));
    const v1::Node before = n;
    n.mutable_devices()->CopyFrom(r.devices());
    for (auto& d : *n.mutable_devices()) d.set_node(name);
    KeepCalibration(before, &n);
  }
  *n.mutable_last_heartbeat() = ToProto(o_.now());
  n.set_state(v1::Node::READY);
  if (o_.sink) {
    HAP_RETURN_IF_ERROR(Annotate(o_.sink->SaveNode(n),
                                 absl::StrCat("heartbeat of node '", name, "' was not saved")));
  }
  DropLinksOfGoneDevicesLocked(it->second, n);
  it->second = std::move(n);
  return out;
}

std::set<std::string> PlannerCore::NodeDeviceIds(const std::string& name) {
  std::set<std::string> ids;
  absl::MutexLock l(&s_->mu);
  auto it = s_->nodes.find(NodeId(name));
  if (it == s_->nodes.end()) return ids;
  for (const auto& d : it->second.devices()) ids.insert(d.id());
  return ids;
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
                       Paginate(s_->nodes, page_size, token, "nodes", [&](const v1::Node& n) {
                         *r.add_nodes() = n;
                         return n.ByteSizeLong();
                       }));
  r.set_next_page_token(next);
  return r;
}

absl::Status PlannerCore::ReportLinks(const std::string& node, const std::vector<v1::Link>& links,
                                      const std::string& address) {
  std::string name = NodeId(node);
  absl::MutexLock l(&s_->mu);
  auto it = s_->nodes.find(name);
  if (it == s_->nodes.end()) {
    return absl::NotFoundError(absl::StrCat("node '", name, "' is not registered"));
  }
  if (!address.empty() && !it->second.address().empty() && address != it->second.address()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node '", name, "' is registered by the agent at ", it->second.address(),
                     "; links reported by the agent at ", address, " are not taken"));
  }
  std::set<std::string> known, own;
  for (const auto& [n, node_msg] : s_->nodes) {
    for (const auto& d : node_msg.devices()) known.insert(d.id());
  }
  for (const auto& d : it->second.devices()) own.insert(d.id());
  for (const v1::Link& l : links) {
    if (!known.count(l.src()) || !known.count(l.dst())) {
      return absl::NotFoundError(absl::StrCat("link ", l.src(), " -> ", l.dst(),
                                              " names a device no node has registered"));
    }
    // A node measures links from its own devices; it may not overwrite
    // another node's measurements.
    if (!own.count(l.src())) {
      return absl::InvalidArgumentError(absl::StrCat("node '", name, "' reports link ", l.src(),
                                                     " -> ", l.dst(),
                                                     " from a device it does not have"));
    }
    HAP_RETURN_IF_ERROR(CheckLinkMeasurement(
        l, absl::StrCat("node '", name, "' reports link ", l.src(), " -> ", l.dst(), ": ")));
  }
  for (const v1::Link& l : links) s_->links[{l.src(), l.dst()}] = l;
  return absl::OkStatus();
}

absl::StatusOr<v1::GetProbeAssignmentsResponse> PlannerCore::GetProbeAssignments(
    const std::string& node, int64_t bytes) {
  std::string name = NodeId(node);
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

}  // namespace hap::service
