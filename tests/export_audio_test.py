"""Sequence and audio models through the exporter (torchaudio 0.13 from
Debian's python3-torchaudio, and the PyTorch pieces they are made of).

The pieces, each against PyTorch's loss and every parameter's gradient in
float64 with the reference evaluator (tests/hap_ir_eval.py):
- nn.Conv1d / F.conv1d (stride, padding, 'same', dilation, groups) as
  conv2d over a height of 1;
- nn.GroupNorm / F.group_norm (one group, one per channel, between; with
  and without affine) as a layer_norm of the groups and a per-channel
  affine;
- nn.PReLU (one value, one per channel), hardtanh to any bounds, nn.GLU /
  F.glu (a split, a sigmoid and a mul);
- nn.ConvTranspose1d/2d, F.conv_transpose1d/2d (stride, padding,
  output_padding, groups, dilation) as a conv2d of the spread input;
- F.mse_loss, F.l1_loss, nn.MSELoss, nn.L1Loss (mean and sum);
- F.pad in reflect, replicate and circular modes and the padding modules
  (nn.ReflectionPad1d/2d, nn.ReplicationPad2d, nn.ZeroPad2d,
  nn.ConstantPad1d);
- softmax / log_softmax over a dim other than the last (transposes);
- masked_fill with a constant mask: a finite value anywhere, -inf into a
  softmax; an empty constant in a torch.cat;
- x - x.max(dim, keepdim=True)[0] before a softmax over dim (a stable
  softmax: the IR has no max, and the shift changes nothing);
- torch.nn.utils.weight_norm on Linear and Conv1d (w = g * v / ||v||);
- control flow on shapes (`if x.ndim == 2`), traced with the example
  inputs' shapes; on values it is refused, naming the line;
- random numbers drawn while tracing (a LayerDrop) are refused, naming the
  line: the graph would keep one draw for ever.

The models: Wav2Letter, wav2vec2_base and hubert_base (layer drop 0) and
conv_tasnet_base export and validate with PyTorch's parameter count; a tiny
ConvTasNet trains 3 SGD steps on 2 ranks against a mean squared error as
PyTorch does; their default layer drop is
refused by name; a tiny wav2vec2 of torchaudio's components and a tiny
Conformer compute PyTorch's loss and gradients in float64, and the tiny
wav2vec2 trains 3 SGD steps on 2 ranks with the dp-even and the synthesized
plan as PyTorch does."""

import json
import os
import random
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402

try:
    import torchaudio.models as am
except ImportError:  # no torchaudio: the model tests skip
    am = None

LAUNCH = os.environ.get("HAP_LAUNCH")
EXECUTOR = os.environ.get("HAP_EXECUTOR")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")
BATCH, STEPS, LR = 4, 3, 0.05


def frame_labels(n, t, classes, seed=0):
    return torch.randint(0, classes, (n, t),
                         generator=torch.Generator().manual_seed(seed))


class PerFrame(nn.Module):
    """Cross-entropy over the classes of a [n, classes, t] output (or of
    [n, t, classes] with `time_major_classes_last`)."""

    def __init__(self, net, classes_last=False, take=None):
        super().__init__()
        self.net, self.classes_last, self.take = net, classes_last, take

    def forward(self, x, labels):
        out = self.net(x)
        if self.take is not None:
            out = out[self.take]
        if self.classes_last:
            out = out.transpose(1, 2)
        return F.cross_entropy(out, labels)


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv1d(3, 6, 5, stride=2, padding=2)
        self.b = nn.Conv1d(6, 6, 3, padding="same", dilation=2, groups=3)
        self.c = nn.Conv1d(6, 8, 1, bias=False)
        self.w = nn.Parameter(torch.randn(4, 8, 3))

    def forward(self, x, labels):
        h = F.relu(self.a(x))
        h = F.relu(self.b(h))
        h = self.c(h)
        h = F.conv1d(h, self.w, None, 1, 1)
        return F.cross_entropy(h, labels)


class GroupNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.one = nn.GroupNorm(1, 6)          # layer norm over (c, h, w)
        self.each = nn.GroupNorm(6, 6)         # instance norm
        self.pairs = nn.GroupNorm(3, 6, affine=False)
        self.w = nn.Parameter(torch.randn(6))
        self.head = nn.Conv2d(6, 4, 1)

    def forward(self, x, labels):
        h = self.conv(x)
        h = self.one(h) + self.each(h)
        h = self.pairs(h) * 2
        h = F.group_norm(h, 2, self.w, None, 1e-3)
        return F.cross_entropy(self.head(h), labels)


class ActivationNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3, padding=1)
        self.one = nn.PReLU()
        self.each = nn.PReLU(5, init=0.1)
        self.tanh = nn.Hardtanh(-0.5, 0.75)

    def forward(self, x, labels):
        h = self.conv(x)
        h = self.one(h) + self.each(h * 2)
        h = self.tanh(h) + F.hardtanh(h, 0.0, 6.0) + F.hardtanh(h, -2, 3)
        h = F.glu(torch.cat([h, h * 0.5 - 1], dim=-1), dim=-1)
        h = F.log_softmax(h, dim=1)  # over the classes of [n, c, t]
        return F.cross_entropy(F.softmax(h, 1) + h, labels)


class StableSoftmax(nn.Module):
    """Attention with torchaudio's shift: scores less their row maximum."""

    def __init__(self, use_amax=False):
        super().__init__()
        self.q, self.k = nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.use_amax = use_amax

    def forward(self, x, labels):
        s = self.q(x) @ self.k(x).transpose(1, 2)
        if self.use_amax:
            s = s - s.amax(dim=-1, keepdim=True)
        else:
            s = s - s.max(dim=-1, keepdim=True)[0]
        h = F.softmax(s, dim=-1) @ x
        return F.cross_entropy(self.head(h[:, 0]), labels)


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.utils.weight_norm(nn.Conv1d(4, 6, 3, padding=1,
                                                   groups=2), dim=2)
        self.fc = nn.utils.weight_norm(nn.Linear(6, 3))  # dim 0

    def forward(self, x, labels):
        h = F.gelu(self.conv(x)).mean(dim=2)
        return F.cross_entropy(self.fc(h), labels)


class ShapeBranches(nn.Module):
    """Branches on shapes, as torchaudio's components do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, labels):
        if x.ndim == 2:
            x = x.unsqueeze(1)
        if x.size(-1) % 2:
            x = x[..., :-1]
        x = x.reshape(x.shape[0], -1, 6)
        return F.cross_entropy(self.fc(x).mean(1), labels)


class LayerDrop(nn.Module):
    def __init__(self, draw, p=0.3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 3)
        self.draw, self.p = draw, p

    def forward(self, x, labels):
        for layer in self.layers:
            if self.training and self.draw() <= self.p:
                continue
            x = F.relu(layer(x))
        return F.cross_entropy(self.head(x), labels)


class Upsampling(nn.Module):
    """Transposed convolutions: strided with output_padding, grouped and
    dilated, 1-D without bias, and F.conv_transpose1d."""

    def __init__(self):
        super().__init__()
        self.a = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1,
                                    output_padding=1)
        self.b = nn.ConvTranspose2d(6, 4, (2, 3), stride=(1, 2),
                                    padding=(0, 2), groups=2,
                                    dilation=(1, 2))
        self.c = nn.ConvTranspose1d(3, 4, 4, stride=3, padding=1, bias=False)
        self.w = nn.Parameter(torch.randn(4, 2, 3))

    def forward(self, x, y, labels):
        h = self.b(F.relu(self.a(x)))
        z = F.conv_transpose1d(self.c(y), self.w, None, 2, 1, 1)
        return F.cross_entropy(h.mean((2, 3)) + z.mean(2).sum(1, True),
                               labels)


class Regression(nn.Module):
    def __init__(self, kind, reduction):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.loss = (nn.MSELoss if kind == "mse" else nn.L1Loss)(
            reduction=reduction)
        self.kind = kind

    def forward(self, x, labels):
        y = self.fc(x)
        f = F.mse_loss if self.kind == "mse" else F.l1_loss
        return self.loss(y, labels) + 0.5 * f(y * 2, labels)


class Padded(nn.Module):
    """F.pad in every mode and the padding modules."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.conv1d = nn.Conv1d(3, 2, 3)
        self.reflect = nn.ReflectionPad2d((1, 2, 2, 1))
        self.replicate = nn.ReplicationPad2d((1, 1, 2, 0))
        self.zero = nn.ZeroPad2d((0, 1, 1, 0))
        self.reflect1d = nn.ReflectionPad1d((3, 0))
        self.const1d = nn.ConstantPad1d((1, 2), 0.5)

    def forward(self, x, y, labels):
        h = self.conv(self.reflect(x)) + self.conv(
            F.pad(x, (1, 2, 2, 1), mode="reflect"))[:, :, :, :]
        h = self.zero(self.replicate(h))
        h = F.pad(h, (1, 1, 0, 1), mode="replicate")
        z = self.conv1d(F.pad(y, (2, 1), mode="circular"))
        z = self.const1d(self.reflect1d(z))
        return F.cross_entropy(h.mean((2, 3)) + z.mean(2).sum(1, True),
                               labels)


