"""The exporter tests' common base: a temporary directory for the graphs,
a fixed seed per test, and the two checks they make of an exported model
(`hapctl validate` takes the graph; its loss and gradients, evaluated by
tests/hap_ir_eval.py, equal PyTorch's)."""

import json
import os
import unittest

import torch

import torch_test_util as U  # noqa: E402  (sets sys.path)
import export_fx  # noqa: E402
import hap_ir_eval  # noqa: E402


class ExportTestCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = U.tmpdir()
        cls.n = 0

    def setUp(self):
        torch.manual_seed(0)

    def path(self, stem):
        """A new file name in the class's directory."""
        type(self).n += 1
        return os.path.join(self.dir, f"{stem}_{self.n}.json")

    def export_valid(self, module, inputs):
        """(graph, values), the graph written and `hapctl validate`d."""
        g, values = export_fx.export(module, inputs, return_values=True)
        path = self.path(g["name"])
        with open(path, "w") as f:
            json.dump(g, f)
        U.validate(path)  # raises naming hapctl's error
        return g, values

    def assert_loss_and_gradients(self, module, inputs, tol=1e-5):
        """The graph's loss and parameter gradients (the reference
        evaluator under autograd) equal PyTorch's (training mode: batch
        statistics, no dropout in these models)."""
        g, values = self.export_valid(module, inputs)
        module.train()
        module.zero_grad()
        ref = module(**inputs)
        ref.backward()
        vals = {k: v.detach().clone().requires_grad_(v.is_floating_point())
                for k, v in values.items()}
        got = hap_ir_eval.evaluate(g, inputs, vals)
        got.backward()
        self.assertAlmostEqual(float(ref), float(got),
                               delta=tol * max(1.0, abs(float(ref))))
        for name, p in module.named_parameters():
            if name not in vals:
                continue
            grad = vals[name].grad
            if p.grad is None:
                # PyTorch gives it none (it is reached only through
                # detached values): nor may the graph.
                self.assertTrue(grad is None or not bool(grad.any()),
                                f"{name}: PyTorch gives no gradient, the "
                                f"graph {grad}")
                continue
            self.assertIsNotNone(grad, name)
            self.assertTrue(torch.allclose(grad.double(), p.grad.double(),
                                           atol=tol, rtol=tol),
                            f"{name}: graph gradient {grad} vs PyTorch "
                            f"{p.grad}")
        return g, values
