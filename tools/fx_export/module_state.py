"""The user's module as it was before export: tracing runs forward on
torch.fx proxies, so an attribute forward sets (`self.cache = x`,
`self.calls += 1`, `self.history.append(x)`) was left on the module as a
Proxy or a traced value; fx's tracer adds `_tensor_constant<N>` attributes
to the root; export switches every module to training mode; the run for
shapes calls leaf modules' forwards (and their hooks) on the example
inputs. snapshot() before, restore() after (in a finally) puts back every
module's attributes: those added removed, those replaced put back, and the
contents of lists, dicts (the _parameters, _buffers, _modules and hook
tables among them) and sets as they were. Tensor values are not copied
(buffers changed in place are put back by api._record_shapes)."""


def _contents(v):
    """A shallow copy of a list, dict or set's contents, else None."""
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, set):
        return set(v)
    return None


def snapshot(root):
    """[(module, {attribute: (value, contents)})] of every module of
    `root` (shared ones once)."""
    return [(m, {k: (v, _contents(v)) for k, v in vars(m).items()})
            for m in root.modules()]


def restore(saved):
    """Puts back what snapshot() saw."""
    for m, attrs in saved:
        d = vars(m)
        for k in [k for k in d if k not in attrs]:
            del d[k]
        for k, (v, contents) in attrs.items():
            d[k] = v
            if contents is None:
                continue
            if isinstance(v, list):
                v[:] = contents
            else:
                v.clear()
                v.update(contents)
