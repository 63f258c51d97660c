"""Attention: nn.MultiheadAttention decomposed into q/k/v linears, heads,
scaled scores, a softmax that takes the masks, dropout, context and the
output linear; and the masks it takes: constant causal masks (also through
masked_fill, or added to hand-written scores), additive float masks, and key
padding masks, held as integer ids when they are booleans (a bool input, or
`tokens == pad_id` and its negations: the comparisons live here, as masks
are their only use).

The transformer layers built from it are in ops_transformer.py.
"""

import functools
import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn

from . import initializers, registry
from .ir import BoolIds, IrTensor, Static, is_causal_mask, join
from .ops_elementwise import dropout
from .ops_linear import linear, linear_module

# The additive stand-in for PyTorch's -inf at a padded key: exp(x + NEG - max)
# is exactly 0 in these dtypes whenever one key of the row is kept, so such
# rows equal PyTorch's; a row with every key padded (NaN in PyTorch 1.13)
# gets uniform weights instead.
_PAD_NEG = {"FLOAT16": -65504.0}
_PAD_NEG_DEFAULT = -1e30

# ---- attention masks -------------------------------------------------------


def attention_mask(ex, mask, sq, sk):
    """(causal, mask tensor or None) for an attn_mask argument."""
    if mask is None:
        return False, None
    if isinstance(mask, Static):
        if is_causal_mask(mask.value, sq, sk):
            return True, None
        ex.fail("only causal constant attention masks are supported "
                "(e.g. nn.Transformer.generate_square_subsequent_mask)")
    if mask.dtype == "INT64" or mask.shape != (sq, sk):
        ex.fail(f"attention mask '{mask.name}' must be a float "
                f"[{sq}, {sk}] tensor (or a constant causal mask)")
    return False, mask


@registry.methods("masked_fill", "masked_fill_")
def _masked_fill_method(ex, call, x):
    """x.masked_fill(mask, value) with a constant boolean mask: scores
    marked causal for a causal mask and -inf (or <= -1e4) before a softmax;
    for a finite value, x times the constant 0/1 keep mask plus the value
    where masked (any use; the filled elements get no gradient, as in
    PyTorch); for -inf, an additive mask the softmax that must follow takes
    (Emformer's block masks)."""
    if not ex.is_static(call.arg(1, "mask")):
        ex.fail("masked_fill is supported with a constant mask only (one "
                "computed from the inputs: use a key_padding_mask)")
    m, val = ex.v(call.arg(1, "mask")), ex.v(call.arg(2, "value"))
    if isinstance(val, torch.Tensor):
        val = val.item()
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or \
            not isinstance(val, (int, float)) or isinstance(val, bool):
        ex.fail("masked_fill needs a boolean mask and a number")
    if len(x.shape) >= 2 and val <= -1e4 and \
            is_causal_mask(m, x.shape[-2], x.shape[-1]):
        return x.with_mask(causal=True)
    if tuple(ex.out_shape()) != tuple(x.shape):
        ex.fail(f"masked_fill's mask {list(m.shape)} does not broadcast to "
                f"the tensor {list(x.shape)}")
    name, scope = ex.base_name(call.node), ex.scope_of(call.node)
    if math.isfinite(val):
        keep = ex.const((~m).double(), x, "the keep mask of masked_fill")
        y = ex.emit("mul", name, [x, keep], None, x.shape, scope=scope)
        if val != 0:
            fill = ex.const(m.double() * val, x, "the fill of masked_fill")
            y = ex.emit("add", name, [y, fill], None, x.shape, scope=scope)
        return y
    if val > 0 or x.causal or x.mask is not None:
        ex.fail(f"masked_fill with {val} is supported only as -inf into a "
                f"softmax, on unmasked scores")
    add = ex.const(m.double() * _PAD_NEG.get(x.dtype, _PAD_NEG_DEFAULT), x,
                   "the additive mask of masked_fill")
    return x.with_mask(mask=add)


# ---- key padding masks -----------------------------------------------------


def bool_ids(ex, kind, a, b=None):
    """`a == b` / `a != b` (kind "eq"/"ne": an integer tensor and an
    integer constant, e.g. tokens == pad_id) or the negation of a boolean
    tensor (kind "not"): a BoolIds, for a key_padding_mask."""
    if kind == "not":
        v = ex.env.get(a) if isinstance(a, fx.Node) else None
        if not isinstance(v, BoolIds):
            ex.fail("logical negation is supported only of a boolean "
                    "key padding mask (a bool input, or integer ids "
                    "== a constant)")
        return v.inverted()
    if ex.is_static(a) and not ex.is_static(b):
        a, b = b, a
    x, c = ex.t(a), ex.v(b)
    if isinstance(c, torch.Tensor) and c.numel() == 1 and \
            not c.is_floating_point():
        c = int(c)
    if x.dtype != "INT64" or isinstance(c, bool) or \
            not isinstance(c, int):
        ex.fail("comparisons are supported only between an integer "
                "tensor and an integer constant (tokens == pad_id, as "
                "a key_padding_mask)")
    return BoolIds(x, {c}, negate=(kind == "ne"))


