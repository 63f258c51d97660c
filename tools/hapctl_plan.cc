#include "tools/hapctl_plan.h"

#include <algorithm>
#include <fstream>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "planner/calibrate/calibration.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_builder.h"
#include "planner/pipeline/pipeline.h"
#include "planner/pipeline/pipeline_plan.h"
#include "planner/synth/planner.h"
#include "tools/hapctl_graph.h"
#include "tools/hapctl_optimizer.h"

namespace hap::tools {
namespace {

constexpr char kUsage[] = R"(usage: hapctl plan --cluster CLUSTER.json [--model NAME | --graph FILE]
                   [--layers N --hidden N --batch N ... (zoo parameters)]
                   [--devices ID,ID,...] [--baseline hap|dp-even|dp-prop|megatron|zero3]
                   [--ratios R,R,... (with --baseline: its split, one per device)]
                   [--no-sfb] [--no-zero] [--no-grouped] [--zero-heuristic]
                   [--overlap on|off] [--precision fp32|bf16]
                   [--gradient-precision fp32|bf16]
                   [--optimizer sgd|momentum|adam] [--ignore-memory]
                   [--max-states N] [--max-seconds S] [-o table|json]
                   [--save-plan PLAN.pb] [--lr X] [--momentum X]
                   [--weight-decay X] [--clip-norm X] [--seed N]
                   [--beta1 X] [--beta2 X] [--epsilon X]
                   [--pipeline off|auto|N] [--microbatches N]

Synthesizes the SPMD program and sharding ratios offline. Zoo models default
to a batch of 32 per device and (moe/switch) 2 experts per device.
--save-plan lowers the plan to per-rank programs (with the optimizer flags)
and writes the hap.v1.Plan in binary for hap-executor / hap-launch.
--ratios gives a baseline another split than its own (e.g. --baseline
dp-prop --ratios 0.75,0.25: data parallelism at a synthesized plan's split);
ratios are rounded to whole samples of the batch, as they will run.
--overlap on prices collectives as overlapping compute (gradient buckets
during backward, the bucket size chosen by the planner; ZeRO gathers
prefetched) and lowers them so: hap-executor starts them early and runs
them behind compute (hap-executor --overlap off runs them in line). Off
(the default) prices and runs them in line.
--precision bf16 plans bf16 mixed precision (README "Precision"): products
in bf16 with fp32 accumulation, fp32 master weights; each device priced at
its bf16 FLOP/s (its fp32 rate when its profile has none).
--gradient-precision bf16 synchronises the parameters' gradients in bf16
(the gradient buckets' all-reduces and ZeRO's gradient reduce-scatters send
and sum bf16: half the bytes, priced so); fp32 (the default) sums them as
they are. The loss, parameters and optimizer stay fp32.
--pipeline auto plans pipeline stages with a synthesized SPMD program each
(README "Pipeline plans"): stage count, cuts, device groups and microbatches
(--microbatches N fixes it) chosen together, one stage (the SPMD plan)
included; N asks for exactly N stages. Off (the default): one SPMD program.
--save-plan saves a plan with stages too; hap-launch runs it (1F1B).
)";

int Fail(const absl::Status& s) {
  std::cerr << "error: " << s.message() << "\n";
  return 1;
}

absl::StatusOr<hap::v1::Cluster> ReadCluster(const std::string& path) {
  HAP_ASSIGN_OR_RETURN(std::string json, ReadInputFile(path, "cluster file "));
  hap::v1::Cluster c;
  auto st = google::protobuf::util::JsonStringToMessage(json, &c);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster file '", path, "' is not a hap.v1.Cluster in JSON: ",
        st.message().as_string()));
  }
  return c;
}

std::string FormList(const std::vector<synth::Form>& fs) {
  std::vector<std::string> s;
  for (auto f : fs) s.push_back(f.ToString());
  return absl::StrJoin(s, ",");
}

// `s` as a JSON string. Control characters as \u00XX: a graph file's names
// (a model's, an op's) may hold a tab or a newline, which made -o json no
// JSON.
std::string Json(const std::string& s) { return "\"" + JsonEscape(s) + "\""; }

