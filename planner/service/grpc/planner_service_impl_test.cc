// hap.v1.Planner in process on 127.0.0.1:0, over a sink that refuses
// writes on demand (a full disk): RPCs fail with the store's error and leave
// nothing behind; node removal; the rendezvous store only for deployments
// that exist, with counters that do not wrap. Deployments against fake
// executors over gRPC (each its own server on 127.0.0.1:0) that can be
// frozen (SIGSTOP) or shut down (SIGKILL): every rank of a deployment that
// fails or is stopped is stopped, also after a planner restart. An elastic
// job over those fake executors: an executor lost, the job re-planned on
// the rest, resumed from the committed checkpoint, and done; across a
// planner restart too.
#include "planner/service/grpc/planner_service_impl.h"

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

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kToken[] = "t0ken";

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

v1::Node TestNode(const std::string& name) {
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

v1::CreatePlanRequest Mlp(const std::string& id) {
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
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("training ", status_.deployment(),
                                       "; stop it before loading another plan"));
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
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*,
                         v1::ExecutorStatus* out) override {
    absl::MutexLock l(&mu_);
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
  static grpc::Status Hung() {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "frozen");
  }

  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mu_;
  v1::ExecutorStatus status_ ABSL_GUARDED_BY(mu_);
  std::string last_resume_ ABSL_GUARDED_BY(mu_);
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;
  int stops_ ABSL_GUARDED_BY(mu_) = 0;
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
      if (d.state() == v1::Deployment::FAILED && !failed_at_.count(d.name())) {
        failed_at_[d.name()] = absl::Now();
      }
    };
    so.job_interval = absl::Milliseconds(20);
    service_ = std::make_unique<PlannerServiceImpl>(core_.get(), &sink_, so,
                                                    std::move(deployments),
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
        << name << " never reached " << v1::Deployment::State_Name(state) << "; last seen: "
        << seen_[name].DebugString();
    return seen_[name];
  }
  absl::Time FailedAt(const std::string& name) {
    absl::MutexLock l(&seen_mu_);
    return failed_at_[name];
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
  std::map<std::string, absl::Time> failed_at_ ABSL_GUARDED_BY(seen_mu_);
  std::unique_ptr<PlannerCore> core_;
  std::unique_ptr<PlannerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Planner::Stub> stub_;
  int port_ = 0;  // the service's
};

TEST_F(PlannerServiceImplTest, DeleteNodeRemovesANode) {
  Register("n");
  Register("m");
  v1::DeleteNodeRequest r;
  r.set_name("nodes/m");
  v1::DeleteNodeResponse out;
  ASSERT_THAT(FromGrpc(stub_->DeleteNode(Ctx().get(), r, &out)), IsOk());
  v1::ListNodesResponse nodes;
  ASSERT_THAT(FromGrpc(stub_->ListNodes(Ctx().get(), v1::ListNodesRequest(), &nodes)), IsOk());
  ASSERT_EQ(nodes.nodes_size(), 1);
  EXPECT_EQ(nodes.nodes(0).name(), "n");
  EXPECT_EQ(sink_.nodes(), 1u);
  EXPECT_THAT(FromGrpc(stub_->DeleteNode(Ctx().get(), r, &out)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("node 'm' is not registered")));
  grpc::ClientContext anonymous;
  EXPECT_THAT(FromGrpc(stub_->DeleteNode(&anonymous, r, &out)),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
}

// A plan's device count is bounded (kMaxPlanDevices): a request listing
// more is INVALID_ARGUMENT, and a cluster with more live devices than that
// and no list is FAILED_PRECONDITION, before the cluster's n x n link
// tables are built (for 10,000 devices two 10,000 x 10,000 tables of
// doubles, 1.6 GB, in the calling thread and again on the worker) or
// anything is stored.
TEST_F(PlannerServiceImplTest, APlanOnMoreDevicesThanTheLimitIsRefused) {
  // Full nodes of kMaxDevicesPerNode devices and one more device.
  const int full = kMaxPlanDevices / kMaxDevicesPerNode;
  ASSERT_EQ(full * kMaxDevicesPerNode, kMaxPlanDevices);
  std::vector<std::string> nodes;
  for (int i = 0; i < full; ++i) nodes.push_back(absl::StrCat("big-", i));
  nodes.push_back("big-b");
  for (const std::string& name : nodes) {
    v1::RegisterNodeRequest r;
    *r.mutable_node() = TestNode(name);
    const v1::Device model = r.node().devices(0);
    r.mutable_node()->clear_devices();
    const int count = name == "big-b" ? 1 : kMaxDevicesPerNode;
    for (int i = 0; i < count; ++i) {
      v1::Device* d = r.mutable_node()->add_devices();
      *d = model;
      d->set_id(absl::StrCat(name, "/cpu", i));
    }
    v1::RegisterNodeResponse out;
    ASSERT_THAT(FromGrpc(stub_->RegisterNode(Ctx().get(), r, &out)), IsOk());
  }
  v1::CreatePlanRequest every = Mlp("every");
  every.set_wait(false);
  v1::Plan plan;
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), every, &plan)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(absl::StrCat(kMaxPlanDevices + 1, " live devices")),
                             HasSubstr(absl::StrCat(kMaxPlanDevices)), HasSubstr("devices"))));
  v1::CreatePlanRequest listed = Mlp("listed");
  listed.set_wait(false);
  for (int n = 0; n < full; ++n) {
    for (int i = 0; i < kMaxDevicesPerNode; ++i) {
      listed.add_devices(absl::StrCat("big-", n, "/cpu", i));
    }
  }
  listed.add_devices("big-b/cpu0");
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), listed, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(absl::StrCat("lists ", kMaxPlanDevices + 1)),
                             HasSubstr(absl::StrCat(kMaxPlanDevices)))));
  v1::ListPlansResponse plans;
  ASSERT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), v1::ListPlansRequest(), &plans)), IsOk());
  EXPECT_EQ(plans.plans_size(), 0);
}

