#include "tools/hapctl_client.h"

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <set>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cli_args.h"
#include "common/grpc_util.h"
#include "common/status_macros.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "tools/hapctl_graph.h"
#include "tools/hapctl_optimizer.h"
#include "tools/hapctl_output.h"

namespace hap::tools {
namespace {

namespace v1 = ::hap::v1;
using service::Security;

constexpr char kDefaultServer[] = "127.0.0.1:7070";
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

constexpr char kUsage[] = R"(usage:
  hapctl get nodes|plans|deployments|jobs
  hapctl describe plan|deployment|job|node NAME
  hapctl create plan (--model NAME [--layers N ...] | --graph FILE) [--devices ID,...]
                     [--batch N] [--baseline hap|dp-even|dp-prop|megatron|zero3]
                     [--no-sfb] [--no-zero] [--no-grouped] [--no-calibration] [--max-seconds S]
                     [--overlap on|off] [--pipeline off|auto|N] [--microbatches N]
                     [--precision fp32|bf16] [--gradient-precision fp32|bf16]
                     [--optimizer sgd|momentum|adam] [--lr X] [--momentum X]
                     [--clip-norm X] [--weight-decay X] [--beta1 X] [--beta2 X] [--epsilon X]
                     [--seed N] [--ignore-memory]
                     [--max-states N] [--id ID] [--wait]
  hapctl watch plan NAME              (until it ends, or --timeout when given)
  hapctl cancel plan NAME
  hapctl delete plan NAME
  hapctl delete node NAME              (its devices leave the cluster)
  hapctl deploy plan NAME --executor DEVICE=HOST:PORT ... [--steps N]
                     [--data synthetic|wikitext|npy:DIR|tokens:FILE[:uint16|uint32]]
                     [--data-path FILE (wikitext)] [--shuffle SEED (npy:, tokens:)]
                     [--threads T] [--log-every N (executor logs; default 100)]
                     [--checkpoint-dir DIR [--checkpoint-every N] [--checkpoint-keep K]]
                     [--resume DIR | --init-weights FILE.safetensors]
  hapctl stop deployment NAME
  hapctl delete deployment NAME        (a finished one, with its step metrics)
  hapctl create job --id ID (--model NAME [...] | --graph FILE) [--batch N] [plan flags]
                     --checkpoint-dir DIR [--checkpoint-every N] [--checkpoint-keep K]
                     [--steps N] [--data ...] [--data-path FILE] [--shuffle SEED] [--threads T]
                     [--log-every N] [--executor DEVICE=HOST:PORT ...] [--devices ID,...]
                     [--label KEY=VALUE ...] [--min-devices N]
                     [--max-devices N] [--min-gain FRACTION] [--no-join]
                     [--join-stable SECONDS] [--max-replans N]
                     [--slowdown-threshold FRACTION] [--no-slowdown]
  hapctl watch job NAME               (until it ends, or --timeout when given)
  hapctl stop job NAME
  hapctl delete job NAME               (a finished one: SUCCEEDED, FAILED or STOPPED)
Common flags: --server HOST:PORT (else $HAPCTL_SERVER, else 127.0.0.1:7070),
  --timeout SECONDS (each call's; default 30; a watch's only when given),
  --keepalive SECONDS (pings on an open call; a planner that stops answering
  ends it after this and at most 20 s more; default 30),
  --token-file FILE (else $HAP_TOKEN_FILE),
  --tls-ca-file FILE, -o table|json|yaml. Errors go to stderr, exit code 1.
)";

struct Client {
  std::unique_ptr<v1::Planner::Stub> stub;
  Security security;
  absl::Duration timeout = absl::Seconds(30);
  // The watches' bound: --timeout when given, else none (a watch lasts
  // until what it watches ends).
  absl::Duration watch_timeout = absl::InfiniteDuration();
  std::string format = "table";

  void Prepare(grpc::ClientContext* ctx) const {
    service::PrepareClientContext(ctx, security, timeout);
  }
};

using tools::Fail;  // hapctl_output.h's, of an absl::Status
int Fail(const grpc::Status& s) { return Fail(service::FromGrpc(s)); }

// A call's error; at its deadline, which one and where it comes from (gRPC
// says "Deadline Exceeded" alone).
int FailCall(const Client& c, const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return Fail(absl::DeadlineExceededError(
        absl::StrCat("no answer from the planner within --timeout ",
                     absl::ToDoubleSeconds(c.timeout), " s (", s.error_message(), ")")));
  }
  return Fail(s);
}


// OK when `server` is an address gRPC reads as it was meant: HOST:PORT
// (an IPv6 host in brackets) with a port from 1 to 65535, or a gRPC target
// with its scheme (dns:///H:P, unix:PATH, ipv4:A:P). gRPC took a port past
// 65535 modulo 65536 ('127.0.0.1:99999' called port 34463), and none or a
// word as port 0; an empty --server fell back to HAPCTL_SERVER or the
// default. The error names `source`, the flag or variable it came from.
absl::Status CheckServer(const std::string& source, const std::string& server) {
  if (service::IsHostPort(server, 1, /*schemes=*/true)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(source,
                   " must be HOST:PORT with a port from 1 to 65535 (or a gRPC target "
                   "such as unix:PATH), got '",
                   server, "'"));
}

