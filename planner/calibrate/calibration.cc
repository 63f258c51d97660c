#include "planner/calibrate/calibration.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/json_struct.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/plan_file.h"
#include "planner/pipeline/layers.h"
#include "planner/pipeline/schedule.h"
#include "planner/service/core/profile_checks.h"
#include "planner/synth/rules.h"
#include "planner/synth/search.h"

namespace hap::calibrate {
namespace {

constexpr char kOptimizer[] = "(optimizer)";
constexpr char kRuntime[] = "(runtime)";
constexpr char kCommunication[] = "(communication)";

absl::StatusOr<double> Number(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  if (it == s.fields().end() || !it->second.has_number_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile has no number '", key, "'"));
  }
  const double v = it->second.number_value();
  if (!std::isfinite(v) || v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile's '", key, "' must be finite and >= 0, got ", v));
  }
  return v;
}

// The string `key` of `s`; "" when absent, InvalidArgument when it is no
// string (a number was read as "" and went unchecked).
absl::StatusOr<std::string> String(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  if (it == s.fields().end()) return std::string();
  if (!it->second.has_string_value()) {
    return absl::InvalidArgumentError(absl::StrCat("profile's '", key, "' must be a string"));
  }
  return it->second.string_value();
}

double FloatFlops(const v1::Device& d) {
  double flops = -1;
  for (const auto& f : d.flops()) {
    if (f.dtype() == v1::FLOAT32 || (flops < 0 && f.dtype() == v1::DTYPE_UNSPECIFIED)) {
      flops = f.flops();
    }
  }
  if (flops < 0 && d.flops_size() > 0) flops = d.flops(0).flops();
  return flops;
}

// How errors name run `k`: "run k", with its source when it has one
// (hapctl calibrate: its --plan and --profile).
std::string RunName(const std::vector<ProfiledRun>& runs, size_t k) {
  return runs[k].source.empty() ? absl::StrCat("run ", k)
                                : absl::StrCat("run ", k, " (", runs[k].source, ")");
}

// The longest per-step time a profile may say (11.6 days): past it a
// number is no measurement, and seconds around 1e20 made every plan of the
// calibrated cluster fail in the solver.
constexpr double kMaxProfileSeconds = 1e6;

// InvalidArgument naming the run (RunName), the rank and the number, unless every
// number of `r` is finite, >= 0 and at most kMaxProfileSeconds. The
// planner's profiles come from the executors' status reports, unparsed.
absl::Status CheckProfile(const std::string& run, const RankProfile& r) {
  auto check = [&](const std::string& what, double v) {
    if (std::isfinite(v) && v >= 0 && v <= kMaxProfileSeconds) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(run, ": rank ", r.rank, "'s ", what,
                                                   " must be finite, >= 0 and at most ",
                                                   kMaxProfileSeconds, " s per step, got ", v));
  };
  HAP_RETURN_IF_ERROR(check("step_seconds_median", r.step_seconds_median));
  HAP_RETURN_IF_ERROR(check("device_seconds", r.device_seconds));
  for (const auto& [type, secs] : r.op_seconds) {
    HAP_RETURN_IF_ERROR(check(absl::StrCat("op_seconds['", type, "']"), secs));
  }
  return absl::OkStatus();
}

// InvalidArgument naming the run (RunName) and the field unless every number of its
// plan's prediction the fits read (and its pipeline stages' times) is
// finite and >= 0: one infinite transfer time made the communication fit's
// sums NaN, and a NaN transfer scale divided every link's bandwidth.
absl::Status CheckPrediction(const std::string& run, const v1::Plan& plan) {
  auto check = [&](const std::string& what, double v) {
    if (std::isfinite(v) && v >= 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(run, ": its plan's ", what, " must be finite and >= 0, got ", v));
  };
  const v1::PlanPrediction& p = plan.prediction();
  HAP_RETURN_IF_ERROR(check("prediction.compute_seconds", p.compute_seconds()));
  HAP_RETURN_IF_ERROR(check("prediction.communication_seconds", p.communication_seconds()));
  HAP_RETURN_IF_ERROR(
      check("prediction.communication_busy_seconds", p.communication_busy_seconds()));
  for (int i = 0; i < plan.pipeline().stages_size(); ++i) {
    const v1::PipelineStage& st = plan.pipeline().stages(i);
    const std::string of = absl::StrCat("pipeline stage ", i, "'s ");
    for (const auto& [what, v] :
         {std::pair<const char*, double>{"forward_seconds", st.forward_seconds()},
          {"backward_seconds", st.backward_seconds()},
          {"send_seconds", st.send_seconds()},
          {"gradient_receive_seconds", st.gradient_receive_seconds()},
          {"sync_seconds", st.sync_seconds()}}) {
      HAP_RETURN_IF_ERROR(check(absl::StrCat(of, what), v));
    }
  }
  return absl::OkStatus();
}

// One run on one device: op type -> seconds per step.
struct RunTimes {
  std::map<std::string, double> modelled, measured;
};

// Per device: op type -> seconds, summed over runs.
struct Sums {
  std::map<std::string, double> modelled, measured;
  double stored_elements = 0;  // parameter elements updated per step
  double overhead = 0;         // summed over runs
  int runs = 0;
  std::vector<RunTimes> per_run;
};

// measured ~ alpha * scaled modelled + beta over one device's runs (least
// squares, alpha > 0, beta >= 0); nullopt when the runs do not spread the
// modelled time by 10% or the fit gives no positive alpha.
std::optional<std::pair<double, double>> FitFixedTime(const std::vector<double>& x,
                                                      const std::vector<double>& y) {
  if (x.size() < 2) return std::nullopt;
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  if (!(*lo > 0) || *hi < 1.1 * *lo) return std::nullopt;
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mx += x[i] / n;
    my += y[i] / n;
  }
  double sxy = 0, sxx = 0, xy = 0, xx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    xy += x[i] * y[i];
    xx += x[i] * x[i];
  }
  double alpha = sxy / sxx, beta = my - alpha * mx;
  if (beta < 0) {
    beta = 0;
    alpha = xy / xx;
  }
  if (!(alpha > 0) || !std::isfinite(alpha) || !std::isfinite(beta)) return std::nullopt;
  return std::make_pair(alpha, beta);
}

