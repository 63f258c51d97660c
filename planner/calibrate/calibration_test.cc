#include "planner/calibrate/calibration.h"

#include <cmath>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/cost/cluster_model.h"
#include "planner/graph/zoo.h"
#include "planner/lower/plan_builder.h"
#include "planner/pipeline/pipeline.h"
#include "planner/pipeline/pipeline_plan.h"
#include "planner/pipeline/schedule.h"
#include "planner/synth/planner.h"
#include "planner/synth/search.h"

namespace hap::calibrate {
namespace {

v1::Cluster TwoCpus() {
  v1::Cluster c;
  auto* node = c.add_nodes();
  node->set_name("local");
  const double flops[] = {80e9, 32e9};
  for (int i = 0; i < 2; ++i) {
    auto* d = node->add_devices();
    d->set_id(absl::StrCat("cpu", i));
    d->set_kind(v1::CPU);
    auto* f = d->add_flops();
    f->set_dtype(v1::FLOAT32);
    f->set_flops(flops[i]);
    d->set_memory_bytes(int64_t{8} << 30);
    d->set_launch_overhead_seconds(2e-6);
    d->set_node("local");
    d->set_local_index(i);
  }
  c.mutable_defaults()->set_intra_node_bandwidth_bytes_per_second(2e9);
  c.mutable_defaults()->set_intra_node_latency_seconds(2e-5);
  c.mutable_defaults()->set_inter_node_bandwidth_bytes_per_second(1e9);
  c.mutable_defaults()->set_inter_node_latency_seconds(5e-5);
  return c;
}

graph::Graph Gpt() {
  auto g = graph::BuildZooModel("gpt", {{"layers", 2}, {"hidden", 64}, {"heads", 4},
                                        {"ffn", 256}, {"seq", 32}, {"batch", 16},
                                        {"vocab", 2000}});
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

v1::Plan MakePlan(const graph::Graph& g, const v1::Cluster& c, synth::Baseline b,
                  bool overlap = false) {
  auto model = cost::ClusterModel::FromProto(c);
  EXPECT_TRUE(model.ok()) << model.status();
  synth::PlanOptions po;
  po.baseline = b;
  po.overlap_communication = overlap;
  po.optimizer = synth::OptimizerKind::kAdam;
  auto r = synth::PlanModel(g, *model, po);
  EXPECT_TRUE(r.ok()) << r.status();
  v1::PlanOptions options;
  options.mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
  options.mutable_optimizer()->set_learning_rate(1e-3);
  auto plan = lower::BuildPlan(g, c, *model, *r, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *std::move(plan);
}

// Profiles of every rank saying each op type took 1 ms: Calibrate's rows
// then tell what the model says per device and type.
ProfiledRun UnitRun(const v1::Plan& plan) {
  ProfiledRun run{plan, {}};
  for (int r = 0; r < plan.devices_size(); ++r) {
    RankProfile p;
    p.rank = r;
    p.device = plan.devices(r);
    p.plan_content_hash = plan.content_hash();
    p.step_seconds_median = 1;
    p.device_seconds = 0.5;
    for (const char* t : {"linear", "cross_entropy", "(optimizer)", "(runtime)"}) {
      p.op_seconds[t] = 1e-3;
    }
    run.ranks.push_back(p);
  }
  return run;
}

// One part of a run made wrong, and what the error says of it.
template <typename Part>
struct Mess {
  std::function<void(Part*)> mess;
  std::string says;
};

// Each mess, applied to the part `of` picks of the second of two unit runs
// of `plan`, makes Calibrate fail InvalidArgument saying `prefix` + says.
template <typename Part>
void ExpectEachMessRefused(const v1::Cluster& c, const v1::Plan& plan,
                           const std::function<Part*(ProfiledRun*)>& of,
                           const std::vector<Mess<Part>>& cases, const std::string& prefix) {
  for (const Mess<Part>& k : cases) {
    ProfiledRun run = UnitRun(plan);
    k.mess(of(&run));
    auto cal = Calibrate(c, {UnitRun(plan), run});
    EXPECT_EQ(cal.status().code(), absl::StatusCode::kInvalidArgument) << k.says;
    EXPECT_NE(cal.status().message().find(prefix + k.says), std::string::npos) << cal.status();
  }
}

// Rank `r`'s profile of `plan` saying each op type took the model's time
// (the rows of `unit`, a calibration against UnitRun(plan)) x scale[type]
// plus add[type]; device_seconds is their sum.
RankProfile Distorted(const v1::Plan& plan, const Calibration& unit, int r,
                      const std::map<std::string, double>& scale,
                      const std::map<std::string, double>& add = {}) {
  RankProfile p;
  p.rank = r;
  p.device = plan.devices(r);
  p.plan_content_hash = plan.content_hash();
  for (const Row& row : unit.rows) {
    if (row.device != p.device || row.modelled_seconds <= 0) continue;
    auto s = scale.find(row.op_type);
    auto a = add.find(row.op_type);
    const double t = row.modelled_seconds * (s == scale.end() ? 1.0 : s->second) +
                     (a == add.end() ? 0.0 : a->second);
    p.op_seconds[row.op_type] = t;
    p.device_seconds += t;
  }
  return p;
}

double Modelled(const Calibration& c, const std::string& device, const std::string& type) {
  for (const Row& r : c.rows) {
    if (r.device == device && r.op_type == type) return r.modelled_seconds;
  }
  return -1;
}

TEST(CalibrationTest, ModelledTimeIsFlopsOverRateAtTheRanksShare) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  v1::Plan dp = MakePlan(g, c, synth::Baseline::kDpEven);
  auto cal = Calibrate(c, {UnitRun(dp)});
  ASSERT_TRUE(cal.ok()) << cal.status();
  // Data parallel, even: every linear is split, each rank does half.
  const std::vector<synth::OpWork> work = synth::TrainingWork(g);
  double linear_flops = 0;
  for (graph::OpId i = 0; i < static_cast<graph::OpId>(g.ops().size()); ++i) {
    if (g.op(i).type == "linear") linear_flops += work[i].flops;
  }
  ASSERT_GT(linear_flops, 0);
  EXPECT_NEAR(Modelled(*cal, "cpu0", "linear"), 0.5 * linear_flops / 80e9,
              0.02 * 0.5 * linear_flops / 80e9);
  EXPECT_NEAR(Modelled(*cal, "cpu1", "linear"), 0.5 * linear_flops / 32e9,
              0.02 * 0.5 * linear_flops / 32e9);
  // Proportional: the ratios 80:32 (0.714) run as 11 and 5 of the 16
  // sequences; the planner says so (ratios snapped to whole sequences), and
  // a plan that still says 0.714 (made before snapping) is measured at the
  // share its rank programs ran.
  v1::Plan prop = MakePlan(g, c, synth::Baseline::kDpProportional);
  EXPECT_NEAR(prop.ratios(0).ratios(0), 11.0 / 16, 1e-12);
  prop.mutable_ratios(0)->set_ratios(0, 80.0 / 112);
  prop.mutable_ratios(0)->set_ratios(1, 32.0 / 112);
  auto cal_prop = Calibrate(c, {UnitRun(prop)});
  ASSERT_TRUE(cal_prop.ok()) << cal_prop.status();
  EXPECT_NEAR(Modelled(*cal_prop, "cpu0", "linear"), 11.0 / 16 * linear_flops / 80e9,
              0.02 * 11.0 / 16 * linear_flops / 80e9);
  EXPECT_NEAR(Modelled(*cal_prop, "cpu1", "linear"), 5.0 / 16 * linear_flops / 32e9,
              0.02 * 5.0 / 16 * linear_flops / 32e9);
}

// GPUs queue their kernel launches behind their kernels: the model a
// calibration fits against prices only what the launches take beyond the
// step's kernels (as the search does), where a CPU pays each launch.
TEST(CalibrationTest, AGpusLaunchesCostWhatTheyTakeBeyondItsKernels) {
  graph::Graph g = Gpt();
  std::set<std::string> types;
  double launches = 0;
  const std::vector<synth::OpWork> work = synth::TrainingWork(g);
  for (graph::OpId i = 0; i < static_cast<graph::OpId>(g.ops().size()); ++i) {
    types.insert(g.op(i).type);
    launches += work[i].backward ? 3 : 1;
  }
  // cpu0's modelled seconds summed over the op types (every type profiled).
  auto modelled = [&](v1::DeviceKind kind, double launch) {
    v1::Cluster c = TwoCpus();
    for (auto& d : *c.mutable_nodes(0)->mutable_devices()) {
      d.set_kind(kind);
      d.set_launch_overhead_seconds(launch);
    }
    v1::Plan dp = MakePlan(g, c, synth::Baseline::kDpEven);
    ProfiledRun run = UnitRun(dp);
    for (RankProfile& p : run.ranks) {
      for (const std::string& t : types) p.op_seconds[t] = 1e-3;
    }
    auto cal = Calibrate(c, {run});
    EXPECT_TRUE(cal.ok()) << cal.status();
    double sum = 0;
    for (const std::string& t : types) sum += cal.ok() ? Modelled(*cal, "cpu0", t) : NAN;
    return sum;
  };
  // Kernel-bound (2 us launches): the GPU's sum is the CPU's less every
  // launch of rank 0 (data parallelism: it runs every op).
  const double small = 2e-6;
  const double kernels = modelled(v1::GPU, small);
  ASSERT_GT(kernels, 10 * launches * small);
  EXPECT_NEAR(modelled(v1::CPU, small) - kernels, launches * small, 1e-9 * kernels);
  // Launch-bound (50 ms launches): the GPU pays its launches, the kernels
  // run behind them.
  const double big = 0.05;
  EXPECT_NEAR(modelled(v1::GPU, big), launches * big, 1e-9 * launches * big);
  EXPECT_NEAR(modelled(v1::CPU, big), launches * big + kernels, 1e-9 * launches * big);
}

// A pipeline plan (two stages of one CPU each, 4 microbatches): each
// device is modelled running its stage's ops on the microbatch 4 times per
// step, so the two stages' modelled linear time at their rates adds up to
// the whole model's; each stores its stage's parameters; the run's step
// takes no part in the communication fit, and no device's runtime is set
// from it.
// Two CPUs of 50 GFLOP/s (no launch overhead) and a 2-stage, 4-microbatch
// pipeline plan of `g` on them, one CPU per stage.
v1::Cluster EqualCpus() {
  v1::Cluster c = TwoCpus();
  for (auto& d : *c.mutable_nodes(0)->mutable_devices()) {  // equal: the layers split
    d.set_launch_overhead_seconds(0);
    d.mutable_flops(0)->set_flops(50e9);
  }
  return c;
}
v1::Plan TwoStagePlan(const graph::Graph& g, const v1::Cluster& c) {
  auto model = cost::ClusterModel::FromProto(c);
  EXPECT_TRUE(model.ok()) << model.status();
  pipeline::PipelineOptions po;
  po.mode = pipeline::Mode::kStages;
  po.stages = 2;
  po.microbatches = 4;
  po.threads = 1;
  po.plan_spmd = false;
  po.stage_options.optimizer = synth::OptimizerKind::kAdam;
  auto pp = pipeline::PlanPipeline(g, *model, po);
  EXPECT_TRUE(pp.ok()) << pp.status();
  EXPECT_EQ(pp->stages.size(), 2u);
  v1::PlanOptions options;
  options.mutable_optimizer()->set_kind(v1::OptimizerConfig::ADAM);
  options.mutable_optimizer()->set_learning_rate(1e-3);
  auto plan = pipeline::BuildPipelinePlan(g, c, *model, *pp, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *std::move(plan);
}

TEST(CalibrationTest, PipelineRunsModelEachStageAtTheMicrobatchTimesM) {
  graph::Graph g = Gpt();
  v1::Cluster c = EqualCpus();
  const v1::Plan plan = TwoStagePlan(g, c);
  ASSERT_EQ(plan.pipeline().stages_size(), 2);
  auto cal = Calibrate(c, {UnitRun(plan)});
  ASSERT_TRUE(cal.ok()) << cal.status();

  const std::vector<synth::OpWork> work = synth::TrainingWork(g);
  double linear_flops = 0, params = 0;
  for (graph::OpId i = 0; i < static_cast<graph::OpId>(g.ops().size()); ++i) {
    if (g.op(i).type == "linear") linear_flops += work[i].flops;
  }
  for (const graph::Tensor& t : g.tensors()) {
    if (t.kind == graph::TensorKind::kParameter && !t.frozen) params += static_cast<double>(t.type.num_elements());
  }
  const double cpu0 = Modelled(*cal, "cpu0", "linear"), cpu1 = Modelled(*cal, "cpu1", "linear");
  ASSERT_GT(cpu0, 0);
  ASSERT_GT(cpu1, 0);
  EXPECT_NEAR((cpu0 + cpu1) * 50e9, linear_flops, 1e-9 * linear_flops);
  // Cross entropy is the last stage's alone.
  EXPECT_GT(Modelled(*cal, "cpu1", "cross_entropy"), 0);
  EXPECT_EQ(Modelled(*cal, "cpu0", "cross_entropy"), -1);
  double stored = 0;
  for (const auto& d : cal->cluster.nodes(0).devices()) {
    ASSERT_GT(d.optimizer_seconds_per_element(), 0) << d.id();
    stored += 1e-3 / d.optimizer_seconds_per_element();
    EXPECT_EQ(d.step_overhead_seconds(), 0) << d.id();
    EXPECT_FALSE(d.op_time_scale().empty()) << d.id();
  }
  EXPECT_NEAR(stored, params, 1e-6 * params);
  EXPECT_EQ(cal->collective_calls, 0);
}

// The stall per transfer between stages: a run whose step is the 1F1B
// schedule of its kernel times (per stage: the busiest rank's kernels but
// the optimizer over M, split as the plan predicted forward and backward;
// the plan's transfers and sync) with 30 ms added to every transfer gives
// back 30 ms; a run no slower than the schedule gives 0; the cluster gets
// the mean.
TEST(CalibrationTest, FitsTheStallPerTransferBetweenPipelineStages) {
  graph::Graph g = Gpt();
  v1::Cluster c = EqualCpus();
  const v1::Plan plan = TwoStagePlan(g, c);
  ASSERT_EQ(plan.pipeline().stages_size(), 2);
  const double kernels[] = {0.02, 0.015}, optimizer = 0.001;
  std::vector<pipeline::StageTimes> times;
  for (int s = 0; s < 2; ++s) {
    const v1::PipelineStage& st = plan.pipeline().stages(s);
    const double micro = (kernels[s] - optimizer) / 4;
    pipeline::StageTimes t;
    t.forward = micro * st.forward_seconds() / (st.forward_seconds() + st.backward_seconds());
    t.backward = micro - t.forward;
    t.send = st.send_seconds() + (s == 0 ? 0.03 : 0);
    t.gradient = st.gradient_receive_seconds() + (s == 0 ? 0.03 : 0);
    t.sync = std::max(st.sync_seconds(), optimizer);
    times.push_back(t);
  }
  auto schedule = pipeline::Simulate1F1B(times, 4);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  auto run = [&](double step) {
    ProfiledRun r{plan, {}};
    for (int k = 0; k < 2; ++k) {
      RankProfile p;
      p.rank = k;
      p.device = plan.devices(k);
      p.plan_content_hash = plan.content_hash();
      p.step_seconds_median = step;
      const int stage = plan.pipeline().stages(0).devices(0) == p.device ? 0 : 1;
      p.device_seconds = kernels[stage];
      p.op_seconds["linear"] = kernels[stage] - optimizer;
      p.op_seconds["(optimizer)"] = optimizer;
      r.ranks.push_back(p);
    }
    return r;
  };
  auto one = Calibrate(c, {run(schedule->step)});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->pipeline_runs, 1);
  EXPECT_NEAR(one->pipeline_transfer_overhead_seconds, 0.03, 1e-9);
  EXPECT_NEAR(one->cluster.defaults().pipeline_transfer_overhead_seconds(), 0.03, 1e-9);
  // A plan made from a cluster already calibrated with a 10 ms stall has it
  // in its transfers: the fit is still of the whole stall.
  {
    v1::Plan priced = plan;
    priced.mutable_cluster()->mutable_defaults()->set_pipeline_transfer_overhead_seconds(0.01);
    v1::PipelineStage& first = *priced.mutable_pipeline()->mutable_stages(0);
    first.set_send_seconds(first.send_seconds() + 0.01);
    first.set_gradient_receive_seconds(first.gradient_receive_seconds() + 0.01);
    ProfiledRun r = run(schedule->step);
    r.plan = priced;
    auto again = Calibrate(c, {r});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_NEAR(again->pipeline_transfer_overhead_seconds, 0.03, 1e-9);
  }
  auto two = Calibrate(c, {run(schedule->step), run(1e-3)});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->pipeline_runs, 2);
  EXPECT_NEAR(two->pipeline_transfer_overhead_seconds, 0.015, 1e-9);
  // The calibrated cluster carries it into the planner's model (which
  // prices it: planner_core_test); a negative one is refused.
  auto slower = cost::ClusterModel::FromProto(one->cluster);
  ASSERT_TRUE(slower.ok()) << slower.status();
  EXPECT_DOUBLE_EQ(slower->pipeline_transfer_overhead_seconds(),
                   one->cluster.defaults().pipeline_transfer_overhead_seconds());
  v1::Cluster bad = c;
  bad.mutable_defaults()->set_pipeline_transfer_overhead_seconds(-1);
  EXPECT_FALSE(cost::ClusterModel::FromProto(bad).ok());
}

TEST(CalibrationTest, RecoversKnownScalesOverheadOptimizerAndCommunication) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  v1::Plan plan = MakePlan(g, c, synth::Baseline::kNone);
  auto unit = Calibrate(c, {UnitRun(plan)});
  ASSERT_TRUE(unit.ok()) << unit.status();
  // "Measured": the model distorted by known factors per device and type.
  const std::map<std::string, double> scale = {{"linear", 1.5}, {"cross_entropy", 20},
                                               {"layer_norm", 4}};
  const double per_element[] = {2e-9, 5e-9};
  const double overhead[] = {0.003, 0.007};
  ProfiledRun run{plan, {}};
  double busiest = 0;
  for (int r = 0; r < 2; ++r) {
    RankProfile p = Distorted(plan, *unit, r, scale);
    p.op_seconds["(runtime)"] = overhead[r];
    p.op_seconds["(optimizer)"] = 1e-3;  // replaced below once elements are known
    p.device_seconds += overhead[r];
    busiest = std::max(busiest, p.device_seconds);
    run.ranks.push_back(p);
  }
  // Optimizer seconds = elements x rate: find the elements from a first pass.
  auto first = Calibrate(c, {run});
  ASSERT_TRUE(first.ok()) << first.status();
  for (int r = 0; r < 2; ++r) {
    const v1::Device* d = nullptr;
    for (const auto& dev : first->cluster.nodes(0).devices()) {
      if (dev.id() == plan.devices(r)) d = &dev;
    }
    ASSERT_NE(d, nullptr);
    ASSERT_GT(d->optimizer_seconds_per_element(), 0);
    const double elements = 1e-3 / d->optimizer_seconds_per_element();
    run.ranks[r].op_seconds["(optimizer)"] = elements * per_element[r];
  }
  const double comm = plan.prediction().communication_seconds();
  ASSERT_GT(comm, 0);
  double calls = 0;
  for (const auto& s : plan.rank_programs(0).steps()) calls += s.has_collective();
  ASSERT_GT(calls, 0);
  const double per_call = 0.004;
  for (auto& p : run.ranks) p.step_seconds_median = busiest + comm + calls * per_call;

