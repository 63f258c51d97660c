"""Convolutions and pooling over NCHW images and NCDHW volumes
(planner/graph/ops_convolution.cc): conv2d and conv3d (grouped and
depthwise, dilated, zero padding), conv1d as conv2d over a height of 1,
conv_transpose1d/2d as a conv2d of the spread input, max_pool2d / 3d, avg_pool2d / 3d,
adaptive_avg_pool2d, adaptive_avg_pool3d to 1x1x1 (a mean over the
volume); F.interpolate / nn.Upsample (bilinear, nearest) as matmuls by
constant interpolation matrices."""

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import registry
from .ir import IrTensor
from .weight_norm import module_weight


def _axes(v, n):
    """An int or a 1- or n-element sequence as n per-axis ints."""
    if isinstance(v, (list, tuple)):
        v = [int(e) for e in v]
        return v * n if len(v) == 1 else v
    return [int(v)] * n


def _pair(v):
    """An int or a 1- or 2-element sequence as [h, w]."""
    return _axes(v, 2)


# ---- conv2d, conv3d --------------------------------------------------------

_LAYOUT = {2: "NCHW (rank-4)", 3: "NCDHW (rank-5)"}


def conv(ex, spatial, x, weight, bias, stride, padding, dilation, groups):
    """conv2d (spatial 2) or conv3d (3) of x by `weight` (+ `bias`, or
    None): module parameters or fx arguments; padding an int, a tuple,
    "valid" or "same"."""
    kind = f"conv{spatial}d"
    if len(x.shape) != spatial + 2:  # PyTorch also takes an unbatched input
        ex.fail(f"{kind} needs an {_LAYOUT[spatial]} input, got "
                f"{list(x.shape)}")
    w = weight if isinstance(weight, IrTensor) else ex.param(weight) \
        if isinstance(weight, torch.Tensor) else ex.t(weight)
    ins = [x, w]
    if bias is not None:
        ins.append(ex.param(bias) if isinstance(bias, torch.Tensor)
                   else ex.t(bias))
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0] * spatial
        else:  # 'same'
            # The dilated kernel's extent (k - 1) * d + 1 must be odd for
            # the padding to be equal on both sides.
            span = [(k - 1) * d for k, d in
                    zip(w.shape[2:], _axes(dilation, spatial))]
            if any(s % 2 for s in span) or \
                    _axes(stride, spatial) != [1] * spatial:
                ex.fail("padding='same' is supported for odd (dilated) "
                        "kernels and stride 1 only")
            padding = [s // 2 for s in span]
    attrs = {"stride": _axes(stride, spatial),
             "padding": _axes(padding, spatial)}
    if _axes(dilation, spatial) != [1] * spatial:
        attrs["dilation"] = _axes(dilation, spatial)
    if groups != 1:
        attrs["groups"] = int(groups)
    return ex.op(kind, ins, attrs)


def conv2d(ex, x, weight, bias, stride, padding, dilation, groups):
    return conv(ex, 2, x, weight, bias, stride, padding, dilation, groups)


@registry.modules(nn.Conv2d, nn.Conv3d)
def _conv_module(ex, call):
    mod = call.mod
    if mod.padding_mode != "zeros":
        ex.fail(f"padding_mode '{mod.padding_mode}' is not supported")
    return conv(ex, 3 if isinstance(mod, nn.Conv3d) else 2, call.x0(),
                module_weight(ex, mod, call.name, call.scope), mod.bias,
                mod.stride, mod.padding, mod.dilation, mod.groups)


# F.conv2d is torch.conv2d in PyTorch 1.13; both are listed for other versions.
def _conv_function(ex, call, f):
    """f(ex, input, weight, bias, stride, padding, dilation, groups) for a
    call of F.conv1d/2d/3d (torch.conv*d), whose arguments are those."""
    a = call.named(["input", "weight", "bias", "stride", "padding",
                    "dilation", "groups"],
                   {"bias": None, "stride": 1, "padding": 0,
                    "dilation": 1, "groups": 1})
    return f(ex, ex.t(a["input"]), a["weight"], a["bias"], ex.v(a["stride"]),
             ex.v(a["padding"]), ex.v(a["dilation"]), ex.v(a["groups"]))


@registry.functions(torch.conv2d, F.conv2d)
def _conv2d(ex, call):
    return _conv_function(ex, call, conv2d)


@registry.functions(torch.conv3d, F.conv3d)
def _conv3d(ex, call):
    return _conv_function(ex, call, lambda ex, *a: conv(ex, 3, *a))


def conv1d(ex, x, weight, bias, stride, padding, dilation, groups):
    """conv1d of x [n, c, l] as conv2d over a height of 1: x viewed as
    [n, c, 1, l] and the weight [o, c/groups, k] as [o, c/groups, 1, k] (the
    parameter keeps its PyTorch shape and name), the result [n, o, 1, l']
    viewed back. No op of its own: conv2d's kernels and sharding rules."""
    if len(x.shape) != 3:  # PyTorch also takes an unbatched [c, l]
        ex.fail(f"conv1d needs an NCL (rank-3) input, got {list(x.shape)}")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    w = weight if isinstance(weight, IrTensor) else ex.param(weight) \
        if isinstance(weight, torch.Tensor) else ex.t(weight)
    if len(w.shape) != 3:
        ex.fail(f"conv1d needs a rank-3 weight [out, in/groups, k], got "
                f"{list(w.shape)}")
    ins = [ex.reshape(f"{name}_input", x, (x.shape[0], x.shape[1], 1,
                                            x.shape[2]), scope),
           ex.reshape(f"{name}_weight", w, (w.shape[0], w.shape[1], 1,
                                             w.shape[2]), scope)]
    if bias is not None:
        ins.append(ex.param(bias) if isinstance(bias, torch.Tensor)
                   else ex.t(bias))
    stride, dilation = _axes(stride, 1)[0], _axes(dilation, 1)[0]
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        else:  # 'same'
            span = (w.shape[2] - 1) * dilation
            if span % 2 or stride != 1:
                ex.fail("padding='same' is supported for odd (dilated) "
                        "kernels and stride 1 only")
            padding = span // 2
    padding = _axes(padding, 1)[0]
    attrs = {"stride": [1, stride], "padding": [0, padding]}
    if dilation != 1:
        attrs["dilation"] = [1, dilation]
    if groups != 1:
        attrs["groups"] = int(groups)
    out = tuple(ex.out_shape())
    y = ex.emit("conv2d", name, ins, attrs, (out[0], out[1], 1, out[2]),
                ex.out_dtype(), scope=scope)
    return ex.reshape(name, y, out, scope)


@registry.modules(nn.Conv1d)
def _conv1d_module(ex, call):
    mod = call.mod
    if mod.padding_mode != "zeros":
        ex.fail(f"padding_mode '{mod.padding_mode}' is not supported")
    return conv1d(ex, call.x0(), module_weight(ex, mod, call.name, call.scope),
                  mod.bias, mod.stride, mod.padding, mod.dilation, mod.groups)


@registry.functions(torch.conv1d, F.conv1d)
def _conv1d(ex, call):
    return _conv_function(ex, call, conv1d)


# ---- conv_transpose1d, conv_transpose2d -------------------------------------


def _flip_last(ex, name, t, scope):
    """t reversed along its last axis: a matmul by the anti-identity."""
    k = t.shape[-1]
    if k == 1:
        return t
    flip = ex.const(torch.eye(k, dtype=torch.float64).flip(0), t,
                    "the reversal of a kernel axis")
    return ex.emit("matmul", name, [t, flip], shape=t.shape, scope=scope)


def conv_transpose(ex, spatial, x, weight, bias, stride, padding,
                   output_padding, groups, dilation):
    """ConvTranspose1d/2d as a conv2d: the input spread out by the stride
    and padded (each axis a matmul by a constant 0/1 matrix [in, spread],
    as F.interpolate's), convolved with stride 1 by the weight with its
    in and out channels swapped (per group) and its kernel reversed. Exact,
    PyTorch's gradients; the convolution runs over the zeros between the
    inputs, stride ** spatial times a direct transposed convolution's
    multiply-adds, and the spreading costs `in` multiply-adds an output."""
    kind = f"conv_transpose{spatial}d"
    if len(x.shape) != spatial + 2:
        ex.fail(f"{kind} needs a batched (rank-{spatial + 2}) input, got "
                f"{list(x.shape)}")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    w = weight if isinstance(weight, IrTensor) else ex.param(weight) \
        if isinstance(weight, torch.Tensor) else ex.t(weight)
    if len(w.shape) != spatial + 2:
        ex.fail(f"{kind} needs a rank-{spatial + 2} weight [in, out/groups, "
                f"kernel...], got {list(w.shape)}")
    groups = int(groups)
    cin, cout_g = w.shape[0], w.shape[1]
    if x.shape[1] != cin or cin % groups:
        ex.fail(f"{kind}: the input's {x.shape[1]} channels do not match "
                f"the weight's {cin} in {groups} groups")
    out = tuple(ex.out_shape())
    # As 2-D: a height of 1 for 1-D.
    if spatial == 1:
        x = ex.reshape(f"{name}_input", x, x.shape[:2] + (1,) + x.shape[2:],
                       scope)
        w = ex.reshape(f"{name}_weight", w, (cin, cout_g, 1, w.shape[2]),
                       scope)
        axes = list(zip([1] + _axes(stride, 1), [0] + _axes(padding, 1),
                        [0] + _axes(output_padding, 1),
                        [1] + _axes(dilation, 1)))
        want = out[:2] + (1,) + out[2:]
    else:
        axes = list(zip(_axes(stride, 2), _axes(padding, 2),
                        _axes(output_padding, 2), _axes(dilation, 2)))
        want = out
    kh, kw = w.shape[2], w.shape[3]
    sizes = []
    for (s, p, op, d), size, k in zip(axes, x.shape[2:], (kh, kw)):
        full = (size - 1) * s - 2 * p + d * (k - 1) + op + 1
        sizes.append(full)
    if tuple(want[2:]) != tuple(sizes):
        ex.fail(f"internal: {kind}'s output {list(want)} is not the "
                f"computed {sizes}")
    # The input spread by the stride and padded by d (k - 1) - p, axis by
    # axis (width, then height between transposes).
    t = x
    for axis in (3, 2):
        (s, p, _, d), size = axes[axis - 2], x.shape[axis]
        k = (kh, kw)[axis - 2]
        span = sizes[axis - 2] + d * (k - 1)
        shift = d * (k - 1) - p
        m = torch.zeros(size, span, dtype=torch.float64)
        for i in range(size):
            if 0 <= i * s + shift < span:
                m[i, i * s + shift] = 1.0
        if torch.equal(m, torch.eye(size, dtype=torch.float64)):
            continue
        spread = ex.const(m, x, f"the spreading of {kind}'s input")
        if axis == 2:
            t = ex.transpose(f"{name}_spread", t, [0, 1, 3, 2], scope)
        shape = t.shape[:3] + (span,)
        t = ex.emit("matmul", f"{name}_spread", [t, spread], shape=shape,
                    scope=scope)
        if axis == 2:
            t = ex.transpose(f"{name}_spread", t, [0, 1, 3, 2], scope)
    # The weight [in, out/g, kh, kw] as conv2d's [out, in/g, kh, kw], the
    # kernel reversed along both axes.
    cin_g = cin // groups
    v = ex.reshape(f"{name}_weight", w, (groups, cin_g, cout_g, kh, kw),
                   scope)
    v = ex.transpose(f"{name}_weight", v, [0, 2, 1, 3, 4], scope)
    v = ex.reshape(f"{name}_weight", v, (groups * cout_g, cin_g, kh, kw),
                   scope)
    v = _flip_last(ex, f"{name}_weight", v, scope)
    v = ex.transpose(f"{name}_weight", v, [0, 1, 3, 2], scope)
    v = _flip_last(ex, f"{name}_weight", v, scope)
    v = ex.transpose(f"{name}_weight", v, [0, 1, 3, 2], scope)
    ins = [t, v]
    if bias is not None:
        ins.append(ex.param(bias) if isinstance(bias, torch.Tensor)
                   else ex.t(bias))
    attrs = {"stride": [1, 1], "padding": [0, 0]}
    if (axes[0][3], axes[1][3]) != (1, 1):
        attrs["dilation"] = [axes[0][3], axes[1][3]]
    if groups != 1:
        attrs["groups"] = groups
    y = ex.emit("conv2d", name, ins, attrs, tuple(want), ex.out_dtype(),
                scope=scope)
    return ex.reshape(name, y, out, scope)


@registry.modules(nn.ConvTranspose1d, nn.ConvTranspose2d)
def _conv_transpose_module(ex, call):
    mod = call.mod
    if mod.padding_mode != "zeros":
        ex.fail(f"padding_mode '{mod.padding_mode}' is not supported")
    spatial = 1 if isinstance(mod, nn.ConvTranspose1d) else 2
    # forward(input, output_size=None): an output_size picks the
    # output_padding; the traced output shape is the one built.
    out = ex.out_shape()
    op = [o - ((i - 1) * s - 2 * p + d * (k - 1) + 1) for o, i, s, p, d, k in
          zip(out[2:], call.x0().shape[2:], mod.stride, mod.padding,
              mod.dilation, mod.kernel_size)]
    return conv_transpose(ex, spatial, call.x0(),
                          module_weight(ex, mod, call.name, call.scope),
                          mod.bias, mod.stride, mod.padding, op, mod.groups,
                          mod.dilation)


@registry.functions(F.conv_transpose1d, F.conv_transpose2d,
                    torch.conv_transpose1d, torch.conv_transpose2d)
def _conv_transpose(ex, call):
    spatial = 1 if call.node.target in (F.conv_transpose1d,
                                        torch.conv_transpose1d) else 2
    a = call.named(["input", "weight", "bias", "stride", "padding",
                    "output_padding", "groups", "dilation"],
                   {"bias": None, "stride": 1, "padding": 0,
                    "output_padding": 0, "groups": 1, "dilation": 1})
    return conv_transpose(ex, spatial, ex.t(a["input"]), a["weight"],
                          a["bias"], ex.v(a["stride"]), ex.v(a["padding"]),
                          ex.v(a["output_padding"]), ex.v(a["groups"]),
                          ex.v(a["dilation"]))


# ---- pooling ---------------------------------------------------------------


def _pool_attrs(ex, kind, x, kernel, stride, padding, ceil_mode, spatial=2):
    """The kernel, stride (default: the kernel), padding and ceil_mode
    attributes of a pooling op over `spatial` axes."""
    if len(x.shape) != spatial + 2:
        ex.fail(f"{kind} needs an {_LAYOUT[spatial]} input, got "
                f"{list(x.shape)}")
    if stride is None or (isinstance(stride, (list, tuple)) and
                          len(stride) == 0):
        stride = kernel
    attrs = {"kernel": _axes(kernel, spatial),
             "stride": _axes(stride, spatial),
             "padding": _axes(padding, spatial)}
    if any(2 * p > k for p, k in zip(attrs["padding"], attrs["kernel"])):
        ex.fail(f"{kind} padding must be at most half the kernel")
    if ceil_mode:
        attrs["ceil_mode"] = True
    return attrs


def max_pool2d(ex, x, kernel, stride, padding, dilation, ceil_mode,
               return_indices, spatial=2):
    """max_pool2d, or max_pool3d with spatial=3."""
    kind = f"max_pool{spatial}d"
    if _axes(dilation, spatial) != [1] * spatial or return_indices:
        ex.fail(f"{kind} with dilation or return_indices is not supported")
    return ex.op(kind, [x], _pool_attrs(
        ex, kind, x, kernel, stride, padding, ceil_mode, spatial))


def avg_pool2d(ex, x, kernel, stride, padding, ceil_mode, count_include_pad,
               divisor_override, spatial=2):
    """avg_pool2d, or avg_pool3d with spatial=3."""
    kind = f"avg_pool{spatial}d"
    if divisor_override is not None:
        ex.fail(f"{kind} with divisor_override is not supported")
    attrs = _pool_attrs(ex, kind, x, kernel, stride, padding, ceil_mode,
                        spatial)
    if not count_include_pad:
        attrs["count_include_pad"] = False
    return ex.op(kind, [x], attrs)


def adaptive_avg_pool2d(ex, x):
    """Average pooling to the traced output size."""
    if len(x.shape) != 4:
        ex.fail("adaptive_avg_pool2d needs an NCHW (rank-4) input")
    out = ex.out_shape()
    return ex.op("adaptive_avg_pool2d", [x],
                 {"output_size": [out[2], out[3]]})


@registry.modules(nn.MaxPool2d, nn.MaxPool3d)
def _max_pool_module(ex, call):
    mod = call.mod
    return max_pool2d(ex, call.x0(), mod.kernel_size, mod.stride, mod.padding,
                      mod.dilation, mod.ceil_mode, mod.return_indices,
                      3 if isinstance(mod, nn.MaxPool3d) else 2)


@registry.modules(nn.AvgPool2d, nn.AvgPool3d)
def _avg_pool2d_module(ex, call):
    mod = call.mod
    return avg_pool2d(ex, call.x0(), mod.kernel_size, mod.stride, mod.padding,
                      mod.ceil_mode, mod.count_include_pad,
                      mod.divisor_override,
                      3 if isinstance(mod, nn.AvgPool3d) else 2)


@registry.modules(nn.AdaptiveAvgPool2d)
def _adaptive_avg_pool2d_module(ex, call):
    return adaptive_avg_pool2d(ex, call.x0())


def _pool_function(ex, call, pool, names, defaults):
    """pool(ex, input, the other `names`' values) for a call of F.*_pool2d,
    whose parameters are `names` in order."""
    a = call.named(names, defaults)
    return pool(ex, ex.t(a["input"]), *(ex.v(a[k]) for k in names[1:]))


# F.max_pool1d/2d/3d's parameters in order, and their defaults.
_MAX_POOL_PARAMETERS = (
    ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
     "return_indices"],
    {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
     "return_indices": False})


