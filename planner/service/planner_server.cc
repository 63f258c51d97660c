#include "planner/service/planner_server.h"

#include <algorithm>
#include <cctype>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "planner/service/core/retention.h"
#include "planner/service/deployment_metrics.h"
#include "planner/service/grpc/planner_service_impl.h"
#include "planner/service/metrics/metrics.h"
#include "planner/service/metrics/metrics_http.h"
#include "planner/service/status_page.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
constexpr char kService[] = "hap.v1.Planner";

// The model label of a plan: its graph's name, which callers choose, cut
// to 64 bytes of [A-Za-z0-9_.:/-] (anything else becomes '_'); "unnamed"
// when empty. Together with the registry's bound on label sets per family
// this keeps /metrics small whatever names arrive.
std::string ModelLabel(const std::string& graph_name) {
  constexpr size_t kMaxModelLabel = 64;
  std::string label;
  for (char c : graph_name.substr(0, kMaxModelLabel)) {
    const bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' ||
                    c == ':' || c == '/' || c == '-';
    label.push_back(ok ? c : '_');
  }
  return label.empty() ? "unnamed" : label;
}

// The planner's metrics: gRPC server metrics under the go-grpc-prometheus
// names, plans, devices, training.
struct PlannerMetrics {
  metrics::MetricsRegistry registry;
  metrics::Family<metrics::Counter>* started = nullptr;
  metrics::Family<metrics::Counter>* handled = nullptr;
  metrics::Family<metrics::Histogram>* handling = nullptr;
  metrics::Family<metrics::Counter>* plans = nullptr;
  metrics::Histogram* plan_duration = nullptr;
  // hap_plan_predicted_step_seconds{model}
  LatestPerKey predicted{metrics::MetricsRegistryOptions{}.max_label_sets_per_family};
  metrics::Histogram* step_seconds = nullptr;
  metrics::Counter* steps = nullptr;
  metrics::Family<metrics::Counter>* job_replans = nullptr;
  metrics::Family<metrics::Counter>* finished = nullptr;
  metrics::Histogram* job_recovery = nullptr;
  metrics::Counter* job_steps_lost = nullptr;