  auto cal = Calibrate(c, {run});
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_NEAR(cal->collective_overhead_seconds, per_call, 1e-9);
  EXPECT_NEAR(cal->cluster.defaults().collective_overhead_seconds(), per_call, 1e-9);
  EXPECT_EQ(cal->collective_calls, calls);
  for (int r = 0; r < 2; ++r) {
    const v1::Device& d = cal->cluster.nodes(0).devices(r);
    SCOPED_TRACE(d.id());
    EXPECT_NEAR(d.op_time_scale().at("linear"), 1.5, 1e-9);
    EXPECT_NEAR(d.op_time_scale().at("cross_entropy"), 20, 1e-9);
    EXPECT_NEAR(d.op_time_scale().at("layer_norm"), 4, 1e-9);
    EXPECT_NEAR(d.op_time_scale().at("gelu"), 1, 1e-9);
    EXPECT_NEAR(d.optimizer_seconds_per_element(), per_element[r], 1e-15);
    EXPECT_NEAR(d.step_overhead_seconds(), overhead[r], 1e-12);
  }

  // The calibrated cluster plans: the model now charges the measured
  // factors, so the same kind of plan is predicted slower than before.
  auto before = cost::ClusterModel::FromProto(c);
  auto after = cost::ClusterModel::FromProto(cal->cluster);
  ASSERT_TRUE(before.ok() && after.ok()) << after.status();
  synth::PlanOptions po;
  po.optimizer = synth::OptimizerKind::kAdam;
  auto p0 = synth::PlanModel(g, *before, po);
  auto p1 = synth::PlanModel(g, *after, po);
  ASSERT_TRUE(p0.ok() && p1.ok());
  EXPECT_GT(p1->cost.total, 1.5 * p0->cost.total);
}

// Runs at two shares whose kernels hide a fixed per-step time (in the
// linears and the runtime): the fit per device recovers it as
// step_overhead_seconds, and the calibrated model reproduces both runs.
TEST(CalibrationTest, FitsEachDevicesFixedTimeAcrossShares) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  const std::map<std::string, double> scale = {{"linear", 1.5}, {"cross_entropy", 20}};
  const double fixed_linear[] = {0.002, 0.010};
  const double runtime = 0.002;
  std::vector<ProfiledRun> runs;
  std::vector<std::map<std::pair<std::string, std::string>, double>> modelled;
  for (synth::Baseline b : {synth::Baseline::kDpEven, synth::Baseline::kDpProportional}) {
    v1::Plan plan = MakePlan(g, c, b);
    auto unit = Calibrate(c, {UnitRun(plan)});
    ASSERT_TRUE(unit.ok()) << unit.status();
    ProfiledRun run{plan, {}};
    modelled.emplace_back();
    for (const Row& row : unit->rows) {
      if (row.modelled_seconds > 0) modelled.back()[{row.device, row.op_type}] = row.modelled_seconds;
    }
    for (int r = 0; r < 2; ++r) {
      RankProfile p = Distorted(plan, *unit, r, scale, {{"linear", fixed_linear[r]}});
      p.op_seconds["(runtime)"] = runtime;
      p.op_seconds["(optimizer)"] = 1e-3;
      p.device_seconds += runtime + 1e-3;
      p.step_seconds_median = p.device_seconds + 0.01;
      run.ranks.push_back(p);
    }
    runs.push_back(run);
  }
  auto cal = Calibrate(c, runs);
  ASSERT_TRUE(cal.ok()) << cal.status();
  ASSERT_EQ(cal->fixed_time.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const v1::Device& d = cal->cluster.nodes(0).devices(r);
    SCOPED_TRACE(d.id());
    // Near, not exact: the model's own launch overheads do not scale with
    // the share either, so the fitted line's intercept moves by theirs.
    EXPECT_NEAR(d.step_overhead_seconds(), fixed_linear[r] + runtime,
                0.05 * (fixed_linear[r] + runtime));
    // Both runs reproduced: the scaled model plus the fixed time.
    for (size_t k = 0; k < runs.size(); ++k) {
      double predicted = d.step_overhead_seconds(), measured = 0;
      for (const auto& [key, m] : modelled[k]) {
        if (key.first == d.id()) predicted += m * d.op_time_scale().at(key.second);
      }
      for (const auto& [t, v] : runs[k].ranks[r].op_seconds) {
        if (t != "(optimizer)") measured += v;
      }
      EXPECT_NEAR(predicted, measured, 1e-9 * measured) << "run " << k;
    }
  }
  // Without the fit, the runtime alone is the fixed time and the linears'
  // fixed part is spread over their scale.
  CalibrateOptions no_fit;
  no_fit.fit_fixed_time = false;
  auto plain = Calibrate(c, runs, no_fit);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->fixed_time.empty());
  EXPECT_NEAR(plain->cluster.nodes(0).devices(1).step_overhead_seconds(), runtime, 1e-12);
  // One run (one share) cannot separate the two: no fit.
  auto one = Calibrate(c, {runs[0]});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(one->fixed_time.empty());
}

