"""Matrix products (planner/graph/ops_linear.cc): linear in PyTorch's layout
(nn.Linear, F.linear) and (batched) matmul (@, torch.matmul, torch.bmm)."""

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import registry


def linear(ex, name, x, w, b, scope):
    """x @ w.T + b (b may be None) as one linear op."""
    ins = [x, w] + ([b] if b is not None else [])
    shape = x.shape[:-1] + (w.shape[0],)
    return ex.emit("linear", name, ins, None, shape, scope=scope)


def linear_module(ex, mod, path, x, scope):
    """nn.Linear `mod` (at `path`) applied to x."""
    if x.shape[-1:] != (mod.in_features,):
        ex.fail(f"{path}: input {list(x.shape)} does not match "
                f"in_features {mod.in_features}")
    w = ex.param(mod.weight)
    b = ex.param(mod.bias) if mod.bias is not None else None
    return linear(ex, path, x, w, b, scope)


@registry.modules(nn.Linear)
def _linear_module(ex, call):
    return linear_module(ex, call.mod, call.name, call.x0(), call.scope)


@registry.functions(F.linear)
def _linear(ex, call):
    b = call.arg(2, "bias", None)
    return ex.op("linear", [call.tensor(0, "input"), call.tensor(1, "weight")]
                 + ([ex.t(b)] if b is not None else []))


def matmul(ex, a, b, batched=False):
    """a @ b for rank >= 2 operands; b of rank 2 or with a's batch
    dimensions (the IR does not broadcast); `batched`: torch.bmm's rank 3."""
    if len(a.shape) < 2 or len(b.shape) < 2:
        ex.fail("matmul of vectors (rank 1) is not supported")
    if batched and (len(a.shape) != 3 or len(b.shape) != 3):
        ex.fail("bmm needs rank-3 operands")
    if len(b.shape) != 2 and (len(b.shape) != len(a.shape) or
                              a.shape[:-2] != b.shape[:-2]):
        ex.fail(f"matmul of {list(a.shape)} and {list(b.shape)}: the "
                f"second operand must be rank 2 or have the same batch "
                f"dimensions (no broadcasting)")
    return ex.op("matmul", [a, b])


@registry.functions(operator.matmul, torch.matmul)
def _matmul(ex, call):
    return matmul(ex, call.tensor(0, "input"), call.tensor(1, "other"))


@registry.functions(torch.bmm)
def _bmm(ex, call):
    return matmul(ex, call.tensor(0, "input"), call.tensor(1, "mat2"),
                  batched=True)


@registry.methods("matmul", "__matmul__")
def _matmul_method(ex, call, x):
    return matmul(ex, x, call.tensor(1, "other"))


@registry.methods("bmm")
def _bmm_method(ex, call, x):
    return matmul(ex, x, call.tensor(1, "mat2"), batched=True)
