#include "planner/synth/snap.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "planner/synth/planner.h"

namespace hap::synth {
namespace {

constexpr double kNone = -std::numeric_limits<double>::infinity();

// Devices with the same samples and the same numbers in every term and in
// memory; `first` orders the groups as their devices are ordered.
struct Group {
  int first = -1;
  int second = -1;  // the group's second device, -1 if it has one
  int64_t size = 0;
  int64_t samples = 0;
};

// A group's value in one term at samples - 1, samples, samples + 1.
struct Values {
  double less, same, more;
};

// The three largest `same` values of a term over groups, and whose.
struct Top {
  double value[3] = {kNone, kNone, kNone};
  int group[3] = {-1, -1, -1};

  void Add(double v, int g) {
    for (int s = 0; s < 3; ++s) {
      if (v > value[s]) {
        for (int t = 2; t > s; --t) {
          value[t] = value[t - 1];
          group[t] = group[t - 1];
        }
        value[s] = v;
        group[s] = g;
        return;
      }
    }
  }
  // The largest value of a group other than a and b (kNone if none).
  double Without(int a, int b) const {
    for (int s = 0; s < 3; ++s) {
      if (group[s] != a && group[s] != b) return value[s];
    }
    return kNone;
  }
};

class Snapper {
 public:
  explicit Snapper(const SnapRequest& q) : q_(q) {}

  SnapResult Run() {
    SnapResult out;
    const int n = static_cast<int>(q_.ratios.size());
    const std::vector<int64_t> base = ratios::RoundShardsAtLeastOne(q_.batch, q_.ratios);
    base_ = &base;
    if (q_.program->overlap) {
      // The step is the critical path (EvaluateProgram): its terms group
      // the devices, and each candidate is priced whole.
      path_.num_devices = n;
      AddProgramTerms(*q_.program, &path_);
      terms_ = path_.terms;
    } else {
      terms_ = MergeTerms(q_.program->BlockTerms());
    }
    Classify(base);
    out.groups = static_cast<int>(groups_.size());
    Tabulate();

    int best_a = -1, best_b = -1;  // -2: the rounded split itself
    double best = kNone;
    auto consider = [&](int a, int b, double cost) {
      if (best == kNone || cost < best * (1 - 1e-9)) {
        best = cost;
        best_a = a;
        best_b = b;
      }
    };
    if (bad_ == 0) consider(-2, -2, q_.program->overlap ? PathCost(-2, -2) : BaseCost());
    if (q_.neighbours) {
      out.complete = Moves([&](int a, int b) {
        ++out.moves_evaluated;
        if (Valid(a, b)) consider(a, b, q_.program->overlap ? PathCost(a, b) : MoveCost(a, b));
      });
    }
    if (best == kNone) return out;
    out.cost = best;
    out.ratios = Ratios(best_a, best_b);
    return out;
  }

 private:
  // The split after moving one sample from group a's device to group b's
  // (a < 0: none), as ratios.
  std::vector<double> Ratios(int a, int b) const {
    std::vector<int64_t> m = *base_;
    if (a >= 0) {
      --m[groups_[a].first];
      ++m[a == b ? groups_[a].second : groups_[b].first];
    }
    std::vector<double> r(m.size());
    for (size_t d = 0; d < m.size(); ++d) r[d] = Ratio(m[d]);
    return r;
  }

  // With overlap: the critical path at Ratios(a, b).
  double PathCost(int a, int b) const { return ratios::EvaluateObjective(path_, {Ratios(a, b)}); }

  double Ratio(int64_t samples) const {
    return static_cast<double>(samples) / static_cast<double>(q_.batch);
  }

  void Classify(const std::vector<int64_t>& base) {
    const int n = static_cast<int>(base.size());
    const ratios::MemoryConstraint* mem = q_.memory;
    absl::flat_hash_map<std::vector<double>, int> index;
    std::vector<double> key;
    for (int d = 0; d < n; ++d) {
      key.clear();
      key.push_back(static_cast<double>(base[d]));
      if (mem != nullptr) {
        key.push_back(mem->constant[d]);
        key.push_back(mem->coef[0][d]);
        key.push_back(mem->capacity[d]);
      }
      for (const CostTerm& t : terms_) {
        key.push_back(t.coef[d]);
        key.push_back(t.constant[d]);
      }
      auto [it, inserted] = index.try_emplace(key, groups_.size());
      if (inserted) {
        groups_.push_back({d, -1, 0, base[d]});
      } else if (groups_[it->second].second < 0) {
        groups_[it->second].second = d;
      }
      ++groups_[it->second].size;
    }
  }

