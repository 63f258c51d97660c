"""The zoo's parameter counts equal those of equivalent PyTorch modules.

For mlp, gpt, vit (required) and transformer, vgg, in small configurations and
in the zoo's defaults, `hapctl zoo NAME ... -o json` must report as many
parameters as sum(p.numel()) of the hand-written PyTorch mirror in
tests/torch_models.py. Small configurations also compare the multiset of
parameter shapes (from `hapctl zoo --export`) and run the PyTorch module once.
Default configurations are built on the 'meta' device (no memory, no init).
"""

import unittest

import torch

import torch_test_util as U  # noqa: E402  (sets sys.path)
import torch_models as M  # noqa: E402

# The zoo's defaults (planner/graph/zoo.cc Infos()); test_defaults_match
# checks that they are the zoo's.
DEFAULTS = {
    "mlp": dict(layers=12, hidden=768, input=768, classes=10, batch=256),
    "transformer": dict(layers=12, hidden=768, heads=12, ffn=3072, seq=128,
                        classes=10, batch=256, dropout=0.1),
    "gpt": dict(layers=12, hidden=768, heads=12, ffn=3072, seq=128,
                vocab=18328, batch=256, dropout=0.1),
    "vit": dict(layers=12, hidden=768, heads=12, ffn=3072, image=32, patch=4,
                channels=3, classes=10, batch=256, dropout=0.1),
    "vgg": dict(width=64, stages=5, convs_per_stage=2, image=32, channels=3,
                classes=10, hidden=512, batch=256),
}

SMALL = {
    "mlp": [dict(layers=2, hidden=64, input=32, classes=10, batch=8),
            dict(layers=1, hidden=48, input=100, classes=3, batch=2),
            dict(layers=3, hidden=16, input=16, classes=7, batch=4)],
    "gpt": [dict(layers=2, hidden=64, heads=4, ffn=128, seq=16, vocab=100,
                 batch=4, dropout=0.1),
            dict(layers=1, hidden=32, heads=2, ffn=48, seq=8, vocab=57,
                 batch=2, dropout=0.0)],
    "vit": [dict(layers=2, hidden=64, heads=4, ffn=128, image=16, patch=4,
                 channels=3, classes=10, batch=4, dropout=0.1),
            dict(layers=1, hidden=32, heads=2, ffn=40, image=8, patch=2,
                 channels=1, classes=5, batch=2, dropout=0.0)],
    "transformer": [dict(layers=2, hidden=64, heads=4, ffn=128, seq=16,
                         classes=10, batch=4, dropout=0.1)],
    "vgg": [dict(width=8, stages=2, convs_per_stage=2, image=16, channels=3,
                 classes=10, hidden=32, batch=4),
            dict(width=4, stages=3, convs_per_stage=1, image=8, channels=1,
                 classes=2, hidden=8, batch=2)],
}


def torch_module(model, cfg, device=None):
    c = dict(cfg)
    c.pop("batch", None)
    if model == "mlp":
        return M.ZooMlp(device=device, **c)
    if model == "gpt":
        return M.ZooGpt(device=device, **c)
    if model == "vit":
        return M.ZooVit(device=device, **c)
    if model == "transformer":
        c.pop("seq")
        return M.TorchTransformerClassifier(device=device, **c)
    if model == "vgg":
        return M.ZooVgg(**c)
    raise KeyError(model)


def example_inputs(model, cfg):
    b = cfg["batch"]
    if model == "mlp":
        return {"x": torch.randn(b, cfg["input"]),
                "labels": torch.randint(0, cfg["classes"], (b,))}
    if model == "gpt":
        s, v = cfg["seq"], cfg["vocab"]
        return {"tokens": torch.randint(0, v, (b, s)),
                "labels": torch.randint(0, v, (b * s,))}
    if model in ("vit", "vgg"):
        return {"images": torch.randn(b, cfg["channels"], cfg["image"],
                                      cfg["image"]),
                "labels": torch.randint(0, cfg["classes"], (b,))}
    if model == "transformer":
        return {"x": torch.randn(b, cfg["seq"], cfg["hidden"]),
                "labels": torch.randint(0, cfg["classes"], (b,))}
    raise KeyError(model)


def torch_param_shapes(m):
    """Parameter shapes, nn.MultiheadAttention's packed in_proj split into
    q/k/v as the zoo (and the exporter) hold them."""
    out = []
    for name, p in m.named_parameters():
        if name.endswith("in_proj_weight") or name.endswith("in_proj_bias"):
            out += [(p.shape[0] // 3,) + tuple(p.shape[1:])] * 3
        else:
            out.append(tuple(p.shape))
    return out


class ZooParamsTest(unittest.TestCase):
    def check_small(self, model):
        for cfg in SMALL[model]:
            with self.subTest(model=model, cfg=cfg):
                zoo = U.zoo(model, **cfg)
                m = torch_module(model, cfg)
                self.assertEqual(zoo["parameters"], M.num_params(m),
                                 f"{model} {cfg}")
                self.assertEqual(zoo["trainable_parameters"], M.num_params(m))
                print(f"  {model} {cfg}: zoo {zoo['parameters']} == torch "
                      f"{M.num_params(m)} parameters")
                graph = U.zoo_graph(model, **cfg)
                zoo_shapes = sorted(tuple(int(d) for d in p["tensor"]["shape"])
                                    for p in graph["parameters"])
                torch_shapes = sorted(torch_param_shapes(m))
                self.assertEqual(zoo_shapes, torch_shapes)
                loss = m(**example_inputs(model, cfg))
                self.assertEqual(loss.shape, ())
                self.assertTrue(torch.isfinite(loss))

    def check_defaults(self, model):
        cfg = DEFAULTS[model]
        zoo = U.zoo(model)
        m = torch_module(model, cfg, device="meta") if model != "vgg" else \
            torch_module(model, cfg)
        self.assertEqual(zoo["parameters"], M.num_params(m), model)
        print(f"  {model} defaults: zoo {zoo['parameters']} == torch "
              f"{M.num_params(m)} parameters")

    def test_mlp_small(self):
        self.check_small("mlp")

    def test_mlp_defaults(self):
        self.check_defaults("mlp")

    def test_gpt_small(self):
        self.check_small("gpt")

    def test_gpt_defaults(self):
        self.check_defaults("gpt")

    def test_vit_small(self):
        self.check_small("vit")

    def test_vit_defaults(self):
        self.check_defaults("vit")

    def test_transformer_small(self):
        self.check_small("transformer")

    def test_transformer_defaults(self):
        self.check_defaults("transformer")

    def test_vgg_small(self):
        self.check_small("vgg")

    def test_vgg_defaults(self):
        self.check_defaults("vgg")

    def test_defaults_match(self):
        """DEFAULTS above are the zoo's own defaults."""
        for model, cfg in DEFAULTS.items():
            with self.subTest(model=model):
                a, b = U.zoo(model), U.zoo(model, **cfg)
                for k in ("parameters", "forward_flops", "ops"):
                    self.assertEqual(a[k], b[k], f"{model}.{k}")


if __name__ == "__main__":
    U.main("zoo_torch_params_test")
