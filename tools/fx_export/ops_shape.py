"""Layout ops (planner/graph/ops_shape.cc): reshape and its PyTorch spellings
(view, unsqueeze, squeeze, unflatten, nn.Unflatten), transpose and permute
(.T, .mT, .t(), swapaxes, swapdims), flatten, indexing and slicing (x[...]),
concat and stack,
split, chunk and unbind, expand, repeat and repeat_interleave (int
repeats), flip, the no-ops (nn.Identity, contiguous, clone, a cast to the
same dtype), and the embedding lookup (nn.Embedding, F.embedding), which the
planner also counts as a layout op; and the selections by a constant mask:
tril, triu and torch.where (a multiplication by the 0/1 mask)."""

import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import registry
from .ir import IrTensor, LstmState, Static, ir_dtype, is_causal_mask
from .ops_attention import _masked_fill_method
from .ops_lstm import lstm_state

# ---- reshape ---------------------------------------------------------------


def same_or_reshape(ex, x):
    """x as the current node's traced shape (a view, unsqueeze, ...)."""
    return ex.reshape(ex.base_name(ex.node), x, ex.out_shape(),
                      ex.scope_of(ex.node))


@registry.functions(torch.reshape, torch.unsqueeze, torch.squeeze)
def _reshape(ex, call):
    return same_or_reshape(ex, call.tensor(0, "input"))


@registry.methods("reshape", "view", "view_as", "reshape_as", "unsqueeze",
                  "squeeze", "unflatten")
def _reshape_method(ex, call, x):
    return same_or_reshape(ex, x)


@registry.modules(nn.Unflatten)
def _unflatten_module(ex, call):
    x = call.x0()
    return ex.reshape(call.name, x, ex.out_shape(), call.scope)


# ---- transpose and permute -------------------------------------------------


def _reversed_axes(ex, x, name, scope):
    """x with its axes in reverse order (.T, torch.t)."""
    return ex.transpose(name, x, list(range(len(x.shape)))[::-1], scope)


def _norm_dims(ex, dims, x):
    """permute's dims (varargs or one list) with negative ones resolved,
    checked to be a permutation of x's axes."""
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    rank = len(x.shape)
    out = [d + rank if isinstance(d, int) and d < 0 else d for d in dims]
    if sorted(out) != list(range(rank)):
        ex.fail(f"permute dims {list(dims)} are not a permutation of the "
                f"{rank} axes of {list(x.shape)}")
    return out


def _transpose_dims(ex, x, d0, d1):
    """x with axes d0 and d1 swapped (torch.transpose)."""
    rank = len(x.shape)
    perm = list(range(rank))
    d0, d1 = d0 % rank, d1 % rank
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return ex.transpose(ex.base_name(ex.node), x, perm, ex.scope_of(ex.node))


@registry.functions(torch.transpose)
def _transpose(ex, call):
    return _transpose_dims(ex, call.tensor(0, "input"), call.value(1, "dim0"),
                           call.value(2, "dim1"))


@registry.methods("transpose")
def _transpose_method(ex, call, x):
    return _transpose_dims(ex, x, call.value(1, "dim0"), call.value(2, "dim1"))


# transpose's other names: swapaxes (numpy's, with axis0/axis1) and swapdims.
def _swapped(ex, call, x):
    numpy = call.node.target in (torch.swapaxes, "swapaxes")
    d0, d1 = ("axis0", "axis1") if numpy else ("dim0", "dim1")
    return _transpose_dims(ex, x, call.value(1, d0), call.value(2, d1))


@registry.functions(torch.swapaxes, torch.swapdims)
def _swapaxes(ex, call):
    return _swapped(ex, call, call.tensor(0, "input"))


@registry.methods("swapaxes", "swapdims")
def _swapaxes_method(ex, call, x):
    return _swapped(ex, call, x)


@registry.functions(torch.permute)
def _permute(ex, call):
    n = call.node
    x = call.tensor(0, "input")
    return ex.transpose(ex.base_name(n), x,
                        _norm_dims(ex, [call.value(1, "dims")], x),
                        ex.scope_of(n))


@registry.methods("permute")
def _permute_method(ex, call, x):
    n = call.node
    # x.permute(1, 0), x.permute((1, 0)) or x.permute(dims=(1, 0)) (the
    # keyword was read as no dims: the identity).
    dims = list(call.args[1:]) if len(call.args) > 1 else \
        [call.kwargs.get("dims", ())]
    return ex.transpose(ex.base_name(n), x, _norm_dims(ex, ex.v(dims), x),
                        ex.scope_of(n))


@registry.functions(torch.t)
def _t(ex, call):
    n = call.node
    t = call.tensor(0, "input")
    return _reversed_axes(ex, t, ex.base_name(n), ex.scope_of(n))


@registry.methods("t")
def _t_method(ex, call, x):
    n = call.node
    return _reversed_axes(ex, x, ex.base_name(n), ex.scope_of(n))


