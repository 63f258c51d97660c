// The builder of one rank's program (Lower and LowerStage run one per rank).
// Internal to planner/lower. Its definitions are split along its seams:
//   rank_builder.cc          Build, buffers and steps, the arena layout
//   lower_forward.cc         forward ops, the loss, a stage's output
//   lower_backward.cc        backward ops and forward collectives' transposes
//   lower_gradient_sync.cc   gradient buckets, ZeRO, overlap's starts and waits
//   lower_optimizer.cc       the optimizer steps
// and op-specific lowering is in the op families' hooks (op_lowering.h,
// lower_ops_*.cc), which build through the public part below.
#ifndef HAP_PLANNER_LOWER_RANK_BUILDER_H_
#define HAP_PLANNER_LOWER_RANK_BUILDER_H_

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hap/v1/plan.pb.h"
#include "planner/graph/graph.h"
#include "planner/lower/dim_classes.h"
#include "planner/lower/lower.h"
#include "planner/synth/gradients.h"
#include "planner/synth/program.h"
#include "planner/synth/rules.h"

namespace hap::lower::internal {

namespace v1 = ::hap::v1;
using graph::TensorId;
using synth::Form;

// A buffer key: a tensor in a form. ZeRO storage (the S(0) shard a ZeRO
// parameter is kept in) has its own pseudo-form.
using Key = std::pair<TensorId, int8_t>;
constexpr int8_t kZeroStorage = -10;

inline Key K(TensorId t, Form f) { return {t, f.raw()}; }

// What lowering knows of the program independently of the rank.
using Analysis = synth::GradientAnalysis;
using synth::Differentiable;
using synth::PartialContribution;

// R operands a rule adds once into a P result: read on rank 0 only.
bool AddedOnce(const synth::ShardRule& r, int j);
v1::TensorForm FormProto(int8_t raw);
v1::CollectiveMethod MethodProto(synth::Method m);

// Builds one rank's program.
class RankBuilder {
 public:
  RankBuilder(const graph::Graph& g, const synth::Program& p, const LowerOptions& o,
              const DimClasses& dims, const Analysis& a, int rank, const StageSpec* stage = nullptr)
      : g_(g), p_(p), o_(o), dims_(dims), a_(a), r_(rank), st_(stage) {}

  absl::StatusOr<v1::RankProgram> Build();

  // --- for the per-op hooks (op_lowering.h) ---------------------------------
  const graph::Graph& graph() const { return g_; }
  const LowerOptions& options() const { return o_; }
  int rank() const { return r_; }
  // Where this rank's piece of `t` starts along `dim` when `dim` is split.
  int64_t RankOffset(TensorId t, int dim) const { return dims_.Layout(t, dim).offsets[r_]; }
  std::vector<int64_t> Offsets(TensorId t, int8_t raw) const;
  int RowBuffer(const std::string& name, int64_t n, TensorId like);
  int AddBuffer(const std::string& name, const std::vector<int64_t>& shape, graph::DType dtype,
                v1::Buffer::Role role, int8_t raw, const std::vector<int64_t>& global_shape,
                const std::vector<int64_t>& offsets);
  // The ZeRO shard a parameter is stored in on this rank, -1 if none.
  int ZeroStorage(TensorId t) const;
  v1::KernelCall* Kernel(v1::Step::Phase phase, const std::string& name, const std::vector<int>& in,
                         const std::vector<int>& out, const std::string& op = "");
  v1::CollectiveCall* Coll(v1::Step::Phase phase, v1::Collective kind, int in, int out, TensorId t);
  void SliceAttrs(v1::KernelCall* k, TensorId t, int dim);
  // The op's attributes and its hooks' (OpLowering::attrs) on `call`.
  void OpAttrs(const synth::OpStep& s, const graph::Op& op, v1::KernelCall* call);
  // A buffer an op's forward leaves for its backward (one per op).
  void SaveForBackward(graph::OpId op, int buffer) { saved_for_backward_[op] = buffer; }
  // Internal error naming the op and `what` when its forward saved none.
  absl::StatusOr<int> SavedForBackward(graph::OpId op, const std::string& what) const;

 private:
  // --- buffers -----------------------------------------------------------
  graph::Shape LocalShape(TensorId t, int8_t raw) const;
  int NewBuffer(TensorId t, int8_t raw, v1::Buffer::Role role, const std::string& suffix = "");
  int Scratch(TensorId t, int8_t raw);

