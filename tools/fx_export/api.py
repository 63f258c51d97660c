"""export(): checks the arguments, wraps the module with a loss when asked,
traces it (tracing.py), runs it once for the shapes (on meta tensors, or on
the example inputs), finds the loss node and runs the Exporter on it."""

import inspect
import keyword
import os
import re
import sysconfig
import traceback

import torch
import torch.fx as fx
import torch.nn as nn

from . import module_state
from .exporter import Exporter
from .ir import ExportError
from .random_guard import (fixed_random_draws, module_settings, other_ends,
                           refusal, same_trace)
from .reparametrizations import refuse_reparametrizations
from .shaped_trace import trace_with_shapes
from .weight_norm import refuse_unsupported_weight_norms, untrace_weight_norms
from .tracing import (HapTracer, Recorder, follow_inplace, inline_wrapped_calls,
                      to_meta)


# How deep fx-wrapped functions calling others are traced into.
_INLINE_DEPTH = 8


class _LossWrapper(nn.Module):
    def __init__(self, model, loss_fn, target, feature_names):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.target, self.feature_names = target, feature_names

    def forward(self, **kwargs):  # replaced by a generated signature below
        raise NotImplementedError


def _wrap_with_loss(module, loss_fn, example_inputs, labels):
    """A module whose forward(features..., labels) returns
    loss_fn(module(features...), labels), with named arguments for fx."""
    if labels not in example_inputs:
        raise ExportError(f"loss= was given as a function, but there is no "
                          f"example input named '{labels}' (pass labels=NAME)")
    names = [k for k in example_inputs if k != labels]
    for n in names + [labels]:
        # They become the wrapper's argument names (generated source).
        if not isinstance(n, str) or not n.isidentifier() or \
                keyword.iskeyword(n) or n == "self":
            raise ExportError(f"example input name {n!r} cannot name a "
                              f"forward argument")
    params = inspect.signature(module.forward).parameters
    kinds = {p.kind for p in params.values()}
    ordered = [p for p in params if p in names]
    extra = [n for n in names if n not in ordered]
    if extra and not kinds & {inspect.Parameter.VAR_POSITIONAL,
                              inspect.Parameter.VAR_KEYWORD}:
        raise ExportError(f"example inputs {extra} are not arguments of "
                          f"{type(module).__name__}.forward")
    if extra or any(params[p].kind == inspect.Parameter.POSITIONAL_ONLY
                    for p in ordered):
        call = ", ".join(ordered + extra)  # *args: by position
    else:
        # By name: an optional argument left out before another one given
        # (forward(src, mask=None, key_padding_mask=None) with src and
        # key_padding_mask) took the next input by position.
        call = ", ".join(f"{n}={n}" for n in ordered)
    src = (f"def forward(self, {', '.join(ordered + extra + [labels])}):\n"
           f"    return self.loss_fn(self.model({call}), {labels})\n")
    scope = {}
    exec(src, scope)  # a real signature for fx to trace
    cls = type(f"{type(module).__name__}WithLoss", (_LossWrapper,),
               {"forward": scope["forward"]})
    w = cls(module, loss_fn, labels, ordered)
    return w


def user_frame(e):
    """ " at FILE:LINE (SOURCE)" for the innermost frame of `e`'s traceback
    in the user's code (not torch's, not the exporter's, not Python's own
    library: importlib's for an error at import), or ""."""
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))),
            os.path.dirname(os.path.abspath(__file__)),
            os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)
    where = ""
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(skip):
            continue
        line = f" ({frame.line.strip()})" if frame.line else ""
        where = f" at {frame.filename}:{frame.lineno}{line}"
    return where


