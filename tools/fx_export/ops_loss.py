"""Losses (planner/graph/ops_loss.cc): nll_loss on log-probabilities and
cross_entropy on logits, [n, c] scores against [n] class targets, averaged
over the batch (reduction='mean', PyTorch's default, only). Scores
[n, c, d1, ...] against targets [n, d1, ...] (a segmentation's per-pixel
loss) are the [n * d1 * ..., c] rows of the scores with their class last:
PyTorch's mean over every position. cross_entropy's label_smoothing adds
a log_softmax's mean. mse_loss and l1_loss ('mean' or 'sum'), smooth_l1_loss,
huber_loss, binary_cross_entropy_with_logits and kl_div ('none' too) are
compositions of element-wise ops and a mean or sum."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import registry
from .ops_elementwise import Emitter, softplus


def loss(ex, kind, input_arg, target_arg, weight, ignore_index, reduction,
         label_smoothing):
    """The `kind` loss op of fx arguments input_arg and target_arg; the
    other arguments must have PyTorch's defaults."""
    x, y = ex.t(input_arg), ex.t(target_arg)
    if weight is not None:
        ex.fail(f"{kind} with class weights is not supported")
    if reduction != "mean":
        ex.fail(f"{kind} with reduction='{reduction}' is not supported "
                f"(only 'mean')")
    if ignore_index != -100:
        ex.fail(f"{kind} with ignore_index={ignore_index} is not "
                f"supported")
    if label_smoothing and kind != "cross_entropy":
        ex.fail(f"{kind} with label_smoothing is not supported")
    if (len(x.shape) >= 3 and len(y.shape) == len(x.shape) - 1
            and y.dtype == "INT64" and x.shape[0] == y.shape[0]
            and x.shape[2:] == y.shape[1:]):
        name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
        rows = 1
        for d in y.shape:
            rows *= d
        perm = [0] + list(range(2, len(x.shape))) + [1]
        x = ex.reshape(name, ex.transpose(name, x, perm, scope),
                       (rows, x.shape[1]), scope)
        y = ex.reshape(name, y, (rows,), scope)
    if len(x.shape) != 2 or len(y.shape) != 1 or y.dtype != "INT64":
        ex.fail(f"{kind} needs [n, c] scores and [n] integer class "
                f"targets, got {list(x.shape)} and {list(y.shape)} "
                f"({y.dtype}); reshape with .view(-1, C) / .view(-1)")
    if label_smoothing:
        return smoothed_cross_entropy(ex, x, y, label_smoothing)
    return ex.op(kind, [x, y])