class BlockMasked(nn.Module):
    """Constant non-causal masks through masked_fill (Emformer's block
    attention): -inf into a softmax, a finite value anywhere; an empty
    constant concatenated; a position table on x.device after a branch on
    x's shape (so traced with the example's shapes)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        blocks = torch.ones(6, 6, dtype=torch.bool)
        for i in range(0, 6, 2):
            blocks[i:i + 2, i:i + 2] = False
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, x, labels):
        if x.ndim == 3:
            x = x + torch.arange(x.shape[1], device=x.device).unsqueeze(-1)
        s = self.q(x) @ self.k(x).transpose(1, 2)
        s = s.masked_fill(self.blocks, float("-inf"))
        h = F.softmax(s, dim=-1) @ x
        h = torch.cat([torch.zeros(2, 0, 4), h], dim=1)
        h = h.masked_fill(self.blocks[:, :4], 0.25)
        return F.cross_entropy(self.head(h).mean(1), labels)


class ExportSequenceOpsTest(ExportTestCase):
    def test_conv1d(self):
        m = Conv1dNet().double()
        inputs = {"x": torch.randn(2, 3, 20, dtype=torch.float64),
                  "labels": frame_labels(2, 10, 4)}
        g, _ = self.assert_loss_and_gradients(m, inputs, tol=1e-10)
        types = [op["type"] for op in g["ops"]]
        self.assertEqual(types.count("conv2d"), 4)
        # The parameters keep PyTorch's names and shapes.
        shapes = {p["tensor"]["name"]: p["tensor"]["shape"]
                  for p in g["parameters"]}
        self.assertEqual(shapes["a.weight"], [6, 3, 5])
        self.assertEqual(shapes["w"], [4, 8, 3])
        # PyTorch's default initialisation: uniform over +-1/sqrt(fan-in),
        # fan-in the input channels of a group times the kernel.
        inits = {p["tensor"]["name"]: p["init"] for p in g["parameters"]}
        for name, fan_in in (("a.weight", 3 * 5), ("b.bias", 2 * 3)):
            self.assertEqual(inits[name]["kind"], "UNIFORM", name)
            self.assertAlmostEqual(inits[name]["high"], fan_in ** -0.5)

    def test_transposed_convolutions(self):
        torch.manual_seed(0)
        m = Upsampling().double()
        g, _ = self.assert_loss_and_gradients(m, {
            "x": torch.randn(2, 4, 5, 6, dtype=torch.float64),
            "y": torch.randn(2, 3, 7, dtype=torch.float64),
            "labels": torch.tensor([0, 3])}, tol=1e-10)
        shapes = {p["tensor"]["name"]: p["tensor"]["shape"]
                  for p in g["parameters"]}
        self.assertEqual(shapes["b.weight"], [6, 2, 2, 3])  # PyTorch's
        self.assertEqual(shapes["c.weight"], [3, 4, 4])

    def test_mse_and_l1_losses(self):
        for kind in ("mse", "l1"):
            for reduction in ("mean", "sum"):
                with self.subTest(kind=kind, reduction=reduction):
                    torch.manual_seed(0)
                    self.assert_loss_and_gradients(
                        Regression(kind, reduction).double(),
                        {"x": torch.randn(4, 5, dtype=torch.float64),
                         "labels": torch.randn(4, 3, dtype=torch.float64)},
                        tol=1e-10)
        class Unreduced(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(5, 3)

            def forward(self, x, labels):
                return F.mse_loss(self.fc(x), labels, reduction="none").mean()

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Unreduced(), {"x": torch.randn(4, 5),
                                           "labels": torch.randn(4, 3)})
        self.assertIn("mse_loss with reduction='none' is not supported",
                      str(cm.exception))

    def test_padding_modes(self):
        torch.manual_seed(0)
        self.assert_loss_and_gradients(Padded().double(), {
            "x": torch.randn(2, 2, 5, 6, dtype=torch.float64),
            "y": torch.randn(2, 3, 7, dtype=torch.float64),
            "labels": torch.tensor([0, 2])}, tol=1e-10)

    def test_masked_fill_with_constant_masks(self):
        torch.manual_seed(0)
        self.assert_loss_and_gradients(BlockMasked().double(), {
            "x": torch.randn(2, 6, 4, dtype=torch.float64),
            "labels": torch.tensor([0, 2])}, tol=1e-10)

        class Computed(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x, ids, labels):
                h = self.fc(x).masked_fill(ids == 0, 0.0)
                return F.cross_entropy(h, labels)

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Computed(), {"x": torch.randn(2, 4),
                                          "ids": torch.tensor([[0, 1, 2]] * 2),
                                          "labels": torch.tensor([0, 2])})
        self.assertIn("masked_fill is supported with a constant mask only",
                      str(cm.exception))

    def test_group_norm(self):
        m = GroupNormNet().double()
        inputs = {"x": torch.randn(2, 3, 5, 4, dtype=torch.float64),
                  "labels": torch.randint(0, 4, (2, 5, 4))}
        g, _ = self.assert_loss_and_gradients(m, inputs, tol=1e-10)
        self.assertEqual([op["type"] for op in g["ops"]].count("layer_norm"),
                         4)

    def test_prelu_hardtanh_and_softmax_over_channels(self):
        m = ActivationNet().double()
        inputs = {"x": torch.randn(2, 3, 7, dtype=torch.float64),
                  "labels": frame_labels(2, 7, 5)}
        self.assert_loss_and_gradients(m, inputs, tol=1e-10)

    def test_softmax_of_scores_less_their_maximum(self):
        inputs = {"x": torch.randn(2, 5, 6, dtype=torch.float64),
                  "labels": torch.tensor([0, 2])}
        for use_amax in (False, True):
            with self.subTest(amax=use_amax):
                torch.manual_seed(0)
                g, _ = self.assert_loss_and_gradients(
                    StableSoftmax(use_amax).double(), inputs, tol=1e-10)
                # The shift is no op: the scores go into the softmax.
                self.assertNotIn("sub", [op["type"] for op in g["ops"]])

    def test_a_maximum_used_otherwise_fails_naming_it(self):
        class MaxUsed(nn.Module):
            def __init__(self, how):
                super().__init__()
                self.fc = nn.Linear(6, 3)
                self.how = how

            def forward(self, x, labels):
                s = self.fc(x)
                m = s.max(dim=-1, keepdim=True)[0]
                if self.how == "added":
                    s = s + m
                elif self.how == "other softmax":
                    s = F.log_softmax(s - m, dim=-1)
                elif self.how == "not keepdim":
                    s = s - s.max(dim=-1)[0].unsqueeze(-1)
                return F.cross_entropy(s, labels)

        for how, needle in (
                ("added", "supported only as the shift x - x.max(dim=1"),
                ("other softmax", "only a softmax over the same dim"),
                ("not keepdim", "keepdim=True")):
            with self.subTest(how=how):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(MaxUsed(how), {
                        "x": torch.randn(2, 6), "labels": torch.tensor([0, 1])})
                self.assertIn(needle, str(cm.exception))

    def test_weight_norm(self):
        torch.manual_seed(0)
        m = WeightNormed().double()
        inputs = {"x": torch.randn(3, 4, 5, dtype=torch.float64),
                  "labels": torch.tensor([0, 2, 1])}
        g, _ = self.assert_loss_and_gradients(m, inputs, tol=1e-10)
        names = {p["tensor"]["name"] for p in g["parameters"]}
        self.assertTrue({"conv.weight_g", "conv.weight_v", "fc.weight_g",
                         "fc.weight_v"} <= names, names)
        self.assertNotIn("conv.weight", names)

    def test_control_flow_on_shapes_takes_the_examples_branch(self):
        torch.manual_seed(0)
        m = ShapeBranches().double()
        for shape in ((2, 13), (2, 1, 12)):
            with self.subTest(shape=shape):
                self.assert_loss_and_gradients(m, {
                    "x": torch.randn(*shape, dtype=torch.float64),
                    "labels": torch.tensor([0, 2])}, tol=1e-10)

    def test_random_draws_while_tracing_fail_naming_the_line(self):
        for what, draw in (("torch.rand", lambda: torch.rand(1).item()),
                           ("random.random", lambda: random.random())):
            with self.subTest(draw=what):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(LayerDrop(draw), {
                        "x": torch.randn(2, 4), "labels": torch.tensor([0, 1])})
                msg = str(cm.exception)
                self.assertIn(f"draws random numbers while it is traced "
                              f"({what} at ", msg)
                self.assertIn("export_audio_test.py:", msg)
                self.assertIn("drop the same layers for ever", msg)
        # A draw the graph does not depend on (a drop probability of 0,
        # for which torchaudio still draws) exports with every layer.
        for what, draw in (("torch.rand", lambda: torch.rand(1).item()),
                           ("random.uniform",
                            lambda: random.uniform(0.0, 1.0))):
            with self.subTest(draw=what, p=0):
                torch.manual_seed(0)
                m = LayerDrop(draw, p=0.0).double()
                g, _ = self.assert_loss_and_gradients(m, {
                    "x": torch.randn(2, 4, dtype=torch.float64),
                    "labels": torch.tensor([0, 1])}, tol=1e-10)
                self.assertEqual(
                    [op["type"] for op in g["ops"]].count("linear"), 4)
        # Other draws fail at once.
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(LayerDrop(lambda: torch.randint(0, 10, (1,))
                                       .item(), p=0), {
                "x": torch.randn(2, 4), "labels": torch.tensor([0, 1])})
        self.assertIn("(torch.randint at ", str(cm.exception))


class Separation(nn.Module):
    """The mean squared error of separated sources against the target."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return F.mse_loss(self.net(x), labels)


