"""Attention key padding masks through tools/export_fx.py (issue 20 item
1): nn.MultiheadAttention's key_padding_mask and the src/tgt/memory
key_padding_mask of nn.TransformerEncoder(Layer), nn.TransformerDecoder(Layer)
and nn.Transformer, as a bool graph input or computed from the tokens
(tokens == pad_id), and float (additive) masks.

The exported graphs compute PyTorch's loss (the reference evaluator,
tests/hap_ir_eval.py); one SGD step of hap-executor on 2 ranks with two
plans (the synthesized plan and data parallel) gives the single-device
program's (PyTorch's) loss and gradients (from the parameters before and
after the step, in float64);
masks the IR cannot express fail with a message that names them."""

import json
import os
import subprocess
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_test_util as U  # noqa: E402  (sets sys.path)
import export_fx  # noqa: E402
import hap_ir_eval  # noqa: E402
import safetensors_io  # noqa: E402

LAUNCH = os.path.abspath(os.environ.get("HAP_LAUNCH", ""))
EXECUTOR = os.path.abspath(os.environ.get("HAP_EXECUTOR", ""))
CPU_CLUSTER = os.path.abspath(os.environ.get("CPU_CLUSTER", ""))

V, E, H, B, S, T, LR = 13, 16, 2, 4, 6, 5, 0.1


class PaddedSeq2Seq(nn.Module):
    """nn.Transformer over token embeddings: the source's padding mask is
    computed from its tokens (pad id 0) and also hides the memory from the
    decoder; the target's is a bool input, with a causal target mask."""

    def __init__(self):
        super().__init__()
        self.src_embed = nn.Embedding(V, E)
        self.tgt_embed = nn.Embedding(V, E)
        self.tf = nn.Transformer(E, H, num_encoder_layers=2,
                                 num_decoder_layers=1, dim_feedforward=24,
                                 dropout=0.0, batch_first=True)
        self.head = nn.Linear(E, V)

    def forward(self, src, tgt, tgt_pad, labels):
        src_pad = src == 0
        causal = self.tf.generate_square_subsequent_mask(tgt.size(1))
        h = self.tf(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=causal,
                    src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                    memory_key_padding_mask=src_pad)
        return F.cross_entropy(self.head(h).reshape(-1, V), labels.reshape(-1))


class SeqFirstAttention(nn.Module):
    """A sequence-first nn.MultiheadAttention with a float attn_mask input
    and a bool key_padding_mask input (PyTorch fills the padded keys of the
    float mask with -inf), then one with a float (additive) padding mask."""

    def __init__(self):
        super().__init__()
        self.a1 = nn.MultiheadAttention(E, H)
        self.a2 = nn.MultiheadAttention(E, H, batch_first=True)
        self.head = nn.Linear(E, V)

    def forward(self, x, attn, pad, fpad, labels):
        h, _ = self.a1(x, x, x, attn_mask=attn, key_padding_mask=pad)
        h = h.transpose(0, 1)
        h, _ = self.a2(h, h, h, key_padding_mask=fpad)
        return F.cross_entropy(self.head(h).reshape(-1, V), labels.reshape(-1))


def source_tokens(gen):
    """[B, S] ids in 1..V-1 with trailing pads (0): row i keeps S - i keys
    (every row keeps at least one, so PyTorch's result has no NaN)."""
    src = torch.randint(1, V, (B, S), generator=gen)
    for i in range(B):
        src[i, S - i:] = 0
    return src


def seq2seq_inputs(gen):
    tgt = torch.randint(1, V, (B, T), generator=gen)
    tgt_pad = torch.zeros(B, T, dtype=torch.bool)
    tgt_pad[1, 3:] = True
    tgt_pad[3, 1:] = True  # causal: the first key stays for every query
    return {"src": source_tokens(gen), "tgt": tgt, "tgt_pad": tgt_pad,
            "labels": torch.randint(0, V, (B, T), generator=gen)}


def ir_inputs(inputs):
    """Bool inputs are 0/1 integer inputs in the graph."""
    return {k: v.long() if v.dtype == torch.bool else v
            for k, v in inputs.items()}


