#include "planner/cost/collectives.h"

#include <algorithm>
#include <cmath>

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
  return AllReduceOver(bytes, g, /*tree=*/false, /*latency=*/true);
}

double CollectiveModel::TreeAllReduce(double bytes,
                                      const std::vector<int>& g) const {
  return AllReduceOver(bytes, g, /*tree=*/true, /*latency=*/true);
}

double CollectiveModel::AllReduceOver(double bytes, const std::vector<int>& g,
                                      bool tree, bool latency) const {
  const int n = static_cast<int>(g.size());
  if (n < 2 || bytes <= 0) return 0;
  const double hops = tree ? std::ceil(std::log2(static_cast<double>(n))) : n - 1;
  const double volume = tree ? 2.0 : 2.0 * (n - 1) / n;
  return volume * bytes / cluster_.RingBandwidth(g) +
         (latency ? 2.0 * hops * cluster_.RingLatency(g) : 0.0);
}

double CollectiveModel::AllReduce(double bytes) const {
  if (bytes <= 0) return 0;
  return AllReduceAlgorithm(bytes).seconds +
         cluster_.collective_overhead_seconds();
}

CollectiveModel::Choice CollectiveModel::Cheapest(double bytes,
                                                  bool latency) const {
  Choice best;
  if (bytes <= 0) return best;
  best.seconds = INFINITY;
  auto consider = [&](const char* name, double seconds) {
    if (seconds < best.seconds) best = {name, seconds};
  };
  consider("ring", AllReduceOver(bytes, cluster_.all(), false, latency));
  consider("tree", AllReduceOver(bytes, cluster_.all(), true, latency));
  const auto& nodes = cluster_.node_groups();
  if (nodes.size() < 2) return best;
  // Hierarchical: reduce-scatter inside each node, all-reduce the 1/k slices
  // across nodes (k in parallel, one per local rank), all-gather inside.
  size_t kmin = nodes[0].size();
  double intra = 0;
  for (const auto& g : nodes) {
    kmin = std::min(kmin, g.size());
    // RS + AG = one AR
    intra = std::max(intra, AllReduceOver(bytes, g, false, latency));
  }
  // The leaders' ring or tree uses the slowest inter-node link; other local
  // ranks' cross the same class of links.
  std::vector<int> leaders;
  for (const auto& g : nodes) leaders.push_back(g[0]);
  const double slice = bytes / static_cast<double>(kmin);
  consider("hierarchical ring", intra + AllReduceOver(slice, leaders, false, latency));
  consider("hierarchical tree", intra + AllReduceOver(slice, leaders, true, latency));
  return best;
}

CollectiveModel::Choice CollectiveModel::AllReduceAlgorithm(
    double bytes) const {
  return Cheapest(bytes, /*latency=*/true);
}

double CollectiveModel::AllReduceTransfer(double bytes) const {
  // The cheapest algorithm's bandwidth term (a ring's, flat or
  // hierarchical: trees move no fewer bytes per link); the bucket pays the
  // latency once.
  return Cheapest(bytes, /*latency=*/false).seconds;
}

double CollectiveModel::Broadcast(double bytes) const {
  if (bytes <= 0) return 0;
  int n = cluster_.size();
  // Pipelined along a chain (n-1 hops of latency) or down a binary tree
  // (log2 n hops); the data crosses the slowest link once either way.
  const double hops = std::min<double>(
      n - 1, std::ceil(std::log2(static_cast<double>(n))));
  return bytes / ring_bw_ + hops * ring_lat_ + cluster_.collective_overhead_seconds();
}

double CollectiveModel::Reduce(double bytes) const { return Broadcast(bytes); }

CostTerm CollectiveModel::Sharded(double bytes, Method m, int segment,
                                  double grouped_eff) const {
  int n = cluster_.size();
  CostTerm t = Constant(0, segment);
  if (bytes <= 0) return t;
  // Flat ring over all devices, bottlenecked by its slowest link.
  double coef = (n - 1) * bytes / ring_bw_;
  double lat = (n - 1) * ring_lat_;
  double grouped = bytes / (grouped_eff * ring_bw_) + n * ring_lat_;
  const auto& nodes = cluster_.node_groups();
  if (nodes.size() > 1) {
    // Hierarchical: k rings of node peers carry the inter-node part (each
    // moves n-k shards), node rings the intra-node part (k-1 shards).
    size_t k = nodes[0].size();
    double intra_bw = 1e30, intra_lat = 0;
    for (const auto& g : nodes) {
      k = std::min(k, g.size());
      intra_bw = std::min(intra_bw, cluster_.RingBandwidth(g));
      intra_lat = std::max(intra_lat, cluster_.RingLatency(g));
    }
    std::vector<int> leaders;
    for (const auto& g : nodes) leaders.push_back(g[0]);
    double inter_bw = cluster_.RingBandwidth(leaders);
    double inter_lat = cluster_.RingLatency(leaders);
    double m_nodes = static_cast<double>(nodes.size());
    double kk = static_cast<double>(k);
    double h_coef = (kk - 1) * bytes / intra_bw + (n - kk) * bytes / inter_bw;
    double h_lat = (kk - 1) * intra_lat + (m_nodes - 1) * inter_lat;
    // Compare at an even split; both forms scale with the largest shard.
    if (h_coef / n + h_lat < coef / n + lat) {
      coef = h_coef;
      lat = h_lat;
    }
    double h_grouped = bytes * (n - kk) / n / (grouped_eff * inter_bw) +
                       bytes / (grouped_eff * intra_bw) + n * inter_lat;
    grouped = std::min(grouped, h_grouped);
  }
  // The grouped form is one call per rank (a broadcast or reduce each).
  const double ov = cluster_.collective_overhead_seconds();
  for (int i = 0; i < n; ++i) {
    if (m == Method::kPadded) {
      t.coef[i] = coef;
      t.constant[i] = lat + ov;
    } else {
      t.constant[i] = grouped + n * ov;
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
    t.constant[i] = (n - 1) * lat + cluster_.collective_overhead_seconds();
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