// Names and ids of 10 KB (with a NUL, slashes, "..") get the status that
// names what is wrong, with a message short enough for a client to read:
// the messages quote what was sent.
TEST_F(PlannerServiceImplTest, OverlongNamesGetTheirOwnErrorsWithBoundedMessages) {
  Register("n");
  std::string huge = "../a/";
  huge.push_back('\0');
  huge += std::string(10 * 1024, 'x');
  using Code = absl::StatusCode;
  using Stub = v1::Planner::Stub;
  v1::RegisterNodeRequest node;
  *node.mutable_node() = TestNode("m");
  const std::vector<std::tuple<const char*, Code, std::function<grpc::Status()>>> calls = {
      {"CreatePlan", Code::kInvalidArgument,
       [&] { return Send(&Stub::CreatePlan, Mlp("x"), "plan_id", huge); }},
      {"GetPlan", Code::kInvalidArgument,
       [&] { return Send(&Stub::GetPlan, v1::GetPlanRequest(), "name", "plans/" + huge); }},
      {"GetDeployment", Code::kNotFound,
       [&] {
         return Send(&Stub::GetDeployment, v1::GetDeploymentRequest(), "name",
                     "deployments/" + huge);
       }},
      {"StopDeployment", Code::kNotFound,
       [&] { return Send(&Stub::StopDeployment, v1::StopDeploymentRequest(), "name", huge); }},
      {"ListStepMetrics", Code::kNotFound,
       [&] {
         return Send(&Stub::ListStepMetrics, v1::ListStepMetricsRequest(), "deployment", huge);
       }},
      {"DeleteNode", Code::kInvalidArgument,
       [&] { return Send(&Stub::DeleteNode, v1::DeleteNodeRequest(), "name", huge); }},
      {"RegisterNode", Code::kInvalidArgument,
       [&] {
         node.mutable_node()->set_name(huge);
         return Send(&Stub::RegisterNode, node, "", "");
       }},
      {"ReportLinks", Code::kNotFound,
       [&] { return Send(&Stub::ReportLinks, v1::ReportLinksRequest(), "node", huge); }},
      {"GetJob", Code::kInvalidArgument,
       [&] { return Send(&Stub::GetJob, v1::GetJobRequest(), "name", "jobs/" + huge); }},
      {"GetProbeAssignments", Code::kNotFound,
       [&] {
         return Send(&Stub::GetProbeAssignments, v1::GetProbeAssignmentsRequest(), "node", huge);
       }},
  };
  for (const auto& [rpc, code, call] : calls) {
    const grpc::Status s = call();
    EXPECT_EQ(static_cast<int>(s.error_code()), static_cast<int>(code))
        << rpc << ": " << s.error_code() << " " << s.error_message().substr(0, 200);
    EXPECT_LE(s.error_message().size(), 4096u) << rpc;
  }
}

// A page token is good only for the list that returned it: one from
// another list (whose keys sort elsewhere) is INVALID_ARGUMENT, not a page
// that silently skips items or comes back empty.
TEST_F(PlannerServiceImplTest, APageTokenFromAnotherListIsRefused) {
  Register("m");
  Register("n");
  for (const char* id : {"a", "b"}) {
    v1::Plan plan;
    ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), Mlp(id), &plan)), IsOk());
  }
  v1::ListNodesRequest nodes_request;
  nodes_request.set_page_size(1);
  v1::ListNodesResponse nodes;
  ASSERT_THAT(FromGrpc(stub_->ListNodes(Ctx().get(), nodes_request, &nodes)), IsOk());
  ASSERT_FALSE(nodes.next_page_token().empty());
  v1::ListPlansRequest plans_request;
  plans_request.set_page_size(1);
  v1::ListPlansResponse plans;
  ASSERT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), plans_request, &plans)), IsOk());
  ASSERT_FALSE(plans.next_page_token().empty());

  plans_request.set_page_token(nodes.next_page_token());
  EXPECT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), plans_request, &plans)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  nodes_request.set_page_token(plans.next_page_token());
  EXPECT_THAT(FromGrpc(stub_->ListNodes(Ctx().get(), nodes_request, &nodes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  v1::ListDeploymentsRequest deployments_request;
  deployments_request.set_page_token(plans.next_page_token());
  v1::ListDeploymentsResponse deployments;
  EXPECT_THAT(FromGrpc(stub_->ListDeployments(Ctx().get(), deployments_request, &deployments)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  v1::ListJobsRequest jobs_request;
  jobs_request.set_page_token(plans.next_page_token());
  v1::ListJobsResponse jobs;
  EXPECT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), jobs_request, &jobs)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));

  // Each list's own token still pages on.
  plans_request.set_page_token(plans.next_page_token());
  ASSERT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), plans_request, &plans)), IsOk());
  ASSERT_EQ(plans.plans_size(), 1);
  EXPECT_EQ(plans.plans(0).name(), "plans/b");
}