void PrintJson(const graph::Graph& g, const cost::ClusterModel& cl,
               const synth::PlanResult& r, synth::Baseline b, const std::string& precision) {
  std::ostringstream o;
  o << "{\n";
  o << "  \"model\": " << Json(g.name()) << ",\n";
  o << "  \"precision\": " << Json(precision) << ",\n";
  o << "  \"gradient_precision\": "
    << Json(r.program.gradient_wire_scale < 1 ? "bf16" : "fp32") << ",\n";
  o << "  \"baseline\": " << Json(synth::BaselineName(b)) << ",\n";
  o << "  \"source\": " << Json(r.source) << ",\n";
  o << absl::StrFormat("  \"predicted_step_seconds\": %.9g,\n", r.cost.total);
  o << absl::StrFormat("  \"compute_seconds\": %.9g,\n", r.cost.compute);
  o << absl::StrFormat("  \"communication_seconds\": %.9g,\n",
                       r.cost.communication);
  o << "  \"overlap_communication\": " << (r.program.overlap ? "true" : "false") << ",\n";
  o << absl::StrFormat("  \"communication_busy_seconds\": %.9g,\n",
                       r.cost.communication_busy);
  o << "  \"gradient_bucket_bytes\": " << r.program.bucket_bytes << ",\n";
  o << "  \"gradient_buckets\": " << r.program.buckets.size() << ",\n";
  o << absl::StrFormat("  \"synthesis_seconds\": %.6g,\n", r.synthesis_seconds);
  o << "  \"states_expanded\": " << r.states_expanded << ",\n";
  o << "  \"optimal\": " << (r.optimal ? "true" : "false") << ",\n";
  o << "  \"joint_iterations\": " << r.joint_iterations << ",\n";
  o << "  \"notes\": [";
  for (size_t i = 0; i < r.notes.size(); ++i) o << (i ? ", " : "") << Json(r.notes[i]);
  o << "],\n";
  o << "  \"devices\": [";
  for (int i = 0; i < cl.size(); ++i) {
    o << (i ? ", " : "") << Json(cl.device(i).id);
  }
  o << "],\n  \"ratios\": [";
  for (size_t i = 0; i < r.ratios.size(); ++i) {
    o << (i ? ", " : "") << absl::StrFormat("%.9g", r.ratios[i]);
  }
  o << "],\n  \"memory_bytes_per_device\": [";
  for (size_t i = 0; i < r.memory_bytes.size(); ++i) {
    o << (i ? ", " : "") << r.memory_bytes[i];
  }
  o << "],\n  \"ops\": [\n";
  for (size_t k = 0; k < r.program.steps.size(); ++k) {
    const auto& s = r.program.steps[k];
    const auto& op = g.op(s.op);
    o << "    {\"op\": " << Json(op.name) << ", \"type\": " << Json(op.type)
      << ", \"rule\": " << Json(s.rule.name) << ", \"inputs\": "
      << Json(FormList(s.rule.inputs)) << ", \"outputs\": "
      << Json(FormList(s.rule.outputs));
    o << ", \"sources\": [";
    for (size_t j = 0; j < s.loads.size(); ++j) {
      const auto& l = s.loads[j];
      o << (j ? ", " : "") << "{\"tensor\": " << Json(g.tensor(l.tensor).name)
        << ", \"form\": " << Json(l.form.ToString());
      if (l.parameter) {
        o << ", \"storage\": " << Json(synth::StorageName(l.storage))
          << ", \"grad_allreduce\": " << (l.grad_allreduce ? "true" : "false")
          << ", \"sfb\": " << (l.sfb ? "true" : "false");
        if (l.storage == synth::ParamStorage::kZero) {
          o << ", \"gathered_once\": " << (l.gather_once ? "true" : "false");
        }
      }
      o << "}";
    }
    o << "], \"communication\": [";
    for (size_t j = 0; j < s.comms.size(); ++j) {
      const auto& c = s.comms[j];
      o << (j ? ", " : "") << "{\"tensor\": " << Json(g.tensor(c.tensor).name)
        << ", \"from\": " << Json(c.from.ToString()) << ", \"to\": "
        << Json(c.to.ToString()) << ", \"forward\": "
        << Json(synth::CollectiveName(c.forward)) << ", \"backward\": "
        << Json(c.has_backward ? synth::CollectiveName(c.backward) : "none")
        << ", \"method\": " << Json(synth::MethodName(c.method)) << "}";
    }
    o << "]}" << (k + 1 < r.program.steps.size() ? "," : "") << "\n";
  }
  o << "  ]\n}\n";
  std::cout << o.str();
}

std::string Bytes(double b) {
  return absl::StrFormat("%.2f GiB", b / (1024.0 * 1024 * 1024));
}