class AttentionPaddingTest(unittest.TestCase):
    def check_loss(self, m, inputs):
        g, values = export_fx.export(m, inputs, return_values=True)
        path = os.path.join(U.tmpdir(), "g.json")
        with open(path, "w") as f:
            json.dump(g, f)
        U.validate(path)
        want = float(m(**inputs))
        got = float(hap_ir_eval.evaluate(g, ir_inputs(inputs), values))
        self.assertAlmostEqual(got, want, delta=1e-5 * abs(want))
        return g

    def test_transformer_masks_give_pytorchs_loss(self):
        torch.manual_seed(1)
        m = PaddedSeq2Seq()
        inputs = seq2seq_inputs(torch.Generator().manual_seed(2))
        g = self.check_loss(m, inputs)
        # The bool input is an integer input; the source's mask (computed
        # once) serves the 2 encoder layers and the decoder's cross
        # attention, the target's its self-attention.
        dtypes = {i["tensor"]["name"]: i["tensor"]["dtype"]
                  for i in g["inputs"]}
        self.assertEqual(dtypes["tgt_pad"], "INT64")
        masks = {op["outputs"][0]: op["inputs"][0] for op in g["ops"]
                 if op["type"] == "embedding" and
                 op["name"].endswith(".padding_additive")}
        self.assertEqual(sorted(masks.values()), ["src", "tgt_pad"])
        users = [op for op in g["ops"] if op["type"] in ("softmax", "add") and
                 any(i.endswith(".padding_mask") for i in op["inputs"])]
        self.assertEqual(len(users), 4)
        # Without the masks the loss differs: they are not ignored.
        x = dict(inputs, tgt_pad=torch.zeros(B, T, dtype=torch.bool))
        self.assertNotAlmostEqual(float(m(**x)), float(m(**inputs)),
                                  places=4)

    def test_float_attn_mask_and_float_padding_mask(self):
        torch.manual_seed(3)
        m = SeqFirstAttention()
        gen = torch.Generator().manual_seed(4)
        pad = source_tokens(gen) == 0
        fpad = torch.randn(B, S, generator=gen)
        fpad[0, 2] = float("-inf")
        inputs = {"x": torch.randn(S, B, E, generator=gen),
                  "attn": torch.randn(S, S, generator=gen), "pad": pad,
                  "fpad": fpad,
                  "labels": torch.randint(0, V, (B, S), generator=gen)}
        self.check_loss(m, inputs)

    def test_masks_the_ir_lacks_fail_naming_them(self):
        class Masked(nn.Module):
            def __init__(self, how):
                super().__init__()
                self.how = how
                self.embed = nn.Embedding(V, E)
                self.attn = nn.MultiheadAttention(E, H, batch_first=True)

            def forward(self, tokens, ids, attn, fpad, labels):
                x = self.embed(tokens)
                if self.how == "range":  # ids no embedding bounds
                    h, _ = self.attn(x, x, x, key_padding_mask=ids == 0)
                elif self.how == "float+attn":
                    h, _ = self.attn(x, x, x, attn_mask=attn,
                                     key_padding_mask=fpad)
                else:  # a bool tensor used as a number
                    h = x * (tokens == 0).unsqueeze(-1)
                return F.cross_entropy(h.sum(-1), labels)

        gen = torch.Generator().manual_seed(5)
        inputs = {"tokens": source_tokens(gen), "ids": source_tokens(gen),
                  "attn": torch.randn(S, S, generator=gen),
                  "fpad": torch.randn(B, S, generator=gen),
                  "labels": torch.randint(0, S, (B,), generator=gen)}
        for how, needle in (("range", "whose range is unknown"),
                            ("float+attn", "with an attn_mask"),
                            ("arith", "only as an attention key_padding")):
            with self.subTest(how=how):
                with self.assertRaises(export_fx.ExportError) as cm:
                    export_fx.export(Masked(how), inputs)
                self.assertIn(needle, str(cm.exception))

    def test_one_step_on_two_ranks_gives_pytorchs_gradients(self):
        torch.manual_seed(6)
        m = PaddedSeq2Seq().double()
        inputs = seq2seq_inputs(torch.Generator().manual_seed(7))
        d, graph, weights, data = U.export_for_training(m, inputs)

        # PyTorch's loss and gradients on the same weights and batch.
        m.load_state_dict(safetensors_io.read(weights), strict=False)
        m.zero_grad()
        loss = m(**inputs)
        loss.backward()
        want = {k: p.grad for k, p in m.named_parameters()}
        start = safetensors_io.read(weights)

        for baseline in ("hap", "dp-even"):
            with self.subTest(baseline=baseline):
                plan = os.path.join(d, f"{baseline}.pb")
                U.run([U.HAPCTL, "plan", "--cluster", CPU_CLUSTER, "--graph",
                       graph, "--baseline", baseline, "--optimizer", "sgd",
                       "--lr", str(LR), "--save-plan", plan,
                       "--max-seconds", "5"])
                ckpt = plan + ".ckpt"
                p = subprocess.run(
                    [LAUNCH, "--executor", EXECUTOR, "--plan", plan,
                     "--steps", "1", "--data", "npy:" + data,
                     "--init-weights", weights, "--checkpoint-dir", ckpt],
                    capture_output=True, text=True, timeout=300)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got_loss = [float(line.split()[3])
                            for line in p.stdout.splitlines()
                            if line.startswith("step 0 ")]
                self.assertEqual(len(got_loss), 1, p.stdout)
                self.assertAlmostEqual(got_loss[0], float(loss), delta=1e-5)
                out = ckpt + ".safetensors"
                U.run([U.HAPCTL, "checkpoint", "export", ckpt, "-o", out])
                after = safetensors_io.read(out)
                for k, w in want.items():
                    grad = (start[k] - after[k]) / LR
                    scale = max(float(w.abs().max()), 1e-6)
                    err = float((grad - w).abs().max())
                    self.assertLessEqual(err, 1e-7 + 1e-6 * scale,
                                         f"{k}: gradient off by {err}")


if __name__ == "__main__":
    U.main("attention_padding_test")