@registry.functions(operator.eq, torch.eq, operator.ne, torch.ne)
def _compare(ex, call):
    kind = "ne" if call.node.target in (operator.ne, torch.ne) else "eq"
    return bool_ids(ex, kind, call.args[0], call.arg(1, "other"))


@registry.functions(operator.invert, torch.logical_not, torch.bitwise_not)
def _logical_not(ex, call):
    return bool_ids(ex, "not", call.args[0])


# The receiver is a boolean or integer ids, not converted to a tensor.
@registry.methods("eq", "ne", "__eq__", "__ne__", tensor_self=False)
def _compare_method(ex, call):
    return bool_ids(ex, call.node.target.strip("_"), call.args[0],
                    call.arg(1, "other"))


@registry.methods("logical_not", "bitwise_not", "__invert__",
                  tensor_self=False)
def _logical_not_method(ex, call):
    return bool_ids(ex, "not", call.args[0])


def _padding_table(ex, kpm, limit, dtype, base, scope):
    """The [limit, 1] table of the additive mask per id: _PAD_NEG for the
    padded ids, 0 for the others, as concatenated constant runs."""
    neg = _PAD_NEG.get(dtype, _PAD_NEG_DEFAULT)
    rows = [(i in kpm.true_ids) != kpm.negate for i in range(limit)]
    like = IrTensor("", (), dtype)
    runs, start = [], 0
    for i in range(1, limit + 1):  # constant runs of the table
        if i == limit or rows[i] != rows[start]:
            runs.append(ex.const(torch.full(
                (i - start, 1), neg if rows[start] else 0.0), like))
            start = i
    return runs[0] if len(runs) == 1 else ex.emit(
        "concat", f"{base}_table", runs, {"axis": 0}, (limit, 1),
        dtype=dtype, scope=scope)


def padding_mask(ex, kpm, path, B, Sk, dtype, alone, scope):
    """PyTorch's key_padding_mask [B, Sk] as an additive mask [B, 1, 1,
    Sk] that softmax broadcasts over heads and queries, or None. Bool
    (True: the key is padding, hidden from every query): an embedding of
    its ids in a [limit, 1] table of 0 and _PAD_NEG (concatenated
    constants). Float: added as it is, as PyTorch does, only `alone`
    (without attn_mask, which PyTorch 1.13 cannot merge with a float
    one). One mask per source tensor, shared by every attention."""
    if kpm is None:
        return None
    if isinstance(kpm, Static):
        v = kpm.value
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool and \
                not bool(v.any()):
            return None
        ex.fail(f"{path}: a constant key_padding_mask is not supported "
                f"(make it an input or compute it from one)")
    ids = kpm.ids if isinstance(kpm, BoolIds) else kpm
    if tuple(ids.shape) != (B, Sk):
        ex.fail(f"{path}: key_padding_mask '{ids.name}' "
                f"{list(ids.shape)} must have shape [{B}, {Sk}] "
                f"(batch, key length)")
    if isinstance(kpm, BoolIds):
        key = (ids.name, kpm.true_ids, kpm.negate, dtype)
    else:
        if kpm.dtype == "INT64":
            ex.fail(f"{path}: key_padding_mask '{kpm.name}' is an "
                    f"integer tensor; PyTorch takes bool (True = "
                    f"padding) or float (additive) masks")
        if kpm.dtype != dtype:
            ex.fail(f"{path}: float key_padding_mask '{kpm.name}' is "
                    f"{kpm.dtype}, the attention {dtype}")
        if not alone:
            ex.fail(f"{path}: a float key_padding_mask with an "
                    f"attn_mask is not supported (PyTorch 1.13 merges "
                    f"them with masked_fill, which takes a bool mask)")
        key = (kpm.name, dtype)
    if key in ex.padding_masks:
        return ex.padding_masks[key]
    base = f"{ids.name}.padding"
    if isinstance(kpm, BoolIds):
        limit = ex.id_limits.get(ids.name)
        if limit is None:
            ex.fail(f"{path}: key_padding_mask computed from "
                    f"'{ids.name}', whose range is unknown: its ids "
                    f"must also index an nn.Embedding before the "
                    f"attention")
        table = _padding_table(ex, kpm, limit, dtype, base, scope)
        add = ex.emit("embedding", f"{base}_additive", [ids, table],
                      None, (B, Sk, 1), dtype=dtype, scope=scope)
    else:
        add = kpm
    out = ex.reshape(f"{base}_mask", add, (B, 1, 1, Sk), scope)
    ex.padding_masks[key] = out
    return out


# ---- nn.MultiheadAttention -------------------------------------------------


