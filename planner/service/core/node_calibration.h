// The planner's own cost-model calibration (issue 19): fitted from a
// deployment's per-op step profiles (the executors report them with their
// status; planner/calibrate does the fitting), kept with each device of the
// cluster registry (Device.calibration), and applied to the cluster a new
// plan is made for. No gRPC, no I/O; the planner core calls these.
#ifndef HAP_PLANNER_SERVICE_CORE_NODE_CALIBRATION_H_
#define HAP_PLANNER_SERVICE_CORE_NODE_CALIBRATION_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"
#include "hap/v1/planner_service.pb.h"

namespace hap::service {

// A calibration is dropped when the device's agent re-probes it at a
// FLOAT32 FLOP/s that differs from the one it was fitted at by more than
// this fraction (the device changed: a new quota, another load).
inline constexpr double kCalibrationFlopsTolerance = 0.10;

// The device's FLOAT32 matmul FLOP/s as its agent measured it (the first
// entry when there is no FLOAT32 one; 0 when none).
double Fp32Flops(const hap::v1::Device& d);

// Whether `old`'s calibration still holds for the device as re-probed
// (`now`): it has one, and FLOP/s within kCalibrationFlopsTolerance.
bool CalibrationHolds(const hap::v1::Device& old, const hap::v1::Device& now);

// Per device of `plan`, the calibration that explains the run of `plan`
// whose rank profiles are `profiles` (one per rank, any order), fitted by
// calibrate::Calibrate against `raw` (the registry's cluster, as measured,
// with every device of the plan). A pipeline plan's run fits the op scales,
// the optimizer and the stall per transfer between stages, and keeps the
// rest of each device's earlier calibration in `raw`; an SPMD run keeps the
// earlier stall. A run without collective calls keeps the earlier
// collective overhead and transfer scale, a pipeline run whose profiles give
// no stage its kernel time the earlier stall (a run that cannot fit a number
// never resets it). InvalidArgument naming what is missing (a rank's profile,
// a device) or inconsistent (another plan's profile).
absl::StatusOr<std::map<std::string, hap::v1::DeviceCalibration>> FitDeviceCalibration(
    const hap::v1::Cluster& raw, const hap::v1::Plan& plan,
    const std::vector<hap::v1::StepProfile>& profiles, const std::string& deployment,
    absl::Time now);

// Applies the devices' calibrations to `cluster` for a plan on `devices`:
// each device's op_time_scale, optimizer_seconds_per_element and
// step_overhead_seconds become its calibration's; a device of the plan
// without one borrows that of the calibrated device of the same kind
// closest in FLOP/s (op scales as they are, the per-element and per-step
// seconds scaled by the two devices' FLOP/s ratio); the collective overhead,
// link transfer scale and pipeline transfer stall are the largest of the
// plan's devices'.
// Returns what was used, one clause per device ("node0/cpu0: deployments/x
// (plans/y)", "node2/cpu0: borrowed from node0/cpu0"); empty, and the
// cluster left as it is, when none of the cluster's devices has one.
std::string ApplyCalibration(hap::v1::Cluster* cluster, const std::vector<std::string>& devices);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_CORE_NODE_CALIBRATION_H_
