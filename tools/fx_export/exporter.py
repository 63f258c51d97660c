"""The exporter core: walks the traced graph from the inputs to the loss and
builds the HAP graph (inputs, parameters, ops, value_info, metadata).

Exporter holds what every op handler shares: unique names, parameters
(state_dict names, slices, exporter constants) and their values, op
emission, the conversion of fx arguments into IR tensors or export-time
values, and error messages that name the node. What a node becomes is up to
its handler, found in the registry's tables (registry.py) and written in the
ops_*.py module of its op family.
"""

import collections
import hashlib
import json
import math

import torch
import torch.fx as fx
import torch.nn as nn

from . import initializers
# Importing the op families registers their handlers.
from . import (ops_attention, ops_audio, ops_autograd,  # noqa: F401
               ops_convolution, ops_elementwise, ops_linear, ops_loss, ops_lstm,
               ops_normalization, ops_reduction, ops_shape, ops_transformer)
from . import registry
from .ir import (BUFFERS_KEY, EXTRAS_KEY, SAFETENSORS_DTYPES, SLICES_KEY,
                 BoolIds, ExportError, IrTensor, LstmState, RowMax, Static,
                 attr_value, float_torch_dtype, ir_dtype)


# The most runs of equal elements the buffers folded into constants may take
# in the graph's metadata together (EXTRAS_KEY "folded"); a buffer past it
# stays "unheld", named at export.
FOLDED_RUNS_LIMIT = 1 << 16

# The same for the parameters forward does not use, recorded with their
# values (EXTRAS_KEY "folded", marked "parameter") so that checkpoint exports
# give them back as PyTorch's training leaves them: a budget of their own
# (the buffers' is as it was), about 1 MiB of float32 values of random
# initialisation, some 4 MB of JSON in the graph and in every checkpoint's
# trainer.json. A parameter past it stays "unheld", named at export and by
# `hapctl checkpoint export`.
UNUSED_PARAMETER_RUNS_LIMIT = 1 << 18

# The most runs of equal values that the graph's VALUES constants (unequal
# values: attention masks, one-hot gather matrices) may list together: a
# graph file of about 40 MB.
VALUES_RUNS_LIMIT = 1 << 21

# Operand dtypes the IR's ops take (planner/graph/ops_*.cc): the positions of
# integer operands (ids, class targets), ops that move any dtype, and
# otherwise one floating-point dtype for every operand.
_INTEGER_OPERANDS = {"embedding": (0,), "cross_entropy": (1,),
                     "nll_loss": (1,)}
_ANY_DTYPE_OPS = frozenset({"transpose", "reshape", "flatten", "concat",
                            "split", "slice", "expand"})

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32,
                   8: torch.int64}


def folded_record(value, budget, limit=FOLDED_RUNS_LIMIT):
    """EXTRAS_KEY's "folded" entry for the buffer `value` ({dtype, shape,
    runs: [[count, the element's little-endian bytes in hex]]}, row-major)
    and None, or None and why it cannot be recorded; `budget` ([runs left]
    of `limit`) is shared by the buffers of one graph (by its unused
    parameters, with their own `limit`)."""
    if not isinstance(value, torch.Tensor):
        # A module's extra state (get_extra_state) in its state_dict: any
        # object (it was an AttributeError traceback).
        return None, (f"not a tensor (a {type(value).__name__}: the "
                      f"module's extra state)")
    dtype = SAFETENSORS_DTYPES.get(value.dtype)
    if dtype is None:
        return None, (f"dtype {value.dtype} (exports write "
                      f"{'/'.join(SAFETENSORS_DTYPES.values())})")
    if value.is_meta:
        return None, "on the meta device: no values"
    flat = value.detach().reshape(-1).contiguous().cpu()
    width = flat.element_size()
    bits = flat.view(_SAME_WIDTH_INT[width])
    n = bits.numel()
    # Counted before they are listed (a buffer of millions of runs).
    count = int((bits[1:] != bits[:-1]).sum()) + 1 if n else 0
    if count > budget[0]:
        return None, (f"{count} runs of equal values, over the "
                      f"{budget[0]} left of the graph's {limit}")
    change = (torch.nonzero(bits[1:] != bits[:-1]).flatten() + 1).tolist()
    starts, ends = [0] + change, change + [n]
    if n == 0:
        starts, ends = [], []
    budget[0] -= len(starts)
    runs = [[e - b, int(bits[b]).to_bytes(width, "little", signed=True).hex()]
            for b, e in zip(starts, ends)]
    return {"dtype": dtype, "shape": list(value.shape), "runs": runs}, None


