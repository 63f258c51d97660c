#include "planner/lower/dim_classes.h"

namespace hap::lower::internal {

using graph::TensorId;
using synth::Form;

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
    if (group > 0 &&
        (op.type == "moe_route" || op.type == "moe_dispatch_idx" || op.type == "moe_combine_idx")) {
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

}  // namespace hap::lower::internal
