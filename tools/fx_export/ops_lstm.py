"""Recurrent layers (planner/graph/ops_lstm.cc): nn.LSTM and nn.GRU as one
lstm or gru op per layer and direction, and their final hidden state h_n;
nn.RNN (tanh, relu), and nn.GRU given an initial state h_0 other than
zeros (the gru op starts from zeros; zeros made in forward, as tutorials
write h0 = torch.zeros(...), are that state), unrolled over the sequence into linear, add, mul, sub,
sigmoid, tanh, relu and layout ops (no op of their own).

The unrolled graph grows with the sequence length S: per layer and
direction one linear projects the input of every step, then each step is
OPS_PER_STEP ops (6 for nn.RNN, 18 for nn.GRU), so a 2-layer bidirectional
GRU over 64 steps is some 4,600 ops. Planning time grows faster than the op
count (hapctl plan --baseline dp-even on 2 cores: 4 s for that GRU, 16 s
over 128 steps, 9,200 ops; over 256 steps, 18,400 ops, 54 s with one
training step), so an export that would unroll into more than
MAX_UNROLLED_OPS ops fails naming the module and its step count (nn.LSTM,
and nn.GRU from the zero state, one op a layer and direction, take long
sequences). Other nn.RNNBase modules fail naming themselves."""

import functools

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from . import registry
from .ir import LstmState, Static, join
from .ops_elementwise import dropout


def _zero_value(v):
    """Whether `v` (an argument's value at export) is None or tensors of
    zeros only: a constant forward made (torch.zeros(L, x.size(0), H),
    x.new_zeros(...)), which starts the recurrence as the default state
    does."""
    if v is None:
        return True
    if isinstance(v, (tuple, list)):
        return len(v) > 0 and all(_zero_value(u) for u in v)
    return isinstance(v, torch.Tensor) and not v.is_meta and \
        v.numel() > 0 and not bool(torch.any(v != 0))


def _is_zero_state(ex, hx):
    """Whether the initial state argument `hx` is PyTorch's default zero
    state: left out (None), or (h_0[, c_0]) known at export to be all
    zeros, as tutorials write it (h0 = torch.zeros(num_layers, x.size(0),
    hidden)). A state computed from the inputs or parameters is not."""
    if hx is None:
        return True
    if isinstance(hx, (tuple, list)):
        return len(hx) > 0 and all(_is_zero_state(ex, h) for h in hx)
    if not isinstance(hx, fx.Node):
        return _zero_value(hx)
    v = ex.env[hx]
    return isinstance(v, Static) and _zero_value(v.value)


def _refuse_packed(ex, what, input_arg):
    """Fails naming `what` when the input is a PackedSequence."""
    v = ex.env.get(input_arg) if isinstance(input_arg, fx.Node) else \
        Static(input_arg)
    if isinstance(v, (tuple, list)) or (
            isinstance(v, Static) and isinstance(v.value, PackedSequence)):
        ex.fail(f"{what}: packed sequences are not supported (pad them "
                f"to one length)")


