// The planner's gRPC API under load, on 127.0.0.1: hap-planner started as a
// process on a fresh SQLite database, driven by this client with a fixed
// number of calls in flight (gRPC's callback client; a finished call starts
// the next one at once).
//
//   reads     mixed GetPlan (BASIC, a random one of the plans) 80% and
//             ListPlans (a page of 20, BASIC) 20%, at 100, 1,000 and 10,000
//             calls in flight against a planner holding 1,000 plans: calls/s,
//             p50/p99/max latency, errors by code; each twice, the client
//             reading the responses as bytes (generic stubs: what the
//             server sustains) and parsing them (typed stubs);
//   creates   cached CreatePlan (the same request, a new plan each time),
//             64 in flight: plans/s;
//   growth    10,000 plans created and expired (--plan-retention-count=1000):
//             the planner's RSS after each 1,000;
//   start-up  a planner restarted on a database of 10,000 plans: seconds
//             from exec to serving.
//
//   creates-ab  --creates-ab OTHER_PLANNER [ROUNDS]: the cached-create row
//             only, alternating between OTHER_PLANNER (e.g. a build of an
//             earlier commit) and this build's, a fresh database each run:
//             plans/s of each per round and the ratio of the medians.
//   reads-ab  --reads-ab OTHER_PLANNER [ROUNDS] [IN_FLIGHT]: the reads at
//             1,000 (or IN_FLIGHT) in flight, the same way (two planners of
//             1,000 plans each, runs alternating, both clients). OTHER may
//             be a script that runs a planner with other flags.
//   --pin     (before the mode) the planner on one CPU, this client on the
//             others.
//   --connections=N  (before the mode) spread the calls over N client
//             connections (default 8).
//
//   bazel run -c opt //bench:planner_load -- [--pin] [--connections=N] [--quick | --startup-only |
//                                              --creates-ab OTHER [ROUNDS] |
//                                              --reads-ab OTHER [ROUNDS] [IN_FLIGHT]]
//
// Prints Markdown tables (bench/README.md, "The planner under load").
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_util.h"
#include "common/stats.h"
#include "grpcpp/generic/generic_stub.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "tests/service_harness.h"

namespace {

using ::hap::Median;

namespace v1 = ::hap::v1;
using hap::testing::Process;
using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "load-token";

// --pin: the planner runs on the first CPU of this process's affinity mask
// (through taskset) and this client on the others, so neither preempts the
// other's threads. Empty: both float over every CPU.
std::string g_planner_cpu;
// --connections=N: client connections the calls are spread over (8).
int g_connections = 8;

std::vector<std::string> PinnedArgs(std::vector<std::string> args) {
  if (!g_planner_cpu.empty()) args.insert(args.begin(), {"/usr/bin/taskset", "-c", g_planner_cpu});
  return args;
}

// --pin: the planner on the first CPU this process may use, this process on
// the rest. False (with a message) when there is only one.
bool Pin() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) < 2) {
    std::fprintf(stderr, "--pin needs at least two CPUs in this process's affinity mask\n");
    return false;
  }
  int first = 0;
  while (!CPU_ISSET(first, &set)) ++first;
  CPU_CLR(first, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    std::perror("sched_setaffinity");
    return false;
  }
  g_planner_cpu = std::to_string(first);
  std::printf("pinned: the planner on CPU %d, this client on the %d others\n", first,
              CPU_COUNT(&set));
  std::fflush(stdout);
  return true;
}

struct Planner {
  Process proc;
  int port = 0;
  double start_seconds = 0;  // exec -> "listening on"