// A run of `plan` whose communication took `scale` x the model's transfers
// plus `per_call` per collective call.
ProfiledRun CommRun(const v1::Plan& plan, double scale, double per_call) {
  ProfiledRun run = UnitRun(plan);
  double calls = 0;
  for (const auto& s : plan.rank_programs(0).steps()) {
    if (!s.has_collective()) continue;
    const auto& c = s.collective();
    const bool grouped = c.method() == v1::GROUPED &&
                         (c.collective() == v1::ALL_GATHER || c.collective() == v1::REDUCE_SCATTER);
    calls += grouped ? plan.devices_size() : 1;
  }
  const double comm = plan.prediction().communication_seconds();
  for (auto& r : run.ranks) r.step_seconds_median = r.device_seconds + scale * comm + calls * per_call;
  return run;
}

TEST(CalibrationTest, SeparatesSlowTransfersFromPerCallOverheadAcrossPlans) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  // Data parallelism (a few calls, the gradients' bytes) and ZeRO-3 (a
  // gather and a scatter per parameter: many calls).
  v1::Plan dp = MakePlan(g, c, synth::Baseline::kDpEven);
  v1::Plan zero = MakePlan(g, c, synth::Baseline::kZero3);
  ASSERT_GT(dp.prediction().communication_seconds(), 0);
  auto cal = Calibrate(c, {CommRun(dp, 3.0, 0.002), CommRun(zero, 3.0, 0.002)});
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_NEAR(cal->transfer_scale, 3.0, 1e-6);
  EXPECT_NEAR(cal->collective_overhead_seconds, 0.002, 1e-9);
  EXPECT_NEAR(cal->cluster.defaults().intra_node_bandwidth_bytes_per_second(), 2e9 / 3, 1);
  EXPECT_NEAR(cal->cluster.defaults().inter_node_bandwidth_bytes_per_second(), 1e9 / 3, 1);
  EXPECT_NE(cal->communication_fit.find("least squares"), std::string::npos)
      << cal->communication_fit;

  // No per-call cost at all: the transfers alone.
  cal = Calibrate(c, {CommRun(dp, 2.0, 0), CommRun(zero, 2.0, 0)});
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_NEAR(cal->transfer_scale, 2.0, 1e-6);
  EXPECT_NEAR(cal->collective_overhead_seconds, 0, 1e-9);

  // One plan twice cannot separate them: the links stay, the calls take it.
  cal = Calibrate(c, {CommRun(dp, 3.0, 0.002), CommRun(dp, 3.0, 0.002)});
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->transfer_scale, 1.0);
  EXPECT_EQ(cal->cluster.defaults().intra_node_bandwidth_bytes_per_second(), 2e9);
  EXPECT_GT(cal->collective_overhead_seconds, 0.002);
  EXPECT_NE(cal->communication_fit.find("do not separate"), std::string::npos)
      << cal->communication_fit;
}

