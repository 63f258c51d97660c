// The executor daemon over gRPC on 127.0.0.1: executors in this process,
// a fake planner (written here, since the real one lives elsewhere) that
// serves the rendezvous store and collects step metrics.
#include "executor/daemon/executor_server.h"

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_test_util.h"
#include "common/status_matchers.h"
#include "executor/cpu/cpu_device.h"
#include "executor/daemon/core_test_util.h"
#include "executor/daemon/executor_service_impl.h"
#include "executor/daemon/fake_planner.h"
#include "executor/daemon/test_plans.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/support/server_interceptor.h"
#include "gtest/gtest.h"
#include "hap/v1/executor_service.grpc.pb.h"
#include "hap/v1/planner_service.grpc.pb.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::IsOk;
using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "s3cret";

class ExecutorServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &planner_port_);
    b.RegisterService(&planner_);
    planner_server_ = b.BuildAndStart();
    ASSERT_NE(planner_server_, nullptr);
    ASSERT_NE(planner_port_, 0);
  }
  void TearDown() override {
    executors_.clear();  // shut down before the planner they report to
    planner_server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  std::string planner_address() const { return absl::StrCat("127.0.0.1:", planner_port_); }

  // Starts an executor (its options changed by `configure` when given);
  // returns its stub.
  std::unique_ptr<v1::Executor::Stub> StartExecutor(
      const std::string& token = "", absl::Duration drain = absl::ZeroDuration(),
      const std::function<void(ExecutorServerOptions*)>& configure = nullptr) {
    ExecutorServerOptions o;
    o.planner = planner_address();
    o.security.token = token;
    o.drain = drain;
    o.core.device_id = absl::StrCat("node0/cpu", executors_.size());
    o.core.comm_timeout = absl::Seconds(20);
    if (configure) configure(&o);
    auto s = ExecutorServer::Start(o);
    EXPECT_THAT(s, IsOk());
    if (!s.ok()) return nullptr;
    auto channel = grpc::CreateChannel((*s)->address(), grpc::InsecureChannelCredentials());
    executors_.push_back(*std::move(s));
    return v1::Executor::NewStub(channel);
  }

  static void Prepare(grpc::ClientContext* ctx, const std::string& token = "") {
    if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  }

  v1::LoadPlanRequest LoadRequest(const v1::Plan& plan, int rank, int64_t steps) {
    v1::LoadPlanRequest r;
    *r.mutable_plan() = plan;
    r.set_deployment("deployments/test");
    r.set_generation(3);
    r.set_rank(rank);
    r.set_world_size(plan.rank_programs_size());
    r.set_rendezvous_address(planner_address());
    r.mutable_training()->set_steps(steps);
    r.mutable_training()->set_data(v1::TrainingConfig::SYNTHETIC);
    return r;
  }

  // Loads `plan`'s rank r, training `steps`, on stubs[r], then starts them
  // all.
  void LoadAndStart(const std::vector<v1::Executor::Stub*>& stubs, const v1::Plan& plan,
                    int64_t steps) {
    for (size_t r = 0; r < stubs.size(); ++r) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      v1::LoadPlanResponse resp;
      ASSERT_TRUE(
          stubs[r]->LoadPlan(&ctx, LoadRequest(plan, static_cast<int>(r), steps), &resp).ok());
    }
    for (v1::Executor::Stub* stub : stubs) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      v1::ExecutorStatus st;
      ASSERT_TRUE(stub->StartTraining(&ctx, v1::StartTrainingRequest(), &st).ok());
    }
  }

  testing::FakePlanner planner_{kToken};
  int planner_port_ = 0;
  std::unique_ptr<grpc::Server> planner_server_;
  std::vector<std::unique_ptr<ExecutorServer>> executors_;
};