void PrintTable(const graph::Graph& g, const cost::ClusterModel& cl,
                const synth::PlanResult& r, synth::Baseline b, const std::string& precision) {
  std::cout << absl::StrFormat(
      "Plan for %s on %d devices (%s)%s\n", g.name(), cl.size(),
      b == synth::Baseline::kNone ? "synthesized: " + r.source
                                  : std::string("baseline ") +
                                        synth::BaselineName(b),
      absl::StrCat(precision == "bf16" ? ", bf16 mixed precision" : "",
                   r.program.gradient_wire_scale < 1 ? ", bf16 gradients" : ""));
  if (r.program.overlap) {
    std::cout << absl::StrFormat(
        "predicted step %.4f s = compute %.4f s + exposed communication %.4f s "
        "(communication overlapped with compute, assumed: %.4f s busy, %.4f s hidden)\n",
        r.cost.total, r.cost.compute, r.cost.communication, r.cost.communication_busy,
        std::max(0.0, r.cost.communication_busy - r.cost.communication));
  } else {
    std::cout << absl::StrFormat(
        "predicted step %.4f s = compute %.4f s + communication %.4f s "
        "(collectives in line)\n",
        r.cost.total, r.cost.compute, r.cost.communication);
  }
  if (!r.program.buckets.empty()) {
    std::cout << absl::StrFormat(
        "gradient all-reduce: %d bucket(s) of up to %.0f MiB (%s%s)\n",
        static_cast<int>(r.program.buckets.size()),
        static_cast<double>(r.program.bucket_bytes) / (1 << 20),
        r.program.buckets.front().algorithm,
        r.program.overlap ? ", started in backward as each fills"
                          : ", after backward");
  }
  std::cout << absl::StrFormat(
      "synthesis %.3f s, %d states expanded, %s, %d joint iteration(s)\n\n",
      r.synthesis_seconds, r.states_expanded,
      r.optimal ? "proven optimal" : "NOT proven optimal (budget cut)",
      r.joint_iterations);
  for (const std::string& note : r.notes) std::cout << "note: " << note << "\n";
  if (!r.notes.empty()) std::cout << "\n";
  // MEMORY over the used part ("9.13 GiB / 40.00 GiB"), not right-aligned
  // past it.
  std::cout << absl::StrFormat("%-22s %10s %12s %s\n", "DEVICE", "RATIO", "TFLOP/S", "MEMORY");
  for (int i = 0; i < cl.size(); ++i) {
    std::cout << absl::StrFormat(
        "%-22s %10.4f %12.2f %7s / %s\n", cl.device(i).id, r.ratios[i],
        cl.device(i).flops / 1e12, Bytes(r.memory_bytes[i]),
        Bytes(cl.device(i).memory_bytes));
  }
  std::cout << "\n"
            << absl::StrFormat("%-34s %-12s %-14s %-18s %s\n", "OP", "TYPE",
                               "RULE", "FORMS in -> out", "COMMUNICATION");
  for (const auto& s : r.program.steps) {
    const auto& op = g.op(s.op);
    std::vector<std::string> comm;
    for (const auto& l : s.loads) {
      if (!l.parameter) continue;
      std::string what = absl::StrCat(g.tensor(l.tensor).name, " stored ",
                                      synth::StorageName(l.storage));
      if (l.gather_once) absl::StrAppend(&what, ", gathered once per step");
      if (l.grad_allreduce) absl::StrAppend(&what, ", grad all-reduce");
      if (l.sfb) absl::StrAppend(&what, ", SFB");
      if (l.storage == synth::ParamStorage::kReplicated && !l.grad_allreduce &&
          !l.sfb) {
        continue;
      }
      comm.push_back(what);
    }
    for (const auto& c : s.comms) {
      comm.push_back(absl::StrCat(
          g.tensor(c.tensor).name, " ", c.from.ToString(), "->",
          c.to.ToString(), " ", synth::CollectiveName(c.forward),
          c.method == synth::Method::kNone
              ? ""
              : absl::StrCat(" (", synth::MethodName(c.method), ")"),
          c.has_backward
              ? absl::StrCat(", bwd ", synth::CollectiveName(c.backward))
              : ""));
    }
    std::string name = op.name.size() > 34 ? "…" + op.name.substr(op.name.size() - 33)
                                           : op.name;
    std::cout << absl::StrFormat(
        "%-34s %-12s %-14s %-18s %s\n", name, op.type, s.rule.name,
        FormList(s.rule.inputs) + " -> " + FormList(s.rule.outputs),
        absl::StrJoin(comm, "; "));
  }
}

// The plan file's options from the flags (optimizer, seed, precision).
absl::StatusOr<hap::v1::PlanOptions> SavedPlanOptions(const Args& args,
                                                      hap::v1::Precision precision) {
  hap::v1::PlanOptions po;
  po.set_precision(precision);
  HAP_ASSIGN_OR_RETURN(*po.mutable_optimizer(), OptimizerFromFlags(args));
  HAP_ASSIGN_OR_RETURN(int64_t seed,
                       args.Integer("seed", 0, 0, std::numeric_limits<int64_t>::max()));
  po.set_seed(static_cast<uint64_t>(seed));
  return po;
}

