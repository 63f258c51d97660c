#include "planner/lower/lower.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "executor/runtime/random.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/op_registry.h"
#include "planner/lower/arena.h"
#include "planner/ratios/ratio_lp.h"
#include "planner/synth/gradients.h"
#include "planner/synth/rules.h"
#include "planner/util/status_macros.h"

namespace hap::lower {
namespace {

namespace v1 = ::hap::v1;
using graph::TensorId;
using synth::Form;

// A buffer key: a tensor in a form. ZeRO storage (the S(0) shard a ZeRO
// parameter is kept in) has its own pseudo-form.
using Key = std::pair<TensorId, int8_t>;
constexpr int8_t kZeroStorage = -10;

Key K(TensorId t, Form f) { return {t, f.raw()}; }

// Union-find over the sharded (tensor, dimension) pairs of a program; each
// class is one logical split (see lower.h).
class DimClasses {
 public:
  explicit DimClasses(const graph::Graph& g) : g_(g) {}

  int Node(TensorId t, int dim) {
    auto [it, fresh] = id_.emplace(std::make_pair(t, dim), static_cast<int>(parent_.size()));
    if (fresh) {
      parent_.push_back(it->second);
      length_.push_back(g_.tensor(t).type.shape[dim]);
    }
    return it->second;
  }
  void Union(int a, int b) {
    a = Find(a);
    b = Find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);
  }
  // Node a's shards must be whole multiples of length / units (grouped MoE
  // routing: whole groups): its class's unit divides `units`.
  void Granule(int a, int64_t units) { granules_.push_back({a, units}); }
  void Solve(const std::vector<double>& ratios) {
    const int n = static_cast<int>(ratios.size());
    std::map<int, int64_t> gcd;
    for (size_t i = 0; i < parent_.size(); ++i) {
      int r = Find(static_cast<int>(i));
      gcd[r] = std::gcd(gcd[r], length_[i]);
    }
    for (auto [a, units] : granules_) {
      int r = Find(a);
      gcd[r] = std::gcd(gcd[r], units);
    }
    std::map<int, std::vector<int64_t>> units;
    for (auto& [root, g] : gcd) {
      std::vector<int64_t> m = ratios::RoundShards(g, ratios);
      // Every rank gets at least one unit where there are enough: kernels
      // then never see an empty shard.
      if (g >= n) {
        for (int r = 0; r < n; ++r) {
          while (m[r] == 0) {
            int big = static_cast<int>(std::max_element(m.begin(), m.end()) - m.begin());
            --m[big];
            ++m[r];
          }
        }
      }
      units[root] = std::move(m);
    }
    layout_.assign(parent_.size(), {});
    for (size_t i = 0; i < parent_.size(); ++i) {
      int root = Find(static_cast<int>(i));
      int64_t scale = length_[i] / gcd[root];
      ShardLayout& l = layout_[i];
      int64_t off = 0;
      for (int64_t u : units[root]) {
        l.offsets.push_back(off);
        l.lengths.push_back(u * scale);
        off += u * scale;
      }
    }
  }
  const ShardLayout& Layout(TensorId t, int dim) const {
    return layout_[id_.at({t, dim})];
  }

 private:
  int Find(int a) {
    while (parent_[a] != a) a = parent_[a] = parent_[parent_[a]];
    return a;
  }
  const graph::Graph& g_;
  std::map<std::pair<TensorId, int>, int> id_;
  std::vector<int> parent_;
  std::vector<int64_t> length_;
  std::vector<std::pair<int, int64_t>> granules_;
  std::vector<ShardLayout> layout_;
};

// What lowering knows of the program independently of the rank.
using Analysis = synth::GradientAnalysis;
using synth::Differentiable;
using synth::PartialContribution;

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

// Builds one rank's program.
class RankBuilder {
 public:
  RankBuilder(const graph::Graph& g, const synth::Program& p,
              const LowerOptions& o, const DimClasses& dims, const Analysis& a,
              int rank, const StageSpec* stage = nullptr)
      : g_(g), p_(p), o_(o), dims_(dims), a_(a), r_(rank), st_(stage) {}

  absl::StatusOr<v1::RankProgram> Build() {
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
      HAP_RETURN_IF_ERROR(Forward(p_.steps[k]));
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
      int out = NewBuffer(st_->input, GradForm(k), v1::Buffer::STAGE_INPUT_GRADIENT,
                          "#stage_in_grad");
      Kernel(v1::Step::BACKWARD, "copy", {grad}, {out});
    }
    FlushGradientBuckets();
    Optimizer();
    AwaitAll();
    Finish();
    return std::move(prog_);
  }

 private:
  // --- buffers -----------------------------------------------------------
  graph::Shape LocalShape(TensorId t, int8_t raw) const {
    graph::Shape s = g_.tensor(t).type.shape;
    int d = raw == kZeroStorage ? 0 : raw;
    if (d >= 0) s[d] = dims_.Layout(t, d).lengths[r_];
    return s;
  }
  std::vector<int64_t> Offsets(TensorId t, int8_t raw) const {
    std::vector<int64_t> off(g_.tensor(t).type.shape.size(), 0);
    int d = raw == kZeroStorage ? 0 : raw;
    if (d >= 0) off[d] = dims_.Layout(t, d).offsets[r_];
    return off;
  }
  int NewBuffer(TensorId t, int8_t raw, v1::Buffer::Role role,
                const std::string& suffix = "") {
    const graph::Tensor& tensor = g_.tensor(t);
    return AddBuffer(tensor.name + suffix, LocalShape(t, raw), tensor.type.dtype, role,
                     raw, tensor.type.shape, Offsets(t, raw));
  }
  // A replicated scratch vector of n elements of tensor `like`'s dtype (not
  // the shape of any graph tensor).
  int RowBuffer(const std::string& name, int64_t n, TensorId like) {
    return AddBuffer(name, {n}, g_.tensor(like).type.dtype, v1::Buffer::SCRATCH,
                     Form::R().raw(), {n}, {0});
  }
  int AddBuffer(const std::string& name, const std::vector<int64_t>& shape,
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
    bool persistent = role == v1::Buffer::PARAMETER ||
                      role == v1::Buffer::OPTIMIZER_STATE;
    b->set_persistent(persistent);
    first_.push_back(persistent || role == v1::Buffer::INPUT ||
                             role == v1::Buffer::LOSS || role == v1::Buffer::STAGE_INPUT ||
                             role == v1::Buffer::STAGE_OUTPUT_GRADIENT
                         ? -1
                         : std::numeric_limits<int>::max());
    last_.push_back(persistent || role == v1::Buffer::LOSS ? kEnd : -1);
    return id;
  }
  // A buffer shaped like `like` (same local shape and metadata).
  int Scratch(TensorId t, int8_t raw) {
    return NewBuffer(t, raw, v1::Buffer::SCRATCH, "#scratch");
  }

