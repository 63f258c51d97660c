#include "profiler_agent/fake_planner.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/proto_time.h"
#include "planner/service/core/profile_checks.h"

namespace hap::agent::testing {
namespace {

namespace v1 = hap::v1;

std::string NodeName(const std::string& name) {
  return absl::StartsWith(name, "nodes/") ? name.substr(6) : name;
}

}  // namespace

std::unique_ptr<grpc::Server> ServeForTest(grpc::Service* service, const std::string& listen,
                                           std::string* address) {
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  b.RegisterService(service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

FakePlanner::FakePlanner(absl::Duration heartbeat_interval, std::string token,
                         const std::string& listen)
    : token_(std::move(token)), heartbeat_interval_(heartbeat_interval) {
  server_ = ServeForTest(this, listen, &address_);
}

FakePlanner::~FakePlanner() {
  server_->Shutdown(absl::ToChronoTime(absl::Now()));
  server_->Wait();
}

grpc::Status FakePlanner::RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* r,
                                       v1::RegisterNodeResponse* out) {
  if (auto s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  absl::MutexLock l(&mu_);
  if (refuse_ > 0) {
    --refuse_;
    ++record_.refused_registrations;
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the fake planner is refusing");
  }
  if (r->node().name().empty() || r->node().devices().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a node needs a name and devices");
  }
  std::set<std::string> ids;
  if (absl::Status s = service::ValidateDevices(r->node().name(), r->node().devices(), &ids);
      !s.ok()) {
    return service::ToGrpc(s);
  }
  // As the real planner (PlannerCore::RegisterNode): an executor label must
  // name a device of the node.
  for (const auto& [key, value] : r->node().labels()) {
    if (!absl::StartsWith(key, "hap.executor/")) continue;
    bool reported = false;
    for (const v1::Device& d : r->node().devices()) reported |= key.substr(13) == d.id();
    if (!reported) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("label '", key, "' names a device the node does not report"));
    }
  }
  ++record_.registrations;
  record_.nodes[r->node().name()] = r->node();
  *out->mutable_node() = r->node();
  *out->mutable_heartbeat_interval() = service::ToProto(heartbeat_interval_);
  return grpc::Status::OK;
}

grpc::Status FakePlanner::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* r,
                                    v1::HeartbeatResponse* out) {
  if (auto s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  absl::MutexLock l(&mu_);
  std::string name = NodeName(r->name());
  std::set<std::string> ids;
  if (!r->devices().empty()) {
    absl::Status s = service::ValidateDevices(name, r->devices(), &ids);
    if (s.ok() && refuse_heartbeat_devices_) {
      s = absl::ResourceExhaustedError("the cluster would hold more than 65536 devices");
    }
    if (!s.ok()) {
      ++record_.refused_heartbeats;
      return service::ToGrpc(s);
    }
  }
  ++record_.heartbeats;
  auto it = record_.nodes.find(name);
  if (it == record_.nodes.end()) {
    out->set_unknown_node(true);
    return grpc::Status::OK;
  }
  // Another agent's heartbeat (the node registered since at another
  // address): not taken, as PlannerCore::Heartbeat (which also hands the
  // node over once its agent is STALE; not kept here).
  if (!r->address().empty() && r->address() != it->second.address()) {
    ++record_.foreign_heartbeats;
    out->set_registered_by(it->second.address());
    return grpc::Status::OK;
  }
  if (!r->devices().empty()) {
    record_.heartbeats_with_devices.push_back(*r);
    *it->second.mutable_devices() = r->devices();
  }
  if (reprobe_[name]) {
    reprobe_[name] = false;
    out->set_reprobe(true);
  }
  out->set_training(training_[name]);
  if (interval_in_heartbeats_) {
    *out->mutable_heartbeat_interval() = service::ToProto(heartbeat_interval_);
  }
  return grpc::Status::OK;
}

grpc::Status FakePlanner::GetProbeAssignments(grpc::ServerContext* ctx,
                                              const v1::GetProbeAssignmentsRequest* r,
                                              v1::GetProbeAssignmentsResponse* out) {
  if (auto s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  absl::MutexLock l(&mu_);
  ++record_.probe_assignment_requests;
  for (const auto& a : assignments_[NodeName(r->node())]) *out->add_assignments() = a;
  return grpc::Status::OK;
}

grpc::Status FakePlanner::ReportLinks(grpc::ServerContext* ctx, const v1::ReportLinksRequest* r,
                                      v1::ReportLinksResponse*) {
  if (auto s = hap::service::CheckToken(ctx, token_); !s.ok()) return s;
  bool hold;
  {
    absl::MutexLock l(&mu_);
    hold = hold_reports_;
    if (hold) record_.held_reports_given.push_back(absl::FromChrono(ctx->deadline()) - absl::Now());
  }
  if (hold) {
    for (int i = 0; i < 2000 && !ctx->IsCancelled(); ++i) absl::SleepFor(absl::Milliseconds(10));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the fake planner held the report");
  }
  absl::MutexLock l(&mu_);
  for (const auto& link : r->links()) {
    for (const std::string* d : {&link.src(), &link.dst()}) {
      if (unknown_devices_.count(*d)) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND, "link names unknown device " + *d);
      }
    }
  }
  for (const auto& link : r->links()) record_.links.push_back(link);
  record_.report_addresses.push_back(r->address());
  return grpc::Status::OK;
}

void FakePlanner::RefuseLinksNaming(const std::string& device) {
  absl::MutexLock l(&mu_);
  unknown_devices_.insert(device);
}

void FakePlanner::HoldReportLinks(bool hold) {
  absl::MutexLock l(&mu_);
  hold_reports_ = hold;
}

void FakePlanner::Forget(const std::string& node) {
  absl::MutexLock l(&mu_);
  record_.nodes.erase(node);
}

void FakePlanner::SetHeartbeatInterval(absl::Duration d) {
  absl::MutexLock l(&mu_);
  heartbeat_interval_ = d;
}

void FakePlanner::SetIntervalInHeartbeats(bool on) {
  absl::MutexLock l(&mu_);
  interval_in_heartbeats_ = on;
}

void FakePlanner::RequestReprobe(const std::string& node) {
  absl::MutexLock l(&mu_);
  reprobe_[node] = true;
}

void FakePlanner::SetTraining(const std::string& node, bool training) {
  absl::MutexLock l(&mu_);
  training_[node] = training;
}

void FakePlanner::RefuseRegistrations(int n) {
  absl::MutexLock l(&mu_);
  refuse_ = n;
}

void FakePlanner::RefuseHeartbeatDevices(bool refuse) {
  absl::MutexLock l(&mu_);
  refuse_heartbeat_devices_ = refuse;
}

void FakePlanner::AssignProbe(const std::string& node, const v1::ProbeAssignment& a) {
  absl::MutexLock l(&mu_);
  assignments_[node].push_back(a);
}

bool FakePlanner::WaitFor(const std::function<bool(const Record&)>& done, absl::Duration timeout) {
  auto cond = [this, &done]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done(record_); };
  mu_.LockWhenWithTimeout(absl::Condition(&cond), timeout);
  bool ok = done(record_);
  mu_.Unlock();
  return ok;
}

FakePlanner::Record FakePlanner::Snapshot() {
  absl::MutexLock l(&mu_);
  return record_;
}

}  // namespace hap::agent::testing
