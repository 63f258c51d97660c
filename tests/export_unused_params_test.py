"""Parameters forward does not use (an nn.Linear defined but never called)
come back after training as PyTorch's training leaves them: the exporter
records their values (the graph's hap.state_dict_extras "folded", marked
"parameter"), --weights writes them, hap-launch carries the record into
every checkpoint's trainer.json and `hapctl checkpoint export` writes them,
so load_state_dict(strict=True) takes what training gives back, the unused
parameters at their values at export and the used ones at PyTorch's SGD
steps; an --init-weights file with other values for one is refused, naming
it. One too large to record (past UNUSED_PARAMETER_RUNS_LIMIT runs of equal
values) is named by the exporter and by the checkpoint export."""

import json
import os
import unittest

import torch

import torch_test_util as U  # noqa: E402  (sets sys.path)
import export_fx  # noqa: E402
from fx_export.exporter import UNUSED_PARAMETER_RUNS_LIMIT  # noqa: E402

EXECUTOR = os.environ.get("HAP_EXECUTOR")
LAUNCH = os.environ.get("HAP_LAUNCH")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")

I, H, C, BATCH, STEPS, LR = 6, 8, 3, 4, 3, 0.5

MODULE = f'''
import torch, torch.nn as nn, torch.nn.functional as F

class WithSpare(nn.Module):
    def __init__(self, spare_features={H}):
        super().__init__()
        self.fc1 = nn.Linear({I}, {H})
        self.spare = nn.Linear(spare_features, spare_features)  # never called
        self.fc2 = nn.Linear({H}, {C})

    def forward(self, x, labels):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), labels)

def make():
    torch.manual_seed(4)
    return WithSpare().double()

def make_big():
    torch.manual_seed(4)
    return WithSpare(spare_features=520)
'''


def train(d, graph, weights, data, steps=STEPS):
    """`graph` planned data parallel on the 2-rank cluster (SGD at LR),
    trained `steps` steps from `weights` on the npy batches in `data` with
    a checkpoint, exported: (the export's tensors, hapctl's run, the plan)."""
    plan = os.path.join(d, "plan.pb")
    U.run([U.HAPCTL, "plan", "--cluster", CPU_CLUSTER, "--graph", graph,
           "--baseline", "dp-even", "--optimizer", "sgd", "--lr", str(LR),
           "--save-plan", plan, "--max-seconds", "5"])
    ckpt = os.path.join(d, "ckpt")
    U.run([LAUNCH, "--executor", EXECUTOR, "--plan", plan, "--steps",
           str(steps), "--data", "npy:" + data, "--init-weights", weights,
           "--checkpoint-dir", ckpt])
    out = os.path.join(d, "trained.safetensors")
    exported = U.run([U.HAPCTL, "checkpoint", "export", ckpt, "-o", out])
    return export_fx._safetensors_io().read(out), exported, plan


def export_cli(d, source, factory, dtype):
    """tools/export_fx.py on d's module: (graph path, weights path, its
    run)."""
    graph = os.path.join(d, "g.json")
    weights = os.path.join(d, "w.safetensors")
    p = U.run([U.PYTHON, U.EXPORT_FX, "--module", f"{source}:{factory}",
               "--input-shape", f"x={BATCH},{I}:{dtype}",
               "--input-shape", f"labels={BATCH}:int64:{C}",
               "-o", graph, "--weights", weights])
    return graph, weights, p


def write_data(d, xs, ys):
    data = os.path.join(d, "data")
    os.makedirs(data)
    U.write_npy(os.path.join(data, "x.npy"), xs)
    U.write_npy(os.path.join(data, "labels.npy"), ys)
    return data


