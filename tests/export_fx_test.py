"""tools/export_fx.py: PyTorch modules exported with torch.fx load and
validate with `hapctl validate`, match the zoo exactly where they are the same
model, and compute the same loss as PyTorch (checked with the reference
evaluator tests/hap_ir_eval.py and the module's own weights)."""

import importlib.util
import json
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402
import hap_ir_eval  # noqa: E402

# tools/safetensors_io.py, found next to export_fx.py (through symlinks).
safetensors_io = export_fx._safetensors_io()
import torch_models as M  # noqa: E402

MODELS_PY = os.path.join(U.HERE, "torch_models.py")
SUMMARY_KEYS = ("parameters", "trainable_parameters", "forward_flops",
                "training_flops", "ops", "op_types")


def labels(n, hi):
    return torch.randint(0, hi, (n,))


# ---- an independent safetensors reader, from the format's specification ----
# (8-byte little-endian header length N, N bytes of JSON, then the data
# buffer); deliberately not tools/safetensors_io.py.
SPEC_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4),
               "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
               "I64": (torch.int64, 8), "I32": (torch.int32, 4)}


def spec_read(path):
    """(tensors, metadata, header length N, header entries in data order)."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, e in header.items():
        dtype, size = SPEC_DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        count = (end - begin) // size
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype,
                             count=count) if count else \
            torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(e["shape"])
    order = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return tensors, meta, n, order, len(data)


# A module with nested submodules, an nn.TransformerEncoder, a bare
# nn.MultiheadAttention, a LayerNorm without affine (frozen exporter
# parameters), a constant (+ 1.0: a "const.*" parameter), a buffer (the
# causal mask: in the state_dict, not a parameter) and a zero-initialised head.
NAMES_MODULE = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                   nn.Linear(2 * d, d))
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x):
        return self.norm(x + self.inner(x))


class Net(nn.Module):
    def __init__(self, d=16, heads=2, classes=5, seq=6):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.stack = nn.ModuleDict({"pre": Block(d)})
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2,
                                             enable_nested_tensor=False)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.register_buffer("mask", torch.triu(
            torch.full((seq, seq), float("-inf")), 1))
        self.head = nn.Linear(d, classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def features(self, x):
        h = self.stack["pre"](self.embed(x))
        h = self.encoder(h)
        a, _ = self.attn(h, h, h, attn_mask=self.mask)
        return (a + 1.0).mean(dim=1)

    def forward(self, x):
        return self.head(self.features(x))


class NetWithLoss(Net):
    def forward(self, x, labels):
        return F.cross_entropy(self.head(self.features(x)), labels)


def make(seed=0):
    torch.manual_seed(seed)
    return NetWithLoss()
"""


