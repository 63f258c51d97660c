"""A reference evaluator of HAP graphs (hap.v1.Graph in proto3 JSON form) on
PyTorch tensors, for tests: runs the forward graph of one step with given
input and parameter values and returns the loss. Dropout is the identity (an
evaluation-mode forward), so results compare with module.eval(); batch_norm
normalises with the batch's statistics (training mode), so models with it
compare with module.train() and no dropout.

Op semantics follow `hapctl ops` (planner/graph/ops_*.cc).
"""

import torch
import torch.nn.functional as F


def _attr(a):
    (kind, v), = a.items()
    if kind in ("ints", "floats"):
        return list(v.get("values", []))
    return v


def _causal(s):
    sq, sk = s.shape[-2], s.shape[-1]
    future = torch.triu(torch.ones(sq, sk, dtype=torch.bool), 1)
    return s.masked_fill(future, float("-inf"))


def lstm(x, reverse=False, op="lstm"):
    """The lstm (or gru) op through PyTorch's own one-layer LSTM (GRU) (what
    nn.LSTM and nn.GRU run, autograd included): x [B, S, I], w_ih, w_hh,
    b_ih?, b_hh? (None or left out: zero); reverse reads the sequence from
    its end."""
    seq, w_ih, w_hh = x[0], x[1], x[2]
    b = list(x[3:5]) + [None] * (5 - len(x))
    if op == "lstm" and (b[0] is None) != (b[1] is None):
        b = [v for v in b if v is not None]  # the other carries the sum
        b = [b[0], torch.zeros_like(b[0])]
    elif b[0] is None and b[1] is None:
        b = []
    else:  # gru: b_ih and b_hh are not interchangeable
        b = [v if v is not None else torch.zeros(w_hh.shape[0],
                                                 dtype=seq.dtype) for v in b]
    h0 = torch.zeros(1, seq.shape[0], w_hh.shape[1], dtype=seq.dtype)
    if reverse:
        seq = seq.flip(1)
    if op == "gru":
        out = torch._VF.gru(seq, h0, [w_ih, w_hh] + b, bool(b), 1, 0.0,
                            True, False, True)[0]
    else:
        out = torch._VF.lstm(seq, (h0, h0), [w_ih, w_hh] + b, bool(b), 1,
                             0.0, True, False, True)[0]
    return out.flip(1) if reverse else out