TEST_F(ExecutorServerTest, ThreeExecutorsTrainAndReportToThePlanner) {
  constexpr int kWorld = 3;
  constexpr int kSteps = 5;
  auto plan = testing::MakeMlpPlan(kWorld);
  ASSERT_THAT(plan, IsOk());
  planner_.set_token_required(true);
  std::vector<std::unique_ptr<v1::Executor::Stub>> stubs;
  for (int r = 0; r < kWorld; ++r) stubs.push_back(StartExecutor(kToken));

  for (int r = 0; r < kWorld; ++r) {
    grpc::ClientContext ctx;
    Prepare(&ctx, kToken);
    v1::LoadPlanResponse resp;
    grpc::Status s = stubs[r]->LoadPlan(&ctx, LoadRequest(*plan, r, kSteps), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.plan_content_hash(), plan->content_hash());
  }
  for (int r = 0; r < kWorld; ++r) {
    grpc::ClientContext ctx;
    Prepare(&ctx, kToken);
    v1::StartTrainingRequest req;
    req.set_deployment("deployments/test");
    v1::ExecutorStatus st;
    grpc::Status s = stubs[r]->StartTraining(&ctx, req, &st);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(st.state(), v1::ExecutorStatus::TRAINING);
  }

  // The stream ends when training ends.
  std::vector<v1::StepMetric> streamed;
  {
    grpc::ClientContext ctx;
    Prepare(&ctx, kToken);
    v1::StreamStepMetricsRequest req;
    req.set_deployment("deployments/test");
    auto reader = stubs[1]->StreamStepMetrics(&ctx, req);
    v1::StepMetric m;
    while (reader->Read(&m)) streamed.push_back(m);
    grpc::Status s = reader->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_EQ(streamed.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(streamed[i].step(), i);

  std::vector<v1::ExecutorStatus> statuses(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    statuses[r] = executors_[r]->core().WaitUntilDone(absl::InfiniteFuture());
    EXPECT_EQ(statuses[r].state(), v1::ExecutorStatus::FINISHED) << statuses[r].error();
    grpc::ClientContext ctx;
    Prepare(&ctx, kToken);
    v1::ExecutorStatus st;
    ASSERT_TRUE(stubs[r]->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
    EXPECT_EQ(st.state(), v1::ExecutorStatus::FINISHED);
    EXPECT_EQ(st.steps_completed(), kSteps);
    EXPECT_EQ(st.rank(), r);
    EXPECT_EQ(st.generation(), 3);
    EXPECT_EQ(st.device(), absl::StrCat("node0/cpu", r));
  }

  // Training ends after the last metrics were flushed to the planner.
  std::map<std::pair<int, int64_t>, double> loss;
  auto at = [&](int rank, int64_t step) { return loss[std::make_pair(rank, step)]; };
  for (const auto& m : planner_.metrics()) {
    EXPECT_EQ(m.deployment(), "deployments/test");
    EXPECT_GT(m.step_seconds(), 0);
    EXPECT_GT(m.time().seconds(), 0);
    loss[std::make_pair(m.rank(), m.step())] = m.loss();
  }
  ASSERT_EQ(loss.size(), static_cast<size_t>(kWorld * kSteps));
  for (int step = 0; step < kSteps; ++step) {
    for (int r = 1; r < kWorld; ++r) {
      EXPECT_EQ(at(r, step), at(0, step)) << "rank " << r << " step " << step;
    }
    EXPECT_EQ(streamed[step].loss(), at(1, step));
  }
  EXPECT_LT(at(0, kSteps - 1), at(0, 0));  // it learns
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(executors_[r]->reporter_counters().sent, kSteps);
    EXPECT_EQ(executors_[r]->reporter_counters().dropped, 0);
  }
  // The ranks met under the deployment's generation.
  EXPECT_GE(planner_.keys_under("deployments/test", 3), kWorld);
  EXPECT_EQ(planner_.keys_under("deployments/test", 0), 0);
}

// Every method of hap.v1.Executor (LoadPlan, Start/StopTraining,
// GetStatus and the StreamStepMetrics stream) refuses a caller without the
// token or with a wrong one: on the executor's server (gRPC's auth filter),
// and in the service's own handlers (on a server without the filter).
TEST_F(ExecutorServerTest, EveryExecutorMethodRefusesCallsWithoutTheToken) {
  const auto* service = v1::LoadPlanRequest::descriptor()->file()->FindServiceByName("Executor");
  ASSERT_NE(service, nullptr);
  ASSERT_NE(StartExecutor(kToken), nullptr);
  auto channel = service::MakeChannel(executors_.back()->address(), {});
  ASSERT_THAT(channel, IsOk());
  EXPECT_THAT(service::testing::CallsNotRefused(*channel, *service, kToken), ::testing::IsEmpty());

  ExecutorCoreOptions co;
  co.planner_address = planner_address();
  ExecutorCore core(co);
  ExecutorServiceImpl handlers(&core, kToken, /*max_streams=*/4);
  EXPECT_THAT(service::testing::HandlerCallsNotRefused(&handlers, *service, kToken),
              ::testing::IsEmpty());
  EXPECT_EQ(core.Status().state(), v1::ExecutorStatus::IDLE);
}

TEST_F(ExecutorServerTest, EveryCallNeedsTheTokenWhenOneIsSet) {
  auto stub = StartExecutor(kToken);
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::LoadPlanResponse resp;
    grpc::Status s = stub->LoadPlan(&ctx, LoadRequest(*plan, 0, 3), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), HasSubstr("bearer token"));
  }
  {
    grpc::ClientContext ctx;
    Prepare(&ctx, "wrong");
    v1::ExecutorStatus st;
    grpc::Status s = stub->StartTraining(&ctx, v1::StartTrainingRequest(), &st);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    Prepare(&ctx, kToken);
    v1::ExecutorStatus st;
    ASSERT_TRUE(stub->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
    EXPECT_EQ(st.state(), v1::ExecutorStatus::IDLE);  // nothing was loaded
  }
}

TEST_F(ExecutorServerTest, PlansFromAnotherPlannerArePermissionDenied) {
  auto stub = StartExecutor();
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  v1::LoadPlanRequest req = LoadRequest(*plan, 0, 3);
  req.set_rendezvous_address("127.0.0.2:9999");
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::LoadPlanResponse resp;
  grpc::Status s = stub->LoadPlan(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("127.0.0.2:9999"));
  EXPECT_THAT(s.error_message(), HasSubstr(planner_address()));
}

TEST_F(ExecutorServerTest, BadPlansAreInvalidArgument) {
  auto stub = StartExecutor();
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  auto load = [&](const v1::LoadPlanRequest& req) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::LoadPlanResponse resp;
    return stub->LoadPlan(&ctx, req, &resp);
  };
  v1::LoadPlanRequest req = LoadRequest(*plan, 0, 3);
  req.set_world_size(3);
  grpc::Status s = load(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("world of 2 ranks, not 3"));

  req = LoadRequest(*plan, 5, 3);
  s = load(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rank 5 is out of range"));

  req = LoadRequest(*plan, 0, 3);
  req.mutable_plan()->mutable_ratios()->Clear();
  req.mutable_plan()->mutable_rank_programs(0)->set_seed(12345);
  s = load(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("content hash does not match"));
}

TEST_F(ExecutorServerTest, StopTrainingStopsARun) {
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  std::vector<std::unique_ptr<v1::Executor::Stub>> stubs;
  for (int r = 0; r < 2; ++r) stubs.push_back(StartExecutor());
  ASSERT_NO_FATAL_FAILURE(LoadAndStart({stubs[0].get(), stubs[1].get()}, *plan, 1'000'000));
  // Read the stream until a few steps have run, then stop both ranks.
  grpc::ClientContext stream_ctx;
  Prepare(&stream_ctx);
  v1::StreamStepMetricsRequest sreq;
  sreq.set_from_step(0);
  auto reader = stubs[0]->StreamStepMetrics(&stream_ctx, sreq);
  v1::StepMetric m;
  while (reader->Read(&m) && m.step() < 2) {
  }
  EXPECT_EQ(m.step(), 2);
  for (int r = 0; r < 2; ++r) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::StopTrainingRequest req;
    req.set_deployment("deployments/test");
    v1::ExecutorStatus st;
    grpc::Status s = stubs[r]->StopTraining(&ctx, req, &st);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(st.state(), v1::ExecutorStatus::FAILED);
    EXPECT_LT(st.steps_completed(), 1'000'000);
    if (r == 0) {
      EXPECT_THAT(st.error(), HasSubstr("stopped by StopTraining"));
    }
  }
  while (reader->Read(&m)) {
  }
  EXPECT_TRUE(reader->Finish().ok());  // the stream ended with training
}

