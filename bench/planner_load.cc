// The planner's gRPC API under load, on 127.0.0.1: hap-planner started as a
// process on a fresh SQLite database, driven by this client with a fixed
// number of calls in flight (gRPC's callback client; a finished call starts
// the next one at once).
//
//   reads     mixed GetPlan (BASIC, a random one of the plans) 80% and
//             ListPlans (a page of 20, BASIC) 20%, at 100, 1,000 and 10,000
//             calls in flight against a planner holding 1,000 plans: calls/s,
//             p50/p99/max latency, errors by code;
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
//
//   bazel run -c opt //bench:planner_load -- [--quick | --startup-only |
//                                              --creates-ab OTHER [ROUNDS]]
//
// Prints Markdown tables (bench/README.md, "The planner under load").
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "hap/v1/planner_service.grpc.pb.h"
#include "planner/service/grpc/grpc_util.h"
#include "tests/service_harness.h"

namespace {

namespace v1 = ::hap::v1;
using hap::testing::Process;
using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "load-token";

struct Planner {
  Process proc;
  int port = 0;
  double start_seconds = 0;  // exec -> "listening on"

  bool Start(const std::string& dir, int keep, const std::string& binary = "") {
    std::ofstream(dir + "/token") << kToken << "\n";
    const auto t0 = Clock::now();
    absl::Status s = proc.Start({binary.empty() ? hap::testing::Runfile("planner/service/hap-planner")
                                                : binary,
                                 "--listen=127.0.0.1:0", "--metrics-listen=off",
                                 "--database=" + dir + "/planner.db",
                                 "--token-file=" + dir + "/token", "--heartbeat-seconds=600",
                                 absl::StrCat("--plan-retention-count=", keep)});
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
};

// Separate connections (a local subchannel pool per channel), so the load
// is not one HTTP/2 connection's.
std::vector<std::unique_ptr<v1::Planner::Stub>> Stubs(int port, int n) {
  std::vector<std::unique_ptr<v1::Planner::Stub>> stubs;
  for (int i = 0; i < n; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("hap.load.channel", i);
    args.SetMaxReceiveMessageSize(64 << 20);
    stubs.push_back(v1::Planner::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args)));
  }
  return stubs;
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

bool Register(const std::vector<std::unique_ptr<v1::Planner::Stub>>& stubs) {
  grpc::ClientContext c;
  Prepare(&c, 10);
  v1::RegisterNodeRequest req;
  *req.mutable_node() = BenchNode();
  v1::RegisterNodeResponse resp;
  grpc::Status s = stubs[0]->RegisterNode(&c, req, &resp);
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

// Keeps `in_flight` calls going for `seconds`; `start(stub, done)` starts
// one call and calls done(status) when it ends.
using StartCall = std::function<void(v1::Planner::Stub*, std::mt19937*,
                                     std::function<void(const grpc::Status&)>)>;

Result Drive(const std::vector<std::unique_ptr<v1::Planner::Stub>>& stubs, int in_flight,
             double seconds, const StartCall& start) {
  Result r;
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  std::atomic<bool> stop{false};
  const auto t0 = Clock::now();
  std::function<void(int, uint32_t)> launch = [&](int i, uint32_t seed) {
    auto rng = std::make_shared<std::mt19937>(seed);
    const auto begin = Clock::now();
    start(stubs[i % stubs.size()].get(), rng.get(),
          [&, i, rng, begin](const grpc::Status& s) {
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
  for (const auto& [code, n] : r.errors) absl::StrAppend(&s, s.empty() ? "" : ", ", n, " (code ", code, ")");
  return s;
}

// Creates `n` plans (cached copies of `variants` distinct searches), 16 in
// flight; false on any failure.
bool CreatePlans(const std::vector<std::unique_ptr<v1::Planner::Stub>>& stubs, int n,
                 int variants, std::vector<std::string>* names, double* seconds = nullptr) {
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
        grpc::Status s = stubs[t % stubs.size()]->CreatePlan(&c, PlanRequest(i % variants), &p);
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

}  // namespace

// Start-up on a database holding `count` plans (all kept), after SIGKILL.
int StartUp(int count) {
  const std::string dir = hap::testing::TempDir("planner-load-startup");
  Planner full;
  if (!full.Start(dir, 0)) return 1;
  auto stubs = Stubs(full.port, 8);
  if (!Register(stubs)) return 1;
  if (!CreatePlans(stubs, count, 10, nullptr)) return 1;
  full.proc.Stop(SIGKILL);
  Planner again;
  if (!again.Start(dir, 0)) return 1;
  std::printf("\nstart-up with %d plans in the database (after SIGKILL): %.2f s to serving, "
              "RSS %.0f MB\n",
              count, again.start_seconds, again.RssMb());
  again.proc.Stop(SIGTERM);
  return 0;
}

// A CreatePlan of variant 0's request (a new plan each call; answered from
// the cache once the first is searched); not SUCCEEDED counts as an error.
StartCall CachedCreateCall() {
  return [](v1::Planner::Stub* stub, std::mt19937*,
            std::function<void(const grpc::Status&)> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    Prepare(ctx.get(), 60);
    auto req = std::make_shared<v1::CreatePlanRequest>(PlanRequest(0));
    auto resp = std::make_shared<v1::Plan>();
    stub->async()->CreatePlan(ctx.get(), req.get(), resp.get(),
                              [ctx, req, resp, done](grpc::Status s) {
                                if (s.ok() && resp->state() != v1::Plan::SUCCEEDED) {
                                  s = grpc::Status(grpc::StatusCode::INTERNAL, resp->error());
                                }
                                done(s);
                              });
  };
}

// Cached CreatePlan with 64 in flight for `seconds` against a fresh planner
// (`binary`, or this build's when empty) holding one searched plan.
bool CachedCreates(const std::string& binary, double seconds, Result* out) {
  const std::string dir = hap::testing::TempDir("planner-load-creates");
  Planner planner;
  if (!planner.Start(dir, 0, binary)) return false;
  auto stubs = Stubs(planner.port, 8);
  std::vector<std::string> names;
  if (!Register(stubs) || !CreatePlans(stubs, 1, 1, &names)) return false;
  const StartCall create = CachedCreateCall();
  *out = Drive(stubs, 64, seconds, create);
  planner.proc.Stop(SIGTERM);
  return true;
}

int CreatesAB(const std::string& other, int rounds) {
  std::printf("cached CreatePlan, 64 in flight, 5 s per run, alternating runs\n\n"
              "| round | %s plans/s | this build plans/s | ratio |\n|---:|---:|---:|---:|\n",
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
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  std::printf("\nmedian: %.0f against %.0f plans/s: %.2fx\n", median(b), median(a),
              median(b) / median(a));
  return 0;
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  signal(SIGPIPE, SIG_IGN);
  if (argc > 2 && std::strcmp(argv[1], "--creates-ab") == 0) {
    return CreatesAB(argv[2], argc > 3 ? std::max(1, std::atoi(argv[3])) : 6);
  }
  // --startup-only: only the start-up row (10,000 plans).
  if (argc > 1 && std::strcmp(argv[1], "--startup-only") == 0) return StartUp(10000);
  const double seconds = quick ? 2 : 6;
  const int plans = quick ? 200 : 1000;
  const int growth = quick ? 2000 : 10000;
  const std::string dir = hap::testing::TempDir("planner-load");

  Planner planner;
  if (!planner.Start(dir, 0)) return 1;
  auto stubs = Stubs(planner.port, 8);
  if (!Register(stubs)) return 1;
  std::vector<std::string> names;
  if (!CreatePlans(stubs, plans, 10, &names)) return 1;
  std::printf("hap-planner on 127.0.0.1 (SQLite), %d plans (10 searches of an MLP on 4 devices, "
              "the rest cached copies); %zu client connections; %.0f s per row\n\n",
              plans, stubs.size(), seconds);

  std::printf("| calls in flight | calls/s | p50 ms | p99 ms | max ms | errors | RSS MB |\n");
  std::printf("|---:|---:|---:|---:|---:|---|---:|\n");
  const StartCall read = [&](v1::Planner::Stub* stub, std::mt19937* rng,
                             std::function<void(const grpc::Status&)> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    Prepare(ctx.get(), 60);
    if ((*rng)() % 5 == 0) {
      auto req = std::make_shared<v1::ListPlansRequest>();
      req->set_page_size(20);
      auto resp = std::make_shared<v1::ListPlansResponse>();
      stub->async()->ListPlans(ctx.get(), req.get(), resp.get(),
                               [ctx, req, resp, done](grpc::Status s) { done(s); });
    } else {
      auto req = std::make_shared<v1::GetPlanRequest>();
      req->set_name(names[(*rng)() % names.size()]);
      auto resp = std::make_shared<v1::Plan>();
      stub->async()->GetPlan(ctx.get(), req.get(), resp.get(),
                             [ctx, req, resp, done](grpc::Status s) { done(s); });
    }
  };
  for (int in_flight : {100, 1000, 10000}) {
    Result r = Drive(stubs, in_flight, seconds, read);
    std::printf("| %d | %.0f | %.1f | %.1f | %.1f | %s | %.0f |\n", in_flight,
                r.calls / r.seconds, Percentile(r.latency_ms, 0.5),
                Percentile(r.latency_ms, 0.99), Percentile(r.latency_ms, 1.0), Errors(r).c_str(),
                planner.RssMb());
    std::fflush(stdout);
  }

  const StartCall create = CachedCreateCall();
  {
    Result r = Drive(stubs, 64, seconds, create);
    std::printf("\ncached CreatePlan, 64 in flight: %.0f plans/s, p50 %.1f ms, p99 %.1f ms, "
                "errors %s\n",
                r.calls / r.seconds, Percentile(r.latency_ms, 0.5),
                Percentile(r.latency_ms, 0.99), Errors(r).c_str());
  }
  planner.proc.Stop(SIGTERM);

  // Growth: plans created and expired.
  const std::string dir2 = hap::testing::TempDir("planner-load-growth");
  Planner grow;
  if (!grow.Start(dir2, 1000)) return 1;
  stubs = Stubs(grow.port, 8);
  if (!Register(stubs)) return 1;
  std::printf("\n%d plans created, the planner keeping the last 1,000 "
              "(--plan-retention-count=1000):\n\n| plans created | RSS MB | plans/s |\n"
              "|---:|---:|---:|\n",
              growth);
  for (int done = 0; done < growth; done += growth / 10) {
    double s = 0;
    if (!CreatePlans(stubs, growth / 10, 10, nullptr, &s)) return 1;
    std::printf("| %d | %.0f | %.0f |\n", done + growth / 10, grow.RssMb(), growth / 10 / s);
    std::fflush(stdout);
  }
  grow.proc.Stop(SIGTERM);

  // Start-up on a database holding `growth` plans: keep them all.
  return StartUp(growth);
}