// The share of the work rank `rank` of `plan` really ran: the plan's ratio
// is rounded to whole units (sequences of the batch) when it is lowered, so
// a ratio of 0.717 over 16 sequences runs 12 of them, 0.75. Taken from the
// rank's buffers sharded along one dimension (local / global length,
// weighted by their global elements); the plan's ratio where none is.
double ExecutedShare(const v1::Plan& plan, int rank, double ratio) {
  if (rank >= plan.rank_programs_size()) return ratio;
  double weight = 0, sum = 0;
  for (const v1::Buffer& b : plan.rank_programs(rank).buffers()) {
    if (b.role() != v1::Buffer::ACTIVATION && b.role() != v1::Buffer::INPUT &&
        b.role() != v1::Buffer::GRADIENT) {
      continue;
    }
    if (b.shape_size() != b.global_shape_size()) continue;
    int split = -1;
    double global = 1;
    for (int d = 0; d < b.shape_size(); ++d) {
      global *= static_cast<double>(b.global_shape(d));
      if (b.shape(d) == b.global_shape(d)) continue;
      split = split == -1 ? d : -2;
    }
    if (split < 0 || b.global_shape(split) <= 0) continue;
    weight += global;
    sum += global * static_cast<double>(b.shape(split)) / static_cast<double>(b.global_shape(split));
  }
  return weight > 0 ? sum / weight : ratio;
}