@registry.functions(F.max_pool2d, torch.max_pool2d)
def _max_pool2d(ex, call):
    return _pool_function(ex, call, max_pool2d, *_MAX_POOL_PARAMETERS)


@registry.functions(F.avg_pool2d)
def _avg_pool2d(ex, call):
    return _pool_function(
        ex, call, avg_pool2d,
        ["input", "kernel_size", "stride", "padding", "ceil_mode",
         "count_include_pad", "divisor_override"],
        {"stride": None, "padding": 0, "ceil_mode": False,
         "count_include_pad": True, "divisor_override": None})


@registry.functions(F.max_pool3d, torch.max_pool3d)
def _max_pool3d(ex, call):
    return _pool_function(ex, call, functools.partial(max_pool2d, spatial=3),
                          *_MAX_POOL_PARAMETERS)


@registry.functions(F.avg_pool3d)
def _avg_pool3d(ex, call):
    return _pool_function(
        ex, call, functools.partial(avg_pool2d, spatial=3),
        ["input", "kernel_size", "stride", "padding", "ceil_mode",
         "count_include_pad", "divisor_override"],
        {"stride": None, "padding": 0, "ceil_mode": False,
         "count_include_pad": True, "divisor_override": None})


@registry.functions(F.adaptive_avg_pool2d)
def _adaptive_avg_pool2d(ex, call):
    return adaptive_avg_pool2d(ex, call.tensor(0, "input"))


