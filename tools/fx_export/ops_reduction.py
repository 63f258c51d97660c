"""Reductions (planner/graph/ops_reduction.cc): sum and mean over a set of
axes (all of them without dim), keepdim."""

import torch

from . import registry


def reduce(ex, kind, x, dim, keepdim, dtype=None):
    """`kind` ("sum"/"mean") of x over `dim` (an int, a list, or None)."""
    if dtype is not None:
        ex.fail(f"{kind} with dtype= is not supported")
    attrs = {}
    if dim is not None:
        dims = [dim] if isinstance(dim, int) else list(dim)
        rank = len(x.shape)
        attrs["axes"] = [d + rank if d < 0 else d for d in dims]
        if not attrs["axes"]:
            del attrs["axes"]
    if keepdim:
        attrs["keepdims"] = True
    return ex.op(kind, [x], attrs)


@registry.functions(torch.mean, torch.sum)
def _reduce(ex, call):
    kind = "mean" if call.node.target is torch.mean else "sum"
    return reduce(ex, kind, call.tensor(0, "input"), call.value(1, "dim", None),
                  call.value(2, "keepdim", False), call.value(3, "dtype", None))


@registry.methods("mean", "sum")
def _reduce_method(ex, call, x):
    return reduce(ex, call.node.target, x, call.value(1, "dim", None),
                  call.value(2, "keepdim", False), call.value(3, "dtype", None))
