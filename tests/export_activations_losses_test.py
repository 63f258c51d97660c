"""tools/export_fx.py on the activations and losses that are no IR op and
are exported as compositions of IR ops (tools/fx_export/ops_elementwise.py,
ops_loss.py): abs, maximum/minimum, leaky_relu, elu, selu, celu, softplus,
mish, logsigmoid, softsign, softmin, tanhshrink and the tanh GELU, as
functions and as modules; smooth L1, Huber, BCE with logits, cross-entropy
with label smoothing and KL divergence with their reductions. Each model's
graph validates with `hapctl validate`, and its loss and parameter
gradients (the reference evaluator tests/hap_ir_eval.py) equal PyTorch's
in float64; what stays unsupported is refused by name."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402


def weighted_sum(terms):
    """The terms' sums weighed by 1 + 0.1 k, so that each term's gradient
    differs."""
    return sum((1.0 + 0.1 * k) * t.sum() for k, t in enumerate(terms))


class Terms(nn.Module):
    """A linear layer (inputs of both signs), then the weighted sum of
    `fn(h)`'s terms."""

    def __init__(self, fn, width=6):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.fn = fn

    def forward(self, x):
        return weighted_sum(self.fn(self.fc(x) * 3.0))


class Activations(nn.Module):
    """Each activation as a module (non-default arguments too)."""

    def __init__(self):
        super().__init__()
        self.acts = nn.ModuleList([
            nn.LeakyReLU(), nn.LeakyReLU(0.2), nn.ELU(), nn.ELU(alpha=0.7),
            nn.SELU(), nn.CELU(), nn.CELU(alpha=4.0), nn.Softplus(),
            nn.Softplus(beta=2.0, threshold=30.0), nn.Mish(), nn.LogSigmoid(),
            nn.Softsign(), nn.Tanhshrink(), nn.GELU(approximate="tanh"),
            nn.Softmin(dim=-1), nn.Softmin(dim=0)])

    def forward(self, h):
        return [act(h) for act in self.acts]


class Loss(nn.Module):
    """A linear layer's output against a target through `loss` (the sum
    of its squares where it is not one value)."""

    def __init__(self, loss, width=5):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.loss = loss

    def forward(self, x, y):
        out = self.loss(self.fc(x) * 2.0, y)
        return out if out.dim() == 0 else (out * out).sum()


