"""torchvision's video classification models through the exporter: 3-D
convolutions (conv3d, with r2plus1d's (1, 3, 3) spatial and (3, 1, 1)
temporal factorisation and mc3's mixed kernels), BatchNorm3d (the IR's
batch_norm over rank 5), MaxPool3d and AvgPool3d (max_pool3d,
avg_pool3d), AdaptiveAvgPool3d to 1x1x1 (a mean over the volume) and a
cross-entropy over the clip's classes.

- r3d_18, mc3_18 and r2plus1d_18 (5 classes, no pretrained weights, 8
  frames of 32x32), s3d (13 frames of 224x224, its smallest input: its
  last AvgPool3d is 2x7x7) and mvit_v1_b (16 frames of 224x224, the size
  of its position embeddings; conv3d pooling of its attention, a wrapped
  function returning a tuple) export and validate with PyTorch's
  parameter count, one conv3d per nn.Conv3d.
- A tiny video classifier of torchvision's own blocks (VideoResNet's
  BasicBlock with Conv3DSimple, Conv2Plus1D with a strided downsample and
  Conv3DNoTemporal) computes PyTorch's loss and every parameter's gradient
  in float64 with the reference evaluator, and trains 3 SGD steps on 2
  ranks (hap-launch, CPU executors) with the dp-even and the synthesized
  plan as PyTorch does (float64, 1e-5)."""

import json
import os
import unittest

import torch_test_util as U  # noqa: E402  (sets sys.path)

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torchvision.models.video as V
    from torchvision.models.video.resnet import (BasicBlock, Conv2Plus1D,
                                                 Conv3DNoTemporal,
                                                 Conv3DSimple)
    import export_fx
    from export_test_case import ExportTestCase
except ImportError:  # no torchvision: every test skips
    V = None
    ExportTestCase = unittest.TestCase


LAUNCH = os.environ.get("HAP_LAUNCH")
EXECUTOR = os.environ.get("HAP_EXECUTOR")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")
BATCH, STEPS, LR = 4, 3, 0.05
CLIP = (3, 4, 12, 12)  # channels, frames, height, width


class Classify(nn.Module if V is not None else object):
    """A clip classifier whose forward(x, labels) is the cross-entropy of
    its scores."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


class TinyVideoNet(nn.Module if V is not None else object):
    """A stem (3x3x3, spatial stride 2), then VideoResNet's BasicBlock with
    each of torchvision's three convolution builders: Conv3DSimple, s3d's
    first MaxPool3d ((1, 3, 3), stride (1, 2, 2), padded), Conv2Plus1D
    (stride 2, a 1x1x1 strided downsample) and Conv3DNoTemporal; a padded
    AvgPool3d without the padding in its divisor, AdaptiveAvgPool3d(1) and
    a linear head."""

    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(3, 4, 3, stride=(1, 2, 2), padding=1, bias=False),
            nn.BatchNorm3d(4), nn.ReLU())
        self.simple = BasicBlock(4, 4, Conv3DSimple)
        self.max_pool = nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1))
        self.two_plus_one = BasicBlock(
            4, 6, Conv2Plus1D, stride=2,
            downsample=nn.Sequential(
                nn.Conv3d(4, 6, 1, stride=2, bias=False), nn.BatchNorm3d(6)))
        self.no_temporal = BasicBlock(6, 6, Conv3DNoTemporal)
        self.avg_pool = nn.AvgPool3d(2, stride=1, padding=(1, 0, 0),
                                     count_include_pad=False)
        self.pool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.head = nn.Linear(6, classes)

    def forward(self, x, labels):
        h = self.max_pool(self.simple(self.stem(x)))  # [4, 4, 3, 3]
        h = self.no_temporal(self.two_plus_one(h))  # [6, 2, 2, 2]
        h = self.pool(self.avg_pool(h))  # [6, 3, 1, 1], [6, 1, 1, 1]
        return F.cross_entropy(self.head(h.flatten(1)), labels)


class VideoTest(ExportTestCase):
    @classmethod
    def setUpClass(cls):
        if V is None:
            raise unittest.SkipTest("python3-torchvision is not installed "
                                    "(scripts/setup.sh installs it)")
        super().setUpClass()

    def test_models_export_with_pytorchs_parameter_count(self):
        clips = {"r3d_18": (2, 3, 8, 32, 32), "mc3_18": (2, 3, 8, 32, 32),
                 "r2plus1d_18": (2, 3, 8, 32, 32),
                 "s3d": (1, 3, 13, 224, 224),
                 "mvit_v1_b": (1, 3, 16, 224, 224)}
        for name, clip in clips.items():
            with self.subTest(model=name):
                torch.manual_seed(0)
                m = Classify(getattr(V, name)(num_classes=5))
                g = export_fx.export(m, {
                    "x": torch.randn(*clip),
                    "labels": torch.randint(0, 5, clip[:1])})
                path = os.path.join(U.tmpdir(), f"{name}.json")
                with open(path, "w") as f:
                    json.dump(g, f)
                got = U.validate(path)
                self.assertEqual(got["trainable_parameters"],
                                 sum(p.numel() for p in m.parameters()
                                     if p.requires_grad))
                convs = sum(1 for op in g["ops"] if op["type"] == "conv3d")
                want = sum(1 for mod in m.modules()
                           if isinstance(mod, nn.Conv3d))
                self.assertGreater(want, 0)
                self.assertEqual(convs, want)

    def test_tiny_video_net_computes_pytorchs_loss_and_gradients(self):
        torch.manual_seed(1)
        m = TinyVideoNet().double()
        inputs = {"x": torch.randn(2, *CLIP, dtype=torch.float64),
                  "labels": torch.randint(0, 3, (2,))}
        _, values = self.assert_loss_and_gradients(m, inputs, tol=1e-9)
        self.assertEqual(sorted(k for k, _ in m.named_parameters()
                                if k not in values), [])

    def test_adaptive_avg_pool3d_to_other_sizes_fails_naming_it(self):
        class Pool(nn.Module):
            def forward(self, x):
                return F.adaptive_avg_pool3d(x, (1, 2, 2)).sum()

        with self.assertRaisesRegex(export_fx.ExportError,
                                    r"adaptive_avg_pool3d to \[1, 2, 2\] "
                                    r"is not supported"):
            export_fx.export(Pool(), {"x": torch.randn(1, 2, 3, 4, 4)})

    def test_tiny_video_net_trains_like_pytorch_on_two_ranks(self):
        if not (LAUNCH and EXECUTOR and CPU_CLUSTER):
            self.skipTest("HAP_LAUNCH, HAP_EXECUTOR, CPU_CLUSTER not given")
        torch.manual_seed(1)
        m = TinyVideoNet().double()
        start = {k: v.detach().clone() for k, v in m.named_parameters()}
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(STEPS * BATCH, *CLIP, generator=gen,
                         dtype=torch.float64)
        ys = torch.randint(0, 3, (STEPS * BATCH,), generator=gen)
        final = U.assert_trains_like_pytorch(self, m, xs, ys, BATCH, STEPS,
                                             LR, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        # The 3-D convolutions of each builder trained.
        for k in ("stem.0.weight", "simple.conv1.0.weight",
                  "simple.conv2.0.weight",
                  "two_plus_one.conv1.0.0.weight",
                  "two_plus_one.conv1.0.3.weight",
                  "no_temporal.conv2.0.weight"):
            self.assertFalse(torch.equal(start[k], final[k]), k)


if __name__ == "__main__":
    U.main("video_test")
