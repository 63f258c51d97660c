// The logical splits of a program's sharded dimensions: a union-find over
// (tensor, dimension) pairs that one rule links (LinkDims), each class then
// laid out once over the ranks at the ratios (ShardLayout, lower.h), so that
// every tensor split along one class is split at the same offsets.
// Internal to planner/lower.
#ifndef HAP_PLANNER_LOWER_DIM_CLASSES_H_
#define HAP_PLANNER_LOWER_DIM_CLASSES_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <utility>
#include <vector>

#include "planner/graph/graph.h"
#include "planner/lower/lower.h"
#include "planner/ratios/ratio_lp.h"
#include "planner/synth/program.h"

namespace hap::lower::internal {

// Union-find over the sharded (tensor, dimension) pairs of a program; each
// class is one logical split (see lower.h).
class DimClasses {
 public:
  explicit DimClasses(const graph::Graph& g) : g_(g) {}

  int Node(graph::TensorId t, int dim) {
    auto [it, fresh] = id_.emplace(std::make_pair(t, dim), static_cast<int>(parent_.size()));
    if (fresh) {
      parent_.push_back(it->second);
      length_.push_back(g_.tensor(t).type.shape[dim]);
    }
    return it->second;
  }
  void Union(int a, int b) {
    a = Find(a);
    b = Find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);
  }
  // Node a's shards must be whole multiples of length / units (grouped MoE
  // routing: whole groups): its class's unit divides `units`.
  void Granule(int a, int64_t units) { granules_.push_back({a, units}); }
  void Solve(const std::vector<double>& ratios) {
    std::map<int, int64_t> gcd;
    for (size_t i = 0; i < parent_.size(); ++i) {
      int r = Find(static_cast<int>(i));
      gcd[r] = std::gcd(gcd[r], length_[i]);
    }
    for (auto [a, units] : granules_) {
      int r = Find(a);
      gcd[r] = std::gcd(gcd[r], units);
    }
    std::map<int, std::vector<int64_t>> units;
    for (auto& [root, g] : gcd) {
      // Every rank gets at least one unit where there are enough: kernels
      // then never see an empty shard (the planner's snap to whole samples
      // starts from the same split).
      units[root] = ratios::RoundShardsAtLeastOne(g, ratios);
    }
    layout_.assign(parent_.size(), {});
    for (size_t i = 0; i < parent_.size(); ++i) {
      int root = Find(static_cast<int>(i));
      int64_t scale = length_[i] / gcd[root];
      ShardLayout& l = layout_[i];
      int64_t off = 0;
      for (int64_t u : units[root]) {
        l.offsets.push_back(off);
        l.lengths.push_back(u * scale);
        off += u * scale;
      }
    }
  }
  const ShardLayout& Layout(graph::TensorId t, int dim) const { return layout_[id_.at({t, dim})]; }

 private:
  int Find(int a) {
    while (parent_[a] != a) a = parent_[a] = parent_[parent_[a]];
    return a;
  }
  const graph::Graph& g_;
  std::map<std::pair<graph::TensorId, int>, int> id_;
  std::vector<int> parent_;
  std::vector<int64_t> length_;
  std::vector<std::pair<int, int64_t>> granules_;
  std::vector<ShardLayout> layout_;
};

// Links the dimensions each step's rule shards alike (and grouped MoE
// routing's granule) in `dims`.
void LinkDims(const graph::Graph& g, const synth::Program& p, DimClasses& dims);

}  // namespace hap::lower::internal

#endif  // HAP_PLANNER_LOWER_DIM_CLASSES_H_
