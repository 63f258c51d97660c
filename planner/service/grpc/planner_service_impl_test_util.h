// The harness of the planner service's in-process tests
// (planner_service_impl_test, planner_service_deployments_test): the service
// on 127.0.0.1:0 over a sink that refuses writes on demand (a full disk),
// fake executors over gRPC that can be frozen (SIGSTOP) or shut down, and
// the fixture that starts, restarts and calls it.
#ifndef HAP_PLANNER_SERVICE_GRPC_PLANNER_SERVICE_IMPL_TEST_UTIL_H_
#define HAP_PLANNER_SERVICE_GRPC_PLANNER_SERVICE_IMPL_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_test_util.h"
#include "common/grpc_util.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/resource_quota.h"
#include "gtest/gtest.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/profile_checks.h"
#include "planner/service/grpc/planner_service_impl.h"

namespace hap::service::impl_testing {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

inline constexpr char kToken[] = "t0ken";

// Keeps what the service persists; refuses writes while told to.
class Sink : public PlannerStateSink {
 public:
  static absl::Status Full() {
    return absl::UnavailableError("sqlite store 'planner.db': database or disk is full");
  }
  // Refuses plans in `state` (STATE_UNSPECIFIED: none).
  void RefusePlans(v1::Plan::State state) {
    absl::MutexLock l(&mu_);
    refuse_plans_ = state;
  }
  // Refuses deployments after `n` more saves (-1: never).
  void RefuseDeploymentsAfter(int n) {
    absl::MutexLock l(&mu_);
    deployment_saves_left_ = n;
  }
  void RefuseMetrics(bool refuse) {
    absl::MutexLock l(&mu_);
    refuse_metrics_ = refuse;
  }
  size_t nodes() {
    absl::MutexLock l(&mu_);
    return nodes_.size();
  }
  v1::Deployment deployment(const std::string& name) {
    absl::MutexLock l(&mu_);
    return deployments_[name];
  }
  std::vector<v1::Deployment> deployments() {
    absl::MutexLock l(&mu_);
    std::vector<v1::Deployment> out;
    for (const auto& [name, d] : deployments_) out.push_back(d);
    return out;
  }