absl::StatusOr<Client> Connect(const Args& a) {
  Client c;
  std::string server = a.Get("server");
  std::string source = "--server";
  if (!a.Has("server")) {
    const char* env = std::getenv("HAPCTL_SERVER");
    const bool from_env = env != nullptr && *env != '\0';  // set empty: as unset
    server = from_env ? env : kDefaultServer;
    source = from_env ? "HAPCTL_SERVER" : "the default server";
  }
  HAP_RETURN_IF_ERROR(CheckServer(source, server));
  HAP_ASSIGN_OR_RETURN(c.security.token, service::ReadTokenFile(a.GetOrEnv("token-file", "")));
  c.security.tls_ca_file = a.GetOrEnv("tls-ca-file", "");
  HAP_ASSIGN_OR_RETURN(double t, a.Number("timeout", 30));
  if (!(t > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--timeout must be a positive number of seconds, got '", a.Get("timeout"), "'"));
  }
  c.timeout = absl::Seconds(t);
  if (a.Has("timeout")) c.watch_timeout = c.timeout;
  c.format = a.Get("o", a.Get("output", "table"));
  if (c.format != "table" && c.format != "json" && c.format != "yaml") {
    return absl::InvalidArgumentError(
        absl::StrCat("-o must be table, json or yaml, got '", c.format, "'"));
  }
  // A planner whose host died or hung mid-call (no TCP reset) ends the
  // call after a ping goes unanswered; a watch without --timeout waited
  // for ever.
  HAP_ASSIGN_OR_RETURN(double keepalive, a.Number("keepalive", 30));
  if (!(keepalive >= 1 && keepalive <= 86400)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--keepalive must be seconds from 1 to 86400, got '", a.Get("keepalive"), "'"));
  }
  HAP_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> ch,
                       service::MakeChannel(server, c.security, absl::Seconds(keepalive)));
  c.stub = v1::Planner::NewStub(ch);
  return c;
}

std::string JobName(const std::string& s) { return s.rfind("jobs/", 0) == 0 ? s : "jobs/" + s; }

std::string PlanName(const std::string& s) {
  return s.rfind("plans/", 0) == 0 ? s : "plans/" + s;
}
std::string DeploymentName(const std::string& s) {
  return s.rfind("deployments/", 0) == 0 ? s : "deployments/" + s;
}

// Every page of a List call (`call(ctx, request, page)`), the items
// (`items(response)`) appended to `all` in order. A planner that answers
// with a page token it gave before is an error (the loop asked for that
// page again for ever).
template <typename Request, typename Response, typename Call, typename Items>
grpc::Status ListEveryPage(const Client& c, Call call, Items items, Response* all) {
  std::string token;
  std::set<std::string> seen;
  do {
    if (!seen.insert(token).second) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("the planner answered with the page token '", token,
                                       "' twice; the list would never end"));
    }
    Request r;
    r.set_page_token(token);
    Response page;
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    grpc::Status s = call(&ctx, r, &page);
    if (!s.ok()) return s;
    for (auto& x : *items(page)) *items(*all)->Add() = std::move(x);
    token = page.next_page_token();
  } while (!token.empty());
  return grpc::Status::OK;
}

int Get(Client& c, const std::string& what) {
  if (what == "nodes" || what == "node") {
    v1::ListNodesResponse all;
    grpc::Status s = ListEveryPage<v1::ListNodesRequest>(
        c,
        [&](grpc::ClientContext* ctx, const v1::ListNodesRequest& r, v1::ListNodesResponse* out) {
          return c.stub->ListNodes(ctx, r, out);
        },
        [](v1::ListNodesResponse& r) { return r.mutable_nodes(); }, &all);
    if (!s.ok()) return FailCall(c, s);
    if (c.format != "table") {
      return PrintMessage(all, c.format);
    }
    std::cout << absl::StrFormat("%-20s %-7s %-22s %8s %14s %s\n", "NAME", "STATE", "ADDRESS",
                                 "DEVICES", "TFLOP/S", "LAST HEARTBEAT");
    for (const auto& n : all.nodes()) {
      double flops = 0;
      for (const auto& d : n.devices()) {
        for (const auto& f : d.flops()) flops += f.dtype() == v1::FLOAT32 ? f.flops() : 0;
      }
      std::cout << absl::StrFormat("%-20s %-7s %-22s %8d %14.3f %s\n", n.name(),
                                   v1::Node::State_Name(n.state()), n.address(),
                                   n.devices_size(), flops / 1e12, Ts(n.last_heartbeat()));
    }
    return 0;
  }
  if (what == "plans" || what == "plan") {
    v1::ListPlansResponse all;
    grpc::Status s = ListEveryPage<v1::ListPlansRequest>(
        c,
        [&](grpc::ClientContext* ctx, const v1::ListPlansRequest& r, v1::ListPlansResponse* out) {
          return c.stub->ListPlans(ctx, r, out);
        },
        [](v1::ListPlansResponse& r) { return r.mutable_plans(); }, &all);
    if (!s.ok()) return FailCall(c, s);
    if (c.format != "table") {
      return PrintMessage(all, c.format);
    }
    PrintPlanHeader();
    for (const auto& p : all.plans()) PrintPlanRow(p);
    return 0;
  }
  if (what == "deployments" || what == "deployment") {
    v1::ListDeploymentsResponse resp;  // every page (it printed the first 50 only)
    grpc::Status s = ListEveryPage<v1::ListDeploymentsRequest>(
        c,
        [&](grpc::ClientContext* ctx, const v1::ListDeploymentsRequest& r,
            v1::ListDeploymentsResponse* out) { return c.stub->ListDeployments(ctx, r, out); },
        [](v1::ListDeploymentsResponse& r) { return r.mutable_deployments(); }, &resp);
    if (!s.ok()) return FailCall(c, s);
    if (c.format != "table") {
      return PrintMessage(resp, c.format);
    }
    PrintDeploymentHeader();
    for (const auto& d : resp.deployments()) PrintDeploymentRow(d);
    return 0;
  }
  if (what == "jobs" || what == "job") {
    v1::ListJobsResponse all;
    grpc::Status s = ListEveryPage<v1::ListJobsRequest>(
        c,
        [&](grpc::ClientContext* ctx, const v1::ListJobsRequest& r, v1::ListJobsResponse* out) {
          return c.stub->ListJobs(ctx, r, out);
        },
        [](v1::ListJobsResponse& r) { return r.mutable_jobs(); }, &all);
    if (!s.ok()) return FailCall(c, s);
    if (c.format != "table") {
      return PrintMessage(all, c.format);
    }
    PrintJobHeader();
    for (const auto& j : all.jobs()) PrintJobRow(j);
    return 0;
  }
  return Fail(absl::InvalidArgumentError(
      absl::StrCat("cannot get '", what, "': use nodes, plans, deployments or jobs")));
}

