#include "planner/synth/program.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "planner/cost/collectives.h"

namespace hap::synth {

const char* CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllGather:
      return "all-gather";
    case Collective::kReduceScatter:
      return "reduce-scatter";
    case Collective::kAllReduce:
      return "all-reduce";
    case Collective::kAllToAll:
      return "all-to-all";
    case Collective::kSlice:
      return "slice";
    case Collective::kZeroOut:
      return "zero-out";
  }
  return "?";
}

const char* MethodName(Method m) {
  switch (m) {
    case Method::kNone:
      return "";
    case Method::kPadded:
      return "padded";
    case Method::kGrouped:
      return "grouped";
  }
  return "?";
}

const char* StorageName(ParamStorage s) {
  switch (s) {
    case ParamStorage::kReplicated:
      return "replicated";
    case ParamStorage::kSharded:
      return "sharded";
    case ParamStorage::kZero:
      return "zero";
  }
  return "?";
}

namespace {

bool IsZero(const CostTerm& t) {
  for (size_t i = 0; i < t.coef.size(); ++i) {
    if (t.coef[i] != 0) return false;
  }
  for (size_t i = 0; i < t.constant.size(); ++i) {
    if (t.constant[i] != 0) return false;
  }
  return true;
}

// dst += f x src, coefficient by coefficient.
void AddInto(CostTerm* dst, const CostTerm& src, double f) {
  for (size_t i = 0; i < src.coef.size() && i < dst->coef.size(); ++i) {
    dst->coef[i] += f * src.coef[i];
  }
  for (size_t i = 0; i < src.constant.size() && i < dst->constant.size(); ++i) {
    dst->constant[i] += f * src.constant[i];
  }
}

// blocks[t.segment] += f x t (a block per segment, made on first use).
void Accumulate(std::map<int, CostTerm>* blocks, const CostTerm& t, double f) {
  if (IsZero(t) || f == 0) return;
  CostTerm& b = (*blocks)[t.segment];
  if (b.coef.empty()) {
    b.segment = t.segment;
    b.coef.assign(t.coef.size(), 0);
    b.constant.assign(t.constant.size(), 0);
  }
  AddInto(&b, t, f);
}

// Compute terms summed per segment until a collective that synchronises.
class Blocks {
 public:
  void Compute(const CostTerm& t, double fraction) {
    Accumulate(&open_, t, fraction * t.weight);
  }
  void Communication(const CostTerm& t) {
    if (IsZero(t)) return;
    Close();
    items_.push_back({t, false});
  }
  // The terms in order; the open block (the end of the step) joins the
  // step's first block, which the next step continues.
  std::vector<CostTerm> Finish(std::vector<bool>* is_compute) {
    if (first_ >= 0) {
      for (size_t i = first_; i < items_.size() && items_[i].compute; ++i) {
        auto it = open_.find(items_[i].term.segment);
        if (it == open_.end()) continue;
        AddInto(&items_[i].term, it->second, 1.0);
        open_.erase(it);
      }
    }
    Close();  // what found no first block of its segment
    std::vector<CostTerm> out;
    for (Item& it : items_) {
      out.push_back(std::move(it.term));
      if (is_compute) is_compute->push_back(it.compute);
    }
    return out;
  }

