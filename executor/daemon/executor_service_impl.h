// hap.v1.Executor over an ExecutorCore: each handler checks the bearer
// token, turns the request into the core's terms, and the result back into
// a gRPC status (TensorStore's thin-translator pattern). The access rule
// "plans only from the configured planner" is enforced twice: the token
// here, the rendezvous address in the core. Only TLS plus the token is a
// real guarantee; the address check catches mistakes, not attackers.
#ifndef HAP_EXECUTOR_DAEMON_EXECUTOR_SERVICE_IMPL_H_
#define HAP_EXECUTOR_DAEMON_EXECUTOR_SERVICE_IMPL_H_

#include <string>

#include "absl/time/time.h"
#include "executor/daemon/executor_core.h"
#include "hap/v1/executor_service.grpc.pb.h"

namespace hap::executor {

class ExecutorServiceImpl final : public hap::v1::Executor::Service {
 public:
  // `core` must outlive the service. `token`: required on every call when
  // not empty (UNAUTHENTICATED otherwise).
  ExecutorServiceImpl(ExecutorCore* core, std::string token)
      : core_(core), token_(std::move(token)) {}

  grpc::Status LoadPlan(grpc::ServerContext* ctx, const hap::v1::LoadPlanRequest* r,
                        hap::v1::LoadPlanResponse* out) override;
  grpc::Status StartTraining(grpc::ServerContext* ctx,
                             const hap::v1::StartTrainingRequest* r,
                             hap::v1::ExecutorStatus* out) override;
  grpc::Status StopTraining(grpc::ServerContext* ctx, const hap::v1::StopTrainingRequest* r,
                            hap::v1::ExecutorStatus* out) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const hap::v1::GetStatusRequest* r,
                         hap::v1::ExecutorStatus* out) override;
  // Streams the metrics from `from_step` on; ends OK when training ends (or
  // the plan is replaced), CANCELLED when the client goes away,
  // DEADLINE_EXCEEDED at the call's deadline.
  grpc::Status StreamStepMetrics(grpc::ServerContext* ctx,
                                 const hap::v1::StreamStepMetricsRequest* r,
                                 grpc::ServerWriter<hap::v1::StepMetric>* writer) override;

 private:
  ExecutorCore* core_;
  const std::string token_;
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_EXECUTOR_SERVICE_IMPL_H_
