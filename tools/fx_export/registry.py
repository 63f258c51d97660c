"""The dispatch tables: which handler exports a traced fx node.

Each ops_*.py module registers its handlers here when it is imported, with
the decorators below; the exporter looks a node up by its kind:

  * call_module: the module's class, along its MRO, so a subclass is
    handled as its nearest registered base (as isinstance would); a handler
    registered with exact=True takes only that class itself, and the lookup
    goes on up the MRO for a subclass. Handler: fn(ex, call: ModuleCall).
  * call_function: the function object itself (torch.add, operator.add and
    F.relu are distinct keys), then the predicates of functions_matching
    (for functions of libraries the exporter does not import). Handler:
    fn(ex, call: CallArgs).
  * call_method: the method name. Handler: fn(ex, call: CallArgs, x) with x
    the receiver already converted to an IrTensor; with tensor_self=False,
    fn(ex, call) converts the receiver itself (masked scores, booleans).

A key registered twice with different handlers is a programming error,
raised when the ops module is imported.
"""

import collections
import inspect

import torch.fx as fx

from .ir import BoolIds, Static

_MISSING = object()

_MODULES = {}  # nn.Module subclass -> _ModuleEntry
_FUNCTIONS = {}  # function -> handler
_FUNCTION_MATCHERS = []  # [(predicate(function) -> bool, handler)]
_METHODS = {}  # Tensor method name -> MethodEntry

_ModuleEntry = collections.namedtuple("_ModuleEntry", "handler exact")
MethodEntry = collections.namedtuple("MethodEntry", "handler tensor_self")


def _add(table, key, entry):
    old = table.setdefault(key, entry)
    if old != entry:
        raise ValueError(f"fx_export: {key!r} has two handlers")


def modules(*classes, exact=False):
    """Registers the decorated fn(ex, call) for these nn.Module classes (and,
    unless `exact`, their subclasses)."""
    def register(handler):
        for cls in classes:
            _add(_MODULES, cls, _ModuleEntry(handler, exact))
        return handler
    return register


def functions(*fns):
    """Registers the decorated fn(ex, call) for these functions."""
    def register(handler):
        for f in fns:
            _add(_FUNCTIONS, f, handler)
        return handler
    return register


def functions_matching(predicate):
    """Registers the decorated fn(ex, call) for the functions f for which
    predicate(f) holds (looked up only when f has no handler of its own)."""
    def register(handler):
        _FUNCTION_MATCHERS.append((predicate, handler))
        return handler
    return register


def methods(*names, tensor_self=True):
    """Registers the decorated handler for these Tensor method names."""
    def register(handler):
        for name in names:
            _add(_METHODS, name, MethodEntry(handler, tensor_self))
        return handler
    return register


def handled_base(cls):
    """The class in `cls`'s MRO whose handler module_handler gives, or None."""
    for base in cls.__mro__:
        entry = _MODULES.get(base)
        if entry is not None and (not entry.exact or base is cls):
            return base
    return None


def module_handler(cls):
    """The handler of an nn.Module class, or None."""
    base = handled_base(cls)
    return None if base is None else _MODULES[base].handler


def function_handler(f):
    """The handler of a call_function target, or None."""
    try:
        handler = _FUNCTIONS.get(f)
    except TypeError:  # an unhashable callable: no handler of its own
        handler = None
    if handler is not None:
        return handler
    for predicate, matched in _FUNCTION_MATCHERS:
        if predicate(f):
            return matched
    return None


def method_handler(name):
    """The MethodEntry of a call_method target, or None."""
    return _METHODS.get(name)


class CallArgs:
    """The arguments of a call_function or call_method node (a method's
    receiver is args[0]), by position or by keyword."""

    def __init__(self, ex, node):
        self.ex, self.node = ex, node
        self.args, self.kwargs = node.args, node.kwargs

    def arg(self, i, name, default=_MISSING):
        """Positional argument `i`, else keyword `name`, else `default`
        (failing when there is none)."""
        if len(self.args) > i:
            return self.args[i]
        if name in self.kwargs:
            return self.kwargs[name]
        if default is _MISSING:
            self.ex.fail(f"missing argument '{name}'")
        return default

    def tensor(self, i, name):
        """arg(i, name) as an IrTensor."""
        return self.ex.t(self.arg(i, name))

    def value(self, i, name, default=_MISSING):
        """arg(i, name, default), known at export time."""
        return self.ex.v(self.arg(i, name, default))

    def named(self, names, defaults=None):
        """The positional and keyword arguments as a dict by `names` (the
        function's parameters in order), `defaults` filling the rest."""
        defaults = defaults or {}
        out = {}
        for i, a in enumerate(self.args):
            if i >= len(names):
                break
            out[names[i]] = a
        for k, v in self.kwargs.items():
            out[k] = v
        for k, v in defaults.items():
            out.setdefault(k, v)
        return out


class ModuleCall:
    """A call_module node: the submodule, its path in the user's module, the
    scope and name of its ops, and its arguments."""

    def __init__(self, ex, node):
        self.ex, self.node = ex, node
        self.mod = ex.root.get_submodule(node.target)
        self.path, self.scope = ex.pub(node.target), ex.scope_of(node)

    @property
    def name(self):
        """The name of the op the module becomes (its path)."""
        return self.ex.base_name(self.node)

    def bound(self):
        """forward's arguments by parameter name, defaults applied."""
        n = self.node
        try:
            b = inspect.signature(self.mod.forward).bind(*n.args, **n.kwargs)
        except TypeError as e:
            self.ex.fail(f"cannot bind its arguments: {e}")
        b.apply_defaults()
        return b.arguments

    def x0(self):
        """The first argument (the input) as an IrTensor."""
        n = self.node
        return self.ex.t(n.args[0] if n.args else next(iter(n.kwargs.values())))

    def optional(self, a):
        """An optional tensor argument (an attention mask): None when absent
        or None, a Static when known at export time, a BoolIds, or an
        IrTensor."""
        if a is None:
            return None
        if isinstance(a, fx.Node):
            v = self.ex.env[a]
            if isinstance(v, Static):
                return None if v.value is None else v
            if isinstance(v, BoolIds):
                return v
            return self.ex.t(a)
        return Static(a)
