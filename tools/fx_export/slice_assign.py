"""Assignment into a slice of a computed tensor: `x[:, 1:] = y` and the
augmented form `x[:, :, 1:, 1:] += rel_pos` (torchvision's mvit_v2 adds its
relative positions into the attention scores so; its residual adds into a
slice too).

fx records `x[idx] = v` as operator.setitem(x, idx, v), which returns None
and changes x; `x[idx] += y` as an in-place add on the view x[idx] followed
by that setitem. The later uses of x take, instead, a new tensor:
x * keep + pad(v), keep a constant 0/1 mask that is 0 on the slice and
pad(v) the value broadcast to the slice and padded with zeros to x's shape
(F.pad), so x's gradient is 0 on the slice and v's is the slice of x's, as
in PyTorch. Only basic indexing by constants: ints, slices of step 1 and
Ellipsis."""

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F


def _region(idx, shape):
    """[(start, stop, kept)] per dim of `shape` for basic index `idx` (kept:
    False for an int, which the view drops), or None when idx is not ints,
    slices of step 1 and one Ellipsis."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if sum(i is Ellipsis for i in idx) > 1:
        return None
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:at] + (slice(None),) * fill + idx[at + 1:]
    if len(idx) > len(shape):
        return None
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    region = []
    for i, size in zip(idx, shape):
        if isinstance(i, bool) or not isinstance(i, (int, slice)):
            return None
        if isinstance(i, int):
            if not -size <= i < size:
                return None
            i %= size
            region.append((i, i + 1, False))
            continue
        start, stop, step = i.indices(size)
        if step != 1 or stop <= start:
            return None
        region.append((start, stop, True))
    return region


def augmented_into_slice(n):
    """Whether in-place node `n` changes a view `base[idx]` whose change is
    then written back by `base[idx] = n` (x[idx] += y): n is then the new
    value of the slice, an ordinary op, and the setitem does the write."""
    a = n.args[0]
    if not (a.op == "call_function" and a.target is operator.getitem and
            isinstance(a.args[0], fx.Node)):
        return False
    return any(u.op == "call_function" and u.target is operator.setitem and
               u.args[0] is a.args[0] and u.args[1] == a.args[1] and
               u.args[2] is n for u in n.users)


def assign_through_slice(gm, n, scope):
    """For `x[idx] = v` (node n): the node of x's value after it (x * keep
    + pad(v), built before n), or a message why it cannot be."""
    x, idx, v = n.args[0], n.args[1], n.args[2]
    shape = x.meta["hap_shape"]
    leaves = []
    fx.node.map_arg(idx, leaves.append)
    if not all(a.meta.get("hap_static", False) for a in leaves):
        return "the index depends on the inputs"
    idx = fx.node.map_arg(idx, lambda a: a.meta.get("hap_value"))
    region = _region(idx, shape)
    if region is None:
        return (f"the index {idx!r} is not basic (ints, slices of step 1, "
                f"Ellipsis)")
    keep = torch.ones(shape, dtype=x.meta["hap_dtype"])
    keep[tuple(slice(a, b) for a, b, _ in region)] = 0
    view = [b - a for a, b, kept in region if kept]
    i = 0
    while hasattr(gm, f"_hap_assign_mask{i}"):
        i += 1
    gm.register_buffer(f"_hap_assign_mask{i}", keep, persistent=False)
    graph = gm.graph
    made = []
    with graph.inserting_before(n):
        mask = graph.get_attr(f"_hap_assign_mask{i}")
        kept = graph.call_function(operator.mul, (x, mask))
        made += [mask, kept]
        if isinstance(v, fx.Node) and "hap_shape" in v.meta and \
                not v.meta.get("hap_static"):
            t = v
            if tuple(v.meta["hap_shape"]) != tuple(view):
                t = graph.call_method("expand", (t, *view))
                made.append(t)
            for d, (_, _, kept_dim) in enumerate(region):
                if not kept_dim:
                    t = graph.call_method("unsqueeze", (t, d))
                    made.append(t)
            pads = []
            for (a, b, _), size in reversed(list(zip(region, shape))):
                pads += [a, size - b]
            spread = graph.call_function(F.pad, (t, pads))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            # A number: v where the mask is 0.
            spread = graph.call_function(operator.mul, (
                graph.call_function(operator.sub, (1.0, mask)), float(v)))
            made.append(spread.args[0])
        else:
            return ("the value is not a tensor computed from the inputs or "
                    "a number")
        new = graph.call_function(operator.add, (kept, spread))
        made += [spread, new]
    for m in made:
        m.meta["hap_scope"] = scope
    new.meta.update(hap_shape=shape, hap_dtype=x.meta["hap_dtype"])
    return new