def _target_name(node, root):
    """The node's target as the error messages show it."""
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
        if mod.startswith("torch._C._nn") or \
                mod == "torch._C._VariableFunctions":
            mod = "torch"
        return f"{mod}.{getattr(t, '__name__', repr(t))}"
    return str(t)


class Exporter:
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
        self.values_runs_left = VALUES_RUNS_LIMIT
        self.id_limits = {}  # INT64 tensor -> its ids lie in [0, limit)
        self.padding_masks = {}  # key padding mask source -> [B, 1, 1, Sk]
        self.values = {}  # parameter name -> torch tensor (its PyTorch value)
        self.buffers = []  # graph parameters that are module buffers
        self.buffer_names = {id(b): self.pub(n)
                             for n, b in root.named_buffers()}
        self.persistent = None  # the module's state_dict names, when asked

    def pub(self, path):
        """A module path of `root` as a path of the user's module."""
        if not self.prefix:
            return path
        if path == self.prefix:
            return ""
        if path.startswith(self.prefix + "."):
            return path[len(self.prefix) + 1:]
        return path

    def fetch_attr(self, target):
        """The attribute of `root` at the dotted path `target`."""
        obj = self.root
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    # ---- errors -----------------------------------------------------------
    def fail(self, why, node=None):
        node = node or self.node
        if node is None:
            raise ExportError(why)
        raise ExportError(
            f"node '{node.name}' ({node.op} {_target_name(node, self.root)})"
            f"{self.where(node)}: {why}")

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
            init = initializers.default_init(self.module, name, tensor)
        # A module parameter with requires_grad=False (frozen for
        # fine-tuning) is one in the graph too: PyTorch does not train it.
        held_fixed = source is not None and not tensor.requires_grad
        if not frozen:
            init = initializers.constant_init(val) or init
            frozen = held_fixed
        if any(isinstance(v, float) and not math.isfinite(v)
               for v in init.values()):
            # An initialiser fitted to inf/NaN values: JSON has no such
            # numbers (the graph file did not parse).
            self.fail(f"parameter '{name}' holds non-finite values (inf or "
                      f"NaN), which no initialiser of the IR describes")
        shape = tuple(tensor.shape) if shape is None else tuple(shape)
        dtype = ir_dtype(tensor.dtype, f"parameter '{name}'")
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
        t = IrTensor(name, shape, dtype)
        entry = {"tensor": {"name": name, "shape": list(shape), "dtype": dtype},
                 "init": init}
        if frozen:
            entry["frozen"] = True
        self.params[key] = (entry, t)
        self.values[name] = val
        return t

    def const(self, value, like, what=None):
        """A constant as a frozen parameter in the dtype of `like`: of
        CONSTANT initialisation (ZEROS, ONES) when its values are equal,
        else of VALUES (values_const). `what` names where a tensor value
        comes from (error messages)."""
        if isinstance(value, torch.Tensor):
            v = value.detach().double().flatten()
            of = f" ({what})" if what else ""
            if v.numel() == 0:
                self.fail(f"needs an empty constant tensor{of}, which the "
                          f"HAP IR cannot hold")
            if float(v.min()) != float(v.max()):
                return self.values_const(value, like, of)
            shape, value = tuple(value.shape), float(v[0])
        else:
            shape, value = (), float(value)
        self.n_const += 1
        init = initializers.constant(value)
        if not math.isfinite(value):
            self.fail(f"needs the non-finite constant {value}")
        # In the dtype of the tensor it meets (a bf16 model's constants are
        # bf16, as its values for return_values).
        dummy = torch.full(shape, value, dtype=float_torch_dtype(like.dtype))
        t = self.param(dummy, name=f"const.{self.node.name}", init=init,
                       frozen=True, key=("const", self.n_const), shape=shape)
        if t.dtype != like.dtype:
            entry = self.params[("const", self.n_const)][0]
            entry["tensor"]["dtype"] = like.dtype
            t.dtype = like.dtype
        return t

    def values_const(self, value, like, of=""):
        """A constant tensor of unequal values (a shifted-window attention
        mask, a one-hot gather matrix): a frozen parameter whose VALUES
        initializer lists them as runs of equal values. Equal constants
        (each block's copy of one mask) are one parameter."""
        if like.dtype == "INT64":
            self.fail(f"needs an integer constant tensor with unequal "
                      f"values{of}, which the HAP IR cannot hold (its "
                      f"parameters are floating point)")
        data = value.detach().to(float_torch_dtype(like.dtype)).contiguous()
        if not bool(torch.isfinite(data).all()):
            self.fail(f"needs a constant tensor with non-finite values{of}")
        digest = hashlib.sha256(data.cpu().view(-1).view(torch.uint8)
                                .numpy().tobytes()).hexdigest()
        key = ("values", like.dtype, tuple(data.shape), digest)
        if key not in self.params:
            # Counted before they are listed: a constant of millions of
            # runs fails at once, not after a Python list of them.
            runs = initializers.count_runs(data)
            if runs > self.values_runs_left:
                self.fail(f"needs a constant tensor{of} of {runs} runs of "
                          f"equal values, over the {self.values_runs_left} "
                          f"left of the graph's {VALUES_RUNS_LIMIT}")
            init, _ = initializers.values(data)
            self.values_runs_left -= runs
        return self.param(data, name=f"const.{self.node.name}",
                          init=None if key in self.params else init,
                          frozen=True, key=key)

    def buffer_param(self, node, buf):
        """A persistent floating-point buffer of uniform value used as it is
        (`x * self.scale`): a frozen parameter under its state_dict name, so
        that --weights and exports hold it (load_state_dict(strict=True)
        wants it); None for the other buffers (constants, or an error)."""
        name = self.pub(node.target)
        if self.persistent is None:
            self.persistent = set(self.module.state_dict().keys())
        if name not in self.persistent or not buf.dtype.is_floating_point \
                or buf.numel() == 0:
            return None
        init = initializers.constant_init(buf.detach())
        if init is None:
            return None
        return self.param(buf, name=name, init=init, frozen=True,
                          key=id(buf))

    def emit(self, type_, name, inputs, attrs=None, shape=None, dtype=None,
             scope=None, outputs=None):
        """Adds an op; `shape`/`dtype` of its (single) output, or the shapes
        of its several `outputs` (then returns their list)."""
        for t in inputs:
            if not isinstance(t, IrTensor):
                self.fail(f"internal: op '{name}' got a non-tensor input {t!r}")
        self.check_operand_dtypes(type_, inputs)
        name = self.fresh(name)
        if scope is None:
            scope = self.scope_of(self.node) if self.node is not None else ""
        op = {"name": name, "type": type_, "inputs": [t.name for t in inputs]}
        dtype = dtype or inputs[0].dtype
        if outputs is None:
            outs = [IrTensor(name, shape, dtype)]
        else:
            outs = []
            for i, s in enumerate(outputs):
                outs.append(IrTensor(self.fresh(f"{name}:{i}"), s, dtype))
        op["outputs"] = [t.name for t in outs]
        if attrs:
            op["attrs"] = {k: attr_value(v) for k, v in attrs.items()}
        if scope:
            op["scope"] = scope
        self.ops.append(op)
        for t in outs:
            self.value_info.append({"name": t.name, "shape": list(t.shape),
                                    "dtype": t.dtype})
        return outs[0] if outputs is None else outs

    def check_operand_dtypes(self, type_, inputs):
        """Fails unless `inputs` have the dtypes op `type_` takes: PyTorch's
        integer arithmetic and its type promotion exported graphs that
        `hapctl validate` refused ('must be a floating-point tensor', 'must
        have the same dtype') after exit status 0."""
        ints = _INTEGER_OPERANDS.get(type_, ())  # none for the shape ops
        if type_ not in _ANY_DTYPE_OPS:
            for i, t in enumerate(inputs):
                if i in ints and t.dtype != "INT64":
                    self.fail(f"{type_} takes integer ids or targets as its "
                              f"operand {i}, not the {t.dtype} tensor "
                              f"'{t.name}'")
                if i not in ints and t.dtype == "INT64":
                    self.fail(f"{type_} of the integer tensor '{t.name}' is "
                              f"not supported: the IR computes in floating "
                              f"point, integer tensors are only ids and "
                              f"labels")
        dtypes = sorted({t.dtype for i, t in enumerate(inputs)
                         if i not in ints})
        if len(dtypes) > 1:
            self.fail(f"{type_} mixes the dtypes {' and '.join(dtypes)} "
                      f"(PyTorch promotes them; the IR's ops take one dtype)")

    def op(self, type_, inputs, attrs=None, name=None):
        """Emits the op of the current node, output shape from tracing."""
        return self.emit(type_, name or self.base_name(self.node), inputs,
                         attrs, self.out_shape(), self.out_dtype())

    def reshape(self, name, x, shape, scope):
        """x as `shape` (x itself when it has that shape already)."""
        shape = tuple(shape)
        if shape == x.shape:
            return x
        return self.emit("reshape", name, [x], {"shape": list(shape)}, shape,
                         scope=scope)

    def transpose(self, name, x, perm, scope):
        """x with its axes permuted (x itself for the identity)."""
        perm = list(perm)
        if perm == list(range(len(perm))):
            return x
        shape = tuple(x.shape[p] for p in perm)
        return self.emit("transpose", name, [x], {"perm": perm}, shape,
                         scope=scope)

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
            if isinstance(v, Static):
                if isinstance(v.value, torch.Tensor):
                    like = IrTensor("", (), ir_dtype(v.value.dtype, a.name))
                    if a.op == "get_attr":
                        held = self.buffer_param(a, v.value)
                        if held is not None:
                            return held
                    what = (f"the buffer '{self.pub(a.target)}'"
                            if a.op == "get_attr" else f"'{a.name}'")
                    return self.const(v.value, like, what)
                self.fail(f"expects a tensor, got {type(v.value).__name__} "
                          f"from '{a.name}'")
            if isinstance(v, LstmState):
                v = ops_lstm.lstm_state(self, v)
            if isinstance(v, BoolIds):
                self.fail(f"boolean tensor '{a.name}' is supported only as "
                          f"an attention key_padding_mask")
            if isinstance(v, RowMax):
                self.fail(f"the maximum '{a.name}' is supported only as the "
                          f"shift x - x.max(dim={v.dim}, keepdim=True)[0] "
                          f"before a softmax over that dim (the IR has no "
                          f"max reduction)")
            if isinstance(v, IrTensor) and v.shifted is not None and \
                    not allow_masked:
                self.fail(f"'{a.name}' (x less its maximum over dim "
                          f"{v.shifted}) is supported only as the input of "
                          f"a softmax over that dim")
            if not isinstance(v, IrTensor):
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
            if isinstance(v, Static):
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
            return isinstance(self.env[a], Static)
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
        return ir_dtype(node.meta["hap_dtype"], f"node '{node.name}'")

    # ---- dispatch ----------------------------------------------------------
    def call_module(self, n):
        call = registry.ModuleCall(self, n)
        handler = registry.module_handler(type(call.mod))
        if handler is None:
            self.fail("this module type is not supported by the HAP exporter")
        return handler(self, call)

    def refuse_out(self, n):
        """`out=`: PyTorch writes the result into that tensor, which the
        graph cannot express; it was dropped, and the tensor kept its old
        values in every later use."""
        # F.normalize passes its out=None on to __torch_function__.
        if n.kwargs.get("out") is not None:
            self.fail("passes out=, writing its result into another tensor, "
                      "which the HAP graph cannot express: assign the result "
                      "instead (z = torch.add(x, y))")

    def call_function(self, n):
        handler = registry.function_handler(n.target)
        if handler is None:
            self.fail("this function is not supported by the HAP exporter")
        return handler(self, registry.CallArgs(self, n))

    def call_method(self, n):
        entry = registry.method_handler(n.target)
        call = registry.CallArgs(self, n)
        if entry is not None and not entry.tensor_self:
            return entry.handler(self, call)
        # The receiver is converted first, also for an unsupported method:
        # a boolean or masked receiver fails naming that instead.
        x = self.t(n.args[0])
        if entry is None:
            self.fail("this tensor method is not supported by the HAP "
                      "exporter")
        return entry.handler(self, call, x)

    # ---- driver ------------------------------------------------------------
    def run(self):
        """The graph (a dict in proto3 JSON form)."""
        for n, ex in self.input_nodes.items():
            if n.meta.get("hap_static"):
                continue
            boolean = ex.dtype == torch.bool  # 0/1 ids (a padding mask)
            dtype = "INT64" if boolean else \
                ir_dtype(ex.dtype, f"input '{n.target}'")
            name = n.target
            self.used.add(name)
            self.env[n] = IrTensor(name, tuple(ex.shape), dtype)
            if boolean:
                self.id_limits[name] = 2
                self.env[n] = BoolIds(self.env[n], {1})
            self.inputs.append({"tensor": {"name": name,
                                           "shape": list(ex.shape),
                                           "dtype": dtype}})
        # Every node, the loss's or not: the call's own result is often
        # unused (torch.add(x, y, out=z) writes z).
        for n in self.gm.graph.nodes:
            if n.op in ("call_function", "call_method"):
                self.node = n
                self.refuse_out(n)
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
            try:
                self.env[n] = self.export_node(n)
            except ExportError:
                raise
            except Exception as e:  # noqa: BLE001
                # A handler that did not foresee this use of its op: still
                # an error naming the node, its target and where it is.
                raise ExportError(
                    f"node '{n.name}' ({n.op} {_target_name(n, self.root)})"
                    f"{self.where(n)}: the exporter cannot handle this use "
                    f"({type(e).__name__}: {e})") from e
        self.node = self.loss_node
        loss = self.env[self.loss_node]
        if not isinstance(loss, IrTensor) or loss.shape != () or \
                loss.dtype == "INT64":
            self.fail("the loss must be a scalar float tensor computed by the "
                      "module (its forward should return the loss)")
        if not any(loss.name in op["outputs"] for op in self.ops):
            self.fail("the loss must be computed by an op")
        self.node = None
        self.assign_roles()
        params = [e for e, _ in self.params.values()]
        read = {name for op in self.ops for name in op["inputs"]}
        for e in params:
            pname = e["tensor"]["name"]
            if not (e.get("frozen") or pname in self.slices or
                    pname in self.reserved):
                raise ExportError(f"internal: graph parameter '{pname}' is "
                                  f"neither a state_dict name nor a slice")
            if not e.get("frozen") and pname not in read:
                # A handler declared it (PyTorch's op reads it: its
                # gradient is zero or more, never None) but no op reads
                # it: it would have no gradient, and the optimizer would
                # skip it where PyTorch's weight decay moves it (a 1-step
                # nn.GRU's weight_hh did).
                raise ExportError(f"internal: trainable graph parameter "
                                  f"'{pname}' is read by no op, so it "
                                  f"would get no gradient where PyTorch's "
                                  f"is zero (please report this model)")
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
                         BUFFERS_KEY: json.dumps(sorted(self.buffers)),
                         EXTRAS_KEY: json.dumps(self.state_dict_extras(params),
                                                sort_keys=True)},
        }

    def export_node(self, n):
        """What node `n` stands for (its handler's result)."""
        if n.meta.get("hap_static"):
            return Static(n.meta.get("hap_value"))
        if n.meta.get("hap_no_grad"):
            # fx records no grad mode: `with torch.no_grad(): t = self.a(x)`
            # was exported with gradients into self.a (trained, where
            # PyTorch leaves it as it is).
            self.fail("is computed under torch.no_grad() (or "
                      "set_grad_enabled(False), or inference_mode()), which "
                      "the HAP graph cannot "
                      "express: its ops would get gradients that PyTorch's "
                      "do not (freeze parameters with requires_grad_(False) "
                      "instead)")
        if n.op == "placeholder":
            self.fail("has no example input")
        if n.op == "get_attr":
            return self.param(self.fetch_attr(n.target))
        if n.op == "call_module":
            return self.call_module(n)
        if n.op == "call_function":
            return self.call_function(n)
        if n.op == "call_method":
            return self.call_method(n)
        self.fail("is not supported")

    def where(self, node):
        """ " in <module path>" for a function or method node inside a
        submodule's forward, or "" (a call_module's target is its path)."""
        if node.op == "call_module":
            return ""
        scope = self.scope_of(node)
        return f" in {scope.replace('/', '.')}" if scope else ""

    def state_dict_extras(self, params):
        """EXTRAS_KEY's object: the module's state_dict names the graph
        holds under another name (tied weights), does not hold, and the
        graph parameters that are not state_dict entries."""
        state = self.module.state_dict(keep_vars=True)
        held = set(self.buffers)
        held.update(s["source"] for s in self.slices.values())
        constants = []
        for e in params:
            name = e["tensor"]["name"]
            if name in self.slices or name in held:
                continue
            if e.get("frozen") and name not in state:
                constants.append(name)
            else:
                held.add(name)
        holder = {}  # id(tensor) -> the state_dict name the graph holds
        for k, v in state.items():
            if k in held:
                holder.setdefault(id(v), k)
        # Forwards of each module per step (PyTorch runs every call of
        # forward, also those the loss does not need).
        forwards = collections.Counter(
            id(self.root.get_submodule(n.target))
            for n in self.gm.graph.nodes if n.op == "call_module")
        aliases, counters, folded, unheld, unrecorded = {}, {}, {}, [], {}
        budget = [FOLDED_RUNS_LIMIT]
        unused_budget = [UNUSED_PARAMETER_RUNS_LIMIT]
        for k, v in state.items():
            if k in held:
                continue
            if id(v) in holder:
                aliases[k] = holder[id(v)]
                continue
            owner = self.counter_owner(k, v)
            if owner is not None:
                counters[k] = {"per_step": forwards[id(owner)],
                               "value": int(v) if not v.is_meta else 0}
                continue
            if isinstance(v, nn.Parameter):  # keep_vars: else a buffer
                # Forward does not use it: PyTorch's training leaves it as
                # it is (no gradient, the optimizers skip it), so exports
                # give back its value now.
                record, why = folded_record(v, unused_budget,
                                            UNUSED_PARAMETER_RUNS_LIMIT)
                if record is not None:
                    record["parameter"] = True
                else:
                    why = f"a parameter forward does not use, {why}"
            else:
                record, why = folded_record(v, budget)
            if record is not None:
                folded[k] = record
                continue
            unrecorded[k] = why
            unheld.append(k)
        return {"aliases": aliases, "constants": sorted(constants),
                "counters": counters, "folded": folded, "unheld": unheld,
                "unrecorded": unrecorded}

    def counter_owner(self, key, value):
        """The BatchNorm module whose num_batches_tracked the state_dict
        entry `key` is (PyTorch adds one per forward in training mode), or
        None."""
        path, _, leaf = key.rpartition(".")
        if leaf != "num_batches_tracked":
            return None
        try:
            mod = self.module.get_submodule(path)
        except AttributeError:
            return None
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and \
                mod.track_running_stats and mod.num_batches_tracked is value:
            return mod
        return None

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