// The transfer scale is fitted against the plans' predictions, so it
// holds for the links they were priced with. Calibrating the calibrated
// cluster again from the same runs divided its links by the scale twice
// (2 GB/s -> 154 MB/s -> 12 MB/s): refused, naming the run and the link.
TEST(CalibrationTest, RefusesToScaleLinksOtherThanThePlansWerePricedWith) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  auto runs = [&](const v1::Cluster& from) {
    ProfiledRun dp = UnitRun(MakePlan(g, from, synth::Baseline::kDpEven));
    ProfiledRun zero3 = UnitRun(MakePlan(g, from, synth::Baseline::kZero3));
    for (auto& r : dp.ranks) r.step_seconds_median = 0.51;
    for (auto& r : zero3.ranks) r.step_seconds_median = 0.7;
    return std::vector<ProfiledRun>{dp, zero3};
  };
  auto once = Calibrate(c, runs(c));
  ASSERT_TRUE(once.ok()) << once.status();
  ASSERT_GT(once->transfer_scale, 2) << once->communication_fit;
  auto twice = Calibrate(once->cluster, runs(c));
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("run 0's plan was priced with intra_node_bandwidth"),
            std::string::npos)
      << twice.status();
  // Runs of plans made from the calibrated cluster calibrate it.
  auto again = Calibrate(once->cluster, runs(once->cluster));
  ASSERT_TRUE(again.ok()) << again.status();
}

