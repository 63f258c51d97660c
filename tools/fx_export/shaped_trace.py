"""Tracing a whole module with its input shapes known.

torch.fx traces symbolically: `if x.ndim != 2:` or `if x.size(1) % 2:` in a
forward (torchaudio's wav2vec2 and ConvTasNet, many user models) is control
flow on a traced value, and fx gives up. The HAP graph has static shapes, so
such a branch can be taken as the example inputs take it: this tracer's
proxies carry an example value for every node (tracing.py's _ShapedProxy, as
for fx-wrapped functions) and answer shape, size(), dim(), ndim, dtype and
len() with Python numbers. Control flow on tensor *values* (`if x.sum() > 0`)
still fails: a proxy has no truth value."""

import contextlib

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx import _symbolic_trace

from .random_guard import draws_allowed
from .tracing import _ShapedTracer


@contextlib.contextmanager
def _modules_untraced():
    """nn.Module's __call__ and __getattr__ as they are outside a trace:
    while fx traces, a module call is recorded (or traced into) and a
    parameter read is a proxy, and an example value computed then would
    record nodes of its own."""
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    nn.Module.__call__ = _symbolic_trace._orig_module_call
    nn.Module.__getattr__ = _symbolic_trace._orig_module_getattr
    try:
        yield
    finally:
        nn.Module.__call__, nn.Module.__getattr__ = call, getattr_


class ShapedModuleTracer(_ShapedTracer):
    """Traces `root` with `examples` ({forward argument name: tensor}) as
    the values of its tensor inputs: each op also runs on the example
    values (meta tensors, or zero CPU tensors of the inputs' shapes), so
    every proxy knows its shape."""

    def __init__(self, root, examples, device):
        super().__init__(root, device)
        self._examples = {k: self.example(v) for k, v in examples.items()}

    def create_proxy(self, kind, target, args, kwargs, name=None,
                     type_expr=None, proxy_factory_fn=None):
        # The example value runs the op for real (a leaf Dropout draws):
        # from a fork of the random stream, which the draws' guard checks.
        with _modules_untraced(), draws_allowed(), \
                torch.random.fork_rng(devices=[]):
            p = super().create_proxy(kind, target, args, kwargs, name,
                                     type_expr, proxy_factory_fn)
        if kind == "placeholder" and isinstance(p, fx.Proxy):
            key = target.lstrip("*")
            if key in self._examples:
                p.node.meta["hap_example"] = self._examples[key]
        return p


def trace_with_shapes(root, examples, concrete_args):
    """The fx graph of `root` traced with its inputs' shapes known: on meta
    tensors first (no memory, no arithmetic), then on the example inputs
    for an op without a meta kernel. Raises the last attempt's error."""
    err = None
    for device in ("meta", "cpu"):
        tracer = ShapedModuleTracer(root, examples, device)
        try:
            with _state_kept(root):
                return tracer.trace(root, concrete_args=concrete_args)
        except Exception as e:  # noqa: BLE001
            err = e
    raise err


@contextlib.contextmanager
def _state_kept(root):
    """root's buffers as they were. The example values run leaf modules
    for real in training mode: a BatchNorm moved its running statistics
    (num_batches_tracked by 2, one per attempt), which the graph then
    described and the caller kept. As api._record_shapes does."""
    saved = [(b, b.detach().clone()) for b in root.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                if b.shape == v.shape:
                    b.copy_(v)
                else:  # a buffer the run resized
                    b.data = v