  absl::StatusOr<int> Fwd(Key k, const graph::Op& op) const {
    auto it = fwd_.find(k);
    if (it == fwd_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "op '", op.name, "' reads '", g_.tensor(k.first).name, "' as ",
          Form::FromRaw(k.second).ToString(), ", which the program never produces"));
    }
    return it->second;
  }

  // A forward value read in backward. A ZeRO parameter's whole copy is
  // gathered again for backward (ZeRO-3), so the forward one dies early.
  int BwdValue(Key k) {
    auto z = zero_gathered_.find(k);
    if (z == zero_gathered_.end()) return fwd_.at(k);
    auto it = regathered_.find(k);
    if (it != regathered_.end()) return it->second;
    return Regather(k, /*async=*/false);
  }
  // The backward all-gather of ZeRO-3 parameter copy `k` (a key of
  // zero_gathered_), started and left running with `async`.
  int Regather(Key k, bool async) {
    const auto& z = zero_gathered_.at(k);
    int whole = NewBuffer(k.first, Form::R().raw(), v1::Buffer::ACTIVATION, "#regathered");
    v1::CollectiveCall* c =
        Sharded(v1::Step::BACKWARD, v1::ALL_GATHER, z.second, z.first, whole, k.first, 0);
    if (async) Started(c);
    regathered_[k] = whole;
    return whole;
  }

  int8_t GradForm(Key k) const {
    if (k.second == kZeroStorage) return kZeroStorage;
    Form f = Form::FromRaw(k.second);
    if (f.is_partial()) return Form::R().raw();
    if (f.is_replicated()) {
      return a_.partial_grad[k.first] ? Form::P().raw() : Form::R().raw();
    }
    return f.raw();
  }
  bool HasGrad(Key k) const { return grad_.count(k) > 0; }
  // The gradient buffer of a forward buffer, created (and zeroed) on first
  // use.
  int Grad(Key k, v1::Step::Phase phase) {
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
  absl::StatusOr<int> GradTarget(Key k, bool partial, v1::Step::Phase phase,
                                 const std::string& what) {
    int id = Grad(k, phase);
    bool target_partial = GradForm(k) == Form::P().raw();
    bool target_whole = GradForm(k) == Form::R().raw();
    if (partial && target_whole) {
      return absl::InternalError(absl::StrCat(
          what, ": a partial gradient contribution to '",
          g_.tensor(k.first).name, "', whose gradient is replicated"));
    }
    if (!partial && target_partial && r_ != 0) return -1;
    return id;
  }

  // --- steps -------------------------------------------------------------
  void Use(int id, int step) {
    if (id < 0) return;
    first_[id] = std::min(first_[id], step);
    last_[id] = std::max(last_[id], step);
  }
  v1::KernelCall* Kernel(v1::Step::Phase phase, const std::string& name,
                         const std::vector<int>& in, const std::vector<int>& out,
                         const std::string& op = "") {
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
  void Fill(v1::Step::Phase phase, int id, double value) {
    v1::KernelCall* k = Kernel(phase, "fill", {}, {id});
    (*k->mutable_attrs())["value"].set_f(value);
  }
  v1::CollectiveCall* Coll(v1::Step::Phase phase, v1::Collective kind, int in,
                           int out, TensorId t) {
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
  v1::CollectiveCall* Sharded(v1::Step::Phase phase, v1::Collective kind,
                              synth::Method m, int in, int out, TensorId t,
                              int dim) {
    v1::CollectiveCall* c = Coll(phase, kind, in, out, t);
    c->set_method(MethodProto(m));
    c->set_dim(dim);
    for (int64_t l : dims_.Layout(t, dim).lengths) c->add_shard_sizes(l);
    return c;
  }
  void SliceAttrs(v1::KernelCall* k, TensorId t, int dim) {
    const ShardLayout& l = dims_.Layout(t, dim);
    auto& a = *k->mutable_attrs();
    a["axis"].set_i(dim);
    a["start"].set_i(l.offsets[r_]);
    a["end"].set_i(l.offsets[r_] + l.lengths[r_]);
  }

  // --- forward -----------------------------------------------------------
  absl::Status Forward(const synth::OpStep& s) {
    const graph::Op& op = g_.op(s.op);
    const auto F = v1::Step::FORWARD;
    for (const synth::SourceLoad& l : s.loads) {
      const graph::Tensor& t = g_.tensor(l.tensor);
      if (!l.parameter) {
        fwd_[K(l.tensor, l.form)] = NewBuffer(l.tensor, l.form.raw(), v1::Buffer::INPUT);
        continue;
      }
      ParamSlot slot;
      slot.tensor = l.tensor;
      auto once = gather_once_.find(l.tensor);
      if (once != gather_once_.end()) {
        // Gathered before forward (GatherOnceParameters); the whole copy
        // stays for backward.
        slot.storage = {l.tensor, kZeroStorage};
        fwd_[slot.storage] = once->second.in;
        fwd_[K(l.tensor, Form::R())] = once->second.out;
      } else if (l.storage == synth::ParamStorage::kZero) {
        slot.storage = {l.tensor, kZeroStorage};
        auto pre = prefetched_.find(l.tensor);
        std::pair<int, int> gathered;
        if (pre == prefetched_.end()) {
          gathered = GatherZero3(l, /*async=*/false);
        } else {
          gathered = pre->second;
          prefetched_.erase(pre);
        }
        fwd_[slot.storage] = gathered.first;
        fwd_[K(l.tensor, Form::R())] = gathered.second;
        zero_gathered_[K(l.tensor, Form::R())] = {fwd_.at(slot.storage), l.method};
      } else {
        slot.storage = K(l.tensor, l.form);
        fwd_[slot.storage] = NewBuffer(l.tensor, l.form.raw(), v1::Buffer::PARAMETER);
      }
      slot.replicated = l.storage == synth::ParamStorage::kReplicated;
      if (!t.frozen) params_.push_back(slot);
    }
    if (IsZero3Step(s.op)) {
      // The next op's gathers queue behind this op's (waited for at their
      // first use below): one op ahead.
      auto next = std::upper_bound(zero3_steps_.begin(), zero3_steps_.end(), s.op);
      if (next != zero3_steps_.end()) PrefetchGathers(*next);
    }
    if (st_ != nullptr) {
      // A model input whose load sits in another stage: loaded here.
      for (const synth::CommStep& c : s.comms) StageLoad(K(c.tensor, c.from));
      for (size_t j = 0; j < op.inputs.size(); ++j) StageLoad(K(op.inputs[j], s.rule.inputs[j]));
    }
    for (const synth::CommStep& c : s.comms) {
      HAP_ASSIGN_OR_RETURN(int in, Fwd(K(c.tensor, c.from), op));
      int out = NewBuffer(c.tensor, c.to.raw(), v1::Buffer::ACTIVATION);
      fwd_[K(c.tensor, c.to)] = out;
      EmitForwardComm(c, in, out);
    }
    std::vector<int> in, out;
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      HAP_ASSIGN_OR_RETURN(int id, Fwd(K(op.inputs[j], s.rule.inputs[j]), op));
      in.push_back(AddedOnce(s.rule, static_cast<int>(j)) && r_ != 0 ? -1 : id);
    }
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      Key k = K(op.outputs[j], s.rule.outputs[j]);
      int id = NewBuffer(op.outputs[j], k.second, v1::Buffer::ACTIVATION);
      fwd_[k] = id;
      out.push_back(id);
    }
    if (IsVocabCrossEntropy(s, op)) return VocabCrossEntropy(s, op, in, out);
    if (IsShardedBatchNorm(s, op)) {
      ShardedBatchNorm(s, op, in, out);
    } else {
      v1::KernelCall* call = Kernel(F, op.type, in, out, op.name);
      OpAttrs(s, op, call);
    }
    if (op.type == "batch_norm") WriteBackRunningStats(op, in);
    return absl::OkStatus();
  }

  // batch_norm over a batch sharded along dimension 0 (its "data(0)" rule):
  // the per-channel sums of x and x^2 are all-reduced between its pieces,
  // so every rank normalises with the global batch's statistics
  // (executor/cpu/kernels_batch_norm.cc); backward likewise with the sums of
  // dy and dy * xhat.
  static bool IsShardedBatchNorm(const synth::OpStep& s, const graph::Op& op) {
    return op.type == "batch_norm" && s.rule.inputs[0].is_sharded() &&
           s.rule.inputs[0].dim() == 0;
  }
  // A replicated f64 [2, c] buffer of per-channel sums.
  int SumsBuffer(const std::string& name, int64_t c) {
    return AddBuffer(name, {2, c}, graph::DType::kFloat64, v1::Buffer::SCRATCH,
                     Form::R().raw(), {2, c}, {0, 0});
  }
  void AllReduceSums(v1::Step::Phase phase, int in, int out, TensorId x,
                     const std::string& name) {
    Coll(phase, v1::ALL_REDUCE, in, out, x)->set_tensor(name);
  }
  void ShardedBatchNorm(const synth::OpStep& s, const graph::Op& op,
                        std::vector<int> in, const std::vector<int>& out) {
    const auto F = v1::Step::FORWARD;
    const int64_t c = g_.tensor(op.inputs[0]).type.shape[1];
    const int local = SumsBuffer(op.name + "#sums", c);
    const int global = SumsBuffer(op.name + "#sums_all", c);
    OpAttrs(s, op, Kernel(F, "batch_norm_stats", {in[0]}, {local}, op.name));
    AllReduceSums(F, local, global, op.inputs[0], op.name + "#sums");
    in.resize(5, -1);  // running statistics absent
    in.push_back(global);
    OpAttrs(s, op, Kernel(F, "batch_norm_apply", in, out, op.name));
    bn_sums_[s.op] = global;
  }
  // batch_norm updates its running statistics (frozen parameters) in place;
  // one stored ZeRO-sharded was updated in its gathered whole copy, so the
  // rank's shard takes its slice back.
  void WriteBackRunningStats(const graph::Op& op, const std::vector<int>& in) {
    for (size_t j = 3; j < op.inputs.size() && j < in.size(); ++j) {
      auto shard = fwd_.find({op.inputs[j], kZeroStorage});
      if (shard == fwd_.end() || in[j] < 0) continue;
      SliceAttrs(Kernel(v1::Step::FORWARD, "slice", {in[j]}, {shard->second}),
                 op.inputs[j], 0);
    }
  }

  // Cross-entropy over logits sharded by class (the "vocab" rule): each
  // rank's row log-sum-exps over its classes are all-gathered, then each
  // rank computes its part of the loss (P) and, in backward, its classes'
  // gradient (executor/cpu/kernels_loss.cc).
  static bool IsVocabCrossEntropy(const synth::OpStep& s, const graph::Op& op) {
    return op.type == "cross_entropy" && s.rule.name == "vocab";
  }
  void VocabAttrs(const synth::OpStep& s, const graph::Op& op, v1::KernelCall* k) {
    OpAttrs(s, op, k);
    auto& a = *k->mutable_attrs();
    a["vocab_offset"].set_i(dims_.Layout(op.inputs[0], 1).offsets[r_]);
    a["vocab_size"].set_i(g_.tensor(op.inputs[0]).type.shape[1]);
    a["rank"].set_i(r_);
    a["ranks"].set_i(o_.world_size);
  }
  absl::Status VocabCrossEntropy(const synth::OpStep& s, const graph::Op& op,
                                 const std::vector<int>& in,
                                 const std::vector<int>& out) {
    const auto F = v1::Step::FORWARD;
    const int64_t rows = g_.tensor(op.inputs[0]).type.shape[0];
    const int n = o_.world_size;
    const int lse = RowBuffer(op.name + "#lse", rows, op.inputs[0]);
    const int all = RowBuffer(op.name + "#lse_all", rows * n, op.inputs[0]);
    VocabAttrs(s, op, Kernel(F, "cross_entropy_lse", {in[0]}, {lse}, op.name));
    v1::CollectiveCall* c = Coll(F, v1::ALL_GATHER, lse, all, op.inputs[0]);
    c->set_tensor(op.name + "#lse");
    c->set_method(MethodProto(synth::Method::kPadded));
    c->set_dim(0);
    for (int r = 0; r < n; ++r) c->add_shard_sizes(rows);
    VocabAttrs(s, op, Kernel(F, "cross_entropy_sharded", {in[0], in[1], all},
                             {out[0]}, op.name));
    vocab_lse_[s.op] = all;
    return absl::OkStatus();
  }

  void EmitForwardComm(const synth::CommStep& c, int in, int out) {
    const auto F = v1::Step::FORWARD;
    using C = synth::Collective;
    switch (c.forward) {
      case C::kAllGather:
        Sharded(F, v1::ALL_GATHER, c.method, in, out, c.tensor, c.from.dim());
        break;
      case C::kAllReduce:
        Coll(F, v1::ALL_REDUCE, in, out, c.tensor);
        break;
      case C::kReduceScatter:
        Sharded(F, v1::REDUCE_SCATTER, c.method, in, out, c.tensor, c.to.dim());
        break;
      case C::kAllToAll: {
        v1::CollectiveCall* call = Sharded(F, v1::ALL_TO_ALL, c.method, in, out,
                                           c.tensor, c.to.dim());
        call->set_from_dim(c.from.dim());
        for (int64_t l : dims_.Layout(c.tensor, c.from.dim()).lengths) {
          call->add_from_shard_sizes(l);
        }
        break;
      }
      case C::kSlice:
        SliceAttrs(Kernel(F, "slice", {in}, {out}), c.tensor, c.to.dim());
        break;
      case C::kZeroOut:
        if (r_ == 0) {
          Kernel(F, "copy", {in}, {out});
        } else {
          Fill(F, out, 0.0);
        }
        break;
    }
  }

  // The ops whose products bf16 mixed precision rounds (LowerOptions::bf16);
  // grouped convolutions have no bf16 kernels and stay float32.
  static bool IsBf16Product(const graph::Op& op) {
    return op.type == "linear" || op.type == "matmul" ||
           (op.type == "conv2d" && op.attrs.Int("groups", 1).value_or(1) == 1);
  }

  // Attributes for sharded execution (executor/cpu/kernels.h).
  void OpAttrs(const synth::OpStep& s, const graph::Op& op, v1::KernelCall* call) {
    auto& a = *call->mutable_attrs();
    for (const auto& [name, v] : op.attrs.values()) {
      if (name.rfind(graph::kAnnotationPrefix, 0) == 0) continue;
      graph::AttrToProto(v, &a[name]);
    }
    if (o_.bf16 && IsBf16Product(op)) a["bf16"].set_b(true);
    const graph::Shape& in0 = g_.tensor(op.inputs[0]).type.shape;
    if (op.type == "dropout" || op.type == "drop_path") {
      // Counter-based masks keyed by global indices (drop_path: by sample).
      uint64_t key = executor::CounterKey(o_.seed, executor::HashName(op.name));
      a["rng_key"].set_i(static_cast<int64_t>(key));
      auto* gs = a["global_shape"].mutable_ints();
      for (int64_t d : in0) gs->add_values(d);
      auto* off = a["offsets"].mutable_ints();
      for (int64_t d : Offsets(op.inputs[0], s.rule.inputs[0].raw())) off->add_values(d);
    } else if (op.type == "nll_loss" || op.type == "cross_entropy") {
      a["global_rows"].set_i(in0[0]);
    } else if (op.type == "batch_norm") {
      // Elements per channel of the whole batch.
      a["global_count"].set_i(graph::NumElements(in0) / in0[1]);
    } else if (op.type == "mean") {
      std::vector<int64_t> axes = op.attrs.Ints("axes", {}).value_or(std::vector<int64_t>{});
      int64_t count = 1;
      int rank = static_cast<int>(in0.size());
      for (int d = 0; d < rank; ++d) {
        bool reduced = axes.empty();
        for (int64_t x : axes) reduced = reduced || (x < 0 ? x + rank : x) == d;
        if (reduced) count *= in0[d];
      }
      a["global_count"].set_i(count);
    } else if (op.type == "moe_dispatch_idx" || op.type == "moe_combine_idx") {
      // The compact route holds global slots; a rank holding experts
      // [offset, offset + local) keeps theirs (executor/cpu/kernels.h).
      const bool dispatch = op.type == "moe_dispatch_idx";
      const TensorId experts = dispatch ? op.outputs[0] : op.inputs[0];
      const Form f = dispatch ? s.rule.outputs[0] : s.rule.inputs[0];
      a["experts"].set_i(g_.tensor(experts).type.shape[0]);
      a["expert_offset"].set_i(f.is_sharded() && f.dim() == 0
                                   ? dims_.Layout(experts, 0).offsets[r_]
                                   : 0);
      // Grouped routing split by groups: this rank's run of every expert's
      // slots, of the whole capacity.
      a["capacity"].set_i(g_.tensor(experts).type.shape[1]);
      a["capacity_offset"].set_i(f.is_sharded() && f.dim() == 1
                                     ? dims_.Layout(experts, 1).offsets[r_]
                                     : 0);
    } else if (op.type == "moe_route") {
      // Grouped routing split by groups: this rank's tokens of the whole.
      a["global_tokens"].set_i(in0[0]);
      const Form f = s.rule.inputs[0];
      a["token_offset"].set_i(f.is_sharded() && f.dim() == 0
                                  ? dims_.Layout(op.inputs[0], 0).offsets[r_]
                                  : 0);
    } else if (op.type == "embedding") {
      const graph::Shape& table = g_.tensor(op.inputs[1]).type.shape;
      a["vocab_size"].set_i(table[0]);
      Form tf = s.rule.inputs[1];
      a["vocab_offset"].set_i(tf.is_sharded() && tf.dim() == 0
                                  ? dims_.Layout(op.inputs[1], 0).offsets[r_]
                                  : 0);
    }
  }

  absl::Status Loss() {
    TensorId l = g_.loss();
    Key k = K(l, Form::R());
    if (!fwd_.count(k)) k = K(l, Form::P());
    if (!fwd_.count(k)) {
      return absl::FailedPreconditionError(
          "the program does not compute the loss in form R or P");
    }
    int loss = NewBuffer(l, Form::R().raw(), v1::Buffer::LOSS, "#value");
    prog_.set_loss_buffer(loss);
    if (Form::FromRaw(k.second).is_partial()) {
      // This rank's part now; summed with the gradient bucket after backward
      // (FlushGradientBuckets): nothing reads the value before the step
      // ends, and one synchronisation fewer per step.
      Kernel(v1::Step::FORWARD, "copy", {fwd_[k]}, {loss});
      partial_loss_ = loss;
    } else {
      Kernel(v1::Step::FORWARD, "copy", {fwd_[k]}, {loss});
    }
    // dL/dL = 1, whole on every rank (the gradient of a P or R loss is R);
    // a pipeline stage's microbatch counts 1 / microbatches of the step.
    int seed = Grad(k, v1::Step::BACKWARD);
    Fill(v1::Step::BACKWARD, seed, st_ != nullptr ? 1.0 / st_->microbatches : 1.0);
    return absl::OkStatus();
  }

  // A pipeline stage's end: the output for the next stage, and its
  // gradient from there seeding backward. The LOSS buffer holds 0.
  absl::Status StageOutput() {
    Key k = K(st_->output, st_->output_form);
    auto it = fwd_.find(k);
    if (it == fwd_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the stage never produces its output '", g_.tensor(st_->output).name, "' as ",
          st_->output_form.ToString()));
    }
    int out = NewBuffer(st_->output, k.second, v1::Buffer::STAGE_OUTPUT, "#stage_out");
    Kernel(v1::Step::FORWARD, "copy", {it->second}, {out});
    int loss = NewBuffer(g_.loss(), Form::R().raw(), v1::Buffer::LOSS, "#value");
    prog_.set_loss_buffer(loss);
    Fill(v1::Step::FORWARD, loss, 0.0);
    int in = NewBuffer(st_->output, GradForm(k), v1::Buffer::STAGE_OUTPUT_GRADIENT,
                       "#stage_out_grad");
    Kernel(v1::Step::BACKWARD, "copy", {in}, {Grad(k, v1::Step::BACKWARD)});
    return absl::OkStatus();
  }

  // Stage mode: a model input read as `k` and loaded by no step of this
  // stage gets an INPUT buffer of that form.
  void StageLoad(Key k) {
    if (g_.tensor(k.first).kind != graph::TensorKind::kInput || fwd_.count(k)) return;
    fwd_[k] = NewBuffer(k.first, k.second, v1::Buffer::INPUT);
  }

  // --- backward ----------------------------------------------------------
  absl::Status Backward(int k) {
    const synth::OpStep& s = p_.steps[k];
    const graph::Op& op = g_.op(s.op);
    if (IsZero3Step(k)) {
      // This op's backward gathers (those not started yet), then the
      // previous op's, one ahead; each waited for at its first use.
      PrefetchRegathers(k);
      auto prev = std::lower_bound(zero3_steps_.begin(), zero3_steps_.end(), k);
      if (prev != zero3_steps_.begin()) PrefetchRegathers(*(prev - 1));
    }
    // The op's gradient kernel.
    bool any_dy = false;
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      any_dy = any_dy || HasGrad(K(op.outputs[j], s.rule.outputs[j]));
    }
    bool any_dx = false;
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      any_dx = any_dx || (a_.requires_grad[op.inputs[j]] &&
                          Differentiable(g_, op, static_cast<int>(j)));
    }
    if (any_dy && any_dx) {
      HAP_RETURN_IF_ERROR(OpBackward(k, s, op));
    }
    // The duals of the communication in front of it, last first.
    for (auto c = s.comms.rbegin(); c != s.comms.rend(); ++c) {
      HAP_RETURN_IF_ERROR(CommBackward(*c));
    }
    // Gradient synchronisation of the parameters it loaded.
    for (const synth::SourceLoad& l : s.loads) {
      if (l.parameter && !g_.tensor(l.tensor).frozen) SyncParameter(l);
    }
    StartGradientBuckets(k);
    return absl::OkStatus();
  }

  absl::Status OpBackward(int k, const synth::OpStep& s, const graph::Op& op) {
    const auto B = v1::Step::BACKWARD;
    std::vector<int> in, outs, dys, dxs;
    bool replicated_rule = !s.rule.split && s.rule.kind != synth::RuleKind::kPartial;
    bool any_partial_out = false;
    for (TensorId o : op.outputs) any_partial_out = any_partial_out || a_.partial_grad[o];
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      Key key = K(op.inputs[j], s.rule.inputs[j]);
      HAP_RETURN_IF_ERROR(Fwd(key, op).status());
      in.push_back(BwdValue(key));
    }
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      Key key = K(op.outputs[j], s.rule.outputs[j]);
      outs.push_back(BwdValue(key));
      int dy = HasGrad(key) ? grad_.at(key) : -1;
      // A replicated op whose outputs' gradients are partly partial: the
      // whole ones count on rank 0 only, and every input gradient is partial.
      if (replicated_rule && any_partial_out && !a_.partial_grad[op.outputs[j]] &&
          r_ != 0) {
        dy = -1;
      }
      dys.push_back(dy);
    }
    TensorId sfb = a_.sfb_param[k];
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      TensorId t = op.inputs[j];
      if (!a_.requires_grad[t] || !Differentiable(g_, op, static_cast<int>(j)) ||
          (sfb == t && j == 1)) {
        dxs.push_back(-1);
        continue;
      }
      Form f = s.rule.inputs[j];
      bool partial = f.is_replicated() &&
                     PartialContribution(s, op, static_cast<int>(j), a_.partial_grad);
      HAP_ASSIGN_OR_RETURN(int dx, GradTarget(K(t, f), partial, B, op.name));
      dxs.push_back(dx);
    }
    std::vector<int> inputs = in;
    inputs.insert(inputs.end(), outs.begin(), outs.end());
    inputs.insert(inputs.end(), dys.begin(), dys.end());
    bool any_out = std::any_of(dxs.begin(), dxs.end(), [](int x) { return x >= 0; });
    bool any_in = std::any_of(dys.begin(), dys.end(), [](int x) { return x >= 0; });
    if (any_out && any_in && IsVocabCrossEntropy(s, op)) {
      // softmax - onehot over this rank's classes, from the gathered
      // log-sum-exps; the targets get no gradient.
      auto lse = vocab_lse_.find(s.op);
      if (lse == vocab_lse_.end()) {
        return absl::InternalError(absl::StrCat(
            "op '", op.name, "': no gathered log-sum-exps from its forward"));
      }
      if (dxs[0] >= 0 && dys[0] >= 0) {
        VocabAttrs(s, op, Kernel(B, "cross_entropy_sharded_grad",
                                 {in[0], in[1], lse->second, dys[0]}, {dxs[0]},
                                 op.name));
      }
    } else if (any_out && any_in && IsShardedBatchNorm(s, op)) {
      auto sums = bn_sums_.find(s.op);
      if (sums == bn_sums_.end()) {
        return absl::InternalError(absl::StrCat(
            "op '", op.name, "': no all-reduced sums from its forward"));
      }
      if (dys[0] >= 0) {
        const int64_t c = g_.tensor(op.inputs[0]).type.shape[1];
        const int local = SumsBuffer(op.name + "#grad_sums", c);
        const int global = SumsBuffer(op.name + "#grad_sums_all", c);
        OpAttrs(s, op, Kernel(B, "batch_norm_grad_stats",
                              {in[0], sums->second, dys[0]}, {local}, op.name));
        AllReduceSums(B, local, global, op.inputs[0], op.name + "#grad_sums");
        OpAttrs(s, op, Kernel(B, "batch_norm_grad_apply",
                              {in[0], in[1], sums->second, global, dys[0]},
                              {dxs[0], dxs[1], dxs[2]}, op.name));
      }
    } else if (any_out && any_in) {
      v1::KernelCall* call = Kernel(B, op.type + "_grad", inputs, dxs, op.name);
      OpAttrs(s, op, call);
    }
    if (sfb >= 0) HAP_RETURN_IF_ERROR(SfbBackward(k, s, op, in));
    return absl::OkStatus();
  }

  // Sufficient factor broadcasting: gather x and dy of a data-parallel
  // linear, and every rank computes the whole weight gradient.
  absl::Status SfbBackward(int k, const synth::OpStep& s, const graph::Op& op,
                           const std::vector<int>& in) {
    const auto B = v1::Step::GRADIENT_SYNC;
    TensorId x = op.inputs[0], y = op.outputs[0], w = op.inputs[1];
    Form xf = s.rule.inputs[0];
    Key yk = K(y, s.rule.outputs[0]);
    if (!HasGrad(yk) || !xf.is_sharded()) return absl::OkStatus();
    synth::Method method = synth::Method::kPadded;
    for (const auto& l : p_.steps[k].loads) {
      if (l.tensor == w) method = l.method;
    }
    int xs = NewBuffer(x, Form::R().raw(), v1::Buffer::SCRATCH, "#sfb");
    int dys = NewBuffer(y, Form::R().raw(), v1::Buffer::SCRATCH, "#sfb_grad");
    Sharded(B, v1::ALL_GATHER, method, in[0], xs, x, xf.dim());
    Sharded(B, v1::ALL_GATHER, method, grad_.at(yk), dys, y, xf.dim());
    HAP_ASSIGN_OR_RETURN(int dw, GradTarget(K(w, Form::R()), false, B, op.name));
    std::vector<int> inputs = {xs, in[1]};
    std::vector<int> dx = {-1, dw};
    if (op.inputs.size() == 3) {
      inputs.push_back(in[2]);
      dx.push_back(-1);
    }
    inputs.push_back(dys);  // the output's value is not read by linear_grad
    inputs.push_back(dys);
    if (dw >= 0) Kernel(B, "linear_grad", inputs, dx, op.name);
    return absl::OkStatus();
  }

  absl::Status CommBackward(const synth::CommStep& c) {
    Key to = K(c.tensor, c.to), from = K(c.tensor, c.from);
    if (!a_.requires_grad[c.tensor] || !HasGrad(to)) return absl::OkStatus();
    const auto B = v1::Step::BACKWARD;
    using C = synth::Collective;
    int gt = grad_.at(to);
    bool gt_partial = GradForm(to) == Form::P().raw();
    std::string what = absl::StrCat("dual of ", synth::CollectiveName(c.forward),
                                    " of '", g_.tensor(c.tensor).name, "'");
    auto accumulate = [&](int src, bool partial) -> absl::Status {
      HAP_ASSIGN_OR_RETURN(int dst, GradTarget(from, partial, B, what));
      if (dst >= 0) Kernel(B, "accumulate", {src}, {dst});
      return absl::OkStatus();
    };
    switch (c.forward) {
      case C::kAllGather: {  // S(d) -> R; gradient back to S(d)
        int d = c.from.dim();
        int tmp = Scratch(c.tensor, c.from.raw());
        if (gt_partial) {
          Sharded(B, v1::REDUCE_SCATTER, c.method, gt, tmp, c.tensor, d);
        } else {
          SliceAttrs(Kernel(B, "slice", {gt}, {tmp}), c.tensor, d);
        }
        return accumulate(tmp, false);
      }
      case C::kAllReduce:  // P -> R; gradient of P is whole
        if (gt_partial) Coll(B, v1::ALL_REDUCE, gt, gt, c.tensor);
        return accumulate(gt, false);
      case C::kReduceScatter: {  // P -> S(d); gradient of P is whole
        int tmp = Scratch(c.tensor, Form::R().raw());
        Sharded(B, v1::ALL_GATHER, c.method, gt, tmp, c.tensor, c.to.dim());
        return accumulate(tmp, false);
      }
      case C::kAllToAll: {  // S(i) -> S(j); back S(j) -> S(i)
        int tmp = Scratch(c.tensor, c.from.raw());
        v1::CollectiveCall* call = Sharded(B, v1::ALL_TO_ALL, c.method, gt, tmp,
                                           c.tensor, c.from.dim());
        call->set_from_dim(c.to.dim());
        for (int64_t l : dims_.Layout(c.tensor, c.to.dim()).lengths) {
          call->add_from_shard_sizes(l);
        }
        return accumulate(tmp, false);
      }
      case C::kSlice: {  // R -> S(d); gradient back to R by all-gather
        // The S(d) gradients gathered make the R gradient whole: a small
        // activation gathered (e.g. the embedding's output) instead of the
        // parameters before it all-reducing partial gradients (the
        // embedding table), as the search prices it.
        int tmp = Scratch(c.tensor, c.from.raw());
        Sharded(B, v1::ALL_GATHER, c.method, gt, tmp, c.tensor, c.to.dim());
        return accumulate(tmp, false);
      }
      case C::kZeroOut: {  // R -> P: only rank 0's copy counted
        HAP_ASSIGN_OR_RETURN(int dst, GradTarget(from, true, B, what));
        if (r_ == 0) Kernel(B, "accumulate", {gt}, {dst});
        return absl::OkStatus();
      }
    }
    return absl::OkStatus();
  }

  std::vector<int> bucket_;  // replicated gradients awaiting their all-reduce
  int partial_loss_ = -1;    // the loss buffer when it holds a partial sum

  // A pair of buffers of a coalesced dim-0 ALL_GATHER or REDUCE_SCATTER.
  struct ShardedItem {
    int in = -1, out = -1;
    TensorId tensor = -1;
    synth::Method method = synth::Method::kNone;
  };
  std::vector<ShardedItem> zero_bucket_;  // gathered-once ZeRO gradients
  std::map<TensorId, ShardedItem> gather_once_;  // shard -> whole

  // The ZeRO parameters the program gathers once per step (ZeRO-2-like): their
  // shards (the stored parameters) and whole copies, gathered by one
  // coalesced ALL_GATHER per dtype before forward; the whole copies stay for
  // backward.
  void GatherOnceParameters() {
    std::vector<ShardedItem> items;
    for (const synth::OpStep& s : p_.steps) {
      for (const synth::SourceLoad& l : s.loads) {
        if (!l.parameter || l.storage != synth::ParamStorage::kZero || !l.gather_once ||
            gather_once_.count(l.tensor)) {
          continue;
        }
        ShardedItem it;
        it.tensor = l.tensor;
        it.method = l.method;
        it.in = NewBuffer(l.tensor, kZeroStorage, v1::Buffer::PARAMETER);
        it.out = NewBuffer(l.tensor, Form::R().raw(), v1::Buffer::ACTIVATION, "#gathered");
        gather_once_[l.tensor] = it;
        items.push_back(it);
      }
    }
    CoalescedDim0(v1::Step::FORWARD, v1::ALL_GATHER, std::move(items),
                  "parameters gathered once");
  }

  // One coalesced `kind` (ALL_GATHER or REDUCE_SCATTER along dim 0) per
  // dtype over `items`, in their order; the method is the largest tensor's.
  void CoalescedDim0(v1::Step::Phase phase, v1::Collective kind,
                     std::vector<ShardedItem> items, const std::string& what,
                     bool gradients = false) {
    while (!items.empty()) {
      const graph::DType dtype = g_.tensor(items.front().tensor).type.dtype;
      std::vector<ShardedItem> take, rest;
      for (const ShardedItem& it : items) {
        (g_.tensor(it.tensor).type.dtype == dtype ? take : rest).push_back(it);
      }
      int64_t bytes = 0, largest = -1;
      synth::Method method = take.front().method;
      for (const ShardedItem& it : take) {
        const int64_t b = g_.tensor(it.tensor).type.bytes();
        bytes += b;
        if (b > largest) {
          largest = b;
          method = it.method;
        }
      }
      for (const ShardedItem& it : take) {
        Await(it.in, phase);
        Await(it.out, phase);
      }
      v1::CollectiveCall* c = Sharded(phase, kind, method, take.front().in,
                                      take.front().out, take.front().tensor, 0);
      if (gradients) GradientWire(c, take.front().in);
      const int step = prog_.steps_size() - 1;
      c->set_tensor(absl::StrCat(what, ": ", take.size(), " tensor(s), ", bytes, " bytes"));
      for (size_t i = 1; i < take.size(); ++i) {
        c->add_coalesced(take[i].in);
        c->add_coalesced_outputs(take[i].out);
        for (int64_t l : dims_.Layout(take[i].tensor, 0).lengths) {
          c->add_coalesced_shard_sizes(l);
        }
        Use(take[i].in, step);
        Use(take[i].out, step);
      }
      items = std::move(rest);
    }
  }

  // A parameter gradient's synchronisation `c` of buffer `buf` in bf16 on
  // the wire (LowerOptions::bf16_gradients; float32 buffers only).
  void GradientWire(v1::CollectiveCall* c, int buf) {
    if (o_.bf16_gradients && prog_.buffers(buf).dtype() == v1::FLOAT32) {
      c->set_wire_dtype(v1::BFLOAT16);
    }
  }

  void SyncParameter(const synth::SourceLoad& l) {
    const auto G = v1::Step::GRADIENT_SYNC;
    Key whole = K(l.tensor, Form::R());
    if (l.storage == synth::ParamStorage::kZero) {
      if (!HasGrad(whole)) return;
      int gt = grad_.at(whole);
      if (gather_once_.count(l.tensor) && a_.partial_grad[l.tensor]) {
        // Deferred into the coalesced reduce-scatter after backward
        // (FlushGradientBuckets), which writes the whole shard gradient.
        Key shard = {l.tensor, kZeroStorage};
        int dst = NewBuffer(l.tensor, kZeroStorage, v1::Buffer::GRADIENT, "#grad");
        grad_[shard] = dst;
        zero_bucket_.push_back({gt, dst, l.tensor, l.method});
        return;
      }
      int dst = Grad({l.tensor, kZeroStorage}, G);
      if (a_.partial_grad[l.tensor]) {
        v1::CollectiveCall* c = Sharded(G, v1::REDUCE_SCATTER, l.method, gt, dst, l.tensor, 0);
        GradientWire(c, gt);
        if (o_.overlap) Started(c);
      } else {
        int tmp = Scratch(l.tensor, kZeroStorage);
        SliceAttrs(Kernel(G, "slice", {gt}, {tmp}), l.tensor, 0);
        Kernel(G, "accumulate", {tmp}, {dst});
      }
    } else if (l.storage == synth::ParamStorage::kReplicated) {
      if (HasGrad(whole) && a_.partial_grad[l.tensor]) {
        // Deferred into a gradient bucket, all-reduced once backward is
        // done (FlushGradientBuckets): one synchronisation, not one per
        // parameter. Nothing reads these gradients before the optimizer.
        int gt = grad_.at(whole);
        std::vector<int>& into =
            o_.overlap ? overlap_buckets_[overlap_bucket_of_.at(l.tensor)].grads : bucket_;
        if (std::find(into.begin(), into.end(), gt) == into.end()) into.push_back(gt);
      }
    }
  }

  // The deferred all-reduces of replicated gradients, in the order their
  // backward produced them, as coalesced ALL_REDUCE calls of one dtype and
  // at most kBucketBytes each (a larger gradient gets a call of its own).
  static constexpr int64_t kBucketBytes = int64_t{64} << 20;
  void FlushGradientBuckets() {
    const auto G = v1::Step::GRADIENT_SYNC;
    CoalescedDim0(G, v1::REDUCE_SCATTER, std::move(zero_bucket_),
                  "gradients of parameters gathered once", /*gradients=*/true);
    zero_bucket_.clear();
    if (partial_loss_ >= 0 && !loss_bucketed_) {
      if (o_.bf16_gradients) {
        // The loss stays fp32: summed in a call of its own.
        AllReduceBucket({partial_loss_}, BufferBytes(prog_.buffers(partial_loss_)),
                        /*gradients=*/false);
        loss_bucketed_ = true;
      } else {
        bucket_.push_back(partial_loss_);
      }
    }
    std::vector<int> pending = std::move(bucket_);
    bucket_.clear();
    while (!pending.empty()) {
      const v1::Buffer& first = prog_.buffers(pending.front());
      std::vector<int> take, rest;
      int64_t bytes = 0;
      for (int id : pending) {
        const v1::Buffer& b = prog_.buffers(id);
        int64_t n = graph::DTypeBytes(graph::FromProtoDType(b.dtype()));
        for (int64_t d : b.shape()) n *= d;
        if (b.dtype() == first.dtype() && (take.empty() || bytes + n <= kBucketBytes)) {
          take.push_back(id);
          bytes += n;
        } else {
          rest.push_back(id);
        }
      }
      AllReduceBucket(take, bytes);
      pending = std::move(rest);
    }
  }

  // A coalesced in-place ALL_REDUCE of the gradients `take` (bytes in all);
  // in bf16 on the wire with LowerOptions::bf16_gradients unless
  // `gradients` is false (the loss alone).
  v1::CollectiveCall* AllReduceBucket(const std::vector<int>& take, int64_t bytes,
                                      bool gradients = true) {
    const auto G = v1::Step::GRADIENT_SYNC;
    for (size_t i = 1; i < take.size(); ++i) Await(take[i], G);
    v1::CollectiveCall* c = Coll(G, v1::ALL_REDUCE, take.front(), take.front(), g_.loss());
    if (gradients) GradientWire(c, take.front());
    const int step = prog_.steps_size() - 1;
    c->set_tensor(
        absl::StrCat("gradient bucket of ", take.size(), " tensor(s), ", bytes, " bytes"));
    for (size_t i = 1; i < take.size(); ++i) {
      c->add_coalesced(take[i]);
      Use(take[i], step);
    }
    return c;
  }

  // --- overlap (LowerOptions::overlap) -------------------------------------
  // A gradient bucket started during backward: the replicated parameters
  // whose partial gradients it sums, in the order backward completes them
  // (as synth::AssignGradientBuckets prices them), and the step whose
  // backward completes the last.
  struct OverlapBucket {
    std::vector<TensorId> tensors;
    std::vector<int> grads;  // gradient buffers, as SyncParameter meets them
    int ready_step = 0;
    graph::DType dtype = graph::DType::kFloat32;
  };

  bool IsZero3(const synth::SourceLoad& l) const {
    return l.parameter && l.storage == synth::ParamStorage::kZero && !l.gather_once;
  }
  bool IsZero3Step(int k) const {
    return std::binary_search(zero3_steps_.begin(), zero3_steps_.end(), k);
  }

  // The buckets and the steps holding ZeRO-3 parameters.
  void PlanOverlap() {
    const int64_t cap = o_.gradient_bucket_bytes > 0 ? o_.gradient_bucket_bytes : kBucketBytes;
    std::set<TensorId> seen;
    OverlapBucket open;
    int64_t bytes = 0;
    auto close = [&]() {
      if (!open.tensors.empty()) overlap_buckets_.push_back(std::move(open));
      open = OverlapBucket();
      bytes = 0;
    };
    for (int k = static_cast<int>(p_.steps.size()) - 1; k >= 0; --k) {
      for (const synth::SourceLoad& l : p_.steps[k].loads) {
        const graph::Tensor& t = g_.tensor(l.tensor);
        if (!l.parameter || t.frozen || l.storage != synth::ParamStorage::kReplicated ||
            !a_.partial_grad[l.tensor] || !seen.insert(l.tensor).second) {
          continue;
        }
        if (!open.tensors.empty() && (bytes + t.type.bytes() > cap || t.type.dtype != open.dtype)) {
          close();
        }
        open.dtype = t.type.dtype;
        open.tensors.push_back(l.tensor);
        open.ready_step = k;
        bytes += t.type.bytes();
        overlap_bucket_of_[l.tensor] = overlap_buckets_.size();
      }
    }
    close();
    for (size_t k = 0; k < p_.steps.size(); ++k) {
      for (const synth::SourceLoad& l : p_.steps[k].loads) {
        if (IsZero3(l)) {
          zero3_steps_.push_back(static_cast<int>(k));
          break;
        }
      }
    }
  }

  // Starts the buckets whose last gradient the backward of step k completed.
  void StartGradientBuckets(int k) {
    for (OverlapBucket& b : overlap_buckets_) {
      if (b.ready_step != k || b.grads.empty()) continue;
      std::vector<int> take = b.grads;
      // The partial loss rides with the first bucket of its dtype.
      // (Not with bf16 gradients: the loss is summed in fp32, alone.)
      // (Nor in a pipeline stage: the pipeline runner writes the loss over
      // the microbatches after the last backward, then sums it in line.)
      if (partial_loss_ >= 0 && !loss_bucketed_ && !o_.bf16_gradients && st_ == nullptr &&
          prog_.buffers(partial_loss_).dtype() == prog_.buffers(take.front()).dtype()) {
        take.push_back(partial_loss_);
        loss_bucketed_ = true;
      }
      int64_t bytes = 0;
      for (int id : take) bytes += BufferBytes(prog_.buffers(id));
      Started(AllReduceBucket(take, bytes));
    }
  }

  // The forward all-gather of a ZeRO-3 parameter into new buffers (its
  // stored shard, its whole copy), started and left running with `async`.
  std::pair<int, int> GatherZero3(const synth::SourceLoad& l, bool async) {
    int shard = NewBuffer(l.tensor, kZeroStorage, v1::Buffer::PARAMETER);
    int whole = NewBuffer(l.tensor, Form::R().raw(), v1::Buffer::ACTIVATION, "#gathered");
    v1::CollectiveCall* c =
        Sharded(v1::Step::FORWARD, v1::ALL_GATHER, l.method, shard, whole, l.tensor, 0);
    if (async) Started(c);
    return {shard, whole};
  }
  // Starts the forward gathers of step k's ZeRO-3 parameters (Forward takes
  // them from prefetched_).
  void PrefetchGathers(int k) {
    for (const synth::SourceLoad& l : p_.steps[k].loads) {
      if (!IsZero3(l) || prefetched_.count(l.tensor) || fwd_.count({l.tensor, kZeroStorage})) {
        continue;
      }
      prefetched_[l.tensor] = GatherZero3(l, /*async=*/true);
    }
  }
  // Starts the backward gathers of step k's ZeRO-3 parameters not gathered
  // again yet (BwdValue then finds them).
  void PrefetchRegathers(int k) {
    for (const synth::SourceLoad& l : p_.steps[k].loads) {
      const Key whole = K(l.tensor, Form::R());
      if (IsZero3(l) && zero_gathered_.count(whole) && !regathered_.count(whole)) {
        Regather(whole, /*async=*/true);
      }
    }
  }

  // Marks the collective just emitted as started: it runs until a step
  // touches one of its buffers, which waits for it first (Await).
  void Started(v1::CollectiveCall* c) {
    c->set_async(true);
    const int step = prog_.steps_size() - 1;
    std::vector<int> ids = {c->input(), c->output()};
    ids.insert(ids.end(), c->coalesced().begin(), c->coalesced().end());
    ids.insert(ids.end(), c->coalesced_outputs().begin(), c->coalesced_outputs().end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (int id : ids) awaited_by_[id] = step;
    async_buffers_[step] = std::move(ids);
  }
  // The wait for the started collective using buffer `id`, if any; its
  // buffers live until here.
  void Await(int id, v1::Step::Phase phase) {
    auto it = awaited_by_.find(id);
    if (id < 0 || it == awaited_by_.end()) return;
    const int start = it->second;
    const int step = prog_.steps_size();
    v1::Step* s = prog_.add_steps();
    s->set_phase(phase);
    s->mutable_wait()->set_start_step(start);
    for (int b : async_buffers_[start]) {
      Use(b, step);
      awaited_by_.erase(b);
    }
    async_buffers_.erase(start);
  }
  // Waits for every collective still running (the loss, unread gathers).
  void AwaitAll() {
    while (!async_buffers_.empty()) {
      Await(async_buffers_.begin()->second.front(), v1::Step::OPTIMIZER);
    }
  }
  static int64_t BufferBytes(const v1::Buffer& b) {
    int64_t n = graph::DTypeBytes(graph::FromProtoDType(b.dtype()));
    for (int64_t d : b.shape()) n *= d;
    return n;
  }

  std::vector<OverlapBucket> overlap_buckets_;
  std::map<TensorId, size_t> overlap_bucket_of_;
  std::vector<int> zero3_steps_;                        // ascending; with overlap only
  std::map<TensorId, std::pair<int, int>> prefetched_;  // -> shard, whole
  std::map<int, int> awaited_by_;                       // buffer -> start step
  std::map<int, std::vector<int>> async_buffers_;       // start step -> buffers
  bool loss_bucketed_ = false;

  // --- optimizer ---------------------------------------------------------
  void Optimizer() {
    const auto O = v1::Step::OPTIMIZER;
    const v1::OptimizerConfig& cfg = o_.optimizer;
    std::vector<const ParamSlot*> live;
    for (const ParamSlot& p : params_) {
      if (HasGrad(p.storage)) live.push_back(&p);
    }
    int norm = -1;
    if (cfg.clip_global_norm() > 0 && !live.empty()) {
      norm = NewNorm();
      Fill(O, norm, 0.0);
      // Every gradient replicated (synchronised): each rank sums them all
      // itself, in the same order, and needs no all-reduce.
      // A pipeline stage's norm is summed over stages afterwards: always
      // all-reduced in the group, each gradient counted once.
      bool all_replicated = st_ == nullptr;
      for (const ParamSlot* p : live) all_replicated = all_replicated && p->replicated;
      for (const ParamSlot* p : live) {
        // Otherwise a replicated parameter counts once: on rank 0.
        if (!all_replicated && p->replicated && r_ != 0) continue;
        Kernel(O, "sq_norm", {grad_.at(p->storage)}, {norm});
      }
      if (!all_replicated) Coll(O, v1::ALL_REDUCE, norm, norm, g_.loss());
    }
    bool adam = cfg.kind() == v1::OptimizerConfig::ADAM;
    for (const ParamSlot* p : live) {
      int param = fwd_.at(p->storage);
      int grad = grad_.at(p->storage);
      std::vector<int> in = {param, grad, norm};
      std::vector<int> out = {param};
      int8_t raw = p->storage.second;
      if (adam) {
        out.push_back(NewBuffer(p->tensor, raw, v1::Buffer::OPTIMIZER_STATE, "#adam_m"));
        out.push_back(NewBuffer(p->tensor, raw, v1::Buffer::OPTIMIZER_STATE, "#adam_v"));
      } else if (cfg.momentum() != 0) {
        out.push_back(NewBuffer(p->tensor, raw, v1::Buffer::OPTIMIZER_STATE, "#momentum"));
      }
      v1::KernelCall* k = Kernel(O, adam ? "adam_update" : "sgd_update", in, out,
                                 g_.tensor(p->tensor).name);
      auto& a = *k->mutable_attrs();
      a["learning_rate"].set_f(cfg.learning_rate());
      a["weight_decay"].set_f(cfg.weight_decay());
      a["clip_global_norm"].set_f(cfg.clip_global_norm());
      if (adam) {
        a["beta1"].set_f(cfg.beta1() != 0 ? cfg.beta1() : 0.9);
        a["beta2"].set_f(cfg.beta2() != 0 ? cfg.beta2() : 0.999);
        a["epsilon"].set_f(cfg.epsilon() != 0 ? cfg.epsilon() : 1e-8);
      } else {
        a["momentum"].set_f(cfg.momentum());
      }
    }
  }
  int NewNorm() {
    v1::Buffer* b = prog_.add_buffers();
    int id = prog_.buffers_size() - 1;
    b->set_id(id);
    b->set_tensor("#global_grad_norm_sq");
    b->add_shape(1);
    b->add_global_shape(1);
    b->add_offsets(0);
    b->set_dtype(v1::FLOAT64);
    b->set_role(v1::Buffer::NORM);
    b->mutable_form()->set_kind(v1::TensorForm::REPLICATED);
    first_.push_back(std::numeric_limits<int>::max());
    last_.push_back(-1);
    return id;
  }

  // Lifetimes and arena offsets.
  void Finish() {
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
      req.push_back({n * graph::DTypeBytes(graph::FromProtoDType(b->dtype())),
                     first, last});
    }
    ArenaLayout layout = PlanArena(req);
    for (int i = 0; i < prog_.buffers_size(); ++i) {
      prog_.mutable_buffers(i)->set_offset_bytes(layout.offsets[i]);
    }
    prog_.set_arena_bytes(layout.total_bytes);
  }

  struct ParamSlot {
    TensorId tensor = -1;
    Key storage;
    bool replicated = false;
  };
  static constexpr int kEnd = std::numeric_limits<int>::max() - 1;

  const graph::Graph& g_;
  const synth::Program& p_;
  const LowerOptions& o_;
  const DimClasses& dims_;
  const Analysis& a_;
  const int r_;
  const StageSpec* st_;  // pipeline stage mode (LowerStage); null otherwise
  v1::RankProgram prog_;
  std::map<Key, int> fwd_, grad_;
  std::map<Key, std::pair<int, synth::Method>> zero_gathered_;  // -> shard
  std::map<Key, int> regathered_;
  std::map<graph::OpId, int> vocab_lse_;  // gathered log-sum-exps per op
  std::map<graph::OpId, int> bn_sums_;    // all-reduced batch_norm sums per op
  std::vector<int> first_, last_;
  std::vector<ParamSlot> params_;
};

