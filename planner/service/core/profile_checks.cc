#include "planner/service/core/profile_checks.h"

#include <cctype>
#include <cmath>
#include <set>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace hap::service {

namespace v1 = ::hap::v1;

bool ValidId(const std::string& id) {
  if (id.empty() || id.size() > 63) return false;
  for (char c : id) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
      return false;
    }
  }
  return true;
}

bool ValidDeviceId(const std::string& id) {
  if (id.empty() || id.size() > kMaxDeviceIdBytes) return false;
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' ||
          c == '/' || c == ':')) {
      return false;
    }
  }
  return true;
}

// "nodes/a" -> "a"; a bare name as it is.
std::string NodeId(const std::string& name) {
  return name.rfind("nodes/", 0) == 0 ? name.substr(6) : name;
}

bool ValidNodeName(const std::string& n) {
  if (n.empty() || n.size() > 253) return false;
  for (char c : n) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_')) {
      return false;
    }
  }
  return true;
}

// OK when lo <= v < hi (so never for NaN or an infinity); otherwise
// InvalidArgument naming `field`, what it must be, and `v`.
absl::Status CheckLinkMeasurement(const v1::Link& l, absl::string_view link) {
  const double bandwidth = l.bandwidth_bytes_per_second();
  if (!(std::isfinite(bandwidth) && bandwidth > 0 && bandwidth <= kMaxLinkBandwidth)) {
    return absl::InvalidArgumentError(
        absl::StrCat(link, "bandwidth_bytes_per_second must be a finite number > 0 and at most ",
                     kMaxLinkBandwidth, " (no link carries more), got ", bandwidth));
  }
  // As a device's kind: a value this planner does not know (a newer
  // agent's, or any number on the wire) was stored and served as if known.
  if (!v1::LinkKind_IsValid(l.kind())) {
    return absl::InvalidArgumentError(
        absl::StrCat(link, "kind ", l.kind(), " is not a link kind this planner knows"));
  }
  return CheckRange(absl::StrCat(link, "latency_seconds"), l.latency_seconds(), 0, kInf,
                    "a finite number >= 0");
}

absl::Status CheckRange(absl::string_view field, double v, double lo, double hi,
                        absl::string_view must_be) {
  if (std::isfinite(v) && v >= lo && v < hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be ", must_be, ", got ", v));
}

namespace {

// `value` as a message may show it: the first 80 bytes, escaped.
std::string Shown(const std::string& value) {
  return absl::StrCat("'", absl::CHexEscape(value.substr(0, 80)), value.size() > 80 ? "...'" : "'",
                      " (", value.size(), " bytes)");
}

// InvalidArgument naming `field` unless `value` is at most `most` bytes of
// no control characters (it is shown, dialled or copied into plans).
absl::Status CheckText(absl::string_view field, const std::string& value, size_t most) {
  if (value.size() > most) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be at most ", most, " bytes, got ", Shown(value)));
  }
  for (char c : value) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must hold no control characters, got ", Shown(value)));
    }
  }
  return absl::OkStatus();
}

// Each op scale of a device or a calibration: finite, > 0, below
// kMaxOpTimeScale. `prefix` starts the message ("device 'ID': ").
absl::Status CheckOpTimeScales(absl::string_view prefix,
                               const google::protobuf::Map<std::string, double>& scales) {
  for (const auto& [op, scale] : scales) {
    if (!(std::isfinite(scale) && scale > 0 && scale < kMaxOpTimeScale)) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "op_time_scale[\"", op,
                                                     "\"] must be a finite number > 0 and below ",
                                                     kMaxOpTimeScale, ", got ", scale));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckNodeText(const v1::Node& node) {
  const std::string of = absl::StrCat("node '", node.name(), "': ");
  HAP_RETURN_IF_ERROR(CheckText(absl::StrCat(of, "address"), node.address(), kMaxNodeTextBytes));
  HAP_RETURN_IF_ERROR(
      CheckText(absl::StrCat(of, "agent_version"), node.agent_version(), kMaxNodeTextBytes));
  if (node.labels_size() > kMaxNodeLabels) {
    return absl::InvalidArgumentError(absl::StrCat(of, "labels: at most ", kMaxNodeLabels,
                                                   " are taken, got ", node.labels_size()));
  }
  for (const auto& [key, value] : node.labels()) {
    HAP_RETURN_IF_ERROR(CheckText(absl::StrCat(of, "label key"), key, kMaxNodeTextBytes));
    if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(of, "a label key is empty"));
    HAP_RETURN_IF_ERROR(CheckText(absl::StrCat(of, "label '", key, "'"), value, kMaxNodeTextBytes));
  }
  return absl::OkStatus();
}

