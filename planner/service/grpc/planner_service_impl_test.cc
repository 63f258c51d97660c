// hap.v1.Planner in process on 127.0.0.1:0, over a sink that refuses
// writes on demand (a full disk): RPCs fail with the store's error and leave
// nothing behind; node removal; request limits, names and page tokens; plan
// reads; the rendezvous store only for deployments that exist, with counters
// that do not wrap; reads while every thread is busy. (Deployments and jobs
// against fake executors: planner_service_deployments_test.)
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

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_test_util.h"
#include "common/grpc_util.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/resource_quota.h"
#include "gtest/gtest.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/core/profile_checks.h"
#include "planner/service/grpc/planner_service_impl_test_util.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using impl_testing::FakeExecutor;
using impl_testing::kToken;
using impl_testing::Mlp;
using impl_testing::PlannerServiceImplTest;
using impl_testing::TestNode;
using ::testing::AllOf;
using ::testing::HasSubstr;

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

// A long message is cut between characters: a name of non-ASCII letters
// cut inside one made the message invalid UTF-8 (which clients that read
// it as a proto3 string refuse).
TEST_F(PlannerServiceImplTest, ALongMessageIsCutBetweenCharacters) {
  std::string name = "deployments/x";
  for (int i = 0; i < 5000; ++i) name += "\u20ac";  // 3 bytes each
  const grpc::Status s =
      Send(&v1::Planner::Stub::GetDeployment, v1::GetDeploymentRequest(), "name", name);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message().substr(0, 200);
  EXPECT_THAT(s.error_message(), HasSubstr("bytes of the message cut"));
  EXPECT_TRUE(google::protobuf::internal::IsStructurallyValidUTF8(s.error_message()))
      << s.error_message();
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

  // A view this planner does not know (a newer client's) is refused, not
  // served as BASIC.
  v1::GetPlanRequest unknown_view;
  unknown_view.set_name("plans/a");
  unknown_view.set_view(static_cast<v1::GetPlanRequest::View>(7));
  v1::Plan plan;
  EXPECT_THAT(FromGrpc(stub_->GetPlan(Ctx().get(), unknown_view, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("view 7 is not one of")));
  v1::ListPlansRequest unknown_list_view;
  unknown_list_view.set_view(static_cast<v1::GetPlanRequest::View>(-1));
  v1::ListPlansResponse listed;
  EXPECT_THAT(FromGrpc(stub_->ListPlans(Ctx().get(), unknown_list_view, &listed)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("view -1 is not one of")));

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

// A WatchPlan that the planner's shutdown ends, the plan still searching,
// is UNAVAILABLE (watch again), not OK: hapctl watch read the OK as the
// plan's end and exited 0 with it RUNNING.
TEST_F(PlannerServiceImplTest, AWatchPlanEndedByShutdownIsUnavailableNotOk) {
  for (const char* node : {"a", "b", "c", "d"}) Register(node);
  v1::CreatePlanRequest long_search;
  long_search.set_plan_id("long");
  long_search.mutable_model()->mutable_zoo()->set_name("gpt");
  (*long_search.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 96;
  long_search.mutable_options()->mutable_budget()->set_max_seconds(120);
  long_search.mutable_options()->set_ignore_memory_limits(true);
  v1::Plan plan;
  ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), long_search, &plan)), IsOk());
  // The search ends with the test, whichever assertion ends it.
  absl::Cleanup cancel = [this] { (void)core_->CancelPlan("plans/long"); };
  auto ctx = Ctx();
  v1::WatchPlanRequest r;
  r.set_name("plans/long");
  auto reader = stub_->WatchPlan(ctx.get(), r);
  ASSERT_TRUE(reader->Read(&plan));
  ASSERT_TRUE(plan.state() == v1::Plan::PENDING || plan.state() == v1::Plan::RUNNING)
      << v1::Plan::State_Name(plan.state());
  service_->Shutdown();
  while (reader->Read(&plan)) {
  }
  EXPECT_THAT(FromGrpc(reader->Finish()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("shutting down"), HasSubstr("plans/long"))));
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

