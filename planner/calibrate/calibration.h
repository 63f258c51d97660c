// Cost-model calibration from measured runs (docs/design.md §8; issue 7). The
// uncalibrated model prices an op at its FLOP count over the device's
// measured matmul rate; real kernels differ by op type (a log-softmax over a
// large vocabulary is memory bound and costs far more than its FLOPs say), the
// optimizer update and the runtime's own work (gradient zeroing, copies) are
// not ops at all, and collectives over a busy or throttled CPU are slower
// than the link probes say.
//
// A run of a plan with `hap-executor --profile` (or hap-launch --profile)
// writes, per rank, seconds per step by op type. Calibrate() compares them
// with what the model says for that rank's device and share of the plan,
// and returns the cluster profile with, per device:
//   op_time_scale[T]  = measured / modelled seconds of op type T,
//   optimizer_seconds_per_element = optimizer seconds / stored elements,
//   step_overhead_seconds = runtime seconds + ops the model gives no FLOPs,
// (runs of plans that assumed overlap fit the devices' overlap_efficiency
// instead: FitOverlapEfficiency), and for the communication time the model
// misses (measured: median step
// time less the busiest rank's kernel time) a least-squares fit over the
// runs of measured = A x the model's transfer seconds + B x collective calls:
// link bandwidths divided by A, B the per-collective-call overhead
// (LinkDefaults.collective_overhead_seconds). Runs of plans with different
// transfers per call (e.g. data parallelism and ZeRO-3) separate the two;
// when the runs cannot, the links stay and the calls take it all. Several
// runs (plans) can be combined: sums over runs are divided, so op types seen
// in any run are calibrated. The planner then searches and predicts with it.
// Runs of pipeline plans add their devices' kernel times at the microbatch
// size (the model: the stage's program on the microbatch, M times per step)
// and optimizer times; their steps (bubbles, transfers between stages, M
// microbatches' fixed costs) take no part in the communication, overlap and
// fixed-time fits; the stall per transfer between stages that explains
// their measured steps is fitted instead.
#ifndef HAP_PLANNER_CALIBRATE_CALIBRATION_H_
#define HAP_PLANNER_CALIBRATE_CALIBRATION_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hap/v1/cluster.pb.h"
#include "hap/v1/plan.pb.h"