// A second executor on the port one serves on was started too (gRPC's
// default SO_REUSEPORT), and the planner's calls landed on either: it is
// refused, naming the address.
TEST_F(ExecutorServerTest, ASecondExecutorOnTheSamePortIsRefused) {
  ASSERT_NE(StartExecutor(), nullptr);
  ExecutorServerOptions o;
  o.planner = planner_address();
  o.listen = executors_.back()->address();
  o.core.device_id = "node0/cpu9";
  EXPECT_THAT(ExecutorServer::Start(o).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot listen on '" + o.listen)));
}

// A StreamStepMetrics call without a deadline holds a server thread until
// training ends: a peer opening streams without bound would take every
// thread and memory, and the planner's LoadPlan and StopTraining would go
// unanswered. Streams beyond max_streams are refused, control calls are
// still answered, and a stream that ends frees its place.
TEST_F(ExecutorServerTest, StreamsBeyondTheLimitAreRefusedAndControlCallsStillAnswer) {
  constexpr int kMaxStreams = 3;
  ExecutorServerOptions none;
  none.planner = planner_address();
  none.max_streams = 0;
  EXPECT_THAT(ExecutorServer::Start(none).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_streams")));
  auto stub = StartExecutor("", absl::ZeroDuration(),
                            [](ExecutorServerOptions* o) { o->max_streams = kMaxStreams; });
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::StepMetric>> reader;
  };
  // Returns once the server has admitted the stream (it then sends its
  // initial metadata) or refused it; the deadline only bounds a broken run.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto open = [&] {
    auto s = std::make_unique<Stream>();
    s->ctx.set_deadline(absl::ToChronoTime(deadline));
    v1::StreamStepMetricsRequest req;
    req.set_deployment("deployments/test");
    s->reader = stub->StreamStepMetrics(&s->ctx, req);
    s->reader->WaitForInitialMetadata();
    return s;
  };
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      v1::LoadPlanResponse resp;
      ASSERT_TRUE(stub->LoadPlan(&ctx, LoadRequest(*plan, 0, 3), &resp).ok());
    }
    // Loaded, not training: the streams wait for metrics.
    std::vector<std::unique_ptr<Stream>> streams;
    for (int i = 0; i < kMaxStreams; ++i) streams.push_back(open());
    std::unique_ptr<Stream> extra = open();
    grpc::Status refused = extra->reader->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(refused.error_message(), HasSubstr("at most 3 StreamStepMetrics calls"));
    {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      v1::ExecutorStatus st;
      grpc::Status s = stub->GetStatus(&ctx, v1::GetStatusRequest(), &st);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(st.state(), v1::ExecutorStatus::LOADED);
    }
    {
      // Unloads (IDLE); the waiting streams end with the load.
      grpc::ClientContext ctx;
      Prepare(&ctx);
      v1::StopTrainingRequest req;
      req.set_deployment("deployments/test");
      v1::ExecutorStatus st;
      grpc::Status s = stub->StopTraining(&ctx, req, &st);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(st.state(), v1::ExecutorStatus::IDLE);
    }
    for (auto& s : streams) {
      grpc::Status end = s->reader->Finish();
      EXPECT_TRUE(end.ok()) << end.error_code() << " " << end.error_message();
    }
  }
}

