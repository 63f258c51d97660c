// A rendezvous store served by the planner (planner_service.proto StoreSet /
// StoreGet): every key lives under one (deployment, generation), so ranks of
// a redeployed plan never read the addresses of an earlier generation.
// This is how executors on different hosts meet for Gloo (docs/design.md §9);
// Debian's Gloo has no TCP store of its own.
//
// Get waits on the planner side: the wait is sent as StoreGetRequest.timeout
// and the RPC deadline is that plus a short grace, so the planner's own
// DeadlineExceeded (which names the missing keys) normally arrives first.
// Calls wait for the channel to become ready within their deadline, so a
// planner that is restarting is waited for rather than failed at once.
//
// Errors keep the planner's status code (via FromGrpc), prefixed with the
// operation and key. A planner that does not answer by a call's deadline
// (not reachable, not serving, overloaded) is DeadlineExceeded saying so,
// apart from a Get whose key the planner did not see set in time.
// Thread-safe (gRPC stubs are).
#ifndef HAP_EXECUTOR_COMM_PLANNER_STORE_H_
#define HAP_EXECUTOR_COMM_PLANNER_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "executor/comm/communicator.h"
#include "hap/v1/planner_service.grpc.pb.h"

namespace hap::executor {

struct PlannerStoreOptions {
  std::string deployment;  // e.g. "deployments/abc"; required
  int64_t generation = 0;
  service::Security security;  // token and CA bundle for the planner
  absl::Duration set_timeout = absl::Seconds(30);  // per StoreSet
  // Added to a Get's wait for the RPC deadline.
  absl::Duration grace = absl::Seconds(2);
};

// Over an existing stub (tests pass a stub to a fake planner). The stub is
// shared, not owned exclusively. InvalidArgument without a deployment.
absl::StatusOr<std::unique_ptr<RendezvousStore>> NewPlannerStore(
    std::shared_ptr<hap::v1::Planner::StubInterface> stub,
    const PlannerStoreOptions& options);

// Over a new channel to `planner_address` ("host:port").
absl::StatusOr<std::unique_ptr<RendezvousStore>> NewPlannerStore(
    const std::string& planner_address, const PlannerStoreOptions& options);

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_COMM_PLANNER_STORE_H_
