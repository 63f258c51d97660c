#!/usr/bin/env python3
"""Export a PyTorch nn.Module to the HAP model IR (hap.v1.Graph, proto3 JSON).

The module is traced with torch.fx and run once on example inputs to learn
every tensor's shape; each traced node is then mapped onto the ops of
planner/graph (`hapctl ops` lists them). The module's forward must return the
scalar training loss (for example a wrapper that applies nn.CrossEntropyLoss
to the model's output and a labels input), or pass `loss=` (see export()).

Conventions (the same as the model zoo, planner/graph/zoo.cc):
  * Graph parameters are named as in the module's state_dict() (also with
    export(loss=...), whose wrapper adds no prefix), except
      - the parameters split from one PyTorch tensor, listed in the graph's
        metadata "hap.state_dict_slices" (below; so is, as a whole-tensor
        slice "<name>_1", a parameter whose name an input already has), and
      - exporter constants: frozen parameters with a constant initialiser
        that are not in the state_dict ("const.<node>" for literal tensors
        and scalars, "<module>.weight"/".bias" of a LayerNorm without affine).
  * nn.MultiheadAttention becomes three q/k/v linears (parameters sliced from
    in_proj_weight/in_proj_bias, named "<module>.q.weight", ".k.weight",
    ".v.weight", ".q.bias" ...), reshape to heads, transpose, matmul, scale,
    softmax, dropout, matmul, transpose, reshape and the output linear
    ("<module>.out_proj.weight"). With kdim/vdim != embed_dim its separate
    q/k/v_proj_weight keep their state_dict names.
  * metadata["hap.state_dict_slices"] (always present; "{}" when nothing is
    split) is a JSON object string: graph parameter -> {"source": state_dict
    name, "axis": int, "offset": int, "source_shape": [int, ...]}: the graph
    parameter is source.narrow(axis, offset, its size along axis), e.g.
    "enc.layers.0.self_attn.k.weight" -> {"source":
    "enc.layers.0.self_attn.in_proj_weight", "axis": 0, "offset": E,
    "source_shape": [3E, E]}. hap-executor --init-weights and
    `hapctl checkpoint export` read and write the source whole through it.
  * Attention key padding masks (key_padding_mask, src_/tgt_/
    memory_key_padding_mask; [batch, keys]): a bool mask (True = padding)
    that is a graph input (it becomes an INT64 0/1 input) or is computed
    from integer ids as `ids == c`, `ids != c`, `~mask` (the ids must also
    index an nn.Embedding, which bounds them) is an `embedding` of the ids
    in a [limit, 1] table of 0 and -1e30 (concatenated constants), reshaped
    to [batch, 1, 1, keys] and added by the softmax over heads and queries
    (plus the attn_mask, if any); one such mask per source, shared by every
    attention. A float mask is added as it is (PyTorch's additive mask),
    without an attn_mask only. Rows with a kept key equal PyTorch's; a row
    whose keys are all padded gets uniform weights (PyTorch: NaN).
  * nn.TransformerEncoderLayer (post-norm or norm_first, relu or gelu) and
    nn.TransformerEncoder are decomposed the same way as the zoo's
    BuildTransformer / PreNormBlock; nn.TransformerDecoderLayer,
    nn.TransformerDecoder and nn.Transformer likewise (self-attention,
    attention over the memory, feed-forward, in PyTorch's order).
  * nn.LSTM becomes one lstm op per layer and direction (the reverse
    direction with attribute reverse, both outputs concatenated on the
    features; nn.LSTM's dropout as dropout ops between layers; transposes
    around a sequence-first (batch_first=False) stack); its parameters keep
    their state_dict names (weight_ih_l0, bias_hh_l1_reverse, ...). Of
    `out, (h_n, c_n) = lstm(x)`, out and h_n are supported (h_n[k] is a
    slice of layer k's output at its last step); c_n, an initial state
    (h_0, c_0), proj_size and packed or unbatched sequences fail naming
    them.
  * Initialisers keep the module's own values where the IR can: a parameter
    whose values are all equal is ZEROS / ONES / CONSTANT (a zero-initialised
    head stays zero); the others carry the kind of PyTorch's default
    initialisation of their module (UNIFORM / NORMAL), or for a bare
    nn.Parameter a kind fitted to its values. Values themselves go into the
    --weights file, not the graph.
  * Integer inputs become INT64; the ones used only as loss targets are LABELS.
  * Dropout is exported as in training mode (the IR is one training step).

Command line:
  /usr/bin/python3 tools/export_fx.py --module pkg.mod:factory_or_class \
      [--kwargs '{"hidden": 64}'] [--input-shape x=8,16] \
      [--input-shape tokens=8,128:int64[:HIGH]] [--name NAME] -o out.json \
      [--weights OUT.safetensors]

  MODULE is "package.module:attr" or "path/to/file.py:attr"; attr is an
  nn.Module instance, a class or a factory called with --kwargs. A factory may
  return (module, {name: example tensor}) and a module may have an
  `example_inputs` attribute (a dict or a callable returning one); --input-shape
  adds or replaces inputs: float32 random normal, or an integer dtype filled
  with zeros (or random integers in [0, HIGH) when HIGH is given).

  --weights OUT.safetensors also writes the module's current parameters (the
  ones the graph uses; a note on stderr names any that forward leaves
  unused) as a safetensors file under their state_dict names, split tensors
  whole (in_proj_weight, not q/k/v), BatchNorm running statistics included
  (module buffers the graph keeps as state), exporter constants and other
  buffers left out:
  `module.load_state_dict(safetensors_io.read(OUT), strict=False)` restores
  them exactly (tools/safetensors_io.py) and `hap-executor --init-weights OUT`
  starts training from them. In Python: export(..., return_values=True), then
  state_dict_weights(graph, values) or write_weights(path, graph, values).

Exit status: 0 on success, 2 on an unsupported op/module or a bad argument
(the message names the fx node and its target).
"""

import argparse
import dis
import functools
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
import sys

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F


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


_MISSING = object()

_FLOAT_DTYPES = {
    torch.float32: "FLOAT32",
    torch.float16: "FLOAT16",
    torch.bfloat16: "BFLOAT16",
    torch.float64: "FLOAT64",
}
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _ir_dtype(dt, what):
    if dt in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[dt]
    if dt in _INT_DTYPES:
        return "INT64"
    raise ExportError(f"{what}: dtype {dt} has no HAP equivalent")


# --------------------------------------------------------------------------
# Tracing


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


def _stochastic_depth_functions():
    mod = sys.modules.get("torchvision.ops.stochastic_depth")
    f = getattr(mod, "stochastic_depth", None)
    return (f,) if f is not None else ()