@registry.functions(getattr)
def _tensor_attribute(ex, call):
    """x.T and x.mT (fx records attribute reads as getattr calls)."""
    n = call.node
    x, attr = call.args[0], call.args[1]
    if attr == "T":
        t = ex.t(x)
        return _reversed_axes(ex, t, ex.base_name(n), ex.scope_of(n))
    if attr == "mT":
        t = ex.t(x)
        perm = list(range(len(t.shape)))
        perm[-2:] = perm[-1], perm[-2]
        return ex.transpose(ex.base_name(n), t, perm, ex.scope_of(n))
    ex.fail(f"tensor attribute '{attr}' is not supported")


# ---- flatten ---------------------------------------------------------------


def flatten(ex, x, start, end):
    """x with dims start..end merged (a rank-0 x becomes [1])."""
    rank = len(x.shape)
    if rank == 0:
        return ex.reshape(ex.base_name(ex.node), x, (1,),
                          ex.scope_of(ex.node))
    s = start + rank if start < 0 else start
    e = end + rank if end < 0 else end
    if s == e:
        return x
    return ex.op("flatten", [x], {"start_dim": s, "end_dim": e})


@registry.modules(nn.Flatten)
def _flatten_module(ex, call):
    return flatten(ex, call.x0(), call.mod.start_dim, call.mod.end_dim)


@registry.functions(torch.flatten)
def _flatten(ex, call):
    return flatten(ex, call.tensor(0, "input"), call.value(1, "start_dim", 0),
                   call.value(2, "end_dim", -1))


@registry.methods("flatten")
def _flatten_method(ex, call, x):
    return flatten(ex, x, call.value(1, "start_dim", 0),
                   call.value(2, "end_dim", -1))


# ---- indexing --------------------------------------------------------------


@registry.functions(operator.getitem)
def _getitem(ex, call):
    """base[idx]: an element of a tuple (a module's outputs), a row of an
    nn.LSTM's h_n, or basic indexing of a tensor (slice ops along each
    indexed axis, then a reshape for the ints and Nones)."""
    n = call.node
    base, idx = n.args
    bv = ex.env[base] if isinstance(base, fx.Node) else base
    if isinstance(bv, (tuple, list)):
        i = ex.v(idx)
        el = bv[i]
        if el is None:
            ex.fail("uses an output that the exporter does not produce "
                    "(e.g. the attention weights of MultiheadAttention)")
        return el
    if isinstance(bv, LstmState) and isinstance(ex.v(idx), int):
        return lstm_state(ex, bv, ex.v(idx))
    x = ex.t(base)
    idx = ex.v(idx)
    # A uint8 index is a mask in PyTorch, as a bool one (not rows).
    if isinstance(idx, torch.Tensor) and not idx.is_floating_point() and \
            idx.dtype not in (torch.bool, torch.uint8):
        return gather_rows(ex, x, idx, ex.base_name(n), ex.scope_of(n))
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(i, (torch.Tensor, list)) or isinstance(i, bool)
           for i in idx):
        ex.fail("advanced (tensor/list) indexing is not supported, except "
                "rows picked by one constant integer tensor (table[index])")
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    rank = len(x.shape)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (rank - n_real) + idx[k + 1:]
    idx = tuple(i for i in idx if i is not None)
    idx = idx + (slice(None),) * (rank - len(idx))
    cur = x
    name = ex.base_name(n)
    scope = ex.scope_of(n)
    for axis, i in enumerate(idx):
        size = x.shape[axis]
        if isinstance(i, int):
            start = i + size if i < 0 else i
            end = start + 1
        else:
            start, end, step = i.indices(size)
            if step < 1:
                ex.fail("slicing with a negative step is not supported")
            if step > 1:
                if not range(start, end, step):
                    ex.fail("empty slice")
                cur = strided_slice(ex, cur, axis, start, end, step, name,
                                    scope)
                continue
        if (start, end) == (0, size):
            continue
        if end <= start:
            ex.fail("empty slice")
        cur = slice_axis(ex, cur, axis, start, end, name, scope)
    return ex.reshape(name, cur, ex.out_shape(), scope)


def slice_axis(ex, x, axis, start, end, name, scope):
    """x[..., start:end, ...] along `axis` (x itself for the whole axis)."""
    if (start, end) == (0, x.shape[axis]):
        return x
    shape = list(x.shape)
    shape[axis] = end - start
    return ex.emit("slice", name, [x], {"axis": axis, "start": start,
                                        "end": end}, tuple(shape),
                   scope=scope)


def strided_slice(ex, x, axis, start, end, step, name, scope):
    """x[..., start:end:step, ...] (step > 1, not empty): the elements
    start, start + step, ... as a slice of `count * step` elements viewed
    as [count, step] and its first column; the last element by a slice of
    its own where those would run past the axis."""
    count = len(range(start, end, step))
    size = x.shape[axis]
    whole = count if start + count * step <= size else count - 1
    parts = []
    if whole:
        span = slice_axis(ex, x, axis, start, start + whole * step, name,
                          scope)
        shape = list(x.shape)
        split = shape[:axis] + [whole, step] + shape[axis + 1:]
        cols = ex.reshape(name, span, split, scope)
        first = slice_axis(ex, cols, axis + 1, 0, 1, name, scope)
        shape[axis] = whole
        parts.append(ex.reshape(name, first, shape, scope))
    if whole < count:
        last = start + whole * step
        parts.append(slice_axis(ex, x, axis, last, last + 1, name, scope))
    if len(parts) == 1:
        return parts[0]
    shape = list(x.shape)
    shape[axis] = count
    return ex.emit("concat", name, parts, {"axis": axis}, tuple(shape),
                   scope=scope)