 private:
  struct Item {
    CostTerm term;
    bool compute;
  };
  void Close() {
    if (open_.empty()) return;
    if (first_ < 0) first_ = static_cast<int>(items_.size());
    for (auto& [segment, t] : open_) items_.push_back({std::move(t), true});
    open_.clear();
  }
  std::map<int, CostTerm> open_;
  std::vector<Item> items_;
  int first_ = -1;  // the step's first block
};


// The step in execution order, as the lowering runs it (overlap off) or
// with asynchronous collectives (overlap on).
enum class ItemKind { kCompute, kBlocking, kLaunch, kWait };
struct StepItem {
  ItemKind kind;
  const CostTerm* term = nullptr;
  double fraction = 1;
  int id = -1;  // launch ordinal (kLaunch: its own, kWait: the one awaited)
};

bool IsZero3(const SourceLoad& l) {
  return l.storage == ParamStorage::kZero && !l.gather_once;
}

std::vector<StepItem> StepItems(const Program& p, bool overlap) {
  std::vector<StepItem> out;
  int launches = 0;
  auto compute = [&](const CostTerm& t, double f) {
    out.push_back({ItemKind::kCompute, &t, f});
  };
  auto blocking = [&](const CostTerm& t) { out.push_back({ItemKind::kBlocking, &t}); };
  auto launch = [&](const CostTerm& t) {
    out.push_back({ItemKind::kLaunch, &t, 1, launches});
    return launches++;
  };
  auto wait = [&](int id) { out.push_back({ItemKind::kWait, nullptr, 1, id}); };
  const bool bucketed = !p.buckets.empty();
  const int n = static_cast<int>(p.steps.size());
  // Parameters gathered once, before forward.
  for (const OpStep& s : p.steps) {
    for (const SourceLoad& l : s.loads) {
      if (l.gather_once && !l.costs.empty()) blocking(l.costs[0]);
    }
  }
  // ZeRO-3 gathers (costs[0] forward, costs[1] backward): with overlap each
  // op's are started when the previous parameter-holding op waits for its
  // own (one ahead), and waited for just before the op.
  std::vector<int> zsteps;
  for (int k = 0; k < n; ++k) {
    for (const SourceLoad& l : p.steps[k].loads) {
      if (IsZero3(l) && !l.costs.empty()) {
        zsteps.push_back(k);
        break;
      }
    }
  }
  std::vector<int> awaited(n, -1);  // the last gather started for step k
  auto prefetch = [&](int k, size_t index) {
    for (const SourceLoad& l : p.steps[k].loads) {
      if (IsZero3(l) && l.costs.size() > index) awaited[k] = launch(l.costs[index]);
    }
  };
  auto take = [&](int k) {
    if (awaited[k] >= 0) wait(awaited[k]);
    awaited[k] = -1;
  };
  size_t zi = 0;
  if (overlap && !zsteps.empty()) prefetch(zsteps[0], 0);
  for (int k = 0; k < n; ++k) {
    const OpStep& s = p.steps[k];
    if (overlap && zi < zsteps.size() && zsteps[zi] == k) {
      take(k);
      if (++zi < zsteps.size()) prefetch(zsteps[zi], 0);
    } else if (!overlap) {
      for (const SourceLoad& l : s.loads) {
        if (IsZero3(l) && !l.costs.empty()) blocking(l.costs[0]);
      }
    }
    for (const CommStep& c : s.comms) blocking(c.forward_cost);
    compute(s.compute, 1.0 / 3);
    blocking(s.internal);
  }
  // Backward, in reverse.
  zi = zsteps.size();
  if (overlap && zi > 0) prefetch(zsteps[zi - 1], 1);
  for (int k = n - 1; k >= 0; --k) {
    const OpStep& s = p.steps[k];
    if (overlap && zi > 0 && zsteps[zi - 1] == k) {
      take(k);
      if (--zi > 0) prefetch(zsteps[zi - 1], 1);
    }
    compute(s.compute, 2.0 / 3);
    for (const CommStep& c : s.comms) {
      if (c.has_backward) blocking(c.backward_cost);
    }
    for (const SourceLoad& l : s.loads) {
      if (l.sfb) {
        // Gathers of x and dy, then dW recomputed on every device.
        for (size_t i = 0; i < l.costs.size(); ++i) {
          if (i < 2) {
            blocking(l.costs[i]);
          } else {
            compute(l.costs[i], 1.0);
          }
        }
      } else if (IsZero3(l)) {
        // The backward gather (prefetched above with overlap), then the
        // gradient's reduce-scatter, started as soon as it is complete.
        for (size_t i = overlap ? 2 : 1; i < l.costs.size(); ++i) {
          if (overlap) {
            launch(l.costs[i]);
          } else {
            blocking(l.costs[i]);
          }
        }
      }
    }
    if (overlap) {
      for (const GradientBucket& b : p.buckets) {
        if (b.ready_step == k) launch(b.cost);
      }
    }
  }
  // After backward: the gradient buckets (in line without overlap), the
  // gathered-once reduce-scatters, other loads.
  if (!overlap) {
    for (const GradientBucket& b : p.buckets) blocking(b.cost);
  }
  for (const OpStep& s : p.steps) {
    for (const SourceLoad& l : s.loads) {
      if (l.sfb || IsZero3(l) || (bucketed && l.grad_allreduce)) continue;
      for (size_t i = l.gather_once ? 1 : 0; i < l.costs.size(); ++i) {
        blocking(l.costs[i]);
      }
    }
  }
  // The optimizer reads every gradient: wait for the last collective
  // started (the stream runs them in order).
  if (overlap && launches > 0) wait(launches - 1);
  for (const OpStep& s : p.steps) {
    for (const SourceLoad& l : s.loads) {
      for (const CostTerm& t : l.update_costs) compute(t, 1.0);
    }
  }
  if (!p.overhead.constant.empty()) compute(p.overhead, 1.0);
  return out;
}

// The step with overlap as a critical path over events (ratios::
// CriticalPath): each device computes from the last point all devices
// synchronised (a blocking collective or a wait) until the next; a
// collective starts when every device reached its launch and the
// communication stream is free (collectives run one at a time, in order);
// a wait ends when both the compute before it and the collective are done.
// The list is rotated to start after its last synchronisation, so the
// compute after it (optimizer, overhead) and the next step's forward form
// one block per device, as they run.
class Timeline {
 public:
  enum Kind : char { kComputeTerm, kCommTerm, kInterferenceTerm };

