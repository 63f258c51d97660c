#include "planner/cost/cluster_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace hap::cost {
namespace {

bool Positive(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

absl::StatusOr<ClusterModel> ClusterModel::FromProto(
    const hap::v1::Cluster& cluster, const std::vector<std::string>& ids,
    hap::v1::DType compute) {
  if (compute != hap::v1::FLOAT32 && compute != hap::v1::BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compute precision ", hap::v1::DType_Name(compute), " is not priced (FLOAT32 or BFLOAT16)"));
  }
  absl::flat_hash_map<std::string, const hap::v1::Device*> by_id;
  absl::flat_hash_map<std::string, std::string> node_of;
  std::vector<std::string> live_order;
  for (const auto& node : cluster.nodes()) {
    for (const auto& d : node.devices()) {
      if (d.id().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("node '", node.name(), "' has a device without id"));
      }
      if (by_id.count(d.id())) {
        return absl::InvalidArgumentError(
            absl::StrCat("device id '", d.id(), "' appears twice"));
      }
      by_id[d.id()] = &d;
      node_of[d.id()] = d.node().empty() ? node.name() : d.node();
      if (node.state() != hap::v1::Node::STALE) live_order.push_back(d.id());
    }
  }
  std::vector<std::string> chosen = ids.empty() ? live_order : ids;
  ClusterModel m;
  absl::flat_hash_map<std::string, int> rank;
  for (const std::string& id : chosen) {
    auto it = by_id.find(id);
    if (it == by_id.end()) {
      std::vector<std::string> known;
      for (const auto& [k, v] : by_id) known.push_back(k);
      std::sort(known.begin(), known.end());
      if (known.size() > 8) known.resize(8), known.push_back("...");
      return absl::InvalidArgumentError(
          absl::StrCat("unknown device '", id, "' (the cluster has: ",
                       absl::StrJoin(known, ", "), ")"));
    }
    if (rank.count(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device '", id, "' is listed twice"));
    }
    const hap::v1::Device& d = *it->second;
    DeviceModel dm;
    dm.id = id;
    dm.node = node_of[id];
    dm.model = d.model();
    // The float32 rate: a FLOAT32 entry, else an unspecified one, else the
    // first. Which entry is chosen does not depend on its value: a bad
    // float32 rate is an error, not a reason to take another dtype's.
    const hap::v1::DtypeThroughput* f32 = nullptr;
    for (const auto& f : d.flops()) {
      if (f.dtype() == hap::v1::FLOAT32 ||
          (f32 == nullptr && f.dtype() == hap::v1::DTYPE_UNSPECIFIED)) {
        f32 = &f;
      }
    }
    if (f32 == nullptr && d.flops_size() > 0) f32 = &d.flops(0);
    double flops = f32 == nullptr ? 0 : f32->flops();
    if (!Positive(flops)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device '", id, "' has no valid float32 FLOPS (got ",
                       f32 == nullptr ? std::string("none") : absl::StrCat(flops),
                       "); FLOPS must be positive and finite"));
    }
    for (const auto& f : d.flops()) {
      if (compute == hap::v1::BFLOAT16 && f.dtype() == hap::v1::BFLOAT16) {
        if (!Positive(f.flops())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "device '", id, "' has bf16 FLOPS ", f.flops(), "; they must be positive and finite"));
        }
        flops = f.flops();
      }
    }
    dm.flops = flops;
    if (d.memory_bytes() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", id, "' has memory_bytes ", d.memory_bytes(),
          "; it must be positive"));
    }
    dm.memory_bytes = d.memory_bytes();
    if (!(std::isfinite(d.launch_overhead_seconds()) && d.launch_overhead_seconds() >= 0 &&
          d.launch_overhead_seconds() <= kMaxLaunchOverheadSeconds)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", id, "' has an invalid launch_overhead_seconds (", d.launch_overhead_seconds(),
          "); it must be finite, >= 0 and at most ", kMaxLaunchOverheadSeconds));
    }
    dm.launch_overhead_seconds = d.launch_overhead_seconds();
    dm.queued_launches = QueuesLaunches(d);
    for (const auto& [type, scale] : d.op_time_scale()) {
      if (!Positive(scale) || scale >= kMaxOpTimeScale) {
        return absl::InvalidArgumentError(absl::StrCat(
            "device '", id, "' has op_time_scale[", type, "] = ", scale,
            "; calibration scales must be positive, finite and below ", kMaxOpTimeScale));
      }
      dm.op_time_scale[type] = scale;
    }
    for (const auto& [field, v, most] :
         {std::tuple<const char*, double, double>{"optimizer_seconds_per_element",
                                                  d.optimizer_seconds_per_element(),
                                                  kMaxOptimizerSecondsPerElement},
          {"step_overhead_seconds", d.step_overhead_seconds(), kMaxStepOverheadSeconds}}) {
      if (!(std::isfinite(v) && v >= 0 && v <= most)) {
        return absl::InvalidArgumentError(absl::StrCat("device '", id, "' has ", field, " ", v,
                                                       "; it must be finite, >= 0 and at most ",
                                                       most));
      }
    }
    const double eff = d.overlap_efficiency();
    if (!(std::isfinite(eff) && eff >= 0 && eff <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", id, "' has overlap_efficiency ", eff,
          "; it must be in [0, 1] (0 = unset: ", kGpuOverlapEfficiency,
          " for GPUs, ", kCpuOverlapEfficiency, " for CPUs)"));
    }
    dm.overlap_efficiency =
        eff > 0 ? eff
                : (d.kind() == hap::v1::CPU ? kCpuOverlapEfficiency : kGpuOverlapEfficiency);
    dm.optimizer_seconds_per_element = d.optimizer_seconds_per_element();
    dm.step_overhead_seconds = d.step_overhead_seconds();
    rank[id] = m.size();
    m.devices_.push_back(dm);
  }
  int n = m.size();
  m.bandwidth_.assign(n, std::vector<double>(n, -1));
  m.latency_.assign(n, std::vector<double>(n, 0));
  for (const auto& l : cluster.links()) {
    auto s = rank.find(l.src());
    auto t = rank.find(l.dst());
    if (!by_id.count(l.src()) || !by_id.count(l.dst())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "link ", l.src(), " -> ", l.dst(), " names an unknown device"));
    }
    if (!Positive(l.bandwidth_bytes_per_second()) ||
        !(std::isfinite(l.latency_seconds()) && l.latency_seconds() >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "link ", l.src(), " -> ", l.dst(),
          " needs a positive finite bandwidth and a non-negative latency"));
    }
    if (s == rank.end() || t == rank.end()) continue;
    m.bandwidth_[s->second][t->second] = l.bandwidth_bytes_per_second();
    m.latency_[s->second][t->second] = l.latency_seconds();
  }
  const auto& def = cluster.defaults();
  if (!(std::isfinite(def.collective_overhead_seconds()) &&
        def.collective_overhead_seconds() >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "defaults.collective_overhead_seconds must be finite and >= 0, got ",
        def.collective_overhead_seconds()));
  }
  m.collective_overhead_ = def.collective_overhead_seconds();
  if (!(std::isfinite(def.pipeline_transfer_overhead_seconds()) &&
        def.pipeline_transfer_overhead_seconds() >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "defaults.pipeline_transfer_overhead_seconds must be finite and >= 0, got ",
        def.pipeline_transfer_overhead_seconds()));
  }
  m.pipeline_transfer_overhead_ = def.pipeline_transfer_overhead_seconds();
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j || m.bandwidth_[i][j] > 0) continue;
      // A link given one way serves both ways.
      if (m.bandwidth_[j][i] > 0) {
        m.bandwidth_[i][j] = m.bandwidth_[j][i];
        m.latency_[i][j] = m.latency_[j][i];
        continue;
      }
      bool same = m.devices_[i].node == m.devices_[j].node;
      double bw = same ? def.intra_node_bandwidth_bytes_per_second()
                       : def.inter_node_bandwidth_bytes_per_second();
      double lat = same ? def.intra_node_latency_seconds()
                        : def.inter_node_latency_seconds();
      if (!Positive(bw) || !(std::isfinite(lat) && lat >= 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "no valid bandwidth between '", m.devices_[i].id, "' and '",
            m.devices_[j].id, "': give a link or positive ",
            same ? "intra" : "inter", "-node defaults"));
      }
      m.bandwidth_[i][j] = bw;
      m.latency_[i][j] = lat;
    }
  }
  HAP_RETURN_IF_ERROR(m.Finish());
  return m;
}