// What every node profile must hold, whether it comes from RegisterNode or
// from a Heartbeat with re-measured devices: device ids non-empty and unique
// in the node, and every measurement a finite number in its range (one NaN
// FLOP/s or negative memory poisons every plan made for the cluster). Adds
// the ids to `ids`. Ownership across nodes is checked by CheckOwners.
absl::Status ValidateDevices(const std::string& node,
                             const google::protobuf::RepeatedPtrField<v1::Device>& devices,
                             std::set<std::string>* ids) {
  if (devices.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("node '", node, "' reports no devices"));
  }
  if (devices.size() > kMaxDevicesPerNode) {
    return absl::InvalidArgumentError(absl::StrCat("node '", node, "' reports ", devices.size(),
                                                   " devices; at most ", kMaxDevicesPerNode,
                                                   " are taken per node"));
  }
  for (const v1::Device& d : devices) {
    if (!ValidDeviceId(d.id())) {
      // Shown as given up to a length a message can hold.
      return absl::InvalidArgumentError(
          absl::StrCat("node '", node, "': a device id must be 1-", kMaxDeviceIdBytes,
                       " letters, digits, '-', '.', '_', '/' or ':' (as NODE/gpu0), got '",
                       absl::CHexEscape(d.id().substr(0, 80)), d.id().size() > 80 ? "...'" : "'",
                       " (", d.id().size(), " bytes)"));
    }
    if (!ids->insert(d.id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("node '", node, "': device ids must be unique, got '", d.id(), "' twice"));
    }
    const std::string dev = absl::StrCat("device '", d.id(), "': ");
    HAP_RETURN_IF_ERROR(CheckText(absl::StrCat(dev, "model"), d.model(), kMaxNodeTextBytes));
    // Enum values this planner does not know (a newer agent's, or any
    // number on the wire) were stored and planned with as if known.
    if (!v1::DeviceKind_IsValid(d.kind())) {
      return absl::InvalidArgumentError(
          absl::StrCat(dev, "kind ", d.kind(), " is not a device kind this planner knows"));
    }
    double f32 = 0;
    std::set<int> dtypes;
    for (const auto& t : d.flops()) {
      if (!v1::DType_IsValid(t.dtype())) {
        return absl::InvalidArgumentError(absl::StrCat(
            dev, "a FLOP/s rate is for dtype ", t.dtype(), ", not a dtype this planner knows"));
      }
      if (!(t.flops() >= kMinFlops && t.flops() <= kMaxFlops)) {
        return absl::InvalidArgumentError(absl::StrCat(
            dev, v1::DType_Name(t.dtype()), " FLOP/s must be a finite number >= ", kMinFlops,
            " and at most ", kMaxFlops, ", got ", t.flops()));
      }
      // One rate a dtype: the cost model and calibration would each take another.
      if (!dtypes.insert(t.dtype()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(dev, v1::DType_Name(t.dtype()), " FLOP/s is reported twice"));
      }
      if (t.dtype() == v1::FLOAT32) f32 = t.flops();
    }
    if (!(f32 > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", d.id(), "' has no positive float32 FLOP/s measurement"));
    }
    if (d.memory_bytes() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device '", d.id(), "' reports no memory: memory_bytes must be positive, got ",
          d.memory_bytes()));
    }
    if (d.memory_bytes() > kMaxDeviceMemoryBytes) {
      return absl::InvalidArgumentError(absl::StrCat(dev, "memory_bytes must be at most ",
                                                     kMaxDeviceMemoryBytes, " (1 PiB), got ",
                                                     d.memory_bytes()));
    }
    if (!(d.tf32_flops() >= 0 && d.tf32_flops() <= kMaxFlops)) {
      return absl::InvalidArgumentError(
          absl::StrCat(dev, "tf32_flops must be a finite number >= 0 and at most ", kMaxFlops,
                       ", got ", d.tf32_flops()));
    }
    // Seconds summed over a step's kernels and parameters: a figure near
    // the largest double came out infinite and failed every plan on the
    // device, so each is bounded far above any device's.
    const std::tuple<const char*, double, double> seconds[] = {
        {"launch_overhead_seconds", d.launch_overhead_seconds(), kMaxLaunchOverheadSeconds},
        {"optimizer_seconds_per_element", d.optimizer_seconds_per_element(),
         kMaxOptimizerSecondsPerElement},
        {"step_overhead_seconds", d.step_overhead_seconds(), kMaxStepOverheadSeconds},
    };
    for (const auto& [field, v, most] : seconds) {
      HAP_RETURN_IF_ERROR(CheckRange(absl::StrCat(dev, field), v, 0, most,
                                     absl::StrCat("a finite number >= 0 and below ", most)));
    }
    if (!(std::isfinite(d.overlap_efficiency()) && d.overlap_efficiency() >= 0 &&
          d.overlap_efficiency() <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          dev, "overlap_efficiency must be in [0, 1] (0 = unset), got ", d.overlap_efficiency()));
    }
    HAP_RETURN_IF_ERROR(CheckOpTimeScales(dev, d.op_time_scale()));
  }
  return absl::OkStatus();
}