  explicit Timeline(const std::vector<double>& interference) : interference_(interference) {}

  void Run(std::vector<StepItem> all) {
    // Collectives that cost nothing (a free slice, a rule without an
    // internal gather) are no synchronisation; a wait for one waits for the
    // last real collective started before it (the stream runs in order), or
    // for nothing.
    std::vector<StepItem> items;
    std::map<int, int> alias;  // skipped launch -> the real one before it
    int last_real = -1;
    for (StepItem it : all) {
      const bool comm = it.kind == ItemKind::kBlocking || it.kind == ItemKind::kLaunch;
      if (comm && IsZero(*it.term)) {
        if (it.kind == ItemKind::kLaunch) alias[it.id] = last_real;
        continue;
      }
      if (it.kind == ItemKind::kLaunch) last_real = it.id;
      if (it.kind == ItemKind::kWait) {
        auto a = alias.find(it.id);
        if (a != alias.end()) {
          if (a->second < 0) continue;
          it.id = a->second;
        }
      }
      items.push_back(it);
    }
    int last_sync = -1;
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].kind == ItemKind::kWait || items[i].kind == ItemKind::kBlocking) {
        last_sync = static_cast<int>(i);
      }
    }
    std::rotate(items.begin(), items.begin() + (last_sync + 1), items.end());
    path_.num_events = 1;
    for (const StepItem& it : items) {
      switch (it.kind) {
        case ItemKind::kCompute:
          Accumulate(&open_, *it.term, it.fraction * it.term->weight);
          break;
        case ItemKind::kBlocking:
          Start(*it.term);
          sync_ = comm_free_;
          open_.clear();
          interfere_.clear();
          break;
        case ItemKind::kLaunch:
          Start(*it.term);
          finish_[it.id] = comm_free_;
          if (!interference_.empty()) {
            CostTerm slow = *it.term;
            for (size_t i = 0; i < slow.coef.size(); ++i) {
              slow.coef[i] *= interference_[i];
              slow.constant[i] *= interference_[i];
            }
            Accumulate(&interfere_, slow, it.term->weight);
          }
          break;
        case ItemKind::kWait: {
          const int w = NewEvent();
          Edge(sync_, w, Snapshot());
          auto f = finish_.find(it.id);
          if (f != finish_.end()) Edge(f->second, w, {});
          sync_ = w;
          open_.clear();
          interfere_.clear();
          break;
        }
      }
    }
    const int end = NewEvent();
    Edge(sync_, end, Snapshot());
    if (comm_free_ != sync_) Edge(comm_free_, end, {});
  }

  std::vector<CostTerm>& terms() { return terms_; }
  const std::vector<char>& kinds() const { return kinds_; }
  ratios::CriticalPath& path() { return path_; }

 private:
  int NewEvent() { return path_.num_events++; }
  void Edge(int from, int to, std::vector<int> terms) {
    path_.edges.push_back({from, to, std::move(terms), 0});
  }
  int AddTerm(const CostTerm& t, Kind kind) {
    terms_.push_back(t);
    kinds_.push_back(kind);
    return static_cast<int>(terms_.size()) - 1;
  }
  // The open blocks' terms so far (each device's compute since sync_).
  std::vector<int> Snapshot() {
    std::vector<int> out;
    for (const auto& [segment, t] : open_) out.push_back(AddTerm(t, kComputeTerm));
    for (const auto& [segment, t] : interfere_) out.push_back(AddTerm(t, kInterferenceTerm));
    return out;
  }
  // A collective on the communication stream; leaves comm_free_ at its end.
  void Start(const CostTerm& t) {
    const int start = NewEvent();
    Edge(sync_, start, Snapshot());
    if (comm_free_ != sync_) Edge(comm_free_, start, {});
    const int end = NewEvent();
    std::vector<int> terms;
    if (!IsZero(t)) terms.push_back(AddTerm(t, kCommTerm));
    Edge(start, end, std::move(terms));
    comm_free_ = end;
  }

  const std::vector<double>& interference_;
  std::vector<CostTerm> terms_;
  std::vector<char> kinds_;
  ratios::CriticalPath path_;
  std::map<int, CostTerm> open_, interfere_;
  std::map<int, int> finish_;  // launch ordinal -> its end event
  int sync_ = 0, comm_free_ = 0;
};

}  // namespace

