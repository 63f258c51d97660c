// The planner core's node registry (planner_core_nodes.cc): registration
// and re-registration, heartbeats checked like registrations, liveness and
// expiry, deletion, stored nodes at start, and the per-device calibration
// fitted from deployments' profiles.
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "common/proto_time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/service/core/planner_core.h"
#include "planner/service/core/planner_core_test_util.h"

namespace hap::service {
namespace {

namespace v1 = ::hap::v1;
using ::hap::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using testing_internal::MakeNode;
using testing_internal::MlpRequest;
using testing_internal::PlannerCoreTest;

// --- Node profiles -------------------------------------------------------

// The planner's own calibration (issue 19): fitted from a deployment's rank
// profiles, stored with the nodes, used by later plans unless asked not to,
// kept across a re-probe that measures about the same, dropped (and then
// borrowed from a device of the same kind) when it measures otherwise.
// Every rank of `plan` profiled 20 steps from step 2: median step `step`,
// kernels `kernels` s of which linear 0.02 s (+0.01 s per rank), optimizer
// 1 ms, runtime 2 ms.
std::vector<v1::StepProfile> Profiles(const v1::Plan& plan, double step, double kernels) {
  std::vector<v1::StepProfile> out;
  for (int r = 0; r < plan.devices_size(); ++r) {
    v1::StepProfile p;
    p.set_rank(r);
    p.set_device(plan.devices(r));
    p.set_plan_content_hash(plan.content_hash());
    p.set_first_step(2);
    p.set_steps(20);
    p.set_step_seconds_median(step);
    p.set_device_seconds(kernels);
    (*p.mutable_op_seconds())["linear"] = 0.02 + 0.01 * r;
    (*p.mutable_op_seconds())["(optimizer)"] = 0.001;
    (*p.mutable_op_seconds())["(runtime)"] = 0.002;
    out.push_back(p);
  }
  return out;
}

TEST_F(PlannerCoreTest, ReRegistrationDoesNotDuplicateAndDevicesAreOwnedOnce) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 3, 2e12)).ok());
  auto nodes = core_->ListNodes(0, "");
  ASSERT_TRUE(nodes.ok());
  ASSERT_EQ(nodes->nodes_size(), 1);
  EXPECT_EQ(nodes->nodes(0).devices_size(), 3);
  v1::Node thief = MakeNode("b", 1, 1e12);
  thief.mutable_devices(0)->set_id("a/cpu0");
  EXPECT_THAT(core_->RegisterNode(thief),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("'a/cpu0'")));
  v1::Node bad = MakeNode("c", 1, 0);
  EXPECT_THAT(core_->RegisterNode(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("FLOP/s")));
}

TEST_F(PlannerCoreTest, ANodeThatStopsHeartbeatingGoesStaleAndIsLeftOut) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(5));
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    auto r = core_->Heartbeat(hb);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->unknown_node());
    // The interval, as at registration: an agent registered under another
    // takes it.
    EXPECT_EQ(hap::service::FromProto(r->heartbeat_interval()), absl::Seconds(5));
  }
  v1::Cluster live = core_->GetCluster(false);
  ASSERT_EQ(live.nodes_size(), 1);
  EXPECT_EQ(live.nodes(0).name(), "a");
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
  auto p = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->devices_size(), 2);
  for (const auto& d : p->devices()) EXPECT_EQ(d.rfind("a/", 0), 0u) << d;
  // Asking for a stale device by name says why.
  v1::CreatePlanRequest r = MlpRequest();
  r.add_devices("a/cpu0");
  r.add_devices("b/cpu0");
  EXPECT_THAT(core_->CreatePlan(r, Deadline()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale")));
  // A heartbeat brings it back, with a request to measure again.
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/b");
  auto back = core_->Heartbeat(hb);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->reprobe());
  EXPECT_EQ(core_->GetCluster(false).nodes_size(), 2);
  hb.set_name("nodes/nobody");
  EXPECT_TRUE(core_->Heartbeat(hb)->unknown_node());
}