def _trace(root, example_inputs, concrete, end, draws, sites=None):
    """The fx graph of `root`: traced symbolically, else (control flow on
    a shape, `if x.ndim != 2`) with the example inputs' shapes. Random
    draws give the `end` of their range (random_guard)."""
    tracer = HapTracer()
    try:
        with fixed_random_draws(end, draws, sites):
            return tracer.trace(root, concrete_args=concrete or None)
    except ExportError:
        raise
    except Exception as e:  # fx.proxy.TraceError, TypeError, ...
        first = e
    try:
        with fixed_random_draws(end, draws, sites):
            return trace_with_shapes(root, {**concrete, **example_inputs},
                                     concrete or None)
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001
        hint = ""
        if isinstance(e, fx.proxy.TraceError):
            hint = (" (control flow on tensor values is not supported; on "
                    "shapes it is, with the example inputs' shapes)")
        raise ExportError(f"torch.fx cannot trace "
                          f"{type(root).__name__}{user_frame(e)}: "
                          f"{type(e).__name__}: {e}{hint}") from first


def _check_inputs(root, example_inputs):
    """forward's signature, and the forward arguments without an example
    input -> their defaults (fixed in the trace)."""
    sig = inspect.signature(root.forward)
    concrete = {}
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ExportError(f"forward(*{pname}/**{pname}) is not supported; "
                              f"name the arguments")
        if p.kind == p.KEYWORD_ONLY:
            raise ExportError(f"forward's keyword-only argument '{pname}' "
                              f"(after *) cannot be traced by torch.fx; make "
                              f"it an ordinary argument")
        if pname not in example_inputs:
            if p.default is p.empty:
                raise ExportError(f"no example input for forward argument "
                                  f"'{pname}'")
            concrete[pname] = p.default
    extra = [k for k in example_inputs if k not in sig.parameters]
    if extra:
        raise ExportError(f"example inputs {extra} are not arguments of "
                          f"{type(root).__name__}.forward")
    for k, v in example_inputs.items():
        if not isinstance(v, torch.Tensor):
            raise ExportError(f"example input '{k}' is not a tensor")
        if any(d < 1 for d in v.shape):
            # The IR has no empty tensors (hapctl validate: "dimensions
            # must be positive"); an empty batch is refused here.
            raise ExportError(f"example input '{k}' has shape "
                              f"{list(v.shape)}: every dimension must be "
                              f"at least 1")
    return sig, concrete


def _refuse_backward_hooks(root):
    """A backward hook (a module's register_full_backward_hook, a
    parameter's register_hook, or a global one) changes or reads gradients
    in PyTorch; fx records none of them, and the graph trained without it
    with exit status 0. Named instead."""
    g = torch.nn.modules.module
    if g._global_backward_hooks or getattr(g, "_global_backward_pre_hooks", None):
        raise ExportError("a global module backward hook is registered "
                          "(register_module_full_backward_hook): the HAP "
                          "graph cannot run it")
    for path, m in root.named_modules():
        if m._backward_hooks or getattr(m, "_backward_pre_hooks", None):
            raise ExportError(f"module '{path or type(m).__name__}' has a "
                              f"backward hook (register_full_backward_hook): "
                              f"the HAP graph cannot run it")
    for pname, p in root.named_parameters():
        if p._backward_hooks:
            raise ExportError(f"parameter '{pname}' has a gradient hook "
                              f"(register_hook): the HAP graph cannot run it")


def _record_shapes(gm, root, args, run_on):
    """Runs gm once (Recorder) on meta tensors and/or the example inputs
    `args`, as `run_on` says."""
    param_targets = {k for k, _ in gm.named_parameters()}
    if run_on not in ("auto", "meta", "cpu"):
        raise ExportError(f"run_on must be auto, meta or cpu, not "
                          f"{run_on!r}")
    # Runs change the module's buffers (the CPU run: BatchNorm's statistics;
    # either run: an in-place op of forward on a buffer, whose constants are
    # computed for real on meta runs too): put back after.
    saved = [(b, b.detach().clone()) for b in root.buffers()]
    try:
        _run_recorder(gm, root, args, run_on, param_targets)
    finally:
        with torch.no_grad():
            for b, v in saved:
                if b.shape == v.shape:
                    b.copy_(v)
                else:  # a buffer the run resized (a fake quantizer's scale)
                    b.data = v


