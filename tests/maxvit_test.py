"""torchvision's MaxViT through the exporter: its attention is written with
torch.einsum (decomposed into matmuls), its grid partition swaps axes with
torch.swapaxes, and its relative position bias reads a table at a constant
index (a one-hot VALUES constant).

- maxvit_t itself (31M parameters, 224x224) exports and validates with
  PyTorch's parameter count, each einsum one matmul. Export only: its
  smallest input is 224x224, too slow for tests/torchvision_corpus_test's
  training.
- A tiny MaxVit (maxvit_t's classes: stem 8, blocks of 8 and 16 channels,
  partitions of 4 on a 32x32 image) computes PyTorch's loss and every
  parameter's gradient in float64 with the reference evaluator."""

import collections
import json
import os
import unittest

import torch_test_util as U  # noqa: E402  (sets sys.path)

try:
    import torch
    import torch.nn.functional as F
    from torchvision.models.maxvit import MaxVit
    import export_fx
    import torchvision_models as TM
    from export_test_case import ExportTestCase
except ImportError:  # no torchvision: every test skips
    MaxVit = None
    ExportTestCase = unittest.TestCase


class TinyMaxVit(MaxVit if MaxVit is not None else object):
    """A MaxVit whose forward(x, labels) returns the cross-entropy loss."""

    def forward(self, x, labels):
        return F.cross_entropy(super().forward(x), labels)


class MaxVitTest(ExportTestCase):
    @classmethod
    def setUpClass(cls):
        if MaxVit is None:
            raise unittest.SkipTest("python3-torchvision is not installed "
                                    "(scripts/setup.sh installs it)")
        super().setUpClass()

    def test_maxvit_t_exports_with_pytorchs_parameter_count(self):
        m = TM.make("maxvit_t")
        g = export_fx.export(m, {"x": torch.randn(2, 3, 224, 224),
                                 "labels": torch.tensor([1, 2])})
        graph = os.path.join(U.tmpdir(), "maxvit_t.json")
        with open(graph, "w") as f:
            json.dump(g, f)
        got = U.validate(graph)
        self.assertEqual(got["trainable_parameters"],
                         sum(p.numel() for p in m.parameters()))
        # 11 layers of a window and a grid attention, each two einsums:
        # the scores a transpose of the keys and a matmul, the weighted
        # values a matmul.
        einsums = collections.Counter(op["type"] for op in g["ops"]
                                      if op["name"].startswith("einsum"))
        self.assertEqual(einsums, {"matmul": 44, "transpose": 22})

    def test_tiny_maxvit_computes_pytorchs_loss_and_gradients(self):
        m = TinyMaxVit(input_size=(32, 32), stem_channels=8,
                       partition_size=4, block_channels=[8, 16],
                       block_layers=[1, 1], head_dim=4,
                       stochastic_depth_prob=0.0, num_classes=5).double()
        inputs = {"x": torch.randn(2, 3, 32, 32, dtype=torch.float64),
                  "labels": torch.tensor([1, 3])}
        _, values = self.assert_loss_and_gradients(m, inputs, tol=1e-9)
        # Every parameter's gradient was compared (the graph holds them all).
        self.assertEqual(sorted(k for k, _ in m.named_parameters()
                                if k not in values), [])


if __name__ == "__main__":
    U.main("maxvit_test")