// Hands each call's ServerContext to `on_call` as the call starts, and
// leaves the call alone.
class ContextTap final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  using OnCall = std::function<void(const std::string& method, grpc::ServerContextBase* ctx)>;
  explicit ContextTap(OnCall on_call) : on_call_(std::move(on_call)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    on_call_(info->method(), info->server_context());
    return nullptr;  // no interceptor for this call
  }

 private:
  OnCall on_call_;
};

// A slow LoadPlan (a large plan, a checkpoint to read) used to install its
// plan after the planner had given up with DEADLINE_EXCEEDED: the executor
// ran a plan the planner took for failed. Here the load's device is made
// only once the client has seen DEADLINE_EXCEEDED and the server's deadline
// for the call has passed; the plan must not be installed, the earlier
// load stays.
TEST_F(ExecutorServerTest, LoadPlanWhoseCallerHasGoneInstallsNothing) {
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  absl::Mutex mu;
  grpc::ServerContextBase* load_ctx = nullptr;  // the latest LoadPlan's
  bool slow = false;
  absl::Notification client_gone;
  ExecutorCoreOptions co;
  co.device_id = "node0/cpu0";
  co.make_device = [&](int threads) {
    grpc::ServerContextBase* ctx;
    {
      absl::MutexLock l(&mu);
      ctx = slow ? load_ctx : nullptr;
    }
    if (ctx != nullptr) {
      client_gone.WaitForNotification();
      absl::SleepFor(service::CallDeadline(ctx) - absl::Now());  // the server's deadline
    }
    return NewCpuDevice(threads);
  };
  ExecutorCore core(co);
  ExecutorServiceImpl service(&core, "");
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> taps;
  taps.push_back(
      std::make_unique<ContextTap>([&](const std::string& method, grpc::ServerContextBase* ctx) {
        absl::MutexLock l(&mu);
        if (method == "/hap.v1.Executor/LoadPlan") load_ctx = ctx;
      }));
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  b.experimental().SetInterceptorCreators(std::move(taps));
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_NE(port, 0);
  auto stub = v1::Executor::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::LoadPlanResponse resp;
    grpc::Status s = stub->LoadPlan(&ctx, LoadRequest(*plan, 0, 3), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  {
    absl::MutexLock l(&mu);
    slow = true;
  }
  v1::LoadPlanRequest req = LoadRequest(*plan, 0, 3);
  req.set_generation(4);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  v1::LoadPlanResponse resp;
  grpc::Status s = stub->LoadPlan(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  client_gone.Notify();
  server->Shutdown();  // waits for the LoadPlan handler to return
  v1::ExecutorStatus st = core.Status();
  EXPECT_EQ(st.state(), v1::ExecutorStatus::LOADED);
  EXPECT_EQ(st.generation(), 3) << "the abandoned load (generation 4) was installed";
}

// grpc.health.v1.Health/Check over raw bytes (its protos are not ours):
// HealthCheckRequest{} is empty; the response's field 1 is the status
// (1 SERVING, 2 NOT_SERVING).
int HealthStatus(grpc::Channel* channel) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::ByteBuffer req, resp;
  grpc::Slice empty("");
  req = grpc::ByteBuffer(&empty, 1);
  grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel,
      grpc::internal::RpcMethod("/grpc.health.v1.Health/Check",
                                grpc::internal::RpcMethod::NORMAL_RPC),
      &ctx, req, &resp);
  if (!s.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!resp.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const auto& x : slices) bytes.append(reinterpret_cast<const char*>(x.begin()), x.size());
  if (bytes.size() == 2 && bytes[0] == 0x08) return bytes[1];
  return 0;  // field absent: UNKNOWN
}