  absl::Status Init(PlannerCore** core, PlannerServiceImpl** service) {
    // The registry's bound on label sets, which the per-model and
    // per-deployment families keep to themselves (their help says so).
    const size_t max = metrics::MetricsRegistryOptions{}.max_label_sets_per_family;
    HAP_ASSIGN_OR_RETURN(started, registry.AddCounterFamily(
                                      "grpc_server_started_total",
                                      "RPCs started on the server.",
                                      {"grpc_type", "grpc_service", "grpc_method"}));
    HAP_ASSIGN_OR_RETURN(handled, registry.AddCounterFamily(
                                      "grpc_server_handled_total",
                                      "RPCs completed on the server, by status code.",
                                      {"grpc_type", "grpc_service", "grpc_method", "grpc_code"}));
    HAP_ASSIGN_OR_RETURN(handling,
                         registry.AddHistogramFamily(
                             "grpc_server_handling_seconds",
                             "Time the server took to handle RPCs, in seconds.",
                             {"grpc_type", "grpc_service", "grpc_method"}));
    HAP_ASSIGN_OR_RETURN(plans, registry.AddCounterFamily(
                                    "hap_plans_total", "Plans finished, by result.",
                                    {"result"}));
    HAP_ASSIGN_OR_RETURN(plan_duration,
                         registry.AddHistogram("hap_plan_duration_seconds",
                                               "Synthesis time of finished plans (search, "
                                               "LP, lowering), in seconds."));
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_plan_predicted_step_seconds",
        absl::StrCat("Predicted step time of the latest plan of each model (its graph's name, "
                     "at most 64 characters; the ",
                     max, " models planned most recently), in seconds."),
        {"model"}, [this] { return predicted.Rows(); }));
    HAP_ASSIGN_OR_RETURN(step_seconds,
                         registry.AddHistogram("hap_executor_step_seconds",
                                               "Training step times reported by executors, "
                                               "in seconds."));
    // From the deployments held at each scrape (deployment_metrics.h).
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_training_loss",
        absl::StrCat("Latest training loss reported by rank 0, per deployment the planner holds "
                     "(running ones, then finished ones by end time, at most ",
                     max, ")."),
        {"deployment"}, [service, max] {
          if (!*service) return std::vector<metrics::LabeledValue>{};
          return TrainingLossRows((*service)->Deployments(), max);
        }));
    // The alert on steps slower than planned compares these two, deployment
    // by deployment (deploy/prometheus/hap-rules.yml).
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_deployment_step_seconds",
        "Measured step time of each running deployment: the slowest rank's median over its "
        "latest 20 steps, in seconds.",
        {"deployment"}, [service, max] {
          if (!*service) return std::vector<metrics::LabeledValue>{};
          return RecentStepRows((*service)->Deployments(), max);
        }));
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_deployment_predicted_step_seconds",
        "Predicted step time of each running deployment's plan, in seconds.", {"deployment"},
        [service, core, max] {
          if (!*service || !*core) return std::vector<metrics::LabeledValue>{};
          return PredictedStepRows((*service)->Deployments(), max,
                                   [core](const std::string& plan) -> std::optional<double> {
                                     auto p = (*core)->GetPlanSnapshot(plan);
                                     if (!p.ok() || (*p)->prediction().step_seconds() <= 0)
                                       return std::nullopt;
                                     return (*p)->prediction().step_seconds();
                                   });
        }));
    HAP_ASSIGN_OR_RETURN(
        finished, registry.AddCounterFamily(
                      "hap_deployments_finished_total",
                      "Deployments that ended, by how (succeeded, failed, stopped).", {"state"}));
    for (const char* state : {"succeeded", "failed", "stopped"}) {
      HAP_RETURN_IF_ERROR(finished->Get({state}).status());  // each series from the start
    }
    HAP_ASSIGN_OR_RETURN(steps, registry.AddCounter("hap_executor_steps_total",
                                                    "Training steps reported by executors."));
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_device_peak_flops", "Measured float32 FLOP/s of each registered device.",
        {"node", "device"}, [core] {
          std::vector<metrics::LabeledValue> rows;
          if (!*core) return rows;
          const v1::Cluster cluster = (*core)->GetCluster(true);
          for (const auto& n : cluster.nodes()) {
            for (const auto& d : n.devices()) {
              for (const auto& f : d.flops()) {
                if (f.dtype() == v1::FLOAT32) rows.push_back({{n.name(), d.id()}, f.flops()});
              }
            }
          }
          return rows;
        }));
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_device_memory_bytes", "Memory of each registered device, in bytes.",
        {"node", "device"}, [core] {
          std::vector<metrics::LabeledValue> rows;
          if (!*core) return rows;
          const v1::Cluster cluster = (*core)->GetCluster(true);
          for (const auto& n : cluster.nodes()) {
            for (const auto& d : n.devices()) {
              rows.push_back({{n.name(), d.id()}, static_cast<double>(d.memory_bytes())});
            }
          }
          return rows;
        }));
    HAP_ASSIGN_OR_RETURN(job_replans,
                         registry.AddCounterFamily("hap_job_replans_total",
                                                   "Re-plans of elastic jobs, by reason (a device "
                                                   "lost, a node joined, ...).",
                                                   {"reason"}));
    // Every re-plan reason at 0 from the start (every value of the enum but
    // REASON_UNSPECIFIED and STARTED, which is no re-plan), so rates and
    // alerts see the series before the first re-plan.
    for (int r = v1::JobEvent::Reason_MIN; r <= v1::JobEvent::Reason_MAX; ++r) {
      if (!v1::JobEvent::Reason_IsValid(r) || r == v1::JobEvent::REASON_UNSPECIFIED ||
          r == v1::JobEvent::STARTED) {
        continue;
      }
      HAP_RETURN_IF_ERROR(
          job_replans->Get({ReasonLabel(static_cast<v1::JobEvent::Reason>(r))}).status());
    }
    HAP_ASSIGN_OR_RETURN(job_recovery,
                         registry.AddHistogram("hap_job_recovery_seconds",
                                               "Downtime of each job re-plan: failure (or switch) "
                                               "seen until the new deployment runs, in seconds."));
    HAP_ASSIGN_OR_RETURN(job_steps_lost,
                         registry.AddCounter("hap_job_steps_lost_total",
                                             "Training steps done again after re-plans (done "
                                             "after the checkpoint resumed from)."));
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_jobs", "Elastic jobs, by state.", {"state"}, [service] {
          std::vector<metrics::LabeledValue> rows;
          if (!*service) return rows;
          std::map<std::string, double> by_state;
          for (int s = v1::JobStatus::PENDING; s <= v1::JobStatus::STOPPED; ++s) {
            by_state[v1::JobStatus::State_Name(static_cast<v1::JobStatus::State>(s))] = 0;
          }
          for (const v1::Job& j : (*service)->Jobs()) {
            by_state[v1::JobStatus::State_Name(j.status().state())] += 1;
          }
          for (const auto& [state, n] : by_state) rows.push_back({{state}, n});
          return rows;
        }));
    HAP_RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        "hap_nodes", "Registered nodes, by state.", {"state"}, [core] {
          std::vector<metrics::LabeledValue> rows;
          if (!*core) return rows;
          double ready = 0, stale = 0;
          const v1::Cluster cluster = (*core)->GetCluster(true);
          for (const auto& n : cluster.nodes()) {
            (n.state() == v1::Node::STALE ? stale : ready) += 1;
          }
          rows.push_back({{"ready"}, ready});
          rows.push_back({{"stale"}, stale});
          return rows;
        }));
    return absl::OkStatus();
  }

  static const char* Type(const std::string& method) {
    return method == "WatchPlan" || method == "WatchJob" ? "server_stream" : "unary";
  }
  void Started(const std::string& method) {
    if (auto c = started->Get({Type(method), kService, method}); c.ok()) (*c)->Increment();
  }
  void Handled(const std::string& method, grpc::StatusCode code, double seconds) {
    std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
    // go-grpc-prometheus spells codes in CamelCase (OK, InvalidArgument).
    std::string camel;
    bool up = true;
    for (char ch : name) {
      if (ch == '_') {
        up = true;
        continue;
      }
      camel += up ? ch : static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      up = false;
    }
    if (code == grpc::StatusCode::OK) camel = "OK";
    if (auto c = handled->Get({Type(method), kService, method, camel}); c.ok()) {
      (*c)->Increment();
    }
    if (auto h = handling->Get({Type(method), kService, method}); h.ok()) {
      (*h)->Observe(seconds);
    }
  }
  // A call the token check refused before any handler saw it (gRPC core's
  // thread): counted as started and handled with Unauthenticated, no
  // latency. The path is the caller's, so the labels are bounded: a method
  // of hap.v1.Planner by name, anything else service and method "(other)".
  void Refused(absl::string_view path) {
    std::string service = "(other)", method = "(other)";
    static const google::protobuf::ServiceDescriptor* const planner =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(kService);
    if (absl::ConsumePrefix(&path, absl::StrCat("/", kService, "/")) && planner != nullptr &&
        planner->FindMethodByName(std::string(path)) != nullptr) {
      service = kService;
      method = std::string(path);
    }
    if (auto c = started->Get({Type(method), service, method}); c.ok()) (*c)->Increment();
    if (auto c = handled->Get({Type(method), service, method, "Unauthenticated"}); c.ok()) {
      (*c)->Increment();
    }
  }
  void PlanDone(const v1::Plan& p) {
    std::string result = p.state() == v1::Plan::SUCCEEDED   ? "succeeded"
                         : p.state() == v1::Plan::CANCELLED ? "cancelled"
                                                            : "failed";
    if (auto c = plans->Get({result}); c.ok()) (*c)->Increment();
    if (p.state() != v1::Plan::SUCCEEDED) return;
    plan_duration->Observe(p.synthesis_seconds());
    predicted.Set(ModelLabel(p.graph().name()), p.prediction().step_seconds());
  }
  static std::string ReasonLabel(v1::JobEvent::Reason reason) {
    return absl::AsciiStrToLower(v1::JobEvent::Reason_Name(reason));
  }
  void JobReplan(v1::JobEvent::Reason reason) {
    if (auto c = job_replans->Get({ReasonLabel(reason)}); c.ok()) (*c)->Increment();
  }
  void JobResumed(const v1::JobEvent& e) {
    if (e.reason() == v1::JobEvent::STARTED) return;  // a start is no recovery
    job_recovery->Observe(e.downtime_seconds());
    job_steps_lost->Increment(static_cast<double>(e.steps_lost()));
  }
  void DeploymentFinished(const v1::Deployment& d) {
    const std::string state = absl::AsciiStrToLower(v1::Deployment::State_Name(d.state()));
    if (auto c = finished->Get({state}); c.ok()) (*c)->Increment();
  }
  void Step(const v1::StepMetric& m) {
    steps->Increment();
    step_seconds->Observe(m.step_seconds());
  }
};

}  // namespace

