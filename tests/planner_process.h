// hap-planner as a process for tests on 127.0.0.1 (planner_service_test,
// hapctl_service_test): started with a token and a database in a
// directory of the test's, clients' call contexts, a node and a plan to
// deploy.
#ifndef HAP_TESTS_PLANNER_PROCESS_H_
#define HAP_TESTS_PLANNER_PROCESS_H_

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "tests/service_harness.h"

namespace hap::testing {

inline constexpr char kToken[] = "s3cret-token";

// A hap-planner with --token-file (kToken), its database in `dir`, fast
// heartbeats; Start fails the test when it does not come up.
struct Planner {
  Process proc;
  int port = 0;
  int metrics_port = 0;
  std::string dir;

  void Start(const std::string& state_dir, std::vector<std::string> extra = {});
  std::string Address() const;
  std::unique_ptr<hap::v1::Planner::Stub> Stub() const;
};

// A call context with the token (or not) and a deadline.
std::unique_ptr<grpc::ClientContext> Ctx(bool token = true, int seconds = 30);

// A node of two CPU devices of `flops` each.
hap::v1::Node FakeNode(const std::string& name, double flops);

// A 2-layer MLP plan request (`wait` for it).
hap::v1::CreatePlanRequest Mlp(bool wait = true);

// A self-signed certificate for 127.0.0.1: DIR/cert.pem and DIR/key.pem.
void MakeTestCertificate(const std::string& dir);

// Node n1 (two CPU devices) and the MLP planned as plans/deployed; the
// request for it, and a deploy of it to executors that are not there.
void RegisterAndPlanDeployed(hap::v1::Planner::Stub* stub, hap::v1::CreatePlanRequest* r,
                             hap::v1::DeployPlanRequest* deploy);

// Deploys `deploy` (to executors that are not there) and waits until the
// deployment has FAILED; the deployment as it ended.
void DeployAndWaitUntilFailed(hap::v1::Planner::Stub* stub,
                              const hap::v1::DeployPlanRequest& deploy, hap::v1::Deployment* d);

}  // namespace hap::testing

#endif  // HAP_TESTS_PLANNER_PROCESS_H_
