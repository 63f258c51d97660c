"""torchvision's Swin Transformer through the exporter and the executor.

torchvision marks shifted_window_attention and _get_relative_position_bias
with torch.fx.wrap; the exporter traces into them with their arguments'
shapes. The shifted-window attention mask (built by slice assignment on a
zeros tensor) and the one-hot matrix that reads the relative position bias
table at the constant relative_position_index are frozen VALUES constants.

- swin_t itself (28M parameters, 224x224) exports, validates with PyTorch's
  parameter count and plans on the 2-rank CPU cluster.
- A tiny SwinTransformer (swin_t's classes: patch 4, embed 8, depths [2, 1],
  window 3 on a 4x4 map, so padded to 6x6 and shifted by 1) computes
  PyTorch's loss and gradients in float64, and trains 3 SGD steps on 2 ranks
  with two plans (dp-even and the synthesized one) from the same weights and
  npy batches: both plans' losses and final parameters equal PyTorch's own
  steps (float64, 1e-5).

The same for Swin V2 (swin_v2_t; the tiny one with SwinTransformerBlockV2 and
PatchMergingV2): cosine attention (F.normalize, clamp, exp), the continuous
position bias MLP on the constant relative_coords_table, and the qkv bias
whose key part is zeroed through a slice of a clone."""

import json
import os
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402

try:  # Debian's python3-torchvision (scripts/setup.sh)
    from torchvision.models import swin_t, swin_v2_t
    from torchvision.models.swin_transformer import (
        PatchMergingV2, SwinTransformer, SwinTransformerBlockV2)
except ImportError:  # every test skips
    SwinTransformer = None

LAUNCH = os.environ.get("HAP_LAUNCH")
EXECUTOR = os.environ.get("HAP_EXECUTOR")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")
BATCH, STEPS, LR, IMAGE, CLASSES = 4, 3, 0.05, 16, 5


class WithLoss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


def tiny_swin(v2=False):
    torch.manual_seed(0)
    kw = {"block": SwinTransformerBlockV2,
          "downsample_layer": PatchMergingV2} if v2 else {}
    m = WithLoss(SwinTransformer(
        patch_size=[4, 4], embed_dim=8, depths=[2, 1], num_heads=[2, 2],
        window_size=[3, 3], stochastic_depth_prob=0.0,
        num_classes=CLASSES, **kw)).double()
    # Biases start at 0 (SwinTransformer's init): nonzero ones, so that the
    # zeroed key part of V2's qkv bias matters.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("qkv.bias"):
                p.uniform_(-0.5, 0.5)
    return m


class SwinTest(ExportTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        if SwinTransformer is None:
            raise unittest.SkipTest("python3-torchvision is not installed "
                                    "(scripts/setup.sh installs it)")

    def test_swin_v2_t_exports_with_pytorchs_parameter_count(self):
        torch.manual_seed(0)
        m = WithLoss(swin_v2_t(num_classes=10))
        graph = os.path.join(U.tmpdir(), "swin_v2_t.json")
        g = export_fx.export(m, {"x": torch.randn(2, 3, 256, 256),
                                 "labels": torch.tensor([1, 2])})
        with open(graph, "w") as f:
            json.dump(g, f)
        self.assertEqual(U.validate(graph)["trainable_parameters"],
                         sum(p.numel() for p in m.parameters()))
        types = {op["type"] for op in g["ops"]}
        self.assertTrue({"exp", "rsqrt"} <= types, types)

    def test_swin_t_exports_with_pytorchs_parameter_count(self):
        torch.manual_seed(0)
        m = WithLoss(swin_t(num_classes=10))
        d = U.tmpdir()
        graph = os.path.join(d, "swin_t.json")
        g = export_fx.export(m, {"x": torch.randn(2, 3, 224, 224),
                                 "labels": torch.tensor([1, 2])})
        with open(graph, "w") as f:
            json.dump(g, f)
        got = U.validate(graph)
        self.assertEqual(got["trainable_parameters"],
                         sum(p.numel() for p in m.parameters()))
        # The relative position index (7x7 windows) and the masks of the
        # shifted windows of the three stages that shift: one constant each,
        # shared by the blocks.
        listed = [p for p in g["parameters"]
                  if p["init"]["kind"] == "VALUES"]
        self.assertEqual(len(listed), 4, [p["tensor"] for p in listed])
        self.assertTrue(all(p["frozen"] for p in listed))
        plan = U.hapctl_json("plan", "--cluster", CPU_CLUSTER, "--graph",
                             graph, "--max-seconds", "5") \
            if CPU_CLUSTER else None
        if plan is not None:
            self.assertGreater(plan["predicted_step_seconds"], 0)

    def test_tiny_swin_computes_pytorchs_loss_and_gradients(self):
        for v2 in (False, True):
            with self.subTest(v2=v2):
                m = tiny_swin(v2)
                inputs = {"x": torch.randn(2, 3, IMAGE, IMAGE,
                                           dtype=torch.float64),
                          "labels": torch.tensor([1, 3])}
                _, values = self.assert_loss_and_gradients(m, inputs,
                                                           tol=1e-9)
                # Every parameter's gradient was compared.
                self.assertEqual(sorted(k for k, _ in m.named_parameters()
                                        if k not in values), [])
                if v2:  # the zeroed key part of the qkv bias: no gradient
                    bias = m.net.features[1][0].attn.qkv.bias
                    self.assertEqual(float(bias.grad[8:16].abs().sum()), 0)
                    self.assertNotEqual(float(bias.grad[:8].abs().sum()), 0)

    def test_tiny_swin_trains_like_pytorch_on_two_ranks(self):
        if not (LAUNCH and EXECUTOR and CPU_CLUSTER):
            self.skipTest("HAP_LAUNCH, HAP_EXECUTOR, CPU_CLUSTER not given")
        for v2 in (False, True):
            with self.subTest(v2=v2):
                self.check_training(tiny_swin(v2))

    def check_training(self, m):
        start = {k: v.detach().clone() for k, v in m.named_parameters()}
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(STEPS * BATCH, 3, IMAGE, IMAGE, generator=gen,
                         dtype=torch.float64)
        ys = torch.randint(0, CLASSES, (STEPS * BATCH,), generator=gen)
        final = U.assert_trains_like_pytorch(self, m, xs, ys, BATCH, STEPS,
                                             LR, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        # The steps did train the relative position bias (V1: the table,
        # V2: the MLP that computes it) and, in V2, the logit scales.
        for k in final:
            if k.endswith(("relative_position_bias_table", "cpb_mlp.0.weight",
                           "logit_scale")):
                self.assertFalse(torch.equal(start[k], final[k]), k)


if __name__ == "__main__":
    U.main("swin_test")