namespace {
// --listen's host with the port bound ("0.0.0.0:0" -> "0.0.0.0:7070").
std::string ListenHostWithPort(const std::string& listen, int port) {
  return absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
}
}  // namespace

struct PlannerServer::Impl {
  PlannerServerOptions o;
  std::unique_ptr<StateBackend> backend;
  PlannerCore* core_ptr = nullptr;  // read by metric callbacks
  PlannerServiceImpl* service_ptr = nullptr;
  PlannerMetrics metrics;
  std::unique_ptr<PlannerCore> core;
  std::unique_ptr<PlannerServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<metrics::MetricsHttpServer> http;
  int port = 0;
  std::string advertised;  // what executors are told to dial
  std::string listening;   // --listen's host with the bound port
  absl::Mutex mu;
  bool shut = false;
  absl::Notification done;
  // Retention: the periodic pass, and whether the service can say which
  // plans deployments use (only while it exists).
  std::thread retention;
  absl::Notification stop_retention;
  absl::Mutex service_mu;
  bool service_up ABSL_GUARDED_BY(service_mu) = false;

  // The plans deployments use: every deployment keeps its plan, over or
  // not (a deployment's record names its plan).
  absl::StatusOr<std::set<std::string>> PlansInUse() {
    absl::MutexLock l(&service_mu);
    if (!service_up) {
      return absl::UnavailableError("the planner service is not running (starting or stopping)");
    }
    std::set<std::string> plans;
    for (const v1::Deployment& d : service->Deployments()) plans.insert(d.plan());
    return plans;
  }
};

