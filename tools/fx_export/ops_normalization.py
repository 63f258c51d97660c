"""Normalisations (planner/graph/ops_normalization.cc): layer_norm over the
last dimension, group_norm (as a layer_norm of the groups and a per-channel
affine), training-mode batch_norm with its running statistics, and
softmax / log_softmax (over another dimension than the last by transposes;
a softmax over the last also takes the causal or additive mask that
attention scores carry)."""

import functools

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import initializers, registry
from .ir import IrTensor, float_torch_dtype, ir_dtype, join

# ---- layer_norm ------------------------------------------------------------


def positive_eps(ex, eps):
    """The IR's layer_norm and batch_norm take eps > 0 (hapctl validate
    refused a graph with PyTorch's allowed eps=0)."""
    if not eps > 0:
        ex.fail(f"eps={eps} is not supported (the IR's normalisations take "
                f"eps > 0)")
    return float(eps)



def layer_norm(ex, mod, path, x, scope):
    """nn.LayerNorm `mod` (at `path`) applied to x; without affine
    parameters its weight and bias are frozen exporter constants."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    if len(mod.normalized_shape) != 1:
        ex.fail(f"LayerNorm '{path}' normalises over "
                f"{list(mod.normalized_shape)}; only the last dimension "
                f"is supported")
    d = mod.normalized_shape[0]
    positive_eps(ex, mod.eps)
    if mod.elementwise_affine:
        g, b = ex.param(mod.weight), ex.param(mod.bias)
    else:  # in x's dtype: a bf16 model's layer_norm takes bf16 gamma/beta
        dt = float_torch_dtype(x.dtype)
        g = ex.param(torch.ones(d, dtype=dt), at("weight"),
                     dict(initializers.ONES), True, key=("ln_w", path))
        b = ex.param(torch.zeros(d, dtype=dt), at("bias"),
                     dict(initializers.ZEROS), True, key=("ln_b", path))
    return ex.emit("layer_norm", path, [x, g, b], {"eps": float(mod.eps)},
                   x.shape, scope=scope)


@registry.modules(nn.LayerNorm)
def _layer_norm_module(ex, call):
    return layer_norm(ex, call.mod, call.name, call.x0(), call.scope)


@registry.functions(F.layer_norm)
def _layer_norm(ex, call):
    x = call.tensor(0, "input")
    shape = call.value(1, "normalized_shape")
    w, b = call.arg(2, "weight", None), call.arg(3, "bias", None)
    if len(shape) != 1 or w is None or b is None:
        ex.fail("layer_norm needs one normalised dim and affine "
                "weight and bias")
    return ex.op("layer_norm", [x, ex.t(w), ex.t(b)],
                 {"eps": positive_eps(ex, call.value(4, "eps", 1e-5))})


# ---- group_norm ------------------------------------------------------------


def group_norm(ex, path, x, groups, weight, bias, eps):
    """nn.GroupNorm / F.group_norm: x [n, c, ...] viewed as [n, groups,
    (c / groups) * ...], a layer_norm over its last dim (frozen ones and
    zeros for its gamma and beta), viewed back, then the per-channel
    weight and bias (module parameters, fx arguments or None) broadcast
    over the other dims. No op of its own."""
    if len(x.shape) < 2:
        ex.fail("group_norm needs an [N, C, ...] input")
    n, c, rest = x.shape[0], x.shape[1], list(x.shape[2:])
    if not isinstance(groups, int) or groups < 1 or c % groups:
        ex.fail(f"group_norm's {groups} groups do not divide its {c} "
                f"channels")
    d = c // groups
    for k in rest:
        d *= k
    positive_eps(ex, eps)
    scope = ex.scope_of(ex.node)
    dt = float_torch_dtype(x.dtype)
    g = ex.param(torch.ones(d, dtype=dt), f"{path}.group_norm_gamma",
                 dict(initializers.ONES), True, key=("gn_w", d, x.dtype))
    b = ex.param(torch.zeros(d, dtype=dt), f"{path}.group_norm_beta",
                 dict(initializers.ZEROS), True, key=("gn_b", d, x.dtype))
    t = ex.reshape(f"{path}_groups", x, (n, groups, d), scope)
    t = ex.emit("layer_norm", f"{path}_norm", [t, g, b], {"eps": float(eps)},
                t.shape, scope=scope)
    y = ex.reshape(f"{path}_channels", t, x.shape, scope)
    per_channel = (1, c) + (1,) * len(rest)
    for t, kind in ((weight, "mul"), (bias, "add")):
        if t is None:
            continue
        p = ex.param(t) if isinstance(t, torch.Tensor) else ex.t(t)
        if tuple(p.shape) != (c,):
            ex.fail(f"group_norm's {'weight' if kind == 'mul' else 'bias'} "
                    f"has shape {list(p.shape)}, not [{c}]")
        p = ex.reshape(f"{path}_{'weight' if kind == 'mul' else 'bias'}", p,
                       per_channel, scope)
        y = ex.emit(kind, path, [y, p], None, x.shape, scope=scope)
    return y


@registry.modules(nn.GroupNorm)
def _group_norm_module(ex, call):
    mod = call.mod
    return group_norm(ex, call.name, call.x0(), mod.num_groups,
                      mod.weight if mod.affine else None,
                      mod.bias if mod.affine else None, mod.eps)


@registry.functions(F.group_norm)
def _group_norm(ex, call):
    a = call.named(["input", "num_groups", "weight", "bias", "eps"],
                   {"weight": None, "bias": None, "eps": 1e-5})
    return group_norm(ex, ex.base_name(call.node), ex.t(a["input"]),
                      ex.v(a["num_groups"]), a["weight"], a["bias"],
                      ex.v(a["eps"]))


# ---- batch_norm ------------------------------------------------------------


def batch_norm(ex, path, x, weight, bias, running_mean, running_var,
               momentum, eps):
    """Training-mode batch normalisation over channel dim 1; the running
    statistics (module buffers) become frozen parameters under their
    state_dict names, updated by the op. weight and bias: module
    parameters, fx arguments, or None (frozen ones and zeros)."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    if len(x.shape) < 2:
        ex.fail("batch_norm needs an [N, C, ...] input")
    if momentum is None:
        ex.fail("batch_norm with momentum=None (a cumulative average of "
                "the statistics) is not supported")
    positive_eps(ex, eps)
    if not 0 <= momentum <= 1:
        ex.fail(f"batch_norm with momentum={momentum} is not supported "
                f"(the IR's is in [0, 1])")
    c = x.shape[1]
    ins = [x]
    for t, leaf, init in ((weight, "weight", initializers.ONES),
                          (bias, "bias", initializers.ZEROS)):
        if isinstance(t, torch.Tensor) and id(t) in ex.qualname:
            ins.append(ex.param(t))
        elif t is not None and not isinstance(t, torch.Tensor):
            ins.append(ex.t(t))
        else:
            ins.append(ex.param(torch.full((c,), 1.0 if leaf == "weight"
                                           else 0.0,
                                           dtype=float_torch_dtype(x.dtype)),
                                at(leaf), dict(init), True,
                                key=("bn_" + leaf, path)))
    if (running_mean is None) != (running_var is None):
        ex.fail("batch_norm needs both running statistics or neither")
    if running_mean is not None:
        for buf, leaf in ((running_mean, "running_mean"),
                          (running_var, "running_var")):
            if not isinstance(buf, torch.Tensor):
                ex.fail("batch_norm's running statistics must be module "
                        "buffers")
            init = initializers.constant_init(buf) or \
                initializers.init_from_values(buf)
            t = ex.param(buf, ex.buffer_names.get(id(buf), at(leaf)),
                         init, True, key=id(buf))
            if t.name not in ex.buffers:
                ex.buffers.append(t.name)
            ins.append(t)
    return ex.emit("batch_norm", path, ins,
                   {"eps": float(eps), "momentum": float(momentum)},
                   x.shape, scope=ex.scope_of(ex.node))


