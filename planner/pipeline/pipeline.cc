#include "planner/pipeline/pipeline.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/deadline.h"
#include "common/status_macros.h"
#include "planner/cost/collectives.h"
#include "planner/pipeline/layers.h"

namespace hap::pipeline {
namespace {

using Clock = std::chrono::steady_clock;
using synth::Form;
using synth::Program;

bool IsZero3(const synth::SourceLoad& l) {
  return l.storage == synth::ParamStorage::kZero && !l.gather_once;
}

ratios::CostTerm ZeroTerm(int n) {
  ratios::CostTerm t;
  t.coef.assign(n, 0);
  t.constant.assign(n, 0);
  return t;
}

// The steps [begin, end) of `p`, one part of them:
//   kMicro  what runs per microbatch: compute, activation collectives,
//           ZeRO-3 gathers and reduce-scatters, SFB gathers;
//   kSync   what runs once per step: replicated gradients' all-reduce (the
//           caller buckets them), ZeRO-2 gathers and reduce-scatters, the
//           optimizer updates;
//   kAll    both (for memory).
enum class Part { kMicro, kSync, kAll };
Program SubProgram(const Program& p, int begin, int end, Part part, int n) {
  Program q;
  for (int k = begin; k < end; ++k) {
    synth::OpStep s = p.steps[k];
    for (synth::SourceLoad& l : s.loads) {
      const bool per_step = (l.grad_allreduce && !l.sfb) || l.gather_once;
      if (part == Part::kMicro) {
        if (per_step) l.costs.clear();
        l.update_costs.clear();
      } else if (part == Part::kSync && !per_step) {
        l.costs.clear();
      }
      (void)IsZero3;
    }
    if (part == Part::kSync) {
      s.compute = ZeroTerm(n);
      s.internal = ZeroTerm(n);
      s.comms.clear();
    }
    q.steps.push_back(std::move(s));
  }
  return q;
}

// Forward's share of a steps' micro work: a third of the compute, the
// forward collectives and gathers, against the rest (at `r`).
double ForwardShare(const Program& micro, const std::vector<double>& r) {
  double f = 0, b = 0;
  for (const synth::OpStep& s : micro.steps) {
    const double c = cost::EvaluateTerm(s.compute, r);
    f += c / 3 + cost::EvaluateTerm(s.internal, r);
    b += 2 * c / 3;
    for (const synth::CommStep& m : s.comms) {
      f += cost::EvaluateTerm(m.forward_cost, r);
      if (m.has_backward) b += cost::EvaluateTerm(m.backward_cost, r);
    }
    for (const synth::SourceLoad& l : s.loads) {
      for (size_t i = 0; i < l.costs.size(); ++i) {
        ((IsZero3(l) && i == 0) ? f : b) += cost::EvaluateTerm(l.costs[i], r);
      }
    }
  }
  return f + b > 0 ? f / (f + b) : 1.0 / 3;
}

struct Group {
  std::vector<int> devices;  // cluster indices
  std::string signature;
};

// One group at one microbatch count: its program and per-layer prices.
struct Entry {
  absl::Status status = absl::UnknownError("not planned");
  bool too_small = false;  // the microbatch has fewer samples than the group devices
  std::unique_ptr<cost::ClusterModel> cluster;
  std::unique_ptr<cost::CollectiveModel> coll;
  synth::PlanResult plan;
  std::vector<double> micro, forward_share, sync;  // per layer
  // Per layer then device: bytes held for the step, and per microbatch.
  std::vector<std::vector<double>> static_bytes, act_bytes;
  std::vector<Form> boundary_form;  // per boundary: the producer's output form
  double overhead = 0;
  // Prefix sums over layers (index l = layers [0, l)).
  std::vector<double> micro_prefix, forward_prefix, sync_prefix;
  std::vector<std::vector<double>> static_prefix, act_prefix;  // [l][device]
  // max_in_flight[i][j]: the most in-flight microbatches layers [i, j) fit
  // with on every device (-1: not even one); kNoLimit without memory checks.
  std::vector<std::vector<int>> max_in_flight;
};
constexpr int kNoLimit = 1 << 30;

// The lowering's gradient buckets (64 MiB) of `p`, each one all-reduce on
// the entry's group.
void AssignBuckets(const graph::Graph& gm, const Entry& e, Program* p) {
  synth::AssignGradientBuckets(
      gm, synth::kLoweringBucketBytes,
      [&e](double bytes, const char** algorithm) {
        *algorithm = e.coll->AllReduceAlgorithm(bytes).algorithm;
        return e.coll->Constant(e.coll->AllReduce(bytes));
      },
      p);
}

// `p` priced with communication overlapping compute on the entry's
// devices (Program::overlap and their interference).
void Overlapped(const Entry& e, Program* p) {
  p->overlap = true;
  p->interference.clear();
  for (const cost::DeviceModel& d : e.cluster->devices()) {
    p->interference.push_back(1 - d.overlap_efficiency);
  }
}

std::string Signature(const cost::ClusterModel& c, const std::vector<int>& d) {
  std::string s;
  for (int i : d) {
    const cost::DeviceModel& m = c.device(i);
    absl::StrAppend(&s, m.model, "|", m.flops, "|", m.memory_bytes, "|", m.launch_overhead_seconds,
                    "|", m.optimizer_seconds_per_element, "|", m.step_overhead_seconds, "|",
                    m.overlap_efficiency, "|", m.queued_launches, "|");
    for (const auto& [k, v] : m.op_time_scale) absl::StrAppend(&s, k, "=", v, ",");
    for (int j : d) absl::StrAppend(&s, c.bandwidth(i, j), "/", c.latency(i, j), ",");
    s += ";";
  }
  return s;
}

double MinBandwidth(const cost::ClusterModel& c, const std::vector<int>& a,
                    const std::vector<int>& b) {
  double bw = INFINITY;
  for (int i : a) {
    for (int j : b) bw = std::min(bw, c.bandwidth(i, j));
  }
  return bw;
}

double MaxLatency(const cost::ClusterModel& c, const std::vector<int>& a,
                  const std::vector<int>& b) {
  double lat = 0;
  for (int i : a) {
    for (int j : b) lat = std::max(lat, c.latency(i, j));
  }
  return lat;
}

// Prices the entry's program per layer.
absl::Status PriceLayers(const graph::Graph& gm, const Layers& layers,
                         const std::vector<graph::TensorId>& boundary, int microbatches,
                         synth::OptimizerKind opt, bool ignore_memory, Entry* e) {
  const Program& p = e->plan.program;
  const std::vector<double>& r = e->plan.ratios;
  const int n = e->cluster->size();
  if (p.steps.size() != gm.ops().size()) {
    return absl::InternalError("the group's program does not cover the graph");
  }
  for (int l = 0; l < layers.size(); ++l) {
    const int b = layers.begin[l], end = layers.begin[l + 1];
    Program micro = SubProgram(p, b, end, Part::kMicro, n);
    Program sync = SubProgram(p, b, end, Part::kSync, n);
    AssignBuckets(gm, *e, &sync);
    e->micro.push_back(synth::EvaluateProgram(micro, r).total);
    e->forward_share.push_back(ForwardShare(micro, r));
    e->sync.push_back(synth::EvaluateProgram(sync, r).total);
    Program all = SubProgram(p, b, end, Part::kAll, n);
    Program outputs = all;
    for (synth::OpStep& s : outputs.steps) s.loads.clear();
    // One more copy of the stage's gradients: the sums over microbatches
    // (executor/train/pipeline.h), which one microbatch does not need.
    const std::vector<int64_t> total = synth::MemoryAt(
        synth::MemoryModel(gm, *e->cluster, all, opt, microbatches > 1 ? 1.0 : 0.0), r);
    const std::vector<int64_t> act =
        synth::MemoryAt(synth::MemoryModel(gm, *e->cluster, outputs, opt), r);
    e->static_bytes.emplace_back();
    e->act_bytes.emplace_back();
    for (int d = 0; d < n; ++d) {
      e->static_bytes.back().push_back(static_cast<double>(total[d] - act[d]));
      e->act_bytes.back().push_back(static_cast<double>(act[d]));
    }
  }
  if (!p.overhead.constant.empty()) e->overhead = cost::EvaluateTerm(p.overhead, r);
  const int L = layers.size();
  e->micro_prefix.assign(L + 1, 0);
  e->forward_prefix.assign(L + 1, 0);
  e->sync_prefix.assign(L + 1, 0);
  e->static_prefix.assign(L + 1, std::vector<double>(n, 0));
  e->act_prefix = e->static_prefix;
  for (int l = 0; l < L; ++l) {
    e->micro_prefix[l + 1] = e->micro_prefix[l] + e->micro[l];
    e->forward_prefix[l + 1] = e->forward_prefix[l] + e->micro[l] * e->forward_share[l];
    e->sync_prefix[l + 1] = e->sync_prefix[l] + e->sync[l];
    for (int d = 0; d < n; ++d) {
      e->static_prefix[l + 1][d] = e->static_prefix[l][d] + e->static_bytes[l][d];
      e->act_prefix[l + 1][d] = e->act_prefix[l][d] + e->act_bytes[l][d];
    }
  }
  e->max_in_flight.assign(L + 1, std::vector<int>(L + 1, -1));
  for (int i = 0; i < L; ++i) {
    for (int j = i + 1; j <= L; ++j) {
      int k = kNoLimit;
      if (!ignore_memory) {
        for (int d = 0; d < n && k >= 0; ++d) {
          const double cap = static_cast<double>(e->cluster->device(d).memory_bytes) -
                             (e->static_prefix[j][d] - e->static_prefix[i][d]);
          // The runner's own microbatch plus k stashed in flight
          // (executor/train/pipeline.h): k + 1 copies of the activations.
          const double act = e->act_prefix[j][d] - e->act_prefix[i][d];
          if (cap < 2 * act) {
            k = -1;
          } else if (act > 0) {
            k = static_cast<int>(std::min<double>(k, std::floor(cap / act) - 1));
          }
        }
      }
      e->max_in_flight[i][j] = k;
    }
  }
  for (graph::TensorId t : boundary) {
    const graph::Tensor& x = gm.tensor(t);
    const synth::OpStep& s = p.steps[x.producer];
    e->boundary_form.push_back(s.rule.outputs[x.producer_output]);
  }
  return absl::OkStatus();
}

// With overlap (PlanOptions::overlap_communication), what a stage on entry
// `e` runs once per step after its last backward, ops [begin, end) at
// ratios `r`: the pipeline runner starts the gradient buckets during the
// last microbatch's backward, so only the part of their synchronisation
// that outlasts it counts, plus the updates and the per-step overhead. The
// microbatch with its synchronisation and updates is priced as the
// critical path over compute and communication (EvaluateProgram with
// Program::overlap and the devices' interference), less the microbatch
// alone.
double ExposedSync(const graph::Graph& gm, const Entry& e, int begin, int end,
                   const std::vector<double>& r) {
  const int n = e.cluster->size();
  Program micro = SubProgram(e.plan.program, begin, end, Part::kMicro, n);
  Program all = SubProgram(e.plan.program, begin, end, Part::kAll, n);
  AssignBuckets(gm, e, &all);
  Overlapped(e, &micro);
  Overlapped(e, &all);
  return std::max(0.0, synth::EvaluateProgram(all, r).total -
                           synth::EvaluateProgram(micro, r).total) +
         e.overhead;
}

// Re-sharding a boundary activation of `bytes` from group A (form fa) to
// group B (form fb), forward and backward; split in the sender's part
// (link, A's collectives) and the receiver's (B's collectives).
struct Transfer {
  double send_sender = 0, send_receiver = 0;
  double grad_sender = 0, grad_receiver = 0;
};
Transfer PriceTransfer(double bytes, double bw, double lat, const Entry& a, Form fa, const Entry& b,
                       Form fb) {
  Transfer t;
  const double link = lat + bytes / bw;
  t.send_sender = link + (fa.is_partial() ? a.coll->AllReduce(bytes) : 0);
  t.grad_sender = link + (fa.is_partial() ? a.coll->Broadcast(bytes) : 0);
  if (!fb.is_sharded() && b.cluster->size() > 1) {
    // Every device of B reads it whole: one copy crosses, then a broadcast
    // inside B; its gradient (partial over B) is reduced before it returns.
    t.send_receiver = b.coll->Broadcast(bytes);
    t.grad_receiver = b.coll->Reduce(bytes);
  }
  return t;
}

struct StageChoice {
  int first_layer, end_layer, first_unit, end_unit;
  int group;  // index into the groups (an alternative program of the units)
};

}  // namespace

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kSynthesized:
      return "pipeline x spmd";
    case Variant::kDataParallel:
      return "metis-style dp x pp";
    case Variant::kEvenSplit:
      return "1f1b even split";
  }
  return "?";
}

