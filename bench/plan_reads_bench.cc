// Plan reads: the CPU time of PlannerCore::ListPlans (one page of 20 plans,
// BASIC view) and GetPlan (BASIC and FULL) on a core holding 20 plans of a
// 12-layer GPT on 8 devices (one search, 19 cached copies), and of
// ListPlans while 4 other threads read at the same time (the core's lock
// is shared by every call). Prints a Markdown table.
//
//   bazel run -c opt //bench:plan_reads_bench -- [--quick]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "planner/service/core/planner_core.h"

namespace {

namespace v1 = ::hap::v1;
using hap::service::PlannerCore;

v1::Node Node(int devices) {
  v1::Node n;
  n.set_name("bench");
  n.set_address("127.0.0.1:1");
  for (int i = 0; i < devices; ++i) {
    v1::Device* d = n.add_devices();
    d->set_id("bench/gpu" + std::to_string(i));
    d->set_kind(v1::GPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(i % 2 ? 2e13 : 1e13);
    d->set_memory_bytes(int64_t{40} << 30);
  }
  return n;
}

double MsPerCall(int calls, const std::function<void()>& call) {
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) call();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         calls;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int calls = quick ? 20 : 200;
  hap::service::PlannerCoreOptions o;
  auto core = PlannerCore::Create(o);
  if (!core.ok() || !(*core)->RegisterNode(Node(8)).ok()) {
    std::fprintf(stderr, "cannot start the core\n");
    return 1;
  }
  v1::CreatePlanRequest r;
  r.mutable_model()->mutable_zoo()->set_name("gpt");
  (*r.mutable_model()->mutable_zoo()->mutable_params())["layers"] = 12;
  r.set_wait(true);
  std::string name;
  size_t full_bytes = 0;
  for (int i = 0; i < 20; ++i) {
    r.set_plan_id("plan-" + std::to_string(i));
    auto p = (*core)->CreatePlan(r, absl::InfiniteFuture());
    if (!p.ok() || p->state() != v1::Plan::SUCCEEDED) {
      std::fprintf(stderr, "plan %d failed: %s\n", i,
                   p.ok() ? p->error().c_str() : std::string(p.status().message()).c_str());
      return 1;
    }
    name = p->name();
  }
  full_bytes = (*core)->GetPlan(name, true)->ByteSizeLong();
  size_t list_bytes = (*core)->ListPlans(50, "")->ByteSizeLong();

  std::printf(
      "20 plans of a 12-layer GPT on 8 devices; a full plan is %.2f MB, a page of "
      "20 in the BASIC view %.2f MB\n\n",
      full_bytes / 1e6, list_bytes / 1e6);
  std::printf("| call | ms per call |\n|---|---:|\n");
  double list_ms = MsPerCall(calls, [&] { (void)(*core)->ListPlans(50, ""); });
  std::printf("| ListPlans (20, BASIC) | %.3f |\n", list_ms);
  std::printf("| GetPlan BASIC | %.3f |\n",
              MsPerCall(calls, [&] { (void)(*core)->GetPlan(name, false); }));
  std::printf("| GetPlan FULL | %.3f |\n",
              MsPerCall(calls, [&] { (void)(*core)->GetPlan(name, true); }));
  // Four readers alongside: what one ListPlans costs when others hold the
  // lock too.
  std::atomic<bool> stop{false};
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&] {
      while (!stop) (void)(*core)->ListPlans(50, "");
    });
  }
  std::printf("| ListPlans (20, BASIC), 4 more readers | %.3f |\n",
              MsPerCall(calls, [&] { (void)(*core)->ListPlans(50, ""); }));
  stop = true;
  for (auto& t : readers) t.join();
  std::printf("| ListNodes | %.3f |\n",
              MsPerCall(calls, [&] { (void)(*core)->ListNodes(50, ""); }));
  return 0;
}
