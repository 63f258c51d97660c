#include "planner/lower/plan_file.h"

#include <openssl/sha.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace hap::lower {

namespace v1 = ::hap::v1;

std::string Sha256Hex(const google::protobuf::Message& m) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream s(&bytes);
    google::protobuf::io::CodedOutputStream out(&s);
    out.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&out);
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

std::string CollectiveSignature(const v1::RankProgram& p) {
  // The calls, each buffer id replaced by the position of a buffer that
  // holds only what every rank agrees on (its dtype and global shape).
  v1::RankProgram sequence;
  auto agreed = [&](int id) -> int {
    if (id < 0) return id;  // absent
    v1::Buffer* b = sequence.add_buffers();
    if (id < p.buffers_size()) {  // else a program CheckProgram refuses
      b->set_dtype(p.buffers(id).dtype());
      *b->mutable_global_shape() = p.buffers(id).global_shape();
    }
    return sequence.buffers_size() - 1;
  };
  for (const v1::Step& step : p.steps()) {
    if (!step.has_collective()) continue;
    v1::CollectiveCall c = step.collective();
    c.set_input(agreed(c.input()));
    c.set_output(agreed(c.output()));
    for (int& id : *c.mutable_coalesced()) id = agreed(id);
    for (int& id : *c.mutable_coalesced_outputs()) id = agreed(id);
    *sequence.add_steps()->mutable_collective() = std::move(c);
  }
  return Sha256Hex(sequence);
}

std::string ContentHash(const v1::Plan& plan) {
  v1::Plan content;
  *content.mutable_program() = plan.program();
  *content.mutable_ratios() = plan.ratios();
  *content.mutable_rank_programs() = plan.rank_programs();
  *content.mutable_options() = plan.options();
  content.set_graph_hash(plan.graph_hash());
  if (plan.format_version() >= 2) {
    content.set_format_version(plan.format_version());
    content.set_cluster_hash(plan.cluster_hash());
    *content.mutable_devices() = plan.devices();
    content.set_global_batch(plan.global_batch());
    *content.mutable_pipeline() = plan.pipeline();
  }
  return Sha256Hex(content);
}

namespace {

// Plan.devices (rank order; optional in an SPMD plan whose programs name
// no device, unless `required`) against the rank programs: one per rank,
// and rank `rank`'s the device its program was lowered for. Executors pick
// their device by Plan.devices, which version 1's content hash does not
// cover (version 2's does; the check runs for both): a list edited out of
// order put ranks on devices their shares were not planned for, and one
// removed ran every rank on the CPU.
absl::Status CheckDevices(const v1::Plan& plan, int rank, bool required) {
  if (plan.devices_size() == 0 && !required && plan.rank_programs(rank).device().empty()) {
    return absl::OkStatus();
  }
  if (plan.devices_size() != plan.rank_programs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan lists ", plan.devices_size(),
                                                   " devices for its ", plan.rank_programs_size(),
                                                   " rank programs (one device per rank)"));
  }
  const std::string& lowered_for = plan.rank_programs(rank).device();
  if (!lowered_for.empty() && lowered_for != plan.devices(rank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan places rank ", rank, " on device '", plan.devices(rank),
                     "', but its program was lowered for '", lowered_for, "'"));
  }
  return absl::OkStatus();
}

// The batch BuildPlan records: the first input's first dimension, 1 for a
// graph without a batched input.
int64_t GraphBatch(const v1::Graph& g) {
  if (g.inputs_size() == 0 || g.inputs(0).tensor().shape_size() == 0) return 1;
  return g.inputs(0).tensor().shape(0);
}

// The tensor whose `role` buffer (STAGE_INPUT or STAGE_OUTPUT, named
// tensor + `suffix` by LowerStage) a stage program holds; empty if none.
std::string Boundary(const v1::RankProgram& p, v1::Buffer::Role role, absl::string_view suffix) {
  for (const v1::Buffer& b : p.buffers()) {
    if (b.role() == role) return std::string(absl::StripSuffix(b.tensor(), suffix));
  }
  return "";
}

// A stage boundary's tensor for messages: quoted, or "nothing".
std::string Named(const std::string& tensor) {
  return tensor.empty() ? std::string("nothing") : absl::StrCat("'", tensor, "'");
}

