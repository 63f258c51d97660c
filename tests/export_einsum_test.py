"""torch.einsum through tools/export_fx.py: decomposed into matmuls,
broadcasting muls, sums and layout ops (tools/fx_export/ops_linear.py).
Each equation exports, validates with `hapctl validate`, and gives
PyTorch's loss and parameter gradients in float64 with the reference
evaluator (tests/hap_ir_eval.py), diagonals ('ii->i', traces) included. An
attention block written with einsum trains one SGD step on 2 ranks as
PyTorch's step."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402

EXECUTOR = os.environ.get("HAP_EXECUTOR")
LAUNCH = os.environ.get("HAP_LAUNCH")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")


class Einsum(nn.Module):
    """torch.einsum(equation, x, *weights) with the input x and parameters
    of the given shapes; the loss weighs each element of the result by a
    parameter of its shape, so that every element's gradient differs.
    `form`: "args" (einsum(eq, x, w)), "list" (einsum(eq, [x, w])) or
    "sublist" (einsum(x, [0, 1], w, [1, 2], [0, 2]))."""

    def __init__(self, equation, x_shape, shapes, form="args"):
        super().__init__()
        self.equation, self.form = equation, form
        self.ws = nn.ParameterList(
            [nn.Parameter(torch.randn(*s)) for s in shapes])
        with torch.no_grad():
            out = self.einsum(torch.randn(*x_shape))
        self.probe = nn.Parameter(torch.randn(out.shape))

    def einsum(self, x):
        operands = [x] + list(self.ws)
        if self.form == "list":
            return torch.einsum(self.equation, operands)
        if self.form == "sublist":
            lhs, _, rhs = self.equation.partition("->")
            args = []
            for t, term in zip(operands, lhs.split(",")):
                args += [t, [ord(c) - ord("a") + 26 for c in term]]
            return torch.einsum(*args, [ord(c) - ord("a") + 26 for c in rhs])
        return torch.einsum(self.equation, *operands)

    def forward(self, x):
        return (self.einsum(x) * self.probe).sum()


# (equation, x's shape, the weights' shapes)
EQUATIONS = [
    # attention scores and weighted values (maxvit's, with spaces)
    ("bhid,bhjd->bhij", (2, 3, 4, 5), [(2, 3, 6, 5)]),
    ("bhij,bhjd->bhid", (2, 3, 4, 6), [(2, 3, 6, 5)]),
    ("B G H I D, B G H J D -> B G H I J", (2, 2, 3, 4, 5), [(2, 2, 3, 6, 5)]),
    ("bi,ij->bj", (4, 3), [(3, 5)]),  # bilinear
    ("bti,ij->btj", (2, 3, 4), [(4, 5)]),
    ("bij,bjk", (2, 3, 4), [(2, 4, 5)]),  # implicit: 'ik', b and j summed
    ("bn,nd", (2, 3), [(3, 4)]),  # implicit: 'bd'
    ("ia,jB", (2, 3), [(4, 5)]),  # implicit: 'Bj', upper case first
    ("ij,jk,kl->il", (2, 3), [(3, 4), (4, 5)]),
    ("bi,bi->b", (4, 3), [(4, 3)]),  # batched dot
    ("i,j->ij", (3,), [(4,)]),  # outer product: a broadcasting mul
    ("bij,bij->bij", (2, 3, 4), [(2, 3, 4)]),
    ("bij,bjk->bik", (2, 3, 4), [(1, 4, 5)]),  # b broadcast from size 1
    ("bij,bjk->bik", (2, 3, 4), [(2, 1, 5)]),  # j broadcast: a sum of x
    ("ijk,ikl->jl", (2, 3, 4), [(2, 4, 5)]),
    ("...ij,...jk->...ik", (2, 3, 4), [(7, 1, 4, 5)]),
    ("...ij,jk", (2, 6, 3, 4), [(4, 5)]),  # implicit: '...ik'
    ("i...,j...->...ij", (3, 6), [(4, 6)]),
    ("...i,...i->i", (2, 3), [(2, 3)]),  # '...' summed (not in the output)
    ("ij->ji", (2, 3), []),
    ("ijk->kj", (2, 3, 4), []),
    ("ij->", (2, 3), []),
    ("ab,cd->", (2, 3), [(4, 5)]),
    # diagonals: a letter repeated in one operand
    ("ii->i", (3, 3), []),
    ("ii", (3, 3), []),  # implicit: the trace
    ("bii", (2, 3, 3), []),  # implicit: 'b', a batched trace
    ("iji->j", (3, 2, 3), []),
    ("bi,bjj->bi", (2, 3), [(2, 4, 4)]),
    ("bii,bij->bj", (2, 3, 3), [(2, 3, 4)]),
    ("iij,jj->ij", (3, 3, 4), [(4, 4)]),
    ("iii->i", (3, 3, 3), []),
]


def einsum_ops(g):
    """The types of the ops the einsum node became."""
    return [op["type"] for op in g["ops"] if op["name"].startswith("einsum")]


class ExportEinsumTest(ExportTestCase):
    def test_equations_give_pytorchs_loss_and_gradients(self):
        for equation, x_shape, shapes in EQUATIONS:
            with self.subTest(equation=equation):
                torch.manual_seed(1)
                m = Einsum(equation, x_shape, shapes).double()
                self.assert_loss_and_gradients(
                    m, {"x": torch.randn(*x_shape, dtype=torch.float64)},
                    tol=1e-10)

    def test_list_and_sublist_forms(self):
        for form in ("list", "sublist"):
            with self.subTest(form=form):
                m = Einsum("bij,jk->bki", (2, 3, 4), [(4, 5)], form).double()
                self.assert_loss_and_gradients(
                    m, {"x": torch.randn(2, 3, 4, dtype=torch.float64)},
                    tol=1e-10)

    def test_attention_equations_are_one_matmul(self):
        """The scores are a transpose of the keys and a matmul, the
        weighted values a matmul: no sums, no reshapes."""
        cases = [("bhid,bhjd->bhij", (2, 3, 4, 5), (2, 3, 6, 5),
                  ["transpose", "matmul"]),
                 ("bhij,bhjd->bhid", (2, 3, 4, 6), (2, 3, 6, 5), ["matmul"]),
                 ("bi,ij->bj", (4, 3), (3, 5), ["matmul"]),
                 ("bti,ij->btj", (2, 3, 4), (4, 5), ["matmul"]),
                 ("i,j->ij", (3,), (4,), ["reshape", "reshape", "mul"])]
        for equation, x_shape, w_shape, ops in cases:
            with self.subTest(equation=equation):
                g, _ = self.export_valid(Einsum(equation, x_shape, [w_shape]),
                                         {"x": torch.randn(*x_shape)})
                self.assertEqual(einsum_ops(g), ops)

    def test_a_diagonal_is_a_mul_by_the_identity_and_a_sum(self):
        g, _ = self.export_valid(Einsum("bii->bi", (2, 3, 3), []),
                                 {"x": torch.randn(2, 3, 3)})
        self.assertEqual(einsum_ops(g), ["mul", "sum"])
        eye = [p for p in g["parameters"]
               if p["tensor"]["name"].startswith("const.einsum")]
        self.assertEqual(len(eye), 1)
        self.assertTrue(eye[0]["frozen"])
        self.assertEqual(eye[0]["tensor"]["shape"], [1, 3, 3])
        self.assertEqual(eye[0]["init"], {"kind": "VALUES",
                                          "values": [1.0, 0.0] * 2 + [1.0],
                                          "counts": [1, 3, 1, 3, 1]})

    def test_a_diagonal_of_unequal_sizes_fails_naming_the_equation(self):
        m = Einsum("ii->i", (3, 3), [])
        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(m, {"x": torch.randn(3, 4)})
        msg = str(cm.exception)
        self.assertIn("node 'einsum'", msg)
        self.assertIn("subscript i is repeated for operand 0", msg)

    def test_attention_block_trains_like_pytorch_on_two_ranks(self):
        """One SGD step on 2 ranks (data parallel) from the --weights file
        of a self-attention block written with einsum: the loss and every
        parameter's update are PyTorch's (the executor's matmul, transpose
        and reshape kernels and their gradients)."""
        if not (EXECUTOR and LAUNCH and CPU_CLUSTER):
            self.skipTest("HAP_EXECUTOR, HAP_LAUNCH, CPU_CLUSTER not given")

        class Attention(nn.Module):
            def __init__(self, e=8, heads=2):
                super().__init__()
                self.qkv, self.out = nn.Linear(e, 3 * e), nn.Linear(e, e)
                self.heads, self.head = heads, nn.Linear(e, 3)

            def forward(self, x, labels):
                b, s, e = x.shape
                q, k, v = self.qkv(x).chunk(3, dim=-1)
                q = q.reshape(b, s, self.heads, -1)
                k = k.reshape(b, s, self.heads, -1)
                v = v.reshape(b, s, self.heads, -1)
                att = torch.einsum("bihd,bjhd->bhij", q, k) * 0.5
                y = torch.einsum("bhij,bjhd->bihd", att.softmax(-1), v)
                y = self.out(y.reshape(b, s, e)).mean(1)
                return F.cross_entropy(self.head(y), labels)

        lr = 0.5
        m = Attention().double()
        g = torch.Generator().manual_seed(3)
        inputs = {"x": torch.randn(4, 5, 8, generator=g, dtype=torch.float64),
                  "labels": torch.randint(0, 3, (4,), generator=g)}
        m.zero_grad()
        loss = m(**inputs)
        loss.backward()
        got, start, after = U.one_sgd_step(m, inputs, lr, LAUNCH, EXECUTOR,
                                           CPU_CLUSTER)
        self.assertAlmostEqual(got, float(loss), delta=1e-6)  # as logged
        for name, param in m.named_parameters():
            grad = (start[name] - after[name]) / lr
            err = float((grad - param.grad).abs().max())
            self.assertLessEqual(err, 1e-9, f"{name}: gradient off by {err}")


if __name__ == "__main__":
    U.main("export_einsum_test")
