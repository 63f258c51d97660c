"""Element-wise ops (planner/graph/ops_elementwise.cc): activations, dropout
and stochastic depth (drop_path), and arithmetic with tensors and constants
(add, sub, mul, div, neg; a multiplication by a constant is a scale)."""

import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import registry
from .ir import IrTensor, RowMax, is_causal_mask
from .tracing import is_stochastic_depth

# ---- activations -----------------------------------------------------------


def activation(ex, act, name, x, scope):
    """The IR op of activation `act`: a function (F.relu ...) or a module
    (nn.ReLU() ..., e.g. a transformer layer's activation); the activations
    that are no IR op (nn.LeakyReLU, nn.GELU(approximate='tanh') ...) as
    their composition (composed_activation)."""
    kind = None
    if act in (F.relu, torch.relu) or isinstance(act, nn.ReLU):
        kind = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and
                           act.approximate == "none"):
        kind = "gelu"
    elif act in (torch.sigmoid, F.sigmoid) or isinstance(act, nn.Sigmoid):
        kind = "sigmoid"
    elif act in (torch.tanh, F.tanh) or isinstance(act, nn.Tanh):
        kind = "tanh"
    elif act is F.silu or isinstance(act, nn.SiLU):
        kind = "silu"
    elif act is F.relu6 or isinstance(act, nn.ReLU6):
        kind = "relu6"
    elif isinstance(act, nn.Hardtanh) and (act.min_val, act.max_val) == (0, 6):
        kind = "relu6"
    elif act is F.hardsigmoid or isinstance(act, nn.Hardsigmoid):
        kind = "hardsigmoid"
    elif act is F.hardswish or isinstance(act, nn.Hardswish):
        kind = "hardswish"
    if kind is None:
        composed = composed_activation(act)
        if composed is not None:
            return composed(Emitter(ex, name, scope), x)
        ex.fail(f"activation {act!r} is not supported (relu, gelu, "
                f"sigmoid, tanh, silu, relu6, hardsigmoid, hardswish, "
                f"leaky_relu, elu, selu, celu, softplus, mish, logsigmoid, "
                f"softsign, tanhshrink)")
    return ex.emit(kind, name, [x], None, x.shape, scope=scope)


@registry.modules(nn.ReLU, nn.GELU, nn.Sigmoid, nn.Tanh, nn.SiLU, nn.ReLU6,
                  nn.Hardsigmoid, nn.Hardswish, nn.LeakyReLU, nn.ELU, nn.SELU,
                  nn.CELU, nn.Softplus, nn.Mish, nn.LogSigmoid, nn.Softsign,
                  nn.Tanhshrink)
def _activation_module(ex, call):
    return activation(ex, call.mod, call.name, call.x0(), call.scope)


def _activation_function(ex, call, act):
    return activation(ex, act, ex.base_name(call.node),
                      call.tensor(0, "input"), ex.scope_of(call.node))


# torch.relu_ (F.relu_) changes its input in place; tracing.follow_inplace
# makes the later uses of the input take its result.
@registry.functions(F.relu, torch.relu, torch.relu_)
def _relu(ex, call):
    return _activation_function(ex, call, F.relu)


@registry.functions(F.gelu)
def _gelu(ex, call):
    approximate = call.value(1, "approximate", "none")
    if approximate == "tanh":
        return gelu_tanh(Emitter(ex, ex.base_name(call.node),
                                 ex.scope_of(call.node)),
                         call.tensor(0, "input"))
    if approximate != "none":
        ex.fail(f"gelu(approximate={approximate!r}) is not supported "
                f"('none' and 'tanh' are)")
    return _activation_function(ex, call, F.gelu)


@registry.functions(F.silu, F.relu6, F.hardsigmoid, F.hardswish)
def _other_activation(ex, call):
    return _activation_function(ex, call, call.node.target)


def hardtanh(ex, x, low, high, name, scope):
    """relu6 for (0, 6), else a clamp to [low, high]."""
    if (low, high) == (0, 6):
        return ex.emit("relu6", name, [x], None, x.shape, scope=scope)
    return clamp(ex, x, low, high, name, scope)


@registry.functions(F.hardtanh)
def _hardtanh(ex, call):
    return hardtanh(ex, call.tensor(0, "input"), call.value(1, "min_val", -1.0),
                    call.value(2, "max_val", 1.0), ex.base_name(call.node),
                    ex.scope_of(call.node))


# nn.ReLU6 is a Hardtanh too: the more specific handler above takes it.
@registry.modules(nn.Hardtanh)
def _hardtanh_module(ex, call):
    return hardtanh(ex, call.x0(), call.mod.min_val, call.mod.max_val,
                    call.name, call.scope)