absl::StatusOr<std::unique_ptr<PlannerServer>> PlannerServer::Start(PlannerServerOptions o) {
  std::unique_ptr<PlannerServer> s(new PlannerServer());
  s->impl_ = std::make_unique<Impl>();
  Impl& m = *s->impl_;
  // `fd00::5:7070` (an IPv6 pod's $(POD_IP):7070) is [fd00::5]:7070, as the
  // agents take it; it was refused as no HOST:PORT.
  o.advertise = BracketIpv6Host(o.advertise);
  m.o = o;
  HAP_RETURN_IF_ERROR(ValidateDeploymentWatchOptions(o.deployments));
  // gRPC takes a port past 65535 modulo 65536: --listen 127.0.0.1:99999
  // served on 34463, and 65536 on a free port, without a word.
  if (!IsHostPort(o.listen, 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address '", o.listen, "' is not HOST:PORT with a port from 0 to 65535"));
  }
  if (!o.advertise.empty() && !IsHostPort(o.advertise, 1, /*schemes=*/true)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "advertise address '", o.advertise, "' is not HOST:PORT with a port from 1 to 65535"));
  }
  // Before anything starts: a port below -1 turned the metrics off without
  // a word (only -1 means off), one above 65535 failed once the gRPC server
  // served.
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", o.metrics_port,
                                                   " is not -1 (no metrics) or a port 0 to 65535"));
  }
  HAP_RETURN_IF_ERROR(m.metrics.Init(&m.core_ptr, &m.service_ptr));
  StateBackend::Loaded loaded;
  if (!o.database.empty()) {
    HAP_ASSIGN_OR_RETURN(m.backend, OpenSqliteBackend(o.database));
    HAP_ASSIGN_OR_RETURN(loaded, m.backend->Load());
  }
  PlannerCoreOptions co = o.core;
  co.sink = m.backend.get();
  co.on_plan_done = [&m](const v1::Plan& p) { m.metrics.PlanDone(p); };
  co.plans_in_use = [&m] { return m.PlansInUse(); };
  co.load_plan = [&m](const std::string& name) { return m.backend->LoadPlan(name); };
  HAP_ASSIGN_OR_RETURN(m.core, PlannerCore::Create(co, std::move(loaded.nodes),
                                                   std::move(loaded.plans)));
  m.core_ptr = m.core.get();
  for (const std::string& note : m.core->StartNotes()) std::cerr << "hap-planner: " << note << "\n";

  HAP_ASSIGN_OR_RETURN(
      std::shared_ptr<grpc::ServerCredentials> creds,
      MakeServerCredentials(o.security, HealthMethods(),
                            [&m](absl::string_view path) { m.metrics.Refused(path); }));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder b;
  b.AddListeningPort(o.listen, creds, &m.port);
  // gRPC binds with SO_REUSEPORT by default: a second planner on the port
  // would start too, and the kernel would split the clients between them.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.SetMaxReceiveMessageSize(o.max_message_bytes);
  b.SetMaxSendMessageSize(kMaxMessageBytes);
  if (o.max_concurrent_streams > 0) {
    b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, o.max_concurrent_streams);
  }
  {
    for (const auto& [name, value] : KeepaliveArguments(o.keepalive, absl::Milliseconds(100))) {
      b.AddChannelArgument(name, value);
    }
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    // Clients' own pings (hapctl's --keepalive) are taken down to once a
    // second; by default gRPC answers pings more often than every 5 minutes
    // on a quiet call with GOAWAY, which ended the watch it meant to keep.
    b.AddChannelArgument(
        GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
        static_cast<int>(absl::ToInt64Milliseconds(service::kMinClientPingInterval)));
  }
  grpc::ResourceQuota quota("hap-planner");
  quota.SetMaxThreads(std::max(4, o.max_threads));
  b.SetResourceQuota(quota);
  PlannerServiceOptions so;
  so.security = o.security;
  so.deployments = o.deployments;
  so.on_rpc_start = [&m](const std::string& method) { m.metrics.Started(method); };
  so.on_rpc = [&m](const std::string& method, grpc::StatusCode c, double sec) {
    m.metrics.Handled(method, c, sec);
  };
  so.on_step_metric = [&m](const v1::StepMetric& x) { m.metrics.Step(x); };
  so.on_deployment_finished = [&m](const v1::Deployment& d) { m.metrics.DeploymentFinished(d); };
  so.on_job_replan = [&m](const v1::Job&, v1::JobEvent::Reason r) { m.metrics.JobReplan(r); };
  so.on_job_resumed = [&m](const v1::Job&, const v1::JobEvent& e) { m.metrics.JobResumed(e); };
  // The advertised address is known once the port is bound; the service
  // reads it at deploy time.
  m.service = std::make_unique<PlannerServiceImpl>(m.core.get(), m.backend.get(), so,
                                                   std::move(loaded.deployments),
                                                   std::move(loaded.metrics),
                                                   std::move(loaded.jobs));
  m.service_ptr = m.service.get();
  b.RegisterService(m.service.get());
  m.server = b.BuildAndStart();
  if (!m.server || m.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", o.listen, " (address in use or invalid)"));
  }
  m.advertised = o.advertise.empty() ? ListenAddressToAdvertise(o.listen, m.port) : o.advertise;
  m.listening = ListenHostWithPort(o.listen, m.port);
  m.service->set_advertise_address(m.advertised);
  m.service->StartJobs();
  m.server->GetHealthCheckService()->SetServingStatus(kService, true);
  m.server->GetHealthCheckService()->SetServingStatus(true);
  if (o.metrics_port >= 0) {
    metrics::MetricsHttpServerOptions ho;
    ho.bind_address = o.metrics_address;
    ho.port = o.metrics_port;
    // The status page shows the cluster and plans: behind the token when
    // there is one (/metrics and /healthz stay open).
    ho.token = o.security.token;
    // With TLS for gRPC, HTTPS with the same certificate: the token would
    // otherwise cross the network in clear.
    ho.tls_cert_file = o.security.tls_cert_file;
    ho.tls_key_file = o.security.tls_key_file;
    m.http = std::make_unique<metrics::MetricsHttpServer>(&m.metrics.registry, ho);
    // The status page for people; the core and service outlive the HTTP
    // server (Shutdown stops it first).
    HAP_RETURN_IF_ERROR(m.http->AddHandler(
        "/", [sources = StatusSourcesFor(m.core.get(), m.service.get())](
                 absl::string_view path) { return ServeStatusPage(sources, path); }));
    HAP_RETURN_IF_ERROR(m.http->Start());
  }
  {
    absl::MutexLock l(&m.service_mu);
    m.service_up = true;
  }
  // Retention by age needs a clock tick, not a new plan. The first pass,
  // before Start returns, trims what a restart loaded (a lower
  // --plan-retention-count, or a kill before the last trim was saved)
  // before the first list is answered.
  auto retain = [&m] {
    const absl::Time now = absl::Now();
    absl::StatusOr<int> gone = m.service->EnforceDeploymentRetention(
        m.o.deployment_retention_count, OldestKept(now, m.o.deployment_retention_age));
    if (!gone.ok()) std::cerr << "hap-planner: " << gone.status().message() << "\n";
    absl::StatusOr<int> jobs_gone = m.service->EnforceJobRetention(
        m.o.job_retention_count, OldestKept(now, m.o.job_retention_age));
    if (!jobs_gone.ok()) std::cerr << "hap-planner: " << jobs_gone.status().message() << "\n";
    absl::StatusOr<int> deleted = m.core->EnforceRetention();
    if (!deleted.ok()) std::cerr << "hap-planner: " << deleted.status().message() << "\n";
  };
  retain();
  m.retention = std::thread([&m, retain] {
    while (!m.stop_retention.WaitForNotificationWithTimeout(m.o.retention_interval)) retain();
  });
  return s;
}