class ExportFxTest(ExportTestCase):
    # ---- helpers -----------------------------------------------------------
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
        # Separate q/k/v_proj_weight keep their state_dict names; the bias
        # is split from in_proj_bias.
        self.assertIn("attn.k_proj_weight", self.params(g))
        self.assertEqual(sorted(export_fx.state_dict_slices(g)),
                         ["attn.k.bias", "attn.q.bias", "attn.v.bias"])
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

    # ---- names, slices, weights ---------------------------------------------
    def names_module(self):
        """tests' NAMES_MODULE, written to a file (also for the CLI)."""
        path = os.path.join(self.dir, "names_module.py")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(NAMES_MODULE)
        spec = importlib.util.spec_from_file_location("names_module", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, path

    def names_inputs(self):
        return {"x": torch.randn(3, 6, 8), "labels": labels(3, 5)}

    def assert_state_dict_names(self, g, module):
        """Every graph parameter is a state_dict parameter by name and shape,
        a listed slice of one, or an exporter constant (frozen, not in the
        state_dict); together they cover every parameter."""
        params = dict(module.named_parameters())
        state = module.state_dict()
        slices = export_fx.state_dict_slices(g)
        covered = set()
        for p in g["parameters"]:
            name, shape = p["tensor"]["name"], p["tensor"]["shape"]
            if name in slices:
                src = slices[name]["source"]
                self.assertIn(src, params, name)
                self.assertEqual(slices[name]["source_shape"],
                                 list(params[src].shape), name)
                covered.add(src)
            elif p.get("frozen"):
                self.assertNotIn(name, state, f"{name} frozen")
            else:
                self.assertIn(name, params)
                self.assertEqual(shape, list(params[name].shape), name)
                covered.add(name)
        self.assertEqual(covered, set(params))

    def test_parameter_names_are_state_dict_names(self):
        """Nested submodules, nn.TransformerEncoder, nn.MultiheadAttention:
        graph parameter names are the module's state_dict names, both when
        forward returns the loss and with export(loss=...)'s wrapper."""
        mod, _ = self.names_module()
        m = mod.make()
        g = export_fx.export(m, self.names_inputs())
        self.check_graph(g)
        self.assert_state_dict_names(g, m)
        p = self.params(g)
        for name in ("embed.weight", "stack.pre.inner.0.weight",
                     "stack.pre.inner.2.bias",
                     "encoder.layers.1.self_attn.out_proj.weight",
                     "encoder.layers.0.linear1.weight",
                     "encoder.layers.1.norm2.bias", "attn.out_proj.bias",
                     "head.weight"):
            self.assertIn(name, p)
            self.assertNotIn("frozen", p[name])
        self.assertTrue(p["stack.pre.norm.weight"]["frozen"])  # no affine
        self.assertTrue(any(n.startswith("const.") for n in p))
        self.assertEqual(g["metadata"]["torch.module"], "NetWithLoss")

        # The same module through export(loss=...): same names.
        net = mod.Net()
        net.load_state_dict(m.state_dict())
        gw, vw = export_fx.export(net, self.names_inputs(),
                                  loss=nn.CrossEntropyLoss(),
                                  return_values=True)
        self.check_graph(gw)
        self.assert_state_dict_names(gw, net)
        self.assertEqual([q["tensor"]["name"] for q in gw["parameters"]],
                         [q["tensor"]["name"] for q in g["parameters"]])
        self.assertEqual(gw["metadata"][export_fx.SLICES_KEY],
                         g["metadata"][export_fx.SLICES_KEY])
        self.assertEqual(gw["metadata"]["torch.module"], "Net")
        self.assertFalse([op["name"] for op in gw["ops"]
                          if op["name"].startswith("model.")])
        self.assertFalse([op["scope"] for op in gw["ops"]
                          if op.get("scope", "").startswith("model")])
        w = export_fx.state_dict_weights(gw, vw)
        self.assertEqual(set(w), set(net.state_dict()))  # the buffer mask too
        self.check_numerics(m, self.names_inputs())

    def test_state_dict_slices_metadata(self):
        """hap.state_dict_slices lists exactly the q/k/v parameters split
        from in_proj_weight/in_proj_bias; slicing the source at offset along
        axis gives the values return_values reports."""
        mod, _ = self.names_module()
        m = mod.make()
        g, values = export_fx.export(m, self.names_inputs(),
                                     return_values=True)
        slices = json.loads(g["metadata"]["hap.state_dict_slices"])
        mhas = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn",
                "attn"]
        want = {f"{a}.{x}.{k}": (f"{a}.in_proj_{k}", i)
                for a in mhas for i, x in enumerate("qkv")
                for k in ("weight", "bias")}
        self.assertEqual(set(slices), set(want))
        state = m.state_dict()
        p = self.params(g)
        E = 16
        for name, s in slices.items():
            src, i = want[name]
            self.assertEqual(set(s), {"source", "axis", "offset",
                                      "source_shape"})
            self.assertEqual((s["source"], s["axis"], s["offset"]),
                             (src, 0, i * E), name)
            self.assertEqual(s["source_shape"], list(state[src].shape))
            shape = p[name]["tensor"]["shape"]
            part = state[src].narrow(s["axis"], s["offset"], shape[s["axis"]])
            self.assertEqual(list(part.shape), shape)
            self.assertTrue(torch.equal(part, values[name]), name)
        # Graph parameters that are not slices carry their state_dict values.
        for name, v in values.items():
            if name not in slices and not p.get(name, {}).get("frozen"):
                self.assertTrue(torch.equal(v, state[name]), name)
        # A module without split parameters records an empty mapping.
        g2 = export_fx.export(nn.Sequential(nn.Linear(4, 3)),
                              {"input": torch.randn(2, 4),
                               "labels": labels(2, 3)},
                              loss=nn.CrossEntropyLoss())
        self.assertEqual(export_fx.state_dict_slices(g2), {})

    def test_parameter_named_like_an_input(self):
        """A parameter whose state_dict name an input already has becomes a
        whole-tensor slice of it (so --weights still writes its name)."""

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4, 3))
                self.fc = nn.Linear(3, 3)

            def forward(self, w, labels):
                return F.cross_entropy(self.fc(w @ self.w), labels)

        m = M()
        g, values = export_fx.export(m, {"w": torch.randn(2, 4),
                                         "labels": labels(2, 3)},
                                     return_values=True)
        self.assertEqual(export_fx.state_dict_slices(g), {
            "w_1": {"source": "w", "axis": 0, "offset": 0,
                    "source_shape": [4, 3]}})
        w = export_fx.state_dict_weights(g, values)
        self.assertEqual(set(w), {"w", "fc.weight", "fc.bias"})
        self.assertTrue(torch.equal(w["w"], m.w.detach()))

    def test_module_initial_values_kept(self):
        """A parameter whose values are all equal keeps them (ZEROS / ONES /
        CONSTANT) instead of the module type's default init; the others keep
        today's kinds."""
        mod, _ = self.names_module()
        m = mod.make()
        with torch.no_grad():
            m.embed.bias.fill_(0.5)
            m.encoder.layers[0].norm1.weight.fill_(2.0)
            m.encoder.layers[0].norm1.bias.fill_(1.0)
            m.attn.in_proj_bias[16:32] = 0.25  # k's bias only
        g = export_fx.export(m, self.names_inputs())
        p = {k: v["init"] for k, v in self.params(g).items()}
        self.assertEqual(p["head.weight"], {"kind": "ZEROS"})
        self.assertEqual(p["head.bias"], {"kind": "ZEROS"})
        self.assertEqual(p["embed.bias"], {"kind": "CONSTANT", "value": 0.5})
        self.assertEqual(p["encoder.layers.0.norm1.weight"],
                         {"kind": "CONSTANT", "value": 2.0})
        self.assertEqual(p["encoder.layers.0.norm1.bias"], {"kind": "ONES"})
        self.assertEqual(p["attn.q.bias"], {"kind": "ZEROS"})
        self.assertEqual(p["attn.k.bias"], {"kind": "CONSTANT",
                                            "value": 0.25})
        self.assertEqual(p["encoder.layers.1.norm1.weight"], {"kind": "ONES"})
        # Not constant: the module type's default kinds, as before.
        self.assertEqual(p["embed.weight"]["kind"], "UNIFORM")
        self.assertAlmostEqual(p["embed.weight"]["high"], 1 / 8 ** 0.5)
        self.assertEqual(p["attn.q.weight"]["kind"], "UNIFORM")
        self.assertAlmostEqual(p["attn.q.weight"]["high"], (6 / 64) ** 0.5)
        # On the meta device there are no values: default kinds.
        meta = nn.Sequential(nn.Linear(6, 4)).to("meta")
        gm = export_fx.export(meta, {"input": torch.zeros(2, 6),
                                     "labels": labels(2, 4)},
                              loss=nn.CrossEntropyLoss(), run_on="meta")
        self.assertEqual(self.params(gm)["0.weight"]["init"]["kind"],
                         "UNIFORM")

    def test_weights_cli_round_trip(self):
        """export_fx.py --weights OUT.safetensors: the module's parameters
        under state_dict names (in_proj_weight whole, no exporter constants),
        read by a reader written here from the specification, restored
        exactly by load_state_dict(strict=True) (the buffer `mask`, folded
        into the graph, included)."""
        mod, path = self.names_module()
        m = mod.make(seed=0)
        weights = os.path.join(self.dir, "names.safetensors")
        out, p = self.cli(f"{path}:make", ["x=3,6,8", "labels=3:int64:5"],
                          extra=["--weights", weights])
        self.assertIn("names.safetensors", p.stderr)
        with open(out) as f:
            g = json.load(f)
        self.assertEqual(self.params(g)["head.weight"]["init"],
                         {"kind": "ZEROS"})

        tensors, meta, n, order, data_len = spec_read(weights)
        params = m.state_dict()
        self.assertEqual(set(tensors), set(params))
        for name, t in tensors.items():
            self.assertEqual(t.dtype, params[name].dtype, name)
            self.assertTrue(torch.equal(t, params[name].detach()), name)
        for a in ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn",
                  "attn"):
            self.assertEqual(list(tensors[f"{a}.in_proj_weight"].shape),
                             [48, 16])
            self.assertEqual(list(tensors[f"{a}.in_proj_bias"].shape), [48])
            self.assertNotIn(f"{a}.q.weight", tensors)
        self.assertFalse([k for k in tensors if k.startswith("const.")])
        self.assertNotIn("stack.pre.norm.weight", tensors)  # exporter's
        self.assertEqual(meta.get("format"), "pt")
        # Layout: header padded to 8 bytes; tensors back to back from 0,
        # covering the data buffer; each aligned to its element size.
        self.assertEqual(n % 8, 0)
        pos = 0
        for name, e in order:
            begin, end = e["data_offsets"]
            self.assertEqual(begin, pos, name)
            self.assertEqual((8 + n + begin) % SPEC_DTYPES[e["dtype"]][1], 0)
            pos = end
        self.assertEqual(pos, data_len)

        # Our reader agrees; load_state_dict restores exactly.
        ours, ours_meta = safetensors_io.read_safetensors(weights)
        self.assertEqual(ours_meta, meta)
        self.assertEqual(list(ours), [k for k, _ in order])
        for k, v in tensors.items():
            self.assertTrue(torch.equal(ours[k], v), k)
        fresh = mod.make(seed=1)
        self.assertFalse(torch.equal(
            fresh.encoder.layers[0].self_attn.in_proj_weight,
            m.encoder.layers[0].self_attn.in_proj_weight))
        fresh.load_state_dict(tensors, strict=True)
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(fresh.state_dict()[k], v), k)

        # The file's in_proj_weight is the graph's q, k, v stacked.
        _, values = export_fx.export(m, self.names_inputs(),
                                     return_values=True)
        for a in ("encoder.layers.1.self_attn", "attn"):
            qkv = torch.cat([values[f"{a}.{x}.weight"] for x in "qkv"])
            self.assertTrue(torch.equal(qkv, tensors[f"{a}.in_proj_weight"]))

    def test_weights_cli_errors(self):
        """--weights on a module without values (meta device) fails before
        writing anything; a module with an unused parameter writes it with
        its values (recorded in the graph, which checkpoint exports give
        back), without a note."""
        src = os.path.join(self.dir, "meta_module.py")
        with open(src, "w") as f:
            f.write("import torch.nn as nn\n"
                    "import torch.nn.functional as F\n\n"
                    "class M(nn.Module):\n"
                    "    def __init__(self, device=None):\n"
                    "        super().__init__()\n"
                    "        self.fc = nn.Linear(4, 3, device=device)\n"
                    "        self.spare = nn.Linear(2, 2, device=device)\n\n"
                    "    def forward(self, x, labels):\n"
                    "        return F.cross_entropy(self.fc(x), labels)\n\n"
                    "def meta():\n"
                    "    return M(device='meta')\n")
        weights = os.path.join(self.dir, "meta.safetensors")
        out, p = self.cli(f"{src}:meta", ["x=2,4", "labels=2:int64:3"],
                          check=False, extra=["--weights", weights])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("meta device", p.stderr)
        self.assertFalse(os.path.exists(out))
        self.assertFalse(os.path.exists(weights))
        out, p = self.cli(f"{src}:M", ["x=2,4", "labels=2:int64:3"],
                          extra=["--weights", weights])
        self.assertNotIn("note:", p.stderr)
        tensors = spec_read(weights)[0]
        self.assertEqual(set(tensors), {"fc.weight", "fc.bias",
                                        "spare.weight", "spare.bias"})

    def test_safetensors_io_layout(self):
        """tools/safetensors_io.py writes what the specification says (read
        back by the reader written here): 8-byte dtypes first, every tensor
        aligned, the header padded to 8 bytes, metadata strings."""
        g = torch.Generator().manual_seed(3)
        ts = {"h": torch.randn(3, generator=g).half(),
              "w": torch.randn(2, 3, generator=g),
              "i": torch.arange(5),
              "bf": torch.randn(4, generator=g).bfloat16(),
              "d": torch.randn(2, 2, generator=g, dtype=torch.float64),
              "n": torch.arange(3, dtype=torch.int32),
              "s": torch.tensor(1.5),
              "e": torch.zeros(0, 3),
              "t": torch.randn(3, 4, generator=g).t()}  # not contiguous
        path = os.path.join(self.dir, "layout.safetensors")
        safetensors_io.write_safetensors(path, ts, {"k": "v"})
        tensors, meta, n, order, data_len = spec_read(path)
        self.assertEqual(meta, {"k": "v"})
        self.assertEqual(n % 8, 0)
        sizes = [SPEC_DTYPES[e["dtype"]][1] for _, e in order]
        self.assertEqual(sizes, sorted(sizes, reverse=True))
        self.assertEqual([k for k, _ in order][:2], ["i", "d"])
        pos = 0
        for name, e in order:
            self.assertEqual(e["data_offsets"][0], pos)
            self.assertEqual((8 + n + pos) % SPEC_DTYPES[e["dtype"]][1], 0)
            pos = e["data_offsets"][1]
        self.assertEqual(pos, data_len)
        for k, v in ts.items():
            self.assertEqual(tensors[k].dtype, v.dtype, k)
            self.assertEqual(tensors[k].shape, v.shape, k)
            self.assertTrue(torch.equal(tensors[k], v), k)
            self.assertTrue(torch.equal(safetensors_io.read(path)[k], v), k)
        # Our reader refuses a truncated file, naming it.
        with open(path, "rb") as f:
            blob = f.read()
        bad = os.path.join(self.dir, "truncated.safetensors")
        with open(bad, "wb") as f:
            f.write(blob[:-3])
        with self.assertRaises(safetensors_io.SafetensorsError) as cm:
            safetensors_io.read_safetensors(bad)
        self.assertIn("truncated.safetensors", str(cm.exception))
        with self.assertRaises(safetensors_io.SafetensorsError):
            safetensors_io.write_safetensors(
                bad, {"m": torch.zeros(2, device="meta")})

    def test_safetensors_io_refuses_malformed_headers_naming_the_file(self):
        """Hand-made headers our reader must refuse with SafetensorsError
        naming the file: not a traceback from json or torch."""
        def hand_made(header, data=b""):
            raw = header.encode()
            return struct.pack("<Q", len(raw)) + raw + data
        cases = {
            # json.loads recurses: a deep header raised RecursionError.
            "deep": (hand_made('{"w":' + "[" * 100000 + "]" * 100000 + "}"),
                     "nest"),
            # Zero elements, so zero bytes, but a dimension torch cannot
            # make: torch's RuntimeError before.
            "huge_dim": (hand_made('{"w":{"dtype":"F32","shape":[0,%d],'
                                   '"data_offsets":[0,0]}}' % 2**70),
                         "shape"),
            "over_limit": (struct.pack("<Q", 100 * 1000 * 1000 + 1) + b"{}",
                           "limit"),
        }
        for name, (blob, words) in cases.items():
            path = os.path.join(self.dir, name + ".safetensors")
            with open(path, "wb") as f:
                f.write(blob)
            with self.assertRaises(safetensors_io.SafetensorsError,
                                   msg=name) as cm:
                safetensors_io.read(path)
            self.assertIn(path, str(cm.exception))
            self.assertIn(words, str(cm.exception))

    # ---- errors ----------------------------------------------------------------
    def test_unsupported_op_fails_naming_it(self):
        out, p = self.cli(f"{MODELS_PY}:Sorter", ["x=4,8", "labels=4:int64:4"],
                          check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("torch.sort", p.stderr)
        self.assertIn("'sort'", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_cli_bad_arguments_fail_naming_them(self):
        """Bad --input-shape values, --kwargs that are not keyword arguments
        of the factory and an -o that cannot be written ended in a Python
        traceback; each is now an export_fx error naming it, exit status 2."""
        good = ["x=8,16", "labels=8:int64:5"]
        nowhere = os.path.join(self.dir, "no-such-dir", "out.json")
        for inputs, extra, needle in (
                (["x=8,-16", "labels=8:int64:5"], (), "--input-shape 'x=8,-16'"),
                (["x=8,16", "labels=8:int64:0"], (), "--input-shape 'labels=8:int64:0'"),
                (["x=8,16", "labels=8:int64:abc"], (), "--input-shape 'labels=8:int64:abc'"),
                (good, ("--kwargs", "[1]"), "--kwargs"),
                (good, ("--kwargs", '{"nonsense": 1}'), "nonsense"),
                (good, ("-o", nowhere), f"cannot write '{nowhere}'"),
                (good, ("-o", self.dir), f"cannot write '{self.dir}'")):
            with self.subTest(inputs=inputs, extra=extra):
                _, p = self.cli("torch_models:Mlp", inputs, check=False, extra=extra)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertNotIn("Traceback", p.stderr)
                self.assertIn("export_fx: error: ", p.stderr)
                self.assertIn(needle, p.stderr)

    def test_unsupported_module_and_tracing_errors(self):
        class Randomized(nn.Module):
            def __init__(self):
                super().__init__()
                self.act = nn.RReLU()  # a random slope per element
                self.fc = nn.Linear(8, 3)

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(self.act(x[:, -1])), labels)

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

        class TwoOutputs(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 3)

            def forward(self, x, labels):
                logits = self.fc(x)
                return logits, F.cross_entropy(logits, labels)

        class PositionBuffer(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 3)
                self.enc = nn.Module()
                self.enc.register_buffer("pos", torch.arange(8.0))

            def forward(self, x, labels):
                return F.cross_entropy(self.fc(x + self.enc.pos), labels)

        class KeywordOnly(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 3)

            def forward(self, *, x, labels):
                return F.cross_entropy(self.fc(x), labels)

        # The data-dependent branch is named by its file, line and source;
        # a keyword-only forward by its argument (it was reported as a
        # TypeError from deep in torch.fx, blamed on control flow).
        for mod, x, needles in (
                (Randomized(), torch.randn(4, 5, 8),
                 ["RReLU", "module type is not supported"]),
                (Branchy(), torch.randn(4, 8),
                 ["control flow", "export_fx_test.py:",
                  "(if x.sum() > 0:)"]),
                (KeywordOnly(), torch.randn(4, 8),
                 ["keyword-only argument 'x'"]),
                (TwoOutputs(), torch.randn(4, 8),
                 ["2 outputs", "--loss INDEX"]),
                (NoLoss(), torch.randn(4, 8), ["scalar loss"])):
            with self.subTest(module=type(mod).__name__):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, {"x": x, "labels": labels(4, 3)})
                for needle in needles:
                    self.assertIn(needle, str(cm.exception))
                self.assertNotIn("code() argument", str(cm.exception))
        # A buffer of unequal values added as it is: a VALUES constant,
        # the buffer's values recorded for --weights (it was refused).
        g = export_fx.export(PositionBuffer(), {"x": torch.randn(4, 8),
                                                "labels": labels(4, 3)})
        listed = [p["init"] for p in g["parameters"]
                  if p["init"]["kind"] == "VALUES"]
        self.assertEqual(listed, [{"kind": "VALUES",
                                   "values": [float(i) for i in range(8)],
                                   "counts": [1] * 8}])
        extras = json.loads(g["metadata"]["hap.state_dict_extras"])
        self.assertIn("enc.pos", extras["folded"])

    def test_tied_weights_and_state_dict_extras(self):
        """A tied pair (head.weight = emb.weight) and a linear used twice are
        one graph parameter each, PyTorch's parameter count; the graph's
        hap.state_dict_extras names the tied name, the exporter constants
        and the state_dict entries the graph does not hold (a persistent
        buffer used as it is is held: a frozen parameter), and
        state_dict_weights writes the tied name as a copy. A parameter
        with requires_grad=False is frozen in the graph."""

        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(11, 8)
                self.mid = nn.Linear(8, 8)
                self.bn = nn.BatchNorm1d(8)
                self.head = nn.Linear(8, 11, bias=False)
                self.head.weight = self.emb.weight
                self.register_buffer("scale", torch.full((8,), 0.5))
                self.register_buffer("tmp", torch.ones(8), persistent=False)
                self.register_buffer("window", torch.cat(
                    [torch.ones(8), torch.full((8,), 2.0)]))
                self.register_buffer("flags", torch.tensor([True, False, False]))
                self.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
                self.bn.bias.requires_grad_(False)

            def forward(self, x, labels):
                h = self.mid(torch.relu(self.mid(self.emb(x))))
                h = self.bn(self.bn(h)) * self.scale * self.tmp * \
                    self.window[:8]
                return F.cross_entropy(self.head(h), labels)

        m = Tied()
        m.bn.num_batches_tracked.fill_(3)  # trained before
        g, values = export_fx.export(
            m, {"x": torch.randint(0, 11, (6,)), "labels": labels(6, 11)},
            return_values=True)
        trainable = [p["tensor"] for p in g["parameters"]
                     if not p.get("frozen")]
        self.assertEqual(sum(torch.Size(t["shape"]).numel()
                             for t in trainable),
                         sum(p.numel() for p in m.parameters()
                             if p.requires_grad))
        # requires_grad=False: frozen in the graph, and in --weights.
        self.assertTrue(self.params(g)["bn.bias"].get("frozen"))
        extras = json.loads(g["metadata"][export_fx.EXTRAS_KEY])
        self.assertEqual(extras["aliases"], {"head.weight": "emb.weight"})
        # scale (persistent, used as it is) is held as a frozen parameter;
        # window is folded into a constant through its slice: recorded
        # with its values (runs of equal elements), as bn's counter is with
        # its forwards per step (bn is called twice), as is the unused bool
        # buffer flags; a complex buffer is not recorded, and says why.
        self.assertTrue(self.params(g)["scale"].get("frozen"))
        self.assertEqual(extras["counters"], {"bn.num_batches_tracked":
                                              {"per_step": 2, "value": 3}})
        one, two = struct.pack("<f", 1.0).hex(), struct.pack("<f", 2.0).hex()
        self.assertEqual(extras["folded"],
                         {"window": {"dtype": "F32", "shape": [16],
                                     "runs": [[8, one], [8, two]]},
                          "flags": {"dtype": "BOOL", "shape": [3],
                                    "runs": [[1, "01"], [2, "00"]]}})
        self.assertEqual(extras["unheld"], ["phase"])
        self.assertIn("dtype torch.complex64", extras["unrecorded"]["phase"])
        self.assertTrue(extras["constants"])
        self.assertTrue(all(c.startswith("const.")
                            for c in extras["constants"]))
        w = export_fx.state_dict_weights(g, values)
        self.assertEqual(set(w), set(m.state_dict()) - {"phase"})
        self.assertTrue(torch.equal(w["head.weight"], m.emb.weight))
        self.assertTrue(torch.equal(w["window"], m.window))
        self.assertTrue(torch.equal(w["flags"], m.flags))
        # Runs are counted over the graph: past the limit a buffer is not
        # recorded, and the reason says so.
        from fx_export.exporter import folded_record  # noqa: PLC0415
        record, why = folded_record(torch.arange(10.0), [9])
        self.assertIsNone(record)
        self.assertIn("10 runs of equal values, over the 9 left", why)
        budget = [10]
        self.assertEqual(folded_record(torch.arange(10.0), budget)[0]["runs"][9],
                         [1, struct.pack("<f", 9.0).hex()])
        self.assertEqual(budget, [0])
        self.assertEqual(int(w["bn.num_batches_tracked"]), 3)

    def test_a_constant_over_the_runs_limit_fails_before_listing_them(self):
        """A constant of unequal values is counted before its runs are
        listed: past the graph's limit the export fails at once, naming
        the counts, without building the runs (millions of them for a
        large constant)."""
        from fx_export import exporter, initializers  # noqa: PLC0415

        class AddRamp(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(64, 1)

            def forward(self, x):
                return self.lin(x + torch.arange(64.0)).sum()

        listed = []
        values = initializers.values

        def spy(t):
            listed.append(t.numel())
            return values(t)

        old_limit = exporter.VALUES_RUNS_LIMIT
        try:
            initializers.values = spy
            exporter.VALUES_RUNS_LIMIT = 63
            with self.assertRaises(export_fx.ExportError) as cm:
                export_fx.export(AddRamp(), {"x": torch.randn(2, 64)})
            self.assertIn("64 runs of equal values, over the 63 left of the "
                          "graph's 63", str(cm.exception))
            self.assertEqual(listed, [])
            exporter.VALUES_RUNS_LIMIT = 64  # at the limit: listed once
            export_fx.export(AddRamp(), {"x": torch.randn(2, 64)})
            self.assertEqual(listed, [64])
        finally:
            initializers.values = values
            exporter.VALUES_RUNS_LIMIT = old_limit


if __name__ == "__main__":
    U.main("export_fx_test")