absl::StatusOr<v1::CreatePlanRequest> CreateRequest(const Args& a) {
  v1::CreatePlanRequest r;
  if (a.Has("graph")) {
    // Read once: the file was read again to be sent, and a pipe
    // ('--graph <(...)') had nothing left, so an empty graph was sent.
    HAP_ASSIGN_OR_RETURN(*r.mutable_model()->mutable_graph(), LoadGraphFile(a));
  } else {
    std::string model = a.Get("model", "gpt");
    auto* zoo = r.mutable_model()->mutable_zoo();
    zoo->set_name(model);
    HAP_ASSIGN_OR_RETURN(auto params, ZooOverrides(a));  // --moe-group-size, --set k=v
    zoo->mutable_params()->insert(params.begin(), params.end());
  }
  if (a.Has("devices")) {
    for (absl::string_view d : absl::StrSplit(a.Get("devices"), ',', absl::SkipEmpty())) {
      r.add_devices(std::string(d));
    }
    // An empty list was sent as none: every live device.
    if (r.devices().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices names no device, got '", a.Get("devices"),
                       "' (without --devices the plan takes every live device)"));
    }
  }
  v1::PlanOptions* o = r.mutable_options();
  std::string b = a.Get("baseline", "hap");
  if (b == "dp-even") {
    o->set_baseline(v1::DP_EVEN);
  } else if (b == "dp-prop") {
    o->set_baseline(v1::DP_PROPORTIONAL);
  } else if (b == "megatron") {
    o->set_baseline(v1::MEGATRON);
  } else if (b == "zero3") {
    o->set_baseline(v1::ZERO3);
  } else if (b != "hap") {
    return absl::InvalidArgumentError(absl::StrCat("--baseline '", b, "' is not known"));
  }
  o->set_disable_sfb(a.Bool("no-sfb"));
  o->set_disable_zero(a.Bool("no-zero"));
  o->set_disable_grouped_collectives(a.Bool("no-grouped"));
  o->set_ignore_calibration(a.Bool("no-calibration"));
  const std::string overlap = a.Get("overlap", "off");
  if (overlap != "on" && overlap != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--overlap must be on or off, got '", overlap, "'"));
  }
  o->set_overlap_communication(overlap == "on");
  // Pipeline stages (README "Pipeline plans"): off by default, as the
  // executors cannot run them yet.
  const std::string pipe = a.Get("pipeline", "off");
  int stages = 0;
  if (pipe == "auto") {
    o->set_pipeline(v1::PlanOptions::PIPELINE_AUTO);
  } else if (absl::SimpleAtoi(pipe, &stages) && stages >= 1) {
    o->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
    o->set_pipeline_stages(stages);
  } else if (pipe != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--pipeline must be off, auto or a stage count >= 1, got '", pipe, "'"));
  }
  // As hapctl plan takes them: a microbatch count without pipeline stages
  // was sent and never read, and the planner took 0 (a count, or seconds)
  // as its default.
  HAP_ASSIGN_OR_RETURN(int64_t micro, a.Integer("microbatches", 0, 0, kMaxInt32));
  if (a.Has("microbatches")) {
    if (micro < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--microbatches must be a positive integer, got '", a.Get("microbatches"), "'"));
    }
    if (o->pipeline() == v1::PlanOptions::PIPELINE_OFF) {
      return absl::InvalidArgumentError("--microbatches needs --pipeline auto or N");
    }
  }
  o->set_pipeline_microbatches(static_cast<int>(micro));
  HAP_ASSIGN_OR_RETURN(double ms, a.Number("max-seconds", 0));
  if (a.Has("max-seconds") && !(ms > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-seconds must be positive, got '", a.Get("max-seconds"), "'"));
  }
  o->mutable_budget()->set_max_seconds(ms);
  HAP_ASSIGN_OR_RETURN(int64_t states, a.Integer("max-states", 0, 1, kMaxInt64));
  o->mutable_budget()->set_max_states(states);
  o->set_ignore_memory_limits(a.Bool("ignore-memory"));
  // As hapctl plan takes them (README "Precision"); fp32 is the default.
  for (const auto& [flag, field] :
       {std::pair<const char*, void (v1::PlanOptions::*)(v1::Precision)>{
            "precision", &v1::PlanOptions::set_precision},
        {"gradient-precision", &v1::PlanOptions::set_gradient_precision}}) {
    const std::string p = a.Get(flag, "fp32");
    if (p != "fp32" && p != "bf16") {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be fp32 or bf16, got '", p, "'"));
    }
    if (p == "bf16") (o->*field)(v1::PRECISION_BF16);
  }
  HAP_ASSIGN_OR_RETURN(*o->mutable_optimizer(), OptimizerFromFlags(a));
  HAP_ASSIGN_OR_RETURN(int64_t seed, a.Integer("seed", 0, 0, kMaxInt64));
  o->set_seed(static_cast<uint64_t>(seed));
  r.set_plan_id(a.Get("id"));
  r.set_wait(a.Bool("wait"));
  return r;
}

