// hap.v1.Planner in process on 127.0.0.1:0, over a sink that refuses
// writes on demand (a full disk): RPCs fail with the store's error and leave
// nothing behind; node removal; the rendezvous store only for deployments
// that exist, with counters that do not wrap.
#include "planner/service/grpc/planner_service_impl.h"

#include <cstdint>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/grpc/grpc_util.h"
#include "planner/util/status_matchers.h"

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

 private:
  absl::Mutex mu_;
  std::map<std::string, v1::Node> nodes_;
  std::map<std::string, v1::Deployment> deployments_;
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

class PlannerServiceImplTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PlannerCoreOptions co;
    co.sink = &sink_;
    auto core = PlannerCore::Create(co);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = *std::move(core);
    PlannerServiceOptions so;
    so.security.token = kToken;
    so.executor_timeout = absl::Seconds(5);
    service_ = std::make_unique<PlannerServiceImpl>(core_.get(), &sink_, so);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port), {});
    ASSERT_TRUE(channel.ok()) << channel.status();
    stub_ = v1::Planner::NewStub(*channel);
  }
  void TearDown() override {
    service_->Shutdown();
    server_->Shutdown();
    service_.reset();  // joins the deployment pushes
    core_.reset();
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
    for (const auto& d : plan.devices()) (*r.mutable_executors())[d] = "127.0.0.1:1";
    v1::Deployment d;
    s = FromGrpc(stub_->DeployPlan(Ctx().get(), r, &d));
    if (!s.ok()) return s;
    return d;
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
  std::unique_ptr<PlannerCore> core_;
  std::unique_ptr<PlannerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Planner::Stub> stub_;
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
  (*again.mutable_executors())["n/cpu1"] = "127.0.0.1:1";
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
  auto d = Deploy("p");
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
}

TEST_F(PlannerServiceImplTest, StoreAddDoesNotWrapAround) {
  Register("n");
  auto d = Deploy("p");
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

}  // namespace
}  // namespace hap::service
