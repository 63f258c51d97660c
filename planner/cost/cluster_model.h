// The cluster as the cost model sees it (docs/design.md §8): the plan's devices in
// rank order with measured FLOPS and memory, and a bandwidth/latency matrix
// with node hierarchy. Built from hap.v1.Cluster; validation rejects what
// would make predictions meaningless (NaN, zero or negative numbers, unknown
// devices, fewer than two devices).
//
// Thread-safety: immutable after construction.
#ifndef HAP_PLANNER_COST_CLUSTER_MODEL_H_
#define HAP_PLANNER_COST_CLUSTER_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hap/v1/cluster.pb.h"

namespace hap::cost {

// Overlap efficiency where the profile leaves it unset (cluster.proto
// Device.overlap_efficiency).
inline constexpr double kGpuOverlapEfficiency = 1.0;
inline constexpr double kCpuOverlapEfficiency = 0.5;

// The most seconds a device's profile may say per kernel call, per
// parameter element of the optimizer and per step outside ops (each far
// above any device's), and the largest calibration scale of an op's time.
// FromProto refuses more, as the planner service does (its profile checks
// use these): a cluster file with an op scale of 1e300 planned with costs
// near infinity.
inline constexpr double kMaxLaunchOverheadSeconds = 1;
inline constexpr double kMaxOptimizerSecondsPerElement = 1;
inline constexpr double kMaxStepOverheadSeconds = 3600;
inline constexpr double kMaxOpTimeScale = 1e6;

struct DeviceModel {
  std::string id;
  std::string node;
  std::string model;
  double flops = 0;  // matmul FLOP/s at the plan's precision (FromProto)
  int64_t memory_bytes = 0;
  double launch_overhead_seconds = 0;
  // Calibration (cluster.proto Device): compute seconds of op type T are
  // scaled by op_time_scale[T] (1 when absent).
  std::map<std::string, double> op_time_scale = {};
  double optimizer_seconds_per_element = 0;
  double step_overhead_seconds = 0;
  // The fraction of an overlapped collective this device hides behind its
  // compute (cluster.proto Device.overlap_efficiency; defaults by kind).
  double overlap_efficiency = 1.0;
  // Kernel launches are queued (a GPU stream: the host runs ahead of the
  // device) rather than each call run to its end (a CPU): QueuesLaunches.
  bool queued_launches = false;

  double OpTimeScale(const std::string& op_type) const {
    auto it = op_time_scale.find(op_type);
    return it == op_time_scale.end() ? 1.0 : it->second;
  }
};

// The fraction of a device's kernel launch overhead (`launches` calls at
// `d.launch_overhead_seconds` each) that a step pays, given the step's
// kernel seconds on the device. A CPU calls each kernel in turn and pays
// every launch (1). A GPU queues its launches on a stream and the host runs
// ahead of the kernels, so only what the launches take beyond the kernels
// is exposed: max(0, 1 - kernel_seconds / (launches x overhead)).
double ExposedLaunchFraction(const DeviceModel& d, double launches, double kernel_seconds);
// Whether a profiled device queues its launches: GPUs do.
inline bool QueuesLaunches(const hap::v1::Device& d) { return d.kind() == hap::v1::GPU; }

class ClusterModel {
 public:
  // `device_ids` chooses and orders the plan's devices; empty = every device
  // of every node that is not STALE, node by node.
  // `compute` is the precision of the plan's matrix products
  // (PlanOptions.precision): FLOAT32, or BFLOAT16, which prices each device
  // at its measured bf16 rate (Device.flops with dtype BFLOAT16), or at its
  // float32 rate when its profile has none.
  static absl::StatusOr<ClusterModel> FromProto(
      const hap::v1::Cluster& cluster,
      const std::vector<std::string>& device_ids = {},
      hap::v1::DType compute = hap::v1::FLOAT32);
  // For tests and benchmarks: devices plus a full bandwidth/latency matrix.
  static absl::StatusOr<ClusterModel> Create(
      std::vector<DeviceModel> devices,
      std::vector<std::vector<double>> bandwidth,
      std::vector<std::vector<double>> latency);
  // For tests and benchmarks: devices whose `node` says where they are,
  // links at one bandwidth and latency inside a node and another between.
  static absl::StatusOr<ClusterModel> TwoLevel(std::vector<DeviceModel> devices,
                                               double intra_bandwidth, double intra_latency,
                                               double inter_bandwidth, double inter_latency);

  // The devices `indices` (into this model, in that order) with their links
  // and the collective overhead: a pipeline stage's group, which may be a
  // single device (unlike a cluster a plan is made for). InvalidArgument
  // for an index out of range or repeated, or no index.
  absl::StatusOr<ClusterModel> Subset(const std::vector<int>& indices) const;

  int size() const { return static_cast<int>(devices_.size()); }
  const DeviceModel& device(int i) const { return devices_[i]; }
  const std::vector<DeviceModel>& devices() const { return devices_; }
  double bandwidth(int i, int j) const { return bandwidth_[i][j]; }
  double latency(int i, int j) const { return latency_[i][j]; }
  double total_flops() const { return total_flops_; }
  // Added to every collective call (LinkDefaults.collective_overhead_seconds).
  double collective_overhead_seconds() const { return collective_overhead_; }
  // Added to every transfer between pipeline stages
  // (LinkDefaults.pipeline_transfer_overhead_seconds).
  double pipeline_transfer_overhead_seconds() const { return pipeline_transfer_overhead_; }

  // Devices grouped by node, in rank order.
  const std::vector<std::vector<int>>& node_groups() const { return nodes_; }
  // A ring over `group` (node-mates adjacent): its slowest link and the
  // largest latency on it.
  double RingBandwidth(const std::vector<int>& group) const;
  double RingLatency(const std::vector<int>& group) const;
  const std::vector<int>& all() const { return all_; }

  // Ratios proportional to FLOPS.
  std::vector<double> ProportionalRatios() const;
  std::vector<double> EvenRatios() const;

 private:
  // Node groups and totals; InvalidArgument below `min_devices` (a plan's
  // cluster needs two, a stage's group one).
  absl::Status Finish(int min_devices = 2);

  std::vector<DeviceModel> devices_;
  std::vector<std::vector<double>> bandwidth_;
  std::vector<std::vector<double>> latency_;
  std::vector<std::vector<int>> nodes_;
  std::vector<int> all_;     // ring order over all devices
  double total_flops_ = 0;
  double collective_overhead_ = 0;
  double pipeline_transfer_overhead_ = 0;
};

}  // namespace hap::cost

#endif  // HAP_PLANNER_COST_CLUSTER_MODEL_H_
