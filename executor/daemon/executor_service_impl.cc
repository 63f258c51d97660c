#include "executor/daemon/executor_service_impl.h"

#include <algorithm>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using service::CallDeadline;
using service::CheckToken;
using service::ToGrpc;

}  // namespace

grpc::Status ExecutorServiceImpl::LoadPlan(grpc::ServerContext* ctx,
                                           const v1::LoadPlanRequest* r,
                                           v1::LoadPlanResponse* out) {
  if (grpc::Status s = CheckToken(ctx, token_); !s.ok()) return s;
  LoadOptions o;
  o.plan = r->plan();
  o.deployment = r->deployment();
  o.generation = r->generation();
  o.rank = r->rank();
  o.world_size = r->world_size();
  o.rendezvous_address = r->rendezvous_address();
  o.training = r->training();
  // The planner gives up at its deadline; a plan installed after that
  // would run while the planner takes the load for failed.
  auto caller = [ctx, deadline = CallDeadline(ctx)]() -> absl::Status {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the LoadPlan call's deadline passed");
    }
    if (ctx->IsCancelled()) return absl::CancelledError("the caller cancelled LoadPlan");
    return absl::OkStatus();
  };
  auto hash = core_->LoadPlan(std::move(o), caller);
  if (!hash.ok()) return ToGrpc(hash.status());
  out->set_plan_content_hash(*hash);
  return grpc::Status::OK;
}

grpc::Status ExecutorServiceImpl::StartTraining(grpc::ServerContext* ctx,
                                                const v1::StartTrainingRequest* r,
                                                v1::ExecutorStatus* out) {
  if (grpc::Status s = CheckToken(ctx, token_); !s.ok()) return s;
  auto st = core_->Start(r->deployment());
  if (!st.ok()) return ToGrpc(st.status());
  *out = *std::move(st);
  return grpc::Status::OK;
}

grpc::Status ExecutorServiceImpl::StopTraining(grpc::ServerContext* ctx,
                                               const v1::StopTrainingRequest* r,
                                               v1::ExecutorStatus* out) {
  if (grpc::Status s = CheckToken(ctx, token_); !s.ok()) return s;
  // Wait for the step in progress at most half the time left, so that the
  // answer (FAILED, the step abandoned if need be) reaches the caller in time.
  const absl::Time now = absl::Now();
  const absl::Time deadline = CallDeadline(ctx);
  const absl::Time wait_until =
      deadline == absl::InfiniteFuture() ? deadline : now + (deadline - now) / 2;
  auto st = core_->Stop(r->deployment(), wait_until);
  if (!st.ok()) return ToGrpc(st.status());
  *out = *std::move(st);
  return grpc::Status::OK;
}

grpc::Status ExecutorServiceImpl::GetStatus(grpc::ServerContext* ctx,
                                            const v1::GetStatusRequest*,
                                            v1::ExecutorStatus* out) {
  if (grpc::Status s = CheckToken(ctx, token_); !s.ok()) return s;
  *out = core_->Status();
  return grpc::Status::OK;
}

grpc::Status ExecutorServiceImpl::StreamStepMetrics(
    grpc::ServerContext* ctx, const v1::StreamStepMetricsRequest* r,
    grpc::ServerWriter<v1::StepMetric>* writer) {
  if (grpc::Status s = CheckToken(ctx, token_); !s.ok()) return s;
  if (r->from_step() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "from_step must not be negative");
  }
  if (streams_.fetch_add(1) >= max_streams_) {
    streams_.fetch_sub(1);
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("this executor serves at most ", max_streams_,
                     " StreamStepMetrics calls at once (ExecutorServerOptions.max_streams) and "
                     "that many are open; retry when one has ended"));
  }
  absl::Cleanup release = [this] { streams_.fetch_sub(1); };
  // The stream is bound to the load current now, before it is admitted:
  // bound later, a plan unloaded meanwhile ended an admitted stream with
  // FAILED_PRECONDITION, and one loaded again (the same deployment, a new
  // generation) between two waits was streamed on as if the same run.
  int64_t load = 0;
  bool done = false;
  auto batch =
      core_->WaitMetrics(r->deployment(), r->from_step(), absl::InfinitePast(), &done, &load);
  if (!batch.ok()) return ToGrpc(batch.status());
  writer->SendInitialMetadata();  // admitted (a client gone is noticed below)
  const absl::Time deadline = CallDeadline(ctx);
  int64_t next = r->from_step();
  while (true) {
    for (const v1::StepMetric& m : *batch) {
      if (!writer->Write(m)) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      }
      next = m.step() + 1;
    }
    if (done) return grpc::Status::OK;
    if (ctx->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the stream");
    }
    if (absl::Now() >= deadline) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "the stream's deadline passed before training ended");
    }
    // Short waits, so a cancelled client is noticed promptly.
    batch =
        core_->WaitMetrics(r->deployment(), next,
                           std::min(deadline, absl::Now() + absl::Milliseconds(200)), &done, &load);
    if (!batch.ok()) return ToGrpc(batch.status());
  }
}

}  // namespace hap::executor
