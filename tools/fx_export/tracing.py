"""Tracing a module with torch.fx and running the traced graph once.

HapTracer records the module path of every node (the ops' scopes) and keeps
PyTorch's transformer modules whole, for the exporter to decompose; Recorder
runs the graph on the example inputs (or on meta tensors, quick at full
size) and stores in each node's meta its shape and dtype, and the value of
the nodes known at export time (sizes, masks, positions); inline_wrapped_calls
then traces into the torch.fx.wrap'ed functions (their arguments' shapes
known), and the Recorder runs again.
"""

import contextlib
import dis
import inspect
import math
import operator
import sys

import torch
import torch.fx as fx
import torch.nn as nn

from .slice_assign import assign_through_slice, augmented_into_slice


def _proxy_iter(self):
    """Proxy.__iter__ for Python 3.11, whose bytecode offsets torch 1.13's
    version does not understand: `a, b = proxy` unpacks by getitem."""
    frame = inspect.currentframe().f_back
    for inst in dis.get_instructions(frame.f_code):
        if inst.offset == frame.f_lasti:
            if inst.opname == "UNPACK_SEQUENCE":
                return (self[i] for i in range(inst.argval))
            break
    return self.tracer.iter(self)


# Tensor factories that accept sizes; with a traced size (x.size(1)) they are
# recorded as graph nodes instead of failing. Their values are known at export
# time (shapes are concrete), so they fold to constants.
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "tensor")


def _wrap_factory(orig):
    def factory(*args, **kwargs):
        proxies = []
        fx.node.map_aggregate((args, kwargs), lambda a: proxies.append(a)
                              if isinstance(a, fx.Proxy) else None)
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", orig, args,
                                                  kwargs)
        return orig(*args, **kwargs)

    factory.__wrapped__ = orig
    return factory


def stochastic_depth_functions():
    """torchvision's stochastic_depth, when the traced code has imported
    torchvision (the exporter does not import it)."""
    mod = sys.modules.get("torchvision.ops.stochastic_depth")
    f = getattr(mod, "stochastic_depth", None)
    return (f,) if f is not None else ()


def is_stochastic_depth(f):
    return f in stochastic_depth_functions()


# torchaudio.functional's functions recorded as one call each: spectrogram
# calls torch.stft, whose complex result the IR cannot hold, and
# amplitude_to_DB's top_db needs a maximum over the tensor. The exporter
# writes them as real ops (ops_audio.py). The transforms call them as
# attributes of the module (F.spectrogram), so the modules' dicts are patched
# too (HapTracer.__init__).
_AUDIO_FUNCTIONS = ("spectrogram", "amplitude_to_DB")
_AUDIO_MODULES = ("torchaudio.functional", "torchaudio.functional.functional")


def audio_functions():
    """{function: name} for torchaudio's spectrogram and amplitude_to_DB,
    when the traced code has imported torchaudio (the exporter does not)."""
    mod = sys.modules.get("torchaudio.functional.functional")
    out = {}
    for name in _AUDIO_FUNCTIONS:
        f = getattr(mod, name, None)
        if f is not None:
            out[f] = name
    return out


def audio_function_name(f):
    """'spectrogram' or 'amplitude_to_DB' for torchaudio's function, else
    None."""
    try:
        return audio_functions().get(f)
    except TypeError:  # an unhashable target
        return None


class TensorAttributeChanged(RuntimeError):
    """forward changed a plain tensor attribute of a module in place."""


def _tensor_attributes(root):
    """[(module path, attribute, tensor, copy)] of the tensors that the
    modules of `root` hold as plain attributes (self.scale = torch.ones(6):
    not parameters or buffers). fx does not trace them: an in-place op of
    forward on one (self.scale.mul_(2)) runs while tracing, changed the
    caller's module and reached the uses before it."""
    out = []
    for path, mod in root.named_modules():
        for k, v in vars(mod).items():
            if type(v) is torch.Tensor and not v.is_meta:
                out.append((path, k, v, v.detach().clone()))
    return out


def _same(t, v):
    """t equals its copy v (NaN equal to NaN)."""
    if t.shape != v.shape or t.dtype != v.dtype:
        return False
    if torch.equal(t, v):
        return True
    return t.is_floating_point() and \
        bool(((t == v) | (t.isnan() & v.isnan())).all())