  absl::Status SaveNode(const v1::Node& n) override {
    absl::MutexLock l(&mu_);
    nodes_[n.name()] = n;
    return absl::OkStatus();
  }
  absl::Status DeleteNode(const std::string& name) override {
    absl::MutexLock l(&mu_);
    nodes_.erase(name);
    return absl::OkStatus();
  }
  absl::Status SavePlan(const v1::Plan& p) override {
    absl::MutexLock l(&mu_);
    if (p.state() == refuse_plans_) return Full();
    return absl::OkStatus();
  }
  absl::Status DeletePlan(const std::string&) override { return absl::OkStatus(); }
  absl::Status SaveDeployment(const v1::Deployment& d) override {
    absl::MutexLock l(&mu_);
    if (deployment_saves_left_ == 0) return Full();
    if (deployment_saves_left_ > 0) --deployment_saves_left_;
    deployments_[d.name()] = d;
    return absl::OkStatus();
  }
  absl::Status AppendStepMetrics(const std::vector<v1::StepMetric>&) override {
    absl::MutexLock l(&mu_);
    return refuse_metrics_ ? Full() : absl::OkStatus();
  }
  absl::Status SaveJob(const v1::Job& j) override {
    absl::MutexLock l(&mu_);
    jobs_[j.name()] = j;
    return absl::OkStatus();
  }
  std::vector<v1::Job> jobs() {
    absl::MutexLock l(&mu_);
    std::vector<v1::Job> out;
    for (const auto& [name, j] : jobs_) out.push_back(j);
    return out;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, v1::Node> nodes_;
  std::map<std::string, v1::Deployment> deployments_;
  std::map<std::string, v1::Job> jobs_;
  v1::Plan::State refuse_plans_ = v1::Plan::STATE_UNSPECIFIED;
  int deployment_saves_left_ = -1;
  bool refuse_metrics_ = false;
};

inline v1::Node TestNode(const std::string& name) {
  v1::Node n;
  n.set_name(name);
  for (int i = 0; i < 2; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id(absl::StrCat(name, "/cpu", i));
    d->set_kind(v1::CPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(1e12);
    d->set_memory_bytes(int64_t{8} << 30);
  }
  return n;
}

inline v1::CreatePlanRequest Mlp(const std::string& id) {
  v1::CreatePlanRequest r;
  r.set_plan_id(id);
  r.mutable_model()->mutable_zoo()->set_name("mlp");
  auto& p = *r.mutable_model()->mutable_zoo()->mutable_params();
  p["layers"] = 2;
  p["hidden"] = 32;
  p["input"] = 16;
  p["batch"] = 16;
  r.set_wait(true);
  return r;
}

// An executor daemon's API over gRPC on 127.0.0.1:0 that trains nothing:
// LoadPlan and StartTraining move its state as the real one's (a load while
// TRAINING is refused); Finish/Fail end its training. Frozen, every call
// hangs until its deadline (a SIGSTOPped process); Kill shuts its server
// down (a SIGKILLed one: connections refused).
class FakeExecutor final : public v1::Executor::Service {
 public:
  FakeExecutor() {
    status_.set_state(v1::ExecutorStatus::IDLE);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(this);
    server_ = b.BuildAndStart();
  }
  ~FakeExecutor() override {
    Freeze(false);
    Kill();
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  void Kill() {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  void Freeze(bool frozen) {
    absl::MutexLock l(&mu_);
    frozen_ = frozen;
  }
  void Set(v1::ExecutorStatus::State state, const std::string& error = "") {
    absl::MutexLock l(&mu_);
    status_.set_state(state);
    status_.set_error(error);
  }
  v1::ExecutorStatus status() {
    absl::MutexLock l(&mu_);
    return status_;
  }
  std::string last_resume() {
    absl::MutexLock l(&mu_);
    return last_resume_;
  }
  int stops() {
    absl::MutexLock l(&mu_);
    return stops_;
  }
  // Waits until at least `n` StopTraining calls were answered.
  bool WaitForStops(int n, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock l(&mu_);
    auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stops_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
  }

  grpc::Status LoadPlan(grpc::ServerContext* ctx, const v1::LoadPlanRequest* r,
                        v1::LoadPlanResponse*) override {
    absl::MutexLock l(&mu_);
    if (!Answer(ctx)) return Hung();
    if (status_.state() == v1::ExecutorStatus::TRAINING) {
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("training ", status_.deployment(), "; stop it before loading another plan"));
    }
    status_.set_state(v1::ExecutorStatus::LOADED);
    last_resume_ = r->training().resume();
    status_.set_deployment(r->deployment());
    status_.set_generation(r->generation());
    status_.set_rank(r->rank());
    status_.clear_error();
    return grpc::Status::OK;
  }
  grpc::Status StartTraining(grpc::ServerContext* ctx, const v1::StartTrainingRequest*,
                             v1::ExecutorStatus* out) override {
    absl::MutexLock l(&mu_);
    if (!Answer(ctx)) return Hung();
    status_.set_state(v1::ExecutorStatus::TRAINING);
    *out = status_;
    return grpc::Status::OK;
  }
  grpc::Status StopTraining(grpc::ServerContext* ctx, const v1::StopTrainingRequest* r,
                            v1::ExecutorStatus* out) override {
    absl::MutexLock l(&mu_);
    if (!Answer(ctx)) return Hung();
    ++stops_;
    if (!status_.deployment().empty() && r->deployment() != status_.deployment()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "holds another deployment");
    }
    if (status_.state() == v1::ExecutorStatus::TRAINING) {
      status_.set_state(v1::ExecutorStatus::FAILED);
      status_.set_error("stopped by StopTraining");
    }
    *out = status_;
    return grpc::Status::OK;
  }
  // The longest time a GetStatus that found it frozen was given (its
  // deadline less the time it arrived): at most the caller's timeout.
  absl::Duration longest_frozen_status_call() {
    absl::MutexLock l(&mu_);
    return longest_frozen_status_call_;
  }
  int frozen_status_calls() {
    absl::MutexLock l(&mu_);
    return frozen_status_calls_;
  }
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*,
                         v1::ExecutorStatus* out) override {
    absl::MutexLock l(&mu_);
    if (frozen_) {
      ++frozen_status_calls_;
      longest_frozen_status_call_ =
          std::max(longest_frozen_status_call_, CallDeadline(ctx) - absl::Now());
    }
    if (!Answer(ctx)) return Hung();
    *out = status_;
    return grpc::Status::OK;
  }

 private:
  // False when frozen until the call's deadline.
  bool Answer(grpc::ServerContext* ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto thawed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !frozen_; };
    return mu_.AwaitWithDeadline(absl::Condition(&thawed), CallDeadline(ctx));
  }
  static grpc::Status Hung() { return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "frozen"); }

  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mu_;
  v1::ExecutorStatus status_ ABSL_GUARDED_BY(mu_);
  std::string last_resume_ ABSL_GUARDED_BY(mu_);
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;
  int stops_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration longest_frozen_status_call_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int frozen_status_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

class PlannerServiceImplTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PlannerCoreOptions co;
    co.sink = &sink_;
    // No agent heartbeats here: nodes stay READY for the test's length.
    co.heartbeat_interval = absl::Hours(1);
    auto core = PlannerCore::Create(co);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = *std::move(core);
    StartService({});
  }
  void TearDown() override {
    for (auto& e : executors_) e->Freeze(false);  // calls in flight return
    StopService();
    executors_.clear();
    core_.reset();
  }

  // The service over the core and sink, starting from `deployments`.
  // `max_threads` > 0: the server's thread quota (as hap-planner sets it).
  void StartService(std::vector<v1::Deployment> deployments, int max_threads = 0,
                    std::vector<v1::Job> jobs = {}) {
    PlannerServiceOptions so;
    so.security.token = kToken;
    so.deployments.call_timeout = absl::Seconds(5);
    // Fast polls: a silent rank fails its deployment within about 150 ms.
    so.deployments.status_interval = absl::Milliseconds(50);
    so.deployments.status_timeout = absl::Milliseconds(100);
    so.deployments.missed_status_limit = 3;
    so.deployments.stop_timeout = absl::Milliseconds(500);
    so.deployments.stop_attempts = 2;
    so.on_deployment = [this](const v1::Deployment& d) {
      absl::MutexLock l(&seen_mu_);
      seen_[d.name()] = d;
    };
    so.job_interval = absl::Milliseconds(20);
    service_ = std::make_unique<PlannerServiceImpl>(core_.get(), &sink_, so, std::move(deployments),
                                                    std::vector<v1::StepMetric>{}, std::move(jobs));
    service_->StartJobs();
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    grpc::ResourceQuota quota("test");
    if (max_threads > 0) {
      quota.SetMaxThreads(max_threads);
      b.SetResourceQuota(quota);
    }
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_), {});
    ASSERT_TRUE(channel.ok()) << channel.status();
    stub_ = v1::Planner::NewStub(*channel);
  }
  void StopService() {
    service_->Shutdown();
    server_->Shutdown();
    service_.reset();  // joins the deployment supervisors
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    Security s;
    s.token = kToken;
    PrepareClientContext(c.get(), s, absl::Seconds(30));
    return c;
  }
  void Register(const std::string& node) {
    v1::RegisterNodeRequest r;
    *r.mutable_node() = TestNode(node);
    v1::RegisterNodeResponse out;
    ASSERT_THAT(FromGrpc(stub_->RegisterNode(Ctx().get(), r, &out)), IsOk());
  }
  // A deployment of a fresh plan on node "n" to executors nobody listens
  // at: its push fails, and it stays (FAILED).
  absl::StatusOr<v1::Deployment> Deploy(const std::string& plan_id) {
    v1::Plan plan;
    absl::Status s = FromGrpc(stub_->CreatePlan(Ctx().get(), Mlp(plan_id), &plan));
    if (!s.ok()) return s;
    v1::DeployPlanRequest r;
    r.set_plan(plan.name());
    for (int i = 0; i < plan.devices_size(); ++i) {
      (*r.mutable_executors())[plan.devices(i)] = absl::StrCat("127.0.0.1:", i + 1);
    }
    v1::Deployment d;
    s = FromGrpc(stub_->DeployPlan(Ctx().get(), r, &d));
    if (!s.ok()) return s;
    return d;
  }
  // Waits until deployment `name` is in `state` (as on_deployment saw it);
  // the deployment then (or as last seen).
  v1::Deployment WaitForState(const std::string& name, v1::Deployment::State state,
                              absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock l(&seen_mu_);
    auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(seen_mu_) {
      auto it = seen_.find(name);
      return it != seen_.end() && it->second.state() == state;
    };
    EXPECT_TRUE(seen_mu_.AwaitWithTimeout(absl::Condition(&reached), timeout))
        << name << " never reached " << v1::Deployment::State_Name(state)
        << "; last seen: " << seen_[name].DebugString();
    return seen_[name];
  }
  // A plan on node "n" (two devices) deployed to two fake executors.
  absl::StatusOr<v1::Deployment> DeployToFakes(const std::string& plan_id) {
    if (executors_.empty()) {
      for (int i = 0; i < 2; ++i) executors_.push_back(std::make_unique<FakeExecutor>());
    }
    v1::Plan plan;
    v1::GetPlanRequest g;
    g.set_name("plans/" + plan_id);
    if (!stub_->GetPlan(Ctx().get(), g, &plan).ok()) {
      absl::Status s = FromGrpc(stub_->CreatePlan(Ctx().get(), Mlp(plan_id), &plan));
      if (!s.ok()) return s;
    }
    v1::DeployPlanRequest r;
    r.set_plan(plan.name());
    for (int i = 0; i < plan.devices_size(); ++i) {
      (*r.mutable_executors())[plan.devices(i)] = executors_[i]->address();
    }
    v1::Deployment d;
    absl::Status s = FromGrpc(stub_->DeployPlan(Ctx().get(), r, &d));
    if (!s.ok()) return s;
    return d;
  }
  absl::StatusOr<v1::Deployment> Stop(const std::string& name) {
    v1::StopDeploymentRequest r;
    r.set_name(name);
    v1::Deployment d;
    absl::Status s = FromGrpc(stub_->StopDeployment(Ctx().get(), r, &d));
    if (!s.ok()) return s;
    return d;
  }

  // Calls `method` with `request` whose string field `field` (none when
  // empty) is set to `value`.
  template <typename Request, typename Response>
  grpc::Status Send(grpc::Status (v1::Planner::Stub::*method)(grpc::ClientContext*, const Request&,
                                                              Response*),
                    Request request, const std::string& field, const std::string& value) {
    if (!field.empty()) {
      request.GetReflection()->SetString(&request, request.GetDescriptor()->FindFieldByName(field),
                                         value);
    }
    Response response;
    return (stub_.get()->*method)(Ctx().get(), request, &response);
  }

  // The deployment once its push has ended.
  v1::Deployment Settled(const std::string& name) {
    v1::GetDeploymentRequest r;
    r.set_name(name);
    v1::Deployment d;
    for (int i = 0; i < 600; ++i) {
      EXPECT_THAT(FromGrpc(stub_->GetDeployment(Ctx().get(), r, &d)), IsOk());
      if (d.state() == v1::Deployment::FAILED) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return d;
  }

  Sink sink_;
  std::vector<std::unique_ptr<FakeExecutor>> executors_;
  absl::Mutex seen_mu_;
  std::map<std::string, v1::Deployment> seen_ ABSL_GUARDED_BY(seen_mu_);
  std::unique_ptr<PlannerCore> core_;
  std::unique_ptr<PlannerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Planner::Stub> stub_;
  int port_ = 0;  // the service's
};

}  // namespace hap::service::impl_testing

#endif  // HAP_PLANNER_SERVICE_GRPC_PLANNER_SERVICE_IMPL_TEST_UTIL_H_