def _is_stochastic_depth(f):
    return f in _stochastic_depth_functions()


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
        super().__init__(autowrap_functions=_stochastic_depth_functions())
        self._stack = []
        # Buffers become get_attr nodes (constants folded at export time), so
        # `self.mask[:S, :S]` with a traced S works.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m, qualname):
        if isinstance(m, self.LEAVES):
            return True
        return super().is_leaf_module(m, qualname)

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
        return super().call_module(m, forward, args, kwargs)

    def create_node(self, kind, target, args, kwargs, name=None,
                    type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["hap_scope"] = self._stack[-1] if self._stack else ""
        return node

    def trace(self, root, concrete_args=None):
        saved_iter = fx.Proxy.__iter__
        saved = {n: getattr(torch, n) for n in _FACTORIES}
        if sys.version_info >= (3, 11):
            fx.Proxy.__iter__ = _proxy_iter
        for n, f in saved.items():
            setattr(torch, n, _wrap_factory(f))
        try:
            return super().trace(root, concrete_args)
        finally:
            fx.Proxy.__iter__ = saved_iter
            for n, f in saved.items():
                setattr(torch, n, f)


def _flat_tensors(v):
    out = []
    fx.node.map_aggregate(v, lambda a: out.append(a)
                          if isinstance(a, torch.Tensor) else None)
    return out


def _to_meta(v):
    return fx.node.map_aggregate(
        v, lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a)


def _meta_device_to_cpu(v):
    return fx.node.map_aggregate(
        v, lambda a: torch.device("cpu")
        if isinstance(a, torch.device) and a.type == "meta" else a)


class _Recorder(fx.Interpreter):
    """Runs the traced graph once; records each node's shapes/dtypes and the
    values of the nodes that do not depend on inputs or parameters.

    With meta=True the inputs and parameters are 'meta' tensors (shapes only,
    no memory, no arithmetic), so exporting a full-size model is quick;
    constants (masks, arange positions) are still computed for real."""

    def __init__(self, gm, params, meta=False):
        super().__init__(gm)
        self._params = params  # get_attr targets that are nn.Parameters
        self.meta = meta

    def call_module(self, target, args, kwargs):
        if not self.meta:
            return super().call_module(target, args, kwargs)
        from torch.nn.utils.stateless import functional_call
        mod = self.fetch_attr(target)
        state = {k: v.to("meta") for k, v in
                 list(mod.named_parameters()) + list(mod.named_buffers())}
        return functional_call(mod, state, tuple(args), dict(kwargs))

    def run_node(self, n):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs_static = all(a.meta.get("hap_static", False)
                            for a in n.all_input_nodes)
        folds = n.op in ("call_function", "call_method") and inputs_static
        if self.meta:
            if folds:
                args, kwargs = _meta_device_to_cpu((args, kwargs))
            else:
                args, kwargs = _to_meta((args, kwargs))
        result = getattr(self, n.op)(n.target, args, kwargs)
        if self.meta and n.op == "get_attr" and n.target in self._params:
            result = result.to("meta")
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
            n.meta["hap_value"] = result
        else:
            n.meta.pop("hap_value", None)
        if isinstance(result, torch.Tensor):
            n.meta["hap_shape"] = tuple(int(d) for d in result.shape)
            n.meta["hap_dtype"] = result.dtype
        return result


# --------------------------------------------------------------------------
# IR building blocks


class _T:
    """An IR tensor. `causal`/`mask`: attention scores awaiting their softmax
    (a causal mask or an additive mask tensor was applied)."""

    def __init__(self, name, shape, dtype, causal=False, mask=None):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self.causal, self.mask = causal, mask

    def with_mask(self, causal=False, mask=None):
        return _T(self.name, self.shape, self.dtype, causal, mask)


class _Static:
    def __init__(self, value):
        self.value = value


class _LstmState:
    """h_n or c_n of an nn.LSTM ([layers * directions, B, H]), made into IR
    ops only when used: `parts` holds, per layer and direction, the lstm op's
    output [B, S, H] and the step whose hidden state is the final one (h_n
    is the output at that step); None for c_n (the lstm op keeps no cell
    states), which fails when used."""

    def __init__(self, path, parts):
        self.path, self.parts = path, parts
        self.whole = None  # the [layers * directions, B, H] tensor, once made


class _BoolIds:
    """A boolean tensor the IR holds through integer ids: True where the
    INT64 tensor `ids` is in `true_ids` (`negate`: where it is not). A bool
    input is its own ids (0/1, true_ids {1}); `tokens == pad` is
    _BoolIds(tokens, {pad}). Only attention key padding masks consume them
    (as an embedding of the ids in a table of 0 and a large negative)."""

    def __init__(self, ids, true_ids, negate=False):
        self.ids, self.true_ids, self.negate = ids, frozenset(true_ids), negate

    def inverted(self):
        return _BoolIds(self.ids, self.true_ids, not self.negate)


# The additive stand-in for PyTorch's -inf at a padded key: exp(x + NEG - max)
# is exactly 0 in these dtypes whenever one key of the row is kept, so such
# rows equal PyTorch's; a row with every key padded (NaN in PyTorch 1.13)
# gets uniform weights instead.
_PAD_NEG = {"FLOAT16": -65504.0}
_PAD_NEG_DEFAULT = -1e30


def _uniform(bound):
    return {"kind": "UNIFORM", "low": -bound, "high": bound}


def _fan_in_uniform(fan_in):
    return _uniform(1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0)


def _normal(mean, std):
    return {"kind": "NORMAL", "mean": mean, "stddev": std}


_ONES = {"kind": "ONES"}
_ZEROS = {"kind": "ZEROS"}


def _xavier_uniform(fan_in, fan_out):
    return _uniform(math.sqrt(6.0 / (fan_in + fan_out)))


def _constant_init(t):
    """ZEROS / ONES / CONSTANT when every value of `t` is the same (the
    module's own initial values kept), else None (also for meta tensors)."""
    if t.is_meta or t.numel() == 0:
        return None
    v = t.detach()
    lo, hi = float(v.min()), float(v.max())
    if lo != hi or not math.isfinite(lo):
        return None
    if lo == 0:
        return dict(_ZEROS)
    if lo == 1:
        return dict(_ONES)
    return {"kind": "CONSTANT", "value": lo}


def _init_from_values(t):
    """Initializer for a bare nn.Parameter (no module default): constant when
    all values are equal, else UNIFORM over [min, max] when the values look
    uniform (excess kurtosis < -0.6), else NORMAL(mean, std). A meta tensor
    has no values: NORMAL(0, 0.02), the usual init of such parameters (class
    tokens, position tables)."""
    if t.is_meta:
        return _normal(0.0, 0.02)
    v = t.detach().double().flatten()
    if v.numel() == 0:
        return dict(_ZEROS)
    lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        if lo == 0:
            return dict(_ZEROS)
        if lo == 1:
            return dict(_ONES)
        return {"kind": "CONSTANT", "value": lo}
    mean, std = float(v.mean()), float(v.std(unbiased=False))
    if v.numel() >= 16:
        kurt = float(((v - mean) ** 4).mean()) / (std ** 4) - 3.0
        if kurt < -0.6:
            return {"kind": "UNIFORM", "low": lo, "high": hi}
    return _normal(mean, std)


def _is_causal(mask, sq, sk):
    """True if a constant attention mask hides exactly the future positions
    (bool: True above the diagonal; float: -inf (or <= -1e4) above, 0 on and
    below). Leading dimensions must be broadcast (size 1)."""
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


def _target_name(node, root):
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        mod = root.get_submodule(t)
        cls = type(mod)
        return f"{t} ({cls.__module__}.{cls.__qualname__})"
    if node.op == "get_attr":
        return str(t)
    if callable(t):
        mod = getattr(t, "__module__", None) or "torch"
        if mod in ("_operator", "builtins"):
            mod = "operator" if mod == "_operator" else mod
        if mod.startswith("torch._C._nn") or mod == "torch._C._VariableFunctions":
            mod = "torch"
        return f"{mod}.{getattr(t, '__name__', repr(t))}"
    return str(t)


def _args(node, names, defaults=None):
    """Maps a node's positional and keyword args onto `names`."""
    defaults = defaults or {}
    out = {}
    for i, a in enumerate(node.args):
        if i >= len(names):
            break
        out[names[i]] = a
    for k, v in node.kwargs.items():
        out[k] = v
    for k, v in defaults.items():
        out.setdefault(k, v)
    return out


def _pair(v):
    if isinstance(v, (list, tuple)):
        v = list(v)
        return v * 2 if len(v) == 1 else v
    return [v, v]


def _join(path, leaf):
    return f"{path}.{leaf}" if path else leaf


class _Exporter:
    """`root` is what was traced: the user's `module` itself, or a loss
    wrapper holding it as the submodule `prefix` ("model"); every name the
    graph shows (parameters, ops, scopes) is relative to `module`, so the
    parameters are named as in module.state_dict()."""

    def __init__(self, gm, root, name, loss_node, input_nodes, module=None,
                 prefix=""):
        self.gm, self.root, self.name = gm, root, name
        self.module = root if module is None else module
        self.prefix = prefix
        self.loss_node = loss_node
        self.input_nodes = input_nodes  # placeholder node -> example tensor
        self.inputs, self.params, self.ops, self.value_info = [], {}, [], []
        self.used = set()
        self.env = {}
        self.qualname = {}  # id(parameter) -> its state_dict name
        for n, p in root.named_parameters():
            self.qualname.setdefault(id(p), self.pub(n))
        # State_dict names are kept for their parameters: other tensors and
        # ops do not take them.
        self.reserved = set(self.qualname.values())
        self.slices = {}  # graph parameter -> slice of a state_dict tensor
        self.node = None  # the node being exported (for error messages)
        self.n_const = 0
        self.id_limits = {}  # INT64 tensor -> its ids lie in [0, limit)
        self.padding_masks = {}  # key padding mask source -> [B, 1, 1, Sk]
        self.values = {}  # parameter name -> torch tensor (its PyTorch value)
        self.buffers = []  # graph parameters that are module buffers
        self.buffer_names = {id(b): self.pub(n)
                             for n, b in root.named_buffers()}

    def pub(self, path):
        """A module path of `root` as a path of the user's module."""
        if not self.prefix:
            return path
        if path == self.prefix:
            return ""
        if path.startswith(self.prefix + "."):
            return path[len(self.prefix) + 1:]
        return path

    # ---- errors -----------------------------------------------------------
    def fail(self, why, node=None):
        node = node or self.node
        if node is None:
            raise ExportError(why)
        raise ExportError(
            f"node '{node.name}' ({node.op} {_target_name(node, self.root)}): "
            f"{why}")

    # ---- names, tensors, parameters, ops ----------------------------------
    def fresh(self, base, own=False):
        """A new tensor/op name from `base`; `own`: base is the state_dict
        name of the parameter being declared (reserved for it)."""
        name, k = base, 1
        while name in self.used or (name in self.reserved and not own):
            name = f"{base}_{k}"
            k += 1
            own = False
        self.used.add(name)
        return name

    def param(self, tensor, name=None, init=None, frozen=False, key=None,
              shape=None, value=None, slice_of=None):
        """Declares (once per `key`) a parameter; `value` (default `tensor`)
        is what export(..., return_values=True) reports for it.

        Without `name`, `tensor` is a parameter of the module and the graph
        parameter takes its state_dict name. `slice_of=(axis, offset)`: the
        graph parameter `name` is `value`, the slice of the module parameter
        `tensor` starting at `offset` along `axis` (recorded in the graph's
        metadata, see SLICES_KEY)."""
        key = key if key is not None else id(tensor)
        if key in self.params:
            return self.params[key][1]
        source = None
        if name is None or slice_of is not None:
            source = self.qualname.get(id(tensor))
            if source is None:
                self.fail("uses a tensor that is not a parameter of the module")
        if name is None:
            name = source
        val = (tensor if value is None else value).detach()
        if init is None:
            init = self.default_init(name, tensor)
        if not frozen:
            init = _constant_init(val) or init
        shape = tuple(tensor.shape) if shape is None else tuple(shape)
        dtype = _ir_dtype(tensor.dtype, f"parameter '{name}'")
        if dtype == "INT64":
            self.fail(f"parameter '{name}' is not floating point")
        whole = slice_of is None and name == source
        gname = self.fresh(name, own=whole)
        if whole and gname != source:
            # Its state_dict name is taken (by an input of the same name):
            # record the parameter as the whole of its source.
            if not shape:
                self.fail(f"parameter '{source}' has the name of an input; "
                          f"rename one of them")
            slice_of = (0, 0)
        if slice_of is not None:
            axis, offset = slice_of
            self.slices[gname] = {"source": source, "axis": int(axis),
                                  "offset": int(offset),
                                  "source_shape": [int(d) for d in
                                                   tensor.shape]}
        name = gname
        t = _T(name, shape, dtype)
        entry = {"tensor": {"name": name, "shape": list(shape), "dtype": dtype},
                 "init": init}
        if frozen:
            entry["frozen"] = True
        self.params[key] = (entry, t)
        self.values[name] = val
        return t

    def const(self, value, like):
        """A constant as a frozen parameter of CONSTANT initialisation."""
        if isinstance(value, torch.Tensor):
            v = value.detach().double().flatten()
            if v.numel() == 0 or float(v.min()) != float(v.max()):
                self.fail("needs a constant tensor with non-uniform values, "
                          "which the HAP IR cannot hold (make it a parameter "
                          "or an input)")
            shape, value = tuple(value.shape), float(v[0])
        else:
            shape, value = (), float(value)
        self.n_const += 1
        init = {"kind": "CONSTANT", "value": value}
        if value == 0:
            init = dict(_ZEROS)
        elif value == 1:
            init = dict(_ONES)
        if not math.isfinite(value):
            self.fail(f"needs the non-finite constant {value}")
        dummy = torch.full(shape, value, dtype=torch.float32)
        t = self.param(dummy, name=f"const.{self.node.name}", init=init,
                       frozen=True, key=("const", self.n_const), shape=shape)
        if t.dtype != like.dtype:
            self.params[("const", self.n_const)][0]["tensor"]["dtype"] = like.dtype
            t.dtype = like.dtype
        return t

    def default_init(self, name, tensor):
        """PyTorch's default initialisation of the module owning `name`."""
        owner_path, _, attr = name.rpartition(".")
        root = self.module
        try:
            owner = root.get_submodule(owner_path) if owner_path else root
        except AttributeError:
            owner = None
        parent = None
        if owner_path:
            pp, _, leaf = owner_path.rpartition(".")
            try:
                parent = root.get_submodule(pp) if pp else root
            except AttributeError:
                parent = None
            if isinstance(parent, nn.MultiheadAttention) and leaf == "out_proj":
                if attr == "bias":
                    return dict(_ZEROS)
        if isinstance(owner, nn.Linear) and attr in ("weight", "bias"):
            return _fan_in_uniform(owner.in_features)
        if isinstance(owner, nn.Conv2d) and attr in ("weight", "bias"):
            w = owner.weight
            return _fan_in_uniform(w.shape[1] * w.shape[2] * w.shape[3])
        if isinstance(owner, nn.Embedding) and attr == "weight":
            return _normal(0.0, 1.0)
        if isinstance(owner, nn.LayerNorm):
            return dict(_ONES if attr == "weight" else _ZEROS)
        if isinstance(owner, nn.LSTM):
            return _uniform(1.0 / math.sqrt(owner.hidden_size))
        return _init_from_values(tensor)

    def emit(self, type_, name, inputs, attrs=None, shape=None, dtype=None,
             scope=None, outputs=None):
        """Adds an op; `shape`/`dtype` of its (single) output."""
        for t in inputs:
            if not isinstance(t, _T):
                self.fail(f"internal: op '{name}' got a non-tensor input {t!r}")
        name = self.fresh(name)
        if scope is None:
            scope = self.scope_of(self.node) if self.node is not None else ""
        op = {"name": name, "type": type_, "inputs": [t.name for t in inputs]}
        dtype = dtype or inputs[0].dtype
        if outputs is None:
            outs = [_T(name, shape, dtype)]
        else:
            outs = []
            for i, s in enumerate(outputs):
                outs.append(_T(self.fresh(f"{name}:{i}"), s, dtype))
        op["outputs"] = [t.name for t in outs]
        if attrs:
            op["attrs"] = {k: _attr(v) for k, v in attrs.items()}
        if scope:
            op["scope"] = scope
        self.ops.append(op)
        for t in outs:
            self.value_info.append({"name": t.name, "shape": list(t.shape),
                                    "dtype": t.dtype})
        return outs[0] if outputs is None else outs

    def scope_of(self, node):
        if node.op == "call_module":
            path = self.pub(node.target).rpartition(".")[0]
        else:
            path = self.pub(node.meta.get("hap_scope", ""))
        return path.replace(".", "/")

    def base_name(self, node):
        if node is self.loss_node:
            return "loss"
        if node.op == "call_module":
            return self.pub(node.target) or node.name
        return node.name

    # ---- argument conversion ----------------------------------------------
    def t(self, a, allow_masked=False):
        """An fx argument as an IR tensor."""
        if isinstance(a, fx.Node):
            v = self.env[a]
            if isinstance(v, _Static):
                if isinstance(v.value, torch.Tensor):
                    like = _T("", (), _ir_dtype(v.value.dtype, a.name))
                    return self.const(v.value, like)
                self.fail(f"expects a tensor, got {type(v.value).__name__} "
                          f"from '{a.name}'")
            if isinstance(v, _LstmState):
                v = self.lstm_state(v)
            if isinstance(v, _BoolIds):
                self.fail(f"boolean tensor '{a.name}' is supported only as "
                          f"an attention key_padding_mask")
            if not isinstance(v, _T):
                self.fail(f"expects a tensor, got {type(v).__name__} from "
                          f"'{a.name}'")
            if (v.causal or v.mask is not None) and not allow_masked:
                self.fail(f"masked attention scores '{a.name}' may only be "
                          f"consumed by softmax")
            return v
        if a is None:
            self.fail("expects a tensor, got None (e.g. an unused output)")
        self.fail(f"expects a tensor, got the constant {a!r}")

    def v(self, a):
        """An fx argument whose value is known at export time."""
        if isinstance(a, fx.Node):
            v = self.env[a]
            if isinstance(v, _Static):
                return v.value
            self.fail(f"needs '{a.name}' to be known at export time, but it "
                      f"depends on the inputs or parameters")
        if isinstance(a, (list, tuple)):
            return type(a)(self.v(x) for x in a)
        if isinstance(a, slice):
            return slice(self.v(a.start), self.v(a.stop), self.v(a.step))
        if isinstance(a, dict):
            return {k: self.v(x) for k, x in a.items()}
        return a

    def is_static(self, a):
        if isinstance(a, fx.Node):
            return isinstance(self.env[a], _Static)
        if isinstance(a, (list, tuple)):
            return all(self.is_static(x) for x in a)
        return True

    def out_shape(self, node=None):
        node = node or self.node
        if "hap_shape" not in node.meta:
            self.fail("its result is not a single tensor")
        return node.meta["hap_shape"]

    def out_dtype(self, node=None):
        node = node or self.node
        return _ir_dtype(node.meta["hap_dtype"], f"node '{node.name}'")

    def op(self, type_, inputs, attrs=None, name=None):
        """Emits the op of the current node, output shape from tracing."""
        return self.emit(type_, name or self.base_name(self.node), inputs,
                         attrs, self.out_shape(), self.out_dtype())

    # ---- driver ------------------------------------------------------------
    def run(self):
        for n, ex in self.input_nodes.items():
            if n.meta.get("hap_static"):
                continue
            boolean = ex.dtype == torch.bool  # 0/1 ids (a padding mask)
            dtype = "INT64" if boolean else \
                _ir_dtype(ex.dtype, f"input '{n.target}'")
            name = n.target
            self.used.add(name)
            self.env[n] = _T(name, tuple(ex.shape), dtype)
            if boolean:
                self.id_limits[name] = 2
                self.env[n] = _BoolIds(self.env[n], {1})
            self.inputs.append({"tensor": {"name": name,
                                           "shape": list(ex.shape),
                                           "dtype": dtype}})
        needed = set()
        stack = [self.loss_node]
        while stack:
            n = stack.pop()
            if n in needed:
                continue
            needed.add(n)
            stack.extend(n.all_input_nodes)
        for n in self.gm.graph.nodes:
            if n not in needed or n in self.env:
                continue
            self.node = n
            if n.meta.get("hap_static"):
                self.env[n] = _Static(n.meta.get("hap_value"))
            elif n.op == "placeholder":
                self.fail("has no example input")
            elif n.op == "get_attr":
                p = _fetch_attr(self.root, n.target)
                self.env[n] = self.param(p)
            elif n.op == "call_module":
                self.env[n] = self.call_module(n)
            elif n.op == "call_function":
                self.env[n] = self.call_function(n)
            elif n.op == "call_method":
                self.env[n] = self.call_method(n)
            else:
                self.fail("is not supported")
        self.node = self.loss_node
        loss = self.env[self.loss_node]
        if not isinstance(loss, _T) or loss.shape != () or loss.dtype == "INT64":
            self.fail("the loss must be a scalar float tensor computed by the "
                      "module (its forward should return the loss)")
        if not any(loss.name in op["outputs"] for op in self.ops):
            self.fail("the loss must be computed by an op")
        self.node = None
        self.assign_roles()
        params = [e for e, _ in self.params.values()]
        for e in params:
            pname = e["tensor"]["name"]
            if not (e.get("frozen") or pname in self.slices or
                    pname in self.reserved):
                raise ExportError(f"internal: graph parameter '{pname}' is "
                                  f"neither a state_dict name nor a slice")
        return {
            "name": self.name,
            "inputs": self.inputs,
            "parameters": params,
            "ops": self.ops,
            "loss": loss.name,
            "value_info": self.value_info,
            "metadata": {"source": "torch.fx",
                         "exporter": "tools/export_fx.py",
                         "torch.module": type(self.module).__qualname__,
                         "torch.version": torch.__version__,
                         SLICES_KEY: json.dumps(self.slices, sort_keys=True),
                         BUFFERS_KEY: json.dumps(sorted(self.buffers))},
        }

    def assign_roles(self):
        """LABELS: integer inputs consumed only (through reshapes) as the
        target of a loss."""
        users = {}
        for op in self.ops:
            for i, name in enumerate(op["inputs"]):
                users.setdefault(name, []).append((op, i))
        view_ops = ("reshape", "flatten")
        for inp in self.inputs:
            spec = inp["tensor"]
            labels = spec["dtype"] == "INT64"
            frontier, seen_use = [spec["name"]], False
            while frontier and labels:
                name = frontier.pop()
                for op, i in users.get(name, []):
                    seen_use = True
                    if op["type"] in view_ops:
                        frontier.extend(op["outputs"])
                    elif not (op["type"] in ("nll_loss", "cross_entropy") and
                              i == 1):
                        labels = False
            inp["role"] = "LABELS" if labels and seen_use else "FEATURES"

    # ---- shared emitters ---------------------------------------------------
    def linear(self, name, x, w, b, scope):
        ins = [x, w] + ([b] if b is not None else [])
        shape = x.shape[:-1] + (w.shape[0],)
        return self.emit("linear", name, ins, None, shape, scope=scope)

    def linear_module(self, mod, path, x, scope):
        if x.shape[-1:] != (mod.in_features,):
            self.fail(f"{path}: input {list(x.shape)} does not match "
                      f"in_features {mod.in_features}")
        w = self.param(mod.weight)
        b = self.param(mod.bias) if mod.bias is not None else None
        return self.linear(path, x, w, b, scope)

    def layer_norm(self, mod, path, x, scope):
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        if len(mod.normalized_shape) != 1:
            self.fail(f"LayerNorm '{path}' normalises over "
                      f"{list(mod.normalized_shape)}; only the last dimension "
                      f"is supported")
        d = mod.normalized_shape[0]
        if mod.elementwise_affine:
            g, b = self.param(mod.weight), self.param(mod.bias)
        else:
            g = self.param(torch.ones(d), at("weight"), dict(_ONES), True,
                           key=("ln_w", path))
            b = self.param(torch.zeros(d), at("bias"), dict(_ZEROS), True,
                           key=("ln_b", path))
        return self.emit("layer_norm", path, [x, g, b], {"eps": float(mod.eps)},
                         x.shape, scope=scope)

    def batch_norm(self, path, x, weight, bias, running_mean, running_var,
                   momentum, eps):
        """Training-mode batch normalisation over channel dim 1; the running
        statistics (module buffers) become frozen parameters under their
        state_dict names, updated by the op."""
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        if len(x.shape) < 2:
            self.fail("batch_norm needs an [N, C, ...] input")
        if momentum is None:
            self.fail("batch_norm with momentum=None (a cumulative average of "
                      "the statistics) is not supported")
        c = x.shape[1]
        ins = [x]
        for t, leaf, init in ((weight, "weight", _ONES), (bias, "bias", _ZEROS)):
            if isinstance(t, torch.Tensor) and id(t) in self.qualname:
                ins.append(self.param(t))
            elif t is not None and not isinstance(t, torch.Tensor):
                ins.append(self.t(t))
            else:
                ins.append(self.param(torch.full((c,), 1.0 if leaf == "weight"
                                                 else 0.0), at(leaf),
                                      dict(init), True, key=("bn_" + leaf, path)))
        if (running_mean is None) != (running_var is None):
            self.fail("batch_norm needs both running statistics or neither")
        if running_mean is not None:
            for buf, leaf in ((running_mean, "running_mean"),
                              (running_var, "running_var")):
                if not isinstance(buf, torch.Tensor):
                    self.fail("batch_norm's running statistics must be module "
                              "buffers")
                init = _constant_init(buf) or _init_from_values(buf)
                t = self.param(buf, self.buffer_names.get(id(buf), at(leaf)),
                               init, True, key=id(buf))
                if t.name not in self.buffers:
                    self.buffers.append(t.name)
                ins.append(t)
        return self.emit("batch_norm", path, ins,
                         {"eps": float(eps), "momentum": float(momentum)},
                         x.shape, scope=self.scope_of(self.node))

    def dropout(self, p, name, x, scope):
        if p == 0:
            return x
        return self.emit("dropout", name, [x], {"p": float(p)}, x.shape,
                         scope=scope)

    def activation(self, act, name, x, scope):
        kind = None
        if act in (F.relu, torch.relu) or isinstance(act, nn.ReLU):
            kind = "relu"
        elif act is F.gelu or (isinstance(act, nn.GELU) and
                               act.approximate == "none"):
            kind = "gelu"
        elif act in (torch.sigmoid, F.sigmoid) or isinstance(act, nn.Sigmoid):
            kind = "sigmoid"
        elif act in (torch.tanh, F.tanh) or isinstance(act, nn.Tanh):
            kind = "tanh"
        elif act is F.silu or isinstance(act, nn.SiLU):
            kind = "silu"
        elif act is F.relu6 or isinstance(act, nn.ReLU6):
            kind = "relu6"
        elif isinstance(act, nn.Hardtanh) and (act.min_val, act.max_val) == (0, 6):
            kind = "relu6"
        elif act is F.hardsigmoid or isinstance(act, nn.Hardsigmoid):
            kind = "hardsigmoid"
        elif act is F.hardswish or isinstance(act, nn.Hardswish):
            kind = "hardswish"
        if kind is None:
            self.fail(f"activation {act!r} is not supported (relu, gelu, "
                      f"sigmoid, tanh, silu, relu6, hardsigmoid, "
                      f"hardswish)")
        return self.emit(kind, name, [x], None, x.shape, scope=scope)

    def reshape(self, name, x, shape, scope):
        shape = tuple(shape)
        if shape == x.shape:
            return x
        return self.emit("reshape", name, [x], {"shape": list(shape)}, shape,
                         scope=scope)

    def transpose(self, name, x, perm, scope):
        perm = list(perm)
        if perm == list(range(len(perm))):
            return x
        shape = tuple(x.shape[p] for p in perm)
        return self.emit("transpose", name, [x], {"perm": perm}, shape,
                         scope=scope)

    # ---- attention and transformer layers ----------------------------------
    def attention_mask(self, mask, sq, sk):
        """(causal, mask tensor or None) for an attn_mask argument."""
        if mask is None:
            return False, None
        if isinstance(mask, _Static):
            if _is_causal(mask.value, sq, sk):
                return True, None
            self.fail("only causal constant attention masks are supported "
                      "(e.g. nn.Transformer.generate_square_subsequent_mask)")
        if mask.dtype == "INT64" or mask.shape != (sq, sk):
            self.fail(f"attention mask '{mask.name}' must be a float "
                      f"[{sq}, {sk}] tensor (or a constant causal mask)")
        return False, mask

    def bool_ids(self, kind, a, b=None):
        """`a == b` / `a != b` (kind "eq"/"ne": an integer tensor and an
        integer constant, e.g. tokens == pad_id) or the negation of a boolean
        tensor (kind "not"): a _BoolIds, for a key_padding_mask."""
        if kind == "not":
            v = self.env.get(a) if isinstance(a, fx.Node) else None
            if not isinstance(v, _BoolIds):
                self.fail("logical negation is supported only of a boolean "
                          "key padding mask (a bool input, or integer ids "
                          "== a constant)")
            return v.inverted()
        if self.is_static(a) and not self.is_static(b):
            a, b = b, a
        x, c = self.t(a), self.v(b)
        if isinstance(c, torch.Tensor) and c.numel() == 1 and \
                not c.is_floating_point():
            c = int(c)
        if x.dtype != "INT64" or isinstance(c, bool) or \
                not isinstance(c, int):
            self.fail("comparisons are supported only between an integer "
                      "tensor and an integer constant (tokens == pad_id, as "
                      "a key_padding_mask)")
        return _BoolIds(x, {c}, negate=(kind == "ne"))

    def padding_mask(self, kpm, path, B, Sk, dtype, alone, scope):
        """PyTorch's key_padding_mask [B, Sk] as an additive mask [B, 1, 1,
        Sk] that softmax broadcasts over heads and queries, or None. Bool
        (True: the key is padding, hidden from every query): an embedding of
        its ids in a [limit, 1] table of 0 and _PAD_NEG (concatenated
        constants). Float: added as it is, as PyTorch does, only `alone`
        (without attn_mask, which PyTorch 1.13 cannot merge with a float
        one). One mask per source tensor, shared by every attention."""
        if kpm is None:
            return None
        if isinstance(kpm, _Static):
            v = kpm.value
            if isinstance(v, torch.Tensor) and v.dtype == torch.bool and \
                    not bool(v.any()):
                return None
            self.fail(f"{path}: a constant key_padding_mask is not supported "
                      f"(make it an input or compute it from one)")
        ids = kpm.ids if isinstance(kpm, _BoolIds) else kpm
        if tuple(ids.shape) != (B, Sk):
            self.fail(f"{path}: key_padding_mask '{ids.name}' "
                      f"{list(ids.shape)} must have shape [{B}, {Sk}] "
                      f"(batch, key length)")
        if isinstance(kpm, _BoolIds):
            key = (ids.name, kpm.true_ids, kpm.negate, dtype)
        else:
            if kpm.dtype == "INT64":
                self.fail(f"{path}: key_padding_mask '{kpm.name}' is an "
                          f"integer tensor; PyTorch takes bool (True = "
                          f"padding) or float (additive) masks")
            if kpm.dtype != dtype:
                self.fail(f"{path}: float key_padding_mask '{kpm.name}' is "
                          f"{kpm.dtype}, the attention {dtype}")
            if not alone:
                self.fail(f"{path}: a float key_padding_mask with an "
                          f"attn_mask is not supported (PyTorch 1.13 merges "
                          f"them with masked_fill, which takes a bool mask)")
            key = (kpm.name, dtype)
        if key in self.padding_masks:
            return self.padding_masks[key]
        base = f"{ids.name}.padding"
        if isinstance(kpm, _BoolIds):
            limit = self.id_limits.get(ids.name)
            if limit is None:
                self.fail(f"{path}: key_padding_mask computed from "
                          f"'{ids.name}', whose range is unknown: its ids "
                          f"must also index an nn.Embedding before the "
                          f"attention")
            neg = _PAD_NEG.get(dtype, _PAD_NEG_DEFAULT)
            rows = [(i in kpm.true_ids) != kpm.negate for i in range(limit)]
            like = _T("", (), dtype)
            runs, start = [], 0
            for i in range(1, limit + 1):  # constant runs of the table
                if i == limit or rows[i] != rows[start]:
                    runs.append(self.const(torch.full(
                        (i - start, 1), neg if rows[start] else 0.0), like))
                    start = i
            table = runs[0] if len(runs) == 1 else self.emit(
                "concat", f"{base}_table", runs, {"axis": 0}, (limit, 1),
                dtype=dtype, scope=scope)
            add = self.emit("embedding", f"{base}_additive", [ids, table],
                            None, (B, Sk, 1), dtype=dtype, scope=scope)
        else:
            add = kpm
        out = self.reshape(f"{base}_mask", add, (B, 1, 1, Sk), scope)
        self.padding_masks[key] = out
        return out

    def mha(self, mod, path, query, key, value, attn_mask, key_padding_mask,
            batch_first=None):
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        if mod.bias_k is not None or mod.add_zero_attn:
            self.fail(f"{path}: add_bias_kv / add_zero_attn are not supported")
        bf = mod.batch_first if batch_first is None else batch_first
        scope = path.replace(".", "/")
        E, H, dh = mod.embed_dim, mod.num_heads, mod.head_dim
        ins = []
        for nm, x in (("query", query), ("key", key), ("value", value)):
            if len(x.shape) != 3:
                self.fail(f"{path}: {nm} {list(x.shape)} must have rank 3 "
                          f"(unbatched attention is not supported)")
            ins.append(x)
        if not bf:
            done = {}
            for i, x in enumerate(ins):
                if x.name not in done:
                    done[x.name] = self.transpose(
                        at(f"{('query', 'key', 'value')[i]}_batch_first"),
                        x, (1, 0, 2), scope)
                ins[i] = done[x.name]
        q_in, k_in, v_in = ins
        B, Sq, _ = q_in.shape
        Sk = k_in.shape[1]
        causal, mask = self.attention_mask(attn_mask, Sq, Sk)
        pad = self.padding_mask(key_padding_mask, path, B, Sk, q_in.dtype,
                                mask is None and not causal, scope)
        if pad is not None:
            # PyTorch 1.13 fills the padded keys of attn_mask with -inf
            # (masked_fill): the sum, [B, 1, Sq, Sk].
            mask = pad if mask is None else self.emit(
                "add", at("attn_mask_padded"), [pad, mask], None,
                (B, 1, Sq, Sk), scope=scope)
        ws, bs = [], []
        # in_proj_weight/in_proj_bias are split into q, k and v parameters
        # ("<module>.q.weight" ...), recorded as slices of their source;
        # separate q/k/v_proj_weight (kdim != embed_dim) keep their names.
        if mod._qkv_same_embed_dim:
            W = mod.in_proj_weight
            init = _xavier_uniform(W.shape[1], W.shape[0])
            for i, nm in enumerate("qkv"):
                ws.append(self.param(W, at(f"{nm}.weight"),
                                     dict(init),
                                     key=("in_proj_weight", id(W), i),
                                     shape=(E, E),
                                     value=W[i * E:(i + 1) * E],
                                     slice_of=(0, i * E)))
        else:
            for nm in "qkv":
                W = getattr(mod, f"{nm}_proj_weight")
                ws.append(self.param(
                    W, init=_xavier_uniform(W.shape[1], W.shape[0])))
        if mod.in_proj_bias is not None:
            b = mod.in_proj_bias
            for i, nm in enumerate("qkv"):
                bs.append(self.param(b, at(f"{nm}.bias"),
                                     dict(_ZEROS),
                                     key=("in_proj_bias", id(b), i),
                                     shape=(E,),
                                     value=b[i * E:(i + 1) * E],
                                     slice_of=(0, i * E)))
        else:
            bs = [None] * 3
        q = self.linear(at("q"), q_in, ws[0], bs[0], scope)
        k = self.linear(at("k"), k_in, ws[1], bs[1], scope)
        v = self.linear(at("v"), v_in, ws[2], bs[2], scope)
        q = self.reshape(at("q_heads"), q, (B, Sq, H, dh), scope)
        k = self.reshape(at("k_heads"), k, (B, Sk, H, dh), scope)
        v = self.reshape(at("v_heads"), v, (B, Sk, H, dh), scope)
        q = self.transpose(at("q_t"), q, (0, 2, 1, 3), scope)
        k = self.transpose(at("k_t"), k, (0, 2, 3, 1), scope)
        v = self.transpose(at("v_t"), v, (0, 2, 1, 3), scope)
        s = self.emit("matmul", at("scores"), [q, k], None, (B, H, Sq, Sk),
                      scope=scope)
        s = self.emit("scale", at("scaled"), [s],
                      {"factor": 1.0 / math.sqrt(dh)}, s.shape, scope=scope)
        s = self.emit("softmax", at("probs"), [s] + ([mask] if mask else []),
                      {"causal": causal}, s.shape, scope=scope)
        s = self.dropout(mod.dropout, at("probs_drop"), s, scope)
        ctx = self.emit("matmul", at("context"), [s, v], None,
                        (B, H, Sq, dh), scope=scope)
        ctx = self.transpose(at("context_t"), ctx, (0, 2, 1, 3), scope)
        ctx = self.reshape(at("context_merged"), ctx, (B, Sq, E), scope)
        out = self.linear_module(mod.out_proj, at("out_proj"), ctx, scope)
        if not bf:
            out = self.transpose(at("output_seq_first"), out, (1, 0, 2),
                                 scope)
        return out

    def encoder_layer(self, mod, path, x, mask, key_padding_mask,
                      batch_first=None):
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        scope = path.replace(".", "/")

        def sa(h):
            h = self.mha(mod.self_attn, at("self_attn"), h, h, h, mask,
                         key_padding_mask, batch_first)
            return self.dropout(mod.dropout1.p, at("dropout1"), h, scope)

        def ff(h):
            h = self.linear_module(mod.linear1, at("linear1"), h, scope)
            h = self.activation(mod.activation, at("activation"), h, scope)
            h = self.dropout(mod.dropout.p, at("dropout"), h, scope)
            h = self.linear_module(mod.linear2, at("linear2"), h, scope)
            return self.dropout(mod.dropout2.p, at("dropout2"), h, scope)

        def add(name, a, b):
            return self.emit("add", at(name), [a, b], None, a.shape,
                             scope=scope)

        if mod.norm_first:
            x = add("attn_residual", x,
                    sa(self.layer_norm(mod.norm1, at("norm1"), x, scope)))
            x = add("ff_residual", x,
                    ff(self.layer_norm(mod.norm2, at("norm2"), x, scope)))
        else:
            x = self.layer_norm(mod.norm1, at("norm1"),
                                add("attn_residual", x, sa(x)), scope)
            x = self.layer_norm(mod.norm2, at("norm2"),
                                add("ff_residual", x, ff(x)), scope)
        return x

    def encoder(self, mod, path, x, mask, key_padding_mask):
        return self.layer_stack(mod, path, nn.TransformerEncoderLayer, x, None,
                          lambda layer, at_i, h, mem: self.encoder_layer(
                              layer, at_i, h, mask, key_padding_mask,
                              batch_first=True))

    def decoder_layer(self, mod, path, x, memory, tgt_mask, memory_mask,
                      tgt_key_padding_mask, memory_key_padding_mask,
                      batch_first=None):
        """nn.TransformerDecoderLayer: self-attention (tgt_mask), attention
        over the memory (memory_mask), feed-forward, each with its dropout
        and residual, post-norm or norm_first (PyTorch's order)."""
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        scope = path.replace(".", "/")

        def sa(h):
            h = self.mha(mod.self_attn, at("self_attn"), h, h, h, tgt_mask,
                         tgt_key_padding_mask, batch_first)
            return self.dropout(mod.dropout1.p, at("dropout1"), h, scope)

        def ca(h):
            h = self.mha(mod.multihead_attn, at("multihead_attn"), h, memory,
                         memory, memory_mask, memory_key_padding_mask,
                         batch_first)
            return self.dropout(mod.dropout2.p, at("dropout2"), h, scope)

        def ff(h):
            h = self.linear_module(mod.linear1, at("linear1"), h, scope)
            h = self.activation(mod.activation, at("activation"), h, scope)
            h = self.dropout(mod.dropout.p, at("dropout"), h, scope)
            h = self.linear_module(mod.linear2, at("linear2"), h, scope)
            return self.dropout(mod.dropout3.p, at("dropout3"), h, scope)

        def add(name, a, b):
            return self.emit("add", at(name), [a, b], None, a.shape,
                             scope=scope)

        norms = [(mod.norm1, "norm1"), (mod.norm2, "norm2"),
                 (mod.norm3, "norm3")]
        for (norm, leaf), (block, res) in zip(
                norms, ((sa, "self_attn_residual"),
                        (ca, "cross_attn_residual"), (ff, "ff_residual"))):
            if mod.norm_first:
                x = add(res, x, block(self.layer_norm(norm, at(leaf), x,
                                                      scope)))
            else:
                x = self.layer_norm(norm, at(leaf), add(res, x, block(x)),
                                    scope)
        return x

    def decoder(self, mod, path, x, memory, tgt_mask, memory_mask,
                tgt_key_padding_mask, memory_key_padding_mask):
        return self.layer_stack(mod, path, nn.TransformerDecoderLayer, x, memory,
                          lambda layer, at_i, h, mem: self.decoder_layer(
                              layer, at_i, h, mem, tgt_mask, memory_mask,
                              tgt_key_padding_mask, memory_key_padding_mask,
                              batch_first=True))

    def layer_stack(self, mod, path, layer_type, x, memory, run_layer):
        """nn.TransformerEncoder/Decoder: its layers (run_layer, batch
        first) and optional final LayerNorm; sequence-first stacks are
        transposed once (x and memory), not per layer."""
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        scope = path.replace(".", "/")
        layers = list(mod.layers)
        if not all(isinstance(l, layer_type) for l in layers):
            self.fail(f"{path}: layers must be nn.{layer_type.__name__}")
        seq_first = bool(layers) and not layers[0].self_attn.batch_first
        if seq_first:  # one transpose for the whole stack, not per layer
            x = self.transpose(at("batch_first"), x, (1, 0, 2), scope)
            if memory is not None:
                memory = self.transpose(at("memory_batch_first"), memory,
                                        (1, 0, 2), scope)
        for i, layer in enumerate(layers):
            if layer.self_attn.batch_first != (not seq_first):
                self.fail(f"{path}: mixed batch_first layers")
            x = run_layer(layer, at(f"layers.{i}"), x, memory)
        if mod.norm is not None:
            if not isinstance(mod.norm, nn.LayerNorm):
                self.fail(f"{path}: norm must be an nn.LayerNorm")
            x = self.layer_norm(mod.norm, at("norm"), x, scope)
        if seq_first:
            x = self.transpose(at("seq_first"), x, (1, 0, 2), scope)
        return x

    # ---- recurrent layers ---------------------------------------------------
    def lstm(self, mod, path, input_arg, hx):
        """nn.LSTM as one lstm op per layer and direction (the reverse one
        with attribute reverse, the two outputs concatenated), dropout between
        layers, transposes around a sequence-first stack. Returns (output,
        (h_n, c_n)); h_n[k] is a slice of layer k's output, c_n unsupported."""
        at = functools.partial(_join, path)  # "<path>.<leaf>"
        scope = self.scope_of(self.node)
        if hx is not None and not (isinstance(hx, fx.Node) and
                                   isinstance(self.env[hx], _Static) and
                                   self.env[hx].value is None):
            self.fail(f"nn.LSTM '{path}' with an initial state (h_0, c_0) is "
                      f"not supported; only the default zero state is")
        if getattr(mod, "proj_size", 0):
            self.fail(f"nn.LSTM '{path}' with proj_size is not supported")
        x = self.t(input_arg)
        if len(x.shape) != 3:
            self.fail(f"nn.LSTM '{path}': input {list(x.shape)} must have "
                      f"rank 3 (unbatched or packed sequences are not "
                      f"supported)")
        if not mod.batch_first:
            x = self.transpose(at("batch_first"), x, (1, 0, 2), scope)
        B, S, _ = x.shape
        H = mod.hidden_size
        dirs = 2 if mod.bidirectional else 1
        h_parts = []
        for layer in range(mod.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"l{layer}" + ("_reverse" if d else "")
                ins = [x, self.param(getattr(mod, f"weight_ih_{sfx}")),
                       self.param(getattr(mod, f"weight_hh_{sfx}"))]
                if mod.bias:
                    ins += [self.param(getattr(mod, f"bias_ih_{sfx}")),
                            self.param(getattr(mod, f"bias_hh_{sfx}"))]
                y = self.emit("lstm", at(sfx), ins,
                              {"reverse": True} if d else None, (B, S, H),
                              scope=scope)
                outs.append(y)
                h_parts.append((y, 0 if d else S - 1))
            if dirs == 1:
                x = outs[0]
            else:
                x = self.emit("concat", at(f"l{layer}_concat"), outs,
                              {"axis": 2}, (B, S, dirs * H), scope=scope)
            if layer + 1 < mod.num_layers:
                x = self.dropout(mod.dropout, at(f"l{layer}_dropout"), x,
                                 scope)
        if not mod.batch_first:
            x = self.transpose(at("seq_first"), x, (1, 0, 2), scope)
        return (x, (_LstmState(path, h_parts), _LstmState(path, None)))

    def lstm_state(self, st, k=None):
        """h_n[k] ([B, H]) or, with k None, the whole h_n; c_n fails."""
        if st.parts is None:
            self.fail(f"uses c_n, the final cell state of nn.LSTM "
                      f"'{st.path}', which is not supported (use the output "
                      f"or h_n)")
        scope = self.scope_of(self.node)
        if k is not None:
            if not -len(st.parts) <= k < len(st.parts):
                self.fail(f"h_n index {k} is out of range for nn.LSTM "
                          f"'{st.path}' ({len(st.parts)} layers x "
                          f"directions)")
            y, step = st.parts[k]
            B, S, H = y.shape
            last = self.emit("slice", _join(st.path, "h_n"), [y],
                             {"axis": 1, "start": step, "end": step + 1},
                             (B, 1, H), scope=scope)
            return self.reshape(_join(st.path, "h_n"), last, (B, H), scope)
        if st.whole is None:
            parts = []
            for i in range(len(st.parts)):
                h = self.lstm_state(st, i)
                parts.append(self.reshape(_join(st.path, "h_n"), h,
                                          (1,) + h.shape, scope))
            st.whole = parts[0] if len(parts) == 1 else self.emit(
                "concat", _join(st.path, "h_n"), parts, {"axis": 0},
                (len(parts),) + parts[0].shape[1:], scope=scope)
        return st.whole

    # ---- modules -----------------------------------------------------------
    def call_module(self, n):
        mod = self.root.get_submodule(n.target)
        path, scope = self.pub(n.target), self.scope_of(n)

        def bound():
            try:
                b = inspect.signature(mod.forward).bind(*n.args, **n.kwargs)
            except TypeError as e:
                self.fail(f"cannot bind its arguments: {e}")
            b.apply_defaults()
            return b.arguments

        def opt_tensor(a):
            if a is None:
                return None
            if isinstance(a, fx.Node):
                v = self.env[a]
                if isinstance(v, _Static):
                    return None if v.value is None else v
                if isinstance(v, _BoolIds):
                    return v
                return self.t(a)
            return _Static(a)

        def x0():
            return self.t(n.args[0] if n.args else next(iter(n.kwargs.values())))

        if isinstance(mod, nn.LSTM):
            a = bound()
            return self.lstm(mod, path, a["input"], a["hx"])
        if isinstance(mod, nn.RNNBase):
            self.fail(f"{type(mod).__name__} is not supported (nn.LSTM is)")
        if isinstance(mod, nn.MultiheadAttention):
            a = bound()
            out = self.mha(mod, path, self.t(a["query"]), self.t(a["key"]),
                           self.t(a["value"]), opt_tensor(a["attn_mask"]),
                           opt_tensor(a["key_padding_mask"]))
            return (out, None)
        if isinstance(mod, nn.TransformerEncoderLayer):
            a = bound()
            return self.encoder_layer(mod, path, self.t(a["src"]),
                                      opt_tensor(a["src_mask"]),
                                      opt_tensor(a["src_key_padding_mask"]))
        if isinstance(mod, nn.TransformerEncoder):
            a = bound()
            return self.encoder(mod, path, self.t(a["src"]),
                                opt_tensor(a["mask"]),
                                opt_tensor(a["src_key_padding_mask"]))
        if isinstance(mod, nn.TransformerDecoderLayer):
            a = bound()
            return self.decoder_layer(
                mod, path, self.t(a["tgt"]), self.t(a["memory"]),
                opt_tensor(a["tgt_mask"]), opt_tensor(a["memory_mask"]),
                opt_tensor(a["tgt_key_padding_mask"]),
                opt_tensor(a["memory_key_padding_mask"]))
        if isinstance(mod, nn.TransformerDecoder):
            a = bound()
            return self.decoder(
                mod, path, self.t(a["tgt"]), self.t(a["memory"]),
                opt_tensor(a["tgt_mask"]), opt_tensor(a["memory_mask"]),
                opt_tensor(a["tgt_key_padding_mask"]),
                opt_tensor(a["memory_key_padding_mask"]))
        if isinstance(mod, nn.Transformer):
            a = bound()
            if not isinstance(mod.encoder, nn.TransformerEncoder) or \
                    not isinstance(mod.decoder, nn.TransformerDecoder):
                self.fail("nn.Transformer with a custom encoder or decoder "
                          "is not supported")
            memory = self.encoder(mod.encoder, _join(path, "encoder"),
                                  self.t(a["src"]), opt_tensor(a["src_mask"]),
                                  opt_tensor(a["src_key_padding_mask"]))
            return self.decoder(
                mod.decoder, _join(path, "decoder"), self.t(a["tgt"]), memory,
                opt_tensor(a["tgt_mask"]), opt_tensor(a["memory_mask"]),
                opt_tensor(a["tgt_key_padding_mask"]),
                opt_tensor(a["memory_key_padding_mask"]))
        name = self.base_name(n)
        if isinstance(mod, nn.Linear):
            return self.linear_module(mod, name, x0(), scope)
        if isinstance(mod, (nn.ReLU, nn.GELU, nn.Sigmoid, nn.Tanh, nn.SiLU,
                            nn.ReLU6, nn.Hardsigmoid, nn.Hardswish)):
            return self.activation(mod, name, x0(), scope)
        if isinstance(mod, nn.LayerNorm):
            return self.layer_norm(mod, name, x0(), scope)
        if isinstance(mod, nn.Dropout) and type(mod) is nn.Dropout:
            return self.dropout(mod.p, name, x0(), scope)
        if isinstance(mod, nn.Identity):
            return x0()
        if isinstance(mod, (nn.Softmax, nn.LogSoftmax)):
            return self.softmax("softmax" if isinstance(mod, nn.Softmax)
                                else "log_softmax", x0(), mod.dim)
        if isinstance(mod, nn.Embedding):
            if mod.max_norm is not None:
                self.fail("Embedding with max_norm is not supported")
            return self.embedding(n.args[0], mod.weight)
        if isinstance(mod, nn.Conv2d):
            if mod.padding_mode != "zeros":
                self.fail(f"padding_mode '{mod.padding_mode}' is not supported")
            return self.conv2d(x0(), mod.weight, mod.bias, mod.stride,
                               mod.padding, mod.dilation, mod.groups)
        if isinstance(mod, nn.MaxPool2d):
            return self.max_pool2d(x0(), mod.kernel_size, mod.stride,
                                   mod.padding, mod.dilation, mod.ceil_mode,
                                   mod.return_indices)
        if isinstance(mod, nn.AvgPool2d):
            return self.avg_pool2d(x0(), mod.kernel_size, mod.stride,
                                   mod.padding, mod.ceil_mode,
                                   mod.count_include_pad,
                                   mod.divisor_override)
        if isinstance(mod, nn.AdaptiveAvgPool2d):
            return self.adaptive_avg_pool2d(x0())
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            if mod.affine:
                w, b = mod.weight, mod.bias
            else:
                w = b = None
            rm = mod.running_mean if mod.track_running_stats else None
            rv = mod.running_var if mod.track_running_stats else None
            return self.batch_norm(name, x0(), w, b, rm, rv, mod.momentum,
                                   mod.eps)
        if isinstance(mod, nn.Flatten):
            return self.flatten(x0(), mod.start_dim, mod.end_dim)
        if isinstance(mod, nn.Unflatten):
            x = x0()
            return self.reshape(name, x, self.out_shape(), scope)
        if isinstance(mod, (nn.NLLLoss, nn.CrossEntropyLoss)):
            kind = "nll_loss" if isinstance(mod, nn.NLLLoss) else "cross_entropy"
            return self.loss(kind, n.args[0], n.args[1], mod.weight,
                             mod.ignore_index, mod.reduction,
                             getattr(mod, "label_smoothing", 0.0))
        self.fail("this module type is not supported by the HAP exporter")

    # ---- shared op handlers ------------------------------------------------
    def softmax(self, kind, x, dim):
        rank = len(x.shape)
        if dim is None:  # PyTorch's legacy implicit dim
            dim = 0 if rank in (0, 1, 3) else 1
        if rank == 0 or dim not in (-1, rank - 1):
            self.fail(f"{kind} over dim {dim} of a rank-{rank} tensor; only the "
                      f"last dimension is supported")
        attrs = {}
        ins = [x]
        if x.causal or x.mask is not None:
            if kind != "softmax":
                self.fail("masked scores must go into softmax")
            attrs["causal"] = bool(x.causal)
            if x.mask is not None:
                ins.append(x.mask)
            x = x.with_mask()
            ins[0] = x
        return self.op(kind, ins, attrs)

    def embedding(self, ids_arg, weight):
        w = self.param(weight) if isinstance(weight, torch.Tensor) else self.t(weight)
        if len(w.shape) != 2:
            self.fail("the embedding table must have rank 2")
        if isinstance(ids_arg, fx.Node) and isinstance(self.env[ids_arg], _Static):
            ids = self.env[ids_arg].value
            n = ids.numel() if isinstance(ids, torch.Tensor) else -1
            if (isinstance(ids, torch.Tensor) and ids.dim() == 1 and
                    torch.equal(ids.cpu(), torch.arange(n))):
                # positions 0..n-1: the first n rows of the table
                if n == w.shape[0]:
                    return w
                return self.emit("slice", self.base_name(self.node), [w],
                                 {"axis": 0, "start": 0, "end": n},
                                 (n, w.shape[1]))
            self.fail("embedding of constant indices other than arange(n) is "
                      "not supported")
        ids = self.t(ids_arg)
        if ids.dtype != "INT64":
            self.fail("embedding indices must be integers")
        self.id_limits.setdefault(ids.name, w.shape[0])
        return self.op("embedding", [ids, w])

    def conv2d(self, x, weight, bias, stride, padding, dilation, groups):
        if tuple(_pair(dilation)) != (1, 1):
            self.fail("dilated convolution is not supported")
        w = self.param(weight) if isinstance(weight, torch.Tensor) else self.t(weight)
        ins = [x, w]
        if bias is not None:
            ins.append(self.param(bias) if isinstance(bias, torch.Tensor)
                       else self.t(bias))
        if isinstance(padding, str):
            if padding == "valid":
                padding = [0, 0]
            else:  # 'same'
                ks = w.shape[2:]
                if any(k % 2 == 0 for k in ks) or tuple(_pair(stride)) != (1, 1):
                    self.fail("padding='same' is supported for odd kernels and "
                              "stride 1 only")
                padding = [(k - 1) // 2 for k in ks]
        attrs = {"stride": _pair(stride), "padding": _pair(padding)}
        if groups != 1:
            attrs["groups"] = int(groups)
        return self.op("conv2d", ins, attrs)

    def pool_attrs(self, kind, x, kernel, stride, padding, ceil_mode):
        if len(x.shape) != 4:
            self.fail(f"{kind} needs an NCHW (rank-4) input")
        if stride is None or (isinstance(stride, (list, tuple)) and
                              len(stride) == 0):
            stride = kernel
        attrs = {"kernel": _pair(kernel), "stride": _pair(stride),
                 "padding": _pair(padding)}
        if any(2 * p > k for p, k in zip(attrs["padding"], attrs["kernel"])):
            self.fail(f"{kind} padding must be at most half the kernel")
        if ceil_mode:
            attrs["ceil_mode"] = True
        return attrs

    def max_pool2d(self, x, kernel, stride, padding, dilation, ceil_mode,
                   return_indices):
        if tuple(_pair(dilation)) != (1, 1) or return_indices:
            self.fail("max_pool2d with dilation or return_indices is not "
                      "supported")
        return self.op("max_pool2d", [x], self.pool_attrs(
            "max_pool2d", x, kernel, stride, padding, ceil_mode))

    def avg_pool2d(self, x, kernel, stride, padding, ceil_mode,
                   count_include_pad, divisor_override):
        if divisor_override is not None:
            self.fail("avg_pool2d with divisor_override is not supported")
        attrs = self.pool_attrs("avg_pool2d", x, kernel, stride, padding,
                                ceil_mode)
        if not count_include_pad:
            attrs["count_include_pad"] = False
        return self.op("avg_pool2d", [x], attrs)

    def adaptive_avg_pool2d(self, x):
        if len(x.shape) != 4:
            self.fail("adaptive_avg_pool2d needs an NCHW (rank-4) input")
        out = self.out_shape()
        return self.op("adaptive_avg_pool2d", [x],
                       {"output_size": [out[2], out[3]]})

    def flatten(self, x, start, end):
        rank = len(x.shape)
        if rank == 0:
            return self.reshape(self.base_name(self.node), x, (1,),
                                self.scope_of(self.node))
        s = start + rank if start < 0 else start
        e = end + rank if end < 0 else end
        if s == e:
            return x
        return self.op("flatten", [x], {"start_dim": s, "end_dim": e})

    def loss(self, kind, input_arg, target_arg, weight, ignore_index,
             reduction, label_smoothing):
        x, y = self.t(input_arg), self.t(target_arg)
        if weight is not None:
            self.fail(f"{kind} with class weights is not supported")
        if reduction != "mean":
            self.fail(f"{kind} with reduction='{reduction}' is not supported "
                      f"(only 'mean')")
        if ignore_index != -100:
            self.fail(f"{kind} with ignore_index={ignore_index} is not "
                      f"supported")
        if label_smoothing:
            self.fail(f"{kind} with label_smoothing is not supported")
        if len(x.shape) != 2 or len(y.shape) != 1 or y.dtype != "INT64":
            self.fail(f"{kind} needs [n, c] scores and [n] integer class "
                      f"targets, got {list(x.shape)} and {list(y.shape)} "
                      f"({y.dtype}); reshape with .view(-1, C) / .view(-1)")
        return self.op(kind, [x, y])

    def binary(self, kind, a, b, alpha=1):
        if alpha != 1:
            self.fail("alpha != 1 is not supported")
        sa, sb = self.is_static(a), self.is_static(b)
        if sa and sb:
            self.fail("internal: constant arithmetic reached the exporter")
        if not sa and not sb:
            ta, tb = self.t(a), self.t(b)
            return self.op(kind, [ta, tb])
        x, c, x_first = (b, a, False) if sa else (a, b, True)
        cv = self.v(c)
        if isinstance(cv, torch.Tensor) and cv.dim() == 0:
            cv = cv.item()
        if isinstance(cv, torch.Tensor):
            xt = self.t(x)
            if kind == "add" and len(xt.shape) >= 2 and \
                    _is_causal(cv, xt.shape[-1], xt.shape[-1]) and \
                    cv.is_floating_point():
                return xt.with_mask(causal=True)
            ct = self.t(c)
            return self.op(kind, [xt, ct] if x_first else [ct, xt])
        if not isinstance(cv, (int, float)) or isinstance(cv, bool):
            self.fail(f"cannot {kind} a {type(cv).__name__}")
        xt = self.t(x)
        cv = float(cv)
        if kind == "mul":
            return xt if cv == 1 else self.op("scale", [xt], {"factor": cv})
        if kind == "div":
            if not x_first:
                self.fail("dividing a constant by a tensor is not supported")
            return xt if cv == 1 else self.op("scale", [xt],
                                              {"factor": 1.0 / cv})
        if kind in ("add", "sub") and cv == 0:
            if kind == "sub" and not x_first:
                return self.op("scale", [xt], {"factor": -1.0})
            return xt
        ct = self.const(cv, xt)
        return self.op(kind, [xt, ct] if x_first else [ct, xt])

    def matmul(self, a, b, batched=False):
        if len(a.shape) < 2 or len(b.shape) < 2:
            self.fail("matmul of vectors (rank 1) is not supported")
        if batched and (len(a.shape) != 3 or len(b.shape) != 3):
            self.fail("bmm needs rank-3 operands")
        if len(b.shape) != 2 and (len(b.shape) != len(a.shape) or
                                  a.shape[:-2] != b.shape[:-2]):
            self.fail(f"matmul of {list(a.shape)} and {list(b.shape)}: the "
                      f"second operand must be rank 2 or have the same batch "
                      f"dimensions (no broadcasting)")
        return self.op("matmul", [a, b])

    def getitem(self, n):
        base, idx = n.args
        bv = self.env[base] if isinstance(base, fx.Node) else base
        if isinstance(bv, (tuple, list)):
            i = self.v(idx)
            el = bv[i]
            if el is None:
                self.fail("uses an output that the exporter does not produce "
                          "(e.g. the attention weights of MultiheadAttention)")
            return el
        if isinstance(bv, _LstmState) and isinstance(self.v(idx), int):
            return self.lstm_state(bv, self.v(idx))
        x = self.t(base)
        idx = self.v(idx)
        if not isinstance(idx, tuple):
            idx = (idx,)
        if any(isinstance(i, (torch.Tensor, list)) or isinstance(i, bool)
               for i in idx):
            self.fail("advanced (tensor/list) indexing is not supported")
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        rank = len(x.shape)
        if Ellipsis in idx:
            k = idx.index(Ellipsis)
            idx = idx[:k] + (slice(None),) * (rank - n_real) + idx[k + 1:]
        idx = tuple(i for i in idx if i is not None)
        idx = idx + (slice(None),) * (rank - len(idx))
        cur = x
        name = self.base_name(n)
        scope = self.scope_of(n)
        for axis, i in enumerate(idx):
            size = x.shape[axis]
            if isinstance(i, int):
                start = i + size if i < 0 else i
                end = start + 1
            else:
                start, end, step = i.indices(size)
                if step != 1:
                    self.fail("strided slicing is not supported")
            if (start, end) == (0, size):
                continue
            if end <= start:
                self.fail("empty slice")
            shape = list(cur.shape)
            shape[axis] = end - start
            cur = self.emit("slice", name, [cur], {"axis": axis,
                                                   "start": start, "end": end},
                            tuple(shape), scope=scope)
        return self.reshape(name, cur, self.out_shape(), scope)

    def split(self, x, sizes_or_n, dim, chunk):
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
        return tuple(self.emit("split", self.base_name(self.node), [x],
                               {"axis": d, "sizes": sizes}, outputs=shapes))

    def reduce(self, kind, x, dim, keepdim, dtype=None):
        if dtype is not None:
            self.fail(f"{kind} with dtype= is not supported")
        attrs = {}
        if dim is not None:
            dims = [dim] if isinstance(dim, int) else list(dim)
            rank = len(x.shape)
            attrs["axes"] = [d + rank if d < 0 else d for d in dims]
            if not attrs["axes"]:
                del attrs["axes"]
        if keepdim:
            attrs["keepdims"] = True
        return self.op(kind, [x], attrs)

    def masked_fill(self, x, mask, value):
        m, val = self.v(mask), self.v(value)
        if isinstance(val, torch.Tensor):
            val = val.item()
        if len(x.shape) >= 2 and val <= -1e4 and \
                _is_causal(m, x.shape[-2], x.shape[-1]) and m.dtype == torch.bool:
            return x.with_mask(causal=True)
        self.fail("masked_fill is supported only with a constant causal mask "
                  "and -inf, before softmax")

    def cat(self, tensors, dim):
        ts = [self.t(a) for a in tensors]
        if len(ts) == 1:
            return ts[0]
        rank = len(ts[0].shape)
        return self.op("concat", ts, {"axis": dim + rank if dim < 0 else dim})

    def stack(self, tensors, dim):
        ts = [self.t(a) for a in tensors]
        rank = len(ts[0].shape) + 1
        d = dim + rank if dim < 0 else dim
        name, scope = self.base_name(self.node), self.scope_of(self.node)
        parts = []
        for t in ts:
            sh = list(t.shape)
            sh.insert(d, 1)
            parts.append(self.reshape(f"{name}_in", t, sh, scope))
        if len(parts) == 1:
            return parts[0]
        return self.op("concat", parts, {"axis": d})

    def same_or_reshape(self, x):
        return self.reshape(self.base_name(self.node), x, self.out_shape(),
                            self.scope_of(self.node))

    def to(self, x):
        dt = self.node.meta.get("hap_dtype")
        if dt is not None and _ir_dtype(dt, self.node.name) != x.dtype:
            self.fail("dtype conversion is not supported")
        return x

    # ---- functions -----------------------------------------------------------
    def call_function(self, n):
        f = n.target
        A = n.args

        def arg(i, name, default=_MISSING):
            if len(A) > i:
                return A[i]
            if name in n.kwargs:
                return n.kwargs[name]
            if default is _MISSING:
                self.fail(f"missing argument '{name}'")
            return default

        def T(i, name):
            return self.t(arg(i, name))

        def V(i, name, default=_MISSING):
            return self.v(arg(i, name, default))

        if f in (operator.eq, torch.eq, operator.ne, torch.ne):
            return self.bool_ids("ne" if f in (operator.ne, torch.ne)
                                 else "eq", A[0], arg(1, "other"))
        if f in (operator.invert, torch.logical_not, torch.bitwise_not):
            return self.bool_ids("not", A[0])
        if f in (operator.add, operator.iadd, torch.add):
            return self.binary("add", A[0], arg(1, "other"),
                               self.v(n.kwargs.get("alpha", 1)))
        if f in (operator.sub, operator.isub, torch.sub):
            return self.binary("sub", A[0], arg(1, "other"),
                               self.v(n.kwargs.get("alpha", 1)))
        if f in (operator.mul, operator.imul, torch.mul):
            return self.binary("mul", A[0], arg(1, "other"))
        if f in (operator.truediv, operator.itruediv, torch.div):
            if n.kwargs.get("rounding_mode") is not None:
                self.fail("rounding division is not supported")
            if not self.is_static(arg(1, "other")):
                self.fail("division by a tensor is not supported")
            return self.binary("div", A[0], arg(1, "other"))
        if f in (operator.neg, torch.neg):
            return self.op("scale", [T(0, "input")], {"factor": -1.0})
        if f in (operator.matmul, torch.matmul):
            return self.matmul(T(0, "input"), T(1, "other"))
        if f is torch.bmm:
            return self.matmul(T(0, "input"), T(1, "mat2"), batched=True)
        if f is operator.getitem:
            return self.getitem(n)
        if f is getattr:
            x, attr = A[0], A[1]
            if attr == "T":
                t = self.t(x)
                return self.transpose(self.base_name(n), t,
                                      list(range(len(t.shape)))[::-1],
                                      self.scope_of(n))
            if attr == "mT":
                t = self.t(x)
                perm = list(range(len(t.shape)))
                perm[-2:] = perm[-1], perm[-2]
                return self.transpose(self.base_name(n), t, perm,
                                      self.scope_of(n))
            self.fail(f"tensor attribute '{attr}' is not supported")
        if f in (F.relu, torch.relu):
            return self.activation(F.relu, self.base_name(n), T(0, "input"),
                                   self.scope_of(n))
        if f is F.gelu:
            if V(1, "approximate", "none") != "none":
                self.fail("gelu(approximate='tanh') is not supported (the IR's "
                          "gelu is the exact erf form)")
            return self.activation(F.gelu, self.base_name(n), T(0, "input"),
                                   self.scope_of(n))
        if f in (torch.sigmoid, F.sigmoid):
            return self.op("sigmoid", [T(0, "input")])
        if f in (F.silu, F.relu6, F.hardsigmoid, F.hardswish):
            return self.activation(f, self.base_name(n), T(0, "input"),
                                   self.scope_of(n))
        if f is F.hardtanh:
            if (V(1, "min_val", -1.0), V(2, "max_val", 1.0)) != (0, 6):
                self.fail("hardtanh is supported as relu6 (0, 6) only")
            return self.activation(F.relu6, self.base_name(n), T(0, "input"),
                                   self.scope_of(n))
        if f in (torch.tanh, F.tanh):
            return self.op("tanh", [T(0, "input")])
        if f in (F.softmax, torch.softmax, F.log_softmax, torch.log_softmax):
            kind = "softmax" if f in (F.softmax, torch.softmax) else "log_softmax"
            if V(3, "dtype", None) is not None:
                self.fail(f"{kind} with dtype= is not supported")
            return self.softmax(kind, self.t(arg(0, "input"), allow_masked=True),
                                V(1, "dim", None))
        if f is F.dropout:
            p, training = V(1, "p", 0.5), V(2, "training", True)
            x = T(0, "input")
            return self.dropout(p if training else 0, self.base_name(n), x,
                                self.scope_of(n))
        if f is F.layer_norm:
            x = T(0, "input")
            shape = V(1, "normalized_shape")
            w, b = arg(2, "weight", None), arg(3, "bias", None)
            if len(shape) != 1 or w is None or b is None:
                self.fail("layer_norm needs one normalised dim and affine "
                          "weight and bias")
            return self.op("layer_norm", [x, self.t(w), self.t(b)],
                           {"eps": float(V(4, "eps", 1e-5))})
        if f is F.linear:
            b = arg(2, "bias", None)
            return self.op("linear", [T(0, "input"), T(1, "weight")] +
                           ([self.t(b)] if b is not None else []))
        if f is F.embedding:
            if V(3, "max_norm", None) is not None:
                self.fail("embedding with max_norm is not supported")
            return self.embedding(arg(0, "input"), arg(1, "weight"))
        if f in (torch.conv2d, F.conv2d):
            a = _args(n, ["input", "weight", "bias", "stride", "padding",
                          "dilation", "groups"],
                      {"bias": None, "stride": 1, "padding": 0,
                       "dilation": 1, "groups": 1})
            return self.conv2d(self.t(a["input"]), a["weight"], a["bias"],
                               self.v(a["stride"]), self.v(a["padding"]),
                               self.v(a["dilation"]), self.v(a["groups"]))
        if f in (F.max_pool2d, torch.max_pool2d):
            a = _args(n, ["input", "kernel_size", "stride", "padding",
                          "dilation", "ceil_mode", "return_indices"],
                      {"stride": None, "padding": 0, "dilation": 1,
                       "ceil_mode": False, "return_indices": False})
            return self.max_pool2d(self.t(a["input"]), self.v(a["kernel_size"]),
                                   self.v(a["stride"]), self.v(a["padding"]),
                                   self.v(a["dilation"]), self.v(a["ceil_mode"]),
                                   self.v(a["return_indices"]))
        if f is F.avg_pool2d:
            a = _args(n, ["input", "kernel_size", "stride", "padding",
                          "ceil_mode", "count_include_pad",
                          "divisor_override"],
                      {"stride": None, "padding": 0, "ceil_mode": False,
                       "count_include_pad": True, "divisor_override": None})
            return self.avg_pool2d(self.t(a["input"]), self.v(a["kernel_size"]),
                                   self.v(a["stride"]), self.v(a["padding"]),
                                   self.v(a["ceil_mode"]),
                                   self.v(a["count_include_pad"]),
                                   self.v(a["divisor_override"]))
        if _is_stochastic_depth(f):
            a = _args(n, ["input", "p", "mode", "training"],
                      {"training": True})
            x = self.t(a["input"])
            p, mode = float(self.v(a["p"])), self.v(a["mode"])
            if mode not in ("row", "batch"):
                self.fail(f"stochastic_depth mode '{mode}' is not supported")
            if not self.v(a["training"]) or p == 0:
                return x
            if p >= 1:
                self.fail("stochastic_depth with p=1 (every sample dropped) "
                          "is not supported")
            return self.op("drop_path", [x], {"p": p, "mode": mode})
        if f is F.batch_norm:
            a = _args(n, ["input", "running_mean", "running_var", "weight",
                          "bias", "training", "momentum", "eps"],
                      {"weight": None, "bias": None, "training": False,
                       "momentum": 0.1, "eps": 1e-5})
            if not self.v(a["training"]):
                self.fail("batch_norm with training=False (normalising by "
                          "the running statistics) is not supported: the IR "
                          "is one training step")

            def tensor_or_none(v):
                if v is None:
                    return None
                if isinstance(v, fx.Node) and v.op == "get_attr":
                    return _fetch_attr(self.root, v.target)
                return v

            return self.batch_norm(self.base_name(n), self.t(a["input"]),
                                   tensor_or_none(a["weight"]),
                                   tensor_or_none(a["bias"]),
                                   tensor_or_none(a["running_mean"]),
                                   tensor_or_none(a["running_var"]),
                                   self.v(a["momentum"]), self.v(a["eps"]))
        if f is F.adaptive_avg_pool2d:
            return self.adaptive_avg_pool2d(T(0, "input"))
        if f is torch.flatten:
            return self.flatten(T(0, "input"), V(1, "start_dim", 0),
                                V(2, "end_dim", -1))
        if f in (F.nll_loss, F.cross_entropy):
            kind = "nll_loss" if f is F.nll_loss else "cross_entropy"
            a = _args(n, ["input", "target", "weight", "size_average",
                          "ignore_index", "reduce", "reduction",
                          "label_smoothing"],
                      {"weight": None, "size_average": None,
                       "ignore_index": -100, "reduce": None,
                       "reduction": "mean", "label_smoothing": 0.0})
            if a["size_average"] is not None or a["reduce"] is not None:
                self.fail("the deprecated size_average/reduce arguments are "
                          "not supported")
            return self.loss(kind, a["input"], a["target"],
                             self.v(a["weight"]), self.v(a["ignore_index"]),
                             self.v(a["reduction"]),
                             self.v(a["label_smoothing"]))
        if f is torch.transpose:
            return self.transpose_dims(T(0, "input"), V(1, "dim0"), V(2, "dim1"))
        if f is torch.permute:
            return self.transpose(self.base_name(n), T(0, "input"),
                                  self.norm_dims(V(1, "dims")),
                                  self.scope_of(n))
        if f is torch.t:
            t = T(0, "input")
            return self.transpose(self.base_name(n), t,
                                  list(range(len(t.shape)))[::-1],
                                  self.scope_of(n))
        if f in (torch.reshape, torch.unsqueeze, torch.squeeze):
            return self.same_or_reshape(T(0, "input"))
        if f in (torch.cat, torch.concat):
            return self.cat(arg(0, "tensors"), V(1, "dim", 0))
        if f is torch.stack:
            return self.stack(arg(0, "tensors"), V(1, "dim", 0))
        if f in (torch.split, torch.chunk):
            if f is torch.chunk:
                return self.split(T(0, "input"), V(1, "chunks"),
                                  V(2, "dim", 0), True)
            return self.split(T(0, "input"), V(1, "split_size_or_sections"),
                              V(2, "dim", 0), False)
        if f in (torch.mean, torch.sum):
            kind = "mean" if f is torch.mean else "sum"
            return self.reduce(kind, T(0, "input"), V(1, "dim", None),
                               V(2, "keepdim", False), V(3, "dtype", None))
        self.fail("this function is not supported by the HAP exporter")

    def norm_dims(self, dims):
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        rank = len(dims)
        return [d + rank if d < 0 else d for d in dims]

    def transpose_dims(self, x, d0, d1):
        rank = len(x.shape)
        perm = list(range(rank))
        d0, d1 = d0 % rank, d1 % rank
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return self.transpose(self.base_name(self.node), x, perm,
                              self.scope_of(self.node))

    # ---- methods -------------------------------------------------------------
    def call_method(self, n):
        m = n.target
        A = n.args

        def arg(i, name, default=_MISSING):
            if len(A) > i:
                return A[i]
            if name in n.kwargs:
                return n.kwargs[name]
            if default is _MISSING:
                self.fail(f"missing argument '{name}'")
            return default

        def V(i, name, default=_MISSING):
            return self.v(arg(i, name, default))

        if m in ("softmax", "log_softmax"):
            x = self.t(A[0], allow_masked=True)
            return self.softmax(m, x, V(1, "dim", None))
        if m in ("eq", "ne", "__eq__", "__ne__"):
            return self.bool_ids(m.strip("_"), A[0], arg(1, "other"))
        if m in ("logical_not", "bitwise_not", "__invert__"):
            return self.bool_ids("not", A[0])
        x = self.t(A[0])
        if m in ("add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_",
                 "__add__", "__mul__"):
            kind = m.strip("_")
            other = arg(1, "other")
            if kind == "div" and not self.is_static(other):
                self.fail("division by a tensor is not supported")
            return self.binary(kind, A[0], other,
                               self.v(n.kwargs.get("alpha", 1)))
        if m in ("matmul", "__matmul__"):
            return self.matmul(x, self.t(A[1]))
        if m == "bmm":
            return self.matmul(x, self.t(A[1]), batched=True)
        if m in ("relu", "sigmoid", "tanh"):
            return self.op(m, [x])
        if m == "neg":
            return self.op("scale", [x], {"factor": -1.0})
        if m == "transpose":
            return self.transpose_dims(x, V(1, "dim0"), V(2, "dim1"))
        if m == "permute":
            return self.transpose(self.base_name(n), x,
                                  self.norm_dims(self.v(list(A[1:]))),
                                  self.scope_of(n))
        if m == "t":
            return self.transpose(self.base_name(n), x,
                                  list(range(len(x.shape)))[::-1],
                                  self.scope_of(n))
        if m in ("reshape", "view", "view_as", "reshape_as", "unsqueeze",
                 "squeeze", "unflatten"):
            return self.same_or_reshape(x)
        if m == "flatten":
            return self.flatten(x, V(1, "start_dim", 0), V(2, "end_dim", -1))
        if m in ("contiguous", "clone"):
            return x
        if m in ("float", "double", "half", "bfloat16", "long", "int", "to",
                 "type_as"):
            return self.to(x)
        if m in ("expand", "expand_as"):
            shape = self.out_shape()
            if shape == x.shape:
                return x
            return self.op("expand", [x], {"shape": list(shape)})
        if m in ("mean", "sum"):
            return self.reduce(m, x, V(1, "dim", None), V(2, "keepdim", False),
                               V(3, "dtype", None))
        if m in ("chunk", "split"):
            if m == "chunk":
                return self.split(x, V(1, "chunks"), V(2, "dim", 0), True)
            return self.split(x, V(1, "split_size"), V(2, "dim", 0), False)
        if m in ("masked_fill", "masked_fill_"):
            return self.masked_fill(x, arg(1, "mask"), arg(2, "value"))
        self.fail("this tensor method is not supported by the HAP exporter")


def _attr(v):
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


def _fetch_attr(root, target):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------
# Public entry point


class _LossWrapper(nn.Module):
    def __init__(self, model, loss_fn, target, feature_names):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.target, self.feature_names = target, feature_names

    def forward(self, **kwargs):  # replaced by a generated signature below
        raise NotImplementedError


def _wrap_with_loss(module, loss_fn, example_inputs, labels):
    if labels not in example_inputs:
        raise ExportError(f"loss= was given as a function, but there is no "
                          f"example input named '{labels}' (pass labels=NAME)")
    names = [k for k in example_inputs if k != labels]
    sig = inspect.signature(module.forward)
    ordered = [p for p in sig.parameters if p in names]
    ordered += [n for n in names if n not in ordered]
    src = (f"def forward(self, {', '.join(ordered + [labels])}):\n"
           f"    return self.loss_fn(self.model({', '.join(ordered)}), "
           f"{labels})\n")
    scope = {}
    exec(src, scope)  # a real signature for fx to trace
    cls = type(f"{type(module).__name__}WithLoss", (_LossWrapper,),
               {"forward": scope["forward"]})
    w = cls(module, loss_fn, labels, ordered)
    return w


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
    """
    if not isinstance(module, nn.Module):
        raise ExportError(f"expected an nn.Module, got {type(module).__name__}")
    example_inputs = dict(example_inputs)
    root, prefix = module, ""
    if callable(loss) and not isinstance(loss, (str, int)):
        root = _wrap_with_loss(module, loss, example_inputs, labels)
        prefix = "model"  # the wrapper's submodule; not part of any name
        loss = None
    sig = inspect.signature(root.forward)
    concrete = {}
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ExportError(f"forward(*{pname}/**{pname}) is not supported; "
                              f"name the arguments")
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

    was_training = root.training
    root.train()
    try:
        tracer = HapTracer()
        try:
            graph = tracer.trace(root, concrete_args=concrete or None)
        except ExportError:
            raise
        except Exception as e:  # fx.proxy.TraceError, TypeError, ...
            raise ExportError(f"torch.fx cannot trace "
                              f"{type(root).__name__}: {type(e).__name__}: {e}"
                              f" (data-dependent control flow is not "
                              f"supported)") from e
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
        param_targets = {k for k, _ in gm.named_parameters()}
        if run_on not in ("auto", "meta", "cpu"):
            raise ExportError(f"run_on must be auto, meta or cpu, not "
                              f"{run_on!r}")
        with torch.no_grad():
            done = False
            if run_on in ("auto", "meta"):
                try:
                    _Recorder(gm, param_targets, meta=True).run(
                        *_to_meta(args))
                    done = True
                except Exception as e:  # an op without a meta kernel
                    if run_on == "meta":
                        raise ExportError(
                            f"running {type(root).__name__} on meta tensors "
                            f"failed: {type(e).__name__}: {e}") from e
            if not done:
                try:
                    _Recorder(gm, param_targets).run(*args)
                except Exception as e:
                    raise ExportError(f"running {type(root).__name__} on the "
                                      f"example inputs failed: "
                                      f"{type(e).__name__}: {e}") from e
        out = next(n for n in gm.graph.nodes if n.op == "output")
        res = out.args[0]
        if loss is not None:
            try:
                res = res[loss]
            except (KeyError, IndexError, TypeError):
                raise ExportError(f"loss={loss!r} does not select an output of "
                                  f"forward") from None
        elif isinstance(res, (tuple, list)):
            res = res[0]
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
        input_nodes = {n: t for n, t in input_nodes.items() if t is not None}
        gname = name or type(module).__name__.lower()
        ex = _Exporter(gm, root, gname, res, input_nodes, module=module,
                       prefix=prefix)
        g = ex.run()
        return (g, ex.values) if return_values else g
    finally:
        root.train(was_training)


def state_dict_slices(graph):
    """The graph's SLICES_KEY metadata as a dict ({} when absent)."""
    raw = graph.get("metadata", {}).get(SLICES_KEY)
    return json.loads(raw) if raw else {}


def state_dict_weights(graph, values):
    """The module's parameters as the graph uses them, under their
    state_dict names (what `--weights` writes): each graph parameter by its
    name, the slices of SLICES_KEY reassembled into their source tensor
    (in_proj_weight whole), module buffers kept as state (BUFFERS_KEY:
    running statistics) included, exporter constants (frozen parameters that
    are not in the state_dict) left out. `values`: export(...,
    return_values=True)'s second result."""
    slices = state_dict_slices(graph)
    buffers = set(json.loads(graph.get("metadata", {}).get(BUFFERS_KEY, "[]")))
    out, parts = {}, {}
    for p in graph["parameters"]:
        name = p["tensor"]["name"]
        if name in buffers:
            out[name] = values[name]
        elif name in slices:
            s = slices[name]
            if s["source"] not in parts:
                out[s["source"]] = None  # keeps the graph's order
            parts.setdefault(s["source"], []).append((name, s))
        elif not p.get("frozen"):
            out[name] = values[name]
    for src, pieces in parts.items():
        shape, axis = pieces[0][1]["source_shape"], pieces[0][1]["axis"]
        first = values[pieces[0][0]]
        whole = torch.empty(shape, dtype=first.dtype, device=first.device)
        covered = torch.zeros(shape[axis], dtype=torch.int64)
        for name, s in pieces:
            v = values[name]
            if s["source_shape"] != shape or s["axis"] != axis:
                raise ExportError(f"{SLICES_KEY}: the slices of '{src}' "
                                  f"disagree on its shape or axis")
            n = v.shape[axis]
            whole.narrow(axis, s["offset"], n).copy_(v)
            covered[s["offset"]:s["offset"] + n] += 1
        if not bool((covered == 1).all()):
            raise ExportError(f"{SLICES_KEY}: the slices of '{src}' do not "
                              f"cover it exactly once")
        out[src] = whole
    meta = [k for k, v in out.items() if v.is_meta]
    if meta:
        raise ExportError(f"the module's parameters are on the meta device "
                          f"(e.g. '{meta[0]}'): there are no weights to "
                          f"write")
    return out


def _safetensors_io():
    """tools/safetensors_io.py, next to this file (also when this file is
    reached through a symlink, as in Bazel's runfiles)."""
    try:
        import safetensors_io  # noqa: PLC0415
        return safetensors_io
    except ImportError:
        pass
    here = os.path.dirname(os.path.realpath(__file__))
    spec = importlib.util.spec_from_file_location(
        "safetensors_io", os.path.join(here, "safetensors_io.py"))
    if spec is None or not os.path.exists(spec.origin):
        raise ExportError(f"--weights needs safetensors_io.py next to "
                          f"{__file__}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["safetensors_io"] = mod
    return mod


def write_weights(path, graph, values, module=None, weights=None):
    """Writes state_dict_weights(graph, values) (or `weights`, its result)
    as a safetensors file; returns (tensor count, the parameters of `module`
    left out because the graph does not use them)."""
    if weights is None:
        weights = state_dict_weights(graph, values)
    unused = []
    if module is not None:
        have = set(weights)
        unused = [n for n, _ in module.named_parameters() if n not in have]
    st = _safetensors_io()
    try:
        st.write_safetensors(path, weights, {
            "format": "pt", "exporter": "tools/export_fx.py",
            "graph": graph["name"]})
    except (st.SafetensorsError, OSError) as e:
        raise ExportError(f"cannot write the weights to {path}: {e}") from e
    return len(weights), unused


# --------------------------------------------------------------------------
# Command line


def _load_attr(spec):
    if ":" not in spec:
        raise ExportError(f"--module wants package.module:attr or "
                          f"file.py:attr, got '{spec}'")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.exists(path):
            raise ExportError(f"no such file '{mod_name}'")
        sys.path.insert(0, os.path.dirname(path))
        modspec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        mod = importlib.util.module_from_spec(modspec)
        modspec.loader.exec_module(mod)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise ExportError(f"cannot import '{mod_name}': {e}") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ExportError(f"'{mod_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


_CLI_DTYPES = {"float32": torch.float32, "float": torch.float32,
               "float64": torch.float64, "float16": torch.float16,
               "bfloat16": torch.bfloat16, "int64": torch.int64,
               "long": torch.int64, "int32": torch.int32, "int": torch.int64}


def _parse_input(spec):
    if "=" not in spec:
        raise ExportError(f"--input-shape wants name=d0,d1[:dtype[:high]], got "
                          f"'{spec}'")
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    try:
        shape = [int(d) for d in parts[0].split(",") if d.strip()]
    except ValueError:
        raise ExportError(f"--input-shape '{spec}': bad shape") from None
    dtype = _CLI_DTYPES.get(parts[1] if len(parts) > 1 else "float32")
    if dtype is None:
        raise ExportError(f"--input-shape '{spec}': unknown dtype '{parts[1]}'"
                          f" (one of {', '.join(sorted(_CLI_DTYPES))})")
    if dtype.is_floating_point:
        return name, torch.randn(shape, dtype=dtype)
    if len(parts) > 2:
        return name, torch.randint(0, int(parts[2]), shape, dtype=dtype)
    return name, torch.zeros(shape, dtype=dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Export a PyTorch module (traced with torch.fx) to a HAP "
                    "graph JSON file (hap.v1.Graph).")
    ap.add_argument("--module", required=True,
                    help="package.module:attr or path/file.py:attr (a module "
                         "instance, class or factory)")
    ap.add_argument("--kwargs", default="{}",
                    help="JSON object of keyword arguments for the factory")
    ap.add_argument("--input-shape", action="append", default=[],
                    metavar="NAME=D0,D1[:DTYPE[:HIGH]]",
                    help="an example input (repeatable)")
    ap.add_argument("--loss", default=None,
                    help="index or key of the loss in forward's output")
    ap.add_argument("--name", default=None, help="graph name")
    ap.add_argument("--run-on", default="auto", choices=("auto", "meta", "cpu"),
                    help="find shapes on meta tensors (quick) or on the real "
                         "inputs; auto: meta, falling back to cpu")
    ap.add_argument("-o", "--output", required=True,
                    help="output JSON file ('-' for stdout)")
    ap.add_argument("--weights", default=None, metavar="OUT.safetensors",
                    help="also write the module's current parameters as a "
                         "safetensors file under their state_dict names "
                         "(for --init-weights, or load_state_dict)")
    a = ap.parse_args(argv)
    try:
        obj = _load_attr(a.module)
        try:
            kwargs = json.loads(a.kwargs)
        except ValueError as e:
            raise ExportError(f"--kwargs is not JSON: {e}") from None
        examples = {}
        if isinstance(obj, nn.Module):
            module = obj
        elif callable(obj):
            module = obj(**kwargs)
        else:
            raise ExportError(f"'{a.module}' is not a module, class or "
                              f"factory")
        if isinstance(module, tuple) and len(module) == 2:
            module, examples = module
            examples = dict(examples)
        if not isinstance(module, nn.Module):
            raise ExportError(f"'{a.module}' did not give an nn.Module")
        ex = getattr(module, "example_inputs", None)
        if not examples and ex is not None:
            examples = dict(ex() if callable(ex) else ex)
        for spec in a.input_shape:
            k, t = _parse_input(spec)
            examples[k] = t
        loss = a.loss
        if loss is not None and loss.isdigit():
            loss = int(loss)
        g, values = export(module, examples, loss=loss, name=a.name,
                           run_on=a.run_on, return_values=True)
        weights = None
        if a.weights is not None:
            weights = state_dict_weights(g, values)  # fails before writing
    except ExportError as e:
        print(f"export_fx: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(g, indent=1)
    if a.output == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(a.output, "w") as f:
            f.write(text + "\n")
        n_params = sum(math.prod(p["tensor"]["shape"]) for p in g["parameters"])
        print(f"export_fx: wrote {a.output}: {len(g['ops'])} ops, "
              f"{len(g['parameters'])} parameter tensors ({n_params} values)",
              file=sys.stderr)
    if a.weights is not None:
        try:
            n, unused = write_weights(a.weights, g, values, module, weights)
        except ExportError as e:
            print(f"export_fx: error: {e}", file=sys.stderr)
            return 2
        print(f"export_fx: wrote {a.weights}: {n} tensors (state_dict names)",
              file=sys.stderr)
        if unused:
            print(f"export_fx: note: {len(unused)} parameters not used by "
                  f"forward are not in {a.weights}: {', '.join(unused)}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