absl::StatusOr<PipelinePlan> PlanPipeline(const graph::Graph& g, const cost::ClusterModel& cluster,
                                          const PipelineOptions& o) {
  auto now = [&o] { return o.now ? o.now() : Clock::now(); };
  const auto start = now();
  // stage_options.max_seconds bounds the whole call (the SPMD plan and every
  // stage synthesis together), and stage_options.cancelled stops it: what
  // was not synthesized by then is left out of the stage search.
  const auto deadline = DeadlineAfter<Clock>(start, o.stage_options.max_seconds);
  auto cancelled = [&o] { return o.stage_options.cancelled && o.stage_options.cancelled(); };
  PipelinePlan out;
  out.variant = o.variant;
  auto note = [&](std::string s) { out.notes.push_back(std::move(s)); };
  const int64_t batch = GraphBatch(g);
  if (batch <= 0) return absl::InvalidArgumentError("the graph has no batched input");
  if (o.mode == Mode::kStages && o.stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a pipeline needs at least 1 stage, got ", o.stages));
  }
  if (o.microbatches < 0 || (o.microbatches > 0 && batch % o.microbatches != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatches ", o.microbatches, " must divide the batch ", batch));
  }
  const bool want_pipeline = o.mode == Mode::kAuto || (o.mode == Mode::kStages && o.stages > 1);
  // The SPMD plan: one stage on every device, the whole batch at once. When
  // it does not fit, a pipeline (microbatches hold fewer activations) still
  // may: its error is the answer only when no pipeline is found.
  absl::Status spmd_error;
  if (o.mode == Mode::kOff || o.plan_spmd || (o.mode == Mode::kStages && o.stages == 1)) {
    absl::StatusOr<synth::PlanResult> spmd = synth::PlanModel(g, cluster, o.stage_options);
    if (spmd.ok()) {
      out.spmd = *std::move(spmd);
      out.has_spmd = true;
      out.spmd_step_seconds = out.spmd.cost.total;
      out.step_seconds = out.spmd_step_seconds;
      out.microbatch_size = batch;
    } else if (want_pipeline && absl::IsResourceExhausted(spmd.status())) {
      spmd_error = spmd.status();
      note(absl::StrCat("the SPMD plan does not fit (", spmd_error.message(),
                        "); pipelines are searched without it"));
    } else {
      return spmd.status();
    }
  }
  auto finish = [&]() -> absl::StatusOr<PipelinePlan> {
    if (!spmd_error.ok() && !out.pipelined()) return spmd_error;
    out.planning_seconds = std::chrono::duration<double>(now() - start).count();
    return out;
  };
  if (!want_pipeline) {
    if (o.microbatches > 1) {
      note(absl::StrCat("one stage: the plan is the SPMD plan, which runs the batch of ", batch,
                        " whole; microbatches ", o.microbatches, " are not used"));
    }
    return finish();
  }

  // Units: nodes, split when more stages are asked for than nodes: each
  // node into `parts` (or its devices, when fewer), the fewest parts that
  // give the stages enough units (nodes of unequal sizes: the larger are
  // split further than an even share of the stages).
  std::vector<std::vector<int>> units;
  {
    const auto& nodes = cluster.node_groups();
    const int want = o.mode == Mode::kStages ? o.stages : 1;
    int largest = 1;
    for (const auto& node : nodes) largest = std::max(largest, static_cast<int>(node.size()));
    auto units_of = [&nodes](int parts) {
      int n = 0;
      for (const auto& node : nodes) n += std::min(parts, static_cast<int>(node.size()));
      return n;
    };
    int parts = 1;
    while (parts < largest && units_of(parts) < want) ++parts;
    for (const auto& node : nodes) {
      const int k = std::min<int>(parts, static_cast<int>(node.size()));
      for (int i = 0; i < k; ++i) {
        const size_t a = node.size() * i / k, b = node.size() * (i + 1) / k;
        units.emplace_back(node.begin() + a, node.begin() + b);
      }
    }
  }
  const int U = static_cast<int>(units.size());
  // STAGES N needs at least N layers: more than max_layers when N is.
  const Layers layers =
      FindLayers(g, o.mode == Mode::kStages ? std::max(o.max_layers, o.stages) : o.max_layers);
  const int L = layers.size();
  out.layers = L;
  const int max_stages = std::min(U, L);
  if (o.mode == Mode::kStages && o.stages > max_stages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot make ", o.stages, " stages: the model has ", L, L == 1 ? " layer" : " layers",
        " to cut between and the cluster ", U, U == 1 ? " group" : " groups",
        " of devices (nodes, split down to single devices)"));
  }
  if (max_stages < 2) {
    note(absl::StrCat(
        "no pipeline: ", U == 1 ? "the cluster is one node" : "the model has one layer",
        "; the plan is the SPMD plan"));
    return finish();
  }
  // Groups: contiguous unit ranges [u, v); a group of one device runs the
  // single-device program of its layers (ratio 1, no collectives).
  std::vector<std::vector<int>> group_of(U, std::vector<int>(U + 1, -1));
  std::vector<Group> groups;
  std::map<std::string, int> by_signature;
  std::vector<int> group_kind;  // group -> distinct signature index
  for (int u = 0; u < U; ++u) {
    for (int v = u + 1; v <= U; ++v) {
      Group gr;
      for (int k = u; k < v; ++k)
        gr.devices.insert(gr.devices.end(), units[k].begin(), units[k].end());
      gr.signature = Signature(cluster, gr.devices);
      auto [it, inserted] =
          by_signature.emplace(gr.signature, static_cast<int>(by_signature.size()));
      (void)inserted;
      group_of[u][v] = static_cast<int>(groups.size());
      group_kind.push_back(it->second);
      groups.push_back(std::move(gr));
    }
  }
  const int kinds = static_cast<int>(by_signature.size());
  std::vector<int> kind_group(kinds, -1);  // a representative group per kind
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (kind_group[group_kind[gi]] < 0) kind_group[group_kind[gi]] = static_cast<int>(gi);
  }
  // Alternatives: the synthesized stages also get the data-parallel program
  // of their group (it prices gradient sync once per microbatch in the
  // search, which a pipeline pays once per step).
  const int A = o.variant == Variant::kSynthesized ? 2 : 1;
  const int G = static_cast<int>(groups.size());
  for (int a = 1; a < A; ++a) {
    for (int gi = 0; gi < G; ++gi) {
      groups.push_back(groups[gi]);
      group_kind.push_back(group_kind[gi] + a * kinds);
    }
  }
  kind_group.resize(static_cast<size_t>(kinds) * A);
  for (int a = 1; a < A; ++a) {
    for (int k = 0; k < kinds; ++k) kind_group[a * kinds + k] = kind_group[k] + a * G;
  }
  // Microbatch counts.
  std::vector<int> counts;
  if (o.microbatches > 0) {
    counts.push_back(o.microbatches);
  } else {
    // The largest divisor in each octave (p/2, p]: the power of two where
    // it divides, so a batch of 96 is priced at 2, 4, ..., 32 and 48, as
    // many counts as powers of two would give. Powers of two alone left a
    // batch of 20 at 2 or 4 microbatches (the bubble of 5 or 10 never
    // priced) and an odd batch at none.
    const int64_t most = std::min<int64_t>(o.max_microbatches, batch);
    for (int64_t p = 2; p / 2 < most; p *= 2) {
      for (int64_t m = std::min(p, most); m > p / 2; --m) {
        if (batch % m == 0) {
          counts.push_back(static_cast<int>(m));
          break;
        }
      }
    }
    // STAGES N on a batch with none (1 sample, or a prime above
    // max_microbatches): the stages run it whole.
    if (counts.empty() && o.mode == Mode::kStages) counts.push_back(1);
  }
  if (counts.empty()) {
    note(absl::StrCat("no pipeline: the batch ", batch, " has no microbatch count from 2 to ",
                      o.max_microbatches));
    return finish();
  }
  // Graphs at each microbatch size. A count whose microbatch the graph
  // does not take (an input or a reshape that fixes the batch) is left out;
  // when none is left, STAGES N answers why and auto keeps the SPMD plan.
  std::vector<std::shared_ptr<const graph::Graph>> graphs;
  std::vector<std::vector<graph::TensorId>> boundaries;
  std::vector<int> taken, left_out;
  absl::Status rebatch_error;
  for (int m : counts) {
    auto gm = Rebatch(g, batch / m);
    if (!gm.ok()) {
      if (rebatch_error.ok()) rebatch_error = gm.status();
      left_out.push_back(m);
      continue;
    }
    taken.push_back(m);
    auto ptr = std::make_shared<const graph::Graph>(*std::move(gm));
    std::vector<graph::TensorId> b;
    for (graph::TensorId t : layers.boundary) {
      auto found = ptr->FindTensor(g.tensor(t).name);
      if (!found) return absl::InternalError("a boundary tensor vanished when rebatching");
      b.push_back(*found);
    }
    graphs.push_back(std::move(ptr));
    boundaries.push_back(std::move(b));
  }
  if (taken.empty()) {
    if (o.mode == Mode::kStages) return rebatch_error;
    note(absl::StrCat("no pipeline: ", rebatch_error.message(), "; the plan is the SPMD plan"));
    return finish();
  }
  if (!left_out.empty()) {
    note(absl::StrCat("microbatch counts ", absl::StrJoin(left_out, ", "),
                      " left out: ", rebatch_error.message()));
  }
  counts = std::move(taken);
  // Synthesize every (kind, microbatch count).
  synth::PlanOptions so = o.stage_options;
  so.progress = nullptr;
  if (o.variant == Variant::kDataParallel) so.baseline = synth::Baseline::kDpProportional;
  if (o.variant == Variant::kEvenSplit) so.baseline = synth::Baseline::kDpEven;
  const int C = static_cast<int>(counts.size());
  std::vector<Entry> entries(static_cast<size_t>(kinds) * A * C);
  std::vector<synth::PlanOptions> alt_options(A, so);
  if (A > 1) alt_options[1].baseline = synth::Baseline::kDpProportional;
  // Whether the time budget left something out (a stage synthesis, or part
  // of the stage search): a pipeline not found is then not one that does
  // not fit.
  bool budget_ran_out = false;
  {
    std::vector<int> jobs;
    for (int k = 0; k < kinds * A; ++k) {
      for (int c = 0; c < C; ++c) {
        if (batch / counts[c] >= static_cast<int64_t>(groups[kind_group[k]].devices.size())) {
          jobs.push_back(k * C + c);
        } else {
          entries[k * C + c].status = absl::FailedPreconditionError("microbatch below group size");
          entries[k * C + c].too_small = true;
        }
      }
    }
    std::mutex mu;
    size_t next = 0;
    std::atomic<int> cut{0};  // syntheses left out for the budget
    auto work = [&]() {
      for (;;) {
        int job;
        {
          std::lock_guard<std::mutex> lock(mu);
          if (next >= jobs.size()) return;
          job = jobs[next++];
        }
        const int k = job / C, c = job % C;
        Entry& e = entries[job];
        const double left = std::chrono::duration<double>(deadline - now()).count();
        if (left <= 0 || cancelled()) {
          e.status = absl::DeadlineExceededError("the time budget ran out first");
          ++cut;
          continue;
        }
        auto sub = cluster.Subset(groups[kind_group[k]].devices);
        if (!sub.ok()) {
          e.status = sub.status();
          continue;
        }
        e.cluster = std::make_unique<cost::ClusterModel>(*std::move(sub));
        e.coll = std::make_unique<cost::CollectiveModel>(*e.cluster);
        synth::PlanOptions ao = alt_options[k / kinds];
        ao.max_seconds = std::min(ao.max_seconds, left);
        // The synthesized alternative searches with gradient sync shared by
        // the step's microbatches.
        if (k / kinds == 0 && o.variant == Variant::kSynthesized) {
          ao.search_async_price = ao.search_async_price / counts[c];
        }
        auto r = synth::PlanModel(*graphs[c], *e.cluster, ao);
        if (!r.ok()) {
          e.status = r.status();
          continue;
        }
        e.plan = *std::move(r);
        e.status = PriceLayers(*graphs[c], layers, boundaries[c], counts[c], so.optimizer,
                               so.ignore_memory, &e);
      }
    };
    int threads = o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency());
    threads = std::max(1, std::min<int>(threads, static_cast<int>(jobs.size())));
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
    out.syntheses = static_cast<int>(jobs.size()) - cut.load();
    if (cancelled()) return absl::CancelledError("the pipeline search was cancelled");
    if (cut.load() > 0) {
      budget_ran_out = true;
      note(absl::StrCat("the time budget (", o.stage_options.max_seconds, " s) ran out: ",
                        cut.load(), " of ", jobs.size(),
                        " stage syntheses were left out of the search"));
    }
  }
  auto entry = [&](int gi, int c) -> const Entry* {
    if (gi < 0) return nullptr;
    const Entry& e = entries[group_kind[gi] * C + c];
    return e.status.ok() ? &e : nullptr;
  };

  // Stage times for layers [i, j) on group gi at count index c, stage s of S
  // (memory: in-flight microbatches), ratios r (the entry's when null).
  struct Priced {
    bool fits = false;
    double work = 0, forward = 0, sync = 0;
    std::vector<int64_t> memory;
  };
  const bool overlap = o.stage_options.overlap_communication;
  std::map<std::tuple<int, int, int>, double> exposed;  // (entry, i, j) -> ExposedSync
  auto price_stage = [&](int i, int j, int gi, int c, int s, int S) -> Priced {
    Priced p;
    const Entry* e = entry(gi, c);
    if (e == nullptr) return p;
    const int k = InFlightMicrobatches(s, S, counts[c]);
    const int n = e->cluster->size();
    p.work = e->micro_prefix[j] - e->micro_prefix[i];
    p.forward = e->forward_prefix[j] - e->forward_prefix[i];
    if (overlap) {
      auto [it, fresh] = exposed.try_emplace({group_kind[gi] * C + c, i, j}, 0.0);
      if (fresh) {
        it->second = ExposedSync(*graphs[c], *e, layers.begin[i], layers.begin[j], e->plan.ratios);
      }
      p.sync = it->second;
    } else {
      p.sync = e->sync_prefix[j] - e->sync_prefix[i] + e->overhead;
    }
    p.fits = e->max_in_flight[i][j] >= k;
    for (int d = 0; d < n; ++d) {
      p.memory.push_back(synth::ToBytes(e->static_prefix[j][d] - e->static_prefix[i][d] +
                                        (k + 1) * (e->act_prefix[j][d] - e->act_prefix[i][d])));
    }
    return p;
  };
  // Every transfer between stages (an activation or its gradient, per
  // microbatch) pays the cluster's calibrated handoff stall as latency.
  const double handoff = cluster.pipeline_transfer_overhead_seconds();
  // The transfer after layer j-1 (boundary j-1) from group ga to gb.
  auto transfer = [&](int j, int ga, int gb, int c) -> Transfer {
    const Entry* a = entry(ga, c);
    const Entry* b = entry(gb, c);
    const graph::Graph& gm = *graphs[c];
    const double bytes = static_cast<double>(gm.tensor(boundaries[c][j - 1]).type.bytes());
    return PriceTransfer(bytes, MinBandwidth(cluster, groups[ga].devices, groups[gb].devices),
                         MaxLatency(cluster, groups[ga].devices, groups[gb].devices) + handoff, *a,
                         a->boundary_form[j - 1], *b, b->boundary_form[j - 1]);
  };
  // A full assignment priced exactly.
  struct Candidate {
    std::vector<StageChoice> stages;
    int c = 0;
    double step = INFINITY, bubble = 0;
    std::vector<StageTimes> times;
  };
  auto evaluate = [&](const std::vector<StageChoice>& st, int c) -> Candidate {
    Candidate cand;
    cand.stages = st;
    cand.c = c;
    const int S = static_cast<int>(st.size());
    for (int s = 0; s < S; ++s) {
      const int gi = st[s].group;
      Priced p = price_stage(st[s].first_layer, st[s].end_layer, gi, c, s, S);
      if (!p.fits) return cand;
      StageTimes t;
      t.forward = p.forward;
      t.backward = p.work - p.forward;
      t.sync = p.sync;
      if (s + 1 < S) {
        const int gb = st[s + 1].group;
        // A group that cannot take this count (its microbatch is smaller
        // than the group) has no program to hand over to.
        if (entry(gb, c) == nullptr) return cand;
        Transfer x = transfer(st[s].end_layer, gi, gb, c);
        t.send = x.send_sender + x.send_receiver;
        t.gradient = x.grad_sender + x.grad_receiver;
      }
      cand.times.push_back(t);
    }
    auto sim = Simulate1F1B(cand.times, counts[c]);
    if (sim.ok()) {
      cand.step = sim->step;
      cand.bubble = sim->bubble;
    }
    return cand;
  };
  Candidate best;
  auto consider = [&](Candidate c) {
    if (c.step < best.step) best = std::move(c);
  };
  // The stage search polls the budget and the cancellation between its
  // DPs (one per microbatch count, stage count and bottleneck): once the
  // budget is spent the best pipeline priced so far stands.
  bool search_cut = false, search_cancelled = false;
  auto stop_search = [&] {
    search_cut = search_cut || now() >= deadline;
    search_cancelled = search_cancelled || cancelled();
    return search_cut || search_cancelled;
  };

  std::vector<int> stage_counts;
  if (o.mode == Mode::kStages) {
    stage_counts.push_back(o.stages);
  } else {
    for (int S = 2; S <= max_stages; ++S) stage_counts.push_back(S);
  }
  if (o.variant == Variant::kEvenSplit) {
    // One stage per unit (or the asked count of equal unit runs; in auto,
    // one per layer when there are fewer layers than units), equal numbers
    // of layers.
    for (int S : stage_counts) {
      if (o.mode == Mode::kAuto && S != max_stages) continue;
      for (int c = 0; c < C; ++c) {
        std::vector<StageChoice> st;
        for (int s = 0; s < S; ++s) {
          st.push_back({L * s / S, L * (s + 1) / S, U * s / S, U * (s + 1) / S,
                        group_of[U * s / S][U * (s + 1) / S]});
        }
        consider(evaluate(st, c));
      }
    }
  } else {
    // Alpa-style: per bottleneck candidate t_max, a DP over (stage, layer,
    // unit) minimising the stages' sum.
    for (int c = 0; c < C && !stop_search(); ++c) {
      const int M = counts[c];
      std::vector<double> boundary_bytes;
      for (graph::TensorId t : boundaries[c]) {
        boundary_bytes.push_back(static_cast<double>(graphs[c]->tensor(t).type.bytes()));
      }
      // Links from each group to each unit.
      std::vector<std::vector<double>> link_bw(groups.size(), std::vector<double>(U + 1, INFINITY));
      std::vector<std::vector<double>> link_lat(groups.size(), std::vector<double>(U + 1, 0));
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        for (int v = 0; v < U; ++v) {
          link_bw[gi][v] = MinBandwidth(cluster, groups[gi].devices, units[v]);
          link_lat[gi][v] = MaxLatency(cluster, groups[gi].devices, units[v]) + handoff;
        }
      }
      // Stage work of every (range, group) for the candidate list.
      std::vector<double> values;
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        const Entry* e = entry(static_cast<int>(gi), c);
        if (e == nullptr) continue;
        for (int i = 0; i < L; ++i) {
          double w = 0;
          for (int j = i + 1; j <= L; ++j) {
            w += e->micro[j - 1];
            values.push_back(w);
          }
        }
      }
      if (values.empty()) continue;
      // A link can be the bottleneck too.
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        const Entry* e = entry(static_cast<int>(gi), c);
        if (e == nullptr) continue;
        for (int v = 0; v < U; ++v) {
          if (!std::isfinite(link_bw[gi][v])) continue;
          for (size_t j = 0; j < boundary_bytes.size(); ++j) {
            const double bytes = boundary_bytes[j];
            const double link = link_lat[gi][v] + bytes / link_bw[gi][v];
            const double t =
                link + (e->boundary_form[j].is_partial() ? e->coll->AllReduce(bytes) : 0);
            if (std::isfinite(t)) values.push_back(t);
          }
        }
      }
      std::sort(values.begin(), values.end());
      values.erase(std::unique(values.begin(), values.end()), values.end());
      const size_t kMaxCandidates = 48;
      std::vector<double> tmax;
      if (values.size() <= kMaxCandidates) {
        tmax = values;
      } else {
        for (size_t q = 0; q < kMaxCandidates; ++q) {
          tmax.push_back(values[(values.size() - 1) * q / (kMaxCandidates - 1)]);
        }
      }
      for (int S : stage_counts) {
        for (double cap : tmax) {
          if (stop_search()) break;
          if ((M - 1) * cap >= best.step) break;
          // F[s][i][u]: best sum placing layers [0, i) on units [0, u) in s
          // stages; choice for reconstruction.
          const double kInf = INFINITY;
          std::vector<std::vector<std::vector<double>>> F(
              S + 1, std::vector<std::vector<double>>(L + 1, std::vector<double>(U + 1, kInf)));
          std::vector<std::vector<std::vector<std::array<int, 3>>>> from(
              S + 1, std::vector<std::vector<std::array<int, 3>>>(
                         L + 1, std::vector<std::array<int, 3>>(U + 1, {-1, -1, -1})));
          F[0][0][0] = 0;
          for (int s = 0; s < S; ++s) {
            for (int i = 0; i < L; ++i) {
              for (int u = 0; u < U; ++u) {
                if (F[s][i][u] == kInf) continue;
                const int rest = S - s - 1;
                for (int v = u + 1; v <= U - rest; ++v) {
                  for (int a = 0; a < A; ++a) {
                    const int gi = group_of[u][v] < 0 ? -1 : group_of[u][v] + a * G;
                    const Entry* e = entry(gi, c);
                    if (e == nullptr) continue;
                    for (int j = i + 1; j <= L - rest; ++j) {
                      if (rest == 0 && (j != L || v != U)) continue;
                      const double work = e->micro_prefix[j] - e->micro_prefix[i];
                      if (work > cap) break;
                      if (e->max_in_flight[i][j] < InFlightMicrobatches(s, S, M)) continue;
                      double cost = work + (e->sync_prefix[j] - e->sync_prefix[i]) / S;
                      if (j < L) {
                        // Sender's part towards the next unit's devices.
                        const double bytes = boundary_bytes[j - 1];
                        const double link = link_lat[gi][v] + bytes / link_bw[gi][v];
                        const Form fa = e->boundary_form[j - 1];
                        const double send =
                            link + (fa.is_partial() ? e->coll->AllReduce(bytes) : 0);
                        const double grad =
                            link + (fa.is_partial() ? e->coll->Broadcast(bytes) : 0);
                        if (send > cap || grad > cap) continue;
                        cost += send + grad;
                      }
                      if (i > 0) {
                        const Form fb = e->boundary_form[i - 1];
                        if (!fb.is_sharded() && e->cluster->size() > 1) {
                          const double bytes = boundary_bytes[i - 1];
                          cost += e->coll->Broadcast(bytes) + e->coll->Reduce(bytes);
                        }
                      }
                      if (F[s][i][u] + cost < F[s + 1][j][v]) {
                        F[s + 1][j][v] = F[s][i][u] + cost;
                        from[s + 1][j][v] = {i, u, gi};
                      }
                    }
                  }
                }
              }
            }
          }
          if (F[S][L][U] == kInf) continue;
          std::vector<StageChoice> st(S);
          int j = L, v = U;
          for (int s = S; s >= 1; --s) {
            auto [i, u, gi] = from[s][j][v];
            st[s - 1] = {i, j, u, v, gi};
            j = i;
            v = u;
          }
          consider(evaluate(st, c));
        }
      }
    }
  }
  if (search_cancelled || cancelled()) {
    return absl::CancelledError("the pipeline search was cancelled");
  }
  if (search_cut) {
    budget_ran_out = true;
    if (!best.stages.empty()) {
      note(absl::StrCat("the time budget (", o.stage_options.max_seconds,
                        " s) ran out during the stage search: the plan is the best pipeline "
                        "priced by then"));
    }
  }
  for (const Entry& e : entries) {
    budget_ran_out = budget_ran_out || absl::IsDeadlineExceeded(e.status);
  }
  if ((best.stages.empty() || !std::isfinite(best.step)) && budget_ran_out) {
    const std::string what =
        o.mode == Mode::kStages ? absl::StrCat("any ", o.stages, "-stage pipeline") : "a pipeline";
    const std::string budget = absl::StrCat("the time budget (", o.stage_options.max_seconds,
                                            " s) ran out before ", what, " was priced");
    if (o.mode == Mode::kStages) {
      return absl::DeadlineExceededError(absl::StrCat(budget, "; give it more time (max_seconds)"));
    }
    if (!spmd_error.ok()) {
      return absl::DeadlineExceededError(
          absl::StrCat(budget, ", and the SPMD plan does not fit: ", spmd_error.message()));
    }
    note(absl::StrCat(budget, "; the plan is the SPMD plan"));
    return finish();
  }
  if (best.stages.empty() || !std::isfinite(best.step)) {
    std::string why;
    for (const Entry& e : entries) {
      if (!e.status.ok() && e.status.code() != absl::StatusCode::kFailedPrecondition) {
        why = absl::StrCat(": a stage synthesis failed: ", e.status.message());
        break;
      }
    }
    bool all_too_small = true;
    for (const Entry& e : entries) all_too_small = all_too_small && e.too_small;
    if (why.empty() && all_too_small) {
      size_t smallest = units.front().size();
      for (const auto& u : units) smallest = std::min(smallest, u.size());
      const int64_t most = batch / counts.front();
      why = absl::StrCat(": microbatches of ", most, most == 1 ? " sample" : " samples",
                         counts.size() > 1 ? " or fewer" : "",
                         " are smaller than every group of devices (the smallest has ", smallest,
                         " devices; a device needs at least one sample)");
    }
    if (o.mode == Mode::kStages) {
      return absl::FailedPreconditionError(
          absl::StrCat("no ", o.stages, "-stage pipeline fits",
                       why.empty() ? " (memory or microbatches smaller than groups)" : why));
    }
    note(absl::StrCat("no pipeline fits", why, "; the plan is the SPMD plan"));
    return finish();
  }
  // Per-stage ratio LPs (M microbatches + sync) for the chosen stages.
  const int c = best.c;
  const int M = counts[c];
  const int S = static_cast<int>(best.stages.size());
  std::vector<StagePlan> stages;
  std::vector<StageTimes> times = best.times;
  std::vector<StagePlan> lp_stages;
  std::vector<StageTimes> lp_times = best.times;
  for (int s = 0; s < S; ++s) {
    const StageChoice& ch = best.stages[s];
    const int gi = ch.group;
    const Entry& e = *entry(gi, c);
    const int n = e.cluster->size();
    StagePlan sp;
    sp.first_layer = ch.first_layer;
    sp.end_layer = ch.end_layer;
    sp.begin_op = layers.begin[ch.first_layer];
    sp.end_op = layers.begin[ch.end_layer];
    sp.devices = groups[gi].devices;
    sp.program = SubProgram(e.plan.program, sp.begin_op, sp.end_op, Part::kAll, n);
    sp.ratios = e.plan.ratios;
    sp.in_flight = InFlightMicrobatches(s, S, M);
    if (ch.first_layer > 0) {
      sp.input_tensor = boundaries[c][ch.first_layer - 1];
      sp.input_form = e.boundary_form[ch.first_layer - 1];
    }
    if (ch.end_layer < L) {
      sp.output_tensor = boundaries[c][ch.end_layer - 1];
      sp.output_form = e.boundary_form[ch.end_layer - 1];
    }
    sp.times = best.times[s];
    sp.memory_bytes = price_stage(ch.first_layer, ch.end_layer, gi, c, s, S).memory;
    StagePlan lp = sp;
    // The stage LPs share what is left of the budget (at most 10 s each);
    // once it is spent the stages keep the search's ratios.
    const double lp_left = std::chrono::duration<double>(deadline - now()).count();
    if (o.variant != Variant::kEvenSplit && lp_left > 0 && !cancelled()) {
      // minimise M * micro(r) + sync(r) subject to memory at sp.in_flight.
      const graph::Graph& gm = *graphs[c];
      Program micro = SubProgram(e.plan.program, sp.begin_op, sp.end_op, Part::kMicro, n);
      Program sync = SubProgram(e.plan.program, sp.begin_op, sp.end_op, Part::kSync, n);
      AssignBuckets(gm, e, &sync);
      ratios::RatioLpRequest req;
      req.num_devices = n;
      if (overlap) {
        // M - 1 microbatches, then the last with its synchronisation behind
        // it (ExposedSync's critical path).
        if (M > 1) {
          synth::AddProgramTerms(micro, &req);
          for (ratios::CostTerm& t : req.terms) t.weight *= M - 1;
        }
        Program all = sp.program;
        AssignBuckets(gm, e, &all);
        Overlapped(e, &all);
        synth::AddProgramTerms(all, &req);
      } else {
        synth::AddProgramTerms(micro, &req);
        for (ratios::CostTerm& t : req.terms) t.weight *= M;
        synth::AddProgramTerms(sync, &req);
      }
      if (!so.ignore_memory) {
        Program outputs = sp.program;
        for (synth::OpStep& st : outputs.steps) st.loads.clear();
        // With more than one microbatch the stage sums their gradients in
        // one more buffer (executor/train/pipeline.h).
        ratios::MemoryConstraint all =
            synth::MemoryModel(gm, *e.cluster, sp.program, so.optimizer, M > 1 ? 1.0 : 0.0);
        ratios::MemoryConstraint act = synth::MemoryModel(gm, *e.cluster, outputs, so.optimizer);
        for (int d = 0; d < n; ++d) {
          all.coef[0][d] += sp.in_flight * act.coef[0][d];
          all.constant[d] += sp.in_flight * act.constant[d];
        }
        req.memory = all;
      }
      req.time_limit_seconds = std::min(10.0, lp_left);
      auto sol = ratios::SolveRatioLp(req);
      if (sol.ok()) {
        lp.ratios = sol->ratios[0];
        const double work = synth::EvaluateProgram(micro, lp.ratios).total;
        lp.times.forward = work * ForwardShare(micro, lp.ratios);
        lp.times.backward = work - lp.times.forward;
        lp.times.sync = overlap ? ExposedSync(gm, e, sp.begin_op, sp.end_op, lp.ratios)
                                : synth::EvaluateProgram(sync, lp.ratios).total + e.overhead;
        ratios::MemoryConstraint m = req.memory ? *req.memory : ratios::MemoryConstraint();
        if (req.memory) lp.memory_bytes = synth::MemoryAt(m, lp.ratios);
        lp_times[s] = lp.times;
      }
    }
    stages.push_back(std::move(sp));
    lp_stages.push_back(std::move(lp));
  }
  auto sim = Simulate1F1B(times, M);
  auto lp_sim = Simulate1F1B(lp_times, M);
  HAP_RETURN_IF_ERROR(sim.status());
  HAP_RETURN_IF_ERROR(lp_sim.status());
  const bool use_lp = lp_sim->step < sim->step * (1 - 1e-9);
  const double step = use_lp ? lp_sim->step : sim->step;
  if (o.mode == Mode::kAuto && out.has_spmd && step >= out.spmd_step_seconds) {
    note(absl::StrCat("no pipeline is predicted faster than the SPMD plan (best: ", S, " stages, ",
                      M, " microbatches, ", step, " s against ", out.spmd_step_seconds, " s)"));
    return finish();
  }
  out.stages = use_lp ? std::move(lp_stages) : std::move(stages);
  out.step_seconds = step;
  out.bubble_seconds = use_lp ? lp_sim->bubble : sim->bubble;
  out.microbatches = M;
  out.microbatch_size = batch / M;
  out.microbatch_graph = graphs[c];
  out.overlap = overlap;
  // What cut the chosen stages' syntheses short (a budget that ran out:
  // their programs are the best found), once per note.
  std::vector<std::pair<std::string, std::vector<int>>> stage_notes;
  for (int s = 0; s < S; ++s) {
    for (const std::string& n : entry(best.stages[s].group, c)->plan.notes) {
      auto it = std::find_if(stage_notes.begin(), stage_notes.end(),
                             [&n](const auto& x) { return x.first == n; });
      if (it == stage_notes.end()) it = stage_notes.insert(stage_notes.end(), {n, {}});
      if (it->second.empty() || it->second.back() != s) it->second.push_back(s);
    }
  }
  for (const auto& [n, at] : stage_notes) {
    note(absl::StrCat(at.size() > 1 ? "stages " : "stage ", absl::StrJoin(at, ", "),
                      " (synthesis): ", n));
  }
  return finish();
}

}  // namespace hap::pipeline