  bool Start(const std::string& dir, int keep, const std::string& binary = "") {
    std::ofstream(dir + "/token") << kToken << "\n";
    const auto t0 = Clock::now();
    absl::Status s = proc.Start(
        PinnedArgs({binary.empty() ? hap::testing::Runfile("planner/service/hap-planner") : binary,
                    "--listen=127.0.0.1:0", "--metrics-listen=off",
                    "--database=" + dir + "/planner.db", "--token-file=" + dir + "/token",
                    "--heartbeat-seconds=600", absl::StrCat("--plan-retention-count=", keep)}));
    if (!s.ok()) {
      std::fprintf(stderr, "cannot start hap-planner: %s\n", std::string(s.message()).c_str());
      return false;
    }
    auto addr = proc.WaitForLine("listening on 127.0.0.1:");
    if (!addr.ok() || !absl::SimpleAtoi(*addr, &port)) {
      std::fprintf(stderr, "hap-planner did not start: %s\n%s\n",
                   std::string(addr.status().message()).c_str(), proc.output().c_str());
      return false;
    }
    start_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return true;
  }

  // Resident set size in MB, from /proc.
  double RssMb() const {
    std::ifstream f(absl::StrCat("/proc/", proc.pid(), "/status"));
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("VmRSS:", 0) == 0) return std::atof(line.c_str() + 6) / 1024;
    }
    return -1;
  }

  // CPU seconds the planner has used (user + system), from /proc.
  double CpuSeconds() const {
    std::ifstream f(absl::StrCat("/proc/", proc.pid(), "/stat"));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // Fields after the command's closing parenthesis: state is field 3,
    // utime 14 and stime 15.
    std::vector<std::string> fields = absl::StrSplit(stat.substr(stat.rfind(')') + 2), ' ');
    if (fields.size() < 13) return -1;
    return (std::atof(fields[11].c_str()) + std::atof(fields[12].c_str())) /
           static_cast<double>(sysconf(_SC_CLK_TCK));
  }
};

// Separate connections (a local subchannel pool per channel), so the load
// is not one HTTP/2 connection's: each with a typed stub and a generic one
// (requests and responses as bytes).
struct Connections {
  std::vector<std::unique_ptr<v1::Planner::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic;
  int size() const { return static_cast<int>(stubs.size()); }
};

Connections Connect(int port, int n) {
  Connections c;
  for (int i = 0; i < n; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("hap.load.channel", i);
    args.SetMaxReceiveMessageSize(64 << 20);
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                             grpc::InsecureChannelCredentials(), args);
    c.stubs.push_back(v1::Planner::NewStub(channel));
    c.generic.push_back(std::make_unique<grpc::GenericStub>(channel));
  }
  return c;
}

void Prepare(grpc::ClientContext* c, double seconds) {
  hap::service::Security s;
  s.token = kToken;
  hap::service::PrepareClientContext(c, s, absl::Seconds(seconds));
}

