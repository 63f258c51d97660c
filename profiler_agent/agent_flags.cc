#include "profiler_agent/agent_flags.h"

#include <unistd.h>

#include <cmath>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/grpc_util.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "planner/service/core/profile_checks.h"

namespace hap::agent {
namespace {

// "--flag (or HAP_FLAG)", as errors name a flag.
std::string Named(const std::string& flag) {
  return absl::StrCat("--", flag, " (or ", hap::tools::Args::EnvName(flag), ")");
}

// OK for "HOST:PORT" ("[v6]:PORT" too) with a port from `min_port` to
// 65535, or, when `schemes`, a gRPC target with its scheme (IsHostPort);
// else InvalidArgument naming the flag and the value. gRPC binds a listen
// address without a port at 443 and one past 65535 at the port modulo
// 65536, dials them likewise, and each would be used as if asked for.
absl::Status CheckHostPort(const std::string& flag, const std::string& value, int min_port,
                           const std::string& what, bool schemes = false) {
  if (!hap::service::IsHostPort(value, min_port, schemes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        Named(flag), " '", value, "' must be HOST:PORT with a port from ", min_port, " to 65535",
        schemes ? " (or dns:///HOST:PORT, unix:PATH)" : "", " (", what, ")"));
  }
  return absl::OkStatus();
}

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == 0) return "localhost";
  return name;
}

}  // namespace

const char kAgentUsage[] =
    "usage: hap-agent --planner HOST:PORT [flags]\n"
    "Each flag can also be set as HAP_<FLAG> in the environment (the flag wins).\n"
    "  --planner HOST:PORT       the planner to register with (required)\n"
    "  --name NODE               node name, 1-253 letters, digits, '-', '.', '_'\n"
    "                            (default: the hostname)\n"
    "  --listen HOST:PORT        Agent service (default 127.0.0.1:0, a free port)\n"
    "  --advertise HOST:PORT     address the planner and peers dial (default: --listen's)\n"
    "  --token-file FILE         bearer token sent and required on every call\n"
    "  --tls-ca-file FILE        CA bundle verifying the planner and peers\n"
    "  --tls-cert-file FILE --tls-key-file FILE  serve TLS\n"
    "  --devices auto|cpu|gpu    devices to measure (default auto: the GPUs when this\n"
    "                            build has CUDA and a GPU is visible, else the CPU)\n"
    "  --threads N               compute threads for probes, up to 4096 (default: the\n"
    "                            CPU share)\n"
    "  --probe-seconds S         bound on one device's probe, and on the GPU peer\n"
    "                            links of the node in all (default 2)\n"
    "  --heartbeat-seconds S     0.01 to 3600, held to the planner's interval at most;\n"
    "                            default: what the planner says\n"
    "  --drift F                 re-probe when two quick FLOP/s checks in a row\n"
    "                            differ by more than this fraction (default 0.2;\n"
    "                            0 = off; paused while an --executor trains)\n"
    "  --drift-check-seconds S   how often to check (default 60)\n"
    "  --link-probe-seconds S    how often to measure peer links (default 300)\n"
    "  --link-probe-delay S      the first link measurement S seconds after\n"
    "                            registering (default 0: at once)\n"
    "  --executor HOST:PORT      an executor daemon of this node (repeatable): the\n"
    "                            node is labelled hap.executor/<its device> = HOST:PORT\n";

const std::set<std::string>& AgentValueFlags() {
  static const std::set<std::string>* const flags = new std::set<std::string>{"planner",
                                                                              "name",
                                                                              "listen",
                                                                              "advertise",
                                                                              "token-file",
                                                                              "tls-ca-file",
                                                                              "tls-cert-file",
                                                                              "tls-key-file",
                                                                              "devices",
                                                                              "threads",
                                                                              "probe-seconds",
                                                                              "heartbeat-seconds",
                                                                              "drift",
                                                                              "drift-check-seconds",
                                                                              "link-probe-seconds",
                                                                              "link-probe-delay",
                                                                              "executor"};
  return *flags;
}