void LinkDims(const graph::Graph& g, const synth::Program& p, DimClasses& dims) {
  for (const synth::OpStep& s : p.steps) {
    const graph::Op& op = g.op(s.op);
    int first = -1;
    auto link = [&](TensorId t, Form f) {
      if (!f.is_sharded()) return;
      int n = dims.Node(t, f.dim());
      if (first < 0) {
        first = n;
      } else {
        dims.Union(first, n);
      }
    };
    for (size_t j = 0; j < op.inputs.size(); ++j) link(op.inputs[j], s.rule.inputs[j]);
    for (size_t j = 0; j < op.outputs.size(); ++j) link(op.outputs[j], s.rule.outputs[j]);
    // Grouped MoE routing split by tokens: shards of whole groups.
    const int64_t group = op.attrs.Int("group_size", 0).value_or(0);
    if (group > 0 && (op.type == "moe_route" || op.type == "moe_dispatch_idx" ||
                      op.type == "moe_combine_idx")) {
      const int j = op.type == "moe_combine_idx" ? 1 : 0;  // the tokens' input
      const Form f = s.rule.inputs[j];
      if (f.is_sharded() && f.dim() == 0) {
        const TensorId t = op.inputs[j];
        dims.Granule(dims.Node(t, 0), g.tensor(t).type.shape[0] / group);
      }
    }
    for (const synth::SourceLoad& l : s.loads) {
      if (l.form.is_sharded()) dims.Node(l.tensor, l.form.dim());
      if (l.storage == synth::ParamStorage::kZero) dims.Node(l.tensor, 0);
    }
    for (const synth::CommStep& c : s.comms) {
      if (c.from.is_sharded()) dims.Node(c.tensor, c.from.dim());
      if (c.to.is_sharded()) dims.Node(c.tensor, c.to.dim());
    }
  }
}

}  // namespace

