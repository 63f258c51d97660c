// Tests only: small whole plans (hap.v1.Plan with rank programs and a
// content hash), planned and lowered in process as `hapctl plan
// --save-plan` would, for a CPU cluster of `world` devices on one node.
#ifndef HAP_EXECUTOR_DAEMON_TEST_PLANS_H_
#define HAP_EXECUTOR_DAEMON_TEST_PLANS_H_

#include "absl/status/statusor.h"
#include "hap/v1/plan.pb.h"

namespace hap::executor::testing {

// A 3-layer MLP (batch 6 * world + 1, so shards are uneven), SGD with
// momentum, seed 7; with `overlap` planned and lowered with communication
// overlapping compute (gradient buckets started during backward).
absl::StatusOr<hap::v1::Plan> MakeMlpPlan(int world, bool overlap = false);

// A 4-layer MLP at batch 16 on 4 CPU devices in two nodes (2 each), SGD
// with momentum, seed 7: planned as 2 pipeline stages with 4 microbatches
// (the planner's pipeline search with PIPELINE_STAGES) when `pipelined`,
// else as one SPMD program.
absl::StatusOr<hap::v1::Plan> MakeMlpTwoNodePlan(bool pipelined);

}  // namespace hap::executor::testing

#endif  // HAP_EXECUTOR_DAEMON_TEST_PLANS_H_
