"""Tensor.detach() and torch.detach as the IR's stop_gradient op
(planner/graph/ops_elementwise.cc): the value, with no gradient flowing
back through it, as in a straight-through estimator (x + (q - x).detach())
or a target computed by the model itself. A detached constant is folded at
export like any constant; a detached integer tensor (ids) has no gradient
anyway and is the tensor itself."""

import torch

from . import registry


def detach(ex, x):
    if x.dtype not in ("FLOAT32", "FLOAT64", "FLOAT16", "BFLOAT16"):
        return x
    return ex.op("stop_gradient", [x])


@registry.functions(torch.detach)
def _detach(ex, call):
    return detach(ex, call.tensor(0, "input"))


@registry.methods("detach", "detach_")
def _detach_method(ex, call, x):
    return detach(ex, x)