def _qkv_parameters(ex, mod, at):
    """The q, k and v weights and biases (None without bias) of `mod`:
    in_proj_weight/in_proj_bias split into "<module>.q.weight" ...,
    recorded as slices of their source; separate q/k/v_proj_weight
    (kdim != embed_dim) keep their names."""
    E = mod.embed_dim
    ws, bs = [], []
    if mod._qkv_same_embed_dim:
        W = mod.in_proj_weight
        init = initializers.xavier_uniform(W.shape[1], W.shape[0])
        for i, nm in enumerate("qkv"):
            ws.append(ex.param(W, at(f"{nm}.weight"), dict(init),
                               key=("in_proj_weight", id(W), i),
                               shape=(E, E), value=W[i * E:(i + 1) * E],
                               slice_of=(0, i * E)))
    else:
        for nm in "qkv":
            W = getattr(mod, f"{nm}_proj_weight")
            ws.append(ex.param(
                W, init=initializers.xavier_uniform(W.shape[1], W.shape[0])))
    if mod.in_proj_bias is not None:
        b = mod.in_proj_bias
        for i, nm in enumerate("qkv"):
            bs.append(ex.param(b, at(f"{nm}.bias"), dict(initializers.ZEROS),
                               key=("in_proj_bias", id(b), i), shape=(E,),
                               value=b[i * E:(i + 1) * E],
                               slice_of=(0, i * E)))
    else:
        bs = [None] * 3
    return ws, bs


def mha(ex, mod, path, query, key, value, attn_mask, key_padding_mask,
        batch_first=None):
    """nn.MultiheadAttention `mod` (at `path`) on IR tensors query, key,
    value; the masks as ModuleCall.optional gives them; `batch_first`
    overrides the module's (a transformer stack transposes once)."""
    at = functools.partial(join, path)  # "<path>.<leaf>"
    if mod.bias_k is not None or mod.add_zero_attn:
        ex.fail(f"{path}: add_bias_kv / add_zero_attn are not supported")
    bf = mod.batch_first if batch_first is None else batch_first
    scope = path.replace(".", "/")
    E, H, dh = mod.embed_dim, mod.num_heads, mod.head_dim
    ins = []
    for nm, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 3:
            ex.fail(f"{path}: {nm} {list(x.shape)} must have rank 3 "
                    f"(unbatched attention is not supported)")
        ins.append(x)
    if not bf:
        done = {}
        for i, x in enumerate(ins):
            if x.name not in done:
                done[x.name] = ex.transpose(
                    at(f"{('query', 'key', 'value')[i]}_batch_first"),
                    x, (1, 0, 2), scope)
            ins[i] = done[x.name]
    q_in, k_in, v_in = ins
    B, Sq, _ = q_in.shape
    Sk = k_in.shape[1]
    causal, mask = attention_mask(ex, attn_mask, Sq, Sk)
    pad = padding_mask(ex, key_padding_mask, path, B, Sk, q_in.dtype,
                       mask is None and not causal, scope)
    if pad is not None:
        # PyTorch 1.13 fills the padded keys of attn_mask with -inf
        # (masked_fill): the sum, [B, 1, Sq, Sk].
        mask = pad if mask is None else ex.emit(
            "add", at("attn_mask_padded"), [pad, mask], None,
            (B, 1, Sq, Sk), scope=scope)
    ws, bs = _qkv_parameters(ex, mod, at)
    q = linear(ex, at("q"), q_in, ws[0], bs[0], scope)
    k = linear(ex, at("k"), k_in, ws[1], bs[1], scope)
    v = linear(ex, at("v"), v_in, ws[2], bs[2], scope)
    q = ex.reshape(at("q_heads"), q, (B, Sq, H, dh), scope)
    k = ex.reshape(at("k_heads"), k, (B, Sk, H, dh), scope)
    v = ex.reshape(at("v_heads"), v, (B, Sk, H, dh), scope)
    q = ex.transpose(at("q_t"), q, (0, 2, 1, 3), scope)
    k = ex.transpose(at("k_t"), k, (0, 2, 3, 1), scope)
    v = ex.transpose(at("v_t"), v, (0, 2, 1, 3), scope)
    s = ex.emit("matmul", at("scores"), [q, k], None, (B, H, Sq, Sk),
                scope=scope)
    s = ex.emit("scale", at("scaled"), [s],
                {"factor": 1.0 / math.sqrt(dh)}, s.shape, scope=scope)
    s = ex.emit("softmax", at("probs"), [s] + ([mask] if mask else []),
                {"causal": causal}, s.shape, scope=scope)
    s = dropout(ex, mod.dropout, at("probs_drop"), s, scope)
    ctx = ex.emit("matmul", at("context"), [s, v], None,
                  (B, H, Sq, dh), scope=scope)
    ctx = ex.transpose(at("context_t"), ctx, (0, 2, 1, 3), scope)
    ctx = ex.reshape(at("context_merged"), ctx, (B, Sq, E), scope)
    out = linear_module(ex, mod.out_proj, at("out_proj"), ctx, scope)
    if not bf:
        out = ex.transpose(at("output_seq_first"), out, (1, 0, 2), scope)
    return out


@registry.modules(nn.MultiheadAttention)
def _mha_module(ex, call):
    """(output, None): the attention weights are not produced."""
    a = call.bound()
    out = mha(ex, call.mod, call.path, ex.t(a["query"]), ex.t(a["key"]),
              ex.t(a["value"]), call.optional(a["attn_mask"]),
              call.optional(a["key_padding_mask"]))
    return (out, None)