  absl::StatusOr<int> Fwd(Key k, const graph::Op& op) const;

  int BwdValue(Key k);
  int Regather(Key k, bool async);

  int8_t GradForm(Key k) const;
  bool HasGrad(Key k) const { return grad_.count(k) > 0; }
  int Grad(Key k, v1::Step::Phase phase);
  absl::StatusOr<int> GradTarget(Key k, bool partial, v1::Step::Phase phase,
                                 const std::string& what);

  // --- steps -------------------------------------------------------------
  void Use(int id, int step);
  void Fill(v1::Step::Phase phase, int id, double value);
  v1::CollectiveCall* Sharded(v1::Step::Phase phase, v1::Collective kind, synth::Method m, int in,
                              int out, TensorId t, int dim);

  // --- forward -----------------------------------------------------------
  absl::Status Forward(int k);  // of p_.steps[k]

  void EmitForwardComm(const synth::CommStep& c, int in, int out);

  absl::Status Loss();

  absl::Status StageOutput();

  void StageLoad(Key k);

  // --- backward ----------------------------------------------------------
  absl::Status Backward(int k);

  absl::Status OpBackward(int k, const synth::OpStep& s, const graph::Op& op);

  absl::Status SfbBackward(int k, const synth::OpStep& s, const graph::Op& op,
                           const std::vector<int>& in);

  absl::Status CommBackward(const synth::CommStep& c);

  std::vector<int> bucket_;  // replicated gradients awaiting their all-reduce
  int partial_loss_ = -1;    // the loss buffer when it holds a partial sum

  // A pair of buffers of a coalesced dim-0 ALL_GATHER or REDUCE_SCATTER.
  struct ShardedItem {
    int in = -1, out = -1;
    TensorId tensor = -1;
    synth::Method method = synth::Method::kNone;
  };
  std::vector<ShardedItem> zero_bucket_;         // gathered-once ZeRO gradients
  std::map<TensorId, ShardedItem> gather_once_;  // shard -> whole

  void GatherOnceParameters();

  void CoalescedDim0(v1::Step::Phase phase, v1::Collective kind, std::vector<ShardedItem> items,
                     const std::string& what, bool gradients = false);

  void GradientWire(v1::CollectiveCall* c, int buf);

  void SyncParameter(const synth::SourceLoad& l);

  // The deferred all-reduces of replicated gradients, in the order their
  // backward produced them, as coalesced ALL_REDUCE calls of one dtype and
  // at most kBucketBytes each (a larger gradient gets a call of its own).
  static constexpr int64_t kBucketBytes = int64_t{64} << 20;
  void FlushGradientBuckets();

  v1::CollectiveCall* AllReduceBucket(const std::vector<int>& take, int64_t bytes,
                                      bool gradients = true);

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

  bool IsZero3(const synth::SourceLoad& l) const;
  bool IsZero3Step(int k) const;

  void PlanOverlap();

  void StartGradientBuckets(int k);

  std::pair<int, int> GatherZero3(const synth::SourceLoad& l, bool async);
  void PrefetchGathers(int k);
  void PrefetchRegathers(int k);

  void Started(v1::CollectiveCall* c);
  void Await(int id, v1::Step::Phase phase);
  void AwaitAll();
  static int64_t BufferBytes(const v1::Buffer& b);

  std::vector<OverlapBucket> overlap_buckets_;
  std::map<TensorId, size_t> overlap_bucket_of_;
  std::vector<int> zero3_steps_;                        // ascending; with overlap only
  std::map<TensorId, std::pair<int, int>> prefetched_;  // -> shard, whole
  std::map<int, int> awaited_by_;                       // buffer -> start step
  std::map<int, std::vector<int>> async_buffers_;       // start step -> buffers
  bool loss_bucketed_ = false;

  // --- optimizer ---------------------------------------------------------
  void Optimizer();
  int NewNorm();

  absl::Status Finish();

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
  std::map<graph::OpId, int> saved_for_backward_;  // SaveForBackward
  std::vector<int> first_, last_;
  std::vector<ParamSlot> params_;
};

}  // namespace hap::lower::internal

#endif  // HAP_PLANNER_LOWER_RANK_BUILDER_H_
