"""tools/export_fx.py on reductions and shape functions the IR has no op
for, exported as compositions of its ops: var and std (var_mean,
std_mean), the 1- and 2-norms, logsumexp, cumsum, tril and triu,
masked_fill and torch.where with a condition known at export, repeat,
outer (ger), addmm and baddbmm, flip (fliplr, flipud). Each function and
method form exports, validates with `hapctl validate`, and its loss and
parameter gradients through the reference evaluator (tests/hap_ir_eval.py)
equal PyTorch's in float64; what stays unsupported is refused naming
why."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402


def weighted_sum(terms):
    """One number from every element of `terms`: each element weighed by
    its own weight (1 to 2 along the flattened term, so that a reversed
    or moved element changes it), the k-th term by 0.1 k (the first by 1)
    so that each term's gradient differs."""
    total = 0.0
    for k, t in enumerate(terms):
        w = torch.linspace(1.0, 2.0, t.numel(), dtype=t.dtype)
        total = total + (t * w.reshape(t.shape)).sum() * (0.1 * k if k
                                                          else 1.0)
    return total


class Terms(nn.Module):
    """weighted_sum of `f`(h, h3, self) for h = fc(x) [3, 6] and h3 = h
    viewed [3, 2, 3], both of both signs."""

    def __init__(self, f):
        super().__init__()
        self.f = f
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        return weighted_sum(self.f(h, h.view(3, 2, 3), self))


class Refused(nn.Module):
    """f(fc(x)).sum(), for the refusals."""

    def __init__(self, f, width=6):
        super().__init__()
        self.f = f
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.f(self.fc(x)).sum()


