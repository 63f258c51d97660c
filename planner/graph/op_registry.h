// The op registry: one entry per IR op type, holding everything the planner
// needs to know about it — arity, shape inference, FLOPs, backward cost. Each
// op family is registered in its own file (ops_*.cc); adding an op touches
// one place. Sharding rules (planner/synth) and kernels (executor/) key on
// the same type names.
//
// Thread-safety: the registry is built once on first use and then read-only.
#ifndef HAP_PLANNER_GRAPH_OP_REGISTRY_H_
#define HAP_PLANNER_GRAPH_OP_REGISTRY_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/graph/types.h"

namespace hap::graph {

// What shape inference and FLOP counting see of one op instance.
struct OpCall {
  absl::string_view type;
  const Attrs& attrs;
  std::vector<std::string> input_names;
  std::vector<TensorType> inputs;
  std::vector<TensorType> outputs;  // filled after inference

  const TensorType& in(int i) const { return inputs[i]; }
  const Shape& shape(int i) const { return inputs[i].shape; }
  // "input 'x' (f32[32,768])" for error messages.
  std::string Describe(int i) const;
};

inline constexpr char kAnnotationPrefix[] = "meta.";

struct OpDef {
  std::string type;
  // Signature and semantics, one line, for `hapctl ops` and the docs.
  std::string summary;
  int min_inputs = 1;
  int max_inputs = 1;  // -1 = any number
  // Output types from input types and attributes; InvalidArgument naming
  // the offending input or attribute when they do not fit.
  std::function<absl::StatusOr<std::vector<TensorType>>(const OpCall&)> infer;
  // Forward FLOPs (multiply-adds count 2). Called after `infer` succeeded.
  std::function<double(const OpCall&)> flops;
  // Backward FLOPs as a multiple of forward (docs/design.md §4: about 2).
  double backward_flops_multiple = 2.0;
  // The attributes the op accepts; any other is an error naming it, except
  // free-form annotations named "meta.*" (provenance from importers).
  std::vector<std::string> attrs;
  // Inputs through which gradients flow (others are indices, masks, ...).
  // Empty = every floating-point input.
  std::vector<int> non_differentiable_inputs;
};

class OpRegistry {
 public:
  static const OpRegistry& Global();

  const OpDef* Find(absl::string_view type) const;
  std::vector<const OpDef*> All() const;  // sorted by type

  void Register(OpDef def);  // during construction only

 private:
  OpRegistry();
  std::vector<OpDef> defs_;
};

// Runs the registered inference for one op; errors are prefixed with
// "op 'name' (type): ".
absl::StatusOr<std::vector<TensorType>> InferOp(
    absl::string_view op_name, absl::string_view type, const Attrs& attrs,
    const std::vector<std::string>& input_names,
    const std::vector<TensorType>& inputs);

}  // namespace hap::graph

#endif  // HAP_PLANNER_GRAPH_OP_REGISTRY_H_
