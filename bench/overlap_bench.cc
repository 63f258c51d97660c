// Predicted step against the compute lower bound, with collectives in line
// (overlap off) and overlapped with compute
// (overlap on), in one run: gpt, vit and transformer on the example clusters
// and on mixed-2node with a 10 GbE (1.25e9 B/s) inter-node link at batch 64.
// Then data parallelism's weak scaling (GPT-12, 32 samples per device) from
// 16 to 2,048 devices.
//
// The compute lower bound is the training FLOPs (forward, and backward where
// a gradient flows: synth::TrainingWork) over the cluster's summed FLOP/s.
//
// Usage: bazel run -c opt //bench:overlap_bench -- [--examples DIR] [--quick]
// (--quick: the example table only).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "hap/v1/cluster.pb.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/synth/planner.h"
#include "planner/synth/search.h"

namespace hap {
namespace {

hap::v1::Cluster ReadCluster(const std::string& path) {
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "cannot open %s (pass --examples DIR)\n", path.c_str());
    std::exit(1);
  }
  std::stringstream ss;
  ss << f.rdbuf();
  hap::v1::Cluster c;
  if (!google::protobuf::util::JsonStringToMessage(ss.str(), &c).ok()) {
    std::fprintf(stderr, "%s is not a hap.v1.Cluster\n", path.c_str());
    std::exit(1);
  }
  return c;
}

double ComputeBound(const graph::Graph& g, const cost::ClusterModel& c) {
  double flops = 0;
  for (const synth::OpWork& w : synth::TrainingWork(g)) flops += w.flops;
  return flops / c.total_flops();
}

struct Outcome {
  synth::PlanResult r;
  double seconds = 0;
};

Outcome Plan(const graph::Graph& g, const cost::ClusterModel& c, bool overlap,
             synth::Baseline b = synth::Baseline::kNone, bool bf16_gradients = false) {
  synth::PlanOptions o;
  o.overlap_communication = overlap;
  o.baseline = b;
  o.bf16_gradients = bf16_gradients;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = synth::PlanModel(g, c, o);
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r.ok()) {
    std::fprintf(stderr, "plan failed: %s\n", std::string(r.status().message()).c_str());
    std::exit(1);
  }
  return {*std::move(r), s};
}

void ExampleTable(const std::string& dir) {
  struct ClusterCase {
    std::string name;
    hap::v1::Cluster proto;
    int batch_per_device;  // 0: a fixed global batch
    int global_batch;
  };
  std::vector<ClusterCase> clusters;
  for (const char* name : {"mixed-8gpu", "mixed-2node", "hetero-64gpu"}) {
    clusters.push_back({name, ReadCluster(absl::StrCat(dir, "/", name, ".json")), 32, 0});
  }
  hap::v1::Cluster slow = ReadCluster(dir + "/mixed-2node.json");
  slow.mutable_defaults()->set_inter_node_bandwidth_bytes_per_second(1.25e9);
  clusters.push_back({"mixed-2node, 1.25e9 B/s", slow, 0, 64});

  std::printf(
      "| model | cluster | batch | compute bound s | off: step s | off: step / bound | on: step s "
      "| on: step / bound | on: exposed comm s | on: busy comm s | bucket MiB | source (on) "
      "| plan s (off, on) | on + bf16 gradients: step s | / bound |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const ClusterCase& cc : clusters) {
    auto c = cost::ClusterModel::FromProto(cc.proto);
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", std::string(c.status().message()).c_str());
      std::exit(1);
    }
    const int batch = cc.global_batch > 0 ? cc.global_batch : cc.batch_per_device * c->size();
    for (const char* model : {"gpt", "vit", "transformer"}) {
      auto g = graph::BuildZooModel(model, {{"batch", batch}});
      if (!g.ok()) {
        std::fprintf(stderr, "%s\n", std::string(g.status().message()).c_str());
        std::exit(1);
      }
      const double bound = ComputeBound(*g, *c);
      const Outcome off = Plan(*g, *c, false);
      const Outcome on = Plan(*g, *c, true);
      // Gradients synchronised in bf16 (PlanOptions.gradient_precision),
      // compute in fp32 as in the other columns: half the gradient bytes.
      const Outcome half = Plan(*g, *c, true, synth::Baseline::kNone, /*bf16_gradients=*/true);
      std::printf(
          "| %s | %s | %d | %.4f | %.4f | %.3f | %.4f | %.3f | %.4f | %.4f | %.0f | %s | %.2f, "
          "%.2f | %.4f | %.3f |\n",
          model, cc.name.c_str(), batch, bound, off.r.cost.total, off.r.cost.total / bound,
          on.r.cost.total, on.r.cost.total / bound, on.r.cost.communication,
          on.r.cost.communication_busy,
          static_cast<double>(on.r.program.bucket_bytes) / (1 << 20), on.r.source.c_str(),
          off.seconds, on.seconds, half.r.cost.total, half.r.cost.total / bound);
      std::fflush(stdout);
    }
  }
}

// GPUs of 1 fast (3.86e12) : 3 slow (2.15e12), 8 devices a node, 9.5e9 B/s inside
// and 3e9 B/s between nodes (the hetero-64gpu profile's classes and links).
cost::ClusterModel Hetero(int n) {
  std::vector<cost::DeviceModel> d;
  for (int i = 0; i < n; ++i) {
    d.push_back({"d" + std::to_string(i), "n" + std::to_string(i / 8), "gpu",
                 i % 4 == 0 ? 3.86e12 : 2.15e12, int64_t{40} << 30, 1e-5});
    d.back().queued_launches = true;  // GPUs, as FromProto makes them
  }
  return *cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 3e9, 5e-5);
}

void WeakScaling() {
  std::printf(
      "\n| devices | compute bound s | dp-prop step s (in line) | / bound | dp-prop step s "
      "(overlap) | / bound | gradient all-reduce | plan s |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (int n : {16, 64, 256, 1024, 2048}) {
    auto c = Hetero(n);
    auto g = graph::BuildZooModel("gpt", {{"layers", 12}, {"batch", 32 * n}});
    if (!g.ok()) std::exit(1);
    const double bound = ComputeBound(*g, c);
    const Outcome off = Plan(*g, c, false, synth::Baseline::kDpProportional);
    const Outcome on = Plan(*g, c, true, synth::Baseline::kDpProportional);
    const auto& b = off.r.program.buckets;
    std::printf("| %d | %.4f | %.4f | %.3f | %.4f | %.3f | %s, %zu x 64 MiB | %.1f |\n", n,
                bound, off.r.cost.total, off.r.cost.total / bound, on.r.cost.total,
                on.r.cost.total / bound, b.empty() ? "none" : b.front().algorithm, b.size(),
                off.seconds + on.seconds);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace hap

int main(int argc, char** argv) {
  std::string dir = "planner/examples";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--examples" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: overlap_bench [--examples DIR] [--quick]\n");
      return 2;
    }
  }
  hap::ExampleTable(dir);
  if (!quick) hap::WeakScaling();
  return 0;
}