namespace {

// The ratios Lower uses (even when empty); InvalidArgument when they are not
// one per rank, non-negative and summing to 1.
absl::StatusOr<std::vector<double>> CheckedRatios(const LowerOptions& options) {
  const int n = options.world_size;
  if (n < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be at least 1, got ", n));
  }
  std::vector<double> ratios = options.ratios;
  if (ratios.empty()) ratios.assign(n, 1.0 / n);
  if (static_cast<int>(ratios.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "got ", ratios.size(), " sharding ratios for a world of ", n));
  }
  double sum = 0;
  for (double r : ratios) {
    if (!(r >= 0) || !std::isfinite(r)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding ratio ", r, " is not a finite non-negative number"));
    }
    sum += r;
  }
  if (std::abs(sum - 1) > 1e-6) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharding ratios sum to ", sum, ", not 1"));
  }
  return ratios;
}

// Steps k of `program` must be ops first + k.
absl::Status CheckSteps(const graph::Graph& g, const synth::Program& program, int first) {
  for (size_t k = 0; k < program.steps.size(); ++k) {
    const synth::OpStep& s = program.steps[k];
    const graph::Op& op = g.op(first + static_cast<int>(k));
    if (s.op != first + static_cast<int>(k) || s.rule.inputs.size() != op.inputs.size() ||
        s.rule.outputs.size() != op.outputs.size() ||
        s.rule.replicated_grad.size() != op.inputs.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "program step ", k, " does not match op '", op.name, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::RankProgram>> LowerChecked(const graph::Graph& g,
                                                          const synth::Program& program,
                                                          const LowerOptions& options,
                                                          const std::vector<double>& ratios,
                                                          const StageSpec* stage) {
  DimClasses dims(g);
  LinkDims(g, program, dims);
  dims.Solve(ratios);
  Analysis analysis = synth::AnalyzeGradients(g, program);
  std::vector<v1::RankProgram> out;
  for (int r = 0; r < options.world_size; ++r) {
    RankBuilder b(g, program, options, dims, analysis, r, stage);
    HAP_ASSIGN_OR_RETURN(v1::RankProgram p, b.Build());
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<v1::RankProgram>> Lower(const graph::Graph& g,
                                                   const synth::Program& program,
                                                   const LowerOptions& options) {
  HAP_ASSIGN_OR_RETURN(std::vector<double> ratios, CheckedRatios(options));
  if (program.steps.size() != g.ops().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the program has ", program.steps.size(), " steps for a graph of ",
        g.ops().size(), " ops"));
  }
  HAP_RETURN_IF_ERROR(CheckSteps(g, program, 0));
  return LowerChecked(g, program, options, ratios, nullptr);
}

absl::StatusOr<std::vector<v1::RankProgram>> LowerStage(const graph::Graph& g,
                                                        const synth::Program& program,
                                                        const StageSpec& stage,
                                                        const LowerOptions& options) {
  HAP_ASSIGN_OR_RETURN(std::vector<double> ratios, CheckedRatios(options));
  const int nops = static_cast<int>(g.ops().size());
  if (stage.begin_op < 0 || stage.end_op > nops || stage.begin_op >= stage.end_op) {
    return absl::InvalidArgumentError(absl::StrCat("stage ops [", stage.begin_op, ", ",
                                                   stage.end_op, ") are not a range of the ",
                                                   nops, " ops"));
  }
  if (static_cast<int>(program.steps.size()) != stage.end_op - stage.begin_op) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stage program has ", program.steps.size(), " steps for ops [", stage.begin_op,
        ", ", stage.end_op, ")"));
  }
  if (stage.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a stage needs at least 1 microbatch, got ", stage.microbatches));
  }
  HAP_RETURN_IF_ERROR(CheckSteps(g, program, stage.begin_op));
  const int ntensors = static_cast<int>(g.tensors().size());
  auto produced_in = [&](TensorId t, int begin, int end) {
    if (t < 0 || t >= ntensors) return false;
    const graph::Tensor& x = g.tensor(t);
    return x.kind == graph::TensorKind::kActivation && x.producer >= begin && x.producer < end;
  };
  if (stage.input >= 0 && !produced_in(stage.input, 0, stage.begin_op)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stage's input (tensor ", stage.input, ") is not an activation produced before op ",
        stage.begin_op));
  }
  if (stage.output >= 0 && !produced_in(stage.output, stage.begin_op, stage.end_op)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stage's output (tensor ", stage.output, ") is not produced by ops [",
        stage.begin_op, ", ", stage.end_op, ")"));
  }
  if (stage.output < 0 && !produced_in(g.loss(), stage.begin_op, stage.end_op)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a stage without output must compute the loss, which ops [", stage.begin_op, ", ",
        stage.end_op, ") do not"));
  }
  // SFB computes a weight's gradient from the step's gathered inputs and
  // output gradients after backward, which microbatches cannot share: such
  // weights get their partial gradients all-reduced instead (summed over
  // the microbatches first).
  synth::Program p = program;
  for (synth::OpStep& s : p.steps) {
    for (synth::SourceLoad& l : s.loads) l.sfb = false;
  }
  return LowerChecked(g, p, options, ratios, &stage);
}

synth::Program SingleDeviceProgram(const graph::Graph& g) {
  synth::Program p;
  synth::RuleContext ctx;
  ctx.num_devices = 1;
  std::set<TensorId> loaded;
  for (size_t k = 0; k < g.ops().size(); ++k) {
    synth::OpStep s;
    s.op = static_cast<int>(k);
    s.rule = synth::RulesFor(g, s.op, ctx).front();  // replicated
    for (TensorId t : g.op(s.op).inputs) {
      const graph::Tensor& tensor = g.tensor(t);
      if (tensor.kind == graph::TensorKind::kActivation || !loaded.insert(t).second) {
        continue;
      }
      synth::SourceLoad l;
      l.tensor = t;
      l.form = Form::R();
      l.parameter = tensor.kind == graph::TensorKind::kParameter;
      l.storage = synth::ParamStorage::kReplicated;
      l.storage_form = Form::R();
      s.loads.push_back(l);
    }
    p.steps.push_back(std::move(s));
  }
  return p;
}

}  // namespace hap::lower