// Two agents with one node name (two containers with one hostname): each
// heartbeat was taken, the devices of both interleaved in one node, and the
// node's address was the last registration's. A heartbeat from another
// address than the node's is now not taken and says who holds the node;
// once that agent goes silent (STALE) the other is told to register again
// and takes the node over. Heartbeats without an address (agents before
// it) are taken as before.
TEST_F(PlannerCoreTest, AHeartbeatFromAnotherAgentThanTheNodesIsNotTaken) {
  v1::Node first = MakeNode("a", 2, 2e12);
  first.set_address("10.0.0.1:7001");
  ASSERT_TRUE(core_->RegisterNode(first).ok());
  v1::Node second = MakeNode("a", 1, 1e12);
  second.set_address("10.0.0.2:7001");
  ASSERT_TRUE(core_->RegisterNode(second).ok());
  const int64_t registered = core_->GetCluster(true).nodes(0).last_heartbeat().seconds();

  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  hb.set_address("10.0.0.1:7001");
  *hb.add_devices() = first.devices(0);
  clock_.Advance(absl::Seconds(5));
  auto r = core_->Heartbeat(hb);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->registered_by(), "10.0.0.2:7001");
  EXPECT_FALSE(r->unknown_node());
  v1::Node n = core_->GetCluster(true).nodes(0);
  EXPECT_EQ(n.address(), "10.0.0.2:7001");
  ASSERT_EQ(n.devices_size(), 1);  // the second's, not replaced by the first's
  EXPECT_DOUBLE_EQ(n.devices(0).flops(0).flops(), 1e12);
  EXPECT_EQ(n.last_heartbeat().seconds(), registered)
      << "a heartbeat not taken does not keep the node alive";

  // The holder heartbeats (and an agent that sends no address is taken).
  v1::HeartbeatRequest own;
  own.set_name("nodes/a");
  own.set_address("10.0.0.2:7001");
  EXPECT_EQ(core_->Heartbeat(own)->registered_by(), "");
  own.clear_address();
  EXPECT_EQ(core_->Heartbeat(own)->registered_by(), "");

  // The holder goes silent: the node is STALE, and the other agent is told
  // to register again (it takes the node over).
  hb.clear_devices();
  clock_.Advance(absl::Seconds(16));
  r = core_->Heartbeat(hb);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->unknown_node());
  EXPECT_EQ(r->registered_by(), "");
  ASSERT_TRUE(core_->RegisterNode(first).ok());
  EXPECT_EQ(core_->Heartbeat(hb)->registered_by(), "");
  EXPECT_EQ(core_->GetCluster(false).nodes(0).address(), "10.0.0.1:7001");
}

TEST_F(PlannerCoreTest, ANodeTheStoreRefusesIsNotRegisteredNorUpdated) {
  sink_.RefuseNodes(true);
  EXPECT_THAT(core_->RegisterNode(MakeNode("a", 2, 2e12)),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("node 'a' was not registered"),
                             HasSubstr("database or disk is full"))));
  EXPECT_EQ(core_->ListNodes(0, "")->nodes_size(), 0);
  sink_.RefuseNodes(false);
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  // A heartbeat with re-measured devices the store refuses changes nothing.
  sink_.RefuseNodes(true);
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  *hb.mutable_devices() = MakeNode("a", 3, 2e12).devices();
  EXPECT_THAT(core_->Heartbeat(hb),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("node 'a'")));
  EXPECT_EQ(core_->ListNodes(0, "")->nodes(0).devices_size(), 2);
}

TEST_F(PlannerCoreTest, CalibratesDevicesFromProfilesAndLaterPlansUseIt) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->state(), v1::Plan::SUCCEEDED) << first->error();
  EXPECT_EQ(first->calibration(), "");  // nothing calibrated yet
  auto full = core_->GetPlan(first->name(), true);
  ASSERT_TRUE(full.ok());
  std::vector<v1::StepProfile> profiles = Profiles(*full, 0.05, 0.04);
  EXPECT_THAT(core_->CalibrateDevices(first->name(), "deployments/d1", {profiles[0]}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("profiles of 1 of the plan's 2 ranks")));
  EXPECT_THAT(core_->CalibrateDevices("plans/none", "deployments/d1", profiles),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plans/none")));
  auto line = core_->CalibrateDevices(first->name(), "deployments/d1", profiles);
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(*line, HasSubstr("from deployments/d1 (measured 0.0500 s)"));
  std::map<std::string, v1::Device> devices;
  const v1::Cluster cluster = core_->GetCluster(true);
  for (const auto& n : cluster.nodes()) devices[n.devices(0).id()] = n.devices(0);
  ASSERT_TRUE(devices.at("a/cpu0").has_calibration());
  const v1::DeviceCalibration& ca = devices.at("a/cpu0").calibration();
  EXPECT_EQ(ca.deployment(), "deployments/d1");
  EXPECT_EQ(ca.plan(), first->name());
  EXPECT_DOUBLE_EQ(ca.probed_flops(), 2e12);
  EXPECT_GT(ca.op_time_scale().at("linear"), 1);  // the model's 2 TFLOP/s is optimistic
  EXPECT_GT(ca.optimizer_seconds_per_element(), 0);
  EXPECT_DOUBLE_EQ(devices.at("b/cpu0").calibration().measured_step_seconds(), 0.05);
  {
    absl::MutexLock l(&sink_.mu);  // saved with the nodes
    EXPECT_TRUE(sink_.nodes.at("a").devices(0).has_calibration());
  }
  // A new plan uses it and says so; asked not to, the raw model as before.
  v1::CreatePlanRequest again = MlpRequest();
  again.set_plan_id("calibrated");
  auto calibrated = core_->CreatePlan(again, Deadline());
  ASSERT_TRUE(calibrated.ok()) << calibrated.status();
  ASSERT_EQ(calibrated->state(), v1::Plan::SUCCEEDED) << calibrated->error();
  EXPECT_THAT(calibrated->calibration(),
              AllOf(HasSubstr("a/cpu0: deployments/d1 (" + first->name() + ")"),
                    HasSubstr("b/cpu0: deployments/d1")));
  EXPECT_GT(calibrated->prediction().step_seconds(), 5 * first->prediction().step_seconds());
  v1::CreatePlanRequest raw = MlpRequest();
  raw.set_plan_id("raw");
  raw.mutable_options()->set_ignore_calibration(true);
  auto uncalibrated = core_->CreatePlan(raw, Deadline());
  ASSERT_TRUE(uncalibrated.ok()) << uncalibrated.status();
  EXPECT_EQ(uncalibrated->calibration(), "");
  EXPECT_DOUBLE_EQ(uncalibrated->prediction().step_seconds(), first->prediction().step_seconds());
  // Re-probed at about the same FLOP/s: kept; at 25% less: dropped, and a
  // plan borrows b's calibration for it.
  auto heartbeat = [&](double flops) {
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    *hb.mutable_devices() = MakeNode("a", 1, flops).devices();
    return core_->Heartbeat(hb);
  };
  ASSERT_TRUE(heartbeat(2.1e12).ok());
  EXPECT_TRUE(core_->GetCluster(true).nodes(0).devices(0).has_calibration());
  ASSERT_TRUE(heartbeat(1.5e12).ok());
  EXPECT_FALSE(core_->GetCluster(true).nodes(0).devices(0).has_calibration());
  EXPECT_TRUE(core_->GetCluster(true).nodes(1).devices(0).has_calibration());
  v1::CreatePlanRequest borrowed = MlpRequest();
  borrowed.set_plan_id("borrowed");
  auto b = core_->CreatePlan(borrowed, Deadline());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->calibration(), HasSubstr("a/cpu0: borrowed from b/cpu0"));
  // A re-registration keeps b's (same FLOP/s).
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  EXPECT_TRUE(core_->GetCluster(true).nodes(1).devices(0).has_calibration());
}

