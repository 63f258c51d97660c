"""tools/export_fx.py: PyTorch modules exported with torch.fx load and
validate with `hapctl validate`, match the zoo exactly where they are the same
model, and compute the same loss as PyTorch (checked with the reference
evaluator tests/hap_ir_eval.py and the module's own weights)."""

import json
import os
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
import export_fx  # noqa: E402
import hap_ir_eval  # noqa: E402
import torch_models as M  # noqa: E402

MODELS_PY = os.path.join(U.HERE, "torch_models.py")
SUMMARY_KEYS = ("parameters", "trainable_parameters", "forward_flops",
                "training_flops", "ops", "op_types")


def labels(n, hi):
    return torch.randint(0, hi, (n,))


class ExportFxTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = U.tmpdir()
        cls.n = 0

    def setUp(self):
        torch.manual_seed(0)

    # ---- helpers -----------------------------------------------------------
    def path(self, stem):
        type(self).n += 1
        return os.path.join(self.dir, f"{stem}_{self.n}.json")

    def cli(self, module, inputs, kwargs=None, check=True, extra=()):
        out = self.path("cli")
        cmd = [U.PYTHON, U.EXPORT_FX, "--module", module, "-o", out]
        for spec in inputs:
            cmd += ["--input-shape", spec]
        if kwargs:
            cmd += ["--kwargs", json.dumps(kwargs)]
        cmd += list(extra)
        env = dict(os.environ, PYTHONPATH=U.HERE)
        import subprocess
        p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                           timeout=300)
        if check:
            self.assertEqual(p.returncode, 0, p.stderr)
        return out, p

    def export(self, module, inputs, **kw):
        g = export_fx.export(module, inputs, **kw)
        out = self.path(g["name"])
        with open(out, "w") as f:
            json.dump(g, f)
        return g, out

    def check_graph(self, g):
        """value_info covers every op output; names are unique."""
        outs = [o for op in g["ops"] for o in op["outputs"]]
        self.assertEqual(sorted(outs), sorted(v["name"] for v in g["value_info"]))
        names = ([i["tensor"]["name"] for i in g["inputs"]] +
                 [p["tensor"]["name"] for p in g["parameters"]] + outs)
        self.assertEqual(len(names), len(set(names)))
        self.assertIn(g["loss"], outs)

    def check_numerics(self, module, inputs, **kw):
        g, values = export_fx.export(module, inputs, return_values=True, **kw)
        self.assertEqual(sorted(values),
                         sorted(p["tensor"]["name"] for p in g["parameters"]))
        module.eval()
        with torch.no_grad():
            ref = module(**inputs).item()
            got = hap_ir_eval.evaluate(g, inputs, values).item()
        self.assertAlmostEqual(ref, got, delta=1e-5 * max(1.0, abs(ref)),
                               msg=f"{type(module).__name__}: torch {ref} vs "
                                   f"graph {got}")
        return ref, got

    def roles(self, g):
        return {i["tensor"]["name"]: i["role"] for i in g["inputs"]}

    def params(self, g):
        return {p["tensor"]["name"]: p for p in g["parameters"]}

    def assert_same_summary(self, got, want, what):
        for k in SUMMARY_KEYS:
            self.assertEqual(got[k], want[k], f"{what}: {k}")
        print(f"  {what}: parameters {got['parameters']}, forward_flops "
              f"{got['forward_flops']:.0f} (== zoo)")

    # ---- transformer encoder == zoo transformer -----------------------------
    def test_transformer_cli_matches_zoo(self):
        B, S, C = 8, 16, 10
        kw = dict(layers=2, hidden=64, heads=4, ffn=128, classes=C,
                  dropout=0.1)
        out, _ = self.cli(f"{MODELS_PY}:TorchTransformerClassifier",
                          [f"x={B},{S},64", f"labels={B}:int64:{C}"], kw)
        got = U.validate(out)
        want = U.zoo("transformer", layers=2, hidden=64, heads=4, ffn=128,
                     seq=S, batch=B, classes=C)
        self.assert_same_summary(got, want, "nn.TransformerEncoder 2x64")
        with open(out) as f:
            g = json.load(f)
        self.check_graph(g)
        self.assertEqual(self.roles(g), {"x": "FEATURES", "labels": "LABELS"})
        zg = U.zoo_graph("transformer", layers=2, hidden=64, heads=4, ffn=128,
                         seq=S, batch=B, classes=C)
        shapes = lambda gr: sorted(tuple(int(d) for d in p["tensor"]["shape"])
                                   for p in gr["parameters"])
        self.assertEqual(shapes(g), shapes(zg))
        # Names and PyTorch default initialisers.
        p = self.params(g)
        q = p["encoder.layers.0.self_attn.q.weight"]
        self.assertEqual(q["tensor"]["shape"], [64, 64])
        self.assertEqual(q["init"]["kind"], "UNIFORM")
        self.assertAlmostEqual(q["init"]["high"], (6 / (64 + 192)) ** 0.5)
        self.assertEqual(p["encoder.layers.1.self_attn.v.bias"]["init"]["kind"],
                         "ZEROS")
        self.assertEqual(
            p["encoder.layers.0.self_attn.out_proj.bias"]["init"]["kind"],
            "ZEROS")
        lin = p["encoder.layers.0.linear2.weight"]["init"]
        self.assertEqual(lin["kind"], "UNIFORM")
        self.assertAlmostEqual(lin["high"], 1 / 128 ** 0.5)
        self.assertEqual(p["encoder.layers.1.norm2.weight"]["init"]["kind"],
                         "ONES")
        self.assertEqual(p["encoder.layers.1.norm2.bias"]["init"]["kind"],
                         "ZEROS")
        self.assertAlmostEqual(p["head.bias"]["init"]["high"], 1 / 8)

    def test_transformer_api_other_config_matches_zoo(self):
        B, S, C = 3, 7, 5
        m = M.TorchTransformerClassifier(layers=3, hidden=32, heads=2, ffn=48,
                                         classes=C, dropout=0.2)
        inputs = {"x": torch.randn(B, S, 32), "labels": labels(B, C)}
        g, out = self.export(m, inputs)
        want = U.zoo("transformer", layers=3, hidden=32, heads=2, ffn=48,
                     seq=S, batch=B, classes=C, dropout=0.2)
        self.assert_same_summary(U.validate(out), want,
                                 "nn.TransformerEncoder 3x32")
        self.assertEqual(U.validate(out)["parameters"], M.num_params(m))
        self.check_numerics(m, inputs)

    def test_transformer_variants(self):
        B, S, H = 2, 6, 32
        base = dict(layers=2, hidden=H, heads=4, ffn=40, seq=S, batch=B,
                    classes=3)
        zoo = U.zoo("transformer", **base)
        for kw in (dict(norm_first=True), dict(activation="gelu"),
                   dict(batch_first=False), dict(dropout=0.0)):
            with self.subTest(**kw):
                m = M.TorchTransformerClassifier(layers=2, hidden=H, heads=4,
                                                 ffn=40, classes=3, **kw)
                x = torch.randn(B, S, H) if m.batch_first else \
                    torch.randn(S, B, H)
                inputs = {"x": x, "labels": labels(B, 3)}
                g, out = self.export(m, inputs)
                self.check_graph(g)
                got = U.validate(out)
                self.assertEqual(got["parameters"], M.num_params(m))
                if kw.get("norm_first"):  # same ops, other order
                    self.assertEqual(got["forward_flops"], zoo["forward_flops"])
                if kw.get("batch_first") is False:
                    # one transpose into and one out of the encoder stack
                    self.assertEqual(got["forward_flops"],
                                     zoo["forward_flops"] + 2 * B * S * H)
                if kw.get("dropout") == 0.0:
                    self.assertNotIn("dropout", got["op_types"])
                self.check_numerics(m, inputs)

    # ---- GPT-style LMs == zoo gpt -------------------------------------------
    def test_gpt_lm_matches_zoo(self):
        """TorchGpt: nn.Embedding tokens + positions, causal
        nn.TransformerEncoderLayer(norm_first, gelu), F.cross_entropy."""
        B, S, V = 4, 16, 100
        m = M.TorchGpt(layers=2, hidden=64, heads=4, ffn=128, seq=S, vocab=V)
        inputs = {"tokens": torch.randint(0, V, (B, S)),
                  "labels": torch.randint(0, V, (B, S))}
        g, out = self.export(m, inputs)
        self.check_graph(g)
        got = U.validate(out)
        want = U.zoo("gpt", layers=2, hidden=64, heads=4, ffn=128, seq=S,
                     vocab=V, batch=B)
        for k in ("parameters", "forward_flops", "training_flops"):
            self.assertEqual(got[k], want[k], k)
        self.assertEqual(got["parameters"], M.num_params(m))
        print(f"  TorchGpt: parameters {got['parameters']}, forward_flops "
              f"{got['forward_flops']:.0f} (== zoo gpt)")
        self.assertEqual(self.roles(g), {"tokens": "FEATURES",
                                         "labels": "LABELS"})
        softmaxes = [op for op in g["ops"] if op["type"] == "softmax"]
        self.assertEqual(len(softmaxes), 2)
        for op in softmaxes:
            self.assertEqual(op["attrs"]["causal"], {"b": True})
        types = {op["type"] for op in g["ops"]}
        self.assertTrue({"embedding", "cross_entropy"} <= types)
        p = self.params(g)
        self.assertEqual(p["tok.weight"]["init"], {"kind": "NORMAL",
                                                   "mean": 0.0, "stddev": 1.0})
        self.check_numerics(m, inputs)

    def test_handwritten_zoo_mirrors_export_like_zoo(self):
        """The hand-written mirrors of tests/torch_models.py (custom attention
        with view/transpose/permute/@/masked_fill, class token, x[:, 0], ...)
        export to exactly the zoo's FLOPs and parameters."""
        cases = [
            ("gpt", M.ZooGpt(layers=2, hidden=64, heads=4, ffn=128, seq=16,
                             vocab=100),
             {"tokens": torch.randint(0, 100, (4, 16)),
              "labels": torch.randint(0, 100, (64,))},
             dict(layers=2, hidden=64, heads=4, ffn=128, seq=16, vocab=100,
                  batch=4)),
            ("vit", M.ZooVit(layers=2, hidden=64, heads=4, ffn=128, image=16,
                             patch=4, channels=3, classes=10),
             {"images": torch.randn(4, 3, 16, 16), "labels": labels(4, 10)},
             dict(layers=2, hidden=64, heads=4, ffn=128, image=16, patch=4,
                  channels=3, classes=10, batch=4)),
            ("mlp", M.ZooMlp(layers=2, hidden=64, input=32, classes=10),
             {"x": torch.randn(8, 32), "labels": labels(8, 10)},
             dict(layers=2, hidden=64, input=32, classes=10, batch=8)),
            ("vgg", M.ZooVgg(width=8, stages=2, convs_per_stage=2, image=16,
                             channels=3, classes=10, hidden=32),
             {"images": torch.randn(4, 3, 16, 16), "labels": labels(4, 10)},
             dict(width=8, stages=2, convs_per_stage=2, image=16, channels=3,
                  classes=10, hidden=32, batch=4)),
        ]
        for name, m, inputs, cfg in cases:
            with self.subTest(model=name):
                g, out = self.export(m, inputs)
                self.check_graph(g)
                self.assert_same_summary(U.validate(out), U.zoo(name, **cfg),
                                         f"hand-written {name}")
                self.check_numerics(m, inputs)

    def test_full_size_defaults_on_meta_match_zoo(self):
        """Modules built on the meta device at the zoo's default sizes (batch
        256) export in well under a second and equal `hapctl zoo NAME`."""
        cases = [
            ("gpt", M.TorchGpt(layers=12, hidden=768, heads=12, ffn=3072,
                               seq=128, vocab=18328, device="meta"),
             {"tokens": torch.zeros(256, 128, dtype=torch.long),
              "labels": torch.zeros(256 * 128, dtype=torch.long)}),
            ("transformer",
             M.TorchTransformerClassifier(layers=12, hidden=768, heads=12,
                                          ffn=3072, classes=10, device="meta"),
             {"x": torch.zeros(256, 128, 768, device="meta"),
              "labels": torch.zeros(256, dtype=torch.long)}),
        ]
        for name, m, inputs in cases:
            with self.subTest(model=name):
                g, out = self.export(m, inputs, run_on="meta")
                got = U.validate(out)
                self.assert_same_summary(got, U.zoo(name),
                                         f"torch {name} at zoo defaults")

    def test_meta_and_cpu_shapes_agree(self):
        for m, inputs in (
                (M.TorchGpt(), {"tokens": torch.randint(0, 100, (2, 16)),
                                "labels": torch.randint(0, 100, (32,))}),
                (M.SmallCnn(), {"images": torch.randn(2, 3, 12, 12),
                                "labels": labels(2, 10)})):
            with self.subTest(model=type(m).__name__):
                a = export_fx.export(m, inputs, run_on="meta")
                b = export_fx.export(m, inputs, run_on="cpu")
                self.assertEqual(a, b)

    # ---- other models --------------------------------------------------------
    def test_mlp(self):
        m = M.Mlp()
        inputs = {"x": torch.randn(8, 16), "labels": labels(8, 5)}
        g, out = self.export(m, inputs)
        self.check_graph(g)
        got = U.validate(out)
        self.assertEqual(got["trainable_parameters"], M.num_params(m))
        self.assertEqual(got["parameters"], M.num_params(m) + 1)  # the 0.25
        for t in ("gelu", "tanh", "sigmoid", "relu", "layer_norm", "dropout",
                  "softmax", "concat", "mean", "scale", "mul", "sub", "add"):
            self.assertIn(t, got["op_types"])
        self.assertEqual(self.roles(g), {"x": "FEATURES", "labels": "LABELS"})
        self.check_numerics(m, inputs)

    def test_cnn_cli_package_module(self):
        out, _ = self.cli("torch_models:SmallCnn",
                          ["images=4,3,16,16", "labels=4:int64:10"])
        got = U.validate(out)
        self.assertEqual(got["parameters"], M.num_params(M.SmallCnn()))
        for t in ("conv2d", "relu", "max_pool2d", "adaptive_avg_pool2d",
                  "flatten", "linear", "cross_entropy"):
            self.assertIn(t, got["op_types"])
        m = M.SmallCnn()
        self.check_numerics(m, {"images": torch.randn(4, 3, 16, 16),
                                "labels": labels(4, 10)})

    def test_multihead_attention_module(self):
        """nn.MultiheadAttention used directly: sequence-first, kdim != embed
        (separate q/k/v weights), an additive float mask input."""

        class Cross(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(16, 2, dropout=0.1, kdim=12,
                                                  vdim=12)
                self.head = nn.Linear(16, 3)

            def forward(self, q, kv, mask, labels):
                a, _ = self.attn(q, kv, kv, attn_mask=mask)
                return F.cross_entropy(self.head(a.sum(dim=0)), labels)

        m = Cross()
        inputs = {"q": torch.randn(5, 2, 16), "kv": torch.randn(7, 2, 12),
                  "mask": torch.randn(5, 7), "labels": labels(2, 3)}
        g, out = self.export(m, inputs)
        self.check_graph(g)
        got = U.validate(out)
        self.assertEqual(got["parameters"], M.num_params(m))
        self.assertIn("attn.k.weight", self.params(g))
        self.assertEqual(self.roles(g)["mask"], "FEATURES")
        self.check_numerics(m, inputs)

    def test_loss_function_argument(self):
        """export(model, inputs, loss=nn.CrossEntropyLoss()) adds the loss."""
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        inputs = {"input": torch.randn(5, 6), "labels": labels(5, 4)}
        g = export_fx.export(model, inputs, loss=nn.CrossEntropyLoss())
        self.assertEqual(g["ops"][-1]["type"], "cross_entropy")
        self.assertEqual(self.roles(g), {"input": "FEATURES",
                                         "labels": "LABELS"})
        out = self.path("lossfn")
        with open(out, "w") as f:
            json.dump(g, f)
        self.assertEqual(U.validate(out)["parameters"], M.num_params(model))

    # ---- errors ----------------------------------------------------------------
    def test_unsupported_op_fails_naming_it(self):
        out, p = self.cli(f"{MODELS_PY}:Sorter", ["x=4,8", "labels=4:int64:4"],
                          check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("torch.sort", p.stderr)
        self.assertIn("'sort'", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_unsupported_module_and_tracing_errors(self):
        class Rnn(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = nn.GRU(8, 8, batch_first=True)
                self.fc = nn.Linear(8, 3)

            def forward(self, x, labels):
                h, _ = self.rnn(x)
                return F.cross_entropy(self.fc(h[:, -1]), labels)

        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 3)

            def forward(self, x, labels):
                if x.sum() > 0:
                    x = x * 2
                return F.cross_entropy(self.fc(x), labels)

        class NoLoss(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 3)

            def forward(self, x, labels):
                return self.fc(x)

        for mod, x, needle in ((Rnn(), torch.randn(4, 5, 8), "GRU"),
                               (Branchy(), torch.randn(4, 8), "control flow"),
                               (NoLoss(), torch.randn(4, 8), "scalar loss")):
            with self.subTest(module=type(mod).__name__):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, {"x": x, "labels": labels(4, 3)})
                self.assertIn(needle, str(cm.exception))


if __name__ == "__main__":
    U.main("export_fx_test")
