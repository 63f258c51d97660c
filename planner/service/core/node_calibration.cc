#include "planner/service/core/node_calibration.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "google/protobuf/util/time_util.h"
#include "planner/calibrate/calibration.h"
#include "planner/lower/plan_file.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;

// The devices of `c` by id.
std::map<std::string, const v1::Device*> DevicesById(const v1::Cluster& c) {
  std::map<std::string, const v1::Device*> out;
  for (const auto& n : c.nodes()) {
    for (const auto& d : n.devices()) out[d.id()] = &d;
  }
  return out;
}

}  // namespace

double Fp32Flops(const v1::Device& d) {
  for (const auto& f : d.flops()) {
    if (f.dtype() == v1::FLOAT32) return f.flops();
  }
  return d.flops_size() > 0 ? d.flops(0).flops() : 0;
}

bool CalibrationHolds(const v1::Device& old, const v1::Device& now) {
  if (!old.has_calibration()) return false;
  const double then = old.calibration().probed_flops();
  const double flops = Fp32Flops(now);
  return then > 0 && flops > 0 && std::abs(flops / then - 1) <= kCalibrationFlopsTolerance;
}

absl::StatusOr<std::map<std::string, v1::DeviceCalibration>> FitDeviceCalibration(
    const v1::Cluster& raw, const v1::Plan& plan, const std::vector<v1::StepProfile>& profiles,
    const std::string& deployment, absl::Time now) {
  if (plan.rank_programs_size() != plan.devices_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(plan.name(), ": the whole plan (with its rank programs) is needed"));
  }
  calibrate::ProfiledRun run;
  run.plan = plan;
  run.source = absl::StrCat("deployment ", deployment);
  for (const v1::StepProfile& p : profiles) {
    if (p.steps() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", p.rank(), " of ", deployment, " has reported no profile yet"));
    }
    calibrate::RankProfile r;
    r.rank = p.rank();
    r.device = p.device();
    r.plan_content_hash = p.plan_content_hash();
    r.step_seconds_median = p.step_seconds_median();
    r.device_seconds = p.device_seconds();
    r.op_seconds.insert(p.op_seconds().begin(), p.op_seconds().end());
    run.ranks.push_back(std::move(r));
  }
  // The model's side is the uncalibrated model: the devices as measured.
  v1::Cluster measured = raw;
  for (auto& n : *measured.mutable_nodes()) {
    for (auto& d : *n.mutable_devices()) d.clear_calibration();
  }
  calibrate::CalibrateOptions co;
  co.fit_fixed_time = false;  // one run, one share per device
  absl::StatusOr<calibrate::Calibration> fit = calibrate::Calibrate(measured, {run}, co);
  if (!fit.ok()) return Annotate(fit.status(), absl::StrCat("calibrating from ", deployment));
  const calibrate::Calibration& cal = *fit;
  const auto fitted = DevicesById(cal.cluster);
  const auto probed = DevicesById(measured);
  const auto before = DevicesById(raw);  // with their earlier calibrations
  const bool pipelined = lower::IsPipelinePlan(plan);
  double step = 0;
  for (const auto& p : profiles) step = std::max(step, p.step_seconds_median());
  std::map<std::string, v1::DeviceCalibration> out;
  for (const std::string& id : plan.devices()) {
    const v1::Device& f = *fitted.at(id);  // Calibrate checked every device is there
    v1::DeviceCalibration c;
    c.mutable_op_time_scale()->insert(f.op_time_scale().begin(), f.op_time_scale().end());
    c.set_optimizer_seconds_per_element(f.optimizer_seconds_per_element());
    c.set_step_overhead_seconds(f.step_overhead_seconds());
    c.set_collective_overhead_seconds(cal.collective_overhead_seconds);
    c.set_transfer_scale(cal.transfer_scale);
    // What the run does not fit stays as it was: a pipeline run fits no
    // communication or step overhead, an SPMD run no stall between stages,
    // a run without collective calls (a replicated plan, one that assumed
    // overlap) no communication, a pipeline run whose profiles give no
    // stage its kernel time no stall.
    const v1::DeviceCalibration& was = before.at(id)->calibration();
    const bool had = before.at(id)->has_calibration();
    if (pipelined) {
      c.set_step_overhead_seconds(was.step_overhead_seconds());
      c.set_collective_overhead_seconds(was.collective_overhead_seconds());
      c.set_transfer_scale(was.transfer_scale());
      c.set_pipeline_transfer_overhead_seconds(cal.pipeline_runs > 0
                                                   ? cal.pipeline_transfer_overhead_seconds
                                                   : was.pipeline_transfer_overhead_seconds());
    } else {
      c.set_pipeline_transfer_overhead_seconds(was.pipeline_transfer_overhead_seconds());
      if (cal.collective_calls == 0 && had) {
        c.set_collective_overhead_seconds(was.collective_overhead_seconds());
        c.set_transfer_scale(was.transfer_scale());
      }
    }
    c.set_probed_flops(Fp32Flops(*probed.at(id)));
    c.set_plan(plan.name());
    c.set_deployment(deployment);
    *c.mutable_fit_time() =
        google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(now));
    c.set_measured_step_seconds(step);
    out[id] = std::move(c);
  }
  return out;
}

