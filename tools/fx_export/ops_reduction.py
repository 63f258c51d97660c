"""Reductions (planner/graph/ops_reduction.cc): sum and mean over a set of
axes (all of them without dim), keepdim; the maximum over one dim only as a
softmax's stabilising shift (ir.RowMax)."""

import torch

from . import registry
from .ir import RowMax


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


def row_max(ex, x, dim, keepdim, what):
    """x.max(dim, keepdim=True) / x.amax(dim, keepdim=True): a RowMax that
    only `x - it` before a softmax over dim takes (the IR has no max)."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or not keepdim:
        ex.fail(f"{what} is supported only over one dim with keepdim=True, "
                f"as the shift before a softmax (x - x.max(dim, "
                f"keepdim=True)[0])")
    rank = len(x.shape)
    if not -rank <= dim < rank:
        ex.fail(f"{what} over dim {dim} of a rank-{rank} tensor")
    return RowMax(x, dim % rank)


@registry.functions(torch.max, torch.amax)
def _max(ex, call):
    f = call.node.target
    x = call.tensor(0, "input")
    dim = call.value(1, "dim", None)
    keepdim = call.value(2, "keepdim", False)
    if f is torch.amax:
        return row_max(ex, x, dim, keepdim, "torch.amax")
    if dim is None or isinstance(call.value(1, "dim", None), torch.Tensor):
        ex.fail("torch.max of a whole tensor or of two tensors is not "
                "supported")
    return (row_max(ex, x, dim, keepdim, "torch.max"), None)  # no indices


@registry.methods("max", "amax")
def _max_method(ex, call, x):
    dim = call.value(1, "dim", None)
    keepdim = call.value(2, "keepdim", False)
    if call.node.target == "amax":
        return row_max(ex, x, dim, keepdim, "Tensor.amax")
    if dim is None or isinstance(dim, torch.Tensor):
        ex.fail("Tensor.max of a whole tensor or of two tensors is not "
                "supported")
    return (row_max(ex, x, dim, keepdim, "Tensor.max"), None)