// A fit past the bounds a restart checks stored calibrations by (an op
// scale of 1e6 or more) is not applied: it planned until the next start,
// which then dropped it and changed the plans.
TEST_F(PlannerCoreTest, ACalibrationFittedOutOfRangeIsNotApplied) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  auto full = core_->GetPlan(first->name(), true);
  ASSERT_TRUE(full.ok());
  std::vector<v1::StepProfile> profiles = Profiles(*full, 3e4, 2.9e4);
  for (auto& p : profiles) (*p.mutable_op_seconds())["linear"] = 2.9e4;
  EXPECT_THAT(core_->CalibrateDevices(first->name(), "deployments/d1", profiles),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("op_time_scale[\"linear\"] must be a finite number > 0 "
                                       "and below 1e+06"),
                             HasSubstr("(not applied)"))));
  const v1::Cluster cluster = core_->GetCluster(true);
  for (const auto& n : cluster.nodes()) EXPECT_FALSE(n.devices(0).has_calibration()) << n.name();
}

// A calibration the store takes for one node and refuses for the next (the
// disk filled between the two saves) fails the call, and the core serves
// what the store holds: a restart neither brings back a calibration the
// caller did not see nor loses one it served.
TEST_F(PlannerCoreTest, ACalibrationTheStoreRefusesPartWayLeavesTheNodesAsStored) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->state(), v1::Plan::SUCCEEDED) << first->error();
  auto full = core_->GetPlan(first->name(), true);
  ASSERT_TRUE(full.ok());
  sink_.RefuseNode("b");  // "a" is saved first (name order), then the disk is full
  EXPECT_THAT(core_->CalibrateDevices(first->name(), "deployments/d1", Profiles(*full, 0.05, 0.04)),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("the calibration of node 'b' was not saved"),
                             HasSubstr("database or disk is full"))));
  std::map<std::string, bool> served, stored;
  const v1::Cluster cluster = core_->GetCluster(true);
  for (const auto& n : cluster.nodes()) served[n.name()] = n.devices(0).has_calibration();
  for (const auto& n : sink_.Nodes()) stored[n.name()] = n.devices(0).has_calibration();
  EXPECT_EQ(served, stored);
  EXPECT_FALSE(served.at("b"));
}

