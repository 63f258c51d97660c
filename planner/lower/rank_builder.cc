// The rank-program builder's core: Build, buffers and steps, the arena layout.
// Part of lower::internal::RankBuilder (rank_builder.h).

#include "planner/lower/rank_builder.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/arena.h"

namespace hap::lower::internal {

// R operands a rule adds once into a P result: read on rank 0 only.
bool AddedOnce(const synth::ShardRule& r, int j) {
  if (!r.inputs[j].is_replicated() || !r.replicated_grad[j]) return false;
  for (Form f : r.outputs) {
    if (f.is_partial()) return true;
  }
  return false;
}

v1::TensorForm FormProto(int8_t raw) {
  v1::TensorForm f;
  if (raw == kZeroStorage) raw = 0;
  Form form = Form::FromRaw(raw);
  if (form.is_replicated()) {
    f.set_kind(v1::TensorForm::REPLICATED);
  } else if (form.is_partial()) {
    f.set_kind(v1::TensorForm::PARTIAL);
  } else {
    f.set_kind(v1::TensorForm::SHARDED);
    f.set_dim(form.dim());
  }
  return f;
}

v1::CollectiveMethod MethodProto(synth::Method m) {
  return m == synth::Method::kGrouped ? v1::GROUPED : v1::PADDED;
}

absl::StatusOr<v1::RankProgram> RankBuilder::Build() {
  prog_.set_rank(r_);
  prog_.set_world_size(o_.world_size);
  prog_.set_seed(o_.seed);
  if (r_ < static_cast<int>(o_.devices.size())) prog_.set_device(o_.devices[r_]);
  GatherOnceParameters();
  if (o_.overlap) PlanOverlap();
  if (!zero3_steps_.empty()) PrefetchGathers(zero3_steps_.front());
  if (st_ != nullptr && st_->input >= 0) {
    fwd_[K(st_->input, st_->input_form)] =
        NewBuffer(st_->input, st_->input_form.raw(), v1::Buffer::STAGE_INPUT, "#stage_in");
  }
  for (size_t k = 0; k < p_.steps.size(); ++k) {
    HAP_RETURN_IF_ERROR(Forward(static_cast<int>(k)));
  }
  if (st_ != nullptr && st_->output >= 0) {
    HAP_RETURN_IF_ERROR(StageOutput());
  } else {
    HAP_RETURN_IF_ERROR(Loss());
  }
  if (!zero3_steps_.empty()) PrefetchRegathers(zero3_steps_.back());
  for (int k = static_cast<int>(p_.steps.size()) - 1; k >= 0; --k) {
    HAP_RETURN_IF_ERROR(Backward(k));
  }
  if (st_ != nullptr && st_->input >= 0) {
    // The input's gradient, whole or in pieces as its form says, for the
    // previous stage (zero where nothing in the stage needs it).
    Key k = K(st_->input, st_->input_form);
    int grad = Grad(k, v1::Step::BACKWARD);
    int out =
        NewBuffer(st_->input, GradForm(k), v1::Buffer::STAGE_INPUT_GRADIENT, "#stage_in_grad");
    Kernel(v1::Step::BACKWARD, "copy", {grad}, {out});
  }
  FlushGradientBuckets();
  Optimizer();
  AwaitAll();
  HAP_RETURN_IF_ERROR(Finish());
  return std::move(prog_);
}

graph::Shape RankBuilder::LocalShape(TensorId t, int8_t raw) const {
  graph::Shape s = g_.tensor(t).type.shape;
  int d = raw == kZeroStorage ? 0 : raw;
  if (d >= 0) s[d] = dims_.Layout(t, d).lengths[r_];
  return s;
}

std::vector<int64_t> RankBuilder::Offsets(TensorId t, int8_t raw) const {
  std::vector<int64_t> off(g_.tensor(t).type.shape.size(), 0);
  int d = raw == kZeroStorage ? 0 : raw;
  if (d >= 0) off[d] = dims_.Layout(t, d).offsets[r_];
  return off;
}

int RankBuilder::NewBuffer(TensorId t, int8_t raw, v1::Buffer::Role role,
                           const std::string& suffix) {
  const graph::Tensor& tensor = g_.tensor(t);
  return AddBuffer(tensor.name + suffix, LocalShape(t, raw), tensor.type.dtype, role, raw,
                   tensor.type.shape, Offsets(t, raw));
}

// A replicated scratch vector of n elements of tensor `like`'s dtype (not
// the shape of any graph tensor).
int RankBuilder::RowBuffer(const std::string& name, int64_t n, TensorId like) {
  return AddBuffer(name, {n}, g_.tensor(like).type.dtype, v1::Buffer::SCRATCH, Form::R().raw(), {n},
                   {0});
}

int RankBuilder::AddBuffer(const std::string& name, const std::vector<int64_t>& shape,
                           graph::DType dtype, v1::Buffer::Role role, int8_t raw,
                           const std::vector<int64_t>& global_shape,
                           const std::vector<int64_t>& offsets) {
  v1::Buffer* b = prog_.add_buffers();
  int id = prog_.buffers_size() - 1;
  b->set_id(id);
  b->set_tensor(name);
  for (int64_t d : shape) b->add_shape(d);
  b->set_dtype(graph::ToProtoDType(dtype));
  b->set_role(role);
  *b->mutable_form() = FormProto(raw);
  for (int64_t d : global_shape) b->add_global_shape(d);
  for (int64_t d : offsets) b->add_offsets(d);
  bool persistent = role == v1::Buffer::PARAMETER || role == v1::Buffer::OPTIMIZER_STATE;
  b->set_persistent(persistent);
  first_.push_back(persistent || role == v1::Buffer::INPUT || role == v1::Buffer::LOSS ||
                           role == v1::Buffer::STAGE_INPUT ||
                           role == v1::Buffer::STAGE_OUTPUT_GRADIENT
                       ? -1
                       : std::numeric_limits<int>::max());
  last_.push_back(persistent || role == v1::Buffer::LOSS ? kEnd : -1);
  return id;
}

// A buffer shaped like `like` (same local shape and metadata).
int RankBuilder::Scratch(TensorId t, int8_t raw) {
  return NewBuffer(t, raw, v1::Buffer::SCRATCH, "#scratch");
}

int RankBuilder::ZeroStorage(TensorId t) const {
  auto it = fwd_.find({t, kZeroStorage});
  return it == fwd_.end() ? -1 : it->second;
}

absl::StatusOr<int> RankBuilder::SavedForBackward(graph::OpId op, const std::string& what) const {
  auto it = saved_for_backward_.find(op);
  if (it == saved_for_backward_.end()) {
    return absl::InternalError(
        absl::StrCat("op '", g_.op(op).name, "': no ", what, " from its forward"));
  }
  return it->second;
}

absl::StatusOr<int> RankBuilder::Fwd(Key k, const graph::Op& op) const {
  auto it = fwd_.find(k);
  if (it == fwd_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("op '", op.name, "' reads '", g_.tensor(k.first).name, "' as ",
                     Form::FromRaw(k.second).ToString(), ", which the program never produces"));
  }
  return it->second;
}