std::vector<CostTerm> Program::BlockTerms(std::vector<bool>* is_compute) const {
  Blocks b;
  for (const StepItem& it : StepItems(*this, /*overlap=*/false)) {
    switch (it.kind) {
      case ItemKind::kCompute:
        b.Compute(*it.term, it.fraction);
        break;
      case ItemKind::kBlocking:
      case ItemKind::kLaunch:
        b.Communication(*it.term);
        break;
      case ItemKind::kWait:
        break;
    }
  }
  return b.Finish(is_compute);
}

void AddProgramTerms(const Program& p, ratios::RatioLpRequest* req) {
  if (!p.overlap) {
    for (CostTerm& t : MergeTerms(p.BlockTerms())) req->terms.push_back(std::move(t));
    return;
  }
  Timeline tl(p.interference);
  tl.Run(StepItems(p, /*overlap=*/true));
  const int offset = static_cast<int>(req->terms.size());
  for (CostTerm& t : tl.terms()) req->terms.push_back(std::move(t));
  ratios::CriticalPath path = std::move(tl.path());
  for (ratios::Precedence& e : path.edges) {
    for (int& k : e.terms) k += offset;
  }
  req->path = std::move(path);
}

ProgramCost EvaluateProgram(const Program& p,
                            const std::vector<double>& ratios) {
  ProgramCost c;
  if (p.overlap) {
    Timeline tl(p.interference);
    tl.Run(StepItems(p, /*overlap=*/true));
    std::vector<double> values, compute_only;
    for (size_t k = 0; k < tl.terms().size(); ++k) {
      const double v = cost::EvaluateTerm(tl.terms()[k], ratios);
      values.push_back(v);
      const bool comm = tl.kinds()[k] != Timeline::kComputeTerm;
      compute_only.push_back(comm ? 0 : v);
      if (tl.kinds()[k] == Timeline::kCommTerm) c.communication_busy += v;
    }
    c.total = ratios::EventTimes(tl.path(), values).back();
    c.compute = ratios::EventTimes(tl.path(), compute_only).back();
    c.communication = c.total - c.compute;
    return c;
  }
  std::vector<bool> is_compute;
  std::vector<CostTerm> terms = p.BlockTerms(&is_compute);
  for (size_t i = 0; i < terms.size(); ++i) {
    double v = cost::EvaluateTerm(terms[i], ratios);
    (is_compute[i] ? c.compute : c.communication) += v;
  }
  c.total = c.compute + c.communication;
  c.communication_busy = c.communication;
  return c;
}

