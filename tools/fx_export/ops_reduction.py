"""Reductions (planner/graph/ops_reduction.cc): sum and mean over a set of
axes (all of them without dim), keepdim; the maximum over one dim only as a
softmax's stabilising shift (ir.RowMax); and, as compositions of IR ops,
var and std (var_mean, std_mean), the 1- and 2-norms (torch.norm,
Tensor.norm, torch.linalg.vector_norm), logsumexp and cumsum."""

import torch

from . import registry
from .ir import RowMax, ir_dtype
from .ops_elementwise import Emitter, power


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


# ---- var, std, norm, logsumexp, cumsum -------------------------------------
#
# Compositions of sum, mean, mul, scale, relu, log/exp and layout ops: the IR
# has none of these reductions.


def reduced_axes(ex, x, dim, what):
    """The axes (sorted, non-negative) that `dim` (an int, a list, or None
    or [] for all of them) names in x."""
    rank = len(x.shape)
    if dim is None:
        return list(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return list(range(rank))
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or \
                not -rank <= d < rank:
            ex.fail(f"{what} over dim {d!r} of a rank-{rank} tensor")
    return sorted({d % rank for d in dims})


def reduced_shape(shape, axes, keepdim):
    """`shape` reduced over `axes` (kept as 1 with keepdim)."""
    if keepdim:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_to(ex, kind, x, axes, keepdim, name, scope):
    """`kind` ("sum"/"mean") of x over `axes`."""
    attrs = {"axes": axes}
    if keepdim:
        attrs["keepdims"] = True
    return ex.emit(kind, name, [x], attrs, reduced_shape(x.shape, axes,
                                                         keepdim),
                   scope=scope)


def variance(ex, x, dim, correction, keepdim, what, with_mean=False):
    """sum((x - mean(x))^2) / (n - correction) over `dim` (n: the number
    of elements reduced); with_mean: (it, the mean), as var_mean gives."""
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    axes = reduced_axes(ex, x, dim, what)
    n = 1
    for a in axes:
        n *= x.shape[a]
    if not isinstance(correction, (int, float)) or \
            isinstance(correction, bool):
        ex.fail(f"{what}'s correction {correction!r} is not a number")
    if n - correction <= 0:
        ex.fail(f"{what} of {n} element(s) with correction {correction} "
                f"divides by {n - correction} (PyTorch gives inf or NaN)")
    mean = _reduce_to(ex, "mean", x, axes, True, name, scope)
    diff = ex.emit("sub", name, [x, mean], shape=x.shape, scope=scope)
    square = ex.emit("mul", name, [diff, diff], shape=x.shape, scope=scope)
    total = _reduce_to(ex, "sum", square, axes, keepdim, name, scope)
    var = ex.emit("scale", name, [total], {"factor": 1.0 / (n - correction)},
                  shape=total.shape, scope=scope)
    if not with_mean:
        return var
    return var, ex.reshape(name, mean, total.shape, scope)


def _variance_args(ex, call, at):
    """(dim, correction, keepdim) of var/std(input, ...) with the
    arguments after input from position `at`: (dim, unbiased, keepdim),
    (unbiased) or (dim, *, correction, keepdim)."""
    rest = [ex.v(a) for a in call.args[at:]]
    kw = {k: ex.v(v) for k, v in call.kwargs.items()}
    if rest and isinstance(rest[0], bool):  # var(input, unbiased)
        kw.setdefault("unbiased", rest.pop(0))
    for key, value in zip(("dim", "unbiased", "keepdim"), rest):
        kw.setdefault(key, value)
    correction = kw.get("correction")
    if correction is None:
        correction = 1 if kw.get("unbiased", True) in (True, None) else 0
    return kw.get("dim"), correction, bool(kw.get("keepdim", False))


def _var_std(ex, call, x, kind, at):
    """var, std, var_mean or std_mean (`kind`) of x."""
    dim, correction, keepdim = _variance_args(ex, call, at)
    with_mean = kind.endswith("_mean")
    out = variance(ex, x, dim, correction, keepdim, kind, with_mean)
    if not kind.startswith("std"):
        return out
    var, mean = out if with_mean else (out, None)
    std = power(ex, var, 0.5, ex.base_name(ex.node), ex.scope_of(ex.node))
    return (std, mean) if with_mean else std


@registry.functions(torch.var, torch.std, torch.var_mean, torch.std_mean)
def _var_std_function(ex, call):
    return _var_std(ex, call, call.tensor(0, "input"),
                    call.node.target.__name__, 1)


@registry.methods("var", "std")
def _var_std_method(ex, call, x):
    return _var_std(ex, call, x, call.node.target, 1)


def vector_norm(ex, x, p, dim, keepdim, dtype, what):
    """The p-norm of x over `dim` (all of x for None) for p = 2 (and
    'fro'): sqrt(sum(x * x)), whose gradient at x = 0 is NaN (PyTorch's:
    0); p = 1: sum(|x|)."""
    if dtype is not None:
        ex.fail(f"{what} with dtype= is not supported (the IR does not "
                f"convert dtypes)")
    if p == "fro":
        p = 2
    if isinstance(p, bool) or not isinstance(p, (int, float)) or \
            p not in (1, 2):
        ex.fail(f"{what} with p={p!r} is not supported (p=2, 'fro' and p=1 "
                f"are: the IR has no max, min or abs for the others)")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    axes = reduced_axes(ex, x, dim, what)
    if p == 1:
        return _reduce_to(ex, "sum", Emitter(ex, name, scope).abs(x), axes,
                          keepdim, name, scope)
    square = ex.emit("mul", name, [x, x], shape=x.shape, scope=scope)
    total = _reduce_to(ex, "sum", square, axes, keepdim, name, scope)
    return power(ex, total, 0.5, name, scope)


def _norm_p(ex, p, dim, what):
    """torch.norm's p: a string other than 'fro' over at most 2 dims is a
    matrix norm ('nuc')."""
    if isinstance(p, str) and p != "fro":
        ex.fail(f"{what} with p='{p}' (a matrix norm) is not supported")
    if p == "fro" and isinstance(dim, (list, tuple)) and len(dim) > 2:
        ex.fail(f"{what} with p='fro' over {len(dim)} dims is not supported")
    return 2 if p is None else p


@registry.functions(torch.norm)
def _norm_function(ex, call):
    a = call.named(["input", "p", "dim", "keepdim", "out", "dtype"],
                   {"p": "fro", "dim": None, "keepdim": False, "dtype": None})
    p, dim = ex.v(a["p"]), ex.v(a["dim"])
    return vector_norm(ex, ex.t(a["input"]), _norm_p(ex, p, dim, "torch.norm"),
                       dim, ex.v(a["keepdim"]), ex.v(a["dtype"]),
                       "torch.norm")


@registry.methods("norm")
def _norm_method(ex, call, x):
    p, dim = call.value(1, "p", "fro"), call.value(2, "dim", None)
    return vector_norm(ex, x, _norm_p(ex, p, dim, "Tensor.norm"), dim,
                       call.value(3, "keepdim", False),
                       call.value(4, "dtype", None), "Tensor.norm")


@registry.functions(torch.linalg.vector_norm)
def _vector_norm(ex, call):
    return vector_norm(ex, call.tensor(0, "x"), call.value(1, "ord", 2),
                       call.value(2, "dim", None),
                       call.value(3, "keepdim", False),
                       ex.v(call.kwargs.get("dtype")),
                       "torch.linalg.vector_norm")


def logsumexp(ex, x, dim, keepdim):
    """log(sum(exp(x))) over `dim`, stably: the dims moved last and merged,
    x - log_softmax(x) (the logsumexp at every position of the row) at
    position 0 (a slice). Its gradient is the softmax, as PyTorch's."""
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    axes = reduced_axes(ex, x, dim, "logsumexp")
    rank = len(x.shape)
    kept = [i for i in range(rank) if i not in axes]
    t = ex.transpose(name, x, kept + axes, scope)
    n = 1
    for a in axes:
        n *= x.shape[a]
    rows = tuple(x.shape[i] for i in kept)
    t = ex.reshape(name, t, rows + (n,), scope)
    lsm = ex.emit("log_softmax", name, [t], shape=t.shape, scope=scope)
    lse = ex.emit("sub", name, [t, lsm], shape=t.shape, scope=scope)
    lse = ex.emit("slice", name, [lse], {"axis": len(rows), "start": 0,
                                         "end": 1}, shape=rows + (1,),
                  scope=scope)
    return ex.reshape(name, lse, reduced_shape(x.shape, axes, keepdim), scope)


@registry.functions(torch.logsumexp)
def _logsumexp(ex, call):
    return logsumexp(ex, call.tensor(0, "input"), call.value(1, "dim"),
                     call.value(2, "keepdim", False))


@registry.methods("logsumexp")
def _logsumexp_method(ex, call, x):
    return logsumexp(ex, x, call.value(1, "dim"),
                     call.value(2, "keepdim", False))


# cumsum's constant [n, n] matrix: 16M elements (64 MiB in float32) at most.
CUMSUM_LIMIT = 4096


def cumsum(ex, x, dim, dtype, what):
    """The running sum of x along `dim`: the dim moved last, times the
    constant upper-triangular matrix of ones ([n, n], U[i, j] = 1 for
    i <= j), moved back."""
    if dtype is not None and ir_dtype(dtype, what) != x.dtype:
        ex.fail(f"{what} with dtype={dtype} of a {x.dtype} tensor is not "
                f"supported (the IR does not convert dtypes)")
    if isinstance(dim, bool) or not isinstance(dim, int):
        ex.fail(f"{what} needs one int dim, not {dim!r}")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    shape = x.shape or (1,)
    rank = len(shape)
    if not -rank <= dim < rank:
        ex.fail(f"{what} over dim {dim} of a rank-{len(x.shape)} tensor")
    axis = dim % rank
    n = shape[axis]
    if n > CUMSUM_LIMIT:
        ex.fail(f"{what} over a dim of {n} elements is not supported (at "
                f"most {CUMSUM_LIMIT}: it is a matmul by a constant "
                f"[{n}, {n}] matrix)")
    if n == 1:
        return x
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    t = ex.transpose(name, ex.reshape(name, x, shape, scope), perm, scope)
    moved = t.shape
    if rank == 1:
        t = ex.reshape(name, t, (1, n), scope)
    ones = torch.triu(torch.ones(n, n, dtype=torch.float64))
    u = ex.const(ones, x, f"the triangular matrix of {what}")
    t = ex.emit("matmul", name, [t, u], shape=t.shape, scope=scope)
    t = ex.reshape(name, t, moved, scope)
    return ex.reshape(name, ex.transpose(name, t, perm, scope), x.shape,
                      scope)


@registry.functions(torch.cumsum)
def _cumsum(ex, call):
    return cumsum(ex, call.tensor(0, "input"), call.value(1, "dim"),
                  call.value(2, "dtype", None), "torch.cumsum")


@registry.methods("cumsum")
def _cumsum_method(ex, call, x):
    return cumsum(ex, x, call.value(1, "dim"), call.value(2, "dtype", None),
                  "Tensor.cumsum")
