"""Review cases for the exporter's audio-era features (shape-traced
forwards, random draws while tracing): each a defect found in review,
checked against PyTorch or against the caller's module being left as it
was."""

import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402,F401  (sets sys.path)
from export_test_case import ExportTestCase  # noqa: E402
import export_fx  # noqa: E402


class ShapeBranchWithBatchNorm(nn.Module):
    """A forward that branches on a shape (so it is traced with the
    example's shapes) around a BatchNorm1d and a Dropout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):
        if x.ndim == 2:
            x = x.unsqueeze(1).expand(-1, 3, -1)
        y = self.drop(self.bn(self.conv(x))).mean(-1)
        return F.cross_entropy(self.fc(y), labels)


class ShapeTracedExportTest(ExportTestCase):
    def test_a_shape_traced_export_leaves_buffers_and_random_stream(self):
        m = ShapeBranchWithBatchNorm()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        inputs = {"x": torch.randn(2, 3, 9) * 3 + 1,
                  "labels": torch.tensor([0, 1])}
        torch.manual_seed(5)
        expected_draw = torch.rand(4)
        torch.manual_seed(5)
        g = export_fx.export(m, inputs)
        self.assertTrue(torch.equal(torch.rand(4), expected_draw),
                        "the export drew from the caller's random stream")
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]),
                            f"{k} moved: {before[k]} -> {v}")
        # The graph's buffers are the module's: unit variances, zero means.
        inits = {p["tensor"]["name"]: p["init"] for p in g["parameters"]}
        self.assertEqual(inits["bn.running_mean"]["kind"], "ZEROS")
        self.assertEqual(inits["bn.running_var"]["kind"], "ONES")


if __name__ == "__main__":
    unittest.main()
