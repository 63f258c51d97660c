// hap-netns: the network testbed (executor/cli/netns_testbed.h) for scripts
// and benchmarks: make it, run commands in its nodes, remove it.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "executor/cli/netns_testbed.h"

namespace {

constexpr char kUsage[] = R"(usage:
  hap-netns up --network SPEC [--owner PID]   make the testbed; prints its nodes
  hap-netns down [--owner PID]                remove the owner's testbed
  hap-netns exec NODE|sw [--owner PID] -- COMMAND [ARGS...]
                                              run COMMAND in node NODE's namespace
                                              (or the switch's, which has the planner address)
  hap-netns clean                             remove the sets whose owner is gone
  hap-netns list                              the testbed namespaces present

The testbed belongs to --owner (default: the calling process, e.g. the shell
script that runs `hap-netns up`; through sudo, give --owner: sudo itself ends
with the command): `down` removes it, and once the owner is
gone the next `up`, `clean` or hap-launch --network removes it too. SPEC:
"nodes=N between=RATE[:DELAY] inside=RATE[:DELAY] pair=I-J:RATE[:DELAY]",
e.g. "nodes=3 between=1gbit pair=0-2:300mbit". Node i has the address
10.213.0.<i+1>, the switch 10.213.0.254. Root only.
)";

int Fail(const std::string& message, int code = 1) {
  std::cerr << "hap-netns: " << message << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cerr << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  hap::netns::TestbedOptions options;
  options.owner = getppid();
  bool owner_given = false;
  std::string network, node;
  std::vector<std::string> command;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      command.assign(args.begin() + i + 1, args.end());
      break;
    }
    if (a == "--owner" || a == "--network") {
      if (i + 1 == args.size()) return Fail(a + " needs a value", 2);
      if (a == "--network") {
        // Elsewhere it was ignored: `down --network X` took down the set.
        if (cmd != "up") return Fail("--network applies to up only", 2);
        network = args[++i];
      } else if (!absl::SimpleAtoi(args[++i], &options.owner) || options.owner <= 0) {
        return Fail("--owner must be a pid, got '" + args[i] + "'", 2);
      } else {
        owner_given = true;
      }
    } else if (cmd == "exec" && node.empty() && a.rfind("--", 0) != 0) {
      node = a;
    } else {
      return Fail("unexpected argument '" + a + "' (see --help)", 2);
    }
  }
  if (cmd != "clean" && cmd != "list" && !owner_given) {
    // The default owner is the calling process. Under sudo (or su, doas)
    // that is sudo itself, gone when this command returns: `up` made a set
    // that was stale at once (the next start removed it, with what ran in
    // it), and `exec` and `down` looked for another sudo's (down removed
    // nothing and said nothing).
    std::ifstream comm(absl::StrCat("/proc/", options.owner, "/comm"));
    std::string parent;
    std::getline(comm, parent);
    if (parent == "sudo" || parent == "su" || parent == "doas" || parent == "runuser") {
      return Fail(absl::StrCat(cmd, " run through ", parent,
                               " needs --owner PID (the script's or shell's pid, e.g. --owner $$): "
                               "the default owner, ",
                               parent, ", ends with this command"),
                  2);
    }
  }
  if (cmd == "up") {
    if (network.empty()) return Fail("up needs --network SPEC", 2);
    auto spec = hap::netns::ParseNetworkSpec(network);
    if (!spec.ok()) return Fail(std::string(spec.status().message()), 2);
    if (spec->nodes == 0) return Fail("up needs nodes=N in the network spec", 2);
    auto testbed = hap::netns::Testbed::Create(*spec, options);
    if (!testbed.ok()) {
      return Fail(std::string(testbed.status().message()),
                  testbed.status().code() == absl::StatusCode::kFailedPrecondition ? 3 : 1);
    }
    std::cout << "switch " << (*testbed)->SwitchNamespace() << " "
              << hap::netns::Testbed::SwitchAddress() << "\n";
    for (int i = 0; i < (*testbed)->nodes(); ++i) {
      std::cout << "node " << i << " " << (*testbed)->NodeNamespace(i) << " "
                << hap::netns::Testbed::NodeAddress(i) << "\n";
    }
    // The caller learns the set from this listing: unwritten, the set is
    // removed again (the destructor) and up fails.
    if (!std::cout.flush()) return Fail("cannot write the listing of the nodes to stdout");
    (*testbed)->Detach();
    return 0;
  }
  if (cmd == "down") {
    auto removed = hap::netns::RemoveOwned(options);
    if (!removed.ok()) return Fail(std::string(removed.status().message()));
    // It said nothing and exited 0 when there was nothing to remove.
    if (*removed == 0) {
      return Fail(absl::StrCat("no testbed of owner ", options.owner, " here (see --owner)"));
    }
    return 0;
  }
  if (cmd == "clean") {
    const hap::netns::StaleRemoval stale = hap::netns::RemoveStale(options);
    for (const std::string& ns : stale.removed) std::cout << "removed " << ns << "\n";
    if (!std::cout.flush()) return Fail("cannot write to stdout");
    if (!stale.failed.empty()) return Fail(absl::StrJoin(stale.failed, "\n"));
    return 0;
  }
  if (cmd == "list") {
    for (const std::string& ns : hap::netns::ListNamespaces(options)) std::cout << ns << "\n";
    return std::cout.flush() ? 0 : Fail("cannot write to stdout");
  }
  if (cmd == "exec") {
    if (node.empty() || command.empty()) return Fail("exec needs NODE -- COMMAND", 2);
    int index = -1;
    if (node != "sw" && (!absl::SimpleAtoi(node, &index) || index < 0)) {
      return Fail("exec: NODE must be a node number or 'sw', got '" + node + "'", 2);
    }
    // The node's number as the testbed writes it ("01" is node 1).
    const std::string ns = std::string(options.prefix) + "-" + std::to_string(options.owner) +
                           (node == "sw" ? "-sw" : "-n" + std::to_string(index));
    absl::Status s = hap::netns::EnterNamespace(ns, options.netns_dir);
    if (!s.ok()) return Fail(std::string(s.message()));
    std::vector<char*> cargs;
    for (std::string& c : command) cargs.push_back(c.data());
    cargs.push_back(nullptr);
    execvp(cargs[0], cargs.data());
    return Fail("cannot run " + command[0] + ": " + std::strerror(errno), 127);
  }
  return Fail("unknown command '" + cmd + "' (see --help)", 2);
}
