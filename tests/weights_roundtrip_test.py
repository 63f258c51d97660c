"""A PyTorch module that is not a zoo mirror (embedding, a pre-norm
nn.TransformerEncoder with nn.MultiheadAttention, a linear head) goes
through the whole platform and back: exported with its weights
(tools/export_fx.py --weights), trained N steps by hap on 2 ranks from
`npy:` data with SGD (hap-launch --init-weights), checkpointed, exported
(hapctl checkpoint export), loaded into the module with load_state_dict:
its parameters equal PyTorch's own N SGD steps on the same batches within
1e-4 relative. Every safetensors file is also read by a reader written
here from the format's specification, not by our code."""

import json
import os
import struct
import sys
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_test_util as util  # noqa: E402

HAPCTL = util.HAPCTL
EXPORT_FX = util.EXPORT_FX
LAUNCH = os.path.abspath(os.environ.get("HAP_LAUNCH", ""))
EXECUTOR = os.path.abspath(os.environ.get("HAP_EXECUTOR", ""))
CLUSTER = os.path.abspath(os.environ.get("CPU_CLUSTER", ""))

V, E, HEADS, FFN, S, B, N, STEPS, LR = 17, 16, 2, 32, 6, 8, 20, 4, 0.1

MODULE = f'''
import torch, torch.nn as nn, torch.nn.functional as F

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding({V}, {E})
        layer = nn.TransformerEncoderLayer({E}, {HEADS}, dim_feedforward={FFN}, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear({E}, {V})

    def forward(self, x, y):
        logits = self.head(self.encoder(self.embed(x)))
        return F.cross_entropy(logits.reshape(-1, {V}), y.reshape(-1))

def make():
    torch.manual_seed(11)
    return TinyLM()
'''

_DTYPES = {"F32": (torch.float32, 4), "F64": (torch.float64, 8), "I64": (torch.int64, 8),
           "BOOL": (torch.bool, 1),
           "I32": (torch.int32, 4)}


def read_safetensors(path):
    """From the specification: u64 LE header size, JSON header, data buffer."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, size = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // size
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype, count=count)
        out[name] = t.reshape(entry["shape"])
    return out


def train_and_export(d, graph, weights, data, plan_flags=()):
    """`graph` planned (SGD at LR, `plan_flags` added) on the cluster,
    trained STEPS steps from `weights` on the npy `data` with a checkpoint,
    and that exported: the export's path and hapctl's run (its stderr names
    what it cannot write); the launch's run too when `plan_flags`."""
    plan = os.path.join(d, "plan.pb")
    util.run([HAPCTL, "plan", "--graph", graph, "--cluster", CLUSTER, "--optimizer", "sgd",
              "--lr", str(LR), "--save-plan", plan, *plan_flags])
    ckpt = os.path.join(d, "ckpt")
    launch = util.run([LAUNCH, "--executor", EXECUTOR, "--plan", plan, "--steps", str(STEPS),
                       "--data", "npy:" + data, "--init-weights", weights,
                       "--checkpoint-dir", ckpt])
    out = os.path.join(d, "trained.safetensors")
    exported = util.run([HAPCTL, "checkpoint", "export", ckpt, "-o", out])
    return (out, exported, launch) if plan_flags else (out, exported)


class WeightsRoundTripTest(unittest.TestCase):
    def test_trained_weights_equal_pytorch_sgd(self):
        d = util.tmpdir()
        tinylm, source = util.module_from_source(d, "tinylm", MODULE)
        model = tinylm.make()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}

        graph, weights = os.path.join(d, "model.json"), os.path.join(d, "init.safetensors")
        util.run([util.PYTHON, EXPORT_FX, "--module", source + ":make",
                  "--input-shape", f"x={B},{S}:int64:{V}", "--input-shape", f"y={B},{S}:int64:{V}",
                  "-o", graph, "--weights", weights])
        # The weights file holds the module's parameters under state_dict names.
        init = read_safetensors(weights)
        params = dict(model.named_parameters())
        self.assertEqual(set(init), set(params))
        for k, v in init.items():
            self.assertTrue(torch.equal(v, start[k]), k)
        self.assertIn("encoder.layers.0.self_attn.in_proj_weight", init)

        # Data: npy files, one per input, N samples.
        xs, ys, data = util.token_data(d, N, S, V)

        out, _ = train_and_export(d, graph, weights, data)

        # PyTorch's own N SGD steps on the same batches: step k takes rows
        # k*B .. k*B+B-1 modulo N, in order.
        ref = tinylm.make()
        ref.load_state_dict(start)
        for k in range(STEPS):
            rows = [(k * B + j) % N for j in range(B)]
            ref.zero_grad()
            loss = ref(xs[rows], ys[rows])
            loss.backward()
            with torch.no_grad():
                for prm in ref.parameters():
                    prm -= LR * prm.grad

        trained = read_safetensors(out)
        self.assertEqual(set(trained), set(params))
        model.load_state_dict(trained, strict=True)
        for name, want in ref.named_parameters():
            got = dict(model.named_parameters())[name].detach()
            scale = max(float(want.abs().max()), 1e-3)
            err = float((got - want.detach()).abs().max())
            self.assertLessEqual(err, 1e-4 * scale, f"{name}: {err}")
            self.assertFalse(torch.equal(want.detach(), start[name]), f"{name} did not train")


