// The model IR: the forward graph of one training step on a single device
// (docs/design.md §3). A Graph is immutable once built; GraphBuilder (below) and
// FromProto (graph_proto.h) are the only ways to make one, and both validate
// fully: every op is registered, every input exists, shapes are inferred and
// consistent, the graph is acyclic and the loss is a float scalar.
//
// Thread-safety: a built Graph is immutable and safe to share across threads.
#ifndef HAP_PLANNER_GRAPH_GRAPH_H_
#define HAP_PLANNER_GRAPH_GRAPH_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/graph/types.h"

namespace hap::graph {

enum class TensorKind { kInput, kParameter, kActivation };

enum class InputRole { kFeatures, kLabels };

// Element-wise initialisation of a parameter (defined on the single-device
// tensor, so a shard can be initialised alone).
struct Initializer {
  enum class Kind { kZeros, kOnes, kConstant, kNormal, kUniform, kValues };
  Kind kind = Kind::kZeros;
  double value = 0;   // kConstant
  double mean = 0;    // kNormal
  double stddev = 0;  // kNormal
  double low = 0;     // kUniform
  double high = 0;    // kUniform
  // kValues: the elements in row-major order as runs, values[i] repeated
  // counts[i] times (ValuesInitError checks them against the tensor).
  std::vector<double> values;
  std::vector<int64_t> counts;

  static Initializer Zeros() { return {}; }
  static Initializer Ones() {
    Initializer i;
    i.kind = Kind::kOnes;
    return i;
  }
  static Initializer Normal(double mean, double stddev) {
    Initializer i;
    i.kind = Kind::kNormal;
    i.mean = mean;
    i.stddev = stddev;
    return i;
  }
  static Initializer Uniform(double low, double high) {
    Initializer i;
    i.kind = Kind::kUniform;
    i.low = low;
    i.high = high;
    return i;
  }
  static Initializer Values(std::vector<double> values, std::vector<int64_t> counts) {
    Initializer i;
    i.kind = Kind::kValues;
    i.values = std::move(values);
    i.counts = std::move(counts);
    return i;
  }
};

// Why the kValues initializer `init` does not describe a tensor of
// `num_elements` elements (counts and values of unequal length, a count
// below 1, counts that do not add up, a non-finite value), or "" when it
// does.
std::string ValuesInitError(const Initializer& init, int64_t num_elements);

using TensorId = int;
using OpId = int;

struct Tensor {
  std::string name;
  TensorType type;
  TensorKind kind = TensorKind::kActivation;
  OpId producer = -1;           // kActivation only
  int producer_output = 0;      // which output of the producer
  std::vector<OpId> consumers;  // ops reading it, in topological order
  // kParameter only.
  Initializer init;
  bool frozen = false;
  // kInput only.
  InputRole role = InputRole::kFeatures;
};

struct Op {
  std::string name;
  std::string type;
  std::vector<TensorId> inputs;
  std::vector<TensorId> outputs;
  Attrs attrs;
  std::string scope;
};

class Graph {
 public:
  const std::string& name() const { return name_; }
  // Tensors in the order they were added: GraphBuilder interleaves inputs,
  // parameters and op outputs as the model code declares them; FromProto
  // adds inputs and parameters first, then op outputs in topological order.
  // Ids are therefore not preserved by ToProto -> FromProto (names are).
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const Tensor& tensor(TensorId id) const { return tensors_[id]; }
  // Ops in a topological order (deterministic: stable w.r.t. declaration).
  const std::vector<Op>& ops() const { return ops_; }
  const Op& op(OpId id) const { return ops_[id]; }
  TensorId loss() const { return loss_; }
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

  std::optional<TensorId> FindTensor(const std::string& name) const;
  std::vector<TensorId> Inputs() const;
  std::vector<TensorId> Parameters() const;

  // Number of elements of all non-frozen parameters.
  int64_t TrainableParameterCount() const;
  int64_t ParameterCount() const;  // including frozen
  // Forward FLOPs of one step (sum over ops), and the usual training total
  // (forward + backward, backward as each op's declared multiple).
  double ForwardFlops() const;
  double TrainingFlops() const;
  double OpForwardFlops(OpId id) const;

 private:
  friend class GraphBuilder;
  std::string name_;
  std::vector<Tensor> tensors_;
  std::vector<Op> ops_;
  TensorId loss_ = -1;
  std::map<std::string, std::string> metadata_;
  absl::flat_hash_map<std::string, TensorId> by_name_;
};

// Builds a Graph op by op, inferring shapes as it goes. The first error is
// remembered (with the op's name) and returned by Build(); later calls after
// an error are no-ops returning -1 ids, so model code can build without
// checking each call.
//
// Not thread-safe.
class GraphBuilder {
 public:
  explicit GraphBuilder(std::string name);

  TensorId Input(const std::string& name, TensorType type,
                 InputRole role = InputRole::kFeatures);
  TensorId Parameter(const std::string& name, TensorType type,
                     Initializer init, bool frozen = false);

  // Adds an op of a registered type. Output names default to the op name
  // (one output) or "name:i"; pass `output_names` to choose them. Returns the
  // output tensor ids (empty after an error).
  std::vector<TensorId> AddOp(const std::string& type, const std::string& name,
                              const std::vector<TensorId>& inputs,
                              Attrs attrs = {},
                              std::vector<std::string> output_names = {});
  // AddOp for single-output ops; -1 after an error.
  TensorId Add(const std::string& type, const std::string& name,
               const std::vector<TensorId>& inputs, Attrs attrs = {});

  // Prefix for op names and the scope recorded on each op ("block3/").
  void PushScope(const std::string& scope);
  void PopScope();
  std::string Scoped(const std::string& name) const;

  void SetLoss(TensorId loss);
  void SetMetadata(const std::string& key, const std::string& value);
  // Checks a declared output type (from an imported file) against inference.
  void ExpectType(const std::string& tensor, const TensorType& declared);

  const TensorType* TypeOf(TensorId id) const;
  const absl::Status& status() const { return status_; }

  // Validates the whole graph and returns it. The builder is left empty.
  absl::StatusOr<Graph> Build();

 private:
  TensorId AddTensor(Tensor t);
  void Fail(absl::Status s);

  Graph g_;
  absl::Status status_;
  absl::flat_hash_set<std::string> op_names_;
  std::vector<std::string> scopes_;
};

}  // namespace hap::graph

#endif  // HAP_PLANNER_GRAPH_GRAPH_H_
