// A fake hap.v1.Planner for the agent's tests: the node calls only
// (RegisterNode, Heartbeat, GetProbeAssignments, ReportLinks), recorded, with
// knobs to forget a node, ask for a re-probe or refuse registrations.
// Devices are checked as the real planner checks them (ValidateDevices).
// Thread-safe. Tests only: the real planner is tested with the agent
// end to end.
#ifndef HAP_PROFILER_AGENT_FAKE_PLANNER_H_
#define HAP_PROFILER_AGENT_FAKE_PLANNER_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hap/v1/planner_service.grpc.pb.h"

namespace hap::agent::testing {

// `service` served in process, plaintext, on `listen` (port 0: a free one);
// its address "127.0.0.1:PORT" in *address.
std::unique_ptr<grpc::Server> ServeForTest(grpc::Service* service, const std::string& listen,
                                           std::string* address);

class FakePlanner final : public hap::v1::Planner::Service {
 public:
  // Serves on `listen` (default: 127.0.0.1 at a free port); calls must
  // carry `token` when set.
  explicit FakePlanner(absl::Duration heartbeat_interval, std::string token = "",
                       const std::string& listen = "127.0.0.1:0");
  ~FakePlanner() override;

  std::string address() const { return address_; }

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const hap::v1::RegisterNodeRequest* r,
                            hap::v1::RegisterNodeResponse* out) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const hap::v1::HeartbeatRequest* r,
                         hap::v1::HeartbeatResponse* out) override;
  grpc::Status GetProbeAssignments(grpc::ServerContext* ctx,
                                   const hap::v1::GetProbeAssignmentsRequest* r,
                                   hap::v1::GetProbeAssignmentsResponse* out) override;
  grpc::Status ReportLinks(grpc::ServerContext* ctx, const hap::v1::ReportLinksRequest* r,
                           hap::v1::ReportLinksResponse* out) override;

  // Knobs.
  void Forget(const std::string& node);          // next heartbeat: unknown_node
  void RequestReprobe(const std::string& node);  // next heartbeat: reprobe
  void SetHeartbeatInterval(absl::Duration d);   // what registrations and heartbeats answer
  // false: heartbeat answers carry no interval, as older planners' did.
  void SetIntervalInHeartbeats(bool on);
  void SetTraining(const std::string& node, bool training);  // heartbeats: training
  void RefuseRegistrations(int n);               // the next n get UNAVAILABLE
  // Heartbeats that carry devices get RESOURCE_EXHAUSTED (as a cluster at
  // its device bound answers), counted in refused_heartbeats, while `refuse`.
  void RefuseHeartbeatDevices(bool refuse);
  void AssignProbe(const std::string& node, const hap::v1::ProbeAssignment& a);
  // ReportLinks naming `device` is refused whole (NOT_FOUND), as the real
  // planner refuses a report naming a device no node registered.
  void RefuseLinksNaming(const std::string& device);
  // While `hold`, ReportLinks calls go unanswered (a hung planner) until
  // their caller gives up or 20 s pass, each recording the time its caller
  // gave it in held_reports_given.
  void HoldReportLinks(bool hold);

  // What was received.
  struct Record {
    int registrations = 0;          // accepted RegisterNode calls
    int refused_registrations = 0;  // UNAVAILABLE ones
    int heartbeats = 0;
    int refused_heartbeats = 0;  // INVALID_ARGUMENT ones (devices the planner refuses)
    // From another agent than the one the node registered last (another
    // address): answered registered_by, not taken.
    int foreign_heartbeats = 0;
    std::map<std::string, hap::v1::Node> nodes;  // by name, as last registered/updated
    std::vector<hap::v1::HeartbeatRequest> heartbeats_with_devices;
    std::vector<hap::v1::Link> links;
    std::vector<std::string> report_addresses;  // each link report's address
    int probe_assignment_requests = 0;  // GetProbeAssignments calls
    std::vector<absl::Duration> held_reports_given;  // HoldReportLinks
  };
  // Waits until `done(record)` holds (true) or `timeout` passes (false).
  bool WaitFor(const std::function<bool(const Record&)>& done,
               absl::Duration timeout = absl::Seconds(30));
  Record Snapshot();

 private:
  const std::string token_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;

  absl::Mutex mu_;
  Record record_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> reprobe_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> training_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<hap::v1::ProbeAssignment>> assignments_ ABSL_GUARDED_BY(mu_);
  int refuse_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_);
  bool interval_in_heartbeats_ ABSL_GUARDED_BY(mu_) = true;
  bool refuse_heartbeat_devices_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_reports_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> unknown_devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hap::agent::testing

#endif  // HAP_PROFILER_AGENT_FAKE_PLANNER_H_