// Fields nothing would read were taken and dropped: CreatePlan with ADAM
// and a momentum ran plain Adam, with SGD and Adam's betas plain SGD, with
// the pipeline off its microbatches (and with AUTO a stage count) unread,
// with compute_dtype BFLOAT16 in float32;
// DeployPlan with a data_spec of no form the executors read made a
// deployment every rank's LoadPlan refused;
// DeployPlan with a data_path beside npy: data trained on that data, and
// checkpoint_every without a checkpoint_dir saved nothing. Each is refused
// naming the fields, before a plan or a deployment is made.
TEST_F(PlannerServiceImplTest, FieldsNothingWouldReadAreRefused) {
  Register("n");
  v1::Plan plan;
  v1::CreatePlanRequest adam = Mlp("adam");
  adam.mutable_options()->mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
  adam.mutable_options()->mutable_optimizer()->set_momentum(0.5);
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), adam, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.optimizer.momentum (0.5) is SGD's")));
  v1::CreatePlanRequest sgd = Mlp("sgd");
  sgd.mutable_options()->mutable_optimizer()->set_beta1(0.8);
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), sgd, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("beta1, beta2 and epsilon (0.8, 0, 0) are Adam's")));
  v1::CreatePlanRequest off = Mlp("off");
  off.mutable_options()->set_pipeline_microbatches(4);
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), off, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pipeline_microbatches (4) apply to a pipeline")));
  v1::CreatePlanRequest automatic = Mlp("auto");
  automatic.mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_AUTO);
  automatic.mutable_options()->set_pipeline_stages(3);
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), automatic, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.pipeline_stages (3) applies to PIPELINE_STAGES")));
  v1::CreatePlanRequest half = Mlp("half");
  half.mutable_options()->set_compute_dtype(v1::BFLOAT16);
  EXPECT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), half, &plan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("options.compute_dtype BFLOAT16 is not supported"),
                             HasSubstr("options.precision PRECISION_BF16"))));
  v1::CreatePlanRequest fp32 = Mlp("fp32");
  fp32.mutable_options()->set_compute_dtype(v1::FLOAT32);
  ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), fp32, &plan)), IsOk());
  ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), Mlp("p"), &plan)), IsOk());
  v1::DeployPlanRequest r;
  r.set_plan(plan.name());
  for (int i = 0; i < plan.devices_size(); ++i) {
    (*r.mutable_executors())[plan.devices(i)] = absl::StrCat("127.0.0.1:", i + 1);
  }
  v1::Deployment d;
  v1::DeployPlanRequest path = r;
  path.mutable_training()->set_data_spec("npy:/data/d");
  path.mutable_training()->set_data_path("/data/wiki.train.tokens");
  EXPECT_THAT(FromGrpc(stub_->DeployPlan(Ctx().get(), path, &d)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("training.data_path ('/data/wiki.train.tokens')"),
                             HasSubstr("data_spec is 'npy:/data/d'"))));
  for (const auto& [spec, says] : std::vector<std::pair<std::string, std::string>>{
           {"npy/data", "training.data_spec 'npy/data' is not of a form the executors read"},
           {"npy:", "training.data_spec 'npy:' names no directory"},
           {"tokens::uint32", "training.data_spec 'tokens::uint32' names no file"},
           {"tokens:/data/t.bin:int8", "has token dtype 'int8', not uint16 or uint32"}}) {
    v1::DeployPlanRequest misspelled = r;
    misspelled.mutable_training()->set_data_spec(spec);
    EXPECT_THAT(FromGrpc(stub_->DeployPlan(Ctx().get(), misspelled, &d)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(says)));
  }
  v1::DeployPlanRequest every = r;
  every.mutable_training()->set_checkpoint_every(10);
  EXPECT_THAT(FromGrpc(stub_->DeployPlan(Ctx().get(), every, &d)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("training.checkpoint_every (10) and checkpoint_keep (0)")));
  v1::ListDeploymentsResponse list;
  ASSERT_THAT(FromGrpc(stub_->ListDeployments(Ctx().get(), v1::ListDeploymentsRequest(), &list)),
              IsOk());
  EXPECT_EQ(list.deployments_size(), 0);
}

// A zoo model's batch param and a different global_batch: the plan was
// made at global_batch, the param dropped without a word.
TEST_F(PlannerServiceImplTest, AGlobalBatchOtherThanTheZooModelsBatchIsRefused) {
  Register("n");
  v1::Plan plan;
  v1::CreatePlanRequest r = Mlp("two-batches");  // batch 16
  r.set_global_batch(32);
  EXPECT_THAT(
      FromGrpc(stub_->CreatePlan(Ctx().get(), r, &plan)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("global_batch 32"), HasSubstr("model.zoo.params[\"batch\"] 16"))));
  // The same batch twice, or either alone, is planned at it.
  r.set_global_batch(16);
  ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), r, &plan)), IsOk());
  EXPECT_EQ(plan.global_batch(), 16);
  r.set_plan_id("global-batch");
  r.mutable_model()->mutable_zoo()->mutable_params()->erase("batch");
  r.set_global_batch(32);
  ASSERT_THAT(FromGrpc(stub_->CreatePlan(Ctx().get(), r, &plan)), IsOk());
  EXPECT_EQ(plan.global_batch(), 32);
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

}  // namespace
}  // namespace hap::service