// GetPlan and ListPlans answer with bytes serialized once per plan
// snapshot: what a client parses equals the core's messages, views and
// pages (with their next-page tokens) included; a request that is not the
// method's message is INVALID_ARGUMENT naming its type, and a caller
// without the token is refused before anything is read.
TEST_F(PlannerServiceImplTest, PlanReadsInWireFormAreTheCoresMessages) {
  Register("n");
  for (const char* id : {"a", "b", "c"}) {
    v1::Plan plan;
    ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), Mlp(id), &plan)), IsOk());
  }
  using google::protobuf::util::MessageDifferencer;
  for (auto view : {v1::GetPlanRequest::VIEW_UNSPECIFIED, v1::GetPlanRequest::BASIC,
                    v1::GetPlanRequest::FULL}) {
    const bool full = view == v1::GetPlanRequest::FULL;
    for (const char* name : {"plans/a", "plans/b", "plans/c"}) {
      v1::GetPlanRequest g;
      g.set_name(name);
      g.set_view(view);
      v1::Plan got;
      ASSERT_THAT(FromGrpc(stub_->GetPlan(Ctx().get(), g, &got)), IsOk());
      auto want = core_->GetPlan(name, full);
      ASSERT_THAT(want, IsOk());
      EXPECT_TRUE(MessageDifferencer::Equals(got, *want)) << name << " view " << view;
    }
    v1::ListPlansRequest lp;
    lp.set_page_size(2);
    lp.set_view(view);
    std::vector<std::string> names;
    for (int page = 0; page < 3; ++page) {
      v1::ListPlansResponse got;
      ASSERT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), lp, &got)), IsOk());
      auto want = core_->ListPlans(2, lp.page_token(), full);
      ASSERT_THAT(want, IsOk());
      EXPECT_TRUE(MessageDifferencer::Equals(got, *want)) << "page " << page << " view " << view;
      for (const auto& p : got.plans()) names.push_back(p.name());
      if (got.next_page_token().empty()) break;
      lp.set_page_token(got.next_page_token());
    }
    EXPECT_EQ(names, (std::vector<std::string>{"plans/a", "plans/b", "plans/c"}));
  }

  // Bytes that are not a GetPlanRequest / ListPlansRequest.
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_), {});
  ASSERT_THAT(channel, IsOk());
  auto raw_call = [&](const std::string& method, const std::string& bytes, bool token) {
    return testing::RawCall(*channel, method, bytes,
                            token ? std::vector<std::string>{absl::StrCat("Bearer ", kToken)}
                                  : std::vector<std::string>{});
  };
  const std::string garbage = "\xff\xff\xff\xff";
  EXPECT_THAT(raw_call("/hap.v1.Planner/GetPlan", garbage, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a valid hap.v1.GetPlanRequest")));
  EXPECT_THAT(raw_call("/hap.v1.Planner/ListPlans", garbage, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a valid hap.v1.ListPlansRequest")));
  EXPECT_THAT(raw_call("/hap.v1.Planner/GetPlan", garbage, false),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  v1::GetPlanRequest gone;
  gone.set_name("plans/none");
  EXPECT_THAT(raw_call("/hap.v1.Planner/GetPlan", gone.SerializeAsString(), true),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/none does not exist")));
}

// Every method of hap.v1.Planner, the streaming watches and the rendezvous
// store included, refuses a caller without the token or with a wrong one in
// its own handler (this server has no gRPC auth filter in front).
TEST_F(PlannerServiceImplTest, EveryPlannerMethodRefusesCallsWithoutTheToken) {
  Register("n");
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_), {});
  ASSERT_THAT(channel, IsOk());
  const auto* service = v1::CreatePlanRequest::descriptor()->file()->FindServiceByName("Planner");
  ASSERT_NE(service, nullptr);
  EXPECT_THAT(testing::CallsNotRefused(*channel, *service, kToken), ::testing::IsEmpty());
  EXPECT_EQ(sink_.nodes(), 1u);
}

TEST_F(PlannerServiceImplTest, AResultTheStoreRefusesFailsCreatePlan) {
  Register("n");
  sink_.RefusePlans(v1::Plan::SUCCEEDED);
  v1::Plan plan;
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), Mlp("unsaved"), &plan)),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("could not be saved"), HasSubstr("disk is full"))));
  v1::GetPlanRequest g;
  g.set_name("plans/unsaved");
  ASSERT_THAT(FromGrpc(stub_->GetPlan(Ctx().get(), g, &plan)), IsOk());
  EXPECT_EQ(plan.state(), v1::Plan::FAILED);
}

TEST_F(PlannerServiceImplTest, ADeploymentTheStoreRefusesIsNotCreated) {
  Register("n");
  sink_.RefuseDeploymentsAfter(0);
  EXPECT_THAT(Deploy("p"), StatusIs(absl::StatusCode::kUnavailable,
                                    AllOf(HasSubstr("deployments/p-g1 was not created"),
                                          HasSubstr("disk is full"))));
  v1::ListDeploymentsResponse list;
  ASSERT_THAT(FromGrpc(stub_->ListDeployments(Ctx().get(), v1::ListDeploymentsRequest(), &list)),
              IsOk());
  EXPECT_EQ(list.deployments_size(), 0);
  // The generation was not used up.
  sink_.RefuseDeploymentsAfter(-1);
  v1::DeployPlanRequest again;
  again.set_plan("plans/p");
  (*again.mutable_executors())["n/cpu0"] = "127.0.0.1:1";
  (*again.mutable_executors())["n/cpu1"] = "127.0.0.1:2";
  v1::Deployment d;
  ASSERT_THAT(FromGrpc(stub_->DeployPlan(Ctx().get(), again, &d)), IsOk());
  EXPECT_EQ(d.name(), "deployments/p-g1");
}

TEST_F(PlannerServiceImplTest, AStateChangeTheStoreRefusesIsNotedOnTheDeployment) {
  Register("n");
  sink_.RefuseDeploymentsAfter(1);  // PENDING is saved, FAILED is not
  auto d = Deploy("p");
  ASSERT_THAT(d, IsOk());
  v1::Deployment settled = Settled(d->name());
  ASSERT_EQ(settled.state(), v1::Deployment::FAILED);
  EXPECT_THAT(settled.error(), AllOf(HasSubstr("LoadPlan on rank 0"),
                                     HasSubstr("could not save this deployment as FAILED"),
                                     HasSubstr("disk is full")));
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::PENDING);
}

