"""Random numbers drawn while forward is traced.

A forward that draws with concrete arguments (`if torch.rand(1).item() <=
self.layer_drop: continue`, torchaudio's LayerDrop in wav2vec2 and HuBERT;
`random.random()`) runs once under the tracer, and the graph would keep that
one draw for ever: a wav2vec2_base exported four times kept 12, 11, 12 and
10 of its 12 layers, with exit status 0. So while tracing, the uniform and
normal draws give fixed values, the lowest first and then the highest they
could give (a second trace, made only when something drew; with draws at
several sites, a function and line each, also each site's at the other end
from the rest's): when the traces are the same graph with the same constants
and module settings (a drop probability of 0, which torchaudio still draws
for), the draws did not matter; when they differ, the export fails naming
the first draw's function and line. The other draws (randint, bernoulli,
...) fail at once, and a draw no patch replaces (numpy.random, `from random
import random` bound before tracing, F.dropout of a constant tensor) fails
once traced: it moved a global random stream. Draws inside ops the exporter
maps (F.dropout, torchvision's stochastic_depth) are recorded as ops, not
drawn while tracing."""

import contextlib
import functools
import os
import random
import traceback

import torch
import torch.fx as fx

try:
    import numpy as np
except ImportError:  # torch runs without numpy
    np = None

from .ir import ExportError

# The lowest and highest value of each bounded or unbounded draw: rand's
# lowest is its float32 step above 0 (rand() <= 0.0, a drop probability of
# 0, is then False both times, as it is but with probability 2^-24).
_LOW_HIGH = {
    "uniform": (2.0 ** -24, 1.0 - 2.0 ** -24),
    "normal": (-8.0, 8.0),
}
# torch factories and in-place Tensor fills whose values are replaced.
_TORCH_FIXED = {"rand": "uniform", "rand_like": "uniform",
                "randn": "normal", "randn_like": "normal"}
_TENSOR_FIXED = {"uniform_": "uniform", "normal_": "normal"}
# Draws that fail at once.
_TORCH_REFUSED = ("randint", "randperm", "randint_like", "bernoulli",
                  "multinomial", "normal", "poisson")
_TENSOR_REFUSED = ("bernoulli_", "random_", "exponential_", "geometric_",
                   "log_normal_", "cauchy_")
_PYTHON_REFUSED = ("randint", "randrange", "choice", "choices", "shuffle",
                   "sample", "normalvariate", "expovariate")

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep

_STATE = {"lifted": False}


def _where():
    """" at FILE:LINE (SOURCE)" of the innermost frame that is neither
    torch's, the exporter's nor Python's random module's, or ""."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path.startswith((_TORCH_DIR, _HERE)) or \
                path == os.path.abspath(random.__file__):
            continue
        line = f" ({frame.line.strip()})" if frame.line else ""
        return f" at {frame.filename}:{frame.lineno}{line}"
    return ""


def refusal(draw):
    """The ExportError for a draw ("torch.rand at FILE:LINE (SOURCE)")
    that the graph would keep."""
    return ExportError(
        f"forward draws random numbers while it is traced ({draw}) and the "
        f"graph depends on the draw: it would keep one draw for every step "
        f"(a LayerDrop would drop the same layers for ever). Set such "
        f"probabilities to 0 for export (torchaudio: "
        f"encoder_layer_drop=0.0); F.dropout and stochastic depth are "
        f"supported")


def _fixed(name, f, value, draws, choose):
    """f, giving value(*args, **kwargs) instead of a draw, and noting the
    draw in `draws`; choose(site) first picks the end of the range for the
    draw's site (the function and " at FILE:LINE (SOURCE)", as noted)."""
    @functools.wraps(f)
    def draw(*args, **kwargs):
        if _STATE["lifted"]:
            return f(*args, **kwargs)
        site = name + _where()
        draws.append(site)
        choose(site)
        return value(*args, **kwargs)
    return draw