absl::Status WritePlanFile(const Args& args, const hap::v1::Plan& plan) {
  std::string path = args.Get("save-plan");
  std::string bytes;
  if (!plan.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrCat("cannot encode the plan for '", path, "'"));
  }
  HAP_RETURN_IF_ERROR(WriteOutputFile(path, bytes, "--save-plan file "));
  std::cerr << "wrote plan for " << plan.rank_programs_size() << " ranks to " << path
            << "\n";
  return absl::OkStatus();
}

absl::Status SavePlan(const Args& args, const graph::Graph& g, const hap::v1::Cluster& profile,
                      const cost::ClusterModel& cluster, const synth::PlanResult& r,
                      hap::v1::PlanOptions po) {
  po.set_gradient_precision(r.program.gradient_wire_scale < 1 ? hap::v1::PRECISION_BF16
                                                              : hap::v1::PRECISION_FP32);
  HAP_ASSIGN_OR_RETURN(hap::v1::Plan plan,
                       lower::BuildPlan(g, profile, cluster, r, po));
  return WritePlanFile(args, plan);
}

// A pipeline plan's file: every device's stage program (LowerStage).
absl::Status SavePipelinePlan(const Args& args, const graph::Graph& g,
                              const hap::v1::Cluster& profile, const cost::ClusterModel& cluster,
                              const pipeline::PipelinePlan& p, hap::v1::PlanOptions po) {
  po.set_pipeline(hap::v1::PlanOptions::PIPELINE_STAGES);
  po.set_pipeline_stages(static_cast<int>(p.stages.size()));
  po.set_pipeline_microbatches(p.microbatches);
  HAP_ASSIGN_OR_RETURN(hap::v1::Plan plan,
                       pipeline::BuildPipelinePlan(g, profile, cluster, p, po));
  return WritePlanFile(args, plan);
}

std::string StageOps(const graph::Graph& g, const pipeline::StagePlan& s) {
  return absl::StrCat(g.op(s.begin_op).name, " .. ", g.op(s.end_op - 1).name);
}

void PrintPipelineTable(const pipeline::PipelinePlan& p, const cost::ClusterModel& cl) {
  const graph::Graph& g = *p.microbatch_graph;
  std::cout << absl::StrFormat(
      "pipeline: %d stages, %d microbatches of %d samples (1F1B), %d layers to cut between\n",
      p.stages.size(), p.microbatches, p.microbatch_size, p.layers);
  std::cout << absl::StrFormat(
      "predicted step: %.4f s (bubble %.4f s); best SPMD plan %.4f s (%.2fx)\n",
      p.step_seconds, p.bubble_seconds, p.spmd_step_seconds,
      p.spmd_step_seconds / p.step_seconds);
  std::cout << absl::StrFormat("planned in %.2f s (%d stage syntheses)\n", p.planning_seconds,
                               p.syntheses);
  for (const std::string& n : p.notes) std::cout << "note: " << n << "\n";
  std::cout << "note: --save-plan writes it for hap-launch (README \"Pipeline plans\")\n\n";
  std::cout << absl::StrFormat("%-5s %-8s %-38s %-9s %-9s %-9s %-9s %-9s %-5s %s\n", "stage",
                               "layers", "ops", "fwd s", "bwd s", "send s", "grad s", "sync s",
                               "held", "devices (ratio, memory GiB)");
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const pipeline::StagePlan& s = p.stages[i];
    std::vector<std::string> dev;
    for (size_t d = 0; d < s.devices.size(); ++d) {
      dev.push_back(absl::StrFormat("%s (%.3f, %.1f)", cl.device(s.devices[d]).id, s.ratios[d],
                                    s.memory_bytes[d] / double(int64_t{1} << 30)));
    }
    std::string ops = StageOps(g, s);
    if (ops.size() > 38) ops = "…" + ops.substr(ops.size() - 37);
    std::cout << absl::StrFormat("%-5d %-8s %-38s %-9.4f %-9.4f %-9.4f %-9.4f %-9.4f %-5d %s\n",
                                 i, absl::StrCat(s.first_layer, "-", s.end_layer - 1), ops,
                                 s.times.forward, s.times.backward, s.times.send,
                                 s.times.gradient, s.times.sync, s.in_flight,
                                 absl::StrJoin(dev, ", "));
    if (s.output_tensor >= 0) {
      std::cout << absl::StrFormat("      sends %s %s\n", g.tensor(s.output_tensor).name,
                                   s.output_form.ToString());
    }
  }
}