// A plan a deployment was made from is not deleted under it (the
// deployment would name a plan that is gone, or, once the id is used
// again, another plan): FAILED_PRECONDITION naming the deployment, until
// the deployment is deleted.
TEST_F(PlannerServiceImplTest, APlanADeploymentUsesIsNotDeleted) {
  Register("n");
  auto d = Deploy("p");
  ASSERT_THAT(d, IsOk());
  Settled(d->name());
  v1::DeletePlanRequest del;
  del.set_name("plans/p");
  v1::DeletePlanResponse out;
  EXPECT_THAT(FromGrpc(stub_->DeletePlan(Ctx().get(), del, &out)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(d->name())));
  using Stub = v1::Planner::Stub;
  EXPECT_THAT(FromGrpc(Send(&Stub::GetPlan, v1::GetPlanRequest(), "name", "plans/p")), IsOk());
  ASSERT_THAT(
      FromGrpc(Send(&Stub::DeleteDeployment, v1::DeleteDeploymentRequest(), "name", d->name())),
      IsOk());
  EXPECT_THAT(FromGrpc(stub_->DeletePlan(Ctx().get(), del, &out)), IsOk());
}

// A deploy holds its plan against retention only until the deployment
// exists (which then keeps it): a deployed plan was held for as long as
// the planner ran, so once its deployment was deleted plan retention still
// never deleted it.
TEST_F(PlannerServiceImplTest, ADeployedPlanIsFreeForRetentionOnceItsDeploymentIsDeleted) {
  StopService();
  PlannerCoreOptions co;
  co.sink = &sink_;
  co.heartbeat_interval = absl::Hours(1);
  co.plan_retention_count = 1;
  co.plans_in_use = [this]() -> absl::StatusOr<std::set<std::string>> {
    // (Every plan is final before the service stops: no pass runs then.)
    std::set<std::string> plans;
    for (const v1::Deployment& d : service_->Deployments()) plans.insert(d.plan());
    return plans;
  };
  auto core = PlannerCore::Create(co);
  ASSERT_TRUE(core.ok()) << core.status();
  core_ = *std::move(core);
  StartService({});
  Register("n");
  auto d = Deploy("p");
  ASSERT_THAT(d, IsOk());
  Settled(d->name());
  v1::Plan q;
  v1::CreatePlanRequest other = Mlp("q");
  (*other.mutable_model()->mutable_zoo()->mutable_params())["hidden"] = 48;
  ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), other, &q)), IsOk());
  ASSERT_THAT(core_->EnforceRetention(), IsOk());
  using Stub = v1::Planner::Stub;
  EXPECT_THAT(FromGrpc(Send(&Stub::GetPlan, v1::GetPlanRequest(), "name", "plans/p")), IsOk())
      << "its deployment exists";
  ASSERT_THAT(
      FromGrpc(Send(&Stub::DeleteDeployment, v1::DeleteDeploymentRequest(), "name", d->name())),
      IsOk());
  absl::StatusOr<int> deleted = core_->EnforceRetention();
  ASSERT_THAT(deleted.status(), IsOk());
  EXPECT_EQ(*deleted, 1);
  EXPECT_THAT(FromGrpc(Send(&Stub::GetPlan, v1::GetPlanRequest(), "name", "plans/p")),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(PlannerServiceImplTest, StepMetricsTheStoreRefusesAreNotKept) {
  Register("n");
  auto d = Deploy("p");
  ASSERT_THAT(d, IsOk());
  sink_.RefuseMetrics(true);
  v1::ReportStepMetricsRequest r;
  v1::StepMetric* m = r.add_metrics();
  m->set_deployment(d->name());
  m->set_rank(0);
  m->set_step(0);
  m->set_loss(2.5);
  v1::ReportStepMetricsResponse out;
  EXPECT_THAT(FromGrpc(stub_->ReportStepMetrics(Ctx().get(), r, &out)),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("step metrics not saved"), HasSubstr("disk is full"))));
  v1::ListStepMetricsRequest lr;
  lr.set_deployment(d->name());
  v1::ListStepMetricsResponse list;
  ASSERT_THAT(FromGrpc(stub_->ListStepMetrics(Ctx().get(), lr, &list)), IsOk());
  EXPECT_EQ(list.metrics_size(), 0);
  v1::GetDeploymentRequest g;
  g.set_name(d->name());
  v1::Deployment got;
  ASSERT_THAT(FromGrpc(stub_->GetDeployment(Ctx().get(), g, &got)), IsOk());
  EXPECT_EQ(got.steps_completed(), 0);
}

TEST_F(PlannerServiceImplTest, RendezvousKeysBelongToADeploymentThatExists) {
  Register("n");
  // The rendezvous is open while the deployment runs (fake executors).
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  v1::StoreSetRequest set;
  set.set_deployment("deployments/ghost-g1");
  set.set_generation(1);
  set.set_key("k");
  set.set_value("v");
  v1::StoreSetResponse set_out;
  EXPECT_THAT(FromGrpc(stub_->StoreSet(Ctx().get(), set, &set_out)),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("deployment 'deployments/ghost-g1' does not exist")));
  v1::StoreAddRequest add;
  add.set_deployment("deployments/ghost-g1");
  add.set_generation(1);
  add.set_key("n");
  add.set_delta(1);
  v1::StoreAddResponse add_out;
  EXPECT_THAT(FromGrpc(stub_->StoreAdd(Ctx().get(), add, &add_out)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("deployments/ghost-g1")));
  v1::StoreGetRequest get;
  get.set_deployment("deployments/ghost-g1");
  get.set_generation(1);
  get.add_keys("k");
  v1::StoreGetResponse get_out;
  EXPECT_THAT(FromGrpc(stub_->StoreGet(Ctx().get(), get, &get_out)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("deployments/ghost-g1")));
  // Another generation of a deployment that exists.
  set.set_deployment(d->name());
  set.set_generation(7);
  EXPECT_THAT(FromGrpc(stub_->StoreSet(Ctx().get(), set, &set_out)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("'deployments/p-g1' is generation 1, not 7")));
  // Its own generation.
  set.set_generation(1);
  ASSERT_THAT(FromGrpc(stub_->StoreSet(Ctx().get(), set, &set_out)), IsOk());
  get.set_deployment(d->name());
  ASSERT_THAT(FromGrpc(stub_->StoreGet(Ctx().get(), get, &get_out)), IsOk());
  ASSERT_EQ(get_out.values_size(), 1);
  EXPECT_EQ(get_out.values(0), "v");
  // A stopped deployment's rendezvous is closed (its keys were dropped).
  ASSERT_THAT(Stop(d->name()), IsOk());
  EXPECT_THAT(FromGrpc(stub_->StoreGet(Ctx().get(), get, &get_out)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("'deployments/p-g1' is STOPPED: its rendezvous is closed")));
  EXPECT_THAT(FromGrpc(stub_->StoreSet(Ctx().get(), set, &set_out)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("STOPPED")));
}

