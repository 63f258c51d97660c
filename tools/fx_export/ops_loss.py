"""Losses (planner/graph/ops_loss.cc): nll_loss on log-probabilities and
cross_entropy on logits, [n, c] scores against [n] class targets, averaged
over the batch (reduction='mean', PyTorch's default, only). Scores
[n, c, d1, ...] against targets [n, d1, ...] (a segmentation's per-pixel
loss) are the [n * d1 * ..., c] rows of the scores with their class last:
PyTorch's mean over every position. mse_loss and l1_loss ('mean' or
'sum') are element-wise ops and a mean or sum."""

import torch.nn as nn
import torch.nn.functional as F

from . import registry


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
    if label_smoothing:
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
    return ex.op(kind, [x, y])


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


def regression_loss(ex, kind, input_arg, target_arg, reduction):
    """F.mse_loss / F.l1_loss ('mean' or 'sum') of same-shaped tensors:
    the difference squared (a mul) or its absolute value (relu(d) +
    relu(-d), PyTorch's gradient, 0 at 0), then mean or sum."""
    x, y = ex.t(input_arg), ex.t(target_arg)
    if reduction not in ("mean", "sum"):
        ex.fail(f"{kind} with reduction='{reduction}' is not supported "
                f"('mean' and 'sum' are)")
    if x.shape != y.shape:
        ex.fail(f"{kind} of {list(x.shape)} and {list(y.shape)}: broadcast "
                f"shapes are not supported (PyTorch warns of them too)")
    if y.dtype == "INT64" or x.dtype == "INT64":
        ex.fail(f"{kind} needs floating-point input and target")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    d = ex.emit("sub", name, [x, y], None, x.shape, scope=scope)
    if kind == "mse_loss":
        e = ex.emit("mul", name, [d, d], None, x.shape, scope=scope)
    else:
        pos = ex.emit("relu", name, [d], None, x.shape, scope=scope)
        neg = ex.emit("relu", name, [ex.emit("scale", name, [d],
                                             {"factor": -1.0}, x.shape,
                                             scope=scope)],
                      None, x.shape, scope=scope)
        e = ex.emit("add", name, [pos, neg], None, x.shape, scope=scope)
    return ex.emit(reduction, name, [e], None, (), scope=scope)


@registry.modules(nn.MSELoss, nn.L1Loss)
def _regression_loss_module(ex, call):
    kind = "mse_loss" if isinstance(call.mod, nn.MSELoss) else "l1_loss"
    args = call.bound()  # also loss(y, target=...), as cross_entropy's
    return regression_loss(ex, kind, args["input"], args["target"],
                           call.mod.reduction)


@registry.functions(F.mse_loss, F.l1_loss)
def _regression_loss(ex, call):
    kind = "mse_loss" if call.node.target is F.mse_loss else "l1_loss"
    a = call.named(["input", "target", "size_average", "reduce",
                    "reduction"],
                   {"size_average": None, "reduce": None,
                    "reduction": "mean"})
    if ex.v(a["size_average"]) is not None or ex.v(a["reduce"]) is not None:
        ex.fail(f"{kind}'s deprecated size_average/reduce are not "
                f"supported (use reduction=)")
    return regression_loss(ex, kind, a["input"], a["target"],
                           ex.v(a["reduction"]))
