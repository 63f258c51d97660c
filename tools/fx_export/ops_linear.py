"""Matrix products (planner/graph/ops_linear.cc): linear in PyTorch's layout
(nn.Linear, F.linear), (batched) matmul (@, torch.matmul, torch.bmm),
torch.addmm and torch.baddbmm (a matmul, scales and an add), torch.outer
(torch.ger: a broadcasting mul), and torch.einsum as matmuls, broadcasting
muls, sums and layout ops."""

import collections
import math
import operator
import string

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import registry
from .weight_norm import module_weight


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
    w = module_weight(ex, mod, path, scope)
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


def _number(ex, v, what):
    """addmm's beta or alpha: a finite number."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or \
            not math.isfinite(v):
        ex.fail(f"{what} {v!r} is not a finite number")
    return float(v)


def add_product(ex, bias, a, b, beta, alpha, batched, what):
    """beta * bias + alpha * (a @ b) (torch.addmm, torch.baddbmm): a matmul,
    scales for beta and alpha other than 1, and an add (bias broadcasts);
    beta = 0 leaves bias out, as PyTorch does (its NaNs too)."""
    beta, alpha = _number(ex, beta, f"{what}'s beta"), \
        _number(ex, alpha, f"{what}'s alpha")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    out = tuple(ex.out_shape())
    y = matmul(ex, a, b, batched)
    if alpha != 1:
        y = ex.emit("scale", name, [y], {"factor": alpha}, shape=out,
                    scope=scope)
    if beta == 0:
        return y
    c = ex.t(bias)
    if beta != 1:
        c = ex.emit("scale", name, [c], {"factor": beta}, shape=c.shape,
                    scope=scope)
    return ex.emit("add", name, [y, c], shape=out, scope=scope)


def _add_product_call(ex, call, bias):
    """torch.addmm(input, mat1, mat2, *, beta, alpha), baddbmm (batch1,
    batch2) and their methods (input the receiver)."""
    f = call.node.target
    batched = f in (torch.baddbmm, "baddbmm")
    names = ("batch1", "batch2") if batched else ("mat1", "mat2")
    what = f"Tensor.{f}" if isinstance(f, str) else f"torch.{f.__name__}"
    return add_product(ex, bias, call.tensor(1, names[0]),
                       call.tensor(2, names[1]), call.value(3, "beta", 1),
                       call.value(4, "alpha", 1), batched, what)


@registry.functions(torch.addmm, torch.baddbmm)
def _addmm(ex, call):
    return _add_product_call(ex, call, call.arg(0, "input"))


@registry.methods("addmm", "baddbmm", tensor_self=False)
def _addmm_method(ex, call):
    return _add_product_call(ex, call, call.args[0])


def outer(ex, a, b):
    """a[n] outer b[m]: a as [n, 1] times b as [1, m] (a broadcasting
    mul)."""
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    col = ex.reshape(f"{name}_a", a, (a.shape[0], 1), scope)
    row = ex.reshape(f"{name}_b", b, (1, b.shape[0]), scope)
    return ex.emit("mul", name, [col, row], shape=(a.shape[0], b.shape[0]),
                   scope=scope)


@registry.functions(torch.outer, torch.ger)
def _outer(ex, call):
    return outer(ex, call.tensor(0, "input"), call.tensor(1, "vec2"))


@registry.methods("outer", "ger")
def _outer_method(ex, call, x):
    return outer(ex, x, call.tensor(1, "vec2"))


# ---- einsum ----------------------------------------------------------------
#
# torch.einsum as the ops above and the layout ops: each operand's labels
# that nothing later needs are summed, then the operands are contracted
# left to right, two at a time, as one matmul (labels both share and still
# need: batch dims; shared labels no longer needed: the contracted dim;
# the others: rows and columns) or, with nothing to contract, a broadcasting
# mul; the result is transposed into the output's order.

_ELLIPSIS = "..."
# torch.einsum's sublist form: subscript k is the k-th of these letters.
_SUBLIST_LETTERS = string.ascii_uppercase + string.ascii_lowercase

# PyTorch has checked the equation against the operands while the module ran
# on the example inputs (tracing.Recorder): what is parsed here is valid.


def _einsum_equation(ex, args):
    """(equation, operand fx args) of einsum('ij,jk->ik', a, b),
    einsum('ij,jk', [a, b]) or the sublist form einsum(a, [0, 1], b,
    [1, 2], [0, 2])."""
    if isinstance(args[0], str):
        operands = list(args[1:])
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        return args[0], operands

    def letters(sub):
        return "".join(_ELLIPSIS if s is Ellipsis else _SUBLIST_LETTERS[s]
                       for s in ex.v(sub))

    pairs = args if len(args) % 2 == 0 else args[:-1]
    equation = ",".join(letters(s) for s in pairs[1::2])
    if len(args) % 2:
        equation += "->" + letters(args[-1])
    return equation, list(pairs[0::2])


def _einsum_subscripts(term):
    """The labels of one term: its letters, and _ELLIPSIS."""
    head, dots, tail = term.partition(_ELLIPSIS)
    return list(head) + ([_ELLIPSIS] if dots else []) + list(tail)


def _einsum_labels(ex, equation, ranks):
    """([the labels of each operand's dims], [the output's labels]): the
    letters, and for the dims '...' stands for the ints 0..n-1 of the
    longest '...' (right-aligned: '...' of fewer dims broadcasts)."""
    lhs, arrow, rhs = "".join(equation.split()).partition("->")
    terms = lhs.split(",")
    parsed = [_einsum_subscripts(t) for t in terms]
    widths = [rank - len(labels) + 1 if _ELLIPSIS in labels else 0
              for labels, rank in zip(parsed, ranks)]
    width = max(widths)
    operands = []
    for k, (term, labels) in enumerate(zip(terms, parsed)):
        dims = []
        for label in labels:
            if label == _ELLIPSIS:
                dims.extend(range(width - widths[k], width))
            else:  # a letter again in one operand: its diagonal
                dims.append(label)
        operands.append(dims)
    if arrow:
        out = []
        for label in _einsum_subscripts(rhs):
            if label in out:
                ex.fail(f"einsum '{equation}': subscript '{label}' appears "
                        f"more than once in the output")
            out.extend(range(width) if label == _ELLIPSIS else [label])
        return operands, out
    # Implicit: '...', then the letters used once, in ASCII order.
    seen = collections.Counter(d for dims in operands for d in dims
                               if isinstance(d, str))
    return operands, list(range(width)) + sorted(
        d for d, n in seen.items() if n == 1)


def _arrange(ex, name, t, labels, order, shape):
    """t (dims `labels`) transposed into `order` and reshaped to `shape`."""
    t = ex.transpose(name, t, [labels.index(d) for d in order], None)
    return ex.reshape(name, t, shape, None)


def _sum_unneeded(ex, name, t, labels, needed):
    """(t with its dims whose label is not `needed` summed, their labels)."""
    axes = [i for i, d in enumerate(labels) if d not in needed]
    if not axes:
        return t, labels
    kept = [i for i, d in enumerate(labels) if d in needed]
    return (ex.emit("sum", name, [t], {"axes": axes},
                    tuple(t.shape[i] for i in kept)),
            [labels[i] for i in kept])


def _contract(ex, name, a, la, b, lb, needed, size):
    """(a times b summed over the labels both have and `needed` lacks, its
    labels: the batch labels (both have them, `needed` too), a's own, b's
    own)."""
    batch = [d for d in la if d in lb and d in needed]
    summed = [d for d in la if d in lb and d not in needed]
    left = [d for d in la if d not in lb]
    right = [d for d in lb if d not in la]
    labels = batch + left + right
    shape = tuple(size[d] for d in labels)
    sizes = [size[d] for d in batch], [size[d] for d in left], \
        [size[d] for d in right]
    if not summed:  # nothing to contract: a broadcasting mul
        ta = _arrange(ex, f"{name}_a", a, la, batch + left,
                      sizes[0] + sizes[1] + [1] * len(right))
        tb = _arrange(ex, f"{name}_b", b, lb, batch + right,
                      sizes[0] + [1] * len(left) + sizes[2])
        return ex.emit("mul", name, [ta, tb], None, shape), labels
    k = math.prod(size[d] for d in summed)
    n = math.prod(sizes[2])
    if batch:
        rows = [math.prod(sizes[1])]
    else:  # a's own dims stay dims of its matmul (b is rank 2)
        rows = sizes[1] or [1]
    ta = _arrange(ex, f"{name}_a", a, la, batch + left + summed,
                  sizes[0] + rows + [k])
    tb = _arrange(ex, f"{name}_b", b, lb, batch + summed + right,
                  sizes[0] + [k, n])
    out = ex.emit("matmul", name, [ta, tb], None,
                  tuple(sizes[0] + rows + [n]))
    return ex.reshape(name, out, shape, None), labels


def _diagonal(ex, equation, k, name, t, labels):
    """(t with each letter that repeats in its `labels` kept once: the
    diagonal, as einsum('ii->i') takes it, its labels). A mul by an
    identity matrix over the two dims, then a sum over the second: no op
    of its own."""
    labels = list(labels)
    while True:
        p = next((i for i, d in enumerate(labels) if labels.index(d) < i),
                 None)
        if p is None:
            return t, labels
        first = labels.index(labels[p])
        n = t.shape[first]
        if t.shape[p] != n:
            ex.fail(f"einsum '{equation}': subscript '{labels[p]}' repeats "
                    f"in operand {k} with sizes {n} and {t.shape[p]}; a "
                    f"diagonal needs them equal")
        shape = [1] * len(labels)
        shape[first] = shape[p] = n
        eye = ex.const(torch.eye(n, dtype=torch.float64).reshape(shape), t,
                       what=f"the identity of einsum '{equation}'")
        t = ex.emit("mul", f"{name}_diagonal", [t, eye], None, tuple(t.shape))
        t = ex.emit("sum", f"{name}_diagonal", [t], {"axes": [p]},
                    tuple(n for i, n in enumerate(t.shape) if i != p))
        labels.pop(p)


def einsum(ex, equation, operands):
    """torch.einsum(equation, *operands) of IR tensors; fails naming the
    equation for what it cannot be (sizes that do not match)."""
    operands_labels, out = _einsum_labels(ex, equation,
                                          [len(t.shape) for t in operands])
    name = ex.base_name(ex.node)
    operands, operands_labels = map(list, zip(*(
        _diagonal(ex, equation, k, name, t, labels)
        for k, (t, labels) in enumerate(zip(operands, operands_labels)))))
    size = {}
    for t, labels in zip(operands, operands_labels):
        for label, n in zip(labels, t.shape):
            size[label] = max(size.get(label, 1), n)
    terms = []
    for t, labels in zip(operands, operands_labels):
        # A dim of size 1 where others have n broadcasts: dropped.
        kept = [d for d, n in zip(labels, t.shape) if n == size[d]]
        terms.append((ex.reshape(f"{name}_broadcast", t,
                                 [size[d] for d in kept], None), kept))
    t, labels = terms[0]
    for i, (u, lu) in enumerate(terms[1:], start=1):
        later = set(out).union(*(d for _, d in terms[i + 1:]))
        t, labels = _sum_unneeded(ex, f"{name}_sum", t, labels,
                                  later.union(lu))
        u, lu = _sum_unneeded(ex, f"{name}_sum", u, lu, later.union(labels))
        t, labels = _contract(ex, name, t, labels, u, lu, later, size)
    t, labels = _sum_unneeded(ex, f"{name}_sum", t, labels, set(out))
    return ex.transpose(name, t, [labels.index(d) for d in out], None)


@registry.functions(torch.einsum)
def _einsum(ex, call):
    equation, args = _einsum_equation(ex, call.args)
    return einsum(ex, equation, [ex.t(a) for a in args])