def gather_rows(ex, table, index, name, scope):
    """table[index] for a constant integer tensor `index` (torchvision's
    relative position bias: a learned table read at constant positions):
    a constant one-hot matrix [index elements, rows] times the table's rows
    ([rows, rest]), so the table gets its gradient as in PyTorch; shaped as
    index's shape + the table's other dimensions."""
    if not table.shape:
        ex.fail("indexes a 0-dimensional tensor with a tensor")
    rows = table.shape[0]
    flat = index.reshape(-1).long()
    if flat.numel() == 0:
        ex.fail("indexes with an empty tensor")
    if bool(((flat < -rows) | (flat >= rows)).any()):
        ex.fail(f"indexes {rows} rows with an index outside [-{rows}, "
                f"{rows})")
    flat = torch.where(flat < 0, flat + rows, flat)
    one_hot = torch.zeros(flat.numel(), rows, dtype=torch.float64)
    one_hot[torch.arange(flat.numel()), flat] = 1.0
    rest = list(table.shape[1:])
    width = 1
    for d in rest:
        width *= d
    pick = ex.const(one_hot, table, "the one-hot rows of the constant index")
    t2 = ex.reshape(name, table, (rows, width), scope)
    out = ex.emit("matmul", name, [pick, t2], shape=(flat.numel(), width),
                  scope=scope)
    return ex.reshape(name, out, tuple(index.shape) + tuple(rest), scope)


# ---- padding and rolling ---------------------------------------------------


def take_along(ex, x, axis, indices, name, scope,
               what="the one-hot matrix of a padding"):
    """The elements `indices` (constants) of x along `axis`: a matmul by a
    constant one-hot matrix [size, len(indices)] with the axis last (moved
    there and back by transposes), so each picked element's gradient goes
    back to where it came from."""
    size, rank = x.shape[axis], len(x.shape)
    pick = torch.zeros(size, len(indices), dtype=torch.float64)
    for j, i in enumerate(indices):
        pick[i, j] = 1.0
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    t = ex.transpose(name, x, perm, scope)
    k = ex.const(pick, x, what)
    t = ex.emit("matmul", name, [t, k], shape=t.shape[:-1] + (len(indices),),
                scope=scope)
    return ex.transpose(name, t, perm, scope)


def _pad_indices(mode, size, before, after):
    """The source indices of the `before` and `after` elements F.pad adds
    along an axis of `size` in mode reflect, replicate or circular."""
    if mode == "reflect":
        return (list(range(before, 0, -1)),
                list(range(size - 2, size - 2 - after, -1)))
    if mode == "replicate":
        return [0] * before, [size - 1] * after
    return (list(range(size - before, size)), list(range(after)))  # circular