// What rank `rank` of `plan` runs: the plan's program on its share of the
// batch, or (a pipeline plan) its stage's program on its share of every
// microbatch, `times` microbatches per step.
struct RankWork {
  const v1::SynthesizedProgram* program = nullptr;
  int group_size = 0;
  double ratio = 0;
  double times = 1;
};
absl::StatusOr<RankWork> WorkOf(const v1::Plan& plan, int rank) {
  RankWork w;
  if (!lower::IsPipelinePlan(plan)) {
    w.program = &plan.program();
    w.group_size = plan.devices_size();
    w.ratio = plan.ratios_size() > 0 && rank < plan.ratios(0).ratios_size()
                  ? plan.ratios(0).ratios(rank)
                  : 1.0 / plan.devices_size();
    return w;
  }
  const std::string& id = plan.devices(rank);
  for (const v1::PipelineStage& s : plan.pipeline().stages()) {
    for (int i = 0; i < s.devices_size(); ++i) {
      if (s.devices(i) != id) continue;
      w.program = &s.program();
      w.group_size = s.devices_size();
      w.ratio = i < s.ratios_size() ? s.ratios(i) : 1.0 / s.devices_size();
      w.times = std::max(1, plan.pipeline().microbatches());
      return w;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the pipeline plan's device '", id, "' is in none of its stages"));
}

// What the uncalibrated model gives rank `rank` of `plan` per op type, and
// the parameter elements it stores. `g` is the plan's graph, or for a
// pipeline plan the graph at its microbatch size.
absl::Status Model(const v1::Plan& plan, const graph::Graph& g, int rank, const v1::Device& dev,
                   Sums* sums) {
  const double flops = FloatFlops(dev);
  if (!(std::isfinite(flops) && flops > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device '", dev.id(), "' has no valid float32 FLOP/s to calibrate against"));
  }
  // A NaN or negative one made every op's modelled time NaN or wrong: no
  // op got a scale and all the time went to the step overhead.
  if (!(std::isfinite(dev.launch_overhead_seconds()) && dev.launch_overhead_seconds() >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device '", dev.id(), "' has launch_overhead_seconds ",
                     dev.launch_overhead_seconds(), "; it must be a finite number >= 0"));
  }
  HAP_ASSIGN_OR_RETURN(const RankWork w, WorkOf(plan, rank));
  const double share = ExecutedShare(plan, rank, w.ratio);
  // Outside [0, 1] (a shard longer than its tensor, a ratio that is no
  // ratio) the op scales were fitted against that much work.
  if (!(std::isfinite(share) && share >= 0 && share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " runs a share ", share,
                                                   " of the batch (its ratio ", w.ratio,
                                                   "); it must be a finite number in [0, 1]"));
  }
  std::map<std::string, graph::OpId> ops;
  for (graph::OpId i = 0; i < static_cast<graph::OpId>(g.ops().size()); ++i) {
    ops[g.op(i).name] = i;
  }
  const std::vector<synth::OpWork> work = synth::TrainingWork(g);
  synth::RuleContext ctx;
  ctx.num_devices = w.group_size;
  struct Computed {
    std::string type;
    double kernel, launches;
  };
  std::vector<Computed> computed;
  double kernels = 0, all_launches = 0;
  for (const v1::Instruction& ins : w.program->instructions()) {
    if (ins.kind() == v1::Instruction::COMPUTE) {
      auto it = ops.find(ins.op());
      if (it == ops.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("the plan computes op '", ins.op(), "' its graph lacks"));
      }
      const graph::OpId op = it->second;
      const std::vector<synth::ShardRule> rules = synth::RulesFor(g, op, ctx);
      auto rule = std::find_if(rules.begin(), rules.end(),
                               [&](const synth::ShardRule& r) { return r.name == ins.rule(); });
      if (rule == rules.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "op '", ins.op(), "' has no sharding rule '", ins.rule(), "'"));
      }
      const double kernel = work[op].flops / flops * (rule->split ? share : 1.0);
      const double launches = work[op].launches();
      computed.push_back({g.op(op).type, kernel, launches});
      kernels += kernel;
      all_launches += launches;
    } else if (ins.kind() == v1::Instruction::SOURCE &&
               ins.storage() != v1::Instruction::STORAGE_UNSPECIFIED) {
      std::optional<graph::TensorId> t = g.FindTensor(ins.op());
      if (!t) {
        return absl::InvalidArgumentError(
            absl::StrCat("the plan loads parameter '", ins.op(), "' its graph lacks"));
      }
      const graph::Tensor& p = g.tensor(*t);
      if (p.frozen) continue;
      const double elements = static_cast<double>(p.type.num_elements());
      sums->stored_elements +=
          ins.storage() == v1::Instruction::STORAGE_REPLICATED ? elements : elements * share;
    }
  }
  // The launches the search prices: those a GPU's queue does not hide.
  cost::DeviceModel model;
  model.launch_overhead_seconds = dev.launch_overhead_seconds();
  model.queued_launches = cost::QueuesLaunches(dev);
  const double exposed = cost::ExposedLaunchFraction(model, all_launches, kernels);
  for (const Computed& c : computed) {
    sums->modelled[c.type] +=
        w.times * (c.kernel + c.launches * dev.launch_overhead_seconds() * exposed);
  }
  return absl::OkStatus();
}

// Collective calls one step of `plan` makes (rank 0's program; every rank
// makes the same): a grouped uneven gather or scatter is one call per rank.
double CollectiveCallsPerStep(const v1::Plan& plan) {
  if (plan.rank_programs_size() == 0) return 0;
  const v1::RankProgram& p = plan.rank_programs(0);
  double calls = 0;
  for (const v1::Step& s : p.steps()) {
    if (!s.has_collective()) continue;
    const v1::CollectiveCall& c = s.collective();
    const bool grouped = c.method() == v1::GROUPED && (c.collective() == v1::ALL_GATHER ||
                                                       c.collective() == v1::REDUCE_SCATTER);
    calls += grouped ? p.world_size() : 1;
  }
  return calls;
}