def lstm(ex, mod, path, input_arg, hx, op="lstm"):
    """nn.LSTM (op "lstm") or nn.GRU (op "gru", from the zero state) as one
    such op per layer and direction (the reverse one with attribute
    reverse, the two outputs concatenated), dropout between layers,
    transposes around a sequence-first stack. Returns (output, (h_n, c_n))
    for nn.LSTM, (output, h_n) for nn.GRU; h_n[k] is a slice of layer k's
    output, c_n unsupported."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    scope = ex.scope_of(ex.node)
    what = "nn.LSTM" if op == "lstm" else "nn.GRU"
    if not _is_zero_state(ex, hx):
        ex.fail(f"nn.LSTM '{path}' with an initial state (h_0, c_0) is "
                f"not supported; only the default zero state is (left "
                f"out, or zeros made in forward)")
    if getattr(mod, "proj_size", 0):
        ex.fail(f"nn.LSTM '{path}' with proj_size is not supported")
    if op == "gru":
        _refuse_packed(ex, f"{what} '{path}'", input_arg)
    x = ex.t(input_arg)
    if len(x.shape) != 3:
        ex.fail(f"{what} '{path}': input {list(x.shape)} must have "
                f"rank 3 (unbatched or packed sequences are not "
                f"supported)")
    if not mod.batch_first:
        x = ex.transpose(at("batch_first"), x, (1, 0, 2), scope)
    B, S, _ = x.shape
    H = mod.hidden_size
    dirs = 2 if mod.bidirectional else 1
    h_parts = []
    for layer in range(mod.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"l{layer}" + ("_reverse" if d else "")
            ins = [x, ex.param(getattr(mod, f"weight_ih_{sfx}")),
                   ex.param(getattr(mod, f"weight_hh_{sfx}"))]
            if mod.bias:
                ins += [ex.param(getattr(mod, f"bias_ih_{sfx}")),
                        ex.param(getattr(mod, f"bias_hh_{sfx}"))]
            y = ex.emit(op, at(sfx), ins,
                        {"reverse": True} if d else None, (B, S, H),
                        scope=scope)
            outs.append(y)
            h_parts.append((y, 0 if d else S - 1))
        if dirs == 1:
            x = outs[0]
        else:
            x = ex.emit("concat", at(f"l{layer}_concat"), outs,
                        {"axis": 2}, (B, S, dirs * H), scope=scope)
        if layer + 1 < mod.num_layers:
            x = dropout(ex, mod.dropout, at(f"l{layer}_dropout"), x, scope)
    if not mod.batch_first:
        x = ex.transpose(at("seq_first"), x, (1, 0, 2), scope)
    if op == "gru":
        return (x, RnnState(path, h_parts, what))
    return (x, (LstmState(path, h_parts), LstmState(path, None)))


def lstm_state(ex, st, k=None):
    """h_n[k] ([B, H]) or, with k None, the whole h_n; c_n fails."""
    what = st.module if isinstance(st, RnnState) else "nn.LSTM"
    if st.parts is None:
        ex.fail(f"uses c_n, the final cell state of nn.LSTM "
                f"'{st.path}', which is not supported (use the output "
                f"or h_n)")
    scope = ex.scope_of(ex.node)
    h_n = join(st.path, "h_n")
    if k is not None:
        if not -len(st.parts) <= k < len(st.parts):
            ex.fail(f"h_n index {k} is out of range for {what} "
                    f"'{st.path}' ({len(st.parts)} layers x "
                    f"directions)")
        y, step = st.parts[k]
        if step is None:  # the final hidden state itself
            return y
        B, S, H = y.shape
        last = ex.emit("slice", h_n, [y],
                       {"axis": 1, "start": step, "end": step + 1},
                       (B, 1, H), scope=scope)
        return ex.reshape(h_n, last, (B, H), scope)
    if st.whole is None:
        parts = []
        for i in range(len(st.parts)):
            h = lstm_state(ex, st, i)
            parts.append(ex.reshape(h_n, h, (1,) + h.shape, scope))
        st.whole = parts[0] if len(parts) == 1 else ex.emit(
            "concat", h_n, parts, {"axis": 0},
            (len(parts),) + parts[0].shape[1:], scope=scope)
    return st.whole


# ---- nn.RNN and nn.GRU, unrolled ------------------------------------------

# The ops one step of a layer and direction unrolls into (the slice of its
# input projection, the hidden projection, the gates, its output's reshape),
# and the most an nn.RNN or nn.GRU may unroll into: see the module's
# docstring.
OPS_PER_STEP = {"tanh": 6, "relu": 6, "GRU": 18}
MAX_UNROLLED_OPS = 10000


class RnnState(LstmState):
    """h_n of an nn.RNN or nn.GRU (`module`, e.g. "nn.GRU"): `parts` holds
    each layer and direction's final hidden state [B, H] itself (step
    None; unrolled) or, as LstmState's, the gru op's output and its final
    step, made into h_n's [layers * directions, B, H] only when used
    whole."""

    def __init__(self, path, parts, module):
        super().__init__(path, parts)
        self.module = module


class _Unroll:
    """Emits one layer and direction of an unrolled nn.RNN or nn.GRU: ops
    named "<path>.<l0[_reverse]>.t<step>.<what>" in the module's scope."""

    def __init__(self, ex, kind, scope, H):
        self.ex, self.kind, self.scope, self.H = ex, kind, scope, H

    def op(self, type_, name, inputs, shape, attrs=None):
        return self.ex.emit(type_, name, inputs, attrs, shape,
                            scope=self.scope)

    def cols(self, name, x, start, end):
        """x[..., start:end] of a [B, G * H] tensor (or a [G * H] bias)."""
        shape = x.shape[:-1] + (end - start,)
        return self.op("slice", name, [x], shape,
                       {"axis": len(x.shape) - 1, "start": start,
                        "end": end})

    def zero_state_projection(self, name, like, w_hh, b_hh):
        """The hidden projection of PyTorch's zero initial state, 0 W_hh^T
        + b_hh, as a linear of a zero [1, H] constant: [1, G * H], b_hh
        broadcast. Only a sequence of one step needs it: there no other
        op reads W_hh, which then had no gradient at all, while PyTorch's
        is zero (the optimizer skipped it; PyTorch's AdamW or SGD with
        weight decay still moves it)."""
        zero = self.ex.const(torch.zeros(1, self.H), like)
        ins = [zero, w_hh] + ([b_hh] if b_hh is not None else [])
        return self.op("linear", name, ins, (1, w_hh.shape[0]))

    def step(self, name, xt, h, w_hh, b_hh, hp0=None):
        """The hidden state after one step: xt [B, G * H] is the step's
        input projection (x W_ih^T + b_ih), h the previous hidden state
        [B, H] or None for PyTorch's zero initial state (then h W_hh^T is
        zero and only b_hh is left of the hidden projection, or hp0, that
        projection computed by zero_state_projection)."""
        at = functools.partial(join, name)
        B, H = xt.shape[0], self.H
        if h is not None:
            ins = [h, w_hh] + ([b_hh] if b_hh is not None else [])
            hp = self.op("linear", at("hh"), ins, (B, xt.shape[1]))
        else:
            hp = b_hh if hp0 is None else hp0  # [G * H], [1, G * H], None
        if self.kind != "GRU":
            pre = xt if hp is None else self.op("add", at("add"), [xt, hp],
                                                (B, H))
            return self.op(self.kind, at(self.kind), [pre], (B, H))
        # PyTorch's GRU, gates (r, z, n):
        #   r = sigmoid(x_r + h_r), z = sigmoid(x_z + h_z),
        #   n = tanh(x_n + r * h_n), h' = (1 - z) * n + z * h
        # with h_* = h W_h*^T + b_h*; h' is computed as n + z * (h - n).
        rz = self.cols(at("x_rz"), xt, 0, 2 * H)
        if hp is not None:
            rz = self.op("add", at("rz_add"),
                         [rz, self.cols(at("h_rz"), hp, 0, 2 * H)],
                         (B, 2 * H))
        rz = self.op("sigmoid", at("rz"), [rz], (B, 2 * H))
        r, z = self.cols(at("r"), rz, 0, H), self.cols(at("z"), rz, H, 2 * H)
        n = self.cols(at("x_n"), xt, 2 * H, 3 * H)
        if hp is not None:
            rh = self.op("mul", at("r_h_n"),
                         [r, self.cols(at("h_n"), hp, 2 * H, 3 * H)], (B, H))
            n = self.op("add", at("n_add"), [n, rh], (B, H))
        n = self.op("tanh", at("n"), [n], (B, H))
        if h is None:  # h' = n - z * n
            zn = self.op("mul", at("z_n"), [z, n], (B, H))
            return self.op("sub", at("h"), [n, zn], (B, H))
        d = self.op("sub", at("h_minus_n"), [h, n], (B, H))
        zd = self.op("mul", at("z_d"), [z, d], (B, H))
        return self.op("add", at("h"), [n, zd], (B, H))

    def layer(self, name, x, weights, h0, reverse, zero_name):
        """One layer and direction over x [B, S, I]: (its output [B, S, H],
        its final hidden state [B, H]). The input projection of every step
        is one linear; h0 [B, H] or None (zeros; over one step, the zero
        state's hidden projection is the op `zero_name`, as a given h0's
        ops are "<path>.h0_<layer>")."""
        w_ih, w_hh, b_ih, b_hh = weights
        B, S, _ = x.shape
        G = 3 if self.kind == "GRU" else 1
        at = functools.partial(join, name)
        ins = [x, w_ih] + ([b_ih] if b_ih is not None else [])
        xp = self.op("linear", at("ih"), ins, (B, S, G * self.H))
        h, outs = h0, [None] * S
        hp0 = None
        if h0 is None and S == 1:
            hp0 = self.zero_state_projection(zero_name, xp, w_hh, b_hh)
        for t in (reversed(range(S)) if reverse else range(S)):
            xt = self.op("slice", at(f"t{t}.x"), [xp], (B, 1, G * self.H),
                         {"axis": 1, "start": t, "end": t + 1})
            xt = self.ex.reshape(at(f"t{t}.x"), xt, (B, G * self.H),
                                 self.scope)
            h = self.step(at(f"t{t}"), xt, h, w_hh, b_hh, hp0)
            outs[t] = self.ex.reshape(at(f"t{t}.out"), h, (B, 1, self.H),
                                      self.scope)
        y = outs[0] if S == 1 else self.op("concat", at("out"), outs,
                                           (B, S, self.H), {"axis": 1})
        return y, h