void PrintPipelineJson(const pipeline::PipelinePlan& p, const cost::ClusterModel& cl) {
  const graph::Graph& g = *p.microbatch_graph;
  std::ostringstream o;
  o << "{\n  \"model\": " << Json(g.name()) << ",\n";
  o << "  \"pipeline\": {\n";
  o << "    \"variant\": " << Json(pipeline::VariantName(p.variant)) << ",\n";
  o << "    \"schedule\": \"1f1b\",\n";
  o << "    \"microbatches\": " << p.microbatches << ",\n";
  o << "    \"microbatch_size\": " << p.microbatch_size << ",\n";
  o << "    \"layers\": " << p.layers << ",\n";
  o << absl::StrFormat("    \"step_seconds\": %.9g,\n", p.step_seconds);
  o << absl::StrFormat("    \"bubble_seconds\": %.9g,\n", p.bubble_seconds);
  o << absl::StrFormat("    \"spmd_step_seconds\": %.9g,\n", p.spmd_step_seconds);
  o << absl::StrFormat("    \"planning_seconds\": %.6g,\n", p.planning_seconds);
  o << "    \"executable\": true,\n";
  o << "    \"stages\": [\n";
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const pipeline::StagePlan& s = p.stages[i];
    o << "      {\"index\": " << i << ", \"first_layer\": " << s.first_layer
      << ", \"end_layer\": " << s.end_layer << ", \"begin_op\": " << s.begin_op
      << ", \"end_op\": " << s.end_op << ", \"first_op\": " << Json(g.op(s.begin_op).name)
      << ", \"last_op\": " << Json(g.op(s.end_op - 1).name) << ", \"devices\": [";
    for (size_t d = 0; d < s.devices.size(); ++d) {
      o << (d ? ", " : "") << Json(cl.device(s.devices[d]).id);
    }
    o << "], \"ratios\": [";
    for (size_t d = 0; d < s.ratios.size(); ++d) {
      o << (d ? ", " : "") << absl::StrFormat("%.9g", s.ratios[d]);
    }
    o << "], \"memory_bytes_per_device\": [";
    for (size_t d = 0; d < s.memory_bytes.size(); ++d) {
      o << (d ? ", " : "") << s.memory_bytes[d];
    }
    o << "]" << absl::StrFormat(
        ", \"forward_seconds\": %.9g, \"backward_seconds\": %.9g, \"send_seconds\": %.9g, "
        "\"gradient_receive_seconds\": %.9g, \"sync_seconds\": %.9g",
        s.times.forward, s.times.backward, s.times.send, s.times.gradient, s.times.sync);
    o << ", \"in_flight_microbatches\": " << s.in_flight;
    o << ", \"output_tensor\": "
      << Json(s.output_tensor >= 0 ? g.tensor(s.output_tensor).name : "")
      << ", \"output_form\": " << Json(s.output_tensor >= 0 ? s.output_form.ToString() : "");
    o << ", \"rules\": [";
    for (size_t k = 0; k < s.program.steps.size(); ++k) {
      o << (k ? ", " : "") << Json(s.program.steps[k].rule.name);
    }
    o << "]}" << (i + 1 < p.stages.size() ? "," : "") << "\n";
  }
  o << "    ]\n  },\n  \"notes\": [";
  for (size_t i = 0; i < p.notes.size(); ++i) o << (i ? ", " : "") << Json(p.notes[i]);
  o << "]\n}\n";
  std::cout << o.str();
}

absl::StatusOr<pipeline::PipelineOptions> ParsePipeline(const Args& args) {
  pipeline::PipelineOptions pp;
  const std::string v = args.Get("pipeline", "off");
  int n = 0;
  if (v == "off") {
    pp.mode = pipeline::Mode::kOff;
  } else if (v == "auto") {
    pp.mode = pipeline::Mode::kAuto;
  } else if (absl::SimpleAtoi(v, &n) && n >= 1) {
    pp.mode = pipeline::Mode::kStages;
    pp.stages = n;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--pipeline must be off, auto or a stage count >= 1, got '", v, "'"));
  }
  if (args.Has("microbatches")) {
    if (!absl::SimpleAtoi(args.Get("microbatches"), &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--microbatches must be a positive integer, got '", args.Get("microbatches"), "'"));
    }
    if (pp.mode == pipeline::Mode::kOff) {
      return absl::InvalidArgumentError("--microbatches needs --pipeline auto or N");
    }
    pp.microbatches = n;
  }
  return pp;
}

}  // namespace