class UnusedParametersTest(unittest.TestCase):
    def setUp(self):
        if not (EXECUTOR and LAUNCH and CPU_CLUSTER):
            self.skipTest("HAP_EXECUTOR, HAP_LAUNCH, CPU_CLUSTER not given")

    def test_unused_linear_comes_back_as_it_was_after_training(self):
        d = U.tmpdir()
        mod, source = U.module_from_source(d, "with_spare", MODULE)
        model = mod.make()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        graph, weights, p = export_cli(d, source, "make", "float64")
        self.assertNotIn("note:", p.stderr)  # nothing left out

        # Not in the graph; recorded with its values, and in --weights.
        with open(graph) as f:
            g = json.load(f)
        self.assertEqual({t["tensor"]["name"] for t in g["parameters"]},
                         {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"})
        extras = json.loads(g["metadata"][export_fx.EXTRAS_KEY])
        self.assertEqual(set(extras["folded"]), {"spare.weight", "spare.bias"})
        self.assertTrue(extras["folded"]["spare.weight"]["parameter"])
        self.assertEqual(extras["unheld"], [])
        init = export_fx._safetensors_io().read(weights)
        self.assertEqual(set(init), set(start))
        for k, v in init.items():
            self.assertTrue(torch.equal(v, start[k]), k)

        gen = torch.Generator().manual_seed(9)
        xs = torch.randn(BATCH * STEPS, I, generator=gen, dtype=torch.float64)
        ys = torch.randint(0, C, (BATCH * STEPS,), generator=gen)
        data = write_data(d, xs, ys)
        trained, exported, plan = train(d, graph, weights, data)
        self.assertNotIn("note:", exported.stderr)

        # PyTorch's own SGD steps on the same batches: the unused linear
        # has no gradient, and the optimizer leaves it as it is.
        ref = mod.make()
        ref.load_state_dict(start)
        opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for k in range(STEPS):
            rows = slice(k * BATCH, (k + 1) * BATCH)
            opt.zero_grad()
            ref(xs[rows], ys[rows]).backward()
            opt.step()
        self.assertIsNone(ref.spare.weight.grad)

        self.assertEqual(set(trained), set(start))
        fresh = mod.make()
        fresh.load_state_dict(trained, strict=True)
        got = fresh.state_dict()
        for name, want in ref.state_dict().items():
            if name.startswith("spare."):
                self.assertTrue(torch.equal(got[name], start[name]), name)
                continue
            err = float((got[name] - want).abs().max())
            bound = 1e-5 * max(float(want.abs().max()), 1e-3)
            self.assertLessEqual(err, bound, name)
            self.assertFalse(torch.equal(got[name], start[name]),
                             f"{name} did not train")

        # A state_dict whose unused linear holds other values: refused
        # before step 1, named (the export would give back the recorded
        # ones).
        other = dict(start)
        other["spare.weight"] = start["spare.weight"] + 1
        path = os.path.join(d, "other.safetensors")
        export_fx._safetensors_io().write(path, other)
        refused = U.run([LAUNCH, "--executor", EXECUTOR, "--plan", plan,
                         "--steps", "1", "--data", "npy:" + data,
                         "--init-weights", path], check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("spare.weight (a parameter forward does not use",
                      refused.stdout + refused.stderr)

    def test_unused_parameter_past_the_budget_is_named(self):
        """520 x 520 random values are more runs than the graph records:
        the exporter names spare.weight with the reason, --weights and
        the checkpoint export leave it out (the latter naming it too), and
        load_state_dict(strict=False) misses exactly it; spare.bias is
        recorded and comes back."""
        d = U.tmpdir()
        mod, source = U.module_from_source(d, "with_big_spare", MODULE)
        graph, weights, p = export_cli(d, source, "make_big", "float32")
        self.assertIn("spare.weight: a parameter forward does not use, ",
                      p.stderr)
        self.assertIn(f"runs of equal values, over the "
                      f"{UNUSED_PARAMETER_RUNS_LIMIT} left", p.stderr)
        init = export_fx._safetensors_io().read(weights)
        self.assertNotIn("spare.weight", init)
        self.assertIn("spare.bias", init)

        gen = torch.Generator().manual_seed(9)
        xs = torch.randn(BATCH, I, generator=gen)
        ys = torch.randint(0, C, (BATCH,), generator=gen)
        trained, exported, _ = train(d, graph, weights, write_data(d, xs, ys),
                                     steps=1)
        self.assertIn("note: the model's state_dict also holds spare.weight",
                      exported.stderr)
        model = mod.make_big()
        result = model.load_state_dict(trained, strict=False)
        self.assertEqual(result.missing_keys, ["spare.weight"])
        self.assertEqual(result.unexpected_keys, [])
        self.assertTrue(torch.equal(trained["spare.bias"],
                                    mod.make_big().spare.bias.detach()))


if __name__ == "__main__":
    U.main("export_unused_params_test")
