"""The command line of tools/export_fx.py (its docstring describes it):
loading the module, the example inputs, writing the graph and weights."""

import argparse
import importlib
import importlib.util
import io
import json
import math
import os
import sys

import torch
import torch.nn as nn

from .api import export, user_frame
from .ir import ExportError
from .weights import (safetensors_io, state_dict_extras, state_dict_weights,
                      write_weights)


def _load_attr(spec):
    """The object named by --module: "package.module:attr" or
    "path/file.py:attr" (attr may be dotted)."""
    if ":" not in spec:
        raise ExportError(f"--module wants package.module:attr or "
                          f"file.py:attr, got '{spec}'")
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        raise ExportError(f"--module wants package.module:attr or "
                          f"file.py:attr, got '{spec}'")
    # An error in the module's own code (a syntax error, an exception at
    # import) is the user's: named with its place, not a traceback.
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.isfile(path):
            raise ExportError(f"no such file '{mod_name}'")
        modspec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        if modspec is None:  # not a source file (a saved .pt checkpoint)
            raise ExportError(f"'{mod_name}' is not a Python source file: "
                              f"--module wants path/file.py:attr, the code "
                              f"that builds the module (a saved checkpoint "
                              f"holds no code)")
        sys.path.insert(0, os.path.dirname(path))
        mod = importlib.util.module_from_spec(modspec)
        try:
            modspec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 (the user's module code)
            raise ExportError(f"cannot load '{mod_name}': "
                              f"{_describe(e)}") from e
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001 (the user's module code)
            raise ExportError(f"cannot import '{mod_name}': "
                              f"{_describe(e)}") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ExportError(f"'{mod_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def _describe(e):
    """An exception raised by the user's code, with where it was raised."""
    return f"{type(e).__name__}: {e}{user_frame(e)}"


_CLI_DTYPES = {"float32": torch.float32, "float": torch.float32,
               "float64": torch.float64, "float16": torch.float16,
               "bfloat16": torch.bfloat16, "int64": torch.int64,
               "long": torch.int64, "int32": torch.int32, "int": torch.int64,
               "bool": torch.bool}


def _parse_input(spec):
    """--input-shape NAME=D0,D1[:DTYPE[:HIGH]] as (name, example tensor):
    bool (a key padding mask input) is all False."""
    if "=" not in spec:
        raise ExportError(f"--input-shape wants name=d0,d1[:dtype[:high]], got "
                          f"'{spec}'")
    name, _, rest = spec.partition("=")
    if not name.isidentifier():
        raise ExportError(f"--input-shape '{spec}': '{name}' is not a forward "
                          f"argument name")
    parts = rest.split(":")
    try:
        shape = [int(d) for d in parts[0].split(",") if d.strip()]
    except ValueError:
        raise ExportError(f"--input-shape '{spec}': bad shape") from None
    # A dimension of 0 (an empty batch) makes a graph the IR refuses
    # ("dimensions must be positive"): named here instead.
    if any(d < 1 for d in shape) or len(parts) > 3:
        raise ExportError(f"--input-shape '{spec}': wants name=d0,d1[:dtype[:high]] "
                          f"with dimensions >= 1")
    dtype = _CLI_DTYPES.get(parts[1] if len(parts) > 1 else "float32")
    if dtype is None:
        raise ExportError(f"--input-shape '{spec}': unknown dtype '{parts[1]}'"
                          f" (one of {', '.join(sorted(_CLI_DTYPES))})")
    if (dtype.is_floating_point or dtype == torch.bool) and len(parts) > 2:
        raise ExportError(f"--input-shape '{spec}': HIGH is for integer "
                          f"inputs (float ones are random normal, bool ones "
                          f"False)")
    high = None
    if len(parts) > 2:
        high = int(parts[2]) if parts[2].strip().isdigit() else 0
        if high < 1:
            raise ExportError(f"--input-shape '{spec}': high must be a positive "
                              f"integer, got '{parts[2]}'")
    try:
        if dtype.is_floating_point:
            return name, torch.randn(shape, dtype=dtype)
        if high is not None:
            return name, torch.randint(0, high, shape, dtype=dtype)
        return name, torch.zeros(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as e:  # too large to allocate
        n = math.prod(shape)
        raise ExportError(f"--input-shape '{spec}': cannot make an example "
                          f"input of {n} elements: "
                          f"{str(e).splitlines()[0][:200]}") from None


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
        if kwargs:  # it was ignored: the module kept its own configuration
            raise ExportError(f"--kwargs is for a class or factory, but "
                              f"'{a.module}' is a module instance "
                              f"({type(obj).__name__}) built already")
        module = obj
    elif callable(obj):
        try:
            module = obj(**kwargs)
        except TypeError as e:  # e.g. a keyword argument it does not take
            raise ExportError(f"'{a.module}' with --kwargs {a.kwargs}: {e}") from None
        except Exception as e:  # noqa: BLE001 (the user's factory failed)
            raise ExportError(f"'{a.module}' with --kwargs {a.kwargs} failed: "
                              f"{_describe(e)}") from e
    else:
        raise ExportError(f"'{a.module}' is not a module, class or "
                          f"factory")
    if isinstance(module, tuple) and len(module) == 2:
        module, examples = module
        if not isinstance(examples, dict):  # dict() of a list: TypeError
            raise ExportError(f"'{a.module}' returned (module, "
                              f"{type(examples).__name__}); the examples "
                              f"must be a dict of input name -> tensor")
        examples = dict(examples)
    if not isinstance(module, nn.Module):
        raise ExportError(f"'{a.module}' did not give an nn.Module")
    ex = getattr(module, "example_inputs", None)
    if not examples and ex is not None:
        try:
            examples = dict(ex() if callable(ex) else ex)
        except Exception as e:  # noqa: BLE001 (the user's example_inputs)
            raise ExportError(f"the example_inputs of '{a.module}' failed: "
                              f"{_describe(e)}") from e
    for spec in a.input_shape:
        k, t = _parse_input(spec)
        examples[k] = t
    return module, examples


def _write_outputs(a, text, g, values, module, weights):
    """Writes the graph (-o) and the weights (--weights): each into a
    temporary file beside it, and renamed into place only when both are
    complete, so that a failure (a full disk, a missing directory) leaves
    neither file half-written nor one new beside an old other. Returns
    (weights tensor count, unused parameters); ExportError names the file
    that could not be written."""
    st = safetensors_io()
    if a.weights is not None and a.output != "-" and \
            os.path.realpath(a.weights) == os.path.realpath(a.output):
        raise ExportError(f"--weights and -o name the same file "
                          f"'{a.output}'")
    pending = []  # (path, OutputFile)
    path = None
    try:
        n, unused = 0, []
        if a.weights is not None:
            path = a.weights
            pending.append((path, st.OutputFile(path)))
            n, unused = write_weights(path, g, values, module, weights,
                                      out=pending[-1][1])
        if a.output != "-":
            path = a.output
            pending.append((path, st.OutputFile(path)))
            pending[-1][1].write(text.encode("utf-8"))
        for path, f in pending:
            f.finish()
        for path, f in pending:
            f.commit()
        return n, unused
    except BaseException as e:
        for _, f in pending:
            f.discard()
        if isinstance(e, OSError):
            raise ExportError(f"cannot write '{path}': "
                              f"{e.strerror or e}") from None
        raise


def _write_stdout(text):
    """Writes `text` to standard output, unbuffered where it is a file
    descriptor: a failed write (a full disk) raises OSError here, once,
    instead of again when Python flushes its buffer at exit (status 120)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        sys.stdout.write(text)  # not a file (captured in-process)
        sys.stdout.flush()
        return
    sys.stdout.flush()
    data = memoryview(text.encode("utf-8"))
    while data:
        data = data[os.write(fd, data):]


def main(argv=None):
    """The command line; returns the exit status (0, or 2 on an error)."""
    a = _parser().parse_args(argv)
    try:
        if a.weights == "-":
            # It wrote a file named '-' (only -o takes '-' for stdout).
            raise ExportError("--weights - : '-' (standard output) is for "
                              "the graph, -o -; name a file for the "
                              "weights (or /dev/stdout)")
        module, examples = _module_and_examples(a)
        loss = a.loss
        if loss is not None and loss.lstrip("-").isdigit():
            loss = int(loss)
        g, values = export(module, examples, loss=loss, name=a.name,
                           run_on=a.run_on, return_values=True)
        weights = None
        if a.weights is not None:
            weights = state_dict_weights(g, values)  # fails before writing
        try:  # proto3 JSON has no NaN or Infinity
            text = json.dumps(g, indent=1, allow_nan=False) + "\n"
        except ValueError as e:
            raise ExportError(f"internal: the graph holds a number JSON "
                              f"cannot write: {e}") from None
        n, _ = _write_outputs(a, text, g, values, module, weights)
    except ExportError as e:
        print(f"export_fx: error: {e}", file=sys.stderr)
        return 2
    unrecorded = state_dict_extras(g)["unrecorded"]
    if unrecorded:
        print("export_fx: note: state_dict entries (parameters forward "
              "does not use, buffers, extra state) the graph does not hold "
              "and cannot record, left out of --weights and checkpoint "
              "exports: " +
              "; ".join(f"{k}: {why}" for k, why in unrecorded.items()),
              file=sys.stderr)
    if a.output == "-":
        try:
            _write_stdout(text)
        except OSError as e:
            print(f"export_fx: error: cannot write the graph to standard "
                  f"output: {e.strerror or e}", file=sys.stderr)
            return 2
    else:
        n_params = sum(math.prod(p["tensor"]["shape"]) for p in g["parameters"])
        print(f"export_fx: wrote {a.output}: {len(g['ops'])} ops, "
              f"{len(g['parameters'])} parameter tensors ({n_params} values)",
              file=sys.stderr)
    if a.weights is not None:
        # The parameters it leaves out (forward does not use them, and the
        # graph could not record their values) are named in the note above.
        print(f"export_fx: wrote {a.weights}: {n} tensors (state_dict names)",
              file=sys.stderr)
    return 0