// A deployment whose executor reported NaN, negative or absurdly large
// seconds (status reports are not checked on the way in) calibrates
// nothing: the call says which rank and number, the devices keep no
// calibration and later plans are made as before (a NaN
// optimizer_seconds_per_element was stored, and every later plan on the
// devices failed on it).
TEST_F(PlannerCoreTest, AProfileWithSecondsNoRunHasCalibratesNothing) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto first = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(first.ok() && first->state() == v1::Plan::SUCCEEDED) << first.status();
  auto full = core_->GetPlan(first->name(), true);
  ASSERT_TRUE(full.ok());
  const std::pair<const char*, double> bad[] = {
      {"(optimizer)", std::nan("")}, {"(runtime)", -1}, {"linear", 1e300}};
  for (const auto& [type, secs] : bad) {
    std::vector<v1::StepProfile> profiles = Profiles(*full, 0.05, 0.04);
    (*profiles[1].mutable_op_seconds())[type] = secs;
    EXPECT_THAT(core_->CalibrateDevices(first->name(), "deployments/d1", profiles),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("deployments/d1"),
                               HasSubstr(absl::StrCat("rank 1's op_seconds['", type, "']")))));
  }
  std::vector<v1::StepProfile> nan_step = Profiles(*full, 0.05, 0.04);
  nan_step[0].set_step_seconds_median(std::nan(""));
  EXPECT_THAT(core_->CalibrateDevices(first->name(), "deployments/d1", nan_step),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step_seconds_median")));
  const v1::Cluster cluster = core_->GetCluster(true);
  for (const auto& n : cluster.nodes()) {
    EXPECT_FALSE(n.devices(0).has_calibration()) << n.DebugString();
  }
  v1::CreatePlanRequest again = MlpRequest();
  again.set_plan_id("again");
  auto p = core_->CreatePlan(again, Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  EXPECT_DOUBLE_EQ(p->prediction().step_seconds(), first->prediction().step_seconds());
}

// A deployment of a pipeline plan (two stages of one device) whose steps
// take far longer than its kernels: its devices get the stall per transfer
// between stages that explains it, keep what the earlier SPMD run fitted of
// communication, and the next pipeline plan prices the stall.
TEST_F(PlannerCoreTest, APipelineRunCalibratesTheStallBetweenStagesAndKeepsTheRest) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  auto spmd = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(spmd.ok() && spmd->state() == v1::Plan::SUCCEEDED) << spmd.status();
  auto spmd_full = core_->GetPlan(spmd->name(), true);
  ASSERT_TRUE(spmd_full.ok());
  ASSERT_TRUE(core_->CalibrateDevices(spmd->name(), "deployments/d1",
                                      Profiles(*spmd_full, 0.08, 0.04)).ok());
  const v1::DeviceCalibration before = core_->GetCluster(true).nodes(0).devices(0).calibration();

  auto pipe_request = [](const std::string& id) {
    v1::CreatePlanRequest r = MlpRequest();
    r.set_plan_id(id);
    r.mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
    r.mutable_options()->set_pipeline_stages(2);
    r.mutable_options()->set_pipeline_microbatches(2);
    return r;
  };
  auto pipe = core_->CreatePlan(pipe_request("pipe"), Deadline());
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_EQ(pipe->state(), v1::Plan::SUCCEEDED) << pipe->error();
  auto full = core_->GetPlan(pipe->name(), true);
  ASSERT_TRUE(full.ok());
  ASSERT_EQ(full->pipeline().stages_size(), 2);
  auto line = core_->CalibrateDevices(pipe->name(), "deployments/d2", Profiles(*full, 2.0, 0.04));
  ASSERT_TRUE(line.ok()) << line.status();
  const v1::DeviceCalibration after = core_->GetCluster(true).nodes(0).devices(0).calibration();
  EXPECT_EQ(after.plan(), pipe->name());
  // 2 s steps from 40 ms of kernels, two microbatches: the 1F1B schedule
  // needs well over 100 ms per transfer to take that long.
  EXPECT_GT(after.pipeline_transfer_overhead_seconds(), 0.1);
  EXPECT_LT(after.pipeline_transfer_overhead_seconds(), 2.0);
  EXPECT_DOUBLE_EQ(after.collective_overhead_seconds(), before.collective_overhead_seconds());
  EXPECT_DOUBLE_EQ(after.transfer_scale(), before.transfer_scale());
  EXPECT_DOUBLE_EQ(after.step_overhead_seconds(), before.step_overhead_seconds());
  auto again = core_->CreatePlan(pipe_request("pipe-again"), Deadline());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->state(), v1::Plan::SUCCEEDED) << again->error();
  EXPECT_GT(again->prediction().step_seconds(),
            pipe->prediction().step_seconds() + after.pipeline_transfer_overhead_seconds());
}

