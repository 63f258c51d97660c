#include "executor/train/pipeline.h"

#include <algorithm>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "executor/cpu/cpu_device.h"
#include "executor/train/backend.h"
#include "planner/pipeline/layers.h"

namespace hap::executor {

namespace v1 = ::hap::v1;

absl::StatusOr<std::pair<int, int>> StageOf(const PipelineLayout& layout, int rank) {
  std::pair<int, int> at{-1, -1};
  int seen = 0;
  for (size_t s = 0; s < layout.stage_ranks.size(); ++s) {
    const auto& g = layout.stage_ranks[s];
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i] == rank) {
        at = {static_cast<int>(s), static_cast<int>(i)};
        ++seen;
      }
    }
  }
  if (seen != 1) {
    return absl::InvalidArgumentError(absl::StrCat("the pipeline layout holds rank ", rank, " ",
                                                   seen, " times, not once"));
  }
  return at;
}

absl::StatusOr<PipelineLayout> PipelineLayoutOf(const v1::Plan& plan) {
  PipelineLayout layout;
  layout.microbatches = plan.pipeline().microbatches();
  layout.clip = plan.options().optimizer().clip_global_norm() > 0;
  for (const v1::PipelineStage& st : plan.pipeline().stages()) {
    std::vector<int> ranks;
    for (const std::string& d : st.devices()) {
      auto it = std::find(plan.devices().begin(), plan.devices().end(), d);
      if (it == plan.devices().end()) {
        return absl::InvalidArgumentError(absl::StrCat("pipeline stage ", st.index(),
                                                       "'s device ", d,
                                                       " is not among the plan's devices"));
      }
      ranks.push_back(static_cast<int>(it - plan.devices().begin()));
    }
    if (ranks.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pipeline stage ", st.index(), " has no devices"));
    }
    layout.stage_ranks.push_back(std::move(ranks));
  }
  for (int r = 0; r < plan.devices_size(); ++r) HAP_RETURN_IF_ERROR(StageOf(layout, r).status());
  if (layout.microbatches < 1) {
    return absl::InvalidArgumentError("the pipeline plan has no microbatch count");
  }
  return layout;
}

absl::Status AddBoundaryPieces(PipelineLayout& layout,
                               const std::vector<v1::RankProgram>& programs) {
  const int S = static_cast<int>(layout.stage_ranks.size());
  layout.output_pieces.assign(S, {});
  layout.input_grad_pieces.assign(S, {});
  for (int s = 0; s < S; ++s) {
    for (int r : layout.stage_ranks[s]) {
      if (r < 0 || r >= static_cast<int>(programs.size())) {
        return absl::InvalidArgumentError(absl::StrCat("no program for rank ", r));
      }
      for (auto role : {v1::Buffer::STAGE_OUTPUT, v1::Buffer::STAGE_INPUT_GRADIENT}) {
        auto& pieces = role == v1::Buffer::STAGE_OUTPUT ? layout.output_pieces[s]
                                                        : layout.input_grad_pieces[s];
        for (const v1::Buffer& b : programs[r].buffers()) {
          if (b.role() != role) continue;
          PipelineLayout::Piece p;
          p.kind = b.form().kind();
          p.offsets.assign(b.offsets().begin(), b.offsets().end());
          p.shape.assign(b.shape().begin(), b.shape().end());
          pieces.push_back(std::move(p));
        }
      }
    }
  }
  // A stage whose ranks disagree (a piece from some, none from others) is
  // refused where the pieces are used: PipelineRunner::Create's
  // CheckPieces, on the receiving stage's ranks.
  return absl::OkStatus();
}

absl::StatusOr<PipelineRank> PipelineRankOf(const v1::Plan& plan, const graph::Graph& g,
                                            int rank) {
  HAP_ASSIGN_OR_RETURN(PipelineLayout layout, PipelineLayoutOf(plan));
  HAP_RETURN_IF_ERROR(AddBoundaryPieces(
      layout, std::vector<v1::RankProgram>(plan.rank_programs().begin(),
                                           plan.rank_programs().end())));
  HAP_ASSIGN_OR_RETURN(graph::Graph micro,
                       pipeline::Rebatch(g, plan.pipeline().microbatch_size()));
  HAP_ASSIGN_OR_RETURN(auto at, StageOf(layout, rank));
  const int group_size = static_cast<int>(layout.stage_ranks[at.first].size());
  return PipelineRank{std::move(layout), std::move(micro), at.first, at.second, group_size};
}

GlooOptions PipelineWorldOptions(const GlooOptions& rank_options) {
  GlooOptions o = rank_options;
  o.prefix = absl::StrCat(rank_options.prefix, "/world");
  return o;
}

GlooOptions PipelineGroupOptions(const GlooOptions& rank_options, const PipelineRank& at) {
  GlooOptions o = rank_options;
  o.rank = at.group_rank;
  o.size = at.group_size;
  o.prefix = absl::StrCat(rank_options.prefix, "/stage", at.stage);
  return o;
}