// Reads take no thread: with every thread of the server's quota held by
// rendezvous waits (more waits than threads: the surplus is refused with
// RESOURCE_EXHAUSTED, not queued), GetPlan, ListPlans, ListNodes,
// GetCluster, GetDeployment and ListDeployments are still answered.
TEST_F(PlannerServiceImplTest, ReadsAreAnsweredWhileEveryThreadIsBusy) {
  Register("n");
  // The rendezvous is open while the deployment runs (fake executors; a
  // restart re-attaches it once RUNNING).
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  StopService();
  StartService(sink_.deployments(), /*max_threads=*/4);

  constexpr int kWaits = 12;
  struct Wait {
    grpc::ClientContext ctx;
    v1::StoreGetRequest request;
    v1::StoreGetResponse response;
  };
  std::vector<std::unique_ptr<Wait>> waits;
  absl::Mutex mu;
  std::vector<grpc::StatusCode> codes;
  for (int i = 0; i < kWaits; ++i) {
    auto w = std::make_unique<Wait>();
    Security s;
    s.token = kToken;
    PrepareClientContext(&w->ctx, s, absl::Seconds(30));
    w->request.set_deployment(d->name());
    w->request.set_generation(1);
    w->request.add_keys("never-set");
    w->request.mutable_timeout()->set_seconds(20);
    stub_->async()->StoreGet(&w->ctx, &w->request, &w->response, [&](grpc::Status st) {
      absl::MutexLock l(&mu);
      codes.push_back(st.error_code());
    });
    waits.push_back(std::move(w));
  }
  // The quota is full once a wait is refused.
  {
    absl::MutexLock l(&mu);
    auto refused = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return std::count(codes.begin(), codes.end(), grpc::StatusCode::RESOURCE_EXHAUSTED) > 0;
    };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&refused), absl::Seconds(20)))
        << "no wait was refused: the thread quota does not bound blocking calls; codes: "
        << absl::StrJoin(codes, ",", [](std::string* out, grpc::StatusCode c) {
             absl::StrAppend(out, static_cast<int>(c));
           });
    EXPECT_LT(codes.size(), static_cast<size_t>(kWaits)) << "no wait is holding a thread";
  }
  for (int i = 0; i < 50; ++i) {
    v1::GetPlanRequest g;
    g.set_name("plans/p");
    v1::Plan plan;
    ASSERT_THAT(FromGrpc(stub_->GetPlan(Ctx().get(), g, &plan)), IsOk()) << "call " << i;
    EXPECT_EQ(plan.name(), "plans/p");
    v1::ListPlansRequest lp;
    v1::ListPlansResponse plans;
    ASSERT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), lp, &plans)), IsOk());
    EXPECT_EQ(plans.plans_size(), 1);
    v1::ListNodesRequest ln;
    v1::ListNodesResponse nodes;
    ASSERT_THAT(FromGrpc(stub_->ListNodes(Ctx().get(), ln, &nodes)), IsOk());
    v1::GetClusterRequest gc;
    v1::Cluster cluster;
    ASSERT_THAT(FromGrpc(stub_->GetCluster(Ctx().get(), gc, &cluster)), IsOk());
    v1::GetDeploymentRequest gd;
    gd.set_name(d->name());
    v1::Deployment dep;
    ASSERT_THAT(FromGrpc(stub_->GetDeployment(Ctx().get(), gd, &dep)), IsOk());
    v1::ListDeploymentsRequest ld;
    v1::ListDeploymentsResponse deps;
    ASSERT_THAT(FromGrpc(stub_->ListDeployments(Ctx().get(), ld, &deps)), IsOk());
  }
  // A blocking method meanwhile has no thread (what every read got before
  // reads moved to the callback API).
  {
    v1::StoreSetRequest set;
    set.set_deployment(d->name());
    set.set_generation(1);
    set.set_key("k");
    set.set_value("v");
    v1::StoreSetResponse out;
    EXPECT_EQ(stub_->StoreSet(Ctx().get(), set, &out).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // A read without the token is still refused on the callback path.
  {
    grpc::ClientContext c;
    v1::GetPlanRequest g;
    g.set_name("plans/p");
    v1::Plan plan;
    EXPECT_EQ(stub_->GetPlan(&c, g, &plan).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  for (auto& w : waits) w->ctx.TryCancel();
  absl::MutexLock l(&mu);
  auto all = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return codes.size() == kWaits; };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(30)));
}

TEST_F(PlannerServiceImplTest, StoreAddDoesNotWrapAround) {
  Register("n");
  // The rendezvous is open while the deployment runs (fake executors).
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  auto add = [&](const std::string& key, int64_t delta) -> absl::StatusOr<int64_t> {
    v1::StoreAddRequest r;
    r.set_deployment(d->name());
    r.set_generation(1);
    r.set_key(key);
    r.set_delta(delta);
    v1::StoreAddResponse out;
    absl::Status s = FromGrpc(stub_->StoreAdd(Ctx().get(), r, &out));
    if (!s.ok()) return s;
    return out.value();
  };
  ASSERT_EQ(*add("up", kMax), kMax);
  EXPECT_THAT(add("up", 1),
              StatusIs(absl::StatusCode::kOutOfRange,
                       AllOf(HasSubstr("key 'up' holds 9223372036854775807"),
                             HasSubstr("overflows"))));
  EXPECT_EQ(*add("up", 0), kMax);  // left as it was
  ASSERT_EQ(*add("down", kMin), kMin);
  EXPECT_THAT(add("down", -1), StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("overflows")));
  EXPECT_EQ(*add("down", 1), kMin + 1);
}

