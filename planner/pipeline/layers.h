// The layer sequence a pipeline is cut along, and the graph at a microbatch.
//
// A cut before op k (graph topological order) is valid when exactly one
// activation crosses it (produced before k, read at or after k: a residual
// stream, a layer's output) and no parameter is read on both sides (a
// shared parameter would need its gradient summed across stages). Inputs
// cross freely: each stage loads what it reads. Layers are the op ranges
// between chosen cuts; when there are more valid cuts than max_layers - 1,
// those nearest to equal shares of the forward FLOPs are chosen.
//
// Thread-safety: pure functions.
#ifndef HAP_PLANNER_PIPELINE_LAYERS_H_
#define HAP_PLANNER_PIPELINE_LAYERS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/graph/graph.h"

namespace hap::pipeline {

struct Layers {
  // Layer l is ops [begin[l], begin[l + 1]); begin.back() = number of ops.
  std::vector<int> begin;
  // The activation crossing the cut after layer l (l < size() - 1).
  std::vector<graph::TensorId> boundary;
  int size() const { return static_cast<int>(begin.size()) - 1; }
};

// Every valid cut position k (1 <= k < ops), in order.
std::vector<int> ValidCuts(const graph::Graph& g);
// max_layers >= 1: min(max_layers, valid cuts + 1) layers (a graph with no
// valid cut is one layer).
Layers FindLayers(const graph::Graph& g, int max_layers);

// The graph with every input's dimension 0 (the first input's is the batch;
// others are multiples of it, e.g. labels per token) scaled to `batch`, and
// `shape` attributes whose first entry is a multiple of the old batch
// (reshape to [batch * seq, ...], expand to [batch, ...]) scaled with it,
// but for a reshape of a tensor not computed from an input (a parameter's
// reshape keeps its shape). Grouped mixture-of-experts routing
// (moe_route, moe_dispatch_idx with group_size > 0) keeps its slots per
// group: its capacity scales with the batch. Op order and ids are kept.
// InvalidArgument when `batch` does not divide the old batch, or the graph does not take the new
// batch (shapes that fix it elsewhere, batch_norm's statistics, routing
// over all the batch's tokens as one group), naming what failed.
absl::StatusOr<graph::Graph> Rebatch(const graph::Graph& g, int64_t batch);

// The first input's dimension 0; 0 for a graph without inputs.
int64_t GraphBatch(const graph::Graph& g);

}  // namespace hap::pipeline

#endif  // HAP_PLANNER_PIPELINE_LAYERS_H_