class LogSoftmaxThen(nn.Module):
    """`loss` of the log_softmax of its input over the last dim."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def forward(self, a, b):
        return self.loss(F.log_softmax(a, -1), b)


class ExportActivationsLossesTest(ExportTestCase):
    def check(self, module, inputs, seed=1):
        """Loss and gradients equal PyTorch's in float64; the graph's op
        types."""
        torch.manual_seed(seed)
        g, _ = self.assert_loss_and_gradients(module.double(), inputs,
                                              tol=1e-9)
        return {op["type"] for op in g["ops"]}

    def assert_refused(self, module, inputs, needle):
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(module, inputs)
        self.assertIn(needle, str(cm.exception))

    def test_abs_maximum_minimum(self):
        """torch.abs, Tensor.abs, torch.maximum/minimum and their
        methods (broadcast against a [6] parameter): relu compositions."""

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(6, 6)
                self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 6))

            def forward(self, x):
                h = self.fc(x)
                g = h * 0.5 - 0.3
                return weighted_sum([
                    torch.abs(h), h.abs(), torch.maximum(h, g),
                    torch.minimum(h, g), h.maximum(self.w),
                    h.minimum(self.w), torch.maximum(self.w, h)])

        types = self.check(Net(), {"x": torch.randn(4, 6,
                                                    dtype=torch.float64)})
        self.assertTrue(types <= {"linear", "relu", "add", "sub", "scale",
                                  "mul", "sum"}, types)

    def test_activation_functions(self):
        """The functions, with default and other arguments (positional and
        keyword), inputs of both signs. celu's alphas have float32
        reciprocals: PyTorch's celu gradient takes 1 / alpha in float32
        (1.7: a relative 7e-9 from the exact gradient, the graph's)."""

        def fn(h):
            return [F.leaky_relu(h), F.leaky_relu(h, 0.3),
                    F.leaky_relu(h, negative_slope=-0.1), F.elu(h),
                    F.elu(h, 0.5), F.selu(h), torch.selu(h), F.celu(h),
                    F.celu(h, alpha=2.0), torch.celu(h, 0.5), F.softplus(h),
                    F.softplus(h, beta=3.0), F.softplus(h, 0.5, 25.0),
                    F.mish(h), F.logsigmoid(h), F.softsign(h),
                    F.tanhshrink(h), F.gelu(h, approximate="tanh"),
                    F.softmin(h, dim=1), F.softmin(h, 0)]

        x = torch.randn(5, 6, dtype=torch.float64)
        types = self.check(Terms(fn), {"x": x})
        self.assertNotIn("gelu", types)
        self.assertTrue({"relu", "exp", "log", "tanh", "softmax"} <= types,
                        types)

    def test_activation_modules(self):
        """The nn modules, and a transformer layer whose activation is
        nn.GELU(approximate='tanh') (was refused as the function was)."""
        x = torch.randn(5, 6, dtype=torch.float64)
        self.check(Terms(Activations()), {"x": x})

        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                           activation=nn.GELU("tanh"),
                                           batch_first=True)

        class Enc(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = layer

            def forward(self, x):
                return self.layer(x).pow(2).sum()

        types = self.check(Enc(), {"x": torch.randn(2, 3, 8,
                                                    dtype=torch.float64)})
        self.assertIn("tanh", types)
        self.assertNotIn("gelu", types)

    def test_activation_values_at_zero_and_large(self):
        """Large inputs (softplus's stable form, logsigmoid of -40) and an
        exact 0 (the gradient of leaky_relu, elu, softplus there is
        PyTorch's)."""

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.tensor(
                    [0.0, -40.0, 40.0, 0.0, 15.0, -15.0],
                    dtype=torch.float64))

            def forward(self, x):
                h = self.w * x
                return weighted_sum([
                    F.leaky_relu(h, 0.2), F.elu(h, 0.5), F.softplus(h),
                    F.logsigmoid(h), F.mish(h), F.celu(h, 2.0),
                    F.softsign(h), F.selu(h)])

        x = torch.ones(2, 6, dtype=torch.float64)
        self.check(Net(), {"x": x})

    def test_regression_losses(self):
        """smooth_l1_loss (beta), huber_loss (delta), functions and modules,
        reductions 'mean', 'sum' and 'none' (differences both within and
        beyond beta/delta)."""
        x = torch.randn(4, 5, dtype=torch.float64)
        y = torch.randn(4, 5, dtype=torch.float64) * 2.0
        for loss in (nn.SmoothL1Loss(), nn.SmoothL1Loss(beta=0.5),
                     nn.SmoothL1Loss(reduction="sum", beta=2.0),
                     nn.SmoothL1Loss(reduction="none", beta=0.0),
                     nn.HuberLoss(), nn.HuberLoss(delta=0.3),
                     nn.HuberLoss(reduction="sum", delta=2.5),
                     nn.HuberLoss(reduction="none", delta=0.7),
                     lambda a, b: F.smooth_l1_loss(a, b, beta=0.8),
                     lambda a, b: F.smooth_l1_loss(a, b, reduction="none"),
                     lambda a, b: F.huber_loss(a, b, "sum", 1.5),
                     lambda a, b: F.huber_loss(a, target=b, delta=0.4)):
            with self.subTest(loss=loss):
                self.check(Loss(loss), {"x": x, "y": y})

    def test_bce_with_logits(self):
        """binary_cross_entropy_with_logits and nn.BCEWithLogitsLoss, soft
        and hard targets, all three reductions; logits up to +-40."""
        x = torch.randn(4, 5, dtype=torch.float64) * 10.0
        soft = torch.rand(4, 5, dtype=torch.float64)
        hard = (torch.rand(4, 5) > 0.5).double()
        for loss in (nn.BCEWithLogitsLoss(),
                     nn.BCEWithLogitsLoss(reduction="sum"),
                     nn.BCEWithLogitsLoss(reduction="none"),
                     F.binary_cross_entropy_with_logits,
                     lambda a, b: F.binary_cross_entropy_with_logits(
                         a, b, reduction="sum")):
            for y in (soft, hard):
                with self.subTest(loss=loss):
                    self.check(Loss(loss), {"x": x, "y": y})

    def test_cross_entropy_label_smoothing(self):
        """cross_entropy with label_smoothing ([n, c] and per-pixel
        [n, c, d] scores), function and module; was refused."""
        x = torch.randn(6, 5, dtype=torch.float64)
        y = torch.randint(0, 5, (6,))
        for loss in (nn.CrossEntropyLoss(label_smoothing=0.1),
                     lambda a, b: F.cross_entropy(a, b, label_smoothing=0.3),
                     lambda a, b: F.cross_entropy(a, b,
                                                  label_smoothing=1.0)):
            with self.subTest(loss=loss):
                types = self.check(Loss(loss), {"x": x, "y": y})
                self.assertTrue({"cross_entropy", "log_softmax"} <= types)

        class PerPixel(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 1)
                self.loss = nn.CrossEntropyLoss(label_smoothing=0.2)

            def forward(self, x, y):
                return self.loss(self.conv(x), y)

        self.check(PerPixel(), {"x": torch.randn(2, 3, 3, 3,
                                                 dtype=torch.float64),
                                "y": torch.randint(0, 4, (2, 3, 3))})

    def test_kl_div(self):
        """kl_div / nn.KLDivLoss of log-probabilities: log_target=True
        against any target, log_target=False against a constant target
        (a buffer, zeros in it: t log t is 0 there); every reduction."""
        x = torch.randn(4, 5, dtype=torch.float64)
        t = torch.log_softmax(torch.randn(4, 5, dtype=torch.float64), -1)
        for loss in (nn.KLDivLoss(reduction="batchmean", log_target=True),
                     nn.KLDivLoss(reduction="sum", log_target=True),
                     nn.KLDivLoss(reduction="none", log_target=True),
                     lambda a, b: F.kl_div(a, b, reduction="mean",
                                           log_target=True)):
            with self.subTest(loss=loss):
                self.check(Loss(LogSoftmaxThen(loss)), {"x": x, "y": t})

        class Static(nn.Module):
            def __init__(self, reduction):
                super().__init__()
                self.fc = nn.Linear(5, 5)
                p = torch.softmax(torch.randn(4, 5), -1)
                p[0, 1] = p[2, 3] = 0.0
                self.register_buffer("p", p)
                self.reduction = reduction

            def forward(self, x):
                return F.kl_div(F.log_softmax(self.fc(x), -1), self.p,
                                reduction=self.reduction).sum()

        for reduction in ("batchmean", "mean", "sum", "none"):
            with self.subTest(reduction=reduction):
                self.check(Static(reduction), {"x": x})

    def test_refusals(self):
        """What stays unsupported is refused by name."""
        x, y = torch.randn(3, 4), torch.rand(3, 4)
        for f, needle in (
                (lambda a, b: F.softplus(a, threshold=5.0),
                 "softplus with threshold=5.0"),
                (lambda a, b: F.gelu(a, approximate="cubic"),
                 "gelu(approximate='cubic')"),
                (lambda a, b: F.binary_cross_entropy(torch.sigmoid(a), b),
                 "BCEWithLogitsLoss"),
                (nn.BCELoss(), "BCEWithLogitsLoss"),
                (lambda a, b: F.binary_cross_entropy_with_logits(
                    a, b, pos_weight=torch.ones(4)), "with pos_weight"),
                (nn.BCEWithLogitsLoss(weight=torch.ones(4)), "with weight"),
                (lambda a, b: F.kl_div(a, b), "log_target=False"),
                (nn.KLDivLoss(reduction="batchmean"), "log_target=False"),
                (lambda a, b: F.softplus(a, beta=-1.0),
                 "softplus with beta=-1.0"),
                (lambda a, b: F.smooth_l1_loss(a, b, beta=float("inf")),
                 "smooth_l1_loss with beta=inf")):
            with self.subTest(needle=needle):
                self.assert_refused(Loss(f, 4), {"x": x, "y": y}, needle)


if __name__ == "__main__":
    U.main("export_activations_losses_test")