// SIGSTOP: a frozen executor is noticed within missed_status_limit polls
// (not a 30 s call deadline); the deployment fails and the other rank is
// stopped.
TEST_F(PlannerServiceImplTest, AFrozenExecutorFailsItsDeploymentAndTheOtherRankIsStopped) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  const absl::Time frozen = absl::Now();
  executors_[1]->Freeze(true);
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_LT(FailedAt(d->name()) - frozen, absl::Seconds(3));
  EXPECT_THAT(failed.error(),
              AllOf(HasSubstr("rank 1 (n/cpu1 at " + executors_[1]->address() + ")"),
                    HasSubstr("did not answer 3 status polls in a row")));
  ASSERT_TRUE(executors_[0]->WaitForStops(1));
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);
  EXPECT_EQ(executors_[0]->status().error(), "stopped by StopTraining");
  // Thawed, the frozen rank is stopped too when asked again.
  executors_[1]->Freeze(false);
  ASSERT_THAT(Stop(d->name()), IsOk());
  EXPECT_EQ(executors_[1]->status().state(), v1::ExecutorStatus::FAILED);
}

// SIGKILL: connections refused; the survivor is stopped, and a new
// deployment of the plan to it (and a replacement) works with no manual stop.
TEST_F(PlannerServiceImplTest, AKilledExecutorFailsItsDeploymentAndANewOneWorks) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  executors_[1]->Kill();
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 1 (n/cpu1 at " + executors_[1]->address()));
  ASSERT_TRUE(executors_[0]->WaitForStops(1));
  EXPECT_NE(executors_[0]->status().state(), v1::ExecutorStatus::TRAINING);

  executors_[1] = std::make_unique<FakeExecutor>();  // the replacement
  auto again = DeployToFakes("p");
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->name(), "deployments/p-g2");
  WaitForState(again->name(), v1::Deployment::RUNNING);
  EXPECT_EQ(executors_[0]->status().deployment(), "deployments/p-g2");
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::TRAINING);
}

// A rank that reports FAILED fails the deployment and the other is stopped;
// StopDeployment on the FAILED deployment tells every rank again
// (idempotent), stopping one still training it.
TEST_F(PlannerServiceImplTest, StopDeploymentOnAFailedDeploymentStopsRanksStillTraining) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  executors_[1]->Set(v1::ExecutorStatus::FAILED, "out of memory");
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 1 (n/cpu1 at " + executors_[1]->address() +
                                        ") failed: out of memory"));
  ASSERT_TRUE(executors_[0]->WaitForStops(1));
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);

  // Say rank 0 never got that stop and trains on.
  executors_[0]->Set(v1::ExecutorStatus::TRAINING);
  auto stopped = Stop(d->name());
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::FAILED);
  EXPECT_EQ(executors_[0]->stops(), 2);
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);
  // A rank that cannot be reached is named, and the call can be retried.
  executors_[0]->Set(v1::ExecutorStatus::TRAINING);
  executors_[1]->Kill();
  EXPECT_THAT(Stop(d->name()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr(d->name() + " is FAILED; its ranks were told to stop"),
                             HasSubstr("not confirmed stopped after 1 attempt: rank 1"))));
  EXPECT_EQ(executors_[0]->status().state(), v1::ExecutorStatus::FAILED);
}

TEST_F(PlannerServiceImplTest, StopDeploymentStopsEveryRankThenSaysStopped) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  auto stopped = Stop(d->name());
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  for (auto& e : executors_) {
    EXPECT_EQ(e->stops(), 1);
    EXPECT_EQ(e->status().state(), v1::ExecutorStatus::FAILED);
  }
  EXPECT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::STOPPED);
}

// A heartbeat tells the agent whether a deployment not finished runs on its
// node (HeartbeatResponse.training): it pauses drift checks and link
// re-probes meanwhile, which beside the job read its load as the device's.
TEST_F(PlannerServiceImplTest, HeartbeatsSayWhetherADeploymentRunsOnTheNode) {
  Register("n");
  auto beat = [&](const std::string& node) {
    v1::HeartbeatRequest r;
    r.set_name("nodes/" + node);
    v1::HeartbeatResponse out;
    EXPECT_THAT(FromGrpc(stub_->Heartbeat(Ctx().get(), r, &out)), IsOk());
    return out.training();
  };
  EXPECT_FALSE(beat("n"));
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  Register("other");  // after the plan: it is on n's devices only
  EXPECT_TRUE(beat("n"));
  EXPECT_FALSE(beat("other"));
  ASSERT_THAT(Stop(d->name()), IsOk());
  EXPECT_FALSE(beat("n"));
}

// The planner restarts (shut down, a new service from the saved state) while
// a deployment runs: its executors train on meanwhile; the new planner
// re-attaches, and StopDeployment stops them.
TEST_F(PlannerServiceImplTest, ARestartedPlannerReattachesAndStopDeploymentStopsTheRanks) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  StopService();
  for (auto& e : executors_) {
    EXPECT_EQ(e->stops(), 0);
    EXPECT_EQ(e->status().state(), v1::ExecutorStatus::TRAINING);
  }
  ASSERT_EQ(sink_.deployment(d->name()).state(), v1::Deployment::RUNNING);
  StartService(sink_.deployments());
  auto stopped = Stop(d->name());
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->state(), v1::Deployment::STOPPED);
  for (auto& e : executors_) {
    EXPECT_EQ(e->stops(), 1);
    EXPECT_EQ(e->status().state(), v1::ExecutorStatus::FAILED);
  }
}