def _check_tensor_attributes(attrs):
    for path, k, t, v in attrs:
        if not _same(t, v):
            name = f"{path}.{k}" if path else k
            raise TensorAttributeChanged(
                f"forward changes the tensor attribute '{name}' in place "
                f"(not a parameter or buffer: torch.fx runs the change while "
                f"tracing, and records none); register it as a buffer or "
                f"use the op's result")


def _forward_hooks(m):
    """(forward pre-hooks, forward hooks) that Module.__call__ runs for
    `m`: the global ones, then the module's own."""
    g = torch.nn.modules.module
    return (list(g._global_forward_pre_hooks.values()) +
            list(m._forward_pre_hooks.values()),
            list(g._global_forward_hooks.values()) +
            list(m._forward_hooks.values()))


@contextlib.contextmanager
def _without_forward_hooks(m):
    """`m` called without its forward hooks (and the global ones): the
    traced graph holds their ops already (HapTracer.call_module)."""
    g = torch.nn.modules.module
    saved = [(d, dict(d)) for d in (m._forward_pre_hooks, m._forward_hooks,
                                    g._global_forward_pre_hooks,
                                    g._global_forward_hooks)]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)


class HapTracer(fx.Tracer):
    """fx tracer that keeps the transformer modules whole (they are decomposed
    by the exporter) and records the module path of every node."""

    LEAVES = (nn.TransformerEncoderLayer, nn.TransformerEncoder,
              nn.TransformerDecoderLayer, nn.TransformerDecoder,
              nn.Transformer, nn.MultiheadAttention)

    def __init__(self):
        # torchvision's stochastic_depth draws its mask with torch.empty and
        # bernoulli_: recorded as one call (an IR drop_path) instead. Only
        # when the traced code has imported torchvision.
        super().__init__(autowrap_functions=stochastic_depth_functions() +
                         tuple(audio_functions()))
        # The torchaudio modules whose attribute is called (F.spectrogram):
        # fx patches the entries of these dicts that are autowrapped
        # functions, and only those.
        self._autowrap_search += [sys.modules[m] for m in _AUDIO_MODULES
                                  if m in sys.modules]
        self._stack = []
        self._constants = {}  # id(tensor) -> (tensor, copy, attribute)
        # Buffers become get_attr nodes (constants folded at export time), so
        # `self.mask[:S, :S]` with a traced S works.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m, qualname):
        if isinstance(m, self.LEAVES):
            # Kept whole only with the forward the exporter decomposes: a
            # subclass that overrides it (`super().forward(x) * 3`) was
            # exported as its base, its own forward dropped. It is traced
            # through instead (its inner modules kept whole as usual).
            base = next(b for b in type(m).__mro__ if b in self.LEAVES)
            if type(m).forward is base.forward:
                return True
        if not super().is_leaf_module(m, qualname):
            return False
        # The same for torch's subclasses of a supported module made
        # elsewhere (torch.nn.qat.Linear fake-quantizes its weight in a
        # forward of its own; intrinsic ConvBn2d folds a BatchNorm): exported
        # as the base class, their forward was lost with exit status 0. They
        # are traced through, and what their forward calls is exported or
        # named. A family's own classes (nn.GRU beside nn.RNNBase, whose
        # handler names them) are left to their handler.
        from . import registry  # noqa: PLC0415 (registry imports the ops)
        cls = type(m)
        base = registry.handled_base(cls)
        return (base is None or base is cls or cls.forward is base.forward or
                cls.__module__ == base.__module__)

    def call_module(self, m, forward, args, kwargs):
        try:
            path = self.path_of_module(m)
        except NameError:
            path = None
        if path is not None and not self.is_leaf_module(m, path):
            self._stack.append(path)
            try:
                return super().call_module(m, forward, args, kwargs)
            finally:
                self._stack.pop()
        pre, post = _forward_hooks(m)
        if not pre and not post:
            return super().call_module(m, forward, args, kwargs)
        # A module kept whole (a leaf) becomes one node, and fx does not run
        # its forward hooks: `register_forward_hook(lambda m, i, o: o * 2)`
        # was dropped. They run here on the proxies, as Module.__call__
        # runs them, and their ops are traced (recorded in the module's
        # scope; Recorder runs the module itself without them).
        for hook in pre:
            r = hook(m, args)
            if r is not None:
                args = r if isinstance(r, tuple) else (r,)
        out = super().call_module(m, forward, args, kwargs)
        if path is not None:
            self._stack.append(path.rpartition(".")[0])
        try:
            for hook in post:
                r = hook(m, args, out)
                if r is not None:
                    out = r
        finally:
            if path is not None:
                self._stack.pop()
        return out

    def create_arg(self, a):
        """A tensor forward makes from literals (m = torch.zeros(6)) is
        stored by fx as the constant `_tensor_constant<i>`: the tensor
        itself, so that an in-place change of it during tracing
        (m.add_(1), run then and not recorded) reached the uses before the
        change too. Each use now gets the values m has at that point: a
        copy, taken anew when they changed."""
        if type(a) is not torch.Tensor or a in self.tensor_attrs or \
                any(a is b for _, b in self.root.named_buffers()):
            return super().create_arg(a)
        held = self._constants.get(id(a))
        if held is None or held[0] is not a or held[1].dtype != a.dtype or \
                held[1].shape != a.shape or not torch.equal(held[1], a):
            i = 0
            while hasattr(self.root, f"_tensor_constant{i}"):
                i += 1
            copy = a.detach().clone()
            held = (a, copy, f"_tensor_constant{i}")
            setattr(self.root, held[2], copy)
            self._constants[id(a)] = held
        return self.create_node("get_attr", held[2], (), {})

    def create_node(self, kind, target, args, kwargs, name=None,
                    type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["hap_scope"] = self._stack[-1] if self._stack else ""
        # fx records no grad mode: a node forward computes under
        # torch.no_grad() is marked (the exporter refuses one that depends
        # on the inputs or parameters, which PyTorch gives no gradient).
        if not torch.is_grad_enabled():
            node.meta["hap_no_grad"] = True
        return node

    def trace(self, root, concrete_args=None):
        attrs = _tensor_attributes(root)
        try:
            # Gradients on, so that the nodes forward computes under
            # torch.no_grad() are told apart (create_node).
            with _tracing_patches(), torch.enable_grad():
                graph = super().trace(root, concrete_args)
            _check_tensor_attributes(attrs)
            return graph
        finally:
            for _, _, t, v in attrs:
                if not _same(t, v) and t.shape == v.shape:
                    with torch.no_grad():
                        t.copy_(v)


@contextlib.contextmanager
def _tracing_patches():
    """While tracing: Proxy.__iter__ for Python 3.11, and torch's tensor
    factories recorded as nodes when given a traced size."""
    saved_iter = fx.Proxy.__iter__
    saved = {n: getattr(torch, n) for n in _FACTORIES}
    if sys.version_info >= (3, 11):
        fx.Proxy.__iter__ = _proxy_iter
    for n, f in saved.items():
        setattr(torch, n, _wrap_factory(f))
    try:
        yield
    finally:
        fx.Proxy.__iter__ = saved_iter
        for n, f in saved.items():
            setattr(torch, n, f)


# ---- tracing into fx-wrapped functions ---------------------------------------
#
# A library marks a function it cannot trace symbolically with torch.fx.wrap
# (torchvision's shifted_window_attention branches on its input's shape): fx
# records it as one call_function node. Once the Recorder has run, the shapes
# of its arguments are known, and the function is traced again with proxies
# that answer x.shape, x.size() and x.dim() with those numbers; its ops
# replace the node.


def is_fx_wrapped(f):
    """Whether `f` is a function a library passed to torch.fx.wrap (not fx's
    own helpers)."""
    from torch.fx import _symbolic_trace  # noqa: PLC0415
    g = getattr(f, "__globals__", None)
    name = getattr(f, "__name__", None)
    if g is None or (getattr(f, "__module__", "") or "").startswith(
            "torch.fx"):
        return False
    return any(wg is g and wn == name
               for wg, wn in getattr(_symbolic_trace, "_wrapped_fns_to_patch",
                                     ()))


class _ShapedProxy(fx.Proxy):
    """A proxy whose example value (node.meta["hap_example"], a tensor on
    the meta device or a zero CPU one) gives its shape, size, dim, dtype and
    length as Python values."""

    def _example(self):
        return self.node.meta["hap_example"]

    @property
    def shape(self):
        return self._example().shape

    @property
    def ndim(self):
        return self._example().dim()

    @property
    def dtype(self):
        return self._example().dtype

    @property
    def device(self):
        # Meta examples give "meta": a tensor made there fails create_arg
        # and the trace is made again on the CPU examples.
        return self._example().device

    def size(self, dim=None):
        v = self._example()
        return v.size() if dim is None else v.size(dim)

    def dim(self):
        return self._example().dim()

    def numel(self):
        return self._example().numel()

    def __len__(self):
        return len(self._example())

    def __setitem__(self, key, value):
        # fx's Proxy has no item assignment: `mask[a:b, c:d] = k`.
        self.tracer.create_proxy("call_function", operator.setitem,
                                 (self, key, value), {})


def _example_of(a):
    return a.node.meta["hap_example"] if isinstance(a, fx.Proxy) else a


class _ShapedTracer(HapTracer):
    """Traces one function on _ShapedProxy arguments: each op also runs on
    the example values, so that the next op's proxies know their shapes."""

    def __init__(self, gm, device):
        super().__init__()
        self.root, self.graph, self.device = gm, fx.Graph(), device
        self.tensor_attrs = {}

    def proxy(self, node):
        return _ShapedProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None,
                     type_expr=None, proxy_factory_fn=None):
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr,
                                 proxy_factory_fn)
        if kind == "placeholder" or not isinstance(p, fx.Proxy):
            return p
        a, k = fx.node.map_aggregate((args, kwargs), _example_of)
        if kind == "call_function":
            value = target(*a, **k)
        elif kind == "call_method":
            value = getattr(a[0], target)(*a[1:], **k)
        elif kind == "get_attr":
            value = self.example(getattr_path(self.root, target))
        else:  # call_module
            value = self.root.get_submodule(target)(*a, **k)
        p.node.meta["hap_example"] = value
        return p

    def create_arg(self, a):
        if isinstance(a, torch.Tensor) and a.device.type == "meta":
            raise RuntimeError("a tensor made on the meta device while "
                               "tracing into the function")
        return super().create_arg(a)

    def example(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        if self.device == "meta":
            return t.detach().to("meta")
        return t.detach().clone() if not t.is_meta else \
            torch.zeros(t.shape, dtype=t.dtype)


def getattr_path(obj, target):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _trace_wrapped_call(gm, n, device):
    """Traces the function of call_function node `n` with its recorded
    arguments: (its graph, {placeholder: the node of `n` it stands for},
    the function's result in terms of the graph's nodes)."""
    tracer = _ShapedTracer(gm, device)
    stands_for = {}

    def arg(a):
        if not isinstance(a, fx.Node):
            return a
        if a.meta.get("hap_static") and "hap_shape" not in a.meta:
            return a.meta.get("hap_value")  # a size, a list, None
        if "hap_shape" not in a.meta:
            raise RuntimeError(f"argument '{a.name}' is not a tensor")
        p = tracer.create_proxy("placeholder", a.name, (), {})
        if a.meta.get("hap_static"):
            value = tracer.example(a.meta["hap_value"])
        else:
            value = torch.zeros(a.meta["hap_shape"], dtype=a.meta["hap_dtype"],
                                device=device)
        p.node.meta["hap_example"] = value
        stands_for[p.node] = a
        return p

    args, kwargs = fx.node.map_aggregate((n.args, n.kwargs), arg)
    with _tracing_patches(), torch.enable_grad():
        out = n.target(*args, **kwargs)
    out_arg = tracer.create_arg(out)
    return tracer.graph, stands_for, out_arg


def inline_wrapped_calls(gm):
    """Replaces every used call of an fx-wrapped function that has no
    exporter handler by the ops of its body, traced with the recorded
    shapes of its arguments. Returns (whether a call was replaced, None)
    or (False, an error message naming the node that could not be)."""
    from . import registry  # noqa: PLC0415 (registry imports the ops)
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not n.users or \
                registry.function_handler(n.target) is not None or \
                not is_fx_wrapped(n.target):
            continue
        if any("hap_static" not in a.meta for a in n.all_input_nodes):
            # An argument made by a call replaced in this pass: its shape
            # is known after the next run.
            changed = True
            continue
        scope = n.meta.get("hap_scope", "")
        where = f" in {scope}" if scope else ""
        head = (f"node '{n.name}' (call_function {n.target.__module__}."
                f"{n.target.__name__}){where}: ")
        err = None
        # Meta tensors first (no memory, no arithmetic); zero CPU tensors
        # for an op without a meta kernel.
        for device in ("meta", "cpu"):
            try:
                sub, stands_for, out = _trace_wrapped_call(gm, n, device)
                err = None
                break
            except Exception as e:  # noqa: BLE001
                err = e
        if err is not None:
            return False, (f"{head}the exporter traces into this "
                           f"torch.fx.wrap'ed function with its arguments' "
                           f"shapes, and that failed ({type(err).__name__}: "
                           f"{err})")
        env = dict(stands_for)
        with gm.graph.inserting_before(n):
            for sn in sub.nodes:
                if sn.op in ("placeholder", "output"):
                    continue
                new = gm.graph.node_copy(sn, lambda a: env[a])
                new.meta = {"hap_scope": scope}
                env[sn] = new
        result = fx.node.map_arg(out, lambda a: env[a])
        if isinstance(result, fx.Node):
            n.replace_all_uses_with(result)
        else:
            # A tuple of tensors and constants (torchvision's mvit
            # _unsqueeze returns the tensor and its rank), taken apart by
            # getitem nodes: a constant part becomes its value in the
            # getitem's users.
            missing = object()
            for u in list(n.users):
                part = missing
                if isinstance(result, (tuple, list)) and \
                        u.op == "call_function" and \
                        u.target is operator.getitem and \
                        isinstance(u.args[1], int) and \
                        -len(result) <= u.args[1] < len(result):
                    part = result[u.args[1]]
                if isinstance(part, fx.Node):
                    u.replace_all_uses_with(part)
                elif part is not missing and _is_constant(part):
                    for v in list(u.users):
                        v.replace_input_with(u, part)
                else:
                    return False, (f"{head}its result "
                                   f"({type(result).__name__}) is used as "
                                   f"'{u.name}', which the exporter does "
                                   f"not take apart")
                gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        changed = True
    return changed, None


def _is_constant(v):
    """Whether `v` is a Python constant an fx argument can hold: a number,
    bool, string or None, or a tuple or list of them (no node, no
    tensor)."""
    if isinstance(v, (tuple, list)):
        return all(_is_constant(e) for e in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _flat_tensors(v):
    out = []
    fx.node.map_aggregate(v, lambda a: out.append(a)
                          if isinstance(a, torch.Tensor) else None)
    return out


def to_meta(v):
    """`v` (nested lists, tuples, dicts) with every tensor on 'meta'."""
    return fx.node.map_aggregate(
        v, lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a)


def _meta_device_to_cpu(v):
    return fx.node.map_aggregate(
        v, lambda a: torch.device("cpu")
        if isinstance(a, torch.device) and a.type == "meta" else a)


# Methods and functions whose result depends on their first argument's shape
# and dtype only (not on its values): constants when their other arguments
# are (x.new_zeros((H, W)) builds a mask).
_SHAPE_ONLY_METHODS = frozenset({"new_zeros", "new_ones", "new_full"})
_SHAPE_ONLY_FUNCTIONS = (torch.zeros_like, torch.ones_like, torch.full_like)


def _of_shape_only(n):
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.op == "call_method":
        return n.target in _SHAPE_ONLY_METHODS
    return n.op == "call_function" and \
        any(n.target is f for f in _SHAPE_ONLY_FUNCTIONS)


class Recorder(fx.Interpreter):
    """Runs the traced graph once; records each node's shapes/dtypes and the
    values of the nodes that do not depend on inputs or parameters.

    With meta=True the inputs and parameters are 'meta' tensors (shapes only,
    no memory, no arithmetic), so exporting a full-size model is quick;
    constants (masks, arange positions) are still computed for real."""

    def __init__(self, gm, params, meta=False):
        super().__init__(gm)
        self._params = params  # get_attr targets that are nn.Parameters
        self._buffers = {k for k, _ in gm.named_buffers()}
        self.meta = meta

    def call_module(self, target, args, kwargs):
        with _without_forward_hooks(self.fetch_attr(target)):
            return self._call_module(target, args, kwargs)

    def _call_module(self, target, args, kwargs):
        if not self.meta:
            return super().call_module(target, args, kwargs)
        from torch.nn.utils.stateless import functional_call
        mod = self.fetch_attr(target)
        state = {k: v.to("meta") for k, v in
                 list(mod.named_parameters()) + list(mod.named_buffers())}
        if not isinstance(mod, nn.RNNBase):
            return functional_call(mod, state, tuple(args), dict(kwargs))
        # nn.LSTM's forward reads its cached _flat_weights, which
        # functional_call does not swap: the CPU weights met meta inputs
        # ("not at the same device") and --run-on meta failed.
        saved = mod._flat_weights
        mod._flat_weights = [state.get(n) for n in mod._flat_weights_names]
        try:
            return functional_call(mod, state, tuple(args), dict(kwargs))
        finally:
            mod._flat_weights = saved

    def run_node(self, n):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        shape_only = _of_shape_only(n)
        inputs_static = all(a.meta.get("hap_static", False)
                            for a in n.all_input_nodes
                            if not (shape_only and a is n.args[0]))
        folds = n.op in ("call_function", "call_method") and inputs_static
        if self.meta:
            if folds:
                args, kwargs = _meta_device_to_cpu((args, kwargs))
            else:
                args, kwargs = to_meta((args, kwargs))
        if shape_only and isinstance(args[0], torch.Tensor) and \
                args[0].is_meta:
            # x.new_zeros(size) of a meta x: a CPU tensor of x's dtype.
            args = (torch.empty(args[0].shape, dtype=args[0].dtype),) + \
                tuple(args[1:])
        result = getattr(self, n.op)(n.target, args, kwargs)
        if n.op == "call_function" and n.target is operator.setitem and \
                folds and isinstance(args[0], torch.Tensor):
            # `mask[a:b] = k` on a constant: its value is the changed
            # tensor (the uses after it read this node, follow_inplace).
            result = args[0]
        if self.meta and n.op == "get_attr" and n.target in self._params:
            result = result.to("meta")
        # A tensor constant fx made of a literal (torch.zeros(6) in forward:
        # a get_attr `_tensor_constant0`), or a computed one, is copied: an
        # in-place op later in forward (m.add_(1)) changed the tensor that
        # the uses before it read (x + m exported as x + 1), and the
        # traced module's own constant.
        copy = isinstance(result, torch.Tensor) and (
            n.op in ("call_function", "call_method") or
            (n.op == "get_attr" and n.target not in self._params and
             n.target not in self._buffers))
        if copy and n.op == "get_attr":
            result = result.clone()
        tensors = _flat_tensors(result)
        if n.op == "placeholder":
            static = not tensors
        elif n.op == "get_attr":
            static = n.target not in self._params
        elif not tensors:
            static = True  # sizes, dtypes, devices, None: concrete at export
        elif n.op == "call_module":
            static = False
        else:
            static = inputs_static
        n.meta["hap_static"] = static
        if static:
            # A copy of a computed tensor: an in-place op later in forward
            # (m.add_(1)) changes the tensor itself, and the uses before it
            # read the changed values (x + m exported as x + 1).
            if copy:
                n.meta["hap_value"] = result.clone()
            else:
                n.meta["hap_value"] = result
        else:
            n.meta.pop("hap_value", None)
        if isinstance(result, torch.Tensor):
            n.meta["hap_shape"] = tuple(int(d) for d in result.shape)
            n.meta["hap_dtype"] = result.dtype
        return result


# Methods and functions that return a view of their first argument: an
# in-place op on such a view also changes the tensor it views.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
    "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "expand_as",
    "narrow", "select", "split", "chunk", "unbind", "detach", "contiguous",
    "__getitem__"})
