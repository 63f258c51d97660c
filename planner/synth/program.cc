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

ProgramCost EvaluateProgram(const Program& p,
                            const std::vector<double>& ratios) {
  std::vector<bool> is_compute;
  std::vector<CostTerm> terms = p.Terms(&is_compute);
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