absl::Status CheckPipelinePlanForRank(const v1::Plan& plan, int rank, int world) {
  if (plan.rank_programs_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the pipeline plan (", plan.pipeline().stages_size(),
        " stages) has no rank programs: it was made before pipeline plans were executable; "
        "plan it again"));
  }
  if (world != plan.rank_programs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan is for a world of ",
                                                   plan.rank_programs_size(), " ranks, not ",
                                                   world));
  }
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is out of range for a world of ", world));
  }
  // Its devices place the ranks in their stages.
  if (absl::Status s = CheckDevices(plan, rank, /*required=*/true); !s.ok()) return s;
  // The runner passes activations down the list: each stage receives what
  // the one before sends (the first nothing), the last sends nothing.
  const auto& stages = plan.pipeline().stages();
  for (int k = 0; k < stages.size(); ++k) {
    const std::string& received = stages[k].input_tensor();
    const std::string sent = k > 0 ? stages[k - 1].output_tensor() : "";
    if (received != sent) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the pipeline's stage ", k, " (index ", stages[k].index(), ") receives ", Named(received),
          k == 0 || sent.empty() ? ", which no stage before it sends"
                                 : absl::StrCat(", but stage ", k - 1, " sends ", Named(sent)),
          " (stages edited or out of order?)"));
    }
  }
  if (!stages.empty() && !stages[stages.size() - 1].output_tensor().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the pipeline's last stage sends ", Named(stages[stages.size() - 1].output_tensor()),
        " to no stage (stages edited or out of order?)"));
  }
  int found = 0;
  for (const v1::PipelineStage& st : plan.pipeline().stages()) {
    for (int i = 0; i < st.devices_size(); ++i) {
      if (st.devices(i) != plan.devices(rank)) continue;
      ++found;
      const v1::RankProgram& p = plan.rank_programs(rank);
      if (p.rank() != i || p.world_size() != st.devices_size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the plan's program ", rank, " is not rank ", i, " of pipeline stage ", st.index(),
            "'s ", st.devices_size(), " ranks"));
      }
      // The activations it receives and sends are the stage's (the content
      // hash does not cover the pipeline: stages edited or reordered would
      // run programs as stages they were not lowered for).
      const std::string receives = Boundary(p, v1::Buffer::STAGE_INPUT, "#stage_in");
      const std::string sends = Boundary(p, v1::Buffer::STAGE_OUTPUT, "#stage_out");
      if (receives != st.input_tensor() || sends != st.output_tensor()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the plan's program ", rank, " receives ", Named(receives), " and sends ", Named(sends),
            ", but pipeline stage ", st.index(), " receives ", Named(st.input_tensor()),
            " and sends ", Named(st.output_tensor()), " (stages edited or out of order?)"));
      }
    }
  }
  if (found != 1) {
    return absl::InvalidArgumentError(absl::StrCat("device ", plan.devices(rank), " (rank ",
                                                   rank, ") is in ", found,
                                                   " pipeline stages, not one"));
  }
  const int microbatches = plan.pipeline().microbatches();
  if (microbatches < 1) {
    return absl::InvalidArgumentError("the pipeline plan has no microbatch count");
  }
  // The stage programs were lowered for this split of the batch: inputs of
  // microbatch_size samples, and a loss seeded with 1 / microbatches (the
  // only fill in backward that is not a zeroing). Version 1's content hash
  // does not cover the pipeline's fields; a count edited there would scale
  // every gradient wrongly.
  const int64_t micro = plan.pipeline().microbatch_size();
  if (micro < 1 || (plan.global_batch() >= 1 && (plan.global_batch() % microbatches != 0 ||
                                                 plan.global_batch() / microbatches != micro))) {
    return absl::InvalidArgumentError(
        absl::StrCat("the pipeline plan's ", microbatches, " microbatches of ", micro,
                     " samples are not its global batch of ", plan.global_batch()));
  }
  for (const v1::Step& step : plan.rank_programs(rank).steps()) {
    if (step.phase() != v1::Step::BACKWARD || step.kernel().kernel() != "fill") continue;
    const auto value = step.kernel().attrs().find("value");
    const double seed = value == step.kernel().attrs().end() ? 0 : value->second.f();
    if (seed == 0) continue;  // a gradient zeroed before it is summed into
    const double want = 1.0 / microbatches;
    if (!(std::abs(seed - want) <= 1e-9 * want)) {
      // The count it was lowered for when the seed is 1 / a count (an
      // int32, as PipelinePlan.microbatches).
      const double count = 1 / seed;
      const bool a_count = count >= 1 && count <= std::numeric_limits<int32_t>::max() &&
                           std::abs(count - std::round(count)) <= 1e-6 * count;
      return absl::InvalidArgumentError(absl::StrCat(
          "the plan's program ", rank, " was lowered for ",
          a_count ? absl::StrCat(std::llround(count)) : std::string("another number of"),
          " microbatches (its loss is seeded with ", seed, "), the pipeline says ", microbatches));
    }
  }
  // Its model inputs were lowered at the microbatch size too (Rebatch's:
  // each input's first dimension scaled by microbatch / batch): a count
  // and size edited together would feed them other rows.
  if (plan.global_batch() >= 1) {
    for (const v1::Buffer& b : plan.rank_programs(rank).buffers()) {
      if (b.role() != v1::Buffer::INPUT || b.global_shape_size() == 0) continue;
      for (const v1::Input& in : plan.graph().inputs()) {
        // (Rebatch refuses an input of no whole rows per sample.)
        if (in.tensor().name() != b.tensor() || in.tensor().shape_size() == 0 ||
            in.tensor().shape(0) < plan.global_batch() ||
            in.tensor().shape(0) % plan.global_batch() != 0) {
          continue;
        }
        const int64_t per_sample = in.tensor().shape(0) / plan.global_batch();
        if (b.global_shape(0) == per_sample * micro) continue;
        return absl::InvalidArgumentError(
            absl::StrCat("the plan's program ", rank, " reads input '", b.tensor(), "' with ",
                         b.global_shape(0), " rows, as microbatches of ",
                         b.global_shape(0) % per_sample == 0
                             ? absl::StrCat(b.global_shape(0) / per_sample)
                             : absl::StrCat(static_cast<double>(b.global_shape(0)) / per_sample),
                         " samples have it, not ", micro));
      }
    }
  }
  if (!plan.content_hash().empty() && ContentHash(plan) != plan.content_hash()) {
    return absl::InvalidArgumentError(
        "the plan's content hash does not match its content (corrupted?)");
  }
  return absl::OkStatus();
}

