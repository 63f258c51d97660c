"""The CPU kernels (executor/cpu) against PyTorch: runs kernel_dump (every
op's forward and backward kernel on fixed-seed float32 inputs) and checks
each output against the PyTorch op on the same inputs, and each input
gradient against autograd with the same output gradients. Ops without a
PyTorch equivalent (dropout's counter-based mask, the MoE gate, dispatch and
combine) are checked against small reference implementations written here;
lstm and gru against PyTorch's own one-layer LSTM and GRU (hap_ir_eval.lstm).
"""

import json
import os
import subprocess
import unittest

import torch
import torch.nn.functional as F

import torch_test_util as util
from hap_ir_eval import _op as ir_op

KERNEL_DUMP = os.environ.get("KERNEL_DUMP") or os.path.join(
    util.HERE, "..", "bazel-bin", "executor", "cpu", "kernel_dump")

M64 = (1 << 64) - 1


# --- executor/runtime/random.h, in Python ------------------------------------

def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def counter_key(seed, a, b=0):
    return mix64(mix64(seed ^ mix64(a)) ^ mix64((b + 0x632BE59BD9B4E019) & M64))


def counter_uniform(key, counter):
    return (mix64(key ^ mix64(counter)) >> 11) * (1.0 / 9007199254740992.0)


def dropout_ref(x, attrs, step):
    """x * mask / (1 - p), the mask keyed by each element's global index."""
    p = attrs.get("p", 0.1)
    key = counter_key(attrs.get("rng_key", 0) & M64, step)
    local = list(x.shape)
    glob = attrs.get("global_shape", local)
    offs = attrs.get("offsets", [0] * len(local))
    keep = torch.zeros(x.numel(), dtype=torch.bool)
    for i in range(x.numel()):
        rem, g, stride = i, 0, 1
        for d in reversed(range(len(local))):
            g += (rem % local[d] + offs[d]) * stride
            rem //= local[d]
            stride *= glob[d]
        keep[i] = counter_uniform(key, g) >= p
    return x * keep.reshape(x.shape).to(x.dtype) / (1 - p)


def drop_path_ref(x, attrs, step):
    """Stochastic depth (torchvision.ops.stochastic_depth, mode row): each
    sample kept whole with probability 1 - p, keyed by its global index."""
    p = attrs.get("p", 0.1)
    key = counter_key(attrs.get("rng_key", 0) & M64, step)
    off = attrs.get("offsets", [0] * x.dim())[0]
    keep = torch.tensor([counter_uniform(key, off + m) >= p
                         for m in range(x.shape[0])], dtype=x.dtype)
    return x * keep.reshape([-1] + [1] * (x.dim() - 1)) / (1 - p)


# --- MoE references (GShard, the routing rule of planner/graph/ops_moe.cc) ---

def moe_gate_ref(logits, k, capacity):
    t, e = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = torch.topk(probs, k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
    fill = [0] * e
    rows, experts, slots, picks = [], [], [], []
    for tok in range(t):
        for j in range(k):
            ex = int(top_i[tok, j])
            if fill[ex] < capacity:
                rows.append(tok)
                experts.append(ex)
                slots.append(fill[ex])
                picks.append(weights[tok, j])
                fill[ex] += 1
    combine = torch.zeros(t, e, capacity, dtype=logits.dtype)
    return combine.index_put((torch.tensor(rows), torch.tensor(experts),
                              torch.tensor(slots)), torch.stack(picks))


def moe_dispatch_ref(x, combine):
    return torch.einsum("tec,td->ecd", (combine != 0).to(x.dtype), x)


def moe_combine_ref(y, combine):
    return torch.einsum("tec,ecd->td", combine, y)


# --- the reference of each case ----------------------------------------------

def reference(case, x):
    op, a = case["op"], case["attrs"]
    if op == "dropout":
        return dropout_ref(x[0], a, case["step"])
    if op == "drop_path":
        return drop_path_ref(x[0], a, case["step"])
    if op == "moe_gate":
        return moe_gate_ref(x[0], a.get("k", 2), a["capacity"])
    if op == "moe_dispatch":
        return moe_dispatch_ref(x[0], x[1])
    if op == "moe_combine":
        return moe_combine_ref(x[0], x[1])
    if op in ("nll_loss", "cross_entropy") and "global_rows" in a:
        f = F.nll_loss if op == "nll_loss" else F.cross_entropy
        return f(x[0], x[1], reduction="sum") / a["global_rows"]
    if op in ("add", "sub", "mul"):  # an absent operand is zero
        x = [v if v is not None else torch.zeros((), dtype=torch.float32)
             for v in x]
    if op == "adaptive_avg_pool2d" and len(a["output_size"]) == 1:
        a = dict(a, output_size=a["output_size"] * 2)
    if op in ("linear", "conv2d", "conv3d") and len(x) == 3 and x[2] is None:
        x = x[:2]
    return ir_op(op, x, a)


def to_torch(t):
    if t is None:
        return None
    dtype = torch.float32 if t["dtype"] == "f32" else torch.int64
    return torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])


