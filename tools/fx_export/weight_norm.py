"""Module parameters reparametrised by torch.nn.utils.weight_norm: the
module's `weight` is recomputed before every forward from `weight_g` and
`weight_v` (wav2vec2's and HuBERT's positional convolution), so it is no
parameter of the module; the graph computes it from the two that are:
w = v * g / ||v||, the norm over every dim but `dim`."""

import torch
import torch.fx as fx
from torch.nn.utils.weight_norm import WeightNorm


def _weight_norm_hook(mod, attr):
    for hook in mod._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and hook.name == attr:
            return hook
    return None


def module_weight(ex, mod, path, scope, attr="weight"):
    """The IR tensor of module parameter `attr` of `mod` (at `path`): the
    parameter itself, or its weight_norm composition (mul, sum, rsqrt)."""
    hook = _weight_norm_hook(mod, attr)
    if hook is None:
        return ex.param(getattr(mod, attr))
    g = ex.param(getattr(mod, attr + "_g"))
    v = ex.param(getattr(mod, attr + "_v"))
    rank = len(v.shape)
    dim = hook.dim if hook.dim is not None else -1
    if dim == -1:
        ex.fail(f"weight_norm of '{path}.{attr}' over the whole tensor "
                f"(dim=None) is not supported (a dim is)")
    dim %= rank
    axes = [a for a in range(rank) if a != dim]
    kept = tuple(n if a == dim else 1 for a, n in enumerate(v.shape))
    if tuple(g.shape) != kept:
        ex.fail(f"weight_norm of '{path}.{attr}': {attr}_g has shape "
                f"{list(g.shape)}, not {list(kept)}")
    name = f"{path}_{attr}_norm"
    sq = ex.emit("mul", name, [v, v], None, v.shape, scope=scope)
    s = ex.emit("sum", name, [sq], {"axes": axes, "keepdims": True}, kept,
                scope=scope)
    scale = ex.emit("mul", name, [g, ex.emit("rsqrt", name, [s], None, kept,
                                             scope=scope)],
                    None, kept, scope=scope)
    return ex.emit("mul", name, [v, scale], None, v.shape, scope=scope)


def untrace_weight_norms(root, graph):
    """After tracing: a weight_norm hook ran on the tracer's proxies, left
    `_weight_norm` nodes nobody uses in `graph` (the module call does not
    take its weight as an input; module_weight computes it again) and a
    proxy as the module's `weight` attribute. The nodes are removed and the
    attribute computed again from the parameters, as the hook would."""
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is torch._weight_norm and \
                not n.users:
            graph.erase_node(n)
    for mod in root.modules():
        for hook in list(mod._forward_pre_hooks.values()):
            if isinstance(hook, WeightNorm) and \
                    isinstance(getattr(mod, hook.name, None), fx.Proxy):
                setattr(mod, hook.name, hook.compute_weight(mod))