class ExportReductionsShapesTest(ExportTestCase):
    def check(self, f, seed=0, module=None):
        """f's terms export with PyTorch's loss and gradients (float64);
        the graph."""
        torch.manual_seed(seed)
        m = (module or Terms(f)).double()
        x = torch.randn(3, 6, dtype=torch.float64)
        g, _ = self.assert_loss_and_gradients(m, {"x": x}, tol=1e-9)
        return g

    def assert_refused(self, f, needles, width=6, inputs=None):
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Refused(f, width) if not isinstance(f, nn.Module)
                             else f,
                             inputs or {"x": torch.randn(2, width)})
        for needle in needles:
            self.assertIn(needle, str(cm.exception))

    def test_var_and_std(self):
        """torch.var/std, Tensor.var/std, var_mean and std_mean over dims
        (negative, several, all) with unbiased, correction and keepdim:
        mean((x - mean x)^2) * n / (n - correction), std its sqrt."""

        def f(h, h3, m):
            var_mean = torch.var_mean(h, 1)
            std_mean = torch.std_mean(h3, (0, -1), keepdim=True)
            return [torch.var(h, 1), h.var(-1, keepdim=True),
                    torch.var(h3, dim=(0, 2)), torch.var(h, unbiased=False),
                    torch.var(h, False), h.var(), torch.var(h, 0, True, True),
                    torch.var(h, 1, correction=0),
                    torch.var(h, dim=-1, correction=2, keepdim=True),
                    h3.var(dim=[-2], unbiased=False, keepdim=True),
                    torch.std(h, -1), h.std(0, keepdim=True, unbiased=False),
                    torch.std(h3, (1, 2)), h.std(), var_mean[0],
                    var_mean[1], std_mean[0], std_mean[1],
                    torch.std_mean(h, unbiased=False)[0]]

        g = self.check(f, seed=1)
        self.assertTrue({"mean", "sum", "exp", "log"} <=
                        {op["type"] for op in g["ops"]})
        self.assert_refused(lambda h: h[:, :1].var(1),
                            ["var of 1 element(s) with correction 1",
                             "divides by 0"])

    def test_norms(self):
        """torch.norm, Tensor.norm and torch.linalg.vector_norm with p=2
        ('fro', the default) and p=1 over dims, keepdim both ways: sqrt(sum
        x*x) and sum(relu(x) + relu(-x)); other p refused by name."""

        def f(h, h3, m):
            return [torch.norm(h), torch.norm(h, dim=1),
                    h.norm(dim=-1, keepdim=True), h.norm(p=1, dim=0),
                    torch.norm(h, 1), torch.norm(h3, 2, (0, -1), True),
                    h.norm(2, 1), h.norm(p="fro", dim=(0, 1)),
                    torch.linalg.vector_norm(h3, dim=(0, 1)),
                    torch.linalg.vector_norm(h, ord=1, dim=-1, keepdim=True),
                    torch.linalg.vector_norm(h), h3.norm(p=1)]

        g = self.check(f, seed=2)
        self.assertIn("relu", {op["type"] for op in g["ops"]})
        for fn, needle in (
                (lambda h: h.norm(p=3, dim=1), "p=3 is not supported"),
                (lambda h: torch.norm(h, float("inf")),
                 "p=inf is not supported"),
                (lambda h: torch.linalg.vector_norm(h, 0), "p=0 is not"),
                (lambda h: torch.norm(h, "nuc"),
                 "p='nuc' (a matrix norm) is not supported")):
            with self.subTest(needle=needle):
                self.assert_refused(fn, [needle])

    def test_logsumexp(self):
        """torch.logsumexp and Tensor.logsumexp over one or several dims,
        keepdim both ways: x - log_softmax(x) at position 0 of the row,
        stable for large values (its gradient the softmax)."""

        def f(h, h3, m):
            big = h * 300.0  # exp overflows float64 past ~709
            return [torch.logsumexp(h, 1), h.logsumexp(-1, keepdim=True),
                    torch.logsumexp(h3, dim=(0, 2)),
                    torch.logsumexp(h, 0, True), torch.logsumexp(big, -1),
                    h3.logsumexp(-2), torch.logsumexp(h3, (1, -1), True)]

        g = self.check(f, seed=3)
        self.assertIn("log_softmax", {op["type"] for op in g["ops"]})

    def test_cumsum(self):
        """torch.cumsum and Tensor.cumsum over any dim (negative, of a
        vector): a matmul by a constant upper-triangular matrix of ones;
        dims over 4096 refused (the constant grows with the square)."""

        def f(h, h3, m):
            return [torch.cumsum(h, 1), h.cumsum(-1), h3.cumsum(0),
                    torch.cumsum(h[0], 0), h3.cumsum(dim=-2),
                    torch.cumsum(h, dim=0)]

        g = self.check(f, seed=4)
        self.assertIn("matmul", {op["type"] for op in g["ops"]})
        self.assert_refused(lambda h: h.cumsum(1),
                            ["Tensor.cumsum over a dim of 4097 elements",
                             "at most 4096"], width=4097)
        self.assert_refused(lambda h: h.cumsum(1, dtype=torch.float16),
                            ["dtype=torch.float16"])

    def test_tril_and_triu(self):
        """torch.tril/triu and their methods, with diagonals of both signs,
        of matrices and batches: a mul by a constant 0/1 mask."""

        def f(h, h3, m):
            return [torch.tril(h), h.triu(1), torch.triu(h3, diagonal=-1),
                    h.tril(-1), torch.tril(h3, 1), h3.triu(), h.tril(10)]

        self.check(f, seed=5)
        self.assert_refused(lambda h: torch.tril(h[0]),
                            ["torch.tril of a rank-1 tensor"])

    def test_masked_fill_and_where(self):
        """Tensor.masked_fill, torch.masked_fill, torch.where and
        Tensor.where with a condition known at export (a bool buffer, or
        one computed from constants) and finite fills: x * (1 - m) +
        value * m, a * m + b * (1 - m); numbers, tensors and constant
        tensors as a and b, conditions that broadcast."""

        class Masked(Terms):
            def __init__(self):
                super().__init__(None)
                self.register_buffer("m", torch.rand(3, 6) > 0.5)
                self.register_buffer("c", torch.linspace(-1.0, 1.0, 6))

            def forward(self, x):
                h = self.fc(x)
                even = torch.arange(6) % 2 == 0  # [6]: broadcasts
                return weighted_sum([
                    h.masked_fill(self.m, 2.5),
                    torch.masked_fill(h, even, -1.0),
                    h.masked_fill(self.m, -1e9),
                    torch.where(self.m, h, 0.5),
                    torch.where(even, 3.0, h),
                    torch.where(self.m, h, h * h),
                    h.where(self.m, -h),
                    torch.where(even, h, self.c),
                    torch.where(~self.m, self.c, h),
                    torch.where(self.m[0], h, 0.0)])

        self.check(None, seed=6, module=Masked())

        class InputMask(Refused):  # the mask an input
            def forward(self, x, mask):
                return self.f(self.fc(x), mask).sum()

        inputs = {"x": torch.randn(2, 6), "mask": torch.rand(2, 6) > 0.5}
        for f, needles in (
                (lambda h, m: torch.where(m, h, 0.0),
                 ["torch.where is supported only with a condition known at "
                  "export", "not one computed from the inputs"]),
                (lambda h, m: h.masked_fill(m, 0.0),
                 ["masked_fill is supported with a constant mask only"])):
            with self.subTest(needle=needles[0]):
                self.assert_refused(InputMask(f), needles, inputs=inputs)
        keep = torch.arange(6) % 2 == 0
        for f, needles in (
                (lambda h: torch.where(keep, h, float("nan")),
                 ["torch.where with the fill nan", "must be finite"]),
                (lambda h: torch.where(keep, h, float("-inf")),
                 ["torch.where with the fill -inf"]),
                (lambda h: h.masked_fill(keep, float("inf")),
                 ["masked_fill with inf is supported only as -inf"])):
            with self.subTest(needle=needles[0]):
                self.assert_refused(f, needles)

    def test_causal_masks_into_softmax(self):
        """minGPT's att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf) and
        its torch.where form before a softmax still give a causal softmax
        (no mask constant), with PyTorch's loss and gradients."""

        class Attention(nn.Module):
            def __init__(self, use_where):
                super().__init__()
                self.qk = nn.Linear(8, 16)
                self.use_where = use_where
                self.register_buffer("bias", torch.tril(torch.ones(6, 6))
                                     .view(1, 1, 6, 6))

            def forward(self, x):
                T = x.size(1)
                q, k = self.qk(x).view(2, T, 2, 8).transpose(1, 2).split(
                    4, dim=-1)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(4))
                if self.use_where:
                    att = torch.where(self.bias[:, :, :T, :T] == 1, att,
                                      float("-inf"))
                else:
                    att = att.masked_fill(self.bias[:, :, :T, :T] == 0,
                                          float("-inf"))
                att = F.softmax(att, dim=-1)
                return weighted_sum([att @ q])

        for use_where in (False, True):
            with self.subTest(use_where=use_where):
                torch.manual_seed(7)
                m = Attention(use_where).double()
                x = torch.randn(2, 5, 8, dtype=torch.float64)
                g, _ = self.assert_loss_and_gradients(m, {"x": x}, tol=1e-9)
                soft = [op for op in g["ops"] if op["type"] == "softmax"]
                self.assertEqual(len(soft), 1)
                self.assertTrue(soft[0]["attrs"]["causal"]["b"])
                self.assertEqual(len(soft[0]["inputs"]), 1)

    def test_repeat_outer_addmm_and_flip(self):
        """Tensor.repeat (extra leading dims too: a reshape, an expand, a
        reshape), torch.outer/ger and their methods (a broadcasting mul),
        torch.addmm/baddbmm and their methods with beta and alpha (a matmul,
        scales and an add; GPT-2's Conv1D), torch.flip, Tensor.flip,
        fliplr and flipud (a matmul by a constant anti-identity)."""

        class Products(Terms):
            def __init__(self):
                super().__init__(None)
                self.w = nn.Parameter(torch.randn(6, 4))
                self.b = nn.Parameter(torch.randn(4))
                self.b3 = nn.Parameter(torch.randn(3, 2, 2))

            def forward(self, x):
                h = self.fc(x)
                h3 = h.view(3, 2, 3)
                conv1d = torch.addmm(self.b, h.view(-1, h.size(-1)), self.w)
                return weighted_sum([
                    h.repeat(2, 1), h.repeat(2, 1, 3), h3.repeat((1, 2, 1)),
                    h.repeat(1, 1), torch.outer(h[0], h[1]),
                    torch.ger(h[1], h[2, :4]), h[0].outer(h[2]),
                    h[2].ger(h[0]), conv1d,
                    torch.addmm(self.b, h, self.w, beta=0.5, alpha=2.0),
                    torch.addmm(h[:, :4], h, self.w, beta=0.0),
                    h[:, :4].addmm(h, self.w, alpha=-1.0),
                    torch.baddbmm(self.b3, h3, h3.transpose(1, 2)),
                    self.b3.baddbmm(h3, h3.transpose(1, 2), beta=2.0,
                                    alpha=0.25),
                    torch.flip(h, [0, -1]), h.flip(1), h3.flip(0, 2),
                    h3.flip([-2]), torch.fliplr(h), torch.flipud(h),
                    h.fliplr(), h3.flipud()])

        g = self.check(None, seed=8, module=Products())
        self.assertIn("expand", {op["type"] for op in g["ops"]})
        for f, needles, width in (
                (lambda h: h.repeat(0, 1), ["ints >= 1"], 6),
                (lambda h: torch.addmm(h, h, h.t(), alpha=float("inf")),
                 ["torch.addmm's alpha inf is not a finite number"], 6),
                (lambda h: h.flip(1), ["Tensor.flip of a dim of 4097 "
                                       "elements", "at most 4096"], 4097)):
            with self.subTest(needle=needles[0]):
                self.assert_refused(f, needles, width=width)


if __name__ == "__main__":
    U.main("export_reductions_shapes_test")
