// hap.v1.Executor over an ExecutorCore: each handler checks the bearer
// token, turns the request into the core's terms, and the result back into
// a gRPC status (TensorStore's thin-translator pattern). The access rule
// "plans only from the configured planner" is enforced twice: the token
// here, the rendezvous address in the core. Only TLS plus the token is a
// real guarantee; the address check catches mistakes, not attackers.
#ifndef HAP_EXECUTOR_DAEMON_EXECUTOR_SERVICE_IMPL_H_
#define HAP_EXECUTOR_DAEMON_EXECUTOR_SERVICE_IMPL_H_

#include <atomic>
#include <string>

#include "absl/time/time.h"
#include "executor/daemon/executor_core.h"
#include "hap/v1/executor_service.grpc.pb.h"

namespace hap::executor {

// StreamStepMetrics calls an executor serves at once unless told otherwise.
inline constexpr int kDefaultMaxStreams = 64;

class ExecutorServiceImpl final : public hap::v1::Executor::Service {
 public:
  // `core` must outlive the service. `token`: required on every call when
  // not empty (UNAUTHENTICATED otherwise). `max_streams`: StreamStepMetrics
  // calls served at once (see StreamStepMetrics).
  ExecutorServiceImpl(ExecutorCore* core, std::string token, int max_streams = kDefaultMaxStreams)
      : core_(core), token_(std::move(token)), max_streams_(max_streams) {}

  // DEADLINE_EXCEEDED or CANCELLED, installing nothing, when the caller has
  // gone (its deadline passed, or it cancelled) before the plan is
  // installed: a slow load does not leave a plan running that the caller
  // took for failed.
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
  // DEADLINE_EXCEEDED at the call's deadline. Each open stream holds a
  // server thread, so beyond `max_streams` open at once a stream is
  // RESOURCE_EXHAUSTED at once. An admitted stream sends its initial
  // metadata straight away (the client's WaitForInitialMetadata returns).
  grpc::Status StreamStepMetrics(grpc::ServerContext* ctx,
                                 const hap::v1::StreamStepMetricsRequest* r,
                                 grpc::ServerWriter<hap::v1::StepMetric>* writer) override;

 private:
  ExecutorCore* core_;
  const std::string token_;
  const int max_streams_;
  std::atomic<int> streams_{0};  // StreamStepMetrics calls open
};

}  // namespace hap::executor

#endif  // HAP_EXECUTOR_DAEMON_EXECUTOR_SERVICE_IMPL_H_