TEST(CalibrationTest, PooledOpScalesAreOnePerKindWeightedByModelledTime) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  v1::Plan dp = MakePlan(g, c, synth::Baseline::kDpEven);
  auto unit = Calibrate(c, {UnitRun(dp)});
  ASSERT_TRUE(unit.ok()) << unit.status();
  // cpu0's linears measured 2x the model, cpu1's 1x.
  ProfiledRun run = UnitRun(dp);
  const double m0 = Modelled(*unit, "cpu0", "linear"), m1 = Modelled(*unit, "cpu1", "linear");
  ASSERT_GT(m0, 0);
  ASSERT_GT(m1, 0);
  run.ranks[0].op_seconds["linear"] = 2 * m0;
  run.ranks[1].op_seconds["linear"] = m1;
  auto per_device = Calibrate(c, {run});
  ASSERT_TRUE(per_device.ok()) << per_device.status();
  EXPECT_NEAR(per_device->cluster.nodes(0).devices(0).op_time_scale().at("linear"), 2, 1e-9);
  EXPECT_NEAR(per_device->cluster.nodes(0).devices(1).op_time_scale().at("linear"), 1, 1e-9);
  CalibrateOptions pool;
  pool.pool_op_scales_by_kind = true;
  auto pooled = Calibrate(c, {run}, pool);
  ASSERT_TRUE(pooled.ok()) << pooled.status();
  const double want = (2 * m0 + m1) / (m0 + m1);
  EXPECT_NEAR(pooled->cluster.nodes(0).devices(0).op_time_scale().at("linear"), want, 1e-9);
  EXPECT_NEAR(pooled->cluster.nodes(0).devices(1).op_time_scale().at("linear"), want, 1e-9);
}

