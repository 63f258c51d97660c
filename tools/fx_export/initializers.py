"""Initializer specs of graph parameters (hap.v1.Initializer, proto3 JSON).

The graph carries how each parameter is initialised, not its values (those
go into the --weights file): the module's own values where the IR can hold
them (all equal: ZEROS / ONES / CONSTANT; an exporter constant of other
values: VALUES, listing them), else the kind of PyTorch's
default initialisation of the owning module, else a kind fitted to the
values of a bare nn.Parameter.
"""

import math

import torch
import torch.nn as nn

ONES = {"kind": "ONES"}
ZEROS = {"kind": "ZEROS"}


def uniform(bound):
    return {"kind": "UNIFORM", "low": -bound, "high": bound}


def fan_in_uniform(fan_in):
    """nn.Linear's and nn.Conv2d's default: U(-1/sqrt(fan_in), ...)."""
    return uniform(1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0)


def normal(mean, std):
    return {"kind": "NORMAL", "mean": mean, "stddev": std}


def xavier_uniform(fan_in, fan_out):
    return uniform(math.sqrt(6.0 / (fan_in + fan_out)))


def constant(value):
    """ZEROS, ONES or CONSTANT `value` (a new dict: callers may edit it)."""
    if value == 0:
        return dict(ZEROS)
    if value == 1:
        return dict(ONES)
    return {"kind": "CONSTANT", "value": value}


def constant_init(t):
    """ZEROS / ONES / CONSTANT when every value of `t` is the same (the
    module's own initial values kept), else None (also for meta tensors)."""
    if t.is_meta or t.numel() == 0:
        return None
    v = t.detach()
    lo, hi = float(v.min()), float(v.max())
    if lo != hi or not math.isfinite(lo):
        return None
    return constant(lo)


def count_runs(t):
    """How many runs of equal values `t`'s elements are in row-major order
    (what values() would list), counted without listing them."""
    flat = t.detach().reshape(-1).cpu()
    if flat.numel() == 0:
        return 0
    return int((flat[1:] != flat[:-1]).sum()) + 1


def values(t):
    """VALUES: the elements of `t` in row-major order as runs of equal
    values ({"kind": "VALUES", "values": [...], "counts": [...]}), and the
    number of runs."""
    flat = t.detach().reshape(-1).double().cpu()
    n = flat.numel()
    change = (torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1).tolist()
    starts = [0] + change if n else []
    ends = change + [n] if n else []
    return ({"kind": "VALUES",
             "values": flat[starts].tolist() if starts else [],
             "counts": [e - b for b, e in zip(starts, ends)]}, len(starts))


def init_from_values(t):
    """Initializer for a bare nn.Parameter (no module default): constant when
    all values are equal, else UNIFORM over [min, max] when the values look
    uniform (excess kurtosis < -0.6), else NORMAL(mean, std). A meta tensor
    has no values: NORMAL(0, 0.02), the usual init of such parameters (class
    tokens, position tables)."""
    if t.is_meta:
        return normal(0.0, 0.02)
    v = t.detach().double().flatten()
    if v.numel() == 0:
        return dict(ZEROS)
    lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        return constant(lo)
    mean, std = float(v.mean()), float(v.std(unbiased=False))
    if v.numel() >= 16:
        kurt = float(((v - mean) ** 4).mean()) / (std ** 4) - 3.0
        if kurt < -0.6:
            return {"kind": "UNIFORM", "low": lo, "high": hi}
    return normal(mean, std)


def default_init(root, name, tensor):
    """PyTorch's default initialisation of the submodule of `root` owning
    the parameter `name` (a state_dict name); `tensor` is its value, fitted
    by init_from_values when no module default applies."""
    owner_path, _, attr = name.rpartition(".")
    try:
        owner = root.get_submodule(owner_path) if owner_path else root
    except AttributeError:
        owner = None
    parent = None
    if owner_path:
        pp, _, leaf = owner_path.rpartition(".")
        try:
            parent = root.get_submodule(pp) if pp else root
        except AttributeError:
            parent = None
        if isinstance(parent, nn.MultiheadAttention) and leaf == "out_proj":
            if attr == "bias":
                return dict(ZEROS)
    if isinstance(owner, nn.Linear) and attr in ("weight", "bias"):
        return fan_in_uniform(owner.in_features)
    if isinstance(owner, nn.modules.conv._ConvNd) and \
            attr in ("weight", "bias"):
        # Conv1d/2d/3d: fan-in is in_channels / groups times the kernel.
        return fan_in_uniform(math.prod(owner.weight.shape[1:]))
    if isinstance(owner, nn.GroupNorm):
        return dict(ONES if attr == "weight" else ZEROS)
    if isinstance(owner, nn.Embedding) and attr == "weight":
        return normal(0.0, 1.0)
    if isinstance(owner, nn.LayerNorm):
        return dict(ONES if attr == "weight" else ZEROS)
    if isinstance(owner, nn.LSTM):
        return uniform(1.0 / math.sqrt(owner.hidden_size))
    return init_from_values(tensor)
