// Synthesis benchmark: time and states expanded of the search for zoo models
// at paper scale (12 layers) and deeper (24, 48), on 8, 16 and 64 devices of
// 2-4 device types; in the same run, the same search with a zero heuristic
// (uniform-cost search, the reference algorithm) as the baseline. Prints a
// Markdown table. Runs on one thread.
//
//   bazel run -c opt //bench:synth_bench -- [--quick]
#include <chrono>
#include <cmath>
#include <map>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/synth/planner.h"
#include "planner/synth/search.h"

namespace {

using hap::cost::ClusterModel;
using hap::cost::DeviceModel;

// The reference profile's device classes (DESIGN.md §8), plus two more for
// four-type clusters.
constexpr double kClasses[] = {3.86e12, 2.15e12, 5.97e12, 1.2e12};

ClusterModel Make(int devices, int types, int per_node) {
  std::vector<DeviceModel> d;
  for (int i = 0; i < devices; ++i) {
    int node = i / per_node;
    int type = node % types;
    if (types == 2) type = (i < devices / 4) ? 0 : 1;  // 1 fast : 3 slow
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(node), "",
                 kClasses[type], int64_t{40} << 30, 1e-5});
  }
  std::vector<std::vector<double>> bw(devices, std::vector<double>(devices)),
      lat = bw;
  for (int i = 0; i < devices; ++i) {
    for (int j = 0; j < devices; ++j) {
      bool same = i / per_node == j / per_node;
      bw[i][j] = same ? 9.5e9 : 3e9;
      lat[i][j] = same ? 1e-5 : 5e-5;
    }
  }
  return *ClusterModel::Create(d, bw, lat);
}

struct Run {
  double seconds = 0;
  int64_t states = 0;
  double cost = 0;
  bool optimal = false;
};

Run Search(const hap::graph::Graph& g, const ClusterModel& c, bool zero,
           bool blocks, double budget) {
  hap::synth::SearchOptions o;
  o.zero_heuristic = zero;
  o.block_search = blocks;
  o.max_seconds = budget;
  auto t0 = std::chrono::steady_clock::now();
  auto p = hap::synth::Synthesize(g, c, o);
  Run r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                  .count();
  if (p.ok()) {
    r.states = p->states_expanded;
    r.cost = p->cost;
    r.optimal = p->optimal;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  struct Config {
    std::string model;
    int layers, devices, types, per_node;
  };
  std::vector<Config> configs;
  for (int layers : {12, 24, 48}) {
    configs.push_back({"gpt", layers, 16, 2, 8});
  }
  if (!quick) {
    configs.push_back({"gpt", 12, 8, 2, 8});
    configs.push_back({"gpt", 12, 64, 2, 8});
    configs.push_back({"gpt", 12, 16, 4, 4});
    configs.push_back({"gpt", 24, 64, 4, 8});
    for (const char* m : {"transformer", "vit", "moe", "vgg"}) {
      configs.push_back({m, 12, 16, 2, 8});
    }
  }
  double budget = quick ? 10 : 30;
  std::printf(
      "| model | layers | devices | types | block s | block states | A* s | "
      "A* states | uniform-cost s | uniform-cost states | time ratio "
      "(uniform / block) | same cost | joint plan s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Config& cfg : configs) {
    ClusterModel c = Make(cfg.devices, cfg.types, cfg.per_node);
    std::map<std::string, double> p = {{"batch", 32.0 * cfg.devices}};
    if (cfg.model != "vgg") p["layers"] = cfg.layers;
    if (cfg.model == "moe") {
      // The dense GShard combine tensor [tokens, experts, capacity] grows with
      // tokens^2: at 32 samples per device it fits no GPU, so MoE runs at 4.
      p["experts"] = 2.0 * cfg.devices;
      p["batch"] = 4.0 * cfg.devices;
    }
    auto g = hap::graph::BuildZooModel(cfg.model, p);
    if (!g.ok()) {
      std::fprintf(stderr, "%s\n", std::string(g.status().message()).c_str());
      return 1;
    }
    Run b = Search(*g, c, false, true, budget);
    Run a = Search(*g, c, false, false, budget);
    Run z = Search(*g, c, true, false, budget);
    auto t0 = std::chrono::steady_clock::now();
    auto plan = hap::synth::PlanModel(*g, c, hap::synth::PlanOptions());
    double joint = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - t0)
                       .count();
    auto eq = [](const Run& x, const Run& y) {
      return x.optimal && y.optimal && std::abs(x.cost - y.cost) <= 1e-9 * x.cost;
    };
    const char* same = (eq(b, a) && (eq(b, z) || !z.optimal)) ? "yes" : "NO";
    std::printf(
        "| %s | %d | %d | %d | %.3f | %lld | %.3f%s | %lld | %.3f%s | %lld | "
        "%.1fx | %s | %.3f%s |\n",
        cfg.model.c_str(), cfg.model == "vgg" ? 0 : cfg.layers, cfg.devices,
        cfg.types, b.seconds, static_cast<long long>(b.states), a.seconds,
        a.optimal ? "" : " (cut)", static_cast<long long>(a.states), z.seconds,
        z.optimal ? "" : " (cut)", static_cast<long long>(z.states),
        b.seconds > 0 ? z.seconds / b.seconds : 0.0, same, joint,
        plan.ok() ? "" : " (failed)");
    std::fflush(stdout);
  }
  return 0;
}