def _filled(f, v):
    """f's tensor (its shape, dtype and device), filled with v(f's
    arguments); the draw made for it leaves
    the random stream as it was (fixed_random_draws checks that nothing
    else drew)."""
    def value(*args, **kwargs):
        fill = v(*args, **kwargs)
        with torch.random.fork_rng(devices=[]):
            out = f(*args, **kwargs)
        with torch.no_grad():
            return out.fill_(fill)
    return value


def _in_place_end(kind, end):
    """What Tensor.uniform_(from=0, to=1) or Tensor.normal_(mean=0, std=1)
    gives at the `end` (a standard draw's low or high value) of its range:
    the range's own, not the standard one (uniform_(0, 10) gave 2^-24 and
    1 - 2^-24, both below 5, so a branch on '< 5' that PyTorch takes half
    the time was kept for ever)."""
    if kind == "uniform":
        def at(_self, *range_, **kwargs):
            lo, hi = (list(range_) + [0.0, 1.0][len(range_):])[:2]
            lo, hi = kwargs.get("from", lo), kwargs.get("to", hi)
            return lo + (hi - lo) * end
    else:
        def at(_self, mean=0.0, std=1.0, **_):
            return mean + std * end
    return at


def _refused(name, f):
    @functools.wraps(f)
    def draw(*args, **kwargs):
        if _STATE["lifted"]:
            return f(*args, **kwargs)
        raise refusal(name + _where())
    return draw


@contextlib.contextmanager
def fixed_random_draws(end, draws, sites=None):
    """While tracing: rand/randn (and _like, Tensor.uniform_/normal_,
    random.random/uniform/gauss) give the `end` ("low" or "high", or
    {site: "low" or "high"}, "low" for the sites it does not name) of their
    range, each draw appended to `draws` (its function and line) and its
    site to `sites`; the other random functions raise ExportError."""
    at = [0]

    def choose(site):
        if sites is not None:
            sites.append(site)
        e = end.get(site, "low") if isinstance(end, dict) else end
        at[0] = 0 if e == "low" else 1

    def ends(kind):
        return lambda *a, **k: _LOW_HIGH[kind][at[0]]

    def in_place(kind):
        return lambda *a, **k: _in_place_end(
            kind, _LOW_HIGH[kind][at[0]])(*a, **k)

    def u():
        return _LOW_HIGH["uniform"][at[0]]

    def z():
        return _LOW_HIGH["normal"][at[0]]

    saved = []

    def patch(owner, n, wrapper):
        f = getattr(owner, n, None)
        if f is not None:
            saved.append((owner, n, f))
            setattr(owner, n, wrapper(f))

    for n, kind in _TORCH_FIXED.items():
        patch(torch, n, lambda f, n=n, kind=kind: _fixed(
            f"torch.{n}", f, _filled(f, ends(kind)), draws, choose))
    for n, kind in _TENSOR_FIXED.items():
        patch(torch.Tensor, n, lambda f, n=n, kind=kind: _fixed(
            f"Tensor.{n}", f, _filled(f, in_place(kind)), draws, choose))
    patch(random, "random", lambda f: _fixed(
        "random.random", f, u, draws, choose))
    patch(random, "uniform", lambda f: _fixed(
        "random.uniform", f, lambda a, b: a + (b - a) * u(), draws, choose))
    patch(random, "gauss", lambda f: _fixed(
        "random.gauss", f, lambda mu=0.0, sigma=1.0: mu + sigma * z(), draws,
        choose))
    for n in _TORCH_REFUSED:
        patch(torch, n, lambda f, n=n: _refused(f"torch.{n}", f))
    for n in _TENSOR_REFUSED:
        patch(torch.Tensor, n, lambda f, n=n: _refused(f"Tensor.{n}", f))
    for n in _PYTHON_REFUSED:
        patch(random, n, lambda f, n=n: _refused(f"random.{n}", f))
    before = _streams()
    try:
        yield
        if _streams() != before:
            raise refusal("a draw the exporter does not replace: numpy."
                          "random, a random function bound before tracing "
                          "(from random import random), random.triangular "
                          "and the like, or a torch op drawing on constant "
                          "tensors such as F.dropout(torch.ones(n))")
    finally:
        for owner, n, f in reversed(saved):
            setattr(owner, n, f)