// A forward value read in backward. A ZeRO parameter's whole copy is
// gathered again for backward (ZeRO-3), so the forward one dies early.
int RankBuilder::BwdValue(Key k) {
  auto z = zero_gathered_.find(k);
  if (z == zero_gathered_.end()) return fwd_.at(k);
  auto it = regathered_.find(k);
  if (it != regathered_.end()) return it->second;
  return Regather(k, /*async=*/false);
}

// The backward all-gather of ZeRO-3 parameter copy `k` (a key of
// zero_gathered_), started and left running with `async`.
int RankBuilder::Regather(Key k, bool async) {
  const auto& z = zero_gathered_.at(k);
  int whole = NewBuffer(k.first, Form::R().raw(), v1::Buffer::ACTIVATION, "#regathered");
  v1::CollectiveCall* c =
      Sharded(v1::Step::BACKWARD, v1::ALL_GATHER, z.second, z.first, whole, k.first, 0);
  if (async) Started(c);
  regathered_[k] = whole;
  return whole;
}

int8_t RankBuilder::GradForm(Key k) const {
  if (k.second == kZeroStorage) return kZeroStorage;
  Form f = Form::FromRaw(k.second);
  if (f.is_partial()) return Form::R().raw();
  if (f.is_replicated()) {
    return a_.partial_grad[k.first] ? Form::P().raw() : Form::R().raw();
  }
  return f.raw();
}

// The gradient buffer of a forward buffer, created (and zeroed) on first
// use.
int RankBuilder::Grad(Key k, v1::Step::Phase phase) {
  auto it = grad_.find(k);
  if (it != grad_.end()) return it->second;
  int8_t gf = GradForm(k);
  int id = NewBuffer(k.first, gf, v1::Buffer::GRADIENT, "#grad");
  grad_[k] = id;
  Fill(phase, id, 0.0);
  return id;
}