int RunPlan(const std::vector<std::string>& argv) {
  std::set<std::string> value_flags = ZooParamFlags();
  value_flags.insert(
      {"o",        "output",      "set",          "cluster",    "model",       "graph",
       "devices",  "baseline",    "optimizer",    "max-states", "max-seconds", "save-plan",
       "lr",       "momentum",    "weight-decay", "clip-norm",  "beta1",       "beta2",
       "epsilon",  "seed",        "ratios",       "overlap",    "precision",   "gradient-precision",
       "pipeline", "microbatches"});
  auto args = Args::Parse(argv, value_flags,
                          {"help", "no-sfb", "no-zero", "no-grouped",
                           "zero-heuristic", "ignore-memory"});
  if (!args.ok()) return Fail(args.status());
  if (args->Bool("help")) {
    std::cout << kUsage;
    return 0;
  }
  // A word that is no flag's was dropped: 'hapctl plan vit --cluster C'
  // planned the default model, gpt.
  if (!args->positional().empty()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("hapctl plan: unexpected argument '", args->positional()[0],
                     "' (the model is --model NAME or --graph FILE; a flag's value without "
                     "its flag?)")));
  }
  if (!args->Has("cluster")) {
    std::cerr << "error: --cluster is required\n" << kUsage;
    return 1;
  }
  auto cluster_proto = ReadCluster(args->Get("cluster"));
  if (!cluster_proto.ok()) return Fail(cluster_proto.status());
  std::vector<std::string> devices;
  if (args->Has("devices")) {
    devices = absl::StrSplit(args->Get("devices"), ',', absl::SkipEmpty());
    // An empty list ('--devices "$DEVICES"' with nothing in it) planned
    // on every device of the cluster.
    if (devices.empty()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--devices names no device, got '", args->Get("devices"),
                       "' (without --devices the plan takes every device of the cluster)")));
    }
  }
  const std::string precision_name = args->Get("precision", "fp32");
  if (precision_name != "fp32" && precision_name != "bf16") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--precision must be fp32 or bf16, got '", precision_name, "'")));
  }
  const bool bf16 = precision_name == "bf16";
  auto cluster = cost::ClusterModel::FromProto(*cluster_proto, devices,
                                               bf16 ? hap::v1::BFLOAT16 : hap::v1::FLOAT32);
  if (!cluster.ok()) return Fail(cluster.status());

  // Zoo defaults that depend on the cluster: batch 32 and 2 experts per device.
  Args model_args = *args;
  std::vector<std::string> extra = argv;
  std::string model = args->Get("model", "gpt");
  if (!args->Has("graph")) {
    // Given as a flag or as --set k=v (a default beside --set was the
    // parameter given twice).
    const auto given = [&](const std::string& k) {
      return args->Has(k) || absl::c_any_of(args->GetAll("set"), [&](const std::string& kv) {
               return absl::StartsWith(kv, k + "=");
             });
    };
    if (!given("batch")) {
      extra.push_back(absl::StrCat("--batch=", 32 * cluster->size()));
    }
    if ((model == "moe" || model == "switch") && !given("experts")) {
      extra.push_back(absl::StrCat("--experts=", 2 * cluster->size()));
    }
    auto a = Args::Parse(extra, value_flags,
                         {"help", "no-sfb", "no-zero", "no-grouped",
                          "zero-heuristic", "ignore-memory"});
    if (!a.ok()) return Fail(a.status());
    model_args = *a;
  }
  auto g = LoadModel(model_args);
  if (!g.ok()) return Fail(g.status());

  synth::PlanOptions po;
  auto b = synth::ParseBaseline(args->Get("baseline", "hap"));
  if (!b.ok()) return Fail(b.status());
  po.baseline = *b;
  if (args->Has("ratios")) {
    if (po.baseline == synth::Baseline::kNone) {
      return Fail(absl::InvalidArgumentError(
          "--ratios needs --baseline (the synthesized plan chooses its own ratios)"));
    }
    for (absl::string_view part : absl::StrSplit(args->Get("ratios"), ',')) {
      double x;
      if (!absl::SimpleAtod(part, &x)) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat("--ratios must be numbers separated by commas, got '", part, "'")));
      }
      po.baseline_ratios.push_back(x);
    }
  }
  po.allow_sfb = !args->Bool("no-sfb");
  po.allow_zero = !args->Bool("no-zero");
  po.allow_grouped = !args->Bool("no-grouped");
  po.zero_heuristic = args->Bool("zero-heuristic");
  po.ignore_memory = args->Bool("ignore-memory");
  const std::string overlap = args->Get("overlap", "off");
  if (overlap != "on" && overlap != "off") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--overlap must be on or off, got '", overlap, "'")));
  }
  po.overlap_communication = overlap == "on";
  const std::string gradient_precision = args->Get("gradient-precision", "fp32");
  if (gradient_precision != "fp32" && gradient_precision != "bf16") {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--gradient-precision must be fp32 or bf16, got '", gradient_precision, "'")));
  }
  po.bf16_gradients = gradient_precision == "bf16";
  // The plan file's optimizer flags, checked with or without --save-plan:
  // they were read only to save it, so 'hapctl plan --lr -1' planned and
  // exited 0.
  auto saved_options =
      SavedPlanOptions(*args, bf16 ? hap::v1::PRECISION_BF16 : hap::v1::PRECISION_FP32);
  if (!saved_options.ok()) return Fail(saved_options.status());
  // Priced as the planner service prices it (and as the executors run it):
  // SGD with a momentum keeps a momentum buffer.
  const hap::v1::OptimizerConfig& opt = saved_options->optimizer();
  po.optimizer = opt.kind() == hap::v1::OptimizerConfig::ADAM ? synth::OptimizerKind::kAdam
                 : opt.momentum() > 0                         ? synth::OptimizerKind::kSgdMomentum
                                                              : synth::OptimizerKind::kSgd;
  auto ms = args->Integer("max-states", po.max_states, 1, std::numeric_limits<int64_t>::max());
  auto mx = args->Number("max-seconds", po.max_seconds);
  if (!ms.ok()) return Fail(ms.status());
  if (!mx.ok()) return Fail(mx.status());
  if (*mx <= 0) return Fail(absl::InvalidArgumentError("--max-seconds must be positive"));
  po.max_states = *ms;
  po.max_seconds = *mx;
  auto pp = ParsePipeline(*args);
  if (!pp.ok()) return Fail(pp.status());
  if (pp->mode != pipeline::Mode::kOff && po.baseline != synth::Baseline::kNone) {
    return Fail(absl::InvalidArgumentError(
        "--baseline plans one SPMD program; it cannot be combined with --pipeline"));
  }
  // Checked before planning: a bad -o wasted the search and wrote
  // --save-plan before it was refused.
  const std::string fmt = args->Get("o", args->Get("output", "table"));
  if (fmt != "json" && fmt != "table") {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("-o must be table or json, got '", fmt, "'")));
  }
  absl::StatusOr<synth::PlanResult> r;
  if (pp->mode == pipeline::Mode::kOff) {
    r = synth::PlanModel(*g, *cluster, po);
  } else {
    pp->stage_options = po;
    auto pr = pipeline::PlanPipeline(*g, *cluster, *pp);
    if (!pr.ok()) return Fail(pr.status());
    if (pr->pipelined()) {
      if (args->Has("save-plan")) {
        auto st = SavePipelinePlan(*args, *g, *cluster_proto, *cluster, *pr, *saved_options);
        if (!st.ok()) return Fail(st);
      }
      if (fmt == "json") {
        PrintPipelineJson(*pr, *cluster);
      } else {
        PrintPipelineTable(*pr, *cluster);
      }
      return 0;
    }
    r = std::move(pr->spmd);
    for (std::string& n : pr->notes) r->notes.push_back(std::move(n));
  }
  if (!r.ok()) return Fail(r.status());
  if (args->Has("save-plan")) {
    auto st = SavePlan(*args, *g, *cluster_proto, *cluster, *r, *saved_options);
    if (!st.ok()) return Fail(st);
  }
  if (fmt == "json") {
    PrintJson(*g, *cluster, *r, *b, precision_name);
  } else {
    PrintTable(*g, *cluster, *r, *b, precision_name);
  }
  return 0;
}