// The training flags of `deploy plan` and `create job`.
absl::StatusOr<v1::TrainingConfig> TrainingFromArgs(const Args& a) {
  v1::TrainingConfig t;
  HAP_ASSIGN_OR_RETURN(int64_t steps, a.Integer("steps", 100, 1, kMaxInt64));
  // 0 (not given): each executor's own --threads, the threads its node's
  // agent measured with; 1 made CPU ranks run several times slower than
  // the plan predicted.
  HAP_ASSIGN_OR_RETURN(int64_t threads, a.Integer("threads", 0, 0, 4096));
  // Each executor daemon's log of its rank's steps; 0 (not given): every
  // 100th.
  HAP_ASSIGN_OR_RETURN(int64_t log_every, a.Integer("log-every", 0, 1, kMaxInt32));
  t.set_steps(steps);
  t.set_threads_per_rank(static_cast<int>(threads));
  t.set_log_every(static_cast<int>(log_every));
  const std::string data = a.Get("data", "synthetic");
  const bool spec = absl::StartsWith(data, "npy:") || absl::StartsWith(data, "tokens:");
  if (data == "wikitext") {
    t.set_data(v1::TrainingConfig::WIKITEXT2);
  } else if (data == "synthetic") {
    t.set_data(v1::TrainingConfig::SYNTHETIC);
  } else if (spec) {
    t.set_data_spec(data);  // its files are checked by the executors, on their hosts
  } else {
    // An empty spec was sent as synthetic data; another word reached every
    // executor, and the deployment failed rank by rank.
    return absl::InvalidArgumentError(absl::StrCat(
        "--data must be synthetic, wikitext, npy:DIR or tokens:FILE[:uint16|uint32], got '", data,
        "'"));
  }
  // The executors read data_path for WikiText-2 alone and shuffle user data
  // alone: '--data npy:D --data-path X' ran on D (and '--shuffle' with
  // synthetic or wikitext data, below, failed every rank once deployed).
  if (a.Has("data-path") && data != "wikitext") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data-path is the WikiText-2 directory or split of --data wikitext; with --data ", data,
        " it would be ignored", spec ? " (the spec names its files)" : ""));
  }
  t.set_data_path(a.Get("data-path"));
  HAP_ASSIGN_OR_RETURN(int64_t every, a.Integer("checkpoint-every", 0, 0, kMaxInt64));
  HAP_ASSIGN_OR_RETURN(int64_t keep, a.Integer("checkpoint-keep", 0, 0, kMaxInt32));
  // Without a directory the executors save nothing, and they read a keep
  // of 0 as their default, 3: both were sent and dropped.
  for (const char* flag : {"checkpoint-every", "checkpoint-keep"}) {
    if (a.Has(flag) && a.Get("checkpoint-dir").empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " needs --checkpoint-dir (without it nothing is saved)"));
    }
  }
  if (a.Has("checkpoint-keep") && keep == 0) {
    return absl::InvalidArgumentError(
        "--checkpoint-keep 0 would be 3, the executors' default (a deployment reads 0 as "
        "unset); give at least 1");
  }
  t.set_checkpoint_dir(a.Get("checkpoint-dir"));
  t.set_checkpoint_every(every);
  t.set_checkpoint_keep(static_cast<int>(keep));
  // As hap-launch refuses them: an executor given both resumed and never
  // read the weights.
  if (a.Has("resume") && a.Has("init-weights")) {
    return absl::InvalidArgumentError(
        "--resume and --init-weights exclude each other (a resumed run takes its checkpoint's "
        "parameters; --init-weights would be ignored)");
  }
  t.set_resume(a.Get("resume"));
  t.set_init_weights(a.Get("init-weights"));
  if (a.Has("shuffle")) {
    HAP_ASSIGN_OR_RETURN(int64_t seed, a.Integer("shuffle", 0, 0, kMaxInt64));
    if (!spec) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shuffle applies to --data npy:DIR and tokens:FILE only, not --data ", data));
    }
    t.set_shuffle(true);
    t.set_shuffle_seed(static_cast<uint64_t>(seed));
  }
  return t;
}

