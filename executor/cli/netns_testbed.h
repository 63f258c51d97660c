// The network testbed: a heterogeneous network on one machine out of Linux
// network namespaces. Node i is the namespace PREFIX-OWNER-n<i> holding the
// address 10.213.0.<i+1>; every node's veth pair (hapnet-n<i> in the node,
// hapnet-s<i> in the switch) ends on the bridge hapnet-br0 of the switch
// namespace PREFIX-OWNER-sw, which also has the control address
// 10.213.0.254 (for a planner). Traffic leaving a node is shaped on its veth
// end by an HTB qdisc: one class per link rate (the node's default towards
// every other node, one per pair override, matched by destination address
// with u32 filters) and, when a delay is asked, a netem leaf under each
// class. The node's loopback carries the traffic between ranks of one node
// and gets the "inside" rate the same way.
//
// Nothing is made in the machine's own namespace: every namespace, link and
// qdisc lives in namespaces named PREFIX-OWNER-* (OWNER: the pid of the
// process that made them, whose start time a state file records), so the
// addresses never meet the host's. A set whose owner is gone (a run killed
// with SIGKILL) is found by its prefix and removed by the next Create or
// RemoveStale: processes still inside are killed by pid, the namespaces
// deleted (their links and qdiscs go with them).
//
// Needs root, `ip` and `tc` (iproute2), and a kernel with network
// namespaces, veth, bridge, HTB and u32 (netem for delays). Where any is
// missing, Create returns FailedPrecondition saying which.
//
// Thread-safety: a Testbed is not thread-safe; Enter* changes the network
// namespace of the calling thread only.
#ifndef HAP_EXECUTOR_CLI_NETNS_TESTBED_H_
#define HAP_EXECUTOR_CLI_NETNS_TESTBED_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hap::netns {

// One direction of a link: a rate cap (0 = unlimited) and an added one-way
// delay (0 = none).
struct LinkShape {
  double rate_bits_per_second = 0;
  double delay_seconds = 0;
  bool shaped() const { return rate_bits_per_second > 0 || delay_seconds > 0; }
};

// What to build. Text form (ParseNetworkSpec), items separated by spaces or
// ';':
//   nodes=N                    number of nodes (1..64); a launcher may fill it in
//   between=RATE[:DELAY]       each node's traffic towards any other node
//   inside=RATE[:DELAY]        traffic between ranks of one node (its loopback)
//   pair=I-J:RATE[:DELAY]      overrides `between` for I->J and J->I (repeatable)
//   ranks=N0,N1,...            the node of each rank (launchers; default: the plan's)
// RATE: a number with bit, kbit, mbit, gbit or tbit (powers of 1000), or
// "unlimited". DELAY: a number with us, ms or s. Example:
//   "nodes=3 between=1gbit inside=10gbit pair=0-2:300mbit"
struct NetworkSpec {
  int nodes = 0;
  LinkShape between;
  LinkShape inside;
  std::map<std::pair<int, int>, LinkShape> pairs;  // key: (i, j) with i < j
  std::vector<int> rank_nodes;                     // empty: not given

  // The shape of traffic from node i to node j (i != j).
  LinkShape Link(int i, int j) const;
  // Checks nodes (1..64), pair and rank node numbers against it.
  absl::Status Validate() const;
  // The text form, ParseNetworkSpec's inverse (rates in bit/s).
  std::string ToString() const;
};

// InvalidArgument naming the item that is wrong.
absl::StatusOr<NetworkSpec> ParseNetworkSpec(absl::string_view text);
absl::StatusOr<double> ParseRate(absl::string_view text);   // bits per second
absl::StatusOr<double> ParseDelay(absl::string_view text);  // seconds

// Runs argv (argv[0] looked up in /usr/sbin, /sbin, /usr/bin, /bin) and
// returns its stdout; an error with the command and its stderr when it
// exits non-zero.
using CommandRunner =
    std::function<absl::StatusOr<std::string>(const std::vector<std::string>& argv)>;
absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv);

