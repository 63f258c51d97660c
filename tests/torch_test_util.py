"""Helpers for the PyTorch-based tests: locating hapctl and the exporter,
running hapctl, and a unittest main that prints per-case results, writes one
JUnit <testcase> per test to Bazel's $XML_OUTPUT_FILE and ends with a plain
"N passed, N failed" line."""

import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))


def _find(env, default):
    p = os.environ.get(env) or default
    return os.path.abspath(p)


HAPCTL = _find("HAPCTL", os.path.join(HERE, "..", "bazel-bin", "tools", "hapctl"))
EXPORT_FX = _find("EXPORT_FX", os.path.join(HERE, "..", "tools", "export_fx.py"))
PYTHON = "/usr/bin/python3"

sys.path.insert(0, os.path.dirname(EXPORT_FX))
sys.path.insert(0, HERE)


def tmpdir():
    base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
    return tempfile.mkdtemp(dir=base)


def run(cmd, check=True):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n"
                             f"{p.stdout}\n{p.stderr}")
    return p


def hapctl_json(*args):
    p = run([HAPCTL] + [str(a) for a in args] + ["-o", "json"])
    return json.loads(p.stdout)


def zoo(model, **params):
    args = ["zoo", model]
    for k, v in params.items():
        args += [f"--{k}", v]
    out = hapctl_json(*args)
    assert len(out) == 1, out
    return out[0]


def zoo_graph(model, **params):
    """The zoo graph itself (hapctl zoo --export), as a dict."""
    path = os.path.join(tmpdir(), f"{model}.json")
    args = ["zoo", model, "--export", path]
    for k, v in params.items():
        args += [f"--{k}", str(v)]
    run([HAPCTL] + args)
    with open(path) as f:
        return json.load(f)


def validate(path):
    return hapctl_json("validate", path)


def write_npy(path, t):
    """A version 1.0 .npy file of a torch tensor (float64/32, int64 or
    bool), written from the format's specification (hap-executor --data
    npy:DIR reads DIR/<input>.npy)."""
    import struct
    import torch
    descr = {torch.float64: "<f8", torch.float32: "<f4", torch.int64: "<i8",
             torch.bool: "|b1"}[t.dtype]
    header = ("{'descr': '%s', 'fortran_order': False, 'shape': (%s), }"
              % (descr, "".join(f"{d}, " for d in t.shape)))
    header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) +
                header.encode("latin1"))
        f.write(t.contiguous().numpy().tobytes())


def export_for_training(module, inputs):
    """Exports `module` on `inputs` into a fresh directory d as hap-launch
    takes it: d/g.json (the graph), d/w.st (its initial weights,
    --init-weights) and d/data/<input>.npy (--data npy:DIR). Returns
    (d, graph path, weights path, data dir)."""
    import export_fx
    d = tmpdir()
    g, values = export_fx.export(module, inputs, return_values=True)
    graph, weights = os.path.join(d, "g.json"), os.path.join(d, "w.st")
    with open(graph, "w") as f:
        json.dump(g, f)
    export_fx.write_weights(weights, g, values, module)
    data = os.path.join(d, "data")
    os.makedirs(data)
    for k, v in inputs.items():
        write_npy(os.path.join(data, f"{k}.npy"), v)
    return d, graph, weights, data


