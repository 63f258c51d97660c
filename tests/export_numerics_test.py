"""tools/export_fx.py on models it claims to support but exported wrongly:
each case exports, validates with `hapctl validate`, and gives PyTorch's
loss (and, where the defect was in training, PyTorch's gradients) with the
reference evaluator tests/hap_ir_eval.py, or fails naming the node, its
target and its place in the model. nn.Embedding's padding_idx also trains
one step on 2 ranks from the --weights file, equal to PyTorch's SGD step."""

import os
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402
import hap_ir_eval  # noqa: E402

EXECUTOR = os.environ.get("HAP_EXECUTOR")
LAUNCH = os.environ.get("HAP_LAUNCH")
CPU_CLUSTER = os.environ.get("CPU_CLUSTER")


def labels(n, hi):
    return torch.randint(0, hi, (n,))


class DivideByBuffer(nn.Module):
    """x / buffer (a per-feature temperature): the IR has no div op."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("temperature", torch.full((3,), 2.5))

    def forward(self, x, labels):
        h = self.fc(x) / self.temperature
        h = h / torch.tensor([4.0, 4.0, 4.0]) + torch.div(h, 0.5)
        return F.cross_entropy(h, labels)


class NoAffineNorms(nn.Module):
    """LayerNorm and BatchNorm without affine parameters: their weight and
    bias are exporter constants, which were float32 in any model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6, elementwise_affine=False)
        self.bn = nn.BatchNorm1d(6, affine=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(self.bn(self.ln(self.fc(x))) + 1),
                               labels)


