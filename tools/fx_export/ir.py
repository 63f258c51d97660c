"""The exporter's vocabulary: its error, the graph metadata keys, dtypes, op
attributes, and the values an fx node can stand for while it is exported
(an IR tensor, a value known at export time, an nn.LSTM's final state, a
boolean held as integer ids). Every other module of the package uses these;
this one uses none of them."""

import torch


class ExportError(Exception):
    """The module cannot be expressed in the HAP IR."""


# Graph metadata key: JSON object, graph parameter -> {"source": state_dict
# name, "axis": int, "offset": int, "source_shape": [..]} for the graph
# parameters that are slices of one state_dict tensor (q/k/v of in_proj_*).
SLICES_KEY = "hap.state_dict_slices"


# Graph metadata key: JSON list of the graph parameters that are module
# buffers kept as state (BatchNorm's running_mean/running_var: frozen
# parameters the op updates, written by --weights under their state_dict
# names).
BUFFERS_KEY = "hap.state_dict_buffers"


# Graph metadata key: JSON object relating the module's state_dict to the
# graph's parameters where they are not one to one:
#   "aliases":   {state_dict name: state_dict name}: a tensor PyTorch holds
#                under several names (tied weights, `head.weight =
#                emb.weight`; a module used twice), each extra name -> the
#                name the graph (or a slice of it) holds it under;
#   "constants": [graph parameter]: exporter constants, not state_dict
#                entries (frozen, constant initialisers);
#   "counters":  {state_dict name: {"per_step": forwards per step,
#                "value": at export}}: BatchNorm's num_batches_tracked
#                (PyTorch adds one per forward of its module in training
#                mode; --weights writes `value`); the executor counts them from
#                the --init-weights value (else 0), one forward of the model
#                per step on the whole global batch (microbatches of a
#                pipeline plan do not count apart), and checkpoints keep them;
#   "folded":    {state_dict name: {"dtype", "shape", "runs"[, "parameter":
#                true]}}: buffers the graph does not hold (folded into
#                constants through a slice or a comparison, or unused) and,
#                marked "parameter", the parameters forward does not use
#                (PyTorch's training leaves them as they are), with their
#                values at export: row-major runs [count, one element's
#                little-endian bytes in hex];
#   "unheld":    [state_dict name]: entries the graph does not hold and the
#                exporter could not record (buffers of a dtype not in
#                SAFETENSORS_DTYPES or past FOLDED_RUNS_LIMIT runs, unused
#                parameters past UNUSED_PARAMETER_RUNS_LIMIT runs, on the
#                meta device, a module's extra state);
#   "unrecorded": {state_dict name: why}: every entry of "unheld".
# --weights and `hapctl checkpoint export` write every alias as a copy, the
# counters and the folded entries; --init-weights accepts an alias equal to
# the tensor it names (or in its place), a counter's start value, folded
# entries equal to the recorded values (other values are refused: the graph
# was built from those buffers, and the exports would give back the
# recorded parameters), and ignores the unheld entries.
EXTRAS_KEY = "hap.state_dict_extras"


# The safetensors dtype of a torch dtype, for the buffers EXTRAS_KEY
# "folded" records (those tools/safetensors_io.py and the executor's
# exports write).
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


_FLOAT_DTYPES = {
    torch.float32: "FLOAT32",
    torch.float16: "FLOAT16",
    torch.bfloat16: "BFLOAT16",
    torch.float64: "FLOAT64",
}
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def ir_dtype(dt, what):
    """The IR dtype of torch dtype `dt`; `what` names the tensor in the
    error. Every integer dtype is INT64 in the IR."""
    if dt in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[dt]
    if dt in _INT_DTYPES:
        return "INT64"
    raise ExportError(f"{what}: dtype {dt} has no HAP equivalent")


def float_torch_dtype(ir):
    """The torch dtype of a floating-point IR dtype (float32 for INT64:
    exporter constants are floating point)."""
    for dt, name in _FLOAT_DTYPES.items():
        if name == ir:
            return dt
    return torch.float32