absl::Status CheckSpmdPlanForRank(const v1::Plan& plan, int rank, int world) {
  if (plan.rank_programs_size() == 0) {
    return absl::InvalidArgumentError("the plan has no rank programs (not lowered)");
  }
  if (world != plan.rank_programs_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan is for a world of ", plan.rank_programs_size(),
        " ranks, not ", world));
  }
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is out of range for a world of ", world));
  }
  if (plan.rank_programs(rank).rank() != rank ||
      plan.rank_programs(rank).world_size() != world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan's program ", rank, " was lowered for rank ", plan.rank_programs(rank).rank(),
        " of ", plan.rank_programs(rank).world_size(), ", not rank ", rank, " of ", world));
  }
  if (absl::Status s = CheckDevices(plan, rank, /*required=*/false); !s.ok()) return s;
  if (!plan.content_hash().empty() && ContentHash(plan) != plan.content_hash()) {
    return absl::InvalidArgumentError(
        "the plan's content hash does not match its content (corrupted?)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPlanForRank(const v1::Plan& plan, int rank, int world) {
  if (plan.format_version() < kOldestPlanFormatVersion ||
      plan.format_version() > kPlanFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan format version ", plan.format_version(),
                     " is not supported (this executor reads versions ", kOldestPlanFormatVersion,
                     " to ", kPlanFormatVersion, ")"));
  }
  absl::Status programs = IsPipelinePlan(plan) ? CheckPipelinePlanForRank(plan, rank, world)
                                               : CheckSpmdPlanForRank(plan, rank, world);
  if (!programs.ok()) return programs;
  // The content hash covers the graph's hash, not the graph: a graph edited
  // after lowering (a parameter frozen, an attribute changed) would run with
  // rank programs lowered for another model.
  if (!plan.graph_hash().empty() && Sha256Hex(plan.graph()) != plan.graph_hash()) {
    return absl::InvalidArgumentError(
        "the plan's graph does not match its graph_hash (edited or corrupted?): its rank "
        "programs were lowered for another graph; plan the edited model again");
  }
  // Nor the cluster, whose devices executors take their kind and GPU
  // ordinal from.
  if (!plan.cluster_hash().empty() && Sha256Hex(plan.cluster()) != plan.cluster_hash()) {
    return absl::InvalidArgumentError(
        "the plan's cluster does not match its cluster_hash (edited or corrupted?): executors "
        "would place ranks on other devices than planned; plan it again");
  }
  // The checkpoints' data cursor is steps x global_batch (samples_seen);
  // a plan without its batch would save cursors a resume cannot check.
  if (plan.global_batch() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan's global_batch is ", plan.global_batch(),
                     "; a lowered plan carries its graph's batch (1 or more): plan it again"));
  }
  // Not covered by the content hash either: an edited batch would make
  // checkpoints count samples wrongly.
  if (const int64_t batch = GraphBatch(plan.graph()); plan.global_batch() != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan's global_batch is ", plan.global_batch(),
                     ", but its graph's batch (the first dimension of its first input, '",
                     plan.graph().inputs_size() > 0 ? plan.graph().inputs(0).tensor().name() : "",
                     "') is ", batch));
  }
  return absl::OkStatus();
}

}  // namespace hap::lower