# ---- 1-D pooling, adaptive max pooling, LP pooling ------------------------


def _pool1d(ex, kind, x, attrs):
    """A pooling of x [N, C, L] as its 2-D op (`kind`, `attrs` over the
    [1, L] plane) of x viewed as [N, C, 1, L], viewed back."""
    if len(x.shape) != 3:
        ex.fail(f"{kind.replace('2d', '1d')} needs an [N, C, L] input, got "
                f"{list(x.shape)} (unbatched input is not supported)")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    n, c, length = x.shape
    out = list(ex.out_shape())
    plane = ex.reshape(name, x, (n, c, 1, length), scope)
    y = ex.emit(kind, name, [plane], attrs, (n, c, 1, out[2]), scope=scope)
    return ex.op("reshape", [y], {"shape": out})


def _pool1d_attrs(kernel, stride, padding, ceil_mode):
    """A 1-D pooling's kernel, stride (default the kernel), padding as the
    2-D op's over a [1, L] plane."""
    k = _axes(kernel, 1)[0]
    s = k if stride is None or (isinstance(stride, (list, tuple)) and
                                len(stride) == 0) else _axes(stride, 1)[0]
    p = _axes(padding, 1)[0]
    attrs = {"kernel": [1, k], "stride": [1, s], "padding": [0, p]}
    if ceil_mode:
        attrs["ceil_mode"] = True
    return attrs, k, p