// `create job`: the model and plan options as `create plan`, training as
// `deploy plan`, the device selector and the re-plan policy.
// --executor DEVICE=HOST:PORT (repeatable) into `out`: both halves given,
// a device named once.
absl::Status ExecutorsFromArgs(const Args& a,
                               google::protobuf::Map<std::string, std::string>* out) {
  for (const std::string& e : a.GetAll("executor")) {
    std::pair<std::string, std::string> kv = absl::StrSplit(e, absl::MaxSplits('=', 1));
    if (kv.first.empty() || kv.second.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--executor ", e, ": expected DEVICE=HOST:PORT"));
    }
    // The planner dials it as hapctl dials --server: 'cpu0=h:99999' sent
    // it to port 34463.
    HAP_RETURN_IF_ERROR(
        CheckServer(absl::StrCat("--executor ", kv.first, "=HOST:PORT"), kv.second));
    if (!out->insert({kv.first, kv.second}).second) {
      return absl::InvalidArgumentError(absl::StrCat("--executor names device ", kv.first,
                                                     " twice (", out->at(kv.first), ", ", kv.second,
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateJobRequest> JobRequest(const Args& a) {
  HAP_ASSIGN_OR_RETURN(v1::CreatePlanRequest plan, CreateRequest(a));
  v1::CreateJobRequest r;
  r.set_job_id(a.Get("id"));
  v1::JobSpec& s = *r.mutable_spec();
  *s.mutable_model() = plan.model();
  *s.mutable_options() = plan.options();
  HAP_ASSIGN_OR_RETURN(*s.mutable_training(), TrainingFromArgs(a));
  HAP_ASSIGN_OR_RETURN(int64_t batch, a.Integer("global-batch", 0, 0, kMaxInt64));
  s.set_global_batch(batch);
  v1::DeviceSelector& sel = *s.mutable_devices();
  *sel.mutable_devices() = plan.devices();
  for (const std::string& kv : a.GetAll("label")) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first.empty() || kv.find('=') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--label ", kv, ": not KEY=VALUE"));
    }
    (*sel.mutable_node_labels())[p.first] = p.second;
  }
  HAP_RETURN_IF_ERROR(ExecutorsFromArgs(a, s.mutable_executors()));
  // The job spec reads 0 in these fields as the planner's default, and
  // under 2 devices as 2: given so, '--join-stable 0' (or 1e-10, rounded to 0 ns) waited 30 s.
  // Each such value is refused naming what it would have been.
  const auto defaulted = [&](const char* flag, const std::string& is) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", a.Get(flag), " would be ", is,
                     " (the job spec reads 0 as the planner's default); give more"));
  };
  HAP_ASSIGN_OR_RETURN(int64_t min_devices, a.Integer("min-devices", 0, 0, kMaxInt32));
  HAP_ASSIGN_OR_RETURN(int64_t max_devices, a.Integer("max-devices", 0, 0, kMaxInt32));
  if (a.Has("min-devices") && min_devices < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--min-devices ", a.Get("min-devices"),
                     " would be 2: a plan takes two devices or more; give at least 2"));
  }
  sel.set_min_devices(static_cast<int>(min_devices));
  sel.set_max_devices(static_cast<int>(max_devices));
  v1::ReplanPolicy& p = *s.mutable_replan();
  if (a.Has("min-gain")) {  // 0: any faster plan (unset: the planner's 10%)
    HAP_ASSIGN_OR_RETURN(double gain, a.Number("min-gain", 0));
    p.set_min_gain(gain);
  }
  p.set_disable_join(a.Bool("no-join"));
  HAP_ASSIGN_OR_RETURN(double stable, a.Number("join-stable", 0));
  constexpr int64_t kMaxDurationSeconds = 315576000000;  // google.protobuf.Duration's
  if (!(stable >= 0 && stable <= kMaxDurationSeconds)) {
    return absl::InvalidArgumentError(absl::StrCat("flag --join-stable must be from 0 to ",
                                                   kMaxDurationSeconds, " seconds, got '",
                                                   a.Get("join-stable"), "'"));
  }
  p.mutable_join_stable()->set_seconds(static_cast<int64_t>(stable));
  p.mutable_join_stable()->set_nanos(
      static_cast<int32_t>((stable - static_cast<int64_t>(stable)) * 1e9));
  if (a.Has("join-stable") && p.join_stable().seconds() == 0 && p.join_stable().nanos() == 0) {
    return defaulted("join-stable", "30 s");
  }
  if (a.Has("max-replans")) {  // 0: none (the first lost rank fails the job)
    HAP_ASSIGN_OR_RETURN(int64_t replans, a.Integer("max-replans", 0, 0, kMaxInt32));
    p.set_max_replans(static_cast<int>(replans));
  }
  HAP_ASSIGN_OR_RETURN(double slowdown, a.Number("slowdown-threshold", 0));
  if (!(slowdown >= 0)) {
    return absl::InvalidArgumentError("--slowdown-threshold must be a fraction >= 0");
  }
  if (a.Has("slowdown-threshold") && slowdown == 0) {
    return defaulted("slowdown-threshold", "0.25 (25% slower)");
  }
  p.set_slowdown_threshold(slowdown);
  p.set_disable_slowdown(a.Bool("no-slowdown"));
  return r;
}

// A watch's error; at its --timeout, which one.
int FailWatch(const Client& c, const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      c.watch_timeout != absl::InfiniteDuration()) {
    return Fail(absl::DeadlineExceededError(
        absl::StrCat("still watching at --timeout ", absl::ToDoubleSeconds(c.watch_timeout),
                     " s (without --timeout, a watch lasts until what it watches ends)")));
  }
  return Fail(s);
}

// Reads a watch's stream to its end, printing each message as it comes:
// `table_line` of it, else the record (JSON waited for a full buffer). The
// last message is left in `last`. Standard output failing (a full disk)
// ends the watch, which went on until what it watched ended, writing into
// nothing; main names the error.
template <typename Msg>
int ReadWatch(const Client& c, grpc::ClientContext& ctx, grpc::ClientReader<Msg>& reader,
              const std::function<std::string(const Msg&)>& table_line, Msg* last) {
  while (reader.Read(last)) {
    int rc = 0;
    if (c.format == "table") {
      std::cout << table_line(*last) << std::flush;
    } else {
      rc = PrintMessage(*last, c.format);
      std::cout.flush();
    }
    if (rc == 0 && !std::cout) rc = 1;
    if (rc != 0) {
      ctx.TryCancel();
      reader.Finish();  // CANCELLED, by us: the error is the printing's
      return rc;
    }
  }
  grpc::Status s = reader.Finish();
  return s.ok() ? 0 : FailWatch(c, s);
}

