// Pipeline x SPMD against the best SPMD plan and the pipeline baselines, in
// one cost model (issue 17 items 2 and 4): predicted step seconds of
//   spmd       the best SPMD plan (PlanModel: search, LP, baselines)
//   1f1b-even  1F1B, one stage per node, equal layers, dp-even inside
//   metis      Metis-style DP x PP: uneven layer split by the stage DP,
//              data parallelism at proportional (then LP) ratios inside
//   pipe       pipeline x SPMD (the stage DP with synthesized stages)
// on clusters with 1.25e9 B/s (10 GbE) inter-node links, with the ratios
// pipe/spmd and pipe/metis (speed-ups: baseline step / pipe step) and the
// planning seconds of pipe (--pipeline auto: stage counts, cuts, groups and
// microbatches together, one stage included).
//
// Usage: bazel run //bench:pipeline_bench --config=cuda -- [--examples DIR] [--quick] [--stages N]
//        [--overlap] [--hidden H]
// (--stages N: exactly N stages instead of --pipeline auto; each plan's
// stages are printed on stderr. --overlap: every plan, the SPMD one and the
// baselines too, priced with communication overlapping compute, as
// `hapctl plan --overlap on`: the SPMD plan's gradient buckets behind its
// backward, a stage's behind its last microbatch's backward. --hidden H:
// the models' hidden size (default 768), with ffn 4H and H/64 heads: wider
// layers weigh parameters, and so a stage's gradient sync and memory, more
// against its activations.)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "hap/v1/cluster.pb.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/pipeline/pipeline.h"

namespace hap {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

absl::StatusOr<cost::ClusterModel> ExampleCluster(const std::string& path, double inter_bw) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path, " (pass --examples DIR)"));
  std::stringstream ss;
  ss << f.rdbuf();
  hap::v1::Cluster c;
  if (!google::protobuf::util::JsonStringToMessage(ss.str(), &c).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a hap.v1.Cluster"));
  }
  c.mutable_defaults()->set_inter_node_bandwidth_bytes_per_second(inter_bw);
  return cost::ClusterModel::FromProto(c);
}

// Three nodes of four devices, one device kind each: the homogeneous class
// (5.97e12 FLOP/s), the fast (3.86e12) and the slow (2.15e12) of docs/design.md
// §8; 9.5e9 B/s inside a node, 1.25e9 B/s between.
cost::ClusterModel ThreeNodeMix() {
  std::vector<cost::DeviceModel> d;
  const double flops[] = {5.97e12, 3.86e12, 2.15e12};
  for (int i = 0; i < 12; ++i) {
    d.push_back({absl::StrCat("n", i / 4, "/gpu", i % 4), absl::StrCat("n", i / 4),
                 absl::StrCat("kind", i / 4), flops[i / 4], 40 * kGiB, 1e-5});
    d.back().queued_launches = true;  // GPUs, as FromProto makes them
  }
  return *cost::ClusterModel::TwoLevel(std::move(d), 9.5e9, 1e-5, 1.25e9, 5e-5);
}

struct Row {
  std::string model, cluster;
  int64_t batch;
};

std::string Describe(const pipeline::PipelinePlan& p) {
  if (!p.pipelined()) return "1 stage";
  std::vector<std::string> s;
  for (const auto& st : p.stages) {
    s.push_back(absl::StrCat(st.end_layer - st.first_layer, "L/", st.devices.size(), "d"));
  }
  return absl::StrCat(p.stages.size(), " stages (", absl::StrJoin(s, " "), "), M=", p.microbatches);
}

void PrintStages(const char* what, const pipeline::PipelinePlan& p) {
  std::fprintf(stderr, "%s: %s, step %.4f s, bubble %.4f s\n", what, Describe(p).c_str(),
               p.step_seconds, p.bubble_seconds);
  for (const std::string& n : p.notes) std::fprintf(stderr, "  note: %s\n", n.c_str());
  for (const auto& st : p.stages) {
    std::fprintf(stderr,
                 "  layers %d-%d on %zu devices (first %d): f %.4f b %.4f send %.4f grad %.4f "
                 "sync %.4f in-flight %d\n",
                 st.first_layer, st.end_layer, st.devices.size(), st.devices.front(),
                 st.times.forward, st.times.backward, st.times.send, st.times.gradient,
                 st.times.sync, st.in_flight);
  }
}

