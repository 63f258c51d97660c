"""nn.LSTM through the platform (issue 20 item 1): a token model with a
two-layer nn.LSTM (its output and h_n[-1] both used) is exported with its
weights (tools/export_fx.py --weights), planned on two CPU ranks (data
parallel at an uneven split, and the synthesized plan), trained STEPS SGD
steps by hap-launch from `npy:` data, checkpointed and exported (hapctl
checkpoint export). Every run's parameters equal
PyTorch's own SGD steps of the single-device module on the same batches
(1e-4 relative, float32), and the runs equal each other (1e-5 relative):
the lstm kernels' gradients, the batch-sharded rule and its gradient sums
against the single-device program. (`hapctl plan` makes no one-device
plan, so PyTorch's steps are the single-device reference here;
executor/train/lstm_equivalence_test compares with our own single-device
program.)"""

import os
import subprocess
import unittest

import torch

import torch_test_util as util  # noqa: E402  (sets sys.path)
from weights_roundtrip_test import read_safetensors  # noqa: E402

LAUNCH = os.path.abspath(os.environ.get("HAP_LAUNCH", ""))
EXECUTOR = os.path.abspath(os.environ.get("HAP_EXECUTOR", ""))
CLUSTER = os.path.abspath(os.environ.get("CPU_CLUSTER", ""))

V, E, H, S, B, N, STEPS, LR = 13, 8, 12, 7, 6, 18, 3, 0.5

MODULE = f'''
import torch, torch.nn as nn, torch.nn.functional as F

class LstmLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding({V}, {E})
        self.lstm = nn.LSTM({E}, {H}, num_layers=2, batch_first=True)
        self.head = nn.Linear({H}, {V})
        self.last = nn.Linear({H}, {V}, bias=False)

    def forward(self, x, y):
        out, (h, c) = self.lstm(self.embed(x))
        logits = self.head(out) + self.last(h[-1]).unsqueeze(1)
        return F.cross_entropy(logits.reshape(-1, {V}), y.reshape(-1))

def make():
    torch.manual_seed(3)
    return LstmLM()
'''


def max_rel_err(got, want):
    scale = max(float(want.abs().max()), 1e-3)
    return float((got - want).abs().max()) / scale


class LstmTrainTest(unittest.TestCase):
    def test_trained_weights_equal_pytorch_and_each_other(self):
        d = util.tmpdir()
        lstmlm, source = util.module_from_source(d, "lstmlm", MODULE)
        model = lstmlm.make()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}

        graph = os.path.join(d, "model.json")
        weights = os.path.join(d, "init.safetensors")
        util.run([util.PYTHON, util.EXPORT_FX, "--module",
                  source + ":make",
                  "--input-shape", f"x={B},{S}:int64:{V}",
                  "--input-shape", f"y={B},{S}:int64:{V}",
                  "-o", graph, "--weights", weights])
        got = util.validate(graph)
        self.assertEqual(got["trainable_parameters"],
                         sum(p.numel() for p in model.parameters()))
        init = read_safetensors(weights)
        self.assertEqual(set(init), set(dict(model.named_parameters())))
        self.assertIn("lstm.weight_hh_l1", init)

        xs, ys, data = util.token_data(d, N, S, V)

        # PyTorch's own SGD steps: step k takes rows k*B .. k*B+B-1 mod N.
        ref = lstmlm.make()
        ref.load_state_dict(start)
        for k in range(STEPS):
            rows = [(k * B + j) % N for j in range(B)]
            ref.zero_grad()
            ref(xs[rows], ys[rows]).backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p -= LR * p.grad
        want = {k: v.detach() for k, v in ref.named_parameters()}

        runs = {}
        for name, args in (("dp-uneven", ["--baseline", "dp-prop",
                                          "--ratios", "0.67,0.33"]),
                           ("hap", [])):
            plan = os.path.join(d, f"{name}.pb")
            util.run([util.HAPCTL, "plan", "--graph", graph, "--cluster",
                      CLUSTER, "--optimizer", "sgd", "--lr", str(LR),
                      "--save-plan", plan] + args)
            ckpt = os.path.join(d, f"ckpt_{name}")
            p = subprocess.run([LAUNCH, "--executor", EXECUTOR, "--plan", plan,
                                "--steps", str(STEPS), "--data", "npy:" + data,
                                "--init-weights", weights,
                                "--checkpoint-dir", ckpt],
                               capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            out = os.path.join(d, f"{name}.safetensors")
            util.run([util.HAPCTL, "checkpoint", "export", ckpt, "-o", out])
            runs[name] = read_safetensors(out)
            self.assertEqual(set(runs[name]), set(want), name)
            worst = 0.0
            for k, w in want.items():
                err = max_rel_err(runs[name][k], w)
                worst = max(worst, err)
                self.assertLessEqual(err, 1e-4, f"{name}: {k}: {err}")
                self.assertFalse(torch.equal(w, start[k]), f"{k} did not train")
            print(f"  {name}: largest relative difference from PyTorch "
                  f"{worst:.3g}")
        for k in want:
            err = max_rel_err(runs["hap"][k], runs["dp-uneven"][k])
            self.assertLessEqual(err, 1e-5, f"hap vs dp-uneven: {k}")


if __name__ == "__main__":
    util.main("lstm_train_test")