absl::StatusOr<ClusterModel> ClusterModel::Create(
    std::vector<DeviceModel> devices, std::vector<std::vector<double>> bw,
    std::vector<std::vector<double>> lat) {
  ClusterModel m;
  int n = static_cast<int>(devices.size());
  if (static_cast<int>(bw.size()) != n || static_cast<int>(lat.size()) != n) {
    return absl::InvalidArgumentError("bandwidth/latency matrix size mismatch");
  }
  for (int i = 0; i < n; ++i) {
    if (static_cast<int>(bw[i].size()) != n ||
        static_cast<int>(lat[i].size()) != n) {
      return absl::InvalidArgumentError("bandwidth/latency matrix not square");
    }
    if (!Positive(devices[i].flops) || devices[i].memory_bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", devices[i].id, "' needs positive FLOPS and memory"));
    }
    for (int j = 0; j < n; ++j) {
      if (i != j && (!Positive(bw[i][j]) || !(lat[i][j] >= 0))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bandwidth/latency between devices ", i, " and ", j,
            " must be positive/non-negative"));
      }
    }
  }
  m.devices_ = std::move(devices);
  m.bandwidth_ = std::move(bw);
  m.latency_ = std::move(lat);
  HAP_RETURN_IF_ERROR(m.Finish());
  return m;
}