std::vector<int> OneFOneBOrder(int stage, int stages, int microbatches) {
  const int w = std::min(stages - 1 - stage, microbatches);
  std::vector<int> order;
  for (int m = 0; m < w; ++m) order.push_back(m + 1);
  for (int i = 0; i < microbatches - w; ++i) {
    order.push_back(w + i + 1);
    order.push_back(-(i + 1));
  }
  for (int m = microbatches - w; m < microbatches; ++m) order.push_back(-(m + 1));
  return order;
}

absl::StatusOr<Batch> MicroBatch(const Batch& batch, int m, int microbatches) {
  if (microbatches == 1) return batch;
  Batch out;
  for (const auto& [name, t] : batch) {
    const Shape& shape = t.shape();
    if (shape.empty() || shape[0] % microbatches != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("input '", name, "' of shape ", graph::ShapeString(shape),
                       " does not split into ", microbatches, " microbatches along dimension 0"));
    }
    Shape part = shape;
    part[0] /= microbatches;
    HostTensor piece(t.dtype(), part);
    std::vector<int64_t> start(shape.size(), 0);
    start[0] = m * part[0];
    HAP_RETURN_IF_ERROR(HostCopyBox(t.view(), start, piece.view(),
                                    std::vector<int64_t>(shape.size(), 0), part));
    out.emplace(name, std::move(piece));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PipelineRunner>> PipelineRunner::Create(
    ProgramRunner* runner, Communicator* world, const PipelineLayout& layout) {
  if (layout.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a pipeline needs at least 1 microbatch, got ", layout.microbatches));
  }
  std::unique_ptr<PipelineRunner> p(new PipelineRunner(runner, world, layout));
  HAP_ASSIGN_OR_RETURN(auto at, StageOf(layout, world->rank()));
  p->stage_ = at.first;
  p->group_rank_ = at.second;
  if (static_cast<int>(layout.stage_ranks[at.first].size()) != runner->comm().size() ||
      runner->comm().rank() != at.second) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", world->rank(), " is rank ", at.second, " of stage ", at.first, "'s ",
        layout.stage_ranks[at.first].size(), " ranks, but its stage communicator is rank ",
        runner->comm().rank(), " of ", runner->comm().size()));
  }
  HAP_RETURN_IF_ERROR(p->Analyze());
  HAP_RETURN_IF_ERROR(p->CheckPieces());
  return p;
}