def max_pool1d(ex, x, kernel, stride, padding, dilation, ceil_mode,
               return_indices):
    """nn.MaxPool1d / F.max_pool1d as max_pool2d over [N, C, 1, L]."""
    if _axes(dilation, 1) != [1] or return_indices:
        ex.fail("max_pool1d with dilation or return_indices is not "
                "supported")
    attrs, k, p = _pool1d_attrs(kernel, stride, padding, ceil_mode)
    if 2 * p > k:
        ex.fail("max_pool1d padding must be at most half the kernel")
    return _pool1d(ex, "max_pool2d", x, attrs)


def avg_pool1d(ex, x, kernel, stride, padding, ceil_mode, count_include_pad):
    """nn.AvgPool1d / F.avg_pool1d as avg_pool2d over [N, C, 1, L]."""
    attrs, k, p = _pool1d_attrs(kernel, stride, padding, ceil_mode)
    if 2 * p > k:
        ex.fail("avg_pool1d padding must be at most half the kernel")
    if not count_include_pad:
        attrs["count_include_pad"] = False
    return _pool1d(ex, "avg_pool2d", x, attrs)


def adaptive_pool1d(ex, kind, x):
    """nn.AdaptiveAvgPool1d / AdaptiveMaxPool1d (`kind` "avg" or "max") to
    the traced output length: the 2-D adaptive average pooling, or a max
    pooling whose windows PyTorch's adaptive ones equal (the length a
    multiple of the output's)."""
    if len(x.shape) != 3:
        ex.fail(f"adaptive_{kind}_pool1d needs an [N, C, L] input, got "
                f"{list(x.shape)}")
    out = ex.out_shape()[2]
    if kind == "avg":
        return _pool1d(ex, "adaptive_avg_pool2d", x, {"output_size": [1, out]})
    length = x.shape[2]
    if length % out:
        ex.fail(f"adaptive_max_pool1d from {length} to {out} is not "
                f"supported (an output length that divides the input's "
                f"is)")
    k = length // out
    return _pool1d(ex, "max_pool2d", x,
                   {"kernel": [1, k], "stride": [1, k], "padding": [0, 0]})


