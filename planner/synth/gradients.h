// Which gradients of a program end partial (a sum over devices), found by
// walking its steps backwards: the lowering all-reduces a replicated
// parameter's partial gradient (planner/lower), the search prices that
// all-reduce (search.cc Finish), and the checker requires it.
//
// A split or partial-sum rule that reads an R input leaves a partial
// gradient for it (unless the rule declares that gradient replicated); a
// replicated rule passes its outputs' partial gradients on to its inputs;
// a zero-out R -> P leaves the R tensor's gradient partial (a slice R -> S
// gets it back whole, by all-gather). So a
// partial gradient made late in the program (a column-parallel decoder
// reading a replicated activation) reaches the parameters of every
// replicated op before it.
#ifndef HAP_PLANNER_SYNTH_GRADIENTS_H_
#define HAP_PLANNER_SYNTH_GRADIENTS_H_

#include <vector>

#include "planner/graph/graph.h"
#include "planner/synth/program.h"

namespace hap::synth {

struct GradientAnalysis {
  std::vector<bool> requires_grad;  // per tensor
  // Per tensor: the gradient of its R buffer is partial.
  std::vector<bool> partial_grad;
  // Per step: the parameter whose weight gradient SFB recomputes (-1: none).
  std::vector<graph::TensorId> sfb_param;
};

GradientAnalysis AnalyzeGradients(const graph::Graph& g, const Program& p);

// Input j of `op` gets a gradient (it is floating and differentiable).
bool Differentiable(const graph::Graph& g, const graph::Op& op, int j);

// The form of op input j's gradient contribution when it reads an R input:
// partial for a split or partial-sum rule (unless it declares the gradient
// replicated); a replicated rule passes on its outputs' forms.
bool PartialContribution(const OpStep& s, const graph::Op& op, int j,
                         const std::vector<bool>& partial_grad);

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_GRADIENTS_H_