def _run_error(e):
    """`e` of a run of the traced module, as one line: fx appends "While
    executing %b : [#users=1] = call_module[target=b](...)" and "Original
    traceback: None" to it; that becomes "(at node 'b': call_module b)"."""
    text = str(e)
    head, _, fx_part = text.partition("\n\nWhile executing %")
    where = ""
    m = re.match(r"(\S+) : .*?= (\w+)\[target=([^\]]+)\]", fx_part)
    if m:
        where = f" (at node '{m.group(1)}': {m.group(2)} {m.group(3)})"
    return f"{type(e).__name__}: {head.strip()}{where}"


def _run_recorder(gm, root, args, run_on, param_targets):
    with torch.no_grad():
        done = False
        if run_on in ("auto", "meta"):
            try:
                Recorder(gm, param_targets, meta=True).run(*to_meta(args))
                done = True
            except Exception as e:  # an op without a meta kernel
                if run_on == "meta":
                    raise ExportError(
                        f"running {type(root).__name__} on meta tensors "
                        f"failed: {_run_error(e)}") from e
        if not done:
            # The run is in training mode on the module's own tensors: its
            # buffers (BatchNorm's running statistics, num_batches_tracked)
            # moved by one step on the example inputs, so --weights wrote
            # them moved and the caller's module was changed; dropout drew
            # from the caller's random stream. Both are put back (the
            # buffers by _record_shapes).
            try:
                with torch.random.fork_rng(devices=[]):
                    Recorder(gm, param_targets).run(*args)
            except Exception as e:
                raise ExportError(f"running {type(root).__name__} on the "
                                  f"example inputs failed: "
                                  f"{_run_error(e)}") from e