int WatchJob(Client& c, const std::string& name) {
  v1::WatchJobRequest r;
  r.set_name(JobName(name));
  grpc::ClientContext ctx;
  service::PrepareClientContext(&ctx, c.security, c.watch_timeout);
  auto reader = c.stub->WatchJob(&ctx, r);
  v1::Job j;
  const int rc = ReadWatch<v1::Job>(
      c, ctx, *reader,
      [](const v1::Job& j) {
        const v1::JobStatus& s = j.status();
        return absl::StrFormat("%s %-10s gen %d devices %d steps %d/%d replans %d %s\n",
                               Ts(s.update_time()), JobState(j), s.generation(), s.devices_size(),
                               s.steps_done(), j.spec().training().steps(), s.replans(),
                               s.message());
      },
      &j);
  if (rc != 0) return rc;
  if (j.status().state() == v1::JobStatus::FAILED) {
    std::cerr << "error: the job failed: " << j.status().message() << "\n";
    return 1;
  }
  return 0;
}

int Watch(Client& c, const std::string& name) {
  v1::WatchPlanRequest r;
  r.set_name(PlanName(name));
  grpc::ClientContext ctx;
  service::PrepareClientContext(&ctx, c.security, c.watch_timeout);
  auto reader = c.stub->WatchPlan(&ctx, r);
  v1::Plan p;
  const int rc = ReadWatch<v1::Plan>(
      c, ctx, *reader,
      [](const v1::Plan& p) {
        return absl::StrFormat("%-10s states %10d best %.4f s iteration %d\n",
                               v1::Plan::State_Name(p.state()), p.progress().states_expanded(),
                               p.progress().best_cost_seconds(), p.progress().joint_iteration());
      },
      &p);
  if (rc != 0) return rc;
  if (p.state() == v1::Plan::FAILED) {
    std::cerr << "error: the plan failed: " << p.error() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

// The flags each command takes (RunClient reads the union, then refuses a
// flag of another command: 'create plan --steps 5' or 'get plans --wait'
// were dropped).
struct ClientFlags {
  std::set<std::string> values, bools;
  void Add(const ClientFlags& other) {
    values.insert(other.values.begin(), other.values.end());
    bools.insert(other.bools.begin(), other.bools.end());
  }
};

ClientFlags FlagsOf(const std::string& verb, const std::string& kind) {
  ClientFlags f{{"server", "timeout", "keepalive", "token-file", "tls-ca-file", "o", "output"},
                {"help"}};
  ClientFlags plan{
      {"model",    "graph",        "devices",   "baseline", "max-seconds", "overlap",
       "pipeline", "microbatches", "optimizer", "lr",       "clip-norm",   "weight-decay",
       "beta1",    "beta2",        "epsilon",   "seed",     "precision",   "gradient-precision",
       "momentum", "max-states",   "id",        "set"},
      {"no-sfb", "no-zero", "no-grouped", "no-calibration", "ignore-memory"}};
  const std::set<std::string> zoo = ZooParamFlags();
  plan.values.insert(zoo.begin(), zoo.end());
  const ClientFlags training{
      {"executor", "steps", "data", "data-path", "threads", "log-every", "checkpoint-dir",
       "checkpoint-every", "checkpoint-keep", "resume", "init-weights", "shuffle"},
      {}};
  const ClientFlags job{{"global-batch", "label", "min-devices", "max-devices", "min-gain",
                         "join-stable", "max-replans", "slowdown-threshold"},
                        {"no-join", "no-slowdown"}};
  if (verb == "create" && kind == "plan") {
    f.Add(plan);
    f.bools.insert("wait");
  } else if (verb == "create" && kind == "job") {
    f.Add(plan);
    f.Add(training);
    f.Add(job);
    // A job resumes from its --checkpoint-dir by itself (the planner
    // refused these only after the call).
    f.values.erase("resume");
    f.values.erase("init-weights");
  } else if (verb == "deploy") {
    f.Add(training);
  } else if (verb.empty()) {  // every command's
    f.Add(plan);
    f.Add(training);
    f.Add(job);
    f.bools.insert("wait");
  }
  return f;
}

int RunClient(const std::string& verb, const std::vector<std::string>& argv) {
  const ClientFlags every = FlagsOf("", "");
  auto a = Args::Parse(argv, every.values, every.bools);
  if (!a.ok()) return Fail(a.status());
  if (a->Bool("help")) {
    std::cout << kUsage;
    return 0;
  }
  const auto& pos = a->positional();
  // Each verb takes its kinds of resource only (a kind it does not take
  // used to fall through to the plan's or the deployment's call).
  static const auto* const kKinds = new std::map<std::string, std::vector<std::string>>{
      {"get", {"nodes", "node", "plans", "plan", "deployments", "deployment", "jobs", "job"}},
      {"describe", {"plan", "deployment", "job", "node"}},
      {"create", {"plan", "job"}},
      {"watch", {"plan", "job"}},
      {"cancel", {"plan"}},
      {"delete", {"plan", "node", "nodes", "job", "deployment"}},
      {"deploy", {"plan"}},
      {"stop", {"deployment", "job"}},
  };
  if (auto kinds = kKinds->find(verb); kinds != kKinds->end() && !pos.empty() &&
                                       absl::c_find(kinds->second, pos[0]) == kinds->second.end()) {
    std::cerr << "error: hapctl " << verb << ": '" << pos[0] << "' is not one of "
              << absl::StrJoin(kinds->second, ", ") << "\n";
    return 1;
  }
  if (!pos.empty()) {
    const ClientFlags mine = FlagsOf(verb, pos[0]);
    for (const std::set<std::string>* flags : {&every.values, &every.bools}) {
      for (const std::string& flag : *flags) {
        if (a->Has(flag) && !mine.values.count(flag) && !mine.bools.count(flag)) {
          std::cerr << "error: hapctl " << verb << " " << pos[0] << ": "
                    << (flag.size() == 1 ? "-" : "--") << flag
                    << " is not one of its flags (hapctl " << verb << " --help)\n";
          return 1;
        }
      }
    }
  }
  // Words past the kind and the name were dropped ('hapctl delete plan a b'
  // deleted a alone, 'create plan --no-sfb true' planned): named instead.
  const size_t words = verb == "get" || verb == "create" ? 1 : 2;
  if (pos.size() > words) {
    std::cerr << "error: hapctl " << verb << ": unexpected argument '" << pos[words] << "' after '"
              << absl::StrJoin(pos.begin(), pos.begin() + words, " ") << "' ("
              << (verb == "get" && pos.size() == 2
                      // kubectl's 'get node NAME': one resource is describe's.
                      ? absl::StrCat("one resource: hapctl describe ",
                                     absl::StripSuffix(pos[0], "s"), " ", pos[1])
                      : std::string("a flag's value without its flag?"))
              << ")\n";
    return 1;
  }
  auto c = Connect(*a);
  if (!c.ok()) return Fail(c.status());
  auto need = [&](size_t n) {
    if (pos.size() < n) {
      std::cerr << "error: missing arguments\n" << kUsage;
      return false;
    }
    return true;
  };
  if (verb == "get") {
    if (!need(1)) return 1;
    return Get(*c, pos[0]);
  }
  if (verb == "describe") {
    if (!need(2)) return 1;
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    if (pos[0] == "job") {
      v1::GetJobRequest r;
      r.set_name(JobName(pos[1]));
      v1::Job j;
      grpc::Status s = c->stub->GetJob(&ctx, r, &j);
      if (!s.ok()) return FailCall(*c, s);
      if (c->format == "table") {
        DescribeJob(j);
      } else {
        return PrintMessage(j, c->format);
      }
      return 0;
    }
    if (pos[0] == "node") {
      v1::GetClusterRequest r;
      r.set_include_stale(true);
      v1::Cluster cluster;
      grpc::Status s = c->stub->GetCluster(&ctx, r, &cluster);
      if (!s.ok()) return FailCall(*c, s);
      const std::string name =
          pos[1].rfind("nodes/", 0) == 0 ? pos[1].substr(std::string("nodes/").size()) : pos[1];
      auto node =
          absl::c_find_if(cluster.nodes(), [&](const v1::Node& n) { return n.name() == name; });
      if (node == cluster.nodes().end()) {
        return Fail(absl::NotFoundError(absl::StrCat(
            "no node '", name, "' is registered with the planner (hapctl get nodes lists them)")));
      }
      if (c->format != "table") {
        return PrintMessage(*node, c->format);
      }
      v1::ListDeploymentsResponse all;
      s = ListEveryPage<v1::ListDeploymentsRequest>(
          *c,
          [&](grpc::ClientContext* ctx, const v1::ListDeploymentsRequest& r,
              v1::ListDeploymentsResponse* out) { return c->stub->ListDeployments(ctx, r, out); },
          [](v1::ListDeploymentsResponse& r) { return r.mutable_deployments(); }, &all);
      if (!s.ok()) return FailCall(*c, s);
      DescribeNode(*node, cluster, {all.deployments().begin(), all.deployments().end()});
      return 0;
    }
    if (pos[0] == "deployment") {
      v1::GetDeploymentRequest r;
      r.set_name(DeploymentName(pos[1]));
      v1::Deployment d;
      grpc::Status s = c->stub->GetDeployment(&ctx, r, &d);
      if (!s.ok()) return FailCall(*c, s);
      if (c->format != "table") {
        return PrintMessage(d, c->format);
      }
      // The plan's prediction, when the plan is still there (retention
      // keeps a deployment's plan while it is held; an older planner's
      // record may outlive it).
      v1::GetPlanRequest pr;
      pr.set_name(d.plan());
      v1::Plan plan;
      grpc::ClientContext plan_ctx;
      c->Prepare(&plan_ctx);
      const bool have_plan = c->stub->GetPlan(&plan_ctx, pr, &plan).ok();
      DescribeDeployment(d, have_plan ? plan.prediction().step_seconds() : 0);
      return 0;
    }
    v1::GetPlanRequest r;
    r.set_name(PlanName(pos[1]));
    v1::Plan p;
    grpc::Status s = c->stub->GetPlan(&ctx, r, &p);
    if (!s.ok()) return FailCall(*c, s);
    if (c->format == "table") {
      DescribePlan(p);
    } else {
      return PrintMessage(p, c->format);
    }
    return 0;
  }
  if (verb == "create" && pos.size() >= 1 && pos[0] == "job") {
    auto r = JobRequest(*a);
    if (!r.ok()) return Fail(r.status());
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    v1::Job j;
    grpc::Status s = c->stub->CreateJob(&ctx, *r, &j);
    if (!s.ok()) return FailCall(*c, s);
    if (c->format == "table") {
      PrintJobHeader();
      PrintJobRow(j);
    } else {
      return PrintMessage(j, c->format);
    }
    return 0;
  }
  if (verb == "create") {
    if (!need(1)) return 1;
    auto r = CreateRequest(*a);
    if (!r.ok()) return Fail(r.status());
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    v1::Plan p;
    grpc::Status s = c->stub->CreatePlan(&ctx, *r, &p);
    if (!s.ok()) return FailCall(*c, s);
    if (c->format == "table") {
      PrintPlanHeader();
      PrintPlanRow(p);
    } else if (int rc = PrintMessage(p, c->format); rc != 0) {
      return rc;
    }
    return p.state() == v1::Plan::FAILED ? 1 : 0;
  }
  if (verb == "watch") {
    if (!need(2)) return 1;
    if (pos[0] == "job") return WatchJob(*c, pos[1]);
    return Watch(*c, pos[1]);
  }
  if (verb == "cancel" || verb == "delete") {
    if (!need(2)) return 1;
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    grpc::Status s;
    if (verb == "delete" && pos[0] != "plan") {
      std::string name;
      if (pos[0] == "deployment") {
        v1::DeleteDeploymentRequest r;
        r.set_name(name = DeploymentName(pos[1]));
        v1::DeleteDeploymentResponse resp;
        s = c->stub->DeleteDeployment(&ctx, r, &resp);
      } else if (pos[0] == "job") {
        v1::DeleteJobRequest r;
        r.set_name(name = JobName(pos[1]));
        v1::DeleteJobResponse resp;
        s = c->stub->DeleteJob(&ctx, r, &resp);
      } else {  // node, nodes
        v1::DeleteNodeRequest r;
        r.set_name(name = pos[1].rfind("nodes/", 0) == 0 ? pos[1] : "nodes/" + pos[1]);
        v1::DeleteNodeResponse resp;
        s = c->stub->DeleteNode(&ctx, r, &resp);
      }
      if (!s.ok()) return FailCall(*c, s);
      std::cout << name << " deleted\n";
      return 0;
    }
    if (verb == "cancel") {
      v1::CancelPlanRequest r;
      r.set_name(PlanName(pos[1]));
      v1::Plan p;
      s = c->stub->CancelPlan(&ctx, r, &p);
    } else {
      v1::DeletePlanRequest r;
      r.set_name(PlanName(pos[1]));
      v1::DeletePlanResponse resp;
      s = c->stub->DeletePlan(&ctx, r, &resp);
    }
    if (!s.ok()) return FailCall(*c, s);
    std::cout << PlanName(pos[1]) << (verb == "cancel" ? " cancelled\n" : " deleted\n");
    return 0;
  }
  if (verb == "deploy") {
    if (!need(2)) return 1;
    v1::DeployPlanRequest r;
    r.set_plan(PlanName(pos[1]));
    if (absl::Status s = ExecutorsFromArgs(*a, r.mutable_executors()); !s.ok()) return Fail(s);
    auto training = TrainingFromArgs(*a);
    if (!training.ok()) return Fail(training.status());
    *r.mutable_training() = *training;
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    v1::Deployment d;
    grpc::Status s = c->stub->DeployPlan(&ctx, r, &d);
    if (!s.ok()) return FailCall(*c, s);
    if (c->format == "table") {
      std::cout << d.name() << " " << v1::Deployment::State_Name(d.state()) << "\n";
    } else {
      return PrintMessage(d, c->format);
    }
    return 0;
  }
  if (verb == "stop" && pos.size() >= 2 && pos[0] == "job") {
    v1::StopJobRequest r;
    r.set_name(JobName(pos[1]));
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    v1::Job j;
    grpc::Status s = c->stub->StopJob(&ctx, r, &j);
    if (!s.ok()) return FailCall(*c, s);
    if (c->format == "table") {
      std::cout << j.name() << " " << JobState(j) << (j.status().stop_requested() &&
                                                       j.status().state() != v1::JobStatus::STOPPED
                                                       ? " (stopping)\n" : "\n");
    } else {
      return PrintMessage(j, c->format);
    }
    return 0;
  }
  if (verb == "stop") {
    if (!need(2)) return 1;
    v1::StopDeploymentRequest r;
    r.set_name(DeploymentName(pos[1]));
    grpc::ClientContext ctx;
    c->Prepare(&ctx);
    v1::Deployment d;
    grpc::Status s = c->stub->StopDeployment(&ctx, r, &d);
    if (!s.ok()) return FailCall(*c, s);
    if (c->format != "table") {
      return PrintMessage(d, c->format);
    }
    // The server answers once the ranks have stopped: say what it reports,
    // and that a deployment which had already ended was left as it was.
    const std::string state = v1::Deployment::State_Name(d.state());
    switch (d.state()) {
      case v1::Deployment::STOPPED:
        std::cout << d.name() << " STOPPED\n";
        break;
      case v1::Deployment::SUCCEEDED:
      case v1::Deployment::FAILED:
        std::cout << d.name() << " had already ended " << state << "; nothing to stop\n";
        break;
      default:
        std::cout << d.name() << " " << state << " (stopping)\n";
        break;
    }
    return 0;
  }
  return Fail(absl::InvalidArgumentError(absl::StrCat("unknown command '", verb, "'")));
}

}  // namespace hap::tools