@registry.modules(nn.modules.batchnorm._BatchNorm)
def _batch_norm_module(ex, call):
    mod = call.mod
    name = call.name
    if mod.affine:
        w, b = mod.weight, mod.bias
    else:
        w = b = None
    rm = mod.running_mean if mod.track_running_stats else None
    rv = mod.running_var if mod.track_running_stats else None
    return batch_norm(ex, name, call.x0(), w, b, rm, rv, mod.momentum,
                      mod.eps)


@registry.functions(F.batch_norm)
def _batch_norm(ex, call):
    a = call.named(["input", "running_mean", "running_var", "weight",
                    "bias", "training", "momentum", "eps"],
                   {"weight": None, "bias": None, "training": False,
                    "momentum": 0.1, "eps": 1e-5})
    if not ex.v(a["training"]):
        ex.fail("batch_norm with training=False (normalising by "
                "the running statistics) is not supported: the IR "
                "is one training step")

    def tensor_or_none(v):
        # Module parameters and buffers by value (their state_dict names
        # kept), other arguments as they are.
        if v is None:
            return None
        if isinstance(v, fx.Node) and v.op == "get_attr":
            return ex.fetch_attr(v.target)
        return v

    return batch_norm(ex, ex.base_name(call.node), ex.t(a["input"]),
                      tensor_or_none(a["weight"]),
                      tensor_or_none(a["bias"]),
                      tensor_or_none(a["running_mean"]),
                      tensor_or_none(a["running_var"]),
                      ex.v(a["momentum"]), ex.v(a["eps"]))