def unrolled_rnn(ex, mod, path, input_arg, hx):
    """nn.RNN or nn.GRU `mod` unrolled (_Unroll per layer and direction,
    the directions' outputs concatenated, dropout between layers as
    nn.LSTM's, transposes around a sequence-first stack). Returns (output,
    h_n), h_n an RnnState."""
    what = f"nn.{type(mod).__name__} '{path}'"
    if isinstance(mod, nn.GRU):
        kind = "GRU"
    elif mod.mode == "RNN_TANH":
        kind = "tanh"
    elif mod.mode == "RNN_RELU":
        kind = "relu"
    else:
        ex.fail(f"{what}: mode {mod.mode} is not supported (nn.LSTM, "
                f"nn.GRU and nn.RNN are)")
    if getattr(mod, "proj_size", 0):
        ex.fail(f"{what} with proj_size is not supported")
    _refuse_packed(ex, what, input_arg)
    x = ex.t(input_arg)
    if len(x.shape) != 3:
        ex.fail(f"{what}: input {list(x.shape)} must have rank 3 "
                f"(unbatched or packed sequences are not supported)")
    at = functools.partial(join, path)
    scope = ex.scope_of(ex.node)
    H, L = mod.hidden_size, mod.num_layers
    dirs = 2 if mod.bidirectional else 1
    if not mod.batch_first:
        x = ex.transpose(at("batch_first"), x, (1, 0, 2), scope)
    B, S, _ = x.shape
    n_ops = S * L * dirs * OPS_PER_STEP[kind]
    if n_ops > MAX_UNROLLED_OPS:
        ex.fail(f"{what}: {S} steps x {L} layers x {dirs} directions "
                f"unroll into about {n_ops} ops, more than "
                f"{MAX_UNROLLED_OPS} (the graph grows with the sequence "
                f"and planning it slows down faster: use a shorter "
                f"sequence, or nn.LSTM, one op a layer and direction)")
    h0 = None
    if not _is_zero_state(ex, hx):
        h0 = ex.t(hx)
        if h0.shape != (L * dirs, B, H):
            ex.fail(f"{what}: initial state {list(h0.shape)} must be "
                    f"[{L * dirs}, {B}, {H}] (layers x directions, batch, "
                    f"hidden)")
    unroll = _Unroll(ex, kind, scope, H)
    finals = []
    for layer in range(L):
        outs = []
        for d in range(dirs):
            sfx = f"l{layer}" + ("_reverse" if d else "")
            weights = [ex.param(getattr(mod, f"weight_ih_{sfx}")),
                       ex.param(getattr(mod, f"weight_hh_{sfx}")), None, None]
            if mod.bias:
                weights[2:] = [ex.param(getattr(mod, f"bias_ih_{sfx}")),
                               ex.param(getattr(mod, f"bias_hh_{sfx}"))]
            h = None
            if h0 is not None:
                k = layer * dirs + d
                h = ex.emit("slice", at(f"h0_{sfx}"), [h0],
                            {"axis": 0, "start": k, "end": k + 1},
                            (1, B, H), scope=scope)
                h = ex.reshape(at(f"h0_{sfx}"), h, (B, H), scope)
            y, h = unroll.layer(at(sfx), x, weights, h, bool(d),
                                at(f"h0_{sfx}.hh"))
            outs.append(y)
            finals.append((h, None))
        if dirs == 1:
            x = outs[0]
        else:
            x = ex.emit("concat", at(f"l{layer}_concat"), outs,
                        {"axis": 2}, (B, S, dirs * H), scope=scope)
        if layer + 1 < L:
            x = dropout(ex, mod.dropout, at(f"l{layer}_dropout"), x, scope)
    if not mod.batch_first:
        x = ex.transpose(at("seq_first"), x, (1, 0, 2), scope)
    return (x, RnnState(path, finals, f"nn.{type(mod).__name__}"))


