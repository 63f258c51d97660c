// Training batches: the global batch of a step, one host tensor per graph
// input with the single-device shape (each rank slices its own part).
//
//   SyntheticBatches  deterministic values from (seed, step, input name):
//                     floats N(0, 1); integer ids and labels uniform over
//                     the range their consumer accepts (the embedding's
//                     vocabulary, the loss's classes).
//   LmBatches         next-word prediction on a token stream (WikiText-2):
//                     for a model with inputs tokens[B, S] and labels[B*S],
//                     row i of step s reads S tokens from position
//                     (i * stride + s * S) mod usable, labels shifted by one.
#ifndef HAP_EXECUTOR_DATA_BATCHES_H_
#define HAP_EXECUTOR_DATA_BATCHES_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/runtime/tensor.h"
#include "planner/graph/graph.h"

namespace hap::data {

using executor::HostTensor;
using GlobalBatch = std::map<std::string, HostTensor>;

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual absl::StatusOr<GlobalBatch> Get(int64_t step) = 0;
};

std::unique_ptr<BatchSource> NewSyntheticBatches(const graph::Graph& g, uint64_t seed);

// InvalidArgument when the model lacks int inputs "tokens" [B, S] and
// "labels" [B*S], or the corpus is shorter than S + 2 tokens or holds ids
// outside the model's vocabulary.
absl::StatusOr<std::unique_ptr<BatchSource>> NewLmBatches(
    const graph::Graph& g, std::vector<int64_t> corpus);

}  // namespace hap::data

#endif  // HAP_EXECUTOR_DATA_BATCHES_H_
