"""bf16 mixed precision against PyTorch's CPU autocast (issue 16 item 3).

For each zoo model (small configurations, no dropout) bench/step_worker
trains the single-device program 20 steps (SGD, lr 0.01, momentum 0.9) with
--precision bf16 and with fp32, and dumps the graph, the initial parameters
and every step's batch. Here PyTorch replays the same training on the same
weights and batches through tests/hap_ir_eval.py: in fp32, and under
torch.autocast("cpu", dtype=torch.bfloat16) with fp32 parameters (autocast's
own master weights) and torch.optim.SGD.

Checks: the fp32 replays agree to 1e-4 (the harness is faithful); our bf16
losses are within bf16 tolerance of autocast's, step by step (0.5% of the
loss: a bf16 rounding is 2^-9 relative, and 20 steps of training amplify
the two programs' different rounding points; measured at most 0.09%, vit,
and the mlp's equal to 5 digits); bf16 really ran (our bf16 losses are not
our fp32 ones).
"""

import json
import os
import subprocess
import unittest

import torch

import torch_test_util as util
from hap_ir_eval import evaluate

STEP_WORKER = os.environ.get("STEP_WORKER") or os.path.join(
    util.HERE, "..", "bazel-bin", "bench", "step_worker")
STEPS = 20
LR, MOMENTUM = 0.01, 0.9

MODELS = {
    "mlp": dict(layers=2, hidden=64, input=32, classes=10, batch=16),
    "gpt": dict(layers=2, hidden=64, heads=4, ffn=128, seq=16, vocab=100,
                batch=4, dropout=0),
    "transformer": dict(layers=2, hidden=64, heads=4, ffn=128, seq=16,
                        classes=10, batch=4, dropout=0),
    "vit": dict(layers=2, hidden=64, heads=4, ffn=128, image=16, patch=4,
                channels=3, classes=10, batch=4, dropout=0),
    "vgg": dict(width=8, stages=2, convs_per_stage=2, image=16, channels=3,
                classes=10, hidden=32, batch=4),
}

_DTYPES = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64,
           "i32": torch.int32}


def tensor(t):
    return torch.tensor(t["data"], dtype=_DTYPES[t["dtype"]]).reshape(t["shape"])


def _ints(graph):
    """proto3 JSON writes int64 as strings: attribute integers back to int."""
    for op in graph["ops"]:
        for a in op.get("attrs", {}).values():
            if "i" in a:
                a["i"] = int(a["i"])
            if "ints" in a:
                a["ints"]["values"] = [int(v) for v in a["ints"].get("values", [])]
    return graph


def ours(model, params, precision):
    path = os.path.join(util.tmpdir(), f"{model}_{precision}.json")
    cmd = [STEP_WORKER, "--model", model, "--threads", "1", "--warmup", "0",
           "--steps", str(STEPS), "--precision", precision, "--dump", path]
    for k, v in params.items():
        cmd += [f"--{k}", str(v)]
    util.run(cmd)
    with open(path) as f:
        d = json.load(f)
    _ints(d["graph"])
    return d


def replay(dump, autocast):
    params = {k: tensor(v).requires_grad_(True) for k, v in dump["params"].items()}
    opt = torch.optim.SGD(list(params.values()), lr=LR, momentum=MOMENTUM)
    losses = []
    for batch in dump["batches"]:
        inputs = {k: tensor(v) for k, v in batch.items()}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = evaluate(dump["graph"], inputs, params)
        loss = loss.float()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for p in params.values():
        assert p.dtype == torch.float32  # autocast's masters stay fp32
    return losses


class Bf16AutocastTest(unittest.TestCase):
    pass


def _make(model, params):
    def test(self):
        d32 = ours(model, params, "fp32")
        d16 = ours(model, params, "bf16")
        ours32, ours16 = d32["timed"]["losses"], d16["timed"]["losses"]
        torch32 = replay(d32, autocast=False)
        torch16 = replay(d16, autocast=True)
        print(f"\n{model}: step ours-bf16 torch-autocast ours-fp32 torch-fp32")
        for s in range(STEPS):
            print(f"  {s:2d} {ours16[s]:.5f} {torch16[s]:.5f} "
                  f"{ours32[s]:.5f} {torch32[s]:.5f}")
        for s in range(STEPS):
            self.assertAlmostEqual(ours32[s], torch32[s],
                                   delta=1e-4 * abs(torch32[s]) + 1e-5,
                                   msg=f"fp32 step {s}")
            self.assertAlmostEqual(ours16[s], torch16[s],
                                   delta=5e-3 * abs(torch16[s]),
                                   msg=f"bf16 step {s}")
        self.assertGreater(max(abs(a - b) for a, b in zip(ours16, ours32)), 1e-5,
                           "the bf16 losses equal the fp32 ones")
        # Both bf16 runs trained: their losses moved the same way.
        self.assertLess(abs((ours16[-1] - ours16[0]) - (torch16[-1] - torch16[0])),
                        0.25 * abs(torch16[-1] - torch16[0]) + 2e-2)
    return test


for _m, _p in MODELS.items():
    setattr(Bf16AutocastTest, f"test_{_m}", _make(_m, _p))


if __name__ == "__main__":
    util.main("bf16_autocast_test")
