#include "executor/comm/planner_store.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;

class PlannerStore : public RendezvousStore {
 public:
  PlannerStore(std::shared_ptr<v1::Planner::StubInterface> stub, PlannerStoreOptions o)
      : stub_(std::move(stub)), o_(std::move(o)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    v1::StoreSetRequest req;
    req.set_deployment(o_.deployment);
    req.set_generation(o_.generation);
    req.set_key(key);
    req.set_value(value);
    v1::StoreSetResponse resp;
    grpc::ClientContext ctx;
    const absl::Time rpc_deadline = absl::Now() + o_.set_timeout;
    service::PrepareClientContext(&ctx, o_.security, o_.set_timeout);
    ctx.set_wait_for_ready(true);
    const grpc::Status s = stub_->StoreSet(&ctx, req, &resp);
    if (NoAnswer(s, rpc_deadline)) return NoAnswerError("StoreSet", key, o_.set_timeout, s);
    return Context("StoreSet", key, s);
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override {
    if (timeout < absl::ZeroDuration()) timeout = absl::ZeroDuration();
    v1::StoreGetRequest req;
    req.set_deployment(o_.deployment);
    req.set_generation(o_.generation);
    req.add_keys(key);
    if (timeout != absl::InfiniteDuration()) {
      const int64_t ns = absl::ToInt64Nanoseconds(timeout);
      req.mutable_timeout()->set_seconds(ns / 1'000'000'000);
      req.mutable_timeout()->set_nanos(static_cast<int32_t>(ns % 1'000'000'000));
    }
    v1::StoreGetResponse resp;
    grpc::ClientContext ctx;
    const absl::Time rpc_deadline = absl::Now() + timeout + o_.grace;
    service::PrepareClientContext(&ctx, o_.security, timeout + o_.grace);
    ctx.set_wait_for_ready(true);
    grpc::Status s = stub_->StoreGet(&ctx, req, &resp);
    if (!s.ok()) {
      if (NoAnswer(s, rpc_deadline)) {
        return NoAnswerError("StoreGet", key, timeout + o_.grace, s);
      }
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        // The planner's wait ended: the key was not there in time.
        return absl::DeadlineExceededError(absl::StrCat(
            "rendezvous key '", key, "' of ", o_.deployment, " generation ",
            o_.generation, " not set within ", absl::FormatDuration(timeout), ": ",
            s.error_message()));
      }
      return Context("StoreGet", key, s);
    }
    if (resp.values_size() != 1) {
      return absl::InternalError(absl::StrCat("StoreGet '", key, "': the planner returned ",
                                              resp.values_size(), " values for one key"));
    }
    return std::move(*resp.mutable_values(0));
  }

 private:
  // DEADLINE_EXCEEDED at or after the call's own deadline: the planner did
  // not answer (not reachable, not serving, or too slow), as opposed to
  // the planner's own DeadlineExceeded (a StoreGet's wait), which comes by
  // the wait's end, a grace before the call's deadline.
  static bool NoAnswer(const grpc::Status& s, absl::Time rpc_deadline) {
    return s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && absl::Now() >= rpc_deadline;
  }
  absl::Status NoAnswerError(const char* what, const std::string& key, absl::Duration waited,
                             const grpc::Status& s) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, " '", key, "' (", o_.deployment, " generation ", o_.generation,
                     "): the planner did not answer within ", absl::FormatDuration(waited),
                     " (not reachable, not serving, or overloaded): ", s.error_message()));
  }

  absl::Status Context(const char* what, const std::string& key, const grpc::Status& s) {
    absl::Status a = service::FromGrpc(s);
    if (a.ok()) return a;
    return absl::Status(a.code(), absl::StrCat(what, " '", key, "' (", o_.deployment,
                                               " generation ", o_.generation,
                                               "): ", a.message()));
  }

  std::shared_ptr<v1::Planner::StubInterface> stub_;
  PlannerStoreOptions o_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RendezvousStore>> NewPlannerStore(
    std::shared_ptr<v1::Planner::StubInterface> stub, const PlannerStoreOptions& options) {
  if (options.deployment.empty()) {
    return absl::InvalidArgumentError("a planner store needs a deployment");
  }
  if (stub == nullptr) return absl::InvalidArgumentError("a planner store needs a stub");
  return std::unique_ptr<RendezvousStore>(new PlannerStore(std::move(stub), options));
}

absl::StatusOr<std::unique_ptr<RendezvousStore>> NewPlannerStore(
    const std::string& planner_address, const PlannerStoreOptions& options) {
  if (planner_address.empty()) {
    return absl::InvalidArgumentError("a planner store needs the planner's address");
  }
  auto channel = service::MakeChannel(planner_address, options.security);
  if (!channel.ok()) return channel.status();
  std::shared_ptr<v1::Planner::StubInterface> stub = v1::Planner::NewStub(*channel);
  return NewPlannerStore(std::move(stub), options);
}

}  // namespace hap::executor