// What a run cannot fit stays as the device's earlier calibration had it:
// a plan that replicates the work makes no collective call, a pipeline run
// whose profiles give no stage its kernel time fits no stall between
// stages. Both were reset (the collective overhead to the registry's
// default, 0; the stall to 0), so later plans priced collectives or stage
// transfers as free, and the plan the fitted overhead had made replicated
// undid that fit with its own run.
TEST_F(PlannerCoreTest, WhatARunDoesNotFitStaysAsTheDevicesEarlierCalibration) {
  // Devices slow enough that data parallelism beats replicating the work.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e9)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e9)).ok());
  auto plan = [&](v1::CreatePlanRequest r, const std::string& id) -> absl::StatusOr<v1::Plan> {
    r.set_plan_id(id);
    auto p = core_->CreatePlan(r, Deadline());
    if (!p.ok()) return p.status();
    if (p->state() != v1::Plan::SUCCEEDED) return absl::InternalError(p->error());
    return core_->GetPlan(p->name(), true);
  };
  v1::CreatePlanRequest dp = MlpRequest();
  // A batch whose compute the replicated program cannot beat: data
  // parallel, with a gradient all-reduce a step.
  (*dp.mutable_model()->mutable_zoo()->mutable_params())["batch"] = 4096;
  auto spmd = plan(dp, "spmd");
  ASSERT_TRUE(spmd.ok()) << spmd.status();
  ASSERT_TRUE(
      core_->CalibrateDevices(spmd->name(), "deployments/d1", Profiles(*spmd, 0.08, 0.04)).ok());
  const v1::DeviceCalibration fitted = core_->GetCluster(true).nodes(0).devices(0).calibration();
  ASSERT_GT(fitted.collective_overhead_seconds(), 0);

  // The calibrated collective overhead makes the small batch's plan
  // replicate the work: no collective call to fit.
  auto replicated = plan(MlpRequest(), "replicated");
  ASSERT_TRUE(replicated.ok()) << replicated.status();
  for (const auto& st : replicated->rank_programs(0).steps()) ASSERT_FALSE(st.has_collective());
  ASSERT_TRUE(core_
                  ->CalibrateDevices(replicated->name(), "deployments/d2",
                                     Profiles(*replicated, 0.08, 0.04))
                  .ok());
  v1::DeviceCalibration now = core_->GetCluster(true).nodes(0).devices(0).calibration();
  EXPECT_EQ(now.deployment(), "deployments/d2");
  EXPECT_DOUBLE_EQ(now.collective_overhead_seconds(), fitted.collective_overhead_seconds());
  EXPECT_DOUBLE_EQ(now.transfer_scale(), fitted.transfer_scale());

  v1::CreatePlanRequest piped = MlpRequest();
  piped.mutable_options()->set_pipeline(v1::PlanOptions::PIPELINE_STAGES);
  piped.mutable_options()->set_pipeline_stages(2);
  piped.mutable_options()->set_pipeline_microbatches(2);
  auto pipe = plan(piped, "pipe");
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_TRUE(
      core_->CalibrateDevices(pipe->name(), "deployments/d3", Profiles(*pipe, 2.0, 0.04)).ok());
  const double stall = core_->GetCluster(true)
                           .nodes(0)
                           .devices(0)
                           .calibration()
                           .pipeline_transfer_overhead_seconds();
  ASSERT_GT(stall, 0.1);
  // No kernel time reported (device_seconds 0): no stage's work, no stall fit.
  ASSERT_TRUE(
      core_->CalibrateDevices(pipe->name(), "deployments/d4", Profiles(*pipe, 2.0, 0)).ok());
  now = core_->GetCluster(true).nodes(0).devices(0).calibration();
  EXPECT_EQ(now.deployment(), "deployments/d4");
  EXPECT_DOUBLE_EQ(now.pipeline_transfer_overhead_seconds(), stall);
  EXPECT_DOUBLE_EQ(now.collective_overhead_seconds(), fitted.collective_overhead_seconds());
}

// A calibration is the planner's own (CalibrateDevices), never an agent's:
// one a node sends is dropped. It was dropped only when the node was
// registered already, so a first registration that carried one (a NaN op
// scale, an overhead of 1e300 s: no check applies to it) was kept and
// applied to every later plan on the device.
TEST_F(PlannerCoreTest, ACalibrationANodeSendsIsDroppedAtItsFirstRegistration) {
  v1::Node a = MakeNode("a", 1, 2e12);
  v1::DeviceCalibration& sent = *a.mutable_devices(0)->mutable_calibration();
  (*sent.mutable_op_time_scale())["linear"] = std::nan("");
  sent.set_collective_overhead_seconds(1e300);
  sent.set_probed_flops(2e12);
  sent.set_deployment("deployments/forged");
  auto registered = core_->RegisterNode(a);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_FALSE(registered->node().devices(0).has_calibration());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 1e12)).ok());
  EXPECT_FALSE(core_->GetCluster(true).nodes(0).devices(0).has_calibration());
  {
    absl::MutexLock l(&sink_.mu);
    EXPECT_FALSE(sink_.nodes.at("a").devices(0).has_calibration());
  }
  auto p = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  EXPECT_EQ(p->calibration(), "");
}

TEST_F(PlannerCoreTest, AHeartbeatIsCheckedLikeARegistration) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  auto heartbeat = [&](const v1::Node& measured) {
    v1::HeartbeatRequest hb;
    hb.set_name("nodes/a");
    *hb.mutable_devices() = measured.devices();
    return core_->Heartbeat(hb);
  };
  v1::Node nan_flops = MakeNode("a", 2, std::nan(""));
  EXPECT_THAT(heartbeat(nan_flops),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'a/cpu0'"), HasSubstr("FLOAT32 FLOP/s"),
                             HasSubstr("got nan"))));
  v1::Node negative_memory = MakeNode("a", 2, 2e12, -5);
  EXPECT_THAT(heartbeat(negative_memory),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'a/cpu0'"), HasSubstr("memory_bytes"), HasSubstr("-5"))));
  v1::Node theft = MakeNode("a", 2, 2e12);
  theft.mutable_devices(1)->set_id("b/cpu0");
  EXPECT_THAT(heartbeat(theft),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("device 'b/cpu0' is already registered by node 'b'")));
  v1::Node twice = MakeNode("a", 2, 2e12);
  twice.mutable_devices(1)->set_id("a/cpu0");
  EXPECT_THAT(heartbeat(twice),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unique, got 'a/cpu0'")));
  // None of them got in: the cluster still plans, on its four devices.
  auto p = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->state(), v1::Plan::SUCCEEDED) << p->error();
  EXPECT_EQ(p->devices_size(), 4);
  // A valid re-measurement is taken.
  ASSERT_TRUE(heartbeat(MakeNode("a", 3, 3e12)).ok());
  EXPECT_EQ(core_->GetCluster(false).nodes(0).devices_size(), 3);
}

