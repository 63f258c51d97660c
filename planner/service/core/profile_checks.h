// What the planner core accepts as names and measurements, shared by node
// registration, heartbeats, link reports and plan options: pure checks,
// each an InvalidArgument (or AlreadyExists) that names the field, what it
// must be and the value. No state; thread-safe.
#ifndef HAP_PLANNER_SERVICE_CORE_PROFILE_CHECKS_H_
#define HAP_PLANNER_SERVICE_CORE_PROFILE_CHECKS_H_

#include <limits>
#include <map>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hap/v1/cluster.pb.h"
#include "planner/cost/cluster_model.h"

namespace hap::service {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
// Every FLOP/s entry a node reports is at least this (a real device does
// 1e8 and more; a denormal one makes the cost model's times infinite).
inline constexpr double kMinFlops = 1e6;
// ... and at most this (an exaFLOP/s: hundreds of times a GPU's densest
// rate); more is a broken agent's figure that makes the device's compute
// free in every plan. Likewise a device's memory: at most a pebibyte.
inline constexpr double kMaxFlops = 1e18;
inline constexpr int64_t kMaxDeviceMemoryBytes = int64_t{1} << 50;
// The largest link bandwidth a node may report, in B/s: ten times a GPU's
// NVLink 5 (900 GB/s each way). More is a broken or lying agent's figure,
// which would make transfers free in every plan.
inline constexpr double kMaxLinkBandwidth = 1e13;
// The most seconds a device may report per kernel call, per parameter
// element of the optimizer and per step outside ops, and the largest
// calibration scale of an op's time: the cost model's (it refuses more).
using cost::kMaxLaunchOverheadSeconds;
using cost::kMaxOpTimeScale;
using cost::kMaxOptimizerSecondsPerElement;
using cost::kMaxStepOverheadSeconds;
// A node's address, agent_version, label keys and values and its devices'
// models: at most this many bytes, no control characters; at most
// kMaxNodeLabels labels.
inline constexpr size_t kMaxNodeTextBytes = 1024;
inline constexpr int kMaxNodeLabels = 256;
// Nodes and devices the cluster holds at most (every plan copies it;
// GetCluster answers it whole).
inline constexpr int kMaxNodes = 4096;
inline constexpr int kMaxClusterDevices = 65536;
// Devices one node may report (each plan's cost model is n x n).
inline constexpr int kMaxDevicesPerNode = 1024;
// At most this many devices a plan (a request's list, or the live cluster
// when it lists none): the cost model's link tables are n x n (two of 268 MB
// at 4,096), and the search and the plan's rank programs grow with n.
// Planning for 1,000+ devices is what the scale work is for
// (bench/synth_bench plans GPT-12 on 2,048 heterogeneous devices), so the
// bound is twice that, not 1,024.
inline constexpr int kMaxPlanDevices = 4096;

// A resource id: 1-63 lower-case letters, digits and '-'.
bool ValidId(const std::string& id);
// A device id as nodes report it ("node-a/gpu0"): 1-kMaxDeviceIdBytes
// letters, digits, '-', '.', '_', '/' and ':'. Ids become label keys
// (hap.executor/<id>), metric labels, log lines and job selectors: no
// spaces, quotes or control characters, and a bounded length.
inline constexpr size_t kMaxDeviceIdBytes = 512;
bool ValidDeviceId(const std::string& id);
// "nodes/a" -> "a"; a bare name as it is.
std::string NodeId(const std::string& name);
// A node name: 1-253 letters, digits, '-', '.', '_'.
bool ValidNodeName(const std::string& n);

// OK when lo <= v < hi (so never for NaN or an infinity); otherwise
// InvalidArgument naming `field`, what it must be, and `v`.
absl::Status CheckRange(absl::string_view field, double v, double lo, double hi,
                        absl::string_view must_be);

// A measured link the planner takes (ReportLinks): a bandwidth that is a
// finite number in (0, kMaxLinkBandwidth] B/s, a known LinkKind and a
// latency that is a finite number >= 0. Otherwise InvalidArgument, `link` (which names the
// link) then the field and the value. The agent checks its measurements
// with it before reporting them: the planner refuses a whole report for
// one such link.
absl::Status CheckLinkMeasurement(const hap::v1::Link& l, absl::string_view link);

// What every node profile must hold, whether it comes from RegisterNode or
// from a Heartbeat with re-measured devices: device ids non-empty and unique
// in the node, and every measurement a finite number in its range (one NaN
// FLOP/s or negative memory poisons every plan made for the cluster). Adds
// the ids to `ids`. Ownership across nodes is checked by CheckOwners.
absl::Status ValidateDevices(const std::string& node,
                             const google::protobuf::RepeatedPtrField<hap::v1::Device>& devices,
                             std::set<std::string>* ids);

// What a device's calibration must hold to be applied to plans: every
// figure a finite number in the range the device's own fields take (one NaN
// op scale fails every plan on the cluster). InvalidArgument naming the
// field. The planner fits calibrations itself (CalibrateDevices); a stored
// one is checked when the store is loaded (a database written by a planner
// that took a node's own may hold anything).
absl::Status CheckCalibration(const hap::v1::DeviceCalibration& c);

// InvalidArgument naming the field for a node's address, agent_version or
// labels past kMaxNodeTextBytes, with a control character, or more than
// kMaxNodeLabels labels.
absl::Status CheckNodeText(const hap::v1::Node& node);

// ResourceExhausted when node `node` reporting `devices` devices would
// take the cluster past kMaxNodes nodes or kMaxClusterDevices devices
// (its own earlier report replaced).
absl::Status CheckClusterSize(const std::map<std::string, hap::v1::Node>& nodes,
                              const std::string& node, int devices);

// AlreadyExists, naming the device and its owner, when one of `ids` belongs
// to a node other than `node`.
absl::Status CheckOwners(const std::map<std::string, hap::v1::Node>& nodes,
                         const std::string& node, const std::set<std::string>& ids);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_PROFILE_CHECKS_H_
