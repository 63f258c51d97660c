"""Assignment into a slice of a computed tensor through the exporter
(tools/fx_export/slice_assign.py): `x[idx] = v` and `x[idx] += y` become
x * keep + pad(v) for the later uses of x, with PyTorch's loss and
gradients in float64 (the reference evaluator, tests/hap_ir_eval.py).
torchvision's mvit_v2_s adds its relative positions into its attention
scores so (`attn[:, :, 1:, 1:] += rel_pos`) and now exports with PyTorch's
parameter count. Indices that are not basic, and a view of x taken before
the assignment and used after it, fail naming the node."""

import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402

try:
    import torchvision.models.video as tv_video
except ImportError:
    tv_video = None


class Assigned(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.g = nn.Linear(5, 2)
        self.head = nn.Linear(6, 3)
        self.how = how

    def forward(self, x, labels):
        h = self.fc(x)  # [n, 4, 6]
        y = self.g(x)   # [n, 4, 2]
        if self.how == "augmented":
            h[:, 1:, 2:4] += y[:, 1:]
        elif self.how == "assigned":
            h[:, :, 4:] = y * 3
        elif self.how == "broadcast":
            h[..., 0] = y[:, :, 1]
        elif self.how == "number":
            h[:, 2] = 0.5
        elif self.how == "twice":
            h[:, 1:, 2:4] += y[:, 1:]
            h[:, 0, :2] = y[:, 0] * 2
            h[:, 2:] *= 0.5
            h[:, :1, 3] -= y[:, :1, 0]
        return F.cross_entropy(self.head(F.relu(h)).mean(1), labels)


class ExportSliceAssignTest(ExportTestCase):
    def test_assignments_give_pytorchs_loss_and_gradients(self):
        inputs = {"x": torch.randn(3, 4, 5, dtype=torch.float64),
                  "labels": torch.tensor([0, 2, 1])}
        for how in ("augmented", "assigned", "broadcast", "number",
                    "twice"):
            with self.subTest(how=how):
                torch.manual_seed(0)
                g, _ = self.assert_loss_and_gradients(
                    Assigned(how).double(), inputs, tol=1e-10)
                self.assertTrue(all(op["type"] != "setitem"
                                    for op in g["ops"]))

    def test_what_cannot_be_assigned_fails_naming_the_node(self):
        class Stepped(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(5, 6)

            def forward(self, x, labels):
                h = self.fc(x)
                h[:, ::2] = 1.0
                return F.cross_entropy(h, labels)

        class EarlierView(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(5, 6)

            def forward(self, x, labels):
                h = self.fc(x)
                k = h[:, :3]
                h[:, 1:] = 0.0
                return F.cross_entropy(h, labels) + k.sum()

        for mod, needle in ((Stepped(), "is not basic"),
                            (EarlierView(), "a view of it taken before")):
            with self.subTest(module=type(mod).__name__):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(mod, {"x": torch.randn(2, 5),
                                           "labels": torch.tensor([0, 1])})
                self.assertIn("assigns into a slice of 'fc'",
                              str(cm.exception))
                self.assertIn(needle, str(cm.exception))

    @unittest.skipIf(tv_video is None, "python3-torchvision is not installed")
    def test_mvit_v2_s_exports_with_pytorchs_parameter_count(self):
        class Clip(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = tv_video.mvit_v2_s(num_classes=5)

            def forward(self, x, labels):
                return F.cross_entropy(self.net(x), labels)

        m = Clip()
        g = export_fx.export(m, {"x": torch.randn(1, 3, 16, 224, 224),
                                 "labels": torch.tensor([3])})
        got = sum(int(torch.tensor(p["tensor"]["shape"]).prod())
                  for p in g["parameters"] if not p.get("frozen"))
        self.assertEqual(got, sum(p.numel() for p in m.parameters()))


if __name__ == "__main__":
    U.main("export_slice_assign_test")