class _Streams:
    """The global random streams' states (torch's CPU generator, Python's
    random, numpy's): a draw that the patches did not replace moves one.
    Equal when no stream moved."""

    def __init__(self):
        self.torch = torch.get_rng_state()
        self.python = random.getstate()
        self.numpy = None
        if np is not None:
            _, keys, pos, has_gauss, gauss = np.random.get_state()
            self.numpy = (keys.tobytes(), pos, has_gauss, gauss)

    def __eq__(self, other):
        return torch.equal(self.torch, other.torch) and \
            self.python == other.python and self.numpy == other.numpy


def _streams():
    return _Streams()


@contextlib.contextmanager
def draws_allowed():
    """Inside fixed_random_draws: the real functions again (an example
    value computed by running an op, which may draw)."""
    was = _STATE["lifted"]
    _STATE["lifted"] = True
    try:
        yield
    finally:
        _STATE["lifted"] = was


def same_trace(root, a, b):
    """Whether fx graphs `a` and `b` of `root` are the same program: the
    same nodes in order with the same targets and arguments, tensor
    constants compared by value."""
    na, nb = list(a.nodes), list(b.nodes)
    if len(na) != len(nb):
        return False
    index = {n: i for i, n in enumerate(na)}
    index.update({n: i for i, n in enumerate(nb)})

    def key(args):
        return fx.node.map_arg(args, lambda n: ("node", index[n]))

    for x, y in zip(na, nb):
        if x.op != y.op or key((x.args, x.kwargs)) != key((y.args, y.kwargs)):
            return False
        if x.op == "get_attr" and x.target != y.target:
            tx = getattr(root, x.target, None)
            ty = getattr(root, y.target, None)
            if not (isinstance(tx, torch.Tensor) and
                    isinstance(ty, torch.Tensor) and tx.dtype == ty.dtype and
                    tx.shape == ty.shape and torch.equal(tx, ty)):
                return False
        elif x.target != y.target:
            return False
    return True


def _plain(v):
    """Whether v is a plain setting: a number, string, None, or a tuple or
    list of them."""
    if isinstance(v, (tuple, list)):
        return all(_plain(e) for e in v)
    return v is None or isinstance(v, (bool, int, float, str))


def module_settings(root, graph):
    """{path: plain attributes} of the modules `graph` calls and their
    submodules, as the trace left them: what the exporter reads of a
    module besides its tensors (nn.Dropout's p, a layer's eps). A forward
    that sets one from a draw (self.drop.p = random.uniform(0, 0.5))
    traces the same graph both times, and the export kept the last
    trace's value (p 0.49999997) for ever; compared between the traces."""
    out = {}
    for n in graph.nodes:
        if n.op != "call_module" or n.target in out:
            continue
        try:
            mod = root.get_submodule(n.target)
        except AttributeError:
            continue
        for sub, m in mod.named_modules(prefix=n.target):
            out[sub] = {k: v for k, v in vars(m).items() if _plain(v)}
    return out


def other_ends(sites):
    """The ends to trace again with, after a trace with every draw at its
    low end whose draws were at `sites`: every draw high; and with draws at
    several sites, each site high with the rest low and low with the rest
    high (two sites: all four combinations; three: all eight). A branch on
    two draws pulling opposite ways (rand() < 0.5 and random() > 0.5) is
    taken by neither all-low nor all-high, and was exported as never taken
    (a LayerDrop skipping each layer a quarter of the time kept all 4)."""
    unique = list(dict.fromkeys(sites))
    plans = [tuple("high" for _ in unique)]
    if len(unique) > 1:
        for k in range(len(unique)):
            plans.append(tuple("high" if j == k else "low"
                               for j in range(len(unique))))
            plans.append(tuple("low" if j == k else "high"
                               for j in range(len(unique))))
    out = []
    for plan in dict.fromkeys(plans):
        out.append("high" if len(unique) == 1 else dict(zip(unique, plan)))
    return out
