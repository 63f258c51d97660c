"""Module tensors PyTorch recomputes from others on every forward or every
access, other than torch.nn.utils.weight_norm's (weight_norm.py): refused
before tracing, naming the module, the tensor and what to do.

  torch.nn.utils.parametrize (register_parametrization, and what is built
      on it: parametrizations.orthogonal, parametrizations.spectral_norm):
      the module's class is swapped for "Parametrized<Class>" and the
      tensor is a property computing the parametrization of
      `parametrizations.<name>.original`. No handler reads it: the export
      failed with "uses a tensor that is not a parameter of the module".
  torch.nn.utils.spectral_norm: a forward pre-hook that, in training mode,
      runs a power iteration updating the buffers <name>_u and <name>_v in
      place on every forward before dividing <name>_orig by the spectral
      norm; the graph cannot update them per step as PyTorch does. The
      export failed with "forward must return the scalar loss tensor".
  torch.nn.utils.prune: a forward pre-hook computing <name> = <name>_orig *
      <name>_mask; failed as spectral_norm did.
"""

from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm

from .ir import ExportError


def _where(path, name):
    return f"{path}.{name}" if path else name


def _module(path):
    return f"model.{path}" if path else "model"


def refuse_reparametrizations(root):
    """Raises ExportError for the first module of `root` with a
    parametrization, a spectral_norm or a pruning hook."""
    for path, mod in root.named_modules():
        if parametrize.is_parametrized(mod):
            cls = type(mod).__bases__[0].__name__
            for name, plist in mod.parametrizations.items():
                kinds = ", ".join(type(p).__name__ for p in plist)
                raise ExportError(
                    f"'{_where(path, name)}' ({cls}) is parametrized by "
                    f"torch.nn.utils.parametrize ({kinds}), which is not "
                    f"supported: the HAP graph cannot recompute it from "
                    f"'{_where(path, f'parametrizations.{name}.original')}'"
                    f" as PyTorch does. Remove the parametrization before "
                    f"export: torch.nn.utils.parametrize."
                    f"remove_parametrizations({_module(path)}, '{name}') "
                    f"keeps its current value as a plain parameter "
                    f"(trained as such from then on)")
        for hook in mod._forward_pre_hooks.values():
            if isinstance(hook, SpectralNorm):
                raise ExportError(
                    f"torch.nn.utils.spectral_norm of "
                    f"'{_where(path, hook.name)}' ({type(mod).__name__}) is "
                    f"not supported: in training mode PyTorch updates its "
                    f"power iteration vectors '{hook.name}_u' and "
                    f"'{hook.name}_v' on every forward, which the HAP graph "
                    f"cannot. Remove it before export: torch.nn.utils."
                    f"remove_spectral_norm({_module(path)}, "
                    f"'{hook.name}') keeps the normalised weight as a "
                    f"plain parameter (trained as such from then on)")
            if isinstance(hook, BasePruningMethod):
                name = getattr(hook, "_tensor_name", "weight")
                raise ExportError(
                    f"torch.nn.utils.prune of '{_where(path, name)}' "
                    f"({type(mod).__name__}) is not supported: PyTorch "
                    f"recomputes it as '{name}_orig' * '{name}_mask' "
                    f"before every forward, which the HAP graph does not. "
                    f"Make the pruning permanent before export: "
                    f"torch.nn.utils.prune.remove({_module(path)}, "
                    f"'{name}') (the pruned entries are zeros of a plain "
                    f"parameter then, and trained)")