// ... and one whose executor died while the planner was away is failed on
// re-attaching, the other rank stopped.
TEST_F(PlannerServiceImplTest, ARestartedPlannerFailsADeploymentWhoseRankIsGone) {
  Register("n");
  auto d = DeployToFakes("p");
  ASSERT_THAT(d, IsOk());
  WaitForState(d->name(), v1::Deployment::RUNNING);
  StopService();
  executors_[0]->Kill();
  StartService(sink_.deployments());
  v1::Deployment failed = WaitForState(d->name(), v1::Deployment::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("rank 0 (n/cpu0 at " + executors_[0]->address()));
  ASSERT_TRUE(executors_[1]->WaitForStops(1));
  EXPECT_EQ(executors_[1]->status().state(), v1::ExecutorStatus::FAILED);
}

// --------------------------------------------------------------- jobs --

class JobTest : public PlannerServiceImplTest {
 protected:
  // Nodes "a" and "b", two devices each, at four fake executors (a's named
  // by its node's labels, b's by the job's spec); a checkpoint directory with
  // step 5 committed and step 10 cut short.
  void SetUp() override {
    PlannerServiceImplTest::SetUp();
    for (int i = 0; i < 4; ++i) executors_.push_back(std::make_unique<FakeExecutor>());
    for (int n = 0; n < 2; ++n) {
      v1::RegisterNodeRequest r;
      *r.mutable_node() = TestNode(n == 0 ? "a" : "b");
      for (int i = 0; n == 0 && i < 2; ++i) {  // node b's executors: in the job's spec
        (*r.mutable_node()->mutable_labels())[absl::StrCat(
            "hap.executor/", r.node().devices(i).id())] = executors_[i]->address();
      }
      v1::RegisterNodeResponse out;
      ASSERT_THAT(FromGrpc(stub_->RegisterNode(Ctx().get(), r, &out)), IsOk());
    }
    dir_ = std::filesystem::path(::testing::TempDir()) / "job-checkpoints";
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "step-00000005");
    std::ofstream(dir_ / "step-00000005" / "COMMITTED") << "";
    std::filesystem::create_directories(dir_ / "step-00000010");  // no COMMITTED
  }
  void TearDown() override {
    PlannerServiceImplTest::TearDown();
    std::filesystem::remove_all(dir_);
  }

  v1::CreateJobRequest JobRequest() {
    v1::CreateJobRequest r;
    r.set_job_id("train");
    *r.mutable_spec()->mutable_model() = Mlp("unused").model();
    r.mutable_spec()->mutable_training()->set_steps(50);
    r.mutable_spec()->mutable_training()->set_checkpoint_dir(dir_.string());
    r.mutable_spec()->mutable_training()->set_checkpoint_every(5);
    // The lost executor's device stays out for the whole test.
    r.mutable_spec()->mutable_replan()->mutable_join_stable()->set_seconds(600);
    (*r.mutable_spec()->mutable_executors())["b/cpu0"] = executors_[2]->address();
    (*r.mutable_spec()->mutable_executors())["b/cpu1"] = executors_[3]->address();
    return r;
  }

  // Follows WatchJob until `done` holds for the job; the job then.
  v1::Job WatchUntil(const std::function<bool(const v1::Job&)>& done) {
    grpc::ClientContext ctx;
    Security s;
    s.token = kToken;
    PrepareClientContext(&ctx, s, absl::Seconds(60));
    v1::WatchJobRequest r;
    r.set_name("jobs/train");
    auto reader = stub_->WatchJob(&ctx, r);
    v1::Job j;
    while (reader->Read(&j)) {
      if (done(j)) {
        ctx.TryCancel();
        break;
      }
    }
    reader->Finish();
    EXPECT_TRUE(done(j)) << j.DebugString();
    return j;
  }

  std::filesystem::path dir_;
};

TEST_F(JobTest, ALostExecutorIsReplannedAroundAndTheJobSucceeds) {
  v1::Job job;
  ASSERT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), JobRequest(), &job)), IsOk());
  EXPECT_EQ(job.name(), "jobs/train");
  EXPECT_EQ(job.status().state(), v1::JobStatus::PENDING);
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::RUNNING; });
  EXPECT_EQ(job.status().devices_size(), 4);
  EXPECT_EQ(job.status().generation(), 1);
  // Step 5 is the latest complete checkpoint (step 10 was cut short).
  EXPECT_EQ(executors_[0]->last_resume(), (dir_ / "step-00000005").string());

  executors_[3]->Kill();  // b/cpu1's executor dies; node b stays READY
  job = WatchUntil([](const v1::Job& j) {
    return j.status().state() == v1::JobStatus::RUNNING && j.status().generation() == 2;
  });
  EXPECT_THAT(job.status().devices(), ::testing::ElementsAre("a/cpu0", "a/cpu1", "b/cpu0"));
  ASSERT_EQ(job.status().events_size(), 2);
  const v1::JobEvent& e = job.status().events(1);
  EXPECT_EQ(e.reason(), v1::JobEvent::EXECUTOR_LOST);
  EXPECT_THAT(e.detail(), HasSubstr("rank 3 (b/cpu1 at " + executors_[3]->address()));
  EXPECT_EQ(e.resume_step(), 5);
  EXPECT_GE(e.downtime_seconds(), 0);
  EXPECT_EQ(e.devices_before_size(), 4);
  EXPECT_EQ(job.status().replans(), 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(executors_[i]->status().deployment(), job.status().deployment());
    EXPECT_EQ(executors_[i]->status().state(), v1::ExecutorStatus::TRAINING);
  }

  for (int i = 0; i < 3; ++i) executors_[i]->Set(v1::ExecutorStatus::FINISHED);
  job = WatchUntil(
      [](const v1::Job& j) { return j.status().state() == v1::JobStatus::SUCCEEDED; });
  EXPECT_EQ(job.status().steps_done(), 50);

  v1::ListJobsResponse list;
  ASSERT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list)), IsOk());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).status().state(), v1::JobStatus::SUCCEEDED);
  v1::StopJobRequest stop;
  stop.set_name("jobs/train");
  ASSERT_THAT(FromGrpc(stub_->StopJob(Ctx().get(), stop, &job)), IsOk());
  EXPECT_EQ(job.status().state(), v1::JobStatus::SUCCEEDED);  // final: as it is
}

