"""tools/export_fx.py leaves the user's module as it was, and refuses
reparametrized tensors by name:
- attributes forward sets (`self.cache = y`, a counter, a list appended
  to, an attribute of a submodule) were left as torch.fx Proxy objects or
  traced values on the module after export; fx's `_tensor_constant<N>`
  attributes stayed on it; every module's training flag came back as the
  root's. Now the module's attributes are as before export, also after an
  export that fails.
- torch.nn.utils.parametrize (parametrizations.orthogonal,
  parametrizations.spectral_norm, register_parametrization),
  torch.nn.utils.spectral_norm and torch.nn.utils.prune failed with
  "uses a tensor that is not a parameter of the module" or "forward must
  return the scalar loss tensor"; each is refused naming the tensor and
  the call that removes it before export (after which the export gives
  PyTorch's loss and gradients in float64)."""

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402


class Caching(nn.Module):
    """Sets attributes in forward, of itself and of a submodule, and uses
    a plain tensor attribute (fx stores it as a `_tensor_constant`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.cache, self.calls, self.history = None, 0, []
        self.offset = torch.full((3,), 0.5, dtype=torch.float64)

    def forward(self, x):
        y = self.norm(self.lin(x)) + self.offset
        self.cache = y
        self.calls += 1
        self.history.append(y)
        self.lin.last_input = x
        return (y * y).sum()


def attributes(m):
    """{module path: a copy of its __dict__, lists and dicts copied}."""
    out = {}
    for path, mod in m.named_modules():
        out[path] = {k: (list(v) if isinstance(v, list) else
                         dict(v) if isinstance(v, dict) else v)
                     for k, v in vars(mod).items()}
    return out


def assert_same_attributes(test, before, after):
    test.assertEqual(list(before), list(after))
    for path in before:
        test.assertEqual(list(before[path]), list(after[path]), path)
        for k, v in before[path].items():
            w = after[path][k]
            if isinstance(v, (list, dict)):
                test.assertEqual(len(v), len(w), f"{path}.{k}")
                items = (zip(v, w) if isinstance(v, list) else
                         ((v[i], w[i]) for i in v))
                for a, b in items:
                    test.assertIs(a, b, f"{path}.{k}")
            else:
                test.assertIs(v, w, f"{path}.{k}")


class ExportModuleUntouchedTest(ExportTestCase):
    def assert_untouched(self, m, export):
        """export() of m leaves every attribute of every module of m as it
        was (no Proxy anywhere)."""
        before = attributes(m)
        export()
        after = attributes(m)
        for path, attrs in after.items():
            for k, v in attrs.items():
                self.assertNotIsInstance(v, fx.Proxy, f"{path}.{k}")
        assert_same_attributes(self, before, after)

    def test_attributes_set_in_forward_are_put_back(self):
        m = Caching().double()
        m.train()
        m.norm.eval()  # a mixed training state stays mixed
        x = torch.randn(2, 4, dtype=torch.float64)
        self.assert_untouched(m, lambda: export_fx.export(m, {"x": x}))
        self.assertIsNone(m.cache)
        self.assertEqual(m.calls, 0)
        self.assertEqual(m.history, [])
        self.assertFalse(hasattr(m.lin, "last_input"))
        self.assertFalse(any(k.startswith("_tensor_constant")
                             for k in vars(m)))
        self.assertTrue(m.training)
        self.assertFalse(m.norm.training)
        # The module still runs as before, and its graph computes PyTorch's
        # loss and gradients.
        m.train()
        self.assert_loss_and_gradients(m, {"x": x}, tol=1e-10)
        self.assertEqual(m.calls, 1)  # PyTorch's forward of the check
        self.assertIsInstance(m.cache, torch.Tensor)

    def test_with_a_loss_function_and_an_eval_module(self):
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 3)
                self.seen = None

            def forward(self, x):
                self.seen = x
                return self.lin(x)

        m = Head().eval()
        self.assert_untouched(m, lambda: export_fx.export(
            m, {"x": torch.randn(2, 4), "labels": torch.tensor([0, 2])},
            loss=nn.CrossEntropyLoss()))
        self.assertFalse(m.training)
        self.assertIsNone(m.seen)

    def test_an_export_that_fails_leaves_the_module_as_it_was(self):
        class Fails(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 3)
                self.cache = None

            def forward(self, x):
                self.cache = self.lin(x)
                return torch.sign(self.cache).sum()  # not supported

        m = Fails()

        def export():
            with self.assertRaises(export_fx.ExportError):
                export_fx.export(m, {"x": torch.randn(2, 4)})

        self.assert_untouched(m, export)
        self.assertIsNone(m.cache)

    def test_reparametrized_tensors_are_refused_by_name(self):
        class Sym(nn.Module):
            def forward(self, w):
                return w.triu() + w.triu(1).t()

        class Model(nn.Module):
            def __init__(self, wrap):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
                self.body[0] = wrap(self.body[0])

            def forward(self, x):
                return self.body(x).sum()

        P = torch.nn.utils.parametrizations
        remove = "torch.nn.utils.parametrize.remove_parametrizations(" \
                 "model.body.0, 'weight')"
        cases = [
            ("orthogonal", P.orthogonal,
             ["'body.0.weight' (Linear)", "torch.nn.utils.parametrize",
              "_Orthogonal", remove]),
            ("parametrizations.spectral_norm", P.spectral_norm,
             ["'body.0.weight' (Linear)", "_SpectralNorm", remove]),
            ("register_parametrization",
             lambda mod: parametrize.register_parametrization(
                 mod, "weight", Sym()) and mod,
             ["'body.0.weight' (Linear)", "(Sym)", remove]),
            ("spectral_norm", torch.nn.utils.spectral_norm,
             ["torch.nn.utils.spectral_norm of 'body.0.weight' (Linear)",
              "'weight_u'", "'weight_v'",
              "torch.nn.utils.remove_spectral_norm(model.body.0, "
              "'weight')"]),
            ("prune", lambda mod: prune.l1_unstructured(mod, "weight", 0.5),
             ["torch.nn.utils.prune of 'body.0.weight' (Linear)",
              "torch.nn.utils.prune.remove(model.body.0, 'weight')"]),
        ]
        for what, wrap, needles in cases:
            with self.subTest(what=what):
                torch.manual_seed(0)
                m = Model(wrap).double()
                x = torch.randn(3, 4, dtype=torch.float64)
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(m, {"x": x})
                for needle in needles:
                    self.assertIn(needle, str(cm.exception))
                # What the message says to do, done: the export gives
                # PyTorch's loss and gradients.
                mod = m.body[0]
                if what == "spectral_norm":
                    torch.nn.utils.remove_spectral_norm(mod, "weight")
                elif what == "prune":
                    prune.remove(mod, "weight")
                else:
                    parametrize.remove_parametrizations(mod, "weight")
                self.assert_loss_and_gradients(m, {"x": x}, tol=1e-10)

    def test_a_parametrized_module_at_the_root(self):
        m = torch.nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))

        class Loss(nn.Module):
            def __init__(self):
                super().__init__()
                self.m = m

            def forward(self, x):
                return self.m(x).sum()

        for module, where, call, arg in (
                (m, "'weight'", "(model, 'weight')", "input"),
                (Loss(), "'m.weight'", "(model.m, 'weight')", "x")):
            with self.subTest(where=where):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(module, {arg: torch.randn(2, 4)})
                self.assertIn(where, str(cm.exception))
                self.assertIn(call, str(cm.exception))


if __name__ == "__main__":
    U.main("export_module_untouched_test")