def prelu(ex, x, weight, name, scope):
    """PReLU: relu(x) + a * (x - relu(x)), with `a` (one value, or one per
    channel of dim 1) broadcast over the other dims."""
    a = ex.param(weight) if isinstance(weight, torch.Tensor) else ex.t(weight)
    if len(a.shape) != 1 or (a.shape[0] != 1 and (
            len(x.shape) < 2 or a.shape[0] != x.shape[1])):
        ex.fail(f"prelu's weight {list(a.shape)} is neither one value nor "
                f"one per channel of {list(x.shape)}")
    if len(x.shape) >= 2:
        a = ex.reshape(f"{name}_weight", a, (1, a.shape[0]) +
                       (1,) * (len(x.shape) - 2), scope)
    pos = ex.emit("relu", name, [x], None, x.shape, scope=scope)
    neg = ex.emit("sub", name, [x, pos], None, x.shape, scope=scope)
    neg = ex.emit("mul", name, [neg, a], None, x.shape, scope=scope)
    return ex.emit("add", name, [pos, neg], None, x.shape, scope=scope)


@registry.modules(nn.PReLU)
def _prelu_module(ex, call):
    return prelu(ex, call.x0(), call.mod.weight, call.name, call.scope)


@registry.functions(F.prelu, torch.prelu)
def _prelu(ex, call):
    return prelu(ex, call.tensor(0, "input"), call.arg(1, "weight"),
                 ex.base_name(call.node), ex.scope_of(call.node))


def glu(ex, x, dim, name, scope):
    """GLU: a * sigmoid(b) for the two halves a, b of x along `dim` (a
    split, a sigmoid and a mul)."""
    # ops_shape imports ops_lstm, which imports this module.
    from .ops_shape import split  # noqa: PLC0415
    rank = len(x.shape)
    if not -rank <= dim < rank or x.shape[dim] % 2:
        ex.fail(f"glu over dim {dim} of {list(x.shape)} needs an even size")
    a, b = split(ex, x, 2, dim % rank, True)
    gate = ex.emit("sigmoid", name, [b], None, b.shape, scope=scope)
    return ex.emit("mul", name, [a, gate], None, a.shape, scope=scope)


@registry.modules(nn.GLU)
def _glu_module(ex, call):
    return glu(ex, call.x0(), call.mod.dim, call.name, call.scope)


@registry.functions(F.glu)
def _glu(ex, call):
    return glu(ex, call.tensor(0, "input"), call.value(1, "dim", -1),
               ex.base_name(call.node), ex.scope_of(call.node))


@registry.functions(torch.sigmoid, F.sigmoid)
def _sigmoid(ex, call):
    return ex.op("sigmoid", [call.tensor(0, "input")])


@registry.functions(torch.tanh, F.tanh)
def _tanh(ex, call):
    return ex.op("tanh", [call.tensor(0, "input")])


@registry.methods("relu", "sigmoid", "tanh")
def _activation_method(ex, call, x):
    return ex.op(call.node.target, [x])


# ---- activations composed of IR ops ----------------------------------------


class Emitter:
    """Emits the element-wise ops of one node (its name and scope), each
    output of the inputs' broadcast shape."""

    def __init__(self, ex, name, scope):
        self.ex, self.name, self.scope = ex, name, scope

    def __call__(self, kind, *inputs, **attrs):
        shape = tuple(torch.broadcast_shapes(*(tuple(t.shape)
                                               for t in inputs)))
        return self.ex.emit(kind, self.name, list(inputs), attrs or None,
                            shape=shape, scope=self.scope)

    def scale(self, x, factor):
        """factor * x (x itself for 1)."""
        return x if factor == 1 else self("scale", x, factor=float(factor))

    def plus(self, x, c):
        """x + the constant c (x itself for 0)."""
        return x if c == 0 else self("add", x, self.ex.const(float(c), x))

    def abs(self, x):
        """|x| as relu(x) + relu(-x): PyTorch's values, and its gradient
        sign(x) (0 at 0)."""
        return self("add", self("relu", x),
                    self("relu", self.scale(x, -1)))

    def reduce(self, x, reduction):
        """A loss's reduction of its element-wise terms x: 'none' (x),
        'mean', 'sum' or 'batchmean' (the sum over the first dim's size)."""
        if reduction == "none":
            return x
        if reduction == "batchmean":
            total = self.ex.emit("sum", self.name, [x], None, (),
                                 scope=self.scope)
            return self.scale(total, 1.0 / x.shape[0]) if x.shape else total
        return self.ex.emit(reduction, self.name, [x], None, (),
                            scope=self.scope)