absl::StatusOr<ClusterModel> ClusterModel::TwoLevel(std::vector<DeviceModel> devices,
                                                    double intra_bw, double intra_lat,
                                                    double inter_bw, double inter_lat) {
  const size_t n = devices.size();
  std::vector<std::vector<double>> bw(n, std::vector<double>(n, 0)), lat = bw;
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      const bool same = devices[i].node == devices[j].node;
      bw[i][j] = same ? intra_bw : inter_bw;
      lat[i][j] = same ? intra_lat : inter_lat;
    }
  }
  return Create(std::move(devices), std::move(bw), std::move(lat));
}

double ExposedLaunchFraction(const DeviceModel& d, double launches, double kernel_seconds) {
  if (!d.queued_launches) return 1.0;
  const double total = launches * d.launch_overhead_seconds;
  if (!(total > 0)) return 1.0;
  return std::clamp(1.0 - kernel_seconds / total, 0.0, 1.0);
}

absl::StatusOr<ClusterModel> ClusterModel::Subset(const std::vector<int>& indices) const {
  std::vector<bool> seen(devices_.size(), false);
  std::vector<DeviceModel> devices;
  std::vector<std::vector<double>> bw, lat;
  for (int i : indices) {
    if (i < 0 || i >= size() || seen[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device index ", i, " is out of range (", size(), " devices) or repeated"));
    }
    seen[i] = true;
    devices.push_back(devices_[i]);
    bw.emplace_back();
    lat.emplace_back();
    for (int j : indices) {
      bw.back().push_back(bandwidth_[i][j]);
      lat.back().push_back(latency_[i][j]);
    }
  }
  ClusterModel m;
  m.devices_ = std::move(devices);
  m.bandwidth_ = std::move(bw);
  m.latency_ = std::move(lat);
  m.collective_overhead_ = collective_overhead_;
  m.pipeline_transfer_overhead_ = pipeline_transfer_overhead_;
  HAP_RETURN_IF_ERROR(m.Finish(/*min_devices=*/1));
  return m;
}

absl::Status ClusterModel::Finish(int min_devices) {
  int n = size();
  if (n < min_devices) {
    return absl::InvalidArgumentError(
        min_devices == 1 ? std::string("a group of devices needs at least one device")
                         : absl::StrCat("a plan needs at least ", min_devices, " devices, got ", n,
                                        "; a single device runs the single-device program as "
                                        "it is"));
  }
  std::map<std::string, int> node_index;
  for (int i = 0; i < n; ++i) {
    auto [it, inserted] =
        node_index.emplace(devices_[i].node, static_cast<int>(nodes_.size()));
    if (inserted) nodes_.emplace_back();
    nodes_[it->second].push_back(i);
    total_flops_ += devices_[i].flops;
  }
  for (const auto& g : nodes_) all_.insert(all_.end(), g.begin(), g.end());
  return absl::OkStatus();
}

double ClusterModel::RingBandwidth(const std::vector<int>& g) const {
  if (g.size() < 2) return 1e30;
  double bw = 1e30;
  for (size_t k = 0; k < g.size(); ++k) {
    int a = g[k], b = g[(k + 1) % g.size()];
    bw = std::min(bw, bandwidth_[a][b]);
  }
  return bw;
}

double ClusterModel::RingLatency(const std::vector<int>& g) const {
  double lat = 0;
  for (size_t k = 0; g.size() > 1 && k < g.size(); ++k) {
    lat = std::max(lat, latency_[g[k]][g[(k + 1) % g.size()]]);
  }
  return lat;
}

std::vector<double> ClusterModel::ProportionalRatios() const {
  std::vector<double> r;
  for (const auto& d : devices_) r.push_back(d.flops / total_flops_);
  return r;
}

std::vector<double> ClusterModel::EvenRatios() const {
  return std::vector<double>(size(), 1.0 / size());
}

}  // namespace hap::cost
