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
//                     (i * stride + s * S) mod N, stride = N / B, labels
//                     shifted by one; the corpus of N tokens is read as a
//                     loop (its last token is followed by its first), so
//                     every token is an input and a label equally often.
#ifndef HAP_EXECUTOR_DATA_BATCHES_H_
#define HAP_EXECUTOR_DATA_BATCHES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
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
  // How much data the batches are drawn from: samples (user data), tokens
  // (a corpus); 0 where any amount gives the same batches (synthetic).
  // Checkpoints record it: a run resumed over data of another size reads
  // other samples at the same step.
  virtual int64_t data_size() const { return 0; }
};

// The range [0, limit) an integer graph input's values must lie in, as its
// consumers say: ids of an embedding index its table's rows (the
// vocabulary), targets of nll_loss / cross_entropy its classes. The tightest
// over all such consumers; nullopt when no consumer constrains `t`.
// `source` names the consumer for messages ("the vocabulary of 18328 of
// embedding 'embed/tokens'").
struct IdLimit {
  int64_t limit = 0;
  std::string source;
};
std::optional<IdLimit> IntegerInputLimit(const graph::Graph& g, graph::TensorId t);

std::unique_ptr<BatchSource> NewSyntheticBatches(const graph::Graph& g, uint64_t seed);

// InvalidArgument when the model lacks int inputs "tokens" [B, S] and
// "labels" [B*S], or the corpus is shorter than S + 1 tokens or holds ids
// outside the model's vocabulary. Its Get is InvalidArgument for a negative
// step and OutOfRange when step * S overflows.
absl::StatusOr<std::unique_ptr<BatchSource>> NewLmBatches(
    const graph::Graph& g, std::vector<int64_t> corpus);

}  // namespace hap::data

#endif  // HAP_EXECUTOR_DATA_BATCHES_H_