// The id a contribution of form `partial` writes to, or -1 when this rank
// skips it (a whole contribution to a partial gradient counts on rank 0).
absl::StatusOr<int> RankBuilder::GradTarget(Key k, bool partial, v1::Step::Phase phase,
                                            const std::string& what) {
  int id = Grad(k, phase);
  bool target_partial = GradForm(k) == Form::P().raw();
  bool target_whole = GradForm(k) == Form::R().raw();
  if (partial && target_whole) {
    return absl::InternalError(absl::StrCat(what, ": a partial gradient contribution to '",
                                            g_.tensor(k.first).name,
                                            "', whose gradient is replicated"));
  }
  if (!partial && target_partial && r_ != 0) return -1;
  return id;
}

void RankBuilder::Use(int id, int step) {
  if (id < 0) return;
  first_[id] = std::min(first_[id], step);
  last_[id] = std::max(last_[id], step);
}

v1::KernelCall* RankBuilder::Kernel(v1::Step::Phase phase, const std::string& name,
                                    const std::vector<int>& in, const std::vector<int>& out,
                                    const std::string& op) {
  for (int i : in) Await(i, phase);
  for (int i : out) Await(i, phase);
  int step = prog_.steps_size();
  v1::Step* s = prog_.add_steps();
  s->set_phase(phase);
  v1::KernelCall* k = s->mutable_kernel();
  k->set_kernel(name);
  k->set_op(op);
  for (int i : in) {
    k->add_inputs(i);
    Use(i, step);
  }
  for (int i : out) {
    k->add_outputs(i);
    Use(i, step);
  }
  return k;
}

void RankBuilder::Fill(v1::Step::Phase phase, int id, double value) {
  v1::KernelCall* k = Kernel(phase, "fill", {}, {id});
  (*k->mutable_attrs())["value"].set_f(value);
}

v1::CollectiveCall* RankBuilder::Coll(v1::Step::Phase phase, v1::Collective kind, int in, int out,
                                      TensorId t) {
  Await(in, phase);
  Await(out, phase);
  int step = prog_.steps_size();
  v1::Step* s = prog_.add_steps();
  s->set_phase(phase);
  v1::CollectiveCall* c = s->mutable_collective();
  c->set_collective(kind);
  c->set_input(in);
  c->set_output(out);
  c->set_tensor(g_.tensor(t).name);
  Use(in, step);
  Use(out, step);
  return c;
}

v1::CollectiveCall* RankBuilder::Sharded(v1::Step::Phase phase, v1::Collective kind,
                                         synth::Method m, int in, int out, TensorId t, int dim) {
  v1::CollectiveCall* c = Coll(phase, kind, in, out, t);
  c->set_method(MethodProto(m));
  c->set_dim(dim);
  for (int64_t l : dims_.Layout(t, dim).lengths) c->add_shard_sizes(l);
  return c;
}

void RankBuilder::SliceAttrs(v1::KernelCall* k, TensorId t, int dim) {
  const ShardLayout& l = dims_.Layout(t, dim);
  auto& a = *k->mutable_attrs();
  a["axis"].set_i(dim);
  a["start"].set_i(l.offsets[r_]);
  a["end"].set_i(l.offsets[r_] + l.lengths[r_]);
}

// Lifetimes and arena offsets.
absl::Status RankBuilder::Finish() {
  const int end = prog_.steps_size();
  std::vector<ArenaRequest> req;
  for (int i = 0; i < prog_.buffers_size(); ++i) {
    v1::Buffer* b = prog_.mutable_buffers(i);
    int first = first_[i], last = last_[i] == kEnd ? end : last_[i];
    if (first == std::numeric_limits<int>::max()) first = last = -1;  // unused
    b->set_first_use(first);
    b->set_last_use(last);
    int64_t n = 1;
    for (int64_t d : b->shape()) n *= d;
    req.push_back({n * graph::DTypeBytes(graph::FromProtoDType(b->dtype())), first, last});
  }
  ArenaLayout layout = PlanArena(req);
  if (layout.overflow) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", r_, prog_.device().empty() ? "" : " (device '" + prog_.device() + "')",
        ": the buffers it holds at once need more than 2^63 bytes"));
  }
  for (int i = 0; i < prog_.buffers_size(); ++i) {
    prog_.mutable_buffers(i)->set_offset_bytes(layout.offsets[i]);
  }
  prog_.set_arena_bytes(layout.total_bytes);
  return absl::OkStatus();
}

}  // namespace hap::lower::internal
