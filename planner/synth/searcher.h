// The synthesis search (search.h) inside: the state, the Searcher and its
// helpers. Internal to planner/synth. Its definitions, by seam:
//   search_transitions.cc  the instruction set as transitions of the search
//                          state: rules, form changes, parameter loads, costs
//   search_blocks.cc       the repeated-block search (cuts, block signatures,
//                          entry/exit forms, the DP over cuts)
//   search.cc              A* over the whole graph, the greedy bound, programs
//                          from states, and the public entry points
#ifndef HAP_PLANNER_SYNTH_SEARCHER_H_
#define HAP_PLANNER_SYNTH_SEARCHER_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "planner/graph/op_registry.h"
#include "planner/synth/gradients.h"
#include "planner/synth/search.h"

namespace hap::synth::internal {

using graph::OpId;
using graph::TensorId;
using graph::TensorKind;

// A live tensor: up to two forms (produced + one communicated).
struct Live {
  TensorId tensor;
  int8_t forms[2];
  int8_t nforms;
  bool communicated;

  bool Has(Form f) const {
    for (int i = 0; i < nforms; ++i) {
      if (forms[i] == f.raw()) return true;
    }
    return false;
  }
};

// The cost model's method for a program's (the dual keeps the method).
inline cost::Method CostMethod(Method m) {
  return m == Method::kGrouped ? cost::Method::kGrouped : cost::Method::kPadded;
}

// Appends a live tensor's forms (order-free) and communicated flag.
inline void AppendForms(const Live& l, std::string* k) {
  int8_t a = l.forms[0], b = l.nforms > 1 ? l.forms[1] : -100;
  if (l.nforms > 1 && b < a) std::swap(a, b);
  k->push_back(static_cast<char>(a));
  k->push_back(static_cast<char>(b));
  k->push_back(l.communicated ? 1 : 0);
}

struct State {
  int step = 0;
  std::vector<Live> live;  // sorted by tensor id
  double g = 0;
  int parent = -1;
  int rule = -1;  // rule applied at step-1 to reach this state
};

struct Candidate {
  double f;
  int64_t seq;
  int index;
  bool operator>(const Candidate& o) const {
    if (f != o.f) return f > o.f;
    return seq > o.seq;
  }
};

class Searcher {
 public:
  Searcher(const graph::Graph& g, const cost::ClusterModel& c, const SearchOptions& o,
           std::vector<double> ratios)
      : g_(g),
        cluster_(c),
        coll_(c),
        opt_(o),
        ratios_(std::move(ratios)),
        n_(static_cast<int>(g.ops().size())) {
    Prepare();
  }

  absl::StatusOr<Program> Run();
  // The repeated-block search (see RunBlocked); nullopt when the graph has
  // no repeated blocks or the budget ran out (then Run() takes over).
  std::optional<Program> RunBlocked();
  // A complete program drawn at random from the same transitions
  // (RandomProgram in search.h): see its contract.
  absl::StatusOr<Program> RandomWalk(uint64_t seed);

 private:
  void Prepare();
  double Eval(const CostTerm& t) const { return cost::EvaluateTerm(t, ratios_); }
  // Runs rule `r` of the op at s.step. Returns false when it does not apply.
  bool Apply(const State& s, int r, State* out, double* cost, OpStep* detail) const;
  bool Convert(TensorId t, Form from, Form to, CommStep* out, double* cost) const;
  void AddUpdateCost(const graph::Tensor& p, bool sharded, SourceLoad* l) const;
  bool LoadParameter(TensorId t, Form need, const ShardRule& rule, int input, OpId op,
                     SourceLoad* out, double* cost) const;
  CostTerm Gather(double bytes, Method* m) const { return Uneven(bytes, true, m); }
  CostTerm Scatter(double bytes, Method* m) const { return Uneven(bytes, false, m); }
  CostTerm Uneven(double bytes, bool gather, Method* method) const;
  CostTerm WithoutCallOverhead(CostTerm t, Method m) const;
  std::string Key(const State& s) const;
  std::optional<int> Greedy(int from, int64_t node_budget);
  Program Reconstruct(int goal) const;
  // The program of `rules` applied from the empty state (costs unset).
  Program Replay(const std::vector<int>& rules) const;
  // FailedPrecondition naming the first op whose rules the options filter
  // out entirely.
  absl::Status EveryOpHasRules() const;
  bool OutOfBudget();
  std::vector<int> Cuts() const;
  std::string Signature(int a, int b) const;
  std::string EntryKey(const State& s) const;
  Program Finish(Program p, bool optimal);

  const graph::Graph& g_;
  const cost::ClusterModel& cluster_;
  cost::CollectiveModel coll_;
  const SearchOptions& opt_;
  std::vector<double> ratios_;
  const int n_;

  std::vector<std::vector<ShardRule>> rules_;      // per op (filtered)
  std::vector<std::vector<int>> rule_index_;       // position in RulesFor
  std::vector<std::vector<CostTerm>> compute_;     // per op, per rule
  std::vector<std::vector<double>> compute_eval_;  // compute + internal
  std::vector<std::vector<CostTerm>> internal_;    // per op, per rule
  std::vector<int> last_use_;                      // per tensor
  std::vector<bool> requires_grad_;
  std::vector<double> h_;  // per step

  std::vector<State> states_;
  int64_t expanded_ = 0;
  bool cut_ = false;
  // Set by RandomWalk only: LoadParameter then takes a storage option drawn
  // per parameter from this seed instead of the cheapest one.
  std::optional<uint64_t> random_seed_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace hap::synth::internal

#endif  // HAP_PLANNER_SYNTH_SEARCHER_H_