TEST(CalibrationTest, RejectsProfilesThatDoNotMatchThePlan) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  v1::Plan plan = MakePlan(g, c, synth::Baseline::kDpEven);
  ProfiledRun missing = UnitRun(plan);
  missing.ranks.pop_back();
  auto s = Calibrate(c, {missing}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("every rank's profile"), std::string::npos) << s;

  ProfiledRun twice = UnitRun(plan);
  twice.ranks[1].rank = 0;
  EXPECT_EQ(Calibrate(c, {twice}).status().code(), absl::StatusCode::kInvalidArgument);

  ProfiledRun other = UnitRun(plan);
  other.ranks[0].plan_content_hash = "0123456789abcdef";
  s = Calibrate(c, {other}).status();
  EXPECT_NE(s.message().find("profile is of plan 0123456789ab"), std::string::npos) << s;

  // A profile that does not say which plan it measured could be of any.
  ProfiledRun unnamed = UnitRun(plan);
  unnamed.ranks[1].plan_content_hash.clear();
  s = Calibrate(c, {unnamed}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank 1's profile does not name its plan"), std::string::npos) << s;

  // Nor is a profile taken for a rank of another device: the plan puts
  // rank 0 on cpu0, a profile measured on cpu1 is of another run.
  ProfiledRun swapped = UnitRun(plan);
  swapped.ranks[0].device = plan.devices(1);
  s = Calibrate(c, {swapped}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(absl::StrCat("rank 0's profile was measured on '", plan.devices(1),
                                          "', the plan puts rank 0 on '", plan.devices(0), "'")),
            std::string::npos)
      << s;

  v1::Cluster renamed = c;
  renamed.mutable_nodes(0)->mutable_devices(1)->set_id("gpu7");
  s = Calibrate(renamed, {UnitRun(plan)}).status();
  EXPECT_NE(s.message().find("'cpu1' is not in the cluster"), std::string::npos) << s;

  EXPECT_EQ(Calibrate(c, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// A plan of no devices (a plan file without its lowering) has no rank to
// profile: it was a run whose every rank had a profile, and calibrated
// nothing without a word (hapctl calibrate wrote the cluster unchanged as
// calibrated; the planner's CalibrateDevices, given one, would read the
// first of no fitted devices).
TEST(CalibrationTest, RejectsARunOfAPlanWithNoDevices) {
  v1::Plan plan = MakePlan(Gpt(), TwoCpus(), synth::Baseline::kDpEven);
  plan.clear_devices();
  plan.clear_rank_programs();
  auto s = Calibrate(TwoCpus(), {ProfiledRun{plan, {}}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 0: its plan has no devices"), std::string::npos) << s;
  // A run's source names it (hapctl calibrate gives its --plan and
  // --profile; "run 3" named none of a user's files).
  ProfiledRun named{plan, {}, "--plan b.pb --profile b"};
  s = Calibrate(TwoCpus(), {named}).status();
  EXPECT_NE(s.message().find("run 0 (--plan b.pb --profile b): its plan has no devices"),
            std::string::npos)
      << s;
}

// Numbers no measurement has (the planner takes its deployments' profiles
// from the executors' status reports unchecked): NaN, infinite or negative
// seconds, or a step longer than a million seconds. Each is refused naming
// the run, the rank and the number, where it became a NaN or negative
// optimizer_seconds_per_element or step_overhead_seconds that the cost
// model refuses for every later plan, or seconds so large that every later
// plan failed as "memory is at the limit of solver tolerance".
TEST(CalibrationTest, RejectsProfileNumbersNoMeasurementHas) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  const v1::Plan plan = MakePlan(g, c, synth::Baseline::kDpEven);
  ASSERT_TRUE(Calibrate(c, {UnitRun(plan)}).ok());
  const double nan = std::nan(""), inf = INFINITY;
  ExpectEachMessRefused<RankProfile>(
      c, plan, [](ProfiledRun* r) { return &r->ranks[1]; },
      {
          {[&](RankProfile* p) { p->op_seconds["(optimizer)"] = nan; },
           "op_seconds['(optimizer)']"},
          {[&](RankProfile* p) { p->op_seconds["(runtime)"] = -0.5; }, "op_seconds['(runtime)']"},
          {[&](RankProfile* p) { p->op_seconds["linear"] = inf; }, "op_seconds['linear']"},
          {[&](RankProfile* p) { p->op_seconds["linear"] = 1e30; }, "op_seconds['linear']"},
          {[&](RankProfile* p) { p->op_seconds["(runtime)"] = 1e300; }, "op_seconds['(runtime)']"},
          {[&](RankProfile* p) { p->step_seconds_median = nan; }, "step_seconds_median"},
          {[&](RankProfile* p) { p->step_seconds_median = 1e300; }, "step_seconds_median"},
          {[&](RankProfile* p) { p->device_seconds = -1; }, "device_seconds"},
      },
      "run 1: rank 1's ");
  // A slow run, still a calibration the planner plans with (one at the
  // bound gives a fit the planner refuses:
  // RejectsAFitThePlannersChecksWouldRefuse).
  ProfiledRun slow = UnitRun(plan);
  slow.ranks[1].op_seconds["linear"] = 10;
  slow.ranks[1].step_seconds_median = 20;
  auto cal = Calibrate(c, {slow});
  ASSERT_TRUE(cal.ok()) << cal.status();
  auto model = cost::ClusterModel::FromProto(cal->cluster);
  ASSERT_TRUE(model.ok()) << model.status();
  synth::PlanOptions po;
  po.optimizer = synth::OptimizerKind::kAdam;
  auto planned = synth::PlanModel(g, *model, po);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_TRUE(std::isfinite(planned->cost.total) && planned->cost.total > 0);
}

TEST(CalibrationTest, ParsesTheExecutorsProfileFormatAndNamesWhatIsWrong) {
  auto p = ParseRankProfile(R"json({"plan_content_hash": "ab", "rank": 1, "device": "cpu1",
      "steps": 10, "step_seconds_median": 0.25, "device_seconds": 0.125,
      "op_seconds": {"linear": 0.05, "(optimizer)": 0.01}})json");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->rank, 1);
  EXPECT_EQ(p->device, "cpu1");
  EXPECT_DOUBLE_EQ(p->step_seconds_median, 0.25);
  EXPECT_DOUBLE_EQ(p->op_seconds.at("linear"), 0.05);

  auto bad = ParseRankProfile("{not json");
  EXPECT_NE(bad.status().message().find("not valid JSON"), std::string::npos);
  // A profile nested 2^20 deep: refused at once, not parsed for hours.
  bad = ParseRankProfile("{\"op_seconds\":" + std::string(1 << 20, '[') +
                         std::string(1 << 20, ']') + "}");
  EXPECT_NE(bad.status().message().find("nest deeper than 64"), std::string::npos) << bad.status();
  bad = ParseRankProfile(R"({"rank": 0, "device_seconds": 1, "op_seconds": {}})");
  EXPECT_NE(bad.status().message().find("step_seconds_median"), std::string::npos);
  bad = ParseRankProfile(
      R"({"rank": 0, "step_seconds_median": 1, "device_seconds": 1, "op_seconds": {"x": -1}})");
  EXPECT_NE(bad.status().message().find("op_seconds['x']"), std::string::npos);
}

// A rank that is no rank number: 1.5 was taken as rank 0, and 1e300 and
// 2^32 were converted to int, which is undefined behaviour.
TEST(CalibrationTest, ParseRankProfileRefusesARankThatIsNoRankNumber) {
  for (const char* rank : {"1.5", "1e300", "4294967296"}) {
    auto p = ParseRankProfile(absl::StrCat(R"({"rank": )", rank,
                                           R"(, "step_seconds_median": 1, "device_seconds": 1,
        "op_seconds": {}})"));
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << rank;
    EXPECT_NE(p.status().message().find("'rank' must be a whole number"), std::string::npos)
        << p.status();
  }
  auto p = ParseRankProfile(
      R"({"rank": 3, "step_seconds_median": 1, "device_seconds": 1, "op_seconds": {}})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->rank, 3);
}

TEST(CalibrationTest, FitsOverlapEfficiencyFromRunsThatOverlapped) {
  // measured = compute + exposed + (1 - e) (busy - exposed) at e = 0.6.
  std::vector<OverlapSample> samples = {{0, 1.0, 0.1, 0.5}, {0, 2.0, 0.0, 0.8}};
  for (OverlapSample& x : samples) x.measured = x.compute + x.exposed + 0.4 * (x.busy - x.exposed);
  ASSERT_TRUE(FitOverlapEfficiency(samples).has_value());
  EXPECT_NEAR(*FitOverlapEfficiency(samples), 0.6, 1e-12);
  // Slower than no overlap at all clips to 0; faster than full overlap to 1.
  EXPECT_DOUBLE_EQ(*FitOverlapEfficiency({{3.0, 1.0, 0.1, 0.5}}), 0.0);
  EXPECT_DOUBLE_EQ(*FitOverlapEfficiency({{1.0, 1.0, 0.1, 0.5}}), 1.0);
  EXPECT_FALSE(FitOverlapEfficiency({{1.0, 1.0, 0.5, 0.5}}).has_value());  // nothing hidden
  EXPECT_FALSE(FitOverlapEfficiency({}).has_value());

  // Through Calibrate: a run of a plan made with overlap at efficiency 1.
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  for (auto& d : *c.mutable_nodes(0)->mutable_devices()) d.set_overlap_efficiency(1);
  const v1::Plan plan = MakePlan(g, c, synth::Baseline::kDpProportional, /*overlap=*/true);
  ASSERT_TRUE(plan.prediction().overlap_assumed());
  const auto& pr = plan.prediction();
  ASSERT_GT(pr.communication_busy_seconds(), pr.communication_seconds());
  ProfiledRun run = UnitRun(plan);
  for (auto& r : run.ranks) {
    r.step_seconds_median = pr.compute_seconds() + pr.communication_seconds() +
                            0.3 * (pr.communication_busy_seconds() - pr.communication_seconds());
  }
  auto cal = Calibrate(c, {run});
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_NEAR(cal->overlap_efficiency, 0.7, 1e-9);
  EXPECT_EQ(cal->overlap_runs, 1);
  for (const auto& d : cal->cluster.nodes(0).devices()) {
    EXPECT_NEAR(d.overlap_efficiency(), 0.7, 1e-9);
  }
  // A plan that assumed the CPUs' default (0.5) cannot be fitted against.
  const v1::Plan cpu = MakePlan(g, TwoCpus(), synth::Baseline::kDpProportional, true);
  auto bad = Calibrate(TwoCpus(), {UnitRun(cpu)});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("overlap_efficiency 0.5"),
            std::string::npos)
      << bad.status();
}

// A plan whose prediction holds an infinite or NaN number (a hand-edited or
// broken plan file): the communication fit took an infinite transfer time
// into its sums and gave a NaN transfer scale, which divided every link's
// bandwidth into NaN, and the overlap fit a NaN overlap_efficiency; both
// were returned as a calibration. Refused naming the run and the field.
TEST(CalibrationTest, RejectsAPlanWhosePredictionIsNoNumber) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  const v1::Plan plan = MakePlan(g, c, synth::Baseline::kDpEven);
  ASSERT_TRUE(Calibrate(c, {UnitRun(plan)}).ok());
  const double nan = std::nan(""), inf = INFINITY;
  ExpectEachMessRefused<v1::PlanPrediction>(
      c, plan, [](ProfiledRun* r) { return r->plan.mutable_prediction(); },
      {
          {[&](v1::PlanPrediction* p) { p->set_communication_seconds(inf); },
           "communication_seconds"},
          {[&](v1::PlanPrediction* p) { p->set_communication_seconds(-1); },
           "communication_seconds"},
          {[&](v1::PlanPrediction* p) { p->set_compute_seconds(nan); }, "compute_seconds"},
          {[&](v1::PlanPrediction* p) { p->set_communication_busy_seconds(inf); },
           "communication_busy_seconds"},
      },
      "run 1: its plan's prediction.");
  // Nor the overlap fit's own samples: nothing is fitted from them.
  EXPECT_FALSE(FitOverlapEfficiency({{nan, 1.0, 0.1, 0.5}}).has_value());
  EXPECT_FALSE(FitOverlapEfficiency({{3.0, 1.0, 0.1, inf}}).has_value());
  auto e = FitOverlapEfficiency({{3.0, 1.0, nan, 0.5}, {1.0 + 0.1 + 0.4 * 0.4, 1.0, 0.1, 0.5}});
  ASSERT_TRUE(e.has_value());
  EXPECT_NEAR(*e, 0.6, 1e-12);
}

// Profile numbers each within the profile's bound (1e6 s per step) can
// still fit what the planner refuses (profile_checks' CheckCalibration): an
// op scale of 1e9 (1e6 s over the model's milliseconds), a step overhead
// past an hour, more than a second per optimizer element, a collective call
// costing hours. They were returned as a calibration: hapctl calibrate
// wrote a cluster whose devices the planner refuses to register, and the
// planner's own fit was refused only after it was made, as "out of range".
// Now the fit is refused naming the device, the field and the value.
TEST(CalibrationTest, RejectsAFitThePlannersChecksWouldRefuse) {
  graph::Graph g = Gpt();
  v1::Cluster c = TwoCpus();
  const v1::Plan plan = MakePlan(g, c, synth::Baseline::kDpEven);
  struct Case {
    std::function<void(RankProfile*)> mess;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {[](RankProfile* p) { p->op_seconds["linear"] = 1e6; },
       {"device 'cpu1'", "op_time_scale[\"linear\"]", "measured 1e+06 s where the model gives"}},
      {[](RankProfile* p) { p->op_seconds["(runtime)"] = 1e4; },
       {"device 'cpu1'", "step_overhead_seconds must be"}},
      {[](RankProfile* p) { p->op_seconds["(optimizer)"] = 1e6; },
       {"device 'cpu1'", "optimizer_seconds_per_element must be"}},
      {[](RankProfile* p) { p->step_seconds_median = 1e6; },
       {"collective_overhead_seconds must be"}},
  };
  for (const Case& k : cases) {
    ProfiledRun run = UnitRun(plan);
    k.mess(&run.ranks[1]);
    auto cal = Calibrate(c, {UnitRun(plan), run});
    EXPECT_EQ(cal.status().code(), absl::StatusCode::kInvalidArgument) << k.says[0];
    for (const std::string& says : k.says) {
      EXPECT_NE(cal.status().message().find(says), std::string::npos)
          << says << " in " << cal.status();
    }
  }
}

// A profile that times no op (op_seconds empty or all 0: a rank whose
// kernel timing was off or broken) was taken as a measurement of nothing:
// its device's op scales were cleared and its optimizer_seconds_per_element
// and step_overhead_seconds set to 0, silently, so the planner's fit
// replaced a device's calibration with none. Refused naming the run and
// the rank.
TEST(CalibrationTest, RejectsAProfileThatTimesNoOp) {
  const v1::Plan plan = MakePlan(Gpt(), TwoCpus(), synth::Baseline::kDpEven);
  ProfiledRun empty = UnitRun(plan);
  empty.ranks[1].op_seconds.clear();
  auto s = Calibrate(TwoCpus(), {UnitRun(plan), empty}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 1: rank 1's profile times no op"), std::string::npos) << s;
  ProfiledRun zeros = UnitRun(plan);
  for (auto& [type, secs] : zeros.ranks[0].op_seconds) secs = 0;
  s = Calibrate(TwoCpus(), {zeros}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 0: rank 0's profile times no op"), std::string::npos) << s;
}

// A plan whose rank programs do not match its devices (a plan file saved
// without its lowering, or a broken one): its collective calls were read
// from rank 0's program, none when there was none, so the communication
// was not fitted and nothing said so; a rank program's world size other
// than the plan's made the grouped calls count negative or wrong.
TEST(CalibrationTest, RejectsAPlanWhoseRankProgramsDoNotMatchItsDevices) {
  const v1::Plan plan = MakePlan(Gpt(), TwoCpus(), synth::Baseline::kDpEven);
  ASSERT_EQ(plan.rank_programs_size(), 2);
  ProfiledRun bare = UnitRun(plan);
  bare.plan.clear_rank_programs();
  auto s = Calibrate(TwoCpus(), {bare}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 0: its plan has 0 rank programs for 2 devices"),
            std::string::npos)
      << s;
  ProfiledRun world = UnitRun(plan);
  world.plan.mutable_rank_programs(1)->set_world_size(-3);
  s = Calibrate(TwoCpus(), {world}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 0: its plan's rank program 1 has world_size -3, not 2"),
            std::string::npos)
      << s;
}

// A device whose launch overhead is no number (a cluster file's NaN, or a
// negative one) made every op's modelled time NaN or wrong: no op type got
// a scale and all the measured time went to step_overhead_seconds, without
// a word. Refused naming the device and the field, as a FLOP/s that is no
// number is.
TEST(CalibrationTest, RejectsADeviceWhoseLaunchOverheadIsNoNumber) {
  const v1::Plan plan = MakePlan(Gpt(), TwoCpus(), synth::Baseline::kDpEven);
  for (double bad : {std::nan(""), -1.0, double{INFINITY}}) {
    v1::Cluster c = TwoCpus();
    c.mutable_nodes(0)->mutable_devices(1)->set_launch_overhead_seconds(bad);
    auto s = Calibrate(c, {UnitRun(plan)}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("device 'cpu1' has launch_overhead_seconds "), std::string::npos)
        << s;
  }
}

// A profile's 'device' or 'plan_content_hash' that is no string (a number,
// an object) was read as empty: the device went unchecked against the
// plan's, and the hash was called missing. Each is refused naming it.
TEST(CalibrationTest, ParseRankProfileRefusesAFieldThatIsNoString) {
  for (const char* field : {"device", "plan_content_hash"}) {
    auto p = ParseRankProfile(absl::StrCat(R"({"rank": 0, ")", field,
                                           R"(": 7, "step_seconds_median": 1,
        "device_seconds": 1, "op_seconds": {"linear": 1}})"));
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(p.status().message().find(absl::StrCat("profile's '", field, "' must be a string")),
              std::string::npos)
        << p.status();
  }
  // Absent, each is empty (Calibrate then says what is missing).
  auto p = ParseRankProfile(
      R"({"rank": 0, "step_seconds_median": 1, "device_seconds": 1, "op_seconds": {}})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device, "");
}

// A rank whose share of the batch, as its buffers say, is outside [0, 1]
// (a broken plan file: a local shard longer than the tensor) was modelled
// at that share, three times the work here, and its op scales fitted a
// third of what they are, without a word. Refused naming the run, the rank
// and the share; Model's errors name the run and the rank.
TEST(CalibrationTest, RejectsARankWhoseShareOfTheBatchIsNoShare) {
  const v1::Plan plan = MakePlan(Gpt(), TwoCpus(), synth::Baseline::kDpEven);
  ProfiledRun run = UnitRun(plan);
  int changed = 0;
  for (v1::Buffer& b : *run.plan.mutable_rank_programs(1)->mutable_buffers()) {
    if (b.role() != v1::Buffer::ACTIVATION && b.role() != v1::Buffer::INPUT &&
        b.role() != v1::Buffer::GRADIENT) {
      continue;
    }
    if (b.shape_size() != b.global_shape_size()) continue;
    for (int d = 0; d < b.shape_size(); ++d) {
      if (b.shape(d) != b.global_shape(d)) {
        b.set_shape(d, 3 * b.global_shape(d));
        ++changed;
      }
    }
  }
  ASSERT_GT(changed, 0);
  auto s = Calibrate(TwoCpus(), {UnitRun(plan), run}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 1: rank 1 runs a share 3 of the batch"), std::string::npos) << s;
}

}  // namespace
}  // namespace hap::calibrate