std::string ApplyCalibration(v1::Cluster* cluster, const std::vector<std::string>& devices) {
  std::vector<const v1::Device*> calibrated;
  for (const auto& n : cluster->nodes()) {
    for (const auto& d : n.devices()) {
      if (d.has_calibration()) calibrated.push_back(&d);
    }
  }
  if (calibrated.empty()) return "";
  const std::set<std::string> chosen(devices.begin(), devices.end());
  // Decided first (`calibrated` points into the cluster), applied after.
  struct Use {
    v1::DeviceCalibration c;
    double speed = 1;  // the borrowing device's FLOP/s ratio: its times x 1/speed
    std::string note;
  };
  std::map<std::string, Use> use;
  for (const auto& n : cluster->nodes()) {
    for (const auto& d : n.devices()) {
      if (!chosen.count(d.id())) continue;
      if (d.has_calibration()) {
        use[d.id()] = {d.calibration(), 1,
                       absl::StrCat(d.id(), ": ", d.calibration().deployment(), " (",
                                    d.calibration().plan(), ")")};
        continue;
      }
      const double flops = Fp32Flops(d);
      const v1::Device* best = nullptr;
      for (const v1::Device* c : calibrated) {
        if (c->kind() != d.kind()) continue;
        const double gap = std::abs(std::log(std::max(Fp32Flops(*c), 1.0) / std::max(flops, 1.0)));
        if (best == nullptr ||
            gap < std::abs(std::log(std::max(Fp32Flops(*best), 1.0) / std::max(flops, 1.0)))) {
          best = c;
        }
      }
      if (best == nullptr) continue;
      const double then = best->calibration().probed_flops();
      use[d.id()] = {best->calibration(), then > 0 && flops > 0 ? flops / then : 1,
                     absl::StrCat(d.id(), ": borrowed from ", best->id())};
    }
  }
  if (use.empty()) return "";
  double overhead = 0, transfer = 1, handoff = 0;
  std::vector<std::string> notes;
  for (auto& n : *cluster->mutable_nodes()) {
    for (auto& d : *n.mutable_devices()) {
      auto it = use.find(d.id());
      if (it == use.end()) continue;
      const Use& u = it->second;
      d.clear_op_time_scale();
      d.mutable_op_time_scale()->insert(u.c.op_time_scale().begin(), u.c.op_time_scale().end());
      d.set_optimizer_seconds_per_element(u.c.optimizer_seconds_per_element() / u.speed);
      d.set_step_overhead_seconds(u.c.step_overhead_seconds() / u.speed);
      overhead = std::max(overhead, u.c.collective_overhead_seconds());
      handoff = std::max(handoff, u.c.pipeline_transfer_overhead_seconds());
      if (u.c.transfer_scale() > 0) transfer = std::max(transfer, u.c.transfer_scale());
      notes.push_back(u.note);
    }
  }
  v1::LinkDefaults* def = cluster->mutable_defaults();
  def->set_collective_overhead_seconds(std::max(def->collective_overhead_seconds(), overhead));
  def->set_pipeline_transfer_overhead_seconds(
      std::max(def->pipeline_transfer_overhead_seconds(), handoff));
  if (transfer != 1) {
    def->set_intra_node_bandwidth_bytes_per_second(def->intra_node_bandwidth_bytes_per_second() /
                                                   transfer);
    def->set_inter_node_bandwidth_bytes_per_second(def->inter_node_bandwidth_bytes_per_second() /
                                                   transfer);
    for (auto& l : *cluster->mutable_links()) {
      l.set_bandwidth_bytes_per_second(l.bandwidth_bytes_per_second() / transfer);
    }
  }
  std::sort(notes.begin(), notes.end());
  return absl::StrJoin(notes, "; ");
}

}  // namespace hap::service
