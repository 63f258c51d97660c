#include "planner/synth/program.h"

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

std::vector<CostTerm> Program::Terms(std::vector<bool>* is_compute) const {
  std::vector<CostTerm> out;
  auto add = [&](const CostTerm& t, bool compute) {
    out.push_back(t);
    if (is_compute) is_compute->push_back(compute);
  };
  if (!overhead.constant.empty()) add(overhead, true);
  for (const OpStep& s : steps) {
    add(s.compute, true);
    for (const SourceLoad& l : s.loads) {
      for (const CostTerm& t : l.costs) add(t, false);
      for (const CostTerm& t : l.update_costs) add(t, true);
    }
    for (const CommStep& c : s.comms) {
      add(c.forward_cost, false);
      if (c.has_backward) add(c.backward_cost, false);
    }
  }
  return out;
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

// Compute terms summed per segment until a collective that synchronises.
class Blocks {
 public:
  void Compute(const CostTerm& t, double fraction) {
    if (IsZero(t) || fraction == 0) return;
    CostTerm& b = open_[t.segment];
    if (b.coef.empty()) {
      b.segment = t.segment;
      b.coef.assign(t.coef.size(), 0);
      b.constant.assign(t.constant.size(), 0);
    }
    const double f = fraction * t.weight;
    for (size_t i = 0; i < t.coef.size() && i < b.coef.size(); ++i) b.coef[i] += f * t.coef[i];
    for (size_t i = 0; i < t.constant.size() && i < b.constant.size(); ++i) {
      b.constant[i] += f * t.constant[i];
    }
  }
  void Communication(const CostTerm& t) {
    if (IsZero(t)) return;
    Close();
    items_.push_back({t, false});
  }
  // The terms in order; the open block joins the step's first one.
  std::vector<CostTerm> Finish(std::vector<bool>* is_compute) {
    std::map<int, CostTerm> tail = std::move(open_);
    open_.clear();
    if (first_ < 0) {
      open_ = std::move(tail);
      Close();
    } else {
      for (auto& [segment, t] : tail) {
        bool merged = false;
        for (size_t i = first_; i < items_.size() && items_[i].compute; ++i) {
          CostTerm& f = items_[i].term;
          if (f.segment != segment) continue;
          for (size_t k = 0; k < f.coef.size(); ++k) f.coef[k] += t.coef[k];
          for (size_t k = 0; k < f.constant.size(); ++k) f.constant[k] += t.constant[k];
          merged = true;
          break;
        }
        if (!merged) items_.push_back({std::move(t), true});
      }
    }
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

}  // namespace

std::vector<CostTerm> Program::BlockTerms(std::vector<bool>* is_compute) const {
  Blocks b;
  auto zero3 = [](const SourceLoad& l) {
    return l.storage == ParamStorage::kZero && !l.gather_once;
  };
  // Parameters gathered once, before forward.
  for (const OpStep& s : steps) {
    for (const SourceLoad& l : s.loads) {
      if (l.gather_once && !l.costs.empty()) b.Communication(l.costs[0]);
    }
  }
  for (const OpStep& s : steps) {
    for (const SourceLoad& l : s.loads) {
      if (zero3(l) && !l.costs.empty()) b.Communication(l.costs[0]);
    }
    for (const CommStep& c : s.comms) b.Communication(c.forward_cost);
    b.Compute(s.compute, 1.0 / 3);
  }
  for (auto s = steps.rbegin(); s != steps.rend(); ++s) {
    b.Compute(s->compute, 2.0 / 3);
    for (const CommStep& c : s->comms) {
      if (c.has_backward) b.Communication(c.backward_cost);
    }
    for (const SourceLoad& l : s->loads) {
      if (l.sfb) {
        // Gathers of x and dy, then dW recomputed on every device.
        for (size_t i = 0; i < l.costs.size(); ++i) {
          if (i < 2) {
            b.Communication(l.costs[i]);
          } else {
            b.Compute(l.costs[i], 1.0);
          }
        }
      } else if (zero3(l)) {
        for (size_t i = 1; i < l.costs.size(); ++i) b.Communication(l.costs[i]);
      }
    }
  }
  // After backward: the gradient bucket, reduce-scatters, other loads.
  for (const OpStep& s : steps) {
    for (const SourceLoad& l : s.loads) {
      if (l.sfb || zero3(l)) continue;
      for (size_t i = l.gather_once ? 1 : 0; i < l.costs.size(); ++i) {
        b.Communication(l.costs[i]);
      }
    }
  }
  for (const OpStep& s : steps) {
    for (const SourceLoad& l : s.loads) {
      for (const CostTerm& t : l.update_costs) b.Compute(t, 1.0);
    }
  }
  if (!overhead.constant.empty()) b.Compute(overhead, 1.0);
  return b.Finish(is_compute);
}

ProgramCost EvaluateProgram(const Program& p,
                            const std::vector<double>& ratios) {
  std::vector<bool> is_compute;
  std::vector<CostTerm> terms = p.BlockTerms(&is_compute);
  ProgramCost c;
  for (size_t i = 0; i < terms.size(); ++i) {
    double v = cost::EvaluateTerm(terms[i], ratios);
    (is_compute[i] ? c.compute : c.communication) += v;
  }
  c.total = c.compute + c.communication;
  return c;
}

std::vector<CostTerm> MergeTerms(const std::vector<CostTerm>& terms) {
  std::map<std::tuple<int, std::vector<double>, std::vector<double>>, size_t>
      index;
  std::vector<CostTerm> out;
  for (const CostTerm& t : terms) {
    bool zero = true;
    for (size_t i = 0; i < t.coef.size() && zero; ++i) {
      zero = t.coef[i] == 0 && t.constant[i] == 0;
    }
    if (zero) continue;
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