def pad(ex, x, pads, mode, value, name, scope):
    """F.pad: in constant mode each padded side a concat with a constant of
    the fill value, each negative one a slice (torchvision's Swin pads its
    feature maps to whole windows); in reflect, replicate and circular
    modes each side a concat with the input's elements it copies (a
    one-hot matmul), as HDemucs and image generators pad."""
    pads = [int(p) for p in pads]
    if mode not in ("constant", "reflect", "replicate", "circular"):
        ex.fail(f"F.pad mode '{mode}' is not supported")
    if len(pads) % 2 or len(pads) // 2 > len(x.shape):
        ex.fail(f"F.pad's pad {pads} does not pair up with the input's "
                f"{len(x.shape)} dimensions")
    if mode != "constant":
        return _pad_copying(ex, x, pads, mode, name, scope)
    value = 0.0 if value is None else float(value)
    cur = x
    for k in range(len(pads) // 2):
        axis = len(x.shape) - 1 - k
        before, after = int(pads[2 * k]), int(pads[2 * k + 1])
        size = cur.shape[axis]
        if -before - after >= size:
            ex.fail(f"F.pad's pad {pads} leaves dimension {axis} empty")
        cur = slice_axis(ex, cur, axis, max(0, -before),
                         size - max(0, -after), name, scope)
        parts = []
        for width in (before, after):
            if width > 0:
                shape = list(cur.shape)
                shape[axis] = width
                parts.append(ex.const(torch.full(shape, value), cur))
            else:
                parts.append(None)
        if parts[0] is None and parts[1] is None:
            continue
        joined = [t for t in (parts[0], cur, parts[1]) if t is not None]
        shape = list(cur.shape)
        shape[axis] = sum(t.shape[axis] for t in joined)
        cur = ex.emit("concat", name, joined, {"axis": axis}, tuple(shape),
                      scope=scope)
    return cur


@registry.functions(F.pad)
def _pad(ex, call):
    return pad(ex, call.tensor(0, "input"), list(call.value(1, "pad")),
               call.value(2, "mode", "constant"), call.value(3, "value", None),
               ex.base_name(call.node), ex.scope_of(call.node))


_PAD_MODULES = {nn.ZeroPad2d: "constant", nn.ConstantPad1d: "constant",
                nn.ConstantPad2d: "constant", nn.ConstantPad3d: "constant",
                nn.ReflectionPad1d: "reflect", nn.ReflectionPad2d: "reflect",
                nn.ReflectionPad3d: "reflect",
                nn.ReplicationPad1d: "replicate",
                nn.ReplicationPad2d: "replicate",
                nn.ReplicationPad3d: "replicate"}


@registry.modules(*_PAD_MODULES)
def _pad_module(ex, call):
    mod = call.mod
    mode = next(m for cls, m in _PAD_MODULES.items() if isinstance(mod, cls))
    return pad(ex, call.x0(), list(mod.padding), mode,
               getattr(mod, "value", None), call.name, call.scope)


def _pad_copying(ex, x, pads, mode, name, scope):
    """F.pad in reflect, replicate or circular mode (PyTorch pads the last
    1-3 dims of a batched input so: checked by its own run first)."""
    cur = x
    for k in range(len(pads) // 2):
        axis = len(x.shape) - 1 - k
        before, after = int(pads[2 * k]), int(pads[2 * k + 1])
        size = cur.shape[axis]
        if before < 0 or after < 0:
            ex.fail(f"F.pad mode '{mode}' with a negative pad {pads} is not "
                    f"supported")
        if mode == "reflect" and max(before, after) >= size:
            ex.fail(f"F.pad mode 'reflect' pads {max(before, after)} on a "
                    f"dimension of {size}: it must be less")
        if mode == "circular" and max(before, after) > size:
            ex.fail(f"F.pad mode 'circular' pads {max(before, after)} on a "
                    f"dimension of {size}: at most that")
        if before == 0 and after == 0:
            continue
        lo, hi = _pad_indices(mode, size, before, after)
        parts = [take_along(ex, cur, axis, lo, name, scope)] if lo else []
        parts.append(cur)
        if hi:
            parts.append(take_along(ex, cur, axis, hi, name, scope))
        shape = list(cur.shape)
        shape[axis] = size + before + after
        cur = ex.emit("concat", name, parts, {"axis": axis}, tuple(shape),
                      scope=scope)
    return cur


def roll(ex, x, shifts, dims, name, scope):
    """torch.roll along `dims`: per dimension, the last `shift` elements
    moved to the front (a concat of two slices)."""
    if isinstance(shifts, int):
        shifts = (shifts,)
    if dims is None:
        ex.fail("torch.roll without dims (of the flattened tensor) is not "
                "supported")
    if isinstance(dims, int):
        dims = (dims,)
    if len(shifts) != len(dims):
        ex.fail(f"torch.roll's shifts {list(shifts)} and dims {list(dims)} "
                f"differ in length")
    cur = x
    for shift, dim in zip(shifts, dims):
        rank = len(x.shape)
        if not -rank <= dim < rank:
            ex.fail(f"torch.roll's dim {dim} is outside the {rank} axes of "
                    f"{list(x.shape)}")
        axis = dim % rank
        size = x.shape[axis]
        shift = int(shift) % size
        if shift == 0:
            continue
        tail = slice_axis(ex, cur, axis, size - shift, size, name, scope)
        head = slice_axis(ex, cur, axis, 0, size - shift, name, scope)
        cur = ex.emit("concat", name, [tail, head], {"axis": axis},
                      tuple(cur.shape), scope=scope)
    return cur


@registry.functions(torch.roll)
def _roll(ex, call):
    return roll(ex, call.tensor(0, "input"), call.value(1, "shifts"),
                call.value(2, "dims", None), ex.base_name(call.node),
                ex.scope_of(call.node))


@registry.methods("roll")
def _roll_method(ex, call, x):
    return roll(ex, x, call.value(1, "shifts"), call.value(2, "dims", None),
                ex.base_name(call.node), ex.scope_of(call.node))


# Flipping a dim is a matmul by a constant [n, n] anti-identity: one op
# (and two transposes) whatever n, where slices and a concat would take n + 1
# ops; the constant grows with the square, so long dims are refused.
FLIP_LIMIT = 4096


def flip(ex, x, dims, what):
    """x reversed along each of `dims` (take_along with the indices
    n - 1, ..., 0: a matmul by the constant anti-identity)."""
    if isinstance(dims, int):
        dims = [dims]
    rank = len(x.shape)
    axes = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or \
                not -rank <= d < rank:
            ex.fail(f"{what} over dim {d!r} of a rank-{rank} tensor")
        axes.append(d % rank)
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    cur = x
    for axis in axes:
        n = x.shape[axis]
        if n > FLIP_LIMIT:
            ex.fail(f"{what} of a dim of {n} elements is not supported (at "
                    f"most {FLIP_LIMIT}: it is a matmul by a constant "
                    f"[{n}, {n}] anti-identity)")
        if n > 1:
            cur = take_along(ex, cur, axis, list(range(n - 1, -1, -1)), name,
                             scope, what=f"the anti-identity of {what}")
    return cur


def _varargs(call, keyword):
    """A method's int varargs (x.flip(0, 1)), one list of them
    (x.flip([0, 1])) or the keyword `keyword`."""
    args = list(call.args[1:])
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        return list(args[0])
    if not args and keyword in call.kwargs:
        return call.kwargs[keyword]
    return args


@registry.functions(torch.flip)
def _flip(ex, call):
    return flip(ex, call.tensor(0, "input"), call.value(1, "dims"),
                "torch.flip")


@registry.methods("flip")
def _flip_method(ex, call, x):
    return flip(ex, x, ex.v(_varargs(call, "dims")), "Tensor.flip")


@registry.functions(torch.fliplr, torch.flipud)
def _fliplr_ud(ex, call):
    f = call.node.target
    return flip(ex, call.tensor(0, "input"), [1 if f is torch.fliplr else 0],
                f"torch.{f.__name__}")


@registry.methods("fliplr", "flipud")
def _fliplr_ud_method(ex, call, x):
    f = call.node.target
    return flip(ex, x, [1 if f == "fliplr" else 0], f"Tensor.{f}")


# ---- concat, stack, split --------------------------------------------------


def _same_dtype(ex, what, ts):
    """concat takes one dtype (PyTorch promotes mixed ones: the graph did
    not validate)."""
    dtypes = sorted({t.dtype for t in ts})
    if len(dtypes) > 1:
        ex.fail(f"{what} mixes the dtypes {' and '.join(dtypes)} (PyTorch "
                f"promotes them; the IR's concat takes one dtype)")


def _cat(ex, tensors, dim):
    # An empty constant adds nothing (Emformer's memory before the first
    # segment): left out, as the IR holds no empty tensor.
    tensors = [a for a in tensors
               if not (ex.is_static(a) and isinstance(ex.v(a), torch.Tensor)
                       and ex.v(a).numel() == 0)]
    if not tensors:
        ex.fail("concatenates only empty tensors")
    ts = [ex.t(a) for a in tensors]
    if len(ts) == 1:
        return ts[0]
    _same_dtype(ex, "cat", ts)
    rank = len(ts[0].shape)
    return ex.op("concat", ts, {"axis": dim + rank if dim < 0 else dim})


@registry.functions(torch.cat, torch.concat)
def _concat(ex, call):
    return _cat(ex, call.arg(0, "tensors"), call.value(1, "dim", 0))


@registry.functions(torch.stack)
def _stack(ex, call):
    """torch.stack as a concat of the tensors with the new axis added."""
    tensors, dim = call.arg(0, "tensors"), call.value(1, "dim", 0)
    ts = [ex.t(a) for a in tensors]
    _same_dtype(ex, "stack", ts)
    rank = len(ts[0].shape) + 1
    d = dim + rank if dim < 0 else dim
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    parts = []
    for t in ts:
        sh = list(t.shape)
        sh.insert(d, 1)
        parts.append(ex.reshape(f"{name}_in", t, sh, scope))
    if len(parts) == 1:
        return parts[0]
    return ex.op("concat", parts, {"axis": d})


def split(ex, x, sizes_or_n, dim, chunk):
    """The parts of x along `dim` (a tuple of IR tensors): `chunk` parts of
    equal size (the last one smaller), else parts of size `sizes_or_n` (an
    int) or of the listed sizes."""
    rank = len(x.shape)
    d = dim + rank if dim < 0 else dim
    size = x.shape[d]
    if chunk:
        per = -(-size // sizes_or_n)
        sizes = [min(per, size - i) for i in range(0, size, per)]
    elif isinstance(sizes_or_n, int):
        sizes = [min(sizes_or_n, size - i)
                 for i in range(0, size, sizes_or_n)]
    else:
        sizes = list(sizes_or_n)
    shapes = []
    for s in sizes:
        sh = list(x.shape)
        sh[d] = s
        shapes.append(tuple(sh))
    if len(sizes) == 1:
        return (x,)
    return tuple(ex.emit("split", ex.base_name(ex.node), [x],
                         {"axis": d, "sizes": sizes}, outputs=shapes))


@registry.functions(torch.split)
def _split(ex, call):
    return split(ex, call.tensor(0, "input"),
                 call.value(1, "split_size_or_sections"),
                 call.value(2, "dim", 0), False)


@registry.functions(torch.chunk)
def _chunk(ex, call):
    return split(ex, call.tensor(0, "input"), call.value(1, "chunks"),
                 call.value(2, "dim", 0), True)


@registry.methods("split")
def _split_method(ex, call, x):
    return split(ex, x, call.value(1, "split_size"), call.value(2, "dim", 0),
                 False)


@registry.methods("chunk")
def _chunk_method(ex, call, x):
    return split(ex, x, call.value(1, "chunks"), call.value(2, "dim", 0), True)


@registry.functions(torch.tensor_split)
def _tensor_split(ex, call):
    """torch.tensor_split by a number of sections (the first size % n one
    longer) or by indices (mvit's class token: indices=(1,))."""
    a = call.named(["input", "indices_or_sections", "dim"], {"dim": 0})
    if "indices_or_sections" not in a:
        a["indices_or_sections"] = call.kwargs.get(
            "indices", call.kwargs.get("sections"))
    x, how, dim = ex.t(a["input"]), ex.v(a["indices_or_sections"]), \
        ex.v(a["dim"])
    rank = len(x.shape)
    d = dim + rank if dim < 0 else dim
    size = x.shape[d]
    if isinstance(how, int):
        sizes = [size // how + (1 if i < size % how else 0)
                 for i in range(how)]
    else:
        bounds = [0] + [min(max(int(i), 0), size) for i in how] + [size]
        sizes = [max(b - a, 0) for a, b in zip(bounds, bounds[1:])]
    if any(s == 0 for s in sizes):
        ex.fail(f"tensor_split into parts of sizes {sizes}: empty parts "
                f"are not supported")
    return split(ex, x, sizes, d, False)


def unbind(ex, x, dim):
    """The slices of x along `dim`, each without that axis (a split into
    parts of 1 and reshapes)."""
    rank = len(x.shape)
    d = dim + rank if dim < 0 else dim
    if not 0 <= d < rank:
        ex.fail(f"unbind dim {dim} is out of range for {list(x.shape)}")
    shape = list(x.shape[:d]) + list(x.shape[d + 1:])
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    return tuple(ex.reshape(f"{name}_{i}", part, shape, scope)
                 for i, part in enumerate(split(ex, x, 1, d, False)))


@registry.functions(torch.unbind)
def _unbind(ex, call):
    return unbind(ex, call.tensor(0, "input"), call.value(1, "dim", 0))


@registry.methods("unbind")
def _unbind_method(ex, call, x):
    return unbind(ex, x, call.value(1, "dim", 0))


def repeat_interleave(ex, x, repeats, dim, output_size):
    """x with each element along `dim` repeated `repeats` (an int) times:
    a size-1 axis after `dim` expanded to `repeats`, merged back."""
    if not isinstance(repeats, int) or isinstance(repeats, bool):
        ex.fail("repeat_interleave with a tensor of repeats is not "
                "supported (an int is)")
    if dim is None:
        ex.fail("repeat_interleave without dim (of the flattened input) "
                "is not supported")
    rank = len(x.shape)
    d = dim + rank if dim < 0 else dim
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    one = list(x.shape[:d + 1]) + [1] + list(x.shape[d + 1:])
    wide = list(one)
    wide[d + 1] = repeats
    t = ex.reshape(f"{name}_axis", x, one, scope)
    if repeats != 1:
        t = ex.emit("expand", name, [t], {"shape": wide}, shape=tuple(wide),
                    scope=scope)
    return ex.reshape(name, t, ex.out_shape(), scope)


@registry.functions(torch.repeat_interleave)
def _repeat_interleave(ex, call):
    a = call.named(["input", "repeats", "dim", "output_size"],
                   {"dim": None, "output_size": None})
    return repeat_interleave(ex, ex.t(a["input"]), ex.v(a["repeats"]),
                             ex.v(a["dim"]), ex.v(a["output_size"]))


@registry.methods("repeat_interleave")
def _repeat_interleave_method(ex, call, x):
    return repeat_interleave(ex, x, call.value(1, "repeats"),
                             call.value(2, "dim", None), None)


def repeat(ex, x, sizes):
    """x.repeat(*sizes): x (with leading dims of 1 for extra sizes) viewed
    with a dim of 1 before each dim, expanded to the repeat counts there,
    merged back (a reshape, an expand, a reshape)."""
    sizes = list(sizes)
    rank = len(x.shape)
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 1
           for r in sizes):
        ex.fail(f"Tensor.repeat{tuple(sizes)}: the repeats must be ints "
                f">= 1 (an empty result is not supported)")
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    shape = [1] * (len(sizes) - rank) + list(x.shape)
    out = tuple(r * d for r, d in zip(sizes, shape))
    if all(r == 1 for r in sizes):
        return ex.reshape(name, x, out, scope)
    one = [n for d in shape for n in (1, d)]
    wide = [n for r, d in zip(sizes, shape) for n in (r, d)]
    t = ex.reshape(f"{name}_axes", x, one, scope)
    t = ex.emit("expand", name, [t], {"shape": wide}, shape=tuple(wide),
                scope=scope)
    return ex.reshape(name, t, out, scope)


@registry.methods("repeat")
def _repeat_method(ex, call, x):
    return repeat(ex, x, ex.v(_varargs(call, "repeats")))


# ---- selections by a constant mask: tril, triu, where ---------------------


def triangle(ex, x, diagonal, upper, what):
    """x times the constant 0/1 mask of tril (or triu) over its last two
    dims: PyTorch's values and gradient (the masked elements get none)."""
    if len(x.shape) < 2:
        ex.fail(f"{what} of a rank-{len(x.shape)} tensor (it needs 2 dims)")
    if isinstance(diagonal, bool) or not isinstance(diagonal, int):
        ex.fail(f"{what}'s diagonal {diagonal!r} is not an int")
    ones = torch.ones(x.shape[-2:], dtype=torch.float64)
    mask = torch.triu(ones, diagonal) if upper else torch.tril(ones, diagonal)
    if bool(mask.all()):
        return x
    k = ex.const(mask, x, f"the mask of {what}")
    return ex.op("mul", [x, k])


@registry.functions(torch.tril, torch.triu)
def _triangle(ex, call):
    f = call.node.target
    return triangle(ex, call.tensor(0, "input"), call.value(1, "diagonal", 0),
                    f is torch.triu, f"torch.{f.__name__}")


@registry.methods("tril", "triu")
def _triangle_method(ex, call, x):
    f = call.node.target
    return triangle(ex, x, call.value(1, "diagonal", 0), f == "triu",
                    f"Tensor.{f}")


def _fill_number(ex, a, what):
    """The number an argument of where is (a Python number or a 0-dim
    constant), or None for a tensor."""
    if not ex.is_static(a):
        return None
    v = ex.v(a)
    if isinstance(v, torch.Tensor):
        if v.dim() != 0:
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        ex.fail(f"{what} takes tensors or numbers, not {v!r}")
    return float(v)


def where(ex, cond, a, b, what):
    """torch.where(cond, a, b) for a condition known at export (a buffer,
    or computed from constants): a * m + b * (1 - m) with the constant 0/1
    mask m; a number a or b is a constant. With a causal condition (keep
    j <= i) and -inf (or <= -1e4) elsewhere, the scores are marked causal
    for the softmax that must follow (as masked_fill's)."""
    if not ex.is_static(cond):
        ex.fail(f"{what} is supported only with a condition known at export "
                f"(a buffer or computed from constants), not one computed "
                f"from the inputs or parameters")
    m = ex.v(cond)
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        ex.fail(f"{what} needs a boolean condition")
    na, nb = _fill_number(ex, a, what), _fill_number(ex, b, what)
    out = tuple(ex.out_shape())
    for x, keep, fill in ((a, m, nb), (b, ~m, na)):
        if fill is not None and fill <= -1e4 and not ex.is_static(x):
            xt = ex.t(x)
            if len(xt.shape) >= 2 and xt.shape == out and \
                    is_causal_mask(~keep, xt.shape[-2], xt.shape[-1]):
                return xt.with_mask(causal=True)
    for n in (na, nb):
        if n is not None and not math.isfinite(n):
            ex.fail(f"{what} with the fill {n} is supported only as -inf "
                    f"outside a causal condition, into a softmax (other "
                    f"fills must be finite)")
    # The operands that are tensors, the one that depends on the inputs
    # first: the constants take its dtype.
    given = sorted(((x, mask) for x, n, mask in ((a, na, m), (b, nb, ~m))
                    if n is None), key=lambda xm: ex.is_static(xm[0]))
    tensors = [(ex.t(x), mask) for x, mask in given]
    like = tensors[0][0]
    name, scope = ex.base_name(ex.node), ex.scope_of(ex.node)
    terms = []
    for n, mask in ((na, m), (nb, ~m)):
        if n is not None and n != 0 and bool(mask.any()):
            terms.append(ex.const(mask.double() * n, like,
                                  f"the fill of {what}"))
    for t, mask in tensors:
        k = ex.const(mask.double(), like, f"the mask of {what}")
        terms.append(ex.emit("mul", name, [t, k], shape=tuple(
            torch.broadcast_shapes(t.shape, mask.shape)), scope=scope))
    y = terms[0]
    for t in terms[1:]:
        y = ex.emit("add", name, [y, t], shape=tuple(
            torch.broadcast_shapes(y.shape, t.shape)), scope=scope)
    if y.shape != out:
        y = ex.emit("expand", name, [y], {"shape": list(out)}, shape=out,
                    scope=scope)
    return y


@registry.functions(torch.where)
def _where(ex, call):
    if len(call.args) + len(call.kwargs) < 3:
        ex.fail("torch.where(condition) (the indices) is not supported")
    return where(ex, call.arg(0, "condition"), call.arg(1, "input"),
                 call.arg(2, "other"), "torch.where")


@registry.methods("where", tensor_self=False)
def _where_method(ex, call):
    return where(ex, call.arg(1, "condition"), call.args[0],
                 call.arg(2, "other"), "Tensor.where")


@registry.functions(torch.masked_fill)
def _masked_fill(ex, call):
    """torch.masked_fill(x, mask, value): Tensor.masked_fill's."""
    return _masked_fill_method(ex, call, call.tensor(0, "input"))


# ---- expand, no-ops, casts -------------------------------------------------


@registry.methods("expand", "expand_as")
def _expand_method(ex, call, x):
    shape = ex.out_shape()
    if shape == x.shape:
        return x
    return ex.op("expand", [x], {"shape": list(shape)})


@registry.modules(nn.Identity)
def _identity_module(ex, call):
    return call.x0()


@registry.methods("contiguous", "clone")
def _same_method(ex, call, x):
    return x


@registry.methods("float", "double", "half", "bfloat16", "long", "int", "to",
                  "type_as")
def _cast_method(ex, call, x):
    """A cast is supported when it keeps the IR dtype (e.g. .float() of a
    float32 tensor, .to(device))."""
    dt = ex.node.meta.get("hap_dtype")
    if dt is not None and ir_dtype(dt, ex.node.name) != x.dtype:
        ex.fail("dtype conversion is not supported")
    return x


# ---- embedding -------------------------------------------------------------


def embedding(ex, ids_arg, weight, padding_idx=None):
    """The rows of table `weight` (a module parameter or an fx argument) at
    the integer ids `ids_arg`; constant ids 0..n-1 (positions) are the
    table's first n rows. Records that the ids lie below the table's size
    (which bounds a key padding mask computed from them). `padding_idx`:
    PyTorch's, whose row gets no gradient (see _keep_rows)."""
    w = ex.param(weight) if isinstance(weight, torch.Tensor) else ex.t(weight)
    if len(w.shape) != 2:
        ex.fail("the embedding table must have rank 2")
    if isinstance(ids_arg, fx.Node) and isinstance(ex.env[ids_arg], Static):
        ids = ex.env[ids_arg].value
        n = ids.numel() if isinstance(ids, torch.Tensor) else -1
        # Positions 0..n-1, also with leading dimensions of 1
        # (arange(T).unsqueeze(0), as Hugging Face's GPT-2 makes them):
        # the first n rows of the table, reshaped to [..., n, d].
        if (isinstance(ids, torch.Tensor) and ids.dim() >= 1 and
                all(d == 1 for d in ids.shape[:-1]) and
                torch.equal(ids.cpu().reshape(-1), torch.arange(n))) and \
                (padding_idx is None or padding_idx % w.shape[0] >= n):
            rows = w
            if n != w.shape[0]:
                rows = ex.emit("slice", ex.base_name(ex.node), [w],
                               {"axis": 0, "start": 0, "end": n},
                               (n, w.shape[1]))
            return ex.reshape(ex.base_name(ex.node), rows,
                              tuple(ids.shape) + (w.shape[1],),
                              ex.scope_of(ex.node))
        ex.fail("embedding of constant indices other than arange(n) is "
                "not supported")
    ids = ex.t(ids_arg)
    if ids.dtype != "INT64":
        ex.fail("embedding indices must be integers")
    ex.id_limits.setdefault(ids.name, w.shape[0])
    out = ex.op("embedding", [ids, w])
    if padding_idx is None:
        return out
    keep = _keep_rows(ex, ids, padding_idx % w.shape[0], w, weight, out)
    return ex.emit("mul", f"{out.name}_padding_idx", [out, keep], None,
                   out.shape, scope=ex.scope_of(ex.node))


def _keep_rows(ex, ids, pad, w, weight, out):
    """PyTorch's padding_idx: the table's row `pad` gets no gradient (it
    was exported as an ordinary row, which training then moved). The
    lookup is multiplied by the embedding of the ids in a [rows, 1] table
    of ones with a 0 at `pad` (concatenated constants): no gradient reaches
    that row, and its output is 0, PyTorch's while the row is zero (as
    nn.Embedding initialises it; a nonzero one is refused)."""
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        weight = ex.fetch_attr(weight.target)  # F.embedding(ids, self.w)
    if not isinstance(weight, torch.Tensor):
        ex.fail(f"embedding with padding_idx={pad} of a computed table is "
                f"not supported (only of a parameter, whose padding row "
                f"is checked to be zero)")
    if not weight.is_meta and bool(weight.detach()[pad].any()):
        ex.fail(f"embedding with padding_idx={pad}: the padding row is "
                f"not zero (PyTorch keeps it as it is, fixed; the HAP "
                f"export holds a fixed zero row)")
    rows, scope, base = w.shape[0], ex.scope_of(ex.node), out.name
    like = IrTensor("", (), w.dtype)
    runs = []
    for n, value in ((pad, 1.0), (1, 0.0), (rows - pad - 1, 1.0)):
        if n > 0:
            runs.append(ex.const(torch.full((n, 1), value), like))
    table = runs[0] if len(runs) == 1 else ex.emit(
        "concat", f"{base}_keep_table", runs, {"axis": 0}, (rows, 1),
        dtype=w.dtype, scope=scope)
    return ex.emit("embedding", f"{base}_keep", [ids, table], None,
                   ids.shape + (1,), dtype=w.dtype, scope=scope)


def _embedding_options(ex, padding_idx, max_norm, scale_grad_by_freq):
    if max_norm is not None:
        ex.fail("embedding with max_norm is not supported")
    if scale_grad_by_freq:
        ex.fail("embedding with scale_grad_by_freq=True is not supported "
                "(the IR's gradient is not scaled by the ids' frequency)")
    return padding_idx


@registry.modules(nn.Embedding)
def _embedding_module(ex, call):
    mod = call.mod
    pad = _embedding_options(ex, mod.padding_idx, mod.max_norm,
                             mod.scale_grad_by_freq)
    return embedding(ex, call.bound()["input"], mod.weight, pad)


@registry.functions(F.embedding)
def _embedding(ex, call):
    a = call.named(["input", "weight", "padding_idx", "max_norm",
                    "norm_type", "scale_grad_by_freq", "sparse"],
                   {"padding_idx": None, "max_norm": None,
                    "scale_grad_by_freq": False})
    pad = _embedding_options(ex, ex.v(a["padding_idx"]), ex.v(a["max_norm"]),
                             ex.v(a["scale_grad_by_freq"]))
    return embedding(ex, a["input"], a["weight"], pad)