def tiny_conv_tasnet():
    return am.ConvTasNet(num_sources=2, enc_kernel_size=8, enc_num_feats=8,
                         msk_kernel_size=3, msk_num_feats=6,
                         msk_num_hidden_feats=8, msk_num_layers=2,
                         msk_num_stacks=1)


def tiny_wav2vec2(classes=5):
    """torchaudio's wav2vec2 components at toy sizes: a group-norm conv
    feature extractor, the feature projection, the weight-normed
    positional convolution and 2 post-norm transformer layers with the
    max-shifted softmax; no dropout, no layer drop."""
    return am.wav2vec2_model(
        extractor_mode="group_norm",
        extractor_conv_layer_config=[(8, 10, 5), (8, 3, 2)],
        extractor_conv_bias=False, encoder_embed_dim=16,
        encoder_projection_dropout=0.0, encoder_pos_conv_kernel=8,
        encoder_pos_conv_groups=4, encoder_num_layers=2,
        encoder_num_heads=2, encoder_attention_dropout=0.0,
        encoder_ff_interm_features=32, encoder_ff_interm_dropout=0.0,
        encoder_dropout=0.0, encoder_layer_norm_first=False,
        encoder_layer_drop=0.0, aux_num_out=classes)


class ExportAudioModelsTest(ExportTestCase):
    @classmethod
    def setUpClass(cls):
        if am is None:
            raise unittest.SkipTest("python3-torchaudio is not installed "
                                    "(scripts/setup.sh installs it)")
        super().setUpClass()

    def frames(self, net, samples):
        dtype = next(net.parameters()).dtype
        with torch.no_grad():
            out = net(torch.zeros(1, *samples, dtype=dtype))
        out = out[0] if isinstance(out, tuple) else out
        return out.shape

    def test_models_export_with_pytorchs_parameter_count(self):
        builders = {
            "wav2letter": (lambda: am.Wav2Letter(num_classes=10),
                           (1, 4000), False),
            "wav2vec2_base": (lambda: am.wav2vec2_base(
                aux_num_out=10, encoder_layer_drop=0.0), (4000,), True),
            "hubert_base": (lambda: am.hubert_base(
                aux_num_out=10, encoder_layer_drop=0.0), (4000,), True),
            "conv_tasnet_base": (lambda: am.conv_tasnet_base(num_sources=2),
                                 (1, 800), None),
        }
        for name, (build, samples, classes_last) in builders.items():
            with self.subTest(model=name):
                torch.manual_seed(0)
                net = build()
                shape = self.frames(net, samples)
                if classes_last is None:  # separated sources: a regression
                    m = Separation(net)
                    target = torch.randn(2, *shape[1:])
                else:
                    t = shape[1] if classes_last else shape[2]
                    m = PerFrame(net, classes_last,
                                 0 if classes_last else None)
                    target = frame_labels(2, t, 10)
                g = export_fx.export(m, {"x": torch.randn(2, *samples),
                                         "labels": target})
                path = os.path.join(U.tmpdir(), f"{name}.json")
                with open(path, "w") as f:
                    json.dump(g, f)
                got = U.validate(path)
                self.assertEqual(got["trainable_parameters"],
                                 sum(p.numel() for p in m.parameters()))

    def test_layer_drop_is_refused_naming_the_line(self):
        net = am.wav2vec2_base(aux_num_out=10)  # encoder_layer_drop 0.1
        t = self.frames(net, (4000,))[1]
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(PerFrame(net, True, 0), {
                "x": torch.randn(2, 4000), "labels": frame_labels(2, t, 10)})
        msg = str(cm.exception)
        self.assertIn("(torch.rand at ", msg)
        self.assertIn("wav2vec2/components.py:", msg)
        self.assertIn("encoder_layer_drop=0.0", msg)

    def test_tiny_wav2vec2_computes_pytorchs_loss_and_gradients(self):
        torch.manual_seed(0)
        m = PerFrame(tiny_wav2vec2(), True, 0).double()
        t = self.frames(m.net, (200,))[1]
        inputs = {"x": torch.randn(2, 200, dtype=torch.float64),
                  "labels": frame_labels(2, t, 5)}
        g, values = self.assert_loss_and_gradients(m, inputs, tol=1e-9)
        self.assertEqual(sorted(k for k, _ in m.named_parameters()
                                if k not in values), [])
        types = {op["type"] for op in g["ops"]}
        self.assertTrue({"conv2d", "layer_norm", "gelu", "softmax",
                         "rsqrt"} <= types, types)

    def test_tiny_conformer_computes_pytorchs_loss_and_gradients(self):
        """torchaudio's Conformer: its convolution module's pointwise conv1d
        and GLU, depthwise conv1d, BatchNorm1d and SiLU, its feed-forward
        halves and attention, with full lengths."""

        class Frames(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = am.Conformer(input_dim=8, num_heads=2, ffn_dim=16,
                                        num_layers=2,
                                        depthwise_conv_kernel_size=5,
                                        dropout=0.0)
                self.head = nn.Linear(8, 4)

            def forward(self, x, labels):
                lengths = torch.full((x.shape[0],), x.shape[1],
                                     dtype=torch.int64)
                y, _ = self.net(x, lengths)
                return F.cross_entropy(self.head(y).transpose(1, 2), labels)

        torch.manual_seed(0)
        m = Frames().double()
        inputs = {"x": torch.randn(2, 9, 8, dtype=torch.float64),
                  "labels": frame_labels(2, 9, 4)}
        g, _ = self.assert_loss_and_gradients(m, inputs, tol=1e-9)
        types = {op["type"] for op in g["ops"]}
        self.assertTrue({"conv2d", "batch_norm", "silu", "sigmoid",
                         "split"} <= types, types)

    def test_tiny_conv_tasnet_trains_like_pytorch_on_two_ranks(self):
        """ConvTasNet: a Conv1d encoder, a temporal convolution mask
        generator (GroupNorm, PReLU, depthwise dilated Conv1d) and a
        ConvTranspose1d decoder, trained against a mean squared error."""
        if not (LAUNCH and EXECUTOR and CPU_CLUSTER):
            self.skipTest("HAP_LAUNCH, HAP_EXECUTOR, CPU_CLUSTER not given")
        torch.manual_seed(0)
        m = Separation(tiny_conv_tasnet()).double()
        shape = self.frames(m.net, (1, 64))
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(STEPS * BATCH, 1, 64, generator=gen,
                         dtype=torch.float64)
        ys = torch.randn(STEPS * BATCH, *shape[1:], generator=gen,
                         dtype=torch.float64)
        start = {k: v.detach().clone() for k, v in m.named_parameters()}
        final = U.assert_trains_like_pytorch(self, m, xs, ys, BATCH, STEPS,
                                             LR, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        for k in ("net.decoder.weight", "net.encoder.weight"):
            self.assertFalse(torch.equal(start[k], final[k]), k)

    def test_tiny_wav2vec2_trains_like_pytorch_on_two_ranks(self):
        if not (LAUNCH and EXECUTOR and CPU_CLUSTER):
            self.skipTest("HAP_LAUNCH, HAP_EXECUTOR, CPU_CLUSTER not given")
        torch.manual_seed(0)
        m = PerFrame(tiny_wav2vec2(), True, 0).double()
        t = self.frames(m.net, (200,))[1]
        start = {k: v.detach().clone() for k, v in m.named_parameters()}
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(STEPS * BATCH, 200, generator=gen,
                         dtype=torch.float64)
        ys = torch.randint(0, 5, (STEPS * BATCH, t), generator=gen)
        final = U.assert_trains_like_pytorch(self, m, xs, ys, BATCH, STEPS,
                                             LR, LAUNCH, EXECUTOR,
                                             CPU_CLUSTER)
        for k in ("net.feature_extractor.conv_layers.0.conv.weight",
                  "net.encoder.transformer.pos_conv_embed.conv.weight_v",
                  "net.encoder.transformer.pos_conv_embed.conv.weight_g"):
            self.assertFalse(torch.equal(start[k], final[k]), k)


if __name__ == "__main__":
    U.main("export_audio_test")
