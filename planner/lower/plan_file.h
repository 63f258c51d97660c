// What an executor needs of a plan file (hap.v1.Plan) without the planner:
// the format version, the check that a plan fits a rank, and the hashes.
// No synthesis, no GLPK: executors and tools link this, not plan_builder.
#ifndef HAP_PLANNER_LOWER_PLAN_FILE_H_
#define HAP_PLANNER_LOWER_PLAN_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "hap/v1/plan.pb.h"

namespace hap::lower {

// The format_version this code writes. Version 2's content hash also
// covers cluster_hash, devices, global_batch and the pipeline stages;
// version 1's (plans saved before 2026-12-07, still in planners' stores and
// users' files) did not, and executors still run them.
inline constexpr int kPlanFormatVersion = 2;
// The oldest format_version executors accept.
inline constexpr int kOldestPlanFormatVersion = 1;

// Whether `plan` is a pipeline plan (more than one stage; README
// "Pipeline plans"): its ranks run stage programs on the microbatch model.
inline bool IsPipelinePlan(const hap::v1::Plan& plan) {
  return plan.pipeline().stages_size() > 1;
}

// Checks a plan an executor is about to run as rank `rank` of `world`:
// format version; rank programs for that world, each at its rank's place
// and lowered for the device Plan.devices lists there; the content hash;
// the graph and the cluster against their hashes; the global batch (its
// graph's). For a pipeline plan also that the stages chain (each receives
// what the one before sends) and that the rank's program is its stage's
// (rank in the group, activations received and sent, the microbatch split
// and loss seed). The hashes are checked where present. InvalidArgument
// naming what does not fit.
absl::Status CheckPlanForRank(const hap::v1::Plan& plan, int rank, int world);

// sha256 (hex) of the deterministic serialization of a message.
std::string Sha256Hex(const google::protobuf::Message& m);
// Plan.content_hash for the plan's format_version: sha256 over the
// program, ratios, rank programs, options and graph_hash; from version 2
// also cluster_hash, devices (rank order), global_batch and the pipeline
// plan: everything an executor's run depends on (the graph and the cluster
// through their own hashes). Not the name, state, prediction or progress.
std::string ContentHash(const hap::v1::Plan& plan);

// A hash (sha256, hex) of the collectives `p` issues, in order, as every
// rank of its world must issue them: each call's kind, method, dimensions,
// per-rank shard sizes, root, wire dtype and whether it runs behind
// compute, and its buffers' dtypes and global shapes; not what differs by
// rank (the rank's own shard, buffer ids, the kernels between). Ranks
// whose programs differ in it would wait for each other for ever or
// exchange wrong data.
std::string CollectiveSignature(const hap::v1::RankProgram& p);

}  // namespace hap::lower

#endif  // HAP_PLANNER_LOWER_PLAN_FILE_H_