def smoothed_cross_entropy(ex, x, y, eps):
    """cross_entropy with label_smoothing eps of [n, c] logits and [n] class
    targets: PyTorch's (1 - eps) * CE + eps * the mean over the rows of
    -sum_c log_softmax / c, i.e. eps * the mean of -log_softmax over every
    element (a cross_entropy, a log_softmax and a mean)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or \
            not 0.0 <= eps <= 1.0:
        ex.fail(f"cross_entropy's label_smoothing {eps!r} is not a number "
                f"in [0, 1]")
    c = Emitter(ex, ex.base_name(ex.node), ex.scope_of(ex.node))
    ce = ex.emit("cross_entropy", c.name, [x, y], None, (), scope=c.scope)
    logp = ex.emit("log_softmax", c.name, [x], None, x.shape, scope=c.scope)
    smooth = ex.emit("mean", c.name, [logp], None, (), scope=c.scope)
    return c("add", c.scale(ce, 1.0 - eps), c.scale(smooth, -eps))


@registry.modules(nn.NLLLoss, nn.CrossEntropyLoss)
def _loss_module(ex, call):
    mod, args = call.mod, call.bound()  # also loss(input=..., target=...)
    kind = "nll_loss" if isinstance(mod, nn.NLLLoss) else "cross_entropy"
    return loss(ex, kind, args["input"], args["target"], mod.weight,
                mod.ignore_index,
                mod.reduction, getattr(mod, "label_smoothing", 0.0))


@registry.functions(F.nll_loss, F.cross_entropy)
def _loss(ex, call):
    kind = "nll_loss" if call.node.target is F.nll_loss else "cross_entropy"
    a = call.named(["input", "target", "weight", "size_average",
                    "ignore_index", "reduce", "reduction", "label_smoothing"],
                   {"weight": None, "size_average": None,
                    "ignore_index": -100, "reduce": None,
                    "reduction": "mean", "label_smoothing": 0.0})
    if a["size_average"] is not None or a["reduce"] is not None:
        ex.fail("the deprecated size_average/reduce arguments are "
                "not supported")
    return loss(ex, kind, a["input"], a["target"], ex.v(a["weight"]),
                ex.v(a["ignore_index"]), ex.v(a["reduction"]),
                ex.v(a["label_smoothing"]))


# ---- regression losses -----------------------------------------------------


def _pair(ex, kind, input_arg, target_arg, reduction, reductions):
    """(x, y, Emitter) of a loss of same-shaped floating-point tensors whose
    reduction is one of `reductions`."""
    x, y = ex.t(input_arg), ex.t(target_arg)
    if reduction not in reductions:
        named = ", ".join(f"'{r}'" for r in reductions[:-1])
        ex.fail(f"{kind} with reduction='{reduction}' is not supported "
                f"({named} and '{reductions[-1]}' are)")
    if x.shape != y.shape:
        ex.fail(f"{kind} of {list(x.shape)} and {list(y.shape)}: broadcast "
                f"shapes are not supported (PyTorch warns of them too)")
    if y.dtype == "INT64" or x.dtype == "INT64":
        ex.fail(f"{kind} needs floating-point input and target")
    return x, y, Emitter(ex, ex.base_name(ex.node), ex.scope_of(ex.node))


def regression_loss(ex, kind, input_arg, target_arg, reduction):
    """F.mse_loss / F.l1_loss ('mean' or 'sum') of same-shaped tensors:
    the difference squared (a mul) or its absolute value (relu(d) +
    relu(-d), PyTorch's gradient, 0 at 0), then mean or sum."""
    x, y, c = _pair(ex, kind, input_arg, target_arg, reduction,
                    ("mean", "sum"))
    d = c("sub", x, y)
    e = c("mul", d, d) if kind == "mse_loss" else c.abs(d)
    return c.reduce(e, reduction)


@registry.modules(nn.MSELoss, nn.L1Loss)
def _regression_loss_module(ex, call):
    kind = "mse_loss" if isinstance(call.mod, nn.MSELoss) else "l1_loss"
    args = call.bound()  # also loss(y, target=...), as cross_entropy's
    return regression_loss(ex, kind, args["input"], args["target"],
                           call.mod.reduction)


def _no_deprecated(ex, kind, a):
    if ex.v(a.get("size_average")) is not None or \
            ex.v(a.get("reduce")) is not None:
        ex.fail(f"{kind}'s deprecated size_average/reduce are not "
                f"supported (use reduction=)")


@registry.functions(F.mse_loss, F.l1_loss)
def _regression_loss(ex, call):
    kind = "mse_loss" if call.node.target is F.mse_loss else "l1_loss"
    a = call.named(["input", "target", "size_average", "reduce",
                    "reduction"],
                   {"size_average": None, "reduce": None,
                    "reduction": "mean"})
    _no_deprecated(ex, kind, a)
    return regression_loss(ex, kind, a["input"], a["target"],
                           ex.v(a["reduction"]))


# ---- smooth L1 and Huber ---------------------------------------------------

_REDUCTIONS = ("none", "mean", "sum")


def huber(ex, kind, input_arg, target_arg, reduction, delta, divide):
    """Huber loss with `delta` of the difference d (divided by delta for
    smooth_l1_loss, `divide`): 0.5 m^2 + delta r with r = relu(|d| - delta)
    and m = min(|d|, delta) = |d| - r (|d| itself below delta). PyTorch's
    values and gradient; smooth_l1_loss with beta 0 is l1_loss."""
    x, y, c = _pair(ex, kind, input_arg, target_arg, reduction, _REDUCTIONS)
    what = "beta" if divide else "delta"
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or \
            not math.isfinite(delta) or delta < 0 or \
            (delta == 0 and not divide):
        ex.fail(f"{kind} with {what}={delta!r} is not supported (a finite "
                f"{what} > 0{'' if not divide else ', or 0'}; PyTorch "
                f"refuses a negative one)")
    a = c.abs(c("sub", x, y))
    if delta == 0:
        return c.reduce(a, reduction)
    r = c("relu", c.plus(a, -delta))
    m = c("sub", a, r)
    k = 1.0 / delta if divide else 1.0
    e = c("add", c.scale(c("mul", m, m), 0.5 * k), c.scale(r, delta * k))
    return c.reduce(e, reduction)


@registry.modules(nn.SmoothL1Loss, nn.HuberLoss)
def _huber_module(ex, call):
    args, mod = call.bound(), call.mod
    if isinstance(mod, nn.SmoothL1Loss):
        return huber(ex, "smooth_l1_loss", args["input"], args["target"],
                     mod.reduction, mod.beta, True)
    return huber(ex, "huber_loss", args["input"], args["target"],
                 mod.reduction, mod.delta, False)


@registry.functions(F.smooth_l1_loss)
def _smooth_l1(ex, call):
    a = call.named(["input", "target", "size_average", "reduce",
                    "reduction", "beta"],
                   {"size_average": None, "reduce": None,
                    "reduction": "mean", "beta": 1.0})
    _no_deprecated(ex, "smooth_l1_loss", a)
    return huber(ex, "smooth_l1_loss", a["input"], a["target"],
                 ex.v(a["reduction"]), ex.v(a["beta"]), True)


@registry.functions(F.huber_loss)
def _huber(ex, call):
    a = call.named(["input", "target", "reduction", "delta"],
                   {"reduction": "mean", "delta": 1.0})
    return huber(ex, "huber_loss", a["input"], a["target"],
                 ex.v(a["reduction"]), ex.v(a["delta"]), False)


# ---- binary cross-entropy --------------------------------------------------


def bce_with_logits(ex, input_arg, target_arg, reduction, weight,
                    pos_weight):
    """binary_cross_entropy_with_logits: softplus(x) - x y (softplus in its
    stable form, ops_elementwise.softplus), PyTorch's values and gradient
    sigmoid(x) - y; without weight and pos_weight."""
    kind = "binary_cross_entropy_with_logits"
    for arg, value in (("weight", weight), ("pos_weight", pos_weight)):
        if value is not None:
            ex.fail(f"{kind} with {arg} is not supported (only "
                    f"{arg}=None)")
    x, y, c = _pair(ex, kind, input_arg, target_arg, reduction, _REDUCTIONS)
    e = c("sub", softplus(c, x), c("mul", x, y))
    return c.reduce(e, reduction)


@registry.modules(nn.BCEWithLogitsLoss)
def _bce_with_logits_module(ex, call):
    args, mod = call.bound(), call.mod
    return bce_with_logits(ex, args["input"], args["target"], mod.reduction,
                           mod.weight, mod.pos_weight)


@registry.functions(F.binary_cross_entropy_with_logits)
def _bce_with_logits(ex, call):
    a = call.named(["input", "target", "weight", "size_average", "reduce",
                    "reduction", "pos_weight"],
                   {"weight": None, "size_average": None, "reduce": None,
                    "reduction": "mean", "pos_weight": None})
    _no_deprecated(ex, "binary_cross_entropy_with_logits", a)
    return bce_with_logits(ex, a["input"], a["target"], ex.v(a["reduction"]),
                           ex.v(a["weight"]), ex.v(a["pos_weight"]))


@registry.modules(nn.BCELoss)
@registry.functions(F.binary_cross_entropy)
def _bce(ex, call):
    ex.fail("binary_cross_entropy (nn.BCELoss) on probabilities is not "
            "supported: PyTorch clamps its logs at -100, and that clamp "
            "composed of IR ops (which have no comparison) gives a NaN "
            "gradient where p is exactly 0 or 1 (a float32 sigmoid of a "
            "logit above 17), where PyTorch's is finite; use "
            "nn.BCEWithLogitsLoss / F.binary_cross_entropy_with_logits on "
            "the logits")


# ---- KL divergence ---------------------------------------------------------


def kl_div(ex, input_arg, target_arg, reduction, log_target):
    """F.kl_div of log-probabilities `input`: exp(t) (t - input) for a
    log_target t; t log t - t input for a probability target t known at
    export (t log t, 0 at t = 0, is then a constant: as a composition it
    would be 0 * -inf = NaN there). Reductions 'batchmean' (the sum over
    the batch size), 'mean', 'sum', 'none'."""
    kind = "kl_div"
    reductions = ("batchmean",) + _REDUCTIONS
    if log_target:
        x, t, c = _pair(ex, kind, input_arg, target_arg, reduction,
                        reductions)
        e = c("mul", c("exp", t), c("sub", t, x))
        return c.reduce(e, reduction)
    if not ex.is_static(target_arg):
        ex.fail("kl_div with log_target=False is supported only for a "
                "target known at export (a constant): t * log(t) is NaN at "
                "t = 0 as a composition of IR ops, PyTorch's 0; pass "
                "log-probabilities with log_target=True")
    t = ex.v(target_arg)
    x = ex.t(input_arg)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(x.shape):
        ex.fail(f"kl_div's constant target must be a tensor of the input's "
                f"shape {list(x.shape)}")
    x, tc, c = _pair(ex, kind, input_arg, target_arg, reduction, reductions)
    xlogx = ex.const(torch.xlogy(t.double(), t.double()), x)
    e = c("sub", xlogx, c("mul", tc, x))
    return c.reduce(e, reduction)


@registry.modules(nn.KLDivLoss)
def _kl_div_module(ex, call):
    args, mod = call.bound(), call.mod
    return kl_div(ex, args["input"], args["target"], mod.reduction,
                  mod.log_target)


@registry.functions(F.kl_div)
def _kl_div(ex, call):
    a = call.named(["input", "target", "size_average", "reduce",
                    "reduction", "log_target"],
                   {"size_average": None, "reduce": None,
                    "reduction": "mean", "log_target": False})
    _no_deprecated(ex, "kl_div", a)
    return kl_div(ex, a["input"], a["target"], ex.v(a["reduction"]),
                  ex.v(a["log_target"]))
