"""Recurrent layers (planner/graph/ops_lstm.cc): nn.LSTM as one lstm op per
layer and direction, and its final hidden state h_n; the other nn.RNNBase
modules (GRU, RNN) fail naming themselves."""

import functools

import torch.fx as fx
import torch.nn as nn

from . import registry
from .ir import LstmState, Static, join
from .ops_elementwise import dropout


def lstm(ex, mod, path, input_arg, hx):
    """nn.LSTM as one lstm op per layer and direction (the reverse one
    with attribute reverse, the two outputs concatenated), dropout between
    layers, transposes around a sequence-first stack. Returns (output,
    (h_n, c_n)); h_n[k] is a slice of layer k's output, c_n unsupported."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    scope = ex.scope_of(ex.node)
    if hx is not None and not (isinstance(hx, fx.Node) and
                               isinstance(ex.env[hx], Static) and
                               ex.env[hx].value is None):
        ex.fail(f"nn.LSTM '{path}' with an initial state (h_0, c_0) is "
                f"not supported; only the default zero state is")
    if getattr(mod, "proj_size", 0):
        ex.fail(f"nn.LSTM '{path}' with proj_size is not supported")
    x = ex.t(input_arg)
    if len(x.shape) != 3:
        ex.fail(f"nn.LSTM '{path}': input {list(x.shape)} must have "
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
            y = ex.emit("lstm", at(sfx), ins,
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
    return (x, (LstmState(path, h_parts), LstmState(path, None)))


def lstm_state(ex, st, k=None):
    """h_n[k] ([B, H]) or, with k None, the whole h_n; c_n fails."""
    if st.parts is None:
        ex.fail(f"uses c_n, the final cell state of nn.LSTM "
                f"'{st.path}', which is not supported (use the output "
                f"or h_n)")
    scope = ex.scope_of(ex.node)
    h_n = join(st.path, "h_n")
    if k is not None:
        if not -len(st.parts) <= k < len(st.parts):
            ex.fail(f"h_n index {k} is out of range for nn.LSTM "
                    f"'{st.path}' ({len(st.parts)} layers x "
                    f"directions)")
        y, step = st.parts[k]
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


# nn.LSTM is an nn.RNNBase: the MRO lookup finds it first.
@registry.modules(nn.LSTM)
def _lstm_module(ex, call):
    a = call.bound()
    return lstm(ex, call.mod, call.path, a["input"], a["hx"])


@registry.modules(nn.RNNBase)
def _other_rnn_module(ex, call):
    ex.fail(f"{type(call.mod).__name__} is not supported (nn.LSTM is)")
