// The profiler agent daemon (docs/design.md §9), without its flags: serves
// hap.v1.Agent, probes the local devices at start and on request, registers
// with the planner (retrying with backoff while it is unreachable), then
// heartbeats. A heartbeat answered unknown_node registers again under the
// same name and measures the links again; one answered reprobe registers
// again (for the planner's current interval) and probes again, as a drifted
// quick FLOP/s check does, sending the devices with the next heartbeat.
// Every so often it asks the planner which peers to measure, measures those
// links and reports them. Its schedule keeps to the monotonic clock. Errors
// are logged to stderr with their context; nothing aborts.
#ifndef HAP_PROFILER_AGENT_AGENT_H_
#define HAP_PROFILER_AGENT_AGENT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "profiler_agent/devices.h"
#include "profiler_agent/link_probe.h"
#include "profiler_agent/probes.h"

namespace hap::agent {

struct AgentOptions {
  std::string planner;  // planner address "host:port"; required
  std::string name;     // node name; required (the daemon defaults it to the hostname)
  std::string listen = "127.0.0.1:0";  // Agent service; port 0 = any free port
  // The address the planner and peers reach this agent at; empty = the
  // listen address with the bound port.
  std::string advertise;
  // The token is sent on every call and required on every call served;
  // tls_ca_file verifies the planner and peers; tls_cert/key_file serve TLS.
  hap::service::Security security;
  // Which devices to measure when Start is given no probers (devices.h).
  DeviceSelection devices = DeviceSelection::kAuto;
  ProbeOptions probe;
  // Zero = the interval RegisterNode returns (5 s if it returns none). One
  // set is held to the planner's at most (a longer one let the node go
  // STALE between heartbeats).
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  // Re-probe when a quick FLOP/s check differs from the one taken after the
  // last full probe by more than this fraction; 0 = never check.
  double drift = 0.2;
  absl::Duration drift_check_interval = absl::Seconds(60);
  // How often to ask the planner for probe assignments (first time right
  // after registering).
  absl::Duration link_probe_interval = absl::Seconds(300);
  // The first link measurement waits this long after registering (zero: at
  // once). A node that joins a cluster already training would measure the
  // training's load on its peers, not the links: the links it reported
  // before (the planner keeps them) stay in use meanwhile.
  absl::Duration link_probe_delay = absl::ZeroDuration();
  // The executor daemons of this node (HOST:PORT, as their clients dial
  // them): each is asked which device it serves (Executor.GetStatus) and
  // the node registers with the label "hap.executor/<device>" = HOST:PORT,
  // which deployments and jobs use for a device given no executor. One
  // that does not answer yet is asked again at each heartbeat; once all
  // have, the node registers again with their labels.
  std::vector<std::string> executors;
  LinkProbeOptions link;
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Registration retries: doubling from initial to max; each wait is a
  // random part of it, from half to all (agents started together do not
  // retry in step).
  absl::Duration initial_backoff = absl::Milliseconds(200);
  absl::Duration max_backoff = absl::Seconds(10);
  // Uniform numbers in [0, 1) for that jitter; empty = the agent's own
  // generator. Called from one thread at a time.
  std::function<double()> random;
  // True once the process is asked to stop before Shutdown can be called:
  // the daemon's SIGTERM check. A probe then ends at its next timed run, in
  // particular the first one, inside Start (a long one, on many GPUs or with
  // a large --probe-seconds, delayed the exit by all of it). Empty: never.
  std::function<bool()> stop_requested;
};

// What an agent logs at start when the address it registers (`advertised`)
// is this machine's only (127.x, localhost, [::1]: the default --listen)
// while the planner (`planner`) is elsewhere: neither the planner's callers
// nor peers on other hosts can reach it. Empty otherwise.
std::string LocalOnlyAddressWarning(const std::string& advertised, const std::string& planner);

class Agent {
 public:
  // Validates the options, starts the server, probes once (a failed probe
  // is logged and retried by the loop) and starts the loops. `probers`
  // empty = those `options.devices` selects (MakeDeviceProbers, whose
  // FailedPrecondition for --devices gpu without a GPU or without CUDA is
  // returned). InvalidArgument for missing planner/name; the server's error
  // when it cannot bind.
  static absl::StatusOr<std::unique_ptr<Agent>> Start(
      AgentOptions options, std::vector<std::unique_ptr<DeviceProber>> probers = {});
  ~Agent();  // Shutdown(zero)

  // The bound listen address ("127.0.0.1:41235") and port.
  std::string listen_address() const;
  int port() const;
  // The address registered with the planner.
  std::string address() const;

  // Stops heartbeating and probing (RPCs in flight are cancelled), then
  // shuts the server down giving calls in flight until `deadline`.
  // Idempotent; thread-safe: a second call returns when the first has.
  void Shutdown(absl::Duration deadline = absl::Seconds(5));

  struct Impl;

 private:
  Agent() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hap::agent

#endif  // HAP_PROFILER_AGENT_AGENT_H_