constexpr char kCalibrateUsage[] =
    R"(usage: hapctl calibrate --cluster FILE.json (--plan PLAN.pb --profile PREFIX)...
                        --out CALIBRATED.json [--op-scales per-device|per-kind]
                        [--fixed-time fit|none]

Calibrates the cost model from measured runs: each --plan was run with
`hap-launch --plan PLAN.pb --profile PREFIX` (or hap-executor --profile),
which wrote PREFIX.rankR.json for every rank R. Writes the cluster with,
per device, op_time_scale (measured / modelled seconds per op type),
optimizer_seconds_per_element and step_overhead_seconds, and for
communication a fit over the runs of measured = A x modelled transfers +
B x collective calls (link bandwidths divided by A, B the per-call
overhead); prints what was modelled and measured. Plan with it: hapctl plan
--cluster CALIBRATED.json.

With runs at different shares of a device (e.g. DP-even and DP-proportional),
each device's time per step is fitted as a x the scaled model + b: b (the
time it spends whatever its share) becomes its step_overhead_seconds and the
op scales are multiplied by a (--fixed-time none keeps the runtime alone).

--op-scales per-kind gives every device of a kind (CPU, GPU) the same
op_time_scale per op type, pooled over them, and leaves ranking the devices
to their measured FLOP/s: use it under CPU quotas, where a throttled rank's
kernel wall times depend on when it waited (default per-device).
)";

