#include "planner/pipeline/layers.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"

namespace hap::pipeline {

int64_t GraphBatch(const graph::Graph& g) {
  const std::vector<graph::TensorId> in = g.Inputs();
  if (in.empty() || g.tensor(in.front()).type.rank() < 1) return 0;
  return g.tensor(in.front()).type.shape[0];
}

std::vector<int> ValidCuts(const graph::Graph& g) {
  const int n = static_cast<int>(g.ops().size());
  // crossing[k]: activations crossing the cut before op k; blocked[k]: a
  // parameter read on both sides. Difference arrays over (first, last].
  std::vector<int> crossing(n + 1, 0), blocked(n + 1, 0);
  for (const graph::Tensor& t : g.tensors()) {
    if (t.consumers.empty()) continue;
    int last = 0, first = n;
    for (graph::OpId c : t.consumers) {
      last = std::max(last, c);
      first = std::min(first, c);
    }
    if (t.kind == graph::TensorKind::kActivation && t.producer >= 0 && last > t.producer) {
      ++crossing[t.producer + 1];
      --crossing[last + 1];
    } else if (t.kind == graph::TensorKind::kParameter && last > first) {
      ++blocked[first + 1];
      --blocked[last + 1];
    }
  }
  std::vector<int> cuts;
  int c = 0, b = 0;
  for (int k = 1; k < n; ++k) {
    c += crossing[k];
    b += blocked[k];
    // crossing/blocked were accumulated from index 1: prefix sums up to k.
    if (c == 1 && b == 0) cuts.push_back(k);
  }
  return cuts;
}

Layers FindLayers(const graph::Graph& g, int max_layers) {
  const int n = static_cast<int>(g.ops().size());
  std::vector<int> cuts = ValidCuts(g);
  std::vector<double> prefix(n + 1, 0);  // forward FLOPs before op k
  for (int k = 0; k < n; ++k) prefix[k + 1] = prefix[k] + g.OpForwardFlops(k);
  std::vector<int> chosen;
  if (static_cast<int>(cuts.size()) <= max_layers - 1) {
    chosen = cuts;
  } else {
    // More cuts than wanted (cuts.size() > max_layers - 1): cut i is the
    // nearest to its equal-FLOP target among cuts [at, last), leaving one
    // cut for each target after it, so every target gets its own.
    size_t at = 0;
    for (int i = 1; i < max_layers; ++i) {
      const double target = prefix[n] * i / max_layers;
      const size_t last = cuts.size() - static_cast<size_t>(max_layers - 1 - i);
      size_t best = at;
      for (size_t j = at; j < last; ++j) {
        if (std::abs(prefix[cuts[j]] - target) < std::abs(prefix[cuts[best]] - target)) best = j;
        if (prefix[cuts[j]] > target) break;
      }
      chosen.push_back(cuts[best]);
      at = best + 1;
    }
  }
  Layers l;
  l.begin.push_back(0);
  for (int k : chosen) {
    // The one activation crossing before op k.
    for (graph::TensorId t = 0; t < static_cast<int>(g.tensors().size()); ++t) {
      const graph::Tensor& x = g.tensor(t);
      if (x.kind != graph::TensorKind::kActivation || x.producer < 0 || x.producer >= k) continue;
      bool later = false;
      for (graph::OpId c : x.consumers) later = later || c >= k;
      if (later) {
        l.boundary.push_back(t);
        break;
      }
    }
    l.begin.push_back(k);
  }
  l.begin.push_back(n);
  return l;
}

absl::StatusOr<graph::Graph> Rebatch(const graph::Graph& g, int64_t batch) {
  const int64_t old = GraphBatch(g);
  if (old <= 0) return absl::InvalidArgumentError("the graph has no batched input to rebatch");
  if (batch == old) return g;
  if (batch < 1 || old % batch != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch ", batch, " does not divide the batch ", old));
  }
  // A shape attribute whose first entry is a multiple of the batch carries
  // it (reshape to [batch * seq, ...], expand of a parameter to [batch,
  // ...]), except on a reshape of a tensor not computed from an input (every
  // input is split): a parameter's reshape keeps its shape.
  std::vector<bool> batched(g.tensors().size(), false);
  absl::flat_hash_set<std::string> kept;  // ops whose shape stays
  // Mixture-of-experts routing fills each expert's slots with the tokens
  // of a group: all the batch's (group_size 0; moe_gate, the dense form,
  // always), which a microbatch cannot reproduce (its tokens would compete
  // for other slots), or runs of group_size tokens, which stay inside a
  // microbatch if they divide its tokens. The op's capacity is its slots
  // per group times the groups, so it scales with the batch (kept, each
  // group had the slots of the whole batch's and dropped fewer tokens).
  absl::flat_hash_map<std::string, int64_t> capacity;  // op -> at `batch`
  const int64_t common = std::gcd(batch, old);
  for (graph::TensorId t : g.Inputs()) batched[t] = true;
  for (const graph::Op& op : g.ops()) {
    bool reads_batch = false;
    for (graph::TensorId t : op.inputs) reads_batch = reads_batch || batched[t];
    // batch_norm takes its statistics over the whole batch (and moves its
    // running statistics once a step); a microbatch would take its own.
    if (reads_batch && op.type == "batch_norm") {
      return absl::InvalidArgumentError(absl::StrCat(
          "op '", op.name, "' (batch_norm) normalises with the statistics of the whole batch: ",
          "microbatches of ", batch, " would each take their own"));
    }
    if (reads_batch && op.attrs.Has("capacity") &&
        (op.type == "moe_gate" || op.type == "moe_route" || op.type == "moe_dispatch_idx")) {
      auto cap = op.attrs.Int("capacity");
      auto group = op.attrs.Int("group_size", 0);
      if (!cap.ok() || !group.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("op '", op.name, "' (", op.type,
                                                       ") has a malformed capacity or group_size"));
      }
      if (*group == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "op '", op.name, "' (", op.type,
            ") routes all the batch's tokens as one group: ", "microbatches of ", batch,
            " would each route their own (give it a group_size, "
            "moe_group_size, that divides a microbatch's tokens)"));
      }
      if (*cap % (old / common) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("op '", op.name, "' (", op.type, "): its capacity ", *cap,
                         " does not split into microbatches of ", batch, " of the batch ", old));
      }
      capacity[op.name] = *cap / (old / common) * (batch / common);
    }
    bool carries = false;
    if (op.attrs.Has("shape")) {
      auto shape = op.attrs.Ints("shape");
      carries = shape.ok() && !shape->empty() && (*shape)[0] > 0 && (*shape)[0] % old == 0 &&
                (reads_batch || op.type != "reshape");
      if (!carries) kept.insert(op.name);
    }
    for (graph::TensorId t : op.outputs) batched[t] = reads_batch || carries;
  }
  hap::v1::Graph p = graph::ToProto(g);
  p.clear_value_info();
  for (hap::v1::Input& in : *p.mutable_inputs()) {
    auto* shape = in.mutable_tensor()->mutable_shape();
    if (shape->empty()) continue;
    if (shape->Get(0) % old != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", in.tensor().name(), "' has dimension 0 of ", shape->Get(0),
          ", not a multiple of the batch ", old, ": cannot split it into microbatches"));
    }
    shape->Set(0, shape->Get(0) / old * batch);
  }
  for (hap::v1::Op& op : *p.mutable_ops()) {
    if (auto c = capacity.find(op.name()); c != capacity.end()) {
      (*op.mutable_attrs())["capacity"].set_i(c->second);
    }
    if (kept.contains(op.name())) continue;
    auto it = op.mutable_attrs()->find("shape");
    if (it == op.mutable_attrs()->end() || !it->second.has_ints()) continue;
    auto* v = it->second.mutable_ints()->mutable_values();
    if (!v->empty() && v->Get(0) > 0 && v->Get(0) % old == 0) {
      v->Set(0, v->Get(0) / old * batch);
    }
  }
  auto r = graph::FromProto(p);
  if (!r.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the graph does not take microbatches of ",
                                                   batch, ": ", r.status().message()));
  }
  if (r->ops().size() != g.ops().size()) {
    return absl::InternalError("rebatching changed the number of ops");
  }
  for (size_t k = 0; k < g.ops().size(); ++k) {
    if (r->op(k).name != g.op(k).name) {
      return absl::InternalError(absl::StrCat("rebatching reordered op '", g.op(k).name, "'"));
    }
  }
  return r;
}

}  // namespace hap::pipeline