# ---- nn.RNNCell, nn.GRUCell, nn.LSTMCell: one step -------------------------


def _cell_state(ex, part):
    """An LSTMCell/GRUCell/RNNCell state argument (an fx node, a value held
    for one, or None) as an IrTensor, or None for PyTorch's zero state."""
    if part is None or (isinstance(part, fx.Node) and
                        _is_zero_state(ex, part)):
        return None
    return part if not isinstance(part, fx.Node) else ex.t(part)


def _lstm_cell_step(unroll, name, xt, h, c, w_hh, b_hh, hp0):
    """PyTorch's LSTM cell, gates (i, f, g, o): c' = f * c + i * g, h' = o *
    tanh(c'), from the step's input projection xt [B, 4H]; h or c None for
    the zero state. Returns (h', c')."""
    at = functools.partial(join, name)
    B, H = xt.shape[0], unroll.H
    if h is not None:
        ins = [h, w_hh] + ([b_hh] if b_hh is not None else [])
        hp = unroll.op("linear", at("hh"), ins, (B, 4 * H))
    else:
        hp = b_hh if hp0 is None else hp0
    pre = xt if hp is None else unroll.op("add", at("add"), [xt, hp],
                                          (B, 4 * H))
    gate = {}
    for k, (what, act) in enumerate((("i", "sigmoid"), ("f", "sigmoid"),
                                     ("g", "tanh"), ("o", "sigmoid"))):
        cols = unroll.cols(at(f"{what}_pre"), pre, k * H, (k + 1) * H)
        gate[what] = unroll.op(act, at(what), [cols], (B, H))
    c2 = unroll.op("mul", at("i_g"), [gate["i"], gate["g"]], (B, H))
    if c is not None:
        fc = unroll.op("mul", at("f_c"), [gate["f"], c], (B, H))
        c2 = unroll.op("add", at("c"), [fc, c2], (B, H))
    tc = unroll.op("tanh", at("tanh_c"), [c2], (B, H))
    return unroll.op("mul", at("h"), [gate["o"], tc], (B, H)), c2