TEST_F(PlannerCoreTest, MeasurementsThatAreNotFiniteNumbersAreRefusedAtRegistration) {
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(v1::Device&)> edit;
    std::string field, value;
  };
  std::vector<Case> cases = {
      {[&](v1::Device& d) { d.set_launch_overhead_seconds(nan); }, "launch_overhead_seconds",
       "nan"},
      {[&](v1::Device& d) { d.set_step_overhead_seconds(-1); }, "step_overhead_seconds", "-1"},
      {[&](v1::Device& d) { d.set_optimizer_seconds_per_element(inf); },
       "optimizer_seconds_per_element", "inf"},
      {[&](v1::Device& d) { d.set_tf32_flops(nan); }, "tf32_flops", "nan"},
      {[&](v1::Device& d) {
         auto* f = d.add_flops();
         f->set_dtype(v1::FLOAT16);
         f->set_flops(inf);
       },
       "FLOAT16 FLOP/s", "inf"},
      {[&](v1::Device& d) { (*d.mutable_op_time_scale())["linear"] = nan; },
       "op_time_scale[\"linear\"]", "nan"},
      {[&](v1::Device& d) { (*d.mutable_op_time_scale())["linear"] = 0; },
       "op_time_scale[\"linear\"]", "got 0"},
  };
  for (const Case& c : cases) {
    v1::Node n = MakeNode("a", 2, 2e12);
    c.edit(*n.mutable_devices(1));
    EXPECT_THAT(core_->RegisterNode(n),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("'a/cpu1'"), HasSubstr(c.field), HasSubstr(c.value))))
        << c.field;
  }
  EXPECT_EQ(core_->ListNodes(0, "")->nodes_size(), 0);

  // Links: a latency that is NaN or infinite, a bandwidth that is NaN.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  auto link = [](double bandwidth, double latency) {
    v1::Link l;
    l.set_src("a/cpu0");
    l.set_dst("a/cpu1");
    l.set_bandwidth_bytes_per_second(bandwidth);
    l.set_latency_seconds(latency);
    return std::vector<v1::Link>{l};
  };
  EXPECT_THAT(core_->ReportLinks("nodes/a", link(1e9, nan)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("a/cpu0 -> a/cpu1"), HasSubstr("latency_seconds"),
                             HasSubstr("got nan"))));
  EXPECT_THAT(core_->ReportLinks("nodes/a", link(1e9, inf)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("latency_seconds"), HasSubstr("got inf"))));
  EXPECT_THAT(core_->ReportLinks("nodes/a", link(nan, 1e-5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("bandwidth_bytes_per_second"), HasSubstr("got nan"))));
  EXPECT_EQ(core_->GetCluster(false).links_size(), 0);
  ASSERT_TRUE(core_->ReportLinks("nodes/a", link(1e9, 1e-5)).ok());
  EXPECT_EQ(core_->GetCluster(false).links_size(), 1);
  // A node reports links from its own devices only: b cannot overwrite a's.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 2e12)).ok());
  EXPECT_THAT(core_->ReportLinks("nodes/b", link(1, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("node 'b' reports link a/cpu0 -> a/cpu1 from a device it does "
                                 "not have")));
  EXPECT_DOUBLE_EQ(core_->GetCluster(false).links(0).bandwidth_bytes_per_second(), 1e9);
}

// A broken or lying agent may report any finite bandwidth; 1e30 B/s would
// make every transfer free in the plans. Above kMaxLinkBandwidth (no link
// carries it) the report is refused naming the node, the link and the
// value; an NVLink-class figure is taken.
TEST_F(PlannerCoreTest, ABandwidthNoLinkCarriesIsRefusedNamingTheNode) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  v1::Link l;
  l.set_src("a/cpu0");
  l.set_dst("a/cpu1");
  l.set_bandwidth_bytes_per_second(1e30);
  l.set_latency_seconds(1e-5);
  EXPECT_THAT(core_->ReportLinks("nodes/a", {l}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("node 'a'"), HasSubstr("a/cpu0 -> a/cpu1"),
                             HasSubstr("bandwidth_bytes_per_second"), HasSubstr("got 1e+30"))));
  EXPECT_EQ(core_->GetCluster(false).links_size(), 0);
  l.set_bandwidth_bytes_per_second(9e11);
  EXPECT_TRUE(core_->ReportLinks("nodes/a", {l}).ok());
  EXPECT_EQ(core_->GetCluster(false).links_size(), 1);
}