void AssignGradientBuckets(
    const graph::Graph& g, int64_t bucket_bytes,
    const std::function<CostTerm(double bytes, const char** algorithm)>& bucket_cost,
    Program* p) {
  p->buckets.clear();
  p->bucket_bytes = bucket_bytes;
  GradientBucket open;
  auto close = [&]() {
    if (open.tensors.empty()) return;
    open.cost = bucket_cost(static_cast<double>(open.bytes), &open.algorithm);
    p->buckets.push_back(std::move(open));
    open = GradientBucket();
  };
  std::vector<bool> seen(g.tensors().size(), false);
  for (int k = static_cast<int>(p->steps.size()) - 1; k >= 0; --k) {
    for (const SourceLoad& l : p->steps[k].loads) {
      if (!l.grad_allreduce || seen[l.tensor]) continue;
      seen[l.tensor] = true;
      const int64_t bytes = g.tensor(l.tensor).type.bytes();
      // Compared without the sum: a tensor takes up to 2^62 bytes, and two
      // such pass INT64_MAX.
      if (!open.tensors.empty() && bytes > bucket_bytes - open.bytes) close();
      open.tensors.push_back(l.tensor);
      open.bytes += bytes;
      open.ready_step = k;
    }
  }
  close();
}

void ScheduleCommunication(const graph::Graph& g, const cost::CollectiveModel& coll,
                           const std::vector<double>& ratios, bool overlap, Program* p) {
  p->overlap = overlap;
  p->interference.clear();
  if (overlap) {
    for (const cost::DeviceModel& d : coll.cluster().devices()) {
      p->interference.push_back(1 - d.overlap_efficiency);
    }
  }
  const double wire = p->gradient_wire_scale;
  auto price = [&](double bytes, const char** algorithm) {
    const cost::CollectiveModel::Choice c = coll.AllReduceAlgorithm(bytes * wire);
    *algorithm = c.algorithm;
    return coll.Constant(coll.AllReduce(bytes * wire));
  };
  if (!overlap) {
    AssignGradientBuckets(g, kLoweringBucketBytes, price, p);
    return;
  }
  double best = INFINITY;
  int64_t best_bytes = kBucketCandidates[0];
  for (int64_t bytes : kBucketCandidates) {
    AssignGradientBuckets(g, bytes, price, p);
    const double t = EvaluateProgram(*p, ratios).total;
    if (t < best * (1 - 1e-12)) {
      best = t;
      best_bytes = bytes;
    }
  }
  AssignGradientBuckets(g, best_bytes, price, p);
}

std::vector<CostTerm> MergeTerms(const std::vector<CostTerm>& terms) {
  std::map<std::tuple<int, std::vector<double>, std::vector<double>>, size_t>
      index;
  std::vector<CostTerm> out;
  for (const CostTerm& t : terms) {
    if (IsZero(t)) continue;
    auto key = std::make_tuple(t.segment, t.coef, t.constant);
    auto it = index.find(key);
    if (it == index.end()) {
      index.emplace(key, out.size());
      out.push_back(t);
    } else {
      out[it->second].weight += t.weight;
    }
  }
  return out;
}

}  // namespace hap::synth