int Run(const std::string& dir, bool quick, int stages, bool overlap, int hidden) {
  struct ClusterCase {
    std::string name;
    absl::StatusOr<cost::ClusterModel> model;
  };
  std::vector<ClusterCase> clusters;
  clusters.push_back({"3-node mix (4+4+4), 1.25e9 B/s", ThreeNodeMix()});
  clusters.push_back(
      {"mixed-2node, 1.25e9 B/s", ExampleCluster(dir + "/mixed-2node.json", 1.25e9)});
  if (!quick) {
    clusters.push_back(
        {"hetero-64gpu, 1.25e9 B/s", ExampleCluster(dir + "/hetero-64gpu.json", 1.25e9)});
  }
  std::printf(
      "| model | cluster | batch | spmd s | 1f1b-even s | metis s | pipe s | pipe plan | pipe / "
      "spmd | pipe / metis | >= 1.3x spmd | >= 1.1x metis | plan s | syntheses |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (ClusterCase& cc : clusters) {
    if (!cc.model.ok()) {
      std::fprintf(stderr, "%s: %s\n", cc.name.c_str(), cc.model.status().ToString().c_str());
      return 1;
    }
    const cost::ClusterModel& c = *cc.model;
    for (const char* model : {"gpt", "vit"}) {
      const int64_t batch = c.size() >= 64 ? 256 : 96;
      auto g = graph::BuildZooModel(model, {{"layers", 12},
                                            {"hidden", static_cast<double>(hidden)},
                                            {"ffn", 4.0 * hidden},
                                            {"heads", hidden / 64.0},
                                            {"batch", static_cast<double>(batch)}});
      if (!g.ok()) {
        std::fprintf(stderr, "%s: %s\n", model, g.status().ToString().c_str());
        return 1;
      }
      pipeline::PipelineOptions o;
      o.mode = stages > 0 ? pipeline::Mode::kStages : pipeline::Mode::kAuto;
      o.stages = stages;
      o.stage_options.overlap_communication = overlap;
      auto start = std::chrono::steady_clock::now();
      auto pipe = pipeline::PlanPipeline(*g, c, o);
      const double plan_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!pipe.ok()) {
        std::fprintf(stderr, "%s pipe: %s\n", model, pipe.status().ToString().c_str());
        return 1;
      }
      o.plan_spmd = false;
      o.variant = pipeline::Variant::kDataParallel;
      auto metis = pipeline::PlanPipeline(*g, c, o);
      o.variant = pipeline::Variant::kEvenSplit;
      auto even = pipeline::PlanPipeline(*g, c, o);
      if (!metis.ok() || !even.ok()) {
        std::fprintf(stderr, "%s baselines: %s %s\n", model, metis.status().ToString().c_str(),
                     even.status().ToString().c_str());
        return 1;
      }
      const double spmd = pipe->spmd_step_seconds;
      PrintStages("pipe", *pipe);
      PrintStages("metis", *metis);
      PrintStages("1f1b-even", *even);
      // A baseline that found no pipeline is not a pipeline baseline.
      auto step = [](const pipeline::PipelinePlan& p) {
        return p.pipelined() ? p.step_seconds : INFINITY;
      };
      const double m = step(*metis), e = step(*even), p = pipe->step_seconds;
      std::printf(
          "| %s | %s | %lld | %.4f | %.4f | %.4f | %.4f | %s | %.2fx | %.2fx | %s | %s | %.1f | %d "
          "|\n",
          model, cc.name.c_str(), static_cast<long long>(batch), spmd, e, m, p,
          Describe(*pipe).c_str(), spmd / p, m / p, spmd / p >= 1.3 ? "yes" : "no",
          m / p >= 1.1 ? "yes" : "no", plan_s, pipe->syntheses);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace hap

int main(int argc, char** argv) {
  std::string dir = "planner/examples";
  bool quick = false;
  int stages = 0;
  bool overlap = false;
  int hidden = 768;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--examples" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--stages" && i + 1 < argc) {
      stages = std::atoi(argv[++i]);
    } else if (a == "--overlap") {
      overlap = true;
    } else if (a == "--hidden" && i + 1 < argc) {
      hidden = std::atoi(argv[++i]);
      if (hidden < 64 || hidden % 64 != 0) {
        std::fprintf(stderr, "--hidden must be a multiple of 64, got '%s'\n", argv[i]);
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: pipeline_bench [--examples DIR] [--quick] [--stages N] [--overlap] "
                   "[--hidden H]\n");
      return 2;
    }
  }
  return hap::Run(dir, quick, stages, overlap, hidden);
}
