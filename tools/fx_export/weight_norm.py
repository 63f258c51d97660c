"""Module parameters reparametrised by torch.nn.utils.weight_norm: the
module's `weight` is recomputed before every forward from `weight_g` and
`weight_v` (wav2vec2's and HuBERT's positional convolution), so it is no
parameter of the module; the graph computes it from the two that are:
w = v * g / ||v||, the norm over every dim but `dim`."""

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils.weight_norm import WeightNorm

from .ir import ExportError

# The modules whose handlers compute a weight_norm'ed `weight` (module_weight).
_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
              nn.ConvTranspose2d)


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


def refuse_unsupported_weight_norms(root):
    """Before tracing: a weight_norm of another parameter than the weight
    of a module module_weight serves (a bias, an nn.Embedding, an nn.GRU's
    weight_hh_l0) failed as 'uses a tensor that is not a parameter of the
    module' or 'torch._weight_norm is not supported', naming neither the
    parameter nor weight_norm; it is refused naming both."""
    for path, mod in root.named_modules():
        for hook in mod._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm) and (
                    hook.name != "weight" or not isinstance(mod, _SUPPORTED)):
                where = f"{path}.{hook.name}" if path else hook.name
                raise ExportError(
                    f"torch.nn.utils.weight_norm of '{where}' "
                    f"({type(mod).__name__}) is not supported: only of the "
                    f"weight of nn.Linear, nn.Conv1d/2d/3d and "
                    f"nn.ConvTranspose1d/2d (or remove_weight_norm before "
                    f"export)")