_VIEW_FUNCTIONS = frozenset({
    torch.reshape, torch.transpose, torch.permute, torch.t, torch.squeeze,
    torch.unsqueeze, torch.flatten, torch.narrow, torch.select, torch.split,
    torch.chunk, torch.unbind, torch.detach, operator.getitem, getattr})


def _inplace_operator_functions():
    return {getattr(operator, k) for k in
            getattr(fx.graph, "inplace_methods", {}) if hasattr(operator, k)}


def _mutates_first_argument(n):
    """Whether node `n` changes its first argument in place: a Tensor
    method ending in one '_' (add_, relu_) or an in-place operator method
    (x.__imul__(2)), an augmented assignment (operator.iadd for `x += y`),
    `x[i] = y` (operator.setitem), or a
    module or function called with inplace=True (nn.ReLU(inplace=True),
    F.relu(x, inplace=True))."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.op == "call_method":
        t = n.target
        return (t.endswith("_") and not t.endswith("__")) or \
            t in {f"__{k}__" for k in getattr(fx.graph, "inplace_methods", {})}
    if n.op == "call_module":
        mod = n.graph.owning_module.get_submodule(n.target)
        return getattr(mod, "inplace", False) is True
    if n.op == "call_function":
        if n.target in _inplace_operator_functions():
            return True
        # torch's in-place functions (torch.relu_, F.relu_, torch.sigmoid_).
        name = getattr(n.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and \
                (getattr(n.target, "__module__", None) or "").startswith(
                    "torch"):
            return True
        if n.kwargs.get("inplace") is True:
            return True
        try:
            sig = inspect.signature(n.target)
            bound = sig.bind(*n.args, **n.kwargs)
        except (TypeError, ValueError):
            return False
        return bound.arguments.get("inplace") is True
    return False


def _is_view(n):
    if n.op == "call_method":
        return n.target in _VIEW_METHODS
    if n.op == "call_function":
        try:
            return n.target in _VIEW_FUNCTIONS
        except TypeError:  # an unhashable target
            return False
    return False


def _earlier_view_used_later(base, view, n, later):
    """Whether a view of `base` (but `view`; None: any), or a view of one,
    taken before node `n`, is used after it."""
    todo = [(u, base) for u in base.users if u is not view]
    while todo:
        u, parent = todo.pop()
        if later(u) or not _is_view(u) or not u.args or \
                u.args[0] is not parent:
            continue
        if any(later(w) for w in u.users):
            return True
        todo.extend((w, u) for w in u.users)
    return False


def _fill_through_slice(gm, n, view, base, later):
    """`base[idx].zero_()` or `.fill_(v)` (constant idx and v) with base, a
    computed tensor, used afterwards (torchvision's Swin V2 zeroes the key
    part of a clone of its qkv bias): the later uses of base take
    base * keep (+ v * (1 - keep)), keep a constant 0/1 mask of the filled
    elements, computed before `n`. False for other changes through views;
    a message naming `n` for a fill with a non-finite value. The new nodes
    have no recorded shapes: the caller runs the graph again."""
    if not (n.op == "call_method" and n.target in ("zero_", "fill_") and
            view.op == "call_function" and view.target is operator.getitem
            and view.args[0] is base and not base.meta.get("hap_static")):
        return False
    idx = view.args[1]
    value = 0.0 if n.target == "zero_" else \
        (n.args[1] if len(n.args) > 1 else n.kwargs.get("value"))
    leaves = []
    fx.node.map_arg((idx, value), leaves.append)
    if not all(a.meta.get("hap_static", False) for a in leaves):
        return False
    idx, value = fx.node.map_arg(
        (idx, value), lambda a: a.meta.get("hap_value"))
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return False
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    dtype = base.meta.get("hap_dtype")
    held = value
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        # -1e9 is -inf in float16: the constant v too.
        held = float(torch.tensor(value, dtype=dtype))
    if not math.isfinite(held):
        # v * (1 - keep) would be nan where kept, and the graph's constants
        # are finite: refused by name, not as the generated ops' failure.
        scope = n.meta.get("hap_scope", "")
        where = f" in {scope}" if scope else ""
        of = "" if not math.isfinite(value) else f" ({held} in {dtype})"
        return (f"node '{n.name}' (call_method Tensor.{n.target}){where} "
                f"fills a slice of '{base.name}' with {value}{of}: a fill "
                f"through a slice takes finite values only (for a mask "
                f"before softmax, fill with a large negative value the "
                f"dtype holds, such as -1e9, or -1e4 in float16, or use a "
                f"causal attention mask)")
    if _earlier_view_used_later(base, view, n, later):
        # `k = base[1:3]` before the fill and used after it: k would read
        # base unfilled (PyTorch's k sees the fill).
        return False
    keep = torch.ones(base.meta["hap_shape"], dtype=base.meta["hap_dtype"])
    keep[idx] = 0
    i = 0
    while hasattr(gm, f"_hap_keep_mask{i}"):
        i += 1
    gm.register_buffer(f"_hap_keep_mask{i}", keep, persistent=False)
    users = [u for u in base.users if later(u)]
    scope = n.meta.get("hap_scope", "")
    with gm.graph.inserting_before(n):
        mask = gm.graph.get_attr(f"_hap_keep_mask{i}")
        kept = gm.graph.call_function(operator.mul, (base, mask))
        new = [mask, kept]
        if float(value) != 0.0:
            filled = gm.graph.call_function(
                operator.mul, (gm.graph.call_function(
                    operator.sub, (1.0, mask)), float(value)))
            kept = gm.graph.call_function(operator.add, (kept, filled))
            new += [filled.args[0], filled, kept]
    for x in new:
        x.meta["hap_scope"] = scope
    # base's value from here on: a tensor of its shape, so that a later
    # in-place change (a second fill, b.mul_(2)) is followed from it too.
    kept.meta.update(hap_shape=base.meta["hap_shape"],
                     hap_dtype=base.meta["hap_dtype"])
    for u in users:
        u.replace_input_with(base, kept)
    return True


def follow_inplace(gm):
    """Makes the later uses of a tensor changed in place use the op that
    changed it (`y.add_(1); f(y)` is f of y + 1; y.add_(1), F.relu(y,
    inplace=True) and nn.ReLU(inplace=True) whose result is not assigned
    were dropped, and f took y as it was before). Run after Recorder (the
    tensors are the nodes with a recorded shape). Returns None, or a
    message naming the node that changes a view of a tensor used later
    (the change to that tensor is not followed) or a buffer or parameter
    of the module (state the graph does not hold)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    state = {k for k, _ in gm.named_buffers()} | \
        {k for k, _ in gm.named_parameters()}
    for n in list(gm.graph.nodes):
        if not _mutates_first_argument(n):
            continue
        a = n.args[0]
        if "hap_shape" not in a.meta:
            continue  # not a tensor (an int `s += 1` rebinds s)
        later = lambda u: order[u] > order[n]  # noqa: E731
        scope = n.meta.get("hap_scope", "")
        where = f" in {scope}" if scope else ""
        what = f"Tensor.{n.target}" if n.op == "call_method" \
            else getattr(n.target, "__name__", n.target)
        held = a
        while held.op != "get_attr" and _is_view(held) and held.args and \
                isinstance(held.args[0], fx.Node):
            held = held.args[0]
        if held.op == "get_attr" and held.target in state:
            # Module state that forward changes (a step counter, a running
            # average): the graph holds no such update, and the uses before
            # the change read it changed.
            return (f"node '{n.name}' ({n.op} {what}){where} changes the "
                    f"module's buffer or parameter '{held.target}' in "
                    f"place, which the HAP graph cannot express")
        if augmented_into_slice(n):
            # `x[idx] += y`: n is the slice's new value (an ordinary op),
            # and the setitem after it writes it back.
            for u in list(a.users):
                if later(u) and not (u.op == "call_function" and
                                     u.target is operator.setitem):
                    u.replace_input_with(a, n)
            continue
        if n.op == "call_function" and n.target is operator.setitem and \
                not _is_view(a) and not a.meta.get("hap_static"):
            if _earlier_view_used_later(a, None, n, later):
                return (f"node '{n.name}' ({n.op} {what}){where} assigns "
                        f"into a slice of '{a.name}', and a view of it "
                        f"taken before is used after: the exporter does "
                        f"not follow the assignment into views")
            new = assign_through_slice(gm, n, scope)
            if isinstance(new, str):
                return (f"node '{n.name}' ({n.op} {what}){where} assigns "
                        f"into a slice of '{a.name}': {new}")
            for x in gm.graph.nodes:  # the new nodes come before n
                order.setdefault(x, order[n] - 0.5)
            for u in list(a.users):
                if u is not n and later(u):
                    u.replace_input_with(a, new)
            if not n.users:
                gm.graph.erase_node(n)
            continue
        base = a
        while _is_view(base) and base.args and \
                isinstance(base.args[0], fx.Node):
            base = base.args[0]
            # A tuple (a module's outputs, split's parts) is not changed:
            # the chain goes on to the tensor it holds views of, if any.
            if "hap_shape" in base.meta and \
                    any(later(u) for u in base.users):
                filled = _fill_through_slice(gm, n, a, base, later)
                if isinstance(filled, str):
                    return filled
                if filled:
                    # Its new nodes come before n (for the later changes).
                    for x in gm.graph.nodes:
                        order.setdefault(x, order[n] - 0.5)
                    break
                return (f"node '{n.name}' ({n.op} {what}){where} "
                        f"changes '{a.name}' in place, a view of "
                        f"'{base.name}', which is used afterwards: the "
                        f"exporter does not follow in-place changes "
                        f"through views (use the op's result instead)")
        if _earlier_view_used_later(a, None, n, later):
            # `k = y[:, :2]; y.mul_(2); f(k)`: only y's later uses take the
            # change, and k would read y unchanged (PyTorch's k sees it).
            return (f"node '{n.name}' ({n.op} {what}){where} changes "
                    f"'{a.name}' in place, and a view of it taken before "
                    f"the change is used after it: the exporter does not "
                    f"follow in-place changes into views (take the view "
                    f"after the change, or use the op's result)")
        for u in list(a.users):
            if u is not n and later(u):
                u.replace_input_with(a, n)
    return None
