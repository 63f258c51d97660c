"""The corpus test (issue 20 item 4): torchvision models (Debian's
python3-torchvision 0.14, weights=None) export with tools/export_fx.py, keep
PyTorch's parameter counts, plan on a 2-rank CPU cluster and on the
64-device heterogeneous example cluster, and the small ones train 3 steps
on 2 ranks (float64, so the comparison is not at the mercy of batch_norm's
conditioning on a few samples) with two different plans (data parallel at
an even split and the synthesized plan), whose losses must agree.

Models: those issue 20 names and others that share their ops (resnet18,
mobilenet_v2, efficientnet_b0, densenet121, squeezenet1_0, convnext_tiny,
vgg11, alexnet, shufflenet_v2_x0_5, resnext50_32x4d, googlenet,
regnet_y_400mf, mobilenet_v3_small)."""

import json
import os
import subprocess
import unittest

import torch_test_util as U  # noqa: E402  (sets sys.path)

try:
    import torch
    import torchvision_models as TM
except ImportError:  # no torchvision: every test skips
    TM = None

LAUNCH = os.path.abspath(os.environ.get("HAP_LAUNCH", ""))
EXECUTOR = os.path.abspath(os.environ.get("HAP_EXECUTOR", ""))
CPU_CLUSTER = os.path.abspath(os.environ.get("CPU_CLUSTER", ""))
BIG_CLUSTER = os.path.abspath(os.environ.get("BIG_CLUSTER", ""))

MODELS = ["resnet18", "mobilenet_v2", "efficientnet_b0", "densenet121",
          "squeezenet1_0", "convnext_tiny", "vgg11", "alexnet",
          "shufflenet_v2_x0_5", "resnext50_32x4d", "googlenet",
          "regnet_y_400mf", "mobilenet_v3_small"]
TRAINED = ["resnet18", "mobilenet_v2", "squeezenet1_0", "shufflenet_v2_x0_5"]
IMAGE = 64  # alexnet's smallest input


class TorchvisionCorpusTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if TM is None:
            raise unittest.SkipTest("python3-torchvision is not installed "
                                    "(scripts/setup.sh installs it)")
        cls.dir = U.tmpdir()

    def export(self, name, batch, double=False, weights=None):
        out = os.path.join(self.dir, f"{name}_{batch}_{int(double)}.json")
        cmd = [U.PYTHON, U.EXPORT_FX, "--module",
               f"{os.path.join(U.HERE, 'torchvision_models.py')}:make",
               "--kwargs", json.dumps({"name": name, "double": double}),
               "--input-shape", f"x={batch},3,{IMAGE},{IMAGE}" +
               (":float64" if double else ""),
               "--input-shape", f"labels={batch}:int64:10", "-o", out]
        if weights:
            cmd += ["--weights", weights]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, f"{name}: {p.stderr}")
        return out

    def plan(self, graph, cluster, baseline="hap", save=None):
        cmd = [U.HAPCTL, "plan", "--cluster", cluster, "--graph", graph,
               "--baseline", baseline, "--max-seconds", "20", "-o", "json",
               "--optimizer", "sgd", "--lr", "0.01"]
        if save:
            cmd += ["--save-plan", save]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, f"{graph} on {cluster}: {p.stderr}")
        return json.loads(p.stdout)

    def train(self, plan, weights):
        p = subprocess.run([LAUNCH, "--executor", EXECUTOR, "--plan", plan,
                            "--steps", "3", "--data", "synthetic",
                            "--init-weights", weights, "--log-every", "1"],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        losses = [float(line.split()[3]) for line in p.stdout.splitlines()
                  if line.startswith("step ")]
        self.assertEqual(len(losses), 3, p.stdout)
        return losses

    def check_model(self, name):
        m = TM.make(name)
        want = sum(p.numel() for p in m.parameters())
        graph = self.export(name, 64)
        got = U.validate(graph)
        self.assertEqual(got["trainable_parameters"], want, name)
        small = self.plan(graph, CPU_CLUSTER)
        big = self.plan(graph, BIG_CLUSTER)
        print(f"  {name}: {want} parameters, {got['ops']} ops; predicted step "
              f"{small['predicted_step_seconds']:.4g} s on 2 CPU ranks, "
              f"{big['predicted_step_seconds']:.4g} s on 64 devices "
              f"(synthesis {big['synthesis_seconds']:.2f} s)")
        if name not in TRAINED:
            return
        weights = os.path.join(self.dir, f"{name}.safetensors")
        g64 = self.export(name, 6, double=True, weights=weights)
        runs = {}
        for baseline in ("dp-even", "hap"):
            plan = os.path.join(self.dir, f"{name}_{baseline}.pb")
            self.plan(g64, CPU_CLUSTER, baseline, save=plan)
            runs[baseline] = self.train(plan, weights)
        print(f"  {name}: losses dp-even {runs['dp-even']}, hap {runs['hap']}")
        for a, b in zip(runs["dp-even"], runs["hap"]):
            self.assertAlmostEqual(a, b, delta=1e-5 * max(1.0, abs(a)),
                                   msg=f"{name}: {runs}")


def add_model_tests():
    for name in MODELS:
        setattr(TorchvisionCorpusTest, f"test_{name}",
                lambda self, n=name: self.check_model(n))


add_model_tests()

if __name__ == "__main__":
    U.main("torchvision_corpus_test")