def _loss_node(gm, loss):
    """The node of the scalar loss among forward's outputs."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    res = out.args[0]
    if loss is not None:
        try:
            res = res[loss]
        except (KeyError, IndexError, TypeError):
            raise ExportError(f"loss={loss!r} does not select an output of "
                              f"forward") from None
    elif isinstance(res, (tuple, list)):
        if not res:
            raise ExportError("forward returned an empty tuple")
        outputs = len(res)
        res = res[0]
        if isinstance(res, fx.Node) and res.meta.get("hap_shape", ()) != () \
                and outputs > 1:
            raise ExportError(
                f"forward returned {outputs} outputs and the first, taken as "
                f"the loss, has shape {list(res.meta['hap_shape'])}: pass "
                f"the loss's index (--loss INDEX, export(loss=INDEX))")
    elif isinstance(res, dict):
        if "loss" not in res:
            raise ExportError("forward returned a dict without 'loss'")
        res = res["loss"]
    if not isinstance(res, fx.Node) or "hap_shape" not in res.meta:
        raise ExportError("forward must return the scalar loss tensor")
    if res.meta["hap_shape"] != ():
        raise ExportError(f"forward must return the scalar loss, but its "
                          f"output has shape {list(res.meta['hap_shape'])}"
                          f" (add a loss such as nn.CrossEntropyLoss)")
    return res


def export(module, example_inputs, loss=None, labels="labels", name=None,
           return_values=False, run_on="auto"):
    """Traces `module` and returns the HAP graph as a dict (proto3 JSON form).

    module:          an nn.Module.
    example_inputs:  dict forward-argument name -> example tensor; shapes are
                     the graph's (concrete, batch size included). Forward
                     arguments not given must have defaults (they are fixed).
    loss:            None: the forward returns the scalar loss (or a tuple
                     whose first element, or a dict whose 'loss' entry, is it);
                     an int/str: the index/key of the loss in the output;
                     a callable (e.g. nn.CrossEntropyLoss()): the loss is
                     loss(module(**features), example_inputs[labels]).
    labels:          with a callable loss, the name of the target input.
    name:            graph name (default: the module's class name, lower case).
    run_on:          how shapes are found: "meta" runs the module once on
                     meta tensors (no memory or arithmetic: quick even at full
                     size), "cpu" on the real example inputs, "auto" (default)
                     tries meta first and falls back to cpu.
    return_values:   also return {parameter name: its current PyTorch value}
                     (q/k/v slices of in_proj_weight, constants filled), e.g.
                     to run the graph with the module's weights;
                     state_dict_weights(graph, values) turns them back into
                     state_dict tensors.

    The module is left as it was, also when the export fails: attributes
    forward set while traced are put back (module_state). A tensor
    reparametrized by torch.nn.utils.parametrize, spectral_norm or prune
    is refused before tracing (reparametrizations).
    """
    if not isinstance(module, nn.Module):
        raise ExportError(f"expected an nn.Module, got {type(module).__name__}")
    if not isinstance(example_inputs, dict) or \
            not all(isinstance(k, str) for k in example_inputs):
        raise ExportError(f"example_inputs must be a dict of forward "
                          f"argument name -> example tensor, got "
                          f"{type(example_inputs).__name__}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        # An empty name was taken for no name: the class name, silently.
        raise ExportError(f"the graph name must be a non-empty string, got "
                          f"{name!r}")
    example_inputs = dict(example_inputs)
    root, prefix = module, ""
    if callable(loss) and not isinstance(loss, (str, int)):
        root = _wrap_with_loss(module, loss, example_inputs, labels)
        prefix = "model"  # the wrapper's submodule; not part of any name
        loss = None
    sig, concrete = _check_inputs(root, example_inputs)
    _refuse_backward_hooks(root)
    refuse_unsupported_weight_norms(root)
    refuse_reparametrizations(root)

    # Put back after (module_state): attributes forward sets while traced,
    # the tracer's constants, every module's training flag.
    saved = module_state.snapshot(root)
    root.train()
    try:
        draws, sites = [], []
        graph = _trace(root, example_inputs, concrete, "low", draws, sites)
        settings = module_settings(root, graph) if draws else None
        for end in other_ends(sites) if draws else ():
            other = _trace(root, example_inputs, concrete, end, [])
            if not same_trace(root, graph, other) or \
                    module_settings(root, other) != settings:
                raise refusal(draws[0])
        untrace_weight_norms(root, graph)
        gm = fx.GraphModule(root, graph)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = list(sig.parameters)
        args, input_nodes = [], {}
        for pname, n in zip(names, placeholders):
            if pname in example_inputs:
                args.append(example_inputs[pname])
                input_nodes[n] = example_inputs[pname]
            else:
                args.append(concrete[pname])
                input_nodes[n] = None
        _record_shapes(gm, root, args, run_on)
        # fx-wrapped functions (torchvision's shifted_window_attention):
        # traced into now that their arguments' shapes are known, then
        # the graph is run again (their bodies may call others).
        for _ in range(_INLINE_DEPTH):
            changed, why = inline_wrapped_calls(gm)
            if why is not None:
                raise ExportError(why)
            if not changed:
                break
            gm.recompile()
            _record_shapes(gm, root, args, run_on)
        why = follow_inplace(gm)
        if why is not None:
            raise ExportError(why)
        if any("hap_static" not in n.meta for n in gm.graph.nodes):
            # follow_inplace wrote a fill through a slice as new ops.
            gm.recompile()
            _record_shapes(gm, root, args, run_on)
        res = _loss_node(gm, loss)
        input_nodes = {n: t for n, t in input_nodes.items() if t is not None}
        gname = name or type(module).__name__.lower()
        ex = Exporter(gm, root, gname, res, input_nodes, module=module,
                      prefix=prefix)
        g = ex.run()
        return (g, ex.values) if return_values else g
    finally:
        module_state.restore(saved)