def abs_(c, x):
    return c.abs(x)


def maximum(c, a, b):
    """max(a, b) = b + relu(a - b) (at a tie the gradient goes to b; PyTorch
    halves it between the two, a set of measure zero)."""
    return c("add", b, c("relu", c("sub", a, b)))


def minimum(c, a, b):
    """min(a, b) = a - relu(a - b) (a tie as maximum's)."""
    return c("sub", a, c("relu", c("sub", a, b)))


def softplus(c, x, beta=1.0, threshold=20.0):
    """log(1 + exp(beta x)) / beta in its stable form 0.5 (z + |z|) +
    log(1 + exp(-|z|)) for z = beta x (0.5 (z + |z|) is relu(z) exactly,
    and its gradient 0.5 at z = 0 makes the whole gradient sigmoid(z)
    there too). PyTorch returns x itself where z > threshold: the
    composition is log(1 + exp(-z)) / beta above it there, under
    exp(-20) / beta = 2.1e-9 / beta for the default 20 (below float32's
    rounding of values > 20 / beta); a threshold under 20 is refused."""
    if beta <= 0 or not math.isfinite(beta):
        c.ex.fail(f"softplus with beta={beta} is not supported (a finite "
                  f"beta > 0)")
    if threshold < 20:
        c.ex.fail(f"softplus with threshold={threshold} is not supported "
                  f"(>= 20: PyTorch's linear part above the threshold "
                  f"differs from the smooth composition by up to "
                  f"log(1 + exp(-threshold)) / beta)")
    z = c.scale(x, beta)
    a = c.abs(z)
    tail = c("log", c.plus(c("exp", c.scale(a, -1)), 1.0))
    y = c("add", c.scale(c("add", z, a), 0.5), tail)
    return c.scale(y, 1.0 / beta)


def leaky_relu(c, x, slope=0.01):
    """relu(x) + slope * (x - relu(x)): PyTorch's values exactly, and its
    gradient (slope at 0)."""
    r = c("relu", x)
    return c("add", r, c.scale(c("sub", x, r), slope))


def elu(c, x, alpha=1.0, input_scale=1.0, output_scale=1.0):
    """PyTorch's elu: output_scale * (relu(x) + alpha * (exp(input_scale *
    min(x, 0)) - 1)) with min(x, 0) = x - relu(x); its values and gradient
    (at 0 too). selu and celu are elus."""
    r = c("relu", x)
    e = c("exp", c.scale(c("sub", x, r), input_scale))
    y = c("add", r, c.scale(c.plus(e, -1.0), alpha))
    return c.scale(y, output_scale)


# torch/nn/functional.py's and ATen's selu constants.
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def selu(c, x):
    return elu(c, x, _SELU_ALPHA, 1.0, _SELU_SCALE)


