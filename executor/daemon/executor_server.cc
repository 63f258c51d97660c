#include "executor/daemon/executor_server.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/host_port.h"
#include "executor/comm/planner_store.h"
#include "executor/daemon/executor_service_impl.h"
#include "grpcpp/health_check_service_interface.h"
#include "hap/v1/planner_service.grpc.pb.h"

namespace hap::executor {
namespace {

namespace v1 = ::hap::v1;
constexpr char kServiceName[] = "hap.v1.Executor";

}  // namespace

absl::Status CheckListenAddress(const std::string& listen) {
  if (listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", listen, "' is not HOST:PORT"));
  }
  if (!service::IsHostPort(listen, 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", listen,
                     "': the port must be a whole number from 0 to 65535 (0: a free port)"));
  }
  return absl::OkStatus();
}

absl::Status CheckPlannerAddress(const std::string& planner) {
  if (!service::IsHostPort(planner, 1, /*schemes=*/true)) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner address '", planner,
                     "' is not HOST:PORT with the port a whole number from 1 to 65535"));
  }
  return absl::OkStatus();
}

struct ExecutorServer::Impl {
  ExecutorServerOptions o;
  std::string host;
  int port = 0;
  std::shared_ptr<v1::Planner::StubInterface> planner;
  std::unique_ptr<StepReporter> reporter;
  std::unique_ptr<ExecutorCore> core;
  std::unique_ptr<ExecutorServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  absl::Mutex mu;
  bool shutting_down ABSL_GUARDED_BY(mu) = false;
  absl::Notification down;
};

absl::StatusOr<std::unique_ptr<ExecutorServer>> ExecutorServer::Start(
    ExecutorServerOptions options) {
  if (options.planner.empty()) {
    return absl::InvalidArgumentError(
        "the executor needs its planner's address (--planner or HAP_PLANNER): the "
        "only planner it takes plans from");
  }
  // `fd00::5:7070` is [fd00::5]:7070, as the planner advertises it.
  options.planner = service::BracketIpv6Host(options.planner);
  if (absl::Status s = CheckPlannerAddress(options.planner); !s.ok()) return s;
  if (options.max_streams < 1 || options.max_streams > kMaxStreamsLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_streams (StreamStepMetrics calls served at once) must be in [1, ",
                     kMaxStreamsLimit, "], got ", options.max_streams));
  }
  if (absl::Status s = CheckListenAddress(options.listen); !s.ok()) return s;
  const auto colon = options.listen.rfind(':');
  std::unique_ptr<ExecutorServer> s(new ExecutorServer);
  s->impl_ = std::make_unique<Impl>();
  Impl& m = *s->impl_;
  m.o = std::move(options);
  m.host = m.o.listen.substr(0, colon);

  auto channel = service::MakeChannel(m.o.planner, m.o.security);
  if (!channel.ok()) return channel.status();
  m.planner = v1::Planner::NewStub(*channel);

  StepReporterOptions ro;
  ro.capacity = m.o.report_queue;
  ro.send = [stub = m.planner, security = m.o.security,
             timeout = m.o.report_timeout](const std::vector<v1::StepMetric>& batch) {
    v1::ReportStepMetricsRequest req;
    for (const auto& x : batch) *req.add_metrics() = x;
    v1::ReportStepMetricsResponse resp;
    grpc::ClientContext ctx;
    service::PrepareClientContext(&ctx, security, timeout);
    return service::FromGrpc(stub->ReportStepMetrics(&ctx, req, &resp));
  };
  m.reporter = std::make_unique<StepReporter>(std::move(ro));

  ExecutorCoreOptions co = m.o.core;
  co.planner_address = m.o.planner;
  co.make_store = [stub = m.planner, security = m.o.security](const LoadOptions& l) {
    PlannerStoreOptions po;
    po.deployment = l.deployment;
    po.generation = l.generation;
    po.security = security;
    return NewPlannerStore(stub, po);
  };
  StepReporter* reporter = m.reporter.get();
  co.on_step = [reporter](const v1::StepMetric& metric) { reporter->Push(metric); };
  co.on_end = [reporter, timeout = m.o.report_timeout] {
    reporter->Flush(absl::Now() + timeout);
  };
  m.core = std::make_unique<ExecutorCore>(std::move(co));
  m.service =
      std::make_unique<ExecutorServiceImpl>(m.core.get(), m.o.security.token, m.o.max_streams);

  auto creds = service::MakeServerCredentials(m.o.security);
  if (!creds.ok()) return creds.status();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  b.AddListeningPort(m.o.listen, *creds, &m.port);
  // gRPC binds with SO_REUSEPORT by default: a second executor on the port
  // would start too, and the planner's calls would land on either.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.SetMaxReceiveMessageSize(service::kMaxMessageBytes);
  b.SetMaxSendMessageSize(service::kMaxMessageBytes);
  grpc::ResourceQuota quota("hap-executor");
  quota.SetMaxThreads(m.o.max_streams + kControlThreads);
  b.SetResourceQuota(quota);
  b.RegisterService(m.service.get());
  m.server = b.BuildAndStart();
  if (m.server == nullptr || m.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", m.o.listen, "'"));
  }
  grpc::HealthCheckServiceInterface* health = m.server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus(kServiceName, true);
  }
  return s;
}

ExecutorServer::~ExecutorServer() {
  if (impl_ != nullptr) Shutdown();
}

int ExecutorServer::port() const { return impl_->port; }

std::string ExecutorServer::address() const {
  return absl::StrCat(impl_->host, ":", impl_->port);
}

ExecutorCore& ExecutorServer::core() { return *impl_->core; }

StepReporter::Counters ExecutorServer::reporter_counters() const {
  return impl_->reporter->counters();
}

void ExecutorServer::Shutdown() {
  Impl& m = *impl_;
  bool first;
  {
    absl::MutexLock l(&m.mu);
    first = !m.shutting_down;
    m.shutting_down = true;
  }
  if (!first) {
    m.down.WaitForNotification();
    return;
  }
  // A Start that failed half way (a bad TLS file, a port in use) leaves no
  // server, or no core, to stop.
  if (m.server != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = m.server->GetHealthCheckService()) {
      health->SetServingStatus(false);  // every service, the overall one included
    }
  }
  // Training is cancelled between steps (and joined) before the drain, so
  // that the planner's status polls during the drain read how it ended.
  // A step stuck in a collective (a peer gone) is abandoned after the stop
  // wait; its thread is joined by ~ExecutorCore.
  if (m.core != nullptr) m.core->Shutdown(/*join=*/false);
  if (m.server != nullptr) {
    if (m.o.drain > absl::ZeroDuration()) absl::SleepFor(m.o.drain);  // let pollers notice
    m.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    m.server->Wait();
  }
  m.down.Notify();
}

void ExecutorServer::Wait() { impl_->down.WaitForNotification(); }

}  // namespace hap::executor