// A link report from another agent than the node's (two agents with one
// --name, on two machines) is refused naming both: its measurements were
// made elsewhere and were taken as the node's. One without an address (an
// agent before ReportLinksRequest.address) is taken, as a heartbeat's is.
TEST_F(PlannerCoreTest, LinksReportedByAnotherAgentThanTheNodesAreRefused) {
  v1::Node a = MakeNode("a", 2, 2e12);
  a.set_address("10.0.0.1:7071");
  ASSERT_TRUE(core_->RegisterNode(a).ok());
  v1::Link l;
  l.set_src("a/cpu0");
  l.set_dst("a/cpu1");
  l.set_bandwidth_bytes_per_second(9e11);
  l.set_latency_seconds(1e-5);
  EXPECT_THAT(core_->ReportLinks("nodes/a", {l}, "10.0.0.2:7071"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("node 'a' is registered by the agent at 10.0.0.1:7071; links "
                                 "reported by the agent at 10.0.0.2:7071 are not taken")));
  EXPECT_EQ(core_->GetCluster(false).links_size(), 0);
  EXPECT_TRUE(core_->ReportLinks("nodes/a", {l}, "10.0.0.1:7071").ok());
  EXPECT_TRUE(core_->ReportLinks("nodes/a", {l}).ok());
  EXPECT_EQ(core_->GetCluster(false).links_size(), 1);
}

// Links are measurements of devices: those of a device its node no longer
// reports (a registration or heartbeat without it) are dropped, so a device
// that comes back is not planned with links measured before it went.
TEST_F(PlannerCoreTest, LinksOfADeviceItsNodeNoLongerReportsAreDropped) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 3, 2e12)).ok());
  auto link = [](const std::string& src, const std::string& dst) {
    v1::Link l;
    l.set_src(src);
    l.set_dst(dst);
    l.set_bandwidth_bytes_per_second(1e9);
    l.set_latency_seconds(1e-5);
    return l;
  };
  ASSERT_TRUE(core_
                  ->ReportLinks("a", {link("a/cpu0", "a/cpu1"), link("a/cpu1", "a/cpu2"),
                                      link("a/cpu0", "a/cpu2")})
                  .ok());
  ASSERT_EQ(core_->GetCluster(false).links_size(), 3);
  auto links = [&] {
    std::set<std::string> out;
    const v1::Cluster c = core_->GetCluster(false);
    for (const auto& l : c.links()) {
      out.insert(l.src() + ">" + l.dst());
    }
    return out;
  };
  // A heartbeat re-measured without a/cpu2, then a registration with it again.
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  *hb.mutable_devices() = MakeNode("a", 2, 2e12).devices();
  ASSERT_TRUE(core_->Heartbeat(hb).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 3, 2e12)).ok());
  EXPECT_EQ(links(), (std::set<std::string>{"a/cpu0>a/cpu1"}));
  // A registration without a/cpu1 drops its last link.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 1, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 3, 2e12)).ok());
  EXPECT_TRUE(links().empty());
}

// A database written before registrations were checked may hold nodes
// that no registration would let in now: they are not loaded (and said
// so), and the good ones plan as before.
TEST_F(PlannerCoreTest, StoredNodesThatFailTheChecksAreNotLoaded) {
  v1::Node good = MakeNode("a", 2, 1e12);
  v1::Node nan = MakeNode("b", 1, std::nan(""));
  v1::Node thief = MakeNode("c", 1, 1e12);
  thief.mutable_devices(0)->set_id("a/cpu0");  // a's device
  v1::Node negative = MakeNode("d", 1, 1e12, -5);
  Start({thief, nan, good, negative}, {});
  const v1::Cluster cluster = core_->GetCluster(true);
  ASSERT_EQ(cluster.nodes_size(), 1);
  EXPECT_EQ(cluster.nodes(0).name(), "a");
  const auto& notes = core_->StartNotes();
  ASSERT_EQ(notes.size(), 3u);
  EXPECT_THAT(notes[0], AllOf(HasSubstr("'b'"), HasSubstr("not loaded")));
  EXPECT_THAT(notes[1], AllOf(HasSubstr("'c'"), HasSubstr("a/cpu0")));
  EXPECT_THAT(notes[2], HasSubstr("'d'"));
  // Its agent back, a's devices plan alone (no "device id appears twice").
  ASSERT_TRUE(core_->RegisterNode(good).ok());
  auto plan = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->state(), v1::Plan::SUCCEEDED);
  // The node's agent registering again (with good measurements) is let in.
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 1, 2e12)).ok());
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
}