def celu(c, x, alpha=1.0):
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1)): elu with input scale
    1 / alpha (PyTorch's gradient takes 1 / alpha rounded to float32, a
    relative 1e-8 from this exact one where that rounds)."""
    if alpha == 0:
        c.ex.fail("celu with alpha=0 is not supported (PyTorch refuses it)")
    return elu(c, x, alpha, 1.0 / alpha)


def mish(c, x):
    """x * tanh(softplus(x))."""
    return c("mul", x, c("tanh", softplus(c, x)))


def logsigmoid(c, x):
    """log(sigmoid(x)) = -softplus(-x), stable for any x."""
    return c.scale(softplus(c, c.scale(x, -1)), -1)


def softsign(c, x):
    """x / (1 + |x|), the division as `reciprocal`."""
    return c("mul", x, reciprocal(c.ex, c.plus(c.abs(x), 1.0), c.name,
                                  c.scope))


def tanhshrink(c, x):
    """x - tanh(x)."""
    return c("sub", x, c("tanh", x))


def gelu_tanh(c, x):
    """gelu(approximate='tanh'), PyTorch's formula: 0.5 x (1 + tanh(sqrt(2 /
    pi) (x + 0.044715 x^3)))."""
    cube = power(c.ex, x, 3, c.name, c.scope)
    inner = c("add", x, c.scale(cube, 0.044715))
    t = c("tanh", c.scale(inner, math.sqrt(2.0 / math.pi)))
    return c.scale(c("mul", x, c.plus(t, 1.0)), 0.5)


def composed_activation(act):
    """fn(c, x) composing activation `act` (a module, or a function with
    its default arguments) of IR ops, or None."""
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return gelu_tanh
    if isinstance(act, nn.LeakyReLU):
        return lambda c, x: leaky_relu(c, x, act.negative_slope)
    if isinstance(act, nn.ELU):
        return lambda c, x: elu(c, x, act.alpha)
    if isinstance(act, nn.CELU):
        return lambda c, x: celu(c, x, act.alpha)
    if isinstance(act, nn.Softplus):
        return lambda c, x: softplus(c, x, act.beta, act.threshold)
    for cls, fn in ((nn.SELU, selu), (nn.Mish, mish),
                    (nn.LogSigmoid, logsigmoid), (nn.Softsign, softsign),
                    (nn.Tanhshrink, tanhshrink)):
        if isinstance(act, cls):
            return fn
    return _COMPOSED_FUNCTIONS.get(act, (None,))[0]


# function -> (composition, [(its argument, position, default)]).
_COMPOSED_FUNCTIONS = {
    F.leaky_relu: (leaky_relu, [("negative_slope", 1, 0.01)]),
    F.elu: (elu, [("alpha", 1, 1.0)]),
    F.selu: (selu, []), torch.selu: (selu, []),
    F.celu: (celu, [("alpha", 1, 1.0)]),
    torch.celu: (celu, [("alpha", 1, 1.0)]),
    F.softplus: (softplus, [("beta", 1, 1.0), ("threshold", 2, 20.0)]),
    F.mish: (mish, []), F.logsigmoid: (logsigmoid, []),
    F.softsign: (softsign, []), F.tanhshrink: (tanhshrink, []),
}


@registry.functions(*_COMPOSED_FUNCTIONS)
def _composed_function(ex, call):
    fn, params = _COMPOSED_FUNCTIONS[call.node.target]
    args = [call.value(i, name, default) for name, i, default in params]
    return fn(Emitter(ex, ex.base_name(call.node), ex.scope_of(call.node)),
              call.tensor(0, "input"), *args)


# operator.abs: abs(x), which fx records from torch 2 on.
@registry.functions(torch.abs, operator.abs)
def _abs(ex, call):
    return abs_(Emitter(ex, ex.base_name(call.node), ex.scope_of(call.node)),
                call.tensor(0, "input"))


@registry.methods("abs", "abs_")
def _abs_method(ex, call, x):
    return abs_(Emitter(ex, ex.base_name(call.node), ex.scope_of(call.node)),
                x)


def _maximum_or_minimum(ex, call, kind, a, b):
    fn = maximum if kind == "maximum" else minimum
    return fn(Emitter(ex, ex.base_name(call.node), ex.scope_of(call.node)),
              ex.t(a), ex.t(b))


@registry.functions(torch.maximum, torch.minimum)
def _maximum_function(ex, call):
    return _maximum_or_minimum(ex, call, call.node.target.__name__,
                               call.arg(0, "input"), call.arg(1, "other"))


@registry.methods("maximum", "minimum")
def _maximum_method(ex, call, x):
    return _maximum_or_minimum(ex, call, call.node.target, call.args[0],
                               call.arg(1, "other"))


def softmin(ex, x, dim, dtype=None):
    """softmin(x) = softmax(-x) over dim."""
    # ops_normalization imports nothing of this module, but keeps its
    # softmax beside the others.
    from .ops_normalization import _same_dtype, softmax  # noqa: PLC0415
    _same_dtype(ex, "softmin", dtype, x)
    neg = ex.emit("scale", ex.base_name(ex.node), [x], {"factor": -1.0},
                  shape=x.shape, scope=ex.scope_of(ex.node))
    return softmax(ex, "softmax", neg, dim)


@registry.modules(nn.Softmin)
def _softmin_module(ex, call):
    return softmin(ex, call.x0(), call.mod.dim)


@registry.functions(F.softmin)
def _softmin(ex, call):
    return softmin(ex, call.tensor(0, "input"), call.value(1, "dim", None),
                   call.value(3, "dtype", None))


# ---- exp, rsqrt, clamp, normalize ------------------------------------------


@registry.functions(torch.exp, torch.rsqrt)
def _exp_or_rsqrt(ex, call):
    return ex.op(call.node.target.__name__, [call.tensor(0, "input")])


@registry.methods("exp", "rsqrt")
def _exp_or_rsqrt_method(ex, call, x):
    return ex.op(call.node.target, [x])


# ---- pow, square, sqrt ---------------------------------------------------


def reciprocal(ex, y, name, scope):
    """1 / y for a tensor y (the IR has no division by a tensor): y *
    rsqrt(y * y)^2, which keeps y's sign. PyTorch's values to rounding
    while y * y neither overflows nor underflows (1e-19 < |y| < 1e19 in
    float32 and bf16); 1 / 0 is NaN (PyTorch's: inf)."""
    yy = ex.emit("mul", name, [y, y], shape=y.shape, scope=scope)
    r = ex.emit("rsqrt", name, [yy], shape=y.shape, scope=scope)
    rr = ex.emit("mul", name, [r, r], shape=y.shape, scope=scope)
    return ex.emit("mul", name, [y, rr], shape=y.shape, scope=scope)


def _integer_power(ex, x, n, name, scope):
    """x ** n for an integer n >= 1 by repeated squaring (about 2 log2 n
    muls): PyTorch's values for any sign of x, to rounding."""
    result, base = None, x
    while n:
        if n & 1:
            result = base if result is None else ex.emit(
                "mul", name, [result, base], shape=x.shape, scope=scope)
        n >>= 1
        if n:
            base = ex.emit("mul", name, [base, base], shape=x.shape,
                           scope=scope)
    return result


def power(ex, x, p, name, scope):
    """x ** p for a tensor x and a constant exponent p (the IR has no pow
    op): an integer p as muls (a negative one as 1 / x^n, that is
    `reciprocal` of x^n), -0.5 as
    rsqrt, any other p as exp(p * log x). The values are PyTorch's wherever
    it gives one: a non-integer p of a negative x is NaN in both, x = 0
    gives 0 (p > 0) or inf (p < 0); at x = 0 the gradient of a fractional
    or negative p is NaN where PyTorch's is inf or 0."""
    if isinstance(p, torch.Tensor):
        if p.numel() != 1:
            ex.fail("pow with a tensor exponent is not supported (only a "
                    "constant number)")
        p = p.item()
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        ex.fail(f"pow's exponent {p!r} is not a number")
    p = float(p)
    if not math.isfinite(p):
        ex.fail(f"pow's exponent {p} is not finite")
    if p == 0:
        ex.fail("x ** 0 is not supported (it is 1 everywhere: write the "
                "constant)")
    if p == 1:
        return x
    if p == int(p):
        y = _integer_power(ex, x, abs(int(p)), name, scope)
        return y if p > 0 else reciprocal(ex, y, name, scope)
    if p == -0.5:
        return ex.emit("rsqrt", name, [x], shape=x.shape, scope=scope)
    logx = ex.emit("log", name, [x], shape=x.shape, scope=scope)
    scaled = ex.emit("scale", name, [logx], {"factor": p}, shape=x.shape,
                     scope=scope)
    return ex.emit("exp", name, [scaled], shape=x.shape, scope=scope)


def _pow(ex, call, base, exponent):
    name, scope = ex.base_name(call.node), ex.scope_of(call.node)
    if not ex.is_static(exponent):
        if ex.is_static(base):
            # c ** x = exp(x ln c) for a constant c > 0.
            c = ex.v(base)
            if isinstance(c, torch.Tensor) and c.numel() == 1:
                c = c.item()
            if isinstance(c, bool) or not isinstance(c, (int, float)) or \
                    not math.isfinite(c) or c <= 0:
                ex.fail(f"{c!r} ** x is supported for a finite base > 0 "
                        f"only")
            x = ex.t(exponent)
            if c == 1:
                ex.fail("1 ** x is not supported (it is 1 everywhere: "
                        "write the constant)")
            scaled = ex.emit("scale", name, [x], {"factor": math.log(c)},
                             shape=x.shape, scope=scope)
            return ex.emit("exp", name, [scaled], shape=x.shape, scope=scope)
        ex.fail("pow with a tensor exponent is not supported (only a "
                "constant number)")
    return power(ex, ex.t(base), ex.v(exponent), name, scope)


@registry.functions(operator.pow, operator.ipow, torch.pow)
def _pow_function(ex, call):
    return _pow(ex, call, call.args[0], call.arg(1, "exponent"))


@registry.methods("pow", "pow_", "__pow__")
def _pow_method(ex, call, x):
    return _pow(ex, call, call.args[0], call.arg(1, "exponent"))


@registry.functions(torch.reciprocal)
def _reciprocal(ex, call):
    return reciprocal(ex, call.tensor(0, "input"), ex.base_name(call.node),
                      ex.scope_of(call.node))


@registry.methods("reciprocal", "reciprocal_")
def _reciprocal_method(ex, call, x):
    return reciprocal(ex, x, ex.base_name(call.node), ex.scope_of(call.node))


# square and sqrt: pow with a fixed exponent.
_FIXED_POWERS = {torch.square: 2, "square": 2, "square_": 2,
                 torch.sqrt: 0.5, "sqrt": 0.5, "sqrt_": 0.5}


@registry.functions(torch.square, torch.sqrt)
def _fixed_power(ex, call):
    return _fixed_power_method(ex, call, call.tensor(0, "input"))


@registry.methods("square", "square_", "sqrt", "sqrt_")
def _fixed_power_method(ex, call, x):
    return power(ex, x, _FIXED_POWERS[call.node.target],
                 ex.base_name(call.node), ex.scope_of(call.node))


# ---- log, log10, log2, log1p -----------------------------------------------

# log_b(x) = ln(x) / ln(b): the natural log then a scale.
_LOG_FACTORS = {"log": 1.0, "log10": 1.0 / math.log(10.0),
                "log2": 1.0 / math.log(2.0)}


def log(ex, x, kind, name, scope):
    """torch.log (`kind` "log"), log10, log2 or log1p of x: one log op, then
    a scale by 1 / ln(base) for log10 and log2; log1p as log(1 + x) (not
    PyTorch's accurate form for tiny x, the same to rounding elsewhere)."""
    if kind == "log1p":
        x = ex.emit("add", name, [x, ex.const(1.0, x)], shape=x.shape,
                    scope=scope)
    y = ex.emit("log", name, [x], shape=x.shape, scope=scope)
    factor = _LOG_FACTORS.get(kind, 1.0)
    if factor == 1.0:
        return y
    return ex.emit("scale", name, [y], {"factor": factor}, shape=x.shape,
                   scope=scope)


@registry.functions(torch.log, torch.log10, torch.log2, torch.log1p)
def _log(ex, call):
    return log(ex, call.tensor(0, "input"), call.node.target.__name__,
               ex.base_name(call.node), ex.scope_of(call.node))


@registry.methods("log", "log10", "log2", "log1p")
def _log_method(ex, call, x):
    return log(ex, x, call.node.target, ex.base_name(call.node),
               ex.scope_of(call.node))


def clamp(ex, x, low, high, name, scope):
    """x clamped to the constants [low, high] (None: no bound) as
    low + relu(x - low) and high - relu(high - x): PyTorch's values, and its
    gradient but at the bounds themselves (measure zero)."""
    for bound, is_low in ((low, True), (high, False)):
        if bound is None:
            continue
        if isinstance(bound, torch.Tensor):
            if bound.numel() != 1:
                ex.fail("clamp with tensor bounds is not supported")
            bound = bound.item()
        if not isinstance(bound, (int, float)) or isinstance(bound, bool) \
                or not math.isfinite(bound):
            ex.fail(f"clamp's bound {bound!r} is not a finite number")
        c = ex.const(float(bound), x)
        diff = ex.emit("sub", name, [x, c] if is_low else [c, x],
                       shape=x.shape, scope=scope)
        over = ex.emit("relu", name, [diff], shape=x.shape, scope=scope)
        x = ex.emit("add" if is_low else "sub", name,
                    [over, c] if is_low else [c, over], shape=x.shape,
                    scope=scope)
    return x


@registry.functions(torch.clamp, torch.clip)
def _clamp(ex, call):
    return clamp(ex, call.tensor(0, "input"), call.value(1, "min", None),
                 call.value(2, "max", None), ex.base_name(call.node),
                 ex.scope_of(call.node))


@registry.methods("clamp", "clip")
def _clamp_method(ex, call, x):
    return clamp(ex, x, call.value(1, "min", None), call.value(2, "max", None),
                 ex.base_name(call.node), ex.scope_of(call.node))


@registry.methods("clamp_min", "clamp_max")
def _clamp_one_side(ex, call, x):
    bound = call.value(1, call.node.target[-3:])
    low, high = (bound, None) if call.node.target == "clamp_min" \
        else (None, bound)
    return clamp(ex, x, low, high, ex.base_name(call.node),
                 ex.scope_of(call.node))


@registry.functions(F.normalize)
def _normalize(ex, call):
    """F.normalize(x, p=2, dim): x / max(||x||, eps) as
    x * rsqrt(max(sum(x * x), eps^2)) over `dim` (the same values and
    gradient; torchvision's Swin V2 cosine attention)."""
    x = call.tensor(0, "input")
    p, dim = call.value(1, "p", 2.0), call.value(2, "dim", 1)
    eps = float(call.value(3, "eps", 1e-12))
    if p != 2:
        ex.fail(f"F.normalize with p={p} is not supported (p=2 only)")
    rank = len(x.shape)
    if not -rank <= dim < rank:
        ex.fail(f"F.normalize's dim {dim} is outside the {rank} axes")
    axis = dim % rank
    name, scope = ex.base_name(call.node), ex.scope_of(call.node)
    square = ex.emit("mul", name, [x, x], shape=x.shape, scope=scope)
    kept = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    total = ex.emit("sum", name, [square], {"axes": [axis],
                                            "keepdims": True},
                    shape=kept, scope=scope)
    total = clamp(ex, total, eps * eps, None, name, scope)
    inverse = ex.emit("rsqrt", name, [total], shape=kept, scope=scope)
    return ex.emit("mul", name, [x, inverse], shape=x.shape, scope=scope)


# ---- dropout and stochastic depth ------------------------------------------


def dropout(ex, p, name, x, scope):
    """Dropout with probability p (training mode: the IR is one training
    step); x itself for p = 0."""
    if p == 0:
        return x
    if p == 1:
        # Every element dropped: zeros, and no gradient, as PyTorch's (the
        # IR's dropout takes p in [0, 1): the graph did not validate).
        return ex.emit("scale", name, [x], {"factor": 0.0}, x.shape,
                       scope=scope)
    return ex.emit("dropout", name, [x], {"p": float(p)}, x.shape,
                   scope=scope)


# Only nn.Dropout itself: its subclasses (and Dropout1d/2d/3d, AlphaDropout)
# drop other things than single elements.
@registry.modules(nn.Dropout, exact=True)
def _dropout_module(ex, call):
    return dropout(ex, call.mod.p, call.name, call.x0(), call.scope)


@registry.functions(F.dropout)
def _dropout(ex, call):
    p, training = call.value(1, "p", 0.5), call.value(2, "training", True)
    x = call.tensor(0, "input")
    return dropout(ex, p if training else 0, ex.base_name(call.node), x,
                   ex.scope_of(call.node))


@registry.functions_matching(is_stochastic_depth)
def _stochastic_depth(ex, call):
    """torchvision.ops.stochastic_depth as one drop_path op."""
    a = call.named(["input", "p", "mode", "training"], {"training": True})
    x = ex.t(a["input"])
    p, mode = float(ex.v(a["p"])), ex.v(a["mode"])
    if mode not in ("row", "batch"):
        ex.fail(f"stochastic_depth mode '{mode}' is not supported")
    if not ex.v(a["training"]) or p == 0:
        return x
    if p >= 1:
        ex.fail("stochastic_depth with p=1 (every sample dropped) "
                "is not supported")
    return ex.op("drop_path", [x], {"p": p, "mode": mode})


# ---- arithmetic ------------------------------------------------------------


def binary(ex, kind, a, b, alpha=1):
    """a <kind> b for fx arguments a, b (tensors or constants, not both
    constants): an op of two tensors, a scale or an identity for a scalar
    factor or a zero term, else the constant as a frozen parameter. A
    constant causal mask added to scores marks them for the softmax."""
    if alpha != 1:
        ex.fail("alpha != 1 is not supported")
    sa, sb = ex.is_static(a), ex.is_static(b)
    if sa and sb:
        ex.fail("internal: constant arithmetic reached the exporter")
    if not sa and not sb:
        shift = ex.env.get(b) if isinstance(b, fx.Node) else None
        if kind == "sub" and isinstance(shift, RowMax):
            # x - x.max(dim, keepdim=True)[0]: x itself for the softmax
            # over dim that must follow (which it does not change).
            ta = ex.t(a)
            if ta.name != shift.x.name:
                ex.fail(f"subtracts the maximum of '{shift.x.name}' from "
                        f"'{ta.name}': supported only from the tensor "
                        f"itself, before a softmax")
            return IrTensor(ta.name, ta.shape, ta.dtype, ta.causal, ta.mask,
                            shifted=shift.dim)
        ta, tb = ex.t(a), ex.t(b)
        if kind == "div":
            return ex.op("mul", [ta, reciprocal(ex, tb, ex.base_name(ex.node),
                                                ex.scope_of(ex.node))])
        return ex.op(kind, [ta, tb])
    x, c, x_first = (b, a, False) if sa else (a, b, True)
    cv = ex.v(c)
    if isinstance(cv, torch.Tensor) and cv.dim() == 0:
        cv = cv.item()
    if isinstance(cv, torch.Tensor):
        xt = ex.t(x)
        # Only scores the mask does not broadcast (x + mask has x's shape):
        # [B, 1, S] + [S, S] (one query) is [B, S, S] in PyTorch; marking
        # the [B, 1, S] scores causal gave a softmax that `hapctl validate`
        # refused, after exit status 0.
        if kind == "add" and len(xt.shape) >= 2 and \
                tuple(ex.out_shape()) == tuple(xt.shape) and \
                is_causal_mask(cv, xt.shape[-2], xt.shape[-1]) and \
                cv.is_floating_point():
            return xt.with_mask(causal=True)
        what = (f"the buffer '{ex.pub(c.target)}'"
                if isinstance(c, fx.Node) and c.op == "get_attr"
                else f"'{getattr(c, 'name', c)}'")
        if kind == "div" and not x_first:
            # c / x: c * (1 / x).
            ct = ex.const(cv, xt, what) if not cv.is_floating_point() \
                else ex.t(c)
            return ex.op("mul", [ct, reciprocal(ex, xt, ex.base_name(ex.node),
                                                ex.scope_of(ex.node))])
        if kind == "div":
            # The IR has no div op (it was emitted, and `hapctl validate`
            # refused it): x * (1 / c), the reciprocal a constant too.
            if (cv == 0).any():
                ex.fail("divides by a constant tensor holding 0")
            ct = ex.const(1.0 / cv.double(), xt, what)
            return ex.op("mul", [xt, ct])
        if not cv.is_floating_point() and xt.dtype != "INT64":
            # An integer or bool constant: PyTorch computes in x's dtype
            # (the constant was an INT64 parameter the IR refuses).
            ct = ex.const(cv, xt, what)
        else:
            ct = ex.t(c)
        return ex.op(kind, [xt, ct] if x_first else [ct, xt])
    if not isinstance(cv, (int, float)) or isinstance(cv, bool):
        ex.fail(f"cannot {kind} a {type(cv).__name__}")
    xt = ex.t(x)
    cv = float(cv)
    if not math.isfinite(cv) or (kind == "div" and cv != 0 and
                                 not math.isfinite(1.0 / cv)):
        # A scale by inf/NaN (hapctl validate: "'factor' must be finite").
        ex.fail(f"{kind} by the non-finite constant {cv} (or its "
                f"reciprocal) is not supported")
    if kind == "mul":
        return xt if cv == 1 else ex.op("scale", [xt],
                                            {"factor": cv})
    if kind == "div":
        if not x_first:
            # c / x: (1 / x) scaled by c.
            r = reciprocal(ex, xt, ex.base_name(ex.node), ex.scope_of(ex.node))
            return r if cv == 1 else ex.op("scale", [r], {"factor": cv})
        if cv == 0:
            ex.fail("divides by the constant 0")
        return xt if cv == 1 else ex.op("scale", [xt],
                                            {"factor": 1.0 / cv})
    if kind in ("add", "sub") and cv == 0:
        if kind == "sub" and not x_first:
            return ex.op("scale", [xt], {"factor": -1.0})
        return xt
    ct = ex.const(cv, xt)
    return ex.op(kind, [xt, ct] if x_first else [ct, xt])


@registry.functions(operator.add, operator.iadd, torch.add)
def _add(ex, call):
    return binary(ex, "add", call.args[0], call.arg(1, "other"),
                  ex.v(call.kwargs.get("alpha", 1)))


@registry.functions(operator.sub, operator.isub, torch.sub)
def _sub(ex, call):
    return binary(ex, "sub", call.args[0], call.arg(1, "other"),
                  ex.v(call.kwargs.get("alpha", 1)))


@registry.functions(operator.mul, operator.imul, torch.mul)
def _mul(ex, call):
    return binary(ex, "mul", call.args[0], call.arg(1, "other"))


@registry.functions(operator.truediv, operator.itruediv, torch.div)
def _div(ex, call):
    if call.kwargs.get("rounding_mode") is not None:
        ex.fail("rounding division is not supported")
    return binary(ex, "div", call.args[0], call.arg(1, "other"))


@registry.methods("add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_",
                  "__add__", "__mul__")
def _arithmetic_method(ex, call, x):
    kind = call.node.target.strip("_")
    other = call.arg(1, "other")
    if kind == "div" and call.kwargs.get("rounding_mode") is not None:
        ex.fail("rounding division is not supported")
    return binary(ex, kind, call.args[0], other,
                  ex.v(call.kwargs.get("alpha", 1)))


@registry.functions(operator.neg, torch.neg)
def _neg(ex, call):
    return ex.op("scale", [call.tensor(0, "input")], {"factor": -1.0})


@registry.methods("neg")
def _neg_method(ex, call, x):
    return ex.op("scale", [x], {"factor": -1.0})
