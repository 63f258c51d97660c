// Tests only: a fake hap.v1.Planner with the rendezvous store (an in-memory
// map; StoreGet waits, bounded by its timeout and the call's deadline) and
// ReportStepMetrics collected. The real planner is planner/service; this
// keeps the executor's tests independent of it. Thread-safe.
#ifndef HAP_EXECUTOR_DAEMON_FAKE_PLANNER_H_
#define HAP_EXECUTOR_DAEMON_FAKE_PLANNER_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/grpc/grpc_util.h"

namespace hap::executor::testing {

namespace v1 = ::hap::v1;

class FakePlanner final : public v1::Planner::Service {
 public:
  // `token`: what ReportStepMetrics requires once set_token_required(true).
  explicit FakePlanner(std::string token = "") : token_(std::move(token)) {}

  grpc::Status StoreSet(grpc::ServerContext*, const v1::StoreSetRequest* r,
                        v1::StoreSetResponse*) override {
    absl::MutexLock l(&mu_);
    kv_[{r->deployment(), r->generation(), r->key()}] = r->value();
    return grpc::Status::OK;
  }
  grpc::Status StoreGet(grpc::ServerContext* ctx, const v1::StoreGetRequest* r,
                        v1::StoreGetResponse* out) override {
    absl::Time deadline = ctx->deadline() == std::chrono::system_clock::time_point::max()
                              ? absl::InfiniteFuture()
                              : absl::FromChrono(ctx->deadline());
    if (r->has_timeout()) {
      deadline = std::min(deadline, absl::Now() + absl::Seconds(r->timeout().seconds()) +
                                        absl::Nanoseconds(r->timeout().nanos()));
    }
    absl::MutexLock l(&mu_);
    auto all_set = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      for (const auto& k : r->keys()) {
        if (!kv_.count({r->deployment(), r->generation(), k})) return false;
      }
      return true;
    };
    while (!all_set()) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      if (absl::Now() >= deadline) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "keys not set in time");
      }
      mu_.AwaitWithDeadline(absl::Condition(&all_set),
                            std::min(deadline, absl::Now() + absl::Milliseconds(100)));
    }
    for (const auto& k : r->keys()) out->add_values(kv_[{r->deployment(), r->generation(), k}]);
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
    absl::MutexLock l(&mu_);
    int n = 0;
    for (const auto& [k, v] : kv_) {
      n += std::get<0>(k) == deployment && std::get<1>(k) == generation;
    }
    return n;
  }
  void set_token_required(bool b) { token_required_ = b; }

 private:
  absl::Mutex mu_;
  std::map<std::tuple<std::string, int64_t, std::string>, std::string> kv_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StepMetric> metrics_ ABSL_GUARDED_BY(mu_);
  const std::string token_;
  bool token_required_ = false;
};

}  // namespace hap::executor::testing

#endif  // HAP_EXECUTOR_DAEMON_FAKE_PLANNER_H_