TEST_F(ExecutorServerTest, HealthIsServingThenNotServingWhileShuttingDown) {
  StartExecutor("", absl::Seconds(1));
  auto channel =
      grpc::CreateChannel(executors_[0]->address(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel.get()), 1);
  std::thread stopper([&] { executors_[0]->Shutdown(); });
  int status = 1;
  for (int i = 0; i < 1000 && status == 1; ++i) status = HealthStatus(channel.get());
  EXPECT_EQ(status, 2);  // NOT_SERVING during the drain
  stopper.join();
  EXPECT_EQ(HealthStatus(channel.get()), -1);  // gone
}

// SIGTERM while training: the planner polls GetStatus (every second by
// default) to learn how each rank ended. The drain came before training was
// cancelled and the server went away right after it, so the planner saw
// "connection refused", not the rank's final status, which said "stopped by
// StopTraining" though nobody called it. Now training is cancelled first and
// the final status is served through the drain.
TEST_F(ExecutorServerTest, ShutdownServesTheFinalStatusThroughTheDrain) {
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  auto stub = StartExecutor("", absl::Seconds(2));
  auto peer = StartExecutor();
  ASSERT_NO_FATAL_FAILURE(LoadAndStart({stub.get(), peer.get()}, *plan, 1'000'000));
  std::thread stopper([&] { executors_[0]->Shutdown(); });
  // Poll as the planner does until the executor answers something other
  // than TRAINING, or stops answering.
  v1::ExecutorStatus last;
  while (true) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::ExecutorStatus st;
    if (!stub->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok()) break;
    last = st;
    if (st.state() != v1::ExecutorStatus::TRAINING) break;
  }
  EXPECT_EQ(last.state(), v1::ExecutorStatus::FAILED);
  {  // and is still served (the drain is 2 s)
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::ExecutorStatus st;
    EXPECT_TRUE(stub->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
    EXPECT_EQ(st.error(), last.error());
  }
  stopper.join();
  EXPECT_THAT(last.error(), HasSubstr("stopped by the executor shutting down after"));
  EXPECT_THAT(last.error(), ::testing::Not(HasSubstr("StopTraining")));
}