def adaptive_max_pool2d(ex, x):
    """nn.AdaptiveMaxPool2d to the traced output size: a max_pool2d whose
    windows PyTorch's adaptive ones equal (each input size a multiple of
    the output's: to 1x1, global max pooling)."""
    if len(x.shape) != 4:
        ex.fail(f"adaptive_max_pool2d needs an NCHW (rank-4) input, got "
                f"{list(x.shape)}")
    out = list(ex.out_shape())[2:]
    if any(i % o for i, o in zip(x.shape[2:], out)):
        ex.fail(f"adaptive_max_pool2d from {list(x.shape[2:])} to {out} is "
                f"not supported (output sizes that divide the input's are)")
    k = [i // o for i, o in zip(x.shape[2:], out)]
    return ex.op("max_pool2d", [x], {"kernel": k, "stride": k,
                                     "padding": [0, 0]})


@registry.modules(nn.MaxPool1d)
def _max_pool1d_module(ex, call):
    mod = call.mod
    return max_pool1d(ex, call.x0(), mod.kernel_size, mod.stride,
                      mod.padding, mod.dilation, mod.ceil_mode,
                      mod.return_indices)


@registry.modules(nn.AvgPool1d)
def _avg_pool1d_module(ex, call):
    mod = call.mod
    return avg_pool1d(ex, call.x0(), mod.kernel_size, mod.stride,
                      mod.padding, mod.ceil_mode, mod.count_include_pad)


@registry.functions(F.max_pool1d, torch.max_pool1d)
def _max_pool1d(ex, call):
    return _pool_function(ex, call, max_pool1d, *_MAX_POOL_PARAMETERS)


@registry.functions(F.avg_pool1d, torch.avg_pool1d)
def _avg_pool1d(ex, call):
    return _pool_function(
        ex, call, avg_pool1d,
        ["input", "kernel_size", "stride", "padding", "ceil_mode",
         "count_include_pad"],
        {"stride": None, "padding": 0, "ceil_mode": False,
         "count_include_pad": True})


@registry.modules(nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)
def _adaptive_pool1d_module(ex, call):
    if getattr(call.mod, "return_indices", False):
        ex.fail("adaptive_max_pool1d with return_indices is not supported")
    kind = "avg" if isinstance(call.mod, nn.AdaptiveAvgPool1d) else "max"
    return adaptive_pool1d(ex, kind, call.x0())


@registry.functions(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d)
def _adaptive_avg_pool1d(ex, call):
    return adaptive_pool1d(ex, "avg", call.tensor(0, "input"))


@registry.functions(F.adaptive_max_pool1d)
def _adaptive_max_pool1d(ex, call):
    if ex.v(call.arg(2, "return_indices", False)):
        ex.fail("adaptive_max_pool1d with return_indices is not supported")
    return adaptive_pool1d(ex, "max", call.tensor(0, "input"))


@registry.modules(nn.AdaptiveMaxPool2d)
def _adaptive_max_pool2d_module(ex, call):
    if call.mod.return_indices:
        ex.fail("adaptive_max_pool2d with return_indices is not supported")
    return adaptive_max_pool2d(ex, call.x0())


@registry.functions(F.adaptive_max_pool2d)
def _adaptive_max_pool2d(ex, call):
    if ex.v(call.arg(2, "return_indices", False)):
        ex.fail("adaptive_max_pool2d with return_indices is not supported")
    return adaptive_max_pool2d(ex, call.tensor(0, "input"))


def adaptive_avg_pool3d(ex, x):
    """Average pooling of an NCDHW volume to 1x1x1 (the video classifiers'
    head): the mean over the volume, the IR's mean op with its rules and
    kernels. Other output sizes are refused."""
    if len(x.shape) != 5:
        ex.fail(f"adaptive_avg_pool3d needs an NCDHW (rank-5) input, got "
                f"{list(x.shape)}")
    out = list(ex.out_shape())
    if out[2:] != [1, 1, 1]:
        ex.fail(f"adaptive_avg_pool3d to {out[2:]} is not supported (to "
                f"1x1x1 is)")
    return ex.op("mean", [x], {"axes": [2, 3, 4], "keepdims": True})


@registry.modules(nn.AdaptiveAvgPool3d)
def _adaptive_avg_pool3d_module(ex, call):
    return adaptive_avg_pool3d(ex, call.x0())


@registry.functions(F.adaptive_avg_pool3d)
def _adaptive_avg_pool3d(ex, call):
    return adaptive_avg_pool3d(ex, call.tensor(0, "input"))


# ---- interpolation ---------------------------------------------------------


def _interpolation_matrix(mode, align_corners, n_in, n_out, scale):
    """[n_in, n_out]: column o holds the weights output o of one axis takes
    of the inputs, as PyTorch's upsample kernels compute them (`scale` the
    input step per output step PyTorch uses when the corners are not
    aligned: 1 / scale_factor when one was given, else n_in / n_out)."""
    m = torch.zeros(n_in, n_out, dtype=torch.float64)
    if mode == "nearest":
        # PyTorch's nearest_idx: the same size is the identity, twice the
        # size halves, else floor(o * scale) in float32, capped at n_in - 1.
        for o in range(n_out):
            if n_out == n_in:
                i = o
            elif n_out == 2 * n_in:
                i = o >> 1
            else:
                f = torch.tensor(o, dtype=torch.float32) * torch.tensor(
                    scale, dtype=torch.float32)
                i = min(int(torch.floor(f)), n_in - 1)
            m[i, o] = 1.0
        return m
    for o in range(n_out):  # linear along this axis
        if align_corners:
            src = o * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
        else:
            src = max(scale * (o + 0.5) - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        i1 = i0 + 1 if i0 < n_in - 1 else i0
        l1 = src - i0
        m[i0, o] += 1.0 - l1
        m[i1, o] += l1
    return m


def interpolate(ex, x, size, scale_factor, mode, align_corners,
                recompute_scale_factor, antialias):
    """F.interpolate of an NCHW image, mode 'bilinear' or 'nearest': each
    spatial axis is linear in the input, so the result is two matmuls by
    constant interpolation matrices (width, then height, the height one
    between transposes). Output size as PyTorch traced it."""
    if len(x.shape) != 4:
        ex.fail(f"interpolate needs an NCHW (rank-4) input, got "
                f"{list(x.shape)}")
    if mode not in ("bilinear", "nearest"):
        ex.fail(f"interpolate mode '{mode}' is not supported (bilinear and "
                f"nearest are)")
    if antialias:
        ex.fail("interpolate with antialias=True is not supported")
    if mode == "nearest" and align_corners:
        ex.fail("align_corners is only for the linear modes")
    out = ex.out_shape()
    n, c, h, w = x.shape
    oh, ow = out[2], out[3]
    scales = [h / oh, w / ow]
    if scale_factor is not None and not recompute_scale_factor:
        sf = scale_factor if isinstance(scale_factor, (list, tuple)) \
            else [scale_factor, scale_factor]
        scales = [1.0 / float(s) for s in sf]
    name = ex.base_name(ex.node)
    scope = ex.scope_of(ex.node)
    t = x  # an axis whose matrix is the identity is left as it is
    mw = _interpolation_matrix(mode, align_corners, w, ow, scales[1])
    if not torch.equal(mw, torch.eye(w, dtype=torch.float64)):
        k = ex.const(mw, x, "the interpolation matrix of the width")
        t = ex.emit("matmul", name, [t, k], shape=(n, c, h, ow), scope=scope)
    mh = _interpolation_matrix(mode, align_corners, h, oh, scales[0])
    if not torch.equal(mh, torch.eye(h, dtype=torch.float64)):
        k = ex.const(mh, x, "the interpolation matrix of the height")
        t = ex.transpose(name, t, [0, 1, 3, 2], scope)
        t = ex.emit("matmul", name, [t, k], shape=(n, c, ow, oh),
                    scope=scope)
        t = ex.transpose(name, t, [0, 1, 3, 2], scope)
    return t


@registry.functions(F.interpolate)
def _interpolate(ex, call):
    a = call.named(["input", "size", "scale_factor", "mode", "align_corners",
                    "recompute_scale_factor", "antialias"],
                   {"size": None, "scale_factor": None, "mode": "nearest",
                    "align_corners": None, "recompute_scale_factor": None,
                    "antialias": False})
    return interpolate(ex, ex.t(a["input"]), None, ex.v(a["scale_factor"]),
                       ex.v(a["mode"]), bool(ex.v(a["align_corners"])),
                       ex.v(a["recompute_scale_factor"]),
                       ex.v(a["antialias"]))


# nn.UpsamplingBilinear2d and nn.UpsamplingNearest2d are subclasses.
@registry.modules(nn.Upsample)
def _upsample_module(ex, call):
    mod = call.mod
    return interpolate(ex, call.x0(), mod.size, mod.scale_factor, mod.mode,
                       bool(mod.align_corners),
                       getattr(mod, "recompute_scale_factor", None), False)