def pytorch_sgd_steps(model, xs, ys, batch, steps, lr):
    """PyTorch's own `steps` SGD steps of `model` (forward(x, labels) -> the
    loss) on the batches hap-launch takes from xs, ys (step k: rows
    k*batch..): the losses and the final parameters by name."""
    import torch
    losses = []
    for k in range(steps):
        rows = slice(k * batch, (k + 1) * batch)
        model.zero_grad()
        loss = model(xs[rows], ys[rows])
        loss.backward()
        losses.append(float(loss))
        with torch.no_grad():
            for prm in model.parameters():
                prm -= lr * prm.grad
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def sgd_steps(d, graph, weights, data, baseline, steps, lr, launch,
              executor, cluster):
    """Plans `graph` on `cluster` (`baseline`: dp-even, hap, ...; SGD at
    `lr`) and trains `steps` steps with hap-launch and hap-executor from
    the --weights file `weights` on the npy batches in `data` (step k:
    rows k*batch..): (the steps' losses as hap-launch logs them, the
    weights after, {state_dict name: tensor}). Files go under d/<baseline>*."""
    import export_fx
    plan = os.path.join(d, f"{baseline}.pb")
    run([HAPCTL, "plan", "--cluster", cluster, "--graph", graph,
         "--baseline", baseline, "--optimizer", "sgd", "--lr", str(lr),
         "--save-plan", plan, "--max-seconds", "5"])
    ckpt = plan + ".ckpt"
    p = run([launch, "--executor", executor, "--plan", plan, "--steps",
             str(steps), "--data", "npy:" + data, "--init-weights", weights,
             "--log-every", "1", "--checkpoint-dir", ckpt])
    losses = [float(line.split()[3]) for line in p.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == steps, p.stdout
    out = ckpt + ".safetensors"
    run([HAPCTL, "checkpoint", "export", ckpt, "-o", out])
    return losses, export_fx._safetensors_io().read(out)


def assert_trains_like_pytorch(test, m, xs, ys, batch, steps, lr, launch,
                               executor, cluster):
    """Exports `m` (forward(x, labels) -> the loss) on the first batch of
    xs, ys, trains `steps` SGD steps on 2 ranks with the dp-even and the
    synthesized ("hap") plan (sgd_steps) and asserts that both give
    PyTorch's losses and final parameters (pytorch_sgd_steps) within 1e-5
    of their scale. Returns PyTorch's final parameters by name."""
    import export_fx
    d = tmpdir()
    graph, weights = os.path.join(d, "g.json"), os.path.join(d, "w.st")
    g, values = export_fx.export(m, {"x": xs[:batch], "labels": ys[:batch]},
                                 return_values=True)
    with open(graph, "w") as f:
        json.dump(g, f)
    export_fx.write_weights(weights, g, values, m)
    data = os.path.join(d, "data")
    os.makedirs(data)
    write_npy(os.path.join(data, "x.npy"), xs)
    write_npy(os.path.join(data, "labels.npy"), ys)
    runs = {b: sgd_steps(d, graph, weights, data, b, steps, lr, launch,
                         executor, cluster)
            for b in ("dp-even", "hap")}
    want, final = pytorch_sgd_steps(m, xs, ys, batch, steps, lr)
    for baseline, (losses, params) in runs.items():
        for got, ref in zip(losses, want):
            test.assertAlmostEqual(got, ref, delta=1e-5 * max(1, ref),
                                   msg=f"{baseline}: {losses} vs {want}")
        for name, p in final.items():
            test.assertIn(name, params, baseline)
            err = float((params[name].double() - p).abs().max())
            bound = 1e-5 * max(float(p.abs().max()), 1e-3)
            test.assertLessEqual(err, bound, f"{baseline}: {name}")
    return final


def one_sgd_step(module, inputs, lr, launch, executor, cluster):
    """Exports `module` (export_for_training), plans it data parallel
    (dp-even, SGD at `lr`) on `cluster` and trains one step with hap-launch
    and hap-executor from its --weights file: (the step's loss as
    hap-launch logs it, the weights before, the weights after), the weights
    as {state_dict name: tensor}."""
    import export_fx
    d, graph, weights, data = export_for_training(module, inputs)
    losses, after = sgd_steps(d, graph, weights, data, "dp-even", 1, lr,
                              launch, executor, cluster)
    return losses[0], export_fx._safetensors_io().read(weights), after


def module_from_source(d, name, source):
    """Writes `source` as d/<name>.py and imports it: (module, its path)
    (export_fx takes --module PATH:FUNCTION)."""
    import importlib
    path = os.path.join(d, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    if d not in sys.path:
        sys.path.insert(0, d)
    return importlib.import_module(name), path


def token_data(d, n, s, vocab, seed=5):
    """n samples of s random token ids below `vocab` for inputs x and y,
    written as d/data/x.npy and y.npy: (xs, ys, the data directory)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randint(0, vocab, (n, s), generator=gen)
    ys = torch.randint(0, vocab, (n, s), generator=gen)
    data = os.path.join(d, "data")
    os.makedirs(data)
    write_npy(os.path.join(data, "x.npy"), xs)
    write_npy(os.path.join(data, "y.npy"), ys)
    return xs, ys, data


class _Result(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.cases = []
        self._t0 = {}

    def startTest(self, test):
        self._t0[test.id()] = time.time()
        super().startTest(test)

    def _record(self, test, kind, detail=""):
        """One case per test; a failed subtest makes the whole test fail."""
        dt = time.time() - self._t0.get(test.id(), time.time())
        for i, c in enumerate(self.cases):
            if c[0] == test.id():
                if kind == "pass":
                    return
                if c[1] in ("failure", "error"):
                    detail = c[2] + "\n" + detail
                self.cases[i] = (test.id(), kind, detail, dt)
                return
        self.cases.append((test.id(), kind, detail, dt))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "failure" if issubclass(err[0], test.failureException) \
                else "error"
            self._record(test, kind, f"{subtest.id()}\n" +
                         self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)


def write_xml(suite_name, cases):
    path = os.environ.get("XML_OUTPUT_FILE")
    if not path:
        return
    root = ET.Element("testsuites")
    fails = sum(1 for c in cases if c[1] in ("failure", "error"))
    ts = ET.SubElement(root, "testsuite", name=suite_name,
                       tests=str(len(cases)), failures=str(fails))
    for cid, kind, detail, dt in cases:
        cls, _, name = cid.rpartition(".")
        if cls.startswith("__main__."):
            cls = suite_name + cls[len("__main__"):]
        tc = ET.SubElement(ts, "testcase", classname=cls, name=name,
                           time=f"{dt:.3f}")
        if kind in ("failure", "error", "skipped"):
            ET.SubElement(tc, kind, message=detail.splitlines()[-1]
                          if detail else kind).text = detail
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(suite_name, needs_torch=True):
    if needs_torch:
        import torch
        torch.set_num_threads(1)
    suite = unittest.defaultTestLoader.loadTestsFromModule(
        sys.modules["__main__"])
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2,
                                     resultclass=_Result)
    result = runner.run(suite)
    write_xml(suite_name, result.cases)
    passed = sum(1 for c in result.cases if c[1] == "pass")
    failed = sum(1 for c in result.cases if c[1] in ("failure", "error"))
    skipped = sum(1 for c in result.cases if c[1] == "skipped")
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(line)
    sys.exit(0 if result.wasSuccessful() else 1)