def load_cases():
    out = os.path.join(util.tmpdir(), "kernels.json")
    # Two threads: the parallel paths of the larger cases run too.
    util.run([KERNEL_DUMP, out, "2"])
    with open(out) as f:
        return json.load(f)["cases"]


CASES = None


def cases():
    global CASES
    if CASES is None:
        CASES = load_cases()
    return CASES


def assert_close(test, got, want, what, rtol=1e-5):
    """|got - want| <= rtol * max|want| (floored at 1e-3) everywhere: float32
    rounding of reductions over at most a few thousand terms, with margin
    (the observed worst case is about 3e-7)."""
    test.assertEqual(tuple(got.shape), tuple(want.shape), what)
    scale = max(float(want.abs().max()), 1e-3)
    err = float((got - want).abs().max())
    if os.environ.get("KERNELS_TORCH_REPORT"):
        print(f"{what}: err/scale {err / scale:.3g}")
    test.assertLessEqual(err, rtol * scale,
                         f"{what}: max abs error {err:g} > {rtol * scale:g}")


class KernelsTorchTest(unittest.TestCase):
    def test_every_op_with_a_torch_equivalent_is_covered(self):
        ops = {c["op"] for c in cases()}
        want = {"linear", "matmul", "add", "sub", "mul", "relu", "gelu",
                "sigmoid", "tanh", "silu", "relu6", "avg_pool2d", "batch_norm",
                "drop_path", "hardsigmoid", "hardswish", "dropout", "scale", "layer_norm",
                "softmax", "log_softmax", "embedding", "transpose",
                "reshape", "flatten", "concat", "split", "slice", "expand",
                "sum", "mean", "nll_loss", "cross_entropy", "conv2d", "conv3d",
                "max_pool2d", "max_pool3d", "avg_pool3d",
                "adaptive_avg_pool2d", "moe_gate", "exp", "rsqrt", "log",
                "moe_dispatch", "moe_combine", "lstm", "gru"}
        self.assertEqual(ops, want)

    def check_case(self, case):
        name = case["name"]
        x = [to_torch(t) for t in case["inputs"]]
        grads = case["grads"]
        for v, g in zip(x, grads):
            if v is not None and g is not None:
                v.requires_grad_(True)
        ref = reference(case, x)
        refs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        outs = [to_torch(t) for t in case["outputs"]]
        self.assertEqual(len(refs), len(outs), name)
        for j, (got, want) in enumerate(zip(outs, refs)):
            assert_close(self, got, want.detach(), f"{name} output {j}")
        diff = [v for v, g in zip(x, grads) if v is not None and g is not None]
        dys = [to_torch(t) for t in case["dys"]]
        want_grads = torch.autograd.grad(refs, diff, grad_outputs=dys,
                                         allow_unused=True)
        k = 0
        for i, (v, g) in enumerate(zip(x, grads)):
            if v is None or g is None:
                continue
            want = want_grads[k]
            k += 1
            if want is None:
                want = torch.zeros_like(v)
            assert_close(self, to_torch(g), want, f"{name} grad of input {i}")


def add_case_tests():
    """One test per dumped case: forward and backward match torch."""
    for case in cases():
        setattr(KernelsTorchTest, f"test_{case['name']}",
                lambda self, c=case: self.check_case(c))


if __name__ == "__main__":
    add_case_tests()
    util.main("kernels_torch_test")
