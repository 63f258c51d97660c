"""The command line of tools/export_fx.py (its docstring describes it):
loading the module, the example inputs, writing the graph and weights."""

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys

import torch
import torch.nn as nn

from .api import export
from .ir import ExportError
from .weights import state_dict_extras, state_dict_weights, write_weights


def _load_attr(spec):
    """The object named by --module: "package.module:attr" or
    "path/file.py:attr" (attr may be dotted)."""
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
    """--input-shape NAME=D0,D1[:DTYPE[:HIGH]] as (name, example tensor)."""
    if "=" not in spec:
        raise ExportError(f"--input-shape wants name=d0,d1[:dtype[:high]], got "
                          f"'{spec}'")
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    try:
        shape = [int(d) for d in parts[0].split(",") if d.strip()]
    except ValueError:
        raise ExportError(f"--input-shape '{spec}': bad shape") from None
    if any(d < 0 for d in shape) or len(parts) > 3:
        raise ExportError(f"--input-shape '{spec}': wants name=d0,d1[:dtype[:high]] "
                          f"with dimensions >= 0")
    dtype = _CLI_DTYPES.get(parts[1] if len(parts) > 1 else "float32")
    if dtype is None:
        raise ExportError(f"--input-shape '{spec}': unknown dtype '{parts[1]}'"
                          f" (one of {', '.join(sorted(_CLI_DTYPES))})")
    if dtype.is_floating_point:
        return name, torch.randn(shape, dtype=dtype)
    if len(parts) > 2:
        high = int(parts[2]) if parts[2].strip().isdigit() else 0
        if high < 1:
            raise ExportError(f"--input-shape '{spec}': high must be a positive "
                              f"integer, got '{parts[2]}'")
        return name, torch.randint(0, high, shape, dtype=dtype)
    return name, torch.zeros(shape, dtype=dtype)


def _parser():
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
    return ap


def _module_and_examples(a):
    """The module --module and --kwargs give, and its example inputs (the
    factory's, the module's example_inputs, then --input-shape)."""
    obj = _load_attr(a.module)
    try:
        kwargs = json.loads(a.kwargs)
    except ValueError as e:
        raise ExportError(f"--kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ExportError(f"--kwargs must be a JSON object, got '{a.kwargs}'")
    examples = {}
    if isinstance(obj, nn.Module):
        module = obj
    elif callable(obj):
        try:
            module = obj(**kwargs)
        except TypeError as e:  # e.g. a keyword argument it does not take
            raise ExportError(f"'{a.module}' with --kwargs {a.kwargs}: {e}") from None
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
    return module, examples


def main(argv=None):
    """The command line; returns the exit status (0, or 2 on an error)."""
    a = _parser().parse_args(argv)
    try:
        module, examples = _module_and_examples(a)
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
    unrecorded = state_dict_extras(g)["unrecorded"]
    if unrecorded:
        print("export_fx: note: buffers the graph does not hold and cannot "
              "record, left out of --weights and checkpoint exports: " +
              "; ".join(f"{k}: {why}" for k, why in unrecorded.items()),
              file=sys.stderr)
    text = json.dumps(g, indent=1)
    if a.output == "-":
        sys.stdout.write(text + "\n")
    else:
        try:
            with open(a.output, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            print(f"export_fx: error: cannot write '{a.output}': {e.strerror}",
                  file=sys.stderr)
            return 2
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