struct TestbedOptions {
  // Every namespace is PREFIX-OWNER-...; link names start with "hapnet-".
  std::string prefix = "hapnet";
  // The process the set belongs to (default: this one). A set whose owner
  // is not running (or is another process with the same pid: the start
  // time differs) is stale.
  pid_t owner = 0;
  // Where the state files go (PREFIX-OWNER.state: owner, start time, names).
  std::string state_dir = "/run/hapnet";
  // Where `ip netns` keeps its namespaces.
  std::string netns_dir = "/var/run/netns";
  // ip and tc are run through this (tests record the commands instead).
  CommandRunner run = RunCommand;
  // Skip the root and kernel checks (tests with a recording runner).
  bool check_environment = true;
};

class Testbed {
 public:
  // Removes stale sets of the prefix, then makes the network of `spec`
  // (spec.nodes > 0). FailedPrecondition when it cannot be made here (not
  // root, no ip/tc, no netem for a delay, namespaces refused), with the
  // reason; whatever was made before a failure is removed again.
  static absl::StatusOr<std::unique_ptr<Testbed>> Create(const NetworkSpec& spec,
                                                         TestbedOptions options = {});
  ~Testbed();  // Destroy(), errors to stderr
  Testbed(const Testbed&) = delete;
  Testbed& operator=(const Testbed&) = delete;

  // Kills the processes still inside the namespaces, deletes them and the
  // state file. Idempotent.
  absl::Status Destroy();
  // Leaves the set in place for its owner to remove (hap-netns up, whose
  // owner is the calling script): the destructor does nothing after it.
  void Detach() { destroyed_ = true; }

  const NetworkSpec& spec() const { return spec_; }
  int nodes() const { return spec_.nodes; }
  std::string NodeNamespace(int node) const;
  std::string SwitchNamespace() const;
  static std::string NodeAddress(int node);  // 10.213.0.<node+1>
  static std::string SwitchAddress();        // 10.213.0.254
  // {"ip", "netns", "exec", <node namespace>}: prefix a command with it.
  std::vector<std::string> ExecPrefix(int node) const;
  // The commands that Create ran, in order (for logs and tests).
  const std::vector<std::vector<std::string>>& commands() const { return commands_; }

 private:
  Testbed(NetworkSpec spec, TestbedOptions options);
  absl::Status Build();

  NetworkSpec spec_;
  TestbedOptions options_;
  std::vector<std::string> namespaces_;  // made so far
  std::vector<std::vector<std::string>> commands_;
  bool destroyed_ = false;
};

// Moves the calling thread into the named namespace (setns). Processes it
// forks afterwards start there.
absl::Status EnterNamespace(const std::string& name,
                            const std::string& netns_dir = "/var/run/netns");

// The testbed namespaces now present, sorted: those named PREFIX-OWNER-sw
// or PREFIX-OWNER-n<i> (OWNER a pid, i a node number, both as decimals
// without leading zeros). Other names that start with the prefix are not a
// testbed's: RemoveStale and RemoveOwned never touch them.
std::vector<std::string> ListNamespaces(const TestbedOptions& options);

// What RemoveStale did: the namespaces removed, and one message per
// namespace that could not be (naming it and why). Sets are independent
// (each lives in its own namespaces, nothing in the host's), so one that
// cannot be removed does not stop a new one being made beside it.
struct StaleRemoval {
  std::vector<std::string> removed;
  std::vector<std::string> failed;
};

// Removes every set of the prefix whose owner is gone, as far as it can;
// an owner's state file stays while any of its namespaces does.
StaleRemoval RemoveStale(const TestbedOptions& options);

// RemoveStale, each namespace removed and each failure said on stderr as
// "WHO: ...".
void RemoveStaleAndSay(const TestbedOptions& options, absl::string_view who);

// Removes the set of `options.owner` whatever its state (hap-netns down):
// how many of its namespaces there were.
absl::StatusOr<int> RemoveOwned(const TestbedOptions& options);

}  // namespace hap::netns

#endif  // HAP_EXECUTOR_CLI_NETNS_TESTBED_H_