// A database written by a planner that kept the calibration a node sent
// (before RegisterNode dropped it) may hold one that fails every plan on the
// cluster: it is dropped at load, and said so; the node stays.
TEST_F(PlannerCoreTest, AStoredCalibrationThatFailsTheChecksIsDroppedAtLoad) {
  v1::Node forged = MakeNode("a", 1, 2e12);
  v1::DeviceCalibration& c = *forged.mutable_devices(0)->mutable_calibration();
  (*c.mutable_op_time_scale())["linear"] = std::nan("");
  c.set_probed_flops(2e12);
  v1::Node fitted = MakeNode("b", 1, 1e12);
  v1::DeviceCalibration& ok = *fitted.mutable_devices(0)->mutable_calibration();
  (*ok.mutable_op_time_scale())["linear"] = 1.5;
  ok.set_collective_overhead_seconds(0.002);
  ok.set_transfer_scale(2.7);
  ok.set_probed_flops(1e12);
  Start({forged, fitted}, {});
  const v1::Cluster cluster = core_->GetCluster(true);
  ASSERT_EQ(cluster.nodes_size(), 2);
  EXPECT_FALSE(cluster.nodes(0).devices(0).has_calibration());
  EXPECT_TRUE(cluster.nodes(1).devices(0).has_calibration());
  ASSERT_EQ(core_->StartNotes().size(), 1u);
  EXPECT_THAT(core_->StartNotes()[0],
              AllOf(HasSubstr("'a'"), HasSubstr("a/cpu0"), HasSubstr("op_time_scale[\"linear\"]"),
                    HasSubstr("dropped")));
  auto plan = core_->CreatePlan(MlpRequest(), Deadline());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->state(), v1::Plan::SUCCEEDED) << plan->error();
}

TEST_F(PlannerCoreTest, DeleteNodeRemovesTheNodeItsDevicesAndItsLinks) {
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  v1::Link l;
  l.set_src("a/cpu0");
  l.set_dst("b/cpu0");
  l.set_bandwidth_bytes_per_second(1e9);
  ASSERT_TRUE(core_->ReportLinks("nodes/a", {l}).ok());
  ASSERT_TRUE(core_->DeleteNode("nodes/b").ok());
  v1::Cluster c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 1);
  EXPECT_EQ(c.nodes(0).name(), "a");
  EXPECT_EQ(c.links_size(), 0);
  EXPECT_EQ(sink_.Nodes().size(), 1u);
  // Its agent is told to register again; its device ids are free.
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/b");
  EXPECT_TRUE(core_->Heartbeat(hb)->unknown_node());
  v1::Node heir = MakeNode("c", 1, 1e12);
  heir.mutable_devices(0)->set_id("b/cpu0");
  EXPECT_TRUE(core_->RegisterNode(heir).ok());
  EXPECT_THAT(core_->DeleteNode("nodes/b"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("node 'b' is not registered")));
  EXPECT_THAT(core_->DeleteNode("nodes/no such"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'nodes/no such'")));
  // A removal the store refuses leaves the node.
  sink_.RefuseNodes(true);
  EXPECT_THAT(core_->DeleteNode("c"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("node 'c' was not deleted")));
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
}

TEST_F(PlannerCoreTest, ANodeStaleLongerThanTheExpiryIsRemoved) {
  node_expiry_ = absl::Minutes(1);
  Start({}, {});
  ASSERT_TRUE(core_->RegisterNode(MakeNode("a", 2, 2e12)).ok());
  ASSERT_TRUE(core_->RegisterNode(MakeNode("b", 2, 1e12)).ok());
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  // b is stale after 15 s and expires 60 s later; a keeps heartbeating.
  for (int i = 0; i < 14; ++i) {
    clock_.Advance(absl::Seconds(5));
    ASSERT_TRUE(core_->Heartbeat(hb).ok());
  }
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);  // 70 s: stale, kept
  clock_.Advance(absl::Seconds(6));
  // While the store refuses the removal, the node stays, as stored.
  sink_.RefuseNodes(true);
  EXPECT_EQ(core_->GetCluster(true).nodes_size(), 2);
  sink_.RefuseNodes(false);
  v1::Cluster c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 1);
  EXPECT_EQ(c.nodes(0).name(), "a");
  EXPECT_EQ(sink_.Nodes().size(), 1u);
  hb.set_name("nodes/b");
  EXPECT_TRUE(core_->Heartbeat(hb)->unknown_node());
}

// A restarted planner does not blame nodes for the heartbeats they sent
// while no planner ran: a stored node whose last heartbeat is long past is
// READY at start and goes STALE only after missing heartbeats against the
// new planner (a job's deployment survives a planner restart).
TEST_F(PlannerCoreTest, ARestartDoesNotMakeStoredNodesStale) {
  v1::Node a = MakeNode("a", 2, 2e12);
  v1::Node b = MakeNode("b", 2, 1e12);
  const absl::Time long_ago = clock_.Now() - absl::Minutes(10);
  for (v1::Node* n : {&a, &b}) {
    n->mutable_last_heartbeat()->set_seconds(absl::ToUnixSeconds(long_ago));
  }
  Start({a, b}, {});
  v1::Cluster c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 2);
  for (const auto& n : c.nodes()) {
    EXPECT_EQ(n.state(), v1::Node::READY) << n.name();
  }
  v1::HeartbeatRequest hb;
  hb.set_name("nodes/a");
  // 16 s later (the limit is 3 x 5 s): a heartbeat, b did not.
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(4));
    ASSERT_TRUE(core_->Heartbeat(hb).ok());
  }
  c = core_->GetCluster(true);
  ASSERT_EQ(c.nodes_size(), 2);
  for (const auto& n : c.nodes()) {
    EXPECT_EQ(n.state(), n.name() == "b" ? v1::Node::STALE : v1::Node::READY) << n.name();
  }
}

}  // namespace
}  // namespace hap::service
