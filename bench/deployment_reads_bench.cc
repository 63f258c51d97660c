// What /metrics and the status page pay to read the deployments the
// planner holds: DeploymentManager::All() (every record whole, each rank's
// per-op profile included) against Summaries() (the records without the
// profiles, what those readers use), on 1,000 finished deployments of 64
// ranks, each rank's profile with 40 op types. Interleaved rounds (the
// machine is shared), medians, ratio. Each call holds the manager's lock
// for its whole copy: step-metric reports and state changes wait on it.
// Three per-deployment families of /metrics read the deployments at every
// scrape.
//
//   bazel run -c opt //bench:deployment_reads_bench -- [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/service/core/deployment_manager.h"

namespace {

namespace v1 = ::hap::v1;

std::vector<v1::Deployment> Held(int deployments, int ranks, int op_types) {
  std::vector<v1::Deployment> out;
  for (int i = 0; i < deployments; ++i) {
    v1::Deployment d;
    d.set_name(absl::StrCat("deployments/train-", i, "-g1"));
    d.set_plan(absl::StrCat("plans/train-", i));
    d.set_generation(1);
    d.set_state(v1::Deployment::SUCCEEDED);
    d.set_steps_completed(1000);
    d.set_last_loss(2.5);
    d.mutable_end_time()->set_seconds(1700000000 + i);
    for (int r = 0; r < ranks; ++r) {
      auto* a = d.add_ranks();
      a->set_rank(r);
      a->set_device(absl::StrCat("node", r / 8, "/gpu", r % 8));
      a->set_executor_address(absl::StrCat("10.0.", r / 8, ".1:7070"));
      v1::StepProfile* p = d.add_rank_profiles();
      p->set_rank(r);
      p->set_device(a->device());
      p->set_plan_content_hash("0123456789abcdef0123456789abcdef");
      p->set_first_step(900);
      p->set_steps(100);
      p->set_step_seconds_median(0.25);
      p->set_device_seconds(0.2);
      for (int t = 0; t < op_types; ++t) {
        (*p->mutable_op_seconds())[absl::StrCat("op_type_", t)] = 0.001 * t;
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

double Ms(const std::function<size_t()>& call, size_t* bytes) {
  auto start = std::chrono::steady_clock::now();
  *bytes = call();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int deployments = quick ? 200 : 1000, ranks = 64, op_types = 40;
  const int rounds = quick ? 5 : 15;
  hap::service::DeploymentManagerOptions o;
  o.executors = [](const v1::Deployment&) -> std::unique_ptr<hap::service::DeploymentExecutors> {
    return nullptr;
  };
  hap::service::DeploymentManager m(std::move(o), Held(deployments, ranks, op_types));
  auto size_of = [](const std::vector<v1::Deployment>& v) {
    size_t n = 0;
    for (const auto& d : v) n += d.ByteSizeLong();
    return n;
  };
  std::vector<double> all_ms, summary_ms;
  size_t all_bytes = 0, summary_bytes = 0;
  for (int r = 0; r < rounds; ++r) {  // interleaved, the order alternating
    auto all = [&] { all_ms.push_back(Ms([&] { return size_of(m.All()); }, &all_bytes)); };
    auto summaries = [&] {
      summary_ms.push_back(Ms([&] { return size_of(m.Summaries()); }, &summary_bytes));
    };
    if (r % 2 == 0) {
      all();
      summaries();
    } else {
      summaries();
      all();
    }
  }
  std::printf(
      "| %d deployments x %d ranks (%d op types) | ms per call (median of %d) | MB "
      "copied |\n|---|---|---|\n",
      deployments, ranks, op_types, rounds);
  std::printf("| All() (baseline) | %.1f | %.1f |\n", Median(all_ms), all_bytes / 1e6);
  std::printf("| Summaries() | %.2f | %.2f |\n", Median(summary_ms), summary_bytes / 1e6);
  std::printf("\nSummaries() / All(): %.3fx the time (%.0fx faster)\n",
              Median(summary_ms) / Median(all_ms), Median(all_ms) / Median(summary_ms));
  return 0;
}
