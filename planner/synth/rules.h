// Sharding rules: the distributed instructions of each IR op, as Hoare
// triples {input forms} op {output forms} (docs/design.md §4). One function per op
// family (rules_*.cc), keyed by op type; adding an op's rules touches one
// place.
#ifndef HAP_PLANNER_SYNTH_RULES_H_
#define HAP_PLANNER_SYNTH_RULES_H_

#include <optional>
#include <string>
#include <vector>

#include "planner/graph/graph.h"
#include "planner/synth/form.h"

namespace hap::synth {

enum class RuleKind {
  kReplicated,  // every device computes the whole op
  kData,        // split along sample/token (batch-like) dimensions
  kTensor,      // split along feature, head, channel or expert dimensions
  kPartial,     // propagates or produces partial sums
};

struct ShardRule {
  std::string name;  // "data(0)", "column", "row", "heads", "replicated"...
  RuleKind kind = RuleKind::kReplicated;
  std::vector<Form> inputs;
  std::vector<Form> outputs;
  // The op's work is divided by the ratios (each device b_i of the FLOPs);
  // otherwise every device does all of it.
  bool split = false;
  // Per input: the gradient of an R input comes out already replicated even
  // though the work is split (e.g. a bias added on one device). Otherwise an
  // R input of a split rule gets a partial gradient.
  std::vector<bool> replicated_grad;
  // Bytes of an all-gather the op runs between its kernels (a synchronising
  // collective inside the op: vocabulary-parallel cross-entropy gathers its
  // row log-sum-exps); 0 for none.
  double internal_gather_bytes = 0;
};

struct RuleContext {
  int num_devices = 2;
  // A dimension may be sharded only when it has at least this many entries.
  int64_t min_shard_length = 2;
};

// Sufficient factor broadcasting (SFB; docs/design.md §4): under a data
// rule, the gradient of a weight that is a product of two sharded factors,
// the op's input `x` and its output's gradient, can be recomputed whole on
// every device from the gathered factors instead of all-reducing partial
// weight gradients. The op has one output; its gradient kernel, run on the
// gathered x and dy, yields the whole weight gradient and does not read the
// op's output.
struct SufficientFactors {
  int x_input = 0;   // the op's input gathered as the first factor
  int y_output = 0;  // the op's output whose gradient is the second
  double flops = 0;  // of the whole weight gradient on one device
};

// The factors of weight input `input` of `op` when SFB applies to it (a
// linear's weight); nullopt otherwise.
std::optional<SufficientFactors> SfbFactors(const graph::Graph& g, const graph::Op& op, int input);

// The rules of op `op` of `g`, replicated first; never empty (the
// replicated rule applies to every op). Only that one for an op with a
// tensor of more than Form::kMaxShardedDim + 1 dimensions.
std::vector<ShardRule> RulesFor(const graph::Graph& g, graph::OpId op,
                                const RuleContext& ctx);

// Internal: one generator per op family.
namespace internal {
struct RuleInput {
  const graph::Graph& g;
  const graph::Op& op;
  const RuleContext& ctx;
  const graph::Shape& in(int i) const { return g.tensor(op.inputs[i]).type.shape; }
  const graph::Shape& out(int i) const {
    return g.tensor(op.outputs[i]).type.shape;
  }
  int num_inputs() const { return static_cast<int>(op.inputs.size()); }
  bool Shardable(int64_t length) const {
    return length >= ctx.min_shard_length && length >= ctx.num_devices;
  }
};
using RuleFn = void (*)(const RuleInput&, std::vector<ShardRule>&);
RuleFn ElementwiseRules(const std::string& type);
RuleFn DenseRules(const std::string& type);
RuleFn LayoutRules(const std::string& type);
RuleFn MoeRules(const std::string& type);
RuleFn RecurrentRules(const std::string& type);

ShardRule MakeRule(std::string name, RuleKind kind, std::vector<Form> in,
                   std::vector<Form> out, bool split);
}  // namespace internal

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_RULES_H_