TEST_F(JobTest, ErrorsAreStatusesNamingWhatIsWrong) {
  v1::Job job;
  v1::GetJobRequest get;
  get.set_name("jobs/none");
  EXPECT_THAT(FromGrpc(stub_->GetJob(Ctx().get(), get, &job)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("jobs/none")));
  get.set_name("train");
  EXPECT_THAT(FromGrpc(stub_->GetJob(Ctx().get(), get, &job)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("jobs/{id}")));
  v1::CreateJobRequest r = JobRequest();
  r.mutable_spec()->mutable_training()->clear_checkpoint_dir();
  EXPECT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), r, &job)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("checkpoint_dir")));
  grpc::ClientContext no_token;
  EXPECT_THAT(FromGrpc(stub_->CreateJob(&no_token, JobRequest(), &job)),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  v1::ListJobsRequest bad;
  bad.set_page_token("garbage");
  v1::ListJobsResponse list;
  EXPECT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), bad, &list)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
}

// A spec the job could never run is refused by CreateJob, naming the
// field, and no job is kept: before, a NaN slowdown threshold was taken as
// the default, and a model, plan options, thread counts or a data source
// no plan or executor takes made a job that failed (or re-planned) later.
TEST_F(JobTest, CreateJobRefusesASpecNoPlanOrDeploymentTakes) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::pair<std::string, std::function<void(v1::JobSpec*)>>> bad = {
      {"spec.replan.slowdown_threshold",
       [&](v1::JobSpec* s) { s->mutable_replan()->set_slowdown_threshold(nan); }},
      {"spec.replan.slowdown_threshold",
       [&](v1::JobSpec* s) { s->mutable_replan()->set_slowdown_threshold(-1); }},
      {"spec.replan.slowdown_threshold",
       [&](v1::JobSpec* s) { s->mutable_replan()->set_slowdown_threshold(inf); }},
      {"spec.replan.join_stable",
       [](v1::JobSpec* s) { s->mutable_replan()->mutable_join_stable()->set_nanos(2000000000); }},
      {"spec: options.optimizer.learning_rate",
       [&](v1::JobSpec* s) { s->mutable_options()->mutable_optimizer()->set_learning_rate(nan); }},
      {"spec: options.budget.max_seconds",
       [](v1::JobSpec* s) { s->mutable_options()->mutable_budget()->set_max_seconds(-1); }},
      {"spec: training.threads_per_rank",
       [](v1::JobSpec* s) { s->mutable_training()->set_threads_per_rank(1 << 30); }},
      {"spec.model.zoo",
       [](v1::JobSpec* s) { s->mutable_model()->mutable_zoo()->set_name("nope"); }},
      {"spec.model.zoo",
       [](v1::JobSpec* s) { (*s->mutable_model()->mutable_zoo()->mutable_params())["zzz"] = 1; }},
      {"spec.model.zoo",
       [&](v1::JobSpec* s) {
         (*s->mutable_model()->mutable_zoo()->mutable_params())["layers"] = nan;
       }},
      {"spec.model.graph",
       [](v1::JobSpec* s) { s->mutable_model()->mutable_graph()->add_ops()->set_name("x"); }},
      {"spec: training.data",
       [](v1::JobSpec* s) {
         s->mutable_training()->set_data(static_cast<v1::TrainingConfig::DataSource>(99));
       }},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const auto& [field, edit] = bad[i];
    v1::CreateJobRequest r = JobRequest();
    r.set_job_id(absl::StrCat("bad-", i));
    r.mutable_spec()->mutable_training()->set_checkpoint_dir((dir_ / r.job_id()).string());
    edit(r.mutable_spec());
    v1::Job job;
    EXPECT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), r, &job)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)))
        << r.spec().DebugString();
  }
  v1::ListJobsResponse jobs;
  ASSERT_THAT(FromGrpc(stub_->ListJobs(Ctx().get(), v1::ListJobsRequest(), &jobs)), IsOk());
  EXPECT_EQ(jobs.jobs_size(), 0);
  EXPECT_TRUE(sink_.jobs().empty());
}

TEST_F(JobTest, ARestartedPlannerGoesOnWithTheJobAndStopJobStopsIt) {
  v1::Job job;
  ASSERT_THAT(FromGrpc(stub_->CreateJob(Ctx().get(), JobRequest(), &job)), IsOk());
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::RUNNING; });
  const std::string deployment = job.status().deployment();
  StopService();  // the executors go on training
  StartService(sink_.deployments(), 0, sink_.jobs());
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::RUNNING; });
  EXPECT_EQ(job.status().deployment(), deployment);  // re-attached, not redeployed
  EXPECT_EQ(job.status().generation(), 1);
  v1::StopJobRequest stop;
  stop.set_name("jobs/train");
  ASSERT_THAT(FromGrpc(stub_->StopJob(Ctx().get(), stop, &job)), IsOk());
  EXPECT_TRUE(job.status().stop_requested());
  job = WatchUntil([](const v1::Job& j) { return j.status().state() == v1::JobStatus::STOPPED; });
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(executors_[i]->status().state(), v1::ExecutorStatus::TRAINING) << i;
  }
}

}  // namespace
}  // namespace hap::service