namespace hap::calibrate {

// One rank's `--profile` file.
struct RankProfile {
  int rank = 0;
  std::string device;
  std::string plan_content_hash;
  double step_seconds_median = 0;
  double device_seconds = 0;                 // every kernel call, per step
  std::map<std::string, double> op_seconds;  // per step, by op type
};

// Parses a profile file's JSON; InvalidArgument naming what is missing.
absl::StatusOr<RankProfile> ParseRankProfile(const std::string& json);

// A plan and the profiles of all its ranks.
struct ProfiledRun {
  v1::Plan plan;
  std::vector<RankProfile> ranks;
  // Where the run came from, for errors ("run k (SOURCE): ..."; hapctl
  // calibrate names its --plan and --profile); empty: "run k".
  std::string source = "";
};

// Per device and op type: what the model said and what was measured.
struct Row {
  std::string device;
  std::string op_type;  // or "(optimizer)", "(runtime)", "(communication)"
  double modelled_seconds = 0;
  double measured_seconds = 0;
};

struct Calibration {
  v1::Cluster cluster;    // the input cluster, calibrated
  std::vector<Row> rows;  // device by device, op types sorted
  // defaults.collective_overhead_seconds of `cluster` (seconds per call)
  // and the collective calls per step it was fitted over (all runs).
  double collective_overhead_seconds = 0;
  double collective_calls = 0;
  // Measured transfer time over the model's: the cluster's link bandwidths
  // were divided by it (1 = kept as probed).
  double transfer_scale = 1;
  std::string communication_fit;  // how the two were fitted, for people
  // Devices whose fixed per-step time was fitted (CalibrateOptions::
  // fit_fixed_time): their op scales were multiplied by `scale` and their
  // step_overhead_seconds set to `fixed_seconds`.
  struct FixedTimeFit {
    std::string device;
    int runs = 0;
    double scale = 1;
    double fixed_seconds = 0;
  };
  std::vector<FixedTimeFit> fixed_time;
  // Devices' overlap efficiency fitted from runs of plans that assumed
  // communication overlapped with compute (FitOverlapEfficiency); 0 and no
  // runs when there were none.
  double overlap_efficiency = 0;
  int overlap_runs = 0;
  // The stall per transfer between pipeline stages that explains the
  // pipeline runs' measured steps given their kernel times (the mean over
  // them; PipelineTransferOverhead in calibration.cc), set as the cluster's
  // defaults.pipeline_transfer_overhead_seconds; 0 and no runs when there
  // were none.
  double pipeline_transfer_overhead_seconds = 0;
  int pipeline_runs = 0;
};

// One run of a plan that assumed overlap (PlanPrediction.overlap_assumed):
// its measured step (the slowest rank's median) and the prediction's
// compute, exposed and busy communication seconds.
struct OverlapSample {
  double measured = 0;
  double compute = 0;
  double exposed = 0;
  double busy = 0;
};
// The overlap efficiency e that explains the samples, the hidden part of
// the communication (busy - exposed) slowing compute by (1 - e) of itself:
//   measured = compute + exposed + (1 - e) (busy - exposed),
// least squares for (1 - e), clipped to [0, 1]. The plans' predictions must
// have assumed e = 1 (the GPU default). nullopt when nothing was hidden.
std::optional<double> FitOverlapEfficiency(const std::vector<OverlapSample>& samples);

// InvalidArgument when a run's profiles do not match its plan (a rank
// missing or twice, another plan's hash, a device the cluster lacks, a
// profile that times no op), when its plan is broken (rank programs not one
// per device, a prediction that is no number, a rank's share outside
// [0, 1]), and when the fit is what the planner refuses
// (service::CheckCalibration: an op scale of kMaxOpTimeScale or more, a
// step overhead past an hour; a link past kMaxLinkBandwidth), naming the
// device, the field and the value.
// Compute and optimizer calibration replace any earlier one (the "modelled"
// side is always the uncalibrated model); the collective overhead is fitted
// against each plan's own prediction, so runs should be of plans made from
// `cluster`: when the fit scales the links, a run whose plan was priced with
// other bandwidths than `cluster`'s is refused (a calibrated cluster
// calibrated again from the same runs had its links divided twice).
struct CalibrateOptions {
  // One op_time_scale per (device kind, op type), from the sums over all
  // devices of the kind, instead of one per device: the op types' cost
  // relative to the FLOP model is the kernels' property, and the agents'
  // measured FLOP/s keep ranking the devices. Use it where per-device kernel
  // times mislead: under a CPU quota, a rank that waited earlier in the
  // quota period runs its next kernels in a burst faster than it can
  // sustain, so a throttled rank's wall-clock kernel times depend on the
  // plan it ran.
  bool pool_op_scales_by_kind = false;
  // Per device, over its runs at different shares: everything measured but
  // the optimizer = alpha x the scaled model's time + beta (least squares,
  // beta >= 0); the op scales are multiplied by alpha and beta becomes
  // step_overhead_seconds, the time a device spends per step whatever its
  // share (small kernels' fixed costs, buffers the size of the parameters,
  // a throttled CPU's stalls). With runs at one share only, or when the fit
  // gives no positive alpha, step_overhead_seconds stays the measured
  // runtime (gradient zeroing, copies) and unmodelled ops.
  bool fit_fixed_time = true;
};

absl::StatusOr<Calibration> Calibrate(const v1::Cluster& cluster,
                                      const std::vector<ProfiledRun>& runs,
                                      const CalibrateOptions& options = {});

}  // namespace hap::calibrate

#endif  // HAP_PLANNER_CALIBRATE_CALIBRATION_H_