@registry.modules(nn.RNNCell, nn.GRUCell, nn.LSTMCell)
def _cell_module(ex, call):
    """One step of nn.RNNCell (tanh, relu), nn.GRUCell or nn.LSTMCell: the
    input projection (a linear), the hidden one (a linear of the state, or
    its bias alone from the zero state) and the gates, as the unrolled
    nn.RNN and nn.GRU steps are. Returns h' ((h', c') for nn.LSTMCell)."""
    mod = call.mod
    what = f"nn.{type(mod).__name__} '{call.path}'"
    a = call.bound()
    x = ex.t(a["input"])
    if len(x.shape) != 2:
        ex.fail(f"{what}: input {list(x.shape)} must have rank 2 [batch, "
                f"features] (unbatched input is not supported)")
    if isinstance(mod, nn.LSTMCell):
        kind, G = "LSTM", 4
    elif isinstance(mod, nn.GRUCell):
        kind, G = "GRU", 3
    else:
        kind, G = mod.nonlinearity, 1
    B, H = x.shape[0], mod.hidden_size
    hx = a["hx"]
    if isinstance(hx, fx.Node) and isinstance(ex.env[hx], (tuple, list)):
        hx = tuple(ex.env[hx])  # (h, c) another cell returned
    if kind == "LSTM":
        h, c = (None, None) if hx is None else \
            (_cell_state(ex, hx[0]), _cell_state(ex, hx[1]))
    else:
        h, c = _cell_state(ex, hx), None
    for state in (h, c):
        if state is not None and tuple(state.shape) != (B, H):
            ex.fail(f"{what}: state {list(state.shape)} must be [{B}, {H}]")
    name, scope = ex.base_name(call.node), ex.scope_of(call.node)
    at = functools.partial(join, name)
    w_ih, w_hh = ex.param(mod.weight_ih), ex.param(mod.weight_hh)
    b_ih = ex.param(mod.bias_ih) if mod.bias else None
    b_hh = ex.param(mod.bias_hh) if mod.bias else None
    unroll = _Unroll(ex, kind, scope, H)
    ins = [x, w_ih] + ([b_ih] if b_ih is not None else [])
    xt = unroll.op("linear", at("ih"), ins, (B, G * H))
    # From the zero state no op reads W_hh: its zero gradient comes from a
    # linear of a zero constant (see zero_state_projection).
    hp0 = unroll.zero_state_projection(at("h0"), xt, w_hh, b_hh) \
        if h is None else None
    if kind == "LSTM":
        return _lstm_cell_step(unroll, at("step"), xt, h, c, w_hh, b_hh, hp0)
    return unroll.step(at("step"), xt, h, w_hh, b_hh, hp0)


# nn.LSTM is an nn.RNNBase: the MRO lookup finds it first.
@registry.modules(nn.LSTM)
def _lstm_module(ex, call):
    a = call.bound()
    return lstm(ex, call.mod, call.path, a["input"], a["hx"])


@registry.modules(nn.GRU)
def _gru_module(ex, call):
    """The gru op from the zero state; given h_0, unrolled."""
    a = call.bound()
    if _is_zero_state(ex, a["hx"]):
        return lstm(ex, call.mod, call.path, a["input"], a["hx"], op="gru")
    return unrolled_rnn(ex, call.mod, call.path, a["input"], a["hx"])


@registry.modules(nn.RNN)
def _unrolled_rnn_module(ex, call):
    a = call.bound()
    return unrolled_rnn(ex, call.mod, call.path, a["input"], a["hx"])


@registry.modules(nn.RNNBase)
def _other_rnn_module(ex, call):
    ex.fail(f"{type(call.mod).__name__} is not supported (nn.LSTM, nn.GRU "
            f"and nn.RNN are)")