absl::Status CheckCalibration(const v1::DeviceCalibration& c) {
  HAP_RETURN_IF_ERROR(CheckOpTimeScales("", c.op_time_scale()));
  const std::tuple<const char*, double, double> fields[] = {
      {"optimizer_seconds_per_element", c.optimizer_seconds_per_element(),
       kMaxOptimizerSecondsPerElement},
      {"step_overhead_seconds", c.step_overhead_seconds(), kMaxStepOverheadSeconds},
      {"collective_overhead_seconds", c.collective_overhead_seconds(), kMaxStepOverheadSeconds},
      {"pipeline_transfer_overhead_seconds", c.pipeline_transfer_overhead_seconds(),
       kMaxStepOverheadSeconds},
      {"transfer_scale", c.transfer_scale(), kMaxOpTimeScale},
      {"probed_flops", c.probed_flops(), kInf},
      {"measured_step_seconds", c.measured_step_seconds(), kInf},
  };
  for (const auto& [field, v, most] : fields) {
    HAP_RETURN_IF_ERROR(CheckRange(field, v, 0, most,
                                   most == kInf
                                       ? std::string("a finite number >= 0")
                                       : absl::StrCat("a finite number >= 0 and below ", most)));
  }
  return absl::OkStatus();
}

absl::Status CheckClusterSize(const std::map<std::string, v1::Node>& nodes, const std::string& node,
                              int devices) {
  const bool is_new = !nodes.count(node);
  if (is_new && nodes.size() >= static_cast<size_t>(kMaxNodes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "node '", node, "' is not taken: the cluster has ", nodes.size(),
        " nodes, the most the planner holds (", kMaxNodes,
        "); delete nodes no longer there (hapctl delete node, or --node-expiry-seconds)"));
  }
  int64_t total = devices;
  for (const auto& [name, n] : nodes) {
    if (name != node) total += n.devices_size();
  }
  if (total > kMaxClusterDevices) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "node '", node, "' with ", devices, " devices is not taken: the cluster would have ", total,
        " devices, more than the planner holds (", kMaxClusterDevices,
        "); delete nodes no longer there (hapctl delete node, or --node-expiry-seconds)"));
  }
  return absl::OkStatus();
}

// AlreadyExists, naming the device and its owner, when one of `ids` belongs
// to a node other than `node`.
absl::Status CheckOwners(const std::map<std::string, v1::Node>& nodes, const std::string& node,
                         const std::set<std::string>& ids) {
  for (const auto& [name, other] : nodes) {
    if (name == node) continue;
    for (const auto& d : other.devices()) {
      if (ids.count(d.id())) {
        return absl::AlreadyExistsError(absl::StrCat(
            "device '", d.id(), "' is already registered by node '", name, "'"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace hap::service