def attr_value(v):
    """An op attribute in hap.v1.AttrValue's proto3 JSON form."""
    if isinstance(v, bool):
        return {"b": v}
    if isinstance(v, int):
        return {"i": v}
    if isinstance(v, float):
        return {"f": v}
    if isinstance(v, str):
        return {"s": v}
    if isinstance(v, (list, tuple)):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return {"ints": {"values": [int(x) for x in v]}}
        return {"floats": {"values": [float(x) for x in v]}}
    raise ExportError(f"internal: attribute value {v!r}")


def join(path, leaf):
    """"<path>.<leaf>", or `leaf` at the root (an empty path)."""
    return f"{path}.{leaf}" if path else leaf


class IrTensor:
    """An IR tensor. `causal`/`mask`: attention scores awaiting their softmax
    (a causal mask or an additive mask tensor was applied). `shifted`: the
    dim over which these are scores less their maximum (x - x.max(dim,
    keepdim=True)[0], which a softmax over that dim does not see: the IR
    tensor is x itself, and only that softmax may take it)."""

    def __init__(self, name, shape, dtype, causal=False, mask=None,
                 shifted=None):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self.causal, self.mask, self.shifted = causal, mask, shifted

    def with_mask(self, causal=False, mask=None):
        return IrTensor(self.name, self.shape, self.dtype, causal, mask)


class RowMax:
    """x.max(dim, keepdim=True)[0] (or x.amax(dim, keepdim=True)) of the IR
    tensor `x`, which the IR has no op for: supported only as the shift in
    x - it before a softmax over `dim` (a numerically stable softmax, as
    torchaudio's wav2vec2 writes it), where it changes nothing."""

    def __init__(self, x, dim):
        self.x, self.dim = x, dim


class Static:
    """A node's value known at export time (sizes, constants, None)."""

    def __init__(self, value):
        self.value = value


class LstmState:
    """h_n or c_n of an nn.LSTM ([layers * directions, B, H]), made into IR
    ops only when used: `parts` holds, per layer and direction, the lstm op's
    output [B, S, H] and the step whose hidden state is the final one (h_n
    is the output at that step); None for c_n (the lstm op keeps no cell
    states), which fails when used."""

    def __init__(self, path, parts):
        self.path, self.parts = path, parts
        self.whole = None  # the [layers * directions, B, H] tensor, once made


class BoolIds:
    """A boolean tensor the IR holds through integer ids: True where the
    INT64 tensor `ids` is in `true_ids` (`negate`: where it is not). A bool
    input is its own ids (0/1, true_ids {1}); `tokens == pad` is
    BoolIds(tokens, {pad}). Only attention key padding masks consume them
    (as an embedding of the ids in a table of 0 and a large negative)."""

    def __init__(self, ids, true_ids, negate=False):
        self.ids, self.true_ids, self.negate = ids, frozenset(true_ids), negate

    def inverted(self):
        return BoolIds(self.ids, self.true_ids, not self.negate)


def is_causal_mask(mask, sq, sk):
    """True if a constant attention mask hides exactly the future positions
    (bool: True above the diagonal; float: -inf (or <= -1e4) above, 0 on and
    below). Leading dimensions must be broadcast (size 1). Such a mask
    becomes the `causal` flag of an IrTensor and then of its softmax."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        return False
    if tuple(mask.shape[-2:]) != (sq, sk) or sq != sk:
        return False
    if any(d != 1 for d in mask.shape[:-2]):
        return False
    m = mask.reshape(sq, sk)
    future = torch.triu(torch.ones(sq, sk, dtype=torch.bool), 1)
    if m.dtype == torch.bool:
        return bool(torch.equal(m, future))
    if not m.is_floating_point():
        return False
    return bool((m[future] <= -1e4).all()) and bool((m[~future] == 0).all())