absl::StatusOr<AgentOptions> AgentOptionsFromArgs(const hap::tools::Args& a) {
  // hap-agent takes flags only: an argument that is no flag's value was
  // dropped without a word (`--executor A B` labelled the node with A alone).
  if (!a.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", a.positional()[0],
                     "': hap-agent takes flags only (each --executor is a flag of its own)"));
  }
  AgentOptions o;
  o.planner = a.GetOrEnv("planner", "");
  if (o.planner.empty()) {
    return absl::InvalidArgumentError(
        "--planner HOST:PORT (or HAP_PLANNER) is required: the planner to register with");
  }
  HAP_RETURN_IF_ERROR(CheckHostPort("planner", o.planner, 1, "the planner to register with",
                                    /*schemes=*/true));
  o.name = a.GetOrEnv("name", "");
  if (o.name.empty()) o.name = Hostname();
  if (!hap::service::ValidNodeName(o.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat(Named("name"), " '", o.name,
                     "' must be 1-253 letters, digits, '-', '.' or '_' (the planner takes no "
                     "other; the default is the hostname)"));
  }
  o.listen = a.GetOrEnv("listen", "127.0.0.1:0");
  HAP_RETURN_IF_ERROR(CheckHostPort("listen", o.listen, 0, "0: any free one"));
  // $(POD_IP):PORT on an IPv6 cluster comes without brackets.
  o.advertise = hap::service::BracketIpv6Host(a.GetOrEnv("advertise", ""));
  if (!o.advertise.empty()) {
    HAP_RETURN_IF_ERROR(
        CheckHostPort("advertise", o.advertise, 1, "the address the planner and peers dial"));
  }
  {
    auto token = hap::service::ReadTokenFile(a.GetOrEnv("token-file", ""));
    if (!token.ok()) return Annotate(token.status(), Named("token-file"));
    o.security.token = *std::move(token);
  }
  o.security.tls_ca_file = a.GetOrEnv("tls-ca-file", "");
  o.security.tls_cert_file = a.GetOrEnv("tls-cert-file", "");
  o.security.tls_key_file = a.GetOrEnv("tls-key-file", "");
  // Checked here, naming the flag (exit 2): at start they stopped the agent
  // with exit 1, naming no flag.
  if (o.security.tls_cert_file.empty() != o.security.tls_key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(Named("tls-cert-file"), " and ",
                                                   Named("tls-key-file"),
                                                   ": TLS needs both a certificate and a key"));
  }
  for (const auto& [flag, path] : {std::pair{"tls-ca-file", o.security.tls_ca_file},
                                   std::pair{"tls-cert-file", o.security.tls_cert_file},
                                   std::pair{"tls-key-file", o.security.tls_key_file}}) {
    if (path.empty()) continue;
    HAP_RETURN_IF_ERROR(Annotate(hap::tools::ReadInputFile(path).status(), Named(flag)));
  }
  {
    std::string devices = a.GetOrEnv("devices", "auto");
    auto selection = ParseDeviceSelection(devices);
    if (!selection.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices (or HAP_DEVICES) must be auto, cpu or gpu, got '", devices, "'"));
    }
    o.devices = *selection;
  }
  HAP_ASSIGN_OR_RETURN(double threads, a.NumberOrEnv("threads", 0, 0, 4096, /*whole=*/true));
  HAP_ASSIGN_OR_RETURN(double probe, a.NumberOrEnv("probe-seconds", 2, 0.001));
  HAP_ASSIGN_OR_RETURN(double heartbeat, a.NumberOrEnv("heartbeat-seconds", 0, 0));
  // hap-planner's range: shorter heartbeats in a loop, longer ones never.
  if (heartbeat != 0 && (heartbeat < 0.01 || heartbeat > 3600)) {
    return absl::InvalidArgumentError(
        absl::StrCat(Named("heartbeat-seconds"),
                     " must be 0 (the planner's interval) or from 0.01 to 3600, got '",
                     a.GetOrEnv("heartbeat-seconds", ""), "'"));
  }
  HAP_ASSIGN_OR_RETURN(o.drift, a.NumberOrEnv("drift", 0.2, 0));
  HAP_ASSIGN_OR_RETURN(double drift_check, a.NumberOrEnv("drift-check-seconds", 60, 0.001));
  HAP_ASSIGN_OR_RETURN(double links, a.NumberOrEnv("link-probe-seconds", 300, 0.001));
  o.probe.threads = static_cast<int>(threads);
  o.probe.max_duration = absl::Seconds(probe);
  o.heartbeat_interval = absl::Seconds(heartbeat);
  o.drift_check_interval = absl::Seconds(drift_check);
  o.link_probe_interval = absl::Seconds(links);
  HAP_ASSIGN_OR_RETURN(double delay, a.NumberOrEnv("link-probe-delay", 0, 0));
  o.link_probe_delay = absl::Seconds(delay);
  o.executors = a.GetAll("executor");
  if (o.executors.empty()) {
    const std::string env = a.GetOrEnv("executor", "");
    if (!env.empty()) o.executors = absl::StrSplit(env, ',', absl::SkipEmpty());
  }
  for (std::string& e : o.executors) {
    e = hap::service::BracketIpv6Host(e);  // $(HOST_IP):PORT on an IPv6 cluster
    HAP_RETURN_IF_ERROR(CheckHostPort("executor", e, 1, "an executor daemon's address"));
  }
  return o;
}

}  // namespace hap::agent
