// Collective communication costs (docs/design.md §8) over a ClusterModel:
// latency + bytes / bandwidth for ring, tree and hierarchical (intra-node,
// then inter-node) algorithms, bottlenecked by the slowest link each crosses.
//
// All-reduce, as NCCL does, picks by size and device count the cheapest of
//   ring:  2 (n-1)/n * S / bw + 2 (n-1) * lat      (bandwidth-optimal)
//   tree:  2 S / bw + 2 ceil(log2 n) * lat          (double binary tree,
//          pipelined: about the ring's bandwidth, logarithmic latency)
// flat over all devices or hierarchical (a ring reduce-scatter and
// all-gather inside each node, ring or tree across nodes on 1/k slices).
// nccl-tests' bus bandwidth of an all-reduce is S / t * 2 (n-1)/n: for
// large S these models keep it near the slowest link's bandwidth at any n,
// as published nccl-tests runs do (cost_test checks it from 16 to 2,048).
//
// Costs of collectives on sharded tensors depend on the sharding ratios b_i,
// so they are returned as a ratios::CostTerm, max_i(coef_i * b_i + const_i):
//   padded all-gather / reduce-scatter: every shard padded to the largest,
//     (n-1) steps of max_i(b_i) * bytes over the ring
//       = max_i((n-1) * bytes / bw * b_i + (n-1) * lat);
//   grouped (a broadcast / reduce per device inside one group call): the
//     data moved follows sum_i b_i = 1, at a lower effective bandwidth and
//     with a per-call overhead: bytes / (eff * bw) + n * lat;
//   all-to-all: device i sends about b_i * bytes * (n-1)/n.
// On several nodes, all-gather and reduce-scatter also have a hierarchical
// form (intra-node rings plus per-local-rank inter-node rings); the cheaper
// of flat and hierarchical is used.
// Ratio-independent collectives (all-reduce, broadcast, reduce of a full
// tensor) are a constant term.
//
// Thread-safety: immutable; safe to share.
#ifndef HAP_PLANNER_COST_COLLECTIVES_H_
#define HAP_PLANNER_COST_COLLECTIVES_H_

#include "planner/cost/cluster_model.h"
#include "planner/ratios/ratio_lp.h"

namespace hap::cost {

using ratios::CostTerm;

enum class Method { kPadded, kGrouped };

// Efficiency of grouped collectives relative to a ring's bandwidth (the
// reference profile measured 9.1 vs 9.5 GB/s all-gather, 8.8 vs 9.7 GB/s
// reduce-scatter).
inline constexpr double kGroupedEfficiency = 0.93;

class CollectiveModel {
 public:
  explicit CollectiveModel(const ClusterModel& cluster);

  // P -> R of a full tensor: the cheapest algorithm (AllReduceAlgorithm),
  // plus the per-call overhead (ClusterModel::collective_overhead_seconds).
  double AllReduce(double bytes) const;
  // A tensor's share of a coalesced all-reduce (a gradient bucket): the
  // bandwidth term of the large-message algorithm only. The bucket pays
  // the latency and the call overhead once (AllReduce of its bytes), so
  // latency does not multiply with the number of tensors in it.
  double AllReduceTransfer(double bytes) const;
  // The all-reduce algorithm AllReduce(bytes) uses and its time without the
  // call overhead: "ring", "tree", "hierarchical ring", "hierarchical tree".
  struct Choice {
    const char* algorithm = "none";
    double seconds = 0;
  };
  Choice AllReduceAlgorithm(double bytes) const;
  double Broadcast(double bytes) const;
  double Reduce(double bytes) const;
  // S(d) -> R, shard i = b_i * bytes (bytes = the full tensor).
  CostTerm AllGather(double bytes, Method m, int segment = 0) const;
  // P -> S(d).
  CostTerm ReduceScatter(double bytes, Method m, int segment = 0) const;
  // S(i) -> S(j).
  CostTerm AllToAll(double bytes, int segment = 0) const;

  CostTerm Constant(double seconds, int segment = 0) const;
  // Ring all-reduce over a subgroup (used by hierarchical plans/baselines).
  double RingAllReduce(double bytes, const std::vector<int>& group) const;
  // Double-binary-tree all-reduce over a subgroup.
  double TreeAllReduce(double bytes, const std::vector<int>& group) const;

  const ClusterModel& cluster() const { return cluster_; }

 private:
  // A ring or tree all-reduce over `group`, with or without its latency.
  double AllReduceOver(double bytes, const std::vector<int>& group, bool tree,
                       bool latency) const;
  Choice Cheapest(double bytes, bool latency) const;
  CostTerm Sharded(double bytes, Method m, int segment, double grouped_eff) const;

  const ClusterModel& cluster_;
  double ring_bw_;
  double ring_lat_;
};

// max_i(coef_i * b_i + const_i) * weight.
double EvaluateTerm(const CostTerm& t, const std::vector<double>& ratios);

}  // namespace hap::cost

#endif  // HAP_PLANNER_COST_COLLECTIVES_H_