int RunCalibrate(const std::vector<std::string>& argv) {
  auto args = Args::Parse(argv, {"cluster", "plan", "profile", "out", "op-scales", "fixed-time"}, {"help"});
  if (!args.ok()) return Fail(args.status());
  if (args->Bool("help")) {
    std::cout << kCalibrateUsage;
    return 0;
  }
  if (!args->positional().empty()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("hapctl calibrate: unexpected argument '", args->positional()[0], "'")));
  }
  std::vector<std::string> plans = args->GetAll("plan"), prefixes = args->GetAll("profile");
  if (!args->Has("cluster") || !args->Has("out") || plans.empty() ||
      plans.size() != prefixes.size()) {
    std::cerr << "error: --cluster, --out and one --profile per --plan are required\n"
              << kCalibrateUsage;
    return 1;
  }
  auto cluster = ReadCluster(args->Get("cluster"));
  if (!cluster.ok()) return Fail(cluster.status());
  std::vector<calibrate::ProfiledRun> runs;
  for (size_t k = 0; k < plans.size(); ++k) {
    calibrate::ProfiledRun run;
    run.source = absl::StrCat("--plan ", plans[k], " --profile ", prefixes[k]);
    auto bytes = ReadInputFile(plans[k], "plan ");
    if (!bytes.ok()) return Fail(bytes.status());
    if (!run.plan.ParseFromString(*bytes)) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("cannot read plan '", plans[k], "' (a hapctl plan --save-plan file)")));
    }
    for (int r = 0; r < run.plan.devices_size(); ++r) {
      std::string path = absl::StrCat(prefixes[k], ".rank", r, ".json");
      auto json = ReadInputFile(path, "profile ");
      if (!json.ok()) return Fail(json.status());
      auto profile = calibrate::ParseRankProfile(*json);
      if (!profile.ok()) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat(path, ": ", profile.status().message())));
      }
      run.ranks.push_back(*std::move(profile));
    }
    runs.push_back(std::move(run));
  }
  calibrate::CalibrateOptions co;
  const std::string op_scales = args->Has("op-scales") ? args->Get("op-scales") : "per-device";
  if (op_scales == "per-kind") {
    co.pool_op_scales_by_kind = true;
  } else if (op_scales != "per-device") {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--op-scales must be per-device or per-kind, got '", op_scales, "'")));
  }
  const std::string fixed = args->Has("fixed-time") ? args->Get("fixed-time") : "fit";
  if (fixed == "none") {
    co.fit_fixed_time = false;
  } else if (fixed != "fit") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--fixed-time must be fit or none, got '", fixed, "'")));
  }
  auto cal = calibrate::Calibrate(*cluster, runs, co);
  if (!cal.ok()) return Fail(cal.status());
  std::cout << absl::StrFormat("%-16s %-18s %14s %14s %8s\n", "DEVICE", "OP TYPE",
                               "MODELLED MS", "MEASURED MS", "SCALE");
  for (const auto& row : cal->rows) {
    std::cout << absl::StrFormat(
        "%-16s %-18s %14.3f %14.3f %8s\n", row.device, row.op_type, 1e3 * row.modelled_seconds,
        1e3 * row.measured_seconds,
        row.modelled_seconds > 0 && row.measured_seconds > 0
            ? absl::StrFormat("%.2f", row.measured_seconds / row.modelled_seconds)
            : "-");
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions jo;
  jo.add_whitespace = true;
  auto st = google::protobuf::util::MessageToJsonString(cal->cluster, &json, jo);
  if (!st.ok()) return Fail(absl::InternalError(std::string(st.message())));
  if (absl::Status w = WriteOutputFile(args->Get("out"), json, "--out file "); !w.ok()) {
    return Fail(w);
  }
  std::cout << absl::StrFormat(
      "communication: link transfer time x%.3f, collective overhead %.3f ms per call (%.0f "
      "calls per step over the runs; fitted %s)\n",
      cal->transfer_scale, 1e3 * cal->collective_overhead_seconds, cal->collective_calls,
      cal->communication_fit);
  for (const auto& f : cal->fixed_time) {
    std::cout << absl::StrFormat(
        "fixed time: %s %.3f ms per step whatever its share, op scales x%.3f (fitted over %d "
        "runs at different shares)\n",
        f.device, 1e3 * f.fixed_seconds, f.scale, f.runs);
  }
  if (cal->overlap_runs > 0) {
    std::cout << absl::StrFormat(
        "overlap: efficiency %.3f (the part of an overlapped collective that does not slow "
        "compute), fitted over %d run(s) of plans that assumed overlap\n",
        cal->overlap_efficiency, cal->overlap_runs);
  }
  if (cal->pipeline_runs > 0) {
    std::cout << absl::StrFormat(
        "pipeline transfers: %.3f ms of stall per transfer between stages (what the 1F1B "
        "schedule of the measured kernel times misses of the measured step), fitted over %d "
        "run(s) of pipeline plans\n",
        1e3 * cal->pipeline_transfer_overhead_seconds, cal->pipeline_runs);
  }
  std::cout << "wrote the calibrated cluster to " << args->Get("out") << "\n";
  return 0;
}

}  // namespace hap::tools