// The per-transfer stall between pipeline stages that explains a pipeline
// run's measured step: each stage's per-microbatch work is its busiest
// rank's kernel time (the optimizer aside) over M, split into forward and
// backward as the plan predicted; its sync is the plan's or the optimizer
// measured, whichever is longer; transfers are the plan's, less the stall
// its cluster already priced into them. The overhead added to every
// transfer for the 1F1B schedule to take the measured step (bisection; 0
// when the schedule already takes as long). nullopt when the profiles do
// not give the stages' work.
std::optional<double> PipelineTransferOverhead(const v1::Plan& plan,
                                               const std::vector<RankProfile>& ranks) {
  const v1::PipelinePlan& pp = plan.pipeline();
  const int M = std::max(1, pp.microbatches());
  // A plan made from a calibrated cluster has its transfers priced with
  // that cluster's stall already.
  const double priced = plan.cluster().defaults().pipeline_transfer_overhead_seconds();
  std::map<std::string, const RankProfile*> by_device;
  double measured = 0;
  for (const RankProfile& r : ranks) {
    by_device[plan.devices(r.rank)] = &r;
    measured = std::max(measured, r.step_seconds_median);
  }
  std::vector<pipeline::StageTimes> times;
  for (const v1::PipelineStage& st : pp.stages()) {
    double work = 0, optimizer = 0;
    for (const std::string& d : st.devices()) {
      auto it = by_device.find(d);
      if (it == by_device.end()) return std::nullopt;
      auto opt = it->second->op_seconds.find(kOptimizer);
      const double o = opt == it->second->op_seconds.end() ? 0 : opt->second;
      work = std::max(work, it->second->device_seconds - o);
      optimizer = std::max(optimizer, o);
    }
    const double predicted = st.forward_seconds() + st.backward_seconds();
    if (!(work > 0) || !(predicted > 0)) return std::nullopt;
    pipeline::StageTimes t;
    t.forward = work / M * st.forward_seconds() / predicted;
    t.backward = work / M - t.forward;
    t.send = std::max(0.0, st.send_seconds() - priced);
    t.gradient = std::max(0.0, st.gradient_receive_seconds() - priced);
    t.sync = std::max(st.sync_seconds(), optimizer);
    times.push_back(t);
  }
  auto step = [&](double overhead) {
    std::vector<pipeline::StageTimes> with = times;
    for (size_t s = 0; s + 1 < with.size(); ++s) {
      with[s].send += overhead;
      with[s].gradient += overhead;
    }
    absl::StatusOr<pipeline::ScheduleResult> r = pipeline::Simulate1F1B(with, M);
    return r.ok() ? r->step : INFINITY;
  };
  if (!(measured > 0) || times.size() < 2 || step(0) >= measured) return 0.0;
  double lo = 0, hi = measured;
  for (int i = 0; i < 60; ++i) {
    const double mid = 0.5 * (lo + hi);
    (step(mid) < measured ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// One run's communication per step: measured (median step less the busiest
// rank's kernel time), the model's transfer seconds and collective calls.
struct CommSample {
  double measured = 0, transfer = 0, calls = 0;
};

struct CommFit {
  double transfer_scale = 1;
  double per_call_seconds = 0;
  std::string how;
};

// measured ~ A * transfer + B * calls with A, B >= 0 by least squares. When
// the runs cannot tell the two apart (every run has about the same transfer
// per call) or the fit leaves A at 0, the links stay as probed (A = 1) and
// the rest goes to the calls (B >= 0); when B would be negative, A alone.
CommFit FitCommunication(const std::vector<CommSample>& runs, double prior_per_call) {
  CommFit f;
  f.per_call_seconds = prior_per_call;
  double tt = 0, tc = 0, cc = 0, tm = 0, cm = 0, sum_m = 0, sum_t = 0, sum_c = 0;
  for (const CommSample& r : runs) {
    tt += r.transfer * r.transfer;
    tc += r.transfer * r.calls;
    cc += r.calls * r.calls;
    tm += r.transfer * r.measured;
    cm += r.calls * r.measured;
    sum_m += r.measured;
    sum_t += r.transfer;
    sum_c += r.calls;
  }
  auto calls_only = [&](const char* why) {
    f.transfer_scale = 1;
    if (sum_c > 0) f.per_call_seconds = std::max(0.0, (sum_m - sum_t) / sum_c);
    f.how = why;
  };
  const double det = tt * cc - tc * tc;
  // |cos| of the angle between the transfer and call columns above 0.995:
  // collinear for our purposes.
  if (tt <= 0 || cc <= 0 || det <= 0.01 * tt * cc) {
    calls_only("per call (the runs do not separate transfers from calls)");
    return f;
  }
  double a = (tm * cc - cm * tc) / det;
  double b = (cm * tt - tm * tc) / det;
  if (a <= 0) {
    calls_only("per call (the fit gave transfers no time)");
    return f;
  }
  if (b < 0) {
    b = 0;
    a = tm / tt;
  }
  f.transfer_scale = a;
  f.per_call_seconds = b;
  f.how = "transfers and calls (least squares over the runs)";
  return f;
}

// How the links `plan` was priced with differ from `cluster`'s (defaults,
// and the links both list), for an error; empty when they do not. The
// transfer scale is fitted against the plans' predictions, so it holds for
// those links only.
std::string OtherLinks(const v1::Cluster& cluster, const v1::Plan& plan) {
  const v1::LinkDefaults &was = plan.cluster().defaults(), &is = cluster.defaults();
  const std::pair<const char*, std::pair<double, double>> defaults[] = {
      {"intra_node_bandwidth",
       {was.intra_node_bandwidth_bytes_per_second(), is.intra_node_bandwidth_bytes_per_second()}},
      {"inter_node_bandwidth",
       {was.inter_node_bandwidth_bytes_per_second(), is.inter_node_bandwidth_bytes_per_second()}},
  };
  for (const auto& [what, bw] : defaults) {
    if (bw.first != bw.second) {
      return absl::StrCat(what, " ", bw.first, " B/s where the cluster has ", bw.second);
    }
  }
  std::map<std::pair<std::string, std::string>, double> links;
  for (const v1::Link& l : plan.cluster().links()) {
    links[{l.src(), l.dst()}] = l.bandwidth_bytes_per_second();
  }
  for (const v1::Link& l : cluster.links()) {
    auto it = links.find({l.src(), l.dst()});
    if (it != links.end() && it->second != l.bandwidth_bytes_per_second()) {
      return absl::StrCat("the link ", l.src(), " -> ", l.dst(), " at ", it->second,
                          " B/s where the cluster has ", l.bandwidth_bytes_per_second());
    }
  }
  return "";
}

// InvalidArgument naming the device (or link), the field and the value
// unless what `out` fitted for each calibrated device in `fitted` is what
// the planner takes (service::CheckCalibration and the link bandwidth
// bound): profile numbers each within kMaxProfileSeconds can still fit an
// op scale of 1e9 or a step overhead of days, which hapctl wrote and the
// planner then refused at registration.
absl::Status CheckFit(const Calibration& out, const std::set<std::string>& fitted) {
  const v1::LinkDefaults& def = out.cluster.defaults();
  for (const auto& n : out.cluster.nodes()) {
    for (const auto& d : n.devices()) {
      if (!fitted.count(d.id())) continue;
      for (const auto& [type, scale] : d.op_time_scale()) {
        if (std::isfinite(scale) && scale > 0 && scale < service::kMaxOpTimeScale) continue;
        double modelled = 0, measured = 0;
        for (const Row& r : out.rows) {
          if (r.device == d.id() && r.op_type == type) {
            modelled = r.modelled_seconds;
            measured = r.measured_seconds;
          }
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "the calibration fitted for device '", d.id(),
            "' is out of range (not applied): ", "op_time_scale[\"", type,
            "\"] must be a finite number > 0 and below ", service::kMaxOpTimeScale, ", got ", scale,
            " (measured ", measured, " s where the model gives ", modelled,
            " s, over its runs: a profile's time no kernel of the op takes)"));
      }
      v1::DeviceCalibration c;
      c.set_optimizer_seconds_per_element(d.optimizer_seconds_per_element());
      c.set_step_overhead_seconds(d.step_overhead_seconds());
      c.set_collective_overhead_seconds(def.collective_overhead_seconds());
      c.set_pipeline_transfer_overhead_seconds(def.pipeline_transfer_overhead_seconds());
      c.set_transfer_scale(out.transfer_scale);
      HAP_RETURN_IF_ERROR(Annotate(service::CheckCalibration(c),
                                   absl::StrCat("the calibration fitted for device '", d.id(),
                                                "' is out of range (not applied)")));
    }
  }
  auto check_bandwidth = [](const std::string& what, double bw) {
    if (std::isfinite(bw) && bw <= service::kMaxLinkBandwidth) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("the fitted transfer scale makes ", what, " ",
                                                   bw, " B/s, more than the planner takes (",
                                                   service::kMaxLinkBandwidth, ")"));
  };
  if (out.transfer_scale == 1) return absl::OkStatus();  // the links as given
  HAP_RETURN_IF_ERROR(check_bandwidth("intra_node_bandwidth_bytes_per_second",
                                      def.intra_node_bandwidth_bytes_per_second()));
  HAP_RETURN_IF_ERROR(check_bandwidth("inter_node_bandwidth_bytes_per_second",
                                      def.inter_node_bandwidth_bytes_per_second()));
  for (const v1::Link& l : out.cluster.links()) {
    HAP_RETURN_IF_ERROR(check_bandwidth(absl::StrCat("the link ", l.src(), " -> ", l.dst()),
                                        l.bandwidth_bytes_per_second()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RankProfile> ParseRankProfile(const std::string& json) {
  google::protobuf::Struct s;
  if (absl::Status st = JsonToStruct(json, &s); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile is not valid JSON: ", std::string(st.message())));
  }
  RankProfile p;
  HAP_ASSIGN_OR_RETURN(double rank, Number(s, "rank"));
  if (rank != std::floor(rank) || rank > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile's 'rank' must be a whole number of an int's range, got ", rank));
  }
  p.rank = static_cast<int>(rank);
  HAP_ASSIGN_OR_RETURN(p.device, String(s, "device"));
  HAP_ASSIGN_OR_RETURN(p.plan_content_hash, String(s, "plan_content_hash"));
  HAP_ASSIGN_OR_RETURN(p.step_seconds_median, Number(s, "step_seconds_median"));
  HAP_ASSIGN_OR_RETURN(p.device_seconds, Number(s, "device_seconds"));
  auto ops = s.fields().find("op_seconds");
  if (ops == s.fields().end() || !ops->second.has_struct_value()) {
    return absl::InvalidArgumentError("profile has no object 'op_seconds'");
  }
  for (const auto& [type, v] : ops->second.struct_value().fields()) {
    if (!v.has_number_value() || !std::isfinite(v.number_value()) || v.number_value() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("profile's op_seconds['", type, "'] must be a number >= 0"));
    }
    p.op_seconds[type] = v.number_value();
  }
  return p;
}

std::optional<double> FitOverlapEfficiency(const std::vector<OverlapSample>& samples) {
  double hh = 0, hy = 0;
  for (const OverlapSample& x : samples) {
    // A sample with a number that is no number tells nothing (and made
    // the fit NaN).
    if (!std::isfinite(x.measured) || !std::isfinite(x.compute) || !std::isfinite(x.exposed) ||
        !std::isfinite(x.busy)) {
      continue;
    }
    const double hidden = x.busy - x.exposed;
    if (!(hidden > 0)) continue;
    hh += hidden * hidden;
    hy += hidden * (x.measured - x.compute - x.exposed);
  }
  if (!(hh > 0)) return std::nullopt;
  return 1.0 - std::clamp(hy / hh, 0.0, 1.0);
}

absl::StatusOr<Calibration> Calibrate(const v1::Cluster& cluster, const std::vector<ProfiledRun>& runs,
                                      const CalibrateOptions& options) {
  if (runs.empty()) return absl::InvalidArgumentError("no runs to calibrate from");
  std::map<std::string, const v1::Device*> devices;
  for (const auto& n : cluster.nodes()) {
    for (const auto& d : n.devices()) devices[d.id()] = &d;
  }
  std::map<std::string, Sums> sums;
  double comm_measured = 0, comm_modelled = 0, calls = 0;
  std::vector<CommSample> comm;  // per run
  std::vector<size_t> comm_runs;       // their indices in `runs`
  std::vector<OverlapSample> overlap;  // runs of plans that assumed overlap
  std::vector<double> pipeline_overheads;  // per pipeline run
  std::set<std::string> overlap_devices;
  for (size_t k = 0; k < runs.size(); ++k) {
    const ProfiledRun& run = runs[k];
    const std::string name = RunName(runs, k);
    const v1::Plan& plan = run.plan;
    if (plan.devices_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": its plan has no devices"));
    }
    // Its collective calls and the ranks' shares are read from the rank
    // programs: one missing, or a world size not the plan's, counted no
    // calls (or negative ones) and the communication went unfitted unsaid.
    if (plan.rank_programs_size() != plan.devices_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": its plan has ", plan.rank_programs_size(), " rank programs for ",
          plan.devices_size(),
          " devices (the whole plan, as hapctl plan --save-plan writes it, is needed)"));
    }
    if (!lower::IsPipelinePlan(plan)) {  // a pipeline stage's world is its group
      for (int i = 0; i < plan.rank_programs_size(); ++i) {
        if (plan.rank_programs(i).world_size() != plan.devices_size()) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, ": its plan's rank program ", i, " has world_size ",
                           plan.rank_programs(i).world_size(), ", not ", plan.devices_size()));
        }
      }
    }
    HAP_RETURN_IF_ERROR(CheckPrediction(name, plan));
    HAP_ASSIGN_OR_RETURN(graph::Graph g, graph::FromProto(plan.graph()));
    // A pipeline run tells each device's kernel times at the microbatch
    // size; its step also holds the bubble and the transfers between stages,
    // which the collective fit below does not model, and M microbatches'
    // fixed costs, so it adds to the op-type sums and the optimizer only.
    const bool piped = lower::IsPipelinePlan(plan);
    if (piped) {
      HAP_ASSIGN_OR_RETURN(g, pipeline::Rebatch(g, plan.pipeline().microbatch_size()));
    }
    std::set<int> seen;
    double busiest = 0, step = 0;
    for (const RankProfile& r : run.ranks) {
      if (r.rank < 0 || r.rank >= plan.devices_size() || !seen.insert(r.rank).second) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": rank ", r.rank,
                                                       " is out of range or given twice (plan has ",
                                                       plan.devices_size(), " ranks)"));
      }
      HAP_RETURN_IF_ERROR(CheckProfile(name, r));
      // Every rank runs kernels: a profile timing none is no measurement
      // (its kernel timing was off), and taken as one it cleared the
      // device's op scales and zeroed its optimizer and step overhead.
      if (std::none_of(r.op_seconds.begin(), r.op_seconds.end(),
                       [](const auto& t) { return t.second > 0; })) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": rank ", r.rank, "'s profile times no op (op_seconds is empty or all 0)"));
      }
      if (r.plan_content_hash.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": rank ", r.rank,
            "'s profile does not name its plan (no plan_content_hash; executors write it)"));
      }
      if (r.plan_content_hash != plan.content_hash()) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": rank ", r.rank, "'s profile is of plan ", r.plan_content_hash.substr(0, 12),
            ", not ", plan.content_hash().substr(0, 12)));
      }
      const std::string& id = plan.devices(r.rank);
      if (!r.device.empty() && r.device != id) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": rank ", r.rank, "'s profile was measured on '", r.device,
                         "', the plan puts rank ", r.rank, " on '", id, "'"));
      }
      auto dev = devices.find(id);
      if (dev == devices.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": the plan's device '", id, "' is not in the cluster"));
      }
      Sums& s = sums[id];
      Sums one;
      HAP_RETURN_IF_ERROR(Annotate(Model(plan, g, r.rank, *dev->second, &one), name));
      for (const auto& [type, secs] : one.modelled) s.modelled[type] += secs;
      s.stored_elements += one.stored_elements;
      if (piped) {
        for (const auto& [type, secs] : r.op_seconds) {
          if (type == kOptimizer || one.modelled.count(type)) s.measured[type] += secs;
        }
        continue;
      }
      double overhead = 0;
      for (const auto& [type, secs] : r.op_seconds) {
        if (type == kRuntime) {
          overhead += secs;
        } else {
          s.measured[type] += secs;
        }
      }
      s.overhead += overhead;
      s.runs += 1;
      s.per_run.push_back({std::move(one.modelled), r.op_seconds});
      busiest = std::max(busiest, r.device_seconds);
      step = std::max(step, r.step_seconds_median);
    }
    if (static_cast<int>(seen.size()) != plan.devices_size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": profiles of ", seen.size(),
                                                     " of the plan's ", plan.devices_size(),
                                                     " ranks; every rank's profile is needed"));
    }
    if (piped) {
      if (std::optional<double> o = PipelineTransferOverhead(plan, run.ranks)) {
        pipeline_overheads.push_back(*o);
      }
      continue;
    }
    if (plan.prediction().overlap_assumed()) {
      // Its communication is mostly hidden: it tells the overlap, not the
      // links.
      for (const auto& n : plan.cluster().nodes()) {
        for (const auto& d : n.devices()) {
          const double e = d.overlap_efficiency() > 0 ? d.overlap_efficiency()
                           : d.kind() == v1::CPU   ? cost::kCpuOverlapEfficiency
                                                   : cost::kGpuOverlapEfficiency;
          if (e != 1 && std::count(plan.devices().begin(), plan.devices().end(), d.id())) {
            return absl::InvalidArgumentError(absl::StrCat(
                name, ": its plan assumed overlap at overlap_efficiency ", e, " for device '",
                d.id(),
                "'; fit the overlap from plans made with overlap_efficiency 1 on every device"));
          }
        }
      }
      const auto& pr = plan.prediction();
      overlap.push_back({step, pr.compute_seconds(), pr.communication_seconds(),
                         pr.communication_busy_seconds()});
      overlap_devices.insert(plan.devices().begin(), plan.devices().end());
      continue;
    }
    CommSample c;
    c.measured = std::max(0.0, step - busiest);
    c.calls = CollectiveCallsPerStep(plan);
    // The prediction's transfers: its communication less the per-call
    // overhead of the cluster the plan was made for.
    c.transfer = std::max(0.0, plan.prediction().communication_seconds() -
                                   c.calls * plan.cluster().defaults().collective_overhead_seconds());
    comm.push_back(c);
    comm_runs.push_back(k);
    comm_measured += c.measured;
    comm_modelled += plan.prediction().communication_seconds();
    calls += c.calls;
  }

  // Pooled op-time scales: modelled and measured seconds per (device kind,
  // op type) over all devices of the kind.
  std::map<std::pair<int, std::string>, std::pair<double, double>> pooled;
  if (options.pool_op_scales_by_kind) {
    for (const auto& n : cluster.nodes()) {
      for (const auto& d : n.devices()) {
        auto it = sums.find(d.id());
        if (it == sums.end()) continue;
        for (const auto& [t, m] : it->second.modelled) pooled[{d.kind(), t}].first += m;
        for (const auto& [t, x] : it->second.measured) pooled[{d.kind(), t}].second += x;
      }
    }
  }
  Calibration out;
  out.cluster = cluster;
  for (auto& n : *out.cluster.mutable_nodes()) {
    for (auto& d : *n.mutable_devices()) {
      auto it = sums.find(d.id());
      if (it == sums.end()) continue;
      Sums& s = it->second;
      d.clear_op_time_scale();
      double overhead = s.overhead;
      std::set<std::string> types;
      for (const auto& [t, v] : s.modelled) types.insert(t);
      for (const auto& [t, v] : s.measured) types.insert(t);
      types.erase(kOptimizer);
      for (const std::string& t : types) {
        const double m = s.modelled[t], x = s.measured[t];
        out.rows.push_back({d.id(), t, m, x});
        if (m > 0 && x > 0) {
          double scale = x / m;
          if (options.pool_op_scales_by_kind) {
            const auto& [pm, px] = pooled[{d.kind(), t}];
            scale = px / pm;
          }
          (*d.mutable_op_time_scale())[t] = scale;
        } else if (x > 0) {
          overhead += x;  // time the model gives no FLOPs: per-step overhead
        }
      }
      const double opt = s.measured[kOptimizer];
      out.rows.push_back({d.id(), kOptimizer, 0, opt});
      d.set_optimizer_seconds_per_element(s.stored_elements > 0 ? opt / s.stored_elements : 0);
      if (s.runs > 0) {  // else pipeline runs only: the device's overhead stays
        out.rows.push_back({d.id(), kRuntime, 0, overhead / s.runs});
        d.set_step_overhead_seconds(overhead / s.runs);
      }
      if (options.fit_fixed_time) {
        // Per run: the model's time with these scales against everything
        // measured but the optimizer.
        std::vector<double> x, y;
        for (const RunTimes& run : s.per_run) {
          double scaled = 0, measured = 0;
          for (const auto& [t, m] : run.modelled) {
            auto it = d.op_time_scale().find(t);
            if (it != d.op_time_scale().end()) scaled += m * it->second;
          }
          for (const auto& [t, v] : run.measured) {
            if (t != kOptimizer) measured += v;
          }
          x.push_back(scaled);
          y.push_back(measured);
        }
        if (auto fit = FitFixedTime(x, y)) {
          for (auto& [t, scale] : *d.mutable_op_time_scale()) scale *= fit->first;
          d.set_step_overhead_seconds(fit->second);
          out.fixed_time.push_back({d.id(), static_cast<int>(x.size()), fit->first, fit->second});
        }
      }
    }
  }
  // What the model misses of communication: measured = A * transfers +
  // B * calls, fitted over the runs. A scales the links' transfer time (a
  // busy or throttled CPU moves and sums bytes slower than the probes saw),
  // B is the synchronisation cost of every collective call (a throttled or
  // busy peer reaches it late).
  auto* def = out.cluster.mutable_defaults();
  const CommFit fit = FitCommunication(comm, def->collective_overhead_seconds());
  if (calls > 0) def->set_collective_overhead_seconds(fit.per_call_seconds);
  if (fit.transfer_scale != 1) {
    for (size_t k : comm_runs) {
      const std::string other = OtherLinks(cluster, runs[k].plan);
      if (!other.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            RunName(runs, k), "'s plan was priced with ", other,
            ": the link transfer scale fitted against its prediction holds for the links it "
            "was priced with; calibrate the cluster the plans were made from (a calibrated "
            "cluster's links would be scaled again)"));
      }
    }
    auto slower = [&](double bw) { return bw / fit.transfer_scale; };
    def->set_intra_node_bandwidth_bytes_per_second(
        slower(def->intra_node_bandwidth_bytes_per_second()));
    def->set_inter_node_bandwidth_bytes_per_second(
        slower(def->inter_node_bandwidth_bytes_per_second()));
    for (auto& l : *out.cluster.mutable_links()) {
      l.set_bandwidth_bytes_per_second(slower(l.bandwidth_bytes_per_second()));
    }
  }
  out.transfer_scale = fit.transfer_scale;
  out.communication_fit = fit.how;
  out.collective_overhead_seconds = def->collective_overhead_seconds();
  out.collective_calls = calls;
  out.rows.push_back({"*", kCommunication, comm_modelled, comm_measured});
  if (!pipeline_overheads.empty()) {
    double sum = 0;
    for (double o : pipeline_overheads) sum += o;
    out.pipeline_transfer_overhead_seconds = sum / pipeline_overheads.size();
    out.pipeline_runs = static_cast<int>(pipeline_overheads.size());
    def->set_pipeline_transfer_overhead_seconds(out.pipeline_transfer_overhead_seconds);
  }
  if (std::optional<double> e = FitOverlapEfficiency(overlap)) {
    // 0 in the profile means "the default": keep a fitted 0 distinguishable.
    const double eff = std::max(*e, 1e-6);
    for (auto& n : *out.cluster.mutable_nodes()) {
      for (auto& d : *n.mutable_devices()) {
        if (overlap_devices.count(d.id())) d.set_overlap_efficiency(eff);
      }
    }
    out.overlap_efficiency = eff;
    out.overlap_runs = static_cast<int>(overlap.size());
  }
  std::set<std::string> fitted;
  for (const auto& [id, s] : sums) fitted.insert(id);
  HAP_RETURN_IF_ERROR(CheckFit(out, fitted));
  return out;
}

}  // namespace hap::calibrate
