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
    AddInto(&b, t, fraction * t.weight);
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
    b.Communication(s.internal);
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
