// Gradient synchronisation: buckets of replicated gradients, ZeRO's gathers and reduce-scatters,
// and with LowerOptions::overlap their asynchronous starts and waits.
// Part of lower::internal::RankBuilder (rank_builder.h).

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {

// The ZeRO parameters the program gathers once per step (ZeRO-2-like): their
// shards (the stored parameters) and whole copies, gathered by one
// coalesced ALL_GATHER per dtype before forward; the whole copies stay for
// backward.
void RankBuilder::GatherOnceParameters() {
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
  CoalescedDim0(v1::Step::FORWARD, v1::ALL_GATHER, std::move(items), "parameters gathered once");
}

// One coalesced `kind` (ALL_GATHER or REDUCE_SCATTER along dim 0) per
// dtype over `items`, in their order; the method is the largest tensor's.
void RankBuilder::CoalescedDim0(v1::Step::Phase phase, v1::Collective kind,
                                std::vector<ShardedItem> items, const std::string& what,
                                bool gradients) {
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
    v1::CollectiveCall* c =
        Sharded(phase, kind, method, take.front().in, take.front().out, take.front().tensor, 0);
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
void RankBuilder::GradientWire(v1::CollectiveCall* c, int buf) {
  if (o_.bf16_gradients && prog_.buffers(buf).dtype() == v1::FLOAT32) {
    c->set_wire_dtype(v1::BFLOAT16);
  }
}

void RankBuilder::SyncParameter(const synth::SourceLoad& l) {
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

void RankBuilder::FlushGradientBuckets() {
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
v1::CollectiveCall* RankBuilder::AllReduceBucket(const std::vector<int>& take, int64_t bytes,
                                                 bool gradients) {
  const auto G = v1::Step::GRADIENT_SYNC;
  for (size_t i = 1; i < take.size(); ++i) Await(take[i], G);
  v1::CollectiveCall* c = Coll(G, v1::ALL_REDUCE, take.front(), take.front(), g_.loss());
  if (gradients) GradientWire(c, take.front());
  const int step = prog_.steps_size() - 1;
  c->set_tensor(absl::StrCat("gradient bucket of ", take.size(), " tensor(s), ", bytes, " bytes"));
  for (size_t i = 1; i < take.size(); ++i) {
    c->add_coalesced(take[i]);
    Use(take[i], step);
  }
  return c;
}

bool RankBuilder::IsZero3(const synth::SourceLoad& l) const {
  return l.parameter && l.storage == synth::ParamStorage::kZero && !l.gather_once;
}

bool RankBuilder::IsZero3Step(int k) const {
  return std::binary_search(zero3_steps_.begin(), zero3_steps_.end(), k);
}

// The buckets and the steps holding ZeRO-3 parameters.
void RankBuilder::PlanOverlap() {
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
void RankBuilder::StartGradientBuckets(int k) {
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
std::pair<int, int> RankBuilder::GatherZero3(const synth::SourceLoad& l, bool async) {
  int shard = NewBuffer(l.tensor, kZeroStorage, v1::Buffer::PARAMETER);
  int whole = NewBuffer(l.tensor, Form::R().raw(), v1::Buffer::ACTIVATION, "#gathered");
  v1::CollectiveCall* c =
      Sharded(v1::Step::FORWARD, v1::ALL_GATHER, l.method, shard, whole, l.tensor, 0);
  if (async) Started(c);
  return {shard, whole};
}

// Starts the forward gathers of step k's ZeRO-3 parameters (Forward takes
// them from prefetched_).
void RankBuilder::PrefetchGathers(int k) {
  for (const synth::SourceLoad& l : p_.steps[k].loads) {
    if (!IsZero3(l) || prefetched_.count(l.tensor) || fwd_.count({l.tensor, kZeroStorage})) {
      continue;
    }
    prefetched_[l.tensor] = GatherZero3(l, /*async=*/true);
  }
}

// Starts the backward gathers of step k's ZeRO-3 parameters not gathered
// again yet (BwdValue then finds them).
void RankBuilder::PrefetchRegathers(int k) {
  for (const synth::SourceLoad& l : p_.steps[k].loads) {
    const Key whole = K(l.tensor, Form::R());
    if (IsZero3(l) && zero_gathered_.count(whole) && !regathered_.count(whole)) {
      Regather(whole, /*async=*/true);
    }
  }
}

// Marks the collective just emitted as started: it runs until a step
// touches one of its buffers, which waits for it first (Await).
void RankBuilder::Started(v1::CollectiveCall* c) {
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
void RankBuilder::Await(int id, v1::Step::Phase phase) {
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
void RankBuilder::AwaitAll() {
  while (!async_buffers_.empty()) {
    Await(async_buffers_.begin()->second.front(), v1::Step::OPTIMIZER);
  }
}

int64_t RankBuilder::BufferBytes(const v1::Buffer& b) {
  int64_t n = graph::DTypeBytes(graph::FromProtoDType(b.dtype()));
  for (int64_t d : b.shape()) n *= d;
  return n;
}

}  // namespace hap::lower::internal