def _op(t, x, a):
    if t == "linear":
        return F.linear(*x)
    if t == "matmul":
        return torch.matmul(x[0], x[1])
    if t == "add":
        return x[0] + x[1]
    if t == "sub":
        return x[0] - x[1]
    if t == "mul":
        return x[0] * x[1]
    if t == "scale":
        return x[0] * a["factor"]
    if t == "stop_gradient":
        return x[0].detach()
    if t == "relu":
        return F.relu(x[0])
    if t == "gelu":
        return F.gelu(x[0])
    if t == "sigmoid":
        return torch.sigmoid(x[0])
    if t == "tanh":
        return torch.tanh(x[0])
    if t == "silu":
        return F.silu(x[0])
    if t == "relu6":
        return F.relu6(x[0])
    if t == "hardsigmoid":
        return F.hardsigmoid(x[0])
    if t == "hardswish":
        return F.hardswish(x[0])
    if t == "exp":
        return torch.exp(x[0])
    if t == "rsqrt":
        return torch.rsqrt(x[0])
    if t == "log":
        return torch.log(x[0])
    if t in ("dropout", "drop_path"):
        return x[0]
    if t == "layer_norm":
        return F.layer_norm(x[0], x[0].shape[-1:], x[1], x[2],
                            a.get("eps", 1e-5))
    if t == "batch_norm":
        # Training mode: the batch's statistics (running ones not read).
        return F.batch_norm(x[0], None, None, x[1], x[2], True, 0.0,
                            a.get("eps", 1e-5))
    if t == "softmax":
        s = x[0] + x[1] if len(x) > 1 else x[0]
        if a.get("causal", False):
            s = _causal(s)
        return torch.softmax(s, dim=-1)
    if t == "log_softmax":
        return torch.log_softmax(x[0], dim=-1)
    if t == "embedding":
        return F.embedding(x[0], x[1])
    if t == "transpose":
        return x[0].permute(*a["perm"])
    if t == "reshape":
        return x[0].reshape(a["shape"])
    if t == "flatten":
        return torch.flatten(x[0], a.get("start_dim", 1), a.get("end_dim", -1))
    if t == "concat":
        return torch.cat(x, dim=a["axis"])
    if t == "split":
        return list(torch.split(x[0], a["sizes"], dim=a["axis"]))
    if t == "slice":
        return x[0].narrow(a["axis"], a["start"], a["end"] - a["start"])
    if t == "expand":
        return x[0].expand(a["shape"])
    if t in ("sum", "mean"):
        axes = a.get("axes", [])
        f = torch.sum if t == "sum" else torch.mean
        if not axes:
            return f(x[0]) if not a.get("keepdims") else \
                f(x[0], dim=list(range(x[0].dim())), keepdim=True)
        return f(x[0], dim=axes, keepdim=a.get("keepdims", False))
    if t == "nll_loss":
        return F.nll_loss(x[0], x[1])
    if t == "cross_entropy":
        return F.cross_entropy(x[0], x[1])
    if t == "conv2d":
        return F.conv2d(x[0], x[1], x[2] if len(x) > 2 else None,
                        a.get("stride", [1, 1]), a.get("padding", [0, 0]),
                        a.get("dilation", [1, 1]), groups=a.get("groups", 1))
    if t == "conv3d":
        return F.conv3d(x[0], x[1], x[2] if len(x) > 2 else None,
                        a.get("stride", [1, 1, 1]), a.get("padding", [0, 0, 0]),
                        a.get("dilation", [1, 1, 1]), groups=a.get("groups", 1))
    if t == "max_pool2d":
        return F.max_pool2d(x[0], a["kernel"], a.get("stride", a["kernel"]),
                            a.get("padding", [0, 0]),
                            ceil_mode=a.get("ceil_mode", False))
    if t == "avg_pool2d":
        return F.avg_pool2d(x[0], a["kernel"], a.get("stride", a["kernel"]),
                            a.get("padding", [0, 0]),
                            ceil_mode=a.get("ceil_mode", False),
                            count_include_pad=a.get("count_include_pad", True))
    if t == "max_pool3d":
        return F.max_pool3d(x[0], a["kernel"], a.get("stride", a["kernel"]),
                            a.get("padding", [0, 0, 0]),
                            ceil_mode=a.get("ceil_mode", False))
    if t == "avg_pool3d":
        return F.avg_pool3d(x[0], a["kernel"], a.get("stride", a["kernel"]),
                            a.get("padding", [0, 0, 0]),
                            ceil_mode=a.get("ceil_mode", False),
                            count_include_pad=a.get("count_include_pad", True))
    if t == "adaptive_avg_pool2d":
        return F.adaptive_avg_pool2d(x[0], a["output_size"])
    if t in ("lstm", "gru"):
        return lstm(x, a.get("reverse", False), t)
    raise NotImplementedError(f"hap_ir_eval: op type '{t}'")


def evaluate(graph, inputs, params):
    """graph: dict; inputs/params: name -> tensor. Returns the loss tensor."""
    env = dict(inputs)
    env.update(params)
    pending = list(graph["ops"])
    while pending:
        progress = False
        rest = []
        for op in pending:
            if not all(i in env for i in op["inputs"]):
                rest.append(op)
                continue
            attrs = {k: _attr(v) for k, v in op.get("attrs", {}).items()}
            out = _op(op["type"], [env[i] for i in op["inputs"]], attrs)
            outs = out if isinstance(out, list) else [out]
            for name, v in zip(op["outputs"], outs):
                env[name] = v
            progress = True
        if not progress:
            raise ValueError(f"hap_ir_eval: cannot order ops "
                             f"{[o['name'] for o in rest][:5]}")
        pending = rest
    return env[graph["loss"]]
