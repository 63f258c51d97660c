"""The module's weights as the graph uses them, under their state_dict names,
and the --weights safetensors file (through tools/safetensors_io.py)."""

import importlib.util
import json
import os
import sys

import torch

from .ir import (BUFFERS_KEY, EXTRAS_KEY, SAFETENSORS_DTYPES, SLICES_KEY,
                 ExportError)


def state_dict_slices(graph):
    """The graph's SLICES_KEY metadata as a dict ({} when absent)."""
    raw = graph.get("metadata", {}).get(SLICES_KEY)
    return json.loads(raw) if raw else {}


def state_dict_extras(graph):
    """The graph's EXTRAS_KEY metadata as a dict (empty parts when absent)."""
    raw = graph.get("metadata", {}).get(EXTRAS_KEY)
    out = json.loads(raw) if raw else {}
    return {"aliases": out.get("aliases", {}),
            "constants": out.get("constants", []),
            "counters": out.get("counters", {}),
            "folded": out.get("folded", {}),
            "unheld": out.get("unheld", []),
            "unrecorded": out.get("unrecorded", {})}


_TORCH_DTYPES = {name: dt for dt, name in SAFETENSORS_DTYPES.items()}


def folded_value(record):
    """The tensor of an EXTRAS_KEY "folded" record (runs of equal
    elements, each as its little-endian bytes in hex)."""
    raw = b"".join(bytes.fromhex(h) * n for n, h in record["runs"])
    dtype = _TORCH_DTYPES[record["dtype"]]
    t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else \
        torch.empty(0, dtype=dtype)
    return t.reshape(record["shape"])


def state_dict_weights(graph, values):
    """The module's parameters as the graph uses them, under their
    state_dict names (what `--weights` writes): each graph parameter by its
    name, the slices of SLICES_KEY reassembled into their source tensor
    (in_proj_weight whole), module buffers kept as state (BUFFERS_KEY:
    running statistics) included, exporter constants (frozen parameters that
    are not in the state_dict) left out, and every other name of a tied
    tensor (EXTRAS_KEY aliases: `head.weight` = `emb.weight`) written as
    a copy, as load_state_dict wants each name, BatchNorm's
    num_batches_tracked, the buffers the graph folded into constants and
    the parameters forward does not use (EXTRAS_KEY counters, folded)
    included. `values`: export(..., return_values=True)'s second result."""
    slices = state_dict_slices(graph)
    buffers = set(json.loads(graph.get("metadata", {}).get(BUFFERS_KEY, "[]")))
    has_extras = EXTRAS_KEY in graph.get("metadata", {})
    constants = set(state_dict_extras(graph)["constants"])
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
        elif name not in constants if has_extras else not p.get("frozen"):
            # Frozen module parameters (requires_grad=False) too; graphs
            # without EXTRAS_KEY cannot tell them from the constants.
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
    extras = state_dict_extras(graph)
    for alias, held in extras["aliases"].items():
        if held in out:
            out[alias] = out[held]
    # BatchNorm's num_batches_tracked, the buffers folded into constants
    # (or unused) and the parameters forward does not use: the module's
    # values at export, as load_state_dict wants.
    for name, c in extras["counters"].items():
        out[name] = torch.tensor(c["value"], dtype=torch.int64)
    for name, b in extras["folded"].items():
        out[name] = folded_value(b)
    meta = [k for k, v in out.items() if v.is_meta]
    if meta:
        raise ExportError(f"the module's parameters are on the meta device "
                          f"(e.g. '{meta[0]}'): there are no weights to "
                          f"write")
    return out


def safetensors_io():
    """tools/safetensors_io.py, next to export_fx.py (also when this
    package is reached through symlinks, as in Bazel's runfiles)."""
    try:
        import safetensors_io as module  # noqa: PLC0415
        return module
    except ImportError:
        pass
    tools = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "safetensors_io", os.path.join(tools, "safetensors_io.py"))
    if spec is None or not os.path.exists(spec.origin):
        raise ExportError(f"--weights needs safetensors_io.py next to "
                          f"{os.path.join(tools, 'export_fx.py')}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["safetensors_io"] = module
    return module


def write_weights(path, graph, values, module=None, weights=None, out=None):
    """Writes state_dict_weights(graph, values) (or `weights`, its result)
    as a safetensors file, atomically; returns (tensor count, the
    parameters of `module` left out: forward does not use them and the
    graph could not record their values, EXTRAS_KEY unheld).
    `out`: a safetensors_io.OutputFile for `path` to write into instead,
    which the caller commits (or discards); its OSError is the caller's."""
    if weights is None:
        weights = state_dict_weights(graph, values)
    unused = []
    if module is not None:
        have = set(weights)
        unused = [n for n, _ in module.named_parameters() if n not in have]
    st = safetensors_io()
    metadata = {"format": "pt", "exporter": "tools/export_fx.py",
                "graph": graph["name"]}
    try:
        if out is not None:
            st.write_to(out, weights, metadata)
        else:
            st.write_safetensors(path, weights, metadata)
    except st.SafetensorsError as e:
        raise ExportError(f"cannot write the weights to {path}: {e}") from e
    except OSError as e:
        if out is not None:
            raise
        raise ExportError(f"cannot write the weights to {path}: {e}") from e
    return len(weights), unused
