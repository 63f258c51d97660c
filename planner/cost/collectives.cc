#include "planner/cost/collectives.h"

#include <algorithm>

namespace hap::cost {

CollectiveModel::CollectiveModel(const ClusterModel& cluster)
    : cluster_(cluster),
      ring_bw_(cluster.RingBandwidth(cluster.all())),
      ring_lat_(cluster.RingLatency(cluster.all())) {}

CostTerm CollectiveModel::Constant(double seconds, int segment) const {
  int n = cluster_.size();
  CostTerm t;
  t.segment = segment;
  t.coef.assign(n, 0);
  t.constant.assign(n, seconds);
  return t;
}

double CollectiveModel::RingAllReduce(double bytes,
                                      const std::vector<int>& g) const {
  int n = static_cast<int>(g.size());
  if (n < 2 || bytes <= 0) return 0;
  return 2.0 * (n - 1) / n * bytes / cluster_.RingBandwidth(g) +
         2.0 * (n - 1) * cluster_.RingLatency(g);
}

double CollectiveModel::AllReduce(double bytes) const {
  if (bytes <= 0) return 0;
  double ring = RingAllReduce(bytes, cluster_.all());
  const auto& nodes = cluster_.node_groups();
  if (nodes.size() < 2) return ring;
  // Hierarchical: reduce-scatter inside each node, all-reduce the 1/k slices
  // across nodes (k in parallel rings of node leaders), all-gather inside.
  size_t kmin = nodes[0].size();
  double intra = 0;
  for (const auto& g : nodes) {
    kmin = std::min(kmin, g.size());
    intra = std::max(intra, RingAllReduce(bytes, g));  // RS + AG = one AR
  }
  std::vector<int> leaders;
  for (const auto& g : nodes) leaders.push_back(g[0]);
  double inter = RingAllReduce(bytes / static_cast<double>(kmin), leaders);
  // Leaders' ring uses the slowest inter-node link; other local ranks' rings
  // cross the same class of links.
  return std::min(ring, intra + inter);
}

double CollectiveModel::Broadcast(double bytes) const {
  if (bytes <= 0) return 0;
  int n = cluster_.size();
  return bytes / ring_bw_ + (n - 1) * ring_lat_;
}

double CollectiveModel::Reduce(double bytes) const { return Broadcast(bytes); }

CostTerm CollectiveModel::Sharded(double bytes, Method m, int segment,
                                  double grouped_eff) const {
  int n = cluster_.size();
  CostTerm t = Constant(0, segment);
  if (bytes <= 0) return t;
  if (m == Method::kPadded) {
    for (int i = 0; i < n; ++i) {
      t.coef[i] = (n - 1) * bytes / ring_bw_;
      t.constant[i] = (n - 1) * ring_lat_;
    }
  } else {
    for (int i = 0; i < n; ++i) {
      t.constant[i] = bytes / (grouped_eff * ring_bw_) + n * ring_lat_;
    }
  }
  return t;
}

CostTerm CollectiveModel::AllGather(double bytes, Method m, int segment) const {
  return Sharded(bytes, m, segment, kGroupedEfficiency);
}

CostTerm CollectiveModel::ReduceScatter(double bytes, Method m,
                                        int segment) const {
  return Sharded(bytes, m, segment, kGroupedEfficiency);
}

CostTerm CollectiveModel::AllToAll(double bytes, int segment) const {
  int n = cluster_.size();
  CostTerm t = Constant(0, segment);
  if (bytes <= 0) return t;
  for (int i = 0; i < n; ++i) {
    // Device i's outgoing data over its own slowest link to a peer.
    double bw = 1e30, lat = 0;
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      bw = std::min(bw, cluster_.bandwidth(i, j));
      lat = std::max(lat, cluster_.latency(i, j));
    }
    t.coef[i] = bytes * (n - 1) / n / bw;
    t.constant[i] = (n - 1) * lat;
  }
  return t;
}

double EvaluateTerm(const CostTerm& t, const std::vector<double>& ratios) {
  double m = 0;
  for (size_t i = 0; i < t.coef.size(); ++i) {
    m = std::max(m, t.coef[i] * ratios[i] + t.constant[i]);
  }
  return m * t.weight;
}

}  // namespace hap::cost