TIED = f'''
import torch, torch.nn as nn, torch.nn.functional as F

class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding({V}, {E})
        self.mid = nn.Linear({E}, {E})
        self.bn = nn.BatchNorm1d({E})
        self.head = nn.Linear({E}, {V}, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's
        self.register_buffer("scale", torch.full(({E},), 0.5))
        self.register_buffer("ones", torch.ones({E}), persistent=False)
        # Folded into a constant through its slice; the rest is never used.
        self.register_buffer("window", torch.cat([torch.full(({E},), 2.0), torch.arange(3.0)]))
        self.register_buffer("keep", torch.tensor([True, False, True]))  # unused, BOOL
        self.mid.bias.requires_grad_(False)  # frozen, as in fine-tuning

    def forward(self, x, y):
        h = self.emb(x).reshape(-1, {E})
        h = self.mid(torch.relu(self.mid(h)))  # one module, used twice
        h = self.bn(h) * self.scale * self.ones * self.window[:{E}]
        return F.cross_entropy(self.head(h), y.reshape(-1))

def make():
    torch.manual_seed(5)
    return TiedLM()
'''


class TiedWeightsTest(unittest.TestCase):
    def test_tied_weights_and_buffers_round_trip(self):
        """One graph parameter for the tied pair (PyTorch's parameter count),
        a frozen one (requires_grad=False) frozen in the graph;
        --init-weights takes the file of model.state_dict() (both tied names,
        num_batches_tracked, the buffer `scale`, the buffer `window` folded
        into a constant through its slice, the unused BOOL buffer `keep`);
        training keeps them one tensor
        and equals PyTorch's SGD steps; the export holds every state_dict
        entry and no exporter constant, so load_state_dict(strict=True)
        takes it: both tied names, the running statistics, `scale`,
        `window` and `keep` as they were, and num_batches_tracked advanced from the
        file's value as PyTorch's own training loop advances it."""
        d = util.tmpdir()
        tied, source = util.module_from_source(d, "tiedlm", TIED)
        model = tied.make()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        graph, exported = os.path.join(d, "model.json"), os.path.join(d, "exported.safetensors")
        util.run([util.PYTHON, EXPORT_FX, "--module", source + ":make",
                  "--input-shape", f"x={B},{S}:int64:{V}", "--input-shape", f"y={B},{S}:int64:{V}",
                  "-o", graph, "--weights", exported])
        with open(graph) as f:
            g = json.load(f)
        trainable = [p["tensor"] for p in g["parameters"] if not p.get("frozen")]
        self.assertEqual(sorted(t["name"] for t in trainable),
                         sorted(["emb.weight", "mid.weight", "bn.weight", "bn.bias"]))
        self.assertEqual(sum(torch.Size(t["shape"]).numel() for t in trainable),
                         sum(p.numel() for p in model.parameters() if p.requires_grad))
        frozen = {p["tensor"]["name"] for p in g["parameters"] if p.get("frozen")}
        self.assertIn("mid.bias", frozen)
        w = read_safetensors(exported)
        self.assertEqual(set(w), set(start))
        self.assertTrue(torch.equal(w["head.weight"], start["emb.weight"]))
        self.assertTrue(torch.equal(w["window"], start["window"]))
        self.assertEqual(int(w["bn.num_batches_tracked"]), 0)

        # --init-weights from the whole state_dict, written by PyTorch's side.
        sys.path.insert(0, os.path.dirname(EXPORT_FX))
        import safetensors_io  # noqa: PLC0415
        # A model that has trained before: its counter is not 0.
        model.bn.num_batches_tracked.fill_(5)
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        init = os.path.join(d, "state_dict.safetensors")
        safetensors_io.write(init, dict(model.state_dict()))
        xs, ys, data = util.token_data(d, N, S, V)
        out, p = train_and_export(d, graph, init, data)
        self.assertNotIn("note:", p.stderr)  # nothing left out

        ref = tied.make()
        ref.load_state_dict(start)
        ref.train()
        for k in range(STEPS):
            rows = [(k * B + j) % N for j in range(B)]
            ref.zero_grad()
            ref(xs[rows], ys[rows]).backward()
            with torch.no_grad():
                for prm in ref.parameters():  # the tied one once
                    if prm.requires_grad:
                        prm -= LR * prm.grad

        trained = read_safetensors(out)
        self.assertEqual(set(trained), set(start))
        self.assertTrue(torch.equal(trained["head.weight"], trained["emb.weight"]))
        fresh = tied.make()
        fresh.load_state_dict(trained, strict=True)
        want = ref.state_dict()
        # PyTorch counted one forward of bn per step from the file's 5.
        self.assertEqual(int(want["bn.num_batches_tracked"]), 5 + STEPS)
        self.assertEqual(trained["bn.num_batches_tracked"].dtype, torch.int64)
        self.assertEqual(trained["bn.num_batches_tracked"].shape, torch.Size([]))
        self.assertEqual(int(trained["bn.num_batches_tracked"]),
                         int(want["bn.num_batches_tracked"]))
        self.assertTrue(torch.equal(trained["window"], start["window"]))
        self.assertTrue(torch.equal(trained["keep"], start["keep"]))
        for name in set(start) - {"bn.num_batches_tracked", "keep"}:  # checked above
            got, ref_value = trained[name], want[name]
            scale = max(float(ref_value.abs().max()), 1e-3)
            err = float((got - ref_value).abs().max())
            self.assertLessEqual(err, 1e-4 * scale, f"{name}: {err}")
            if name in ("mid.bias", "scale", "window"):
                self.assertTrue(torch.equal(got, start[name]), f"the frozen {name} changed")
            else:
                self.assertFalse(torch.equal(got, start[name]), f"{name} did not change")

    def test_num_batches_tracked_counts_steps_not_microbatches(self):
        """On a pipeline plan, num_batches_tracked advances by one per step,
        as in a PyTorch loop of one forward per step on the same global
        batch, and the export loads strictly. The plan has one microbatch:
        batch_norm's statistics are the whole batch's, so a plan of 4 is
        refused naming it (each microbatch would take its own, and the
        running statistics would move 4 times a step). The
        --init-weights file holds the tied tensor only as head.weight (as
        GPT-2 checkpoints hold lm_head.weight without transformer.wte.weight):
        the recorded tie makes it emb.weight."""
        d = util.tmpdir()
        tied, source = util.module_from_source(d, "tiedlm", TIED)
        model = tied.make()
        model.bn.num_batches_tracked.fill_(5)
        graph = os.path.join(d, "model.json")
        util.run([util.PYTHON, EXPORT_FX, "--module", source + ":make",
                  "--input-shape", f"x={B},{S}:int64:{V}", "--input-shape", f"y={B},{S}:int64:{V}",
                  "-o", graph])
        sys.path.insert(0, os.path.dirname(EXPORT_FX))
        import safetensors_io  # noqa: PLC0415
        init = os.path.join(d, "state_dict.safetensors")
        state = dict(model.state_dict())
        del state["emb.weight"]
        safetensors_io.write(init, state)
        _, _, data = util.token_data(d, N, S, V)
        refused = util.run([HAPCTL, "plan", "--graph", graph, "--cluster", CLUSTER,
                            "--pipeline", "2", "--microbatches", "4"], check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("op 'bn' (batch_norm) normalises with the statistics of the whole batch",
                      refused.stderr)
        out, _, launch = train_and_export(d, graph, init, data,
                                          ["--pipeline", "2", "--microbatches", "1"])
        self.assertIn("pipeline: 2 stages, 1 microbatches", launch.stdout)
        trained = read_safetensors(out)
        self.assertEqual(int(trained["bn.num_batches_tracked"]), 5 + STEPS)
        self.assertTrue(torch.equal(trained["head.weight"], trained["emb.weight"]))
        tied.make().load_state_dict(trained, strict=True)


if __name__ == "__main__":
    util.main("weights_roundtrip_test")
