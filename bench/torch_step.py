"""PyTorch side of the training-step benchmark (bench/step_bench.py).

The same zoo model as bench/step_worker.cc, built from the hand-written
mirrors in tests/torch_models.py (ZooMlp, ZooGpt, ZooVit), trained with
torch.optim.SGD(lr=0.01, momentum=0.9) in train mode (dropout on), with the
same command line and protocol as step_worker:

    /usr/bin/python3 bench/torch_step.py --model gpt --threads 1 \
        --layers 2 --hidden 256 ... [--steps 10] [--warmup 2] [--breakdown] \
        [--serve] [--device cuda] [--precision fp32|bf16]

A step's time covers forward, backward, optimizer.step() and
zero_grad(set_to_none=True); making the batch is not timed. --device cuda
(scripts/gpu-check.sh) runs on the GPU: moving the batch there is timed (as
our side loads it into its arena) and the step ends with
torch.cuda.synchronize(). Output: one JSON
line per block, {"seconds": [...], "losses": [...]}. --breakdown (without
--serve) profiles the timed steps and adds the profiler's per-operator table.
--precision bf16 runs forward under torch.autocast(device, torch.bfloat16)
(fp32 parameters and optimizer, as our bf16 plans).
Needs Debian's python3-torch (run with /usr/bin/python3).
"""

import argparse
import json
import os
import sys
import time

import torch

# tests/torch_models.py: beside this file's folder in the source tree; under
# `bazel run`, in the workspace that bazel names.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "tests"))
if os.environ.get("BUILD_WORKSPACE_DIRECTORY"):
    sys.path.insert(0, os.path.join(os.environ["BUILD_WORKSPACE_DIRECTORY"],
                                    "tests"))
import torch_models as M  # noqa: E402

def parse(argv):
    """step_worker's command line: known flags, and --NAME VALUE zoo
    parameters."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt", "vit"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args, rest = ap.parse_known_args(argv)
    if len(rest) % 2:
        ap.error(f"zoo parameters come as --NAME VALUE pairs: {rest}")
    params = {}
    for k, v in zip(rest[::2], rest[1::2]):
        if not k.startswith("--"):
            ap.error(f"unexpected argument {k}")
        params[k[2:]] = float(v)
    return args, params


def build(model, params):
    """The module and a function making step s's batch (global batch,
    single-device shapes as the zoo's graph inputs)."""
    p = {k: (v if k == "dropout" else int(v)) for k, v in params.items()}
    batch = p.pop("batch", 256)
    gen = torch.Generator().manual_seed(1)
    if model == "mlp":
        m = M.ZooMlp(**p)
        d_in, classes = p.get("input", 768), p.get("classes", 10)

        def make():
            return {"x": torch.randn(batch, d_in, generator=gen),
                    "labels": torch.randint(0, classes, (batch,), generator=gen)}
    elif model == "gpt":
        m = M.ZooGpt(**p)
        seq, vocab = p.get("seq", 128), p.get("vocab", 18328)

        def make():
            return {"tokens": torch.randint(0, vocab, (batch, seq), generator=gen),
                    "labels": torch.randint(0, vocab, (batch * seq,),
                                            generator=gen)}
    else:
        m = M.ZooVit(**p)
        image, ch = p.get("image", 32), p.get("channels", 3)
        classes = p.get("classes", 10)

        def make():
            return {"images": torch.randn(batch, ch, image, image, generator=gen),
                    "labels": torch.randint(0, classes, (batch,), generator=gen)}
    return m, make


def run_block(m, opt, make, n, device="cpu", bf16=False):
    seconds, losses = [], []
    cuda = device.startswith("cuda")
    for _ in range(n):
        batch = make()
        t0 = time.perf_counter()
        if cuda:
            batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            loss = m(**batch)
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"seconds": seconds, "losses": losses}


def main():
    args, params = parse(sys.argv[1:])
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    m, make = build(args.model, params)
    m.to(args.device)
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    bf16 = args.precision == "bf16"
    if args.serve:
        for line in sys.stdin:
            print(json.dumps(run_block(m, opt, make, int(line), args.device, bf16)),
                  flush=True)
        return
    run_block(m, opt, make, args.warmup, args.device, bf16)
    if not args.breakdown:
        print(json.dumps(run_block(m, opt, make, args.steps, args.device, bf16)),
              flush=True)
        return
    with torch.autograd.profiler.profile() as prof:
        print(json.dumps(run_block(m, opt, make, args.steps, args.device, bf16)),
              flush=True)
    print(f"PyTorch profiler, totals over {args.steps} steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                    row_limit=25))

if __name__ == "__main__":
    main()