std::string ListenAddressToAdvertise(const std::string& listen, int port) {
  return AdvertisedAddress(ListenHostWithPort(listen, port));
}

PlannerServer::~PlannerServer() {
  if (impl_) Shutdown();
}

int PlannerServer::port() const { return impl_->port; }
int PlannerServer::metrics_port() const { return impl_->http ? impl_->http->port() : -1; }
std::string PlannerServer::address() const {
  return absl::StrCat("127.0.0.1:", impl_->port);
}
const std::string& PlannerServer::listen_address() const { return impl_->listening; }
const std::string& PlannerServer::advertised_address() const { return impl_->advertised; }
PlannerCore& PlannerServer::core() { return *impl_->core; }

void PlannerServer::Shutdown() {
  Impl& m = *impl_;
  {
    absl::MutexLock l(&m.mu);
    if (m.shut) return;
    m.shut = true;
  }
  if (m.server) {
    m.server->GetHealthCheckService()->SetServingStatus(kService, false);
    m.server->GetHealthCheckService()->SetServingStatus(false);
    absl::SleepFor(m.o.drain);
  }
  if (m.service) m.service->Shutdown();
  if (m.server) {
    m.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    m.server->Wait();
  }
  if (m.http) m.http->Stop();
  m.stop_retention.Notify();
  if (m.retention.joinable()) m.retention.join();
  {
    absl::MutexLock l(&m.service_mu);
    m.service_up = false;
  }
  m.service_ptr = nullptr;
  m.service.reset();
  m.core.reset();
  m.core_ptr = nullptr;
  m.done.Notify();
}

void PlannerServer::Wait() { impl_->done.WaitForNotification(); }

}  // namespace hap::service