// SIGTERM while a peer is frozen: the step in progress waits in a
// collective until the communicator timeout (--timeout, 60 s by default),
// and Shutdown waited for it, holding the lock StopTraining needs (the
// planner's stop timed out) and outlasting a supervisor's grace period.
// It is abandoned after the stop wait, as StopTraining abandons it.
TEST_F(ExecutorServerTest, ShutdownAbandonsAStepStuckInACollective) {
  absl::Notification entered, release;
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  auto stub = StartExecutor("", absl::Seconds(1), [&](ExecutorServerOptions* o) {
    o->core.stop_wait = absl::Milliseconds(100);
    o->core.connect = [&](const GlooOptions& go,
                          RendezvousStore&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
      return std::make_unique<testing::HungPeerCommunicator>(go.rank, &entered, &release);
    };
  });
  ASSERT_NO_FATAL_FAILURE(LoadAndStart({stub.get()}, *plan, 1'000'000));
  entered.WaitForNotification();  // inside step 0's first collective
  executors_[0]->Shutdown();      // returned while the collective still waits
  EXPECT_FALSE(release.HasBeenNotified());
  const v1::ExecutorStatus st = executors_[0]->core().Status();
  EXPECT_EQ(st.state(), v1::ExecutorStatus::FAILED);
  EXPECT_THAT(st.error(), ::testing::AllOf(HasSubstr("stopped by the executor shutting down"),
                                           HasSubstr("abandoned")));
  EXPECT_EQ(executors_[0]->core().RetiredThreads(), 1);
  release.Notify();    // the collective times out at last
  executors_.clear();  // joins the thread, before `release` goes
}

// Entries of /proc/self/<dir> (fd: open file descriptors; task: threads).
int CountEntries(const std::string& dir) {
  int n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/" + dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// A long-running daemon takes plan after plan: loads that are unloaded,
// runs that finish, runs that are stopped. None may leave a thread or a
// file descriptor behind (sockets of Gloo's meshes, the store's calls).
TEST_F(ExecutorServerTest, ManyLoadAndStopCyclesLeakNoThreadsOrFiles) {
  auto plan = testing::MakeMlpPlan(2);
  ASSERT_THAT(plan, IsOk());
  std::vector<std::unique_ptr<v1::Executor::Stub>> stubs;
  for (int r = 0; r < 2; ++r) stubs.push_back(StartExecutor());
  auto call_all = [&](int cycle, const std::string& method, int64_t steps) {
    for (int r = 0; r < 2; ++r) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      grpc::Status s;
      v1::ExecutorStatus st;
      if (method == "load") {
        v1::LoadPlanRequest req = LoadRequest(*plan, r, steps);
        req.set_generation(100 + cycle);
        v1::LoadPlanResponse resp;
        s = stubs[r]->LoadPlan(&ctx, req, &resp);
      } else if (method == "start") {
        s = stubs[r]->StartTraining(&ctx, v1::StartTrainingRequest(), &st);
      } else {
        s = stubs[r]->StopTraining(&ctx, v1::StopTrainingRequest(), &st);
      }
      ASSERT_TRUE(s.ok()) << method << " cycle " << cycle << ": " << s.error_message();
    }
  };
  auto cycle = [&](int i) {
    ASSERT_NO_FATAL_FAILURE(call_all(i, "load", 2));
    if (i % 3 == 0) {  // unloaded before it trains
      ASSERT_NO_FATAL_FAILURE(call_all(i, "stop", 0));
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(executors_[r]->core().Status().state(), v1::ExecutorStatus::IDLE);
      }
      return;
    }
    ASSERT_NO_FATAL_FAILURE(call_all(i, "start", 0));
    if (i % 3 == 1) {
      ASSERT_NO_FATAL_FAILURE(call_all(i, "stop", 0));
    }
    for (int r = 0; r < 2; ++r) {
      const v1::ExecutorStatus st =
          executors_[r]->core().WaitUntilDone(absl::Now() + absl::Seconds(60));
      EXPECT_TRUE(st.state() == v1::ExecutorStatus::FINISHED ||
                  st.state() == v1::ExecutorStatus::FAILED)
          << "cycle " << i << ": " << v1::ExecutorStatus::State_Name(st.state());
      if (i % 3 == 2) {
        EXPECT_EQ(st.state(), v1::ExecutorStatus::FINISHED) << st.error();
      }
    }
  };
  for (int i = 0; i < 6; ++i) ASSERT_NO_FATAL_FAILURE(cycle(i));  // warm-up
  // Threads that ended may still be on their way out.
  auto settled = [](const std::string& dir, int at_most) {
    int n = CountEntries(dir);
    for (int i = 0; i < 100 && n > at_most; ++i) {
      absl::SleepFor(absl::Milliseconds(50));
      n = CountEntries(dir);
    }
    return n;
  };
  const int fds = CountEntries("fd");
  const int threads = CountEntries("task");
  for (int i = 6; i < 56; ++i) ASSERT_NO_FATAL_FAILURE(cycle(i));
  EXPECT_LE(settled("fd", fds + 8), fds + 8);
  EXPECT_LE(settled("task", threads + 4), threads + 4);
}

}  // namespace
}  // namespace hap::executor