class KeywordArguments(nn.Module):
    """Arguments passed by keyword: the loss module's and nn.Embedding's
    were IndexError tracebacks, x.permute(dims=...) was exported as the
    identity (a wrong loss), x.matmul(other=...) an IndexError."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.w = nn.Parameter(torch.randn(3, 3))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, ids, labels):
        h = self.emb(input=ids).sum(1)  # [3, 3]
        h = h.permute(dims=(1, 0)).matmul(other=self.w)
        return self.loss(input=h, target=labels)


class PaddedEmbedding(nn.Module):
    """nn.Embedding and F.embedding with padding_idx: PyTorch gives that
    row no gradient; the export trained it."""

    def __init__(self, pad=2, fn_pad=-1):
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=pad)
        self.table = nn.Parameter(torch.randn(10, 4))
        with torch.no_grad():
            self.table[fn_pad].zero_()
        self.fn_pad = fn_pad
        self.fc = nn.Linear(4, 3)

    def forward(self, ids, labels):
        h = self.emb(ids) + F.embedding(ids, self.table,
                                        padding_idx=self.fn_pad)
        return F.cross_entropy(self.fc(h.mean(1)), labels)


class CausalSelfAttention(nn.Module):
    """minGPT's attention: one c_attn linear split into q, k, v, a causal
    mask buffer applied with masked_fill."""

    def __init__(self, e, heads, s):
        super().__init__()
        self.c_attn = nn.Linear(e, 3 * e)
        self.c_proj = nn.Linear(e, e)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(s, s))
                             .view(1, 1, s, s))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous()
        return self.c_proj(y.view(b, t, c))


class PositionIdsGpt(nn.Module):
    """A GPT whose position ids are arange(T).unsqueeze(0) ([1, T], as
    minGPT and Hugging Face's GPT-2 make them): that embedding failed
    ('constant indices other than arange(n)'); head tied to wte."""

    def __init__(self, vocab=20, e=16, heads=2, s=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, e)
        self.wpe = nn.Embedding(s, e)
        self.ln1 = nn.LayerNorm(e)
        self.attn = CausalSelfAttention(e, heads, s)
        self.ln2 = nn.LayerNorm(e)
        self.mlp = nn.Sequential(nn.Linear(e, 4 * e), nn.GELU(),
                                 nn.Linear(4 * e, e))
        self.ln_f = nn.LayerNorm(e)
        self.head = nn.Linear(e, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)),
                               targets.view(-1))


def padded_inputs(m, gen=None):
    ids = torch.randint(0, 10, (4, 5), generator=gen)
    ids[:, 0] = m.emb.padding_idx
    ids[:, 1] = m.fn_pad % 10
    return {"ids": ids, "labels": torch.randint(0, 3, (4,), generator=gen)}


class ExportNumericsTest(ExportTestCase):
    def test_division_by_a_constant_tensor(self):
        """A 'div' op (not in the IR) was emitted for x / tensor, and
        `hapctl validate` refused the graph; x / 0 was a ZeroDivisionError
        traceback."""
        m = DivideByBuffer()
        g, _ = self.assert_loss_and_gradients(
            m, {"x": torch.randn(5, 4), "labels": labels(5, 3)})
        self.assertNotIn("div", {op["type"] for op in g["ops"]})

        class ByZero(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x) / 0, labels)

        class ByZeros(ByZero):
            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x) / torch.zeros(3), labels)

        class ByVarying(ByZero):
            def __init__(self):
                super().__init__()
                self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x) / self.scale, labels)

        # By unequal values: times their reciprocals, a VALUES constant.
        g, _ = self.assert_loss_and_gradients(
            ByVarying(), {"x": torch.randn(5, 4), "labels": labels(5, 3)})
        self.assertEqual([p["init"]["values"] for p in g["parameters"]
                          if p["init"]["kind"] == "VALUES"],
                         [torch.tensor([1.0, 0.5, 1.0 / 3.0]).tolist()])
        for mod, needle in ((ByZero(), "divides by the constant 0"),
                            (ByZeros(), "constant tensor holding 0")):
            with self.subTest(module=type(mod).__name__):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, {"x": torch.randn(2, 4),
                                           "labels": labels(2, 3)})
                self.assertIn("node 'truediv'", str(cm.exception))
                self.assertIn(needle, str(cm.exception))

    def test_models_in_other_dtypes_keep_their_dtype_in_constants(self):
        """A bf16, fp16 or float64 model with a LayerNorm or BatchNorm
        without affine parameters exported float32 gamma/beta, and `hapctl
        validate` refused the graph (mixed dtypes); its constants' values
        were float32 too."""
        for dt, ir in ((torch.bfloat16, "BFLOAT16"), (torch.float16, "FLOAT16"),
                       (torch.float64, "FLOAT64")):
            with self.subTest(dtype=dt):
                m = NoAffineNorms().to(dt)
                inputs = {"x": torch.randn(5, 4, dtype=dt),
                          "labels": labels(5, 3)}
                g, values = self.export_valid(m, inputs)
                for p in g["parameters"]:
                    self.assertEqual(p["tensor"]["dtype"], ir,
                                     p["tensor"]["name"])
                    self.assertEqual(values[p["tensor"]["name"]].dtype, dt,
                                     p["tensor"]["name"])
        m = NoAffineNorms().double()
        self.assert_loss_and_gradients(
            m, {"x": torch.randn(5, 4, dtype=torch.float64),
                "labels": labels(5, 3)}, tol=1e-9)

    def test_arguments_by_keyword(self):
        m = KeywordArguments()
        g, _ = self.assert_loss_and_gradients(
            m, {"ids": torch.randint(0, 7, (3, 4)), "labels": labels(3, 3)})
        self.assertIn("transpose", [op["type"] for op in g["ops"]])

        class BadPermute(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x).permute(0, 0), labels)

        with self.assertRaises(export_fx.ExportError) as cm:
            # PyTorch's own permute fails first on a bad permutation, so
            # the handler is called as for a traced x.permute(0, 0).
            with mock.patch.object(torch.Tensor, "permute",
                                   lambda self, *d: self):
                export_fx.export(BadPermute(), {"x": torch.randn(3, 4),
                                                "labels": labels(3, 3)})
        self.assertIn("not a permutation", str(cm.exception))

    def test_embedding_padding_idx_gets_no_gradient(self):
        for pad, fn_pad in ((2, -1), (0, 9), (9, 0)):
            with self.subTest(padding_idx=pad):
                m = PaddedEmbedding(pad, fn_pad)
                g, _ = self.assert_loss_and_gradients(m, padded_inputs(m))
                self.assertEqual(float(m.emb.weight.grad[pad].abs().sum()), 0)
        # What the IR cannot hold is refused, naming the node.
        m = PaddedEmbedding()
        with torch.no_grad():
            m.emb.weight[2].fill_(0.5)
        freq = PaddedEmbedding()
        freq.emb.scale_grad_by_freq = True
        for mod, needle in ((m, "padding row is not zero"),
                            (freq, "scale_grad_by_freq=True")):
            with self.subTest(module=needle):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, padded_inputs(mod))
                self.assertIn("node 'emb'", str(cm.exception))
                self.assertIn(needle, str(cm.exception))
        # F.embedding's table as a parameter is checked too; a computed
        # table (whose padding row PyTorch outputs) is refused.
        fn_row = PaddedEmbedding()
        with torch.no_grad():
            fn_row.table[-1].fill_(1.0)

        class Computed(PaddedEmbedding):
            def forward(self, ids, labels):
                h = F.embedding(ids, self.table * 2, padding_idx=0)
                return F.cross_entropy(self.fc(h.mean(1)), labels)

        for mod, needle in ((fn_row, "padding row is not zero"),
                            (Computed(), "of a computed table")):
            with self.subTest(module=needle):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, padded_inputs(mod))
                self.assertIn("node 'embedding'", str(cm.exception))
                self.assertIn(needle, str(cm.exception))

    def test_embedding_padding_idx_trains_like_pytorch_on_two_ranks(self):
        """One SGD step on 2 ranks from the --weights file: every
        parameter moves as PyTorch's step moves it, the padding row not
        at all (it moved by the learning rate times its gradient)."""
        if not (EXECUTOR and LAUNCH and CPU_CLUSTER):
            self.skipTest("HAP_EXECUTOR, HAP_LAUNCH, CPU_CLUSTER not given")
        lr = 0.5
        m = PaddedEmbedding().double()
        inputs = padded_inputs(m, torch.Generator().manual_seed(3))
        m.zero_grad()
        loss = m(**inputs)
        loss.backward()
        got, start, after = U.one_sgd_step(m, inputs, lr, LAUNCH, EXECUTOR,
                                           CPU_CLUSTER)
        self.assertAlmostEqual(got, float(loss), delta=1e-5)
        for name, param in m.named_parameters():
            grad = (start[name] - after[name]) / lr
            err = float((grad - param.grad).abs().max())
            self.assertLessEqual(err, 1e-9, f"{name}: gradient off by {err}")
        self.assertTrue(torch.equal(after["emb.weight"][2],
                                    start["emb.weight"][2]))

    def test_position_ids_with_a_batch_dimension_of_one(self):
        m = PositionIdsGpt()
        g, _ = self.assert_loss_and_gradients(
            m, {"idx": torch.randint(0, 20, (2, 6)),
                "targets": torch.randint(0, 20, (2, 6))})
        # The first 6 rows of wpe, as [1, 6, 16]; one causal softmax.
        self.assertIn({"axis": {"i": 0}, "start": {"i": 0}, "end": {"i": 6}},
                      [op.get("attrs") for op in g["ops"]
                       if op["type"] == "slice"])
        self.assertEqual(len([op for op in g["ops"] if op["type"] == "softmax"
                              and op["attrs"]["causal"] == {"b": True}]), 1)

    def test_a_parameter_with_infinite_values_fails_naming_it(self):
        """Its fitted initialiser was NORMAL(-inf, nan), written as
        -Infinity/NaN: a graph file that did not parse (exit status 0)."""
        class InfBias(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.bias2 = nn.Parameter(torch.tensor([0.0, -float("inf"),
                                                        1.0]))

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x) + self.bias2, labels)

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(InfBias(), {"x": torch.randn(2, 4),
                                         "labels": labels(2, 3)})
        self.assertIn("parameter 'bias2' holds non-finite values",
                      str(cm.exception))

    def test_lstm_shapes_on_meta_tensors(self):
        """--run-on meta failed on nn.LSTM ('Input and parameter tensors
        are not at the same device'), so a float16 model with one, which
        PyTorch cannot run on the CPU, could not be exported at all."""
        class Tagger(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 8)
                self.lstm = nn.LSTM(8, 6, num_layers=2, bidirectional=True)
                self.head = nn.Linear(12, 3)

            def forward(self, ids, labels):
                h, (h_n, _) = self.lstm(self.emb(ids).transpose(0, 1))
                return F.cross_entropy(self.head(h[-1]) + h_n.sum(), labels)

        inputs = {"ids": torch.randint(0, 10, (4, 5)), "labels": labels(4, 3)}
        on_cpu = export_fx.export(Tagger(), inputs, run_on="cpu")
        on_meta = export_fx.export(Tagger(), inputs, run_on="meta")
        self.assertEqual(on_meta["ops"], on_cpu["ops"])
        self.assertEqual(on_meta["value_info"], on_cpu["value_info"])
        g, _ = self.export_valid(Tagger().half(), inputs)
        self.assertEqual({p["tensor"]["dtype"] for p in g["parameters"]},
                         {"FLOAT16"})

    def test_dropout_of_every_element(self):
        """nn.Dropout(1.0) became a dropout op with p=1, which `hapctl
        validate` refuses ('must be in [0, 1)'); PyTorch gives zeros."""
        class AllDropped(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.drop = nn.Dropout(1.0)
                self.skip = nn.Linear(4, 3)

            def forward(self, x, labels):
                h = self.drop(self.fc(x)) + F.dropout(self.skip(x), 1.0)
                return F.cross_entropy(h + self.skip(x), labels)

        m = AllDropped()
        inputs = {"x": torch.randn(3, 4), "labels": labels(3, 3)}
        g, values = self.export_valid(m, inputs)
        self.assertNotIn("dropout", {op["type"] for op in g["ops"]})
        with torch.no_grad():  # PyTorch's training-mode forward
            self.assertAlmostEqual(float(m.train()(**inputs)),
                                   float(hap_ir_eval.evaluate(g, inputs,
                                                              values)),
                                   delta=1e-6)

    def test_values_the_ir_refuses_fail_naming_them(self):
        """eps=0 (PyTorch allows it), a multiplication by inf and a
        division by a subnormal number exported graphs that `hapctl
        validate` refused ('eps' must be positive, 'factor' must be
        finite), exit status 0."""
        def net(body):
            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(4, 3)
                    self.ln = nn.LayerNorm(3, eps=0.0)
                    self.bn = nn.BatchNorm1d(3, eps=0.0)

                def forward(self, x, labels):
                    return F.cross_entropy(body(self, self.fc(x)), labels)
            return Net()

        for body, needle in (
                (lambda s, h: s.ln(h), "eps=0.0 is not supported"),
                (lambda s, h: s.bn(h), "eps=0.0 is not supported"),
                (lambda s, h: F.layer_norm(h, (3,), s.ln.weight, s.ln.bias,
                                           0.0), "eps=0.0 is not supported"),
                (lambda s, h: h * float("inf"), "non-finite constant"),
                (lambda s, h: h / 1e-320, "non-finite constant")):
            with self.subTest(needle=needle):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(net(body), {"x": torch.randn(3, 4),
                                                 "labels": labels(3, 3)})
                self.assertIn(needle, str(cm.exception))

    def test_integer_arithmetic_and_mixed_dtypes_fail_naming_them(self):
        """ids + 1, ids * 2, labels * 0.5, ids.sum(1) (integer tensors in
        arithmetic and reductions) and float32 + float64 (PyTorch's type
        promotion), in + or in cat,
        exported graphs that `hapctl validate` refused ('must be a
        floating-point tensor', 'must have the same dtype'), exit 0."""
        class Net(nn.Module):
            def __init__(self, body):
                super().__init__()
                self.emb = nn.Embedding(10, 4)
                self.fc = nn.Linear(4, 3)
                self.p64 = nn.Parameter(torch.randn(3, dtype=torch.float64))
                self.body = body

            def forward(self, ids, labels):
                return F.cross_entropy(self.body(self, ids, labels), labels)

        for body, needle in (
                (lambda s, ids, y: s.fc(s.emb(ids + 1).sum(1)),
                 "node 'add' (call_function operator.add): add of the "
                 "integer tensor 'ids'"),
                (lambda s, ids, y: s.fc(s.emb(ids * 2).sum(1)),
                 "integer tensor 'ids'"),
                (lambda s, ids, y: s.fc(s.emb(ids).sum(1)) - y[:, None] * 0.5,
                 "integer tensor"),
                (lambda s, ids, y: s.fc(s.emb(ids).sum(1)) + s.p64,
                 "add mixes the dtypes FLOAT32 and FLOAT64"),
                # A reduction: every op's operands are checked, not only
                # arithmetic's.
                (lambda s, ids, y: s.fc(s.emb(ids.sum(1))),
                 "sum of the integer tensor 'ids'"),
                (lambda s, ids, y: torch.cat([s.fc(s.emb(ids).sum(1)),
                                              s.p64.expand(4, 3)], 1)[:, :3],
                 "cat mixes the dtypes FLOAT32 and FLOAT64")):
            with self.subTest(needle=needle):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(Net(body), {
                        "ids": torch.randint(1, 9, (4, 2)),
                        "labels": labels(4, 3)})
                self.assertIn(needle, str(cm.exception))

    def test_exporting_on_the_cpu_leaves_the_module_as_it_was(self):
        """The shape run on the example inputs (run_on='cpu', and 'auto'
        where meta tensors fail) is a training-mode forward of the module
        itself: it moved BatchNorm's running statistics and counter, which
        --weights then wrote, and drew dropout masks from the caller's
        random stream."""
        class BnDrop(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.bn = nn.BatchNorm1d(3)
                self.drop = nn.Dropout(0.5)

            def forward(self, x, labels):
                return F.cross_entropy(self.drop(self.bn(self.fc(x))), labels)

        m = BnDrop()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        inputs = {"x": torch.randn(5, 4) * 3 + 1, "labels": labels(5, 3)}
        rng = torch.random.get_rng_state()
        g, values = export_fx.export(m, inputs, run_on="cpu",
                                     return_values=True)
        self.assertTrue(torch.equal(torch.random.get_rng_state(), rng))
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        w = export_fx.state_dict_weights(g, values)
        self.assertEqual(set(w), set(before))
        for k, v in w.items():
            self.assertTrue(torch.equal(v, before[k]), k)

    def test_loss_function_passes_inputs_by_name(self):
        """export(..., loss=fn) called the module with its inputs by
        position: an optional argument left out before a given one
        (forward(x, scale=None, shift=None) with x and shift) received the
        next input (shift as scale: a wrong loss); input names that are not
        identifiers were a SyntaxError traceback."""
        class Optional(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x, scale=None, shift=None):
                h = self.fc(x)
                if scale is not None:
                    h = h * scale
                if shift is not None:
                    h = h + shift
                return h

        m = Optional()
        inputs = {"x": torch.randn(3, 4), "shift": torch.randn(3, 3),
                  "labels": labels(3, 3)}
        g, values = export_fx.export(m, inputs, loss=nn.CrossEntropyLoss(),
                                     return_values=True)
        with torch.no_grad():
            ref = F.cross_entropy(m(inputs["x"], shift=inputs["shift"]),
                                  inputs["labels"])
            got = hap_ir_eval.evaluate(g, inputs, values)
        self.assertAlmostEqual(float(ref), float(got), delta=1e-6)
        for name, needle in (("input-ids", "cannot name a forward argument"),
                             ("lambda", "cannot name a forward argument"),
                             ("extra", "['extra'] are not arguments of "
                                       "Optional.forward")):
            with self.subTest(name=name):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(m, {"x": torch.randn(3, 4),
                                         name: torch.randn(3, 3),
                                         "labels": labels(3, 3)},
                                     loss=nn.CrossEntropyLoss())
                self.assertIn(needle, str(cm.exception))

    def test_integer_constant_tensors_with_float_tensors(self):
        """x * an integer (or bool) constant tensor: PyTorch computes in x's
        dtype; the constant became an INT64 parameter, which `hapctl
        validate` refused."""
        class IntConstants(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.register_buffer("k", torch.full((3,), 2,
                                                     dtype=torch.long))
                self.register_buffer("on", torch.ones(3, dtype=torch.bool))

            def forward(self, x, labels):
                h = self.fc(x) * self.k + self.on
                h = h - torch.ones(3, dtype=torch.int32) * 3
                return F.cross_entropy(h, labels)

        m = IntConstants()
        g, values = self.assert_loss_and_gradients(
            m, {"x": torch.randn(5, 4), "labels": labels(5, 3)})
        # --weights still restores the module's buffers (folded, recorded).
        IntConstants().load_state_dict(
            export_fx.state_dict_weights(g, values), strict=True)

    def test_unbatched_conv2d_fails_naming_it(self):
        """PyTorch takes an unbatched [C, H, W] input; the exporter emitted
        a conv2d that `hapctl validate` refused."""
        class Unbatched(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(4, 3, 1)

            def forward(self, x, labels):
                return F.cross_entropy(self.conv(x).mean(-1), labels)

        with self.assertRaises(export_fx.ExportError) as cm:
            export_fx.export(Unbatched(), {"x": torch.randn(4, 5, 6),
                                           "labels": labels(3, 6)})
        self.assertIn("node 'conv'", str(cm.exception))
        self.assertIn("NCHW (rank-4) input, got [4, 5, 6]", str(cm.exception))

    def test_an_unforeseen_error_names_the_node_and_its_place(self):
        """An exception a handler did not foresee (here made to happen) was
        a Python traceback naming neither the node nor where it is."""
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return torch.tanh(self.fc(x))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.Sequential(Block(), Block())
                self.head = nn.Linear(4, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.head(self.blocks(x)), labels)

        from fx_export import registry  # noqa: PLC0415

        def broken(ex, call):
            raise IndexError("tuple index out of range")

        with mock.patch.dict(registry._FUNCTIONS, {torch.tanh: broken}):
            with self.assertRaises(export_fx.ExportError) as cm:
                export_fx.export(Net(), {"x": torch.randn(2, 4),
                                         "labels": labels(2, 3)})
        msg = str(cm.exception)
        self.assertIn("node 'tanh' (call_function torch.tanh) in blocks.0",
                      msg)
        self.assertIn("IndexError: tuple index out of range", msg)


if __name__ == "__main__":
    U.main("export_numerics_test")