v1::Node BenchNode() {
  v1::Node n;
  n.set_name("load");
  n.set_address("127.0.0.1:1");
  for (int i = 0; i < 4; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id(absl::StrCat("load/gpu", i));
    d->set_kind(v1::GPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(i % 2 ? 2e13 : 1e13);
    d->set_memory_bytes(int64_t{40} << 30);
  }
  return n;
}

bool Register(const Connections& conns) {
  grpc::ClientContext c;
  Prepare(&c, 10);
  v1::RegisterNodeRequest req;
  *req.mutable_node() = BenchNode();
  v1::RegisterNodeResponse resp;
  grpc::Status s = conns.stubs[0]->RegisterNode(&c, req, &resp);
  if (!s.ok()) std::fprintf(stderr, "RegisterNode: %s\n", s.error_message().c_str());
  return s.ok();
}

v1::CreatePlanRequest PlanRequest(int variant) {
  v1::CreatePlanRequest r;
  r.mutable_model()->mutable_zoo()->set_name("mlp");
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 2 + variant;
  r.set_wait(true);
  return r;
}

struct Result {
  int64_t calls = 0;
  double seconds = 0;
  std::vector<double> latency_ms;
  std::map<int, int64_t> errors;  // grpc code -> count
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min<size_t>(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// Keeps `in_flight` calls going for `seconds`, spread over `connections`;
// `start(connection, rng, done)` starts one call and calls done(status)
// when it ends.
using StartCall = std::function<void(int, std::minstd_rand*, std::function<void(const grpc::Status&)>)>;

Result Drive(int connections, int in_flight, double seconds, const StartCall& start) {
  Result r;
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  std::atomic<bool> stop{false};
  const auto t0 = Clock::now();
  std::function<void(int, uint32_t)> launch = [&](int i, uint32_t seed) {
    auto rng = std::make_shared<std::minstd_rand>(seed);
    const auto begin = Clock::now();
    start(i % connections, rng.get(), [&, i, rng, begin](const grpc::Status& s) {
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - begin).count();
      bool again;
      {
        std::lock_guard<std::mutex> l(mu);
        ++r.calls;
        r.latency_ms.push_back(ms);
        if (!s.ok()) ++r.errors[s.error_code()];
        again = !stop.load();
        if (!again && --running == 0) cv.notify_all();
      }
      if (again) launch(i, (*rng)());
    });
  };
  {
    std::lock_guard<std::mutex> l(mu);
    running = in_flight;
  }
  for (int i = 0; i < in_flight; ++i) launch(i, 1234 + i);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return running == 0; });
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

std::string Errors(const Result& r) {
  if (r.errors.empty()) return "0";
  std::string s;
  for (const auto& [code, n] : r.errors)
    absl::StrAppend(&s, s.empty() ? "" : ", ", n, " (code ", code, ")");
  return s;
}

// Creates `n` plans (cached copies of `variants` distinct searches), 16 in
// flight; false on any failure.
bool CreatePlans(const Connections& conns, int n, int variants, std::vector<std::string>* names,
                 double* seconds = nullptr) {
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      for (int i = next++; i < n && !failed; i = next++) {
        grpc::ClientContext c;
        Prepare(&c, 120);
        v1::Plan p;
        grpc::Status s =
            conns.stubs[t % conns.size()]->CreatePlan(&c, PlanRequest(i % variants), &p);
        if (!s.ok() || p.state() != v1::Plan::SUCCEEDED) {
          std::fprintf(stderr, "CreatePlan %d: %s %s\n", i, s.error_message().c_str(),
                       p.error().c_str());
          failed = true;
          return;
        }
        if (names != nullptr) {
          std::lock_guard<std::mutex> l(mu);
          names->push_back(p.name());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (seconds != nullptr) *seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return !failed;
}

// Start-up on a database holding `count` plans (all kept), after SIGKILL.
int StartUp(int count) {
  const std::string dir = hap::testing::TempDir("planner-load-startup");
  Planner full;
  if (!full.Start(dir, 0)) return 1;
  auto conns = Connect(full.port, 8);
  if (!Register(conns)) return 1;
  if (!CreatePlans(conns, count, 10, nullptr)) return 1;
  full.proc.Stop(SIGKILL);
  Planner again;
  if (!again.Start(dir, 0)) return 1;
  std::printf(
      "\nstart-up with %d plans in the database (after SIGKILL): %.2f "
      "s to serving, "
      "RSS %.0f MB\n",
      count, again.start_seconds, again.RssMb());
  again.proc.Stop(SIGTERM);
  return 0;
}

// A CreatePlan of variant 0's request (a new plan each call; answered from
// the cache once the first is searched); not SUCCEEDED counts as an error.
StartCall CachedCreateCall(const Connections& conns) {
  return [&conns](int conn, std::minstd_rand*, std::function<void(const grpc::Status&)> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    Prepare(ctx.get(), 60);
    auto req = std::make_shared<v1::CreatePlanRequest>(PlanRequest(0));
    auto resp = std::make_shared<v1::Plan>();
    conns.stubs[conn]->async()->CreatePlan(
        ctx.get(), req.get(), resp.get(), [ctx, req, resp, done](grpc::Status s) {
          if (s.ok() && resp->state() != v1::Plan::SUCCEEDED) {
            s = grpc::Status(grpc::StatusCode::INTERNAL, resp->error());
          }
          done(s);
        });
  };
}

// The mixed reads: GetPlan (BASIC) of a random one of `names` 80%,
// ListPlans (a page of 20, BASIC) 20%. `parse`: typed stubs, each response
// parsed into its message (what a client using the plans pays); otherwise
// requests and responses as bytes (generic stubs), an empty response
// counted as an error: the server's cost, the client's kept small.
StartCall ReadCall(const Connections& conns, const std::vector<std::string>& names, bool parse) {
  if (parse) {
    return [&conns, &names](int conn, std::minstd_rand* rng,
                            std::function<void(const grpc::Status&)> done) {
      auto ctx = std::make_shared<grpc::ClientContext>();
      Prepare(ctx.get(), 60);
      if ((*rng)() % 5 == 0) {
        auto req = std::make_shared<v1::ListPlansRequest>();
        req->set_page_size(20);
        auto resp = std::make_shared<v1::ListPlansResponse>();
        conns.stubs[conn]->async()->ListPlans(ctx.get(), req.get(), resp.get(),
                                              [ctx, req, resp, done](grpc::Status s) { done(s); });
      } else {
        auto req = std::make_shared<v1::GetPlanRequest>();
        req->set_name(names[(*rng)() % names.size()]);
        auto resp = std::make_shared<v1::Plan>();
        conns.stubs[conn]->async()->GetPlan(ctx.get(), req.get(), resp.get(),
                                            [ctx, req, resp, done](grpc::Status s) { done(s); });
      }
    };
  }
  auto gets = std::make_shared<std::vector<grpc::Slice>>();
  for (const std::string& name : names) {
    v1::GetPlanRequest r;
    r.set_name(name);
    gets->emplace_back(r.SerializeAsString());
  }
  v1::ListPlansRequest list;
  list.set_page_size(20);
  auto lists = std::make_shared<grpc::Slice>(list.SerializeAsString());
  return [&conns, gets, lists](int conn, std::minstd_rand* rng,
                               std::function<void(const grpc::Status&)> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    Prepare(ctx.get(), 60);
    const bool is_list = (*rng)() % 5 == 0;
    const grpc::Slice& slice = is_list ? *lists : (*gets)[(*rng)() % gets->size()];
    auto req = std::make_shared<grpc::ByteBuffer>(&slice, 1);
    auto resp = std::make_shared<grpc::ByteBuffer>();
    conns.generic[conn]->UnaryCall(
        ctx.get(), is_list ? "/hap.v1.Planner/ListPlans" : "/hap.v1.Planner/GetPlan",
        grpc::StubOptions(), req.get(), resp.get(), [ctx, req, resp, done](grpc::Status s) {
          if (s.ok() && resp->Length() == 0) {
            s = grpc::Status(grpc::StatusCode::INTERNAL, "empty response");
          }
          done(s);
        });
  };
}

// A planner (`binary`, or this build's when empty) on a fresh database
// holding `plans` plans (10 searches, the rest cached copies), connected.
struct Loaded {
  Planner planner;
  Connections conns;
  std::vector<std::string> names;
};
std::unique_ptr<Loaded> Load(const std::string& binary, int plans, int keep = 0) {
  auto l = std::make_unique<Loaded>();
  const std::string dir = hap::testing::TempDir("planner-load");
  if (!l->planner.Start(dir, keep, binary)) return nullptr;
  l->conns = Connect(l->planner.port, g_connections);
  if (!Register(l->conns)) return nullptr;
  if (plans > 0 && !CreatePlans(l->conns, plans, std::min(plans, 10), &l->names)) return nullptr;
  return l;
}

// Cached CreatePlan with 64 in flight for `seconds` against a fresh planner
// (`binary`, or this build's when empty) holding one searched plan.
bool CachedCreates(const std::string& binary, double seconds, Result* out) {
  auto l = Load(binary, 1);
  if (l == nullptr) return false;
  *out = Drive(l->conns.size(), 64, seconds, CachedCreateCall(l->conns));
  l->planner.proc.Stop(SIGTERM);
  return true;
}

int CreatesAB(const std::string& other, int rounds) {
  std::printf(
      "cached CreatePlan, 64 in flight, 5 s per run, alternating runs\n\n"
      "| round | %s plans/s | this build plans/s | ratio "
      "|\n|---:|---:|---:|---:|\n",
      other.c_str());
  std::vector<double> a, b;
  for (int r = 0; r < rounds; ++r) {
    Result ra, rb;
    // The order alternates between rounds, so drift hits both alike.
    const bool other_first = r % 2 == 0;
    if (!CachedCreates(other_first ? other : "", 5, other_first ? &ra : &rb)) return 1;
    if (!CachedCreates(other_first ? "" : other, 5, other_first ? &rb : &ra)) return 1;
    if (Errors(ra) != "0") std::printf("errors (other): %s\n", Errors(ra).c_str());
    if (Errors(rb) != "0") std::printf("errors (this): %s\n", Errors(rb).c_str());
    a.push_back(ra.calls / ra.seconds);
    b.push_back(rb.calls / rb.seconds);
    std::printf("| %d | %.0f | %.0f | %.2fx |\n", r + 1, a.back(), b.back(), b.back() / a.back());
    std::fflush(stdout);
  }
  std::printf("\nmedian: %.0f against %.0f plans/s: %.2fx\n", Median(b), Median(a),
              Median(b) / Median(a));
  return 0;
}

// The mixed reads at 1,000 in flight against OTHER (a build of an earlier
// commit) and this build, each holding 1,000 plans, alternating 5 s runs;
// the client reads bytes (`parse` false) or parses (true), alternating too.
int ReadsAB(const std::string& other, int rounds, int in_flight) {
  std::printf(
      "mixed reads (GetPlan 80%%, ListPlans 20%%), %d in flight, "
      "1,000 plans, "
      "5 s per run, alternating runs\n\n"
      "| round | client | %s calls/s | p99 ms | this build calls/s | "
      "p99 ms | ratio |\n"
      "|---:|---|---:|---:|---:|---:|---:|\n",
      in_flight, other.c_str());
  auto a = Load(other, 1000);
  auto b = Load("", 1000);
  if (a == nullptr || b == nullptr) return 1;
  std::map<bool, std::vector<double>> ra, rb;
  for (int r = 0; r < rounds; ++r) {
    for (bool parse : {false, true}) {
      Result x, y;
      const bool other_first = r % 2 == 0;
      Loaded* first = other_first ? a.get() : b.get();
      Loaded* second = other_first ? b.get() : a.get();
      Result* rf = other_first ? &x : &y;
      Result* rs = other_first ? &y : &x;
      *rf = Drive(first->conns.size(), in_flight, 5, ReadCall(first->conns, first->names, parse));
      *rs =
          Drive(second->conns.size(), in_flight, 5, ReadCall(second->conns, second->names, parse));
      if (Errors(x) != "0" || Errors(y) != "0") {
        std::printf("errors: %s / %s\n", Errors(x).c_str(), Errors(y).c_str());
      }
      ra[parse].push_back(x.calls / x.seconds);
      rb[parse].push_back(y.calls / y.seconds);
      std::printf("| %d | %s | %.0f | %.1f | %.0f | %.1f | %.2fx |\n", r + 1,
                  parse ? "parses" : "bytes", ra[parse].back(), Percentile(x.latency_ms, 0.99),
                  rb[parse].back(), Percentile(y.latency_ms, 0.99),
                  rb[parse].back() / ra[parse].back());
      std::fflush(stdout);
    }
  }
  for (bool parse : {false, true}) {
    std::printf("\nclient %s: median %.0f against %.0f calls/s: %.2fx", parse ? "parses" : "bytes",
                Median(rb[parse]), Median(ra[parse]), Median(rb[parse]) / Median(ra[parse]));
  }
  std::printf("\n");
  a->planner.proc.Stop(SIGTERM);
  b->planner.proc.Stop(SIGTERM);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  // --pin and --connections=N first (before any thread), then the mode.
  while (argc > 1) {
    if (std::strcmp(argv[1], "--pin") == 0) {
      if (!Pin()) return 2;
    } else if (std::strncmp(argv[1], "--connections=", 14) == 0) {
      if (!absl::SimpleAtoi(argv[1] + 14, &g_connections) || g_connections < 1) {
        std::fprintf(stderr, "--connections needs a whole number >= 1\n");
        return 2;
      }
    } else {
      break;
    }
    --argc;
    ++argv;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  // As hap-planner does: gRPC's locks are Abseil's, and the client's cost
  // comes out of the server's two cores.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (argc > 2 && std::strcmp(argv[1], "--creates-ab") == 0) {
    return CreatesAB(argv[2], argc > 3 ? std::max(1, std::atoi(argv[3])) : 6);
  }
  if (argc > 2 && std::strcmp(argv[1], "--reads-ab") == 0) {
    return ReadsAB(argv[2], argc > 3 ? std::max(1, std::atoi(argv[3])) : 4,
                   argc > 4 ? std::max(1, std::atoi(argv[4])) : 1000);
  }
  // --startup-only: only the start-up row (10,000 plans).
  if (argc > 1 && std::strcmp(argv[1], "--startup-only") == 0) return StartUp(10000);
  const double seconds = quick ? 2 : 6;
  const int plans = quick ? 200 : 1000;
  const int growth = quick ? 2000 : 10000;

  auto loaded = Load("", plans);
  if (loaded == nullptr) return 1;
  Planner& planner = loaded->planner;
  const Connections& conns = loaded->conns;
  std::printf(
      "hap-planner on 127.0.0.1 (SQLite), %d plans (10 searches of an MLP on 4 "
      "devices, "
      "the rest cached copies); %d client connections; %.0f s per row\n\n",
      plans, conns.size(), seconds);

  std::printf(
      "| calls in flight | client | calls/s | p50 ms | p99 ms | max ms | errors | planner CPU "
      "us/call | RSS MB |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---|---:|---:|\n");
  for (int in_flight : {100, 1000, 10000}) {
    for (bool parse : {false, true}) {
      const double cpu0 = planner.CpuSeconds();
      Result r = Drive(conns.size(), in_flight, seconds, ReadCall(conns, loaded->names, parse));
      const double cpu_us = (planner.CpuSeconds() - cpu0) / std::max<int64_t>(1, r.calls) * 1e6;
      std::printf("| %d | %s | %.0f | %.1f | %.1f | %.1f | %s | %.1f | %.0f |\n", in_flight,
                  parse ? "parses" : "bytes", r.calls / r.seconds, Percentile(r.latency_ms, 0.5),
                  Percentile(r.latency_ms, 0.99), Percentile(r.latency_ms, 1.0),
                  Errors(r).c_str(), cpu_us, planner.RssMb());
      std::fflush(stdout);
    }
  }

  {
    Result r = Drive(conns.size(), 64, seconds, CachedCreateCall(conns));
    std::printf(
        "\ncached CreatePlan, 64 in flight: %.0f plans/s, p50 %.1f ms, p99 %.1f ms, errors %s\n",
        r.calls / r.seconds, Percentile(r.latency_ms, 0.5), Percentile(r.latency_ms, 0.99),
        Errors(r).c_str());
  }
  planner.proc.Stop(SIGTERM);

  // Growth: plans created and expired.
  auto grow = Load("", 0, 1000);
  if (grow == nullptr) return 1;
  std::printf(
      "\n%d plans created, the planner keeping the last 1,000 "
      "(--plan-retention-count=1000):\n\n| plans created | RSS MB | plans/s |\n"
      "|---:|---:|---:|\n",
      growth);
  for (int done = 0; done < growth; done += growth / 10) {
    double s = 0;
    if (!CreatePlans(grow->conns, growth / 10, 10, nullptr, &s)) return 1;
    std::printf("| %d | %.0f | %.0f |\n", done + growth / 10, grow->planner.RssMb(),
                growth / 10 / s);
    std::fflush(stdout);
  }
  grow->planner.proc.Stop(SIGTERM);

  // Start-up on a database holding `growth` plans: keep them all.
  return StartUp(growth);
}