  // A device of group g holding `samples`: none, or over its memory (the
  // memory model's bytes as MemoryAt counts them).
  bool Bad(int g, int64_t samples) const {
    if (samples < 1) return true;
    if (q_.memory == nullptr) return false;
    const int d = groups_[g].first;
    const ratios::MemoryConstraint& m = *q_.memory;
    const int64_t bytes = ToBytes(m.constant[d] + m.coef[0][d] * Ratio(samples));
    return bytes > ToBytes(m.capacity[d]);
  }

  void Tabulate() {
    const int ng = static_cast<int>(groups_.size());
    const size_t tabulated = q_.program->overlap ? 0 : terms_.size();  // PathCost
    values_.resize(tabulated * ng);
    tops_.assign(tabulated, Top());
    for (size_t k = 0; k < tabulated; ++k) {
      const CostTerm& t = terms_[k];
      for (int g = 0; g < ng; ++g) {
        const int d = groups_[g].first;
        const int64_t s = groups_[g].samples;
        Values& v = values_[k * ng + g];
        v.less = t.coef[d] * Ratio(s - 1) + t.constant[d];
        v.same = t.coef[d] * Ratio(s) + t.constant[d];
        v.more = t.coef[d] * Ratio(s + 1) + t.constant[d];
        tops_[k].Add(v.same, g);
      }
    }
    bad_ = 0;
    bad_less_.resize(ng);
    bad_same_.resize(ng);
    bad_more_.resize(ng);
    for (int g = 0; g < ng; ++g) {
      bad_less_[g] = Bad(g, groups_[g].samples - 1);
      bad_same_[g] = Bad(g, groups_[g].samples);
      bad_more_[g] = Bad(g, groups_[g].samples + 1);
      if (bad_same_[g]) bad_ += groups_[g].size;
    }
  }

  // Every device valid after one sample from a device of a to one of b.
  bool Valid(int a, int b) const {
    const int64_t after =
        bad_ - bad_same_[a] - bad_same_[b] + bad_less_[a] + bad_more_[b];
    return after == 0;
  }

  double BaseCost() const {
    double total = 0;
    for (size_t k = 0; k < terms_.size(); ++k) {
      total += std::max(0.0, tops_[k].value[0]) * terms_[k].weight;
    }
    return total;
  }

  double MoveCost(int a, int b) const {
    const size_t ng = groups_.size();
    // Devices of a (b) left at their samples besides the one that moves.
    const int64_t rest_a = groups_[a].size - (a == b ? 2 : 1);
    const int64_t rest_b = a == b ? 0 : groups_[b].size - 1;
    double total = 0;
    for (size_t k = 0; k < terms_.size(); ++k) {
      const Values& va = values_[k * ng + a];
      const Values& vb = values_[k * ng + b];
      double m = std::max(0.0, tops_[k].Without(a, b));
      if (rest_a > 0) m = std::max(m, va.same);
      if (rest_b > 0) m = std::max(m, vb.same);
      m = std::max(m, std::max(va.less, vb.more));
      total += m * terms_[k].weight;
    }
    return total;
  }

  // Calls f(a, b) for each group move in the order of its first device pair;
  // false when the deadline stopped it.
  template <typename F>
  bool Moves(F f) const {
    const int ng = static_cast<int>(groups_.size());
    int64_t calls = 0;
    auto out_of_time = [&]() {
      return q_.deadline.has_value() && (++calls & 255) == 0 &&
             std::chrono::steady_clock::now() >= *q_.deadline;
    };
    for (int a = 0; a < ng; ++a) {  // groups are in order of first device
      if (groups_[a].samples < 2) continue;
      bool self = groups_[a].second >= 0;
      for (int b = 0; b < ng; ++b) {
        if (b == a) continue;
        if (self && groups_[a].second < groups_[b].first) {
          if (out_of_time()) return false;
          f(a, a);
          self = false;
        }
        if (out_of_time()) return false;
        f(a, b);
      }
      if (self) {
        if (out_of_time()) return false;
        f(a, a);
      }
    }
    return true;
  }

  const SnapRequest& q_;
  const std::vector<int64_t>* base_ = nullptr;  // the rounded split
  ratios::RatioLpRequest path_;                 // with overlap: its terms and path
  std::vector<CostTerm> terms_;
  std::vector<Group> groups_;
  std::vector<Values> values_;  // [term][group]
  std::vector<Top> tops_;       // [term]
  int64_t bad_ = 0;             // devices bad at the rounded split
  std::vector<char> bad_less_, bad_same_, bad_more_;  // [group]
};

}  // namespace

SnapResult SnapToSamples(const SnapRequest& request) {
  return Snapper(request).Run();
}

}  // namespace hap::synth
