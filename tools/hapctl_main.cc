// hapctl: the command-line client of the HAP service.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <streambuf>
#include <string>
#include <vector>

#include "common/std_streams.h"
#include "grpc/support/log.h"
#include "tools/hapctl_checkpoint.h"
#include "tools/hapctl_client.h"
#include "tools/hapctl_graph.h"
#include "tools/hapctl_plan.h"

namespace {

constexpr char kUsage[] = R"(hapctl: plan and run SPMD training on heterogeneous clusters

Usage: hapctl COMMAND [ARGS]

Models:
  ops                       list the IR's ops and their signatures
  zoo [MODEL] [--layers N]  zoo models with parameter counts and FLOPs
                            (--export FILE.json writes the graph)
  validate FILE             load and validate a graph file (JSON/text/binary)

Planning (offline, no server):
  plan --cluster FILE [--model M | --graph FILE] [--baseline B] [-o table|json]
                            [--save-plan PLAN.pb]
  calibrate --cluster FILE --plan PLAN.pb --profile PREFIX --out FILE
                            cost model calibrated from measured runs

Checkpoints (hap-executor --checkpoint-dir):
  checkpoint inspect DIR    step, plan, files, tensors and their slices
  checkpoint export DIR -o FILE.safetensors
                            every parameter whole, by name (PyTorch, --init-weights)
  checkpoint verify DIR     every tensor against its CRC-32C (exit 1 naming damage)

Against a planner (--server HOST:PORT, else $HAPCTL_SERVER, else 127.0.0.1:7070):
  get nodes|plans|deployments|jobs   list (-o table|json|yaml)
  describe plan|deployment|job|node NAME
                                     one resource in detail (a job: its timeline; a
                                     node: devices, calibration, links, deployments)
  create plan --model M [...]        synthesize on the live cluster (--wait)
  watch plan NAME                    stream progress until it ends (or --timeout)
  cancel plan NAME / delete plan NAME / delete node NAME
  deploy plan NAME --executor DEV=HOST:PORT ... [--steps N]
  stop deployment NAME / delete deployment NAME (a finished one)
  create job --id ID --model M [...] --checkpoint-dir DIR [--checkpoint-every N] [--steps N]
                                     an elastic job: re-planned as devices fail and join
  watch job NAME / stop job NAME / delete job NAME (a finished one)

Run `hapctl COMMAND --help` for a command's flags. --server, --timeout,
--keepalive, --token-file, --tls-ca-file and -o may also come before the
command.
)";

// std::cout's buffer: standard output through write(2), keeping the
// first failure's reason (stdio's error flag says only that some write
// failed, and its errno is long overwritten by the end). Not thread-safe,
// as std::cout is not used from several threads.
class StandardOutput : public std::streambuf {
 public:
  StandardOutput() { setp(buf_, buf_ + sizeof(buf_)); }
  // 0, or the errno of the first write that failed (what came after it
  // was dropped).
  int error() const { return error_; }

 protected:
  int_type overflow(int_type c) override {
    if (!Drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override { return Drain() ? 0 : -1; }

 private:
  bool Drain() {
    const char* p = pbase();
    size_t n = static_cast<size_t>(pptr() - pbase());
    while (n > 0 && error_ == 0) {
      const ssize_t w = write(1, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        error_ = w < 0 ? errno : EIO;
        break;
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    setp(buf_, buf_ + sizeof(buf_));
    return error_ == 0;
  }

  char buf_[1 << 16];
  int error_ = 0;
};

// `rc`, or 1 when what the command printed did not all reach standard
// output: a full disk (`hapctl get plans -o json > /dev/full`) showed only
// at the flush at exit, unchecked, and hapctl exited 0 with the output lost.
int FlushStandardOutput(StandardOutput& out, int rc) {
  std::cout.flush();
  if (out.error() == 0 && !std::cout.fail()) return rc;
  std::cerr << "error: cannot write to standard output: "
            << (out.error() != 0 ? std::strerror(out.error()) : "a write failed") << "\n";
  return rc == 0 ? 1 : rc;
}

int Run(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" ||
      std::string(argv[1]) == "help") {
    std::cout << kUsage;
    return argc < 2 ? 1 : 0;
  }
  // The connection and output flags may come before the command, as with
  // kubectl (`hapctl --server H:P get nodes`): they move behind it.
  std::vector<std::string> args(argv + 1, argv + argc);
  std::vector<std::string> leading;
  size_t i = 0;
  for (; i < args.size() && args[i].size() > 1 && args[i][0] == '-'; ++i) {
    const std::string& flag = args[i];
    const std::string name = flag.substr(0, flag.find('='));
    if (name != "--server" && name != "--timeout" && name != "--keepalive" &&
        name != "--token-file" && name != "--tls-ca-file" && name != "-o" && name != "--output") {
      std::cerr << "error: '" << flag
                << "' before the command: only --server, --timeout, --keepalive, --token-file, "
                   "--tls-ca-file and -o may come before it\n";
      return 1;
    }
    leading.push_back(flag);
    if (name == flag) {
      if (i + 1 == args.size()) {
        std::cerr << "error: '" << flag << "' needs a value\n";
        return 1;
      }
      leading.push_back(args[++i]);
    }
  }
  if (i == args.size()) {
    std::cerr << "error: no command after the flags\n\n" << kUsage;
    return 1;
  }
  std::string cmd = args[i];
  std::vector<std::string> rest(args.begin() + i + 1, args.end());
  // `checkpoint export` takes -o as its output file: `hapctl -o json
  // checkpoint export DIR` wrote the safetensors into a file named 'json'.
  if (cmd == "checkpoint" && !rest.empty() && rest[0] == "export") {
    for (size_t k = 0; k < leading.size(); ++k) {
      const std::string name = leading[k].substr(0, leading[k].find('='));
      if (name == "-o" || name == "--output") {
        std::cerr << "error: '" << leading[k]
                  << "' before 'checkpoint export': its -o is the output file, give it after "
                     "(hapctl checkpoint export DIR -o FILE.safetensors)\n";
        return 1;
      }
    }
  }
  rest.insert(rest.end(), leading.begin(), leading.end());
  if (cmd == "ops") return hap::tools::RunOps(rest);
  if (cmd == "zoo") return hap::tools::RunZoo(rest);
  if (cmd == "validate") return hap::tools::RunValidate(rest);
  if (cmd == "plan") return hap::tools::RunPlan(rest);
  if (cmd == "calibrate") return hap::tools::RunCalibrate(rest);
  if (cmd == "checkpoint") return hap::tools::RunCheckpoint(rest);
  for (const char* verb : {"get", "describe", "create", "watch", "cancel", "delete", "deploy",
                           "stop"}) {
    if (cmd == verb) return hap::tools::RunClient(cmd, rest);
  }
  std::cerr << "error: unknown command '" << cmd << "'\n\n" << kUsage;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (!hap::tools::ReserveStandardStreams()) {
    std::cerr << "error: standard output is closed (hapctl prints its results there)\n";
    return 1;
  }
  // gRPC's own log lines ("E1206 ... Handshake failed ...") repeat, before
  // it, the error hapctl prints with what to change; GRPC_VERBOSITY set
  // asks for them.
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function([](gpr_log_func_args*) {});
  static StandardOutput* const out = new StandardOutput;  // outlives std::cout's last use
  std::cout.rdbuf(out);
  return FlushStandardOutput(*out, Run(argc, argv));
}