absl::Status PipelineRunner::CheckPieces() const {
  const size_t S = layout_.stage_ranks.size();
  const auto& out = layout_.output_pieces;
  const auto& in_grad = layout_.input_grad_pieces;
  if (out.empty() && in_grad.empty()) return absl::OkStatus();
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("the pipeline layout's boundary pieces: ", what));
  };
  if (out.size() != S || in_grad.size() != S) {
    return bad(
        absl::StrCat("pieces for ", out.size(), " and ", in_grad.size(), " of its ", S, " stages"));
  }
  // Stage `from`'s pieces of what it sends into this rank's buffer `id`.
  auto check = [&](int from, const std::vector<PipelineLayout::Piece>& pieces, int id,
                   const std::string& what) -> absl::Status {
    const size_t ranks = layout_.stage_ranks[from].size();
    if (pieces.size() != ranks) {
      return bad(absl::StrCat("stage ", from, " gives ", pieces.size(), " pieces of its ", what,
                              " for its ", ranks, " ranks"));
    }
    const v1::Buffer& b = runner_->program().buffers(id);
    const Shape global(b.global_shape().begin(), b.global_shape().end());
    for (size_t i = 0; i < ranks; ++i) {
      const PipelineLayout::Piece& p = pieces[i];
      const bool whole = p.kind == v1::TensorForm::REPLICATED || p.kind == v1::TensorForm::PARTIAL;
      bool fits = (whole || p.kind == v1::TensorForm::SHARDED) && p.shape.size() == global.size() &&
                  p.offsets.size() == global.size();
      for (size_t d = 0; fits && d < global.size(); ++d) {
        fits = p.offsets[d] >= 0 && p.shape[d] >= 0 && p.shape[d] <= global[d] - p.offsets[d] &&
               (!whole || p.shape[d] == global[d]);
      }
      if (!fits) {
        return bad(
            absl::StrCat("rank ", i, "'s piece of stage ", from, "'s ", what, " (",
                         v1::TensorForm::Kind_IsValid(p.kind)
                             ? v1::TensorForm::Kind_Name(static_cast<v1::TensorForm::Kind>(p.kind))
                             : absl::StrCat("kind ", p.kind),
                         " ", graph::ShapeString(p.shape), " at ", graph::ShapeString(p.offsets),
                         ") does not fit ", graph::ShapeString(global)));
      }
    }
    return absl::OkStatus();
  };
  if (stage_in_ >= 0) HAP_RETURN_IF_ERROR(check(stage_ - 1, out[stage_ - 1], stage_in_, "output"));
  if (out_grad_ >= 0) {
    HAP_RETURN_IF_ERROR(check(stage_ + 1, in_grad[stage_ + 1], out_grad_, "input gradient"));
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::Analyze() {
  const v1::RankProgram& prog = runner_->program();
  const int n = prog.steps_size();
  auto phase_at = [&](int i) { return prog.steps(i).phase(); };
  // Per microbatch: the leading FORWARD steps, then up to the last
  // BACKWARD step (gradient synchronisation inside backward, such as
  // ZeRO's reduce-scatters, is linear and runs per microbatch); once per
  // step: the rest.
  int i = 0;
  while (i < n && phase_at(i) == v1::Step::FORWARD) ++i;
  forward_end_ = i;
  // Ops that couple the samples of the whole batch: batch_norm normalises
  // with its statistics (and moves its running statistics once a step);
  // mixture-of-experts routing over all its tokens as one group (moe_gate,
  // moe_route without a group_size) gives each expert's slots to the first
  // tokens that want them. The program runs once per microbatch on that
  // microbatch alone, and 1F1B finishes a microbatch's forward before the
  // next one's starts: the statistics and the slots would be the
  // microbatch's, another model than the single device's, with no error.
  // (planner/pipeline's Rebatch refuses both; a plan made before it did
  // is refused here.)
  if (layout_.microbatches > 1) {
    for (int k = 0; k < forward_end_; ++k) {
      const v1::Step& st = prog.steps(k);
      if (!st.has_kernel()) continue;
      const std::string& kernel = st.kernel().kernel();
      const auto group = st.kernel().attrs().find("group_size");
      const bool whole_batch_routing =
          kernel == "moe_gate" ||
          (kernel == "moe_route" && (group == st.kernel().attrs().end() || group->second.i() == 0));
      if (kernel == "batch_norm" || kernel == "batch_norm_stats") {
        return absl::InvalidArgumentError(absl::StrCat(
            "the program of stage ", stage_, " normalises with batch_norm ('", st.kernel().op(),
            "'), which takes its statistics over the whole batch; run in ", layout_.microbatches,
            " microbatches it would take them over each microbatch (plan the pipeline with one "
            "microbatch, --microbatches 1)"));
      }
      if (whole_batch_routing) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the program of stage ", stage_,
            " routes all the batch's tokens to its experts as "
            "one group ('",
            st.kernel().op(), "', ", kernel, "); run in ", layout_.microbatches,
            " microbatches each would be routed on its own (give the routing a group_size that "
            "divides a microbatch's tokens, or plan one microbatch)"));
      }
    }
  }
  backward_end_ = forward_end_;
  for (; i < n; ++i) {
    if (phase_at(i) == v1::Step::FORWARD) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", i, " of the stage program is a FORWARD step after the backward began: "
          "not a pipeline stage program"));
    }
    if (phase_at(i) == v1::Step::BACKWARD) backward_end_ = i + 1;
  }
  // Asynchronous collectives: each start and its wait in one range
  // (forward, backward, after backward) but the gradient synchronisations
  // started in backward and waited for after it (deferred_).
  auto range_of = [&](int k) { return k < forward_end_ ? 0 : k < backward_end_ ? 1 : 2; };
  std::set<int> deferred_only;  // buffers only a deferred start writes
  std::map<int, std::vector<int>> deferred_reads;
  for (int k = 0; k < n; ++k) {
    if (!prog.steps(k).has_wait()) continue;
    const int start = prog.steps(k).wait().start_step();
    if (start < 0 || start >= k || !prog.steps(start).has_collective()) {
      return absl::InvalidArgumentError(
          absl::StrCat("wait step ", k, " waits for step ", start, ", not a collective before it"));
    }
    if (range_of(start) == range_of(k)) continue;
    if (range_of(start) != 1 || range_of(k) != 2 ||
        prog.steps(start).phase() != v1::Step::GRADIENT_SYNC) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the collective started at step ", start, " is waited for at step ", k,
          " in another part of the step; a pipeline stage runs only gradient synchronisations "
          "started in backward across microbatches"));
    }
    const v1::CollectiveCall& c = prog.steps(start).collective();
    std::vector<int> reads = {c.input()};
    reads.insert(reads.end(), c.coalesced().begin(), c.coalesced().end());
    std::vector<int> writes = {c.output()};
    writes.insert(writes.end(), c.coalesced_outputs().begin(), c.coalesced_outputs().end());
    for (int id : writes) {
      if (std::find(reads.begin(), reads.end(), id) == reads.end()) deferred_only.insert(id);
    }
    deferred_reads[start] = std::move(reads);
  }
  // The lifetimes the plan declares decide what is kept across microbatches
  // (stashed, summed): each must hold every step that uses its buffer.
  for (int k = 0; k < n; ++k) {
    for (int id : StepBuffers(prog.steps(k))) {
      const v1::Buffer& b = prog.buffers(id);
      if (!b.persistent() && (b.last_use() < 0 || k < b.first_use() || k > b.last_use())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "buffer '", b.tensor(), "' is used at step ", k, ", outside its lifetime [",
            b.first_use(), ", ", b.last_use(), "] in the stage program"));
      }
    }
  }
  const bool first = stage_ == 0;
  const bool last = stage_ + 1 == static_cast<int>(layout_.stage_ranks.size());
  for (const v1::Buffer& b : prog.buffers()) {
    switch (b.role()) {
      case v1::Buffer::STAGE_INPUT: stage_in_ = b.id(); break;
      case v1::Buffer::STAGE_OUTPUT: stage_out_ = b.id(); break;
      case v1::Buffer::STAGE_OUTPUT_GRADIENT: out_grad_ = b.id(); break;
      case v1::Buffer::STAGE_INPUT_GRADIENT: in_grad_ = b.id(); break;
      case v1::Buffer::NORM: norm_ = b.id(); break;
      default: break;
    }
    // Kept anyway (persistent), unused, handled apart (the loss), or
    // written after the restore (the output's gradient).
    if (b.persistent() || b.last_use() < 0 || b.role() == v1::Buffer::LOSS ||
        b.role() == v1::Buffer::STAGE_OUTPUT_GRADIENT) {
      continue;
    }
    const bool before_backward = b.first_use() < forward_end_;
    const bool into_backward = b.last_use() >= forward_end_;
    const bool into_sync = b.last_use() >= backward_end_;
    if (before_backward && into_sync && into_backward) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer '", b.tensor(), "' lives from the forward into the gradient synchronisation; "
          "a pipeline stage cannot keep it across microbatches"));
    }
    if (before_backward && into_backward) stash_ids_.push_back(b.id());
    if (!before_backward && b.first_use() < backward_end_ && into_sync &&
        !deferred_only.count(b.id())) {
      if (b.role() != v1::Buffer::GRADIENT) {
        return absl::InvalidArgumentError(absl::StrCat(
            "buffer '", b.tensor(), "' (", v1::Buffer::Role_Name(b.role()),
            ") lives from the backward into the gradient synchronisation; only gradients "
            "are summed over microbatches"));
      }
      accumulate_ids_.push_back(b.id());
    }
  }
  for (const auto& [start, reads] : deferred_reads) {
    std::vector<size_t>& at = deferred_[start];
    for (int id : reads) {
      auto it = std::find(accumulate_ids_.begin(), accumulate_ids_.end(), id);
      if (it != accumulate_ids_.end()) at.push_back(it - accumulate_ids_.begin());
    }
  }
  if ((stage_in_ >= 0) == first || (in_grad_ >= 0) == first || (stage_out_ >= 0) == last ||
      (out_grad_ >= 0) == last) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the program of stage ", stage_, " of ", layout_.stage_ranks.size(),
        (first ? " has" : " lacks"), " a stage input or its gradient, or ",
        (last ? "has" : "lacks"), " a stage output or its gradient"));
  }
  // What the stage sends is written before it is sent (else the arena's
  // stale or uninitialised bytes would go): its output by a forward step,
  // its input's gradient by a backward one.
  auto written_in = [&](int id, int begin, int end) {
    for (int k = begin; k < end; ++k) {
      const v1::Step& st = prog.steps(k);
      if (st.has_wait()) continue;
      const auto& outs =
          st.has_kernel() ? st.kernel().outputs() : st.collective().coalesced_outputs();
      if (std::find(outs.begin(), outs.end(), id) != outs.end()) return true;
      if (!st.has_collective()) continue;
      const v1::CollectiveCall& c = st.collective();
      const bool in_place_bucket =
          c.collective() == v1::ALL_REDUCE &&
          std::find(c.coalesced().begin(), c.coalesced().end(), id) != c.coalesced().end();
      if (c.output() == id || in_place_bucket) return true;
    }
    return false;
  };
  for (const auto& [id, begin, end, what] :
       {std::tuple{stage_out_, 0, forward_end_, "output"},
        std::tuple{in_grad_, forward_end_, backward_end_, "input's gradient"}}) {
    if (id >= 0 && !written_in(id, begin, end)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the program of stage ", stage_, " never writes its ", what, " '",
          prog.buffers(id).tensor(), "' in its ", id == stage_out_ ? "forward" : "backward",
          " steps: it would send memory nothing wrote"));
    }
  }
  // A stage trains when its optimizer updates a parameter: one whose
  // parameters are all frozen (a fine-tune's first layers) has PARAMETER
  // buffers but nothing to clip, and the lowering gives it no norm.
  const bool trains = std::any_of(prog.steps().begin(), prog.steps().end(), [](const v1::Step& st) {
    return st.has_kernel() &&
           (st.kernel().kernel() == "sgd_update" || st.kernel().kernel() == "adam_update");
  });
  if (layout_.clip && norm_ < 0 && trains) {
    // Its optimizer would not clip: the single-device step clips every
    // parameter by the norm over all of them.
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan's optimizer clips by the global gradient norm (clip_global_norm > 0) but the "
        "program of stage ",
        stage_, " computes no norm: the plan's programs and options disagree"));
  }
  if (norm_ >= 0) {
    for (int s = backward_end_; s < n; ++s) {
      const v1::Step& st = prog.steps(s);
      if (st.has_collective() && st.collective().collective() == v1::ALL_REDUCE &&
          st.collective().input() == norm_) {
        norm_step_ = s;
      }
    }
    if (norm_step_ < 0) {
      return absl::InvalidArgumentError(
          "the stage program does not all-reduce its clipping norm in its group");
    }
    if (!layout_.clip) {
      // Each stage would clip by its own norm, not the model's.
      return absl::InvalidArgumentError(
          "the stage program clips by a gradient norm but the plan's optimizer does not "
          "(clip_global_norm 0): the plan's programs and options disagree");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<HostTensor> PipelineRunner::Read(int id) {
  const TensorView& v = runner_->buffer(id);
  HostTensor t(v.dtype, v.shape);
  HAP_RETURN_IF_ERROR(runner_->device().CopyToHost(v, t.data()));
  return t;
}

absl::Status PipelineRunner::Write(int id, const HostTensor& t) {
  return runner_->device().CopyFromHost(t.data(), runner_->buffer(id));
}

namespace {

template <typename T>
void AddInto(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

absl::Status Add(HostTensor& dst, const HostTensor& src) {
  if (dst.dtype() == DType::kFloat32) {
    AddInto(dst.as<float>(), src.as<float>(), dst.num_elements());
  } else if (dst.dtype() == DType::kFloat64) {
    AddInto(dst.as<double>(), src.as<double>(), dst.num_elements());
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot sum ", graph::DTypeName(dst.dtype()), " tensors over microbatches"));
  }
  return absl::OkStatus();
}

double ScalarOf(const HostTensor& t) {
  return t.dtype() == DType::kFloat64 ? *t.as<double>() : static_cast<double>(*t.as<float>());
}

// `src` whole into `dst` (same dtype and shape), both device memory.
absl::Status CopyWhole(Device& device, const TensorView& src, const TensorView& dst) {
  const std::vector<int64_t> zero(src.rank(), 0);
  return device.CopyBox(src, zero, dst, zero, src.shape);
}

// out += x with the runtime kernel "accumulate" (a profile books it as
// runtime work, not as the model's add op).
absl::Status AccumulateOnDevice(Device& device, const TensorView& x, const TensorView& out) {
  return Annotate(
      device.RunKernel("accumulate", KernelContext{}, graph::Attrs{}, {&x, 1}, {&out, 1}),
      "summing gradients over microbatches");
}

}  // namespace

absl::Status PipelineRunner::SendWhole(int id, int to, int64_t tag) {
  const v1::Buffer& b = runner_->program().buffers(id);
  HAP_ASSIGN_OR_RETURN(HostTensor piece, Read(id));
  const v1::TensorForm& f = b.form();
  const bool known = !layout_.output_pieces.empty();
  if (known) {
    // Only the piece; a replicated form's from rank 0 alone.
    if (f.kind() == v1::TensorForm::REPLICATED && group_rank_ != 0) return absl::OkStatus();
    pending_sends_.push_back(std::move(piece));
  } else {
    Shape global(b.global_shape().begin(), b.global_shape().end());
    HostTensor whole(piece.dtype(), global);  // zeros
    if (f.kind() == v1::TensorForm::SHARDED || f.kind() == v1::TensorForm::PARTIAL ||
        group_rank_ == 0) {
      std::vector<int64_t> start(b.offsets().begin(), b.offsets().end());
      HAP_RETURN_IF_ERROR(HostCopyBox(piece.view(), std::vector<int64_t>(global.size(), 0),
                                      whole.view(), start, piece.shape()));
    }
    pending_sends_.push_back(std::move(whole));
  }
  for (int peer : layout_.stage_ranks[to]) {
    HAP_RETURN_IF_ERROR(world_->Send(pending_sends_.back().view(), peer, tag));
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::ReceiveInto(int id, int from, int64_t tag) {
  const v1::Buffer& b = runner_->program().buffers(id);
  const TensorView& v = runner_->buffer(id);
  Shape global(b.global_shape().begin(), b.global_shape().end());
  HostTensor whole(v.dtype, global);
  const std::vector<int>& senders = layout_.stage_ranks[from];
  // Forward: the previous stage's outputs; backward: the next stage's
  // input gradients.
  const std::vector<PipelineLayout::Piece>* pieces = nullptr;
  if (!layout_.output_pieces.empty()) {
    pieces = from < stage_ ? &layout_.output_pieces[from] : &layout_.input_grad_pieces[from];
  }
  for (size_t i = 0; i < senders.size(); ++i) {
    if (pieces == nullptr) {
      HostTensor part(v.dtype, global);
      HAP_RETURN_IF_ERROR(world_->Recv(i == 0 ? whole.view() : part.view(), senders[i], tag));
      if (i > 0) HAP_RETURN_IF_ERROR(Add(whole, part));
      continue;
    }
    const PipelineLayout::Piece& p = (*pieces)[i];
    if (p.kind == v1::TensorForm::REPLICATED && i != 0) continue;
    HostTensor part(v.dtype, p.shape);
    HAP_RETURN_IF_ERROR(world_->Recv(part.view(), senders[i], tag));
    if (p.kind == v1::TensorForm::PARTIAL) {
      HAP_RETURN_IF_ERROR(Add(whole, part));
    } else {
      HAP_RETURN_IF_ERROR(HostCopyBox(part.view(), std::vector<int64_t>(p.shape.size(), 0),
                                      whole.view(), p.offsets, p.shape));
    }
  }
  HostTensor piece(v.dtype, v.shape);  // zeros: a partial form off rank 0
  if (b.form().kind() != v1::TensorForm::PARTIAL || group_rank_ == 0) {
    std::vector<int64_t> start(b.offsets().begin(), b.offsets().end());
    HAP_RETURN_IF_ERROR(HostCopyBox(whole.view(), start, piece.view(),
                                    std::vector<int64_t>(v.rank(), 0), v.shape));
  }
  return Write(id, piece);
}

absl::Status PipelineRunner::Forward(const Batch& batch, int m, int64_t step) {
  runner_->SetMicrobatch(m, layout_.microbatches);
  HAP_ASSIGN_OR_RETURN(Batch micro, MicroBatch(batch, m, layout_.microbatches));
  HAP_RETURN_IF_ERROR(runner_->LoadBatch(micro));
  if (stage_in_ >= 0) HAP_RETURN_IF_ERROR(ReceiveInto(stage_in_, stage_ - 1, 2 * m));
  HAP_RETURN_IF_ERROR(runner_->RunSteps(0, forward_end_, step));
  HAP_RETURN_IF_ERROR(runner_->device().Synchronize());
  if (stage_out_ >= 0) {
    HAP_RETURN_IF_ERROR(SendWhole(stage_out_, stage_ + 1, 2 * m));
  } else {
    HAP_ASSIGN_OR_RETURN(HostTensor loss, Read(runner_->program().loss_buffer()));
    loss_sum_ += ScalarOf(loss);
  }
  if (stash_ids_.empty()) return absl::OkStatus();
  if (free_stash_slots_.empty()) {
    std::vector<TensorView> slot;
    for (int id : stash_ids_) {
      HAP_ASSIGN_OR_RETURN(TensorView v, AllocateLike(runner_->buffer(id)));
      slot.push_back(v);
    }
    free_stash_slots_.push_back(stash_slots_.size());
    stash_slots_.push_back(std::move(slot));
  }
  const size_t slot = free_stash_slots_.back();
  free_stash_slots_.pop_back();
  stash_[m] = slot;
  for (size_t i = 0; i < stash_ids_.size(); ++i) {
    HAP_RETURN_IF_ERROR(
        CopyWhole(runner_->device(), runner_->buffer(stash_ids_[i]), stash_slots_[slot][i]));
  }
  return runner_->device().Synchronize();
}

absl::Status PipelineRunner::Backward(int m, int64_t step) {
  runner_->SetMicrobatch(m, layout_.microbatches);
  if (!stash_ids_.empty()) {
    auto it = stash_.find(m);
    if (it == stash_.end()) {
      return absl::InternalError(
          absl::StrCat("backward of microbatch ", m, " before its forward"));
    }
    for (size_t i = 0; i < stash_ids_.size(); ++i) {
      HAP_RETURN_IF_ERROR(CopyWhole(runner_->device(), stash_slots_[it->second][i],
                                    runner_->buffer(stash_ids_[i])));
    }
    free_stash_slots_.push_back(it->second);
    stash_.erase(it);
  }
  if (out_grad_ >= 0) HAP_RETURN_IF_ERROR(ReceiveInto(out_grad_, stage_ + 1, 2 * m + 1));
  HAP_RETURN_IF_ERROR(RunBackwardSteps(m + 1 == layout_.microbatches, step));
  HAP_RETURN_IF_ERROR(runner_->device().Synchronize());
  if (in_grad_ >= 0) HAP_RETURN_IF_ERROR(SendWhole(in_grad_, stage_ - 1, 2 * m + 1));
  if (m + 1 < layout_.microbatches) return AccumulateMicrobatch();
  // The last: the earlier microbatches' sums into its gradients (those
  // a deferred synchronisation reads were folded in before it started, and
  // it may be running on them).
  if (!summed_) return absl::OkStatus();
  for (size_t k = 0; k < accumulate_ids_.size(); ++k) {
    if (!folded_[k]) HAP_RETURN_IF_ERROR(SumInto(k));
  }
  return runner_->device().Synchronize();
}

absl::StatusOr<TensorView> PipelineRunner::AllocateLike(const TensorView& like) {
  HAP_ASSIGN_OR_RETURN(void* memory,
                       runner_->device().Allocate(std::max<int64_t>(like.bytes(), 1)));
  owned_.push_back(memory);
  return TensorView{like.dtype, like.shape, memory};
}

absl::Status PipelineRunner::AccumulateMicrobatch() {
  Device& device = runner_->device();
  if (sums_.empty()) {
    for (int id : accumulate_ids_) {
      HAP_ASSIGN_OR_RETURN(TensorView sum, AllocateLike(runner_->buffer(id)));
      sums_.push_back(sum);
    }
  }
  for (size_t k = 0; k < accumulate_ids_.size(); ++k) {
    const TensorView& g = runner_->buffer(accumulate_ids_[k]);
    HAP_RETURN_IF_ERROR(summed_ ? AccumulateOnDevice(device, g, sums_[k])
                                : CopyWhole(device, g, sums_[k]));
  }
  summed_ = true;
  return device.Synchronize();
}

absl::Status PipelineRunner::SumInto(size_t k) {
  const TensorView& g = runner_->buffer(accumulate_ids_[k]);
  return AccumulateOnDevice(runner_->device(), sums_[k], g);
}

PipelineRunner::~PipelineRunner() {
  // Sends of a failed step may still read their buffers (a slow peer posts
  // its receive later): wait for them before the memory goes.
  if (!pending_sends_.empty()) world_->WaitSends().IgnoreError();
  for (void* p : owned_) runner_->device().Free(p);
}

absl::Status PipelineRunner::RunBackwardSteps(bool last_microbatch, int64_t step) {
  int from = forward_end_;
  for (const auto& [start, reads] : deferred_) {
    HAP_RETURN_IF_ERROR(runner_->RunSteps(from, start, step));
    from = start + 1;
    if (!last_microbatch) continue;
    if (summed_) {
      // The earlier microbatches' sums into the buffers it synchronises.
      for (size_t k : reads) HAP_RETURN_IF_ERROR(SumInto(k));
    }
    for (size_t k : reads) folded_[k] = true;
    HAP_RETURN_IF_ERROR(runner_->RunSteps(start, start + 1, step));
  }
  return runner_->RunSteps(from, backward_end_, step);
}

absl::Status PipelineRunner::Finish(int64_t step, double* loss) {
  const v1::RankProgram& prog = runner_->program();
  const int S = static_cast<int>(layout_.stage_ranks.size());
  const bool last = stage_ + 1 == S;
  HAP_ASSIGN_OR_RETURN(HostTensor lt, Read(prog.loss_buffer()));
  const double mean = last ? loss_sum_ / layout_.microbatches : 0.0;
  if (lt.dtype() == DType::kFloat64) {
    *lt.as<double>() = mean;
  } else {
    *lt.as<float>() = static_cast<float>(mean);
  }
  HAP_RETURN_IF_ERROR(Write(prog.loss_buffer(), lt));
  HAP_RETURN_IF_ERROR(world_->WaitSends());
  pending_sends_.clear();
  const int n = prog.steps_size();
  const int split = norm_step_ >= 0 ? norm_step_ + 1 : backward_end_;
  HAP_RETURN_IF_ERROR(runner_->RunSteps(backward_end_, split, step));
  HAP_RETURN_IF_ERROR(runner_->device().Synchronize());
  if (layout_.clip) {
    // The norm over every stage: each group's total counted on its rank 0.
    HostTensor total(DType::kFloat64, {1});
    if (norm_ >= 0 && group_rank_ == 0) {
      HAP_ASSIGN_OR_RETURN(HostTensor mine, Read(norm_));
      *total.as<double>() = ScalarOf(mine);
    }
    HAP_RETURN_IF_ERROR(Annotate(world_->AllReduce(total.view()),
                                 "summing the clipping norm over the stages"));
    if (norm_ >= 0) HAP_RETURN_IF_ERROR(Write(norm_, total));
  }
  HAP_RETURN_IF_ERROR(runner_->RunSteps(split, n, step));
  HAP_RETURN_IF_ERROR(runner_->EndSteps(step));
  HAP_RETURN_IF_ERROR(runner_->device().Synchronize());
  // The loss, from the last stage's rank 0 to everyone.
  HostTensor value(DType::kFloat64, {1});
  if (last) {
    HAP_ASSIGN_OR_RETURN(HostTensor l, Read(prog.loss_buffer()));
    *value.as<double>() = ScalarOf(l);
  }
  HAP_RETURN_IF_ERROR(world_->Broadcast(value.view(), layout_.stage_ranks[S - 1][0]));
  *loss = *value.as<double>();
  return absl::OkStatus();
}

absl::StatusOr<double> PipelineRunner::RunStep(const Batch& batch, int64_t step) {
  for (const auto& [m, slot] : stash_) free_stash_slots_.push_back(slot);  // an earlier step failed
  stash_.clear();
  summed_ = false;
  folded_.assign(accumulate_ids_.size(), false);
  // An earlier step that failed may have left sends reading these copies.
  if (!pending_sends_.empty()) world_->WaitSends().IgnoreError();
  pending_sends_.clear();
  loss_sum_ = 0;
  HAP_RETURN_IF_ERROR(runner_->BeginSteps(step));
  const int S = static_cast<int>(layout_.stage_ranks.size());
  for (int op : OneFOneBOrder(stage_, S, layout_.microbatches)) {
    absl::Status s = op > 0 ? Forward(batch, op - 1, step) : Backward(-op - 1, step);
    if (!s.ok()) {
      return Annotate(s, absl::StrCat("stage ", stage_, ", microbatch ", std::abs(op) - 1,
                                      op > 0 ? " forward" : " backward"));
    }
  }
  double loss = 0;
  HAP_RETURN_IF_ERROR(Annotate(Finish(step, &loss), absl::StrCat("stage ", stage_)));
  runner_->SetMicrobatch(0, 1);
  return loss;
}

absl::StatusOr<std::vector<TrainResult>> RunLocalPipeline(
    const std::vector<v1::RankProgram>& programs, const graph::Graph& microbatch_graph,
    const PipelineLayout& layout,
    const std::function<std::unique_ptr<data::BatchSource>(int rank)>& batches,
    const TrainOptions& train, const LocalRanksOptions& options) {
  const int n = static_cast<int>(programs.size());
  PipelineLayout with_pieces = layout;
  if (with_pieces.output_pieces.empty() && options.pipeline_pieces) {
    HAP_RETURN_IF_ERROR(AddBoundaryPieces(with_pieces, programs));
  }
  std::vector<absl::StatusOr<TrainResult>> results(n, absl::UnknownError("rank did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      results[r] = [&]() -> absl::StatusOr<TrainResult> {
        HAP_ASSIGN_OR_RETURN(auto at, StageOf(layout, r));
        std::unique_ptr<Device> device = NewCpuDevice(options.threads_per_rank);
        HAP_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> store,
                             NewFileStore(options.rendezvous_dir));
        GlooOptions go;
        go.rank = r;
        go.size = n;
        go.prefix = absl::StrCat(options.prefix, "/world");
        go.timeout = options.timeout;
        HAP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world, ConnectGloo(go, *store));
        go.rank = at.second;
        go.size = static_cast<int>(layout.stage_ranks[at.first].size());
        go.prefix = absl::StrCat(options.prefix, "/stage", at.first);
        HAP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group, ConnectGloo(go, *store));
        RunnerOptions ro = options.runner;
        std::unique_ptr<AsyncCollectives> async;
        if (options.overlap && HasAsyncCollectives(programs[r])) {
          HAP_ASSIGN_OR_RETURN(async, ConnectOverlap(*device, go, *store));
          ro.async = async.get();
        }
        HAP_ASSIGN_OR_RETURN(std::unique_ptr<ProgramRunner> runner,
                             ProgramRunner::Create(programs[r], microbatch_graph, device.get(),
                                                   group.get(), ro));
        HAP_ASSIGN_OR_RETURN(std::unique_ptr<PipelineRunner> pipe,
                             PipelineRunner::Create(runner.get(), world.get(), with_pieces));
        std::unique_ptr<data::BatchSource> source = batches(r);
        return TrainRankWith(
            *runner, [&](const Batch& b, int64_t step) { return pipe->RunStep(b, step); },
            *source, train);
      }();
    });
  }
  for (auto& t : threads) t.join();
  // The cause rather than its echo: a rank that failed makes its peers'
  // connections break or time out.
  for (int r = 0; r < n; ++r) {
    const absl::Status& st = results[r].status();
    if (!st.ok() && st.code() != absl::StatusCode::kUnavailable &&
        st.code() != absl::StatusCode::kDeadlineExceeded) {
      return Annotate(st, absl::StrCat("rank ", r));
    }
  }
  std::vector<TrainResult> out;
  for (int r = 0; r < n; ++r) {
    if (!results[r].ok()) return Annotate(results[r].status(), absl::StrCat("rank ", r));
    out.push_back(*std::move(results[r]));
  }
  return out;
}

}  // namespace hap::executor
