"""torchvision's segmentation models through the exporter: dilated
convolutions (fcn's and deeplabv3's backbones, deeplabv3's ASPP),
F.interpolate back to the input's size (bilinear), the model's dict output
(model(x)["out"]) and a per-pixel cross-entropy ([n, c, h, w] scores
against [n, h, w] targets).

- fcn_resnet50, deeplabv3_mobilenet_v3_large and lraspp_mobilenet_v3_large
  (5 classes, no pretrained weights, 64x64) export and validate with
  PyTorch's parameter count.
- A tiny segmentation model of torchvision's own heads (DeepLabHead's ASPP
  with dilations 2, 3 and 4 and its pooled branch, LRASPPHead, FCNHead) on
  a small dilated backbone computes PyTorch's loss and every parameter's
  gradient in float64 with the reference evaluator, and trains 3 SGD steps
  on 2 ranks (hap-launch, CPU executors) with the dp-even and the
  synthesized plan as PyTorch does (float64, 1e-5)."""

import json
import os
import unittest

import torch_test_util as U  # noqa: E402  (sets sys.path)

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torchvision.models.segmentation as S
    from torchvision.models.segmentation.deeplabv3 import ASPP
    from torchvision.models.segmentation.fcn import FCNHead
    from torchvision.models.segmentation.lraspp import LRASPPHead
    import export_fx
    from export_test_case import ExportTestCase
except ImportError:  # no torchvision: every test skips
    S = None
    ExportTestCase = unittest.TestCase


LAUNCH = os.environ.get("HAP_LAUNCH")
EXECUTOR = os.environ.get("HAP_EXECUTOR")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")
BATCH, STEPS, LR = 4, 3, 0.05


class Segment(nn.Module if S is not None else object):
    """A segmentation model whose forward(x, labels) is the per-pixel
    cross-entropy of its "out"."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x)["out"], labels)


class TinySegmenter(nn.Module if S is not None else object):
    """A dilated backbone (stride 2, then dilations 2 and (1, 2)) and
    torchvision's ASPP, LRASPP and FCN heads, each resized back to the
    input (bilinear, as torchvision's models do)."""

    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1),
                                  nn.BatchNorm2d(6), nn.ReLU())
        self.low = nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=3)
        self.high = nn.Conv2d(6, 8, 3, stride=2, padding=(1, 2),
                              dilation=(1, 2))
        self.aspp = ASPP(8, [2, 3, 4], out_channels=8)
        self.aspp_out = nn.Conv2d(8, classes, 1)
        self.lraspp = LRASPPHead(6, 8, classes, 4)
        self.fcn = FCNHead(8, classes)
        for m in self.modules():
            if isinstance(m, nn.Dropout):  # deterministic for the check
                m.p = 0.0

    def forward(self, x, labels):
        size = x.shape[-2:]
        low = F.relu(self.low(self.stem(x)))
        high = F.relu(self.high(low))
        a = self.aspp_out(self.aspp(high))
        b = self.lraspp({"low": low, "high": high})
        c = self.fcn(high)
        out = F.interpolate(a + c, size=low.shape[-2:], mode="bilinear",
                            align_corners=False) + b
        out = F.interpolate(out, size=size, mode="bilinear",
                            align_corners=False)
        return F.cross_entropy(out, labels)


class SegmentationTest(ExportTestCase):
    @classmethod
    def setUpClass(cls):
        if S is None:
            raise unittest.SkipTest("python3-torchvision is not installed "
                                    "(scripts/setup.sh installs it)")
        super().setUpClass()

    def test_models_export_with_pytorchs_parameter_count(self):
        builders = {
            "fcn_resnet50": lambda: S.fcn_resnet50(
                num_classes=5, weights_backbone=None, aux_loss=False),
            "deeplabv3_mobilenet_v3_large": lambda:
                S.deeplabv3_mobilenet_v3_large(
                    num_classes=5, weights_backbone=None, aux_loss=False),
            "lraspp_mobilenet_v3_large": lambda:
                S.lraspp_mobilenet_v3_large(num_classes=5,
                                            weights_backbone=None),
        }
        for name, build in builders.items():
            with self.subTest(model=name):
                torch.manual_seed(0)
                m = Segment(build())
                g = export_fx.export(m, {
                    "x": torch.randn(2, 3, 64, 64),
                    "labels": torch.randint(0, 5, (2, 64, 64))})
                path = os.path.join(U.tmpdir(), f"{name}.json")
                with open(path, "w") as f:
                    json.dump(g, f)
                got = U.validate(path)
                self.assertEqual(got["trainable_parameters"],
                                 sum(p.numel() for p in m.parameters()
                                     if p.requires_grad))
                dilated = sum(1 for op in g["ops"] if op["type"] == "conv2d"
                              and "dilation" in op.get("attrs", {}))
                want = sum(1 for mod in m.modules()
                           if isinstance(mod, nn.Conv2d)
                           and tuple(mod.dilation) != (1, 1))
                self.assertGreater(want, 0)
                self.assertEqual(dilated, want)

    def test_tiny_segmenter_computes_pytorchs_loss_and_gradients(self):
        m = TinySegmenter().double()
        inputs = {"x": torch.randn(2, 3, 16, 20, dtype=torch.float64),
                  "labels": torch.randint(0, 3, (2, 16, 20))}
        _, values = self.assert_loss_and_gradients(m, inputs, tol=1e-9)
        self.assertEqual(sorted(k for k, _ in m.named_parameters()
                                if k not in values), [])

    def test_tiny_segmenter_trains_like_pytorch_on_two_ranks(self):
        if not (LAUNCH and EXECUTOR and CPU_CLUSTER):
            self.skipTest("HAP_LAUNCH, HAP_EXECUTOR, CPU_CLUSTER not given")
        m = TinySegmenter().double()
        start = {k: v.detach().clone() for k, v in m.named_parameters()}
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(STEPS * BATCH, 3, 16, 20, generator=gen,
                         dtype=torch.float64)
        ys = torch.randint(0, 3, (STEPS * BATCH, 16, 20), generator=gen)
        final = U.assert_trains_like_pytorch(self, m, xs, ys, BATCH, STEPS,
                                             LR, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        # The dilated convolutions trained.
        for k in ("low.weight", "high.weight", "aspp.convs.1.0.weight"):
            self.assertFalse(torch.equal(start[k], final[k]), k)


if __name__ == "__main__":
    U.main("segmentation_test")
