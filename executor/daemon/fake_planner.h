// Tests only: a fake hap.v1.Planner with the planner's rendezvous store
// (planner/service/core/rendezvous_store.h, open to any deployment; StoreGet
// waits, bounded by its timeout and the call's deadline) and
// ReportStepMetrics collected. The real planner is planner/service; this
// keeps the executor's tests independent of it. Thread-safe.
#ifndef HAP_EXECUTOR_DAEMON_FAKE_PLANNER_H_
#define HAP_EXECUTOR_DAEMON_FAKE_PLANNER_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "grpcpp/grpcpp.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/rendezvous_store.h"

namespace hap::executor::testing {

namespace v1 = ::hap::v1;

class FakePlanner final : public v1::Planner::Service {
 public:
  // `token`: what ReportStepMetrics requires once set_token_required(true).
  explicit FakePlanner(std::string token = "") : token_(std::move(token)) {}

  grpc::Status StoreSet(grpc::ServerContext*, const v1::StoreSetRequest* r,
                        v1::StoreSetResponse*) override {
    return service::ToGrpc(store_.Set(r->deployment(), r->generation(), r->key(), r->value()));
  }
  grpc::Status StoreGet(grpc::ServerContext* ctx, const v1::StoreGetRequest* r,
                        v1::StoreGetResponse* out) override {
    auto values =
        store_.Get(r->deployment(), r->generation(), {r->keys().begin(), r->keys().end()},
                   service::CallDeadline(ctx, r->has_timeout() ? &r->timeout() : nullptr),
                   [ctx] { return ctx->IsCancelled(); });
    if (!values.ok()) return service::ToGrpc(values.status());
    for (auto& v : *values) out->add_values(std::move(v));
    return grpc::Status::OK;
  }
  grpc::Status StoreAdd(grpc::ServerContext*, const v1::StoreAddRequest* r,
                        v1::StoreAddResponse* out) override {
    auto sum = store_.Add(r->deployment(), r->generation(), r->key(), r->delta());
    if (!sum.ok()) return service::ToGrpc(sum.status());
    out->set_value(*sum);
    return grpc::Status::OK;
  }
  grpc::Status ReportStepMetrics(grpc::ServerContext* ctx,
                                 const v1::ReportStepMetricsRequest* r,
                                 v1::ReportStepMetricsResponse*) override {
    if (token_required_) {
      if (auto s = service::CheckToken(ctx, token_); !s.ok()) return s;
    }
    absl::MutexLock l(&mu_);
    for (const auto& m : r->metrics()) metrics_.push_back(m);
    return grpc::Status::OK;
  }

  std::vector<v1::StepMetric> metrics() {
    absl::MutexLock l(&mu_);
    return metrics_;
  }
  int keys_under(const std::string& deployment, int64_t generation) {
    return static_cast<int>(store_.keys(deployment, generation));
  }
  void set_token_required(bool b) { token_required_ = b; }

 private:
  absl::Mutex mu_;
  // The planner's own store, open to any deployment (no deployment is made).
  service::RendezvousStore store_{service::RendezvousStore::Options{/*open_on_use=*/true}};
  std::vector<v1::StepMetric> metrics_ ABSL_GUARDED_BY(mu_);
  const std::string token_;
  bool token_required_ = false;
};

}  // namespace hap::executor::testing

#endif  // HAP_EXECUTOR_DAEMON_FAKE_PLANNER_H_
