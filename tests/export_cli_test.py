"""tools/export_fx.py's command line on the mistakes a user makes and the
failures a disk makes: every one is an `export_fx: error:` naming the
argument, the module or the file, exit status 2, no Python traceback; and
the graph and weights files are written whole or not at all (each into a
temporary file, both renamed into place only once both are complete)."""

import json
import os
import resource
import signal
import stat
import subprocess
import unittest

import torch
import torch.nn as nn

import torch_test_util as U  # noqa: E402  (sets sys.path)
import export_fx  # noqa: E402

MODULES = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x, labels):
        return F.cross_entropy(self.fc2(F.relu(self.fc1(x))), labels)


class TwoOutputs(Mlp):
    def forward(self, x, labels):
        logits = self.fc2(F.relu(self.fc1(x)))
        return logits, F.cross_entropy(logits, labels)


def failing_factory():
    raise ValueError("no such configuration")


def list_examples():
    return Mlp(), [torch.randn(5, 4)]


class BadExamples(Mlp):
    def example_inputs(self):
        raise KeyError("x")


built = Mlp(hidden=8)


class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x, mask, labels):
        h, _ = self.att(x, x, x, key_padding_mask=mask)
        return F.cross_entropy(self.head(h[:, 0]), labels)
'''

GOOD = ["x=5,4", "labels=5:int64:3"]


class ExportCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = U.tmpdir()
        cls.py = os.path.join(cls.dir, "cli_models.py")
        with open(cls.py, "w") as f:
            f.write(MODULES)
        with open(os.path.join(cls.dir, "broken_syntax.py"), "w") as f:
            f.write("def f(:\n")
        with open(os.path.join(cls.dir, "raises_at_import.py"), "w") as f:
            f.write("raise RuntimeError('cannot start without a GPU')\n")

    def run_cli(self, module, inputs=GOOD, extra=(), out=None, limit=None,
                cwd=None):
        """export_fx.py as a user runs it: (process, output path)."""
        out = out or os.path.join(self.dir, "out.json")
        cmd = [U.PYTHON, U.EXPORT_FX, "--module", module, "-o", out]
        for spec in inputs:
            cmd += ["--input-shape", spec]
        cmd += list(extra)

        def preexec():
            if limit is not None:  # a disk that fills after `limit` bytes
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        p = subprocess.run(cmd, capture_output=True, text=True,
                           cwd=cwd or self.dir, preexec_fn=preexec,
                           timeout=300)
        return p, out

    def assertFailsNaming(self, p, *needles):
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        self.assertIn("export_fx: error: ", p.stderr)
        for needle in needles:
            self.assertIn(needle, p.stderr)

    def test_errors_of_the_users_module_are_named_not_tracebacks(self):
        """A module that does not import, a factory or example_inputs that
        raise: exit status 1 and a traceback before; now the module, the
        exception and its file and line."""
        for module, needles in (
                ("broken_syntax.py:M", ["cannot load 'broken_syntax.py'",
                                        "SyntaxError"]),
                ("broken_syntax:M", ["cannot import 'broken_syntax'",
                                     "SyntaxError"]),
                ("raises_at_import.py:M",
                 ["RuntimeError: cannot start without a GPU",
                  "raises_at_import.py:1"]),
                ("raises_at_import:M",
                 ["cannot import 'raises_at_import'",
                  "RuntimeError: cannot start without a GPU"]),
                ("cli_models.py:failing_factory",
                 ["'cli_models.py:failing_factory'",
                  "ValueError: no such configuration",
                  'cli_models.py:24 (raise ValueError("no such configuration"))']),
                ("cli_models.py:BadExamples",
                 ["example_inputs of 'cli_models.py:BadExamples'",
                  "KeyError"]),
                ("cli_models.py:list_examples",
                 ["returned (module, list)", "must be a dict"]),
                (":Mlp", ["--module wants package.module:attr"]),
                ("cli_models.py:", ["--module wants package.module:attr"])):
            with self.subTest(module=module):
                p, _ = self.run_cli(module, inputs=[])
                self.assertFailsNaming(p, *needles)
        p, _ = self.run_cli("cli_models.py:Mlp",
                            extra=["--kwargs", '{"hidden": -3}'])
        self.assertFailsNaming(p, "--kwargs {\"hidden\": -3} failed",
                               "negative dimension")

    def test_a_module_path_that_is_not_python_source_fails(self):
        """--module path/model.pt:M (a saved checkpoint, not code) was an
        AttributeError traceback (no import spec for the file) with exit
        status 1."""
        path = os.path.join(self.dir, "model.pt")
        torch.save({"fc.weight": torch.zeros(3, 4)}, path)
        for module in (f"{path}:M", "./model.pt:M"):
            with self.subTest(module=module):
                p, _ = self.run_cli(module)
                self.assertFailsNaming(p, "model.pt' is not a Python "
                                          "source file")

    def test_kwargs_for_a_module_instance_fail(self):
        """--kwargs with a module instance (built already) was ignored:
        exit status 0 and a graph of the instance's own configuration
        (hidden 8, not the 9 asked for)."""
        p, out = self.run_cli("cli_models.py:built",
                              extra=["--kwargs", '{"hidden": 9}'],
                              out=os.path.join(self.dir, "built.json"))
        self.assertFailsNaming(p, "--kwargs is for a class or factory",
                               "'cli_models.py:built' is a module instance")
        self.assertFalse(os.path.exists(out))
        p, out = self.run_cli("cli_models.py:built", extra=["--kwargs", "{}"],
                              out=os.path.join(self.dir, "built.json"))
        self.assertEqual(p.returncode, 0, p.stderr)
        p, out = self.run_cli("cli_models.py:Mlp",
                              extra=["--kwargs", '{"hidden": 9}'],
                              out=os.path.join(self.dir, "built9.json"))
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            shapes = [q["tensor"]["shape"] for q in json.load(f)["parameters"]]
        self.assertIn([9, 4], shapes)

    def test_weights_to_dash_fails(self):
        """--weights - wrote a file named '-' in the current directory
        (only -o takes '-' for standard output)."""
        cwd = U.tmpdir()
        p, _ = self.run_cli(os.path.join(self.dir, "cli_models.py") + ":Mlp",
                            extra=["--weights", "-"], cwd=cwd,
                            out=os.path.join(cwd, "g.json"))
        self.assertFailsNaming(p, "--weights - :")
        self.assertEqual(os.listdir(cwd), [])

    def test_an_empty_graph_name_fails(self):
        """--name '' was ignored: the graph took the class name, exit
        status 0."""
        p, out = self.run_cli("cli_models.py:Mlp", extra=["--name", ""],
                              out=os.path.join(self.dir, "unnamed.json"))
        self.assertFailsNaming(p, "graph name must be a non-empty string")
        self.assertFalse(os.path.exists(out))
        p, out = self.run_cli("cli_models.py:Mlp", extra=["--name", "mlp2"],
                              out=os.path.join(self.dir, "named.json"))
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            self.assertEqual(json.load(f)["name"], "mlp2")

    def test_a_bool_input_for_a_key_padding_mask(self):
        """A bool key padding mask is a graph input (an INT64 0/1 one), but
        --input-shape knew no bool dtype ('unknown dtype'): such a module
        could not be exported from the command line. bool is all False;
        HIGH is refused for it."""
        inputs = ["x=5,7,4", "mask=5,7:bool", "labels=5:int64:3"]
        p, out = self.run_cli("cli_models.py:Padded", inputs=inputs,
                              out=os.path.join(self.dir, "padded.json"))
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            got = {i["tensor"]["name"]: i["tensor"] for i in json.load(f)["inputs"]}
        self.assertEqual(got["mask"], {"name": "mask", "shape": [5, 7],
                                       "dtype": "INT64"})
        U.validate(out)
        p, _ = self.run_cli("cli_models.py:Padded",
                            inputs=["x=5,7,4", "mask=5,7:bool:2",
                                    "labels=5:int64:3"])
        self.assertFailsNaming(p, "'mask=5,7:bool:2'",
                               "HIGH is for integer inputs")

    def test_bad_input_shapes_are_named(self):
        """A dimension of 0 (an empty batch) exported a graph that `hapctl
        validate` refuses; an input too large to allocate was a traceback;
        HIGH on a float input and an empty name were ignored."""
        huge = "x=1000000000,1000000"  # 4e15 bytes: more than any address space
        for inputs, needle in (
                (["x=0,4", "labels=0:int64:3"], "'x=0,4'"),
                (["x=5,4", "labels=0:int64:3"], "'labels=0:int64:3'"),
                ([huge, "labels=5:int64:3"], f"'{huge}': cannot make"),
                (["x=5,4:float32:3", "labels=5:int64:3"],
                 "HIGH is for integer inputs"),
                (["=5,4", "labels=5:int64:3"], "'' is not a forward argument"),
                (["x=5,4", "labels=5:int64:-1"], "high must be a positive")):
            with self.subTest(inputs=inputs):
                p, out = self.run_cli("cli_models.py:Mlp", inputs=inputs)
                self.assertFailsNaming(p, "--input-shape", needle)
        # The API refuses an empty example input too.
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(nn.Linear(4, 3),
                             {"input": torch.zeros(0, 4),
                              "labels": torch.zeros(0, dtype=torch.int64)},
                             loss=nn.CrossEntropyLoss())
        self.assertIn("example input 'input' has shape [0, 4]",
                      str(cm.exception))
        # A list instead of a dict was a TypeError from dict().
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(nn.Linear(4, 3), [torch.zeros(2, 4)],
                             loss=nn.CrossEntropyLoss())
        self.assertIn("example_inputs must be a dict", str(cm.exception))

    def test_negative_loss_index_selects_from_the_end(self):
        p, out = self.run_cli("cli_models.py:TwoOutputs", extra=["--loss=-1"])
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            g = json.load(f)
        self.assertEqual(g["loss"], "loss")

    def test_a_failed_write_leaves_both_files_as_they_were(self):
        """The graph was written in place (open(..., 'w')): a full disk left
        a truncated JSON file, and a --weights that failed after it left a
        new graph beside the old weights."""
        out = os.path.join(self.dir, "pair.json")
        weights = os.path.join(self.dir, "pair.safetensors")
        p, _ = self.run_cli("cli_models.py:Mlp", out=out,
                            extra=["--weights", weights])
        self.assertEqual(p.returncode, 0, p.stderr)
        before = {}
        for path in (out, weights):
            with open(path, "rb") as f:
                before[path] = f.read()
        listing = sorted(os.listdir(self.dir))

        # A disk that fills part of the way through the graph's file (the
        # weights file, a few hundred bytes, fits; the graph's JSON does not).
        limit = len(before[weights]) + 200
        self.assertGreater(len(before[out]), limit)
        p, _ = self.run_cli("cli_models.py:Mlp", out=out, limit=limit,
                            extra=["--weights", weights,
                                   "--kwargs", '{"hidden": 9}'])
        self.assertFailsNaming(p, f"cannot write '{out}'")
        # A weights file that cannot be written (no such directory).
        nowhere = os.path.join(self.dir, "no-such-dir", "w.safetensors")
        p, _ = self.run_cli("cli_models.py:Mlp", out=out,
                            extra=["--weights", nowhere,
                                   "--kwargs", '{"hidden": 9}'])
        self.assertFailsNaming(p, f"cannot write '{nowhere}'")
        # The same file for both: the graph replaced the weights.
        p, _ = self.run_cli("cli_models.py:Mlp", out=out,
                            extra=["--weights", out])
        self.assertFailsNaming(p, "--weights and -o name the same file")
        for path, data in before.items():
            with open(path, "rb") as f:
                self.assertEqual(f.read(), data, path)
        self.assertEqual(sorted(os.listdir(self.dir)), listing)

    def test_standard_output_that_cannot_be_written_fails(self):
        if not os.path.exists("/dev/full") or \
                not stat.S_ISCHR(os.stat("/dev/full").st_mode):
            self.skipTest("no /dev/full")
        with open("/dev/full", "w") as full:
            p = subprocess.run(
                [U.PYTHON, U.EXPORT_FX, "--module", "cli_models.py:Mlp",
                 "-o", "-"] + sum((["--input-shape", s] for s in GOOD), []),
                stdout=full, stderr=subprocess.PIPE, text=True, cwd=self.dir,
                timeout=300)
        self.assertFailsNaming(p, "cannot write the graph to standard output")


if __name__ == "__main__":
    U.main("export_cli_test")