# ---- softmax ---------------------------------------------------------------


def softmax(ex, kind, x, dim):
    """softmax or log_softmax (`kind`) of x over `dim`, the last one; masked
    scores (causal, or an additive mask) only into a softmax, which takes
    the mask."""
    rank = len(x.shape)
    if dim is None:  # PyTorch's legacy implicit dim
        dim = 0 if rank in (0, 1, 3) else 1
    if rank == 0 or not -rank <= dim < rank:
        ex.fail(f"{kind} over dim {dim} of a rank-{rank} tensor")
    if x.shifted is not None:
        # x less its maximum over x.shifted: the same softmax as of x.
        if x.shifted != dim % rank or kind != "softmax":
            ex.fail(f"{kind} over dim {dim} of scores less their maximum "
                    f"over dim {x.shifted}: only a softmax over the same "
                    f"dim is supported")
        x = IrTensor(x.name, x.shape, x.dtype, x.causal, x.mask)
    if dim % rank != rank - 1:
        # Another dim (Wav2Letter's log_softmax over the classes of
        # [n, classes, time]): moved last, and the result moved back.
        if x.causal or x.mask is not None:
            ex.fail(f"masked scores go into a softmax over the last "
                    f"dimension, not dim {dim}")
        name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
        perm = list(range(rank))
        perm[dim % rank], perm[-1] = perm[-1], perm[dim % rank]
        t = ex.transpose(f"{name}_in", x, perm, scope)
        y = ex.emit(kind, name, [t], None, t.shape, ex.out_dtype(),
                    scope=scope)
        return ex.transpose(name, y, perm, scope)
    attrs = {}
    ins = [x]
    if x.causal or x.mask is not None:
        if kind != "softmax":
            ex.fail("masked scores must go into softmax")
        attrs["causal"] = bool(x.causal)
        if x.mask is not None:
            ins.append(x.mask)
        x = x.with_mask()
        ins[0] = x
    return ex.op(kind, ins, attrs)


def _same_dtype(ex, kind, dtype, x):
    """softmax's dtype= is supported when it is x's own (the IR converts
    no dtypes)."""
    if dtype is not None and ir_dtype(dtype, kind) != x.dtype:
        ex.fail(f"{kind} with dtype={dtype} of a {x.dtype} tensor is not "
                f"supported (the IR does not convert dtypes)")


@registry.modules(nn.Softmax, nn.LogSoftmax)
def _softmax_module(ex, call):
    kind = "softmax" if isinstance(call.mod, nn.Softmax) else "log_softmax"
    return softmax(ex, kind, call.x0(), call.mod.dim)


@registry.functions(F.softmax, torch.softmax, F.log_softmax,
                    torch.log_softmax)
def _softmax(ex, call):
    f = call.node.target
    kind = "softmax" if f in (F.softmax, torch.softmax) else "log_softmax"
    # torch.softmax(input, dim, dtype); F.softmax(input, dim, _stacklevel,
    # dtype): torch's positional dtype was read as F's _stacklevel and
    # dropped (the graph declared a softmax of another dtype than its
    # input's, which `hapctl validate` refused after exit status 0).
    at = 2 if f in (torch.softmax, torch.log_softmax) else 3
    x = ex.t(call.arg(0, "input"), allow_masked=True)
    _same_dtype(ex, kind, call.value(at, "dtype", None), x)
    return softmax(ex, kind, x, call.value(1, "dim", None))


# The receiver may be masked scores: converted here, allowing the mask.
@registry.methods("softmax", "log_softmax", tensor_self=False)
def _softmax_method(ex, call):
    x = ex.t(call.args[0], allow_masked=True)
    # Tensor.softmax(dim, dtype): the dtype was not read at all.
    _same_dtype(ex, call.node.target, call.value(2, "dtype", None), x)
    return softmax(ex, call.node.target, x, call.value(1, "dim", None))
